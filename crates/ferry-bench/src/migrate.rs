//! `ferry-bench migrate`: live migration between two nodes against a plain memory copy.
//!
//! Starts a local cluster of two nodes (a, b) with the measured ferry binary, then for each
//! size, one after the other:
//!
//! 1. the physical limit: `memcpy` of that many bytes between two pre-faulted buffers in this
//!    process (best of several copies; the engine benchmark's baseline);
//! 2. a child (`ferry-bench hold`) fills that much memory with non-zero pseudo-random data and
//!    says ready;
//! 3. `ferry --node a migrate PID --to b --json`, timed from outside as well;
//! 4. the child, now on b, checksums its memory again: a migration that lost or changed a
//!    word fails the benchmark instead of producing a number.
//!
//! Then the smallest process there is to move, the same child holding no memory (a "null
//! process"), next to the times published for Sprite and OSF/1 AD. See docs/benchmarks.md.

use crate::common::{
    ferry_binary, ferry_json, markdown, memcpy_ms, num, random_bytes, Cluster, Holder, HOLD_TIMEOUT,
};
use anyhow::{bail, Context, Result};
use std::fmt::Write as _;
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::thread::sleep;
use std::time::{Duration, Instant};

const MIB: f64 = 1048576.0;
const GIB: f64 = 1073741824.0;
/// Null-process migration times published for earlier systems, in ms.
const LITERATURE: [(&str, f64); 2] = [
    ("Sprite (Douglis & Ousterhout, 1991)", 76.0),
    ("OSF/1 AD (Zajcew et al., 1993)", 1450.0),
];

#[derive(clap::Args)]
pub struct Args {
    /// Memory sizes to measure, in MiB, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,64,512,2048")]
    sizes: Vec<usize>,
    /// Migrations per size; the table shows the one with the median freeze time.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Migrations of the null process (0 MiB); the median is shown.
    #[arg(long, default_value_t = 10)]
    null_runs: usize,
    /// The ferry binary to measure. Default: the workspace's target/release/ferry, brought up to
    /// date with `cargo build --release -p ferry` first.
    #[arg(long)]
    ferry: Option<PathBuf>,
    /// TCP port of the benchmark's own local cluster (on 127.0.0.11 and .12).
    #[arg(long, default_value_t = 7392)]
    port: u16,
    /// Where the cluster's and the children's directories go (a fresh directory inside it,
    /// removed afterwards).
    #[arg(long, default_value = "/tmp")]
    dir: PathBuf,
    /// Also print ferry's JSON report of every migration.
    #[arg(long)]
    verbose: bool,
    /// How memory moves (`ferry migrate --memory`): eager (stop-and-copy, as the tables of
    /// docs/benchmarks.md were measured), precopy, lazy or auto.
    #[arg(long, default_value = "eager", value_parser = ["eager", "precopy", "lazy", "auto"])]
    memory: String,
    /// The child's memory compresses (a byte of noise in each 8) instead of being all noise.
    #[arg(long)]
    compressible: bool,
    /// The nodes compress the stream between them where it pays (`ferry cluster up
    /// --compress`; off by default).
    #[arg(long)]
    compress: bool,
}

/// One migration (times in ms).
#[derive(Default, Clone)]
struct Sample {
    copy_ms: f64,
    /// From the daemon's start of the migration until the copy ran on b (`resumed_ms`).
    resumed: f64,
    /// Lazy: pages brought by faults and by the push; the source released after the resume.
    fault_pages: f64,
    pushed_pages: f64,
    released: f64,
    wall: f64,
    total: f64,
    freeze: f64,
    preflight: f64,
    offer: f64,
    transfer: f64,
    restore: f64,
    commit: f64,
    /// The destination's restore worker: loading the image as it streams in, then rebuilding.
    dest_load: f64,
    dest_rebuild: f64,
    wire_bytes: f64,
    image_bytes: f64,
    /// CPU time used by node a's daemon and its workers, and by b's, during the migration.
    cpu_a: f64,
    cpu_b: f64,
    /// Over all runs of this size: the shortest and longest freeze.
    freeze_min: f64,
    freeze_max: f64,
    /// The report's timeline from the freeze on: each step, and when it ended (ms after the
    /// freeze began).
    steps: Vec<(String, f64)>,
}

