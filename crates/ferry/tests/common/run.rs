//! The harness of engine_suite and real_programs: one program under test at a time, moved by
//! `ferry checkpoint` and `ferry restore` or `ferry migrate` around a local cluster, followed
//! through each move, and its whole tree killed and reaped afterwards, also when it failed.

use super::cluster::{self, Cluster};
use super::{
    clear_stale_runs, is_guest_init, parent_pid, proc_state, reap_zombies, status_field, tail,
    tree_pids, wait_gone, with_newline,
};
use libtest_mimic::{Arguments, Conclusion, Failed};
use std::fmt::Write as _;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Mutex;
use std::thread::sleep;
use std::time::{Duration, Instant};

/// A guest init exits within a second of being alone (it looks once a second).
pub const INIT_GONE_TIMEOUT: Duration = Duration::from_secs(5);
/// The hops of a migration trial: around a cluster of three nodes and home again.
pub const MIG_HOPS: [(&str, &str); 3] = [("a", "b"), ("b", "c"), ("c", "a")];

/// A harness's time limits, and how much of a log its failure messages show.
#[derive(Clone, Copy)]
pub struct Limits {
    /// for a program to be ready
    pub ready: Duration,
    /// for the root to exit after its verdict
    pub exit: Duration,
    /// for a checkpointed tree to be gone
    pub tree_gone: Duration,
    /// for one ferry command
    pub ferry: Duration,
    pub log_tail: usize,
}

/// What every run of a harness shares.
pub struct Harness {
    name: &'static str,
    /// compiled programs
    pub bin_dir: PathBuf,
    /// this harness process's run directories
    pub runs_dir: PathBuf,
    pub ferry: PathBuf,
    /// keep the run directories of passing runs too
    pub keep: bool,
    pub limits: Limits,
    /// The local cluster of the migration trials: started by the first of them (or why it
    /// could not be), stopped before the harness exits.
    cluster: Mutex<Option<Result<Cluster, String>>>,
}

impl Harness {
    /// Makes this process a child subreaper (restored processes are detached by `ferry
    /// restore`; as their parent by reparenting we can reap them) and clears the run
    /// directories of harnesses that are gone. `ferry_var` names another ferry binary to run,
    /// `keep_var` asks to keep the directories of passing runs.
    pub fn new(name: &'static str, ferry_var: &str, keep_var: &str, limits: Limits) -> Harness {
        // SAFETY: prctl with integer arguments only changes this process's flag.
        let rc = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
        if rc != 0 {
            eprintln!(
                "{name}: PR_SET_CHILD_SUBREAPER failed: {}",
                io::Error::last_os_error()
            );
        }
        let work = option_env!("CARGO_TARGET_TMPDIR")
            .map(PathBuf::from)
            .unwrap_or_else(std::env::temp_dir)
            .join(name);
        // Several harnesses may run at once (e.g. a developer's and an agent's): each gets its
        // own run directories; those of finished ones are cleared when the next one starts.
        let runs_root = work.join("runs");
        clear_stale_runs(&runs_root);
        Harness {
            name,
            bin_dir: work.join("bin"),
            runs_dir: runs_root.join(std::process::id().to_string()),
            ferry: std::env::var_os(ferry_var)
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from(cluster::FERRY)),
            keep: std::env::var_os(keep_var).is_some_and(|v| !v.is_empty() && v != "0"),
            limits,
            cluster: Mutex::new(None),
        }
    }

    /// The command line's arguments, with one trial at a time: restore needs the original
    /// PIDs free.
    pub fn args() -> Arguments {
        let mut args = Arguments::from_args();
        args.test_threads = Some(1);
        args
    }

    /// The directory of the migration trials' cluster of three; the first call starts it.
    pub fn cluster_dir(&self) -> Result<PathBuf, String> {
        let mut slot = self.cluster.lock().unwrap_or_else(|e| e.into_inner());
        match slot.get_or_insert_with(|| Cluster::up_unadopted(self.name, 3)) {
            Ok(c) => Ok(c.dir.clone()),
            Err(e) => Err(e.clone()),
        }
    }

    /// Stops the cluster (`exit` runs no destructors), then exits with the trials' verdict.
    pub fn exit(&self, conclusion: Conclusion) -> ! {
        let cluster = self
            .cluster
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        drop(cluster);
        let _ = fs::remove_dir(&self.runs_dir); // only if nothing was kept
        conclusion.exit()
    }
}

