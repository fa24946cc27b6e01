//! TCP connections in repair mode (tcp(7)): their capture, the check that both ends are in the
//! tree, their silencing before the kill, and their rebuild at resume ([`DeferredRepair`]),
//! with their FINs sent again ([`replay_shutdowns`]) and a stand-in for an end its process had
//! closed. Connections that wait in a listener's queue, or are still being opened, are made
//! afresh at resume ([`DeferredHandshake`]); those that carry bytes are taken out of the queue
//! at capture and put back ([`requeue_tcp`]).

use super::*;

pub(super) const TCP_SYN_SENT: u8 = 2;
pub(super) const TCP_FIN_WAIT1: u8 = 4;
pub(super) const TCP_FIN_WAIT2: u8 = 5;
pub(super) const TCP_CLOSE_WAIT: u8 = 8;
pub(super) const TCP_LAST_ACK: u8 = 9;
pub(super) const TCP_CLOSING: u8 = 11;

pub(super) fn tcp_state_name(s: u8) -> &'static str {
    match s {
        1 => "ESTABLISHED",
        2 => "SYN_SENT",
        3 => "SYN_RECV",
        4 => "FIN_WAIT1",
        5 => "FIN_WAIT2",
        6 => "TIME_WAIT",
        8 => "CLOSE_WAIT",
        9 => "LAST_ACK",
        11 => "CLOSING",
        _ => "unknown",
    }
}

impl Cap<'_> {
    /// Reads an established TCP connection in repair mode (sequence numbers, both queues, the
    /// options negotiated, the window), then takes repair mode off again, so the connection
    /// works on if the tree is let go. `info`: its TCP_INFO; `conn`: it, for people.
    pub(super) fn tcp_conn(&self, info: &[u8], conn: &str) -> Result<(TcpConn, Vec<SockMsg>)> {
        let s = self.s;
        if sk::getsockopt_int(s, IPPROTO_TCP, libc::TCP_REPAIR).unwrap_or(0) != 0 {
            return Err(self.refuse(format!(
                "{conn} is already in TCP repair mode (someone else is checkpointing it?)"
            )));
        }
        let reuse = sk::getsockopt_int(s, SOL_SOCKET, libc::SO_REUSEADDR)
            .ctx(self.pid, || self.what("read SO_REUSEADDR"))?;
        sk::tcp_repair(s, sk::TCP_REPAIR_ON).map_err(|e| {
            self.refuse(format!(
                "{conn} cannot be put in TCP repair mode ({e}); that needs CAP_NET_ADMIN in \
                 the socket's network namespace"
            ))
        })?;
        let r = self.tcp_read_repaired(info, conn);
        // Leaving repair mode clears SO_REUSEADDR (the kernel resets the socket's reuse mode):
        // it is set back as it was. No window probe: the peer must not notice anything.
        let queue = sk::tcp_repair_queue(s, sk::TCP_NO_QUEUE);
        let off = sk::tcp_repair(s, sk::TCP_REPAIR_OFF_NO_WP);
        let back = sk::setsockopt_int(s, SOL_SOCKET, libc::SO_REUSEADDR, reuse);
        let v = r?;
        queue
            .and(off)
            .and(back)
            .ctx(self.pid, || self.what("leave TCP repair mode"))?;
        Ok(v)
    }

    pub(super) fn tcp_read_repaired(
        &self,
        info: &[u8],
        conn: &str,
    ) -> Result<(TcpConn, Vec<SockMsg>)> {
        let s = self.s;
        let ctx = |w: &str| format!("{w} of {conn}, fd {} ({})", self.fd, self.link);
        let ioctl = |req, w: &str| {
            sk::ioctl_int(s, req)
                .map(|n| n.max(0) as usize)
                .ctx(self.pid, || ctx(w))
        };
        let state = info.first().copied().unwrap_or(0);
        // A FIN takes a sequence number. This end's FIN (after shutdown(SHUT_WR) or close) is
        // counted in the send sequence, and in SIOCOUTQ until it is acknowledged (FIN_WAIT2:
        // it is), and in SIOCOUTQNSD until it is sent; the other end's FIN in the receive
        // sequence (SIOCINQ leaves it out). They are left out of the image: the connection is
        // made again as established, and its FINs are sent again at resume.
        let fin_sent = matches!(
            state,
            TCP_FIN_WAIT1 | TCP_FIN_WAIT2 | TCP_CLOSING | TCP_LAST_ACK
        );
        let fin_unacked = fin_sent && state != TCP_FIN_WAIT2;
        let fin_received = matches!(state, TCP_CLOSE_WAIT | TCP_CLOSING | TCP_LAST_ACK);
        let inq = ioctl(sk::SIOCINQ, "read the bytes queued (SIOCINQ)")?;
        let outq_all = ioctl(sk::SIOCOUTQ, "read the bytes not acknowledged (SIOCOUTQ)")?;
        let unsent_all = ioctl(sk::SIOCOUTQNSD, "read the bytes not sent (SIOCOUTQNSD)")?;
        let outq = outq_all.saturating_sub(usize::from(fin_unacked && outq_all > 0));
        let unsent = unsent_all.saturating_sub(usize::from(fin_unacked && unsent_all > 0));
        sk::tcp_repair_queue(s, sk::TCP_SEND_QUEUE)
            .ctx(self.pid, || ctx("select the send queue"))?;
        let write_seq = sk::tcp_queue_seq(s)
            .ctx(self.pid, || ctx("read the send sequence"))?
            .wrapping_sub(u32::from(fin_sent));
        let send_queue =
            sk::tcp_peek_send_queue(s, outq).ctx(self.pid, || ctx("read the send queue"))?;
        if send_queue.len() != outq {
            return Err(self.refuse(format!(
                "only {} of the {outq} bytes in the send queue of {conn} could be read",
                send_queue.len()
            )));
        }
        sk::tcp_repair_queue(s, sk::TCP_RECV_QUEUE)
            .ctx(self.pid, || ctx("select the receive queue"))?;
        let rcv_nxt = sk::tcp_queue_seq(s)
            .ctx(self.pid, || ctx("read the receive sequence"))?
            .wrapping_sub(u32::from(fin_received));
        let queue = if inq > 0 {
            self.peek_stream(inq)?
        } else {
            Vec::new()
        };
        // In repair mode TCP_MAXSEG reads the MSS negotiated (mss_clamp).
        let mss_clamp = sk::getsockopt_int(s, IPPROTO_TCP, libc::TCP_MAXSEG)
            .ctx(self.pid, || ctx("read the MSS"))? as u32;
        let timestamp = sk::getsockopt_int(s, IPPROTO_TCP, libc::TCP_TIMESTAMP)
            .ctx(self.pid, || ctx("read TCP_TIMESTAMP"))? as u32;
        let mut w = sk::tcp_repair_window(s).ctx(self.pid, || ctx("read the window"))?;
        let past = w.rcv_wup.wrapping_sub(rcv_nxt);
        if fin_received && (past as i32) > 0 {
            // The window was last announced past the FIN: the same right edge, announced at
            // the receive sequence (the kernel refuses a window announced past it).
            w.rcv_wup = rcv_nxt;
            w.rcv_wnd = w.rcv_wnd.wrapping_add(past);
        }
        // struct tcp_info: tcpi_options at 5; tcpi_snd_wscale:4, tcpi_rcv_wscale:4 at 6.
        let options = info.get(5).copied().unwrap_or(0);
        let scales = info.get(6).copied().unwrap_or(0);
        let tcp = TcpConn {
            send_seq: write_seq.wrapping_sub(outq as u32),
            recv_seq: rcv_nxt.wrapping_sub(inq as u32),
            send_queue,
            unsent: unsent.min(outq) as u32,
            mss_clamp,
            wscale: (options & TCPI_OPT_WSCALE != 0).then_some((scales & 0xf, scales >> 4)),
            sack: options & TCPI_OPT_SACK != 0,
            timestamps: options & TCPI_OPT_TIMESTAMPS != 0,
            timestamp,
            window: TcpWindow {
                snd_wl1: w.snd_wl1,
                snd_wnd: w.snd_wnd,
                max_window: w.max_window,
                rcv_wnd: w.rcv_wnd,
                rcv_wup: w.rcv_wup,
            },
            fin_sent,
            fin_received,
            peer_closed: false,
            state,
        };
        Ok((tcp, queue))
    }
}

