//! `ferry-bench dirty`: pre-copy, lazy and hybrid migration against a writer, in one run. A
//! process (tests/victims/dirtier.c) holds N MiB and rewrites random pages at a share of its
//! memory per second (one write in 64 drops a page instead); it checks every page against its
//! own table each second. For each `--memory` mode, one migration a -> b on a local cluster
//! of two nodes, then the moved process must go on with every page right:
//!
//! - frozen: the report's `freeze_ms` (pre-copy: the freeze until the commit; lazy and hybrid:
//!   from the freeze until the copy ran);
//! - running on b: from the start of the migration until the destination said `Resumed`;
//! - source released: until the source's memory was no longer needed (pre-copy: when
//!   `ferry migrate` returned; lazy and hybrid: the resume plus the lazy phase);
//! - on the wire: the migration's stream (pre-copy rounds, image) plus the pages fetched in
//!   the lazy phase.
//!
//! See docs/benchmarks.md, "Pre-copy, lazy and hybrid against a writer".

use crate::common::{build_c, ferry_binary, markdown, num};
use crate::migrate::{cluster_up, migrate_a_to_b};
use anyhow::{bail, Context, Result};
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

const MIB: f64 = 1048576.0;
const DIRTIER: &str = include_str!("../../../tests/victims/dirtier.c");

#[derive(clap::Args)]
pub struct Args {
    /// The process's memory, MiB.
    #[arg(long, default_value_t = 512)]
    mib: usize,
    /// The share of its memory it rewrites per second, in percent (random pages).
    #[arg(long, default_value_t = 10.0)]
    percent: f64,
    /// `ferry migrate --memory` modes to compare, one after the other in each run.
    #[arg(long, value_delimiter = ',', default_value = "precopy,lazy,hybrid")]
    modes: Vec<String>,
    /// Runs (each moves one process per mode).
    #[arg(long, default_value_t = 1)]
    runs: usize,
    /// The ferry binary to measure (default: the workspace's target/release/ferry).
    #[arg(long)]
    ferry: Option<PathBuf>,
    /// TCP port of the benchmark's own local cluster.
    #[arg(long, default_value_t = 7398)]
    port: u16,
    /// Where the cluster's and the children's directories go.
    #[arg(long, default_value = "/tmp")]
    dir: PathBuf,
}

struct Sample {
    freeze_ms: f64,
    running_ms: f64,
    released_ms: f64,
    total_ms: f64,
    wire_bytes: f64,
    /// A hybrid move's pre-copied pages the copy ran without (copied in after by the
    /// destination's page server), and those still to copy when the source was released.
    local_bytes: f64,
    local_pending_bytes: f64,
    rounds: usize,
    frozen_bytes: f64,
    lazy_bytes: f64,
    /// The report's timeline from the freeze on (ms after the freeze began).
    steps: Vec<(String, f64)>,
}

pub fn run(a: Args) -> Result<()> {
    crate::common::seal_inherited_fds();
    if a.mib == 0 || a.runs == 0 || a.percent.is_nan() || a.percent < 0.0 {
        bail!("--mib and --runs must be above 0, --percent not negative");
    }
    let ferry = ferry_binary(a.ferry.as_deref())?;
    let work = a
        .dir
        .join(format!("ferry-bench-dirty.{}", std::process::id()));
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(&work).with_context(|| format!("create {}", work.display()))?;
    let dirtier = build_c(&work, "dirtier", DIRTIER, "the dirtier")?;
    let result = (|| {
        let cluster = cluster_up(&ferry, a.port, &work.join("cluster"), false)?;
        let mut rows = Vec::new();
        for r in 0..a.runs {
            for mode in &a.modes {
                eprintln!(
                    "ferry-bench: {} MiB dirtied at {} %/s, {mode}, run {}/{}",
                    a.mib,
                    a.percent,
                    r + 1,
                    a.runs
                );
                let dir = work.join(format!("{mode}-{r}"));
                let s = measure(&cluster, &dirtier, &dir, a.mib, a.percent, mode)
                    .with_context(|| format!("{mode}, run {}", r + 1))?;
                rows.push((r + 1, mode.clone(), s));
            }
        }
        Ok::<_, anyhow::Error>(rows)
    })();
    let rows = match result {
        Ok(r) => r,
        Err(e) => {
            let kept = a
                .dir
                .join(format!("ferry-bench-dirty-failed.{}", std::process::id()));
            if fs::rename(&work, &kept).is_ok() {
                return Err(e.context(format!("files kept in {}", kept.display())));
            }
            return Err(e);
        }
    };
    let _ = fs::remove_dir_all(&work);
    print!("{}", table(&a, &rows));
    Ok(())
}

/// The dirtier, our child until it is moved, then its PID on b: killed whatever happens.
struct Victim {
    child: Option<Child>,
    moved: Option<i32>,
    status: PathBuf,
}

impl Victim {
    fn field(&self, k: &str) -> Option<String> {
        fs::read_to_string(&self.status)
            .ok()?
            .split_whitespace()
            .find_map(|w| w.strip_prefix(k))
            .map(str::to_string)
    }

