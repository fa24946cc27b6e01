//! The home side of a moved tree: its originals, kept as deputies.
//!
//! [`Deputies::from_frozen`] takes a tree the engine froze and captured, once its copy runs
//! elsewhere (the commit point of a migration), and turns every process of it into a deputy:
//!
//! 1. its TCP connections are put in repair mode and its descriptors are closed (the body holds
//!    the rebuilt ones; a listener or a lock kept here would keep the body from taking it), but
//!    for its terminals, whose closing would hang up its session at home;
//! 2. its memory is unmapped, except the vDSO (whose `syscall` instruction runs the calls
//!    injected from here), one scratch page, and the pages holding its arguments and
//!    environment (so `ps` and `/proc/PID/cmdline` at home still show its command line);
//! 3. every thread is parked in `pause()` at that `syscall` instruction, with no signal
//!    blocked, under `PTRACE_SYSCALL`: it never runs a user instruction again. Each time the
//!    call returns (a signal interrupted it) the thread is pointed at it once more.
//!
//! From then on [`Deputies::poll`] reports the signals sent to a deputy (each suppressed here,
//! for the body to receive), and [`Deputies::mirror`] makes a deputy end, stop or continue as
//! its body did.
//! The threads carry `PTRACE_O_EXITKILL`: if the tracer dies, the deputies die with it (by
//! SIGKILL, which their parents see) rather than run on without memory.

use ferry_engine::freeze::{FrozenProc, FrozenTree};
use ferry_engine::procfs;
use ferry_inject::{find_syscall_insn, Injector, Site};
use ferry_sys::ptrace;
use ferry_sys::regs::GpRegs;
use ferry_sys::wait::{decode, WaitStatus};
use std::collections::{HashMap, HashSet};

const PAGE: u64 = 4096;

/// The signals whose default action stops a process.
const STOP_SIGNALS: [i32; 4] = [libc::SIGSTOP, libc::SIGTSTP, libc::SIGTTIN, libc::SIGTTOU];

/// The kernel's "restart this call" error, which a fork with a signal pending returns.
const ERESTARTNOINTR: i64 = 513;

/// si_code of tkill/tgkill: not one anybody may send on another's behalf.
const SI_TKILL: i32 = -6;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("deputy PID {pid}: {what}: {source}")]
    Inject {
        pid: i32,
        what: String,
        source: ferry_inject::InjectError,
    },
    #[error("deputy PID {pid}: {what}: {source}")]
    Sys {
        pid: i32,
        what: String,
        source: ferry_sys::SysError,
    },
    #[error("deputy PID {pid}: {source}")]
    Engine {
        pid: i32,
        source: ferry_engine::Error,
    },
    #[error("no deputy with PID {0}")]
    Unknown(i32),
    /// Nothing was done: the deputies go on as they were.
    #[error("{0}")]
    Refused(String),
}

pub type Result<T> = std::result::Result<T, Error>;

/// What happened to a deputy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Signal `sig` was sent to deputy `pid` at home (and held back there): its body's.
    /// `queued`: (si_code, si_pid, si_uid, si_value) of one sent with a negative si_code that
    /// may be given again (sigqueue and the like; not SI_TKILL).
    Signal {
        pid: i32,
        sig: i32,
        queued: Option<(i32, i32, u32, u64)>,
    },
    /// Deputy `pid` ended with wait status `status`: as its body did (`mirrored`), or killed at
    /// home (SIGKILL, which no tracer can hold back: the body must follow).
    Ended {
        pid: i32,
        status: i32,
        mirrored: bool,
    },
}

/// How a deputy was asked to end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    Exit,
    Signal(i32),
}

struct Deputy {
    pid: i32,
    syscall_at: u64,
    scratch: u64,
    /// Registers the threads are parked with (the leader's at the freeze, redirected).
    template: GpRegs,
    threads: Vec<i32>,
    ending: Option<Ending>,
    /// The stop signal being delivered to it, as its body stopped.
    stopping: Option<i32>,
    /// In group-stop as its body is (its parent at home has seen it stop).
    stopped: bool,
    /// A SIGCONT sent to it because its body continued: not news for the body.
    continuing: bool,
    /// Its parent at home (as it left, or the deputy it was forked from): when that is a
    /// deputy too, which never waits, its end is reaped by a `wait4` injected there.
    parent: i32,
}

/// The deputies of one moved tree, traced by this thread.
pub struct Deputies {
    /// The root of the tree (the first process).
    root: i32,
    procs: Vec<Deputy>,
    /// Per parked thread: whether it is between a system-call entry stop and its exit stop.
    in_call: HashMap<i32, bool>,
    /// Events seen while waiting for something else.
    queued: Vec<Event>,
    /// Deputies with children that ended since they were last reaped.
    to_reap: Vec<i32>,
}

fn inj_err(pid: i32, what: &str) -> impl FnOnce(ferry_inject::InjectError) -> Error + '_ {
    move |source| Error::Inject {
        pid,
        what: what.to_string(),
        source,
    }
}

fn sys_err(pid: i32, what: String) -> impl FnOnce(ferry_sys::SysError) -> Error {
    move |source| Error::Sys { pid, what, source }
}

/// Address ranges of `[start, end)` left once `keep` (sorted, page-aligned) is cut out.
fn cut(start: u64, end: u64, keep: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut at = start;
    for &(ks, ke) in keep {
        if ke <= at || ks >= end {
            continue;
        }
        if ks > at {
            out.push((at, ks));
        }
        at = at.max(ke);
    }
    if at < end {
        out.push((at, end));
    }
    out
}

