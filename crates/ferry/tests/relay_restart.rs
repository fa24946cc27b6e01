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
        Trial::test(
            "seqpacket_records_to_home_go_on_through_a_home_daemon_restart",
            || records_through_restart("seqpacket"),
        ),
        Trial::test(
            "datagrams_to_home_go_on_through_a_home_daemon_restart",
            || records_through_restart("dgram"),
        ),
        Trial::test(
            "a_job_under_a_terminal_keeps_its_home_terminal_through_a_home_daemon_restart",
            terminal_through_restart,
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

/// The terminal the job runs in: an interactive bash under a pty that a Python driver holds
/// (a terminal Ferry did not make). Once told (`restarted`), it waits for a new tick, types a
/// line, stops the job with ^Z, resumes it with `fg`, ends it with ^C, checking what the
/// shell says each time (statuses 148 and 130).
const TERMINAL_DRIVER: &str = r#"
import os, sys, time, select, subprocess, fcntl, termios
d, job = sys.argv[1], sys.argv[2]
m, s = os.openpty()
def pre():
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
env = dict(os.environ, PS1='$ ', TERM='dumb', HISTFILE='/dev/null')
p = subprocess.Popen(['bash', '--norc', '--noprofile', '-i'], stdin=s, stdout=s, stderr=s,
                     preexec_fn=pre, env=env, close_fds=True)
os.close(s)
screen = b''
def pump(t):
    global screen
    end = time.time() + t
    while time.time() < end:
        r, _, _ = select.select([m], [], [], 0.05)
        if r:
            try:
                b = os.read(m, 65536)
            except OSError:
                return
            screen += b
            open(d + '/screen', 'wb').write(screen)
def until(pat, since=0, t=30):
    end = time.time() + t
    while time.time() < end:
        if pat in screen[since:]:
            return
        pump(0.1)
    sys.exit('timed out waiting for %r' % pat)
def typ(b):
    os.write(m, b)
pump(0.5)
typ(b'python3 ' + job.encode() + b' ' + d.encode() + b'\n')
until(b'tick 3')
while not os.path.exists(d + '/restarted'):
    pump(0.1)
until(b'tick', since=len(screen))
typ(b'hello from home\n')
end = time.time() + 30
def typed():
    try:
        return b'hello from home' in open(d + '/input', 'rb').read()
    except OSError:
        return False
while not typed():
    pump(0.1)
    if time.time() > end:
        sys.exit('the moved job never read the line typed at home')
typ(b'\x1a')
until(b'Stopped')
typ(b'echo status=$?\n')
until(b'status=148')
mark = len(screen)
typ(b'fg\n')
until(b'tick', since=mark + 10)
mark = len(screen)
typ(b'\x03')
until(b'$ ', since=mark)
mark = len(screen)
typ(b'echo status=$?\n')
until(b'status=130', since=mark)
typ(b'exit\n')
p.wait(10)
"#;

/// The job: prints a tick every 0.1 s, and appends every line it reads to `input`.
const TERMINAL_JOB: &str = r#"
import os, sys, time, threading, signal
d = sys.argv[1]
signal.signal(signal.SIGINT, signal.SIG_DFL)
open(d + '/pid.tmp', 'w').write(str(os.getpid()))
os.rename(d + '/pid.tmp', d + '/pid')
def rd():
    for l in sys.stdin:
        with open(d + '/input', 'a') as f:
            f.write(l)
threading.Thread(target=rd, daemon=True).start()
i = 0
while True:
    i += 1
    print('tick', i, flush=True)
    time.sleep(0.1)
"#;

/// A job started from an interactive shell under a terminal Ferry did not make moves a -> b
/// while it prints; a's daemon is killed (SIGKILL) and restarted while it goes on printing. Its
/// terminal's relay outlives the daemon: every tick reaches the terminal once, in order (those
/// printed while a was away come after), a line typed after the restart reaches the job, ^Z
/// stops it (the shell says Stopped, 148), `fg` resumes it and ^C ends it (130). Before, the
/// relay ended with the daemon: the job's terminal hung up.
fn terminal_through_restart() -> Result<(), Failed> {
    let c = shared("rr-tty");
    let dir = scratch("relay_restart", "rr-tty");
    let job_path = dir.join("job.py");
    std::fs::write(&job_path, TERMINAL_JOB).unwrap();
    let mut driver = Reaped(
        Command::new("python3")
            .args(["-c", TERMINAL_DRIVER])
            .arg(&dir)
            .arg(&job_path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("driver.err")).unwrap())
            .spawn()
            .unwrap(),
    );
    let screen = || {
        String::from_utf8_lossy(&std::fs::read(dir.join("screen")).unwrap_or_default()).into_owned()
    };
    let failed = |what: String| -> Failed {
        format!(
            "{what}\n{}\nthe terminal showed:\n{}\n{}",
            std::fs::read_to_string(dir.join("driver.err")).unwrap_or_default(),
            screen(),
            common::cluster::daemon_logs(&c.dir, &["a", "b"])
        )
        .into()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let pid: i32 = loop {
        if let Some(p) = std::fs::read_to_string(dir.join("pid"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
        {
            break p;
        }
        if Instant::now() > deadline {
            return Err(failed("the job did not start".into()));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    std::thread::sleep(Duration::from_millis(300));
    let o = c.run("a", &["migrate", &pid.to_string(), "--to", "b", "--json"]);
    if !o.status.success() {
        return Err(failed(format!("the job did not move: {}", text(&o))));
    }
    // Ticks from b reach the terminal before a's daemon dies.
    let shown = screen().matches("tick ").count();
    while screen().matches("tick ").count() < shown + 5 {
        if Instant::now() > deadline + Duration::from_secs(30) {
            return Err(failed("no tick from b reached the terminal".into()));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    kill_daemon(&c, "a");
    std::thread::sleep(Duration::from_secs(1));
    restart(&c, "a");
    std::fs::write(dir.join("restarted"), "").unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    let st = loop {
        if let Some(st) = driver.0.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > deadline {
            let _ = driver.0.kill();
            break driver.0.wait().unwrap();
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    if !st.success() {
        return Err(failed(format!("the driver ended with {st:?}")));
    }
    // (The typed line's echo may fall inside a tick: "tickhello from home\r\n 23".)
    let ticks: Vec<u64> = screen()
        .replace("hello from home\r\n", "")
        .replace("hello from home\n", "")
        .split("tick ")
        .skip(1)
        .filter_map(|t| {
            let n: String = t.chars().take_while(|c| c.is_ascii_digit()).collect();
            n.parse().ok()
        })
        .collect();
    for w in ticks.windows(2) {
        if w[1] != w[0] + 1 {
            return Err(failed(format!(
                "tick {} followed tick {}: output lost or repeated across the restart",
                w[1], w[0]
            )));
        }
    }
    let input = std::fs::read_to_string(dir.join("input")).unwrap_or_default();
    if input != "hello from home\n" {
        return Err(failed(format!(
            "the job read {input:?}, not the typed line once"
        )));
    }
    let a = c.log("a");
    if !a.contains("relay-recovered") {
        return Err(failed(
            "a's log says nothing of its relays taken up again".into(),
        ));
    }
    Ok(())
}

/// Both ends of a socket pair of messages (`seqpacket` or `dgram`): the parent stays home and
/// starts the child (`client`), which is moved. Each sends COUNT numbered messages of many
/// lengths (every 50th longer than a relay's 64 KiB chunk), paced, then `end`, and reads the
/// other's until its `end`, checking each whole and in order; ROLE.progress says how many it
/// read, ROLE.done what it read in all.
const RECORD_PEER: &str = r#"
import os, socket, subprocess, sys, threading, time
d, kind, role = sys.argv[1], sys.argv[2], sys.argv[3]
COUNT, PACE = 1500, 0.004
ty = socket.SOCK_SEQPACKET if kind == 'seqpacket' else socket.SOCK_DGRAM
def body(side, k):
    size = 100000 if k % 50 == 0 else (k * 997) % 5000
    return b'%s %d:' % (side, k) + bytes([48 + k % 10]) * size
if role == 'home':
    mine, theirs = socket.socketpair(socket.AF_UNIX, ty)
    child = subprocess.Popen([sys.executable, '-c', open(d + '/peer.py').read(), d, kind,
                              'client', str(theirs.fileno())], pass_fds=[theirs.fileno()])
    theirs.close()
    s, me, other = mine, b'home', b'client'
else:
    s, me, other = socket.socket(fileno=int(sys.argv[4])), b'client', b'home'
    open(d + '/pid.tmp', 'w').write(str(os.getpid()))
    os.rename(d + '/pid.tmp', d + '/pid')
    while not os.path.exists(d + '/go'):
        time.sleep(0.02)
errors = []
def send():
    try:
        for k in range(1, COUNT + 1):
            s.send(body(me, k))
            time.sleep(PACE)
        s.send(b'end')
    except Exception as e:
        errors.append('send: %r' % e)
t = threading.Thread(target=send)
t.start()
n = 0
try:
    while True:
        m = s.recv(1 << 20)
        if m == b'end':
            break
        n += 1
        if m != body(other, n):
            errors.append('message %d: %r... (%d bytes)' % (n, m[:30], len(m)))
            break
        if n % 50 == 0:
            open(d + '/' + role + '.progress.tmp', 'w').write(str(n))
            os.rename(d + '/' + role + '.progress.tmp', d + '/' + role + '.progress')
except Exception as e:
    errors.append('recv: %r' % e)
t.join()
open(d + '/' + role + '.done.tmp', 'w').write('read=%d errors=%s\n' % (n, errors))
os.rename(d + '/' + role + '.done.tmp', d + '/' + role + '.done')
if role == 'home':
    child.wait()
"#;

/// A child moved to b exchanges numbered messages over a seqpacket or datagram socket pair
/// with its parent at a (`kind`) while a's daemon is killed (SIGKILL) and restarted: both read
/// every message of the other's once, whole and in order. Before, the relay ended with the
/// daemon (the child's sends failed, the parent read no more).
fn records_through_restart(kind: &str) -> Result<(), Failed> {
    let tag = format!("rr-{kind}");
    let c = shared(&tag);
    let dir = scratch("relay_restart", &tag);
    let logs = || common::cluster::daemon_logs(&c.dir, &["a", "b"]);
    let err = || std::fs::read_to_string(dir.join("home.err")).unwrap_or_default();
    std::fs::write(dir.join("peer.py"), RECORD_PEER).unwrap();
    let _home = Reaped(
        Command::new("python3")
            .args(["-c", RECORD_PEER])
            .arg(&dir)
            .arg(kind)
            .arg("home")
            .current_dir(&dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("home.err")).unwrap())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    let pid: i32 = loop {
        if let Some(p) = std::fs::read_to_string(dir.join("pid"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
        {
            break p;
        }
        if Instant::now() > deadline {
            return Err(format!("the child did not start\n{}", err()).into());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let o = c.run("a", &["migrate", &pid.to_string(), "--to", "b", "--json"]);
    if !o.status.success() {
        return Err(format!("the child did not move: {}", text(&o)).into());
    }
    std::fs::write(dir.join("go"), "").unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while progress(&dir, "home") < 200 || progress(&dir, "client") < 200 {
        if Instant::now() > deadline {
            return Err(format!("nothing flowed through the relay\n{}\n{}", err(), logs()).into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    kill_daemon(&c, "a");
    let at_kill = (progress(&dir, "home"), progress(&dir, "client"));
    std::thread::sleep(Duration::from_secs(1));
    restart(&c, "a");
    let deadline = Instant::now() + Duration::from_secs(120);
    while !(dir.join("home.done").exists() && dir.join("client.done").exists()) {
        if Instant::now() > deadline {
            return Err(format!(
                "the exchange did not finish (read {} and {} of 1500 at home and away; \
                 {at_kill:?} when a died)\n{}\n{}",
                progress(&dir, "home"),
                progress(&dir, "client"),
                err(),
                logs()
            )
            .into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    for role in ["home", "client"] {
        let done = std::fs::read_to_string(dir.join(format!("{role}.done"))).unwrap_or_default();
        if done.trim() != "read=1500 errors=[]" {
            return Err(format!(
                "the {role} read {} ({at_kill:?} when a died)\n{}\n{}",
                done.trim(),
                err(),
                logs()
            )
            .into());
        }
    }
    if at_kill.0 >= 1500 || at_kill.1 >= 1500 {
        return Err("the exchange was over before a's daemon died: nothing tested".into());
    }
    if !c.log("a").contains("relay-recovered") {
        return Err(format!(
            "a's log says nothing of its relays taken up again\n{}",
            logs()
        )
        .into());
    }
    Ok(())
}