/// Pairs each established TCP connection of the tree with its other end, which must be a
/// socket of the tree too; a connection to anything else is refused (`refuse(file id, inode,
/// why)`).
///
/// Why refuse a peer outside the tree: between the checkpoint and the restore the connection
/// has no socket on this machine, so anything the peer sends (data, a keepalive, a
/// retransmission) is answered with a reset, and the connection is lost; CRIU locks the
/// network (firewall rules dropping the connection's packets) for that window, which Ferry
/// does not do. Both ends in the tree are frozen, captured and killed together, and neither
/// sends anything in between.
///
/// Returns the listeners (file indices) whose waiting connections already carry what their
/// clients sent: [`requeue_tcp`] takes those.
///
/// With `relay` (a tree leaving its home, `FrozenTree::relay_pipes`), a connection whose other
/// end is outside the tree is not refused but relayed: the home keeps its socket (the deputy's
/// description, taken by the home daemon), with what waits in it, and the body gets the other
/// end of a relay in its place.
pub(super) fn tcp_peers(
    tree: &mut Tree,
    refuse: &dyn Fn(u32, u64, String) -> Error,
    tree_pids: &HashSet<i32>,
    relay: bool,
) -> Result<Vec<usize>> {
    let conns: Vec<(usize, u64, SockAddr, SockAddr)> = tree
        .files
        .iter()
        .enumerate()
        .filter_map(|(i, f)| match &f.kind {
            FileKind::Socket(s) if s.tcp.is_some() => {
                Some((i, s.ino, s.local.clone()?, s.peer.clone()?))
            }
            _ => None,
        })
        .collect();
    let root = tree.processes.first().map(|p| p.pid).unwrap_or(0);
    let held: HashSet<u32> = tree
        .processes
        .iter()
        .flat_map(|p| p.fds.iter().map(|f| f.file))
        .collect();
    // The tree's TCP listeners with connections waiting to be accepted: (file index, address,
    // how many wait).
    let listeners: Vec<(usize, SockAddr, usize)> = tree
        .files
        .iter()
        .enumerate()
        .filter_map(|(i, f)| match &f.kind {
            FileKind::Socket(s) if s.family != SockFamily::Unix => match &s.state {
                SockState::Listening { pending, .. } if !pending.is_empty() => {
                    Some((i, s.local.clone()?, pending.len()))
                }
                _ => None,
            },
            _ => None,
        })
        .collect();
    // Clients whose connection waits in one of those queues: (listener index, client index).
    let mut waiting: Vec<(usize, usize)> = Vec::new();
    let mut carrying: Vec<usize> = Vec::new();
    for (i, ino, local, peer) in &conns {
        let other = conns
            .iter()
            .find(|(_, _, l, p)| same_inet(l, peer) && same_inet(p, local));
        match other {
            Some((_, peer_ino, _, _)) => {
                if let FileKind::Socket(s) = &mut tree.files[*i].kind {
                    s.state = SockState::Connected {
                        peer_ino: *peer_ino,
                    };
                }
            }
            None => {
                let child = tcp_table_entry(root, peer, local);
                let listener = listeners
                    .iter()
                    .find(|(_, l, _)| listener_reaches(l, peer))
                    .map(|(li, _, _)| *li);
                if let Some(c) = child
                    .as_ref()
                    .filter(|c| c.ino == 0 && c.state == TCP_FIN_WAIT2)
                {
                    if orphaned_peer(tree, refuse, *i, c)? {
                        continue;
                    }
                }
                if let (Some(li), Some(child)) = (listener, &child) {
                    // The other end has no inode: it waits in the listener's queue, not
                    // accepted yet.
                    if child.ino == 0 {
                        waiting_client(tree, refuse, *i, li, child)?;
                        waiting.push((li, *i));
                        if child.rx_queue > 0 && !carrying.contains(&li) {
                            carrying.push(li);
                        }
                        continue;
                    }
                }
                // Relayed only when a process holds it: the home keeps its deputy's socket (one
                // in flight in a queue has no deputy to keep it).
                if relay && held.contains(&tree.files[*i].id) {
                    if let FileKind::Socket(s) = &mut tree.files[*i].kind {
                        s.relayed = true;
                        s.tcp = None;
                        s.queue.clear();
                        s.state = SockState::Connected { peer_ino: 0 };
                    }
                    continue;
                }
                let whose = match child.map(|c| (c.ino, c.state)) {
                    Some((0, TCP_ESTABLISHED)) => {
                        "waiting to be accepted by a listening socket outside the tree".into()
                    }
                    Some((0, st)) => format!("held by no process, {}", tcp_state_name(st)),
                    Some((pi, _)) => format!("socket:[{pi}]{}", outside_holders(pi, tree_pids)),
                    None => "not a socket of this machine's network namespace".into(),
                };
                return Err(refuse(
                    tree.files[*i].id,
                    *ino,
                    format!(
                        "TCP connection {} -> {}: its other end ({whose}) is outside the tree. \
                         Only connections whose both ends are in the tree can be checkpointed: \
                         while the tree is away nothing on this machine would answer the other \
                         end but with a reset, and Ferry does not lock the network to hold its \
                         packets back",
                        describe(local),
                        describe(peer)
                    ),
                ));
            }
        }
    }
    // Each listener's queue, in the order its clients' sockets were made (inode order: the
    // kernel does not tell the order of its queue), must be the tree's clients, all of them.
    for (li, _, count) in &listeners {
        let mut clients: Vec<(u64, usize)> = waiting
            .iter()
            .filter(|(l, _)| l == li)
            .filter_map(|(_, c)| match &tree.files[*c].kind {
                FileKind::Socket(s) => Some((s.ino, *c)),
                _ => None,
            })
            .collect();
        clients.sort_unstable();
        let (id, FileKind::Socket(l)) = (tree.files[*li].id, &mut tree.files[*li].kind) else {
            continue;
        };
        if clients.len() != *count {
            return Err(refuse(
                id,
                l.ino,
                format!(
                    "{count} TCP connection(s) wait to be accepted by the listening socket on \
                     {}, and only {} of their clients are sockets of the tree (a client outside \
                     the tree, or one that is already closed, cannot be made again)",
                    l.local.as_ref().map(describe).unwrap_or_default(),
                    clients.len()
                ),
            ));
        }
        let listener_ino = l.ino;
        if let SockState::Listening { pending, .. } = &mut l.state {
            *pending = clients
                .iter()
                .map(|(ino, _)| PendingConn {
                    client_ino: *ino,
                    ..Default::default()
                })
                .collect();
        }
        for (_, c) in clients {
            if let FileKind::Socket(s) = &mut tree.files[c].kind {
                s.state = SockState::Pending { listener_ino };
            }
        }
    }
    Ok(carrying)
}