impl Deputies {
    /// Turns every live process of `tree` into a deputy (see the module's documentation). On an
    /// error the processes already changed cannot run again: they are killed, as a committed
    /// migration's originals were before deputies existed. The TCP connections whose socket
    /// inodes are in `relayed` stay open and speaking: the home daemon relays them to the body.
    pub fn from_frozen(tree: FrozenTree, relayed: &HashSet<u64>) -> Result<Deputies> {
        let live: Vec<i32> = tree
            .procs
            .iter()
            .filter(|p| !p.zombie)
            .map(|p| p.pid)
            .collect();
        // Their TCP connections close silently: the body holds them now (but for those relayed
        // from here).
        ferry_engine::resources::sockets::silence_tcp_connections(&live, relayed);
        let procs = tree.into_procs();
        let mut deputies = Deputies {
            root: live.first().copied().unwrap_or(0),
            procs: Vec::new(),
            in_call: HashMap::new(),
            queued: Vec::new(),
            to_reap: Vec::new(),
        };
        let mut failed = None;
        for p in procs.iter().filter(|p| !p.zombie) {
            if failed.is_some() {
                let _ = ptrace::kill(p.pid, libc::SIGKILL);
                continue;
            }
            match Self::deputize(p) {
                Ok(d) => deputies.procs.push(d),
                Err(e) => {
                    let _ = ptrace::kill(p.pid, libc::SIGKILL);
                    failed = Some(e);
                }
            }
        }
        if let Some(e) = failed {
            deputies.kill_all();
            return Err(e);
        }
        let parked: Vec<(usize, i32)> = deputies
            .procs
            .iter()
            .enumerate()
            .flat_map(|(i, d)| d.threads.iter().map(move |&t| (i, t)))
            .collect();
        for (i, tid) in parked {
            let (pid, at, template) = {
                let d = &deputies.procs[i];
                (d.pid, d.syscall_at, d.template)
            };
            deputies.park(pid, tid, at, &template)?;
        }
        Ok(deputies)
    }

    fn deputize(p: &FrozenProc) -> Result<Deputy> {
        let pid = p.pid;
        let leader = p
            .threads
            .iter()
            .find(|t| t.tid == pid)
            .or_else(|| p.threads.first())
            .ok_or(Error::Unknown(pid))?;
        let syscall_at = find_syscall_insn(pid).map_err(inj_err(pid, "find a syscall"))?;
        let stat = procfs::stat(pid).map_err(|source| Error::Engine { pid, source })?;
        let maps = procfs::smaps(pid).map_err(|source| Error::Engine { pid, source })?;
        let mut inj = Injector::new(
            pid,
            leader.tid,
            leader.regs,
            Site {
                syscall_at,
                scratch: 0,
                scratch_len: 0,
            },
        )
        .map_err(inj_err(pid, "prepare"))?;
        // The kernel writes each thread's rseq area (in memory about to go) whenever the thread
        // returns to user space: unregistered first, or the first return is a SIGSEGV.
        for t in &p.threads {
            let (addr, len, sig) = ptrace::get_rseq(t.tid)
                .map_err(sys_err(pid, format!("read rseq of thread {}", t.tid)))?;
            if addr == 0 {
                continue;
            }
            let tinj = Injector::new(
                pid,
                t.tid,
                t.regs,
                Site {
                    syscall_at,
                    scratch: 0,
                    scratch_len: 0,
                },
            )
            .map_err(inj_err(pid, "prepare"))?;
            tinj.syscall("rseq", 334, &[addr, len as u64, 1, sig as u64])
                .map_err(inj_err(pid, "unregister rseq"))?;
            tinj.finish().map_err(inj_err(pid, "finish"))?;
        }
        // Its descriptors go (the body has its own copies of them now: a listener, a lock or a
        // connection kept here would keep the body from taking it), but for its terminals:
        // closing a controlling terminal would hang up its session at home.
        for fd in procfs::fds(pid).unwrap_or_default() {
            let link = procfs::readlink(pid, &format!("fd/{fd}")).unwrap_or_default();
            if link.starts_with("/dev/pts/") || link == "/dev/ptmx" || link.starts_with("/dev/tty")
            {
                continue;
            }
            inj.syscall("close", libc::SYS_close, &[fd as u64])
                .map_err(inj_err(pid, "close its descriptors"))?;
        }
        let scratch = inj
            .syscall(
                "mmap",
                libc::SYS_mmap,
                &[
                    0,
                    PAGE,
                    (libc::PROT_READ | libc::PROT_WRITE) as u64,
                    (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS) as u64,
                    u64::MAX,
                    0,
                ],
            )
            .map_err(inj_err(pid, "map a scratch page"))?;
        inj.set_site(Site {
            syscall_at,
            scratch,
            scratch_len: PAGE,
        });
        // Its timers would fire here as well as in the body, which has them: disarmed.
        let zeros = inj
            .write_scratch(0, &[0u8; 64])
            .map_err(inj_err(pid, "write scratch"))?;
        for which in 0..3u64 {
            inj.syscall("setitimer", libc::SYS_setitimer, &[which, zeros, 0])
                .map_err(inj_err(pid, "disarm an interval timer"))?;
        }
        let timers = procfs::read(pid, "timers").unwrap_or_default();
        for id in timers
            .lines()
            .filter_map(|l| l.strip_prefix("ID:")?.trim().parse::<u64>().ok())
        {
            inj.syscall("timer_delete", libc::SYS_timer_delete, &[id])
                .map_err(inj_err(pid, "delete a POSIX timer"))?;
        }
        // Signals pending now were captured: the body has them. Taken here, so that they are
        // not forwarded to it a second time.
        for t in &p.threads {
            let mut tinj = Injector::new(
                pid,
                t.tid,
                t.regs,
                Site {
                    syscall_at,
                    scratch,
                    scratch_len: PAGE,
                },
            )
            .map_err(inj_err(pid, "prepare"))?;
            let set = tinj
                .write_scratch(128, &u64::MAX.to_ne_bytes())
                .map_err(inj_err(pid, "write scratch"))?;
            for _ in 0..1024 {
                let r = tinj
                    .syscall_raw(
                        "rt_sigtimedwait",
                        libc::SYS_rt_sigtimedwait,
                        &[set, 0, zeros, 8],
                    )
                    .map_err(inj_err(pid, "take a pending signal"))?;
                if r <= 0 {
                    break;
                }
            }
            tinj.set_site(Site {
                syscall_at,
                scratch,
                scratch_len: PAGE,
            });
            tinj.finish().map_err(inj_err(pid, "finish"))?;
        }
        let down = |a: u64| a & !(PAGE - 1);
        let up = |a: u64| (a + PAGE - 1) & !(PAGE - 1);
        let mut keep = vec![
            (scratch, scratch + PAGE),
            (down(syscall_at), up(syscall_at + 2)),
        ];
        if stat.arg_start != 0 && stat.env_end > stat.arg_start {
            keep.push((down(stat.arg_start), up(stat.env_end)));
        }
        for m in &maps {
            if matches!(
                m.name.as_str(),
                "[vdso]" | "[vvar]" | "[vvar_vclock]" | "[vsyscall]"
            ) {
                keep.push((m.start, m.end));
            }
        }
        keep.sort_unstable();
        for m in &maps {
            for (s, e) in cut(m.start, m.end, &keep) {
                inj.syscall("munmap", libc::SYS_munmap, &[s, e - s])
                    .map_err(inj_err(pid, "give its memory back"))?;
            }
        }
        inj.finish().map_err(inj_err(pid, "finish"))?;
        let options =
            FrozenTree::OPTIONS | ptrace::PTRACE_O_TRACESYSGOOD | ptrace::PTRACE_O_EXITKILL;
        for t in &p.threads {
            ptrace::set_options(t.tid, options).map_err(sys_err(
                pid,
                format!("set ptrace options of thread {}", t.tid),
            ))?;
        }
        Ok(Deputy {
            pid,
            syscall_at,
            scratch,
            template: leader.regs,
            threads: p.threads.iter().map(|t| t.tid).collect(),
            ending: None,
            stopping: None,
            stopped: false,
            continuing: false,
            parent: stat.ppid,
        })
    }

