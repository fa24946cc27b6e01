//! /dev/kmsg, the kernel's log: a descriptor open for reading has a read position of its own,
//! the sequence number of the next record it will read. The kernel does not show it (fdinfo's
//! `pos` stays 0, `lseek(fd, 0, SEEK_CUR)` fails with EINVAL) and can set it only to the first
//! record still kept (SEEK_SET), the first after the last clear (SEEK_DATA) or the end
//! (SEEK_END).
//!
//! - **capture**: through a copy of the descriptor (the same open file description), `poll`
//!   says whether a record waits. If none does, the position is the end: the sequence number
//!   after the last record, read through a reader of our own (checked again). If one does, it
//!   is read (16 KiB is more than a record holds), its header names its sequence number S, and
//!   the description is put back at S: SEEK_SET, then records read and discarded up to S. A
//!   description whose next record has been overwritten already (`poll` says EPOLLERR: its next
//!   read would fail with EPIPE, which no restore can make it do again) is refused.
//! - **restore**: /dev/kmsg opened again with the process's rights, then SEEK_SET and records
//!   read and discarded up to S; if the record S is no longer kept (the log went on past it),
//!   the restore is refused, naming the descriptor. The sequence numbers are those of one boot
//!   of one kernel: a descriptor open for reading is restored only on the machine and boot it
//!   was captured in (`devices::check_machine`). One open for writing only has no position and
//!   moves anywhere.

use crate::error::{Context, Error, Result};
use ferry_sys::fdops;
use std::os::fd::{AsRawFd, OwnedFd};

pub const KMSG_RDEV: (u32, u32) = (1, 11);

/// Whether `rdev` is /dev/kmsg's.
pub fn is_kmsg(rdev: u64) -> bool {
    (libc::major(rdev), libc::minor(rdev)) == KMSG_RDEV
}

/// A record's sequence number, from its header ("PRIO,SEQ,USEC,FLAGS;text").
fn seq_of(record: &[u8]) -> Option<u64> {
    let head = record.split(|&b| b == b';').next()?;
    let head = std::str::from_utf8(head).ok()?;
    head.split(',').nth(1)?.parse().ok()
}

enum Next {
    Record(u64),
    None,
    /// The record at the position has been overwritten (the read moved on to the first one
    /// still kept).
    Lost,
}

fn read_next(fd: &OwnedFd, buf: &mut [u8]) -> ferry_sys::SysResult<Next> {
    match fdops::read_fd(fd.as_raw_fd(), buf) {
        Ok(n) => Ok(seq_of(&buf[..n]).map_or(Next::None, Next::Record)),
        Err(e) if e.errno == libc::EAGAIN => Ok(Next::None),
        Err(e) if e.errno == libc::EPIPE => Ok(Next::Lost),
        Err(e) => Err(e),
    }
}

/// Sets `fd` (a /dev/kmsg reader, non-blocking) at record `seq`: SEEK_SET, then reading
/// records up to it. `Err(first)`: the first record kept now is after `seq`.
fn seek_to(fd: &OwnedFd, seq: u64) -> std::result::Result<(), String> {
    let first = first_kept()?;
    if first > seq {
        return Err(format!(
            "record {seq} is no longer kept by the kernel (the first kept is {first})"
        ));
    }
    fdops::lseek(fd.as_raw_fd(), 0, libc::SEEK_SET).map_err(|e| e.to_string())?;
    if first == seq {
        return Ok(());
    }
    let mut buf = vec![0u8; 16384];
    loop {
        match read_next(fd, &mut buf).map_err(|e| e.to_string())? {
            Next::Record(r) if r + 1 == seq => return Ok(()),
            Next::Record(r) if r < seq => continue,
            Next::Record(r) => {
                return Err(format!(
                    "record {r} read while looking for {seq} (the log moved on meanwhile)"
                ))
            }
            Next::Lost => continue,
            Next::None => return Err(format!("record {seq} is not in the kernel's log yet")),
        }
    }
}

/// A reader of our own, non-blocking, at the first record kept.
fn own_reader() -> std::result::Result<OwnedFd, String> {
    fdops::open_path(
        "/dev/kmsg",
        libc::O_RDONLY | libc::O_NONBLOCK | libc::O_CLOEXEC,
        0,
    )
    .map_err(|e| format!("open /dev/kmsg: {e}"))
}

/// The sequence number of the first record the kernel keeps now.
fn first_kept() -> std::result::Result<u64, String> {
    let r = own_reader()?;
    let mut buf = vec![0u8; 16384];
    for _ in 0..16 {
        match read_next(&r, &mut buf).map_err(|e| e.to_string())? {
            Next::Record(s) => return Ok(s),
            Next::Lost => continue,
            Next::None => return Ok(0),
        }
    }
    Err("the kernel's log moves on too fast to read its first record".into())
}