/// Takes the connections waiting in the queue of TCP listener `tree.files[li]`, some of which
/// carry what their clients sent (bytes that no descriptor reaches before accept), and makes
/// them again in the running tree, in queue order, recording what each carries in the
/// listener's `pending` (the restore sends it again: [`DeferredHandshake`]).
///
/// Each is accepted from a copy of the listener and read; its server end is put in repair mode
/// and closed, and so is the client (our copy of it, once a new client socket, with its
/// options and file flags, has taken its place in every process that held it): neither says
/// anything to the other, and the connection's addresses are free. The new client binds the
/// old one's address, connects and sends the same bytes: the connection waits in the queue
/// again as it did. Refused before anything is touched where that cannot be done: a client
/// watched by an epoll instance (its registration would not follow) or held outside the tree.
pub(super) fn requeue_tcp(
    frozen: &FrozenTree,
    tree: &mut Tree,
    holders: &HashMap<u32, Vec<(i32, i32, bool)>>,
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
        why: format!(
            "TCP connections that already carry data wait in its queue, and {why}, so they \
             cannot be captured"
        ),
    };
    // The clients: (client's file index, its address).
    let mut clients: Vec<(usize, SockAddr)> = Vec::new();
    let tree_pids: HashSet<i32> = tree.processes.iter().map(|p| p.pid).collect();
    let epoll_targets = epoll_watched_inodes(tree);
    for c in pending {
        let Some(ci) = tree.files.iter().position(|f| {
            matches!(&f.kind, FileKind::Socket(s) if s.ino == c.client_ino && s.family != SockFamily::Unix)
        }) else {
            return Err(refuse(format!("client socket:[{}] is not in the tree", c.client_ino)));
        };
        let FileKind::Socket(cs) = &tree.files[ci].kind else {
            continue;
        };
        if epoll_targets.contains(&c.client_ino) {
            return Err(refuse(format!(
                "client socket:[{}] is watched by an epoll instance",
                c.client_ino
            )));
        }
        let outside = outside_holders(c.client_ino, &tree_pids);
        if !outside.is_empty() {
            return Err(refuse(format!(
                "client socket:[{}] is also{}, outside the tree",
                c.client_ino,
                outside.trim_start_matches(',')
            )));
        }
        let Some(local) = cs.local.clone() else {
            return Err(refuse(format!(
                "client socket:[{}] has no address",
                c.client_ino
            )));
        };
        for (pid, _, _) in holders
            .get(&tree.files[ci].id)
            .map(|h| h.as_slice())
            .unwrap_or(&[])
        {
            ferry_inject::find_syscall_insn(*pid)?;
        }
        clients.push((ci, local));
    }
    let pidfd = pidfd::pidfd_open(lpid).ctx(lpid, || "open a pidfd".into())?;
    let lcopy = pidfd::pidfd_getfd(&pidfd, lfd)
        .ctx(lpid, || format!("take a copy of listening fd {lfd}"))?;
    // Accept them all, in queue order: from here on the connections must be made again.
    let mut accepted: Vec<(usize, Vec<u8>)> = Vec::new();
    for _ in pending {
        let e = sk::accept(lcopy.as_raw_fd(), libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC)
            .ctx(lpid, || format!("accept a waiting connection on fd {lfd}"))?;
        let from = sk::getpeername(e.as_raw_fd())
            .ok()
            .and_then(|raw| decode_addr(&raw));
        let mut data = Vec::new();
        while let Ok(m) = sk::recv(e.as_raw_fd(), PEEK_CHUNK, libc::MSG_DONTWAIT) {
            if m.data.is_empty() {
                break;
            }
            data.extend_from_slice(&m.data);
        }
        // Closed in repair mode: the client hears nothing.
        let _ = sk::tcp_repair(e.as_raw_fd(), sk::TCP_REPAIR_ON);
        drop(e);
        let ci = from
            .as_ref()
            .and_then(|f| clients.iter().find(|(_, a)| same_inet(a, f)))
            .map(|(ci, _)| *ci)
            .ok_or_else(|| Error::Unsupported {
                pid: lpid,
                what: format!("fd {lfd} (socket:[{}])", l.ino),
                why: format!(
                    "a connection accepted from its queue ({}) has no client in the tree; it is \
                     lost",
                    from.as_ref().map(describe).unwrap_or_default()
                ),
            })?;
        accepted.push((ci, data));
    }
    let mut chan: Option<Channel> = None;
    let mut new_pending = Vec::new();
    for (ci, data) in &accepted {
        let cfile = tree.files[*ci].clone();
        let FileKind::Socket(cs) = &cfile.kind else {
            continue;
        };
        let hs = holders.get(&cfile.id).cloned().unwrap_or_default();
        let Some(&(hpid, hfd, _)) = hs.first() else {
            continue;
        };
        let what = || {
            format!(
                "fd {hfd} (socket:[{}]): make its waiting connection again",
                cs.ino
            )
        };
        let p = pidfd::pidfd_open(hpid).ctx(hpid, || "open a pidfd".into())?;
        let old = pidfd::pidfd_getfd(&p, hfd).ctx(hpid, what)?;
        let domain = match cs.family {
            SockFamily::Inet6 => libc::AF_INET6,
            _ => libc::AF_INET,
        };
        let new = sk::socket(domain, libc::SOCK_STREAM | NEW, libc::IPPROTO_TCP).ctx(hpid, what)?;
        apply_opts(new.as_raw_fd(), &cs.opts, false);
        let mask = libc::O_NONBLOCK | libc::O_ASYNC;
        let fl = fdops::get_fl(new.as_raw_fd()).ctx(hpid, what)?;
        fdops::set_fl(new.as_raw_fd(), (fl & !mask) | (cfile.flags & mask)).ctx(hpid, what)?;
        sk::tcp_repair(old.as_raw_fd(), sk::TCP_REPAIR_ON).ctx(hpid, what)?;
        for &(pid, fd, cloexec) in &hs {
            let flags = if cloexec { libc::O_CLOEXEC } else { 0 };
            if chan.is_none() {
                chan = Some(Channel::new(lpid)?);
            }
            chan.as_ref()
                .expect("made above")
                .install(frozen, pid, &new, fd, flags as u64)?;
        }
        // The last reference to the old client: it goes without a word.
        drop(old);
        let local = cs.local.as_ref().map(encode_addr).unwrap_or_default();
        let peer = cs.peer.as_ref().map(encode_addr).unwrap_or_default();
        let h = DeferredHandshake {
            fd: new,
            local,
            peer,
            order: (l.ino, 0),
            data: data.clone(),
            connecting: false,
            what: what(),
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
        let retry = move |op: &dyn Fn() -> ferry_sys::SysResult<()>| loop {
            match op() {
                Err(e)
                    if (e.errno == libc::EADDRINUSE || e.errno == libc::EADDRNOTAVAIL)
                        && std::time::Instant::now() < deadline =>
                {
                    std::thread::sleep(std::time::Duration::from_millis(1))
                }
                r => return r,
            }
        };
        h.make(&retry, deadline)
            .map_err(|(step, e)| Error::Restore {
                pid: hpid,
                what: format!("{}: {step}: {e}", h.what),
            })?;
        new_pending.push(PendingConn {
            client_ino: cs.ino,
            queue: vec![SockMsg {
                data: data.clone(),
                ..Default::default()
            }],
            cred: None,
        });
    }
    if let FileKind::Socket(s) = &mut tree.files[li].kind {
        if let SockState::Listening { pending, .. } = &mut s.state {
            *pending = new_pending;
        }
    }
    Ok(())
}

