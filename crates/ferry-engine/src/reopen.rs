//! Opening again, at restore, what a process had open or mapped by path: with the process's
//! own rights, without following a symbolic link anywhere in the path, and only if the path
//! still names the file that was captured.
//!
//! Ferry runs as root, and a path is something the process's owner controls: between a
//! checkpoint and a restore they may have replaced a file, or a directory on its way, with a
//! symbolic link to a file of root's. So the path is walked on a thread that holds the
//! process's file-system credentials (`ferry_sys::fsid`), with `RESOLVE_NO_SYMLINKS` (a
//! captured path is the kernel's own name of the file, which never goes through a link), only
//! for an `O_PATH` descriptor; that descriptor's inode is compared with the one recorded at
//! checkpoint ([`FileIdentity`]); and only then is the file opened, through the descriptor, with
//! the flags the process had.
//!
//! A process may hold a file its credentials could not open now: one opened before it dropped
//! root, say (a daemon's log). When the process's rights are refused (EACCES, EPERM), the path
//! is tried again with the rights of whoever asked for the restore ([`Rights::caller`]; Ferry's
//! own, root, today), and then the file must be the very one captured: the same device, inode,
//! type, size and change time, which the process had open when it was frozen.
//!
//! With the process's own rights, a regular file on another device or inode (the same path on
//! another machine) is taken if it holds what the captured one held (`crate::digests`).

use crate::error::{Error, Result};
use ferry_image::{FileIdentity, Process};
use ferry_sys::fsid::{self, FsCreds};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;

/// What a file is, as stat(2) describes it.
pub fn identity_of(md: &std::fs::Metadata) -> FileIdentity {
    FileIdentity {
        dev: md.dev(),
        ino: md.ino(),
        mode: md.mode(),
        rdev: md.rdev(),
        size: md.len(),
        ctime_sec: md.ctime(),
        ctime_nsec: md.ctime_nsec(),
    }
}

/// The file-system credentials process `p` acts with.
pub fn creds_of(p: &Process) -> FsCreds {
    FsCreds {
        uid: p.creds.uids[3],
        gid: p.creds.gids[3],
        groups: p.creds.groups.clone(),
    }
}

/// Whose rights a file operation for a process uses.
#[derive(Debug, Clone)]
pub struct Rights<'a> {
    /// The process (its PID in the image), for messages.
    pub pid: i32,
    /// The process's own (its fsuid, fsgid and groups as captured).
    pub process: FsCreds,
    /// Whoever asked for the restore; `None`: Ferry itself (root). Used only when the
    /// process's own rights are refused, and then only for the very file captured.
    pub caller: Option<&'a FsCreds>,
}

impl<'a> Rights<'a> {
    pub fn of(p: &Process, caller: Option<&'a FsCreds>) -> Rights<'a> {
        Rights {
            pid: p.pid,
            process: creds_of(p),
            caller,
        }
    }

    /// The second try's credentials, if they differ from the process's.
    fn fallback(&self) -> Option<FsCreds> {
        let c = self.caller.cloned().unwrap_or_else(FsCreds::root);
        (c != self.process).then_some(c)
    }
}

/// Which parts of a file's identity must match.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Match {
    /// A regular file: device, inode, type, size and change time.
    Contents,
    /// A directory, FIFO or other name: device, inode and type (their change time moves with
    /// their entries or every write).
    Inode,
    /// A device opened by path (/dev/null ...): its type and device number.
    Device,
    /// A mapped file: device, inode, type and size (the image records no change time for
    /// mappings).
    Mapped,
}

/// The ways `now` differs from `want`, as `Match` counts them.
fn differences(want: &FileIdentity, now: &FileIdentity, m: Match) -> Vec<String> {
    let mut out = Vec::new();
    let kind = |mode: u32| match mode & libc::S_IFMT {
        libc::S_IFREG => "a regular file",
        libc::S_IFDIR => "a directory",
        libc::S_IFLNK => "a symbolic link",
        libc::S_IFIFO => "a FIFO",
        libc::S_IFSOCK => "a socket",
        libc::S_IFCHR => "a character device",
        libc::S_IFBLK => "a block device",
        _ => "of an unknown type",
    };
    if want.mode & libc::S_IFMT != now.mode & libc::S_IFMT {
        out.push(format!(
            "it is {} now, {} when captured",
            kind(now.mode),
            kind(want.mode)
        ));
    }
    if m == Match::Device {
        if want.rdev != now.rdev {
            out.push(format!(
                "device number {:#x} now, {:#x} captured",
                now.rdev, want.rdev
            ));
        }
        return out;
    }
    if (want.dev, want.ino) != (now.dev, now.ino) {
        out.push(format!(
            "inode {} on device {:#x} now, inode {} on device {:#x} captured",
            now.ino, now.dev, want.ino, want.dev
        ));
    }
    if matches!(m, Match::Contents | Match::Mapped) && want.size != now.size {
        out.push(format!("size {} now, {} captured", now.size, want.size));
    }
    if m == Match::Contents && (want.ctime_sec, want.ctime_nsec) != (now.ctime_sec, now.ctime_nsec)
    {
        out.push(format!(
            "changed at {}.{:09} now, {}.{:09} when captured",
            now.ctime_sec, now.ctime_nsec, want.ctime_sec, want.ctime_nsec
        ));
    }
    out
}

