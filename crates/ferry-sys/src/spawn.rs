//! Starting a program on behalf of someone else (the remote side of `ferry run`), and the
//! process-identity and signal helpers its client needs.
//!
//! [`spawn`] forks from a multi-threaded daemon, so the child makes only async-signal-safe calls
//! between fork and execve: everything that allocates (argument vectors, the resolved path) is
//! prepared before the fork. The child gets a new session, optionally a controlling terminal,
//! its stdio, then drops to the new user (supplementary groups, gid, uid) before it does
//! anything on the user's behalf: its rlimits are set as the user (a hard limit above the one it
//! inherited is refused, as it would be for the user), its cwd is entered and its program found
//! and executed as the user (a PATH search never tells the user whether a file it cannot reach
//! exists). Then a parent-death signal, umask, signal dispositions and mask, and execve. A
//! failure before execve reaches the parent as (step, errno, candidate) through a close-on-exec
//! pipe; the child then exits with 127. The child is never waited for here: the caller's reaper
//! collects every exit status.

use crate::{check, SysError, SysResult};
use std::ffi::CString;
use std::fmt;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

/// Everything the child needs, prepared before the fork.
#[derive(Debug, Clone)]
pub struct Spawn {
    /// Where the program may be, tried in order by the child once it is the new user and in
    /// `cwd` (relative names are relative to it): the first that is a regular file is executed.
    pub candidates: Vec<CString>,
    /// The candidates are a PATH search, as a shell makes it: one that does not exist, or
    /// cannot be reached by the user, is skipped; one that exists but cannot be executed is
    /// remembered and the search goes on (it is the error if nothing else is found). Otherwise
    /// there is one candidate (a name with a slash) and its error is the error.
    pub search: bool,
    pub argv: Vec<CString>,
    /// `NAME=value` strings.
    pub envp: Vec<CString>,
    pub cwd: CString,
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
    pub umask: u32,
    /// (resource, soft, hard), set after the uid changes: as the user, who cannot raise a hard
    /// limit above the one the child inherits.
    pub rlimits: Vec<(u32, u64, u64)>,
    /// The descriptors that become the child's 0, 1 and 2.
    pub stdio: [RawFd; 3],
    /// Make the child's stdin (a terminal) its controlling terminal.
    pub controlling_tty: bool,
    /// Signals the child starts with ignored (bit `n - 1` for signal `n`); all others default.
    pub sig_ignored: u64,
    /// The child's initial signal mask (same bit layout).
    pub sig_blocked: u64,
    /// Sent to the child when the forking thread dies (0: none).
    pub parent_death_signal: i32,
    /// A mount namespace (an nsfs descriptor) the child enters first, while still root: its
    /// root and working directory become that namespace's root, and `cwd` is then looked up
    /// there (a guest's confined file system).
    pub mount_ns: Option<RawFd>,
    /// A user namespace (an nsfs descriptor) the child enters, while still root, so that its
    /// capabilities count only there (a confined guest's, whose mounts it owns and has locked):
    /// a user's child before its credentials change, root's after its limits are set (which
    /// may raise a hard limit, as root, the caller, may).
    pub user_ns: Option<RawFd>,
}

impl Spawn {
    /// `argv` and `envp` as execve(2) takes them: pointers into `self`, each list ended by a
    /// null pointer, made before the fork (the child may not allocate).
    pub(crate) fn pointers(&self) -> (Vec<*const libc::c_char>, Vec<*const libc::c_char>) {
        let list = |v: &[CString]| {
            v.iter()
                .map(|a| a.as_ptr())
                .chain(std::iter::once(std::ptr::null()))
                .collect()
        };
        (list(&self.argv), list(&self.envp))
    }
}

/// The step of the child's setup that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    Fork,
    Session,
    Stdio,
    ControllingTty,
    Groups,
    Gid,
    Uid,
    Rlimit,
    ParentDeath,
    Cwd,
    Umask,
    Signals,
    Exec,
    MountNs,
    Namespaces,
    UserNs,
    NetNs,
}

