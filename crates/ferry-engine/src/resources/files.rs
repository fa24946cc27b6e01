//! File descriptors and the open file descriptions behind them: regular files (deleted ones
//! too), directories, devices, pipes and FIFOs with their buffered bytes, eventfds, memfds.
//!
//! Descriptions shared between descriptors (dup) or processes (fork) are found with kcmp(2) and
//! recreated once; every process then takes its copy of the one description with
//! pidfd_getfd(2), so sharing survives exactly.

use crate::error::{Context, Error, Result};
use crate::husk::Husk;
use crate::objects::{CaptureObjects, RestoreObjects};
use crate::procfs;
use crate::reopen::Match;
use ferry_image::{Fd, FileDesc, FileKind, FileOwner, OwnerKind, Pipe, Process, Tree};
use ferry_sys::fdops;
use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};

/// Devices whose descriptors carry no state beyond their flags.
const STATELESS_DEVICES: &[&str] = &[
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/random",
    "/dev/urandom",
];

#[derive(Default)]
pub struct FdCapture {
    seen: Vec<(i32, i32, u64, u64, u32)>,
    pipes_by_ino: HashMap<u64, u32>,
    /// Anonymous pipes (by inode) held outside the tree too, captured as relayed
    /// (`FrozenTree::relay_pipes`).
    pub relay: HashMap<u64, i32>,
    /// Stand-ins for relays to the tree's home (pipe inode -> relay id at home), captured as
    /// relayed with their buffered bytes (`FrozenTree::relay_standins`).
    pub relay_standins: HashMap<u64, u32>,
    /// Capture slaves of terminals outside the tree as relayed (`TtyDesc::relayed`).
    pub relay_ttys: bool,
    /// Descriptors in flight found in the sockets' queues (see `sockets::InFlight`).
    inflight: std::cell::RefCell<super::sockets::InFlight>,
    /// The PIDs and TIDs of the tree (ours): a file under /proc/PID of one of them is refused.
    pub tree_ids: std::collections::HashSet<i32>,
    /// The PIDs of the tree's processes (ours), in capture order.
    pub tree_pids: Vec<i32>,
    /// The tree's own number (innermost `NSpid`) -> ours, for each of `tree_ids`: made when
    /// first needed (a /proc file opened through the tree's own /proc names it so).
    inner_ids: Option<HashMap<i32, i32>>,
}

/// The owner (host PIDs, translated with the tree's) and the signal of signal-driven I/O of
/// the description behind `fd` of `pid`, read on a copy of it (fdinfo shows neither).
fn signal_owner(pid: i32, fd: i32, link: &str) -> Result<(Option<FileOwner>, i32)> {
    let what = || format!("read the owner of fd {fd} ({link})");
    let copy = if pid == std::process::id() as i32 {
        fdops::dup_cloexec(fd).ctx(pid, what)?
    } else {
        let pidfd = ferry_sys::pidfd::pidfd_open(pid).ctx(pid, what)?;
        ferry_sys::pidfd::pidfd_getfd(&pidfd, fd).ctx(pid, what)?
    };
    let (ty, owner) = fdops::get_owner_ex(copy.as_raw_fd()).ctx(pid, what)?;
    let sig = fdops::get_sig(copy.as_raw_fd()).ctx(pid, what)?;
    let kind = match ty {
        fdops::F_OWNER_TID => OwnerKind::Thread,
        fdops::F_OWNER_PID => OwnerKind::Process,
        fdops::F_OWNER_PGRP => OwnerKind::Group,
        _ => {
            return Err(Error::Unsupported {
                pid,
                what: format!("fd {fd} ({link})"),
                why: format!("its signal-driven I/O owner is of an unknown type {ty}"),
            })
        }
    };
    // PID 0: no owner, or one that has exited (the kernel then reads 0 too).
    Ok(((owner > 0).then_some(FileOwner { kind, pid: owner }), sig))
}

fn octal(info: &[(String, String)], key: &str) -> i64 {
    info.iter()
        .find(|(k, _)| k == key)
        .and_then(|(_, v)| i64::from_str_radix(v, 8).ok())
        .unwrap_or(0)
}

fn decimal(info: &[(String, String)], key: &str) -> i64 {
    info.iter()
        .find(|(k, _)| k == key)
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0)
}

impl FdCapture {
    /// Records every descriptor of `pid` in `tree`, returning the process's fd table.
    pub fn capture(
        &mut self,
        pid: i32,
        tree: &mut Tree,
        objects: &mut CaptureObjects,
    ) -> Result<Vec<Fd>> {
        let mut table = Vec::new();
        for fd in procfs::fds(pid)? {
            let link = procfs::readlink(pid, &format!("fd/{fd}"))?;
            let md = std::fs::metadata(format!("/proc/{pid}/fd/{fd}"))
                .ctx(pid, || format!("stat fd {fd} ({link})"))?;
            let info = procfs::fdinfo(pid, fd)?;
            let (desc_locks, posix_locks) =
                super::locks::capture(pid, &format!("fd {fd} ({link})"), &info)?;
            let flags = octal(&info, "flags");
            let cloexec = flags & libc::O_CLOEXEC as i64 != 0;
            let id = self.description(pid, fd, &link, &md, &info, desc_locks, tree, objects)?;
            // A POSIX lock shows on every descriptor of its description in its process.
            let posix_locks = posix_locks
                .into_iter()
                .filter(|l| {
                    !table
                        .iter()
                        .any(|t: &Fd| t.file == id && t.posix_locks.contains(l))
                })
                .collect();
            table.push(Fd {
                fd,
                file: id,
                cloexec,
                posix_locks,
            });
        }
        self.capture_in_flight(tree, objects)?;
        Ok(table)
    }

