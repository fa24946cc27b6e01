//! The engine's correctness suite.
//!
//! Every `tests/programs/*.c` is a small self-checking program about one kind
//! of process state (see `tests/programs/README.md` for the protocol).  For
//! each program there are two trials, run one at a time:
//!
//! * `native::NAME` runs it, waits for `ready`, touches `go` and requires the
//!   verdict `PASS` (the program itself is right);
//! * `cr::NAME` runs it, then twice does `ferry checkpoint PID --dir D` (which
//!   kills the tree) and `ferry restore --dir D` (which must give back the
//!   same root PID), then touches `go` and requires `PASS`.
//!
//! * `ns::NAME` runs it, then does `ferry checkpoint PID --dir D` and
//!   `ferry restore --dir D --pid-namespace` (the tree is rebuilt in fresh PID,
//!   time, mount and IPC namespaces, under its PIDs there), then checkpoints it
//!   again from inside that namespace and restores that into another fresh
//!   one, then touches `go` and requires `PASS`.  The restored root must have
//!   its original PID inside the namespace (NSpid).
//!
//! * `mig::NAME` runs it natively, then moves it live around a local 3-node
//!   cluster, `ferry --node a migrate PID --to b`, b -> c, c -> a (the tree
//!   ends up in fresh guest namespaces on each node, under its original PIDs
//!   there), then touches `go` and requires `PASS` and the whole tree gone
//!   (the root and every guest namespace it passed through).  After the first
//!   hop the root is no longer our child (each daemon is the subreaper of its
//!   guests), so its exit status cannot be checked: the harness follows it by
//!   the host PID each migration reports (`dest_pid`).  One cluster serves
//!   every `mig::` trial of a run: it is started when the first one runs and
//!   stopped before the suite exits.
//!
//! Programs listed in `tests/programs/PENDING` hold state the engine does not
//! support yet: their `cr::`, `ns::` and `mig::` trials require that `ferry
//! checkpoint` (or `ferry migrate`) refuses (non-zero status, a message on
//! stderr) and leaves the program running unharmed.  Programs listed in
//! `tests/programs/MIG_EXCLUDED` cannot be migrated on a local cluster (the
//! reason is on their line): they have no `mig::` trial.  Programs listed in
//! `tests/programs/MIG_PENDING` are supported by checkpoint and restore but not
//! yet by `ferry migrate`: their `mig::` trial requires a clean refusal.  Programs listed in `tests/programs/NS_EXCLUDED` cannot
//! work in a PID namespace of their own (the reason is on their line): they
//! have no `ns::` trial.
//!
//! More trials (`ns_extra::`): a tree cloned into a namespace while its
//! original keeps running; a clone of TCP listeners, which can listen only
//! once the original is gone (its restore fails cleanly while the original
//! keeps listening, and completes when the original dies); clocks that the image says were ahead of this
//! machine's (the guest's monotonic clock must continue from them); a tree
//! whose root is a namespace's PID 1, which must be refused; the engine API
//! of the commit protocol, called from here (`restore_with` into guest
//! namespaces holds the tree stopped, then `kill` leaves nothing behind or
//! `resume` lets it run; `FrozenTree::set_exit_kill` makes the original die
//! with its tracer).
//!
//! Environment: `FERRY_SUITE_FILTER=substr` runs only programs whose name
//! contains `substr`; `FERRY_SUITE_KEEP=1` keeps the run directories of
//! passing trials too (failing ones are always kept); `FERRY_SUITE_CC`
//! overrides the C compiler (default `gcc`); `FERRY_SUITE_FERRY` runs another
//! `ferry` binary (e.g. a release build) instead of the one cargo built (the
//! `mig::` cluster's daemons are always the one cargo built).

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fmt::Write as _;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::sleep;
use std::time::{Duration, Instant, SystemTime};

mod common;

use common::cluster::{self, Cluster};
use common::*;
use libtest_mimic::{Arguments, Failed, Trial};

const READY_TIMEOUT: Duration = Duration::from_secs(10);
const NATIVE_RESULT_TIMEOUT: Duration = Duration::from_secs(10);
const CR_RESULT_TIMEOUT: Duration = Duration::from_secs(20);
const FERRY_TIMEOUT: Duration = Duration::from_secs(60);
const EXIT_TIMEOUT: Duration = Duration::from_secs(5);
const TREE_GONE_TIMEOUT: Duration = Duration::from_secs(10);
/// A guest init exits within a second of being alone (it looks once a second).
const INIT_GONE_TIMEOUT: Duration = Duration::from_secs(5);
/// The hops of a `mig::` trial: around the cluster and home again.
const MIG_HOPS: [(&str, &str); 3] = [("a", "b"), ("b", "c"), ("c", "a")];
const LOG_TAIL: usize = 16 * 1024;

