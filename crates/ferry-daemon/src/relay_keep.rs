//! What a pipe's relay keeps at home so that it outlives its home daemon (a crash, a restart).
//!
//! Each relayed pipe's home end has a buffer beside it (a memfd), and both are held by a small
//! holder process (`ferry __relay-holder --root ROOT`, its stdin the pipe's end, its stdout the
//! buffer; nothing else of the daemon's stays open in it), started by the daemon in a process
//! group of its own: it does not die with the daemon, ignores SIGHUP, SIGINT and SIGTERM, and
//! ends when the tree's root at home, its deputy, does (it polls a pidfd of it). The relay's
//! state is in the two descriptions themselves, so that nothing the daemon knew only in its
//! memory is needed to go on:
//! - the body reads (home reads its pipe): the daemon moves what it reads from the pipe into
//!   the buffer with `splice` (one call: the bytes leave the pipe and the buffer's position
//!   advances together), and sends from the buffer; the position is how many bytes home took
//!   from its pipe. The body's node acknowledges what it wrote into the body's stand-in
//!   (`RelayAck`), and home frees the buffer below that;
//! - the body writes (home writes its pipe): what comes from the body's node is written at the
//!   buffer's end, and acknowledged; the buffer's size is how much home received, and its
//!   position, advanced by `splice` into the pipe, how much it wrote into the pipe.
//!
//! A relay the body reads also keeps the offset its body's node last acknowledged in a second
//! memfd (the holder's stderr): a node the body moves on to is sent from there.
//!
//! Which relays there are, with their holder's PID and start time, is recorded durably
//! (crate::state::RELAY); a restarted daemon takes both descriptions back from the holder with
//! pidfd_getfd and waits for the body's node, which dials again and says where it stands
//! (`RelayOpen::at`). A holder is ended (SIGKILL) when its relay ends, which closes the home's
//! end as the relay itself would.

use crate::node::Node;
use crate::state;
use anyhow::{anyhow, Context, Result};
use serde::{Deserialize, Serialize};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;

/// A pipe's relay's buffer at home, and the process holding it and the home's end.
pub struct Keep {
    /// The buffer (see the module's comment).
    pub buf: OwnedFd,
    /// The relay's marks (three offsets of 8 bytes, native order, in a memfd the holder keeps
    /// too): [`ACKED`], [`FLOOR`], [`REWIND`].
    pub marks: OwnedFd,
    holder: Option<Holder>,
    store: Arc<state::Store>,
    /// A way of a terminal's relay: the home terminal (for its size and settings), and the
    /// holder that holds it (PID, start time), recorded with the relay.
    pub tty: Option<(Arc<OwnedFd>, i32, u64)>,
}

struct Holder {
    pid: i32,
    pidfd: OwnedFd,
}

impl Holder {
    /// Records this holder for relay `pipe` of PID `pid`, whose body is on `body_node`, so
    /// that this daemon's successor finds the relay (and its holder) again.
    fn record(
        &self,
        store: &state::Store,
        pid: i32,
        pipe: u32,
        body_node: &str,
        joined: bool,
        tty_holder: Option<(i32, u64)>,
    ) {
        let rec = RelayRecord {
            pid,
            pipe,
            body_node: body_node.to_string(),
            joined,
            holder_pid: self.pid,
            holder_start: state::start_time(self.pid).unwrap_or(0),
            tty_holder,
        };
        store.put_or_log(state::RELAY, &key(pid, pipe), &rec);
    }
}

/// A relay kept at home, as recorded for this daemon's successor.
#[derive(Serialize, Deserialize)]
struct RelayRecord {
    /// Home PID of the tree's root, and the relay's id (`RelayOpen`).
    pid: i32,
    pipe: u32,
    /// The node running the body.
    body_node: String,
    /// Joined with its pipe's other end on that node (crate::relay_join): kept unread, with no
    /// deadline.
    #[serde(default)]
    joined: bool,
    holder_pid: i32,
    holder_start: u64,
    /// A way of a terminal's relay: the holder of the home terminal (PID, start time).
    #[serde(default)]
    tty_holder: Option<(i32, u64)>,
}

/// Mark: on a relay the body reads, the offset its body's node last acknowledged (what a node
/// the body moves on to is sent from).
pub const ACKED: usize = 0;
/// Mark: on a relay the body reads, the offset below which the buffer may be freed (what the
/// last checkpoint of the body needs: crate::recovery); [`NONE`]: what is acknowledged.
pub const FLOOR: usize = 1;
/// Mark: on a relay the body writes, where the stream of a body rebuilt from a checkpoint
/// starts (its next open): what it writes again below what home received is dropped.
pub const REWIND: usize = 2;
/// An unset mark.
pub const NONE: u64 = u64::MAX;