    /// The open file description behind descriptor `fd` of `pid`: one the tree already holds
    /// (kcmp), or a new one, recorded in `tree.files`.
    #[allow(clippy::too_many_arguments)]
    fn description(
        &mut self,
        pid: i32,
        fd: i32,
        link: &str,
        md: &std::fs::Metadata,
        info: &[(String, String)],
        desc_locks: Vec<ferry_image::FileLock>,
        tree: &mut Tree,
        objects: &mut CaptureObjects,
    ) -> Result<u32> {
        let (dev, ino) = (md.dev(), md.ino());
        for (p2, fd2, d2, i2, id) in &self.seen {
            if (*d2, *i2) == (dev, ino)
                && fdops::kcmp_file(pid, *p2, fd, *fd2)
                    .ctx(pid, || format!("compare fd {fd} with PID {p2} fd {fd2}"))?
            {
                return Ok(*id);
            }
        }
        let id = tree.files.len() as u32;
        let kind = self.classify(pid, fd, link, md, info, tree, objects)?;
        // Opened again by path at restore: which file that path names now.
        let by_path = match &kind {
            FileKind::Regular { ghost, .. } => ghost.is_none(),
            FileKind::Directory { .. } | FileKind::Device { .. } | FileKind::PathOnly { .. } => {
                true
            }
            FileKind::Pipe { pipe } => tree
                .pipes
                .get(*pipe as usize)
                .is_some_and(|p| p.fifo_path.is_some()),
            _ => false,
        };
        let flags = octal(info, "flags");
        // An O_PATH descriptor has no owner (fcntl refuses F_SETOWN and F_GETOWN_EX on it).
        let (owner, io_signal) = if flags & libc::O_PATH as i64 != 0 {
            (None, 0)
        } else {
            signal_owner(pid, fd, link)?
        };
        tree.files.push(FileDesc {
            id,
            flags: (flags & !(libc::O_CLOEXEC as i64)) as i32,
            pos: decimal(info, "pos"),
            kind,
            locks: desc_locks,
            identity: by_path.then(|| crate::reopen::identity_of(md)),
            owner,
            io_signal,
        });
        self.seen.push((pid, fd, dev, ino, id));
        Ok(id)
    }

    /// Records every descriptor in flight met so far in the sockets' queues, and those in
    /// flight in the queues of the sockets among them, as our own descriptors (see
    /// `sockets::scm`).
    fn capture_in_flight(&mut self, tree: &mut Tree, objects: &mut CaptureObjects) -> Result<()> {
        let me = std::process::id() as i32;
        loop {
            let Some((k, fd, carrier)) = self.inflight.borrow().next_unrecorded() else {
                return Ok(());
            };
            let id = (|| {
                // Through a process of the tree that holds it too, if one does: an epoll
                // instance's interest list names that process's descriptors.
                let (pid, fd) = self.tree_holder(fd).unwrap_or((me, fd));
                let link = procfs::readlink(pid, &format!("fd/{fd}"))?;
                let md = std::fs::metadata(format!("/proc/{pid}/fd/{fd}"))
                    .ctx(pid, || format!("stat fd {fd} ({link})"))?;
                let info = procfs::fdinfo(pid, fd)?;
                if pid == me && info.iter().any(|(k, _)| k == "tfd") {
                    return Err(Error::Unsupported {
                        pid: me,
                        what: format!("fd {fd} ({link})"),
                        why: "an epoll instance in flight that no process of the tree holds, \
                              with items in its interest list: they name descriptors of a \
                              process that has since let go of it, which no rebuilt process \
                              holds to register them again"
                            .into(),
                    });
                }
                let (desc_locks, _) =
                    super::locks::capture(pid, &format!("fd {fd} ({link})"), &info)?;
                let id = self.description(pid, fd, &link, &md, &info, desc_locks, tree, objects)?;
                if let Err(kind) = super::sockets::may_fly(&tree.files[id as usize].kind) {
                    return Err(Error::Unsupported {
                        pid: me,
                        what: format!("fd {fd} ({link})"),
                        why: format!("{kind} in flight cannot be checkpointed yet"),
                    });
                }
                Ok(id)
            })()
            .map_err(|e| super::sockets::name_carrier(e, carrier))?;
            self.inflight.borrow_mut().record(k, id);
        }
    }

    /// A process of the tree, and its descriptor, that hold the description of our descriptor
    /// `fd` (one in flight), if any does.
    fn tree_holder(&self, fd: i32) -> Option<(i32, i32)> {
        let me = std::process::id() as i32;
        self.tree_pids.iter().find_map(|&q| {
            procfs::fds(q)
                .ok()?
                .into_iter()
                .find(|&n| fdops::kcmp_file(q, me, n, fd).unwrap_or(false))
                .map(|n| (q, n))
        })
    }

    /// Once every process is captured: the messages of the sockets' queues name the
    /// descriptions in flight with them by file id.
    pub fn finish(&self, tree: &mut Tree) -> Result<()> {
        self.inflight.borrow().resolve(tree)?;
        super::tty::check_masters(tree)
    }

    #[allow(clippy::too_many_arguments)]
    fn classify(
        &mut self,
        pid: i32,
        fd: i32,
        link: &str,
        md: &std::fs::Metadata,
        info: &[(String, String)],
        tree: &mut Tree,
        objects: &mut CaptureObjects,
    ) -> Result<FileKind> {
        let unsupported = |why: &str| Error::Unsupported {
            pid,
            what: format!("fd {fd} ({link})"),
            why: why.to_string(),
        };
        let ft = md.file_type();
        if let Some(rest) = link.strip_prefix("pipe:[") {
            let ino: u64 = rest.trim_end_matches(']').parse().unwrap_or(0);
            return Ok(FileKind::Pipe {
                pipe: self.pipe(pid, fd, ino, None, tree)?,
            });
        }
        if link.starts_with("/memfd:") {
            return Ok(FileKind::Memfd {
                object: objects.shmem_for_fd(pid, fd, link, md.dev(), md.ino())?,
            });
        }
        if link == "anon_inode:[eventfd]" {
            let count = info
                .iter()
                .find(|(k, _)| k == "eventfd-count")
                .and_then(|(_, v)| u64::from_str_radix(v, 16).ok())
                .unwrap_or(0);
            let semaphore = decimal(info, "eventfd-semaphore") != 0;
            return Ok(FileKind::EventFd { count, semaphore });
        }
        if let Some(n) = proc_pid_of(link) {
            if let Some(kind) = self.proc_file(pid, fd, link, n, md)? {
                return Ok(kind);
            }
        }
        if let Some(path) = link.strip_prefix('/').map(|_| link) {
            let deleted = path.ends_with(" (deleted)");
            let path = path.strip_suffix(" (deleted)").unwrap_or(path).to_string();
            if ft.is_file() {
                let ghost = if deleted {
                    Some(objects.ghost_for_fd(pid, fd, &path, md.dev(), md.ino())?)
                } else {
                    None
                };
                return Ok(FileKind::Regular {
                    path,
                    size: md.len(),
                    ghost,
                });
            }
            if deleted && ft.is_fifo() {
                let pipe = self.pipe(pid, fd, md.ino(), Some(path), tree)?;
                tree.pipes[pipe as usize].fifo_removed = true;
                return Ok(FileKind::Pipe { pipe });
            }
            if deleted && ft.is_dir() {
                return Ok(FileKind::Directory {
                    path,
                    removed: true,
                });
            }
            if deleted {
                return Err(unsupported(
                    "it refers to a deleted file that is not a regular file",
                ));
            }
            let o_path = octal(info, "flags") & libc::O_PATH as i64 != 0;
            if o_path && !ft.is_dir() {
                // Only a name: no device, socket or FIFO state comes with it.
                return Ok(FileKind::PathOnly { path });
            }
            if ft.is_dir() {
                return Ok(FileKind::Directory {
                    path,
                    removed: false,
                });
            }
            if ft.is_fifo() {
                return Ok(FileKind::Pipe {
                    pipe: self.pipe(pid, fd, md.ino(), Some(path), tree)?,
                });
            }
            if ft.is_char_device() && STATELESS_DEVICES.contains(&path.as_str()) {
                return Ok(FileKind::Device {
                    path,
                    rdev: md.rdev(),
                    terminal: None,
                    kmsg_seq: None,
                });
            }
            if ft.is_char_device() {
                if let Some(kind) = super::devices::classify(pid, fd, &path, md)? {
                    return Ok(kind);
                }
                if let Some(kind) =
                    super::tty::classify(pid, fd, &path, md, self.relay_ttys, &self.relay_standins)?
                {
                    return Ok(kind);
                }
            }
            return Err(unsupported("this kind of device is not supported yet"));
        }
        if link.starts_with("anon_inode:") {
            if let Some(kind) = super::anon_inodes::classify(pid, fd, link, info)? {
                return Ok(kind);
            }
        }
        if link.starts_with("socket:") {
            if let Some(kind) = super::sockets::classify(pid, fd, link, info, &self.inflight)? {
                return Ok(kind);
            }
        }
        let why = if link.starts_with("socket:") {
            "sockets are not supported yet"
        } else if link.starts_with("anon_inode:") {
            "this kind of anonymous-inode descriptor is not supported yet"
        } else {
            "this kind of descriptor is not known to Ferry"
        };
        Err(unsupported(why))
    }

