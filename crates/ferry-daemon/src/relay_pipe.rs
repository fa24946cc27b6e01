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

use crate::relay_standin::{Dst, Sock, Src};
use anyhow::{anyhow, bail, Context, Result};
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

/// The body's node's side of one relayed pipe, kept across the connections of its relay (a
/// home that restarts is dialled again).
struct BodyPipe {
    stand_in: StandIn,
    /// Where this node stands in the relay's stream (`RelayOpen::at`): bytes written into the
    /// stand-in (the body reads), or sent (the body writes); `None` until home first answered.
    at: Option<u64>,
    /// The body reads: home's end of file came.
    eof: bool,
    /// The body writes: what was sent and home has not kept yet (from `at` less its length).
    unacked: Vec<u8>,
    /// The body writes: the stand-in gave end of file (its writers are gone).
    drained: bool,
    paused: bool,
    total: u64,
    /// Where a writer's stand-in waits to be joined with its reader's (the node's joins, and
    /// the home they are under); none for a body at its home.
    join: Option<(Arc<crate::relay_join::Joins>, String, i32)>,
    /// The body writes: a second descriptor of the stand-in's read end, for a join.
    dup: Option<OwnedFd>,
    /// A terminal's way: its size and settings.
    tty: Option<BodyTty>,
}

/// A terminal's way at the body's node: the pty's size as last seen or set, and (the way
/// home) its settings as last sent.
struct BodyTty {
    known: crate::relay_tty::Known,
    settings: Option<ferry_sys::tty::Termios>,
}

/// Takes the body's node's word `c` while a relay is connected: a pause is answered with
/// where the relay stands (`at`), a resume (or the node gone) lets it go on. A handoff is left
/// to the caller, whose side of the relay it concerns: its node and answer come back.
fn steer(
    c: Option<Ctl>,
    paused: &mut bool,
    at: Option<u64>,
) -> Option<(String, u64, oneshot::Sender<Result<()>>)> {
    match c {
        Some(Ctl::Pause(ack)) => {
            *paused = true;
            let _ = ack.send(Ok(at.unwrap_or(0)));
            None
        }
        Some(Ctl::Resume) | None => {
            *paused = false;
            None
        }
        Some(Ctl::Handoff { to, peer, done }) => Some((to, peer, done)),
    }
}

enum StandIn {
    /// The body reads: our end is the stand-in's write end (or the body's stream socket's
    /// other end, for its way from home).
    Reads(Dst),
    /// The body writes: our end is its read end (or the socket's, for its way home).
    Writes(Src),
}

/// How one connection of a body's relay ended.
enum BodyEnd {
    /// The relay is over (or handed over to the body's next node).
    Done,
    /// The connection broke: dial again.
    Lost(String),
    /// The body writes: home asked to join the relay with its pipe's reader here, under this
    /// token, and has all the body wrote.
    Join(u64),
    /// The body reads: its joined pair ended with a move: its own to node `to` (its relay at
    /// home is to be handed over there), or its writer's (it goes on through home).
    Unjoined(Option<(String, oneshot::Sender<Result<()>>)>),
}

/// At the body's node, after the commit: relays stand-in end `fd` of relay `pipe` of the tree
/// rooted at home PID `pid` to `home`, obeying `ctl`. If home goes away (its daemon restarts),
/// it is dialled again for up to five minutes, and the relay goes on where it stood (see
/// crate::relay_keep): meanwhile the body's pipe I/O waits, and a move of the body is refused.
/// Returns the bytes moved.
pub async fn body_relay(
    node: &Arc<crate::node::Node>,
    home: &str,
    pid: i32,
    pipe: u32,
    fd: OwnedFd,
    ctl: Option<mpsc::UnboundedReceiver<Ctl>>,
) -> Result<u64> {
    let Some(mut ctl) = ctl else {
        bail!("relay {pipe} has no control")
    };
    let mut st = BodyPipe::new(fd)?;
    st.join = Some((node.body_relays.joins.clone(), home.to_string(), pid));
    relay_on(node, home, pid, pipe, &mut st, &mut ctl).await
}

