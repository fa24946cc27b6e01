//! Relayed sockets and terminals through a restart of their home daemon (issue 9): a process
//! moved to b talks to a peer that stayed at a, a's daemon is killed outright (SIGKILL) while
//! bytes flow both ways and started again, and the conversation goes on: every byte once and
//! in order both ways, and the peer at home never sees a reset. (The pipes' relays are tested
//! the same way in commit_protocol.rs.)

mod common;

use common::cluster::{Cluster, Isolation, FERRY};
use common::scratch;
use libtest_mimic::{Arguments, Failed, Trial};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn main() {
    let args = Arguments::from_args();
    let tests = vec![
        Trial::test(
            "a_tcp_client_keeps_talking_to_home_through_a_home_daemon_restart",
            || stream_through_restart("tcp"),
        ),
        Trial::test(
            "a_unix_stream_client_keeps_talking_to_home_through_a_home_daemon_restart",
            || stream_through_restart("unix"),
        ),
    ];
    libtest_mimic::run(&args, tests).exit();
}

fn text(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr)
}

/// Two nodes sharing this machine's namespaces: a daemon restarted from here is where it was.
fn shared(tag: &str) -> Cluster {
    Cluster::up_full(tag, 2, &[], Isolation::Shared, &["--dead-after", "2"])
}

