//! `ferry __guest-init --hold-fd N` (hidden): PID 1 of the guest namespaces a tree is restored
//! into (`ferry restore --pid-namespace`, `ferry_engine::guest_ns`).
//!
//! It reaps every child as soon as it ends (orphans of the guest are reparented to it), and
//! exits once the process that made the namespaces has closed the hold pipe (descriptor N) and
//! no process other than itself is left in its PID namespace. It looks at least once a second;
//! it must never exit earlier, since the kernel kills every process of a PID namespace whose
//! init exits. It runs one thread only: a second thread would take a PID of the namespace,
//! which a restored tree may need.
//!
//! In a body's namespaces (`--home`), it is also the supervisor of Ferry's seccomp filter: the
//! listeners of the tree's processes come through the hold socket (SCM_RIGHTS), and it answers
//! `getppid`, `getpgrp`, `getpgid` and `getsid` with the values the home gave (see
//! [`Supervisor`]), signals to processes at home (super::guest_kills), and `getsockname` and `getpeername` of the tree's relayed sockets with the
//! names they had at home (their filters hand those over only in processes that hold one). It names its UTS namespace after the home (`--hostname`). If it dies, the
//! kernel kills every process of its namespace: no body ever sees ENOSYS from a call nobody
//! answers.

use anyhow::{bail, Context, Result};
use std::os::fd::AsRawFd;

#[derive(clap::Args)]
pub struct Args {
    /// The read end of the hold pipe: while its writer holds it open, stay even when alone.
    #[arg(long)]
    pub hold_fd: i32,
    /// A datagram socket (the daemon's) told of every child that ends, stops or continues: "NS
    /// PID STATUS", where NS names this PID namespace as /proc/self/ns/pid does and STATUS is the
    /// raw wait status.
    #[arg(long)]
    pub report: Option<std::path::PathBuf>,
    /// The host name of this UTS namespace (the body's home's).
    #[arg(long)]
    pub hostname: Option<String>,
    /// "ROOT PPID PGID SID": the tree's root and its parent, process group and session at home.
    #[arg(long)]
    pub home: Option<String>,
    /// A body away from home: make this mount namespace show only the system's files,
    /// read-only, and the shared tree (super::guest_confine), before anything is in it.
    #[arg(long, requires = "home")]
    pub confine: bool,
    /// With --confine: the cluster's shared tree.
    #[arg(long, requires = "confine")]
    pub shared: Option<std::path::PathBuf>,
    /// With --confine: directories of the node's own hidden even where they would show.
    #[arg(long, requires = "confine")]
    pub hide: Vec<std::path::PathBuf>,
}

/// The root of a body and its identities at home.
#[derive(Debug, Clone, Copy)]
struct HomeIds {
    root: i32,
    ppid: i32,
    pgid: i32,
    sid: i32,
}

fn parse_home(s: &str) -> Result<HomeIds> {
    let v: Vec<i32> = s
        .split_whitespace()
        .map(|x| x.parse::<i32>())
        .collect::<std::result::Result<_, _>>()
        .with_context(|| format!("--home {s:?}: not four numbers"))?;
    match v[..] {
        [root, ppid, pgid, sid] => Ok(HomeIds {
            root,
            ppid,
            pgid,
            sid,
        }),
        _ => bail!("--home {s:?}: not four numbers"),
    }
}

/// Parent, process group and session of thread `tid` (this namespace's numbers), from
/// /proc/TID/stat: the cheapest of /proc's files that has them.
pub(crate) fn ids_of(tid: i32) -> Option<(i32, i32, i32)> {
    let s = std::fs::read_to_string(format!("/proc/{tid}/stat")).ok()?;
    // "tid (comm) state ppid pgrp session ...": comm may hold anything but its last ')'.
    let mut f = s[s.rfind(')')? + 1..].split_whitespace().skip(1);
    let mut next = || f.next()?.parse::<i32>().ok();
    Some((next()?, next()?, next()?))
}

