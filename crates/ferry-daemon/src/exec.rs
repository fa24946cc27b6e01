//! Remote execution (`ferry run`): the caller's daemon relays, the chosen node runs the program
//! as if it ran at home.
//!
//! Home side ([`relay`]): the CLI sends `Run(spec)` over the control socket. The daemon checks
//! the caller may claim the spec's identity (SO_PEERCRED: a non-root caller runs only as
//! itself), picks the node (`--on`, or the idlest that accepts guests), dials it, forwards
//! `Run`, passes the first answer on, and from `Started` on copies bytes both ways: the two
//! connections carry the same frames, so relaying is forwarding without decoding. When the
//! chosen node is this one, the daemon runs the program itself, on the CLI's own connection.
//!
//! Remote side ([`serve`]): admission (`ferry_policy::admit`), then the program is forked with
//! the caller's argv, environment, cwd, umask, rlimits, uid, gid, groups and signal state
//! (`ferry_sys::spawn`), its stdio pipes or a pty sized like the caller's terminal. Its output
//! goes back as `Io` frames as it comes (read by a thread of its own, `Outputs`); at most two
//! reads wait while a frame is written, so a caller that reads slowly slows the program down
//! (the pipe fills) and nothing piles up here.
//! Caller frames: `Io`/`IoEnd` on stream 0 feed stdin, `IoEnd` on 1 or 2 means the caller's
//! reader went away (the program then gets EPIPE), `Signal` and `Resize`. The daemon's reaper
//! reports the exit; remaining output is drained, then `IoEnd`s and `Exited`. A caller that
//! vanishes (its connection closes) hangs the program up: SIGHUP to its process group, and after
//! [`HANGUP_GRACE`] SIGKILL to whatever is left of its session and process group.

use crate::node::Node;
use anyhow::{anyhow, Context, Result};
use ferry_sys::spawn::{Spawn, SpawnError, Step};
use ferry_transport::message::{kind, ProcInfo, RunSpec};
use ferry_transport::{read_frame, read_msg, write_io, write_msg, Conn, Frame, FrameError, Msg};
use serde_bytes::ByteBuf;
use std::ffi::CString;
use std::future::Future;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::unix::pipe::{Receiver as Reader, Sender as Writer};
use tokio::net::UnixStream;
use tokio::sync::mpsc;

/// How long a program whose caller vanished has, after SIGHUP, before SIGKILL.
pub const HANGUP_GRACE: Duration = Duration::from_secs(3);
/// Largest read from the program's stdout or stderr, hence the largest `Io` frame (as much as
/// its enlarged pipe holds: a fast writer's output crosses in fewer, larger frames).
const IO_CHUNK: usize = PIPE_SIZE;
/// Its pipes are enlarged to this: fewer, larger reads for a program that writes a lot.
const PIPE_SIZE: usize = 1 << 20;
/// Chunks of caller stdin waiting for the program (each at most the CLI's read, 64 KiB).
const STDIN_QUEUE: usize = 8;
/// After the program exits, output still arriving (from a pty's queue, or from descendants that
/// kept its stdout) is forwarded until end-of-file, or a pause this long, or DRAIN_MAX.
const DRAIN_IDLE: Duration = Duration::from_millis(100);
const DRAIN_MAX: Duration = Duration::from_secs(2);
/// After `Exited`, how long the caller has to close its end first (what it still sends is
/// read and dropped, so the connection ends cleanly rather than reset with data unread).
const LINGER: Duration = Duration::from_secs(5);
/// Buffer per direction when relaying bytes between the CLI and the remote daemon.
const RELAY_BUF: usize = 256 << 10;
/// The send buffer of the CLI's socket while relaying (the kernel doubles it; the default is
/// about 200 KiB, less than one read of the relay).
const CLI_SNDBUF: i32 = 1 << 20;
/// How long the remote daemon may take to answer `Run`.
const START_TIMEOUT: Duration = Duration::from_secs(30);
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

// ---- Home side ---------------------------------------------------------------------------

/// Home side: check the caller, pick the node, connect, and relay between the CLI and the
/// remote daemon (or run the program here when this node is the one picked).
pub async fn relay(node: Arc<Node>, mut cli: UnixStream, mut spec: RunSpec) -> Result<()> {
    if let Err(reason) = check_caller(&cli, &spec) {
        tracing::warn!(event = "run-refused", reason = %reason);
        write_msg(&mut cli, &Msg::error(reason)).await?;
        return Ok(());
    }
    spec.home_node = node.name().to_string();
    let picked = match &spec.target {
        Some(t) => Ok((t.clone(), None)),
        None => crate::hosts::pick_for_run(&node, spec.uid, spec.home_pid, spec.elsewhere).await,
    };
    // An `--auto` program holds its host until it ends (dropped with this).
    let (target, _grant) = match picked {
        Ok(t) => t,
        Err(e) => {
            write_msg(&mut cli, &Msg::error(format!("{e:#}"))).await?;
            return Ok(());
        }
    };
    if target == node.name() {
        return serve_stream(node, cli, spec, None).await;
    }
    let (conn, first) = match open_remote(&node, &target, &spec).await {
        Ok(x) => x,
        Err(e) => {
            let message = format!("{e:#}");
            tracing::info!(event = "run-failed", to = %target, error = %message);
            write_msg(&mut cli, &Msg::error(message)).await?;
            return Ok(());
        }
    };
    let started = matches!(first, Msg::Started { .. });
    let first = match first {
        Msg::Refused { reason } => Msg::error(format!(
            "node {target} refused to run {}: {reason}",
            spec.argv.first().map_or("", String::as_str)
        )),
        m @ (Msg::Started { .. } | Msg::RunFailed { .. } | Msg::Error { .. }) => m,
        other => Msg::error(format!("node {target} answered Run with {}", kind(&other))),
    };
    write_msg(&mut cli, &first).await?;
    if !started {
        return Ok(());
    }
    // The program's output reaches the CLI in pieces as large as this socket's send buffer
    // holds: room for a whole read of the relay, so that it rarely waits for the CLI to read.
    let _ = ferry_sys::sockets::setsockopt_int(
        cli.as_raw_fd(),
        libc::SOL_SOCKET,
        libc::SO_SNDBUF,
        CLI_SNDBUF,
    );
    // Each direction runs to its own end: the program's last frames must reach the CLI even
    // when the caller's last ones (stdin's end, say) can no longer be delivered.
    let (cli_r, mut cli_w) = cli.split();
    let (tls_r, mut tls_w) = tokio::io::split(conn.stream);
    let mut cli_r = tokio::io::BufReader::with_capacity(RELAY_BUF, cli_r);
    let mut tls_r = tokio::io::BufReader::with_capacity(RELAY_BUF, tls_r);
    let up = async {
        let r = tokio::io::copy_buf(&mut cli_r, &mut tls_w).await;
        let _ = tls_w.shutdown().await;
        r
    };
    let down = async {
        let r = tokio::io::copy_buf(&mut tls_r, &mut cli_w).await;
        let _ = cli_w.shutdown().await;
        r
    };
    let (up, down) = tokio::join!(up, down);
    tracing::debug!(event = "run-relayed", to = %target, home_pid = spec.home_pid,
        up = ?up, down = ?down);
    Ok(())
}

