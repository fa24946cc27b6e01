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
//! Environment: `FERRY_SUITE_FILTER=substr[,substr...]` runs only programs whose
//! name contains one of the `substr`s; `FERRY_SUITE_KEEP=1` keeps the run directories of
//! passing trials too (failing ones are always kept); `FERRY_SUITE_CC`
//! overrides the C compiler (default `gcc`); `FERRY_SUITE_FERRY` runs another
//! `ferry` binary (e.g. a release build) instead of the one cargo built (the
//! `mig::` cluster's daemons are always the one cargo built).

use std::collections::HashMap;
use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::sleep;
use std::time::{Duration, Instant, SystemTime};

mod common;

use common::run::{CmdOutput, Harness, Limits, Run, INIT_GONE_TIMEOUT, MIG_HOPS};
use common::*;
use libtest_mimic::{Failed, Trial};

const READY_TIMEOUT: Duration = Duration::from_secs(10);
const NATIVE_RESULT_TIMEOUT: Duration = Duration::from_secs(10);
const CR_RESULT_TIMEOUT: Duration = Duration::from_secs(20);
const EXIT_TIMEOUT: Duration = Duration::from_secs(5);
const TREE_GONE_TIMEOUT: Duration = Duration::from_secs(10);
const LIMITS: Limits = Limits {
    ready: READY_TIMEOUT,
    exit: EXIT_TIMEOUT,
    tree_gone: TREE_GONE_TIMEOUT,
    ferry: Duration::from_secs(60),
    log_tail: 16 * 1024,
};

/// What all trials share.
struct Suite {
    harness: Harness,
    programs_dir: PathBuf,
    cc: String,
    /// program name -> compiled binary or compiler output
    built: Mutex<HashMap<String, Result<PathBuf, String>>>,
}

type ExtraTrial = fn(&Suite) -> Result<(), Failed>;

