//! What lets a thread put itself back if its tracer dies while calls are injected into it.
//!
//! A tracer that dies lets its tracees run on from wherever they are stopped, with whatever
//! registers it gave them. So while calls are injected into a thread, that thread is always
//! *parked* on an `rt_sigreturn`: its instruction pointer at a `mov $15, %rax; syscall`
//! sequence that the process already has (glibc's and musl's `__restore_rt`, Go's
//! `runtime.sigreturn`), its stack pointer at a signal frame that Ferry wrote below the red
//! zone, holding the thread's own registers, FPU/AVX state and signal mask. Each injected call
//! is made by changing, at the syscall-entry stop of that `rt_sigreturn`, the call number and
//! arguments; the call then returns to the same sequence. Alone, at any instant, the thread
//! would run `rt_sigreturn` and be exactly as it was (see [`frame`] for the one difference).

use ferry_sys::proc_mem::ProcMem;
use ferry_sys::regs::GpRegs;
use std::cell::RefCell;
use std::collections::HashMap;

/// `mov $15, %rax; syscall` and `mov $15, %eax; syscall` (rt_sigreturn is 15 on x86_64).
const SEQUENCES: [&[u8]; 2] = [
    &[0x48, 0xc7, 0xc0, 0x0f, 0, 0, 0, 0x0f, 0x05],
    &[0xb8, 0x0f, 0, 0, 0, 0x0f, 0x05],
];

/// Size of the part of a `struct ucontext` that `rt_sigreturn` reads (flags, link, stack,
/// sigcontext, mask).
pub const UCONTEXT_LEN: u64 = 304;
const UC_FP_XSTATE: u64 = 1;
const UC_SIGCONTEXT_SS: u64 = 2;
const UC_STRICT_RESTORE_SS: u64 = 4;
const FP_XSTATE_MAGIC1: u32 = 0x4650_5853;
const FP_XSTATE_MAGIC2: u32 = 0x4650_5845;
/// Offset of `sw_reserved` in the legacy FXSAVE area.
const SW_RESERVED: usize = 464;
const SYS_RESTART_SYSCALL: u64 = 219;
const X86_EFLAGS_TF: u64 = 0x100;

thread_local! {
    /// Where each process's sequence was found, checked again before each use.
    static FOUND: RefCell<HashMap<i32, (u64, usize)>> = RefCell::new(HashMap::new());
}

/// The address of a `mov $15, %rax; syscall` sequence in an executable mapping of `pid` (libc
/// first), or `None` if the process has none.
pub fn find_sigreturn(pid: i32, mem: &ProcMem) -> Option<u64> {
    if let Some((at, len)) = FOUND.with(|f| f.borrow().get(&pid).copied()) {
        let mut b = vec![0u8; len];
        if mem.read_exact(at, &mut b).is_ok() && SEQUENCES.contains(&b.as_slice()) {
            return Some(at);
        }
    }
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    let mut candidates: Vec<(u64, u64, bool)> = Vec::new();
    for line in maps.lines() {
        let mut it = line.split_whitespace();
        let (Some(range), Some(perms)) = (it.next(), it.next()) else {
            continue;
        };
        if !perms.contains('x') || line.ends_with("[vsyscall]") {
            continue;
        }
        let Some((s, e)) = range.split_once('-') else {
            continue;
        };
        let (Ok(s), Ok(e)) = (u64::from_str_radix(s, 16), u64::from_str_radix(e, 16)) else {
            continue;
        };
        let libc = line.contains("/libc.so") || line.contains("/libc-") || line.contains("musl");
        candidates.push((s, e, libc));
    }
    candidates.sort_by_key(|c| !c.2);
    for (start, end, _) in candidates {
        let mut addr = start;
        while addr < end {
            let len = (end - addr).min(1 << 18) as usize;
            let mut buf = vec![0u8; len];
            if mem.read_exact(addr, &mut buf).is_err() {
                break;
            }
            for seq in SEQUENCES {
                if let Some(i) = buf.windows(seq.len()).position(|w| w == seq) {
                    let at = addr + i as u64;
                    FOUND.with(|f| f.borrow_mut().insert(pid, (at, seq.len())));
                    return Some(at);
                }
            }
            if addr + len as u64 >= end {
                break;
            }
            // Step back so that a sequence split across two reads is still seen.
            addr += len as u64 - 16;
        }
    }
    None
}

