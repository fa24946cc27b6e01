//! userfaultfd(2) ioctls on a descriptor made inside another process (whose address space it
//! then serves): registering ranges for missing-page handling, filling them with
//! `UFFDIO_COPY` (which allocates each page and copies into it without clearing it first and
//! without a page fault) or `UFFDIO_ZEROPAGE`, waking threads with `UFFDIO_WAKE`, and reading
//! the fault and event messages ([`read_msgs`]) a handler answers.

use crate::{SysError, SysResult};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// The API version the kernel's header calls `UFFD_API`.
const UFFD_API: u64 = 0xaa;
/// Faults in registered ranges fail with SIGBUS (EFAULT for a remote access such as
/// process_vm_writev) instead of waiting for a handler.
pub const FEATURE_SIGBUS: u64 = 1 << 7;
/// A fork of the served process hands the handler a new userfaultfd for the child
/// ([`Msg::Fork`]); without it the child's registered ranges would be unregistered (and its
/// missing pages zero-filled).
pub const FEATURE_EVENT_FORK: u64 = 1 << 1;
/// mremap(2) of a registered range is reported ([`Msg::Remap`]).
pub const FEATURE_EVENT_REMAP: u64 = 1 << 2;
/// madvise(MADV_DONTNEED/MADV_REMOVE) of a registered range is reported ([`Msg::Remove`]).
pub const FEATURE_EVENT_REMOVE: u64 = 1 << 3;
/// munmap(2) (and mremap's shrinking) of a registered range is reported ([`Msg::Unmap`]).
pub const FEATURE_EVENT_UNMAP: u64 = 1 << 6;
const REGISTER_MODE_MISSING: u64 = 1;

// _IOWR(0xAA, 0x3F, struct uffdio_api) and friends, as the kernel's header defines them.
const UFFDIO_API: u64 = 0xc018_aa3f;
const UFFDIO_REGISTER: u64 = 0xc020_aa00;
const UFFDIO_UNREGISTER: u64 = 0x8010_aa01;
const UFFDIO_WAKE: u64 = 0x8010_aa02;
const UFFDIO_COPY: u64 = 0xc028_aa03;
const UFFDIO_ZEROPAGE: u64 = 0xc020_aa04;
/// `UFFDIO_COPY_MODE_DONTWAKE`: the caller wakes the faulting threads itself, once.
pub const COPY_MODE_DONTWAKE: u64 = 1;

#[repr(C)]
struct Api {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
struct Range {
    start: u64,
    len: u64,
}

#[repr(C)]
struct Register {
    range: Range,
    mode: u64,
    ioctls: u64,
}

#[repr(C)]
struct Copy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    copy: i64,
}

#[repr(C)]
struct Zeropage {
    range: Range,
    mode: u64,
    zeropage: i64,
}

fn ioctl<T>(fd: BorrowedFd<'_>, op: &'static str, request: u64, arg: &mut T) -> SysResult<()> {
    // SAFETY: `arg` is the #[repr(C)] struct the kernel's header gives `request`, and lives
    // (mutably borrowed) for the whole call; the one pointer inside such a struct
    // (UFFDIO_COPY's source) points into a slice `copy` borrows for the call.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), request as _, arg as *mut T) };
    if r < 0 {
        return Err(SysError::last(op));
    }
    Ok(())
}

/// Enables the API on a fresh userfaultfd with `features`.
pub fn api(fd: BorrowedFd<'_>, features: u64) -> SysResult<()> {
    let mut a = Api {
        api: UFFD_API,
        features,
        ioctls: 0,
    };
    ioctl(fd, "UFFDIO_API", UFFDIO_API, &mut a)
}

/// Registers `[start, start+len)` of the served address space for missing-page handling.
pub fn register_missing(fd: BorrowedFd<'_>, start: u64, len: u64) -> SysResult<()> {
    let mut r = Register {
        range: Range { start, len },
        mode: REGISTER_MODE_MISSING,
        ioctls: 0,
    };
    ioctl(fd, "UFFDIO_REGISTER", UFFDIO_REGISTER, &mut r)
}