/// Sends `Run` to `target` and returns the connection with the first answer. The connection
/// is a spare one opened earlier when there is one (the TCP and TLS handshakes are then off
/// the run's path); a spare the peer has closed meanwhile is replaced by a fresh connection
/// (the peer never read that `Run`). Each run leaves a fresh spare behind for the next.
async fn open_remote(node: &Arc<Node>, target: &str, spec: &RunSpec) -> Result<(Conn, Msg)> {
    let run = Msg::Run(spec.clone());
    let alive = node.membership.find(target).is_some();
    if let Some(mut conn) = node.exec_spares.take(target).filter(|_| alive) {
        node.exec_spares.refill(node.clone(), target);
        if write_msg(&mut conn.stream, &run).await.is_ok() {
            match tokio::time::timeout(SPARE_START_TIMEOUT, read_msg(&mut conn.stream)).await {
                Ok(Ok(first)) => return Ok((conn, first)),
                // Closed before any answer: the peer dropped the idle connection (it
                // restarted, say) without reading `Run`.
                Ok(Err(FrameError::Closed)) => {
                    tracing::debug!(to = %target, "a spare connection was closed; dialling")
                }
                Ok(Err(e)) => {
                    return Err(anyhow!(e)).with_context(|| format!("node {target} did not answer"))
                }
                Err(_) => bail_start_timeout(target, SPARE_START_TIMEOUT)?,
            }
        }
    }
    let mut conn = node.dial(target).await?;
    node.exec_spares.refill(node.clone(), target);
    write_msg(&mut conn.stream, &run)
        .await
        .with_context(|| format!("send the command to node {target}"))?;
    let first = tokio::time::timeout(START_TIMEOUT, read_msg(&mut conn.stream))
        .await
        .map_err(|_| anyhow!("node {target} did not start the command within {START_TIMEOUT:?}"))?
        .with_context(|| format!("node {target} did not answer"))?;
    Ok((conn, first))
}

fn bail_start_timeout(target: &str, t: Duration) -> Result<()> {
    Err(anyhow!(
        "node {target} did not start the command within {t:?}"
    ))
}

/// How long the peer has to answer `Run` on a spare connection: shorter than a fresh one's,
/// as a peer that vanished without closing its connections (a machine whose power was cut)
/// never answers, and the membership may not know it yet.
const SPARE_START_TIMEOUT: Duration = Duration::from_secs(10);
/// How many connections to each peer wait, opened, for remote runs.
const SPARES_PER_PEER: usize = 2;
/// A spare older than this is dropped rather than used (the peer may have gone meanwhile).
const SPARE_MAX_AGE: Duration = Duration::from_secs(20);

/// Connections to peers opened ahead of time, for remote runs (`Run` is the first message a
/// connection carries, so a spare is used once; it saves the run its TCP and TLS handshakes).
#[derive(Default)]
pub struct Spares {
    by_peer: std::sync::Mutex<std::collections::HashMap<String, Vec<(Instant, Conn)>>>,
    /// Peers a spare is being opened for.
    dialling: std::sync::Mutex<std::collections::HashSet<String>>,
}

impl Spares {
    /// A spare connection to `peer` young enough to use, if any.
    pub(crate) fn take(&self, peer: &str) -> Option<Conn> {
        let mut by = self.by_peer.lock().unwrap_or_else(|p| p.into_inner());
        let list = by.get_mut(peer)?;
        list.retain(|(t, _)| t.elapsed() < SPARE_MAX_AGE);
        list.pop().map(|(_, c)| c)
    }

    /// Opens spares to `peer` in the background, up to [`SPARES_PER_PEER`].
    pub(crate) fn refill(&self, node: Arc<Node>, peer: &str) {
        {
            let mut d = self.dialling.lock().unwrap_or_else(|p| p.into_inner());
            if !d.insert(peer.to_string()) {
                return;
            }
        }
        let peer = peer.to_string();
        tokio::spawn(async move {
            loop {
                let have = {
                    let mut by = node
                        .exec_spares
                        .by_peer
                        .lock()
                        .unwrap_or_else(|p| p.into_inner());
                    let list = by.entry(peer.clone()).or_default();
                    list.retain(|(t, _)| t.elapsed() < SPARE_MAX_AGE);
                    list.len()
                };
                if have >= SPARES_PER_PEER {
                    break;
                }
                match node.dial(&peer).await {
                    Ok(c) => node
                        .exec_spares
                        .by_peer
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .entry(peer.clone())
                        .or_default()
                        .push((Instant::now(), c)),
                    Err(e) => {
                        tracing::debug!(to = %peer, error = %format!("{e:#}"), "no spare connection");
                        break;
                    }
                }
            }
            node.exec_spares
                .dialling
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&peer);
        });
    }
}

/// Lines for the callers of the `ferry run` programs running here, by PID: each goes to its
/// caller's stderr, as the program's own stderr would (eviction says so when it must kill one).
#[derive(Default)]
pub struct Notices(std::sync::Mutex<std::collections::HashMap<i32, mpsc::UnboundedSender<String>>>);

impl Notices {
    fn open(&self, pid: i32) -> mpsc::UnboundedReceiver<String> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(pid, tx);
        rx
    }

    fn close(&self, pid: i32) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&pid);
    }

    /// Tells the caller of the program `pid` runs here `line`; false if there is none.
    pub fn tell(&self, pid: i32, line: String) -> bool {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&pid)
            .is_some_and(|tx| tx.send(line).is_ok())
    }
}

