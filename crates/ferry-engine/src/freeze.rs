//! Stopping a process tree in place, and letting it go again exactly as it was.
//!
//! Every thread is attached with PTRACE_SEIZE and stopped with PTRACE_INTERRUPT; nothing is
//! written into the processes. A [`FrozenTree`] that is dropped without being killed puts every
//! register and signal mask back and detaches, so an error anywhere during a checkpoint leaves
//! the tree running as it was.

use crate::error::{Context, Error, Result};
use crate::procfs;
use ferry_sys::ptrace;
use ferry_sys::regs::GpRegs;
use ferry_sys::wait::{wait_tid, WaitStatus};

pub const ERESTARTSYS: i64 = 512;
pub const ERESTARTNOINTR: i64 = 513;
pub const ERESTARTNOHAND: i64 = 514;
pub const ERESTART_RESTARTBLOCK: i64 = 516;
/// `restart_syscall` on x86_64: what a thread interrupted with `-ERESTART_RESTARTBLOCK` runs
/// when it goes on after a stop.
pub const SYS_RESTART_SYSCALL: u64 = 219;

/// Makes a thread stopped inside system call `nr` (registers `regs`) issue it again, with its
/// own arguments, when it runs on: the way a restore resumes a thread that was in a call, and
/// the way a thaw that asks for it ([`FrozenTree::reissue_on_thaw`]) lets one go.
pub fn reissue(regs: &mut GpRegs, nr: u64) {
    regs.rax = nr;
    regs.rip -= 2;
    regs.orig_rax = u64::MAX;
}

/// Whether a thread stopped with registers `regs` was in a call the kernel would resume with
/// `restart_syscall` (a sleep with a deadline: nanosleep, clock_nanosleep, poll, a futex wait
/// with a timeout), and not already in `restart_syscall` itself: the call it would resume is
/// known now, and only now. Once the thread has run on, its registers say `restart_syscall`,
/// whose state (which call, which deadline) is the kernel's restart block of this thread: a
/// later capture can neither read it nor make it again, and the restored thread's
/// `restart_syscall` fails with EINTR.
pub fn in_restart_block_call(regs: &GpRegs) -> bool {
    regs.orig_rax as i64 >= 0
        && regs.orig_rax != SYS_RESTART_SYSCALL
        && regs.rax as i64 == -ERESTART_RESTARTBLOCK
}

/// System calls that fail with EINTR when their thread is merely stopped and resumed (see
/// signal(7)); a thread caught in one is rewound so that it issues the call again.
const EINTR_ON_STOP: &[u64] = &[
    libc::SYS_epoll_wait as u64,
    libc::SYS_epoll_pwait as u64,
    441, // epoll_pwait2
    libc::SYS_semop as u64,
    libc::SYS_semtimedop as u64,
    libc::SYS_rt_sigtimedwait as u64,
];

/// The signals whose default action stops a process (job control).
pub const STOP_SIGNALS: [i32; 4] = [libc::SIGSTOP, libc::SIGTSTP, libc::SIGTTIN, libc::SIGTTOU];

#[derive(Debug)]
pub struct FrozenThread {
    pub tid: i32,
    /// The registers to resume with (after rewinding a call that would see a spurious EINTR).
    pub regs: GpRegs,
    pub sigmask: u64,
    /// The stop signal of the group stop (job control) the thread was in, if any.
    pub group_stop: Option<i32>,
}

#[derive(Debug)]
pub struct FrozenProc {
    pub pid: i32,
    pub stat: procfs::Stat,
    pub threads: Vec<FrozenThread>,
    pub zombie: bool,
    /// Set when the process is stopped by job control (SIGSTOP, SIGTSTP, SIGTTIN, SIGTTOU):
    /// the stop signal. Thawing it leaves it stopped, as it was.
    pub stop_signal: Option<i32>,
    /// Its main thread has exited (a zombie thread) while other threads run on: `threads`
    /// holds those, and the first stands for the process wherever a live thread is needed.
    pub leader_exited: bool,
}

impl FrozenProc {
    /// The thread through which the process is read (/proc, ptrace, process_vm_readv,
    /// pidfd_getfd): its PID, or a live thread when its main thread has exited.
    pub fn host(&self) -> i32 {
        if self.leader_exited {
            self.threads.first().map(|t| t.tid).unwrap_or(self.pid)
        } else {
            self.pid
        }
    }
}

