//! Descriptors backed by sockets: UNIX (stream, datagram, seqpacket; pairs and named; listening
//! with the connections waiting in their queues, and connected, with queued data), TCP
//! listening and unconnected sockets, established TCP connections whose both ends are in the
//! tree, and UDP sockets.
//!
//! An established TCP connection is read in TCP repair mode (tcp(7)): its sequence numbers,
//! both queues (peeked), the options negotiated and the window; repair mode is taken off again
//! at once, so a tree that is let go keeps working connections. Just before a captured tree is
//! killed its connections are put back in repair mode ([`silence_tcp_connections`]), so they
//! close without a word to the other end. Restore makes each socket in repair mode, and binds it
//! (whoever holds the port: repair mode forces it), connects it (without a handshake) and
//! refills its queues only when the tree is about to run, when the original's sockets are gone;
//! then both ends leave repair mode ([`Deferred`]).
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

use crate::error::{Context, Error, Result};
use crate::freeze::FrozenTree;
use crate::husk::Husk;
use crate::procfs;
use ferry_image::{
    FileDesc, FileKind, PeerCred, PendingConn, Process, Shutdown, SockAddr, SockFamily, SockMsg,
    SockOpt, SockState, SockType, SocketDesc, SocketFile, TcpConn, TcpWindow, Tree,
};
use ferry_sys::sockets::{self as sk, HelperCred, HelperOp};
use ferry_sys::{fdops, pidfd};
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

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

