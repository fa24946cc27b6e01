//! Netlink sockets (NETLINK_ROUTE and the other netlink families): their port id, the
//! multicast groups they listen to, where they send by default, and their options. Rebuilt by
//! binding to the same port id (the kernel's autobind gave it; a program may have chosen it),
//! joining every group again and connecting; a port id another socket still holds (the frozen
//! original of a migration on one machine) is bound at resume, as a UDP address is.
//!
//! What waits in a netlink socket's queue came from the kernel (or another port), which cannot
//! be asked to send it again: such a socket is refused. CRIU refuses it too.

use super::*;

const SOL_NETLINK: i32 = 270;
const NETLINK_PKTINFO: i32 = 3;
const NETLINK_BROADCAST_ERROR: i32 = 4;
const NETLINK_NO_ENOBUFS: i32 = 5;
const NETLINK_LISTEN_ALL_NSID: i32 = 8;
const NETLINK_LIST_MEMBERSHIPS: i32 = 9;
const NETLINK_CAP_ACK: i32 = 10;
const NETLINK_EXT_ACK: i32 = 11;
const NETLINK_GET_STRICT_CHK: i32 = 12;
const NETLINK_ADD_MEMBERSHIP: i32 = 1;

/// Options of netlink sockets.
const NETLINK_OPTS: &[(i32, i32, usize)] = &[
    (SOL_SOCKET, libc::SO_RCVBUF, 4),
    (SOL_SOCKET, libc::SO_SNDBUF, 4),
    (SOL_SOCKET, SO_BUF_LOCK, 4),
    (SOL_SOCKET, libc::SO_PASSCRED, 4),
    (SOL_SOCKET, SO_RCVTIMEO_OLD, 16),
    (SOL_SOCKET, SO_SNDTIMEO_OLD, 16),
    (SOL_SOCKET, libc::SO_PRIORITY, 4),
    (SOL_SOCKET, libc::SO_MARK, 4),
    (SOL_SOCKET, SO_TIMESTAMP_OLD, 4),
    (SOL_NETLINK, NETLINK_PKTINFO, 4),
    (SOL_NETLINK, NETLINK_BROADCAST_ERROR, 4),
    (SOL_NETLINK, NETLINK_NO_ENOBUFS, 4),
    (SOL_NETLINK, NETLINK_LISTEN_ALL_NSID, 4),
    (SOL_NETLINK, NETLINK_CAP_ACK, 4),
    (SOL_NETLINK, NETLINK_EXT_ACK, 4),
    (SOL_NETLINK, NETLINK_GET_STRICT_CHK, 4),
];

/// (nl_pid, nl_groups) of a raw `struct sockaddr_nl`.
fn nl_addr(raw: &[u8]) -> (u32, u32) {
    let word = |at: usize| {
        raw.get(at..at + 4)
            .map(|b| u32::from_ne_bytes(b.try_into().expect("4 bytes")))
            .unwrap_or(0)
    };
    (word(4), word(8))
}

/// A raw `struct sockaddr_nl`.
fn sockaddr_nl(pid: u32, groups: u32) -> Vec<u8> {
    let mut v = (libc::AF_NETLINK as u16).to_ne_bytes().to_vec();
    v.extend_from_slice(&[0, 0]);
    v.extend_from_slice(&pid.to_ne_bytes());
    v.extend_from_slice(&groups.to_ne_bytes());
    v
}

impl Cap<'_> {
    pub(super) fn netlink(&self, ty: SockType, protocol: i32) -> Result<SocketDesc> {
        let name = sk::getsockname(self.s).ctx(self.pid, || self.what("read the name"))?;
        // Zeros when it is not connected.
        let peer = sk::getpeername(self.s).ctx(self.pid, || self.what("read the peer's name"))?;
        let (port, _) = nl_addr(&name);
        let (dst_port, dst_groups) = nl_addr(&peer);
        // A bitmap of 32-bit words, group 1 at bit 0.
        let bits = sk::getsockopt(self.s, SOL_NETLINK, NETLINK_LIST_MEMBERSHIPS, 1 << 12)
            .ctx(self.pid, || self.what("read its multicast groups"))?;
        let mut groups = Vec::new();
        for (w, word) in bits.chunks_exact(4).enumerate() {
            let word = u32::from_ne_bytes(word.try_into().expect("4 bytes"));
            for b in 0..32 {
                if word & (1 << b) != 0 {
                    groups.push((w * 32 + b + 1) as u32);
                }
            }
        }
        let ev = sk::poll_now(self.s, libc::POLLIN).ctx(self.pid, || self.what("poll"))?;
        if ev & libc::POLLIN != 0 {
            return Err(self.refuse(
                "messages wait in this netlink socket's queue; they came from the kernel (or \
                 another port), which cannot be made to send them again",
            ));
        }
        Ok(SocketDesc {
            ino: self.ino,
            family: SockFamily::Netlink,
            sock_type: ty,
            protocol,
            opts: capture_opts(self.s, &[NETLINK_OPTS]),
            netlink: Some(NetlinkState {
                port,
                groups,
                dst_port,
                dst_groups,
            }),
            ..Default::default()
        })
    }
}

impl Builder<'_> {
    /// Options, port id, groups and default destination of netlink socket `i`.
    pub(super) fn netlink(&mut self, i: usize) -> Result<()> {
        let s = self.sock(i);
        let n = s
            .netlink
            .as_ref()
            .ok_or_else(|| self.err(i, "a netlink socket without its netlink state"))?;
        let f = self.fd(i);
        apply_opts(f, &s.opts, true);
        // bind(2) sets the first 32 groups to the mask it is given: the groups go with it,
        // and all of them (again) once it is bound.
        let mask = n
            .groups
            .iter()
            .filter(|g| (1..=32).contains(*g))
            .fold(0u32, |m, g| m | 1 << (g - 1));
        let join = |b: &Self| -> Result<()> {
            for g in &n.groups {
                sk::setsockopt_int(f, SOL_NETLINK, NETLINK_ADD_MEMBERSHIP, *g as i32)
                    .map_err(|e| b.err(i, format!("join multicast group {g}: {e}")))?;
            }
            Ok(())
        };
        let peer =
            (n.dst_port != 0 || n.dst_groups != 0).then(|| sockaddr_nl(n.dst_port, n.dst_groups));
        if n.port != 0 {
            let local = sockaddr_nl(n.port, mask);
            match sk::bind(f, &local) {
                Ok(()) => {}
                Err(e) if e.errno == libc::EADDRINUSE => {
                    join(self)?;
                    let fd = self.dup(i)?;
                    self.deferred.binds.push(DeferredBind {
                        fd,
                        local,
                        peer,
                        what: format!("netlink socket:[{}]: bind to port {}", s.ino, n.port),
                    });
                    return Ok(());
                }
                Err(e) => return Err(self.err(i, format!("bind to port {}: {e}", n.port))),
            }
        }
        join(self)?;
        if let Some(p) = peer {
            sk::connect(f, &p).map_err(|e| {
                self.err(
                    i,
                    format!(
                        "connect to port {} groups {:#x}: {e}",
                        n.dst_port, n.dst_groups
                    ),
                )
            })?;
        }
        Ok(())
    }
}
