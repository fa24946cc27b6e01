//! Namespaces for guests: new PID, time, mount and IPC namespaces whose PID 1 is an exec'd init
//! (with a /proc and a devpts instance of their own), and the small helpers that init needs.
//! The emulated nodes of a local cluster are made the same way, with a network and a UTS
//! namespace of their own instead of a time namespace (`spawn_node_init`).
//!
//! The time namespace's offsets can only be written before any process has entered it, so the
//! namespaces are made by `unshare` in a short-lived intermediate child, which writes the offsets
//! and forks the init; the init (PID 1 of the new PID namespace) mounts a /proc of its own and
//! execs. Nothing of the forking process survives the exec, so a large caller (one holding a
//! loaded image, say) pins no memory through the init.

use crate::{check, SysError, SysResult};
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;

/// `CLONE_NEWTIME` (Linux 5.6); not in every libc crate version.
pub const CLONE_NEWTIME: i32 = 0x80;

/// How the init of new guest namespaces is started.
pub struct GuestInitSpec<'a> {
    /// The program to exec as PID 1.
    pub exe: &'a std::path::Path,
    /// Its arguments, without argv[0] (which is `exe`).
    pub args: &'a [String],
    /// Offsets of CLOCK_MONOTONIC and CLOCK_BOOTTIME in the new time namespace, in ns.
    pub monotonic_offset_ns: u64,
    pub boottime_offset_ns: u64,
    /// A descriptor (number 3 or above) the init keeps open under the same number; its other
    /// descriptors are closed on exec (ours are all close-on-exec) and its stdin, stdout and
    /// stderr are /dev/null, so it holds no pipe of ours open.
    pub keep_fd: RawFd,
}

// What the children report through the status pipe: (kind, step, value).
const REPORT_PID: i32 = 1;
const REPORT_FAILED: i32 = 2;
const STEPS: [&str; 12] = [
    "",
    "unshare (the new namespaces)",
    "mount(/, MS_REC|MS_SLAVE)",
    "open /proc/self/timens_offsets",
    "write /proc/self/timens_offsets",
    "fork (init)",
    "mount proc on /proc (init)",
    "redirect stdio to /dev/null, close the rest (init)",
    "setsid (init)",
    "execv (init)",
    "mount a new devpts instance on /dev/pts (init)",
    "bind /dev/pts/ptmx on /dev/ptmx (init)",
];

/// The namespaces a guest lives in, besides the host's network and user namespaces: the
/// flags for `unshare` when they are made and for `setns` (with a pidfd) to join them. (Its
/// UTS namespace starts as a copy of the node's; a body's init names it after its home.)
pub const GUEST_NAMESPACES: i32 = libc::CLONE_NEWPID
    | CLONE_NEWTIME
    | libc::CLONE_NEWNS
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWUTS;

/// The namespaces of an emulated node (a local cluster's node other than the first): all of a
/// machine's that one kernel can give, but its clocks and its users.
pub const NODE_NAMESPACES: i32 = libc::CLONE_NEWPID
    | libc::CLONE_NEWNS
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWNET
    | libc::CLONE_NEWUTS;

/// Everything the children use, made before the fork: after it they only make raw system
/// calls on this memory.
struct Prepared {
    /// What `unshare` makes.
    flags: i32,
    exe: CString,
    /// Owns the strings `argv_ptrs` points into.
    _argv: Vec<CString>,
    argv_ptrs: Vec<*const libc::c_char>,
    offsets: Vec<u8>,
    status_w: RawFd,
    keep_fd: RawFd,
}

fn cstr(s: &[u8]) -> SysResult<CString> {
    CString::new(s).map_err(|_| SysError::new("path with a NUL byte", libc::EINVAL))
}

