//! `ferry-bench sprite`: Sprite's Table 7.3 and MOSIX's Table 5.1 on this machine: what a
//! process pays for having moved, workload by workload.
//!
//! One C program does every workload once it is told to go; it runs at home, then moved from a
//! to b of a local cluster of two nodes (one network stack and file system), run by run
//! interleaved. It connects to this process over TCP before it is told to go, so the moved
//! one's connection is relayed by the daemons (its peer, this process, stays home).
//!
//! - MOSIX Table 5.1 (per call, µs): `open` and `close` of a file, `lseek`, `write` of 1 KiB and
//!   of 8 KiB, on a file in a directory both nodes see.
//! - Sprite Table 7.3 (per workload, ms): a compile (`cc -O2 -c` of a generated C file of 300
//!   functions, through `system()`: a shell forked and exec'd, then the compiler's own
//!   processes), a text-formatting job (`fmt` piped to `sort`, 2 MiB of text), a 1 MiB copy over TCP
//!   to the process at home (answered with a byte, ten times), `fork` + `wait` 1000 times, and
//!   `gettimeofday` 10000 times.
//!
//! The migration itself is not timed (`ferry-bench migrate` does). See docs/benchmarks.md.

use crate::common::{build_c, ferry_binary, markdown, seal_inherited_fds, stats};
use crate::remote_exec::{cluster_up, ferry_a};
use anyhow::{bail, Context, Result};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

#[derive(clap::Args)]
pub struct Args {
    /// Runs at home and moved each (interleaved).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// The ferry binary to measure. Default: the workspace's target/release/ferry, brought up to
    /// date with `cargo build --release -p ferry` first.
    #[arg(long)]
    ferry: Option<PathBuf>,
    /// TCP port of the benchmark's own local cluster (on 127.0.0.11 and .12).
    #[arg(long, default_value_t = 7395)]
    port: u16,
}

/// The workload program: `work GO OUT PORT DIR`. Connects to 127.0.0.1:PORT, waits for GO to
/// exist, does every workload in DIR and writes `name microseconds` lines to OUT.
const WORK_C: &str = r#"
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}
#define CALLS 1000
static int fds[CALLS];
static char buf[1 << 20];
int main(int argc, char **argv) {
    if (argc != 5) return 2;
    const char *dir = argv[4];
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(atoi(argv[3])) };
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(s, (struct sockaddr *)&a, sizeof a)) return 3;
    while (access(argv[1], F_OK)) usleep(2000);
    char path[4096], tmp[4096], cmd[8192];
    snprintf(tmp, sizeof tmp, "%s.tmp", argv[2]);
    FILE *o = fopen(tmp, "w");
    if (!o) return 4;
    snprintf(path, sizeof path, "%s/calls.dat", dir);
    int f = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
    if (f < 0) return 5;
    double t;
    /* MOSIX Table 5.1: per call. */
    t = now();
    for (int i = 0; i < CALLS; i++) if ((fds[i] = open(path, O_RDONLY)) < 0) return 6;
    fprintf(o, "open %.3f\n", (now() - t) / CALLS);
    t = now();
    for (int i = 0; i < CALLS; i++) close(fds[i]);
    fprintf(o, "close %.3f\n", (now() - t) / CALLS);
    t = now();
    for (int i = 0; i < CALLS; i++) lseek(f, i, SEEK_SET);
    fprintf(o, "lseek %.3f\n", (now() - t) / CALLS);
    t = now();
    for (int i = 0; i < CALLS; i++) if (write(f, buf, 1024) != 1024) return 7;
    fprintf(o, "write-1k %.3f\n", (now() - t) / CALLS);
    t = now();
    for (int i = 0; i < CALLS; i++) if (write(f, buf, 8192) != 8192) return 8;
    fprintf(o, "write-8k %.3f\n", (now() - t) / CALLS);
    close(f);
    unlink(path);
    /* Sprite Table 7.3: per workload. */
    snprintf(cmd, sizeof cmd, "cc -O2 -c %s/big.c -o %s/big.o", dir, dir);
    t = now();
    if (system(cmd)) return 9;
    fprintf(o, "compile %.3f\n", now() - t);
    snprintf(cmd, sizeof cmd, "fmt -w 50 %s/text.txt | sort > %s/text.out", dir, dir);
    t = now();
    if (system(cmd)) return 10;
    fprintf(o, "format %.3f\n", now() - t);
    t = now();
    for (int r = 0; r < 10; r++) {
        for (size_t n = 0; n < sizeof buf;) {
            ssize_t w = write(s, buf + n, sizeof buf - n);
            if (w <= 0) return 11;
            n += w;
        }
        char ack;
        if (read(s, &ack, 1) != 1) return 12;
    }
    fprintf(o, "tcp-1m %.3f\n", (now() - t) / 10);
    t = now();
    for (int i = 0; i < 1000; i++) {
        pid_t p = fork();
        if (p == 0) _exit(0);
        if (p < 0 || waitpid(p, NULL, 0) != p) return 13;
    }
    fprintf(o, "fork-wait %.3f\n", now() - t);
    struct timeval tv;
    t = now();
    for (int i = 0; i < 10000; i++) gettimeofday(&tv, NULL);
    fprintf(o, "gettimeofday %.3f\n", now() - t);
    fclose(o);
    rename(tmp, argv[2]);
    return 0;
}
"#;

