//! UNIX sockets (stream, datagram, seqpacket): their capture (names, peers, queues, the
//! connections waiting in listeners' queues, which [`requeue`] accepts and makes again), and
//! their rebuild (pairs, names, listeners, abstract names taken late: [`DeferredName`]).

use super::*;

/// SO_PEERCRED and SO_PEERGROUPS of a UNIX socket, when it has them.
pub(super) fn peer_cred(s: RawFd) -> Option<PeerCred> {
    let b = sk::getsockopt(s, SOL_SOCKET, libc::SO_PEERCRED, 12).ok()?;
    if b.len() < 12 {
        return None;
    }
    let word = |at: usize| u32::from_ne_bytes(b[at..at + 4].try_into().expect("4 bytes"));
    let pid = word(0) as i32;
    if pid <= 0 {
        return None;
    }
    let groups = sk::getsockopt(s, SOL_SOCKET, libc::SO_PEERGROUPS, 1 << 16)
        .map(|g| {
            g.chunks_exact(4)
                .map(|c| u32::from_ne_bytes(c.try_into().expect("4 bytes")))
                .collect()
        })
        .unwrap_or_default();
    Some(PeerCred {
        pid,
        uid: word(4),
        gid: word(8),
        groups,
    })
}

impl Cap<'_> {
    /// The file a UNIX socket bound to `path` made, looked up as the process sees the path.
    pub(super) fn socket_file(&self, path: &[u8], vfs: Option<(u32, u32)>) -> Result<SocketFile> {
        let rel = path.first() != Some(&b'/');
        let (dir, full) = if rel {
            let cwd = procfs::readlink(self.pid, "cwd")?;
            let full =
                PathBuf::from(format!("/proc/{}/cwd", self.pid)).join(OsStr::from_bytes(path));
            (Some(cwd), full)
        } else {
            let full = PathBuf::from(format!("/proc/{}/root", self.pid))
                .join(OsStr::from_bytes(&path[1..]));
            (None, full)
        };
        let md = std::fs::metadata(&full).ok().filter(|m| {
            m.file_type().is_socket()
                && vfs.is_some_and(|(ino, dev)| m.ino() as u32 == ino && same_dev(dev, m.dev()))
        });
        Ok(match md {
            Some(m) => SocketFile {
                dir,
                deleted: false,
                mode: m.mode() & 0o7777,
                uid: m.uid(),
                gid: m.gid(),
            },
            None => SocketFile {
                dir,
                deleted: true,
                mode: 0o755,
                uid: 0,
                gid: 0,
            },
        })
    }

    pub(super) fn unix(&self, ty: SockType) -> Result<SocketDesc> {
        let d = sk::unix_diag(Some(self.ino as u32), sk::UDIAG_SHOW_ALL)
            .ctx(self.pid, || self.what("ask sock_diag about the state"))?
            .into_iter()
            .next()
            .ok_or_else(|| {
                self.refuse("sock_diag does not know this UNIX socket (another network namespace?)")
            })?;
        let mut desc = SocketDesc {
            ino: self.ino,
            family: SockFamily::Unix,
            sock_type: ty,
            local: self.name(false)?,
            shutdown: Shutdown {
                read: d.shutdown & RCV_SHUTDOWN != 0,
                write: d.shutdown & SEND_SHUTDOWN != 0,
            },
            peer_cred: peer_cred(self.s),
            opts: capture_opts(self.s, &[UNIX_OPTS]),
            ..Default::default()
        };
        if let Some(SockAddr::UnixPath(p)) = &desc.local {
            desc.path_file = Some(self.socket_file(p, d.vfs)?);
        }
        if d.state == TCP_LISTEN {
            desc.state = SockState::Listening {
                backlog: d.rqlen.map(|r| r.1).unwrap_or(0),
                pending: d
                    .icons
                    .iter()
                    .map(|&c| PendingConn {
                        client_ino: u64::from(c),
                        ..Default::default()
                    })
                    .collect(),
            };
            return Ok(desc);
        }
        if let Some(peer) = d.peer {
            desc.state = SockState::Connected {
                peer_ino: u64::from(peer),
            };
            desc.peer = self.name(true)?;
        }
        let queued = d.rqlen.map(|r| r.0).unwrap_or(0) as usize;
        let ev = sk::poll_now(self.s, libc::POLLIN).ctx(self.pid, || self.what("poll"))?;
        if ev & libc::POLLERR != 0 {
            // The pending error would be consumed by reading; for stream sockets it is the
            // peer's reset, which the queue can be read around.
            if ty != SockType::Stream && queued > 0 {
                return Err(self.refuse(
                    "it has a pending error (its peer was reset), which reading its queued \
                     messages would clear",
                ));
            }
            desc.error = libc::ECONNRESET;
        }
        desc.queue = match ty {
            SockType::Stream if queued > 0 => self.peek_stream(queued)?,
            SockType::Stream => Vec::new(),
            SockType::Seqpacket if queued == 0 => Vec::new(),
            _ if ev & libc::POLLIN == 0 => Vec::new(),
            _ => self.peek_messages(
                if ty == SockType::Seqpacket {
                    Some(queued)
                } else {
                    None
                },
                desc.shutdown.read,
                ty == SockType::Dgram,
            )?,
        };
        Ok(desc)
    }
}

/// Who holds a socket outside the tree, for error messages: "held by PID 42 (sshd)".
pub(super) fn outside_holders(ino: u64, tree_pids: &HashSet<i32>) -> String {
    let needle = format!("socket:[{ino}]");
    let mut found = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                continue;
            };
            if tree_pids.contains(&pid) {
                continue;
            }
            let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
                continue;
            };
            if fds.flatten().any(|f| {
                std::fs::read_link(f.path()).is_ok_and(|l| l.as_os_str() == needle.as_str())
            }) {
                let comm = procfs::read(pid, "comm").unwrap_or_default();
                found.push(format!("PID {pid} ({})", comm.trim()));
                if found.len() >= 3 {
                    break;
                }
            }
        }
    }
    if found.is_empty() {
        String::new()
    } else {
        format!(", held by {}", found.join(", "))
    }
}

