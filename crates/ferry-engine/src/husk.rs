//! A process being rebuilt: an idle process under the right PID, driven entirely from outside
//! with ptrace, until its address space, descriptors and threads are those of the image.
//!
//! The husk starts as a copy of ferry. Ferry maps a two-page trampoline into it (a `syscall`
//! instruction followed by `int3`, and a scratch page), unmaps everything else, and from then on
//! runs every system call the rebuild needs through the trampoline. The trampoline lies in a
//! gap of the image's address space and is unmapped last.

use crate::error::{Context, Error, Result};
use ferry_inject::{Injector, Site};
use ferry_sys::proc_mem::ProcMem;
use ferry_sys::ptrace;
use ferry_sys::wait::{wait_tid, WaitStatus};
use std::cell::Cell;
use std::os::fd::AsRawFd;

pub const TRAMPOLINE_LEN: u64 = 2 * ferry_sys::PAGE_SIZE;
const TRAMPOLINE_CODE: [u8; 3] = [0x0f, 0x05, 0xcc];
const CLONE_VM: u64 = 0x100;
const CLONE_FS: u64 = 0x200;
const CLONE_FILES: u64 = 0x400;
const CLONE_SIGHAND: u64 = 0x800;
const CLONE_THREAD: u64 = 0x10000;
const CLONE_SYSVSEM: u64 = 0x40000;
const SYS_CLOSE_RANGE: i64 = 436;
const SYS_CLONE3: i64 = 435;
const SYS_PIDFD_OPEN: i64 = 434;
const SYS_PIDFD_GETFD: i64 = 438;

pub struct Husk {
    pub pid: i32,
    inj: Injector,
    mem: ProcMem,
    trampoline: u64,
    ferry_pidfd: Cell<Option<i32>>,
    /// A descriptor number above every one the image uses, for the husk's pidfd of ferry.
    spare_fd: i32,
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
    /// Creates the root of a rebuilt tree: PID `pid`, adopted by our subreaper or init, with
    /// nothing but the trampoline at `trampoline` in its address space.
    pub fn spawn_root(pid: i32, trampoline: u64, spare_fd: i32) -> Result<Husk> {
        ferry_sys::clone3::spawn_idle_with_pid(pid).map_err(|e| {
            if e.errno == libc::EEXIST {
                Error::PidTaken {
                    pid,
                    by: crate::restore::describe_pid(pid),
                }
            } else {
                Error::Restore {
                    pid,
                    what: format!("create the process: {e}"),
                }
            }
        })?;
        let opts =
            ptrace::PTRACE_O_TRACECLONE | ptrace::PTRACE_O_TRACEFORK | ptrace::PTRACE_O_EXITKILL;
        ptrace::seize(pid, opts).ctx(pid, || "attach to the new process".into())?;
        ptrace::interrupt(pid).ctx(pid, || "stop the new process".into())?;
        let regs = stop_new(pid, pid)?;
        let syscall_at = ferry_inject::find_syscall_insn(pid)?;
        let scratch = (regs.rsp - 8192) & !15;
        let inj = Injector::new(
            pid,
            pid,
            regs,
            Site {
                syscall_at,
                scratch,
                scratch_len: 4096,
            },
        )?;
        let mem = ProcMem::open(pid).ctx(pid, || "open /proc/PID/mem".into())?;
        let mut h = Husk {
            pid,
            inj,
            mem,
            trampoline,
            ferry_pidfd: Cell::new(None),
            spare_fd,
        };
        h.clear_out()?;
        Ok(h)
    }