const STEPS: [Step; 17] = [
    Step::Fork,
    Step::Session,
    Step::Stdio,
    Step::ControllingTty,
    Step::Groups,
    Step::Gid,
    Step::Uid,
    Step::Rlimit,
    Step::ParentDeath,
    Step::Cwd,
    Step::Umask,
    Step::Signals,
    Step::Exec,
    Step::MountNs,
    Step::Namespaces,
    Step::UserNs,
    Step::NetNs,
];

/// The step whose [`Step::code`] is `code`.
pub(crate) fn step_of(code: u8) -> Step {
    STEPS.get(code as usize).copied().unwrap_or(Step::Exec)
}

impl Step {
    pub(crate) fn code(self) -> u8 {
        STEPS.iter().position(|s| *s == self).unwrap_or(0) as u8
    }

    pub fn describe(self) -> &'static str {
        match self {
            Step::Fork => "fork",
            Step::Session => "setsid",
            Step::Stdio => "set up stdin, stdout and stderr",
            Step::ControllingTty => "take the terminal as controlling terminal",
            Step::Rlimit => "set resource limits",
            Step::Groups => "set supplementary groups",
            Step::Gid => "set gid",
            Step::Uid => "set uid",
            Step::ParentDeath => "set the parent-death signal",
            Step::Cwd => "change directory",
            Step::Umask => "set umask",
            Step::Signals => "reset signal dispositions",
            Step::Exec => "execute",
            Step::MountNs => "enter the guests' mount namespace",
            Step::Namespaces => "make the guest's own PID and mount namespaces",
            Step::UserNs => "enter the guests' user namespace",
            Step::NetNs => "enter the guests' network namespace",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpawnError {
    pub step: Step,
    pub errno: i32,
    /// The child that failed (it exits with 127 and must still be reaped), or 0 if none was made.
    pub pid: i32,
    /// For [`Step::Exec`]: the candidate the error is about (none: nothing was found).
    pub candidate: Option<usize>,
}

impl SpawnError {
    /// The error of `step` before any child was made: the system's `errno`.
    pub(crate) fn before(step: Step, errno: i32) -> SpawnError {
        SpawnError {
            step,
            errno,
            pid: 0,
            candidate: None,
        }
    }
}

impl fmt::Display for SpawnError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {}",
            self.step.describe(),
            std::io::Error::from_raw_os_error(self.errno)
        )
    }
}

impl std::error::Error for SpawnError {}

pub(crate) fn errno() -> i32 {
    // SAFETY: __errno_location returns the calling thread's errno slot; reading it is always
    // valid (and async-signal-safe).
    unsafe { *libc::__errno_location() }
}

/// Forks and executes `s`; returns the child's PID once execve succeeded.
pub fn spawn(s: &Spawn) -> Result<i32, SpawnError> {
    spawn_from(s, false)
}

/// [`spawn`]; with `for_parent` (the spawner, [`crate::spawner`]) the child is made our
/// parent's child (`CLONE_PARENT`), not ours: its parent-death signal and its reaping are our
/// parent's, as if our parent had forked it.
pub(crate) fn spawn_from(s: &Spawn, for_parent: bool) -> Result<i32, SpawnError> {
    let (err_r, err_w) = crate::fdops::pipe2(libc::O_CLOEXEC)
        .map_err(|e| SpawnError::before(Step::Fork, e.errno))?;
    let pid = start(s, for_parent, err_w.as_raw_fd())?;
    drop(err_w);
    finish(pid, err_r.as_raw_fd())
}

/// Forks the child (it reports a failure on `err_w`, which closes at its execve) and returns
/// its PID at once.
pub(crate) fn start(s: &Spawn, for_parent: bool, err_w: RawFd) -> Result<i32, SpawnError> {
    let fail0 = SpawnError::before;
    let (argv, envp) = s.pointers();
    let groups: Vec<libc::gid_t> = s.groups.clone();
    // SAFETY: getpid and getppid cannot fail.
    let parent = unsafe {
        match for_parent {
            true => libc::getppid(),
            false => libc::getpid(),
        }
    };

    // SAFETY: the child only runs `child` below, which makes async-signal-safe calls on data
    // prepared before the fork (no allocation, no lock), then execs or _exits. The spawner is
    // single-threaded, so its raw clone copies a consistent process.
    let pid = unsafe {
        match for_parent {
            true => crate::process::raw_clone(libc::CLONE_PARENT),
            false => libc::fork(),
        }
    };
    if pid < 0 {
        return Err(fail0(Step::Fork, errno()));
    }
    if pid == 0 {
        child(s, s.mount_ns, &argv, &envp, &groups, parent, err_w);
    }
    Ok(pid)
}