/// The caller (the process at the other end of the control socket) may claim the uid, gid,
/// groups and home PID of `spec`: root may claim anything, anyone else only itself.
fn check_caller(cli: &UnixStream, spec: &RunSpec) -> Result<(), String> {
    let cred = cli
        .peer_cred()
        .map_err(|e| format!("cannot tell who is calling: {e}"))?;
    if cred.uid() == 0 {
        return Ok(());
    }
    let groups = ferry_sys::spawn::peer_groups(cli.as_raw_fd())
        .map_err(|e| format!("cannot tell the caller's groups: {e}"))?;
    claim_allowed(cred.uid(), cred.gid(), &groups, cred.pid(), spec)
}

/// The rule behind [`check_caller`], on plain values.
pub fn claim_allowed(
    uid: u32,
    gid: u32,
    groups: &[u32],
    pid: Option<i32>,
    spec: &RunSpec,
) -> Result<(), String> {
    if uid == 0 {
        return Ok(());
    }
    if spec.uid != uid {
        return Err(format!(
            "uid {uid} may not run a command as uid {} (only root may)",
            spec.uid
        ));
    }
    if spec.gid != gid && !groups.contains(&spec.gid) {
        return Err(format!("uid {uid} is not in group {}", spec.gid));
    }
    if let Some(g) = spec
        .groups
        .iter()
        .find(|g| **g != gid && !groups.contains(g))
    {
        return Err(format!("uid {uid} is not in group {g}"));
    }
    if pid.is_some_and(|p| p != spec.home_pid) {
        return Err(format!(
            "PID {} may not speak for PID {}",
            pid.unwrap_or(0),
            spec.home_pid
        ));
    }
    Ok(())
}

// ---- Remote side -------------------------------------------------------------------------

/// Remote side: start the program and stream its I/O until it ends.
pub async fn serve(node: Arc<Node>, conn: Conn, mut spec: RunSpec) -> Result<()> {
    let peer = conn.peer.clone();
    // The caller's daemon is the program's home: a node speaks only for itself.
    spec.home_node = peer.clone();
    serve_stream(node, conn.stream, spec, Some(peer)).await
}

/// Runs `spec` here for a caller on `stream`: a peer daemon relaying for its CLI (`peer`), or
/// this node's own CLI (None).
async fn serve_stream<S>(
    node: Arc<Node>,
    mut stream: S,
    spec: RunSpec,
    peer: Option<String>,
) -> Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let from = peer.clone().unwrap_or_else(|| "its own CLI".into());
    if peer.is_some() {
        let mut load = node.own_load();
        // The published load lags by up to a second; acceptance is known now.
        load.accepting = node.accepting.load(Ordering::Relaxed);
        if let Err(reason) = ferry_policy::admit(&load, 0) {
            tracing::info!(event = "run-refused", from = %from, home_pid = spec.home_pid,
                reason = %reason);
            write_msg(&mut stream, &Msg::Refused { reason }).await?;
            return Ok(());
        }
    }
    // A program run for another node is a guest here: it sees only what a guest may.
    let prog = match Program::start(&node, &spec, peer.is_some()) {
        Ok(p) => p,
        Err(f) => {
            tracing::info!(event = "run-failed", from = %from, home_pid = spec.home_pid,
                code = f.exit_code, error = %f.message);
            write_msg(
                &mut stream,
                &Msg::RunFailed {
                    message: f.message,
                    exit_code: f.exit_code,
                },
            )
            .await?;
            return Ok(());
        }
    };
    let pid = prog.pid;
    node.guests.add(ProcInfo {
        home_node: spec.home_node.clone(),
        node: node.name().to_string(),
        home_pid: spec.home_pid,
        pid,
        uid: spec.uid,
        command: command_line(&spec.argv),
        state: "running".into(),
        kind: crate::migrate::REMOTE_EXEC.into(),
        since_unix_ms: now_unix_ms(),
        home_ids: None,
        forwarded_calls: 0,
        forwarded_us: 0,
        checkpoint_every_secs: spec.checkpoint_every_secs.map(f64::from),
        recovered: None,
        deputies: Vec::new(),
    });
    if spec.balance {
        // `ferry run --balance`: the balancer may move it (crate::balancer; a `ferry run`
        // program moves with its stdio relayed from here: crate::migrate::moving_guest).
        let origin = format!("ferry run --balance from node {}", spec.home_node);
        if let Err(e) = node.balancer.add(pid, &origin, false) {
            tracing::warn!(event = "run-not-balanced", pid, error = %format!("{e:#}"));
        }
    }
    tracing::info!(event = "run-started", from = %from, home = %spec.home_node,
        home_pid = spec.home_pid, pid, uid = spec.uid, tty = spec.tty.is_some(),
        command = %spec.argv[0]);
    let status = session(&node, stream, prog).await;
    node.run_notices.close(pid);
    node.guests.remove(pid);
    match status {
        Some(st) => tracing::info!(event = "run-ended", home_pid = spec.home_pid, pid,
            status = %crate::node::describe_status(st)),
        None => tracing::info!(event = "run-hung-up", home_pid = spec.home_pid, pid),
    }
    Ok(())
}

/// What the caller's side told the output loop.
enum Event {
    /// The caller's connection closed or broke.
    Gone(String),
    /// The caller's stdout (1) or stderr (2) reader went away.
    ReaderClosed(u8),
}

