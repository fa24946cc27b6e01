//! Eviction: every guest of this node leaves, when its owner comes back (input under
//! `accept = idle`), on `ferry evict NODE` and `ferry drain NODE`, or when fairness takes the
//! host back for another user (crate::hosts).
//!
//! Each guest goes home (the deputy waits for it there; a tree coming home is always taken
//! back), unless its home is busy (as many runnable processes as processors) and another node
//! is idle, accepts guests and would not make it wait: then there, longest idle first. All
//! guests leave at once. A `ferry run` program moves like the others: this node becomes its
//! home (its deputy stays here, and its stdio, this daemon's stream to its caller, are relayed
//! to where it runs: crate::migrate), so its caller sees nothing. A guest that cannot move (a
//! refused resource; no live home and no idle node) keeps running here and is reported with
//! the reason; except a `ferry run` program when the owner is back or the node drains
//! ([`LastResort::Kill`]): it is killed, as the last resort, its caller told why on its
//! stderr, and `ferry run` exits as for SIGKILL.

use crate::node::Node;
use ferry_policy::hosts::{self as policy, HostRequest};
use ferry_policy::NodeLoad;
use ferry_transport::message::{kind, EvictReport, EvictedGuest, ProcInfo};
use ferry_transport::{read_msg, write_msg, Msg};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What happens to a `ferry run` program that could go nowhere.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum LastResort {
    /// It keeps running here (`ferry evict`, fairness).
    Stay,
    /// It is killed, its caller told (the owner is back, `ferry drain`).
    Kill,
}

/// Sends away every guest `which` selects; returns what went where.
pub async fn evict(
    node: &Arc<Node>,
    reason: String,
    last: LastResort,
    which: impl Fn(&ProcInfo) -> bool,
) -> EvictReport {
    let t0 = Instant::now();
    let guests: Vec<ProcInfo> = node
        .guests
        .list()
        .into_iter()
        .filter(|g| g.home_node != node.name() && g.state == "running" && which(g))
        .collect();
    tracing::info!(event = "evict", reason = %reason, guests = guests.len());
    let mut tasks = Vec::new();
    for g in guests {
        let node = node.clone();
        let why = reason.clone();
        tasks.push(tokio::spawn(async move {
            evict_one(&node, g, &why, last).await
        }));
    }
    let mut report = EvictReport {
        node: node.name().to_string(),
        reason,
        draining: node.hosts.accepts().is_err_and(|r| r.contains("drained")),
        ..Default::default()
    };
    for t in tasks {
        match t.await {
            Ok(e) => report.guests.push(e),
            Err(e) => tracing::error!(event = "evict-task-failed", error = %e),
        }
    }
    report.total_ms = t0.elapsed().as_secs_f64() * 1e3;
    let moved = report.guests.iter().filter(|g| g.to.is_some()).count();
    tracing::info!(event = "evicted", reason = %report.reason, moved,
        stayed = report.guests.len() - moved, total_ms = report.total_ms);
    report
}

async fn evict_one(node: &Arc<Node>, g: ProcInfo, reason: &str, last: LastResort) -> EvictedGuest {
    let t = Instant::now();
    let mut out = EvictedGuest {
        home_node: g.home_node.clone(),
        home_pid: g.home_pid,
        pid: g.pid,
        uid: g.uid,
        command: g.command.clone(),
        ..Default::default()
    };
    let run = g.kind == crate::migrate::REMOTE_EXEC;
    let r = {
        let dests = destinations(node, &g);
        if dests.is_empty() {
            Err(format!(
                "its home {} is not alive and no other node is idle",
                g.home_node
            ))
        } else {
            let mut errors = Vec::new();
            let mut to = None;
            // Twice each: a move can fail for a passing reason (a short-lived child of the
            // tree ending between the preflight and the freeze).
            'dests: for d in dests {
                for attempt in 0..2 {
                    if attempt > 0 {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    match move_to(node, g.pid, &d).await {
                        Ok(()) => {
                            to = Some(d);
                            break 'dests;
                        }
                        Err(e) => errors.push(format!("to {d}: {e}")),
                    }
                }
            }
            to.ok_or_else(|| errors.join("; "))
        }
    };
    let r = match r {
        Err(e) if run && last == LastResort::Kill => Err(kill_run(node, &g, reason, &e)),
        Err(e) => Err(format!("{e}; it keeps running here")),
        Ok(to) => Ok(to),
    };
    out.ms = t.elapsed().as_secs_f64() * 1e3;
    match r {
        Ok(to) => {
            tracing::info!(event = "guest-evicted", home = %g.home_node, home_pid = g.home_pid,
                pid = g.pid, to = %to, ms = out.ms);
            out.to = Some(to);
        }
        Err(e) => {
            tracing::warn!(event = "guest-not-evicted", home = %g.home_node,
                home_pid = g.home_pid, pid = g.pid, error = %e);
            out.error = Some(e);
        }
    }
    out
}