/// A UNIX socket for people, by inode: "socket:[123] (/run/x.sock, held by PID 42 (sshd))".
pub(super) fn describe_unix_ino(ino: u64, tree_pids: &HashSet<i32>) -> String {
    let name = sk::unix_diag(Some(ino as u32), sk::UDIAG_SHOW_NAME)
        .ok()
        .and_then(|v| v.into_iter().next())
        .and_then(|d| d.name)
        .map(|n| {
            let mut raw = (libc::AF_UNIX as u16).to_ne_bytes().to_vec();
            raw.extend_from_slice(&n);
            decode_addr(&raw).map(|a| describe(&a)).unwrap_or_default()
        })
        .unwrap_or_else(|| "unnamed".into());
    format!("socket:[{ino}] ({name}{})", outside_holders(ino, tree_pids))
}

/// Accepts every connection waiting in listener `tree.files[li]` from a copy of it, records
/// what each carries, and makes the connections again in the running tree (see the module
/// documentation).
pub(super) fn requeue(
    frozen: &FrozenTree,
    tree: &mut Tree,
    holders: &HashMap<u32, Vec<(i32, i32, bool)>>,
    by_ino: &HashMap<u64, usize>,
    li: usize,
) -> Result<()> {
    let lfile = tree.files[li].clone();
    let FileKind::Socket(l) = &lfile.kind else {
        return Ok(());
    };
    let SockState::Listening { pending, .. } = &l.state else {
        return Ok(());
    };
    let (lpid, lfd, _) = holders
        .get(&lfile.id)
        .and_then(|h| h.first().copied())
        .unwrap_or((tree.root_pid, -1, false));
    let refuse = |why: String| Error::Unsupported {
        pid: lpid,
        what: format!("fd {lfd} (socket:[{}])", l.ino),
        why,
    };
    let name = match (&l.local, &l.path_file) {
        (Some(SockAddr::UnixPath(_)), Some(f)) if f.deleted => None,
        (Some(SockAddr::UnixPath(p)), Some(f)) => Some(match &f.dir {
            Some(d) => {
                let mut full = d.as_bytes().to_vec();
                full.push(b'/');
                full.extend_from_slice(p);
                SockAddr::UnixPath(full)
            }
            None => SockAddr::UnixPath(p.clone()),
        }),
        (Some(a @ SockAddr::UnixAbstract(_)), _) => Some(a.clone()),
        _ => None,
    };
    let Some(name) = name else {
        return Err(refuse(
            "connections that already carry data wait in its queue, and its name can no longer \
             be connected to (the socket file was removed)"
                .into(),
        ));
    };
    let addr = encode_addr(&name);
    // Everything that could stop us is checked before the queue is touched.
    let tree_pids: HashSet<i32> = tree.processes.iter().map(|p| p.pid).collect();
    let epoll_targets = epoll_watched_inodes(tree);
    for c in pending.iter().filter(|c| c.client_ino != 0) {
        let Some(ci) = by_ino.get(&c.client_ino) else {
            continue;
        };
        let FileKind::Socket(cs) = &tree.files[*ci].kind else {
            continue;
        };
        if cs.local.is_some() {
            return Err(refuse(format!(
                "client socket:[{}] waiting in its queue already sent data and is bound to a \
                 name; such a connection cannot be captured yet",
                c.client_ino
            )));
        }
        if epoll_targets.contains(&c.client_ino) {
            return Err(refuse(format!(
                "client socket:[{}] waiting in its queue already sent data and is watched by an \
                 epoll instance; such a connection cannot be captured yet",
                c.client_ino
            )));
        }
        let outside = outside_holders(c.client_ino, &tree_pids);
        if !outside.is_empty() {
            return Err(refuse(format!(
                "client socket:[{}] waiting in its queue is also{}, outside the tree",
                c.client_ino,
                outside.trim_start_matches(',')
            )));
        }
    }
    for c in pending.iter().filter(|c| c.client_ino != 0) {
        if let Some(f) = by_ino.get(&c.client_ino).map(|i| &tree.files[*i]) {
            for (pid, _, _) in holders.get(&f.id).map(|h| h.as_slice()).unwrap_or(&[]) {
                ferry_inject::find_syscall_insn(*pid)?;
            }
        }
    }
    let pidfd = pidfd::pidfd_open(lpid).ctx(lpid, || "open a pidfd".into())?;
    let lcopy = pidfd::pidfd_getfd(&pidfd, lfd)
        .ctx(lpid, || format!("take a copy of listening fd {lfd}"))?;
    // Accept them all, in queue order: from here on the connections must be made again.
    let mut accepted = Vec::new();
    for c in pending {
        let e = sk::accept(lcopy.as_raw_fd(), libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC)
            .ctx(lpid, || format!("accept a waiting connection on fd {lfd}"))?;
        let mut data: Vec<(Vec<u8>, Vec<OwnedFd>)> = Vec::new();
        loop {
            match sk::recv(e.as_raw_fd(), PEEK_CHUNK, libc::MSG_DONTWAIT) {
                Ok(m) if m.data.is_empty() && m.rights.is_empty() => break,
                Ok(m) => data.push((m.data, m.rights)),
                Err(_) => break,
            }
        }
        let cred = peer_cred(e.as_raw_fd());
        accepted.push((c.client_ino, e, data, cred));
    }
    let ty = match l.sock_type {
        SockType::Seqpacket => libc::SOCK_SEQPACKET,
        _ => libc::SOCK_STREAM,
    };
    let mut rights_seen = 0;
    let mut new_pending = Vec::new();
    let mut chan: Option<Channel> = None;
    for (client_ino, _server_end, data, cred) in &accepted {
        rights_seen += data.iter().map(|d| d.1.len()).sum::<usize>();
        new_pending.push(PendingConn {
            client_ino: *client_ino,
            queue: data
                .iter()
                .map(|(d, _)| SockMsg {
                    data: d.clone(),
                    ..Default::default()
                })
                .collect(),
            cred: cred.clone(),
        });
        if *client_ino == 0 {
            // The client is gone: a throwaway one says the same and goes.
            let c = sk::socket(libc::AF_UNIX, ty | NEW, 0).ctx(lpid, || "make a socket".into())?;
            sk::connect(c.as_raw_fd(), &addr)
                .ctx(lpid, || format!("connect to listening fd {lfd} again"))?;
            write_all(lpid, c.as_raw_fd(), data, ty == libc::SOCK_SEQPACKET)?;
            continue;
        }
        let ci = by_ino[client_ino];
        let cfile = &tree.files[ci];
        let FileKind::Socket(cs) = &cfile.kind else {
            continue;
        };
        let hs = holders.get(&cfile.id).cloned().unwrap_or_default();
        let Some(&(hpid, _, _)) = hs.first() else {
            continue;
        };
        let inj = injector(frozen, hpid)?;
        let r = (|| -> Result<()> {
            // The new client is made by a process of the tree, which the server end records.
            // Non-blocking: the queue has room, but an injected call must never wait.
            let t = inj.syscall(
                "socket",
                libc::SYS_socket,
                &[libc::AF_UNIX as u64, (ty | NEW) as u64, 0],
            )?;
            let a = inj.write_scratch(0, &addr)?;
            inj.syscall("connect", libc::SYS_connect, &[t, a, addr.len() as u64])?;
            let p = pidfd::pidfd_open(hpid).ctx(hpid, || "open a pidfd".into())?;
            let c2 = pidfd::pidfd_getfd(&p, t as i32)
                .ctx(hpid, || "take a copy of the new client socket".into())?;
            write_all(hpid, c2.as_raw_fd(), data, ty == libc::SOCK_SEQPACKET)?;
            apply_opts(c2.as_raw_fd(), &cs.opts, true);
            let mask = libc::O_NONBLOCK | libc::O_ASYNC;
            let fl = fdops::get_fl(c2.as_raw_fd()).ctx(hpid, || "read file flags".into())?;
            fdops::set_fl(c2.as_raw_fd(), (fl & !mask) | (cfile.flags & mask))
                .ctx(hpid, || "set file flags".into())?;
            apply_shutdown(c2.as_raw_fd(), &cs.shutdown);
            for &(pid, fd, cloexec) in &hs {
                let flags = if cloexec { libc::O_CLOEXEC as u64 } else { 0 };
                if pid == hpid {
                    inj.syscall("dup3", libc::SYS_dup3, &[t, fd as u64, flags])?;
                } else {
                    if chan.is_none() {
                        chan = Some(Channel::new(lpid)?);
                    }
                    let ch = chan.as_ref().expect("made above");
                    ch.install(frozen, pid, &c2, fd, flags)?;
                }
            }
            inj.syscall("close", libc::SYS_close, &[t])?;
            Ok(())
        })();
        inj.finish()?;
        r?;
    }
    drop(accepted);
    if let FileKind::Socket(s) = &mut tree.files[li].kind {
        if let SockState::Listening { pending, .. } = &mut s.state {
            for (p, n) in pending.iter_mut().zip(new_pending) {
                p.queue = n.queue;
                if n.cred.is_some() {
                    p.cred = n.cred;
                }
            }
        }
    }
    if rights_seen > 0 {
        return Err(refuse(format!(
            "{rights_seen} file descriptor(s) are in flight (SCM_RIGHTS) in connections waiting \
             in its queue, which cannot be checkpointed yet"
        )));
    }
    Ok(())
}

