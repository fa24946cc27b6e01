//! `ferry-bench engine --criu PATH`: Ferry and CRIU side by side, in one run.
//!
//! For each case (a memory size, or a shape: many mappings, threads, children or
//! descriptors) and each run, the same benchmark child (`ferry-bench hold`) is checkpointed
//! and restored once by Ferry and once by CRIU, the two taking turns as to who goes first.
//! Both are timed from outside (process start included): `ferry checkpoint PID --dir D` /
//! `ferry restore --dir D`, and `criu dump -t PID -D D` / `criu restore -D D -d`. Each
//! restored child checks its memory (and its mappings' words, threads) and a restore that lost
//! anything fails the benchmark. CRIU is never a dependency of Ferry: building it is described
//! in docs/benchmarks.md.

use crate::common::{ferry_json, wait_gone, Holder, HOLD_TIMEOUT};
use crate::hold::Shape;
use anyhow::{bail, Context, Result};
use std::fmt::Write as _;
use std::fs::{self, File};
use std::path::Path;
use std::process::{Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

/// One case: `mib` MiB of memory and `shape`.
#[derive(Clone, Copy)]
pub struct Case {
    pub mib: usize,
    pub shape: Shape,
}

impl Case {
    fn label(&self) -> String {
        if self.shape == Shape::default() {
            format!("{} MiB", self.mib)
        } else {
            self.shape.label()
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Engine {
    Ferry,
    Criu,
}

/// Checkpoint and restore wall times of one engine in one run (ms).
#[derive(Clone, Copy)]
struct Times {
    ck: f64,
    rs: f64,
}

/// Runs every case `runs` times with both engines, alternating; returns the report.
pub fn compare(
    cases: &[Case],
    runs: usize,
    ferry: &Path,
    criu: &Path,
    work: &Path,
) -> Result<String> {
    let mut rows = Vec::new();
    for (k, case) in cases.iter().enumerate() {
        let mut ferry_runs = Vec::new();
        let mut criu_runs: Vec<Result<Times, String>> = Vec::new();
        for r in 0..runs {
            let order = if (k + r) % 2 == 0 {
                [Engine::Ferry, Engine::Criu]
            } else {
                [Engine::Criu, Engine::Ferry]
            };
            for e in order {
                let name = if e == Engine::Ferry { "ferry" } else { "criu" };
                eprintln!(
                    "ferry-bench: {}, run {}/{runs}: {name}",
                    case.label(),
                    r + 1
                );
                let dir = work.join(format!("cmp-{k}-{r}-{name}"));
                fs::create_dir_all(&dir)?;
                let t = one(e, case, ferry, criu, &dir)
                    .with_context(|| format!("{}, run {}, {name}", case.label(), r + 1));
                match (e, t) {
                    (Engine::Ferry, t) => ferry_runs.push(t?),
                    // CRIU refusing a case (it cannot dump 2,000 pipes here) is a result.
                    (Engine::Criu, t) => criu_runs.push(t.map_err(|e| format!("{e:#}"))),
                }
                let _ = fs::remove_dir_all(&dir);
            }
        }
        rows.push((case.label(), ferry_runs, criu_runs));
    }
    Ok(report(&rows, runs))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

type Row = (String, Vec<Times>, Vec<Result<Times, String>>);

fn report(rows: &[Row], runs: usize) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\nFerry against CRIU, alternating in one run ({runs} run{} per case; medians in ms, wall \
         time of each command; ratio = Ferry / CRIU, below 1 Ferry is faster; per run: the \
         ratio of each run's checkpoint + restore)\n",
        if runs == 1 { "" } else { "s" }
    );
    let head = [
        "case",
        "ferry ck+rs",
        "criu ck+rs",
        "ratio ck+rs",
        "ferry restore",
        "criu restore",
        "ratio restore",
        "ferry ckpt",
        "criu dump",
        "per run",
    ];
    let mut lines = vec![head.iter().map(|h| h.to_string()).collect::<Vec<_>>()];
    for (label, f, c) in rows {
        let ok: Vec<Times> = c.iter().filter_map(|t| t.as_ref().ok().copied()).collect();
        let f_both = median(f.iter().map(|t| t.ck + t.rs).collect());
        let f_rs = median(f.iter().map(|t| t.rs).collect());
        let f_ck = median(f.iter().map(|t| t.ck).collect());
        if ok.is_empty() {
            let why: String = c
                .iter()
                .find_map(|t| t.as_ref().err())
                .map(|e| e.lines().last().unwrap_or("").chars().take(80).collect())
                .unwrap_or_default();
            lines.push(vec![
                label.clone(),
                format!("{f_both:.0}"),
                format!("fails: {why}"),
                "-".into(),
                format!("{f_rs:.0}"),
                "-".into(),
                "-".into(),
                format!("{f_ck:.0}"),
                "-".into(),
                "-".into(),
            ]);
            continue;
        }
        let c_both = median(ok.iter().map(|t| t.ck + t.rs).collect());
        let c_rs = median(ok.iter().map(|t| t.rs).collect());
        let c_ck = median(ok.iter().map(|t| t.ck).collect());
        let per_run: Vec<String> = f
            .iter()
            .zip(c)
            .map(|(f, c)| match c {
                Ok(c) => format!("{:.2}", (f.ck + f.rs) / (c.ck + c.rs)),
                Err(_) => "x".into(),
            })
            .collect();
        lines.push(vec![
            label.clone(),
            format!("{f_both:.0}"),
            format!("{c_both:.0}"),
            format!("{:.2}", f_both / c_both),
            format!("{f_rs:.0}"),
            format!("{c_rs:.0}"),
            format!("{:.2}", f_rs / c_rs),
            format!("{f_ck:.0}"),
            format!("{c_ck:.0}"),
            per_run.join(" "),
        ]);
    }
    s.push_str(&crate::common::markdown(&lines));
    s
}

/// One checkpoint and restore of a fresh benchmark child by `e`.
fn one(e: Engine, case: &Case, ferry: &Path, criu: &Path, dir: &Path) -> Result<Times> {
    let (mut holder, sum) =
        Holder::start_shaped(dir, case.mib, case.shape, Duration::from_millis(5))?;
    let pid = holder.pid;
    sleep(Duration::from_millis(100));
    let img = dir.join("img");
    fs::create_dir_all(&img)?;
    let img_s = img.to_string_lossy().into_owned();
    let pid_s = pid.to_string();
    // Its children die with it at the checkpoint and come to us (a subreaper) to be reaped.
    let kids = children_of(pid);
    let t0 = Instant::now();
    match e {
        Engine::Ferry => {
            ferry_json(
                Command::new(ferry),
                &["checkpoint", &pid_s, "--dir", &img_s, "--json"],
                dir,
                "checkpoint",
            )?;
        }
        Engine::Criu => criu_cmd(
            criu,
            &["dump", "-t", &pid_s, "-D", &img_s, "-o", "dump.log"],
            &img,
        )?,
    }
    let ck = t0.elapsed().as_secs_f64() * 1e3;
    if let Some(mut c) = holder.child.take() {
        c.wait().context("reap the checkpointed child")?;
    }
    for k in kids {
        if !wait_gone(k, Duration::from_secs(30)) {
            bail!("child {k} of the benchmark process did not die with it");
        }
    }
    let t1 = Instant::now();
    match e {
        Engine::Ferry => {
            ferry_json(
                Command::new(ferry),
                &["restore", "--dir", &img_s, "--json"],
                dir,
                "restore",
            )?;
        }
        Engine::Criu => criu_cmd(
            criu,
            &["restore", "-D", &img_s, "-d", "-o", "restore.log"],
            &img,
        )?,
    }
    let rs = t1.elapsed().as_secs_f64() * 1e3;
    File::create(dir.join("go"))?;
    let result = holder.wait_file(&dir.join("result"), HOLD_TIMEOUT, Duration::from_millis(5))?;
    if result.trim() != sum {
        bail!(
            "the restored child's memory differs: checksum {} after restore, {sum} before",
            result.trim()
        );
    }
    if !wait_gone(pid, Duration::from_secs(30)) {
        bail!("the restored child did not exit after writing its result");
    }
    std::mem::forget(holder); // gone and reaped
    Ok(Times { ck, rs })
}

/// The children of every thread of `pid`.
fn children_of(pid: i32) -> Vec<i32> {
    let mut out = Vec::new();
    if let Ok(tasks) = fs::read_dir(format!("/proc/{pid}/task")) {
        for t in tasks.flatten() {
            let p = t.path().join("children");
            if let Ok(s) = fs::read_to_string(p) {
                out.extend(s.split_whitespace().filter_map(|c| c.parse::<i32>().ok()));
            }
        }
    }
    out
}

/// Runs CRIU in the image directory; its log names the reason when it fails.
fn criu_cmd(criu: &Path, args: &[&str], img: &Path) -> Result<()> {
    let st = Command::new(criu)
        .args(args)
        .current_dir(img)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .with_context(|| format!("cannot run {}", criu.display()))?;
    if !st.success() {
        let log = fs::read_to_string(img.join(if args[0] == "dump" {
            "dump.log"
        } else {
            "restore.log"
        }))
        .unwrap_or_default();
        let errors: Vec<&str> = log.lines().filter(|l| l.contains("Error")).collect();
        bail!(
            "criu {} failed ({st}): {}",
            args[0],
            errors.first().copied().unwrap_or("see its log")
        );
    }
    Ok(())
}
