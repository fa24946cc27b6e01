//! What the benchmarks share: the ferry binary to measure, the memcpy baseline, the
//! benchmark child, ferry's JSON reports, Markdown tables.

use crate::hold;
use anyhow::{anyhow, bail, Context, Result};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The given ferry, or the workspace's release build brought up to date.
pub fn ferry_binary(given: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = given {
        if !p.is_file() {
            bail!("--ferry {}: no such file", p.display());
        }
        return Ok(p.to_path_buf());
    }
    let ws = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let ws = ws.canonicalize().unwrap_or(ws);
    let target = match std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from) {
        Some(t) if t.is_absolute() => t,
        Some(t) => ws.join(t),
        None => ws.join("target"),
    };
    let bin = target.join("release/ferry");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    eprintln!("ferry-bench: cargo build --release -p ferry");
    let built = Command::new(&cargo)
        .args(["build", "--release", "--quiet", "-p", "ferry"])
        .current_dir(&ws)
        .stdin(Stdio::null())
        .status();
    match built {
        Ok(st) if st.success() && bin.is_file() => Ok(bin),
        Ok(_) | Err(_) if bin.is_file() => {
            eprintln!(
                "ferry-bench: the build failed; measuring the existing {}",
                bin.display()
            );
            Ok(bin)
        }
        Ok(st) => Err(anyhow!(
            "cargo build --release -p ferry failed ({st}) and there is no {}; \
             give a ferry binary with --ferry",
            bin.display()
        )),
        Err(e) => Err(anyhow!(
            "cannot run {}: {e}; build ferry with cargo build --release -p ferry \
             or give it with --ferry",
            Path::new(&cargo).display()
        )),
    }
}

/// Writes `source` to `dir/NAME.c` and builds it with `cc -O2` into `dir/NAME`; `what` names
/// the program in the error.
pub fn build_c(dir: &Path, name: &str, source: &str, what: &str) -> Result<PathBuf> {
    let src = dir.join(format!("{name}.c"));
    let bin = dir.join(name);
    std::fs::write(&src, source).with_context(|| format!("write {}", src.display()))?;
    let st = Command::new("cc")
        .args(["-O2", "-o"])
        .arg(&bin)
        .arg(&src)
        .status()
        .context("run cc")?;
    if !st.success() {
        bail!("cc could not build {what} ({})", src.display());
    }
    Ok(bin)
}

/// `len` bytes of the xorshift sequence after `seed`: nothing zero, nothing repeated.
pub fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut bytes = vec![0u8; len];
    let mut x = seed | 1;
    for chunk in bytes.chunks_mut(8) {
        x = hold::xorshift(x);
        chunk.copy_from_slice(&x.to_ne_bytes()[..chunk.len()]);
    }
    bytes
}

/// Best time of `memcpy` from `src` into a pre-faulted buffer of the same size, in ms (at
/// least five copies, more for up to 300 ms): the physical limit any copy of these bytes
/// within this machine's memory meets.
pub fn memcpy_ms(src: &[u8]) -> Result<f64> {
    let mut dst = vec![0xffu8; src.len()];
    std::hint::black_box(&mut dst);
    let mut best = f64::INFINITY;
    let started = Instant::now();
    let mut reps = 0;
    while reps < 5 || (started.elapsed() < Duration::from_millis(300) && reps < 10_000) {
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(src));
        std::hint::black_box(&mut dst);
        best = best.min(t.elapsed().as_secs_f64() * 1e3);
        reps += 1;
    }
    if dst != src {
        bail!("memcpy baseline: the copy differs from its source");
    }
    Ok(best)
}

