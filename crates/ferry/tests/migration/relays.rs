//! Relays: a pipeline stage moved with its pipes relayed from home, EPIPE when the reader at
//! home goes, bulk streams both ways, and UNIX and TCP peers at home talking on to a moved
//! client or server (their names, fstat and credentials as at home).

use super::*;

/// The middle stage of a shell pipeline moves while data flows through it: its stdin and
/// stdout are pipes shared with the stages that stay home, relayed by the daemons. The last
/// stage gets every line, in order, end of file arrives through both relays, and the shell
/// (with pipefail) sees every stage succeed.
pub(super) fn pipeline_stage_moves_with_relayed_pipes() -> Result<(), Failed> {
    let c = Cluster::up("pipeline", 2);
    let dir = scratch("migration", "pipeline");
    let middle = "import sys,os\n\
        open(sys.argv[1]+'/pid.tmp','w').write(str(os.getpid()))\n\
        os.rename(sys.argv[1]+'/pid.tmp', sys.argv[1]+'/pid')\n\
        for l in sys.stdin:\n\
        \x20   print(int(l)*2, flush=True)\n";
    let reader = "import sys\n\
        n=0\n\
        for l in sys.stdin:\n\
        \x20   n+=1\n\
        \x20   assert int(l)==2*n, (l, n)\n\
        open(sys.argv[1]+'/lines','w').write(str(n))\n";
    let script = "set -o pipefail; for i in $(seq 1 300); do echo $i; sleep 0.01; done \
        | python3 -c \"$2\" \"$1\" | python3 -c \"$3\" \"$1\"";
    let mut sh = UnixServer(
        common::bash(script, "pipeline")
            .arg(&dir)
            .arg(middle)
            .arg(reader)
            .spawn()
            .unwrap(),
    );
    let pid = pid_from(&dir.join("pid"), "the middle stage")?;
    std::thread::sleep(Duration::from_millis(500));
    migrate(&c, "a", pid, "b").map_err(|e| format!("the middle stage did not move: {e}"))?;
    if common::run::tracer_of(pid) == 0 {
        return Err("no deputy at home for the middle stage".into());
    }
    let st = common::wait_child_or(&mut sh.0, Duration::from_secs(30), || {
        format!(
            "the pipeline did not end; the last stage read {:?} lines\n{}",
            std::fs::read_to_string(dir.join("lines")).ok(),
            c.log("a") + &c.log("b")
        )
    })?;
    assert!(st.success(), "the pipeline broke: {st:?}");
    assert_eq!(
        std::fs::read_to_string(dir.join("lines")).unwrap_or_default(),
        "300",
        "the last stage did not read every line"
    );
    Ok(())
}

/// Waits up to `secs` for the pipeline `sh` of a three-node cluster to end, and asserts that
/// its `last` stage read all `lines` lines once, in order (it writes how many to `dir/lines`).
/// Returns the shell's status and what the pipeline wrote to `dir/sh.err`.
pub(super) fn pipeline_end(
    c: &Cluster,
    sh: &mut UnixServer,
    dir: &Path,
    secs: u64,
    last: &str,
    lines: &str,
) -> Result<(std::process::ExitStatus, String), Failed> {
    let st = common::wait_child_or(&mut sh.0, Duration::from_secs(secs), || {
        format!(
            "the pipeline did not end; {last} read {:?} lines\n{}",
            std::fs::read_to_string(dir.join("lines")).ok(),
            c.log("a") + &c.log("b") + &c.log("c")
        )
    })?;
    let err = std::fs::read_to_string(dir.join("sh.err")).unwrap_or_default();
    assert_eq!(
        std::fs::read_to_string(dir.join("lines")).unwrap_or_default(),
        lines,
        "{last} did not read every line once, in order: {err}"
    );
    Ok((st, err))
}

