//! A process being rebuilt: an idle process under the right PID, driven entirely from outside
//! with ptrace, until its address space, descriptors and threads are those of the image.
//!
//! The husk starts as a copy of ferry. Ferry maps a two-page trampoline into it (a `syscall`
//! instruction followed by `int3`, and a scratch page), unmaps everything else, and from then on
//! runs every system call the rebuild needs through the trampoline. The trampoline lies in a
//! gap of the image's address space and is unmapped last.

use crate::error::{Context, Error, Result};
use ferry_inject::batch::{BatchSite, Call};
use ferry_inject::{Injector, Site};
use ferry_sys::proc_mem::ProcMem;
use ferry_sys::ptrace;
use ferry_sys::wait::{wait_tid, WaitStatus};
use std::cell::Cell;
use std::os::fd::AsRawFd;

/// The trampoline: a code page (`syscall; int3`, then the batch loop at [`LOOP_AT`]), a scratch
/// page, and the table of a batch of calls (`ferry_inject::batch`).
pub const TRAMPOLINE_LEN: u64 = (2 + TABLE_PAGES + DATA_PAGES) * ferry_sys::PAGE_SIZE;
const TABLE_PAGES: u64 = 64;
/// After the table: what a batch's calls point to (clone3's arguments).
const DATA_PAGES: u64 = 32;
/// Threads made by one batch of clone3 calls at most (their arguments fit the data pages).
const THREADS_PER_BATCH: usize = 512;
const TRAMPOLINE_CODE: [u8; 3] = [0x0f, 0x05, 0xcc];
const LOOP_AT: u64 = 16;
const CLONE_VM: u64 = 0x100;
const CLONE_FS: u64 = 0x200;
const CLONE_FILES: u64 = 0x400;
const CLONE_SIGHAND: u64 = 0x800;
const CLONE_THREAD: u64 = 0x10000;
const CLONE_SYSVSEM: u64 = 0x40000;
const SYS_CLOSE_RANGE: i64 = 436;
const SYS_CLONE3: i64 = 435;
const SYS_PIDFD_GETFD: i64 = 438;
const SYS_PIDFD_OPEN: i64 = 434;

pub struct Husk {
    /// The PID as the tree sees it (the image's): the number injected calls inside the tree
    /// use (setpgid, rt_sigqueueinfo ...).
    pub pid: i32,
    /// The PID in our namespace, for ptrace, /proc and process_vm_*: the same as `pid` unless
    /// the tree is rebuilt in a guest PID namespace.
    pub host: i32,
    inj: Injector,
    mem: ProcMem,
    trampoline: u64,
    /// The husk's pidfd of ferry (at `spare_fd`), through which it takes copies of ferry's
    /// descriptors. Inherited from its creation on: a husk in a guest PID namespace could not
    /// name ferry by PID.
    ferry_pidfd: Cell<Option<i32>>,
    /// A descriptor number above every one the image uses, for the husk's pidfd of ferry.
    spare_fd: i32,
}

/// Where a root husk is made.
#[derive(Clone, Copy)]
pub enum Place<'a> {
    /// In our own namespaces.
    Here,
    /// In guest namespaces; `helper_pid` is a PID free there (and not in the image) for the
    /// launcher that makes the root inside them.
    Guest {
        ns: &'a crate::guest_ns::GuestNamespaces,
        helper_pid: i32,
    },
}

fn stop_new(pid: i32, tid: i32) -> Result<ferry_sys::regs::GpRegs> {
    loop {
        match wait_tid(tid, false).ctx(pid, || format!("wait for new thread {tid}"))? {
            WaitStatus::Stopped {
                event: ptrace::PTRACE_EVENT_STOP,
                ..
            } => break,
            WaitStatus::Stopped { .. } => {
                ptrace::cont(tid, 0).ctx(pid, || format!("resume new thread {tid}"))?
            }
            other => {
                return Err(Error::Restore {
                    pid,
                    what: format!("new thread {tid} did not start: {other:?}"),
                })
            }
        }
    }
    ptrace::set_sigmask(tid, u64::MAX).ctx(pid, || format!("block signals of thread {tid}"))?;
    ptrace::get_regs(tid).ctx(pid, || format!("read registers of new thread {tid}"))
}

