//! `ferry-bench touch`: the touched fraction (Accent's question: where does copy-on-reference
//! stop paying?). A process holds N MiB of non-zero pseudo-random data; once it has moved
//! (it watches its PID namespace: a moved process runs in one of its own) it reads a share of
//! its pages, a fixed pseudo-random spread (the hard case for prefetch: no two touched pages
//! need be neighbours), and checks them. For each share and each `--memory` mode, one
//! migration a -> b on a local cluster of two nodes:
//!
//! - running on b after: from the start of `ferry migrate` until the process first ran
//!   there (its own wall clock; both nodes share this machine's);
//! - touched pages there after: until it had read the last of its touched pages;
//! - moved: the bytes of the migration's stream (image and pre-copy rounds) plus, lazily, the
//!   pages the destination fetched;
//!
//! against memcpy of N MiB in the same run. See docs/benchmarks.md.

use crate::common::{ferry_binary, markdown, memcpy_ms, num, random_bytes, Holder, HOLD_TIMEOUT};
use crate::migrate::{cluster_up, migrate_a_to_b};
use anyhow::{bail, Context, Result};
use std::fmt::Write as _;
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::thread::sleep;
use std::time::{Duration, Instant};

const MIB: f64 = 1048576.0;

#[derive(clap::Args)]
pub struct Args {
    /// The process's memory, MiB.
    #[arg(long, default_value_t = 512)]
    mib: usize,
    /// Shares of its pages it reads once moved, in percent.
    #[arg(long, value_delimiter = ',', default_value = "1,10,100")]
    percents: Vec<f64>,
    /// `ferry migrate --memory` modes to compare.
    #[arg(long, value_delimiter = ',', default_value = "eager,precopy,lazy")]
    modes: Vec<String>,
    /// Migrations per share and mode; the one with the median time until the touched pages
    /// are there is shown.
    #[arg(long, default_value_t = 1)]
    runs: usize,
    /// The ferry binary to measure (default: the workspace's target/release/ferry).
    #[arg(long)]
    ferry: Option<PathBuf>,
    /// TCP port of the benchmark's own local cluster.
    #[arg(long, default_value_t = 7396)]
    port: u16,
    /// Where the cluster's and the children's directories go.
    #[arg(long, default_value = "/tmp")]
    dir: PathBuf,
}

#[derive(Clone, Default)]
struct Sample {
    running_ms: f64,
    touched_ms: f64,
    migrate_ms: f64,
    freeze_ms: f64,
    moved_bytes: f64,
    lazy_bytes: f64,
}

pub fn run(a: Args) -> Result<()> {
    crate::common::seal_inherited_fds();
    if a.mib == 0 || a.runs == 0 || a.percents.iter().any(|p| !(*p > 0.0 && *p <= 100.0)) {
        bail!("--mib and --runs must be above 0, --percents in (0, 100]");
    }
    let ferry = ferry_binary(a.ferry.as_deref())?;
    let work = a
        .dir
        .join(format!("ferry-bench-touch.{}", std::process::id()));
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(&work).with_context(|| format!("create {}", work.display()))?;
    let copy_ms = memcpy_ms(&random_bytes(a.mib << 20, 42))?;
    let result = (|| {
        let cluster = cluster_up(&ferry, a.port, &work.join("cluster"), false)?;
        let mut rows = Vec::new();
        for &pct in &a.percents {
            for mode in &a.modes {
                let mut samples = Vec::new();
                for r in 0..a.runs {
                    eprintln!(
                        "ferry-bench: {} MiB, {pct} % touched, {mode}, run {}/{}",
                        a.mib,
                        r + 1,
                        a.runs
                    );
                    let dir = work.join(format!("{pct}-{mode}-{r}"));
                    samples.push(
                        measure(&cluster, &dir, a.mib, pct, mode)
                            .with_context(|| format!("{pct} % touched, {mode}, run {}", r + 1))?,
                    );
                }
                samples.sort_by(|x, y| x.touched_ms.total_cmp(&y.touched_ms));
                rows.push((pct, mode.clone(), samples.swap_remove(samples.len() / 2)));
            }
        }
        Ok::<_, anyhow::Error>(rows)
    })();
    let rows = match result {
        Ok(r) => r,
        Err(e) => {
            let kept = a
                .dir
                .join(format!("ferry-bench-touch-failed.{}", std::process::id()));
            if fs::rename(&work, &kept).is_ok() {
                return Err(e.context(format!("files kept in {}", kept.display())));
            }
            return Err(e);
        }
    };
    let _ = fs::remove_dir_all(&work);
    print!("{}", table(&a, copy_ms, &rows));
    Ok(())
}

