//! ptrace(2): seize, interrupt, resume to system calls, registers, signal masks and queues of a stopped thread.

use crate::regs::GpRegs;
use crate::{check, SysError, SysResult};

/// System call stops report SIGTRAP | 0x80, told apart from a real SIGTRAP.
pub const PTRACE_O_TRACESYSGOOD: u64 = 1;
pub const SYSCALL_STOP_SIG: i32 = libc::SIGTRAP | 0x80;
pub const PTRACE_O_TRACEFORK: u64 = 2;
pub const PTRACE_O_TRACECLONE: u64 = 8;
pub const PTRACE_O_EXITKILL: u64 = 0x100000;
/// While traced, the tracee's seccomp filters do not apply (to the calls we inject into it).
pub const PTRACE_O_SUSPEND_SECCOMP: u64 = 0x200000;
pub const PTRACE_EVENT_FORK: i32 = 1;
pub const PTRACE_EVENT_CLONE: i32 = 3;
pub const PTRACE_EVENT_STOP: i32 = 128;

const PTRACE_SEIZE: libc::c_uint = 0x4206;
const PTRACE_INTERRUPT: libc::c_uint = 0x4207;
const PTRACE_PEEKSIGINFO: libc::c_uint = 0x4209;
const PTRACE_GETSIGMASK: libc::c_uint = 0x420a;
const PTRACE_SETSIGMASK: libc::c_uint = 0x420b;
const PTRACE_GET_RSEQ_CONFIGURATION: libc::c_uint = 0x420f;
const PTRACE_GETREGSET: libc::c_uint = 0x4204;
const PTRACE_SETREGSET: libc::c_uint = 0x4205;
const NT_X86_XSTATE: usize = 0x202;
const PTRACE_PEEKSIGINFO_SHARED: u32 = 1;

/// Largest XSAVE area the kernel may hand back (AMX tiles included).
const XSTATE_MAX: usize = 16384;

fn ptrace(
    op: &'static str,
    req: libc::c_uint,
    tid: i32,
    addr: usize,
    data: usize,
) -> SysResult<libc::c_long> {
    // SAFETY: every caller passes addr/data that are either plain integers or pointers to live
    // buffers of the size the request writes or reads.
    let r = unsafe {
        libc::ptrace(
            req,
            tid,
            addr as *mut libc::c_void,
            data as *mut libc::c_void,
        )
    };
    check(op, r)
}

pub fn seize(tid: i32, options: u64) -> SysResult<()> {
    ptrace(
        "ptrace(PTRACE_SEIZE)",
        PTRACE_SEIZE,
        tid,
        0,
        options as usize,
    )
    .map(drop)
}

/// PTRACE_SETOPTIONS: replaces the tracing options of a stopped tracee.
pub fn set_options(tid: i32, options: u64) -> SysResult<()> {
    ptrace(
        "ptrace(PTRACE_SETOPTIONS)",
        libc::PTRACE_SETOPTIONS,
        tid,
        0,
        options as usize,
    )
    .map(drop)
}

pub fn interrupt(tid: i32) -> SysResult<()> {
    ptrace("ptrace(PTRACE_INTERRUPT)", PTRACE_INTERRUPT, tid, 0, 0).map(drop)
}

pub fn cont(tid: i32, sig: i32) -> SysResult<()> {
    ptrace(
        "ptrace(PTRACE_CONT)",
        libc::PTRACE_CONT,
        tid,
        0,
        sig as usize,
    )
    .map(drop)
}

/// PTRACE_LISTEN: lets a tracee in group-stop wait for SIGCONT (or a kill) while still stopped;
/// the tracer hears of what wakes it with a new PTRACE_EVENT_STOP.
pub fn listen(tid: i32) -> SysResult<()> {
    ptrace("ptrace(PTRACE_LISTEN)", 0x4208, tid, 0, 0).map(drop)
}

/// PTRACE_SYSCALL: resumes a stopped tracee until its next system call entry or exit. Unlike
/// a single step, nothing of it outlives the tracer: the kernel clears the syscall-trace flag
/// when the tracer detaches or dies.
pub fn syscall(tid: i32, sig: i32) -> SysResult<()> {
    ptrace(
        "ptrace(PTRACE_SYSCALL)",
        libc::PTRACE_SYSCALL,
        tid,
        0,
        sig as usize,
    )
    .map(drop)
}