    fn count(&self) -> u64 {
        self.field("count=")
            .and_then(|c| c.parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for Victim {
    fn drop(&mut self) {
        if let Some(p) = self.moved {
            let _ = Command::new("kill")
                .args(["-9", &p.to_string()])
                .stderr(Stdio::null())
                .status();
        }
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn measure(
    cluster: &crate::common::Cluster,
    dirtier: &Path,
    dir: &Path,
    mib: usize,
    percent: f64,
    mode: &str,
) -> Result<Sample> {
    fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let status = dir.join("status");
    let pages_per_s = (mib as f64 * 256.0 * percent / 100.0).round() as u64;
    let child = Command::new(dirtier)
        .arg(mib.to_string())
        .arg(pages_per_s.to_string())
        .arg(&status)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("start the dirtier")?;
    let pid = child.id() as i32;
    let mut v = Victim {
        child: Some(child),
        moved: None,
        status,
    };
    let start = Instant::now();
    while v.count() < 2 {
        if start.elapsed() > Duration::from_secs(120) {
            bail!("the dirtier did not start");
        }
        sleep(Duration::from_millis(20));
    }
    // Writing at its pace for a second before it moves.
    sleep(Duration::from_secs(1));
    let report = migrate_a_to_b(cluster, pid, dir, mode)?;
    v.moved = Some(num(&report, "dest_pid")? as i32);
    // Every page is checked once a second: two seconds of checks on b, all of them right.
    let before = v.count();
    let start = Instant::now();
    while v.count() < before + 100 {
        if v.field("ok=").as_deref() != Some("1") {
            bail!("{mode}: a page came back wrong on b");
        }
        if start.elapsed() > Duration::from_secs(30) {
            bail!("{mode}: the moved dirtier stopped");
        }
        sleep(Duration::from_millis(50));
    }
    if v.field("ok=").as_deref() != Some("1") {
        bail!("{mode}: a page came back wrong on b");
    }
    let lazy = report.get("lazy").filter(|l| !l.is_null());
    let lazy_bytes = lazy.and_then(|l| l["source_bytes"].as_f64()).unwrap_or(0.0);
    let total_ms = num(&report, "total_ms")?;
    let resumed_ms = report["resumed_ms"].as_f64().unwrap_or(0.0);
    let released_ms = match lazy.and_then(|l| l["source_released_after_resume_ms"].as_f64()) {
        Some(after) => resumed_ms + after,
        None => total_ms,
    };
    let m = &report["memory"];
    let _ = fs::remove_dir_all(dir);
    Ok(Sample {
        freeze_ms: num(&report, "freeze_ms")?,
        running_ms: resumed_ms,
        released_ms,
        total_ms,
        wire_bytes: num(&report, "wire_bytes")? + lazy_bytes,
        rounds: m["rounds"].as_array().map_or(0, Vec::len),
        frozen_bytes: m["frozen_bytes"].as_f64().unwrap_or(0.0),
        lazy_bytes,
        local_bytes: lazy
            .and_then(|l| l["local_owed_bytes"].as_f64())
            .unwrap_or(0.0),
        local_pending_bytes: lazy
            .and_then(|l| l["local_pending_bytes"].as_f64())
            .unwrap_or(0.0),
        steps: crate::migrate::steps(&report),
    })
}

fn table(a: &Args, rows: &[(usize, String, Sample)]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\n{} MiB, random pages rewritten at {} % of it per second (ms from the start of \
         `ferry migrate`)\n",
        a.mib, a.percent
    );
    let head = [
        "run",
        "memory",
        "frozen (ms)",
        "running on b",
        "source released",
        "migrate returned",
        "rounds",
        "in the image (MiB)",
        "lazily (MiB)",
        "on the wire (MiB)",
        "pre-copied, in after it ran (MiB)",
        "of them, after the release (MiB)",
    ];
    let mut lines = vec![head.iter().map(|h| h.to_string()).collect::<Vec<_>>()];
    for (run, mode, x) in rows {
        lines.push(vec![
            run.to_string(),
            mode.clone(),
            format!("{:.0}", x.freeze_ms),
            format!("{:.0}", x.running_ms),
            format!("{:.0}", x.released_ms),
            format!("{:.0}", x.total_ms),
            x.rounds.to_string(),
            format!("{:.1}", x.frozen_bytes / MIB),
            format!("{:.1}", x.lazy_bytes / MIB),
            format!("{:.1}", x.wire_bytes / MIB),
            format!("{:.1}", x.local_bytes / MIB),
            format!("{:.1}", x.local_pending_bytes / MIB),
        ]);
    }
    s.push_str(&markdown(&lines));
    // Where each freeze went: the first run's timeline, one column per mode.
    let first: Vec<&(usize, String, Sample)> = rows.iter().filter(|r| r.0 == 1).collect();
    let Some(longest) = first.iter().max_by_key(|r| r.2.steps.len()) else {
        return s;
    };
    let _ = writeln!(
        s,
        "\nWhere the freeze went (run 1: when each step ended, ms after the freeze began)\n"
    );
    let mut head = vec!["step".to_string()];
    head.extend(first.iter().map(|r| r.1.clone()));
    let mut lines = vec![head];
    for (what, _) in &longest.2.steps {
        let mut line = vec![what.clone()];
        for r in &first {
            line.push(
                r.2.steps
                    .iter()
                    .find(|(w, _)| w == what)
                    .map_or("-".into(), |(_, t)| format!("{t:.1}")),
            );
        }
        lines.push(line);
    }
    s.push_str(&markdown(&lines));
    s
}