    /// A descriptor of /proc/`n`/... (`link`) of `pid`: a file of a process (or thread) of the
    /// tree, opened again by the rebuilt process itself once every process exists
    /// (`install_proc_files`). `n` is numbered by the /proc it was opened through: ours (the
    /// same numbers as ours), or the process's own /proc, which numbers the tree as the tree
    /// sees itself (a tree in a PID namespace of its own). A file of /proc/N of a process
    /// outside the tree is refused (that process is not rebuilt with it). `None`: not a file
    /// of either /proc.
    fn proc_file(
        &mut self,
        pid: i32,
        fd: i32,
        link: &str,
        n: i32,
        md: &std::fs::Metadata,
    ) -> Result<Option<FileKind>> {
        let unsupported = |why: String| Error::Unsupported {
            pid,
            what: format!("fd {fd} ({link})"),
            why,
        };
        let dev_of = |p: &str| std::fs::metadata(p).map(|m| m.dev()).ok();
        let inner = dev_of("/proc") != Some(md.dev());
        let host = if !inner {
            self.tree_ids.contains(&n).then_some(n)
        } else if dev_of(&format!("/proc/{pid}/root/proc")) == Some(md.dev()) {
            if self.inner_ids.is_none() {
                let mut m = HashMap::new();
                for &id in &self.tree_ids {
                    let st = procfs::status(id)?;
                    if let Some(inner) = procfs::field(&st, "NSpid")
                        .split_whitespace()
                        .last()
                        .and_then(|x| x.parse().ok())
                    {
                        m.insert(inner, id);
                    }
                }
                self.inner_ids = Some(m);
            }
            self.inner_ids.as_ref().and_then(|m| m.get(&n).copied())
        } else {
            return Ok(None);
        };
        let Some(host) = host else {
            return Err(unsupported(format!(
                "it is a file of /proc/{n}, a process outside the tree, which is not rebuilt \
                 with it"
            )));
        };
        let rest = &link["/proc/".len() + n.to_string().len()..];
        if rest.ends_with(" (deleted)") {
            return Err(unsupported(format!(
                "it is a file of /proc/{n}, a process of the tree, that no longer exists"
            )));
        }
        if rest.starts_with("/task/") && inner {
            // Its TID, numbered by the tree's /proc, would need the same renumbering.
            let tail = &rest["/task/".len()..];
            let tid: Option<i32> = tail.split('/').next().and_then(|t| t.parse().ok());
            let ours = tid.and_then(|t| self.inner_ids.as_ref()?.get(&t).copied());
            let Some(ours) = ours else {
                return Err(unsupported(format!(
                    "it is a file of {link}, a thread that is not part of the tree"
                )));
            };
            let after = &tail[tail.find('/').unwrap_or(tail.len())..];
            return Ok(Some(FileKind::ProcFile {
                pid: host,
                rest: format!("/task/{ours}{after}"),
            }));
        }
        Ok(Some(FileKind::ProcFile {
            pid: host,
            rest: rest.to_string(),
        }))
    }

    /// Registers a pipe (or FIFO) once, with the bytes buffered in it, read without consuming
    /// them: tee(2) copies them into a pipe of our own.
    fn pipe(
        &mut self,
        pid: i32,
        fd: i32,
        ino: u64,
        fifo_path: Option<String>,
        tree: &mut Tree,
    ) -> Result<u32> {
        if let Some(id) = self.pipes_by_ino.get(&ino) {
            return Ok(*id);
        }
        if fifo_path.is_none() && self.relay.contains_key(&ino) {
            // What is buffered stays in the home's pipe, and reaches the body through the relay.
            let id = tree.pipes.len() as u32;
            tree.pipes.push(Pipe {
                id,
                ino,
                relayed: true,
                ..Default::default()
            });
            self.pipes_by_ino.insert(ino, id);
            return Ok(id);
        }
        let reader = fdops::open_path(
            &format!("/proc/{pid}/fd/{fd}"),
            libc::O_RDONLY | libc::O_NONBLOCK | libc::O_CLOEXEC,
            0,
        )
        .ctx(pid, || format!("open the read side of pipe fd {fd}"))?;
        let capacity =
            fdops::pipe_size(reader.as_raw_fd()).ctx(pid, || format!("size of pipe fd {fd}"))?;
        let queued = fdops::fionread(reader.as_raw_fd())
            .ctx(pid, || format!("bytes queued in pipe fd {fd}"))?;
        let (buffered, packets) = peek_pipe(&reader, queued, capacity)
            .ctx(pid, || format!("copy the bytes queued in pipe fd {fd}"))?;
        let id = tree.pipes.len() as u32;
        // A stand-in for a relay to the tree's home (a body moving on): what is buffered in it
        // moves with the image, and the relay at home follows the body.
        let relay = (fifo_path.is_none())
            .then(|| self.relay_standins.get(&ino).copied())
            .flatten();
        tree.pipes.push(Pipe {
            id,
            ino,
            capacity: capacity as u64,
            buffered,
            packets,
            fifo_path,
            fifo_removed: false,
            relayed: relay.is_some(),
            relay,
        });
        self.pipes_by_ino.insert(ino, id);
        Ok(id)
    }
}

