//! Descriptors backed by anonymous inodes: epoll (with its interest list), timerfd, signalfd,
//! inotify. (eventfd lives in files.rs.)

use crate::error::Result;
use crate::husk::Husk;
use ferry_image::{FileDesc, FileKind, Process};
use std::os::fd::OwnedFd;

/// Describes descriptor `fd` of `pid` (whose /proc link is `link`, e.g.
/// "anon_inode:[eventpoll]", and whose fdinfo lines are `info`), or `None` when this module
/// does not handle that kind (the caller then refuses it).
pub fn classify(
    _pid: i32,
    _fd: i32,
    _link: &str,
    _info: &[(String, String)],
) -> Result<Option<FileKind>> {
    Ok(None)
}

/// Recreates the open file description `d` in this (the restoring) process.
pub fn open(d: &FileDesc) -> Result<OwnedFd> {
    Err(crate::Error::BadImage(format!(
        "file {}: {:?} cannot be restored by this version",
        d.id, d.kind
    )))
}

/// Completes state that refers to the process's descriptor numbers, once all are installed.
pub fn after_install(_h: &Husk, _p: &Process) -> Result<()> {
    Ok(())
}
