//! File locks: flock(2), open-file-description locks (fcntl F_OFD_SETLK) and POSIX record
//! locks (fcntl F_SETLK).
//!
//! - **capture**: /proc/PID/fdinfo/FD lists, in `lock:` lines, the locks taken through that
//!   descriptor: those of its open file description (flock, OFD) and, for POSIX locks, those of
//!   the process (the kernel shows a lock only where its file and owner match).
//! - **restore**: flock and OFD locks belong to the description, not to whoever took them, so
//!   the restorer takes them on the rebuilt description; POSIX locks belong to the process, so
//!   the rebuilt process takes them itself (an injected fcntl). A lock still held elsewhere
//!   (by the frozen original of a migration on one machine, until the commit point) is taken
//!   at resume instead, once the original is gone ([`Deferred`]): a POSIX one by injecting the
//!   fcntl into the process once more, at a `syscall` instruction of its own code, with every
//!   signal held back meanwhile so that none is lost.

use crate::error::{Error, Result};
use crate::husk::Husk;
use ferry_image::{FileLock, LockKind};
use ferry_inject::Injector;
use std::cell::RefCell;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

/// The locks of one descriptor's fdinfo: (of its description: flock and OFD; of the process:
/// POSIX). `what` names the descriptor in errors.
pub fn capture(
    pid: i32,
    what: &str,
    info: &[(String, String)],
) -> Result<(Vec<FileLock>, Vec<FileLock>)> {
    let mut desc = Vec::new();
    let mut posix = Vec::new();
    for (_, line) in info.iter().filter(|(k, _)| k == "lock") {
        let lock = parse(line).map_err(|why| Error::Unsupported {
            pid,
            what: what.to_string(),
            why: format!("it holds a lock ({line:?}) {why}"),
        })?;
        match lock.kind {
            LockKind::Posix => posix.push(lock),
            LockKind::Flock | LockKind::Ofd | LockKind::Lease => desc.push(lock),
        }
    }
    Ok((desc, posix))
}

/// One `lock:` line of fdinfo: `1: POSIX  ADVISORY  WRITE 1234 fe:00:1234 0 EOF`.
fn parse(line: &str) -> std::result::Result<FileLock, String> {
    let t: Vec<&str> = line.split_whitespace().collect();
    if t.len() < 8 {
        return Err("that Ferry cannot read".into());
    }
    let kind = match t[1] {
        "POSIX" => LockKind::Posix,
        "FLOCK" => LockKind::Flock,
        "OFDLCK" => LockKind::Ofd,
        "LEASE" => {
            if t[2] != "ACTIVE" {
                return Err(
                    "that is a lease being broken (a process waits to open the file, \
                            which the kernel's lease break cannot be made to wait for again)"
                        .into(),
                );
            }
            let write = match t[3] {
                "WRITE" => true,
                "READ" => false,
                _ => return Err("that is a lease of an unknown type".into()),
            };
            return Ok(FileLock {
                kind: LockKind::Lease,
                write,
                start: 0,
                end: None,
            });
        }
        "DELEG" => return Err("that is an NFS delegation, which cannot be moved".into()),
        _ => return Err("of a kind Ferry does not know".into()),
    };
    if t[2] != "ADVISORY" {
        return Err("that is mandatory".into());
    }
    let write = match t[3] {
        "WRITE" => true,
        "READ" => false,
        _ => return Err("of an unknown type".into()),
    };
    let start = t[6]
        .parse()
        .map_err(|_| "with an unreadable start".to_string())?;
    let end = match t[7] {
        "EOF" => None,
        e => Some(
            e.parse()
                .map_err(|_| "with an unreadable end".to_string())?,
        ),
    };
    Ok(FileLock {
        kind,
        write,
        start,
        end,
    })
}

fn describe(l: &FileLock) -> String {
    let kind = match l.kind {
        LockKind::Flock => "flock",
        LockKind::Ofd => "OFD lock",
        LockKind::Posix => "POSIX lock",
        LockKind::Lease => "lease",
    };
    let mode = if l.write { "write" } else { "read" };
    match (l.kind, l.end) {
        (LockKind::Flock | LockKind::Lease, _) => format!("{mode} {kind}"),
        (_, Some(end)) => format!("{mode} {kind} on bytes {}-{end}", l.start),
        (_, None) => format!("{mode} {kind} on bytes {}-EOF", l.start),
    }
}