#[derive(Debug, Default)]
pub struct FrozenTree {
    /// Parents before children.
    pub procs: Vec<FrozenProc>,
    /// Capture pipes shared with processes outside the tree as relayed (a migration that
    /// leaves a deputy at home relays them) instead of refusing them.
    pub relay_pipes: bool,
    /// A body moving on from a node that is not its home: its node's stand-ins for relays to
    /// the home (pipe inode -> the relay's id at home), captured as relayed with what is
    /// buffered in them (`Pipe::relay`) instead of refused as shared with the daemon.
    pub relay_standins: std::collections::HashMap<u64, u32>,
    /// A body moving on: its node's stand-ins for relayed sockets (the body's socket inode ->
    /// what the original was at home), captured as the original (`SocketDesc::relay`) instead
    /// of refused as connected to the daemon. Their inodes are among `relay_standins` too.
    pub relay_sockets: std::collections::HashMap<u64, crate::resources::sockets::RelayedNames>,
    /// Set by a migration, which may capture the tree again after letting it go (pre-copy's
    /// brief stop, then the freeze; a move that failed, then another): a thread let go from a
    /// sleep with a deadline ([`in_restart_block_call`]) issues its call again, with its own
    /// arguments, instead of going on in `restart_syscall`, so that a later capture still
    /// sees the call (a restored thread gets EINTR from a captured `restart_syscall`). Its
    /// sleep then starts again from its full length (a relative timeout; `sleep(3)`, whose
    /// request is also where the kernel writes the time left, goes on with the rest), as a
    /// restored thread's does. Without it (`ferry checkpoint --leave-running`), the thread goes
    /// on exactly where it was.
    pub reissue_on_thaw: bool,
    /// The tree's mappings read before the freeze ([`crate::premaps`]), settled right after
    /// it: the capture reads /proc/PID/smaps only where they are no longer right.
    pub premaps: Option<crate::premaps::PreMaps>,
    released: bool,
}

/// The ptrace options every frozen thread is seized with: its seccomp filters suspended (the
/// calls injected to capture it must not be refused, or kill it), and system call stops told
/// apart from SIGTRAP (injected calls run between them); no event is traced.
const FREEZE_OPTIONS: u64 = ptrace::PTRACE_O_SUSPEND_SECCOMP | ptrace::PTRACE_O_TRACESYSGOOD;

/// Seizes one thread and waits until it is in an interrupt stop. Returns `None` if the thread
/// exited meanwhile.
fn stop_thread(pid: i32, tid: i32) -> Result<Option<FrozenThread>> {
    let was_stopped = procfs::task_stat(pid, tid).is_ok_and(|s| s.state == 'T');
    match ptrace::seize(tid, FREEZE_OPTIONS) {
        Ok(()) => {}
        Err(e) if e.errno == libc::ESRCH => return Ok(None),
        Err(e) => return Err(e).ctx(pid, || format!("attach to thread {tid}")),
    }
    // A thread in a group stop (job control) is moved into a trap by the attach itself
    // (PTRACE_SEIZE waits until it is there): interrupting it as well would leave a second
    // trap pending, to be reported at its next step (the first injected call would meet it).
    // Only a thread that was in a group stop before the attach is in that trap: a running one
    // can be in a tracing stop too, a moment after the attach, if a signal came for it (its
    // signal-delivery stop); left uninterrupted it would run on and never stop.
    if !(was_stopped && procfs::task_stat(pid, tid).is_ok_and(|s| s.state == 't')) {
        ptrace::interrupt(tid).ctx(pid, || format!("interrupt thread {tid}"))?;
    }
    let group_stop;
    loop {
        match wait_tid(tid, false).ctx(pid, || format!("wait for thread {tid} to stop"))? {
            WaitStatus::Stopped {
                event: ptrace::PTRACE_EVENT_STOP,
                sig,
            } => {
                // The trap of a group stop reports its stop signal; an interrupt, SIGTRAP.
                group_stop = STOP_SIGNALS.contains(&sig).then_some(sig);
                break;
            }
            WaitStatus::Stopped { sig, event: 0 } => {
                // A signal was being delivered as we stopped the thread: let it be delivered,
                // and the interrupt stop follows (in its handler if it has one). Held back, it
                // would be lost if the tree ran on, and lost too if ferry died meanwhile. Any
                // stop clears a pending interrupt, this one too: it is asked for again (also
                // for a thread taken for group-stopped, which was running after all).
                ptrace::interrupt(tid).ctx(pid, || format!("interrupt thread {tid}"))?;
                ptrace::cont(tid, sig)
                    .ctx(pid, || format!("resume thread {tid} with signal {sig}"))?;
            }
            WaitStatus::Stopped { .. } => {
                ptrace::interrupt(tid).ctx(pid, || format!("interrupt thread {tid}"))?;
                ptrace::cont(tid, 0).ctx(pid, || format!("resume thread {tid}"))?;
            }
            WaitStatus::Exited(_) | WaitStatus::Signaled(_) => return Ok(None),
            WaitStatus::Nothing => {}
        }
    }
    let mut regs = ptrace::get_regs(tid).ctx(pid, || format!("read registers of thread {tid}"))?;
    let sigmask =
        ptrace::get_sigmask(tid).ctx(pid, || format!("read signal mask of thread {tid}"))?;
    if regs.orig_rax as i64 >= 0
        && regs.rax as i64 == -(libc::EINTR as i64)
        && EINTR_ON_STOP.contains(&regs.orig_rax)
    {
        regs.rax = regs.orig_rax;
        regs.rip -= 2;
        regs.orig_rax = u64::MAX;
        ptrace::set_regs(tid, &regs).ctx(pid, || format!("rewind system call of thread {tid}"))?;
    }
    Ok(Some(FrozenThread {
        tid,
        regs,
        sigmask,
        group_stop,
    }))
}

