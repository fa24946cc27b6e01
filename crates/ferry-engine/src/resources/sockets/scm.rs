//! Descriptors in flight: open file descriptions that a process sent over a UNIX socket
//! (SCM_RIGHTS) and that wait, attached to their message, in the receiver's queue.
//!
//! Capture: a queue is read with MSG_PEEK (see `Cap::peek_stream` and `Cap::peek_messages`),
//! which installs a copy of every descriptor in flight in the capturing process. Each is kept
//! open here ([`InFlight`]) until the capture ends, and recorded like any descriptor of the
//! tree (`FdCapture::capture_in_flight`, with our own PID: kcmp finds a description the tree
//! also holds, and a socket in flight has its own queue read in turn, so descriptors several
//! deep are found, and a socket carrying itself or its peer is recorded once). The message
//! names them by file id (`SockMsg::rights`). In a stream socket the kernel attaches a
//! message's descriptors to the bytes sent with them and never reads past them, but it does
//! glue earlier bytes to them: the capture finds where those bytes start (a one-byte peek
//! tells whether a byte carries descriptors) and keeps them apart, so that no descriptor comes
//! back with bytes that had none.
//!
//! Restore: the descriptions are opened like every other (sockets last, so that a queue can be
//! refilled with all of them), and each message is sent again with its descriptors attached
//! (`Builder::fill_queues`). A description held by no process is opened with the rights of
//! the process holding the socket that carries it ([`carriers`]). A pidfd names a process,
//! which does not exist yet when the queues are refilled: a message carrying one, and every
//! message after it in its queue, is sent only when the tree is about to run
//! ([`DeferredSend`], from `Deferred::complete`), with a pidfd ferry opens then for the
//! rebuilt process; the shutdowns of the UNIX sockets wait for it too.

use super::*;

/// The kinds of description that may be in flight: what a restore can open before the
/// processes are made, and pidfds (sent once their process exists: [`DeferredSend`]). An epoll
/// instance may: its items are registered again by the process of the tree that holds it (one
/// that no process holds may fly only with an empty interest list: `FdCapture`).
pub(crate) fn may_fly(kind: &FileKind) -> std::result::Result<(), &'static str> {
    match kind {
        FileKind::Device { path, .. } if path == "/dev/tty" => Err("/dev/tty"),
        FileKind::Regular { .. }
        | FileKind::Directory { .. }
        | FileKind::Device { .. }
        | FileKind::PathOnly { .. }
        | FileKind::Pipe { .. }
        | FileKind::EventFd { .. }
        | FileKind::Memfd { .. }
        | FileKind::Epoll(_)
        | FileKind::Timerfd(_)
        | FileKind::Signalfd(_)
        | FileKind::Inotify(_)
        | FileKind::Fanotify(_)
        | FileKind::Pidfd { .. }
        | FileKind::Tty(_) => Ok(()),
        FileKind::Socket(_) => Ok(()),
        FileKind::ProcFile { .. } => Err("a file of /proc/PID of a process of the tree"),
        FileKind::Unknown => Err("an unknown kind of file"),
    }
}

/// Where a descriptor in flight was found: the process and descriptor through which the tree
/// holds the socket whose queue carries it, and that socket's inode.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Carrier {
    pub pid: i32,
    pub fd: i32,
    pub ino: u64,
}

/// The descriptors in flight met during one capture, in the order met, kept open (they are
/// ours) until the capture ends.
#[derive(Default)]
pub struct InFlight {
    fds: Vec<OwnedFd>,
    carriers: Vec<Carrier>,
    /// The file id each was recorded as.
    ids: Vec<Option<u32>>,
}

