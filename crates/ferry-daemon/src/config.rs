//! The daemon's configuration file (TOML).
//!
//! ```toml
//! name = "a"
//! listen = "127.0.0.1:7070"
//! data_dir = "/var/lib/ferry"
//! accept_guests = true
//! peers = ["127.0.0.2:7070"]
//! shared = "/srv/shared"
//! [credentials]
//! ca_cert = "/etc/ferry/ca.pem"
//! cert = "/etc/ferry/a.pem"
//! key = "/etc/ferry/a.key"
//! ```
//!
//! and, optionally, at the top level, `revoked = "/etc/ferry/revoked"`: the revocation list,
//! `web = "127.0.0.1:7071"` (or `"off"`): where the daemon serves its page and metrics
//! (crate::web), and an `[owner]` table (who may use this machine, crate::hosts::OwnerConfig):
//!
//! ```toml
//! [owner]
//! accept = "idle"            # always | idle | never (default: accept_guests, true = always)
//! load_below = 1.0           # idle: the one-minute load average below this...
//! input_idle_secs = 30       # ...and no input for this long
//! input_watch = ["/dev/input", "/dev/pts"]  # devices and terminals whose use is input
//! ```
//!
//! `confine_guests = false` (default true) lets guests see this node's whole file system
//! (docs/security.md, "Guests are confined"); `confine_network = true` (default false) gives
//! programs run here for other nodes a network of their own, a loopback only; `control_mode = "0660"` and `control_group =
//! "ferry"` open the control socket to users (default 0600, root only).
//!
//! and a `[balance]` table (automatic load balancing: `ferry_policy::balance::BalanceConfig`,
//! e.g. `algorithm = "cpu"`, `allow = ["make"]`, `min_stay_secs = 30`).

