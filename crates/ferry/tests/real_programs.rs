//! Real programs nobody here wrote, checkpointed and restored.
//!
//! Each trial starts a real program (CPython, a Go binary, redis-server, a
//! bash pipeline of coreutils/awk/sed), lets it work, then twice does
//! `ferry checkpoint PID --dir D` (which kills the tree) and
//! `ferry restore --dir D` (which must give back the same root PID), checks
//! after each restore that the program carries on, and finally that its
//! state is intact:
//!
//! * `python_compute`: `tests/real/python/compute.py`, a computation whose
//!   state is in memory and which recomputes it from scratch at the end;
//! * `python_threads`: `tests/real/python/threads.py`, a dozen threads on
//!   shared state (locks, a queue, timers), checked for consistency;
//! * `go_ticker`: `tests/real/go-ticker`, goroutines on tickers and timers
//!   passing a hash chain over channels (built here with the machine's `go`);
//! * `redis_data`: `redis-server` (no persistence) on a free loopback port,
//!   filled by `redis-cli` before, read back and added to after each restore,
//!   then shut down cleanly;
//! * `bash_pipeline`: `bash -c 'seq | awk | sed | awk > out'`, whose last
//!   stage checks every line's continuity and reports running totals that
//!   the harness checks too; at the end the last stage exits and the others
//!   must die of SIGPIPE.
//!
//! The programs follow the engine suite's protocol where they can (see
//! `tests/programs/README.md`): cwd = a fresh directory T, stdin /dev/null,
//! stdout and stderr appended to T/log, own session (setsid); `T/ready`
//! holds the pid once set up, "progress N" lines in the log show the work
//! going on, `T/go` asks for the verdict, `T/result` holds `PASS` or
//! `FAIL: ...`.  A missing program (redis-server, go, ...) is a failure that
//! says which package to install, never a silent skip.
//!
//! Each also has a `migrate::` trial: instead of checkpoint and restore, the
//! program is moved live around a local cluster of three nodes, `ferry
//! --node a migrate PID --to b`, b -> c, c -> a, and must get further after
//! each hop; redis-server's listening socket comes along (between nodes that
//! share a network stack its port is still held by the frozen original while
//! the copy is rebuilt: see docs/limitations.md), and is reached by a client
//! on the node where it runs (in its network namespace).  After the first hop the root is no longer our
//! child (each daemon is the subreaper of its guests): the harness follows it
//! by the host PID each migration reports, and instead of its exit status
//! requires it, and every guest namespace it lived in, to be gone after the
//! program's own final check.  One cluster serves every `migrate::` trial of
//! a run; it is started by the first and stopped before the harness exits.
//!
//! Like the engine suite, the harness makes itself a child subreaper so
//! restored (detached) processes become its children, runs one trial at a
//! time (restore needs the PIDs free), and kills and reaps every process of
//! a trial afterwards, also when it failed.
//!
//! Environment: `FERRY_REAL_KEEP=1` keeps the run directories of passing
//! trials too (failing ones are always kept); `FERRY_REAL_FERRY` runs
//! another `ferry` binary (e.g. a release build).

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::sync::Arc;
use std::thread::sleep;
use std::time::{Duration, Instant};

mod common;

use common::run::{run_with_timeout, CmdOutput, Harness, Limits, Run, MIG_HOPS};
use common::*;
use libtest_mimic::{Failed, Trial};

/// The machine is small and shared: generous limits, tight polling.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
const PROGRESS_TIMEOUT: Duration = Duration::from_secs(30);
const RESULT_TIMEOUT: Duration = Duration::from_secs(120);
const TOOL_TIMEOUT: Duration = Duration::from_secs(60);
const BUILD_TIMEOUT: Duration = Duration::from_secs(300);
const LIMITS: Limits = Limits {
    ready: READY_TIMEOUT,
    exit: Duration::from_secs(10),
    tree_gone: Duration::from_secs(10),
    ferry: Duration::from_secs(120),
    log_tail: 8 * 1024,
};
/// How long a program works between seeing progress and the checkpoint, so
/// that it is caught in the middle of its work.
const WORK_TIME: Duration = Duration::from_millis(500);

struct Suite {
    harness: Harness,
    real_dir: PathBuf,
}

