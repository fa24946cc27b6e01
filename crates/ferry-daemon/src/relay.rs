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

/// What a two-way relay's reading thread found.
enum TtyOut {
    Data(Vec<u8>),
    Winsize([u16; 4]),
    /// The body's pty's settings changed (the body's side of a terminal's relay).
    Termios(ferry_sys::tty::Termios),
    /// End of file from our side of the descriptor.
    Eof,
    /// Our side can no longer be written (its peer is gone): the relay ends.
    Broken,
    /// A terminal's relay handed over: all there was to read is sent (see `pump_duplex`).
    Drained,
}

/// The two-way relays: a terminal (at home, `gate` is the tree's root: see `pump_duplex`), or
/// a UNIX stream socket (each way ends by itself: end of file one way is a shutdown the other).
#[derive(Clone, Copy)]
enum Duplex {
    Tty { gate: Option<i32> },
    Socket,
}

/// The kind of relay an id names (see `ferry_image::RELAY_TTY`, `RELAY_SOCKET`).
fn duplex_of(id: u32) -> Option<Duplex> {
    if id & ferry_image::RELAY_TTY != 0 {
        Some(Duplex::Tty { gate: None })
    } else if id & ferry_image::RELAY_SOCKET != 0 {
        Some(Duplex::Socket)
    } else {
        None
    }
}

