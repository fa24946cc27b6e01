//! Starting a program run for another node (the remote side of `ferry run`) in namespaces of
//! its own: a PID namespace whose PID 1 is a small init, an IPC namespace, and a mount
//! namespace (a copy of the guests' confined one, or of the node's) with a /proc of that PID
//! namespace and, when confined, an empty /tmp, /run and /dev/shm of its own.
//!
//! The daemon clones the init straight into the new PID and IPC namespaces (PID 1 there, the
//! daemon's child). The init, still a copy of the daemon and still root, enters the guests'
//! mount namespace, unshares a copy of it, puts its own mounts in, then clones the program's
//! process (PID 2), which goes through [`crate::spawn`]'s steps (session, stdio, credentials,
//! rlimits, cwd, exec as the user). The program is the init's child, so orphans of its tree
//! are reaped by the init; PID 1 ignores signals it has no handler for, which is why the
//! program is not PID 1 itself (a `ferry run` caller's SIGINT reaches the program as before).
//!
//! The init reports the program's wait status (4 bytes) on a pipe and reaps until no process
//! is left in its namespace, then exits (the namespace, its /proc and its tmpfs go with it).
//! It waits to reap anything until the daemon has read the program's PID (the daemon's view
//! of it, from the init's `children`), and for its first second it runs as the daemon's copy
//! it was born as; a program still running then gets the init exec'd afresh (`ferry
//! __run-init`), so that it does not keep the daemon's memory of that moment for long.
//!
//! Between the clone and execve only async-signal-safe system calls are made, on data prepared
//! before it (no allocation, no lock: the daemon has other threads); the clones are raw system
//! calls, so no C library fork handler runs in a copy of a multi-threaded process.

use crate::spawn::{child, errno, read_report, Spawn, SpawnError, Step};
use std::cell::Cell;
use std::ffi::CString;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// The hidden subcommand of the `ferry` binary that runs as a program's init once exec'd.
pub const RUN_INIT_COMMAND: &str = "__run-init";
/// How long the init runs as the daemon's copy before it is exec'd afresh.
const EXEC_AFTER_NS: i64 = 1_000_000_000;
/// The descriptor the exec'd init gets the status pipe on.
const STATUS_FD: RawFd = 3;

/// The program's own namespaces.
#[derive(Debug, Clone)]
pub struct OwnNamespaces<'a> {
    /// An empty /tmp, /run and /dev/shm of its own (a confined guest's); else it sees those
    /// of the mount namespace it starts from.
    pub private_tmp: bool,
    /// The `ferry` binary, exec'd as the init of a program that runs on.
    pub init_exe: &'a Path,
    /// A network namespace (an nsfs descriptor) the init enters first (a confined guest's,
    /// a loopback only); else the program uses its node's network.
    pub net_ns: Option<RawFd>,
}

/// Where to look for a PID free in both namespaces for the program's process, and the largest
/// PID there is. A PID found taken costs a failed clone, a whole copy of the address space, so
/// the search starts [`PID_AHEAD`] past the last PID used in ours (the next few are what every
/// other fork of the machine is about to take meanwhile) at one that is free now.
fn pid_hint() -> (i32, i32) {
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .ok()
            .and_then(|s| s.trim().parse::<i32>().ok())
    };
    let max = read("/proc/sys/kernel/pid_max").unwrap_or(32768);
    let mut pid = read("/proc/sys/kernel/ns_last_pid").unwrap_or(300) + PID_AHEAD;
    for _ in 0..SAME_PID_TRIES {
        if pid >= max {
            pid = 300;
        }
        if std::fs::symlink_metadata(format!("/proc/{pid}")).is_err() {
            break;
        }
        pid += 1;
    }
    (pid, max)
}

/// How far past the last PID used the program's is looked for.
const PID_AHEAD: i32 = 64;

/// A program started in namespaces of its own.
#[derive(Debug)]
pub struct Guest {
    /// The program, as this process sees it.
    pub pid: i32,
    /// Its init: our child, PID 1 of the program's PID namespace.
    pub init: i32,
    /// The init writes the program's wait status here (4 bytes, native order) when it ends;
    /// the pipe closes without it if the init is killed first.
    pub status: OwnedFd,
}

/// Starts `s` in namespaces of its own (see the module's text). On failure the error's `pid`
/// is the init, which ends by itself and must be reaped.
pub fn spawn_guest(s: &Spawn, ns: &OwnNamespaces) -> Result<Guest, SpawnError> {
    spawn_guest_from(s, ns, false)
}