/// Waits for the child started by [`start`] to exec (Ok) or report what failed (every other
/// copy of the error pipe's write end closed).
pub(crate) fn finish(pid: i32, err_r: RawFd) -> Result<i32, SpawnError> {
    match read_report(err_r) {
        None => Ok(pid),
        Some(mut e) => {
            e.pid = pid;
            Err(e)
        }
    }
}

/// Reads the child's report from the error pipe until it closes: None if the pipe closed
/// without one (execve succeeded), else the error (its `pid` left 0 for the caller to fill).
pub(crate) fn read_report(err_r: RawFd) -> Option<SpawnError> {
    let mut buf = [0u8; 9];
    let mut got = 0;
    while got < buf.len() {
        // SAFETY: reading into the unfilled tail of a local buffer.
        let r = unsafe { libc::read(err_r, buf[got..].as_mut_ptr().cast(), buf.len() - got) };
        if r < 0 {
            if errno() == libc::EINTR {
                continue;
            }
            break;
        }
        if r == 0 {
            break;
        }
        got += r as usize;
    }
    if got == 0 {
        // The pipe closed on execve: the program runs.
        return None;
    }
    let step = STEPS.get(buf[0] as usize).copied().unwrap_or(Step::Exec);
    let (errno, candidate) = if got == buf.len() {
        let at = u32::from_ne_bytes([buf[5], buf[6], buf[7], buf[8]]);
        (
            i32::from_ne_bytes([buf[1], buf[2], buf[3], buf[4]]),
            (at != u32::MAX).then_some(at as usize),
        )
    } else {
        (libc::EIO, None)
    };
    Some(SpawnError {
        step,
        errno,
        pid: 0,
        candidate,
    })
}

