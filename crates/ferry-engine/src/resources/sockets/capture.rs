//! The capture of one socket descriptor, through a copy taken with pidfd_getfd(2) ([`Cap`],
//! [`classify`]), and the check of the whole tree's sockets once every process is captured
//! ([`finish_capture`]).

use super::*;

pub(super) struct Cap<'a> {
    pub(super) pid: i32,
    pub(super) fd: i32,
    pub(super) ino: u64,
    pub(super) link: &'a str,
    pub(super) s: RawFd,
    /// Where descriptors found in flight in its queue are kept.
    flight: &'a RefCell<InFlight>,
}

impl Cap<'_> {
    pub(super) fn refuse(&self, why: impl Into<String>) -> Error {
        Error::Unsupported {
            pid: self.pid,
            what: format!("fd {} ({})", self.fd, self.link),
            why: why.into(),
        }
    }

    pub(super) fn what(&self, w: &str) -> String {
        format!("{w} of fd {} ({})", self.fd, self.link)
    }

    pub(super) fn name(&self, peer: bool) -> Result<Option<SockAddr>> {
        let raw = if peer {
            match sk::getpeername(self.s) {
                Ok(r) => r,
                Err(e) if e.errno == libc::ENOTCONN => return Ok(None),
                Err(e) => return Err(e).ctx(self.pid, || self.what("read the peer's name")),
            }
        } else {
            sk::getsockname(self.s).ctx(self.pid, || self.what("read the name"))?
        };
        Ok(decode_addr(&raw).filter(|a| peer || !is_unspecified(a)))
    }

    /// Runs `f` with SO_PEEK_OFF at 0, then puts the old offset back.
    fn with_peek_off<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let old = sk::getsockopt_int(self.s, SOL_SOCKET, libc::SO_PEEK_OFF)
            .ctx(self.pid, || self.what("read SO_PEEK_OFF"))?;
        sk::setsockopt_int(self.s, SOL_SOCKET, libc::SO_PEEK_OFF, 0).map_err(|e| {
            self.refuse(format!(
                "its queued data cannot be read without consuming it (SO_PEEK_OFF: {e})"
            ))
        })?;
        let r = f();
        let back = sk::setsockopt_int(self.s, SOL_SOCKET, libc::SO_PEEK_OFF, old)
            .ctx(self.pid, || self.what("put SO_PEEK_OFF back"));
        let v = r?;
        back?;
        Ok(v)
    }

    /// Keeps the descriptors in flight that came with a peeked message (see `scm`), returning
    /// what the message names them by.
    fn take_rights(&self, m: &mut sk::Received) -> Result<Vec<u32>> {
        if m.flags & libc::MSG_CTRUNC != 0 {
            return Err(self.refuse(
                "a queued message carries more ancillary data than could be read (descriptors \
                 in flight beyond our own limit of open files?)",
            ));
        }
        if m.rights.is_empty() {
            return Ok(Vec::new());
        }
        let carrier = scm::Carrier {
            pid: self.pid,
            fd: self.fd,
            ino: self.ino,
        };
        Ok(self
            .flight
            .borrow_mut()
            .keep(std::mem::take(&mut m.rights), carrier))
    }

    /// Peeks the `total` bytes queued in a stream socket.
    ///
    /// Descriptors in flight: a peek stops after the bytes that carry descriptors, and reports
    /// those descriptors; but it reports them too when it stops earlier (its buffer full), as
    /// it looks ahead for them. So descriptors count only for a peek that stopped short, or
    /// that reached the end of the queue; a chunk of bytes that ends where descriptors were
    /// attached is recorded with them (where those bytes begin, the kernel does not tell).
    pub(super) fn peek_stream(&self, total: usize) -> Result<Vec<SockMsg>> {
        self.with_peek_off(|| {
            let mut out = Vec::new();
            let mut got = 0;
            let mut want = total.min(PEEK_CHUNK);
            while got < total {
                let mut m = match sk::recv(self.s, want, libc::MSG_PEEK | libc::MSG_DONTWAIT) {
                    Ok(m) => m,
                    Err(e) if e.errno == libc::EAGAIN => break,
                    Err(e) => return Err(e).ctx(self.pid, || self.what("peek the queued data")),
                };
                if m.data.is_empty() {
                    break;
                }
                let n = m.data.len();
                let ahead = !m.rights.is_empty() && n == want && got + n < total;
                if ahead {
                    // The descriptors may be those of bytes further on: look again, to the end.
                    want = total - got;
                    sk::setsockopt_int(self.s, SOL_SOCKET, libc::SO_PEEK_OFF, got as i32)
                        .ctx(self.pid, || self.what("set SO_PEEK_OFF"))?;
                    continue;
                }
                let rights = self.take_rights(&mut m)?;
                got += n;
                want = (total - got).min(PEEK_CHUNK);
                out.push(SockMsg {
                    data: m.data,
                    from: None,
                    rights,
                });
            }
            if got < total {
                return Err(self.refuse(format!(
                    "only {got} of the {total} bytes queued could be read without consuming \
                     them (out-of-band data?)"
                )));
            }
            Ok(out)
        })
    }

    /// Peeks the datagrams or records queued in a socket, with their senders' addresses.
    /// `total`, when known, is the number of bytes queued.
    pub(super) fn peek_messages(
        &self,
        total: Option<usize>,
        read_shut: bool,
        with_from: bool,
    ) -> Result<Vec<SockMsg>> {
        self.with_peek_off(|| {
            let mut out = Vec::new();
            let (mut off, mut size, mut empties) = (0usize, 1usize << 16, 0usize);
            loop {
                if total.is_some_and(|t| off >= t) {
                    break;
                }
                let mut m = match sk::recv(self.s, size, libc::MSG_PEEK | libc::MSG_DONTWAIT) {
                    Ok(m) => m,
                    Err(e) if e.errno == libc::EAGAIN => break,
                    Err(e) => {
                        return Err(e).ctx(self.pid, || self.what("peek the queued messages"))
                    }
                };
                if m.flags & libc::MSG_TRUNC != 0 {
                    // Larger than the buffer: look at the same message again with more room.
                    size = size.saturating_mul(8);
                    if size > 1 << 28 {
                        return Err(self.refuse("a queued message is larger than 256 MiB"));
                    }
                    sk::setsockopt_int(self.s, SOL_SOCKET, libc::SO_PEEK_OFF, off as i32)
                        .ctx(self.pid, || self.what("set SO_PEEK_OFF"))?;
                    continue;
                }
                if m.data.is_empty() {
                    // A zero-length message, or the end after a shutdown.
                    if read_shut && total.is_none() {
                        break;
                    }
                    empties += 1;
                    if empties > 1 << 16 {
                        return Err(self.refuse("too many empty messages are queued"));
                    }
                } else {
                    empties = 0;
                }
                let rights = self.take_rights(&mut m)?;
                off += m.data.len();
                out.push(SockMsg {
                    rights,
                    from: if with_from {
                        decode_addr(&m.from)
                    } else {
                        None
                    },
                    data: m.data,
                });
            }
            Ok(out)
        })
    }
}