/// [`body_relay`]'s connections, one after the other, for the body's side `st`.
async fn relay_on(
    node: &Arc<crate::node::Node>,
    home: &str,
    pid: i32,
    pipe: u32,
    st: &mut BodyPipe,
    ctl: &mut mpsc::UnboundedReceiver<Ctl>,
) -> Result<u64> {
    let mut deadline = tokio::time::Instant::now() + crate::relay::OPEN_RETRY;
    loop {
        let opened = async {
            let mut conn = node.dial(home).await?;
            write_msg(
                &mut conn.stream,
                &Msg::RelayOpen {
                    pid,
                    pipe,
                    at: st.at,
                },
            )
            .await?;
            match ferry_transport::frame::read_msg(&mut conn.stream).await {
                Ok(Msg::RelayAt { at }) => Ok((conn, at)),
                Ok(Msg::Error { message }) => Err(anyhow!("node {home}: {message}")),
                Ok(other) => Err(anyhow!("node {home} answered {}", kind(&other))),
                Err(e) => Err(anyhow!("node {home} did not answer: {e}")),
            }
        }
        .await;
        match opened {
            Ok((conn, at)) => {
                if st.at.is_some() {
                    tracing::warn!(event = "relay-resumed", home = %home, pid, pipe, at);
                }
                match body_pump(conn.stream, st, at, ctl).await? {
                    BodyEnd::Done => return Ok(st.total),
                    BodyEnd::Join(token) => {
                        let dup = st.dup.as_ref().map(|d| d.try_clone()).transpose();
                        let dup = dup.context("keep the stand-in for a join")?;
                        let Some(dup) = dup else {
                            bail!("relay {pipe} is not a writer's, and was asked to join")
                        };
                        use crate::relay_join::WriterEnd;
                        let joins = node.body_relays.joins.clone();
                        let at = st.at.unwrap_or(0);
                        match joins.writer(home, pid, token, dup, ctl, at).await {
                            WriterEnd::Ended => {
                                tracing::info!(event = "relay-joined-ended", home = %home, pid,
                                    pipe, bytes = st.total);
                                return Ok(st.total);
                            }
                            WriterEnd::Back => {
                                // Not joined, or its reader moved on: through home again.
                                tracing::info!(event = "relay-unjoined", home = %home, pid, pipe);
                                deadline = tokio::time::Instant::now() + REDIAL_FOR;
                            }
                            WriterEnd::Handoff { to, done } => {
                                let r = hand_over_joined(node, home, pid, pipe, at, &to, false);
                                let _ = done.send(r.await);
                                return Ok(st.total);
                            }
                        }
                    }
                    BodyEnd::Unjoined(Some((to, done))) => {
                        let at = st.at;
                        let r = hand_over_joined(node, home, pid, pipe, at.unwrap_or(0), &to, true);
                        let _ = done.send(r.await);
                        return Ok(st.total);
                    }
                    BodyEnd::Unjoined(None) => {
                        // Its writer moved on: through home again, from where it stood.
                        tracing::info!(event = "relay-unjoined", home = %home, pid, pipe);
                        deadline = tokio::time::Instant::now() + REDIAL_FOR;
                    }
                    BodyEnd::Lost(why) => {
                        tracing::warn!(event = "relay-interrupted", home = %home, pid, pipe,
                            at = ?st.at, error = %why, "dialling home again");
                        deadline = tokio::time::Instant::now() + REDIAL_FOR;
                    }
                }
            }
            Err(e) if tokio::time::Instant::now() > deadline => return Err(e),
            Err(_) => {
                let wait = if st.at.is_some() { 300 } else { 50 };
                let until = tokio::time::Instant::now() + Duration::from_millis(wait);
                // Meanwhile a move of the body is refused: the relay could not follow it.
                while let Ok(Some(c)) = tokio::time::timeout_at(until, ctl.recv()).await {
                    let why = format!("its home {home} cannot be reached (dialled again)");
                    match c {
                        Ctl::Pause(ack) => {
                            let _ = ack.send(Err(why));
                        }
                        Ctl::Handoff { done, .. } => {
                            let _ = done.send(Err(anyhow!(why)));
                            return Ok(st.total);
                        }
                        Ctl::Resume => st.paused = false,
                    }
                }
                tokio::time::sleep_until(until).await;
            }
        }
    }
}

