//! Relays: a moved tree's pipes, terminal and UNIX sockets (stream, datagram, seqpacket) to
//! processes that stayed at home (the two-way kinds, terminals and sockets, are in
//! `pump_duplex`).
//!
//! A pipe the tree shares with a process outside it (one stage of a shell pipeline moved, the
//! others stayed) is captured as relayed (`ferry_image::Pipe::relayed`). At home, before the
//! commit, this daemon opens the home's pipe anew through the tree's descriptor of it (a
//! description of its own: nothing the relay does to it, O_NONBLOCK say, reaches the processes
//! that share the original's); the original then closes its copy as it becomes a deputy. At
//! the destination the restore makes a fresh pipe, gives the body its end, and this daemon takes
//! the other from the restore worker. After the commit the destination opens one connection to
//! the home per pipe (`RelayOpen`) and the data flows on it one way, in frames: what the home
//! side reads is written at the other, in order; end of file is `End`. Whichever side loses its
//! last reader (a write end polls POLLERR) or its connection drops its end, so that a writer on
//! the far side gets EPIPE, as it would had nothing moved.

mod duplex;

use duplex::*;
pub(crate) use duplex::{recv_record, unread_socket};

use crate::node::Node;
use crate::relay_keep::Keep;
use crate::relay_pipe::Ctl;
use crate::relay_tty;
use anyhow::{anyhow, bail, Context, Result};
use ferry_transport::frame::{
    read_frame, write_data, write_end, write_msg, write_record, FrameError,
};
use ferry_transport::message::{kind, RelayedPipe};
use ferry_transport::tls::Conn;
use ferry_transport::{Frame, Msg};
use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How often an idle datagram relay asks whether its socket's peer is gone.
const PEER_POLL: Duration = Duration::from_millis(200);
/// How long a home end waits for its body's node to connect before it is closed.
const OPEN_GRACE: Duration = Duration::from_secs(60);
/// How long a body's node asks again for a relay its home does not have for it yet.
pub(crate) const OPEN_RETRY: Duration = Duration::from_secs(20);

/// Who a relay at home sends as (SCM_CREDENTIALS: PID, user and group), on a socket: the
/// process at home that holds it (its deputy), never the daemon.
pub type Sender = (i32, u32, u32);

/// The home's end of one relay: its id (`RelayedPipe::pipe`), the descriptor, and, for a
/// socket, whom its messages come from.
pub type HomeOpen = (u32, OwnedFd, Option<Sender>);

/// The home's ends of relayed pipes, waiting for their body's node to connect, and the bytes
/// relayed so far per home PID.
#[derive(Default)]
pub struct HomeRelays {
    /// (home PID of the tree's root, pipe) -> the body's node, the home's end, what goes to
    /// that node first (returned by the node the body left), which parking this is, and whom
    /// a socket's end sends as.
    pub(crate) waiting: Mutex<HashMap<(i32, u32), Waiting>>,
    relayed: Mutex<HashMap<i32, Arc<AtomicU64>>>,
    serial: AtomicU64,
    /// The marks (crate::relay_keep) of each pipe's relay kept here, by (home PID, relay).
    pub(crate) marks: Mutex<HashMap<(i32, u32), OwnedFd>>,
    /// The pipes' relays being pumped here, by (home PID, relay): their body's node, and how
    /// to cut them (crate::relay_keep: a recovery takes them from a dead node).
    pub(crate) live: Mutex<HashMap<(i32, u32), LivePump>>,
    /// The home pipes (by inode) whose two relays are being joined (crate::relay_join).
    pub(crate) joining: Mutex<std::collections::HashSet<u64>>,
}

/// A pipe's relay being pumped at home.
pub(crate) struct LivePump {
    pub(crate) node: String,
    serial: u64,
    pub(crate) cut: Option<tokio::sync::oneshot::Sender<()>>,
    /// The home pipe's inode, whether the body reads it, the pump's control (a join), and
    /// the relay's holder's PID.
    pub(crate) ino: u64,
    pub(crate) body_reads: bool,
    pub(crate) ctl: Option<tokio::sync::mpsc::UnboundedSender<crate::relay_pipe::HomeCtl>>,
    pub(crate) holder: Option<i32>,
    /// When its connection was taken (a connection that only hands the relay over lasts
    /// moments: no join is tried on it).
    pub(crate) since: std::time::Instant,
}

