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

/// Moves this process (single-threaded) into a new mount namespace, a slave of the one it
/// leaves: mounts made there later still show here, nothing mounted here goes back.
pub fn unshare_mount_ns() -> SysResult<()> {
    // SAFETY: plain integer argument.
    let r = unsafe { libc::unshare(libc::CLONE_NEWNS) };
    check("unshare(CLONE_NEWNS)", r as libc::c_long)?;
    // SAFETY: NUL-terminated strings; no data.
    let r = unsafe {
        libc::mount(
            std::ptr::null(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_SLAVE,
            std::ptr::null(),
        )
    };
    check("mount(/, MS_REC|MS_SLAVE)", r as libc::c_long).map(drop)
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

/// Like [`clone_tree`], without the mounts below `dir` (a bind of that one mount).
pub fn clone_mount(dir: &Path) -> SysResult<OwnedFd> {
    let path = cpath("open_tree (path has NUL)", dir)?;
    let flags = OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint;
    // SAFETY: path is a NUL-terminated string that outlives the call; flags are constants.
    let r = unsafe { libc::syscall(libc::SYS_open_tree, libc::AT_FDCWD, path.as_ptr(), flags) };
    let fd = check("open_tree(OPEN_TREE_CLONE)", r)?;
    // SAFETY: the kernel just made this descriptor for us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Makes a detached tree (from [`clone_tree`] or [`clone_mount`]) read-only, with the mounts
/// below it when `recursive`; also nosuid and nodev.
pub fn make_read_only(tree: &OwnedFd, recursive: bool) -> SysResult<()> {
    const MOUNT_ATTR_RDONLY: u64 = 0x1;
    const MOUNT_ATTR_NOSUID: u64 = 0x2;
    const MOUNT_ATTR_NODEV: u64 = 0x4;
    #[repr(C)]
    struct MountAttr {
        attr_set: u64,
        attr_clr: u64,
        propagation: u64,
        userns_fd: u64,
    }
    let attr = MountAttr {
        attr_set: MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV,
        attr_clr: 0,
        propagation: 0,
        userns_fd: 0,
    };
    let flags = libc::AT_EMPTY_PATH as libc::c_uint | if recursive { AT_RECURSIVE } else { 0 };
    // SAFETY: the descriptor is open, the path an empty NUL-terminated string, and `attr` a
    // live struct of the size passed.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            c"".as_ptr(),
            flags,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    check("mount_setattr(MOUNT_ATTR_RDONLY)", r).map(drop)
}

/// Makes the mount on `dir` read-only (a bind remount: that mount only, nosuid and nodev).
pub fn remount_read_only(dir: &Path) -> SysResult<()> {
    let target = cpath("remount (path has NUL)", dir)?;
    // SAFETY: every pointer is a NUL-terminated string that outlives the call or null.
    let r = unsafe {
        libc::mount(
            std::ptr::null(),
            target.as_ptr(),
            std::ptr::null(),
            libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV,
            std::ptr::null(),
        )
    };
    check("remount read-only", r as libc::c_long).map(drop)
}

/// Makes the mount at `new_root` this mount namespace's root (and this process's root and
/// working directory); the old root is detached and gone from the namespace.
pub fn pivot_root_to(new_root: &Path) -> SysResult<()> {
    let dir = cpath("pivot_root (path has NUL)", new_root)?;
    // SAFETY: NUL-terminated strings that outlive each call.
    unsafe {
        check(
            "chdir (new root)",
            libc::chdir(dir.as_ptr()) as libc::c_long,
        )?;
        check(
            "pivot_root",
            libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()),
        )?;
        // The old root is stacked on the new one: detach it.
        check(
            "umount the old root",
            libc::umount2(c".".as_ptr(), libc::MNT_DETACH) as libc::c_long,
        )?;
        check("chdir /", libc::chdir(c"/".as_ptr()) as libc::c_long)?;
    }
    Ok(())
}
