//! ICMP ping sockets (SOCK_DGRAM over IPPROTO_ICMP or IPPROTO_ICMPV6, what `ping` uses without
//! privileges): their identifier (the port of their name), the address they are bound and
//! connected to, their options, and the echo replies waiting in their queue.
//!
//! The kernel gives an echo reply to the ping socket whose identifier it carries, so a queued
//! reply (unlike a raw socket's packets) was meant for this socket alone, and can be delivered
//! to it again: the restore makes the reply packet again, from its original source to the
//! socket's address, and sends it over this machine's loopback through a raw socket that
//! writes its own IP header (IPPROTO_RAW). ICMP's checksum does not cover the IPv4 addresses,
//! so an IPv4 reply goes out exactly as it came; ICMPv6's covers them, and is computed again.
//!
//! Creating a ping socket needs the creator's group in `net.ipv4.ping_group_range` (it covers
//! IPv6 too); the restorer makes them, so that range must include its group where the tree is
//! rebuilt, or the restore fails naming it.

use super::*;

pub(super) const IPPROTO_ICMPV6: i32 = 58;

/// Whether a socket of `family`, `ty` and `protocol` is a ping socket.
pub(super) fn is_ping(family: SockFamily, ty: SockType, protocol: i32) -> bool {
    ty == SockType::Dgram
        && match family {
            SockFamily::Inet => protocol == libc::IPPROTO_ICMP,
            SockFamily::Inet6 => protocol == IPPROTO_ICMPV6,
            _ => false,
        }
}

impl Cap<'_> {
    pub(super) fn ping(&self, domain: i32, protocol: i32) -> Result<SocketDesc> {
        let (family, fam_opts, table) = if domain == libc::AF_INET {
            (SockFamily::Inet, IPV4_OPTS, "net/icmp")
        } else {
            (SockFamily::Inet6, IPV6_OPTS, "net/icmp6")
        };
        let mut desc = SocketDesc {
            ino: self.ino,
            family,
            sock_type: SockType::Dgram,
            protocol,
            local: self.name(false)?,
            opts: capture_opts(self.s, &[INET_OPTS, fam_opts]),
            ..Default::default()
        };
        // A ping socket connected with port 0 (as everyone does) answers ENOTCONN to
        // getpeername(2): its table says where it is connected.
        desc.peer = raw::connected_to(self.pid, table, self.ino);
        if desc.peer.is_some() {
            desc.state = SockState::Connected { peer_ino: 0 };
        }
        desc.shutdown = self.dgram_shutdown(domain, protocol)?;
        let ev = sk::poll_now(self.s, libc::POLLIN).ctx(self.pid, || self.what("poll"))?;
        if ev & libc::POLLIN != 0 {
            if ev & libc::POLLERR != 0 {
                return Err(self.refuse(
                    "it has both a pending error and queued echo replies; reading them would \
                     clear the error",
                ));
            }
            desc.queue = self.read_out_replies(desc.local.as_ref())?;
        }
        Ok(desc)
    }

    /// The echo replies queued in the socket. A ping socket has no SO_PEEK_OFF, so that a
    /// peek sees only the first: they are read, then delivered to it again at once, in order
    /// (behind any reply that arrives meanwhile).
    fn read_out_replies(&self, local: Option<&SockAddr>) -> Result<Vec<SockMsg>> {
        let mut out = Vec::new();
        let mut failed = None;
        loop {
            match sk::recv(self.s, 1 << 16, libc::MSG_DONTWAIT) {
                Ok(m) if m.flags & libc::MSG_TRUNC == 0 => out.push(SockMsg {
                    data: m.data,
                    from: decode_addr(&m.from),
                    rights: Vec::new(),
                }),
                Ok(_) => {
                    failed = Some("a queued echo reply is larger than 64 KiB".to_string());
                    break;
                }
                Err(e) if e.errno == libc::EAGAIN => break,
                Err(e) => {
                    failed = Some(format!("read its queued echo replies: {e}"));
                    break;
                }
            }
        }
        if !out.is_empty() {
            let local = local.ok_or_else(|| {
                self.refuse("echo replies are queued on a socket with no identifier (lost)")
            })?;
            deliver(local, &out).map_err(|(at, e)| {
                self.refuse(format!(
                    "its queued echo replies were read out but could not be put back ({} of {} \
                     lost): {e}",
                    out.len() - at,
                    out.len()
                ))
            })?;
        }
        match failed {
            Some(why) => Err(self.refuse(why)),
            None => Ok(out),
        }
    }
}

/// Delivers echo replies `msgs` to the ping socket bound to `local` (the address made
/// loopback if it is the wildcard), each from its source, over this network namespace's
/// loopback; or (how many went, why the next did not).
fn deliver(local: &SockAddr, msgs: &[SockMsg]) -> std::result::Result<(), (usize, String)> {
    let local = loopback_if_any(local);
    let domain = match local {
        SockAddr::Inet6 { .. } => libc::AF_INET6,
        _ => libc::AF_INET,
    };
    let raw = sk::socket(domain, libc::SOCK_RAW | NEW, libc::IPPROTO_RAW)
        .map_err(|e| (0, format!("a raw socket to deliver them: {e}")))?;
    let to = encode_addr(&without_port(&local));
    for (at, m) in msgs.iter().enumerate() {
        let from = m.from.clone().unwrap_or_else(|| without_port(&local));
        let packet = reply_packet(&from, &local, &m.data).ok_or_else(|| {
            (
                at,
                format!(
                    "a reply from {} cannot be sent to {}",
                    describe(&from),
                    describe(&local)
                ),
            )
        })?;
        sk::send(raw.as_raw_fd(), &packet, Some(&to), &[], libc::MSG_DONTWAIT)
            .map_err(|e| (at, format!("send a reply from {}: {e}", describe(&from))))?;
    }
    Ok(())
}

