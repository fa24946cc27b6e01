//! Scheduling state of a thread, read and set from outside: policy, priority, nice, CPU
//! affinity, I/O priority.

use crate::{check, SysResult};

pub fn get_policy(tid: i32) -> SysResult<(i32, i32)> {
    // SAFETY: plain integer argument.
    let policy = unsafe { libc::sched_getscheduler(tid) };
    check("sched_getscheduler", policy as libc::c_long)?;
    let mut param = libc::sched_param { sched_priority: 0 };
    // SAFETY: param is a valid out-pointer.
    let r = unsafe { libc::sched_getparam(tid, &mut param) };
    check("sched_getparam", r as libc::c_long)?;
    Ok((policy, param.sched_priority))
}

pub fn set_policy(tid: i32, policy: i32, priority: i32) -> SysResult<()> {
    let param = libc::sched_param {
        sched_priority: priority,
    };
    // SAFETY: param is a valid in-pointer.
    let r = unsafe { libc::sched_setscheduler(tid, policy, &param) };
    check("sched_setscheduler", r as libc::c_long).map(drop)
}

/// The nice value (-20..19) of one thread.
pub fn get_nice(tid: i32) -> SysResult<i32> {
    // The raw system call returns 20 - nice, which is never negative, so errors are unambiguous.
    // SAFETY: plain integer arguments.
    let r = unsafe { libc::syscall(libc::SYS_getpriority, libc::PRIO_PROCESS, tid) };
    Ok(20 - check("getpriority", r)? as i32)
}

pub fn set_nice(tid: i32, nice: i32) -> SysResult<()> {
    // SAFETY: plain integer arguments.
    let r = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice) };
    check("setpriority", r as libc::c_long).map(drop)
}

pub fn get_affinity(tid: i32) -> SysResult<Vec<u64>> {
    let mut mask = vec![0u64; 16];
    // SAFETY: the kernel writes at most mask.len() * 8 bytes.
    let r = unsafe {
        libc::syscall(
            libc::SYS_sched_getaffinity,
            tid,
            mask.len() * 8,
            mask.as_mut_ptr(),
        )
    };
    let n = check("sched_getaffinity", r)? as usize;
    mask.truncate(n / 8);
    Ok(mask)
}

pub fn set_affinity(tid: i32, mask: &[u64]) -> SysResult<()> {
    // SAFETY: the kernel reads mask.len() * 8 bytes.
    let r = unsafe {
        libc::syscall(
            libc::SYS_sched_setaffinity,
            tid,
            mask.len() * 8,
            mask.as_ptr(),
        )
    };
    check("sched_setaffinity", r).map(drop)
}

const IOPRIO_WHO_PROCESS: i32 = 1;

pub fn get_ioprio(tid: i32) -> SysResult<i32> {
    // SAFETY: plain integer arguments.
    let r = unsafe { libc::syscall(libc::SYS_ioprio_get, IOPRIO_WHO_PROCESS, tid) };
    check("ioprio_get", r).map(|v| v as i32)
}

pub fn set_ioprio(tid: i32, prio: i32) -> SysResult<()> {
    // SAFETY: plain integer arguments.
    let r = unsafe { libc::syscall(libc::SYS_ioprio_set, IOPRIO_WHO_PROCESS, tid, prio) };
    check("ioprio_set", r).map(drop)
}

/// The extra time the kernel adds to a CPU-time interval timer when it is set (one tick), in
/// microseconds: measured by setting ITIMER_VIRTUAL on ourselves and reading it back.
pub fn cpu_itimer_slack_us() -> u64 {
    let set = libc::itimerval {
        it_interval: libc::timeval {
            tv_sec: 0,
            tv_usec: 0,
        },
        it_value: libc::timeval {
            tv_sec: 100,
            tv_usec: 0,
        },
    };
    let mut got = libc::itimerval {
        it_interval: set.it_interval,
        it_value: set.it_interval,
    };
    let off = libc::itimerval {
        it_interval: set.it_interval,
        it_value: set.it_interval,
    };
    // SAFETY: valid in- and out-pointers to itimerval structs on this stack.
    unsafe {
        libc::setitimer(libc::ITIMER_VIRTUAL, &set, std::ptr::null_mut());
        libc::getitimer(libc::ITIMER_VIRTUAL, &mut got);
        libc::setitimer(libc::ITIMER_VIRTUAL, &off, std::ptr::null_mut());
    }
    let v = got.it_value.tv_sec * 1_000_000 + got.it_value.tv_usec;
    let extra = v - 100_000_000;
    // Round to whole milliseconds: the few microseconds we ran meanwhile are not slack.
    if extra > 0 {
        (((extra + 500) / 1000) * 1000) as u64
    } else {
        0
    }
}
