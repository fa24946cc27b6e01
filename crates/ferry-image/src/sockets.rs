//! Image schema of sockets: UNIX (stream, datagram, seqpacket), TCP and UDP over IPv4 and IPv6.
//!
//! Sockets refer to each other by the inode number they had when captured (`SocketDesc::ino`):
//! the two ends of a connection, a listening socket and the clients waiting in its queue.

use serde::{Deserialize, Serialize};

/// A socket: its family, type, addresses, options, state and queued data.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct SocketDesc {
    /// Inode number of the socket when it was captured; other sockets name it by this.
    pub ino: u64,
    pub family: SockFamily,
    pub sock_type: SockType,
    pub protocol: i32,
    /// The name the socket is bound to (getsockname), `None` when it is not bound.
    pub local: Option<SockAddr>,
    /// The peer's name (getpeername), when connected.
    pub peer: Option<SockAddr>,
    pub state: SockState,
    pub shutdown: Shutdown,
    /// For a UNIX socket bound to a path: the socket file.
    pub path_file: Option<SocketFile>,
    /// SO_PEERCRED of a UNIX socket: who created the pair, called listen() or connect().
    pub peer_cred: Option<PeerCred>,
    /// Data waiting to be read from this socket, oldest first: for datagram and seqpacket
    /// sockets one message per datagram or record; for stream sockets chunks whose boundaries
    /// carry no meaning.
    pub queue: Vec<SockMsg>,
    /// Options that differ between sockets (raw values as getsockopt returns them).
    pub opts: Vec<SockOpt>,
    /// A pending error (SO_ERROR) the socket will report: ECONNRESET for a UNIX stream socket
    /// whose peer closed without reading everything.
    #[serde(default)]
    pub error: i32,
    /// A UNIX stream socket connected to a process at the tree's home (outside the tree):
    /// rebuilt by a migration as one end of a fresh pair whose other end the daemons relay to
    /// the home's socket (see ARCHITECTURE.md, "Relays"); its queue stays at home. Any other
    /// restore refuses it.
    #[serde(default)]
    pub relayed: bool,
    /// A relayed socket of a body moving on (B to C): the socket is the body node's stand-in
    /// for relay `relay` of the tree's home (`RelayOpen::pipe`); `ino`, `local` and `peer` are
    /// the original's at home. The restore gives the relay's end to the new node, which
    /// attaches it to the same relay at home (docs/wire-format.md, "Moving on with relays").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub relay: Option<u32>,
    /// For a TCP connection, established or half-closed (`state` is `Connected`, `queue` holds
    /// the bytes received and not yet read): what TCP repair mode needs to make it again. For
    /// TCP `shutdown` says what this end has shut down (`read`: shutdown(SHUT_RD) here or the
    /// other end's FIN; `write`: this end's FIN, see `TcpConn::fin_sent`).
    #[serde(default)]
    pub tcp: Option<Box<TcpConn>>,
    /// A classic BPF filter attached to the socket (SO_ATTACH_FILTER), as SO_GET_FILTER reads
    /// it back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filter: Option<SockFilter>,
    /// A netlink socket's addresses and multicast groups (`family` is `Netlink`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub netlink: Option<NetlinkState>,
    /// A packet socket's binding and fanout group (`family` is `Packet`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub packet: Option<PacketState>,
}

/// What a packet socket (AF_PACKET) is bound to.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct PacketState {
    /// The protocol it takes (sll_protocol of getsockname: an EtherType in network order).
    pub protocol: u16,
    /// The interface it is bound to, by name (an index means nothing on another machine);
    /// `None` for every interface.
    pub interface: Option<String>,
    /// PACKET_FANOUT: the fanout group it is in (id | mode << 16 | flags), 0 for none.
    pub fanout: u32,
    /// Its receive ring (PACKET_RX_RING), if it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rx_ring: Option<Box<PacketRing>>,
    /// Its transmit ring (PACKET_TX_RING), if it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tx_ring: Option<Box<PacketRing>>,
    /// Its memberships (PACKET_ADD_MEMBERSHIP), in the order sock_diag lists them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub memberships: Vec<PacketMembership>,
}