    /// Points thread `tid` at `pause()` and lets it go into it.
    fn park(&mut self, pid: i32, tid: i32, syscall_at: u64, template: &GpRegs) -> Result<()> {
        let mut r = *template;
        r.rip = syscall_at;
        r.rax = libc::SYS_pause as u64;
        r.orig_rax = u64::MAX;
        ptrace::set_regs(tid, &r).map_err(sys_err(pid, format!("park thread {tid}")))?;
        ptrace::set_sigmask(tid, 0)
            .map_err(sys_err(pid, format!("unblock signals of thread {tid}")))?;
        self.in_call.insert(tid, false);
        ptrace::syscall(tid, 0).map_err(sys_err(pid, format!("park thread {tid}")))
    }

    /// The PIDs of the deputies still there.
    pub fn pids(&self) -> Vec<i32> {
        self.procs.iter().map(|d| d.pid).collect()
    }

    /// The PID of the tree's root (its first deputy).
    pub fn root(&self) -> i32 {
        self.root
    }

    pub fn is_empty(&self) -> bool {
        self.procs.is_empty()
    }

    fn owner(&self, tid: i32) -> Option<usize> {
        self.procs.iter().position(|d| d.threads.contains(&tid))
    }

    /// Handles every stop and death waiting to be collected, without blocking, and returns
    /// what happened (with whatever was seen earlier).
    pub fn poll(&mut self) -> Vec<Event> {
        while let Some((tid, status)) = ferry_sys::wait::reap_any() {
            self.handle(tid, status);
        }
        // A deputy whose child (a deputy too) ended reaps it: it never waits by itself, and
        // its body's parent has reaped the body's child over there (or will: the body has its
        // own zombie).
        for parent in std::mem::take(&mut self.to_reap) {
            let Some(i) = self.procs.iter().position(|d| d.pid == parent) else {
                continue;
            };
            let d = &self.procs[i];
            if d.ending.is_some() || d.stopped || d.stopping.is_some() {
                continue;
            }
            let (at, template) = (d.syscall_at, d.template);
            let reaped = self.interrupt(i).and_then(|live| {
                if !live {
                    return Ok(());
                }
                let i = self
                    .procs
                    .iter()
                    .position(|d| d.pid == parent)
                    .ok_or(Error::Unknown(parent))?;
                let r = self.reap_children(i);
                self.park(parent, parent, at, &template)?;
                r
            });
            if let Err(e) = reaped {
                log::warn!("deputy PID {parent}: reap its ended children: {e}");
            }
        }
        while let Some((tid, status)) = ferry_sys::wait::reap_any() {
            self.handle(tid, status);
        }
        std::mem::take(&mut self.queued)
    }

