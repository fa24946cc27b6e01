//! Forking a worker that outlives nothing: it is told (by a signal) when its parent dies.

use crate::{check, SysError, SysResult};

pub enum Forked {
    Parent { child: i32 },
    Child,
}

/// fork(2). The caller must be single-threaded: the child continues with a copy of this one
/// thread only.
pub fn fork_single_threaded() -> SysResult<Forked> {
    // SAFETY: the callers fork before starting any thread, so the child's copy of the address
    // space holds no lock taken by a thread that does not exist in the child.
    let r = unsafe { libc::fork() };
    match r {
        -1 => Err(SysError::last("fork")),
        0 => Ok(Forked::Child),
        child => Ok(Forked::Parent { child }),
    }
}

/// A raw clone(2) with `flags` (namespaces to make new) and `SIGCHLD` when the child exits:
/// no C library fork handlers and no new stack, so the child runs on its copy of ours, like
/// fork. Returns what the system call did: the child's PID, 0 in the child, -1 on error (see
/// errno).
///
/// # Safety
/// The caller must be single-threaded, and the child may make only async-signal-safe calls
/// (on data prepared before) until it execs or exits.
pub(crate) unsafe fn raw_clone(flags: libc::c_int) -> i32 {
    // SAFETY: integer arguments only; what the child may do is the caller's promise above.
    unsafe {
        libc::syscall(
            libc::SYS_clone,
            (flags | libc::SIGCHLD) as libc::c_ulong,
            0usize,
            0usize,
            0usize,
            0usize,
        ) as i32
    }
}

/// Asks the kernel to send `sig` to this process when its parent thread dies.
pub fn set_parent_death_signal(sig: i32) -> SysResult<()> {
    // SAFETY: plain integer arguments.
    let r = unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, sig as libc::c_ulong, 0, 0, 0) };
    check("prctl(PR_SET_PDEATHSIG)", r as libc::c_long).map(drop)
}

pub fn parent_pid() -> i32 {
    // SAFETY: getppid cannot fail.
    unsafe { libc::getppid() }
}

/// Waits for a child process and returns its exit code (128 + signal if killed).
pub fn wait_exit_code(child: i32) -> SysResult<i32> {
    loop {
        match crate::wait::wait_tid(child, false)? {
            crate::wait::WaitStatus::Exited(c) => return Ok(c),
            crate::wait::WaitStatus::Signaled(s) => return Ok(128 + s),
            _ => continue,
        }
    }
}

/// Restores the default action of SIGPIPE (Rust ignores it), so that `ferry ... | head` ends
/// quietly like any Unix tool instead of failing on a closed pipe.
pub fn default_sigpipe() {
    // SAFETY: installing the default disposition for one signal; no handler code involved.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
}

/// Ignores SIGPIPE: a write to a closed pipe or socket then fails with EPIPE, which the
/// caller reports, instead of killing the process silently (a lazy migration's worker, whose
/// page link may close under it).
pub fn ignore_sigpipe() {
    // SAFETY: installing the ignore disposition for one signal; no handler code involved.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
}

/// Kills this process outright (SIGKILL), as if someone else had: for fault injection in tests.
pub fn kill_self() -> ! {
    // SAFETY: plain integer arguments; SIGKILL cannot be caught, so nothing of ours runs after.
    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    unreachable!("SIGKILL did not kill this process")
}

/// Sets this thread's name (`comm`, what `ps` shows; the kernel keeps 15 bytes of it).
pub fn set_name(name: &str) -> SysResult<()> {
    let c = std::ffi::CString::new(name).map_err(|_| SysError {
        op: "prctl(PR_SET_NAME)",
        errno: libc::EINVAL,
    })?;
    // SAFETY: c is a live NUL-terminated string; the kernel copies at most 16 bytes of it.
    let r = unsafe { libc::prctl(libc::PR_SET_NAME, c.as_ptr() as libc::c_ulong, 0, 0, 0) };
    check("prctl(PR_SET_NAME)", r as libc::c_long).map(drop)
}

/// Closes every descriptor of this process from `first` up.
pub fn close_from(first: u32) -> SysResult<()> {
    // SAFETY: plain integer arguments; the caller owns no descriptor in the range that it
    // goes on using (the descriptors closed are not reached through any live OwnedFd).
    let r = unsafe { libc::syscall(libc::SYS_close_range, first, u32::MAX, 0u32) };
    check("close_range", r).map(drop)
}
