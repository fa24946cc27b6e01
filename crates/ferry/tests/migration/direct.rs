//! Both ends of a pipe moved to one node: their relays through home are joined there, and the
//! bytes go straight from the writer to the reader (crate ferry-daemon, `relay_join.rs`).

use super::*;

/// A stage writing its pid to `DIR/spid` that copies its stdin to its stdout, a line at a
/// time, `sleep` seconds apart.
const STAGE: &str = "import sys,os,time\n\
    open(sys.argv[1]+'/spid.tmp','w').write(str(os.getpid()))\n\
    os.rename(sys.argv[1]+'/spid.tmp', sys.argv[1]+'/spid')\n\
    for l in sys.stdin:\n\
    \x20   sys.stdout.write(l)\n\
    \x20   sys.stdout.flush()\n\
    \x20   time.sleep(float(sys.argv[2]))\n";

/// A reader writing its pid to `DIR/rpid` that checks each line is the next number, says how
/// many it has read in `DIR/n` every 20 lines, writes the count to `DIR/lines` at end of file,
/// and stops early (exit 0) once `DIR/stop` exists.
const READER: &str = "import sys,os\n\
    d=sys.argv[1]\n\
    open(d+'/rpid.tmp','w').write(str(os.getpid()))\n\
    os.rename(d+'/rpid.tmp', d+'/rpid')\n\
    n=0\n\
    for l in sys.stdin:\n\
    \x20   n+=1\n\
    \x20   assert int(l)==n, (l, n)\n\
    \x20   if n%20==0:\n\
    \x20       open(d+'/n.tmp','w').write(str(n))\n\
    \x20       os.rename(d+'/n.tmp', d+'/n')\n\
    \x20       if os.path.exists(d+'/stop'):\n\
    \x20           sys.exit(0)\n\
    open(d+'/lines','w').write(str(n))\n";

/// A writer that dies of SIGPIPE as a C program would (Python ignores it by default),
/// printing 1, 2, 3, ... 5 ms apart, its pid in `DIR/spid`.
const WRITER: &str = "import sys,os,time,signal\n\
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)\n\
    open(sys.argv[1]+'/spid.tmp','w').write(str(os.getpid()))\n\
    os.rename(sys.argv[1]+'/spid.tmp', sys.argv[1]+'/spid')\n\
    i=0\n\
    while True:\n\
    \x20   i+=1\n\
    \x20   print(i, flush=True)\n\
    \x20   time.sleep(0.005)\n";