    /// Body `parent` is forking: its deputy forks a deputy for the child (an injected
    /// `clone(CLONE_PTRACE | SIGCHLD)`, so the child is traced by us from its first
    /// instruction and stops before it runs one), which is parked as the others are. Returns
    /// the child's PID, the one the body's child is to have. Nothing is changed if it fails.
    pub fn fork(&mut self, parent: i32) -> Result<i32> {
        let i = self
            .procs
            .iter()
            .position(|d| d.pid == parent)
            .ok_or(Error::Unknown(parent))?;
        {
            let d = &self.procs[i];
            if d.ending.is_some() || d.stopped || d.stopping.is_some() {
                return Err(Error::Refused(format!(
                    "deputy {parent} is stopped, stopping or ending with its body: no child \
                     forked from it"
                )));
            }
        }
        let (at, scratch, template) = {
            let d = &self.procs[i];
            (d.syscall_at, d.scratch, d.template)
        };
        if !self.interrupt(i)? {
            return Err(Error::Refused(format!("deputy {parent} ended")));
        }
        let i = self
            .procs
            .iter()
            .position(|d| d.pid == parent)
            .ok_or(Error::Unknown(parent))?;
        // A signal pending and not blocked makes the kernel give up a fork half way
        // (ERESTARTNOINTR), and one comes often: SIGCHLD from the deputy of a child that just
        // ended. Blocked meanwhile; the parking unblocks them again (and the signal is held
        // back as usual).
        let made = ptrace::set_sigmask(parent, u64::MAX)
            .map_err(sys_err(parent, "block its signals to fork".into()))
            .and_then(|()| self.injector(i))
            .and_then(|(pid, inj)| {
                let flags = (libc::CLONE_PTRACE | libc::SIGCHLD) as u64;
                let mut r = 0;
                for _ in 0..3 {
                    r = inj
                        .syscall_raw("clone", libc::SYS_clone, &[flags, 0, 0, 0, 0])
                        .map_err(inj_err(pid, "fork a deputy"))?;
                    if r != -ERESTARTNOINTR && r != -(libc::EINTR as i64) {
                        break;
                    }
                }
                inj.finish().map_err(inj_err(pid, "finish"))?;
                Ok(r)
            });
        let parked = self.park(parent, parent, at, &template);
        let child = made?;
        parked?;
        if child <= 0 {
            return Err(Error::Refused(format!(
                "deputy {parent}: fork: {}",
                std::io::Error::from_raw_os_error(-child as i32)
            )));
        }
        // The kernel answered in the deputy's PID namespace (a program run for another node
        // has one of its own): the child as we number it.
        let child = ours(parent, child as i32);
        // Traced from its creation (CLONE_PTRACE, by a tracer that seized its parent): it stops
        // before its first instruction.
        loop {
            let status = ferry_sys::wait::wait_raw(child)
                .map_err(sys_err(child, "wait for the forked deputy to stop".into()))?;
            match decode(status) {
                WaitStatus::Stopped {
                    event: ptrace::PTRACE_EVENT_STOP,
                    ..
                } => break,
                WaitStatus::Exited(_) | WaitStatus::Signaled(_) => {
                    self.to_reap.push(parent);
                    return Err(Error::Refused(format!(
                        "the deputy forked from {parent} (PID {child}) ended at once"
                    )));
                }
                _ => {
                    let _ = ptrace::cont(child, 0);
                }
            }
        }
        let options =
            FrozenTree::OPTIONS | ptrace::PTRACE_O_TRACESYSGOOD | ptrace::PTRACE_O_EXITKILL;
        let set = ptrace::set_options(child, options)
            .map_err(sys_err(child, "set ptrace options".into()));
        self.procs.push(Deputy {
            pid: child,
            syscall_at: at,
            scratch,
            template,
            threads: vec![child],
            ending: None,
            stopping: None,
            stopped: false,
            continuing: false,
            parent,
        });
        let parked = set.and_then(|()| self.park(child, child, at, &template));
        if let Err(e) = parked {
            let _ = ptrace::kill(child, libc::SIGKILL);
            if let Some(d) = self.procs.iter_mut().find(|d| d.pid == child) {
                d.ending = Some(Ending::Signal(libc::SIGKILL));
            }
            return Err(e);
        }
        Ok(child)
    }

