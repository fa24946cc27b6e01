//! Packet sockets (AF_PACKET, SOCK_RAW and SOCK_DGRAM): the protocol and interface they are
//! bound to (the interface by name: its index means nothing on another machine), their fanout
//! group, memberships, rings and options. Rebuilt by binding again, then joining the fanout
//! group and taking the memberships again.
//!
//! Packets waiting in the queue are left behind, as for raw IP sockets (a packet socket gets a
//! copy of what crosses its interface; none can be delivered again to it alone).
//!
//! A ring (PACKET_RX_RING, PACKET_TX_RING; TPACKET_V1 and V2) is memory the socket shares with
//! the process: frames, each with a status word saying whether the kernel or the program owns
//! it. Its geometry comes from sock_diag; its frames are read through a mapping of our own of
//! the socket (taken with pidfd_getfd). The kernel's place in the ring (the frame it fills or
//! sends next) is not reported anywhere: for a receive ring it is the frame after the one
//! filled last (the latest timestamp: the kernel stamps every frame it fills); for a transmit
//! ring, the first frame of the run waiting to be sent, or frame 0 for a ring never used (one
//! that has sent frames and has none waiting is refused). The restore sets the ring up again,
//! brings the kernel to the same frame by having it take that many frames first (received
//! from a packet socket of ours over the loopback interface, or sent over it from the ring),
//! then writes every frame back, status words included, and maps the ring at its old address
//! in the process (`Backing::PacketRing`). A TPACKET_V3 receive ring is filled block by block:
//! the block the kernel fills now is the one opened last (the highest sequence number), and it
//! must be empty (a block with packets is retired by the ring's timer, which the capture waits
//! for); the restore takes the new ring through as many blocks as the old one had filled (a
//! frame sent into each, each block given straight back), so that the kernel fills the same
//! block next, under the same sequence number. TPACKET_V3 transmit rings are refused.

use super::*;
use ferry_image::{Backing, PacketFrame, PacketMembership, PacketRing};

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
const PACKET_ADD_MEMBERSHIP: i32 = 1;
const PACKET_RX_RING: i32 = 5;
const PACKET_STATISTICS: i32 = 6;
const PACKET_TX_RING: i32 = 13;
const TPACKET_V1: i32 = 0;
const TPACKET_V3: i32 = 2;
/// Frame status bits (if_packet.h): a receive frame the program owns; a transmit frame to be
/// sent, being sent, or refused as malformed.
const TP_STATUS_USER: u32 = 1;
const TP_STATUS_SEND_REQUEST: u32 = 1;
const TP_STATUS_SENDING: u32 = 2;
const TP_STATUS_WRONG_FORMAT: u32 = 4;
/// Where a transmit frame's data starts, for TPACKET_V1 and V2 alike (TPACKET_ALIGN of the
/// header).
const TX_DATA_OFFSET: usize = 32;
/// The EtherType of the frames the restore has a rebuilt ring take to reach its place (the
/// second one IEEE 802 keeps for local experiments).
const ADVANCE_ETHERTYPE: u16 = 0x88b6;
/// The most blocks a rebuilt TPACKET_V3 ring is taken through to reach its block and
/// sequence number (3,000 take about a second in a debug build); past that, only to its block.
const V3_MAX_BLOCKS: u64 = 4096;
/// How long the restore waits for the kernel to take those frames.
const ADVANCE_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

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
        let version = sk::getsockopt_int(self.s, SOL_PACKET, PACKET_VERSION)
            .ctx(self.pid, || self.what("read PACKET_VERSION"))?;
        let (rx_ring, tx_ring) = self.rings(&diag, version)?;
        let mut memberships = Vec::new();
        for m in &diag.mclist {
            let interface = sk::interface_name(m.ifindex).ctx(self.pid, || {
                self.what(&format!("name interface {} of a membership", m.ifindex))
            })?;
            memberships.push(PacketMembership {
                interface,
                mr_type: m.mr_type,
                addr: m.addr.clone(),
                count: m.count,
            });
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
                rx_ring: rx_ring.map(Box::new),
                tx_ring: tx_ring.map(Box::new),
                memberships,
            }),
            ..Default::default()
        })
    }
}