/// Starts the init of fresh PID, time and mount namespaces and returns its PID in our
/// namespace. The init is not our child: the intermediate process exits at once, so the init is
/// adopted by our nearest subreaper (or init), like a restored tree.
pub fn spawn_guest_init(spec: &GuestInitSpec) -> SysResult<i32> {
    let split = |ns: u64| (ns / 1_000_000_000, ns % 1_000_000_000);
    let (ms, mn) = split(spec.monotonic_offset_ns);
    let (bs, bn) = split(spec.boottime_offset_ns);
    let offsets = if spec.monotonic_offset_ns == 0 && spec.boottime_offset_ns == 0 {
        Vec::new()
    } else {
        format!(
            "{} {ms} {mn}\n{} {bs} {bn}\n",
            libc::CLOCK_MONOTONIC,
            libc::CLOCK_BOOTTIME
        )
        .into_bytes()
    };
    spawn_init(GUEST_NAMESPACES, offsets, spec.exe, spec.args, spec.keep_fd)
}

/// Starts the init of an emulated node: new PID, mount, IPC, network and UTS namespaces
/// ([`NODE_NAMESPACES`]), whose PID 1 (with a /proc and a devpts instance of its own, its stdio
/// on /dev/null, in a session of its own) execs `exe` with `args`, keeping `keep_fd` open
/// under its number. Returns the init's PID in our namespace; like a guest init, it is not our
/// child. The new mount namespace is a slave of ours: nothing mounted in it comes back.
pub fn spawn_node_init(exe: &std::path::Path, args: &[String], keep_fd: RawFd) -> SysResult<i32> {
    spawn_init(NODE_NAMESPACES, Vec::new(), exe, args, keep_fd)
}

fn spawn_init(
    flags: i32,
    offsets: Vec<u8>,
    exe: &std::path::Path,
    args: &[String],
    keep_fd: RawFd,
) -> SysResult<i32> {
    if keep_fd < 3 {
        return Err(SysError::new("init: kept descriptor below 3", libc::EINVAL));
    }
    let exe = cstr(exe.as_os_str().as_bytes())?;
    let mut argv = vec![exe.clone()];
    for a in args {
        argv.push(cstr(a.as_bytes())?);
    }
    let mut argv_ptrs: Vec<*const libc::c_char> = argv.iter().map(|a| a.as_ptr()).collect();
    argv_ptrs.push(std::ptr::null());
    let (status_r, status_w) = crate::fdops::pipe2(libc::O_CLOEXEC)?;
    let prep = Prepared {
        flags,
        exe,
        _argv: argv,
        argv_ptrs,
        offsets,
        status_w: status_w.as_raw_fd(),
        keep_fd,
    };
    // SAFETY: fork in a program that may have other threads: the child runs `intermediate`,
    // which only makes raw, async-signal-safe system calls on memory prepared above.
    let child = unsafe { libc::fork() };
    if child < 0 {
        return Err(SysError::last("fork (guest namespaces)"));
    }
    if child == 0 {
        // SAFETY: see above; `prep` lives on, unchanged, in the child's copy of this frame.
        unsafe { intermediate(&prep) };
    }
    drop(status_w);
    let mut status = 0;
    // SAFETY: status is a valid out-pointer; child is our child.
    let r = unsafe { libc::waitpid(child, &mut status, 0) };
    if r < 0 {
        return Err(SysError::last("waitpid (guest namespaces)"));
    }
    // Read every report until the pipe closes: at the init's exec, or its death.
    let mut bytes = Vec::new();
    let mut buf = [0u8; 256];
    loop {
        match crate::fdops::read_fd(status_r.as_raw_fd(), &mut buf) {
            Ok(0) => break,
            Ok(n) => bytes.extend_from_slice(&buf[..n]),
            Err(e) if e.errno == libc::EINTR => continue,
            Err(e) => return Err(e),
        }
    }
    let mut pid = None;
    for rec in bytes.chunks_exact(12) {
        let w = |i: usize| i32::from_ne_bytes(rec[i * 4..i * 4 + 4].try_into().expect("4 bytes"));
        match w(0) {
            REPORT_PID => pid = Some(w(2)),
            REPORT_FAILED => {
                let step = STEPS.get(w(1) as usize).copied().unwrap_or("init");
                return Err(SysError::new(step, w(2)));
            }
            _ => {}
        }
    }
    pid.ok_or_else(|| SysError::new("init: no report from the new namespaces", libc::EIO))
}