/// A home end taken by its body's node: the end, what goes first, whom it sends as, and a
/// pipe's buffer and holder.
type Taken = (OwnedFd, Prefix, Option<Sender>, Option<Keep>);

/// What goes to a relay's new node first (returned by the node its body left), as it came: for
/// a relay of messages (datagrams, seqpacket), one message each.
pub(crate) type Prefix = Vec<Vec<u8>>;

pub(crate) struct Waiting {
    pub(crate) node: String,
    pub(crate) fd: OwnedFd,
    pub(crate) prefix: Prefix,
    serial: u64,
    pub(crate) sender: Option<Sender>,
    pub(crate) keep: Option<Keep>,
}

impl HomeRelays {
    /// Keeps `ends` for the tree rooted at home PID `pid`, whose body runs on `body_node`;
    /// an end its body's node has not asked for within a minute is closed.
    /// A pipe's end gets a buffer and a holder (crate::relay_keep), so that its relay outlives
    /// this daemon.
    pub fn expect(self: &Arc<Self>, node: &Node, pid: i32, body_node: &str, ends: Vec<HomeOpen>) {
        for (pipe, fd, sender) in ends {
            // A stream socket's or a terminal's relay is kept as two pipes'
            // (crate::relay_keep::keep_two_way).
            if crate::relay_keep::two_ways(pipe, &fd).is_some() {
                match crate::relay_keep::keep_two_way(node, pid, pipe, body_node, &fd, sender) {
                    Ok(ways) => {
                        for (way, end, keep) in ways {
                            self.park_as(pid, way, body_node, end, Vec::new(), None, Some(keep));
                        }
                        continue;
                    }
                    Err(e) => {
                        tracing::warn!(event = "relay-keep-failed", pid, pipe,
                            error = %format!("{e:#}"), "this relay ends if the daemon does");
                    }
                }
            }
            let keep = if duplex_of(pipe).is_none() {
                match Keep::new(node, pid, pipe, body_node, &fd) {
                    Ok(k) => Some(k),
                    Err(e) => {
                        tracing::warn!(event = "relay-keep-failed", pid, pipe,
                            error = %format!("{e:#}"));
                        None
                    }
                }
            } else {
                None
            };
            self.park_as(pid, pipe, body_node, fd, Vec::new(), sender, keep);
        }
    }

    /// Keeps the home's end `fd` of pipe relay `pipe` of home PID `pid`, with its buffer and
    /// holder, for node `body_node` (which dials again after a restart of this daemon, or
    /// asks for it after a move on).
    pub fn park_kept(
        self: &Arc<Self>,
        pid: i32,
        pipe: u32,
        body_node: &str,
        fd: OwnedFd,
        keep: Keep,
    ) {
        keep.moved(pid, pipe, body_node);
        self.park_as(pid, pipe, body_node, fd, Vec::new(), None, Some(keep));
    }

    /// Keeps the home's end `fd` of pipe relay `pipe` of home PID `pid`, joined on node
    /// `body_node` (crate::relay_join), with its buffer and holder, for as long as the join
    /// lasts: taken again by that node when either body moves on, or ended with the tree's
    /// deputies.
    pub fn park_joined(
        self: &Arc<Self>,
        pid: i32,
        pipe: u32,
        body_node: &str,
        fd: OwnedFd,
        keep: Keep,
    ) {
        keep.joined(pid, pipe, body_node);
        let serial = self.serial.fetch_add(1, Ordering::Relaxed);
        if let Ok(m) = keep.marks() {
            self.marks
                .lock()
                .expect("relays lock")
                .insert((pid, pipe), m);
        }
        self.waiting.lock().expect("relays lock").insert(
            (pid, pipe),
            Waiting {
                node: body_node.to_string(),
                fd,
                prefix: Vec::new(),
                serial,
                sender: None,
                keep: Some(keep),
            },
        );
    }