/// A body at its own home (come home beside its deputies): its pipe's relay over the
/// in-process stream `stream` to the home's end here.
pub async fn body_at_home<S>(
    stream: S,
    fd: OwnedFd,
    ctl: Option<mpsc::UnboundedReceiver<Ctl>>,
) -> Result<u64>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let Some(mut ctl) = ctl else {
        bail!("a relay has no control")
    };
    let mut st = BodyPipe::new(fd)?;
    local_on(stream, &mut st, &mut ctl).await
}

/// [`body_at_home`]'s one connection, for the body's side `st`.
async fn local_on<S>(
    mut stream: S,
    st: &mut BodyPipe,
    ctl: &mut mpsc::UnboundedReceiver<Ctl>,
) -> Result<u64>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let at = match ferry_transport::frame::read_msg(&mut stream).await {
        Ok(Msg::RelayAt { at }) => at,
        Ok(other) => bail!("the home's end answered {}", kind(&other)),
        Err(e) => bail!("the home's end did not answer: {e}"),
    };
    match body_pump(stream, st, at, ctl).await? {
        BodyEnd::Done => Ok(st.total),
        BodyEnd::Lost(why) => bail!("the home's end went: {why}"),
        BodyEnd::Join(_) | BodyEnd::Unjoined(_) => bail!("a relay at home was asked to join"),
    }
}

impl BodyPipe {
    fn new(fd: OwnedFd) -> Result<BodyPipe> {
        let acc = ferry_sys::fdops::get_fl(fd.as_raw_fd())
            .map_err(|e| anyhow!("read the relayed pipe's flags: {e}"))?
            & libc::O_ACCMODE;
        let mut dup = None;
        let stand_in = if acc == libc::O_RDONLY {
            dup = Some(fd.try_clone().context("keep the relayed pipe")?);
            StandIn::Writes(Src::Pipe(
                pipe::Receiver::from_owned_fd(fd).context("watch the relayed pipe")?,
            ))
        } else {
            StandIn::Reads(Dst::Pipe(
                pipe::Sender::from_owned_fd(fd).context("watch the relayed pipe")?,
            ))
        };
        let mut st = BodyPipe::with(stand_in);
        st.dup = dup;
        Ok(st)
    }

    fn with(stand_in: StandIn) -> BodyPipe {
        BodyPipe {
            stand_in,
            at: None,
            eof: false,
            unacked: Vec::new(),
            drained: false,
            paused: false,
            total: 0,
            join: None,
            dup: None,
            tty: None,
        }
    }
}

