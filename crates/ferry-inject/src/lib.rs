//! Running system calls inside a stopped tracee.
//!
//! Ferry never writes code into a process it checkpoints. An injected call runs at a `syscall`
//! instruction the process already has, between the two stops `PTRACE_SYSCALL` gives (entry
//! and exit), so that nothing of it outlives the tracer: a single step would leave the trap
//! flag set, and the thread would die of SIGTRAP if the tracer died (the kernel clears the
//! syscall-trace flag when the tracer goes, not the trap flag). Data the call reads or writes
//! goes through a scratch area below the thread's red zone, whose bytes are saved first and put
//! back afterwards.
//!
//! An injector made with [`Injector::on_stack`] (a thread of a live process) also keeps the
//! thread safe from its tracer's death at every instant: see [`rescue`]. Its signals are
//! blocked while calls run (an injected call must not take a signal meant for the process),
//! and the frame that `rt_sigreturn` would read holds its own mask. [`Injector::finish`]
//! puts the mask, the registers and the stack bytes back, in that order, from an interrupt
//! stop, where the kernel's own restart logic sees the thread's registers when it runs on.

#![forbid(unsafe_code)]

pub mod batch;
pub mod rescue;
pub mod together;

use ferry_sys::proc_mem::ProcMem;
use ferry_sys::ptrace;
use ferry_sys::regs::GpRegs;
use ferry_sys::wait::{wait_tid, WaitStatus};
use ferry_sys::SysError;
use std::cell::Cell;

#[derive(Debug, thiserror::Error)]
pub enum InjectError {
    #[error("thread {tid}: {source}")]
    Sys { tid: i32, source: SysError },
    #[error("thread {tid}: unexpected {status:?} while running an injected {call}")]
    UnexpectedStop {
        tid: i32,
        call: &'static str,
        status: WaitStatus,
    },
    #[error("thread {tid}: injected {call} failed: {}", std::io::Error::from_raw_os_error(*errno))]
    Failed {
        tid: i32,
        call: &'static str,
        errno: i32,
    },
    #[error(
        "thread {tid}: {len} bytes at offset {off} do not fit the {scratch_len}-byte scratch area"
    )]
    ScratchOverflow {
        tid: i32,
        off: u64,
        len: u64,
        scratch_len: u64,
    },
    #[error("process {pid}: no `syscall` instruction found in its executable mappings")]
    NoSyscallInsn { pid: i32 },
}

pub type Result<T> = std::result::Result<T, InjectError>;

/// Configures the fail points of this process from `FAILPOINTS` (the `fail` crate's format,
/// `NAME=ACTIONS;...`), once, at the start of every `ferry` process (CLI, daemon, workers). A
/// no-op unless the `failpoints` feature is on (the test suite's builds): release builds carry no
/// fail points and read no configuration.
pub fn setup_failpoints() {
    #[cfg(feature = "failpoints")]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        // The scenario holds a lock for its lifetime: kept for the whole process.
        ONCE.call_once(|| std::mem::forget(fail::FailScenario::setup()));
    }
}

/// Test-only fail points (`fail` crate, feature `failpoints`): the tracer kills itself with
/// SIGKILL when the fail point named POINT returns, at one of the instants at which a thread
/// holds something of an injection: `parked` (registers and frame set, mask not yet blocked),
/// `entry` (at the entry stop, before the call is set up), `call` (the call set up at the entry
/// stop), `exit` (at the exit stop), `back` (at the interrupt stop, before the mask is put back),
/// `mask` (the mask put back, not yet the registers), `batch` (a husk running a batch of calls:
/// [`batch`]). The Nth time: `FAILPOINTS=entry=2*off->return`.
fn fault(point: &str) {
    fail::fail_point!(point, |_| {
        log::warn!("fail point {point}: killing the tracer");
        ferry_sys::process::kill_self();
    });
    let _ = point;
}

/// The red zone below the stack pointer the x86_64 ABI lets leaf functions use; never touched.
const RED_ZONE: u64 = 128;
const STACK_SCRATCH: u64 = 1024;

