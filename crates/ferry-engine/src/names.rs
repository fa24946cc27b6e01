//! The files of a moving tree's UNIX sockets, set aside while it moves.
//!
//! A UNIX socket bound to a path owns a socket file there, and a copy of the socket can bind
//! that path only once the file is gone. Where the source and the destination see one file
//! system (the nodes of a local cluster; machines sharing their files, as Sprite's did), the
//! frozen original still holds its files while its copy is rebuilt, before the commit point.
//! So the source renames each of them aside (in the same directory, under a name that says
//! whose it is) once the image is captured; after the commit it removes them; if the migration
//! fails, it renames them back before the original runs again, replacing whatever socket file
//! the copy had made meanwhile. The kernel keeps the name a socket was bound to, so the
//! original's `getsockname` never changes; only its file moves, and only while it is frozen.

use crate::error::{Context, Result};
use crate::freeze::FrozenTree;
use crate::procfs;
use crate::resources::sockets::same_dev;
use ferry_sys::fsid::{with_fs_creds, FsCreds};
use ferry_sys::sockets as sk;
use std::collections::{HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

/// TCP_ESTABLISHED, as sock_diag reports a connected stream socket's state.
const ESTABLISHED: u8 = 1;

/// Socket files moved aside; put them back or remove them (dropping it puts them back).
#[derive(Debug, Default)]
pub struct SocketFilesAside {
    moved: Vec<Moved>,
}

#[derive(Debug)]
struct Moved {
    /// The directory, held open (O_PATH) so that it is found again after the tree is gone.
    dir: OwnedFd,
    name: OsString,
    aside: OsString,
    /// The path as the tree names it, for messages.
    shown: PathBuf,
    /// The file-system rights of the process that holds the socket: the file is looked at,
    /// renamed and removed with them, never with root's.
    creds: FsCreds,
}

impl SocketFilesAside {
    /// Renames aside the file of every UNIX socket of the frozen tree that is bound to a path
    /// whose file is still there. On failure, what was already moved is put back.
    pub fn set_aside(frozen: &FrozenTree) -> Result<SocketFilesAside> {
        let mut out = SocketFilesAside::default();
        let root = frozen.procs.first().map(|p| p.pid).unwrap_or(0);
        // Every socket of the tree, with a process that holds it.
        let mut holder: HashMap<u32, i32> = HashMap::new();
        for p in frozen.procs.iter().filter(|p| !p.zombie) {
            for fd in procfs::fds(p.pid)? {
                let Ok(link) = procfs::readlink(p.pid, &format!("fd/{fd}")) else {
                    continue;
                };
                if let Some(ino) = link
                    .strip_prefix("socket:[")
                    .and_then(|s| s.strip_suffix(']'))
                    .and_then(|s| s.parse().ok())
                {
                    holder.entry(ino).or_insert(p.pid);
                }
            }
        }
        if holder.is_empty() {
            return Ok(out);
        }
        let all = sk::unix_diag(
            None,
            sk::UDIAG_SHOW_NAME | sk::UDIAG_SHOW_VFS | sk::UDIAG_SHOW_PEER,
        )
        .ctx(root, || "ask sock_diag about UNIX sockets".into())?;
        let mut seen = HashSet::new();
        for d in all {
            let Some(&pid) = holder.get(&d.ino) else {
                continue;
            };
            // Accepted connections share their listener's name and file without owning them.
            if d.sock_type != libc::SOCK_DGRAM as u8 && d.state == ESTABLISHED {
                continue;
            }
            // A datagram socket connected to one outside the tree, of a tree leaving its home,
            // is relayed: the original stays at home with its name, which the body never binds.
            let outside = |p: u32| p != 0 && !holder.contains_key(&p);
            if frozen.relay_pipes
                && d.sock_type == libc::SOCK_DGRAM as u8
                && d.peer.is_some_and(outside)
            {
                continue;
            }
            let (Some(mut name), Some((ino, dev))) = (d.name, d.vfs) else {
                continue;
            };
            // sock_diag gives a path name with the NUL that ends it.
            if name.first().is_some_and(|b| *b != 0) {
                while name.last() == Some(&0) {
                    name.pop();
                }
            }
            if name.first().is_none_or(|b| *b == 0) || !seen.insert((ino, dev)) {
                continue; // abstract, or already moved
            }
            if let Err(e) = out.move_one(pid, &name, ino, dev) {
                out.put_back_logged();
                return Err(e);
            }
        }
        Ok(out)
    }

    /// Moves the file of the socket bound to `name` (as process `pid` resolves it) aside, if
    /// it is still that socket's file.
    fn move_one(&mut self, pid: i32, name: &[u8], ino: u32, dev: u32) -> Result<()> {
        let path = Path::new(OsStr::from_bytes(name));
        let (base, resolve) = if path.is_absolute() {
            // Resolved as the process resolves it: under its root, links and all.
            (format!("/proc/{pid}/root"), libc::RESOLVE_IN_ROOT)
        } else {
            (format!("/proc/{pid}/cwd"), 0)
        };
        let (Some(parent), Some(file)) = (path.parent(), path.file_name()) else {
            return Ok(());
        };
        let parent = parent.strip_prefix("/").unwrap_or(parent);
        let parent = if parent.as_os_str().is_empty() {
            Path::new(".")
        } else {
            parent
        };
        let base = ferry_sys::fdops::open_path(
            &base,
            libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
            0,
        )
        .ctx(pid, || {
            format!("open the directory of socket file {}", path.display())
        })?;
        let creds = procfs::fs_creds(pid)?;
        let mut aside = b".".to_vec();
        aside.extend_from_slice(file.as_bytes());
        aside.extend_from_slice(format!(".ferry-moving-{pid}").as_bytes());
        let aside = OsString::from_vec(aside);
        let moved = with_fs_creds(
            &creds,
            || -> std::result::Result<Option<OwnedFd>, String> {
                let dir = ferry_sys::fsid::openat2(
                    base.as_raw_fd(),
                    &parent.to_string_lossy(),
                    libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
                    0,
                    resolve,
                )
                .map_err(|e| {
                    format!("open the directory of socket file {}: {e}", path.display())
                })?;
                let here = Path::new(&format!("/proc/self/fd/{}", dir.as_raw_fd())).join(file);
                match std::fs::symlink_metadata(&here) {
                    Ok(md)
                        if md.file_type().is_socket()
                            && md.ino() as u32 == ino
                            && same_dev(dev, md.dev()) => {}
                    // Removed or replaced since it was bound: nothing of ours to move.
                    _ => return Ok(None),
                }
                ferry_sys::fsid::rename_in(dir.as_raw_fd(), file, &aside, true).map_err(|e| {
                    format!(
                        "move socket file {} aside while the tree moves: {e}",
                        path.display()
                    )
                })?;
                Ok(Some(dir))
            },
        );
        let dir = match moved {
            Ok(Ok(Some(dir))) => dir,
            Ok(Ok(None)) => return Ok(()),
            Ok(Err(e)) => {
                return Err(crate::Error::Restore {
                    pid,
                    what: format!("{e} (as {creds})"),
                })
            }
            Err(e) => return Err(e).ctx(pid, || format!("take the rights of {creds}")),
        };
        self.moved.push(Moved {
            dir,
            name: file.to_owned(),
            aside,
            shown: path.to_owned(),
            creds,
        });
        Ok(())
    }

    /// How many socket files are aside.
    pub fn len(&self) -> usize {
        self.moved.len()
    }

    pub fn is_empty(&self) -> bool {
        self.moved.is_empty()
    }

    /// The migration failed: every file goes back under its name (replacing a socket file the
    /// copy may have made there), before the original runs again. Errors name every file that
    /// could not go back.
    pub fn put_back(mut self) -> std::result::Result<(), String> {
        put_back_all(std::mem::take(&mut self.moved))
    }

    fn put_back_logged(&mut self) {
        if let Err(e) = put_back_all(std::mem::take(&mut self.moved)) {
            log::error!("{e}");
        }
    }

    /// The migration committed: the files set aside are the original's, which is gone.
    pub fn remove(mut self) {
        for m in std::mem::take(&mut self.moved) {
            let removed = with_fs_creds(&m.creds, || {
                ferry_sys::fsid::unlink_in(m.dir.as_raw_fd(), &m.aside)
            });
            if let Err(e) = removed.and_then(|r| r) {
                log::warn!(
                    "remove the old socket file {:?} of {}: {e}",
                    m.aside,
                    m.shown.display()
                );
            }
        }
    }
}

fn put_back_all(moved: Vec<Moved>) -> std::result::Result<(), String> {
    let failed: Vec<String> = moved
        .into_iter()
        .filter_map(|m| {
            with_fs_creds(&m.creds, || {
                ferry_sys::fsid::rename_in(m.dir.as_raw_fd(), &m.aside, &m.name, false)
            })
            .and_then(|r| r)
            .err()
            .map(|e| format!("{} (left as {:?}): {e}", m.shown.display(), m.aside))
        })
        .collect();
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "could not put socket files back: {}",
            failed.join("; ")
        ))
    }
}

impl Drop for SocketFilesAside {
    fn drop(&mut self) {
        self.put_back_logged();
    }
}