/// The recreated ends of one pipe not yet handed out: read end, write end, and (for a FIFO)
/// the read-write descriptor that keeps it open.
type PipeEnds = (Option<OwnedFd>, Option<OwnedFd>, Option<OwnedFd>);

/// The relay's end of each relayed pipe, by `Pipe::id`.
pub type RelayEnds = Vec<(u32, OwnedFd)>;

/// Status flags that can be changed after open with F_SETFL.
const SETFL_MASK: i32 =
    libc::O_APPEND | libc::O_NONBLOCK | libc::O_ASYNC | libc::O_DIRECT | libc::O_NOATIME;

/// Recreates every open file description of the tree in this process. `guest`: the guest
/// namespaces the tree is rebuilt in, if it is (UNIX sockets are made there under the PIDs
/// their peers' credentials name; ptys come from the guest's own devpts).
///
/// Whatever is opened by path is opened with the rights of a process that holds it (the first
/// in the tree), and only if the path still names the file captured (`crate::reopen`).
///
/// Also returns, for each relayed pipe (`Pipe::relayed`), the end the tree does not hold: the
/// relay's.
pub fn open_descriptions(
    tree: &Tree,
    objects: &RestoreObjects,
    guest: Option<&crate::guest_ns::GuestNamespaces>,
) -> Result<(HashMap<u32, OwnedFd>, RelayEnds)> {
    let dev = guest.map_or_else(|| std::path::PathBuf::from("/dev"), |g| g.dev_dir());
    drop(super::locks::Deferred::take()); // anything an earlier, failed restore left
    drop(super::tty::take_relayed());
    drop(super::sockets::take_relayed());
    let me = std::process::id() as i32;
    // The first descriptor of each description: in whose name, and with whose rights, it is
    // opened.
    let mut holders: HashMap<u32, (&Process, i32)> = HashMap::new();
    for p in &tree.processes {
        for f in &p.fds {
            holders.entry(f.file).or_insert((p, f.fd));
        }
    }
    // A description in flight is opened for the process holding the socket that carries it.
    let first_live = tree
        .processes
        .iter()
        .find(|p| p.zombie_status.is_none())
        .map(|p| (p, -1));
    super::sockets::holders_in_flight(tree, &mut holders, first_live);
    // Leases held now (by the frozen original of a migration on one machine, or by anyone): an
    // open that would break one is refused instead of waiting for the break.
    let leases = super::locks::leases_held();
    let by_path = |d: &FileDesc, path: &str, flags: i32, m: Match| -> Result<OwnedFd> {
        let (p, fd) = holders.get(&d.id).ok_or_else(|| {
            Error::BadImage(format!("file {} ({path}) is held by no process", d.id))
        })?;
        if let Some(id) = &d.identity {
            let writes = flags & libc::O_ACCMODE != libc::O_RDONLY;
            if let Some((_, _, w)) = leases
                .iter()
                .find(|(dev, ino, w)| (*dev, *ino) == (id.dev, id.ino) && (*w || writes))
            {
                return Err(Error::Restore {
                    pid: p.pid,
                    what: format!(
                        "fd {fd}: open {path} again: another process (the original of the \
                         tree, if it still runs?) holds a {} lease on it, which the open would \
                         break",
                        if *w { "write" } else { "read" }
                    ),
                });
            }
        }
        crate::reopen::open(
            p.pid,
            &format!("fd {fd}"),
            path,
            flags,
            d.identity.as_ref(),
            m,
            &objects.rights(p),
        )
    };
    let fifo_desc = |pipe: u32| {
        tree.files
            .iter()
            .find(|d| d.kind == FileKind::Pipe { pipe })
            .ok_or_else(|| Error::BadImage(format!("FIFO {pipe} is held by no descriptor")))
    };
    let mut out = HashMap::new();
    let mut pipe_ends: HashMap<u32, PipeEnds> = HashMap::new();
    for p in &tree.pipes {
        if let (Some(path), true) = (&p.fifo_path, p.fifo_removed) {
            // Unlinked: made again (resources/removed.rs), held open and unlinked at once;
            // every description of it is opened through this one.
            let d = fifo_desc(p.id)?;
            let (holder, fd) = holders
                .get(&d.id)
                .ok_or_else(|| Error::BadImage(format!("FIFO {path} is held by no process")))?;
            let how = format!("fd {fd}");
            let mode = d.identity.as_ref().map_or(0o600, |i| i.mode);
            let rights = objects.rights(holder);
            let made = super::removed::make(
                holder.pid,
                &how,
                super::removed::Node::Fifo,
                path,
                mode,
                &rights.process,
            )?;
            let keep = made.open(holder.pid, &how, libc::O_RDWR | libc::O_NONBLOCK)?;
            made.remove(holder.pid, &how)?;
            fill_pipe(&keep, p, false)?;
            pipe_ends.insert(p.id, (None, None, Some(keep)));
        } else if let Some(path) = &p.fifo_path {
            // Holding the FIFO open for both reading and writing lets the ends open without
            // blocking and keeps the buffered bytes alive until the processes hold it.
            let keep = by_path(
                fifo_desc(p.id)?,
                path,
                libc::O_RDWR | libc::O_NONBLOCK,
                Match::Inode,
            )?;
            let there =
                fdops::fionread(keep.as_raw_fd()).ctx(me, || format!("bytes in FIFO {path}"))?;
            if there == 0 {
                fill_pipe(&keep, p, false)?;
            } else {
                // Others hold the FIFO open, with bytes in it: one pipe for all who open it.
                // On this machine that is the tree's original (frozen until the commit point
                // of a migration between two nodes of one machine, or running beside a
                // clone): if the bytes are those captured, they are already where they belong.
                let capacity = fdops::pipe_size(keep.as_raw_fd())
                    .ctx(me, || format!("size of FIFO {path}"))?;
                let (bytes, _) = peek_pipe(&keep, there, capacity)
                    .ctx(me, || format!("read the bytes in FIFO {path}"))?;
                if bytes != p.buffered {
                    return Err(Error::Restore {
                        pid: me,
                        what: format!(
                            "FIFO {path} is open elsewhere and holds {there} bytes, not the {} \
                             captured: its contents cannot be restored",
                            p.buffered.len()
                        ),
                    });
                }
            }
            pipe_ends.insert(p.id, (None, None, Some(keep)));
        } else {
            let packet_mode = tree.files.iter().any(|d| {
                d.kind == FileKind::Pipe { pipe: p.id }
                    && d.flags & libc::O_ACCMODE == libc::O_WRONLY
                    && d.flags & libc::O_DIRECT != 0
            });
            let flags = libc::O_CLOEXEC | if packet_mode { libc::O_DIRECT } else { 0 };
            let (r, w) = fdops::pipe2(flags).ctx(me, || format!("recreate pipe {}", p.ino))?;
            fill_pipe(&w, p, packet_mode)?;
            pipe_ends.insert(p.id, (Some(r), Some(w), None));
        }
    }
    let keep_flags = |f: i32| {
        (f & !(libc::O_CREAT | libc::O_EXCL | libc::O_TRUNC | libc::O_NOCTTY)) | libc::O_CLOEXEC
    };
    // Sockets last: their queues are refilled with the descriptions that were in flight in
    // them, which must all be open by then.
    let is_socket = |d: &&FileDesc| matches!(d.kind, FileKind::Socket(_));
    let order = tree.files.iter().filter(|d| !is_socket(d));
    for d in order.chain(tree.files.iter().filter(is_socket)) {
        let acc = d.flags & libc::O_ACCMODE;
        let fd: OwnedFd = match &d.kind {
            FileKind::Regular {
                path,
                ghost: Some(g),
                ..
            } => {
                // Recreated by us: opened through our own descriptor of it.
                let (p, _) = holders.get(&d.id).ok_or_else(|| {
                    Error::BadImage(format!("file {} ({path}) is held by no process", d.id))
                })?;
                objects.reopen_ghost(*g, keep_flags(d.flags), &objects.rights(p))?
            }
            FileKind::Regular { path, .. } => {
                by_path(d, path, keep_flags(d.flags), Match::Contents)?
            }
            FileKind::Directory {
                path,
                removed: false,
            } => by_path(
                d,
                path,
                keep_flags(d.flags) | libc::O_DIRECTORY,
                Match::Inode,
            )?,
            FileKind::Directory {
                path,
                removed: true,
            } => {
                let (p, fd) = holders.get(&d.id).ok_or_else(|| {
                    Error::BadImage(format!("file {} ({path}) is held by no process", d.id))
                })?;
                let how = format!("fd {fd}");
                let mode = d.identity.as_ref().map_or(0o700, |i| i.mode);
                let rights = objects.rights(p);
                let made = super::removed::make(
                    p.pid,
                    &how,
                    super::removed::Node::Dir,
                    path,
                    mode,
                    &rights.process,
                )?;
                let fd = made.open(p.pid, &how, keep_flags(d.flags))?;
                made.remove(p.pid, &how)?;
                fd
            }
            FileKind::PathOnly { path } => by_path(d, path, keep_flags(d.flags), Match::Inode)?,
            // Made in the process itself, once it has its controlling terminal (`install`).
            FileKind::Device { .. } if super::tty::is_dev_tty(d) => continue,
            FileKind::Device { path, rdev, .. } => {
                let machine = super::devices::is_machine_device(d);
                let (holder, holder_fd) = holders.get(&d.id).map_or((me, -1), |(p, f)| (p.pid, *f));
                if machine {
                    super::devices::check_machine(tree, d, holder, holder_fd)?;
                }
                if let (
                    FileKind::Device {
                        kmsg_seq: Some(_), ..
                    },
                    Some((p, f)),
                ) = (&d.kind, holders.get(&d.id))
                {
                    super::kmsg::check_reader(p, objects.caller(), &format!("fd {f}"))?;
                }
                // The machine's terminals: never made a controlling terminal by this open,
                // nor held waiting for a serial line's carrier (the process's own O_NONBLOCK
                // is set below).
                let extra = if machine {
                    libc::O_NOCTTY | libc::O_NONBLOCK
                } else {
                    0
                };
                let fd = by_path(d, path, keep_flags(d.flags) | extra, Match::Device)?;
                let now = std::fs::metadata(format!("/proc/self/fd/{}", fd.as_raw_fd()))
                    .ctx(me, || format!("stat {path}"))?;
                if now.rdev() != *rdev {
                    return Err(Error::Restore {
                        pid: me,
                        what: format!(
                            "{path} is device {:#x} now, {rdev:#x} when captured; refused",
                            now.rdev()
                        ),
                    });
                }
                super::devices::check_opened(d, &fd, holder, holder_fd)?;
                if let FileKind::Device {
                    kmsg_seq: Some(seq),
                    ..
                } = &d.kind
                {
                    super::kmsg::restore_position(holder, &format!("fd {holder_fd}"), &fd, *seq)?;
                }
                fd
            }
            FileKind::Pipe { pipe } => {
                let p = tree.pipes.get(*pipe as usize).ok_or_else(|| {
                    Error::BadImage(format!("file {} names unknown pipe {pipe}", d.id))
                })?;
                let ends = pipe_ends.get_mut(pipe).expect("every pipe was made above");
                let taken = match (&p.fifo_path, acc) {
                    (None, libc::O_RDONLY) => ends.0.take(),
                    (None, _) => ends.1.take(),
                    (Some(_), _) => None,
                };
                match taken {
                    Some(fd) => fd,
                    None => {
                        // A second description of the same end, or a FIFO: open it anew.
                        match &p.fifo_path {
                            Some(_) if p.fifo_removed => {
                                let keep = ends.2.as_ref().expect("made above");
                                let src = format!("/proc/self/fd/{}", keep.as_raw_fd());
                                fdops::open_path(&src, acc | libc::O_NONBLOCK | libc::O_CLOEXEC, 0)
                                    .ctx(me, || format!("reopen removed FIFO {}", p.ino))?
                            }
                            Some(path) => by_path(d, path, acc | libc::O_NONBLOCK, Match::Inode)?,
                            None => {
                                let any = ends.0.as_ref().or(ends.1.as_ref()).or(ends.2.as_ref());
                                let any = any
                                    .or_else(|| out.values().next())
                                    .expect("pipe has an open end");
                                let src = format!("/proc/self/fd/{}", any.as_raw_fd());
                                fdops::open_path(&src, acc | libc::O_NONBLOCK | libc::O_CLOEXEC, 0)
                                    .ctx(me, || format!("reopen pipe {}", p.ino))?
                            }
                        }
                    }
                }
            }
            FileKind::EventFd { count, semaphore } => {
                let flags = libc::EFD_CLOEXEC | if *semaphore { libc::EFD_SEMAPHORE } else { 0 };
                fdops::eventfd(0, flags)
                    .and_then(|fd| {
                        if *count > 0 {
                            fdops::write_fd(fd.as_raw_fd(), &count.to_ne_bytes())?;
                        }
                        Ok(fd)
                    })
                    .ctx(me, || "recreate eventfd".into())?
            }
            FileKind::Memfd { object } => {
                let f = objects.shmem_file(*object)?;
                fdops::open_path(
                    &format!("/proc/self/fd/{}", f.as_raw_fd()),
                    keep_flags(d.flags),
                    0,
                )
                .ctx(me, || format!("reopen memfd object {object}"))?
            }
            FileKind::Epoll(_)
            | FileKind::Timerfd(_)
            | FileKind::Signalfd(_)
            | FileKind::Inotify(_)
            | FileKind::Fanotify(_) => {
                let creds = holders
                    .get(&d.id)
                    .map(|(p, _)| crate::reopen::creds_of(p))
                    .unwrap_or_default();
                // (A mount is marked in the tree's own mount namespace.)
                let root = guest.map(|g| format!("/proc/{}/root", g.init_host_pid()));
                super::anon_inodes::open(d, &creds, root.as_deref())?
            }
            FileKind::Socket(_) => super::sockets::open(d, tree, guest.map(|g| g.pidfd()), &out)?,
            FileKind::Tty(_) => super::tty::open(d, tree, &dev, objects.caller())?,
            // Made in the process itself, once its target exists (see `install`).
            FileKind::Pidfd { .. } => continue,
            // Made in the process itself, once every process exists (`install_proc_files`).
            FileKind::ProcFile { .. } => continue,
            FileKind::Unknown => {
                return Err(Error::BadImage(format!(
                    "file {} has an unknown kind",
                    d.id
                )))
            }
        };
        if matches!(
            d.kind,
            FileKind::Regular { .. }
                | FileKind::Directory { .. }
                | FileKind::Memfd { .. }
                | FileKind::Device { .. }
        ) && d.pos != 0
        {
            fdops::lseek(fd.as_raw_fd(), d.pos, libc::SEEK_SET)
                .ctx(me, || format!("seek file {} to {}", d.id, d.pos))?;
        }
        let now = fdops::get_fl(fd.as_raw_fd()).ctx(me, || "read file flags".into())?;
        // O_ASYNC is set by a process holding it, through its own descriptor
        // (`restore_owners`): the signal's si_fd is the number it was set through.
        let want = (now & !SETFL_MASK) | (d.flags & SETFL_MASK & !libc::O_ASYNC);
        if want != now {
            fdops::set_fl(fd.as_raw_fd(), want)
                .ctx(me, || format!("set flags {:o} on file {}", d.flags, d.id))?;
        }
        if d.io_signal != 0 {
            fdops::set_sig(fd.as_raw_fd(), d.io_signal).ctx(me, || {
                format!(
                    "set signal {} of signal-driven I/O on file {}",
                    d.io_signal, d.id
                )
            })?;
        }
        if !d.locks.is_empty() {
            super::locks::take_on_description(&fd, &d.locks, &file_name(d))?;
        }
        out.insert(d.id, fd);
    }
    let mut relays = super::tty::take_relayed();
    relays.extend(super::sockets::take_relayed());
    for p in tree.pipes.iter().filter(|p| p.relayed) {
        let ends = pipe_ends.get_mut(&p.id).expect("every pipe was made above");
        match (ends.0.take(), ends.1.take()) {
            // A stand-in for a relay at home keeps that relay's id (`Pipe::relay`).
            (Some(end), None) | (None, Some(end)) => relays.push((p.relay.unwrap_or(p.id), end)),
            _ => {
                return Err(Error::BadImage(format!(
                    "relayed pipe {} is held by the tree at neither or both ends",
                    p.id
                )))
            }
        }
    }
    Ok((out, relays))
}