/// Writes captured messages (with the descriptors that came with them) into a socket.
pub(super) fn write_all(
    pid: i32,
    s: RawFd,
    data: &[(Vec<u8>, Vec<OwnedFd>)],
    records: bool,
) -> Result<()> {
    let total: usize = data.iter().map(|d| d.0.len()).sum();
    bump_sndbuf(s, total);
    for (d, rights) in data {
        let fds: Vec<RawFd> = rights.iter().map(|f| f.as_raw_fd()).collect();
        let mut at = 0;
        loop {
            let n = sk::send(
                s,
                &d[at..],
                None,
                if at == 0 { &fds } else { &[] },
                libc::MSG_DONTWAIT,
            )
            .ctx(pid, || "send queued data again".into())?;
            at += n;
            if at >= d.len() || records {
                break;
            }
        }
    }
    Ok(())
}

/// An injector on a frozen process's first thread.
pub(super) fn injector(frozen: &FrozenTree, pid: i32) -> Result<ferry_inject::Injector> {
    let fp = frozen
        .procs
        .iter()
        .find(|p| p.pid == pid)
        .ok_or(Error::NoSuchProcess { pid })?;
    let t = fp.threads.first().ok_or(Error::NoSuchProcess { pid })?;
    let at = ferry_inject::find_syscall_insn(pid)?;
    Ok(ferry_inject::Injector::on_stack(pid, t.tid, t.regs, at)?)
}

/// Inodes of the sockets that an epoll instance of the tree watches.
pub(super) fn epoll_watched_inodes(tree: &Tree) -> HashSet<u64> {
    let mut out = HashSet::new();
    for p in &tree.processes {
        for f in &p.fds {
            if procfs::readlink(p.pid, &format!("fd/{}", f.fd))
                .ok()
                .as_deref()
                != Some("anon_inode:[eventpoll]")
            {
                continue;
            }
            let Ok(text) = procfs::read(p.pid, &format!("fdinfo/{}", f.fd)) else {
                continue;
            };
            for word in text.split_whitespace() {
                if let Some(h) = word.strip_prefix("ino:") {
                    if let Ok(ino) = u64::from_str_radix(h, 16) {
                        out.insert(ino);
                    }
                }
            }
        }
    }
    out
}

/// Hands descriptors of ours to frozen processes whatever their credentials: each connects to
/// an abstract socket of ours and receives the descriptor with SCM_RIGHTS.
pub(super) struct Channel {
    pub(super) listener: OwnedFd,
    pub(super) addr: Vec<u8>,
}

