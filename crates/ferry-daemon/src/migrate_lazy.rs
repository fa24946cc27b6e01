//! The page traffic of a lazy migration (`ferry migrate --memory lazy`, Accent's
//! copy-on-reference): the destination's page server asks for memory (`Msg::PageWant`) on its
//! worker's page link; its daemon passes the request over the migration's connection to the
//! source's daemon, which hands it to the capture worker on its page link; the answer (one
//! `Data` frame, or `Msg::PageError`) comes back the same way.
//!
//! The two daemons relay in two windows of the migration: from the end of the image until the
//! destination's `Rebuilt` (the rebuild itself touches lazy memory: the arguments, each
//! thread's rseq area), and from `Commit` until the destination's `LazyDone` (the copy runs,
//! its faults are served and the rest is pushed). Between them the copy is held stopped and
//! its push waits for the resume, so no page crosses the link. Control messages of either
//! side are handed to the caller, which says what to do with them ([`Step`]).

use crate::workers::{PageLink, Worker};
use anyhow::{anyhow, bail, Result};
use ferry_transport::message::{kind, Stamp};
use ferry_transport::{read_frame, write_data, write_msg, Conn, Frame, FrameError, Msg};
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;

/// Writes one answer's bytes and flushes them: `write_data` leaves the tail of a frame in
/// the TLS session's buffer when the socket is full, and the peer, which asks for nothing
/// more until it has its answer, would wait for it for ever.
async fn write_flushed<W: tokio::io::AsyncWrite + Unpin>(
    w: &mut W,
    d: &[u8],
) -> std::result::Result<(), FrameError> {
    write_data(w, d).await?;
    w.flush().await?;
    Ok(())
}

/// A control message heard while relaying: from the peer daemon or from our worker.
#[derive(Debug)]
pub enum Heard {
    Peer(Msg),
    Worker(Msg),
}

/// What the caller makes of a control message.
pub enum Step<T> {
    /// Keep relaying.
    Go,
    /// Send this to the peer and keep relaying.
    Tell(Msg),
    /// Send this to the peer and stop with this result.
    TellDone(Msg, T),
    /// Stop with this result.
    Done(T),
}