/// A moved writer feeds a reader at home (`head -n 150`) through the relay; when that reader
/// has had its lines and goes, the writer gets EPIPE (Python's BrokenPipeError), as at home.
pub(super) fn relayed_pipe_reader_gone() -> Result<(), Failed> {
    let c = Cluster::up("pipegone", 2);
    let dir = scratch("migration", "pipegone");
    let writer = "import sys,os,time\n\
        open(sys.argv[1]+'/pid.tmp','w').write(str(os.getpid()))\n\
        os.rename(sys.argv[1]+'/pid.tmp', sys.argv[1]+'/pid')\n\
        try:\n\
        \x20   for i in range(100000):\n\
        \x20       print(i, flush=True)\n\
        \x20       time.sleep(0.01)\n\
        except BrokenPipeError:\n\
        \x20   open(sys.argv[1]+'/epipe','w').write('yes')\n\
        \x20   os._exit(3)\n\
        os._exit(0)\n";
    let script = "python3 -c \"$2\" \"$1\" | head -n 150 > \"$1/got\"; sleep 5";
    let mut sh = UnixServer(
        common::bash(script, "pipegone")
            .arg(&dir)
            .arg(writer)
            .spawn()
            .unwrap(),
    );
    let pid = pid_from(&dir.join("pid"), "the writer")?;
    migrate(&c, "a", pid, "b").map_err(|e| format!("the writer did not move: {e}"))?;
    let deadline = Instant::now() + Duration::from_secs(20);
    while !dir.join("epipe").exists() {
        if Instant::now() > deadline {
            return Err(format!(
                "the moved writer never saw its reader go\n{}",
                c.log("a") + &c.log("b")
            )
            .into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = sh.0.wait();
    let got = std::fs::read_to_string(dir.join("got")).unwrap_or_default();
    let want: String = (0..150).map(|i| format!("{i}\n")).collect();
    assert_eq!(
        got, want,
        "the reader at home did not get the moved writer's lines"
    );
    Ok(())
}

/// The moved middle of `feeder | BULK_MOVED | reader`, also a client of `BULK_SERVER` at home
/// over TCP. Once `go` exists it streams 24 MiB (the same bytes) to its stdout and to the
/// server, in writes of odd sizes, closes its stdout and shuts its socket down for writing;
/// then reads its stdin and the server's reply to their ends. It reports the SHA-256 and
/// length of each stream in `moved.sums`.
pub(super) const BULK_MOVED: &str = r#"
import os, sys, socket, hashlib, random, time
d = sys.argv[1]
c = socket.create_connection(('127.0.0.1', int(open(d + '/srv.port').read())))
open(d + '/pid.tmp', 'w').write(str(os.getpid()))
os.rename(d + '/pid.tmp', d + '/pid')
while not os.path.exists(d + '/go'):
    time.sleep(0.02)
data = random.Random(7).randbytes(1 << 20)
sizes = [1, 100, 4096, 65536, 131072, 7000, 300000, 5]
sent, at, i, h = 0, 0, 0, hashlib.sha256()
while sent < 24 << 20:
    n = min(sizes[i % len(sizes)], (24 << 20) - sent)
    i += 1
    chunk = data[at:at + n] if at + n <= len(data) else data[at:] + data[:at + n - len(data)]
    at = (at + n) % len(data)
    v = memoryview(chunk)
    while v:
        v = v[os.write(1, v):]
    c.sendall(chunk)
    h.update(chunk)
    sent += n
os.close(1)
c.shutdown(socket.SHUT_WR)
def drain(read):
    g, n = hashlib.sha256(), 0
    while True:
        b = read(1 << 16)
        if not b:
            return '%s %d' % (g.hexdigest(), n)
        g.update(b)
        n += len(b)
sums = ['%s %d' % (h.hexdigest(), sent), drain(lambda k: os.read(0, k)), drain(c.recv)]
open(d + '/moved.tmp', 'w').write('\n'.join(sums))
os.rename(d + '/moved.tmp', d + '/moved.sums')
"#;

/// At home: accepts one connection, waits a second before reading (its peer's data backs up
/// through the relay meanwhile), reads to end of file, then answers 8 MiB and closes.
/// `srv.sums`: what it got, then what it sent.
pub(super) const BULK_SERVER: &str = r#"
import os, sys, socket, hashlib, random, time
d = sys.argv[1]
s = socket.socket()
s.bind(('127.0.0.1', 0))
s.listen(1)
open(d + '/srv.port.tmp', 'w').write(str(s.getsockname()[1]))
os.rename(d + '/srv.port.tmp', d + '/srv.port')
c, _ = s.accept()
time.sleep(1)
g, n = hashlib.sha256(), 0
while True:
    b = c.recv(1 << 16)
    if not b:
        break
    g.update(b)
    n += len(b)
reply = random.Random(9).randbytes(8 << 20)
c.sendall(reply)
c.close()
open(d + '/srv.tmp', 'w').write('%s %d\n%s %d' % (g.hexdigest(), n,
    hashlib.sha256(reply).hexdigest(), len(reply)))
os.rename(d + '/srv.tmp', d + '/srv.sums')
"#;

/// The pipeline's ends at home: `feed` writes 8 MiB to its stdout; `read` waits a second, then
/// reads its stdin to end of file. Each writes the SHA-256 and length to `feed.sums` or
/// `read.sums`.
pub(super) const BULK_END: &str = r#"
import os, sys, hashlib, random, time
d, role = sys.argv[1], sys.argv[2]
g, n = hashlib.sha256(), 0
if role == 'feed':
    data = random.Random(11).randbytes(8 << 20)
    v = memoryview(data)
    while v:
        v = v[os.write(1, v[:1 << 20]):]
    g.update(data)
    n = len(data)
else:
    time.sleep(1)
    while True:
        b = os.read(0, 1 << 16)
        if not b:
            break
        g.update(b)
        n += len(b)
open(d + '/' + role + '.tmp', 'w').write('%s %d' % (g.hexdigest(), n))
os.rename(d + '/' + role + '.tmp', d + '/' + role + '.sums')
"#;

/// A process in the middle of a pipeline, and a TCP client of a server, all at home but it,
/// moves, then streams in bulk through its relays: 24 MiB out through the relayed pipe and
/// the relayed connection (whose readers at home start a second late: the relays are held
/// back meanwhile), end of file and a half-close behind them; then 8 MiB in through each
/// (the home's bytes pushed ahead to its node). Every stream arrives whole and in order, and
/// its end arrives after it.
pub(super) fn bulk_streams_through_relays() -> Result<(), Failed> {
    let c = Cluster::up("bulkrelay", 2);
    let dir = scratch("migration", "bulkrelay");
    let log = |name: &str| std::fs::File::create(dir.join(name)).unwrap();
    let _server = UnixServer(
        Command::new("python3")
            .args(["-c", BULK_SERVER])
            .arg(&dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log("srv.err"))
            .spawn()
            .unwrap(),
    );
    pid_from(&dir.join("srv.port"), "the server")?;
    let script = "python3 -c \"$2\" \"$1\" feed | python3 -c \"$3\" \"$1\" \
        | python3 -c \"$2\" \"$1\" read";
    let mut sh = UnixServer(
        common::bash(script, "bulkrelay")
            .arg(&dir)
            .arg(BULK_END)
            .arg(BULK_MOVED)
            .stderr(log("pipeline.err"))
            .spawn()
            .unwrap(),
    );
    let pid = pid_from(&dir.join("pid"), "the moved stage")?;
    migrate(&c, "a", pid, "b").map_err(|e| format!("the middle stage did not move: {e}"))?;
    std::fs::write(dir.join("go"), "").unwrap();
    let errs = || {
        ["srv.err", "pipeline.err"]
            .iter()
            .map(|f| std::fs::read_to_string(dir.join(f)).unwrap_or_default())
            .collect::<String>()
    };
    let st = common::wait_child_or(&mut sh.0, Duration::from_secs(90), || {
        format!(
            "the streams did not end\n{}\n{}",
            errs(),
            c.log("a") + &c.log("b")
        )
    })?;
    assert!(st.success(), "the pipeline failed: {st:?}\n{}", errs());
    let sums = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_default();
    let (moved, srv) = (sums("moved.sums"), sums("srv.sums"));
    let moved: Vec<&str> = moved.lines().collect();
    let srv: Vec<&str> = srv.lines().collect();
    assert_eq!(moved.len(), 3, "the moved stage did not finish\n{}", errs());
    assert_eq!(srv.len(), 2, "the server did not finish\n{}", errs());
    assert!(moved[0].ends_with(&format!(" {}", 24 << 20)), "{moved:?}");
    assert_eq!(
        sums("read.sums"),
        moved[0],
        "the reader at home got other bytes"
    );
    assert_eq!(srv[0], moved[0], "the server at home got other bytes");
    assert_eq!(
        moved[1],
        sums("feed.sums"),
        "the moved stage read other bytes"
    );
    assert_eq!(moved[2], srv[1], "the moved client got another reply");
    Ok(())
}

/// What getsockname(2) and getpeername(2) answer for a connection, called through libc as a C
/// program calls them, and read whole: with room for any address, with room for 4 bytes
/// (truncated, the length still the whole name's), with none, through a second descriptor
/// of the socket (dup), and with a negative length (EINVAL); then fstat's, statx's and
/// SO_PEERCRED's answers. A moved end of a relayed connection must answer exactly as it did at
/// home, though its socket is another one.
/// (Put before `STREAM_SERVER` and `STREAM_CLIENT`.)
pub(super) const SOCKET_NAMES: &str = r#"
import ctypes, os, socket
libc = ctypes.CDLL(None, use_errno=True)
def raw_name(fd, peer, room=128, length=None):
    buf = ctypes.create_string_buffer(b'\xaa' * (room + 8), room + 8)
    n = ctypes.c_int(room if length is None else length)
    f = libc.getpeername if peer else libc.getsockname
    if f(fd, buf, ctypes.byref(n)) != 0:
        return ('error', ctypes.get_errno())
    return (n.value, buf.raw)
def bad_name(fd, peer, bad_len):
    # A buffer at an unmapped address, or no length at all: EFAULT.
    n = ctypes.c_int(16)
    f = libc.getpeername if peer else libc.getsockname
    r = f(fd, None if bad_len else ctypes.c_void_p(8), None if bad_len else ctypes.byref(n))
    return (r, ctypes.get_errno() if r else None, n.value)
def stats(fd):
    # fstat(2) itself, glibc's fstat (newfstatat with AT_EMPTY_PATH), statx(2): inode, mode.
    st = ctypes.create_string_buffer(144)
    assert libc.syscall(5, fd, st) == 0
    sx = ctypes.create_string_buffer(256)
    assert libc.statx(fd, b'', 0x1000, 0x7ff, sx) == 0
    f = os.fstat(fd)
    return [('stat', int.from_bytes(st.raw[8:16], 'little'), int.from_bytes(st.raw[24:28], 'little')),
            ('fstat', f.st_ino, f.st_mode),
            ('statx', int.from_bytes(sx.raw[32:40], 'little'), int.from_bytes(sx.raw[28:30], 'little'))]
def names(s):
    fd = s.fileno()
    other = os.dup(fd)
    try:
        return [raw_name(fd, p, room, length) for p in (False, True)
                for (room, length) in ((128, None), (4, None), (0, None), (8, -1))] + \
            [raw_name(other, False), raw_name(other, True)] + \
            [bad_name(fd, p, b) for p in (False, True) for b in (False, True)] + \
            stats(fd) + stats(other) + \
            [('cred', s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))]
    finally:
        os.close(other)
def same_names(s, before, who):
    after = names(s)
    def show(l):
        out = []
        for x in l:
            if isinstance(x[1], bytes):
                b = x[1]
                while b.endswith(b'\xaa'):
                    b = b[:-1]
                x = (x[0], b.hex())
            out.append(x)
        return out
    assert after == before, '%s: socket names changed (length, bytes written before the 0xaa fill)\nbefore %r\nafter  %r' % (who, show(before), show(after))
    # From another thread too (the supervisor is told of a thread, not of its process).
    import threading
    got = []
    t = threading.Thread(target=lambda: got.append(names(s)))
    t.start()
    t.join()
    assert got == [after], '%s: another thread sees other names\n%r' % (who, show(got[0]) if got else None)
    # A socket of its own answers for itself (the filter lets the kernel answer).
    a, b = socket.socketpair()
    assert a.getsockname() == '' and raw_name(a.fileno(), True)[0] == 2
    own = int(os.readlink('/proc/self/fd/%d' % a.fileno())[8:-1])
    assert [x[1] for x in stats(a.fileno())] == [own] * 3, (stats(a.fileno()), own)
    # A path is stat'ed by the kernel, relative to a descriptor too.
    assert os.stat('.', dir_fd=os.open('/', os.O_PATH)).st_ino == os.stat('/').st_ino
    l = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    l.bind(('127.0.0.1', 0))
    assert l.getsockname()[1] != 0
    for x in (a, b, l):
        x.close()
"#;

/// A server and its client, connected by a UNIX stream socket (`unix`) or over TCP on the
/// loopback (`tcp`: the port is written to `srv.port`); one of them moves. With `once`, the
/// server closes its listener once it has accepted (a moved listener would listen on the body's
/// node). Each checks that its connection's names (`SOCKET_NAMES`) are the same at the end as
/// at the start (`srv.named`, `client.named`: read before any move).
pub(super) const STREAM_SERVER: &str = r#"
import os, sys, socket
d, kind = sys.argv[1], sys.argv[2]
if kind == 'unix':
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(d + '/srv.sock')
else:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(('127.0.0.1', 0))
    open(d + '/srv.port', 'w').write(str(srv.getsockname()[1]))
srv.listen(1)
open(d + '/pid.srv.tmp', 'w').write(str(os.getpid()))
os.rename(d + '/pid.srv.tmp', d + '/pid.srv')
open(d + '/srv.ready', 'w').close()
c, peer = srv.accept()
before = names(c)
open(d + '/srv.named', 'w').close()
if len(sys.argv) > 3:
    srv.close()
if kind == 'tcp':
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
f = c.makefile('rwb', buffering=0)
n = 0
for line in f:
    n += 1
    assert line == b'ping %d\n' % n, (line, n)
    c.sendall(b'pong %d\n' % n)
if kind == 'tcp':
    # Moved or not, a TCP socket with its options (the moved one's addresses are its node's).
    assert c.getsockopt(socket.SOL_SOCKET, socket.SO_DOMAIN) == socket.AF_INET
    assert c.getsockopt(socket.SOL_SOCKET, socket.SO_PROTOCOL) == socket.IPPROTO_TCP
    assert c.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 0)
same_names(c, before, 'server')
c.sendall(b'bye after %d\n' % n)
c.close()
open(d + '/srv.done', 'w').write(str(n))
"#;

pub(super) const STREAM_CLIENT: &str = r#"
import os, sys, socket, time
d, kind = sys.argv[1], sys.argv[2]
if kind == 'unix':
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.connect(d + '/srv.sock')
else:
    c = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    c.connect(('127.0.0.1', int(open(d + '/srv.port').read())))
before = names(c)
open(d + '/client.named', 'w').close()
open(d + '/pid.tmp', 'w').write(str(os.getpid()))
os.rename(d + '/pid.tmp', d + '/pid')
f = c.makefile('rb', buffering=0)
for i in range(1, 61):
    c.sendall(b'ping %d\n' % i)
    assert f.readline() == b'pong %d\n' % i
    time.sleep(0.05)
same_names(c, before, 'client')
c.shutdown(socket.SHUT_WR)
rest = f.read()
if kind == 'tcp':
    # Closed both ways (TIME_WAIT): no peer any more, moved or not.
    assert raw_name(c.fileno(), True) == ('error', 107), raw_name(c.fileno(), True)
open(d + '/client.done', 'w').write(rest.decode())
"#;

/// A client moves while it talks to a server that stays home over a UNIX stream socket: the
/// conversation goes on through the relay, in order; its shutdown reaches the server, and the
/// server's last words and close reach it.
pub(super) fn unix_client_of_a_home_server() -> Result<(), Failed> {
    stream_peer_moves("unix", "client")
}

/// The same over TCP: the connection's other end stays home (the home daemon keeps the
/// connection and relays it), and the server sees the same peer address to the end.
pub(super) fn tcp_client_of_a_home_server() -> Result<(), Failed> {
    stream_peer_moves("tcp", "client")
}

/// A UNIX server moves while its client at home talks to it over the connection it accepted:
/// that socket's own name is the listener's path, which the body's unnamed pair does not have.
pub(super) fn unix_server_of_a_home_client() -> Result<(), Failed> {
    stream_peer_moves("unix", "server")
}

/// A TCP server moves while its client at home talks to it over the connection it accepted.
pub(super) fn tcp_server_of_a_home_client() -> Result<(), Failed> {
    stream_peer_moves("tcp", "server")
}

/// Runs `STREAM_SERVER` and `STREAM_CLIENT` over `kind` (unix or tcp) on node a, moves `who`
/// (client or server) to node b a moment into their conversation, and checks that it finished
/// as it would have at home.
pub(super) fn stream_peer_moves(kind: &str, who: &str) -> Result<(), Failed> {
    let tag = format!("{kind}{who}relay");
    // Guests confined, as `ferry cluster up` makes them by default (so the programs run in the
    // shared tree).
    let c = Cluster::up_full(
        &tag,
        2,
        &[],
        Isolation::default_for_tests(),
        &["--confine-guests"],
    );
    let dir = scratch("migration", &tag);
    let mut srv_cmd = Command::new("python3");
    srv_cmd
        .args(["-c", &format!("{SOCKET_NAMES}\n{STREAM_SERVER}")])
        .arg(&dir)
        .current_dir(&dir)
        .arg(kind);
    if who == "server" {
        srv_cmd.arg("once");
    }
    let mut server = UnixServer(
        srv_cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("srv.err")).unwrap())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while !dir.join("srv.ready").exists() {
        if Instant::now() > deadline {
            return Err("the server did not start".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut client = UnixServer(
        Command::new("python3")
            .args(["-c", &format!("{SOCKET_NAMES}\n{STREAM_CLIENT}")])
            .arg(&dir)
            .current_dir(&dir)
            .arg(kind)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("client.err")).unwrap())
            .spawn()
            .unwrap(),
    );
    let pid = pid_from(&dir.join("pid"), "the client")?;
    let pid = if who == "server" {
        pid_from(&dir.join("pid.srv"), "the server")?
    } else {
        pid
    };
    // The mover has read its names as they are at home.
    let named = dir.join(if who == "server" {
        "srv.named"
    } else {
        "client.named"
    });
    while !named.exists() {
        if Instant::now() > deadline + Duration::from_secs(10) {
            return Err(format!("the {who} did not read its socket's names").into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    migrate(&c, "a", pid, "b").map_err(|e| format!("the {who} did not move: {e}"))?;
    let err = || {
        std::fs::read_to_string(dir.join("client.err")).unwrap_or_default()
            + &std::fs::read_to_string(dir.join("srv.err")).unwrap_or_default()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let (st, srv) = loop {
        let st = client.0.try_wait().unwrap();
        let srv = server.0.try_wait().unwrap();
        if let (Some(st), Some(srv)) = (st, srv) {
            break (st, srv);
        }
        if Instant::now() > deadline {
            return Err(format!(
                "the conversation did not finish\n{}\n{}",
                err(),
                c.log("a") + &c.log("b")
            )
            .into());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        st.success(),
        "the client failed: {st:?}\n{}\n{}",
        err(),
        c.log("a") + &c.log("b")
    );
    assert!(
        srv.success(),
        "the server failed: {srv:?}\n{}\n{}",
        err(),
        c.log("a") + &c.log("b")
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("srv.done")).unwrap_or_default(),
        "60"
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("client.done")).unwrap_or_default(),
        "bye after 60\n"
    );
    Ok(())
}

/// The middle stage of a shell pipeline moves home -> b -> c -> home while lines flow through
/// it from a writer at home to a reader at home (a failed move from b in between): its relays
/// follow it from b to c and home (the bytes b had taken from home but the stage had not read,
/// and those the stage wrote at b, reach their reader before any later ones). The reader gets every line once, in order, and the shell's
/// `wait` (pipefail) gets the moved stage's own exit status.
pub(super) fn pipeline_stage_moves_on_with_its_relays() -> Result<(), Failed> {
    let c = Cluster::up("onward", 3);
    let dir = scratch("migration", "onward");
    // The writer outruns the stage (its pipe from home stays full: bytes in every place a
    // relay holds them), and the stage writes each line as it goes.
    let middle = "import sys,os,time\n\
        open(sys.argv[1]+'/pid.tmp','w').write(str(os.getpid()))\n\
        os.rename(sys.argv[1]+'/pid.tmp', sys.argv[1]+'/pid')\n\
        for l in sys.stdin:\n\
        \x20   print(int(l)*2, flush=True)\n\
        \x20   time.sleep(0.0002)\n\
        sys.exit(3)\n";
    let reader = "import sys\n\
        n=0\n\
        for l in sys.stdin:\n\
        \x20   n+=1\n\
        \x20   assert int(l)==2*n, (l, n)\n\
        open(sys.argv[1]+'/lines','w').write(str(n))\n";
    let script = "set -o pipefail; seq 1 20000 \
        | python3 -c \"$2\" \"$1\" | python3 -c \"$3\" \"$1\"";
    let mut sh = UnixServer(
        common::bash(script, "onward")
            .arg(&dir)
            .arg(middle)
            .arg(reader)
            .stderr(std::fs::File::create(dir.join("sh.err")).unwrap())
            .spawn()
            .unwrap(),
    );
    let pid = pid_from(&dir.join("pid"), "the middle stage")?;
    std::thread::sleep(Duration::from_millis(300));
    migrate(&c, "a", pid, "b").map_err(|e| format!("the middle stage did not move: {e}"))?;
    // A move that fails after the relays were paused (no node zz) lets them go on.
    if migrate(&c, "b", pid, "zz").is_ok() {
        return Err("a move to a node that does not exist succeeded".into());
    }
    std::thread::sleep(Duration::from_millis(300));
    migrate(&c, "b", pid, "c").map_err(|e| {
        format!(
            "the middle stage did not move on from b to c: {e}\n{}",
            c.log("b")
        )
    })?;
    if common::run::tracer_of(pid) == 0 {
        return Err("no deputy at home for the middle stage".into());
    }
    std::thread::sleep(Duration::from_millis(300));
    migrate(&c, "c", pid, "a").map_err(|e| {
        format!(
            "the middle stage did not come home from c: {e}\n{}",
            c.log("c")
        )
    })?;
    let (st, err) = pipeline_end(&c, &mut sh, &dir, 40, "the last stage", "20000")?;
    assert_eq!(
        st.code(),
        Some(3),
        "the shell did not get the moved stage's exit status: {st:?} {err}"
    );
    Ok(())
}

/// A job started from an interactive shell under a terminal Ferry did not make moves a -> b,
/// then on b -> c while it prints and while a line is typed: its terminal's relay follows it.
/// Every tick it printed reaches the terminal once, in order (what it wrote on b before the
/// freeze is sent home before the relay moves); the line typed during the move and the one
/// typed after reach it once each, in order; ^Z, `fg` and ^C from the terminal act on it on c,
/// and the shell sees the right statuses (148, 130). A first try to move it on, which c
/// refuses, leaves its relay going on at b.
pub(super) fn a_job_under_a_terminal_moves_on_from_b_to_c() -> Result<(), Failed> {
    terminal_job_moved_along("ttyonward", &[("a", "b"), ("b", "!c")])
}

/// As [`a_job_under_a_terminal_moves_on_from_b_to_c`], and then home from c: it comes home as
/// a body beside its deputies (not rebuilt in their place), its terminal's relay attached to
/// the home terminal there.
pub(super) fn a_job_under_a_terminal_comes_home_from_c() -> Result<(), Failed> {
    terminal_job_moved_along("ttyhome", &[("a", "b"), ("b", "c"), ("c", "a")])
}

/// The job of `TERMINAL_JOB` under `TERMINAL_DRIVER` moved along `hops`, a line typed before
/// the last: see [`a_job_under_a_terminal_moves_on_from_b_to_c`].
fn terminal_job_moved_along(name: &str, hops: &[(&str, &str)]) -> Result<(), Failed> {
    let c = Cluster::up(name, 3);
    let dir = scratch("migration", name);
    let typing = "while not os.path.exists(d + '/moved'):\n    pump(0.1)\n";
    assert!(TERMINAL_DRIVER.contains(typing));
    let driver = TERMINAL_DRIVER.replace(
        typing,
        "typed_moving = False\n\
         while not os.path.exists(d + '/moved'):\n\
         \x20   if not typed_moving and os.path.exists(d + '/moving'):\n\
         \x20       typ(b'typed while moving\\n')\n\
         \x20       typed_moving = True\n\
         \x20       open(d + '/moving-seen', 'w').write('1')\n\
         \x20   pump(0.1)\n",
    );
    let st = drive_terminal_job_via(
        &c,
        &dir,
        &driver,
        TERMINAL_JOB,
        hops,
        Duration::from_secs(120),
    )?;
    let screen = String::from_utf8_lossy(&std::fs::read(dir.join("screen")).unwrap_or_default())
        .into_owned();
    let failed = |what: String| -> Failed {
        format!(
            "{what}\n{}\nthe terminal showed:\n{screen}\n{}",
            std::fs::read_to_string(dir.join("driver.err")).unwrap_or_default(),
            c.log("a") + &c.log("b") + &c.log("c")
        )
        .into()
    };
    if !st.success() {
        return Err(failed(format!("the driver ended with {st:?}")));
    }
    let ticks: Vec<u64> = screen
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
                "tick {} followed tick {}: output lost or repeated across the moves",
                w[1], w[0]
            )));
        }
    }
    let input = std::fs::read_to_string(dir.join("input")).unwrap_or_default();
    if input != "typed while moving\nhello from home\n" {
        return Err(failed(format!(
            "the job read {input:?}, not each typed line once, in order"
        )));
    }
    Ok(())
}

