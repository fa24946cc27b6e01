//! Small descriptor and process operations without a better home: kcmp, prlimit, tee, sockets'
//! peek offsets, memfd.

use crate::{check, SysResult};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

pub const KCMP_FILE: i32 = 0;

/// Whether descriptor `fd1` of `pid1` and `fd2` of `pid2` are the same open file description.
pub fn kcmp_file(pid1: i32, pid2: i32, fd1: i32, fd2: i32) -> SysResult<bool> {
    // SAFETY: plain integer arguments.
    let r = unsafe {
        libc::syscall(
            libc::SYS_kcmp,
            pid1,
            pid2,
            KCMP_FILE,
            fd1 as u64,
            fd2 as u64,
        )
    };
    Ok(check("kcmp(KCMP_FILE)", r)? == 0)
}

pub const KCMP_FILES: i32 = 2;

/// Whether processes `pid1` and `pid2` share one descriptor table (CLONE_FILES).
pub fn kcmp_files(pid1: i32, pid2: i32) -> SysResult<bool> {
    // SAFETY: plain integer arguments.
    let r = unsafe { libc::syscall(libc::SYS_kcmp, pid1, pid2, KCMP_FILES, 0u64, 0u64) };
    Ok(check("kcmp(KCMP_FILES)", r)? == 0)
}

