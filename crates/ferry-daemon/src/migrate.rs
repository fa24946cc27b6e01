//! Moving a live tree between nodes.
//!
//! Source (`send`): a capture worker checks the tree can move (before anything is frozen), the
//! destination is offered it and may refuse, then the worker freezes the tree and streams its
//! image, which this daemon forwards to the destination frame by frame. The destination
//! (`receive`) feeds the stream to a restore worker, which rebuilds the tree in namespaces of
//! its own and holds it stopped: `Rebuilt`. That message is the commit point: the source kills
//! its copy, says `Commit`, and the destination lets the tree run. Anything that fails before
//! the commit point thaws the original where it was.

use crate::node::Node;
use crate::workers::Worker;
use anyhow::{anyhow, bail, Context, Result};
use ferry_transport::message::{kind, MigrateOffer, MigrateReport, ProcInfo, Rebuilt};
use ferry_transport::{
    read_frame, read_msg, tls, write_data, write_end, write_msg, Conn, Frame, FrameError, Msg,
};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;

/// How long a destination waits for the source's decision after `Rebuilt`.
const COMMIT_TIMEOUT: Duration = Duration::from_secs(30);

fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Sends the tree rooted at `pid` (a PID on this node, or the home PID of a guest here) to
/// node `to`, reporting progress to the CLI on `cli`.
pub async fn send(
    node: Arc<Node>,
    cli: &mut UnixStream,
    pid: i32,
    to: &str,
) -> Result<MigrateReport> {
    let t0 = Instant::now();
    if to == node.name() {
        bail!("PID {pid} is already on node {to}");
    }
    // A guest keeps the identity it got at home; a native process gets this node as home.
    let guest = node.guests.find(pid);
    let host_pid = guest.as_ref().map_or(pid, |g| g.pid);
    let mut report = MigrateReport {
        pid,
        from: node.name().to_string(),
        to: to.to_string(),
        ..Default::default()
    };
    progress(cli, "preflight", 0).await;
    let mut worker = Worker::spawn(
        &node.exe,
        &["__capture-worker".into(), host_pid.to_string()],
    )?;
    let (memory_bytes, uid, command) = match worker_msg(&mut worker).await? {
        Msg::Movable {
            memory_bytes,
            uid,
            command,
        } => (memory_bytes, uid, command),
        Msg::Error { message } => bail!("{message}"),
        other => bail!("capture worker said {}", kind(&other)),
    };
    report.preflight_ms = ms(t0);

    let t1 = Instant::now();
    let id = node.next_id();
    let offer = MigrateOffer {
        id,
        from_node: node.name().to_string(),
        home_node: guest
            .as_ref()
            .map_or_else(|| node.name().to_string(), |g| g.home_node.clone()),
        home_pid: guest.as_ref().map_or(pid, |g| g.home_pid),
        command: guest.as_ref().map_or(command, |g| g.command.clone()),
        uid,
        memory_bytes,
        since_unix_ms: guest.as_ref().map_or_else(now_unix_ms, |g| g.since_unix_ms),
    };
    let mut conn = node.dial(to).await?;
    write_msg(&mut conn.stream, &Msg::MigrateOffer(offer.clone())).await?;
    match read_msg(&mut conn.stream).await {
        Ok(Msg::Accept) => {}
        Ok(Msg::Refused { reason }) => bail!("node {to} refused PID {pid}: {reason}"),
        Ok(other) => bail!("node {to} answered the offer with {}", kind(&other)),
        Err(e) => bail!("node {to} did not answer the offer: {e}"),
    }
    report.offer_ms = ms(t1);
    tracing::info!(event = "migrate-start", id, pid, host_pid, to = %to, memory_bytes);
    if let Some(g) = &guest {
        node.guests.set_state(g.pid, "migrating");
    }

    // From here until the commit point, any failure must thaw the original.
    let mut worker_gave_up = false;
    let outcome = transfer(
        cli,
        &mut worker,
        &mut conn,
        &mut report,
        &mut worker_gave_up,
    )
    .await;
    let (frozen_at, rebuilt) = match outcome {
        Ok(x) => x,
        Err(e) => {
            let _ = write_msg(
                &mut conn.stream,
                &Msg::Abort {
                    reason: format!("{e:#}"),
                },
            )
            .await;
            // A worker that reports an error has already let the tree go, and exits.
            let thawed = if worker_gave_up {
                Ok(())
            } else {
                thaw(&mut worker).await
            };
            if let Some(g) = &guest {
                node.guests.set_state(g.pid, "running");
            }
            // A worker that died let go of the tree as it died (its pipes close a moment
            // before the kernel detaches it).
            let let_go = thawed.is_err() && {
                let mut free = running_free(host_pid);
                for _ in 0..20 {
                    if free {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    free = running_free(host_pid);
                }
                free
            };
            return Err(match thawed {
                Ok(()) => e.context(format!("PID {pid} keeps running on {}", node.name())),
                Err(t) if let_go => e.context(format!(
                    "{t:#}; PID {pid} was let go and keeps running on {}",
                    node.name()
                )),
                Err(t) => e.context(format!("and thawing PID {pid} failed too: {t:#}")),
            });
        }
    };

    // The commit point: the destination holds a complete, rebuilt copy.
    let t4 = Instant::now();
    node.outcomes
        .lock()
        .expect("outcomes lock")
        .insert(id, true);
    write_msg(&mut worker.tx, &Msg::Kill).await?;
    match worker_msg(&mut worker).await {
        Ok(Msg::Killed) => {}
        Ok(other) => tracing::error!(event = "kill-failed", pid, reply = %kind(&other)),
        Err(e) => tracing::error!(event = "kill-failed", pid, error = %format!("{e:#}")),
    }
    if let Some(g) = &guest {
        node.guests.remove(g.pid);
    }
    write_msg(&mut conn.stream, &Msg::Commit)
        .await
        .with_context(|| format!("after commit, tell node {to} to resume PID {pid}"))?;
    node.fault("exit-after-commit");
    match tokio::time::timeout(COMMIT_TIMEOUT, read_msg(&mut conn.stream)).await {
        Ok(Ok(Msg::Resumed)) => {}
        Ok(Ok(other)) => bail!("after commit, node {to} said {}", kind(&other)),
        Ok(Err(e)) => bail!("after commit, lost node {to}: {e}"),
        Err(_) => bail!("after commit, node {to} did not confirm the resume"),
    }
    report.commit_ms = ms(t4);
    report.freeze_ms = ms(frozen_at);
    report.dest_pid = rebuilt.pid;
    report.total_ms = ms(t0);
    tracing::info!(event = "migrated", id, pid, to = %to, dest_pid = rebuilt.pid,
        freeze_ms = report.freeze_ms, wire_bytes = report.wire_bytes);
    Ok(report)
}

/// Freeze, stream, and wait for the destination's `Rebuilt`. Returns when the tree froze.
async fn transfer(
    cli: &mut UnixStream,
    worker: &mut Worker,
    conn: &mut Conn,
    report: &mut MigrateReport,
    worker_gave_up: &mut bool,
) -> Result<(Instant, Rebuilt)> {
    let t2 = Instant::now();
    write_msg(&mut worker.tx, &Msg::Go).await?;
    let mut frozen_at = None;
    let mut last_progress = Instant::now();
    let to = report.to.clone();
    loop {
        let frame = worker
            .next_frame()
            .await
            .map_err(|e| anyhow!("capture worker: {e}"))?;
        match frame {
            Frame::Msg(Msg::Frozen) => {
                frozen_at = Some(Instant::now());
                progress(cli, "capture", 0).await;
            }
            Frame::Data(d) => {
                report.wire_bytes += d.len() as u64 + 5;
                if let Err(e) = write_data(&mut conn.stream, &d).await {
                    // The destination may have given up, and said why, before it closed.
                    if let Some(reason) = reason_given(conn).await {
                        bail!("node {to} could not rebuild the tree: {reason}");
                    }
                    return Err(e).with_context(|| format!("stream the image to node {to}"));
                }
                if last_progress.elapsed() > Duration::from_millis(200) {
                    progress(cli, "transfer", report.wire_bytes).await;
                    last_progress = Instant::now();
                }
            }
            Frame::End => {
                write_end(&mut conn.stream)
                    .await
                    .with_context(|| format!("finish the image for node {to}"))?;
                report.wire_bytes += 5;
            }
            Frame::Msg(Msg::Captured { image_bytes }) => {
                report.image_bytes = image_bytes;
                break;
            }
            Frame::Msg(Msg::Error { message }) => {
                *worker_gave_up = true;
                bail!("{message}")
            }
            Frame::Msg(other) => bail!("capture worker said {}", kind(&other)),
        }
    }
    let frozen_at = frozen_at.ok_or_else(|| anyhow!("capture worker never froze the tree"))?;
    report.transfer_ms = ms(t2);
    progress(cli, "restore", report.wire_bytes).await;
    let t3 = Instant::now();
    let reply = tokio::time::timeout(Duration::from_secs(600), read_msg(&mut conn.stream))
        .await
        .map_err(|_| anyhow!("node {to} did not rebuild the tree within 10 minutes"))?;
    let rebuilt = match reply {
        Ok(Msg::Rebuilt(r)) => r,
        Ok(Msg::Abort { reason }) | Ok(Msg::Refused { reason }) => {
            bail!("node {to} could not rebuild the tree: {reason}")
        }
        Ok(other) => bail!("node {to} answered the image with {}", kind(&other)),
        Err(e) => bail!("lost node {to} while it rebuilt the tree: {e}"),
    };
    report.restore_ms = ms(t3);
    report.dest_load_ms = rebuilt.load_ms;
    report.dest_rebuild_ms = rebuilt.restore_ms;
    Ok((frozen_at, rebuilt))
}

/// After a write to the destination failed: the reason it gave up, if it sent one (an `Abort`
/// it wrote before closing is still there to be read).
async fn reason_given(conn: &mut Conn) -> Option<String> {
    match tokio::time::timeout(Duration::from_secs(1), read_msg(&mut conn.stream)).await {
        Ok(Ok(Msg::Abort { reason } | Msg::Refused { reason })) => Some(reason),
        _ => None,
    }
}

async fn thaw(worker: &mut Worker) -> Result<()> {
    write_msg(&mut worker.tx, &Msg::Thaw).await?;
    loop {
        match worker_msg(worker).await? {
            Msg::Thawed => return Ok(()),
            Msg::Error { message } => bail!("{message}"),
            _ => continue,
        }
    }
}

/// The next message from a worker, skipping any stream data still in the pipe.
async fn worker_msg(worker: &mut Worker) -> Result<Msg> {
    loop {
        match worker.next_frame().await {
            Ok(Frame::Msg(m)) => return Ok(m),
            Ok(_) => continue,
            Err(FrameError::Closed) => bail!("the engine worker (PID {}) died", worker.pid),
            Err(e) => bail!("engine worker (PID {}): {e}", worker.pid),
        }
    }
}

async fn progress(cli: &mut UnixStream, phase: &str, bytes: u64) {
    let _ = write_msg(
        cli,
        &Msg::Progress {
            phase: phase.to_string(),
            bytes,
        },
    )
    .await;
}

/// Whether `pid` exists, is not a zombie, and nothing traces it any more.
fn running_free(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .is_ok_and(|s| !s.contains("State:\tZ") && s.lines().any(|l| l == "TracerPid:\t0"))
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

/// Destination side: admit, rebuild, hold, and run the tree once the source commits.
pub async fn receive(node: Arc<Node>, mut conn: Conn, offer: MigrateOffer) -> Result<()> {
    let from = conn.peer.clone();
    let mut load = node.own_load();
    // The published load lags by up to a second; acceptance is known now.
    load.accepting = node.accepting.load(std::sync::atomic::Ordering::Relaxed);
    if let Err(reason) = ferry_policy::admit(&load, offer.memory_bytes) {
        tracing::info!(event = "refused-guest", from = %from, pid = offer.home_pid, reason = %reason);
        write_msg(&mut conn.stream, &Msg::Refused { reason }).await?;
        return Ok(());
    }
    let mut worker = match Worker::spawn(&node.exe, &["__restore-worker".into()]) {
        Ok(w) => w,
        Err(e) => {
            let reason = format!("{e:#}");
            write_msg(&mut conn.stream, &Msg::Refused { reason }).await?;
            return Err(e);
        }
    };
    write_msg(&mut conn.stream, &Msg::Accept).await?;
    tracing::info!(event = "migrate-in", from = %from, id = offer.id, home = %offer.home_node,
        home_pid = offer.home_pid);

    let rebuilt = match receive_image(&mut conn, &mut worker).await {
        Ok(r) => r,
        Err(e) => {
            // Closing its stdin makes the worker kill whatever it built.
            let reason = format!("{e:#}");
            let _ = write_msg(&mut conn.stream, &Msg::Abort { reason }).await;
            drop(worker);
            return Err(e.context(format!("receive PID {} from {from}", offer.home_pid)));
        }
    };
    if node.fault_at("abort-after-rebuilt") {
        let reason = "fault injected: abort-after-rebuilt".to_string();
        let _ = write_msg(
            &mut worker.tx,
            &Msg::Abort {
                reason: reason.clone(),
            },
        )
        .await;
        let _ = worker_msg(&mut worker).await;
        write_msg(&mut conn.stream, &Msg::Abort { reason }).await?;
        return Ok(());
    }
    write_msg(&mut conn.stream, &Msg::Rebuilt(rebuilt.clone())).await?;
    node.fault("exit-after-rebuilt");

    let decision = tokio::time::timeout(COMMIT_TIMEOUT, read_msg(&mut conn.stream)).await;
    let commit = match decision {
        Ok(Ok(Msg::Commit)) => true,
        Ok(Ok(Msg::Abort { reason })) => {
            tracing::info!(event = "migrate-aborted", from = %from, reason = %reason);
            false
        }
        other => {
            tracing::warn!(event = "source-lost", from = %from, id = offer.id,
                detail = %match other { Ok(Ok(m)) => kind(&m), Ok(Err(e)) => e.to_string(), Err(_) => "timeout".into() });
            ask_outcome(&node, &from, offer.id).await
        }
    };
    if !commit {
        let _ = write_msg(
            &mut worker.tx,
            &Msg::Abort {
                reason: "the source did not commit".into(),
            },
        )
        .await;
        let _ = worker_msg(&mut worker).await;
        return Ok(());
    }
    write_msg(&mut worker.tx, &Msg::Resume).await?;
    match worker_msg(&mut worker).await {
        Ok(Msg::Resumed) => {}
        Ok(Msg::Error { message }) => bail!("resume PID {}: {message}", offer.home_pid),
        Ok(other) => bail!("restore worker said {}", kind(&other)),
        Err(e) => return Err(e),
    }
    node.guests.add(ProcInfo {
        home_node: offer.home_node.clone(),
        node: node.name().to_string(),
        home_pid: offer.home_pid,
        pid: rebuilt.pid,
        uid: offer.uid,
        command: offer.command.clone(),
        state: "running".into(),
        kind: "migrated".into(),
        since_unix_ms: offer.since_unix_ms,
    });
    let _ = write_msg(&mut conn.stream, &Msg::Resumed).await;
    let _ = conn.stream.shutdown().await;
    tracing::info!(event = "guest-running", home = %offer.home_node, home_pid = offer.home_pid,
        pid = rebuilt.pid);
    Ok(())
}

async fn receive_image(conn: &mut Conn, worker: &mut Worker) -> Result<Rebuilt> {
    loop {
        tokio::select! {
            frame = read_frame(&mut conn.stream) => {
                match frame.map_err(|e| anyhow!("image stream: {e}"))? {
                    Frame::Data(d) => {
                        if let Err(e) = write_data(&mut worker.tx, &d).await {
                            return Err(fed_badly(worker, e).await);
                        }
                    }
                    Frame::End => {
                        if let Err(e) = write_end(&mut worker.tx).await {
                            return Err(fed_badly(worker, e).await);
                        }
                        break;
                    }
                    Frame::Msg(Msg::Abort { reason }) => bail!("the source gave up: {reason}"),
                    Frame::Msg(other) => bail!("{} message inside the image stream", kind(&other)),
                }
            }
            early = worker_msg(worker) => {
                match early? {
                    Msg::Error { message } => bail!("{message}"),
                    other => bail!("restore worker said {} before the image ended", kind(&other)),
                }
            }
        }
    }
    match worker_msg(worker).await? {
        Msg::Rebuilt(r) => Ok(r),
        Msg::Error { message } => bail!("{message}"),
        other => bail!("restore worker said {}", kind(&other)),
    }
}

/// A write to the restore worker failed: it has most likely stopped reading after an error (the
/// rebuild fails as soon as it has the tree), which it reported first: that is the reason given.
async fn fed_badly(worker: &mut Worker, e: impl std::fmt::Display) -> anyhow::Error {
    match tokio::time::timeout(Duration::from_secs(2), worker_msg(worker)).await {
        Ok(Ok(Msg::Error { message })) => anyhow!("{message}"),
        _ => anyhow!("feed the restore worker: {e}"),
    }
}

/// After losing the source between `Rebuilt` and `Commit`: ask it how the migration ended.
/// An unreachable source is taken as not committed: its original thaws when its worker loses
/// the daemon, so running our copy could make two.
async fn ask_outcome(node: &Node, from: &str, id: u64) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if let Some(m) = node.membership.find(from) {
            let ask = async {
                let mut c =
                    tls::connect(&node.creds, Some(from), m.id.addr, Duration::from_secs(1))
                        .await?;
                write_msg(&mut c.stream, &Msg::OutcomeQuery { id }).await?;
                match read_msg(&mut c.stream).await? {
                    Msg::Outcome { committed, .. } => Ok(committed),
                    other => Err(anyhow!("unexpected {}", kind(&other))),
                }
            };
            if let Ok(committed) = ask.await {
                return committed;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    false
}