/// Connection `c` (file index), whose other end is `orphan`: no descriptor holds it, and it
/// lingers in FIN_WAIT2 (its process closed it). If `c` is in CLOSE_WAIT with nothing to send
/// (anything sent to the orphan would draw a reset), it can be made again with a stand-in for
/// the orphan ([`Builder::tcp_conn`]): marks it so and says yes. Otherwise refuses.
fn orphaned_peer(
    tree: &mut Tree,
    refuse: &dyn Fn(u32, u64, String) -> Error,
    c: usize,
    _orphan: &TcpTableEntry,
) -> Result<bool> {
    let id = tree.files[c].id;
    let FileKind::Socket(s) = &mut tree.files[c].kind else {
        return Ok(false);
    };
    let Some(t) = s.tcp.as_deref_mut() else {
        return Ok(false);
    };
    if t.state == TCP_CLOSE_WAIT && t.send_queue.is_empty() {
        t.peer_closed = true;
        s.state = SockState::Connected { peer_ino: 0 };
        return Ok(true);
    }
    Err(refuse(
        id,
        s.ino,
        format!(
            "TCP connection {} -> {} is {} and its other end was closed by its process (it \
             lingers in FIN_WAIT2, held by no descriptor); such a connection moves only in \
             CLOSE_WAIT with nothing left to send",
            s.local.as_ref().map(describe).unwrap_or_default(),
            s.peer.as_ref().map(describe).unwrap_or_default(),
            tcp_state_name(t.state)
        ),
    ))
}

/// Whether a listener bound to `listener` accepts connections made to `to`.
fn listener_reaches(listener: &SockAddr, to: &SockAddr) -> bool {
    let (port, any) = match listener {
        SockAddr::Inet { addr, port } => (*port, *addr == [0; 4]),
        SockAddr::Inet6 { addr, port, .. } => (*port, *addr == [0; 16]),
        _ => return false,
    };
    let to_port = match to {
        SockAddr::Inet { port, .. } | SockAddr::Inet6 { port, .. } => *port,
        _ => return false,
    };
    port == to_port && (any || same_inet(listener, to))
}

/// Checks that client `c` (file index), whose connection waits in the queue of listener `li`,
/// can be made again by connecting it afresh at resume: nothing sent or received on it, and
/// not shut down. Its connection state is dropped (see `Builder::tcp_waiting`).
fn waiting_client(
    tree: &mut Tree,
    refuse: &dyn Fn(u32, u64, String) -> Error,
    c: usize,
    li: usize,
    child: &TcpTableEntry,
) -> Result<()> {
    let listener = match &tree.files[li].kind {
        FileKind::Socket(l) => l.local.as_ref().map(describe).unwrap_or_default(),
        _ => String::new(),
    };
    let id = tree.files[c].id;
    let FileKind::Socket(s) = &mut tree.files[c].kind else {
        return Ok(());
    };
    let conn = format!(
        "TCP connection {} -> {}",
        s.local.as_ref().map(describe).unwrap_or_default(),
        s.peer.as_ref().map(describe).unwrap_or_default()
    );
    let why = if child.state != TCP_ESTABLISHED {
        Some(format!(
            "its other end waits in the queue of the listening socket on {listener} and is {}",
            tcp_state_name(child.state)
        ))
    } else {
        match s.tcp.as_deref() {
            Some(t) if t.state != TCP_ESTABLISHED || t.fin_sent => Some(format!(
                "it waits in the queue of the listening socket on {listener} and is {}",
                tcp_state_name(t.state)
            )),
            Some(t) if !t.send_queue.is_empty() || !s.queue.is_empty() => Some(format!(
                "it waits in the queue of the listening socket on {listener} with bytes in \
                 flight"
            )),
            _ => None,
        }
    };
    if let Some(why) = why {
        return Err(refuse(
            id,
            s.ino,
            format!(
                "{conn}: {why}; only connections waiting to be accepted that are established \
                 and not shut down can be checkpointed"
            ),
        ));
    }
    s.tcp = None;
    s.shutdown = Shutdown::default();
    s.queue.clear();
    Ok(())
}

/// A line of /proc/net/tcp or tcp6.
pub(super) struct TcpTableEntry {
    pub(super) ino: u64,
    pub(super) state: u8,
    /// Bytes received and not read (for a connection).
    pub(super) rx_queue: u64,
}

/// The TCP socket bound to `local` and connected to `peer`, from the network namespace of
/// `pid` (/proc/PID/net/tcp and tcp6), if there is one: its inode (0 for a connection waiting
/// in a listener's queue, which no descriptor reaches yet), state and receive queue.
pub(super) fn tcp_table_entry(
    pid: i32,
    local: &SockAddr,
    peer: &SockAddr,
) -> Option<TcpTableEntry> {
    tcp_table_find(pid, &|l, r, _| same_inet(l, local) && same_inet(r, peer)).map(|(_, e)| e)
}

/// The remote address of the TCP socket with inode `ino`, from the network namespace of `pid`
/// (getpeername(2) does not tell it while the connection is being opened).
pub(super) fn tcp_remote_of(pid: i32, ino: u64) -> Option<SockAddr> {
    tcp_table_find(pid, &|_, _, i| i == ino).map(|(r, _)| r)
}

