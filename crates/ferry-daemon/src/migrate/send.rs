//! The source's side: check, offer, freeze, stream, and the commit (`send`).

use super::*;

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

pub(super) async fn send_counted(
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
        m @ ("eager" | "precopy" | "lazy" | "hybrid" | "auto") => m,
        other => bail!("unknown memory mode {other:?} (eager, precopy, lazy, hybrid or auto)"),
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
    // `auto` may choose lazy or hybrid (the capture worker decides, from the tree's size), if
    // the speed memory moves at to `to` is known: the worker then gets a page link too.
    let link_bps = node.links.get(to);
    if let (true, Some(bps)) = (memory == "auto", link_bps) {
        args.push(format!("--link-bps={bps}"));
        args.push(format!(
            "--lazy-above-ms={}",
            node.config.lazy_above_ms.unwrap_or(1000.0)
        ));
        // A tree going home is rebuilt in place of its deputies only by a move that is not
        // lazy: `auto` does not trade that for hybrid's shorter freeze.
        if guest.as_ref().is_some_and(|g| g.home_node == to) {
            args.push("--no-auto-hybrid".into());
        }
    }
    let (mut worker, mut pages) = if matches!(memory, "lazy" | "hybrid")
        || args.iter().any(|a| a.starts_with("--link-bps"))
    {
        let (w, p) = Worker::spawn_paged(&node.exe, &args).await?;
        (w, Some(p))
    } else {
        (Worker::spawn(&node.exe, &args)?, None)
    };
    let (memory_bytes, uid, command, in_place, lazy, machine) =
        match worker_msg(&mut worker).await? {
            Msg::Movable {
                memory_bytes,
                uid,
                command,
                in_place,
                lazy,
                machine,
            } => (
                memory_bytes,
                uid,
                command,
                in_place,
                lazy || matches!(memory, "lazy" | "hybrid"),
                machine,
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
        machine_bound: machine.map(|what| {
            Box::new(ferry_transport::message::MachineBound {
                boot_id: super::boot_id(),
                what,
            })
        }),
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
    node.relays.expect(&node, pid, to, relay_ends);
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
                "PID {pid} moved to {to} with --memory {}{ran}, but its lazy phase failed \
                 and the copy cannot run without the source's memory: it was killed, and the \
                 original with it (the risk of post-copy, docs/limitations.md): {e:#}",
                report.memory.mode
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
/// the image's stream (eager), the first pre-copy round (all memory, the tree running: pre-copy
/// and hybrid), or
/// the lazy phase (the destination's page server received its bytes from the resume until the
/// source was released).
fn learn_link(node: &Node, to: &str, r: &MigrateReport) {
    const ENOUGH: f64 = 8.0 * 1048576.0;
    let rate = |bytes: f64, ms: f64| (bytes >= ENOUGH && ms > 0.0).then(|| bytes / (ms / 1e3));
    // (A hybrid move's first round: its lazy phase moves only what the last round left.)
    let bps = match (&r.lazy, r.memory.rounds.first()) {
        (_, Some(round)) => rate(round.sent_bytes as f64, round.ms),
        (Some(l), None) => rate(l.source_bytes as f64, l.source_released_after_resume_ms),
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
pub(super) struct Pending<'a>(&'a Outcomes, u64);

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        self.0.end(self.1);
    }
}

/// Says `Commit` and waits for the destination's `Resumed`.
pub(super) async fn confirm(conn: &mut Conn, to: &str, node: &Node) -> Result<()> {
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
pub(super) async fn transfer(
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
pub(super) async fn reason_given(conn: &mut Conn) -> Option<String> {
    match tokio::time::timeout(Duration::from_secs(1), read_msg(&mut conn.stream)).await {
        Ok(Ok(Msg::Abort { reason } | Msg::Refused { reason })) => Some(reason),
        _ => None,
    }
}

pub(super) async fn thaw(worker: &mut Worker) -> Result<()> {
    write_msg(&mut worker.tx, &Msg::Thaw).await?;
    loop {
        match worker_msg(worker).await? {
            Msg::Thawed => return Ok(()),
            Msg::Error { message } => bail!("{message}"),
            _ => continue,
        }
    }
}

/// Whether `pid` exists, is not a zombie, and nothing traces it any more.
pub(super) fn running_free(pid: i32) -> bool {
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