/// The last resort for a `ferry run` program that could not leave: its caller is told why
/// (on its stderr, through the program's stream), then its session and process group are
/// killed; `ferry run` reports the SIGKILL. Returns the report's error.
fn kill_run(node: &Arc<Node>, g: &ProcInfo, reason: &str, why: &str) -> String {
    let line = format!(
        "node {} must be freed ({reason}) and `{}` (PID {} there) could not move: {why}; \
         it was killed",
        node.name(),
        g.command.lines().next().unwrap_or_default(),
        g.pid
    );
    let told = node.run_notices.tell(g.pid, line);
    tracing::warn!(event = "run-killed-on-eviction", home = %g.home_node,
        home_pid = g.home_pid, pid = g.pid, reason = %reason, error = %why, caller_told = told,
        "a `ferry run` program could not move and was killed (the last resort)");
    // Its caller's stream carries the line before the end: the kill waits for the session to
    // have sent it (written in order, ahead of the exit the reaper reports).
    let (node, pid) = (node.clone(), g.pid);
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        crate::exec::kill_program(&node, pid);
    });
    format!("{why}; it was killed (the last resort), its caller told")
}

/// Moves the guest whose PID here is `pid` to `to`.
async fn move_to(node: &Arc<Node>, pid: i32, to: &str) -> Result<(), String> {
    // `migrate::send` reports its progress to a CLI; here nobody listens.
    let (mut sink, _drain) = tokio::net::UnixStream::pair().map_err(|e| e.to_string())?;
    crate::migrate::send(node.clone(), &mut sink, pid, to, "auto", None)
        .await
        .map(|_| ())
        .map_err(|e| format!("{e:#}"))
}

/// Where a guest should go, best first: home, unless home is busy and another node is idle.
fn destinations(node: &Node, g: &ProcInfo) -> Vec<String> {
    let wont_wait = |l: &NodeLoad| l.runnable < l.cpus.max(1);
    let members = node.membership.members();
    let home = members.iter().find(|m| m.id.name == g.home_node);
    let mut loads: Vec<(String, NodeLoad)> = members
        .iter()
        .filter(|m| m.id.name != g.home_node)
        .filter_map(|m| Some((m.id.name.clone(), m.load.clone()?)))
        .filter(|(_, l)| wont_wait(l))
        .collect();
    loads.retain(|(n, _)| n != node.name());
    let refs = loads.iter().map(|(n, l)| (n.as_str(), l));
    let other = policy::select(
        refs,
        &HostRequest {
            class: "",
            uid: g.uid,
            count: 1,
            exclude: Some(node.name()),
        },
    )
    .first()
    .map(|s| s.to_string());
    let mut v = Vec::new();
    match home {
        Some(h) => {
            let busy = h.load.as_ref().is_some_and(|l| !wont_wait(l));
            if busy {
                v.extend(other);
            }
            v.push(g.home_node.clone());
            if !busy {
                // Should home fail, an idle node.
                v.extend(other_than(&loads, &g.home_node));
            }
        }
        None => v.extend(other),
    }
    v.dedup();
    v
}

fn other_than(loads: &[(String, NodeLoad)], not: &str) -> Option<String> {
    policy::select(
        loads
            .iter()
            .filter(|(n, _)| n != not)
            .map(|(n, l)| (n.as_str(), l)),
        &HostRequest {
            class: "",
            uid: 0,
            count: 1,
            exclude: None,
        },
    )
    .first()
    .map(|s| s.to_string())
}

/// `ferry evict NODE` / `ferry drain NODE`, from this node's CLI or a peer: evicts here, or
/// passes the request on to `target`.
pub async fn serve(node: &Arc<Node>, target: &str, drain: bool, via: Option<&str>) -> Msg {
    if target != node.name() {
        if via.is_some() {
            return Msg::error(format!("this is node {}, not {target}", node.name()));
        }
        return match forward(node, target, drain).await {
            Ok(m) => m,
            Err(e) => Msg::error(format!("{e:#}")),
        };
    }
    if drain {
        node.hosts.set_draining(node);
    }
    let who = via.map_or(String::new(), |p| format!(" (asked by node {p})"));
    let reason = format!("ferry {}{who}", if drain { "drain" } else { "evict" });
    let last = if drain {
        LastResort::Kill
    } else {
        LastResort::Stay
    };
    let mut r = evict(node, reason, last, |_| true).await;
    r.draining = drain || r.draining;
    debug_assert!(!drain || !node.accepting.load(Ordering::Relaxed));
    Msg::Evicted(r)
}

async fn forward(node: &Arc<Node>, target: &str, drain: bool) -> anyhow::Result<Msg> {
    let mut c = node.dial(target).await?;
    let msg = Msg::Evict {
        node: target.to_string(),
        drain,
    };
    write_msg(&mut c.stream, &msg).await?;
    // Eviction moves trees: minutes at worst.
    match tokio::time::timeout(Duration::from_secs(600), read_msg(&mut c.stream)).await {
        Ok(Ok(m @ (Msg::Evicted(_) | Msg::Error { .. }))) => Ok(m),
        Ok(Ok(other)) => anyhow::bail!("node {target} answered {}", kind(&other)),
        Ok(Err(e)) => anyhow::bail!("node {target} did not answer: {e}"),
        Err(_) => anyhow::bail!("node {target} did not finish evicting within 10 minutes"),
    }
}
