//! The `ferry` command against bad input and hostile timing: a wrong PID, ferry's own tree, a
//! kernel thread, corrupted, truncated and foreign images, a PID in use, a resource that cannot
//! be captured, and ferry killed at random moments of a checkpoint. In every case the error
//! names the problem and the victim keeps running unharmed.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;

use common::cluster::FERRY;
use common::{ferry, scratch};

/// Builds the busy victim once per test binary.
fn busy_binary() -> PathBuf {
    common::victim("busy", &["-O1", "-pthread"])
}

struct Victim {
    child: Child,
    pid: i32,
}

impl Victim {
    fn start() -> Victim {
        let mut child = Command::new(busy_binary())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start victim");
        let mut line = String::new();
        BufReader::new(child.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(line.starts_with("ready"), "victim did not start: {line:?}");
        let pid = child.id() as i32;
        Victim { child, pid }
    }

    fn status_field(&self, key: &str) -> String {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.pid)).unwrap_or_default();
        s.lines()
            .find_map(|l| l.strip_prefix(&format!("{key}:")))
            .unwrap_or("")
            .trim()
            .to_string()
    }

    /// Not stopped, not traced, and passes its own checks.
    fn assert_unharmed(mut self) {
        let state = self.status_field("State");
        assert!(
            !state.starts_with('t') && !state.starts_with('T'),
            "victim left stopped: {state}"
        );
        assert_eq!(self.status_field("TracerPid"), "0", "victim left traced");
        assert!(Command::new("kill")
            .args(["-USR2", &self.pid.to_string()])
            .status()
            .unwrap()
            .success());
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                let mut err = String::new();
                std::io::Read::read_to_string(self.child.stderr.as_mut().unwrap(), &mut err)
                    .unwrap();
                assert!(st.success(), "victim failed its own checks ({st}): {err}");
                return;
            }
            assert!(
                Instant::now() < deadline,
                "victim did not finish its checks"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Victim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `ferry checkpoint PID` (into scratch directory `name`) must fail, saying `says`.
fn checkpoint_is_refused(name: &str, pid: &str, says: &str) {
    let d = scratch("cli", name);
    let (ok, _, err) = ferry(&["checkpoint", pid, "--dir", d.to_str().unwrap()]);
    assert!(!ok);
    assert!(err.contains(says), "{err}");
}

/// `ferry checkpoint PID --dir DIR` (which kills the tree) must succeed.
fn checkpoint_ok(pid: i32, dir: &Path) {
    let (ok, _, err) = ferry(&[
        "checkpoint",
        &pid.to_string(),
        "--dir",
        dir.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
}

#[test]
fn nonexistent_pid_is_named() {
    checkpoint_is_refused("nopid", "999999", "no process with PID 999999");
}

#[test]
fn a_zombie_is_refused() {
    // A child of this test that has exited and is not collected yet.
    let mut child = Command::new("true").spawn().unwrap();
    let pid = child.id() as i32;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| s.contains(") Z ")) {
        assert!(
            std::time::Instant::now() < deadline,
            "PID {pid} did not exit"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    checkpoint_is_refused("zombie", &pid.to_string(), "it has exited (a zombie");
    // Still there for its parent, with its status.
    assert!(child.wait().unwrap().success());
}

#[test]
fn kernel_thread_is_refused() {
    checkpoint_is_refused("kthread", "2", "kernel thread");
}

#[test]
fn a_tree_containing_ferry_is_refused() {
    // This test process is ferry's parent: its tree contains ferry.
    let me = std::process::id().to_string();
    checkpoint_is_refused("self", &me, "is ferry itself");
}

#[test]
fn bad_images_are_rejected() {
    let v = Victim::start();
    let d = scratch("cli", "bad-images");
    let dir = d.join("good");
    let (ok, _, err) = ferry(&[
        "checkpoint",
        &v.pid.to_string(),
        "--dir",
        dir.to_str().unwrap(),
        "--leave-running",
    ]);
    assert!(ok, "{err}");
    let image = std::fs::read(dir.join("image.ferry")).unwrap();
    // (name, image, what the error must say, restore into guest namespaces). A bad header or
    // tree is refused before anything is created; a bad record of memory only when the
    // stream reaches it, so those are restored beside the running original, in namespaces of
    // their own, where its PIDs are free.
    let cases: Vec<(&str, Vec<u8>, &str, bool)> = vec![
        (
            "flipped",
            {
                let mut b = image.clone();
                let n = b.len() / 2;
                b[n] ^= 1;
                b
            },
            "checksum mismatch",
            true,
        ),
        (
            "flipped-tree",
            {
                let mut b = image.clone();
                b[16 + 12 + 40] ^= 1;
                b
            },
            "checksum mismatch",
            false,
        ),
        (
            "truncated",
            image[..image.len() - 100].to_vec(),
            "truncated",
            true,
        ),
        (
            "foreign",
            b"#!/bin/sh\necho not an image\n".to_vec(),
            "not a Ferry image",
            false,
        ),
        (
            "future",
            {
                let mut b = image.clone();
                b[8] = 200;
                b
            },
            "version 200",
            false,
        ),
    ];
    for (name, bytes, want, guest) in cases {
        let bad = d.join(name);
        std::fs::create_dir_all(&bad).unwrap();
        std::fs::write(bad.join("image.ferry"), bytes).unwrap();
        let mut args = vec!["restore", "--dir", bad.to_str().unwrap()];
        if guest {
            args.push("--pid-namespace");
        }
        let (ok, _, err) = ferry(&args);
        assert!(!ok, "{name} image was accepted");
        assert!(err.contains(want), "{name}: expected {want:?} in {err}");
    }
    // The image is good, but its PIDs are in use: the error names the PID.
    let (ok, _, err) = ferry(&["restore", "--dir", dir.to_str().unwrap()]);
    assert!(!ok);
    assert!(
        err.contains(&format!("PID {} is already in use", v.pid)),
        "{err}"
    );
    v.assert_unharmed();
}

/// A record of pages may run on across adjacent mappings (image format version 5), never
/// across a gap between them: an image whose record does is refused, naming the record's
/// range, and the original runs on.
#[test]
fn a_record_of_pages_across_a_gap_is_refused() {
    use ferry_image::{ImageReader, ImageWriter, Record};
    let v = Victim::start();
    let d = scratch("cli", "pages-gap");
    let good = d.join("good");
    let (ok, _, err) = ferry(&[
        "checkpoint",
        &v.pid.to_string(),
        "--dir",
        good.to_str().unwrap(),
        "--leave-running",
    ]);
    assert!(ok, "{err}");
    let bad = d.join("bad");
    std::fs::create_dir_all(&bad).unwrap();
    let src = std::fs::File::open(good.join(ferry_image::IMAGE_FILE)).unwrap();
    let mut r = ImageReader::new(BufReader::new(src)).unwrap();
    let dst = std::fs::File::create(bad.join(ferry_image::IMAGE_FILE)).unwrap();
    let mut w = ImageWriter::new(std::io::BufWriter::new(dst)).unwrap();
    let tree = r.read_tree().unwrap();
    w.write_tree(&tree).unwrap();
    // The last page of a mapping and the first of the gap after it.
    let p = &tree.processes[0];
    let at = p
        .vmas
        .windows(2)
        .find(|m| m[0].end < m[1].start)
        .map(|m| m[0].end - 4096)
        .expect("a mapping with a gap after it");
    while let Some(rec) = r.next_record().unwrap() {
        match rec {
            Record::Pages { pid, addr, data } => w.write_pages(pid, addr, &data).unwrap(),
            Record::Object {
                object,
                offset,
                data,
            } => w.write_object(object, offset, &data).unwrap(),
            Record::Tree(_) | Record::End { .. } => {}
        }
    }
    w.write_pages(p.pid, at, &[7u8; 8192]).unwrap();
    w.finish().unwrap();
    let (ok, _, err) = ferry(&["restore", "--dir", bad.to_str().unwrap(), "--pid-namespace"]);
    assert!(!ok, "a record across a gap was accepted");
    let want = format!(
        "memory at {at:x}-{:x} lies outside its mappings (or across a gap between them)",
        at + 8192
    );
    assert!(err.contains(&want), "expected {want:?} in {err}");
    v.assert_unharmed();
}

/// Writes an image of `tree` (perhaps with records before it) into a fresh directory.
fn crafted_image(name: &str, tree: &ferry_image::Tree, pages_first: bool, trees: usize) -> PathBuf {
    let d = scratch("cli", &format!("crafted-{name}"));
    let f = std::fs::File::create(d.join(ferry_image::IMAGE_FILE)).unwrap();
    let mut w = ferry_image::ImageWriter::new(f).unwrap();
    if pages_first {
        w.write_pages(tree.root_pid, 0x1000, &[1u8; 4096]).unwrap();
    }
    for _ in 0..trees {
        w.write_tree(tree).unwrap();
    }
    w.finish().unwrap();
    d
}

/// `ferry image show` reads and checks an image's tree as a restore does: an image that is
/// well framed and checksummed but whose tree is inconsistent (a short register block, an fd
/// naming a file the image does not hold ...) is refused by both, naming what is wrong, and
/// never makes `ferry` panic.
#[test]
fn image_show_refuses_crafted_trees_as_restore_does() {
    use ferry_image::*;
    let pid = 2_000_000_000;
    let good = Tree {
        root_pid: pid,
        processes: vec![Process {
            pid,
            threads: vec![Thread {
                tid: pid,
                gp_regs: vec![0; validate::GP_REGS_WORDS],
                ..Default::default()
            }],
            fds: vec![Fd {
                fd: 3,
                file: 0,
                ..Default::default()
            }],
            ..Default::default()
        }],
        files: vec![FileDesc {
            kind: FileKind::Pipe { pipe: 0 },
            ..Default::default()
        }],
        pipes: vec![Pipe::default()],
        ..Default::default()
    };
    let d = crafted_image("good", &good, false, 1);
    let (ok, out, err) = ferry(&["image", "show", d.to_str().unwrap()]);
    assert!(ok, "a consistent image was refused: {err}");
    assert!(out.contains("fd   3 -> file#0 pipe#0"), "{out}");

    let short_regs = {
        let mut t = good.clone();
        t.processes[0].threads[0].gp_regs.truncate(3);
        t
    };
    let bad_fd = {
        let mut t = good.clone();
        t.processes[0].fds[0].file = 7;
        t
    };
    let bad_pipe = {
        let mut t = good.clone();
        t.files[0].kind = FileKind::Pipe { pipe: 9 };
        t
    };
    let short_siginfo = {
        let mut t = good.clone();
        t.processes[0].shared_pending = vec![SigInfo(vec![2])];
        t
    };
    let cases = [
        (
            "short-regs",
            crafted_image("short-regs", &short_regs, false, 1),
            "register set has 3 words",
        ),
        (
            "bad-fd",
            crafted_image("bad-fd", &bad_fd, false, 1),
            "fd 3 refers to unknown file 7",
        ),
        (
            "bad-pipe",
            crafted_image("bad-pipe", &bad_pipe, false, 1),
            "unknown pipe 9",
        ),
        (
            "short-siginfo",
            crafted_image("short-siginfo", &short_siginfo, false, 1),
            "siginfo has 1 bytes",
        ),
        (
            "pages-first",
            crafted_image("pages-first", &good, true, 1),
            "not the tree",
        ),
        (
            "two-trees",
            crafted_image("two-trees", &good, false, 2),
            "two tree records",
        ),
    ];
    for (name, dir, want) in cases {
        let dir = dir.to_str().unwrap();
        let (ok, _, err) = ferry(&["image", "show", dir]);
        assert!(!ok, "image show accepted the {name} image");
        assert!(
            !err.contains("panicked"),
            "image show panicked on {name}: {err}"
        );
        assert!(
            err.contains(want),
            "image show, {name}: expected {want:?} in {err}"
        );
        if name == "two-trees" {
            continue; // restore finds the second tree only once it has started building
        }
        let (ok, _, err) = ferry(&["restore", "--dir", dir]);
        assert!(!ok, "restore accepted the {name} image");
        assert!(
            err.contains(want),
            "restore, {name}: expected {want:?} in {err}"
        );
    }
}

/// `ferry image show` tells the signal state a restore rebuilds: queued signals (the process's
/// and each thread's), armed interval timers, one expired with its signal not yet taken (as a
/// tree frozen past the expiry is captured), and POSIX timers.
#[test]
fn image_show_names_timers_and_pending_signals() {
    use ferry_image::*;
    let pid = 2_000_000_001;
    let siginfo = |sig: i32| {
        let mut b = vec![0u8; 128];
        b[..4].copy_from_slice(&sig.to_ne_bytes());
        SigInfo(b)
    };
    let tree = Tree {
        root_pid: pid,
        processes: vec![Process {
            pid,
            threads: vec![Thread {
                tid: pid,
                gp_regs: vec![0; validate::GP_REGS_WORDS],
                pending: vec![siginfo(libc::SIGUSR1)],
                ..Default::default()
            }],
            shared_pending: vec![siginfo(libc::SIGALRM), siginfo(libc::SIGRTMIN() + 1)],
            itimers: vec![
                ITimer {
                    which: libc::ITIMER_REAL,
                    interval_us: 100_000,
                    value_us: 0,
                },
                ITimer {
                    which: libc::ITIMER_VIRTUAL,
                    interval_us: 0,
                    value_us: 0,
                },
                ITimer {
                    which: libc::ITIMER_PROF,
                    interval_us: 0,
                    value_us: 2_000_000,
                },
            ],
            posix_timers: vec![PosixTimer {
                id: 3,
                signo: libc::SIGUSR2,
                interval_ns: 5_000_000,
                value_ns: 1_000,
                ..Default::default()
            }],
            ..Default::default()
        }],
        ..Default::default()
    };
    let d = crafted_image("timers", &tree, false, 1);
    let (ok, out, err) = ferry(&["image", "show", d.to_str().unwrap()]);
    assert!(ok, "image show failed: {err}");
    for want in [
        "  process-wide pending: SIGALRM signal 35",
        "ITIMER_REAL: expired, its signal not yet taken, every 100000 us",
        "ITIMER_PROF: 2000000 us left, once",
        "POSIX timer 3 clock 0 signal 12 notify 0x0: 1000 ns left, every 5000000 ns",
    ] {
        assert!(out.contains(want), "expected {want:?} in:\n{out}");
    }
    let thread = out
        .lines()
        .find(|l| l.starts_with("  thread "))
        .unwrap_or("");
    assert!(
        thread.ends_with(" pending: SIGUSR1"),
        "the thread's pending signal, in:\n{out}"
    );
    assert!(
        !out.contains("ITIMER_VIRTUAL"),
        "a disarmed timer shown:\n{out}"
    );
}

/// Copies the image in `from` to `to`, its tree changed by `change`, every record after it as
/// it was (checksums recomputed: the image is well formed, only what it says is hostile).
fn rewrite_tree(from: &Path, to: &Path, change: impl FnOnce(&mut ferry_image::Tree)) {
    use ferry_image::{ImageReader, ImageWriter, Record};
    std::fs::create_dir_all(to).unwrap();
    let src = std::fs::File::open(from.join(ferry_image::IMAGE_FILE)).unwrap();
    let mut r = ImageReader::new(BufReader::new(src)).unwrap();
    let dst = std::fs::File::create(to.join(ferry_image::IMAGE_FILE)).unwrap();
    let mut w = ImageWriter::new(std::io::BufWriter::new(dst)).unwrap();
    let mut tree = r.read_tree().unwrap();
    change(&mut tree);
    w.write_tree(&tree).unwrap();
    while let Some(rec) = r.next_record().unwrap() {
        match rec {
            Record::Pages { pid, addr, data } => w.write_pages(pid, addr, &data).unwrap(),
            Record::Object {
                object,
                offset,
                data,
            } => w.write_object(object, offset, &data).unwrap(),
            Record::Tree(_) | Record::End { .. } => {}
        }
    }
    w.finish().unwrap();
}

/// What a restore copies into a process's scratch page comes from the image: a working
/// directory longer than the page is an error naming it, and the half-built tree is killed
/// (it made the restore panic).
#[test]
fn an_image_path_longer_than_the_scratch_page_is_an_error() {
    let v = Victim::start();
    let d = scratch("cli", "long-path");
    let good = d.join("good");
    let (ok, _, err) = ferry(&[
        "checkpoint",
        &v.pid.to_string(),
        "--dir",
        good.to_str().unwrap(),
        "--leave-running",
    ]);
    assert!(ok, "{err}");
    let bad = d.join("bad");
    rewrite_tree(&good, &bad, |t| {
        t.processes[0].cwd = format!("/{}", "a".repeat(5000))
    });
    let (ok, _, err) = ferry(&["restore", "--dir", bad.to_str().unwrap(), "--pid-namespace"]);
    assert!(!ok, "a 5000-byte working directory was restored");
    assert!(!err.contains("panicked"), "restore panicked: {err}");
    // Refused by name: looked up with the process's rights first (too long a name), or, had
    // it got that far, too big for the scratch page of the injected call.
    assert!(
        err.contains("do not fit the") || err.contains("File name too long"),
        "{err}"
    );
    v.assert_unharmed();
}

fn wait_gone(pid: i32, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Path::new(&format!("/proc/{pid}")).exists() {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    true
}

/// A restore streams memory into processes it has already made: a record found bad on the way
/// (corrupted, or the image cut short) kills every one of them, so the image's PIDs are free
/// again, and the good image restores afterwards.
#[test]
fn a_bad_memory_record_kills_the_half_built_tree() {
    let mut v = Victim::start();
    let pid = v.pid;
    let d = scratch("cli", "bad-memory");
    let dir = d.join("good");
    checkpoint_ok(pid, &dir);
    v.child.wait().unwrap();
    let image = std::fs::read(dir.join("image.ferry")).unwrap();
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            // In the last record of memory, just before the end marker.
            "flipped-late",
            {
                let mut b = image.clone();
                let n = b.len() - 300;
                b[n] ^= 0x10;
                b
            },
            "checksum mismatch",
        ),
        (
            "cut-in-memory",
            image[..image.len() / 2].to_vec(),
            "truncated",
        ),
    ];
    for (name, bytes, want) in cases {
        let bad = d.join(name);
        std::fs::create_dir_all(&bad).unwrap();
        std::fs::write(bad.join("image.ferry"), bytes).unwrap();
        let (ok, _, err) = ferry(&["restore", "--dir", bad.to_str().unwrap()]);
        assert!(!ok, "{name} image was accepted");
        assert!(err.contains(want), "{name}: expected {want:?} in {err}");
        assert!(
            wait_gone(pid, Duration::from_secs(5)),
            "{name}: a process with the image's PID {pid} was left behind"
        );
    }
    let (ok, out, err) = ferry(&["restore", "--dir", dir.to_str().unwrap()]);
    assert!(ok, "the good image after the bad ones: {err}");
    assert_eq!(out.trim(), pid.to_string());
    assert!(Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap()
        .success());
    assert!(wait_gone(pid, Duration::from_secs(5)));
}

#[test]
fn an_uncapturable_resource_is_named_and_the_process_carries_on() {
    // A process holding /dev/net/tun (a device whose state, the interface a TUNSETIFF would
    // attach, the engine does not capture; /dev/kmsg, used here before, moves now).
    let d = scratch("cli", "refusal");
    let mut sh = Command::new("sleep")
        .arg("30")
        .stdin(std::fs::File::open("/dev/net/tun").expect("open /dev/net/tun"))
        .spawn()
        .expect("start sleep");
    std::thread::sleep(Duration::from_millis(200));
    let pid = sh.id().to_string();
    let (ok, _, err) = ferry(&["checkpoint", &pid, "--dir", d.join("img").to_str().unwrap()]);
    assert!(!ok, "a tree holding /dev/net/tun was checkpointed");
    assert!(
        err.contains(&format!("PID {pid}")) && err.contains("fd 0 (/dev/net/tun)"),
        "{err}"
    );
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    assert!(status.contains("TracerPid:\t0"), "left traced: {status}");
    assert!(sh.try_wait().unwrap().is_none(), "the refused process died");
    let _ = sh.kill();
    let _ = sh.wait();
}

#[test]
fn killing_ferry_mid_checkpoint_leaves_the_process_unharmed() {
    let v = Victim::start();
    let d = scratch("cli", "kill-ferry");
    for round in 0..12u64 {
        let dir = d.join(format!("img{round}"));
        let mut f = Command::new(FERRY)
            .args([
                "checkpoint",
                &v.pid.to_string(),
                "--dir",
                dir.to_str().unwrap(),
                "--leave-running",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // Spread the kills over the whole checkpoint, freeze to finish.
        std::thread::sleep(Duration::from_micros(round * round * 300));
        let _ = f.kill();
        let _ = f.wait();
        // The worker notices and lets go within moments.
        let deadline = Instant::now() + Duration::from_secs(5);
        while v.status_field("TracerPid") != "0" {
            assert!(
                Instant::now() < deadline,
                "round {round}: victim still traced"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    v.assert_unharmed();
}

/// A System V segment is made while the mappings are, before memory streams in: a bad record
/// of memory after it removes it again (nothing of the failed restore is left).
#[test]
fn a_bad_memory_record_leaves_no_system_v_segment() {
    let d = scratch("cli", "bad-memory-sysv");
    let src = d.join("sv.c");
    std::fs::write(
        &src,
        r#"#include <sys/ipc.h>
#include <sys/shm.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
int main(void) {
    int id = shmget(IPC_PRIVATE, 65536, IPC_CREAT | 0600);
    char *a = shmat(id, NULL, 0);
    memset(a, 7, 65536);
    size_t n = 8 << 20;
    char *m = malloc(n);
    for (size_t i = 0; i < n; i++) m[i] = (char)(i * 13 + 1);
    printf("%d\n", id);
    fflush(stdout);
    for (;;) pause();
}
"#,
    )
    .unwrap();
    let exe = d.join("sv");
    assert!(Command::new("gcc")
        .args(["-O1", "-o"])
        .arg(&exe)
        .arg(&src)
        .status()
        .unwrap()
        .success());
    let mut child = Command::new(&exe).stdout(Stdio::piped()).spawn().unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    let shmid = line.trim().to_string();
    let pid = child.id() as i32;
    let segment_there = || {
        std::fs::read_to_string("/proc/sysvipc/shm")
            .unwrap()
            .lines()
            .skip(1)
            .any(|l| l.split_whitespace().nth(1) == Some(shmid.as_str()))
    };
    let dir = d.join("img");
    checkpoint_ok(pid, &dir);
    child.wait().unwrap();
    let image = dir.join("image.ferry");
    let mut bytes = std::fs::read(&image).unwrap();
    let n = bytes.len() - 300;
    bytes[n] ^= 0x10;
    std::fs::write(&image, bytes).unwrap();
    let (ok, _, err) = ferry(&["restore", "--dir", dir.to_str().unwrap()]);
    assert!(!ok, "the corrupted image was accepted");
    assert!(err.contains("checksum mismatch"), "{err}");
    assert!(
        wait_gone(pid, Duration::from_secs(5)),
        "PID {pid} left behind"
    );
    assert!(
        !segment_there(),
        "System V segment {shmid} left behind by the failed restore"
    );
}

/// A restore puts each process back into its cgroups; one that no longer exists fails the
/// restore, naming it (no cgroup is made up). (Fails without cgroup capture: the restore
/// succeeds.)
#[test]
fn a_cgroup_missing_here_fails_the_restore_naming_it() {
    let root = Path::new("/sys/fs/cgroup/pids");
    assert!(
        root.join("cgroup.procs").exists(),
        "this test needs the v1 pids hierarchy"
    );
    let v = Victim::start();
    let orig = std::fs::read_to_string(format!("/proc/{}/cgroup", v.pid))
        .unwrap()
        .lines()
        .find_map(|l| l.split_once(":pids:").map(|(_, p)| p.to_string()))
        .expect("the victim's pids cgroup");
    let name = format!("ferry-cli-missing-{}", std::process::id());
    let dir = root.join(orig.trim_start_matches('/')).join(&name);
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("cgroup.procs"), v.pid.to_string()).unwrap();
    let d = scratch("cli", "cgroup-missing");
    let img = d.join("img");
    let (ok, _, err) = ferry(&[
        "checkpoint",
        &v.pid.to_string(),
        "--dir",
        img.to_str().unwrap(),
        "--leave-running",
    ]);
    // Back where it was, and the cgroup gone, before the restore.
    std::fs::write(
        root.join(orig.trim_start_matches('/')).join("cgroup.procs"),
        v.pid.to_string(),
    )
    .unwrap();
    std::fs::remove_dir(&dir).unwrap();
    assert!(ok, "{err}");
    let (ok, _, err) = ferry(&["restore", "--dir", img.to_str().unwrap(), "--pid-namespace"]);
    assert!(!ok, "restored into a cgroup that does not exist");
    assert!(
        err.contains("cgroup pids:") && err.contains(&name) && err.contains("does not exist"),
        "{err}"
    );
    v.assert_unharmed();
}

/// The daemon runs as root and reads what peers and users send it: its executable keeps the
/// randomized load address of a position-independent executable (ELF type DYN), even though
/// being linked at a fixed address would make every `ferry` start cheaper (docs/security.md).
#[test]
fn ferry_is_position_independent() {
    let mut head = [0u8; 18];
    std::io::Read::read_exact(&mut std::fs::File::open(FERRY).unwrap(), &mut head).unwrap();
    assert_eq!(&head[..4], b"\x7fELF", "{FERRY} is not an ELF file");
    let e_type = u16::from_le_bytes([head[16], head[17]]);
    assert_eq!(
        e_type, 3,
        "{FERRY} has ELF type {e_type}, not DYN (3): it is not a PIE"
    );
}
