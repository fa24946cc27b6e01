//! Established TCP connections through `ferry checkpoint` and `ferry restore`, with real
//! processes and real sockets on loopback: both ends in the tree, with full queues both ways
//! (bytes sent and not acknowledged, bytes never sent, bytes received and not read), through
//! `--leave-running` (the connections must work on) and through kill and restore (they must
//! close silently and come back); a connection to a peer outside the tree, which is
//! refused while the process and its connection carry on; and connections waiting in a
//! listener's queue with what their clients sent, through `--leave-running` and restore.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;

use common::{ferry, scratch};

fn state(pid: i32) -> Option<char> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    s[s.rfind(')')? + 2..].chars().next()
}

fn wait_for(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Both ends of a connection in one process. The client writes without reading until the
/// kernel takes no more (the server's receive queue and the client's send queue full, part of
/// it never sent), the server writes 1000 bytes the client does not read; then it waits for
/// `go`, reads everything, checks every byte and that the connection still works both ways,
/// and writes PASS or FAIL to `result`.
const BOTH_ENDS: &str = r#"
import os, socket, sys, time
d = sys.argv[1]
l = socket.socket()
l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
l.bind(("127.0.0.1", 0)); l.listen(4)
c = socket.socket()
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
c.connect(l.getsockname())
s, _ = l.accept()
def pattern(n, seed):
    return bytes((i * 7 + seed + i // 251) & 255 for i in range(n))
chunk = pattern(65536, 3)
c.setblocking(False)
sent = 0
while True:
    try:
        sent += c.send(chunk)
    except BlockingIOError:
        break
c.setblocking(True)
back = pattern(1000, 9)
s.sendall(back)
time.sleep(0.1)
ports = (l.getsockname()[1], c.getsockname()[1])
with open(d + "/ready.tmp", "w") as f:
    f.write("%d %d %d %d\n" % (os.getpid(), sent, ports[0], ports[1]))
os.rename(d + "/ready.tmp", d + "/ready")
while not os.path.exists(d + "/go"):
    time.sleep(0.005)
def verdict(v):
    with open(d + "/result.tmp", "w") as f:
        f.write(v + "\n")
    os.rename(d + "/result.tmp", d + "/result")
    sys.exit(0)
def read_n(sock, n):
    sock.settimeout(5)
    got = bytearray()
    while len(got) < n:
        b = sock.recv(min(1 << 20, n - len(got)))
        if not b:
            break
        got += b
    return bytes(got)
got = read_n(s, sent)
if len(got) != sent:
    verdict("FAIL: server got %d of %d bytes" % (len(got), sent))
for at in range(0, sent, 65536):
    if got[at:at + 65536] != chunk[:len(got[at:at + 65536])]:
        verdict("FAIL: bytes client -> server differ in the chunk at %d" % at)
if read_n(c, 1000) != back:
    verdict("FAIL: bytes server -> client differ")
c.sendall(b"ping")
if read_n(s, 4) != b"ping":
    verdict("FAIL: ping after restore")
s.sendall(b"pong")
if read_n(c, 4) != b"pong":
    verdict("FAIL: pong after restore")
if c.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0:
    verdict("FAIL: TCP_NODELAY lost")
if l.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR) == 0:
    verdict("FAIL: SO_REUSEADDR of the listener lost")
c2 = socket.create_connection(l.getsockname(), timeout=5)
s2, _ = l.accept()
verdict("PASS")
"#;

struct Prog {
    child: Child,
    dir: PathBuf,
    pid: i32,
    sent: usize,
    ports: (u16, u16),
}

impl Prog {
    fn start(name: &str) -> Prog {
        let dir = scratch("tcp", name);
        let log = std::fs::File::create(dir.join("log")).unwrap();
        let child = Command::new("python3")
            .args(["-c", BOTH_ENDS])
            .arg(&dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start python3");
        let ready = dir.join("ready");
        wait_for("the program to be ready", Duration::from_secs(20), || {
            ready.exists()
        });
        let text = std::fs::read_to_string(&ready).unwrap();
        let v: Vec<usize> = text
            .split_whitespace()
            .map(|w| w.parse().unwrap())
            .collect();
        assert_eq!(v[0] as u32, child.id());
        assert!(v[1] > 65536, "the client sent only {} bytes", v[1]);
        Prog {
            pid: v[0] as i32,
            sent: v[1],
            ports: (v[2] as u16, v[3] as u16),
            child,
            dir,
        }
    }

    fn go_and_pass(&self) {
        std::fs::write(self.dir.join("go"), b"").unwrap();
        let result = self.dir.join("result");
        wait_for("the verdict", Duration::from_secs(30), || result.exists());
        let v = std::fs::read_to_string(&result).unwrap();
        let log = std::fs::read_to_string(self.dir.join("log")).unwrap_or_default();
        assert_eq!(v.trim(), "PASS", "log:\n{log}");
    }
}

impl Drop for Prog {
    fn drop(&mut self) {
        // SAFETY: a PID we started (or restored); worst case ESRCH.
        unsafe { libc::kill(self.pid, libc::SIGKILL) };
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sockets of the loopback TCP table on `port` (any state), as /proc/net/tcp lists them.
fn sockets_on(port: u16) -> Vec<String> {
    let text = std::fs::read_to_string("/proc/net/tcp").unwrap();
    let needle = format!(":{port:04X}");
    text.lines()
        .skip(1)
        .filter(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            cols.len() > 3 && (cols[1].ends_with(&needle) || cols[2].ends_with(&needle))
        })
        .map(str::to_owned)
        .collect()
}

#[test]
fn a_connection_with_both_ends_in_the_tree_works_on_after_leave_running() {
    let p = Prog::start("leave-running");
    let img = p.dir.join("img");
    let (ok, _, err) = ferry(&[
        "checkpoint",
        &p.pid.to_string(),
        "--dir",
        img.to_str().unwrap(),
        "--leave-running",
    ]);
    assert!(ok, "checkpoint --leave-running failed: {err}");
    let (ok, shown, err) = ferry(&["image", "show", img.to_str().unwrap()]);
    assert!(ok, "{err}");
    let line = shown
        .lines()
        .find(|l| l.contains(&format!("127.0.0.1:{} -> ", p.ports.1)))
        .unwrap_or_else(|| panic!("no line for the client in:\n{shown}"));
    assert!(
        line.contains("established") && line.contains("sendq="),
        "{line}"
    );
    assert_ne!(state(p.pid), Some('T'));
    // The original carries on: its connections left repair mode.
    p.go_and_pass();
}

#[test]
fn a_connection_with_both_ends_in_the_tree_closes_silently_and_comes_back() {
    let mut p = Prog::start("restore");
    let img = p.dir.join("img");
    let (ok, _, err) = ferry(&[
        "checkpoint",
        &p.pid.to_string(),
        "--dir",
        img.to_str().unwrap(),
    ]);
    assert!(ok, "checkpoint failed: {err}");
    let _ = p.child.wait();
    // Killed in repair mode: no FIN, no reset, no TIME_WAIT; only the listener's port is
    // free, and nothing is left on the client's.
    let left = sockets_on(p.ports.1);
    assert!(
        left.is_empty(),
        "sockets left on the client's port after the kill:\n{}",
        left.join("\n")
    );
    let (ok, out, err) = ferry(&["restore", "--dir", img.to_str().unwrap()]);
    assert!(ok, "restore failed: {err}");
    assert_eq!(out.trim().lines().last(), Some(p.pid.to_string().as_str()));
    assert!(p.sent > 0);
    p.go_and_pass();
}

/// A client whose server is outside the tree (this test): echoes each line it receives.
const ECHO_CLIENT: &str = r#"
import socket, sys
c = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
print("ready %d" % c.fileno(), flush=True)
f = c.makefile("rwb")
for line in f:
    f.write(b"echo " + line); f.flush()
"#;

#[test]
fn a_connection_to_a_peer_outside_the_tree_is_refused_and_lives_on() {
    let d = scratch("tcp", "outside");
    let server = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = server.local_addr().unwrap().port();
    let mut child = Command::new("python3")
        .args(["-c", ECHO_CLIENT, &port.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start python3");
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    let fd: i32 = line
        .trim()
        .strip_prefix("ready ")
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("the client said {line:?}"));
    let (conn, from) = server.accept().unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut ask = |what: &str| {
        (&conn).write_all(format!("{what}\n").as_bytes()).unwrap();
        let mut got = String::new();
        reader.read_line(&mut got).unwrap();
        assert_eq!(got, format!("echo {what}\n"));
    };
    ask("one");
    let pid = child.id() as i32;
    let pid_s = pid.to_string();
    for extra in [None, Some("--leave-running")] {
        let img = d.join("img");
        let mut args = vec!["checkpoint", &pid_s, "--dir", img.to_str().unwrap()];
        args.extend(extra);
        let (ok, _, err) = ferry(&args);
        assert!(
            !ok,
            "a connection to a peer outside the tree was checkpointed"
        );
        for want in [
            format!("PID {pid}"),
            format!("fd {fd} "),
            format!("127.0.0.1:{} -> 127.0.0.1:{port}", from.port()),
            "outside the tree".to_string(),
        ] {
            assert!(err.contains(&want), "{want:?} not in the refusal: {err}");
        }
        assert!(
            err.contains(&format!("PID {}", std::process::id())),
            "the refusal does not name the peer's holder: {err}"
        );
        assert!(child.try_wait().unwrap().is_none(), "the client died");
        assert!(!matches!(state(pid), Some('T' | 't')), "left stopped");
        ask("two");
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Three clients wait in a listener's queue, not accepted: the first two already sent
/// something (it waits in the server ends, which no descriptor reaches), the third nothing.
/// Then, at `go`, the listener accepts them and must get them in that order, each with what
/// it sent, and each must work both ways.
const WAITING: &str = r#"
import os, socket, sys, time
d = sys.argv[1]
l = socket.socket()
l.bind(("127.0.0.1", 0)); l.listen(8)
cs = []
for what in (b"first", b"second", b""):
    c = socket.create_connection(l.getsockname())
    if what:
        c.sendall(what)
    cs.append((c, what))
time.sleep(0.05)
with open(d + "/ready.tmp", "w") as f:
    f.write("%d %d\n" % (os.getpid(), cs[0][0].fileno()))
os.rename(d + "/ready.tmp", d + "/ready")
while not os.path.exists(d + "/go"):
    time.sleep(0.005)
def verdict(v):
    with open(d + "/result.tmp", "w") as f:
        f.write(v + "\n")
    os.rename(d + "/result.tmp", d + "/result")
    sys.exit(0)
l.settimeout(5)
for k, (c, what) in enumerate(cs):
    s, peer = l.accept()
    if peer != c.getsockname():
        verdict("FAIL: accepted %r as connection %d, expected %r" % (peer, k, c.getsockname()))
    s.settimeout(5); c.settimeout(5)
    if what and s.recv(100) != what:
        verdict("FAIL: connection %d lost what its client sent" % k)
    s.sendall(b"reply %d" % k)
    if c.recv(100) != b"reply %d" % k:
        verdict("FAIL: connection %d: no reply" % k)
verdict("PASS")
"#;

fn start_waiting(name: &str) -> (Child, PathBuf, i32) {
    let dir = scratch("tcp", name);
    let log = std::fs::File::create(dir.join("log")).unwrap();
    let child = Command::new("python3")
        .args(["-c", WAITING])
        .arg(&dir)
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("start python3");
    let ready = dir.join("ready");
    wait_for("the program to be ready", Duration::from_secs(20), || {
        ready.exists()
    });
    let text = std::fs::read_to_string(&ready).unwrap();
    let pid: i32 = text.split_whitespace().next().unwrap().parse().unwrap();
    (child, dir, pid)
}

fn go_and_pass(dir: &std::path::Path) {
    std::fs::write(dir.join("go"), b"").unwrap();
    let result = dir.join("result");
    wait_for("the verdict", Duration::from_secs(30), || result.exists());
    let v = std::fs::read_to_string(&result).unwrap();
    let log = std::fs::read_to_string(dir.join("log")).unwrap_or_default();
    assert_eq!(v.trim(), "PASS", "log:\n{log}");
}

#[test]
fn connections_waiting_to_be_accepted_with_data_work_on_after_leave_running_and_come_back() {
    // --leave-running: the connections were accepted from a copy of the listener to be read,
    // and made again in the running tree, in the same order, with the same bytes.
    let (mut child, dir, pid) = start_waiting("waiting-leave-running");
    let img = dir.join("img");
    let (ok, _, err) = ferry(&[
        "checkpoint",
        &pid.to_string(),
        "--dir",
        img.to_str().unwrap(),
        "--leave-running",
    ]);
    assert!(ok, "checkpoint --leave-running failed: {err}");
    go_and_pass(&dir);
    let _ = child.wait();

    // Kill and restore: made again from the image.
    let (mut child, dir, pid) = start_waiting("waiting-restore");
    let img = dir.join("img");
    let (ok, _, err) = ferry(&[
        "checkpoint",
        &pid.to_string(),
        "--dir",
        img.to_str().unwrap(),
    ]);
    assert!(ok, "checkpoint failed: {err}");
    let _ = child.wait();
    let (ok, out, err) = ferry(&["restore", "--dir", img.to_str().unwrap()]);
    assert!(ok, "restore failed: {err}");
    assert_eq!(out.trim().lines().last(), Some(pid.to_string().as_str()));
    go_and_pass(&dir);
    // SAFETY: a PID we restored; worst case ESRCH.
    unsafe { libc::kill(pid, libc::SIGKILL) };
}