/// One connection of a body's relay: home answered `RelayAt { at: home_at }`.
async fn body_pump<S>(
    stream: S,
    st: &mut BodyPipe,
    home_at: u64,
    ctl: &mut mpsc::UnboundedReceiver<Ctl>,
) -> Result<BodyEnd>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (rx, mut tx) = tokio::io::split(stream);
    let mut heard = frames(rx);
    macro_rules! net {
        ($e:expr) => {
            if let Err(e) = $e {
                return Ok(BodyEnd::Lost(format!("{e}")));
            }
        };
    }
    let mut tick = tokio::time::interval(READERS_POLL);
    match &mut st.stand_in {
        StandIn::Writes(pipe) => {
            // The body writes: ours to read and send. Home kept `home_at` bytes: send again
            // what it did not keep.
            let sent = st.at.unwrap_or(home_at);
            let base = sent - st.unacked.len() as u64;
            if home_at < base || home_at > sent {
                bail!("home keeps {home_at} bytes of the relay, and this node sent {base}..{sent}");
            }
            st.unacked.drain(..(home_at - base) as usize);
            for c in st.unacked.chunks(CHUNK) {
                net!(write_data(&mut tx, c).await);
            }
            st.at = Some(sent);
            if st.drained {
                net!(write_end(&mut tx).await);
            }
            net!(tx.flush().await);
            let mut buf = vec![0u8; CHUNK];
            let mut tty_tick = tokio::time::interval(Duration::from_millis(20));
            loop {
                tokio::select! {
                    biased;
                    // Each chunk read is sent whole before a pause is looked at.
                    c = ctl.recv() => if let Some((to, _, done)) = steer(c, &mut st.paused, st.at) {
                        // A socket's: what the frozen body wrote goes first (a pipe's is in
                        // the image).
                        let rest = pipe.rest();
                        let r = async {
                            for c in rest.chunks(CHUNK) {
                                write_data(&mut tx, c).await?;
                            }
                            write_msg(&mut tx, &Msg::RelayHandoff { to }).await?;
                            tx.shutdown().await?;
                            Ok::<_, anyhow::Error>(())
                        }
                        .await;
                        let _ = done.send(r);
                        return Ok(BodyEnd::Done);
                    },
                    f = heard.recv() => match f {
                        Some(Ok(Frame::Msg(Msg::RelayAck { at }))) => {
                            let sent = st.at.unwrap_or(0);
                            let base = sent - st.unacked.len() as u64;
                            let upto = at.clamp(base, sent);
                            st.unacked.drain(..(upto - base) as usize);
                        }
                        Some(Ok(Frame::Msg(Msg::RelayJoin { token }))) => {
                            // Every chunk read is sent: the answer is after the last of them.
                            let ok = token != 0
                                && !st.paused
                                && !st.drained
                                && st.join.is_some()
                                && st.dup.is_some();
                            let token = if ok { token } else { 0 };
                            net!(write_msg(&mut tx, &Msg::RelayJoin { token }).await);
                            net!(tx.flush().await);
                            if ok {
                                return Ok(BodyEnd::Join(token));
                            }
                        }
                        // Home's readers are gone (so is what we would send), or it wrote
                        // all we sent after our end of file. A socket's body then reads no
                        // more of ours: its writes fail, as they would have at home.
                        Some(Ok(Frame::End)) => {
                            if let Src::Sock(s, false) = pipe {
                                let _ = ferry_sys::sockets::shutdown(s.as_raw_fd(), libc::SHUT_RD);
                            }
                            if let Src::Rec(r) = pipe {
                                let _ = ferry_sys::sockets::shutdown(r.s.as_raw_fd(), libc::SHUT_RD);
                            }
                            return Ok(BodyEnd::Done);
                        }
                        Some(Ok(Frame::Msg(m))) => bail!("{} message inside a relay", kind(&m)),
                        Some(Ok(Frame::Data(_))) => bail!("data from the reading side of a relay"),
                        Some(Err(e)) => return Ok(BodyEnd::Lost(e.to_string())),
                        None => return Ok(BodyEnd::Lost("closed".into())),
                    },
                    // A terminal's way home: the size and settings the body set go home.
                    _ = tty_tick.tick(), if st.tty.is_some() && !st.paused => {
                        if let (Some(t), Src::Sock(s, true)) = (&mut st.tty, &*pipe) {
                            let master = s.as_raw_fd();
                            if let Some(now) = crate::relay_tty::slave_termios(master) {
                                if t.settings.as_ref() != Some(&now) {
                                    t.settings = Some(now.clone());
                                    net!(write_msg(&mut tx, &crate::relay_tty::termios_msg(now)).await);
                                }
                            }
                            if let Some(size) = crate::relay_tty::size_changed(&t.known, master) {
                                net!(write_msg(&mut tx, &Msg::RelayWinsize { size }).await);
                            }
                            net!(tx.flush().await);
                        }
                    }
                    n = pipe.read(&mut buf),
                        if !st.paused && !st.drained && (st.unacked.len() as u64) < WINDOW => {
                        let n = n.context("read the relayed pipe")?;
                        if n == 0 {
                            // Home answers our end of file once all is in its pipe.
                            st.drained = true;
                            net!(write_end(&mut tx).await);
                            net!(tx.flush().await);
                            continue;
                        }
                        st.unacked.extend_from_slice(&buf[..n]);
                        st.at = Some(st.at.unwrap_or(0) + n as u64);
                        st.total += n as u64;
                        net!(write_data(&mut tx, &buf[..n]).await);
                        net!(tx.flush().await);
                    }
                }
            }
        }
        StandIn::Reads(pipe) => {
            // The body reads: what comes from home (from `home_at`, where we stand) is
            // written into the stand-in, and acknowledged once there.
            st.at = Some(home_at);
            let mut pending: Vec<u8> = Vec::new();
            let mut off = 0usize;
            loop {
                if st.eof && off >= pending.len() && !st.paused {
                    // Home's end of file, after all it sent: the body sees it once it has
                    // read all (a socket's way from home is shut down). Home ends the relay.
                    if let Dst::Sock(s, false) = pipe {
                        let _ = ferry_sys::sockets::shutdown(s.as_raw_fd(), libc::SHUT_WR);
                    }
                    if let Dst::Rec(r) = pipe {
                        let _ = ferry_sys::sockets::shutdown(r.s.as_raw_fd(), libc::SHUT_WR);
                    }
                    let _ = write_end(&mut tx).await;
                    let _ = tx.flush().await;
                    return Ok(BodyEnd::Done);
                }
                tokio::select! {
                    biased;
                    c = ctl.recv() => if let Some((to, peer, done)) = steer(c, &mut st.paused, st.at) {
                        let back = match pipe {
                            Dst::Pipe(_) => Back::None,
                            Dst::Sock(_, false) => Back::Socket(peer),
                            Dst::Sock(s, true) => Back::Tty(s.as_raw_fd()),
                            Dst::Rec(_) => {
                                let dgram = matches!(pipe, Dst::Rec(r) if r.dgram);
                                Back::Records(peer, dgram, pipe.taken())
                            }
                        };
                        let r = hand_back(&mut tx, &mut heard, to, back).await;
                        let _ = done.send(r);
                        return Ok(BodyEnd::Done);
                    },
                    // (With nothing left to write, a socket of messages sends the whole
                    // messages it took and could not send yet.)
                    n = pipe.write(&pending[off..]),
                        if !st.paused && (off < pending.len() || pipe.waiting()) => match n {
                        Ok(n) => {
                            off += n;
                            st.total += n as u64;
                            let at = st.at.unwrap_or(0) + n as u64;
                            st.at = Some(at);
                            net!(write_msg(&mut tx, &Msg::RelayAck { at }).await);
                            net!(tx.flush().await);
                        }
                        // Its readers are gone: telling home ends the relay, and its writers
                        // then get EPIPE.
                        Err(e) if e.raw_os_error() == Some(libc::EPIPE) => {
                            let _ = write_end(&mut tx).await;
                            let _ = tx.flush().await;
                            return Ok(BodyEnd::Done);
                        }
                        Err(e) => return Err(e).context("write the relayed pipe"),
                    },
                    f = heard.recv(), if off >= pending.len() && !st.eof => match f {
                        Some(Ok(Frame::Data(d))) => {
                            pending = d;
                            off = 0;
                        }
                        Some(Ok(Frame::End)) => st.eof = true,
                        Some(Ok(Frame::Msg(Msg::RelayJoin { token }))) => {
                            // All home sent before it is in the stand-in.
                            // (Only a pipe's stand-in is joined.)
                            let is_pipe = matches!(&*pipe, Dst::Pipe(_));
                            let half = match &st.join {
                                Some((joins, home, _)) if !st.paused && token != 0 && is_pipe => {
                                    joins.take(home, token, CONTROL_WAIT).await
                                }
                                Some((joins, home, _)) => {
                                    joins.abandon(home, token);
                                    None
                                }
                                None => None,
                            };
                            let answer = if half.is_some() { token } else { 0 };
                            let r = async {
                                write_msg(&mut tx, &Msg::RelayJoin { token: answer })
                                    .await
                                    .map_err(|e| anyhow!("{e}"))?;
                                tx.flush().await.map_err(|e| anyhow!("{e}"))
                            }
                            .await;
                            if let Err(e) = r {
                                // Home never hears it: the writer's relay goes back there.
                                return Ok(BodyEnd::Lost(format!("{e}")));
                            }
                            if let Some(half) = half {
                                drop(tx);
                                drop(heard);
                                use crate::relay_join::JoinedEnd;
                                let at = st.at.unwrap_or(0);
                                let Some((joins, home, me)) = st.join.clone() else {
                                    bail!("a relay at home took a join");
                                };
                                let who = (&*joins, home.as_str(), me);
                                let Dst::Pipe(pipe) = pipe else {
                                    bail!("a relay that is not a pipe's took a join");
                                };
                                match crate::relay_join::joined(who, half, pipe, ctl, at).await? {
                                    JoinedEnd::Ended(n) => {
                                        st.total += n;
                                        return Ok(BodyEnd::Done);
                                    }
                                    JoinedEnd::Back(n) => {
                                        st.total += n;
                                        return Ok(BodyEnd::Unjoined(None));
                                    }
                                    JoinedEnd::Handoff { bytes, to, done } => {
                                        st.total += bytes;
                                        return Ok(BodyEnd::Unjoined(Some((to, done))));
                                    }
                                }
                            }
                        }
                        // A terminal's way from home: the home terminal's new size.
                        Some(Ok(Frame::Msg(Msg::RelayWinsize { size }))) if st.tty.is_some() => {
                            if let (Some(t), Dst::Sock(s, true)) = (&st.tty, &*pipe) {
                                crate::relay_tty::set_size(&t.known, s.as_raw_fd(), size);
                            }
                        }
                        Some(Ok(Frame::Msg(m))) => bail!("{} message inside a relay", kind(&m)),
                        Some(Err(e)) => return Ok(BodyEnd::Lost(e.to_string())),
                        None => return Ok(BodyEnd::Lost("closed".into())),
                    },
                    _ = tick.tick(), if !st.paused => {
                        if pipe.gone() {
                            let _ = write_end(&mut tx).await;
                            let _ = tx.flush().await;
                            return Ok(BodyEnd::Done);
                        }
                    }
                }
            }
        }
    }
}

