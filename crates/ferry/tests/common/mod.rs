//! Helpers shared by the integration tests: scratch directories, the process table read from
//! /proc, reaping, clearing old run directories, and output trimming; a local cluster
//! (`cluster`) and the harness of the programs moved by checkpoint, restore and migration
//! (`run`).

#![allow(dead_code)]

pub mod cluster;
pub mod run;

use std::collections::{BTreeSet, HashSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::thread::sleep;
use std::time::{Duration, Instant};

/// `bash -c SCRIPT NAME` (the arguments the caller adds are the script's `$1`, `$2` ...),
/// with no input and its output and errors thrown away (a caller wanting them sets `stderr`
/// again): the shell or pipeline of a test, ready to spawn.
pub fn bash(script: &str, name: &str) -> std::process::Command {
    use std::process::Stdio;
    let mut cmd = std::process::Command::new("bash");
    cmd.args(["-c", script, name])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    cmd
}

/// Waits up to `limit` for `child` to end, looking every 50 ms; past that, fails with what
/// `why` says (what the child had done, and the logs that say why not).
pub fn wait_child_or(
    child: &mut std::process::Child,
    limit: Duration,
    why: impl FnOnce() -> String,
) -> Result<std::process::ExitStatus, String> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return Ok(st);
        }
        if Instant::now() > deadline {
            return Err(why());
        }
        sleep(Duration::from_millis(50));
    }
}

/// `tests/victims/NAME.c` built with `gcc FLAGS`, once per test process: the first caller
/// builds while the others (tests run in parallel) wait, and the binary is renamed into place
/// whole (a test that ran a half-written one failed with EACCES).
pub fn victim(name: &str, flags: &[&str]) -> PathBuf {
    static BUILT: std::sync::Mutex<std::collections::BTreeMap<String, PathBuf>> =
        std::sync::Mutex::new(std::collections::BTreeMap::new());
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(out) = built.get(name) {
        return out.clone();
    }
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-{}", std::process::id()));
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../../tests/victims/{name}.c"));
    let tmp = out.with_extension("building");
    let st = std::process::Command::new("gcc")
        .args(flags)
        .arg("-o")
        .arg(&tmp)
        .arg(&src)
        .status()
        .expect("run gcc");
    assert!(st.success(), "gcc failed on {}", src.display());
    fs::rename(&tmp, &out).unwrap();
    built.insert(name.to_string(), out.clone());
    out
}