/// Moves bytes both ways between `fd` and the connection. A terminal: at home `fd` is the home
/// terminal (a description of our own, not our controlling terminal) and `gate` the tree's
/// root there, whose input is read only while its group is in the foreground (else the shell
/// at home reads it) and whose window size is sent on when it changes; at the body's node `fd`
/// is the master of the body's pty; the relay ends when either side does. A socket: end of file
/// read on one side is a shutdown(SHUT_WR) on the other, and the relay ends when both ways
/// have, or a write fails. A socket of messages (datagrams, seqpacket) keeps them whole: one
/// read is one message, one `Data` frame, one send on the other side (a datagram may be empty);
/// a datagram relay ends when either side's socket finds its peer gone. On a socket, `sender`
/// is whom the messages sent here come from (SCM_CREDENTIALS: the home's process, not us).
/// `prefix` goes to the far side first (at home: what the body's last node returned when the
/// body moved on). At the body's node, `ctl` is its node's control (a terminal's relay follows
/// a body moving on: [`crate::relay_pipe::Ctl`]).
///
/// A terminal's relay moving on (docs/wire-format.md, "Moving on with relays"): the body's
/// node, told to hand it over (the body frozen, committed elsewhere), reads what is left of the
/// body's output from the pty's master and sends it, then `RelayHandoff`; it stops writing the
/// pty, reads back through the slave what the body had not read, and sends that, what its
/// writer still held, and what home sent before its answer (`RelayHandoff`, after home's last
/// data frame), then `End`. Home writes the output it got to its terminal, stops reading the
/// terminal, answers, keeps what came back for the body's next node, and ends with the
/// terminal's description ([`DuplexEnd::Handoff`]).
async fn pump_duplex<S>(
    stream: S,
    fd: OwnedFd,
    mode: Duplex,
    sender: Option<Sender>,
    counter: Option<Arc<AtomicU64>>,
    prefix: Prefix,
    mut ctl: Option<tokio::sync::mpsc::UnboundedReceiver<Ctl>>,
) -> Result<DuplexEnd>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let gate = match mode {
        Duplex::Tty { gate } => gate,
        Duplex::Socket => None,
    };
    let socket = matches!(mode, Duplex::Socket);
    let sock_type = if socket {
        ferry_sys::sockets::getsockopt_int(fd.as_raw_fd(), libc::SOL_SOCKET, libc::SO_TYPE)
            .map_err(|e| anyhow!("the type of the relayed socket: {e}"))?
    } else {
        0
    };
    let records = socket && sock_type != libc::SOCK_STREAM;
    let dgram = socket && sock_type == libc::SOCK_DGRAM;
    // The body's node's side (which its node controls), or home's.
    let body_side = ctl.is_some();
    // A socket's far side shut its way down (`End`).
    let far_shut = Arc::new(tokio::sync::Notify::new());
    let (rx, mut tx) = tokio::io::split(stream);
    for m in &prefix {
        if records {
            write_record(&mut tx, m).await?;
        } else {
            write_data(&mut tx, m).await?;
        }
    }
    if !prefix.is_empty() {
        tokio::io::AsyncWriteExt::flush(&mut tx).await?;
    }
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // A terminal's relay handed over: the reader sends what is left (at the body's node) and
    // `Drained`, and reads no more.
    let drain = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let fd = Arc::new(fd);
    let (out_tx, mut out_rx) = tokio::sync::mpsc::channel::<TtyOut>(16);
    // A terminal's window size as this side last saw or set it: a size the far side sent is
    // set under the lock and is not sent back (a stale size echoed would undo a newer one).
    let known_size: Arc<std::sync::Mutex<Option<[u16; 4]>>> = Arc::default();
    // The size of terminal `raw` if it is not `known` (which it becomes).
    let size_changed = |known: &std::sync::Mutex<Option<[u16; 4]>>, raw| {
        let mut known = known.lock().unwrap_or_else(|e| e.into_inner());
        let now = ferry_sys::tty::get_winsize(raw).ok()?;
        (known.replace(now) != Some(now)).then_some(now)
    };
    let reader = {
        let (fd, stop, out_tx) = (fd.clone(), stop.clone(), out_tx.clone());
        let drain = drain.clone();
        let known_size = known_size.clone();
        std::thread::spawn(move || {
            let raw = fd.as_raw_fd();
            let mut buf = vec![0u8; 1 << 16];
            // The body's side of a terminal: the settings of its pty, as the body sets them,
            // against those it was rebuilt with (the home's), or, if they were not read, the
            // first read here.
            let body_tty = gate.is_none() && !socket;
            let mut settings = None;
            if !socket {
                let (termios, size) = relay_tty::take_tty_start(&fd).unwrap_or_default();
                if body_tty {
                    settings = termios.or_else(|| relay_tty::slave_termios(raw));
                }
                match size {
                    Some(size) => {
                        *known_size.lock().unwrap_or_else(|e| e.into_inner()) = Some(size);
                    }
                    // The size it starts with is the home's.
                    None if body_tty => {
                        let _ = size_changed(&known_size, raw);
                    }
                    None => {}
                }
            }
            let mut checked = std::time::Instant::now();
            let mut peer_checked = std::time::Instant::now();
            while !stop.load(Ordering::Relaxed) {
                if drain.load(Ordering::Relaxed) {
                    // At the body's node (the body frozen): all it wrote that we have not
                    // read yet goes first. At home nothing more is read: what is typed waits
                    // in the terminal, what is sent in the socket, for the body's next node.
                    let mut more = body_tty || (socket && body_side);
                    while more {
                        let got = if records {
                            recv_record(raw)
                        } else if socket {
                            let mut d = Vec::with_capacity(buf.len());
                            ferry_sys::sockets::recv_append(
                                raw,
                                &mut d,
                                buf.len(),
                                libc::MSG_DONTWAIT,
                            )
                            .map(|_| d)
                        } else {
                            ferry_sys::fdops::read_fd(raw, &mut buf).map(|n| buf[..n].to_vec())
                        };
                        match got {
                            // (An empty datagram is a message: EAGAIN ends those.)
                            Ok(d) if d.is_empty() && !dgram => more = false,
                            Ok(d) => {
                                if out_tx.blocking_send(TtyOut::Data(d)).is_err() {
                                    return;
                                }
                            }
                            Err(e) if e.errno == libc::EINTR => {}
                            // EAGAIN: nothing left (a read flushes what the slave wrote
                            // first); EIO: no slave open.
                            Err(_) => more = false,
                        }
                    }
                    let _ = out_tx.blocking_send(TtyOut::Drained);
                    return;
                }
                if body_tty && checked.elapsed() >= Duration::from_millis(20) {
                    checked = std::time::Instant::now();
                    if let Some(now) = relay_tty::slave_termios(raw) {
                        if settings.as_ref() != Some(&now) {
                            settings = Some(now.clone());
                            if out_tx.blocking_send(TtyOut::Termios(now)).is_err() {
                                return;
                            }
                        }
                    }
                    // A size the body set (TIOCSWINSZ) goes home, as it would have set it
                    // there.
                    if let Some(now) = size_changed(&known_size, raw) {
                        if out_tx.blocking_send(TtyOut::Winsize(now)).is_err() {
                            return;
                        }
                    }
                }
                if let Some(root) = gate {
                    if let Some(now) = size_changed(&known_size, raw) {
                        if out_tx.blocking_send(TtyOut::Winsize(now)).is_err() {
                            return;
                        }
                    }
                    match relay_tty::in_foreground(root) {
                        Some(true) => {}
                        Some(false) => {
                            std::thread::sleep(Duration::from_millis(50));
                            continue;
                        }
                        None => break,
                    }
                }
                let wait = if body_tty { 20 } else { 100 };
                match ferry_sys::ns::poll_in(&[raw], wait) {
                    Ok(r) if r[0] => {}
                    Ok(_) => {
                        // A datagram socket hears nothing of its peer's close: ask.
                        if dgram && peer_checked.elapsed() >= PEER_POLL {
                            peer_checked = std::time::Instant::now();
                            if dgram_peer_gone(raw) {
                                let _ = out_tx.blocking_send(TtyOut::Broken);
                                return;
                            }
                        }
                        continue;
                    }
                    Err(_) => break,
                }
                // The shell may have taken the terminal back while we waited.
                if gate.is_some_and(|root| relay_tty::in_foreground(root) == Some(false)) {
                    continue;
                }
                let got = if records {
                    recv_record(raw)
                } else if socket {
                    // Read straight into the bytes to send: nothing zeroed first, no room
                    // for control messages (which a relay drops).
                    let mut d = Vec::with_capacity(buf.len());
                    ferry_sys::sockets::recv_append(raw, &mut d, buf.len(), libc::MSG_DONTWAIT)
                        .map(|_| d)
                } else {
                    ferry_sys::fdops::read_fd(raw, &mut buf).map(|n| buf[..n].to_vec())
                };
                match got {
                    // An empty datagram is a message; no more of them is a shutdown for
                    // reading (which polls POLLRDHUP).
                    Ok(d) if d.is_empty() && (!dgram || read_shut(raw)) => break,
                    Ok(d) => {
                        if out_tx.blocking_send(TtyOut::Data(d)).is_err() {
                            return;
                        }
                    }
                    Err(e) if e.errno == libc::EAGAIN || e.errno == libc::EINTR => {}
                    // EIO: the last slave closed (the body's), or the terminal hung up;
                    // ECONNRESET: the peer closed with data unread.
                    Err(_) => break,
                }
            }
            let _ = out_tx.blocking_send(TtyOut::Eof);
        })
    };
    // Bytes to write, each holding its room in the queue (`queued`: released once written);
    // `None` is end of file from the far side. The writer drains what it was given even after
    // the relay ends (the far side's last words, then its end of file), unless the relay failed.
    let abort = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let queued = Arc::new(tokio::sync::Semaphore::new(IN_QUEUE_BYTES));
    let (in_tx, mut in_rx) = tokio::sync::mpsc::unbounded_channel::<In>();
    // A terminal's relay handed over: the writer stops and gives back what it holds (the rest
    // of its chunk, and its queue).
    let hold = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (fd, stop, hold) = (fd.clone(), abort.clone(), hold.clone());
        let mut sender = sender;
        std::thread::spawn(move || {
            let raw = fd.as_raw_fd();
            let mut left = None;
            'items: while let Some(item) = in_rx.blocking_recv() {
                let data = match item {
                    In::Data((data, _room)) => data,
                    In::Shut => {
                        let _ = ferry_sys::sockets::shutdown(raw, libc::SHUT_WR);
                        continue;
                    }
                    In::Hold => break,
                };
                let mut at = 0;
                loop {
                    if stop.load(Ordering::Relaxed) {
                        break 'items;
                    }
                    if hold.load(Ordering::Relaxed) {
                        left = Some(data[at..].to_vec());
                        break 'items;
                    }
                    let put = if socket {
                        send_on(raw, &data[at..], &mut sender)
                    } else {
                        ferry_sys::fdops::write_fd(raw, &data[at..])
                    };
                    match put {
                        // A message goes whole or not at all.
                        Ok(n) => {
                            at += n;
                            if records || at >= data.len() {
                                break;
                            }
                        }
                        Err(e) if e.errno == libc::EINTR => {}
                        // Larger than this socket may send: that one is lost, as it would
                        // be had the sender met the limit itself.
                        Err(e) if records && e.errno == libc::EMSGSIZE => {
                            tracing::warn!(event = "relay-message-too-long", bytes = data.len());
                            break;
                        }
                        // A description that is non-blocking (the home's own socket, as its
                        // process set it): wait until it takes more (not a 5 ms sleep per
                        // full buffer), and look at `stop` now and then.
                        Err(e) if e.errno == libc::EAGAIN => {
                            let _ = ferry_sys::sockets::poll_wait(raw, libc::POLLOUT, 100);
                        }
                        Err(_) => {
                            let _ = out_tx.blocking_send(TtyOut::Broken);
                            break 'items;
                        }
                    }
                }
            }
            (left, in_rx)
        })
    };
    let total_in = AtomicU64::new(0);
    let count = |n: usize| {
        if let Some(c) = &counter {
            c.fetch_add(n as u64, Ordering::Relaxed);
        }
    };
    let mut writer = Some(writer);
    let mut total_out = 0u64;
    let r: Result<Ended> = {
        // The far side's frames, read by one future for the relay's life (a read cut short by
        // the other branch of the select below would lose what it had read). A frame waits
        // for room in the writer's queue before the next is read: when our side does not take
        // what is written to it, the connection is not read either, and the far side waits
        // (its reader stops reading, and so does the sender behind it).
        let frames = async {
            let mut rx = rx;
            loop {
                match read_frame(&mut rx).await {
                    // (An empty one would read as the far side's shutdown.)
                    Ok(Frame::Data(d)) if d.is_empty() && !dgram => {}
                    Ok(Frame::Data(d)) => {
                        let room = queued
                            .clone()
                            .acquire_many_owned(d.len().min(IN_QUEUE_BYTES) as u32)
                            .await
                            .map_err(|_| anyhow!("the relay's queue is closed"))?;
                        total_in.fetch_add(d.len() as u64, Ordering::Relaxed);
                        count(d.len());
                        // The frame's own buffer: no copy of it.
                        if in_tx.send(In::Data((d, room))).is_err() {
                            return Ok(FramesEnd::Closed);
                        }
                    }
                    // The home terminal's size at the body; the size the body set at home
                    // (whose terminal then signals its foreground group, which the deputy
                    // forwards, as a TIOCSWINSZ at home would).
                    Ok(Frame::Msg(Msg::RelayWinsize { size })) if !socket => {
                        let mut known = known_size.lock().unwrap_or_else(|e| e.into_inner());
                        *known = Some(size);
                        let _ = ferry_sys::tty::set_winsize(fd.as_raw_fd(), size);
                    }
                    Ok(Frame::Msg(Msg::RelayTermios {
                        iflag,
                        oflag,
                        cflag,
                        lflag,
                        line,
                        cc,
                    })) if gate.is_some() => {
                        // The body set its terminal: the home terminal takes it (its speeds
                        // kept), as a tcsetattr at home would have set it.
                        let raw = fd.as_raw_fd();
                        if let Ok(mut t) = ferry_sys::tty::get_termios(raw) {
                            (t.iflag, t.oflag, t.cflag, t.lflag, t.line) =
                                (iflag, oflag, cflag, lflag, line);
                            if cc.len() == t.cc.len() {
                                t.cc = cc;
                            }
                            if let Err(e) = ferry_sys::tty::set_termios(raw, &t) {
                                tracing::warn!(event = "relay-termios", error = %e);
                            }
                        }
                    }
                    // A terminal's relay moving on: the body's node hands it over (at home), or
                    // home answers (at the body's node); what follows is read after.
                    Ok(Frame::Msg(Msg::RelayHandoff { to })) => {
                        return Ok::<_, anyhow::Error>(FramesEnd::Handoff(to, rx));
                    }
                    Ok(Frame::Msg(m)) => bail!("{} message inside a two-way relay", kind(&m)),
                    // A socket's shutdown one way: the other way goes on (and the far side may
                    // still hand the relay over).
                    Ok(Frame::End) if socket => {
                        let _ = in_tx.send(In::Shut);
                        far_shut.notify_one();
                    }
                    Ok(Frame::End) | Err(FrameError::Closed) => return Ok(FramesEnd::Closed),
                    Err(e) => bail!("relay stream: {e}"),
                }
            }
        };
        tokio::pin!(frames);
        let (mut sent_end, mut got_end) = (false, false);
        let mut handing: Option<(String, HandoffDone)> = None;
        let (mut reader_ended, mut peer_ino) = (false, 0u64);
        let step = async {
            loop {
                if sent_end && got_end {
                    return Ok(Step::Done);
                }
                tokio::select! {
                    c = next_ctl(&mut ctl) => match c {
                        // Nothing to stop while the body is captured: what it reads or writes
                        // meanwhile stays in its pty, which the handoff empties.
                        Some(Ctl::Pause(ack)) => {
                            let _ = ack.send(Ok(0));
                        }
                        Some(Ctl::Resume) => {}
                        Some(Ctl::Handoff { to, peer, done }) => {
                            peer_ino = peer;
                            if reader_ended {
                                // Nothing more to read (the body shut its way down).
                                return Ok(Step::HandOver(to, done));
                            }
                            drain.store(true, Ordering::Relaxed);
                            handing = Some((to, done));
                        }
                        None => ctl = None,
                    },
                    out = out_rx.recv() => match out {
                        Some(TtyOut::Data(d)) => {
                            if records {
                                write_record(&mut tx, &d).await?;
                            } else {
                                write_data(&mut tx, &d).await?;
                            }
                            tokio::io::AsyncWriteExt::flush(&mut tx).await?;
                            total_out += d.len() as u64;
                            count(d.len());
                        }
                        Some(TtyOut::Winsize(size)) => {
                            write_msg(&mut tx, &Msg::RelayWinsize { size }).await?;
                        }
                        Some(TtyOut::Termios(t)) => {
                            let msg = Msg::RelayTermios {
                                iflag: t.iflag,
                                oflag: t.oflag,
                                cflag: t.cflag,
                                lflag: t.lflag & !libc::EXTPROC,
                                line: t.line,
                                cc: t.cc,
                            };
                            write_msg(&mut tx, &msg).await?;
                        }
                        Some(TtyOut::Eof) => {
                            reader_ended = true;
                            if !sent_end {
                                let _ = write_end(&mut tx).await;
                                if !socket {
                                    return Ok(Step::Done);
                                }
                                sent_end = true;
                            }
                        }
                        // Everything the frozen body wrote is sent: hand the relay over.
                        Some(TtyOut::Drained) => {
                            return Ok(match handing.take() {
                                Some((to, done)) => Step::HandOver(to, done),
                                None => Step::Done,
                            });
                        }
                        // Our writer found the far side's data can no longer be delivered, or
                        // both threads are gone.
                        Some(TtyOut::Broken) | None => return Ok(Step::Done),
                    },
                    _ = far_shut.notified(), if !got_end => got_end = true,
                    more = &mut frames => match more? {
                        FramesEnd::Closed => return Ok(Step::Done),
                        FramesEnd::Handoff(to, rx) if !body_side => {
                            return Ok(Step::Moved(to, rx));
                        }
                        FramesEnd::Handoff(..) => bail!("home sent RelayHandoff unasked"),
                    }
                }
            }
        }
        .await;
        match step {
            Err(e) => Err(e),
            Ok(Step::Done) => Ok(Ended::Closed),
            // At the body's node: every byte the frozen body wrote went before this.
            Ok(Step::HandOver(to, done)) => {
                let r = async {
                    write_msg(&mut tx, &Msg::RelayHandoff { to }).await?;
                    tokio::io::AsyncWriteExt::flush(&mut tx).await?;
                    hold.store(true, Ordering::Relaxed);
                    let _ = in_tx.send(In::Hold);
                    let w = writer
                        .take()
                        .ok_or_else(|| anyhow!("the relay's writer is gone"))?;
                    let (left, mut held) = tokio::task::spawn_blocking(move || w.join())
                        .await
                        .map_err(|e| anyhow!("wait for the relay's writer: {e}"))?
                        .map_err(|_| anyhow!("the relay's writer panicked"))?;
                    // Oldest first: what the body had not read, what the writer held, what
                    // home sent before its answer.
                    let mut back: Prefix = if socket {
                        unread_socket(peer_ino, records, dgram)?
                    } else {
                        vec![relay_tty::unread_input(fd.as_raw_fd())]
                    };
                    back.extend(left);
                    loop {
                        tokio::select! {
                            biased;
                            item = held.recv() => {
                                if let Some(In::Data((d, _room))) = item {
                                    back.push(d);
                                }
                            }
                            more = &mut frames => match more? {
                                FramesEnd::Handoff(..) => break,
                                _ => bail!("home closed the relay before answering its handoff"),
                            },
                        }
                    }
                    while let Ok(item) = held.try_recv() {
                        if let In::Data((d, _room)) = item {
                            back.push(d);
                        }
                    }
                    for m in &back {
                        if records {
                            write_record(&mut tx, m).await?;
                        } else {
                            write_data(&mut tx, m).await?;
                        }
                    }
                    write_end(&mut tx).await?;
                    Ok::<_, anyhow::Error>(back.iter().map(Vec::len).sum::<usize>())
                }
                .await;
                match r {
                    Ok(returned) => {
                        tracing::info!(event = "relay-returned", bytes = returned);
                        let _ = done.send(Ok(()));
                        Ok(Ended::HandedOff)
                    }
                    Err(e) => {
                        let _ = done.send(Err(anyhow!("{e:#}")));
                        Err(e)
                    }
                }
            }
            // At home: the body's node hands the relay over; all it sent before is queued for
            // the terminal.
            Ok(Step::Moved(to, mut rx)) => {
                async {
                    drain.store(true, Ordering::Relaxed);
                    // What we read from the terminal (or socket) goes before our answer.
                    let mut reading = !reader_ended;
                    while reading {
                        match out_rx.recv().await {
                            Some(TtyOut::Data(d)) => {
                                write_data(&mut tx, &d).await?;
                                total_out += d.len() as u64;
                                count(d.len());
                            }
                            Some(TtyOut::Winsize(size)) => {
                                write_msg(&mut tx, &Msg::RelayWinsize { size }).await?;
                            }
                            Some(TtyOut::Termios(_)) => {}
                            Some(TtyOut::Drained | TtyOut::Eof | TtyOut::Broken) | None => {
                                reading = false
                            }
                        }
                    }
                    write_msg(&mut tx, &Msg::RelayHandoff { to: to.clone() }).await?;
                    tokio::io::AsyncWriteExt::flush(&mut tx).await?;
                    // Then what the body's node returns: for the body's next node.
                    let mut prefix = Vec::new();
                    loop {
                        match read_frame(&mut rx).await {
                            Ok(Frame::Data(d)) => prefix.push(d),
                            Ok(Frame::End) => break,
                            Ok(Frame::Msg(Msg::RelayWinsize { .. } | Msg::RelayTermios { .. })) => {
                            }
                            Ok(Frame::Msg(m)) => {
                                bail!("{} message inside a relay's handoff", kind(&m))
                            }
                            Err(e) => bail!("the body's node left during the handoff: {e}"),
                        }
                    }
                    Ok(Ended::Moved(to, prefix))
                }
                .await
            }
        }
    };
    stop.store(true, Ordering::Relaxed);
    if r.is_err() {
        abort.store(true, Ordering::Relaxed);
    }
    // What is still queued is written (a terminal's output from a body moving on, before the
    // terminal waits for its next node), or dropped if the relay failed.
    queued.close();
    drop(in_tx);
    drop(out_rx);
    let _ = tokio::task::spawn_blocking(move || {
        let _ = reader.join();
        if let Some(w) = writer {
            let _ = w.join();
        }
    })
    .await;
    let bytes = total_in.load(Ordering::Relaxed);
    match r? {
        Ended::Closed => Ok(DuplexEnd::Closed(total_out + bytes)),
        Ended::HandedOff => Ok(DuplexEnd::HandedOff(total_out + bytes)),
        Ended::Moved(to, prefix) => {
            let fd = Arc::try_unwrap(fd)
                .map_err(|_| anyhow!("the terminal's description is still in use"))?;
            Ok(DuplexEnd::Handoff {
                bytes: total_out + bytes,
                to,
                prefix,
                fd,
            })
        }
    }
}