/// Relays page traffic between `pages` (our worker's page link) and the peer on `conn` until
/// `on` says done. Every frame from the page link goes to the peer; from the peer, `Data`,
/// `PageWant`, `PageReply` and `PageError` go to the page link, anything else to `on`, as does every
/// message of `worker`. Nothing at all from the peer for `idle` fails the relay, as does
/// the loss of the connection or of the page link.
pub async fn relay<T>(
    conn: &mut Conn,
    pages: &mut PageLink,
    mut worker: Option<&mut Worker>,
    idle: Duration,
    mut on: impl FnMut(Heard) -> Result<Step<T>>,
) -> Result<T> {
    let peer = conn.peer.clone();
    let (mut crd, mut cwr) = tokio::io::split(&mut conn.stream);
    let (mut prd, mut pwr) = pages.stream.split();
    // Frames are read by futures that live as long as the relay, so that no frame is ever
    // cut in half by a `select!` that picked another branch.
    let (ctx, mut crx) = mpsc::channel::<Result<Frame, FrameError>>(1);
    let (ptx, mut prx) = mpsc::channel::<Result<Frame, FrameError>>(1);
    let conn_reader = async move {
        loop {
            let f = read_frame(&mut crd).await;
            let end = f.is_err();
            if ctx.send(f).await.is_err() || end {
                break;
            }
        }
        std::future::pending::<()>().await
    };
    let pages_reader = async move {
        loop {
            let f = read_frame(&mut prd).await;
            let end = f.is_err();
            if ptx.send(f).await.is_err() || end {
                break;
            }
        }
        std::future::pending::<()>().await
    };
    tokio::pin!(conn_reader, pages_reader);
    let write_timeout = idle.max(Duration::from_secs(5));
    let mut pages_open = true;
    loop {
        let from_worker = async {
            match worker.as_mut() {
                Some(w) => w.next_frame().await,
                None => std::future::pending().await,
            }
        };
        let step = tokio::select! {
            _ = &mut conn_reader => unreachable!("pending"),
            _ = &mut pages_reader => unreachable!("pending"),
            heard = tokio::time::timeout(idle, crx.recv()) => {
                let Ok(heard) = heard else {
                    bail!("node {peer} sent nothing for {:.1} s during the lazy phase", idle.as_secs_f64());
                };
                match heard.unwrap_or(Err(FrameError::Closed)) {
                    Ok(Frame::Data(d)) => {
                        tokio::time::timeout(write_timeout, write_flushed(&mut pwr, &d)).await
                            .map_err(|_| anyhow!("the engine worker took no page for {write_timeout:?}"))?
                            .map_err(|e| anyhow!("the engine worker's page link: {e}"))?;
                        continue;
                    }
                    Ok(Frame::Msg(
                        m @ (Msg::PageWant { .. } | Msg::PageReply { .. } | Msg::PageError { .. }),
                    )) => {
                        tokio::time::timeout(write_timeout, write_msg(&mut pwr, &m)).await
                            .map_err(|_| anyhow!("the engine worker took no request for {write_timeout:?}"))?
                            .map_err(|e| anyhow!("the engine worker's page link: {e}"))?;
                        continue;
                    }
                    Ok(Frame::Msg(m)) => on(Heard::Peer(m))?,
                    Ok(Frame::End) => bail!("node {peer} ended a stream during the lazy phase"),
                    Err(FrameError::Closed) => bail!("lost node {peer}: the connection closed"),
                    Err(e) => bail!("lost node {peer}: {e}"),
                }
            }
            f = prx.recv(), if pages_open => {
                let f = match f.unwrap_or(Err(FrameError::Closed)) {
                    Ok(f) => f,
                    // A worker that ends closes its link: its last word comes on its pipe.
                    Err(FrameError::Closed) if worker.is_some() => {
                        pages_open = false;
                        continue;
                    }
                    Err(FrameError::Closed) => bail!("the engine worker's page link closed (the worker died)"),
                    Err(e) => bail!("the engine worker's page link: {e}"),
                };
                let sent = match &f {
                    Frame::Data(d) => tokio::time::timeout(write_timeout, write_flushed(&mut cwr, d)).await,
                    Frame::Msg(m) => tokio::time::timeout(write_timeout, write_msg(&mut cwr, m)).await,
                    Frame::End => bail!("the engine worker ended a stream on its page link"),
                };
                sent.map_err(|_| anyhow!("node {peer} took nothing for {write_timeout:?}"))?
                    .map_err(|e| anyhow!("lost node {peer}: {e}"))?;
                continue;
            }
            f = from_worker => match f {
                Ok(Frame::Msg(m)) => on(Heard::Worker(m))?,
                Ok(_) => continue,
                Err(FrameError::Closed) => bail!("the engine worker died"),
                Err(e) => bail!("the engine worker: {e}"),
            },
        };
        match step {
            Step::Go => {}
            Step::Tell(m) => {
                tokio::time::timeout(write_timeout, write_msg(&mut cwr, &m))
                    .await
                    .map_err(|_| anyhow!("node {peer} took nothing for {write_timeout:?}"))?
                    .map_err(|e| anyhow!("tell node {peer} {}: {e}", kind(&m)))?;
            }
            Step::TellDone(m, t) => {
                let _ = tokio::time::timeout(write_timeout, write_msg(&mut cwr, &m)).await;
                return Ok(t);
            }
            Step::Done(t) => return Ok(t),
        }
    }
}

/// Source side, at the commit point of a lazy migration (the outcome is recorded): tells the
/// capture worker (the original now dies with it), says `Commit`, and relays the copy's page
/// traffic until the destination says every page is in (`LazyDone`) or that the copy was
/// lost. Fills the report's `resumed_ms` and `lazy`. The caller then kills the original or
/// leaves it as a deputy: its memory is no longer needed.
pub async fn source_phase(
    worker: &mut Worker,
    conn: &mut Conn,
    pages: &mut PageLink,
    idle: Duration,
    t0: std::time::Instant,
    report: &mut ferry_transport::message::MigrateReport,
) -> Result<()> {
    write_msg(&mut worker.tx, &Msg::Committed)
        .await
        .map_err(|e| anyhow!("tell the capture worker of the commit: {e}"))?;
    let to = conn.peer.clone();
    write_msg(&mut conn.stream, &Msg::Commit)
        .await
        .map_err(|e| anyhow!("tell node {to} to resume the tree: {e}"))?;
    report.timeline.push(Stamp::now("source: commit sent"));
    let mut resumed = None;
    let mut resumed_stamp = Stamp::default();
    let r = relay(conn, pages, None, idle, |h| match h {
        Heard::Peer(Msg::Resumed) => {
            resumed = Some(std::time::Instant::now());
            resumed_stamp = Stamp::now("source: heard resumed");
            Ok(Step::Go)
        }
        Heard::Peer(Msg::LazyDone(r)) => Ok(Step::Done(Ok(r))),
        Heard::Peer(Msg::Error { message }) => Ok(Step::Done(Err(message))),
        Heard::Peer(Msg::Abort { reason }) => Ok(Step::Done(Err(reason))),
        Heard::Peer(other) => Ok(Step::Done(Err(format!("node {to} said {}", kind(&other))))),
        Heard::Worker(_) => Ok(Step::Go),
    })
    .await;
    if let Some(at) = resumed {
        report.resumed_ms = at.duration_since(t0).as_secs_f64() * 1e3;
        report.timeline.push(resumed_stamp);
    }
    match r {
        Ok(Ok(mut lazy)) => {
            lazy.source_released_after_resume_ms =
                resumed.map_or(0.0, |at| at.elapsed().as_secs_f64() * 1e3);
            tracing::info!(event = "lazy-done", to = %to, fault_pages = lazy.fault_pages,
                pushed_pages = lazy.pushed_pages, released_ms = lazy.source_released_after_resume_ms);
            report.lazy = Some(lazy);
            Ok(())
        }
        Ok(Err(reason)) => Err(anyhow!("node {to}: {reason}")),
        Err(e) => Err(e),
    }
}