// ---------------------------------------------------------------------------
// Running commands with a time limit.

pub struct CmdOutput {
    /// None: killed at the time limit.
    pub status: Option<ExitStatus>,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
    pub timeout: Duration,
}

impl CmdOutput {
    pub fn success(&self) -> bool {
        self.status.is_some_and(|s| s.success())
    }

    pub fn status_text(&self) -> String {
        match self.status {
            Some(st) => st.to_string(),
            None => format!("killed after {:?}", self.timeout),
        }
    }

    /// The non-empty lines of stderr, joined: a one-line summary.
    pub fn stderr_summary(&self) -> String {
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
pub fn run_with_timeout(
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
pub struct Run {
    /// the trial's name, for failure messages
    pub name: String,
    /// images, and the outputs of the commands run
    pub base: PathBuf,
    /// the program's working directory
    pub t: PathBuf,
    /// The root's PID as the program sees it (getpid()).
    pub root: i32,
    /// The root's PID here: `root`, until it is restored or migrated into a PID namespace.
    pub host: i32,
    /// Whether the root lives in a PID namespace of its own (and is no longer our child).
    pub in_ns: bool,
    /// Host PIDs of the guest inits of the namespaces a migrated tree has lived in.
    pub inits: Vec<i32>,
    pub child: Option<Child>,
    /// The original, left at home as its body's deputy by a migration (our child still).
    pub deputy: Option<Child>,
    /// exit status of the root, once seen
    pub exited: Option<ExitStatus>,
    /// commands run so far (ferry, redis-cli...) with their outputs
    history: String,
    commands: u32,
    ferry: PathBuf,
    limits: Limits,
    keep: bool,
}

/// One hop of a migration trial, for its failure messages.
pub struct Hop {
    pub n: u32,
    pub from: &'static str,
    pub to: &'static str,
    cluster_dir: PathBuf,
}

impl Hop {
    /// A failure of this hop, with the tails of both daemons' logs.
    pub fn fail(&self, run: &Run, what: &str) -> Failed {
        let (n, from, to) = (self.n, self.from, self.to);
        let f = run.report(&format!("migration {n} ({from} -> {to}): {what}"));
        Failed::from(format!(
            "{}\n{}",
            f.message().unwrap_or(""),
            cluster::daemon_logs(&self.cluster_dir, &[from, to])
        ))
    }
}

impl Run {
    /// Starts `cmd` by the programs' protocol (see `tests/programs/README.md`): in a fresh
    /// directory `dir/t` under the harness's runs, stdin /dev/null, stdout and stderr appended
    /// to `t/log`, in a session of its own.
    pub fn start(h: &Harness, name: &str, dir: &str, mut cmd: Command) -> Result<Run, Failed> {
        let base = h.runs_dir.join(dir);
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
            name: name.to_owned(),
            base,
            t,
            root,
            host: root,
            in_ns: false,
            inits: Vec::new(),
            child: Some(child),
            exited: None,
            deputy: None,
            history: String::new(),
            commands: 0,
            ferry: h.ferry.clone(),
            limits: h.limits,
            keep: h.keep,
        })
    }

    pub fn file(&self, name: &str) -> PathBuf {
        self.t.join(name)
    }

    /// A failure: what went wrong first, then the result file, the commands
    /// run so far with their outputs, and the program's log.
    pub fn report(&self, what: &str) -> Failed {
        let mut msg = format!("{}: {what}\n", self.name);
        if let Ok(r) = fs::read_to_string(self.file("result")) {
            let _ = writeln!(msg, "--- result: {}", r.trim_end());
        }
        msg.push_str(&self.history);
        let log = fs::read(self.file("log")).unwrap_or_default();
        let log = String::from_utf8_lossy(tail(&log, self.limits.log_tail));
        let _ = write!(
            msg,
            "--- {} (last {} KiB):\n{}",
            self.file("log").display(),
            self.limits.log_tail / 1024,
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
    pub fn command(
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
                    with_newline(tail(text.as_bytes(), self.limits.log_tail))
                );
            }
        }
        Ok(out)
    }

