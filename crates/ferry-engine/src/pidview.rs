//! The tree's own view of process IDs.
//!
//! The engine works with the PIDs of its own PID namespace (ptrace, /proc, pidfds: the "host"
//! PIDs). The image records every PID as the tree itself sees it, in its innermost PID namespace
//! (the last number of `NSpid`, `NSpgid` and `NSsid` in /proc/PID/status), so that a tree
//! rebuilt in a PID namespace of its own gets back the numbers it knew, whichever numbers it
//! had on the machine it left. Capture is done with host PIDs throughout; [`PidView::translate`]
//! then rewrites every PID-valued field of the [`Tree`] in one place, just before it is written.
//!
//! What can be captured: every process of the tree in one PID namespace (the root's), none of
//! them having made a PID namespace for its children (`unshare(CLONE_NEWPID)`), and, when that
//! namespace is not ours, none of them being its PID 1 (the namespace's init: a rebuilt tree
//! gets a new namespace whose PID 1 is ferry's guest init). Parent links inside the tree then
//! never leave the namespace; the root's parent, process group and session may lie outside it
//! (they read 0 then, as `getppid()` would say), and are not rebuilt anyway (a restored root
//! leads a session of its own). All processes must also share one time namespace, whose
//! offsets give the clocks recorded in `Tree::clocks`.

use crate::error::{Error, Result};
use crate::freeze::FrozenTree;
use crate::procfs;
use ferry_image::{Clocks, FileKind, LockKind, OwnerKind, SockState, Tree};
use std::collections::HashMap;

/// How the tree's PID namespace numbers the processes, threads, groups and sessions we see.
pub struct PidView {
    /// Host PID/TID/PGID/SID -> the tree's number for it.
    map: HashMap<i32, i32>,
    /// Per process (host PID): (process group, session) as the tree sees them.
    groups: HashMap<i32, (i32, i32)>,
    /// The tree's PID namespace (`pid:[inode]`).
    ns: String,
    /// Whether the tree's PID namespace is ours: then every number reads the same.
    ours: bool,
}

/// The numbers of an `NS*` line of /proc/PID/status (outermost namespace first).
fn ns_ids(status: &[(String, String)], key: &str) -> Vec<i32> {
    procfs::field(status, key)
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect()
}

fn ns_link(pid: i32, which: &str) -> Option<String> {
    procfs::readlink(pid, &format!("ns/{which}")).ok()
}

/// Why a tree leaving its home whose root `pid` is numbered `inner` in its own PID namespace
/// is refused ([`PidView::first_renumbered`]): (what, why).
pub fn renumbered(pid: i32, inner: i32) -> (&'static str, String) {
    (
        "its PID in its own namespace",
        format!(
            "it is PID {inner} in its own PID namespace and {pid} on this node; a tree leaves \
             its home only when its root's two numbers are the same (its home, its body's \
             node and its relays know the tree by its root's PID): move the program run for \
             another node (`ferry run`) whose PID namespace it is in, not one of its children"
        ),
    )
}

fn refuse(pid: i32, what: &str, why: String) -> Error {
    Error::Unsupported {
        pid,
        what: what.into(),
        why,
    }
}