/// The messages of `DGRAM_HOME` and `DGRAM_CLIENT`: numbered, of many lengths (every 25th
/// longer than a relay's 64 KiB stream buffer), so that a message cut, merged or reordered
/// shows.
const DGRAM_MESSAGES: &str = r#"
def body(n):
    size = 100000 if n % 25 == 0 else (n * 997) % 3000
    return b'msg %d:' % n + bytes([48 + n % 10]) * size
def early(k):
    return b'early %d ' % k + b'e' * (k * 5000)
"#;

/// At home: a log daemon's datagram socket bound in this machine's /tmp (which the body's node
/// does not see; it acknowledges every 10th message to the client's own name there), and one end of a datagram socketpair whose other end the client it starts
/// holds (three datagrams wait in the client's queue, unread). Each message must arrive whole,
/// in order, from the client's PID and user (SCM_CREDENTIALS); each ping is answered by a pong
/// and an empty datagram.
const DGRAM_HOME: &str = r#"
import os, sys, socket, subprocess, select, struct
d, tmp, client, kind = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
# A zero-length record would read as the end of a seqpacket connection.
empty = kind == 'dgram'
log = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
log.bind(tmp + '/log.sock')
log.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
ty = socket.SOCK_DGRAM if kind == 'dgram' else socket.SOCK_SEQPACKET
mine, theirs = socket.socketpair(socket.AF_UNIX, ty)
for k in range(3):
    mine.send(early(k))
