//! What TCP and UDP sockets share: their capture (names, state, options) and their rebuild
//! (options, name, and listen or connect).

use super::*;

impl Cap<'_> {
    pub(super) fn inet(&self, domain: i32, ty: SockType, protocol: i32) -> Result<SocketDesc> {
        if ty == SockType::Raw {
            return self.raw(domain, protocol);
        }
        if ty == SockType::Dgram
            && (protocol == libc::IPPROTO_ICMP || protocol == ping::IPPROTO_ICMPV6)
        {
            return self.ping(domain, protocol);
        }
        let family = if domain == libc::AF_INET {
            SockFamily::Inet
        } else {
            SockFamily::Inet6
        };
        let fam_opts = if domain == libc::AF_INET {
            IPV4_OPTS
        } else {
            IPV6_OPTS
        };
        let mut desc = SocketDesc {
            ino: self.ino,
            family,
            sock_type: ty,
            protocol,
            local: self.name(false)?,
            ..Default::default()
        };
        let local = desc
            .local
            .as_ref()
            .map(describe)
            .unwrap_or_else(|| "an unbound socket".into());
        match ty {
            SockType::Stream if protocol == libc::IPPROTO_TCP => {
                let info = sk::getsockopt(self.s, IPPROTO_TCP, libc::TCP_INFO, TCP_INFO_LEN)
                    .ctx(self.pid, || self.what("read TCP_INFO"))?;
                let word = |at: usize| {
                    info.get(at..at + 4)
                        .map(|b| u32::from_ne_bytes(b.try_into().expect("4 bytes")))
                        .unwrap_or(0)
                };
                match info.first().copied().unwrap_or(0) {
                    TCP_LISTEN => {
                        // tcpi_unacked: the connections waiting to be accepted; tcpi_sacked:
                        // the backlog. Each waiting connection's client must be a socket of
                        // the tree: `tcp_peers` finds them and fills `pending` in.
                        let (waiting, backlog) = (word(24), word(28));
                        desc.state = SockState::Listening {
                            backlog,
                            pending: vec![PendingConn::default(); waiting as usize],
                        };
                    }
                    7 => {}
                    TCP_SYN_SENT => {
                        // Being opened: made again at resume by connecting afresh (the
                        // handshake has nothing to keep yet).
                        desc.peer = tcp_remote_of(self.pid, self.ino);
                        if desc.local.is_none() || desc.peer.is_none() {
                            return Err(self.refuse(format!(
                                "the TCP connection from {local} being opened (SYN_SENT) has \
                                 no address to connect to in /proc/{}/net/tcp",
                                self.pid
                            )));
                        }
                        desc.state = SockState::Pending { listener_ino: 0 };
                    }
                    st @ (TCP_ESTABLISHED | TCP_FIN_WAIT1 | TCP_FIN_WAIT2 | TCP_CLOSE_WAIT
                    | TCP_LAST_ACK | TCP_CLOSING) => {
                        desc.peer = self.name(true)?;
                        let peer = desc
                            .peer
                            .as_ref()
                            .map(describe)
                            .unwrap_or_else(|| "?".into());
                        // Options first: repair mode changes what SO_REUSEADDR reads.
                        desc.opts =
                            capture_opts(self.s, &[INET_OPTS, fam_opts, TCP_OPTS, TCP_CONN_OPTS]);
                        // Multicast options mean nothing to TCP, cannot be set on it, and
                        // read differently on accepted sockets (the peer's TTL).
                        desc.opts.retain(|o| !is_multicast_opt(o));
                        let conn = format!("TCP connection {local} -> {peer}");
                        // Shut down for reading: by shutdown(SHUT_RD), or by the peer's FIN.
                        let ev = sk::poll_now(self.s, libc::POLLRDHUP)
                            .ctx(self.pid, || self.what("poll"))?;
                        let (tcp, queue) = self.tcp_conn(&info, &conn)?;
                        desc.shutdown = Shutdown {
                            read: ev & libc::POLLRDHUP != 0 || tcp.fin_received,
                            write: tcp.fin_sent,
                        };
                        debug_assert_eq!(tcp.state, st);
                        desc.tcp = Some(Box::new(tcp));
                        desc.queue = queue;
                        // The other end, a socket of the tree, is found in finish_capture.
                        desc.state = SockState::Connected { peer_ino: 0 };
                        return Ok(desc);
                    }
                    s => {
                        let peer = self
                            .name(true)?
                            .map(|p| describe(&p))
                            .unwrap_or_else(|| "?".into());
                        return Err(self.refuse(format!(
                            "TCP connection {local} -> {peer} is {}; only established, \
                             half-closed and closing TCP connections, and ones being opened by \
                             connect() (SYN_SENT), can be checkpointed",
                            tcp_state_name(s)
                        )));
                    }
                }
                desc.opts = capture_opts(self.s, &[INET_OPTS, fam_opts, TCP_OPTS]);
            }
            SockType::Dgram if protocol == libc::IPPROTO_UDP || protocol == IPPROTO_UDPLITE => {
                desc.peer = self.name(true)?;
                if desc.peer.is_some() {
                    desc.state = SockState::Connected { peer_ino: 0 };
                }
                desc.opts = capture_opts(self.s, &[INET_OPTS, fam_opts, UDP_OPTS]);
                desc.shutdown = self.dgram_shutdown(domain, protocol)?;
                let ev = sk::poll_now(self.s, libc::POLLIN).ctx(self.pid, || self.what("poll"))?;
                if ev & libc::POLLIN != 0 {
                    if ev & libc::POLLERR != 0 {
                        return Err(self.refuse(
                            "it has both a pending error and queued datagrams; reading them \
                             would clear the error",
                        ));
                    }
                    desc.queue = self.peek_messages(None, false, true)?;
                }
            }
            _ => {
                return Err(self.refuse(format!(
                    "{} sockets of protocol {protocol} are not supported (only TCP, UDP and \
                     ICMP echo)",
                    if domain == libc::AF_INET {
                        "IPv4"
                    } else {
                        "IPv6"
                    }
                )))
            }
        }
        Ok(desc)
    }
}