/// A relay joined on this node (crate::relay_join) whose body moved on to `to`: its end at home
/// (kept there meanwhile) is taken again, from where it stood (`at`), and handed over, as a
/// relay that was never joined would be (`reads`: the body reads the pipe).
async fn hand_over_joined(
    node: &Arc<crate::node::Node>,
    home: &str,
    pid: i32,
    pipe: u32,
    at: u64,
    to: &str,
    reads: bool,
) -> Result<()> {
    let mut conn = node.dial(home).await?;
    let open = Msg::RelayOpen {
        pid,
        pipe,
        at: Some(at),
    };
    write_msg(&mut conn.stream, &open).await?;
    match ferry_transport::frame::read_msg(&mut conn.stream).await {
        Ok(Msg::RelayAt { .. }) => {}
        Ok(Msg::Error { message }) => bail!("node {home}: {message}"),
        Ok(other) => bail!("node {home} answered {}", kind(&other)),
        Err(e) => bail!("node {home} did not answer: {e}"),
    }
    let (rx, mut tx) = tokio::io::split(conn.stream);
    if reads {
        let mut heard = frames(rx);
        return hand_back(&mut tx, &mut heard, to.to_string(), Back::None).await;
    }
    write_msg(&mut tx, &Msg::RelayHandoff { to: to.to_string() }).await?;
    tx.shutdown().await?;
    Ok(())
}

