//! Descriptors backed by sockets: UNIX (stream, datagram, seqpacket; pairs and named; listening
//! with the connections waiting in their queues, and connected, with queued data), TCP
//! listening sockets (with the connections waiting in their queues) and unconnected ones, TCP
//! connections (being opened, established, half-closed or closing) whose both ends are in the
//! tree, and UDP sockets.
//!
//! A TCP connection is read in TCP repair mode (tcp(7)): its sequence numbers,
//! both queues (peeked), the options negotiated and the window; repair mode is taken off again
//! at once, so a tree that is let go keeps working connections. Just before a captured tree is
//! killed its connections are put back in repair mode ([`silence_tcp_connections`]), so they
//! close without a word to the other end. Restore makes each socket in repair mode, and binds it
//! (whoever holds the port: repair mode forces it), connects it (without a handshake) and
//! refills its queues only when the tree is about to run, when the original's sockets are gone;
//! then both ends leave repair mode ([`Deferred`]), and the FINs of a connection that was
//! shut down are sent again ([`replay_shutdowns`]).
//!
//! Capture takes a copy of each socket with pidfd_getfd(2) and reads it from outside: options
//! with getsockopt, names, state and peers with sock_diag(7), queued data with MSG_PEEK at
//! SO_PEEK_OFF (put back afterwards), so the socket never notices. Once every process is
//! captured, [`finish_capture`] checks that every peer is part of the tree and turns clients
//! whose connection waits in a listener's queue into [`SockState::Pending`]. Data a pending
//! client already sent sits in the server end, which no descriptor reaches: those connections
//! are accepted from a copy of the listener, read, and made again in the running tree with a
//! new client socket installed in place of the old one (so a refused or --leave-running
//! checkpoint leaves the tree working).
//!
//! Restore rebuilds every socket of the tree at once, when the first is asked for: pairs,
//! names, listeners and their queues, connections, queued data, shutdowns and options. A UNIX
//! socket records who created it (SO_PEERCRED), so pairs, listen() and connect() run in a
//! short-lived helper process under the PID and credentials that are to be recorded. A TCP or
//! UDP address that another socket still holds (the tree's original, frozen on this machine
//! during a migration between nodes of one machine) is taken only when the tree is about to
//! run: see [`Deferred`].
//!
//! One file per family, as CRIU keeps sk-unix.c, sk-inet.c and sk-tcp.c apart: this one holds
//! the shared plumbing (addresses, options, the capture of one descriptor, the check of the
//! whole tree, the rebuild's [`Builder`] and the [`Deferred`] machinery), `unix` the UNIX
//! sockets, `inet` what TCP and UDP share, `tcp` the TCP repair-mode work, `udp` the UDP
//! datagrams, `ping` the ICMP echo sockets, `raw` and `packet` those that see raw packets,
//! `netlink` the kernel's, and `scm` the descriptors in flight in UNIX sockets' queues
//! (SCM_RIGHTS).

mod filter;
mod inet;
mod netlink;
mod packet;
mod ping;
mod raw;
mod relayed;
mod scm;
mod tcp;
mod udp;
mod unix;

use crate::error::{Context, Error, Result};
use crate::freeze::FrozenTree;
use crate::husk::Husk;
use crate::procfs;
use ferry_image::{
    FileDesc, FileKind, NetlinkState, PacketState, PeerCred, PendingConn, Process, Shutdown,
    SockAddr, SockFamily, SockFilter, SockMsg, SockOpt, SockState, SockType, SocketDesc,
    SocketFile, TcpConn, TcpWindow, Tree,
};
use ferry_sys::fsid::{with_fs_creds, FsCreds};
use ferry_sys::sockets::{self as sk, HelperCred, HelperOp};
use ferry_sys::{fdops, pidfd};
use inet::*;
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use tcp::*;
use udp::*;
use unix::*;

pub use relayed::{name_bytes, relayed_files, relayed_names, RelayedNames};
pub use scm::InFlight;
pub(crate) use scm::{holders_in_flight, may_fly, name_carrier};
pub use tcp::silence_tcp_connections;

const TCP_ESTABLISHED: u8 = 1;
const TCP_LISTEN: u8 = 10;
const RCV_SHUTDOWN: u8 = 1;
const SEND_SHUTDOWN: u8 = 2;
const SOL_SOCKET: i32 = libc::SOL_SOCKET;
const IPPROTO_IP: i32 = libc::IPPROTO_IP;
const IPPROTO_IPV6: i32 = libc::IPPROTO_IPV6;
const IPPROTO_TCP: i32 = libc::IPPROTO_TCP;
const IPPROTO_UDPLITE: i32 = 136;
const SO_RCVTIMEO_OLD: i32 = 20;
const SO_SNDTIMEO_OLD: i32 = 21;
const SO_TIMESTAMP_OLD: i32 = 29;
const SO_TIMESTAMPNS_OLD: i32 = 35;
/// Which buffer sizes the socket keeps as set (SOCK_SNDBUF_LOCK 1 | SOCK_RCVBUF_LOCK 2).
const SO_BUF_LOCK: i32 = 72;
const TCP_INFO_LEN: usize = 104;
/// tcpi_options bits.
const TCPI_OPT_TIMESTAMPS: u8 = 1;
const TCPI_OPT_SACK: u8 = 2;
const TCPI_OPT_WSCALE: u8 = 4;
/// A stream chunk or datagram is peeked in pieces of at most this many bytes.
const PEEK_CHUNK: usize = 1 << 20;

// ---------------------------------------------------------------------------------------------
// Addresses
// ---------------------------------------------------------------------------------------------

/// Decodes a raw socket address as the kernel reports it.
pub fn decode_addr(raw: &[u8]) -> Option<SockAddr> {
    if raw.len() < 2 {
        return None;
    }
    let family = i32::from(u16::from_ne_bytes([raw[0], raw[1]]));
    match family {
        libc::AF_UNIX => {
            let path = &raw[2..];
            if path.is_empty() {
                Some(SockAddr::UnixUnnamed)
            } else if path[0] == 0 {
                Some(SockAddr::UnixAbstract(path[1..].to_vec()))
            } else {
                let end = path.iter().position(|&b| b == 0).unwrap_or(path.len());
                Some(SockAddr::UnixPath(path[..end].to_vec()))
            }
        }
        libc::AF_INET if raw.len() >= 8 => Some(SockAddr::Inet {
            port: u16::from_be_bytes([raw[2], raw[3]]),
            addr: raw[4..8].try_into().expect("4 bytes"),
        }),
        libc::AF_INET6 if raw.len() >= 28 => Some(SockAddr::Inet6 {
            port: u16::from_be_bytes([raw[2], raw[3]]),
            flowinfo: u32::from_be_bytes(raw[4..8].try_into().expect("4 bytes")),
            addr: raw[8..24].try_into().expect("16 bytes"),
            scope_id: u32::from_ne_bytes(raw[24..28].try_into().expect("4 bytes")),
        }),
        _ => None,
    }
}