/// What all trials share.
struct Suite {
    programs_dir: PathBuf,
    bin_dir: PathBuf,
    runs_dir: PathBuf,
    ferry: PathBuf,
    cc: String,
    keep: bool,
    /// program name -> compiled binary or compiler output
    built: Mutex<HashMap<String, Result<PathBuf, String>>>,
    /// The local cluster of the `mig::` trials: started by the first of them (or why it
    /// could not be), stopped before the suite exits.
    cluster: Mutex<Option<Result<Cluster, String>>>,
}

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
            "engine_suite: PR_SET_CHILD_SUBREAPER failed: {}",
            io::Error::last_os_error()
        );
    }

    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let root = root.canonicalize().unwrap_or(root);
    let programs_dir = root.join("tests/programs");
    let work = option_env!("CARGO_TARGET_TMPDIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir)
        .join("engine_suite");
    // Several suites may run at once (e.g. a developer's and an agent's):
    // each gets its own run directories; those of finished suites are
    // cleared when the next one starts.
    let runs_root = work.join("runs");
    clear_stale_runs(&runs_root);
    let suite = Arc::new(Suite {
        bin_dir: work.join("bin"),
        runs_dir: runs_root.join(std::process::id().to_string()),
        programs_dir: programs_dir.clone(),
        ferry: std::env::var_os("FERRY_SUITE_FERRY")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_ferry"))),
        cc: std::env::var("FERRY_SUITE_CC").unwrap_or_else(|_| "gcc".into()),
        keep: std::env::var_os("FERRY_SUITE_KEEP").is_some_and(|v| !v.is_empty() && v != "0"),
        built: Mutex::new(HashMap::new()),
        cluster: Mutex::new(None),
    });

    let filter = std::env::var("FERRY_SUITE_FILTER").unwrap_or_default();
    let programs: Vec<String> = list_programs(&programs_dir)
        .into_iter()
        .filter(|p| p.contains(&filter))
        .collect();
    let pending = read_pending(&programs_dir.join("PENDING"));
    let ns_excluded = read_pending(&programs_dir.join("NS_EXCLUDED"));
    let mig_excluded = read_pending(&programs_dir.join("MIG_EXCLUDED"));
    let mig_pending = read_pending(&programs_dir.join("MIG_PENDING"));

    let mut trials = Vec::new();
    for name in &programs {
        let (s, n) = (suite.clone(), name.clone());
        trials.push(Trial::test(format!("native::{name}"), move || {
            run_native(&s, &n)
        }));
    }
    for name in &programs {
        let (s, n) = (suite.clone(), name.clone());
        let reason = pending.get(name).cloned();
        trials.push(Trial::test(format!("cr::{name}"), move || {
            run_cr(&s, &n, reason.as_deref(), Mode::Here)
        }));
    }
    for name in programs.iter().filter(|n| !ns_excluded.contains_key(*n)) {
        let (s, n) = (suite.clone(), name.clone());
        let reason = pending.get(name).cloned();
        trials.push(Trial::test(format!("ns::{name}"), move || {
            run_cr(&s, &n, reason.as_deref(), Mode::Namespace)
        }));
    }
    for name in programs.iter().filter(|n| !mig_excluded.contains_key(*n)) {
        let (s, n) = (suite.clone(), name.clone());
        let reason = mig_pending.get(name).or(pending.get(name)).cloned();
        trials.push(Trial::test(format!("mig::{name}"), move || {
            run_mig(&s, &n, reason.as_deref())
        }));
    }
    if "ns_extra".contains(&filter) || filter.is_empty() {
        let s = suite.clone();
        trials.push(Trial::test("ns_extra::clone_beside_original", move || {
            run_clone_beside_original(&s)
        }));
        let s = suite.clone();
        trials.push(Trial::test(
            "ns_extra::listener_beside_original",
            move || run_listener_beside_original(&s),
        ));
        let s = suite.clone();
        trials.push(Trial::test("ns_extra::clocks_ahead", move || {
            run_clocks_ahead(&s)
        }));
        let s = suite.clone();
        trials.push(Trial::test("ns_extra::refuse_namespace_init", move || {
            run_refuse_namespace_init(&s)
        }));
        let s = suite.clone();
        trials.push(Trial::test("ns_extra::held_then_killed", move || {
            run_held(&s, false)
        }));
        let s = suite.clone();
        trials.push(Trial::test("ns_extra::held_then_resumed", move || {
            run_held(&s, true)
        }));
        let s = suite.clone();
        trials.push(Trial::test("ns_extra::exit_kill", move || {
            run_exit_kill(&s)
        }));
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

/// Names (without `.c`) of all programs, sorted.
fn list_programs(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().into_string().ok())
                .filter_map(|n| n.strip_suffix(".c").map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// `PENDING`: one program name per line, optionally followed by `# reason`.
fn read_pending(path: &Path) -> HashMap<String, String> {
    let text = fs::read_to_string(path).unwrap_or_default();
    let mut map = HashMap::new();
    for line in text.lines() {
        let (name, reason) = match line.split_once('#') {
            Some((n, r)) => (n.trim(), r.trim()),
            None => (line.trim(), ""),
        };
        if !name.is_empty() {
            map.insert(name.to_owned(), reason.to_owned());
        }
    }
    map
}

// ---------------------------------------------------------------------------
// Building the programs.

fn mtime(p: &Path) -> Option<SystemTime> {
    fs::metadata(p).and_then(|m| m.modified()).ok()
}

/// Compile `name.c` (once per run, and only if out of date).
fn build(suite: &Suite, name: &str) -> Result<PathBuf, String> {
    build_from(suite, name, &suite.programs_dir.join(format!("{name}.c")))
}

/// Compile `src` as `name` (once per run, and only if out of date).
fn build_from(suite: &Suite, name: &str, src: &Path) -> Result<PathBuf, String> {
    let mut built = suite.built.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(r) = built.get(name) {
        return r.clone();
    }
    let src = src.to_path_buf();
    let header = suite.programs_dir.join("ferry_test.h");
    let bin = suite.bin_dir.join(name);
    let result = (|| {
        fs::create_dir_all(&suite.bin_dir)
            .map_err(|e| format!("mkdir {}: {e}", suite.bin_dir.display()))?;
        let newest_input = [mtime(&src), mtime(&header)].into_iter().flatten().max();
        if let (Some(b), Some(i)) = (mtime(&bin), newest_input) {
            if b > i {
                return Ok(bin.clone());
            }
        }
        // Compile to a private name, then rename: another suite may be
        // building or running the same program right now.
        let tmp = suite
            .bin_dir
            .join(format!(".{name}.{}.tmp", std::process::id()));
        let out = Command::new(&suite.cc)
            .args(["-O1", "-g", "-pthread", "-Wall", "-o"])
            .arg(&tmp)
            .arg(&src)
            .arg("-lrt")
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("cannot run {}: {e}", suite.cc))?;
        if !out.status.success() {
            let _ = fs::remove_file(&tmp);
            return Err(format!(
                "compiling {} failed ({}):\n{}{}",
                src.display(),
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        fs::rename(&tmp, &bin).map_err(|e| format!("rename {}: {e}", tmp.display()))?;
        Ok(bin.clone())
    })();
    built.insert(name.to_owned(), result.clone());
    result
}

// ---------------------------------------------------------------------------
// One run of one program.

/// Where a trial rebuilds its tree.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// `ferry restore`: in our namespaces, under the original PIDs.
    Here,
    /// `ferry restore --pid-namespace`: in fresh namespaces of its own.
    Namespace,
}

/// A program under test: its directory, and cleanup of its whole tree.
struct Run {
    name: String,
    base: PathBuf,
    t: PathBuf,
    /// The root's PID as the program sees it (getpid()).
    root: i32,
    /// The root's PID here: `root`, unless it was restored into a PID namespace.
    host: i32,
    /// Whether the root now lives in a PID namespace of its own (and is not our child).
    in_ns: bool,
    /// Host PIDs of the guest inits of the namespaces a migrated tree has lived in.
    inits: Vec<i32>,
    child: Option<Child>,
    /// exit status of the root, once seen
    exited: Option<ExitStatus>,
    /// ferry invocations so far, for failure messages
    ferry_log: String,
    keep: bool,
}

impl Run {
    fn start(suite: &Suite, name: &str, mode: &str) -> Result<Run, String> {
        let bin = build(suite, name)?;
        Run::start_bin(suite, name, mode, &bin)
    }

    fn start_bin(suite: &Suite, name: &str, mode: &str, bin: &Path) -> Result<Run, String> {
        let base = suite.runs_dir.join(format!("{name}.{mode}"));
        let _ = fs::remove_dir_all(&base);
        let t = base.join("t");
        fs::create_dir_all(&t).map_err(|e| format!("mkdir {}: {e}", t.display()))?;
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(t.join("log"))
            .map_err(|e| format!("open log: {e}"))?;
        let log2 = log.try_clone().map_err(|e| format!("dup log: {e}"))?;
        let mut cmd = Command::new(bin);
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
            .map_err(|e| format!("cannot start {}: {e}", bin.display()))?;
        let root = child.id() as i32;
        Ok(Run {
            name: name.to_owned(),
            base,
            t,
            root,
            host: root,
            in_ns: false,
            inits: Vec::new(),
            child: Some(child),
            exited: None,
            ferry_log: String::new(),
            keep: suite.keep,
        })
    }

    fn file(&self, name: &str) -> PathBuf {
        self.t.join(name)
    }

    /// The test directory's log, the result file, and the ferry outputs.
    fn report(&self, what: &str) -> Failed {
        let mut msg = format!("{}: {what}\n", self.name);
        if let Ok(r) = fs::read_to_string(self.file("result")) {
            let _ = writeln!(msg, "--- result: {}", r.trim_end());
        }
        if !self.ferry_log.is_empty() {
            msg.push_str(&self.ferry_log);
        }
        let log = fs::read(self.file("log")).unwrap_or_default();
        let log = String::from_utf8_lossy(tail(&log, LOG_TAIL));
        let _ = write!(msg, "--- {}:\n{}", self.file("log").display(), log);
        if !log.ends_with('\n') {
            msg.push('\n');
        }
        let _ = write!(msg, "--- run directory kept: {}", self.base.display());
        Failed::from(msg)
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
                    use std::os::unix::process::ExitStatusExt;
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

    /// Wait for `ready`; it must name the root pid.
    fn wait_ready(&mut self) -> Result<(), Failed> {
        let start = Instant::now();
        loop {
            if let Ok(text) = fs::read_to_string(self.file("ready")) {
                return match text.trim().parse::<i32>() {
                    Ok(pid) if pid == self.root => Ok(()),
                    _ => Err(self.report(&format!(
                        "ready file says {:?}, expected pid {}",
                        text.trim(),
                        self.root
                    ))),
                };
            }
            if self.file("result").exists() {
                return Err(self.report("program gave a verdict before it was ready"));
            }
            if !self.root_alive() {
                return Err(self.report(&format!(
                    "program died before it was ready{}",
                    self.exit_note()
                )));
            }
            if start.elapsed() > READY_TIMEOUT {
                return Err(self.report(&format!("no ready file after {READY_TIMEOUT:?}")));
            }
            sleep(Duration::from_millis(5));
        }
    }

    fn touch_go(&self) -> Result<(), Failed> {
        File::create(self.file("go"))
            .map_err(|e| self.report(&format!("cannot create go: {e}")))?;
        Ok(())
    }

    /// Wait for the verdict; require PASS and a clean exit of the root.
    fn wait_pass(&mut self, timeout: Duration) -> Result<(), Failed> {
        let start = Instant::now();
        let mut dead_since: Option<Instant> = None;
        let verdict = loop {
            if let Ok(text) = fs::read_to_string(self.file("result")) {
                break text;
            }
            if !self.root_alive() {
                // The verdict is written before exit; allow a moment for the rename.
                let since = *dead_since.get_or_insert_with(Instant::now);
                if since.elapsed() > Duration::from_millis(200) {
                    return Err(self.report(&format!(
                        "program exited without a verdict{}",
                        self.exit_note()
                    )));
                }
            }
            if start.elapsed() > timeout {
                return Err(self.report(&format!("no result after {timeout:?}")));
            }
            sleep(Duration::from_millis(5));
        };
        if verdict.trim_end() != "PASS" {
            return Err(self.report("program did not pass"));
        }
        if self.in_ns {
            // The guest's init is the root's parent and collects its status.
            return if wait_gone(self.host, EXIT_TIMEOUT) {
                Ok(())
            } else {
                Err(self.report(&format!(
                    "program said PASS but did not exit within {EXIT_TIMEOUT:?}"
                )))
            };
        }
        match self.wait_root_exit(EXIT_TIMEOUT) {
            Some(st) if st.success() => Ok(()),
            Some(st) => Err(self.report(&format!("program said PASS but exited with {st}"))),
            None => Err(self.report(&format!(
                "program said PASS but did not exit within {EXIT_TIMEOUT:?}"
            ))),
        }
    }

    /// Reap the root (our child, or reparented to us) and return its status.
    fn wait_root_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        use std::os::unix::process::ExitStatusExt;
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

    /// Run ferry with a timeout; record its outputs for failure messages.
    fn ferry(&mut self, suite: &Suite, label: &str, args: &[&str]) -> Result<FerryOutput, Failed> {
        self.ferry_env(suite, label, args, &[])
    }

    /// `ferry` with extra environment (`FERRY_CLUSTER_DIR`, `FERRY_NODE`).
    fn ferry_env(
        &mut self,
        suite: &Suite,
        label: &str,
        args: &[&str],
        env: &[(&str, &OsStr)],
    ) -> Result<FerryOutput, Failed> {
        let out_path = self.base.join(format!("{label}.stdout"));
        let err_path = self.base.join(format!("{label}.stderr"));
        let open = |p: &Path| File::create(p).map_err(|e| format!("create {}: {e}", p.display()));
        let stdout = open(&out_path).map_err(|e| self.report(&e))?;
        let stderr = open(&err_path).map_err(|e| self.report(&e))?;
        let started = Instant::now();
        let mut child = Command::new(&suite.ferry)
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .spawn()
            .map_err(|e| self.report(&format!("cannot run {}: {e}", suite.ferry.display())))?;
        let status = loop {
            match child.try_wait() {
                Ok(Some(st)) => break Some(st),
                Ok(None) if started.elapsed() > FERRY_TIMEOUT => {
                    let _ = child.kill();
                    let _ = child.wait();
                    break None;
                }
                Ok(None) => sleep(Duration::from_millis(5)),
                Err(e) => return Err(self.report(&format!("waiting for ferry: {e}"))),
            }
        };
        let out = FerryOutput {
            status,
            stdout: fs::read_to_string(&out_path).unwrap_or_default(),
            stderr: fs::read_to_string(&err_path).unwrap_or_default(),
        };
        let _ = write!(
            self.ferry_log,
            "--- ferry {} ({}, {:.2} s)\n--- stdout:\n{}--- stderr:\n{}",
            args.join(" "),
            match status {
                Some(st) => st.to_string(),
                None => format!("killed after {FERRY_TIMEOUT:?}"),
            },
            started.elapsed().as_secs_f64(),
            with_newline(tail(out.stdout.as_bytes(), LOG_TAIL)),
            with_newline(tail(out.stderr.as_bytes(), LOG_TAIL)),
        );
        Ok(out)
    }

    /// After a checkpoint: the whole tree must be gone and reaped (so that
    /// restore can have the PIDs back).
    fn wait_tree_gone(&mut self) -> Result<(), Failed> {
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
                    "checkpoint succeeded but processes are still there after {TREE_GONE_TIMEOUT:?}: {left:?}"
                )));
            }
            sleep(Duration::from_millis(5));
        }
    }

    /// Checkpoint, wait for the tree to go, restore; the root must come back
    /// with its PID.  `Ok(false)`: checkpoint failed (status and stderr are
    /// in `ferry_log`), the program should be untouched.
    fn checkpoint_restore(
        &mut self,
        suite: &Suite,
        round: u32,
        mode: Mode,
    ) -> Result<bool, Failed> {
        let img = self.base.join(format!("img{round}"));
        let _ = fs::remove_dir_all(&img);
        let img_s = img.to_string_lossy().into_owned();
        let pid_s = self.host.to_string();
        let ck = self.ferry(
            suite,
            &format!("checkpoint{round}"),
            &["checkpoint", &pid_s, "--dir", &img_s],
        )?;
        match ck.status {
            Some(st) if st.success() => {}
            Some(_) => return Ok(false),
            None => return Err(self.report(&format!("ferry checkpoint (round {round}) hung"))),
        }
        if mode == Mode::Namespace {
            return self
                .restore_in_namespace(suite, round, &img_s)
                .map(|_| true);
        }
        self.wait_tree_gone()?;
        let rs = self.ferry(
            suite,
            &format!("restore{round}"),
            &["restore", "--dir", &img_s],
        )?;
        match rs.status {
            Some(st) if st.success() => {}
            _ => return Err(self.report(&format!("ferry restore (round {round}) failed"))),
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
                "root pid {} is not running after restore (round {round})",
                self.root
            )));
        }
        if self.file("result").exists() {
            return Err(self.report(&format!(
                "program gave a verdict before go (after restore round {round})"
            )));
        }
        Ok(true)
    }

    /// After a checkpoint (which killed the tree): `ferry restore --pid-namespace`. The root must
    /// come back with its PID inside the new namespace, under another PID here.
    /// Returns the guest init's PID here.
    fn restore_in_namespace(
        &mut self,
        suite: &Suite,
        round: u32,
        img: &str,
    ) -> Result<i32, Failed> {
        let old = self.host;
        self.poll_child();
        reap_zombies();
        if !wait_gone(old, TREE_GONE_TIMEOUT) {
            return Err(self.report(&format!(
                "checkpoint (round {round}) succeeded but PID {old} still runs"
            )));
        }
        self.exited = None;
        let rs = self.ferry(
            suite,
            &format!("restore{round}"),
            &["restore", "--dir", img, "--pid-namespace", "--json"],
        )?;
        match rs.status {
            Some(st) if st.success() => {}
            _ => return Err(self.report(&format!("ferry restore (round {round}) failed"))),
        }
        let report: serde_json::Value = serde_json::from_str(&rs.stdout)
            .map_err(|e| self.report(&format!("restore (round {round}): bad JSON report: {e}")))?;
        let num = |k: &str| report.get(k).and_then(|v| v.as_i64()).map(|v| v as i32);
        let (Some(pid), Some(host), Some(init)) = (
            num("root_pid"),
            num("root_host_pid"),
            num("guest_init_host_pid"),
        ) else {
            return Err(self.report(&format!(
                "restore (round {round}): the report lacks root_pid, root_host_pid or \
                 guest_init_host_pid"
            )));
        };
        if pid != self.root {
            return Err(self.report(&format!(
                "restore (round {round}) gave root pid {pid}, expected {}",
                self.root
            )));
        }
        self.host = host;
        self.in_ns = true;
        let nspid = fs::read_to_string(format!("/proc/{host}/status"))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("NSpid:").map(str::to_owned))
            })
            .unwrap_or_default();
        let ids: Vec<i32> = nspid
            .split_whitespace()
            .filter_map(|x| x.parse().ok())
            .collect();
        if ids != [host, self.root] {
            return Err(self.report(&format!(
                "restore (round {round}): host PID {host} has NSpid {nspid:?}, expected \
                 \"{host} {}\"",
                self.root
            )));
        }
        if !self.root_alive() {
            return Err(self.report(&format!(
                "root (host PID {host}) is not running after restore (round {round})"
            )));
        }
        if self.file("result").exists() {
            return Err(self.report(&format!(
                "program gave a verdict before go (after restore round {round})"
            )));
        }
        Ok(init)
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
}