    /// Leaves only the trampoline in the address space and no descriptors open.
    fn clear_out(&mut self) -> Result<()> {
        let t = self.trampoline;
        let pid = self.pid;
        let flags = (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE) as u64;
        let prot = (libc::PROT_READ | libc::PROT_WRITE | libc::PROT_EXEC) as u64;
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
        self.mem
            .write_all(t, &TRAMPOLINE_CODE)
            .ctx(pid, || "write the trampoline".into())?;
        self.inj.set_site(Site {
            syscall_at: t,
            scratch: t + ferry_sys::PAGE_SIZE,
            scratch_len: ferry_sys::PAGE_SIZE,
        });
        self.inj
            .syscall("close_range", SYS_CLOSE_RANGE, &[0, u32::MAX as u64, 0])?;
        // The copy of ferry has glibc's rseq area registered; the kernel would fault the husk
        // as soon as that memory is gone.
        if let Ok((addr, len, sig)) = ptrace::get_rseq(pid) {
            if addr != 0 {
                self.inj.syscall(
                    "rseq(unregister)",
                    libc::SYS_rseq,
                    &[addr, len as u64, 1, sig as u64],
                )?;
            }
        }
        for m in crate::procfs::smaps(pid)? {
            if m.start == t || m.name == "[vsyscall]" {
                continue;
            }
            self.inj
                .syscall("munmap", libc::SYS_munmap, &[m.start, m.end - m.start])?;
        }
        Ok(())
    }

    pub fn injector(&self) -> &Injector {
        &self.inj
    }

    pub fn mem(&self) -> &ProcMem {
        &self.mem
    }

    /// Forks a child husk with PID `pid` (its address space: the trampoline only).
    pub fn fork_child(&self, pid: i32, exit_signal: i32) -> Result<Husk> {
        let tid_addr = self.inj.write_scratch(512, &pid.to_ne_bytes())?;
        let args = ferry_sys::clone3::CloneArgs {
            exit_signal: exit_signal as u64,
            set_tid: tid_addr,
            set_tid_size: 1,
            ..Default::default()
        };
        let got = self.clone3(pid, &args)?;
        let regs = stop_new(pid, got)?;
        let inj = Injector::new(pid, pid, regs, self.inj.site())?;
        let mem = ProcMem::open(pid).ctx(pid, || "open /proc/PID/mem".into())?;
        Ok(Husk {
            pid,
            inj,
            mem,
            trampoline: self.trampoline,
            ferry_pidfd: Cell::new(None),
            spare_fd: self.spare_fd,
        })
    }

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
        Ok(want)
    }

    /// Adds thread `tid` to the process; returns an injector for it.
    pub fn create_thread(&self, tid: i32) -> Result<Injector> {
        let tid_addr = self.inj.write_scratch(512, &tid.to_ne_bytes())?;
        let flags =
            CLONE_VM | CLONE_FS | CLONE_FILES | CLONE_SIGHAND | CLONE_THREAD | CLONE_SYSVSEM;
        let args = ferry_sys::clone3::CloneArgs {
            flags,
            set_tid: tid_addr,
            set_tid_size: 1,
            ..Default::default()
        };
        self.clone3(tid, &args)?;
        let regs = stop_new(self.pid, tid)?;
        Ok(Injector::new(self.pid, tid, regs, self.inj.site())?)
    }

    /// Gives the husk a copy of one of our descriptors, sharing its open file description: at
    /// number `at` (with close-on-exec as given), or at the lowest free number.
    pub fn install_fd(&self, fd: &impl AsRawFd, at: Option<(i32, bool)>) -> Result<i32> {
        let pidfd = match self.ferry_pidfd.get() {
            Some(p) => p,
            None => {
                let p = self.inj.syscall(
                    "pidfd_open",
                    SYS_PIDFD_OPEN,
                    &[std::process::id() as u64, 0],
                )?;
                self.inj.syscall(
                    "dup3",
                    libc::SYS_dup3,
                    &[p, self.spare_fd as u64, libc::O_CLOEXEC as u64],
                )?;
                self.inj.syscall("close", libc::SYS_close, &[p])?;
                self.ferry_pidfd.set(Some(self.spare_fd));
                self.spare_fd
            }
        };
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
        let _ = ptrace::kill(self.pid, libc::SIGKILL);
    }
}