/// How a two-way relay ended.
enum DuplexEnd {
    /// Over (either side ended, or a write failed): the bytes moved.
    Closed(u64),
    /// At home: the body moved on to node `to`. The home's end `fd` waits for it there, and
    /// `prefix` (what the body's last node had taken and the body had not read) goes first.
    Handoff {
        bytes: u64,
        to: String,
        prefix: Prefix,
        fd: OwnedFd,
    },
    /// At the body's node: the relay was handed over to the body's next node.
    HandedOff(u64),
}

/// What a body's node is told once its relay is handed over (or why not).
type HandoffDone = tokio::sync::oneshot::Sender<Result<()>>;

/// Where a two-way relay's pumping stopped.
enum Step<R> {
    Done,
    /// At the body's node: hand the relay over to node `to`, and say so on `done`.
    HandOver(String, HandoffDone),
    /// At home: the body moved on to node `to`; its last node's frames go on on `rx`.
    Moved(String, R),
}

/// What a two-way relay came to, before its threads are joined.
enum Ended {
    Closed,
    HandedOff,
    Moved(String, Prefix),
}

/// What the far side's frames came to.
enum FramesEnd<R> {
    /// End of file, or the connection closed.
    Closed,
    /// `RelayHandoff { to }`: what follows is read from `rx` after.
    Handoff(String, R),
}