impl Channel {
    pub(super) fn new(pid: i32) -> Result<Channel> {
        let listener = sk::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0)
            .ctx(pid, || "make a socket".into())?;
        let name = format!("ferry-{}-{:p}", std::process::id(), &listener);
        let addr = encode_addr(&SockAddr::UnixAbstract(name.into_bytes()));
        sk::bind(listener.as_raw_fd(), &addr).ctx(pid, || "bind a socket".into())?;
        sk::listen(listener.as_raw_fd(), 8).ctx(pid, || "listen".into())?;
        Ok(Channel { listener, addr })
    }

    /// Installs `what` in frozen process `pid` as descriptor `fd` (with dup3 `flags`).
    pub(super) fn install(
        &self,
        frozen: &FrozenTree,
        pid: i32,
        what: &OwnedFd,
        fd: i32,
        flags: u64,
    ) -> Result<()> {
        let inj = injector(frozen, pid)?;
        let r = (|| -> Result<()> {
            let s = inj.syscall(
                "socket",
                libc::SYS_socket,
                &[
                    libc::AF_UNIX as u64,
                    (libc::SOCK_STREAM | libc::SOCK_CLOEXEC) as u64,
                    0,
                ],
            )?;
            let a = inj.write_scratch(0, &self.addr)?;
            inj.syscall(
                "connect",
                libc::SYS_connect,
                &[s, a, self.addr.len() as u64],
            )?;
            let conn = sk::accept(self.listener.as_raw_fd(), libc::SOCK_CLOEXEC)
                .ctx(pid, || "accept on the hand-over socket".into())?;
            sk::send(conn.as_raw_fd(), &[0], None, &[what.as_raw_fd()], 0)
                .ctx(pid, || "hand a descriptor over".into())?;
            // struct msghdr at 256, its iovec at 320, one data byte at 352, control at 384.
            let base = inj.scratch(0);
            let mut msg = Vec::new();
            for w in [0u64, 0, base + 320, 1, base + 384, 64, 0] {
                msg.extend_from_slice(&w.to_ne_bytes());
            }
            inj.write_scratch(256, &msg)?;
            let mut iov = Vec::new();
            for w in [base + 352, 1u64] {
                iov.extend_from_slice(&w.to_ne_bytes());
            }
            inj.write_scratch(320, &iov)?;
            inj.write_scratch(384, &[0u8; 64])?;
            inj.syscall(
                "recvmsg",
                libc::SYS_recvmsg,
                &[s, base + 256, libc::MSG_CMSG_CLOEXEC as u64],
            )?;
            let c = inj.read_scratch(384, 24)?;
            let level = i32::from_ne_bytes(c[8..12].try_into().expect("4 bytes"));
            let ty = i32::from_ne_bytes(c[12..16].try_into().expect("4 bytes"));
            if level != libc::SOL_SOCKET || ty != libc::SCM_RIGHTS {
                return Err(Error::Restore {
                    pid,
                    what: "no descriptor arrived over the hand-over socket".into(),
                });
            }
            let got = u64::from(u32::from_ne_bytes(c[16..20].try_into().expect("4 bytes")));
            inj.syscall("dup3", libc::SYS_dup3, &[got, fd as u64, flags])?;
            inj.syscall("close", libc::SYS_close, &[got])?;
            inj.syscall("close", libc::SYS_close, &[s])?;
            Ok(())
        })();
        inj.finish()?;
        r
    }
}

/// A UNIX stream or seqpacket socket whose abstract name another socket held while the tree
/// was rebuilt (on one machine, the frozen original of a migration, until the commit point:
/// abstract names belong to the network namespace). bind() and listen() are made by process
/// `pid` itself through its descriptor `fd`, injected at resume ([`crate::late`]), so that
/// SO_PEERCRED reports that process to whoever connects, as it did; each waiting connection
/// is made by the process that made it (its credentials are what the server end reports), and
/// refilled with what it had sent.
pub(super) struct DeferredName {
    pub(super) pid: i32,
    pub(super) fd: i32,
    pub(super) addr: Vec<u8>,
    pub(super) backlog: Option<i32>,
    pub(super) clients: Vec<DeferredClient>,
    pub(super) what: String,
}

pub(super) struct DeferredClient {
    pub(super) pid: i32,
    pub(super) fd: i32,
    /// A copy of the client socket, to refill what it had sent.
    pub(super) socket: OwnedFd,
    pub(super) data: Vec<Vec<u8>>,
    pub(super) records: bool,
}

impl DeferredName {
    pub(super) fn make(
        &self,
        hosts: &HashMap<i32, i32>,
        deadline: std::time::Instant,
        wait: std::time::Duration,
    ) -> Result<()> {
        let host = |pid: i32| {
            hosts.get(&pid).copied().ok_or_else(|| Error::Restore {
                pid,
                what: format!("{}: the process is not in the rebuilt tree", self.what),
            })
        };
        let addr_len = self.addr.len() as u64;
        crate::late::with_injector(self.pid, host(self.pid)?, &self.what, |inj| {
            let addr = inj.write_scratch(0, &self.addr)?;
            loop {
                let r =
                    inj.syscall_raw("bind", libc::SYS_bind, &[self.fd as u64, addr, addr_len])?;
                if r == 0 {
                    break;
                }
                if r == -(libc::EADDRINUSE as i64) && std::time::Instant::now() < deadline {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                    continue;
                }
                return Err(Error::Restore {
                    pid: self.pid,
                    what: format!(
                        "{}: bind: {}{}",
                        self.what,
                        std::io::Error::from_raw_os_error(-r as i32),
                        if r == -(libc::EADDRINUSE as i64) {
                            format!(" after {wait:?} (the original of the tree, if it still runs?)")
                        } else {
                            String::new()
                        }
                    ),
                });
            }
            if let Some(backlog) = self.backlog {
                inj.syscall(
                    "listen",
                    libc::SYS_listen,
                    &[self.fd as u64, backlog as u64],
                )?;
            }
            Ok(())
        })?;
        for c in &self.clients {
            let what = format!(
                "{}: connect a waiting client (PID {} fd {})",
                self.what, c.pid, c.fd
            );
            crate::late::with_injector(c.pid, host(c.pid)?, &what, |inj| {
                let addr = inj.write_scratch(0, &self.addr)?;
                inj.syscall("connect", libc::SYS_connect, &[c.fd as u64, addr, addr_len])?;
                Ok(())
            })?;
            let data: Vec<(Vec<u8>, Vec<OwnedFd>)> =
                c.data.iter().map(|d| (d.clone(), Vec::new())).collect();
            write_all(c.pid, c.socket.as_raw_fd(), &data, c.records)?;
        }
        Ok(())
    }
}