/// The sequence number after the last record now, read through `r`, a reader of our own.
fn end_through(r: &OwnedFd) -> std::result::Result<u64, String> {
    let mut buf = vec![0u8; 16384];
    let mut last = None;
    loop {
        match read_next(r, &mut buf).map_err(|e| e.to_string())? {
            Next::Record(s) => last = Some(s),
            Next::Lost => continue,
            Next::None => return Ok(last.map_or(0, |s| s + 1)),
        }
    }
}

/// The read position (the next record's sequence number) of `copy`, our descriptor of a
/// frozen process's /dev/kmsg description open for reading; the description is left where it
/// was. `what` names it for messages.
pub fn capture_position(pid: i32, what: &str, copy: &OwnedFd) -> Result<u64> {
    let me = std::process::id() as i32;
    let refuse = |why: String| Error::Unsupported {
        pid,
        what: what.into(),
        why,
    };
    let fl = fdops::get_fl(copy.as_raw_fd()).ctx(pid, || format!("flags of {what}"))?;
    if fl & libc::O_NONBLOCK == 0 {
        fdops::set_fl(copy.as_raw_fd(), fl | libc::O_NONBLOCK)
            .ctx(pid, || format!("make {what} non-blocking for a moment"))?;
    }
    let got = (|| -> Result<u64> {
        let own = own_reader().map_err(|e| refuse(e.clone()))?;
        for _ in 0..16 {
            let ev = ferry_sys::sockets::poll_now(copy.as_raw_fd(), libc::POLLIN)
                .ctx(pid, || format!("poll {what}"))?;
            if ev & (libc::POLLERR | libc::POLLPRI) != 0 {
                return Err(refuse(
                    "the record at its read position has been overwritten already: its next \
                     read fails with EPIPE, which a restore cannot make it do again"
                        .into(),
                ));
            }
            if ev & libc::POLLIN != 0 {
                let mut buf = vec![0u8; 16384];
                let seq = match read_next(copy, &mut buf).ctx(pid, || format!("read {what}"))? {
                    Next::Record(s) => s,
                    _ => return Err(refuse("its next record could not be read".into())),
                };
                seek_to(copy, seq).map_err(|e| Error::Restore {
                    pid,
                    what: format!("{what}: put its read position back to record {seq}: {e}"),
                })?;
                return Ok(seq);
            }
            // At the end: the sequence number after the last record, if the end did not move
            // while we read it.
            let end = end_through(&own).map_err(|e| refuse(e.clone()))?;
            let copy_at_end = ferry_sys::sockets::poll_now(copy.as_raw_fd(), libc::POLLIN)
                .ctx(pid, || format!("poll {what}"))?
                == 0;
            let own_at_end = ferry_sys::sockets::poll_now(own.as_raw_fd(), libc::POLLIN)
                .ctx(me, || "poll our /dev/kmsg".into())?
                == 0;
            if copy_at_end && own_at_end {
                return Ok(end);
            }
        }
        Err(refuse(
            "the kernel's log grew too fast to read its position".into(),
        ))
    })();
    if fl & libc::O_NONBLOCK == 0 {
        fdops::set_fl(copy.as_raw_fd(), fl).ctx(pid, || format!("flags of {what}"))?;
    }
    got
}

/// Sets `fd`, /dev/kmsg opened again (non-blocking) for PID `pid`'s `what`, at record `seq`.
pub fn restore_position(pid: i32, what: &str, fd: &OwnedFd, seq: u64) -> Result<()> {
    seek_to(fd, seq).map_err(|e| Error::Restore {
        pid,
        what: format!("{what} (/dev/kmsg): its read position, record {seq}: {e}; refused"),
    })
}

/// CAP_SYSLOG's bit in a capability set.
const CAP_SYSLOG: u64 = 1 << 34;

/// Whether process `p` may read the kernel's log, as the kernel would ask when it opens
/// /dev/kmsg for reading (`check_syslog_permissions`): Ferry's open runs with root's
/// capabilities, so for a restore asked for by another user (`caller`) this is checked here.
pub fn check_reader(
    p: &ferry_image::Process,
    caller: Option<&ferry_sys::fsid::FsCreds>,
    what: &str,
) -> Result<()> {
    let by_user = caller.is_some_and(|c| c.uid != 0);
    let restricted = std::fs::read_to_string("/proc/sys/kernel/dmesg_restrict")
        .map(|v| v.trim() != "0")
        .unwrap_or(true);
    if by_user && restricted && p.creds.cap_eff & CAP_SYSLOG == 0 {
        return Err(Error::Restore {
            pid: p.pid,
            what: format!(
                "{what} (/dev/kmsg open for reading): the kernel's log is readable only with \
                 CAP_SYSLOG here (kernel.dmesg_restrict), which the process does not have; \
                 refused"
            ),
        });
    }
    Ok(())
}
