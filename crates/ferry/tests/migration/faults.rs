//! Failures around the commit point (a destination killed mid-transfer, a stalled image
//! stream, the source or the destination dying after it), pre-copy under a fast writer and a
//! failed round, a socket file and a TCP connection after an abort, hostile peers, unmovable
//! state refused, and a daemon's clean stop: each leaves the process running where it was.

use super::*;

pub(super) fn destination_killed_mid_transfer() -> Result<(), Failed> {
    let c = Cluster::up("midway", 2);
    let dir = scratch("migration", "midway");
    // Big enough that the transfer takes a while.
    let t = Ticker::start(&dir, 768);
    let pid = t.pid();
    let m = c
        .ferry("a")
        .args(["migrate", &pid.to_string(), "--to", "b"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !c.log("b").contains("migrate-in") {
        assert!(Instant::now() < deadline, "b never received the offer");
        std::thread::sleep(Duration::from_millis(2));
    }
    kill_host_pid(c.daemon_pid("b") as i64);
    let o = m.wait_with_output().unwrap();
    let e = text(&o);
    assert!(
        !o.status.success(),
        "migration to a killed node succeeded: {e}"
    );
    assert!(e.contains("keeps running on a"), "{e}");
    assert!(pid_alive(pid));
    t.assert_alive("after the destination died mid-transfer");
    Ok(())
}

/// Pre-copy (`--memory precopy`) of a process that dirties a third of its memory per second
/// and drops pages as it goes: rounds are made while it runs, the image takes most of its
/// memory from them, and every page arrives current (the victim checks all of them against
/// its own table each second), there and back again.
pub(super) fn precopy_moves_a_fast_writer() -> Result<(), Failed> {
    let c = Cluster::up("precopy", 2);
    let dir = scratch("migration", "precopy");
    let t = Ticker::dirtier(&dir, 48, 4096);
    let pid = t.pid();
    for (from, to) in [("a", "b"), ("b", "a")] {
        let o = c.run(
            from,
            &[
                "migrate",
                &pid.to_string(),
                "--to",
                to,
                "--memory",
                "precopy",
                "--json",
            ],
        );
        if !o.status.success() {
            return Err(format!("{from} -> {to}: {}", text(&o)).into());
        }
        let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let m = &r["memory"];
        assert_eq!(m["mode"], "precopy", "{r}");
        let rounds = m["rounds"].as_array().unwrap();
        assert!(!rounds.is_empty(), "no pre-copy round: {r}");
        assert!(
            rounds[0]["sent_bytes"].as_u64().unwrap() > 40 << 20,
            "the first round did not copy the memory: {r}"
        );
        assert!(
            m["inherited_bytes"].as_u64().unwrap() > 20 << 20,
            "the image did not take the rounds' pages: {r}"
        );
        // A full check of every page takes the victim a second.
        std::thread::sleep(Duration::from_millis(1300));
        t.assert_alive(&format!("after a pre-copy {from} -> {to}"));
    }
    Ok(())
}

/// A migration whose image stream stalls mid-image fails after `stream_stall_secs` (2 s here),
/// before its commit point, and the process runs on at the source: first the destination (b)
/// stops reading (fail point `stall-image-read`: the source's writes make no progress), then
/// the source (a) stops sending to c (`stall-image-send`, its second migration: c hears
/// nothing), then a's capture worker is stuck (`stop-capture-worker`, the third: it is killed,
/// which lets the process go). None hangs.
pub(super) fn stream_stalls() -> Result<(), Failed> {
    let c = Cluster::up_full(
        "stall",
        3,
        &[(
            "FAILPOINTS",
            "b:stall-image-read=return;a:stall-image-send=1*off->return;\
             a:stop-capture-worker=2*off->return",
        )],
        Isolation::default_for_tests(),
        &["--stream-stall", "2"],
    );
    let dir = scratch("migration", "stall");
    // Far more than the socket buffers between the two daemons hold.
    let t = Ticker::start(&dir, 64);
    let pid = t.pid();
    for (to, who) in [
        ("b", "the destination stops reading"),
        ("c", "the source stops sending"),
        ("c", "the capture worker is stuck"),
    ] {
        let mut m = c
            .ferry("a")
            .args(["migrate", &pid.to_string(), "--to", to])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(40);
        while m.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                let _ = m.kill();
                return Err(format!("{who}: the migration to {to} hangs").into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let o = m.wait_with_output().unwrap();
        let e = text(&o);
        assert!(
            !o.status.success(),
            "{who}: the migration to {to} succeeded: {e}"
        );
        assert!(
            e.contains("stalled") || e.contains("sent nothing"),
            "{who}: {e}"
        );
        assert!(e.contains("keeps running on a"), "{who}: {e}");
        assert!(pid_alive(pid));
        t.assert_alive(who);
    }
    Ok(())
}

/// The destination dies while pre-copy rounds run: the migration fails and the process runs
/// on at the source, its memory intact and no longer tracked.
pub(super) fn precopy_round_fails() -> Result<(), Failed> {
    let c = Cluster::up("precopy-fail", 2);
    let dir = scratch("migration", "precopy-fail");
    let t = Ticker::dirtier(&dir, 256, 2048);
    let pid = t.pid();
    let m = c
        .ferry("a")
        .args([
            "migrate",
            &pid.to_string(),
            "--to",
            "b",
            "--memory",
            "precopy",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !c.log("b").contains("migrate-in") {
        assert!(Instant::now() < deadline, "b never received the offer");
        std::thread::sleep(Duration::from_millis(2));
    }
    // Into the first round.
    std::thread::sleep(Duration::from_millis(300));
    kill_host_pid(c.daemon_pid("b") as i64);
    let o = m.wait_with_output().unwrap();
    let e = text(&o);
    assert!(
        !o.status.success(),
        "migration to a killed node succeeded: {e}"
    );
    assert!(e.contains("keeps running on a"), "{e}");
    assert!(pid_alive(pid));
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap();
    assert!(
        !smaps
            .lines()
            .any(|l| l.starts_with("VmFlags:") && l.contains(" uw")),
        "PID {pid} is still write-protect tracked"
    );
    std::thread::sleep(Duration::from_millis(1300));
    t.assert_alive("after the destination died during pre-copy");
    Ok(())
}

pub(super) fn source_dies_after_commit() -> Result<(), Failed> {
    let c = Cluster::up_with("commit", 2, &[("FAILPOINTS", "a:exit-after-commit=return")]);
    let dir = scratch("migration", "commit");
    let t = Ticker::start(&dir, 8);
    let pid = t.pid();
    let e = migrate(&c, "a", pid, "b").expect_err("the source daemon dies");
    assert!(
        e.contains("stopped answering") || e.contains("connection"),
        "{e}"
    );
    // The source's daemon is gone; the deputies' worker outlives it and keeps the original as
    // the body's deputy, for the daemon's successor (commit_protocol's restart test), while b
    // resumes the copy on its `Commit`.
    std::thread::sleep(Duration::from_secs(1));
    assert!(pid_alive(pid), "the deputy died with its home daemon");
    let deadline = Instant::now() + Duration::from_secs(5);
    let g = loop {
        if let Some(g) = guest(&c, "b", pid) {
            break g;
        }
        if Instant::now() > deadline {
            return Err("b does not host the process".into());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(g["node"], "b");
    t.assert_alive("on b after the source died");
    kill_on(&c, "b", g["pid"].as_i64().unwrap());
    Ok(())
}

pub(super) fn destination_dies_after_rebuild() -> Result<(), Failed> {
    let c = Cluster::up_with(
        "rebuilt",
        2,
        &[("FAILPOINTS", "b:exit-after-rebuilt=return")],
    );
    let dir = scratch("migration", "rebuilt");
    let t = Ticker::start(&dir, 8);
    let pid = t.pid();
    // Committed on `Rebuilt`: the migration succeeded, though b never confirmed the resume
    // (commit_protocol.rs restarts b and finds the copy listed).
    migrate(&c, "a", pid, "b").expect("committed on Rebuilt");
    // Past the commit point the copy must run, even without its daemon; the original stays
    // at home as its deputy.
    assert!(
        pid_alive(pid) && common::run::tracer_of(pid) != 0,
        "the original is not its copy's deputy"
    );
    t.assert_alive("on b after its daemon died");
    // Find and stop the copy: the ticker that writes our status file.
    let out = Command::new("pgrep")
        .args(["-f", &t.status.display().to_string()])
        .output()
        .unwrap();
    for p in String::from_utf8_lossy(&out.stdout).split_whitespace() {
        kill_host_pid(p.parse().unwrap());
    }
    Ok(())
}

pub(super) fn unix_server(path: &Path) -> UnixServer {
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/victims/unix_pid_server.py");
    // (Beside the socket's directory, whose names the tests check.)
    let (out, err) = victim_output(path.parent().and_then(Path::parent).unwrap(), "server");
    let child = Command::new("python3")
        .arg(script)
        .arg(path)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .expect("start python3");
    let deadline = Instant::now() + Duration::from_secs(10);
    while ask_pid(path).is_none() {
        assert!(Instant::now() < deadline, "the UNIX server did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    UnixServer(child)
}

/// The PID the server behind `path` says it has.
pub(super) fn ask_pid(path: &Path) -> Option<i32> {
    use std::io::Read;
    let mut s = std::os::unix::net::UnixStream::connect(path).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let mut got = String::new();
    s.read_to_string(&mut got).ok()?;
    got.parse().ok()
}

pub(super) fn names_in(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// A server bound to a socket file: the source sets the file aside while the copy is rebuilt
/// (one file system on a local cluster); the destination aborts after rebuilding, and the
/// original must be back under its name, serving; then a migration that commits must leave
/// the name to the copy and nothing aside.
pub(super) fn socket_file_after_abort() -> Result<(), Failed> {
    let c = Cluster::up_with(
        "names",
        3,
        &[("FAILPOINTS", "b:abort-after-rebuilt=return")],
    );
    let dir = scratch("migration", "names");
    let sock_dir = dir.join("sockets");
    std::fs::create_dir_all(&sock_dir).unwrap();
    let path = sock_dir.join("srv.sock");
    let server = unix_server(&path);
    let pid = server.0.id() as i32;

    let e = migrate(&c, "a", pid, "b").expect_err("b aborts after rebuilding");
    assert!(e.contains("abort-after-rebuilt"), "{e}");
    assert!(pid_alive(pid), "the original died in an aborted migration");
    assert_eq!(names_in(&sock_dir), vec!["srv.sock".to_string()]);
    assert_eq!(
        ask_pid(&path),
        Some(pid),
        "the original does not serve its name"
    );

    let r = migrate(&c, "a", pid, "c").map_err(|e| format!("a -> c: {e}"))?;
    // The original stays as the copy's deputy (it holds no descriptor: not the listener).
    assert_eq!(names_in(&sock_dir), vec!["srv.sock".to_string()]);
    // The copy serves the name, and sees its own PID as before.
    assert_eq!(
        ask_pid(&path),
        Some(pid),
        "the copy does not serve the name"
    );
    kill_on(
        &c,
        "c",
        r["dest_pid"]
            .as_i64()
            .ok_or(format!("no dest_pid in {r}"))?,
    );
    Ok(())
}

/// A process whose two ends of one loopback TCP connection talk to each other (each round,
/// a number both ways), and which reports every round in `DIR/status`: "ROUND ok|bad PID".
pub(super) const TCP_PAIR: &str = "import os,socket,time\n\
    l=socket.socket(); l.bind(('127.0.0.1',0)); l.listen()\n\
    c=socket.create_connection(l.getsockname()); s,_=l.accept()\n\
    def get(k):\n\
    \x20   b=b''\n\
    \x20   while len(b)<8:\n\
    \x20       x=k.recv(8-len(b))\n\
    \x20       if not x: return b'closed'\n\
    \x20       b+=x\n\
    \x20   return b\n\
    n=0\n\
    while True:\n\
    \x20   m=b'%08d'%n\n\
    \x20   try:\n\
    \x20       c.sendall(m); s.sendall(m); ok=get(s)==m and get(c)==m\n\
    \x20   except OSError: ok=False\n\
    \x20   open('status.tmp','w').write('%d %s %d'%(n,'ok' if ok else 'bad',os.getpid()))\n\
    \x20   os.rename('status.tmp','status')\n\
    \x20   if not ok: break\n\
    \x20   n+=1; time.sleep(0.02)\n";

/// (round, ok, PID) from the status of a [`TCP_PAIR`] process.
pub(super) fn tcp_pair_status(dir: &Path) -> Option<(u64, bool, i32)> {
    let text = std::fs::read_to_string(dir.join("status")).ok()?;
    let mut w = text.split_whitespace();
    Some((
        w.next()?.parse().ok()?,
        w.next()? == "ok",
        w.next()?.parse().ok()?,
    ))
}

/// Waits until the [`TCP_PAIR`] process in `dir` has done `more` rounds more, all good.
pub(super) fn tcp_pair_goes_on(dir: &Path, pid: i32, more: u64, when: &str) -> Result<(), Failed> {
    let start = tcp_pair_status(dir).map_or(0, |s| s.0);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match tcp_pair_status(dir) {
            Some((_, false, _)) => {
                return Err(
                    format!("{when}: the connection broke ({:?})", tcp_pair_status(dir)).into(),
                )
            }
            Some((n, true, p)) if n >= start + more => {
                if p != pid {
                    return Err(format!("{when}: the process says it is PID {p}, not {pid}").into());
                }
                return Ok(());
            }
            _ if Instant::now() > deadline => {
                return Err(format!(
                    "{when}: the connection stalled at {:?} (from round {start})",
                    tcp_pair_status(dir)
                )
                .into())
            }
            _ => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// An established TCP connection with both ends in the tree: the destination aborts after
/// rebuilding it (the copy's sockets wait in repair mode, unconnected), and the original's
/// connection must work on untouched; then a migration that commits moves the connection,
/// which goes on carrying data in the copy, and leaves nothing on the port behind (the original
/// closed in repair mode: no FIN, no reset, no TIME_WAIT).
pub(super) fn tcp_connection_after_abort() -> Result<(), Failed> {
    let c = Cluster::up_with("tcp", 3, &[("FAILPOINTS", "b:abort-after-rebuilt=return")]);
    let dir = scratch("migration", "tcp");
    let (server, r) =
        aborted_then_moved(&c, &dir, "tcp-pair", TCP_PAIR, [3, 10], tcp_pair_goes_on)?;
    // The original is the copy's deputy at home: killing it there kills the copy.
    let dest = r["dest_pid"]
        .as_i64()
        .ok_or(format!("no dest_pid in {r}"))? as i32;
    let dest = c
        .host_pid("c", dest)
        .ok_or(format!("no process of node c is its PID {dest}"))?;
    drop(server);
    let deadline = Instant::now() + Duration::from_secs(10);
    while pid_alive(dest) {
        assert!(
            Instant::now() < deadline,
            "SIGKILL to the deputy at home left its body {dest} running"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// Runs `python3 -c code` in `dir` (its output and errors in `dir`'s files of `name`, see
/// [`victim_output`]) on a, where b aborts a migration after rebuilding, and checks with
/// `goes_on(dir, pid, rounds, when)` that it works before (`rounds[0]`), after a migration to
/// b (the original must come through the abort untouched) and in the copy once it moved to c
/// (`rounds[1]` each). Returns the original, now the copy's deputy at home (killed and reaped
/// when dropped), and the answer of the migration to c.
fn aborted_then_moved(
    c: &Cluster,
    dir: &Path,
    name: &str,
    code: &str,
    rounds: [u64; 2],
    goes_on: fn(&Path, i32, u64, &str) -> Result<(), Failed>,
) -> Result<(UnixServer, serde_json::Value), Failed> {
    let (out, err) = victim_output(dir, name);
    let child = Command::new("python3")
        .args(["-c", code])
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .expect("start python3");
    let server = UnixServer(child);
    let pid = server.0.id() as i32;
    goes_on(dir, pid, rounds[0], "before")?;

    let e = migrate(c, "a", pid, "b").expect_err("b aborts after rebuilding");
    assert!(e.contains("abort-after-rebuilt"), "{e}");
    assert!(pid_alive(pid), "the original died in an aborted migration");
    goes_on(dir, pid, rounds[1], "after the abort")?;

    let r = migrate(c, "a", pid, "c").map_err(|e| format!("a -> c: {e}"))?;
    goes_on(dir, pid, rounds[1], "in the copy")?;
    Ok((server, r))
}

/// A process holding a write lease on `leased` (opened read-write), which reports every 20 ms
/// in `DIR/status`: "ROUND LEASE PID", LEASE as F_GETLEASE reads it (1: F_WRLCK).
pub(super) const WRITE_LEASE: &str = "import fcntl,os,time\n\
    fd=os.open('leased',os.O_RDWR|os.O_CREAT,0o644)\n\
    fcntl.fcntl(fd,fcntl.F_SETLEASE,fcntl.F_WRLCK)\n\
    n=0\n\
    while True:\n\
    \x20   l=fcntl.fcntl(fd,fcntl.F_GETLEASE)\n\
    \x20   open('status.tmp','w').write('%d %d %d'%(n,l,os.getpid()))\n\
    \x20   os.rename('status.tmp','status')\n\
    \x20   n+=1; time.sleep(0.02)\n";

/// Waits until the [`WRITE_LEASE`] process in `dir` has reported `more` rounds more, the last
/// one as PID `pid` holding its write lease.
fn write_lease_held(dir: &Path, pid: i32, more: u64, when: &str) -> Result<(), Failed> {
    let status = || -> Option<(u64, i32, i32)> {
        let text = std::fs::read_to_string(dir.join("status")).ok()?;
        let mut w = text.split_whitespace();
        Some((
            w.next()?.parse().ok()?,
            w.next()?.parse().ok()?,
            w.next()?.parse().ok()?,
        ))
    };
    let start = status().map_or(0, |s| s.0);
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        match status() {
            Some((n, lease, p)) if n >= start + more => {
                if (lease, p) != (libc::F_WRLCK, pid) {
                    return Err(format!(
                        "{when}: round {n}: F_GETLEASE says {lease} (not F_WRLCK, {}), as PID {p} \
                         (expected {pid})",
                        libc::F_WRLCK
                    )
                    .into());
                }
                return Ok(());
            }
            _ if Instant::now() > deadline => {
                return Err(format!("{when}: the process stalled at {:?}", status()).into())
            }
            _ => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// A write lease: the source lets go of it while the copy is rebuilt (the copy opens the file
/// again on the same kernel); the destination aborts after rebuilding, and the original must
/// hold its lease again; then a migration that commits gives the lease to the copy.
pub(super) fn write_lease_after_abort() -> Result<(), Failed> {
    let c = Cluster::up_with(
        "lease",
        3,
        &[("FAILPOINTS", "b:abort-after-rebuilt=return")],
    );
    let dir = scratch("migration", "lease");
    let (server, r) = aborted_then_moved(
        &c,
        &dir,
        "write-lease",
        WRITE_LEASE,
        [2, 5],
        write_lease_held,
    )?;
    kill_on(
        &c,
        "c",
        r["dest_pid"]
            .as_i64()
            .ok_or(format!("no dest_pid in {r}"))?,
    );
    drop(server);
    Ok(())
}

/// Speaks TLS to `addr` with openssl, offering `cert`/`key` (or none), sends `payload`, and
/// returns what openssl printed.
pub(super) fn openssl_send(
    addr: &str,
    ca: &Path,
    cert: Option<(&Path, &Path)>,
    payload: &[u8],
) -> String {
    let mut cmd = Command::new("openssl");
    cmd.args([
        "s_client",
        "-quiet",
        "-connect",
        addr,
        "-servername",
        "ferry-node.cluster",
    ])
    .arg("-CAfile")
    .arg(ca);
    if let Some((c, k)) = cert {
        cmd.arg("-cert").arg(c).arg("-key").arg(k);
    }
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    let mut stdin = child.stdin.take().unwrap();
    let _ = stdin.write_all(payload);
    std::thread::sleep(Duration::from_millis(300));
    drop(stdin);
    let o = child.wait_with_output().unwrap();
    text(&o)
}

pub(super) fn hostile_peers() -> Result<(), Failed> {
    let c = Cluster::up("hostile", 2);
    let other = Cluster::up("foreign", 1);
    let b_addr = c.listen_addr("b");
    let certs = c.dir.join("certs");
    let foreign = other.dir.join("certs");

    // A certificate from another cluster's CA, and no certificate at all: refused, logged.
    openssl_send(
        &b_addr,
        &foreign.join("ca.pem"),
        Some((&foreign.join("a.pem"), &foreign.join("a.key"))),
        b"hello",
    );
    openssl_send(&b_addr, &certs.join("ca.pem"), None, b"hello");
    // A member's certificate, then garbage; then a well-framed message that is not CBOR;
    // then a Hello claiming another name than the certificate's.
    let member = Some((certs.join("a.pem"), certs.join("a.key")));
    let member = member.as_ref().map(|(c, k)| (c.as_path(), k.as_path()));
    openssl_send(&b_addr, &certs.join("ca.pem"), member, &[0xff; 64]);
    openssl_send(
        &b_addr,
        &certs.join("ca.pem"),
        member,
        &[0, 0, 0, 3, 1, 0xff, 0xfe, 0xfd],
    );
    let mut lie = Vec::new();
    let hello = [
        0xa1, 0x65, b'H', b'e', b'l', b'l', b'o', 0xa1, 0x64, b'n', b'o', b'd', b'e', 0x61, b'b',
    ];
    lie.extend_from_slice(&(hello.len() as u32).to_be_bytes());
    lie.push(1);
    lie.extend_from_slice(&hello);
    openssl_send(&b_addr, &certs.join("ca.pem"), member, &lie);

    std::thread::sleep(Duration::from_millis(300));
    let log = c.log("b");
    let refused = log.matches("event=\"refused\"").count();
    assert!(
        refused >= 5,
        "expected 5 refusals in b's log, saw {refused}:\n{log}"
    );
    assert!(
        log.contains("certificate names \\\"a\\\"") || log.contains("certificate names"),
        "{log}"
    );
    // Still a working cluster: b answers and a migration through it works.
    let dir = scratch("migration", "hostile");
    let t = Ticker::start(&dir, 4);
    let r = migrate(&c, "a", t.pid(), "b").map_err(|e| format!("after hostile peers: {e}"))?;
    t.assert_alive("after hostile peers");
    kill_on(&c, "b", r["dest_pid"].as_i64().unwrap());
    Ok(())
}

/// A pidfd of an outside process and a holder of /dev/net/tun cannot move: the migration is refused
/// (the first before the tree is frozen), and the error names the fd or resource.
pub(super) fn unmovable_refused() -> Result<(), Failed> {
    let c = Cluster::up("unmovable", 2);
    let dir = scratch("migration", "unmovable");
    let tun = std::path::PathBuf::from("/dev/net/tun");
    // (script, what the refusal must say, whether /proc shows it before anything is frozen)
    let scripts = [
        (
            // A pidfd of a process outside the tree (a TCP connection to a peer that stays
            // behind is relayed now).
            "import os,time\nfd=os.pidfd_open(1)\n\
             open('ready','w').close(); time.sleep(60)",
            "a pidfd of a process outside the tree cannot be moved",
            true,
        ),
        (
            // A holder of /dev/net/tun (a device the engine does not capture; the kernel log
            // reader used here before moves now): the capture finds it, and thaws the tree.
            "import time,sys\nf=open(sys.argv[1],'rb')\n\
             open('ready','w').close(); time.sleep(60)",
            "(/dev/net/tun) cannot be checkpointed",
            false,
        ),
    ];
    for (script, expect, before_freezing) in scripts {
        let _ = std::fs::remove_file(dir.join("ready"));
        let mut child = Command::new("python3")
            .args(["-c", script])
            .arg(&tun)
            .current_dir(&dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        let deadline = Instant::now() + Duration::from_secs(10);
        while !dir.join("ready").exists() {
            assert!(Instant::now() < deadline, "python did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        let e = migrate(&c, "a", pid, "b").expect_err(&format!("must be refused ({expect})"));
        assert!(e.contains(expect), "{e}");
        // The refusal alone: the worker that refused had let the tree go itself.
        assert!(
            !e.contains("failed too") && !e.contains("worker") && !e.contains("died"),
            "{e}"
        );
        assert_eq!(e.contains("before freezing"), before_freezing, "{e}");
        // Back asleep in its own call (just thawed, it may still be on its way there).
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            let state = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
            if state.contains("State:\tS") && state.contains("TracerPid:\t0") {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "PID {pid} is not running freely: {state}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        if before_freezing {
            assert!(
                !c.log("b").contains("migrate-in"),
                "the offer was made anyway"
            );
        }
        let _ = child.kill();
        let _ = child.wait();
    }
    Ok(())
}

/// SIGTERM: the daemon leaves the cluster, removes its control socket and exits 0.
pub(super) fn daemon_sigterm() -> Result<(), Failed> {
    let c = Cluster::up("sigterm", 2);
    let pid = c.daemon_pid("b");
    let sock = c.dir.join("b").join("ferry.sock");
    assert!(sock.exists());
    Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while pid_alive(pid) {
        assert!(Instant::now() < deadline, "daemon b ignored SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = c.log("b");
    assert!(log.contains("event=\"stopping\""), "{log}");
    assert!(log.contains("event=\"stopped\""), "{log}");
    assert!(!sock.exists(), "control socket left behind");
    // The other node hears it left.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let o = c.run("a", &["nodes", "--json"]);
        let nodes: Vec<serde_json::Value> = serde_json::from_slice(&o.stdout).unwrap();
        if nodes.iter().all(|n| n["name"] != "b") {
            break;
        }
        assert!(Instant::now() < deadline, "a still lists b: {nodes:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}