/// Streams the program's I/O until it ends; its wait status, or None if the caller vanished
/// (the program has then been hung up and is gone too).
async fn session<S>(node: &Arc<Node>, stream: S, mut prog: Program) -> Option<i32>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let pid = prog.pid;
    let exit = program_exit(node.clone(), pid, prog.init.take());
    tokio::pin!(exit);
    let (rd, mut wr) = tokio::io::split(stream);
    let started = Msg::Started {
        node: node.name().to_string(),
        pid,
    };
    if write_msg(&mut wr, &started).await.is_err() {
        drop(prog);
        hang_up(pid, exit.as_mut()).await;
        return None;
    }

    let (ev_tx, mut ev_rx) = mpsc::channel::<Event>(4);
    let (in_tx, in_rx) = mpsc::channel::<Vec<u8>>(STDIN_QUEUE);
    let feeder = tokio::spawn(feed_stdin(prog.stdin.take(), in_rx));
    // Set once the program is reaped: its PID may then be anyone's, no signal goes there.
    let ended = Arc::new(AtomicBool::new(false));
    let mut input = tokio::spawn(read_caller(
        rd,
        in_tx,
        ev_tx,
        pid,
        prog.master.clone(),
        ended.clone(),
    ));
    let tty = prog.master.is_some();
    // The program's output is read by a thread of its own (see `Outputs`).
    let mut outputs = match Outputs::start([prog.stdout.take(), prog.stderr.take()]) {
        Ok(o) => o,
        Err(e) => {
            tracing::warn!(event = "run-output-failed", pid, error = %e);
            input.abort();
            feeder.abort();
            drop(prog);
            hang_up(pid, exit.as_mut()).await;
            return None;
        }
    };
    let mut notices = node.run_notices.open(pid);

    let status = loop {
        tokio::select! {
            c = outputs.next() => {
                if outputs.forward(&mut wr, c).await.is_err() {
                    break None;
                }
            }
            st = &mut exit => {
                ended.store(true, Ordering::Relaxed);
                break Some(st);
            }
            Some(line) = notices.recv() => {
                let note = Msg::Io {
                    stream: 2,
                    // A terminal in raw mode needs its carriage return.
                    data: ByteBuf::from(
                        format!("ferry: {line}{}", if tty { "\r\n" } else { "\n" }).into_bytes(),
                    ),
                };
                if write_msg(&mut wr, &note).await.is_err() {
                    break None;
                }
            }
            ev = ev_rx.recv() => match ev {
                Some(Event::ReaderClosed(1)) if !tty => outputs.close(1),
                Some(Event::ReaderClosed(2)) => outputs.close(2),
                Some(Event::ReaderClosed(_)) => {}
                Some(Event::Gone(why)) => {
                    tracing::info!(event = "run-caller-gone", pid, why = %why);
                    break None;
                }
                None => break None,
            },
        }
    };

    let Some(status) = status else {
        input.abort();
        feeder.abort();
        let _ = input.await;
        let _ = feeder.await;
        // Closing the pty master (every copy is gone now) hangs up its session too.
        drop((outputs, prog));
        hang_up(pid, exit.as_mut()).await;
        return None;
    };

    // The program ended: what it wrote is in its pipes (or on its way through the pty). One
    // that moved away (eviction, the balancer: crate::migrate) ended as its body's deputy here:
    // its last output may still be on its way through the relays, so only its end of file, or
    // DRAIN_MAX, ends the wait.
    let moved = node.guests.find(pid).is_none();
    let idle = if moved { DRAIN_MAX } else { DRAIN_IDLE };
    let deadline = Instant::now() + DRAIN_MAX;
    let mut caller_ok = true;
    while outputs.any_open() && Instant::now() < deadline {
        let step = tokio::time::timeout(idle, async {
            let c = outputs.next().await;
            outputs.forward(&mut wr, c).await
        })
        .await;
        match step {
            Ok(Ok(())) => {}
            Ok(Err(())) => {
                caller_ok = false;
                break;
            }
            Err(_) => break,
        }
    }
    feeder.abort();
    drop(ev_rx);
    if caller_ok {
        let mut end = Vec::new();
        for stream in [1, 2] {
            if outputs.is_open(stream) {
                end.push(Msg::IoEnd { stream });
            }
        }
        end.push(exited(status));
        for m in &end {
            if write_msg(&mut wr, m).await.is_err() {
                break;
            }
        }
        let _ = wr.shutdown().await;
        let _ = tokio::time::timeout(LINGER, &mut input).await;
    }
    input.abort();
    drop(outputs);
    Some(status)
}

fn exited(status: i32) -> Msg {
    if libc::WIFSIGNALED(status) {
        Msg::Exited {
            code: None,
            signal: Some(libc::WTERMSIG(status)),
        }
    } else if libc::WIFEXITED(status) {
        Msg::Exited {
            code: Some(libc::WEXITSTATUS(status)),
            signal: None,
        }
    } else {
        // The reaper lost it (-1): report a failure rather than success.
        Msg::Exited {
            code: Some(125),
            signal: None,
        }
    }
}

/// A read of the program's output: `len` bytes of `buf` (0: that stream's end).
struct Chunk {
    stream: u8,
    buf: Vec<u8>,
    len: usize,
}

/// The program's stdout and stderr, read by a thread of its own, which hands what it reads to
/// the session in chunks of up to [`IO_CHUNK`].
///
/// Why a thread: every write into a pipe that anyone ever polled wakes whoever waits on it
/// (since Linux 5.16, for the sake of edge-triggered epoll). Registered with the runtime's
/// epoll, a pipe wakes a worker of the daemon for each write the program makes (each 4 KiB
/// `head` or `cat` writes), even while this side deliberately waits for more. This thread waits
/// in poll(2) only when it means to read, so it is woken once per read; between reads (see
/// [`pace`]) it sleeps where the writer's writes do not reach it.
///
/// Memory stays bounded: at most three buffers (one being filled, one in the channel, one being
/// sent); a caller that reads slowly stops the thread, then the pipe fills and the program
/// blocks. Dropping this ends the thread (its stop pipes hang up), which closes the descriptors.
struct Outputs {
    rx: mpsc::Receiver<Chunk>,
    /// Buffers given back to the thread once sent.
    back: std::sync::mpsc::Sender<Vec<u8>>,
    /// Per stream: open (not yet at its end or closed), and the write end of the pipe whose
    /// hang-up tells the thread to close that stream.
    open: [bool; 2],
    stops: [Option<OwnedFd>; 2],
}

/// The size a read buffer starts at.
const FIRST_BUF: usize = 64 << 10;
/// A read of less than this is a writer's small writes caught as they come.
const PACE_MIN: usize = 64 << 10;
/// A wake-up less than this after the previous read finds the program writing steadily.
const PACE_RECENT: Duration = Duration::from_millis(2);
/// How long such a read waits at most for [`PACE_MIN`] bytes to be there, in steps.
const PACE_WAIT: Duration = Duration::from_millis(1);
const PACE_STEP: Duration = Duration::from_micros(250);

impl Outputs {
    fn start(fds: [Option<OwnedFd>; 2]) -> io::Result<Outputs> {
        let (tx, rx) = mpsc::channel(1);
        let (back, back_rx) = std::sync::mpsc::channel();
        let mut stops = [None, None];
        let mut stop_rds = [None, None];
        for (i, fd) in fds.iter().enumerate() {
            if fd.is_some() {
                let (r, w) = ferry_sys::fdops::pipe2(libc::O_CLOEXEC).map_err(|e| e.io())?;
                stops[i] = Some(w);
                stop_rds[i] = Some(r);
            }
        }
        let open = [fds[0].is_some(), fds[1].is_some()];
        std::thread::Builder::new()
            .name("run-output".into())
            .spawn(move || read_outputs(fds, stop_rds, tx, back_rx))?;
        Ok(Outputs {
            rx,
            back,
            open,
            stops,
        })
    }