/// Where injected calls find their `syscall` instruction and their scratch memory.
#[derive(Debug, Clone, Copy)]
pub struct Site {
    pub syscall_at: u64,
    pub scratch: u64,
    pub scratch_len: u64,
}

/// What an injector on a live thread must put back.
struct Owned {
    /// The thread's own signal mask (PTRACE_GETSIGMASK), blocked entirely meanwhile.
    mask: u64,
    /// The stack bytes under the scratch area (and the signal frame), from this address.
    saved_at: u64,
    saved: Vec<u8>,
    /// The `rt_sigreturn` sequence and the frame's ucontext the thread is parked on, if the
    /// process has such a sequence.
    parked: Option<GpRegs>,
}

/// A stopped thread in which system calls can be run.
pub struct Injector {
    pub tid: i32,
    /// The process the thread belongs to (whose memory `mem` is).
    pid: i32,
    site: Site,
    base: GpRegs,
    mem: ProcMem,
    owned: Option<Owned>,
    /// Whether the thread is in a syscall stop (rather than a signal or interrupt stop).
    at_syscall_stop: Cell<bool>,
    finished: Cell<bool>,
    /// The process or thread the last injected fork/clone made, as our PID namespace numbers it
    /// (PTRACE_GETEVENTMSG): the call's own result is the number in the tracee's namespace.
    new_child: Cell<Option<i32>>,
    /// What the clone3 calls of the last batch made ([`batch`]), in order.
    batch_children: std::cell::RefCell<Vec<i32>>,
}

impl Injector {
    /// Prepares a thread whose registers are `base` (the thread must be in a ptrace stop), for
    /// calls at `site`. Nothing is saved or put back: for husks that Ferry itself builds.
    pub fn new(pid: i32, tid: i32, base: GpRegs, site: Site) -> Result<Self> {
        let mem = ProcMem::open(pid).map_err(|source| InjectError::Sys { tid, source })?;
        Ok(Injector {
            tid,
            pid,
            site,
            base,
            mem,
            owned: None,
            at_syscall_stop: Cell::new(false),
            finished: Cell::new(false),
            new_child: Cell::new(None),
            batch_children: Default::default(),
        })
    }

    /// Prepares thread `tid` of a live process `pid`, stopped with registers `base`: scratch
    /// memory below its red zone, its bytes saved; its signals blocked; and, if the process
    /// has an `rt_sigreturn` sequence, the thread parked on it (see [`rescue`]), so that if
    /// ferry dies at any point from here on the thread puts itself back as it was.
    /// [`Injector::finish`] (or dropping the injector) undoes all of it.
    pub fn on_stack(pid: i32, tid: i32, base: GpRegs, syscall_at: u64) -> Result<Self> {
        let mut inj = Self::new(
            pid,
            tid,
            base,
            Site {
                syscall_at,
                scratch: 0,
                scratch_len: STACK_SCRATCH,
            },
        )?;
        let mask = ptrace::get_sigmask(tid).map_err(|e| inj.sys(e))?;
        let top = (base.rsp - RED_ZONE) & !63;
        let sigreturn_at = rescue::find_sigreturn(pid, &inj.mem);
        let (scratch, frame) = match sigreturn_at {
            Some(_) => {
                let xstate = ptrace::get_xstate(tid).map_err(|e| inj.sys(e))?;
                let fp = (top - xstate.len() as u64 - 4) & !63;
                let uc = (fp - rescue::UCONTEXT_LEN) & !15;
                // 8 bytes for the return address a signal frame starts with (never read).
                let scratch = (uc - 8 - STACK_SCRATCH) & !15;
                (
                    scratch,
                    Some((uc, rescue::frame(&base, mask, &xstate, uc, fp))),
                )
            }
            None => ((top - STACK_SCRATCH) & !15, None),
        };
        inj.site.scratch = scratch;
        let mut saved = vec![0u8; (top - scratch) as usize];
        inj.mem
            .read_exact(scratch, &mut saved)
            .map_err(|e| inj.sys(e))?;
        let mut owned = Owned {
            mask,
            saved_at: scratch,
            saved,
            parked: None,
        };
        if let (Some(at), Some((uc, bytes))) = (sigreturn_at, frame) {
            inj.mem.write_all(uc, &bytes).map_err(|e| inj.sys(e))?;
            let parked = rescue::parked(&base, at, uc);
            // From here on, a thread let go runs rt_sigreturn and is as it was ...
            ptrace::set_regs(tid, &parked).map_err(|e| inj.sys(e))?;
            owned.parked = Some(parked);
            fault("parked");
        }
        // ... mask included, since the frame holds its own.
        inj.owned = Some(owned);
        ptrace::set_sigmask(tid, u64::MAX).map_err(|e| inj.sys(e))?;
        Ok(inj)
    }

