//! The floor: what the kernel's data movement alone costs for a checkpoint and restore that
//! copy memory (as Ferry and CRIU do), measured in the benchmark's own process next to
//! `memcpy`. Four steps no such engine can skip:
//!
//! 1. *read out*: `process_vm_readv` of the memory into a pre-faulted buffer (the fastest way to
//!    read another process's memory from outside it; on our own PID, the same kernel path);
//! 2. *write*: the bytes written to a file in the image directory, and fsynced (the baseline
//!    column *write+fsync*);
//! 3. *read back*: the file read into a pre-faulted buffer;
//! 4. *fill*: `UFFDIO_COPY` into a fresh mapping (the cheapest way to give a new process pages:
//!    no page fault, no clearing).
//!
//! No checksums, no parsing, no second core: a floor, not a design.

use anyhow::{bail, Context, Result};
use std::fs::File;
use std::io::Read;
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::time::Instant;

const PIECE: usize = 4 << 20;

/// Step 1: `process_vm_readv` of `src`, in 4 MiB pieces, into a pre-faulted buffer; ms.
pub fn read_out_ms(src: &[u8]) -> Result<f64> {
    let mut dst = vec![0xffu8; src.len()];
    let pid = std::process::id() as i32;
    let t = Instant::now();
    for (i, piece) in dst.chunks_mut(PIECE).enumerate() {
        let n = ferry_sys::proc_mem::vm_read(pid, src.as_ptr() as u64 + (i * PIECE) as u64, piece)
            .context("floor: process_vm_readv")?;
        if n != piece.len() {
            bail!("floor: process_vm_readv read {n} of {} bytes", piece.len());
        }
    }
    let ms = t.elapsed().as_secs_f64() * 1e3;
    if dst != src {
        bail!("floor: process_vm_readv gave other bytes");
    }
    Ok(ms)
}

/// Step 3: reads `path` (`len` bytes) into a pre-faulted buffer; ms.
pub fn read_back_ms(path: &Path, len: usize) -> Result<f64> {
    let mut dst = vec![0xffu8; len];
    let mut f = File::open(path).with_context(|| format!("open {}", path.display()))?;
    let t = Instant::now();
    for piece in dst.chunks_mut(PIECE) {
        f.read_exact(piece)
            .with_context(|| format!("read {}", path.display()))?;
    }
    Ok(t.elapsed().as_secs_f64() * 1e3)
}

/// A fresh private anonymous mapping, unmapped on drop.
struct Mapping {
    addr: *mut libc::c_void,
    len: usize,
}

impl Mapping {
    fn new(len: usize) -> Result<Mapping> {
        // SAFETY: a new anonymous mapping at an address the kernel chooses; nothing else
        // refers to it.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            bail!("floor: mmap: {}", std::io::Error::last_os_error());
        }
        Ok(Mapping { addr, len })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: our own mapping, unmapped once; no reference into it outlives `self`.
        unsafe { libc::munmap(self.addr, self.len) };
    }
}

/// Step 4: `UFFDIO_COPY` of `src`, in 4 MiB pieces, into a fresh mapping; ms.
pub fn fill_ms(src: &[u8]) -> Result<f64> {
    let target = Mapping::new(src.len())?;
    // SAFETY: userfaultfd with integer flags makes a new descriptor.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC) };
    if fd < 0 {
        bail!("floor: userfaultfd: {}", std::io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor; we are its only owner.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let base = target.addr as u64;
    ferry_sys::uffd::api(fd.as_fd(), ferry_sys::uffd::FEATURE_SIGBUS).context("floor")?;
    ferry_sys::uffd::register_missing(fd.as_fd(), base, src.len() as u64).context("floor")?;
    let t = Instant::now();
    for (i, piece) in src.chunks(PIECE).enumerate() {
        let n = ferry_sys::uffd::copy(fd.as_fd(), base + (i * PIECE) as u64, piece)
            .map_err(|(e, _)| anyhow::anyhow!("floor: {e}"))?;
        if n != piece.len() {
            bail!("floor: UFFDIO_COPY copied {n} of {} bytes", piece.len());
        }
    }
    Ok(t.elapsed().as_secs_f64() * 1e3)
}
