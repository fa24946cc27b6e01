//! Threads: registers, FPU/SSE/AVX state, TLS (fs/gs base), signal mask, alternate signal
//! stack, robust futex list, rseq, clear_child_tid, name, and the system call they were in.

use crate::error::{Context, Result};
use crate::freeze::{self, FrozenThread};
use crate::husk::Husk;
use crate::procfs;
use ferry_image::{AltStack, Rseq, Sched, SigInfo, SyscallState, Thread};
use ferry_inject::batch::Call;
use ferry_inject::Injector;
use ferry_sys::ptrace;
use ferry_sys::regs::{gp_from_words, gp_to_words};
use ferry_sys::sched;

const PR_SET_NAME: u64 = 15;
const PR_GET_TID_ADDRESS: u64 = 40;

pub fn capture(pid: i32, ft: &FrozenThread, inj: &Injector) -> Result<Thread> {
    let tid = ft.tid;
    let what = |w: &str| format!("{w} of thread {tid}");
    let xstate = ptrace::get_xstate(tid).ctx(pid, || what("read FPU/AVX state"))?;
    let rseq = match ptrace::get_rseq(tid) {
        Ok((addr, len, sig)) if addr != 0 => Some(Rseq { addr, len, sig }),
        Ok(_) => None,
        Err(e) => return Err(e).ctx(pid, || what("read rseq registration")),
    };
    let (robust_list, robust_list_len) =
        ptrace::get_robust_list(tid).ctx(pid, || what("read robust futex list"))?;
    inj.syscall("sigaltstack", libc::SYS_sigaltstack, &[0, inj.scratch(0)])?;
    let ss = inj.read_scratch(0, 24)?;
    let word = |b: &[u8], at: usize| u64::from_ne_bytes(b[at..at + 8].try_into().expect("8 bytes"));
    inj.syscall(
        "prctl(PR_GET_TID_ADDRESS)",
        libc::SYS_prctl,
        &[PR_GET_TID_ADDRESS, inj.scratch(32)],
    )?;
    let clear_child_tid = word(&inj.read_scratch(32, 8)?, 0);
    let pending: Vec<SigInfo> = ptrace::peek_siginfo(tid, false)
        .ctx(pid, || what("read pending signals"))?
        .into_iter()
        .map(|b| SigInfo(b.to_vec()))
        .collect();
    let sched = capture_sched(pid, tid, inj)?;
    let r = &ft.regs;
    let in_syscall = r.orig_rax as i64 >= 0
        && matches!(
            -(r.rax as i64),
            freeze::ERESTARTSYS
                | freeze::ERESTARTNOINTR
                | freeze::ERESTARTNOHAND
                | freeze::ERESTART_RESTARTBLOCK
        );
    Ok(Thread {
        tid,
        comm: procfs::read(pid, &format!("task/{tid}/comm"))
            .unwrap_or_default()
            .trim_end_matches('\n')
            .to_string(),
        gp_regs: gp_to_words(r),
        xstate,
        sigmask: ft.sigmask,
        pending,
        altstack: AltStack {
            sp: word(&ss, 0),
            flags: i32::from_ne_bytes(ss[8..12].try_into().expect("4 bytes")),
            size: word(&ss, 16),
        },
        robust_list,
        robust_list_len,
        rseq,
        clear_child_tid,
        syscall: if in_syscall {
            SyscallState::Restart { nr: r.orig_rax }
        } else {
            SyscallState::None
        },
        sched,
    })
}

const PR_SET_TIMERSLACK: u64 = 29;
const PR_GET_TIMERSLACK: u64 = 30;

fn capture_sched(pid: i32, tid: i32, inj: &Injector) -> Result<Sched> {
    let what = |w: &str| format!("{w} of thread {tid}");
    let (policy, priority) = sched::get_policy(tid).ctx(pid, || what("read scheduling policy"))?;
    Ok(Sched {
        policy,
        priority,
        nice: sched::get_nice(tid).ctx(pid, || what("read nice value"))?,
        ioprio: sched::get_ioprio(tid).ctx(pid, || what("read I/O priority"))?,
        affinity: sched::get_affinity(tid).ctx(pid, || what("read CPU affinity"))?,
        timerslack_ns: inj.syscall(
            "prctl(PR_GET_TIMERSLACK)",
            libc::SYS_prctl,
            &[PR_GET_TIMERSLACK],
        )?,
    })
}

/// Scheduling attributes, set from outside once the thread exists (its timer slack is set
/// from inside by [`restore_inside`]); `inj` is the thread's injector (its `tid` is the
/// thread's TID in our namespace).
pub fn restore_sched(pid: i32, inj: &Injector, t: &Thread) -> Result<()> {
    let s = &t.sched;
    let host = inj.tid;
    let what = |w: &str| format!("{w} of thread {}", t.tid);
    if s.affinity.is_empty() {
        return Ok(());
    }
    sched::set_policy(host, s.policy, s.priority).ctx(pid, || what("set scheduling policy"))?;
    sched::set_nice(host, s.nice).ctx(pid, || what("set nice value"))?;
    sched::set_ioprio(host, s.ioprio).ctx(pid, || what("set I/O priority"))?;
    sched::set_affinity(host, &s.affinity).ctx(pid, || what("set CPU affinity"))?;
    Ok(())
}

/// The size of the kernel's `struct robust_list_head`, the only length `set_robust_list` takes.
const ROBUST_LIST_HEAD_LEN: u64 = 24;

