//! The rebuild of every socket of a tree at once ([`open`], [`Builder`]); each family's part
//! of it is in its own file.

use super::*;

thread_local! {
    /// Sockets made for the tree being restored, by file id, until each is asked for.
    static MADE: RefCell<HashMap<u32, OwnedFd>> = RefCell::new(HashMap::new());
    /// The relay's ends of relayed sockets (`SocketDesc::relayed`), by relay id.
    static RELAYED: RefCell<Vec<(u32, OwnedFd)>> = const { RefCell::new(Vec::new()) };
}

/// Recreates the open file description `d` in this (the restoring) process. All the sockets of
/// the tree are made together, when the first one is asked for.
///
/// `guest`: a pidfd of the init of the guest namespaces the tree is rebuilt in, if it is.
/// `others`: every description of the tree that is not a socket, already open (descriptors in
/// flight in the sockets' queues are sent again from these).
pub fn open(
    d: &FileDesc,
    tree: &Tree,
    guest: Option<std::os::fd::BorrowedFd<'_>>,
    others: &HashMap<u32, OwnedFd>,
) -> Result<OwnedFd> {
    let first = tree
        .files
        .iter()
        .find(|f| matches!(f.kind, FileKind::Socket(_)))
        .map(|f| f.id);
    if first == Some(d.id) {
        MADE.with(|m| m.borrow_mut().clear());
        drop(Deferred::take());
        let (made, deferred) = Builder::new(tree, guest.map(|g| g.as_raw_fd()), others).build()?;
        MADE.with(|m| *m.borrow_mut() = made);
        DEFERRED.with(|d| *d.borrow_mut() = deferred);
    }
    MADE.with(|m| m.borrow_mut().remove(&d.id))
        .ok_or_else(|| Error::BadImage(format!("file {}: socket was not rebuilt", d.id)))
}

/// A TCP connection over this network namespace's loopback (IPv6's for an IPv6 socket, where
/// it has one): the connecting end, then the accepted one. A relayed TCP socket is the first:
/// a TCP socket of its family, whose options are TCP's, only its addresses are this node's.
/// Where the loopback cannot carry it, an unnamed UNIX stream pair.
fn loopback_pair(family: SockFamily) -> std::io::Result<(OwnedFd, OwnedFd)> {
    use std::net::{Ipv4Addr, Ipv6Addr, TcpListener, TcpStream};
    let tcp = |addr: std::net::IpAddr| -> std::io::Result<(OwnedFd, OwnedFd)> {
        let l = TcpListener::bind((addr, 0))?;
        let c = TcpStream::connect(l.local_addr()?)?;
        let (a, _) = l.accept()?;
        Ok((OwnedFd::from(c), OwnedFd::from(a)))
    };
    let v6 = (family == SockFamily::Inet6)
        .then(|| tcp(Ipv6Addr::LOCALHOST.into()).ok())
        .flatten();
    match v6 {
        Some(p) => Ok(p),
        None => tcp(Ipv4Addr::LOCALHOST.into()).or_else(|_| {
            sk::socketpair(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC)
                .map_err(|e| std::io::Error::from_raw_os_error(e.errno))
        }),
    }
}

/// The relay's ends of the relayed sockets the last rebuild made (and forgets them).
pub fn take_relayed() -> Vec<(u32, OwnedFd)> {
    RELAYED.with(|r| std::mem::take(&mut *r.borrow_mut()))
}

/// Completes state that refers to the process's descriptor numbers, once all are installed.
pub fn after_install(_h: &Husk, _p: &Process) -> Result<()> {
    Ok(())
}

pub(super) fn sock_type_raw(t: SockType) -> i32 {
    match t {
        SockType::Stream => libc::SOCK_STREAM,
        SockType::Dgram => libc::SOCK_DGRAM,
        SockType::Seqpacket => libc::SOCK_SEQPACKET,
        SockType::Raw => libc::SOCK_RAW,
    }
}

/// Every socket is made non-blocking (the file's flags are set afterwards) and close-on-exec.
pub(super) const NEW: i32 = libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC;

/// One end of a connection to make: a socket of the tree, or a stand-in for a closed peer of
/// socket `owner` that had name `name`.
#[derive(Clone)]
pub(super) enum End {
    Real(usize),
    Phantom {
        owner: usize,
        name: Option<SockAddr>,
    },
}