/// The first line of /proc/PID/net/tcp or tcp6 for which `pick(local, remote, inode)` holds:
/// its remote address and what it says.
fn tcp_table_find(
    pid: i32,
    pick: &dyn Fn(&SockAddr, &SockAddr, u64) -> bool,
) -> Option<(SockAddr, TcpTableEntry)> {
    // "0100007F:1F90": the address as the kernel's u32 words in hex, the port in hex.
    let parse = |field: &str| -> Option<SockAddr> {
        let (a, p) = field.split_once(':')?;
        let port = u16::from_str_radix(p, 16).ok()?;
        let words: Option<Vec<[u8; 4]>> = (0..a.len() / 8)
            .map(|k| {
                u32::from_str_radix(a.get(k * 8..k * 8 + 8)?, 16)
                    .ok()
                    .map(u32::to_ne_bytes)
            })
            .collect();
        let bytes: Vec<u8> = words?.concat();
        match bytes.len() {
            4 => Some(SockAddr::Inet {
                addr: bytes.try_into().ok()?,
                port,
            }),
            16 => Some(SockAddr::Inet6 {
                addr: bytes.try_into().ok()?,
                port,
                flowinfo: 0,
                scope_id: 0,
            }),
            _ => None,
        }
    };
    for table in ["net/tcp", "net/tcp6"] {
        let Ok(text) = procfs::read(pid, table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            if cols.len() <= 9 {
                continue;
            }
            let (Some(l), Some(r)) = (parse(cols[1]), parse(cols[2])) else {
                continue;
            };
            let Ok(ino) = cols[9].parse::<u64>() else {
                continue;
            };
            if pick(&l, &r, ino) {
                // sl local rem st tx_queue:rx_queue tr:when retrnsmt uid timeout inode
                let rx_queue = cols[4]
                    .split_once(':')
                    .and_then(|(_, rx)| u64::from_str_radix(rx, 16).ok())
                    .unwrap_or(0);
                let e = TcpTableEntry {
                    ino,
                    state: u8::from_str_radix(cols[3], 16).ok()?,
                    rx_queue,
                };
                return Some((r, e));
            }
        }
    }
    None
}

/// Just before a captured tree is killed: puts every TCP connection its processes hold into
/// repair mode, so that closing them sends nothing (no FIN, no reset) and leaves nothing
/// behind (no TIME_WAIT): the other end (in the tree too, and dying with it) hears nothing,
/// and the connection's addresses are free at once for the restore. So are the connections
/// in flight in the queues of the tree's UNIX sockets (SCM_RIGHTS, several deep): the kill
/// closes them too, and a FIN of the original could reach the copy's other end, which has
/// the same addresses and expects the same sequence numbers. Errors are logged: the tree
/// dies anyway. Connections whose socket inode is in `spare` are left alone (relayed from
/// home: the home daemon holds them on, for the body).
pub fn silence_tcp_connections(pids: &[i32], spare: &HashSet<u64>) {
    // UNIX sockets whose queues may carry descriptors: (where, our copy), read once each.
    let mut carriers: Vec<(i32, String, OwnedFd)> = Vec::new();
    let mut seen: HashSet<u64> = HashSet::new();
    for &pid in pids {
        let Ok(fds) = procfs::fds(pid) else {
            continue;
        };
        let mut pfd = None;
        for fd in fds {
            let Ok(link) = procfs::readlink(pid, &format!("fd/{fd}")) else {
                continue;
            };
            let Some(ino) = socket_link_ino(&link) else {
                continue;
            };
            if spare.contains(&ino) || !seen.insert(ino) {
                continue;
            }
            if pfd.is_none() {
                match pidfd::pidfd_open(pid) {
                    Ok(p) => pfd = Some(p),
                    Err(_) => break,
                }
            }
            let Some(p) = pfd.as_ref() else { break };
            let Ok(s) = pidfd::pidfd_getfd(p, fd) else {
                continue;
            };
            let what = format!("fd {fd} ({link})");
            if is_unix(s.as_raw_fd()) {
                carriers.push((pid, what, s));
            } else {
                silence(pid, s.as_raw_fd(), &what);
            }
        }
    }
    let me = std::process::id() as i32;
    while let Some((pid, what, carrier)) = carriers.pop() {
        for s in in_flight(carrier.as_raw_fd()) {
            let Some(ino) = procfs::readlink(me, &format!("fd/{}", s.as_raw_fd()))
                .ok()
                .as_deref()
                .and_then(socket_link_ino)
            else {
                continue;
            };
            if spare.contains(&ino) || !seen.insert(ino) {
                continue;
            }
            let inner = format!("socket:[{ino}] in flight in the queue of {what}");
            if is_unix(s.as_raw_fd()) {
                carriers.push((pid, inner, s));
            } else {
                silence(pid, s.as_raw_fd(), &inner);
            }
        }
    }
}

fn socket_link_ino(link: &str) -> Option<u64> {
    link.strip_prefix("socket:[")?
        .strip_suffix(']')?
        .parse()
        .ok()
}

fn is_unix(s: RawFd) -> bool {
    sk::getsockopt_int(s, SOL_SOCKET, libc::SO_DOMAIN).is_ok_and(|d| d == libc::AF_UNIX)
}

/// Puts TCP connection `s` (reached through PID `pid`, named `what` in warnings) in repair
/// mode, if it is one.
fn silence(pid: i32, s: RawFd, what: &str) {
    let tcp =
        sk::getsockopt_int(s, SOL_SOCKET, libc::SO_PROTOCOL).is_ok_and(|p| p == libc::IPPROTO_TCP);
    if !tcp {
        return;
    }
    let state = sk::getsockopt(s, IPPROTO_TCP, libc::TCP_INFO, 1)
        .ok()
        .and_then(|i| i.first().copied())
        .unwrap_or(0);
    if state == 0 || state == TCP_LISTEN || state == 7 {
        return;
    }
    if let Err(e) = sk::tcp_repair(s, sk::TCP_REPAIR_ON) {
        log::warn!(
            "PID {pid}: {what}: {e}: the connection may be reset or linger when the tree dies"
        );
    }
    if state == TCP_CLOSE_WAIT {
        destroy_orphaned_peer(pid, s, what);
    }
}

/// The descriptors in flight (SCM_RIGHTS) in the queue of UNIX socket `s`, peeked (SO_PEEK_OFF
/// is put back afterwards): our copies, sockets only.
fn in_flight(s: RawFd) -> Vec<OwnedFd> {
    let mut out = Vec::new();
    let Ok(old) = sk::getsockopt_int(s, SOL_SOCKET, libc::SO_PEEK_OFF) else {
        return out;
    };
    if sk::setsockopt_int(s, SOL_SOCKET, libc::SO_PEEK_OFF, 0).is_err() {
        return out;
    }
    // Each peek moves the offset on, past the message (or the bytes) it read.
    for _ in 0..1 << 16 {
        let Ok(m) = sk::recv(s, 1 << 16, libc::MSG_PEEK | libc::MSG_DONTWAIT) else {
            break;
        };
        let empty = m.data.is_empty() && m.rights.is_empty();
        // Only a socket answers SO_DOMAIN.
        out.extend(
            m.rights
                .into_iter()
                .filter(|f| sk::getsockopt_int(f.as_raw_fd(), SOL_SOCKET, libc::SO_DOMAIN).is_ok()),
        );
        if empty {
            break;
        }
    }
    let _ = sk::setsockopt_int(s, SOL_SOCKET, libc::SO_PEEK_OFF, old);
    out
}