/// A Markdown table with aligned columns (numbers right-aligned).
pub fn markdown(lines: &[Vec<String>]) -> String {
    let cols = lines[0].len();
    let width: Vec<usize> = (0..cols)
        .map(|c| lines.iter().map(|l| l[c].len()).max().unwrap_or(0))
        .collect();
    let mut s = String::new();
    for (i, l) in lines.iter().enumerate() {
        s.push('|');
        for (c, cell) in l.iter().enumerate() {
            if i == 0 {
                let _ = write!(s, " {cell:<w$} |", w = width[c]);
            } else {
                let _ = write!(s, " {cell:>w$} |", w = width[c]);
            }
        }
        s.push('\n');
        if i == 0 {
            s.push('|');
            for w in &width {
                let _ = write!(s, "{}:|", "-".repeat(w + 1));
            }
            s.push('\n');
        }
    }
    s
}

/// How long any one ferry command may take in a benchmark.
pub const FERRY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

/// Runs `cmd` (a ferry command whose arguments are `args`) with a time limit, its output in
/// `dir/label.stdout` and `.stderr`; on success, its JSON report.
pub fn ferry_json(
    mut cmd: std::process::Command,
    args: &[&str],
    dir: &Path,
    label: &str,
) -> Result<serde_json::Value> {
    use std::process::Stdio;
    use std::time::{Duration, Instant};
    let out = dir.join(format!("{label}.stdout"));
    let err = dir.join(format!("{label}.stderr"));
    let mut child = cmd
        .args(args)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out)?)
        .stderr(std::fs::File::create(&err)?)
        .spawn()
        .with_context(|| format!("cannot run {:?}", cmd.get_program()))?;
    let start = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait()? {
            break st;
        }
        if start.elapsed() > FERRY_TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "ferry {} did not finish within {FERRY_TIMEOUT:?}",
                args.join(" ")
            );
        }
        // Fine enough for the wall times the benchmarks take from outside.
        std::thread::sleep(Duration::from_micros(500));
    };
    let stdout = std::fs::read_to_string(&out).unwrap_or_default();
    if !status.success() {
        bail!(
            "ferry {} failed ({status}): {}",
            args.join(" "),
            std::fs::read_to_string(&err).unwrap_or_default().trim()
        );
    }
    serde_json::from_str(&stdout)
        .with_context(|| format!("ferry {}: stdout is not a JSON report: {stdout:?}", args[0]))
}

/// A number from one of ferry's JSON reports.
pub fn num(v: &serde_json::Value, key: &str) -> Result<f64> {
    v.get(key)
        .and_then(|x| x.as_f64())
        .ok_or_else(|| anyhow!("ferry's JSON report has no number {key:?}: {v}"))
}

/// How long the benchmark child may take to fill or check its memory.
pub const HOLD_TIMEOUT: Duration = Duration::from_secs(300);

/// The benchmark child (`ferry-bench hold`): our child until ferry takes it, then the process
/// under `pid` (restored here, or moved to another node). Killed when dropped.
pub struct Holder {
    pub pid: i32,
    pub child: Option<Child>,
}

impl Holder {
    /// Starts `ferry-bench hold` holding `mib` MiB in `dir`, in a session of its own, and waits
    /// (looking every `poll`) until it says ready; returns it with the checksum of its memory.
    /// The child also holds `shape`'s mappings, threads, children and descriptors.
    pub fn start_shaped(
        dir: &Path,
        mib: usize,
        shape: crate::hold::Shape,
        poll: Duration,
    ) -> Result<(Holder, String)> {
        let log = std::fs::File::create(dir.join("hold.log"))?;
        let mut cmd =
            std::process::Command::new(std::env::current_exe().context("find ferry-bench itself")?);
        cmd.args(["hold", "--mib", &mib.to_string(), "--dir"])
            .arg(dir)
            .args(shape.args())
            .current_dir(dir)
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        // SAFETY: the closure runs in the forked child before exec and only calls setsid(),
        // which is async-signal-safe.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().context("start the benchmark child")?;
        let mut holder = Holder {
            pid: child.id() as i32,
            child: Some(child),
        };
        let ready = holder.wait_file(&dir.join("ready"), HOLD_TIMEOUT, poll)?;
        let sum = ready
            .split_whitespace()
            .nth(1)
            .ok_or_else(|| anyhow!("ready file {ready:?} has no checksum"))?
            .to_owned();
        Ok((holder, sum))
    }