fn main() {
    common::seal_inherited_fds();
    let args = Harness::args();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let root = root.canonicalize().unwrap_or(root);
    let programs_dir = root.join("tests/programs");
    let suite = Arc::new(Suite {
        harness: Harness::new(
            "engine_suite",
            "FERRY_SUITE_FERRY",
            "FERRY_SUITE_KEEP",
            LIMITS,
        ),
        programs_dir: programs_dir.clone(),
        cc: std::env::var("FERRY_SUITE_CC").unwrap_or_else(|_| "gcc".into()),
        built: Mutex::new(HashMap::new()),
    });

    let filter = std::env::var("FERRY_SUITE_FILTER").unwrap_or_default();
    let programs: Vec<String> = list_programs(&programs_dir)
        .into_iter()
        .filter(|p| filter.split(',').any(|f| p.contains(f)))
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
    for name in programs
        .iter()
        .filter(|n| lazy_trial(n) && !pending.contains_key(*n))
    {
        let (s, n) = (suite.clone(), name.clone());
        trials.push(Trial::test(format!("lazy::{name}"), move || {
            run_cr(&s, &n, None, Mode::Lazy)
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
        let extras: [(&str, ExtraTrial); 9] = [
            ("clone_beside_original", run_clone_beside_original),
            ("listener_beside_original", run_listener_beside_original),
            ("clocks_ahead", run_clocks_ahead),
            ("refuse_namespace_init", run_refuse_namespace_init),
            ("held_then_killed", |s| run_held(s, false)),
            ("held_then_resumed", |s| run_held(s, true)),
            ("exit_kill", run_exit_kill),
            ("lazy_corrupted_page_kills", run_lazy_corrupted),
            ("lazy_restorer_killed", run_lazy_restorer_killed),
        ];
        for (name, f) in extras {
            let s = suite.clone();
            trials.push(Trial::test(format!("ns_extra::{name}"), move || f(&s)));
        }
    }
    if filter.split(',').any(|f| "mem_extra".contains(f)) {
        let s = suite.clone();
        trials.push(Trial::test(
            "mem_extra::adjacent_mappings_few_records",
            move || run_adjacent_mappings_few_records(&s),
        ));
    }
    widen_ping_groups();
    let conclusion = libtest_mimic::run(&args, trials);
    suite.harness.exit(conclusion);
}

/// `fd_icmp_ping` makes ping sockets, which need the maker's group in this machine's
/// `net.ipv4.ping_group_range` (most distributions let every group; a bare kernel none): the
/// range is widened to root's group before the `mig::` cluster starts (`ferry cluster up` gives
/// its separate nodes this machine's range), and left so: suites run at once by others would
/// otherwise narrow it under each other's feet (one did, within a minute of this landing).
fn widen_ping_groups() {
    const PING_GROUP_RANGE: &str = "/proc/sys/net/ipv4/ping_group_range";
    let Ok(old) = std::fs::read_to_string(PING_GROUP_RANGE) else {
        return;
    };
    let range: Vec<i64> = old
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    if let [lo, hi] = range[..] {
        if lo <= 0 && 0 <= hi {
            return;
        }
    }
    if let Err(e) = std::fs::write(PING_GROUP_RANGE, "0 0") {
        eprintln!("cannot widen {PING_GROUP_RANGE} to root's group: {e}");
    }
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
    // The headers every program may include (ferry_test.h, ferry_tcp.h ...).
    let headers: Vec<PathBuf> = fs::read_dir(&suite.programs_dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "h"))
                .collect()
        })
        .unwrap_or_default();
    let bin = suite.harness.bin_dir.join(name);
    let result = (|| {
        fs::create_dir_all(&suite.harness.bin_dir)
            .map_err(|e| format!("mkdir {}: {e}", suite.harness.bin_dir.display()))?;
        let newest_input = std::iter::once(mtime(&src))
            .chain(headers.iter().map(|h| mtime(h)))
            .flatten()
            .max();
        if let (Some(b), Some(i)) = (mtime(&bin), newest_input) {
            if b > i {
                return Ok(bin.clone());
            }
        }
        // Compile to a private name, then rename: another suite may be
        // building or running the same program right now.
        let tmp = suite
            .harness
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
// One run of one program (the run itself is common::run's).

/// Where a trial rebuilds its tree.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// `ferry restore`: in our namespaces, under the original PIDs.
    Here,
    /// `ferry restore --pid-namespace`: in fresh namespaces of its own.
    Namespace,
    /// `ferry restore --lazy`: memory comes from the image as it is touched. In the last
    /// round the push waits [`LAZY_PUSH_AFTER_MS`] and `go` is touched as soon as the tree
    /// runs, so the program checks its memory while its pages are still owed.
    Lazy,
}

/// The background push of a lazy trial's last round starts this late.
const LAZY_PUSH_AFTER_MS: &str = "400";

/// Programs that get a `lazy::` trial: those about memory, registers and threads, and a few
/// trees (the others hold no more private memory than these).
fn lazy_trial(name: &str) -> bool {
    ["mem_", "thr_", "cpu_"].iter().any(|p| name.starts_with(p))
        || [
            "proc_tree_children",
            "proc_zombie",
            "sig_handlers",
            "sys_blocked_read",
            "fd_pipe_buffered",
            "proc_aio_kernel",
            "proc_aio_posix",
        ]
        .contains(&name)
}

/// Builds and starts program `name` for a trial of kind `mode` ("native", "cr", ...).
fn start(suite: &Suite, name: &str, mode: &str) -> Result<Run, Failed> {
    let bin = build(suite, name)?;
    start_bin(suite, name, mode, &bin)
}

fn start_bin(suite: &Suite, name: &str, mode: &str, bin: &Path) -> Result<Run, Failed> {
    Run::start(
        &suite.harness,
        name,
        &format!("{name}.{mode}"),
        Command::new(bin),
    )
}

/// How a round of checkpoint and restore went.
enum Round {
    Restored,
    /// `ferry checkpoint` failed (its output is here); the program should be untouched.
    Refused(CmdOutput),
}

/// Checkpoint, wait for the tree to go, restore; the root must come back with its PID.
fn checkpoint_restore(run: &mut Run, round: u32, mode: Mode) -> Result<Round, Failed> {
    let ck = run.checkpoint(round, &[])?;
    match ck.status {
        Some(st) if st.success() => {}
        Some(_) => return Ok(Round::Refused(ck)),
        None => return Err(run.report(&format!("ferry checkpoint (round {round}) hung"))),
    }
    match mode {
        Mode::Namespace => {
            let img = run.image(round).to_string_lossy().into_owned();
            restore_in_namespace(run, round, &img)?;
        }
        Mode::Lazy => {
            run.wait_tree_gone(round)?;
            restore_lazy(run, round)?;
        }
        Mode::Here => {
            run.wait_tree_gone(round)?;
            run.restore(round)?;
            if run.file("result").exists() {
                return Err(run.report(&format!(
                    "program gave a verdict before go (after restore round {round})"
                )));
            }
        }
    }
    Ok(Round::Restored)
}

/// After a checkpoint (which killed the tree): `ferry restore --lazy`, in the background. The
/// root must come back with its PID while memory is still arriving; in round 2 `go` is touched
/// then. `ferry restore` must end in success once every page is in.
fn restore_lazy(run: &mut Run, round: u32) -> Result<(), Failed> {
    let img = run.image(round).to_string_lossy().into_owned();
    let push = if round == 2 { LAZY_PUSH_AFTER_MS } else { "0" };
    let out_path = run.base.join(format!("restore-lazy{round}.stdout"));
    let err_path = run.base.join(format!("restore-lazy{round}.stderr"));
    let files = File::create(&out_path).and_then(|o| Ok((o, File::create(&err_path)?)));
    let (out, err) = files.map_err(|e| run.report(&format!("create output files: {e}")))?;
    let mut child = Command::new(run.ferry_bin())
        .args(["restore", "--dir", &img, "--lazy", "--push-after-ms", push])
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .map_err(|e| run.report(&format!("run ferry restore --lazy: {e}")))?;
    let started = Instant::now();
    let stderr = |p: &Path| fs::read_to_string(p).unwrap_or_default();
    let pid = loop {
        // Whether it has ended is asked before its output is read: one that printed its PID and
        // ended between the two is not taken for one that ended without printing it.
        let ended = child.try_wait();
        let text = fs::read_to_string(&out_path).unwrap_or_default();
        if let Some(line) = text.lines().next().filter(|_| text.ends_with('\n')) {
            break line.trim().parse::<i32>().ok();
        }
        if let Ok(Some(st)) = ended {
            return Err(run.report(&format!(
                "ferry restore --lazy (round {round}) ended ({st}) without a PID: {}",
                stderr(&err_path)
            )));
        }
        if started.elapsed() > CR_RESULT_TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            return Err(run.report(&format!(
                "ferry restore --lazy (round {round}) printed no PID"
            )));
        }
        sleep(Duration::from_millis(2));
    };
    if pid != Some(run.root) {
        let _ = child.kill();
        let _ = child.wait();
        return Err(run.report(&format!(
            "ferry restore --lazy (round {round}) gave root pid {pid:?}, expected {}",
            run.root
        )));
    }
    if round == 2 {
        run.touch("go")?;
    }
    let status = loop {
        if let Ok(Some(st)) = child.try_wait() {
            break st;
        }
        if started.elapsed() > CR_RESULT_TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            return Err(run.report(&format!(
                "ferry restore --lazy (round {round}) did not finish bringing memory in"
            )));
        }
        sleep(Duration::from_millis(5));
    };
    if !status.success() {
        return Err(run.report(&format!(
            "ferry restore --lazy (round {round}) failed ({status}): {}",
            stderr(&err_path)
        )));
    }
    Ok(())
}

