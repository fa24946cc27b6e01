//! Raw IP sockets (SOCK_RAW over IPv4 and IPv6, of any protocol): the address they are bound
//! to, the one they are connected to, and their options (IP_HDRINCL, ICMP_FILTER,
//! IPV6_CHECKSUM, ICMPV6_FILTER, and those of every IP socket). Rebuilt like a UDP socket:
//! bound, then connected (a raw socket's address has no port, so none is ever taken).
//!
//! A raw socket gets a copy of every packet of its protocol that reaches the machine, so what
//! waits in its queue may have been meant for anyone; it cannot be delivered again to this
//! socket alone. Those packets are left behind, as a network may lose a packet: the protocols
//! raw sockets carry expect it (ping counts one lost reply).

use super::*;

const SOL_RAW: i32 = 255;
const ICMP_FILTER: i32 = 1;
const IPPROTO_ICMPV6: i32 = 58;
const ICMPV6_FILTER: i32 = 1;
const IPV6_CHECKSUM: i32 = 7;
const IPV6_HDRINCL: i32 = 36;

const RAW4_OPTS: &[(i32, i32, usize)] =
    &[(IPPROTO_IP, libc::IP_HDRINCL, 4), (SOL_RAW, ICMP_FILTER, 4)];

const RAW6_OPTS: &[(i32, i32, usize)] = &[
    (IPPROTO_IPV6, IPV6_CHECKSUM, 4),
    (IPPROTO_IPV6, IPV6_HDRINCL, 4),
    (IPPROTO_ICMPV6, ICMPV6_FILTER, 32),
];

/// `a` without its port (a raw socket's name carries its protocol there), or `None` for the
/// unspecified address (not bound).
fn address_only(a: SockAddr) -> Option<SockAddr> {
    match a {
        SockAddr::Inet { addr, .. } if addr == [0; 4] => None,
        SockAddr::Inet { addr, .. } => Some(SockAddr::Inet { addr, port: 0 }),
        SockAddr::Inet6 { addr, .. } if addr == [0; 16] => None,
        SockAddr::Inet6 {
            addr,
            flowinfo,
            scope_id,
            ..
        } => Some(SockAddr::Inet6 {
            addr,
            port: 0,
            flowinfo,
            scope_id,
        }),
        other => Some(other),
    }
}

/// Where socket `ino` is connected, from `table` (/proc/PID/net/raw, raw6, icmp or icmp6: a
/// line's state is TCP_ESTABLISHED, 1, when it is), or `None`. The port is left 0.
pub(super) fn connected_to(pid: i32, table: &str, ino: u64) -> Option<SockAddr> {
    let text = procfs::read(pid, table).ok()?;
    for line in text.lines().skip(1) {
        let cols: Vec<&str> = line.split_whitespace().collect();
        if cols.len() <= 9 || cols[9].parse::<u64>().ok() != Some(ino) {
            continue;
        }
        if cols[3] != "01" {
            return None;
        }
        // "0100007F:00FD": the address as the kernel's u32 words in hex, then the port.
        let (a, _) = cols[2].split_once(':')?;
        let words: Option<Vec<[u8; 4]>> = (0..a.len() / 8)
            .map(|k| {
                u32::from_str_radix(a.get(k * 8..k * 8 + 8)?, 16)
                    .ok()
                    .map(u32::to_ne_bytes)
            })
            .collect();
        let bytes = words?.concat();
        return match bytes.len() {
            4 => Some(SockAddr::Inet {
                addr: bytes.try_into().ok()?,
                port: 0,
            }),
            16 => Some(SockAddr::Inet6 {
                addr: bytes.try_into().ok()?,
                port: 0,
                flowinfo: 0,
                scope_id: 0,
            }),
            _ => None,
        };
    }
    None
}

impl Cap<'_> {
    pub(super) fn raw(&self, domain: i32, protocol: i32) -> Result<SocketDesc> {
        let (family, lists) = if domain == libc::AF_INET {
            (SockFamily::Inet, [INET_OPTS, IPV4_OPTS, RAW4_OPTS])
        } else {
            (SockFamily::Inet6, [INET_OPTS, IPV6_OPTS, RAW6_OPTS])
        };
        let raw_name = sk::getsockname(self.s).ctx(self.pid, || self.what("read the name"))?;
        let local = decode_addr(&raw_name).and_then(address_only);
        // getpeername(2) answers ENOTCONN for a raw socket (it has no port): the table says.
        let table = if domain == libc::AF_INET {
            "net/raw"
        } else {
            "net/raw6"
        };
        let peer = connected_to(self.pid, table, self.ino).and_then(address_only);
        let mut desc = SocketDesc {
            ino: self.ino,
            family,
            sock_type: SockType::Raw,
            protocol,
            local,
            opts: capture_opts(self.s, &lists),
            ..Default::default()
        };
        if peer.is_some() {
            desc.peer = peer;
            desc.state = SockState::Connected { peer_ino: 0 };
        }
        let ev = sk::poll_now(self.s, libc::POLLIN | libc::POLLRDHUP)
            .ctx(self.pid, || self.what("poll"))?;
        desc.shutdown.read = ev & libc::POLLRDHUP != 0;
        desc.shutdown.write = ev & libc::POLLHUP != 0;
        if ev & libc::POLLIN != 0 && !desc.shutdown.read {
            log::info!(
                "PID {}: {}: the packets queued in this raw socket are left behind",
                self.pid,
                self.what("the queue")
            );
        }
        Ok(desc)
    }
}