    /// After a move: waits (up to 30 s each) until the moved child, watched by its PID on the
    /// destination, has ended, then until `deputy`, the original kept at home as its deputy,
    /// has ended too and is reaped.
    pub fn wait_moved_end(&self, deputy: Option<Child>) -> Result<()> {
        let start = Instant::now();
        while self.alive() {
            if start.elapsed() > Duration::from_secs(30) {
                bail!("the moved child did not exit after writing its result");
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        if let Some(mut c) = deputy {
            let start = Instant::now();
            while c.try_wait().context("reap the deputy")?.is_none() {
                if start.elapsed() > Duration::from_secs(30) {
                    bail!("the deputy at home did not end after its body");
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        Ok(())
    }

    /// Whether `pid` is a live process of our own name (the child runs this very binary:
    /// restored or moved or not, it is still the child).
    pub fn alive(&self) -> bool {
        let Ok(ours) = std::fs::read_to_string("/proc/self/comm") else {
            return false;
        };
        std::fs::read_to_string(format!("/proc/{}/stat", self.pid)).is_ok_and(|s| {
            s.contains(&format!("({})", ours.trim_end_matches('\n')))
                && s.rfind(')')
                    .and_then(|i| s[i + 1..].split_whitespace().next())
                    .is_some_and(|st| st != "Z" && st != "X")
        })
    }

    /// The contents of `path` once the child has written it, looking every `poll` for up to
    /// `timeout`; fails as soon as the child is gone.
    pub fn wait_file(&mut self, path: &Path, timeout: Duration, poll: Duration) -> Result<String> {
        let start = Instant::now();
        loop {
            if let Ok(text) = std::fs::read_to_string(path) {
                return Ok(text);
            }
            if let Some(c) = self.child.as_mut() {
                if let Some(st) = c.try_wait()? {
                    self.child = None;
                    bail!(
                        "the benchmark child exited ({st}) before writing {}",
                        path.display()
                    );
                }
            } else if !self.alive() {
                bail!(
                    "the benchmark child (PID {}, restored or moved) died before writing {}",
                    self.pid,
                    path.display()
                );
            }
            if start.elapsed() > timeout {
                bail!("no {} within {timeout:?}", path.display());
            }
            std::thread::sleep(poll);
        }
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        if let Some(c) = self.child.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        } else if self.alive() {
            // SAFETY: kill() on the PID of our own benchmark child, restored or moved.
            unsafe { libc::kill(self.pid, libc::SIGKILL) };
            wait_gone(self.pid, Duration::from_secs(10));
        }
    }
}

/// Reaps `pid` (our child, or reparented to us) or waits for it to vanish.
pub fn wait_gone(pid: i32, timeout: Duration) -> bool {
    let start = Instant::now();
    loop {
        let mut status = 0;
        // SAFETY: waitpid with a valid pointer to a local int.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid || (r < 0 && !Path::new(&format!("/proc/{pid}")).exists()) {
            return true;
        }
        if start.elapsed() > timeout {
            return false;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A local cluster (`ferry cluster up`), stopped however the benchmark ends; its directory
/// is removed too when the cluster made it afresh ([`Cluster::up_fresh`]).
pub struct Cluster {
    pub ferry: PathBuf,
    pub dir: PathBuf,
    remove_dir: bool,
}

impl Cluster {
    /// `ferry cluster up ARGS --dir DIR` in a fresh `DIR` (under the temporary directory,
    /// named `name`), removed again when the cluster is dropped; `env` for `cluster up`.
    pub fn up_fresh(
        ferry: &Path,
        name: &str,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Cluster> {
        let dir = std::env::temp_dir().join(name);
        let _ = std::fs::remove_dir_all(&dir);
        Self::start(ferry, dir, true, args, env)
    }

    /// `ferry cluster up ARGS --dir DIR`, `dir` left behind when the cluster is dropped.
    pub fn up_in(ferry: &Path, dir: &Path, args: &[&str]) -> Result<Cluster> {
        Self::start(ferry, dir.to_path_buf(), false, args, &[])
    }

    fn start(
        ferry: &Path,
        dir: PathBuf,
        remove_dir: bool,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Cluster> {
        let c = Cluster {
            ferry: ferry.to_path_buf(),
            dir,
            remove_dir,
        };
        let o = Command::new(ferry)
            .args(["cluster", "up"])
            // The benchmarks' programs run from temporary directories outside any shared tree.
            .args((!args.contains(&"--confine-guests")).then_some("--no-confine-guests"))
            .args(args)
            .arg("--dir")
            .arg(&c.dir)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .output()
            .context("run ferry cluster up")?;
        if !o.status.success() {
            bail!(
                "ferry cluster up {} failed (another cluster on that port? try --port): {}{}",
                args.join(" "),
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
        }
        Ok(c)
    }

    /// A ferry command speaking to node `node` (stdin closed; no arguments yet).
    pub fn ferry_on(&self, node: &str) -> Command {
        let mut c = Command::new(&self.ferry);
        c.env("FERRY_CLUSTER_DIR", &self.dir)
            .env("FERRY_NODE", node)
            .stdin(Stdio::null());
        c
    }

    /// The CPU cgroup node `node` runs its guests in (`cpu_cgroup` of its ferry.toml).
    pub fn cpu_cgroup(&self, node: &str) -> Result<PathBuf> {
        let cfg = std::fs::read_to_string(self.dir.join(node).join("ferry.toml"))?;
        cfg.lines()
            .find_map(|l| l.strip_prefix("cpu_cgroup = "))
            .map(|v| PathBuf::from(v.trim().trim_matches('"')))
            .context("no cpu_cgroup in the node's config")
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new(&self.ferry)
            .args(["cluster", "down", "--dir"])
            .arg(&self.dir)
            .stdin(Stdio::null())
            .output();
        if self.remove_dir {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Marks every descriptor above 2 close-on-exec: the benchmark's children must hold nothing
/// of whatever started it (a pipe inherited from it would be shared with a process that
/// stays behind, which a migration refuses).
pub fn seal_inherited_fds() {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return;
    };
    let fds: Vec<i32> = dir
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .filter(|&fd| fd > 2)
        .collect();
    for fd in fds {
        // SAFETY: fcntl on a descriptor number; at worst EBADF (the directory's own fd).
        unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    }
}

/// This machine's CPUs and kernel release, for the line above a report's table.
pub fn cpus_and_kernel() -> (usize, String) {
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    (cpus, kernel.trim().to_owned())
}

/// Mean, median, minimum and 90th percentile of some times.
pub struct Stats {
    pub mean: f64,
    pub median: f64,
    pub min: f64,
    pub p90: f64,
}

/// The [`Stats`] of `v` (not empty).
pub fn stats(v: &[f64]) -> Stats {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let at = |q: f64| s[((s.len() - 1) as f64 * q).round() as usize];
    Stats {
        mean: s.iter().sum::<f64>() / s.len() as f64,
        median: at(0.5),
        min: s[0],
        p90: at(0.9),
    }
}

/// The header of a table of [`Stats`] in ms, its last column `last`.
pub fn stats_header(last: &str) -> Vec<String> {
    ["what", "mean ms", "median ms", "min ms", "p90 ms", last]
        .map(String::from)
        .to_vec()
}

/// A row under [`stats_header`]: `label`, `s` in ms, and `last`.
pub fn stats_row(label: &str, s: &Stats, last: String) -> Vec<String> {
    vec![
        label.to_string(),
        format!("{:.2}", s.mean),
        format!("{:.2}", s.median),
        format!("{:.2}", s.min),
        format!("{:.2}", s.p90),
        last,
    ]
}