/// The child between fork and execve, entering `mount_ns` first (the program's own mount
/// namespace is entered by its init instead: `crate::guest_spawn`). Never returns.
pub(crate) fn child(
    s: &Spawn,
    mount_ns: Option<RawFd>,
    argv: &[*const libc::c_char],
    envp: &[*const libc::c_char],
    groups: &[libc::gid_t],
    parent: i32,
    err_w: RawFd,
) -> ! {
    let report = |step: Step, e: i32, candidate: u32| -> ! {
        let mut msg = [0u8; 9];
        msg[0] = step.code();
        msg[1..5].copy_from_slice(&e.to_ne_bytes());
        msg[5..9].copy_from_slice(&candidate.to_ne_bytes());
        // SAFETY: write(2) and _exit(2) are async-signal-safe; msg is a local buffer.
        unsafe {
            libc::write(err_w, msg.as_ptr().cast(), msg.len());
            libc::_exit(127)
        }
    };
    let fail = |step: Step| -> ! { report(step, errno(), u32::MAX) };

    // SAFETY: setsid takes no arguments.
    if unsafe { libc::setsid() } < 0 {
        fail(Step::Session);
    }
    if let Some(ns) = mount_ns {
        // SAFETY: setns on a descriptor the caller holds; plain integer arguments. The child
        // has its own fs_struct (fork), as entering a mount namespace requires.
        if unsafe { libc::setns(ns, libc::CLONE_NEWNS) } < 0 {
            fail(Step::MountNs);
        }
    }
    // Move the stdio sources above 2 first, so that none is overwritten by another's dup2.
    let mut high = [0; 3];
    for (i, fd) in s.stdio.iter().enumerate() {
        // SAFETY: F_DUPFD_CLOEXEC duplicates a descriptor we hold; plain integer arguments.
        let r = unsafe { libc::fcntl(*fd, libc::F_DUPFD_CLOEXEC, 3) };
        if r < 0 {
            fail(Step::Stdio);
        }
        high[i] = r;
    }
    for (i, fd) in high.iter().enumerate() {
        // SAFETY: dup2 onto 0, 1, 2; the new descriptor is not close-on-exec.
        if unsafe { libc::dup2(*fd, i as i32) } < 0 {
            fail(Step::Stdio);
        }
    }
    if s.controlling_tty {
        // SAFETY: TIOCSCTTY takes an integer (0: do not steal from another session).
        if unsafe { libc::ioctl(0, libc::TIOCSCTTY as _, 0) } < 0 {
            fail(Step::ControllingTty);
        }
    }
    // Every limit is first only lowered where the caller asks for less, which grants nothing
    // (so that the uid change below counts the user's processes against the RLIMIT_NPROC it
    // asks for, as a login would); it is set exactly, as the user, after the change.
    for &(resource, cur, max) in &s.rlimits {
        let mut old = libc::rlimit64 {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: a null new limit only reads the old one into a valid local.
        if unsafe { libc::prlimit64(0, resource as _, std::ptr::null(), &mut old) } < 0 {
            fail(Step::Rlimit);
        }
        let lower = libc::rlimit64 {
            rlim_cur: cur.min(old.rlim_cur).min(max),
            rlim_max: max.min(old.rlim_max),
        };
        // SAFETY: lower is a valid in-pointer; old is null.
        if unsafe { libc::prlimit64(0, resource as _, &lower, std::ptr::null_mut()) } < 0 {
            fail(Step::Rlimit);
        }
    }
    let enter_user_ns = || {
        if let Some(ns) = s.user_ns {
            // Entering fills the bounding set; it is put back as it was (so the program holds
            // no capability its node's root lacks, and a capture of it restores anywhere).
            let mut bounding = 0u64;
            for cap in 0..64 {
                // SAFETY: plain integer arguments; -1 (EINVAL) past the last capability.
                if unsafe { libc::prctl(libc::PR_CAPBSET_READ, cap as libc::c_ulong, 0, 0, 0) } == 1
                {
                    bounding |= 1 << cap;
                }
            }
            // SAFETY: setns on a descriptor the caller holds; this child is single-threaded
            // with its own fs_struct, as entering a user namespace requires.
            if unsafe { libc::setns(ns, libc::CLONE_NEWUSER) } < 0 {
                fail(Step::UserNs);
            }
            for cap in 0..64 {
                // SAFETY: plain integer arguments.
                let now =
                    unsafe { libc::prctl(libc::PR_CAPBSET_READ, cap as libc::c_ulong, 0, 0, 0) };
                if now == 1 && bounding & (1 << cap) == 0 {
                    // SAFETY: plain integer arguments (CAP_SETPCAP is ours in the namespace).
                    if unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) }
                        < 0
                    {
                        fail(Step::UserNs);
                    }
                }
            }
        }
    };
    if s.uid != 0 {
        enter_user_ns();
    }
    // The credentials are changed by the raw system calls, for this thread only: glibc's
    // setgroups/setresgid/setresuid signal every thread of the process it believes it is
    // (`__nptl_setxid`), and a child cloned without glibc (a raw clone of the multi-threaded
    // daemon) still holds the daemon's thread list: it waited forever for a thread that was
    // being created at the moment of the clone. This child is single-threaded.
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        // SAFETY: groups points at groups.len() gids.
        if unsafe { libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) } < 0 {
            fail(Step::Groups);
        }
    }
    // SAFETY: plain integer arguments.
    if unsafe { libc::syscall(libc::SYS_setresgid, s.gid, s.gid, s.gid) } < 0 {
        fail(Step::Gid);
    }
    // SAFETY: plain integer arguments.
    if unsafe { libc::syscall(libc::SYS_setresuid, s.uid, s.uid, s.uid) } < 0 {
        fail(Step::Uid);
    }
    // From here on the child is the user: what follows is done with its rights only.
    for &(resource, cur, max) in &s.rlimits {
        let lim = libc::rlimit64 {
            rlim_cur: cur,
            rlim_max: max,
        };
        // SAFETY: lim is a valid in-pointer; old is null.
        if unsafe { libc::prlimit64(0, resource as _, &lim, std::ptr::null_mut()) } < 0 {
            fail(Step::Rlimit);
        }
    }
    if s.uid == 0 {
        enter_user_ns();
    }
    if s.parent_death_signal != 0 {
        // Set after the uid change, which clears it.
        // SAFETY: plain integer arguments.
        let r = unsafe {
            libc::prctl(
                libc::PR_SET_PDEATHSIG,
                s.parent_death_signal as libc::c_ulong,
                0,
                0,
                0,
            )
        };
        if r < 0 {
            fail(Step::ParentDeath);
        }
        // SAFETY: getppid cannot fail.
        if unsafe { libc::getppid() } != parent {
            // SAFETY: _exit is async-signal-safe.
            unsafe { libc::_exit(127) };
        }
    }
    // SAFETY: cwd is a NUL-terminated string prepared before the fork.
    if unsafe { libc::chdir(s.cwd.as_ptr()) } < 0 {
        fail(Step::Cwd);
    }
    // SAFETY: umask cannot fail.
    unsafe { libc::umask(s.umask as libc::mode_t) };
    for sig in 1..=64 {
        if sig == libc::SIGKILL || sig == libc::SIGSTOP {
            continue;
        }
        let handler = if s.sig_ignored & (1u64 << (sig - 1)) != 0 {
            libc::SIG_IGN
        } else {
            libc::SIG_DFL
        };
        // SAFETY: sigaction is async-signal-safe; act is a zeroed (valid) struct with a
        // default or ignore disposition. Signals the C library reserves fail harmlessly.
        unsafe {
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = handler;
            libc::sigaction(sig, &act, std::ptr::null_mut());
        }
    }
    // SAFETY: set is a local sigset_t filled by sigemptyset/sigaddset before use.
    let r = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for sig in 1..=64 {
            if s.sig_blocked & (1u64 << (sig - 1)) != 0 {
                libc::sigaddset(&mut set, sig);
            }
        }
        libc::sigprocmask(libc::SIG_SETMASK, &set, std::ptr::null_mut())
    };
    if r < 0 {
        fail(Step::Signals);
    }
    // Everything the daemon holds (all close-on-exec already, but a descriptor inherited without
    // the flag must not leak into a stranger's program) closes at execve; the error pipe too.
    // SAFETY: plain integer arguments; failure (an old kernel) is harmless.
    unsafe {
        libc::syscall(
            libc::SYS_close_range,
            3u32,
            u32::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        )
    };
    // The program is looked for as the user, as a shell would (execvp's rules): a directory
    // the user cannot search hides what is in it.
    let mut denied: Option<(u32, i32)> = None;
    for (i, path) in s.candidates.iter().enumerate() {
        let at = i as u32;
        // SAFETY: path is a NUL-terminated string made before the fork; st is a local,
        // zeroed (valid) stat buffer; stat(2) is async-signal-safe.
        let (r, mode) = unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            let r = libc::stat(path.as_ptr(), &mut st);
            (r, st.st_mode & libc::S_IFMT)
        };
        if r < 0 {
            if s.search {
                continue;
            }
            report(Step::Exec, errno(), at);
        }
        if mode == libc::S_IFDIR {
            if s.search {
                continue;
            }
            report(Step::Exec, libc::EISDIR, at);
        }
        if mode != libc::S_IFREG && s.search {
            continue;
        }
        // SAFETY: path, argv and envp are NUL-terminated strings and NULL-terminated arrays
        // built before the fork, alive for the whole call.
        unsafe { libc::execve(path.as_ptr(), argv.as_ptr(), envp.as_ptr()) };
        let e = errno();
        if s.search && e == libc::EACCES {
            denied.get_or_insert((at, e));
            continue;
        }
        report(Step::Exec, e, at);
    }
    match denied {
        Some((at, e)) => report(Step::Exec, e, at),
        None => report(Step::Exec, libc::ENOENT, u32::MAX),
    }
}