/// The raw socket address for `a`, as bind(2) and connect(2) take it.
pub fn encode_addr(a: &SockAddr) -> Vec<u8> {
    let fam = |f: i32| (f as u16).to_ne_bytes().to_vec();
    match a {
        SockAddr::UnixUnnamed => fam(libc::AF_UNIX),
        SockAddr::UnixPath(p) => {
            let mut v = fam(libc::AF_UNIX);
            v.extend_from_slice(p);
            // A name that fills sun_path (108 bytes) has no terminating NUL.
            if p.len() < 108 {
                v.push(0);
            }
            v
        }
        SockAddr::UnixAbstract(n) => {
            let mut v = fam(libc::AF_UNIX);
            v.push(0);
            v.extend_from_slice(n);
            v
        }
        SockAddr::Inet { addr, port } => {
            let mut v = fam(libc::AF_INET);
            v.extend_from_slice(&port.to_be_bytes());
            v.extend_from_slice(addr);
            v.extend_from_slice(&[0; 8]);
            v
        }
        SockAddr::Inet6 {
            addr,
            port,
            flowinfo,
            scope_id,
        } => {
            let mut v = fam(libc::AF_INET6);
            v.extend_from_slice(&port.to_be_bytes());
            v.extend_from_slice(&flowinfo.to_be_bytes());
            v.extend_from_slice(addr);
            v.extend_from_slice(&scope_id.to_ne_bytes());
            v
        }
    }
}

/// A socket address for people.
pub fn describe(a: &SockAddr) -> String {
    a.to_string()
}

fn is_unspecified(a: &SockAddr) -> bool {
    match a {
        SockAddr::Inet { addr, port } => *port == 0 && *addr == [0; 4],
        SockAddr::Inet6 { addr, port, .. } => *port == 0 && *addr == [0; 16],
        SockAddr::UnixUnnamed => true,
        _ => false,
    }
}

fn family_name(domain: i32) -> &'static str {
    match domain {
        libc::AF_NETLINK => "netlink",
        libc::AF_PACKET => "packet",
        libc::AF_BLUETOOTH => "bluetooth",
        libc::AF_ALG => "crypto API",
        libc::AF_VSOCK => "vsock",
        libc::AF_XDP => "XDP",
        libc::AF_TIPC => "TIPC",
        libc::AF_CAN => "CAN",
        _ => "other",
    }
}

/// Whether a device number as sock_diag reports it (the kernel's own encoding) and one as stat(2)
/// reports it name the same device.
pub(crate) fn same_dev(kernel: u32, user: u64) -> bool {
    let (kmaj, kmin) = (u64::from(kernel >> 20), u64::from(kernel & 0xfffff));
    let umaj = ((user >> 8) & 0xfff) | ((user >> 32) & !0xfff);
    let umin = (user & 0xff) | ((user >> 12) & !0xff);
    (kmaj, kmin) == (umaj, umin)
}

// ---------------------------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------------------------