/// N of a path under /proc/N (a process's own /proc directory or a file in it).
fn proc_pid_of(link: &str) -> Option<i32> {
    let rest = link.strip_prefix("/proc/")?;
    rest.split('/').next()?.parse().ok()
}

/// A description's path, or its number, for messages.
fn file_name(d: &FileDesc) -> String {
    match &d.kind {
        FileKind::Regular { path, .. }
        | FileKind::Directory { path, .. }
        | FileKind::Device { path, .. }
        | FileKind::PathOnly { path } => path.clone(),
        _ => format!("file {}", d.id),
    }
}

fn fill_pipe(w: &OwnedFd, p: &Pipe, packet_mode: bool) -> Result<()> {
    let me = std::process::id() as i32;
    if p.capacity as usize > 65536 || p.buffered.len() > 65536 {
        fdops::set_pipe_size(w.as_raw_fd(), (p.capacity as usize).max(p.buffered.len()))
            .ctx(me, || format!("size pipe {}", p.ino))?;
    }
    // In packet mode every write is one packet; elsewhere the boundaries do not matter.
    let whole = [p.buffered.len() as u64];
    let pieces: &[u64] = if packet_mode && !p.packets.is_empty() {
        &p.packets
    } else {
        &whole
    };
    let mut at = 0usize;
    for len in pieces {
        let end = (at + *len as usize).min(p.buffered.len());
        let mut done = at;
        while done < end {
            done += fdops::write_fd(w.as_raw_fd(), &p.buffered[done..end])
                .ctx(me, || format!("refill pipe {}", p.ino))?;
        }
        at = end;
    }
    Ok(())
}