impl Husk {
    /// Creates the root of a rebuilt tree: PID `pid` (in the guest namespace when `place` says
    /// so), adopted by our subreaper or init (by the guest's init in a guest), with nothing but
    /// the trampoline at `trampoline` in its address space and `ferry_pidfd` (a pidfd of this
    /// process, which the new process inherits) at descriptor `spare_fd`.
    pub fn spawn_root(
        pid: i32,
        trampoline: u64,
        spare_fd: i32,
        ferry_pidfd: &impl AsRawFd,
        place: Place<'_>,
    ) -> Result<Husk> {
        let made = match place {
            Place::Here => ferry_sys::clone3::spawn_idle_with_pid(pid),
            Place::Guest { ns, helper_pid } => {
                ferry_sys::clone3::spawn_idle_in_guest(ns.pidfd().as_raw_fd(), pid, helper_pid)
            }
        };
        made.map_err(|e| {
            if e.errno == libc::EEXIST && e.op == "clone3(set_tid)" {
                Error::PidTaken {
                    pid,
                    by: match place {
                        Place::Here => crate::restore::describe_pid(pid),
                        Place::Guest { .. } => "by another process of the guest namespace".into(),
                    },
                }
            } else {
                Error::Restore {
                    pid,
                    what: format!("create the process: {e}"),
                }
            }
        })?;
        let host = match place {
            Place::Here => pid,
            Place::Guest { ns, .. } => ns.host_pid(pid)?,
        };
        // From here on, a failure must not leave the new process behind.
        let taken = (|| -> Result<Husk> {
            // Seccomp filters, installed last, must not apply to the calls injected after them.
            let opts = ptrace::PTRACE_O_TRACECLONE
                | ptrace::PTRACE_O_TRACEFORK
                | ptrace::PTRACE_O_EXITKILL
                | ptrace::PTRACE_O_SUSPEND_SECCOMP
                | ptrace::PTRACE_O_TRACESYSGOOD;
            ptrace::seize(host, opts).ctx(pid, || {
                format!("attach to the new process (host PID {host})")
            })?;
            ptrace::interrupt(host).ctx(pid, || "stop the new process".into())?;
            let regs = stop_new(pid, host)?;
            let syscall_at = ferry_inject::find_syscall_insn(host)?;
            let scratch = (regs.rsp - 8192) & !15;
            let inj = Injector::new(
                host,
                host,
                regs,
                Site {
                    syscall_at,
                    scratch,
                    scratch_len: 4096,
                },
            )?;
            let mem = ProcMem::open(host).ctx(pid, || "open /proc/PID/mem".into())?;
            let mut h = Husk {
                pid,
                host,
                inj,
                mem,
                trampoline,
                ferry_pidfd: Cell::new(None),
                spare_fd,
            };
            h.clear_out(ferry_pidfd.as_raw_fd())?;
            Ok(h)
        })();
        if taken.is_err() {
            let _ = ptrace::kill(host, libc::SIGKILL);
        }
        taken
    }

