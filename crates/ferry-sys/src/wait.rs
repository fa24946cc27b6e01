//! waitpid(2) on traced threads, decoded into the stops Ferry cares about.

use crate::{SysError, SysResult};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitStatus {
    /// Exited with a status.
    Exited(i32),
    /// Killed by a signal.
    Signaled(i32),
    /// A ptrace stop: the signal, and the PTRACE_EVENT_* number (0 if none).
    Stopped { sig: i32, event: i32 },
    /// Nothing to report (WNOHANG).
    Nothing,
}

/// Waits for one specific thread (any kind of child, `__WALL`).
pub fn wait_tid(tid: i32, nohang: bool) -> SysResult<WaitStatus> {
    let mut status: libc::c_int = 0;
    let flags = libc::__WALL | if nohang { libc::WNOHANG } else { 0 };
    loop {
        // SAFETY: status is a valid out-pointer.
        let r = unsafe { libc::waitpid(tid, &mut status, flags) };
        if r < 0 {
            let e = SysError::last("waitpid");
            if e.errno == libc::EINTR {
                continue;
            }
            return Err(e);
        }
        if r == 0 {
            return Ok(WaitStatus::Nothing);
        }
        return Ok(decode(status));
    }
}

pub fn decode(status: i32) -> WaitStatus {
    if libc::WIFEXITED(status) {
        WaitStatus::Exited(libc::WEXITSTATUS(status))
    } else if libc::WIFSIGNALED(status) {
        WaitStatus::Signaled(libc::WTERMSIG(status))
    } else if libc::WIFSTOPPED(status) {
        WaitStatus::Stopped {
            sig: libc::WSTOPSIG(status),
            event: (status >> 16) & 0xff,
        }
    } else {
        WaitStatus::Nothing
    }
}

/// Reaps one ended child of any kind without blocking: its PID and raw wait status, or None
/// when no child has ended (or there are no children).
pub fn reap_any() -> Option<(i32, i32)> {
    let mut status: libc::c_int = 0;
    loop {
        // SAFETY: status is a valid out-pointer.
        let r = unsafe { libc::waitpid(-1, &mut status, libc::__WALL | libc::WNOHANG) };
        if r < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
            continue;
        }
        return (r > 0).then_some((r, status));
    }
}

/// Waits for one specific thread (`__WALL`), blocking, and returns its raw wait status.
pub fn wait_raw(tid: i32) -> SysResult<i32> {
    let mut status: libc::c_int = 0;
    loop {
        // SAFETY: status is a valid out-pointer.
        let r = unsafe { libc::waitpid(tid, &mut status, libc::__WALL) };
        if r < 0 {
            let e = SysError::last("waitpid");
            if e.errno == libc::EINTR {
                continue;
            }
            return Err(e);
        }
        return Ok(status);
    }
}