fn measure(
    cluster: &crate::common::Cluster,
    dir: &Path,
    mib: usize,
    pct: f64,
    mode: &str,
) -> Result<Sample> {
    fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let shape = crate::hold::Shape {
        touch_permille: ((pct * 10.0).round() as usize).clamp(1, 1000),
        ..Default::default()
    };
    let (mut holder, sum) = Holder::start_shaped(dir, mib, shape, Duration::from_millis(2))?;
    sleep(Duration::from_millis(100));
    let t0 = std::time::SystemTime::now();
    let started = Instant::now();
    let report = migrate_a_to_b(cluster, holder.pid, dir, mode)?;
    let migrate_ms = started.elapsed().as_secs_f64() * 1e3;
    let deputy = holder.child.take();
    holder.pid = num(&report, "dest_pid")? as i32;
    // (Not needed by a touching child; harmless.)
    File::create(dir.join("go"))?;
    let result = holder.wait_file(&dir.join("result"), HOLD_TIMEOUT, Duration::from_millis(2))?;
    let mut f = result.split_whitespace();
    let (got, moved, done) = (f.next(), f.next(), f.next());
    if got != Some(sum.trim()) {
        bail!("the moved child's touched pages differ: {result:?} on b, {sum} before");
    }
    let start_ns = t0
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as f64)
        .unwrap_or(0.0);
    let ms = |t: Option<&str>| -> Result<f64> {
        let t: f64 = t
            .and_then(|t| t.parse().ok())
            .context("result without times")?;
        Ok((t - start_ns) / 1e6)
    };
    let (running_ms, touched_ms) = (ms(moved)?, ms(done)?);
    holder.wait_moved_end(deputy)?;
    let _ = fs::remove_dir_all(dir);
    let lazy_bytes = report["lazy"]["source_bytes"].as_f64().unwrap_or(0.0);
    Ok(Sample {
        running_ms,
        touched_ms,
        migrate_ms,
        freeze_ms: num(&report, "freeze_ms")?,
        moved_bytes: num(&report, "wire_bytes")? + lazy_bytes,
        lazy_bytes,
    })
}

fn table(a: &Args, copy_ms: f64, rows: &[(f64, String, Sample)]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\n{} MiB, touched after the move ({} run{} each, the median by 'touched there'; ms from \
         the start of `ferry migrate`; memcpy of {} MiB: {copy_ms:.0} ms)\n",
        a.mib,
        a.runs,
        if a.runs == 1 { "" } else { "s" },
        a.mib
    );
    let head = [
        "touched",
        "memory",
        "running on b",
        "touched pages there",
        "frozen",
        "migrate returned",
        "moved MiB",
        "of it by page request",
        "touched there / memcpy",
    ];
    let mut lines = vec![head.iter().map(|h| h.to_string()).collect::<Vec<_>>()];
    for (pct, mode, x) in rows {
        lines.push(vec![
            format!("{pct} %"),
            mode.clone(),
            format!("{:.0}", x.running_ms),
            format!("{:.0}", x.touched_ms),
            format!("{:.0}", x.freeze_ms),
            format!("{:.0}", x.migrate_ms),
            format!("{:.1}", x.moved_bytes / MIB),
            format!("{:.1}", x.lazy_bytes / MIB),
            format!("{:.1}x", x.touched_ms / copy_ms),
        ]);
    }
    s.push_str(&markdown(&lines));
    s
}