    /// Ends every relay of the tree rooted at home PID `root` still waiting for its body's
    /// node (its deputies are gone: no body will ask).
    pub fn forget_tree(&self, root: i32) {
        let gone: Vec<(u32, Waiting)> = {
            let mut w = self.waiting.lock().expect("relays lock");
            let keys: Vec<(i32, u32)> = w.keys().filter(|k| k.0 == root).copied().collect();
            keys.into_iter()
                .filter_map(|k| w.remove(&k).map(|x| (k.1, x)))
                .collect()
        };
        for (pipe, x) in gone {
            tracing::info!(event = "relay-dropped", pid = root, pipe, body = %x.node,
                "its tree's deputies are gone");
            if let Some(k) = x.keep {
                k.release(root, pipe);
            }
        }
        self.marks
            .lock()
            .expect("relays lock")
            .retain(|k, _| k.0 != root);
    }

    /// Keeps the home's end `fd` of relay `pipe` of home PID `pid` for node `body_node`, which
    /// gets `prefix` first (a body moving on: what its last node returned); closed if that node
    /// has not asked for it within a minute. A socket's end sends as `sender`; a pipe's comes
    /// with its buffer and holder.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn park_as(
        self: &Arc<Self>,
        pid: i32,
        pipe: u32,
        body_node: &str,
        fd: OwnedFd,
        prefix: Prefix,
        sender: Option<Sender>,
        keep: Option<Keep>,
    ) {
        let serial = self.serial.fetch_add(1, Ordering::Relaxed);
        if let Some(m) = keep.as_ref().and_then(|k| k.marks().ok()) {
            self.marks
                .lock()
                .expect("relays lock")
                .insert((pid, pipe), m);
        }
        self.waiting.lock().expect("relays lock").insert(
            (pid, pipe),
            Waiting {
                node: body_node.to_string(),
                fd,
                prefix,
                serial,
                sender,
                keep,
            },
        );
        let me = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(OPEN_GRACE).await;
            let mut w = me.waiting.lock().expect("relays lock");
            if w.get(&(pid, pipe)).is_some_and(|x| x.serial == serial) {
                let x = w.remove(&(pid, pipe));
                drop(w);
                tracing::warn!(event = "relay-never-opened", pid, pipe);
                if let Some(k) = x.and_then(|x| x.keep) {
                    k.release(pid, pipe);
                }
            }
        });
    }

    /// The end of pipe `pipe` of home PID `pid`, for node `from`, which must be where its body
    /// runs (a node speaks only for itself).
    fn take(&self, from: &str, pid: i32, pipe: u32) -> Result<Taken> {
        let mut w = self.waiting.lock().expect("relays lock");
        match w.get(&(pid, pipe)) {
            None => bail!("no pipe {pipe} of PID {pid} waits for a relay here"),
            Some(x) if x.node != from => {
                bail!(
                    "pipe {pipe} of PID {pid} is relayed to node {}, not to {from}",
                    x.node
                )
            }
            Some(_) => {
                let x = w.remove(&(pid, pipe)).expect("just seen");
                Ok((x.fd, x.prefix, x.sender, x.keep))
            }
        }
    }

    fn counter(&self, pid: i32) -> Arc<AtomicU64> {
        self.relayed
            .lock()
            .expect("relays lock")
            .entry(pid)
            .or_default()
            .clone()
    }

    /// A token for a join of two relays (crate::relay_join), never 0.
    pub(crate) fn join_token(&self) -> u64 {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        (now ^ self.serial.fetch_add(1, Ordering::Relaxed).rotate_left(48)) | 1
    }

    /// Bytes relayed so far for the tree whose home root is `pid`.
    pub fn bytes(&self, pid: i32) -> u64 {
        self.relayed
            .lock()
            .expect("relays lock")
            .get(&pid)
            .map_or(0, |c| c.load(Ordering::Relaxed))
    }
}

/// The real user and group of process `pid` (what the kernel puts in SCM_CREDENTIALS for it).
fn real_ids(pid: i32) -> Result<(u32, u32)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("read /proc/{pid}/status"))?;
    let real = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u32>().ok())
            .ok_or_else(|| anyhow!("no {key} in /proc/{pid}/status"))
    };
    Ok((real("Uid:")?, real("Gid:")?))
}