pub fn detach(tid: i32, sig: i32) -> SysResult<()> {
    ptrace(
        "ptrace(PTRACE_DETACH)",
        libc::PTRACE_DETACH,
        tid,
        0,
        sig as usize,
    )
    .map(drop)
}

pub fn get_event_msg(tid: i32) -> SysResult<u64> {
    let mut msg: libc::c_ulong = 0;
    ptrace(
        "ptrace(PTRACE_GETEVENTMSG)",
        libc::PTRACE_GETEVENTMSG,
        tid,
        0,
        &mut msg as *mut _ as usize,
    )?;
    Ok(msg)
}

pub fn get_regs(tid: i32) -> SysResult<GpRegs> {
    let mut regs = crate::regs::zeroed_gp();
    ptrace(
        "ptrace(PTRACE_GETREGS)",
        libc::PTRACE_GETREGS,
        tid,
        0,
        &mut regs as *mut _ as usize,
    )?;
    Ok(regs)
}

pub fn set_regs(tid: i32, regs: &GpRegs) -> SysResult<()> {
    ptrace(
        "ptrace(PTRACE_SETREGS)",
        libc::PTRACE_SETREGS,
        tid,
        0,
        regs as *const _ as usize,
    )
    .map(drop)
}

/// The thread's XSAVE area (x87, SSE, AVX, AVX-512 ... state), exactly as the kernel reports it.
pub fn get_xstate(tid: i32) -> SysResult<Vec<u8>> {
    let mut buf = vec![0u8; XSTATE_MAX];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    ptrace(
        "ptrace(PTRACE_GETREGSET, NT_X86_XSTATE)",
        PTRACE_GETREGSET,
        tid,
        NT_X86_XSTATE,
        &mut iov as *mut _ as usize,
    )?;
    buf.truncate(iov.iov_len);
    Ok(buf)
}

pub fn set_xstate(tid: i32, xstate: &[u8]) -> SysResult<()> {
    let mut copy = xstate.to_vec();
    let mut iov = libc::iovec {
        iov_base: copy.as_mut_ptr().cast(),
        iov_len: copy.len(),
    };
    ptrace(
        "ptrace(PTRACE_SETREGSET, NT_X86_XSTATE)",
        PTRACE_SETREGSET,
        tid,
        NT_X86_XSTATE,
        &mut iov as *mut _ as usize,
    )
    .map(drop)
}

pub fn get_sigmask(tid: i32) -> SysResult<u64> {
    let mut mask: u64 = 0;
    ptrace(
        "ptrace(PTRACE_GETSIGMASK)",
        PTRACE_GETSIGMASK,
        tid,
        8,
        &mut mask as *mut _ as usize,
    )?;
    Ok(mask)
}

pub fn set_sigmask(tid: i32, mask: u64) -> SysResult<()> {
    ptrace(
        "ptrace(PTRACE_SETSIGMASK)",
        PTRACE_SETSIGMASK,
        tid,
        8,
        &mask as *const _ as usize,
    )
    .map(drop)
}

/// Raw 128-byte siginfo records of the signals queued for a thread (or, with `shared`, for its
/// whole thread group), without dequeuing them.
pub fn peek_siginfo(tid: i32, shared: bool) -> SysResult<Vec<[u8; 128]>> {
    #[repr(C)]
    struct PeekArgs {
        off: u64,
        flags: u32,
        nr: i32,
    }
    let mut out = Vec::new();
    loop {
        let mut buf = [[0u8; 128]; 32];
        let args = PeekArgs {
            off: out.len() as u64,
            flags: if shared { PTRACE_PEEKSIGINFO_SHARED } else { 0 },
            nr: 32,
        };
        let n = ptrace(
            "ptrace(PTRACE_PEEKSIGINFO)",
            PTRACE_PEEKSIGINFO,
            tid,
            &args as *const _ as usize,
            buf.as_mut_ptr() as usize,
        )? as usize;
        out.extend_from_slice(&buf[..n]);
        if n < 32 {
            return Ok(out);
        }
    }
}