/// A new pseudo-terminal: (master, slave), both close-on-exec, the slave not yet anyone's
/// controlling terminal.
pub fn open_pty() -> SysResult<(OwnedFd, OwnedFd)> {
    let master = crate::fdops::open_path(
        "/dev/ptmx",
        libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC,
        0,
    )?;
    crate::tty::set_locked(master.as_raw_fd(), false)?;
    let slave = crate::tty::open_peer(
        master.as_raw_fd(),
        libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC,
    )?;
    Ok((master, slave))
}

/// This process's effective uid and gid and its supplementary groups.
pub fn ids() -> SysResult<(u32, u32, Vec<u32>)> {
    // SAFETY: geteuid and getegid cannot fail.
    let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
    // SAFETY: a zero size only asks for the count.
    let n = unsafe { libc::getgroups(0, std::ptr::null_mut()) };
    check("getgroups", n as libc::c_long)?;
    let mut groups = vec![0 as libc::gid_t; n as usize];
    // SAFETY: groups has room for n gids.
    let n = unsafe { libc::getgroups(n, groups.as_mut_ptr()) };
    check("getgroups", n as libc::c_long)?;
    groups.truncate(n as usize);
    Ok((uid, gid, groups))
}

/// The supplementary groups of the process at the other end of a UNIX stream socket, as they
/// were when it connected (SO_PEERGROUPS).
pub fn peer_groups(sock: RawFd) -> SysResult<Vec<u32>> {
    let mut groups = vec![0 as libc::gid_t; 64];
    loop {
        let mut len = (groups.len() * std::mem::size_of::<libc::gid_t>()) as libc::socklen_t;
        // SAFETY: groups has room for len bytes; len is a valid in/out pointer.
        let r = unsafe {
            libc::getsockopt(
                sock,
                libc::SOL_SOCKET,
                libc::SO_PEERGROUPS,
                groups.as_mut_ptr().cast(),
                &mut len,
            )
        };
        let n = len as usize / std::mem::size_of::<libc::gid_t>();
        if r < 0 {
            let e = SysError::last("getsockopt(SO_PEERGROUPS)");
            if e.errno == libc::ERANGE && n > groups.len() {
                groups.resize(n, 0);
                continue;
            }
            return Err(e);
        }
        groups.truncate(n);
        return Ok(groups);
    }
}