impl InFlight {
    /// Keeps `fds`, found in the queue of `carrier`, and returns the placeholders a message
    /// names them by until [`InFlight::resolve`].
    pub(crate) fn keep(&mut self, fds: Vec<OwnedFd>, carrier: Carrier) -> Vec<u32> {
        // A socket that is itself in flight is carried, in the end, by the tree's socket
        // that carries it.
        let me = std::process::id() as i32;
        let carrier = if carrier.pid == me {
            self.carrier_of(carrier.fd).unwrap_or(carrier)
        } else {
            carrier
        };
        let mut out = Vec::with_capacity(fds.len());
        for fd in fds {
            out.push(self.fds.len() as u32);
            self.fds.push(fd);
            self.carriers.push(carrier);
            self.ids.push(None);
        }
        out
    }

    /// The carrier of our descriptor `fd`, when it is one of those kept.
    fn carrier_of(&self, fd: RawFd) -> Option<Carrier> {
        self.fds
            .iter()
            .position(|f| f.as_raw_fd() == fd)
            .map(|i| self.carriers[i])
    }

    /// The next descriptor not yet recorded: (placeholder, our descriptor, where it was found).
    pub(crate) fn next_unrecorded(&self) -> Option<(usize, RawFd, Carrier)> {
        let k = self.ids.iter().position(Option::is_none)?;
        Some((k, self.fds[k].as_raw_fd(), self.carriers[k]))
    }

    pub(crate) fn record(&mut self, placeholder: usize, id: u32) {
        self.ids[placeholder] = Some(id);
    }

    /// Replaces the placeholders of every message of the tree by the file ids recorded.
    pub(crate) fn resolve(&self, tree: &mut Tree) -> Result<()> {
        if self.fds.is_empty() {
            return Ok(());
        }
        for f in tree.files.iter_mut() {
            let FileKind::Socket(s) = &mut f.kind else {
                continue;
            };
            for m in s.queue.iter_mut() {
                for r in m.rights.iter_mut() {
                    *r = self
                        .ids
                        .get(*r as usize)
                        .copied()
                        .flatten()
                        .ok_or_else(|| {
                            Error::BadImage(format!(
                                "socket:[{}]: a descriptor in flight was not recorded",
                                s.ino
                            ))
                        })?;
                }
            }
        }
        Ok(())
    }
}

/// Makes an error met while recording a descriptor in flight (under our own PID) name the
/// process and socket that carry it.
pub(crate) fn name_carrier(e: Error, c: Carrier) -> Error {
    let me = std::process::id() as i32;
    let place = |what: String| {
        format!(
            "a descriptor in flight (SCM_RIGHTS) in the queue of fd {} (socket:[{}]): {what}",
            c.fd, c.ino
        )
    };
    match e {
        Error::Unsupported { pid, what, why } if pid == me => Error::Unsupported {
            pid: c.pid,
            what: place(what),
            why,
        },
        Error::Sys { pid, what, source } if pid == me => Error::Sys {
            pid: c.pid,
            what: place(what),
            source,
        },
        Error::Io { pid, what, source } if pid == me => Error::Io {
            pid: c.pid,
            what: place(what),
            source,
        },
        e => e,
    }
}

/// For each description in flight that no process holds: the socket (file id) whose queue
/// carries it, held by a process or itself carried (first found, in file order).
pub(crate) fn carriers(tree: &Tree) -> HashMap<u32, u32> {
    let mut out = HashMap::new();
    for f in &tree.files {
        if let FileKind::Socket(s) = &f.kind {
            for m in &s.queue {
                for r in &m.rights {
                    out.entry(*r).or_insert(f.id);
                }
            }
        }
    }
    out
}

/// The holder to act for when opening each description: a process holding it, or the process
/// holding (perhaps through other sockets in flight) the socket that carries it. `held`: the
/// descriptions processes hold, with their first holder; `fallback`: for descriptions carried
/// only by sockets no process holds (a socket in flight in its own queue, say).
pub(crate) fn holders_in_flight<T: Copy>(
    tree: &Tree,
    held: &mut HashMap<u32, T>,
    fallback: Option<T>,
) {
    let carried = carriers(tree);
    for _ in 0..tree.files.len() {
        let mut more = false;
        for (file, socket) in &carried {
            if !held.contains_key(file) {
                if let Some(h) = held.get(socket).copied() {
                    held.insert(*file, h);
                    more = true;
                }
            }
        }
        if !more {
            break;
        }
    }
    if let Some(f) = fallback {
        for file in carried.keys() {
            held.entry(*file).or_insert(f);
        }
    }
}

