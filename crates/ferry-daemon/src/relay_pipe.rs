//! A relayed pipe's two pumps, and how its relay follows a body that moves on (B to C).
//!
//! At home ([`home_pump`]) the daemon holds the home's end of the pipe; at the body's node
//! ([`body_pump`]) the other end of the body's stand-in pipe. Data flows one way in `Data`
//! frames, `End` is end of file.
//!
//! Moving on (docs/wire-format.md, "Moving on with relays"): before B captures the body, it
//! pauses the body's relays ([`BodyRelays::pause`]): B's pump stops moving bytes between the
//! connection and the stand-in, so what is buffered in the stand-in is exactly what the image
//! records (bytes the body has not read, or has written and B not taken), and the restore at C
//! refills C's stand-in with it. A move that fails lets the relays go on. After the commit B
//! hands each relay off to C (`RelayHandoff`): on a relay the body writes, every byte B took is
//! already sent, and the handoff is its last frame; on a relay the body reads, home stops
//! reading its pipe and answers with a marker after its last data frame, and B sends back what
//! it had taken from home but not put into the stand-in (its chunk in hand, then what came
//! before the marker): home sends those to C before anything more of its pipe. Home keeps its
//! end meanwhile for C ([`crate::relay::HomeRelays`]), which asks for it with `RelayOpen` as it
//! would for a first move. Nothing is lost, duplicated or reordered: the body at C reads its
//! refilled stand-in, then what B returned, then home's pipe; what it writes at C reaches home
//! after all B sent, since home takes C's connection only once B's has ended. A terminal's
//! or a socket's relay follows a body too (its handoff is in `crate::relay`'s `pump_duplex`).

mod body;

use crate::relay_standin::{Dst, Sock, Src};
use anyhow::{anyhow, bail, Context, Result};
pub use body::{body_at_home, body_relay, body_socket};
use ferry_transport::frame::{read_frame, write_data, write_end, write_msg, FrameError};
use ferry_transport::message::kind;
use ferry_transport::{Frame, Msg};
use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::unix::pipe;
use tokio::sync::{mpsc, oneshot};

/// How often an idle write end is asked whether its readers are all gone.
const READERS_POLL: Duration = Duration::from_millis(200);
/// How long a paused relay's pump has to answer, and a handoff to finish.
const CONTROL_WAIT: Duration = Duration::from_secs(10);

/// What a body's node asks of one of its pipes' pumps.
pub enum Ctl {
    /// Stop moving bytes between the stand-in and the connection (the body is about to be
    /// captured); answered once nothing is in flight between them, with where a pipe's relay
    /// stands in its stream (`RelayOpen::at`; 0 for a terminal's or a socket's), or with why
    /// the relay cannot follow the body.
    Pause(oneshot::Sender<Result<u64, String>>),
    /// The move failed: go on.
    Resume,
    /// The body moved on to node `to` (paused first): hand the relay over. `peer`: for a
    /// socket's relay, the inode of the body's socket (what it has not read goes too).
    Handoff {
        to: String,
        peer: u64,
        done: oneshot::Sender<Result<()>>,
    },
}

/// One relay of a body here.
struct Live {
    /// The relay's id at home (`RelayOpen::pipe`).
    pipe: u32,
    /// The stand-in pipe's inode (for a terminal's relay, `u64::MAX` less its pts number,
    /// which no pipe has; 0 for a socket's).
    ino: u64,
    ctl: Option<mpsc::UnboundedSender<Ctl>>,
    /// A socket's relay: what the body's socket was at home (`RelayName::line`, with the
    /// body's socket inode first), for the capture.
    names: Option<String>,
    serial: u64,
}

/// The relays of the bodies this node runs, by (home node, home PID of the tree's root).
#[derive(Default)]
pub struct BodyRelays {
    live: Mutex<HashMap<(String, i32), Vec<Live>>>,
    /// What the relayed sockets of bodies rebuilt here were at home, by (home, home PID,
    /// relay id), until their relays are registered.
    names: Mutex<HashMap<(String, i32, u32), String>>,
    serial: AtomicU64,
    /// Writers' stand-ins waiting for their readers' relays here (crate::relay_join).
    pub joins: Arc<crate::relay_join::Joins>,
}