/// Opens, at home, a description of its own of each pipe the tree shares with processes
/// outside it, through the (frozen) process's descriptor: the end the tree holds. A socket's
/// end sends as the process that holds it (its PID and real ids).
pub fn open_home_ends(relays: &[RelayedPipe]) -> Result<Vec<HomeOpen>> {
    relays
        .iter()
        .map(|r| {
            if r.pipe & ferry_image::RELAY_SOCKET != 0 {
                // A socket cannot be opened again: the relay takes the process's own
                // description (the deputy then closes its descriptor of it).
                let fd = ferry_sys::pidfd::pidfd_open(r.pid)
                    .and_then(|p| ferry_sys::pidfd::pidfd_getfd(&p, r.fd))
                    .map_err(|e| {
                        anyhow!(
                            "PID {} fd {}: take its socket for relaying: {e}",
                            r.pid,
                            r.fd
                        )
                    })?;
                // A UNIX socket's messages carry their sender (SCM_CREDENTIALS).
                let domain = ferry_sys::sockets::getsockopt_int(
                    fd.as_raw_fd(),
                    libc::SOL_SOCKET,
                    libc::SO_DOMAIN,
                );
                let sender = match domain {
                    Ok(libc::AF_UNIX) => {
                        let (uid, gid) = real_ids(r.pid)?;
                        Some((r.pid, uid, gid))
                    }
                    _ => None,
                };
                return Ok((r.pipe, fd, sender));
            }
            let acc = if r.tty {
                libc::O_RDWR | libc::O_NOCTTY
            } else if r.body_reads {
                libc::O_RDONLY
            } else {
                libc::O_WRONLY
            };
            let fd = ferry_sys::fdops::open_path(
                &format!("/proc/{}/fd/{}", r.pid, r.fd),
                acc | libc::O_NONBLOCK | libc::O_CLOEXEC,
                0,
            )
            .map_err(|e| {
                anyhow!(
                    "PID {} fd {}: open the home's end of its pipe for relaying: {e}",
                    r.pid,
                    r.fd
                )
            })?;
            if r.tty {
                relay_tty::remember_tty_start(&fd, false);
            }
            Ok((r.pipe, fd, None))
        })
        .collect()
}

/// The inode of descriptor `fd` (0 if it cannot be read).
pub(crate) fn inode_of(fd: &OwnedFd) -> u64 {
    use std::os::unix::fs::MetadataExt as _;
    fd.try_clone()
        .map(std::fs::File::from)
        .and_then(|f| f.metadata())
        .map_or(0, |m| m.ino())
}

/// Takes the relay's ends of relayed pipes from the restore worker `worker` (its descriptor
/// numbers, by pipe).
pub fn take_from_worker(worker: i32, ends: &[(u32, i32)]) -> Result<Vec<(u32, OwnedFd)>> {
    if ends.is_empty() {
        return Ok(Vec::new());
    }
    let pidfd = ferry_sys::pidfd::pidfd_open(worker)
        .map_err(|e| anyhow!("open a pidfd of restore worker {worker}: {e}"))?;
    ends.iter()
        .map(|&(pipe, n)| {
            let fd = ferry_sys::pidfd::pidfd_getfd(&pidfd, n).map_err(|e| {
                anyhow!("take the relay's end of pipe {pipe} (fd {n}) from restore worker {worker}: {e}")
            })?;
            let fl = ferry_sys::fdops::get_fl(fd.as_raw_fd())
                .and_then(|fl| ferry_sys::fdops::set_fl(fd.as_raw_fd(), fl | libc::O_NONBLOCK))
                .map(|_| ());
            fl.map_err(|e| anyhow!("make the relay's end of pipe {pipe} non-blocking: {e}"))?;
            if pipe & ferry_image::RELAY_TTY != 0 {
                relay_tty::remember_tty_start(&fd, true);
            }
            Ok((pipe, fd))
        })
        .collect()
}