    /// The next chunk; waits forever once every stream is done.
    async fn next(&mut self) -> Chunk {
        if !self.any_open() {
            return std::future::pending().await;
        }
        match self.rx.recv().await {
            Some(c) => c,
            None => std::future::pending().await,
        }
    }

    /// Sends `c` to the caller: its bytes as `Io`, or its stream's end as `IoEnd`. Err: the
    /// caller is gone.
    async fn forward<W: AsyncWrite + Unpin>(&mut self, wr: &mut W, c: Chunk) -> Result<(), ()> {
        let i = usize::from(c.stream - 1);
        if !self.open[i] {
            // Closed meanwhile: what was still read is dropped.
            let _ = self.back.send(c.buf);
            return Ok(());
        }
        let r = if c.len > 0 {
            // The bytes go out as they were read, not copied into an encoded message first.
            write_io(wr, c.stream, &c.buf[..c.len]).await.map_err(drop)
        } else {
            self.open[i] = false;
            self.stops[i] = None;
            write_msg(wr, &Msg::IoEnd { stream: c.stream })
                .await
                .map_err(drop)
        };
        let _ = self.back.send(c.buf);
        r
    }

    /// The caller's reader of `stream` went away: its descriptor is closed (the program gets
    /// EPIPE), without an `IoEnd`.
    fn close(&mut self, stream: u8) {
        if let Some(i) = usize::from(stream).checked_sub(1).filter(|i| *i < 2) {
            self.open[i] = false;
            self.stops[i] = None;
        }
    }

    fn is_open(&self, stream: u8) -> bool {
        usize::from(stream)
            .checked_sub(1)
            .is_some_and(|i| self.open.get(i).copied().unwrap_or(false))
    }

    fn any_open(&self) -> bool {
        self.open.iter().any(|o| *o)
    }
}

/// The body of [`Outputs`]' thread.
fn read_outputs(
    mut fds: [Option<OwnedFd>; 2],
    mut stops: [Option<OwnedFd>; 2],
    tx: mpsc::Sender<Chunk>,
    back: std::sync::mpsc::Receiver<Vec<u8>>,
) {
    let mut last: [Option<Instant>; 2] = [None, None];
    let mut spare: Option<Vec<u8>> = None;
    let raw = |f: &Option<OwnedFd>| f.as_ref().map_or(-1, |f| f.as_raw_fd());
    while fds.iter().any(Option::is_some) {
        let polled = [raw(&fds[0]), raw(&fds[1]), raw(&stops[0]), raw(&stops[1])];
        let Ok(rev) = ferry_sys::ns::poll_events(&polled, -1) else {
            return;
        };
        for i in 0..2 {
            if rev[2 + i] != 0 {
                // The session closed this stream.
                fds[i] = None;
                stops[i] = None;
            }
        }
        for i in 0..2 {
            let Some(fd) = fds[i].as_ref().filter(|_| rev[i] != 0) else {
                continue;
            };
            // (A writer that closed its end has said all it will.)
            if rev[i] & libc::POLLHUP == 0 && last[i].is_some_and(|t| t.elapsed() < PACE_RECENT) {
                pace(fd);
            }
            // Buffers start small (most programs write little: a large zeroed allocation
            // per run is a mapping made and unmade) and grow to what is there, once each.
            let want = ferry_sys::fdops::fionread(fd.as_raw_fd())
                .unwrap_or(0)
                .clamp(FIRST_BUF, IO_CHUNK);
            let mut buf = spare
                .take()
                .or_else(|| back.try_recv().ok())
                .unwrap_or_default();
            if buf.len() < want {
                buf.resize(want, 0);
            }
            let len = match ferry_sys::fdops::read_fd(fd.as_raw_fd(), &mut buf) {
                Ok(n) => n,
                Err(e) if e.errno == libc::EAGAIN || e.errno == libc::EINTR => {
                    spare = Some(buf);
                    continue;
                }
                // EIO: a pty master whose slave is closed everywhere; any error ends it.
                Err(_) => 0,
            };
            last[i] = Some(Instant::now());
            if len == 0 {
                fds[i] = None;
                stops[i] = None;
            }
            let c = Chunk {
                stream: i as u8 + 1,
                buf,
                len,
            };
            if tx.blocking_send(c).is_err() {
                return;
            }
        }
    }
}

/// The program wrote a moment ago and may be writing steadily in small pieces: wait until
/// [`PACE_MIN`] bytes are there, or [`PACE_WAIT`] has passed, so that one read (one frame, one
/// wake-up of each process down the line) moves many writes. The pipe holds 1 MiB: the writer
/// does not block meanwhile. Output after a pause (a prompt, a line typed and echoed) is read at
/// once; a steady writer's is held at most about a millisecond.
fn pace(fd: &OwnedFd) {
    let start = Instant::now();
    while start.elapsed() < PACE_WAIT {
        match ferry_sys::fdops::fionread(fd.as_raw_fd()) {
            Ok(n) if n < PACE_MIN => std::thread::sleep(PACE_STEP),
            _ => return,
        }
    }
}

/// Frames from the caller: stdin, its end, signals, window sizes, readers gone.
async fn read_caller<R: AsyncRead + Unpin>(
    mut rd: R,
    stdin: mpsc::Sender<Vec<u8>>,
    events: mpsc::Sender<Event>,
    pid: i32,
    master: Option<Arc<OwnedFd>>,
    ended: Arc<AtomicBool>,
) {
    let mut stdin = Some(stdin);
    loop {
        let frame = match read_frame(&mut rd).await {
            Ok(Frame::Msg(m)) => m,
            Ok(_) => {
                tracing::debug!(pid, "stream frame from a run caller, ignored");
                continue;
            }
            Err(FrameError::Closed) => {
                let _ = events.send(Event::Gone("connection closed".into())).await;
                return;
            }
            Err(e) => {
                let _ = events.send(Event::Gone(e.to_string())).await;
                return;
            }
        };
        match frame {
            Msg::Io { stream: 0, data } => {
                if let Some(tx) = &stdin {
                    if tx.send(data.into_vec()).await.is_err() {
                        stdin = None;
                    }
                }
            }
            Msg::IoEnd { stream: 0 } => stdin = None,
            Msg::IoEnd { stream } => {
                let _ = events.send(Event::ReaderClosed(stream)).await;
            }
            Msg::Signal { signal } if !ended.load(Ordering::Relaxed) => {
                deliver(pid, master.as_deref(), signal)
            }
            Msg::Signal { .. } => {}
            Msg::Resize { rows, cols } => {
                if let Some(m) = &master {
                    if let Err(e) = ferry_sys::tty::set_winsize(m.as_raw_fd(), [rows, cols, 0, 0]) {
                        tracing::debug!(pid, error = %e, "resize");
                    }
                }
            }
            other => tracing::debug!(pid, kind = %kind(&other), "unexpected from a run caller"),
        }
    }
}