/// A pipe's relay registered here: its pump takes `ctl`, and ends by `forget`ting it.
pub struct Registered {
    pub ctl: Option<mpsc::UnboundedReceiver<Ctl>>,
    serial: u64,
}

/// The paused relays of a body about to be captured. Dropped without `handoff`, they go on.
pub struct Paused {
    relays: Vec<(u32, u64, mpsc::UnboundedSender<Ctl>)>,
    /// `--relay-socket` arguments for the capture worker.
    sockets: Vec<String>,
    /// Where each pipe's relay stood when paused (`RelayOpen::at`), by relay id.
    offsets: Vec<(u32, u64)>,
    handed: bool,
}

impl BodyRelays {
    /// What the relayed sockets of the body of home PID `pid` from `home`, rebuilt here, were
    /// at home (its restore's report).
    pub fn names(&self, home: &str, pid: i32, names: &[ferry_transport::message::RelayName]) {
        let mut all = self.names.lock().expect("body relays lock");
        for n in names {
            all.insert((home.to_string(), pid, n.relay), n.line.clone());
        }
    }

    /// Registers relay `pipe` of home PID `pid` from `home`, whose stand-in is `fd` here.
    pub fn register(&self, home: &str, pid: i32, pipe: u32, fd: &OwnedFd) -> Registered {
        let serial = self.serial.fetch_add(1, Ordering::Relaxed);
        let names =
            self.names
                .lock()
                .expect("body relays lock")
                .remove(&(home.to_string(), pid, pipe));
        // A socket's relay follows its body only if it is known what the socket was at home.
        let (ctl, rx) = if pipe & ferry_image::RELAY_SOCKET != 0 && names.is_none() {
            (None, None)
        } else {
            let (tx, rx) = mpsc::unbounded_channel();
            (Some(tx), Some(rx))
        };
        // A socket's stand-in is the body's socket (its inode leads the line).
        let body_socket = names
            .as_deref()
            .and_then(|l| l.split(' ').next())
            .and_then(|i| i.parse::<u64>().ok());
        let ino = if let Some(ino) = body_socket {
            ino
        } else if pipe & ferry_image::RELAY_TTY != 0 {
            u64::MAX - u64::from(pipe & !ferry_image::RELAY_TTY)
        } else {
            crate::relay::inode_of(fd)
        };
        self.live
            .lock()
            .expect("body relays lock")
            .entry((home.to_string(), pid))
            .or_default()
            .push(Live {
                pipe,
                ino,
                ctl,
                names,
                serial,
            });
        Registered { ctl: rx, serial }
    }

    /// The relay registered as `r` ended.
    pub fn forget(&self, home: &str, pid: i32, r: &Registered) {
        let mut live = self.live.lock().expect("body relays lock");
        let key = (home.to_string(), pid);
        if let Some(v) = live.get_mut(&key) {
            v.retain(|l| l.serial != r.serial);
            if v.is_empty() {
                live.remove(&key);
            }
        }
    }