pub fn run(a: Args) -> Result<()> {
    // The child must hold nothing of whatever started the benchmark (a pipe shared with a
    // process that stays behind would be relayed, and measured).
    crate::common::seal_inherited_fds();
    if a.sizes.is_empty() || a.sizes.contains(&0) {
        bail!("--sizes needs sizes in MiB, all above 0 (the null process is measured anyway)");
    }
    if a.runs == 0 || a.null_runs == 0 {
        bail!("--runs and --null-runs must be at least 1");
    }
    if cfg!(debug_assertions) {
        eprintln!(
            "ferry-bench: this is a debug build: filling and checking memory will be slow \
             (the measurements of ferry are not affected); use cargo run --release -p ferry-bench"
        );
    }
    let ferry = ferry_binary(a.ferry.as_deref())?;
    let work = a
        .dir
        .join(format!("ferry-bench-migrate.{}", std::process::id()));
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(&work).with_context(|| format!("create {}", work.display()))?;
    let result = (|| {
        let cluster = cluster_up(&ferry, a.port, &work.join("cluster"), a.compress)?;
        let rows = measure_all(&a, &cluster, &work)?;
        let null = (0..a.null_runs)
            .map(|r| {
                eprintln!("ferry-bench: null process, run {}/{}", r + 1, a.null_runs);
                measure(&a, &cluster, &work.join(format!("null-{r}")), 0)
                    .with_context(|| format!("null process, run {}", r + 1))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok::<_, anyhow::Error>((rows, null))
    })();
    let (rows, null) = match result {
        Ok(x) => x,
        Err(e) => {
            // Keep the evidence (the daemons' logs, the children's directories).
            let kept = a
                .dir
                .join(format!("ferry-bench-migrate-failed.{}", std::process::id()));
            if fs::rename(&work, &kept).is_ok() {
                return Err(e.context(format!("files kept in {}", kept.display())));
            }
            return Err(e);
        }
    };
    let _ = fs::remove_dir_all(&work);
    print!("{}", machine(&ferry));
    print!("{}", table(&rows, &null, a.runs));
    print!("{}", resume_table(&rows, &a.memory));
    print!("{}", steps_table(&rows));
    Ok(())
}

fn measure_all(a: &Args, cluster: &Cluster, work: &Path) -> Result<Vec<(usize, Sample)>> {
    let mut rows = Vec::new();
    for &mib in &a.sizes {
        let mut samples = Vec::new();
        for r in 0..a.runs {
            eprintln!("ferry-bench: {mib} MiB, run {}/{}", r + 1, a.runs);
            let dir = work.join(format!("{mib}-{r}"));
            let s = measure(a, cluster, &dir, mib)
                .with_context(|| format!("{mib} MiB, run {}", r + 1))?;
            samples.push(s);
        }
        rows.push((mib, median(samples)));
    }
    Ok(rows)
}

/// The run with the median freeze time, whole (its parts add up), with the range of all.
fn median(mut samples: Vec<Sample>) -> Sample {
    samples.sort_by(|a, b| a.freeze.total_cmp(&b.freeze));
    let (min, max) = (samples[0].freeze, samples[samples.len() - 1].freeze);
    let mut m = samples.swap_remove(samples.len() / 2);
    m.freeze_min = min;
    m.freeze_max = max;
    m
}

// ---------------------------------------------------------------------------
// The cluster.

/// A local cluster of two nodes, a and b, stopped however the benchmark ends.
pub(crate) fn cluster_up(ferry: &Path, port: u16, dir: &Path, compress: bool) -> Result<Cluster> {
    let port = port.to_string();
    // One network stack and file system for both nodes, as when docs/benchmarks.md
    // was measured (and the benchmark's files may lie in /tmp).
    let mut args = vec!["--nodes", "2", "--port", &port, "--isolation", "shared"];
    if compress {
        args.push("--compress");
    }
    Cluster::up_in(ferry, dir, &args)
}

/// CPU time (ms) node `node`'s daemon has used so far, with its children that it reaped
/// (its engine workers).
fn cpu_ms(c: &Cluster, node: &str) -> Result<f64> {
    let pid = fs::read_to_string(c.dir.join(node).join("daemon.pid"))
        .with_context(|| format!("node {node}'s daemon.pid"))?;
    let stat = fs::read_to_string(format!("/proc/{}/stat", pid.trim()))
        .with_context(|| format!("node {node}'s daemon (PID {})", pid.trim()))?;
    // utime, stime, cutime, cstime: fields 14 to 17, the 12th to 15th after the ")".
    let ticks: f64 = stat[stat.rfind(')').unwrap_or(0) + 1..]
        .split_whitespace()
        .skip(11)
        .take(4)
        .filter_map(|t| t.parse::<f64>().ok())
        .sum();
    // SAFETY: sysconf has no memory effects.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Ok(ticks * 1e3 / hz)
}

/// `ferry --node a migrate PID --to b --json`, with a time limit: the report.
pub(crate) fn migrate_a_to_b(
    c: &Cluster,
    pid: i32,
    dir: &Path,
    memory: &str,
) -> Result<serde_json::Value> {
    let pid = pid.to_string();
    ferry_json(
        c.ferry_on("a"),
        &["migrate", &pid, "--to", "b", "--json", "--memory", memory],
        dir,
        "migrate",
    )
}

// ---------------------------------------------------------------------------
// One migration.

/// The `hold` child, here (our child) or moved (its PID on b): killed whatever happens.
fn measure(a: &Args, cluster: &Cluster, dir: &Path, mib: usize) -> Result<Sample> {
    fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let copy_ms = if mib > 0 {
        memcpy_ms(&random_bytes(mib << 20, 42))?
    } else {
        0.0
    };

    let shape = crate::hold::Shape {
        compressible: a.compressible,
        ..Default::default()
    };
    let (mut holder, sum) = Holder::start_shaped(dir, mib, shape, Duration::from_millis(2))?;
    let pid = holder.pid;
    sleep(Duration::from_millis(100));

    let cpu0 = (cpu_ms(cluster, "a")?, cpu_ms(cluster, "b")?);
    let t0 = Instant::now();
    let report = migrate_a_to_b(cluster, pid, dir, &a.memory)?;
    let wall = t0.elapsed().as_secs_f64() * 1e3;
    // The workers have exited; give the daemons a moment to reap them (and count their time).
    sleep(Duration::from_millis(400));
    let cpu1 = (cpu_ms(cluster, "a")?, cpu_ms(cluster, "b")?);
    if a.verbose {
        eprintln!("migrate: {report}");
    }
    // The original, our child, stays home as the deputy of the body on b, and ends as the
    // body does: reaped once the body has ended. From now on the process to watch is b's.
    let deputy = holder.child.take();
    holder.pid = num(&report, "dest_pid")? as i32;

    File::create(dir.join("go"))?;
    let result = holder.wait_file(&dir.join("result"), HOLD_TIMEOUT, Duration::from_millis(2))?;
    if result.trim() != sum {
        bail!(
            "the moved child's memory differs: checksum {} on b, {sum} before",
            result.trim()
        );
    }
    holder.wait_moved_end(deputy)?;
    let _ = fs::remove_dir_all(dir);
    Ok(Sample {
        copy_ms,
        wall,
        total: num(&report, "total_ms")?,
        freeze: num(&report, "freeze_ms")?,
        preflight: num(&report, "preflight_ms")?,
        offer: num(&report, "offer_ms")?,
        transfer: num(&report, "transfer_ms")?,
        restore: num(&report, "restore_ms")?,
        commit: num(&report, "commit_ms")?,
        // (Not reported by ferry before these were added.)
        dest_load: num(&report, "dest_load_ms").unwrap_or(0.0),
        dest_rebuild: num(&report, "dest_rebuild_ms").unwrap_or(0.0),
        wire_bytes: num(&report, "wire_bytes")?,
        image_bytes: num(&report, "image_bytes")?,
        cpu_a: cpu1.0 - cpu0.0,
        cpu_b: cpu1.1 - cpu0.1,
        resumed: num(&report, "resumed_ms").unwrap_or(0.0),
        fault_pages: report["lazy"]["fault_pages"].as_f64().unwrap_or(0.0),
        pushed_pages: report["lazy"]["pushed_pages"].as_f64().unwrap_or(0.0),
        released: report["lazy"]["source_released_after_resume_ms"]
            .as_f64()
            .unwrap_or(0.0),
        steps: steps(&report),
        ..Default::default()
    })
}

/// The steps of the report's timeline from the freeze on, each with when it ended (ms after
/// the freeze began; both nodes share this machine's clock).
pub(crate) fn steps(report: &serde_json::Value) -> Vec<(String, f64)> {
    let stamps: Vec<(String, f64)> = report["timeline"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| Some((s["what"].as_str()?.to_string(), s["unix_us"].as_f64()?)))
        .skip_while(|(what, _)| what != "source: freeze begins")
        .collect();
    let Some(&(_, t0)) = stamps.first() else {
        return Vec::new();
    };
    stamps
        .into_iter()
        .skip(1)
        .map(|(what, t)| (what, (t - t0) / 1e3))
        .collect()
}

// ---------------------------------------------------------------------------
// The report.

fn machine(ferry: &Path) -> String {
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let kernel = fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let model = fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")?
                .split_once(':')
                .map(|x| x.1.trim().to_owned())
        })
        .unwrap_or_default();
    format!(
        "machine: {cpus} CPUs ({model}), kernel {}; ferry: {}; nodes a and b on this machine \
         (loopback, mutual TLS)\n",
        kernel.trim(),
        ferry.display()
    )
}