/// The other end of socket `s` (CLOSE_WAIT, reached through PID `pid`, named `link`), if no descriptor
/// holds it (it lingers in FIN_WAIT2 after its process closed it), is closed at once: a
/// restore makes a stand-in for it, which needs its four addresses.
fn destroy_orphaned_peer(pid: i32, s: RawFd, link: &str) {
    let (Ok(local), Ok(peer)) = (sk::getsockname(s), sk::getpeername(s)) else {
        return;
    };
    let (Some(l), Some(p)) = (decode_addr(&local), decode_addr(&peer)) else {
        return;
    };
    let orphan = tcp_table_entry(pid, &p, &l);
    if !orphan.is_some_and(|o| o.ino == 0 && o.state == TCP_FIN_WAIT2) {
        return;
    }
    // SOCK_DESTROY reaches our network namespace: only if it is the process's too.
    let ours = std::fs::read_link("/proc/self/ns/net").ok();
    let theirs = std::fs::read_link(format!("/proc/{pid}/ns/net")).ok();
    if ours.is_none() || ours != theirs {
        log::warn!(
            "PID {pid}: {link}: the other end ({}, held by no process) lingers: it is in another \
             network namespace than ferry's",
            describe(&p)
        );
        return;
    }
    if let Err(e) = sk::tcp_destroy(&peer, &local) {
        log::warn!(
            "PID {pid}: {link}: close the other end ({}, held by no process): {e}; a restore \
             waits for it to go (tcp_fin_timeout)",
            describe(&p)
        );
    }
}

pub(super) struct DeferredRepair {
    /// A copy of the socket, in repair mode, with its options, neither bound nor connected.
    pub(super) fd: OwnedFd,
    pub(super) local: Vec<u8>,
    pub(super) peer: Vec<u8>,
    pub(super) conn: TcpConn,
    /// The bytes received and not read.
    pub(super) recv: Vec<u8>,
    /// How many bytes at the start of `conn.send_queue` were sent (and not acknowledged).
    pub(super) sent: usize,
    pub(super) opts: Vec<SockOpt>,
    /// SO_REUSEADDR as captured (leaving repair mode clears it).
    pub(super) reuseaddr: i32,
    /// SO_SNDBUF as captured (raised for a moment to send what was never sent).
    pub(super) sndbuf: Option<i32>,
    /// shutdown(SHUT_RD) had been called here (not only the other end's FIN received).
    pub(super) shut_rd: bool,
    pub(super) what: String,
}

/// Runs an operation again while it fails because an address is still in use, until a deadline.
pub(super) type Retry = dyn Fn(&dyn Fn() -> ferry_sys::SysResult<()>) -> ferry_sys::SysResult<()>;

impl DeferredRepair {
    /// Makes the connection in repair mode: its name (bound whoever holds the port: repair
    /// mode forces it), its sequence numbers, connect (which sends nothing in repair mode;
    /// through `retry`, while another socket still owns the four addresses), the options
    /// negotiated, both queues and the window. Errors name the step.
    pub(super) fn make(
        &self,
        retry: &Retry,
    ) -> std::result::Result<(), (String, ferry_sys::SysError)> {
        let f = self.fd.as_raw_fd();
        let t = &self.conn;
        let step = |what: &str| {
            let what = what.to_string();
            move |e: ferry_sys::SysError| (what, e)
        };
        sk::bind(f, &self.local).map_err(step("bind (in repair mode)"))?;
        sk::tcp_repair_queue(f, sk::TCP_SEND_QUEUE).map_err(step("select the send queue"))?;
        sk::set_tcp_queue_seq(f, t.send_seq).map_err(step("set the send sequence"))?;
        sk::tcp_repair_queue(f, sk::TCP_RECV_QUEUE).map_err(step("select the receive queue"))?;
        sk::set_tcp_queue_seq(f, t.recv_seq).map_err(step("set the receive sequence"))?;
        if t.timestamps {
            sk::setsockopt_int(f, IPPROTO_TCP, libc::TCP_TIMESTAMP, t.timestamp as i32)
                .map_err(step("set TCP_TIMESTAMP"))?;
        }
        retry(&|| sk::connect(f, &self.peer)).map_err(step("connect (in repair mode)"))?;
        let mut opts = vec![(sk::TCPOPT_MSS, t.mss_clamp)];
        if let Some((snd, rcv)) = t.wscale {
            opts.push((sk::TCPOPT_WINDOW, u32::from(snd) | (u32::from(rcv) << 16)));
        }
        if t.sack {
            opts.push((sk::TCPOPT_SACK_PERM, 0));
        }
        if t.timestamps {
            opts.push((sk::TCPOPT_TIMESTAMP, 0));
        }
        sk::tcp_repair_options(f, &opts).map_err(step("set the options negotiated"))?;
        // The bytes received and not read: queued as if they had just arrived.
        if !self.recv.is_empty() {
            let want = (self.recv.len().saturating_mul(2) + (1 << 20)).min(i32::MAX as usize / 4);
            let _ = sk::setsockopt_int(f, SOL_SOCKET, libc::SO_RCVBUFFORCE, want as i32);
            sk::tcp_repair_queue(f, sk::TCP_RECV_QUEUE)
                .map_err(step("select the receive queue"))?;
            send_stream(f, &self.recv).map_err(step("refill the receive queue"))?;
        }
        // The bytes sent and not acknowledged: queued as sent (repair mode sends nothing; they
        // go out again when the retransmission timer fires). The bytes never sent are sent
        // for real when the connection leaves repair mode.
        bump_sndbuf(f, t.send_queue.len());
        if self.sent > 0 {
            sk::tcp_repair_queue(f, sk::TCP_SEND_QUEUE).map_err(step("select the send queue"))?;
            send_stream(f, &t.send_queue[..self.sent]).map_err(step("refill the send queue"))?;
        }
        sk::tcp_repair_queue(f, sk::TCP_NO_QUEUE).map_err(step("select no queue"))?;
        // Buffers as they were (raised above to refill the queues). Only they: the other
        // options were set before the bind, and some cannot be set after it (IPV6_V6ONLY).
        let buffers: Vec<SockOpt> = self
            .opts
            .iter()
            .filter(|o| {
                o.level == SOL_SOCKET && (o.name == libc::SO_RCVBUF || o.name == libc::SO_SNDBUF)
            })
            .cloned()
            .collect();
        apply_opts(f, &buffers, true);
        let w = sk::TcpRepairWindow {
            snd_wl1: t.window.snd_wl1,
            snd_wnd: t.window.snd_wnd,
            max_window: t.window.max_window,
            rcv_wnd: t.window.rcv_wnd,
            rcv_wup: t.window.rcv_wup,
        };
        sk::set_tcp_repair_window(f, &w).map_err(step("set the window"))?;
        Ok(())
    }
}