impl<'a> Builder<'a> {
    /// The path a UNIX socket name refers to, from the socket's directory when relative.
    pub(super) fn full_path(p: &[u8], file: Option<&SocketFile>) -> PathBuf {
        match file.and_then(|f| f.dir.as_ref()) {
            Some(d) if p.first() != Some(&b'/') => Path::new(d).join(OsStr::from_bytes(p)),
            _ => PathBuf::from(OsStr::from_bytes(p)),
        }
    }

    /// Binds `fd` to UNIX name `a` (its file described by `file`), clearing a stale socket
    /// file first. `i` names the socket in messages.
    pub(super) fn bind_unix(
        &mut self,
        i: usize,
        fd: RawFd,
        a: &SockAddr,
        file: Option<&SocketFile>,
    ) -> Result<()> {
        let raw = encode_addr(a);
        let SockAddr::UnixPath(p) = a else {
            let r = sk::bind(fd, &raw);
            if r.as_ref().is_err_and(|e| e.errno == libc::EADDRINUSE)
                && matches!(a, SockAddr::UnixAbstract(_))
                && self.can_name_late(i)
            {
                self.late_names.insert(i);
                return Ok(());
            }
            return r.map_err(|e| {
                if e.errno == libc::EADDRINUSE && matches!(a, SockAddr::UnixAbstract(_)) {
                    // Abstract names belong to the network namespace, which the nodes of one
                    // machine share: the frozen original of a migration holds the name until
                    // the commit point. Binding later would be easy; but a listener's waiting
                    // connections are made through its name now, and listen() and connect()
                    // must be called by the processes whose PIDs SO_PEERCRED reports, which
                    // exist only in the rebuilt tree by then.
                    self.err(
                        i,
                        format!(
                            "bind to the abstract name {}: {e}: another socket holds it (the \
                             original of the tree, frozen on this machine until the commit point \
                             of a migration, or still running?), and it cannot get it when the \
                             tree is about to run instead: {}",
                            describe(a),
                            self.late_name_refusal(i).unwrap_or_default()
                        ),
                    )
                } else {
                    self.err(i, format!("bind to {}: {e}", describe(a)))
                }
            });
        };
        let full = Self::full_path(p, file);
        self.clear_stale(i, &full)?;
        // The socket's file is made (and its mode and owner set) with the rights of the
        // process holding the socket, never root's: its path is the process owner's to change,
        // and a link they put on it leads only where they could go themselves.
        let creds = self.creds(i);
        let dir = file
            .and_then(|f| f.dir.as_deref())
            .filter(|_| p.first() != Some(&b'/'));
        let attrs = file.filter(|f| !f.deleted).map(|f| (f.mode, f.uid, f.gid));
        let made = with_fs_creds(&creds, || -> std::result::Result<(), String> {
            if let Some(d) = dir {
                // A relative name is bound from its directory: this thread's own cwd.
                ferry_sys::fsid::own_cwd(d).map_err(|e| format!("chdir to {d}: {e}"))?;
            }
            sk::bind(fd, &raw).map_err(|e| format!("bind to {}: {e}", full.display()))?;
            if let Some((mode, uid, gid)) = attrs {
                let _ = std::fs::set_permissions(&full, std::fs::Permissions::from_mode(mode));
                let _ = std::os::unix::fs::chown(&full, Some(uid), Some(gid));
            }
            Ok(())
        });
        match made {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(self.err(i, format!("{e} (as {creds})"))),
            Err(e) => return Err(self.err(i, format!("take the rights of {creds}: {e}"))),
        }
        if attrs.is_none() {
            self.remove_later.push((full, creds));
        }
        Ok(())
    }

    /// Removes a socket file left at `path` by a socket that no longer exists.
    /// Looked at and removed with the rights of the process holding socket `i`.
    pub(super) fn clear_stale(&mut self, i: usize, path: &Path) -> Result<()> {
        let creds = self.creds(i);
        let Ok(Ok(md)) = with_fs_creds(&creds, || std::fs::symlink_metadata(path)) else {
            return Ok(());
        };
        if !md.file_type().is_socket() {
            return Err(self.err(i, format!("{} exists and is not a socket", path.display())));
        }
        if let Some(k) = self.remove_later.iter().position(|(p, _)| p == path) {
            // The file of one of ours that was to go anyway.
            let (_, c) = self.remove_later.remove(k);
            let _ = with_fs_creds(&c, || std::fs::remove_file(path));
            return Ok(());
        }
        // Connected stream sockets (accepted ones) refer to their listener's file without
        // owning the name; ours are made from the image.
        let ours: HashSet<u64> = self
            .fds
            .iter()
            .flatten()
            .chain(self.phantoms.iter().map(|(_, f)| f))
            .filter_map(|f| std::fs::metadata(format!("/proc/self/fd/{}", f.as_raw_fd())).ok())
            .map(|m| m.ino())
            .collect();
        let live = sk::unix_diag(None, sk::UDIAG_SHOW_VFS)
            .map_err(|e| self.err(i, format!("ask sock_diag about bound sockets: {e}")))?
            .iter()
            .any(|d| {
                d.vfs
                    .is_some_and(|(ino, dev)| md.ino() as u32 == ino && same_dev(dev, md.dev()))
                    && !ours.contains(&u64::from(d.ino))
                    && (d.sock_type == libc::SOCK_DGRAM as u8 || d.state != TCP_ESTABLISHED)
            });
        if live {
            return Err(self.err(
                i,
                format!("{} is in use by a running socket", path.display()),
            ));
        }
        let removed = with_fs_creds(&creds, || std::fs::remove_file(path))
            .map_err(|e| e.io())
            .and_then(|r| r);
        removed.map_err(|e| {
            self.err(
                i,
                format!(
                    "remove stale socket file {} (as {creds}): {e}",
                    path.display()
                ),
            )
        })
    }

