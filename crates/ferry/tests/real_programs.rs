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
//! each hop; redis-server's listening socket comes along (its port is still
//! held by the frozen original while the copy is rebuilt on the same machine:
//! see docs/limitations.md).  After the first hop the root is no longer our
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

use std::fmt::Write as _;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::sleep;
use std::time::{Duration, Instant};

mod common;

use common::cluster::{self, Cluster};
use common::*;
use libtest_mimic::{Arguments, Failed, Trial};

/// The machine is small and shared: generous limits, tight polling.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
const PROGRESS_TIMEOUT: Duration = Duration::from_secs(30);
const RESULT_TIMEOUT: Duration = Duration::from_secs(120);
const FERRY_TIMEOUT: Duration = Duration::from_secs(120);
const TOOL_TIMEOUT: Duration = Duration::from_secs(60);
const BUILD_TIMEOUT: Duration = Duration::from_secs(300);
const EXIT_TIMEOUT: Duration = Duration::from_secs(10);
const TREE_GONE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a program works between seeing progress and the checkpoint, so
/// that it is caught in the middle of its work.
const WORK_TIME: Duration = Duration::from_millis(500);
const LOG_TAIL: usize = 8 * 1024;
/// A guest init exits within a second of being alone (it looks once a second).
const INIT_GONE_TIMEOUT: Duration = Duration::from_secs(5);
/// The hops of a `migrate::` trial: around the cluster and home again.
const MIG_HOPS: [(&str, &str); 3] = [("a", "b"), ("b", "c"), ("c", "a")];

struct Suite {
    real_dir: PathBuf,
    bin_dir: PathBuf,
    runs_dir: PathBuf,
    ferry: PathBuf,
    keep: bool,
    /// The local cluster of the `migrate::` trials: started by the first of them (or why it
    /// could not be), stopped before the harness exits.
    cluster: Mutex<Option<Result<Cluster, String>>>,
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
    let mut args = Arguments::from_args();
    // Restore needs the original PIDs free: never run two trials at once.
    args.test_threads = Some(1);

