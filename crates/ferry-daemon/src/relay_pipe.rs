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

use anyhow::{anyhow, bail, Context, Result};
use ferry_transport::frame::{read_frame, write_data, write_end, write_msg, FrameError};
use ferry_transport::message::kind;
use ferry_transport::{Frame, Msg};
use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::unix::pipe;
use tokio::sync::{mpsc, oneshot};

/// How often an idle write end is asked whether its readers are all gone.
const READERS_POLL: Duration = Duration::from_millis(200);
/// How long a paused relay's pump has to answer, and a handoff to finish.
const CONTROL_WAIT: Duration = Duration::from_secs(10);

/// What a body's node asks of one of its pipes' pumps.
pub enum Ctl {
    /// Stop moving bytes between the stand-in and the connection (the body is about to be
    /// captured); answered once nothing is in flight between them, or with why the relay
    /// cannot follow the body.
    Pause(oneshot::Sender<Result<(), String>>),
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
                Ok(Ok(Ok(()))) => {
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
fn readers_gone(raw: i32) -> bool {
    match ferry_sys::sockets::poll_now(raw, libc::POLLOUT) {
        Ok(ev) => ev & libc::POLLERR != 0,
        Err(_) => true,
    }
}

/// How a home's pump ended.
pub enum HomeEnd {
    /// The relay is over (end of file went across, or a side's readers or writers are gone).
    Closed(u64),
    /// The body moved on to node `to`: the home's end waits for it, and `prefix` (what the
    /// body's last node had taken and the body had not read) goes to it first.
    Handoff {
        bytes: u64,
        to: String,
        prefix: Vec<u8>,
    },
}

/// At home: moves one relayed pipe's data between the home's end `fd` (a description of our
/// own) and the body's node, `prefix` first (what an earlier node returned at a handoff).
pub async fn home_pump<S>(
    stream: S,
    fd: OwnedFd,
    prefix: Vec<u8>,
    counter: Option<Arc<AtomicU64>>,
) -> Result<HomeEnd>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let acc = ferry_sys::fdops::get_fl(fd.as_raw_fd())
        .map_err(|e| anyhow!("read the relayed pipe's flags: {e}"))?
        & libc::O_ACCMODE;
    let (rx, mut tx) = tokio::io::split(stream);
    let mut heard = frames(rx);
    let mut total = 0u64;
    if acc == libc::O_RDONLY {
        // Ours to read and send. The body's node says nothing until it closes (its readers
        // are gone, or it has written our end of file into the stand-in) or hands off.
        let mut pipe = pipe::Receiver::from_owned_fd(fd).context("watch the relayed pipe")?;
        if !prefix.is_empty() {
            write_data(&mut tx, &prefix).await?;
            tx.flush().await?;
        }
        let mut buf = vec![0u8; 1 << 16];
        let mut eof = false;
        loop {
            tokio::select! {
                biased;
                f = heard.recv() => match f {
                    Some(Ok(Frame::Msg(Msg::RelayHandoff { to }))) => {
                        // Our last data frame is before this marker.
                        write_msg(&mut tx, &Msg::RelayHandoff { to: to.clone() }).await?;
                        let mut prefix = Vec::new();
                        loop {
                            match heard.recv().await {
                                Some(Ok(Frame::Data(d))) => prefix.extend_from_slice(&d),
                                Some(Ok(Frame::End)) => break,
                                Some(Ok(Frame::Msg(m))) => {
                                    bail!("{} message inside a relay's handoff", kind(&m))
                                }
                                Some(Err(e)) => {
                                    bail!("the body's node left during the handoff: {e}")
                                }
                                None => bail!("the body's node left during the handoff"),
                            }
                        }
                        return Ok(HomeEnd::Handoff { bytes: total, to, prefix });
                    }
                    _ => return Ok(HomeEnd::Closed(total)),
                },
                n = pipe.read(&mut buf), if !eof => {
                    let n = n.context("read the relayed pipe")?;
                    if n == 0 {
                        write_end(&mut tx).await?;
                        eof = true;
                        continue;
                    }
                    write_data(&mut tx, &buf[..n]).await?;
                    // A relay is interactive: what was read goes now, not with the next read.
                    tx.flush().await?;
                    total += n as u64;
                    count(&counter, n);
                }
            }
        }
    }
    let mut pipe = pipe::Sender::from_owned_fd(fd).context("watch the relayed pipe")?;
    let raw = pipe.as_raw_fd();
    let mut tick = tokio::time::interval(READERS_POLL);
    loop {
        tokio::select! {
            f = heard.recv() => match f {
                Some(Ok(Frame::Data(d))) => {
                    match pipe.write_all(&d).await {
                        Ok(()) => {}
                        // Its readers are gone: so must the writer's data be.
                        Err(e) if e.raw_os_error() == Some(libc::EPIPE) => {
                            return Ok(HomeEnd::Closed(total))
                        }
                        Err(e) => return Err(e).context("write the relayed pipe"),
                    }
                    total += d.len() as u64;
                    count(&counter, d.len());
                }
                Some(Ok(Frame::Msg(Msg::RelayHandoff { to }))) => {
                    return Ok(HomeEnd::Handoff { bytes: total, to, prefix: Vec::new() })
                }
                Some(Ok(Frame::End)) | Some(Err(FrameError::Closed)) | None => {
                    return Ok(HomeEnd::Closed(total))
                }
                Some(Ok(Frame::Msg(m))) => bail!("{} message inside a relay", kind(&m)),
                Some(Err(e)) => bail!("relay stream: {e}"),
            },
            _ = tick.tick() => {
                if readers_gone(raw) {
                    return Ok(HomeEnd::Closed(total));
                }
            }
        }
    }
}

/// At the body's node: moves one relayed pipe's data between the stand-in's other end `fd`
/// and the home, obeying `ctl` (pause, resume, handoff). Returns the bytes moved.
pub async fn body_pump<S>(
    stream: S,
    fd: OwnedFd,
    mut ctl: mpsc::UnboundedReceiver<Ctl>,
) -> Result<u64>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let acc = ferry_sys::fdops::get_fl(fd.as_raw_fd())
        .map_err(|e| anyhow!("read the relayed pipe's flags: {e}"))?
        & libc::O_ACCMODE;
    let (rx, mut tx) = tokio::io::split(stream);
    let mut heard = frames(rx);
    let mut total = 0u64;
    let mut paused = false;
    if acc == libc::O_RDONLY {
        // The body writes: ours to read and send.
        let mut pipe = pipe::Receiver::from_owned_fd(fd).context("watch the relayed pipe")?;
        let mut buf = vec![0u8; 1 << 16];
        loop {
            tokio::select! {
                biased;
                c = ctl.recv() => match c {
                    Some(Ctl::Pause(ack)) => {
                        // Each chunk read is sent whole before this is looked at again.
                        paused = true;
                        let _ = ack.send(Ok(()));
                    }
                    Some(Ctl::Resume) => paused = false,
                    Some(Ctl::Handoff { to, done, .. }) => {
                        let r = async {
                            write_msg(&mut tx, &Msg::RelayHandoff { to }).await?;
                            tx.shutdown().await?;
                            Ok::<_, anyhow::Error>(())
                        }
                        .await;
                        let _ = done.send(r);
                        return Ok(total);
                    }
                    None => paused = false,
                },
                // Home closed: its readers are gone, and so is what we would send.
                _ = heard.recv() => return Ok(total),
                n = pipe.read(&mut buf), if !paused => {
                    let n = n.context("read the relayed pipe")?;
                    if n == 0 {
                        write_end(&mut tx).await?;
                        return Ok(total);
                    }
                    write_data(&mut tx, &buf[..n]).await?;
                    tx.flush().await?;
                    total += n as u64;
                }
            }
        }
    }
    // The body reads: what comes from home is written into the stand-in.
    let mut pipe = pipe::Sender::from_owned_fd(fd).context("watch the relayed pipe")?;
    let raw = pipe.as_raw_fd();
    let mut pending: Vec<u8> = Vec::new();
    let mut off = 0usize;
    let mut eof = false;
    let mut tick = tokio::time::interval(READERS_POLL);
    loop {
        if eof && off >= pending.len() && !paused {
            // Home's end of file, after all it sent: the body sees it once it has read all.
            return Ok(total);
        }
        tokio::select! {
            biased;
            c = ctl.recv() => match c {
                Some(Ctl::Pause(ack)) => {
                    paused = true;
                    let _ = ack.send(Ok(()));
                }
                Some(Ctl::Resume) | None => paused = false,
                Some(Ctl::Handoff { to, done, .. }) => {
                    let r = hand_back(&mut tx, &mut heard, to, pending.split_off(off)).await;
                    let _ = done.send(r);
                    return Ok(total);
                }
            },
            n = pipe.write(&pending[off..]), if !paused && off < pending.len() => match n {
                Ok(n) => {
                    off += n;
                    total += n as u64;
                }
                // Its readers are gone: closing tells home, whose writers then get EPIPE.
                Err(e) if e.raw_os_error() == Some(libc::EPIPE) => return Ok(total),
                Err(e) => return Err(e).context("write the relayed pipe"),
            },
            f = heard.recv(), if off >= pending.len() && !eof => match f {
                Some(Ok(Frame::Data(d))) => {
                    pending = d;
                    off = 0;
                }
                Some(Ok(Frame::End)) => eof = true,
                Some(Ok(Frame::Msg(m))) => bail!("{} message inside a relay", kind(&m)),
                Some(Err(FrameError::Closed)) | None => return Ok(total),
                Some(Err(e)) => bail!("relay stream: {e}"),
            },
            _ = tick.tick(), if !paused => {
                if readers_gone(raw) {
                    return Ok(total);
                }
            }
        }
    }
}

/// A relay the body reads, handed off: asks home to stop, and sends back what came from home
/// and did not reach the stand-in (`in_hand`, then what home sent before its marker).
async fn hand_back<W: AsyncWrite + Unpin>(
    tx: &mut W,
    heard: &mut mpsc::Receiver<Result<Frame, FrameError>>,
    to: String,
    mut in_hand: Vec<u8>,
) -> Result<()> {
    write_msg(tx, &Msg::RelayHandoff { to }).await?;
    loop {
        match heard.recv().await {
            Some(Ok(Frame::Data(d))) => in_hand.extend_from_slice(&d),
            // Home's end of file came before our handoff: it is still at home (read again).
            Some(Ok(Frame::End)) => {}
            Some(Ok(Frame::Msg(Msg::RelayHandoff { .. }))) => break,
            Some(Ok(Frame::Msg(m))) => bail!("home answered the handoff with {}", kind(&m)),
            Some(Err(e)) => bail!("home left during the handoff: {e}"),
            None => bail!("home left during the handoff"),
        }
    }
    write_data(tx, &in_hand).await?;
    write_end(tx).await?;
    tx.flush().await?;
    Ok(())
}