impl Drop for Run {
    fn drop(&mut self) {
        self.cleanup();
    }
}

struct FerryOutput {
    status: Option<ExitStatus>,
    stdout: String,
    stderr: String,
}

// ---------------------------------------------------------------------------
// The trials.

fn run_native(suite: &Suite, name: &str) -> Result<(), Failed> {
    let mut run = Run::start(suite, name, "native").map_err(Failed::from)?;
    run.wait_ready()?;
    run.touch_go()?;
    run.wait_pass(NATIVE_RESULT_TIMEOUT)?;
    finish(run)
}

fn run_cr(suite: &Suite, name: &str, pending: Option<&str>, mode: Mode) -> Result<(), Failed> {
    let label = match mode {
        Mode::Here => "cr",
        Mode::Namespace => "ns",
    };
    let mut run = Run::start(suite, name, label).map_err(Failed::from)?;
    run.wait_ready()?;
    for round in 1..=2 {
        let ok = run.checkpoint_restore(suite, round, mode)?;
        if ok {
            continue;
        }
        // The checkpoint was refused.
        let Some(reason) = pending else {
            return Err(run.report(&format!("ferry checkpoint (round {round}) failed")));
        };
        if round != 1 {
            return Err(run.report(
                "the first checkpoint of a PENDING program succeeded but the second failed",
            ));
        }
        let stderr = fs::read_to_string(run.base.join("checkpoint1.stderr")).unwrap_or_default();
        if stderr.trim().is_empty() {
            return Err(run.report(&format!(
                "PENDING ({reason}): checkpoint failed as expected, but printed no message on stderr"
            )));
        }
        if !run.root_alive() {
            return Err(run.report(&format!(
                "PENDING ({reason}): checkpoint failed as expected, but the program did not survive it"
            )));
        }
        if let Some(st @ ('T' | 't')) = proc_state(run.host) {
            return Err(run.report(&format!(
                "PENDING ({reason}): checkpoint failed as expected, but left the program stopped (state {st})"
            )));
        }
        run.touch_go()?;
        run.wait_pass(NATIVE_RESULT_TIMEOUT).map_err(|f| {
            with_context(
                f,
                &format!("PENDING ({reason}): after the refused checkpoint"),
            )
        })?;
        return finish(run);
    }
    run.touch_go()?;
    run.wait_pass(CR_RESULT_TIMEOUT)?;
    if let Some(reason) = pending {
        eprintln!(
            "NOTE: {name} is listed in tests/programs/PENDING ({reason}) but passed checkpoint/restore: \
             it can be removed from PENDING"
        );
    }
    finish(run)
}