/// Mark `i` of `marks`.
pub fn read_mark(marks: &OwnedFd, i: usize) -> std::io::Result<u64> {
    use std::os::unix::fs::FileExt as _;
    let mut b = [0u8; 8];
    std::fs::File::from(marks.try_clone()?).read_exact_at(&mut b, (i * 8) as u64)?;
    Ok(u64::from_ne_bytes(b))
}

/// Sets mark `i` of `marks` (one write: a daemon dying meanwhile leaves the old or the new).
pub fn write_mark(marks: &OwnedFd, i: usize, v: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt as _;
    std::fs::File::from(marks.try_clone()?).write_all_at(&v.to_ne_bytes(), (i * 8) as u64)
}

fn key(pid: i32, pipe: u32) -> String {
    format!("{pid}-{pipe}")
}

impl Keep {
    /// A buffer for the home's end `end` of relay `pipe` of the tree rooted at home PID
    /// `pid`, whose body runs on `body_node`, and a holder holding both, recorded. Without a
    /// holder (it could not be started, logged) the relay works as well but does not outlive
    /// this daemon.
    pub fn new(node: &Node, pid: i32, pipe: u32, body_node: &str, end: &OwnedFd) -> Result<Keep> {
        let buf =
            ferry_sys::fdops::memfd_create(&format!("ferry-relay-{pid}-{pipe}"), libc::MFD_CLOEXEC)
                .map_err(|e| anyhow!("make the buffer of relay {pipe} of PID {pid}: {e}"))?;
        let marks = ferry_sys::fdops::memfd_create(
            &format!("ferry-relay-acked-{pid}-{pipe}"),
            libc::MFD_CLOEXEC,
        )
        .map_err(|e| anyhow!("make the offsets of relay {pipe} of PID {pid}: {e}"))?;
        for (i, v) in [(ACKED, 0), (FLOOR, NONE), (REWIND, NONE)] {
            write_mark(&marks, i, v).context("write the relay's offsets")?;
        }
        // The holder's stderr: whatever it might say lands past the marks.
        ferry_sys::fdops::lseek(marks.as_raw_fd(), 4096, libc::SEEK_SET)
            .map_err(|e| anyhow!("place the relay's offsets: {e}"))?;
        let holder = match spawn_holder(&node.exe, pid, end, &buf, &marks) {
            Ok(h) => {
                h.record(&node.store, pid, pipe, body_node, false, None);
                Some(h)
            }
            Err(e) => {
                tracing::warn!(event = "relay-holder-failed", pid, pipe,
                    error = %format!("{e:#}"), "this relay ends if the daemon does");
                None
            }
        };
        Ok(Keep {
            buf,
            marks,
            holder,
            store: node.store.clone(),
            tty: None,
        })
    }

    /// The relay's body moved on to `body_node`: its record follows.
    pub fn moved(&self, pid: i32, pipe: u32, body_node: &str) {
        if let Some(h) = &self.holder {
            let tty = self.tty.as_ref().map(|t| (t.1, t.2));
            h.record(&self.store, pid, pipe, body_node, false, tty);
        }
    }

    /// The relay was joined on `body_node` (crate::relay_join): its record says so, so that a
    /// restarted daemon keeps its end for as long as the join lasts.
    pub fn joined(&self, pid: i32, pipe: u32, body_node: &str) {
        if let Some(h) = &self.holder {
            let tty = self.tty.as_ref().map(|t| (t.1, t.2));
            h.record(&self.store, pid, pipe, body_node, true, tty);
        }
    }

    /// The relay is over: its holder ends (closing the home's end with it) and its record
    /// goes.
    pub fn release(self, pid: i32, pipe: u32) {
        if let Some(h) = self.holder {
            if let Err(e) = ferry_sys::pidfd::pidfd_send_signal(&h.pidfd, libc::SIGKILL) {
                tracing::warn!(event = "relay-holder-unkilled", pid, pipe, holder = h.pid,
                    error = %e);
            }
            self.store.remove_or_log(state::RELAY, &key(pid, pipe));
        }
    }

    /// A copy of the buffer's descriptor (the same description).
    /// The holder's PID (it holds the home's end of the pipe too).
    pub fn holder_pid(&self) -> Option<i32> {
        self.holder.as_ref().map(|h| h.pid)
    }