/// Once every connection has left repair mode and sent what it had never sent: the FINs,
/// sent again for real (shutdown(SHUT_WR)) in the order that brings each end back to the state
/// it was captured in, then the shutdown(SHUT_RD)s.
///
/// A FIN that its sender had sent before receiving the other's (FIN_WAIT1, CLOSING) goes
/// first; a FIN the other end had acknowledged (FIN_WAIT2) next, which makes the other end
/// CLOSE_WAIT, or CLOSING if its own FIN went first; a FIN sent after receiving the other's
/// (LAST_ACK) last, once that one has arrived. On loopback a FIN that the other end's full
/// receive buffer held back (a zero window) is held back again, behind the same bytes.
pub(super) fn replay_shutdowns(
    repairs: &[DeferredRepair],
    deadline: std::time::Instant,
    err: &dyn Fn(&str, ferry_sys::SysError) -> Error,
) -> Result<()> {
    let shut = |r: &DeferredRepair| {
        sk::shutdown(r.fd.as_raw_fd(), libc::SHUT_WR).map_err(|e| {
            err(
                &format!("{}: send its FIN again (shutdown SHUT_WR)", r.what),
                e,
            )
        })
    };
    let sent = |states: &'static [u8]| {
        repairs
            .iter()
            .filter(move |r| r.conn.fin_sent && states.contains(&r.conn.state))
    };
    for r in sent(&[TCP_FIN_WAIT1, TCP_CLOSING]) {
        shut(r)?;
    }
    for r in sent(&[TCP_FIN_WAIT2]) {
        shut(r)?;
    }
    let state = |r: &DeferredRepair| {
        sk::getsockopt(r.fd.as_raw_fd(), IPPROTO_TCP, libc::TCP_INFO, 1)
            .ok()
            .and_then(|i| i.first().copied())
    };
    // On loopback a segment arrives at once, or a moment later (when the softirq that
    // delivers it runs on another CPU).
    let wait_for = |r: &DeferredRepair, want: u8| {
        while state(r) != Some(want) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    };
    for r in sent(&[TCP_LAST_ACK]) {
        // Its peer's FIN first.
        wait_for(r, TCP_CLOSE_WAIT);
        shut(r)?;
    }
    // Images that did not record the state: a FIN is a FIN.
    for r in sent(&[0, TCP_ESTABLISHED, TCP_CLOSE_WAIT]) {
        shut(r)?;
    }
    for r in repairs.iter().filter(|r| r.shut_rd) {
        sk::shutdown(r.fd.as_raw_fd(), libc::SHUT_RD)
            .map_err(|e| err(&format!("{}: shutdown(SHUT_RD)", r.what), e))?;
    }
    // The tree runs once every connection is back in its state (a FIN acknowledged, a FIN
    // received), not while the segments that bring it there are on their way.
    for r in repairs.iter().filter(|r| r.conn.state > TCP_ESTABLISHED) {
        wait_for(r, r.conn.state);
        if state(r) != Some(r.conn.state) {
            log::warn!(
                "{}: {} after the restore, not {} as captured",
                r.what,
                state(r).map(tcp_state_name).unwrap_or("unknown"),
                tcp_state_name(r.conn.state)
            );
        }
    }
    Ok(())
}

/// Writes `data` into the queue of socket `f` that repair mode has selected.
pub(super) fn send_stream(f: RawFd, data: &[u8]) -> ferry_sys::SysResult<()> {
    let mut at = 0;
    while at < data.len() {
        let n = sk::send(f, &data[at..], None, &[], libc::MSG_DONTWAIT).map_err(|e| {
            ferry_sys::SysError::new(
                if at == 0 {
                    "send"
                } else {
                    "send (part of the bytes done)"
                },
                e.errno,
            )
        })?;
        if n == 0 {
            return Err(ferry_sys::SysError::new("send (no progress)", libc::EAGAIN));
        }
        at += n;
    }
    Ok(())
}

/// A TCP client whose connection waited in the queue of a listener of the tree, not accepted
/// yet, and carried nothing: the connection is made afresh (a real handshake) when the tree is
/// about to run, from the client's address, so that it waits in the rebuilt listener's queue.
/// Its sequence numbers are new; nothing the program can see depends on them.
pub(super) struct DeferredHandshake {
    /// A copy of the client socket, with its options, neither bound nor connected.
    pub(super) fd: OwnedFd,
    pub(super) local: Vec<u8>,
    pub(super) peer: Vec<u8>,
    /// (the listener's inode, the place in its queue): the connections are made in this order.
    pub(super) order: (u64, usize),
    /// What the client had sent, waiting in the server end: sent again once connected.
    pub(super) data: Vec<u8>,
    /// The connection was still being opened (SYN_SENT): it is opened again, and not waited
    /// for (the other end may still be unable to take it, as it was).
    pub(super) connecting: bool,
    pub(super) what: String,
}

