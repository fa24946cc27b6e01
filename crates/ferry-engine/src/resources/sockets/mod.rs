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
//! One file per family, as CRIU keeps sk-unix.c, sk-inet.c and sk-tcp.c apart: `unix` the UNIX
//! sockets, `inet` what TCP and UDP share, `tcp` the TCP repair-mode work, `udp` the UDP
//! datagrams, `ping` the ICMP echo sockets, `raw` and `packet` those that see raw packets,
//! `netlink` the kernel's, `filter` the attached socket filters, `relayed` the sockets a
//! migrated tree keeps at home, and `scm` the descriptors in flight in UNIX sockets' queues
//! (SCM_RIGHTS). The shared plumbing has files of its own: `addr` the addresses, `opts` the
//! options, `capture` the capture of one descriptor ([`classify`]) and the check of the whole
//! tree ([`finish_capture`]), `build` the rebuild ([`open`] and its `Builder`), and `deferred`
//! what the rebuild leaves until the tree is about to run ([`Deferred`]).

mod addr;
mod build;
mod capture;
mod deferred;
mod filter;
mod inet;
mod netlink;
mod opts;
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
use addr::*;
use build::*;
use capture::*;
use deferred::*;
use ferry_image::{
    FileDesc, FileKind, NetlinkState, PacketState, PeerCred, PendingConn, Process, Shutdown,
    SockAddr, SockFamily, SockFilter, SockMsg, SockOpt, SockState, SockType, SocketDesc,
    SocketFile, TcpConn, TcpWindow, Tree,
};
use ferry_sys::fsid::{with_fs_creds, FsCreds};
use ferry_sys::sockets::{self as sk, HelperCred, HelperOp};
use ferry_sys::{fdops, pidfd};
use inet::*;
use opts::*;
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

pub(crate) use addr::same_dev;
pub use addr::{decode_addr, describe, encode_addr};
pub use build::{after_install, open, take_relayed};
pub use capture::{classify, finish_capture};
pub use deferred::Deferred;
pub use packet::{check_ring_mappings, ring_socket};
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
const TCP_INFO_LEN: usize = 104;
/// tcpi_options bits.
const TCPI_OPT_TIMESTAMPS: u8 = 1;
const TCPI_OPT_SACK: u8 = 2;
const TCPI_OPT_WSCALE: u8 = 4;
/// A stream chunk or datagram is peeked in pieces of at most this many bytes.
const PEEK_CHUNK: usize = 1 << 20;