/// The `queued` bytes in the pipe `reader` reads from, without consuming them (tee(2) copies
/// them into a pipe of our own), and the size of each pipe buffer (a packet, in packet mode).
fn peek_pipe(
    reader: &OwnedFd,
    queued: usize,
    capacity: usize,
) -> ferry_sys::SysResult<(Vec<u8>, Vec<u64>)> {
    let mut buffered = Vec::with_capacity(queued);
    let mut packets = Vec::new();
    if queued > 0 {
        // Read through an O_DIRECT end: each read returns one pipe buffer, which in a
        // packet-mode pipe is one packet.
        let (r, w) = fdops::pipe2(libc::O_CLOEXEC | libc::O_NONBLOCK | libc::O_DIRECT)?;
        fdops::set_pipe_size(w.as_raw_fd(), capacity.max(queued))?;
        let copied = fdops::tee(reader.as_raw_fd(), w.as_raw_fd(), queued)?;
        let mut chunk = vec![0u8; 1 << 16];
        while buffered.len() < copied {
            let n = fdops::read_fd(r.as_raw_fd(), &mut chunk)?;
            if n == 0 {
                break;
            }
            buffered.extend_from_slice(&chunk[..n]);
            packets.push(n as u64);
        }
    }
    Ok((buffered, packets))
}