    /// Body `pid` made a call only its home can answer (one of [`HOME_CALLS`]: a signal to a
    /// process at home, or a change of its group or session): its deputy makes it here, injected, with `args` (six at most) and, for
    /// a call that takes a siginfo, `data` (its bytes, from the body) in the deputy's scratch
    /// page, its pointer argument pointing there. The kernel checks the deputy's credentials,
    /// the process's own at home, as it would have had it never left, and the signal's sender
    /// is its PID here. `uids` are the caller's (real, effective, saved) in the body: a body
    /// whose uids are no longer its deputy's is refused (`Refused`), rather than send with
    /// rights it no longer has. Returns what the call returned (a value or -errno). A signal
    /// the deputy sends itself (its own process group's) is held back and forwarded to the body
    /// as any other.
    pub fn call(
        &mut self,
        pid: i32,
        nr: i64,
        args: &[u64],
        data: &[u8],
        uids: [u32; 3],
    ) -> Result<i64> {
        let &(_, name, info_arg) = HOME_CALLS
            .iter()
            .find(|(n, _, _)| *n == nr)
            .ok_or_else(|| Error::Refused(format!("system call {nr} is not one made at home")))?;
        if args.len() > 6 || data.len() > 128 || info_arg.is_some_and(|k| k >= args.len()) {
            return Err(Error::Refused(format!(
                "{name}: {} arguments and {} bytes of data",
                args.len(),
                data.len()
            )));
        }
        let i = self
            .procs
            .iter()
            .position(|d| d.pid == pid)
            .ok_or(Error::Unknown(pid))?;
        {
            let d = &self.procs[i];
            if d.ending.is_some() || d.stopped || d.stopping.is_some() {
                return Err(Error::Refused(format!(
                    "deputy {pid} is stopped, stopping or ending with its body: no {name} from it"
                )));
            }
        }
        let theirs = uids_of(pid).ok_or(Error::Unknown(pid))?;
        if theirs != uids {
            return Err(Error::Refused(format!(
                "the body of PID {pid} has uids {uids:?} (real, effective, saved), its deputy \
                 {theirs:?}: a credential change in a body is not followed at home, so its \
                 {name} is not made there"
            )));
        }
        let (at, template) = {
            let d = &self.procs[i];
            (d.syscall_at, d.template)
        };
        if !self.interrupt(i)? {
            return Err(Error::Refused(format!("deputy {pid} ended")));
        }
        let i = self
            .procs
            .iter()
            .position(|d| d.pid == pid)
            .ok_or(Error::Unknown(pid))?;
        // Its signals blocked meanwhile (one it sends itself waits, pending, for the parking,
        // which unblocks them: then it is held back and forwarded as usual).
        let made = ptrace::set_sigmask(pid, u64::MAX)
            .map_err(sys_err(pid, format!("block its signals for {name}")))
            .and_then(|()| self.injector(i))
            .and_then(|(pid, inj)| {
                let mut a = [0u64; 6];
                a[..args.len()].copy_from_slice(args);
                if let Some(k) = info_arg {
                    let mut info = [0u8; 128];
                    info[..data.len()].copy_from_slice(data);
                    a[k] = inj
                        .write_scratch(0, &info)
                        .map_err(inj_err(pid, "write a siginfo"))?;
                }
                let r = inj
                    .syscall_raw(name, nr, &a[..])
                    .map_err(inj_err(pid, name))?;
                inj.finish().map_err(inj_err(pid, "finish"))?;
                Ok(r)
            });
        let parked = self.park(pid, pid, at, &template);
        let r = made?;
        parked?;
        Ok(r)
    }

    fn handle(&mut self, tid: i32, status: i32) {
        let Some(i) = self.owner(tid) else {
            return;
        };
        let pid = self.procs[i].pid;
        let ending = self.procs[i].ending;
        match decode(status) {
            WaitStatus::Exited(_) | WaitStatus::Signaled(_) => {
                self.in_call.remove(&tid);
                let d = &mut self.procs[i];
                d.threads.retain(|&t| t != tid);
                if tid == pid {
                    let gone = self.procs.remove(i);
                    if self.procs.iter().any(|d| d.pid == gone.parent) {
                        self.to_reap.push(gone.parent);
                    }
                    self.queued.push(Event::Ended {
                        pid,
                        status,
                        mirrored: ending.is_some(),
                    });
                    if pid == self.root {
                        // The tree's root is over: its other deputies, whose bodies ended
                        // unseen (reaped by their parents over there), or will end with it,
                        // have nobody at home to wait for them.
                        for d in &mut self.procs {
                            d.ending = Some(Ending::Signal(libc::SIGKILL));
                            let _ = ptrace::kill(d.pid, libc::SIGKILL);
                        }
                    }
                }
            }
            WaitStatus::Stopped { sig, event: 0 } if sig == libc::SIGTRAP | 0x80 => {
                let entering = !self.in_call.get(&tid).copied().unwrap_or(false);
                if entering {
                    self.in_call.insert(tid, true);
                    if let Err(e) = ptrace::syscall(tid, 0) {
                        log::warn!("deputy PID {pid}: resume thread {tid}: {e}");
                    }
                } else {
                    // The pause returned (a signal interrupted it): into it again.
                    let (at, template) = (self.procs[i].syscall_at, self.procs[i].template);
                    if let Err(e) = self.park(pid, tid, at, &template) {
                        log::warn!("{e}");
                    }
                }
            }
            WaitStatus::Stopped { sig, event: 0 } => {
                // A signal about to be delivered.
                if ending == Some(Ending::Signal(sig)) || self.procs[i].stopping == Some(sig) {
                    if let Err(e) = ptrace::cont(tid, sig) {
                        log::warn!("deputy PID {pid}: deliver signal {sig}: {e}");
                    }
                    return;
                }
                if sig == libc::SIGCONT && self.procs[i].continuing {
                    // Sent here because the body continued: the body knows.
                    self.procs[i].continuing = false;
                    if let Err(e) = ptrace::syscall(tid, 0) {
                        log::warn!("deputy PID {pid}: hold back SIGCONT: {e}");
                    }
                    return;
                }
                let info = ptrace::get_siginfo(tid).unwrap_or([0u8; 128]);
                let code = i32::from_ne_bytes([info[8], info[9], info[10], info[11]]);
                // The deputy's own children ending (deputies too) are no news for the body,
                // which has children of its own.
                let forward = !(sig == libc::SIGCHLD && code > 0);
                if forward && ending.is_none() {
                    // struct siginfo on x86_64: si_code at 8; si_pid, si_uid, si_value at 16.
                    let word = |at: usize| {
                        u32::from_ne_bytes([info[at], info[at + 1], info[at + 2], info[at + 3]])
                    };
                    let queued = (code < 0 && code != SI_TKILL).then(|| {
                        let value = u64::from_ne_bytes(info[24..32].try_into().unwrap_or([0; 8]));
                        (code, word(16) as i32, word(20), value)
                    });
                    self.queued.push(Event::Signal { pid, sig, queued });
                }
                if let Err(e) = ptrace::syscall(tid, 0) {
                    log::warn!("deputy PID {pid}: hold back signal {sig}: {e}");
                }
            }
            WaitStatus::Stopped {
                sig,
                event: ptrace::PTRACE_EVENT_STOP,
            } if STOP_SIGNALS.contains(&sig) && self.procs[i].stopping.is_some() => {
                // In group-stop, as its body: its parent at home has been told. It waits
                // there for a SIGCONT (PTRACE_LISTEN), which we hear of.
                self.procs[i].stopped = true;
                if let Err(e) = ptrace::listen(tid) {
                    log::warn!("deputy PID {pid}: hold thread {tid} stopped: {e}");
                }
            }
            WaitStatus::Stopped { .. } => {
                // An interrupt, or the end of a group-stop (SIGCONT): on with the parking.
                if self.procs[i].stopped {
                    self.procs[i].stopped = false;
                    self.procs[i].stopping = None;
                }
                if let Err(e) = ptrace::syscall(tid, 0) {
                    log::warn!("deputy PID {pid}: resume thread {tid}: {e}");
                }
            }
            WaitStatus::Nothing => {}
        }
    }

