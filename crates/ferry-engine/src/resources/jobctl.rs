//! Job-control stops: a process stopped by SIGSTOP, SIGTSTP, SIGTTIN or SIGTTOU (a group
//! stop of all its threads), and whether its parent has already collected the stop.
//!
//! Capture: the freeze finds each thread of a stopped process in the trap of its group stop,
//! which reports the stop signal (`FrozenProc::stop_signal`); the parent, when it is in the
//! tree, is asked with an injected `waitid(WSTOPPED | WNOWAIT | WNOHANG)` whether the stop is
//! still waiting to be collected (WNOWAIT leaves it there).
//!
//! Restore: once every thread of the rebuilt process exists, the stop signal is delivered to
//! it while we trace it, so the kernel makes the group stop itself (every thread takes part,
//! the parent is sent SIGCHLD and can collect the stop). The SIGCHLD goes with the other
//! signals the rebuild left pending in the parent (`signals::restore_pending` empties them
//! before it queues the captured ones); a stop the parent had collected is collected again
//! here by a `waitid` injected into it. When the tree is let go, detaching a thread of a
//! stopped group puts it back into the group stop: it stays stopped until SIGCONT.

use crate::error::{Context, Error, Result};
use crate::husk::Husk;
use crate::procfs;
use ferry_image::Process;
use ferry_inject::Injector;
use ferry_sys::ptrace;
use ferry_sys::wait::{wait_tid, WaitStatus};

const P_PID: u64 = 1;
const WNOHANG: u64 = 1;
const WSTOPPED: u64 = 2;
const WCONTINUED: u64 = 8;
const WNOWAIT: u64 = 0x0100_0000;
const WALL: u64 = 0x4000_0000;

/// Whether the stop of child `child` (its PID as the parent sees it) has already been
/// collected by its parent, whose injector is `parent`.
pub fn stop_collected(parent: &Injector, child: i32) -> Result<bool> {
    let info = parent.write_scratch(0, &[0u8; 128])?;
    parent.syscall(
        "waitid(WSTOPPED|WNOWAIT)",
        libc::SYS_waitid,
        &[
            P_PID,
            child as u64,
            info,
            WSTOPPED | WNOWAIT | WNOHANG | WALL,
            0,
        ],
    )?;
    // si_pid, after si_signo, si_errno, si_code and padding: 0 when nothing is waiting.
    let b = parent.read_scratch(16, 4)?;
    Ok(i32::from_ne_bytes(b.try_into().expect("4 bytes")) == 0)
}

/// Whether the process group of `host` (a process of the rebuilt tree) is orphaned: no member
/// has a parent in another group of the same session. The kernel discards SIGTSTP, SIGTTIN and
/// SIGTTOU sent to an orphaned group; zombies and children of init do not count (as in the
/// kernel's `will_become_orphaned_pgrp`).
fn group_orphaned(host: i32, members: &[i32]) -> Result<bool> {
    let me = procfs::stat(host)?;
    for &m in members {
        let Ok(s) = procfs::stat(m) else { continue };
        if s.pgid != me.pgid || s.state == 'Z' || s.ppid <= 1 {
            continue;
        }
        let Ok(parent) = procfs::stat(s.ppid) else {
            continue;
        };
        if parent.pgid != s.pgid && parent.sid == s.sid {
            return Ok(false);
        }
    }
    Ok(true)
}

fn wait_stop(pid: i32, tid: i32, what: &str) -> Result<WaitStatus> {
    wait_tid(tid, false).ctx(pid, || format!("wait for thread {tid} to {what}"))
}

/// Puts a rebuilt process into the group stop it was in. `tids`: the host TIDs of its
/// threads, leader first, each in a ptrace stop with every signal blocked; `tree`: the host
/// PIDs of every process of the tree (for the orphaned-group rule). Each thread is left in the
/// trap of the group stop, from which injected calls still run.
pub fn make_stopped(h: &Husk, p: &Process, tids: &[i32], tree: &[i32]) -> Result<()> {
    if p.continued_uncollected && p.stop_signal.is_none() {
        return make_continued(h, p, tids);
    }
    let Some(want) = p.stop_signal else {
        return Ok(());
    };
    // A job-control signal to an orphaned group would be discarded: the process stops by
    // SIGSTOP instead (which only its parent's wait status could tell; the parent of the
    // tree's root is outside the tree).
    let sig = if want != libc::SIGSTOP && group_orphaned(h.host, tree)? {
        log::info!(
            "PID {}: its process group is orphaned now; stopped by SIGSTOP instead of signal \
             {want}",
            p.pid
        );
        libc::SIGSTOP
    } else {
        want
    };
    group_stop(h, p, tids, sig)
}