/// Writes the caller's stdin to the program; at its end closes the pipe (the program reads
/// end-of-file). A program that closed its stdin makes the rest be discarded.
async fn feed_stdin(fd: Option<Writer>, mut rx: mpsc::Receiver<Vec<u8>>) {
    let Some(mut fd) = fd else {
        while rx.recv().await.is_some() {}
        return;
    };
    while let Some(d) = rx.recv().await {
        if fd.write_all(&d).await.is_err() {
            while rx.recv().await.is_some() {}
            return;
        }
    }
}

/// Delivers a signal the caller received. Those a terminal sends to its foreground process
/// group (INT, QUIT, TSTP, CONT, WINCH) go to the program's process group (with a pty: the
/// pty's foreground group); the others to the program itself. The program leads a session of
/// its own, so its group is orphaned and the kernel would discard a SIGTSTP it does not catch:
/// that one becomes SIGSTOP.
fn deliver(pid: i32, master: Option<&OwnedFd>, sig: i32) {
    if !(1..=64).contains(&sig) {
        return;
    }
    let group = matches!(
        sig,
        libc::SIGINT | libc::SIGQUIT | libc::SIGTSTP | libc::SIGCONT | libc::SIGWINCH
    );
    let pgid = master
        .and_then(|m| ferry_sys::tty::pgrp(m.as_raw_fd()).ok())
        .filter(|p| *p > 0)
        .unwrap_or(pid);
    let sig = if sig == libc::SIGTSTP && !catches(pgid, libc::SIGTSTP) {
        libc::SIGSTOP
    } else {
        sig
    };
    let r = if group {
        ferry_sys::ptrace::kill(-pgid, sig)
    } else {
        ferry_sys::ptrace::kill(pid, sig)
    };
    if let Err(e) = r {
        tracing::debug!(pid, sig, error = %e, "forward signal");
    }
}

/// Whether process `pid` has a handler for `sig` (/proc/PID/status SigCgt).
fn catches(pid: i32, sig: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("SigCgt:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .is_some_and(|mask| mask & (1u64 << (sig - 1)) != 0)
}

/// The caller is gone: SIGHUP (and SIGCONT, should it be stopped) to the program's process
/// group; after [`HANGUP_GRACE`], SIGKILL to what is left of its session and group. Returns
/// the program's wait status.
async fn hang_up(pid: i32, mut exit: Pin<&mut impl Future<Output = i32>>) -> i32 {
    let deadline = Instant::now() + HANGUP_GRACE;
    let _ = ferry_sys::ptrace::kill(-pid, libc::SIGHUP);
    let _ = ferry_sys::ptrace::kill(-pid, libc::SIGCONT);
    let status = match tokio::time::timeout(HANGUP_GRACE, exit.as_mut()).await {
        Ok(st) => st,
        Err(_) => {
            tracing::info!(event = "run-killed", pid, "still running after SIGHUP");
            signal_session(pid, libc::SIGKILL);
            exit.await
        }
    };
    // Its descendants get the rest of the grace period, then SIGKILL too.
    while signal_session(pid, 0) > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    signal_session(pid, libc::SIGKILL);
    status
}

/// Kills the `ferry run` program `pid` runs here, with its session and process group (the
/// last resort of an eviction: crate::evict). Its session reports the SIGKILL to its caller.
pub fn kill_program(node: &Node, pid: i32) {
    // Still ours: its session forgets it only once it is reaped.
    if node
        .guests
        .find(pid)
        .is_none_or(|g| g.kind != crate::migrate::REMOTE_EXEC)
    {
        return;
    }
    let _ = ferry_sys::ptrace::kill(pid, libc::SIGKILL);
    signal_session(pid, libc::SIGKILL);
}

/// Sends `sig` to every process in session `sid` or process group `sid` (0: just count them).
fn signal_session(sid: i32, sig: i32) -> usize {
    let mut n = 0;
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0;
    };
    for e in dir.flatten() {
        let Some(p) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else {
            continue;
        };
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
            continue;
        };
        let f: Vec<&str> = rest.split_whitespace().collect();
        // state, ppid, pgrp, session
        if f.len() < 4 || f[0] == "Z" || f[0] == "X" {
            continue;
        }
        if f[2].parse() == Ok(sid) || f[3].parse() == Ok(sid) {
            n += 1;
            if sig != 0 {
                let _ = ferry_sys::ptrace::kill(p, sig);
            }
        }
    }
    n
}

// ---- Starting the program ----------------------------------------------------------------

/// A program started for a caller, and this side of its stdio.
struct Program {
    pid: i32,
    /// Where the caller's stdin goes: a pipe, or the pty master.
    stdin: Option<Writer>,
    stdout: Option<OwnedFd>,
    stderr: Option<OwnedFd>,
    /// The pty master, for window sizes and its foreground group.
    master: Option<Arc<OwnedFd>>,
    /// A program run for another node: its init (PID 1 of its namespaces, our child) and the
    /// pipe the init reports the program's wait status on.
    init: Option<(i32, OwnedFd)>,
}

/// The program's wait status: its init's word when it has namespaces of its own (the init is
/// reaped all the same; if it died without a word, its own status), else the reaper's.
async fn program_exit(node: Arc<Node>, pid: i32, init: Option<(i32, OwnedFd)>) -> i32 {
    let Some((init, status)) = init else {
        return node.reaper.wait(pid).await;
    };
    let init_exit = tokio::spawn(async move { node.reaper.wait(init).await });
    let mut word = Vec::new();
    if let Ok(r) = reader(status) {
        while word.len() < 4 {
            match read_chunk(&r, 4 - word.len()).await {
                Ok(d) if !d.is_empty() => word.extend_from_slice(&d),
                _ => break,
            }
        }
    }
    match <[u8; 4]>::try_from(word.as_slice()) {
        Ok(w) => i32::from_ne_bytes(w),
        Err(_) => init_exit.await.unwrap_or(-1),
    }
}

/// Why a program could not start, and the exit code `ferry run` reports.
struct Failure {
    message: String,
    exit_code: i32,
}