/// Per-thread kernel state that is set from inside the thread: name, alternate stack, robust
/// list, rseq, clear_child_tid and timer slack, as one batch of calls the thread runs itself
/// (`h`'s trampoline). The thread must be stopped in `inj`.
pub fn restore_inside(h: &Husk, inj: &Injector, t: &Thread) -> Result<()> {
    restore_inside_all(h, &[(inj, t)])
}

/// Bytes of the table for one thread's batch of [`restore_inside`] (six calls at most).
const INSIDE_SLOT: u64 = 512;
/// Bytes of the data area for one thread's name and alternate stack.
const INSIDE_DATA: u64 = 64;

/// [`restore_inside`] for several threads of `h` at once: each runs its own batch from its
/// own slot of the trampoline's table, all of them at the same time (one round of stops for
/// all, not one per thread), in waves of as many as the table holds.
pub fn restore_inside_all(h: &Husk, threads: &[(&Injector, &Thread)]) -> Result<()> {
    let per_wave = (h.batch_site().table_len / INSIDE_SLOT) as usize;
    for wave in threads.chunks(per_wave.max(1)) {
        let mut tables = Vec::with_capacity(wave.len());
        for (k, (_, t)) in wave.iter().enumerate() {
            let data = k as u64 * INSIDE_DATA;
            let site = h
                .batch_slot(k, INSIDE_SLOT)
                .ok_or_else(|| crate::Error::Restore {
                    pid: h.pid,
                    what: format!("thread {}: no room in the trampoline's table", t.tid),
                })?;
            tables.push((site, inside_calls(h, t, data)?));
        }
        let items: Vec<_> = wave
            .iter()
            .zip(&tables)
            .map(|((inj, _), (site, calls))| (*inj, *site, &calls[..]))
            .collect();
        let results = ferry_inject::batch::run_batches(&items)?;
        for ((_, t), r) in wave.iter().zip(results) {
            if let Err(stopped) = r {
                return Err(crate::Error::Restore {
                    pid: h.pid,
                    what: format!("thread {}: {stopped}", t.tid),
                });
            }
        }
    }
    Ok(())
}

/// The calls of [`restore_inside`] for thread `t`, its name and alternate stack written at
/// offset `data` of the trampoline's data area.
fn inside_calls(h: &Husk, t: &Thread, data: u64) -> Result<Vec<Call>> {
    let mut bytes = t.comm.as_bytes().to_vec();
    bytes.truncate(15);
    bytes.resize(16, 0);
    // Set even when the thread had none: the thread it is rebuilt in may have one (inherited
    // from the restorer, on a stack the image does not map), and a handler with SA_ONSTACK
    // (every handler Python installs) would then be run there, and the process killed.
    let (sp, flags, size) = if t.altstack.flags & libc::SS_DISABLE == 0 {
        (
            t.altstack.sp,
            t.altstack.flags & !libc::SS_ONSTACK,
            t.altstack.size,
        )
    } else {
        (0, libc::SS_DISABLE, 0)
    };
    bytes.extend_from_slice(&sp.to_ne_bytes());
    bytes.extend_from_slice(&(flags as i64).to_ne_bytes());
    bytes.extend_from_slice(&size.to_ne_bytes());
    let name = h.write_data(data, &bytes)?;
    let ss = name + 16;
    let mut calls = vec![
        Call::new("prctl(PR_SET_NAME)", libc::SYS_prctl, &[PR_SET_NAME, name]),
        Call::new("sigaltstack", libc::SYS_sigaltstack, &[ss, 0]),
    ];
    // Likewise: a thread without a robust list (a Go or static program's) must not keep the
    // restorer's, which the kernel would walk in the image's memory when the thread exits.
    let robust_len = if t.robust_list != 0 {
        t.robust_list_len
    } else {
        ROBUST_LIST_HEAD_LEN
    };
    calls.push(Call::new(
        "set_robust_list",
        libc::SYS_set_robust_list,
        &[t.robust_list, robust_len],
    ));
    if let Some(r) = &t.rseq {
        calls.push(Call::new(
            "rseq",
            libc::SYS_rseq,
            &[r.addr, r.len as u64, 0, r.sig as u64],
        ));
    }
    calls.push(Call::new(
        "set_tid_address",
        libc::SYS_set_tid_address,
        &[t.clear_child_tid],
    ));
    if t.sched.timerslack_ns != 0 {
        calls.push(Call::new(
            "prctl(PR_SET_TIMERSLACK)",
            libc::SYS_prctl,
            &[PR_SET_TIMERSLACK, t.sched.timerslack_ns],
        ));
    }
    Ok(calls)
}

/// Puts the registers, FPU state and signal mask of thread `t` of process `pid` (the tree's
/// numbers) in place, through its TID in our namespace `host`: the last step before it is let
/// go. A thread that was inside a system call is rewound to issue it again.
pub fn restore_registers(pid: i32, host: i32, t: &Thread) -> Result<()> {
    let mut regs = gp_from_words(&t.gp_regs).ok_or_else(|| {
        crate::Error::BadImage(format!("thread {}: register set has the wrong size", t.tid))
    })?;
    if let SyscallState::Restart { nr } = t.syscall {
        freeze::reissue(&mut regs, nr);
    }
    ptrace::set_xstate(host, &t.xstate)
        .ctx(pid, || format!("set FPU/AVX state of thread {}", t.tid))?;
    ptrace::set_regs(host, &regs).ctx(pid, || format!("set registers of thread {}", t.tid))?;
    ptrace::set_sigmask(host, t.sigmask)
        .ctx(pid, || format!("set signal mask of thread {}", t.tid))?;
    Ok(())
}
