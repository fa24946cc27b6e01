//! A real local cluster for tests: `ferry cluster up` on loopback addresses and a port of the
//! test's own (so several test binaries, or engineers, never collide), torn down on drop.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub const FERRY: &str = env!("CARGO_BIN_EXE_ferry");

pub struct Cluster {
    pub dir: PathBuf,
    pub port: u16,
    pub nodes: Vec<String>,
}

impl Cluster {
    /// Starts `n` nodes (a, b, c, ...) under a fresh directory named after `tag`.
    pub fn up(tag: &str, n: usize) -> Cluster {
        Self::up_with(tag, n, &[])
    }

    /// Like `up`, with extra environment for the daemons (FERRY_FAULT, FERRY_LOG).
    pub fn up_with(tag: &str, n: usize, env: &[(&str, &str)]) -> Cluster {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join("clusters")
            .join(format!("{tag}-{}", std::process::id()));
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
            ])
            .arg("--dir")
            .arg(&dir)
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
        }
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
