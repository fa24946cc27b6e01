//! The commit protocol of a migration and a daemon's durable records, under injected faults
//! (fail points `FAILPOINTS=NODE:POINT=return`, see `Node::fault`): a daemon dies at a step, or the migration's
//! link is cut there, and is restarted or not. After the dust settles exactly one copy of the
//! ticking victim runs (the processes running its command line are counted, and its status
//! file must keep counting), and a copy away from home is listed by `ferry ps` with its home
//! node and home PID.

mod common;

use common::cluster::{Cluster, Isolation, FERRY};
use common::scratch;
use libtest_mimic::{Arguments, Failed, Trial};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn main() {
    let args = Arguments::from_args();
    let tests = vec![
        Trial::test(
            "destination_daemon_dies_after_rebuilt_and_restarts",
            destination_dies_after_rebuilt,
        ),
        Trial::test(
            "source_daemon_dies_after_recording_the_outcome_and_restarts",
            source_dies_after_outcome,
        ),
        Trial::test(
            "source_daemon_dies_undecided_is_declared_dead_and_restarts",
            source_dies_undecided,
        ),
        Trial::test(
            "source_daemon_dies_after_the_kill_and_stays_dead",
            source_dies_after_kill,
        ),
        Trial::test("link_cut_after_rebuilt", link_cut_after_rebuilt),
        Trial::test(
            "link_cut_by_dropping_packets_after_the_kill",
            packets_dropped_after_kill,
        ),
        Trial::test(
            "capture_worker_killed_after_the_outcome",
            worker_killed_after_outcome,
        ),
        Trial::test("cli_killed_at_any_step", cli_killed),
        Trial::test(
            "guests_survive_a_daemon_restart_and_move_on",
            guests_survive_restart,
        ),
        Trial::test(
            "a_body_node_declared_down_while_alive_keeps_its_deputy",
            false_down_verdict,
        ),
        Trial::test(
            "a_home_daemon_killed_and_restarted_keeps_its_deputies",
            home_restart_keeps_deputies,
        ),
        Trial::test(
            "a_checkpointed_guest_whose_node_is_killed_is_rebuilt_at_home",
            recovered_after_node_death,
        ),
        Trial::test(
            "a_checkpointed_guest_whose_node_is_killed_is_rebuilt_on_the_next_node_that_takes_it",
            recovered_elsewhere_after_node_death,
        ),
        Trial::test(
            "a_node_taken_for_dead_that_comes_back_runs_no_old_body",
            taken_for_dead_comes_back,
        ),
        Trial::test(
            "a_tree_is_not_sent_back_beside_its_old_body",
            not_sent_back_beside_old_body,
        ),
        Trial::test(
            "a_ferry_run_program_is_checkpointed_at_its_own_interval_and_recovered",
            run_program_checkpointed,
        ),
        Trial::test(
            "a_pipeline_stage_keeps_its_relays_through_a_home_daemon_restart",
            relays_survive_home_restart,
        ),
        Trial::test(
            "a_pipeline_stage_whose_node_dies_is_rebuilt_with_its_relays",
            relayed_pipeline_recovered_after_node_death,
        ),
        Trial::test(
            "a_pipeline_stage_whose_node_dies_is_rebuilt_elsewhere_with_its_relays",
            relayed_pipeline_recovered_elsewhere,
        ),
    ];
    libtest_mimic::run(&args, tests).exit();
}

fn ticker_binary() -> PathBuf {
    common::victim("ticker", &["-O2"])
}

/// The ticking victim: its status line counts on as long as one copy of it runs.
struct Ticker {
    child: Child,
    status: PathBuf,
}

