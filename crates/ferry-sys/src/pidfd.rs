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
