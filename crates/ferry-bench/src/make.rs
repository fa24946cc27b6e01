//! `ferry-bench make`: the speedup of `ferry make` building a real C project nobody here wrote
//! (LuaJIT, as the crates.io package `luajit-src` ships it, with its own Makefiles), on 1, 2
//! and 4 emulated nodes of half a CPU each, against plain `make` on one half-CPU node
//! (Sprite's Table 7.4 / B.1).
//!
//! - *plain*: `make -j2` in a cgroup of its own held to half a CPU (`cpu.cfs_quota_us`), no
//!   Ferry anywhere.
//! - *ferry make, N nodes*: a local cluster of N+1 separate nodes, each held to half a CPU
//!   (`ferry cluster up --cpu-quota 0.5`); `ferry make -j 2N --elsewhere` runs on node a (the
//!   home, in a's cgroup too: make, its shells and a's daemon relaying share a's half CPU) and
//!   its recipes on the N others.
//!
//! Every build starts from a fresh copy of the sources outside /tmp (which each separate node
//! has to itself). Speedup = plain / ferry make; the aim is at least 0.8 N.

use crate::common::{ferry_binary, markdown, Cluster};
use anyhow::{bail, Context, Result};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// Node counts to build with.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    nodes: Vec<usize>,
    /// Builds of each configuration (the table shows the median).
    #[arg(long, default_value_t = 1)]
    runs: usize,
    /// CPU share of each node (and of the plain build).
    #[arg(long, default_value_t = 0.5)]
    quota: f64,
    /// LuaJIT's source tree (the directory holding its top Makefile). Default: the
    /// `luajit-src` package in cargo's registry, fetched with `cargo fetch` if missing.
    #[arg(long)]
    source: Option<PathBuf>,
    /// The ferry binary. Default: the workspace's target/release/ferry, brought up to date.
    #[arg(long)]
    ferry: Option<PathBuf>,
    /// Where the builds happen (must not be under /tmp, /run or /dev/shm).
    #[arg(long, default_value = "/var/tmp")]
    work: PathBuf,
}

/// The luajit2 directory of the newest `luajit-src` in cargo's registry.
fn find_luajit() -> Option<PathBuf> {
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cargo")))?;
    let mut found = Vec::new();
    for reg in std::fs::read_dir(home.join("registry/src")).ok()?.flatten() {
        for e in std::fs::read_dir(reg.path())
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with("luajit-src-") && e.path().join("luajit2/Makefile").exists() {
                found.push(e.path().join("luajit2"));
            }
        }
    }
    found.sort();
    found.pop()
}

/// Fetches `luajit-src` from crates.io with cargo, through a throwaway package.
fn fetch_luajit(work: &Path) -> Result<PathBuf> {
    let dir = work.join(format!("ferry-bench-fetch.{}", std::process::id()));
    std::fs::create_dir_all(dir.join("src"))?;
    std::fs::write(
        dir.join("Cargo.toml"),
        "[package]\nname = \"fetch\"\nversion = \"0.0.0\"\nedition = \"2021\"\n\
         [dependencies]\nluajit-src = \"210\"\n",
    )?;
    std::fs::write(dir.join("src/main.rs"), "fn main() {}\n")?;
    let st = Command::new("cargo")
        .arg("fetch")
        .current_dir(&dir)
        .status()
        .context("run cargo fetch")?;
    let _ = std::fs::remove_dir_all(&dir);
    if !st.success() {
        bail!("cargo fetch of luajit-src failed: {st}");
    }
    find_luajit().context("luajit-src fetched, but not found in cargo's registry")
}

