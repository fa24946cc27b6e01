//! Acting on files with someone else's rights, and opening paths without following symbolic
//! links.
//!
//! Ferry runs as root, but a file it opens, creates, renames or removes for a process must be
//! one that process could open, create, rename or remove itself. [`with_fs_creds`] runs a
//! closure on a short-lived thread whose file-system user and group IDs and supplementary
//! groups are the process's: the kernel checks every path walk and permission on that thread
//! as it would for the process (an fsuid other than 0 also clears the thread's file
//! capabilities: CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER, CAP_CHOWN ...). Only that
//! thread changes: the raw system calls are used, not glibc's `setgroups`, which would change
//! every thread of the process.

use crate::{check, SysError, SysResult};
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

/// File-system credentials: the fsuid, fsgid and supplementary groups to act with.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FsCreds {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
}

impl FsCreds {
    /// Root's: what Ferry itself may do.
    pub fn root() -> FsCreds {
        FsCreds::default()
    }
}

impl std::fmt::Display for FsCreds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "uid {} gid {}", self.uid, self.gid)
    }
}

/// Runs `f` with the file-system rights of `creds`: on this thread when they are root's
/// (Ferry's own: an fsuid of 0 keeps the file capabilities whatever the groups), else on a new
/// thread that takes them first and ends with `f`. Fails only if the credentials cannot be
/// taken.
pub fn with_fs_creds<T: Send>(creds: &FsCreds, f: impl FnOnce() -> T + Send) -> SysResult<T> {
    if creds.uid == 0 {
        return Ok(f());
    }
    std::thread::scope(|s| {
        let worker = s.spawn(|| {
            take(creds)?;
            Ok(f())
        });
        match worker.join() {
            Ok(r) => r,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    })
}

/// Gives this thread the file-system rights of `creds`.
fn take(creds: &FsCreds) -> SysResult<()> {
    // SAFETY: the pointer and length describe `creds.groups`, which outlives the call; the raw
    // call changes this thread only.
    let r = unsafe {
        libc::syscall(
            libc::SYS_setgroups,
            creds.groups.len() as libc::size_t,
            creds.groups.as_ptr(),
        )
    };
    check("setgroups", r)?;
    // setfsgid/setfsuid return the previous value and cannot fail visibly: read it back
    // (an invalid ID, -1, changes nothing and returns the current one).
    // SAFETY: plain integer arguments; this thread only.
    unsafe { libc::syscall(libc::SYS_setfsgid, creds.gid) };
    // SAFETY: as above.
    let gid = unsafe { libc::syscall(libc::SYS_setfsgid, u32::MAX) };
    if gid as u32 != creds.gid {
        return Err(SysError::new("setfsgid", libc::EPERM));
    }
    // SAFETY: as above.
    unsafe { libc::syscall(libc::SYS_setfsuid, creds.uid) };
    // SAFETY: as above.
    let uid = unsafe { libc::syscall(libc::SYS_setfsuid, u32::MAX) };
    if uid as u32 != creds.uid {
        return Err(SysError::new("setfsuid", libc::EPERM));
    }
    Ok(())
}

/// openat2(2): opens `path` relative to `dirfd` (or the working directory, `libc::AT_FDCWD`)
/// with `flags` and `mode`, resolving it as `resolve` (`libc::RESOLVE_*`) allows.
pub fn openat2(
    dirfd: RawFd,
    path: &str,
    flags: i32,
    mode: u32,
    resolve: u64,
) -> SysResult<OwnedFd> {
    let c = std::ffi::CString::new(path)
        .map_err(|_| SysError::new("openat2 (path has NUL)", libc::EINVAL))?;
    // struct open_how { u64 flags; u64 mode; u64 resolve; } (libc's is non-exhaustive).
    let mode = if flags & (libc::O_CREAT | libc::O_TMPFILE) != 0 {
        mode as u64
    } else {
        0
    };
    let how: [u64; 3] = [flags as u32 as u64, mode, resolve];
    // SAFETY: c is a valid NUL-terminated string and `how` a valid open_how of the size given.
    let r = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dirfd,
            c.as_ptr(),
            how.as_ptr(),
            std::mem::size_of_val(&how),
        )
    };
    let fd = check("openat2", r)?;
    // SAFETY: a new descriptor, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

fn cstr(op: &'static str, s: &std::ffi::OsStr) -> SysResult<std::ffi::CString> {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(s.as_bytes()).map_err(|_| SysError::new(op, libc::EINVAL))
}

/// renameat2(2) within one directory: `from` becomes `to`; with `noreplace`, fails (EEXIST)
/// rather than replace what `to` names. Neither name's symbolic link is followed.
pub fn rename_in(
    dirfd: RawFd,
    from: &std::ffi::OsStr,
    to: &std::ffi::OsStr,
    noreplace: bool,
) -> SysResult<()> {
    let (a, b) = (cstr("renameat2", from)?, cstr("renameat2", to)?);
    let flags = if noreplace { libc::RENAME_NOREPLACE } else { 0 };
    // SAFETY: valid NUL-terminated strings; plain integers.
    let r = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            dirfd,
            a.as_ptr(),
            dirfd,
            b.as_ptr(),
            flags,
        )
    };
    check("renameat2", r).map(drop)
}