    pub fn site(&self) -> Site {
        self.site
    }

    /// Moves injected calls to another `syscall` instruction and scratch area.
    pub fn set_site(&mut self, site: Site) {
        self.site = site;
    }

    pub fn base_regs(&self) -> &GpRegs {
        &self.base
    }

    pub fn set_base_regs(&mut self, regs: GpRegs) {
        self.base = regs;
    }

    fn sys(&self, source: SysError) -> InjectError {
        InjectError::Sys {
            tid: self.tid,
            source,
        }
    }

    /// Resumes the thread up to its next syscall stop (entry or exit), following the fork and
    /// clone events of an injected clone on the way.
    fn to_syscall_stop(&self, call: &'static str) -> Result<()> {
        self.resume_to_syscall()?;
        self.wait_syscall_stop(call)
    }

    /// Lets the thread run up to its next syscall stop, without waiting for it.
    fn resume_to_syscall(&self) -> Result<()> {
        ptrace::syscall(self.tid, 0).map_err(|e| self.sys(e))?;
        self.at_syscall_stop.set(false);
        Ok(())
    }

    /// Waits for the syscall stop [`Injector::resume_to_syscall`] let the thread run to.
    fn wait_syscall_stop(&self, call: &'static str) -> Result<()> {
        loop {
            let status = wait_tid(self.tid, false).map_err(|e| self.sys(e))?;
            match status {
                WaitStatus::Stopped { sig, event: 0 }
                    if sig == ptrace::SYSCALL_STOP_SIG || sig == libc::SIGTRAP =>
                {
                    self.at_syscall_stop.set(true);
                    return Ok(());
                }
                // fork/clone events of an injected clone3: on to the end of the call.
                WaitStatus::Stopped { event, .. } if (1..=3).contains(&event) => {
                    let child = ptrace::get_event_msg(self.tid).map_err(|e| self.sys(e))?;
                    self.new_child.set(Some(child as i32));
                    ptrace::syscall(self.tid, 0).map_err(|e| self.sys(e))?;
                }
                // A fault caused by the call itself: going on would fault again.
                WaitStatus::Stopped { sig, event: 0 }
                    if [libc::SIGSEGV, libc::SIGBUS, libc::SIGILL, libc::SIGFPE].contains(&sig) =>
                {
                    return Err(InjectError::UnexpectedStop {
                        tid: self.tid,
                        call,
                        status,
                    });
                }
                // A signal the mask could not hold back (SIGCHLD to a traced parent is reported
                // even when blocked): suppress it and go on.
                WaitStatus::Stopped { sig, event: 0 } if sig != libc::SIGKILL => {
                    log::debug!("thread {}: stopped by signal {sig} during {call}", self.tid);
                    ptrace::syscall(self.tid, 0).map_err(|e| self.sys(e))?;
                }
                other => {
                    return Err(InjectError::UnexpectedStop {
                        tid: self.tid,
                        call,
                        status: other,
                    })
                }
            }
        }
    }

