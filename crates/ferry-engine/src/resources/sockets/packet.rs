//! Packet sockets (AF_PACKET, SOCK_RAW and SOCK_DGRAM): the protocol and interface they are
//! bound to (the interface by name: its index means nothing on another machine), their fanout
//! group and their options. Rebuilt by binding again, then joining the fanout group.
//!
//! Packets waiting in the queue are left behind, as for raw IP sockets (a packet socket gets a
//! copy of what crosses its interface; none can be delivered again to it alone). Rings
//! (PACKET_RX_RING, PACKET_TX_RING) and memberships (PACKET_ADD_MEMBERSHIP) are refused: not
//! written yet. sock_diag tells of both.

use super::*;

const SOL_PACKET: i32 = 263;
const PACKET_AUXDATA: i32 = 8;
const PACKET_ORIGDEV: i32 = 9;
const PACKET_VERSION: i32 = 10;
const PACKET_RESERVE: i32 = 12;
const PACKET_LOSS: i32 = 14;
const PACKET_VNET_HDR: i32 = 15;
const PACKET_TIMESTAMP: i32 = 17;
const PACKET_FANOUT: i32 = 18;
const PACKET_QDISC_BYPASS: i32 = 20;
const PACKET_IGNORE_OUTGOING: i32 = 23;

const PACKET_OPTS: &[(i32, i32, usize)] = &[
    (SOL_SOCKET, libc::SO_RCVBUF, 4),
    (SOL_SOCKET, libc::SO_SNDBUF, 4),
    (SOL_SOCKET, SO_BUF_LOCK, 4),
    (SOL_SOCKET, SO_RCVTIMEO_OLD, 16),
    (SOL_SOCKET, SO_SNDTIMEO_OLD, 16),
    (SOL_SOCKET, libc::SO_PRIORITY, 4),
    (SOL_SOCKET, libc::SO_MARK, 4),
    (SOL_SOCKET, SO_TIMESTAMP_OLD, 4),
    (SOL_SOCKET, SO_TIMESTAMPNS_OLD, 4),
    (SOL_PACKET, PACKET_VERSION, 4),
    (SOL_PACKET, PACKET_RESERVE, 4),
    (SOL_PACKET, PACKET_AUXDATA, 4),
    (SOL_PACKET, PACKET_ORIGDEV, 4),
    (SOL_PACKET, PACKET_VNET_HDR, 4),
    (SOL_PACKET, PACKET_LOSS, 4),
    (SOL_PACKET, PACKET_TIMESTAMP, 4),
    (SOL_PACKET, PACKET_QDISC_BYPASS, 4),
    (SOL_PACKET, PACKET_IGNORE_OUTGOING, 4),
];

/// A raw `struct sockaddr_ll` for bind(2).
fn sockaddr_ll(protocol: u16, ifindex: u32) -> Vec<u8> {
    let mut v = (libc::AF_PACKET as u16).to_ne_bytes().to_vec();
    v.extend_from_slice(&protocol.to_ne_bytes());
    v.extend_from_slice(&(ifindex as i32).to_ne_bytes());
    v.extend_from_slice(&[0; 12]);
    v
}

impl Cap<'_> {
    pub(super) fn packet(&self, ty: SockType, protocol: i32) -> Result<SocketDesc> {
        let diag = sk::packet_diag(self.ino)
            .ctx(self.pid, || {
                self.what("ask sock_diag about the packet socket")
            })?
            .ok_or_else(|| {
                self.refuse(
                    "sock_diag does not know this packet socket (another network namespace?)",
                )
            })?;
        if diag.rx_ring || diag.tx_ring {
            return Err(self.refuse(
                "it has a ring (PACKET_RX_RING or PACKET_TX_RING), which cannot be checkpointed \
                 yet",
            ));
        }
        if diag.memberships > 0 {
            return Err(self.refuse(format!(
                "it holds {} membership(s) taken with PACKET_ADD_MEMBERSHIP, which cannot be \
                 checkpointed yet",
                diag.memberships
            )));
        }
        let name = sk::getsockname(self.s).ctx(self.pid, || self.what("read the name"))?;
        let bound_proto = name
            .get(2..4)
            .map(|b| u16::from_ne_bytes([b[0], b[1]]))
            .unwrap_or(0);
        let ifindex = name
            .get(4..8)
            .map(|b| i32::from_ne_bytes(b.try_into().expect("4 bytes")))
            .unwrap_or(0);
        let interface = if ifindex > 0 {
            Some(
                sk::interface_name(ifindex as u32)
                    .ctx(self.pid, || self.what(&format!("name interface {ifindex}")))?,
            )
        } else {
            None
        };
        let fanout = sk::getsockopt_int(self.s, SOL_PACKET, PACKET_FANOUT).unwrap_or(0) as u32;
        let ev = sk::poll_now(self.s, libc::POLLIN).ctx(self.pid, || self.what("poll"))?;
        if ev & libc::POLLIN != 0 {
            log::info!(
                "PID {}: {}: the packets queued in this packet socket are left behind",
                self.pid,
                self.what("the queue")
            );
        }
        Ok(SocketDesc {
            ino: self.ino,
            family: SockFamily::Packet,
            sock_type: ty,
            protocol,
            opts: capture_opts(self.s, &[PACKET_OPTS]),
            packet: Some(PacketState {
                protocol: bound_proto,
                interface,
                fanout,
            }),
            ..Default::default()
        })
    }
}

impl Builder<'_> {
    /// Options, binding and fanout group of packet socket `i`.
    pub(super) fn packet(&mut self, i: usize) -> Result<()> {
        let s = self.sock(i);
        let p = s
            .packet
            .as_ref()
            .ok_or_else(|| self.err(i, "a packet socket without its packet state"))?;
        let f = self.fd(i);
        apply_opts(f, &s.opts, true);
        let ifindex = match &p.interface {
            Some(name) => sk::interface_index(name)
                .map_err(|e| self.err(i, format!("find interface {name} here: {e}")))?,
            None => 0,
        };
        // socket(2) already takes its protocol on every interface; bind only to change that.
        if ifindex != 0 || i32::from(p.protocol) != s.protocol {
            sk::bind(f, &sockaddr_ll(p.protocol, ifindex)).map_err(|e| {
                self.err(
                    i,
                    format!(
                        "bind to protocol {:#06x} on {}: {e}",
                        u16::from_be(p.protocol),
                        p.interface.as_deref().unwrap_or("every interface")
                    ),
                )
            })?;
        }
        if p.fanout != 0 {
            sk::setsockopt_int(f, SOL_PACKET, PACKET_FANOUT, p.fanout as i32)
                .map_err(|e| self.err(i, format!("join fanout group {:#x}: {e}", p.fanout)))?;
        }
        Ok(())
    }
}
