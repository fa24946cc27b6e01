//! userfaultfd(2) ioctls on a descriptor made inside another process (whose address space it
//! then serves): registering ranges for missing-page handling, and filling them with
//! `UFFDIO_COPY`, which allocates each page and copies into it without clearing it first and
//! without a page fault.

use crate::{SysError, SysResult};
use std::os::fd::{AsRawFd, BorrowedFd};

/// The API version the kernel's header calls `UFFD_API`.
const UFFD_API: u64 = 0xaa;
/// Faults in registered ranges fail with SIGBUS (EFAULT for a remote access such as
/// process_vm_writev) instead of waiting for a handler.
pub const FEATURE_SIGBUS: u64 = 1 << 7;
const REGISTER_MODE_MISSING: u64 = 1;

// _IOWR(0xAA, 0x3F, struct uffdio_api) and friends, as the kernel's header defines them.
const UFFDIO_API: u64 = 0xc018_aa3f;
const UFFDIO_REGISTER: u64 = 0xc020_aa00;
const UFFDIO_UNREGISTER: u64 = 0x8010_aa01;
const UFFDIO_COPY: u64 = 0xc028_aa03;

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
