//! Many system calls in one injection: a table of calls written into the process, run by a
//! small position-independent loop that the process executes itself, stopping at the first
//! failure.
//!
//! An injected call costs two ptrace stops and a few register transfers (about 0.1-0.2 ms on
//! this kind of machine); a process with 8,000 mappings needs tens of thousands of calls. The
//! loop ([`LOOP_CODE`]) makes them all from inside the process, the way CRIU's restorer blob
//! does, but the blob here is 98 bytes of code that does nothing but read the table: each entry
//! is a call number, six arguments, flags and an expected result. It ends at an `int3` (the
//! tracer's `SIGTRAP`) when the table is done, when a call fails (a result in -4095..-1), or
//! when a call's result is not the one expected; `r13` then holds the index of the entry it
//! stopped at and `rax` its result.
//!
//! Only for processes Ferry builds itself (husks, which the kernel kills with their tracer:
//! `PTRACE_O_EXITKILL`): a tracer that dies while the loop runs leaves nothing half-built.
//! Never in a process being checkpointed, which Ferry does not write code into.

use crate::{fault, InjectError, Injector, Result};
use ferry_sys::ptrace;
use ferry_sys::wait::{wait_tid, WaitStatus};

/// The loop, as assembled (`as --64`, Intel syntax). Registers: `rbx` the entry, `r12` the
/// entries left, `r13` the index of the entry, `r14` a value kept from an earlier call.
///
/// ```text
/// loop:  test r12, r12 ; jz done
///        mov r15, [rbx+56]                 ; flags
///        mov rax, [rbx]                    ; call number
///        mov rdi, [rbx+8]  ; mov rsi, [rbx+16] ; mov rdx, [rbx+24]
///        mov r10, [rbx+32] ; mov r8, [rbx+40]  ; mov r9, [rbx+48]
///        test r15b, 4 ; jz 1f ; add rdi, r14   ; ARG0_PLUS_KEPT
/// 1:     test r15b, 8 ; jz 2f ; mov r8, r14    ; ARG4_IS_KEPT
/// 2:     syscall
///        cmp rax, -4095 ; jae done             ; failed
///        test r15b, 1 ; jz 3f
///        cmp rax, [rbx+64] ; jne done          ; EXPECT: not the result expected
/// 3:     test r15b, 2 ; jz 4f ; mov r14, rax   ; KEEP
/// 4:     add rbx, 72 ; dec r12 ; inc r13 ; jmp loop
/// done:  int3
/// ```
pub const LOOP_CODE: [u8; 98] = [
    0x4d, 0x85, 0xe4, 0x74, 0x5c, 0x4c, 0x8b, 0x7b, 0x38, 0x48, 0x8b, 0x03, 0x48, 0x8b, 0x7b, 0x08,
    0x48, 0x8b, 0x73, 0x10, 0x48, 0x8b, 0x53, 0x18, 0x4c, 0x8b, 0x53, 0x20, 0x4c, 0x8b, 0x43, 0x28,
    0x4c, 0x8b, 0x4b, 0x30, 0x41, 0xf6, 0xc7, 0x04, 0x74, 0x03, 0x4c, 0x01, 0xf7, 0x41, 0xf6, 0xc7,
    0x08, 0x74, 0x03, 0x4d, 0x89, 0xf0, 0x0f, 0x05, 0x48, 0x3d, 0x01, 0xf0, 0xff, 0xff, 0x73, 0x21,
    0x41, 0xf6, 0xc7, 0x01, 0x74, 0x06, 0x48, 0x3b, 0x43, 0x40, 0x75, 0x15, 0x41, 0xf6, 0xc7, 0x02,
    0x74, 0x03, 0x49, 0x89, 0xc6, 0x48, 0x83, 0xc3, 0x48, 0x49, 0xff, 0xcc, 0x49, 0xff, 0xc5, 0xeb,
    0x9f, 0xcc,
];

/// Bytes per table entry: number, six arguments, flags, expected result.
pub const ENTRY_LEN: u64 = 72;

/// The call's result must be [`Call::expect`] (a `MAP_FIXED` mapping landing where asked).
pub const EXPECT: u64 = 1;
/// The call's result is kept (in `r14`) for the calls after it.
pub const KEEP: u64 = 2;
/// The kept value is added to the first argument.
pub const ARG0_PLUS_KEPT: u64 = 4;
/// The fifth argument is the kept value (an `mmap`'s descriptor).
pub const ARG4_IS_KEPT: u64 = 8;

/// One entry of the table.
#[derive(Debug, Clone, Copy)]
pub struct Call {
    pub name: &'static str,
    pub nr: i64,
    pub args: [u64; 6],
    pub flags: u64,
    pub expect: u64,
}