enum Failed {
    /// The kernel refused these rights.
    Denied(std::io::Error),
    Other(String),
    Differs(Vec<String>),
}

fn io_failed(e: std::io::Error, what: &str) -> Failed {
    match e.raw_os_error() {
        Some(libc::EACCES) | Some(libc::EPERM) => Failed::Denied(e),
        Some(libc::ELOOP) => Failed::Other(format!(
            "{what}: a symbolic link is in the path now (it was not when captured)"
        )),
        _ => Failed::Other(format!("{what}: {e}")),
    }
}

/// One try, on a thread with `creds`. `by_contents`: a regular file elsewhere than the one
/// captured (another machine's) is taken if it holds what the captured one held
/// (`crate::digests`).
fn try_open(
    creds: &FsCreds,
    path: &str,
    flags: i32,
    want: Option<&FileIdentity>,
    m: Match,
    by_contents: bool,
) -> std::result::Result<OwnedFd, Failed> {
    let r = fsid::with_fs_creds(creds, || {
        let o = fsid::openat2(
            libc::AT_FDCWD,
            path,
            libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            0,
            libc::RESOLVE_NO_SYMLINKS,
        )
        .map_err(|e| io_failed(e.io(), "look it up"))?;
        let through = format!("/proc/self/fd/{}", o.as_raw_fd());
        if let Some(want) = want {
            let md = std::fs::metadata(&through).map_err(|e| io_failed(e, "stat it"))?;
            let now = identity_of(&md);
            let mut diff = differences(want, &now, m);
            if !diff.is_empty() && by_contents && matches!(m, Match::Contents | Match::Mapped) {
                match crate::digests::same_contents(want, &now, &through) {
                    Some(true) => diff.clear(),
                    Some(false) => diff.push("its contents differ from the file captured".into()),
                    None => {}
                }
            }
            if !diff.is_empty() {
                return Err(Failed::Differs(diff));
            }
        }
        if flags & libc::O_PATH != 0 && flags & libc::O_NOFOLLOW != 0 {
            // A name and nothing more (a symbolic link itself, say): what we hold.
            return Ok(o);
        }
        ferry_sys::fdops::open_path(&through, flags | libc::O_CLOEXEC, 0)
            .map_err(|e| io_failed(e.io(), "open it"))
    });
    match r {
        Ok(r) => r,
        Err(e) => Err(Failed::Other(format!("take the rights of {creds}: {e}"))),
    }
}

/// Opens `path` with `flags` for process `pid` (its descriptor or mapping `what`, for
/// messages), as `rights` allow, refusing a file that is not `want` (`None`: an image from
/// before identities were recorded; then only the rights are checked).
pub fn open(
    pid: i32,
    what: &str,
    path: &str,
    flags: i32,
    want: Option<&FileIdentity>,
    m: Match,
    rights: &Rights<'_>,
) -> Result<OwnedFd> {
    let refuse = |why: String| Error::Restore {
        pid,
        what: format!("{what}: {path}: {why}"),
    };
    let differs = |d: Vec<String>| {
        refuse(format!(
            "not the file that was captured ({}); refused",
            d.join("; ")
        ))
    };
    match try_open(&rights.process, path, flags, want, m, true) {
        Ok(fd) => Ok(fd),
        Err(Failed::Differs(d)) => Err(differs(d)),
        Err(Failed::Other(e)) => Err(refuse(e)),
        Err(Failed::Denied(e)) => {
            let Some(caller) = rights.fallback() else {
                return Err(refuse(format!("{e} (as {})", rights.process)));
            };
            // Only for the very file captured, all of it checked.
            let Some(want) = want else {
                return Err(refuse(format!(
                    "{e} (as {}; the image does not say which file it was, so no other \
                     rights are tried)",
                    rights.process
                )));
            };
            // Exactly that file: never another with the same contents.
            match try_open(&caller, path, flags, Some(want), m, false) {
                Ok(fd) => Ok(fd),
                Err(Failed::Differs(d)) => Err(differs(d)),
                Err(Failed::Other(e2)) => Err(refuse(e2)),
                Err(Failed::Denied(e2)) => Err(refuse(format!(
                    "{e} (as {}), {e2} (as {caller})",
                    rights.process
                ))),
            }
        }
    }
}