child = subprocess.Popen([sys.executable, '-c', client, d, tmp + '/log.sock',
                          str(theirs.fileno()), str(empty)], pass_fds=[theirs.fileno()])
theirs.close()
CRED = struct.Struct('iII')
n = pings = 0
ended = byes = False
while not (ended and byes):
    r, _, _ = select.select([log, mine], [], [], 60)
    assert r, 'nothing for 60 s after message %d, ping %d' % (n, pings)
    if log in r:
        m, anc, fl, addr = log.recvmsg(1 << 20, socket.CMSG_SPACE(CRED.size))
        assert fl & socket.MSG_TRUNC == 0
        creds = [CRED.unpack(a[2]) for a in anc if a[1] == socket.SCM_CREDENTIALS]
        assert creds and creds[0][:2] == (child.pid, os.getuid()), (creds, child.pid, n)
        if m == b'end':
            ended = True
        else:
            n += 1
            assert m == body(n), (m[:40], len(m), n)
            assert addr == tmp + '/client.sock', addr
            if n % 10 == 0:
                log.sendto(b'ack %d' % n, addr)
    if mine in r:
        m = mine.recv(1 << 20)
        if m == b'bye':
            byes = True
        else:
            pings += 1
            assert m == b'ping %d' % pings, (m, pings)
            mine.send(b'pong %d' % pings)
            if empty:
                mine.send(b'')
