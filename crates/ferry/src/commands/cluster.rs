//! `ferry cluster up [--nodes N]` / `ferry cluster down`: a local cluster of daemons, each with
//! its own certificate from a fresh cluster CA, all state under one directory. The embedded
//! default behind README's first command.
//!
//! Two kinds of cluster (`--isolation`):
//! - `shared`: every daemon in this machine's namespaces, on loopback addresses (127.0.0.11,
//!   .12, ...): the nodes share one network stack, host name, /tmp and PID space.
//! - `separate`: the first node is this machine itself (its daemon in the root namespaces, so a
//!   program started from a shell here is at home on it); every other node is as separate as
//!   one kernel allows: network, UTS, mount, IPC and PID namespaces of its own
//!   (`ferry __node-init` is its PID 1, see `node_init.rs`), its own address on a bridge of the
//!   cluster's (`cluster_net.rs`), its host name, its own /tmp, /run and /dev/shm. One
//!   directory tree, `--shared`, stands for a network file system: the same on every node.

use super::client::{self, cluster_dir, local_nodes};
use super::cluster_cpu;
use super::cluster_net::Net;
use anyhow::{bail, Context, Result};
use ferry_daemon::Config;
use ferry_transport::{ClusterCa, Msg};
use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(clap::Subcommand)]
pub enum Command {
    /// Start a local cluster of N daemons: a here, the others as separate as one kernel allows.
    Up(UpArgs),
    /// Stop the local cluster: node a's daemon (its guests keep running), and the separate
    /// nodes as machines shut down (whatever runs on them ends); remove their links.
    Down(DirArg),
    /// Make a new cluster CA (ca.pem, ca.key) in DIR, for a cluster of real machines.
    Ca(CaArgs),
    /// Issue the certificate of node NAME (NAME.pem, NAME.key) from the CA in DIR.
    Issue(IssueArgs),
    /// Revoke the certificate of node NAME (DIR/NAME.pem): add it to DIR/revoked, the
    /// revocation list, which every node must then have at its config's `revoked` path.
    Revoke(IssueArgs),
}

#[derive(clap::Args)]
pub struct CaArgs {
    #[arg(long)]
    pub dir: PathBuf,
    /// A name for the cluster, written into the CA certificate.
    #[arg(long, default_value = "ferry")]
    pub name: String,
}

#[derive(clap::Args)]
pub struct IssueArgs {
    pub node: String,
    #[arg(long)]
    pub dir: PathBuf,
}