/// For a two-way relay's writer: bytes to write, a socket's shutdown one way, or stop and
/// give back what it holds (a terminal's relay handed over).
enum In {
    Data(Queued),
    Shut,
    Hold,
}

/// The next order of a body's node for its relay (never, without one).
async fn next_ctl(ctl: &mut Option<tokio::sync::mpsc::UnboundedReceiver<Ctl>>) -> Option<Ctl> {
    match ctl {
        Some(c) => c.recv().await,
        None => std::future::pending().await,
    }
}

/// What waits unread in the body's socket `ino` (frozen, moving on; the other end of a relay
/// here), read through a copy of a descriptor of it: it goes to the body's next node. A socket
/// of messages (`records`; datagrams: `dgram`) gives them one by one, whole.
pub(crate) fn unread_socket(ino: u64, records: bool, dgram: bool) -> Result<Prefix> {
    let link = format!("socket:[{ino}]");
    let holder = std::fs::read_dir("/proc")
        .context("list /proc")?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .find_map(|pid| {
            let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?;
            fds.flatten().find_map(|f| {
                let l = std::fs::read_link(f.path()).ok()?;
                (l.to_str()? == link)
                    .then(|| f.file_name().to_str()?.parse::<i32>().ok())
                    .flatten()
                    .map(|fd| (pid, fd))
            })
        });
    let Some((pid, fd)) = holder else {
        bail!("no process holds the body's {link} to read what it has not read")
    };
    let sock = ferry_sys::pidfd::pidfd_open(pid)
        .and_then(|p| ferry_sys::pidfd::pidfd_getfd(&p, fd))
        .map_err(|e| anyhow!("PID {pid} fd {fd} ({link}): take it to read what waits: {e}"))?;
    let mut out = Vec::new();
    let mut bytes = Vec::new();
    loop {
        let got = if records {
            recv_record(sock.as_raw_fd())
        } else {
            let mut d = Vec::new();
            ferry_sys::sockets::recv_append(sock.as_raw_fd(), &mut d, 1 << 16, libc::MSG_DONTWAIT)
                .map(|_| d)
        };
        match got {
            // The end (a stream's or seqpacket's shutdown); an empty datagram is a message.
            Ok(d) if d.is_empty() && !dgram => break,
            Ok(d) if records => out.push(d),
            Ok(d) => bytes.extend_from_slice(&d),
            Err(e) if e.errno == libc::EINTR => {}
            Err(e) if e.errno == libc::EAGAIN => break,
            Err(e) => bail!("PID {pid} fd {fd} ({link}): read what waits: {e}"),
        }
    }
    if !records {
        out.push(bytes);
    }
    Ok(out)
}