    // Restored processes are detached by `ferry restore`; as a subreaper we
    // become their parent, so we can reap them and nothing is left behind.
    // SAFETY: prctl with integer arguments only changes this process's flag.
    let rc = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    if rc != 0 {
        eprintln!(
            "real_programs: PR_SET_CHILD_SUBREAPER failed: {}",
            io::Error::last_os_error()
        );
    }

    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let root = root.canonicalize().unwrap_or(root);
    let work = option_env!("CARGO_TARGET_TMPDIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir)
        .join("real_programs");
    let runs_root = work.join("runs");
    clear_stale_runs(&runs_root);
    let suite = Arc::new(Suite {
        real_dir: root.join("tests/real"),
        bin_dir: work.join("bin"),
        runs_dir: runs_root.join(std::process::id().to_string()),
        ferry: std::env::var_os("FERRY_REAL_FERRY")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_ferry"))),
        keep: std::env::var_os("FERRY_REAL_KEEP").is_some_and(|v| !v.is_empty() && v != "0"),
        cluster: Mutex::new(None),
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
    // `exit` runs no destructors: stop the cluster first.
    let cluster = suite
        .cluster
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take();
    drop(cluster);
    let _ = fs::remove_dir(&suite.runs_dir); // only if nothing was kept
    conclusion.exit();
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
    fs::create_dir_all(&suite.bin_dir)
        .map_err(|e| Failed::from(format!("mkdir {}: {e}", suite.bin_dir.display())))?;
    let bin = suite.bin_dir.join("go-ticker");
    // Build to a private name, then rename: another harness may be running
    // the binary right now.
    let tmp = suite
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
        let gohome = suite.bin_dir.join("go-home");
        if std::env::var_os("GOCACHE").is_none() {
            cmd.env("GOCACHE", gohome.join("cache"));
        }
        if std::env::var_os("GOPATH").is_none() {
            cmd.env("GOPATH", gohome.join("path"));
        }
    }
    let out = run_with_timeout(cmd, None, &suite.bin_dir, "go-build", BUILD_TIMEOUT)
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
// Running commands with a time limit.

struct CmdOutput {
    /// None: killed at the time limit.
    status: Option<ExitStatus>,
    stdout: String,
    stderr: String,
    elapsed: Duration,
    timeout: Duration,
}

impl CmdOutput {
    fn success(&self) -> bool {
        self.status.is_some_and(|s| s.success())
    }

    fn status_text(&self) -> String {
        match self.status {
            Some(st) => st.to_string(),
            None => format!("killed after {:?}", self.timeout),
        }
    }

    /// The non-empty lines of stderr, joined: a one-line summary.
    fn stderr_summary(&self) -> String {
        let s: Vec<&str> = self
            .stderr
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect();
        let mut s = s.join(" / ");
        if s.len() > 600 {
            let mut cut = 600;
            while !s.is_char_boundary(cut) {
                cut -= 1;
            }
            s.truncate(cut);
            s.push_str(" ...");
        }
        if s.is_empty() {
            "(nothing on stderr)".into()
        } else {
            s
        }
    }
}

/// Run `cmd` with stdout and stderr to files `dir/label.{stdout,stderr}` and
/// stdin from `input` (else /dev/null); kill it at `timeout`.
fn run_with_timeout(
    mut cmd: Command,
    input: Option<&[u8]>,
    dir: &Path,
    label: &str,
    timeout: Duration,
) -> io::Result<CmdOutput> {
    let out_path = dir.join(format!("{label}.stdout"));
    let err_path = dir.join(format!("{label}.stderr"));
    cmd.stdout(File::create(&out_path)?)
        .stderr(File::create(&err_path)?);
    match input {
        Some(data) => {
            let in_path = dir.join(format!("{label}.stdin"));
            fs::write(&in_path, data)?;
            cmd.stdin(File::open(&in_path)?);
        }
        None => {
            cmd.stdin(Stdio::null());
        }
    }
    let started = Instant::now();
    let mut child = cmd.spawn()?;
    let status = loop {
        match child.try_wait()? {
            Some(st) => break Some(st),
            None if started.elapsed() > timeout => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            None => sleep(Duration::from_millis(5)),
        }
    };
    Ok(CmdOutput {
        status,
        stdout: fs::read_to_string(&out_path).unwrap_or_default(),
        stderr: fs::read_to_string(&err_path).unwrap_or_default(),
        elapsed: started.elapsed(),
        timeout,
    })
}

// ---------------------------------------------------------------------------
// One run of one program.

/// A program under test: its directories, what happened so far (for failure
/// messages), and cleanup of its whole tree.
struct Run {
    name: String,
    /// images, ferry's and the tools' outputs
    base: PathBuf,
    /// the program's working directory
    t: PathBuf,
    /// The root's PID as the program sees it (getpid()).
    root: i32,
    /// The root's PID here: `root`, until it is migrated into a guest namespace.
    host: i32,
    /// Whether the root lives in a guest namespace (and is no longer our child).
    in_ns: bool,
    /// Host PIDs of the guest inits of the namespaces it has lived in.
    inits: Vec<i32>,
    child: Option<Child>,
    /// exit status of the root, once seen
    exited: Option<ExitStatus>,
    /// commands run so far (ferry, redis-cli...) with their outputs
    history: String,
    keep: bool,
    commands: u32,
}

impl Run {
    fn start(suite: &Suite, name: &str, mode: Mode, mut cmd: Command) -> Result<Run, Failed> {
        let base = suite.runs_dir.join(match mode {
            Mode::CheckpointRestore => name.to_string(),
            Mode::Migrate => format!("{name}.migrate"),
        });
        let _ = fs::remove_dir_all(&base);
        let t = base.join("t");
        fs::create_dir_all(&t).map_err(|e| format!("mkdir {}: {e}", t.display()))?;
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(t.join("log"))
            .map_err(|e| format!("open log: {e}"))?;
        let log2 = log.try_clone().map_err(|e| format!("dup log: {e}"))?;
        cmd.current_dir(&t)
            .env("FERRY_TEST_DIR", &t)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2);
        // SAFETY: the closure runs in the forked child before exec and only
        // calls setsid(), which is async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                if libc::setsid() < 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd
            .spawn()
            .map_err(|e| format!("cannot start {:?}: {e}", cmd.get_program()))?;
        let root = child.id() as i32;
        Ok(Run {
            name: match mode {
                Mode::CheckpointRestore => name.to_owned(),
                Mode::Migrate => format!("migrate::{name}"),
            },
            base,
            t,
            root,
            host: root,
            in_ns: false,
            inits: Vec::new(),
            child: Some(child),
            exited: None,
            history: String::new(),
            keep: suite.keep,
            commands: 0,
        })
    }

    fn file(&self, name: &str) -> PathBuf {
        self.t.join(name)
    }

    /// A failure: what went wrong first, then the result file, the commands
    /// run so far with their outputs, and the program's log.
    fn report(&self, what: &str) -> Failed {
        let mut msg = format!("{}: {what}\n", self.name);
        if let Ok(r) = fs::read_to_string(self.file("result")) {
            let _ = writeln!(msg, "--- result: {}", r.trim_end());
        }
        msg.push_str(&self.history);
        let log = fs::read(self.file("log")).unwrap_or_default();
        let log = String::from_utf8_lossy(tail(&log, LOG_TAIL));
        let _ = write!(
            msg,
            "--- {} (last {} KiB):\n{}",
            self.file("log").display(),
            LOG_TAIL / 1024,
            with_newline(log.as_bytes())
        );
        let _ = write!(
            msg,
            "--- run directory kept: {}\n=> {}: {what}",
            self.base.display(),
            self.name
        );
        Failed::from(msg)
    }

    /// Run a tool (ferry, redis-cli) with a time limit; its outputs go into
    /// the history for failure messages.
    fn command(
        &mut self,
        label: &str,
        cmd: Command,
        input: Option<&[u8]>,
        timeout: Duration,
    ) -> Result<CmdOutput, Failed> {
        self.commands += 1;
        let label = format!("{:02}-{label}", self.commands);
        let line = format!(
            "{} {}",
            cmd.get_program().to_string_lossy(),
            cmd.get_args()
                .map(|a| a.to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join(" ")
        );
        let out = run_with_timeout(cmd, input, &self.base, &label, timeout)
            .map_err(|e| self.report(&format!("cannot run {line}: {e}")))?;
        // Whole outputs stay in the run directory; the message shows those
        // of failed commands, and short ones.
        let _ = writeln!(
            self.history,
            "--- {line} ({}, {:.2} s; outputs in {label}.*)",
            out.status_text(),
            out.elapsed.as_secs_f64(),
        );
        for (name, text) in [("stdout", &out.stdout), ("stderr", &out.stderr)] {
            if !text.is_empty() && (!out.success() || text.len() <= 300) {
                let _ = write!(
                    self.history,
                    "--- {name}:\n{}",
                    with_newline(tail(text.as_bytes(), LOG_TAIL))
                );
            }
        }
        Ok(out)
    }

    fn ferry(&mut self, suite: &Suite, label: &str, args: &[&str]) -> Result<CmdOutput, Failed> {
        let mut cmd = Command::new(&suite.ferry);
        cmd.args(args);
        self.command(label, cmd, None, FERRY_TIMEOUT)
    }

    /// Forget the std `Child` once it has exited (or was reaped by
    /// `reap_zombies`, which makes `try_wait` fail with ECHILD).
    fn poll_child(&mut self) {
        if let Some(c) = self.child.as_mut() {
            match c.try_wait() {
                Ok(None) => {}
                Ok(Some(st)) => {
                    self.exited = Some(st);
                    self.child = None;
                }
                Err(_) => self.child = None,
            }
        }
    }

    /// " (exit status ...)" if the root's exit has been seen, else "".
    fn exit_note(&self) -> String {
        self.exited.map(|st| format!(" ({st})")).unwrap_or_default()
    }

    /// Is the root process still running (not gone, not a zombie)?
    fn root_alive(&mut self) -> bool {
        self.poll_child();
        match proc_state(self.host) {
            Some('Z') | Some('X') => {
                if self.child.is_none() && self.exited.is_none() && !self.in_ns {
                    // A restored root is our child by reparenting: note how it ended.
                    let mut status = 0;
                    // SAFETY: waitpid on a pid with a valid pointer to a local int.
                    if unsafe { libc::waitpid(self.root, &mut status, libc::WNOHANG) } == self.root
                    {
                        self.exited = Some(ExitStatus::from_raw(status));
                    }
                }
                false
            }
            Some(_) => true,
            None => false,
        }
    }

    /// Poll `probe` until it gives a value; fail if the program dies or time
    /// runs out.
    fn wait_for<T>(
        &mut self,
        what: &str,
        timeout: Duration,
        mut probe: impl FnMut(&mut Run) -> Result<Option<T>, Failed>,
    ) -> Result<T, Failed> {
        let start = Instant::now();
        loop {
            if let Some(v) = probe(self)? {
                return Ok(v);
            }
            if !self.root_alive() {
                return Err(self.report(&format!(
                    "the program died while waiting for {what}{}",
                    self.exit_note()
                )));
            }
            if start.elapsed() > timeout {
                return Err(self.report(&format!("no {what} within {timeout:?}")));
            }
            sleep(Duration::from_millis(10));
        }
    }

    /// Wait for `T/ready`; it must name the root pid.
    fn wait_ready(&mut self) -> Result<(), Failed> {
        let text = self.wait_for("ready file", READY_TIMEOUT, |r| {
            Ok(fs::read_to_string(r.file("ready")).ok())
        })?;
        match text.trim().parse::<i32>() {
            Ok(pid) if pid == self.root => Ok(()),
            _ => Err(self.report(&format!(
                "ready file says {:?}, expected pid {}",
                text.trim(),
                self.root
            ))),
        }
    }

    /// `ferry checkpoint` (which kills the tree); then wait until the whole
    /// tree is gone and reaped, so that restore can have the PIDs back.
    fn checkpoint(&mut self, suite: &Suite, round: u32) -> Result<(), Failed> {
        let img = self.base.join(format!("img{round}"));
        let _ = fs::remove_dir_all(&img);
        let img_s = img.to_string_lossy().into_owned();
        let pid_s = self.root.to_string();
        let ck = self.ferry(
            suite,
            &format!("checkpoint{round}"),
            &["checkpoint", &pid_s, "--dir", &img_s, "--json"],
        )?;
        if !ck.success() {
            let fate = if self.root_alive() {
                "the program is still running".to_string()
            } else {
                format!("the program did not survive it{}", self.exit_note())
            };
            return Err(self.report(&format!(
                "ferry checkpoint (round {round}) failed ({}): {}\n({fate})",
                ck.status_text(),
                ck.stderr_summary()
            )));
        }
        let start = Instant::now();
        loop {
            self.poll_child();
            reap_zombies();
            let left: Vec<i32> = tree_pids(self.root).into_iter().collect();
            if left.is_empty() && self.child.is_none() {
                self.exited = None; // that was the checkpointed incarnation
                return Ok(());
            }
            if start.elapsed() > TREE_GONE_TIMEOUT {
                return Err(self.report(&format!(
                    "checkpoint (round {round}) succeeded but processes are still there after \
                     {TREE_GONE_TIMEOUT:?}: {left:?}"
                )));
            }
            sleep(Duration::from_millis(5));
        }
    }

    /// `ferry restore` from round `round`'s image: the root must come back
    /// with its PID and be running.
    fn restore(&mut self, suite: &Suite, round: u32) -> Result<(), Failed> {
        let img = self.base.join(format!("img{round}"));
        let img_s = img.to_string_lossy().into_owned();
        let rs = self.ferry(
            suite,
            &format!("restore{round}"),
            &["restore", "--dir", &img_s],
        )?;
        if !rs.success() {
            return Err(self.report(&format!(
                "ferry restore (round {round}) failed ({}): {}",
                rs.status_text(),
                rs.stderr_summary()
            )));
        }
        let last = rs
            .stdout
            .lines()
            .map(str::trim)
            .rfind(|l| !l.is_empty())
            .unwrap_or("");
        match last.parse::<i32>() {
            Ok(pid) if pid == self.root => {}
            Ok(pid) => {
                return Err(self.report(&format!(
                    "restore (round {round}) gave root pid {pid}, expected {}",
                    self.root
                )))
            }
            Err(_) => {
                return Err(self.report(&format!(
                "restore (round {round}): last line of stdout is {last:?}, expected the root pid"
            )))
            }
        }
        if !self.root_alive() {
            return Err(self.report(&format!(
                "root pid {} is not running right after restore (round {round}){}",
                self.root,
                self.exit_note()
            )));
        }
        Ok(())
    }

    fn touch(&self, name: &str) -> Result<(), Failed> {
        File::create(self.file(name))
            .map_err(|e| self.report(&format!("cannot create {name}: {e}")))?;
        Ok(())
    }

    /// Wait for the verdict; require PASS and a clean exit of the root.
    fn wait_pass(&mut self) -> Result<(), Failed> {
        let mut dead_since: Option<Instant> = None;
        let start = Instant::now();
        let verdict = loop {
            if let Ok(text) = fs::read_to_string(self.file("result")) {
                break text;
            }
            if !self.root_alive() {
                // The verdict is written before exit; allow a moment for the rename.
                let since = *dead_since.get_or_insert_with(Instant::now);
                if since.elapsed() > Duration::from_millis(300) {
                    return Err(self.report(&format!(
                        "the program exited without a verdict{}",
                        self.exit_note()
                    )));
                }
            }
            if start.elapsed() > RESULT_TIMEOUT {
                return Err(self.report(&format!("no result within {RESULT_TIMEOUT:?} of go")));
            }
            sleep(Duration::from_millis(10));
        };
        if verdict.trim_end() != "PASS" {
            return Err(self.report(&format!(
                "the program checked its state and did not pass: {}",
                verdict.trim_end()
            )));
        }
        self.require_clean_exit("said PASS")
    }

    /// The root exits with status 0 (migrated: the root, and every guest namespace it lived
    /// in, are gone; its status went to its namespace's init).
    fn require_clean_exit(&mut self, after: &str) -> Result<(), Failed> {
        if self.in_ns {
            return self.require_gone(after);
        }
        match self.wait_root_exit(EXIT_TIMEOUT) {
            Some(st) if st.success() => Ok(()),
            Some(st) => Err(self.report(&format!("the program {after} but exited with {st}"))),
            None => Err(self.report(&format!(
                "the program {after} but did not exit within {EXIT_TIMEOUT:?}"
            ))),
        }
    }

    /// A migrated tree is gone: its root, and the init of each namespace it lived in (an init
    /// leaves once nothing else is left in its namespace).
    fn require_gone(&mut self, after: &str) -> Result<(), Failed> {
        if !wait_gone(self.host, EXIT_TIMEOUT) {
            return Err(self.report(&format!(
                "the program {after} but did not exit within {EXIT_TIMEOUT:?}"
            )));
        }
        for init in self.inits.clone() {
            if !wait_gone(init, INIT_GONE_TIMEOUT) {
                return Err(self.report(&format!(
                    "the program {after} and exited, but processes of its tree are left in the \
                     namespace of guest init {init}"
                )));
            }
        }
        Ok(())
    }

    /// One move of the program: checkpoint and restore, or a migration to the next node.
    fn move_once(&mut self, suite: &Suite, mode: Mode, round: u32) -> Result<(), Failed> {
        match mode {
            Mode::CheckpointRestore => {
                self.checkpoint(suite, round)?;
                self.restore(suite, round)
            }
            Mode::Migrate => self.migrate(suite, round),
        }
    }

    /// `ferry --node FROM migrate ROOT --to TO` for hop `hop` (1-based) of [`MIG_HOPS`]; then
    /// the copy it came from must be gone and the new one run under the tree's PID in a guest
    /// namespace, whose host PID (`dest_pid`) the harness follows from now on.
    fn migrate(&mut self, suite: &Suite, hop: u32) -> Result<(), Failed> {
        let dir = {
            let mut slot = suite.cluster.lock().unwrap_or_else(|e| e.into_inner());
            match slot.get_or_insert_with(|| Cluster::up_unadopted("real-programs", 3)) {
                Ok(c) => c.dir.clone(),
                Err(e) => return Err(self.report(e)),
            }
        };
        let (from, to) = MIG_HOPS[hop as usize - 1];
        let fail = |run: &Run, what: &str| {
            let f = run.report(&format!("migration {hop} ({from} -> {to}): {what}"));
            Failed::from(format!(
                "{}\n{}",
                f.message().unwrap_or(""),
                cluster::daemon_logs(&dir, &[from, to])
            ))
        };
        let mut cmd = Command::new(&suite.ferry);
        cmd.env("FERRY_CLUSTER_DIR", &dir)
            .env("FERRY_NODE", from)
            .args(["migrate", &self.root.to_string(), "--to", to, "--json"]);
        let out = self.command(&format!("migrate{hop}"), cmd, None, FERRY_TIMEOUT)?;
        if !out.success() {
            let fate = if self.root_alive() {
                "the program is still running where it was".to_string()
            } else {
                format!("the program did not survive it{}", self.exit_note())
            };
            return Err(fail(
                self,
                &format!(
                    "ferry migrate failed ({}): {} ({fate})",
                    out.status_text(),
                    out.stderr_summary()
                ),
            ));
        }
        let report: serde_json::Value = serde_json::from_str(&out.stdout)
            .map_err(|e| fail(self, &format!("bad JSON report: {e}")))?;
        let Some(dest) = report
            .get("dest_pid")
            .and_then(|v| v.as_i64())
            .map(|v| v as i32)
            .filter(|&p| p > 0)
        else {
            return Err(fail(self, "the report has no dest_pid"));
        };
        // The copy it came from is gone (on the first hop, our child: reaped here).
        let old = self.host;
        if !wait_gone(old, TREE_GONE_TIMEOUT) {
            return Err(fail(
                self,
                &format!("migrated, but the copy it left (PID {old}) still runs"),
            ));
        }
        self.poll_child();
        self.exited = None;
        self.host = dest;
        self.in_ns = true;
        let nspid = status_field(dest, "NSpid");
        let want = [dest.to_string(), self.root.to_string()];
        if nspid.split_whitespace().collect::<Vec<_>>() != want {
            return Err(fail(
                self,
                &format!(
                    "the root (PID {dest} here) has NSpid {nspid:?}, expected \"{dest} {}\"",
                    self.root
                ),
            ));
        }
        match parent_pid(dest) {
            Some(init) if is_guest_init(init) => self.inits.push(init),
            p => {
                return Err(fail(
                    self,
                    &format!("the root's parent (PID {p:?}) is not a guest init"),
                ))
            }
        }
        if !self.root_alive() {
            return Err(fail(self, &format!("the root (PID {dest}) is not running")));
        }
        Ok(())
    }

    /// Reap the root (our child, or reparented to us) and return its status.
    fn wait_root_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let start = Instant::now();
        loop {
            if self.child.is_some() {
                self.poll_child();
            } else if let Some(st) = self.exited {
                return Some(st);
            } else {
                let mut status = 0;
                // SAFETY: waitpid on a pid with a valid pointer to a local int.
                let r = unsafe { libc::waitpid(self.root, &mut status, libc::WNOHANG) };
                if r == self.root {
                    self.exited = Some(ExitStatus::from_raw(status));
                    continue;
                }
                if r < 0 {
                    // Not our child (yet?): fall back to watching /proc.
                    proc_state(self.root)?;
                }
            }
            if start.elapsed() > timeout {
                return None;
            }
            sleep(Duration::from_millis(5));
        }
    }

    /// Kill every process of the run (also after failures) and reap them.
    fn cleanup(&mut self) {
        let start = Instant::now();
        loop {
            if let Some(c) = self.child.as_mut() {
                let _ = c.kill();
            }
            self.poll_child();
            let mut pids = tree_pids(self.root);
            if self.host != self.root {
                pids.extend(tree_pids(self.host));
            }
            // A guest init's death takes every process of its namespace with it.
            pids.extend(self.inits.iter().copied().filter(|&p| is_guest_init(p)));
            for &pid in &pids {
                // SAFETY: kill() with a pid taken from /proc; worst case ESRCH.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            reap_zombies();
            if (pids.is_empty() && self.child.is_none())
                || start.elapsed() > Duration::from_secs(10)
            {
                break;
            }
            sleep(Duration::from_millis(5));
        }
        reap_zombies();
    }

    /// Passed: clean up, and drop the run directory unless asked to keep it.
    fn finish(mut self) -> Result<(), Failed> {
        self.cleanup();
        if !self.keep {
            let _ = fs::remove_dir_all(&self.base);
        }
        Ok(())
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        self.cleanup();
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
                run.checkpoint(suite, round)?;
                // The tree is gone: this is where it stood.
                let at = probe(run).unwrap_or(0);
                run.restore(suite, round)?;
                at
            }
            Mode::Migrate => {
                run.migrate(suite, round)?;
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
    let mut run = Run::start(suite, name, mode, cmd)?;
    run.wait_ready()?;
    work_and_move(suite, &mut run, log_progress, mode)?;
    run.touch("go")?;
    run.wait_pass()?;
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
    let mut run = Run::start(suite, "bash_pipeline", mode, cmd)?;
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
    /// `redis-cli -h 127.0.0.1 -p PORT ARGS` with `input` on stdin.
    fn cli(
        &self,
        run: &mut Run,
        label: &str,
        args: &[&str],
        input: Option<&[u8]>,
    ) -> Result<CmdOutput, Failed> {
        let mut cmd = Command::new(&self.cli);
        cmd.args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
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
    let mut run = Run::start(suite, "redis_data", mode, cmd)?;
    let redis = Redis { cli, port };
    redis.wait_pong(&mut run, "after start")?;
    redis_write(&redis, &mut run, 0)?;
    redis_verify(&redis, &mut run, 0, "verify0")?;
    for round in 1..=mode.rounds() {
        sleep(WORK_TIME);
        run.move_once(suite, mode, round)?;
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