/// Rows of the tables: the program's name for it, what it is, whether it is per call (µs)
/// rather than per workload (ms).
const ROWS: [(&str, &str, bool); 10] = [
    ("close", "close", true),
    ("lseek", "lseek", true),
    ("open", "open", true),
    ("write-1k", "write 1 KiB", true),
    ("write-8k", "write 8 KiB", true),
    ("compile", "compile (cc -O2 -c, 300 functions)", false),
    ("format", "text formatting (fmt, then sort: 2 MiB)", false),
    ("tcp-1m", "1 MiB copy over TCP to home", false),
    ("fork-wait", "fork + wait x1000", false),
    ("gettimeofday", "gettimeofday x10000", false),
];

/// Builds the program and writes its inputs into `dir`.
fn prepare(dir: &Path) -> Result<PathBuf> {
    let bin = build_c(dir, "work", WORK_C, "the workload program")?;
    let mut c = String::from("#include <string.h>\n");
    for i in 0..300 {
        c.push_str(&format!(
            "int f{i}(const char *s, int n) {{ int h = {i}; for (int k = 0; k < n; k++) \
             h = h * 31 + s[k] + (int)strlen(s + k) % 7; return h ^ (h >> {}); }}\n",
            i % 13 + 1
        ));
    }
    std::fs::write(dir.join("big.c"), c)?;
    let words = [
        "migration",
        "home",
        "deputy",
        "body",
        "kernel",
        "page",
        "socket",
        "relay",
        "node",
        "cluster",
        "signal",
        "terminal",
    ];
    let mut text = String::with_capacity(2 << 20);
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    while text.len() < 2 << 20 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        text.push_str(words[(x % words.len() as u64) as usize]);
        text.push(if x.is_multiple_of(11) { '\n' } else { ' ' });
    }
    std::fs::write(dir.join("text.txt"), text)?;
    Ok(bin)
}

/// Takes the program's connections: reads 1 MiB, answers a byte, until end of file.
fn serve(listener: std::net::TcpListener) {
    for conn in listener.incoming() {
        let Ok(mut c) = conn else { return };
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 1 << 16];
            let mut got = 0usize;
            loop {
                match c.read(&mut buf) {
                    Ok(0) | Err(_) => return,
                    Ok(n) => got += n,
                }
                while got >= 1 << 20 {
                    got -= 1 << 20;
                    if c.write_all(b"k").is_err() {
                        return;
                    }
                }
            }
        });
    }
}

pub fn run(a: Args) -> Result<()> {
    if a.runs == 0 {
        bail!("--runs must be at least 1");
    }
    seal_inherited_fds();
    let ferry = ferry_binary(a.ferry.as_deref())?;
    let dir = std::env::temp_dir().join(format!("ferry-bench-sprite.{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("make {}", dir.display()))?;
    let bin = prepare(&dir)?;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").context("listen on loopback")?;
    let port = listener.local_addr()?.port();
    std::thread::spawn(move || serve(listener));
    let cluster = cluster_up(&ferry, a.port)?;
    eprintln!("ferry-bench: sprite: {} runs at home and moved", a.runs);
    // [row][moved] -> one value per run.
    let mut v: Vec<[Vec<f64>; 2]> = ROWS.iter().map(|_| Default::default()).collect();
    for run in 0..a.runs {
        for (k, moving) in [false, true].into_iter().enumerate() {
            let go = dir.join(format!("go-{run}-{k}"));
            let out = dir.join(format!("out-{run}-{k}"));
            let mut c = Command::new(&bin)
                .arg(&go)
                .arg(&out)
                .arg(port.to_string())
                .arg(&dir)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .context("start the workload program")?;
            // Connected before it moves: wait until it is (its socket shows in /proc).
            std::thread::sleep(Duration::from_millis(100));
            if moving {
                let o = ferry_a(&cluster, &["migrate", &c.id().to_string(), "--to", "b"])
                    .stderr(Stdio::piped())
                    .output()
                    .context("run ferry migrate")?;
                if !o.status.success() {
                    let _ = c.kill();
                    let _ = c.wait();
                    bail!("ferry migrate: {}", String::from_utf8_lossy(&o.stderr));
                }
            }
            std::fs::write(&go, "")?;
            let st = c.wait().context("wait for the workload program")?;
            if !st.success() {
                bail!("the workload program ended with {st} (moved: {moving})");
            }
            let text =
                std::fs::read_to_string(&out).with_context(|| format!("read {}", out.display()))?;
            for (i, (name, _, _)) in ROWS.iter().enumerate() {
                let x = text
                    .lines()
                    .find_map(|l| l.strip_prefix(&format!("{name} ")))
                    .and_then(|x| x.trim().parse::<f64>().ok())
                    .with_context(|| format!("no {name} in {text:?}"))?;
                v[i][k].push(x);
            }
        }
    }
    drop(cluster);
    let _ = std::fs::remove_dir_all(&dir);
    for per_call in [true, false] {
        let unit = if per_call { "µs per call" } else { "ms" };
        let mut lines = vec![vec![
            if per_call {
                "MOSIX Table 5.1: call".to_string()
            } else {
                "Sprite Table 7.3: workload".to_string()
            },
            format!("at home, {unit}"),
            format!("moved, {unit}"),
            "moved vs home".into(),
        ]];
        for (i, (_, label, pc)) in ROWS.iter().enumerate() {
            if *pc != per_call {
                continue;
            }
            let scale = if per_call { 1.0 } else { 1e-3 };
            let home = stats(&v[i][0]).median * scale;
            let there = stats(&v[i][1]).median * scale;
            lines.push(vec![
                label.to_string(),
                format!("{home:.3}"),
                format!("{there:.3}"),
                format!("{:.2}x", there / home.max(1e-9)),
            ]);
        }
        println!("{}", markdown(&lines));
        println!();
    }
    Ok(())
}
