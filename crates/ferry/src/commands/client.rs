//! How the CLI finds and talks to the daemon of "here": the machine's own daemon, or, where a
//! local cluster runs several on one machine, the one `--node`/FERRY_NODE names.

use anyhow::{bail, Context, Result};
use ferry_transport::{read_msg, write_msg, Msg};
use std::path::{Path, PathBuf};
use tokio::net::UnixStream;

/// Where `ferry cluster up` keeps its nodes unless told otherwise.
pub const DEFAULT_CLUSTER_DIR: &str = "/run/ferry/cluster";
/// The config file of a machine's own daemon.
pub const SYSTEM_CONFIG: &str = "/etc/ferry/ferry.toml";

pub fn cluster_dir(arg: Option<&Path>) -> PathBuf {
    arg.map(Path::to_path_buf)
        .or_else(|| std::env::var_os("FERRY_CLUSTER_DIR").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(DEFAULT_CLUSTER_DIR))
}

/// The names of a local cluster's nodes, in order.
pub fn local_nodes(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .filter(|e| e.path().join("ferry.toml").exists())
                .filter_map(|e| e.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// The control socket of the daemon that is "here".
pub fn daemon_socket(node: Option<&str>) -> Result<PathBuf> {
    if let Some(s) = std::env::var_os("FERRY_SOCKET") {
        return Ok(PathBuf::from(s));
    }
    let dir = cluster_dir(None);
    // Most machines of a local cluster have no system config: not even an error is made then
    // (with RUST_BACKTRACE set, each error captures a backtrace, a cost on every command).
    let system = Path::new(SYSTEM_CONFIG)
        .exists()
        .then(|| ferry_daemon::Config::load(Path::new(SYSTEM_CONFIG)).ok())
        .flatten();
    match node {
        Some(n) => {
            let p = ferry_daemon::config::control_socket(&dir.join(n));
            if p.exists() {
                return Ok(p);
            }
            if let Some(c) = system.filter(|c| c.name == n) {
                return Ok(c.control_socket());
            }
            bail!(
                "no daemon for node {n:?} on this machine (looked in {} and {SYSTEM_CONFIG})",
                dir.display()
            )
        }
        None => {
            if let Some(c) = system {
                return Ok(c.control_socket());
            }
            if let Some(first) = local_nodes(&dir).first() {
                return Ok(ferry_daemon::config::control_socket(&dir.join(first)));
            }
            bail!(
                "no Ferry daemon on this machine: start one with `ferry daemon --config FILE`, \
                 or a local cluster with `ferry cluster up`"
            )
        }
    }
}

pub async fn connect(node: Option<&str>) -> Result<UnixStream> {
    let path = daemon_socket(node)?;
    UnixStream::connect(&path).await.with_context(|| {
        format!(
            "reach the ferry daemon at {} (is it running?)",
            path.display()
        )
    })
}

/// One request, one answer; an `Error` answer becomes an error.
pub async fn ask(node: Option<&str>, request: &Msg) -> Result<Msg> {
    let mut s = connect(node).await?;
    write_msg(&mut s, request).await?;
    match read_msg(&mut s).await.context("read the daemon's answer")? {
        Msg::Error { message } => bail!("{message}"),
        m => Ok(m),
    }
}

pub fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("start the async runtime")
}