/// The registers a thread resumes with when it is let go from anywhere but the stop the kernel
/// left it in: a system call it was interrupted in is rewound to be issued again (the kernel's
/// own restart logic runs only on the way out of a signal stop, and `rt_sigreturn` disables it).
pub fn resumable(base: &GpRegs) -> GpRegs {
    let mut r = *base;
    if r.orig_rax as i64 >= 0 {
        match -(r.rax as i64) {
            512..=514 => {
                r.rax = r.orig_rax;
                r.rip -= 2;
            }
            516 => {
                r.rax = SYS_RESTART_SYSCALL;
                r.rip -= 2;
            }
            _ => {}
        }
        r.orig_rax = u64::MAX;
    }
    r
}

/// The registers of a thread parked on the sequence at `sigreturn_at` with the frame whose
/// `ucontext` is at `uc`.
pub fn parked(base: &GpRegs, sigreturn_at: u64, uc: u64) -> GpRegs {
    let mut r = *base;
    r.rip = sigreturn_at;
    r.rsp = uc;
    r.rax = 15;
    r.orig_rax = u64::MAX;
    r.eflags &= !X86_EFLAGS_TF;
    r
}

/// A signal frame for `rt_sigreturn`: the `ucontext` (to be written at `uc`) and the XSAVE
/// area (at `fp`, 64-byte aligned) that it points to, as one byte string from `uc`.
///
/// `rt_sigreturn` puts back the registers (`resumable(base)`), the signal mask and the whole
/// FPU/AVX state. It leaves the alternate signal stack alone: the frame's `uc_stack` has an
/// invalid mode, which `restore_altstack` ignores. What it cannot keep is a system call's
/// restart block: a thread that was sleeping with a deadline (nanosleep, clock_nanosleep,
/// poll, a futex wait with a timeout) sees its call fail with EINTR instead of going on.
pub fn frame(base: &GpRegs, mask: u64, xstate: &[u8], uc: u64, fp: u64) -> Vec<u8> {
    let r = resumable(base);
    let mut out = Vec::with_capacity((fp - uc) as usize + xstate.len() + 4);
    let mut put = |v: u64| out.extend_from_slice(&v.to_ne_bytes());
    put(UC_FP_XSTATE | UC_SIGCONTEXT_SS | UC_STRICT_RESTORE_SS);
    put(0); // uc_link
    put(0); // uc_stack.ss_sp
    put(3); // uc_stack.ss_flags: neither 0, SS_ONSTACK nor SS_DISABLE (and padding)
    put(0); // uc_stack.ss_size
    for v in [
        r.r8, r.r9, r.r10, r.r11, r.r12, r.r13, r.r14, r.r15, r.rdi, r.rsi, r.rbp, r.rbx, r.rdx,
        r.rax, r.rcx, r.rsp, r.rip, r.eflags,
    ] {
        put(v);
    }
    // cs, gs, fs, ss (16 bits each).
    put((r.cs & 0xffff) | (r.ss & 0xffff) << 48);
    for _ in 0..4 {
        put(0); // err, trapno, oldmask, cr2
    }
    put(fp);
    for _ in 0..8 {
        put(0);
    }
    put(mask);
    debug_assert_eq!(out.len() as u64, UCONTEXT_LEN);
    out.resize((fp - uc) as usize, 0);
    let at = out.len();
    out.extend_from_slice(xstate);
    // The software-reserved bytes a signal frame carries: without them the kernel restores
    // only the legacy x87/SSE state.
    let xfeatures = u64::from_ne_bytes(
        xstate[SW_RESERVED..SW_RESERVED + 8]
            .try_into()
            .expect("8 bytes"),
    );
    let mut sw = Vec::with_capacity(48);
    sw.extend_from_slice(&FP_XSTATE_MAGIC1.to_ne_bytes());
    sw.extend_from_slice(&(xstate.len() as u32 + 4).to_ne_bytes());
    sw.extend_from_slice(&xfeatures.to_ne_bytes());
    sw.extend_from_slice(&(xstate.len() as u32).to_ne_bytes());
    sw.resize(48, 0);
    out[at + SW_RESERVED..at + SW_RESERVED + 48].copy_from_slice(&sw);
    out.extend_from_slice(&FP_XSTATE_MAGIC2.to_ne_bytes());
    out
}