/// (level, name, size) of the options captured for UNIX sockets.
const UNIX_OPTS: &[(i32, i32, usize)] = &[
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
const INET_OPTS: &[(i32, i32, usize)] = &[
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

const IPV4_OPTS: &[(i32, i32, usize)] = &[
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

const IPV6_OPTS: &[(i32, i32, usize)] = &[
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

const TCP_OPTS: &[(i32, i32, usize)] = &[
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

const UDP_OPTS: &[(i32, i32, usize)] = &[(SOL_SOCKET, libc::SO_PEEK_OFF, 4)];

/// Options of established TCP connections only.
const TCP_CONN_OPTS: &[(i32, i32, usize)] = &[(SOL_SOCKET, libc::SO_PEEK_OFF, 4)];

/// Reads every option of `list` that the socket has (options it does not know are skipped).
fn capture_opts(s: RawFd, lists: &[&[(i32, i32, usize)]]) -> Vec<SockOpt> {
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

fn is_multicast_opt(o: &SockOpt) -> bool {
    (o.level == IPPROTO_IP
        && (o.name == libc::IP_MULTICAST_TTL || o.name == libc::IP_MULTICAST_LOOP))
        || (o.level == IPPROTO_IPV6
            && (o.name == libc::IPV6_MULTICAST_HOPS || o.name == libc::IPV6_MULTICAST_LOOP))
}

fn opt_int(desc: &SocketDesc, level: i32, name: i32) -> Option<i32> {
    desc.opts
        .iter()
        .find(|o| o.level == level && o.name == name && o.value.len() >= 4)
        .map(|o| i32::from_ne_bytes(o.value[..4].try_into().expect("4 bytes")))
}

/// Sets every captured option that a new socket does not already have (SO_PEEK_OFF is left to
/// the caller: it must come after the queue is refilled).
fn apply_opts(s: RawFd, opts: &[SockOpt], force_buffers: bool) {
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

fn set_peek_off(s: RawFd, desc: &SocketDesc) {
    if let Some(off) = opt_int(desc, SOL_SOCKET, libc::SO_PEEK_OFF) {
        if off >= 0 {
            if let Err(e) = sk::setsockopt_int(s, SOL_SOCKET, libc::SO_PEEK_OFF, off) {
                log::warn!("SO_PEEK_OFF not restored: {e}");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Capture
// ---------------------------------------------------------------------------------------------

struct Cap<'a> {
    pid: i32,
    fd: i32,
    ino: u64,
    link: &'a str,
    s: RawFd,
    /// Where descriptors found in flight in its queue are kept.
    flight: &'a RefCell<InFlight>,
}

impl Cap<'_> {
    fn refuse(&self, why: impl Into<String>) -> Error {
        Error::Unsupported {
            pid: self.pid,
            what: format!("fd {} ({})", self.fd, self.link),
            why: why.into(),
        }
    }

    fn what(&self, w: &str) -> String {
        format!("{w} of fd {} ({})", self.fd, self.link)
    }

    fn name(&self, peer: bool) -> Result<Option<SockAddr>> {
        let raw = if peer {
            match sk::getpeername(self.s) {
                Ok(r) => r,
                Err(e) if e.errno == libc::ENOTCONN => return Ok(None),
                Err(e) => return Err(e).ctx(self.pid, || self.what("read the peer's name")),
            }
        } else {
            sk::getsockname(self.s).ctx(self.pid, || self.what("read the name"))?
        };
        Ok(decode_addr(&raw).filter(|a| peer || !is_unspecified(a)))
    }

    /// Runs `f` with SO_PEEK_OFF at 0, then puts the old offset back.
    fn with_peek_off<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let old = sk::getsockopt_int(self.s, SOL_SOCKET, libc::SO_PEEK_OFF)
            .ctx(self.pid, || self.what("read SO_PEEK_OFF"))?;
        sk::setsockopt_int(self.s, SOL_SOCKET, libc::SO_PEEK_OFF, 0).map_err(|e| {
            self.refuse(format!(
                "its queued data cannot be read without consuming it (SO_PEEK_OFF: {e})"
            ))
        })?;
        let r = f();
        let back = sk::setsockopt_int(self.s, SOL_SOCKET, libc::SO_PEEK_OFF, old)
            .ctx(self.pid, || self.what("put SO_PEEK_OFF back"));
        let v = r?;
        back?;
        Ok(v)
    }

    /// Keeps the descriptors in flight that came with a peeked message (see `scm`), returning
    /// what the message names them by.
    fn take_rights(&self, m: &mut sk::Received) -> Result<Vec<u32>> {
        if m.flags & libc::MSG_CTRUNC != 0 {
            return Err(self.refuse(
                "a queued message carries more ancillary data than could be read (descriptors \
                 in flight beyond our own limit of open files?)",
            ));
        }
        if m.rights.is_empty() {
            return Ok(Vec::new());
        }
        let carrier = scm::Carrier {
            pid: self.pid,
            fd: self.fd,
            ino: self.ino,
        };
        Ok(self
            .flight
            .borrow_mut()
            .keep(std::mem::take(&mut m.rights), carrier))
    }

    /// Peeks the `total` bytes queued in a stream socket.
    ///
    /// Descriptors in flight: a peek stops after the bytes that carry descriptors, and reports
    /// those descriptors; but it reports them too when it stops earlier (its buffer full), as
    /// it looks ahead for them. So descriptors count only for a peek that stopped short, or
    /// that reached the end of the queue; a chunk of bytes that ends where descriptors were
    /// attached is recorded with them (where those bytes begin, the kernel does not tell).
    fn peek_stream(&self, total: usize) -> Result<Vec<SockMsg>> {
        self.with_peek_off(|| {
            let mut out = Vec::new();
            let mut got = 0;
            let mut want = total.min(PEEK_CHUNK);
            while got < total {
                let mut m = match sk::recv(self.s, want, libc::MSG_PEEK | libc::MSG_DONTWAIT) {
                    Ok(m) => m,
                    Err(e) if e.errno == libc::EAGAIN => break,
                    Err(e) => return Err(e).ctx(self.pid, || self.what("peek the queued data")),
                };
                if m.data.is_empty() {
                    break;
                }
                let n = m.data.len();
                let ahead = !m.rights.is_empty() && n == want && got + n < total;
                if ahead {
                    // The descriptors may be those of bytes further on: look again, to the end.
                    want = total - got;
                    sk::setsockopt_int(self.s, SOL_SOCKET, libc::SO_PEEK_OFF, got as i32)
                        .ctx(self.pid, || self.what("set SO_PEEK_OFF"))?;
                    continue;
                }
                let rights = self.take_rights(&mut m)?;
                got += n;
                want = (total - got).min(PEEK_CHUNK);
                out.push(SockMsg {
                    data: m.data,
                    from: None,
                    rights,
                });
            }
            if got < total {
                return Err(self.refuse(format!(
                    "only {got} of the {total} bytes queued could be read without consuming \
                     them (out-of-band data?)"
                )));
            }
            Ok(out)
        })
    }

    /// Peeks the datagrams or records queued in a socket, with their senders' addresses.
    /// `total`, when known, is the number of bytes queued.
    fn peek_messages(
        &self,
        total: Option<usize>,
        read_shut: bool,
        with_from: bool,
    ) -> Result<Vec<SockMsg>> {
        self.with_peek_off(|| {
            let mut out = Vec::new();
            let (mut off, mut size, mut empties) = (0usize, 1usize << 16, 0usize);
            loop {
                if total.is_some_and(|t| off >= t) {
                    break;
                }
                let mut m = match sk::recv(self.s, size, libc::MSG_PEEK | libc::MSG_DONTWAIT) {
                    Ok(m) => m,
                    Err(e) if e.errno == libc::EAGAIN => break,
                    Err(e) => {
                        return Err(e).ctx(self.pid, || self.what("peek the queued messages"))
                    }
                };
                if m.flags & libc::MSG_TRUNC != 0 {
                    // Larger than the buffer: look at the same message again with more room.
                    size = size.saturating_mul(8);
                    if size > 1 << 28 {
                        return Err(self.refuse("a queued message is larger than 256 MiB"));
                    }
                    sk::setsockopt_int(self.s, SOL_SOCKET, libc::SO_PEEK_OFF, off as i32)
                        .ctx(self.pid, || self.what("set SO_PEEK_OFF"))?;
                    continue;
                }
                if m.data.is_empty() {
                    // A zero-length message, or the end after a shutdown.
                    if read_shut && total.is_none() {
                        break;
                    }
                    empties += 1;
                    if empties > 1 << 16 {
                        return Err(self.refuse("too many empty messages are queued"));
                    }
                } else {
                    empties = 0;
                }
                let rights = self.take_rights(&mut m)?;
                off += m.data.len();
                out.push(SockMsg {
                    rights,
                    from: if with_from {
                        decode_addr(&m.from)
                    } else {
                        None
                    },
                    data: m.data,
                });
            }
            Ok(out)
        })
    }
}

/// Describes descriptor `fd` of `pid` (whose /proc link is `link`, e.g.
/// "socket:[1234]", and whose fdinfo lines are `info`), or `None` when this module
/// does not handle that kind (the caller then refuses it).
///
/// Descriptors in flight in its queue are kept in `flight`, to be recorded by the caller.
pub fn classify(
    pid: i32,
    fd: i32,
    link: &str,
    _info: &[(String, String)],
    flight: &RefCell<InFlight>,
) -> Result<Option<FileKind>> {
    let Some(ino) = link
        .strip_prefix("socket:[")
        .and_then(|r| r.strip_suffix(']'))
        .and_then(|n| n.parse::<u64>().ok())
    else {
        return Ok(None);
    };
    let pidfd = pidfd::pidfd_open(pid).ctx(pid, || "open a pidfd".into())?;
    let sock =
        pidfd::pidfd_getfd(&pidfd, fd).ctx(pid, || format!("take a copy of fd {fd} ({link})"))?;
    let c = Cap {
        pid,
        fd,
        ino,
        link,
        s: sock.as_raw_fd(),
        flight,
    };
    let int =
        |name: i32, what: &str| sk::getsockopt_int(c.s, SOL_SOCKET, name).ctx(pid, || c.what(what));
    let domain = int(libc::SO_DOMAIN, "read SO_DOMAIN")?;
    let ty = int(libc::SO_TYPE, "read SO_TYPE")?;
    let protocol = int(libc::SO_PROTOCOL, "read SO_PROTOCOL")?;
    let sock_type = match ty {
        libc::SOCK_STREAM => SockType::Stream,
        libc::SOCK_DGRAM => SockType::Dgram,
        libc::SOCK_SEQPACKET => SockType::Seqpacket,
        libc::SOCK_RAW => SockType::Raw,
        _ => return Err(c.refuse(format!("sockets of type {ty} are not supported"))),
    };
    let filter = c.filter()?;
    let mut desc = match domain {
        libc::AF_UNIX => c.unix(sock_type)?,
        libc::AF_INET | libc::AF_INET6 => c.inet(domain, sock_type, protocol)?,
        libc::AF_NETLINK => c.netlink(sock_type, protocol)?,
        libc::AF_PACKET => c.packet(sock_type, protocol)?,
        _ => {
            return Err(c.refuse(format!(
                "{} sockets (address family {domain}) are not supported",
                family_name(domain)
            )))
        }
    };
    desc.filter = filter;
    Ok(Some(FileKind::Socket(desc)))
}

/// Once every process is captured: checks that the peers of the tree's UNIX sockets are in the
/// tree, marks clients that wait in a listener's queue, and captures what those clients have
/// already sent (see the module documentation).
pub fn finish_capture(frozen: &FrozenTree, tree: &mut Tree) -> Result<()> {
    let tree_pids: HashSet<i32> = tree.processes.iter().map(|p| p.pid).collect();
    // Where each description is held: file id -> [(pid, fd, cloexec)].
    let mut holders: HashMap<u32, Vec<(i32, i32, bool)>> = HashMap::new();
    for p in &tree.processes {
        for f in &p.fds {
            holders
                .entry(f.file)
                .or_default()
                .push((p.pid, f.fd, f.cloexec));
        }
    }
    let mut by_ino: HashMap<u64, usize> = HashMap::new();
    for (i, f) in tree.files.iter().enumerate() {
        if let FileKind::Socket(s) = &f.kind {
            if s.family == SockFamily::Unix {
                by_ino.insert(s.ino, i);
            }
        }
    }
    let root = tree.root_pid;
    let first_holder = |id: u32| {
        holders
            .get(&id)
            .and_then(|h| h.first().copied())
            .unwrap_or((root, -1, false))
    };
    let refuse = |id: u32, ino: u64, why: String| {
        let (pid, fd, _) = first_holder(id);
        Error::Unsupported {
            pid,
            what: format!("fd {fd} (socket:[{ino}])"),
            why,
        }
    };
    let carrying = tcp_peers(tree, &refuse, &tree_pids, frozen.relay_pipes)?;
    // Clients waiting in the queues of the tree's listeners: client inode -> listener inode.
    let mut waiting: HashMap<u64, u64> = HashMap::new();
    for f in &tree.files {
        if let FileKind::Socket(s) = &f.kind {
            if s.family != SockFamily::Unix {
                continue; // TCP listeners' queues: see tcp_peers
            }
            if let SockState::Listening { pending, .. } = &s.state {
                for c in pending {
                    if c.client_ino != 0 {
                        if !by_ino.contains_key(&c.client_ino) {
                            return Err(refuse(
                                f.id,
                                s.ino,
                                format!(
                                    "a connection from {}, outside the tree, waits in the queue \
                                     of this listening socket",
                                    describe_unix_ino(c.client_ino, &tree_pids)
                                ),
                            ));
                        }
                        waiting.insert(c.client_ino, s.ino);
                    }
                }
            }
        }
    }
    for f in tree.files.iter_mut() {
        let id = f.id;
        let FileKind::Socket(s) = &mut f.kind else {
            continue;
        };
        if s.family != SockFamily::Unix {
            continue;
        }
        let SockState::Connected { peer_ino } = s.state else {
            continue;
        };
        if peer_ino != 0 {
            if !by_ino.contains_key(&peer_ino)
                && frozen.relay_pipes
                && s.sock_type == SockType::Stream
                && holders.contains_key(&id)
            {
                // Relayed from home: what waits in it stays there, read by the relay.
                s.relayed = true;
                s.state = SockState::Connected { peer_ino: 0 };
                s.queue.clear();
                continue;
            }
            if !by_ino.contains_key(&peer_ino) {
                return Err(refuse(
                    id,
                    s.ino,
                    format!(
                        "it is connected to {}, which is outside the tree",
                        describe_unix_ino(peer_ino, &tree_pids)
                    ),
                ));
            }
            continue;
        }
        if let Some(l) = waiting.get(&s.ino) {
            s.state = SockState::Pending { listener_ino: *l };
        } else if s.sock_type != SockType::Dgram && !(s.shutdown.read && s.shutdown.write) {
            let to = s.peer.as_ref().map(describe).unwrap_or_else(|| "?".into());
            return Err(refuse(
                id,
                s.ino,
                format!(
                    "its connection to {to} waits to be accepted by a listening socket outside \
                     the tree"
                ),
            ));
        }
        // Otherwise the peer has been closed; the socket is restored that way.
    }
    // Who connected each waiting client: the first process holding it, with its credentials.
    let cred_of = |pid: i32| {
        tree.processes
            .iter()
            .find(|p| p.pid == pid)
            .map(|p| PeerCred {
                pid,
                uid: p.creds.uids[1],
                gid: p.creds.gids[1],
                groups: p.creds.groups.clone(),
            })
    };
    let mut creds: HashMap<u64, Option<PeerCred>> = HashMap::new();
    for (ino, i) in &by_ino {
        if waiting.contains_key(ino) {
            creds.insert(*ino, cred_of(first_holder(tree.files[*i].id).0));
        }
    }
    for f in tree.files.iter_mut() {
        if let FileKind::Socket(s) = &mut f.kind {
            if let SockState::Listening { pending, .. } = &mut s.state {
                for c in pending.iter_mut() {
                    c.cred = creds.get(&c.client_ino).cloned().flatten();
                }
            }
        }
    }
    // Listeners whose waiting connections already carry data, or whose clients are gone.
    let mut to_accept = Vec::new();
    for (i, f) in tree.files.iter().enumerate() {
        let FileKind::Socket(s) = &f.kind else {
            continue;
        };
        if s.family != SockFamily::Unix {
            continue;
        }
        let SockState::Listening { pending, .. } = &s.state else {
            continue;
        };
        let mut needed = false;
        for c in pending {
            if c.client_ino == 0 {
                needed = true;
                continue;
            }
            let sent = sk::unix_diag(Some(c.client_ino as u32), sk::UDIAG_SHOW_RQLEN)
                .ok()
                .and_then(|v| v.into_iter().next())
                .and_then(|d| d.rqlen)
                .map(|r| r.1)
                .unwrap_or(0);
            needed |= sent > 0;
        }
        if needed {
            to_accept.push(i);
        }
    }
    for i in to_accept {
        requeue(frozen, tree, &holders, &by_ino, i)?;
    }
    for i in carrying {
        requeue_tcp(frozen, tree, &holders, i)?;
    }
    Ok(())
}

/// Raises a socket's send buffer so that `bytes` fit at once (its real size is set afterwards).
fn bump_sndbuf(s: RawFd, bytes: usize) {
    if bytes == 0 {
        return;
    }
    let want = (bytes.saturating_mul(2) + (1 << 20)).min(i32::MAX as usize / 4) as i32;
    let now = sk::getsockopt_int(s, SOL_SOCKET, libc::SO_SNDBUF).unwrap_or(0);
    if now < want * 2 {
        let _ = sk::setsockopt_int(s, SOL_SOCKET, libc::SO_SNDBUFFORCE, want);
    }
}

fn apply_shutdown(s: RawFd, sh: &Shutdown) {
    if sh.write {
        let _ = sk::shutdown(s, libc::SHUT_WR);
    }
    if sh.read {
        let _ = sk::shutdown(s, libc::SHUT_RD);
    }
}

// ---------------------------------------------------------------------------------------------
// Restore
// ---------------------------------------------------------------------------------------------

thread_local! {
    /// Sockets made for the tree being restored, by file id, until each is asked for.
    static MADE: RefCell<HashMap<u32, OwnedFd>> = RefCell::new(HashMap::new());
    /// The relay's ends of relayed sockets (`SocketDesc::relayed`), by relay id.
    static RELAYED: RefCell<Vec<(u32, OwnedFd)>> = const { RefCell::new(Vec::new()) };
    /// What the last build of the sockets left for [`Deferred::complete`].
    static DEFERRED: RefCell<Deferred> = RefCell::new(Deferred::default());
}

/// What the rebuild of the sockets had to leave until the tree is about to run, because
/// another socket held the address: the tree's original, which a migration between two nodes
/// of one machine (they share its network stack) keeps frozen until the commit point, after
/// the rebuild; or a running original beside a clone (`ferry restore --pid-namespace` of an
/// image taken with `--leave-running`). [`Deferred::complete`] does it, waiting a little for
/// the address to be freed; `RestoredTree::resume` calls it before letting any thread go.
#[derive(Default)]
pub struct Deferred {
    /// TCP listeners, bound (forced, see `ferry_sys::sockets::bind_forced`) but not listening:
    /// listen() checks the address again, and a listener cannot leave repair mode.
    listens: Vec<DeferredListen>,
    /// UDP sockets that could not be bound (UDP has no repair mode, and sharing the port with
    /// SO_REUSEADDR or SO_REUSEPORT would need the original's consent and split its traffic),
    /// with the peer each is to be connected to once bound (connecting first would bind it
    /// to another port).
    binds: Vec<DeferredBind>,
    /// Datagrams for the UDP sockets' queues, sent once every UDP socket of the tree has its
    /// address (the senders among them included).
    datagrams: Vec<DeferredDatagram>,
    /// Established TCP connections: sockets in repair mode, made (bound, connected, refilled)
    /// only here, once the original's sockets are gone (see `Builder::tcp_conn`); they leave
    /// repair mode once every connection is made (leaving it sends a window probe to the other
    /// end, which would draw a reset from a port with no socket), and then send what had never
    /// been sent.
    repairs: Vec<DeferredRepair>,
    /// UNIX sockets named (and listening, with their waiting connections made) only here: see
    /// [`DeferredName`].
    names: Vec<DeferredName>,
    /// TCP clients whose connection waited in a listener's queue: connected afresh, once the
    /// tree's listeners listen (see [`DeferredHandshake`]).
    handshakes: Vec<DeferredHandshake>,
    /// UDP sockets shut down, once bound and their datagrams sent.
    shutdowns: Vec<(OwnedFd, Shutdown)>,
    /// Echo replies for ping sockets, once they have their identifiers.
    pings: Vec<ping::DeferredPings>,
}

impl Deferred {
    /// The work left by the sockets just rebuilt on this thread (nothing if none was).
    pub fn take() -> Deferred {
        DEFERRED.with(|d| std::mem::take(&mut *d.borrow_mut()))
    }

    pub fn is_empty(&self) -> bool {
        self.listens.is_empty()
            && self.binds.is_empty()
            && self.datagrams.is_empty()
            && self.repairs.is_empty()
            && self.names.is_empty()
            && self.handshakes.is_empty()
            && self.shutdowns.is_empty()
            && self.pings.is_empty()
    }

    /// Binds and connects the UDP sockets, makes the TCP listeners listen, makes the TCP
    /// connections, names the UNIX sockets whose abstract names were taken, and queues the
    /// datagrams, retrying while an address is still in use, until `wait` has passed.
    /// `pid`: the process named in errors; `hosts`: the tree's PIDs -> ours, for the calls
    /// made inside its processes.
    pub fn complete(
        self,
        pid: i32,
        wait: std::time::Duration,
        hosts: &HashMap<i32, i32>,
    ) -> Result<()> {
        let deadline = std::time::Instant::now() + wait;
        for n in &self.names {
            n.make(hosts, deadline, wait)?;
        }
        let retry = move |op: &dyn Fn() -> ferry_sys::SysResult<()>| loop {
            match op() {
                Err(e)
                    if (e.errno == libc::EADDRINUSE || e.errno == libc::EADDRNOTAVAIL)
                        && std::time::Instant::now() < deadline =>
                {
                    std::thread::sleep(std::time::Duration::from_millis(10))
                }
                r => return r,
            }
        };
        let err = |what: &str, e: ferry_sys::SysError| Error::Restore {
            pid,
            what: if e.errno == libc::EADDRINUSE || e.errno == libc::EADDRNOTAVAIL {
                format!(
                    "{what}: {e}: another socket still holds the address after {wait:?} (the \
                     original of the tree, if it still runs?)"
                )
            } else {
                format!("{what}: {e}")
            },
        };
        for b in &self.binds {
            let fd = b.fd.as_raw_fd();
            retry(&|| sk::bind(fd, &b.local)).map_err(|e| err(&b.what, e))?;
            if let Some(peer) = &b.peer {
                sk::connect(fd, peer).map_err(|e| err(&format!("{}: connect", b.what), e))?;
            }
        }
        for l in &self.listens {
            let fd = l.fd.as_raw_fd();
            retry(&|| sk::listen(fd, l.backlog)).map_err(|e| err(&l.what, e))?;
        }
        let mut handshakes: Vec<&DeferredHandshake> = self.handshakes.iter().collect();
        handshakes.sort_by_key(|h| h.order);
        for h in handshakes {
            h.make(&retry, deadline)
                .map_err(|(step, e)| err(&format!("{}: {step}", h.what), e))?;
        }
        // The connections, once the tree's listeners have their ports (a socket bound to the
        // port, even in repair mode, would keep a listener without SO_REUSEADDR from it).
        for r in &self.repairs {
            r.make(&retry)
                .map_err(|(step, e)| err(&format!("{}: {step}", r.what), e))?;
        }
        for d in &self.datagrams {
            sk::send(
                d.from.as_raw_fd(),
                &d.data,
                Some(&d.to),
                &[],
                libc::MSG_DONTWAIT,
            )
            .map_err(|e| {
                err(
                    &format!("{}: queue {} bytes again", d.what, d.data.len()),
                    e,
                )
            })?;
        }
        for p in &self.pings {
            p.deliver().map_err(|e| Error::Restore {
                pid,
                what: format!("{}: {e}", p.what),
            })?;
        }
        for (fd, sh) in &self.shutdowns {
            apply_shutdown(fd.as_raw_fd(), sh);
        }
        for r in &self.repairs {
            let fd = r.fd.as_raw_fd();
            sk::tcp_repair(fd, sk::TCP_REPAIR_OFF)
                .map_err(|e| err(&format!("{}: leave repair mode", r.what), e))?;
            sk::setsockopt_int(fd, SOL_SOCKET, libc::SO_REUSEADDR, r.reuseaddr)
                .map_err(|e| err(&format!("{}: set SO_REUSEADDR back", r.what), e))?;
        }
        for r in &self.repairs {
            let unsent = &r.conn.send_queue[r.sent..];
            if unsent.is_empty() {
                continue;
            }
            let fd = r.fd.as_raw_fd();
            bump_sndbuf(fd, unsent.len());
            let mut at = 0;
            while at < unsent.len() {
                let n =
                    sk::send(fd, &unsent[at..], None, &[], libc::MSG_DONTWAIT).map_err(|e| {
                        err(
                            &format!("{}: send the {} bytes never sent", r.what, unsent.len()),
                            e,
                        )
                    })?;
                at += n.max(1);
            }
            if let Some(b) = r.sndbuf {
                let _ = sk::setsockopt_int(fd, SOL_SOCKET, libc::SO_SNDBUFFORCE, b / 2);
            }
        }
        replay_shutdowns(&self.repairs, deadline, &err)
    }
}

/// Recreates the open file description `d` in this (the restoring) process. All the sockets of
/// the tree are made together, when the first one is asked for.
///
/// `guest`: a pidfd of the init of the guest namespaces the tree is rebuilt in, if it is.
/// `others`: every description of the tree that is not a socket, already open (descriptors in
/// flight in the sockets' queues are sent again from these).
pub fn open(
    d: &FileDesc,
    tree: &Tree,
    guest: Option<std::os::fd::BorrowedFd<'_>>,
    others: &HashMap<u32, OwnedFd>,
) -> Result<OwnedFd> {
    let first = tree
        .files
        .iter()
        .find(|f| matches!(f.kind, FileKind::Socket(_)))
        .map(|f| f.id);
    if first == Some(d.id) {
        MADE.with(|m| m.borrow_mut().clear());
        drop(Deferred::take());
        let (made, deferred) = Builder::new(tree, guest.map(|g| g.as_raw_fd()), others).build()?;
        MADE.with(|m| *m.borrow_mut() = made);
        DEFERRED.with(|d| *d.borrow_mut() = deferred);
    }
    MADE.with(|m| m.borrow_mut().remove(&d.id))
        .ok_or_else(|| Error::BadImage(format!("file {}: socket was not rebuilt", d.id)))
}

/// A TCP connection over this network namespace's loopback (IPv6's for an IPv6 socket, where
/// it has one): the connecting end, then the accepted one. A relayed TCP socket is the first:
/// a TCP socket of its family, whose options are TCP's, only its addresses are this node's.
/// Where the loopback cannot carry it, an unnamed UNIX stream pair.
fn loopback_pair(family: SockFamily) -> std::io::Result<(OwnedFd, OwnedFd)> {
    use std::net::{Ipv4Addr, Ipv6Addr, TcpListener, TcpStream};
    let tcp = |addr: std::net::IpAddr| -> std::io::Result<(OwnedFd, OwnedFd)> {
        let l = TcpListener::bind((addr, 0))?;
        let c = TcpStream::connect(l.local_addr()?)?;
        let (a, _) = l.accept()?;
        Ok((OwnedFd::from(c), OwnedFd::from(a)))
    };
    let v6 = (family == SockFamily::Inet6)
        .then(|| tcp(Ipv6Addr::LOCALHOST.into()).ok())
        .flatten();
    match v6 {
        Some(p) => Ok(p),
        None => tcp(Ipv4Addr::LOCALHOST.into()).or_else(|_| {
            sk::socketpair(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC)
                .map_err(|e| std::io::Error::from_raw_os_error(e.errno))
        }),
    }
}

/// The relay's ends of the relayed sockets the last rebuild made (and forgets them).
pub fn take_relayed() -> Vec<(u32, OwnedFd)> {
    RELAYED.with(|r| std::mem::take(&mut *r.borrow_mut()))
}

/// Completes state that refers to the process's descriptor numbers, once all are installed.
pub fn after_install(_h: &Husk, _p: &Process) -> Result<()> {
    Ok(())
}

fn sock_type_raw(t: SockType) -> i32 {
    match t {
        SockType::Stream => libc::SOCK_STREAM,
        SockType::Dgram => libc::SOCK_DGRAM,
        SockType::Seqpacket => libc::SOCK_SEQPACKET,
        SockType::Raw => libc::SOCK_RAW,
    }
}

/// Every socket is made non-blocking (the file's flags are set afterwards) and close-on-exec.
const NEW: i32 = libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC;

/// One end of a connection to make: a socket of the tree, or a stand-in for a closed peer of
/// socket `owner` that had name `name`.
#[derive(Clone)]
enum End {
    Real(usize),
    Phantom {
        owner: usize,
        name: Option<SockAddr>,
    },
}

struct Builder<'a> {
    me: i32,
    /// (file id, socket) of every socket of the tree.
    socks: Vec<(u32, &'a SocketDesc)>,
    by_ino: HashMap<u64, usize>,
    fds: Vec<Option<OwnedFd>>,
    /// Sockets already bound to their names.
    bound: HashSet<usize>,
    /// What each socket was connected to when it was made (a pair, a stand-in, a listener).
    made_peer: HashMap<usize, Option<usize>>,
    /// Stand-ins for closed peers: (the socket they are connected to, the stand-in).
    phantoms: Vec<(usize, OwnedFd)>,
    /// Socket files to remove once every connection to them is made, and with whose rights.
    remove_later: Vec<(PathBuf, FsCreds)>,
    /// The file-system rights each socket's files are made and removed with (file id -> the
    /// first live process holding it); `tree_creds` for sockets no process holds.
    creds: HashMap<u32, FsCreds>,
    tree_creds: FsCreds,
    /// A pidfd of the guest init when the tree is rebuilt in guest namespaces: sockets are then
    /// made by helpers in the guest PID namespace, under the tree's PIDs.
    guest: Option<RawFd>,
    /// What must wait until the tree is about to run.
    deferred: Deferred,
    /// Who holds each description (file id): (the tree's PID, its fd), live processes only.
    holders: HashMap<u32, Vec<(i32, i32)>>,
    /// UNIX sockets whose abstract name another socket holds (the frozen original of a
    /// migration on one machine): named, and made to listen, at resume (see [`DeferredName`]).
    late_names: HashSet<usize>,
    /// The tree's other descriptions, open: sent again where they were in flight.
    others: &'a HashMap<u32, OwnedFd>,
}

impl<'a> Builder<'a> {
    fn new(tree: &'a Tree, guest: Option<RawFd>, others: &'a HashMap<u32, OwnedFd>) -> Self {
        let mut holders: HashMap<u32, Vec<(i32, i32)>> = HashMap::new();
        for p in tree.processes.iter().filter(|p| p.zombie_status.is_none()) {
            for f in &p.fds {
                holders.entry(f.file).or_default().push((p.pid, f.fd));
            }
        }
        let socks: Vec<(u32, &SocketDesc)> = tree
            .files
            .iter()
            .filter_map(|f| match &f.kind {
                FileKind::Socket(s) => Some((f.id, s)),
                _ => None,
            })
            .collect();
        let by_ino = socks
            .iter()
            .enumerate()
            .filter(|(_, (_, s))| s.family == SockFamily::Unix)
            .map(|(i, (_, s))| (s.ino, i))
            .collect();
        let n = socks.len();
        // A socket's files are the business of the process holding it: made, changed and
        // removed with its rights, never root's (see crate::reopen).
        let mut creds = HashMap::new();
        for p in tree.processes.iter().filter(|p| p.zombie_status.is_none()) {
            for f in &p.fds {
                creds
                    .entry(f.file)
                    .or_insert_with(|| crate::reopen::creds_of(p));
            }
        }
        let tree_creds = tree
            .processes
            .first()
            .map(crate::reopen::creds_of)
            .unwrap_or_default();
        Builder {
            me: std::process::id() as i32,
            socks,
            by_ino,
            fds: (0..n).map(|_| None).collect(),
            bound: HashSet::new(),
            made_peer: HashMap::new(),
            phantoms: Vec::new(),
            remove_later: Vec::new(),
            creds,
            tree_creds,
            guest,
            deferred: Deferred::default(),
            holders,
            late_names: HashSet::new(),
            others,
        }
    }

    fn build(mut self) -> Result<(HashMap<u32, OwnedFd>, Deferred)> {
        let r = self.build_steps();
        self.remove_now();
        r?;
        let mut out = HashMap::new();
        for (i, fd) in self.fds.into_iter().enumerate() {
            let (id, s) = self.socks[i];
            let fd = fd.ok_or_else(|| Error::Restore {
                pid: self.me,
                what: format!("socket of file {id} (socket:[{}]) was not rebuilt", s.ino),
            })?;
            out.insert(id, fd);
        }
        Ok((out, self.deferred))
    }

    /// Removes the socket files that were to go, each with its socket's rights.
    fn remove_now(&mut self) {
        for (p, c) in std::mem::take(&mut self.remove_later) {
            let _ = with_fs_creds(&c, || std::fs::remove_file(p));
        }
    }

    /// The rights socket `i`'s files are handled with.
    pub(super) fn creds(&self, i: usize) -> FsCreds {
        self.creds
            .get(&self.socks[i].0)
            .cloned()
            .unwrap_or_else(|| self.tree_creds.clone())
    }

    fn build_steps(&mut self) -> Result<()> {
        self.pairs()?;
        self.create_rest()?;
        self.bind_and_listen()?;
        self.connect_dgrams()?;
        self.remove_now();
        self.fill_queues()?;
        self.finish()?;
        self.attach_filters()
    }

    fn sock(&self, i: usize) -> &'a SocketDesc {
        self.socks[i].1
    }

    fn err(&self, i: usize, what: impl std::fmt::Display) -> Error {
        let (id, s) = self.socks[i];
        // Named by the first process holding it, and its descriptor.
        let (pid, fd) = match self.holders.get(&id).and_then(|h| h.first()) {
            Some((pid, fd)) => (*pid, format!("fd {fd}: ")),
            None => (self.me, String::new()),
        };
        Error::Restore {
            pid,
            what: format!("{fd}socket of file {id} (socket:[{}]): {what}", s.ino),
        }
    }

    fn fd(&self, i: usize) -> RawFd {
        self.fds[i].as_ref().map(|f| f.as_raw_fd()).unwrap_or(-1)
    }

    /// A copy of the descriptor of socket `i`, kept until [`Deferred::complete`].
    fn dup(&self, i: usize) -> Result<OwnedFd> {
        self.fds[i]
            .as_ref()
            .ok_or_else(|| self.err(i, "not made yet"))?
            .try_clone()
            .map_err(|e| self.err(i, format!("dup: {e}")))
    }

    /// The socket of the tree that socket `i` is connected to.
    fn peer_of(&self, i: usize) -> Option<usize> {
        match self.sock(i).state {
            SockState::Connected { peer_ino } if peer_ino != 0 => {
                self.by_ino.get(&peer_ino).copied()
            }
            _ => None,
        }
    }

    fn phantom_of(&self, i: usize) -> Option<RawFd> {
        self.phantoms
            .iter()
            .find(|(o, _)| *o == i)
            .map(|(_, f)| f.as_raw_fd())
    }

    /// Runs helper operations as `cred` (under its PID when that is free), or here.
    fn as_cred(&self, cred: Option<&PeerCred>, ops: &[HelperOp]) -> Vec<sk::HelperResult> {
        if let Some(c) = cred {
            let hc = HelperCred {
                uid: c.uid,
                gid: c.gid,
                groups: c.groups.clone(),
            };
            // The helper is made where the tree's PIDs mean what the credentials say.
            let as_pid = match (self.guest, c.pid > 0) {
                (_, false) => Ok(None),
                (None, true) => sk::run_as(Some(c.pid), Some(&hc), ops),
                (Some(g), true) => ferry_sys::ns::with_children_in_pid_ns_of(g, || {
                    sk::run_as(Some(c.pid), Some(&hc), ops)
                })
                .and_then(|r| r),
            };
            match as_pid {
                Ok(Some(r)) => return r,
                Ok(None) => {
                    log::debug!(
                        "PID {} is taken (or not ours): its sockets are made under another",
                        c.pid
                    )
                }
                Err(e) => log::warn!("socket helper as PID {}: {e}", c.pid),
            }
            match sk::run_as(None, Some(&hc), ops) {
                Ok(Some(r)) => return r,
                Ok(None) => {}
                Err(e) => log::warn!("socket helper as UID {}: {e}", c.uid),
            }
        }
        let res = |r: ferry_sys::SysResult<()>| sk::HelperResult {
            errno: r.err().map(|e| e.errno).unwrap_or(0),
            fds: None,
        };
        ops.iter()
            .map(|op| match *op {
                HelperOp::SocketPair { ty } => match sk::socketpair(libc::AF_UNIX, ty) {
                    Ok(p) => sk::HelperResult {
                        errno: 0,
                        fds: Some(p),
                    },
                    Err(e) => sk::HelperResult {
                        errno: e.errno,
                        fds: None,
                    },
                },
                HelperOp::Listen { fd, backlog } => res(sk::listen(fd, backlog)),
                HelperOp::Connect { fd, addr } => res(sk::connect(fd, addr)),
                HelperOp::Bind { fd, addr } => res(sk::bind(fd, addr)),
                HelperOp::Chdir { .. } => sk::HelperResult {
                    errno: libc::ENOSYS,
                    fds: None,
                },
            })
            .collect()
    }

    fn check(&self, i: usize, what: &str, r: &sk::HelperResult) -> Result<()> {
        if r.errno != 0 {
            return Err(self.err(
                i,
                format!("{what}: {}", std::io::Error::from_raw_os_error(r.errno)),
            ));
        }
        Ok(())
    }

    /// Every socket not made as part of a pair; TCP and UDP ones completely. Established TCP
    /// connections come last, so that the tree's listeners have their ports first.
    fn create_rest(&mut self) -> Result<()> {
        for i in 0..self.socks.len() {
            if self.fds[i].is_some() || self.sock(i).tcp.is_some() {
                continue;
            }
            let s = self.sock(i);
            if s.relayed && s.family != SockFamily::Unix {
                // A TCP connection relayed from home: this end of a connection over this
                // node's loopback, the other the relay's (which carries it to the home's socket).
                let (mine, relay) = loopback_pair(s.family)
                    .map_err(|e| self.err(i, format!("a connection for its relay: {e}")))?;
                apply_opts(mine.as_raw_fd(), &s.opts, false);
                self.fds[i] = Some(mine);
                let id = ferry_image::RELAY_SOCKET | self.socks[i].0;
                RELAYED.with(|r| r.borrow_mut().push((id, relay)));
                continue;
            }
            let domain = match s.family {
                SockFamily::Unix => libc::AF_UNIX,
                SockFamily::Inet => libc::AF_INET,
                SockFamily::Inet6 => libc::AF_INET6,
                SockFamily::Netlink => libc::AF_NETLINK,
                SockFamily::Packet => libc::AF_PACKET,
            };
            let fd =
                sk::socket(domain, sock_type_raw(s.sock_type) | NEW, s.protocol).map_err(|e| {
                    match ping::is_ping(s.family, s.sock_type, s.protocol) {
                        true if e.errno == libc::EACCES => self.err(
                            i,
                            format!(
                            "make an ICMP echo (ping) socket: {e}: the restorer's group is not \
                             in net.ipv4.ping_group_range here"
                        ),
                        ),
                        _ => self.err(i, format!("socket: {e}")),
                    }
                })?;
            self.fds[i] = Some(fd);
            match s.family {
                SockFamily::Unix => {}
                SockFamily::Netlink => self.netlink(i)?,
                SockFamily::Packet => self.packet(i)?,
                SockFamily::Inet | SockFamily::Inet6 => self.inet(i)?,
            }
        }
        for i in 0..self.socks.len() {
            if self.fds[i].is_none() && self.sock(i).tcp.is_some() {
                self.tcp_conn(i)?;
            }
        }
        Ok(())
    }

    /// Puts every queued message back, each sent by a socket that could have sent it.
    fn fill_queues(&mut self) -> Result<()> {
        let mut unbound_udp: HashMap<i32, OwnedFd> = HashMap::new();
        for r in 0..self.socks.len() {
            let s = self.sock(r);
            if s.queue.is_empty() {
                continue;
            }
            let total: usize = s.queue.iter().map(|m| m.data.len()).sum();
            // A connected UNIX socket only hears from its peer (or the peer's stand-in).
            let peer = self
                .peer_of(r)
                .map(|j| (j, self.fd(j)))
                .map(|(j, f)| (Some(j), f))
                .or_else(|| self.phantom_of(r).map(|f| (None, f)));
            match (s.family, s.sock_type) {
                (SockFamily::Unix, SockType::Stream | SockType::Seqpacket) => {
                    let (_, p) =
                        peer.ok_or_else(|| self.err(r, "data is queued but nothing can send it"))?;
                    bump_sndbuf(p, total);
                    for m in &s.queue {
                        let seq = s.sock_type == SockType::Seqpacket;
                        self.send_one(r, p, m, None, seq)?;
                    }
                }
                (SockFamily::Unix, _) => {
                    let to = self.reachable(r);
                    if let Some((j, p)) = peer {
                        let mutual = match j {
                            Some(j) => {
                                self.made_peer.get(&j).copied().flatten() == Some(r)
                                    || self.peer_of(j) == Some(r)
                            }
                            None => true,
                        };
                        let dest = if mutual { None } else { to.as_deref() };
                        bump_sndbuf(p, total);
                        for m in &s.queue {
                            self.send_one(r, p, m, dest, true)?;
                        }
                        continue;
                    }
                    let to = to.ok_or_else(|| {
                        self.err(r, "datagrams are queued on an unnamed, unconnected socket")
                    })?;
                    for m in &s.queue {
                        match self.unix_sender(m.from.as_ref()) {
                            Some(j) => {
                                let f = self.fd(j);
                                bump_sndbuf(f, m.data.len());
                                self.send_one(r, f, m, Some(&to), true)?;
                            }
                            None => {
                                let t = self.temp_sender(r, m.from.as_ref())?;
                                bump_sndbuf(t.as_raw_fd(), m.data.len());
                                self.send_one(r, t.as_raw_fd(), m, Some(&to), true)?;
                            }
                        }
                    }
                }
                (f, SockType::Dgram) if ping::is_ping(f, SockType::Dgram, s.protocol) => {
                    self.requeue_ping_replies(r)?;
                }
                (_, SockType::Dgram) => {
                    let to =
                        s.local.as_ref().map(loopback_if_any).ok_or_else(|| {
                            self.err(r, "datagrams are queued on an unbound socket")
                        })?;
                    let raw_to = encode_addr(&to);
                    if !self.deferred.binds.is_empty() {
                        // Some UDP socket of the tree (the receiver, or a sender) gets its
                        // address only when the tree is about to run: so do all the datagrams.
                        self.defer_datagrams(r, &raw_to)?;
                        continue;
                    }
                    for m in &s.queue {
                        if let Some(j) = m.from.as_ref().and_then(|f| self.inet_sender(f)) {
                            let f = self.fd(j);
                            self.send_one(r, f, m, Some(&raw_to), true)?;
                        } else if let Some(t) = m.from.as_ref().and_then(|f| self.inet_temp(r, f)) {
                            self.send_one(r, t.as_raw_fd(), m, Some(&raw_to), true)?;
                        } else {
                            let d = match s.family {
                                SockFamily::Inet6 => libc::AF_INET6,
                                _ => libc::AF_INET,
                            };
                            if let std::collections::hash_map::Entry::Vacant(e) =
                                unbound_udp.entry(d)
                            {
                                e.insert(
                                    sk::socket(d, libc::SOCK_DGRAM | NEW, 0)
                                        .map_err(|e| self.err(r, e))?,
                                );
                            }
                            let f = unbound_udp[&d].as_raw_fd();
                            self.send_one(r, f, m, Some(&raw_to), true)?;
                        }
                    }
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Sends message `m` of socket `r`'s queue again from `from`, with the descriptors that
    /// were in flight with it.
    fn send_one(
        &self,
        r: usize,
        from: RawFd,
        m: &SockMsg,
        to: Option<&[u8]>,
        record: bool,
    ) -> Result<()> {
        let rights = self.rights_of(r, m)?;
        if !record && !rights.is_empty() && m.data.len() > 1 {
            // A stream: the descriptors go with the last byte of the bytes recorded with them
            // (see `Cap::peek_stream`), so that a read ending before it does not take them.
            let (head, last) = m.data.split_at(m.data.len() - 1);
            let head = SockMsg {
                data: head.to_vec(),
                ..Default::default()
            };
            self.send_one(r, from, &head, to, false)?;
            let last = SockMsg {
                data: last.to_vec(),
                from: None,
                rights: m.rights.clone(),
            };
            return self.send_one(r, from, &last, to, true);
        }
        let data = &m.data;
        let mut at = 0;
        loop {
            let fds = if at == 0 { &rights[..] } else { &[] };
            let n = sk::send(from, &data[at..], to, fds, libc::MSG_DONTWAIT).map_err(|e| {
                self.err(
                    r,
                    format!(
                        "queue {} bytes again (with {} descriptors in flight): {e}",
                        data.len(),
                        fds.len()
                    ),
                )
            })?;
            at += n;
            if record || at >= data.len() {
                return Ok(());
            }
        }
    }

    /// Stand-ins for closed peers go; then shutdowns, options and peek offsets.
    fn finish(&mut self) -> Result<()> {
        for (owner, p) in std::mem::take(&mut self.phantoms) {
            let s = self.sock(owner);
            if s.relayed {
                let id = ferry_image::RELAY_SOCKET | self.socks[owner].0;
                RELAYED.with(|r| r.borrow_mut().push((id, p)));
                continue;
            }
            if s.error != 0 && s.sock_type != SockType::Dgram {
                // A peer that closes with unread data resets the connection (ECONNRESET).
                let _ = sk::send(self.fd(owner), &[0], None, &[], libc::MSG_DONTWAIT);
            }
            drop(p);
        }
        for i in 0..self.socks.len() {
            let s = self.sock(i);
            let fd = self.fd(i);
            if s.family == SockFamily::Unix {
                apply_shutdown(fd, &s.shutdown);
                // Buffers may have been raised to refill queues: always set them.
                apply_opts(fd, &s.opts, true);
            } else if matches!(s.sock_type, SockType::Dgram | SockType::Raw)
                && (s.shutdown.read || s.shutdown.write)
            {
                // Once its datagrams are sent (it may be their sender), and it is bound.
                if self.deferred.binds.is_empty() && self.deferred.datagrams.is_empty() {
                    apply_shutdown(fd, &s.shutdown);
                } else {
                    let fd = self.dup(i)?;
                    self.deferred.shutdowns.push((fd, s.shutdown));
                }
            }
            set_peek_off(fd, s);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_round_trip() {
        let long = vec![b'a'; 108];
        for a in [
            SockAddr::UnixUnnamed,
            SockAddr::UnixPath(b"/tmp/x.sock".to_vec()),
            SockAddr::UnixPath(b"rel.sock".to_vec()),
            SockAddr::UnixPath(long),
            SockAddr::UnixAbstract(b"name\0with\0nuls\0".to_vec()),
            SockAddr::UnixAbstract(Vec::new()),
            SockAddr::Inet {
                addr: [127, 0, 0, 1],
                port: 8080,
            },
            SockAddr::Inet6 {
                addr: std::net::Ipv6Addr::LOCALHOST.octets(),
                port: 443,
                flowinfo: 7,
                scope_id: 2,
            },
        ] {
            let raw = encode_addr(&a);
            assert!(raw.len() <= sk::ADDR_MAX);
            assert_eq!(decode_addr(&raw), Some(a));
        }
    }

    #[test]
    fn addresses_match_the_kernel_layout() {
        let raw = encode_addr(&SockAddr::Inet {
            addr: [10, 1, 2, 3],
            port: 0x1234,
        });
        assert_eq!(raw.len(), std::mem::size_of::<libc::sockaddr_in>());
        assert_eq!(&raw[2..8], &[0x12, 0x34, 10, 1, 2, 3]);
        let raw = encode_addr(&SockAddr::Inet6 {
            addr: [0; 16],
            port: 1,
            flowinfo: 0,
            scope_id: 0,
        });
        assert_eq!(raw.len(), std::mem::size_of::<libc::sockaddr_in6>());
        assert_eq!(
            encode_addr(&SockAddr::UnixAbstract(b"ab".to_vec())).len(),
            5
        );
        assert_eq!(encode_addr(&SockAddr::UnixPath(b"/a".to_vec())).len(), 5);
    }

    #[test]
    fn device_numbers_compare_across_encodings() {
        // major 8, minor 17: the kernel's MKDEV and the stat(2) encoding.
        let kernel = (8u32 << 20) | 17;
        let user = libc::makedev(8, 17);
        assert!(same_dev(kernel, user));
        assert!(!same_dev(kernel, libc::makedev(8, 18)));
        let kernel = (259u32 << 20) | 300;
        assert!(same_dev(kernel, libc::makedev(259, 300)));
    }
}