/// Starts node `node`'s daemon again, as its supervisor would.
fn restart(c: &Cluster, node: &str) {
    use std::os::unix::process::CommandExt;
    let data = c.dir.join(node);
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(data.join("daemon.log"))
        .unwrap();
    let mut child = Command::new(FERRY)
        .arg("daemon")
        .arg("--config")
        .arg(data.join("ferry.toml"))
        .env_remove("FAILPOINTS")
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .process_group(0)
        .spawn()
        .unwrap();
    std::fs::write(data.join("daemon.pid"), child.id().to_string()).unwrap();
    // Reaped here whenever `cluster down` stops it.
    std::thread::spawn(move || child.wait());
    let deadline = Instant::now() + Duration::from_secs(10);
    while !c.run(node, &["ps", "--json"]).status.success() {
        assert!(Instant::now() < deadline, "node {node} did not come back");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Kills node `node`'s daemon outright and waits until it is gone.
fn kill_daemon(c: &Cluster, node: &str) {
    let pid = c.daemon_pid(node);
    let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
    let deadline = Instant::now() + Duration::from_secs(30);
    while Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap_or_default()
            .contains(") Z")
    {
        assert!(
            Instant::now() < deadline,
            "node {node}'s daemon did not die"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A child killed and reaped when dropped (a test that fails leaves nothing running).
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Both ends of a stream (TCP on the loopback, or a UNIX stream socket): each sends BLOCKS
/// blocks of 4 KiB (block k of side S: SHA-256 of "S k", 128 times), paced, then shuts its way
/// down, and reads the other's until end of file; it writes what it read (byte count and
/// SHA-256, and whether that is exactly the other's blocks, in order) and any error (a reset)
/// to ROLE.done. While it runs, ROLE.progress says how many bytes it has read.
const STREAM_PEER: &str = r#"
import hashlib, os, socket, sys, threading, time
d, kind, role = sys.argv[1], sys.argv[2], sys.argv[3]
BLOCKS, PACE = 1200, 0.006
def block(side, k):
    return hashlib.sha256(b'%s %d' % (side, k)).digest() * 128
def expected(side):
    h = hashlib.sha256()
    for k in range(BLOCKS):
        h.update(block(side, k))
    return h.hexdigest()
if role == 'srv':
    if kind == 'unix':
        l = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        l.bind(d + '/srv.sock')
    else:
        l = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        l.bind(('127.0.0.1', 0))
        open(d + '/srv.port', 'w').write(str(l.getsockname()[1]))
    l.listen(1)
    open(d + '/srv.ready', 'w').close()
    c, _ = l.accept()
    l.close()
    mine, theirs = b'srv', b'client'
else:
    if kind == 'unix':
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(d + '/srv.sock')
    else:
        c = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        c.connect(('127.0.0.1', int(open(d + '/srv.port').read())))
    open(d + '/pid.tmp', 'w').write(str(os.getpid()))
    os.rename(d + '/pid.tmp', d + '/pid')
    # Starts sending once the test says so (the move first).
    while not os.path.exists(d + '/go'):
        time.sleep(0.02)
    mine, theirs = b'client', b'srv'
errors = []
def send():
    try:
        for k in range(BLOCKS):
            c.sendall(block(mine, k))
            time.sleep(PACE)
        c.shutdown(socket.SHUT_WR)
    except Exception as e:
        errors.append('send: %r' % e)
t = threading.Thread(target=send)
t.start()
h, n, last = hashlib.sha256(), 0, 0
try:
    while True:
        b = c.recv(65536)
        if not b:
            break
        h.update(b)
        n += len(b)
        if n - last >= 65536:
            last = n
            open(d + '/' + role + '.progress.tmp', 'w').write(str(n))
            os.rename(d + '/' + role + '.progress.tmp', d + '/' + role + '.progress')
except Exception as e:
    errors.append('recv: %r' % e)
t.join()
whole = n == BLOCKS * 4096 and h.hexdigest() == expected(theirs)
open(d + '/' + role + '.done.tmp', 'w').write('read=%d whole=%s errors=%s\n' % (n, whole, errors))
os.rename(d + '/' + role + '.done.tmp', d + '/' + role + '.done')
"#;

fn python(dir: &Path, kind: &str, role: &str) -> Reaped {
    Reaped(
        Command::new("python3")
            .args(["-c", STREAM_PEER])
            .arg(dir)
            .arg(kind)
            .arg(role)
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join(format!("{role}.err"))).unwrap())
            .spawn()
            .unwrap(),
    )
}

fn progress(dir: &Path, role: &str) -> u64 {
    std::fs::read_to_string(dir.join(format!("{role}.progress")))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// A client moved to b streams to its server at a and back (`kind`: tcp or unix) while a's
/// daemon is killed (SIGKILL) and restarted: both ends read every byte of the other's, once
/// and in order, and neither sees an error (no reset). Before, the relay ended with the
/// daemon: the server saw its connection reset or ended early, the client end of file.
fn stream_through_restart(kind: &str) -> Result<(), Failed> {
    let tag = format!("rr-{kind}");
    let c = shared(&tag);
    let dir = scratch("relay_restart", &tag);
    let logs = || common::cluster::daemon_logs(&c.dir, &["a", "b"]);
    let err = || {
        std::fs::read_to_string(dir.join("srv.err")).unwrap_or_default()
            + &std::fs::read_to_string(dir.join("client.err")).unwrap_or_default()
    };
    let _srv = python(&dir, kind, "srv");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !dir.join("srv.ready").exists() {
        if Instant::now() > deadline {
            return Err(format!("the server did not start\n{}", err()).into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _client = python(&dir, kind, "client");
    let pid_file = dir.join("pid");
    let pid: i32 = loop {
        if let Some(p) = std::fs::read_to_string(&pid_file)
            .ok()
            .and_then(|s| s.trim().parse().ok())
        {
            break p;
        }
        if Instant::now() > deadline {
            return Err(format!("the client did not start\n{}", err()).into());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let o = c.run("a", &["migrate", &pid.to_string(), "--to", "b", "--json"]);
    if !o.status.success() {
        return Err(format!("the client did not move: {}", text(&o)).into());
    }
    std::fs::write(dir.join("go"), "").unwrap();
    // Bytes flow both ways through b before a's daemon dies.
    let deadline = Instant::now() + Duration::from_secs(60);
    while progress(&dir, "srv") < 256 << 10 || progress(&dir, "client") < 256 << 10 {
        if Instant::now() > deadline {
            return Err(format!("nothing flowed through the relay\n{}\n{}", err(), logs()).into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    kill_daemon(&c, "a");
    let at_kill = (progress(&dir, "srv"), progress(&dir, "client"));
    std::thread::sleep(Duration::from_secs(1));
    restart(&c, "a");
    let total = 1200 * 4096;
    let deadline = Instant::now() + Duration::from_secs(120);
    while !(dir.join("srv.done").exists() && dir.join("client.done").exists()) {
        if Instant::now() > deadline {
            return Err(format!(
                "the conversation did not finish (read {} and {} of {total} by server and \
                 client; {at_kill:?} when a died)\n{}\n{}",
                progress(&dir, "srv"),
                progress(&dir, "client"),
                err(),
                logs()
            )
            .into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let want = format!("read={total} whole=True errors=[]");
    for role in ["srv", "client"] {
        let done = std::fs::read_to_string(dir.join(format!("{role}.done"))).unwrap_or_default();
        if done.trim() != want {
            return Err(format!(
                "the {role} read {}, not {want} ({at_kill:?} when a died)\n{}\n{}",
                done.trim(),
                err(),
                logs()
            )
            .into());
        }
    }
    if at_kill.0 >= total || at_kill.1 >= total {
        return Err("the stream was over before a's daemon died: nothing tested".into());
    }
    let a = c.log("a");
    if !a.contains("relay-recovered") {
        return Err(format!("a's log says nothing of its relays taken up again\n{a}").into());
    }
    Ok(())
}