st = child.wait()
open(d + '/home.done', 'w').write('%d %d %d' % (n, pings, st))
"#;

/// The client, moved: it keeps logging numbered messages through its socket connected to the
/// home's log socket; once told it has moved (`moved`), it reads what waited in its pair's
/// queue, plays 20 pings with its parent, and logs 40 more messages.
const DGRAM_CLIENT: &str = r#"
import os, sys, socket, time
d, path, fd, empty = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == 'True'
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
# Bound in the home's /tmp too: the log daemon answers it there.
s.bind(os.path.dirname(path) + '/client.sock')
s.connect(path)
named = s.getsockname()
p = socket.socket(fileno=fd)
open(d + '/pid.tmp', 'w').write(str(os.getpid()))
os.rename(d + '/pid.tmp', d + '/pid')
i, moved_at, deadline = 0, None, time.time() + 60
while moved_at is None or i < moved_at + 40:
    i += 1
    s.send(body(i))
    if i % 10 == 0:
        assert s.recv(100) == b'ack %d' % i
    if moved_at is None and os.path.exists(d + '/moved'):
        moved_at = i
        open(d + '/reach', 'w').write(str(os.path.exists(path)))
        for k in range(3):
            m = p.recv(1 << 20)
            assert m == early(k), (m[:20], len(m), k)
        for k in range(1, 21):
            p.send(b'ping %d' % k)
            assert p.recv(100) == b'pong %d' % k
            if empty:
                assert p.recv(100) == b''
    assert time.time() < deadline, 'never told it moved'
    time.sleep(0.02)