impl Builder<'_> {
    /// Delivers the echo replies queued in ping socket `r` again, or leaves them for
    /// [`Deferred::complete`] when some socket of the tree gets its address only then (this
    /// one, whose identifier the original of a migration may still hold, among them).
    pub(super) fn requeue_ping_replies(&mut self, r: usize) -> Result<()> {
        let s = self.sock(r);
        let local = s
            .local
            .as_ref()
            .ok_or_else(|| self.err(r, "echo replies are queued on a socket with no identifier"))?;
        if self.deferred.binds.is_empty() {
            return deliver(local, &s.queue).map_err(|(_, e)| {
                self.err(r, format!("deliver its queued echo replies again: {e}"))
            });
        }
        self.deferred.pings.push(DeferredPings {
            local: local.clone(),
            msgs: s.queue.clone(),
            what: format!("socket:[{}]: deliver its queued echo replies again", s.ino),
        });
        Ok(())
    }
}

pub(super) struct DeferredPings {
    local: SockAddr,
    msgs: Vec<SockMsg>,
    pub(super) what: String,
}

impl DeferredPings {
    pub(super) fn deliver(&self) -> std::result::Result<(), String> {
        deliver(&self.local, &self.msgs).map_err(|(_, e)| e)
    }
}

/// `a` with port 0 (a raw socket's destination; a ping socket's port is its identifier).
fn without_port(a: &SockAddr) -> SockAddr {
    match a {
        SockAddr::Inet { addr, .. } => SockAddr::Inet {
            addr: *addr,
            port: 0,
        },
        SockAddr::Inet6 {
            addr,
            flowinfo,
            scope_id,
            ..
        } => SockAddr::Inet6 {
            addr: *addr,
            port: 0,
            flowinfo: *flowinfo,
            scope_id: *scope_id,
        },
        other => other.clone(),
    }
}

/// The IP packet that carries ICMP message `icmp` (as a ping socket reads it: from its ICMP
/// header on) from `from` to `to`, or `None` if the two are not addresses of one family.
fn reply_packet(from: &SockAddr, to: &SockAddr, icmp: &[u8]) -> Option<Vec<u8>> {
    match (from, to) {
        (SockAddr::Inet { addr: src, .. }, SockAddr::Inet { addr: dst, .. }) => {
            let len = u16::try_from(20 + icmp.len()).ok()?;
            let mut p = Vec::with_capacity(len as usize);
            // Version 4, 5 words; the kernel fills in the identification and checksum.
            p.extend_from_slice(&[0x45, 0]);
            p.extend_from_slice(&len.to_be_bytes());
            p.extend_from_slice(&[0, 0, 0, 0, 64, libc::IPPROTO_ICMP as u8, 0, 0]);
            p.extend_from_slice(src);
            p.extend_from_slice(dst);
            p.extend_from_slice(icmp);
            Some(p)
        }
        (SockAddr::Inet6 { addr: src, .. }, SockAddr::Inet6 { addr: dst, .. }) => {
            let len = u16::try_from(icmp.len()).ok()?;
            if icmp.len() < 4 {
                return None;
            }
            let mut msg = icmp.to_vec();
            msg[2..4].copy_from_slice(&[0, 0]);
            let sum = icmpv6_checksum(src, dst, &msg);
            msg[2..4].copy_from_slice(&sum.to_be_bytes());
            let mut p = Vec::with_capacity(40 + msg.len());
            p.extend_from_slice(&0x6000_0000u32.to_be_bytes());
            p.extend_from_slice(&len.to_be_bytes());
            p.extend_from_slice(&[IPPROTO_ICMPV6 as u8, 64]);
            p.extend_from_slice(src);
            p.extend_from_slice(dst);
            p.extend_from_slice(&msg);
            Some(p)
        }
        _ => None,
    }
}

/// The Internet checksum of ICMPv6 message `msg` (its checksum field zero) from `src` to
/// `dst`, over the IPv6 pseudo-header (RFC 8200, 8.1).
fn icmpv6_checksum(src: &[u8; 16], dst: &[u8; 16], msg: &[u8]) -> u16 {
    let mut pseudo = Vec::with_capacity(40 + msg.len() + 1);
    pseudo.extend_from_slice(src);
    pseudo.extend_from_slice(dst);
    pseudo.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    pseudo.extend_from_slice(&[0, 0, 0, IPPROTO_ICMPV6 as u8]);
    pseudo.extend_from_slice(msg);
    if pseudo.len() % 2 == 1 {
        pseudo.push(0);
    }
    let mut sum: u32 = pseudo
        .chunks(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn icmpv6_checksum_matches_a_kernel_reply() {
        // An echo reply the kernel sent from ::1 to ::1 (id 0x9d4b, seq 7, "hello").
        let lo = std::net::Ipv6Addr::LOCALHOST.octets();
        let mut msg = b"\x81\x00\x00\x00\x9d\x4b\x00\x07hello".to_vec();
        assert_eq!(icmpv6_checksum(&lo, &lo, &msg), 0x9d91);
        msg[2..4].copy_from_slice(&[0x9d, 0x91]);
        let p = reply_packet(
            &SockAddr::Inet6 {
                addr: lo,
                port: 0,
                flowinfo: 0,
                scope_id: 0,
            },
            &SockAddr::Inet6 {
                addr: lo,
                port: 0x9d4b,
                flowinfo: 0,
                scope_id: 0,
            },
            &msg,
        )
        .unwrap();
        assert_eq!(p.len(), 40 + msg.len());
        assert_eq!(&p[40..], &msg[..]);
    }
}