/// How a trial moves its program.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    /// Twice `ferry checkpoint` (which kills it) and `ferry restore`.
    CheckpointRestore,
    /// Three hops around a local cluster with `ferry migrate`.
    Migrate,
}

impl Mode {
    fn rounds(self) -> u32 {
        match self {
            Mode::CheckpointRestore => 2,
            Mode::Migrate => MIG_HOPS.len() as u32,
        }
    }

    /// "checkpoint 2", "migration 2 (b -> c)".
    fn step(self, round: u32) -> String {
        match self {
            Mode::CheckpointRestore => format!("checkpoint {round}"),
            Mode::Migrate => {
                let (from, to) = MIG_HOPS[round as usize - 1];
                format!("migration {round} ({from} -> {to})")
            }
        }
    }
}

type TrialFn = fn(&Suite, Mode) -> Result<(), Failed>;

fn main() {
    common::seal_inherited_fds();
    let args = Harness::args();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let root = root.canonicalize().unwrap_or(root);
    let suite = Arc::new(Suite {
        harness: Harness::new(
            "real_programs",
            "FERRY_REAL_FERRY",
            "FERRY_REAL_KEEP",
            LIMITS,
        ),
        real_dir: root.join("tests/real"),
    });

    let all: [(&str, TrialFn); 5] = [
        ("python_compute", python_compute),
        ("python_threads", python_threads),
        ("go_ticker", go_ticker),
        ("redis_data", redis_data),
        ("bash_pipeline", bash_pipeline),
    ];
    let mut trials = Vec::new();
    for (prefix, mode) in [("", Mode::CheckpointRestore), ("migrate::", Mode::Migrate)] {
        for (name, f) in all {
            let s = suite.clone();
            trials.push(Trial::test(format!("{prefix}{name}"), move || f(&s, mode)));
        }
    }
    let conclusion = libtest_mimic::run(&args, trials);
    suite.harness.exit(conclusion);
}

// ---------------------------------------------------------------------------
// Finding and building the programs.

fn is_executable(p: &Path) -> bool {
    fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// `name` on PATH, or a failure that says which Debian package has it.
fn find_tool(name: &str, package: &str) -> Result<PathBuf, Failed> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    if let Some(p) = std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| is_executable(p))
    {
        return Ok(p);
    }
    Err(Failed::from(format!(
        "`{name}` is not installed: it is not on PATH ({}). It comes from Debian's \
         {package} package: run scripts/install-deps.sh as root.",
        path.to_string_lossy()
    )))
}

/// The system's python3 (what scripts/install-deps.sh installs) rather than
/// a wrapper such as a pyenv shim, else whatever PATH has.
fn find_python() -> Result<PathBuf, Failed> {
    let system = PathBuf::from("/usr/bin/python3");
    if is_executable(&system) {
        return Ok(system);
    }
    find_tool("python3", "python3")
}

/// Build `tests/real/go-ticker` into the target directory with `go build`
/// (pure Go, no external modules, nothing downloaded).
fn build_go_ticker(suite: &Suite) -> Result<PathBuf, Failed> {
    let go = find_tool("go", "golang-go")?;
    let src = suite.real_dir.join("go-ticker");
    fs::create_dir_all(&suite.harness.bin_dir)
        .map_err(|e| Failed::from(format!("mkdir {}: {e}", suite.harness.bin_dir.display())))?;
    let bin = suite.harness.bin_dir.join("go-ticker");
    // Build to a private name, then rename: another harness may be running
    // the binary right now.
    let tmp = suite
        .harness
        .bin_dir
        .join(format!(".go-ticker.{}.tmp", std::process::id()));
    let mut cmd = Command::new(&go);
    cmd.current_dir(&src)
        .args(["build", "-trimpath", "-o"])
        .arg(&tmp)
        .arg(".")
        .env("CGO_ENABLED", "0")
        .env("GOTOOLCHAIN", "local")
        .env("GOFLAGS", "")
        .env("GOPROXY", "off");
    if std::env::var_os("HOME").is_none() {
        // go needs somewhere for its build cache.
        let gohome = suite.harness.bin_dir.join("go-home");
        if std::env::var_os("GOCACHE").is_none() {
            cmd.env("GOCACHE", gohome.join("cache"));
        }
        if std::env::var_os("GOPATH").is_none() {
            cmd.env("GOPATH", gohome.join("path"));
        }
    }
    let out = run_with_timeout(cmd, None, &suite.harness.bin_dir, "go-build", BUILD_TIMEOUT)
        .map_err(|e| Failed::from(format!("cannot run {}: {e}", go.display())))?;
    if !out.success() {
        let _ = fs::remove_file(&tmp);
        return Err(Failed::from(format!(
            "building {} with {} failed ({}):\n{}{}",
            src.display(),
            go.display(),
            out.status_text(),
            out.stdout,
            out.stderr
        )));
    }
    fs::rename(&tmp, &bin).map_err(|e| Failed::from(format!("rename {}: {e}", tmp.display())))?;
    Ok(bin)
}