/// A packet socket's ring (TPACKET_V1 or V2: frames, each with a status word the program and
/// the kernel hand back and forth; TPACKET_V3: blocks of frames, each block with its status
/// word): its geometry (`struct tpacket_req3`), where the kernel takes the next frame (block)
/// from, and the frames (blocks) that hold anything.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct PacketRing {
    pub block_size: u32,
    pub block_nr: u32,
    pub frame_size: u32,
    pub frame_nr: u32,
    /// TPACKET_V3: the block retire timeout (ms), the private area's size and the features
    /// asked for (`struct tpacket_req3`); 0 otherwise.
    #[serde(default)]
    pub retire_tmo: u32,
    #[serde(default)]
    pub sizeof_priv: u32,
    #[serde(default)]
    pub features: u32,
    /// The frame the kernel fills (receive) or sends (transmit) next; TPACKET_V3: the block it
    /// fills now (open, empty).
    pub head: u32,
    /// TPACKET_V3: the sequence number of that block (the next blocks count on from it).
    #[serde(default)]
    pub seq: u64,
    /// Every frame (TPACKET_V3: block) not all zero, by index, with its bytes (header and data,
    /// `frame_size`; TPACKET_V3: `block_size`).
    pub frames: Vec<PacketFrame>,
}

#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct PacketFrame {
    pub index: u32,
    #[serde(with = "serde_bytes")]
    pub bytes: Vec<u8>,
}

/// A membership of a packet socket (`struct packet_mreq`), taken `count` times.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct PacketMembership {
    /// The interface, by name.
    pub interface: String,
    /// PACKET_MR_MULTICAST (0), PACKET_MR_PROMISC (1), PACKET_MR_ALLMULTI (2),
    /// PACKET_MR_UNICAST (3).
    pub mr_type: u16,
    #[serde(with = "serde_bytes")]
    pub addr: Vec<u8>,
    pub count: u32,
}

/// What a netlink socket is bound and connected to.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct NetlinkState {
    /// Its port id (nl_pid of getsockname), 0 when it is not bound.
    pub port: u32,
    /// The multicast groups it listens to (NETLINK_LIST_MEMBERSHIPS), by number (1 and up).
    pub groups: Vec<u32>,
    /// Where it sends by default (connect): a port id and a group mask (getpeername).
    pub dst_port: u32,
    pub dst_groups: u32,
}

/// A classic BPF socket filter.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct SockFilter {
    /// The program: `struct sock_filter` instructions, 8 bytes each, in the machine's order.
    #[serde(with = "serde_bytes")]
    pub insns: Vec<u8>,
    /// SO_LOCK_FILTER: the filter can be neither replaced nor removed.
    pub locked: bool,
}

/// A TCP connection, as TCP repair mode reads it (tcp(7), TCP_REPAIR): established, or on its
/// way to closing (FIN_WAIT1, FIN_WAIT2, CLOSE_WAIT, CLOSING, LAST_ACK). The sequence numbers
/// leave out the FINs (each takes one): a connection is made again as established, and its
/// FINs are sent again, for real, when the tree is about to run.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct TcpConn {
    /// Sequence number of the first byte of `send_queue` (the oldest byte not acknowledged).
    pub send_seq: u32,
    /// Sequence number of the first byte not yet read (the first byte of the socket's `queue`).
    pub recv_seq: u32,
    /// The send queue: bytes sent but not acknowledged, then bytes not sent yet.
    #[serde(with = "serde_bytes")]
    pub send_queue: Vec<u8>,
    /// How many bytes at the end of `send_queue` were never sent.
    pub unsent: u32,
    /// Options negotiated when the connection was made.
    pub mss_clamp: u32,
    /// Window scaling, when negotiated: (send shift, receive shift).
    pub wscale: Option<(u8, u8)>,
    pub sack: bool,
    pub timestamps: bool,
    /// TCP_TIMESTAMP: the connection's timestamp clock when captured (opaque; its low bit says
    /// microsecond timestamps).
    pub timestamp: u32,
    /// TCP_REPAIR_WINDOW.
    pub window: TcpWindow,
    /// This end has sent (or queued, after `send_queue`) its FIN: shutdown(SHUT_WR), or
    /// FIN_WAIT1, FIN_WAIT2, CLOSING, LAST_ACK. Sent again at resume with shutdown(SHUT_WR).
    #[serde(default)]
    pub fin_sent: bool,
    /// The other end's FIN has arrived, after the bytes of the socket's `queue` (CLOSE_WAIT,
    /// CLOSING, LAST_ACK): the other end, a socket of the tree, sends it again at resume.
    #[serde(default)]
    pub fin_received: bool,
    /// The other end had closed its descriptor: it lingered in FIN_WAIT2, held by no
    /// process (this end is CLOSE_WAIT). A stand-in plays it at resume: it sends the FIN
    /// again, and is closed, lingering as the original did.
    #[serde(default)]
    pub peer_closed: bool,
    /// The kernel's TCP state number when captured (1 ESTABLISHED, 4 FIN_WAIT1, 5 FIN_WAIT2,
    /// 8 CLOSE_WAIT, 9 LAST_ACK, 11 CLOSING), for people; 0 in images that did not record it.
    #[serde(default)]
    pub state: u8,
}