use anyhow::{Context, Result};
use ferry_policy::balance::BalanceConfig;
use ferry_transport::CredentialPaths;
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// This node's name; must be the common name of its certificate.
    pub name: String,
    /// Where peers reach this node (TCP, mutual TLS): migration, remote execution and gossip.
    pub listen: SocketAddr,
    /// Holds the CLI's control socket (`ferry.sock`) and the daemon's pid file.
    pub data_dir: PathBuf,
    #[serde(default = "yes")]
    pub accept_guests: bool,
    /// Nodes to join through; any one alive is enough.
    #[serde(default)]
    pub peers: Vec<SocketAddr>,
    /// The revocation list (docs/security.md): certificates, by fingerprint, that this node
    /// refuses. Reloaded when it changes and on SIGHUP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revoked: Option<PathBuf>,
    /// The directory tree that is the same on every node of the cluster (a network file
    /// system; on a local cluster, one directory bound at the same path into every node).
    /// Everything else on a node is its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared: Option<PathBuf>,
    /// A cgroup (a directory of the cgroup v1 `cpu` hierarchy) the daemon joins as it starts,
    /// with everything it starts: remote runs, workers, and the guests it rebuilds, which
    /// join it instead of the CPU cgroup their image names. Its `cpu.cfs_quota_us` is the
    /// node's share of the machine (`ferry cluster up --cpu-quota`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_cgroup: Option<PathBuf>,
    /// The read-only page and metrics (crate::web): `"off"`, or ADDR:PORT. Absent: on
    /// loopback, the listen port + 1 (see [`Config::web_addr`]). An address that is not
    /// loopback is served only over the cluster's mutual TLS (docs/security.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub web: Option<String>,
    /// Automatic load balancing (`ferry_policy::balance::BalanceConfig`): `[balance]`.
    #[serde(default, skip_serializing_if = "is_default_balance")]
    pub balance: BalanceConfig,
    /// Seconds a migration's image stream may make no progress (no frame read by the
    /// destination, no frame taken by the link at the source) before the migration fails,
    /// before its commit point: the process runs on at the source. Absent: 30.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_stall_secs: Option<f64>,
    /// `--memory auto` moves a tree lazily when an eager move would keep it frozen at least
    /// this long: its memory (64 MiB or more) at the speed memory last moved to that node (no
    /// earlier move there: never lazily). Absent: 1000.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lazy_above_ms: Option<f64>,
    /// Whether a migration's stream between this node and another may go in compressed
    /// frames (LZ4, each frame only where that saves an eighth of it), if both say so: this
    /// node offers it when sending and takes it when receiving. Absent: false (on this
    /// project's machine, a CPU-bound loopback, it lengthened the freeze: docs/benchmarks.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compress: Option<bool>,
    /// Seconds a node must stay declared down by the membership, and unreachable, before this
    /// node acts on its death (a deputy ends, a held copy runs, an undecided migration is
    /// settled without it). A verdict alone may be false: a daemon starved of CPU for a few
    /// seconds is declared down while its processes run on. Absent: 6.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dead_after_secs: Option<f64>,
    /// Seconds between two images of each tree that left this home, kept here to rebuild it
    /// from should the node running it die (crate::recovery). Absent: none taken.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_every_secs: Option<f64>,
    /// Where a tree is rebuilt from its last image when the node running its body dies
    /// (crate::recovery): `"idlest"`, the idlest other live node that accepts guests, or this
    /// home if there is none; `"home"`, always here; or a node's name, that node if it is live,
    /// else here. A rebuild elsewhere that fails is done here. Absent: "idlest".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recover_on: Option<String>,
    pub credentials: CredentialPaths,
    /// Whether a guest (a body: a tree whose home is another node) sees only the shared tree
    /// and the system's files, read-only, of this node (docs/security.md, "Guests are
    /// confined"). Absent: true.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confine_guests: Option<bool>,
    /// Whether a program run here for another node (`ferry run`, `ferry make`'s recipes) on a
    /// node that confines guests gets a network of its own with nothing but a loopback
    /// (docs/security.md, "Guests are confined"). Absent: false (it uses this node's network).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confine_network: Option<bool>,
    /// The control socket's mode, in octal ("0660": its group may use the daemon; "0666":
    /// every local user may). Absent: "0600", root only. Whoever reaches the socket is served
    /// as who they are (docs/security.md, "Users who are not root").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_mode: Option<String>,
    /// The control socket's group (a name in /etc/group, or a number). Absent: root's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_group: Option<String>,
    /// Who may use this machine (crate::hosts::OwnerConfig): `[owner]` in the file. Reloaded
    /// on SIGHUP.
    #[serde(default, skip_serializing_if = "crate::hosts::OwnerConfig::is_default")]
    pub owner: crate::hosts::OwnerConfig,
}

fn is_default_balance(b: &BalanceConfig) -> bool {
    *b == BalanceConfig::default()
}

fn yes() -> bool {
    true
}

/// A checkpoint interval in seconds as a duration (0 or less: none; at least 0.1 s).
pub fn interval(secs: Option<f64>) -> Option<std::time::Duration> {
    secs.filter(|s| *s > 0.0)
        .map(|s| std::time::Duration::from_secs_f64(s.clamp(0.1, 1e6)))
}

impl Config {
    /// How often a tree that left is checkpointed ([`Config::checkpoint_every_secs`]).
    pub fn checkpoint_every(&self) -> Option<std::time::Duration> {
        interval(self.checkpoint_every_secs)
    }