/// A process traced by another tracer (a debugger, strace) cannot be attached, and its
/// tracing (the tracer's link, options and the stop it holds the tracee in) could not be
/// captured or made again: only one tracer may hold a thread, and Ferry must be it.
fn refuse_traced(pid: i32) -> Result<()> {
    for tid in procfs::tids(pid)? {
        let Ok(status) = procfs::read(pid, &format!("task/{tid}/status")) else {
            continue;
        };
        let tracer = status
            .lines()
            .find_map(|l| l.strip_prefix("TracerPid:"))
            .and_then(|v| v.trim().parse::<i32>().ok())
            .unwrap_or(0);
        if tracer != 0 {
            let comm = std::fs::read_to_string(format!("/proc/{tracer}/comm"))
                .map(|c| c.trim().to_string())
                .unwrap_or_default();
            return Err(Error::Unsupported {
                pid,
                what: format!("thread {tid} is traced by PID {tracer} ({comm})"),
                why: "a thread has one tracer at a time, so Ferry cannot attach it, and the \
                      tracing itself (the tracer's link, its options, the stop it holds the \
                      thread in) is not something another process can capture or make again"
                    .into(),
            });
        }
    }
    Ok(())
}

impl FrozenTree {
    /// Stops `root` and all its descendants.
    pub fn freeze(root: i32) -> Result<FrozenTree> {
        let me = std::process::id() as i32;
        let stat = procfs::stat(root)?;
        if stat.flags & procfs::PF_KTHREAD != 0 {
            return Err(Error::KernelThread { pid: root });
        }
        let mut tree = FrozenTree::default();
        let mut queue = vec![root];
        while let Some(pid) = queue.pop() {
            crate::cancel::check("freezing the tree")?;
            if pid == me {
                return Err(Error::IsFerry {
                    pid: root,
                    ferry: me,
                });
            }
            let proc = match tree.freeze_process(pid) {
                Ok(p) => p,
                // A child that has ended and been collected since its parent's children were
                // listed is not part of the tree any more.
                Err(Error::NoSuchProcess { .. }) if pid != root => continue,
                Err(e) => return Err(e),
            };
            if proc.zombie && pid == root {
                // Dropping the tree lets go what it holds: nothing yet.
                return Err(Error::Unsupported {
                    pid,
                    what: "the process".into(),
                    why: "it has exited (a zombie, waiting for its parent to collect its status): \
                          there is nothing left of it to checkpoint or move"
                        .into(),
                });
            }
            let zombie = proc.zombie;
            tree.procs.push(proc);
            if !zombie {
                let mut kids = procfs::children(pid)?;
                kids.reverse();
                queue.extend(kids);
            }
        }
        // Parents were pushed before their children; keep that order.
        Ok(tree)
    }