    /// Connections both ends of which are made here: pairs within the tree, and sockets whose
    /// peer has been closed (with a stand-in peer, closed at the end).
    pub(super) fn pairs(&mut self) -> Result<()> {
        let mut taken: HashSet<usize> = HashSet::new();
        let mut plain: Vec<(usize, End)> = Vec::new();
        let mut named: Vec<(End, End)> = Vec::new();
        for i in 0..self.socks.len() {
            let s = self.sock(i);
            if s.family != SockFamily::Unix || taken.contains(&i) {
                continue;
            }
            let SockState::Connected { peer_ino } = s.state else {
                continue;
            };
            let other = if peer_ino == 0 {
                let name = s.peer.clone().filter(|p| *p != SockAddr::UnixUnnamed);
                End::Phantom { owner: i, name }
            } else {
                let Some(j) = self.peer_of(i) else {
                    return Err(self.err(
                        i,
                        format!("its peer socket:[{peer_ino}] is not in the image"),
                    ));
                };
                if taken.contains(&j) {
                    continue;
                }
                if s.sock_type == SockType::Dgram {
                    // Only its other end can have connected a datagram socket to an unnamed
                    // one: they were made as a pair (and may have been bound since). Named
                    // ones are connected by name later.
                    let back = self.peer_of(j) == Some(i);
                    if self.sock(j).local.is_some() && !(s.local.is_none() && back) {
                        continue;
                    }
                } else if self.peer_of(j) != Some(i) {
                    return Err(self.err(i, "its peer is connected to another socket"));
                }
                taken.insert(j);
                End::Real(j)
            };
            taken.insert(i);
            let other_named = match &other {
                End::Real(j) => self.sock(*j).local.is_some(),
                End::Phantom { name, .. } => name.is_some(),
            };
            // A relayed socket's pair is unnamed: its other end is the relay's.
            if s.sock_type == SockType::Dgram || s.relayed || (s.local.is_none() && !other_named) {
                plain.push((i, other));
            } else {
                named.push((End::Real(i), other));
            }
        }
        // socketpair(2), in one helper per creator.
        type Group = (Option<PeerCred>, Vec<(usize, End)>);
        let mut by_cred: Vec<Group> = Vec::new();
        for (i, other) in plain {
            let c = self.sock(i).peer_cred.clone();
            match by_cred.iter_mut().find(|(k, _)| *k == c) {
                Some((_, v)) => v.push((i, other)),
                None => by_cred.push((c, vec![(i, other)])),
            }
        }
        for (cred, list) in by_cred {
            let ops: Vec<HelperOp> = list
                .iter()
                .map(|(i, _)| HelperOp::SocketPair {
                    ty: sock_type_raw(self.sock(*i).sock_type) | NEW,
                })
                .collect();
            let res = self.as_cred(cred.as_ref(), &ops);
            for ((i, other), r) in list.into_iter().zip(res) {
                self.check(i, "socketpair", &r)?;
                let (a, b) = r
                    .fds
                    .ok_or_else(|| self.err(i, "socketpair made nothing"))?;
                self.fds[i] = Some(a);
                match other {
                    End::Real(j) => {
                        self.fds[j] = Some(b);
                        self.made_peer.insert(i, Some(j));
                        self.made_peer.insert(j, Some(i));
                    }
                    End::Phantom { .. } => {
                        self.made_peer.insert(i, None);
                        self.phantoms.push((i, b));
                    }
                }
            }
        }
        for (a, b) in named {
            self.named_pair(a, b)?;
        }
        Ok(())
    }

    /// Makes a connected stream pair through a temporary listener bound to the name of one end,
    /// which that end (the accepted one) takes over. The connecting end records the listener's
    /// creator and the accepted end the connector, so SO_PEERCRED comes out right on both.
    pub(super) fn named_pair(&mut self, a: End, b: End) -> Result<()> {
        let name_of = |e: &End| match e {
            End::Real(i) => self.sock(*i).local.clone(),
            End::Phantom { name, .. } => name.clone(),
        };
        // y takes the listener's name; x connects.
        let (x, y) = if name_of(&b).is_some() {
            (a, b)
        } else {
            (b, a)
        };
        let i = match (&x, &y) {
            (End::Real(i), _) | (_, End::Real(i)) => *i,
            _ => {
                return Err(Error::BadImage(
                    "a connection between two closed sockets".into(),
                ))
            }
        };
        let name = name_of(&y).ok_or_else(|| self.err(i, "a named pair has no name"))?;
        let ty = sock_type_raw(self.sock(i).sock_type) | NEW;
        let cred = |e: &End| match e {
            End::Real(k) => self.sock(*k).peer_cred.clone(),
            End::Phantom { .. } => None,
        };
        let (listen_cred, connect_cred) = (cred(&x), cred(&y));
        let xfd = sk::socket(libc::AF_UNIX, ty, 0).map_err(|e| self.err(i, e))?;
        if let End::Real(k) = x {
            if let Some(own) = self.sock(k).local.clone() {
                let file = self.sock(k).path_file.clone();
                self.bind_unix(k, xfd.as_raw_fd(), &own, file.as_ref())?;
                self.bound.insert(k);
            }
        }
        let t = sk::socket(libc::AF_UNIX, ty, 0).map_err(|e| self.err(i, e))?;
        let file = match &y {
            End::Real(k) => self.sock(*k).path_file.clone(),
            End::Phantom { .. } => None,
        }
        .unwrap_or(SocketFile {
            deleted: true,
            ..Default::default()
        });
        self.bind_unix(i, t.as_raw_fd(), &name, Some(&file))?;
        let raw = match &name {
            SockAddr::UnixPath(p) => encode_addr(&SockAddr::UnixPath(
                Self::full_path(p, Some(&file)).into_os_string().into_vec(),
            )),
            other => encode_addr(other),
        };
        let (tfd, xraw) = (t.as_raw_fd(), xfd.as_raw_fd());
        let listen = HelperOp::Listen {
            fd: tfd,
            backlog: 1,
        };
        let connect = HelperOp::Connect {
            fd: xraw,
            addr: &raw,
        };
        if listen_cred == connect_cred {
            let r = self.as_cred(listen_cred.as_ref(), &[listen, connect]);
            self.check(i, "listen", &r[0])?;
            self.check(i, &format!("connect to {}", describe(&name)), &r[1])?;
        } else {
            let r = self.as_cred(listen_cred.as_ref(), &[listen]);
            self.check(i, "listen", &r[0])?;
            let r = self.as_cred(connect_cred.as_ref(), &[connect]);
            self.check(i, &format!("connect to {}", describe(&name)), &r[0])?;
        }
        let yfd = sk::accept(tfd, NEW).map_err(|e| self.err(i, format!("accept: {e}")))?;
        drop(t);
        let real = |e: &End| match e {
            End::Real(k) => Some(*k),
            End::Phantom { .. } => None,
        };
        let (xr, yr) = (real(&x), real(&y));
        for (end, fd) in [(&x, xfd), (&y, yfd)] {
            match end {
                End::Real(k) => {
                    self.fds[*k] = Some(fd);
                    self.made_peer
                        .insert(*k, if Some(*k) == xr { yr } else { xr });
                }
                End::Phantom { owner, .. } => self.phantoms.push((*owner, fd)),
            }
        }
        if let Some(k) = yr {
            self.bound.insert(k);
        }
        Ok(())
    }