/// `struct flock` for x86_64, as bytes.
fn flock_struct(l: &FileLock) -> [u8; 32] {
    let ty = if l.write {
        libc::F_WRLCK
    } else {
        libc::F_RDLCK
    } as i16;
    let len = l.end.map_or(0, |e| e + 1 - l.start) as i64;
    let mut b = [0u8; 32];
    b[0..2].copy_from_slice(&ty.to_ne_bytes());
    b[2..4].copy_from_slice(&(libc::SEEK_SET as i16).to_ne_bytes());
    b[8..16].copy_from_slice(&(l.start as i64).to_ne_bytes());
    b[16..24].copy_from_slice(&len.to_ne_bytes());
    b
}

/// Tries once to take a flock or OFD lock on `fd`: Ok(false) if another holder has it.
fn try_take(fd: RawFd, l: &FileLock) -> ferry_sys::SysResult<bool> {
    let r = match l.kind {
        LockKind::Flock => {
            let op = if l.write {
                libc::LOCK_EX
            } else {
                libc::LOCK_SH
            };
            ferry_sys::fdops::flock(fd, op | libc::LOCK_NB)
        }
        _ => ferry_sys::fdops::fcntl_lock(fd, libc::F_OFD_SETLK, &flock_struct(l)),
    };
    match r {
        Ok(()) => Ok(true),
        Err(e) if e.errno == libc::EWOULDBLOCK || e.errno == libc::EACCES => Ok(false),
        Err(e) => Err(e),
    }
}

thread_local! {
    /// Locks the last restore on this thread left for [`Deferred::complete`].
    static DEFERRED: RefCell<Deferred> = RefCell::new(Deferred::default());
}

/// Locks still held elsewhere when the tree was rebuilt, to be taken when it is about to run:
/// description locks (with a copy of their description), and POSIX locks (by their process).
#[derive(Default)]
pub struct Deferred {
    locks: Vec<(OwnedFd, FileLock, String)>,
    posix: Vec<DeferredPosix>,
}

/// A POSIX lock (or a write lease) process `pid` (`host` here) is to take through its
/// descriptor `fd`.
struct DeferredPosix {
    pid: i32,
    host: i32,
    fd: i32,
    lock: FileLock,
    path: String,
    /// For a lease: the signal-driven I/O owner (`struct f_owner_ex`) to set again after it
    /// (F_SETLEASE makes the caller the owner), if the description had one.
    owner: Option<[u8; 8]>,
}

impl Deferred {
    /// What the descriptions just rebuilt on this thread left (nothing if none was).
    pub fn take() -> Deferred {
        DEFERRED.with(|d| std::mem::take(&mut *d.borrow_mut()))
    }

