//! Relays: a moved tree's pipes, terminal and UNIX stream sockets to processes that stayed at
//! home (the two-way kinds, terminals and sockets, are in `pump_duplex`).
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
use anyhow::{anyhow, bail, Context, Result};
use ferry_transport::frame::{read_frame, write_data, write_end, write_msg, FrameError};
use ferry_transport::message::{kind, RelayedPipe};
use ferry_transport::tls::Conn;
use ferry_transport::{Frame, Msg};
use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::unix::pipe;

/// How often an idle write end is asked whether its readers are all gone.
const READERS_POLL: Duration = Duration::from_millis(200);
/// How long a home end waits for its body's node to connect before it is closed.
const OPEN_GRACE: Duration = Duration::from_secs(60);

/// The home's ends of relayed pipes, waiting for their body's node to connect, and the bytes
/// relayed so far per home PID.
#[derive(Default)]
pub struct HomeRelays {
    /// (home PID of the tree's root, pipe) -> (the body's node, the home's end).
    waiting: Mutex<HashMap<(i32, u32), (String, OwnedFd)>>,
    relayed: Mutex<HashMap<i32, Arc<AtomicU64>>>,
}

impl HomeRelays {
    /// Keeps `ends` for the tree rooted at home PID `pid`, whose body runs on `body_node`;
    /// an end its body's node has not asked for within a minute is closed.
    pub fn expect(self: &Arc<Self>, pid: i32, body_node: &str, ends: Vec<(u32, OwnedFd)>) {
        if ends.is_empty() {
            return;
        }
        let pipes: Vec<u32> = ends.iter().map(|(p, _)| *p).collect();
        {
            let mut w = self.waiting.lock().expect("relays lock");
            for (pipe, fd) in ends {
                w.insert((pid, pipe), (body_node.to_string(), fd));
            }
        }
        let me = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(OPEN_GRACE).await;
            let mut w = me.waiting.lock().expect("relays lock");
            for pipe in pipes {
                if w.remove(&(pid, pipe)).is_some() {
                    tracing::warn!(event = "relay-never-opened", pid, pipe);
                }
            }
        });
    }

    /// The end of pipe `pipe` of home PID `pid`, for node `from`, which must be where its body
    /// runs (a node speaks only for itself).
    fn take(&self, from: &str, pid: i32, pipe: u32) -> Result<OwnedFd> {
        let mut w = self.waiting.lock().expect("relays lock");
        match w.get(&(pid, pipe)) {
            None => bail!("no pipe {pipe} of PID {pid} waits for a relay here"),
            Some((body, _)) if body != from => {
                bail!("pipe {pipe} of PID {pid} is relayed to node {body}, not to {from}")
            }
            Some(_) => Ok(w.remove(&(pid, pipe)).expect("just seen").1),
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

    /// Bytes relayed so far for the tree whose home root is `pid`.
    pub fn bytes(&self, pid: i32) -> u64 {
        self.relayed
            .lock()
            .expect("relays lock")
            .get(&pid)
            .map_or(0, |c| c.load(Ordering::Relaxed))
    }
}

/// Opens, at home, a description of its own of each pipe the tree shares with processes
/// outside it, through the (frozen) process's descriptor: the end the tree holds.
pub fn open_home_ends(relays: &[RelayedPipe]) -> Result<Vec<(u32, OwnedFd)>> {
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
                return Ok((r.pipe, fd));
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
            Ok((r.pipe, fd))
        })
        .collect()
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
            Ok((pipe, fd))
        })
        .collect()
}

