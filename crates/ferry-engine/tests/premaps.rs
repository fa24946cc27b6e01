//! Mappings read before a freeze (`ferry_engine::premaps`): used in the freeze when the
//! process made no call that could change a mapping's flags since, read again when it did,
//! even when /proc/PID/maps looks the same (an madvise over a whole mapping splits nothing).
//! A real process (tests/victims/madviser.c), frozen by the engine.

use ferry_engine::freeze::FrozenTree;
use ferry_engine::premaps::PreMaps;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

fn wait_file(path: &Path, what: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(s) = std::fs::read_to_string(path) {
            if s.ends_with('\n') {
                return s;
            }
        }
        assert!(Instant::now() < deadline, "{what}: no {}", path.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `tests/victims/madviser.c`, built once per test process.
fn victim() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
            let out = std::env::temp_dir().join(format!("ferry-madviser-{}", std::process::id()));
            let st = Command::new("gcc")
                .args(["-O1", "-pthread", "-o"])
                .arg(&out)
                .arg(root.join("tests/victims/madviser.c"))
                .status()
                .expect("run gcc");
            assert!(st.success(), "gcc failed on madviser.c");
            out
        })
        .clone()
}

/// The victim with 64 MiB of private anonymous memory, written, at the address it says; once
/// `DIR/go` exists, a thread it started before gives the whole mapping `advice` (none: it
/// does nothing), and it says `done`.
fn start(dir: &Path, advice: Option<i32>) -> (Child, u64) {
    let child = Command::new(victim())
        .arg(dir)
        .arg(advice.unwrap_or(-1).to_string())
        .stdin(Stdio::null())
        .spawn()
        .expect("start the victim");
    let addr = wait_file(&dir.join("addr"), "the child did not start");
    (child, u64::from_str_radix(addr.trim(), 16).unwrap())
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferry-premaps-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Takes the early read, lets the child act, freezes it and returns what the capture would
/// read in the freeze (the mapping at `addr`'s VmFlags), with how many early reads were used
/// and how many processes were read again.
fn read_through_freeze(dir: &Path, pid: i32, addr: u64) -> (Vec<String>, usize, usize) {
    let pre = PreMaps::take(pid);
    std::fs::write(dir.join("go"), "").unwrap();
    wait_file(&dir.join("done"), "the child did not act");
    let mut frozen = FrozenTree::freeze(pid).unwrap();
    let mut pre = pre;
    let counters = pre.settle();
    frozen.premaps = Some(pre);
    let pre = frozen.premaps.as_ref().unwrap();
    let maps = pre.mappings(pid, pid).unwrap();
    let (used, again) = (
        pre.used.load(Ordering::Relaxed),
        pre.read_again.load(Ordering::Relaxed),
    );
    frozen.thaw();
    counters.close();
    let m = maps
        .iter()
        .find(|m| m.start <= addr && addr < m.end)
        .expect("the child's mapping");
    (m.vm_flags.clone(), used, again)
}

fn tracefs() -> bool {
    ferry_sys::perf::sys_enter_id().is_some()
}

#[test]
fn a_quiet_process_is_not_read_again_in_the_freeze() {
    assert!(
        tracefs(),
        "this test needs tracefs (raw_syscalls:sys_enter)"
    );
    // Nothing, or an advice that changes pages, not flags (glibc gives it an ending thread's
    // stack).
    for (name, advice) in [("quiet", None), ("dontneed", Some(libc::MADV_DONTNEED))] {
        let dir = scratch(name);
        let (mut child, addr) = start(&dir, advice);
        let (flags, used, again) = read_through_freeze(&dir, child.id() as i32, addr);
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!((used, again), (1, 0), "{name}: the early read was not used");
        assert!(!flags.iter().any(|f| f == "dc"), "{flags:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn a_flag_changed_over_a_whole_mapping_after_the_early_read_is_seen() {
    assert!(
        tracefs(),
        "this test needs tracefs (raw_syscalls:sys_enter)"
    );
    for (advice, flag) in [(libc::MADV_DONTFORK, "dc"), (libc::MADV_DONTDUMP, "dd")] {
        let dir = scratch(flag);
        let name = if flag == "dc" {
            "MADV_DONTFORK"
        } else {
            "MADV_DONTDUMP"
        };
        let (mut child, addr) = start(&dir, Some(advice));
        let pid = child.id() as i32;
        let before = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
        let (flags, used, again) = read_through_freeze(&dir, pid, addr);
        let after = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
        let _ = child.kill();
        let _ = child.wait();
        // What makes the case: /proc/PID/maps alone would not have told.
        assert_eq!(before, after, "{name} changed /proc/PID/maps");
        assert!(
            flags.iter().any(|f| f == flag),
            "{name} (by a thread other than the main one) was missed: {flags:?}"
        );
        assert_eq!((used, again), (0, 1), "{name}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
