//! Signal state: handlers with flags and masks, pending signals, interval and POSIX timers.

use crate::error::Result;
use crate::husk::Husk;
use crate::procfs;
use ferry_image::{ITimer, PosixTimer, Process, SigAction, SigInfo};
use ferry_inject::batch::Call;
use ferry_inject::Injector;

const PR_TIMER_CREATE_RESTORE_IDS: u64 = 77;

/// The actions of signals 1..=64 of every process whose main thread `injs` holds (ours
/// PIDs and injectors), in order: one `rt_sigaction` query per signal, made in all the
/// processes at once (`ferry_inject::together`), their ptrace stops overlapping.
pub fn capture_actions(injs: &[(i32, &Injector)]) -> Result<Vec<Vec<SigAction>>> {
    let answers = crate::resources::asked::ask_all(injs, 64, 32, |k, inj| {
        let sig = k as u64 + 1;
        (
            "rt_sigaction",
            libc::SYS_rt_sigaction,
            [sig, 0, inj.scratch(0), 8, 0, 0],
        )
    })?;
    Ok(answers
        .into_iter()
        .map(|per| {
            per.into_iter()
                .map(|b| {
                    let w = |i: usize| {
                        u64::from_ne_bytes(b[i * 8..i * 8 + 8].try_into().expect("8 bytes"))
                    };
                    SigAction {
                        handler: w(0),
                        flags: w(1),
                        restorer: w(2),
                        mask: w(3),
                    }
                })
                .collect()
        })
        .collect())
}

