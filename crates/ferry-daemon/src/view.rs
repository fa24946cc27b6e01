//! The cluster in one picture (`Msg::Cluster`): every node and its load, every process under
//! Ferry with where it runs, its CPU use and state, and what it costs its home. Each node
//! answers for its own guests and deputies (`Msg::LocalView`); the node asked puts the parts
//! together. `ferry top` and the daemon's page (crate::web) show it.

use crate::node::Node;
use anyhow::bail;
use ferry_transport::message::{kind, ClusterView, ProcView};
use ferry_transport::{read_msg, tls, write_msg, Msg};
use std::sync::Arc;
use std::time::Duration;

fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// This node's part: its guests (with CPU use and state) and what the trees that left it cost.
pub fn local_view(node: &Node) -> ClusterView {
    let guests = node.guests.list();
    let mut processes = Vec::with_capacity(guests.len());
    for info in guests {
        let sample = node.cpu.sample(info.pid);
        processes.push(ProcView {
            cpu_pct: sample.as_ref().map(|s| s.0),
            run_state: sample.map(|s| s.1),
            cost: None,
            info,
        });
    }
    let alive: Vec<i32> = processes.iter().map(|p| p.info.pid).collect();
    node.cpu.retain(&alive);
    let mut home_costs = node.deputies.costs();
    for c in &mut home_costs {
        // The pipes the home relays for the tree (crate::relay), counted by its root's PID.
        c.bytes_relayed = Some(c.pids.iter().map(|&p| node.relays.bytes(p)).sum());
    }
    ClusterView {
        node: node.name().to_string(),
        taken_unix_ms: now_unix_ms(),
        nodes: Vec::new(),
        processes,
        home_costs,
        unanswered: Vec::new(),
    }
}

/// The whole cluster, as this node sees it: peers asked in parallel; one that does not
/// answer within 3 s is listed in `unanswered`.
pub async fn cluster_view(node: &Arc<Node>) -> ClusterView {
    let mut asks = Vec::new();
    for m in node.membership.members() {
        let node = node.clone();
        asks.push(tokio::spawn(async move {
            let name = m.id.name.clone();
            let work = async {
                let mut c =
                    tls::connect(&node.creds, Some(&name), m.id.addr, Duration::from_secs(2))
                        .await?;
                write_msg(&mut c.stream, &Msg::LocalView).await?;
                match read_msg(&mut c.stream).await? {
                    Msg::View(v) => Ok(v),
                    other => bail!("unexpected {}", kind(&other)),
                }
            };
            let r = tokio::time::timeout(Duration::from_secs(3), work)
                .await
                .unwrap_or_else(|_| bail!("timed out"));
            (name, r)
        }));
    }
    let mut view = local_view(node);
    view.nodes = crate::node::nodes(node);
    let mut costs: Vec<(String, ferry_transport::message::HomeCost)> = view
        .home_costs
        .drain(..)
        .map(|c| (view.node.clone(), c))
        .collect();
    for a in asks {
        let Ok((name, r)) = a.await else { continue };
        match r {
            Ok(part) => {
                view.processes.extend(part.processes);
                costs.extend(part.home_costs.into_iter().map(|c| (name.clone(), c)));
            }
            Err(e) => {
                tracing::debug!(node = %name, error = %format!("{e:#}"), "cluster view");
                view.unanswered.push(name);
            }
        }
    }
    for p in &mut view.processes {
        p.cost = costs
            .iter()
            .find(|(home, c)| *home == p.info.home_node && c.pids.contains(&p.info.home_pid))
            .map(|(_, c)| c.clone());
    }
    view.processes.sort_by(|a, b| {
        (&a.info.home_node, a.info.home_pid).cmp(&(&b.info.home_node, b.info.home_pid))
    });
    view.unanswered.sort();
    view
}

// ---- The picture as rows of text: one table layout for `ferry top` and the page ----------

/// The nodes table's columns.
pub const NODE_COLUMNS: &[&str] = &[
    "NODE", "STATE", "LOAD1", "RUNNABLE", "CPU-IDLE", "FREE-MEM", "OWNER", "ACCEPTS", "GUESTS",
];

/// The processes table's columns.
pub const PROC_COLUMNS: &[&str] = &[
    "HOME", "HOME-PID", "NODE", "PID", "CPU%", "STATE", "KIND", "DEPUTIES", "SIGNALS", "CALLS",
    "RELAYED", "AGE", "COMMAND",
];

/// Whether the owner is at the machine (or it is busy with their work), and how long since
/// its console was last used.
pub fn owner_text(load: &ferry_policy::NodeLoad) -> String {
    let input = load.console_idle_secs.map_or_else(
        || "no console".to_string(),
        |s| format!("input {} ago", duration_text(s)),
    );
    if load.owner_present() {
        format!("present, {input}")
    } else if load.owner.idle {
        format!("idle, {input}")
    } else {
        format!("busy, {input}")
    }
}

/// The owner's policy and whether the node takes guests now: "idle: yes", "never: no".
pub fn accepts_text(load: &ferry_policy::NodeLoad) -> String {
    let now = if load.stale {
        "stale"
    } else if load.accepting {
        "yes"
    } else {
        "no"
    };
    let draining = if load.owner.draining {
        ", draining"
    } else {
        ""
    };
    format!("{}{draining}: {now}", load.owner.policy)
}

pub fn duration_text(secs: u64) -> String {
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 7200 => format!("{}m", s / 60),
        s if s < 172_800 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86400),
    }
}

pub fn bytes_text(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b}B")
    } else {
        format!("{v:.1}{}", UNITS[u])
    }
}

/// One row of the nodes table, in [`NODE_COLUMNS`] order.
pub fn node_row(n: &ferry_transport::message::NodeInfo) -> Vec<String> {
    let mut row = vec![n.name.clone(), n.state.clone()];
    match &n.load {
        Some(l) => row.extend([
            format!("{:.2}", l.owner.load_avg_1m),
            l.runnable.to_string(),
            format!("{:.0}%", l.cpu_idle_pct),
            bytes_text(l.free_memory_bytes),
            owner_text(l),
            accepts_text(l),
            l.guests.to_string(),
        ]),
        None => row.extend((0..7).map(|_| "-".to_string())),
    }
    row
}

/// One row of the processes table, in [`PROC_COLUMNS`] order; `now_ms` for its age.
pub fn proc_row(p: &ProcView, now_ms: u64) -> Vec<String> {
    let opt = |v: Option<u64>| v.map_or_else(|| "-".to_string(), |v| v.to_string());
    let cost = p.cost.as_ref();
    let state = match &p.run_state {
        Some(s) => format!("{}/{}", p.info.state, s),
        None => p.info.state.clone(),
    };
    vec![
        p.info.home_node.clone(),
        p.info.home_pid.to_string(),
        p.info.node.clone(),
        p.info.pid.to_string(),
        p.cpu_pct
            .map_or_else(|| "-".to_string(), |c| format!("{c:.1}")),
        state,
        p.info.kind.clone(),
        opt(cost.map(|c| c.deputies as u64)),
        opt(cost.map(|c| c.signals_forwarded)),
        opt(cost.and_then(|c| c.calls_forwarded)),
        cost.and_then(|c| c.bytes_relayed)
            .map_or_else(|| "-".to_string(), bytes_text),
        duration_text(now_ms.saturating_sub(p.info.since_unix_ms) / 1000),
        p.info.command.clone(),
    ]
}