/// How many bytes from the far side a two-way relay holds for its writer at most (a longer
/// message alone): past that it stops reading the connection.
const IN_QUEUE_BYTES: usize = 1 << 20;

/// Bytes for a two-way relay's writer, with their room in its queue.
type Queued = (Vec<u8>, tokio::sync::OwnedSemaphorePermit);

/// The longest message a relay carries whole (a longer one is cut there, as a reader with a
/// buffer that size would have it).
const RECORD_MAX: usize = ferry_transport::frame::MAX_FRAME - 4096;

/// The next message of a socket of messages, whole (its length asked first: MSG_TRUNC).
pub(crate) fn recv_record(raw: std::os::fd::RawFd) -> Result<Vec<u8>, ferry_sys::SysError> {
    let len = ferry_sys::sockets::next_message_len(raw)?;
    let mut d = Vec::new();
    ferry_sys::sockets::recv_append(raw, &mut d, len.min(RECORD_MAX), libc::MSG_DONTWAIT)?;
    Ok(d)
}

/// Whether socket `raw` is shut down for reading.
fn read_shut(raw: std::os::fd::RawFd) -> bool {
    ferry_sys::sockets::poll_now(raw, libc::POLLRDHUP).is_ok_and(|ev| ev & libc::POLLRDHUP != 0)
}