// ---------------------------------------------------------------------------
// One run of one program (the run itself is common::run's).

/// Starts `cmd` as trial `name` of `mode`.
fn start(suite: &Suite, name: &str, mode: Mode, cmd: Command) -> Result<Run, Failed> {
    let (trial, dir) = match mode {
        Mode::CheckpointRestore => (name.to_owned(), name.to_owned()),
        Mode::Migrate => (format!("migrate::{name}"), format!("{name}.migrate")),
    };
    Run::start(&suite.harness, &trial, &dir, cmd)
}

/// `ferry checkpoint` (which kills the tree); then wait until the whole tree is gone and
/// reaped, so that restore can have the PIDs back.
fn checkpoint(run: &mut Run, round: u32) -> Result<(), Failed> {
    let ck = run.checkpoint(round, &["--json"])?;
    if !ck.success() {
        let why = run.why_failed(&format!("ferry checkpoint (round {round})"), &ck);
        return Err(run.report(&why));
    }
    run.wait_tree_gone(round)
}

/// `ferry migrate`, hop `hop` of [`MIG_HOPS`], which must succeed.
fn migrate(suite: &Suite, run: &mut Run, hop: u32) -> Result<(), Failed> {
    let (hop, out) = run.migrate(&suite.harness, hop)?;
    if !out.success() {
        let why = run.why_failed("ferry migrate", &out);
        return Err(hop.fail(run, &why));
    }
    run.follow_migration(&hop, &out)
}

/// One move of the program: checkpoint and restore, or a migration to the next node.
fn move_once(suite: &Suite, run: &mut Run, mode: Mode, round: u32) -> Result<(), Failed> {
    match mode {
        Mode::CheckpointRestore => {
            checkpoint(run, round)?;
            run.restore(round)
        }
        Mode::Migrate => migrate(suite, run, round),
    }
}

// ---------------------------------------------------------------------------
// The common course of a trial.

/// How far a program has got; `None` while it has not said.
type Probe = fn(&Run) -> Option<u64>;

/// The N of the last "progress N" line in the log.
fn log_progress(run: &Run) -> Option<u64> {
    let log = fs::read(run.file("log")).ok()?;
    let log = String::from_utf8_lossy(tail(&log, 64 * 1024)).into_owned();
    log.lines()
        .rev()
        .find_map(|l| l.strip_prefix("progress ")?.trim().parse().ok())
}

/// For each round of `mode` (twice checkpoint and restore, or three hops of
/// migration): let the program work (fresh progress, then `WORK_TIME` more),
/// move it, and require it to get further than it was when moved.
fn work_and_move(suite: &Suite, run: &mut Run, probe: Probe, mode: Mode) -> Result<(), Failed> {
    let mut last = 0;
    for round in 1..=mode.rounds() {
        let what = if round == 1 {
            format!("progress report before {}", mode.step(round))
        } else {
            format!("progress report beyond {last} before {}", mode.step(round))
        };
        run.wait_for(&what, PROGRESS_TIMEOUT, |r| {
            Ok(probe(r).filter(|&p| p > last))
        })?;
        sleep(WORK_TIME);
        let at = match mode {
            Mode::CheckpointRestore => {
                checkpoint(run, round)?;
                // The tree is gone: this is where it stood.
                let at = probe(run).unwrap_or(0);
                run.restore(round)?;
                at
            }
            Mode::Migrate => {
                migrate(suite, run, round)?;
                // The copy runs already: it stood at most here, and must get further.
                probe(run).unwrap_or(0)
            }
        };
        let what = format!(
            "progress after {} (the program was at {at} when moved)",
            mode.step(round)
        );
        last = run.wait_for(
            &what,
            PROGRESS_TIMEOUT,
            |r| Ok(probe(r).filter(|&p| p > at)),
        )?;
    }
    Ok(())
}