fn tcp_state_name(s: u8) -> &'static str {
    match s {
        1 => "ESTABLISHED",
        2 => "SYN_SENT",
        3 => "SYN_RECV",
        4 => "FIN_WAIT1",
        5 => "FIN_WAIT2",
        6 => "TIME_WAIT",
        8 => "CLOSE_WAIT",
        9 => "LAST_ACK",
        11 => "CLOSING",
        _ => "unknown",
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

/// SO_PEERCRED and SO_PEERGROUPS of a UNIX socket, when it has them.
fn peer_cred(s: RawFd) -> Option<PeerCred> {
    let b = sk::getsockopt(s, SOL_SOCKET, libc::SO_PEERCRED, 12).ok()?;
    if b.len() < 12 {
        return None;
    }
    let word = |at: usize| u32::from_ne_bytes(b[at..at + 4].try_into().expect("4 bytes"));
    let pid = word(0) as i32;
    if pid <= 0 {
        return None;
    }
    let groups = sk::getsockopt(s, SOL_SOCKET, libc::SO_PEERGROUPS, 1 << 16)
        .map(|g| {
            g.chunks_exact(4)
                .map(|c| u32::from_ne_bytes(c.try_into().expect("4 bytes")))
                .collect()
        })
        .unwrap_or_default();
    Some(PeerCred {
        pid,
        uid: word(4),
        gid: word(8),
        groups,
    })
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

    /// The file a UNIX socket bound to `path` made, looked up as the process sees the path.
    fn socket_file(&self, path: &[u8], vfs: Option<(u32, u32)>) -> Result<SocketFile> {
        let rel = path.first() != Some(&b'/');
        let (dir, full) = if rel {
            let cwd = procfs::readlink(self.pid, "cwd")?;
            let full =
                PathBuf::from(format!("/proc/{}/cwd", self.pid)).join(OsStr::from_bytes(path));
            (Some(cwd), full)
        } else {
            let full = PathBuf::from(format!("/proc/{}/root", self.pid))
                .join(OsStr::from_bytes(&path[1..]));
            (None, full)
        };
        let md = std::fs::metadata(&full).ok().filter(|m| {
            m.file_type().is_socket()
                && vfs.is_some_and(|(ino, dev)| m.ino() as u32 == ino && same_dev(dev, m.dev()))
        });
        Ok(match md {
            Some(m) => SocketFile {
                dir,
                deleted: false,
                mode: m.mode() & 0o7777,
                uid: m.uid(),
                gid: m.gid(),
            },
            None => SocketFile {
                dir,
                deleted: true,
                mode: 0o755,
                uid: 0,
                gid: 0,
            },
        })
    }

    fn unix(&self, ty: SockType) -> Result<SocketDesc> {
        let d = sk::unix_diag(Some(self.ino as u32), sk::UDIAG_SHOW_ALL)
            .ctx(self.pid, || self.what("ask sock_diag about the state"))?
            .into_iter()
            .next()
            .ok_or_else(|| {
                self.refuse("sock_diag does not know this UNIX socket (another network namespace?)")
            })?;
        let mut desc = SocketDesc {
            ino: self.ino,
            family: SockFamily::Unix,
            sock_type: ty,
            local: self.name(false)?,
            shutdown: Shutdown {
                read: d.shutdown & RCV_SHUTDOWN != 0,
                write: d.shutdown & SEND_SHUTDOWN != 0,
            },
            peer_cred: peer_cred(self.s),
            opts: capture_opts(self.s, &[UNIX_OPTS]),
            ..Default::default()
        };
        if let Some(SockAddr::UnixPath(p)) = &desc.local {
            desc.path_file = Some(self.socket_file(p, d.vfs)?);
        }
        if d.state == TCP_LISTEN {
            desc.state = SockState::Listening {
                backlog: d.rqlen.map(|r| r.1).unwrap_or(0),
                pending: d
                    .icons
                    .iter()
                    .map(|&c| PendingConn {
                        client_ino: u64::from(c),
                        ..Default::default()
                    })
                    .collect(),
            };
            return Ok(desc);
        }
        if let Some(peer) = d.peer {
            desc.state = SockState::Connected {
                peer_ino: u64::from(peer),
            };
            desc.peer = self.name(true)?;
        }
        let queued = d.rqlen.map(|r| r.0).unwrap_or(0) as usize;
        let ev = sk::poll_now(self.s, libc::POLLIN).ctx(self.pid, || self.what("poll"))?;
        if ev & libc::POLLERR != 0 {
            // The pending error would be consumed by reading; for stream sockets it is the
            // peer's reset, which the queue can be read around.
            if ty != SockType::Stream && queued > 0 {
                return Err(self.refuse(
                    "it has a pending error (its peer was reset), which reading its queued \
                     messages would clear",
                ));
            }
            desc.error = libc::ECONNRESET;
        }
        desc.queue = match ty {
            SockType::Stream if queued > 0 => self.peek_stream(queued)?,
            SockType::Stream => Vec::new(),
            SockType::Seqpacket if queued == 0 => Vec::new(),
            _ if ev & libc::POLLIN == 0 => Vec::new(),
            _ => self.peek_messages(
                if ty == SockType::Seqpacket {
                    Some(queued)
                } else {
                    None
                },
                desc.shutdown.read,
                ty == SockType::Dgram,
            )?,
        };
        Ok(desc)
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

    fn no_rights(&self, m: &sk::Received) -> Result<()> {
        if !m.rights.is_empty() {
            return Err(self.refuse(format!(
                "{} file descriptor(s) are in flight in its receive queue (SCM_RIGHTS), which \
                 cannot be checkpointed yet",
                m.rights.len()
            )));
        }
        Ok(())
    }

    /// Peeks the `total` bytes queued in a stream socket.
    fn peek_stream(&self, total: usize) -> Result<Vec<SockMsg>> {
        self.with_peek_off(|| {
            let mut out = Vec::new();
            let mut got = 0;
            while got < total {
                let m = match sk::recv(
                    self.s,
                    (total - got).min(PEEK_CHUNK),
                    libc::MSG_PEEK | libc::MSG_DONTWAIT,
                ) {
                    Ok(m) => m,
                    Err(e) if e.errno == libc::EAGAIN => break,
                    Err(e) => return Err(e).ctx(self.pid, || self.what("peek the queued data")),
                };
                self.no_rights(&m)?;
                if m.data.is_empty() {
                    break;
                }
                got += m.data.len();
                out.push(SockMsg {
                    data: m.data,
                    from: None,
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
                let m = match sk::recv(self.s, size, libc::MSG_PEEK | libc::MSG_DONTWAIT) {
                    Ok(m) => m,
                    Err(e) if e.errno == libc::EAGAIN => break,
                    Err(e) => {
                        return Err(e).ctx(self.pid, || self.what("peek the queued messages"))
                    }
                };
                self.no_rights(&m)?;
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
                off += m.data.len();
                out.push(SockMsg {
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

    /// Reads an established TCP connection in repair mode (sequence numbers, both queues, the
    /// options negotiated, the window), then takes repair mode off again, so the connection
    /// works on if the tree is let go. `info`: its TCP_INFO; `conn`: it, for people.
    fn tcp_conn(&self, info: &[u8], conn: &str) -> Result<(TcpConn, Vec<SockMsg>)> {
        let s = self.s;
        if sk::getsockopt_int(s, IPPROTO_TCP, libc::TCP_REPAIR).unwrap_or(0) != 0 {
            return Err(self.refuse(format!(
                "{conn} is already in TCP repair mode (someone else is checkpointing it?)"
            )));
        }
        let reuse = sk::getsockopt_int(s, SOL_SOCKET, libc::SO_REUSEADDR)
            .ctx(self.pid, || self.what("read SO_REUSEADDR"))?;
        sk::tcp_repair(s, sk::TCP_REPAIR_ON).map_err(|e| {
            self.refuse(format!(
                "{conn} cannot be put in TCP repair mode ({e}); that needs CAP_NET_ADMIN in \
                 the socket's network namespace"
            ))
        })?;
        let r = self.tcp_read_repaired(info, conn);
        // Leaving repair mode clears SO_REUSEADDR (the kernel resets the socket's reuse mode):
        // it is set back as it was. No window probe: the peer must not notice anything.
        let queue = sk::tcp_repair_queue(s, sk::TCP_NO_QUEUE);
        let off = sk::tcp_repair(s, sk::TCP_REPAIR_OFF_NO_WP);
        let back = sk::setsockopt_int(s, SOL_SOCKET, libc::SO_REUSEADDR, reuse);
        let v = r?;
        queue
            .and(off)
            .and(back)
            .ctx(self.pid, || self.what("leave TCP repair mode"))?;
        Ok(v)
    }

    fn tcp_read_repaired(&self, info: &[u8], conn: &str) -> Result<(TcpConn, Vec<SockMsg>)> {
        let s = self.s;
        let ctx = |w: &str| format!("{w} of {conn}, fd {} ({})", self.fd, self.link);
        let ioctl = |req, w: &str| {
            sk::ioctl_int(s, req)
                .map(|n| n.max(0) as usize)
                .ctx(self.pid, || ctx(w))
        };
        let inq = ioctl(sk::SIOCINQ, "read the bytes queued (SIOCINQ)")?;
        let outq = ioctl(sk::SIOCOUTQ, "read the bytes not acknowledged (SIOCOUTQ)")?;
        let unsent = ioctl(sk::SIOCOUTQNSD, "read the bytes not sent (SIOCOUTQNSD)")?;
        sk::tcp_repair_queue(s, sk::TCP_SEND_QUEUE)
            .ctx(self.pid, || ctx("select the send queue"))?;
        let write_seq = sk::tcp_queue_seq(s).ctx(self.pid, || ctx("read the send sequence"))?;
        let send_queue =
            sk::tcp_peek_send_queue(s, outq).ctx(self.pid, || ctx("read the send queue"))?;
        if send_queue.len() != outq {
            return Err(self.refuse(format!(
                "only {} of the {outq} bytes in the send queue of {conn} could be read",
                send_queue.len()
            )));
        }
        sk::tcp_repair_queue(s, sk::TCP_RECV_QUEUE)
            .ctx(self.pid, || ctx("select the receive queue"))?;
        let rcv_nxt = sk::tcp_queue_seq(s).ctx(self.pid, || ctx("read the receive sequence"))?;
        let queue = if inq > 0 {
            self.peek_stream(inq)?
        } else {
            Vec::new()
        };
        // In repair mode TCP_MAXSEG reads the MSS negotiated (mss_clamp).
        let mss_clamp = sk::getsockopt_int(s, IPPROTO_TCP, libc::TCP_MAXSEG)
            .ctx(self.pid, || ctx("read the MSS"))? as u32;
        let timestamp = sk::getsockopt_int(s, IPPROTO_TCP, libc::TCP_TIMESTAMP)
            .ctx(self.pid, || ctx("read TCP_TIMESTAMP"))? as u32;
        let w = sk::tcp_repair_window(s).ctx(self.pid, || ctx("read the window"))?;
        // struct tcp_info: tcpi_options at 5; tcpi_snd_wscale:4, tcpi_rcv_wscale:4 at 6.
        let options = info.get(5).copied().unwrap_or(0);
        let scales = info.get(6).copied().unwrap_or(0);
        let tcp = TcpConn {
            send_seq: write_seq.wrapping_sub(outq as u32),
            recv_seq: rcv_nxt.wrapping_sub(inq as u32),
            send_queue,
            unsent: unsent.min(outq) as u32,
            mss_clamp,
            wscale: (options & TCPI_OPT_WSCALE != 0).then_some((scales & 0xf, scales >> 4)),
            sack: options & TCPI_OPT_SACK != 0,
            timestamps: options & TCPI_OPT_TIMESTAMPS != 0,
            timestamp,
            window: TcpWindow {
                snd_wl1: w.snd_wl1,
                snd_wnd: w.snd_wnd,
                max_window: w.max_window,
                rcv_wnd: w.rcv_wnd,
                rcv_wup: w.rcv_wup,
            },
        };
        Ok((tcp, queue))
    }

    fn inet(&self, domain: i32, ty: SockType, protocol: i32) -> Result<SocketDesc> {
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
                        let (waiting, backlog) = (word(24), word(28));
                        if waiting > 0 {
                            return Err(self.refuse(format!(
                                "the TCP listening socket on {local} has {waiting} connection(s) \
                                 waiting to be accepted, which cannot be checkpointed yet \
                                 (established TCP connections need TCP_REPAIR)"
                            )));
                        }
                        desc.state = SockState::Listening {
                            backlog,
                            pending: Vec::new(),
                        };
                    }
                    7 => {}
                    TCP_ESTABLISHED => {
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
                        let (tcp, queue) = self.tcp_conn(&info, &conn)?;
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
                            "TCP connection {local} -> {peer} is {}; only established TCP \
                             connections can be checkpointed (half-closed and closing ones \
                             cannot yet)",
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
                    "{} sockets of protocol {protocol} are not supported (only TCP and UDP)",
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

/// Describes descriptor `fd` of `pid` (whose /proc link is `link`, e.g.
/// "socket:[1234]", and whose fdinfo lines are `info`), or `None` when this module
/// does not handle that kind (the caller then refuses it).
pub fn classify(
    pid: i32,
    fd: i32,
    link: &str,
    _info: &[(String, String)],
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
        _ => return Err(c.refuse(format!("sockets of type {ty} are not supported"))),
    };
    // SO_GET_FILTER: the number of instructions of a classic filter, EACCES for an eBPF one.
    match sk::getsockopt_len(c.s, SOL_SOCKET, libc::SO_ATTACH_FILTER) {
        Ok(0) => {}
        Ok(_)
        | Err(ferry_sys::SysError {
            errno: libc::EACCES,
            ..
        }) => {
            return Err(c.refuse(
                "a socket filter (SO_ATTACH_FILTER or SO_ATTACH_BPF) is attached to it, which \
                 cannot be checkpointed yet",
            ))
        }
        Err(_) => {}
    }
    let desc = match domain {
        libc::AF_UNIX => c.unix(sock_type)?,
        libc::AF_INET | libc::AF_INET6 => c.inet(domain, sock_type, protocol)?,
        _ => {
            return Err(c.refuse(format!(
                "{} sockets (address family {domain}) are not supported",
                family_name(domain)
            )))
        }
    };
    Ok(Some(FileKind::Socket(desc)))
}

/// Who holds a socket outside the tree, for error messages: "held by PID 42 (sshd)".
fn outside_holders(ino: u64, tree_pids: &HashSet<i32>) -> String {
    let needle = format!("socket:[{ino}]");
    let mut found = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                continue;
            };
            if tree_pids.contains(&pid) {
                continue;
            }
            let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
                continue;
            };
            if fds.flatten().any(|f| {
                std::fs::read_link(f.path()).is_ok_and(|l| l.as_os_str() == needle.as_str())
            }) {
                let comm = procfs::read(pid, "comm").unwrap_or_default();
                found.push(format!("PID {pid} ({})", comm.trim()));
                if found.len() >= 3 {
                    break;
                }
            }
        }
    }
    if found.is_empty() {
        String::new()
    } else {
        format!(", held by {}", found.join(", "))
    }
}

/// A UNIX socket for people, by inode: "socket:[123] (/run/x.sock, held by PID 42 (sshd))".
fn describe_unix_ino(ino: u64, tree_pids: &HashSet<i32>) -> String {
    let name = sk::unix_diag(Some(ino as u32), sk::UDIAG_SHOW_NAME)
        .ok()
        .and_then(|v| v.into_iter().next())
        .and_then(|d| d.name)
        .map(|n| {
            let mut raw = (libc::AF_UNIX as u16).to_ne_bytes().to_vec();
            raw.extend_from_slice(&n);
            decode_addr(&raw).map(|a| describe(&a)).unwrap_or_default()
        })
        .unwrap_or_else(|| "unnamed".into());
    format!("socket:[{ino}] ({name}{})", outside_holders(ino, tree_pids))
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
    tcp_peers(tree, &refuse, &tree_pids)?;
    // Clients waiting in the queues of the tree's listeners: client inode -> listener inode.
    let mut waiting: HashMap<u64, u64> = HashMap::new();
    for f in &tree.files {
        if let FileKind::Socket(s) = &f.kind {
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
    Ok(())
}

/// Whether two socket addresses name the same TCP or UDP endpoint (flow labels and scope
/// aside; an IPv4-mapped IPv6 address is its IPv4 address).
fn same_inet(a: &SockAddr, b: &SockAddr) -> bool {
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

/// Pairs each established TCP connection of the tree with its other end, which must be a
/// socket of the tree too; a connection to anything else is refused (`refuse(file id, inode,
/// why)`).
///
/// Why refuse a peer outside the tree: between the checkpoint and the restore the connection
/// has no socket on this machine, so anything the peer sends (data, a keepalive, a
/// retransmission) is answered with a reset, and the connection is lost; CRIU locks the
/// network (firewall rules dropping the connection's packets) for that window, which Ferry
/// does not do. Both ends in the tree are frozen, captured and killed together, and neither
/// sends anything in between.
fn tcp_peers(
    tree: &mut Tree,
    refuse: &dyn Fn(u32, u64, String) -> Error,
    tree_pids: &HashSet<i32>,
) -> Result<()> {
    let conns: Vec<(usize, u64, SockAddr, SockAddr)> = tree
        .files
        .iter()
        .enumerate()
        .filter_map(|(i, f)| match &f.kind {
            FileKind::Socket(s) if s.tcp.is_some() => {
                Some((i, s.ino, s.local.clone()?, s.peer.clone()?))
            }
            _ => None,
        })
        .collect();
    for (i, ino, local, peer) in &conns {
        let other = conns
            .iter()
            .find(|(_, _, l, p)| same_inet(l, peer) && same_inet(p, local));
        match other {
            Some((_, peer_ino, _, _)) => {
                if let FileKind::Socket(s) = &mut tree.files[*i].kind {
                    s.state = SockState::Connected {
                        peer_ino: *peer_ino,
                    };
                }
            }
            None => {
                let root = tree.processes.first().map(|p| p.pid).unwrap_or(0);
                let whose = match tcp_inode_of(root, peer, local) {
                    Some(pi) => format!("socket:[{pi}]{}", outside_holders(pi, tree_pids)),
                    None => "not a socket of this machine's network namespace".into(),
                };
                return Err(refuse(
                    tree.files[*i].id,
                    *ino,
                    format!(
                        "TCP connection {} -> {}: its other end ({whose}) is outside the tree. \
                         Only connections whose both ends are in the tree can be checkpointed: \
                         while the tree is away nothing on this machine would answer the other \
                         end but with a reset, and Ferry does not lock the network to hold its \
                         packets back",
                        describe(local),
                        describe(peer)
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// The inode of the TCP socket bound to `local` and connected to `peer`, from the network
/// namespace of `pid` (/proc/PID/net/tcp and tcp6), if there is one.
fn tcp_inode_of(pid: i32, local: &SockAddr, peer: &SockAddr) -> Option<u64> {
    // "0100007F:1F90": the address as the kernel's u32 words in hex, the port in hex.
    let parse = |field: &str| -> Option<SockAddr> {
        let (a, p) = field.split_once(':')?;
        let port = u16::from_str_radix(p, 16).ok()?;
        let words: Option<Vec<[u8; 4]>> = (0..a.len() / 8)
            .map(|k| {
                u32::from_str_radix(a.get(k * 8..k * 8 + 8)?, 16)
                    .ok()
                    .map(u32::to_ne_bytes)
            })
            .collect();
        let bytes: Vec<u8> = words?.concat();
        match bytes.len() {
            4 => Some(SockAddr::Inet {
                addr: bytes.try_into().ok()?,
                port,
            }),
            16 => Some(SockAddr::Inet6 {
                addr: bytes.try_into().ok()?,
                port,
                flowinfo: 0,
                scope_id: 0,
            }),
            _ => None,
        }
    };
    for table in ["net/tcp", "net/tcp6"] {
        let Ok(text) = procfs::read(pid, table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            if cols.len() <= 9 {
                continue;
            }
            let (Some(l), Some(r)) = (parse(cols[1]), parse(cols[2])) else {
                continue;
            };
            if same_inet(&l, local) && same_inet(&r, peer) {
                return cols[9].parse().ok().filter(|&ino| ino != 0);
            }
        }
    }
    None
}

/// Just before a captured tree is killed: puts every TCP connection its processes hold into
/// repair mode, so that closing them sends nothing (no FIN, no reset) and leaves nothing
/// behind (no TIME_WAIT): the other end (in the tree too, and dying with it) hears nothing,
/// and the connection's addresses are free at once for the restore. Errors are logged: the
/// tree dies anyway.
pub fn silence_tcp_connections(pids: &[i32]) {
    for &pid in pids {
        let Ok(fds) = procfs::fds(pid) else {
            continue;
        };
        let mut pfd = None;
        for fd in fds {
            let Ok(link) = procfs::readlink(pid, &format!("fd/{fd}")) else {
                continue;
            };
            if !link.starts_with("socket:[") {
                continue;
            }
            if pfd.is_none() {
                match pidfd::pidfd_open(pid) {
                    Ok(p) => pfd = Some(p),
                    Err(_) => break,
                }
            }
            let Some(p) = pfd.as_ref() else { break };
            let Ok(s) = pidfd::pidfd_getfd(p, fd) else {
                continue;
            };
            let s = s.as_raw_fd();
            let tcp = sk::getsockopt_int(s, SOL_SOCKET, libc::SO_PROTOCOL)
                .is_ok_and(|p| p == libc::IPPROTO_TCP);
            if !tcp {
                continue;
            }
            let state = sk::getsockopt(s, IPPROTO_TCP, libc::TCP_INFO, 1)
                .ok()
                .and_then(|i| i.first().copied())
                .unwrap_or(0);
            if state == 0 || state == TCP_LISTEN || state == 7 {
                continue;
            }
            if let Err(e) = sk::tcp_repair(s, sk::TCP_REPAIR_ON) {
                log::warn!(
                    "PID {pid}: fd {fd} ({link}): {e}: the connection may be reset or linger \
                     when the tree dies"
                );
            }
        }
    }
}

/// Accepts every connection waiting in listener `tree.files[li]` from a copy of it, records
/// what each carries, and makes the connections again in the running tree (see the module
/// documentation).
fn requeue(
    frozen: &FrozenTree,
    tree: &mut Tree,
    holders: &HashMap<u32, Vec<(i32, i32, bool)>>,
    by_ino: &HashMap<u64, usize>,
    li: usize,
) -> Result<()> {
    let lfile = tree.files[li].clone();
    let FileKind::Socket(l) = &lfile.kind else {
        return Ok(());
    };
    let SockState::Listening { pending, .. } = &l.state else {
        return Ok(());
    };
    let (lpid, lfd, _) = holders
        .get(&lfile.id)
        .and_then(|h| h.first().copied())
        .unwrap_or((tree.root_pid, -1, false));
    let refuse = |why: String| Error::Unsupported {
        pid: lpid,
        what: format!("fd {lfd} (socket:[{}])", l.ino),
        why,
    };
    let name = match (&l.local, &l.path_file) {
        (Some(SockAddr::UnixPath(_)), Some(f)) if f.deleted => None,
        (Some(SockAddr::UnixPath(p)), Some(f)) => Some(match &f.dir {
            Some(d) => {
                let mut full = d.as_bytes().to_vec();
                full.push(b'/');
                full.extend_from_slice(p);
                SockAddr::UnixPath(full)
            }
            None => SockAddr::UnixPath(p.clone()),
        }),
        (Some(a @ SockAddr::UnixAbstract(_)), _) => Some(a.clone()),
        _ => None,
    };
    let Some(name) = name else {
        return Err(refuse(
            "connections that already carry data wait in its queue, and its name can no longer \
             be connected to (the socket file was removed)"
                .into(),
        ));
    };
    let addr = encode_addr(&name);
    // Everything that could stop us is checked before the queue is touched.
    let tree_pids: HashSet<i32> = tree.processes.iter().map(|p| p.pid).collect();
    let epoll_targets = epoll_watched_inodes(tree);
    for c in pending.iter().filter(|c| c.client_ino != 0) {
        let Some(ci) = by_ino.get(&c.client_ino) else {
            continue;
        };
        let FileKind::Socket(cs) = &tree.files[*ci].kind else {
            continue;
        };
        if cs.local.is_some() {
            return Err(refuse(format!(
                "client socket:[{}] waiting in its queue already sent data and is bound to a \
                 name; such a connection cannot be captured yet",
                c.client_ino
            )));
        }
        if epoll_targets.contains(&c.client_ino) {
            return Err(refuse(format!(
                "client socket:[{}] waiting in its queue already sent data and is watched by an \
                 epoll instance; such a connection cannot be captured yet",
                c.client_ino
            )));
        }
        let outside = outside_holders(c.client_ino, &tree_pids);
        if !outside.is_empty() {
            return Err(refuse(format!(
                "client socket:[{}] waiting in its queue is also{}, outside the tree",
                c.client_ino,
                outside.trim_start_matches(',')
            )));
        }
    }
    for c in pending.iter().filter(|c| c.client_ino != 0) {
        if let Some(f) = by_ino.get(&c.client_ino).map(|i| &tree.files[*i]) {
            for (pid, _, _) in holders.get(&f.id).map(|h| h.as_slice()).unwrap_or(&[]) {
                ferry_inject::find_syscall_insn(*pid)?;
            }
        }
    }
    let pidfd = pidfd::pidfd_open(lpid).ctx(lpid, || "open a pidfd".into())?;
    let lcopy = pidfd::pidfd_getfd(&pidfd, lfd)
        .ctx(lpid, || format!("take a copy of listening fd {lfd}"))?;
    // Accept them all, in queue order: from here on the connections must be made again.
    let mut accepted = Vec::new();
    for c in pending {
        let e = sk::accept(lcopy.as_raw_fd(), libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC)
            .ctx(lpid, || format!("accept a waiting connection on fd {lfd}"))?;
        let mut data: Vec<(Vec<u8>, Vec<OwnedFd>)> = Vec::new();
        loop {
            match sk::recv(e.as_raw_fd(), PEEK_CHUNK, libc::MSG_DONTWAIT) {
                Ok(m) if m.data.is_empty() && m.rights.is_empty() => break,
                Ok(m) => data.push((m.data, m.rights)),
                Err(_) => break,
            }
        }
        let cred = peer_cred(e.as_raw_fd());
        accepted.push((c.client_ino, e, data, cred));
    }
    let ty = match l.sock_type {
        SockType::Seqpacket => libc::SOCK_SEQPACKET,
        _ => libc::SOCK_STREAM,
    };
    let mut rights_seen = 0;
    let mut new_pending = Vec::new();
    let mut chan: Option<Channel> = None;
    for (client_ino, _server_end, data, cred) in &accepted {
        rights_seen += data.iter().map(|d| d.1.len()).sum::<usize>();
        new_pending.push(PendingConn {
            client_ino: *client_ino,
            queue: data
                .iter()
                .map(|(d, _)| SockMsg {
                    data: d.clone(),
                    from: None,
                })
                .collect(),
            cred: cred.clone(),
        });
        if *client_ino == 0 {
            // The client is gone: a throwaway one says the same and goes.
            let c = sk::socket(libc::AF_UNIX, ty | NEW, 0).ctx(lpid, || "make a socket".into())?;
            sk::connect(c.as_raw_fd(), &addr)
                .ctx(lpid, || format!("connect to listening fd {lfd} again"))?;
            write_all(lpid, c.as_raw_fd(), data, ty == libc::SOCK_SEQPACKET)?;
            continue;
        }
        let ci = by_ino[client_ino];
        let cfile = &tree.files[ci];
        let FileKind::Socket(cs) = &cfile.kind else {
            continue;
        };
        let hs = holders.get(&cfile.id).cloned().unwrap_or_default();
        let Some(&(hpid, _, _)) = hs.first() else {
            continue;
        };
        let inj = injector(frozen, hpid)?;
        let r = (|| -> Result<()> {
            // The new client is made by a process of the tree, which the server end records.
            // Non-blocking: the queue has room, but an injected call must never wait.
            let t = inj.syscall(
                "socket",
                libc::SYS_socket,
                &[libc::AF_UNIX as u64, (ty | NEW) as u64, 0],
            )?;
            let a = inj.write_scratch(0, &addr)?;
            inj.syscall("connect", libc::SYS_connect, &[t, a, addr.len() as u64])?;
            let p = pidfd::pidfd_open(hpid).ctx(hpid, || "open a pidfd".into())?;
            let c2 = pidfd::pidfd_getfd(&p, t as i32)
                .ctx(hpid, || "take a copy of the new client socket".into())?;
            write_all(hpid, c2.as_raw_fd(), data, ty == libc::SOCK_SEQPACKET)?;
            apply_opts(c2.as_raw_fd(), &cs.opts, true);
            let mask = libc::O_NONBLOCK | libc::O_ASYNC;
            let fl = fdops::get_fl(c2.as_raw_fd()).ctx(hpid, || "read file flags".into())?;
            fdops::set_fl(c2.as_raw_fd(), (fl & !mask) | (cfile.flags & mask))
                .ctx(hpid, || "set file flags".into())?;
            apply_shutdown(c2.as_raw_fd(), &cs.shutdown);
            for &(pid, fd, cloexec) in &hs {
                let flags = if cloexec { libc::O_CLOEXEC as u64 } else { 0 };
                if pid == hpid {
                    inj.syscall("dup3", libc::SYS_dup3, &[t, fd as u64, flags])?;
                } else {
                    if chan.is_none() {
                        chan = Some(Channel::new(lpid)?);
                    }
                    let ch = chan.as_ref().expect("made above");
                    ch.install(frozen, pid, &c2, fd, flags)?;
                }
            }
            inj.syscall("close", libc::SYS_close, &[t])?;
            Ok(())
        })();
        inj.finish()?;
        r?;
    }
    drop(accepted);
    if let FileKind::Socket(s) = &mut tree.files[li].kind {
        if let SockState::Listening { pending, .. } = &mut s.state {
            for (p, n) in pending.iter_mut().zip(new_pending) {
                p.queue = n.queue;
                if n.cred.is_some() {
                    p.cred = n.cred;
                }
            }
        }
    }
    if rights_seen > 0 {
        return Err(refuse(format!(
            "{rights_seen} file descriptor(s) are in flight (SCM_RIGHTS) in connections waiting \
             in its queue, which cannot be checkpointed yet"
        )));
    }
    Ok(())
}

/// Writes captured messages (with the descriptors that came with them) into a socket.
fn write_all(pid: i32, s: RawFd, data: &[(Vec<u8>, Vec<OwnedFd>)], records: bool) -> Result<()> {
    let total: usize = data.iter().map(|d| d.0.len()).sum();
    bump_sndbuf(s, total);
    for (d, rights) in data {
        let fds: Vec<RawFd> = rights.iter().map(|f| f.as_raw_fd()).collect();
        let mut at = 0;
        loop {
            let n = sk::send(
                s,
                &d[at..],
                None,
                if at == 0 { &fds } else { &[] },
                libc::MSG_DONTWAIT,
            )
            .ctx(pid, || "send queued data again".into())?;
            at += n;
            if at >= d.len() || records {
                break;
            }
        }
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

/// An injector on a frozen process's first thread.
fn injector(frozen: &FrozenTree, pid: i32) -> Result<ferry_inject::Injector> {
    let fp = frozen
        .procs
        .iter()
        .find(|p| p.pid == pid)
        .ok_or(Error::NoSuchProcess { pid })?;
    let t = fp.threads.first().ok_or(Error::NoSuchProcess { pid })?;
    let at = ferry_inject::find_syscall_insn(pid)?;
    Ok(ferry_inject::Injector::on_stack(pid, t.tid, t.regs, at)?)
}

/// Inodes of the sockets that an epoll instance of the tree watches.
fn epoll_watched_inodes(tree: &Tree) -> HashSet<u64> {
    let mut out = HashSet::new();
    for p in &tree.processes {
        for f in &p.fds {
            if procfs::readlink(p.pid, &format!("fd/{}", f.fd))
                .ok()
                .as_deref()
                != Some("anon_inode:[eventpoll]")
            {
                continue;
            }
            let Ok(text) = procfs::read(p.pid, &format!("fdinfo/{}", f.fd)) else {
                continue;
            };
            for word in text.split_whitespace() {
                if let Some(h) = word.strip_prefix("ino:") {
                    if let Ok(ino) = u64::from_str_radix(h, 16) {
                        out.insert(ino);
                    }
                }
            }
        }
    }
    out
}

/// Hands descriptors of ours to frozen processes whatever their credentials: each connects to
/// an abstract socket of ours and receives the descriptor with SCM_RIGHTS.
struct Channel {
    listener: OwnedFd,
    addr: Vec<u8>,
}

impl Channel {
    fn new(pid: i32) -> Result<Channel> {
        let listener = sk::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0)
            .ctx(pid, || "make a socket".into())?;
        let name = format!("ferry-{}-{:p}", std::process::id(), &listener);
        let addr = encode_addr(&SockAddr::UnixAbstract(name.into_bytes()));
        sk::bind(listener.as_raw_fd(), &addr).ctx(pid, || "bind a socket".into())?;
        sk::listen(listener.as_raw_fd(), 8).ctx(pid, || "listen".into())?;
        Ok(Channel { listener, addr })
    }

    /// Installs `what` in frozen process `pid` as descriptor `fd` (with dup3 `flags`).
    fn install(
        &self,
        frozen: &FrozenTree,
        pid: i32,
        what: &OwnedFd,
        fd: i32,
        flags: u64,
    ) -> Result<()> {
        let inj = injector(frozen, pid)?;
        let r = (|| -> Result<()> {
            let s = inj.syscall(
                "socket",
                libc::SYS_socket,
                &[
                    libc::AF_UNIX as u64,
                    (libc::SOCK_STREAM | libc::SOCK_CLOEXEC) as u64,
                    0,
                ],
            )?;
            let a = inj.write_scratch(0, &self.addr)?;
            inj.syscall(
                "connect",
                libc::SYS_connect,
                &[s, a, self.addr.len() as u64],
            )?;
            let conn = sk::accept(self.listener.as_raw_fd(), libc::SOCK_CLOEXEC)
                .ctx(pid, || "accept on the hand-over socket".into())?;
            sk::send(conn.as_raw_fd(), &[0], None, &[what.as_raw_fd()], 0)
                .ctx(pid, || "hand a descriptor over".into())?;
            // struct msghdr at 256, its iovec at 320, one data byte at 352, control at 384.
            let base = inj.scratch(0);
            let mut msg = Vec::new();
            for w in [0u64, 0, base + 320, 1, base + 384, 64, 0] {
                msg.extend_from_slice(&w.to_ne_bytes());
            }
            inj.write_scratch(256, &msg)?;
            let mut iov = Vec::new();
            for w in [base + 352, 1u64] {
                iov.extend_from_slice(&w.to_ne_bytes());
            }
            inj.write_scratch(320, &iov)?;
            inj.write_scratch(384, &[0u8; 64])?;
            inj.syscall(
                "recvmsg",
                libc::SYS_recvmsg,
                &[s, base + 256, libc::MSG_CMSG_CLOEXEC as u64],
            )?;
            let c = inj.read_scratch(384, 24)?;
            let level = i32::from_ne_bytes(c[8..12].try_into().expect("4 bytes"));
            let ty = i32::from_ne_bytes(c[12..16].try_into().expect("4 bytes"));
            if level != libc::SOL_SOCKET || ty != libc::SCM_RIGHTS {
                return Err(Error::Restore {
                    pid,
                    what: "no descriptor arrived over the hand-over socket".into(),
                });
            }
            let got = u64::from(u32::from_ne_bytes(c[16..20].try_into().expect("4 bytes")));
            inj.syscall("dup3", libc::SYS_dup3, &[got, fd as u64, flags])?;
            inj.syscall("close", libc::SYS_close, &[got])?;
            inj.syscall("close", libc::SYS_close, &[s])?;
            Ok(())
        })();
        inj.finish()?;
        r
    }
}

// ---------------------------------------------------------------------------------------------
// Restore
// ---------------------------------------------------------------------------------------------

thread_local! {
    /// Sockets made for the tree being restored, by file id, until each is asked for.
    static MADE: RefCell<HashMap<u32, OwnedFd>> = RefCell::new(HashMap::new());
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
}

/// A UNIX stream or seqpacket socket whose abstract name another socket held while the tree
/// was rebuilt (on one machine, the frozen original of a migration, until the commit point:
/// abstract names belong to the network namespace). bind() and listen() are made by process
/// `pid` itself through its descriptor `fd`, injected at resume ([`crate::late`]), so that
/// SO_PEERCRED reports that process to whoever connects, as it did; each waiting connection
/// is made by the process that made it (its credentials are what the server end reports), and
/// refilled with what it had sent.
struct DeferredName {
    pid: i32,
    fd: i32,
    addr: Vec<u8>,
    backlog: Option<i32>,
    clients: Vec<DeferredClient>,
    what: String,
}

struct DeferredClient {
    pid: i32,
    fd: i32,
    /// A copy of the client socket, to refill what it had sent.
    socket: OwnedFd,
    data: Vec<Vec<u8>>,
    records: bool,
}

impl DeferredName {
    fn make(
        &self,
        hosts: &HashMap<i32, i32>,
        deadline: std::time::Instant,
        wait: std::time::Duration,
    ) -> Result<()> {
        let host = |pid: i32| {
            hosts.get(&pid).copied().ok_or_else(|| Error::Restore {
                pid,
                what: format!("{}: the process is not in the rebuilt tree", self.what),
            })
        };
        let addr_len = self.addr.len() as u64;
        crate::late::with_injector(self.pid, host(self.pid)?, &self.what, |inj| {
            let addr = inj.write_scratch(0, &self.addr)?;
            loop {
                let r =
                    inj.syscall_raw("bind", libc::SYS_bind, &[self.fd as u64, addr, addr_len])?;
                if r == 0 {
                    break;
                }
                if r == -(libc::EADDRINUSE as i64) && std::time::Instant::now() < deadline {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                    continue;
                }
                return Err(Error::Restore {
                    pid: self.pid,
                    what: format!(
                        "{}: bind: {}{}",
                        self.what,
                        std::io::Error::from_raw_os_error(-r as i32),
                        if r == -(libc::EADDRINUSE as i64) {
                            format!(" after {wait:?} (the original of the tree, if it still runs?)")
                        } else {
                            String::new()
                        }
                    ),
                });
            }
            if let Some(backlog) = self.backlog {
                inj.syscall(
                    "listen",
                    libc::SYS_listen,
                    &[self.fd as u64, backlog as u64],
                )?;
            }
            Ok(())
        })?;
        for c in &self.clients {
            let what = format!(
                "{}: connect a waiting client (PID {} fd {})",
                self.what, c.pid, c.fd
            );
            crate::late::with_injector(c.pid, host(c.pid)?, &what, |inj| {
                let addr = inj.write_scratch(0, &self.addr)?;
                inj.syscall("connect", libc::SYS_connect, &[c.fd as u64, addr, addr_len])?;
                Ok(())
            })?;
            let data: Vec<(Vec<u8>, Vec<OwnedFd>)> =
                c.data.iter().map(|d| (d.clone(), Vec::new())).collect();
            write_all(c.pid, c.socket.as_raw_fd(), &data, c.records)?;
        }
        Ok(())
    }
}

struct DeferredRepair {
    /// A copy of the socket, in repair mode, with its options, neither bound nor connected.
    fd: OwnedFd,
    local: Vec<u8>,
    peer: Vec<u8>,
    conn: TcpConn,
    /// The bytes received and not read.
    recv: Vec<u8>,
    /// How many bytes at the start of `conn.send_queue` were sent (and not acknowledged).
    sent: usize,
    opts: Vec<SockOpt>,
    /// SO_REUSEADDR as captured (leaving repair mode clears it).
    reuseaddr: i32,
    /// SO_SNDBUF as captured (raised for a moment to send what was never sent).
    sndbuf: Option<i32>,
    what: String,
}

/// Runs an operation again while it fails because an address is still in use, until a deadline.
type Retry = dyn Fn(&dyn Fn() -> ferry_sys::SysResult<()>) -> ferry_sys::SysResult<()>;

impl DeferredRepair {
    /// Makes the connection in repair mode: its name (bound whoever holds the port: repair
    /// mode forces it), its sequence numbers, connect (which sends nothing in repair mode;
    /// through `retry`, while another socket still owns the four addresses), the options
    /// negotiated, both queues and the window. Errors name the step.
    fn make(&self, retry: &Retry) -> std::result::Result<(), (String, ferry_sys::SysError)> {
        let f = self.fd.as_raw_fd();
        let t = &self.conn;
        let step = |what: &str| {
            let what = what.to_string();
            move |e: ferry_sys::SysError| (what, e)
        };
        sk::bind(f, &self.local).map_err(step("bind (in repair mode)"))?;
        sk::tcp_repair_queue(f, sk::TCP_SEND_QUEUE).map_err(step("select the send queue"))?;
        sk::set_tcp_queue_seq(f, t.send_seq).map_err(step("set the send sequence"))?;
        sk::tcp_repair_queue(f, sk::TCP_RECV_QUEUE).map_err(step("select the receive queue"))?;
        sk::set_tcp_queue_seq(f, t.recv_seq).map_err(step("set the receive sequence"))?;
        if t.timestamps {
            sk::setsockopt_int(f, IPPROTO_TCP, libc::TCP_TIMESTAMP, t.timestamp as i32)
                .map_err(step("set TCP_TIMESTAMP"))?;
        }
        retry(&|| sk::connect(f, &self.peer)).map_err(step("connect (in repair mode)"))?;
        let mut opts = vec![(sk::TCPOPT_MSS, t.mss_clamp)];
        if let Some((snd, rcv)) = t.wscale {
            opts.push((sk::TCPOPT_WINDOW, u32::from(snd) | (u32::from(rcv) << 16)));
        }
        if t.sack {
            opts.push((sk::TCPOPT_SACK_PERM, 0));
        }
        if t.timestamps {
            opts.push((sk::TCPOPT_TIMESTAMP, 0));
        }
        sk::tcp_repair_options(f, &opts).map_err(step("set the options negotiated"))?;
        // The bytes received and not read: queued as if they had just arrived.
        if !self.recv.is_empty() {
            let want = (self.recv.len().saturating_mul(2) + (1 << 20)).min(i32::MAX as usize / 4);
            let _ = sk::setsockopt_int(f, SOL_SOCKET, libc::SO_RCVBUFFORCE, want as i32);
            sk::tcp_repair_queue(f, sk::TCP_RECV_QUEUE)
                .map_err(step("select the receive queue"))?;
            send_stream(f, &self.recv).map_err(step("refill the receive queue"))?;
        }
        // The bytes sent and not acknowledged: queued as sent (repair mode sends nothing; they
        // go out again when the retransmission timer fires). The bytes never sent are sent
        // for real when the connection leaves repair mode.
        bump_sndbuf(f, t.send_queue.len());
        if self.sent > 0 {
            sk::tcp_repair_queue(f, sk::TCP_SEND_QUEUE).map_err(step("select the send queue"))?;
            send_stream(f, &t.send_queue[..self.sent]).map_err(step("refill the send queue"))?;
        }
        sk::tcp_repair_queue(f, sk::TCP_NO_QUEUE).map_err(step("select no queue"))?;
        // Buffers as they were (raised above to refill the queues).
        apply_opts(f, &self.opts, true);
        let w = sk::TcpRepairWindow {
            snd_wl1: t.window.snd_wl1,
            snd_wnd: t.window.snd_wnd,
            max_window: t.window.max_window,
            rcv_wnd: t.window.rcv_wnd,
            rcv_wup: t.window.rcv_wup,
        };
        sk::set_tcp_repair_window(f, &w).map_err(step("set the window"))?;
        Ok(())
    }
}

/// Writes `data` into the queue of socket `f` that repair mode has selected.
fn send_stream(f: RawFd, data: &[u8]) -> ferry_sys::SysResult<()> {
    let mut at = 0;
    while at < data.len() {
        let n = sk::send(f, &data[at..], None, &[], libc::MSG_DONTWAIT).map_err(|e| {
            ferry_sys::SysError::new(
                if at == 0 {
                    "send"
                } else {
                    "send (part of the bytes done)"
                },
                e.errno,
            )
        })?;
        if n == 0 {
            return Err(ferry_sys::SysError::new("send (no progress)", libc::EAGAIN));
        }
        at += n;
    }
    Ok(())
}

struct DeferredListen {
    fd: OwnedFd,
    backlog: i32,
    what: String,
}

struct DeferredBind {
    fd: OwnedFd,
    local: Vec<u8>,
    peer: Option<Vec<u8>>,
    what: String,
}

struct DeferredDatagram {
    /// A copy of the sending socket of the tree, or a throwaway socket.
    from: OwnedFd,
    to: Vec<u8>,
    data: Vec<u8>,
    what: String,
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
        Ok(())
    }
}

/// Recreates the open file description `d` in this (the restoring) process. All the sockets of
/// the tree are made together, when the first one is asked for.
///
/// `guest`: a pidfd of the init of the guest namespaces the tree is rebuilt in, if it is.
pub fn open(
    d: &FileDesc,
    tree: &Tree,
    guest: Option<std::os::fd::BorrowedFd<'_>>,
) -> Result<OwnedFd> {
    let first = tree
        .files
        .iter()
        .find(|f| matches!(f.kind, FileKind::Socket(_)))
        .map(|f| f.id);
    if first == Some(d.id) {
        MADE.with(|m| m.borrow_mut().clear());
        drop(Deferred::take());
        let (made, deferred) = Builder::new(tree, guest.map(|g| g.as_raw_fd())).build()?;
        MADE.with(|m| *m.borrow_mut() = made);
        DEFERRED.with(|d| *d.borrow_mut() = deferred);
    }
    MADE.with(|m| m.borrow_mut().remove(&d.id))
        .ok_or_else(|| Error::BadImage(format!("file {}: socket was not rebuilt", d.id)))
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
    /// Socket files to remove once every connection to them is made.
    remove_later: Vec<PathBuf>,
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
}

impl<'a> Builder<'a> {
    fn new(tree: &'a Tree, guest: Option<RawFd>) -> Self {
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
        Builder {
            me: std::process::id() as i32,
            socks,
            by_ino,
            fds: (0..n).map(|_| None).collect(),
            bound: HashSet::new(),
            made_peer: HashMap::new(),
            phantoms: Vec::new(),
            remove_later: Vec::new(),
            guest,
            deferred: Deferred::default(),
            holders,
            late_names: HashSet::new(),
        }
    }

    fn build(mut self) -> Result<(HashMap<u32, OwnedFd>, Deferred)> {
        let r = self.build_steps();
        for p in std::mem::take(&mut self.remove_later) {
            let _ = std::fs::remove_file(p);
        }
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

    fn build_steps(&mut self) -> Result<()> {
        self.pairs()?;
        self.create_rest()?;
        self.bind_and_listen()?;
        self.connect_dgrams()?;
        for p in std::mem::take(&mut self.remove_later) {
            let _ = std::fs::remove_file(p);
        }
        self.fill_queues()?;
        self.finish();
        Ok(())
    }

    fn sock(&self, i: usize) -> &'a SocketDesc {
        self.socks[i].1
    }

    fn err(&self, i: usize, what: impl std::fmt::Display) -> Error {
        let (id, s) = self.socks[i];
        Error::Restore {
            pid: self.me,
            what: format!("socket of file {id} (socket:[{}]): {what}", s.ino),
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

    /// The path a UNIX socket name refers to, from the socket's directory when relative.
    fn full_path(p: &[u8], file: Option<&SocketFile>) -> PathBuf {
        match file.and_then(|f| f.dir.as_ref()) {
            Some(d) if p.first() != Some(&b'/') => Path::new(d).join(OsStr::from_bytes(p)),
            _ => PathBuf::from(OsStr::from_bytes(p)),
        }
    }

    /// Binds `fd` to UNIX name `a` (its file described by `file`), clearing a stale socket
    /// file first. `i` names the socket in messages.
    fn bind_unix(
        &mut self,
        i: usize,
        fd: RawFd,
        a: &SockAddr,
        file: Option<&SocketFile>,
    ) -> Result<()> {
        let raw = encode_addr(a);
        let SockAddr::UnixPath(p) = a else {
            let r = sk::bind(fd, &raw);
            if r.as_ref().is_err_and(|e| e.errno == libc::EADDRINUSE)
                && matches!(a, SockAddr::UnixAbstract(_))
                && self.can_name_late(i)
            {
                self.late_names.insert(i);
                return Ok(());
            }
            return r.map_err(|e| {
                if e.errno == libc::EADDRINUSE && matches!(a, SockAddr::UnixAbstract(_)) {
                    // Abstract names belong to the network namespace, which the nodes of one
                    // machine share: the frozen original of a migration holds the name until
                    // the commit point. Binding later would be easy; but a listener's waiting
                    // connections are made through its name now, and listen() and connect()
                    // must be called by the processes whose PIDs SO_PEERCRED reports, which
                    // exist only in the rebuilt tree by then.
                    self.err(
                        i,
                        format!(
                            "bind to the abstract name {}: {e}: another socket holds it (the \
                             original of the tree, frozen on this machine until the commit point \
                             of a migration, or still running?), and it cannot get it when the \
                             tree is about to run instead: {}",
                            describe(a),
                            self.late_name_refusal(i).unwrap_or_default()
                        ),
                    )
                } else {
                    self.err(i, format!("bind to {}: {e}", describe(a)))
                }
            });
        };
        let full = Self::full_path(p, file);
        self.clear_stale(i, &full)?;
        match file
            .and_then(|f| f.dir.as_ref())
            .filter(|_| p.first() != Some(&b'/'))
        {
            Some(d) => {
                // A relative name is bound from its directory, by a helper with its own cwd.
                let mut cd = d.as_bytes().to_vec();
                cd.push(0);
                let ops = [
                    HelperOp::Chdir { path: &cd },
                    HelperOp::Bind { fd, addr: &raw },
                ];
                let res = sk::run_as(None, None, &ops)
                    .map_err(|e| self.err(i, format!("bind helper: {e}")))?
                    .unwrap_or_default();
                if res.len() != 2 {
                    return Err(self.err(i, "bind helper did not run"));
                }
                self.check(i, &format!("chdir to {d}"), &res[0])?;
                self.check(i, &format!("bind to {}", full.display()), &res[1])?;
            }
            None => sk::bind(fd, &raw)
                .map_err(|e| self.err(i, format!("bind to {}: {e}", full.display())))?,
        }
        match file {
            Some(f) if !f.deleted => {
                let _ = std::fs::set_permissions(&full, std::fs::Permissions::from_mode(f.mode));
                let _ = std::os::unix::fs::chown(&full, Some(f.uid), Some(f.gid));
            }
            _ => self.remove_later.push(full),
        }
        Ok(())
    }

    /// Removes a socket file left at `path` by a socket that no longer exists.
    fn clear_stale(&mut self, i: usize, path: &Path) -> Result<()> {
        let Ok(md) = std::fs::symlink_metadata(path) else {
            return Ok(());
        };
        if !md.file_type().is_socket() {
            return Err(self.err(i, format!("{} exists and is not a socket", path.display())));
        }
        if let Some(k) = self.remove_later.iter().position(|p| p == path) {
            // The file of one of ours that was to go anyway.
            let _ = std::fs::remove_file(path);
            self.remove_later.remove(k);
            return Ok(());
        }
        // Connected stream sockets (accepted ones) refer to their listener's file without
        // owning the name; ours are made from the image.
        let ours: HashSet<u64> = self
            .fds
            .iter()
            .flatten()
            .chain(self.phantoms.iter().map(|(_, f)| f))
            .filter_map(|f| std::fs::metadata(format!("/proc/self/fd/{}", f.as_raw_fd())).ok())
            .map(|m| m.ino())
            .collect();
        let live = sk::unix_diag(None, sk::UDIAG_SHOW_VFS)
            .map_err(|e| self.err(i, format!("ask sock_diag about bound sockets: {e}")))?
            .iter()
            .any(|d| {
                d.vfs
                    .is_some_and(|(ino, dev)| md.ino() as u32 == ino && same_dev(dev, md.dev()))
                    && !ours.contains(&u64::from(d.ino))
                    && (d.sock_type == libc::SOCK_DGRAM as u8 || d.state != TCP_ESTABLISHED)
            });
        if live {
            return Err(self.err(
                i,
                format!("{} is in use by a running socket", path.display()),
            ));
        }
        std::fs::remove_file(path).map_err(|e| {
            self.err(
                i,
                format!("remove stale socket file {}: {e}", path.display()),
            )
        })
    }

    /// Connections both ends of which are made here: pairs within the tree, and sockets whose
    /// peer has been closed (with a stand-in peer, closed at the end).
    fn pairs(&mut self) -> Result<()> {
        let mut taken: HashSet<usize> = HashSet::new();
        let mut plain: Vec<(usize, End)> = Vec::new();
        let mut named: Vec<(End, End)> = Vec::new();
        for i in 0..self.socks.len() {
            let s = self.sock(i);
            if s.family != SockFamily::Unix || taken.contains(&i) {
                continue;
            }
            let SockState::Connected { peer_ino } = s.state else {
                continue;
            };
            let other = if peer_ino == 0 {
                let name = s.peer.clone().filter(|p| *p != SockAddr::UnixUnnamed);
                End::Phantom { owner: i, name }
            } else {
                let Some(j) = self.peer_of(i) else {
                    return Err(self.err(
                        i,
                        format!("its peer socket:[{peer_ino}] is not in the image"),
                    ));
                };
                if taken.contains(&j) {
                    continue;
                }
                if s.sock_type == SockType::Dgram {
                    // Only its other end can have connected a datagram socket to an unnamed
                    // one: they were made as a pair (and may have been bound since). Named
                    // ones are connected by name later.
                    let back = self.peer_of(j) == Some(i);
                    if self.sock(j).local.is_some() && !(s.local.is_none() && back) {
                        continue;
                    }
                } else if self.peer_of(j) != Some(i) {
                    return Err(self.err(i, "its peer is connected to another socket"));
                }
                taken.insert(j);
                End::Real(j)
            };
            taken.insert(i);
            let other_named = match &other {
                End::Real(j) => self.sock(*j).local.is_some(),
                End::Phantom { name, .. } => name.is_some(),
            };
            if s.sock_type == SockType::Dgram || (s.local.is_none() && !other_named) {
                plain.push((i, other));
            } else {
                named.push((End::Real(i), other));
            }
        }
        // socketpair(2), in one helper per creator.
        type Group = (Option<PeerCred>, Vec<(usize, End)>);
        let mut by_cred: Vec<Group> = Vec::new();
        for (i, other) in plain {
            let c = self.sock(i).peer_cred.clone();
            match by_cred.iter_mut().find(|(k, _)| *k == c) {
                Some((_, v)) => v.push((i, other)),
                None => by_cred.push((c, vec![(i, other)])),
            }
        }
        for (cred, list) in by_cred {
            let ops: Vec<HelperOp> = list
                .iter()
                .map(|(i, _)| HelperOp::SocketPair {
                    ty: sock_type_raw(self.sock(*i).sock_type) | NEW,
                })
                .collect();
            let res = self.as_cred(cred.as_ref(), &ops);
            for ((i, other), r) in list.into_iter().zip(res) {
                self.check(i, "socketpair", &r)?;
                let (a, b) = r
                    .fds
                    .ok_or_else(|| self.err(i, "socketpair made nothing"))?;
                self.fds[i] = Some(a);
                match other {
                    End::Real(j) => {
                        self.fds[j] = Some(b);
                        self.made_peer.insert(i, Some(j));
                        self.made_peer.insert(j, Some(i));
                    }
                    End::Phantom { .. } => {
                        self.made_peer.insert(i, None);
                        self.phantoms.push((i, b));
                    }
                }
            }
        }
        for (a, b) in named {
            self.named_pair(a, b)?;
        }
        Ok(())
    }

    /// Makes a connected stream pair through a temporary listener bound to the name of one end,
    /// which that end (the accepted one) takes over. The connecting end records the listener's
    /// creator and the accepted end the connector, so SO_PEERCRED comes out right on both.
    fn named_pair(&mut self, a: End, b: End) -> Result<()> {
        let name_of = |e: &End| match e {
            End::Real(i) => self.sock(*i).local.clone(),
            End::Phantom { name, .. } => name.clone(),
        };
        // y takes the listener's name; x connects.
        let (x, y) = if name_of(&b).is_some() {
            (a, b)
        } else {
            (b, a)
        };
        let i = match (&x, &y) {
            (End::Real(i), _) | (_, End::Real(i)) => *i,
            _ => {
                return Err(Error::BadImage(
                    "a connection between two closed sockets".into(),
                ))
            }
        };
        let name = name_of(&y).ok_or_else(|| self.err(i, "a named pair has no name"))?;
        let ty = sock_type_raw(self.sock(i).sock_type) | NEW;
        let cred = |e: &End| match e {
            End::Real(k) => self.sock(*k).peer_cred.clone(),
            End::Phantom { .. } => None,
        };
        let (listen_cred, connect_cred) = (cred(&x), cred(&y));
        let xfd = sk::socket(libc::AF_UNIX, ty, 0).map_err(|e| self.err(i, e))?;
        if let End::Real(k) = x {
            if let Some(own) = self.sock(k).local.clone() {
                let file = self.sock(k).path_file.clone();
                self.bind_unix(k, xfd.as_raw_fd(), &own, file.as_ref())?;
                self.bound.insert(k);
            }
        }
        let t = sk::socket(libc::AF_UNIX, ty, 0).map_err(|e| self.err(i, e))?;
        let file = match &y {
            End::Real(k) => self.sock(*k).path_file.clone(),
            End::Phantom { .. } => None,
        }
        .unwrap_or(SocketFile {
            deleted: true,
            ..Default::default()
        });
        self.bind_unix(i, t.as_raw_fd(), &name, Some(&file))?;
        let raw = match &name {
            SockAddr::UnixPath(p) => encode_addr(&SockAddr::UnixPath(
                Self::full_path(p, Some(&file)).into_os_string().into_vec(),
            )),
            other => encode_addr(other),
        };
        let (tfd, xraw) = (t.as_raw_fd(), xfd.as_raw_fd());
        let listen = HelperOp::Listen {
            fd: tfd,
            backlog: 1,
        };
        let connect = HelperOp::Connect {
            fd: xraw,
            addr: &raw,
        };
        if listen_cred == connect_cred {
            let r = self.as_cred(listen_cred.as_ref(), &[listen, connect]);
            self.check(i, "listen", &r[0])?;
            self.check(i, &format!("connect to {}", describe(&name)), &r[1])?;
        } else {
            let r = self.as_cred(listen_cred.as_ref(), &[listen]);
            self.check(i, "listen", &r[0])?;
            let r = self.as_cred(connect_cred.as_ref(), &[connect]);
            self.check(i, &format!("connect to {}", describe(&name)), &r[0])?;
        }
        let yfd = sk::accept(tfd, NEW).map_err(|e| self.err(i, format!("accept: {e}")))?;
        drop(t);
        let real = |e: &End| match e {
            End::Real(k) => Some(*k),
            End::Phantom { .. } => None,
        };
        let (xr, yr) = (real(&x), real(&y));
        for (end, fd) in [(&x, xfd), (&y, yfd)] {
            match end {
                End::Real(k) => {
                    self.fds[*k] = Some(fd);
                    self.made_peer
                        .insert(*k, if Some(*k) == xr { yr } else { xr });
                }
                End::Phantom { owner, .. } => self.phantoms.push((*owner, fd)),
            }
        }
        if let Some(k) = yr {
            self.bound.insert(k);
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
            let domain = match s.family {
                SockFamily::Unix => libc::AF_UNIX,
                SockFamily::Inet => libc::AF_INET,
                SockFamily::Inet6 => libc::AF_INET6,
            };
            let fd = sk::socket(domain, sock_type_raw(s.sock_type) | NEW, s.protocol)
                .map_err(|e| self.err(i, format!("socket: {e}")))?;
            self.fds[i] = Some(fd);
            if s.family != SockFamily::Unix {
                self.inet(i)?;
            }
        }
        for i in 0..self.socks.len() {
            if self.fds[i].is_none() && self.sock(i).tcp.is_some() {
                self.tcp_conn(i)?;
            }
        }
        Ok(())
    }

    /// Makes the socket of an established TCP connection, with its options, in repair mode.
    /// Everything that needs the connection's addresses (its name, its sequence numbers,
    /// connect, the options negotiated, both queues and the window) waits for
    /// [`Deferred::complete`]: while the tree is rebuilt, the original of a migration between
    /// nodes of one machine still owns the connection's four addresses (a socket cannot be
    /// connected, even in repair mode, where another is), and a socket bound to a listener's
    /// port would keep that listener from listening. It leaves repair mode (and sends what was
    /// never sent) once every connection of the tree is made.
    fn tcp_conn(&mut self, i: usize) -> Result<()> {
        let s = self.sock(i);
        let Some(t) = s.tcp.as_ref() else {
            return Ok(());
        };
        let (Some(local), Some(peer)) = (s.local.as_ref(), s.peer.as_ref()) else {
            return Err(self.err(i, "an established TCP connection without both addresses"));
        };
        let conn = format!("TCP connection {} -> {}", describe(local), describe(peer));
        let e =
            |what: &str, err: ferry_sys::SysError| self.err(i, format!("{conn}: {what}: {err}"));
        let domain = match s.family {
            SockFamily::Inet6 => libc::AF_INET6,
            _ => libc::AF_INET,
        };
        let fd = sk::socket(domain, libc::SOCK_STREAM | NEW, libc::IPPROTO_TCP)
            .map_err(|err| e("socket", err))?;
        let f = fd.as_raw_fd();
        // Options before repair mode: SO_REUSEADDR would undo the forced reuse it brings.
        apply_opts(f, &s.opts, false);
        sk::tcp_repair(f, sk::TCP_REPAIR_ON).map_err(|err| e("enter repair mode", err))?;
        let dup = fd
            .try_clone()
            .map_err(|err| self.err(i, format!("{conn}: dup: {err}")))?;
        self.fds[i] = Some(fd);
        let sent = t.send_queue.len() - (t.unsent as usize).min(t.send_queue.len());
        self.deferred.repairs.push(DeferredRepair {
            fd: dup,
            local: encode_addr(local),
            peer: encode_addr(peer),
            conn: (**t).clone(),
            recv: s
                .queue
                .iter()
                .flat_map(|m| m.data.iter().copied())
                .collect(),
            sent,
            opts: s.opts.clone(),
            reuseaddr: opt_int(s, SOL_SOCKET, libc::SO_REUSEADDR).unwrap_or(0),
            sndbuf: opt_int(s, SOL_SOCKET, libc::SO_SNDBUF),
            what: format!("socket:[{}]: {conn}", s.ino),
        });
        Ok(())
    }

    /// Options, name, and listen or connect, for a TCP or UDP socket. Where another socket
    /// holds the address (see [`Deferred`]), a TCP socket is bound anyway (TCP_REPAIR) and
    /// listens later; a UDP socket is bound and connected later.
    fn inet(&mut self, i: usize) -> Result<()> {
        let s = self.sock(i);
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

    /// The process of the tree that holds socket `i` and, if `pid` is given, is that process:
    /// (its PID, its fd).
    fn holder(&self, i: usize, pid: Option<i32>) -> Option<(i32, i32)> {
        let id = self.socks[i].0;
        self.holders
            .get(&id)?
            .iter()
            .copied()
            .find(|(p, _)| pid.is_none_or(|want| want == *p))
    }

    /// Whether socket `i`, whose abstract name another socket holds now, can be named at
    /// resume instead ([`DeferredName`]); why not, if it cannot.
    fn late_name_refusal(&self, i: usize) -> Option<String> {
        let s = self.sock(i);
        if s.sock_type == SockType::Dgram {
            return Some(
                "a datagram socket is reached through its name while the tree is rebuilt".into(),
            );
        }
        // Clients waiting in its queue are connected to its name: those are made at resume.
        let waiting: HashSet<u64> = match &s.state {
            SockState::Listening { pending, .. } => pending.iter().map(|c| c.client_ino).collect(),
            _ => HashSet::new(),
        };
        let reached = (0..self.socks.len()).any(|j| {
            let o = self.sock(j);
            j != i
                && !waiting.contains(&o.ino)
                && o.family == SockFamily::Unix
                && matches!(o.state, SockState::Connected { .. })
                && (o.local == s.local || o.peer == s.local)
        });
        if reached {
            return Some("connections made through its name are rebuilt through it".into());
        }
        let Some(_) = self.holder(i, None) else {
            return Some("no process of the tree holds it".into());
        };
        if let SockState::Listening { pending, .. } = &s.state {
            if let Some(c) = &s.peer_cred {
                if self.holder(i, Some(c.pid)).is_none() {
                    return Some(format!(
                        "PID {}, which made it listen, does not hold it in the tree",
                        c.pid
                    ));
                }
            }
            for c in pending {
                let client = self.by_ino.get(&c.client_ino).copied();
                let ok = match (client, &c.cred) {
                    (Some(ci), Some(cred)) => self.holder(ci, Some(cred.pid)).is_some(),
                    (Some(ci), None) => self.holder(ci, None).is_some(),
                    (None, _) => false,
                };
                if !ok {
                    return Some(
                        "a connection waits in its queue whose client is not held by the \
                         process that connected it"
                            .into(),
                    );
                }
            }
        }
        None
    }

    fn can_name_late(&self, i: usize) -> bool {
        self.late_name_refusal(i).is_none()
    }

    /// Leaves the naming of socket `i` (and its listening, and its waiting connections) to
    /// [`Deferred::complete`].
    fn name_late(&mut self, i: usize) -> Result<()> {
        let s = self.sock(i);
        let Some(local) = &s.local else {
            return Ok(());
        };
        let (pid, fd) = match (&s.state, &s.peer_cred) {
            (SockState::Listening { .. }, Some(c)) => self.holder(i, Some(c.pid)),
            _ => self.holder(i, None),
        }
        .ok_or_else(|| self.err(i, "no process of the tree holds it"))?;
        let mut name = DeferredName {
            pid,
            fd,
            addr: encode_addr(local),
            backlog: None,
            clients: Vec::new(),
            what: format!("socket:[{}] (fd {fd}): name {}", s.ino, describe(local)),
        };
        if let SockState::Listening { backlog, pending } = &s.state {
            name.backlog = Some(*backlog as i32);
            for c in pending {
                let ci = self.waiting_client(i, c.client_ino)?;
                let (cpid, cfd) = self
                    .holder(ci, c.cred.as_ref().map(|c| c.pid))
                    .ok_or_else(|| self.err(ci, "no process of the tree holds it"))?;
                name.clients.push(DeferredClient {
                    pid: cpid,
                    fd: cfd,
                    socket: self.dup(ci)?,
                    data: c.queue.iter().map(|m| m.data.clone()).collect(),
                    records: s.sock_type == SockType::Seqpacket,
                });
            }
        }
        self.bound.insert(i);
        self.deferred.names.push(name);
        Ok(())
    }

    /// The client (socket `client_ino` of the tree) of a connection waiting in listener `i`'s
    /// queue, bound to its own name if it has one, and marked as connected by that connection.
    fn waiting_client(&mut self, i: usize, client_ino: u64) -> Result<usize> {
        let ci = self.by_ino.get(&client_ino).copied().ok_or_else(|| {
            self.err(
                i,
                format!("waiting client socket:[{client_ino}] is not in the image"),
            )
        })?;
        if !self.bound.contains(&ci) {
            self.bind_own(ci)?;
        }
        self.made_peer.insert(ci, None);
        Ok(ci)
    }

    fn bind_own(&mut self, i: usize) -> Result<()> {
        let s = self.sock(i);
        if let Some(a) = &s.local {
            let fd = self.fd(i);
            self.bind_unix(i, fd, a, s.path_file.as_ref())?;
        }
        self.bound.insert(i);
        Ok(())
    }

    /// The raw address that reaches UNIX socket `i` by its name (a relative path made
    /// absolute when that fits).
    fn reachable(&self, i: usize) -> Option<Vec<u8>> {
        let s = self.sock(i);
        match &s.local {
            Some(SockAddr::UnixPath(p)) => {
                let full = Self::full_path(p, s.path_file.as_ref())
                    .into_os_string()
                    .into_vec();
                Some(encode_addr(&SockAddr::UnixPath(if full.len() < 108 {
                    full
                } else {
                    p.clone()
                })))
            }
            Some(a) => Some(encode_addr(a)),
            None => None,
        }
    }

    /// Binds the UNIX sockets that have names (those whose files were removed first) and makes
    /// listeners listen, with the connections waiting in their queues (and what they carry).
    fn bind_and_listen(&mut self) -> Result<()> {
        let mut order: Vec<usize> = (0..self.socks.len())
            .filter(|&i| {
                let s = self.sock(i);
                s.family == SockFamily::Unix && s.local.is_some() && !self.bound.contains(&i)
            })
            .collect();
        order.sort_by_key(|&i| !self.sock(i).path_file.as_ref().is_some_and(|f| f.deleted));
        for i in order {
            if !self.bound.contains(&i) {
                self.bind_own(i)?;
            }
        }
        let mut late: Vec<usize> = self.late_names.iter().copied().collect();
        late.sort_unstable();
        for i in late {
            self.name_late(i)?;
        }
        for i in 0..self.socks.len() {
            let s = self.sock(i);
            if s.family != SockFamily::Unix {
                continue;
            }
            let SockState::Listening { backlog, pending } = &s.state else {
                continue;
            };
            if self.late_names.contains(&i) {
                continue;
            }
            let fd = self.fd(i);
            let r = self.as_cred(
                s.peer_cred.as_ref(),
                &[HelperOp::Listen {
                    fd,
                    backlog: *backlog as i32,
                }],
            );
            self.check(i, "listen", &r[0])?;
            if pending.is_empty() {
                continue;
            }
            let raw = self.reachable(i).ok_or_else(|| {
                self.err(i, "connections wait on a listening socket without a name")
            })?;
            let ty = sock_type_raw(s.sock_type) | NEW;
            for c in pending {
                let (cfd, throwaway) = if c.client_ino == 0 {
                    let t = sk::socket(libc::AF_UNIX, ty, 0).map_err(|e| self.err(i, e))?;
                    (t.as_raw_fd(), Some(t))
                } else {
                    let ci = self.waiting_client(i, c.client_ino)?;
                    (self.fd(ci), None)
                };
                let r = self.as_cred(
                    c.cred.as_ref(),
                    &[HelperOp::Connect {
                        fd: cfd,
                        addr: &raw,
                    }],
                );
                self.check(i, "connect a waiting client", &r[0])?;
                let data: Vec<(Vec<u8>, Vec<OwnedFd>)> = c
                    .queue
                    .iter()
                    .map(|m| (m.data.clone(), Vec::new()))
                    .collect();
                write_all(self.me, cfd, &data, s.sock_type == SockType::Seqpacket)?;
                drop(throwaway);
            }
        }
        Ok(())
    }

    /// Datagram sockets connected to named sockets of the tree; pair ends that were connected
    /// elsewhere (or nowhere) afterwards.
    fn connect_dgrams(&mut self) -> Result<()> {
        for i in 0..self.socks.len() {
            let s = self.sock(i);
            if s.family != SockFamily::Unix || s.sock_type != SockType::Dgram {
                continue;
            }
            if matches!(s.state, SockState::Connected { peer_ino: 0 }) {
                continue;
            }
            let fd = self.fd(i);
            let want = self.peer_of(i);
            let made = self.made_peer.get(&i).copied();
            match (want, made) {
                (Some(j), Some(Some(k))) if j == k => {}
                (Some(j), _) => {
                    let raw = self
                        .reachable(j)
                        .ok_or_else(|| self.err(i, "it is connected to an unnamed socket"))?;
                    sk::connect(fd, &raw).map_err(|e| {
                        self.err(i, format!("connect to socket:[{}]: {e}", self.sock(j).ino))
                    })?;
                }
                (None, Some(_)) => {
                    // Made as one end of a pair, but connected nowhere since.
                    let _ = sk::connect(fd, &(libc::AF_UNSPEC as u16).to_ne_bytes());
                }
                (None, None) => {}
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
                        self.send_one(r, p, &m.data, None, s.sock_type == SockType::Seqpacket)?;
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
                            self.send_one(r, p, &m.data, dest, true)?;
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
                                self.send_one(r, f, &m.data, Some(&to), true)?;
                            }
                            None => {
                                let t = self.temp_sender(r, m.from.as_ref())?;
                                bump_sndbuf(t.as_raw_fd(), m.data.len());
                                self.send_one(r, t.as_raw_fd(), &m.data, Some(&to), true)?;
                            }
                        }
                    }
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
                            self.send_one(r, f, &m.data, Some(&raw_to), true)?;
                        } else if let Some(t) = m.from.as_ref().and_then(|f| self.inet_temp(r, f)) {
                            self.send_one(r, t.as_raw_fd(), &m.data, Some(&raw_to), true)?;
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
                            self.send_one(r, f, &m.data, Some(&raw_to), true)?;
                        }
                    }
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Queues socket `r`'s datagrams for [`Deferred::complete`], each with a copy of its
    /// sender (or a throwaway socket, as [`Builder::fill_queues`] would send it from).
    fn defer_datagrams(&mut self, r: usize, to: &[u8]) -> Result<()> {
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

    fn send_one(
        &self,
        r: usize,
        from: RawFd,
        data: &[u8],
        to: Option<&[u8]>,
        record: bool,
    ) -> Result<()> {
        let mut at = 0;
        loop {
            let n = sk::send(from, &data[at..], to, &[], libc::MSG_DONTWAIT)
                .map_err(|e| self.err(r, format!("queue {} bytes again: {e}", data.len())))?;
            at += n;
            if record || at >= data.len() {
                return Ok(());
            }
        }
    }

    /// The datagram socket of the tree bound to UNIX name `from`, if any.
    fn unix_sender(&self, from: Option<&SockAddr>) -> Option<usize> {
        let from = from.filter(|f| **f != SockAddr::UnixUnnamed)?;
        (0..self.socks.len()).find(|&j| {
            let s = self.sock(j);
            s.family == SockFamily::Unix
                && s.sock_type == SockType::Dgram
                && s.local.as_ref() == Some(from)
        })
    }

    /// A throwaway datagram socket to send from: bound to `from` when that name is free.
    fn temp_sender(&mut self, r: usize, from: Option<&SockAddr>) -> Result<OwnedFd> {
        let t = sk::socket(libc::AF_UNIX, libc::SOCK_DGRAM | NEW, 0).map_err(|e| self.err(r, e))?;
        match from {
            Some(a @ SockAddr::UnixAbstract(_)) => {
                let _ = sk::bind(t.as_raw_fd(), &encode_addr(a));
            }
            Some(a @ SockAddr::UnixPath(p)) if p.first() == Some(&b'/') => {
                let path = PathBuf::from(OsStr::from_bytes(p));
                if std::fs::symlink_metadata(&path).is_err()
                    && sk::bind(t.as_raw_fd(), &encode_addr(a)).is_ok()
                {
                    self.remove_later.push(path);
                }
            }
            _ => {}
        }
        Ok(t)
    }

    /// The UDP socket of the tree a datagram from `from` came from, if any.
    fn inet_sender(&self, from: &SockAddr) -> Option<usize> {
        (0..self.socks.len()).find(|&j| {
            let s = self.sock(j);
            s.family != SockFamily::Unix
                && s.sock_type == SockType::Dgram
                && s.local.as_ref().is_some_and(|l| same_endpoint(l, from))
        })
    }

    /// A throwaway UDP socket bound to `from`, if that address can be had.
    fn inet_temp(&self, r: usize, from: &SockAddr) -> Option<OwnedFd> {
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

    /// Stand-ins for closed peers go; then shutdowns, options and peek offsets.
    fn finish(&mut self) {
        for (owner, p) in std::mem::take(&mut self.phantoms) {
            let s = self.sock(owner);
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
            }
            set_peek_off(fd, s);
        }
    }
}

/// `a` with an unspecified address replaced by loopback: where to send to reach a socket
/// bound to the wildcard address.
fn loopback_if_any(a: &SockAddr) -> SockAddr {
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
fn same_endpoint(local: &SockAddr, from: &SockAddr) -> bool {
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
