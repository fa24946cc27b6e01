//! Relayed sockets following a body that moves on (a -> b -> c, and home): streams both ways
//! whole across the moves (SHA-256 at both ends), a move on that fails after the rebuild, a
//! half-closed connection, and the names the body's supervisor answers.

use super::*;

/// The home end of `stream_moves_on_whole`: a server over a UNIX stream socket or TCP on the
/// loopback. Each round it reads a chunk from the client (a length, then the bytes) and
/// answers with one of its own; it hashes what it read and what it sent (SHA-256). At the
/// client's shutdown it writes `srv.sums` and closes.
const SHA_SERVER: &str = r#"
import os, sys, socket, hashlib, struct
d, kind = sys.argv[1], sys.argv[2]
if kind == 'unix':
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(d + '/srv.sock')
else:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(('127.0.0.1', 0))
    open(d + '/srv.port', 'w').write(str(srv.getsockname()[1]))
srv.listen(1)
open(d + '/srv.ready', 'w').close()
c, _ = srv.accept()
srv.close()
def chunk(tag, i, n):
    b = hashlib.sha256(b'%s %d' % (tag, i)).digest()
    return (b * (n // 32 + 1))[:n]
def exact(n):
    out = b''
    while len(out) < n:
        b = c.recv(n - len(out))
        if not b:
            return None
        out += b
    return out
got, sent, i = hashlib.sha256(), hashlib.sha256(), 0
while True:
    h = exact(4)
    if h is None:
        break
    i += 1
    data = exact(struct.unpack('>I', h)[0])
    assert data is not None, 'the client stopped in the middle of chunk %d' % i
    got.update(data)
    reply = chunk(b'srv', i, (i * 104729) % 70000 + 1)
    c.sendall(struct.pack('>I', len(reply)) + reply)
    sent.update(reply)
open(d + '/srv.sums', 'w').write('%s %s %d' % (got.hexdigest(), sent.hexdigest(), i))
c.close()
"#;

/// The moved end of `stream_moves_on_whole`: the client of `SHA_SERVER`. It reads its
/// connection's names (`SOCKET_NAMES`) first, then sends a chunk each round and reads the
/// server's answer a moment later (so that it waits unread in its socket, as a move may find
/// it), until 30 rounds after it is told it has moved (`moved`); then checks its names are
/// the original's, shuts its way down, and writes `client.sums` once the server has closed.
const SHA_CLIENT: &str = r#"
import os, sys, socket, hashlib, struct, time
d, kind = sys.argv[1], sys.argv[2]
if kind == 'unix':
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.connect(d + '/srv.sock')
else:
    c = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    c.connect(('127.0.0.1', int(open(d + '/srv.port').read())))
before = names(c)
open(d + '/pid.tmp', 'w').write(str(os.getpid()))
os.rename(d + '/pid.tmp', d + '/pid')
def chunk(tag, i, n):
    b = hashlib.sha256(b'%s %d' % (tag, i)).digest()
    return (b * (n // 32 + 1))[:n]
def exact(n):
    out = b''
    while len(out) < n:
        b = c.recv(n - len(out))
        assert b, 'the server closed early'
        out += b
    return out
got, sent, i, until, deadline = hashlib.sha256(), hashlib.sha256(), 0, None, time.time() + 120
while until is None or i < until:
    i += 1
    data = chunk(b'client', i, (i * 7919) % 50000 + 1)
    c.sendall(struct.pack('>I', len(data)) + data)
    sent.update(data)
    time.sleep(0.03)
    got.update(exact(struct.unpack('>I', exact(4))[0]))
    if until is None and os.path.exists(d + '/moved'):
        until = i + 30
    assert time.time() < deadline, 'never told it moved'
same_names(c, before, 'client')
c.shutdown(socket.SHUT_WR)
assert c.recv(1) == b''
open(d + '/client.sums', 'w').write('%s %s %d' % (sent.hexdigest(), got.hexdigest(), i))
"#;

/// A client talking to a server that stays home, over a UNIX stream socket, moves a -> b -> c
/// (a first try to c failing once it was frozen and rebuilt there: its relay goes on at b)
/// while chunks flow both ways: its
/// socket's relay follows it. Every byte arrives once, in order, both ways (SHA-256 of each
/// way at both ends), its shutdown reaches the server and the server's close reaches it, and
/// after the second move `getsockname`, `getpeername` and `fstat` still answer what they did
/// at home.
pub(super) fn a_unix_client_moves_on_talking_to_home() -> Result<(), Failed> {
    stream_moves_on_whole("unix", false)
}

/// The same over TCP on the loopback.
pub(super) fn a_tcp_client_moves_on_talking_to_home() -> Result<(), Failed> {
    stream_moves_on_whole("tcp", false)
}

/// The TCP client moved a -> b -> c comes home from c while it talks: it comes home as a body
/// beside its deputies, its socket's relay attached to the home's socket there; the streams
/// are whole and its names the original's.
pub(super) fn a_tcp_client_comes_home_talking_to_home() -> Result<(), Failed> {
    stream_moves_on_whole("tcp", true)
}

/// Runs `SHA_SERVER` at home and `SHA_CLIENT` over `kind` (unix or tcp), moves the client
/// a -> b, then on to c (failing once first), and (`home`) back to a; compares the
/// streams' sums.
fn stream_moves_on_whole(kind: &str, home: bool) -> Result<(), Failed> {
    let tag = format!("{kind}onward{}", if home { "home" } else { "" });
    // The first move to c fails after the body was frozen, captured and rebuilt there.
    let c = Cluster::up_full(
        &tag,
        3,
        &[("FAILPOINTS", "c:abort-after-rebuilt=1*return")],
        Isolation::default_for_tests(),
        &["--confine-guests"],
    );
    let dir = scratch("migration", &tag);
    let spawn = |prog: String, err: &str| {
        UnixServer(
            Command::new("python3")
                .args(["-c", &prog])
                .arg(&dir)
                .arg(kind)
                .current_dir(&dir)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(dir.join(err)).unwrap())
                .spawn()
                .unwrap(),
        )
    };
    let mut server = spawn(SHA_SERVER.to_string(), "srv.err");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !dir.join("srv.ready").exists() {
        if Instant::now() > deadline {
            return Err("the server did not start".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut client = spawn(format!("{SOCKET_NAMES}\n{SHA_CLIENT}"), "client.err");
    let pid = pid_from(&dir.join("pid"), "the client")?;
    let logs = || {
        std::fs::read_to_string(dir.join("client.err")).unwrap_or_default()
            + &std::fs::read_to_string(dir.join("srv.err")).unwrap_or_default()
            + &c.log("a")
            + &c.log("b")
            + &c.log("c")
    };
    std::thread::sleep(Duration::from_millis(300));
    migrate(&c, "a", pid, "b").map_err(|e| format!("a -> b: {e}\n{}", logs()))?;
    std::thread::sleep(Duration::from_millis(500));
    match migrate(&c, "b", pid, "c") {
        Ok(r) => return Err(format!("the first b -> c did not fail: {r}").into()),
        Err(e) if !e.contains("abort-after-rebuilt") => {
            return Err(format!("the first b -> c failed otherwise: {e}").into())
        }
        Err(_) => {}
    }
    std::thread::sleep(Duration::from_millis(300));
    migrate(&c, "b", pid, "c").map_err(|e| format!("b -> c: {e}\n{}", logs()))?;
    if home {
        std::thread::sleep(Duration::from_millis(300));
        migrate(&c, "c", pid, "a").map_err(|e| format!("c -> a: {e}\n{}", logs()))?;
    }
    std::fs::write(dir.join("moved"), "").unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let (st, srv) = loop {
        let st = client.0.try_wait().unwrap();
        let srv = server.0.try_wait().unwrap();
        if let (Some(st), Some(srv)) = (st, srv) {
            break (st, srv);
        }
        if Instant::now() > deadline {
            return Err(format!("the conversation did not finish\n{}", logs()).into());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    if !st.success() || !srv.success() {
        return Err(format!("client {st:?}, server {srv:?}\n{}", logs()).into());
    }
    let sums = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_default();
    let (mine, theirs) = (sums("client.sums"), sums("srv.sums"));
    let mine: Vec<&str> = mine.split(' ').collect();
    let theirs: Vec<&str> = theirs.split(' ').collect();
    if mine.len() != 3 || mine != theirs {
        return Err(format!(
            "the streams differ: client sent, got, rounds {mine:?}; server got, sent, rounds \
             {theirs:?}\n{}",
            logs()
        )
        .into());
    }
    Ok(())
}

/// The home end of `half_closed_stream_moves_on`: it reads the client's stream to its end
/// (the client's shutdown), then sends a stream of its own for a few seconds and closes; it
/// hashes both (`srv.sums`: got, sent).
const HALF_SERVER: &str = r#"
import os, sys, socket, hashlib, time
d, kind = sys.argv[1], sys.argv[2]
if kind == 'unix':
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(d + '/srv.sock')
else:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(('127.0.0.1', 0))
    open(d + '/srv.port', 'w').write(str(srv.getsockname()[1]))
srv.listen(1)
open(d + '/srv.ready', 'w').close()
c, _ = srv.accept()
srv.close()
got, sent = hashlib.sha256(), hashlib.sha256()
while True:
    b = c.recv(65536)
    if not b:
        break
    got.update(b)
for j in range(1, 151):
    data = (hashlib.sha256(b'tail %d' % j).digest() * 700)[:20000 + j]
    c.sendall(data)
    sent.update(data)
    time.sleep(0.02)
open(d + '/srv.sums', 'w').write('%s %s' % (got.hexdigest(), sent.hexdigest()))
c.close()
"#;

/// The moved end of `half_closed_stream_moves_on`: it sends a stream, and once told (`half`)
/// shuts its way down (`shut`) and reads the server's stream to its end (`client.sums`: sent,
/// got); a write after that fails (EPIPE) as it would at home.
const HALF_CLIENT: &str = r#"
import os, sys, socket, hashlib, time
d, kind = sys.argv[1], sys.argv[2]
if kind == 'unix':
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.connect(d + '/srv.sock')
else:
    c = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    c.connect(('127.0.0.1', int(open(d + '/srv.port').read())))
open(d + '/pid.tmp', 'w').write(str(os.getpid()))
os.rename(d + '/pid.tmp', d + '/pid')
got, sent, i, deadline = hashlib.sha256(), hashlib.sha256(), 0, time.time() + 60
while not os.path.exists(d + '/half'):
    i += 1
    data = (hashlib.sha256(b'head %d' % i).digest() * 400)[:10000 + i]
    c.sendall(data)
    sent.update(data)
    time.sleep(0.02)
    assert time.time() < deadline, 'never told to shut down'
c.shutdown(socket.SHUT_WR)
open(d + '/shut', 'w').close()
while True:
    b = c.recv(65536)
    if not b:
        break
    got.update(b)
# Its way is still shut down, moved or not.
try:
    c.send(b'x')
    sys.exit('a write after the shutdown went through')
except BrokenPipeError:
    pass
open(d + '/client.sums', 'w').write('%s %s' % (sent.hexdigest(), got.hexdigest()))
"#;

/// A client shuts its way down to a server at home (over a UNIX stream socket) after sending
/// a stream, and moves on from b to c while the server's answer streams back: the shutdown
/// stays made (the server read the client's stream to its end once, and a write of the
/// client's fails with EPIPE at c), and the client reads the server's stream whole and then
/// its close (SHA-256 of both ways at both ends).
pub(super) fn a_half_closed_unix_stream_moves_on() -> Result<(), Failed> {
    half_closed_stream_moves_on("unix")
}

/// The same over TCP.
pub(super) fn a_half_closed_tcp_stream_moves_on() -> Result<(), Failed> {
    half_closed_stream_moves_on("tcp")
}

/// Runs `HALF_SERVER` at home and `HALF_CLIENT` over `kind`, moves the client a -> b, has it
/// shut its way down, moves it on to c, and compares the streams' sums.
fn half_closed_stream_moves_on(kind: &str) -> Result<(), Failed> {
    let tag = format!("{kind}half");
    let c = Cluster::up_full(
        &tag,
        3,
        &[],
        Isolation::default_for_tests(),
        &["--confine-guests"],
    );
    let dir = scratch("migration", &tag);
    let spawn = |prog: &str, err: &str| {
        UnixServer(
            Command::new("python3")
                .args(["-c", prog])
                .arg(&dir)
                .arg(kind)
                .current_dir(&dir)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(dir.join(err)).unwrap())
                .spawn()
                .unwrap(),
        )
    };
    let mut server = spawn(HALF_SERVER, "srv.err");
    let wait_for = |f: &str, what: &str| -> Result<(), Failed> {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !dir.join(f).exists() {
            if Instant::now() > deadline {
                return Err(format!("{what} did not happen").into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    };
    wait_for("srv.ready", "the server's start")?;
    let mut client = spawn(HALF_CLIENT, "client.err");
    let pid = pid_from(&dir.join("pid"), "the client")?;
    let logs = || {
        std::fs::read_to_string(dir.join("client.err")).unwrap_or_default()
            + &std::fs::read_to_string(dir.join("srv.err")).unwrap_or_default()
            + &c.log("a")
            + &c.log("b")
            + &c.log("c")
    };
    std::thread::sleep(Duration::from_millis(300));
    migrate(&c, "a", pid, "b").map_err(|e| format!("a -> b: {e}\n{}", logs()))?;
    std::thread::sleep(Duration::from_millis(300));
    std::fs::write(dir.join("half"), "").unwrap();
    wait_for("shut", "the client's shutdown")?;
    std::thread::sleep(Duration::from_millis(500));
    migrate(&c, "b", pid, "c").map_err(|e| format!("b -> c: {e}\n{}", logs()))?;
    let deadline = Instant::now() + Duration::from_secs(60);
    let (st, srv) = loop {
        let st = client.0.try_wait().unwrap();
        let srv = server.0.try_wait().unwrap();
        if let (Some(st), Some(srv)) = (st, srv) {
            break (st, srv);
        }
        if Instant::now() > deadline {
            return Err(format!("the streams did not end\n{}", logs()).into());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    if !st.success() || !srv.success() {
        return Err(format!("client {st:?}, server {srv:?}\n{}", logs()).into());
    }
    let sums = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_default();
    let (mine, theirs) = (sums("client.sums"), sums("srv.sums"));
    if mine.split(' ').count() != 2 || mine != theirs {
        return Err(format!(
            "the streams differ: client sent, got {mine:?}; server got, sent {theirs:?}\n{}",
            logs()
        )
        .into());
    }
    Ok(())
}

/// A writer whose stdout is a pipe to a reader at home that does not read yet (its pipe, and
/// the relay's buffers behind it, full; the writer blocked) moves a -> b -> c -> a, as the
/// README's demo moves its counter: each move pauses its relay at once and succeeds (before,
/// the body's node was blocked sending to a home that had stopped reading, and the pause of
/// the third hop timed out), and once the reader reads it gets every line once, in order.
pub(super) fn a_writer_to_a_full_pipe_at_home_moves_around() -> Result<(), Failed> {
    let c = Cluster::up("fullpipe", 3);
    let dir = scratch("migration", "fullpipe");
    let writer = "import sys,os\n\
        open(sys.argv[1]+'/pid.tmp','w').write(str(os.getpid()))\n\
        os.rename(sys.argv[1]+'/pid.tmp', sys.argv[1]+'/pid')\n\
        for i in range(1, 2000001):\n\
        \x20   sys.stdout.write('%d\\n' % i)\n\
        sys.stdout.flush()\n";
    let reader = "import sys,os,time\n\
        while not os.path.exists(sys.argv[1]+'/go'):\n\
        \x20   time.sleep(0.05)\n\
        n=0\n\
        for l in sys.stdin:\n\
        \x20   n+=1\n\
        \x20   assert int(l)==n, (l, n)\n\
        open(sys.argv[1]+'/lines','w').write(str(n))\n";
    let script = "set -o pipefail; python3 -c \"$2\" \"$1\" | python3 -c \"$3\" \"$1\"";
    let mut sh = UnixServer(
        common::bash(script, "fullpipe")
            .arg(&dir)
            .arg(writer)
            .arg(reader)
            .stderr(std::fs::File::create(dir.join("sh.err")).unwrap())
            .spawn()
            .unwrap(),
    );
    // However the test ends, the reader then reads on to its end of file, and goes.
    struct Go(PathBuf);
    impl Drop for Go {
        fn drop(&mut self) {
            let _ = std::fs::write(&self.0, b"");
        }
    }
    let go = Go(dir.join("go"));
    let pid = pid_from(&dir.join("pid"), "the writer")?;
    for (on, to) in [("a", "b"), ("b", "c"), ("c", "a")] {
        // Long enough for the pipe at home and the relay to fill.
        std::thread::sleep(Duration::from_millis(1500));
        migrate(&c, on, pid, to).map_err(|e| {
            format!(
                "{on} -> {to}: {e}\n{}",
                c.log("a") + &c.log("b") + &c.log("c")
            )
        })?;
    }
    drop(go);
    let (st, err) = pipeline_end(&c, &mut sh, &dir, 60, "the reader", "2000000")?;
    assert!(st.success(), "the pipeline failed: {st:?} {err}");
    Ok(())
}