impl PidView {
    /// Reads the view of every process and thread of the frozen tree, refusing trees that span
    /// PID or time namespaces (see the module documentation).
    pub fn of(frozen: &FrozenTree) -> Result<PidView> {
        let root = frozen
            .procs
            .first()
            .ok_or(Error::NoSuchProcess { pid: 0 })?;
        let ns = ns_link(root.pid, "pid").ok_or(Error::NoSuchProcess { pid: root.pid })?;
        let ours = ns_link(ferry_sys::ns::getpid(), "pid").as_deref() == Some(ns.as_str());
        let time_ns = ns_link(root.pid, "time");
        let mut view = PidView {
            map: HashMap::new(),
            groups: HashMap::new(),
            ns: ns.clone(),
            ours,
        };
        let mut depth = None;
        for fp in &frozen.procs {
            let pid = fp.pid;
            let status = procfs::status(pid)?;
            let ids = ns_ids(&status, "NSpid");
            let Some(&inner) = ids.last() else {
                return Err(Error::Io {
                    pid,
                    what: "read NSpid from /proc/PID/status".into(),
                    source: std::io::Error::from(std::io::ErrorKind::InvalidData),
                });
            };
            if *depth.get_or_insert(ids.len()) != ids.len() {
                return Err(refuse(
                    pid,
                    "its PID namespace",
                    format!(
                        "it lives in a PID namespace other than the root's (PID {}), nested \
                         {} levels deep instead of {}; a tree spanning PID namespaces cannot \
                         be rebuilt",
                        root.pid,
                        ids.len(),
                        depth.unwrap_or(0)
                    ),
                ));
            }
            if !fp.zombie {
                // (Read through a live thread: a main thread that has exited has none.)
                let pid = fp.host();
                let here = ns_link(pid, "pid");
                if here.as_deref() != Some(ns.as_str()) {
                    return Err(refuse(
                        pid,
                        "its PID namespace",
                        format!(
                            "it lives in PID namespace {}, the root (PID {}) in {ns}; a tree \
                             spanning PID namespaces cannot be rebuilt",
                            here.unwrap_or_default(),
                            root.pid
                        ),
                    ));
                }
                if ns_link(pid, "pid_for_children") != here {
                    return Err(refuse(
                        pid,
                        "a new PID namespace for its children",
                        "it called unshare(CLONE_NEWPID); its next children would live in a \
                         namespace the image cannot describe"
                            .into(),
                    ));
                }
                let t = ns_link(pid, "time");
                if t != time_ns || ns_link(pid, "time_for_children") != t {
                    return Err(refuse(
                        pid,
                        "its time namespace",
                        format!(
                            "it (or its next children) lives in a time namespace other than \
                             the root's (PID {}); the image records one set of clocks",
                            root.pid
                        ),
                    ));
                }
            }
            if !ours && inner == 1 {
                return Err(refuse(
                    pid,
                    "PID 1 of its PID namespace",
                    "it is the namespace's init; a tree is rebuilt in a new namespace whose PID 1 \
                     is ferry's own guest init, so its init cannot be part of the tree"
                        .into(),
                ));
            }
            view.map.insert(pid, inner);
            let pgid = ns_ids(&status, "NSpgid").last().copied().unwrap_or(0);
            let sid = ns_ids(&status, "NSsid").last().copied().unwrap_or(0);
            view.groups.insert(pid, (pgid, sid));
            for (host, seen) in [(fp.stat.pgid, pgid), (fp.stat.sid, sid)] {
                if host > 0 && seen > 0 {
                    view.map.entry(host).or_insert(seen);
                }
            }
            for t in fp.threads.iter().filter(|t| t.tid != pid) {
                let st = procfs::read(pid, &format!("task/{}/status", t.tid))?;
                let st: Vec<(String, String)> = st
                    .lines()
                    .filter_map(|l| l.split_once(':'))
                    .map(|(k, v)| (k.to_string(), v.trim().to_string()))
                    .collect();
                let tid = ns_ids(&st, "NSpid").last().copied().ok_or(Error::Io {
                    pid,
                    what: format!("read NSpid of thread {}", t.tid),
                    source: std::io::Error::from(std::io::ErrorKind::InvalidData),
                })?;
                view.map.insert(t.tid, tid);
            }
        }
        Ok(view)
    }

    /// A tree leaving its home leaves deputies there that stand for its processes under the
    /// PIDs the home knows them by, and is rebuilt elsewhere under the PIDs it knows itself
    /// by. Its other processes may differ (a child of a `ferry run` program, which lives in a
    /// PID namespace of its own: the home's deputies turn one number into the other,
    /// `ferry_daemon::deputies`), but its root must read the same in both, by which the home,
    /// the body's node and the relays know the tree. The first of `pids` that has another PID
    /// in its own namespace than here: (its PID here, its own).
    pub fn first_renumbered(&self, pids: &[i32]) -> Option<(i32, i32)> {
        pids.iter()
            .map(|&p| (p, self.of_pid(p)))
            .find(|(p, inner)| p != inner)
    }

    /// Whether the tree lives in our own PID namespace (every number reads the same).
    pub fn is_ours(&self) -> bool {
        self.ours
    }

    /// The tree's number for host PID `host` (a process, thread, group or session of the tree,
    /// or any other process: its number in the tree's namespace, 0 if the tree cannot see it).
    pub fn of_pid(&self, host: i32) -> i32 {
        if host <= 0 {
            return host;
        }
        if let Some(v) = self.map.get(&host) {
            return *v;
        }
        if self.ours {
            return host;
        }
        // A process outside the tree: visible to it only if it lives in the same namespace.
        match (ns_link(host, "pid"), procfs::status(host)) {
            (Some(n), Ok(st)) if n == self.ns => ns_ids(&st, "NSpid").last().copied().unwrap_or(0),
            _ => 0,
        }
    }

    /// The tree's number for a process or thread that must belong to it.
    fn member(&self, host: i32, what: impl FnOnce() -> String) -> Result<i32> {
        self.map
            .get(&host)
            .copied()
            .ok_or_else(|| Error::BadImage(format!("{}: PID {host} is not in the tree", what())))
    }