    /// Runs one system call and returns the raw kernel result (negative errno on failure).
    pub fn syscall_raw(&self, call: &'static str, nr: i64, args: &[u64]) -> Result<i64> {
        self.new_child.set(None);
        let parked = self.owned.as_ref().and_then(|o| o.parked);
        let mut r = parked.unwrap_or(self.base);
        if parked.is_some() {
            // Up to the entry of the thread's rt_sigreturn, which becomes this call; the call
            // returns to the same sequence.
            self.to_syscall_stop(call)?;
            fault("entry");
            r.orig_rax = nr as u64;
        } else {
            r.rax = nr as u64;
            // -1 tells the kernel's syscall-restart logic that no system call is in progress.
            r.orig_rax = u64::MAX;
            r.rip = self.site.syscall_at;
        }
        let slots = [
            &mut r.rdi, &mut r.rsi, &mut r.rdx, &mut r.r10, &mut r.r8, &mut r.r9,
        ];
        for (slot, value) in slots
            .into_iter()
            .zip(args.iter().copied().chain(std::iter::repeat(0)))
        {
            *slot = value;
        }
        ptrace::set_regs(self.tid, &r).map_err(|e| self.sys(e))?;
        if parked.is_none() {
            self.to_syscall_stop(call)?;
        }
        fault("call");
        // The call runs between its entry and exit stops.
        self.to_syscall_stop(call)?;
        fault("exit");
        let out = ptrace::get_regs(self.tid).map_err(|e| self.sys(e))?;
        Ok(out.rax as i64)
    }

    /// The PID (in our namespace) of the process or thread made by the last injected call that
    /// made one (fork, clone, clone3), once; `None` if none was made since the last time.
    pub fn take_new_child(&self) -> Option<i32> {
        self.new_child.take()
    }

    /// Runs one system call; a negative result becomes [`InjectError::Failed`].
    pub fn syscall(&self, call: &'static str, nr: i64, args: &[u64]) -> Result<u64> {
        let r = self.syscall_raw(call, nr, args)?;
        if (-4095..0).contains(&r) {
            return Err(InjectError::Failed {
                tid: self.tid,
                call,
                errno: (-r) as i32,
            });
        }
        Ok(r as u64)
    }

    /// Address of scratch byte `off`.
    pub fn scratch(&self, off: u64) -> u64 {
        assert!(
            off < self.site.scratch_len,
            "scratch offset {off} out of range"
        );
        self.site.scratch + off
    }

    /// Checks that `len` bytes at scratch offset `off` fit: what goes there may come from an
    /// image (a path, a list of groups), and a crafted one is an error, not a panic.
    fn fits(&self, off: u64, len: u64) -> Result<()> {
        if off
            .checked_add(len)
            .is_none_or(|end| end > self.site.scratch_len)
        {
            return Err(InjectError::ScratchOverflow {
                tid: self.tid,
                off,
                len,
                scratch_len: self.site.scratch_len,
            });
        }
        Ok(())
    }

    pub fn write_scratch(&self, off: u64, bytes: &[u8]) -> Result<u64> {
        self.fits(off, bytes.len() as u64)?;
        let addr = self.site.scratch + off;
        self.mem.write_all(addr, bytes).map_err(|e| self.sys(e))?;
        Ok(addr)
    }

    pub fn read_scratch(&self, off: u64, len: usize) -> Result<Vec<u8>> {
        self.fits(off, len as u64)?;
        let mut buf = vec![0u8; len];
        self.mem
            .read_exact(self.site.scratch + off, &mut buf)
            .map_err(|e| self.sys(e))?;
        Ok(buf)
    }