/// The lines the reader has read so far.
fn progress(dir: &Path) -> u64 {
    std::fs::read_to_string(dir.join("n"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// What home `a` counts as relayed for the tree of home PID `pid` (`ferry top`).
fn relayed(c: &Cluster, pid: i32) -> Option<u64> {
    let o = c.run("a", &["top", "--once", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).ok()?;
    v["processes"]
        .as_array()?
        .iter()
        .find(|p| p["home_pid"] == pid)?["cost"]["bytes_relayed"]
        .as_u64()
}

/// Starts `writer | reader` (the writer fed by `seq 1 LINES` when it is the stage) in `dir`,
/// moves the writer, then the reader, from a to b while the lines flow, and waits for home to
/// join their relays on b. Then, while the reader reads at least 200 more lines, the reader's
/// tree's relayed bytes at home must not grow. Returns the shell, the writer's and the
/// reader's PIDs.
fn moved_pair(c: &Cluster, dir: &Path, script: &str) -> Result<(UnixServer, i32, i32), Failed> {
    let sh = UnixServer(
        common::bash(script, "direct")
            .arg(dir)
            .arg(STAGE)
            .arg(READER)
            .arg(WRITER)
            .stderr(std::fs::File::create(dir.join("sh.err")).unwrap())
            .spawn()
            .unwrap(),
    );
    let writer = pid_from(&dir.join("spid"), "the writer")?;
    let reader = pid_from(&dir.join("rpid"), "the reader")?;
    std::thread::sleep(Duration::from_millis(300));
    migrate(c, "a", writer, "b").map_err(|e| format!("the writer did not move: {e}"))?;
    std::thread::sleep(Duration::from_millis(300));
    migrate(c, "a", reader, "b").map_err(|e| format!("the reader did not move: {e}"))?;
    let deadline = Instant::now() + Duration::from_secs(20);
    while !c.log("a").contains("relay-joined") {
        if Instant::now() > deadline {
            return Err(format!(
                "home never joined the relays of the writer and the reader, both on b \
                 (the reader read {} lines)\n{}",
                progress(dir),
                c.log("a") + &c.log("b")
            )
            .into());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let before = relayed(c, reader).ok_or("top shows no relayed bytes for the reader")?;
    let n0 = progress(dir);
    let deadline = Instant::now() + Duration::from_secs(30);
    while progress(dir) < n0 + 200 {
        if Instant::now() > deadline {
            return Err(format!(
                "the reader stopped at line {} after the join\n{}",
                progress(dir),
                c.log("a") + &c.log("b")
            )
            .into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let after = relayed(c, reader).unwrap_or(u64::MAX);
    if after != before {
        return Err(format!(
            "home still relays the reader's pipe after the join: {before} bytes, then \
             {after} while it read lines {n0}..{}",
            progress(dir)
        )
        .into());
    }
    Ok((sh, writer, reader))
}

/// Waits for the shell and reads the pipeline's statuses (`PIPESTATUS`, in `DIR/status`).
fn statuses(c: &Cluster, sh: &mut UnixServer, dir: &Path) -> Result<String, Failed> {
    common::wait_child_or(&mut sh.0, Duration::from_secs(60), || {
        format!(
            "the pipeline did not end; the reader read {} lines\n{}",
            progress(dir),
            c.log("a") + &c.log("b") + &c.log("c")
        )
    })?;
    Ok(std::fs::read_to_string(dir.join("status"))
        .unwrap_or_default()
        .trim()
        .to_string())
}

/// `seq 1 6000 | stage | reader`, the stage then the reader moved to b while the lines flow:
/// home joins the stage's stdout relay and the reader's stdin relay on b, and the reader's
/// relayed bytes at home stop growing while it reads on. Every line arrives once, in order;
/// the stage's end gives the reader end of file; every stage succeeds.
pub(super) fn both_ends_of_a_pipe_on_one_node_talk_straight() -> Result<(), Failed> {
    let c = Cluster::up("direct", 2);
    let dir = scratch("migration", "direct");
    let script = "set -o pipefail; seq 1 6000 | python3 -c \"$2\" \"$1\" 0.003 \
        | python3 -c \"$3\" \"$1\"; echo ${PIPESTATUS[@]} > \"$1/status\"";
    let (mut sh, _, _) = moved_pair(&c, &dir, script)?;
    let st = statuses(&c, &mut sh, &dir)?;
    let err = std::fs::read_to_string(dir.join("sh.err")).unwrap_or_default();
    assert_eq!(st, "0 0 0", "a stage failed: {err}");
    assert_eq!(
        std::fs::read_to_string(dir.join("lines")).unwrap_or_default(),
        "6000",
        "the reader did not read every line once, in order: {err}"
    );
    Ok(())
}

/// A writer and its reader, both moved to b and joined there: when the reader ends, the
/// writer dies of SIGPIPE (the shell sees 141), as at home.
pub(super) fn a_joined_writer_gets_sigpipe_when_its_reader_ends() -> Result<(), Failed> {
    let c = Cluster::up("directpipe", 2);
    let dir = scratch("migration", "directpipe");
    let script = "python3 -c \"$4\" \"$1\" | python3 -c \"$3\" \"$1\"; \
        echo ${PIPESTATUS[@]} > \"$1/status\"";
    let (mut sh, _, _) = moved_pair(&c, &dir, script)?;
    std::fs::write(dir.join("stop"), "").unwrap();
    let st = statuses(&c, &mut sh, &dir)?;
    let err = std::fs::read_to_string(dir.join("sh.err")).unwrap_or_default();
    assert_eq!(
        st, "141 0",
        "the writer did not die of SIGPIPE when its reader ended: {err}"
    );
    Ok(())
}

/// As [`both_ends_of_a_pipe_on_one_node_talk_straight`] on three nodes; then the stage moves
/// on from b to c while the lines flow (its relay through home comes back, the reader's too),
/// and the reader follows it to c, where home joins the two again; then the reader comes home
/// (the stage's relay brings the lines home to it). Every line arrives once, in order, and
/// every stage succeeds.
pub(super) fn a_joined_end_moves_on_and_is_joined_again() -> Result<(), Failed> {
    let c = Cluster::up("directon", 3);
    let dir = scratch("migration", "directon");
    let script = "set -o pipefail; seq 1 8000 | python3 -c \"$2\" \"$1\" 0.003 \
        | python3 -c \"$3\" \"$1\"; echo ${PIPESTATUS[@]} > \"$1/status\"";
    let (mut sh, writer, reader) = moved_pair(&c, &dir, script)?;
    migrate(&c, "b", writer, "c").map_err(|e| {
        format!(
            "the joined stage did not move on to c: {e}\n{}",
            c.log("a") + &c.log("b")
        )
    })?;
    let n0 = progress(&dir);
    let deadline = Instant::now() + Duration::from_secs(30);
    while progress(&dir) < n0 + 100 {
        if Instant::now() > deadline {
            return Err(format!(
                "the reader stopped at line {} once the stage moved on\n{}",
                progress(&dir),
                c.log("a") + &c.log("b") + &c.log("c")
            )
            .into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    migrate(&c, "b", reader, "c").map_err(|e| {
        format!(
            "the reader did not move on to c: {e}\n{}",
            c.log("a") + &c.log("b")
        )
    })?;
    let deadline = Instant::now() + Duration::from_secs(20);
    while c.log("a").matches("event=\"relay-joined\"").count() < 2 {
        if Instant::now() > deadline {
            return Err(format!(
                "home did not join the two relays again on c\n{}",
                c.log("a")
            )
            .into());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    // Then the reader comes home: the stage's relay brings its lines home to it again.
    migrate(&c, "c", reader, "a").map_err(|e| {
        format!(
            "the reader did not come home from c: {e}\n{}",
            c.log("a") + &c.log("c")
        )
    })?;
    let st = statuses(&c, &mut sh, &dir)?;
    let err = std::fs::read_to_string(dir.join("sh.err")).unwrap_or_default();
    assert_eq!(st, "0 0 0", "a stage failed after the moves on: {err}");
    assert_eq!(
        std::fs::read_to_string(dir.join("lines")).unwrap_or_default(),
        "8000",
        "the reader did not read every line once, in order: {err}"
    );
    Ok(())
}

/// A writer and its reader joined on b stream 48 MiB (in 64 KiB writes, the reader reading
/// 4 KiB at a time: both stand-ins fill and empty many times over): the reader gets the same
/// bytes (SHA-256) and their end, and none of them crosses home.
pub(super) fn a_joined_pair_streams_in_bulk_whole() -> Result<(), Failed> {
    let c = Cluster::up("directbulk", 2);
    let dir = scratch("migration", "directbulk");
    let writer = "import sys,os,time,random,hashlib\n\
        d=sys.argv[1]\n\
        open(d+'/spid.tmp','w').write(str(os.getpid()))\n\
        os.rename(d+'/spid.tmp', d+'/spid')\n\
        while not os.path.exists(d+'/go'):\n\
        \x20   time.sleep(0.05)\n\
        h=hashlib.sha256()\n\
        r=random.Random(5)\n\
        for i in range(768):\n\
        \x20   b=r.randbytes(65536)\n\
        \x20   h.update(b)\n\
        \x20   sys.stdout.buffer.write(b)\n\
        \x20   sys.stdout.buffer.flush()\n\
        open(d+'/sent','w').write(h.hexdigest())\n";
    let reader = "import sys,os,hashlib\n\
        d=sys.argv[1]\n\
        open(d+'/rpid.tmp','w').write(str(os.getpid()))\n\
        os.rename(d+'/rpid.tmp', d+'/rpid')\n\
        h=hashlib.sha256()\n\
        n=0\n\
        while True:\n\
        \x20   b=os.read(0, 4096)\n\
        \x20   if not b:\n\
        \x20       break\n\
        \x20   n+=len(b)\n\
        \x20   h.update(b)\n\
        open(d+'/got','w').write('%s %d' % (h.hexdigest(), n))\n";
    let script = "python3 -c \"$2\" \"$1\" | python3 -c \"$3\" \"$1\"; \
        echo ${PIPESTATUS[@]} > \"$1/status\"";
    let mut sh = UnixServer(
        common::bash(script, "directbulk")
            .arg(&dir)
            .arg(writer)
            .arg(reader)
            .stderr(std::fs::File::create(dir.join("sh.err")).unwrap())
            .spawn()
            .unwrap(),
    );
    let w = pid_from(&dir.join("spid"), "the writer")?;
    let r = pid_from(&dir.join("rpid"), "the reader")?;
    migrate(&c, "a", w, "b").map_err(|e| format!("the writer did not move: {e}"))?;
    migrate(&c, "a", r, "b").map_err(|e| format!("the reader did not move: {e}"))?;
    let deadline = Instant::now() + Duration::from_secs(20);
    while !c.log("a").contains("relay-joined") {
        if Instant::now() > deadline {
            return Err(format!("home never joined the two relays\n{}", c.log("a")).into());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let before = relayed(&c, r).ok_or("top shows no relayed bytes for the reader")?;
    std::fs::write(dir.join("go"), "").unwrap();
    let st = statuses(&c, &mut sh, &dir)?;
    let err = std::fs::read_to_string(dir.join("sh.err")).unwrap_or_default();
    assert_eq!(st, "0 0", "the writer or the reader failed: {err}");
    let sent = std::fs::read_to_string(dir.join("sent")).unwrap_or_default();
    assert_eq!(
        std::fs::read_to_string(dir.join("got")).unwrap_or_default(),
        format!("{sent} {}", 768 * 65536),
        "the reader did not get the writer's bytes: {err}"
    );
    assert!(
        relayed(&c, r).is_none_or(|after| after == before),
        "the bulk stream crossed home"
    );
    Ok(())
}