/// Programs that follow the ready / progress / go / result protocol.
fn protocol_trial(suite: &Suite, name: &str, mode: Mode, cmd: Command) -> Result<(), Failed> {
    let mut run = start(suite, name, mode, cmd)?;
    run.wait_ready()?;
    work_and_move(suite, &mut run, log_progress, mode)?;
    run.touch("go")?;
    run.wait_pass(RESULT_TIMEOUT)?;
    run.finish()
}

// ---------------------------------------------------------------------------
// The trials.

fn python_compute(suite: &Suite, mode: Mode) -> Result<(), Failed> {
    let mut cmd = Command::new(find_python()?);
    cmd.arg(suite.real_dir.join("python/compute.py"));
    protocol_trial(suite, "python_compute", mode, cmd)
}

fn python_threads(suite: &Suite, mode: Mode) -> Result<(), Failed> {
    let mut cmd = Command::new(find_python()?);
    cmd.arg(suite.real_dir.join("python/threads.py"));
    protocol_trial(suite, "python_threads", mode, cmd)
}

fn go_ticker(suite: &Suite, mode: Mode) -> Result<(), Failed> {
    let bin = build_go_ticker(suite)?;
    protocol_trial(suite, "go_ticker", mode, Command::new(bin))
}

// --- bash pipeline -----------------------------------------------------------

/// Every 100000 lines the last stage prints "n s m" (lines so far, their sum
/// modulo P, the sum of the `n % 7` column) and checks for `T/stop`; when it
/// is there it prints "END n" and exits, and the stages before it die of
/// SIGPIPE.  Bash records every stage's status in `T/status`.
const PIPELINE: &str = r#"
seq 1 1000000000 | awk '{ print $1, $1 % 7 }' | sed 's/ / x /' | awk '
{
  n++
  if ($1 != n || $2 != "x" || $3 != n % 7) { printf "BROKEN at line %d: %s\n", n, $0; exit 3 }
  s = (s + $1) % 1000000007
  m += $3
  if (n % 100000 == 0) {
    printf "%d %d %d\n", n, s, m
    fflush()
    if ((getline stop < "stop") >= 0) { printf "END %d\n", n; exit 0 }
    close("stop")
  }
}' > out
echo "${PIPESTATUS[*]}" > status
"#;
const PIPELINE_STEP: u64 = 100_000;
const PIPELINE_P: u64 = 1_000_000_007;

/// The n of the last complete "n s m" line of `T/out`.
fn pipeline_progress(run: &Run) -> Option<u64> {
    let out = fs::read(run.file("out")).ok()?;
    let out = String::from_utf8_lossy(tail(&out, 4096)).into_owned();
    let complete = &out[..out.rfind('\n')?];
    complete
        .lines()
        .rev()
        .find_map(|l| l.split_whitespace().next()?.parse().ok())
}

/// Check every line of the pipeline's output; `Ok(lines)` when all agree.
fn check_pipeline_output(out: &str) -> Result<u64, String> {
    let mut k = 0u64;
    let mut ended = false;
    for (i, line) in out.lines().enumerate() {
        let lineno = i + 1;
        if ended {
            return Err(format!("line {lineno} {line:?} comes after END"));
        }
        if let Some(rest) = line.strip_prefix("END ") {
            if rest.trim().parse::<u64>().ok() != Some(k * PIPELINE_STEP) {
                return Err(format!(
                    "line {lineno} {line:?}: END should name {}, the last count",
                    k * PIPELINE_STEP
                ));
            }
            ended = true;
            continue;
        }
        let f: Vec<u64> = line
            .split_whitespace()
            .map(|x| x.parse::<u64>())
            .collect::<Result<_, _>>()
            .map_err(|_| format!("line {lineno} is not three numbers: {line:?}"))?;
        k += 1;
        let n = k * PIPELINE_STEP;
        let s = ((n as u128 * (n as u128 + 1) / 2) % PIPELINE_P as u128) as u64;
        let m = n / 7 * 21 + (1..=n % 7).sum::<u64>();
        if f != [n, s, m] {
            return Err(format!(
                "line {lineno}: expected \"{n} {s} {m}\" (line count, sum mod P, sum of n%7), \
                 got {line:?}: lines of the stream were lost, repeated or changed"
            ));
        }
    }
    if !ended {
        return Err(format!("no END line after {k} report lines"));
    }
    Ok(k * PIPELINE_STEP)
}

