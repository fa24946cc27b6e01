//! Directories and FIFOs removed while still in use: a directory held open by a descriptor,
//! or a process's working directory; a FIFO held open (its buffered bytes are the pipe's, see
//! `files.rs`). Such a directory is empty and can gain no entry; what is left of either is an
//! inode with its mode, and the name /proc shows followed by " (deleted)". It is made again
//! under its old name (beside it, under a name of ours, when that name is taken now), with
//! the rights of the process it is for, entered or opened, and removed.

use crate::error::{Error, Result};
use ferry_sys::fsid::{self, with_fs_creds, FsCreds};
use std::ffi::OsString;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;

/// What was removed.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Node {
    Dir,
    Fifo,
}

/// An empty directory or a FIFO made to stand for a removed one, removed again when dropped.
pub struct Made {
    node: Node,
    /// Its parent (O_PATH), opened without following any link.
    parent: OwnedFd,
    name: OsString,
    /// Where it is, for the process to enter.
    pub path: String,
    creds: FsCreds,
    removed: bool,
}

/// Makes an empty directory (or a FIFO) with `mode` where `path` was, as `creds`, for `how`
/// (what needs it, for messages) of process `pid`.
pub fn make(
    pid: i32,
    how: &str,
    node: Node,
    path: &str,
    mode: u32,
    creds: &FsCreds,
) -> Result<Made> {
    let kind = if node == Node::Dir {
        "directory"
    } else {
        "FIFO"
    };
    let fail = |why: String| Error::Restore {
        pid,
        what: format!("{how}: make removed {kind} {path} again (as {creds}): {why}"),
    };
    let p = Path::new(path);
    let (Some(parent), Some(name)) = (p.parent(), p.file_name()) else {
        return Err(fail("it has no name in a directory".into()));
    };
    if !p.is_absolute() {
        return Err(fail("its path is relative".into()));
    }
    let name = name.to_owned();
    let made = with_fs_creds(
        creds,
        || -> std::result::Result<(OwnedFd, OsString), String> {
            let dir = fsid::openat2(
                libc::AT_FDCWD,
                &parent.to_string_lossy(),
                libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
                0,
                libc::RESOLVE_NO_SYMLINKS,
            )
            .map_err(|e| format!("open its parent {}: {e}", parent.display()))?;
            let mut name = name.clone();
            let mode = mode & 0o7777;
            let mk = |n: &std::ffi::OsStr| match node {
                Node::Dir => fsid::mkdir_in(dir.as_raw_fd(), n, mode),
                Node::Fifo => fsid::mkfifo_in(dir.as_raw_fd(), n, mode),
            };
            if let Err(e) = mk(&name) {
                if e.errno != libc::EEXIST {
                    return Err(format!("make it: {e}"));
                }
                // The name is someone else's now: what was removed was not it.
                name.push(format!(".ferry-removed-{}", std::process::id()));
                mk(&name).map_err(|e| format!("make it: {e}"))?;
            }
            Ok((dir, name))
        },
    )
    .map_err(|e| fail(e.to_string()))?
    .map_err(fail)?;
    let (parent_fd, name) = made;
    let full = parent.join(&name).to_string_lossy().into_owned();
    let m = Made {
        node,
        parent: parent_fd,
        name,
        path: full,
        creds: creds.clone(),
        removed: false,
    };
    // Its mode as captured (mkdir(2) takes the umask off).
    // (A FIFO opened for reading without waiting for a writer.)
    let fd = m.open(pid, how, libc::O_RDONLY | libc::O_NONBLOCK)?;
    let _ = std::fs::File::from(fd)
        .set_permissions(std::os::unix::fs::PermissionsExt::from_mode(mode & 0o7777));
    Ok(m)
}

impl Made {
    /// Opens it with `flags`.
    pub fn open(&self, pid: i32, how: &str, flags: i32) -> Result<OwnedFd> {
        let name = self.name.to_string_lossy().into_owned();
        let parent = self.parent.as_raw_fd();
        with_fs_creds(&self.creds, || {
            fsid::openat2(
                parent,
                &name,
                flags
                    | if self.node == Node::Dir {
                        libc::O_DIRECTORY
                    } else {
                        0
                    }
                    | libc::O_NOFOLLOW
                    | libc::O_CLOEXEC,
                0,
                libc::RESOLVE_BENEATH | libc::RESOLVE_NO_SYMLINKS,
            )
        })
        .map_err(|e| e.to_string())
        .and_then(|r| r.map_err(|e| e.to_string()))
        .map_err(|e| Error::Restore {
            pid,
            what: format!("{how}: open the directory made for {}: {e}", self.path),
        })
    }

    /// Removes it: whoever holds it holds a removed directory.
    pub fn remove(mut self, pid: i32, how: &str) -> Result<()> {
        self.removed = true;
        let parent = self.parent.as_raw_fd();
        let name = self.name.clone();
        let node = self.node;
        with_fs_creds(&self.creds, || remove_in(node, parent, &name))
            .map_err(|e| e.to_string())
            .and_then(|r| r.map_err(|e| e.to_string()))
            .map_err(|e| Error::Restore {
                pid,
                what: format!("{how}: remove the directory made for {}: {e}", self.path),
            })
    }
}

impl Drop for Made {
    fn drop(&mut self) {
        if !self.removed {
            let parent = self.parent.as_raw_fd();
            let name = self.name.clone();
            let node = self.node;
            let _ = with_fs_creds(&self.creds, || remove_in(node, parent, &name));
        }
    }
}

fn remove_in(
    node: Node,
    parent: std::os::fd::RawFd,
    name: &std::ffi::OsStr,
) -> ferry_sys::SysResult<()> {
    match node {
        Node::Dir => fsid::rmdir_in(parent, name),
        Node::Fifo => fsid::unlink_in(parent, name),
    }
}
