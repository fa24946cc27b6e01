//! Pre-copy migration (`--memory precopy`, and `auto`, the default) on real local clusters:
//! threads asleep with a deadline (nanosleep, a futex wait with a timeout, poll) go on asleep
//! through the brief stop that starts dirty tracking, through a move that fails after its
//! capture and through the move that follows, never seeing EINTR; `auto` moves a small tree
//! eagerly and a large idle one by pre-copy, saying why; and memory that compresses crosses
//! between the daemons compressed. Hybrid moves (pre-copy rounds, then the rest lazily) keep
//! the sleeps too, an aborted one leaving the tree running where it was.

mod common;

use common::cluster::{Cluster, Isolation};
use common::scratch;
use libtest_mimic::{Arguments, Failed, Trial};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn main() {
    common::seal_inherited_fds();
    let args = Arguments::from_args();
    let tests = vec![
        Trial::test(
            "timed_sleeps_go_on_through_precopy_and_an_aborted_move",
            || timed_sleeps_go_on("precopy"),
        ),
        Trial::test(
            "timed_sleeps_go_on_through_hybrid_and_an_aborted_move",
            || timed_sleeps_go_on("hybrid"),
        ),
        Trial::test(
            "auto_moves_a_small_tree_eagerly_and_a_large_idle_one_by_precopy",
            auto_chooses,
        ),
    ];
    libtest_mimic::run(&args, tests).exit();
}

/// tests/victims/sleepers.c, built once per test process.
fn sleepers_binary() -> PathBuf {
    let out =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("sleepers-{}", std::process::id()));
    if !out.exists() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/victims/sleepers.c");
        let st = Command::new("gcc")
            .args(["-O2", "-pthread", "-o"])
            .arg(&out)
            .arg(&src)
            .status()
            .unwrap();
        assert!(st.success(), "build sleepers");
    }
    out
}

/// A running `sleepers MIB DIR` (our child, wherever it is moved: its home keeps a deputy).
struct Sleepers {
    child: Child,
    dir: PathBuf,
}

impl Sleepers {
    fn start(dir: &Path, mib: u32) -> Sleepers {
        let file = |ext: &str| Stdio::from(std::fs::File::create(dir.join(ext)).unwrap());
        let child = Command::new(sleepers_binary())
            .arg(mib.to_string())
            .arg(dir)
            .stdin(Stdio::null())
            .stdout(file("out"))
            .stderr(file("err"))
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !dir.join("ready").exists() {
            assert!(Instant::now() < deadline, "sleepers did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        Sleepers {
            child,
            dir: dir.to_path_buf(),
        }
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Lets the sleeps that run end (each lasts 2 s), then asks for the verdict.
    fn finish(mut self, what: &str) -> Result<(), Failed> {
        std::thread::sleep(Duration::from_millis(2200));
        std::fs::write(self.dir.join("stop"), "").unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        let status = loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                break st;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                return Err(format!("{what}: sleepers did not end").into());
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let result = std::fs::read_to_string(self.dir.join("result")).unwrap_or_default();
        if !status.success() || !result.starts_with("PASS") {
            let err = std::fs::read_to_string(self.dir.join("err")).unwrap_or_default();
            return Err(format!("{what}: {status}: {result}{err}").into());
        }
        Ok(())
    }
}

impl Drop for Sleepers {
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

/// `ferry migrate PID --to TO --json [--memory MODE]` on `from`: the report, or why it failed.
fn migrate(
    c: &Cluster,
    from: &str,
    pid: i32,
    to: &str,
    memory: Option<&str>,
) -> Result<serde_json::Value, String> {
    let pid = pid.to_string();
    let mut args = vec!["migrate", &pid, "--to", to, "--json"];
    if let Some(m) = memory {
        args.extend(["--memory", m]);
    }
    let o = c.run(from, &args);
    if o.status.success() {
        serde_json::from_slice(&o.stdout).map_err(|e| format!("bad json: {e}: {}", text(&o)))
    } else {
        Err(text(&o))
    }
}

/// Threads asleep with a deadline, always (2 s sleeps, one after another), are moved by
/// pre-copy twice: to b, which aborts once it has rebuilt them (the originals, frozen and
/// captured, go on at a), then to c. Every sleep must end at its deadline, never with EINTR:
/// pre-copy's first stop and the failed move's thaw each let them go on, and what they go on
/// in must still be their own call when they are captured again (a captured
/// `restart_syscall` fails with EINTR once restored). `hybrid` (pre-copy rounds, then the rest
/// lazily) the same: the move that fails after its rounds and its capture leaves the tree
/// running at a, whole.
fn timed_sleeps_go_on(mode: &str) -> Result<(), Failed> {
    let c = Cluster::up_with(
        &format!("{mode}-sleeps"),
        3,
        &[("FAILPOINTS", "b:abort-after-rebuilt=return")],
    );
    let dir = scratch("precopy", &format!("sleeps-{mode}"));
    let s = Sleepers::start(&dir, 8);
    let pid = s.pid();
    let e = migrate(&c, "a", pid, "b", Some(mode)).expect_err("b aborts after rebuilding");
    assert!(e.contains("abort-after-rebuilt"), "{e}");
    assert!(
        !dir.join("result").exists(),
        "the sleepers ended during an aborted move"
    );
    let r = migrate(&c, "a", pid, "c", Some(mode)).map_err(|e| format!("a -> c: {e}"))?;
    assert_eq!(r["memory"]["mode"], mode, "{r}");
    s.finish(&format!("moved by {mode} after an aborted move"))
}

/// `auto` (no `--memory`): a tree of a few MiB moves eagerly (its freeze is short already); a
/// large one that writes little moves by pre-copy, and the report says why, in each case with
/// the numbers it chose from. The victims' memory compresses well (a byte in eight varies):
/// the daemons agree on LZ4 and the wire carries far less than the memory.
fn auto_chooses() -> Result<(), Failed> {
    let c = Cluster::up_full(
        "precopy-auto",
        2,
        &[],
        Isolation::default_for_tests(),
        &["--compress"],
    );
    let small_dir = scratch("precopy", "auto-small");
    let small = Sleepers::start(&small_dir, 1);
    // The human report.
    let o = c.run("a", &["migrate", &small.pid().to_string(), "--to", "b"]);
    let out = text(&o);
    assert!(o.status.success(), "small: {out}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("memory: eager (auto: ") && l.contains("MiB")),
        "small: {out}"
    );
    assert!(
        out.lines().any(|l| l.starts_with("wire: lz4 compressed")),
        "small: {out}"
    );
    small.finish("a small tree moved by auto")?;

    let large_dir = scratch("precopy", "auto-large");
    let large = Sleepers::start(&large_dir, 160);
    let r = migrate(&c, "a", large.pid(), "b", None).map_err(|e| format!("large: {e}"))?;
    let m = &r["memory"];
    assert_eq!(m["mode"], "precopy", "{r}");
    let why = m["reason"].as_str().unwrap_or_default();
    assert!(
        why.starts_with("auto:") && why.contains("MiB/s"),
        "the reason gives no rates: {r}"
    );
    assert!(
        m["inherited_bytes"].as_u64().unwrap_or(0) > 100 << 20,
        "the freeze did not take the rounds' pages: {r}"
    );
    assert_eq!(r["compression"], "lz4", "{r}");
    assert!(
        r["wire_bytes"].as_u64().unwrap_or(u64::MAX) < 110 << 20,
        "160 MiB that compress went uncompressed: {r}"
    );
    large.finish("a large idle tree moved by auto")
}