pub fn unregister(fd: BorrowedFd<'_>, start: u64, len: u64) -> SysResult<()> {
    let mut r = Range { start, len };
    ioctl(fd, "UFFDIO_UNREGISTER", UFFDIO_UNREGISTER, &mut r)
}

/// Copies `src` to `dst` in the served address space (page-aligned, a whole number of pages),
/// allocating its pages. Returns how many bytes were copied; on an error, also how many were
/// copied before it (a page already present gives EEXIST there).
pub fn copy(fd: BorrowedFd<'_>, dst: u64, src: &[u8]) -> Result<usize, (SysError, usize)> {
    let mut c = Copy {
        dst,
        src: src.as_ptr() as u64,
        len: src.len() as u64,
        mode: 0,
        copy: 0,
    };
    match ioctl(fd, "UFFDIO_COPY", UFFDIO_COPY, &mut c) {
        Ok(()) => Ok(c.copy as usize),
        // `copy` holds the bytes done, or a negative errno when none were.
        Err(e) => Err((e, c.copy.max(0) as usize)),
    }
}

/// Copies `src` to `dst` as [`copy`] does, with `mode` ([`COPY_MODE_DONTWAKE`] or 0).
pub fn copy_mode(
    fd: BorrowedFd<'_>,
    dst: u64,
    src: &[u8],
    mode: u64,
) -> Result<usize, (SysError, usize)> {
    let mut c = Copy {
        dst,
        src: src.as_ptr() as u64,
        len: src.len() as u64,
        mode,
        copy: 0,
    };
    match ioctl(fd, "UFFDIO_COPY", UFFDIO_COPY, &mut c) {
        Ok(()) => Ok(c.copy as usize),
        Err(e) => Err((e, c.copy.max(0) as usize)),
    }
}

/// Maps the zero page over `[dst, dst+len)` of the served address space (missing pages that
/// read as zeros until written). Returns the bytes done; on an error, also how many were done
/// before it (EEXIST: a page already present).
pub fn zeropage(fd: BorrowedFd<'_>, dst: u64, len: u64) -> Result<usize, (SysError, usize)> {
    let mut z = Zeropage {
        range: Range { start: dst, len },
        mode: 0,
        zeropage: 0,
    };
    match ioctl(fd, "UFFDIO_ZEROPAGE", UFFDIO_ZEROPAGE, &mut z) {
        Ok(()) => Ok(z.zeropage as usize),
        Err(e) => Err((e, z.zeropage.max(0) as usize)),
    }
}

/// Wakes the threads waiting on a fault in `[start, start+len)` (after a fill that did not
/// wake them, or one that found the page already there).
pub fn wake(fd: BorrowedFd<'_>, start: u64, len: u64) -> SysResult<()> {
    let mut r = Range { start, len };
    ioctl(fd, "UFFDIO_WAKE", UFFDIO_WAKE, &mut r)
}

const EVENT_PAGEFAULT: u8 = 0x12;
const EVENT_FORK: u8 = 0x13;
const EVENT_REMAP: u8 = 0x14;
const EVENT_REMOVE: u8 = 0x15;
const EVENT_UNMAP: u8 = 0x16;
/// `sizeof(struct uffd_msg)`.
const MSG_LEN: usize = 32;

/// A message read from a userfaultfd.
#[derive(Debug)]
pub enum Msg {
    /// A thread touched a missing page at `address` (`write`: on a write access).
    Pagefault { address: u64, write: bool },
    /// The served process forked: `child` serves the child's address space (a descriptor of
    /// ours, close-on-exec and non-blocking like the parent's).
    Fork { child: OwnedFd },
    /// `[from, from+len)` moved to `[to, to+len)` (mremap).
    Remap { from: u64, to: u64, len: u64 },
    /// `[start, end)` was dropped with madvise: its pages are missing again and must read as
    /// zeros (private anonymous memory).
    Remove { start: u64, end: u64 },
    /// `[start, end)` was unmapped.
    Unmap { start: u64, end: u64 },
    /// A message this wrapper does not know (its event number).
    Other(u8),
}

