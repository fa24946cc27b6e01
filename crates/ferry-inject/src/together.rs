//! One injected call in each of several live threads at once.
//!
//! An injected call costs two ptrace stops, and most of a stop's cost is the tracer and the
//! thread waiting for each other to be scheduled. Run one at a time in many processes, the
//! calls of a checkpoint follow one another stop after stop; here every thread is let go to
//! its next stop first, then each is waited for, so that the stops of all the threads overlap.
//! Each thread goes through exactly the steps (and fail points) of [`Injector::syscall_raw`]:
//! parked on its `rt_sigreturn` sequence, a ferry killed at any instant leaves every thread
//! as it was.

use crate::{fault, Injector, Result};
use ferry_sys::ptrace;

/// One call for one thread: the injector, the call's name, number and arguments.
pub type Item<'a> = (&'a Injector, &'static str, i64, [u64; 6]);

/// Runs each item's call in its thread, the threads' stops overlapping, and returns each raw
/// result (a negative errno on failure), in order. A thread not parked on an `rt_sigreturn`
/// sequence has its call made on its own ([`Injector::syscall_raw`]). A thread that was let go
/// is always waited for, even after another failed; the first error is the answer.
pub fn syscalls(items: &[Item]) -> Result<Vec<i64>> {
    let parked = |inj: &Injector| inj.owned.as_ref().and_then(|o| o.parked);
    let mut first_err = None;
    // Up to the entry of each thread's rt_sigreturn.
    let mut running = Vec::with_capacity(items.len());
    for (i, (inj, ..)) in items.iter().enumerate() {
        if parked(inj).is_none() {
            continue;
        }
        inj.new_child.set(None);
        match inj.resume_to_syscall() {
            Ok(()) => running.push(i),
            Err(e) => {
                first_err = Some(e);
                break;
            }
        }
    }
    // Each entry becomes the call, which returns to the same sequence.
    let mut calling = Vec::with_capacity(running.len());
    for &i in &running {
        let (inj, call, nr, args) = &items[i];
        let step = || -> Result<()> {
            inj.wait_syscall_stop(call)?;
            if first_err.is_some() {
                return Ok(());
            }
            fault("entry");
            let mut r = parked(inj).expect("a parked thread");
            r.orig_rax = *nr as u64;
            let slots = [
                &mut r.rdi, &mut r.rsi, &mut r.rdx, &mut r.r10, &mut r.r8, &mut r.r9,
            ];
            for (slot, value) in slots.into_iter().zip(args.iter().copied()) {
                *slot = value;
            }
            ptrace::set_regs(inj.tid, &r).map_err(|e| inj.sys(e))?;
            fault("call");
            inj.resume_to_syscall()
        };
        match step() {
            Ok(()) if first_err.is_none() => calling.push(i),
            Ok(()) => {}
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    let mut out = vec![0i64; items.len()];
    for &i in &calling {
        let (inj, call, ..) = &items[i];
        let step = || -> Result<i64> {
            inj.wait_syscall_stop(call)?;
            fault("exit");
            let regs = ptrace::get_regs(inj.tid).map_err(|e| inj.sys(e))?;
            Ok(regs.rax as i64)
        };
        match step() {
            Ok(r) => out[i] = r,
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    for (i, (inj, call, nr, args)) in items.iter().enumerate() {
        if parked(inj).is_none() {
            out[i] = inj.syscall_raw(call, *nr, args)?;
        }
    }
    Ok(out)
}
