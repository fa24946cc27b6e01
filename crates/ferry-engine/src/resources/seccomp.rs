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
//! - **Ferry's own filter** ([`install_forwarding`]): a body (a process whose home is another
//!   node) gets, before its own filters and while it is still root, a filter that hands the
//!   location-dependent calls of [`FORWARDED`] to a supervisor (its guest init), and lets every
//!   other call through in the kernel (SECCOMP_RET_ALLOW, never notified). A process that
//!   holds a relayed socket gets the variant that hands over [`NAMES`] too. It is the oldest
//!   filter, so the process's own filters still decide first (an ERRNO or KILL of theirs
//!   outranks USER_NOTIF). The capture recognizes it by its exact program and leaves it out of
//!   the image: a tree moved on, or home, is rebuilt without it (and gets a fresh one where it
//!   is a body again).
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

/// The filters of thread `tid`, oldest first. (PTRACE_SECCOMP_GET_FILTER's index 0 is the
/// oldest filter, whatever ptrace(2) says: the kernel's get_nth_filter counts back from the
/// newest by the number of filters less the index.)
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
    let mut first = filters_of(pid, tids[0])?;
    for &tid in &tids[1..] {
        if filters_of(pid, tid)? != first {
            return Err(refuse(format!(
                "thread {tid} has other filters than thread {} (only filters shared by every \
                 thread, as SECCOMP_FILTER_FLAG_TSYNC makes them, can be rebuilt)",
                tids[0]
            )));
        }
    }
    // Ferry's own filter (the oldest) is no part of the process: it is not recorded.
    if first.first().is_some_and(|f| {
        f.program == forwarding_program(false) || f.program == forwarding_program(true)
    }) {
        first.remove(0);
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
    restore_from(p, host, 0)
}

/// How many seccomp filters process `host` has (`Seccomp_filters` of its status).
pub fn installed(host: i32) -> usize {
    crate::procfs::status(host)
        .map(|s| {
            crate::procfs::field(&s, "Seccomp_filters")
                .parse()
                .unwrap_or(0)
        })
        .unwrap_or(0)
}