/// Gives the rebuilt process its descriptors, each at its old number.
pub fn install(h: &Husk, p: &Process, tree: &Tree, descs: &HashMap<u32, OwnedFd>) -> Result<()> {
    // Ferry's descriptors first, by batches the husk runs itself: each taken with pidfd_getfd
    // (at the lowest free number), moved to its number with dup3 and the copy closed. Highest
    // number first, so that the lowest free number is rarely the one wanted.
    let mut plain: Vec<(&Fd, &OwnedFd)> = Vec::new();
    for fd in &p.fds {
        if let Some(FileKind::Pidfd { .. } | FileKind::ProcFile { .. }) =
            tree.files.get(fd.file as usize).map(|d| &d.kind)
        {
            continue;
        }
        if tree
            .files
            .get(fd.file as usize)
            .is_some_and(super::tty::is_dev_tty)
        {
            continue;
        }
        let d = descs.get(&fd.file).ok_or_else(|| {
            Error::BadImage(format!(
                "PID {} fd {} names unknown file {}",
                p.pid, fd.fd, fd.file
            ))
        })?;
        plain.push((fd, d));
    }
    plain.sort_by_key(|(fd, _)| std::cmp::Reverse(fd.fd));
    install_batched(h, &plain)?;
    for fd in &p.fds {
        if let Some(FileKind::Pidfd { pid }) = tree.files.get(fd.file as usize).map(|d| &d.kind) {
            let flags = tree.files[fd.file as usize].flags;
            install_pidfd(h, fd, *pid, flags)?;
        }
    }
    for fd in &p.fds {
        if let Some(d) = tree
            .files
            .get(fd.file as usize)
            .filter(|d| super::tty::is_dev_tty(d))
        {
            super::tty::install_dev_tty(h, fd.fd, d.flags, fd.cloexec)?;
        }
    }
    // POSIX locks belong to the process: it takes them itself, through its descriptors.
    for fd in p.fds.iter().filter(|f| !f.posix_locks.is_empty()) {
        let name = tree
            .files
            .get(fd.file as usize)
            .map_or_else(|| format!("file {}", fd.file), file_name);
        super::locks::take_posix(h, fd.fd, &fd.posix_locks, &name)?;
    }
    // Kinds whose state refers to the process's own descriptor numbers (an epoll interest
    // list, say) are completed once every descriptor is in place.
    super::anon_inodes::after_install(h, p)?;
    super::sockets::after_install(h, p)?;
    super::tty::after_install(h, p)?;
    Ok(())
}

/// Takes again the leases (fcntl F_SETLEASE), and sets again the signal-driven I/O owners
/// (fcntl F_SETOWN_EX) and O_ASYNC, of the descriptions process `p` (husk `h`) holds and no process before it did (`done`): injected
/// into the process itself once every process, thread and group of the tree exists, with its
/// own credentials (the kernel checks the owner's permission to receive the signal against
/// them), through its lowest descriptor of the description (the signal's si_fd is the number
/// O_ASYNC was set through).
pub fn restore_owners(
    h: &Husk,
    p: &Process,
    tree: &Tree,
    done: &mut std::collections::HashSet<u32>,
) -> Result<()> {
    for fd in &p.fds {
        let Some(d) = tree.files.get(fd.file as usize) else {
            continue;
        };
        let is_async = d.flags & libc::O_ASYNC != 0;
        let leased = d
            .locks
            .iter()
            .any(|l| l.kind == ferry_image::LockKind::Lease);
        if (d.owner.is_none() && !is_async && !leased) || !done.insert(d.id) {
            continue;
        }
        let name = file_name(d);
        // The owner as `struct f_owner_ex` (set below, and again after a lease taken at
        // resume, which makes its taker the owner).
        let owner = d.owner.map(|o| {
            let ty = match o.kind {
                OwnerKind::Thread => fdops::F_OWNER_TID,
                OwnerKind::Process => fdops::F_OWNER_PID,
                OwnerKind::Group => fdops::F_OWNER_PGRP,
            };
            let mut b = [0u8; 8];
            b[0..4].copy_from_slice(&ty.to_ne_bytes());
            b[4..8].copy_from_slice(&o.pid.to_ne_bytes());
            b
        });
        for l in d
            .locks
            .iter()
            .filter(|l| l.kind == ferry_image::LockKind::Lease)
        {
            super::locks::take_lease(h, fd.fd, l, &name, owner)?;
        }
        let inj = h.injector();
        let failed = |what: String, r: i64| Error::Restore {
            pid: p.pid,
            what: format!(
                "fd {}: {what}: {}",
                fd.fd,
                std::io::Error::from_raw_os_error(-r as i32)
            ),
        };
        if let (Some(o), Some(b)) = (d.owner, owner) {
            let arg = inj.write_scratch(0, &b)?;
            let r = inj.syscall_raw(
                "fcntl(F_SETOWN_EX)",
                libc::SYS_fcntl,
                &[fd.fd as u64, fdops::F_SETOWN_EX as u64, arg],
            )?;
            if r < 0 {
                let whose = match o.kind {
                    OwnerKind::Thread => "thread",
                    OwnerKind::Process => "process",
                    OwnerKind::Group => "process group",
                };
                return Err(failed(
                    format!("make {whose} {} the owner of its signal-driven I/O", o.pid),
                    r,
                ));
            }
        }
        if is_async {
            let r = inj.syscall_raw(
                "fcntl(F_SETFL)",
                libc::SYS_fcntl,
                &[
                    fd.fd as u64,
                    libc::F_SETFL as u64,
                    (d.flags & SETFL_MASK) as u64,
                ],
            )?;
            if r < 0 {
                return Err(failed("set O_ASYNC".into(), r));
            }
        }
    }
    Ok(())
}