    /// Pauses every relay of the body of home PID `pid` from `home` before it is captured to
    /// move on; the stand-ins' inodes and relay ids (for the capture) are in the answer. A
    /// socket whose names at home this node does not know cannot follow: refused, naming it.
    pub async fn pause(&self, home: &str, pid: i32) -> Result<Paused> {
        type Listed = (u32, u64, Option<mpsc::UnboundedSender<Ctl>>, Option<String>);
        let list: Vec<Listed> = self
            .live
            .lock()
            .expect("body relays lock")
            .get(&(home.to_string(), pid))
            .map(|v| {
                v.iter()
                    .map(|l| (l.pipe, l.ino, l.ctl.clone(), l.names.clone()))
                    .collect()
            })
            .unwrap_or_default();
        let mut paused = Paused {
            relays: Vec::new(),
            sockets: Vec::new(),
            offsets: Vec::new(),
            handed: false,
        };
        for (pipe, ino, ctl, names) in list {
            let Some(ctl) = ctl else {
                bail!(
                    "PID {pid} (home {home}) holds a socket whose other end is at home (file \
                     {}), relayed from its home, and this node does not know what it was there \
                     (its names and inode): it cannot move on (docs/limitations.md)",
                    pipe & !ferry_image::RELAY_SOCKET
                );
            };
            let (tx, rx) = oneshot::channel();
            if ctl.send(Ctl::Pause(tx)).is_err() {
                // Its relay ended meanwhile: the stand-in is the body's own pipe now.
                continue;
            }
            match tokio::time::timeout(CONTROL_WAIT, rx).await {
                Ok(Ok(Ok(at))) => {
                    if pipe & (ferry_image::RELAY_TTY | ferry_image::RELAY_SOCKET) == 0 {
                        paused.offsets.push((pipe, at));
                    }
                    if let Some(line) = names {
                        paused
                            .sockets
                            .push(format!("--relay-socket={pipe}:{}", line.trim_end()));
                    }
                    paused.relays.push((pipe, ino, ctl))
                }
                Ok(Ok(Err(why))) => bail!(
                    "PID {pid} (home {home}): its relay {} cannot follow it: {why}",
                    describe(pipe)
                ),
                // Ended before it could answer: as above.
                Ok(Err(_)) => continue,
                Err(_) => bail!(
                    "the relay of pipe {pipe} of PID {pid} (home {home}) did not pause within \
                     {} s (its home not reached yet?)",
                    CONTROL_WAIT.as_secs()
                ),
            }
        }
        Ok(paused)
    }
}

impl Paused {
    /// Where each pipe's relay stood when paused, by relay id.
    pub fn offsets(&self) -> Vec<(u32, u64)> {
        self.offsets.clone()
    }

    /// Whether a terminal's or a socket's relay is among them.
    pub fn two_way(&self) -> Option<u32> {
        self.relays
            .iter()
            .map(|r| r.0)
            .find(|p| p & (ferry_image::RELAY_TTY | ferry_image::RELAY_SOCKET) != 0)
    }

    /// `--relay-standin` arguments for the capture worker: INO:ID.
    pub fn worker_args(&self) -> Vec<String> {
        self.relays
            .iter()
            .map(|(pipe, ino, _)| format!("--relay-standin={ino}:{pipe}"))
            .chain(self.sockets.iter().cloned())
            .collect()
    }

    /// After the commit: hands every paused relay over to node `to`. A relay that fails to is
    /// logged (the body sees end of file or EPIPE there, as had its peer gone).
    pub async fn handoff(mut self, to: &str, pid: i32) {
        self.handed = true;
        for (pipe, ino, ctl) in std::mem::take(&mut self.relays) {
            let (tx, rx) = oneshot::channel();
            let sent = ctl.send(Ctl::Handoff {
                to: to.to_string(),
                peer: if pipe & ferry_image::RELAY_SOCKET != 0 {
                    ino
                } else {
                    0
                },
                done: tx,
            });
            let r = match sent {
                Err(_) => Err(anyhow!("its relay had ended")),
                Ok(()) => match tokio::time::timeout(CONTROL_WAIT, rx).await {
                    Ok(Ok(r)) => r,
                    Ok(Err(_)) => Err(anyhow!("its relay ended during the handoff")),
                    Err(_) => Err(anyhow!(
                        "the handoff took over {} s",
                        CONTROL_WAIT.as_secs()
                    )),
                },
            };
            match r {
                Ok(()) => tracing::info!(event = "relay-handed-off", pid, pipe, to = %to),
                Err(e) => tracing::warn!(event = "relay-handoff-failed", pid, pipe, to = %to,
                    error = %format!("{e:#}")),
            }
        }
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        if !self.handed {
            for (_, _, ctl) in &self.relays {
                let _ = ctl.send(Ctl::Resume);
            }
        }
    }
}

