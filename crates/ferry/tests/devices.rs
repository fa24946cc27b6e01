//! The machine's own devices (docs/limitations.md): the console, virtual terminals and
//! /dev/kmsg move only within the machine and boot they were captured in, and a virtual
//! terminal that is the process's controlling terminal is refused before anything is lost.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;

use common::{ferry, scratch};

/// `sh -c SCRIPT` (which ends by exec'ing `sleep`), in a session of its own; returns once the
/// sleep runs.
#[allow(clippy::zombie_processes)]
fn start(script: &str) -> Child {
    let mut c = Command::new("/bin/sh");
    c.args(["-c", script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // SAFETY: setsid() is async-signal-safe and touches nothing of ours.
    unsafe {
        c.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let child = c.spawn().expect("start the process");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let comm = std::fs::read_to_string(format!("/proc/{}/comm", child.id()));
        if comm.is_ok_and(|c| c.trim() == "sleep") {
            return child;
        }
        assert!(Instant::now() < deadline, "the process did not start");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn kill(pid: u32) {
    let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
}

/// Copies the image in `from` to `to` with its source's boot id replaced by `boot_id`.
fn with_boot_id(from: &Path, to: &Path, boot_id: &str) {
    let mut b = std::fs::read(from.join("image.ferry")).unwrap();
    let (at, _, range) = ferry_fuzz::image_records(&b)
        .into_iter()
        .next()
        .expect("a tree record");
    let mut tree: ferry_image::Tree = ciborium::from_reader(&b[range.clone()]).unwrap();
    tree.source.boot_id = boot_id.into();
    let mut payload = Vec::new();
    ciborium::into_writer(&tree, &mut payload).unwrap();
    ferry_fuzz::replace_payload(&mut b, at, range, &payload);
    ferry_fuzz::reseal_image(&mut b);
    std::fs::create_dir_all(to).unwrap();
    std::fs::write(to.join("image.ferry"), &b).unwrap();
}

/// The console and the console memory, captured here, are refused by a restore in another
/// boot (another machine), naming the descriptor; the same image restores in this one.
#[test]
fn machine_devices_refused_on_another_boot() {
    let dir = scratch("devices", "boot");
    let img = dir.join("img");
    let other = dir.join("other");
    let mut child = start("exec 3>/dev/console 4</dev/vcs1; exec sleep 100");
    let pid = child.id();
    let (ok, _, err) = ferry(&[
        "checkpoint",
        &pid.to_string(),
        "--dir",
        img.to_str().unwrap(),
    ]);
    if !ok {
        let _ = child.kill();
    }
    let _ = child.wait();
    assert!(ok, "checkpoint failed: {err}");
    with_boot_id(&img, &other, "00000000-0000-0000-0000-000000000000");
    let (ok, out, err) = ferry(&["restore", "--dir", other.to_str().unwrap()]);
    if ok {
        kill(pid);
        panic!("a restore in another boot was not refused (it printed {out:?})");
    }
    for w in [
        "fd 3",
        "/dev/console",
        "00000000-0000-0000-0000-000000000000",
    ] {
        assert!(err.contains(w), "{w:?} not in the error: {err}");
    }
    let (ok, _, err) = ferry(&["restore", "--dir", img.to_str().unwrap()]);
    assert!(ok, "the restore in this boot failed: {err}");
    let fd3 = std::fs::read_link(format!("/proc/{pid}/fd/3")).map(|p| p.display().to_string());
    let fd4 = std::fs::read_link(format!("/proc/{pid}/fd/4")).map(|p| p.display().to_string());
    kill(pid);
    assert_eq!(fd3.ok().as_deref(), Some("/dev/console"));
    assert_eq!(fd4.ok().as_deref(), Some("/dev/vcs1"));
}

/// A virtual terminal that is the process's controlling terminal is refused at checkpoint,
/// saying so, and the process runs on.
#[test]
fn vt_as_controlling_terminal_refused() {
    let dir = scratch("devices", "ctty");
    let img = dir.join("img");
    // A session leader opening a terminal without O_NOCTTY makes it its controlling terminal.
    let mut child = start("exec 3<>/dev/tty2; exec sleep 100");
    let pid = child.id();
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let tty_nr: u64 = stat
        .rsplit_once(')')
        .and_then(|(_, r)| r.split_whitespace().nth(4)?.parse().ok())
        .unwrap();
    let (ok, _, err) = ferry(&[
        "checkpoint",
        &pid.to_string(),
        "--dir",
        img.to_str().unwrap(),
    ]);
    let alive = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| s.contains(") S ") || s.contains(") R "));
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(
        tty_nr, 0x402,
        "/dev/tty2 did not become its controlling terminal"
    );
    assert!(!ok, "a VT as controlling terminal was not refused");
    for w in ["fd 3", "/dev/tty2", "controlling terminal"] {
        assert!(err.contains(w), "{w:?} not in the error: {err}");
    }
    assert!(alive, "the refused process did not run on");
}

/// A migration to a node on another machine (fail point `b:other-machine`: b says its kernel
/// boot id is another) of a tree holding the console is refused by the offer, before anything
/// is frozen, naming the descriptor; the process runs on at home.
#[test]
fn console_not_offered_to_another_machine() {
    let c = common::cluster::Cluster::up_with(
        "dev-machine",
        2,
        &[("FAILPOINTS", "b:other-machine=return")],
    );
    let mut child = start("exec 3>/dev/console; exec sleep 100");
    let pid = child.id();
    let out = c.run("a", &["migrate", &pid.to_string(), "--to", "b"]);
    let alive = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| s.contains(") S ") || s.contains(") R "));
    let fd3 = std::fs::read_link(format!("/proc/{pid}/fd/3")).map(|p| p.display().to_string());
    let _ = child.kill();
    let _ = child.wait();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the migration was not refused");
    for w in ["fd 3 (/dev/console)", "another machine"] {
        assert!(err.contains(w), "{w:?} not in the error: {err}");
    }
    assert!(alive, "the refused process did not run on");
    assert_eq!(fd3.ok().as_deref(), Some("/dev/console"));
    // Refused at the offer: no capture began at a (`migrate-start` is logged once the offer
    // is taken, before the freeze).
    let log = c.log("a");
    assert!(
        !log.contains("migrate-start"),
        "the migration started: {log}"
    );
}

/// `ferry migrate` of a process whose controlling terminal is a virtual terminal it holds is
/// refused by the look before freezing, naming it; the process runs on.
#[test]
fn vt_as_controlling_terminal_not_migrated() {
    let c = common::cluster::Cluster::up("dev-ctty", 2);
    let mut child = start("exec 3<>/dev/tty3; exec sleep 100");
    let pid = child.id();
    let out = c.run("a", &["migrate", &pid.to_string(), "--to", "b"]);
    let alive = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| s.contains(") S ") || s.contains(") R "));
    let _ = child.kill();
    let _ = child.wait();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the migration was not refused");
    for w in [
        "fd 3 (/dev/tty3)",
        "controlling terminal",
        "refused before freezing anything",
    ] {
        assert!(err.contains(w), "{w:?} not in the error: {err}");
    }
    assert!(alive, "the refused process did not run on");
}