/// At the body's node, after the commit: connects each relay end to the tree's home.
pub fn dial_home(node: Arc<Node>, home: String, pid: i32, ends: Vec<(u32, OwnedFd)>) {
    for (pipe, fd) in ends {
        let node = node.clone();
        let home = home.clone();
        tokio::spawn(async move {
            let r = async {
                let mut conn = node.dial(&home).await?;
                write_msg(&mut conn.stream, &Msg::RelayOpen { pid, pipe }).await?;
                match ferry_transport::frame::read_msg(&mut conn.stream).await {
                    Ok(Msg::Done) => {}
                    Ok(Msg::Error { message }) => bail!("node {home}: {message}"),
                    Ok(other) => bail!("node {home} answered {}", kind(&other)),
                    Err(e) => bail!("node {home} did not answer: {e}"),
                }
                match duplex_of(pipe) {
                    Some(mode) => pump_duplex(conn, fd, mode, None).await,
                    None => pump(conn, fd, None).await,
                }
            }
            .await;
            match r {
                Ok(bytes) => tracing::info!(event = "relay-closed", home = %home, pid, pipe, bytes),
                // The body sees end of file, or EPIPE, as it would had its peer gone.
                Err(e) => tracing::warn!(event = "relay-failed", home = %home, pid, pipe,
                    error = %format!("{e:#}")),
            }
        });
    }
}

/// At home: node `conn.peer` asks for pipe `pipe` of home PID `pid`.
pub async fn serve_open(node: &Arc<Node>, mut conn: Conn, pid: i32, pipe: u32) -> Result<()> {
    let fd = match node.relays.take(&conn.peer, pid, pipe) {
        Ok(fd) => fd,
        Err(e) => {
            let message = format!("{e:#}");
            write_msg(&mut conn.stream, &Msg::Error { message }).await?;
            return Err(e);
        }
    };
    write_msg(&mut conn.stream, &Msg::Done).await?;
    let peer = conn.peer.clone();
    let counter = node.relays.counter(pid);
    let bytes = match duplex_of(pipe) {
        Some(Duplex::Tty { .. }) => {
            pump_duplex(conn, fd, Duplex::Tty { gate: Some(pid) }, Some(counter)).await?
        }
        Some(mode) => pump_duplex(conn, fd, mode, Some(counter)).await?,
        None => pump(conn, fd, Some(counter)).await?,
    };
    tracing::info!(event = "relay-closed", body = %peer, pid, pipe, bytes);
    Ok(())
}

fn io_err(e: ferry_sys::SysError) -> std::io::Error {
    std::io::Error::from_raw_os_error(e.errno)
}

/// Moves the data of one relayed pipe between `fd` and the connection until either side ends:
/// a read end is sent, a write end is written with what arrives. Returns the bytes moved.
async fn pump(conn: Conn, fd: OwnedFd, counter: Option<Arc<AtomicU64>>) -> Result<u64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let acc = ferry_sys::fdops::get_fl(fd.as_raw_fd()).map_err(io_err)? & libc::O_ACCMODE;
    let (mut rx, mut tx) = tokio::io::split(conn.stream);
    let count = |n: usize| {
        if let Some(c) = &counter {
            c.fetch_add(n as u64, Ordering::Relaxed);
        }
    };
    let mut total = 0u64;
    if acc == libc::O_RDONLY {
        let mut pipe = pipe::Receiver::from_owned_fd(fd).context("watch the relayed pipe")?;
        // Ours to read and send; the other side says nothing until it closes (its readers are
        // gone), and then what we read has nowhere to go.
        let send = async {
            let mut buf = vec![0u8; 1 << 16];
            loop {
                let n = pipe.read(&mut buf).await.context("read the relayed pipe")?;
                if n == 0 {
                    write_end(&mut tx).await?;
                    return Ok::<_, anyhow::Error>(());
                }
                write_data(&mut tx, &buf[..n]).await?;
                // A relay is interactive: what was read goes now, not with the next read.
                tx.flush().await?;
                total += n as u64;
                count(n);
            }
        };
        let closed = async {
            let _ = read_frame(&mut rx).await;
        };
        tokio::select! {
            r = send => r?,
            _ = closed => {}
        }
    } else {
        let mut pipe = pipe::Sender::from_owned_fd(fd).context("watch the relayed pipe")?;
        let raw = pipe.as_raw_fd();
        let recv = async {
            loop {
                match read_frame(&mut rx).await {
                    Ok(Frame::Data(d)) => {
                        match pipe.write_all(&d).await {
                            Ok(()) => {}
                            // Its readers are gone: so must the writer's data be.
                            Err(e) if e.raw_os_error() == Some(libc::EPIPE) => return Ok(()),
                            Err(e) => return Err(e).context("write the relayed pipe"),
                        }
                        total += d.len() as u64;
                        count(d.len());
                    }
                    Ok(Frame::End) | Err(FrameError::Closed) => return Ok::<_, anyhow::Error>(()),
                    Ok(Frame::Msg(m)) => bail!("{} message inside a relay", kind(&m)),
                    Err(e) => return Err(anyhow!("relay stream: {e}")),
                }
            }
        };
        let readers_gone = async {
            loop {
                tokio::time::sleep(READERS_POLL).await;
                match ferry_sys::sockets::poll_now(raw, libc::POLLOUT) {
                    Ok(ev) if ev & libc::POLLERR != 0 => return,
                    Ok(_) => {}
                    Err(_) => return,
                }
            }
        };
        tokio::select! {
            r = recv => r?,
            _ = readers_gone => {}
        }
    }
    Ok(total)
}