/// What a way from home gives back at its handoff, besides what it holds.
enum Back {
    /// Nothing (a pipe's stand-in is in the image).
    None,
    /// What the body's socket (its inode) had not read.
    Socket(u64),
    /// What the body had not read from its pty (its master).
    Tty(std::os::fd::RawFd),
    /// What the body's socket of messages (its inode; datagrams?) had not read, then what
    /// this node had taken and not sent (framed).
    Records(u64, bool, Vec<u8>),
}

/// A relay the body reads, handed off: asks home to stop, and waits for its marker (what came
/// from home and did not reach the stand-in is still in home's buffer, past what this node
/// acknowledged: the body's next node gets it from there).
///
/// A stream socket's way from home (`peer`: the body's socket's inode): what this node wrote
/// into it and the body had not read goes back after the marker, as data before `End` (the
/// last bytes this node acknowledged: home keeps them again for the next node).
async fn hand_back<W: AsyncWrite + Unpin>(
    tx: &mut W,
    heard: &mut mpsc::Receiver<Result<Frame, FrameError>>,
    to: String,
    back: Back,
) -> Result<()> {
    write_msg(tx, &Msg::RelayHandoff { to }).await?;
    tx.flush().await?;
    loop {
        match heard.recv().await {
            Some(Ok(Frame::Data(_))) => {}
            // Home's end of file came before our handoff: it is still at home (read again).
            Some(Ok(Frame::End)) => {}
            // A join home asked for meanwhile: refused by the move (home hears the handoff).
            Some(Ok(Frame::Msg(Msg::RelayJoin { .. }))) => {}
            Some(Ok(Frame::Msg(Msg::RelayHandoff { .. }))) => break,
            Some(Ok(Frame::Msg(m))) => bail!("home answered the handoff with {}", kind(&m)),
            Some(Err(e)) => bail!("home left during the handoff: {e}"),
            None => bail!("home left during the handoff"),
        }
    }
    let unread = match back {
        Back::None => Vec::new(),
        Back::Socket(peer) => crate::relay::unread_socket(peer, false, false)?,
        Back::Tty(master) => vec![crate::relay_tty::unread_input(master)],
        Back::Records(peer, dgram, taken) => {
            let mut framed = Vec::new();
            for m in crate::relay::unread_socket(peer, true, dgram)? {
                crate::relay_standin::frame(&m, &mut framed);
            }
            framed.extend_from_slice(&taken);
            vec![framed]
        }
    };
    for c in unread.iter().flat_map(|m| m.chunks(CHUNK)) {
        write_data(tx, c).await?;
    }
    write_end(tx).await?;
    tx.flush().await?;
    Ok(())
}