    /// How long a death verdict must stand before it is acted on ([`Config::dead_after_secs`]).
    pub fn dead_after(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.dead_after_secs.unwrap_or(6.0).clamp(0.0, 1e6))
    }

    /// How long a migration's image stream may stall ([`Config::stream_stall_secs`]).
    pub fn compress(&self) -> bool {
        self.compress.unwrap_or(false)
    }

    pub fn stream_stall(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.stream_stall_secs.unwrap_or(30.0).clamp(0.1, 1e6))
    }

    pub fn load(path: &Path) -> Result<Config> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("read config {}", path.display()))?;
        Config::parse(&text).with_context(|| format!("config {}", path.display()))
    }

    /// The configuration in `text`, checked (the node's name must be one a certificate can
    /// carry).
    pub fn parse(text: &str) -> Result<Config> {
        let c: Config = toml::from_str(text).context("parse")?;
        ferry_transport::credentials::check_node_name(&c.name)?;
        c.web_addr()?;
        c.balance.check().map_err(|e| anyhow::anyhow!(e))?;
        c.control_mode()?;
        Ok(c)
    }

    pub fn to_toml(&self) -> Result<String> {
        Ok(toml::to_string(self)?)
    }

    /// Where the page and metrics are served (None: `web = "off"`), and whether that address
    /// was configured (else it is the default). The default is loopback: the listen address if
    /// it is a loopback one (each node of a local cluster has its own), else 127.0.0.1; at the
    /// listen port + 1.
    pub fn web_addr(&self) -> Result<Option<(SocketAddr, bool)>> {
        match self.web.as_deref() {
            Some("off") => Ok(None),
            Some(a) => a
                .parse()
                .map(|a| Some((a, true)))
                .with_context(|| format!("web = {a:?}: \"off\" or ADDRESS:PORT")),
            None => {
                let ip = if self.listen.ip().is_loopback() {
                    self.listen.ip()
                } else {
                    std::net::Ipv4Addr::LOCALHOST.into()
                };
                let port = self
                    .listen
                    .port()
                    .checked_add(1)
                    .unwrap_or(self.listen.port() - 1);
                Ok(Some((SocketAddr::new(ip, port), false)))
            }
        }
    }

    pub fn control_socket(&self) -> PathBuf {
        control_socket(&self.data_dir)
    }

    /// The control socket's mode ([`Config::control_mode`]; 0600 when absent).
    pub fn control_mode(&self) -> Result<u32> {
        match self.control_mode.as_deref() {
            None => Ok(0o600),
            Some(m) => u32::from_str_radix(m, 8)
                .ok()
                .filter(|m| *m <= 0o777 && m & 0o600 == 0o600)
                .with_context(|| {
                    format!("control_mode = {m:?}: octal permission bits with 0600, as \"0660\"")
                }),
        }
    }

    /// The control socket's group ([`Config::control_group`]), a number or a name looked up
    /// in /etc/group.
    pub fn control_gid(&self) -> Result<Option<u32>> {
        let Some(g) = self.control_group.as_deref() else {
            return Ok(None);
        };
        if let Ok(n) = g.parse() {
            return Ok(Some(n));
        }
        let groups = std::fs::read_to_string("/etc/group").context("read /etc/group")?;
        groups
            .lines()
            .find_map(|l| {
                let mut f = l.split(':');
                (f.next() == Some(g)).then(|| f.nth(1)?.parse().ok())?
            })
            .map(Some)
            .with_context(|| format!("control_group = {g:?}: no such group in /etc/group"))
    }
}

/// The CLI finds its daemon here.
pub fn control_socket(data_dir: &Path) -> PathBuf {
    data_dir.join("ferry.sock")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_web(listen: &str, web: Option<&str>) -> Result<Config> {
        let web = web.map(|w| format!("web = {w:?}\n")).unwrap_or_default();
        Config::parse(&format!(
            "name = \"a\"\nlisten = {listen:?}\ndata_dir = \"/tmp/x\"\n{web}\
             [credentials]\nca_cert = \"c\"\ncert = \"d\"\nkey = \"e\"\n"
        ))
    }

    #[test]
    fn the_page_is_on_loopback_unless_told() {
        let addr = |l: &str, w: Option<&str>| with_web(l, w).unwrap().web_addr().unwrap();
        // Default: the listen address if loopback (a shared local cluster), else 127.0.0.1.
        assert_eq!(
            addr("127.0.0.12:7070", None),
            Some(("127.0.0.12:7071".parse().unwrap(), false))
        );
        assert_eq!(
            addr("10.0.0.2:7070", None),
            Some(("127.0.0.1:7071".parse().unwrap(), false))
        );
        assert_eq!(addr("10.0.0.2:7070", Some("off")), None);
        assert_eq!(
            addr("10.0.0.2:7070", Some("10.0.0.2:9100")),
            Some(("10.0.0.2:9100".parse().unwrap(), true))
        );
        let e = with_web("10.0.0.2:7070", Some("everywhere")).unwrap_err();
        assert!(
            format!("{e:#}").contains("\"off\" or ADDRESS:PORT"),
            "{e:#}"
        );
    }
}
