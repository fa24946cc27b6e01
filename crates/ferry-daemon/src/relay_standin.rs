//! The body's side of a relay kept as pipes' ways (`relay_pipe.rs`): what a body's node
//! reads the body's writing from and writes what it reads into (a stand-in pipe, the body's
//! socket pair, its pty's master), one message at a time for a socket of messages.

use crate::relay_pipe::{readers_gone, sys, CHUNK};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::pipe;

/// The body's relayed stream socket's other end here, which both its ways use.
/// (Registered as a UNIX stream's, whatever its family: only its readiness and descriptor are
/// used.)
pub(crate) type Sock = Arc<tokio::net::UnixStream>;

/// What a body's node reads the body's writing from.
pub(crate) enum Src {
    Pipe(pipe::Receiver),
    /// A socket, or a pty's master (`true`).
    Sock(Sock, bool),
    /// A socket of messages.
    Rec(Records),
}

/// A socket of messages (seqpacket, or datagrams: `dgram`), whose messages go on a way as
/// their length (4 bytes, little-endian) and bytes: `framed` holds, going home, what was read
/// and not handed out yet (from `off`), and, coming from home, what was taken and not sent
/// yet (whole messages first, then the start of one).
pub(crate) struct Records {
    pub(crate) s: Sock,
    pub(crate) dgram: bool,
    framed: Vec<u8>,
    off: usize,
}

impl Records {
    pub(crate) fn new(s: Sock, dgram: bool) -> Records {
        Records {
            s,
            dgram,
            framed: Vec::new(),
            off: 0,
        }
    }

    /// The next whole message in `framed` (from `off`), if there is one.
    fn next(&self) -> Option<(usize, usize)> {
        let f = &self.framed[self.off..];
        let len = u32::from_le_bytes(f.get(..4)?.try_into().ok()?) as usize;
        (f.len() >= 4 + len).then_some((self.off + 4, len))
    }

    /// Sends the whole messages taken while the socket has room, without waiting.
    fn send_now(&mut self) -> std::io::Result<()> {
        while let Some((at, len)) = self.next() {
            let flags = libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL;
            let msg = &self.framed[at..at + len];
            match ferry_sys::sockets::send(self.s.as_raw_fd(), msg, None, &[], flags) {
                Err(e) if e.errno == libc::EAGAIN || e.errno == libc::EINTR => return Ok(()),
                Err(e) if e.errno == libc::EMSGSIZE => {
                    tracing::warn!(event = "relay-message-too-long", bytes = len);
                }
                Err(e)
                    if matches!(
                        e.errno,
                        libc::ECONNRESET | libc::ECONNREFUSED | libc::ENOTCONN
                    ) =>
                {
                    return Err(std::io::Error::from_raw_os_error(libc::EPIPE))
                }
                Err(e) => return Err(sys(e)),
                Ok(_) => {}
            }
            self.off = at + len;
            if self.off == self.framed.len() {
                self.framed.clear();
                self.off = 0;
            }
        }
        Ok(())
    }

    /// Sends the whole messages taken, waiting for room; one too long for the socket is
    /// dropped; the body's socket closed is EPIPE.
    async fn flush(&mut self) -> std::io::Result<()> {
        while let Some((at, len)) = self.next() {
            self.s.writable().await?;
            let raw = self.s.as_raw_fd();
            let msg = &self.framed[at..at + len];
            let r = self.s.try_io(tokio::io::Interest::WRITABLE, || {
                let flags = libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL;
                ferry_sys::sockets::send(raw, msg, None, &[], flags).map_err(sys)
            });
            match r {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) if e.raw_os_error() == Some(libc::EMSGSIZE) => {
                    tracing::warn!(event = "relay-message-too-long", bytes = len);
                }
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::ECONNRESET | libc::ECONNREFUSED | libc::ENOTCONN)
                    ) =>
                {
                    return Err(std::io::Error::from_raw_os_error(libc::EPIPE))
                }
                Err(e) => return Err(e),
                Ok(_) => {}
            }
            self.off = at + len;
            if self.off == self.framed.len() {
                self.framed.clear();
                self.off = 0;
            }
        }
        Ok(())
    }
}

/// A message as it goes on a way: its length, then its bytes.
pub(crate) fn frame(d: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&(d.len() as u32).to_le_bytes());
    out.extend_from_slice(d);
}

/// What a body's node writes what the body reads into.
pub(crate) enum Dst {
    Pipe(pipe::Sender),
    /// A socket, or a pty's master (`true`).
    Sock(Sock, bool),
    /// A socket of messages.
    Rec(Records),
}

