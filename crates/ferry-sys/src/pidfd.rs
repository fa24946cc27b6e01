//! pidfd_open(2), pidfd_getfd(2): taking a copy of another process's file descriptor.

use crate::{check, SysResult};
use std::os::fd::{FromRawFd, OwnedFd};

pub fn pidfd_open(pid: i32) -> SysResult<OwnedFd> {
    // SAFETY: plain integer arguments.
    let mut r = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if r < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL) {
        // Not a thread-group leader: a thread of a process whose main thread has exited,
        // standing for it (PIDFD_THREAD, Linux 6.9+; pidfd_getfd then reads its table).
        // SAFETY: plain integer arguments.
        r = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, libc::O_EXCL) };
    }
    let fd = check("pidfd_open", r)?;
    // SAFETY: the kernel just returned this new descriptor; we are its only owner.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Duplicates descriptor `targetfd` of the process behind `pidfd` into this process. The copy
/// shares the open file description (offset, flags) with the original.
pub fn pidfd_getfd(pidfd: &OwnedFd, targetfd: i32) -> SysResult<OwnedFd> {
    use std::os::fd::AsRawFd;
    // SAFETY: plain integer arguments.
    let r = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), targetfd, 0) };
    let fd = check("pidfd_getfd", r)?;
    // SAFETY: the kernel just returned this new descriptor; we are its only owner.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Sends signal `sig` to the process behind `pidfd` (which cannot have been replaced by another
/// process under a recycled PID).
pub fn pidfd_send_signal(pidfd: &OwnedFd, sig: i32) -> SysResult<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: plain integer arguments; a null siginfo asks for a kill(2)-like signal.
    let r = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            sig,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    check("pidfd_send_signal", r).map(drop)
}

/// Sends signal `sig` to the process behind `pidfd` with a siginfo of our making: `code`
/// (negative: SI_QUEUE and the like; the kernel refuses others from anyone but the target
/// itself), sender `pid` and `uid`, and value `value` (si_value).
pub fn pidfd_send_siginfo(
    pidfd: &OwnedFd,
    sig: i32,
    code: i32,
    pid: i32,
    uid: u32,
    value: u64,
) -> SysResult<()> {
    use std::os::fd::AsRawFd;
    // struct siginfo on x86_64 (128 bytes): si_signo, si_errno, si_code, then at 16 si_pid,
    // si_uid and at 24 si_value.
    let mut info = [0u64; 16];
    info[0] = sig as u32 as u64;
    info[1] = code as u32 as u64;
    info[2] = (pid as u32 as u64) | ((uid as u64) << 32);
    info[3] = value;
    // SAFETY: `info` is a 128-byte siginfo_t laid out as above; the kernel only reads it.
    let r = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            sig,
            info.as_ptr(),
            0,
        )
    };
    check("pidfd_send_signal (with siginfo)", r).map(drop)
}