impl Call {
    pub fn new(name: &'static str, nr: i64, args: &[u64]) -> Call {
        let mut a = [0u64; 6];
        a[..args.len()].copy_from_slice(args);
        Call {
            name,
            nr,
            args: a,
            flags: 0,
            expect: 0,
        }
    }

    /// The call must return `v`.
    pub fn expecting(mut self, v: u64) -> Call {
        self.flags |= EXPECT;
        self.expect = v;
        self
    }

    pub fn with(mut self, flags: u64) -> Call {
        self.flags |= flags;
        self
    }

    fn bytes(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.nr.to_ne_bytes());
        for a in self.args {
            out.extend_from_slice(&a.to_ne_bytes());
        }
        out.extend_from_slice(&self.flags.to_ne_bytes());
        out.extend_from_slice(&self.expect.to_ne_bytes());
    }
}

/// Where the loop and its table are in the process: `code` holds [`LOOP_CODE`] (executable),
/// `table` is `table_len` bytes of writable memory.
#[derive(Debug, Clone, Copy)]
pub struct BatchSite {
    pub code: u64,
    pub table: u64,
    pub table_len: u64,
}

/// The entry a batch stopped at, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stopped {
    pub index: usize,
    pub name: &'static str,
    /// The raw result: a negative errno, or a value other than the one expected.
    pub result: i64,
}

impl std::fmt::Display for Stopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if (-4095..0).contains(&self.result) {
            write!(
                f,
                "{} (call {} of the batch) failed: {}",
                self.name,
                self.index,
                std::io::Error::from_raw_os_error(-self.result as i32)
            )
        } else {
            write!(
                f,
                "{} (call {} of the batch) returned {:#x}, not the value expected",
                self.name, self.index, self.result
            )
        }
    }
}

impl Injector {
    /// Runs `calls` in order inside the thread, as many per injection as the table holds.
    /// `Ok(Err(stopped))` names the first call that failed (none after it ran). Only for a
    /// thread of a process Ferry builds (an injector made with [`Injector::new`]), whose loop
    /// code is already at `site.code`.
    pub fn run_batch(
        &self,
        site: BatchSite,
        calls: &[Call],
    ) -> Result<std::result::Result<(), Stopped>> {
        assert!(
            self.owned.is_none(),
            "run_batch is for processes Ferry builds, never for a live one"
        );
        self.batch_children.borrow_mut().clear();
        let per = (site.table_len / ENTRY_LEN).max(1) as usize;
        let mut kept = 0u64;
        let mut bytes = Vec::with_capacity(per * ENTRY_LEN as usize);
        for (n, chunk) in calls.chunks(per).enumerate() {
            bytes.clear();
            for c in chunk {
                c.bytes(&mut bytes);
            }
            self.mem
                .write_all(site.table, &bytes)
                .map_err(|e| self.sys(e))?;
            let mut r = self.base;
            r.rip = site.code;
            r.rbx = site.table;
            r.r12 = chunk.len() as u64;
            r.r13 = 0;
            r.r14 = kept;
            // No system call in progress for the kernel's restart logic.
            r.orig_rax = u64::MAX;
            ptrace::set_regs(self.tid, &r).map_err(|e| self.sys(e))?;
            ptrace::cont(self.tid, 0).map_err(|e| self.sys(e))?;
            self.at_syscall_stop.set(false);
            fault("batch");
            let out = self.wait_trap()?;
            let done = out.r13 as usize;
            if out.r12 != 0 || done != chunk.len() {
                let Some(c) = chunk.get(done) else {
                    return Err(InjectError::UnexpectedStop {
                        tid: self.tid,
                        call: "a batch of calls",
                        status: WaitStatus::Stopped {
                            sig: libc::SIGTRAP,
                            event: 0,
                        },
                    });
                };
                return Ok(Err(Stopped {
                    index: n * per + done,
                    name: c.name,
                    result: out.rax as i64,
                }));
            }
            kept = out.r14;
        }
        Ok(Ok(()))
    }

    /// Starts `calls` (at most one table of them) in the thread and returns at once:
    /// [`Injector::end_batch`] waits for the loop's end. Between the two, the thread runs on
    /// its own, so that several threads (of one process or of several) run their batches at
    /// the same time ([`run_batches`]).
    fn start_batch(&self, site: BatchSite, calls: &[Call], write_table: bool) -> Result<()> {
        assert!(
            self.owned.is_none(),
            "start_batch is for processes Ferry builds, never for a live one"
        );
        assert!(
            calls.len() as u64 * ENTRY_LEN <= site.table_len,
            "a batch started alongside others fits one table"
        );
        if write_table {
            let mut bytes = Vec::with_capacity(calls.len() * ENTRY_LEN as usize);
            for c in calls {
                c.bytes(&mut bytes);
            }
            self.mem
                .write_all(site.table, &bytes)
                .map_err(|e| self.sys(e))?;
        }
        let mut r = self.base;
        r.rip = site.code;
        r.rbx = site.table;
        r.r12 = calls.len() as u64;
        r.r13 = 0;
        r.r14 = 0;
        r.orig_rax = u64::MAX;
        ptrace::set_regs(self.tid, &r).map_err(|e| self.sys(e))?;
        ptrace::cont(self.tid, 0).map_err(|e| self.sys(e))?;
        self.at_syscall_stop.set(false);
        fault("batch");
        Ok(())
    }