    /// The `ferry` binary the trials run.
    pub fn ferry_bin(&self) -> &Path {
        &self.ferry
    }

    pub fn ferry(&mut self, label: &str, args: &[&str]) -> Result<CmdOutput, Failed> {
        let mut cmd = Command::new(&self.ferry);
        cmd.args(args);
        self.command(label, cmd, None, self.limits.ferry)
    }

    /// What to say when `what`, a command that should have succeeded, failed with `out`: its
    /// status and stderr, and whether the program survived it.
    pub fn why_failed(&mut self, what: &str, out: &CmdOutput) -> String {
        let fate = if self.root_alive() {
            "the program is still running".to_string()
        } else {
            format!("the program did not survive it{}", self.exit_note())
        };
        format!(
            "{what} failed ({}): {}\n({fate})",
            out.status_text(),
            out.stderr_summary()
        )
    }

    /// Forget the std `Child` once it has exited (or was reaped by
    /// `reap_zombies`, which makes `try_wait` fail with ECHILD).
    pub fn poll_child(&mut self) {
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
    pub fn exit_note(&self) -> String {
        self.exited.map(|st| format!(" ({st})")).unwrap_or_default()
    }

    /// Is the root process still running (not gone, not a zombie)?
    pub fn root_alive(&mut self) -> bool {
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
    pub fn wait_for<T>(
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
            sleep(Duration::from_millis(5));
        }
    }

    /// Wait for `t/ready`; it must name the root pid, and come before any verdict.
    pub fn wait_ready(&mut self) -> Result<(), Failed> {
        let text = self.wait_for(
            "ready file",
            self.limits.ready,
            |r| match fs::read_to_string(r.file("ready")) {
                Ok(text) => Ok(Some(text)),
                Err(_) if r.file("result").exists() => {
                    Err(r.report("the program gave a verdict before it was ready"))
                }
                Err(_) => Ok(None),
            },
        )?;
        match text.trim().parse::<i32>() {
            Ok(pid) if pid == self.root => Ok(()),
            _ => Err(self.report(&format!(
                "ready file says {:?}, expected pid {}",
                text.trim(),
                self.root
            ))),
        }
    }

    /// Creates `t/name` (`go`, `stop`).
    pub fn touch(&self, name: &str) -> Result<(), Failed> {
        File::create(self.file(name))
            .map_err(|e| self.report(&format!("cannot create {name}: {e}")))?;
        Ok(())
    }

    /// Wait for the verdict; require PASS and a clean exit of the root.
    pub fn wait_pass(&mut self, timeout: Duration) -> Result<(), Failed> {
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
            if start.elapsed() > timeout {
                return Err(self.report(&format!("no result within {timeout:?} of go")));
            }
            sleep(Duration::from_millis(5));
        };
        if verdict.trim_end() != "PASS" {
            return Err(self.report(&format!(
                "the program checked its state and did not pass: {}",
                verdict.trim_end()
            )));
        }
        self.require_clean_exit("said PASS")
    }

    /// The root exits with status 0 (in a namespace of its own: the root, and every guest
    /// namespace it lived in, are gone; its status went to its namespace's init).
    pub fn require_clean_exit(&mut self, after: &str) -> Result<(), Failed> {
        if self.in_ns {
            return self.require_gone(after);
        }
        let exit = self.limits.exit;
        match self.wait_root_exit(exit) {
            Some(st) if st.success() => Ok(()),
            Some(st) => Err(self.report(&format!("the program {after} but exited with {st}"))),
            None => Err(self.report(&format!(
                "the program {after} but did not exit within {exit:?}"
            ))),
        }
    }

