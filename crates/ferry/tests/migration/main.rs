//! Live migration between the daemons of real local clusters on loopback: a ticking victim is
//! moved around and must never notice (same PID in its own eyes, memory intact, monotonic clock
//! never backwards, keeps counting), and every failure before the commit point leaves it
//! running where it was. Faults are real: daemons killed, a foreign certificate, garbage on the
//! wire.
//!
//! The trials are in `faults.rs` (failures around the commit point, hostile peers, refusals),
//! `relays.rs` (pipes, UNIX and TCP peers relayed from home), `direct.rs` (both ends of a
//! pipe on one node, joined there), `home.rs` (what the deputy
//! keeps: a parent's wait, terminals, identities, coming home) and `kills.rs` (a body's
//! signals to processes at home, its group changes made there, its home parent's death, its
//! children's stops); this file has the moves around the cluster and the shared helpers.

#[path = "../common/mod.rs"]
mod common;
mod direct;
mod faults;
mod home;
mod kills;
mod onward;
mod relays;

use direct::*;
use faults::*;
use home::*;
use kills::*;
use onward::*;
use relays::*;

use common::scratch;

use common::cluster::{Cluster, Isolation};
use libtest_mimic::{Arguments, Failed, Trial};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn main() {
    common::seal_inherited_fds();
    let args = Arguments::from_args();
    let tests = vec![
        Trial::test("migrate_a_to_b_to_c_to_a", migrate_around),
        Trial::test("refusals_leave_the_process_running", refusals),
        Trial::test(
            "destination_killed_mid_transfer",
            destination_killed_mid_transfer,
        ),
        Trial::test("image_stream_stalls_fail_the_move", stream_stalls),
        Trial::test("source_dies_after_commit", source_dies_after_commit),
        Trial::test(
            "precopy_moves_a_fast_writer_intact",
            precopy_moves_a_fast_writer,
        ),
        Trial::test(
            "a_failed_precopy_round_leaves_the_process_running",
            precopy_round_fails,
        ),
        Trial::test(
            "destination_daemon_dies_after_rebuild",
            destination_dies_after_rebuild,
        ),
        Trial::test(
            "socket_file_comes_back_after_an_abort",
            socket_file_after_abort,
        ),
        Trial::test(
            "tcp_connection_works_on_after_an_abort_and_moves",
            tcp_connection_after_abort,
        ),
        Trial::test(
            "write_lease_comes_back_after_an_abort_and_moves",
            write_lease_after_abort,
        ),
        Trial::test("foreign_certificate_and_garbage_refused", hostile_peers),
        Trial::test(
            "unmovable_state_refused_and_left_running",
            unmovable_refused,
        ),
        Trial::test("daemon_stops_cleanly_on_sigterm", daemon_sigterm),
        Trial::test(
            "a_shell_waits_for_its_moved_child_as_if_it_never_left",
            shell_waits_for_moved_child,
        ),
        Trial::test(
            "a_parent_sees_its_moved_child_stop_continue_and_exit",
            parent_sees_stop_continue_exit,
        ),
        Trial::test(
            "a_body_lost_with_its_node_is_killed_at_home",
            body_lost_with_its_node,
        ),
        Trial::test(
            "a_pipeline_stage_moves_its_pipes_relayed_from_home",
            pipeline_stage_moves_with_relayed_pipes,
        ),
        Trial::test(
            "a_relayed_pipe_answers_fstat_with_its_inode_at_home",
            relayed_pipes_fstat_as_at_home,
        ),
        Trial::test(
            "a_pipeline_stage_moves_on_from_b_to_c_with_its_relays",
            pipeline_stage_moves_on_with_its_relays,
        ),
        Trial::test(
            "a_writer_to_a_full_pipe_at_home_moves_a_b_c_a",
            a_writer_to_a_full_pipe_at_home_moves_around,
        ),
        Trial::test(
            "a_job_under_a_terminal_moves_on_from_b_to_c",
            a_job_under_a_terminal_moves_on_from_b_to_c,
        ),
        Trial::test(
            "a_unix_client_moves_on_from_b_to_c_talking_to_home",
            a_unix_client_moves_on_talking_to_home,
        ),
        Trial::test(
            "a_tcp_client_moves_on_from_b_to_c_talking_to_home",
            a_tcp_client_moves_on_talking_to_home,
        ),
        Trial::test(
            "a_tcp_client_moved_on_comes_home_talking_to_home",
            a_tcp_client_comes_home_talking_to_home,
        ),
        Trial::test(
            "datagrams_to_home_follow_a_body_moving_on",
            datagrams_to_home_follow_a_body_moving_on,
        ),
        Trial::test(
            "seqpacket_records_to_home_follow_a_body_moving_on",
            seqpacket_records_to_home_follow_a_body_moving_on,
        ),
        Trial::test(
            "a_half_closed_unix_stream_moves_on_from_b_to_c",
            a_half_closed_unix_stream_moves_on,
        ),
        Trial::test(
            "a_half_closed_tcp_stream_moves_on_from_b_to_c",
            a_half_closed_tcp_stream_moves_on,
        ),
        Trial::test(
            "a_job_under_a_terminal_comes_home_from_c",
            a_job_under_a_terminal_comes_home_from_c,
        ),
        Trial::test(
            "both_ends_of_a_pipe_on_one_node_talk_straight",
            both_ends_of_a_pipe_on_one_node_talk_straight,
        ),
        Trial::test(
            "a_joined_writer_gets_sigpipe_when_its_reader_ends",
            a_joined_writer_gets_sigpipe_when_its_reader_ends,
        ),
        Trial::test(
            "a_joined_pair_streams_in_bulk_whole",
            a_joined_pair_streams_in_bulk_whole,
        ),
        Trial::test(
            "a_joined_end_moves_on_and_is_joined_again",
            a_joined_end_moves_on_and_is_joined_again,
        ),
        Trial::test(
            "a_moved_writer_sees_epipe_when_its_reader_at_home_goes",
            relayed_pipe_reader_gone,
        ),
        Trial::test(
            "bulk_streams_through_relays_arrive_whole_both_ways",
            bulk_streams_through_relays,
        ),
        Trial::test(
            "a_client_talks_on_to_its_server_at_home_over_a_unix_socket",
            unix_client_of_a_home_server,
        ),
        Trial::test(
            "datagrams_to_home_are_relayed_whole_and_in_order",
            datagrams_to_home_are_relayed_whole,
        ),
        Trial::test(
            "seqpacket_records_to_home_are_relayed_whole",
            seqpacket_records_to_home_are_relayed_whole,
        ),
        Trial::test(
            "a_peer_that_never_reads_does_not_grow_the_home_daemon",
            a_peer_that_never_reads_does_not_grow_the_home_daemon,
        ),
        Trial::test(
            "a_client_talks_on_to_its_server_at_home_over_tcp",
            tcp_client_of_a_home_server,
        ),
        Trial::test(
            "a_tcp_server_talks_on_to_its_client_at_home",
            tcp_server_of_a_home_client,
        ),
        Trial::test(
            "a_unix_server_talks_on_to_its_client_at_home",
            unix_server_of_a_home_client,
        ),
        Trial::test(
            "a_shell_job_under_a_terminal_moves_stops_resumes_and_is_interrupted",
            shell_job_under_a_terminal,
        ),
        Trial::test(
            "a_moved_process_keeps_its_home_identities",
            keeps_home_identities,
        ),
        Trial::test(
            "a_body_signals_processes_at_home_as_it_did_there",
            a_body_signals_processes_at_home,
        ),
        Trial::test(
            "a_body_follows_its_home_parents_death",
            a_body_follows_its_home_parents_death,
        ),
        Trial::test(
            "a_forked_childs_stop_and_continue_show_at_home",
            a_forked_childs_stop_and_continue_show_at_home,
        ),
        Trial::test(
            "a_body_whose_supervisor_dies_is_killed_and_its_parent_told",
            supervisor_dies,
        ),
        Trial::test(
            "a_job_brought_home_is_its_shells_child_again",
            job_brought_home,
        ),
        Trial::test(
            "a_child_forked_after_the_move_sees_its_parent_group_and_session",
            fork_after_move,
        ),
        Trial::test(
            "a_child_forked_after_the_move_has_a_deputy_at_home",
            forked_child_has_a_deputy,
        ),
        Trial::test(
            "a_child_forked_after_the_move_moves_on_and_comes_home",
            forked_child_moves_on_and_comes_home,
        ),
        Trial::test(
            "a_fork_without_its_home_fails_with_eagain",
            fork_without_home_fails_with_eagain,
        ),
        Trial::test(
            "three_hundred_forks_after_the_move_each_get_their_deputys_pid",
            many_forks_after_the_move,
        ),
        Trial::test(
            "a_moved_job_sets_its_home_terminal_raw_and_reads_keys",
            raw_terminal_after_move,
        ),
        Trial::test(
            "a_moved_on_job_sets_its_home_terminal_raw_and_reads_keys",
            raw_terminal_after_moving_on,
        ),
    ];
    libtest_mimic::run(&args, tests).exit();
}

