//! The spawner: a small single-threaded process the daemon forks once at its start, before its
//! runtime's threads and most of its memory exist (a fork server, as a zygote), that makes the
//! processes of `ferry run` programs for it.
//!
//! Forking the daemon itself for each program copied its page tables (its heap, its threads'
//! stacks) twice for a program run for another node (its init, then the program from the
//! init), and left the daemon taking a copy-on-write fault on each page it wrote while a copy
//! lived. The spawner is a copy of the daemon of that first moment: cloning it copies little.
//!
//! The daemon sends the spawner what [`crate::spawn::spawn`] or
//! [`crate::guest_spawn::spawn_guest`] would be given (the [`Spawn`], the program's stdio and
//! the namespaces' descriptors attached), and the spawner runs the same steps with one
//! difference: the process it makes (the program, or its init) is cloned with `CLONE_PARENT`,
//! so it is the daemon's child, not the spawner's. Its parent-death signal is tied to the
//! daemon's thread that forked the spawner (the main thread, which lives as long as the
//! daemon), and the daemon's reaper collects its status, as before. The daemon makes the
//! pipes the new process reports on and sends their far ends along; the spawner answers with
//! the PID as soon as it has cloned (or with the step that failed), and the daemon waits for
//! the program's exec itself, so that one slow start never holds up the next.
//!
//! The spawner dies with the daemon (parent-death signal), and exits when the daemon closes
//! its socket. Nothing it does is on behalf of anyone but the daemon: its socket is a private
//! socketpair, and every step done for a user is done in the process made for that user, as
//! the user, exactly as when the daemon forked it.

use crate::guest_spawn::{self, spawn_guest_from, Guest, InitEnds, OwnNamespaces};
use crate::spawn::{spawn_from, Spawn, SpawnError, Step};
use crate::{SysError, SysResult};
use std::ffi::CString;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

/// The daemon's end of its spawner.
#[derive(Debug)]
pub struct Spawner {
    sock: Mutex<OwnedFd>,
    pid: i32,
}

static SPAWNER: OnceLock<Spawner> = OnceLock::new();

/// The spawner started by [`start`], if any.
pub fn get() -> Option<&'static Spawner> {
    SPAWNER.get()
}

/// Forks the spawner. Call it while this process is single-threaded (before any runtime or
/// thread starts), from the thread that lives as long as the process: the programs' parent
/// death signal is tied to it.
pub fn start() -> SysResult<()> {
    // Close-on-exec: nothing the daemon or the spawner executes keeps the socket.
    let (ours, theirs) =
        crate::sockets::socketpair(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC)?;
    // SAFETY: getpid cannot fail.
    let parent = unsafe { libc::getpid() };
    // SAFETY: the caller is single-threaded (the contract above), so the child is a complete
    // copy that may allocate and run anything.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(SysError::last("fork (the spawner)"));
    }
    if pid == 0 {
        drop(ours);
        serve(theirs, parent);
    }
    drop(theirs);
    let _ = SPAWNER.set(Spawner {
        sock: Mutex::new(ours),
        pid,
    });
    Ok(())
}

const KIND_SPAWN: u8 = 0;
const KIND_GUEST: u8 = 1;
/// The answer: ok (1 byte), the PID made (the program, or its init), the failed child's (0:
/// none), the failed step (1 byte), its errno, the candidate it is about (u32::MAX: none).
const REPLY_LEN: usize = 1 + 4 + 4 + 1 + 4 + 4;

impl Spawner {
    /// The spawner's PID.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// [`crate::spawn::spawn`], made by the spawner: the program is this process's child. A
    /// spawner gone (killed) before it got the request: this process forks it itself.
    pub fn spawn(&self, s: &Spawn) -> Result<i32, SpawnError> {
        let (err_r, err_w) = crate::fdops::pipe2(libc::O_CLOEXEC)
            .map_err(|e| SpawnError::before(Step::Fork, e.errno))?;
        match self.ask(KIND_SPAWN, s, None, vec![err_w]) {
            Err(Asked::NotSent) => spawn_from(s, false),
            Err(Asked::Failed(e)) => Err(e),
            Ok(pid) => crate::spawn::finish(pid, err_r.as_raw_fd()),
        }
    }