/// unlinkat(2) of `name` in `dirfd` (a file, or a symbolic link itself: never its target).
pub fn unlink_in(dirfd: RawFd, name: &std::ffi::OsStr) -> SysResult<()> {
    let c = cstr("unlinkat", name)?;
    // SAFETY: a valid NUL-terminated string; plain integers.
    let r = unsafe { libc::unlinkat(dirfd, c.as_ptr(), 0) };
    check("unlinkat", r as libc::c_long).map(drop)
}

/// mknodat(2) of a FIFO `name` in `dirfd` with `mode` (less the umask).
pub fn mkfifo_in(dirfd: RawFd, name: &std::ffi::OsStr, mode: u32) -> SysResult<()> {
    let c = cstr("mknodat", name)?;
    // SAFETY: a valid NUL-terminated string; plain integers.
    let r = unsafe {
        libc::mknodat(
            dirfd,
            c.as_ptr(),
            libc::S_IFIFO | (mode & 0o7777) as libc::mode_t,
            0,
        )
    };
    check("mknodat", r as libc::c_long).map(drop)
}

/// unlinkat(2) with AT_REMOVEDIR: removes the empty directory `name` in `dirfd`.
pub fn rmdir_in(dirfd: RawFd, name: &std::ffi::OsStr) -> SysResult<()> {
    let c = cstr("unlinkat", name)?;
    // SAFETY: a valid NUL-terminated string; plain integers.
    let r = unsafe { libc::unlinkat(dirfd, c.as_ptr(), libc::AT_REMOVEDIR) };
    check("unlinkat(AT_REMOVEDIR)", r as libc::c_long).map(drop)
}

/// mkdirat(2) of `name` in `dirfd` with `mode` (less the umask).
pub fn mkdir_in(dirfd: RawFd, name: &std::ffi::OsStr, mode: u32) -> SysResult<()> {
    let c = cstr("mkdirat", name)?;
    // SAFETY: a valid NUL-terminated string; plain integers.
    let r = unsafe { libc::mkdirat(dirfd, c.as_ptr(), mode as libc::mode_t) };
    check("mkdirat", r as libc::c_long).map(drop)
}

/// Gives this thread a working directory of its own (unshare(CLONE_FS)) and moves it to `dir`
/// (as this thread's credentials allow), for calls that take a path relative to it (bind of a
/// relative UNIX socket name). Meant for a thread of [`with_fs_creds`], which ends afterwards.
pub fn own_cwd(dir: &str) -> SysResult<()> {
    // SAFETY: plain integer argument; CLONE_FS only unshares this thread's root, cwd and umask.
    let r = unsafe { libc::unshare(libc::CLONE_FS) };
    check("unshare(CLONE_FS)", r as libc::c_long)?;
    let c = std::ffi::CString::new(dir).map_err(|_| SysError::new("chdir", libc::EINVAL))?;
    // SAFETY: a valid NUL-terminated string.
    let r = unsafe { libc::chdir(c.as_ptr()) };
    check("chdir", r as libc::c_long).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn a_thread_with_nobodys_rights_cannot_open_a_root_only_file() {
        let dir = std::env::temp_dir().join(format!("ferry-fsid-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let secret = dir.join("secret");
        std::fs::write(&secret, b"x").unwrap();
        std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .unwrap();
        let path = secret.to_str().unwrap().to_string();
        let nobody = FsCreds {
            uid: 65534,
            gid: 65534,
            groups: vec![],
        };
        let r = with_fs_creds(&nobody, || {
            crate::fdops::open_path(&path, libc::O_RDONLY | libc::O_CLOEXEC, 0).map(drop)
        })
        .unwrap();
        assert_eq!(r.unwrap_err().errno, libc::EACCES);
        // This thread kept root's rights.
        crate::fdops::open_path(&path, libc::O_RDONLY | libc::O_CLOEXEC, 0).unwrap();
        // No symbolic link is followed.
        let link = dir.join("link");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&secret, &link).unwrap();
        let e = openat2(
            libc::AT_FDCWD,
            link.to_str().unwrap(),
            libc::O_RDONLY | libc::O_CLOEXEC,
            0,
            libc::RESOLVE_NO_SYMLINKS,
        )
        .unwrap_err();
        assert_eq!(e.errno, libc::ELOOP);
        let d = crate::fdops::open_path(dir.to_str().unwrap(), libc::O_PATH, 0).unwrap();
        unlink_in(d.as_raw_fd(), std::ffi::OsStr::new("link")).unwrap();
        assert!(secret.exists());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
