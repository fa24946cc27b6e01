//! `ferry-bench remote-exec`: what `ferry run` costs against running the program here.
//!
//! Starts a local cluster of two nodes (a, b) with the measured ferry binary, then, run by run
//! and interleaved (so that drift on a shared machine hits every variant alike):
//!
//! 1. *local*: fork, exec and wait for the command from this process (`Command::status`);
//! 2. `ferry nodes` on a: the fixed cost of a ferry CLI asking its daemon one thing;
//! 3. `ferry run --on a -- CMD`: node a's daemon runs the command itself (no network);
//! 4. `ferry run --on b -- CMD`: relayed by a to b over mutual TLS, a fresh connection each
//!    time.
//!
//! Then a stream: `head -c N /dev/zero` read here through a pipe, locally and through
//! `ferry run --on b`. See docs/benchmarks.md.

use crate::common::{cpus_and_kernel, stats, stats_header, stats_row, Cluster};
use crate::engine::{ferry_binary, markdown};
use anyhow::{bail, Context, Result};
use std::fmt::Write as _;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// Runs of each variant (after a few unmeasured warm-up runs).
    #[arg(long, default_value_t = 200)]
    runs: usize,
    /// The command to run, with its arguments.
    #[arg(long, default_value = "/bin/true", num_args = 1.., allow_hyphen_values = true)]
    command: Vec<String>,
    /// The ferry binary to measure. Default: the workspace's target/release/ferry, brought up to
    /// date with `cargo build --release -p ferry` first.
    #[arg(long)]
    ferry: Option<PathBuf>,
    /// TCP port of the benchmark's own local cluster (on 127.0.0.11 and .12).
    #[arg(long, default_value_t = 7390)]
    port: u16,
    /// MiB of stdout for the streaming measurement (0: skip it).
    #[arg(long, default_value_t = 512)]
    stream_mib: u64,
    /// Rounds of the streaming measurement (each local, then through ferry run; the median is
    /// reported).
    #[arg(long, default_value_t = 3)]
    stream_rounds: usize,
    /// The nodes confine guests (`ferry cluster up --confine-guests`), the runs starting in a
    /// fresh shared tree (else `--no-confine-guests`, from this directory).
    #[arg(long)]
    confine: bool,
    /// And give programs run for another node a network of their own (`--confine-network`;
    /// implies --confine).
    #[arg(long)]
    confine_network: bool,
}

/// The local cluster of two nodes, stopped however the benchmark ends.
pub(crate) fn cluster_up(ferry: &Path, port: u16) -> Result<Cluster> {
    cluster_up_with(ferry, port, &[])
}

/// `cluster_up` with more arguments for `ferry cluster up`.
fn cluster_up_with(ferry: &Path, port: u16, extra: &[&str]) -> Result<Cluster> {
    let port = port.to_string();
    // One network stack and file system for both nodes, as when docs/benchmarks.md
    // was measured (and the benchmark's files may lie in /tmp).
    let mut args = vec!["--nodes", "2", "--port", &port, "--isolation", "shared"];
    args.extend_from_slice(extra);
    Cluster::up_fresh(
        ferry,
        &format!("ferry-bench-remote.{}", std::process::id()),
        &args,
        &[],
    )
}

/// `ferry ARGS` on node a, its stdout discarded.
pub(crate) fn ferry_a(c: &Cluster, args: &[&str]) -> Command {
    let mut cmd = c.ferry_on("a");
    cmd.args(args).stdout(Stdio::null());
    cmd
}

/// Runs `cmd` to the end and returns its wall time in ms; a failure fails the benchmark.
fn timed(cmd: &mut Command, what: &str) -> Result<f64> {
    let t = Instant::now();
    let st = cmd.status().with_context(|| format!("start {what}"))?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    if !st.success() {
        bail!("{what} failed: {st}");
    }
    Ok(ms)
}

/// Reads all of `cmd`'s stdout; returns MiB/s.
fn stream(mut cmd: Command, mib: u64, what: &str) -> Result<f64> {
    let t = Instant::now();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("start {what}"))?;
    let mut out = child.stdout.take().expect("piped");
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = out.read(&mut buf).with_context(|| format!("read {what}"))?;
        if n == 0 {
            break;
        }
        total += n as u64;
    }
    let st = child.wait()?;
    let secs = t.elapsed().as_secs_f64();
    if !st.success() || total != mib << 20 {
        bail!("{what}: {st}, {total} bytes");
    }
    Ok(mib as f64 / secs)
}