fn bash_pipeline(suite: &Suite, mode: Mode) -> Result<(), Failed> {
    let bash = find_tool("bash", "bash")?;
    for (tool, package) in [("seq", "coreutils"), ("awk", "mawk"), ("sed", "sed")] {
        find_tool(tool, package)?;
    }
    let mut cmd = Command::new(bash);
    cmd.arg("-c").arg(PIPELINE);
    let mut run = start(suite, "bash_pipeline", mode, cmd)?;
    // Five processes: bash and the four stages.
    run.wait_for("the pipeline's first report", READY_TIMEOUT, |r| {
        Ok(pipeline_progress(r))
    })?;
    let procs = tree_pids(run.root).len();
    if procs != 5 {
        return Err(run.report(&format!(
            "expected 5 processes (bash and four stages), found {procs}"
        )));
    }
    work_and_move(suite, &mut run, pipeline_progress, mode)?;
    run.touch("stop")?;
    // Migrated, bash is not our child: its status is not ours to see, but it records every
    // stage's, checked below.
    let status = if run.in_ns {
        wait_gone(run.host, PROGRESS_TIMEOUT).then(|| ExitStatus::from_raw(0))
    } else {
        run.wait_root_exit(PROGRESS_TIMEOUT)
    };
    match status {
        Some(st) if st.success() => {}
        Some(st) => return Err(run.report(&format!("bash exited with {st} after stop"))),
        None => {
            return Err(run.report(&format!(
                "the pipeline did not finish within {PROGRESS_TIMEOUT:?} after stop (a stage \
                 blocked on a pipe whose other end should be closed?); processes left: {:?}",
                tree_pids(run.root)
            )))
        }
    }
    let out = fs::read_to_string(run.file("out")).unwrap_or_default();
    let lines = check_pipeline_output(&out)
        .map_err(|e| run.report(&format!("the pipeline's output is wrong: {e}")))?;
    let status = fs::read_to_string(run.file("status")).unwrap_or_default();
    let codes: Vec<&str> = status.split_whitespace().collect();
    // The last stage exits 0; the others die of SIGPIPE (141) or, if they
    // happened to finish first, exit 0.
    let ok =
        codes.len() == 4 && codes[3] == "0" && codes[..3].iter().all(|c| *c == "141" || *c == "0");
    if !ok {
        return Err(run.report(&format!(
            "stage exit statuses are {:?}, expected the last 0 and the others 141 (SIGPIPE)",
            status.trim()
        )));
    }
    if lines == 0 {
        return Err(run.report("the pipeline reported no lines"));
    }
    if run.in_ns {
        run.require_gone("finished")?;
    }
    run.finish()
}

// --- redis -------------------------------------------------------------------

struct Redis {
    cli: PathBuf,
    port: u16,
}

impl Redis {
    /// `redis-cli -h 127.0.0.1 -p PORT ARGS` with `input` on stdin, on the node where
    /// redis-server runs now: in its network namespace (a separate node's is not ours).
    fn cli(
        &self,
        run: &mut Run,
        label: &str,
        args: &[&str],
        input: Option<&[u8]>,
    ) -> Result<CmdOutput, Failed> {
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net=/proc/{}/ns/net", run.host))
            .arg("--")
            .arg(&self.cli)
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(args);
        run.command(label, cmd, input, TOOL_TIMEOUT)
    }