/// The `mig::` cluster's directory; the first call starts the cluster.
fn mig_cluster(suite: &Suite) -> Result<PathBuf, Failed> {
    let mut slot = suite.cluster.lock().unwrap_or_else(|e| e.into_inner());
    match slot.get_or_insert_with(|| Cluster::up_unadopted("engine-suite-mig", 3)) {
        Ok(c) => Ok(c.dir.clone()),
        Err(e) => Err(Failed::from(e.clone())),
    }
}

/// Moves a program a -> b -> c -> a with `ferry migrate`, then lets it check itself.
fn run_mig(suite: &Suite, name: &str, pending: Option<&str>) -> Result<(), Failed> {
    let dir = mig_cluster(suite)?;
    let mut run = Run::start(suite, name, "mig").map_err(Failed::from)?;
    run.wait_ready()?;
    let root_s = run.root.to_string();
    for (i, (from, to)) in MIG_HOPS.into_iter().enumerate() {
        let hop = i + 1;
        let fail = |run: &Run, what: &str| {
            let f = run.report(&format!("hop {hop} ({from} -> {to}): {what}"));
            Failed::from(format!(
                "{}\n{}",
                f.message().unwrap_or(""),
                cluster::daemon_logs(&dir, &[from, to])
            ))
        };
        let env = [
            ("FERRY_CLUSTER_DIR", dir.as_os_str()),
            ("FERRY_NODE", OsStr::new(from)),
        ];
        let args = ["migrate", &root_s, "--to", to, "--json"];
        let out = run.ferry_env(suite, &format!("migrate{hop}"), &args, &env)?;
        match out.status {
            Some(st) if st.success() => {}
            None => return Err(fail(&run, "ferry migrate hung")),
            Some(_) => {
                // Refused: the program must carry on where it was, untouched.
                let Some(reason) = pending else {
                    return Err(fail(&run, "ferry migrate failed"));
                };
                if hop != 1 {
                    return Err(fail(
                        &run,
                        "the first migration of a PENDING program succeeded but a later one failed",
                    ));
                }
                if out.stderr.trim().is_empty() {
                    return Err(fail(
                        &run,
                        &format!("PENDING ({reason}): migrate failed as expected, but printed no message on stderr"),
                    ));
                }
                if !run.root_alive() {
                    return Err(fail(
                        &run,
                        &format!("PENDING ({reason}): migrate failed as expected, but the program did not survive it"),
                    ));
                }
                if let Some(st @ ('T' | 't')) = proc_state(run.host) {
                    return Err(fail(
                        &run,
                        &format!("PENDING ({reason}): migrate failed as expected, but left the program stopped (state {st})"),
                    ));
                }
                run.touch_go()?;
                run.wait_pass(NATIVE_RESULT_TIMEOUT).map_err(|f| {
                    with_context(
                        f,
                        &format!("PENDING ({reason}): after the refused migration"),
                    )
                })?;
                return finish(run);
            }
        }
        let report: serde_json::Value = serde_json::from_str(&out.stdout)
            .map_err(|e| fail(&run, &format!("bad JSON report: {e}")))?;
        let Some(dest) = report
            .get("dest_pid")
            .and_then(|v| v.as_i64())
            .map(|v| v as i32)
            .filter(|&p| p > 0)
        else {
            return Err(fail(&run, "the report has no dest_pid"));
        };
        // The copy it came from is gone (on hop 1, our child: reaped here).
        let old = run.host;
        run.poll_child();
        if !wait_gone(old, TREE_GONE_TIMEOUT) {
            return Err(fail(
                &run,
                &format!("migrated, but the copy it left (PID {old}) still runs"),
            ));
        }
        run.poll_child();
        run.exited = None;
        run.host = dest;
        run.in_ns = true;
        let nspid = status_field(dest, "NSpid");
        if nspid.split_whitespace().collect::<Vec<_>>() != [dest.to_string(), root_s.clone()] {
            return Err(fail(
                &run,
                &format!(
                    "the root (PID {dest} here) has NSpid {nspid:?}, expected \"{dest} {root_s}\""
                ),
            ));
        }
        match parent_pid(dest) {
            Some(init) if is_guest_init(init) => run.inits.push(init),
            p => {
                return Err(fail(
                    &run,
                    &format!("the root's parent (PID {p:?}) is not a guest init"),
                ))
            }
        }
        if !run.root_alive() {
            return Err(fail(&run, &format!("the root (PID {dest}) is not running")));
        }
        if run.file("result").exists() {
            return Err(fail(&run, "the program gave a verdict before go"));
        }
    }
    run.touch_go()?;
    run.wait_pass(CR_RESULT_TIMEOUT)?;
    // The whole tree is gone: each namespace it lived in emptied, and its init left.
    for init in run.inits.clone() {
        if !wait_gone(init, INIT_GONE_TIMEOUT) {
            return Err(run.report(&format!(
                "the program passed, but the guest init {init} still runs: processes of the tree \
                 are left in its namespace"
            )));
        }
    }
    if let Some(reason) = pending {
        eprintln!(
            "NOTE: {name} is listed in tests/programs/PENDING ({reason}) but passed migration: \
             it can be removed from PENDING"
        );
    }
    finish(run)
}