    /// Rewrites every PID-valued field of `tree` (captured with host PIDs) into the tree's view.
    /// Raw siginfo records need nothing: the kernel queued them with `si_pid` already in the
    /// receiver's namespace.
    pub fn translate(&self, tree: &mut Tree, frozen: &FrozenTree) -> Result<()> {
        // Where each description is held (host PID, fd), while the tree still has host PIDs.
        let mut holders: HashMap<u32, (i32, i32)> = HashMap::new();
        for p in tree.processes.iter().filter(|p| p.zombie_status.is_none()) {
            for f in &p.fds {
                holders.entry(f.file).or_insert((p.pid, f.fd));
            }
        }
        // Which process holds each socket, by inode.
        let socket_holder: HashMap<u64, i32> = tree
            .files
            .iter()
            .filter_map(|f| match &f.kind {
                FileKind::Socket(s) => Some((s.ino, holders.get(&f.id)?.0)),
                _ => None,
            })
            .collect();
        // The tree's number of each of its process groups, by host PGID (before the
        // processes' own fields are rewritten below).
        let tree_groups: HashMap<i32, i32> = tree
            .processes
            .iter()
            .filter_map(|p| Some((p.pgid, self.groups.get(&p.pid)?.0)))
            .collect();
        for f in &mut tree.files {
            let (holder, fd) = holders.get(&f.id).copied().unwrap_or_default();
            if holder == 0 && f.owner.is_none() && f.flags & libc::O_ASYNC != 0 {
                return Err(Error::Unsupported {
                    pid: tree.root_pid,
                    what: format!("file {} (in flight in a socket's queue)", f.id),
                    why: "it has O_ASYNC, which only a process holding it could set again (the \
                          signal names the descriptor it was set through), and none of the tree \
                          does"
                        .into(),
                });
            }
            if holder == 0 && f.locks.iter().any(|l| l.kind == LockKind::Lease) {
                return Err(Error::Unsupported {
                    pid: tree.root_pid,
                    what: format!("file {} (in flight in a socket's queue)", f.id),
                    why: "it holds a lease, which only a process holding it could take again \
                          (the lease's signals go to that process), and none of the tree does"
                        .into(),
                });
            }
            let Some(o) = &mut f.owner else {
                continue;
            };
            let whose = match o.kind {
                OwnerKind::Thread => "thread",
                OwnerKind::Process => "process",
                OwnerKind::Group => "process group",
            };
            if holder == 0 {
                return Err(Error::Unsupported {
                    pid: tree.root_pid,
                    what: format!("file {} (in flight in a socket's queue)", f.id),
                    why: format!(
                        "it has a signal-driven I/O owner ({whose} {}), which only a process \
                         holding it could set again, and none of the tree does",
                        o.pid
                    ),
                });
            }
            let seen = match o.kind {
                OwnerKind::Thread | OwnerKind::Process => self.map.get(&o.pid).copied(),
                OwnerKind::Group => tree_groups.get(&o.pid).copied(),
            };
            o.pid = seen.ok_or_else(|| Error::Unsupported {
                pid: holder,
                what: format!("fd {fd}"),
                why: format!(
                    "its signals of signal-driven I/O (F_SETOWN) go to {whose} {}, which is \
                     not part of the tree: it would not get them from the restored copy",
                    o.pid
                ),
            })?;
        }
        tree.root_pid = self.member(tree.root_pid, || "the root".into())?;
        for p in &mut tree.processes {
            let host = p.pid;
            p.pid = self.member(host, || "a process".into())?;
            p.ppid = self.of_pid(p.ppid);
            if let Some((pgid, sid)) = self.groups.get(&host) {
                (p.pgid, p.sid) = (*pgid, *sid);
            }
            for t in &mut p.threads {
                t.tid = self.member(t.tid, || format!("PID {host}: a thread"))?;
            }
            for t in &mut p.posix_timers {
                t.notify_tid = self.of_pid(t.notify_tid);
            }
        }
        for f in &mut tree.files {
            match &mut f.kind {
                FileKind::Epoll(e) => {
                    for i in &mut e.items {
                        i.pid = self.member(i.pid, || format!("epoll file {}", f.id))?;
                    }
                }
                FileKind::Pidfd { pid } => {
                    let (holder, fd) = holders.get(&f.id).copied().unwrap_or_default();
                    *pid = *self.map.get(pid).ok_or_else(|| Error::Unsupported {
                        pid: holder,
                        what: format!("fd {fd} (a pidfd)"),
                        why: format!("it refers to PID {pid}, which is not part of the tree"),
                    })?;
                }
                FileKind::ProcFile { pid, rest } => {
                    let (holder, fd) = holders.get(&f.id).copied().unwrap_or_default();
                    let host = *pid;
                    *pid = self.member(host, || format!("PID {holder} fd {fd} (/proc/{host})"))?;
                    // /proc/PID/task/TID/...: the thread by the tree's number too.
                    if let Some(after) = rest.strip_prefix("/task/") {
                        let (tid, tail) = after.split_at(after.find('/').unwrap_or(after.len()));
                        if let Ok(tid) = tid.parse::<i32>() {
                            let seen = self.member(tid, || {
                                format!("PID {holder} fd {fd} (/proc/{host}/task/{tid})")
                            })?;
                            *rest = format!("/task/{seen}{tail}");
                        }
                    }
                }
                FileKind::Tty(t) => {
                    if let Some(s) = &mut t.state {
                        s.session = self.of_pid(s.session);
                        s.fg_pgrp = self.of_pid(s.fg_pgrp);
                    }
                }
                FileKind::Socket(s) => {
                    if let Some(c) = &mut s.peer_cred {
                        c.pid = match self.map.get(&c.pid) {
                            Some(v) => *v,
                            None if self.ours => c.pid,
                            // Credentials of a process that is gone (a socket made by a helper
                            // at an earlier restore, say) have no number here any more: ask
                            // a holder of the socket, inside the tree's namespace.
                            None => match holders.get(&f.id) {
                                Some(&(pid, fd)) => peer_pid_inside(frozen, pid, fd)?,
                                None => 0,
                            },
                        };
                    }
                    if let SockState::Listening { pending, .. } = &mut s.state {
                        for c in pending.iter_mut() {
                            let client = c.client_ino;
                            let Some(cred) = c.cred.as_mut() else {
                                continue;
                            };
                            cred.pid = match self.map.get(&cred.pid) {
                                Some(v) => *v,
                                None if self.ours => cred.pid,
                                // Whoever connected is gone (a helper of an earlier restore):
                                // the process holding the client socket stands in for it.
                                None => socket_holder
                                    .get(&client)
                                    .and_then(|h| self.map.get(h))
                                    .copied()
                                    .unwrap_or(0),
                            };
                        }
                    }
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// SO_PEERCRED's PID of socket `fd` of frozen process `pid`, as that process sees it (asked by
/// a call injected into it).
fn peer_pid_inside(frozen: &FrozenTree, pid: i32, fd: i32) -> Result<i32> {
    let t = frozen
        .procs
        .iter()
        .find(|p| p.pid == pid)
        .and_then(|p| p.threads.first())
        .ok_or(Error::NoSuchProcess { pid })?;
    let syscall_at = ferry_inject::find_syscall_insn(pid)?;
    let inj = ferry_inject::Injector::on_stack(pid, t.tid, t.regs, syscall_at)?;
    let asked = (|| -> Result<i32> {
        let len = inj.write_scratch(64, &12u32.to_ne_bytes())?;
        inj.syscall(
            "getsockopt(SO_PEERCRED)",
            libc::SYS_getsockopt,
            &[
                fd as u64,
                libc::SOL_SOCKET as u64,
                libc::SO_PEERCRED as u64,
                inj.scratch(0),
                len,
            ],
        )?;
        let b = inj.read_scratch(0, 4)?;
        Ok(i32::from_ne_bytes(b[..4].try_into().expect("4 bytes")))
    })();
    inj.finish()?;
    asked
}

/// CLOCK_MONOTONIC and CLOCK_BOOTTIME as process `pid` sees them now: our clocks plus the
/// offsets of its time namespace (/proc/PID/timens_offsets).
pub fn clocks_seen_by(pid: i32) -> Result<Clocks> {
    let text = procfs::read(pid, "timens_offsets")?;
    let mut off: HashMap<String, i128> = HashMap::new();
    for line in text.lines() {
        let w: Vec<&str> = line.split_whitespace().collect();
        if let [name, secs, nanos] = w[..] {
            let v = secs.parse::<i128>().unwrap_or(0) * 1_000_000_000
                + nanos.parse::<i128>().unwrap_or(0);
            off.insert(name.to_string(), v);
        }
    }
    let now = |clock: i32, names: [&str; 2]| -> Result<u64> {
        let host = ferry_sys::anon_fds::clock_now_ns(clock).map_err(|source| Error::Sys {
            pid,
            what: format!("read clock {clock}"),
            source,
        })? as i128;
        let o = names.iter().find_map(|n| off.get(*n)).copied().unwrap_or(0);
        Ok((host + o).max(0) as u64)
    };
    Ok(Clocks {
        monotonic_ns: now(libc::CLOCK_MONOTONIC, ["monotonic", "1"])?,
        boottime_ns: now(libc::CLOCK_BOOTTIME, ["boottime", "7"])?,
    })
}