/// [`restore`], but for the first `kept` filters, which the process has already (a deputy
/// taken over at home keeps those it had when it left).
pub fn restore_from(p: &Process, host: i32, kept: usize) -> Result<()> {
    let fewer;
    let p = if kept == 0 {
        p
    } else {
        fewer = Process {
            pid: p.pid,
            seccomp: p.seccomp.iter().skip(kept).cloned().collect(),
            ..Default::default()
        };
        &fewer
    };
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

/// The system calls (x86_64 numbers) whose answer depends on where the process runs and that
/// a body's supervisor answers with its home's values: getppid, getpgrp, getpgid, getsid.
pub const FORWARDED: [(u32, &str); 4] = [
    (libc::SYS_getppid as u32, "getppid"),
    (libc::SYS_getpgrp as u32, "getpgrp"),
    (libc::SYS_getpgid as u32, "getpgid"),
    (libc::SYS_getsid as u32, "getsid"),
];

/// The calls that make processes and threads: handed to the supervisor too, which has home
/// give a process's child its PID (a deputy at home, forked from the caller's) and lets the
/// call go on in the kernel (SECCOMP_USER_NOTIF_FLAG_CONTINUE) once the namespace's next PID is
/// that one. Threads (clone with CLONE_THREAD, or clone3 whose flags in memory say so) go on at
/// once; they come here too because they take their TIDs from the same allocator, and must not
/// take the child's PID while it is being made.
pub const CLONES: [(u32, &str); 4] = [
    (libc::SYS_clone as u32, "clone"),
    (libc::SYS_clone3 as u32, "clone3"),
    (libc::SYS_fork as u32, "fork"),
    (libc::SYS_vfork as u32, "vfork"),
];

/// The calls that send a signal to a PID: handed to the supervisor, which lets one whose target
/// is a process of the body's own PID namespace (the tree, known by its home PIDs) go on in the
/// kernel (SECCOMP_USER_NOTIF_FLAG_CONTINUE), and sends any other home: there the caller's
/// deputy makes the same call (injected), with the process's credentials at home, and its
/// result is the caller's. `pidfd_open` is not among them: a pidfd of a process at home cannot
/// be handed to a body on another node (docs/limitations.md).
pub const KILLS: [(u32, &str); 5] = [
    (libc::SYS_kill as u32, "kill"),
    (libc::SYS_tkill as u32, "tkill"),
    (libc::SYS_tgkill as u32, "tgkill"),
    (libc::SYS_rt_sigqueueinfo as u32, "rt_sigqueueinfo"),
    (libc::SYS_rt_tgsigqueueinfo as u32, "rt_tgsigqueueinfo"),
];

/// The calls that change a process's group or session: handed to the supervisor, which has
/// the caller's deputy make the same call at home first (so the home's job control and
/// `getpgid` from home see the change, or the home's kernel refuses it), then lets it go on in
/// the kernel, or, for the tree's root, whose group and session in the body stand for its home
/// ones, answers with what home said and keeps the new values.
pub const GROUPS: [(u32, &str); 2] = [
    (libc::SYS_setpgid as u32, "setpgid"),
    (libc::SYS_setsid as u32, "setsid"),
];

/// Handed to the supervisor too, but only by the filter of a process that holds a relayed
/// socket (`SocketDesc::relayed`): the supervisor answers them with the original's names (and
/// inode, for fstat) for that socket and lets them run in the kernel for anything else.
pub const NAMES: [(u32, &str); 3] = [
    (libc::SYS_getsockname as u32, "getsockname"),
    (libc::SYS_getpeername as u32, "getpeername"),
    (libc::SYS_fstat as u32, "fstat"),
];

/// With [`NAMES`]: these calls too, but only when they stat a descriptor itself (their flags,
/// the argument of this index, hold AT_EMPTY_PATH): a stat of a path never leaves the kernel.
pub const NAMES_AT: [(u32, &str, u32); 2] = [
    (libc::SYS_newfstatat as u32, "newfstatat", 3),
    (libc::SYS_statx as u32, "statx", 2),
];

const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
const SECCOMP_RET_ALLOW: u32 = 0x7fff_0000;
/// BPF_LD | BPF_W | BPF_ABS
const BPF_LD_W_ABS: u16 = 0x20;
/// BPF_JMP | BPF_JEQ | BPF_K
const BPF_JEQ_K: u16 = 0x15;
/// BPF_JMP | BPF_JSET | BPF_K
const BPF_JSET_K: u16 = 0x45;
const SECCOMP_FILTER_FLAG_NEW_LISTENER: u64 = 8;
const SECCOMP_FILTER_FLAG_TSYNC_ESRCH: u64 = 16;
/// Once the supervisor has received a notification, the caller waits for the answer killable
/// only (Linux 5.19): a signal no longer interrupts the call half way. Without it a fork whose
/// notification was pending when SIGCHLD came (a shell's pipeline) failed with EINTR, which no
/// program expects of fork.
const SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV: u64 = 32;

fn insn(code: u16, jt: u8, jf: u8, k: u32) -> [u8; 8] {
    let mut b = [0u8; 8];
    b[0..2].copy_from_slice(&code.to_ne_bytes());
    b[2] = jt;
    b[3] = jf;
    b[4..8].copy_from_slice(&k.to_ne_bytes());
    b
}

/// Ferry's filter: the calls of [`FORWARDED`], [`CLONES`], [`KILLS`] and [`GROUPS`] (native
/// x86_64 ones),
/// and with `names` those of
/// [`NAMES`] and [`NAMES_AT`], go to the supervisor; everything else is allowed in the kernel.
/// Always the same bytes for the same `names`, so that a capture knows it.
pub fn forwarding_program(names: bool) -> Vec<u8> {
    let calls: Vec<u32> = FORWARDED
        .iter()
        .chain(CLONES.iter())
        .chain(KILLS.iter())
        .chain(GROUPS.iter())
        .chain(NAMES.iter().filter(|_| names))
        .map(|(nr, _)| *nr)
        .collect();
    let conds: &[(u32, &str, u32)] = if names { &NAMES_AT } else { &[] };
    let (n, m) = (calls.len(), conds.len());
    // Where the returns are: ALLOW, USER_NOTIF after the tests; then a block of two for each
    // conditional call, then ALLOW and USER_NOTIF again (jumps only go forward).
    let allow = 3 + n + m;
    let cond = |j: usize| allow + 2 + 2 * j;
    let allow2 = allow + 2 + 2 * m;
    let off = |from: usize, to: usize| (to - from - 1) as u8;
    let mut prog = Vec::new();
    // struct seccomp_data: nr at 0, arch at 4, args from 16 (8 bytes each).
    prog.extend(insn(BPF_LD_W_ABS, 0, 0, 4));
    // Another ABI (i386, whose numbers differ): allowed.
    prog.extend(insn(BPF_JEQ_K, 0, off(1, allow), AUDIT_ARCH_X86_64));
    prog.extend(insn(BPF_LD_W_ABS, 0, 0, 0));
    for (i, nr) in calls.iter().enumerate() {
        // A match jumps over the remaining tests and the ALLOW to the USER_NOTIF.
        prog.extend(insn(BPF_JEQ_K, off(3 + i, allow + 1), 0, *nr));
    }
    for (j, (nr, _, _)) in conds.iter().enumerate() {
        prog.extend(insn(BPF_JEQ_K, off(3 + n + j, cond(j)), 0, *nr));
    }
    prog.extend(insn(BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW));
    prog.extend(insn(BPF_RET_K, 0, 0, SECCOMP_RET_USER_NOTIF));
    for (j, (_, _, arg)) in conds.iter().enumerate() {
        // The low half of the flags argument (little-endian).
        prog.extend(insn(BPF_LD_W_ABS, 0, 0, 16 + 8 * arg));
        let at = cond(j) + 1;
        prog.extend(insn(
            BPF_JSET_K,
            off(at, allow2 + 1),
            off(at, allow2),
            libc::AT_EMPTY_PATH as u32,
        ));
    }
    if m > 0 {
        prog.extend(insn(BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW));
        prog.extend(insn(BPF_RET_K, 0, 0, SECCOMP_RET_USER_NOTIF));
    }
    prog
}

/// Installs Ferry's filter in the rebuilt, stopped process `p` (`h` here), on every thread,
/// and returns its listener (taken out of the process, whose descriptor table keeps no trace
/// of it). Done before the process's credentials are restored: as root it needs no
/// no_new_privs, which would change what its own execs may do. With `names` (the process
/// holds a relayed socket) its getsockname and getpeername go to the supervisor too.
pub fn install_forwarding(
    p: &Process,
    h: &crate::husk::Husk,
    names: bool,
) -> Result<std::os::fd::OwnedFd> {
    let inj = h.injector();
    let prog = forwarding_program(names);
    let mut head = [0u8; 16];
    head[0..2].copy_from_slice(&((prog.len() / 8) as u16).to_ne_bytes());
    let fail = |what: String| Error::Restore { pid: p.pid, what };
    let body = inj
        .write_scratch(16, &prog)
        .map_err(|e| fail(format!("write Ferry's seccomp filter: {e}")))?;
    head[8..16].copy_from_slice(&body.to_ne_bytes());
    let fprog = inj
        .write_scratch(0, &head)
        .map_err(|e| fail(format!("write Ferry's seccomp filter: {e}")))?;
    let flags = SECCOMP_FILTER_FLAG_NEW_LISTENER
        | SECCOMP_FILTER_FLAG_TSYNC
        | SECCOMP_FILTER_FLAG_TSYNC_ESRCH
        | SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV;
    let fd = inj.syscall_raw(
        "seccomp(SECCOMP_SET_MODE_FILTER, NEW_LISTENER)",
        libc::SYS_seccomp,
        &[SECCOMP_SET_MODE_FILTER, flags, fprog],
    )?;
    if fd < 0 {
        return Err(fail(format!(
            "install Ferry's seccomp filter: {}",
            std::io::Error::from_raw_os_error(-fd as i32)
        )));
    }
    let taken = ferry_sys::pidfd::pidfd_open(h.host)
        .and_then(|pidfd| ferry_sys::pidfd::pidfd_getfd(&pidfd, fd as i32));
    inj.syscall("close", libc::SYS_close, &[fd as u64])?;
    taken.map_err(|e| Error::Sys {
        pid: p.pid,
        what: format!("take the seccomp listener (its fd {fd})"),
        source: e,
    })
}

#[cfg(test)]
mod tests {
    /// What the program returns for a call (classic BPF, as the kernel runs it).
    fn run(prog: &[u8], arch: u32, nr: u32, args: [u64; 6]) -> u32 {
        let mut data = Vec::new();
        data.extend(nr.to_ne_bytes());
        data.extend(arch.to_ne_bytes());
        data.extend(0u64.to_ne_bytes());
        for a in args {
            data.extend(a.to_ne_bytes());
        }
        let (mut pc, mut acc) = (0usize, 0u32);
        loop {
            let i = &prog[pc * 8..pc * 8 + 8];
            let code = u16::from_ne_bytes([i[0], i[1]]);
            let (jt, jf) = (i[2] as usize, i[3] as usize);
            let k = u32::from_ne_bytes([i[4], i[5], i[6], i[7]]);
            pc += 1;
            match code {
                super::BPF_LD_W_ABS => {
                    let k = k as usize;
                    acc = u32::from_ne_bytes(data[k..k + 4].try_into().unwrap());
                }
                super::BPF_JEQ_K => pc += if acc == k { jt } else { jf },
                super::BPF_JSET_K => pc += if acc & k != 0 { jt } else { jf },
                super::BPF_RET_K => return k,
                other => panic!("instruction {other:#x}"),
            }
        }
    }

    #[test]
    fn the_forwarding_program_hands_over_exactly_its_calls() {
        use super::{SECCOMP_RET_ALLOW as ALLOW, SECCOMP_RET_USER_NOTIF as NOTIF};
        let x86 = super::AUDIT_ARCH_X86_64;
        let empty = libc::AT_EMPTY_PATH as u64;
        for names in [false, true] {
            let prog = super::forwarding_program(names);
            assert_eq!(prog.len() % 8, 0);
            let call = |nr: i64, args: [u64; 6]| run(&prog, x86, nr as u32, args);
            for (nr, _) in super::FORWARDED
                .into_iter()
                .chain(super::CLONES)
                .chain(super::KILLS)
                .chain(super::GROUPS)
            {
                assert_eq!(call(nr as i64, [0; 6]), NOTIF);
                // i386's numbers mean other calls.
                assert_eq!(run(&prog, 0x4000_0003, nr, [0; 6]), ALLOW);
            }
            for (nr, _) in super::NAMES {
                assert_eq!(call(nr as i64, [0; 6]), if names { NOTIF } else { ALLOW });
            }
            let at = |flags: u64| [3, 0, 0, flags, 0, 0];
            let sx = |flags: u64| [3, 0, flags, 0x7ff, 0, 0];
            let n = if names { NOTIF } else { ALLOW };
            assert_eq!(call(libc::SYS_newfstatat, at(empty)), n);
            assert_eq!(call(libc::SYS_newfstatat, at(empty | 0x100)), n);
            assert_eq!(call(libc::SYS_newfstatat, at(0x100)), ALLOW);
            assert_eq!(call(libc::SYS_newfstatat, at(0)), ALLOW);
            assert_eq!(call(libc::SYS_statx, sx(empty)), n);
            assert_eq!(call(libc::SYS_statx, sx(0)), ALLOW);
            // Flags in another argument than the call's own do not count.
            assert_eq!(call(libc::SYS_statx, at(empty)), ALLOW);
            for nr in [
                libc::SYS_read,
                libc::SYS_write,
                libc::SYS_stat,
                libc::SYS_openat,
            ] {
                assert_eq!(call(nr, at(empty)), ALLOW);
            }
        }
        // Without names: the forwarded calls, the clones, the kills and the group calls,
        // nothing else.
        assert_eq!(
            super::forwarding_program(false).len() / 8,
            3 + 4 + 4 + 5 + 2 + 2
        );
    }
}