    /// [`crate::guest_spawn::spawn_guest`], made by the spawner: the init is this process's
    /// child. A spawner gone before it got the request: this process clones the init itself.
    pub fn spawn_guest(&self, s: &Spawn, ns: &OwnNamespaces) -> Result<Guest, SpawnError> {
        let (ours, theirs) = guest_spawn::pipes()?;
        let InitEnds {
            err_w,
            go_r,
            status_w,
        } = theirs;
        match self.ask(KIND_GUEST, s, Some(ns), vec![err_w, go_r, status_w]) {
            Err(Asked::NotSent) => spawn_guest_from(s, ns, false),
            Err(Asked::Failed(e)) => Err(e),
            Ok(init) => guest_spawn::finish(init, ours),
        }
    }

    /// Sends the request, `ends` (the pipes' ends the new process keeps) attached after the
    /// program's descriptors, closes our copies of `ends`, and returns the PID the spawner
    /// made (the program, or its init) as soon as it is cloned: its start is waited for here,
    /// not in the spawner, which is free for the next request meanwhile.
    fn ask(
        &self,
        kind: u8,
        s: &Spawn,
        ns: Option<&OwnNamespaces>,
        ends: Vec<OwnedFd>,
    ) -> Result<i32, Asked> {
        let lost = |e: SysError| Asked::Failed(SpawnError::before(Step::Fork, e.errno));
        let payload = encode(kind, s, ns);
        let mut fds = s.stdio.to_vec();
        fds.extend(s.mount_ns);
        fds.extend(s.user_ns);
        fds.extend(ns.and_then(|n| n.net_ns));
        fds.extend(ends.iter().map(|f| f.as_raw_fd()));
        let sock = self.sock.lock().unwrap_or_else(|p| p.into_inner());
        let fd = sock.as_raw_fd();
        let mut head = [0u8; 8];
        head[..4].copy_from_slice(&(payload.len() as u32).to_ne_bytes());
        head[4..].copy_from_slice(&(fds.len() as u32).to_ne_bytes());
        // Nothing is made before the whole request is there.
        send_all(fd, &head, &fds).map_err(|_| Asked::NotSent)?;
        send_all(fd, &payload, &[]).map_err(|_| Asked::NotSent)?;
        // The new process's copies are the only ones that count from here on.
        drop(ends);
        let (reply, _) = recv_exact(fd, REPLY_LEN).map_err(lost)?;
        drop(sock);
        let int = |at: usize| {
            i32::from_ne_bytes([reply[at], reply[at + 1], reply[at + 2], reply[at + 3]])
        };
        if reply[0] == 1 {
            return Ok(int(1));
        }
        let candidate = int(14) as u32;
        Err(Asked::Failed(SpawnError {
            step: crate::spawn::step_of(reply[9]),
            errno: int(10),
            pid: int(5),
            candidate: (candidate != u32::MAX).then_some(candidate as usize),
        }))
    }
}

/// Why a request to the spawner got no answer.
enum Asked {
    /// The spawner is gone and never had the whole request: nothing was made.
    NotSent,
    /// It was asked, and this is what went wrong.
    Failed(SpawnError),
}

