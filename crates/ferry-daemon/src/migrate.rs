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
use crate::outcomes::{Outcome, Outcomes};
use crate::state;
use crate::workers::Worker;
use anyhow::{anyhow, bail, Context, Result};
use ferry_transport::frame::LZ4;
use ferry_transport::message::{kind, MigrateOffer, MigrateReport, ProcInfo, Rebuilt, Stamp};
use ferry_transport::{
    read_frame, read_msg, tls, write_data, write_data_with, write_end, write_msg, Compressor, Conn,
    Frame, FrameError, Msg,
};
use serde::{Deserialize, Serialize};
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
/// node `to`, reporting progress to the CLI on `cli`. Counted in the metrics either way.
pub async fn send(
    node: Arc<Node>,
    cli: &mut UnixStream,
    pid: i32,
    to: &str,
    memory: &str,
    owner: Option<&ferry_sys::owner::Owner>,
) -> Result<MigrateReport> {
    let t0 = Instant::now();
    let r = send_counted(node.clone(), cli, pid, to, memory, owner).await;
    match &r {
        Ok(_) => node.metrics.migration_out(Ok(t0.elapsed())),
        Err(e) => node.metrics.migration_out(Err(&format!("{e:#}"))),
    }
    r
}

async fn send_counted(
    node: Arc<Node>,
    cli: &mut UnixStream,
    pid: i32,
    to: &str,
    memory: &str,
    owner: Option<&ferry_sys::owner::Owner>,
) -> Result<MigrateReport> {
    let t0 = Instant::now();
    let memory = match memory {
        "" => "auto",
        m @ ("eager" | "precopy" | "lazy" | "auto") => m,
        other => bail!("unknown memory mode {other:?} (eager, precopy, lazy or auto)"),
    };
    if to == node.name() {
        bail!("PID {pid} is already on node {to}");
    }
    // A guest keeps the identity it got at home; a native process gets this node as home.
    // So does a `ferry run` program started here: its stdio are this daemon's pipes to its
    // caller, so this node stays its home (deputies and relays), and its caller's stream goes
    // on through them.
    let run_here = node.guests.find(pid).filter(|g| g.kind == REMOTE_EXEC);
    // Named by its caller's PID or by its own, the program is what moves.
    let pid = run_here.as_ref().map_or(pid, |r| r.pid);
    let guest = moving_guest(&node, pid);
    let host_pid = guest.as_ref().map_or(pid, |g| g.pid);
    let mut report = MigrateReport {
        pid,
        from: node.name().to_string(),
        to: to.to_string(),
        ..Default::default()
    };
    progress(cli, "preflight", 0).await;
    // A tree leaving its home relays the pipes it shares with processes that stay (its deputies
    // stay with them); a guest moving on has no home here to relay from.
    let mut args = vec![
        "__capture-worker".to_string(),
        host_pid.to_string(),
        "--memory".into(),
        memory.into(),
    ];
    if guest.is_none() {
        args.push("--relay-pipes".into());
        // Should it leave deputies here, they wait there for this daemon's successor.
        args.push("--deputies-dir".into());
        args.push(
            crate::deputies::deputies_dir(&node)
                .to_string_lossy()
                .into_owned(),
        );
    }
    // A body moving on: its pipes' relays to its home stop moving bytes while it is captured
    // (what is buffered in their stand-ins moves with the image), and follow it to `to` once
    // it is committed there; a failed move lets them go on (dropping `paused`).
    let mut paused = match &guest {
        Some(g) => Some(
            node.body_relays
                .pause(&g.home_node, g.home_pid)
                .await
                .with_context(|| format!("cannot move PID {pid}"))?,
        ),
        None => None,
    };
    if let Some(p) = &paused {
        args.extend(p.worker_args());
    }
    // For a user: only a tree of theirs moves (checked before and again once it is frozen).
    if let Some(o) = owner {
        args.push(format!("--owner={o}"));
    }
    // `auto` may choose lazy (the capture worker decides, from the tree's size), if the speed
    // memory moves at to `to` is known: the worker then gets a page link too.
    let link_bps = node.links.get(to);
    if let (true, Some(bps)) = (memory == "auto", link_bps) {
        args.push(format!("--link-bps={bps}"));
        args.push(format!(
            "--lazy-above-ms={}",
            node.config.lazy_above_ms.unwrap_or(1000.0)
        ));
    }
    let (mut worker, mut pages) =
        if memory == "lazy" || args.iter().any(|a| a.starts_with("--link-bps")) {
            let (w, p) = Worker::spawn_paged(&node.exe, &args).await?;
            (w, Some(p))
        } else {
            (Worker::spawn(&node.exe, &args)?, None)
        };
    let (memory_bytes, uid, command, in_place, lazy) = match worker_msg(&mut worker).await? {
        Msg::Movable {
            memory_bytes,
            uid,
            command,
            in_place,
            lazy,
        } => (
            memory_bytes,
            uid,
            command,
            in_place,
            lazy || memory == "lazy",
        ),
        Msg::Error { message } => bail!("{message}"),
        other => bail!("capture worker said {}", kind(&other)),
    };
    report.preflight_ms = ms(t0);
    if !lazy {
        // (`auto` chose otherwise: the link goes unused.)
        pages = None;
    }

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
        home_ids: match &guest {
            Some(g) => g.home_ids.clone(),
            None => home_ids(pid),
        },
        compress: if node.config.compress() {
            vec![LZ4.to_string()]
        } else {
            Vec::new()
        },
        lazy,
        in_place: in_place && guest.as_ref().is_some_and(|g| g.home_node == to),
        // A recovered tree moving on keeps saying so.
        recovered: guest.as_ref().and_then(|g| g.recovered.clone()),
    };
    // Until it is decided, a question from the destination decides it: not committed.
    node.outcomes
        .begin(id, to, state::start_time(host_pid).map(|s| (host_pid, s)))
        .context("record the migration")?;
    let _pending = Pending(&node.outcomes, id);
    let mut conn = node.dial(to).await?;
    write_msg(&mut conn.stream, &Msg::MigrateOffer(offer.clone())).await?;
    match read_msg(&mut conn.stream).await {
        Ok(Msg::Accept) => {}
        Ok(Msg::AcceptCompressed { codec }) if codec == LZ4 && !offer.compress.is_empty() => {
            report.compression = codec;
        }
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
    let mut relays = Vec::new();
    let outcome = transfer(
        &node,
        cli,
        &mut worker,
        &mut conn,
        pages.as_mut(),
        &mut report,
        &mut worker_gave_up,
        &mut relays,
    )
    .await
    .and_then(|x| Ok((x, crate::relay::open_home_ends(&relays)?)));
    let ((frozen_at, rebuilt), relay_ends) = match outcome {
        Ok(x) => x,
        Err(e) => {
            // Bounded: a destination that stopped reading takes nothing more.
            let _ = tokio::time::timeout(
                ABORT_TIMEOUT,
                write_msg(
                    &mut conn.stream,
                    &Msg::Abort {
                        reason: format!("{e:#}"),
                    },
                ),
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

    // The commit point: the destination holds a complete, rebuilt copy. The decision is
    // recorded durably before anything acts on it; a destination that asked first (it lost us)
    // has decided it already: not committed.
    let t4 = Instant::now();
    node.fault("exit-before-outcome");
    let root = state::start_time(host_pid).map(|s| (host_pid, s));
    let decided = node.outcomes.decide(
        id,
        Outcome {
            committed: true,
            to: to.to_string(),
            root,
        },
    );
    report.timeline.push(Stamp::now("source: commit recorded"));
    let refusal = match decided {
        Ok(o) if o.committed => None,
        Ok(_) => Some(anyhow!("node {to} gave up waiting for the commit")),
        Err(e) => Some(e.context("record the commit")),
    };
    if let Some(e) = refusal {
        let _ = write_msg(
            &mut conn.stream,
            &Msg::Abort {
                reason: format!("{e:#}"),
            },
        )
        .await;
        let thawed = thaw(&mut worker).await;
        if let Some(g) = &guest {
            node.guests.set_state(g.pid, "running");
        }
        return Err(match thawed {
            Ok(()) => e.context(format!("PID {pid} keeps running on {}", node.name())),
            Err(t) => e.context(format!("and thawing PID {pid} failed too: {t:#}")),
        });
    }
    node.fault("exit-after-outcome");
    // Before the destination hears `Commit` and connects for them.
    node.relays.expect(pid, to, relay_ends);
    if let Some(p) = paused.take() {
        // The body is frozen here: its relays at home switch to `to`.
        p.handoff(to, pid).await;
    }
    if node.fault_at("pause-after-outcome") {
        // Time for a test to kill the capture worker here.
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    // A tree leaving its home leaves its originals there as deputies (crate::deputies); a
    // guest moving on is destroyed here (its deputies stay at its home).
    let deputize = guest.is_none();
    if let Some(g) = &guest {
        // Its end is no news for its home: the body lives on at the destination.
        node.bodies.forget(g.pid);
    }
    // A lazy migration: the copy runs now, and the original stays frozen, its memory served,
    // until the destination has every page; only then is it killed or made a deputy.
    let lazy_outcome = match pages.as_mut() {
        Some(pages) => Some(
            crate::migrate_lazy::source_phase(
                &mut worker,
                &mut conn,
                pages,
                node.config.stream_stall(),
                t0,
                &mut report,
            )
            .await,
        ),
        None => None,
    };
    let order = if deputize { &Msg::Deputize } else { &Msg::Kill };
    let mut deputies = None;
    let killed = match write_msg(&mut worker.tx, order).await {
        Err(e) => Err(anyhow!("tell the capture worker to kill: {e}")),
        Ok(()) => match worker_msg(&mut worker).await {
            Ok(Msg::Killed) => Ok(()),
            Ok(Msg::Deputized { pids }) => {
                deputies = Some(pids);
                Ok(())
            }
            Ok(other) => Err(anyhow!("the capture worker said {}", kind(&other))),
            Err(e) => Err(e),
        },
    };
    if let Err(e) = killed {
        // A worker that died let the original go (thawed): the outcome stands, so it is
        // killed here, if it is still the same process.
        tracing::error!(event = "kill-failed", pid, error = %format!("{e:#}"));
        if let Some((root, start)) = root {
            if state::start_time(root) == Some(start) {
                kill_tree(root);
            }
        }
    }
    if let Some(g) = &guest {
        node.guests.remove(g.pid);
    }
    if let Some(r) = &run_here {
        // Its deputy stays here, no guest any more: ps, the load and eviction count its body
        // where it runs now.
        node.guests.remove(r.pid);
        tracing::info!(event = "run-moved", home = %r.home_node, home_pid = r.home_pid,
            pid, to = %to, "its caller's stream goes on through this node's relays");
    }
    if let Some(pids) = deputies {
        // A `ferry run` program's own checkpoint interval, else this node's.
        let every = run_here.as_ref().and_then(|g| g.checkpoint_every_secs);
        crate::deputies::adopt(node.clone(), worker, pid, pids, to.to_string(), every);
    } else if let Some(g) = guest
        .as_ref()
        .filter(|g| !(g.home_node == to && rebuilt.pid == g.home_pid))
    {
        // Its home learns where the body went (only the node it left may say so); a tree
        // rebuilt at home in place of its deputies (there under its home PID) is its home's
        // own process again.
        let moved = Msg::BodyMoved {
            pid: g.home_pid,
            node: to.to_string(),
        };
        let home = g.home_node.clone();
        let r = if home == node.name() {
            crate::deputies::moved(&node, node.name(), g.home_pid, to)
        } else {
            crate::deputies::ask(&node, &home, moved).await
        };
        if let Err(e) = r {
            tracing::warn!(event = "body-moved-unheard", home = %home, pid = g.home_pid,
                error = %format!("{e:#}"));
        }
    }
    node.fault("exit-after-kill");
    if node.fault_at("pause-after-kill") {
        // Time for a test to cut the link before `Commit` leaves.
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    // Past the commit point the migration has happened, whatever the link does now: a
    // destination that misses our `Commit` asks (or, if we are declared dead, runs its copy).
    let confirmed = if let Some(lazy) = &lazy_outcome {
        if let Err(e) = lazy {
            if report.resumed_ms > 0.0 {
                node.outcomes.settle(id);
            }
            tracing::error!(event = "lazy-phase-failed", id, pid, to = %to, error = %format!("{e:#}"));
            let ran = if report.resumed_ms > 0.0 {
                format!(
                    " (it ran there {:.1} ms after the migration started)",
                    report.resumed_ms
                )
            } else {
                String::new()
            };
            return Err(anyhow!(
                "PID {pid} moved to {to} with --memory lazy{ran}, but its lazy phase failed \
                 and the copy cannot run without the source's memory: it was killed, and the \
                 original with it (the risk of post-copy, docs/limitations.md): {e:#}"
            ));
        }
        Ok(())
    } else if node.fault_at("cut-link-after-kill") {
        Err(anyhow!("fault injected: cut-link-after-kill"))
    } else {
        let t = confirm(&mut conn, to, &node).await;
        report.resumed_ms = ms(t0);
        report.timeline.push(Stamp::now("source: heard resumed"));
        t
    };
    match confirmed {
        Ok(()) => node.outcomes.settle(id),
        Err(e) => tracing::warn!(event = "commit-unconfirmed", id, pid, to = %to,
            error = %format!("{e:#}"), "the copy runs once its node learns the outcome"),
    }
    report.commit_ms = ms(t4);
    report.freeze_ms = if lazy && report.resumed_ms > 0.0 {
        // Stopped from the freeze until the copy ran (the lazy phase came after).
        report.resumed_ms - frozen_at.duration_since(t0).as_secs_f64() * 1e3
    } else {
        ms(frozen_at)
    };
    report.dest_pid = rebuilt.pid;
    report.total_ms = ms(t0);
    // Steps of the two nodes in the order they happened (on one clock, a local cluster's).
    report.timeline.sort_by_key(|s| s.unix_us);
    tracing::info!(event = "migrated", id, pid, to = %to, dest_pid = rebuilt.pid,
        freeze_ms = report.freeze_ms, wire_bytes = report.wire_bytes);
    learn_link(&node, to, &report);
    Ok(report)
}

/// Remembers how fast memory moved to `to` in a migration that moved at least 8 MiB of it:
/// the image's stream (eager), the first pre-copy round (all memory, the tree running), or
/// the lazy phase (the destination's page server received its bytes from the resume until the
/// source was released).
fn learn_link(node: &Node, to: &str, r: &MigrateReport) {
    const ENOUGH: f64 = 8.0 * 1048576.0;
    let rate = |bytes: f64, ms: f64| (bytes >= ENOUGH && ms > 0.0).then(|| bytes / (ms / 1e3));
    let bps = match (&r.lazy, r.memory.rounds.first()) {
        (Some(l), _) => rate(l.source_bytes as f64, l.source_released_after_resume_ms),
        (None, Some(round)) => rate(round.sent_bytes as f64, round.ms),
        (None, None) => rate(r.image_bytes as f64, r.transfer_ms),
    };
    if let Some(bps) = bps {
        node.links.learn(to, bps);
    }
}

/// What `ferry ps` calls a `ferry run` program (crate::exec).
pub const REMOTE_EXEC: &str = "remote-exec";

/// The guest entry PID `pid` moves under: a tree that came here by migration keeps its home's
/// identity; a native process, or a `ferry run` program started here (its stdio are this
/// daemon's, relayed once it moves), has this node as its home (None).
pub fn moving_guest(node: &Node, pid: i32) -> Option<ProcInfo> {
    node.guests.find(pid).filter(|g| g.kind != REMOTE_EXEC)
}

/// Removes a migration from those under way however `send` ends.
struct Pending<'a>(&'a Outcomes, u64);

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        self.0.end(self.1);
    }
}

/// Says `Commit` and waits for the destination's `Resumed`.
async fn confirm(conn: &mut Conn, to: &str, node: &Node) -> Result<()> {
    write_msg(&mut conn.stream, &Msg::Commit)
        .await
        .with_context(|| format!("tell node {to} to resume the tree"))?;
    node.fault("exit-after-commit");
    match tokio::time::timeout(COMMIT_TIMEOUT, read_msg(&mut conn.stream)).await {
        Ok(Ok(Msg::Resumed)) => Ok(()),
        Ok(Ok(other)) => bail!("node {to} said {}", kind(&other)),
        Ok(Err(e)) => bail!("lost node {to}: {e}"),
        Err(_) => bail!("node {to} did not confirm the resume"),
    }
}

/// Freeze, stream, and wait for the destination's `Rebuilt`. Returns when the tree froze.
#[allow(clippy::too_many_arguments)]
async fn transfer(
    node: &Node,
    cli: &mut UnixStream,
    worker: &mut Worker,
    conn: &mut Conn,
    pages: Option<&mut crate::workers::PageLink>,
    report: &mut MigrateReport,
    worker_gave_up: &mut bool,
    relays: &mut Vec<ferry_transport::message::RelayedPipe>,
) -> Result<(Instant, Rebuilt)> {
    let t2 = Instant::now();
    write_msg(&mut worker.tx, &Msg::Go).await?;
    if node.fault_at("stop-capture-worker") {
        // A capture worker stuck (as one once was, waiting for a thread that ran on).
        let _ = ferry_sys::ptrace::kill(worker.pid, libc::SIGSTOP);
    }
    let mut frozen_at = None;
    let mut last_progress = Instant::now();
    let to = report.to.clone();
    let stall = node.config.stream_stall();
    let mut first_data = true;
    // Compressed frames where they pay, if the destination said it reads them.
    let mut compressor = (report.compression == LZ4).then(Compressor::default);
    loop {
        // A capture worker streams as it captures: one silent for as long as a stalled stream
        // is stuck (with the tree frozen, and a destination that gives up too). Killed, it
        // lets the tree go (the error path below checks that it runs freely).
        let Ok(frame) = tokio::time::timeout(stall, worker.next_frame()).await else {
            let _ = ferry_sys::ptrace::kill(worker.pid, libc::SIGKILL);
            bail!(
                "the capture worker (PID {}) sent nothing for {:.1} s (stream_stall_secs) and \
                 was killed",
                worker.pid,
                stall.as_secs_f64()
            );
        };
        let frame = frame.map_err(|e| anyhow!("capture worker: {e}"))?;
        match frame {
            Frame::Msg(Msg::MemoryPlan(plan)) => {
                report.memory = plan;
                progress(cli, "freeze", report.wire_bytes).await;
            }
            Frame::Msg(Msg::Frozen) => {
                frozen_at = Some(Instant::now());
                progress(cli, "capture", 0).await;
            }
            Frame::Data(d) => {
                if first_data {
                    first_data = false;
                    if node.fault_at("stall-image-send") {
                        // The source stops sending mid-image, its connection open.
                        tokio::time::sleep(stall * 2).await;
                    }
                }
                // A destination that stops reading must not hold the frozen tree forever.
                let sent = async {
                    match &mut compressor {
                        Some(c) => {
                            let before = c.wire_bytes;
                            write_data_with(&mut conn.stream, c, &d).await?;
                            Ok::<u64, FrameError>(c.wire_bytes - before)
                        }
                        None => write_data(&mut conn.stream, &d)
                            .await
                            .map(|()| d.len() as u64 + 5),
                    }
                };
                let Ok(written) = tokio::time::timeout(stall, sent).await else {
                    bail!(
                        "node {to} took nothing of the image for {:.1} s after {} bytes \
                         (stream stalled; stream_stall_secs)",
                        stall.as_secs_f64(),
                        report.wire_bytes
                    );
                };
                match written {
                    Ok(n) => report.wire_bytes += n,
                    Err(e) => {
                        // The destination may have given up, and said why, before it closed.
                        if let Some(reason) = reason_given(conn).await {
                            bail!("node {to} could not rebuild the tree: {reason}");
                        }
                        return Err(e).with_context(|| format!("stream the image to node {to}"));
                    }
                }
                if last_progress.elapsed() > Duration::from_millis(200) {
                    progress(cli, "transfer", report.wire_bytes).await;
                    last_progress = Instant::now();
                }
            }
            Frame::End => {
                tokio::time::timeout(stall, write_end(&mut conn.stream))
                    .await
                    .map_err(|_| {
                        anyhow!(
                            "node {to} took nothing for {:.1} s (stream stalled)",
                            stall.as_secs_f64()
                        )
                    })?
                    .with_context(|| format!("finish the image for node {to}"))?;
                report.wire_bytes += 5;
            }
            Frame::Msg(Msg::Captured {
                image_bytes,
                relays: r,
                timeline,
            }) => {
                report.image_bytes = image_bytes;
                *relays = r;
                report.timeline.extend(timeline);
                report.timeline.push(Stamp::now("source: image sent"));
                break;
            }
            Frame::Msg(Msg::CapturedMemory {
                frozen_bytes,
                inherited_bytes,
            }) => {
                report.memory.frozen_bytes = frozen_bytes;
                report.memory.inherited_bytes = inherited_bytes;
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
    let reply = match pages {
        // The rebuild asks for lazy memory meanwhile.
        Some(pages) => {
            use crate::migrate_lazy::{relay, Heard, Step};
            relay(conn, pages, None, Duration::from_secs(600), |h| {
                Ok(Step::Done(match h {
                    Heard::Peer(m) | Heard::Worker(m) => Ok(m),
                }))
            })
            .await
            .map_err(|e| e.context(format!("node {to} rebuilding the tree")))?
        }
        None => tokio::time::timeout(Duration::from_secs(600), read_msg(&mut conn.stream))
            .await
            .map_err(|_| anyhow!("node {to} did not rebuild the tree within 10 minutes"))?,
    };
    let rebuilt = match reply {
        Ok(Msg::Rebuilt(mut r)) => {
            report.timeline.append(&mut r.timeline);
            report.timeline.push(Stamp::now("source: heard rebuilt"));
            r
        }
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
pub(crate) async fn worker_msg(worker: &mut Worker) -> Result<Msg> {
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

/// What the home says of native process `pid` about to leave it: the host name, and its
/// parent, process group and session (read from /proc/PID/stat). None if it is gone.
pub(crate) fn home_ids(pid: i32) -> Option<ferry_transport::message::HomeIds> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) state ppid pgrp session ...": comm may hold anything but its last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<i32> = rest
        .split_whitespace()
        .skip(1)
        .take(3)
        .filter_map(|x| x.parse().ok())
        .collect();
    let [ppid, pgid, sid] = f[..] else {
        return None;
    };
    Some(ferry_transport::message::HomeIds {
        hostname: crate::node::hostname(),
        ppid,
        pgid,
        sid,
    })
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

/// Destination side: admit, rebuild, hold, and run the tree once the source commits.
pub async fn receive(node: Arc<Node>, mut conn: Conn, offer: MigrateOffer) -> Result<()> {
    let t0 = Instant::now();
    let from = conn.peer.clone();
    let mut load = node.own_load();
    // The published load lags by up to a second; acceptance is known now. A tree coming home
    // is always taken back: home is where it would have run anyway (eviction sends it here).
    load.accepting =
        node.accepting.load(std::sync::atomic::Ordering::Relaxed) || offer.home_node == node.name();
    if let Err(reason) = ferry_policy::admit(&load, offer.memory_bytes) {
        tracing::info!(event = "refused-guest", from = %from, pid = offer.home_pid, reason = %reason);
        write_msg(&mut conn.stream, &Msg::Refused { reason }).await?;
        return Ok(());
    }
    // A body of the same tree still here is one its home gave up for dead (this node was
    // frozen or cut off meanwhile) and has killed as soon as it hears from us
    // (crate::recovery::fence): the tree must not come back beside it, and be killed for it.
    let old_body = node
        .bodies
        .host_pid(&offer.home_node, offer.home_pid)
        .map(|host| format!("PID {host}"))
        .or_else(|| {
            // Its root may have ended there, the processes it forked running on.
            node.bodies
                .namespace_of(&offer.home_node, offer.home_pid)
                .map(|ns| format!("its PID namespace {ns}"))
        });
    if let Some(old) = old_body {
        let reason = format!(
            "a body of PID {} from {} already runs here ({old}): one its home took this \
             node for dead and rebuilt elsewhere; it is killed once the home hears from us",
            offer.home_pid, offer.home_node
        );
        tracing::warn!(event = "refused-guest", from = %from, pid = offer.home_pid, reason = %reason);
        write_msg(&mut conn.stream, &Msg::Refused { reason }).await?;
        return Ok(());
    }
    // A tree coming home from the node running its body, fit to be rebuilt in place of its
    // deputies: the restore worker asks for them to be let go once it knows the image's tree
    // fits (ferry_deputy::home::Deputies::release); any other comes home as a body beside
    // them, as to any other node.
    let mut home_coming = None;
    if offer.in_place && !offer.lazy && offer.home_node == node.name() {
        if let Some(pids) = node.deputies.tree_of(&from, offer.home_pid) {
            tracing::info!(event = "coming-home", from = %from, pid = offer.home_pid,
                deputies = ?pids);
            home_coming = Some(HomeComing {
                node: node.clone(),
                from: from.clone(),
                pid: offer.home_pid,
                deputies: pids,
                released: false,
                done: false,
            });
        }
    }
    let reports = node.config.data_dir.join(crate::deputies::REPORT_SOCKET);
    let mut worker_args = vec![
        "__restore-worker".to_string(),
        "--reports".to_string(),
        reports.to_string_lossy().into_owned(),
    ];
    // A node held to a CPU quota keeps its guests in it.
    if let Some(cg) = &node.config.cpu_cgroup {
        worker_args.push("--cpu-cgroup".to_string());
        worker_args.push(cg.to_string_lossy().into_owned());
    }
    if let Some(h) = &home_coming {
        // (Rebuilt as a body with the arguments below if the image's tree does not fit.)
        let pids: Vec<String> = h.deputies.iter().map(i32::to_string).collect();
        worker_args.push(format!("--adopt={}", pids.join(",")));
    }
    if let Some(h) = &offer.home_ids {
        // A body: its forwarded calls are answered with its home's values.
        // (`--name=value`: a host name from a peer may start with a dash.)
        worker_args.extend([
            format!("--hostname={}", h.hostname),
            format!("--home={} {} {} {}", offer.home_pid, h.ppid, h.pgid, h.sid),
        ]);
        // A guest away from home sees only the shared tree and the system's files here, never
        // what this node keeps to itself (its data directory and credentials included).
        if offer.home_node != node.name() && crate::confine::confines(&node.config) {
            worker_args.extend(crate::confine::guest_init_args(&node.config));
        }
    }
    if offer.lazy {
        worker_args.extend([
            format!("--lazy-from={from}"),
            format!(
                "--stall-secs={}",
                node.config.stream_stall().as_secs().max(1)
            ),
        ]);
    }
    let spawned = if offer.lazy {
        Worker::spawn_paged(&node.exe, &worker_args)
            .await
            .map(|(w, p)| (w, Some(p)))
    } else {
        Worker::spawn(&node.exe, &worker_args).map(|w| (w, None))
    };
    let (mut worker, mut pages) = match spawned {
        Ok(w) => w,
        Err(e) => {
            let reason = format!("{e:#}");
            write_msg(&mut conn.stream, &Msg::Refused { reason }).await?;
            return Err(e);
        }
    };
    let accept = if node.config.compress() && offer.compress.iter().any(|c| c == LZ4) {
        Msg::AcceptCompressed {
            codec: LZ4.to_string(),
        }
    } else {
        Msg::Accept
    };
    write_msg(&mut conn.stream, &accept).await?;
    tracing::info!(event = "migrate-in", from = %from, id = offer.id, home = %offer.home_node,
        home_pid = offer.home_pid);

    let rebuilt = match receive_image(
        &node,
        &from,
        &mut conn,
        &mut worker,
        pages.as_mut(),
        &mut home_coming,
    )
    .await
    {
        Ok(r) => r,
        Err(e) => {
            // Closing its stdin makes the worker kill whatever it built.
            let reason = format!("{e:#}");
            let _ = tokio::time::timeout(
                ABORT_TIMEOUT,
                write_msg(&mut conn.stream, &Msg::Abort { reason }),
            )
            .await;
            drop(worker);
            return Err(e.context(format!("receive PID {} from {from}", offer.home_pid)));
        }
    };
    // The relay's ends of relayed pipes, taken before the worker may let them go.
    let relay_ends = match crate::relay::take_from_worker(worker.pid, &rebuilt.relays) {
        Ok(e) => e,
        Err(e) => {
            abort_rebuilt(&mut worker, &mut conn, format!("{e:#}")).await?;
            return Err(e);
        }
    };
    if node.fault_at("abort-after-rebuilt") {
        let reason = "fault injected: abort-after-rebuilt".to_string();
        abort_rebuilt(&mut worker, &mut conn, reason).await?;
        return Ok(());
    }
    let info = ProcInfo {
        home_node: offer.home_node.clone(),
        node: node.name().to_string(),
        home_pid: offer.home_pid,
        pid: rebuilt.pid,
        uid: offer.uid,
        command: offer.command.clone(),
        state: "running".into(),
        kind: "migrated".into(),
        since_unix_ms: offer.since_unix_ms,
        home_ids: offer.home_ids.clone(),
        forwarded_calls: 0,
        forwarded_us: 0,
        checkpoint_every_secs: None,
        recovered: offer.recovered.clone(),
    };
    // The copy is recorded before anyone may act on it: a restarted daemon finds it (its worker
    // resumes it should this daemon die now) and asks the source what became of it.
    let key = offer.id.to_string();
    let held = Held {
        id: offer.id,
        from: from.clone(),
        start_time: state::start_time(rebuilt.pid).unwrap_or(0),
        info: info.clone(),
    };
    if let Err(e) = node.store.put(state::HELD, &key, &held) {
        let reason = format!("record the rebuilt copy: {e:#}");
        abort_rebuilt(&mut worker, &mut conn, reason).await?;
        return Err(e);
    }
    write_msg(&mut conn.stream, &Msg::Rebuilt(rebuilt.clone())).await?;
    node.fault("exit-after-rebuilt");

    let decision = if node.fault_at("cut-link-after-rebuilt") {
        // As if the link were cut: nothing more from the source on this connection.
        let _ = conn.stream.shutdown().await;
        None
    } else {
        Some(tokio::time::timeout(COMMIT_TIMEOUT, read_msg(&mut conn.stream)).await)
    };
    let decision = match decision {
        Some(d) => d,
        None => {
            let commit = await_outcome(&node, &from, offer.id).await;
            if let Some(h) = home_coming.as_mut().filter(|h| h.released && commit) {
                h.done = true;
                let r = finish_home_coming(&node, worker, &key, &info, None).await;
                if r.is_ok() {
                    node.metrics.migration_in(t0);
                }
                return r;
            }
            let r = finish_held(&node, worker, commit, &key, info, None, relay_ends, pages).await;
            if commit && r.is_ok() {
                node.metrics.migration_in(t0);
            }
            return r;
        }
    };
    let commit = match decision {
        Ok(Ok(Msg::Commit)) => true,
        Ok(Ok(Msg::Abort { reason })) => {
            tracing::info!(event = "migrate-aborted", from = %from, reason = %reason);
            false
        }
        other => {
            tracing::warn!(event = "source-lost", from = %from, id = offer.id,
                detail = %match other { Ok(Ok(m)) => kind(&m), Ok(Err(e)) => e.to_string(), Err(_) => "timeout".into() });
            await_outcome(&node, &from, offer.id).await
        }
    };
    if let Some(h) = home_coming.as_mut().filter(|h| h.released && commit) {
        // Home again: an ordinary process, no guest here.
        h.done = true;
        let r = finish_home_coming(&node, worker, &key, &info, Some(&mut conn)).await;
        if r.is_ok() {
            node.metrics.migration_in(t0);
        }
        return r;
    }
    let r = finish_held(
        &node,
        worker,
        commit,
        &key,
        info,
        Some(&mut conn),
        relay_ends,
        pages,
    )
    .await;
    if commit && r.is_ok() {
        node.metrics.migration_in(t0);
    }
    r
}

/// A tree coming home whose deputies were let go for its rebuild. Should the migration fail
/// from here on, the rebuild (and so the deputies it took over) is killed, and the parents at
/// home see SIGKILL: the body, which its source thaws, is then killed too, so that no body
/// runs on with nobody at home (a log line says so on both sides).
struct HomeComing {
    node: Arc<Node>,
    from: String,
    pid: i32,
    deputies: Vec<i32>,
    /// The deputies were let go (before that, a failure leaves them as they were).
    released: bool,
    /// The process runs at home again (or the commit made the source destroy its body).
    done: bool,
}

impl Drop for HomeComing {
    fn drop(&mut self) {
        if self.done || !self.released {
            return;
        }
        tracing::error!(event = "home-coming-failed", pid = self.pid, from = %self.from,
            "the tree's deputies were let go for its rebuild: it is killed on both sides");
        for &p in &self.deputies {
            // Those the restore took over died with it; one still parked dies here.
            if let Ok(fd) = ferry_sys::pidfd::pidfd_open(p) {
                let _ = ferry_sys::pidfd::pidfd_send_signal(&fd, libc::SIGKILL);
            }
        }
        let (node, from, pid) = (self.node.clone(), self.from.clone(), self.pid);
        tokio::spawn(async move {
            let kill = Msg::SignalBody {
                pid,
                sig: libc::SIGKILL,
                queued: None,
            };
            let r = tokio::time::timeout(
                Duration::from_secs(10),
                crate::deputies::ask(&node, &from, kill),
            )
            .await;
            if !matches!(r, Ok(Ok(()))) {
                tracing::warn!(event = "home-coming-body-not-killed", pid, from = %from,
                    "the body may still be frozen or thawed there");
            }
        });
    }
}

/// Lets a tree rebuilt in place of its deputies run: it is an ordinary process at home again.
async fn finish_home_coming(
    node: &Arc<Node>,
    mut worker: Worker,
    key: &str,
    info: &ProcInfo,
    conn: Option<&mut Conn>,
) -> Result<()> {
    node.fault("exit-before-resume");
    write_msg(&mut worker.tx, &Msg::Resume).await?;
    let r = match worker_msg(&mut worker).await {
        Ok(Msg::Resumed) => Ok(()),
        Ok(Msg::Error { message }) => Err(anyhow!("resume PID {}: {message}", info.home_pid)),
        Ok(other) => Err(anyhow!("restore worker said {}", kind(&other))),
        Err(e) => Err(e),
    };
    node.store.remove_or_log(state::HELD, key);
    r?;
    tracing::info!(
        event = "home-again",
        pid = info.home_pid,
        pid_here = info.pid
    );
    if let Some(conn) = conn {
        let _ = write_msg(&mut conn.stream, &Msg::Resumed).await;
        let _ = conn.stream.shutdown().await;
    }
    Ok(())
}

/// Gives up a copy rebuilt here before it was recorded: the restore worker kills it, and the
/// source hears why.
async fn abort_rebuilt(worker: &mut Worker, conn: &mut Conn, reason: String) -> Result<()> {
    let _ = write_msg(
        &mut worker.tx,
        &Msg::Abort {
            reason: reason.clone(),
        },
    )
    .await;
    let _ = worker_msg(worker).await;
    write_msg(&mut conn.stream, &Msg::Abort { reason }).await?;
    Ok(())
}

/// A copy rebuilt here and held until its source decides (crate::state::HELD).
#[derive(Serialize, Deserialize)]
struct Held {
    id: u64,
    from: String,
    /// The copy's root here (`info.pid`) and its start time.
    start_time: u64,
    info: ProcInfo,
}

/// Lets the held copy run (`commit`) or throws it away, then forgets its record. A lazy copy
/// (`pages`) is served from its source meanwhile, until every page is in.
#[allow(clippy::too_many_arguments)]
async fn finish_held(
    node: &Arc<Node>,
    mut worker: Worker,
    commit: bool,
    key: &str,
    info: ProcInfo,
    conn: Option<&mut Conn>,
    relay_ends: Vec<(u32, std::os::fd::OwnedFd)>,
    pages: Option<crate::workers::PageLink>,
) -> Result<()> {
    let commit = match (&pages, &conn) {
        (Some(_), None) if commit => {
            // The source is lost (declared dead): it held the memory this copy lacks.
            tracing::error!(event = "lazy-copy-lost", home = %info.home_node,
                home_pid = info.home_pid, "the source of a lazy migration is lost before the \
                copy ran: the copy cannot get its memory and is thrown away");
            false
        }
        _ => commit,
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
        node.store.remove_or_log(state::HELD, key);
        return Ok(());
    }
    node.fault("exit-before-resume");
    let conn = match (pages, conn) {
        (Some(pages), Some(conn)) => {
            return crate::migrate_lazy::dest_phase(
                node, worker, conn, pages, key, info, relay_ends,
            )
            .await;
        }
        (_, conn) => conn,
    };
    write_msg(&mut worker.tx, &Msg::Resume).await?;
    match worker_msg(&mut worker).await {
        Ok(Msg::Resumed) => {}
        Ok(Msg::Error { message }) => bail!("resume PID {}: {message}", info.home_pid),
        Ok(other) => bail!("restore worker said {}", kind(&other)),
        Err(e) => return Err(e),
    }
    guest_running(
        node,
        info,
        conn.as_ref().map(|c| c.peer.as_str()),
        key,
        relay_ends,
    );
    if let Some(conn) = conn {
        let _ = write_msg(&mut conn.stream, &Msg::Resumed).await;
        let _ = conn.stream.shutdown().await;
    }
    Ok(())
}

/// A copy that runs here now: a body of its home, a guest of this node, its relays dialled
/// home; its held record goes.
pub(crate) fn guest_running(
    node: &Arc<Node>,
    info: ProcInfo,
    peer: Option<&str>,
    key: &str,
    relay_ends: Vec<(u32, std::os::fd::OwnedFd)>,
) {
    tracing::info!(event = "guest-running", home = %info.home_node, home_pid = info.home_pid,
        pid = info.pid);
    node.bodies.add(info.pid, &info.home_node, info.home_pid);
    crate::deputies::watch_supervisor(node.clone(), info.pid);
    crate::relay::dial_home(
        node.clone(),
        info.home_node.clone(),
        info.home_pid,
        relay_ends,
    );
    if let Some(peer) = peer {
        // Its balancer may hand it to ours (crate::balancer::adopt).
        node.balancer.arrived(peer, &info.home_node, info.home_pid);
    }
    node.guests.add(info);
    node.store.remove_or_log(state::HELD, key);
}

/// Takes up what the last run of this daemon left undone; called at start, before any peer
/// can ask anything.
/// - Source side: an original that a committed outcome condemned, but that its worker thawed
///   when the daemon died before killing it, is killed now.
/// - Destination side: a copy held for its source's decision (its worker resumed it when the
///   daemon died) is listed as a guest at once, and the source is asked; a copy the source did
///   not commit is killed.
pub fn recover(node: &Arc<Node>) {
    for (id, o) in node.outcomes.take_undecided() {
        let node = node.clone();
        tokio::spawn(settle_undecided(node, id, o));
    }
    for (id, pid) in node.outcomes.originals_alive() {
        tracing::warn!(
            event = "original-killed-after-restart",
            id,
            pid,
            "the migration was committed before the daemon died"
        );
        kill_tree(pid);
    }
    for (key, h) in node.store.load::<Held>(state::HELD) {
        if state::start_time(h.info.pid) != Some(h.start_time) {
            tracing::warn!(event = "held-copy-gone", id = h.id, pid = h.info.pid,
                home = %h.info.home_node, home_pid = h.info.home_pid);
            node.store.remove_or_log(state::HELD, &key);
            continue;
        }
        tracing::info!(event = "held-copy-recovered", id = h.id, pid = h.info.pid,
            from = %h.from, home = %h.info.home_node, home_pid = h.info.home_pid);
        node.guests.add(h.info.clone());
        let node = node.clone();
        tokio::spawn(async move {
            if !await_outcome(&node, &h.from, h.id).await {
                tracing::warn!(event = "held-copy-discarded", id = h.id, pid = h.info.pid);
                kill_tree(h.info.pid);
                node.guests.remove(h.info.pid);
            }
            node.store.remove_or_log(state::HELD, &key);
        });
    }
}

/// Source side, after a restart: migration `id` was under way and undecided when the daemon
/// died, and its worker thawed the original. Its destination may have run its copy meanwhile
/// (it took us for dead): it is asked. If it ran the copy the outcome is "committed" and the
/// original is killed; otherwise "not committed" (the destination, asking us, learns the
/// same). A destination declared dead has no copy to run.
async fn settle_undecided(node: Arc<Node>, id: u64, o: Outcome) {
    let since = Instant::now();
    let ran = loop {
        if let Some(m) = node.membership.find(&o.to) {
            let ask = async {
                let mut c =
                    tls::connect(&node.creds, Some(&o.to), m.id.addr, Duration::from_secs(1))
                        .await?;
                write_msg(&mut c.stream, &Msg::OutcomeQuery { id }).await?;
                match read_msg(&mut c.stream).await? {
                    Msg::Outcome { committed, .. } => Ok(committed),
                    other => Err(anyhow!("unexpected {}", kind(&other))),
                }
            };
            if let Ok(ran) = ask.await {
                break ran;
            }
        } else if node.is_dead(&o.to).await
            || (since.elapsed() > UNKNOWN_SOURCE_GRACE && !node.membership.is_known(&o.to))
        {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    match node.outcomes.decide(
        id,
        Outcome {
            committed: ran,
            ..o.clone()
        },
    ) {
        Ok(d) => {
            tracing::warn!(event = "undecided-settled", id, to = %o.to, committed = d.committed);
            if d.committed {
                if let Some((pid, start)) = o.root {
                    if state::start_time(pid) == Some(start) {
                        kill_tree(pid);
                    }
                }
            }
        }
        Err(e) => tracing::error!(event = "undecided-unsettled", id, error = %format!("{e:#}")),
    }
}

/// Destination side: what a copy's source asks about migration `id`, if this node holds or ran
/// its copy: whether it ran it. A question from the source about a copy still held means the
/// source is alive: its decision is awaited from then on, whatever the membership says.
pub fn copy_state(node: &Node, id: u64, peer: &str) -> Option<bool> {
    let key = id.to_string();
    if let Some(from) = node.store.get::<String>(state::RAN, &key) {
        if from == peer {
            node.store.remove_or_log(state::RAN, &key);
            return Some(true);
        }
    }
    let held = node.store.get::<Held>(state::HELD, &key)?;
    if held.from != peer {
        return None;
    }
    node.outcomes.source_spoke(id);
    Some(false)
}

/// SIGKILLs process `pid` and every descendant it has now (children first listed, then
/// killed, so none escapes by being reparented in between).
fn kill_tree(pid: i32) {
    let mut all = vec![pid];
    let mut i = 0;
    while i < all.len() {
        let p = all[i];
        if let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) {
            for t in tasks.flatten() {
                let kids = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
                all.extend(
                    kids.split_whitespace()
                        .filter_map(|k| k.parse::<i32>().ok()),
                );
            }
        }
        i += 1;
    }
    for p in all {
        match ferry_sys::pidfd::pidfd_open(p) {
            Ok(fd) => {
                if let Err(e) = ferry_sys::pidfd::pidfd_send_signal(&fd, libc::SIGKILL) {
                    tracing::warn!(event = "kill-failed", pid = p, error = %e);
                }
            }
            Err(e) => tracing::debug!(event = "kill-skipped", pid = p, error = %e),
        }
    }
}

/// Receives the image into the restore worker. A source that sends nothing for the node's
/// `stream_stall_secs` fails the migration (it is before the commit point: the source thaws).
async fn receive_image(
    node: &Node,
    from: &str,
    conn: &mut Conn,
    worker: &mut Worker,
    pages: Option<&mut crate::workers::PageLink>,
    home_coming: &mut Option<HomeComing>,
) -> Result<Rebuilt> {
    let stall = node.config.stream_stall();
    let mut first_data = true;
    loop {
        // The next frame from the source, read whatever the worker says meanwhile (a frame
        // read is not to be abandoned half way: it would lose its first bytes).
        let frame = {
            let read = tokio::time::timeout(stall, read_frame(&mut conn.stream));
            tokio::pin!(read);
            loop {
                tokio::select! {
                    frame = &mut read => break frame,
                    early = worker_msg(worker) => match early? {
                        Msg::Error { message } => bail!("{message}"),
                        Msg::ReleaseDeputies => release_deputies(node, home_coming).await?,
                        other => {
                            bail!("restore worker said {} before the image ended", kind(&other))
                        }
                    },
                }
            }
        };
        let Ok(frame) = frame else {
            bail!(
                "the image stream from {from} stalled: nothing for {:.1} s \
                 (stream_stall_secs)",
                stall.as_secs_f64()
            );
        };
        match frame.map_err(|e| anyhow!("image stream: {e}"))? {
            Frame::Data(d) => {
                if first_data {
                    first_data = false;
                    if node.fault_at("stall-image-read") {
                        // The destination stops reading mid-image, its connection open.
                        tokio::time::sleep(stall * 5).await;
                    }
                }
                if let Err(e) = feed(worker, Some(&d), node, home_coming).await {
                    return Err(fed_badly(worker, e).await);
                }
            }
            Frame::End => {
                if let Err(e) = feed(worker, None, node, home_coming).await {
                    return Err(fed_badly(worker, e).await);
                }
                break;
            }
            Frame::Msg(Msg::Abort { reason }) => bail!("the source gave up: {reason}"),
            Frame::Msg(other) => bail!("{} message inside the image stream", kind(&other)),
        }
    }
    let said = match pages {
        // The rebuild asks the source for lazy memory meanwhile.
        Some(pages) => {
            use crate::migrate_lazy::{relay, Heard, Step};
            relay(conn, pages, Some(worker), Duration::from_secs(600), |h| {
                Ok(Step::Done(match h {
                    Heard::Worker(m) => m,
                    Heard::Peer(Msg::Abort { reason }) => Msg::Error {
                        message: format!("the source gave up: {reason}"),
                    },
                    Heard::Peer(other) => Msg::Error {
                        message: format!("the source said {} during the rebuild", kind(&other)),
                    },
                }))
            })
            .await?
        }
        None => loop {
            match worker_msg(worker).await? {
                Msg::ReleaseDeputies => release_deputies(node, home_coming).await?,
                m => break m,
            }
        },
    };
    match said {
        Msg::Rebuilt(r) => Ok(r),
        Msg::Error { message } => bail!("{message}"),
        other => bail!("restore worker said {}", kind(&other)),
    }
}

/// Writes `data` (or, for None, the image's end) to the restore worker, letting a tree's
/// deputies go meanwhile if it asks for them: it reads no more until it has them.
async fn feed(
    worker: &mut Worker,
    data: Option<&[u8]>,
    node: &Node,
    home_coming: &mut Option<HomeComing>,
) -> Result<()> {
    let (tx, rx) = worker.split();
    let write = async {
        match data {
            Some(d) => write_data(tx, d).await,
            None => write_end(tx).await,
        }
    };
    tokio::pin!(write);
    loop {
        tokio::select! {
            r = &mut write => return r.map_err(|e| anyhow!("{e}")),
            f = rx.recv() => match f {
                Some(Ok(Frame::Msg(Msg::ReleaseDeputies))) => {
                    release_deputies(node, home_coming).await?
                }
                Some(Ok(Frame::Msg(Msg::Error { message }))) => bail!("{message}"),
                Some(Ok(Frame::Msg(other))) => {
                    bail!("restore worker said {} before the image ended", kind(&other))
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => bail!("restore worker: {e}"),
                None => bail!("the restore worker died"),
            },
        }
    }
}

/// The restore worker of a tree coming home found it fit: its deputies are let go for it.
async fn release_deputies(node: &Node, home_coming: &mut Option<HomeComing>) -> Result<()> {
    let Some(h) = home_coming.as_mut() else {
        bail!("the restore worker asked for deputies it was not given");
    };
    let mut pids = node.deputies.release(&h.from, h.pid).await?;
    pids.sort_unstable();
    h.released = true;
    if pids != h.deputies {
        bail!(
            "deputies {:?} were let go for PID {}, not {:?}",
            pids,
            h.pid,
            h.deputies
        );
    }
    Ok(())
}

/// A write to the restore worker failed: it has most likely stopped reading after an error (the
/// rebuild fails as soon as it has the tree), which it reported first: that is the reason given.
async fn fed_badly(worker: &mut Worker, e: impl std::fmt::Display) -> anyhow::Error {
    match tokio::time::timeout(Duration::from_secs(2), worker_msg(worker)).await {
        Ok(Ok(Msg::Error { message })) => anyhow!("{message}"),
        _ => anyhow!("feed the restore worker: {e}"),
    }
}

/// How long an `Abort` may take to leave when a migration fails (a peer that stopped reading
/// takes nothing more).
const ABORT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a source that the membership has never shown us (this daemon restarted since)
/// may stay unheard of before it counts as dead.
const UNKNOWN_SOURCE_GRACE: Duration = Duration::from_secs(30);

/// After losing the source between `Rebuilt` and `Commit`: ask it how the migration ended,
/// for as long as it takes. The copy is never thrown away because the source cannot be
/// reached (it may have killed its original already): only its answer, or the membership
/// declaring it dead (a dead node runs no original), decides; a dead source means the copy
/// runs.
async fn await_outcome(node: &Node, from: &str, id: u64) -> bool {
    let since = Instant::now();
    let mut said = false;
    loop {
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
            match ask.await {
                Ok(committed) => {
                    tracing::info!(event = "outcome-heard", id, from = %from, committed);
                    return committed;
                }
                Err(e) => tracing::debug!(event = "outcome-unheard", id, from = %from,
                    error = %format!("{e:#}")),
            }
        } else if !node.outcomes.has_source_spoken(id)
            && ((since.elapsed() > UNKNOWN_SOURCE_GRACE && !node.membership.is_known(from))
                || node.is_dead(from).await)
        {
            tracing::warn!(event = "source-declared-dead", id, from = %from,
                "its original cannot run: the copy runs");
            // Run without the source's word: should it restart undecided, it asks whether we
            // ran the copy (crate::state::RAN; kept until it asks).
            node.store
                .put_or_log(state::RAN, &id.to_string(), &from.to_string());
            return true;
        }
        if !said {
            tracing::warn!(event = "awaiting-outcome", id, from = %from);
            said = true;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}