    pub fn buf(&self) -> Result<OwnedFd> {
        self.buf.try_clone().context("keep the relay's buffer")
    }

    /// A copy of the offsets' descriptor.
    pub fn marks(&self) -> Result<OwnedFd> {
        self.marks.try_clone().context("keep the relay's offsets")
    }
}

/// Starts a holder of `end` (its stdin), `buf` (its stdout) and `marks` (its stderr), in a
/// process group of its own, for as long as home PID `root` (the tree's deputy) lives: a relay
/// whose daemons all went leaves nothing behind once its tree is over.
fn spawn_holder(
    exe: &std::path::Path,
    root: i32,
    end: &OwnedFd,
    buf: &OwnedFd,
    marks: &OwnedFd,
) -> Result<Holder> {
    use std::os::unix::process::CommandExt;
    let child = std::process::Command::new(exe)
        .args(["__relay-holder", "--root", &root.to_string()])
        .stdin(end.try_clone().context("copy the home's end")?)
        .stdout(buf.try_clone().context("copy the buffer")?)
        .stderr(marks.try_clone().context("copy the offsets")?)
        .process_group(0)
        .spawn()
        .with_context(|| format!("start a relay holder ({} __relay-holder)", exe.display()))?;
    let pid = child.id() as i32;
    // The daemon's reaper collects it.
    drop(child);
    let pidfd = ferry_sys::pidfd::pidfd_open(pid)
        .map_err(|e| anyhow!("open a pidfd of relay holder {pid}: {e}"))?;
    Ok(Holder { pid, pidfd })
}

/// At start: every relay an earlier run of this daemon kept whose holder still runs waits
/// again for its body's node, which dials again; the others' records go.
pub fn recover(node: &Arc<Node>) {
    for (k, r) in node.store.load::<RelayRecord>(state::RELAY) {
        let taken = (|| -> Result<(OwnedFd, Keep)> {
            if state::start_time(r.holder_pid) != Some(r.holder_start) {
                anyhow::bail!("its holder {} is gone", r.holder_pid);
            }
            let pidfd = ferry_sys::pidfd::pidfd_open(r.holder_pid)
                .map_err(|e| anyhow!("open a pidfd of holder {}: {e}", r.holder_pid))?;
            let take = |n: i32| {
                ferry_sys::pidfd::pidfd_getfd(&pidfd, n)
                    .map_err(|e| anyhow!("take fd {n} of holder {}: {e}", r.holder_pid))
            };
            let end = take(0)?;
            let buf = take(1)?;
            let marks = take(2)?;
            // A terminal's way: the terminal, from its own holder.
            let tty = match r.tty_holder {
                Some((h, start)) if state::start_time(h) == Some(start) => {
                    let t = ferry_sys::pidfd::pidfd_open(h)
                        .and_then(|p| ferry_sys::pidfd::pidfd_getfd(&p, 0))
                        .map_err(|e| anyhow!("take the terminal from holder {h}: {e}"))?;
                    Some((Arc::new(t), h, start))
                }
                Some((h, _)) => anyhow::bail!("the terminal's holder {h} is gone"),
                None => None,
            };
            Ok((
                end,
                Keep {
                    buf,
                    marks,
                    holder: Some(Holder {
                        pid: r.holder_pid,
                        pidfd,
                    }),
                    store: node.store.clone(),
                    tty,
                },
            ))
        })();
        match taken {
            Ok((end, keep)) => {
                let at = ferry_sys::fdops::lseek(keep.buf.as_raw_fd(), 0, libc::SEEK_CUR);
                tracing::warn!(event = "relay-recovered", pid = r.pid, pipe = r.pipe,
                    body = %r.body_node, holder = r.holder_pid, at = ?at.ok(), joined = r.joined);
                if r.joined {
                    node.relays
                        .park_joined(r.pid, r.pipe, &r.body_node, end, keep);
                } else {
                    node.relays
                        .park_kept(r.pid, r.pipe, &r.body_node, end, keep);
                }
            }
            Err(e) => {
                tracing::warn!(event = "relay-lost", pid = r.pid, pipe = r.pipe,
                    body = %r.body_node, error = %format!("{e:#}"));
                node.store.remove_or_log(state::RELAY, &k);
            }
        }
    }
}

