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

const PM_PRESENT: u64 = 1 << 63;
const PM_MMAP_EXCLUSIVE: u64 = 1 << 56;

/// Reads `buf.len()` bytes (whole pages) at `addr` (page-aligned) of `pid` without unsharing
/// its pages. `process_vm_readv` pins what it reads, and the kernel copies a copy-on-write
/// page that is shared with another process (a parent's and its forked children's) before it
/// pins it for reading: reading a pre-fork server would leave each worker with a copy of its
/// parent's memory. Pages that `pagemap` (the process's /proc/PID/pagemap) shows present and
/// mapped more than once are read through `mem` (/proc/PID/mem takes a plain reference, and
/// copies nothing); the others with `process_vm_readv`, or `mem` where that cannot read them.
/// Returns how many bytes from the start were read (fewer at a page neither can read).
pub fn read_keeping_shared(
    pid: i32,
    pagemap: &File,
    mem: &ProcMem,
    addr: u64,
    buf: &mut [u8],
) -> usize {
    let page = crate::PAGE_SIZE as usize;
    let pages = buf.len().div_ceil(page);
    let mut raw = vec![0u8; pages * 8];
    let shared: Vec<bool> = match pagemap.read_exact_at(&mut raw, addr / crate::PAGE_SIZE * 8) {
        Ok(()) => raw
            .chunks_exact(8)
            .map(|c| {
                let e = u64::from_ne_bytes(c.try_into().expect("8 bytes"));
                e & PM_PRESENT != 0 && e & PM_MMAP_EXCLUSIVE == 0
            })
            .collect(),
        // Without the pagemap (not ours to read), as before.
        Err(_) => vec![false; pages],
    };
    let mut done = 0;
    while done < buf.len() {
        let k = done / page;
        let mut j = k + 1;
        while j < pages && shared[j] == shared[k] {
            j += 1;
        }
        let end = (j * page).min(buf.len());
        let at = addr + done as u64;
        let got = if shared[k] {
            match mem.read_exact(at, &mut buf[done..end]) {
                Ok(()) => end - done,
                Err(_) => 0,
            }
        } else {
            vm_read(pid, at, &mut buf[done..end]).unwrap_or(0)
        };
        let mut d = done + got / page * page;
        // What process_vm_readv did not read (or was not asked to), page by page.
        if got < end - done {
            while d < end {
                let n = page.min(end - d);
                if mem.read_exact(addr + d as u64, &mut buf[d..d + n]).is_err() {
                    return d;
                }
                d += n;
            }
        }
        done = end;
    }
    done
}
