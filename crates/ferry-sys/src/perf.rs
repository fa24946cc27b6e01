//! Counting a thread's system calls of a given set (perf_event_open on the
//! `raw_syscalls:sys_enter` tracepoint, with a filter on the call's number), without stopping
//! it: how the engine knows that a process made none of the calls that change its mappings'
//! flags between a read of /proc/PID/smaps before a freeze and the freeze itself.

use crate::{check, SysError, SysResult};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

const PERF_TYPE_TRACEPOINT: u32 = 2;
/// `disabled`: enabled once its filter is set.
const ATTR_DISABLED: u64 = 1 << 0;
/// `inherit`: threads and processes the thread creates afterwards are counted too, in this
/// counter.
const ATTR_INHERIT: u64 = 1 << 1;
const PERF_FLAG_FD_CLOEXEC: libc::c_ulong = 1 << 3;
// _IO('$', 0)
const PERF_EVENT_IOC_ENABLE: u64 = 0x2400;
// _IOW('$', 6, char *)
const PERF_EVENT_IOC_SET_FILTER: u64 = 0x4008_2406;

/// struct perf_event_attr as of its first version (PERF_ATTR_SIZE_VER0, 64 bytes), which every
/// kernel accepts; the bit fields are `flags`.
#[repr(C)]
#[derive(Default)]
struct Attr {
    kind: u32,
    size: u32,
    config: u64,
    sample_period: u64,
    sample_type: u64,
    read_format: u64,
    flags: u64,
    wakeup_events: u32,
    bp_type: u32,
    config1: u64,
}

/// Where tracefs may be, in the order tried.
const TRACEFS: [&str; 2] = ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"];

/// The id of tracepoint `group:name` (`raw_syscalls`, `sys_enter`), from tracefs; None if
/// tracefs is not mounted here or the kernel has no such event.
pub fn tracepoint_id(group: &str, name: &str) -> Option<u64> {
    TRACEFS.iter().find_map(|t| {
        std::fs::read_to_string(format!("{t}/events/{group}/{name}/id"))
            .ok()?
            .trim()
            .parse()
            .ok()
    })
}

/// The id of the `raw_syscalls:sys_enter` tracepoint (every system call's entry, its number
/// in the field `id`).
pub fn sys_enter_id() -> Option<u64> {
    tracepoint_id("raw_syscalls", "sys_enter")
}

/// A counter of the calls of a set that one thread (and every thread or process it creates
/// from now on) enters.
#[derive(Debug)]
pub struct SyscallCounter {
    fd: OwnedFd,
}

impl SyscallCounter {
    /// Starts counting the hits of tracepoint `tracepoint` (an id from [`tracepoint_id`]) by
    /// thread `tid` that pass `filter` (ftrace's filter syntax on the event's fields, e.g.
    /// `id == 28 || id == 9` for `raw_syscalls:sys_enter`).
    pub fn open(tid: i32, tracepoint: u64, filter: &str) -> SysResult<SyscallCounter> {
        let attr = Attr {
            kind: PERF_TYPE_TRACEPOINT,
            size: std::mem::size_of::<Attr>() as u32,
            config: tracepoint,
            flags: ATTR_DISABLED | ATTR_INHERIT,
            ..Default::default()
        };
        // SAFETY: `attr` is a struct perf_event_attr of the size it declares, alive for the
        // call; the other arguments are plain integers (a thread, any CPU, no group).
        let fd = check("perf_event_open", unsafe {
            libc::syscall(
                libc::SYS_perf_event_open,
                &attr as *const Attr,
                tid as libc::c_long,
                -1 as libc::c_long,
                -1 as libc::c_long,
                PERF_FLAG_FD_CLOEXEC,
            )
        })?;
        // SAFETY: perf_event_open returned a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        let filter = std::ffi::CString::new(filter)
            .map_err(|_| SysError::new("perf event filter", libc::EINVAL))?;
        // SAFETY: the filter is a NUL-terminated string alive for the call; the descriptor
        // is the event just opened.
        check("ioctl(PERF_EVENT_IOC_SET_FILTER)", unsafe {
            libc::ioctl(
                fd.as_raw_fd(),
                PERF_EVENT_IOC_SET_FILTER as _,
                filter.as_ptr(),
            ) as libc::c_long
        })?;
        // SAFETY: a plain ioctl on our own perf event descriptor, no argument.
        check("ioctl(PERF_EVENT_IOC_ENABLE)", unsafe {
            libc::ioctl(fd.as_raw_fd(), PERF_EVENT_IOC_ENABLE as _, 0) as libc::c_long
        })?;
        Ok(SyscallCounter { fd })
    }

    /// How many of the calls were entered since [`SyscallCounter::open`] (by the thread and
    /// all it created since).
    pub fn count(&self) -> SysResult<u64> {
        let mut v = 0u64;
        // SAFETY: reads 8 bytes (the counter's value, read_format 0) into `v`.
        let n = unsafe {
            libc::read(
                self.fd.as_raw_fd(),
                &mut v as *mut u64 as *mut libc::c_void,
                8,
            )
        };
        if n != 8 {
            return Err(if n < 0 {
                SysError::last("read(perf event)")
            } else {
                SysError::new("read(perf event)", libc::EIO)
            });
        }
        Ok(v)
    }
}