/// Relay `pipe` for people: a terminal's, a socket's, a pipe's.
fn describe(pipe: u32) -> String {
    if pipe & ferry_image::RELAY_TTY != 0 {
        format!(
            "of its terminal /dev/pts/{}",
            pipe & !ferry_image::RELAY_TTY
        )
    } else if pipe & ferry_image::RELAY_SOCKET != 0 {
        format!(
            "of a socket at home (file {})",
            pipe & !ferry_image::RELAY_SOCKET
        )
    } else {
        format!("of pipe {pipe}")
    }
}

/// Frames read from `rx` by a task of their own (a frame half read is never dropped by a
/// `select!` that chose something else); ends with an error (`Closed` when the peer closed).
fn frames<R: AsyncRead + Unpin + Send + 'static>(
    mut rx: R,
) -> mpsc::Receiver<Result<Frame, FrameError>> {
    let (tx, out) = mpsc::channel(4);
    tokio::spawn(async move {
        loop {
            let f = read_frame(&mut rx).await;
            let end = f.is_err();
            if tx.send(f).await.is_err() || end {
                return;
            }
        }
    });
    out
}

fn count(counter: &Option<Arc<AtomicU64>>, n: usize) {
    if let Some(c) = counter {
        c.fetch_add(n as u64, Ordering::Relaxed);
    }
}

/// Whether the write end `raw`'s readers are all gone.
pub(crate) fn readers_gone(raw: i32) -> bool {
    match ferry_sys::sockets::poll_now(raw, libc::POLLOUT) {
        Ok(ev) => ev & libc::POLLERR != 0,
        Err(_) => true,
    }
}

/// How much a relay keeps that its other side has not acknowledged (home: taken from its pipe
/// and not yet written into the body's stand-in; the body's node: sent and not yet kept at
/// home), before it stops taking more (its writer then blocks, as it would at home).
const WINDOW: u64 = 1 << 20;
/// One read, one frame.
pub(crate) const CHUNK: usize = 1 << 16;
/// How long a body's node dials again a home it lost (restarting) before its relay ends.
const REDIAL_FOR: Duration = Duration::from_secs(300);

/// How a home's pump ended.
pub enum HomeEnd {
    /// The relay is over (end of file went across, or a side's readers or writers are gone).
    Closed(u64),
    /// The body moved on to node `to`: the home's end and buffer wait for it. `acked`: on a
    /// relay the body reads, what the last node had written into the body's stand-in (its
    /// next node gets the rest from the buffer).
    Handoff { bytes: u64, to: String, acked: u64 },
    /// The connection broke (the body's node went, or the link): the home's end and buffer
    /// wait for the body's node to dial again.
    Lost { bytes: u64, acked: u64 },
    /// The relay was joined with its pipe's other end on the body's node (crate::relay_join):
    /// nothing more crosses home. On the relay the body writes, `release` says whether the
    /// join held (the home's end may go) or not (it waits for the body's node to dial again).
    Joined {
        bytes: u64,
        release: Option<oneshot::Receiver<bool>>,
    },
}

/// What home asks of one of its pipes' pumps.
pub enum HomeCtl {
    /// Join the relay with its pipe's other end on the body's node, under `token` (see
    /// `Msg::RelayJoin`); `done` says whether it did. On the relay the body writes, `release`
    /// comes back in [`HomeEnd::Joined`].
    Join {
        token: u64,
        done: oneshot::Sender<Result<()>>,
        release: Option<oneshot::Receiver<bool>>,
    },
}

/// The next word of home for a pump (never, once nobody can send one).
async fn next_home_ctl(ctl: &mut Option<mpsc::UnboundedReceiver<HomeCtl>>) -> HomeCtl {
    loop {
        match ctl {
            Some(c) => match c.recv().await {
                Some(x) => return x,
                None => *ctl = None,
            },
            None => std::future::pending::<()>().await,
        }
    }
}

pub(crate) fn sys(e: ferry_sys::SysError) -> std::io::Error {
    std::io::Error::from_raw_os_error(e.errno)
}

