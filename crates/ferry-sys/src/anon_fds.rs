//! Descriptors backed by anonymous inodes: epoll(7), timerfd_create(2), signalfd(2),
//! inotify(7); and the calls that inspect them from outside: kcmp(KCMP_EPOLL_TFD),
//! open_by_handle_at(2).

use crate::{check, SysError, SysResult};
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

/// kcmp(2) type comparing a file with the target of an epoll item.
pub const KCMP_EPOLL_TFD: i32 = 7;
/// `_IOW('T', 0, u64)`: sets the expiration count of a timerfd (CONFIG_CHECKPOINT_RESTORE).
pub const TFD_IOC_SET_TICKS: libc::c_ulong = 0x4008_5400;
pub const TFD_TIMER_ABSTIME: i32 = 1;

/// Wraps a descriptor the kernel has just returned.
fn owned(op: &'static str, r: libc::c_long) -> SysResult<OwnedFd> {
    let fd = check(op, r)?;
    // SAFETY: the kernel just returned this new descriptor; we are its only owner.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

fn timespec(ns: u64) -> libc::timespec {
    libc::timespec {
        tv_sec: (ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (ns % 1_000_000_000) as libc::c_long,
    }
}

fn nanos(t: &libc::timespec) -> u64 {
    (t.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(t.tv_nsec as u64)
}

pub fn epoll_create1(flags: i32) -> SysResult<OwnedFd> {
    // SAFETY: plain integer argument.
    let r = unsafe { libc::epoll_create1(flags) };
    owned("epoll_create1", r as libc::c_long)
}

/// Whether descriptor `fd1` of `pid1` is the file registered as item (`tfd`, `toff`) of the
/// epoll instance at descriptor `efd` of `pid2` (`toff` counts earlier items with the same
/// `tfd`, in the order /proc/PID/fdinfo lists them).
pub fn kcmp_epoll_tfd(
    pid1: i32,
    fd1: i32,
    pid2: i32,
    efd: i32,
    tfd: i32,
    toff: u32,
) -> SysResult<bool> {
    // struct kcmp_epoll_slot { __u32 efd, tfd, toff; }
    let slot: [u32; 3] = [efd as u32, tfd as u32, toff];
    // SAFETY: slot is a valid kcmp_epoll_slot that outlives the call; the kernel only reads it.
    let r = unsafe {
        libc::syscall(
            libc::SYS_kcmp,
            pid1,
            pid2,
            KCMP_EPOLL_TFD,
            fd1 as libc::c_ulong,
            slot.as_ptr() as libc::c_ulong,
        )
    };
    Ok(check("kcmp(KCMP_EPOLL_TFD)", r)? == 0)
}

pub fn timerfd_create(clockid: i32, flags: i32) -> SysResult<OwnedFd> {
    // SAFETY: plain integer arguments.
    let r = unsafe { libc::timerfd_create(clockid, flags) };
    owned("timerfd_create", r as libc::c_long)
}

/// The time to the next expiration and the interval of a timerfd, in nanoseconds (0, 0 when
/// disarmed). Like a read(2), this accounts for expirations that have happened meanwhile.
pub fn timerfd_gettime(fd: RawFd) -> SysResult<(u64, u64)> {
    let mut cur = libc::itimerspec {
        it_interval: timespec(0),
        it_value: timespec(0),
    };
    // SAFETY: cur is a valid out-pointer to an itimerspec.
    let r = unsafe { libc::timerfd_gettime(fd, &mut cur) };
    check("timerfd_gettime", r as libc::c_long)?;
    Ok((nanos(&cur.it_value), nanos(&cur.it_interval)))
}

/// Arms (or with `value_ns` 0 disarms) a timerfd; `flags` as for timerfd_settime(2).
pub fn timerfd_settime(fd: RawFd, flags: i32, value_ns: u64, interval_ns: u64) -> SysResult<()> {
    let new = libc::itimerspec {
        it_interval: timespec(interval_ns),
        it_value: timespec(value_ns),
    };
    // SAFETY: new is a valid in-pointer; the old value is not asked for.
    let r = unsafe { libc::timerfd_settime(fd, flags, &new, std::ptr::null_mut()) };
    check("timerfd_settime", r as libc::c_long).map(drop)
}

/// Sets the number of expirations a read(2) of the timerfd will report (non-zero).
pub fn timerfd_set_ticks(fd: RawFd, ticks: u64) -> SysResult<()> {
    // SAFETY: the ioctl reads one u64 from the pointer, which is valid for the call.
    let r = unsafe { libc::ioctl(fd, TFD_IOC_SET_TICKS as _, &ticks as *const u64) };
    check("ioctl(TFD_IOC_SET_TICKS)", r as libc::c_long).map(drop)
}

/// The current time of clock `clockid`, in nanoseconds.
pub fn clock_now_ns(clockid: i32) -> SysResult<u64> {
    let mut t = timespec(0);
    // SAFETY: t is a valid out-pointer to a timespec.
    let r = unsafe { libc::clock_gettime(clockid, &mut t) };
    check("clock_gettime", r as libc::c_long)?;
    Ok(nanos(&t))
}

/// A new signalfd for the signals in `mask` (bit `n - 1` stands for signal `n`).
pub fn signalfd(mask: u64, flags: i32) -> SysResult<OwnedFd> {
    // SAFETY: mask is a valid 8-byte kernel sigset_t that outlives the call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_signalfd4,
            -1,
            &mask as *const u64,
            std::mem::size_of::<u64>(),
            flags,
        )
    };
    owned("signalfd4", r)
}

pub fn inotify_init1(flags: i32) -> SysResult<OwnedFd> {
    // SAFETY: plain integer argument.
    let r = unsafe { libc::inotify_init1(flags) };
    owned("inotify_init1", r as libc::c_long)
}

pub fn inotify_add_watch(fd: RawFd, path: &str, mask: u32) -> SysResult<i32> {
    let c = std::ffi::CString::new(path)
        .map_err(|_| SysError::new("inotify_add_watch (path has NUL)", libc::EINVAL))?;
    // SAFETY: c is a valid NUL-terminated string.
    let r = unsafe { libc::inotify_add_watch(fd, c.as_ptr(), mask) };
    check("inotify_add_watch", r as libc::c_long).map(|wd| wd as i32)
}

pub fn fanotify_init(flags: u32, event_f_flags: u32) -> SysResult<OwnedFd> {
    // SAFETY: plain integer arguments.
    let r = unsafe { libc::fanotify_init(flags, event_f_flags) };
    owned("fanotify_init", r as libc::c_long)
}

/// fanotify_mark(2) of the object at `path` (looked up from the current directory).
pub fn fanotify_mark(fd: RawFd, flags: u32, mask: u64, path: &str) -> SysResult<()> {
    let c = std::ffi::CString::new(path)
        .map_err(|_| SysError::new("fanotify_mark (path has NUL)", libc::EINVAL))?;
    // SAFETY: c is a valid NUL-terminated string; the other arguments are integers.
    let r = unsafe { libc::fanotify_mark(fd, flags, mask, libc::AT_FDCWD, c.as_ptr()) };
    check("fanotify_mark", r as libc::c_long).map(drop)
}

pub fn inotify_rm_watch(fd: RawFd, wd: i32) -> SysResult<()> {
    // SAFETY: plain integer arguments.
    let r = unsafe { libc::inotify_rm_watch(fd, wd) };
    check("inotify_rm_watch", r as libc::c_long).map(drop)
}

/// Opens the file that the file handle (`handle_type`, `handle`) names on the filesystem
/// holding `mount_fd` (needs CAP_DAC_READ_SEARCH).
pub fn open_by_handle_at(
    mount_fd: RawFd,
    handle_type: i32,
    handle: &[u8],
    flags: i32,
) -> SysResult<OwnedFd> {
    // struct file_handle { u32 handle_bytes; int handle_type; unsigned char f_handle[]; },
    // built in u32 words so that the header is aligned.
    let mut words = vec![0u32; 2 + handle.len().div_ceil(4)];
    words[0] = handle.len() as u32;
    words[1] = handle_type as u32;
    for (i, b) in handle.iter().enumerate() {
        let w = &mut words[2 + i / 4];
        let mut bytes = w.to_ne_bytes();
        bytes[i % 4] = *b;
        *w = u32::from_ne_bytes(bytes);
    }
    // SAFETY: words holds a complete file_handle of handle.len() bytes, valid for the call;
    // the kernel only reads it.
    let r = unsafe { libc::syscall(libc::SYS_open_by_handle_at, mount_fd, words.as_ptr(), flags) };
    owned("open_by_handle_at", r)
}

/// Whether `fd` is readable right now (poll(2) with no timeout); for an epoll instance:
/// whether any of its items is ready.
pub fn readable_now(fd: RawFd) -> SysResult<bool> {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: p is one valid pollfd for the call.
    let r = unsafe { libc::poll(&mut p, 1, 0) };
    Ok(check("poll", r as libc::c_long)? > 0)
}