    /// Stops the leader of deputy `i` at an interrupt stop, handling whatever comes first. Under
    /// PTRACE_SYSCALL an interrupted `pause` reports its syscall-exit stop; a signal may have
    /// caused that stop before our interrupt, which then stays pending (and a call injected
    /// there would stop in it): from an exit stop the thread is interrupted again and let on to
    /// its interrupt stop. Returns false if the deputy ended meanwhile.
    fn interrupt(&mut self, i: usize) -> Result<bool> {
        let pid = self.procs[i].pid;
        self.stop_thread(pid, pid)
    }

    /// [`Deputies::interrupt`] for thread `tid` of deputy `pid`: false if it ended meanwhile.
    fn stop_thread(&mut self, pid: i32, tid: i32) -> Result<bool> {
        ptrace::interrupt(tid).map_err(sys_err(pid, format!("interrupt thread {tid}")))?;
        loop {
            let status = match ferry_sys::wait::wait_raw(tid) {
                Ok(s) => s,
                Err(e) => return Err(sys_err(pid, format!("wait for thread {tid}"))(e)),
            };
            match decode(status) {
                WaitStatus::Stopped {
                    event: ptrace::PTRACE_EVENT_STOP,
                    ..
                } => return Ok(true),
                WaitStatus::Stopped { sig, event: 0 }
                    if sig == libc::SIGTRAP | 0x80
                        && self.in_call.get(&tid).copied().unwrap_or(false) =>
                {
                    // Our interrupt's exit stop, or one a signal caused first, our interrupt
                    // then still pending (a call injected from here would stop in it, and
                    // fail). Interrupted again (one trap either way) and let on to that
                    // interrupt stop, which comes before any user instruction.
                    self.in_call.insert(tid, false);
                    ptrace::interrupt(tid)
                        .and_then(|()| ptrace::cont(tid, 0))
                        .map_err(sys_err(pid, format!("bring thread {tid} to its interrupt")))?;
                    continue;
                }
                _ => {}
            }
            self.handle(tid, status);
            if self.owner(tid).is_none() {
                return Ok(false);
            }
        }
    }

    /// The tree is coming home (its body is frozen on its way back): every deputy is let go
    /// for the restore to rebuild the process in its place (`ferry_engine::husk::Husk::adopt`).
    /// Its threads but the main one exit (the body's threads are made again with their
    /// numbers; a thread's end is no news for the parent), and the main thread is parked in
    /// `pause()` with every signal blocked (a signal sent meanwhile waits, pending, for the
    /// rebuilt process) and detached. Returns the PIDs let go; those whose deputy ended
    /// meanwhile are not among them (their end was reported as usual). On an error, the
    /// deputies still held are killed (their parents see SIGKILL), as the home gives up.
    pub fn release(&mut self) -> Result<Vec<i32>> {
        if let Some(d) = self
            .procs
            .iter()
            .find(|d| d.stopped || d.stopping.is_some() || d.ending.is_some())
        {
            return Err(Error::Refused(format!(
                "deputy {} is stopping, stopped or ending with its body",
                d.pid
            )));
        }
        let r = self.release_all();
        if r.is_err() {
            self.kill_all();
        }
        r
    }