#[derive(clap::Args)]
pub struct UpArgs {
    #[arg(long, default_value_t = 3)]
    pub nodes: usize,
    /// Where the cluster keeps its state [default: $FERRY_CLUSTER_DIR or /run/ferry/cluster].
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// TCP port every node listens on (each on its own address).
    #[arg(long, default_value_t = 7070)]
    pub port: u16,
    /// First loopback address; node i gets this plus i (`--isolation shared` only).
    #[arg(long, default_value = "127.0.0.11")]
    pub first_addr: Ipv4Addr,
    /// How separate the nodes are: `separate` (every node but the first in namespaces of its
    /// own, like a machine) or `shared` (all daemons in this machine's namespaces).
    #[arg(long, value_enum, default_value_t = Isolation::Separate)]
    pub isolation: Isolation,
    /// The directory tree that is the same on every node (a network file system's stand-in)
    /// [default with `--isolation separate`: DIR/shared].
    #[arg(long)]
    pub shared: Option<PathBuf>,
    /// Hold each node (its daemon and everything it runs: remote runs, guests) to FRACTION
    /// of one CPU (cgroup v1 `cpu.cfs_quota_us`), so that e.g. 4 nodes of 0.5 share 2 cores
    /// as 4 slow machines.
    #[arg(long, value_name = "FRACTION")]
    pub cpu_quota: Option<f64>,
    /// Seconds a migration's image stream may stall before the migration fails and the
    /// process runs on at its source (each node's `stream_stall_secs`) [default: 30].
    #[arg(long, value_name = "SECS")]
    pub stream_stall: Option<f64>,
    /// `--memory auto` moves a tree lazily when an eager move to a node would freeze it at
    /// least this long, at the speed memory last moved there (each node's `lazy_above_ms`)
    /// [default: 1000].
    #[arg(long, value_name = "MS")]
    pub lazy_above_ms: Option<f64>,
    /// Send migrations' streams between the nodes as they are, never compressed (each node's
    /// `compress = false`; for measuring what compression saves).
    #[arg(long)]
    pub no_compress: bool,
    /// Let migrations' streams between the nodes go LZ4-compressed where that pays (each
    /// node's `compress = true`; off by default).
    #[arg(long, conflicts_with = "no_compress")]
    pub compress: bool,
    /// Each node's control socket mode (`control_mode`, octal: "0666" lets every local user
    /// use Ferry for their own processes) [default: 0600, root only].
    #[arg(long, value_name = "MODE")]
    pub control_mode: Option<String>,
    /// Each node's control socket group (`control_group`: a name or a number).
    #[arg(long, value_name = "GROUP")]
    pub control_group: Option<String>,
    /// Confine guests (each node's `confine_guests`), the default: a tree away from its home
    /// sees only the system's files, read-only, and the shared tree of the node it runs on, so
    /// a tree whose working directory lies outside the shared tree stays home (its move is
    /// refused, naming the directory).
    #[arg(long, conflicts_with = "no_confine_guests")]
    pub confine_guests: bool,
    /// Let guests see their node's whole file system (each node's `confine_guests = false`):
    /// for programs run from directories outside the shared tree, on a machine whose users
    /// all trust each other.
    #[arg(long)]
    pub no_confine_guests: bool,
    /// Give programs run on a node for another (`ferry run`, `ferry make`'s recipes) a network
    /// of their own, a loopback only (each node's `confine_network`; with confined guests).
    #[arg(long, conflicts_with = "no_confine_guests")]
    pub confine_network: bool,
    /// Seconds a node must stay declared down, and silent, before the others act on its death
    /// (each node's `dead_after_secs`) [default: 6].
    #[arg(long, value_name = "SECS")]
    pub dead_after: Option<f64>,
    /// Seconds between two images of each tree that left its home, kept at home to rebuild it
    /// should its node die (each node's `checkpoint_every_secs`) [default: none].
    #[arg(long, value_name = "SECS")]
    pub checkpoint_every: Option<f64>,
    /// Where a tree whose body's node died is rebuilt from its last image (each node's
    /// `recover_on`): idlest (the idlest other live node that accepts guests, else home), home,
    /// or a node's name [default: idlest].
    #[arg(long, value_name = "WHERE")]
    pub recover_on: Option<String>,
}

#[derive(
    Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Isolation {
    Shared,
    Separate,
}

/// What `cluster down` needs besides the nodes' directories: `DIR/cluster.json`.
#[derive(serde::Serialize, serde::Deserialize)]
struct State {
    isolation: Isolation,
    net: Option<Net>,
    /// The cluster's cgroup in the `cpu` hierarchy (`--cpu-quota`), removed by `down`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    cpu_cgroup: Option<PathBuf>,
}

const STATE: &str = "cluster.json";

