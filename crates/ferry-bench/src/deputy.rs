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
//! 3. *calls* (MOSIX Table 5.1's question, for the calls Ferry forwards): a C program makes
//!    each of a few system calls `--calls` times in a row and reports the mean time per call,
//!    at home and moved to b. Moved, `getppid`, `getpgrp` and `getsid` go through Ferry's
//!    seccomp filter to b's guest init (the supervisor) and back; `getpid` and `uname` pass
//!    the filter in the kernel (its cost for calls that stay local).
//!
//! 4. *relays*: a writer streams `--relay-mib` MiB to this process over a pipe (its stdout) or a
//!    TCP connection on the loopback, at home and moved to b: moved, the daemons relay them
//!    (`ferry-daemon/src/relay.rs`), b's end to a's over the cluster's mTLS link. The time runs
//!    from the go-ahead to end of file; the rate is against the same stream at home.
//!
//! The migration itself is not timed here (`ferry-bench migrate` does). See docs/benchmarks.md.

use crate::common::{
    build_c, ferry_binary, markdown, seal_inherited_fds, stats, stats_header, stats_row,
};
use crate::remote_exec::{cluster_up, ferry_a};
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
    /// Calls of each kind per run of the *calls* measure.
    #[arg(long, default_value_t = 20000)]
    calls: u64,
    /// Runs of the *calls* measure, at home and moved each.
    #[arg(long, default_value_t = 5)]
    call_runs: usize,
    /// Only the *calls* measure.
    #[arg(long)]
    calls_only: bool,
    /// Only the *relays* measure.
    #[arg(long, conflicts_with = "calls_only")]
    relays_only: bool,
    /// MiB each run of the *relays* measure streams (0: no relay measure).
    #[arg(long, default_value_t = 256)]
    relay_mib: u64,
    /// Runs of the *relays* measure, at home and moved, per kind.
    #[arg(long, default_value_t = 3)]
    relay_runs: usize,
}

/// The *relays* writer: connects (TCP to 127.0.0.1:PORT, or writes to its stdout for "pipe"),
/// waits for GO to exist, writes BYTES in 64 KiB writes, and exits.
const WRITER_C: &str = r#"
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
int main(int argc, char **argv) {
    if (argc != 4) return 2;
    int fd = 1;
    if (strcmp(argv[2], "pipe")) {
        fd = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(atoi(argv[2])) };
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        if (connect(fd, (struct sockaddr *)&a, sizeof a)) return 3;
    }
    long long left = atoll(argv[3]);
    static char buf[65536];
    memset(buf, 'x', sizeof buf);
    while (access(argv[1], F_OK)) usleep(2000);
    while (left > 0) {
        ssize_t n = write(fd, buf, left < (long long)sizeof buf ? left : (long long)sizeof buf);
        if (n <= 0) return 4;
        left -= n;
    }
    return 0;
}
"#;

/// The *calls* program: waits for GO to exist, then makes each call N times and writes
/// "NAME NS-PER-CALL" lines to OUT (atomically).
const CALLS_C: &str = r#"
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <sys/utsname.h>
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}
int main(int argc, char **argv) {
    if (argc != 4) return 2;
    long n = atol(argv[3]);
    while (access(argv[1], F_OK)) usleep(2000);
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", argv[2]);
    FILE *o = fopen(tmp, "w");
    if (!o) return 3;
    struct utsname u;
#define M(name, call) { double t = now(); for (long i = 0; i < n; i++) { call; } \
        fprintf(o, "%s %.1f\n", name, (now() - t) / n); }
    M("getppid", syscall(SYS_getppid));
    M("getpgrp", syscall(SYS_getpgrp));
    M("getsid", syscall(SYS_getsid, 0));
    M("getpid", syscall(SYS_getpid));
    M("uname", uname(&u));
    fclose(o);
    rename(tmp, argv[2]);
    return 0;
}
"#;

/// The calls measured, in the program's order, and whether Ferry forwards them.
const CALLS: [(&str, bool); 5] = [
    ("getppid", true),
    ("getpgrp", true),
    ("getsid", true),
    ("getpid", false),
    ("uname", false),
];

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
    seal_inherited_fds();
    let ferry = ferry_binary(a.ferry.as_deref())?;
    let cluster = cluster_up(&ferry, a.port)?;
    let moved = |c: &Child| -> Result<()> {
        // python3 takes a moment to start; a half-started interpreter moves too, but then
        // its start is measured as well.
        std::thread::sleep(Duration::from_millis(150));
        let o = ferry_a(&cluster, &["migrate", &c.id().to_string(), "--to", "b"])
            .stderr(Stdio::piped())
            .output()
            .context("run ferry migrate")?;
        if !o.status.success() {
            bail!("ferry migrate: {}", String::from_utf8_lossy(&o.stderr));
        }
        Ok(())
    };
    if a.relays_only {
        if a.relay_mib == 0 {
            bail!("--relays-only needs --relay-mib above 0");
        }
        println!("{}", relays_table(&a, &moved)?);
        return Ok(());
    }
    let calls = calls_table(&a, &moved)?;
    let relays = if a.relay_mib > 0 && !a.calls_only {
        relays_table(&a, &moved)?
    } else {
        String::new()
    };
    if a.calls_only {
        println!("{calls}");
        return Ok(());
    }
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
    let mut lines = vec![stats_header("median vs local")];
    for (i, l) in labels.iter().enumerate() {
        let s = stats(&samples[i]);
        let base = stats(&samples[i - i % 2]).median;
        let ratio = format!("{:.1}x", s.median / base.max(1e-9));
        lines.push(stats_row(l, &s, ratio));
    }
    println!("{}", markdown(&lines));
    println!();
    println!("{calls}");
    if !relays.is_empty() {
        println!();
        println!("{relays}");
    }
    Ok(())
}