/// Ignores `sig` in this process from now on.
pub fn ignore_signal(sig: i32) -> SysResult<()> {
    // SAFETY: installs the ignore disposition for one signal; no handler code involved.
    let r = unsafe { libc::signal(sig, libc::SIG_IGN) };
    if r == libc::SIG_ERR {
        return Err(SysError::last("signal(SIG_IGN)"));
    }
    Ok(())
}

/// Stops this process (SIGSTOP) until someone sends SIGCONT.
pub fn stop_self() {
    // SAFETY: raise with a valid signal number.
    unsafe { libc::raise(libc::SIGSTOP) };
}

/// Ends this process by signal `sig`, as if that signal had killed it, without dumping core
/// (the program that dumped core was elsewhere). If `sig` does not kill (it is one whose default
/// action is to ignore or stop), exits with 128 + `sig`, the shell's convention.
pub fn die_by_signal(sig: i32) -> ! {
    if (1..=64).contains(&sig) && sig != libc::SIGKILL && sig != libc::SIGSTOP {
        if let Ok((_, hard)) = crate::fdops::get_rlimit(0, libc::RLIMIT_CORE) {
            let _ = crate::fdops::set_rlimit(0, libc::RLIMIT_CORE, 0, hard);
        }
        // SAFETY: default disposition for one signal, then unblock it in this thread and send
        // it to this thread: a fatal signal ends the process before raise returns.
        unsafe {
            libc::signal(sig, libc::SIG_DFL);
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, sig);
            libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
            libc::raise(sig);
        }
    } else if sig == libc::SIGKILL {
        // SAFETY: raise with a valid signal number.
        unsafe { libc::raise(libc::SIGKILL) };
    }
    std::process::exit(128 + (sig & 0x7f))
}

/// Replaces descriptor `fd` (0, 1 or 2) with /dev/null: whoever reads the other end of a pipe
/// it was sees end-of-file, as when a program closes its stdout.
pub fn release_stdio(fd: RawFd) -> SysResult<()> {
    let null = crate::fdops::open_path("/dev/null", libc::O_RDWR | libc::O_CLOEXEC, 0)?;
    // SAFETY: dup2 of a descriptor we own onto `fd`; the old description is released.
    let r = unsafe { libc::dup2(null.as_raw_fd(), fd) };
    check("dup2", r as libc::c_long).map(drop)
}