    /// Takes over an existing process as the husk of tree process `pid` (this namespace's PID):
    /// the deputy of a tree coming home (ferry_deputy), which keeps its PID, its parent, its
    /// process group, session and controlling terminal. The deputies' tracer let it go parked
    /// in `pause()` with every signal blocked and no thread but its main one; here it is seized
    /// and cleared out like a new husk (the trampoline at `trampoline` its only mapping, and
    /// no descriptor but a pidfd of this process at `spare_fd`). On failure it is killed: what
    /// it was is gone already (its parent sees SIGKILL).
    pub fn adopt(pid: i32, trampoline: u64, spare_fd: i32) -> Result<Husk> {
        let taken = (|| -> Result<Husk> {
            let opts = ptrace::PTRACE_O_TRACECLONE
                | ptrace::PTRACE_O_TRACEFORK
                | ptrace::PTRACE_O_EXITKILL
                | ptrace::PTRACE_O_SUSPEND_SECCOMP
                | ptrace::PTRACE_O_TRACESYSGOOD;
            ptrace::seize(pid, opts).ctx(pid, || "take over its deputy".into())?;
            ptrace::interrupt(pid).ctx(pid, || "stop its deputy".into())?;
            let regs = stop_new(pid, pid)?;
            let others: Vec<i32> = crate::procfs::tids(pid)?
                .into_iter()
                .filter(|&t| t != pid)
                .collect();
            if !others.is_empty() {
                return Err(Error::Restore {
                    pid,
                    what: format!("its deputy still has threads {others:?}"),
                });
            }
            let syscall_at = ferry_inject::find_syscall_insn(pid)?;
            let inj = Injector::new(
                pid,
                pid,
                regs,
                Site {
                    syscall_at,
                    scratch: 0,
                    scratch_len: 0,
                },
            )?;
            let mem = ProcMem::open(pid).ctx(pid, || "open /proc/PID/mem".into())?;
            let me = ferry_sys::ns::getpid();
            // A pidfd of ferry, made inside: the deputy was not born holding one.
            let ferry_fd = inj.syscall("pidfd_open(ferry)", SYS_PIDFD_OPEN, &[me as u64, 0])?;
            let mut h = Husk {
                pid,
                host: pid,
                inj,
                mem,
                trampoline,
                ferry_pidfd: Cell::new(None),
                spare_fd,
            };
            h.clear_out(ferry_fd as i32)?;
            Ok(h)
        })();
        if taken.is_err() {
            let _ = ptrace::kill(pid, libc::SIGKILL);
        }
        taken
    }

    /// Leaves only the trampoline in the address space and no descriptors open but the
    /// inherited pidfd of ferry `ferry_fd`, moved to the spare descriptor.
    fn clear_out(&mut self, ferry_fd: i32) -> Result<()> {
        let t = self.trampoline;
        let pid = self.pid;
        let host = self.host;
        let flags = (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE) as u64;
        let prot = (libc::PROT_READ | libc::PROT_WRITE) as u64;
        let got = self
            .inj
            .syscall(
                "mmap(trampoline)",
                libc::SYS_mmap,
                &[t, TRAMPOLINE_LEN, prot, flags, u64::MAX, 0],
            )
            .map_err(|e| Error::Restore {
                pid,
                what: format!("map the restore trampoline at {t:x}: {e}"),
            })?;
        if got != t {
            return Err(Error::Restore {
                pid,
                what: format!("trampoline landed at {got:x}, not {t:x}"),
            });
        }
        // The code page is never writable from inside (a deputy taken over may have
        // memory-deny-write-execute, PR_SET_MDWE, which refuses writable code): executable,
        // read-only, and written through /proc/PID/mem.
        self.inj
            .syscall(
                "mmap(trampoline code)",
                libc::SYS_mmap,
                &[
                    t,
                    ferry_sys::PAGE_SIZE,
                    (libc::PROT_READ | libc::PROT_EXEC) as u64,
                    (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED) as u64,
                    u64::MAX,
                    0,
                ],
            )
            .map_err(|e| Error::Restore {
                pid,
                what: format!("map the restore trampoline's code at {t:x}: {e}"),
            })?;
        self.mem
            .write_all(t, &TRAMPOLINE_CODE)
            .and_then(|()| {
                self.mem
                    .write_all(t + LOOP_AT, &ferry_inject::batch::LOOP_CODE)
            })
            .ctx(pid, || "write the trampoline".into())?;
        self.inj.set_site(Site {
            syscall_at: t,
            scratch: t + ferry_sys::PAGE_SIZE,
            scratch_len: ferry_sys::PAGE_SIZE,
        });
        let spare = self.spare_fd as u64;
        if ferry_fd != self.spare_fd {
            self.inj.syscall(
                "dup3(pidfd of ferry)",
                libc::SYS_dup3,
                &[ferry_fd as u64, spare, libc::O_CLOEXEC as u64],
            )?;
        }
        self.ferry_pidfd.set(Some(self.spare_fd));
        if spare > 0 {
            self.inj
                .syscall("close_range", SYS_CLOSE_RANGE, &[0, spare - 1, 0])?;
        }
        self.inj.syscall(
            "close_range",
            SYS_CLOSE_RANGE,
            &[spare + 1, u32::MAX as u64, 0],
        )?;
        // The copy of ferry has glibc's rseq area registered; the kernel would fault the husk
        // as soon as that memory is gone.
        if let Ok((addr, len, sig)) = ptrace::get_rseq(host) {
            if addr != 0 {
                self.inj.syscall(
                    "rseq(unregister)",
                    libc::SYS_rseq,
                    &[addr, len as u64, 1, sig as u64],
                )?;
            }
        }
        let unmap: Vec<Call> = crate::procfs::smaps(host)?
            .into_iter()
            .filter(|m| !(t..t + TRAMPOLINE_LEN).contains(&m.start) && m.name != "[vsyscall]")
            .map(|m| Call::new("munmap", libc::SYS_munmap, &[m.start, m.end - m.start]))
            .collect();
        self.batch(&unmap, |i| {
            format!("clear the new process's address space (call {i})")
        })
    }

