//! Socket options: which are captured for each kind of socket, and how they (buffers,
//! peek offsets, shutdowns) are set again on a rebuilt socket.

use super::*;

pub(super) const SO_RCVTIMEO_OLD: i32 = 20;
pub(super) const SO_SNDTIMEO_OLD: i32 = 21;
pub(super) const SO_TIMESTAMP_OLD: i32 = 29;
pub(super) const SO_TIMESTAMPNS_OLD: i32 = 35;
/// Which buffer sizes the socket keeps as set (SOCK_SNDBUF_LOCK 1 | SOCK_RCVBUF_LOCK 2).
pub(super) const SO_BUF_LOCK: i32 = 72;

/// (level, name, size) of the options captured for UNIX sockets.
pub(super) const UNIX_OPTS: &[(i32, i32, usize)] = &[
    (SOL_SOCKET, libc::SO_PASSCRED, 4),
    (SOL_SOCKET, libc::SO_PASSSEC, 4),
    (SOL_SOCKET, sk::SO_PASSPIDFD, 4),
    (SOL_SOCKET, sk::SO_PASSRIGHTS, 4),
    (SOL_SOCKET, libc::SO_RCVBUF, 4),
    (SOL_SOCKET, libc::SO_SNDBUF, 4),
    // After the buffers, whose forced sizes lock them.
    (SOL_SOCKET, SO_BUF_LOCK, 4),
    (SOL_SOCKET, SO_RCVTIMEO_OLD, 16),
    (SOL_SOCKET, SO_SNDTIMEO_OLD, 16),
    (SOL_SOCKET, libc::SO_RCVLOWAT, 4),
    (SOL_SOCKET, libc::SO_PRIORITY, 4),
    (SOL_SOCKET, libc::SO_MARK, 4),
    (SOL_SOCKET, SO_TIMESTAMP_OLD, 4),
    (SOL_SOCKET, SO_TIMESTAMPNS_OLD, 4),
    (SOL_SOCKET, libc::SO_PEEK_OFF, 4),
];

/// Options of every TCP or UDP socket.
pub(super) const INET_OPTS: &[(i32, i32, usize)] = &[
    (SOL_SOCKET, libc::SO_REUSEADDR, 4),
    (SOL_SOCKET, libc::SO_REUSEPORT, 4),
    (SOL_SOCKET, libc::SO_KEEPALIVE, 4),
    (SOL_SOCKET, libc::SO_BROADCAST, 4),
    (SOL_SOCKET, libc::SO_RCVBUF, 4),
    (SOL_SOCKET, libc::SO_SNDBUF, 4),
    (SOL_SOCKET, SO_BUF_LOCK, 4),
    (SOL_SOCKET, libc::SO_DONTROUTE, 4),
    (SOL_SOCKET, libc::SO_PRIORITY, 4),
    (SOL_SOCKET, libc::SO_MARK, 4),
    (SOL_SOCKET, libc::SO_LINGER, 8),
    (SOL_SOCKET, SO_RCVTIMEO_OLD, 16),
    (SOL_SOCKET, SO_SNDTIMEO_OLD, 16),
    (SOL_SOCKET, libc::SO_RCVLOWAT, 4),
    (SOL_SOCKET, libc::SO_OOBINLINE, 4),
    (SOL_SOCKET, libc::SO_BINDTODEVICE, 16),
    (SOL_SOCKET, SO_TIMESTAMP_OLD, 4),
    (SOL_SOCKET, SO_TIMESTAMPNS_OLD, 4),
];

pub(super) const IPV4_OPTS: &[(i32, i32, usize)] = &[
    (IPPROTO_IP, libc::IP_TOS, 4),
    (IPPROTO_IP, libc::IP_TTL, 4),
    (IPPROTO_IP, libc::IP_RECVERR, 4),
    (IPPROTO_IP, libc::IP_PKTINFO, 4),
    (IPPROTO_IP, libc::IP_MTU_DISCOVER, 4),
    (IPPROTO_IP, libc::IP_FREEBIND, 4),
    (IPPROTO_IP, libc::IP_TRANSPARENT, 4),
    (IPPROTO_IP, libc::IP_BIND_ADDRESS_NO_PORT, 4),
    (IPPROTO_IP, libc::IP_MULTICAST_TTL, 4),
    (IPPROTO_IP, libc::IP_MULTICAST_LOOP, 4),
    (IPPROTO_IP, libc::IP_OPTIONS, 40),
    (IPPROTO_IP, libc::IP_RECVTOS, 4),
    (IPPROTO_IP, libc::IP_RECVTTL, 4),
    (IPPROTO_IP, libc::IP_RECVOPTS, 4),
    (IPPROTO_IP, libc::IP_RECVORIGDSTADDR, 4),
];

pub(super) const IPV6_OPTS: &[(i32, i32, usize)] = &[
    (IPPROTO_IPV6, libc::IPV6_V6ONLY, 4),
    (IPPROTO_IPV6, libc::IPV6_UNICAST_HOPS, 4),
    (IPPROTO_IPV6, libc::IPV6_TCLASS, 4),
    (IPPROTO_IPV6, libc::IPV6_RECVPKTINFO, 4),
    (IPPROTO_IPV6, libc::IPV6_RECVERR, 4),
    (IPPROTO_IPV6, libc::IPV6_MTU_DISCOVER, 4),
    (IPPROTO_IPV6, 78, 4), // IPV6_FREEBIND
    (IPPROTO_IPV6, 75, 4), // IPV6_TRANSPARENT
    (IPPROTO_IPV6, libc::IPV6_MULTICAST_HOPS, 4),
    (IPPROTO_IPV6, libc::IPV6_MULTICAST_LOOP, 4),
];

