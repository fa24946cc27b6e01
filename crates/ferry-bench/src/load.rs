//! `ferry-bench load`: Ferry under load, for minutes. A benchmark, not a test: it reports.
//!
//! Starts a local cluster of three nodes (a, b, c, one machine: `--isolation shared`) with the
//! measured ferry binary and ten long-running counters (python3 loops appending 1, 2, 3, ... to
//! a log of their own, ten a second, forever). Then, round after round until `--minutes` have passed, all at
//! once: `--jobs` `ferry run --on NODE -- sh -c 'exit K'` (K: 0 to 99, each job its own, nodes
//! in turn) and `--migrations` migrations, each counter moving on to the next node (a, b, c, a,
//! ...). After each round it checks:
//!
//! - every job exited with its own K;
//! - every counter runs exactly once: its log goes on growing (not lost), and its numbers follow
//!   one another with no repeat (two copies would each write the next number);
//! - its home still has it: its PID at home (node a: the original, or the deputy it left there)
//!   is alive, so that its parent (this benchmark) could still signal and wait for it;
//! - each daemon's RSS and open fds (from /proc), kept over time.
//!
//! At the end the counters are killed where they are, and their logs must stop growing (no
//! copy left anywhere). It prints the totals, RSS and fds first against last, and migrations
//! per second. See docs/benchmarks.md.

use crate::common::{cpus_and_kernel, seal_inherited_fds, Cluster};
use crate::engine::{ferry_binary, markdown};
use anyhow::{anyhow, bail, Context, Result};
use std::fmt::Write as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct Args {
    /// How long to keep the load on, in minutes.
    #[arg(long, default_value_t = 3.0)]
    minutes: f64,
    /// Concurrent `ferry run` jobs per round.
    #[arg(long, default_value_t = 50)]
    jobs: usize,
    /// Long-running counters, all migrated at once in each round.
    #[arg(long, default_value_t = 10)]
    migrations: usize,
    /// The ferry binary to measure. Default: the workspace's target/release/ferry, brought up to
    /// date with `cargo build --release -p ferry` first.
    #[arg(long)]
    ferry: Option<PathBuf>,
    /// TCP port of the benchmark's own local cluster.
    #[arg(long, default_value_t = 7430)]
    port: u16,
}

const NODES: [&str; 3] = ["a", "b", "c"];

/// The local cluster of three nodes, stopped however the benchmark ends.
fn cluster_up(ferry: &Path, port: u16, dir: &Path) -> Result<Cluster> {
    Cluster::up_in(
        ferry,
        dir,
        &[
            "--nodes",
            "3",
            "--port",
            &port.to_string(),
            "--isolation",
            "shared",
        ],
    )
}

fn daemon_pid(c: &Cluster, node: &str) -> Result<i32> {
    let p = c.dir.join(node).join("daemon.pid");
    let s = std::fs::read_to_string(&p).with_context(|| format!("read {}", p.display()))?;
    s.trim()
        .parse()
        .with_context(|| format!("{}: not a PID: {s:?}", p.display()))
}

/// (RSS in KiB, open fds) of node `node`'s daemon.
fn daemon_use(c: &Cluster, node: &str) -> Result<(u64, usize)> {
    let pid = daemon_pid(c, node)?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("node {node}'s daemon (PID {pid}) is gone"))?;
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .ok_or_else(|| anyhow!("PID {pid}: no VmRSS in /proc/{pid}/status"))?;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .with_context(|| format!("list /proc/{pid}/fd"))?
        .count();
    Ok((rss, fds))
}

/// A counter: where it runs now and its log.
struct Counter {
    pid: i32,
    /// Its PID at home (node a): the original, a deputy there once it has moved (its parent,
    /// this benchmark, must still be able to wait for it).
    home_pid: i32,
    node: usize,
    log: PathBuf,
    /// The last number seen in its log.
    last: u64,
    /// Why it is no longer counted on (lost or duplicated): left out of later rounds.
    broken: Option<String>,
}