    /// Where batches of calls run: the loop in the trampoline's code page, the table after its
    /// scratch page.
    pub fn batch_site(&self) -> BatchSite {
        BatchSite {
            code: self.trampoline + LOOP_AT,
            table: self.trampoline + 2 * ferry_sys::PAGE_SIZE,
            table_len: TABLE_PAGES * ferry_sys::PAGE_SIZE,
        }
    }

    /// Runs `calls` in the husk with as few injections as the table allows
    /// (`ferry_inject::batch`); the first that fails stops the rest, and the error says what it
    /// was for (`what` of its index).
    pub fn batch(&self, calls: &[Call], what: impl Fn(usize) -> String) -> Result<()> {
        if calls.is_empty() {
            return Ok(());
        }
        match self.inj.run_batch(self.batch_site(), calls)? {
            Ok(()) => Ok(()),
            Err(stopped) => Err(Error::Restore {
                pid: self.pid,
                what: format!("{}: {stopped}", what(stopped.index)),
            }),
        }
    }

    /// Slot `k` of the table split into slots of `slot_len` bytes: where one of several
    /// threads of the husk runs its own batch while the others run theirs
    /// (`ferry_inject::batch::run_batches`). `None` past the table's end.
    pub fn batch_slot(&self, k: usize, slot_len: u64) -> Option<BatchSite> {
        let site = self.batch_site();
        let at = (k as u64).checked_mul(slot_len)?;
        (at.checked_add(slot_len)? <= site.table_len).then_some(BatchSite {
            code: site.code,
            table: site.table + at,
            table_len: slot_len,
        })
    }

    /// Writes `bytes` at offset `off` of the data pages after the batch table (what a batch's
    /// calls point to), and returns their address in the husk.
    pub fn write_data(&self, off: u64, bytes: &[u8]) -> Result<u64> {
        let site = self.batch_site();
        let len = DATA_PAGES * ferry_sys::PAGE_SIZE;
        if off.saturating_add(bytes.len() as u64) > len {
            return Err(Error::Restore {
                pid: self.pid,
                what: format!(
                    "{} bytes at offset {off} do not fit the trampoline's {len}-byte data area",
                    bytes.len()
                ),
            });
        }
        let at = site.table + site.table_len + off;
        self.mem.write_all(at, bytes).ctx(self.pid, || {
            "write a batch's data into the trampoline".into()
        })?;
        Ok(at)
    }

    /// The addresses the trampoline takes, `[start, end)`.
    pub fn trampoline_range(&self) -> (u64, u64) {
        (self.trampoline, self.trampoline + TRAMPOLINE_LEN)
    }

    /// An address just past the trampoline: it lies in a gap of the image's address space
    /// (`restore::choose_trampoline`), a place to ask for temporary mappings.
    pub fn spare_area(&self) -> u64 {
        self.trampoline + TRAMPOLINE_LEN + (1 << 20)
    }

    pub fn injector(&self) -> &Injector {
        &self.inj
    }

    pub fn mem(&self) -> &ProcMem {
        &self.mem
    }

    /// Forks a child husk with PID `pid` (its address space: the trampoline only; its
    /// descriptors: the pidfd of ferry).
    pub fn fork_child(&self, pid: i32, exit_signal: i32) -> Result<Husk> {
        self.fork_child_sharing(pid, exit_signal, false)
    }

