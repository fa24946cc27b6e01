//! A real local cluster for tests: `ferry cluster up` with a port of the test's own (so several
//! test binaries, or engineers, never collide), torn down on drop.
//!
//! Its nodes are `shared` (all daemons in this machine's namespaces, on loopback) or
//! `separate` (every node but the first in namespaces of its own, on a bridge of the
//! cluster's); `FERRY_TEST_ISOLATION` chooses for the tests that do not ask for one. The shared
//! tree of a test cluster is the target's temporary directory, where the tests keep the files
//! of the programs they move.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub const FERRY: &str = env!("CARGO_BIN_EXE_ferry");

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isolation {
    Shared,
    Separate,
}

impl Isolation {
    /// What the tests that do not ask get: `FERRY_TEST_ISOLATION` (shared or separate), or
    /// separate, as `ferry cluster up` does.
    pub fn default_for_tests() -> Isolation {
        match std::env::var("FERRY_TEST_ISOLATION").as_deref() {
            Ok("separate") | Err(_) => Isolation::Separate,
            Ok("shared") => Isolation::Shared,
            Ok(other) => panic!("FERRY_TEST_ISOLATION={other:?}: shared or separate"),
        }
    }

    fn arg(self) -> &'static str {
        match self {
            Isolation::Shared => "shared",
            Isolation::Separate => "separate",
        }
    }
}

pub struct Cluster {
    pub dir: PathBuf,
    pub port: u16,
    pub nodes: Vec<String>,
    pub isolation: Isolation,
}

impl Cluster {
    /// Starts `n` nodes (a, b, c, ...) under a fresh directory named after `tag`.
    pub fn up(tag: &str, n: usize) -> Cluster {
        Self::up_with(tag, n, &[])
    }

    /// Like `up`, with extra environment for the daemons (FAILPOINTS, FERRY_LOG).
    pub fn up_with(tag: &str, n: usize, env: &[(&str, &str)]) -> Cluster {
        Self::up_as(tag, n, env, Isolation::default_for_tests())
    }

    /// Like `up`, with nodes as separate as `isolation` says, whatever the default.
    pub fn up_isolated(tag: &str, n: usize, isolation: Isolation) -> Cluster {
        Self::up_as(tag, n, &[], isolation)
    }

    /// Where test clusters live, each in `TAG-PID` (PID: the test process's).
    pub fn clusters_dir() -> PathBuf {
        Path::new(env!("CARGO_TARGET_TMPDIR")).join("clusters")
    }

    /// The shared tree of test clusters.
    pub fn shared_tree() -> &'static Path {
        Path::new(env!("CARGO_TARGET_TMPDIR"))
    }

    pub fn up_as(tag: &str, n: usize, env: &[(&str, &str)], isolation: Isolation) -> Cluster {
        Self::up_full(tag, n, env, isolation, &[])
    }

    /// Like `up_as`, with more arguments for `ferry cluster up` (`--cpu-quota 0.5`).
    pub fn up_full(
        tag: &str,
        n: usize,
        env: &[(&str, &str)],
        isolation: Isolation,
        extra: &[&str],
    ) -> Cluster {
        // Whatever the processes of a test inherit from it is theirs to move.
        super::seal_inherited_fds();
        let root = Self::clusters_dir();
        stop_stale_clusters(&root);
        let dir = root.join(format!("{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        // A port per test process and tag: clusters of parallel binaries and tests never meet.
        let tag_hash = tag
            .bytes()
            .fold(7u32, |h, b| h.wrapping_mul(31).wrapping_add(b as u32));
        let port =
            20000 + (std::process::id().wrapping_mul(13).wrapping_add(tag_hash) % 20000) as u16;
        let out = Command::new(FERRY)
            .envs(env.iter().copied())
            .args([
                "cluster",
                "up",
                "--nodes",
                &n.to_string(),
                "--port",
                &port.to_string(),
                "--isolation",
                isolation.arg(),
            ])
            .arg("--dir")
            .arg(&dir)
            .arg("--shared")
            .arg(Self::shared_tree())
            // The programs under test run from the repository, outside the shared tree: only a
            // test that asks for it has its guests confined.
            .args((!extra.contains(&"--confine-guests")).then_some("--no-confine-guests"))
            .args(extra)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "cluster up failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        Cluster {
            dir,
            port,
            nodes: (0..n)
                .map(|i| ((b'a' + i as u8) as char).to_string())
                .collect(),
            isolation,
        }
    }

    /// The X of a separate cluster's subnet 169.254.X.0/24 (and of its bridge, `ferryX`).
    pub fn net_slot(&self) -> Option<u8> {
        let state = std::fs::read(self.dir.join("cluster.json")).ok()?;
        let v: serde_json::Value = serde_json::from_slice(&state).ok()?;
        v["net"]["slot"].as_u64().map(|s| s as u8)
    }

    /// PID of the init of separate node `node` (none for the first node, or shared ones).
    pub fn init_pid(&self, node: &str) -> Option<i32> {
        init_pid(&self.dir, node)
    }

    /// Where node `node` listens for its peers (`listen` in its config), as ADDR:PORT.
    pub fn listen_addr(&self, node: &str) -> String {
        let cfg = std::fs::read_to_string(self.dir.join(node).join("ferry.toml")).unwrap();
        cfg.lines()
            .find_map(|l| l.strip_prefix("listen = "))
            .map(|v| v.trim().trim_matches('"').to_string())
            .unwrap_or_else(|| panic!("no listen address in the config of {node}"))
    }

    /// This machine's PID of the process node `node` calls `pid` (see [`host_pid`]).
    pub fn host_pid(&self, node: &str, pid: i32) -> Option<i32> {
        host_pid(&self.dir, node, pid)
    }

    /// Like `up`, for a harness that is a child subreaper (it adopts what its trials leave
    /// behind and kills its descendants when a trial ends): the daemons are children of
    /// `ferry cluster up` and outlive it, so such a harness would adopt them and kill them with
    /// a trial's processes. They are left to init instead (and stopped on drop as usual). A
    /// failure to start is returned, not a panic.
    pub fn up_unadopted(tag: &str, n: usize) -> Result<Cluster, String> {
        fn set_subreaper(on: bool) {
            // SAFETY: prctl with integer arguments only changes this process's flag.
            unsafe {
                libc::prctl(
                    libc::PR_SET_CHILD_SUBREAPER,
                    libc::c_ulong::from(on),
                    0,
                    0,
                    0,
                )
            };
        }
        let mut was = 0 as libc::c_int;
        // SAFETY: PR_GET_CHILD_SUBREAPER writes one int through the pointer, to a local.
        unsafe { libc::prctl(libc::PR_GET_CHILD_SUBREAPER, &mut was as *mut libc::c_int) };
        set_subreaper(false);
        let r = std::panic::catch_unwind(|| Cluster::up(tag, n));
        set_subreaper(was != 0);
        r.map_err(|p| {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            format!("cannot start a local cluster of {n} nodes: {msg}")
        })
    }

    /// A `ferry` command run as if on node `node`.
    pub fn ferry(&self, node: &str) -> Command {
        let mut c = Command::new(FERRY);
        c.env("FERRY_CLUSTER_DIR", &self.dir)
            .env("FERRY_NODE", node);
        c
    }

    /// Runs `ferry ARGS` on `node` and returns its output.
    pub fn run(&self, node: &str, args: &[&str]) -> Output {
        self.ferry(node).args(args).output().unwrap()
    }

    pub fn log(&self, node: &str) -> String {
        std::fs::read_to_string(self.dir.join(node).join("daemon.log")).unwrap_or_default()
    }

    /// PID of node `node`'s daemon.
    pub fn daemon_pid(&self, node: &str) -> i32 {
        std::fs::read_to_string(self.dir.join(node).join("daemon.pid"))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new(FERRY)
            .args(["cluster", "down", "--dir"])
            .arg(&self.dir)
            .output();
    }
}

