//! The body's side of a relayed pipe: its stand-in at the body's node ([`body_relay`]), its
//! pump, and its handoff when the body moves on.

use super::*;

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