/// [`spawn_guest`]; with `for_parent` (the spawner, [`crate::spawner`]) the init is made our
/// parent's child (`CLONE_PARENT`): its parent-death signal and its reaping are our parent's.
pub(crate) fn spawn_guest_from(
    s: &Spawn,
    ns: &OwnNamespaces,
    for_parent: bool,
) -> Result<Guest, SpawnError> {
    let (ours, theirs) = pipes()?;
    let init = start_init(
        s,
        ns,
        for_parent,
        [&theirs.err_w, &theirs.go_r, &theirs.status_w].map(|f| f.as_raw_fd()),
    )?;
    drop(theirs);
    finish(init, ours)
}

/// The init's ends of its three pipes: its error report, its go, its status word.
pub(crate) struct InitEnds {
    pub err_w: OwnedFd,
    pub go_r: OwnedFd,
    pub status_w: OwnedFd,
}

/// Ours: the error report read, the go given, the status word read.
pub(crate) struct OurEnds {
    pub err_r: OwnedFd,
    pub go_w: OwnedFd,
    pub status_r: OwnedFd,
}

/// The pipes between the init and whoever waits for the program's start and end.
pub(crate) fn pipes() -> Result<(OurEnds, InitEnds), SpawnError> {
    let pipe = || {
        crate::fdops::pipe2(libc::O_CLOEXEC).map_err(|e| SpawnError::before(Step::Fork, e.errno))
    };
    let (err_r, err_w) = pipe()?;
    let (go_r, go_w) = pipe()?;
    let (status_r, status_w) = pipe()?;
    Ok((
        OurEnds {
            err_r,
            go_w,
            status_r,
        },
        InitEnds {
            err_w,
            go_r,
            status_w,
        },
    ))
}

/// Clones the init (which makes the program's process) and returns its PID at once; the
/// init's pipe ends (`InitEnds`' error report, go and status word) are copied into it (the
/// caller then closes its own).
pub(crate) fn start_init(
    s: &Spawn,
    ns: &OwnNamespaces,
    for_parent: bool,
    [err_w, go_r, status_w]: [RawFd; 3],
) -> Result<i32, SpawnError> {
    let fail0 = SpawnError::before;
    let (argv, envp) = s.pointers();
    let groups: Vec<libc::gid_t> = s.groups.clone();
    let exe = crate::fdops::open_path(
        &ns.init_exe.to_string_lossy(),
        libc::O_PATH | libc::O_CLOEXEC,
        0,
    )
    .map_err(|e| fail0(Step::Namespaces, e.errno))?;
    let null = crate::fdops::open_path("/dev/null", libc::O_RDWR | libc::O_CLOEXEC, 0)
        .map_err(|e| fail0(Step::Namespaces, e.errno))?;
    let (first_pid, pid_max) = pid_hint();
    let words = [
        ns.init_exe.as_os_str().as_bytes(),
        RUN_INIT_COMMAND.as_bytes(),
        b"3",
        b"-1",
    ]
    .map(|a| CString::new(a).unwrap_or_default());
    // The program's PID is written in by the init, before it execs itself.
    let program_arg = Box::new(Cell::new([0u8; 16]));
    let with = |status: &CString| {
        vec![
            words[0].as_ptr(),
            words[1].as_ptr(),
            program_arg.as_ptr().cast::<libc::c_char>().cast_const(),
            status.as_ptr(),
            std::ptr::null(),
        ]
    };
    let init = Init {
        first_pid,
        pid_max,
        exe: exe.as_raw_fd(),
        argv_status: with(&words[2]),
        argv_no_status: with(&words[3]),
        program_arg: &program_arg,
        envp: [std::ptr::null()],
        null: null.as_raw_fd(),
    };
    let fds = Fds {
        err_w,
        go_r,
        status_w,
    };

    // SAFETY: a raw clone (no C library fork handlers) into new PID and IPC namespaces, with
    // no new stack: the child runs on its copy of ours, like fork. It only runs `init_child`,
    // which makes async-signal-safe calls on data prepared above and never returns.
    let pid = unsafe {
        crate::process::raw_clone(
            libc::CLONE_NEWPID
                | libc::CLONE_NEWIPC
                | if for_parent { libc::CLONE_PARENT } else { 0 },
        )
    };
    if pid < 0 {
        return Err(fail0(Step::Namespaces, errno()));
    }
    if pid == 0 {
        init_child(s, ns, &argv, &envp, &groups, &fds, &init);
    }
    Ok(pid)
}