    /// Run the commands (one a line) and require exactly `expected` replies.
    fn expect(
        &self,
        run: &mut Run,
        label: &str,
        commands: &[String],
        expected: &[String],
    ) -> Result<(), Failed> {
        let input = commands.join("\n") + "\n";
        let out = self.cli(run, label, &[], Some(input.as_bytes()))?;
        if !out.success() {
            return Err(run.report(&format!(
                "redis-cli ({label}) failed ({}): {}",
                out.status_text(),
                out.stderr_summary()
            )));
        }
        let got: Vec<&str> = out.stdout.lines().collect();
        let mut wrong = Vec::new();
        for (i, cmd) in commands.iter().enumerate() {
            let g = got.get(i).copied().unwrap_or("<no reply>");
            if g != expected[i] {
                wrong.push(format!(
                    "{:?} -> {g:?}, expected {:?}",
                    shorten(cmd),
                    expected[i]
                ));
            }
        }
        if got.len() != commands.len() {
            wrong.push(format!(
                "{} replies to {} commands",
                got.len(),
                commands.len()
            ));
        }
        if !wrong.is_empty() {
            let n = wrong.len();
            wrong.truncate(8);
            return Err(run.report(&format!(
                "redis ({label}) gave {n} wrong replies: {}",
                wrong.join("; ")
            )));
        }
        Ok(())
    }

    fn wait_pong(&self, run: &mut Run, when: &str) -> Result<(), Failed> {
        let start = Instant::now();
        loop {
            let out = self.cli(run, "ping", &["PING"], None)?;
            if out.success() && out.stdout.trim() == "PONG" {
                // Only the last attempt matters in failure messages.
                return Ok(());
            }
            if !run.root_alive() {
                return Err(run.report(&format!("redis-server died {when}{}", run.exit_note())));
            }
            if start.elapsed() > READY_TIMEOUT {
                return Err(run.report(&format!(
                    "redis-server does not answer PING {when} (waited {READY_TIMEOUT:?}): {}",
                    out.stderr_summary()
                )));
            }
            sleep(Duration::from_millis(100));
        }
    }
}