/// Installs ferry's descriptors `fds` at their numbers in the husk, three calls each in batches.
fn install_batched(h: &Husk, fds: &[(&Fd, &OwnedFd)]) -> Result<()> {
    use ferry_inject::batch::{Call, ARG0_PLUS_KEPT, KEEP};
    let Some(pidfd) = h.ferry_pidfd() else {
        return Err(Error::Restore {
            pid: h.pid,
            what: "the husk's pidfd of ferry is already closed".into(),
        });
    };
    let mut calls = Vec::with_capacity(fds.len() * 3);
    for (fd, d) in fds {
        let cloexec = if fd.cloexec {
            libc::O_CLOEXEC as u64
        } else {
            0
        };
        calls.push(
            Call::new(
                "pidfd_getfd",
                SYS_PIDFD_GETFD,
                &[pidfd as u64, d.as_raw_fd() as u64, 0],
            )
            .with(KEEP),
        );
        calls.push(
            Call::new("dup3", libc::SYS_dup3, &[0, fd.fd as u64, cloexec])
                .with(ARG0_PLUS_KEPT)
                .expecting(fd.fd as u64),
        );
        calls.push(Call::new("close", libc::SYS_close, &[0]).with(ARG0_PLUS_KEPT));
    }
    let mut from = 0;
    while from < calls.len() {
        match h.injector().run_batch(h.batch_site(), &calls[from..])? {
            Ok(()) => break,
            Err(stopped) => {
                let at = from + stopped.index;
                let (fd, _) = fds[at / 3];
                // dup3 onto itself: pidfd_getfd put the copy at its number already (the lowest
                // free one); only close-on-exec is left, and its close must not run.
                if at % 3 == 1 && stopped.result == -(libc::EINVAL as i64) {
                    h.injector().syscall(
                        "fcntl(F_SETFD)",
                        libc::SYS_fcntl,
                        &[
                            fd.fd as u64,
                            libc::F_SETFD as u64,
                            if fd.cloexec {
                                libc::FD_CLOEXEC as u64
                            } else {
                                0
                            },
                        ],
                    )?;
                    from = at + 2;
                    continue;
                }
                return Err(Error::Restore {
                    pid: h.pid,
                    what: format!("install fd {}: {stopped}", fd.fd),
                });
            }
        }
    }
    Ok(())
}

const SYS_PIDFD_GETFD: i64 = 438;

/// Opens a pidfd of `target` (the tree's PID) inside the husk, where the tree's numbers are
/// its own, and puts it at `fd`. (Every descriptor of one pidfd description becomes a
/// description of its own: only their shared O_NONBLOCK could tell.)
fn install_pidfd(h: &Husk, fd: &Fd, target: i32, flags: i32) -> Result<()> {
    let inj = h.injector();
    let nonblock = (flags & libc::O_NONBLOCK) as u64; // PIDFD_NONBLOCK
    let fail = |e: crate::Error| Error::Restore {
        pid: h.pid,
        what: format!("fd {}: pidfd of PID {target}: {e}", fd.fd),
    };
    let got = inj
        .syscall(
            "pidfd_open",
            libc::SYS_pidfd_open,
            &[target as u64, nonblock],
        )
        .map_err(|e| fail(e.into()))? as i32;
    let cloexec = if fd.cloexec {
        libc::O_CLOEXEC as u64
    } else {
        0
    };
    if got != fd.fd {
        inj.syscall("dup3", libc::SYS_dup3, &[got as u64, fd.fd as u64, cloexec])
            .map_err(|e| fail(e.into()))?;
        inj.syscall("close", libc::SYS_close, &[got as u64])
            .map_err(|e| fail(e.into()))?;
    } else if !fd.cloexec {
        inj.syscall(
            "fcntl",
            libc::SYS_fcntl,
            &[got as u64, libc::F_SETFD as u64, 0],
        )
        .map_err(|e| fail(e.into()))?;
    }
    Ok(())
}

/// Opens again, inside the rebuilt process `p` (husk `h`) and with its own credentials, its
/// descriptors of files of /proc/PID of processes of the tree (`FileKind::ProcFile`): once
/// every process and thread of the tree exists, before it runs. Each is opened at its number
/// (an injected openat of /proc/PID/REST, PID as the tree numbers it, in the process's own
/// /proc) with its flags, and put back at its offset; descriptors of one description in the
/// process share the description opened for the first. A process sharing its parent's table
/// has them from its parent.
pub fn install_proc_files(h: &Husk, p: &Process, tree: &Tree) -> Result<()> {
    if p.files_shared_with_parent {
        return Ok(());
    }
    let inj = h.injector();
    let mut first: HashMap<u32, i32> = HashMap::new();
    for fd in &p.fds {
        let Some(d) = tree.files.get(fd.file as usize) else {
            continue;
        };
        let FileKind::ProcFile { pid, rest } = &d.kind else {
            continue;
        };
        let path = format!("/proc/{pid}{rest}");
        let fail = |e: crate::Error| Error::Restore {
            pid: h.pid,
            what: format!("fd {}: open {path} again: {e}", fd.fd),
        };
        let cloexec = if fd.cloexec {
            libc::O_CLOEXEC as u64
        } else {
            0
        };
        let got = match first.get(&d.id) {
            Some(&other) => other,
            None => {
                let mut name = path.clone().into_bytes();
                name.push(0);
                let at = inj.write_scratch(0, &name).map_err(|e| fail(e.into()))?;
                let flags = (d.flags & !(libc::O_CREAT | libc::O_EXCL | libc::O_TRUNC))
                    | libc::O_NOCTTY
                    | libc::O_CLOEXEC;
                let got = inj
                    .syscall(
                        "openat",
                        libc::SYS_openat,
                        &[libc::AT_FDCWD as u64, at, flags as u64, 0],
                    )
                    .map_err(|e| fail(e.into()))? as i32;
                if d.pos != 0 {
                    inj.syscall(
                        "lseek",
                        libc::SYS_lseek,
                        &[got as u64, d.pos as u64, libc::SEEK_SET as u64],
                    )
                    .map_err(|e| fail(e.into()))?;
                }
                first.insert(d.id, fd.fd);
                if got == fd.fd {
                    if !fd.cloexec {
                        inj.syscall(
                            "fcntl",
                            libc::SYS_fcntl,
                            &[got as u64, libc::F_SETFD as u64, 0],
                        )
                        .map_err(|e| fail(e.into()))?;
                    }
                    continue;
                }
                inj.syscall("dup3", libc::SYS_dup3, &[got as u64, fd.fd as u64, cloexec])
                    .map_err(|e| fail(e.into()))?;
                inj.syscall("close", libc::SYS_close, &[got as u64])
                    .map_err(|e| fail(e.into()))?;
                continue;
            }
        };
        inj.syscall("dup3", libc::SYS_dup3, &[got as u64, fd.fd as u64, cloexec])
            .map_err(|e| fail(e.into()))?;
    }
    Ok(())
}