/// At home: moves one relayed pipe's data between the home's end `fd` (a description of our
/// own) and the body's node, through the relay's buffer `buf` and offsets `marks`
/// (crate::relay_keep). `at`: where the body's node stands (`RelayOpen::at`). Answers the open
/// with `RelayAt` first. `ctl`: home's word (a join, crate::relay_join).
#[allow(clippy::too_many_arguments)]
pub async fn home_pump<S>(
    stream: S,
    fd: OwnedFd,
    buf: OwnedFd,
    marks: OwnedFd,
    at: Option<u64>,
    counter: Option<Arc<AtomicU64>>,
    ctl: Option<mpsc::UnboundedReceiver<HomeCtl>>,
    tty: Option<Arc<OwnedFd>>,
) -> Result<HomeEnd>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    use std::os::unix::fs::FileExt as _;
    let acc = ferry_sys::fdops::get_fl(fd.as_raw_fd())
        .map_err(|e| anyhow!("read the relayed pipe's flags: {e}"))?
        & libc::O_ACCMODE;
    let raw = fd.as_raw_fd();
    let b = buf.as_raw_fd();
    let pos = ferry_sys::fdops::lseek(b, 0, libc::SEEK_CUR)
        .map_err(|e| anyhow!("read the relay buffer's position: {e}"))? as u64;
    let file = std::fs::File::from(buf);
    let (rx, mut tx) = tokio::io::split(stream);
    let mut heard = frames(rx);
    let mut total = 0u64;
    let mut ctl = ctl;
    // A failure of the connection is not the relay's end: the body's node dials again.
    macro_rules! net {
        ($e:expr, $acked:expr) => {
            if let Err(e) = $e {
                tracing::debug!(error = %e, "relay connection lost");
                return Ok(HomeEnd::Lost {
                    bytes: total,
                    acked: $acked,
                });
            }
        };
    }
    if acc == libc::O_RDONLY {
        // Ours to read (into the buffer, `pos` bytes taken so far) and send from the buffer.
        use crate::relay_keep::{read_mark, write_mark, ACKED, FLOOR};
        let mut taken = pos;
        let mark = read_mark(&marks, ACKED).context("read the relay's acknowledged offset")?;
        // A node dialling again says where it stands; a new one (the body moved on, or was
        // rebuilt from a checkpoint) gets what the last acknowledged (or the checkpoint had).
        let mut acked = at.unwrap_or(mark).min(taken);
        let note = |acked: u64| {
            if let Err(e) = write_mark(&marks, ACKED, acked) {
                tracing::warn!(event = "relay-offset-unwritten", error = %e);
            }
            // What the body's last checkpoint needs stays.
            let floor = read_mark(&marks, FLOOR).unwrap_or(0);
            let _ = ferry_sys::fdops::punch_hole(b, acked.min(floor) & !4095);
        };
        note(acked);
        let mut sent = acked;
        net!(write_msg(&mut tx, &Msg::RelayAt { at: sent }).await, acked);
        net!(tx.flush().await, acked);
        let pipe = pipe::Receiver::from_owned_fd(fd).context("watch the relayed pipe")?;
        // A terminal's way from home: its window size goes with it when it changes.
        let known = tty.as_ref().map(|t| crate::relay_tty::known_size(t));
        let mut size_tick = tokio::time::interval(Duration::from_millis(100));
        let mut chunk = vec![0u8; CHUNK];
        let mut eof = false;
        let mut end_sent = false;
        // A join under way (its token and answer), and whether its marker went.
        let mut joining: Option<(u64, oneshot::Sender<Result<()>>)> = None;
        let mut marker_sent = false;
        loop {
            if sent < taken {
                let n = ((taken - sent) as usize).min(CHUNK);
                file.read_exact_at(&mut chunk[..n], sent)
                    .context("read the relay's buffer")?;
                net!(write_data(&mut tx, &chunk[..n]).await, acked);
                // A relay is interactive: what was read goes now, not with the next read.
                net!(tx.flush().await, acked);
                sent += n as u64;
                total += n as u64;
                count(&counter, n);
            } else if eof && !end_sent {
                net!(write_end(&mut tx).await, acked);
                net!(tx.flush().await, acked);
                end_sent = true;
            } else if let Some(token) = joining.as_ref().filter(|_| !marker_sent).map(|j| j.0) {
                // Joining: the writer's relay put all it had into our pipe, and nothing else
                // writes it. Take what is left in it; once it is empty, the marker follows
                // our last data frame.
                match ferry_sys::fdops::splice(raw, b, CHUNK) {
                    Ok(n) if n > 0 => {
                        taken += n as u64;
                        continue;
                    }
                    Ok(_) => {}
                    Err(e) if e.errno == libc::EAGAIN => {}
                    Err(e) => {
                        return Err(sys(e)).context("move the relayed pipe's bytes into its buffer")
                    }
                }
                net!(write_msg(&mut tx, &Msg::RelayJoin { token }).await, acked);
                net!(tx.flush().await, acked);
                marker_sent = true;
            }
            tokio::select! {
                biased;
                f = heard.recv() => match f {
                    Some(Ok(Frame::Msg(Msg::RelayAck { at }))) => {
                        acked = acked.max(at.min(sent));
                        note(acked);
                    }
                    Some(Ok(Frame::Msg(Msg::RelayJoin { token }))) => {
                        let Some((want, done)) = joining.take() else {
                            bail!("a join answered inside a relay that asked none");
                        };
                        if token == want && token != 0 && marker_sent {
                            // Everything before the marker is in the reader's stand-in, and
                            // its node has the writer's: the relay is theirs now.
                            let _ = done.send(Ok(()));
                            return Ok(HomeEnd::Joined { bytes: total, release: None });
                        }
                        marker_sent = false;
                        let _ = done.send(Err(anyhow!(
                            "the reader's node refused the join (its body is being moved, or \
                             the writer's stand-in was not there)"
                        )));
                    }
                    Some(Ok(Frame::Msg(Msg::RelayHandoff { to }))) => {
                        // Our last data frame is before this marker. What the body's node
                        // took and did not write into the stand-in is still in the buffer,
                        // past `acked`: its next node gets it from there.
                        net!(write_msg(&mut tx, &Msg::RelayHandoff { to: to.clone() }).await,
                            acked);
                        net!(tx.flush().await, acked);
                        // A stream socket's way: what the body had not read comes back (the
                        // last bytes acknowledged), kept again for the next node.
                        let mut back: Vec<u8> = Vec::new();
                        loop {
                            match heard.recv().await {
                                Some(Ok(Frame::Data(d))) => back.extend_from_slice(&d),
                                Some(Ok(Frame::Msg(Msg::RelayAck { at }))) => {
                                    acked = acked.max(at.min(sent));
                                    note(acked);
                                }
                                Some(Ok(Frame::End)) => {
                                    let n = back.len() as u64;
                                    if n > 0 && n <= acked {
                                        acked -= n;
                                        file.write_all_at(&back, acked)
                                            .context("keep what the body had not read")?;
                                        note(acked);
                                    } else if n > 0 {
                                        bail!("{n} bytes came back, past the {acked} sent");
                                    }
                                    break;
                                }
                                Some(Ok(Frame::Msg(m))) => {
                                    bail!("{} message inside a relay's handoff", kind(&m))
                                }
                                Some(Err(_)) | None => break,
                            }
                        }
                        return Ok(HomeEnd::Handoff { bytes: total, to, acked });
                    }
                    // The body's readers are gone, or it had all and our end of file.
                    Some(Ok(Frame::End)) => return Ok(HomeEnd::Closed(total)),
                    Some(Ok(Frame::Data(_))) => bail!("data from the reading side of a relay"),
                    Some(Ok(Frame::Msg(m))) => bail!("{} message inside a relay", kind(&m)),
                    Some(Err(_)) | None => {
                        return Ok(HomeEnd::Lost { bytes: total, acked })
                    }
                },
                c = next_home_ctl(&mut ctl), if joining.is_none() => {
                    let HomeCtl::Join { token, done, .. } = c;
                    if eof {
                        let _ = done.send(Err(anyhow!("the pipe's writers are gone")));
                    } else {
                        joining = Some((token, done));
                    }
                }
                _ = size_tick.tick(), if known.is_some() => {
                    if let (Some(t), Some(k)) = (&tty, &known) {
                        if let Some(size) = crate::relay_tty::size_changed(k, t.as_raw_fd()) {
                            net!(write_msg(&mut tx, &Msg::RelayWinsize { size }).await, acked);
                            net!(tx.flush().await, acked);
                        }
                    }
                }
                r = pipe.readable(),
                    if !eof && joining.is_none() && sent >= taken && taken - acked < WINDOW => {
                    r.context("watch the relayed pipe")?;
                    let room = (WINDOW - (taken - acked)) as usize;
                    match pipe.try_io(|| {
                        ferry_sys::fdops::splice(raw, b, room.min(CHUNK)).map_err(sys)
                    }) {
                        Ok(0) => eof = true,
                        Ok(n) => taken += n as u64,
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                        Err(e) => {
                            return Err(e).context("move the relayed pipe's bytes into its buffer")
                        }
                    }
                }
            }
        }
    }
    // The body writes: what comes is kept at the buffer's end (`received`), then moved into
    // our pipe from the buffer's position (`written`).
    let mut received = file
        .metadata()
        .context("read the relay buffer's size")?
        .len();
    let mut written = pos;
    // Where the body's node's stream stands: what home received, but for a body rebuilt from
    // a checkpoint (it writes again what it wrote since: dropped up to what home received),
    // or a node dialling again that had sent less than that (the same, during such a replay).
    let rewind = crate::relay_keep::read_mark(&marks, crate::relay_keep::REWIND)
        .context("read the relay's marks")?;
    let mut incoming = match at {
        Some(at) => at.min(received),
        None if rewind != crate::relay_keep::NONE => {
            crate::relay_keep::write_mark(
                &marks,
                crate::relay_keep::REWIND,
                crate::relay_keep::NONE,
            )
            .context("write the relay's marks")?;
            rewind.min(received)
        }
        None => received,
    };
    net!(write_msg(&mut tx, &Msg::RelayAt { at: incoming }).await, 0);
    net!(tx.flush().await, 0);
    let pipe = pipe::Sender::from_owned_fd(fd).context("watch the relayed pipe")?;
    let mut tick = tokio::time::interval(READERS_POLL);
    let mut ending = false;
    // Home always reads what the body's node sends (so that its pump, never blocked on the
    // connection, answers a pause at once); it acknowledges only up to 1 MiB past what is in
    // its pipe, and the body's node sends at most 1 MiB past what is acknowledged: its reading
    // of the stand-in stops while home's pipe is full, and the body's writer blocks.
    let mut acked = incoming;
    macro_rules! ack {
        () => {
            let at = incoming.min(written + WINDOW);
            if at > acked {
                acked = at;
                net!(write_msg(&mut tx, &Msg::RelayAck { at }).await, 0);
                net!(tx.flush().await, 0);
            }
        };
    }
    loop {
        if ending && written >= received {
            // All the body wrote is in our pipe: the relay is over (closing our end gives
            // the readers end of file).
            let _ = write_end(&mut tx).await;
            let _ = tx.flush().await;
            return Ok(HomeEnd::Closed(total));
        }
        tokio::select! {
            c = next_home_ctl(&mut ctl), if !ending => {
                let HomeCtl::Join { token, done, release } = c;
                net!(write_msg(&mut tx, &Msg::RelayJoin { token }).await, 0);
                net!(tx.flush().await, 0);
                // What the body's node sent before its answer goes into the buffer first.
                let joined = loop {
                    match heard.recv().await {
                        Some(Ok(Frame::Data(d))) => {
                            let end = incoming + d.len() as u64;
                            if end > received {
                                let new = &d[(received - incoming) as usize..];
                                file.write_all_at(new, received)
                                    .context("keep relayed bytes in the relay's buffer")?;
                                received = end;
                            }
                            incoming = end;
                        }
                        Some(Ok(Frame::End)) => ending = true,
                        Some(Ok(Frame::Msg(Msg::RelayJoin { token: t }))) => {
                            break t == token && t != 0 && !ending
                        }
                        Some(Ok(Frame::Msg(Msg::RelayHandoff { to }))) => {
                            // Moved on before it heard of the join: its last frame.
                            return Ok(HomeEnd::Handoff { bytes: total, to, acked: 0 });
                        }
                        Some(Ok(Frame::Msg(m))) => bail!("{} message inside a relay's join", kind(&m)),
                        Some(Err(_)) | None => {
                            return Ok(HomeEnd::Lost { bytes: total, acked: 0 })
                        }
                    }
                };
                if !joined {
                    let _ = done.send(Err(anyhow!(
                        "the writer's node refused the join (its body is being moved, or its \
                         writers are gone)"
                    )));
                    ack!();
                    continue;
                }
                // All the body wrote before the join is in the buffer: into our pipe with it
                // (the reader's relay takes it from there).
                while written < received {
                    pipe.writable().await.context("watch the relayed pipe")?;
                    let n = ((received - written) as usize).min(CHUNK);
                    match pipe.try_io(|| ferry_sys::fdops::splice(b, raw, n).map_err(sys)) {
                        Ok(n) => {
                            written += n as u64;
                            total += n as u64;
                            count(&counter, n);
                            let _ = ferry_sys::fdops::punch_hole(b, written & !4095);
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                        Err(e) => return Err(e).context("write the relayed pipe"),
                    }
                }
                let _ = done.send(Ok(()));
                return Ok(HomeEnd::Joined { bytes: total, release });
            }
            f = heard.recv(), if !ending => match f {
                Some(Ok(Frame::Data(d))) => {
                    let end = incoming + d.len() as u64;
                    if end > received {
                        let new = &d[(received - incoming) as usize..];
                        file.write_all_at(new, received)
                            .context("keep relayed bytes in the relay's buffer")?;
                        received = end;
                    }
                    incoming = end;
                    ack!();
                }
                Some(Ok(Frame::End)) => ending = true,
                // A terminal's way home: the size and settings the body set.
                Some(Ok(Frame::Msg(Msg::RelayWinsize { size }))) if tty.is_some() => {
                    if let Some(t) = &tty {
                        let known = crate::relay_tty::known_size(t);
                        crate::relay_tty::set_size(&known, t.as_raw_fd(), size);
                    }
                }
                Some(Ok(Frame::Msg(m @ Msg::RelayTermios { .. }))) if tty.is_some() => {
                    if let Some(t) = &tty {
                        crate::relay_tty::apply_termios(t.as_raw_fd(), &m);
                    }
                }
                Some(Ok(Frame::Msg(Msg::RelayHandoff { to }))) => {
                    // Its last frame: all it sent is in the buffer, which the next node's
                    // connection goes on draining.
                    return Ok(HomeEnd::Handoff { bytes: total, to, acked: 0 })
                }
                Some(Ok(Frame::Msg(m))) => bail!("{} message inside a relay", kind(&m)),
                Some(Err(_)) | None => return Ok(HomeEnd::Lost { bytes: total, acked: 0 }),
            },
            r = pipe.writable(), if written < received => {
                r.context("watch the relayed pipe")?;
                let n = ((received - written) as usize).min(CHUNK);
                match pipe.try_io(|| ferry_sys::fdops::splice(b, raw, n).map_err(sys)) {
                    Ok(n) => {
                        written += n as u64;
                        total += n as u64;
                        count(&counter, n);
                        let _ = ferry_sys::fdops::punch_hole(b, written & !4095);
                        ack!();
                    }
                    // Its readers are gone: so must the writer's data be.
                    Err(e) if e.raw_os_error() == Some(libc::EPIPE) => {
                        let _ = write_end(&mut tx).await;
                        let _ = tx.flush().await;
                        return Ok(HomeEnd::Closed(total));
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(e).context("write the relayed pipe"),
                }
            }
            _ = tick.tick() => {
                if readers_gone(raw) {
                    let _ = write_end(&mut tx).await;
                    let _ = tx.flush().await;
                    return Ok(HomeEnd::Closed(total));
                }
            }
        }
    }
}