impl Src {
    pub(crate) async fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Src::Pipe(p) => p.read(buf).await,
            Src::Rec(r) => {
                while r.off >= r.framed.len() {
                    // A datagram socket hears nothing of its peer's close: asked now and then.
                    let ready =
                        tokio::time::timeout(std::time::Duration::from_millis(200), r.s.readable())
                            .await;
                    let raw = r.s.as_raw_fd();
                    match ready {
                        Err(_) => {
                            if r.dgram && ferry_sys::sockets::unix_dgram_peer_gone(raw) {
                                return Ok(0);
                            }
                            continue;
                        }
                        Ok(x) => x?,
                    }
                    let got = r.s.try_io(tokio::io::Interest::READABLE, || {
                        crate::relay::recv_record(raw).map_err(sys)
                    });
                    match got {
                        // A seqpacket's end (no empty records there).
                        Ok(d) if d.is_empty() && !r.dgram => return Ok(0),
                        Ok(d) => {
                            r.framed.clear();
                            r.off = 0;
                            frame(&d, &mut r.framed);
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                        Err(e) if e.raw_os_error() == Some(libc::ECONNRESET) => return Ok(0),
                        Err(e) => return Err(e),
                    }
                }
                let n = buf.len().min(r.framed.len() - r.off);
                buf[..n].copy_from_slice(&r.framed[r.off..r.off + n]);
                r.off += n;
                Ok(n)
            }
            Src::Sock(s, _) => loop {
                s.readable().await?;
                let raw = s.as_raw_fd();
                let r = s.try_io(tokio::io::Interest::READABLE, || {
                    match ferry_sys::fdops::read_fd(raw, buf) {
                        // The body closed with data unread by it: its end of file (a pty's
                        // master: EIO, its last slave closed).
                        Err(e) if e.errno == libc::ECONNRESET || e.errno == libc::EIO => Ok(0),
                        r => r.map_err(sys),
                    }
                });
                match r {
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    r => return r,
                }
            },
        }
    }

    /// A socket's: what the frozen body wrote and we have not read (none for a pipe, whose
    /// stand-in the image keeps), for the handoff.
    pub(crate) fn rest(&self) -> Vec<u8> {
        let mut out = Vec::new();
        if let Src::Rec(r) = self {
            out.extend_from_slice(&r.framed[r.off.min(r.framed.len())..]);
            loop {
                match crate::relay::recv_record(r.s.as_raw_fd()) {
                    Ok(d) if d.is_empty() && !r.dgram => break,
                    Ok(d) => frame(&d, &mut out),
                    Err(e) if e.errno == libc::EINTR => {}
                    Err(_) => break,
                }
            }
        }
        if let Src::Sock(s, tty) = self {
            let mut buf = vec![0u8; CHUNK];
            loop {
                let r = if *tty {
                    ferry_sys::fdops::read_fd(s.as_raw_fd(), &mut buf)
                        .inspect(|&n| out.extend_from_slice(&buf[..n]))
                } else {
                    ferry_sys::sockets::recv_append(
                        s.as_raw_fd(),
                        &mut out,
                        CHUNK,
                        libc::MSG_DONTWAIT,
                    )
                };
                match r {
                    Ok(0) => break,
                    Ok(_) => {}
                    Err(e) if e.errno == libc::EINTR => {}
                    Err(_) => break,
                }
            }
        }
        out
    }
}

impl Dst {
    pub(crate) async fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        match self {
            Dst::Pipe(p) => p.write(data).await,
            Dst::Rec(r) => {
                // What was taken before goes first; then these bytes are taken (whole messages
                // sent now if the socket has room, the rest with the next write or flush).
                r.flush().await?;
                r.framed.extend_from_slice(data);
                r.send_now()?;
                Ok(data.len())
            }
            Dst::Sock(s, tty) => loop {
                s.writable().await?;
                let raw = s.as_raw_fd();
                let tty = *tty;
                let r = s.try_io(tokio::io::Interest::WRITABLE, || {
                    let flags = libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL;
                    let r = if tty {
                        ferry_sys::fdops::write_fd(raw, data)
                    } else {
                        ferry_sys::sockets::send(raw, data, None, &[], flags)
                    };
                    match r {
                        // The body closed its socket: as a pipe's readers gone.
                        Err(e) if e.errno == libc::ECONNRESET || e.errno == libc::EIO => {
                            Err(std::io::Error::from_raw_os_error(libc::EPIPE))
                        }
                        r => r.map_err(sys),
                    }
                });
                match r {
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    r => return r,
                }
            },
        }
    }

    /// Whether no one reads any more (a pipe's readers gone; a socket says so on a write).
    pub(crate) fn gone(&self) -> bool {
        match self {
            Dst::Pipe(p) => readers_gone(p.as_raw_fd()),
            Dst::Sock(..) => false,
            Dst::Rec(r) => r.dgram && ferry_sys::sockets::unix_dgram_peer_gone(r.s.as_raw_fd()),
        }
    }

    /// Whether whole messages taken wait to be sent (the next write, of nothing if need be,
    /// sends them).
    pub(crate) fn waiting(&self) -> bool {
        matches!(self, Dst::Rec(r) if r.next().is_some())
    }

    /// A socket of messages: what was taken and not sent (whole messages, then the start of
    /// one), for the handoff.
    pub(crate) fn taken(&mut self) -> Vec<u8> {
        match self {
            Dst::Rec(r) => {
                let rest = r.framed[r.off..].to_vec();
                r.framed.clear();
                r.off = 0;
                rest
            }
            _ => Vec::new(),
        }
    }
}