/// A fresh copy of the sources.
fn fresh_copy(src: &Path, work: &Path, tag: &str) -> Result<PathBuf> {
    let dst = work.join(format!("ferry-bench-make.{}.{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    let st = Command::new("cp")
        .arg("-a")
        .arg(src)
        .arg(&dst)
        .status()
        .context("run cp")?;
    if !st.success() {
        bail!("cp -a {} {} failed", src.display(), dst.display());
    }
    Ok(dst)
}

/// A cgroup of the cpu hierarchy held to `quota` of a CPU, removed on drop.
struct Cgroup(PathBuf);

impl Cgroup {
    fn new(quota: f64) -> Result<Cgroup> {
        let dir = PathBuf::from(format!(
            "/sys/fs/cgroup/cpu/ferry-bench-make.{}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
        std::fs::write(dir.join("cpu.cfs_period_us"), "100000")?;
        std::fs::write(
            dir.join("cpu.cfs_quota_us"),
            ((quota * 100_000.0) as u64).to_string(),
        )?;
        Ok(Cgroup(dir))
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// `sh -c 'echo $$ > CGROUP/cgroup.procs && exec "$@"' sh ARGS...`: ARGS run in the cgroup
/// from their first instruction.
fn in_cgroup(cg: &Path, args: &[String]) -> Command {
    let mut c = Command::new("sh");
    c.arg("-c")
        .arg(format!(
            "echo $$ > {}/cgroup.procs && exec \"$@\"",
            cg.display()
        ))
        .arg("sh")
        .args(args);
    c
}

/// Runs a build to the end; its wall time in seconds.
fn timed_build(mut cmd: Command, what: &str, log: &Path) -> Result<f64> {
    let out = std::fs::File::create(log)?;
    let t = Instant::now();
    let st = cmd
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .status()
        .with_context(|| format!("start {what}"))?;
    let secs = t.elapsed().as_secs_f64();
    if !st.success() {
        bail!("{what} failed ({st}); its output: {}", log.display());
    }
    Ok(secs)
}

/// A local cluster of `n` separate nodes held to `quota` each, stopped on drop.
fn cluster_up(ferry: &Path, n: usize, quota: f64) -> Result<Cluster> {
    Cluster::up_fresh(
        ferry,
        &format!("ferry-bench-make-cl.{}", std::process::id()),
        &[
            "--nodes",
            &n.to_string(),
            "--cpu-quota",
            &quota.to_string(),
            "--port",
            "7395",
        ],
        &[],
    )
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

pub fn run(a: Args) -> Result<()> {
    if a.runs == 0 || a.nodes.is_empty() || a.nodes.contains(&0) {
        bail!("--runs and every --nodes count must be at least 1");
    }
    if ["/tmp", "/run", "/dev/shm"]
        .iter()
        .any(|p| a.work.starts_with(p))
    {
        bail!("--work must be outside /tmp, /run and /dev/shm, which each separate node has to itself");
    }
    let ferry = ferry_binary(a.ferry.as_deref())?;
    let src = match &a.source {
        Some(s) => s.clone(),
        None => match find_luajit() {
            Some(s) => s,
            None => fetch_luajit(&a.work)?,
        },
    };
    if !src.join("src/Makefile").exists() {
        bail!(
            "{} does not look like LuaJIT's source tree (no src/Makefile)",
            src.display()
        );
    }
    let count_c = std::fs::read_dir(src.join("src"))?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".c"))
        .count();
    eprintln!(
        "ferry-bench make: LuaJIT from {} ({count_c} C files), {} build(s) per configuration",
        src.display(),
        a.runs
    );
    let logs = a
        .work
        .join(format!("ferry-bench-make-logs.{}", std::process::id()));
    std::fs::create_dir_all(&logs)?;

    // Plain make on one node of `quota` CPU.
    let mut plain = Vec::new();
    for r in 0..a.runs {
        let tree = fresh_copy(&src, &a.work, "plain")?;
        let cg = Cgroup::new(a.quota)?;
        let mut cmd = in_cgroup(&cg.0, &["make".into(), "-j2".into()]);
        cmd.current_dir(&tree);
        let s = timed_build(cmd, "plain make", &logs.join(format!("plain-{r}.log")))?;
        eprintln!("  plain make -j2 on one {} CPU: {s:.1} s", a.quota);
        plain.push(s);
        let _ = std::fs::remove_dir_all(&tree);
    }
    let base = median(&mut plain);

    let mut rows = vec![vec![
        "build".to_string(),
        "nodes".into(),
        "wall s (median)".into(),
        "speedup".into(),
        "aim 0.8 N".into(),
    ]];
    rows.push(vec![
        format!("make -j2 (one node of {} CPU)", a.quota),
        "1".into(),
        format!("{base:.1}"),
        "1.00".into(),
        "".into(),
    ]);
    for &n in &a.nodes {
        let cluster = cluster_up(&ferry, n + 1, a.quota)?;
        let home_cg = cluster.cpu_cgroup("a")?;
        let mut times = Vec::new();
        for r in 0..a.runs {
            let tree = fresh_copy(&src, &a.work, &format!("n{n}"))?;
            let jobs = (2 * n).to_string();
            let mut cmd = in_cgroup(
                &home_cg,
                &[
                    ferry.display().to_string(),
                    "make".into(),
                    "-j".into(),
                    jobs,
                    "--elsewhere".into(),
                ],
            );
            cmd.current_dir(&tree)
                .env("FERRY_CLUSTER_DIR", &cluster.dir)
                .env("FERRY_NODE", "a");
            let s = timed_build(
                cmd,
                &format!("ferry make on {n} nodes"),
                &logs.join(format!("ferry-{n}-{r}.log")),
            )?;
            eprintln!("  ferry make -j {} on {n} node(s): {s:.1} s", 2 * n);
            times.push(s);
            let _ = std::fs::remove_dir_all(&tree);
        }
        drop(cluster);
        let t = median(&mut times);
        rows.push(vec![
            format!("ferry make -j {} --elsewhere", 2 * n),
            n.to_string(),
            format!("{t:.1}"),
            format!("{:.2}", base / t),
            format!("{:.1}", 0.8 * n as f64),
        ]);
    }
    let _ = std::fs::remove_dir_all(&logs);
    let mut out = String::new();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let _ = writeln!(
        out,
        "LuaJIT ({count_c} C files, {}), each node {} CPU; load average at the end: {}\n",
        src.display(),
        a.quota,
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    out.push_str(&markdown(&rows));
    let _ = writeln!(
        out,
        "\nSprite (Table 7.4, B.1): 2.95-5.42x with 12 hosts; the aim here: at least 0.8 N."
    );
    print!("{out}");
    Ok(())
}