/// Describes descriptor `fd` of `pid` (whose /proc link is `link`, e.g.
/// "socket:[1234]", and whose fdinfo lines are `info`), or `None` when this module
/// does not handle that kind (the caller then refuses it).
///
/// Descriptors in flight in its queue are kept in `flight`, to be recorded by the caller.
pub fn classify(
    pid: i32,
    fd: i32,
    link: &str,
    _info: &[(String, String)],
    flight: &RefCell<InFlight>,
) -> Result<Option<FileKind>> {
    let Some(ino) = link
        .strip_prefix("socket:[")
        .and_then(|r| r.strip_suffix(']'))
        .and_then(|n| n.parse::<u64>().ok())
    else {
        return Ok(None);
    };
    let pidfd = pidfd::pidfd_open(pid).ctx(pid, || "open a pidfd".into())?;
    let sock =
        pidfd::pidfd_getfd(&pidfd, fd).ctx(pid, || format!("take a copy of fd {fd} ({link})"))?;
    let c = Cap {
        pid,
        fd,
        ino,
        link,
        s: sock.as_raw_fd(),
        flight,
    };
    let int =
        |name: i32, what: &str| sk::getsockopt_int(c.s, SOL_SOCKET, name).ctx(pid, || c.what(what));
    let domain = int(libc::SO_DOMAIN, "read SO_DOMAIN")?;
    let ty = int(libc::SO_TYPE, "read SO_TYPE")?;
    let protocol = int(libc::SO_PROTOCOL, "read SO_PROTOCOL")?;
    let sock_type = match ty {
        libc::SOCK_STREAM => SockType::Stream,
        libc::SOCK_DGRAM => SockType::Dgram,
        libc::SOCK_SEQPACKET => SockType::Seqpacket,
        libc::SOCK_RAW => SockType::Raw,
        _ => return Err(c.refuse(format!("sockets of type {ty} are not supported"))),
    };
    let filter = c.filter()?;
    let mut desc = match domain {
        libc::AF_UNIX => c.unix(sock_type)?,
        libc::AF_INET | libc::AF_INET6 => c.inet(domain, sock_type, protocol)?,
        libc::AF_NETLINK => c.netlink(sock_type, protocol)?,
        libc::AF_PACKET => c.packet(sock_type, protocol)?,
        _ => {
            return Err(c.refuse(format!(
                "{} sockets (address family {domain}) are not supported",
                family_name(domain)
            )))
        }
    };
    desc.filter = filter;
    Ok(Some(FileKind::Socket(desc)))
}