/// Where frame `i` of a ring of geometry `r` starts in it (frames do not cross blocks).
fn frame_offset(r: &PacketRing, i: u32) -> usize {
    let per_block = (r.block_size / r.frame_size.max(1)).max(1);
    (i / per_block) as usize * r.block_size as usize
        + (i % per_block) as usize * r.frame_size as usize
}

/// The status word of a TPACKET_V1 or V2 frame header (V1's is an unsigned long: its low
/// half on this little-endian machine).
fn status_of(frame: &[u8]) -> u32 {
    u32::from_ne_bytes(frame[0..4].try_into().expect("4 bytes"))
}

/// When the kernel filled a receive frame (seconds, then micro- or nanoseconds), as one
/// comparable number.
fn stamp_of(frame: &[u8], version: i32) -> (u32, u32) {
    let w = |at: usize| u32::from_ne_bytes(frame[at..at + 4].try_into().expect("4 bytes"));
    if version == TPACKET_V1 {
        (w(20), w(24))
    } else {
        (w(16), w(20))
    }
}

/// The frame a receive ring's kernel fills next: the one after the frame filled last (the
/// latest stamp, the last of a run of equal ones), 0 for a ring never filled.
fn rx_head(frames: &[Vec<u8>], version: i32) -> u32 {
    let n = frames.len();
    let stamp = |i: usize| stamp_of(&frames[i], version);
    let Some(latest) = (0..n).map(stamp).filter(|s| *s != (0, 0)).max() else {
        return 0;
    };
    (0..n)
        .find(|&i| stamp(i) == latest && stamp((i + 1) % n) != latest)
        .map(|i| ((i + 1) % n) as u32)
        .unwrap_or(0)
}

/// The frame a transmit ring's kernel sends next: the first of the run of frames waiting to
/// be sent (or refused as malformed, where the kernel stopped); 0 for a ring never used.
/// `None` when neither tells.
fn tx_head(frames: &[Vec<u8>]) -> Option<u32> {
    let n = frames.len();
    let waiting =
        |i: usize| status_of(&frames[i]) & (TP_STATUS_SEND_REQUEST | TP_STATUS_WRONG_FORMAT) != 0;
    if let Some(i) = (0..n).find(|&i| waiting(i) && !waiting((i + n - 1) % n)) {
        return Some(i as u32);
    }
    frames.iter().all(|f| memory_is_zero(f)).then_some(0)
}

fn memory_is_zero(b: &[u8]) -> bool {
    b.iter().all(|&x| x == 0)
}