impl Program {
    fn start(node: &Arc<Node>, spec: &RunSpec, guest: bool) -> Result<Program, Failure> {
        let here = node.name().to_string();
        let fail = |code: i32, what: String| Failure {
            message: format!("node {here}: {what}"),
            exit_code: code,
        };
        let guest_ns = match guest {
            true => node
                .guest_mounts
                .for_guest()
                .map_err(|why| fail(125, why))?,
            false => None,
        };
        let mount_ns = guest_ns.map(|g| g.mnt);
        let user_ns = guest_ns.map(|g| g.user);
        let Some(cmd) = spec.argv.first() else {
            return Err(fail(125, "no command given".into()));
        };
        // Where the program may be; the child looks, as the caller (the daemon never tells a
        // caller whether a file it cannot reach exists).
        let (candidates, search) = candidates(cmd, &spec.env).map_err(|(c, m)| fail(c, m))?;
        let cstr = |s: &str, what: &str| {
            CString::new(s).map_err(|_| fail(125, format!("{what} contains a NUL byte")))
        };
        let argv = spec
            .argv
            .iter()
            .map(|a| cstr(a, "an argument"))
            .collect::<Result<Vec<_>, _>>()?;
        let envp = spec
            .env
            .iter()
            .map(|(k, v)| cstr(&format!("{k}={v}"), "an environment variable"))
            .collect::<Result<Vec<_>, _>>()?;
        let setup = |e: io::Error| fail(125, format!("set up the program's stdio: {e}"));

        // This side's ends, and the child's.
        let (master, stdin, stdout, child_in, child_out);
        let (stderr, child_err);
        if let Some((rows, cols)) = spec.tty {
            let (m, slave) = ferry_sys::spawn::open_pty().map_err(|e| setup(e.io()))?;
            ferry_sys::tty::set_winsize(m.as_raw_fd(), [rows, cols, 0, 0])
                .map_err(|e| setup(e.io()))?;
            // Like a login: the terminal belongs to the user it serves.
            std::os::unix::fs::fchown(&slave, Some(spec.uid), None).map_err(setup)?;
            let slave = std::fs::File::from(slave);
            {
                use std::os::unix::fs::PermissionsExt;
                slave
                    .set_permissions(std::fs::Permissions::from_mode(0o620))
                    .map_err(setup)?;
            }
            let slave = OwnedFd::from(slave);
            stdin = Some(writer(m.try_clone().map_err(setup)?).map_err(setup)?);
            stdout = Some(m.try_clone().map_err(setup)?);
            master = Some(Arc::new(m));
            if spec.stderr_tty {
                child_err = slave.try_clone().map_err(setup)?;
                stderr = None;
            } else {
                let (r, w) = pipe_out().map_err(setup)?;
                child_err = w;
                stderr = Some(r);
            }
            child_in = slave.try_clone().map_err(setup)?;
            child_out = slave;
        } else {
            let (r, w) = ferry_sys::fdops::pipe2(libc::O_CLOEXEC).map_err(|e| setup(e.io()))?;
            child_in = r;
            stdin = Some(writer(w).map_err(setup)?);
            let (r, w) = pipe_out().map_err(setup)?;
            stdout = Some(r);
            child_out = w;
            let (r, w) = pipe_out().map_err(setup)?;
            stderr = Some(r);
            child_err = w;
            master = None;
        }
        let s = Spawn {
            candidates: candidates
                .iter()
                .map(|p| {
                    CString::new(p.as_os_str().as_encoded_bytes())
                        .map_err(|_| fail(125, "the command contains a NUL byte".into()))
                })
                .collect::<Result<_, _>>()?,
            search,
            argv,
            envp,
            cwd: cstr(&spec.cwd, "the directory")?,
            uid: spec.uid,
            gid: spec.gid,
            groups: spec.groups.clone(),
            umask: spec.umask,
            rlimits: spec.rlimits.clone(),
            stdio: [
                child_in.as_raw_fd(),
                child_out.as_raw_fd(),
                child_err.as_raw_fd(),
            ],
            controlling_tty: spec.tty.is_some(),
            sig_ignored: spec.sig_ignored,
            sig_blocked: spec.sig_blocked,
            // The program must not outlive this daemon (its caller could not reach it). The
            // signal is tied to the thread that forked it: the daemon's main thread when the
            // spawner made it (ferry_sys::spawner), else a tokio worker; both live as long as
            // the daemon.
            parent_death_signal: libc::SIGKILL,
            mount_ns,
            user_ns,
        };
        // A program run for another node gets PID, IPC and mount namespaces of its own (a
        // /proc showing only its own processes; when confined, its own /tmp, /run and
        // /dev/shm), under a small init: ferry_sys::guest_spawn.
        let started = if guest {
            let own = ferry_sys::guest_spawn::OwnNamespaces {
                private_tmp: mount_ns.is_some(),
                net_ns: guest_ns.and_then(|g| g.net),
                init_exe: &node.exe,
            };
            match ferry_sys::spawner::get() {
                Some(sp) => sp.spawn_guest(&s, &own),
                None => ferry_sys::guest_spawn::spawn_guest(&s, &own),
            }
            .map(|g| (g.pid, Some((g.init, g.status))))
        } else {
            match ferry_sys::spawner::get() {
                Some(sp) => sp.spawn(&s),
                None => ferry_sys::spawn::spawn(&s),
            }
            .map(|pid| (pid, None))
        };
        let (pid, init) = match started {
            Ok(p) => p,
            Err(e) => {
                if e.pid > 0 {
                    // Let the reaper's record of the failed child be claimed.
                    let node = node.clone();
                    tokio::spawn(async move { node.reaper.wait(e.pid).await });
                }
                return Err(spawn_failure(
                    &e,
                    cmd,
                    &candidates,
                    spec,
                    &here,
                    mount_ns.is_some(),
                ));
            }
        };
        drop((child_in, child_out, child_err));
        Ok(Program {
            pid,
            stdin,
            stdout,
            stderr,
            master,
            init,
        })
    }
}

/// A pipe for the program's output: (our read end, its write end), enlarged.
/// Never registered with the runtime's epoll (see [`Outputs`]).
fn pipe_out() -> io::Result<(OwnedFd, OwnedFd)> {
    let (r, w) = ferry_sys::fdops::pipe2(libc::O_CLOEXEC).map_err(|e| e.io())?;
    let _ = ferry_sys::fdops::set_pipe_size(r.as_raw_fd(), PIPE_SIZE);
    Ok((r, w))
}

