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

/// `NS_GET_USERNS` (`_IO(0xb7, 0x1)`): the user namespace that owns the namespace an nsfs
/// descriptor names.
const NS_GET_USERNS: libc::c_ulong = 0xb701;

/// The largest identity mapping a user namespace can have (every uid or gid but -1).
pub const IDENTITY_MAP: &str = "0 0 4294967295\n";

/// Moves this process (single-threaded, root) into a copy of its mount namespace that is owned
/// by a new user namespace, and returns a descriptor of that user namespace (an identity
/// mapping of every uid and gid, written by us from its parent, so files and permissions are
/// as before). The kernel copies the mounts into a namespace of a less privileged owner as
/// one locked whole (`MNT_LOCKED`): from then on no one, root included, can unmount, move or
/// take apart a mount under another, nor make a read-only, nosuid or nodev mount otherwise,
/// so nothing a mount covers can be revealed from inside.
///
/// A short-lived child is cloned with `CLONE_NEWUSER | CLONE_NEWNS`; we map its user
/// namespace, join its mount namespace, and let it go. This process stays in its own user
/// namespace, with its capabilities over the new one (its parent's).
pub fn lock_mounts() -> SysResult<OwnedFd> {
    let (r, w) = crate::fdops::pipe2(libc::O_CLOEXEC)?;
    // SAFETY: a raw clone (no C library fork handlers, no new stack: the child runs on its
    // copy of ours, like fork) of a single-threaded process; the child only closes, reads and
    // exits, all async-signal-safe, on descriptors made above.
    let pid = unsafe { crate::process::raw_clone(libc::CLONE_NEWUSER | libc::CLONE_NEWNS) };
    if pid < 0 {
        return Err(SysError::last("clone(CLONE_NEWUSER|CLONE_NEWNS)"));
    }
    if pid == 0 {
        // SAFETY: see above; the child waits for our end of the pipe to close, then exits.
        unsafe {
            libc::close(w.as_raw_fd());
            let mut b = [0u8; 1];
            while libc::read(r.as_raw_fd(), b.as_mut_ptr().cast(), 1) < 0 {}
            libc::_exit(0)
        }
    }
    drop(r);
    let joined = (|| {
        for map in ["uid_map", "gid_map"] {
            std::fs::write(format!("/proc/{pid}/{map}"), IDENTITY_MAP).map_err(|e| {
                SysError::new(
                    "write the new user namespace's id map",
                    e.raw_os_error().unwrap_or(libc::EIO),
                )
            })?;
        }
        let open = |what: &str| {
            crate::fdops::open_path(
                &format!("/proc/{pid}/ns/{what}"),
                libc::O_RDONLY | libc::O_CLOEXEC,
                0,
            )
        };
        let mnt = open("mnt")?;
        let user = open("user")?;
        // SAFETY: setns on a descriptor we hold; this process is single-threaded (its own
        // fs_struct), as entering a mount namespace requires.
        let rc = unsafe { libc::setns(mnt.as_raw_fd(), libc::CLONE_NEWNS) };
        check("setns (the locked mount namespace)", rc as libc::c_long)?;
        Ok(user)
    })();
    drop(w);
    let mut status = 0;
    // SAFETY: status is a valid out-pointer; pid is our child.
    unsafe { libc::waitpid(pid, &mut status, libc::__WALL) };
    joined
}

/// The user namespace that owns the namespace `ns` (an nsfs descriptor) names.
pub fn owner_user_ns(ns: RawFd) -> SysResult<OwnedFd> {
    // SAFETY: NS_GET_USERNS takes no argument and returns a new descriptor.
    let r = unsafe { libc::ioctl(ns, NS_GET_USERNS as _) };
    let fd = check("ioctl(NS_GET_USERNS)", r as libc::c_long)?;
    // SAFETY: the kernel just made this descriptor for us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Moves this process (single-threaded) into a new network namespace and brings its loopback
/// up: the only interface there (a confined guest's network).
pub fn unshare_loopback_only() -> SysResult<()> {
    // SAFETY: plain integer argument.
    let r = unsafe { libc::unshare(libc::CLONE_NEWNET) };
    check("unshare(CLONE_NEWNET)", r as libc::c_long)?;
    // SAFETY: plain integer arguments.
    let s = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    let s = check("socket (to bring lo up)", s as libc::c_long)?;
    // SAFETY: the kernel just made this descriptor for us.
    let s = unsafe { OwnedFd::from_raw_fd(s as RawFd) };
    // SAFETY: a zeroed ifreq is valid; its name is set below.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, b) in ifr.ifr_name.iter_mut().zip(b"lo\0") {
        *d = *b as libc::c_char;
    }
    // SAFETY: ifr is a valid ifreq naming "lo"; SIOCGIFFLAGS fills its flags.
    let r = unsafe { libc::ioctl(s.as_raw_fd(), libc::SIOCGIFFLAGS, &mut ifr) };
    check("ioctl(SIOCGIFFLAGS, lo)", r as libc::c_long)?;
    // SAFETY: reading and writing the flags member of the union SIOCGIFFLAGS just filled.
    unsafe {
        ifr.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
    }
    // SAFETY: ifr is a valid ifreq naming "lo" with its new flags.
    let r = unsafe { libc::ioctl(s.as_raw_fd(), libc::SIOCSIFFLAGS, &ifr) };
    check("ioctl(SIOCSIFFLAGS, lo up)", r as libc::c_long).map(drop)
}