/// At the body's node: relays the body's stream socket's other end `fd` (relay `id` of the
/// tree rooted at home PID `pid`) as two pipes' relays, one each way
/// (crate::relay_keep::socket_ways), so that it outlives its home daemon as they do: dialled
/// again, nothing lost or sent twice. `ctl` steers both (a pause pauses both; a handoff hands
/// over the way home first, with what the frozen body wrote, then the way from home, with what
/// it had not read). `local`: a body at its own home, its two ways' in-process streams.
pub async fn body_socket(
    node: &Arc<crate::node::Node>,
    home: &str,
    pid: i32,
    id: u32,
    fd: OwnedFd,
    ctl: Option<mpsc::UnboundedReceiver<Ctl>>,
    local: Option<(tokio::io::DuplexStream, tokio::io::DuplexStream)>,
) -> Result<u64> {
    let (down, up) = crate::relay_keep::socket_ways(id);
    // A pty's settings and size as it was rebuilt (the home's), before the body ran.
    let start = if id & ferry_image::RELAY_TTY != 0 {
        crate::relay_tty::take_tty_start(&fd)
    } else {
        None
    };
    let watch = || -> std::io::Result<tokio::net::UnixStream> {
        let fl = ferry_sys::fdops::get_fl(fd.as_raw_fd()).map_err(sys)?;
        ferry_sys::fdops::set_fl(fd.as_raw_fd(), fl | libc::O_NONBLOCK).map_err(sys)?;
        let std = std::os::unix::net::UnixStream::from(fd.try_clone()?);
        tokio::net::UnixStream::from_std(std)
    };
    let sock: Sock =
        Arc::new(watch().with_context(|| format!("watch the relayed socket {id} of PID {pid}"))?);
    drop(fd);
    let tty = id & ferry_image::RELAY_TTY != 0;
    let kind = if tty {
        libc::SOCK_STREAM
    } else {
        ferry_sys::sockets::getsockopt_int(sock.as_raw_fd(), libc::SOL_SOCKET, libc::SO_TYPE)
            .map_err(|e| anyhow!("the type of the relayed socket {id} of PID {pid}: {e}"))?
    };
    let (down_end, up_end) = if kind == libc::SOCK_STREAM {
        (Dst::Sock(sock.clone(), tty), Src::Sock(sock.clone(), tty))
    } else {
        let dgram = kind == libc::SOCK_DGRAM;
        (
            Dst::Rec(crate::relay_standin::Records::new(sock.clone(), dgram)),
            Src::Rec(crate::relay_standin::Records::new(sock.clone(), dgram)),
        )
    };
    let mut down_st = BodyPipe::with(StandIn::Reads(down_end));
    let mut up_st = BodyPipe::with(StandIn::Writes(up_end));
    if tty {
        // Both ways know the pty's size; the way home sends what the body sets.
        let master = sock.as_raw_fd();
        let (termios, size) = start.unwrap_or_default();
        let known: crate::relay_tty::Known = Arc::new(std::sync::Mutex::new(
            size.or_else(|| ferry_sys::tty::get_winsize(master).ok()),
        ));
        let settings = termios.or_else(|| crate::relay_tty::slave_termios(master));
        down_st.tty = Some(BodyTty {
            known: known.clone(),
            settings: None,
        });
        up_st.tty = Some(BodyTty { known, settings });
    }
    let (down_tx, mut down_rx) = mpsc::unbounded_channel();
    let (up_tx, mut up_rx) = mpsc::unbounded_channel();
    // Each way's control goes with it when it ends (a pause or handoff then finds it over).
    let ways = async {
        let (a, b) = match local {
            Some((d, u)) => {
                tokio::join!(
                    async move { local_on(d, &mut down_st, &mut down_rx).await },
                    async move { local_on(u, &mut up_st, &mut up_rx).await }
                )
            }
            None => {
                tokio::join!(
                    async move { relay_on(node, home, pid, down, &mut down_st, &mut down_rx).await },
                    async move { relay_on(node, home, pid, up, &mut up_st, &mut up_rx).await }
                )
            }
        };
        Ok::<u64, anyhow::Error>(a? + b?)
    };
    let steer = async move {
        let Some(mut ctl) = ctl else {
            return std::future::pending::<()>().await;
        };
        // Asks way `tx` to pause: its answer (a way over answers nothing: nothing to stop).
        async fn pause(tx: &mpsc::UnboundedSender<Ctl>) -> Result<u64, String> {
            let (a, r) = oneshot::channel();
            if tx.send(Ctl::Pause(a)).is_err() {
                return Ok(0);
            }
            r.await.unwrap_or(Ok(0))
        }
        async fn hand(tx: &mpsc::UnboundedSender<Ctl>, to: &str, peer: u64) -> Result<()> {
            let (done, r) = oneshot::channel();
            let c = Ctl::Handoff {
                to: to.to_string(),
                peer,
                done,
            };
            if tx.send(c).is_err() {
                return Ok(());
            }
            r.await.unwrap_or(Ok(()))
        }
        while let Some(c) = ctl.recv().await {
            match c {
                Ctl::Pause(ack) => {
                    let (a, b) = tokio::join!(pause(&up_tx), pause(&down_tx));
                    let _ = ack.send(a.and(b).map(|_| 0));
                }
                Ctl::Resume => {
                    let _ = up_tx.send(Ctl::Resume);
                    let _ = down_tx.send(Ctl::Resume);
                }
                Ctl::Handoff { to, peer, done } => {
                    let a = hand(&up_tx, &to, peer).await;
                    let b = hand(&down_tx, &to, peer).await;
                    let _ = done.send(a.and(b));
                }
            }
        }
        std::future::pending::<()>().await
    };
    tokio::select! {
        r = ways => r,
        _ = steer => unreachable!("the control of a socket's relay never ends first"),
    }
}