impl Cap<'_> {
    /// What a datagram socket has shut down (shutdown(2) records it even on an unconnected
    /// socket, which it answers with ENOTCONN): poll tells a shutdown for reading, sock_diag a
    /// shutdown for writing.
    pub(super) fn dgram_shutdown(&self, domain: i32, protocol: i32) -> Result<Shutdown> {
        let ev = sk::poll_now(self.s, libc::POLLRDHUP).ctx(self.pid, || self.what("poll"))?;
        let mut sh = Shutdown {
            read: ev & libc::POLLRDHUP != 0,
            write: ev & libc::POLLHUP != 0,
        };
        if let Ok(Some(bits)) = sk::inet_diag_shutdown(domain, protocol, self.ino) {
            sh.read |= bits & RCV_SHUTDOWN != 0;
            sh.write |= bits & SEND_SHUTDOWN != 0;
        }
        Ok(sh)
    }
}

/// Whether two socket addresses name the same TCP or UDP endpoint (flow labels and scope
/// aside; an IPv4-mapped IPv6 address is its IPv4 address).
pub(super) fn same_inet(a: &SockAddr, b: &SockAddr) -> bool {
    let v4 = |x: &SockAddr| match x {
        SockAddr::Inet6 { addr, port, .. } => std::net::Ipv6Addr::from(*addr)
            .to_ipv4_mapped()
            .map(|v| SockAddr::Inet {
                addr: v.octets(),
                port: *port,
            })
            .unwrap_or_else(|| x.clone()),
        _ => x.clone(),
    };
    match (&v4(a), &v4(b)) {
        (SockAddr::Inet { addr: x, port: p }, SockAddr::Inet { addr: y, port: q }) => {
            x == y && p == q
        }
        (
            SockAddr::Inet6 {
                addr: x, port: p, ..
            },
            SockAddr::Inet6 {
                addr: y, port: q, ..
            },
        ) => x == y && p == q,
        _ => false,
    }
}

impl<'a> Builder<'a> {
    /// Options, name, and listen or connect, for a TCP or UDP socket. Where another socket
    /// holds the address (see [`Deferred`]), a TCP socket is bound anyway (TCP_REPAIR) and
    /// listens later; a UDP socket is bound and connected later.
    pub(super) fn inet(&mut self, i: usize) -> Result<()> {
        let s = self.sock(i);
        if let SockState::Pending { listener_ino } = s.state {
            return self.tcp_waiting(i, listener_ino);
        }
        let f = self.fd(i);
        apply_opts(f, &s.opts, false);
        if let Some(local) = &s.local {
            let raw = encode_addr(local);
            if let Err(e) = sk::bind(f, &raw) {
                let what = format!("bind to {}", describe(local));
                if e.errno != libc::EADDRINUSE {
                    return Err(self.err(i, format!("{what}: {e}")));
                }
                let reuse = opt_int(s, SOL_SOCKET, libc::SO_REUSEADDR).unwrap_or(0);
                if s.sock_type == SockType::Stream {
                    // The original holds the port, or connections of an earlier incarnation
                    // linger on it (TIME_WAIT).
                    sk::bind_forced(f, &raw, reuse).map_err(|e| {
                        self.err(i, format!("{what} (forced, in TCP repair mode): {e}"))
                    })?;
                } else {
                    let fd = self.dup(i)?;
                    let what = format!("socket:[{}]: {what}", s.ino);
                    self.deferred.binds.push(DeferredBind {
                        fd,
                        local: raw,
                        peer: s.peer.as_ref().map(encode_addr),
                        what,
                    });
                    return Ok(());
                }
            }
        }
        match &s.state {
            SockState::Listening { backlog, .. } => match sk::listen(f, *backlog as i32) {
                Ok(()) => {}
                Err(e) if e.errno == libc::EADDRINUSE => {
                    let fd = self.dup(i)?;
                    let what = format!(
                        "socket:[{}]: listen on {}",
                        s.ino,
                        s.local.as_ref().map(describe).unwrap_or_default()
                    );
                    self.deferred.listens.push(DeferredListen {
                        fd,
                        backlog: *backlog as i32,
                        what,
                    });
                }
                Err(e) => return Err(self.err(i, format!("listen: {e}"))),
            },
            SockState::Connected { .. } => {
                if let Some(peer) = &s.peer {
                    sk::connect(f, &encode_addr(peer))
                        .map_err(|e| self.err(i, format!("connect to {}: {e}", describe(peer))))?;
                }
            }
            _ => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcp_ends_match_across_ipv4_mapped_addresses() {
        let v4 = SockAddr::Inet {
            addr: [127, 0, 0, 1],
            port: 80,
        };
        let mapped = SockAddr::Inet6 {
            addr: std::net::Ipv4Addr::new(127, 0, 0, 1)
                .to_ipv6_mapped()
                .octets(),
            port: 80,
            flowinfo: 3,
            scope_id: 0,
        };
        assert!(same_inet(&v4, &mapped) && same_inet(&mapped, &v4));
        assert!(!same_inet(
            &v4,
            &SockAddr::Inet {
                addr: [127, 0, 0, 1],
                port: 81
            }
        ));
        let lo6 = SockAddr::Inet6 {
            addr: std::net::Ipv6Addr::LOCALHOST.octets(),
            port: 80,
            flowinfo: 0,
            scope_id: 0,
        };
        assert!(!same_inet(&v4, &lo6));
    }
}