/// Makes the group stop of signal `sig` (see [`make_stopped`]).
fn group_stop(h: &Husk, p: &Process, tids: &[i32], sig: i32) -> Result<()> {
    let leader = h.host;
    let bad = |what: String| Error::Restore { pid: p.pid, what };
    ptrace::set_sigmask(leader, !(1u64 << (sig - 1)))
        .ctx(p.pid, || "unblock the stop signal".into())?;
    ptrace::tgkill(leader, leader, sig).ctx(p.pid, || format!("send signal {sig}"))?;
    ptrace::cont(leader, 0).ctx(p.pid, || "resume the leader".into())?;
    // Its delivery stops first for us (the tracer), then, passed on, starts the group stop.
    match wait_stop(p.pid, leader, "take the stop signal")? {
        WaitStatus::Stopped { sig: s, event: 0 } if s == sig => {}
        other => return Err(bad(format!("signal {sig} was not delivered: {other:?}"))),
    }
    ptrace::cont(leader, sig).ctx(p.pid, || format!("deliver signal {sig}"))?;
    for (i, &tid) in tids.iter().enumerate() {
        if i > 0 {
            // Each other thread takes part in the group stop when it next runs.
            ptrace::cont(tid, 0).ctx(p.pid, || format!("resume thread {tid}"))?;
        }
        match wait_stop(p.pid, tid, "join the group stop")? {
            WaitStatus::Stopped {
                sig: s,
                event: ptrace::PTRACE_EVENT_STOP,
            } if s == sig => {}
            other => {
                return Err(bad(format!(
                    "thread {tid} did not join the group stop of signal {sig}: {other:?}"
                )))
            }
        }
    }
    ptrace::set_sigmask(leader, u64::MAX).ctx(p.pid, || "block signals again".into())?;
    Ok(())
}

/// A process that was stopped and continued (SIGCONT) while its parent has not yet collected
/// the continue (`wait*(WCONTINUED)`): stopped and continued again, which leaves the kernel's
/// "continued" mark for the parent to collect. Each thread then owes us one trap (a seized
/// tracee is told of the continue), taken here so that the next injected call does not meet it.
fn make_continued(h: &Husk, p: &Process, tids: &[i32]) -> Result<()> {
    group_stop(h, p, tids, libc::SIGSTOP)?;
    ptrace::kill(h.host, libc::SIGCONT).ctx(p.pid, || "send SIGCONT".into())?;
    for &tid in tids {
        ptrace::cont(tid, 0).ctx(p.pid, || format!("resume thread {tid}"))?;
        match wait_stop(p.pid, tid, "take the continue")? {
            WaitStatus::Stopped {
                event: ptrace::PTRACE_EVENT_STOP,
                ..
            } => {}
            other => {
                return Err(Error::Restore {
                    pid: p.pid,
                    what: format!("thread {tid} did not report the continue: {other:?}"),
                })
            }
        }
    }
    Ok(())
}

/// Whether child `child` (its PID as the parent sees it) was continued (SIGCONT after a
/// stop) and its parent, whose injector is `parent`, has not collected that yet.
pub fn continue_uncollected(parent: &Injector, child: i32) -> Result<bool> {
    let info = parent.write_scratch(0, &[0u8; 128])?;
    parent.syscall(
        "waitid(WCONTINUED|WNOWAIT)",
        libc::SYS_waitid,
        &[
            P_PID,
            child as u64,
            info,
            WCONTINUED | WNOWAIT | WNOHANG | WALL,
            0,
        ],
    )?;
    let b = parent.read_scratch(16, 4)?;
    Ok(i32::from_ne_bytes(b.try_into().expect("4 bytes")) != 0)
}

/// Collects, in the rebuilt parent, the stop of child `child` (its PID in the tree) that the
/// original parent had already collected.
pub fn collect_stop(parent: &Husk, child: i32) -> Result<()> {
    let inj = parent.injector();
    let info = inj.write_scratch(0, &[0u8; 128])?;
    inj.syscall(
        "waitid(WSTOPPED)",
        libc::SYS_waitid,
        &[P_PID, child as u64, info, WSTOPPED | WNOHANG | WALL, 0],
    )?;
    let b = inj.read_scratch(16, 4)?;
    if i32::from_ne_bytes(b.try_into().expect("4 bytes")) != child {
        return Err(Error::Restore {
            pid: parent.pid,
            what: format!("the stop of child {child} was not there to collect"),
        });
    }
    Ok(())
}
