//! Reading and writing another process's memory: process_vm_readv/writev where the pages allow it,
//! /proc/PID/mem (which may touch read-only and PROT_NONE pages) elsewhere.

use crate::{check, SysError, SysResult};
use std::fs::File;
use std::os::unix::fs::FileExt;

/// Reads `buf.len()` bytes at `addr` of `pid`. Returns how many bytes were read.
pub fn vm_read(pid: i32, addr: u64, buf: &mut [u8]) -> SysResult<usize> {
    let local = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let remote = libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: buf.len(),
    };
    // SAFETY: `local` describes `buf`, which we own mutably; `remote` is only an address in the
    // other process, checked by the kernel.
    let r = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
    check("process_vm_readv", r as libc::c_long).map(|n| n as usize)
}

/// Writes `buf` at `addr` of `pid`. Returns how many bytes were written.
pub fn vm_write(pid: i32, addr: u64, buf: &[u8]) -> SysResult<usize> {
    let local = libc::iovec {
        iov_base: buf.as_ptr() as *mut libc::c_void,
        iov_len: buf.len(),
    };
    let remote = libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: buf.len(),
    };
    // SAFETY: `local` describes `buf`, only read by the kernel; `remote` is checked by the kernel.
    let r = unsafe { libc::process_vm_writev(pid, &local, 1, &remote, 1, 0) };
    check("process_vm_writev", r as libc::c_long).map(|n| n as usize)
}

/// /proc/PID/mem of a (stopped, traced) process.
pub struct ProcMem {
    file: File,
}

impl ProcMem {
    pub fn open(pid: i32) -> SysResult<Self> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(format!("/proc/{pid}/mem"))
            .map_err(|e| SysError::new("open /proc/PID/mem", e.raw_os_error().unwrap_or(0)))?;
        Ok(ProcMem { file })
    }

    pub fn read_exact(&self, addr: u64, buf: &mut [u8]) -> SysResult<()> {
        self.file
            .read_exact_at(buf, addr)
            .map_err(|e| SysError::new("read /proc/PID/mem", e.raw_os_error().unwrap_or(libc::EIO)))
    }

    pub fn write_all(&self, addr: u64, buf: &[u8]) -> SysResult<()> {
        self.file.write_all_at(buf, addr).map_err(|e| {
            SysError::new("write /proc/PID/mem", e.raw_os_error().unwrap_or(libc::EIO))
        })
    }

    pub fn read_u64(&self, addr: u64) -> SysResult<u64> {
        let mut b = [0u8; 8];
        self.read_exact(addr, &mut b)?;
        Ok(u64::from_ne_bytes(b))
    }
}

/// Marks the whole pages inside `[addr, addr + len)` of this process's own memory
/// `MADV_DONTFORK`: a child forked from now on neither gets them nor costs the copy of their
/// page tables. For large buffers that no forked child touches (the restore's launchers make
/// only raw system calls; a child that read them would fault). Parts of a page at either end
/// are left as they are.
pub fn dont_fork(addr: usize, len: usize) -> SysResult<()> {
    let page = crate::PAGE_SIZE as usize;
    let start = addr.div_ceil(page) * page;
    let end = (addr + len) / page * page;
    if end <= start {
        return Ok(());
    }
    // SAFETY: MADV_DONTFORK changes only the flags of our own mappings over whole pages of
    // `[addr, addr + len)`, memory the caller owns; no byte of it is read, written or freed.
    let r = unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTFORK) };
    check("madvise(MADV_DONTFORK)", r as libc::c_long).map(|_| ())
}