fn with_context(f: Failed, ctx: &str) -> Failed {
    Failed::from(format!("{ctx}: {}", f.message().unwrap_or("")))
}

/// Passed: clean up, and drop the run directory unless asked to keep it.
fn finish(mut run: Run) -> Result<(), Failed> {
    run.cleanup();
    if !run.keep {
        let _ = fs::remove_dir_all(&run.base);
    }
    Ok(())
}

/// Requires a successful ferry run.
fn ferry_ok(run: &mut Run, suite: &Suite, label: &str, args: &[&str]) -> Result<String, Failed> {
    let out = run.ferry(suite, label, args)?;
    match out.status {
        Some(st) if st.success() => Ok(out.stdout),
        _ => Err(run.report(&format!("ferry {label} failed"))),
    }
}

/// Starts tests/victims/whoami.c and waits until it handles SIGUSR1.
fn start_whoami(suite: &Suite, mode: &str) -> Result<Run, Failed> {
    let src = suite.programs_dir.join("../victims/whoami.c");
    let bin = build_from(suite, "victim_whoami", &src).map_err(Failed::from)?;
    let mut run = Run::start_bin(suite, "whoami", mode, &bin).map_err(Failed::from)?;
    let start = Instant::now();
    while u64::from_str_radix(&status_field(run.root, "SigCgt"), 16).unwrap_or(0) & (1 << 9) == 0 {
        if start.elapsed() > READY_TIMEOUT || !run.root_alive() {
            return Err(run.report("whoami did not start"));
        }
        sleep(Duration::from_millis(5));
    }
    Ok(run)
}