assert s.getsockname() == named, (s.getsockname(), named)
s.send(b'end')
p.send(b'bye')
open(d + '/moved_at', 'w').write(str(moved_at))
"#;

/// A process moves while it holds UNIX datagram sockets to home: one connected to a log
/// daemon's socket in the home's private /tmp (syslog's /dev/log), one end of a socketpair
/// whose other end its parent at home holds. Both are relayed: every message arrives whole and
/// in order, before and after the move, from the process's PID (not the daemon's); what waited
/// in its queue comes first; replies, an empty datagram among them, come back; the relays end
/// with the client.
pub(super) fn datagrams_to_home_are_relayed_whole() -> Result<(), Failed> {
    messages_to_home_are_relayed_whole("dgram", false)
}

/// As [`datagrams_to_home_are_relayed_whole`], the client moved a -> b -> c: its relays follow
/// it, the datagrams waiting unread in its queue at b (read only once it is told it moved) go
/// on to c whole and in order, the rest as before.
pub(super) fn datagrams_to_home_follow_a_body_moving_on() -> Result<(), Failed> {
    messages_to_home_are_relayed_whole("dgram", true)
}

/// The same with seqpacket records.
pub(super) fn seqpacket_records_to_home_follow_a_body_moving_on() -> Result<(), Failed> {
    messages_to_home_are_relayed_whole("seqpacket", true)
}

