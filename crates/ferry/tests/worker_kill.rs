//! The engine's worker killed outright (SIGKILL: nothing of ferry's own runs) at many points of
//! a checkpoint (`ferry checkpoint --leave-running`) and of a migration: every time, the process
//! it held runs on unharmed. The victim (tests/victims/selfcheck.c) checks itself: each
//! thread's signal mask, its memory, bytes through a pipe in sequence, a futex waiter, FPU
//! registers in the middle of a computation; and its SIGUSR1 handler must still see signals.
//! The worker is found as the victim's tracer (/proc/PID/status: TracerPid) and killed at
//! growing delays after it first attached; in a checkpoint, it also kills itself at each
//! instant of an injected call (fail points, see `fault` in ferry-inject).

mod common;

use common::cluster::{Cluster, FERRY};
use common::scratch;
use libtest_mimic::{Arguments, Failed, Trial};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn main() {
    let args = Arguments::from_args();
    let tests = vec![
        Trial::test(
            "checkpoint_worker_killed_anywhere",
            checkpoint_worker_killed,
        ),
        Trial::test(
            "checkpoint_worker_killed_in_injected_calls",
            checkpoint_worker_killed_in_calls,
        ),
        Trial::test(
            "checkpoint_tree_worker_killed_in_calls_together",
            checkpoint_tree_worker_killed_in_calls,
        ),
        Trial::test("migration_worker_killed_anywhere", migration_worker_killed),
        Trial::test("restore_killed_in_batched_calls", restore_killed_in_batches),
    ];
    libtest_mimic::run(&args, tests).exit();
}

/// Microseconds after the worker first attached to the victim at which it is killed: every
/// step of a checkpoint of this victim, from the first thread seized to the tree let go.
const DELAYS_US: &[u64] = &[
    0, 50, 100, 200, 300, 500, 700, 1000, 1300, 1700, 2200, 2800, 3500, 4500, 6000, 8000, 11000,
    15000, 20000, 30000, 45000, 70000,
];

fn victim_binary() -> PathBuf {
    common::victim("selfcheck", &["-O2", "-pthread"])
}

#[derive(Debug)]
struct Status {
    count: u64,
    sigs: u64,
    ok: bool,
    why: String,
}

struct Victim {
    /// The victim as our child; `None` for one a shell of the test started.
    child: Option<Child>,
    pid: i32,
    status: PathBuf,
}

impl Victim {
    fn start(dir: &Path) -> Victim {
        let status = dir.join("selfcheck.status");
        let _ = std::fs::remove_file(&status);
        let child = Command::new(victim_binary())
            .arg(&status)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let v = Victim {
            pid: child.id() as i32,
            child: Some(child),
            status,
        };
        v.wait_started();
        v
    }