    fn release_all(&mut self) -> Result<Vec<i32>> {
        let mut released = Vec::new();
        while let Some(d) = self.procs.first() {
            let (pid, at, template) = (d.pid, d.syscall_at, d.template);
            let others: Vec<i32> = d.threads.iter().copied().filter(|&t| t != pid).collect();
            for tid in others {
                if !self.stop_thread(pid, tid)? {
                    continue;
                }
                let mut r = template;
                r.rip = at;
                r.rax = libc::SYS_exit as u64;
                r.rdi = 0;
                r.orig_rax = u64::MAX;
                ptrace::set_regs(tid, &r)
                    .map_err(sys_err(pid, format!("let thread {tid} exit")))?;
                ptrace::set_sigmask(tid, u64::MAX)
                    .map_err(sys_err(pid, format!("block signals of thread {tid}")))?;
                ptrace::cont(tid, 0).map_err(sys_err(pid, format!("let thread {tid} exit")))?;
                loop {
                    let status = ferry_sys::wait::wait_raw(tid)
                        .map_err(sys_err(pid, format!("wait for thread {tid} to exit")))?;
                    match decode(status) {
                        WaitStatus::Exited(_) | WaitStatus::Signaled(_) => break,
                        _ => {
                            let _ = ptrace::cont(tid, 0);
                        }
                    }
                }
                self.in_call.remove(&tid);
                if let Some(d) = self.procs.iter_mut().find(|d| d.pid == pid) {
                    d.threads.retain(|&t| t != tid);
                }
            }
            let Some(i) = self.procs.iter().position(|d| d.pid == pid) else {
                continue;
            };
            if !self.interrupt(i)? {
                continue;
            }
            // Its children that ended (deputies that mirrored their bodies, or zombies left
            // at home when it left) are reaped: the image has those the body has not reaped,
            // and the restore makes them again.
            self.reap_children(i)?;
            let mut r = template;
            r.rip = at;
            r.rax = libc::SYS_pause as u64;
            r.orig_rax = u64::MAX;
            ptrace::set_regs(pid, &r).map_err(sys_err(pid, "park it to be let go".into()))?;
            ptrace::set_sigmask(pid, u64::MAX).map_err(sys_err(pid, "block its signals".into()))?;
            ptrace::detach(pid, 0).map_err(sys_err(pid, "let it go".into()))?;
            self.in_call.remove(&pid);
            self.procs.retain(|d| d.pid != pid);
            released.push(pid);
        }
        Ok(released)
    }

    /// Makes deputy `pid` do what its body did: `status` is the body's raw wait status (an exit
    /// code, the signal that killed it, a stop, or a continue). Its parent at home sees the same.
    pub fn mirror(&mut self, pid: i32, status: i32) -> Result<()> {
        let i = self
            .procs
            .iter()
            .position(|d| d.pid == pid)
            .ok_or(Error::Unknown(pid))?;
        if status == 0xffff {
            // Continued: a stopped deputy is woken (its parent is told), and the SIGCONT that
            // wakes it is not sent back to the body.
            let d = &mut self.procs[i];
            if d.stopped || d.stopping.is_some() {
                d.continuing = true;
                ptrace::kill(pid, libc::SIGCONT).map_err(sys_err(pid, "continue".into()))?;
            }
            return Ok(());
        }
        if status & 0xff == 0x7f {
            let sig = (status >> 8) & 0xff;
            if self.procs[i].stopped || self.procs[i].stopping.is_some() {
                return Ok(());
            }
            if !self.interrupt(i)? {
                return Ok(());
            }
            // The kernel discards SIGTSTP, SIGTTIN and SIGTTOU sent to an orphaned process
            // group: the deputy of a body stopped by one (delivered as SIGSTOP over there, where
            // its group is always orphaned) stops by SIGSTOP then.
            let sig = if sig != libc::SIGSTOP && pgrp_orphaned(pid) {
                libc::SIGSTOP
            } else {
                sig
            };
            if sig != libc::SIGSTOP {
                self.default_action(i, sig)?;
            }
            let d = &mut self.procs[i];
            d.stopping = Some(sig);
            ptrace::tgkill(pid, pid, sig).map_err(sys_err(pid, format!("send signal {sig}")))?;
            return ptrace::syscall(pid, 0).map_err(sys_err(pid, "resume".into()));
        }
        if !self.interrupt(i)? {
            return Ok(());
        }
        let i = self
            .procs
            .iter()
            .position(|d| d.pid == pid)
            .ok_or(Error::Unknown(pid))?;
        let (at, template) = {
            let d = &self.procs[i];
            (d.syscall_at, d.template)
        };
        match decode(status) {
            WaitStatus::Signaled(sig) if sig != libc::SIGKILL => {
                self.default_action(i, sig)?;
                self.procs[i].ending = Some(Ending::Signal(sig));
                ptrace::set_sigmask(pid, 0).map_err(sys_err(pid, "unblock signals".into()))?;
                ptrace::tgkill(pid, pid, sig)
                    .map_err(sys_err(pid, format!("send signal {sig}")))?;
                ptrace::syscall(pid, 0).map_err(sys_err(pid, "resume".into()))?;
            }
            WaitStatus::Signaled(_) => {
                self.procs[i].ending = Some(Ending::Signal(libc::SIGKILL));
                ptrace::kill(pid, libc::SIGKILL).map_err(sys_err(pid, "kill".into()))?;
            }
            WaitStatus::Exited(code) => {
                let mut r = template;
                r.rip = at;
                r.rax = libc::SYS_exit_group as u64;
                r.rdi = code as u64;
                r.orig_rax = u64::MAX;
                ptrace::set_regs(pid, &r).map_err(sys_err(pid, "prepare its exit".into()))?;
                self.procs[i].ending = Some(Ending::Exit);
                ptrace::cont(pid, 0).map_err(sys_err(pid, "resume".into()))?;
            }
            _ => {
                // Not an end: leave it parked.
                ptrace::syscall(pid, 0).map_err(sys_err(pid, "resume".into()))?;
            }
        }
        Ok(())
    }

    /// An injector into stopped deputy `i` (its PID too), at its own syscall instruction and
    /// scratch page.
    fn injector(&self, i: usize) -> Result<(i32, Injector)> {
        let d = &self.procs[i];
        let pid = d.pid;
        let regs = ptrace::get_regs(pid).map_err(sys_err(pid, "read registers".into()))?;
        let inj = Injector::new(
            pid,
            pid,
            regs,
            Site {
                syscall_at: d.syscall_at,
                scratch: d.scratch,
                scratch_len: PAGE,
            },
        )
        .map_err(inj_err(pid, "prepare"))?;
        Ok((pid, inj))
    }