/// Sends SIGUSR1 to `pid` and returns the line whoami appends to whoami.log.
fn ask_whoami(run: &Run, pid: i32) -> Result<String, Failed> {
    let log = run.file("whoami.log");
    let before = fs::read_to_string(&log).unwrap_or_default().lines().count();
    // SAFETY: kill() with a pid we started; worst case ESRCH.
    unsafe { libc::kill(pid, libc::SIGUSR1) };
    let start = Instant::now();
    loop {
        let text = fs::read_to_string(&log).unwrap_or_default();
        if let Some(line) = text.lines().nth(before) {
            return Ok(line.to_owned());
        }
        if start.elapsed() > READY_TIMEOUT {
            return Err(run.report(&format!("PID {pid} did not answer SIGUSR1")));
        }
        sleep(Duration::from_millis(5));
    }
}

/// checkpoint --leave-running, restore --pid-namespace: the clone runs beside its original,
/// under another PID here and the same getpid() inside.
fn run_clone_beside_original(suite: &Suite) -> Result<(), Failed> {
    let mut run = start_whoami(suite, "ns_clone")?;
    let img = run.base.join("img").to_string_lossy().into_owned();
    let pid_s = run.root.to_string();
    let args = ["checkpoint", &pid_s, "--dir", &img, "--leave-running"];
    ferry_ok(&mut run, suite, "checkpoint", &args)?;
    let out = ferry_ok(
        &mut run,
        suite,
        "restore",
        &["restore", "--dir", &img, "--pid-namespace"],
    )?;
    let clone: i32 = out
        .lines()
        .map(str::trim)
        .rfind(|l| !l.is_empty())
        .and_then(|l| l.parse().ok())
        .ok_or_else(|| run.report(&format!("restore printed {out:?}, not a PID")))?;
    if clone == run.root {
        return Err(run.report("the clone has the original's PID on this machine"));
    }
    for (what, pid) in [("original", run.root), ("clone", clone)] {
        if !matches!(proc_state(pid), Some(s) if s != 'Z' && s != 'X') {
            return Err(run.report(&format!("the {what} (PID {pid}) is not running")));
        }
    }
    let nspid = status_field(clone, "NSpid");
    if nspid.split_whitespace().collect::<Vec<_>>() != [clone.to_string(), pid_s.clone()] {
        return Err(run.report(&format!("the clone's NSpid is {nspid:?}")));
    }
    let a = ask_whoami(&run, run.root)?;
    let b = ask_whoami(&run, clone)?;
    let field = |line: &str, k: &str| {
        let w: Vec<&str> = line.split_whitespace().collect();
        w.iter()
            .position(|x| *x == k)
            .and_then(|i| w.get(i + 1))
            .map(|v| v.to_string())
            .unwrap_or_default()
    };
    if field(&a, "pid") != pid_s || field(&b, "pid") != pid_s {
        return Err(run.report(&format!(
            "getpid() differs: original says {a:?}, clone says {b:?} (expected pid {pid_s})"
        )));
    }
    // The clone's parent is the namespace's init.
    if field(&b, "ppid") != "1" {
        return Err(run.report(&format!("the clone's getppid() is not 1: {b:?}")));
    }
    // Both still run afterwards.
    for (what, pid) in [("original", run.root), ("clone", clone)] {
        if !matches!(proc_state(pid), Some(s) if s != 'Z' && s != 'X') {
            return Err(run.report(&format!("the {what} (PID {pid}) died")));
        }
    }
    run.host = clone;
    finish(run)
}