/// The *relays* measure: per kind (pipe, TCP), the median rate at home and moved.
fn relays_table(a: &Args, moved: &dyn Fn(&Child) -> Result<()>) -> Result<String> {
    use std::io::Read;
    let dir = std::env::temp_dir().join(format!("ferry-bench-relays.{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("make {}", dir.display()))?;
    let bin = build_c(&dir, "writer", WRITER_C, "the writer")?;
    let bytes = a.relay_mib << 20;
    eprintln!(
        "ferry-bench: relays: {} runs of {} MiB per kind, at home and moved",
        a.relay_runs, a.relay_mib
    );
    // [kind][moved] -> MiB/s, one per run.
    let kinds = ["pipe", "tcp"];
    let mut rates: Vec<[Vec<f64>; 2]> = kinds.iter().map(|_| Default::default()).collect();
    let mut buf = vec![0u8; 1 << 20];
    for run in 0..a.relay_runs {
        for (i, kind) in kinds.iter().enumerate() {
            for (k, moving) in [false, true].into_iter().enumerate() {
                let go = dir.join(format!("go-{run}-{kind}-{k}"));
                let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
                let port = listener.local_addr()?.port().to_string();
                let mut c = Command::new(&bin)
                    .arg(&go)
                    .arg(if *kind == "pipe" { "pipe" } else { &port })
                    .arg(bytes.to_string())
                    .stdin(Stdio::null())
                    .stdout(if *kind == "pipe" {
                        Stdio::piped()
                    } else {
                        Stdio::null()
                    })
                    .stderr(Stdio::null())
                    .spawn()
                    .context("start the writer")?;
                let mut from: Box<dyn Read> = match c.stdout.take() {
                    Some(p) => Box::new(p),
                    None => Box::new(listener.accept().context("accept the writer")?.0),
                };
                if moving {
                    moved(&c)?;
                }
                let t = Instant::now();
                std::fs::write(&go, "")?;
                let mut got = 0u64;
                loop {
                    let n = from.read(&mut buf).context("read the stream")?;
                    if n == 0 {
                        break;
                    }
                    got += n as u64;
                }
                let secs = t.elapsed().as_secs_f64();
                let st = wait(&mut c)?;
                if !st.success() || got != bytes {
                    bail!("{kind}: {got} of {bytes} bytes, the writer ended with {st} (moved: {moving})");
                }
                rates[i][k].push(bytes as f64 / (1 << 20) as f64 / secs);
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    let mut lines = vec![vec![
        "stream".to_string(),
        "at home MiB/s".into(),
        "moved (relayed) MiB/s".into(),
        "moved vs home".into(),
    ]];
    for (i, kind) in kinds.iter().enumerate() {
        let home = stats(&rates[i][0]).median;
        let there = stats(&rates[i][1]).median;
        lines.push(vec![
            format!("{kind}, {} MiB, writer to this process", a.relay_mib),
            format!("{home:.0}"),
            format!("{there:.0}"),
            format!("{:.2}x", there / home.max(1e-9)),
        ]);
    }
    Ok(markdown(&lines))
}

/// The *calls* measure: per call, the median over the runs of its mean time at home and moved.
fn calls_table(a: &Args, moved: &dyn Fn(&Child) -> Result<()>) -> Result<String> {
    let dir = std::env::temp_dir().join(format!("ferry-bench-calls.{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("make {}", dir.display()))?;
    let bin = build_c(&dir, "calls", CALLS_C, "the calls program")?;
    eprintln!(
        "ferry-bench: calls: {} runs of {} calls each, at home and moved",
        a.call_runs, a.calls
    );
    // [call][moved] -> ns per call, one per run.
    let mut ns: Vec<[Vec<f64>; 2]> = CALLS.iter().map(|_| Default::default()).collect();
    for run in 0..a.call_runs {
        for (k, moving) in [false, true].into_iter().enumerate() {
            let go = dir.join(format!("go-{run}-{k}"));
            let out = dir.join(format!("out-{run}-{k}"));
            let mut c = Command::new(&bin)
                .arg(&go)
                .arg(&out)
                .arg(a.calls.to_string())
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .context("start the calls program")?;
            if moving {
                moved(&c)?;
            }
            std::fs::write(&go, "")?;
            let st = wait(&mut c)?;
            if !st.success() {
                bail!("the calls program ended with {st} (moved: {moving})");
            }
            let text =
                std::fs::read_to_string(&out).with_context(|| format!("read {}", out.display()))?;
            for (i, (name, _)) in CALLS.iter().enumerate() {
                let v = text
                    .lines()
                    .find_map(|l| l.strip_prefix(&format!("{name} ")))
                    .and_then(|v| v.trim().parse::<f64>().ok())
                    .with_context(|| format!("no {name} in {text:?}"))?;
                ns[i][k].push(v);
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    let mut lines = vec![vec![
        "call".to_string(),
        "moved: handled".into(),
        "at home µs".into(),
        "moved µs".into(),
        "added µs".into(),
        "moved vs home".into(),
    ]];
    for (i, (name, forwarded)) in CALLS.iter().enumerate() {
        let home = stats(&ns[i][0]).median / 1e3;
        let there = stats(&ns[i][1]).median / 1e3;
        lines.push(vec![
            name.to_string(),
            if *forwarded {
                "forwarded (supervisor)".into()
            } else {
                "local (filter: ALLOW)".into()
            },
            format!("{home:.3}"),
            format!("{there:.3}"),
            format!("{:.3}", there - home),
            format!("{:.1}x", there / home.max(1e-9)),
        ]);
    }
    Ok(markdown(&lines))
}
