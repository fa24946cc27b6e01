//! Running system calls inside a stopped tracee.
//!
//! Ferry never writes code into a process it checkpoints: it points a stopped thread at a
//! `syscall` instruction that already exists in the process (the vDSO has one), sets the
//! argument registers, single-steps it, reads the result and puts every register back. While it
//! does so the thread's signal mask blocks everything, so no signal is delivered or lost between
//! steps. Data the call reads or writes goes through a scratch area just below the thread's red
//! zone, whose bytes are saved first and put back afterwards.

#![forbid(unsafe_code)]

use ferry_sys::proc_mem::ProcMem;
use ferry_sys::ptrace;
use ferry_sys::regs::GpRegs;
use ferry_sys::wait::{wait_tid, WaitStatus};
use ferry_sys::SysError;

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

/// A stopped thread in which system calls can be run.
pub struct Injector {
    pub tid: i32,
    site: Site,
    base: GpRegs,
    mem: ProcMem,
    saved_scratch: Option<Vec<u8>>,
    /// The process or thread the last injected fork/clone made, as our PID namespace numbers it
    /// (PTRACE_GETEVENTMSG): the call's own result is the number in the tracee's namespace.
    new_child: std::cell::Cell<Option<i32>>,
}

impl Injector {
    /// Prepares a thread whose registers are `base` (the thread must be in a ptrace stop).
    pub fn new(pid: i32, tid: i32, base: GpRegs, site: Site) -> Result<Self> {
        let mem = ProcMem::open(pid).map_err(|source| InjectError::Sys { tid, source })?;
        Ok(Injector {
            tid,
            site,
            base,
            mem,
            saved_scratch: None,
            new_child: std::cell::Cell::new(None),
        })
    }

    /// Uses the memory just below the thread's red zone as scratch, saving its bytes so that
    /// [`Injector::finish`] can put them back.
    pub fn on_stack(pid: i32, tid: i32, base: GpRegs, syscall_at: u64) -> Result<Self> {
        let scratch = (base.rsp - RED_ZONE - STACK_SCRATCH) & !15;
        let mut inj = Self::new(
            pid,
            tid,
            base,
            Site {
                syscall_at,
                scratch,
                scratch_len: STACK_SCRATCH,
            },
        )?;
        let mut saved = vec![0u8; STACK_SCRATCH as usize];
        inj.mem
            .read_exact(scratch, &mut saved)
            .map_err(|source| InjectError::Sys { tid, source })?;
        inj.saved_scratch = Some(saved);
        Ok(inj)
    }

    pub fn site(&self) -> Site {
        self.site
    }

    /// Moves injected calls to another `syscall` instruction and scratch area.
    pub fn set_site(&mut self, site: Site) {
        self.site = site;
        self.saved_scratch = None;
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

    /// Runs one system call and returns the raw kernel result (negative errno on failure).
    pub fn syscall_raw(&self, call: &'static str, nr: i64, args: &[u64]) -> Result<i64> {
        self.new_child.set(None);
        let mut r = self.base;
        r.rax = nr as u64;
        // -1 tells the kernel's syscall-restart logic that no system call is in progress.
        r.orig_rax = u64::MAX;
        r.rip = self.site.syscall_at;
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
        ptrace::singlestep(self.tid, 0).map_err(|e| self.sys(e))?;
        loop {
            let status = wait_tid(self.tid, false).map_err(|e| self.sys(e))?;
            match status {
                WaitStatus::Stopped { sig, event: 0 } if sig == libc::SIGTRAP => break,
                // fork/clone events of an injected clone3: step on to the end of the call.
                WaitStatus::Stopped { event, .. } if (1..=3).contains(&event) => {
                    let child = ptrace::get_event_msg(self.tid).map_err(|e| self.sys(e))?;
                    self.new_child.set(Some(child as i32));
                    ptrace::singlestep(self.tid, 0).map_err(|e| self.sys(e))?;
                }
                // A signal the mask could not hold back (SIGCHLD to a traced parent is reported
                // even when blocked): suppress it and keep stepping.
                // A fault caused by the call itself: stepping again would fault again.
                WaitStatus::Stopped { sig, event: 0 }
                    if [libc::SIGSEGV, libc::SIGBUS, libc::SIGILL, libc::SIGFPE].contains(&sig) =>
                {
                    return Err(InjectError::UnexpectedStop {
                        tid: self.tid,
                        call,
                        status,
                    });
                }
                WaitStatus::Stopped { sig, event: 0 } if sig != libc::SIGKILL => {
                    log::debug!(
                        "thread {}: {} stopped by signal {sig} during {call}",
                        self.tid,
                        call
                    );
                    ptrace::singlestep(self.tid, 0).map_err(|e| self.sys(e))?;
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

    /// Puts back the scratch bytes and the registers the thread had.
    pub fn finish(self) -> Result<()> {
        if let Some(saved) = &self.saved_scratch {
            self.mem
                .write_all(self.site.scratch, saved)
                .map_err(|e| self.sys(e))?;
        }
        ptrace::set_regs(self.tid, &self.base).map_err(|e| self.sys(e))
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