impl DeferredHandshake {
    /// Binds (through `retry`, while the original still holds the address), connects and
    /// waits, until `deadline`, for the handshake to finish. Errors name the step.
    pub(super) fn make(
        &self,
        retry: &Retry,
        deadline: std::time::Instant,
    ) -> std::result::Result<(), (String, ferry_sys::SysError)> {
        let f = self.fd.as_raw_fd();
        retry(&|| sk::bind(f, &self.local)).map_err(|e| ("bind".to_string(), e))?;
        match sk::connect(f, &self.peer) {
            Ok(()) => return self.send_data(f, deadline),
            Err(e) if e.errno == libc::EINPROGRESS && self.connecting => return Ok(()),
            Err(e) if e.errno == libc::EINPROGRESS => {}
            Err(e) => return Err(("connect".into(), e)),
        }
        loop {
            let ev = sk::poll_now(f, libc::POLLOUT).map_err(|e| ("poll".to_string(), e))?;
            if ev & (libc::POLLOUT | libc::POLLERR | libc::POLLHUP) != 0 {
                break;
            }
            if std::time::Instant::now() >= deadline {
                return Err((
                    "connect (no answer from the listener)".into(),
                    ferry_sys::SysError::new("connect", libc::ETIMEDOUT),
                ));
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        match sk::getsockopt_int(f, SOL_SOCKET, libc::SO_ERROR) {
            Ok(0) => {}
            Ok(errno) => {
                return Err(("connect".into(), ferry_sys::SysError::new("connect", errno)))
            }
            Err(e) => return Err(("read SO_ERROR".into(), e)),
        }
        self.send_data(f, deadline)
    }

    /// Sends `data` and waits, until `deadline`, for the server end to have it all (the queue
    /// holds it, not this socket's send buffer).
    fn send_data(
        &self,
        f: RawFd,
        deadline: std::time::Instant,
    ) -> std::result::Result<(), (String, ferry_sys::SysError)> {
        if self.data.is_empty() {
            return Ok(());
        }
        let what = || format!("send the {} bytes the client had sent", self.data.len());
        let mut at = 0;
        while at < self.data.len() {
            match sk::send(f, &self.data[at..], None, &[], libc::MSG_DONTWAIT) {
                Ok(n) => at += n,
                Err(e) if e.errno == libc::EAGAIN && std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(1))
                }
                Err(e) => return Err((what(), e)),
            }
        }
        loop {
            let outq = sk::ioctl_int(f, sk::SIOCOUTQ).map_err(|e| (what(), e))?;
            if outq <= 0 {
                return Ok(());
            }
            if std::time::Instant::now() >= deadline {
                return Err((
                    what(),
                    ferry_sys::SysError::new("wait for the acknowledgement", libc::ETIMEDOUT),
                ));
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

pub(super) struct DeferredListen {
    pub(super) fd: OwnedFd,
    pub(super) backlog: i32,
    pub(super) what: String,
}

impl<'a> Builder<'a> {
    /// A TCP client (socket `i`) whose connection waited in the queue of listener
    /// `listener_ino`: its options now, its address and connection at resume
    /// ([`DeferredHandshake`]).
    pub(super) fn tcp_waiting(&mut self, i: usize, listener_ino: u64) -> Result<()> {
        let s = self.sock(i);
        let (Some(local), Some(peer)) = (s.local.as_ref(), s.peer.as_ref()) else {
            return Err(self.err(i, "a waiting TCP connection without both addresses"));
        };
        if listener_ino == 0 {
            // Still being opened (SYN_SENT): opened again once the connections waiting in
            // the tree's listeners are there again (they come first in the queues).
            apply_opts(self.fd(i), &s.opts, false);
            let fd = self.dup(i)?;
            self.deferred.handshakes.push(DeferredHandshake {
                fd,
                local: encode_addr(local),
                peer: encode_addr(peer),
                order: (u64::MAX, i),
                data: Vec::new(),
                connecting: true,
                what: format!(
                    "socket:[{}]: TCP connection {} -> {} (being opened)",
                    s.ino,
                    describe(local),
                    describe(peer)
                ),
            });
            return Ok(());
        }
        let place = (0..self.socks.len())
            .map(|j| self.sock(j))
            .find(|l| l.ino == listener_ino && l.family != SockFamily::Unix)
            .and_then(|l| match &l.state {
                SockState::Listening { pending, .. } => pending
                    .iter()
                    .position(|c| c.client_ino == s.ino)
                    .map(|k| (k, &pending[k].queue)),
                _ => None,
            })
            .ok_or_else(|| {
                self.err(
                    i,
                    format!("it waits in the queue of socket:[{listener_ino}], not a TCP listener of the image"),
                )
            })?;
        let (place, waiting) = place;
        apply_opts(self.fd(i), &s.opts, false);
        let fd = self.dup(i)?;
        self.deferred.handshakes.push(DeferredHandshake {
            fd,
            local: encode_addr(local),
            peer: encode_addr(peer),
            order: (listener_ino, place),
            data: waiting
                .iter()
                .flat_map(|m| m.data.iter().copied())
                .collect(),
            connecting: false,
            what: format!(
                "socket:[{}]: TCP connection {} -> {} (waiting to be accepted)",
                s.ino,
                describe(local),
                describe(peer)
            ),
        });
        Ok(())
    }

    /// Makes the socket of an established TCP connection, with its options, in repair mode.
    /// Everything that needs the connection's addresses (its name, its sequence numbers,
    /// connect, the options negotiated, both queues and the window) waits for
    /// [`Deferred::complete`]: while the tree is rebuilt, the original of a migration between
    /// nodes of one machine still owns the connection's four addresses (a socket cannot be
    /// connected, even in repair mode, where another is), and a socket bound to a listener's
    /// port would keep that listener from listening. It leaves repair mode (and sends what was
    /// never sent) once every connection of the tree is made.
    pub(super) fn tcp_conn(&mut self, i: usize) -> Result<()> {
        let s = self.sock(i);
        let Some(t) = s.tcp.as_ref() else {
            return Ok(());
        };
        let (Some(local), Some(peer)) = (s.local.as_ref(), s.peer.as_ref()) else {
            return Err(self.err(i, "an established TCP connection without both addresses"));
        };
        let conn = format!("TCP connection {} -> {}", describe(local), describe(peer));
        let e =
            |what: &str, err: ferry_sys::SysError| self.err(i, format!("{conn}: {what}: {err}"));
        let domain = match s.family {
            SockFamily::Inet6 => libc::AF_INET6,
            _ => libc::AF_INET,
        };
        let fd = sk::socket(domain, libc::SOCK_STREAM | NEW, libc::IPPROTO_TCP)
            .map_err(|err| e("socket", err))?;
        let f = fd.as_raw_fd();
        // Options before repair mode: SO_REUSEADDR would undo the forced reuse it brings.
        apply_opts(f, &s.opts, false);
        sk::tcp_repair(f, sk::TCP_REPAIR_ON).map_err(|err| e("enter repair mode", err))?;
        let dup = fd
            .try_clone()
            .map_err(|err| self.err(i, format!("{conn}: dup: {err}")))?;
        self.fds[i] = Some(fd);
        let sent = t.send_queue.len() - (t.unsent as usize).min(t.send_queue.len());
        self.deferred.repairs.push(DeferredRepair {
            fd: dup,
            local: encode_addr(local),
            peer: encode_addr(peer),
            conn: (**t).clone(),
            recv: s
                .queue
                .iter()
                .flat_map(|m| m.data.iter().copied())
                .collect(),
            sent,
            opts: s.opts.clone(),
            reuseaddr: opt_int(s, SOL_SOCKET, libc::SO_REUSEADDR).unwrap_or(0),
            sndbuf: opt_int(s, SOL_SOCKET, libc::SO_SNDBUF),
            shut_rd: s.shutdown.read && !t.fin_received,
            what: format!("socket:[{}]: {conn}", s.ino),
        });
        if t.peer_closed {
            self.stand_in(i, domain, local, peer, t)?;
        }
        Ok(())
    }

    /// A stand-in for the other end of connection `i` (CLOSE_WAIT), which its process had
    /// closed (see `orphaned_peer`): made in repair mode as that end must have been, from
    /// what this end knows (its sequence numbers, window and options, mirrored; no
    /// timestamps: its clock is not known, and a segment without one is taken), it sends its
    /// FIN again at resume, and is closed at the end of [`Deferred::complete`]: it lingers in
    /// FIN_WAIT2, held by no process, as the original did.
    fn stand_in(
        &mut self,
        i: usize,
        domain: i32,
        local: &SockAddr,
        peer: &SockAddr,
        t: &TcpConn,
    ) -> Result<()> {
        let s = self.sock(i);
        let what = format!(
            "socket:[{}]: a stand-in for {}, the closed other end of its TCP connection",
            s.ino,
            describe(peer)
        );
        let e =
            |step: &str, err: ferry_sys::SysError| self.err(i, format!("{what}: {step}: {err}"));
        let fd = sk::socket(domain, libc::SOCK_STREAM | NEW, libc::IPPROTO_TCP)
            .map_err(|err| e("socket", err))?;
        sk::tcp_repair(fd.as_raw_fd(), sk::TCP_REPAIR_ON)
            .map_err(|err| e("enter repair mode", err))?;
        let queued: usize = s.queue.iter().map(|m| m.data.len()).sum();
        let rcv_nxt = t.recv_seq.wrapping_add(queued as u32);
        let conn = TcpConn {
            send_seq: rcv_nxt,
            recv_seq: t.send_seq,
            send_queue: Vec::new(),
            unsent: 0,
            mss_clamp: t.mss_clamp,
            wscale: t.wscale.map(|(snd, rcv)| (rcv, snd)),
            sack: t.sack,
            timestamps: false,
            timestamp: 0,
            window: TcpWindow {
                snd_wl1: t.send_seq,
                snd_wnd: t.window.rcv_wnd,
                max_window: t.window.rcv_wnd.max(t.window.snd_wnd),
                rcv_wnd: t.window.snd_wnd,
                rcv_wup: t.send_seq,
            },
            fin_sent: true,
            fin_received: false,
            peer_closed: false,
            state: TCP_FIN_WAIT2,
        };
        self.deferred.repairs.push(DeferredRepair {
            fd,
            local: encode_addr(peer),
            peer: encode_addr(local),
            conn,
            recv: Vec::new(),
            sent: 0,
            opts: Vec::new(),
            reuseaddr: 0,
            sndbuf: None,
            shut_rd: false,
            what,
        });
        Ok(())
    }
}