/// The window state of a TCP connection (`struct tcp_repair_window`).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct TcpWindow {
    pub snd_wl1: u32,
    pub snd_wnd: u32,
    pub max_window: u32,
    pub rcv_wnd: u32,
    pub rcv_wup: u32,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, Default, PartialEq, Eq)]
pub enum SockFamily {
    #[default]
    Unix,
    Inet,
    Inet6,
    /// AF_NETLINK (`SocketDesc::protocol` is the netlink family: NETLINK_ROUTE ...).
    Netlink,
    /// AF_PACKET (`SocketDesc::protocol` is the EtherType given to socket(2), in network order).
    Packet,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, Default, PartialEq, Eq)]
pub enum SockType {
    #[default]
    Stream,
    Dgram,
    Seqpacket,
    /// SOCK_RAW.
    Raw,
}

/// A socket address.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub enum SockAddr {
    /// A UNIX socket that has no name (autobind never happened).
    UnixUnnamed,
    /// A UNIX name in the file system, as the socket was bound (possibly relative).
    UnixPath(#[serde(with = "serde_bytes")] Vec<u8>),
    /// A UNIX name in the abstract namespace, without the leading NUL byte.
    UnixAbstract(#[serde(with = "serde_bytes")] Vec<u8>),
    Inet {
        addr: [u8; 4],
        port: u16,
    },
    Inet6 {
        addr: [u8; 16],
        port: u16,
        flowinfo: u32,
        scope_id: u32,
    },
}

#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub enum SockState {
    /// Neither listening nor connected (maybe bound).
    #[default]
    Unconnected,
    /// Listening, with the connections that wait to be accepted, in queue order.
    Listening {
        backlog: u32,
        pending: Vec<PendingConn>,
    },
    /// Connected. For UNIX sockets `peer_ino` is the peer's inode: a socket of the tree, or 0
    /// when the peer has been closed. For UDP it is 0 and `SocketDesc::peer` says where to.
    /// For an established TCP connection it is the inode of the other end, a socket of the
    /// tree (`SocketDesc::tcp` holds the connection's state).
    Connected { peer_ino: u64 },
    /// A client whose connection waits in the queue of the listening socket `listener_ino`
    /// (which lists it in its `pending`). For TCP, `listener_ino` 0 is a connection still
    /// being opened (SYN_SENT) to `SocketDesc::peer`.
    Pending { listener_ino: u64 },
}

/// A connection waiting in a listening UNIX socket's queue.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct PendingConn {
    /// Inode of the client socket (a socket of the tree), or 0 if the client has been closed.
    pub client_ino: u64,
    /// What the client sent that waits in the server's end of the connection.
    pub queue: Vec<SockMsg>,
    /// SO_PEERCRED the server end will report: who called connect().
    pub cred: Option<PeerCred>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct Shutdown {
    /// No more receptions (SHUT_RD here, or SHUT_WR at the peer).
    pub read: bool,
    /// No more transmissions.
    pub write: bool,
}

/// The file a UNIX socket bound to a path created.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct SocketFile {
    /// For a relative name: the directory it was bound in.
    pub dir: Option<String>,
    /// The file has been removed (or replaced) since the socket was bound.
    pub deleted: bool,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
}

/// Credentials of a process as a UNIX socket recorded them.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct PeerCred {
    pub pid: i32,
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
}

/// One message waiting in a socket's receive queue.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct SockMsg {
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
    /// Sender's address, when the socket reports one (datagrams).
    pub from: Option<SockAddr>,
    /// Descriptors in flight with this message (SCM_RIGHTS), in order: the ids of open file
    /// descriptions in `Tree::files` (which may be held by no process, only by this message).
    /// In a stream socket's queue, a message with descriptors is exactly the bytes the kernel
    /// attached them to.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rights: Vec<u32>,
}

/// A socket option, as getsockopt(level, name) returned it.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct SockOpt {
    pub level: i32,
    pub name: i32,
    #[serde(with = "serde_bytes")]
    pub value: Vec<u8>,
}

impl std::fmt::Display for SockAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SockAddr::UnixUnnamed => write!(f, "(unnamed)"),
            SockAddr::UnixPath(p) => write!(f, "{}", String::from_utf8_lossy(p)),
            SockAddr::UnixAbstract(n) => write!(f, "@{}", String::from_utf8_lossy(n)),
            SockAddr::Inet { addr, port } => {
                write!(f, "{}:{port}", std::net::Ipv4Addr::from(*addr))
            }
            SockAddr::Inet6 { addr, port, .. } => {
                write!(f, "[{}]:{port}", std::net::Ipv6Addr::from(*addr))
            }
        }
    }
}