/// The rest of a process's signal state, its actions (`capture_actions`) given.
pub fn capture(pid: i32, inj: &Injector, p: &mut Process, actions: Vec<SigAction>) -> Result<()> {
    p.sigactions = actions;
    for which in 0..3u64 {
        inj.syscall("getitimer", libc::SYS_getitimer, &[which, inj.scratch(64)])?;
        let b = inj.read_scratch(64, 32)?;
        let w = |i: usize| u64::from_ne_bytes(b[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
        p.itimers.push(ITimer {
            which: which as i32,
            interval_us: w(0) * 1_000_000 + w(1),
            value_us: w(2) * 1_000_000 + w(3),
        });
    }
    p.posix_timers = posix_timers(pid, inj)?;
    p.shared_pending = ferry_sys::ptrace::peek_siginfo(pid, true)
        .map_err(|source| crate::Error::Sys {
            pid,
            what: "read process-wide pending signals".into(),
            source,
        })?
        .into_iter()
        .map(|b| SigInfo(b.to_vec()))
        .collect();
    Ok(())
}

fn posix_timers(pid: i32, inj: &Injector) -> Result<Vec<PosixTimer>> {
    let text = procfs::read(pid, "timers").unwrap_or_default();
    let mut out: Vec<PosixTimer> = Vec::new();
    for line in text.lines() {
        let (k, v) = line
            .split_once(':')
            .map(|(k, v)| (k.trim(), v.trim()))
            .unwrap_or(("", ""));
        match k {
            "ID" => out.push(PosixTimer {
                id: v.parse().unwrap_or(0),
                ..Default::default()
            }),
            "signal" => {
                if let (Some(t), Some((sig, val))) = (out.last_mut(), v.split_once('/')) {
                    t.signo = sig.parse().unwrap_or(0);
                    t.sigev_value = u64::from_str_radix(val, 16).unwrap_or(0);
                }
            }
            "notify" => {
                if let (Some(t), Some((how, who))) = (out.last_mut(), v.split_once('/')) {
                    // "signal|none|thread" / "pid|tid" . id, as the kernel prints it.
                    let base = match how {
                        "thread" => libc::SIGEV_THREAD,
                        "none" => libc::SIGEV_NONE,
                        _ => libc::SIGEV_SIGNAL,
                    };
                    let thread_id = if who.starts_with("tid") {
                        libc::SIGEV_THREAD_ID
                    } else {
                        0
                    };
                    t.notify = base | thread_id;
                    t.notify_tid = who
                        .split('.')
                        .nth(1)
                        .and_then(|n| n.parse().ok())
                        .unwrap_or(0);
                }
            }
            "ClockID" => {
                if let Some(t) = out.last_mut() {
                    t.clock = v.parse().unwrap_or(0);
                }
            }
            _ => {}
        }
    }
    for t in &mut out {
        inj.syscall(
            "timer_gettime",
            libc::SYS_timer_gettime,
            &[t.id as u64, inj.scratch(128)],
        )?;
        let b = inj.read_scratch(128, 32)?;
        let w = |i: usize| u64::from_ne_bytes(b[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
        t.interval_ns = w(0) * 1_000_000_000 + w(1);
        t.value_ns = w(2) * 1_000_000_000 + w(3);
        t.overrun = inj.syscall(
            "timer_getoverrun",
            libc::SYS_timer_getoverrun,
            &[t.id as u64],
        )? as i32;
    }
    Ok(out)
}

pub fn restore_actions(h: &Husk, p: &Process) -> Result<()> {
    // Every handler in one batch: the actions side by side in the trampoline's data area.
    let mut bytes = Vec::with_capacity(p.sigactions.len() * 32);
    for a in &p.sigactions {
        for w in [a.handler, a.flags, a.restorer, a.mask] {
            bytes.extend_from_slice(&w.to_ne_bytes());
        }
    }
    let base = h.write_data(0, &bytes)?;
    let calls: Vec<(u64, Call)> = (1..=p.sigactions.len() as u64)
        .filter(|&sig| sig != libc::SIGKILL as u64 && sig != libc::SIGSTOP as u64)
        .map(|sig| {
            let at = base + (sig - 1) * 32;
            (
                sig,
                Call::new("rt_sigaction", libc::SYS_rt_sigaction, &[sig, at, 0, 8]),
            )
        })
        .collect();
    let table: Vec<Call> = calls.iter().map(|(_, c)| *c).collect();
    h.batch(&table, |i| {
        format!(
            "set the action of signal {}",
            calls.get(i).map_or(0, |(sig, _)| *sig)
        )
    })
}

pub fn restore_timers(h: &Husk, p: &Process) -> Result<()> {
    let inj = h.injector();
    // Setting a CPU-time timer adds a tick to it; take that tick off so that every
    // checkpoint/restore cycle does not push the timer back.
    let slack = if p.itimers.iter().any(|t| t.which != 0 && t.value_us != 0) {
        ferry_sys::sched::cpu_itimer_slack_us()
    } else {
        0
    };
    for t in &p.itimers {
        if t.value_us == 0 && t.interval_us == 0 {
            continue;
        }
        let mut t = t.clone();
        if t.value_us == 0 {
            // Expired while the tree was frozen, its signal pending (captured as such): the
            // kernel would have armed it again when the signal was taken. A zero value would
            // disarm it; it fires again an interval from now.
            t.value_us = t.interval_us;
        }
        if t.which != libc::ITIMER_REAL && t.value_us > slack {
            t.value_us -= slack;
        }
        let words = [
            t.interval_us / 1_000_000,
            t.interval_us % 1_000_000,
            t.value_us / 1_000_000,
            t.value_us % 1_000_000,
        ];
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
        let addr = inj.write_scratch(0, &bytes)?;
        inj.syscall("setitimer", libc::SYS_setitimer, &[t.which as u64, addr, 0])?;
    }
    if p.posix_timers.is_empty() {
        return Ok(());
    }
    // Linux 6.16+: timer_create takes the wanted ID from *timerid.
    inj.syscall(
        "prctl(PR_TIMER_CREATE_RESTORE_IDS)",
        libc::SYS_prctl,
        &[PR_TIMER_CREATE_RESTORE_IDS, 1, 0, 0, 0],
    )
    .map_err(|e| crate::Error::Restore {
        pid: h.pid,
        what: format!("this kernel cannot recreate POSIX timer IDs: {e}"),
    })?;
    // /proc/PID/timers lists the newest timer first (each new one goes to the head of the
    // process's list): make them oldest first, so that the list reads the same again.
    for t in p.posix_timers.iter().rev() {
        // struct sigevent: value (8), signo (4), notify (4), tid (4), padding to 64.
        let mut ev = vec![0u8; 64];
        ev[0..8].copy_from_slice(&t.sigev_value.to_ne_bytes());
        ev[8..12].copy_from_slice(&t.signo.to_ne_bytes());
        ev[12..16].copy_from_slice(&t.notify.to_ne_bytes());
        ev[16..20].copy_from_slice(&t.notify_tid.to_ne_bytes());
        let ev_addr = inj.write_scratch(0, &ev)?;
        let id_addr = inj.write_scratch(64, &t.id.to_ne_bytes())?;
        inj.syscall(
            "timer_create",
            libc::SYS_timer_create,
            &[t.clock as u64, ev_addr, id_addr],
        )?;
        if t.value_ns != 0 || t.interval_ns != 0 {
            let words = [
                t.interval_ns / 1_000_000_000,
                t.interval_ns % 1_000_000_000,
                t.value_ns / 1_000_000_000,
                t.value_ns % 1_000_000_000,
            ];
            let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
            let spec = inj.write_scratch(128, &bytes)?;
            inj.syscall(
                "timer_settime",
                libc::SYS_timer_settime,
                &[t.id as u64, 0, spec, 0],
            )?;
        }
    }
    inj.syscall(
        "prctl(PR_TIMER_CREATE_RESTORE_IDS)",
        libc::SYS_prctl,
        &[PR_TIMER_CREATE_RESTORE_IDS, 0, 0, 0, 0],
    )?;
    Ok(())
}

/// Empties the signal queues a rebuilt process picked up while being built (SIGCHLD from a
/// zombie child, say), then queues exactly the signals the image says were pending.
pub fn restore_pending(
    h: &Husk,
    p: &Process,
    threads: &std::collections::HashMap<i32, Injector>,
) -> Result<()> {
    let inj = h.injector();
    let all = inj.write_scratch(0, &u64::MAX.to_ne_bytes())?;
    let zero = inj.write_scratch(16, &[0u8; 16])?;
    loop {
        let r = inj.syscall_raw(
            "rt_sigtimedwait",
            libc::SYS_rt_sigtimedwait,
            &[all, 0, zero, 8],
        )?;
        if r <= 0 {
            break;
        }
    }
    for si in &p.shared_pending {
        let a = inj.write_scratch(128, &si.0)?;
        inj.syscall(
            "rt_sigqueueinfo",
            libc::SYS_rt_sigqueueinfo,
            &[h.pid as u64, si.signo() as u64, a],
        )?;
    }
    // A signal aimed at one thread, with the sender's own si_code, may only be queued by
    // that thread itself.
    for t in &p.threads {
        let inj = if t.tid == p.pid {
            h.injector()
        } else {
            threads.get(&t.tid).ok_or_else(|| crate::Error::Restore {
                pid: p.pid,
                what: format!("thread {} was not created", t.tid),
            })?
        };
        for si in &t.pending {
            let a = inj.write_scratch(128, &si.0)?;
            inj.syscall(
                "rt_tgsigqueueinfo",
                libc::SYS_rt_tgsigqueueinfo,
                &[h.pid as u64, t.tid as u64, si.signo() as u64, a],
            )?;
        }
    }
    Ok(())
}