/// The siginfo of the signal a thread is stopped for (in a signal-delivery stop).
pub fn get_siginfo(tid: i32) -> SysResult<[u8; 128]> {
    let mut buf = [0u8; 128];
    ptrace(
        "ptrace(PTRACE_GETSIGINFO)",
        libc::PTRACE_GETSIGINFO,
        tid,
        0,
        buf.as_mut_ptr() as usize,
    )?;
    Ok(buf)
}

/// rseq registration of a thread: (area address, area length, signature).
pub fn get_rseq(tid: i32) -> SysResult<(u64, u32, u32)> {
    #[repr(C)]
    #[derive(Default)]
    struct RseqConf {
        rseq_abi_pointer: u64,
        rseq_abi_size: u32,
        signature: u32,
        flags: u32,
        pad: u32,
    }
    let mut conf = RseqConf::default();
    ptrace(
        "ptrace(PTRACE_GET_RSEQ_CONFIGURATION)",
        PTRACE_GET_RSEQ_CONFIGURATION,
        tid,
        std::mem::size_of::<RseqConf>(),
        &mut conf as *mut _ as usize,
    )?;
    Ok((conf.rseq_abi_pointer, conf.rseq_abi_size, conf.signature))
}

/// The robust futex list head of a thread (address, length).
pub fn get_robust_list(tid: i32) -> SysResult<(u64, u64)> {
    let mut head: u64 = 0;
    let mut len: usize = 0;
    // SAFETY: the kernel writes one pointer and one size_t into the two locals.
    let r = unsafe {
        libc::syscall(
            libc::SYS_get_robust_list,
            tid,
            &mut head as *mut u64,
            &mut len as *mut usize,
        )
    };
    check("get_robust_list", r)?;
    Ok((head, len as u64))
}

/// Sends a signal to one thread of one process.
pub fn tgkill(tgid: i32, tid: i32, sig: i32) -> SysResult<()> {
    // SAFETY: plain integer arguments.
    let r = unsafe { libc::syscall(libc::SYS_tgkill, tgid, tid, sig) };
    check("tgkill", r).map(drop)
}

pub fn kill(pid: i32, sig: i32) -> SysResult<()> {
    // SAFETY: plain integer arguments.
    let r = unsafe { libc::kill(pid, sig) };
    check("kill", r as libc::c_long).map(drop)
}

pub fn errno_is(e: &SysError, errno: i32) -> bool {
    e.errno == errno
}

const PTRACE_SECCOMP_GET_FILTER: libc::c_uint = 0x420c;
const PTRACE_SECCOMP_GET_METADATA: libc::c_uint = 0x420d;

/// The classic BPF program of seccomp filter `index` of thread `tid` (0: the oldest, as the
/// kernel counts; ptrace(2) says otherwise), as raw `struct sock_filter`s (8 bytes each); `None` past the last filter, or if
/// the thread has none (it is not in filter mode).
pub fn seccomp_filter(tid: i32, index: u64) -> SysResult<Option<Vec<u8>>> {
    let op = "ptrace(PTRACE_SECCOMP_GET_FILTER)";
    let count = match ptrace(op, PTRACE_SECCOMP_GET_FILTER, tid, index as usize, 0) {
        Ok(n) => n as usize,
        Err(e) if e.errno == libc::ENOENT || e.errno == libc::EINVAL => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut buf = vec![0u8; count * 8];
    // The request writes `count` instructions into `buf`, which holds exactly that many.
    ptrace(
        op,
        PTRACE_SECCOMP_GET_FILTER,
        tid,
        index as usize,
        buf.as_mut_ptr() as usize,
    )?;
    Ok(Some(buf))
}

/// The flags seccomp filter `index` of thread `tid` was installed with (SECCOMP_FILTER_FLAG_*).
pub fn seccomp_filter_flags(tid: i32, index: u64) -> SysResult<u64> {
    // struct seccomp_metadata { __u64 filter_off; __u64 flags; }
    let mut meta = [index, 0u64];
    ptrace(
        "ptrace(PTRACE_SECCOMP_GET_METADATA)",
        PTRACE_SECCOMP_GET_METADATA,
        tid,
        std::mem::size_of_val(&meta),
        meta.as_mut_ptr() as usize,
    )?;
    Ok(meta[1])
}