    fn freeze_process(&mut self, pid: i32) -> Result<FrozenProc> {
        let stat = procfs::stat(pid)?;
        if stat.flags & procfs::PF_KTHREAD != 0 {
            return Err(Error::KernelThread { pid });
        }
        // The leader thread exited (pthread_exit in main) while the others run on: the
        // process lives, driven through another thread.
        let leader_exited = stat.state == 'Z' && procfs::tids(pid).is_ok_and(|t| t.len() > 1);
        if stat.state == 'Z' && !leader_exited {
            return Ok(FrozenProc {
                pid,
                stat,
                threads: Vec::new(),
                zombie: true,
                stop_signal: None,
                leader_exited: false,
            });
        }
        refuse_traced(pid)?;
        let mut proc = FrozenProc {
            pid,
            stat,
            threads: Vec::new(),
            zombie: false,
            stop_signal: None,
            leader_exited,
        };
        // Threads may be created while we attach; repeat until a pass finds none new.
        loop {
            let mut new = 0;
            for tid in procfs::tids(pid)? {
                if (leader_exited && tid == pid) || proc.threads.iter().any(|t| t.tid == tid) {
                    continue;
                }
                match stop_thread(pid, tid) {
                    Ok(Some(t)) => {
                        proc.threads.push(t);
                        new += 1;
                    }
                    Ok(None) => {}
                    Err(e) => {
                        // Keep what was stopped so that Drop lets it go again.
                        self.procs.push(proc);
                        return Err(e);
                    }
                }
            }
            if new == 0 {
                break;
            }
        }
        proc.threads
            .sort_by_key(|t| if t.tid == pid { 0 } else { 1 });
        proc.stop_signal = proc.threads.iter().find_map(|t| t.group_stop);
        if proc.threads.is_empty() {
            return Err(Error::NoSuchProcess { pid });
        }
        Ok(proc)
    }

    /// Sets PTRACE_O_EXITKILL on every traced thread (keeping the other options): from now on,
    /// if the tracer (this thread of ferry) dies, every process of the tree is killed instead of
    /// being let go. The commit point of a migration: once the tree runs elsewhere, the original
    /// must not carry on if the source dies. `thaw` still lets it go (detaching clears the option).
    pub fn set_exit_kill(&self) -> Result<()> {
        for p in self.procs.iter().filter(|p| !p.zombie) {
            for t in &p.threads {
                ptrace::set_options(t.tid, FREEZE_OPTIONS | ptrace::PTRACE_O_EXITKILL)
                    .ctx(p.pid, || {
                        format!("set PTRACE_O_EXITKILL on thread {}", t.tid)
                    })?;
            }
        }
        Ok(())
    }

    /// Hands the frozen processes over, still traced and stopped, to a caller that keeps them
    /// (the deputies a migration leaves at home): this tree no longer thaws or kills them.
    pub fn into_procs(mut self) -> Vec<FrozenProc> {
        self.released = true;
        std::mem::take(&mut self.procs)
    }

    /// The ptrace options every frozen thread carries.
    pub const OPTIONS: u64 = FREEZE_OPTIONS;

    /// Puts every thread back as it was and detaches. Errors are logged, not returned: each
    /// thread is let go even if another could not be.
    pub fn thaw(mut self) {
        self.release();
    }

    fn release(&mut self) {
        if self.released {
            return;
        }
        self.released = true;
        for p in &self.procs {
            for t in &p.threads {
                let mut regs = t.regs;
                if self.reissue_on_thaw && in_restart_block_call(&regs) {
                    let nr = regs.orig_rax;
                    reissue(&mut regs, nr);
                }
                let restore = ptrace::set_regs(t.tid, &regs)
                    .and_then(|_| ptrace::set_sigmask(t.tid, t.sigmask));
                if let Err(e) = restore {
                    log::warn!(
                        "PID {}: restoring thread {} before detaching: {e}",
                        p.pid,
                        t.tid
                    );
                }
                if let Err(e) = ptrace::detach(t.tid, 0) {
                    log::warn!("PID {}: detaching thread {}: {e}", p.pid, t.tid);
                }
            }
        }
    }

    /// Kills the whole tree (the image is safely written) and waits until every thread is dead.
    /// Reaping the processes is their parents' business.
    pub fn kill(mut self) {
        self.released = true;
        // Its TCP connections close silently (repair mode), to be made again by a restore.
        let live: Vec<i32> = self
            .procs
            .iter()
            .filter(|p| !p.zombie)
            .map(|p| p.pid)
            .collect();
        crate::resources::sockets::silence_tcp_connections(&live, &Default::default());
        for p in &self.procs {
            if !p.zombie {
                let _ = ptrace::kill(p.pid, libc::SIGKILL);
            }
        }
        for p in &self.procs {
            // Collect the tracer's notification of each death; a group leader's comes only
            // after all its other threads', so it is waited for last.
            for t in p.threads.iter().rev() {
                while let Ok(s) = wait_tid(t.tid, false) {
                    if matches!(s, WaitStatus::Exited(_) | WaitStatus::Signaled(_)) {
                        break;
                    }
                }
            }
        }
    }
}

impl Drop for FrozenTree {
    fn drop(&mut self) {
        self.release();
    }
}
