//! UDP sockets: binds and datagrams left until the tree is about to run, and the senders
//! their queued datagrams are put back from.

use super::*;

pub(super) struct DeferredBind {
    pub(super) fd: OwnedFd,
    pub(super) local: Vec<u8>,
    pub(super) peer: Option<Vec<u8>>,
    pub(super) what: String,
}

pub(super) struct DeferredDatagram {
    /// A copy of the sending socket of the tree, or a throwaway socket.
    pub(super) from: OwnedFd,
    pub(super) to: Vec<u8>,
    pub(super) data: Vec<u8>,
    pub(super) what: String,
}

impl<'a> Builder<'a> {
    /// Queues socket `r`'s datagrams for [`Deferred::complete`], each with a copy of its
    /// sender (or a throwaway socket, as [`Builder::fill_queues`] would send it from).
    pub(super) fn defer_datagrams(&mut self, r: usize, to: &[u8]) -> Result<()> {
        let s = self.sock(r);
        for m in &s.queue {
            let from = if let Some(j) = m.from.as_ref().and_then(|f| self.inet_sender(f)) {
                self.dup(j)?
            } else if let Some(t) = m.from.as_ref().and_then(|f| self.inet_temp(r, f)) {
                t
            } else {
                let d = match s.family {
                    SockFamily::Inet6 => libc::AF_INET6,
                    _ => libc::AF_INET,
                };
                sk::socket(d, libc::SOCK_DGRAM | NEW, 0).map_err(|e| self.err(r, e))?
            };
            self.deferred.datagrams.push(DeferredDatagram {
                from,
                to: to.to_vec(),
                data: m.data.clone(),
                what: format!("socket:[{}]", s.ino),
            });
        }
        Ok(())
    }

    /// The UDP socket of the tree a datagram from `from` came from, if any.
    pub(super) fn inet_sender(&self, from: &SockAddr) -> Option<usize> {
        (0..self.socks.len()).find(|&j| {
            let s = self.sock(j);
            s.family != SockFamily::Unix
                && s.sock_type == SockType::Dgram
                && !ping::is_ping(s.family, s.sock_type, s.protocol)
                && s.local.as_ref().is_some_and(|l| same_endpoint(l, from))
        })
    }

    /// A throwaway UDP socket bound to `from`, if that address can be had.
    pub(super) fn inet_temp(&self, r: usize, from: &SockAddr) -> Option<OwnedFd> {
        let (d, level, freebind) = match from {
            SockAddr::Inet { .. } => (libc::AF_INET, IPPROTO_IP, libc::IP_FREEBIND),
            SockAddr::Inet6 { .. } => (libc::AF_INET6, IPPROTO_IPV6, 78),
            _ => return None,
        };
        let t = sk::socket(d, libc::SOCK_DGRAM | NEW, 0).ok()?;
        let _ = sk::setsockopt_int(t.as_raw_fd(), SOL_SOCKET, libc::SO_REUSEADDR, 1);
        let _ = sk::setsockopt_int(t.as_raw_fd(), level, freebind, 1);
        match sk::bind(t.as_raw_fd(), &encode_addr(from)) {
            Ok(()) => Some(t),
            Err(e) => {
                log::warn!(
                    "socket:[{}]: a queued datagram from {} is put back from another address \
                     ({e})",
                    self.sock(r).ino,
                    describe(from)
                );
                None
            }
        }
    }
}

/// `a` with an unspecified address replaced by loopback: where to send to reach a socket
/// bound to the wildcard address.
pub(super) fn loopback_if_any(a: &SockAddr) -> SockAddr {
    match a {
        SockAddr::Inet { addr, port } if *addr == [0; 4] => SockAddr::Inet {
            addr: [127, 0, 0, 1],
            port: *port,
        },
        SockAddr::Inet6 { addr, port, .. } if *addr == [0; 16] => SockAddr::Inet6 {
            addr: std::net::Ipv6Addr::LOCALHOST.octets(),
            port: *port,
            flowinfo: 0,
            scope_id: 0,
        },
        other => other.clone(),
    }
}

/// Whether a socket bound to `local` sends from `from`.
pub(super) fn same_endpoint(local: &SockAddr, from: &SockAddr) -> bool {
    match (local, from) {
        (SockAddr::Inet { addr: a, port: p }, SockAddr::Inet { addr: b, port: q }) => {
            p == q && (a == b || *a == [0; 4])
        }
        (
            SockAddr::Inet6 {
                addr: a, port: p, ..
            },
            SockAddr::Inet6 {
                addr: b, port: q, ..
            },
        ) => p == q && (a == b || *a == [0; 16]),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_match_wildcard_binds() {
        let any = SockAddr::Inet {
            addr: [0; 4],
            port: 5,
        };
        let lo = SockAddr::Inet {
            addr: [127, 0, 0, 1],
            port: 5,
        };
        assert!(same_endpoint(&any, &lo));
        assert!(same_endpoint(&lo, &lo));
        assert!(!same_endpoint(&lo, &any));
        assert_eq!(loopback_if_any(&any), lo);
    }
}
