//! Outcomes left undecided (a daemon that restarted, a link that broke after `Rebuilt`): each
//! settled from the record written before it was acted on, and the other side's answer.

use super::*;

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
pub(super) async fn settle_undecided(node: Arc<Node>, id: u64, o: Outcome) {
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
pub(super) fn kill_tree(pid: i32) {
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

/// How long an `Abort` may take to leave when a migration fails (a peer that stopped reading
/// takes nothing more).
pub(super) const ABORT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a source that the membership has never shown us (this daemon restarted since)
/// may stay unheard of before it counts as dead.
pub(super) const UNKNOWN_SOURCE_GRACE: Duration = Duration::from_secs(30);

/// After losing the source between `Rebuilt` and `Commit`: ask it how the migration ended,
/// for as long as it takes. The copy is never thrown away because the source cannot be
/// reached (it may have killed its original already): only its answer, or the membership
/// declaring it dead (a dead node runs no original), decides; a dead source means the copy
/// runs.
pub(super) async fn await_outcome(node: &Node, from: &str, id: u64) -> bool {
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