/// At the body's node, after the commit: connects each relay end to the tree's home. A relay
/// that follows a body moving on may not be ready at home yet (its last node hands it over
/// meanwhile): asked again for a while.
pub fn dial_home(node: Arc<Node>, home: String, pid: i32, ends: Vec<(u32, OwnedFd)>) {
    for (pipe, fd) in ends {
        let node = node.clone();
        let home = home.clone();
        let mut reg = node.body_relays.register(&home, pid, pipe, &fd);
        tokio::spawn(async move {
            let r = async {
                if home == node.name() {
                    return attach_at_home(&node, pid, pipe, fd, reg.ctl.take()).await;
                }
                if node.fault_at("relay-dial-late") {
                    // The body runs a while before its relays do (a node under load).
                    tokio::time::sleep(Duration::from_secs(2)).await;
                }
                if duplex_of(pipe).is_none() {
                    let ctl = reg.ctl.take();
                    return crate::relay_pipe::body_relay(&node, &home, pid, pipe, fd, ctl).await;
                }
                if crate::relay_keep::two_ways(pipe, &fd).is_some() {
                    let ctl = reg.ctl.take();
                    return crate::relay_pipe::body_socket(&node, &home, pid, pipe, fd, ctl, None)
                        .await;
                }
                let deadline = tokio::time::Instant::now() + OPEN_RETRY;
                let conn = loop {
                    let mut conn = node.dial(&home).await?;
                    let open = Msg::RelayOpen {
                        pid,
                        pipe,
                        at: None,
                    };
                    write_msg(&mut conn.stream, &open).await?;
                    match ferry_transport::frame::read_msg(&mut conn.stream).await {
                        Ok(Msg::Done) => break conn,
                        Ok(Msg::Error { message }) => {
                            if tokio::time::Instant::now() > deadline {
                                bail!("node {home}: {message}");
                            }
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                        Ok(other) => bail!("node {home} answered {}", kind(&other)),
                        Err(e) => bail!("node {home} did not answer: {e}"),
                    }
                };
                let mode = duplex_of(pipe).expect("a two-way relay");
                let ctl = reg.ctl.take();
                let end = pump_duplex(conn.stream, fd, mode, None, None, Vec::new(), ctl);
                match end.await? {
                    DuplexEnd::Closed(n) | DuplexEnd::HandedOff(n) => Ok(n),
                    DuplexEnd::Handoff { .. } => bail!("relay {pipe} moved on from home"),
                }
            }
            .await;
            node.body_relays.forget(&home, pid, &reg);
            match r {
                Ok(bytes) => tracing::info!(event = "relay-closed", home = %home, pid, pipe, bytes),
                // The body sees end of file, or EPIPE, as it would had its peer gone.
                Err(e) => tracing::warn!(event = "relay-failed", home = %home, pid, pipe,
                    error = %format!("{e:#}")),
            }
        });
    }
}

/// At home: node `conn.peer` asks for pipe `pipe` of home PID `pid`; on a pipe's relay, it
/// stands at `at` (it dials again).
pub async fn serve_open(
    node: &Arc<Node>,
    mut conn: Conn,
    pid: i32,
    pipe: u32,
    at: Option<u64>,
) -> Result<()> {
    let (fd, prefix, sender, keep) = match node.relays.take(&conn.peer, pid, pipe) {
        Ok(x) => x,
        Err(e) => {
            let message = format!("{e:#}");
            write_msg(&mut conn.stream, &Msg::Error { message }).await?;
            return Err(e);
        }
    };
    let peer = conn.peer.clone();
    if duplex_of(pipe).is_some() {
        write_msg(&mut conn.stream, &Msg::Done).await?;
        return home_duplex(node, &peer, conn.stream, pid, pipe, fd, prefix, sender).await;
    }
    // A pipe's pump answers with where the relay stands.
    home_pipe(node, &peer, conn.stream, pid, pipe, fd, keep, at).await
}

/// At home: the home's end of a two-way relay (a terminal, whose input is read only while the
/// tree rooted at `pid` has it in the foreground, or a socket that sends as `sender`) pumped to
/// the body on `peer` (`prefix` first); if the body moves on, the end waits for its next node.
#[allow(clippy::too_many_arguments)]
async fn home_duplex<S>(
    node: &Arc<Node>,
    peer: &str,
    stream: S,
    pid: i32,
    pipe: u32,
    fd: OwnedFd,
    prefix: Prefix,
    sender: Option<Sender>,
) -> Result<()>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let mode = match duplex_of(pipe) {
        Some(Duplex::Tty { .. }) => Duplex::Tty { gate: Some(pid) },
        Some(mode) => mode,
        None => bail!("relay {pipe} is a pipe's"),
    };
    let counter = Some(node.relays.counter(pid));
    match pump_duplex(stream, fd, mode, sender, counter, prefix, None).await? {
        DuplexEnd::Closed(bytes) | DuplexEnd::HandedOff(bytes) => {
            tracing::info!(event = "relay-closed", body = %peer, pid, pipe, bytes);
        }
        DuplexEnd::Handoff {
            bytes,
            to,
            prefix,
            fd,
        } => {
            // The body moved on: its new node asks for this end next. A terminal's settings
            // and size now (the body frozen) are what the next relay compares against.
            tracing::info!(event = "relay-moves-on", from = %peer, to = %to, pid, pipe,
                bytes, returned = prefix.iter().map(Vec::len).sum::<usize>());
            if pipe & ferry_image::RELAY_TTY != 0 {
                relay_tty::remember_tty_start(&fd, false);
            }
            node.relays
                .park_as(pid, pipe, &to, fd, prefix, sender, None);
        }
    }
    Ok(())
}