#[derive(clap::Args)]
pub struct DirArg {
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

pub fn run(c: Command) -> Result<()> {
    match c {
        Command::Up(a) => up(a),
        Command::Down(a) => down(&absolute(cluster_dir(a.dir.as_deref()))),
        Command::Ca(a) => {
            if a.dir.join("ca.key").exists() {
                bail!(
                    "{} already holds a CA; refusing to replace it",
                    a.dir.display()
                );
            }
            std::fs::create_dir_all(&a.dir)
                .with_context(|| format!("create {}", a.dir.display()))?;
            ClusterCa::generate(&a.name)?.save(&a.dir)?;
            println!("cluster CA written to {}", a.dir.join("ca.pem").display());
            Ok(())
        }
        Command::Issue(a) => {
            let ca = ClusterCa::load(&a.dir)?;
            let p = ca.issue_node_files(&a.node, &a.dir)?;
            println!(
                "[credentials]\nca_cert = {:?}\ncert = {:?}\nkey = {:?}",
                p.ca_cert, p.cert, p.key
            );
            Ok(())
        }
        Command::Revoke(a) => revoke(&a.node, &a.dir),
    }
}

/// The revocation list `ferry cluster up` and `ferry cluster revoke` keep beside the
/// certificates.
pub const REVOKED_FILE: &str = "revoked";

const REVOKED_HEADER: &str = "# Ferry revocation list: certificates every node refuses, one per \
line, by the SHA-256 of its DER encoding (docs/security.md).\n";

fn revoke(node: &str, dir: &Path) -> Result<()> {
    ferry_transport::credentials::check_node_name(node)?;
    let cert = dir.join(format!("{node}.pem"));
    let fp = ferry_transport::revocation::fingerprint_pem_file(&cert)?;
    let list_path = dir.join(REVOKED_FILE);
    let old = match std::fs::read_to_string(&list_path) {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => REVOKED_HEADER.to_string(),
        Err(e) => return Err(e).with_context(|| format!("read {}", list_path.display())),
    };
    let list = ferry_transport::RevocationList::parse(&old)
        .with_context(|| format!("parse {}", list_path.display()))?;
    if list.contains(&fp) {
        println!(
            "the certificate of {node} ({fp}) is already in {}",
            list_path.display()
        );
        return Ok(());
    }
    let when = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let mut new = old;
    if !new.is_empty() && !new.ends_with('\n') {
        new.push('\n');
    }
    new.push_str(&format!("{fp}  {node}  revoked-at-unix {when}\n"));
    // Whole or not at all: daemons reload the file when it changes.
    let tmp = dir.join(format!(".{REVOKED_FILE}.tmp"));
    std::fs::write(&tmp, &new).with_context(|| format!("write {}", tmp.display()))?;
    std::fs::rename(&tmp, &list_path)
        .with_context(|| format!("replace {}", list_path.display()))?;
    println!(
        "revoked the certificate of {node} ({fp}) in {}; every node whose config names this \
         list (`revoked = ...`) refuses it within a second or on SIGHUP (copy the file to \
         nodes that keep their own)",
        list_path.display()
    );
    Ok(())
}

/// Node names: a, b, c, ... z, then n26, n27...
pub fn node_name(i: usize) -> String {
    if i < 26 {
        ((b'a' + i as u8) as char).to_string()
    } else {
        format!("n{i}")
    }
}

fn up(a: UpArgs) -> Result<()> {
    if a.nodes == 0 || a.nodes > 200 {
        bail!("--nodes must be between 1 and 200");
    }
    let dir = absolute(cluster_dir(a.dir.as_deref()));
    if local_nodes(&dir).iter().any(|n| {
        running_pid(&dir.join(n))
            .or_else(|| running_init(&dir.join(n)))
            .is_some()
    }) {
        bail!(
            "a local cluster is already running in {} (stop it with `ferry cluster down`)",
            dir.display()
        );
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    // Half a cluster is taken down again: nothing of it stays behind.
    let started = start(&a, &dir);
    if started.is_err() {
        let _ = stop(&dir);
    }
    started
}

fn start(a: &UpArgs, dir: &Path) -> Result<()> {
    let quota = match a.cpu_quota {
        Some(f) => {
            let quota_us = cluster_cpu::check_fraction(f)?;
            let cg = cluster_cpu::cluster_cgroup(&cluster_cpu::cpu_hierarchy()?, dir);
            Some((cg, quota_us))
        }
        None => None,
    };
    let shared = match (&a.shared, a.isolation) {
        (Some(p), _) => Some(p.clone()),
        (None, Isolation::Separate) => Some(dir.join("shared")),
        (None, Isolation::Shared) => None,
    };
    let shared = match shared {
        Some(p) => {
            std::fs::create_dir_all(&p).with_context(|| format!("create {}", p.display()))?;
            Some(
                p.canonicalize()
                    .with_context(|| format!("find {}", p.display()))?,
            )
        }
        None => None,
    };
    let certs = dir.join("certs");
    std::fs::create_dir_all(&certs)?;
    let ca = ClusterCa::generate(&dir.display().to_string())?;
    ca.save(&certs)?;
    let revoked = certs.join(REVOKED_FILE);
    std::fs::write(&revoked, REVOKED_HEADER)
        .with_context(|| format!("write {}", revoked.display()))?;
    let names: Vec<String> = (0..a.nodes).map(node_name).collect();
    let net = match a.isolation {
        Isolation::Separate => Some(Net::create()?),
        Isolation::Shared => None,
    };
    let state = State {
        isolation: a.isolation,
        net,
        cpu_cgroup: quota.as_ref().map(|(cg, _)| cg.clone()),
    };
    std::fs::write(dir.join(STATE), serde_json::to_vec_pretty(&state)?)
        .with_context(|| format!("write {}", dir.join(STATE).display()))?;
    let addr = |i: usize| -> Result<SocketAddr> {
        if let Some(net) = &net {
            return Ok(SocketAddr::from((net.addr(i), a.port)));
        }
        let base = u32::from(a.first_addr);
        let ip = Ipv4Addr::from(base + i as u32);
        if ip.octets()[0] != 127 {
            bail!("{ip} is not a loopback address");
        }
        Ok(SocketAddr::from((ip, a.port)))
    };
    let exe = std::env::current_exe().context("find the ferry binary")?;
    if let Some((cg, _)) = &quota {
        std::fs::create_dir_all(cg).with_context(|| format!("make cgroup {}", cg.display()))?;
        cluster_cpu::weigh_cluster(cg, names.len())?;
    }
    for (i, name) in names.iter().enumerate() {
        let data_dir = dir.join(name);
        std::fs::create_dir_all(&data_dir)?;
        for stale in ["daemon.pid", "init.pid"] {
            let _ = std::fs::remove_file(data_dir.join(stale));
        }
        let config = Config {
            name: name.clone(),
            listen: addr(i)?,
            data_dir: data_dir.clone(),
            accept_guests: true,
            // Everyone joins through the first node; the first knows the second, should it
            // restart alone.
            peers: if i == 0 {
                if a.nodes > 1 {
                    vec![addr(1)?]
                } else {
                    vec![]
                }
            } else {
                vec![addr(0)?]
            },
            revoked: Some(revoked.clone()),
            shared: shared.clone(),
            cpu_cgroup: match &quota {
                Some((cg, quota_us)) => Some(cluster_cpu::make_node_cgroup(cg, name, *quota_us)?),
                None => None,
            },
            // The default: loopback (each shared node on its own address), port + 1.
            web: None,
            balance: Default::default(),
            stream_stall_secs: a.stream_stall,
            lazy_above_ms: a.lazy_above_ms,
            compress: if a.compress {
                Some(true)
            } else {
                a.no_compress.then_some(false)
            },
            control_mode: a.control_mode.clone(),
            control_group: a.control_group.clone(),
            confine_guests: Some(!a.no_confine_guests),
            confine_network: a.confine_network.then_some(true),
            dead_after_secs: a.dead_after,
            checkpoint_every_secs: a.checkpoint_every,
            recover_on: a.recover_on.clone(),
            credentials: ca.issue_node_files(name, &certs)?,
            // The nodes share this machine's terminals: none watches them unless told.
            owner: ferry_daemon::hosts::OwnerConfig {
                input_watch: Some(vec![]),
                ..Default::default()
            },
        };
        let cfg_path = data_dir.join("ferry.toml");
        std::fs::write(&cfg_path, config.to_toml()?)
            .with_context(|| format!("write {}", cfg_path.display()))?;
        match &net {
            Some(net) if i > 0 => start_node(&exe, &cfg_path, &data_dir, name, net, i)?,
            _ => start_daemon(&exe, &cfg_path, &data_dir)?,
        }
    }
    // Ready when every daemon answers and sees all the others.
    let rt = client::runtime()?;
    let deadline = Instant::now() + Duration::from_secs(20);
    for name in &names {
        loop {
            let sock = ferry_daemon::config::control_socket(&dir.join(name));
            let seen = rt.block_on(async {
                let mut s = tokio::net::UnixStream::connect(&sock).await.ok()?;
                ferry_transport::write_msg(&mut s, &Msg::ListNodes)
                    .await
                    .ok()?;
                match ferry_transport::read_msg(&mut s).await.ok()? {
                    Msg::Nodes(n) => Some(n.iter().filter(|n| n.load.is_some()).count()),
                    _ => None,
                }
            });
            if seen == Some(names.len()) {
                break;
            }
            if Instant::now() > deadline {
                let log = dir.join(name).join("daemon.log");
                bail!(
                    "node {name} did not join the cluster within 20 s (sees {:?} of {} nodes); \
                     its log: {}",
                    seen,
                    names.len(),
                    log.display()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    println!(
        "local cluster of {} nodes up in {} ({} nodes{}{})",
        names.len(),
        dir.display(),
        match a.isolation {
            Isolation::Shared => "shared",
            Isolation::Separate => "separate",
        },
        shared
            .as_ref()
            .map(|s| format!(", shared tree {}", s.display()))
            .unwrap_or_default(),
        quota
            .as_ref()
            .map(|(cg, q)| format!(
                ", each held to {:.2} CPU by {}/NODE",
                *q as f64 / cluster_cpu::PERIOD_US as f64,
                cg.display()
            ))
            .unwrap_or_default()
    );
    for (i, name) in names.iter().enumerate() {
        // The node's page and metrics, where this machine's namespace reaches them (a separate
        // node's loopback is its own).
        let page = (i == 0 || a.isolation == Isolation::Shared)
            .then(|| Config::load(&dir.join(name).join("ferry.toml")).ok())
            .flatten()
            .and_then(|c| c.web_addr().ok().flatten())
            .map(|(w, _)| format!("  page http://{w}/"))
            .unwrap_or_default();
        println!(
            "  {name}  {}  log {}{page}",
            addr(i)?,
            dir.join(name).join("daemon.log").display()
        );
    }
    Ok(())
}

/// Starts node `name` (the `i`th) in namespaces of its own: its init first, then its link on
/// the bridge, then the go that lets the init configure the link and start the daemon.
fn start_node(
    exe: &Path,
    cfg: &Path,
    data_dir: &Path,
    name: &str,
    net: &Net,
    i: usize,
) -> Result<()> {
    use std::os::fd::AsRawFd;
    let (go_r, go_w) = ferry_sys::fdops::pipe2(libc::O_CLOEXEC).context("make the go pipe")?;
    let go_r = ferry_sys::ns::dup_at_least(go_r, 3).context("make the go pipe")?;
    let args: Vec<String> = vec![
        "__node-init".into(),
        "--config".into(),
        cfg.display().to_string(),
        "--hostname".into(),
        name.into(),
        "--address".into(),
        format!("{}/24", net.addr(i)),
        "--go-fd".into(),
        go_r.as_raw_fd().to_string(),
    ];
    let mut args = args;
    for name in super::node_init::NET_SYSCTLS {
        if let Ok(v) = std::fs::read_to_string(Path::new("/proc/sys/net").join(name)) {
            args.push("--net-sysctl".into());
            args.push(format!("{name}={}", v.trim()));
        }
    }
    let init = ferry_sys::ns::spawn_node_init(exe, &args, go_r.as_raw_fd())
        .with_context(|| format!("make the namespaces of node {name}"))?;
    drop(go_r);
    std::fs::write(data_dir.join("init.pid"), init.to_string())?;
    net.attach(name, init)
        .with_context(|| format!("link node {name} to bridge {}", net.bridge()))?;
    ferry_sys::fdops::write_fd(go_w.as_raw_fd(), b"1").context("tell the node init to go")?;
    drop(go_w);
    // The daemon is the init's child; its PID here is what `daemon.pid` holds.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(pid) = children_of(init)
            .into_iter()
            .find(|p| cmdline_has(*p, b"daemon"))
        {
            std::fs::write(data_dir.join("daemon.pid"), pid.to_string())?;
            return Ok(());
        }
        if running_init(data_dir).is_none() || Instant::now() > deadline {
            bail!(
                "node {name} did not start its daemon; its log: {}",
                data_dir.join("daemon.log").display()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The processes whose parent is `pid`.
fn children_of(pid: i32) -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/stat"))
                .ok()
                .and_then(|s| {
                    s.rsplit_once(')')?
                        .1
                        .split_whitespace()
                        .nth(1)?
                        .parse::<i32>()
                        .ok()
                })
                == Some(pid)
        })
        .collect()
}

fn cmdline_has(pid: i32, arg: &[u8]) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .is_ok_and(|c| c.split(|b| *b == 0).any(|a| a == arg))
}

fn start_daemon(exe: &Path, cfg: &Path, data_dir: &Path) -> Result<()> {
    use std::os::unix::process::CommandExt;
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(data_dir.join("daemon.log"))
        .context("open daemon.log")?;
    let child = std::process::Command::new(exe)
        .arg("daemon")
        .arg("--config")
        .arg(cfg)
        .stdin(std::process::Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        // Its own session: the daemon outlives this command and its terminal.
        .process_group(0)
        .spawn()
        .with_context(|| format!("start the daemon for {}", cfg.display()))?;
    std::fs::write(data_dir.join("daemon.pid"), child.id().to_string())?;
    Ok(())
}

/// `dir` made absolute (not resolved): the daemons' command lines name their configs by it.
fn absolute(dir: PathBuf) -> PathBuf {
    std::path::absolute(&dir).unwrap_or(dir)
}

/// The PID in `data_dir/file` if it is a live (not zombie) process whose command line has
/// `arg` and this node's config (a PID reused by anything else, another cluster's daemon
/// included, is not ours to stop).
fn live_pid(data_dir: &Path, file: &str, arg: &[u8]) -> Option<i32> {
    let pid: i32 = std::fs::read_to_string(data_dir.join(file))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let zombie = stat
        .rsplit(')')
        .next()
        .is_some_and(|s| s.trim_start().starts_with('Z'));
    let config = data_dir.join("ferry.toml");
    (!zombie && cmdline_has(pid, arg) && cmdline_has(pid, config.as_os_str().as_bytes()))
        .then_some(pid)
}

/// The daemon of the node whose data directory this is, if it runs.
fn running_pid(data_dir: &Path) -> Option<i32> {
    live_pid(data_dir, "daemon.pid", b"daemon")
}

/// The init of a separate node, if it runs.
fn running_init(data_dir: &Path) -> Option<i32> {
    live_pid(data_dir, "init.pid", b"__node-init")
}

fn down(dir: &Path) -> Result<()> {
    let names = local_nodes(dir);
    if names.is_empty() {
        bail!("no local cluster in {}", dir.display());
    }
    let (stopped, total) = stop(dir)?;
    println!("stopped {stopped} of {total} nodes in {}", dir.display());
    Ok(())
}

/// SIGTERM to the deputies' workers a node's daemon recorded in `data/state` (each checked
/// against its start time), which then kill their deputies and end.
fn give_up_deputies(data: &Path) {
    let Ok(dir) = std::fs::read_dir(data.join("state")) else {
        return;
    };
    for e in dir.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !(name.starts_with("deputy-") && name.ends_with(".json")) {
            continue;
        }
        let Some(r) = std::fs::read(e.path())
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        else {
            continue;
        };
        let (Some(pid), Some(start)) = (r["worker_pid"].as_i64(), r["worker_start"].as_u64())
        else {
            continue;
        };
        let pid = pid as i32;
        if ferry_daemon::state::start_time(pid) == Some(start) {
            ferry_sys::ptrace::kill(pid, libc::SIGTERM).ok();
        }
    }
}

/// Stops every node: the first's daemon (its guests keep running: they are this machine's),
/// and each separate node as a machine is shut down (its init passes SIGTERM to its daemon,
/// then exits, and whatever still ran on the node ends with it); then removes the cluster's
/// links. Returns how many nodes were running, and how many there are.
fn stop(dir: &Path) -> Result<(usize, usize)> {
    let names = local_nodes(dir);
    let mut stopping = Vec::new();
    for n in &names {
        let d = dir.join(n);
        if let Some(pid) = running_init(&d).or_else(|| running_pid(&d)) {
            ferry_sys::ptrace::kill(pid, libc::SIGTERM).ok();
            stopping.push((n.clone(), pid));
        }
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    for (n, pid) in &stopping {
        let d = dir.join(n);
        while running_init(&d).or_else(|| running_pid(&d)) == Some(*pid) {
            if Instant::now() > deadline {
                eprintln!("ferry: node {n} (PID {pid}) ignored SIGTERM; killing it");
                ferry_sys::ptrace::kill(*pid, libc::SIGKILL).ok();
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    for n in &names {
        for f in ["daemon.pid", "init.pid"] {
            let _ = std::fs::remove_file(dir.join(n).join(f));
        }
        // The deputies a stopped daemon leaves wait for its successor (their worker outlives
        // it); the cluster is going: their home gives them up (SIGTERM to their worker).
        give_up_deputies(&dir.join(n));
    }
    let state: Option<State> = std::fs::read(dir.join(STATE))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    if let Some(cg) = state.as_ref().and_then(|s| s.cpu_cgroup.as_ref()) {
        cluster_cpu::remove(cg)?;
    }
    if let Some(net) = state.and_then(|s| s.net) {
        net.remove(&names)
            .with_context(|| format!("remove the links of the cluster in {}", dir.display()))?;
    }
    let _ = std::fs::remove_file(dir.join(STATE));
    Ok((stopping.len(), names.len()))
}