/// The relays' marks as a checkpoint of their body and a recovery use them.
impl crate::relay::HomeRelays {
    /// Relay `pipe` of `pid` ended here.
    pub(crate) fn unmark(&self, pid: i32, pipe: u32) {
        self.marks.lock().expect("relays lock").remove(&(pid, pipe));
    }

    /// The marks of the pipes' relays of the tree rooted at `root`, by relay.
    fn marks_of(&self, root: i32) -> Vec<(u32, OwnedFd)> {
        self.marks
            .lock()
            .expect("relays lock")
            .iter()
            .filter(|(k, _)| k.0 == root)
            .filter_map(|(k, m)| m.try_clone().ok().map(|m| (k.1, m)))
            .collect()
    }

    /// A checkpoint of the body of `root` begins: each of its relays the body reads keeps its
    /// buffer from what is acknowledged now on (the body is frozen later, at or past that),
    /// until [`HomeRelays::set_floor`] says where the image stands.
    pub fn hold_floor(&self, root: i32) {
        use crate::relay_keep::{read_mark, write_mark, ACKED, FLOOR, NONE};
        for (_, m) in self.marks_of(root) {
            if read_mark(&m, FLOOR).is_ok_and(|f| f == NONE) {
                if let Ok(a) = read_mark(&m, ACKED) {
                    let _ = write_mark(&m, FLOOR, a);
                }
            }
        }
    }

    /// The last image of `root` stands at `offsets` (relay, `RelayOpen::at`): its relays keep
    /// their buffers from there.
    pub fn set_floor(&self, root: i32, offsets: &[(u32, u64)]) {
        use crate::relay_keep::{write_mark, FLOOR};
        for (pipe, m) in self.marks_of(root) {
            if let Some(&(_, at)) = offsets.iter().find(|o| o.0 == pipe) {
                let _ = write_mark(&m, FLOOR, at);
            }
        }
    }

    /// Cuts the pumps of the relays of `root` whose body's node is `dead` (their connections
    /// not yet known broken): each waits here for its body's next node.
    pub fn cut_tree(&self, root: i32, dead: &str) {
        let mut live = self.live.lock().expect("relays lock");
        for ((pid, pipe), l) in live.iter_mut() {
            if *pid == root && l.node == dead {
                if let Some(cut) = l.cut.take() {
                    tracing::info!(event = "relay-cut", pid, pipe, body = %dead);
                    let _ = cut.send(());
                }
            }
        }
    }

    /// The tree rooted at `root` is rebuilt on node `to` from an image that stood at
    /// `offsets`: each of its relays waiting here goes to `to`, and starts where the image
    /// stands (a relay the body reads is sent from there; on one it writes, what it writes
    /// again is dropped up to what this home received). Returns the relays that could not
    /// (not waiting here, or not in the image), by id (`only`: just these relays).
    pub fn rewind_tree(
        self: &Arc<Self>,
        root: i32,
        to: &str,
        offsets: &[(u32, u64)],
        only: Option<&[u32]>,
    ) -> Vec<u32> {
        use crate::relay_keep::{write_mark, ACKED, REWIND};
        let mut missed = Vec::new();
        for (pipe, m) in self.marks_of(root) {
            if only.is_some_and(|o| !o.contains(&pipe)) {
                continue;
            }
            let x = self
                .waiting
                .lock()
                .expect("relays lock")
                .remove(&(root, pipe));
            let (Some(x), Some(&(_, at))) = (x, offsets.iter().find(|o| o.0 == pipe)) else {
                missed.push(pipe);
                continue;
            };
            let reads = ferry_sys::fdops::get_fl(x.fd.as_raw_fd())
                .is_ok_and(|fl| fl & libc::O_ACCMODE == libc::O_RDONLY);
            let r = write_mark(&m, if reads { ACKED } else { REWIND }, at);
            if let Err(e) = r {
                tracing::warn!(event = "relay-rewind-failed", pid = root, pipe, error = %e);
            }
            tracing::info!(event = "relay-rewound", pid = root, pipe, to = %to, at,
                from = %x.node);
            match x.keep {
                Some(k) => self.park_kept(root, pipe, to, x.fd, k),
                None => self.park_as(root, pipe, to, x.fd, x.prefix, x.sender, None),
            }
        }
        missed
    }
}

/// A relayed stream socket's way from home to the body (its id on the wire: the relay's file
/// number with this bit, `RelayOpen::pipe`), relayed as a pipe's.
pub const SOCKET_DOWN: u32 = 1 << 29;
/// A relayed stream socket's way from the body home, relayed as a pipe's.
pub const SOCKET_UP: u32 = 1 << 28;