/// `tests/victims/NAME.c`, built once per test process.
fn victim_binary(name: &str) -> PathBuf {
    common::victim(name, &["-O2"])
}

fn ticker_binary() -> PathBuf {
    victim_binary("ticker")
}

/// A victim's stdout and stderr: files beside it, which every node has. (Inherited, they would
/// be the test's own, which may be a file only this node has, such as /tmp/log: a moved victim
/// reopens its files on the destination.)
fn victim_output(dir: &Path, name: &str) -> (Stdio, Stdio) {
    let file = |ext: &str| {
        let p = dir.join(format!("{name}.{ext}"));
        Stdio::from(std::fs::File::create(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
    };
    (file("out"), file("err"))
}

/// A ticking victim and the status line it keeps rewriting.
struct Ticker {
    child: Child,
    status: PathBuf,
}

#[derive(Debug, PartialEq)]
struct Status {
    count: u64,
    pid: i32,
    ok: bool,
    mono: bool,
}

impl Ticker {
    fn start(dir: &Path, mib: u32) -> Ticker {
        Ticker::start_as(dir, ticker_binary(), &[&mib.to_string()])
    }

    /// tests/victims/dirtier.c: `mib` of memory, `rate` pages written per second (one in 64
    /// dropped), all of it checked against its own table of versions every second.
    fn dirtier(dir: &Path, mib: u32, rate: u32) -> Ticker {
        Ticker::start_as(
            dir,
            victim_binary("dirtier"),
            &[&mib.to_string(), &rate.to_string()],
        )
    }

    fn start_as(dir: &Path, binary: PathBuf, args: &[&str]) -> Ticker {
        let status = dir.join("ticker.status");
        let (out, err) = victim_output(dir, "ticker");
        let child = Command::new(binary)
            .args(args)
            .arg(&status)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap();
        let t = Ticker { child, status };
        let deadline = Instant::now() + Duration::from_secs(10);
        while t.status().is_none_or(|s| s.count < 2) {
            assert!(Instant::now() < deadline, "ticker did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        t
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// How the ticker ended, as its parent (this test) sees it, waiting up to `limit`.
    fn wait_end(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return Some(st);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn status(&self) -> Option<Status> {
        let text = std::fs::read_to_string(&self.status).ok()?;
        let field = |k: &str| -> Option<String> {
            text.split_whitespace()
                .find_map(|w| w.strip_prefix(k))
                .map(str::to_string)
        };
        Some(Status {
            count: field("count=")?.parse().ok()?,
            pid: field("pid=")?.parse().ok()?,
            ok: field("ok=")? == "1",
            mono: field("mono=")? == "1",
        })
    }

    /// Fails unless the ticker counts on, intact, under its own PID.
    fn assert_alive(&self, what: &str) {
        if let Err(e) = self.alive(what) {
            panic!("{e}");
        }
    }

    /// Whether the ticker counts on, intact, under its own PID: what went wrong if not.
    fn alive(&self, what: &str) -> Result<(), String> {
        let before = self.status().expect("status");
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let now = self.status().expect("status");
            if !now.ok {
                return Err(format!("{what}: memory pattern damaged: {now:?}"));
            }
            if !now.mono {
                return Err(format!("{what}: CLOCK_MONOTONIC went backwards: {now:?}"));
            }
            if now.pid != self.pid() {
                return Err(format!("{what}: the process sees another PID: {now:?}"));
            }
            if now.count > before.count + 2 {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!("{what}: the ticker stopped counting at {now:?}"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
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

fn migrate(c: &Cluster, on: &str, pid: i32, to: &str) -> Result<serde_json::Value, String> {
    let o = c.run(on, &["migrate", &pid.to_string(), "--to", to, "--json"]);
    if o.status.success() {
        serde_json::from_slice(&o.stdout).map_err(|e| format!("bad json: {e}: {}", text(&o)))
    } else {
        Err(text(&o))
    }
}

fn ps(c: &Cluster, on: &str) -> Vec<serde_json::Value> {
    let o = c.run(on, &["ps", "--json"]);
    assert!(o.status.success(), "ps: {}", text(&o));
    serde_json::from_slice::<Vec<serde_json::Value>>(&o.stdout).unwrap()
}

/// The guest with this home PID, as `ferry ps` lists it.
fn guest(c: &Cluster, on: &str, home_pid: i32) -> Option<serde_json::Value> {
    ps(c, on)
        .into_iter()
        .find(|p| p["home_pid"].as_i64() == Some(home_pid as i64))
}

fn proc_state_of(pid: i32) -> Option<char> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    s.rsplit(')').next()?.trim_start().chars().next()
}

fn pid_alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            !s.rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        })
        .unwrap_or(false)
}

fn kill_host_pid(pid: i64) {
    let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
}

/// Kills the process that node `node` calls `pid` (on a separate node, a PID of its own
/// namespace).
fn kill_on(c: &Cluster, node: &str, pid: i64) {
    if let Some(p) = c.host_pid(node, pid as i32) {
        kill_host_pid(p as i64);
    }
}

fn migrate_around() -> Result<(), Failed> {
    let c = Cluster::up("around", 3);
    let dir = scratch("migration", "around");
    let mut t = Ticker::start(&dir, 32);
    let home = t.pid();
    let mut host_pid = home;
    for (from, to) in [("a", "b"), ("b", "c"), ("c", "a")] {
        let r = migrate(&c, from, home, to).map_err(|e| format!("{from} -> {to}: {e}"))?;
        assert_eq!(r["to"], to);
        assert!(r["freeze_ms"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["wire_bytes"].as_u64().unwrap() > 1 << 20, "{r}");
        if host_pid == home {
            // Leaving home, the original stays there as the body's deputy: alive (to its
            // parent, this test), traced, holding no memory.
            assert!(pid_alive(home), "no deputy of {home} at home");
            assert_ne!(
                common::run::tracer_of(home),
                0,
                "PID {home} at home is not a deputy"
            );
            let rss = std::fs::read_to_string(format!("/proc/{home}/status")).unwrap();
            let rss_kb: u64 = rss
                .lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
                .unwrap_or(u64::MAX);
            assert!(rss_kb < 4096, "the deputy still holds {rss_kb} kB");
        } else if to == "a" {
            // Home again: the process itself, in place of its deputy.
            assert!(!pid_alive(host_pid), "the copy on {from} still runs");
            assert_eq!(r["dest_pid"].as_i64(), Some(home as i64), "{r}");
            assert_eq!(common::run::tracer_of(home), 0, "{home} is still a deputy");
            assert!(guest(&c, "a", home).is_none(), "ps lists {home} at home");
            host_pid = home;
            t.assert_alive("after c -> a");
            break;
        } else {
            assert!(!pid_alive(host_pid), "the copy on {from} still runs");
            assert!(
                pid_alive(home),
                "the deputy at home died when its body moved on"
            );
        }
        let g = guest(&c, "a", home).ok_or(format!("ps does not list {home} after {to}"))?;
        assert_eq!(g["node"], to, "{g}");
        assert_eq!(g["home_node"], "a", "{g}");
        let there = g["pid"].as_i64().unwrap() as i32;
        host_pid = c
            .host_pid(to, there)
            .ok_or(format!("no process of node {to} is its PID {there}"))?;
        assert_ne!(host_pid, home, "a guest runs under its own host PID");
        t.assert_alive(&format!("after {from} -> {to}"));
        if to == "c" {
            // A signal sent to the PID at home reaches the body, wherever it runs now.
            let st = Command::new("kill")
                .args(["-STOP", &home.to_string()])
                .status()
                .unwrap();
            assert!(st.success());
            let deadline = Instant::now() + Duration::from_secs(5);
            while proc_state_of(host_pid) != Some('T') {
                assert!(
                    Instant::now() < deadline,
                    "SIGSTOP to {home} at home did not stop its body ({host_pid})"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
            let st = Command::new("kill")
                .args(["-CONT", &home.to_string()])
                .status()
                .unwrap();
            assert!(st.success());
            // (With the daemons' logs: it failed once under heavy load, unexplained.)
            t.alive("after SIGSTOP and SIGCONT at home").map_err(|e| {
                format!(
                    "{e}\nbody state: {:?}\n--- a\n{}\n--- b\n{}\n--- c\n{}",
                    proc_state_of(host_pid),
                    c.log("a"),
                    c.log("b"),
                    c.log("c")
                )
            })?;
        }
    }
    kill_host_pid(host_pid as i64);
    // Its parent at home sees it end.
    let st = t
        .wait_end(Duration::from_secs(10))
        .ok_or("the process did not end at home")?;
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(st.signal(), Some(libc::SIGKILL), "{st:?}");
    Ok(())
}

fn refusals() -> Result<(), Failed> {
    let c = Cluster::up("refuse", 3);
    let dir = scratch("migration", "refuse");
    let t = Ticker::start(&dir, 4);
    let pid = t.pid();

    let o = c.run("c", &["accept", "no"]);
    assert!(o.status.success(), "{}", text(&o));
    let e = migrate(&c, "a", pid, "c").expect_err("c refuses guests");
    assert!(e.contains("does not accept guests"), "{e}");
    assert!(e.contains("keeps running") || e.contains("refused"), "{e}");
    t.assert_alive("after a refusal");
    assert!(c.run("c", &["accept", "yes"]).status.success());

    let e = migrate(&c, "a", pid, "nowhere").expect_err("unknown node");
    assert!(e.contains("no live node named \"nowhere\""), "{e}");
    let e = migrate(&c, "a", pid, "a").expect_err("same node");
    assert!(e.contains("already on node a"), "{e}");
    let e = migrate(&c, "a", 999_999_999, "b").expect_err("no such PID");
    assert!(e.contains("999999999"), "{e}");
    t.assert_alive("after bad requests");

    // A dead node: it leaves the membership and cannot be chosen.
    kill_host_pid(c.daemon_pid("c") as i64);
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let e = migrate(&c, "a", pid, "c").expect_err("c is dead");
        if e.contains("no live node named \"c\"") {
            break;
        }
        assert!(
            e.contains("keeps running") || e.contains("reach node c"),
            "unexpected: {e}"
        );
        assert!(
            Instant::now() < deadline,
            "c never left the membership: {e}"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    t.assert_alive("after trying a dead node");
    Ok(())
}

/// tests/victims/unix_pid_server.py on a UNIX socket bound to `path`: each client gets its PID.
/// Killed and reaped when dropped.
struct UnixServer(Child);

impl Drop for UnixServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