impl Cap<'_> {
    /// The receive and transmit rings of the packet socket, with their frames.
    fn rings(
        &self,
        diag: &sk::PacketDiag,
        version: i32,
    ) -> Result<(Option<PacketRing>, Option<PacketRing>)> {
        if diag.rx_ring.is_none() && diag.tx_ring.is_none() {
            return Ok((None, None));
        }
        if version == TPACKET_V3 {
            if diag.tx_ring.is_some() {
                return Err(self.refuse(
                    "it has a TPACKET_V3 transmit ring, which cannot be checkpointed yet",
                ));
            }
            let req = diag.rx_ring.expect("a ring");
            return Ok((Some(self.v3_ring(&req)?), None));
        }
        let rx_bytes = diag.rx_ring.map(|r| r.bytes()).unwrap_or(0);
        let tx_bytes = diag.tx_ring.map(|r| r.bytes()).unwrap_or(0);
        let map = sk::SharedMap::new(self.s, rx_bytes + tx_bytes, false)
            .ctx(self.pid, || self.what("map its rings"))?;
        let read = |req: &sk::PacketRingReq, base: usize| -> (PacketRing, Vec<Vec<u8>>) {
            let mut ring = PacketRing {
                block_size: req.block_size,
                block_nr: req.block_nr,
                frame_size: req.frame_size,
                frame_nr: req.frame_nr,
                ..Default::default()
            };
            let frames: Vec<Vec<u8>> = (0..req.frame_nr)
                .map(|i| {
                    let mut b = vec![0u8; req.frame_size as usize];
                    map.read(base + frame_offset(&ring, i), &mut b);
                    b
                })
                .collect();
            ring.frames = frames
                .iter()
                .enumerate()
                .filter(|(_, b)| !memory_is_zero(b))
                .map(|(i, b)| PacketFrame {
                    index: i as u32,
                    bytes: b.clone(),
                })
                .collect();
            (ring, frames)
        };
        let rx = diag.rx_ring.map(|req| {
            let (mut ring, frames) = read(&req, 0);
            ring.head = rx_head(&frames, version);
            ring
        });
        let tx = match diag.tx_ring {
            None => None,
            Some(req) => {
                let (mut ring, frames) = read(&req, rx_bytes);
                if frames.iter().any(|f| status_of(f) & TP_STATUS_SENDING != 0) {
                    return Err(self.refuse(
                        "a frame of its transmit ring is being sent (TP_STATUS_SENDING); retry",
                    ));
                }
                ring.head = tx_head(&frames).ok_or_else(|| {
                    self.refuse(
                        "its transmit ring has sent frames and has none waiting: which frame \
                         the kernel sends next is not known (the kernel reports it nowhere)",
                    )
                })?;
                Some(ring)
            }
        };
        Ok((rx, tx))
    }
}

/// TPACKET_V3 block descriptor fields (`struct tpacket_block_desc`, its `tpacket_hdr_v1`).
const BLOCK_STATUS: usize = 8;
const BLOCK_NUM_PKTS: usize = 12;
const BLOCK_SEQ: usize = 24;

/// A word of a block (or frame) as read: `(status, packets, sequence number)` of a TPACKET_V3
/// block.
fn block_fields(b: &[u8]) -> (u32, u32, u64) {
    let w = |at: usize| u32::from_ne_bytes(b[at..at + 4].try_into().expect("4 bytes"));
    (
        w(BLOCK_STATUS),
        w(BLOCK_NUM_PKTS),
        u64::from_ne_bytes(b[BLOCK_SEQ..BLOCK_SEQ + 8].try_into().expect("8 bytes")),
    )
}

/// The block a TPACKET_V3 ring's kernel fills now: the one opened last (the highest sequence
/// number), with its index and sequence number.
fn v3_active(blocks: &[Vec<u8>]) -> Option<(usize, u64)> {
    blocks
        .iter()
        .enumerate()
        .map(|(i, b)| (i, block_fields(b).2))
        .max_by_key(|&(_, seq)| seq)
}

impl Cap<'_> {
    /// A TPACKET_V3 receive ring: its blocks, and the block the kernel fills now, which must be
    /// open and empty (a block with packets is retired by the kernel's timer, waited for here;
    /// where the kernel is inside a block it fills cannot be set again).
    fn v3_ring(&self, req: &sk::PacketRingReq) -> Result<PacketRing> {
        let map = sk::SharedMap::new(self.s, req.bytes(), false)
            .ctx(self.pid, || self.what("map its ring"))?;
        let read = || -> Vec<Vec<u8>> {
            (0..req.block_nr as usize)
                .map(|i| {
                    let mut b = vec![0u8; req.block_size as usize];
                    map.read(i * req.block_size as usize, &mut b);
                    b
                })
                .collect()
        };
        // The timer retires a block with packets within two of its periods.
        let wait = std::time::Duration::from_millis(u64::from(req.retire_tmo.max(1)) * 3 + 100);
        let t0 = std::time::Instant::now();
        let (blocks, head, seq) = loop {
            let blocks = read();
            let (head, seq) =
                v3_active(&blocks).ok_or_else(|| self.refuse("its ring has no block"))?;
            let (status, pkts, _) = block_fields(&blocks[head]);
            if status & TP_STATUS_USER != 0 {
                return Err(self.refuse(
                    "its TPACKET_V3 ring is full (every block is the program's): where the \
                     kernel goes on once a block is given back cannot be set again; retry once \
                     the program has read some",
                ));
            }
            if pkts == 0 {
                break (blocks, head, seq);
            }
            if t0.elapsed() > wait {
                return Err(self.refuse(format!(
                    "packets keep arriving in the block its TPACKET_V3 ring fills (block {head}, \
                     {pkts} packets): where the kernel is inside a block cannot be set again"
                )));
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        };
        Ok(PacketRing {
            block_size: req.block_size,
            block_nr: req.block_nr,
            frame_size: req.frame_size,
            frame_nr: req.frame_nr,
            retire_tmo: req.retire_tmo,
            sizeof_priv: req.sizeof_priv,
            features: req.features,
            head: head as u32,
            seq,
            frames: blocks
                .into_iter()
                .enumerate()
                .filter(|(_, b)| !memory_is_zero(b))
                .map(|(i, bytes)| PacketFrame {
                    index: i as u32,
                    bytes,
                })
                .collect(),
        })
    }
}

