//! Seccomp filters (mode 2): classic BPF programs stacked on a thread.
//!
//! - **capture**: PTRACE_SECCOMP_GET_FILTER and _GET_METADATA read each filter of each thread,
//!   newest first. Every thread must have the same stack (what SECCOMP_FILTER_FLAG_TSYNC
//!   makes, and what threads created after the filters inherit); a filter that hands system
//!   calls to a user-space supervisor (SECCOMP_RET_USER_NOTIF) is refused: its listener is
//!   not part of the tree.
//! - **restore**: the filters are installed last, once the process is complete and its
//!   trampoline gone ([`crate::late`]), oldest first, each with TSYNC so that every thread gets
//!   it, by the process itself (which needs no_new_privs or CAP_SYS_ADMIN, as the original
//!   did).
//!
//! While ferry traces a process, to capture or to rebuild it, its filters are suspended
//! (PTRACE_O_SUSPEND_SECCOMP, set when its threads are seized): they must neither refuse nor
//! punish the calls ferry injects. They act again once ferry lets the process go.

use crate::error::{Error, Result};
use ferry_image::{Process, SeccompFilter};
use ferry_sys::ptrace;

const SECCOMP_SET_MODE_FILTER: u64 = 1;
const SECCOMP_FILTER_FLAG_TSYNC: u64 = 1;
/// The flags a filter keeps that matter to what it does (LOG, SPEC_ALLOW).
const KEPT_FLAGS: u64 = 2 | 4;
const SECCOMP_RET_ACTION_FULL: u32 = 0xffff_0000;
const SECCOMP_RET_USER_NOTIF: u32 = 0x7fc0_0000;
/// BPF_RET | BPF_K
const BPF_RET_K: u16 = 0x06;
/// The most filters a thread can have: the kernel's limit is on their total size.
const MAX_FILTERS: u64 = 512;

/// The filters of thread `tid`, oldest first.
fn filters_of(pid: i32, tid: i32) -> Result<Vec<SeccompFilter>> {
    let mut out = Vec::new();
    for index in 0..MAX_FILTERS {
        let fail = |e: ferry_sys::SysError| Error::Sys {
            pid,
            what: format!("thread {tid}: read seccomp filter {index}"),
            source: e,
        };
        let Some(program) = ptrace::seccomp_filter(tid, index).map_err(fail)? else {
            break;
        };
        let flags = ptrace::seccomp_filter_flags(tid, index).map_err(fail)?;
        out.push(SeccompFilter { program, flags });
    }
    out.reverse();
    Ok(out)
}

/// Records the seccomp filters of frozen process `pid` (whose threads are `tids`).
pub fn capture(pid: i32, tids: &[i32], p: &mut Process) -> Result<()> {
    let status = crate::procfs::status(pid)?;
    if crate::procfs::field(&status, "Seccomp").trim() != "2" {
        return Ok(());
    }
    let refuse = |why: String| Error::Unsupported {
        pid,
        what: "seccomp filters".into(),
        why,
    };
    let first = filters_of(pid, tids[0])?;
    for &tid in &tids[1..] {
        if filters_of(pid, tid)? != first {
            return Err(refuse(format!(
                "thread {tid} has other filters than thread {} (only filters shared by every \
                 thread, as SECCOMP_FILTER_FLAG_TSYNC makes them, can be rebuilt)",
                tids[0]
            )));
        }
    }
    for f in &first {
        let user_notif = f.program.chunks_exact(8).any(|i| {
            let code = u16::from_ne_bytes([i[0], i[1]]);
            let k = u32::from_ne_bytes([i[4], i[5], i[6], i[7]]);
            code == BPF_RET_K && k & SECCOMP_RET_ACTION_FULL == SECCOMP_RET_USER_NOTIF
        });
        if user_notif {
            return Err(refuse(
                "a filter hands system calls to a user-space supervisor (SECCOMP_RET_USER_NOTIF), \
                 whose listener is not part of the tree"
                    .into(),
            ));
        }
    }
    p.seccomp = first;
    Ok(())
}

/// Installs `p`'s filters in the rebuilt, stopped process (`host` here), oldest first.
pub fn restore(p: &Process, host: i32) -> Result<()> {
    if p.seccomp.is_empty() {
        return Ok(());
    }
    let total: usize = p.seccomp.iter().map(|f| f.program.len()).sum();
    let len = (total + 16 * p.seccomp.len()).next_multiple_of(4096) as u64;
    crate::late::with_injector(p.pid, host, "install seccomp filters", |inj| {
        // The programs and their headers go in a mapping of their own (they may not fit in
        // the scratch space), made before the first filter and removed after the last.
        let flags = (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS) as u64;
        let rw = (libc::PROT_READ | libc::PROT_WRITE) as u64;
        let area = inj.syscall("mmap", libc::SYS_mmap, &[0, len, rw, flags, u64::MAX, 0])?;
        let mem = ferry_sys::proc_mem::ProcMem::open(host).map_err(|e| Error::Sys {
            pid: p.pid,
            what: "open its memory to write seccomp filters".into(),
            source: e,
        })?;
        let mut at = area;
        let mut progs = Vec::new();
        for f in &p.seccomp {
            // struct sock_fprog { unsigned short len; struct sock_filter *filter; }
            let mut head = [0u8; 16];
            head[0..2].copy_from_slice(&((f.program.len() / 8) as u16).to_ne_bytes());
            head[8..16].copy_from_slice(&(at + 16).to_ne_bytes());
            let write = |addr: u64, bytes: &[u8]| {
                mem.write_all(addr, bytes).map_err(|e| Error::Sys {
                    pid: p.pid,
                    what: format!("write a seccomp filter at {addr:x}"),
                    source: e,
                })
            };
            write(at, &head)?;
            write(at + 16, &f.program)?;
            progs.push((at, f.flags));
            at += 16 + f.program.len() as u64;
        }
        let mut installed = Ok(());
        for (i, (prog, flags)) in progs.into_iter().enumerate() {
            let flags = (flags & KEPT_FLAGS) | SECCOMP_FILTER_FLAG_TSYNC;
            let r = inj.syscall_raw(
                "seccomp(SECCOMP_SET_MODE_FILTER)",
                libc::SYS_seccomp,
                &[SECCOMP_SET_MODE_FILTER, flags, prog],
            )?;
            if r != 0 {
                installed = Err(Error::Restore {
                    pid: p.pid,
                    what: format!(
                        "install seccomp filter {} of {}: {}",
                        i + 1,
                        p.seccomp.len(),
                        if r < 0 {
                            std::io::Error::from_raw_os_error(-r as i32).to_string()
                        } else {
                            format!("thread {r} could not take it")
                        }
                    ),
                });
                break;
            }
        }
        let _ = inj.syscall("munmap", libc::SYS_munmap, &[area, len]);
        installed
    })
}