/// TCP listeners cloned into a namespace beside their original, which still listens on their
/// ports: the clone is bound (in TCP repair mode) but can listen only once the original is gone.
/// `ferry restore --pid-namespace` waits a few seconds for that, then fails, naming the address
/// and leaving nothing behind; when the original dies meanwhile (as in a migration between nodes
/// of one machine, where the source kills it at the commit point), the clone listens and passes.
fn run_listener_beside_original(suite: &Suite) -> Result<(), Failed> {
    let mut run = Run::start(suite, "fd_tcp_listen", "ns_listen").map_err(Failed::from)?;
    run.wait_ready()?;
    let img = run.base.join("img").to_string_lossy().into_owned();
    let pid_s = run.root.to_string();
    let args = ["checkpoint", &pid_s, "--dir", &img, "--leave-running"];
    ferry_ok(&mut run, suite, "checkpoint", &args)?;
    let restore = [
        "restore",
        "--dir",
        img.as_str(),
        "--pid-namespace",
        "--json",
    ];

    // The original keeps listening: refused after the wait.
    let started = Instant::now();
    let out = run.ferry(suite, "restore-beside", &restore)?;
    if out.status.is_none_or(|s| s.success()) || !out.stderr.contains("still holds the address") {
        return Err(run.report(
            "restoring a listener whose original still listens should fail, saying another \
             socket still holds the address",
        ));
    }
    if started.elapsed() < Duration::from_secs(2) {
        return Err(run.report("the restore gave up without waiting for the address"));
    }
    // Nothing of the clone is left (its guest init, our child by reparenting, goes within a
    // second of being alone); the original runs on.
    let start = Instant::now();
    loop {
        reap_zombies();
        let left: Vec<i32> = tree_pids(run.root)
            .into_iter()
            .filter(|&p| p != run.root)
            .collect();
        if left.is_empty() {
            break;
        }
        if start.elapsed() > INIT_GONE_TIMEOUT {
            return Err(run.report(&format!("the failed restore left processes: {left:?}")));
        }
        sleep(Duration::from_millis(20));
    }
    if !run.root_alive() {
        return Err(run.report("the original died"));
    }

    // Now the original dies while the restore waits: the clone takes the ports.
    let out_path = run.base.join("restore-after-kill.stdout");
    let err_path = run.base.join("restore-after-kill.stderr");
    let create = |p: &Path| File::create(p).map_err(|e| run.report(&format!("create: {e}")));
    let mut child = Command::new(&suite.ferry)
        .args(restore)
        .stdin(Stdio::null())
        .stdout(create(&out_path)?)
        .stderr(create(&err_path)?)
        .spawn()
        .map_err(|e| run.report(&format!("cannot run ferry: {e}")))?;
    sleep(Duration::from_millis(500));
    // (Not reap_zombies: it would reap ferry too.)
    if let Some(mut c) = run.child.take() {
        let _ = c.kill();
        let _ = c.wait();
    }
    let status = child
        .wait()
        .map_err(|e| run.report(&format!("wait for ferry: {e}")))?;
    let stdout = fs::read_to_string(&out_path).unwrap_or_default();
    let stderr = fs::read_to_string(&err_path).unwrap_or_default();
    if !status.success() {
        return Err(run.report(&format!(
            "restore while the original died failed ({status}): {stderr}"
        )));
    }
    let report: serde_json::Value = serde_json::from_str(&stdout)
        .map_err(|e| run.report(&format!("bad JSON report {stdout:?}: {e}")))?;
    let clone = report
        .get("root_host_pid")
        .and_then(|v| v.as_i64())
        .unwrap_or(0) as i32;
    let nspid = status_field(clone, "NSpid");
    if nspid.split_whitespace().collect::<Vec<_>>() != [clone.to_string(), pid_s] {
        return Err(run.report(&format!("the clone's NSpid is {nspid:?}")));
    }
    run.host = clone;
    run.in_ns = true;
    run.touch_go()?;
    run.wait_pass(CR_RESULT_TIMEOUT)?;
    finish(run)
}

/// An image whose clocks are ahead of this machine's (as if it came from a machine booted
/// earlier): restored into a namespace, the monotonic clocks continue from the image's.
fn run_clocks_ahead(suite: &Suite) -> Result<(), Failed> {
    const AHEAD_NS: u64 = 100_000_000_000;
    let mut run = Run::start(suite, "proc_clock_monotonic", "ns_clocks").map_err(Failed::from)?;
    run.wait_ready()?;
    let img = run.base.join("img");
    let img_s = img.to_string_lossy().into_owned();
    let pid_s = run.root.to_string();
    ferry_ok(
        &mut run,
        suite,
        "checkpoint",
        &["checkpoint", &pid_s, "--dir", &img_s],
    )?;
    // Rewrite the image with clocks 100 s ahead.
    let ahead = run.base.join("img_ahead");
    let seen = shift_image_clocks(&img, &ahead, AHEAD_NS)
        .map_err(|e| run.report(&format!("rewrite the image: {e}")))?;
    let ahead_s = ahead.to_string_lossy().into_owned();
    let init = run.restore_in_namespace(suite, 1, &ahead_s)?;
    let offsets = fs::read_to_string(format!("/proc/{init}/timens_offsets")).unwrap_or_default();
    let secs = |name: &str| -> i64 {
        offsets
            .lines()
            .find_map(|l| {
                let w: Vec<&str> = l.split_whitespace().collect();
                (w.first() == Some(&name)).then(|| w.get(1)?.parse().ok())?
            })
            .unwrap_or(-1)
    };
    // The offset is what the image's clocks are ahead of ours by: 100 s less the time since
    // the capture (well under a second here).
    for name in ["monotonic", "boottime"] {
        if !(95..=100).contains(&secs(name)) {
            return Err(run.report(&format!(
                "guest {name} offset is not about 100 s: {offsets:?} (image clocks {seen:?})"
            )));
        }
    }
    let root_offsets =
        fs::read_to_string(format!("/proc/{}/timens_offsets", run.host)).unwrap_or_default();
    if root_offsets != offsets {
        return Err(run.report(&format!(
            "the restored root is not in the guest time namespace: {root_offsets:?}"
        )));
    }
    run.touch_go()?;
    run.wait_pass(CR_RESULT_TIMEOUT)?;
    finish(run)
}

/// Copies the image in `from` to `to` with its recorded clocks moved `by` ns ahead; returns the
/// new clocks.
fn shift_image_clocks(from: &Path, to: &Path, by: u64) -> Result<ferry_image::Clocks, String> {
    use ferry_image::{ImageReader, ImageWriter, Record};
    let file = |d: &Path| d.join(ferry_image::IMAGE_FILE);
    let input = File::open(file(from)).map_err(|e| e.to_string())?;
    let mut r = ImageReader::new(io::BufReader::new(input)).map_err(|e| e.to_string())?;
    fs::create_dir_all(to).map_err(|e| e.to_string())?;
    let out = File::create(file(to)).map_err(|e| e.to_string())?;
    let mut w = ImageWriter::new(io::BufWriter::new(out)).map_err(|e| e.to_string())?;
    let mut clocks = None;
    while let Some(rec) = r.next_record().map_err(|e| e.to_string())? {
        match rec {
            Record::Tree(mut t) => {
                let c = t.clocks.as_mut().ok_or("the image records no clocks")?;
                c.monotonic_ns += by;
                c.boottime_ns += by;
                clocks = Some(*c);
                w.write_tree(&t).map_err(|e| e.to_string())?;
            }
            Record::Pages { pid, addr, data } => {
                w.write_pages(pid, addr, &data).map_err(|e| e.to_string())?
            }
            Record::Object {
                object,
                offset,
                data,
            } => w
                .write_object(object, offset, &data)
                .map_err(|e| e.to_string())?,
            Record::End { .. } => {}
        }
    }
    let (out, _) = w.finish().map_err(|e| e.to_string())?;
    out.into_inner().map_err(|e| e.to_string())?;
    clocks.ok_or_else(|| "no tree record".into())
}