pub(super) struct Builder<'a> {
    pub(super) me: i32,
    /// (file id, socket) of every socket of the tree.
    pub(super) socks: Vec<(u32, &'a SocketDesc)>,
    pub(super) by_ino: HashMap<u64, usize>,
    pub(super) fds: Vec<Option<OwnedFd>>,
    /// Sockets already bound to their names.
    pub(super) bound: HashSet<usize>,
    /// What each socket was connected to when it was made (a pair, a stand-in, a listener).
    pub(super) made_peer: HashMap<usize, Option<usize>>,
    /// Stand-ins for closed peers: (the socket they are connected to, the stand-in).
    pub(super) phantoms: Vec<(usize, OwnedFd)>,
    /// Socket files to remove once every connection to them is made, and with whose rights.
    pub(super) remove_later: Vec<(PathBuf, FsCreds)>,
    /// The file-system rights each socket's files are made and removed with (file id -> the
    /// first live process holding it); `tree_creds` for sockets no process holds.
    pub(super) creds: HashMap<u32, FsCreds>,
    tree_creds: FsCreds,
    /// A pidfd of the guest init when the tree is rebuilt in guest namespaces: sockets are then
    /// made by helpers in the guest PID namespace, under the tree's PIDs.
    guest: Option<RawFd>,
    /// What must wait until the tree is about to run.
    pub(super) deferred: Deferred,
    /// Who holds each description (file id): (the tree's PID, its fd), live processes only.
    pub(super) holders: HashMap<u32, Vec<(i32, i32)>>,
    /// UNIX sockets whose abstract name another socket holds (the frozen original of a
    /// migration on one machine): named, and made to listen, at resume (see [`DeferredName`]).
    pub(super) late_names: HashSet<usize>,
    /// The tree's other descriptions, open: sent again where they were in flight.
    pub(super) others: &'a HashMap<u32, OwnedFd>,
    /// The pidfds of the tree (file id -> the PID it names, non-blocking), which exist only
    /// once the processes do.
    pidfds: HashMap<u32, (i32, bool)>,
    /// Sockets whose queue is refilled, from its first message carrying a pidfd on, only when
    /// the tree is about to run.
    late_queues: HashSet<usize>,
}

impl<'a> Builder<'a> {
    fn new(tree: &'a Tree, guest: Option<RawFd>, others: &'a HashMap<u32, OwnedFd>) -> Self {
        let mut holders: HashMap<u32, Vec<(i32, i32)>> = HashMap::new();
        for p in tree.processes.iter().filter(|p| p.zombie_status.is_none()) {
            for f in &p.fds {
                holders.entry(f.file).or_default().push((p.pid, f.fd));
            }
        }
        let socks: Vec<(u32, &SocketDesc)> = tree
            .files
            .iter()
            .filter_map(|f| match &f.kind {
                FileKind::Socket(s) => Some((f.id, s)),
                _ => None,
            })
            .collect();
        let by_ino = socks
            .iter()
            .enumerate()
            .filter(|(_, (_, s))| s.family == SockFamily::Unix)
            .map(|(i, (_, s))| (s.ino, i))
            .collect();
        let n = socks.len();
        let pidfds = tree
            .files
            .iter()
            .filter_map(|f| match f.kind {
                FileKind::Pidfd { pid } => Some((f.id, (pid, f.flags & libc::O_NONBLOCK != 0))),
                _ => None,
            })
            .collect();
        // A socket's files are the business of the process holding it: made, changed and
        // removed with its rights, never root's (see crate::reopen).
        let mut creds = HashMap::new();
        for p in tree.processes.iter().filter(|p| p.zombie_status.is_none()) {
            for f in &p.fds {
                creds
                    .entry(f.file)
                    .or_insert_with(|| crate::reopen::creds_of(p));
            }
        }
        let tree_creds = tree
            .processes
            .first()
            .map(crate::reopen::creds_of)
            .unwrap_or_default();
        Builder {
            me: std::process::id() as i32,
            socks,
            by_ino,
            fds: (0..n).map(|_| None).collect(),
            bound: HashSet::new(),
            made_peer: HashMap::new(),
            phantoms: Vec::new(),
            remove_later: Vec::new(),
            creds,
            tree_creds,
            guest,
            deferred: Deferred::default(),
            holders,
            late_names: HashSet::new(),
            others,
            pidfds,
            late_queues: HashSet::new(),
        }
    }