/// Beside [`SOCKET_DOWN`] or [`SOCKET_UP`]: a terminal's way (the rest is its pts number).
pub const TTY_WAY: u32 = 1 << 27;

/// The ids of the two ways (home to body, body to home) of stream socket or terminal relay
/// `id`.
pub fn socket_ways(id: u32) -> (u32, u32) {
    let n = if id & ferry_image::RELAY_TTY != 0 {
        (id & !ferry_image::RELAY_TTY) | TTY_WAY
    } else {
        id & !ferry_image::RELAY_SOCKET
    };
    (n | SOCKET_DOWN, n | SOCKET_UP)
}

/// Whether socket `fd` is a UNIX socket (of messages too: seqpacket, datagrams).
pub fn is_unix(fd: &OwnedFd) -> bool {
    ferry_sys::sockets::getsockopt_int(fd.as_raw_fd(), libc::SOL_SOCKET, libc::SO_DOMAIN)
        == Ok(libc::AF_UNIX)
}

/// Whether socket `fd` is a stream socket (whose relay is kept as two pipes' relays).
pub fn is_stream(fd: &OwnedFd) -> bool {
    ferry_sys::sockets::getsockopt_int(fd.as_raw_fd(), libc::SOL_SOCKET, libc::SO_TYPE)
        == Ok(libc::SOCK_STREAM)
}

/// Whether relay `id`, whose end here is `fd`, is relayed as two kept ways (a stream socket's
/// or a terminal's), and whether it is a terminal's.
pub fn two_ways(id: u32, fd: &OwnedFd) -> Option<bool> {
    if id & ferry_image::RELAY_TTY != 0 {
        Some(true)
    } else if id & ferry_image::RELAY_SOCKET != 0 && (is_stream(fd) || is_unix(fd)) {
        Some(false)
    } else {
        None
    }
}

/// At home: the stream socket or terminal `sock` of relay `id` of the tree rooted at home PID
/// `pid`, whose body runs on `body_node`, is held by a holder that pumps it to and from two
/// pipes (`ferry __relay-holder --socket`, sending as `sender`, or `--tty`), and each pipe's
/// other end is relayed and kept as a pipe's (a buffer and a holder each): the socket's peer,
/// or the terminal, never sees this daemon go. Returns the two ways' ids and home ends, with
/// their buffers, for the body's node.
pub fn keep_two_way(
    node: &Node,
    pid: i32,
    id: u32,
    body_node: &str,
    sock: &OwnedFd,
    sender: Option<crate::relay::Sender>,
) -> Result<Vec<(u32, OwnedFd, Keep)>> {
    use std::os::unix::process::CommandExt;
    let pipe = || {
        ferry_sys::fdops::pipe2(libc::O_CLOEXEC)
            .map_err(|e| anyhow!("make a pipe for socket relay {id} of PID {pid}: {e}"))
    };
    let (down_r, down_w) = pipe()?;
    let (up_r, up_w) = pipe()?;
    let mut cmd = std::process::Command::new(&node.exe);
    let tty = id & ferry_image::RELAY_TTY != 0;
    let mode = if tty { "--tty" } else { "--socket" };
    cmd.args(["__relay-holder", mode, "--root", &pid.to_string()]);
    if let Some((p, u, g)) = sender {
        cmd.arg("--sender").arg(format!("{p}:{u}:{g}"));
    }
    let child = cmd
        .stdin(sock.try_clone().context("copy the home's socket")?)
        .stdout(down_w)
        .stderr(up_r)
        .process_group(0)
        .spawn()
        .with_context(|| {
            format!(
                "start a socket holder ({} __relay-holder --socket)",
                node.exe.display()
            )
        })?;
    let holder = child.id() as i32;
    tracing::info!(event = "relay-two-way-held", pid, relay = id, holder);
    // The daemon's reaper collects it.
    drop(child);
    let term = if tty {
        crate::relay_tty::start_known(sock);
        let t = sock.try_clone().context("keep the home terminal")?;
        Some((Arc::new(t), holder, state::start_time(holder).unwrap_or(0)))
    } else {
        None
    };
    let (down, up) = socket_ways(id);
    let mut ways = Vec::new();
    for (way, end) in [(down, down_r), (up, up_w)] {
        let mut keep = Keep::new(node, pid, way, body_node, &end)?;
        keep.tty = term.clone();
        keep.moved(pid, way, body_node);
        ways.push((way, end, keep));
    }
    Ok(ways)
}