/// Waits for the init started by [`start_init`] to report the program exec'd (or what failed),
/// learns the program's PID and lets the init reap. On failure the error's `pid` is the init.
pub(crate) fn finish(pid: i32, ours: OurEnds) -> Result<Guest, SpawnError> {
    let OurEnds {
        err_r,
        go_w,
        status_r,
    } = ours;
    if let Some(mut e) = read_report(err_r.as_raw_fd()) {
        e.pid = pid;
        return Err(e);
    }
    // The program is the init's only child until the init hears from us (`go_w`).
    let program = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .ok()
        .and_then(|c| c.split_whitespace().next()?.parse::<i32>().ok());
    drop(go_w);
    match program {
        Some(p) => Ok(Guest {
            pid: p,
            init: pid,
            status: status_r,
        }),
        None => {
            // Its namespace dies with its init.
            let _ = crate::ptrace::kill(pid, libc::SIGKILL);
            Err(SpawnError {
                step: Step::Namespaces,
                errno: libc::ESRCH,
                pid,
                candidate: None,
            })
        }
    }
}

/// The pipes' ends the init keeps.
struct Fds {
    err_w: RawFd,
    go_r: RawFd,
    status_w: RawFd,
}

/// Where the program's PID is looked for, and what the init needs to exec itself afresh.
struct Init<'a> {
    first_pid: i32,
    pid_max: i32,
    /// The program's PID as an argument of the exec'd init (NUL-terminated decimal).
    program_arg: &'a Cell<[u8; 16]>,
    exe: RawFd,
    argv_status: Vec<*const libc::c_char>,
    argv_no_status: Vec<*const libc::c_char>,
    envp: [*const libc::c_char; 1],
    null: RawFd,
}

const MOUNT_FLAGS: libc::c_ulong = libc::MS_NOSUID | libc::MS_NODEV;

/// The init between the clone and its loop. Never returns.
fn init_child(
    s: &Spawn,
    ns: &OwnNamespaces,
    argv: &[*const libc::c_char],
    envp: &[*const libc::c_char],
    groups: &[libc::gid_t],
    fds: &Fds,
    init: &Init,
) -> ! {
    let fail = |step: Step| -> ! {
        let mut msg = [0u8; 9];
        msg[0] = step.code();
        msg[1..5].copy_from_slice(&errno().to_ne_bytes());
        msg[5..9].copy_from_slice(&u32::MAX.to_ne_bytes());
        // SAFETY: write(2) and _exit(2) are async-signal-safe; msg is a local buffer.
        unsafe {
            libc::write(fds.err_w, msg.as_ptr().cast(), msg.len());
            libc::_exit(127)
        }
    };
    // SAFETY: plain integer arguments; a full signal set built in a local. No handler of the
    // daemon's may run in this copy of it: every signal is blocked, then every disposition
    // reset (the program's own are set by its steps).
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::sigprocmask(libc::SIG_SETMASK, &all, std::ptr::null_mut());
        for sig in 1..=64 {
            if sig != libc::SIGKILL && sig != libc::SIGSTOP {
                let mut act: libc::sigaction = std::mem::zeroed();
                act.sa_sigaction = libc::SIG_DFL;
                libc::sigaction(sig, &act, std::ptr::null_mut());
            }
        }
        libc::prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGKILL as libc::c_ulong,
            0,
            0,
            0,
        );
        libc::setsid();
    }
    // Nothing of the daemon's but what the init and the program need.
    let mut keep = [
        s.stdio[0],
        s.stdio[1],
        s.stdio[2],
        fds.err_w,
        fds.go_r,
        fds.status_w,
        init.exe,
        init.null,
        s.mount_ns.unwrap_or(init.null),
        s.user_ns.unwrap_or(init.null),
        ns.net_ns.unwrap_or(init.null),
    ];
    close_all_but(&mut keep);
    for fd in 0..3 {
        // SAFETY: dup2 of a descriptor we hold onto 0, 1 or 2 (the program's are its own).
        unsafe { libc::dup2(init.null, fd) };
    }
    if let Some(n) = ns.net_ns {
        // SAFETY: setns on a descriptor we hold; plain integer arguments.
        if unsafe { libc::setns(n, libc::CLONE_NEWNET) } < 0 {
            fail(Step::NetNs);
        }
    }
    if let Some(m) = s.mount_ns {
        // SAFETY: setns on a descriptor we hold; this process has its own fs_struct.
        if unsafe { libc::setns(m, libc::CLONE_NEWNS) } < 0 {
            fail(Step::MountNs);
        }
    }
    // A copy of that namespace, where nothing mounted goes back to it.
    // SAFETY: plain integer argument.
    if unsafe { libc::unshare(libc::CLONE_NEWNS) } < 0 {
        fail(Step::Namespaces);
    }
    // SAFETY: a NUL-terminated static string and null pointers.
    let r = unsafe {
        libc::mount(
            std::ptr::null(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_SLAVE,
            std::ptr::null(),
        )
    };
    if r < 0 {
        fail(Step::Namespaces);
    }
    // What it mounts covers what it would have seen. (Not unmounted first: a lazy unmount
    // waits for an RCU grace period, milliseconds on a busy machine, and a root program, which
    // holds every capability, could undo either; a user's cannot.)
    let fresh: [(
        &std::ffi::CStr,
        &std::ffi::CStr,
        &std::ffi::CStr,
        libc::c_ulong,
    ); 4] = [
        (c"/proc", c"proc", c"", MOUNT_FLAGS | libc::MS_NOEXEC),
        (c"/tmp", c"tmpfs", c"mode=1777", MOUNT_FLAGS),
        (c"/run", c"tmpfs", c"mode=755", MOUNT_FLAGS),
        (c"/dev/shm", c"tmpfs", c"mode=1777", MOUNT_FLAGS),
    ];
    let n = if ns.private_tmp { fresh.len() } else { 1 };
    for (dir, fstype, data, flags) in &fresh[..n] {
        // SAFETY: NUL-terminated static strings.
        let r = unsafe {
            libc::mount(
                fstype.as_ptr(),
                dir.as_ptr(),
                fstype.as_ptr(),
                *flags,
                if data.is_empty() {
                    std::ptr::null()
                } else {
                    data.as_ptr().cast()
                },
            )
        };
        if r < 0 {
            fail(Step::Namespaces);
        }
    }
    let program = fork_program(init.first_pid, init.pid_max);
    if program < 0 {
        fail(Step::Fork);
    }
    if program == 0 {
        // Its parent, the init, is PID 1 of its namespace.
        child(s, None, argv, envp, groups, 1, fds.err_w);
    }
    // SAFETY: closing descriptors we hold, which are the program's now.
    unsafe {
        for fd in s.stdio {
            libc::close(fd);
        }
        libc::close(fds.err_w);
    }
    wait_for_go(fds.go_r);
    reap(program, fds.status_w, Some(init))
}