    /// The process of the tree that holds socket `i` and, if `pid` is given, is that process:
    /// (its PID, its fd).
    pub(super) fn holder(&self, i: usize, pid: Option<i32>) -> Option<(i32, i32)> {
        let id = self.socks[i].0;
        self.holders
            .get(&id)?
            .iter()
            .copied()
            .find(|(p, _)| pid.is_none_or(|want| want == *p))
    }

    /// Whether socket `i`, whose abstract name another socket holds now, can be named at
    /// resume instead ([`DeferredName`]); why not, if it cannot.
    pub(super) fn late_name_refusal(&self, i: usize) -> Option<String> {
        let s = self.sock(i);
        if s.sock_type == SockType::Dgram {
            return Some(
                "a datagram socket is reached through its name while the tree is rebuilt".into(),
            );
        }
        // Clients waiting in its queue are connected to its name: those are made at resume.
        let waiting: HashSet<u64> = match &s.state {
            SockState::Listening { pending, .. } => pending.iter().map(|c| c.client_ino).collect(),
            _ => HashSet::new(),
        };
        let reached = (0..self.socks.len()).any(|j| {
            let o = self.sock(j);
            j != i
                && !waiting.contains(&o.ino)
                && o.family == SockFamily::Unix
                && matches!(o.state, SockState::Connected { .. })
                && (o.local == s.local || o.peer == s.local)
        });
        if reached {
            return Some("connections made through its name are rebuilt through it".into());
        }
        let Some(_) = self.holder(i, None) else {
            return Some("no process of the tree holds it".into());
        };
        if let SockState::Listening { pending, .. } = &s.state {
            if let Some(c) = &s.peer_cred {
                if self.holder(i, Some(c.pid)).is_none() {
                    return Some(format!(
                        "PID {}, which made it listen, does not hold it in the tree",
                        c.pid
                    ));
                }
            }
            for c in pending {
                let client = self.by_ino.get(&c.client_ino).copied();
                let ok = match (client, &c.cred) {
                    (Some(ci), Some(cred)) => self.holder(ci, Some(cred.pid)).is_some(),
                    (Some(ci), None) => self.holder(ci, None).is_some(),
                    (None, _) => false,
                };
                if !ok {
                    return Some(
                        "a connection waits in its queue whose client is not held by the \
                         process that connected it"
                            .into(),
                    );
                }
            }
        }
        None
    }

    pub(super) fn can_name_late(&self, i: usize) -> bool {
        self.late_name_refusal(i).is_none()
    }

    /// Leaves the naming of socket `i` (and its listening, and its waiting connections) to
    /// [`Deferred::complete`].
    pub(super) fn name_late(&mut self, i: usize) -> Result<()> {
        let s = self.sock(i);
        let Some(local) = &s.local else {
            return Ok(());
        };
        let (pid, fd) = match (&s.state, &s.peer_cred) {
            (SockState::Listening { .. }, Some(c)) => self.holder(i, Some(c.pid)),
            _ => self.holder(i, None),
        }
        .ok_or_else(|| self.err(i, "no process of the tree holds it"))?;
        let mut name = DeferredName {
            pid,
            fd,
            addr: encode_addr(local),
            backlog: None,
            clients: Vec::new(),
            what: format!("socket:[{}] (fd {fd}): name {}", s.ino, describe(local)),
        };
        if let SockState::Listening { backlog, pending } = &s.state {
            name.backlog = Some(*backlog as i32);
            for c in pending {
                let ci = self.waiting_client(i, c.client_ino)?;
                let (cpid, cfd) = self
                    .holder(ci, c.cred.as_ref().map(|c| c.pid))
                    .ok_or_else(|| self.err(ci, "no process of the tree holds it"))?;
                name.clients.push(DeferredClient {
                    pid: cpid,
                    fd: cfd,
                    socket: self.dup(ci)?,
                    data: c.queue.iter().map(|m| m.data.clone()).collect(),
                    records: s.sock_type == SockType::Seqpacket,
                });
            }
        }
        self.bound.insert(i);
        self.deferred.names.push(name);
        Ok(())
    }

    /// The client (socket `client_ino` of the tree) of a connection waiting in listener `i`'s
    /// queue, bound to its own name if it has one, and marked as connected by that connection.
    pub(super) fn waiting_client(&mut self, i: usize, client_ino: u64) -> Result<usize> {
        let ci = self.by_ino.get(&client_ino).copied().ok_or_else(|| {
            self.err(
                i,
                format!("waiting client socket:[{client_ino}] is not in the image"),
            )
        })?;
        if !self.bound.contains(&ci) {
            self.bind_own(ci)?;
        }
        self.made_peer.insert(ci, None);
        Ok(ci)
    }

    pub(super) fn bind_own(&mut self, i: usize) -> Result<()> {
        let s = self.sock(i);
        // A relayed socket's name stays at home with the original (the relay's socket there);
        // the supervisor answers getsockname with it.
        if let (Some(a), false) = (&s.local, s.relayed) {
            let fd = self.fd(i);
            self.bind_unix(i, fd, a, s.path_file.as_ref())?;
        }
        self.bound.insert(i);
        Ok(())
    }