    /// [`Husk::fork_child`], the child sharing this husk's descriptor table when
    /// `share_files` (CLONE_FILES): its descriptors are then this husk's, installed by it.
    pub fn fork_child_sharing(
        &self,
        pid: i32,
        exit_signal: i32,
        share_files: bool,
    ) -> Result<Husk> {
        let tid_addr = self.inj.write_scratch(512, &pid.to_ne_bytes())?;
        let args = ferry_sys::clone3::CloneArgs {
            flags: if share_files { CLONE_FILES } else { 0 },
            exit_signal: exit_signal as u64,
            set_tid: tid_addr,
            set_tid_size: 1,
            ..Default::default()
        };
        let host = self.clone3(pid, &args)?;
        let taken = (|| -> Result<Husk> {
            let regs = stop_new(pid, host)?;
            let inj = Injector::new(host, host, regs, self.inj.site())?;
            let mem = ProcMem::open(host).ctx(pid, || "open /proc/PID/mem".into())?;
            Ok(Husk {
                pid,
                host,
                inj,
                mem,
                trampoline: self.trampoline,
                ferry_pidfd: Cell::new(self.ferry_pidfd.get()),
                spare_fd: self.spare_fd,
            })
        })();
        if taken.is_err() {
            // Not a husk of the tree yet: nobody else would kill it.
            let _ = ptrace::kill(host, libc::SIGKILL);
        }
        taken
    }

    /// Runs clone3 in the husk for a process or thread that is to be `want` in the tree's
    /// namespace; returns its PID in ours (which the tracer learns from the fork event).
    fn clone3(&self, want: i32, args: &ferry_sys::clone3::CloneArgs) -> Result<i32> {
        let bytes = args.to_bytes();
        let a = self.inj.write_scratch(0, &bytes)?;
        let got = self
            .inj
            .syscall_raw("clone3", SYS_CLONE3, &[a, bytes.len() as u64])?;
        if got == -(libc::EEXIST as i64) {
            return Err(Error::PidTaken {
                pid: want,
                by: crate::restore::describe_pid(want),
            });
        }
        if got < 0 {
            return Err(Error::Restore {
                pid: self.pid,
                what: format!(
                    "clone3 for {want}: {}",
                    std::io::Error::from_raw_os_error(-got as i32)
                ),
            });
        }
        if got as i32 != want {
            return Err(Error::Restore {
                pid: self.pid,
                what: format!("clone3 made {got}, not {want}"),
            });
        }
        self.inj.take_new_child().ok_or_else(|| Error::Restore {
            pid: self.pid,
            what: format!("clone3 made {want}, but no fork or clone event reported it"),
        })
    }

    /// Adds threads `tids` (the tree's numbers) to the process, by batches of clone3 calls;
    /// returns, for each, its TID in our namespace and an injector for it.
    pub fn create_threads(&self, tids: &[i32]) -> Result<Vec<(i32, Injector)>> {
        let flags =
            CLONE_VM | CLONE_FS | CLONE_FILES | CLONE_SIGHAND | CLONE_THREAD | CLONE_SYSVSEM;
        let site = self.batch_site();
        let data = site.table + site.table_len;
        let mut out = Vec::with_capacity(tids.len());
        for group in tids.chunks(THREADS_PER_BATCH) {
            // Each thread's clone_args, followed by the TID it is to have.
            let mut bytes = Vec::new();
            let mut calls = Vec::with_capacity(group.len());
            for &tid in group {
                let at = data + bytes.len() as u64;
                let args = ferry_sys::clone3::CloneArgs {
                    flags,
                    set_tid: 0,
                    set_tid_size: 1,
                    ..Default::default()
                };
                let len = args.to_bytes().len() as u64;
                let args = ferry_sys::clone3::CloneArgs {
                    set_tid: at + len,
                    ..args
                };
                bytes.extend_from_slice(&args.to_bytes());
                bytes.extend_from_slice(&(tid as u64).to_ne_bytes());
                calls.push(Call::new("clone3", SYS_CLONE3, &[at, len]).expecting(tid as u64));
            }
            if bytes.len() as u64 > DATA_PAGES * ferry_sys::PAGE_SIZE {
                return Err(Error::Restore {
                    pid: self.pid,
                    what: "the threads' clone3 arguments do not fit the trampoline".into(),
                });
            }
            self.mem
                .write_all(data, &bytes)
                .ctx(self.pid, || "write clone3 arguments".into())?;
            let r = self.inj.run_batch(site, &calls)?;
            let made = self.inj.take_batch_children();
            // Threads made before a failure are stopped at their start and die with the husk.
            if let Err(stopped) = r {
                let want = group[stopped.index.min(group.len() - 1)];
                if stopped.result == -(libc::EEXIST as i64) {
                    return Err(Error::PidTaken {
                        pid: want,
                        by: crate::restore::describe_pid(want),
                    });
                }
                return Err(Error::Restore {
                    pid: self.pid,
                    what: format!("create thread {want}: {stopped}"),
                });
            }
            if made.len() != group.len() {
                return Err(Error::Restore {
                    pid: self.pid,
                    what: format!(
                        "{} clone3 calls reported {} new threads",
                        group.len(),
                        made.len()
                    ),
                });
            }
            for host in made {
                let regs = stop_new(self.pid, host)?;
                out.push((host, Injector::new(self.host, host, regs, self.inj.site())?));
            }
        }
        Ok(out)
    }