pub(super) const TCP_OPTS: &[(i32, i32, usize)] = &[
    (IPPROTO_TCP, libc::TCP_NODELAY, 4),
    (IPPROTO_TCP, libc::TCP_CORK, 4),
    (IPPROTO_TCP, libc::TCP_KEEPIDLE, 4),
    (IPPROTO_TCP, libc::TCP_KEEPINTVL, 4),
    (IPPROTO_TCP, libc::TCP_KEEPCNT, 4),
    (IPPROTO_TCP, libc::TCP_DEFER_ACCEPT, 4),
    (IPPROTO_TCP, libc::TCP_WINDOW_CLAMP, 4),
    (IPPROTO_TCP, libc::TCP_CONGESTION, 16),
    (IPPROTO_TCP, libc::TCP_USER_TIMEOUT, 4),
    (IPPROTO_TCP, libc::TCP_FASTOPEN, 4),
    (IPPROTO_TCP, libc::TCP_NOTSENT_LOWAT, 4),
];

pub(super) const UDP_OPTS: &[(i32, i32, usize)] = &[(SOL_SOCKET, libc::SO_PEEK_OFF, 4)];

/// Options of established TCP connections only.
pub(super) const TCP_CONN_OPTS: &[(i32, i32, usize)] = &[(SOL_SOCKET, libc::SO_PEEK_OFF, 4)];

/// Reads every option of `list` that the socket has (options it does not know are skipped).
pub(super) fn capture_opts(s: RawFd, lists: &[&[(i32, i32, usize)]]) -> Vec<SockOpt> {
    let mut out = Vec::new();
    for (level, name, size) in lists.iter().flat_map(|l| l.iter()) {
        if let Ok(value) = sk::getsockopt(s, *level, *name, *size) {
            out.push(SockOpt {
                level: *level,
                name: *name,
                value,
            });
        }
    }
    out
}

pub(super) fn is_multicast_opt(o: &SockOpt) -> bool {
    (o.level == IPPROTO_IP
        && (o.name == libc::IP_MULTICAST_TTL || o.name == libc::IP_MULTICAST_LOOP))
        || (o.level == IPPROTO_IPV6
            && (o.name == libc::IPV6_MULTICAST_HOPS || o.name == libc::IPV6_MULTICAST_LOOP))
}

pub(super) fn opt_int(desc: &SocketDesc, level: i32, name: i32) -> Option<i32> {
    desc.opts
        .iter()
        .find(|o| o.level == level && o.name == name && o.value.len() >= 4)
        .map(|o| i32::from_ne_bytes(o.value[..4].try_into().expect("4 bytes")))
}

/// Sets every captured option that a new socket does not already have (SO_PEEK_OFF is left to
/// the caller: it must come after the queue is refilled).
pub(super) fn apply_opts(s: RawFd, opts: &[SockOpt], force_buffers: bool) {
    for o in opts {
        if o.level == SOL_SOCKET && o.name == libc::SO_PEEK_OFF {
            continue;
        }
        let now = sk::getsockopt(s, o.level, o.name, o.value.len().max(4)).unwrap_or_default();
        let is_buf =
            o.level == SOL_SOCKET && (o.name == libc::SO_RCVBUF || o.name == libc::SO_SNDBUF);
        if now == o.value && !(is_buf && force_buffers) {
            continue;
        }
        let r = if is_buf && o.value.len() >= 4 {
            // The kernel doubles what it is given (for its bookkeeping) and reports the double.
            let v = i32::from_ne_bytes(o.value[..4].try_into().expect("4 bytes"));
            let force = if o.name == libc::SO_RCVBUF {
                libc::SO_RCVBUFFORCE
            } else {
                libc::SO_SNDBUFFORCE
            };
            sk::setsockopt_int(s, SOL_SOCKET, force, v / 2)
        } else {
            sk::setsockopt(s, o.level, o.name, &o.value)
        };
        if let Err(e) = r {
            log::warn!("socket option {}/{} not restored: {e}", o.level, o.name);
        }
    }
}

pub(super) fn set_peek_off(s: RawFd, desc: &SocketDesc) {
    if let Some(off) = opt_int(desc, SOL_SOCKET, libc::SO_PEEK_OFF) {
        if off >= 0 {
            if let Err(e) = sk::setsockopt_int(s, SOL_SOCKET, libc::SO_PEEK_OFF, off) {
                log::warn!("SO_PEEK_OFF not restored: {e}");
            }
        }
    }
}

/// Raises a socket's send buffer so that `bytes` fit at once (its real size is set afterwards).
pub(super) fn bump_sndbuf(s: RawFd, bytes: usize) {
    if bytes == 0 {
        return;
    }
    let want = (bytes.saturating_mul(2) + (1 << 20)).min(i32::MAX as usize / 4) as i32;
    let now = sk::getsockopt_int(s, SOL_SOCKET, libc::SO_SNDBUF).unwrap_or(0);
    if now < want * 2 {
        let _ = sk::setsockopt_int(s, SOL_SOCKET, libc::SO_SNDBUFFORCE, want);
    }
}

pub(super) fn apply_shutdown(s: RawFd, sh: &Shutdown) {
    if sh.write {
        let _ = sk::shutdown(s, libc::SHUT_WR);
    }
    if sh.read {
        let _ = sk::shutdown(s, libc::SHUT_RD);
    }
}