    /// The raw address that reaches UNIX socket `i` by its name (a relative path made
    /// absolute when that fits).
    pub(super) fn reachable(&self, i: usize) -> Option<Vec<u8>> {
        let s = self.sock(i);
        match &s.local {
            Some(SockAddr::UnixPath(p)) => {
                let full = Self::full_path(p, s.path_file.as_ref())
                    .into_os_string()
                    .into_vec();
                Some(encode_addr(&SockAddr::UnixPath(if full.len() < 108 {
                    full
                } else {
                    p.clone()
                })))
            }
            Some(a) => Some(encode_addr(a)),
            None => None,
        }
    }

    /// Binds the UNIX sockets that have names (those whose files were removed first) and makes
    /// listeners listen, with the connections waiting in their queues (and what they carry).
    pub(super) fn bind_and_listen(&mut self) -> Result<()> {
        let mut order: Vec<usize> = (0..self.socks.len())
            .filter(|&i| {
                let s = self.sock(i);
                s.family == SockFamily::Unix && s.local.is_some() && !self.bound.contains(&i)
            })
            .collect();
        order.sort_by_key(|&i| !self.sock(i).path_file.as_ref().is_some_and(|f| f.deleted));
        for i in order {
            if !self.bound.contains(&i) {
                self.bind_own(i)?;
            }
        }
        let mut late: Vec<usize> = self.late_names.iter().copied().collect();
        late.sort_unstable();
        for i in late {
            self.name_late(i)?;
        }
        for i in 0..self.socks.len() {
            let s = self.sock(i);
            if s.family != SockFamily::Unix {
                continue;
            }
            let SockState::Listening { backlog, pending } = &s.state else {
                continue;
            };
            if self.late_names.contains(&i) {
                continue;
            }
            let fd = self.fd(i);
            let r = self.as_cred(
                s.peer_cred.as_ref(),
                &[HelperOp::Listen {
                    fd,
                    backlog: *backlog as i32,
                }],
            );
            self.check(i, "listen", &r[0])?;
            if pending.is_empty() {
                continue;
            }
            let raw = self.reachable(i).ok_or_else(|| {
                self.err(i, "connections wait on a listening socket without a name")
            })?;
            let ty = sock_type_raw(s.sock_type) | NEW;
            for c in pending {
                let (cfd, throwaway) = if c.client_ino == 0 {
                    let t = sk::socket(libc::AF_UNIX, ty, 0).map_err(|e| self.err(i, e))?;
                    (t.as_raw_fd(), Some(t))
                } else {
                    let ci = self.waiting_client(i, c.client_ino)?;
                    (self.fd(ci), None)
                };
                let r = self.as_cred(
                    c.cred.as_ref(),
                    &[HelperOp::Connect {
                        fd: cfd,
                        addr: &raw,
                    }],
                );
                self.check(i, "connect a waiting client", &r[0])?;
                let data: Vec<(Vec<u8>, Vec<OwnedFd>)> = c
                    .queue
                    .iter()
                    .map(|m| (m.data.clone(), Vec::new()))
                    .collect();
                write_all(self.me, cfd, &data, s.sock_type == SockType::Seqpacket)?;
                drop(throwaway);
            }
        }
        Ok(())
    }

    /// Datagram sockets connected to named sockets of the tree; pair ends that were connected
    /// elsewhere (or nowhere) afterwards.
    pub(super) fn connect_dgrams(&mut self) -> Result<()> {
        for i in 0..self.socks.len() {
            let s = self.sock(i);
            if s.family != SockFamily::Unix || s.sock_type != SockType::Dgram {
                continue;
            }
            if matches!(s.state, SockState::Connected { peer_ino: 0 }) {
                continue;
            }
            let fd = self.fd(i);
            let want = self.peer_of(i);
            let made = self.made_peer.get(&i).copied();
            match (want, made) {
                (Some(j), Some(Some(k))) if j == k => {}
                (Some(j), _) => {
                    let raw = self
                        .reachable(j)
                        .ok_or_else(|| self.err(i, "it is connected to an unnamed socket"))?;
                    sk::connect(fd, &raw).map_err(|e| {
                        self.err(i, format!("connect to socket:[{}]: {e}", self.sock(j).ino))
                    })?;
                }
                (None, Some(_)) => {
                    // Made as one end of a pair, but connected nowhere since.
                    let _ = sk::connect(fd, &(libc::AF_UNSPEC as u16).to_ne_bytes());
                }
                (None, None) => {}
            }
        }
        Ok(())
    }

    /// The datagram socket of the tree bound to UNIX name `from`, if any.
    pub(super) fn unix_sender(&self, from: Option<&SockAddr>) -> Option<usize> {
        let from = from.filter(|f| **f != SockAddr::UnixUnnamed)?;
        (0..self.socks.len()).find(|&j| {
            let s = self.sock(j);
            s.family == SockFamily::Unix
                && s.sock_type == SockType::Dgram
                && s.local.as_ref() == Some(from)
        })
    }

    /// A throwaway datagram socket to send from: bound to `from` when that name is free.
    pub(super) fn temp_sender(&mut self, r: usize, from: Option<&SockAddr>) -> Result<OwnedFd> {
        let t = sk::socket(libc::AF_UNIX, libc::SOCK_DGRAM | NEW, 0).map_err(|e| self.err(r, e))?;
        match from {
            Some(a @ SockAddr::UnixAbstract(_)) => {
                let _ = sk::bind(t.as_raw_fd(), &encode_addr(a));
            }
            Some(a @ SockAddr::UnixPath(p)) if p.first() == Some(&b'/') => {
                let path = PathBuf::from(OsStr::from_bytes(p));
                let creds = self.creds(r);
                let bound = with_fs_creds(&creds, || {
                    std::fs::symlink_metadata(&path).is_err()
                        && sk::bind(t.as_raw_fd(), &encode_addr(a)).is_ok()
                });
                if bound == Ok(true) {
                    self.remove_later.push((path, creds));
                }
            }
            _ => {}
        }
        Ok(t)
    }
}