/// A fresh, empty directory `name` of test binary `binary` under the target's temporary
/// directory (per test process, so that parallel runs never meet).
pub fn scratch(binary: &str, name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(binary)
        .join(format!("{name}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&d);
    fs::create_dir_all(&d).unwrap();
    d
}

/// `ferry ARGS`, to its end: whether it succeeded, its stdout and its stderr.
pub fn ferry(args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new(cluster::FERRY)
        .args(args)
        .output()
        .expect("run ferry");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

/// Removes run directories of earlier suites whose process is gone.
pub fn clear_stale_runs(runs_root: &Path) {
    let Ok(rd) = fs::read_dir(runs_root) else {
        return;
    };
    for e in rd.flatten() {
        let name = e.file_name();
        if let Some(pid) = name.to_str().and_then(|n| n.parse::<i32>().ok()) {
            if !Path::new(&format!("/proc/{pid}")).exists() {
                detach_mounts_under(&e.path());
                let _ = fs::remove_dir_all(e.path());
            }
        }
    }
}

/// Detaches every mount of our mount namespace whose mount point is `dir` or below it,
/// deepest first: what a test program mounted in its directory (fd_fanotify_mount's tmpfs)
/// and left behind when it was killed, or when its copy was rebuilt in a mount namespace of
/// its own and unmounted them only there.
pub fn detach_mounts_under(dir: &Path) {
    let Ok(info) = fs::read_to_string("/proc/self/mountinfo") else {
        return;
    };
    // Field 5 is the mount point, with space, tab, newline and backslash octal-escaped.
    let unescape = |f: &str| {
        let b = f.as_bytes();
        let mut out = Vec::with_capacity(b.len());
        let mut i = 0;
        while i < b.len() {
            if b[i] == b'\\' && i + 3 < b.len() {
                if let Ok(v) = u8::from_str_radix(&f[i + 1..i + 4], 8) {
                    out.push(v);
                    i += 4;
                    continue;
                }
            }
            out.push(b[i]);
            i += 1;
        }
        std::path::PathBuf::from(std::ffi::OsString::from_vec(out))
    };
    use std::os::unix::ffi::{OsStrExt, OsStringExt};
    let mut points: Vec<std::path::PathBuf> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(unescape)
        .filter(|p| p.starts_with(dir))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.as_os_str().len()));
    for p in points {
        let Ok(c) = std::ffi::CString::new(p.as_os_str().as_bytes()) else {
            continue;
        };
        // SAFETY: umount2 reads a NUL-terminated path; MNT_DETACH only unhooks that mount.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    }
}

/// The last `n` bytes of `b`.
pub fn tail(b: &[u8], n: usize) -> &[u8] {
    &b[b.len().saturating_sub(n)..]
}

/// `b` as text ending in a newline (unless empty).
pub fn with_newline(b: &[u8]) -> String {
    let mut s = String::from_utf8_lossy(b).into_owned();
    if !s.is_empty() && !s.ends_with('\n') {
        s.push('\n');
    }
    s
}

// ---------------------------------------------------------------------------
// /proc helpers.

pub struct ProcInfo {
    pub pid: i32,
    pub ppid: i32,
    pub pgrp: i32,
    pub session: i32,
}

pub fn parse_stat(text: &str) -> Option<(char, i32, i32, i32)> {
    let rest = &text[text.rfind(')')? + 2..];
    let mut f = rest.split_whitespace();
    let state = f.next()?.chars().next()?;
    let ppid = f.next()?.parse().ok()?;
    let pgrp = f.next()?.parse().ok()?;
    let session = f.next()?.parse().ok()?;
    Some((state, ppid, pgrp, session))
}

pub fn proc_state(pid: i32) -> Option<char> {
    let text = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat(&text).map(|s| s.0)
}

pub fn all_procs() -> Vec<ProcInfo> {
    let Ok(rd) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|pid| {
            let text = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let (_, ppid, pgrp, session) = parse_stat(&text)?;
            Some(ProcInfo {
                pid,
                ppid,
                pgrp,
                session,
            })
        })
        .collect()
}

/// All processes of a run: our descendants (we are a subreaper, so orphans
/// and restored processes are among them) and anything in the root's
/// session or process group.
pub fn tree_pids(root: i32) -> BTreeSet<i32> {
    let me = std::process::id() as i32;
    let procs = all_procs();
    let mut out = BTreeSet::new();
    let mut frontier: HashSet<i32> = HashSet::from([me]);
    while !frontier.is_empty() {
        let next: HashSet<i32> = procs
            .iter()
            .filter(|p| frontier.contains(&p.ppid) && p.pid != me && !out.contains(&p.pid))
            .map(|p| p.pid)
            .collect();
        out.extend(next.iter().copied());
        frontier = next;
    }
    for p in &procs {
        if p.pid != me && (p.session == root || p.pgrp == root) {
            out.insert(p.pid);
        }
    }
    // Zombies that are already ours are not "left": reap_zombies takes them.
    out.retain(|&pid| {
        proc_state(pid).is_some_and(|s| s != 'Z' && s != 'X') || !is_our_child(pid, &procs)
    });
    out
}

pub fn is_our_child(pid: i32, procs: &[ProcInfo]) -> bool {
    let me = std::process::id() as i32;
    procs.iter().any(|p| p.pid == pid && p.ppid == me)
}

/// Reap every exited child without blocking.
pub fn reap_zombies() {
    loop {
        let mut status = 0;
        // SAFETY: waitpid with a valid pointer to a local int.
        let r = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG | libc::__WALL) };
        if r <= 0 {
            break;
        }
    }
}

/// Whether `pid` is gone (or dead, waiting to be reaped by its parent) within `timeout`.
pub fn wait_gone(pid: i32, timeout: Duration) -> bool {
    let start = Instant::now();
    loop {
        reap_zombies();
        if matches!(proc_state(pid), None | Some('Z') | Some('X')) {
            return true;
        }
        if start.elapsed() > timeout {
            return false;
        }
        sleep(Duration::from_millis(5));
    }
}

/// `/proc/PID/status` field `key`.
pub fn status_field(pid: i32, key: &str) -> String {
    fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix(key)
                    .and_then(|r| r.strip_prefix(':'))
                    .map(|v| v.trim().to_owned())
            })
        })
        .unwrap_or_default()
}

/// `/proc/PID/stat`'s parent PID (in our namespace).
pub fn parent_pid(pid: i32) -> Option<i32> {
    let text = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat(&text).map(|s| s.1)
}

/// Whether `pid` is a live `ferry __guest-init` (PID 1 of a guest's namespaces).
pub fn is_guest_init(pid: i32) -> bool {
    let cmd = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    matches!(proc_state(pid), Some(s) if s != 'Z' && s != 'X')
        && cmd.split(|b| *b == 0).any(|a| a == b"__guest-init")
}

/// Marks every descriptor this test binary inherited beyond stdio close-on-exec, so that the
/// processes the tests start (and move) hold only what the tests give them. A pipe inherited
/// from whatever ran `cargo test` would be shared with a process outside any moved tree, which
/// a migration rightly refuses.
pub fn seal_inherited_fds() {
    let Ok(dir) = fs::read_dir("/proc/self/fd") else {
        return;
    };
    let fds: Vec<i32> = dir
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .filter(|&fd| fd > 2)
        .collect();
    for fd in fds {
        // SAFETY: fcntl on a descriptor number; at worst EBADF (the directory's own fd).
        unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    }
}
