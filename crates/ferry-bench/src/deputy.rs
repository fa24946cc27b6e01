//! `ferry-bench deputy`: what a moved child's home costs its parent.
//!
//! On a local cluster of two nodes (a is home), run by run and interleaved with the same thing
//! for a child that never moved:
//!
//! 1. *signal*: the parent (this process) sends SIGTERM to its child's PID and times until its
//!    `waitpid` returns. Moved: the deputy holds the signal back, a's daemon passes it to b,
//!    b delivers it to the body, the body dies, b's guest init reaps it and reports it, a's
//!    daemon tells the deputies' worker, and the deputy dies of SIGTERM too.
//! 2. *exit*: the child exits with code 7 at a wall-clock deadline it was given; the time from
//!    that deadline until the parent's `waitpid` returns (one machine: one wall clock).
//!
//! The migration itself is not timed here (`ferry-bench migrate` does). See docs/benchmarks.md.

use crate::common::{ferry_binary, markdown};
use crate::remote_exec::{stats, Cluster};
use anyhow::{bail, Context, Result};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

#[derive(clap::Args)]
pub struct Args {
    /// Runs of each variant.
    #[arg(long, default_value_t = 20)]
    runs: usize,
    /// The ferry binary to measure. Default: the workspace's target/release/ferry, brought up to
    /// date with `cargo build --release -p ferry` first.
    #[arg(long)]
    ferry: Option<PathBuf>,
    /// TCP port of the benchmark's own local cluster (on 127.0.0.11 and .12).
    #[arg(long, default_value_t = 7395)]
    port: u16,
}

/// A child that exits with 7 at `deadline` (seconds since the epoch), or dies of a signal.
fn child(deadline: f64) -> Result<Child> {
    Command::new("python3")
        .args([
            "-c",
            "import sys,time\nt=float(sys.argv[1])\nwhile True:\n    d=t-time.time()\n    \
             if d<=0: sys.exit(7)\n    time.sleep(min(d,0.5))",
            &format!("{deadline:.6}"),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("start python3")
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Waits for the child and returns how it ended.
fn wait(c: &mut Child) -> Result<std::process::ExitStatus> {
    c.wait().context("wait for the child")
}

pub fn run(a: Args) -> Result<()> {
    if a.runs == 0 {
        bail!("--runs must be at least 1");
    }
    // The children must hold nothing of whatever started the benchmark: a pipe inherited from
    // it would be shared with a process that stays behind, which a migration refuses.
    for fd in std::fs::read_dir("/proc/self/fd")?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&fd| fd > 2)
    {
        // SAFETY: fcntl on a descriptor number; at worst EBADF.
        unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    }
    let ferry = ferry_binary(a.ferry.as_deref())?;
    let cluster = Cluster::up(&ferry, a.port)?;
    let moved = |c: &Child| -> Result<()> {
        // python3 takes a moment to start; a half-started interpreter moves too, but then
        // its start is measured as well.
        std::thread::sleep(Duration::from_millis(150));
        let o = cluster
            .ferry(&["migrate", &c.id().to_string(), "--to", "b"])
            .stderr(Stdio::piped())
            .output()
            .context("run ferry migrate")?;
        if !o.status.success() {
            bail!("ferry migrate: {}", String::from_utf8_lossy(&o.stderr));
        }
        Ok(())
    };
    let mut samples: [Vec<f64>; 4] = Default::default();
    eprintln!("ferry-bench: {} runs of each", a.runs);
    for _ in 0..a.runs {
        for (k, moving) in [false, true].into_iter().enumerate() {
            // 1. A signal at home until the parent sees the death.
            let mut c = child(now() + 600.0)?;
            if moving {
                moved(&c)?;
            } else {
                std::thread::sleep(Duration::from_millis(150));
            }
            let t = Instant::now();
            // SAFETY: kill() on our own child's PID.
            if unsafe { libc::kill(c.id() as i32, libc::SIGTERM) } != 0 {
                bail!("kill: {}", std::io::Error::last_os_error());
            }
            let st = wait(&mut c)?;
            samples[k].push(t.elapsed().as_secs_f64() * 1e3);
            if st.signal() != Some(libc::SIGTERM) {
                bail!("the child ended with {st}, not SIGTERM (moved: {moving})");
            }
            // 2. The body's exit until the parent sees it.
            let deadline = now() + 1.0;
            let mut c = child(deadline)?;
            if moving {
                moved(&c)?;
            }
            let st = wait(&mut c)?;
            let late = (now() - deadline) * 1e3;
            if st.code() != Some(7) {
                bail!("the child ended with {st}, not exit 7 (moved: {moving})");
            }
            if now() - deadline > 5.0 || late < 0.0 {
                bail!("the child ended {late:.1} ms after its deadline (moved: {moving})");
            }
            samples[2 + k].push(late);
        }
    }
    let labels = [
        "SIGTERM at home -> parent's wait sees it: child never moved",
        "SIGTERM at home -> parent's wait sees it: child moved to b (deputy)",
        "exit at its deadline -> parent's wait sees it: child never moved",
        "exit at its deadline -> parent's wait sees it: child moved to b (deputy)",
    ];
    let mut lines = vec![vec![
        "what".to_string(),
        "mean ms".into(),
        "median ms".into(),
        "min ms".into(),
        "p90 ms".into(),
        "median vs local".into(),
    ]];
    for (i, l) in labels.iter().enumerate() {
        let s = stats(&samples[i]);
        let base = stats(&samples[i - i % 2]).median;
        lines.push(vec![
            l.to_string(),
            format!("{:.2}", s.mean),
            format!("{:.2}", s.median),
            format!("{:.2}", s.min),
            format!("{:.2}", s.p90),
            format!("{:.1}x", s.median / base.max(1e-9)),
        ]);
    }
    println!("{}", markdown(&lines));
    Ok(())
}
