//! The write leases of a moving tree, let go while it moves.
//!
//! A write lease (fcntl F_SETLEASE F_WRLCK) forbids any other open of its file: an open from
//! elsewhere waits for the lease to be broken (45 s by default) and breaks it. Where the source
//! and the destination share one kernel (the nodes of a local cluster), the frozen original
//! still holds its leases while its copy is rebuilt, and the copy opens the file again. So the
//! source lets go of each write lease (an F_SETLEASE F_UNLCK injected into the frozen original,
//! through its descriptor) once the image is captured, before it leaves; the copy takes it
//! again at resume, once the original is gone (`locks::take_lease`, deferred). If the
//! migration fails, the original takes it back before it runs again (F_SETLEASE F_WRLCK, and
//! its signal-driven I/O owner as it was), waiting for the copy to have closed the file.
//! Between the two nobody holds the lease: an open by someone else meanwhile is not refused
//! (and, if it stays open, keeps the original from taking the lease back: logged).

use crate::error::{Error, Result};
use crate::freeze::FrozenTree;
use crate::procfs;
use ferry_inject::Injector;
use ferry_sys::fdops;
use std::collections::HashSet;
use std::time::{Duration, Instant};

/// How long the original waits, taking a lease back, for the copy to close the file.
const PUT_BACK_WAIT: Duration = Duration::from_secs(10);

/// Write leases let go; put them back or forget them (dropping it forgets them).
#[derive(Debug, Default)]
pub struct WriteLeasesAside {
    released: Vec<Released>,
}

#[derive(Debug)]
struct Released {
    /// The process (our PID, the thread it is read through) and its descriptor of the file.
    pid: i32,
    fd: i32,
    /// Its signal-driven I/O owner (`struct f_owner_ex`) before: F_SETLEASE makes the caller
    /// the owner, so it is set again after the lease is taken back.
    owner: [u8; 8],
    /// The file, for messages.
    path: String,
}

/// Runs `f` with an injector into frozen process `fp`.
fn with_injector<T>(
    fp: &crate::freeze::FrozenProc,
    f: impl FnOnce(&Injector) -> Result<T>,
) -> Result<T> {
    let host = fp.host();
    let t = fp.threads.first().ok_or_else(|| Error::Unsupported {
        pid: fp.pid,
        what: "its threads".into(),
        why: "none is left".into(),
    })?;
    let at = ferry_inject::find_syscall_insn(host)?;
    let inj = Injector::on_stack(host, t.tid, t.regs, at)?;
    let out = f(&inj);
    let done = inj.finish().map_err(Error::from);
    let out = out?;
    done?;
    Ok(out)
}

impl WriteLeasesAside {
    /// Lets go of every write lease the frozen tree holds (fdinfo's `lock:` lines), each
    /// through the first descriptor of it found. On failure, what was let go is put back.
    pub fn set_aside(frozen: &FrozenTree) -> Result<WriteLeasesAside> {
        let mut out = WriteLeasesAside::default();
        let mut seen = HashSet::new();
        for fp in frozen.procs.iter().filter(|p| !p.zombie) {
            let host = fp.host();
            let mut mine = Vec::new();
            for fd in procfs::fds(host)? {
                let Ok(info) = procfs::fdinfo(host, fd) else {
                    continue;
                };
                // `1: LEASE  ACTIVE    WRITE 1234 fe:00:1234 0 EOF`: one write lease per
                // file at most, known by its device and inode.
                let lease = info.iter().find_map(|(k, v)| {
                    let t: Vec<&str> = v.split_whitespace().collect();
                    (k == "lock" && t.len() >= 6 && t[1] == "LEASE" && t[3] == "WRITE")
                        .then(|| t[5].to_string())
                });
                if let Some(id) = lease.filter(|id| seen.insert(id.clone())) {
                    let path = procfs::readlink(host, &format!("fd/{fd}")).unwrap_or(id);
                    mine.push((fd, path));
                }
            }
            if mine.is_empty() {
                continue;
            }
            let r = with_injector(fp, |inj| {
                for (fd, path) in mine {
                    let arg = inj.write_scratch(0, &[0u8; 8])?;
                    let r = inj.syscall_raw(
                        "fcntl(F_GETOWN_EX)",
                        libc::SYS_fcntl,
                        &[fd as u64, fdops::F_GETOWN_EX as u64, arg],
                    )?;
                    let mut owner = [0u8; 8];
                    if r >= 0 {
                        owner.copy_from_slice(&inj.read_scratch(0, 8)?);
                    }
                    let r = inj.syscall_raw(
                        "fcntl(F_SETLEASE, F_UNLCK)",
                        libc::SYS_fcntl,
                        &[fd as u64, libc::F_SETLEASE as u64, libc::F_UNLCK as u64],
                    )?;
                    if r < 0 {
                        return Err(Error::Unsupported {
                            pid: fp.pid,
                            what: format!("fd {fd} ({path})"),
                            why: format!(
                                "its write lease could not be let go while it moves: {}",
                                std::io::Error::from_raw_os_error(-r as i32)
                            ),
                        });
                    }
                    out.released.push(Released {
                        pid: fp.pid,
                        fd,
                        owner,
                        path,
                    });
                }
                Ok(())
            });
            if let Err(e) = r {
                if let Err(back) = std::mem::take(&mut out).put_back(frozen) {
                    log::error!("{back}");
                }
                return Err(e);
            }
        }
        Ok(out)
    }

    /// How many leases were let go.
    pub fn len(&self) -> usize {
        self.released.len()
    }

    pub fn is_empty(&self) -> bool {
        self.released.is_empty()
    }

    /// The original takes its write leases back (the tree still frozen), each once no one else
    /// has the file open (the copy being thrown away), waiting up to [`PUT_BACK_WAIT`]; then its
    /// signal-driven I/O owner as it was. Every lease is tried; the first failure is returned.
    pub fn put_back(self, frozen: &FrozenTree) -> Result<()> {
        let deadline = Instant::now() + PUT_BACK_WAIT;
        let mut first_err = None;
        for r in self.released {
            let Some(fp) = frozen.procs.iter().find(|p| p.pid == r.pid) else {
                continue;
            };
            let res = with_injector(fp, |inj| loop {
                let got = inj.syscall_raw(
                    "fcntl(F_SETLEASE, F_WRLCK)",
                    libc::SYS_fcntl,
                    &[r.fd as u64, libc::F_SETLEASE as u64, libc::F_WRLCK as u64],
                )?;
                if got == -(libc::EAGAIN as i64) && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
                if got < 0 {
                    return Err(Error::Restore {
                        pid: r.pid,
                        what: format!(
                            "fd {} ({}): take its write lease back: {}{}",
                            r.fd,
                            r.path,
                            std::io::Error::from_raw_os_error(-got as i32),
                            if got == -(libc::EAGAIN as i64) {
                                " (another process still has the file open)"
                            } else {
                                ""
                            }
                        ),
                    });
                }
                if r.owner != [0u8; 8] {
                    let arg = inj.write_scratch(0, &r.owner)?;
                    inj.syscall_raw(
                        "fcntl(F_SETOWN_EX)",
                        libc::SYS_fcntl,
                        &[r.fd as u64, fdops::F_SETOWN_EX as u64, arg],
                    )?;
                }
                return Ok(());
            });
            if let Err(e) = res {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}