    /// Takes every lock, retrying while another holder has it, until `wait` has passed.
    /// `pid`: the process named in errors.
    pub fn complete(self, pid: i32, wait: Duration) -> Result<()> {
        let deadline = Instant::now() + wait;
        for (fd, l, path) in &self.locks {
            loop {
                let got = try_take(fd.as_raw_fd(), l).map_err(|e| Error::Restore {
                    pid,
                    what: format!("take the {} of {path}: {e}", describe(l)),
                })?;
                if got {
                    break;
                }
                if Instant::now() >= deadline {
                    return Err(Error::Restore {
                        pid,
                        what: format!(
                            "the {} of {path} is still held by another process after {wait:?} \
                             (the original of the tree, if it still runs?)",
                            describe(l)
                        ),
                    });
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        for d in &self.posix {
            take_posix_at_resume(d, deadline, wait)?;
        }
        Ok(())
    }
}

/// Injects `fcntl(F_SETLK)` into the stopped, fully rebuilt process of `d` until the lock is
/// free or `deadline` passes.
fn take_posix_at_resume(d: &DeferredPosix, deadline: Instant, wait: Duration) -> Result<()> {
    let what = format!("fd {}: take the {} of {}", d.fd, describe(&d.lock), d.path);
    crate::late::with_injector(d.pid, d.host, &what, |inj| loop {
        if try_take_posix(inj, d.pid, d.fd, &d.lock, &d.path)? {
            if let Some(owner) = d.owner {
                let arg = inj.write_scratch(0, &owner)?;
                let r = inj.syscall_raw(
                    "fcntl(F_SETOWN_EX)",
                    libc::SYS_fcntl,
                    &[d.fd as u64, ferry_sys::fdops::F_SETOWN_EX as u64, arg],
                )?;
                if r < 0 {
                    return Err(Error::Restore {
                        pid: d.pid,
                        what: format!(
                            "{what}: set its signal-driven I/O owner again: {}",
                            std::io::Error::from_raw_os_error(-r as i32)
                        ),
                    });
                }
            }
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(Error::Restore {
                pid: d.pid,
                what: format!(
                    "{what}: still held by another process after {wait:?} (the original of \
                     the tree, if it still runs?)"
                ),
            });
        }
        std::thread::sleep(Duration::from_millis(10));
    })
}

/// Tries once to take POSIX lock (or lease) `l` in process `pid` (injecting through `inj`),
/// through its descriptor `fd` (of `path`): Ok(false) if another process holds it (or, for
/// a lease, has the file open in a way it forbids).
fn try_take_posix(inj: &Injector, pid: i32, fd: i32, l: &FileLock, path: &str) -> Result<bool> {
    if l.kind == LockKind::Lease {
        return try_take_lease(inj, pid, fd, l, path);
    }
    let arg = inj.write_scratch(0, &flock_struct(l))?;
    let r = inj.syscall_raw(
        "fcntl(F_SETLK)",
        libc::SYS_fcntl,
        &[fd as u64, libc::F_SETLK as u64, arg],
    )?;
    if r == -(libc::EAGAIN as i64) || r == -(libc::EACCES as i64) {
        return Ok(false);
    }
    if r < 0 {
        return Err(Error::Restore {
            pid,
            what: format!(
                "fd {fd}: take the {} of {path}: {}",
                describe(l),
                std::io::Error::from_raw_os_error(-r as i32)
            ),
        });
    }
    Ok(true)
}

/// Takes the flock and OFD locks of a rebuilt description `fd` (at `path`), or leaves those
/// another holder still has for [`Deferred::complete`].
pub fn take_on_description(fd: &OwnedFd, locks: &[FileLock], path: &str) -> Result<()> {
    let me = std::process::id() as i32;
    // A lease is taken by the process holding the description (`take_lease`).
    for l in locks.iter().filter(|l| l.kind != LockKind::Lease) {
        let got = try_take(fd.as_raw_fd(), l).map_err(|e| Error::Restore {
            pid: me,
            what: format!("take the {} of {path}: {e}", describe(l)),
        })?;
        if !got {
            let copy = fd.try_clone().map_err(|e| Error::Io {
                pid: me,
                what: format!("keep a copy of {path} for its {}", describe(l)),
                source: e,
            })?;
            DEFERRED.with(|d| {
                d.borrow_mut()
                    .locks
                    .push((copy, l.clone(), path.to_string()))
            });
        }
    }
    Ok(())
}

/// Leaves lock `l` of process `h` (through its descriptor `fd` of `path`) for
/// [`Deferred::complete`], which takes it once the process that still holds (or forbids) it
/// is gone, and sets `owner` (a lease's `struct f_owner_ex`) again after it.
fn defer(h: &Husk, fd: i32, l: &FileLock, path: &str, owner: Option<[u8; 8]>) {
    DEFERRED.with(|d| {
        d.borrow_mut().posix.push(DeferredPosix {
            pid: h.pid,
            host: h.host,
            fd,
            lock: l.clone(),
            path: path.to_string(),
            owner,
        })
    });
}

/// Takes process `h`'s POSIX locks, each through its descriptor `fd` (already installed), or
/// leaves those another process still holds for [`Deferred::complete`].
pub fn take_posix(h: &Husk, fd: i32, locks: &[FileLock], path: &str) -> Result<()> {
    for l in locks {
        if !try_take_posix(h.injector(), h.pid, fd, l, path)? {
            defer(h, fd, l, path, None);
        }
    }
    Ok(())
}

/// Takes lease `l` again in rebuilt process `h`, through its descriptor `fd` of `path` (an
/// injected fcntl F_SETLEASE: the lease's signals go to that process, naming `fd`, as they
/// did for the process that took it). A write lease that another process's open still
/// forbids (the original of a migration on one machine, which let go of it but still has the
/// file open until the commit point) is taken at resume instead, once the original is gone,
/// and `owner` (a `struct f_owner_ex`, if the description had an owner) set again after it.
pub fn take_lease(
    h: &Husk,
    fd: i32,
    l: &FileLock,
    path: &str,
    owner: Option<[u8; 8]>,
) -> Result<()> {
    if try_take_lease(h.injector(), h.pid, fd, l, path)? {
        return Ok(());
    }
    if !l.write {
        return Err(Error::Restore {
            pid: h.pid,
            what: format!(
                "fd {fd}: take the {} of {path} again: another process has the file open in \
                 a way the lease forbids",
                describe(l)
            ),
        });
    }
    defer(h, fd, l, path, owner);
    Ok(())
}

/// Tries once to take lease `l` through `fd`: Ok(false) if another process has the file open
/// in a way the lease forbids.
fn try_take_lease(inj: &Injector, pid: i32, fd: i32, l: &FileLock, path: &str) -> Result<bool> {
    let arg = if l.write {
        libc::F_WRLCK
    } else {
        libc::F_RDLCK
    };
    let r = inj.syscall_raw(
        "fcntl(F_SETLEASE)",
        libc::SYS_fcntl,
        &[fd as u64, libc::F_SETLEASE as u64, arg as u64],
    )?;
    if r == -(libc::EAGAIN as i64) {
        return Ok(false);
    }
    if r < 0 {
        return Err(Error::Restore {
            pid,
            what: format!(
                "fd {fd}: take the {} of {path} again: {}",
                describe(l),
                std::io::Error::from_raw_os_error(-r as i32)
            ),
        });
    }
    Ok(true)
}

/// The leases of this machine (/proc/locks), as (device, inode, write), read once for a
/// restore: a description opened again while another process holds a lease its open breaks
/// would wait for the break (45 s by default) and break it.
pub fn leases_held() -> Vec<(u64, u64, bool)> {
    let text = std::fs::read_to_string("/proc/locks").unwrap_or_default();
    text.lines()
        .filter_map(|line| {
            let t: Vec<&str> = line.split_whitespace().collect();
            if t.len() < 6 || t[1] != "LEASE" {
                return None;
            }
            let write = t[3] == "WRITE";
            let mut id = t[5].split(':');
            let major = u32::from_str_radix(id.next()?, 16).ok()?;
            let minor = u32::from_str_radix(id.next()?, 16).ok()?;
            let ino = id.next()?.parse().ok()?;
            Some((libc::makedev(major, minor), ino, write))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fdinfo_lock_lines() {
        let l = parse("1: POSIX  ADVISORY  WRITE 1234 fe:00:10166504 0 99").unwrap();
        assert_eq!(
            (l.kind, l.write, l.start, l.end),
            (LockKind::Posix, true, 0, Some(99))
        );
        let l = parse("2: FLOCK  ADVISORY  READ 1234 fe:00:10166504 0 EOF").unwrap();
        assert_eq!((l.kind, l.write, l.end), (LockKind::Flock, false, None));
        let l = parse("3: OFDLCK ADVISORY  READ -1 fe:00:10166504 200 299").unwrap();
        assert_eq!((l.kind, l.start, l.end), (LockKind::Ofd, 200, Some(299)));
        let l = parse("4: LEASE  ACTIVE    READ 1 fe:00:1 0 EOF").unwrap();
        assert_eq!((l.kind, l.write), (LockKind::Lease, false));
        let l = parse("4: LEASE  ACTIVE    WRITE 1 fe:00:1 0 EOF").unwrap();
        assert_eq!((l.kind, l.write), (LockKind::Lease, true));
        assert!(parse("4: LEASE  BREAKING  READ 1 fe:00:1 0 EOF").is_err());
        assert!(parse("4: DELEG  ACTIVE    READ 1 fe:00:1 0 EOF").is_err());
        assert!(parse("garbage").is_err());
        let b = flock_struct(&parse("1: POSIX  ADVISORY  WRITE 1 0:0:1 100 199").unwrap());
        assert_eq!(i16::from_ne_bytes([b[0], b[1]]), libc::F_WRLCK as i16);
        assert_eq!(i64::from_ne_bytes(b[16..24].try_into().unwrap()), 100);
    }
}