/// At home: pumps a pipe's relay between the home's end `fd` (with its buffer and holder) and
/// the body on `peer`, which stands at `at` if it dials again; if the body moves on, or the
/// connection breaks, the end waits for the body's (next) node.
#[allow(clippy::too_many_arguments)]
async fn home_pipe<S>(
    node: &Arc<Node>,
    peer: &str,
    stream: S,
    pid: i32,
    pipe: u32,
    fd: OwnedFd,
    keep: Option<Keep>,
    at: Option<u64>,
) -> Result<()>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    use crate::relay_pipe::{home_pump, HomeEnd};
    let keep = match keep {
        Some(k) => k,
        None => Keep::new(node, pid, pipe, peer, &fd)?,
    };
    let counter = node.relays.counter(pid);
    let ours = fd
        .try_clone()
        .with_context(|| format!("keep the home's end of pipe {pipe} of PID {pid}"))?;
    let buf = keep.buf()?;
    let marks = keep.marks()?;
    // A recovery may cut the pump (its body's node is dead, the connection not known broken
    // yet): the relay's state is in its buffer and marks, whatever point it stops at.
    let (cut, cut_rx) = tokio::sync::oneshot::channel::<()>();
    let serial = node.relays.serial.fetch_add(1, Ordering::Relaxed);
    let (ctl, ctl_rx) = tokio::sync::mpsc::unbounded_channel();
    let body_reads = ferry_sys::fdops::get_fl(fd.as_raw_fd())
        .is_ok_and(|fl| fl & libc::O_ACCMODE == libc::O_RDONLY);
    node.relays.live.lock().expect("relays lock").insert(
        (pid, pipe),
        LivePump {
            node: peer.to_string(),
            serial,
            cut: Some(cut),
            ino: inode_of(&fd),
            body_reads,
            ctl: Some(ctl),
            holder: keep.holder_pid(),
            since: std::time::Instant::now(),
        },
    );
    crate::relay_join::try_join(node, pid, pipe);
    let pumped = tokio::select! {
        r = home_pump(stream, ours, buf, marks, at, Some(counter), Some(ctl_rx), keep.tty.as_ref().map(|t| t.0.clone())) => r,
        Ok(()) = cut_rx => Ok(HomeEnd::Lost { bytes: 0, acked: 0 }),
    };
    {
        let mut live = node.relays.live.lock().expect("relays lock");
        if live.get(&(pid, pipe)).is_some_and(|l| l.serial == serial) {
            live.remove(&(pid, pipe));
        }
    }
    match pumped {
        Ok(HomeEnd::Closed(bytes)) => {
            tracing::info!(event = "relay-closed", body = %peer, pid, pipe, bytes);
            node.relays.unmark(pid, pipe);
            keep.release(pid, pipe);
        }
        Ok(HomeEnd::Handoff { bytes, to, acked }) => {
            // The body moved on: its new node asks for this end next.
            tracing::info!(event = "relay-moves-on", from = %peer, to = %to, pid, pipe,
                bytes, acked);
            node.relays.park_kept(pid, pipe, &to, fd, keep);
        }
        Ok(HomeEnd::Joined { bytes, release }) => {
            // Joined on the body's node: nothing more of it crosses home. The writer's end
            // stays until the reader's relay has taken all it wrote.
            let held = match release {
                Some(r) => r.await.unwrap_or(false),
                None => true,
            };
            if held {
                // Kept, unread, for as long as the join lasts: a body moving on takes its
                // relay through home again (or its tree's deputies end, and with them this).
                tracing::info!(event = "relay-parked-joined", body = %peer, pid, pipe, bytes,
                    "joined on its body's node");
                node.relays.park_joined(pid, pipe, peer, fd, keep);
            } else {
                tracing::warn!(event = "relay-join-undone", body = %peer, pid, pipe, bytes);
                node.relays.park_kept(pid, pipe, peer, fd, keep);
            }
        }
        Ok(HomeEnd::Lost { bytes, acked }) => {
            // Its node dials again (or its tree's deputies end, and with them this end).
            tracing::warn!(event = "relay-interrupted", body = %peer, pid, pipe, bytes, acked);
            node.relays.park_kept(pid, pipe, peer, fd, keep);
        }
        Err(e) => {
            node.relays.unmark(pid, pipe);
            keep.release(pid, pipe);
            return Err(e);
        }
    }
    Ok(())
}

