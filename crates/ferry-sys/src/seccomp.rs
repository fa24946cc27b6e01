//! seccomp(2) user notification: the supervisor's side of a filter that returns
//! SECCOMP_RET_USER_NOTIF (a listener descriptor, its RECV / SEND / ID_VALID ioctls).

use crate::{check, SysResult};
use std::os::fd::RawFd;

/// ioctl numbers: _IOWR('!', 0, struct seccomp_notif), _IOWR('!', 1, struct
/// seccomp_notif_resp), _IOW('!', 2, __u64).
const SECCOMP_IOCTL_NOTIF_RECV: libc::c_ulong = 0xc050_2100;
const SECCOMP_IOCTL_NOTIF_SEND: libc::c_ulong = 0xc018_2101;
const SECCOMP_IOCTL_NOTIF_ID_VALID: libc::c_ulong = 0x4008_2102;
/// _IOW('!', 4, __u64)
const SECCOMP_IOCTL_NOTIF_SET_FLAGS: libc::c_ulong = 0x4008_2104;
const SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP: u64 = 1;
/// Lets the notified call run as if no filter had stopped it.
pub const SECCOMP_USER_NOTIF_FLAG_CONTINUE: u32 = 1;

/// struct seccomp_notif (with its struct seccomp_data).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct RawNotif {
    id: u64,
    pid: u32,
    flags: u32,
    nr: i32,
    arch: u32,
    ip: u64,
    args: [u64; 6],
}

/// struct seccomp_notif_resp
#[repr(C)]
struct RawResp {
    id: u64,
    val: i64,
    error: i32,
    flags: u32,
}

/// A system call a filter handed to us: which thread (its TID in our PID namespace), which
/// call, with which arguments.
#[derive(Debug, Clone, Copy)]
pub struct Notif {
    pub id: u64,
    pub pid: i32,
    pub nr: i32,
    pub arch: u32,
    pub args: [u64; 6],
}

/// Takes the next notification waiting on `listener` (blocks if there is none).
pub fn recv(listener: RawFd) -> SysResult<Notif> {
    let mut n = RawNotif::default();
    // SAFETY: the kernel writes one struct seccomp_notif, which must be zeroed on entry.
    let r = unsafe { libc::ioctl(listener, SECCOMP_IOCTL_NOTIF_RECV, &mut n) };
    check("ioctl(SECCOMP_IOCTL_NOTIF_RECV)", r as libc::c_long)?;
    Ok(Notif {
        id: n.id,
        pid: n.pid as i32,
        nr: n.nr,
        arch: n.arch,
        args: n.args,
    })
}

/// Answers notification `id`: the call returns `val`, or fails with `error` (a positive errno);
/// with [`SECCOMP_USER_NOTIF_FLAG_CONTINUE`] it runs in the kernel instead.
pub fn respond(listener: RawFd, id: u64, val: i64, error: i32, flags: u32) -> SysResult<()> {
    let resp = RawResp {
        id,
        val,
        error: -error,
        flags,
    };
    // SAFETY: the kernel reads one struct seccomp_notif_resp.
    let r = unsafe { libc::ioctl(listener, SECCOMP_IOCTL_NOTIF_SEND, &resp) };
    check("ioctl(SECCOMP_IOCTL_NOTIF_SEND)", r as libc::c_long).map(drop)
}

/// Whether notification `id` is still waiting (its caller not killed or interrupted): checked
/// after reading the caller's memory and before acting on what was read.
pub fn id_valid(listener: RawFd, id: u64) -> bool {
    // SAFETY: the kernel reads one u64.
    let r = unsafe { libc::ioctl(listener, SECCOMP_IOCTL_NOTIF_ID_VALID, &id) };
    r == 0
}

/// Asks the kernel to wake the supervisor synchronously (Linux 6.6+): the notifying thread
/// hands its CPU to the supervisor and back, instead of waiting for a scheduler wakeup each way.
pub fn sync_wake_up(listener: RawFd) -> SysResult<()> {
    // SAFETY: the request takes its flags by value.
    let r = unsafe {
        libc::ioctl(
            listener,
            SECCOMP_IOCTL_NOTIF_SET_FLAGS,
            SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP,
        )
    };
    check("ioctl(SECCOMP_IOCTL_NOTIF_SET_FLAGS)", r as libc::c_long).map(drop)
}