fn shorten(s: &str) -> String {
    if s.len() <= 80 {
        s.to_owned()
    } else {
        let mut cut = 80;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        format!("{}...", &s[..cut])
    }
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

const REDIS_KEYS: u64 = 3000;
const REDIS_ROUND_KEYS: u64 = 200;
const REDIS_BIG: usize = 2 << 20;

/// The string keys written before the checkpoints (round 0) and after
/// restore `round`.
fn redis_keys(round: u32) -> Vec<(String, String)> {
    let (prefix, n) = if round == 0 {
        ("key".to_string(), REDIS_KEYS)
    } else {
        (format!("round{round}"), REDIS_ROUND_KEYS)
    };
    (0..n)
        .map(|i| {
            let v = splitmix(i ^ (u64::from(round) << 32));
            (format!("{prefix}:{i}"), format!("v{i}-{v:016x}"))
        })
        .collect()
}

fn redis_big_value() -> Vec<u8> {
    let mut x = 7u64;
    (0..REDIS_BIG)
        .map(|_| {
            x = splitmix(x);
            b'a' + (x % 26) as u8
        })
        .collect()
}

/// Write round `round`'s data.
fn redis_write(redis: &Redis, run: &mut Run, round: u32) -> Result<(), Failed> {
    let mut cmds = Vec::new();
    let mut want = Vec::new();
    for (k, v) in redis_keys(round) {
        cmds.push(format!("SET {k} {v}"));
        want.push("OK".to_string());
    }
    if round == 0 {
        let fields: Vec<String> = (0..200).map(|i| format!("field{i} val{i}")).collect();
        cmds.push(format!("HSET hash {}", fields.join(" ")));
        want.push("200".into());
        let items: Vec<String> = (0..500).map(|i| format!("item{i}")).collect();
        cmds.push(format!("RPUSH list {}", items.join(" ")));
        want.push("500".into());
        let members: Vec<String> = (0..300).map(|i| format!("m{i}")).collect();
        cmds.push(format!("SADD set {}", members.join(" ")));
        want.push("300".into());
        cmds.push("SET ttlkey alive EX 3600".into());
        want.push("OK".into());
        cmds.push("INCRBY counter 1000".into());
        want.push("1000".into());
    } else {
        cmds.push(format!("INCRBY counter {round}"));
        want.push(redis_counter(round).to_string());
    }
    redis.expect(run, &format!("write{round}"), &cmds, &want)?;
    if round == 0 {
        let big = redis_big_value();
        let out = redis.cli(run, "write-big", &["-x", "SET", "big"], Some(&big))?;
        if !out.success() || out.stdout.trim() != "OK" {
            return Err(run.report(&format!(
                "redis-cli -x SET big ({} bytes) failed ({}): {}",
                big.len(),
                out.status_text(),
                out.stderr_summary()
            )));
        }
    }
    Ok(())
}

fn redis_counter(round: u32) -> u64 {
    1000 + (1..=u64::from(round)).sum::<u64>()
}

/// Everything written up to and including round `round` must be there.
fn redis_verify(redis: &Redis, run: &mut Run, round: u32, label: &str) -> Result<(), Failed> {
    let mut cmds = Vec::new();
    let mut want = Vec::new();
    for r in 0..=round {
        for (k, v) in redis_keys(r) {
            cmds.push(format!("GET {k}"));
            want.push(v);
        }
    }
    let keys = REDIS_KEYS + REDIS_ROUND_KEYS * u64::from(round) + 6;
    for (c, w) in [
        ("DBSIZE".to_string(), keys.to_string()),
        ("HLEN hash".into(), "200".into()),
        ("HGET hash field123".into(), "val123".into()),
        ("LLEN list".into(), "500".into()),
        ("LINDEX list 321".into(), "item321".into()),
        ("SCARD set".into(), "300".into()),
        ("SISMEMBER set m42".into(), "1".into()),
        ("GET ttlkey".into(), "alive".into()),
        ("GET counter".into(), redis_counter(round).to_string()),
        ("STRLEN big".into(), REDIS_BIG.to_string()),
    ] {
        cmds.push(c);
        want.push(w);
    }
    redis.expect(run, label, &cmds, &want)?;
    let out = redis.cli(run, &format!("{label}-big"), &["GET", "big"], None)?;
    let big = redis_big_value();
    if !out.success() || out.stdout.trim_end().as_bytes() != big.as_slice() {
        return Err(run.report(&format!(
            "redis ({label}): GET big did not return the {} bytes written ({}, {} bytes back)",
            big.len(),
            out.status_text(),
            out.stdout.trim_end().len()
        )));
    }
    Ok(())
}

fn free_port() -> Result<u16, Failed> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")
        .map_err(|e| Failed::from(format!("cannot find a free port: {e}")))?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(|e| Failed::from(format!("cannot find a free port: {e}")))
}

fn redis_data(suite: &Suite, mode: Mode) -> Result<(), Failed> {
    let server = find_tool("redis-server", "redis-server")?;
    let cli = find_tool("redis-cli", "redis-tools")?;
    let port = free_port()?;
    let mut cmd = Command::new(server);
    cmd.args(["--bind", "127.0.0.1", "--port", &port.to_string()])
        .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
        .args(["--logfile", "", "--dir", "."]);
    let mut run = start(suite, "redis_data", mode, cmd)?;
    let redis = Redis { cli, port };
    redis.wait_pong(&mut run, "after start")?;
    redis_write(&redis, &mut run, 0)?;
    redis_verify(&redis, &mut run, 0, "verify0")?;
    for round in 1..=mode.rounds() {
        sleep(WORK_TIME);
        move_once(suite, &mut run, mode, round)?;
        redis.wait_pong(&mut run, &format!("after {}", mode.step(round)))?;
        redis_verify(
            &redis,
            &mut run,
            round - 1,
            &format!("verify-after-move{round}"),
        )?;
        redis_write(&redis, &mut run, round)?;
        redis_verify(&redis, &mut run, round, &format!("verify{round}"))?;
    }
    let out = redis.cli(&mut run, "shutdown", &["SHUTDOWN", "NOSAVE"], None)?;
    if !out.stdout.trim().is_empty() {
        return Err(run.report(&format!(
            "SHUTDOWN NOSAVE answered {:?} ({})",
            out.stdout.trim(),
            out.stderr_summary()
        )));
    }
    run.require_clean_exit("was asked to SHUTDOWN NOSAVE")?;
    run.finish()
}