/// One line for people: family and type, names, state and how much is queued.
impl std::fmt::Display for SocketDesc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match (self.family, self.sock_type) {
            (SockFamily::Unix, SockType::Stream) => "unix stream",
            (SockFamily::Unix, SockType::Dgram) => "unix dgram",
            (SockFamily::Unix, _) => "unix seqpacket",
            (SockFamily::Netlink, _) => "netlink",
            (SockFamily::Packet, SockType::Dgram) => "packet dgram",
            (SockFamily::Packet, _) => "packet raw",
            (SockFamily::Inet | SockFamily::Inet6, SockType::Raw) => "raw",
            (SockFamily::Inet, SockType::Stream) => "tcp",
            (SockFamily::Inet6, SockType::Stream) => "tcp6",
            (SockFamily::Inet, _) => "udp",
            (SockFamily::Inet6, _) => "udp6",
        };
        write!(f, "{kind} [{}]", self.ino)?;
        if let Some(p) = &self.packet {
            write!(f, " proto={:#06x}", u16::from_be(p.protocol))?;
            if let Some(i) = &p.interface {
                write!(f, " on {i}")?;
            }
            if p.fanout != 0 {
                write!(f, " fanout={:#x}", p.fanout)?;
            }
        }
        if let Some(n) = &self.netlink {
            write!(f, " proto={} port={}", self.protocol, n.port)?;
            if !n.groups.is_empty() {
                let g: Vec<String> = n.groups.iter().map(|g| g.to_string()).collect();
                write!(f, " groups={}", g.join(","))?;
            }
            if n.dst_port != 0 || n.dst_groups != 0 {
                write!(f, " -> port={} groups={:#x}", n.dst_port, n.dst_groups)?;
            }
        }
        if let Some(l) = &self.local {
            write!(f, " {l}")?;
            if self.path_file.as_ref().is_some_and(|p| p.deleted) {
                write!(f, " (deleted)")?;
            }
        }
        match &self.state {
            SockState::Unconnected => {}
            SockState::Listening { backlog, pending } => {
                write!(f, " listening backlog={backlog}")?;
                if !pending.is_empty() {
                    write!(f, " waiting={}", pending.len())?;
                }
            }
            SockState::Connected { peer_ino } => {
                write!(f, " ->")?;
                if let Some(p) = &self.peer {
                    write!(f, " {p}")?;
                }
                match (*peer_ino, self.family) {
                    (0, SockFamily::Unix) => write!(f, " (closed)")?,
                    (0, _) => {}
                    (ino, _) => write!(f, " [{ino}]")?,
                }
            }
            SockState::Pending { listener_ino } => {
                write!(f, " waiting in the queue of [{listener_ino}]")?
            }
        }
        if let Some(t) = &self.tcp {
            let state = match t.state {
                4 => "fin_wait1",
                5 => "fin_wait2",
                8 => "close_wait",
                9 => "last_ack",
                11 => "closing",
                _ => "established",
            };
            write!(f, " {state}")?;
        }
        if self.shutdown.read || self.shutdown.write {
            let how = match (self.shutdown.read, self.shutdown.write) {
                (true, true) => "rdwr",
                (true, false) => "rd",
                _ => "wr",
            };
            write!(f, " shut={how}")?;
        }
        if !self.queue.is_empty() {
            let bytes: usize = self.queue.iter().map(|m| m.data.len()).sum();
            write!(f, " queued={bytes}B")?;
            if self.sock_type != SockType::Stream {
                write!(f, "/{}msg", self.queue.len())?;
            }
            let fds: usize = self.queue.iter().map(|m| m.rights.len()).sum();
            if fds > 0 {
                write!(f, " in-flight={fds}fd")?;
            }
        }
        if let Some(t) = &self.tcp {
            if !t.send_queue.is_empty() {
                write!(f, " sendq={}B", t.send_queue.len())?;
                if t.unsent > 0 {
                    write!(f, " (unsent={}B)", t.unsent)?;
                }
            }
            write!(f, " seq=snd:{}/rcv:{}", t.send_seq, t.recv_seq)?;
        }
        if let Some(c) = &self.peer_cred {
            write!(f, " cred={}:{}:{}", c.pid, c.uid, c.gid)?;
        }
        if let Some(flt) = &self.filter {
            write!(f, " filter={}insns", flt.insns.len() / 8)?;
            if flt.locked {
                write!(f, "(locked)")?;
            }
        }
        Ok(())
    }
}