/// Stops the clusters under `root` whose test process is gone (killed before its clusters were
/// dropped): their daemons, separate nodes and bridges would otherwise stay for good.
pub fn stop_stale_clusters(root: &Path) {
    let Ok(rd) = std::fs::read_dir(root) else {
        return;
    };
    for e in rd.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.rsplit_once('-'))
            .and_then(|(_, p)| p.parse::<u32>().ok())
        else {
            continue;
        };
        if Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        let _ = Command::new(FERRY)
            .args(["cluster", "down", "--dir"])
            .arg(e.path())
            .output();
        let _ = std::fs::remove_dir_all(e.path());
    }
}

/// PID of the init of separate node `node` of the cluster in `dir`.
pub fn init_pid(dir: &Path, node: &str) -> Option<i32> {
    std::fs::read_to_string(dir.join(node).join("init.pid"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// This machine's PID of the process that node `node` of the cluster in `dir` calls `pid`.
/// The PIDs `ferry ps` and a migration's report give are the node's own: on a separate node,
/// those of its PID namespace, which is not ours. None if no such process runs.
pub fn host_pid(dir: &Path, node: &str, pid: i32) -> Option<i32> {
    let Some(init) = init_pid(dir, node) else {
        return Some(pid);
    };
    let ppid = |p: i32| -> Option<i32> {
        let s = std::fs::read_to_string(format!("/proc/{p}/stat")).ok()?;
        s.rsplit_once(')')?
            .1
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()
    };
    let on_node = |mut p: i32| {
        for _ in 0..64 {
            if p == init {
                return true;
            }
            match ppid(p) {
                Some(q) if q > 1 => p = q,
                _ => return false,
            }
        }
        false
    };
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .find(|&p| {
            let status = std::fs::read_to_string(format!("/proc/{p}/status")).unwrap_or_default();
            let nspid: Vec<&str> = status
                .lines()
                .find_map(|l| l.strip_prefix("NSpid:"))
                .map(|l| l.split_whitespace().collect())
                .unwrap_or_default();
            nspid.get(1) == Some(&pid.to_string().as_str()) && on_node(p)
        })
}

/// The last lines of the daemons' logs of `nodes`, for failure messages.
pub fn daemon_logs(dir: &Path, nodes: &[&str]) -> String {
    let mut out = String::new();
    for n in nodes {
        let p = dir.join(n).join("daemon.log");
        let log = std::fs::read(&p).unwrap_or_default();
        out.push_str(&format!(
            "--- {} (last 4 KiB):\n{}",
            p.display(),
            super::with_newline(super::tail(&log, 4096))
        ));
    }
    out
}