    /// Reaps the children of stopped deputy `i` that have ended, by `wait4` calls injected
    /// into it.
    fn reap_children(&mut self, i: usize) -> Result<()> {
        let (pid, inj) = self.injector(i)?;
        let flags = (libc::WNOHANG | libc::__WALL) as u64;
        for _ in 0..4096 {
            let r = inj
                .syscall_raw("wait4", libc::SYS_wait4, &[u64::MAX, 0, flags, 0])
                .map_err(inj_err(pid, "reap its ended children"))?;
            if r <= 0 {
                break;
            }
        }
        inj.finish().map_err(inj_err(pid, "finish"))
    }

    /// Gives signal `sig` its default action in stopped deputy `i` (a kernel_sigaction of
    /// zeros), and turns core files off (the body's node has the body's).
    fn default_action(&mut self, i: usize, sig: i32) -> Result<()> {
        let (pid, inj) = self.injector(i)?;
        let sa = inj
            .write_scratch(0, &[0u8; 32])
            .map_err(inj_err(pid, "write a sigaction"))?;
        inj.syscall(
            "rt_sigaction",
            libc::SYS_rt_sigaction,
            &[sig as u64, sa, 0, 8],
        )
        .map_err(inj_err(pid, "reset a signal's action"))?;
        let zero = inj
            .write_scratch(64, &[0u8; 16])
            .map_err(inj_err(pid, "write an rlimit"))?;
        inj.syscall(
            "prlimit64",
            libc::SYS_prlimit64,
            &[0, libc::RLIMIT_CORE as u64, zero, 0],
        )
        .map_err(inj_err(pid, "turn core files off"))?;
        inj.finish().map_err(inj_err(pid, "finish"))
    }

    /// Kills every deputy (the home gives up on the tree) and collects their deaths.
    pub fn kill_all(&mut self) {
        for d in &mut self.procs {
            d.ending = Some(Ending::Signal(libc::SIGKILL));
            let _ = ptrace::kill(d.pid, libc::SIGKILL);
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !self.procs.is_empty() && std::time::Instant::now() < deadline {
            let _ = self.poll();
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
}

/// The calls a body's deputy makes at home for it ([`Deputies::call`]: a signal to a process
/// at home, a change of its group or session): x86_64 number, name,
/// and the argument that points to a siginfo, for those that take one.
pub const HOME_CALLS: [(i64, &str, Option<usize>); 7] = [
    (libc::SYS_setpgid, "setpgid", None),
    (libc::SYS_setsid, "setsid", None),
    (libc::SYS_kill, "kill", None),
    (libc::SYS_tkill, "tkill", None),
    (libc::SYS_tgkill, "tgkill", None),
    (libc::SYS_rt_sigqueueinfo, "rt_sigqueueinfo", Some(2)),
    (libc::SYS_rt_tgsigqueueinfo, "rt_tgsigqueueinfo", Some(3)),
];

/// The real, effective and saved uids of process `pid`.
fn uids_of(pid: i32) -> Option<[u32; 3]> {
    let s = procfs::status(pid).ok()?;
    let v: Vec<u32> = procfs::field(&s, "Uid")
        .split_whitespace()
        .filter_map(|u| u.parse().ok())
        .collect();
    Some([*v.first()?, *v.get(1)?, *v.get(2)?])
}

/// Whether the process group of `pid` is orphaned: no member has a parent in another group of
/// the same session (POSIX; the kernel's `is_current_pgrp_orphaned`).
fn pgrp_orphaned(pid: i32) -> bool {
    let Ok(me) = procfs::stat(pid) else {
        return false;
    };
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return false;
    };
    !dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|p| procfs::stat(p).ok())
        .filter(|s| s.pgid == me.pgid)
        .any(|member| {
            procfs::stat(member.ppid)
                .is_ok_and(|parent| parent.pgid != me.pgid && parent.sid == me.sid)
        })
}

/// The child of `parent` that `parent`'s own PID namespace numbers `theirs`, as this process
/// numbers it: `theirs` itself when `parent` is in our namespace (its NSpid has one number).
fn ours(parent: i32, theirs: i32) -> i32 {
    let last_nspid = |pid: i32| -> Option<(usize, i32)> {
        let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let ids: Vec<i32> = s
            .lines()
            .find_map(|l| l.strip_prefix("NSpid:"))?
            .split_whitespace()
            .filter_map(|n| n.parse().ok())
            .collect();
        Some((ids.len(), *ids.last()?))
    };
    if last_nspid(parent).is_none_or(|(levels, _)| levels <= 1) {
        return theirs;
    }
    std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|c| c.parse::<i32>().ok())
        .find(|&c| last_nspid(c).is_some_and(|(_, id)| id == theirs))
        .unwrap_or(theirs)
}

#[cfg(test)]
mod tests {
    use super::cut;

    #[test]
    fn cut_keeps_what_is_asked() {
        assert_eq!(cut(0, 100, &[]), vec![(0, 100)]);
        assert_eq!(cut(0, 100, &[(20, 30)]), vec![(0, 20), (30, 100)]);
        assert_eq!(cut(0, 100, &[(0, 100)]), vec![]);
        assert_eq!(cut(10, 50, &[(0, 20), (40, 60)]), vec![(20, 40)]);
        assert_eq!(cut(10, 50, &[(60, 70)]), vec![(10, 50)]);
    }
}