/// Refuses a process mapping packet rings that cannot be mapped again as they are: part of a
/// ring only, or the rings of a socket the tree does not hold (its descriptors closed).
pub fn check_ring_mappings(tree: &Tree) -> Result<()> {
    for p in &tree.processes {
        for v in &p.vmas {
            let Backing::PacketRing { ino } = v.backing else {
                continue;
            };
            let unsupported = |why: String| Error::Unsupported {
                pid: p.pid,
                what: format!("mapping {:x}-{:x} ({})", v.start, v.end, v.name),
                why,
            };
            let rings = tree.files.iter().find_map(|f| match &f.kind {
                FileKind::Socket(s) if s.ino == ino => s.packet.as_ref(),
                _ => None,
            });
            let Some(ps) = rings.filter(|ps| ps.rx_ring.is_some() || ps.tx_ring.is_some()) else {
                return Err(unsupported(format!(
                    "a mapping of socket:[{ino}], which is not the rings of a packet socket the \
                     tree holds (only those are mapped again: any other mapping of a socket, or \
                     the rings of one whose descriptors were closed, is not)"
                )));
            };
            let size = ring_bytes(ps);
            if v.offset != 0 || v.end - v.start != size as u64 {
                return Err(unsupported(format!(
                    "part of a packet socket's rings ({size} bytes from offset 0): they can only \
                     be mapped again whole"
                )));
            }
        }
    }
    Ok(())
}

/// The bytes the rings of a packet socket take in a mapping of it.
fn ring_bytes(p: &PacketState) -> usize {
    let b = |r: &Option<Box<PacketRing>>| {
        r.as_ref()
            .map(|r| r.block_size as usize * r.block_nr as usize)
            .unwrap_or(0)
    };
    b(&p.rx_ring) + b(&p.tx_ring)
}

thread_local! {
    /// The rebuilt packet sockets with rings, by their inode in the image, for their
    /// mappings (`Backing::PacketRing`).
    static RINGS: RefCell<HashMap<u64, OwnedFd>> = RefCell::new(HashMap::new());
}

/// The rebuilt socket whose rings a mapping of socket `ino` of the image is to map.
pub fn ring_socket(ino: u64) -> Option<OwnedFd> {
    RINGS.with(|r| r.borrow().get(&ino).and_then(|f| f.try_clone().ok()))
}

