//! The two-way relays (a terminal, a UNIX socket of any type, a TCP connection): their pump
//! at either end ([`pump_duplex`]), and what a socket's queue holds.

use super::*;

/// What a two-way relay's reading thread found.
pub(super) enum TtyOut {
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
pub(super) enum Duplex {
    Tty { gate: Option<i32> },
    Socket,
}

/// The kind of relay an id names (see `ferry_image::RELAY_TTY`, `RELAY_SOCKET`).
pub(super) fn duplex_of(id: u32) -> Option<Duplex> {
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
pub(super) async fn pump_duplex<S>(
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
                            if ferry_sys::sockets::unix_dgram_peer_gone(raw) {
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
                        crate::relay_tty::set_size(&known_size, fd.as_raw_fd(), size);
                    }
                    // The body set its terminal: the home terminal takes it.
                    Ok(Frame::Msg(m @ Msg::RelayTermios { .. })) if gate.is_some() => {
                        crate::relay_tty::apply_termios(fd.as_raw_fd(), &m);
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
pub(super) enum DuplexEnd {
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
pub(super) type HandoffDone = tokio::sync::oneshot::Sender<Result<()>>;

/// Where a two-way relay's pumping stopped.
pub(super) enum Step<R> {
    Done,
    /// At the body's node: hand the relay over to node `to`, and say so on `done`.
    HandOver(String, HandoffDone),
    /// At home: the body moved on to node `to`; its last node's frames go on on `rx`.
    Moved(String, R),
}

/// What a two-way relay came to, before its threads are joined.
pub(super) enum Ended {
    Closed,
    HandedOff,
    Moved(String, Prefix),
}

/// What the far side's frames came to.
pub(super) enum FramesEnd<R> {
    /// End of file, or the connection closed.
    Closed,
    /// `RelayHandoff { to }`: what follows is read from `rx` after.
    Handoff(String, R),
}

/// For a two-way relay's writer: bytes to write, a socket's shutdown one way, or stop and
/// give back what it holds (a terminal's relay handed over).
pub(super) enum In {
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