    /// Waits for the end of a batch [`Injector::start_batch`] started.
    fn end_batch(&self, calls: &[Call]) -> Result<std::result::Result<(), Stopped>> {
        let out = self.wait_trap()?;
        let done = out.r13 as usize;
        if out.r12 == 0 && done == calls.len() {
            return Ok(Ok(()));
        }
        match calls.get(done) {
            Some(c) => Ok(Err(Stopped {
                index: done,
                name: c.name,
                result: out.rax as i64,
            })),
            None => Err(InjectError::UnexpectedStop {
                tid: self.tid,
                call: "a batch of calls",
                status: WaitStatus::Stopped {
                    sig: libc::SIGTRAP,
                    event: 0,
                },
            }),
        }
    }

    /// The processes or threads (our PIDs) that the clone3 calls of the last batch made, in
    /// the order they were made.
    pub fn take_batch_children(&self) -> Vec<i32> {
        std::mem::take(&mut *self.batch_children.borrow_mut())
    }

    /// Waits for the loop's `int3`; signals that reach the thread meanwhile (it has them all
    /// blocked, but SIGCHLD to a traced parent is still reported) are suppressed.
    fn wait_trap(&self) -> Result<ferry_sys::regs::GpRegs> {
        loop {
            let status = wait_tid(self.tid, false).map_err(|e| self.sys(e))?;
            match status {
                WaitStatus::Stopped {
                    sig: libc::SIGTRAP,
                    event: 0,
                } => return ptrace::get_regs(self.tid).map_err(|e| self.sys(e)),
                WaitStatus::Stopped { sig, event: 0 }
                    if [libc::SIGSEGV, libc::SIGBUS, libc::SIGILL, libc::SIGFPE].contains(&sig) =>
                {
                    return Err(InjectError::UnexpectedStop {
                        tid: self.tid,
                        call: "a batch of calls",
                        status,
                    })
                }
                // fork/clone events of a clone3 in the batch: the new process or thread is
                // stopped at its start (auto-attached) and never runs the loop itself.
                WaitStatus::Stopped { event, .. } if (1..=3).contains(&event) => {
                    let child = ptrace::get_event_msg(self.tid).map_err(|e| self.sys(e))?;
                    self.batch_children.borrow_mut().push(child as i32);
                    ptrace::cont(self.tid, 0).map_err(|e| self.sys(e))?;
                }
                WaitStatus::Stopped { sig, .. } if sig != libc::SIGKILL => {
                    log::debug!("thread {}: stopped by signal {sig} in a batch", self.tid);
                    ptrace::cont(self.tid, 0).map_err(|e| self.sys(e))?;
                }
                other => {
                    return Err(InjectError::UnexpectedStop {
                        tid: self.tid,
                        call: "a batch of calls",
                        status: other,
                    })
                }
            }
        }
    }
}

/// Runs a batch in each of several threads at once (of one process or of several Ferry
/// builds): every thread is started, then each is waited for, so that the threads' stops
/// overlap instead of following one another (one round of stops for them all, the calls
/// themselves spread over the CPUs). Each item's calls must fit its site's table; items that
/// share a table must carry the same calls (all threads of a process running the same
/// ones, say). The answer is each item's outcome, in order. A thread that was started is
/// always waited for, even after another failed.
pub fn run_batches(
    items: &[(&Injector, BatchSite, &[Call])],
) -> Result<Vec<std::result::Result<(), Stopped>>> {
    let mut started = 0;
    let mut first_err = None;
    // A table is written once (by the first item that uses it), never while a thread started
    // before reads it. Tables are per address space: the same address in two processes is
    // two tables.
    let mut written: Vec<(i32, u64)> = Vec::new();
    for (inj, site, calls) in items {
        inj.batch_children.borrow_mut().clear();
        if calls.is_empty() {
            started += 1;
            continue;
        }
        let table = (inj.pid, site.table);
        let write_table = !written.contains(&table);
        written.push(table);
        if let Err(e) = inj.start_batch(*site, calls, write_table) {
            first_err = Some(e);
            break;
        }
        started += 1;
    }
    let mut out = Vec::with_capacity(items.len());
    for (inj, _, calls) in &items[..started] {
        if calls.is_empty() {
            out.push(Ok(()));
            continue;
        }
        match inj.end_batch(calls) {
            Ok(r) => out.push(r),
            Err(e) => {
                first_err.get_or_insert(e);
                out.push(Ok(()));
            }
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(out),
    }
}