/// Whether home PID `pid` is in the foreground process group of its controlling terminal
/// (from its /proc stat: `pgrp` and `tpgid`; a deputy keeps its terminal and its group).
fn in_foreground(pid: i32) -> Option<bool> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let f: Vec<&str> = stat
        .get(stat.rfind(')')? + 2..)?
        .split_whitespace()
        .collect();
    let pgrp: i32 = f.get(2)?.parse().ok()?;
    let tpgid: i32 = f.get(5)?.parse().ok()?;
    Some(pgrp == tpgid)
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
/// have, or a write fails. Returns the bytes moved.
async fn pump_duplex(
    conn: Conn,
    fd: OwnedFd,
    mode: Duplex,
    counter: Option<Arc<AtomicU64>>,
) -> Result<u64> {
    let gate = match mode {
        Duplex::Tty { gate } => gate,
        Duplex::Socket => None,
    };
    let socket = matches!(mode, Duplex::Socket);
    let (mut rx, mut tx) = tokio::io::split(conn.stream);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
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
        let known_size = known_size.clone();
        std::thread::spawn(move || {
            let raw = fd.as_raw_fd();
            let mut buf = vec![0u8; 1 << 16];
            // The body's side of a terminal: the settings of its pty, as the body sets them
            // (read through a short-lived descriptor of the slave: one kept open would keep
            // the master from seeing the body's last close).
            let body_tty = gate.is_none() && !socket;
            let slave_termios = |raw| {
                let s = ferry_sys::tty::open_peer(raw, libc::O_RDWR | libc::O_NOCTTY).ok()?;
                ferry_sys::tty::get_termios(s.as_raw_fd()).ok()
            };
            let mut settings = if body_tty { slave_termios(raw) } else { None };
            if body_tty {
                // The size it starts with is the home's.
                let _ = size_changed(&known_size, raw);
            }
            let mut checked = std::time::Instant::now();
            while !stop.load(Ordering::Relaxed) {
                if body_tty && checked.elapsed() >= Duration::from_millis(20) {
                    checked = std::time::Instant::now();
                    if let Some(now) = slave_termios(raw) {
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
                    match in_foreground(root) {
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
                    Ok(_) => continue,
                    Err(_) => break,
                }
                // The shell may have taken the terminal back while we waited.
                if gate.is_some_and(|root| in_foreground(root) == Some(false)) {
                    continue;
                }
                let got = if socket {
                    // Read straight into the bytes to send: nothing zeroed first, no room
                    // for control messages (which a relay drops).
                    let mut d = Vec::with_capacity(buf.len());
                    ferry_sys::sockets::recv_append(raw, &mut d, buf.len(), libc::MSG_DONTWAIT)
                        .map(|_| d)
                } else {
                    ferry_sys::fdops::read_fd(raw, &mut buf).map(|n| buf[..n].to_vec())
                };
                match got {
                    Ok(d) if d.is_empty() => break,
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
    // Bytes to write; an empty one is end of file from the far side. The writer drains what it
    // was given even after the relay ends (the far side's last words, then its end of file),
    // unless the relay failed.
    let abort = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (in_tx, in_rx) = std::sync::mpsc::channel::<Vec<u8>>();
    let writer = {
        let (fd, stop) = (fd.clone(), abort.clone());
        std::thread::spawn(move || {
            let raw = fd.as_raw_fd();
            for data in in_rx {
                if data.is_empty() {
                    let _ = ferry_sys::sockets::shutdown(raw, libc::SHUT_WR);
                    continue;
                }
                let mut at = 0;
                while at < data.len() {
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                    match ferry_sys::fdops::write_fd(raw, &data[at..]) {
                        Ok(n) => at += n,
                        Err(e) if e.errno == libc::EINTR => {}
                        // A description that is non-blocking (the home's own socket, as its
                        // process set it): wait until it takes more (not a 5 ms sleep per
                        // full buffer), and look at `stop` now and then.
                        Err(e) if e.errno == libc::EAGAIN => {
                            let _ = ferry_sys::sockets::poll_wait(raw, libc::POLLOUT, 100);
                        }
                        Err(_) => {
                            let _ = out_tx.blocking_send(TtyOut::Broken);
                            return;
                        }
                    }
                }
            }
        })
    };
    let mut total = 0u64;
    let count = |n: usize| {
        if let Some(c) = &counter {
            c.fetch_add(n as u64, Ordering::Relaxed);
        }
    };
    let (mut sent_end, mut got_end) = (false, false);
    let r: Result<()> = async {
        loop {
            if sent_end && got_end {
                return Ok(());
            }
            tokio::select! {
                out = out_rx.recv() => match out {
                    Some(TtyOut::Data(d)) => {
                        write_data(&mut tx, &d).await?;
                        tokio::io::AsyncWriteExt::flush(&mut tx).await?;
                        total += d.len() as u64;
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
                        if !sent_end {
                            let _ = write_end(&mut tx).await;
                            if !socket {
                                return Ok(());
                            }
                            sent_end = true;
                        }
                    }
                    // Our writer found the far side's data can no longer be delivered, or
                    // both threads are gone.
                    Some(TtyOut::Broken) | None => return Ok(()),
                },
                frame = read_frame(&mut rx), if !got_end => match frame {
                    // (An empty one would read as the far side's shutdown.)
                    Ok(Frame::Data(d)) if d.is_empty() => {}
                    Ok(Frame::Data(d)) => {
                        total += d.len() as u64;
                        count(d.len());
                        // The frame's own buffer: no copy of it.
                        if in_tx.send(d).is_err() {
                            return Ok(());
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
                    Ok(Frame::Msg(Msg::RelayTermios { iflag, oflag, cflag, lflag, line, cc }))
                        if gate.is_some() =>
                    {
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
                    Ok(Frame::Msg(m)) => bail!("{} message inside a two-way relay", kind(&m)),
                    Ok(Frame::End) if socket => {
                        let _ = in_tx.send(Vec::new());
                        got_end = true;
                    }
                    Ok(Frame::End) | Err(FrameError::Closed) => return Ok(()),
                    Err(e) => bail!("relay stream: {e}"),
                },
            }
        }
    }
    .await;
    stop.store(true, Ordering::Relaxed);
    if r.is_err() {
        abort.store(true, Ordering::Relaxed);
    }
    drop(in_tx);
    drop(out_rx);
    let _ = tokio::task::spawn_blocking(move || {
        let _ = reader.join();
        let _ = writer.join();
    })
    .await;
    r.map(|()| total)
}