/// Makes the program's process (returns 0 in it, like fork): under the same PID in its
/// namespace as in ours when one is free (clone3 `set_tid` for both namespaces, trying from
/// `first`), so that it is known by one number everywhere and keeps it when it moves (a tree
/// leaves its node only under the PIDs its node knows it by); else under any.
fn fork_program(first: i32, pid_max: i32) -> i32 {
    let mut pid = first.max(2);
    for _ in 0..SAME_PID_TRIES {
        if pid >= pid_max {
            pid = 300;
        }
        let tids = [pid as libc::pid_t, pid as libc::pid_t];
        let args = crate::clone3::CloneArgs {
            exit_signal: libc::SIGCHLD as u64,
            set_tid: tids.as_ptr() as u64,
            set_tid_size: 2,
            ..Default::default()
        };
        // SAFETY: clone3 with no new stack (the child runs on its copy of ours, like fork) of
        // this single-threaded process; args and tids are locals that outlive the call.
        let r = unsafe {
            libc::syscall(
                libc::SYS_clone3,
                &args as *const crate::clone3::CloneArgs,
                std::mem::size_of::<crate::clone3::CloneArgs>(),
            )
        } as i32;
        if r >= 0 {
            return r;
        }
        if errno() != libc::EEXIST {
            break;
        }
        pid += 1;
    }
    // SAFETY: a raw fork of this single-threaded process.
    unsafe { crate::process::raw_clone(0) }
}

/// How many PIDs the program's process is tried under, from the last one used here on.
const SAME_PID_TRIES: usize = 64;

/// Closes every descriptor but those in `keep` (sorted in place).
fn close_all_but(keep: &mut [RawFd]) {
    keep.sort_unstable();
    let mut from: u32 = 0;
    for &fd in keep.iter() {
        if fd < 0 {
            continue;
        }
        let fd = fd as u32;
        if fd > from {
            // SAFETY: plain integer arguments.
            unsafe { libc::syscall(libc::SYS_close_range, from, fd - 1, 0u32) };
        }
        from = from.max(fd + 1);
    }
    // SAFETY: plain integer arguments.
    unsafe { libc::syscall(libc::SYS_close_range, from, u32::MAX, 0u32) };
}