/// The same with the socketpair of kind SOCK_SEQPACKET: its records are relayed whole too.
pub(super) fn seqpacket_records_to_home_are_relayed_whole() -> Result<(), Failed> {
    messages_to_home_are_relayed_whole("seqpacket", false)
}

/// Runs `DGRAM_HOME` (its pair of kind `kind`) and moves its client to node b.
fn messages_to_home_are_relayed_whole(kind: &str, onward: bool) -> Result<(), Failed> {
    let tag = &format!("{kind}relay{}", if onward { "on" } else { "" });
    let c = Cluster::up_full(
        tag,
        if onward { 3 } else { 2 },
        &[],
        Isolation::default_for_tests(),
        &["--confine-guests"],
    );
    let dir = scratch("migration", tag);
    // This machine's /tmp is node a's own: node b has a private one.
    let tmp = PathBuf::from(format!("/tmp/ferry-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).unwrap();
    struct Gone(PathBuf);
    impl Drop for Gone {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _tmp = Gone(tmp.clone());
    let mut home = UnixServer(
        Command::new("python3")
            .args(["-c", &format!("{DGRAM_MESSAGES}\n{DGRAM_HOME}")])
            .arg(&dir)
            .arg(&tmp)
            .arg(format!("{DGRAM_MESSAGES}\n{DGRAM_CLIENT}"))
            .arg(kind)
            .current_dir(&dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("home.err")).unwrap())
            .spawn()
            .unwrap(),
    );
    let pid = pid_from(&dir.join("pid"), "the client")?;
    std::thread::sleep(Duration::from_millis(400));
    migrate(&c, "a", pid, "b").map_err(|e| format!("the client did not move: {e}"))?;
    if onward {
        std::thread::sleep(Duration::from_millis(400));
        migrate(&c, "b", pid, "c").map_err(|e| {
            format!(
                "the client did not move on: {e}\n{}",
                c.log("a") + &c.log("b") + &c.log("c")
            )
        })?;
    }
    std::fs::write(dir.join("moved"), "").unwrap();
    let err = || std::fs::read_to_string(dir.join("home.err")).unwrap_or_default();
    let st = common::wait_child_or(&mut home.0, Duration::from_secs(40), || {
        format!(
            "the conversation did not finish\n{}\n{}",
            err(),
            c.log("a") + &c.log("b")
        )
    })?;
    let logs = || c.log("a") + &c.log("b") + &c.log("c");
    assert!(st.success(), "home failed: {st:?}\n{}\n{}", err(), logs());
    let moved_at: u32 = std::fs::read_to_string(dir.join("moved_at"))
        .unwrap_or_default()
        .parse()
        .unwrap_or(0);
    assert!(moved_at > 1, "the client logged nothing before it moved");
    assert_eq!(
        std::fs::read_to_string(dir.join("home.done")).unwrap_or_default(),
        format!("{} 20 0", moved_at + 40),
        "home's count of messages and pings, and the client's status"
    );
    // Nothing tells a datagram socket its peer closed: the relays find it out (the body's
    // sockets went with it) and end, at home too.
    let deadline = Instant::now() + Duration::from_secs(10);
    while c.log("a").matches("event=\"relay-closed\"").count() < 2 {
        if Instant::now() > deadline {
            return Err(format!("the relays outlived the client\n{}", logs()).into());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    if c.isolation == Isolation::Separate {
        assert_eq!(
            std::fs::read_to_string(dir.join("reach")).unwrap_or_default(),
            "False",
            "the body saw the home's /tmp: it could have reached the log socket by itself"
        );
    }
    Ok(())
}

/// At home: a server that accepts a UNIX stream connection and reads nothing until told
/// (`drain`), then everything, and writes how much (`got`).
const SILENT_SERVER: &str = r#"
import os, sys, socket, time
d, path = sys.argv[1], sys.argv[2]
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(path)
srv.listen(1)
open(d + '/ready', 'w').close()
c, _ = srv.accept()
while not os.path.exists(d + '/drain'):
    time.sleep(0.05)
got = 0
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    got += len(b)
open(d + '/got', 'w').write(str(got))
"#;

/// The client, moved: once told it has moved, it writes to the silent server as much as its
/// socket takes for 5 s (at most 768 MiB), says how much (`sent`), and closes once the server
/// drains.
const FLOODING_CLIENT: &str = r#"
import os, sys, socket, time, select
d, path = sys.argv[1], sys.argv[2]
c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
c.connect(path)
open(d + '/pid.tmp', 'w').write(str(os.getpid()))
os.rename(d + '/pid.tmp', d + '/pid')
while not os.path.exists(d + '/moved'):
    time.sleep(0.05)
c.setblocking(False)
chunk = b'x' * 65536
sent, end = 0, time.time() + 5
while time.time() < end and sent < 768 << 20:
    try:
        sent += c.send(chunk)
    except BlockingIOError:
        select.select([], [c], [], 0.1)
open(d + '/sent.tmp', 'w').write(str(sent))
os.rename(d + '/sent.tmp', d + '/sent')
c.setblocking(True)
while not os.path.exists(d + '/drain'):
    time.sleep(0.05)
c.close()
"#;

/// VmRSS of process `pid`, in bytes.
fn rss_of(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(0, |kb| kb << 10)
}

/// A moved client floods a UNIX stream socket whose server at home reads nothing: the home
/// daemon holds at most a bounded queue for it (it stops reading the relay's connection, the
/// body's node stops reading the body's socket, and the client's writes block), so its memory
/// does not grow with what the client tries to send; once the server reads, every byte the
/// client's socket took arrives.
pub(super) fn a_peer_that_never_reads_does_not_grow_the_home_daemon() -> Result<(), Failed> {
    let tag = "silentpeer";
    let c = Cluster::up_full(
        tag,
        2,
        &[],
        Isolation::default_for_tests(),
        &["--confine-guests"],
    );
    let dir = scratch("migration", tag);
    let sock = dir.join("srv.sock");
    let spawn = |src: &str, err: &str| {
        UnixServer(
            Command::new("python3")
                .args(["-c", src])
                .arg(&dir)
                .arg(&sock)
                .current_dir(&dir)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(dir.join(err)).unwrap())
                .spawn()
                .unwrap(),
        )
    };
    let mut server = spawn(SILENT_SERVER, "srv.err");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !dir.join("ready").exists() {
        if Instant::now() > deadline {
            return Err("the server did not start".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _client = spawn(FLOODING_CLIENT, "client.err");
    let pid = pid_from(&dir.join("pid"), "the client")?;
    migrate(&c, "a", pid, "b").map_err(|e| format!("the client did not move: {e}"))?;
    let home = c.daemon_pid("a");
    let before = rss_of(home);
    std::fs::write(dir.join("moved"), "").unwrap();
    let sent_file = dir.join("sent");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !sent_file.exists() {
        if Instant::now() > deadline {
            return Err(format!(
                "the client did not finish writing\n{}",
                std::fs::read_to_string(dir.join("client.err")).unwrap_or_default()
            )
            .into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let sent: u64 = std::fs::read_to_string(&sent_file)
        .unwrap_or_default()
        .parse()
        .unwrap_or(0);
    let grown = rss_of(home).saturating_sub(before);
    assert!(
        grown < 48 << 20,
        "the home daemon grew by {} MiB while the client wrote {} MiB to a peer that reads \
         nothing",
        grown >> 20,
        sent >> 20
    );
    std::fs::write(dir.join("drain"), "").unwrap();
    let st = common::wait_child_or(&mut server.0, Duration::from_secs(30), || {
        format!("the server did not drain\n{}", c.log("a") + &c.log("b"))
    })?;
    assert!(st.success(), "the server failed: {st:?}");
    assert_eq!(
        std::fs::read_to_string(dir.join("got")).unwrap_or_default(),
        sent.to_string(),
        "the server did not get every byte the client's socket took"
    );
    Ok(())
}

/// fstat of a moved pipeline stage's relayed pipes answers the pipes' inodes at home (those its
/// neighbours share), after its moves (a to b, then on to c) as before: the body's pipes are new ones of its node, and
/// its guest init answers their inode at home (`RelayedNames::is_pipe`). What
/// /proc/PID/fd/N says is the kernel's and names the body's pipe (docs/limitations.md).
pub(super) fn relayed_pipes_fstat_as_at_home() -> Result<(), Failed> {
    let c = Cluster::up("pipeino", 3);
    let dir = scratch("migration", "pipeino");
    let middle = "import sys,os\n\
        before=(os.fstat(0).st_ino, os.fstat(1).st_ino)\n\
        open(sys.argv[1]+'/pid.tmp','w').write(str(os.getpid()))\n\
        os.rename(sys.argv[1]+'/pid.tmp', sys.argv[1]+'/pid')\n\
        for l in sys.stdin:\n\
        \x20   print(int(l)*2, flush=True)\n\
        after=(os.fstat(0).st_ino, os.fstat(1).st_ino)\n\
        print('inodes %d %d %d %d' % (before+after), flush=True)\n";
    let reader = "import sys\n\
        n=0\n\
        for l in sys.stdin:\n\
        \x20   if l.startswith('inodes'):\n\
        \x20       open(sys.argv[1]+'/inodes','w').write(l)\n\
        \x20       continue\n\
        \x20   n+=1\n\
        \x20   assert int(l)==2*n, (l, n)\n\
        open(sys.argv[1]+'/lines','w').write(str(n))\n";
    let script = "set -o pipefail; for i in $(seq 1 500); do echo $i; sleep 0.01; done \
        | python3 -c \"$2\" \"$1\" | python3 -c \"$3\" \"$1\"";
    let mut sh = UnixServer(
        Command::new("bash")
            .args(["-c", script, "pipeino"])
            .arg(&dir)
            .arg(middle)
            .arg(reader)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let pid = pid_from(&dir.join("pid"), "the middle stage")?;
    // The pipes at home, as this node's kernel names them.
    let home_ino = |fd: i32| -> Result<u64, Failed> {
        let l = std::fs::read_link(format!("/proc/{pid}/fd/{fd}")).map_err(|e| e.to_string())?;
        let l = l.to_string_lossy().into_owned();
        l.strip_prefix("pipe:[")
            .and_then(|r| r.strip_suffix(']'))
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| format!("fd {fd} of the stage is {l}, not a pipe").into())
    };
    let (home0, home1) = (home_ino(0)?, home_ino(1)?);
    std::thread::sleep(Duration::from_millis(300));
    migrate(&c, "a", pid, "b").map_err(|e| format!("the middle stage did not move: {e}"))?;
    std::thread::sleep(Duration::from_millis(300));
    migrate(&c, "b", pid, "c").map_err(|e| format!("the stage did not move on to c: {e}"))?;
    let deadline = Instant::now() + Duration::from_secs(30);
    let st = loop {
        if let Some(st) = sh.0.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > deadline {
            return Err(format!(
                "the pipeline did not end\n{}",
                c.log("a") + &c.log("b") + &c.log("c")
            )
            .into());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    if !st.success() {
        return Err(format!("the pipeline broke: {st:?}\n{}", c.log("b") + &c.log("c")).into());
    }
    let said = std::fs::read_to_string(dir.join("inodes")).unwrap_or_default();
    let v: Vec<u64> = said
        .split_whitespace()
        .skip(1)
        .filter_map(|w| w.parse().ok())
        .collect();
    if v != [home0, home1, home0, home1] {
        return Err(format!(
            "fstat of stdin and stdout before and after the move: {said:?}; at home they are \
             pipe:[{home0}] and pipe:[{home1}]"
        )
        .into());
    }
    Ok(())
}