/// A body at its own home (come home beside its deputies): its relay `pipe` is attached to
/// the home's end here, through an in-process stream instead of a connection.
async fn attach_at_home(
    node: &Arc<Node>,
    pid: i32,
    pipe: u32,
    fd: OwnedFd,
    ctl: Option<tokio::sync::mpsc::UnboundedReceiver<Ctl>>,
) -> Result<u64> {
    let me = node.name().to_string();
    let deadline = tokio::time::Instant::now() + OPEN_RETRY;
    if crate::relay_keep::two_ways(pipe, &fd).is_some() {
        // Its two ways, each a pipe's relay here.
        let (down, up) = crate::relay_keep::socket_ways(pipe);
        let mut streams = Vec::new();
        for way in [down, up] {
            let (home_fd, _, _, keep) = loop {
                match node.relays.take(&me, pid, way) {
                    Ok(x) => break x,
                    Err(e) if tokio::time::Instant::now() > deadline => return Err(e),
                    Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                }
            };
            let (home_end, body_end) = tokio::io::duplex(1 << 16);
            let (node2, me2) = (node.clone(), me.clone());
            tokio::spawn(async move {
                let r = home_pipe(&node2, &me2, home_end, pid, way, home_fd, keep, None).await;
                if let Err(e) = r {
                    tracing::warn!(event = "relay-failed", pid, pipe = way,
                        error = %format!("{e:#}"));
                }
            });
            streams.push(body_end);
        }
        let up_end = streams.pop().expect("two ways");
        let down_end = streams.pop().expect("two ways");
        return crate::relay_pipe::body_socket(
            node,
            &me,
            pid,
            pipe,
            fd,
            ctl,
            Some((down_end, up_end)),
        )
        .await;
    }
    let (home_fd, prefix, sender, keep) = loop {
        match node.relays.take(&me, pid, pipe) {
            Ok(x) => break x,
            Err(e) if tokio::time::Instant::now() > deadline => return Err(e),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    let (home_end, body_end) = tokio::io::duplex(1 << 16);
    let node2 = node.clone();
    tokio::spawn(async move {
        let r = if duplex_of(pipe).is_some() {
            home_duplex(&node2, &me, home_end, pid, pipe, home_fd, prefix, sender).await
        } else {
            home_pipe(&node2, &me, home_end, pid, pipe, home_fd, keep, None).await
        };
        if let Err(e) = r {
            tracing::warn!(event = "relay-failed", pid, pipe, error = %format!("{e:#}"));
        }
    });
    match (duplex_of(pipe), ctl) {
        (Some(mode), ctl) => {
            match pump_duplex(body_end, fd, mode, None, None, Vec::new(), ctl).await? {
                DuplexEnd::Closed(n) | DuplexEnd::HandedOff(n) => Ok(n),
                DuplexEnd::Handoff { .. } => bail!("relay {pipe} moved on from home"),
            }
        }
        (None, ctl) => crate::relay_pipe::body_at_home(body_end, fd, ctl).await,
    }
}