    /// Gives the husk a copy of one of our descriptors, sharing its open file description: at
    /// number `at` (with close-on-exec as given), or at the lowest free number.
    pub fn install_fd(&self, fd: &impl AsRawFd, at: Option<(i32, bool)>) -> Result<i32> {
        let pidfd = self.ferry_pidfd.get().ok_or_else(|| Error::Restore {
            pid: self.pid,
            what: "the husk's pidfd of ferry is already closed".into(),
        })?;
        let tmp = self.inj.syscall(
            "pidfd_getfd",
            SYS_PIDFD_GETFD,
            &[pidfd as u64, fd.as_raw_fd() as u64, 0],
        )? as i32;
        let Some((n, cloexec)) = at else {
            return Ok(tmp);
        };
        if tmp == n {
            self.inj.syscall(
                "fcntl(F_SETFD)",
                libc::SYS_fcntl,
                &[
                    n as u64,
                    libc::F_SETFD as u64,
                    if cloexec { libc::FD_CLOEXEC as u64 } else { 0 },
                ],
            )?;
        } else {
            self.inj.syscall(
                "dup3",
                libc::SYS_dup3,
                &[
                    tmp as u64,
                    n as u64,
                    if cloexec { libc::O_CLOEXEC as u64 } else { 0 },
                ],
            )?;
            self.inj.syscall("close", libc::SYS_close, &[tmp as u64])?;
        }
        Ok(n)
    }

    /// The husk's descriptor number of its pidfd of ferry, while it has one.
    pub fn ferry_pidfd(&self) -> Option<i32> {
        self.ferry_pidfd.get()
    }

    /// Forgets the husk's handle on ferry without closing it: for a husk that shares its
    /// parent's descriptor table, where the parent closes it.
    pub fn forget_ferry_pidfd(&self) {
        self.ferry_pidfd.take();
    }

    /// The call that closes the husk's handle on ferry, for a batch (forgotten here at once:
    /// the batch must run).
    pub fn drop_ferry_pidfd_call(&self) -> Option<Call> {
        self.ferry_pidfd
            .take()
            .map(|p| Call::new("close(pidfd of ferry)", libc::SYS_close, &[p as u64]))
    }

    /// Closes the husk's handle on ferry.
    pub fn drop_ferry_pidfd(&self) -> Result<()> {
        if let Some(p) = self.ferry_pidfd.take() {
            self.inj.syscall("close", libc::SYS_close, &[p as u64])?;
        }
        Ok(())
    }

    /// Unmaps the trampoline: the last injected call. The caller sets final registers next.
    pub fn remove_trampoline(&self) -> Result<()> {
        self.inj.syscall(
            "munmap(trampoline)",
            libc::SYS_munmap,
            &[self.trampoline, TRAMPOLINE_LEN],
        )?;
        Ok(())
    }

    pub fn kill(&self) {
        let _ = ptrace::kill(self.host, libc::SIGKILL);
    }
}