/// Writes one report to the status pipe (a 12-byte write is atomic on a pipe).
///
/// # Safety
/// Async-signal-safe; `fd` is the status pipe.
unsafe fn report(fd: RawFd, kind: i32, step: i32, value: i32) {
    let mut rec = [0u8; 12];
    rec[0..4].copy_from_slice(&kind.to_ne_bytes());
    rec[4..8].copy_from_slice(&step.to_ne_bytes());
    rec[8..12].copy_from_slice(&value.to_ne_bytes());
    // SAFETY: rec is a live 12-byte buffer.
    unsafe { libc::write(fd, rec.as_ptr().cast(), rec.len()) };
}

/// Reports the errno of a failed step and ends the child.
///
/// # Safety
/// Async-signal-safe; `fd` is the status pipe; errno is that of the failed call.
unsafe fn fail(fd: RawFd, step: i32) -> ! {
    let errno = std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO);
    // SAFETY: the caller's contract.
    unsafe {
        report(fd, REPORT_FAILED, step, errno);
        libc::_exit(127)
    }
}

/// The intermediate child: makes the namespaces, sets the clock offsets (if any), forks the
/// init.
///
/// # Safety
/// Runs in a freshly forked child of a possibly multi-threaded process: only raw system calls on
/// memory prepared before the fork.
unsafe fn intermediate(p: &Prepared) -> ! {
    let w = p.status_w;
    // SAFETY: for the whole block: raw system calls with constant C strings or buffers in `p`, which
    // outlive every call; this process ends in _exit without returning to Rust code.
    unsafe {
        if libc::unshare(p.flags) != 0 {
            fail(w, 1);
        }
        // Mounts made in the new mount namespace (its /proc) must not propagate back to ours.
        if libc::mount(
            std::ptr::null(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_SLAVE,
            std::ptr::null(),
        ) != 0
        {
            fail(w, 2);
        }
        if !p.offsets.is_empty() {
            let fd = libc::open(
                c"/proc/self/timens_offsets".as_ptr(),
                libc::O_WRONLY | libc::O_CLOEXEC,
            );
            if fd < 0 {
                fail(w, 3);
            }
            if libc::write(fd, p.offsets.as_ptr().cast(), p.offsets.len())
                != p.offsets.len() as isize
            {
                fail(w, 4);
            }
            libc::close(fd);
        }
        let init = libc::fork();
        if init < 0 {
            fail(w, 5);
        }
        if init == 0 {
            guest_init_child(p);
        }
        report(w, REPORT_PID, 0, init);
        libc::_exit(0)
    }
}

/// PID 1 of the new namespaces, before its exec.
///
/// # Safety
/// As [`intermediate`].
unsafe fn guest_init_child(p: &Prepared) -> ! {
    let w = p.status_w;
    // SAFETY: for the whole block: as in `intermediate`.
    unsafe {
        // A /proc of the new PID namespace, so that /proc/self and /proc/<getpid()> are right.
        if libc::mount(
            c"proc".as_ptr(),
            c"/proc".as_ptr(),
            c"proc".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            std::ptr::null(),
        ) != 0
        {
            fail(w, 6);
        }
        // Pseudo-terminals of its own, numbered from 0 (a moved tree gets its pty under the
        // number it had, whatever this machine's terminals use), reached as /dev/ptmx too.
        if libc::mount(
            c"devpts".as_ptr(),
            c"/dev/pts".as_ptr(),
            c"devpts".as_ptr(),
            libc::MS_NOSUID | libc::MS_NOEXEC,
            c"newinstance,ptmxmode=0666,mode=0620,gid=5".as_ptr().cast(),
        ) != 0
        {
            fail(w, 10);
        }
        if libc::mount(
            c"/dev/pts/ptmx".as_ptr(),
            c"/dev/ptmx".as_ptr(),
            std::ptr::null(),
            libc::MS_BIND,
            std::ptr::null(),
        ) != 0
        {
            fail(w, 11);
        }
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
        if null < 0 {
            fail(w, 7);
        }
        for fd in 0..3 {
            if null != fd && libc::dup2(null, fd) < 0 {
                fail(w, 7);
            }
        }
        if null > 2 {
            libc::close(null);
        }
        // Nothing else we hold reaches the init (a pipe whose reader waits for its end, say):
        // every other descriptor closes at the exec, the status pipe included.
        const CLOSE_RANGE_CLOEXEC: libc::c_uint = 4;
        if libc::syscall(
            libc::SYS_close_range,
            3 as libc::c_uint,
            libc::c_uint::MAX,
            CLOSE_RANGE_CLOEXEC,
        ) != 0
        {
            fail(w, 7);
        }
        if libc::fcntl(p.keep_fd, libc::F_SETFD, 0) < 0 {
            fail(w, 7);
        }
        // Out of our session and process group: a terminal's ^C must not reach it.
        if libc::setsid() < 0 {
            fail(w, 8);
        }
        let empty: u64 = 0;
        libc::syscall(
            libc::SYS_rt_sigprocmask,
            libc::SIG_SETMASK,
            &empty as *const u64,
            std::ptr::null_mut::<u64>(),
            8,
        );
        libc::execv(p.exe.as_ptr(), p.argv_ptrs.as_ptr());
        fail(w, 9);
    }
}

/// Moves `fd` to a number of at least `min` (close-on-exec), if it is below.
pub fn dup_at_least(fd: OwnedFd, min: RawFd) -> SysResult<OwnedFd> {
    if fd.as_raw_fd() >= min {
        return Ok(fd);
    }
    // SAFETY: plain integer arguments.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, min) };
    let n = check("fcntl(F_DUPFD_CLOEXEC)", r as libc::c_long)?;
    // SAFETY: the kernel just made this descriptor for us.
    Ok(unsafe { OwnedFd::from_raw_fd(n as RawFd) })
}

/// Takes ownership of a descriptor this process was started with (for example a pipe handed to
/// an exec'd helper). Fails with EBADF if `fd` is not open.
pub fn take_inherited_fd(fd: RawFd) -> SysResult<OwnedFd> {
    // SAFETY: F_GETFD only queries the descriptor.
    let r = unsafe { libc::fcntl(fd, libc::F_GETFD) };
    check("fcntl(F_GETFD)", r as libc::c_long)?;
    // SAFETY: the descriptor is open and was handed to this process at exec; the caller takes
    // it once, so nothing else in the process owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Waits for any child (blocking unless `nohang`): `Ok(None)` when there is nothing to reap
/// right now (WNOHANG) ; ECHILD when there are no children at all.
pub fn wait_any(nohang: bool) -> SysResult<Option<(i32, i32)>> {
    wait_any_with(if nohang { libc::WNOHANG } else { 0 })
}

/// Like [`wait_any`], also reporting children that stopped or continued (WUNTRACED,
/// WCONTINUED): their raw status says which.
pub fn wait_any_changes() -> SysResult<Option<(i32, i32)>> {
    wait_any_with(libc::WNOHANG | libc::WUNTRACED | libc::WCONTINUED)
}

fn wait_any_with(extra: i32) -> SysResult<Option<(i32, i32)>> {
    let mut status = 0;
    let flags = libc::__WALL | extra;
    loop {
        // SAFETY: status is a valid out-pointer.
        let r = unsafe { libc::waitpid(-1, &mut status, flags) };
        if r < 0 {
            let e = SysError::last("waitpid(-1)");
            if e.errno == libc::EINTR {
                continue;
            }
            return Err(e);
        }
        return Ok(if r == 0 { None } else { Some((r, status)) });
    }
}

/// This process's PID in its own PID namespace.
pub fn getpid() -> i32 {
    // SAFETY: getpid cannot fail.
    unsafe { libc::getpid() }
}

/// Blocks signal `sig` in the calling thread (so that a signalfd can collect it instead).
pub fn block_signal(sig: i32) -> SysResult<()> {
    let mask: u64 = 1 << (sig - 1);
    // SAFETY: mask is a valid 8-byte kernel sigset_t that outlives the call; no old set asked.
    let r = unsafe {
        libc::syscall(
            libc::SYS_rt_sigprocmask,
            libc::SIG_BLOCK,
            &mask as *const u64,
            std::ptr::null_mut::<u64>(),
            8,
        )
    };
    check("rt_sigprocmask(SIG_BLOCK)", r).map(drop)
}

/// poll(2) for input on `fds` for up to `timeout_ms`: which of them are readable or hung up.
pub fn poll_in(fds: &[RawFd], timeout_ms: i32) -> SysResult<Vec<bool>> {
    Ok(poll_events(fds, timeout_ms)?
        .into_iter()
        .map(|r| r != 0)
        .collect())
}

/// poll(2) for input on `fds` for up to `timeout_ms`: each one's `revents` (POLLIN, POLLHUP
/// ...; 0 when nothing happened to it).
pub fn poll_events(fds: &[RawFd], timeout_ms: i32) -> SysResult<Vec<i16>> {
    let mut p: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    // SAFETY: p is a live array of p.len() pollfd structures.
    let r = unsafe { libc::poll(p.as_mut_ptr(), p.len() as libc::nfds_t, timeout_ms) };
    if r < 0 {
        let e = SysError::last("poll");
        if e.errno != libc::EINTR {
            return Err(e);
        }
    }
    Ok(p.iter()
        .map(|x| if r > 0 { x.revents } else { 0 })
        .collect())
}

/// Runs `f` with this thread's new children made in the PID namespace of the process behind
/// `pidfd` (setns(CLONE_NEWPID) changes only where the caller's next children go), then puts
/// the thread's namespace for children back.
pub fn with_children_in_pid_ns_of<T>(pidfd: RawFd, f: impl FnOnce() -> T) -> SysResult<T> {
    let own = crate::fdops::open_path(
        "/proc/thread-self/ns/pid_for_children",
        libc::O_RDONLY | libc::O_CLOEXEC,
        0,
    )?;
    // SAFETY: plain integer arguments.
    let r = unsafe { libc::setns(pidfd, libc::CLONE_NEWPID) };
    check("setns(CLONE_NEWPID)", r as libc::c_long)?;
    let out = f();
    // SAFETY: plain integer arguments.
    let r = unsafe { libc::setns(own.as_raw_fd(), libc::CLONE_NEWPID) };
    check("setns(CLONE_NEWPID) back", r as libc::c_long)?;
    Ok(out)
}

/// This thread in the IPC namespace of another process until dropped (System V objects are
/// looked up, created and listed in /proc/sysvipc in the caller's IPC namespace; a guest has one
/// of its own). Entering the namespace the thread is already in does nothing.
pub struct IpcNamespaceVisit {
    /// The thread's own namespace, to go back to.
    own: Option<OwnedFd>,
}

impl IpcNamespaceVisit {
    pub fn enter(pid: i32) -> SysResult<IpcNamespaceVisit> {
        let flags = libc::O_RDONLY | libc::O_CLOEXEC;
        let own = crate::fdops::open_path("/proc/thread-self/ns/ipc", flags, 0)?;
        let theirs = crate::fdops::open_path(&format!("/proc/{pid}/ns/ipc"), flags, 0)?;
        let ino = |path: &str| {
            std::fs::metadata(path)
                .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
                .map_err(|e| SysError::new("stat an IPC namespace", e.raw_os_error().unwrap_or(0)))
        };
        if ino("/proc/thread-self/ns/ipc")? == ino(&format!("/proc/{pid}/ns/ipc"))? {
            return Ok(IpcNamespaceVisit { own: None });
        }
        // SAFETY: plain integer arguments.
        let r = unsafe { libc::setns(theirs.as_raw_fd(), libc::CLONE_NEWIPC) };
        check("setns(CLONE_NEWIPC)", r as libc::c_long)?;
        Ok(IpcNamespaceVisit { own: Some(own) })
    }
}

impl Drop for IpcNamespaceVisit {
    fn drop(&mut self) {
        if let Some(own) = &self.own {
            // SAFETY: plain integer arguments. (Going back to the namespace the thread came
            // from is not refused to a thread that could leave it: nothing to report.)
            unsafe { libc::setns(own.as_raw_fd(), libc::CLONE_NEWIPC) };
        }
    }
}

/// Sets the host name of the caller's UTS namespace.
pub fn sethostname(name: &str) -> SysResult<()> {
    // SAFETY: the pointer and length describe the bytes of `name`, which outlive the call.
    let r = unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) };
    check("sethostname", r as libc::c_long).map(drop)
}