/// Sends all of `data`, `rights` attached to its first byte.
fn send_all(fd: RawFd, data: &[u8], rights: &[RawFd]) -> SysResult<()> {
    let mut at = 0;
    let mut rights = rights;
    while at < data.len() {
        match crate::sockets::send(fd, &data[at..], None, rights, libc::MSG_NOSIGNAL) {
            Ok(n) => {
                at += n;
                rights = &[];
            }
            Err(e) if e.errno == libc::EINTR => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads exactly `n` bytes and the descriptors that came with them.
fn recv_exact(fd: RawFd, n: usize) -> SysResult<(Vec<u8>, Vec<OwnedFd>)> {
    let mut data = Vec::with_capacity(n);
    let mut rights = Vec::new();
    while data.len() < n {
        match crate::sockets::recv(fd, n - data.len(), 0) {
            Ok(r) if r.data.is_empty() => {
                return Err(SysError {
                    op: "recvmsg (the spawner's socket closed)",
                    errno: libc::EPIPE,
                })
            }
            Ok(r) => {
                data.extend_from_slice(&r.data);
                rights.extend(r.rights);
            }
            Err(e) if e.errno == libc::EINTR => {}
            Err(e) => return Err(e),
        }
    }
    Ok((data, rights))
}

fn encode(kind: u8, s: &Spawn, ns: Option<&OwnNamespaces>) -> Vec<u8> {
    let mut b = Vec::with_capacity(4096);
    b.push(kind);
    b.push(s.search as u8);
    b.push(s.controlling_tty as u8);
    b.push(ns.is_some_and(|n| n.private_tmp) as u8);
    b.push(s.mount_ns.is_some() as u8);
    b.push(s.user_ns.is_some() as u8);
    b.push(ns.is_some_and(|n| n.net_ns.is_some()) as u8);
    for v in [s.uid, s.gid, s.umask, s.parent_death_signal as u32] {
        b.extend_from_slice(&v.to_ne_bytes());
    }
    b.extend_from_slice(&s.sig_ignored.to_ne_bytes());
    b.extend_from_slice(&s.sig_blocked.to_ne_bytes());
    b.extend_from_slice(&(s.groups.len() as u32).to_ne_bytes());
    for g in &s.groups {
        b.extend_from_slice(&g.to_ne_bytes());
    }
    b.extend_from_slice(&(s.rlimits.len() as u32).to_ne_bytes());
    for (r, cur, max) in &s.rlimits {
        b.extend_from_slice(&r.to_ne_bytes());
        b.extend_from_slice(&cur.to_ne_bytes());
        b.extend_from_slice(&max.to_ne_bytes());
    }
    let bytes = |b: &mut Vec<u8>, v: &[u8]| {
        b.extend_from_slice(&(v.len() as u32).to_ne_bytes());
        b.extend_from_slice(v);
    };
    for list in [&s.candidates, &s.argv, &s.envp] {
        b.extend_from_slice(&(list.len() as u32).to_ne_bytes());
        for c in list.iter() {
            bytes(&mut b, c.as_bytes());
        }
    }
    bytes(&mut b, s.cwd.as_bytes());
    bytes(
        &mut b,
        ns.map(|n| n.init_exe.as_os_str().as_bytes()).unwrap_or(b""),
    );
    b
}

/// Reads what [`encode`] wrote.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(a)
    }
    fn u8(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_ne_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_ne_bytes(self.take(8)?.try_into().ok()?))
    }
    fn bytes(&mut self) -> Option<Vec<u8>> {
        let n = self.u32()? as usize;
        Some(self.take(n)?.to_vec())
    }
    fn cstrings(&mut self) -> Option<Vec<CString>> {
        let n = self.u32()? as usize;
        (0..n).map(|_| CString::new(self.bytes()?).ok()).collect()
    }
}

/// A request decoded: the kind, the spawn (its descriptors those received), for a guest its
/// namespaces' settings (private tmp, the init's executable, the network namespace), and the
/// pipes' ends the new process keeps (the rest of the descriptors received).
type Request = (u8, Spawn, bool, PathBuf, Option<RawFd>, Vec<RawFd>);