fn table(rows: &[(usize, Sample)], null: &[Sample], runs: usize) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\nmigration a -> b (of {runs} run{} per size, the one with the median freeze time; \
         times in ms; rate = size / frozen time; %memcpy = memcpy time / frozen time)\n",
        if runs == 1 { "" } else { "s" }
    );
    let head = [
        "size MiB",
        "memcpy GiB/s",
        "migrate",
        "frozen",
        "frozen, all runs",
        "frozen ms/MiB",
        "wire MiB",
        "rate MiB/s",
        "%memcpy",
        "%memcpy (whole migrate)",
    ];
    let mut lines = vec![head.iter().map(|h| h.to_string()).collect::<Vec<_>>()];
    for (mib, x) in rows {
        let m = *mib as f64;
        lines.push(vec![
            mib.to_string(),
            format!("{:.1}", m / 1024.0 / (x.copy_ms / 1e3)),
            format!("{:.0}", x.wall),
            format!("{:.0}", x.freeze),
            format!("{:.0}-{:.0}", x.freeze_min, x.freeze_max),
            format!("{:.2}", x.freeze / m),
            format!("{:.1}", x.wire_bytes / MIB),
            format!("{:.0}", m / (x.freeze / 1e3)),
            format!("{:.1}%", 100.0 * x.copy_ms / x.freeze),
            format!("{:.1}%", 100.0 * x.copy_ms / x.wall),
        ]);
    }
    s.push_str(&markdown(&lines));
    let _ = writeln!(
        s,
        "\nwhere the time goes (ms, from the source daemon's report; 'start' = wall time minus \
         the daemon's total: the CLI and its connection to the daemon; CPU = CPU time of each \
         node's daemon and engine workers, 10 ms resolution; CPU / frozen: how many of the \
         machine's cores the migration kept busy while the process stood still)\n"
    );
    let head = [
        "size MiB",
        "start",
        "preflight",
        "offer",
        "freeze+capture+stream",
        "rebuild after the end",
        "dest: load",
        "dest: rebuild",
        "commit",
        "transfer GiB/s",
        "CPU a",
        "CPU b",
        "CPU / frozen",
    ];
    let mut lines = vec![head.iter().map(|h| h.to_string()).collect::<Vec<_>>()];
    let mut null_sorted = null.to_vec();
    null_sorted.sort_by(|a, b| a.wall.total_cmp(&b.wall));
    let null_median = null_sorted[null_sorted.len() / 2].clone();
    let mut all: Vec<(String, &Sample)> = vec![("0 (null)".into(), &null_median)];
    all.extend(rows.iter().map(|(m, x)| (m.to_string(), x)));
    for (label, x) in all {
        lines.push(vec![
            label,
            format!("{:.0}", x.wall - x.total),
            format!("{:.0}", x.preflight),
            format!("{:.0}", x.offer),
            format!("{:.0}", x.transfer),
            format!("{:.0}", x.restore),
            format!("{:.0}", x.dest_load),
            format!("{:.0}", x.dest_rebuild),
            format!("{:.0}", x.commit),
            if x.transfer > 0.0 && x.image_bytes > MIB {
                format!("{:.2}", x.image_bytes / GIB / (x.transfer / 1e3))
            } else {
                "-".into()
            },
            format!("{:.0}", x.cpu_a),
            format!("{:.0}", x.cpu_b),
            format!("{:.2}", (x.cpu_a + x.cpu_b) / x.freeze),
        ]);
    }
    s.push_str(&markdown(&lines));
    let _ = writeln!(
        s,
        "\nnull process (the benchmark child holding no memory; median of {} migrations) against \
         published null-process migration times\n",
        null.len()
    );
    let mut lines = vec![vec!["what".to_string(), "ms".to_string()]];
    lines.push(vec![
        "ferry migrate, wall time of the command".into(),
        format!("{:.1}", null_median.wall),
    ]);
    let mut frozen: Vec<f64> = null.iter().map(|x| x.freeze).collect();
    frozen.sort_by(f64::total_cmp);
    lines.push(vec![
        "ferry migrate, time the process stood still".into(),
        format!("{:.1}", frozen[frozen.len() / 2]),
    ]);
    lines.push(vec![
        "ferry migrate, image / wire KiB".into(),
        format!(
            "{:.0} / {:.0}",
            null_median.image_bytes / 1024.0,
            null_median.wire_bytes / 1024.0
        ),
    ]);
    for (who, ms) in LITERATURE {
        lines.push(vec![who.into(), format!("{ms:.0}")]);
    }
    s.push_str(&markdown(&lines));
    s
}

