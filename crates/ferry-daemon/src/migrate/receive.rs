//! The destination's side: the offer taken or refused, the image fed to a restore worker, the
//! rebuilt tree held until the source's decision (`receive`).

use super::*;

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
    // A device of the source's machine (its console, a virtual terminal, its kernel's log)
    // is that machine's: taken only on the same machine and boot (the nodes of a local
    // cluster share one kernel). Fail point `other-machine`: this node says it is another.
    if let Some(m) = &offer.machine_bound {
        let here = if node.fault_at("other-machine") {
            "another-machine".to_string()
        } else {
            boot_id()
        };
        if m.boot_id != here {
            let reason = format!(
                "{} is a device of {}'s machine (kernel boot {}), and this node is another \
                 machine (boot {here}): its console, terminals and kernel log are that \
                 machine's own",
                m.what, offer.from_node, m.boot_id
            );
            tracing::info!(event = "refused-guest", from = %from, pid = offer.home_pid, reason = %reason);
            write_msg(&mut conn.stream, &Msg::Refused { reason }).await?;
            return Ok(());
        }
    }
    // A body of the same tree still here is one its home gave up for dead (this node was
    // frozen or cut off meanwhile) and has killed as soon as it hears from us
    // (crate::recovery::fence): the tree must not come back beside it, and be killed for it.
    let old_body = node
        .bodies
        .host_pid(&offer.home_node, offer.home_pid, Some(offer.home_pid))
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
    // them, as to any other node. A tree some of whose processes its own PID namespace numbers
    // apart from their deputies (children of a `ferry run` program) is never rebuilt in their
    // place: the rebuild keeps the numbers the tree knows itself by.
    let mut home_coming = None;
    if offer.in_place
        && !offer.lazy
        && offer.home_node == node.name()
        && !node.deputies.renumbered(offer.home_pid)
    {
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
        if node.fault_at("lazy-push-late") {
            worker_args.push("--push-after-ms=2000".into());
        }
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
        Ok(e) => {
            // What its relayed sockets were at home, should the body move on.
            node.body_relays
                .names(&offer.home_node, offer.home_pid, &rebuilt.relay_names);
            e
        }
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
        deputies: Vec::new(),
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
pub(super) struct HomeComing {
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
                root: None,
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
pub(super) async fn finish_home_coming(
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
pub(super) async fn abort_rebuilt(
    worker: &mut Worker,
    conn: &mut Conn,
    reason: String,
) -> Result<()> {
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
pub(super) struct Held {
    pub(super) id: u64,
    pub(super) from: String,
    /// The copy's root here (`info.pid`) and its start time.
    pub(super) start_time: u64,
    pub(super) info: ProcInfo,
}

/// Lets the held copy run (`commit`) or throws it away, then forgets its record. A lazy copy
/// (`pages`) is served from its source meanwhile, until every page is in.
#[allow(clippy::too_many_arguments)]
pub(super) async fn finish_held(
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

/// Receives the image into the restore worker. A source that sends nothing for the node's
/// `stream_stall_secs` fails the migration (it is before the commit point: the source thaws).
pub(super) async fn receive_image(
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
pub(super) async fn feed(
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
pub(super) async fn release_deputies(
    node: &Node,
    home_coming: &mut Option<HomeComing>,
) -> Result<()> {
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
pub(super) async fn fed_badly(worker: &mut Worker, e: impl std::fmt::Display) -> anyhow::Error {
    match tokio::time::timeout(Duration::from_secs(2), worker_msg(worker)).await {
        Ok(Ok(Msg::Error { message })) => anyhow!("{message}"),
        _ => anyhow!("feed the restore worker: {e}"),
    }
}