impl Ticker {
    fn start(dir: &Path) -> Ticker {
        let status = dir.join("ticker.status");
        let child = Command::new(ticker_binary())
            .arg("8")
            .arg(&status)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let t = Ticker { child, status };
        let deadline = Instant::now() + Duration::from_secs(10);
        while t.count().is_none_or(|c| c < 2) {
            assert!(Instant::now() < deadline, "ticker did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        t
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    fn count(&self) -> Option<u64> {
        let text = std::fs::read_to_string(&self.status).ok()?;
        text.split_whitespace()
            .find_map(|w| w.strip_prefix("count="))?
            .parse()
            .ok()
    }

    fn ticking(&self) -> bool {
        let Some(before) = self.count() else {
            return false;
        };
        std::thread::sleep(Duration::from_millis(200));
        self.count().is_some_and(|now| now > before)
    }

    /// The processes running this ticker (its command line names the status file), with
    /// their states: zombies are left out.
    fn copies(&self) -> Vec<(i32, char)> {
        copies_naming(&self.status)
    }

    fn kill_copies(&self) {
        for (p, _) in self.copies() {
            let _ = Command::new("kill").args(["-9", &p.to_string()]).status();
        }
    }
}

/// The processes whose command line has `arg` as an argument, with their states: zombies and
/// deputies are left out.
fn copies_naming(arg: &Path) -> Vec<(i32, char)> {
    let want = arg.display().to_string();
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        if !cmd.split(|b| *b == 0).any(|a| a == want.as_bytes()) {
            continue;
        }
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let state = stat
            .rsplit(')')
            .next()
            .and_then(|s| s.trim_start().chars().next())
            .unwrap_or('?');
        if state != 'Z' && state != 'X' && state != '?' && !is_deputy(pid) {
            out.push((pid, state));
        }
    }
    out
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.kill_copies();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn text(o: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn migrate(c: &Cluster, on: &str, pid: i32, to: &str) -> Result<String, String> {
    let o = c.run(on, &["migrate", &pid.to_string(), "--to", to, "--json"]);
    if o.status.success() {
        Ok(text(&o))
    } else {
        Err(text(&o))
    }
}

fn ps(c: &Cluster, on: &str) -> Vec<serde_json::Value> {
    let o = c.run(on, &["ps", "--json"]);
    if !o.status.success() {
        return Vec::new();
    }
    serde_json::from_slice::<Vec<serde_json::Value>>(&o.stdout).unwrap_or_default()
}

/// Two nodes sharing this machine's namespaces: a daemon restarted from here is where it was.
/// A node declared down, and silent, is taken for dead after 2 s (`--dead-after`; these tests
/// kill daemons or cut links outright).
fn shared(tag: &str, env: &[(&str, &str)]) -> Cluster {
    Cluster::up_full(tag, 2, env, Isolation::Shared, &["--dead-after", "2"])
}

/// Starts node `node`'s daemon again (without the fault), as its supervisor would.
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
    // Ready once it answers its CLI.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !c.run(node, &["ps", "--json"]).status.success() {
        assert!(Instant::now() < deadline, "node {node} did not come back");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn wait_daemon_gone(c: &Cluster, node: &str) {
    let pid = c.daemon_pid(node);
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

/// Waits until exactly one copy of the ticker runs and ticks, none is held stopped, and, if it
/// is not the original, `ferry ps` on `ask` lists it on `away` with home `home` and the
/// original's PID. Fails after `within` with what it saw.
fn exactly_one(
    c: &Cluster,
    t: &Ticker,
    ask: &str,
    home: &str,
    away: &str,
    within: Duration,
) -> Result<i32, Failed> {
    let deadline = Instant::now() + within;
    let mut seen = String::new();
    loop {
        let copies = t.copies();
        let running: Vec<i32> = copies
            .iter()
            .filter(|(_, s)| !matches!(s, 't' | 'T'))
            .map(|(p, _)| *p)
            .collect();
        if running.len() == 1 && copies.len() == 1 && t.ticking() {
            let p = running[0];
            if p == t.pid() {
                return Ok(p);
            }
            let listed = ps(c, ask).into_iter().find(|g| {
                g["home_pid"].as_i64() == Some(t.pid() as i64)
                    && g["pid"].as_i64().and_then(|q| c.host_pid(away, q as i32)) == Some(p)
            });
            match listed {
                Some(g) if g["home_node"] == home && g["node"] == away => {
                    // And still exactly one a moment later.
                    std::thread::sleep(Duration::from_secs(1));
                    if t.copies().len() == 1 && t.ticking() {
                        return Ok(p);
                    }
                }
                other => seen = format!("copy {p} listed as {other:?}"),
            }
        } else {
            seen = format!("copies {copies:?}, ticking {}", t.ticking());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "not exactly one listed copy after {within:?}: {seen}\n{}",
                common::cluster::daemon_logs(&c.dir, &["a", "b"])
            )
            .into());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// b dies right after sending `Rebuilt`: a commits; b's worker lets the copy run; the restarted
/// b finds the copy it held, asks a, and lists it.
fn destination_dies_after_rebuilt() -> Result<(), Failed> {
    let c = shared(
        "cp-rebuilt",
        &[("FAILPOINTS", "b:exit-after-rebuilt=return")],
    );
    let dir = scratch("commit_protocol", "rebuilt");
    let t = Ticker::start(&dir);
    let r = migrate(&c, "a", t.pid(), "b");
    // The migration is committed: the CLI says so, even without b's confirmation.
    r.map_err(|e| format!("migrate failed though it committed: {e}"))?;
    wait_daemon_gone(&c, "b");
    restart(&c, "b");
    let p = exactly_one(&c, &t, "a", "a", "b", Duration::from_secs(30))?;
    assert_ne!(p, t.pid(), "the original survived its commit");
    Ok(())
}

/// a dies after recording `committed`, before telling its worker to kill: the worker thaws the
/// original. Restarted, a kills it (the outcome stands), and b runs the copy.
fn source_dies_after_outcome() -> Result<(), Failed> {
    let c = shared(
        "cp-outcome",
        &[("FAILPOINTS", "a:exit-after-outcome=return")],
    );
    let dir = scratch("commit_protocol", "outcome");
    let t = Ticker::start(&dir);
    let _ = migrate(&c, "a", t.pid(), "b").expect_err("the source daemon dies");
    wait_daemon_gone(&c, "a");
    restart(&c, "a");
    let p = exactly_one(&c, &t, "b", "a", "b", Duration::from_secs(40))?;
    assert_ne!(p, t.pid(), "the original survived a committed outcome");
    Ok(())
}

/// a dies on `Rebuilt` before deciding: its worker thaws the original; b, unable to ask,
/// runs its copy once a is declared dead: two copies, for now. Restarted, a finds the migration
/// undecided, asks b, hears that b ran the copy, decides "committed" and kills the original.
fn source_dies_undecided() -> Result<(), Failed> {
    let c = shared(
        "cp-undecided",
        &[("FAILPOINTS", "a:exit-before-outcome=return")],
    );
    let dir = scratch("commit_protocol", "undecided");
    let t = Ticker::start(&dir);
    let _ = migrate(&c, "a", t.pid(), "b").expect_err("the source daemon dies");
    wait_daemon_gone(&c, "a");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !c.log("b").contains("source-declared-dead") {
        if Instant::now() > deadline {
            return Err(format!(
                "b never took a for dead\n{}",
                common::cluster::daemon_logs(&c.dir, &["a", "b"])
            )
            .into());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    restart(&c, "a");
    let p = exactly_one(&c, &t, "a", "a", "b", Duration::from_secs(30))?;
    assert_ne!(p, t.pid(), "the original runs beside the copy b ran");
    Ok(())
}

/// a dies after killing the original and is never restarted: b cannot ask, waits, and runs
/// its copy once the membership declares a dead (it must not kill the only copy).
fn source_dies_after_kill() -> Result<(), Failed> {
    let c = shared("cp-kill", &[("FAILPOINTS", "a:exit-after-kill=return")]);
    let dir = scratch("commit_protocol", "kill");
    let t = Ticker::start(&dir);
    let _ = migrate(&c, "a", t.pid(), "b").expect_err("the source daemon dies");
    wait_daemon_gone(&c, "a");
    let p = exactly_one(&c, &t, "b", "a", "b", Duration::from_secs(40))?;
    assert_ne!(p, t.pid(), "the original survived its kill");
    Ok(())
}

/// The migration's connection is cut right after b sends `Rebuilt` (simulated: b shuts the
/// connection and reads nothing more from it; gossip goes on). b asks a on a new connection;
/// whichever way a decided, exactly one copy runs, and a copy on b is listed.
fn link_cut_after_rebuilt() -> Result<(), Failed> {
    let c = shared(
        "cp-cut",
        &[("FAILPOINTS", "b:cut-link-after-rebuilt=return")],
    );
    let dir = scratch("commit_protocol", "cut");
    let t = Ticker::start(&dir);
    let _ = migrate(&c, "a", t.pid(), "b");
    exactly_one(&c, &t, "a", "a", "b", Duration::from_secs(40))?;
    Ok(())
}

/// Separate nodes; a kills the original, then the link between a and b drops every packet
/// (b's end of it on the bridge is set down) before `Commit` leaves. b waits for `Commit`
/// (30 s), cannot ask a, and runs its copy once the membership declares a down: it must not
/// kill the only copy.
fn packets_dropped_after_kill() -> Result<(), Failed> {
    let c = Cluster::up_as(
        "cp-drop",
        2,
        &[("FAILPOINTS", "a:pause-after-kill=return")],
        Isolation::Separate,
    );
    let slot = c.net_slot().ok_or("no network for separate nodes")?;
    let veth = format!("ferry{slot}-b");
    let dir = scratch("commit_protocol", "drop");
    let t = Ticker::start(&dir);
    let mut cli = c
        .ferry("a")
        .args(["migrate", &t.pid().to_string(), "--to", "b"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !c.log("a").contains("pause-after-kill") {
        if Instant::now() > deadline {
            let _ = cli.kill();
            let _ = cli.wait();
            return Err("the migration never reached the kill".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let link = |state: &str| {
        let st = Command::new("ip")
            .args(["link", "set", &veth, state])
            .status()
            .unwrap();
        assert!(st.success(), "ip link set {veth} {state}");
    };
    link("down");
    let r = exactly_one(&c, &t, "b", "a", "b", Duration::from_secs(60));
    link("up");
    let _ = cli.wait();
    let p = r?;
    assert_ne!(p, t.pid(), "the original survived its kill");
    Ok(())
}

/// The capture worker is killed outright after a recorded "committed" and before the kill:
/// its death lets the original go, and the daemon kills it itself (the outcome stands).
fn worker_killed_after_outcome() -> Result<(), Failed> {
    let c = shared(
        "cp-worker",
        &[("FAILPOINTS", "a:pause-after-outcome=return")],
    );
    let dir = scratch("commit_protocol", "worker");
    let t = Ticker::start(&dir);
    let mut cli = c
        .ferry("a")
        .args(["migrate", &t.pid().to_string(), "--to", "b"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !c.log("a").contains("pause-after-outcome") {
        if Instant::now() > deadline {
            let _ = cli.kill();
            let _ = cli.wait();
            return Err("the migration never reached its outcome".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let workers = Command::new("pgrep")
        .args(["-f", &format!("__capture-worker {}", t.pid())])
        .output()
        .unwrap();
    let workers = String::from_utf8_lossy(&workers.stdout).to_string();
    assert!(!workers.trim().is_empty(), "no capture worker found");
    for w in workers.split_whitespace() {
        let _ = Command::new("kill").args(["-9", w]).status();
    }
    let _ = cli.wait();
    let p = exactly_one(&c, &t, "a", "a", "b", Duration::from_secs(30))?;
    assert_ne!(p, t.pid(), "the original survived a committed outcome");
    Ok(())
}

/// `ferry migrate` killed at several moments of a migration: the daemons carry on without it,
/// and exactly one copy runs, listed if it moved.
fn cli_killed() -> Result<(), Failed> {
    let c = shared("cp-cli", &[]);
    for (i, after_ms) in [0u64, 60, 150, 300, 600].into_iter().enumerate() {
        let dir = scratch("commit_protocol", &format!("cli-{i}"));
        let t = Ticker::start(&dir);
        let mut cli = c
            .ferry("a")
            .args(["migrate", &t.pid().to_string(), "--to", "b"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(after_ms));
        let _ = cli.kill();
        let _ = cli.wait();
        std::thread::sleep(Duration::from_secs(1));
        exactly_one(&c, &t, "a", "a", "b", Duration::from_secs(30)).map_err(|e| {
            format!(
                "CLI killed after {after_ms} ms: {}",
                e.message().unwrap_or_default()
            )
        })?;
    }
    Ok(())
}

/// b is killed outright while hosting a guest, and restarted: the guest is listed again, and
/// moves on.
fn guests_survive_restart() -> Result<(), Failed> {
    let c = shared("cp-restart", &[]);
    let dir = scratch("commit_protocol", "restart");
    let t = Ticker::start(&dir);
    migrate(&c, "a", t.pid(), "b").map_err(|e| format!("a -> b: {e}"))?;
    exactly_one(&c, &t, "a", "a", "b", Duration::from_secs(10))?;
    let _ = Command::new("kill")
        .args(["-9", &c.daemon_pid("b").to_string()])
        .status();
    wait_daemon_gone(&c, "b");
    restart(&c, "b");
    let p = exactly_one(&c, &t, "b", "a", "b", Duration::from_secs(20))?;
    migrate(&c, "b", t.pid(), "a").map_err(|e| format!("b -> a after b's restart: {e}"))?;
    let q = exactly_one(&c, &t, "a", "a", "a", Duration::from_secs(20))?;
    assert_ne!(p, q, "the guest did not move on");
    Ok(())
}

/// b's daemon stops for a few seconds (SIGSTOP: a daemon starved of CPU, as under load) while a
/// process moved a -> b runs there: a's membership declares b down, then b is back. The verdict
/// was false: the body ran all along. Its deputy at a must still be there (it used to end at
/// once, as if SIGKILLed: its parent saw it die while it ran on, out of its home's reach), a
/// signal to its home PID must still reach it, and its parent's wait must get its end.
fn false_down_verdict() -> Result<(), Failed> {
    // The default `dead_after` (6 s).
    let c = Cluster::up_as("cp-false-down", 2, &[], Isolation::Shared);
    let dir = scratch("commit_protocol", "false-down");
    let mut t = Ticker::start(&dir);
    migrate(&c, "a", t.pid(), "b").map_err(|e| format!("a -> b: {e}"))?;
    exactly_one(&c, &t, "a", "a", "b", Duration::from_secs(20))?;
    let b = c.daemon_pid("b");
    let downs = |c: &Cluster| c.log("a").matches("event=\"member-down\" node=b").count();
    let ups = |c: &Cluster| c.log("a").matches("event=\"member-up\" node=b").count();
    let (down0, up0) = (downs(&c), ups(&c));
    let _ = Command::new("kill")
        .args(["-STOP", &b.to_string()])
        .status();
    let deadline = Instant::now() + Duration::from_secs(20);
    while downs(&c) == down0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    // Down for a few seconds (the deputies look once a second), well within `dead_after`.
    std::thread::sleep(Duration::from_millis(2500));
    let _ = Command::new("kill")
        .args(["-CONT", &b.to_string()])
        .status();
    if downs(&c) == down0 {
        return Err("a never declared the stopped b down: nothing was tested".into());
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while ups(&c) == up0 {
        if Instant::now() > deadline {
            return Err(format!("b never came back up at a\n{}", c.log("a")).into());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    // Past the verdict, and past the time a dead node's deputies are given up.
    std::thread::sleep(Duration::from_secs(7));
    let logs = || common::cluster::daemon_logs(&c.dir, &["a", "b"]);
    if let Ok(Some(st)) = t.child.try_wait() {
        return Err(format!(
            "the deputy of PID {} ended ({st}) on a false verdict while its body ran on b\n{}",
            t.pid(),
            logs()
        )
        .into());
    }
    if !t.ticking() {
        return Err(format!("the body stopped ticking\n{}", logs()).into());
    }
    // Its home still reaches it, and its parent (this test) sees how it ended.
    let _ = Command::new("kill")
        .args(["-TERM", &t.pid().to_string()])
        .status();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        match t.child.try_wait() {
            Ok(Some(st)) => {
                use std::os::unix::process::ExitStatusExt;
                if st.signal() != Some(libc::SIGTERM) {
                    return Err(format!("the parent saw {st}, not SIGTERM\n{}", logs()).into());
                }
                break;
            }
            _ if Instant::now() > deadline => {
                return Err(format!("SIGTERM to the home PID did not end it\n{}", logs()).into())
            }
            _ => std::thread::sleep(Duration::from_millis(100)),
        }
    }
    if !t.copies().is_empty() {
        return Err(format!("copies left after SIGTERM: {:?}", t.copies()).into());
    }
    Ok(())
}

/// The home's daemon is killed outright (SIGKILL) while a process it sent away runs on b, and
/// restarted: the deputy never ends (it used to die with the daemon, its parent seeing
/// SIGKILL), `ferry ps` on the restarted a lists the body with its home PID, a signal sent to
/// the home PID meanwhile reaches the body, and the parent's wait gets its end.
fn home_restart_keeps_deputies() -> Result<(), Failed> {
    let c = shared("cp-home-restart", &[]);
    let dir = scratch("commit_protocol", "home-restart");
    let mut t = Ticker::start(&dir);
    migrate(&c, "a", t.pid(), "b").map_err(|e| format!("a -> b: {e}"))?;
    exactly_one(&c, &t, "a", "a", "b", Duration::from_secs(20))?;
    let _ = Command::new("kill")
        .args(["-9", &c.daemon_pid("a").to_string()])
        .status();
    wait_daemon_gone(&c, "a");
    let logs = || common::cluster::daemon_logs(&c.dir, &["a", "b"]);
    std::thread::sleep(Duration::from_secs(1));
    if let Ok(Some(st)) = t.child.try_wait() {
        return Err(format!("the deputy ended ({st}) with its home's daemon\n{}", logs()).into());
    }
    restart(&c, "a");
    exactly_one(&c, &t, "a", "a", "b", Duration::from_secs(20))?;
    if let Ok(Some(st)) = t.child.try_wait() {
        return Err(format!("the deputy ended ({st}) after the restart\n{}", logs()).into());
    }
    // Sent as soon as the restarted daemon answers: held by the deputy until its worker is
    // taken up again, then forwarded.
    let _ = Command::new("kill")
        .args(["-TERM", &t.pid().to_string()])
        .status();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match t.child.try_wait() {
            Ok(Some(st)) => {
                use std::os::unix::process::ExitStatusExt;
                if st.signal() != Some(libc::SIGTERM) {
                    return Err(format!("the parent saw {st}, not SIGTERM\n{}", logs()).into());
                }
                break;
            }
            _ if Instant::now() > deadline => {
                return Err(format!(
                    "SIGTERM to the home PID after a's restart did not end it\n{}",
                    logs()
                )
                .into())
            }
            _ => std::thread::sleep(Duration::from_millis(100)),
        }
    }
    if !t.copies().is_empty() {
        return Err(format!("copies left after SIGTERM: {:?}", t.copies()).into());
    }
    Ok(())
}

/// Node b, running a process moved there from a, is killed outright (its init: its daemon and
/// every process on it die) after a has checkpointed the process (`--checkpoint-every 2`:
/// every second, on a loaded machine, the captures froze the counter for seconds). Once b is
/// dead, a rebuilds the process from its last image, at home: it counts on (from the
/// image's count), `ferry ps` lists it at a with its home PID (kind "recovered"), a's log says
/// so, and its deputy stands for it still: SIGTERM to the home PID ends it, and its parent
/// sees that. Before, the deputy ended as if SIGKILLed and the process was gone.
fn recovered_after_node_death() -> Result<(), Failed> {
    recovered_on("cp-recover", 2, "a")
}

/// As above with two more nodes, c and d, and `recover_on` "idlest" (the default): c is set
/// `accept no` while its gossip still says it is idle and open (fail point
/// `c:advertise-accepting`, gossip lagging behind its policy), so a offers c the tree first and
/// c refuses it; a passes c over and rebuilds the process on d, not at home. It counts on,
/// `ferry ps` on d lists it as a's, recovered after b died with c passed over (and why), a's
/// log says it went to d and why c was passed over, and its deputy at a follows it there:
/// SIGTERM to the home PID ends it, and its parent sees that. Before, a node that refused the recovery sent it home, and nothing said why.
fn recovered_elsewhere_after_node_death() -> Result<(), Failed> {
    recovered_on("cp-recover-d", 4, "d")
}

/// b, running a process moved there from a (of `n` nodes), is killed outright after a has
/// checkpointed the process; it is rebuilt on `expect_on`. With 4 nodes, c refuses guests
/// while its gossip says it takes them (see above), and must be passed over.
fn recovered_on(tag: &str, n: usize, expect_on: &str) -> Result<(), Failed> {
    let env: &[(&str, &str)] = if n == 4 {
        &[("FAILPOINTS", "c:advertise-accepting=return")]
    } else {
        &[]
    };
    let c = Cluster::up_full(
        tag,
        n,
        env,
        Isolation::Separate,
        &["--dead-after", "2", "--checkpoint-every", "2"],
    );
    if n == 4 {
        let o = c.run("c", &["accept", "no"]);
        if !o.status.success() {
            return Err(format!("accept no on c: {}", text(&o)).into());
        }
    }
    let dir = scratch("commit_protocol", tag);
    let count = dir.join("count");
    let mut child = counter(&count);
    let pid = child.id() as i32;
    let counting = || counts(&count);
    let logs = || common::cluster::daemon_logs(&c.dir, &["a", "b", "c", "d"][..n]);
    let r = (|| -> Result<(), Failed> {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !counting() {
            if Instant::now() > deadline {
                return Err("the counter did not start".into());
            }
        }
        migrate(&c, "a", pid, "b").map_err(|e| format!("a -> b: {e}"))?;
        first_checkpoint(&c, 30, &logs)?;
        if !counting() {
            return Err(format!("the body stopped counting on b\n{}", logs()).into());
        }
        let init = c.init_pid("b").ok_or("node b has no init")?;
        let _ = Command::new("kill")
            .args(["-9", &init.to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(40);
        while !c.log("a").contains("event=\"guest-recovered\"") {
            if let Ok(Some(st)) = child.try_wait() {
                return Err(format!("the deputy ended ({st}) with b\n{}", logs()).into());
            }
            if Instant::now() > deadline {
                return Err(format!("a did not rebuild it\n{}", logs()).into());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        if !counting() {
            return Err(format!("the rebuilt process does not count\n{}", logs()).into());
        }
        let said = format!("node={expect_on}");
        if !c.log("a").lines().any(|l| {
            l.contains("event=\"guest-recovered\"") && l.split_whitespace().any(|w| w == said)
        }) {
            return Err(format!("a's log does not say it went to {expect_on}\n{}", logs()).into());
        }
        if n == 4
            && !c.log("a").lines().any(|l| {
                l.contains("event=\"recovery-skipped\"")
                    && l.split_whitespace().any(|w| w == "node=c")
                    && l.contains("accept")
            })
        {
            return Err(format!("a's log does not say why c was passed over\n{}", logs()).into());
        }
        let listed = ps(&c, expect_on).into_iter().find(|g| {
            g["home_pid"].as_i64() == Some(pid as i64)
                && g["node"] == expect_on
                && g["home_node"] == "a"
        });
        let kind = if expect_on == "a" {
            "recovered"
        } else {
            "migrated"
        };
        // It says where it comes from, and which node was passed over for it.
        let said = |g: &serde_json::Value| {
            g["recovered"].as_str().is_some_and(|r| {
                r.starts_with("after node b died") && (n != 4 || r.contains("passed over: c: "))
            })
        };
        match listed {
            Some(g) if g["kind"] == kind && said(&g) => {}
            other => return Err(format!("ferry ps on {expect_on} lists {other:?}").into()),
        }
        let _ = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match child.try_wait() {
                Ok(Some(st)) => {
                    use std::os::unix::process::ExitStatusExt;
                    if st.signal() != Some(libc::SIGTERM) {
                        return Err(format!("the parent saw {st}, not SIGTERM\n{}", logs()).into());
                    }
                    break;
                }
                _ if Instant::now() > deadline => {
                    return Err(
                        format!("SIGTERM to the home PID did not end it\n{}", logs()).into(),
                    )
                }
                _ => std::thread::sleep(Duration::from_millis(100)),
            }
        }
        if counting() {
            return Err(format!("still counting after SIGTERM\n{}", logs()).into());
        }
        Ok(())
    })();
    let _ = child.kill();
    let _ = child.wait();
    r
}

/// b, running a shell moved there from a, has its daemon frozen (SIGSTOP) after a has
/// checkpointed it: the body on b runs on, but b answers nobody, and a takes it for dead
/// (declared down, no TLS handshake) and rebuilds the shell on c, the idlest other node. Once
/// on b, the shell forked a counter (a subshell writing 1, 2, 3... and starting a `sleep` child
/// every 100 ms): a process with no PID at home. When b's daemon runs again, nothing of the old
/// body may run on beside the rebuilt one: no process is left in its PID namespace on b (the
/// old counter included), the processes left running the shell are the rebuilt ones, all in one
/// namespace, the counter counts, `ferry ps` on c lists it as a's, and a's log says it had the
/// old body killed. Before, only the PIDs the tree had at home were killed, and the old counter
/// counted on beside the rebuilt one.
fn taken_for_dead_comes_back() -> Result<(), Failed> {
    let c = Cluster::up_full(
        "cp-fence",
        3,
        &[],
        Isolation::Shared,
        &["--dead-after", "2", "--checkpoint-every", "1"],
    );
    let dir = scratch("commit_protocol", "fence");
    let count = dir.join("count");
    let go = dir.join("go");
    // Waits for GO, then forks the counter and waits for it.
    let script = "while [ ! -e \"$2\" ]; do sleep 0.2; done\n\
                  (i=0; while :; do i=$((i+1)); echo $i > \"$1\"; sleep 0.1; done) &\n\
                  wait\n";
    let mut child = Command::new("sh")
        .args(["-c", script, "sh"])
        .arg(&count)
        .arg(&go)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id() as i32;
    let logs = || common::cluster::daemon_logs(&c.dir, &["a", "b", "c"]);
    let b = c.daemon_pid("b").to_string();
    let r = (|| -> Result<(), Failed> {
        migrate(&c, "a", pid, "b").map_err(|e| format!("a -> b: {e}"))?;
        std::fs::write(&go, "").unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while !counts(&count) {
            if Instant::now() > deadline {
                return Err(format!("the counter did not start on b\n{}", logs()).into());
            }
        }
        first_checkpoint(&c, 30, &logs)?;
        // The old body's PID namespace on b, its counter in it.
        let old: Vec<String> = copies_naming(&count)
            .iter()
            .filter_map(|(p, _)| pid_ns(*p))
            .collect();
        let Some(old_ns) = old.first().cloned() else {
            return Err(format!("nothing runs the shell on b\n{}", logs()).into());
        };
        if old.len() < 2 || old.iter().any(|n| *n != old_ns) {
            return Err(format!("the body on b: namespaces {old:?}\n{}", logs()).into());
        }
        let _ = Command::new("kill").args(["-STOP", &b]).status();
        let recovered = (|| -> Result<(), Failed> {
            let deadline = Instant::now() + Duration::from_secs(40);
            while !c.log("a").contains("event=\"guest-recovered\"") {
                if Instant::now() > deadline {
                    return Err(format!("a did not rebuild it\n{}", logs()).into());
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            Ok(())
        })();
        let _ = Command::new("kill").args(["-CONT", &b]).status();
        recovered?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let left = in_namespace(&old_ns);
            let copies = copies_naming(&count);
            let spaces: Vec<String> = copies.iter().filter_map(|(p, _)| pid_ns(*p)).collect();
            let one = !spaces.is_empty()
                && spaces.iter().all(|n| *n == spaces[0] && *n != old_ns)
                && c.log("a").contains("event=\"stale-body-fenced\"");
            if left.is_empty() && one {
                std::thread::sleep(Duration::from_secs(1));
                if in_namespace(&old_ns).is_empty() && counts(&count) {
                    break;
                }
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "after b came back: left in the old body's namespace {left:?}, \
                     copies {copies:?} in {spaces:?}\n{}",
                    logs()
                )
                .into());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        let listed = ps(&c, "c").into_iter().any(|g| {
            g["home_pid"].as_i64() == Some(pid as i64) && g["node"] == "c" && g["home_node"] == "a"
        });
        if !listed {
            return Err(format!("ferry ps on c does not list it\n{}", logs()).into());
        }
        Ok(())
    })();
    let _ = Command::new("kill").args(["-CONT", &b]).status();
    for (p, _) in copies_naming(&count) {
        let _ = Command::new("kill").args(["-9", &p.to_string()]).status();
    }
    let _ = child.kill();
    let _ = child.wait();
    r
}

/// The PID namespace ("pid:[inode]") of process `pid`.
fn pid_ns(pid: i32) -> Option<String> {
    std::fs::read_link(format!("/proc/{pid}/ns/pid"))
        .ok()
        .map(|p| p.to_string_lossy().into_owned())
}

/// The live processes (not zombies) in PID namespace `ns`.
fn in_namespace(ns: &str) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&p| pid_ns(p).as_deref() == Some(ns))
        .filter(|&p| {
            std::fs::read_to_string(format!("/proc/{p}/stat")).is_ok_and(|s| {
                s.rsplit(')')
                    .next()
                    .and_then(|r| r.trim_start().chars().next())
                    .is_some_and(|c| c != 'Z' && c != 'X')
            })
        })
        .collect()
}

/// As above with a third node, and a's kill of the old body held back (fail point
/// `a:hold-fence`): the process is rebuilt on c while b's daemon is stopped; b runs again, its
/// old body with it. Moving the rebuilt process from c to b must be refused, naming the body
/// already there: accepted, the new body would sit beside the old one, and the kill meant for
/// the old one could take either.
fn not_sent_back_beside_old_body() -> Result<(), Failed> {
    let c = Cluster::up_full(
        "cp-fence-back",
        3,
        &[("FAILPOINTS", "a:hold-fence=return")],
        Isolation::Shared,
        &["--dead-after", "2", "--checkpoint-every", "1"],
    );
    let dir = scratch("commit_protocol", "fence-back");
    let count = dir.join("count");
    let mut child = counter(&count);
    let pid = child.id() as i32;
    let logs = || common::cluster::daemon_logs(&c.dir, &["a", "b", "c"]);
    let b = c.daemon_pid("b").to_string();
    let r = (|| -> Result<(), Failed> {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !counts(&count) {
            if Instant::now() > deadline {
                return Err("the counter did not start".into());
            }
        }
        migrate(&c, "a", pid, "b").map_err(|e| format!("a -> b: {e}"))?;
        first_checkpoint(&c, 30, &logs)?;
        let _ = Command::new("kill").args(["-STOP", &b]).status();
        let deadline = Instant::now() + Duration::from_secs(40);
        while !c.log("a").contains("event=\"guest-recovered\"") {
            if Instant::now() > deadline {
                let _ = Command::new("kill").args(["-CONT", &b]).status();
                return Err(format!("a did not rebuild it\n{}", logs()).into());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        let _ = Command::new("kill").args(["-CONT", &b]).status();
        let on_c = ps(&c, "c")
            .into_iter()
            .find(|g| g["home_pid"].as_i64() == Some(pid as i64))
            .and_then(|g| g["pid"].as_i64())
            .ok_or_else(|| format!("ferry ps on c does not list it\n{}", logs()))?;
        // c must hear from b again first.
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match migrate(&c, "c", on_c as i32, "b") {
                Ok(out) => {
                    return Err(format!("c -> b beside the old body: {out}\n{}", logs()).into())
                }
                Err(e) if e.contains("already runs here") => return Ok(()),
                Err(e) if Instant::now() > deadline => {
                    return Err(format!("c -> b: {e}\n{}", logs()).into())
                }
                Err(_) => std::thread::sleep(Duration::from_millis(500)),
            }
        }
    })();
    let _ = Command::new("kill").args(["-CONT", &b]).status();
    for (p, _) in copies_naming(&count) {
        let _ = Command::new("kill").args(["-9", &p.to_string()]).status();
    }
    let _ = child.kill();
    let _ = child.wait();
    r
}

/// `ferry run --checkpoint-every 2` on a, whose own default is none: the program (its stdio
/// put on /dev/null, so that no relayed pipe holds it back) is moved to b, and a checkpoints it
/// every second because the program asked; b is killed outright, a rebuilds it, and the
/// `ferry run` that started it still stands for it: SIGTERM to it reaches the program, and it
/// dies of SIGTERM. Before, `ferry run` had no such option, a node's default was the only
/// choice, and a `ferry run` program could not leave its node.
fn run_program_checkpointed() -> Result<(), Failed> {
    let c = Cluster::up_full(
        "cp-run-ckpt",
        2,
        &[],
        Isolation::Separate,
        &["--dead-after", "2"],
    );
    let dir = scratch("commit_protocol", "run-ckpt");
    let count = dir.join("count");
    let mut run = c
        .ferry("a")
        .args([
            "run",
            "--on",
            "a",
            "--checkpoint-every",
            "2",
            "--",
            "python3",
            "-c",
        ])
        .arg(format!(
            "import os\nfd = os.open('/dev/null', os.O_RDWR)\n\
                 for n in (0, 1, 2):\n    os.dup2(fd, n)\nos.close(fd)\n{COUNTER_LOOP}"
        ))
        .arg(&count)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let logs = || common::cluster::daemon_logs(&c.dir, &["a", "b"]);
    let r = (|| -> Result<(), Failed> {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !counts(&count) {
            if Instant::now() > deadline {
                return Err(format!("the program did not start\n{}", logs()).into());
            }
        }
        let pid = ps(&c, "a")
            .into_iter()
            .find(|g| g["kind"] == "remote-exec")
            .and_then(|g| g["pid"].as_i64())
            .ok_or("ferry ps on a lists no ferry run program")?;
        migrate(&c, "a", pid as i32, "b").map_err(|e| format!("a -> b: {e}"))?;
        first_checkpoint(&c, 20, &logs)?;
        let init = c.init_pid("b").ok_or("node b has no init")?;
        let _ = Command::new("kill")
            .args(["-9", &init.to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(40);
        while !c.log("a").contains("event=\"guest-recovered\"") {
            if let Ok(Some(st)) = run.try_wait() {
                return Err(format!("ferry run ended ({st}) with b\n{}", logs()).into());
            }
            if Instant::now() > deadline {
                return Err(format!("a did not rebuild it\n{}", logs()).into());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        if !counts(&count) {
            return Err(format!("the rebuilt program does not count\n{}", logs()).into());
        }
        let _ = Command::new("kill")
            .args(["-TERM", &run.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match run.try_wait() {
                Ok(Some(st)) => {
                    use std::os::unix::process::ExitStatusExt;
                    if st.signal() != Some(libc::SIGTERM) {
                        return Err(format!("ferry run ended with {st}\n{}", logs()).into());
                    }
                    break;
                }
                _ if Instant::now() > deadline => {
                    return Err(format!("SIGTERM to ferry run did not end it\n{}", logs()).into())
                }
                _ => std::thread::sleep(Duration::from_millis(100)),
            }
        }
        if counts(&count) {
            return Err("still counting after SIGTERM".into());
        }
        Ok(())
    })();
    let _ = run.kill();
    let _ = run.wait();
    for (p, _) in copies_naming(&count) {
        let _ = Command::new("kill").args(["-9", &p.to_string()]).status();
    }
    r
}

/// Counts 1, 2, 3... into the file `sys.argv[1]` every 100 ms, through a shared mapping of
/// its first 64 bytes (libc's mmap: Python's own keeps a descriptor of the file): it holds no
/// descriptor of it, and a mapped file must only keep its device, inode and size, so an image
/// of it restores whatever the file has become since (a file it held open, written since,
/// would be refused: not the file captured).
const COUNTER_LOOP: &str = "import ctypes, os, sys, time\n\
     fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)\n\
     os.ftruncate(fd, 64)\nlibc = ctypes.CDLL(None)\nlibc.mmap.restype = ctypes.c_void_p\n\
     libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, \
     ctypes.c_int, ctypes.c_long]\np = libc.mmap(None, 64, 3, 1, fd, 0)\nos.close(fd)\n\
     i = 0\nwhile True:\n    i += 1\n    ctypes.memmove(p, str(i).ljust(64).encode(), 64)\n    \
     time.sleep(0.1)\n";

/// A python counter writing 1, 2, 3... to `count` every 100 ms ([`COUNTER_LOOP`]).
fn counter(count: &Path) -> Child {
    Command::new("python3")
        .arg("-c")
        .arg(COUNTER_LOOP)
        .arg(count)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// Waits up to `secs` for node a's first automatic checkpoint of a guest.
fn first_checkpoint(c: &Cluster, secs: u64, logs: &dyn Fn() -> String) -> Result<(), Failed> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !c.log("a").contains("event=\"checkpoint-taken\"") {
        if Instant::now() > deadline {
            return Err(format!("a took no checkpoint\n{}", logs()).into());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

/// Whether the number in `count` moves within 3 s (it moves every 100 ms, but a loaded
/// machine, with a checkpoint freezing the counter every second, may hold it back a while).
fn counts(count: &Path) -> bool {
    let read = || {
        std::fs::read_to_string(count)
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
    };
    let a = read();
    let deadline = Instant::now() + Duration::from_secs(3);
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        let b = read();
        if matches!((a, b), (Some(x), Some(y)) if y != x) {
            return true;
        }
    }
    false
}

/// A deputy: the original a migration left at home (crates/ferry-deputy), traced by its worker
/// and holding no memory but the vDSO and a few pages. Not a copy: it never runs the program.
fn is_deputy(pid: i32) -> bool {
    let traced = common::run::tracer_of(pid) != 0;
    let mappings = std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .map(|m| m.lines().count())
        .unwrap_or(usize::MAX);
    traced && mappings <= 8
}

/// A shell pipeline `seq 1 N | stage | reader` started here (a), in `dir`: the stage doubles
/// each line (and sleeps `pause` seconds), then exits 3; the reader checks each line is the
/// next one, writes how many it read to `dir/lines` every 500 and at the end.
struct Pipeline {
    sh: Reaped,
    dir: PathBuf,
    /// The stage's PID.
    stage: i32,
}

impl Pipeline {
    fn start(dir: &Path, n: u32, pause: &str) -> Result<Pipeline, Failed> {
        let middle = format!(
            "import sys,os,time\n\
            open(sys.argv[1]+'/pid.tmp','w').write(str(os.getpid()))\n\
            os.rename(sys.argv[1]+'/pid.tmp', sys.argv[1]+'/pid')\n\
            for l in sys.stdin:\n\
            \x20   print(int(l)*2, flush=True)\n\
            \x20   time.sleep({pause})\n\
            sys.exit(3)\n"
        );
        let reader = "import sys\n\
            n=0\n\
            for l in sys.stdin:\n\
            \x20   n+=1\n\
            \x20   assert int(l)==2*n, (l, n)\n\
            \x20   open(sys.argv[1]+'/lines','w').write(str(n)) if n % 500 == 0 else None\n\
            open(sys.argv[1]+'/lines','w').write(str(n))\n";
        let script = format!(
            "set -o pipefail; seq 1 {n} | python3 -c \"$2\" \"$1\" | python3 -c \"$3\" \"$1\""
        );
        let sh = Reaped(
            common::bash(&script, "pipeline")
                .arg(dir)
                .arg(middle)
                .arg(reader)
                .stderr(std::fs::File::create(dir.join("sh.err")).unwrap())
                .spawn()
                .unwrap(),
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        let stage: i32 = loop {
            if let Some(p) = std::fs::read_to_string(dir.join("pid"))
                .ok()
                .and_then(|s| s.trim().parse().ok())
            {
                break p;
            }
            if Instant::now() > deadline {
                return Err("the middle stage did not start".into());
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        Ok(Pipeline {
            sh,
            dir: dir.to_path_buf(),
            stage,
        })
    }

    /// How many lines the reader has read (in steps of 500).
    fn lines(&self) -> u64 {
        std::fs::read_to_string(self.dir.join("lines"))
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .unwrap_or(0)
    }

    /// Waits up to `secs` for at least `n` lines read.
    fn wait_lines(&self, n: u64, secs: u64, logs: &dyn Fn() -> String) -> Result<(), Failed> {
        let deadline = Instant::now() + Duration::from_secs(secs);
        while self.lines() < n {
            if Instant::now() > deadline {
                return Err(
                    format!("{} lines through the relays\n{}", self.lines(), logs()).into(),
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// Waits up to `secs` for the pipeline's end: every one of `n` lines read once, in order,
    /// and the stage's own exit status (3) seen by the shell. `when`: what happened at
    /// `at` lines.
    fn completes(
        &mut self,
        n: u64,
        secs: u64,
        when: &str,
        logs: &dyn Fn() -> String,
    ) -> Result<(), Failed> {
        let deadline = Instant::now() + Duration::from_secs(secs);
        let st = loop {
            if let Some(st) = self.sh.0.try_wait().unwrap() {
                break st;
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "the pipeline did not end; the reader read {} lines ({when})\n{}",
                    self.lines(),
                    logs()
                )
                .into());
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let err = std::fs::read_to_string(self.dir.join("sh.err")).unwrap_or_default();
        if self.lines() != n || st.code() != Some(3) {
            return Err(format!(
                "the reader read {} lines, not {n} once in order ({when}), and the shell saw \
                 {st:?}, not the stage's 3: {err}\n{}",
                self.lines(),
                logs()
            )
            .into());
        }
        Ok(())
    }
}

/// The middle stage of a shell pipeline (`seq | stage | reader`, all at a) moves to b while
/// lines flow through it, both its stdin and stdout relayed by a; then a's daemon is killed
/// outright (SIGKILL) and restarted while the stage reads and writes. The relays' home ends and
/// buffers outlive the daemon in their holders, the restarted daemon takes them back, and b
/// dials again: the reader gets every line once, in order, and the shell's `wait` (pipefail)
/// gets the moved stage's own exit status. Before, the stage saw end of file and the reader
/// lost what was in flight.
fn relays_survive_home_restart() -> Result<(), Failed> {
    let c = shared("cp-relay-restart", &[]);
    let dir = scratch("commit_protocol", "relay-restart");
    let logs = || common::cluster::daemon_logs(&c.dir, &["a", "b"]);
    let mut p = Pipeline::start(&dir, 20000, "0.0005")?;
    std::thread::sleep(Duration::from_millis(300));
    migrate(&c, "a", p.stage, "b").map_err(|e| format!("the middle stage did not move: {e}"))?;
    // Lines flow through b before a's daemon dies.
    p.wait_lines(1000, 30, &logs)?;
    let holders = holders_hold_only_theirs(&c, "a", 2)?;
    let _ = Command::new("kill")
        .args(["-9", &c.daemon_pid("a").to_string()])
        .status();
    wait_daemon_gone(&c, "a");
    let at_kill = p.lines();
    std::thread::sleep(Duration::from_secs(1));
    restart(&c, "a");
    p.completes(20000, 90, &format!("{at_kill} when a died"), &logs)?;
    if at_kill >= 20000 {
        return Err("the pipeline was done before a's daemon died: nothing tested".into());
    }
    // The stage is over: its holders end with it (gone, or a zombie not yet reaped).
    let deadline = Instant::now() + Duration::from_secs(10);
    for h in holders {
        loop {
            let stat = std::fs::read_to_string(format!("/proc/{h}/stat")).unwrap_or_default();
            let ours = stat.contains("(ferry-holder)");
            let state = stat
                .rsplit_once(')')
                .and_then(|r| r.1.split_whitespace().next());
            if !ours || state == Some("Z") {
                break;
            }
            if Instant::now() > deadline {
                return Err(format!("holder {h} outlived its relay: {stat}").into());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    let a = c.log("a");
    if !a.contains("relay-recovered") {
        return Err(format!("a's log says nothing of its relays taken up again\n{a}").into());
    }
    Ok(())
}

/// The holders of node `node`'s relays (their records in its state directory; `n` of them):
/// each is Ferry's own (`ferry-holder`), in a process group of its own, and holds only the
/// pipe's end (fd 0), the relay's buffer and marks (fds 1 and 2, memfds) and the pidfd of the
/// tree's root it waits on: none of the daemon's other descriptors; SIGHUP, SIGINT and SIGTERM
/// sent to its group do not end it. Returns their PIDs.
fn holders_hold_only_theirs(c: &Cluster, node: &str, n: usize) -> Result<Vec<i32>, Failed> {
    let state = c.dir.join(node).join("state");
    let mut pids = Vec::new();
    for e in std::fs::read_dir(&state).map_err(|e| format!("{}: {e}", state.display()))? {
        let e = e.map_err(|e| e.to_string())?;
        let name = e.file_name().to_string_lossy().into_owned();
        if !(name.starts_with("relay-") && name.ends_with(".json")) {
            continue;
        }
        let rec: serde_json::Value =
            serde_json::from_slice(&std::fs::read(e.path()).map_err(|e| e.to_string())?)
                .map_err(|e| format!("{name}: {e}"))?;
        let h = rec["holder_pid"]
            .as_i64()
            .ok_or(format!("{name}: no holder_pid"))? as i32;
        pids.push(h);
        let comm = std::fs::read_to_string(format!("/proc/{h}/comm")).unwrap_or_default();
        if comm.trim() != "ferry-holder" {
            return Err(format!(
                "holder {h} of {name} is {:?}, not ferry-holder",
                comm.trim()
            )
            .into());
        }
        let stat = std::fs::read_to_string(format!("/proc/{h}/stat")).unwrap_or_default();
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .map(|r| r.1)
            .unwrap_or("")
            .split_whitespace()
            .collect();
        if fields.get(2) != Some(&h.to_string().as_str()) {
            return Err(format!("holder {h} is not in a process group of its own: {stat}").into());
        }
        let mut fds = Vec::new();
        for f in std::fs::read_dir(format!("/proc/{h}/fd")).map_err(|e| e.to_string())? {
            let f = f.map_err(|e| e.to_string())?;
            let to = std::fs::read_link(f.path()).map_err(|e| e.to_string())?;
            let fd: i32 = f.file_name().to_string_lossy().parse().unwrap_or(-1);
            fds.push((fd, to.to_string_lossy().into_owned()));
        }
        fds.sort();
        let ok = fds.len() == 4
            && fds[0].0 == 0
            && fds[0].1.starts_with("pipe:")
            && fds[1].0 == 1
            && fds[1].1.starts_with("/memfd:ferry-relay-")
            && fds[2].0 == 2
            && fds[2].1.starts_with("/memfd:ferry-relay-acked-")
            && fds[3].1 == "anon_inode:[pidfd]";
        if !ok {
            return Err(
                format!("holder {h} of {name} holds more or other than its own: {fds:?}").into(),
            );
        }
    }
    if pids.len() != n {
        return Err(format!(
            "{} relay records in {}, not {n}",
            pids.len(),
            state.display()
        )
        .into());
    }
    // A hang-up, ^C or a stop sent to their process groups leaves them holding.
    for &h in &pids {
        for sig in ["HUP", "INT", "TERM"] {
            let _ = Command::new("kill")
                .args([&format!("-{sig}"), "--", &format!("-{h}")])
                .status();
        }
    }
    std::thread::sleep(Duration::from_millis(300));
    for &h in &pids {
        let comm = std::fs::read_to_string(format!("/proc/{h}/comm")).unwrap_or_default();
        let stat = std::fs::read_to_string(format!("/proc/{h}/stat")).unwrap_or_default();
        let state = stat
            .rsplit_once(')')
            .and_then(|r| r.1.split_whitespace().next());
        if comm.trim() != "ferry-holder" || state == Some("Z") {
            return Err(format!("holder {h} ended on SIGHUP/SIGINT/SIGTERM to its group").into());
        }
    }
    Ok(pids)
}

/// The middle stage of a shell pipeline (`seq | stage | reader`) moves from a to b, where a
/// checkpoints it every 2 s with its relayed stdin and stdout (the stand-ins' contents in the
/// image, where each relay stood sent home with it); then node b is killed outright (its
/// init) while lines flow. a rebuilds the stage from its last image, at home, and links its
/// relays again from where the image stood: the stage reads again from there what it had read
/// since (a kept it), and what it writes again up to what a had received is dropped (the stage
/// is deterministic). The reader gets every line once, in order, and the shell sees the stage's
/// exit status. Before, such a body could not be checkpointed, and b's death lost it.
fn relayed_pipeline_recovered_after_node_death() -> Result<(), Failed> {
    relayed_pipeline_recovered_on(2, "a")
}

/// As above with a third node, c: the stage is rebuilt there (the idlest live node), and its
/// relays go from a to c.
fn relayed_pipeline_recovered_elsewhere() -> Result<(), Failed> {
    relayed_pipeline_recovered_on(3, "c")
}

fn relayed_pipeline_recovered_on(n: usize, expect_on: &str) -> Result<(), Failed> {
    let c = Cluster::up_full(
        &format!("cp-relay-recover{n}"),
        n,
        &[],
        Isolation::Separate,
        &["--dead-after", "2", "--checkpoint-every", "2"],
    );
    let dir = scratch("commit_protocol", &format!("relay-recover{n}"));
    let logs = || common::cluster::daemon_logs(&c.dir, &["a", "b", "c"][..n]);
    let mut p = Pipeline::start(&dir, 20000, "0.001")?;
    std::thread::sleep(Duration::from_millis(300));
    migrate(&c, "a", p.stage, "b").map_err(|e| format!("the middle stage did not move: {e}"))?;
    first_checkpoint(&c, 30, &logs)?;
    p.wait_lines(2000, 30, &logs)?;
    let init = c.init_pid("b").ok_or("node b has no init")?;
    let _ = Command::new("kill")
        .args(["-9", &init.to_string()])
        .status();
    let at_kill = p.lines();
    let deadline = Instant::now() + Duration::from_secs(40);
    while !c.log("a").contains("event=\"guest-recovered\"") {
        if Instant::now() > deadline {
            return Err(format!("a did not rebuild the stage\n{}", logs()).into());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    p.completes(20000, 120, &format!("{at_kill} when b died"), &logs)?;
    if at_kill >= 20000 {
        return Err("the pipeline was done before b died: nothing tested".into());
    }
    let said = format!("node={expect_on}");
    if !c
        .log("a")
        .lines()
        .any(|l| l.contains("event=\"guest-recovered\"") && l.split_whitespace().any(|w| w == said))
    {
        return Err(format!("a's log does not say it went to {expect_on}\n{}", logs()).into());
    }
    Ok(())
}

/// A child killed and reaped when dropped (a test that fails leaves nothing running).
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