fn decode(p: &[u8], fds: &[OwnedFd]) -> Option<Request> {
    let mut r = Reader(p);
    let kind = r.u8()?;
    let search = r.u8()? != 0;
    let controlling_tty = r.u8()? != 0;
    let private_tmp = r.u8()? != 0;
    let (has_mnt, has_user, has_net) = (r.u8()? != 0, r.u8()? != 0, r.u8()? != 0);
    let (uid, gid, umask, pdeath) = (r.u32()?, r.u32()?, r.u32()?, r.u32()? as i32);
    let (sig_ignored, sig_blocked) = (r.u64()?, r.u64()?);
    let groups = (0..r.u32()?).map(|_| r.u32()).collect::<Option<Vec<_>>>()?;
    let rlimits = (0..r.u32()?)
        .map(|_| Some((r.u32()?, r.u64()?, r.u64()?)))
        .collect::<Option<Vec<_>>>()?;
    let candidates = r.cstrings()?;
    let argv = r.cstrings()?;
    let envp = r.cstrings()?;
    let cwd = CString::new(r.bytes()?).ok()?;
    let exe = PathBuf::from(std::ffi::OsStr::from_bytes(&r.bytes()?));
    let mut fd = fds.iter().map(|f| f.as_raw_fd());
    let stdio = [fd.next()?, fd.next()?, fd.next()?];
    let mount_ns = if has_mnt { Some(fd.next()?) } else { None };
    let user_ns = if has_user { Some(fd.next()?) } else { None };
    let net_ns = if has_net { Some(fd.next()?) } else { None };
    let ends: Vec<RawFd> = fd.collect();
    let s = Spawn {
        candidates,
        search,
        argv,
        envp,
        cwd,
        uid,
        gid,
        groups,
        umask,
        rlimits,
        stdio,
        controlling_tty,
        sig_ignored,
        sig_blocked,
        parent_death_signal: pdeath,
        mount_ns,
        user_ns,
    };
    Some((kind, s, private_tmp, exe, net_ns, ends))
}

/// The spawner's life: answers requests until the daemon closes its end. Never returns.
fn serve(sock: OwnedFd, parent: i32) -> ! {
    // SAFETY: plain integer arguments; the name is a NUL-terminated static string.
    unsafe {
        libc::prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGKILL as libc::c_ulong,
            0,
            0,
            0,
        );
        if libc::getppid() != parent {
            libc::_exit(0);
        }
        libc::prctl(libc::PR_SET_NAME, c"ferry-spawner".as_ptr(), 0, 0, 0);
    }
    // Nothing of the daemon's but the socket and stdio (its log).
    // SAFETY: dup3 of a descriptor we own onto 3, then closing everything above it.
    let fd = unsafe {
        let fd = sock.as_raw_fd();
        if fd != 3 && libc::dup3(fd, 3, libc::O_CLOEXEC) < 0 {
            libc::_exit(1);
        }
        libc::syscall(libc::SYS_close_range, 4u32, u32::MAX, 0u32);
        3
    };
    std::mem::forget(sock);
    loop {
        let Ok((head, rights)) = recv_exact(fd, 8) else {
            // SAFETY: _exit ends this process at once.
            unsafe { libc::_exit(0) };
        };
        let len = u32::from_ne_bytes([head[0], head[1], head[2], head[3]]) as usize;
        let Ok((payload, _)) = recv_exact(fd, len) else {
            // SAFETY: as above.
            unsafe { libc::_exit(0) };
        };
        let mut reply = [0u8; REPLY_LEN];
        let put = |r: &mut [u8; REPLY_LEN], at: usize, v: i32| {
            r[at..at + 4].copy_from_slice(&v.to_ne_bytes())
        };
        let result = match decode(&payload, &rights) {
            None => Err(SpawnError::before(Step::Fork, libc::EPROTO)),
            Some((KIND_GUEST, s, private_tmp, exe, net_ns, ends)) => match ends[..] {
                [err_w, go_r, status_w] => {
                    let ns = OwnNamespaces {
                        private_tmp,
                        init_exe: &exe,
                        net_ns,
                    };
                    guest_spawn::start_init(&s, &ns, true, [err_w, go_r, status_w])
                }
                _ => Err(SpawnError::before(Step::Fork, libc::EPROTO)),
            },
            Some((_, s, .., ends)) => match ends[..] {
                [err_w] => crate::spawn::start(&s, true, err_w),
                _ => Err(SpawnError::before(Step::Fork, libc::EPROTO)),
            },
        };
        drop(rights);
        match result {
            Ok(pid) => {
                put(&mut reply, 1, pid);
                reply[0] = 1;
            }
            Err(e) => {
                put(&mut reply, 5, e.pid);
                put(&mut reply, 10, e.errno);
                put(
                    &mut reply,
                    14,
                    e.candidate.map_or(u32::MAX, |c| c as u32) as i32,
                );
                reply[9] = e.step.code();
            }
        }
        if send_all(fd, &reply, &[]).is_err() {
            // SAFETY: _exit ends this process at once.
            unsafe { libc::_exit(0) };
        }
    }
}