impl Builder<'_> {
    /// Every packet socket with a ring, first of all sockets (before any other packet socket
    /// takes packets): made, its ring set up and brought to its place, its frames written
    /// back, then bound like the others.
    pub(super) fn packet_rings(&mut self) -> Result<()> {
        RINGS.with(|r| r.borrow_mut().clear());
        let rings: Vec<usize> = (0..self.socks.len())
            .filter(|&i| {
                self.fds[i].is_none()
                    && self.sock(i).family == SockFamily::Packet
                    && self
                        .sock(i)
                        .packet
                        .as_ref()
                        .is_some_and(|p| p.rx_ring.is_some() || p.tx_ring.is_some())
            })
            .collect();
        for &i in &rings {
            let s = self.sock(i);
            let fd = sk::socket(
                libc::AF_PACKET,
                sock_type_raw(s.sock_type) | NEW,
                s.protocol,
            )
            .map_err(|e| self.err(i, format!("socket: {e}")))?;
            // (PACKET_VERSION and PACKET_RESERVE before the rings.)
            apply_opts(fd.as_raw_fd(), &s.opts, true);
            self.fds[i] = Some(fd);
            self.set_up_rings(i)?;
        }
        // Every ring in place: each socket takes its own packets from now on.
        for &i in &rings {
            sk::setsockopt_int(self.fd(i), SOL_SOCKET, libc::SO_DETACH_FILTER, 0)
                .or_else(|e| {
                    if e.errno == libc::ENOENT {
                        Ok(())
                    } else {
                        Err(e)
                    }
                })
                .map_err(|e| self.err(i, format!("detach the filter that held it: {e}")))?;
            self.packet(i)?;
            let dup = self.dup(i)?;
            RINGS.with(|r| r.borrow_mut().insert(self.sock(i).ino, dup));
        }
        Ok(())
    }

    /// Sets up the rings of packet socket `i` (made, unbound), brings each to its head and
    /// writes its frames back; leaves it taking no packets (a filter that drops them all).
    fn set_up_rings(&mut self, i: usize) -> Result<()> {
        let s = self.sock(i);
        let p = s.packet.as_ref().expect("a ring socket");
        let f = self.fd(i);
        if opt_int(s, SOL_PACKET, PACKET_VERSION) == Some(TPACKET_V3) {
            return self.set_up_v3_ring(i);
        }
        let geometry = |r: &PacketRing| sk::PacketRingReq {
            block_size: r.block_size,
            block_nr: r.block_nr,
            frame_size: r.frame_size,
            frame_nr: r.frame_nr,
            ..Default::default()
        };
        for (name, opt, ring) in [
            ("PACKET_RX_RING", PACKET_RX_RING, &p.rx_ring),
            ("PACKET_TX_RING", PACKET_TX_RING, &p.tx_ring),
        ] {
            if let Some(r) = ring {
                sk::setsockopt(f, SOL_PACKET, opt, &geometry(r).to_setsockopt(false))
                    .map_err(|e| self.err(i, format!("set up its ring ({name}): {e}")))?;
            }
        }
        let rx_bytes = p
            .rx_ring
            .as_ref()
            .map(|r| r.block_size as usize * r.block_nr as usize)
            .unwrap_or(0);
        let map = sk::SharedMap::new(f, ring_bytes(p), true)
            .map_err(|e| self.err(i, format!("map its rings: {e}")))?;
        let receiving = p.rx_ring.as_ref().is_some_and(|r| r.head > 0);
        let advancing = receiving || p.tx_ring.as_ref().is_some_and(|r| r.head > 0);
        let lo = if advancing {
            sk::interface_index("lo").map_err(|e| {
                self.err(
                    i,
                    format!("find the loopback interface, to bring its ring to its place: {e}"),
                )
            })?
        } else {
            0
        };
        // Frames this socket sends go out as ADVANCE_ETHERTYPE - 1 (0x88b5) to the address
        // given to send; it takes only ADVANCE_ETHERTYPE, on the loopback interface, and none
        // while its own are sent.
        let drop_all = [0x06u8, 0, 0, 0, 0, 0, 0, 0];
        sk::attach_filter(f, &drop_all)
            .map_err(|e| self.err(i, format!("attach a filter holding packets back: {e}")))?;
        if receiving {
            sk::bind(f, &sockaddr_ll(ADVANCE_ETHERTYPE.to_be(), lo)).map_err(|e| {
                self.err(
                    i,
                    format!("bind to the loopback interface for a moment: {e}"),
                )
            })?;
        }
        if let Some(r) = p.tx_ring.as_ref().filter(|r| r.head > 0) {
            self.advance_tx(i, &map, rx_bytes, r, s.sock_type, lo)?;
        }
        if let Some(r) = p.rx_ring.as_ref().filter(|r| r.head > 0) {
            sk::setsockopt_int(f, SOL_SOCKET, libc::SO_DETACH_FILTER, 0)
                .map_err(|e| self.err(i, format!("detach its filter for a moment: {e}")))?;
            let r = self.advance_rx(i, &map, r, lo);
            sk::attach_filter(f, &drop_all)
                .map_err(|e| self.err(i, format!("attach a filter holding packets back: {e}")))?;
            r?;
        }
        // What these frames counted is not the socket's (PACKET_STATISTICS is reset when read).
        let _ = sk::getsockopt(f, SOL_PACKET, PACKET_STATISTICS, 12);
        for (ring, base) in [(&p.rx_ring, 0), (&p.tx_ring, rx_bytes)] {
            let Some(r) = ring else { continue };
            let zero = vec![0u8; r.frame_size as usize];
            for n in 0..r.frame_nr {
                map.write(base + frame_offset(r, n), &zero);
            }
            for fr in &r.frames {
                if fr.index >= r.frame_nr || fr.bytes.len() != r.frame_size as usize {
                    return Err(self.err(i, format!("ring frame {} is malformed", fr.index)));
                }
                // The status word last, as the kernel writes it.
                let at = base + frame_offset(r, fr.index);
                map.write(at + 4, &fr.bytes[4..]);
                map.store_u32(at, status_of(&fr.bytes));
            }
        }
        Ok(())
    }

    /// Has the kernel fill the first `r.head` frames of the (empty) receive ring of socket `i`,
    /// bound to ADVANCE_ETHERTYPE on the loopback interface `lo`: sends that many frames from
    /// a packet socket of ours and waits until the last is in the ring.
    fn advance_rx(&self, i: usize, map: &sk::SharedMap, r: &PacketRing, lo: u32) -> Result<()> {
        let sender = sk::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0)
            .map_err(|e| self.err(i, format!("a packet socket to fill its ring: {e}")))?;
        let mut frame = [0u8; 14 + 4];
        frame[12..14].copy_from_slice(&ADVANCE_ETHERTYPE.to_be_bytes());
        let mut to = sockaddr_ll(ADVANCE_ETHERTYPE.to_be(), lo);
        to[11] = 6; // sll_halen
        for _ in 0..r.head {
            sk::send(sender.as_raw_fd(), &frame, Some(&to), &[], 0).map_err(|e| {
                self.err(i, format!("send a frame over the loopback interface: {e}"))
            })?;
        }
        let last = frame_offset(r, r.head - 1);
        self.wait_ring(i, "its receive ring to take the frames sent to it", || {
            map.load_u32(last) & TP_STATUS_USER != 0
        })
    }

    /// Has the kernel send the first `r.head` frames of the (empty) transmit ring of socket
    /// `i` (at `base` in `map`) over the loopback interface `lo`, and waits until it has.
    fn advance_tx(
        &self,
        i: usize,
        map: &sk::SharedMap,
        base: usize,
        r: &PacketRing,
        ty: SockType,
        lo: u32,
    ) -> Result<()> {
        let ethertype = ADVANCE_ETHERTYPE - 1;
        let mut frame = [0u8; 14 + 4];
        frame[12..14].copy_from_slice(&ethertype.to_be_bytes());
        let data: &[u8] = if ty == SockType::Dgram {
            &frame[14..]
        } else {
            &frame
        };
        for n in 0..r.head {
            let at = base + frame_offset(r, n);
            map.write(at + TX_DATA_OFFSET, data);
            map.store_u32(at + 4, data.len() as u32); // tp_len
            map.store_u32(at, TP_STATUS_SEND_REQUEST);
        }
        let mut to = sockaddr_ll(ethertype.to_be(), lo);
        to[11] = 6; // sll_halen
        sk::send(self.fd(i), &[], Some(&to), &[], 0)
            .map_err(|e| self.err(i, format!("send from its transmit ring: {e}")))?;
        let last = base + frame_offset(r, r.head - 1);
        self.wait_ring(i, "its transmit ring to send its first frames", || {
            map.load_u32(last) & (TP_STATUS_SEND_REQUEST | TP_STATUS_SENDING) == 0
        })
    }

    /// [`Self::set_up_rings`] for a TPACKET_V3 receive ring: the kernel opens block 0 with
    /// sequence number 1 and moves on a block at a time (when a packet does not fit in the
    /// block it fills, or when the block's timer retires it), so it is brought to the image's
    /// block and sequence number by as many blocks as it had filled: large frames sent to it
    /// over the loopback interface, each closing a block (handed straight back to it), and the
    /// timer for the last one, so that the block it fills is empty, as it was.
    fn set_up_v3_ring(&mut self, i: usize) -> Result<()> {
        let s = self.sock(i);
        let p = s.packet.as_ref().expect("a ring socket");
        let r = p.rx_ring.as_ref().expect("a V3 ring is a receive ring");
        let f = self.fd(i);
        let req = sk::PacketRingReq {
            block_size: r.block_size,
            block_nr: r.block_nr,
            frame_size: r.frame_size,
            frame_nr: r.frame_nr,
            retire_tmo: r.retire_tmo,
            sizeof_priv: r.sizeof_priv,
            features: r.features,
        };
        sk::setsockopt(f, SOL_PACKET, PACKET_RX_RING, &req.to_setsockopt(true))
            .map_err(|e| self.err(i, format!("set up its ring (PACKET_RX_RING, V3): {e}")))?;
        let bs = r.block_size as usize;
        let map = sk::SharedMap::new(f, bs * r.block_nr as usize, true)
            .map_err(|e| self.err(i, format!("map its ring: {e}")))?;
        let fields = |b: usize| {
            let mut h = [0u8; 32];
            map.read(b * bs, &mut h);
            block_fields(&h)
        };
        let current = || {
            (0..r.block_nr as usize)
                .map(|b| (b, fields(b).2))
                .max_by_key(|&(_, seq)| seq)
                .unwrap_or((0, 0))
        };
        let drop_all = [0x06u8, 0, 0, 0, 0, 0, 0, 0];
        // As many blocks as it had filled, or (past V3_MAX_BLOCKS) only as many as bring it
        // to the same block: its sequence numbers then count on from a lower one.
        let target = if r.seq.saturating_sub(1) > V3_MAX_BLOCKS {
            (r.seq - 1) % u64::from(r.block_nr.max(1)) + 1
        } else {
            r.seq
        };
        if target > 1 {
            let lo = sk::interface_index("lo").map_err(|e| {
                self.err(
                    i,
                    format!("find the loopback interface, to bring its ring to its place: {e}"),
                )
            })?;
            sk::bind(f, &sockaddr_ll(ADVANCE_ETHERTYPE.to_be(), lo)).map_err(|e| {
                self.err(
                    i,
                    format!("bind to the loopback interface for a moment: {e}"),
                )
            })?;
            let sender = sk::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0)
                .map_err(|e| self.err(i, format!("a packet socket to fill its ring: {e}")))?;
            // A frame too large for two to share a block (the kernel cuts what does not fit).
            let len = (bs / 2 + 64).clamp(64, 65000);
            let mut frame = vec![0u8; len];
            frame[12..14].copy_from_slice(&ADVANCE_ETHERTYPE.to_be_bytes());
            let mut to = sockaddr_ll(ADVANCE_ETHERTYPE.to_be(), lo);
            to[11] = 6; // sll_halen
            let give_back = || {
                for b in 0..r.block_nr as usize {
                    if fields(b).0 & TP_STATUS_USER != 0 {
                        map.store_u32(b * bs + BLOCK_STATUS, 0);
                    }
                }
            };
            let packets = |b: usize| fields(b).1;
            // Block by block up to the image's: a frame into the block before it, which the
            // timer then retires (a frame that does not fit closes a block at once).
            loop {
                let (b, seq) = current();
                if seq >= target {
                    break;
                }
                give_back();
                if seq + 1 == target && packets(b) > 0 {
                    self.wait_ring(i, "its ring's timer to retire a block", || {
                        current().1 != seq
                    })?;
                    continue;
                }
                let had = packets(b);
                sk::send(sender.as_raw_fd(), &frame, Some(&to), &[], 0).map_err(|e| {
                    self.err(i, format!("send a frame over the loopback interface: {e}"))
                })?;
                self.wait_ring(i, "its ring to take the frame sent to it", || {
                    let (nb, nseq) = current();
                    nseq != seq || packets(nb) != had
                })?;
            }
        }
        sk::attach_filter(f, &drop_all)
            .map_err(|e| self.err(i, format!("attach a filter holding packets back: {e}")))?;
        let (b, seq) = current();
        if (b as u32, seq) != (r.head, target) || fields(b).1 != 0 {
            return Err(self.err(
                i,
                format!(
                    "its ring came to block {b} (sequence number {seq}, {} packets), not to \
                     block {} (sequence number {target}, empty)",
                    fields(b).1,
                    r.head,
                ),
            ));
        }
        let _ = sk::getsockopt(f, SOL_PACKET, PACKET_STATISTICS, 12);
        let zero = vec![0u8; bs];
        for n in 0..r.block_nr as usize {
            if n != b {
                map.write(n * bs, &zero);
            }
        }
        for fr in &r.frames {
            if fr.index >= r.block_nr || fr.bytes.len() != bs {
                return Err(self.err(i, format!("ring block {} is malformed", fr.index)));
            }
            // The status word last, as the kernel writes it.
            let at = fr.index as usize * bs;
            map.write(at, &fr.bytes[..BLOCK_STATUS]);
            map.write(at + BLOCK_STATUS + 4, &fr.bytes[BLOCK_STATUS + 4..]);
            let status = u32::from_ne_bytes(
                fr.bytes[BLOCK_STATUS..BLOCK_STATUS + 4]
                    .try_into()
                    .expect("4 bytes"),
            );
            map.store_u32(at + BLOCK_STATUS, status);
        }
        Ok(())
    }

    fn wait_ring(&self, i: usize, what: &str, done: impl Fn() -> bool) -> Result<()> {
        let t0 = std::time::Instant::now();
        // (The loopback interface delivers at once, as a rule: a few turns before sleeping.)
        for _ in 0..200 {
            if done() {
                return Ok(());
            }
            std::thread::yield_now();
        }
        while !done() {
            if t0.elapsed() > ADVANCE_WAIT {
                return Err(self.err(
                    i,
                    format!(
                        "waited {} s for {what} (is the loopback interface up?)",
                        ADVANCE_WAIT.as_secs()
                    ),
                ));
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        Ok(())
    }

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
        for m in &p.memberships {
            let ifindex = sk::interface_index(&m.interface).map_err(|e| {
                self.err(
                    i,
                    format!("find interface {} of a membership here: {e}", m.interface),
                )
            })?;
            // struct packet_mreq, with room for the longest address (packet_mreq_max).
            let mut mreq = (ifindex as i32).to_ne_bytes().to_vec();
            mreq.extend_from_slice(&m.mr_type.to_ne_bytes());
            mreq.extend_from_slice(&(m.addr.len() as u16).to_ne_bytes());
            let mut addr = [0u8; 32];
            addr[..m.addr.len().min(32)].copy_from_slice(&m.addr[..m.addr.len().min(32)]);
            mreq.extend_from_slice(&addr);
            for _ in 0..m.count.max(1) {
                sk::setsockopt(f, SOL_PACKET, PACKET_ADD_MEMBERSHIP, &mreq).map_err(|e| {
                    self.err(
                        i,
                        format!(
                            "take membership (type {}) of interface {} again: {e}",
                            m.mr_type, m.interface
                        ),
                    )
                })?;
            }
        }
        Ok(())
    }
}