/// Sends `data` on socket `raw`, as `sender` when there is one (at home: the process whose
/// socket it is). Never blocks, never raises SIGPIPE.
fn send_on(
    raw: std::os::fd::RawFd,
    data: &[u8],
    sender: &mut Option<Sender>,
) -> Result<usize, ferry_sys::SysError> {
    let flags = libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL;
    if let Some(who) = *sender {
        match ferry_sys::sockets::send_as(raw, data, who, flags) {
            // That process is gone (its body ended): what is left goes as the daemon.
            Err(e) if e.errno == libc::ESRCH => *sender = None,
            r => return r,
        }
    }
    ferry_sys::sockets::send(raw, data, None, &[], flags)
}

/// Whether the peer of connected UNIX datagram socket `raw` is gone (closed: it is no longer
/// among the sockets sock_diag knows). A socket sock_diag cannot see (another network
/// namespace's) is taken as alive.
pub(crate) fn dgram_peer_gone(raw: std::os::fd::RawFd) -> bool {
    use ferry_sys::sockets::{unix_diag, UDIAG_SHOW_PEER};
    let Some(ino) = std::fs::read_link(format!("/proc/self/fd/{raw}"))
        .ok()
        .and_then(|l| {
            let l = l.to_string_lossy().into_owned();
            l.strip_prefix("socket:[")?
                .strip_suffix(']')?
                .parse::<u32>()
                .ok()
        })
    else {
        return false;
    };
    let Ok(me) = unix_diag(Some(ino), UDIAG_SHOW_PEER) else {
        return false;
    };
    let Some(me) = me.first() else {
        return false;
    };
    match me.peer {
        None | Some(0) => true,
        Some(peer) => unix_diag(Some(peer), 0).is_ok_and(|p| p.is_empty()),
    }
}
