//! Mounts, for the private file trees of an emulated node: a tmpfs over a directory, and a
//! directory tree carried across such a mount (`open_tree` clones it detached, `move_mount`
//! attaches the clone again, at the same path, once the tmpfs hides the original).

use crate::{check, SysError, SysResult};
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

const OPEN_TREE_CLONE: libc::c_uint = 1;
const AT_RECURSIVE: libc::c_uint = 0x8000;
const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;

fn cpath(op: &'static str, p: &Path) -> SysResult<CString> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| SysError::new(op, libc::EINVAL))
}

/// Mounts a fresh tmpfs on `dir` (nosuid, nodev) with the given mode for its root.
pub fn mount_tmpfs(dir: &Path, mode: u32) -> SysResult<()> {
    let target = cpath("mount tmpfs (path has NUL)", dir)?;
    let data = CString::new(format!("mode={mode:o}")).expect("no NUL");
    // SAFETY: every pointer is a NUL-terminated string that outlives the call.
    let r = unsafe {
        libc::mount(
            c"tmpfs".as_ptr(),
            target.as_ptr(),
            c"tmpfs".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV,
            data.as_ptr().cast(),
        )
    };
    check("mount tmpfs", r as libc::c_long).map(drop)
}

/// A detached copy of the mount tree at `dir` (with the mounts below it), to be attached
/// elsewhere with [`attach_tree`]. Unattached, it disappears with the descriptor.
pub fn clone_tree(dir: &Path) -> SysResult<OwnedFd> {
    let path = cpath("open_tree (path has NUL)", dir)?;
    let flags = OPEN_TREE_CLONE | AT_RECURSIVE | libc::O_CLOEXEC as libc::c_uint;
    // SAFETY: path is a NUL-terminated string that outlives the call; flags are constants.
    let r = unsafe { libc::syscall(libc::SYS_open_tree, libc::AT_FDCWD, path.as_ptr(), flags) };
    let fd = check("open_tree(OPEN_TREE_CLONE)", r)?;
    // SAFETY: the kernel just made this descriptor for us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Attaches a tree made by [`clone_tree`] on the directory `dir`.
pub fn attach_tree(tree: &OwnedFd, dir: &Path) -> SysResult<()> {
    let path = cpath("move_mount (path has NUL)", dir)?;
    // SAFETY: the strings are NUL-terminated and outlive the call; the descriptor is open.
    let r = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            tree.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_FDCWD,
            path.as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH,
        )
    };
    check("move_mount", r).map(drop)
}