    fn build(mut self) -> Result<(HashMap<u32, OwnedFd>, Deferred)> {
        let r = self.build_steps();
        self.remove_now();
        r?;
        let mut out = HashMap::new();
        for (i, fd) in self.fds.into_iter().enumerate() {
            let (id, s) = self.socks[i];
            let fd = fd.ok_or_else(|| Error::Restore {
                pid: self.me,
                what: format!("socket of file {id} (socket:[{}]) was not rebuilt", s.ino),
            })?;
            out.insert(id, fd);
        }
        Ok((out, self.deferred))
    }

    /// Removes the socket files that were to go, each with its socket's rights.
    fn remove_now(&mut self) {
        for (p, c) in std::mem::take(&mut self.remove_later) {
            let _ = with_fs_creds(&c, || std::fs::remove_file(p));
        }
    }

    /// The rights socket `i`'s files are handled with.
    pub(super) fn creds(&self, i: usize) -> FsCreds {
        self.creds
            .get(&self.socks[i].0)
            .cloned()
            .unwrap_or_else(|| self.tree_creds.clone())
    }

    fn build_steps(&mut self) -> Result<()> {
        self.pairs()?;
        self.create_rest()?;
        self.bind_and_listen()?;
        self.connect_dgrams()?;
        self.remove_now();
        self.fill_queues()?;
        self.finish()?;
        self.attach_filters()
    }