/// `ferry restore --lazy` from an image with one flipped byte in a record of pages: the tree
/// runs, and when that record is needed (a fault or the push) the checksum fails; the whole
/// tree must then be killed (no verdict, nothing left waiting for a page), and the command
/// must fail naming the checksum.
fn run_lazy_corrupted(suite: &Suite) -> Result<(), Failed> {
    let mut run = start(suite, "thr_lazy_same_pages", "lazy_corrupt")?;
    run.wait_ready()?;
    let ck = run.checkpoint(1, &[])?;
    if !ck.success() {
        return Err(run.report("ferry checkpoint failed"));
    }
    run.wait_tree_gone(1)?;
    let img = run.image(1).join(ferry_image::IMAGE_FILE);
    let flipped = (|| -> Result<(), String> {
        let f = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&img)
            .map_err(|e| e.to_string())?;
        let idx = ferry_image::index::index_pages(&f).map_err(|e| e.to_string())?;
        let big = idx
            .records
            .iter()
            .max_by_key(|r| r.len)
            .ok_or("no pages in the image")?;
        use std::os::unix::fs::FileExt;
        let at = big.at + 28 + big.len / 2;
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, at).map_err(|e| e.to_string())?;
        f.write_all_at(&[b[0] ^ 0x40], at)
            .map_err(|e| e.to_string())
    })();
    flipped.map_err(|e| run.report(&format!("corrupt the image: {e}")))?;
    let dir = run.image(1).to_string_lossy().into_owned();
    let mut child = Command::new(run.ferry_bin())
        .args(["restore", "--dir", &dir, "--lazy", "--push-after-ms"])
        .arg(LAZY_PUSH_AFTER_MS)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| run.report(&format!("run ferry restore --lazy: {e}")))?;
    // The tree runs (its PID printed) before the bad record is read.
    let mut first = String::new();
    let stdout = child.stdout.take().expect("piped");
    io::BufRead::read_line(&mut io::BufReader::new(stdout), &mut first)
        .map_err(|e| run.report(&format!("read ferry's output: {e}")))?;
    if first.trim().parse::<i32>().ok() != Some(run.root) {
        let _ = child.kill();
        return Err(run.report(&format!(
            "ferry restore --lazy printed {first:?}, not the root's PID {}",
            run.root
        )));
    }
    run.touch("go")?;
    let started = Instant::now();
    let status = loop {
        if let Ok(Some(st)) = child.try_wait() {
            break st;
        }
        if started.elapsed() > CR_RESULT_TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            return Err(run.report("ferry restore --lazy hung on a corrupted image"));
        }
        sleep(Duration::from_millis(5));
    };
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = io::Read::read_to_string(&mut e, &mut err);
    }
    if status.success() || !err.contains("checksum mismatch") || !err.contains("killed") {
        return Err(run.report(&format!(
            "ferry restore --lazy from a corrupted image ended ({status}) with: {err}"
        )));
    }
    if !wait_gone(run.root, TREE_GONE_TIMEOUT) {
        return Err(run.report("the tree still runs after its image failed"));
    }
    if run.file("result").exists() {
        return Err(run.report(&format!(
            "the program gave a verdict on corrupted memory: {:?}",
            fs::read_to_string(run.file("result")).unwrap_or_default()
        )));
    }
    run.finish()
}