/// Destination side, once the source committed a lazy migration: lets the copy run and
/// relays its page traffic until every page is in. If the source, the link or the page
/// server fails first, the restore worker's page server kills the copy (it cannot run with
/// memory missing) and says why: that is logged and returned, and told to the source.
pub async fn dest_phase(
    node: &std::sync::Arc<crate::node::Node>,
    mut worker: Worker,
    conn: &mut Conn,
    mut pages: PageLink,
    key: &str,
    info: ferry_transport::message::ProcInfo,
    relay_ends: Vec<(u32, std::os::fd::OwnedFd)>,
) -> Result<()> {
    let from = conn.peer.clone();
    let (home_node, home_pid) = (info.home_node.clone(), info.home_pid);
    write_msg(&mut worker.tx, &Msg::Resume).await?;
    let mut running = Some((info, relay_ends));
    let idle = node.config.stream_stall();
    let r = relay(conn, &mut pages, Some(&mut worker), idle, |h| match h {
        Heard::Worker(Msg::Resumed) => {
            if let Some((info, ends)) = running.take() {
                crate::migrate::guest_running(node, info, Some(&from), key, ends);
            }
            Ok(Step::Tell(Msg::Resumed))
        }
        Heard::Worker(Msg::LazyDone(r)) => Ok(Step::TellDone(Msg::LazyDone(r.clone()), Ok(r))),
        Heard::Worker(Msg::Error { message }) => Ok(Step::TellDone(
            Msg::Error {
                message: message.clone(),
            },
            Err(message),
        )),
        Heard::Worker(other) => Ok(Step::Done(Err(format!(
            "the restore worker said {}",
            kind(&other)
        )))),
        Heard::Peer(Msg::Abort { reason }) => {
            Ok(Step::Done(Err(format!("the source gave up: {reason}"))))
        }
        Heard::Peer(other) => Ok(Step::Done(Err(format!(
            "the source said {} during the lazy phase",
            kind(&other)
        )))),
    })
    .await;
    let failure = match r {
        Ok(Ok(r)) => {
            tracing::info!(event = "lazy-done", from = %from, home = %home_node, home_pid,
                fault_pages = r.fault_pages, pushed_pages = r.pushed_pages,
                dependency_ms = r.dependency_ms);
            let _ = conn.stream.shutdown().await;
            return Ok(());
        }
        Ok(Err(reason)) => reason,
        Err(e) => format!("{e:#}"),
    };
    // The page server notices the link's end (at once, or within 100 ms) and kills the copy;
    // its last word says why.
    drop(pages);
    let said = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match crate::migrate::worker_msg(&mut worker).await {
                Ok(Msg::Error { message }) => return Some(message),
                Ok(_) => continue,
                Err(_) => return None,
            }
        }
    })
    .await
    .ok()
    .flatten();
    let why = match said {
        Some(m) if !failure.contains(&m) => format!("{failure}; {m}"),
        _ => failure,
    };
    if running.is_some() {
        node.store.remove_or_log(crate::state::HELD, key);
    }
    tracing::error!(event = "lazy-copy-killed", from = %from, home = %home_node, home_pid,
        error = %why, "a lazy copy lost its source's memory: it was killed, not left running \
        with pages missing");
    let _ = tokio::time::timeout(
        Duration::from_secs(2),
        write_msg(
            &mut conn.stream,
            &Msg::Error {
                message: why.clone(),
            },
        ),
    )
    .await;
    bail!("PID {home_pid} of {home_node}, moved here lazily from {from}: {why}")
}