/// Reads the messages waiting on `fd` (non-blocking: none is `Ok(0)`), appending them to
/// `out`. Returns how many were read.
pub fn read_msgs(fd: BorrowedFd<'_>, out: &mut Vec<Msg>) -> SysResult<usize> {
    let mut buf = [0u8; MSG_LEN * 64];
    // SAFETY: `buf` is a writable buffer of the length passed, alive for the call.
    let r = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
    if r < 0 {
        let e = SysError::last("read(userfaultfd)");
        return if e.errno == libc::EAGAIN {
            Ok(0)
        } else {
            Err(e)
        };
    }
    let n = r as usize / MSG_LEN;
    let u64_at = |m: &[u8], at: usize| u64::from_ne_bytes(m[at..at + 8].try_into().expect("8"));
    for m in buf[..n * MSG_LEN].chunks_exact(MSG_LEN) {
        // struct uffd_msg { u8 event; u8; u16; u32; union arg (24 bytes) } __packed
        let arg = 8;
        out.push(match m[0] {
            EVENT_PAGEFAULT => Msg::Pagefault {
                write: u64_at(m, arg) & 1 != 0,
                address: u64_at(m, arg + 8),
            },
            EVENT_FORK => {
                let ufd = u32::from_ne_bytes(m[arg..arg + 4].try_into().expect("4")) as i32;
                // SAFETY: the kernel installed descriptor `ufd` in our table for this message,
                // and nothing else owns it: it becomes this `OwnedFd`'s alone.
                let child = unsafe { OwnedFd::from_raw_fd(ufd) };
                Msg::Fork { child }
            }
            EVENT_REMAP => Msg::Remap {
                from: u64_at(m, arg),
                to: u64_at(m, arg + 8),
                len: u64_at(m, arg + 16),
            },
            EVENT_REMOVE => Msg::Remove {
                start: u64_at(m, arg),
                end: u64_at(m, arg + 8),
            },
            EVENT_UNMAP => Msg::Unmap {
                start: u64_at(m, arg),
                end: u64_at(m, arg + 8),
            },
            other => Msg::Other(other),
        });
    }
    Ok(n)
}

/// `USERFAULTFD_IOC_NEW` on `/dev/userfaultfd`: a userfaultfd for the caller's address space
/// (the ioctl's argument: its `O_CLOEXEC`/`O_NONBLOCK` flags), for a process that the
/// `userfaultfd` system call refuses (vm.unprivileged_userfaultfd) but that may open the device.
pub const USERFAULTFD_IOC_NEW: u64 = 0xaa00;

/// Write faults in write-protected ranges are resolved by the kernel itself, which only
/// clears the page's protection bit: a tracker reads that bit back with PAGEMAP_SCAN
/// (`pagemap::scan_written`) instead of serving events. The process never waits.
pub const FEATURE_WP_ASYNC: u64 = 1 << 15;
/// Write protection also covers pages not yet populated (their first write is seen too).
pub const FEATURE_WP_UNPOPULATED: u64 = 1 << 13;
const REGISTER_MODE_WP: u64 = 1 << 1;
// _IOWR(0xAA, 0x06, struct uffdio_writeprotect)
const UFFDIO_WRITEPROTECT: u64 = 0xc018_aa06;
const WRITEPROTECT_MODE_WP: u64 = 1;

#[repr(C)]
struct WriteProtect {
    range: Range,
    mode: u64,
}

/// Registers `[start, start+len)` for write-protect tracking (with `FEATURE_WP_ASYNC`, any
/// kind of private memory may be registered so).
pub fn register_wp(fd: BorrowedFd<'_>, start: u64, len: u64) -> SysResult<()> {
    let mut r = Register {
        range: Range { start, len },
        mode: REGISTER_MODE_WP,
        ioctls: 0,
    };
    ioctl(fd, "UFFDIO_REGISTER(WP)", UFFDIO_REGISTER, &mut r)
}

/// Write-protects (`protect`) or unprotects `[start, start+len)`, a registered range.
pub fn write_protect(fd: BorrowedFd<'_>, start: u64, len: u64, protect: bool) -> SysResult<()> {
    let mut w = WriteProtect {
        range: Range { start, len },
        mode: if protect { WRITEPROTECT_MODE_WP } else { 0 },
    };
    ioctl(fd, "UFFDIO_WRITEPROTECT", UFFDIO_WRITEPROTECT, &mut w)
}