impl Counter {
    fn start(dir: &Path, i: usize) -> Result<Counter> {
        let log = dir.join(format!("counter-{i}.log"));
        // One process without children (a child ending between a migration's preflight and
        // its freeze fails the move), the log held open in append mode.
        let child = Command::new("python3")
            .arg("-c")
            .arg(
                "import sys, time\nf = open(sys.argv[1], 'a')\ni = 0\nwhile True:\n    \
                 i += 1\n    f.write(f'{i}\\n')\n    f.flush()\n    time.sleep(0.1)\n",
            )
            .arg(&log)
            .arg(format!("ferry-load-counter-{i}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .context("start a counter (python3)")?;
        let pid = child.id() as i32;
        // Never waited for: the first move's commit kills this original, which stays a zombie
        // of ours until the benchmark exits (ten at most).
        std::mem::forget(child);
        Ok(Counter {
            pid,
            home_pid: pid,
            node: 0,
            log,
            last: 0,
            broken: None,
        })
    }

    /// Checks the log: its numbers follow one another from 1 with no repeat, and it grew past
    /// what was seen last time. Returns the last number.
    fn check(&mut self) -> Result<u64> {
        let last = self.read()?;
        if last <= self.last {
            let st =
                std::fs::read_to_string(format!("/proc/{}/status", self.pid)).unwrap_or_default();
            let st: Vec<&str> = st
                .lines()
                .filter(|l| l.starts_with("State") || l.starts_with("NSpid"))
                .collect();
            bail!(
                "{} stopped at {last} (PID {} on node {}, {st:?}): the counter was lost",
                self.log.display(),
                self.pid,
                NODES[self.node]
            );
        }
        self.last = last;
        // Its home keeps it: the original or its deputy still lives there (not a zombie).
        let stat =
            std::fs::read_to_string(format!("/proc/{}/stat", self.home_pid)).unwrap_or_default();
        let state = stat
            .rsplit(')')
            .next()
            .and_then(|s| s.trim_start().chars().next());
        if !matches!(state, Some(s) if s != 'Z' && s != 'X') {
            bail!(
                "PID {} at home (node a) is gone ({}) while the counter runs on node {} (PID \
                 {}): its home lost it, and its parent saw it end",
                self.home_pid,
                state.map_or("no such process".to_string(), |s| format!("state {s}")),
                NODES[self.node],
                self.pid
            );
        }
        Ok(last)
    }

    /// The last number of the log, which must follow from 1 with no repeat.
    fn read(&self) -> Result<u64> {
        let text = std::fs::read_to_string(&self.log)
            .with_context(|| format!("read {}", self.log.display()))?;
        let mut expect = 1u64;
        // The last line may be half written.
        let lines: Vec<&str> = text.lines().collect();
        for (n, l) in lines.iter().enumerate() {
            match l.trim().parse::<u64>() {
                Ok(v) if v == expect => expect += 1,
                Ok(v) => bail!(
                    "{}: line {}: {v} after {}: {}",
                    self.log.display(),
                    n + 1,
                    expect - 1,
                    if v < expect {
                        "a number written twice (two copies ran)"
                    } else {
                        "numbers missing"
                    }
                ),
                Err(_) if n + 1 == lines.len() => {}
                Err(_) => bail!("{}: line {}: {l:?}", self.log.display(), n + 1),
            }
        }
        Ok(expect - 1)
    }
}

/// A counter at home (node a, the benchmark's own namespaces) is killed however the benchmark
/// ends; one on another node is left to `cluster down`.
impl Drop for Counter {
    fn drop(&mut self) {
        if self.node == 0 {
            let _ = Command::new("kill")
                .args(["-9", &self.pid.to_string()])
                .stderr(Stdio::null())
                .status();
        }
    }
}

#[derive(Default)]
struct Totals {
    rounds: usize,
    jobs: usize,
    job_failures: Vec<String>,
    migrations: usize,
    migration_failures: Vec<String>,
    migrating: Duration,
}

pub fn run(a: Args) -> Result<()> {
    if a.jobs == 0 && a.migrations == 0 {
        bail!("--jobs and --migrations are both 0: no load");
    }
    seal_inherited_fds();
    let ferry = ferry_binary(a.ferry.as_deref())?;
    let dir = std::env::temp_dir().join(format!("ferry-bench-load.{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    let cluster = cluster_up(&ferry, a.port, &dir.join("cluster"))?;
    let mut counters = (0..a.migrations)
        .map(|i| Counter::start(&dir, i))
        .collect::<Result<Vec<_>>>()?;
    // Each counter has counted before anything moves.
    let started = Instant::now();
    for c in &mut counters {
        while c.check().is_err() {
            if started.elapsed() > Duration::from_secs(20) {
                c.check().context("a counter did not start")?;
            }
            sleep(Duration::from_millis(50));
        }
    }

    // (seconds since start, per node (RSS KiB, fds))
    let mut usage: Vec<(f64, Vec<(u64, usize)>)> = Vec::new();
    let sample = |t0: Instant| -> Result<(f64, Vec<(u64, usize)>)> {
        Ok((
            t0.elapsed().as_secs_f64(),
            NODES
                .iter()
                .map(|n| daemon_use(&cluster, n))
                .collect::<Result<_>>()?,
        ))
    };
    let t0 = Instant::now();
    usage.push(sample(t0)?);
    let mut totals = Totals::default();
    let limit = Duration::from_secs_f64(a.minutes * 60.0);
    while t0.elapsed() < limit {
        round(&a, &cluster, &mut counters, &mut totals)?;
        totals.rounds += 1;
        usage.push(sample(t0)?);
        let (t, u) = usage.last().expect("sampled");
        eprintln!(
            "ferry-bench load: {t:.0} s, round {}: {} jobs, {} migrations ({} refused) so far; \
             daemons RSS KiB {:?}, fds {:?}",
            totals.rounds,
            totals.jobs,
            totals.migrations,
            totals.migration_failures.len(),
            u.iter().map(|x| x.0).collect::<Vec<_>>(),
            u.iter().map(|x| x.1).collect::<Vec<_>>(),
        );
    }
    let wall = t0.elapsed();

    // The end: each counter killed where it is; no log may grow after that.
    for c in &counters {
        let _ = Command::new("kill")
            .args(["-9", &c.pid.to_string()])
            .status();
    }
    sleep(Duration::from_millis(500));
    for c in counters.iter_mut().filter(|c| c.broken.is_none()) {
        let end = c.read()?;
        sleep(Duration::from_millis(300));
        let now = c.read()?;
        if now > end {
            c.broken = Some(format!(
                "{} grew after PID {} was killed on node {}: another copy runs ({end}, then {now})",
                c.log.display(),
                c.pid,
                NODES[c.node]
            ));
        }
    }
    drop(cluster);

    let mut out = String::new();
    let (cpus, kernel) = cpus_and_kernel();
    let _ = writeln!(
        out,
        "machine: {cpus} CPUs, kernel {kernel}; ferry: {}; {:.1} min, {} rounds of {} jobs and {} \
         migrations at once\n",
        ferry.display(),
        wall.as_secs_f64() / 60.0,
        totals.rounds,
        a.jobs,
        a.migrations
    );
    let mut lines = vec![vec!["what".to_string(), "result".to_string()]];
    lines.push(vec![
        "ferry run jobs, exit code right".into(),
        format!(
            "{} of {}",
            totals.jobs - totals.job_failures.len(),
            totals.jobs
        ),
    ]);
    lines.push(vec![
        "migrations done / refused (the counter ran on at the source)".into(),
        format!(
            "{} / {}",
            totals.migrations,
            totals.migration_failures.len()
        ),
    ]);
    let broken: Vec<&String> = counters.iter().filter_map(|c| c.broken.as_ref()).collect();
    lines.push(vec![
        "counters lost or duplicated".into(),
        format!("{} of {}", broken.len(), counters.len()),
    ]);
    lines.push(vec![
        "migrations per second (over the whole run)".into(),
        format!("{:.2}", totals.migrations as f64 / wall.as_secs_f64()),
    ]);
    lines.push(vec![
        "migrations per second (while migrating)".into(),
        format!(
            "{:.2}",
            totals.migrations as f64 / totals.migrating.as_secs_f64().max(1e-9)
        ),
    ]);
    let (first, last) = (&usage[0].1, &usage[usage.len() - 1].1);
    for (i, n) in NODES.iter().enumerate() {
        let max = usage.iter().map(|u| u.1[i].0).max().unwrap_or(0);
        lines.push(vec![
            format!("daemon {n}: RSS MiB first / max / last"),
            format!(
                "{:.1} / {:.1} / {:.1}",
                first[i].0 as f64 / 1024.0,
                max as f64 / 1024.0,
                last[i].0 as f64 / 1024.0
            ),
        ]);
        lines.push(vec![
            format!("daemon {n}: open fds first / last"),
            format!("{} / {}", first[i].1, last[i].1),
        ]);
    }
    out.push_str(&markdown(&lines));
    if !broken.is_empty() {
        let _ = writeln!(out, "\ncounters lost or duplicated:");
        for b in &broken {
            let _ = writeln!(out, "- {b}");
        }
    }
    if !totals.job_failures.is_empty() {
        let _ = writeln!(out, "\nwrong exit codes (first 5):");
        for f in totals.job_failures.iter().take(5) {
            let _ = writeln!(out, "- {f}");
        }
    }
    if !totals.migration_failures.is_empty() {
        let _ = writeln!(out, "\nrefused migrations (first 5):");
        for f in totals.migration_failures.iter().take(5) {
            let _ = writeln!(out, "- {f}");
        }
    }
    if broken.is_empty() {
        let _ = std::fs::remove_dir_all(&dir);
    } else {
        // The daemons' logs say what became of the lost or duplicated counters.
        let _ = writeln!(
            out,
            "\nkept for its daemons' logs (cluster/NODE/daemon.log): {}",
            dir.display()
        );
    }
    print!("{out}");
    Ok(())
}

/// One round: the jobs and the migrations, all started at once, then every check.
fn round(a: &Args, cluster: &Cluster, counters: &mut [Counter], totals: &mut Totals) -> Result<()> {
    let mut jobs = Vec::new();
    for j in 0..a.jobs {
        let code = (totals.jobs + j) % 100;
        let node = NODES[j % NODES.len()];
        let child = cluster
            .ferry_on("a")
            .args(["run", "--on", node, "--", "sh", "-c"])
            .arg(format!("exit {code}"))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("start ferry run")?;
        jobs.push((code, node, child));
    }
    let t = Instant::now();
    let mut moves = Vec::new();
    for c in counters.iter().filter(|c| c.broken.is_none()) {
        let to = (c.node + 1) % NODES.len();
        let child = cluster
            .ferry_on(NODES[c.node])
            .args(["migrate", &c.pid.to_string(), "--to", NODES[to], "--json"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("start ferry migrate")?;
        moves.push((to, child));
    }
    for (c, (to, child)) in counters
        .iter_mut()
        .filter(|c| c.broken.is_none())
        .zip(moves)
    {
        let o = child.wait_with_output().context("wait for ferry migrate")?;
        if o.status.success() {
            let report: serde_json::Value =
                serde_json::from_slice(&o.stdout).with_context(|| {
                    format!(
                        "ferry migrate: not a JSON report: {}",
                        String::from_utf8_lossy(&o.stdout)
                    )
                })?;
            c.pid = report
                .get("dest_pid")
                .and_then(|p| p.as_i64())
                .ok_or_else(|| anyhow!("ferry migrate's report has no dest_pid: {report}"))?
                as i32;
            c.node = to;
            totals.migrations += 1;
        } else {
            eprintln!(
                "ferry-bench load: PID {} {} -> {} refused: {}",
                c.pid,
                NODES[c.node],
                NODES[to],
                String::from_utf8_lossy(&o.stderr).trim()
            );
            totals.migration_failures.push(format!(
                "PID {} {} -> {}: {}",
                c.pid,
                NODES[c.node],
                NODES[to],
                String::from_utf8_lossy(&o.stderr).trim()
            ));
        }
    }
    totals.migrating += t.elapsed();
    for (code, node, child) in jobs {
        let o = child.wait_with_output().context("wait for ferry run")?;
        totals.jobs += 1;
        if o.status.code() != Some(code as i32) {
            totals.job_failures.push(format!(
                "ferry run --on {node} -- sh -c 'exit {code}': {} ({})",
                o.status,
                String::from_utf8_lossy(&o.stderr).trim()
            ));
        }
    }
    // Every counter runs once, wherever it is now.
    sleep(Duration::from_millis(300));
    for c in counters.iter_mut().filter(|c| c.broken.is_none()) {
        if let Err(e) = c.check() {
            eprintln!("ferry-bench load: {e:#}");
            c.broken = Some(format!("{e:#}"));
        }
    }
    Ok(())
}