    /// Brings a thread in a syscall stop to an interrupt stop: from there, when it runs on, the
    /// kernel's restart logic sees the registers it is given (on the way out of a syscall stop
    /// it would not run, and a call the thread was interrupted in would return -ERESTART...).
    fn to_interrupt_stop(&self) -> Result<()> {
        if !self.at_syscall_stop.get() {
            return Ok(());
        }
        ptrace::interrupt(self.tid).map_err(|e| self.sys(e))?;
        ptrace::cont(self.tid, 0).map_err(|e| self.sys(e))?;
        self.at_syscall_stop.set(false);
        loop {
            match wait_tid(self.tid, false).map_err(|e| self.sys(e))? {
                WaitStatus::Stopped {
                    event: ptrace::PTRACE_EVENT_STOP,
                    ..
                } => return Ok(()),
                WaitStatus::Stopped { sig, event: 0 } if sig != libc::SIGKILL => {
                    log::debug!(
                        "thread {}: stopped by signal {sig} on its way back",
                        self.tid
                    );
                    ptrace::cont(self.tid, 0).map_err(|e| self.sys(e))?;
                }
                WaitStatus::Stopped { .. } => {
                    ptrace::cont(self.tid, 0).map_err(|e| self.sys(e))?;
                }
                status => {
                    return Err(InjectError::UnexpectedStop {
                        tid: self.tid,
                        call: "the way back to an interrupt stop",
                        status,
                    })
                }
            }
        }
    }

    fn put_back(&self) -> Result<()> {
        if self.finished.replace(true) {
            return Ok(());
        }
        let Some(owned) = &self.owned else {
            return ptrace::set_regs(self.tid, &self.base).map_err(|e| self.sys(e));
        };
        self.to_interrupt_stop()?;
        fault("back");
        // The mask first: until the registers are back, a thread let go still runs
        // rt_sigreturn, which puts them back.
        ptrace::set_sigmask(self.tid, owned.mask).map_err(|e| self.sys(e))?;
        fault("mask");
        ptrace::set_regs(self.tid, &self.base).map_err(|e| self.sys(e))?;
        self.mem
            .write_all(owned.saved_at, &owned.saved)
            .map_err(|e| self.sys(e))
    }

    /// Puts back the signal mask, the registers and the stack bytes the thread had.
    pub fn finish(self) -> Result<()> {
        self.put_back()
    }
}

impl Drop for Injector {
    /// An injector dropped on an error path still puts its thread back.
    fn drop(&mut self) {
        if self.owned.is_some() && !self.finished.get() {
            if let Err(e) = self.put_back() {
                log::warn!(
                    "thread {}: putting it back after injected calls: {e}",
                    self.tid
                );
            }
        }
    }
}

/// Finds a `syscall` instruction (0f 05) in an executable mapping of `pid`, the vDSO first.
pub fn find_syscall_insn(pid: i32) -> Result<u64> {
    let maps =
        std::fs::read_to_string(format!("/proc/{pid}/maps")).map_err(|e| InjectError::Sys {
            tid: pid,
            source: SysError::new("read /proc/PID/maps", e.raw_os_error().unwrap_or(0)),
        })?;
    let mem = ProcMem::open(pid).map_err(|source| InjectError::Sys { tid: pid, source })?;
    let mut candidates: Vec<(u64, u64, bool)> = Vec::new();
    for line in maps.lines() {
        let mut it = line.split_whitespace();
        let (Some(range), Some(perms)) = (it.next(), it.next()) else {
            continue;
        };
        if !perms.contains('x') {
            continue;
        }
        let Some((s, e)) = range.split_once('-') else {
            continue;
        };
        let (Ok(s), Ok(e)) = (u64::from_str_radix(s, 16), u64::from_str_radix(e, 16)) else {
            continue;
        };
        candidates.push((s, e, line.ends_with("[vdso]")));
    }
    candidates.sort_by_key(|c| !c.2);
    for (start, end, _) in candidates {
        let mut addr = start;
        while addr < end {
            let len = (end - addr).min(1 << 16) as usize;
            let mut buf = vec![0u8; len];
            if mem.read_exact(addr, &mut buf).is_err() {
                break;
            }
            if let Some(i) = buf.windows(2).position(|w| w == [0x0f, 0x05]) {
                return Ok(addr + i as u64);
            }
            if addr + len as u64 >= end {
                break;
            }
            // Step back one byte so an instruction split across two reads is still seen.
            addr += len as u64 - 1;
        }
    }
    Err(InjectError::NoSyscallInsn { pid })
}