/// The process (thread group) thread `tid` belongs to.
fn tgid_of(tid: i32) -> Option<i32> {
    let s = std::fs::read_to_string(format!("/proc/{tid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("Tgid:"))?
        .trim()
        .parse()
        .ok()
}

/// Whether thread `tid` belongs to process `pid`.
fn thread_of(tid: i32, pid: i32) -> bool {
    tid == pid || std::path::Path::new(&format!("/proc/{pid}/task/{tid}")).exists()
}

/// Answers the calls Ferry's filter hands over (ferry_engine::resources::seccomp::FORWARDED)
/// as the home would. The tree was rebuilt with its root leading a session of its own (the
/// engine's restore): its group and session read as the root's PID here, and stand for the
/// root's group and session at home; the root's parent here (this init, or nobody) stands for
/// its parent at home. Every other number is the tree's own and the same as at home.
struct Supervisor {
    home: HomeIds,
    listeners: Vec<std::os::fd::OwnedFd>,
    /// Calls answered, per thread (this namespace's TID), and the time spent on them.
    counts: std::collections::HashMap<i32, (u64, u64)>,
    /// The processes whose counts changed since they were last reported.
    changed: std::collections::BTreeSet<i32>,
    /// The relayed sockets, by the inode of the socket the tree holds: their names at home
    /// (getsockname's, getpeername's), as the kernel writes them, and their inode there.
    names: std::collections::HashMap<u64, ferry_engine::resources::sockets::RelayedNames>,
    /// The device number of sockets (sockfs): an inode number means a socket only with it.
    sockfs: u64,
    /// The device number of pipes (pipefs), likewise: `names` holds relayed pipes too (entries
    /// without names, `RelayedNames::is_pipe`), whose fstat answers their inode at home.
    pipefs: u64,
    /// Bytes read from the hold socket and not yet understood (a message cut in two).
    inbox: Vec<u8>,
    /// The processes the body makes, and those whose end is told home from here.
    forks: super::guest_forks::Forks,
    /// Where the daemon tells the root's new parent, group and session at home ("I PPID PGID
    /// SID"), and when it was last asked for (asked again a few seconds after it hangs up: a
    /// daemon that restarted).
    watch: Option<std::os::fd::OwnedFd>,
    watch_asked: Option<std::time::Instant>,
}

/// How a forwarded call is answered: a value, an errno, or by the kernel itself
/// (SECCOMP_USER_NOTIF_FLAG_CONTINUE).
enum Answer {
    Value(i64),
    Errno(i32),
    Kernel,
}

impl Supervisor {
    /// Takes what the hold socket said: `N` messages carry relayed sockets' names (see
    /// `GuestNamespaces::hand_listeners`), `L` ones listeners (which come in `rights`).
    fn take_hold(&mut self, data: &[u8], rights: Vec<std::os::fd::OwnedFd>) {
        self.inbox.extend_from_slice(data);
        loop {
            match self.inbox.first() {
                None => break,
                Some(b'L') => {
                    self.inbox.remove(0);
                }
                Some(b'N') => {
                    let Some(nl) = self.inbox.iter().position(|&b| b == b'\n') else {
                        break;
                    };
                    let len = std::str::from_utf8(&self.inbox[1..nl])
                        .ok()
                        .and_then(|l| l.parse::<usize>().ok());
                    let Some(len) = len else {
                        log::warn!("guest init: a bad names message on the hold socket");
                        self.inbox.clear();
                        break;
                    };
                    if self.inbox.len() < nl + 1 + len {
                        break;
                    }
                    let text: Vec<u8> = self.inbox.drain(..nl + 1 + len).skip(nl + 1).collect();
                    let list = std::str::from_utf8(&text)
                        .ok()
                        .and_then(ferry_engine::resources::sockets::RelayedNames::decode);
                    match list {
                        Some(list) => self.names.extend(list.into_iter().map(|n| (n.ino, n))),
                        None => log::warn!("guest init: bad relayed socket names: {text:?}"),
                    }
                }
                Some(b) => {
                    log::warn!("guest init: unexpected byte {b} on the hold socket");
                    self.inbox.clear();
                    break;
                }
            }
        }
        for l in &rights {
            if let Err(e) = ferry_sys::seccomp::sync_wake_up(l.as_raw_fd()) {
                log::debug!("guest init: seccomp listener: {e}");
            }
        }
        if !rights.is_empty() {
            // The tree is whole: the ends of its processes this init is not the parent of
            // are told home from here.
            self.forks.watch_tree(self.home.root);
            self.watch_home();
        }
        self.listeners.extend(rights);
    }

    /// The relayed socket (or, with `pipes`, the relayed socket or pipe) the caller of `n`
    /// names by its descriptor `fd` (a copy of it, and what the restore said of it); `None`
    /// for any other descriptor.
    ///
    /// The descriptor is looked up in the calling thread's own table (/proc/TID/fd: one
    /// readlink, which is all a descriptor that is no relayed socket costs), then taken with
    /// pidfd_getfd from the thread, or from its process (pidfd_getfd takes no thread's pidfd),
    /// and must be the same socket.
    fn relayed(
        &self,
        n: &ferry_sys::seccomp::Notif,
        fd: u64,
        pipes: bool,
    ) -> Option<(
        std::fs::File,
        &ferry_engine::resources::sockets::RelayedNames,
    )> {
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        let fd = fd as i32;
        if fd < 0 {
            return None;
        }
        let link = std::fs::read_link(format!("/proc/{}/fd/{fd}", n.pid)).ok()?;
        let link = link.to_str()?;
        let (pipe, rest) = match link.strip_prefix("socket:[") {
            Some(rest) => (false, rest),
            None if pipes => (true, link.strip_prefix("pipe:[")?),
            None => return None,
        };
        let ino: u64 = rest.strip_suffix(']')?.parse().ok()?;
        let known = self.names.get(&ino).filter(|k| k.is_pipe() == pipe)?;
        let take = |pid: i32| {
            ferry_sys::pidfd::pidfd_open(pid)
                .and_then(|p| ferry_sys::pidfd::pidfd_getfd(&p, fd))
                .ok()
        };
        let sock = take(n.pid).or_else(|| take(tgid_of(n.pid)?))?;
        let sock = std::fs::File::from(sock);
        let meta = sock.metadata().ok()?;
        let (kind, dev) = if pipe {
            (meta.file_type().is_fifo(), self.pipefs)
        } else {
            (meta.file_type().is_socket(), self.sockfs)
        };
        if !kind || meta.dev() != dev || meta.ino() != ino {
            return None;
        }
        Some((sock, known))
    }

    /// Writes `bytes` at `addr` of the caller of `n`, whole, or says it could not.
    fn write_to(n: &ferry_sys::seccomp::Notif, addr: u64, bytes: &[u8]) -> bool {
        matches!(ferry_sys::proc_mem::vm_write(n.pid, addr, bytes), Ok(w) if w == bytes.len())
    }

    /// getsockname or getpeername (`n`, taken from `listener`): for a relayed socket, the
    /// name it had at home, written into the caller's buffer as the kernel would (its whole
    /// length into `*addrlen`, and at most `*addrlen` bytes of it); for anything else, or a
    /// socket the kernel would fail the call for (getpeername once it is no longer connected),
    /// the kernel's own answer.
    fn name(&self, n: &ferry_sys::seccomp::Notif, listener: i32) -> Answer {
        let peer = n.nr as i64 == libc::SYS_getpeername;
        let Some((sock, known)) = self.relayed(n, n.args[0], false) else {
            return Answer::Kernel;
        };
        let (local, remote) = (&known.local, &known.peer);
        if peer && ferry_sys::sockets::getpeername(sock.as_raw_fd()).is_err() {
            return Answer::Kernel;
        }
        let name = if peer { remote } else { local };
        // As move_addr_to_user (Linux 6.18) does: read *addrlen; unless it is negative, write
        // the name's whole length there; then copy min(*addrlen, length) bytes of the name.
        let mut len = [0u8; 4];
        if !matches!(
            ferry_sys::proc_mem::vm_read(n.pid, n.args[2], &mut len),
            Ok(4)
        ) {
            return Answer::Errno(libc::EFAULT);
        }
        let len = i32::from_ne_bytes(len).min(name.len() as i32);
        // The caller is still waiting in this call (not killed, its PID not someone else's)
        // before anything is written into it.
        if !ferry_sys::seccomp::id_valid(listener, n.id) {
            return Answer::Errno(libc::EINTR);
        }
        let write = |addr: u64, bytes: &[u8]| Self::write_to(n, addr, bytes);
        if len >= 0 && !write(n.args[2], &(name.len() as u32).to_ne_bytes()) {
            return Answer::Errno(libc::EFAULT);
        }
        if len < 0 {
            return Answer::Errno(libc::EINVAL);
        }
        if len > 0 && !write(n.args[1], &name[..len as usize]) {
            return Answer::Errno(libc::EFAULT);
        }
        Answer::Value(0)
    }

    /// fstat, or newfstatat and statx of a descriptor itself (AT_EMPTY_PATH, an empty path):
    /// for a relayed socket or pipe, what the kernel says of the body's socket or pipe but for
    /// its inode number, which is the original's at home; for anything else, the kernel's own
    /// answer.
    fn stat(&self, n: &ferry_sys::seccomp::Notif, listener: i32) -> Answer {
        let nr = n.nr as i64;
        let (fd, buf) = match nr {
            libc::SYS_fstat => (n.args[0], n.args[1]),
            libc::SYS_newfstatat => (n.args[0], n.args[2]),
            _ => (n.args[0], n.args[4]),
        };
        if nr != libc::SYS_fstat && n.args[1] != 0 {
            // A path (relative to the descriptor) is the kernel's to follow; a NULL one with
            // AT_EMPTY_PATH means the descriptor itself, as an empty one does.
            let mut first = [0u8; 1];
            match ferry_sys::proc_mem::vm_read(n.pid, n.args[1], &mut first) {
                Ok(1) if first[0] == 0 => {}
                _ => return Answer::Kernel,
            }
        }
        let Some((sock, known)) = self.relayed(n, fd, true) else {
            return Answer::Kernel;
        };
        let ino = known.home_ino.to_ne_bytes();
        let st = if nr == libc::SYS_statx {
            // struct statx: stx_mask at 0, stx_ino at 32 (when the mask has STATX_INO).
            let flags = (n.args[2] as i32) & libc::AT_STATX_SYNC_TYPE;
            match ferry_sys::fdops::statx_raw(sock.as_raw_fd(), flags, n.args[3] as u32) {
                Ok(mut st) => {
                    let mask = u32::from_ne_bytes(st[0..4].try_into().expect("4 bytes"));
                    if mask & libc::STATX_INO != 0 {
                        st[32..40].copy_from_slice(&ino);
                    }
                    st.to_vec()
                }
                Err(_) => return Answer::Kernel,
            }
        } else {
            // struct stat (x86_64): st_ino at 8.
            match ferry_sys::fdops::fstat_raw(sock.as_raw_fd()) {
                Ok(mut st) => {
                    st[8..16].copy_from_slice(&ino);
                    st.to_vec()
                }
                Err(_) => return Answer::Kernel,
            }
        };
        if !ferry_sys::seccomp::id_valid(listener, n.id) {
            return Answer::Errno(libc::EINTR);
        }
        if !Self::write_to(n, buf, &st) {
            return Answer::Errno(libc::EFAULT);
        }
        Answer::Value(0)
    }

    /// Asks the daemon to tell the root's changes at home, unless it already does or was
    /// asked less than 5 s ago.
    fn watch_home(&mut self) {
        if self.watch.is_some()
            || self
                .watch_asked
                .is_some_and(|t| t.elapsed() < std::time::Duration::from_secs(5))
        {
            return;
        }
        self.watch_asked = Some(std::time::Instant::now());
        self.watch = self.forks.watch_home();
    }

    /// Reads what the daemon said on the watch socket (`events`: what poll said of it): the
    /// root's parent, group and session at home, from now on.
    fn watched_home(&mut self, events: i16) {
        let Some(fd) = self.watch.as_ref().map(|w| w.as_raw_fd()) else {
            return;
        };
        if events & libc::POLLIN != 0 {
            if let Ok(r) = ferry_sys::sockets::recv(fd, 256, libc::MSG_DONTWAIT) {
                let text = String::from_utf8_lossy(&r.data);
                let v: Vec<i32> = text
                    .strip_prefix("I ")
                    .unwrap_or_default()
                    .split_whitespace()
                    .filter_map(|x| x.parse().ok())
                    .collect();
                if let [ppid, pgid, sid] = v[..] {
                    (self.home.ppid, self.home.pgid, self.home.sid) = (ppid, pgid, sid);
                    return;
                }
                if !r.data.is_empty() {
                    log::warn!("guest init: a bad word from the daemon: {text:?}");
                    return;
                }
            }
        }
        if events & (libc::POLLHUP | libc::POLLERR) != 0 || events & libc::POLLIN != 0 {
            // Hung up (or end of file): its daemon is gone; asked again later.
            self.watch = None;
        }
    }

    /// A signal sent by a process of the body (`n`, from `listener`): one to a process of the
    /// body's namespace goes on in the kernel, any other is made at home by the caller's
    /// deputy (super::guest_kills).
    fn kill(&self, n: &ferry_sys::seccomp::Notif, listener: i32) -> Answer {
        use super::guest_kills::{at_home, target, Target};
        let args: [u64; 6] = n.args;
        match target(n.nr as i64, &args, n.pid, self.home.root, self.home.pgid) {
            Target::Here => Answer::Kernel,
            Target::Home { info } => {
                let Some(pid) = tgid_of(n.pid) else {
                    return Answer::Errno(libc::ESRCH);
                };
                match at_home(&self.forks, n, listener, pid, info) {
                    Ok(v) => Answer::Value(v),
                    Err(e) => Answer::Errno(e),
                }
            }
        }
    }

    /// setpgid or setsid by a process of the body (`n`, from `listener`): its deputy makes the
    /// same call at home first, so the home's job control and `getpgid` from home follow; if
    /// the home's kernel refuses, so does this. Then the call goes on in the kernel here, but
    /// for the tree's root: its group and session here (its own, numbered as itself) stand for
    /// its home ones, so it stays in them, and they stand for the new ones from now on (told
    /// to the daemon, for the body's next move). A process joining the root's group by its home
    /// number (which is no group here) is refused (EPERM) before home is asked: the body's
    /// kernel could not follow.
    fn group(&mut self, n: &ferry_sys::seccomp::Notif, listener: i32) -> Answer {
        let Some(pid) = tgid_of(n.pid) else {
            return Answer::Errno(libc::ESRCH);
        };
        let h = self.home;
        let setsid = n.nr as i64 == libc::SYS_setsid;
        // setpgid(0 or PID, 0 or PGID): which process, and which group.
        let target = match n.args[0] as i32 {
            0 => pid,
            t => t,
        };
        let group = match n.args[1] as i32 {
            0 => target,
            g => g,
        };
        if !setsid && target != h.root && group == h.pgid && h.pgid != h.root {
            self.forks.say(&format!(
                "PID {pid} moves PID {target} into group {group}, the tree's group at home, which \
                 the body's namespace numbers {}: not followed; the call fails with EPERM",
                h.root
            ));
            return Answer::Errno(libc::EPERM);
        }
        let done = match super::guest_kills::at_home(&self.forks, n, listener, pid, None) {
            Ok(v) => v,
            Err(e) => return Answer::Errno(e),
        };
        if setsid && pid == h.root {
            self.home.sid = done as i32;
            self.home.pgid = done as i32;
        } else if !setsid && target == h.root {
            self.home.pgid = group;
        } else {
            return Answer::Kernel;
        }
        self.forks
            .tell_ids(self.home.ppid, self.home.pgid, self.home.sid);
        Answer::Value(done)
    }

    /// The answer to notification `n`: a value, or an errno.
    fn answer(&self, n: &ferry_sys::seccomp::Notif) -> std::result::Result<i64, i32> {
        let h = self.home;
        let target = |arg: u64| -> std::result::Result<i32, i32> {
            match arg as i32 {
                0 => Ok(n.pid),
                p if p < 0 => Err(libc::ESRCH),
                p => Ok(p),
            }
        };
        let local = |tid: i32| ids_of(tid).ok_or(libc::ESRCH);
        let nr = n.nr as i64;
        if nr == libc::SYS_getppid {
            let (ppid, _, _) = local(n.pid)?;
            // The root's parent is outside the tree: here 0 (its maker) or 1 (this init).
            return Ok(if ppid <= 1 && thread_of(n.pid, h.root) {
                h.ppid
            } else {
                ppid
            } as i64);
        }
        let (is_sid, tid) = if nr == libc::SYS_getpgrp {
            (false, n.pid)
        } else if nr == libc::SYS_getpgid {
            (false, target(n.args[0])?)
        } else if nr == libc::SYS_getsid {
            (true, target(n.args[0])?)
        } else {
            return Err(libc::ENOSYS);
        };
        let (_, pgid, sid) = local(tid)?;
        Ok(match (is_sid, if is_sid { sid } else { pgid }) {
            (true, v) if v == h.root => h.sid,
            (false, v) if v == h.root => h.pgid,
            (_, v) => v,
        } as i64)
    }

    /// Takes and answers one notification waiting on listener `i`; false if the listener is
    /// done (no process uses its filter any more).
    fn serve(&mut self, i: usize) -> bool {
        use std::os::fd::AsRawFd;
        let fd = self.listeners[i].as_raw_fd();
        let t = std::time::Instant::now();
        let n = match ferry_sys::seccomp::recv(fd) {
            Ok(n) => n,
            // Its caller was interrupted (a signal) before we took it: nothing to answer.
            Err(e) if e.errno == libc::ENOENT || e.errno == libc::EINTR => return true,
            Err(e) => {
                log::warn!("guest init: seccomp listener: {e}");
                return false;
            }
        };
        let nr = n.nr as i64;
        let mut pending = None;
        let clone = ferry_engine::resources::seccomp::CLONES
            .iter()
            .any(|(c, _)| *c as i64 == nr);
        let answer = if clone {
            match self.forks.prepare(&n, fd, tgid_of(n.pid)) {
                Ok(p) => {
                    pending = p;
                    Answer::Kernel
                }
                Err(e) => Answer::Errno(e),
            }
        } else if super::guest_kills::is_kill(nr) {
            self.kill(&n, fd)
        } else if nr == libc::SYS_setpgid || nr == libc::SYS_setsid {
            self.group(&n, fd)
        } else if nr == libc::SYS_getsockname || nr == libc::SYS_getpeername {
            self.name(&n, fd)
        } else if nr == libc::SYS_fstat || nr == libc::SYS_newfstatat || nr == libc::SYS_statx {
            self.stat(&n, fd)
        } else {
            match self.answer(&n) {
                Ok(v) => Answer::Value(v),
                Err(e) => Answer::Errno(e),
            }
        };
        let (val, err, flags) = match answer {
            Answer::Value(v) => (v, 0, 0),
            Answer::Errno(e) => (0, e, 0),
            Answer::Kernel => (0, 0, ferry_sys::seccomp::SECCOMP_USER_NOTIF_FLAG_CONTINUE),
        };
        match ferry_sys::seccomp::respond(fd, n.id, val, err, flags) {
            Ok(()) => {
                if let Some(p) = pending {
                    self.forks.made(p);
                }
            }
            Err(e) => {
                if e.errno != libc::ENOENT {
                    log::warn!("guest init: answer call {} of thread {}: {e}", n.nr, n.pid);
                }
                if let Some(p) = pending {
                    // Not let go: the child's deputy at home goes.
                    self.forks.made(p);
                }
            }
        }
        // (Counted per thread: the daemon adds up the tree's.)
        let c = self.counts.entry(n.pid).or_default();
        c.0 += 1;
        c.1 += t.elapsed().as_nanos() as u64;
        self.changed.insert(n.pid);
        true
    }
}

/// Whether this init is the only process of its PID namespace (its /proc is the namespace's).
fn alone() -> bool {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return false;
    };
    !dir.flatten().any(|e| {
        e.file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
            .is_some_and(|pid| pid != 1)
    })
}

/// Reaps every child that has ended, and reports each end, stop and continue to `report` (best
/// effort: a daemon that is gone misses them). Returns those that ended.
fn reap(report: Option<&(std::os::unix::net::UnixDatagram, String)>) -> Vec<i32> {
    let mut ended = Vec::new();
    while let Ok(Some((pid, status))) = ferry_sys::ns::wait_any_changes() {
        if let Some((sock, ns)) = report {
            let _ = sock.send(format!("{ns} {pid} {status}\n").as_bytes());
        }
        if status & 0x7f != 0x7f && status != 0xffff {
            ended.push(pid);
        }
    }
    ended
}

pub fn run(a: Args) -> Result<()> {
    use ferry_sys::{anon_fds, fdops, ns};
    if ns::getpid() != 1 {
        bail!("`ferry __guest-init` only runs as PID 1 of the guest namespaces ferry makes");
    }
    let hold = ns::take_inherited_fd(a.hold_fd)
        .with_context(|| format!("take the hold socket (fd {})", a.hold_fd))?;
    if let Some(name) = &a.hostname {
        ns::sethostname(name).with_context(|| format!("name the guest {name:?}"))?;
    }
    // Every socket's inode is on the one sockfs: the hold socket's device is theirs.
    let sockfs = {
        use std::os::unix::fs::MetadataExt;
        hold.try_clone()
            .map(std::fs::File::from)
            .and_then(|f| f.metadata())
            .map(|m| m.dev())
            .context("stat the hold socket")?
    };
    // Every pipe's on the one pipefs: a pipe made here says which device that is.
    let pipefs = {
        use std::os::unix::fs::MetadataExt;
        let (r, _w) = fdops::pipe2(libc::O_CLOEXEC).context("make a pipe")?;
        std::fs::File::from(r)
            .metadata()
            .map(|m| m.dev())
            .context("stat a pipe")?
    };
    ns::block_signal(libc::SIGCHLD).context("block SIGCHLD")?;
    let sigchld = anon_fds::signalfd(
        1 << (libc::SIGCHLD - 1),
        libc::SFD_CLOEXEC | libc::SFD_NONBLOCK,
    )
    .context("make a signalfd for SIGCHLD")?;
    // Connected before anything is reaped; a report socket that cannot be reached is logged
    // and done without.
    let report = a.report.as_ref().and_then(|path| {
        let sock = std::os::unix::net::UnixDatagram::unbound()
            .and_then(|s| s.connect(path).map(|()| s))
            .map_err(|e| log::warn!("guest init: report socket {}: {e}", path.display()))
            .ok()?;
        let ns = std::fs::read_link("/proc/self/ns/pid").ok()?;
        Some((sock, ns.to_string_lossy().into_owned()))
    });
    // (ns_last_pid is opened here, before the guest is confined.)
    let mut sup = match &a.home {
        Some(h) => Some(Supervisor {
            home: parse_home(h)?,
            listeners: Vec::new(),
            counts: Default::default(),
            changed: Default::default(),
            names: Default::default(),
            sockfs,
            pipefs,
            inbox: Vec::new(),
            forks: super::guest_forks::Forks::new(report.as_ref().and_then(|(s, ns)| {
                Some((
                    s.try_clone()
                        .map_err(|e| log::warn!("guest init: report socket: {e}"))
                        .ok()?,
                    ns.clone(),
                ))
            })),
            watch: None,
            watch_asked: None,
        }),
        None => None,
    };
    if a.confine {
        // Before anything joins the namespace: whoever made it waits for our word ("R", or
        // "E" and why) on the hold socket.
        let done = super::guest_confine::confine(a.shared.as_deref(), &a.hide)
            .context("confine the guest's file system");
        let word = match &done {
            Ok(()) => "R".to_string(),
            Err(e) => format!("E{e:#}"),
        };
        let _ = ferry_sys::sockets::send(hold.as_raw_fd(), word.as_bytes(), None, &[], 0);
        done?;
    }
    let mut hold = Some(hold);
    let mut counted = std::time::Instant::now();
    // Woken only by forwarded calls last time round (no child changed, no timeout).
    let mut busy = false;
    loop {
        let reaped = reap(report.as_ref());
        if let Some(s) = sup.as_mut() {
            s.forks.reaped(&reaped);
        }
        if let (Some(s), Some((sock, ns))) = (sup.as_mut(), report.as_ref()) {
            // What the body costs, for `ferry ps`: at most every half second, when it changed.
            if !s.changed.is_empty() && counted.elapsed() >= std::time::Duration::from_millis(500) {
                for pid in std::mem::take(&mut s.changed) {
                    let (calls, nanos) = s.counts.get(&pid).copied().unwrap_or_default();
                    let _ = sock.send(format!("{ns} calls {pid} {calls} {nanos}\n").as_bytes());
                }
                counted = std::time::Instant::now();
            }
        }
        // (Not after every answered call: listing /proc is the costliest thing done here.)
        if hold.is_none() && !busy && alone() {
            return Ok(());
        }
        let mut fds = vec![sigchld.as_raw_fd(), -1];
        fds[1] = hold.as_ref().map_or(-1, |h| h.as_raw_fd());
        let listening = sup.as_ref().map_or(0, |s| s.listeners.len());
        let watching = sup.as_ref().map_or(0, |s| s.forks.watched.len());
        if let Some(s) = sup.as_mut() {
            if s.watch.is_none() && !s.listeners.is_empty() {
                s.watch_home();
            }
        }
        if let Some(s) = &sup {
            fds.extend(s.listeners.iter().map(|l| l.as_raw_fd()));
            fds.extend(s.forks.watched.iter().map(|(_, w)| w.as_raw_fd()));
            // Last: the daemon's word of home's changes.
            fds.push(s.watch.as_ref().map_or(-1, |w| w.as_raw_fd()));
        }
        // While it watches processes of the tree it is not the parent of, it looks at them
        // five times a second for stops and continues.
        let wait = if watching > 0 { 200 } else { 1000 };
        let events = match ns::poll_events(&fds, wait) {
            Ok(r) => r,
            Err(e) => {
                log::warn!("guest init: {e}");
                std::thread::sleep(std::time::Duration::from_secs(1));
                continue;
            }
        };
        let ready: Vec<bool> = events.iter().map(|&e| e != 0).collect();
        busy = !ready[0] && ready.iter().any(|&r| r);
        if ready[0] {
            let mut buf = [0u8; 128];
            while matches!(fdops::read_fd(sigchld.as_raw_fd(), &mut buf), Ok(n) if n > 0) {}
        }
        if ready[1] {
            let fd = hold.as_ref().map(|h| h.as_raw_fd()).unwrap_or(-1);
            match ferry_sys::sockets::recv(fd, 65536, libc::MSG_DONTWAIT) {
                Ok(r) if !r.data.is_empty() => match sup.as_mut() {
                    Some(s) => s.take_hold(&r.data, r.rights),
                    None => log::warn!("guest init: seccomp listeners for no home"),
                },
                Err(e) if e.errno == libc::EAGAIN || e.errno == libc::EINTR => {}
                _ => hold = None,
            }
        }
        if let Some(s) = sup.as_mut() {
            let mut done = Vec::new();
            for i in 0..listening {
                let ev = events[2 + i];
                if ev & libc::POLLIN != 0 {
                    if !s.serve(i) {
                        done.push(i);
                    }
                } else if ev != 0 {
                    // Hung up: no process uses its filter any more.
                    done.push(i);
                }
            }
            for i in done.into_iter().rev() {
                s.listeners.remove(i);
            }
            // Watched processes that ended (their pidfds read ready); those the calls above
            // added come after them.
            for i in (0..watching).rev() {
                if events[2 + listening + i] != 0 {
                    s.forks.ended(i);
                }
            }
            if let Some(&ev) = events.get(2 + listening + watching) {
                if ev != 0 {
                    s.watched_home(ev);
                }
            }
            s.forks.look_for_stops();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_engine::resources::sockets::RelayedNames;

    fn supervisor() -> Supervisor {
        Supervisor {
            home: HomeIds {
                root: 1,
                ppid: 1,
                pgid: 1,
                sid: 1,
            },
            listeners: Vec::new(),
            counts: Default::default(),
            changed: Default::default(),
            names: Default::default(),
            sockfs: 0,
            pipefs: 0,
            inbox: Vec::new(),
            forks: crate::commands::guest_forks::Forks::new(None),
            watch: None,
            watch_asked: None,
        }
    }

    /// The hold socket is a stream: a names message cut anywhere, and run together with the
    /// listeners' letters, is read whole.
    #[test]
    fn names_messages_are_read_across_cuts() {
        let list = vec![
            RelayedNames {
                relay: 0,
                ino: 5,
                local: vec![2, 0, 1, 2, 127, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0],
                peer: vec![1, 0],
                home_ino: 77,
            },
            RelayedNames {
                relay: 0,
                ino: 6,
                local: Vec::new(),
                peer: vec![1, 0, b'/', b'a', 0],
                home_ino: 78,
            },
        ];
        let text = RelayedNames::encode(&list);
        let stream = format!("LN{}\n{text}L", text.len()).into_bytes();
        for cut in 0..=stream.len() {
            let mut s = supervisor();
            s.take_hold(&stream[..cut], Vec::new());
            s.take_hold(&stream[cut..], Vec::new());
            assert!(s.inbox.is_empty(), "cut at {cut}");
            assert_eq!(s.names.len(), 2, "cut at {cut}");
            assert_eq!(s.names[&6], list[1]);
        }
        // A message that is not one is dropped, not kept waiting for more.
        let mut s = supervisor();
        s.take_hold(b"Nx\n", Vec::new());
        assert!(s.names.is_empty() && s.inbox.is_empty());
    }
}