/// `ferry restore --lazy` killed with SIGKILL while pages are owed (the push held back): its
/// userfaultfds close with it, and without its guardian the kernel would zero-fill every owed
/// page. The tree must be killed instead (its guardian says so): after `go` it must give no
/// verdict (on zeroed memory it would FAIL, or crash) and be gone.
fn run_lazy_restorer_killed(suite: &Suite) -> Result<(), Failed> {
    let mut run = start(suite, "thr_lazy_same_pages", "lazy_killed")?;
    run.wait_ready()?;
    let ck = run.checkpoint(1, &[])?;
    if !ck.success() {
        return Err(run.report("ferry checkpoint failed"));
    }
    run.wait_tree_gone(1)?;
    let dir = run.image(1).to_string_lossy().into_owned();
    // Its guardian inherits its stderr and says there what it did.
    let err_path = run.base.join("restore-lazy.stderr");
    let err = File::create(&err_path).map_err(|e| run.report(&format!("create: {e}")))?;
    let mut child = Command::new(run.ferry_bin())
        .args([
            "restore",
            "--dir",
            &dir,
            "--lazy",
            "--push-after-ms",
            "600000",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(err)
        .spawn()
        .map_err(|e| run.report(&format!("run ferry restore --lazy: {e}")))?;
    let mut first = String::new();
    let stdout = child.stdout.take().expect("piped");
    io::BufRead::read_line(&mut io::BufReader::new(stdout), &mut first)
        .map_err(|e| run.report(&format!("read ferry's output: {e}")))?;
    let _ = child.kill();
    let _ = child.wait();
    if first.trim().parse::<i32>().ok() != Some(run.root) {
        return Err(run.report(&format!(
            "ferry restore --lazy printed {first:?}, not the root's PID {}",
            run.root
        )));
    }
    run.touch("go")?;
    if !wait_gone(run.root, TREE_GONE_TIMEOUT) {
        return Err(run.report("the tree still runs after its page server was killed"));
    }
    if run.file("result").exists() {
        return Err(run.report(&format!(
            "the program ran on without its memory and said {:?}",
            fs::read_to_string(run.file("result")).unwrap_or_default()
        )));
    }
    // Gone, but killed, not crashed on zeroed memory: the guardian says so (just after the
    // kill, so its words may come a moment after the tree is gone).
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut said = fs::read_to_string(&err_path).unwrap_or_default();
    while !said.contains("the tree was killed") && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
        said = fs::read_to_string(&err_path).unwrap_or_default();
    }
    if !said.contains("the tree was killed") {
        return Err(run.report(&format!(
            "the tree is gone, but nothing killed it (it died on its own, its memory lost): \
             {said:?}"
        )));
    }
    run.finish()
}

/// After a checkpoint (which killed the tree): `ferry restore --pid-namespace`. The root must
/// come back with its PID inside the new namespace, under another PID here.
/// Returns the guest init's PID here.
fn restore_in_namespace(run: &mut Run, round: u32, img: &str) -> Result<i32, Failed> {
    let old = run.host;
    run.poll_child();
    reap_zombies();
    if !wait_gone(old, TREE_GONE_TIMEOUT) {
        return Err(run.report(&format!(
            "checkpoint (round {round}) succeeded but PID {old} still runs"
        )));
    }
    run.exited = None;
    let rs = run.ferry(
        &format!("restore{round}"),
        &["restore", "--dir", img, "--pid-namespace", "--json"],
    )?;
    if !rs.success() {
        return Err(run.report(&format!("ferry restore (round {round}) failed")));
    }
    let report: serde_json::Value = serde_json::from_str(&rs.stdout)
        .map_err(|e| run.report(&format!("restore (round {round}): bad JSON report: {e}")))?;
    let num = |k: &str| report.get(k).and_then(|v| v.as_i64()).map(|v| v as i32);
    let (Some(pid), Some(host), Some(init)) = (
        num("root_pid"),
        num("root_host_pid"),
        num("guest_init_host_pid"),
    ) else {
        return Err(run.report(&format!(
            "restore (round {round}): the report lacks root_pid, root_host_pid or \
             guest_init_host_pid"
        )));
    };
    if pid != run.root {
        return Err(run.report(&format!(
            "restore (round {round}) gave root pid {pid}, expected {}",
            run.root
        )));
    }
    run.host = host;
    run.in_ns = true;
    let nspid = status_field(host, "NSpid");
    let ids: Vec<i32> = nspid
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    if ids != [host, run.root] {
        return Err(run.report(&format!(
            "restore (round {round}): host PID {host} has NSpid {nspid:?}, expected \
             \"{host} {}\"",
            run.root
        )));
    }
    if !run.root_alive() {
        return Err(run.report(&format!(
            "root (host PID {host}) is not running after restore (round {round})"
        )));
    }
    if run.file("result").exists() {
        return Err(run.report(&format!(
            "program gave a verdict before go (after restore round {round})"
        )));
    }
    Ok(init)
}

// ---------------------------------------------------------------------------
// The trials.

fn run_native(suite: &Suite, name: &str) -> Result<(), Failed> {
    let mut run = start(suite, name, "native")?;
    run.wait_ready()?;
    run.touch("go")?;
    run.wait_pass(NATIVE_RESULT_TIMEOUT)?;
    run.finish()
}

fn run_cr(suite: &Suite, name: &str, pending: Option<&str>, mode: Mode) -> Result<(), Failed> {
    let label = match mode {
        Mode::Here => "cr",
        Mode::Namespace => "ns",
        Mode::Lazy => "lazy",
    };
    let mut run = start(suite, name, label)?;
    run.wait_ready()?;
    for round in 1..=2 {
        let Round::Refused(ck) = checkpoint_restore(&mut run, round, mode)? else {
            continue;
        };
        let Some(reason) = pending else {
            let why = run.why_failed(&format!("ferry checkpoint (round {round})"), &ck);
            return Err(run.report(&why));
        };
        if round != 1 {
            return Err(run.report(
                "the first checkpoint of a PENDING program succeeded but the second failed",
            ));
        }
        let what = format!("PENDING ({reason}): checkpoint failed as expected");
        check_refusal(&mut run, &what, &ck).map_err(|e| run.report(&e))?;
        return finish_after_refusal(
            run,
            &format!("PENDING ({reason}): after the refused checkpoint"),
        );
    }
    run.touch("go")?;
    run.wait_pass(CR_RESULT_TIMEOUT)?;
    if let Some(reason) = pending {
        eprintln!(
            "NOTE: {name} is listed in tests/programs/PENDING ({reason}) but passed checkpoint/restore: \
             it can be removed from PENDING"
        );
    }
    run.finish()
}

/// A refused checkpoint or migration (`what`, with output `out`) must say why on stderr and
/// leave the program running where it was, not stopped.
fn check_refusal(run: &mut Run, what: &str, out: &CmdOutput) -> Result<(), String> {
    if out.stderr.trim().is_empty() {
        return Err(format!("{what}, but printed no message on stderr"));
    }
    if !run.root_alive() {
        return Err(format!("{what}, but the program did not survive it"));
    }
    if let Some(st @ ('T' | 't')) = proc_state(run.host) {
        return Err(format!("{what}, but left the program stopped (state {st})"));
    }
    Ok(())
}

/// After a refusal: the program, untouched, must still pass.
fn finish_after_refusal(mut run: Run, context: &str) -> Result<(), Failed> {
    run.touch("go")?;
    run.wait_pass(NATIVE_RESULT_TIMEOUT)
        .map_err(|f| Failed::from(format!("{context}: {}", f.message().unwrap_or(""))))?;
    run.finish()
}

/// Moves a program a -> b -> c -> a with `ferry migrate`, then lets it check itself: it must
/// pass, and the whole tree be gone (each namespace it lived in emptied, and its init left).
fn run_mig(suite: &Suite, name: &str, pending: Option<&str>) -> Result<(), Failed> {
    let mut run = start(suite, name, "mig")?;
    run.wait_ready()?;
    for hop in 1..=MIG_HOPS.len() as u32 {
        let (hop, out) = run.migrate(&suite.harness, hop)?;
        match out.status {
            Some(st) if st.success() => {}
            None => return Err(hop.fail(&run, "ferry migrate hung")),
            Some(_) => {
                // Refused: the program must carry on where it was, untouched.
                let Some(reason) = pending else {
                    let why = run.why_failed("ferry migrate", &out);
                    return Err(hop.fail(&run, &why));
                };
                if hop.n != 1 {
                    return Err(hop.fail(
                        &run,
                        "the first migration of a PENDING program succeeded but a later one failed",
                    ));
                }
                let what = format!("PENDING ({reason}): migrate failed as expected");
                check_refusal(&mut run, &what, &out).map_err(|e| hop.fail(&run, &e))?;
                return finish_after_refusal(
                    run,
                    &format!("PENDING ({reason}): after the refused migration"),
                );
            }
        }
        run.follow_migration(&hop, &out)?;
        if run.file("result").exists() {
            return Err(hop.fail(&run, "the program gave a verdict before go"));
        }
    }
    run.touch("go")?;
    run.wait_pass(CR_RESULT_TIMEOUT)?;
    if let Some(reason) = pending {
        eprintln!(
            "NOTE: {name} is listed in tests/programs/PENDING ({reason}) but passed migration: \
             it can be removed from PENDING"
        );
    }
    run.finish()
}

/// Requires a successful ferry run.
fn ferry_ok(run: &mut Run, label: &str, args: &[&str]) -> Result<String, Failed> {
    let out = run.ferry(label, args)?;
    if out.success() {
        Ok(out.stdout)
    } else {
        Err(run.report(&format!("ferry {label} failed")))
    }
}

/// Starts tests/victims/whoami.c and waits until it handles SIGUSR1.
fn start_whoami(suite: &Suite, mode: &str) -> Result<Run, Failed> {
    let src = suite.programs_dir.join("../victims/whoami.c");
    let bin = build_from(suite, "victim_whoami", &src)?;
    let mut run = start_bin(suite, "whoami", mode, &bin)?;
    run.wait_for("whoami's SIGUSR1 handler", READY_TIMEOUT, |r| {
        let caught = u64::from_str_radix(&status_field(r.root, "SigCgt"), 16).unwrap_or(0);
        Ok((caught & (1 << 9) != 0).then_some(()))
    })?;
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
    ferry_ok(&mut run, "checkpoint", &args)?;
    let out = ferry_ok(
        &mut run,
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
    run.finish()
}

/// TCP listeners cloned into a namespace beside their original, which still listens on their
/// ports: the clone is bound (in TCP repair mode) but can listen only once the original is gone.
/// `ferry restore --pid-namespace` waits a few seconds for that, then fails, naming the address
/// and leaving nothing behind; when the original dies meanwhile (as in a migration between nodes
/// of one machine, where the source kills it at the commit point), the clone listens and passes.
fn run_listener_beside_original(suite: &Suite) -> Result<(), Failed> {
    let mut run = start(suite, "fd_tcp_listen", "ns_listen")?;
    run.wait_ready()?;
    let img = run.base.join("img").to_string_lossy().into_owned();
    let pid_s = run.root.to_string();
    let args = ["checkpoint", &pid_s, "--dir", &img, "--leave-running"];
    ferry_ok(&mut run, "checkpoint", &args)?;
    let restore = [
        "restore",
        "--dir",
        img.as_str(),
        "--pid-namespace",
        "--json",
    ];

    // The original keeps listening: refused after the wait.
    let started = Instant::now();
    let out = run.ferry("restore-beside", &restore)?;
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
    let mut child = Command::new(&suite.harness.ferry)
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
    run.touch("go")?;
    run.wait_pass(CR_RESULT_TIMEOUT)?;
    run.finish()
}

/// An image whose clocks are ahead of this machine's (as if it came from a machine booted
/// earlier): restored into a namespace, the monotonic clocks continue from the image's.
fn run_clocks_ahead(suite: &Suite) -> Result<(), Failed> {
    const AHEAD_NS: u64 = 100_000_000_000;
    let mut run = start(suite, "proc_clock_monotonic", "ns_clocks")?;
    run.wait_ready()?;
    let img = run.base.join("img");
    let img_s = img.to_string_lossy().into_owned();
    let pid_s = run.root.to_string();
    ferry_ok(
        &mut run,
        "checkpoint",
        &["checkpoint", &pid_s, "--dir", &img_s],
    )?;
    // Rewrite the image with clocks 100 s ahead.
    let ahead = run.base.join("img_ahead");
    let seen = shift_image_clocks(&img, &ahead, AHEAD_NS)
        .map_err(|e| run.report(&format!("rewrite the image: {e}")))?;
    let ahead_s = ahead.to_string_lossy().into_owned();
    let init = restore_in_namespace(&mut run, 1, &ahead_s)?;
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
    run.touch("go")?;
    run.wait_pass(CR_RESULT_TIMEOUT)?;
    run.finish()
}

/// Thousands of small mappings side by side (`mem_adjacent_mappings`: about 2,900) are stored
/// in a few records of pages, a record going on across adjacent mappings (split only where a
/// zero or untouched page is left out), not one or more per mapping; and they come back page
/// for page.
fn run_adjacent_mappings_few_records(suite: &Suite) -> Result<(), Failed> {
    // mem_adjacent_mappings leaves out about 100 pages (never touched, or zero) among its
    // 5,000 anonymous ones; with the file and tail pages, some 120 stretches at most.
    const MAX_RECORDS: usize = 200;
    let mut run = start(suite, "mem_adjacent_mappings", "mem_records")?;
    run.wait_ready()?;
    let ck = run.checkpoint(1, &[])?;
    if !ck.success() {
        return Err(run.report(&format!(
            "ferry checkpoint failed ({}): {}",
            ck.status_text(),
            ck.stderr_summary()
        )));
    }
    let records = count_page_records(&run.image(1))
        .map_err(|e| run.report(&format!("read the image: {e}")))?;
    if records > MAX_RECORDS {
        return Err(run.report(&format!(
            "the image holds {records} records of pages (at most {MAX_RECORDS} expected: a \
             record should go on across adjacent mappings)"
        )));
    }
    run.wait_tree_gone(1)?;
    run.restore(1)?;
    run.touch("go")?;
    run.wait_pass(CR_RESULT_TIMEOUT)?;
    run.finish()
}

/// How many records of pages the image in `dir` holds.
fn count_page_records(dir: &Path) -> Result<usize, String> {
    use ferry_image::{ImageReader, Record};
    let input = File::open(dir.join(ferry_image::IMAGE_FILE)).map_err(|e| e.to_string())?;
    let mut r = ImageReader::new(io::BufReader::new(input)).map_err(|e| e.to_string())?;
    let mut n = 0;
    while let Some(rec) = r.next_record().map_err(|e| e.to_string())? {
        if matches!(rec, Record::Pages { .. }) {
            n += 1;
        }
    }
    Ok(n)
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
    ferry_ok(&mut run, "checkpoint", &args)?;
    let args = ["restore", "--dir", &img, "--pid-namespace", "--json"];
    let out = ferry_ok(&mut run, "restore", &args)?;
    let report: serde_json::Value =
        serde_json::from_str(&out).map_err(|e| run.report(&format!("bad JSON report: {e}")))?;
    let num = |k: &str| report.get(k).and_then(|v| v.as_i64()).unwrap_or(0) as i32;
    let (clone, init) = (num("root_host_pid"), num("guest_init_host_pid"));
    let img2 = run.base.join("img2").to_string_lossy().into_owned();
    let init_s = init.to_string();
    let ck = run.ferry("checkpoint2", &["checkpoint", &init_s, "--dir", &img2])?;
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
    run.finish()
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
    ferry_ok(&mut run, "checkpoint", &args)?;
    let file = File::open(img.join(ferry_image::IMAGE_FILE))
        .map_err(|e| run.report(&format!("open the image: {e}")))?;
    let mut image =
        open(io::BufReader::new(file)).map_err(|e| run.report(&format!("open: {e}")))?;
    let guest = GuestNamespaces::create(&suite.harness.ferry, image.tree.clocks, None)
        .map_err(|e| run.report(&format!("GuestNamespaces::create: {e}")))?;
    let init = guest.init_host_pid();
    let held = restore_with(
        &mut image,
        &RestoreOptions {
            guest: Some(&guest),
            caller: None,
            cpu_cgroup: None,
            relays: false,
            lazy: None,
            supervised: false,
            pages: None,
            adopt: &[],
            release: None,
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
    run.finish()
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
        run.finish()?;
    }
    Ok(())
}
