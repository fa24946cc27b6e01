//! clone3(2) with `set_tid`: creating a process under the PID it had before.

use crate::{SysError, SysResult};

/// `struct clone_args` as of Linux 5.5 (with `set_tid`), laid out for the kernel.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct CloneArgs {
    pub flags: u64,
    pub pidfd: u64,
    pub child_tid: u64,
    pub parent_tid: u64,
    pub exit_signal: u64,
    pub stack: u64,
    pub stack_size: u64,
    pub tls: u64,
    pub set_tid: u64,
    pub set_tid_size: u64,
    pub cgroup: u64,
}

impl CloneArgs {
    /// The struct as the bytes the kernel reads, for placing in another process's memory.
    pub fn to_bytes(&self) -> Vec<u8> {
        [
            self.flags,
            self.pidfd,
            self.child_tid,
            self.parent_tid,
            self.exit_signal,
            self.stack,
            self.stack_size,
            self.tls,
            self.set_tid,
            self.set_tid_size,
            self.cgroup,
        ]
        .iter()
        .flat_map(|w| w.to_ne_bytes())
        .collect()
    }
}

/// Starts an idle process whose PID is `pid` and whose parent is not us: a launcher child makes it
/// with clone3(set_tid) and exits at once, so the new process is adopted by our nearest
/// subreaper (or init). The new process sleeps in pause() until a tracer takes it over; it is a
/// copy of this process, so the caller replaces its whole address space before letting it run.
///
/// Returns `Err` with `EEXIST` when `pid` is taken.
pub fn spawn_idle_with_pid(pid: i32) -> SysResult<()> {
    let tids = [pid as libc::pid_t];
    let args = CloneArgs {
        exit_signal: libc::SIGCHLD as u64,
        set_tid: tids.as_ptr() as u64,
        set_tid_size: 1,
        ..Default::default()
    };
    // SAFETY: fork in a program that may have other threads: the child below only makes raw
    // system calls (clone3, pause, _exit), which are async-signal-safe.
    let launcher = unsafe { libc::fork() };
    if launcher < 0 {
        return Err(SysError::last("fork (restore launcher)"));
    }
    if launcher == 0 {
        // SAFETY: args and tids live on this stack frame, which outlives the call.
        let r = unsafe {
            libc::syscall(
                libc::SYS_clone3,
                &args as *const CloneArgs,
                std::mem::size_of::<CloneArgs>(),
            )
        };
        if r == 0 {
            loop {
                // SAFETY: pause has no arguments; the tracer takes this process over from here.
                unsafe { libc::pause() };
            }
        }
        let code = if r < 0 {
            std::io::Error::last_os_error().raw_os_error().unwrap_or(1)
        } else {
            0
        };
        // SAFETY: _exit ends only this child, without running the parent's atexit handlers.
        unsafe { libc::_exit(code.min(255)) };
    }
    let mut status = 0;
    // SAFETY: status is a valid out-pointer; launcher is our child.
    let r = unsafe { libc::waitpid(launcher, &mut status, 0) };
    if r < 0 {
        return Err(SysError::last("waitpid (restore launcher)"));
    }
    match crate::wait::decode(status) {
        crate::wait::WaitStatus::Exited(0) => Ok(()),
        crate::wait::WaitStatus::Exited(errno) => Err(SysError::new("clone3(set_tid)", errno)),
        other => Err(SysError::new(
            "clone3(set_tid)",
            if matches!(other, crate::wait::WaitStatus::Signaled(_)) {
                libc::EINTR
            } else {
                libc::EIO
            },
        )),
    }
}

/// Like [`spawn_idle_with_pid`], but the new process is made inside the PID, time and mount
/// namespaces of the process behind `ns_pidfd` (the init of a guest namespace), with PID `pid`
/// there, and is adopted by that init: the launcher joins the namespaces (setns) and forks a
/// second launcher inside them, under the free PID `helper_pid`, which makes the process with
/// clone3(set_tid) and exits at once. The new process's PID in our namespace is the kernel's
/// choice; find it through the init's children.
///
/// Returns `Err` with `EEXIST` when `pid` is taken there; a failure to join the namespaces or to
/// start the second launcher is reported under its own operation name.
pub fn spawn_idle_in_guest(ns_pidfd: i32, pid: i32, helper_pid: i32) -> SysResult<()> {
    let tids = [pid as libc::pid_t];
    let helper_tids = [helper_pid as libc::pid_t];
    let args = CloneArgs {
        exit_signal: libc::SIGCHLD as u64,
        set_tid: tids.as_ptr() as u64,
        set_tid_size: 1,
        ..Default::default()
    };
    let helper_args = CloneArgs {
        exit_signal: libc::SIGCHLD as u64,
        set_tid: helper_tids.as_ptr() as u64,
        set_tid_size: 1,
        ..Default::default()
    };
    let ns = crate::ns::GUEST_NAMESPACES;
    // SAFETY: fork in a program that may have other threads: the children below only make raw
    // system calls (setns, clone3, waitpid, pause, _exit) on memory prepared before the fork.
    let launcher = unsafe { libc::fork() };
    if launcher < 0 {
        return Err(SysError::last("fork (restore launcher)"));
    }
    if launcher == 0 {
        let errno = || std::io::Error::last_os_error().raw_os_error().unwrap_or(1);
        // SAFETY: raw system calls; args, helper_args and the tid arrays live on this stack
        // frame, which outlives every call; every path ends in pause or _exit.
        unsafe {
            // Exit codes: 0 made; below 128 the errno of making the process; 128 + errno of
            // joining the namespaces or starting the second launcher (errnos stay below 128).
            if libc::setns(ns_pidfd, ns) != 0 {
                libc::_exit(128 + errno().min(127));
            }
            let helper = libc::syscall(
                libc::SYS_clone3,
                &helper_args as *const CloneArgs,
                std::mem::size_of::<CloneArgs>(),
            );
            if helper < 0 {
                libc::_exit(128 + errno().min(127));
            }
            if helper == 0 {
                let r = libc::syscall(
                    libc::SYS_clone3,
                    &args as *const CloneArgs,
                    std::mem::size_of::<CloneArgs>(),
                );
                if r == 0 {
                    loop {
                        libc::pause();
                    }
                }
                libc::_exit(if r < 0 { errno().min(127) } else { 0 });
            }
            let mut status = 0;
            if libc::waitpid(helper as libc::pid_t, &mut status, 0) < 0 {
                libc::_exit(128 + errno().min(127));
            }
            libc::_exit(if libc::WIFEXITED(status) {
                libc::WEXITSTATUS(status)
            } else {
                128 + libc::EINTR
            });
        }
    }
    let mut status = 0;
    // SAFETY: status is a valid out-pointer; launcher is our child.
    let r = unsafe { libc::waitpid(launcher, &mut status, 0) };
    if r < 0 {
        return Err(SysError::last("waitpid (restore launcher)"));
    }
    match crate::wait::decode(status) {
        crate::wait::WaitStatus::Exited(0) => Ok(()),
        crate::wait::WaitStatus::Exited(c) if c >= 128 => Err(SysError::new(
            "setns into the guest namespaces or start the launcher there",
            c - 128,
        )),
        crate::wait::WaitStatus::Exited(errno) => Err(SysError::new("clone3(set_tid)", errno)),
        _ => Err(SysError::new("restore launcher (killed)", libc::EINTR)),
    }
}