    pub(super) fn sock(&self, i: usize) -> &'a SocketDesc {
        self.socks[i].1
    }

    pub(super) fn err(&self, i: usize, what: impl std::fmt::Display) -> Error {
        let (id, s) = self.socks[i];
        // Named by the first process holding it, and its descriptor.
        let (pid, fd) = match self.holders.get(&id).and_then(|h| h.first()) {
            Some((pid, fd)) => (*pid, format!("fd {fd}: ")),
            None => (self.me, String::new()),
        };
        Error::Restore {
            pid,
            what: format!("{fd}socket of file {id} (socket:[{}]): {what}", s.ino),
        }
    }

    pub(super) fn fd(&self, i: usize) -> RawFd {
        self.fds[i].as_ref().map(|f| f.as_raw_fd()).unwrap_or(-1)
    }

    /// A copy of the descriptor of socket `i`, kept until [`Deferred::complete`].
    pub(super) fn dup(&self, i: usize) -> Result<OwnedFd> {
        self.fds[i]
            .as_ref()
            .ok_or_else(|| self.err(i, "not made yet"))?
            .try_clone()
            .map_err(|e| self.err(i, format!("dup: {e}")))
    }

    /// The socket of the tree that socket `i` is connected to.
    pub(super) fn peer_of(&self, i: usize) -> Option<usize> {
        match self.sock(i).state {
            SockState::Connected { peer_ino } if peer_ino != 0 => {
                self.by_ino.get(&peer_ino).copied()
            }
            _ => None,
        }
    }

    fn phantom_of(&self, i: usize) -> Option<RawFd> {
        self.phantoms
            .iter()
            .find(|(o, _)| *o == i)
            .map(|(_, f)| f.as_raw_fd())
    }

    /// Runs helper operations as `cred` (under its PID when that is free), or here.
    pub(super) fn as_cred(
        &self,
        cred: Option<&PeerCred>,
        ops: &[HelperOp],
    ) -> Vec<sk::HelperResult> {
        if let Some(c) = cred {
            let hc = HelperCred {
                uid: c.uid,
                gid: c.gid,
                groups: c.groups.clone(),
            };
            // The helper is made where the tree's PIDs mean what the credentials say.
            let as_pid = match (self.guest, c.pid > 0) {
                (_, false) => Ok(None),
                (None, true) => sk::run_as(Some(c.pid), Some(&hc), ops),
                (Some(g), true) => ferry_sys::ns::with_children_in_pid_ns_of(g, || {
                    sk::run_as(Some(c.pid), Some(&hc), ops)
                })
                .and_then(|r| r),
            };
            match as_pid {
                Ok(Some(r)) => return r,
                Ok(None) => {
                    log::debug!(
                        "PID {} is taken (or not ours): its sockets are made under another",
                        c.pid
                    )
                }
                Err(e) => log::warn!("socket helper as PID {}: {e}", c.pid),
            }
            match sk::run_as(None, Some(&hc), ops) {
                Ok(Some(r)) => return r,
                Ok(None) => {}
                Err(e) => log::warn!("socket helper as UID {}: {e}", c.uid),
            }
        }
        let res = |r: ferry_sys::SysResult<()>| sk::HelperResult {
            errno: r.err().map(|e| e.errno).unwrap_or(0),
            fds: None,
        };
        ops.iter()
            .map(|op| match *op {
                HelperOp::SocketPair { ty } => match sk::socketpair(libc::AF_UNIX, ty) {
                    Ok(p) => sk::HelperResult {
                        errno: 0,
                        fds: Some(p),
                    },
                    Err(e) => sk::HelperResult {
                        errno: e.errno,
                        fds: None,
                    },
                },
                HelperOp::Listen { fd, backlog } => res(sk::listen(fd, backlog)),
                HelperOp::Connect { fd, addr } => res(sk::connect(fd, addr)),
                HelperOp::Bind { fd, addr } => res(sk::bind(fd, addr)),
                HelperOp::Chdir { .. } => sk::HelperResult {
                    errno: libc::ENOSYS,
                    fds: None,
                },
            })
            .collect()
    }

    pub(super) fn check(&self, i: usize, what: &str, r: &sk::HelperResult) -> Result<()> {
        if r.errno != 0 {
            return Err(self.err(
                i,
                format!("{what}: {}", std::io::Error::from_raw_os_error(r.errno)),
            ));
        }
        Ok(())
    }

    /// Every socket not made as part of a pair; TCP and UDP ones completely. Established TCP
    /// connections come last, so that the tree's listeners have their ports first.
    fn create_rest(&mut self) -> Result<()> {
        self.packet_rings()?;
        for i in 0..self.socks.len() {
            if self.fds[i].is_some() || self.sock(i).tcp.is_some() {
                continue;
            }
            let s = self.sock(i);
            if s.relayed && s.family != SockFamily::Unix {
                // A TCP connection relayed from home: this end of a connection over this
                // node's loopback, the other the relay's (which carries it to the home's socket).
                let (mine, relay) = loopback_pair(s.family)
                    .map_err(|e| self.err(i, format!("a connection for its relay: {e}")))?;
                apply_opts(mine.as_raw_fd(), &s.opts, false);
                // Its own way shut down (its FIN sent): so is the new one's (the relay reads
                // that end of file and passes it on, which home has made already).
                if s.shutdown.write {
                    let write_only = Shutdown {
                        read: false,
                        write: true,
                    };
                    apply_shutdown(mine.as_raw_fd(), &write_only);
                }
                let id = s
                    .relay
                    .unwrap_or(ferry_image::RELAY_SOCKET | self.socks[i].0);
                self.fds[i] = Some(mine);
                RELAYED.with(|r| r.borrow_mut().push((id, relay)));
                continue;
            }
            let domain = match s.family {
                SockFamily::Unix => libc::AF_UNIX,
                SockFamily::Inet => libc::AF_INET,
                SockFamily::Inet6 => libc::AF_INET6,
                SockFamily::Netlink => libc::AF_NETLINK,
                SockFamily::Packet => libc::AF_PACKET,
            };
            let fd =
                sk::socket(domain, sock_type_raw(s.sock_type) | NEW, s.protocol).map_err(|e| {
                    match ping::is_ping(s.family, s.sock_type, s.protocol) {
                        true if e.errno == libc::EACCES => self.err(
                            i,
                            format!(
                            "make an ICMP echo (ping) socket: {e}: the restorer's group is not \
                             in net.ipv4.ping_group_range here"
                        ),
                        ),
                        _ => self.err(i, format!("socket: {e}")),
                    }
                })?;
            self.fds[i] = Some(fd);
            match s.family {
                SockFamily::Unix => {}
                SockFamily::Netlink => self.netlink(i)?,
                SockFamily::Packet => self.packet(i)?,
                SockFamily::Inet | SockFamily::Inet6 => self.inet(i)?,
            }
        }
        for i in 0..self.socks.len() {
            if self.fds[i].is_none() && self.sock(i).tcp.is_some() {
                self.tcp_conn(i)?;
            }
        }
        Ok(())
    }

    /// Puts every queued message back, each sent by a socket that could have sent it.
    fn fill_queues(&mut self) -> Result<()> {
        let mut unbound_udp: HashMap<i32, OwnedFd> = HashMap::new();
        for r in 0..self.socks.len() {
            let s = self.sock(r);
            if s.queue.is_empty() {
                continue;
            }
            let total: usize = s.queue.iter().map(|m| m.data.len()).sum();
            // A connected UNIX socket only hears from its peer (or the peer's stand-in).
            let peer = self
                .peer_of(r)
                .map(|j| (j, self.fd(j)))
                .map(|(j, f)| (Some(j), f))
                .or_else(|| self.phantom_of(r).map(|f| (None, f)));
            match (s.family, s.sock_type) {
                (SockFamily::Unix, SockType::Stream | SockType::Seqpacket) => {
                    let (_, p) =
                        peer.ok_or_else(|| self.err(r, "data is queued but nothing can send it"))?;
                    bump_sndbuf(p, total);
                    for m in &s.queue {
                        let seq = s.sock_type == SockType::Seqpacket;
                        self.send_one(r, p, m, None, seq)?;
                    }
                }
                (SockFamily::Unix, _) => {
                    let to = self.reachable(r);
                    if let Some((j, p)) = peer {
                        let mutual = match j {
                            Some(j) => {
                                self.made_peer.get(&j).copied().flatten() == Some(r)
                                    || self.peer_of(j) == Some(r)
                            }
                            None => true,
                        };
                        let dest = if mutual { None } else { to.as_deref() };
                        bump_sndbuf(p, total);
                        for m in &s.queue {
                            self.send_one(r, p, m, dest, true)?;
                        }
                        continue;
                    }
                    let to = to.ok_or_else(|| {
                        self.err(r, "datagrams are queued on an unnamed, unconnected socket")
                    })?;
                    for m in &s.queue {
                        match self.unix_sender(m.from.as_ref()) {
                            Some(j) => {
                                let f = self.fd(j);
                                bump_sndbuf(f, m.data.len());
                                self.send_one(r, f, m, Some(&to), true)?;
                            }
                            None => {
                                let t = self.temp_sender(r, m.from.as_ref())?;
                                bump_sndbuf(t.as_raw_fd(), m.data.len());
                                self.send_one(r, t.as_raw_fd(), m, Some(&to), true)?;
                            }
                        }
                    }
                }
                (f, SockType::Dgram) if ping::is_ping(f, SockType::Dgram, s.protocol) => {
                    self.requeue_ping_replies(r)?;
                }
                (_, SockType::Dgram) => {
                    let to =
                        s.local.as_ref().map(loopback_if_any).ok_or_else(|| {
                            self.err(r, "datagrams are queued on an unbound socket")
                        })?;
                    let raw_to = encode_addr(&to);
                    if !self.deferred.binds.is_empty() {
                        // Some UDP socket of the tree (the receiver, or a sender) gets its
                        // address only when the tree is about to run: so do all the datagrams.
                        self.defer_datagrams(r, &raw_to)?;
                        continue;
                    }
                    for m in &s.queue {
                        if let Some(j) = m.from.as_ref().and_then(|f| self.inet_sender(f)) {
                            let f = self.fd(j);
                            self.send_one(r, f, m, Some(&raw_to), true)?;
                        } else if let Some(t) = m.from.as_ref().and_then(|f| self.inet_temp(r, f)) {
                            self.send_one(r, t.as_raw_fd(), m, Some(&raw_to), true)?;
                        } else {
                            let d = match s.family {
                                SockFamily::Inet6 => libc::AF_INET6,
                                _ => libc::AF_INET,
                            };
                            if let std::collections::hash_map::Entry::Vacant(e) =
                                unbound_udp.entry(d)
                            {
                                e.insert(
                                    sk::socket(d, libc::SOCK_DGRAM | NEW, 0)
                                        .map_err(|e| self.err(r, e))?,
                                );
                            }
                            let f = unbound_udp[&d].as_raw_fd();
                            self.send_one(r, f, m, Some(&raw_to), true)?;
                        }
                    }
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Sends message `m` of socket `r`'s queue again from `from`, with the descriptors that
    /// were in flight with it; or, from the first message that carries a pidfd on, keeps it
    /// to be sent when the tree is about to run (see `scm`).
    fn send_one(
        &mut self,
        r: usize,
        from: RawFd,
        m: &SockMsg,
        to: Option<&[u8]>,
        record: bool,
    ) -> Result<()> {
        if m.rights.iter().any(|id| self.pidfds.contains_key(id)) {
            self.late_queues.insert(r);
        }
        if !record && !m.rights.is_empty() && m.data.len() > 1 {
            // A stream: the descriptors go with the last byte of the bytes recorded with them
            // (see `Cap::peek_stream`), so that a read ending before it does not take them.
            let (head, last) = m.data.split_at(m.data.len() - 1);
            let head = SockMsg {
                data: head.to_vec(),
                ..Default::default()
            };
            self.send_one(r, from, &head, to, false)?;
            let last = SockMsg {
                data: last.to_vec(),
                from: None,
                rights: m.rights.clone(),
            };
            return self.send_one(r, from, &last, to, true);
        }
        if self.late_queues.contains(&r) {
            return self.defer_send(r, from, m, to, record);
        }
        let rights = self.rights_of(r, m)?;
        let data = &m.data;
        let mut at = 0;
        loop {
            let fds = if at == 0 { &rights[..] } else { &[] };
            let n = sk::send(from, &data[at..], to, fds, libc::MSG_DONTWAIT).map_err(|e| {
                self.err(
                    r,
                    format!(
                        "queue {} bytes again (with {} descriptors in flight): {e}",
                        data.len(),
                        fds.len()
                    ),
                )
            })?;
            at += n;
            if record || at >= data.len() {
                return Ok(());
            }
        }
    }

    /// Keeps message `m` of socket `r`'s queue, and copies of its sender and descriptors, for
    /// [`Deferred::complete`].
    fn defer_send(
        &mut self,
        r: usize,
        from: RawFd,
        m: &SockMsg,
        to: Option<&[u8]>,
        record: bool,
    ) -> Result<()> {
        let dup = |fd: RawFd| {
            fdops::dup_cloexec(fd)
                .map_err(|e| self.err(r, format!("keep a message for later: {e}")))
        };
        let mut rights = Vec::with_capacity(m.rights.len());
        for id in &m.rights {
            rights.push(match self.pidfds.get(id) {
                Some(&(pid, nonblock)) => scm::LateRight::Pidfd { pid, nonblock },
                None => {
                    let one = SockMsg {
                        rights: vec![*id],
                        ..Default::default()
                    };
                    scm::LateRight::Fd(dup(self.rights_of(r, &one)?[0])?)
                }
            });
        }
        let (id, s) = self.socks[r];
        let send = scm::DeferredSend {
            what: format!(
                "socket of file {id} (socket:[{}]): a message that carries a pidfd, or follows one",
                s.ino
            ),
            from: dup(from)?,
            data: m.data.clone(),
            to: to.map(<[u8]>::to_vec),
            rights,
            stream: !record,
        };
        self.deferred.sends.push(send);
        Ok(())
    }

    /// Stand-ins for closed peers go; then shutdowns, options and peek offsets.
    fn finish(&mut self) -> Result<()> {
        for (owner, p) in std::mem::take(&mut self.phantoms) {
            let s = self.sock(owner);
            if s.relayed {
                let id = s
                    .relay
                    .unwrap_or(ferry_image::RELAY_SOCKET | self.socks[owner].0);
                RELAYED.with(|r| r.borrow_mut().push((id, p)));
                continue;
            }
            if s.error != 0 && s.sock_type != SockType::Dgram {
                // A peer that closes with unread data resets the connection (ECONNRESET).
                let _ = sk::send(self.fd(owner), &[0], None, &[], libc::MSG_DONTWAIT);
            }
            drop(p);
        }
        for i in 0..self.socks.len() {
            let s = self.sock(i);
            let fd = self.fd(i);
            if s.family == SockFamily::Unix {
                if self.late_queues.is_empty() || !(s.shutdown.read || s.shutdown.write) {
                    apply_shutdown(fd, &s.shutdown);
                } else {
                    // Once the messages left for later are sent.
                    let fd = self.dup(i)?;
                    self.deferred.shutdowns.push((fd, s.shutdown));
                }
                // Buffers may have been raised to refill queues: always set them.
                apply_opts(fd, &s.opts, true);
            } else if matches!(s.sock_type, SockType::Dgram | SockType::Raw)
                && (s.shutdown.read || s.shutdown.write)
            {
                // Once its datagrams are sent (it may be their sender), and it is bound.
                if self.deferred.binds.is_empty() && self.deferred.datagrams.is_empty() {
                    apply_shutdown(fd, &s.shutdown);
                } else {
                    let fd = self.dup(i)?;
                    self.deferred.shutdowns.push((fd, s.shutdown));
                }
            }
            set_peek_off(fd, s);
        }
        Ok(())
    }
}