pub fn run(a: Args) -> Result<()> {
    if a.runs == 0 || a.command.is_empty() {
        bail!("--runs must be at least 1 and --command not empty");
    }
    let ferry = ferry_binary(a.ferry.as_deref())?;
    // Not under /tmp: a confined guest's /tmp is its own, over any shared tree lying there.
    let shared =
        Path::new("/var/tmp").join(format!("ferry-bench-remote-shared.{}", std::process::id()));
    let shared_arg = shared.to_string_lossy().into_owned();
    let mut extra = Vec::new();
    if a.confine || a.confine_network {
        std::fs::create_dir_all(&shared)
            .with_context(|| format!("make the shared tree {}", shared.display()))?;
        extra.extend(["--confine-guests", "--shared", shared_arg.as_str()]);
        // A confined guest finds only the shared tree: the runs start there.
        std::env::set_current_dir(&shared)
            .with_context(|| format!("enter the shared tree {}", shared.display()))?;
    }
    if a.confine_network {
        extra.push("--confine-network");
    }
    let cluster = cluster_up_with(&ferry, a.port, &extra)?;
    let cmd: Vec<&str> = a.command.iter().map(String::as_str).collect();
    let line = cmd.join(" ");
    let on = |node: &str| {
        let mut args = vec!["run", "--on", node, "--"];
        args.extend(&cmd);
        ferry_a(&cluster, &args)
    };
    let local = || {
        let mut c = Command::new(cmd[0]);
        c.args(&cmd[1..]).stdin(Stdio::null()).stdout(Stdio::null());
        c
    };
    let labels = [
        format!("local fork/exec/wait of {line}"),
        "ferry nodes (CLI to its daemon, reference)".to_string(),
        format!("ferry run --on a -- {line} (this node)"),
        format!("ferry run --on b -- {line}"),
    ];
    let mut samples: [Vec<f64>; 4] = Default::default();
    let warmup = 5.min(a.runs);
    eprintln!(
        "ferry-bench: {} runs of each (after {warmup} warm-up runs)",
        a.runs
    );
    for i in 0..warmup + a.runs {
        let t = [
            timed(&mut local(), &labels[0])?,
            timed(&mut ferry_a(&cluster, &["nodes"]), &labels[1])?,
            timed(&mut on("a"), &labels[2])?,
            timed(&mut on("b"), &labels[3])?,
        ];
        if i >= warmup {
            for (s, t) in samples.iter_mut().zip(t) {
                s.push(t);
            }
        }
    }
    let base = stats(&samples[0]).median;
    let mut lines = vec![stats_header("median / local")];
    for (label, s) in labels.iter().zip(&samples) {
        let st = stats(s);
        lines.push(stats_row(label, &st, format!("{:.1}", st.median / base)));
    }
    let mut out = String::new();
    let (cpus, kernel) = cpus_and_kernel();
    let _ = writeln!(
        out,
        "machine: {cpus} CPUs, kernel {kernel}; ferry: {}; {} runs each; cluster up {}\n",
        ferry.display(),
        a.runs,
        if extra.is_empty() {
            "--no-confine-guests".to_string()
        } else {
            extra.join(" ")
        }
    );
    out.push_str(&markdown(&lines));
    let _ = writeln!(
        out,
        "\nSprite (Ousterhout et al., 1988, Sun-3/75): remote exec 81 ms against a local \
         fork/exec 46 ms, ratio 1.8."
    );

    if a.stream_mib > 0 {
        let n = (a.stream_mib << 20).to_string();
        let head = ["head", "-c", n.as_str(), "/dev/zero"];
        let mut rates: [Vec<f64>; 2] = Default::default();
        for _ in 0..a.stream_rounds.max(1) {
            let mut c = Command::new("head");
            c.args(&head[1..]);
            rates[0].push(stream(c, a.stream_mib, "local head")?);
            let mut args = vec!["run", "--on", "b", "--"];
            args.extend(head);
            rates[1].push(stream(
                ferry_a(&cluster, &args),
                a.stream_mib,
                "ferry run head",
            )?);
        }
        let (l, r) = (stats(&rates[0]).median, stats(&rates[1]).median);
        let lines = vec![
            vec![
                format!("stdout of head -c {}M /dev/zero, read here", a.stream_mib),
                format!("MiB/s (median of {})", a.stream_rounds.max(1)),
            ],
            vec!["local pipe".into(), format!("{l:.0}")],
            vec!["ferry run --on b".into(), format!("{r:.0}")],
        ];
        out.push('\n');
        out.push_str(&markdown(&lines));
    }
    drop(cluster);
    let _ = std::fs::remove_dir_all(&shared);
    print!("{out}");
    Ok(())
}