/// Once every process is captured: checks that the peers of the tree's UNIX sockets are in the
/// tree, marks clients that wait in a listener's queue, and captures what those clients have
/// already sent (see the module documentation).
pub fn finish_capture(frozen: &FrozenTree, tree: &mut Tree) -> Result<()> {
    // A body moving on: its node's stand-ins for its relayed sockets are the originals at home.
    for f in tree.files.iter_mut() {
        if let FileKind::Socket(s) = &mut f.kind {
            if let Some(n) = frozen.relay_sockets.get(&s.ino).filter(|n| !n.is_pipe()) {
                super::relayed::as_relayed(s, n);
            }
        }
    }
    let tree_pids: HashSet<i32> = tree.processes.iter().map(|p| p.pid).collect();
    // Where each description is held: file id -> [(pid, fd, cloexec)].
    let mut holders: HashMap<u32, Vec<(i32, i32, bool)>> = HashMap::new();
    for p in &tree.processes {
        for f in &p.fds {
            holders
                .entry(f.file)
                .or_default()
                .push((p.pid, f.fd, f.cloexec));
        }
    }
    let mut by_ino: HashMap<u64, usize> = HashMap::new();
    for (i, f) in tree.files.iter().enumerate() {
        if let FileKind::Socket(s) = &f.kind {
            if s.family == SockFamily::Unix {
                by_ino.insert(s.ino, i);
            }
        }
    }
    let root = tree.root_pid;
    let first_holder = |id: u32| {
        holders
            .get(&id)
            .and_then(|h| h.first().copied())
            .unwrap_or((root, -1, false))
    };
    let refuse = |id: u32, ino: u64, why: String| {
        let (pid, fd, _) = first_holder(id);
        Error::Unsupported {
            pid,
            what: format!("fd {fd} (socket:[{ino}])"),
            why,
        }
    };
    let carrying = tcp_peers(tree, &refuse, &tree_pids, frozen.relay_pipes)?;
    // Clients waiting in the queues of the tree's listeners: client inode -> listener inode.
    let mut waiting: HashMap<u64, u64> = HashMap::new();
    for f in &tree.files {
        if let FileKind::Socket(s) = &f.kind {
            if s.family != SockFamily::Unix {
                continue; // TCP listeners' queues: see tcp_peers
            }
            if let SockState::Listening { pending, .. } = &s.state {
                for c in pending {
                    if c.client_ino != 0 {
                        if !by_ino.contains_key(&c.client_ino) {
                            return Err(refuse(
                                f.id,
                                s.ino,
                                format!(
                                    "a connection from {}, outside the tree, waits in the queue \
                                     of this listening socket",
                                    describe_unix_ino(c.client_ino, &tree_pids)
                                ),
                            ));
                        }
                        waiting.insert(c.client_ino, s.ino);
                    }
                }
            }
        }
    }
    for f in tree.files.iter_mut() {
        let id = f.id;
        let FileKind::Socket(s) = &mut f.kind else {
            continue;
        };
        if s.family != SockFamily::Unix {
            continue;
        }
        let SockState::Connected { peer_ino } = s.state else {
            continue;
        };
        if s.relay.is_some() {
            continue;
        }
        if peer_ino != 0 {
            if !by_ino.contains_key(&peer_ino) && frozen.relay_pipes && holders.contains_key(&id) {
                // Relayed from home (a stream, or messages kept whole: datagrams, seqpacket):
                // what waits in it stays there, read by the relay.
                s.relayed = true;
                s.state = SockState::Connected { peer_ino: 0 };
                s.queue.clear();
                continue;
            }
            if !by_ino.contains_key(&peer_ino) {
                return Err(refuse(
                    id,
                    s.ino,
                    format!(
                        "it is connected to {}, which is outside the tree",
                        describe_unix_ino(peer_ino, &tree_pids)
                    ),
                ));
            }
            continue;
        }
        if let Some(l) = waiting.get(&s.ino) {
            s.state = SockState::Pending { listener_ino: *l };
        } else if s.sock_type != SockType::Dgram && !(s.shutdown.read && s.shutdown.write) {
            let to = s.peer.as_ref().map(describe).unwrap_or_else(|| "?".into());
            return Err(refuse(
                id,
                s.ino,
                format!(
                    "its connection to {to} waits to be accepted by a listening socket outside \
                     the tree"
                ),
            ));
        }
        // Otherwise the peer has been closed; the socket is restored that way.
    }
    // Who connected each waiting client: the first process holding it, with its credentials.
    let cred_of = |pid: i32| {
        tree.processes
            .iter()
            .find(|p| p.pid == pid)
            .map(|p| PeerCred {
                pid,
                uid: p.creds.uids[1],
                gid: p.creds.gids[1],
                groups: p.creds.groups.clone(),
            })
    };
    let mut creds: HashMap<u64, Option<PeerCred>> = HashMap::new();
    for (ino, i) in &by_ino {
        if waiting.contains_key(ino) {
            creds.insert(*ino, cred_of(first_holder(tree.files[*i].id).0));
        }
    }
    for f in tree.files.iter_mut() {
        if let FileKind::Socket(s) = &mut f.kind {
            if let SockState::Listening { pending, .. } = &mut s.state {
                for c in pending.iter_mut() {
                    c.cred = creds.get(&c.client_ino).cloned().flatten();
                }
            }
        }
    }
    // Listeners whose waiting connections already carry data, or whose clients are gone.
    let mut to_accept = Vec::new();
    for (i, f) in tree.files.iter().enumerate() {
        let FileKind::Socket(s) = &f.kind else {
            continue;
        };
        if s.family != SockFamily::Unix {
            continue;
        }
        let SockState::Listening { pending, .. } = &s.state else {
            continue;
        };
        let mut needed = false;
        for c in pending {
            if c.client_ino == 0 {
                needed = true;
                continue;
            }
            let sent = sk::unix_diag(Some(c.client_ino as u32), sk::UDIAG_SHOW_RQLEN)
                .ok()
                .and_then(|v| v.into_iter().next())
                .and_then(|d| d.rqlen)
                .map(|r| r.1)
                .unwrap_or(0);
            needed |= sent > 0;
        }
        if needed {
            to_accept.push(i);
        }
    }
    for i in to_accept {
        requeue(frozen, tree, &holders, &by_ino, i)?;
    }
    for i in carrying {
        requeue_tcp(frozen, tree, &holders, i)?;
    }
    Ok(())
}