pub fn get_rlimit(pid: i32, resource: u32) -> SysResult<(u64, u64)> {
    let mut old = libc::rlimit64 {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: old is a valid out-pointer; new is null.
    let r = unsafe { libc::prlimit64(pid, resource as _, std::ptr::null(), &mut old) };
    check("prlimit64(get)", r as libc::c_long)?;
    Ok((old.rlim_cur, old.rlim_max))
}

pub fn set_rlimit(pid: i32, resource: u32, cur: u64, max: u64) -> SysResult<()> {
    let new = libc::rlimit64 {
        rlim_cur: cur,
        rlim_max: max,
    };
    // SAFETY: new is a valid in-pointer; old is null.
    let r = unsafe { libc::prlimit64(pid, resource as _, &new, std::ptr::null_mut()) };
    check("prlimit64(set)", r as libc::c_long).map(drop)
}

/// Copies up to `len` bytes buffered in pipe `from` into pipe `to` without consuming them.
pub fn tee(from: RawFd, to: RawFd, len: usize) -> SysResult<usize> {
    // SAFETY: plain integer arguments.
    let r = unsafe { libc::tee(from, to, len, libc::SPLICE_F_NONBLOCK) };
    check("tee", r as libc::c_long).map(|n| n as usize)
}

/// Moves up to `len` bytes from `from` to `to` (one of them a pipe) without blocking, in one
/// call: a file's side without an offset given uses and advances its description's position.
/// `Ok(0)`: `from` is a pipe at end of file.
pub fn splice(from: RawFd, to: RawFd, len: usize) -> SysResult<usize> {
    // SAFETY: plain integer arguments; both offsets are null (the descriptions' positions).
    let r = unsafe {
        libc::splice(
            from,
            std::ptr::null_mut(),
            to,
            std::ptr::null_mut(),
            len,
            libc::SPLICE_F_NONBLOCK,
        )
    };
    check("splice", r as libc::c_long).map(|n| n as usize)
}

/// Frees the bytes of file `fd` below `len` (a hole: they read as zeros), its size unchanged.
pub fn punch_hole(fd: RawFd, len: u64) -> SysResult<()> {
    if len == 0 {
        return Ok(());
    }
    // SAFETY: plain integer arguments.
    let r = unsafe {
        libc::fallocate(
            fd,
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            0,
            len as libc::off_t,
        )
    };
    check("fallocate(punch hole)", r as libc::c_long).map(drop)
}

pub fn pipe2(flags: i32) -> SysResult<(OwnedFd, OwnedFd)> {
    let mut fds = [0i32; 2];
    // SAFETY: fds has room for the two descriptors.
    let r = unsafe { libc::pipe2(fds.as_mut_ptr(), flags) };
    check("pipe2", r as libc::c_long)?;
    // SAFETY: both descriptors were just created and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

pub fn fionread(fd: RawFd) -> SysResult<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int.
    let r = unsafe { libc::ioctl(fd, libc::FIONREAD, &mut n) };
    check("ioctl(FIONREAD)", r as libc::c_long)?;
    Ok(n as usize)
}

pub fn pipe_size(fd: RawFd) -> SysResult<usize> {
    // SAFETY: plain integer arguments.
    let r = unsafe { libc::fcntl(fd, libc::F_GETPIPE_SZ) };
    check("fcntl(F_GETPIPE_SZ)", r as libc::c_long).map(|n| n as usize)
}

pub fn set_pipe_size(fd: RawFd, size: usize) -> SysResult<()> {
    // SAFETY: plain integer arguments.
    let r = unsafe { libc::fcntl(fd, libc::F_SETPIPE_SZ, size as libc::c_int) };
    check("fcntl(F_SETPIPE_SZ)", r as libc::c_long).map(drop)
}

pub fn get_fl(fd: RawFd) -> SysResult<i32> {
    // SAFETY: plain integer arguments.
    let r = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    check("fcntl(F_GETFL)", r as libc::c_long).map(|n| n as i32)
}

pub fn set_fl(fd: RawFd, flags: i32) -> SysResult<()> {
    // SAFETY: plain integer arguments.
    let r = unsafe { libc::fcntl(fd, libc::F_SETFL, flags) };
    check("fcntl(F_SETFL)", r as libc::c_long).map(drop)
}

/// fcntl commands for signal-driven I/O (asm-generic/fcntl.h), which the libc crate lacks.
pub const F_SETSIG: i32 = 10;
pub const F_GETSIG: i32 = 11;
pub const F_SETOWN_EX: i32 = 15;
pub const F_GETOWN_EX: i32 = 16;
/// `f_owner_ex.type`: a thread, a process, a process group.
pub const F_OWNER_TID: i32 = 0;
pub const F_OWNER_PID: i32 = 1;
pub const F_OWNER_PGRP: i32 = 2;

/// The owner of `fd`'s description for signal-driven I/O (fcntl F_GETOWN_EX): its type
/// (F_OWNER_TID, F_OWNER_PID or F_OWNER_PGRP) and PID, in our PID namespace (0: none).
pub fn get_owner_ex(fd: RawFd) -> SysResult<(i32, i32)> {
    // struct f_owner_ex { int type; pid_t pid; }
    let mut o = [0i32; 2];
    // SAFETY: `o` is a valid, writable struct f_owner_ex for the call's duration.
    let r = unsafe { libc::fcntl(fd, F_GETOWN_EX, o.as_mut_ptr()) };
    check("fcntl(F_GETOWN_EX)", r as libc::c_long).map(|_| (o[0], o[1]))
}

/// The signal sent for signal-driven I/O on `fd`'s description (fcntl F_GETSIG; 0: SIGIO).
pub fn get_sig(fd: RawFd) -> SysResult<i32> {
    // SAFETY: plain integer arguments.
    let r = unsafe { libc::fcntl(fd, F_GETSIG) };
    check("fcntl(F_GETSIG)", r as libc::c_long).map(|n| n as i32)
}

/// Sets the signal sent for signal-driven I/O on `fd`'s description (fcntl F_SETSIG).
pub fn set_sig(fd: RawFd, sig: i32) -> SysResult<()> {
    // SAFETY: plain integer arguments.
    let r = unsafe { libc::fcntl(fd, F_SETSIG, sig) };
    check("fcntl(F_SETSIG)", r as libc::c_long).map(drop)
}

pub fn write_fd(fd: RawFd, buf: &[u8]) -> SysResult<usize> {
    // SAFETY: buf is a valid slice for reading.
    let r = unsafe { libc::write(fd, buf.as_ptr().cast(), buf.len()) };
    check("write", r as libc::c_long).map(|n| n as usize)
}

pub fn read_fd(fd: RawFd, buf: &mut [u8]) -> SysResult<usize> {
    // SAFETY: buf is a valid slice for writing.
    let r = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
    check("read", r as libc::c_long).map(|n| n as usize)
}

pub fn lseek(fd: RawFd, off: i64, whence: i32) -> SysResult<i64> {
    // SAFETY: plain integer arguments.
    let r = unsafe { libc::lseek(fd, off, whence) };
    check("lseek", r as libc::c_long)
}

pub fn eventfd(initval: u32, flags: i32) -> SysResult<OwnedFd> {
    // SAFETY: plain integer arguments.
    let r = unsafe { libc::eventfd(initval, flags) };
    let fd = check("eventfd", r as libc::c_long)?;
    // SAFETY: new descriptor owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

pub fn open_path(path: &str, flags: i32, mode: u32) -> SysResult<OwnedFd> {
    let c = std::ffi::CString::new(path)
        .map_err(|_| crate::SysError::new("open (path has NUL)", libc::EINVAL))?;
    // SAFETY: c is a valid NUL-terminated string.
    let r = unsafe { libc::open(c.as_ptr(), flags, mode) };
    let fd = check("open", r as libc::c_long)?;
    // SAFETY: new descriptor owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

pub fn memfd_create(name: &str, flags: u32) -> SysResult<OwnedFd> {
    let c = std::ffi::CString::new(name)
        .map_err(|_| crate::SysError::new("memfd_create (name has NUL)", libc::EINVAL))?;
    // SAFETY: c is a valid NUL-terminated string.
    let r = unsafe { libc::memfd_create(c.as_ptr(), flags) };
    let fd = check("memfd_create", r as libc::c_long)?;
    // SAFETY: new descriptor owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Raises this process's soft RLIMIT_NOFILE to its hard limit: a restore holds many descriptors.
pub fn raise_nofile() {
    if let Ok((_, max)) = get_rlimit(0, libc::RLIMIT_NOFILE) {
        let _ = set_rlimit(0, libc::RLIMIT_NOFILE, max, max);
    }
}

pub fn raw(fd: &OwnedFd) -> RawFd {
    fd.as_raw_fd()
}

/// Marks this process a child subreaper: orphaned descendants are reparented to it.
pub fn set_child_subreaper() -> SysResult<()> {
    // SAFETY: plain integer arguments.
    let r = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    check("prctl(PR_SET_CHILD_SUBREAPER)", r as libc::c_long).map(drop)
}

/// A new MAP_SHARED|MAP_ANONYMOUS memory object of `size` bytes, as a file: the same kind of
/// object ("/dev/zero (deleted)") that a process gets from mmap, so it maps identically.
pub fn anon_shmem(size: u64) -> SysResult<std::fs::File> {
    // SAFETY: a fresh mapping at an address of the kernel's choosing; it is unmapped below and
    // never dereferenced.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(crate::SysError::last("mmap(MAP_SHARED|MAP_ANONYMOUS)"));
    }
    let start = p as u64;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(format!(
            "/proc/self/map_files/{:x}-{:x}",
            start,
            start + size
        ))
        .map_err(|e| {
            crate::SysError::new("open /proc/self/map_files", e.raw_os_error().unwrap_or(0))
        });
    // SAFETY: p is the mapping made above, of exactly `size` bytes.
    unsafe { libc::munmap(p, size as usize) };
    file
}

pub fn get_seals(fd: RawFd) -> SysResult<u32> {
    // SAFETY: plain integer arguments.
    let r = unsafe { libc::fcntl(fd, libc::F_GET_SEALS) };
    check("fcntl(F_GET_SEALS)", r as libc::c_long).map(|n| n as u32)
}

pub fn add_seals(fd: RawFd, seals: u32) -> SysResult<()> {
    // SAFETY: plain integer arguments.
    let r = unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, seals as libc::c_int) };
    check("fcntl(F_ADD_SEALS)", r as libc::c_long).map(drop)
}

/// flock(2): `op` is LOCK_SH, LOCK_EX or LOCK_UN, with LOCK_NB or not.
pub fn flock(fd: RawFd, op: i32) -> SysResult<()> {
    // SAFETY: plain integer arguments.
    let r = unsafe { libc::flock(fd, op) };
    check("flock", r as libc::c_long).map(drop)
}

/// A record-lock fcntl (F_SETLK, F_OFD_SETLK, F_GETLK ...) with `lock`, the bytes of a
/// `struct flock`.
pub fn fcntl_lock(fd: RawFd, cmd: i32, lock: &[u8; 32]) -> SysResult<()> {
    const _: () = assert!(std::mem::size_of::<libc::flock>() == 32);
    let mut copy = *lock;
    // SAFETY: `copy` is 32 writable bytes, the size of `struct flock` on this architecture
    // (checked above); the kernel reads it, and for F_GETLK writes into it.
    let r = unsafe { libc::fcntl(fd, cmd, copy.as_mut_ptr()) };
    check("fcntl(lock)", r as libc::c_long).map(drop)
}

/// Size and number of attaches of System V shared memory segment `shmid`.
pub fn shm_stat(shmid: i32) -> SysResult<(u64, u64)> {
    // SAFETY: shmid_ds is plain data; all-zero is a valid value for it.
    let mut ds: libc::shmid_ds = unsafe { std::mem::zeroed() };
    // SAFETY: ds is a valid out-pointer for IPC_STAT.
    let r = unsafe { libc::shmctl(shmid, libc::IPC_STAT, &mut ds) };
    check("shmctl(IPC_STAT)", r as libc::c_long)?;
    Ok((ds.shm_segsz as u64, ds.shm_nattch))
}

pub fn shm_remove(shmid: i32) -> SysResult<()> {
    // SAFETY: IPC_RMID takes no buffer.
    let r = unsafe { libc::shmctl(shmid, libc::IPC_RMID, std::ptr::null_mut()) };
    check("shmctl(IPC_RMID)", r as libc::c_long).map(drop)
}

/// A copy of `fd` (F_DUPFD_CLOEXEC: close-on-exec, at the lowest free number).
pub fn dup_cloexec(fd: RawFd) -> SysResult<OwnedFd> {
    // SAFETY: plain integer arguments.
    let r = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    let n = check("fcntl(F_DUPFD_CLOEXEC)", r as libc::c_long)?;
    // SAFETY: the kernel just made descriptor `n`, which nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(n as i32) })
}

/// Makes `new` a copy of `old` (dup2).
pub fn dup2(old: RawFd, new: RawFd) -> SysResult<()> {
    // SAFETY: plain integer arguments.
    let r = unsafe { libc::dup2(old, new) };
    check("dup2", r as libc::c_long).map(drop)
}

/// fstat(2) of `fd`: the `struct stat` as the kernel writes it (x86_64: 144 bytes).
pub fn fstat_raw(fd: RawFd) -> SysResult<[u8; 144]> {
    const _: () = assert!(std::mem::size_of::<libc::stat>() == 144);
    // SAFETY: struct stat is plain old data; all zeroes is a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: the kernel writes one struct stat into `st`.
    let r = unsafe { libc::fstat(fd, &mut st) };
    check("fstat", r as libc::c_long)?;
    // SAFETY: `st` is 144 initialized bytes (checked above).
    Ok(unsafe { std::mem::transmute::<libc::stat, [u8; 144]>(st) })
}

/// statx(2) of `fd` itself (AT_EMPTY_PATH, with `flags` added) for the fields in `mask`: the
/// `struct statx` as the kernel writes it (256 bytes).
pub fn statx_raw(fd: RawFd, flags: i32, mask: u32) -> SysResult<[u8; 256]> {
    let mut buf = [0u8; 256];
    // SAFETY: the path is a NUL-terminated empty string; the kernel writes at most one struct
    // statx (256 bytes) into `buf`.
    let r = unsafe {
        libc::syscall(
            libc::SYS_statx,
            fd,
            c"".as_ptr(),
            flags | libc::AT_EMPTY_PATH,
            mask,
            buf.as_mut_ptr(),
        )
    };
    check("statx", r)?;
    Ok(buf)
}