    /// A tree in a namespace of its own is gone: its root, and the init of each namespace it
    /// lived in (an init leaves once nothing else is left in its namespace).
    pub fn require_gone(&mut self, after: &str) -> Result<(), Failed> {
        let exit = self.limits.exit;
        // Before anything reaps zombies (wait_gone does): the deputy's status is ours to see.
        if let Some(mut d) = self.deputy.take() {
            // The parent at home sees the end its body had: the program's clean exit.
            let start = Instant::now();
            let st = loop {
                match d.try_wait() {
                    Ok(Some(st)) => break Some(st),
                    // Reaped already by a harness loop that reaps every zombie: it ended.
                    Err(_) => break Some(ExitStatus::from_raw(0)),
                    Ok(None) => {}
                }
                if start.elapsed() > exit {
                    break None;
                }
                sleep(Duration::from_millis(5));
            };
            match st {
                Some(st) if st.success() => {}
                Some(st) => {
                    return Err(self.report(&format!(
                        "the program {after}, but its deputy at home ended with {st}"
                    )))
                }
                None => {
                    let _ = d.kill();
                    return Err(self.report(&format!(
                        "the program {after}, but its deputy at home did not end within {exit:?}"
                    )));
                }
            }
        }
        if !wait_gone(self.host, exit) {
            return Err(self.report(&format!(
                "the program {after} but did not exit within {exit:?}"
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

    /// Reap the root (our child, or reparented to us) and return its status.
    pub fn wait_root_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
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

    // --- Moves ----------------------------------------------------------------------------

    /// The image directory of round `round`.
    pub fn image(&self, round: u32) -> PathBuf {
        self.base.join(format!("img{round}"))
    }

    /// `ferry checkpoint HOST --dir IMG ARGS` into a fresh image of round `round`.
    pub fn checkpoint(&mut self, round: u32, args: &[&str]) -> Result<CmdOutput, Failed> {
        let img = self.image(round);
        let _ = fs::remove_dir_all(&img);
        let img = img.to_string_lossy().into_owned();
        let pid = self.host.to_string();
        let mut all = vec!["checkpoint", &pid, "--dir", &img];
        all.extend_from_slice(args);
        self.ferry(&format!("checkpoint{round}"), &all)
    }

    /// After a checkpoint (which kills the tree): the whole tree must be gone and reaped, so
    /// that restore can have the PIDs back.
    pub fn wait_tree_gone(&mut self, round: u32) -> Result<(), Failed> {
        let start = Instant::now();
        loop {
            self.poll_child();
            reap_zombies();
            let left: Vec<i32> = tree_pids(self.root).into_iter().collect();
            if left.is_empty() && self.child.is_none() {
                self.exited = None; // that was the checkpointed incarnation
                return Ok(());
            }
            if start.elapsed() > self.limits.tree_gone {
                return Err(self.report(&format!(
                    "checkpoint (round {round}) succeeded but processes are still there after \
                     {:?}: {left:?}",
                    self.limits.tree_gone
                )));
            }
            sleep(Duration::from_millis(5));
        }
    }

    /// `ferry restore` from round `round`'s image: the root must come back
    /// with its PID and be running.
    pub fn restore(&mut self, round: u32) -> Result<(), Failed> {
        let img = self.image(round).to_string_lossy().into_owned();
        let rs = self.ferry(&format!("restore{round}"), &["restore", "--dir", &img])?;
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

    /// `ferry --node FROM migrate ROOT --to TO --json`, hop `hop` (1-based) of [`MIG_HOPS`]
    /// around the harness's cluster (started by the first hop of a harness).
    pub fn migrate(&mut self, h: &Harness, hop: u32) -> Result<(Hop, CmdOutput), Failed> {
        let cluster_dir = h.cluster_dir().map_err(|e| self.report(&e))?;
        let (from, to) = MIG_HOPS[hop as usize - 1];
        let mut cmd = Command::new(&self.ferry);
        cmd.env("FERRY_CLUSTER_DIR", &cluster_dir)
            .env("FERRY_NODE", from)
            .args(["migrate", &self.root.to_string(), "--to", to, "--json"]);
        // FERRY_TEST_MEMORY=precopy (or eager) runs the suite's migrations in that mode.
        if let Ok(mode) = std::env::var("FERRY_TEST_MEMORY") {
            cmd.args(["--memory", &mode]);
        }
        let out = self.command(&format!("migrate{hop}"), cmd, None, self.limits.ferry)?;
        let hop = Hop {
            n: hop,
            from,
            to,
            cluster_dir,
        };
        Ok((hop, out))
    }

    /// After a migration that succeeded (`out`): the copy it came from must be gone and the
    /// new one run under the tree's PID in a guest namespace, whose host PID (`dest_pid`) the
    /// harness follows from now on.
    pub fn follow_migration(&mut self, hop: &Hop, out: &CmdOutput) -> Result<(), Failed> {
        let report: serde_json::Value = serde_json::from_str(&out.stdout)
            .map_err(|e| hop.fail(self, &format!("bad JSON report: {e}")))?;
        let Some(dest) = report
            .get("dest_pid")
            .and_then(|v| v.as_i64())
            .map(|v| v as i32)
            .filter(|&p| p > 0)
        else {
            return Err(hop.fail(self, "the report has no dest_pid"));
        };
        // (On a separate node, that is a PID of the node's namespace: find ours.)
        let Some(dest) = cluster::host_pid(&hop.cluster_dir, hop.to, dest) else {
            return Err(hop.fail(
                self,
                &format!("no process of node {} is its PID {dest}", hop.to),
            ));
        };
        let old = self.host;
        // Back at home, rebuilt in place of its deputy (a tree its last node found fit: see
        // docs/limitations.md, "Coming home"; any other comes home as a body beside its
        // deputy): it is our child again, under its own PID, in our namespaces, traced by
        // nobody.
        if self.deputy.is_some() && hop.to == MIG_HOPS[0].0 && dest == self.root {
            if !wait_gone(old, self.limits.tree_gone) {
                return Err(hop.fail(
                    self,
                    &format!("came home, but the copy it left (PID {old}) still runs"),
                ));
            }
            if tracer_of(dest) != 0 || status_field(dest, "NSpid").split_whitespace().count() != 1 {
                return Err(hop.fail(
                    self,
                    &format!(
                        "came home, but PID {dest} is traced by {} or in a namespace (NSpid {:?})",
                        tracer_of(dest),
                        status_field(dest, "NSpid")
                    ),
                ));
            }
            self.child = self.deputy.take();
            self.exited = None;
            self.host = dest;
            self.in_ns = false;
            if !self.root_alive() {
                return Err(hop.fail(self, &format!("the root (PID {dest}) is not running")));
            }
            return Ok(());
        }
        // The copy it came from is gone; except the original at home (our child), which stays
        // as the deputy of its body: alive, traced, and the one whose end we wait for.
        self.poll_child();
        if !self.in_ns && self.child.is_some() {
            if tracer_of(old) == 0 {
                return Err(hop.fail(
                    self,
                    &format!("migrated from home, but PID {old} there is no deputy"),
                ));
            }
            self.deputy = self.child.take();
        } else if !wait_gone(old, self.limits.tree_gone) {
            return Err(hop.fail(
                self,
                &format!("migrated, but the copy it left (PID {old}) still runs"),
            ));
        }
        if self.deputy.is_none() {
            self.poll_child();
        }
        self.exited = None;
        self.host = dest;
        self.in_ns = true;
        // Ours first, the tree's own last (a separate node's in between).
        let nspid = status_field(dest, "NSpid");
        let levels: Vec<&str> = nspid.split_whitespace().collect();
        let (ours, theirs) = (dest.to_string(), self.root.to_string());
        if levels.len() < 2
            || levels.first() != Some(&ours.as_str())
            || levels.last() != Some(&theirs.as_str())
        {
            return Err(hop.fail(
                self,
                &format!(
                    "the root (PID {dest} here) has NSpid {nspid:?}, expected \"{dest} ... {}\"",
                    self.root
                ),
            ));
        }
        match parent_pid(dest) {
            Some(init) if is_guest_init(init) => self.inits.push(init),
            p => {
                return Err(hop.fail(
                    self,
                    &format!("the root's parent (PID {p:?}) is not a guest init"),
                ))
            }
        }
        if !self.root_alive() {
            return Err(hop.fail(self, &format!("the root (PID {dest}) is not running")));
        }
        Ok(())
    }

    // --- The end --------------------------------------------------------------------------

    /// Kill every process of the run (also after failures) and reap them.
    pub fn cleanup(&mut self) {
        if let Some(mut d) = self.deputy.take() {
            let _ = d.kill();
            let _ = d.wait();
        }
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
        super::detach_mounts_under(&self.base);
    }

    /// Passed: clean up, and drop the run directory unless asked to keep it.
    pub fn finish(mut self) -> Result<(), Failed> {
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

/// The PID tracing `pid` (0 if none, or gone).
pub fn tracer_of(pid: i32) -> i32 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("TracerPid:"))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or(0)
}