fn spawn_failure(
    e: &SpawnError,
    cmd: &str,
    candidates: &[PathBuf],
    spec: &RunSpec,
    here: &str,
    confined: bool,
) -> Failure {
    // What a confined guest cannot find may well be there, outside what it sees.
    let unseen = if confined && matches!(e.errno, libc::ENOENT | libc::ENOTDIR) {
        " (a guest here sees only the shared tree and the system's files)"
    } else {
        ""
    };
    let err = io::Error::from_raw_os_error(e.errno);
    let path = e.candidate.and_then(|i| candidates.get(i));
    let (exit_code, what) = match (e.step, path) {
        (Step::Exec, None) => (127, format!("{cmd}: command not found{unseen}")),
        (Step::Exec, Some(_)) if e.errno == libc::ENOENT || e.errno == libc::ENOTDIR => {
            (127, format!("{cmd}: {err}{unseen}"))
        }
        (Step::Exec, Some(_)) if e.errno == libc::EISDIR => (126, format!("{cmd}: Is a directory")),
        (Step::Exec, Some(p)) => (126, format!("cannot execute {}: {err}", p.display())),
        (Step::Cwd, _) => (
            125,
            format!("cannot change to directory {}: {err}{unseen}", spec.cwd),
        ),
        (step, _) => (
            125,
            format!(
                "cannot start {cmd} as uid {} gid {}: {}: {err}",
                spec.uid,
                spec.gid,
                step.describe()
            ),
        ),
    };
    Failure {
        message: format!("node {here}: {what}"),
        exit_code,
    }
}

/// Where `cmd` may be, as a shell would look: a name with a slash is itself (relative to the
/// cwd); any other is looked for in each directory of the caller's PATH in turn (the `bool`:
/// a search). The child looks, as the caller. Err: (exit code, message).
fn candidates(cmd: &str, env: &[(String, String)]) -> Result<(Vec<PathBuf>, bool), (i32, String)> {
    if cmd.is_empty() {
        return Err((127, "'': command not found".into()));
    }
    if cmd.contains('/') {
        return Ok((vec![PathBuf::from(cmd)], false));
    }
    let path = env
        .iter()
        .find(|(k, _)| k == "PATH")
        .map_or(DEFAULT_PATH, |(_, v)| v.as_str());
    let dirs = path
        .split(':')
        .map(|dir| Path::new(if dir.is_empty() { "." } else { dir }).join(cmd))
        .collect();
    Ok((dirs, true))
}

fn command_line(argv: &[String]) -> String {
    let mut s = argv.join(" ");
    if s.len() > 200 {
        let mut end = 200;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push('…');
    }
    s
}

fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn nonblocking(fd: &OwnedFd) -> io::Result<()> {
    let raw = fd.as_raw_fd();
    let fl = ferry_sys::fdops::get_fl(raw).map_err(|e| e.io())?;
    ferry_sys::fdops::set_fl(raw, fl | libc::O_NONBLOCK).map_err(|e| e.io())
}

/// Our reading end of the program's stdout or stderr (a pipe, or a pty master).
fn reader(fd: OwnedFd) -> io::Result<Reader> {
    nonblocking(&fd)?;
    Reader::from_owned_fd_unchecked(fd)
}

/// Our writing end of the program's stdin (a pipe, or a pty master).
fn writer(fd: OwnedFd) -> io::Result<Writer> {
    nonblocking(&fd)?;
    Writer::from_owned_fd_unchecked(fd)
}

/// Up to `cap` bytes; empty at end-of-file (for a pty master: no slave open any more).
async fn read_chunk(r: &Reader, cap: usize) -> io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    read_into(r, &mut buf, cap).await?;
    Ok(buf)
}

/// Replaces what `buf` holds with up to `cap` bytes read from `r`; empty at end-of-file.
async fn read_into(r: &Reader, buf: &mut Vec<u8>, cap: usize) -> io::Result<()> {
    buf.clear();
    buf.reserve(cap);
    loop {
        r.readable().await?;
        // Read into spare capacity: a chunk is not cleared first (at the pipe's full rate,
        // clearing 256 KiB per read cost as much as the read).
        match r.try_read_buf(buf) {
            Ok(_) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) if e.raw_os_error() == Some(libc::EIO) => return Ok(()),
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(uid: u32, gid: u32, groups: Vec<u32>, home_pid: i32) -> RunSpec {
        RunSpec {
            argv: vec!["true".into()],
            env: vec![],
            cwd: "/".into(),
            umask: 0o022,
            uid,
            gid,
            groups,
            rlimits: vec![],
            tty: None,
            home_node: String::new(),
            home_pid,
            target: None,
            elsewhere: false,
            stderr_tty: false,
            sig_ignored: 0,
            sig_blocked: 0,
            balance: false,
            checkpoint_every_secs: None,
        }
    }

    #[test]
    fn only_root_claims_others() {
        // Root claims anyone.
        assert!(claim_allowed(0, 0, &[], Some(1), &spec(1000, 1000, vec![4], 77)).is_ok());
        // A user claims itself, its groups, its own PID.
        assert!(claim_allowed(
            1000,
            1000,
            &[1000, 27],
            Some(77),
            &spec(1000, 1000, vec![27], 77)
        )
        .is_ok());
        // Not root, not a stranger's uid or group, not another PID.
        let e = claim_allowed(1000, 1000, &[1000], Some(77), &spec(0, 0, vec![], 77)).unwrap_err();
        assert!(e.contains("only root"), "{e}");
        let e =
            claim_allowed(1000, 1000, &[1000], Some(77), &spec(1000, 0, vec![], 77)).unwrap_err();
        assert!(e.contains("group 0"), "{e}");
        let e = claim_allowed(
            1000,
            1000,
            &[1000],
            Some(77),
            &spec(1000, 1000, vec![27], 77),
        )
        .unwrap_err();
        assert!(e.contains("group 27"), "{e}");
        let e =
            claim_allowed(1000, 1000, &[], Some(78), &spec(1000, 1000, vec![], 77)).unwrap_err();
        assert!(e.contains("PID 78"), "{e}");
    }

    #[test]
    fn looks_like_a_shell() {
        let env = vec![("PATH".to_string(), "/nonexistent::/bin".to_string())];
        let (c, search) = candidates("sh", &env).unwrap();
        assert!(search);
        assert_eq!(c, ["/nonexistent/sh", "./sh", "/bin/sh"].map(PathBuf::from));
        let (c, search) = candidates("./x/y", &env).unwrap();
        assert!(!search);
        assert_eq!(c, [PathBuf::from("./x/y")]);
        assert_eq!(candidates("", &env).unwrap_err().0, 127);
        let (c, _) = candidates("ls", &[]).unwrap();
        assert_eq!(c.len(), DEFAULT_PATH.split(':').count());
    }
}