    fn wait_started(&self) {
        let v = self;
        let deadline = Instant::now() + Duration::from_secs(10);
        while v.status().is_none_or(|s| s.count < 3) {
            assert!(Instant::now() < deadline, "selfcheck did not start");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn pid(&self) -> i32 {
        self.pid
    }

    fn status(&self) -> Option<Status> {
        let text = std::fs::read_to_string(&self.status).ok()?;
        let field = |k: &str| -> Option<String> {
            text.split_whitespace()
                .find_map(|w| w.strip_prefix(k))
                .map(str::to_string)
        };
        Some(Status {
            count: field("count=")?.parse().ok()?,
            sigs: field("sigs=")?.parse().ok()?,
            ok: field("ok=")? == "1",
            why: field("why=")?,
        })
    }

    /// Fails unless the victim, free of any tracer, counts on intact and takes a signal.
    fn assert_unharmed(&mut self, what: &str) -> Result<(), Failed> {
        let pid = self.pid();
        let deadline = Instant::now() + Duration::from_secs(5);
        while tracer_of(pid).is_some() {
            if Instant::now() > deadline {
                return Err(format!("{what}: PID {pid} is still traced").into());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let before = self.status().ok_or("no status")?;
        // SAFETY: kill with a plain PID and signal number.
        unsafe { libc::kill(pid, libc::SIGUSR1) };
        let deadline = Instant::now() + Duration::from_secs(3);
        loop {
            match &mut self.child {
                Some(c) => {
                    if let Ok(Some(st)) = c.try_wait() {
                        return Err(format!("{what}: the victim died: {st}").into());
                    }
                }
                None if !Path::new(&format!("/proc/{pid}")).exists() => {
                    return Err(format!("{what}: the victim {pid} died").into());
                }
                None => {}
            }
            let now = self.status().ok_or("no status")?;
            if !now.ok {
                return Err(format!("{what}: the victim is damaged ({}): {now:?}", now.why).into());
            }
            if now.count > before.count + 3 && now.sigs > before.sigs {
                return Ok(());
            }
            if Instant::now() > deadline {
                let state =
                    std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
                return Err(format!(
                    "{what}: the victim stopped counting or taking signals: {before:?} -> {now:?}\n{state}"
                )
                .into());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Victim {
    fn drop(&mut self) {
        match &mut self.child {
            Some(c) => {
                let _ = c.kill();
                let _ = c.wait();
            }
            // SAFETY: kill with a plain PID and signal number.
            None => unsafe {
                libc::kill(self.pid, libc::SIGKILL);
            },
        }
    }
}

/// The tracer of any thread of `pid`, if one has it.
fn tracer_of(pid: i32) -> Option<i32> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    for t in tasks.flatten() {
        let s = std::fs::read_to_string(t.path().join("status")).unwrap_or_default();
        let tracer = s
            .lines()
            .find_map(|l| l.strip_prefix("TracerPid:"))
            .and_then(|v| v.trim().parse::<i32>().ok())
            .unwrap_or(0);
        if tracer != 0 {
            return Some(tracer);
        }
    }
    None
}

/// Waits for a `ferry` process to trace `pid` (while `running` says the command that would
/// start it is still going), then SIGKILLs it `delay_us` later. Returns whether it did.
fn kill_worker_after(pid: i32, delay_us: u64, mut running: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(20);
    let worker = loop {
        if let Some(w) = tracer_of(pid) {
            break w;
        }
        if !running() || Instant::now() > deadline {
            return false;
        }
        std::hint::spin_loop();
    };
    let attached = Instant::now();
    while attached.elapsed() < Duration::from_micros(delay_us) {
        std::hint::spin_loop();
    }
    let comm = std::fs::read_to_string(format!("/proc/{worker}/comm")).unwrap_or_default();
    if comm.trim() != "ferry" || tracer_of(pid) != Some(worker) {
        return false;
    }
    // SAFETY: kill with a plain PID and signal number.
    unsafe { libc::kill(worker, libc::SIGKILL) };
    true
}

fn checkpoint_worker_killed() -> Result<(), Failed> {
    let dir = scratch("worker_kill", "checkpoint");
    let mut v = Victim::start(&dir);
    let mut killed = 0;
    for (i, delay) in DELAYS_US.iter().enumerate() {
        let images = dir.join(format!("image-{i}"));
        let mut ck = Command::new(FERRY)
            .args([
                "checkpoint",
                &v.pid().to_string(),
                "--leave-running",
                "--dir",
            ])
            .arg(&images)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        if kill_worker_after(v.pid(), *delay, || matches!(ck.try_wait(), Ok(None))) {
            killed += 1;
        }
        let _ = ck.wait();
        v.assert_unharmed(&format!(
            "checkpoint worker killed {delay} us after it attached"
        ))?;
    }
    // Most kills land while the worker holds the tree (the last ones may come too late).
    assert!(killed > DELAYS_US.len() / 2, "only {killed} kills landed");
    Ok(())
}

/// The fail-point setting that makes POINT fire the Nth time it is reached (`fail` crate).
fn nth_time(point: &str, n: u32) -> String {
    match n {
        0 | 1 => format!("{point}=return"),
        n => format!("{point}={}*off->return", n - 1),
    }
}

/// (fault point, the Nth time it is reached): each instant at which a thread holds something
/// of an injected call, for the first thread's first call, a later one, and another thread's.
const FAULTS: &[(&str, u32)] = &[
    ("parked", 1),
    ("parked", 3),
    ("entry", 1),
    ("entry", 9),
    ("entry", 45),
    ("call", 1),
    ("call", 9),
    ("call", 45),
    ("exit", 1),
    ("exit", 9),
    ("exit", 45),
    ("back", 1),
    ("back", 3),
    ("mask", 1),
    ("mask", 3),
];

fn checkpoint_worker_killed_in_calls() -> Result<(), Failed> {
    let dir = scratch("worker_kill", "calls");
    let mut v = Victim::start(&dir);
    for (i, (point, n)) in FAULTS.iter().enumerate() {
        let o = Command::new(FERRY)
            .args([
                "checkpoint",
                &v.pid().to_string(),
                "--leave-running",
                "--dir",
            ])
            .arg(dir.join(format!("image-{i}")))
            .env("FAILPOINTS", nth_time(point, *n))
            .output()
            .unwrap();
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "no fault at {point}:{n}: {e}");
        v.assert_unharmed(&format!("checkpoint worker killed at {point}:{n}"))?;
    }
    Ok(())
}

/// Fail points of a checkpoint of a shell and two victims, in the signal-action queries that
/// run in all three processes at once (`ferry_inject::together`): the second process's
/// entry while the first has its call set up and the third runs; calls and exits of the first
/// rounds and of a later one.
const TREE_FAULTS: &[(&str, u32)] = &[
    ("parked", 2),
    ("entry", 2),
    ("entry", 3),
    ("call", 2),
    ("call", 3),
    ("exit", 1),
    ("exit", 2),
    ("entry", 50),
    ("exit", 100),
];

/// A checkpoint of a tree (a shell, parent of two victims) killed at each of `TREE_FAULTS`:
/// every process runs on unharmed, the shell still waiting for its children.
fn checkpoint_tree_worker_killed_in_calls() -> Result<(), Failed> {
    let dir = scratch("worker_kill", "tree");
    let bin = victim_binary();
    let (a, b) = (dir.join("a.status"), dir.join("b.status"));
    for f in [&a, &b] {
        let _ = std::fs::remove_file(f);
    }
    let mut shell = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "{0} {1} & {0} {2} & wait",
            bin.display(),
            a.display(),
            b.display()
        ))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let root = shell.id() as i32;
    let kids = |root: i32| -> Vec<i32> {
        std::fs::read_to_string(format!("/proc/{root}/task/{root}/children"))
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|w| w.parse().ok())
            .collect()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while kids(root).len() < 2 {
        assert!(
            Instant::now() < deadline,
            "the shell did not start its victims"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut victims: Vec<Victim> = Vec::new();
    for status in [a, b] {
        // Which child writes which status file: the first whose command line names it.
        let pid = kids(root)
            .into_iter()
            .find(|k| {
                std::fs::read(format!("/proc/{k}/cmdline"))
                    .map(|c| String::from_utf8_lossy(&c).contains(&*status.to_string_lossy()))
                    .unwrap_or(false)
            })
            .expect("a victim for each status file");
        let v = Victim {
            child: None,
            pid,
            status,
        };
        v.wait_started();
        victims.push(v);
    }
    let result = (|| -> Result<(), Failed> {
        // The whole tree checkpoints (the faults below are the only reason a run fails).
        let o = Command::new(FERRY)
            .args(["checkpoint", &root.to_string(), "--leave-running", "--dir"])
            .arg(dir.join("image-whole"))
            .output()
            .unwrap();
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "checkpoint of the tree: {e}");
        for v in &mut victims {
            v.assert_unharmed("tree checkpointed, left running")?;
        }
        for (i, (point, n)) in TREE_FAULTS.iter().enumerate() {
            let o = Command::new(FERRY)
                .args(["checkpoint", &root.to_string(), "--leave-running", "--dir"])
                .arg(dir.join(format!("image-{i}")))
                .env("FAILPOINTS", nth_time(point, *n))
                .output()
                .unwrap();
            let e = String::from_utf8_lossy(&o.stderr);
            assert!(
                !o.status.success() && e.contains(&format!("fail point {point}")),
                "no fault at {point}:{n}: {e}"
            );
            for v in &mut victims {
                v.assert_unharmed(&format!("tree checkpoint worker killed at {point}:{n}"))?;
            }
            if let Ok(Some(st)) = shell.try_wait() {
                return Err(format!("the shell died at {point}:{n}: {st}").into());
            }
            let st = std::fs::read_to_string(format!("/proc/{root}/stat")).unwrap_or_default();
            let state = st.rsplit(") ").next().and_then(|r| r.split(' ').next());
            if state == Some("T") || state == Some("t") || tracer_of(root).is_some() {
                return Err(format!("the shell is left stopped at {point}:{n}: {st}").into());
            }
        }
        Ok(())
    })();
    drop(victims);
    let _ = shell.wait();
    result
}

/// A restore killed while a husk runs a batch of calls (fail point `batch`, the Nth time: the
/// husk runs its loop of mmaps, clone3s, descriptor installs, ... and ferry dies): nothing of
/// the half-built tree is left (its husks die with their tracer), and the image restores
/// afterwards into a victim that runs on intact.
fn restore_killed_in_batches() -> Result<(), Failed> {
    let dir = scratch("worker_kill", "restore-batches");
    let mut v = Victim::start(&dir);
    let pid = v.pid();
    let img = dir.join("image");
    let o = Command::new(FERRY)
        .args(["checkpoint", &pid.to_string(), "--dir"])
        .arg(&img)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "checkpoint: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    if let Some(c) = &mut v.child {
        let _ = c.wait();
    }
    let mut killed = 0;
    let mut restored = false;
    for n in [1, 2, 3, 4, 6, 9] {
        let o = Command::new(FERRY)
            .args(["restore", "--dir"])
            .arg(&img)
            .env("FAILPOINTS", nth_time("batch", n))
            .output()
            .unwrap();
        if o.status.success() {
            // Fewer batches than n: restored whole.
            restored = true;
            break;
        }
        killed += 1;
        eprintln!(
            "restore killed in batch {n}: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        );
        if !common::wait_gone(pid, Duration::from_secs(10)) {
            let st = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
            return Err(format!("killed in batch {n}: PID {pid} is still there:\n{st}").into());
        }
        // Dead; and reaped by whoever adopted it (init), so its PID is free again.
        let deadline = Instant::now() + Duration::from_secs(10);
        while Path::new(&format!("/proc/{pid}")).exists() {
            if Instant::now() > deadline {
                let st = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
                return Err(format!("killed in batch {n}: PID {pid} left behind:\n{st}").into());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    assert!(killed >= 3, "only {killed} restores were killed in a batch");
    if !restored {
        let o = Command::new(FERRY)
            .args(["restore", "--dir"])
            .arg(&img)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "restore: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    // The restored victim (no longer our child) counts on, intact.
    let before = v.status().ok_or("no status")?;
    let deadline = Instant::now() + Duration::from_secs(5);
    let result = loop {
        let now = v.status().ok_or("no status")?;
        if !now.ok {
            break Err(format!(
                "the restored victim is damaged ({}): {now:?}",
                now.why
            ));
        }
        if now.count > before.count + 3 {
            break Ok(());
        }
        if Instant::now() > deadline {
            break Err(format!(
                "the restored victim stopped counting: {before:?} -> {now:?}"
            ));
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    // SAFETY: kill with a plain PID and signal number.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    common::wait_gone(pid, Duration::from_secs(10));
    result.map_err(Into::into)
}

fn migration_worker_killed() -> Result<(), Failed> {
    // The destination gives up after its rebuild: the migration never commits, so whatever
    // the moment of the kill, the original is the only copy and must run on.
    let c = Cluster::up_with(
        "worker-kill",
        2,
        &[("FAILPOINTS", "b:abort-after-rebuilt=return")],
    );
    let dir = scratch("worker_kill", "migration");
    let mut v = Victim::start(&dir);
    let mut killed = 0;
    for delay in DELAYS_US.iter().step_by(2) {
        let mut m = c
            .ferry("a")
            .args(["migrate", &v.pid().to_string(), "--to", "b"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        if kill_worker_after(v.pid(), *delay, || matches!(m.try_wait(), Ok(None))) {
            killed += 1;
        }
        let o = m.wait_with_output().unwrap();
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "the migration cannot commit");
        assert!(!e.contains("failed too"), "the victim was let go: {e}");
        v.assert_unharmed(&format!(
            "capture worker killed {delay} us after it attached"
        ))?;
    }
    assert!(killed > DELAYS_US.len() / 4, "only {killed} kills landed");
    Ok(())
}
