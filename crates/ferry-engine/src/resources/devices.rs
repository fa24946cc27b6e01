//! The machine's own character devices whose state lives in the device, shared by everyone who
//! opens it, not in the open file: the console (/dev/console, 5:1), virtual terminals
//! (/dev/ttyN, 4:0-63; /dev/tty0 is the one in the foreground), serial ttys (/dev/ttySN,
//! 4:64-255) and the virtual console memory (/dev/vcs*, /dev/vcsa*, /dev/vcsu*, major 7).
//!
//! - **capture**: the path, device number, access mode and flags (and for /dev/vcs* the
//!   offset) are recorded, and for a terminal the terminal it leads to (TIOCGDEV). A terminal
//!   that is the process's controlling terminal is refused: its session would have to take it
//!   back (TIOCSCTTY), from whoever holds it then.
//! - **restore**: the same path is opened again with the process's rights, checked to be a
//!   character device of the same number (`crate::reopen`), with O_NOCTTY (nothing becomes a
//!   controlling terminal by accident) and O_NONBLOCK (a serial line without carrier does not
//!   hold the open; the process's own O_NONBLOCK is set after); a terminal must lead to the
//!   terminal captured. Its settings (termios, window size) belong to the device and are not
//!   touched. These devices are the machine's: an image is restored with them only on the
//!   machine, and in the boot, it was captured in (`Source::boot_id`), as on the nodes of a
//!   local cluster, which share one kernel.

use crate::error::{Context, Error, Result};
use crate::procfs;
use ferry_image::{FileDesc, FileKind, Tree};
use ferry_sys::{pidfd, tty};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;

const TTY_MAJOR: u32 = 4;
const TTYAUX_MAJOR: u32 = 5;
const CONSOLE_MINOR: u32 = 1;
const VCS_MAJOR: u32 = 7;

/// Whether device number `rdev` is one of the machine's devices handled here; whether it is a
/// terminal.
fn kind_of(rdev: u64) -> Option<bool> {
    let (major, minor) = (libc::major(rdev), libc::minor(rdev));
    match (major, minor) {
        (TTY_MAJOR, _) => Some(true),
        (TTYAUX_MAJOR, CONSOLE_MINOR) => Some(true),
        (VCS_MAJOR, _) => Some(false),
        _ => None,
    }
}

/// Whether device number `rdev` is one of the machine's devices handled here (/dev/kmsg
/// aside).
pub fn is_machine_rdev(rdev: u64) -> bool {
    kind_of(rdev).is_some()
}

/// Whether description `d` is one of the machine's own devices (this module's).
/// /dev/kmsg open for reading counts (its position is a sequence number of this boot's log).
pub fn is_machine_device(d: &FileDesc) -> bool {
    matches!(&d.kind, FileKind::Device { rdev, kmsg_seq, .. }
        if kind_of(*rdev).is_some() || kmsg_seq.is_some())
}

/// Describes descriptor `fd` of `pid`, a character device at `path`, if it is one of the
/// machine's devices handled here; `None` for any other device.
pub fn classify(pid: i32, fd: i32, path: &str, md: &std::fs::Metadata) -> Result<Option<FileKind>> {
    let rdev = md.rdev();
    if super::kmsg::is_kmsg(rdev) && path == "/dev/kmsg" {
        let pfd = pidfd::pidfd_open(pid).ctx(pid, || "open a pidfd".into())?;
        let copy = pidfd::pidfd_getfd(&pfd, fd).ctx(pid, || format!("copy fd {fd} ({path})"))?;
        let fl = ferry_sys::fdops::get_fl(copy.as_raw_fd())
            .ctx(pid, || format!("flags of fd {fd} ({path})"))?;
        // Open for writing only: no position (records written go to the log of wherever the
        // process runs).
        let kmsg_seq = if fl & libc::O_ACCMODE == libc::O_WRONLY {
            None
        } else {
            Some(super::kmsg::capture_position(
                pid,
                &format!("fd {fd} ({path})"),
                &copy,
            )?)
        };
        return Ok(Some(FileKind::Device {
            path: path.into(),
            rdev,
            terminal: None,
            kmsg_seq,
        }));
    }
    let Some(terminal) = kind_of(rdev) else {
        return Ok(None);
    };
    if !terminal {
        return Ok(Some(FileKind::Device {
            path: path.into(),
            rdev,
            terminal: None,
            kmsg_seq: None,
        }));
    }
    let pfd = pidfd::pidfd_open(pid).ctx(pid, || "open a pidfd".into())?;
    let copy = pidfd::pidfd_getfd(&pfd, fd).ctx(pid, || format!("copy fd {fd} ({path})"))?;
    let real = tty::real_dev(copy.as_raw_fd())
        .ctx(pid, || format!("the terminal behind fd {fd} ({path})"))?;
    let stat = procfs::read(pid, "stat")?;
    let ctty: Option<u32> = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(4)?.parse().ok());
    if ctty == Some(real) {
        let (major, minor) = (libc::major(u64::from(real)), libc::minor(u64::from(real)));
        return Err(Error::Unsupported {
            pid,
            what: format!("fd {fd} ({path})"),
            why: format!(
                "its terminal {major}:{minor} (a console, virtual terminal or serial line) is \
                 the process's controlling terminal, which its session cannot take back yet \
                 (only a pty of the tree can be)"
            ),
        });
    }
    Ok(Some(FileKind::Device {
        path: path.into(),
        rdev,
        terminal: Some(u64::from(real)),
        kmsg_seq: None,
    }))
}

/// A restore of `d` (one of the machine's devices) is refused on another machine or boot than
/// the capture's: the console there is that machine's.
pub fn check_machine(tree: &Tree, d: &FileDesc, holder: i32, fd: i32) -> Result<()> {
    let FileKind::Device { path, .. } = &d.kind else {
        return Ok(());
    };
    let here = procfs::boot_id();
    if tree.source.boot_id.is_empty() || tree.source.boot_id != here {
        return Err(Error::Restore {
            pid: holder,
            what: format!(
                "fd {fd} ({path}): a device of the machine it was captured on (boot {}), \
                 which is not this machine or boot ({here}): its console, terminals and \
                 console memory are this machine's own; refused",
                if tree.source.boot_id.is_empty() {
                    "not recorded"
                } else {
                    tree.source.boot_id.as_str()
                }
            ),
        });
    }
    Ok(())
}

/// Checks that `fd`, opened again for description `d`, leads to the terminal captured.
pub fn check_opened(d: &FileDesc, opened: &OwnedFd, holder: i32, fd: i32) -> Result<()> {
    let FileKind::Device {
        path,
        terminal: Some(want),
        ..
    } = &d.kind
    else {
        return Ok(());
    };
    let me = std::process::id() as i32;
    let now = tty::real_dev(opened.as_raw_fd()).ctx(me, || {
        format!("the terminal behind {path} (PID {holder} fd {fd})")
    })?;
    if u64::from(now) != *want {
        let dev = |n: u64| format!("{}:{}", libc::major(n), libc::minor(n));
        return Err(Error::Restore {
            pid: holder,
            what: format!(
                "fd {fd}: {path} leads to terminal {} now, {} when captured (another console \
                 or virtual terminal in the foreground?); refused",
                dev(u64::from(now)),
                dev(*want)
            ),
        });
    }
    Ok(())
}