/// Blocks until the daemon closes its end (it has read the program's PID).
fn wait_for_go(go: RawFd) {
    let mut b = [0u8; 16];
    loop {
        // SAFETY: reading into a local buffer.
        let r = unsafe { libc::read(go, b.as_mut_ptr().cast(), b.len()) };
        if r == 0 || (r < 0 && errno() != libc::EINTR) {
            break;
        }
    }
    // SAFETY: closing a descriptor we hold.
    unsafe { libc::close(go) };
}

fn now_ns() -> i64 {
    // SAFETY: ts is a valid out-pointer.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: as above; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec * 1_000_000_000 + ts.tv_nsec
}

/// The init's loop: reaps every child (the program, and the orphans its namespace's processes
/// leave it), reports the program's status on `status_fd` (-1: already reported), and exits
/// once no child is left. With `exec`, execs the init afresh after [`EXEC_AFTER_NS`].
fn reap(program: i32, mut status_fd: RawFd, mut exec: Option<&Init>) -> ! {
    let deadline = now_ns() + EXEC_AFTER_NS;
    // SAFETY: a local set holding SIGCHLD (blocked since the init started, or inherited
    // blocked by an exec'd init).
    let chld = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGCHLD);
        libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    };
    loop {
        loop {
            let mut st = 0;
            // SAFETY: st is a valid out-pointer.
            let r = unsafe { libc::waitpid(-1, &mut st, libc::WNOHANG | libc::__WALL) };
            if r > 0 {
                if r == program && status_fd >= 0 {
                    // SAFETY: writing a local int to a pipe we hold, then closing it.
                    unsafe {
                        libc::write(status_fd, (&st as *const i32).cast(), 4);
                        libc::close(status_fd);
                    }
                    status_fd = -1;
                }
                continue;
            }
            if r == 0 {
                break;
            }
            if errno() == libc::EINTR {
                continue;
            }
            // ECHILD: nobody is left.
            // SAFETY: _exit is async-signal-safe.
            unsafe { libc::_exit(0) };
        }
        let left = deadline - now_ns();
        if let (Some(init), true) = (exec, left <= 0) {
            exec_afresh(init, program, status_fd);
            exec = None;
        }
        let wait = libc::timespec {
            tv_sec: left.max(0) / 1_000_000_000,
            tv_nsec: left.max(0) % 1_000_000_000,
        };
        // SAFETY: chld is a valid set; a null siginfo is allowed; wait is a valid timespec.
        unsafe {
            libc::sigtimedwait(
                &chld,
                std::ptr::null_mut(),
                if exec.is_some() {
                    &wait
                } else {
                    std::ptr::null()
                },
            )
        };
    }
}

/// Execs the init afresh (returns only if that failed: the copy then carries on).
fn exec_afresh(init: &Init, program: i32, status_fd: RawFd) {
    // The program's PID, in decimal, as the exec'd init's first argument.
    let mut digits = [0u8; 16];
    let (mut n, mut at) = (program.max(0), 15);
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    let mut arg = [0u8; 16];
    arg[..15 - at].copy_from_slice(&digits[at..15]);
    init.program_arg.set(arg);
    // SAFETY: descriptors we hold are moved above STATUS_FD, the status pipe put on it (not
    // close-on-exec), everything else marked close-on-exec; the argument vectors were built
    // before the clone (the program's PID written into its buffer just now).
    unsafe {
        let exe = libc::fcntl(init.exe, libc::F_DUPFD_CLOEXEC, 10);
        let argv = if status_fd >= 0 {
            let st = libc::fcntl(status_fd, libc::F_DUPFD_CLOEXEC, 10);
            if st < 0 || libc::dup2(st, STATUS_FD) < 0 {
                return;
            }
            init.argv_status.as_ptr()
        } else {
            init.argv_no_status.as_ptr()
        };
        if exe < 0 {
            return;
        }
        libc::syscall(
            libc::SYS_close_range,
            (STATUS_FD + 1) as u32,
            u32::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        );
        libc::syscall(
            libc::SYS_execveat,
            exe,
            c"".as_ptr(),
            argv,
            init.envp.as_ptr(),
            libc::AT_EMPTY_PATH,
        );
    }
}

/// `ferry __run-init PROGRAM STATUS_FD`: the init exec'd afresh (SIGCHLD still blocked, its
/// go long given). STATUS_FD is -1 once the program's status was reported.
pub fn run_init(program: i32, status_fd: RawFd) -> ! {
    reap(program, status_fd, None)
}