/// Time until the process runs on b (the daemon's `resumed_ms`), and a lazy move's lazy phase.
fn resume_table(rows: &[(usize, Sample)], memory: &str) -> String {
    let mut s = format!(
        "\n--memory {memory}: time until the process ran on b (ms from the source daemon's \
         start of the migration until the destination's Resumed reached it; wall: the whole \
         command, which for lazy includes the lazy phase), pages brought by faults and by the \
         push, and the source released after the resume (ms)\n\n"
    );
    let mut lines = vec![[
        "size MiB",
        "running on b after",
        "wall",
        "fault pages",
        "pushed pages",
        "source released after",
    ]
    .iter()
    .map(|h| h.to_string())
    .collect::<Vec<_>>()];
    for (mib, x) in rows {
        lines.push(vec![
            mib.to_string(),
            format!("{:.0}", x.resumed),
            format!("{:.0}", x.wall),
            format!("{:.0}", x.fault_pages),
            format!("{:.0}", x.pushed_pages),
            format!("{:.0}", x.released),
        ]);
    }
    s.push_str(&markdown(&lines));
    s
}

/// Where the freeze went: when each step of the median run's timeline ended (ms after the
/// freeze began), one column per size, and in brackets the ms since the step before it (steps
/// in the order of the first size's run).
fn steps_table(rows: &[(usize, Sample)]) -> String {
    let Some((_, first)) = rows.iter().find(|(_, x)| !x.steps.is_empty()) else {
        return String::new();
    };
    let mut s = "\nWhere the freeze went (the median run's timeline: when each step ended, ms \
                 after the freeze began; in brackets, ms since the step before it)\n\n"
        .to_string();
    let mut header = vec!["step".to_string()];
    header.extend(rows.iter().map(|(mib, _)| format!("{mib} MiB")));
    let mut lines = vec![header];
    for (what, _) in &first.steps {
        let mut line = vec![what.clone()];
        for (_, x) in rows {
            line.push(match x.steps.iter().position(|(w, _)| w == what) {
                Some(i) => {
                    let before = if i == 0 { 0.0 } else { x.steps[i - 1].1 };
                    format!("{:.1} ({:.1})", x.steps[i].1, x.steps[i].1 - before)
                }
                None => "-".into(),
            });
        }
        lines.push(line);
    }
    s.push_str(&markdown(&lines));
    s
}