/// A namespace's PID 1 (here: the guest init of a cloned tree) cannot be checkpointed: the
/// refusal names it, and the namespace carries on untouched.
fn run_refuse_namespace_init(suite: &Suite) -> Result<(), Failed> {
    let mut run = start_whoami(suite, "ns_refuse")?;
    let img = run.base.join("img").to_string_lossy().into_owned();
    let pid_s = run.root.to_string();
    let args = ["checkpoint", &pid_s, "--dir", &img, "--leave-running"];
    ferry_ok(&mut run, suite, "checkpoint", &args)?;
    let args = ["restore", "--dir", &img, "--pid-namespace", "--json"];
    let out = ferry_ok(&mut run, suite, "restore", &args)?;
    let report: serde_json::Value =
        serde_json::from_str(&out).map_err(|e| run.report(&format!("bad JSON report: {e}")))?;
    let num = |k: &str| report.get(k).and_then(|v| v.as_i64()).unwrap_or(0) as i32;
    let (clone, init) = (num("root_host_pid"), num("guest_init_host_pid"));
    let img2 = run.base.join("img2").to_string_lossy().into_owned();
    let init_s = init.to_string();
    let ck = run.ferry(
        suite,
        "checkpoint2",
        &["checkpoint", &init_s, "--dir", &img2],
    )?;
    if ck.status.is_some_and(|s| s.success()) || !ck.stderr.contains("PID 1 of its PID namespace") {
        return Err(run.report(
            "checkpointing a namespace's init should be refused, naming PID 1 of its namespace",
        ));
    }
    for (what, pid) in [
        ("guest init", init),
        ("clone", clone),
        ("original", run.root),
    ] {
        match proc_state(pid) {
            Some('S') | Some('R') => {}
            st => {
                return Err(run.report(&format!(
                    "after the refusal the {what} (PID {pid}) is in state {st:?}"
                )))
            }
        }
    }
    ask_whoami(&run, clone)?;
    run.host = clone;
    finish(run)
}

/// The engine's commit protocol, called directly: `restore_with` into fresh guest namespaces
/// holds the clone stopped (every thread in a ptrace stop); then either `kill` (nothing of it
/// is left, and the guest init goes once dropped) or `resume` (it runs and answers).
fn run_held(suite: &Suite, resume: bool) -> Result<(), Failed> {
    use ferry_engine::guest_ns::GuestNamespaces;
    use ferry_engine::restore::{open, restore_with, RestoreOptions};
    let mut run = start_whoami(suite, if resume { "ns_resume" } else { "ns_kill" })?;
    let img = run.base.join("img");
    let img_s = img.to_string_lossy().into_owned();
    let pid_s = run.root.to_string();
    let args = ["checkpoint", &pid_s, "--dir", &img_s, "--leave-running"];
    ferry_ok(&mut run, suite, "checkpoint", &args)?;
    let file = File::open(img.join(ferry_image::IMAGE_FILE))
        .map_err(|e| run.report(&format!("open the image: {e}")))?;
    let mut image =
        open(io::BufReader::new(file)).map_err(|e| run.report(&format!("open: {e}")))?;
    let guest = GuestNamespaces::create(&suite.ferry, image.tree.clocks)
        .map_err(|e| run.report(&format!("GuestNamespaces::create: {e}")))?;
    let init = guest.init_host_pid();
    let held = restore_with(
        &mut image,
        &RestoreOptions {
            guest: Some(&guest),
        },
    )
    .map_err(|e| run.report(&format!("restore_with: {e}")))?;
    let report = held.report().clone();
    let clone = held.root_host_pid();
    if report.guest_init_host_pid != Some(init)
        || report.processes.len() != 1
        || report.processes[0].pid != run.root
        || report.processes[0].host_pid != clone
    {
        return Err(run.report(&format!("unexpected report {report:?}")));
    }
    if proc_state(clone) != Some('t') {
        return Err(run.report(&format!(
            "the held clone (PID {clone}) is in state {:?}, not stopped by its tracer",
            proc_state(clone)
        )));
    }
    if resume {
        held.resume()
            .map_err(|e| run.report(&format!("resume: {e}")))?;
        let line = ask_whoami(&run, clone)?;
        if !line.starts_with(&format!("pid {pid_s} ")) {
            return Err(run.report(&format!("the resumed clone says {line:?}")));
        }
        run.host = clone;
    } else {
        held.kill();
        if !wait_gone(clone, EXIT_TIMEOUT) {
            return Err(run.report(&format!("the killed clone (PID {clone}) is still there")));
        }
        drop(guest);
        // Alone and released: the init goes within its one-second poll.
        if !wait_gone(init, Duration::from_secs(3)) {
            return Err(run.report(&format!("the guest init (PID {init}) is still there")));
        }
        if !run.root_alive() {
            return Err(run.report("the original died"));
        }
    }
    finish(run)
}

/// `FrozenTree::set_exit_kill`: once set, the tree dies with the thread that froze it (the
/// commit point of a migration); without it, the tree is let go.
fn run_exit_kill(suite: &Suite) -> Result<(), Failed> {
    use ferry_engine::freeze::FrozenTree;
    for exit_kill in [false, true] {
        let mut run = start_whoami(
            suite,
            if exit_kill {
                "exit_kill"
            } else {
                "no_exit_kill"
            },
        )?;
        let pid = run.root;
        let tracer = std::thread::spawn(move || -> Result<(), String> {
            let frozen = FrozenTree::freeze(pid).map_err(|e| e.to_string())?;
            if exit_kill {
                frozen.set_exit_kill().map_err(|e| e.to_string())?;
            }
            // The tracer thread ends without thawing the tree, as if ferry died.
            std::mem::forget(frozen);
            Ok(())
        });
        match tracer.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(run.report(&format!("freeze: {e}"))),
            Err(_) => return Err(run.report("the tracer thread panicked")),
        }
        if exit_kill {
            if !wait_gone(pid, EXIT_TIMEOUT) {
                return Err(run.report("with PTRACE_O_EXITKILL the tree outlived its tracer"));
            }
        } else {
            sleep(Duration::from_millis(50));
            if !run.root_alive() {
                return Err(run.report("without PTRACE_O_EXITKILL the tree died with its tracer"));
            }
            ask_whoami(&run, pid)?;
        }
        finish(run)?;
    }
    Ok(())
}
