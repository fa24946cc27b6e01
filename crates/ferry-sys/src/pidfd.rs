//! pidfd_open(2), pidfd_getfd(2): taking a copy of another process's file descriptor; signals
//! through pidfds, and the status a reaped process ended with.

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

/// PIDFD_GET_INFO: `_IOWR(0xFF, 11, struct pidfd_info)`, with the first version of the struct
/// (64 bytes; the kernel takes the size from the number).
const PIDFD_GET_INFO_V0: u64 = (3 << 30) | (64 << 16) | (0xFF << 8) | 11;
const PIDFD_INFO_EXIT: u64 = 1 << 3;

/// The wait status the process behind `pidfd` ended with, once it has been reaped (by whoever
/// reaped it: PIDFD_GET_INFO with PIDFD_INFO_EXIT, Linux 6.15+); None while it lives or is a
/// zombie, or on an older kernel.
pub fn exit_status(pidfd: &OwnedFd) -> Option<i32> {
    use std::os::fd::AsRawFd;
    // struct pidfd_info (version 0): mask at 0 (in: what we ask; out: what it holds),
    // exit_code at 60.
    let mut info = [0u64; 8];
    info[0] = PIDFD_INFO_EXIT;
    // SAFETY: info is 64 writable bytes, the size the request number says.
    let r = unsafe { libc::ioctl(pidfd.as_raw_fd(), PIDFD_GET_INFO_V0 as _, info.as_mut_ptr()) };
    if r < 0 || info[0] & PIDFD_INFO_EXIT == 0 {
        return None;
    }
    Some((info[7] >> 32) as u32 as i32)
}

#[cfg(test)]
mod tests {
    /// A child's status reads from its pidfd once it has been reaped, not before.
    #[test]
    fn exit_status_of_a_reaped_child() {
        let mut child = std::process::Command::new("sh")
            .args(["-c", "read x; exit 7"])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let fd = super::pidfd_open(child.id() as i32).unwrap();
        assert_eq!(super::exit_status(&fd), None, "alive");
        drop(child.stdin.take());
        let st = child.wait().unwrap();
        assert_eq!(st.code(), Some(7));
        assert_eq!(super::exit_status(&fd), Some(7 << 8));
    }
}