impl Builder<'_> {
    /// Our descriptors of the descriptions in flight with a message of socket `r`'s queue.
    pub(super) fn rights_of(&self, r: usize, m: &SockMsg) -> Result<Vec<RawFd>> {
        m.rights
            .iter()
            .map(|id| {
                if let Some(i) = self.socks.iter().position(|(sid, _)| sid == id) {
                    return self.fds[i]
                        .as_ref()
                        .map(|f| f.as_raw_fd())
                        .ok_or_else(|| self.err(r, format!("socket {id} in flight is not made")));
                }
                self.others.get(id).map(|f| f.as_raw_fd()).ok_or_else(|| {
                    self.err(r, format!("file {id} in flight in its queue is not open"))
                })
            })
            .collect()
    }
}

/// A descriptor a deferred message carries: one of the tree's descriptions (ours), or a pidfd
/// of a process of the tree (its PID as the tree sees it), made when the message is sent.
pub(super) enum LateRight {
    Fd(OwnedFd),
    Pidfd { pid: i32, nonblock: bool },
}

/// A message for a UNIX socket's queue that is sent only when the tree is about to run,
/// because it (or a message before it in that queue) carries a pidfd.
pub(super) struct DeferredSend {
    /// The socket and message, for errors.
    pub what: String,
    /// Who sends it (a copy).
    pub from: OwnedFd,
    pub data: Vec<u8>,
    /// Where to (a raw address), for an unconnected sender.
    pub to: Option<Vec<u8>>,
    pub rights: Vec<LateRight>,
    /// A stream's bytes, sent until all are (a datagram or record is sent once).
    pub stream: bool,
}

impl DeferredSend {
    /// Sends it; `hosts`: the tree's PIDs -> ours.
    pub(super) fn send(&self, hosts: &HashMap<i32, i32>) -> std::result::Result<(), String> {
        let mut made = Vec::new();
        for r in &self.rights {
            if let LateRight::Pidfd { pid, nonblock } = r {
                let host = hosts
                    .get(pid)
                    .ok_or_else(|| format!("a pidfd of PID {pid}, which was not rebuilt"))?;
                let p = pidfd::pidfd_open(*host)
                    .map_err(|e| format!("a pidfd of PID {pid} (here {host}): {e}"))?;
                if *nonblock {
                    fdops::set_fl(p.as_raw_fd(), libc::O_NONBLOCK)
                        .map_err(|e| format!("make the pidfd of PID {pid} non-blocking: {e}"))?;
                }
                made.push(p);
            }
        }
        let mut made = made.iter();
        let fds: Vec<RawFd> = self
            .rights
            .iter()
            .map(|r| match r {
                LateRight::Fd(f) => f.as_raw_fd(),
                LateRight::Pidfd { .. } => made.next().map(|p| p.as_raw_fd()).unwrap_or(-1),
            })
            .collect();
        let mut at = 0;
        loop {
            let with = if at == 0 { &fds[..] } else { &[] };
            let n = sk::send(
                self.from.as_raw_fd(),
                &self.data[at..],
                self.to.as_deref(),
                with,
                libc::MSG_DONTWAIT,
            )
            .map_err(|e| {
                format!(
                    "queue {} bytes again (with {} descriptors in flight): {e}",
                    self.data.len(),
                    with.len()
                )
            })?;
            at += n;
            if !self.stream || at >= self.data.len() {
                return Ok(());
            }
        }
    }
}
