//! Who may use which machine, with real daemons: the owner's input on a node (a real terminal
//! the node watches, typed on and read) sends its guest home, where it carries on with its
//! state; `ferry drain` empties a node and closes it; `accept never` refuses `ferry run --on`;
//! and a user holding many hosts gives one back to a user holding none.

use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

mod common;

use common::cluster::{Cluster, Isolation};

fn text(o: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}stderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn wait_until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn scratch(name: &str) -> PathBuf {
    let d = Cluster::shared_tree()
        .join("hosts")
        .join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Counts in `dir/count`, one numbered line every 0.1 s: one process, no children (a child
/// that ends between a migration's preflight and its freeze fails the move).
fn counter(dir: &Path) -> Child {
    Command::new("setsid")
        .args([
            "python3",
            "-c",
            "import time\nf = open('count', 'a')\ni = 0\nwhile True:\n    i += 1\n    \
             f.write(f'{i}\\n')\n    f.flush()\n    time.sleep(0.1)\n",
        ])
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

fn lines(dir: &Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("count"))
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

/// The count goes on, and no number was lost or doubled.
fn counts_on(dir: &Path, what: &str) {
    let n = lines(dir).len();
    wait_until(what, Duration::from_secs(10), || lines(dir).len() >= n + 5);
    for (i, l) in lines(dir).iter().enumerate() {
        assert_eq!(l, &(i + 1).to_string(), "lost or doubled lines");
    }
}

/// Where ferry ps says home PID `pid` runs.
fn runs_on(c: &Cluster, pid: i32) -> Option<String> {
    let o = c.run("a", &["ps", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).ok()?;
    v.as_array()?
        .iter()
        .find(|p| p["home_pid"] == pid)
        .and_then(|p| p["node"].as_str().map(str::to_string))
}

/// Whether home PID `pid` runs at home (a): a body there beside its deputies (listed on a), or
/// rebuilt in place of them, an ordinary process again (no longer listed, untraced).
fn at_home(c: &Cluster, pid: i32) -> bool {
    match runs_on(c, pid).as_deref() {
        Some(node) => node == "a",
        None => std::fs::read_to_string(format!("/proc/{pid}/status"))
            .is_ok_and(|s| s.contains("TracerPid:\t0\n") && !s.contains("State:\tZ")),
    }
}

fn node_load(c: &Cluster, from: &str, name: &str) -> serde_json::Value {
    let o = c.run(from, &["nodes", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
    v.as_array()
        .and_then(|a| a.iter().find(|n| n["name"] == name).cloned())
        .map(|n| n["load"].clone())
        .unwrap_or_default()
}

/// Gives node `node` an `[owner]` table and has its daemon take it up (SIGHUP).
fn set_owner(c: &Cluster, node: &str, table: &str) {
    let path = c.dir.join(node).join("ferry.toml");
    let cfg = std::fs::read_to_string(&path).unwrap();
    let (before, _) = cfg.split_once("[owner]").unwrap();
    std::fs::write(&path, format!("{before}[owner]\n{table}\n")).unwrap();
    let seen = c.log(node).matches("owner-config").count();
    // SAFETY: kill(2) with a PID and a signal number.
    unsafe { libc::kill(c.daemon_pid(node), libc::SIGHUP) };
    wait_until(
        "the daemon to take up its [owner] table",
        Duration::from_secs(5),
        || c.log(node).matches("owner-config").count() > seen,
    );
}

/// A pseudo-terminal: (master, the slave's path, the slave open).
fn pty() -> (std::fs::File, PathBuf, std::fs::File) {
    // SAFETY: posix_openpt returns a new descriptor or -1; grantpt/unlockpt/ptsname_r act on
    // it and write at most the buffer's length.
    let (master, path) = unsafe {
        let fd = libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC);
        assert!(fd >= 0, "posix_openpt");
        let master = OwnedFd::from_raw_fd(fd);
        assert_eq!(libc::grantpt(fd), 0);
        assert_eq!(libc::unlockpt(fd), 0);
        let mut buf = [0 as libc::c_char; 64];
        assert_eq!(libc::ptsname_r(fd, buf.as_mut_ptr(), buf.len()), 0);
        let name = std::ffi::CStr::from_ptr(buf.as_ptr())
            .to_string_lossy()
            .into_owned();
        (std::fs::File::from(master), PathBuf::from(name))
    };
    let slave = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOCTTY | libc::O_NONBLOCK)
        .open(&path)
        .unwrap();
    (master, path, slave)
}

/// b takes guests only while its owner is away, and its owner's input is a pty of ours (its
/// master and slave, returned) last used an hour ago; returns once b says it is
/// idle and accepting. The machine's load average is whatever the other builds here make it:
/// only input counts.
fn idle_owner_on_b(c: &Cluster) -> (std::fs::File, std::fs::File) {
    let (master, slave_path, slave) = pty();
    let o = Command::new("touch")
        .args(["-a", "-d", "1 hour ago"])
        .arg(&slave_path)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    set_owner(
        c,
        "b",
        &format!(
            "accept = \"idle\"\nload_below = 10000.0\ninput_idle_secs = 3\ninput_watch = [{:?}]",
            slave_path
        ),
    );
    wait_until(
        "b to be idle and accepting",
        Duration::from_secs(10),
        || {
            let l = node_load(c, "a", "b");
            l["accepting"] == true && l["owner"]["policy"] == "idle" && l["owner"]["idle"] == true
        },
    );
    (master, slave)
}

#[test]
fn owner_input_sends_a_guest_home_where_it_carries_on() {
    let c = Cluster::up_isolated("hosts-owner", 2, Isolation::Shared);
    let (mut master, mut slave) = idle_owner_on_b(&c);
    let dir = scratch("owner");
    let mut child = counter(&dir);
    let pid = child.id() as i32;
    counts_on(&dir, "the counter to start");
    let o = c.run("a", &["migrate", &pid.to_string(), "--to", "b"]);
    assert!(o.status.success(), "a -> b: {}", text(&o));
    assert_eq!(runs_on(&c, pid).as_deref(), Some("b"));
    counts_on(&dir, "the counter to count on b");

    // The owner types, and what is typed is read (as a shell would).
    master.write_all(b"ls\n").unwrap();
    let t = Instant::now();
    let mut got = Vec::new();
    while got.is_empty() && t.elapsed() < Duration::from_secs(5) {
        let mut buf = [0u8; 16];
        match slave.read(&mut buf) {
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    assert!(!got.is_empty(), "nothing came through the pty");
    wait_until("the guest to be sent home", Duration::from_secs(15), || {
        at_home(&c, pid)
    });
    counts_on(&dir, "the counter to count at home");
    let log = c.log("b");
    assert!(
        log.contains("event=\"owner-returned\"") || log.contains("owner-returned"),
        "{log}"
    );
    assert!(log.contains("guest-evicted"), "{log}");
    // b takes no guest while its owner is there.
    let o = c.run("a", &["run", "--on", "b", "--", "true"]);
    assert_eq!(o.status.code(), Some(125), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("accept = idle"),
        "{}",
        text(&o)
    );
    let _ = child.kill();
    let _ = child.wait();
    drop(master);
}

#[test]
fn drain_empties_a_node_and_accept_never_refuses_run_on() {
    let c = Cluster::up_isolated("hosts-drain", 2, Isolation::Shared);
    let o = c.run("b", &["accept", "never"]);
    assert!(o.status.success(), "{}", text(&o));
    let o = c.run("a", &["run", "--on", "b", "--", "true"]);
    assert_eq!(o.status.code(), Some(125), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("accept = never"),
        "{}",
        text(&o)
    );
    let o = c.run("b", &["accept", "always"]);
    assert!(o.status.success(), "{}", text(&o));
    let o = c.run("a", &["run", "--on", "b", "--", "true"]);
    assert!(o.status.success(), "{}", text(&o));

    let dir = scratch("drain");
    let mut child = counter(&dir);
    let pid = child.id() as i32;
    counts_on(&dir, "the counter to start");
    let o = c.run("a", &["migrate", &pid.to_string(), "--to", "b"]);
    assert!(o.status.success(), "a -> b: {}", text(&o));
    counts_on(&dir, "the counter to count on b");
    let o = c.run("a", &["drain", "b", "--json"]);
    assert!(o.status.success(), "{}", text(&o));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["node"], "b");
    assert_eq!(r["draining"], true);
    assert_eq!(r["guests"].as_array().unwrap().len(), 1, "{r}");
    assert_eq!(r["guests"][0]["home_pid"], pid);
    assert_eq!(r["guests"][0]["to"], "a", "{r}");
    assert!(r["total_ms"].as_f64().unwrap() > 0.0);
    assert!(at_home(&c, pid), "{:?}", runs_on(&c, pid));
    counts_on(&dir, "the counter to count at home");
    let o = c.run("a", &["run", "--on", "b", "--", "true"]);
    assert_eq!(o.status.code(), Some(125), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("drained"),
        "{}",
        text(&o)
    );
    let o = c.run("a", &["migrate", &pid.to_string(), "--to", "b"]);
    assert!(
        !o.status.success(),
        "a drained node took a guest: {}",
        text(&o)
    );
    // `ferry accept` ends the drain.
    let o = c.run("b", &["accept", "always"]);
    assert!(o.status.success(), "{}", text(&o));
    let o = c.run("a", &["run", "--on", "b", "--", "true"]);
    assert!(o.status.success(), "{}", text(&o));
    let _ = child.kill();
    let _ = child.wait();
}

fn sleeper() -> Child {
    Command::new("sleep")
        .arg("600")
        .stdin(Stdio::null())
        .spawn()
        .unwrap()
}

fn hosts_get(c: &Cluster, node: &str, uid: u32, holder: &Child, n: u32) -> serde_json::Value {
    let o = c.run(
        node,
        &[
            "hosts",
            "get",
            &n.to_string(),
            "--class",
            "cc",
            "--uid",
            &uid.to_string(),
            "--holder",
            &holder.id().to_string(),
            "--json",
        ],
    );
    serde_json::from_slice(&o.stdout).unwrap_or_else(|_| panic!("{}", text(&o)))
}

fn grants(c: &Cluster) -> Vec<(String, u64, u64)> {
    let o = c.run("a", &["nodes", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let mut out = Vec::new();
    for n in v.as_array().unwrap() {
        for g in n["load"]["grants"].as_array().into_iter().flatten() {
            out.push((
                n["name"].as_str().unwrap().to_string(),
                g["uid"].as_u64().unwrap(),
                g["holder"].as_u64().unwrap(),
            ));
        }
    }
    out.sort();
    out
}

#[test]
fn a_user_holding_many_hosts_gives_one_back_to_one_holding_none() {
    let c = Cluster::up_isolated("hosts-fair", 3, Isolation::Shared);
    wait_until(
        "every node to see the others",
        Duration::from_secs(10),
        || {
            c.run("c", &["nodes", "--json"])
                .stdout
                .windows(7)
                .filter(|w| w == b"\"alive\"")
                .count()
                == 2
        },
    );
    let mut h1 = sleeper();
    let h2 = sleeper();
    let h3 = sleeper();
    // uid 1000 takes every host: b and c from a, then a from b.
    let r = hosts_get(&c, "a", 1000, &h1, 2);
    let mut got: Vec<String> = serde_json::from_value(r["hosts"].clone()).unwrap();
    got.sort();
    assert_eq!(got, ["b", "c"], "{r}");
    // One application of a class per host: another of uid 1000's finds b and c taken.
    wait_until("the grants to be gossiped", Duration::from_secs(5), || {
        grants(&c).len() == 2
    });
    let r = hosts_get(&c, "b", 1000, &h2, 2);
    assert_eq!(r["hosts"], serde_json::json!(["a"]), "{r}");
    wait_until("the grants to be gossiped", Duration::from_secs(5), || {
        grants(&c).len() == 3
    });
    // uid 2000 holds none, uid 1000 three: one comes back to uid 2000.
    let r = hosts_get(&c, "c", 2000, &h3, 1);
    assert_eq!(r["hosts"].as_array().unwrap().len(), 1, "{r}");
    assert_eq!(r["reclaimed"][0][1], 1000, "{r}");
    wait_until(
        "the reclaimed grant to be gossiped",
        Duration::from_secs(5),
        || {
            let g = grants(&c);
            g.iter().filter(|x| x.1 == 2000).count() == 1
                && g.iter().filter(|x| x.1 == 1000).count() == 2
        },
    );
    // uid 1000 (two hosts) against uid 2000 (one): no more is taken back.
    let h4 = sleeper();
    let o = c.run(
        "c",
        &[
            "hosts",
            "get",
            "1",
            "--class",
            "cc",
            "--uid",
            "2000",
            "--holder",
            &h4.id().to_string(),
        ],
    );
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    // A holder's end gives its hosts back; an explicit release too.
    h1.kill().unwrap();
    h1.wait().unwrap();
    wait_until("h1's hosts to come back", Duration::from_secs(10), || {
        !grants(&c).iter().any(|g| g.2 == h1.id() as u64)
    });
    let o = c.run("c", &["hosts", "release", "--holder", &h3.id().to_string()]);
    assert!(o.status.success(), "{}", text(&o));
    wait_until("h3's host to come back", Duration::from_secs(5), || {
        !grants(&c).iter().any(|g| g.1 == 2000)
    });
    for mut h in [h2, h3, h4] {
        let _ = h.kill();
        let _ = h.wait();
    }
    let _ = h1.wait();
}

/// A `ferry run` program that prints one numbered line every 0.1 s on its stdout, and exits
/// with 7 once `stop` exists in its directory. With `inotify`, it first takes an inotify
/// instance with an event it never reads (a migration refuses that: it cannot move).
fn run_counter(c: &Cluster, on: &str, dir: &Path, inotify: bool) -> Child {
    let prog = format!(
        "import os, sys, time\n\
         if {inotify}:\n    \
             import ctypes\n    \
             libc = ctypes.CDLL(None)\n    \
             fd = libc.inotify_init()\n    \
             libc.inotify_add_watch(fd, b'.', 0x100)\n    \
             open('created', 'w').close()\n\
         i = 0\n\
         while not os.path.exists('stop'):\n    \
             i += 1\n    \
             print(i, flush=True)\n    \
             time.sleep(0.1)\n\
         sys.exit(7)\n",
        inotify = if inotify { "True" } else { "False" }
    );
    c.ferry("a")
        .args(["run", "--on", on, "--", "python3", "-u", "-c", &prog])
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(dir.join("count")).unwrap())
        .stderr(std::fs::File::create(dir.join("stderr")).unwrap())
        .spawn()
        .unwrap()
}

/// The `ferry run` program of `ferry run` PID `pid` runs on node `node` (ps on that node).
fn run_on(c: &Cluster, node: &str, home_pid: i32) -> bool {
    let o = c.run(node, &["ps", "--json"]);
    serde_json::from_slice::<serde_json::Value>(&o.stdout)
        .ok()
        .and_then(|v| v.as_array().cloned())
        .unwrap_or_default()
        .iter()
        .any(|p| p["home_pid"] == home_pid && p["kind"] == "remote-exec" && p["node"] == node)
}

/// The counting program, still running under its caller's `ferry run` (`run`), is told to
/// stop (`dir/stop`): `ferry run` ends with its exit code 7, every line came once and in
/// order, and nothing was said on its stderr.
fn stops_with_its_output_whole(dir: &Path, run: &mut Child) {
    assert!(run.try_wait().unwrap().is_none(), "ferry run ended");
    std::fs::write(dir.join("stop"), b"").unwrap();
    let st = wait_exit(run, Duration::from_secs(20));
    assert_eq!(st.code(), Some(7), "{st:?}");
    let n = lines(dir).len();
    for (i, l) in lines(dir).iter().enumerate() {
        assert_eq!(l, &(i + 1).to_string(), "lost or doubled lines (of {n})");
    }
    let err = std::fs::read_to_string(dir.join("stderr")).unwrap();
    assert!(err.is_empty(), "its caller was told something: {err}");
}

fn wait_exit(child: &mut Child, limit: Duration) -> std::process::ExitStatus {
    let t = Instant::now();
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return st;
        }
        if t.elapsed() > limit {
            let _ = child.kill();
            panic!("ferry run did not end within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn owner_input_moves_a_ferry_run_program_whose_caller_sees_nothing() {
    let c = Cluster::up_isolated("hosts-run-owner", 2, Isolation::Shared);
    let (mut master, mut slave) = idle_owner_on_b(&c);
    let dir = scratch("run-owner");
    let mut run = run_counter(&c, "b", &dir, false);
    let home_pid = run.id() as i32;
    wait_until("the program to run on b", Duration::from_secs(10), || {
        run_on(&c, "b", home_pid)
    });
    counts_on(&dir, "the program to count on b");

    // The owner types on b.
    master.write_all(b"ls\n").unwrap();
    let t = Instant::now();
    let mut got = Vec::new();
    while got.is_empty() && t.elapsed() < Duration::from_secs(5) {
        let mut buf = [0u8; 16];
        match slave.read(&mut buf) {
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    assert!(!got.is_empty(), "nothing came through the pty");
    wait_until("the program to leave b", Duration::from_secs(15), || {
        c.log("b").contains("guest-evicted") || c.log("b").contains("guest-not-evicted")
    });
    let log = c.log("b");
    assert!(log.contains("run-moved"), "{log}");
    assert!(!run_on(&c, "b", home_pid), "{log}");
    // Its caller is none the wiser: the count goes on, no line lost or doubled.
    counts_on(&dir, "the program to count where it went");
    stops_with_its_output_whole(&dir, &mut run);
    drop(master);
}

#[test]
fn drain_kills_a_ferry_run_program_that_cannot_move_and_its_caller_is_told() {
    let c = Cluster::up_isolated("hosts-run-drain", 2, Isolation::Shared);
    let dir = scratch("run-drain");
    let mut run = run_counter(&c, "b", &dir, true);
    let home_pid = run.id() as i32;
    wait_until("the program to run on b", Duration::from_secs(10), || {
        run_on(&c, "b", home_pid)
    });
    counts_on(&dir, "the program to count on b");
    let o = c.run("a", &["drain", "b", "--json"]);
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
    assert_eq!(
        r["guests"].as_array().map(Vec::len),
        Some(1),
        "{}",
        text(&o)
    );
    let g = &r["guests"][0];
    assert!(g["to"].is_null(), "{r}");
    assert!(
        g["error"].as_str().unwrap_or_default().contains("killed"),
        "{r}"
    );
    let st = wait_exit(&mut run, Duration::from_secs(10));
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(st.signal(), Some(libc::SIGKILL), "{st:?}");
    let err = std::fs::read_to_string(dir.join("stderr")).unwrap();
    assert!(
        err.contains("could not move") && err.contains("inotify") && err.contains("killed"),
        "{err}"
    );
    let log = c.log("b");
    assert!(log.contains("run-killed-on-eviction"), "{log}");
}

/// A `ferry run` program (its stdio relayed to its caller by the node it started on, its
/// home) moves b -> c, then c -> a: its relays follow it each time, and its caller gets every
/// line once, in order, and the program's exit code.
#[test]
fn a_ferry_run_program_moved_twice_keeps_its_callers_output_whole() {
    let c = Cluster::up_isolated("hosts-run-twice", 3, Isolation::Shared);
    let dir = scratch("run-twice");
    let mut run = run_counter(&c, "b", &dir, false);
    let caller = run.id() as i32;
    wait_until("the program to run on b", Duration::from_secs(10), || {
        run_on(&c, "b", caller)
    });
    counts_on(&dir, "the program to count on b");
    // Its PID on b, its home: what names it on the nodes it moves to.
    let o = c.run("b", &["ps", "--json"]);
    let ps: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
    let home_pid = ps
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["home_pid"] == caller && p["kind"] == "remote-exec")
        .and_then(|p| p["pid"].as_i64())
        .unwrap_or_else(|| panic!("the program is not in b's ps: {ps}"));
    let o = c.run("b", &["migrate", &caller.to_string(), "--to", "c"]);
    assert!(o.status.success(), "b -> c: {}", text(&o));
    counts_on(&dir, "the program to count on c");
    let o = c.run("c", &["migrate", &home_pid.to_string(), "--to", "a"]);
    assert!(
        o.status.success(),
        "c -> a: {}\n{}",
        text(&o),
        c.log("c") + &c.log("b")
    );
    counts_on(&dir, "the program to count on a");
    stops_with_its_output_whole(&dir, &mut run);
}

/// A `ferry run` program with a child of its own (a shell running the counter) leaves its node
/// on `ferry evict`, though the child's PID in the program's own PID namespace (which its body
/// keeps) is not its PID on the node (which its deputy there keeps): the deputies turn one into
/// the other. It moves b -> a; `kill` of the program's PID on b (its deputy) reaches the shell
/// on a (its trap runs), `kill` of the child's PID on b reaches the counter (which ends with
/// 7), and the caller gets every line once, in order, and the exit code 7. The child alone is
/// refused a move (its root would be numbered apart), before anything is frozen.
#[test]
fn a_ferry_run_program_with_a_child_is_evicted_and_its_deputies_reach_it() {
    let c = Cluster::up_isolated("hosts-run-kids", 2, Isolation::Shared);
    let dir = scratch("run-kids");
    // On SIGUSR2 the child forks (after the move: its home makes a deputy for the grandchild,
    // asked by its PID in the program's namespace) and writes what fork returned.
    let prog = "import os, signal, sys, time\n\
                stop = []\n\
                signal.signal(signal.SIGUSR1, lambda *a: stop.append(1))\n\
                def fork(*a):\n    \
                    p = os.fork()\n    \
                    if p == 0:\n        \
                        os._exit(0)\n    \
                    os.waitpid(p, 0)\n    \
                    open('forked', 'w').write(str(p))\n\
                signal.signal(signal.SIGUSR2, fork)\n\
                i = 0\n\
                while not stop:\n    \
                    i += 1\n    \
                    print(i, flush=True)\n    \
                    time.sleep(0.1)\n\
                sys.exit(7)\n";
    // The shell waits for its child again after its trap interrupts `wait`.
    let script = "trap 'echo USR2 > trapped' USR2\n\
                  python3 -u -c \"$0\" & p=$!\n\
                  while :; do wait $p; s=$?; kill -0 $p 2>/dev/null || exit $s; done\n";
    let mut run = c
        .ferry("a")
        .args(["run", "--on", "b", "--", "sh", "-c", script])
        .arg(prog)
        .current_dir(&dir)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(dir.join("count")).unwrap())
        .stderr(std::fs::File::create(dir.join("stderr")).unwrap())
        .spawn()
        .unwrap();
    let caller = run.id() as i32;
    wait_until("the program to run on b", Duration::from_secs(10), || {
        run_on(&c, "b", caller)
    });
    counts_on(&dir, "the program to count on b");
    // The shell's PID on b, and its child's, which the program's namespace numbers apart.
    let o = c.run("b", &["ps", "--json"]);
    let ps: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
    let shell = ps
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["home_pid"] == caller && p["kind"] == "remote-exec")
        .and_then(|p| p["pid"].as_i64())
        .unwrap_or_else(|| panic!("the program is not in b's ps: {ps}"));
    let children =
        std::fs::read_to_string(format!("/proc/{shell}/task/{shell}/children")).unwrap_or_default();
    let child: i64 = children
        .split_whitespace()
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("the shell {shell} has no child"));
    let status = std::fs::read_to_string(format!("/proc/{child}/status")).unwrap();
    let own: i64 = status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .and_then(|l| l.split_whitespace().last()?.parse().ok())
        .unwrap();
    assert_ne!(
        own, child,
        "the child has the same PID in its namespace: {status}"
    );
    // The child alone cannot leave: a tree is known by its root's PID, which must read the same
    // in its namespace. Refused before anything is frozen, naming it; the program counts on.
    let o = c.run("b", &["migrate", &child.to_string(), "--to", "a"]);
    let said = text(&o);
    assert!(
        !o.status.success()
            && said.contains("its PID in its own namespace")
            && said.contains(&format!("PID {own} in its own PID namespace and {child}"))
            && said.contains("refused before freezing"),
        "{said}"
    );
    counts_on(&dir, "the program to count on b still");

    let o = c.run("a", &["evict", "b", "--json"]);
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
    assert_eq!(r["guests"][0]["to"], "a", "{}\n{}", text(&o), c.log("b"));
    assert!(!run_on(&c, "b", caller), "the program is still on b");
    counts_on(&dir, "the program to count on a");

    // Its deputies on b reach it on a: the shell's ...
    let kill = |sig: &str, pid: i64| {
        let st = Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .unwrap();
        assert!(st.success(), "kill {sig} {pid}");
    };
    kill("-USR2", shell);
    wait_until(
        "the shell's trap to run on a",
        Duration::from_secs(10),
        || dir.join("trapped").exists(),
    );
    counts_on(&dir, "the program to count on after its trap");
    // ... and its child's, by its PID on b, which forks there (a deputy for the grandchild is
    // forked at b from the child's, named by the child's PID in its namespace) ...
    kill("-USR2", child);
    wait_until(
        "the moved child to fork on a",
        Duration::from_secs(20),
        || dir.join("forked").exists(),
    );
    let forked: i64 = std::fs::read_to_string(dir.join("forked"))
        .unwrap()
        .parse()
        .unwrap();
    assert!(forked > 0, "fork in the moved child returned {forked}");
    counts_on(&dir, "the program to count on after its child forked");
    // ... and stops it.
    kill("-USR1", child);
    let st = wait_exit(&mut run, Duration::from_secs(20));
    assert_eq!(st.code(), Some(7), "{st:?}\n{}", c.log("b") + &c.log("a"));
    let n = lines(&dir).len();
    for (i, l) in lines(&dir).iter().enumerate() {
        assert_eq!(l, &(i + 1).to_string(), "lost or doubled lines (of {n})");
    }
    let err = std::fs::read_to_string(dir.join("stderr")).unwrap();
    assert!(err.is_empty(), "its caller was told something: {err}");
}
