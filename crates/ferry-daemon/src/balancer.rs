//! Automatic load balancing on this node (the rules: `ferry_policy::balance`).
//!
//! The balancer moves only what its owner handed to Ferry: a PID given with `ferry balance add
//! PID`, a process whose command is in the config's `balance.allow`, or a process that the
//! balancer of another node sent here (`BalanceAdopt`). Nothing else is ever a candidate.
//!
//! Every 250 ms it counts, for this node and for each candidate tree, the threads wanting a
//! CPU (state R: running, waiting for a CPU, or held back by the node's CPU quota), and keeps a
//! decaying average of each: the node's *demand* and each process's. The node's own processes
//! are those of its CPU cgroup (a node of `ferry cluster up --cpu-quota`), or the whole
//! machine's (/proc/stat) when it has none; its *capacity* is its quota, or its CPUs. Both go
//! out with the node's load in the gossip. Every `period_ms` it reads each candidate's CPU time
//! and data rate (`crate::traffic`), asks the policy what to do, logs the decision with its
//! reason (`ferry balance log`), and moves the chosen tree with the ordinary migration.

use crate::node::Node;
use ferry_policy::balance::{self, BalanceConfig, Candidate, Decision, NodeView, Plan};
use ferry_transport::Msg;
use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Decisions kept for `ferry balance log`.
const LOG_KEPT: usize = 500;
/// A decision not to move is logged again, unchanged, at most this often.
const STAY_RELOG: Duration = Duration::from_secs(30);
/// A `BalanceAdopt` is taken only from the node that sent the guest, this soon after.
const ADOPT_WINDOW: Duration = Duration::from_secs(60);
/// A process whose migration failed is not tried again for this long.
const FAILED_BACKOFF: Duration = Duration::from_secs(30);
/// Sampling period of runnable threads, and the decay of their averages.
const TICK: Duration = Duration::from_millis(250);
const DECAY_SECS: f64 = 2.0;

/// Why a process is a candidate.
#[derive(Debug, Clone)]
struct Handed {
    start_time: u64,
    /// When it arrived here, if another node's balancer sent it (for the minimum stay); None
    /// for a process handed over where it runs.
    since: Option<Instant>,
    origin: String,
}

#[derive(Debug, Clone, Default)]
struct Watch {
    first: Option<Instant>,
    demand: f64,
    cpu_ticks: Option<(Instant, u64)>,
    cpu: f64,
    rate_bps: f64,
    memory_bytes: u64,
}

#[derive(Default)]
struct State {
    handed: HashMap<i32, Handed>,
    /// Guests that arrived here, by (home node, home PID): the node that sent each, and when
    /// (only that node's `BalanceAdopt` is taken, for a minute).
    arrivals: HashMap<(String, i32), (String, Instant)>,
    watched: HashMap<i32, Watch>,
    demand: f64,
    capacity: f64,
    last_move: Option<Instant>,
    failed: HashMap<i32, Instant>,
    log: VecDeque<Decision>,
    last_stay: Option<(String, Instant)>,
}

pub struct Balancer {
    /// From the node's config; `ferry balance set` changes it while the daemon runs.
    config: Mutex<BalanceConfig>,
    state: Mutex<State>,
    /// The node's CPU cgroup directory, if it has one of its own.
    cgroup: Option<PathBuf>,
}

impl Balancer {
    pub fn new(config: BalanceConfig) -> Balancer {
        let cgroup = own_cpu_cgroup();
        let capacity = capacity(cgroup.as_deref());
        tracing::info!(event = "balance-config", enabled = config.enabled,
            algorithm = config.algorithm.name(), cgroup = ?cgroup, capacity);
        Balancer {
            config: Mutex::new(config),
            state: Mutex::new(State {
                capacity,
                ..Default::default()
            }),
            cgroup,
        }
    }

    pub fn config(&self) -> BalanceConfig {
        self.config.lock().expect("balancer config lock").clone()
    }

    /// Sets `settings` (TOML `key = value` lines of the `[balance]` table) over the present
    /// configuration; nothing changes if any is wrong. Returns the new configuration.
    pub fn set(&self, settings: &str) -> anyhow::Result<BalanceConfig> {
        use anyhow::Context;
        let mut c = self.config.lock().expect("balancer config lock");
        let mut table = toml::Table::try_from(&*c).context("the present configuration")?;
        let new: toml::Table =
            toml::from_str(settings).with_context(|| format!("balance settings {settings:?}"))?;
        table.extend(new);
        let merged: BalanceConfig = table
            .try_into()
            .with_context(|| format!("balance settings {settings:?}"))?;
        merged.check().map_err(|e| anyhow::anyhow!(e))?;
        tracing::info!(
            event = "balance-config",
            enabled = merged.enabled,
            algorithm = merged.algorithm.name(),
            settings
        );
        *c = merged.clone();
        Ok(merged)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("balancer lock")
    }

    /// This node's demand and capacity, for the gossip.
    pub fn figures(&self) -> (f32, f32) {
        let s = self.lock();
        (s.demand as f32, s.capacity as f32)
    }

    /// Hands `pid` (a PID on this node) to the balancer; `arrived`: it was just sent here by
    /// another node's balancer (its minimum stay starts now).
    pub fn add(&self, pid: i32, origin: &str, arrived: bool) -> anyhow::Result<()> {
        let Some(start_time) = crate::state::start_time(pid) else {
            anyhow::bail!("no process {pid} on this node");
        };
        if pid == std::process::id() as i32 {
            anyhow::bail!("PID {pid} is this node's daemon");
        }
        self.lock().handed.insert(
            pid,
            Handed {
                start_time,
                since: arrived.then(Instant::now),
                origin: origin.to_string(),
            },
        );
        tracing::info!(event = "balance-handed", pid, origin);
        Ok(())
    }

    /// A tree from `from` whose home identity is (`home_node`, `home_pid`) runs here now.
    pub fn arrived(&self, from: &str, home_node: &str, home_pid: i32) {
        let mut s = self.lock();
        s.arrivals.retain(|_, (_, t)| t.elapsed() < ADOPT_WINDOW);
        s.arrivals.insert(
            (home_node.to_string(), home_pid),
            (from.to_string(), Instant::now()),
        );
    }

    /// Whether `from` sent the guest (`home_node`, `home_pid`) here within the last minute.
    fn sent_by(&self, from: &str, home_node: &str, home_pid: i32) -> bool {
        self.lock()
            .arrivals
            .get(&(home_node.to_string(), home_pid))
            .is_some_and(|(f, t)| f == from && t.elapsed() < ADOPT_WINDOW)
    }

    /// The decisions logged, oldest first.
    pub fn log(&self) -> Vec<Decision> {
        self.lock().log.iter().cloned().collect()
    }

    fn record(&self, node: &str, load: f64, mut d: Decision) {
        d.node = node.to_string();
        d.load = load;
        tracing::info!(event = "balance-decision", action = %d.action, pid = ?d.pid,
            to = ?d.to, reason = %d.reason);
        let mut s = self.lock();
        if s.log.len() >= LOG_KEPT {
            s.log.pop_front();
        }
        s.log.push_back(d);
    }
}

fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The directory of this process's CPU cgroup (cgroup v1 `cpu` hierarchy), if not the root.
fn own_cpu_cgroup() -> Option<PathBuf> {
    let cg = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = cg.lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let _ = f.next();
        let ctl = f.next()?;
        ctl.split(',').any(|c| c == "cpu").then(|| f.next())?
    })?;
    if path == "/" {
        return None;
    }
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let mount = info.lines().find_map(|line| {
        let fields: Vec<&str> = line.split(' ').collect();
        let sep = fields.iter().position(|f| *f == "-")?;
        let options = fields.get(sep + 3)?;
        (fields.get(sep + 1) == Some(&"cgroup")
            && options.split(',').any(|o| o == "cpu")
            && fields.get(3) == Some(&"/"))
        .then(|| PathBuf::from(fields[4]))
    })?;
    let dir = mount.join(path.trim_start_matches('/'));
    dir.is_dir().then_some(dir)
}

/// CPUs this node has: the tightest CPU quota of its cgroup and its parents, or its CPUs.
fn capacity(cgroup: Option<&Path>) -> f64 {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let mut best = cpus;
    let mut dir = cgroup;
    while let Some(d) = dir {
        let read = |f: &str| -> Option<i64> {
            std::fs::read_to_string(d.join(f)).ok()?.trim().parse().ok()
        };
        match (read("cpu.cfs_quota_us"), read("cpu.cfs_period_us")) {
            (Some(q), Some(p)) if q > 0 && p > 0 => best = best.min(q as f64 / p as f64),
            (None, _) => break,
            _ => {}
        }
        dir = d.parent();
    }
    best
}

/// Field `n` (1-based, as proc(5) numbers them) of /proc/PATH/stat.
fn stat_field(path: &str, n: usize) -> Option<String> {
    let s = std::fs::read_to_string(format!("/proc/{path}/stat")).ok()?;
    let rest = s.rsplit_once(')')?.1;
    rest.split_whitespace().nth(n - 3).map(str::to_string)
}

/// The tasks (threads) of the cgroup at `dir` and its children, by TID.
fn cgroup_tasks(dir: &Path, out: &mut Vec<i32>) {
    if let Ok(t) = std::fs::read_to_string(dir.join("tasks")) {
        out.extend(t.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
    }
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                cgroup_tasks(&e.path(), out);
            }
        }
    }
}

/// Threads of this node wanting a CPU now (ours excluded).
fn node_runnable(cgroup: Option<&Path>) -> Option<f64> {
    match cgroup {
        Some(dir) => {
            let mut tasks = Vec::new();
            cgroup_tasks(dir, &mut tasks);
            let own: std::collections::HashSet<i32> = std::fs::read_dir("/proc/self/task")
                .map(|d| {
                    d.flatten()
                        .filter_map(|e| e.file_name().to_str()?.parse().ok())
                        .collect()
                })
                .unwrap_or_default();
            Some(
                tasks
                    .iter()
                    .filter(|t| !own.contains(t))
                    .filter(|t| stat_field(&t.to_string(), 3).as_deref() == Some("R"))
                    .count() as f64,
            )
        }
        None => {
            let stat = std::fs::read_to_string("/proc/stat").ok()?;
            let n: f64 = stat
                .lines()
                .find_map(|l| l.strip_prefix("procs_running "))?
                .trim()
                .parse()
                .ok()?;
            Some((n - 1.0).max(0.0))
        }
    }
}

/// `pid` and its descendants.
fn tree(pid: i32) -> Vec<i32> {
    let mut out = vec![pid];
    let mut i = 0;
    while i < out.len() {
        let p = out[i];
        if let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) {
            for t in tasks.flatten() {
                if let Ok(c) = std::fs::read_to_string(t.path().join("children")) {
                    out.extend(c.split_whitespace().filter_map(|x| x.parse::<i32>().ok()));
                }
            }
        }
        i += 1;
    }
    out
}

/// Runnable threads of the tree of `pid`, its CPU time in ticks, and its resident memory.
fn tree_figures(pid: i32) -> (f64, u64, u64) {
    let mut runnable = 0.0;
    let mut ticks = 0;
    let mut rss = 0;
    for p in tree(pid) {
        if let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) {
            for t in tasks.flatten() {
                let tid = t.file_name().to_string_lossy().into_owned();
                if stat_field(&format!("{p}/task/{tid}"), 3).as_deref() == Some("R") {
                    runnable += 1.0;
                }
            }
        }
        ticks += [14, 15]
            .iter()
            .filter_map(|n| stat_field(&p.to_string(), *n)?.parse::<u64>().ok())
            .sum::<u64>();
        rss += stat_field(&p.to_string(), 24)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
            * 4096;
    }
    (runnable, ticks, rss)
}

fn comm(pid: i32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

fn ns_of(pid: &str) -> Option<PathBuf> {
    std::fs::read_link(format!("/proc/{pid}/ns/pid")).ok()
}

/// Processes of this node (in the daemon's PID namespace) whose command is allowed.
fn allowed(node: &Node, allow: &[String]) -> Vec<i32> {
    if allow.is_empty() {
        return Vec::new();
    }
    let me = std::process::id() as i32;
    let my_ns = ns_of("self");
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|p| *p != me && allow.iter().any(|a| *a == comm(*p)))
        .filter(|p| ns_of(&p.to_string()) == my_ns || node.guests.find(*p).is_some())
        .collect()
}

/// Runs the balancer of `node` until the daemon stops.
pub async fn run(node: Arc<Node>) {
    let b = &node.balancer;
    let mut traffic = crate::traffic::Traffic::default();
    let mut last_decide = Instant::now();
    let mut last_tick = Instant::now();
    loop {
        tokio::time::sleep(TICK).await;
        let dt = last_tick.elapsed().as_secs_f64();
        last_tick = Instant::now();
        let alpha = 1.0 - (-dt / DECAY_SECS).exp();
        let cfg = b.config();
        let period = Duration::from_millis(cfg.period_ms);
        // The node's demand.
        let runnable = node_runnable(b.cgroup.as_deref());
        // Candidates: those handed over, still the same processes, and the allowed ones.
        let allowed = allowed(&node, &cfg.allow);
        {
            let mut s = b.lock();
            if let Some(r) = runnable {
                s.demand += (r - s.demand) * alpha;
            }
            s.handed
                .retain(|pid, h| crate::state::start_time(*pid) == Some(h.start_time));
            for pid in allowed {
                if let std::collections::hash_map::Entry::Vacant(e) = s.handed.entry(pid) {
                    if let Some(start_time) = crate::state::start_time(pid) {
                        e.insert(Handed {
                            start_time,
                            since: None,
                            origin: "allowed by the config".into(),
                        });
                    }
                }
            }
            let pids: Vec<i32> = s.handed.keys().copied().collect();
            s.watched.retain(|p, _| pids.contains(p));
            for pid in pids {
                let (r, ticks, rss) = tree_figures(pid);
                let w = s.watched.entry(pid).or_default();
                let now = Instant::now();
                if w.first.is_none() {
                    w.first = Some(now);
                    w.demand = r;
                }
                w.demand += (r - w.demand) * alpha;
                w.memory_bytes = rss;
                if let Some((t0, c0)) = w.cpu_ticks {
                    let secs = now.duration_since(t0).as_secs_f64();
                    if secs >= 0.9 {
                        // Averaged like the demand (ticks are coarse: 10 ms).
                        let cpu = ticks.saturating_sub(c0) as f64 / 100.0 / secs;
                        let a = 1.0 - (-secs / DECAY_SECS).exp();
                        w.cpu += (cpu - w.cpu) * a;
                        w.cpu_ticks = Some((now, ticks));
                    }
                } else {
                    w.cpu_ticks = Some((now, ticks));
                }
            }
        }
        if last_decide.elapsed() < period {
            continue;
        }
        last_decide = Instant::now();
        // Data rates, once per period.
        let pids: Vec<i32> = b.lock().handed.keys().copied().collect();
        let mut rates = HashMap::new();
        for &pid in &pids {
            let total: f64 = tree(pid)
                .into_iter()
                .filter_map(|p| traffic.sample(p))
                .map(|r| r.total_bps)
                .sum();
            rates.insert(pid, total);
        }
        let alive: std::collections::HashSet<i32> = pids.iter().flat_map(|p| tree(*p)).collect();
        traffic.retain(|p| alive.contains(&p));
        if !cfg.enabled {
            continue;
        }
        decide(&node, &cfg, rates).await;
    }
}

async fn decide(node: &Arc<Node>, cfg: &BalanceConfig, rates: HashMap<i32, f64>) {
    let b = &node.balancer;
    let (me, candidates, cooling) = {
        let mut s = b.lock();
        let now = Instant::now();
        s.failed
            .retain(|_, t| now.duration_since(*t) < FAILED_BACKOFF);
        let mut load = node.own_load();
        load.demand = s.demand as f32;
        load.capacity = s.capacity as f32;
        let me = NodeView::from_load(node.name(), &load);
        let mut candidates = Vec::new();
        for (pid, h) in &s.handed {
            if s.failed.contains_key(pid) {
                continue;
            }
            let Some(w) = s.watched.get(pid) else {
                continue;
            };
            candidates.push(Candidate {
                pid: *pid,
                command: comm(*pid),
                origin: h.origin.clone(),
                demand: w.demand,
                cpu: w.cpu,
                rate_bps: rates.get(pid).copied().unwrap_or(w.rate_bps),
                memory_bytes: w.memory_bytes,
                watched_secs: w.first.map_or(0.0, |f| now.duration_since(f).as_secs_f64()),
                stayed_secs: h.since.map(|t| now.duration_since(t).as_secs_f64()),
            });
        }
        for c in &candidates {
            if let Some(w) = s.watched.get_mut(&c.pid) {
                w.rate_bps = c.rate_bps;
            }
        }
        candidates.sort_by_key(|c| c.pid);
        let cooling = s.last_move.and_then(|t| {
            let left = cfg.cooldown_secs as f64 - now.duration_since(t).as_secs_f64();
            (left > 0.0).then_some(left)
        });
        (me, candidates, cooling)
    };
    let others: Vec<NodeView> = node
        .membership
        .members()
        .into_iter()
        .filter_map(|m| Some(NodeView::from_load(&m.id.name, m.load.as_ref()?)))
        .collect();
    let backing_off = {
        let s = b.lock();
        (candidates.is_empty() && !s.handed.is_empty()).then(|| s.handed.len())
    };
    let plan = match backing_off {
        Some(n) => Plan::Stay {
            pid: None,
            reason: format!(
                "the {n} process(es) handed over here failed to move less than {} s ago",
                FAILED_BACKOFF.as_secs()
            ),
        },
        None => balance::plan(cfg, &me, &others, &candidates, cooling),
    };
    let decision = |action: &str, pid: Option<i32>, to: Option<String>, reason: String| Decision {
        unix_ms: now_unix_ms(),
        node: String::new(),
        algorithm: cfg.algorithm,
        action: action.to_string(),
        pid,
        command: pid.map(comm),
        to,
        reason,
        load: 0.0,
        candidates: candidates.clone(),
    };
    match plan {
        Plan::Stay { pid, reason } => {
            // Unchanged reasons are logged again only now and then.
            let key = format!("{pid:?} {}", reason.chars().take(24).collect::<String>());
            let fresh = {
                let mut s = b.lock();
                let fresh =
                    !matches!(&s.last_stay, Some((k, t)) if *k == key && t.elapsed() < STAY_RELOG);
                if fresh {
                    s.last_stay = Some((key, Instant::now()));
                }
                fresh
            };
            if fresh {
                b.record(node.name(), me.ratio(), decision("stay", pid, None, reason));
            }
        }
        Plan::Move {
            pid,
            to,
            cause,
            reason,
        } => {
            b.lock().last_stay = None;
            b.record(
                node.name(),
                me.ratio(),
                decision("move", Some(pid), Some(to.clone()), reason),
            );
            let command = comm(pid);
            // The identity it moves under (a `ferry run` program's home is this node).
            let home = crate::migrate::moving_guest(node, pid)
                .map_or((node.name().to_string(), pid), |g| {
                    (g.home_node, g.home_pid)
                });
            let (mut cli, mut sink) = match tokio::net::UnixStream::pair() {
                Ok(p) => p,
                Err(e) => {
                    tracing::error!(error = %e, "balancer: socket pair");
                    return;
                }
            };
            // The migration reports its progress to a CLI; nobody reads it here.
            let drain = tokio::spawn(async move {
                use tokio::io::AsyncReadExt;
                let mut buf = [0u8; 4096];
                while matches!(sink.read(&mut buf).await, Ok(n) if n > 0) {}
            });
            let t0 = Instant::now();
            let r = crate::migrate::send(node.clone(), &mut cli, pid, &to, "auto", None).await;
            drop(cli);
            let _ = drain.await;
            match r {
                Ok(report) => {
                    {
                        let mut s = b.lock();
                        s.handed.remove(&pid);
                        s.watched.remove(&pid);
                        s.last_move = Some(Instant::now());
                    }
                    let mut d = decision(
                        "moved",
                        Some(pid),
                        Some(to.clone()),
                        format!(
                            "{cause}: moved to {to} in {:.0} ms (frozen {:.0} ms), PID {} there",
                            t0.elapsed().as_secs_f64() * 1e3,
                            report.freeze_ms,
                            report.dest_pid
                        ),
                    );
                    d.command = Some(command);
                    b.record(node.name(), me.ratio(), d);
                    // Its new node takes it over, with its minimum stay starting now.
                    let adopt = Msg::BalanceAdopt {
                        home_node: home.0,
                        home_pid: home.1,
                    };
                    if let Err(e) = crate::deputies::ask(node, &to, adopt).await {
                        tracing::warn!(event = "balance-adopt-unheard", to = %to,
                            error = %format!("{e:#}"));
                    }
                }
                Err(e) => {
                    b.lock().failed.insert(pid, Instant::now());
                    b.record(
                        node.name(),
                        me.ratio(),
                        decision(
                            "failed",
                            Some(pid),
                            Some(to),
                            format!("{e:#} (not tried again for {} s)", FAILED_BACKOFF.as_secs()),
                        ),
                    );
                }
            }
        }
    }
}

/// A peer's `BalanceAdopt`: the guest with this home identity, which `from`'s balancer just
/// sent here, is handed to this node's balancer, its minimum stay starting now. Taken only from
/// the node that sent it (recorded by the migration: [`Balancer::arrived`]).
pub fn adopt(node: &Node, from: &str, home_node: &str, home_pid: i32) -> Msg {
    if !node.balancer.sent_by(from, home_node, home_pid) {
        return Msg::error(format!(
            "node {from} did not send the guest from {home_node} with home PID {home_pid} here \
             (in the last {} s)",
            ADOPT_WINDOW.as_secs()
        ));
    }
    let guest = node
        .guests
        .list()
        .into_iter()
        .find(|g| g.home_node == home_node && g.home_pid == home_pid);
    match guest {
        Some(g) => match node.balancer.add(
            g.pid,
            &format!("moved here by the balancer of {from}"),
            true,
        ) {
            Ok(()) => {
                node.balancer.lock().last_move = Some(Instant::now());
                Msg::Done
            }
            Err(e) => Msg::error(format!("{e:#}")),
        },
        None => Msg::error(format!(
            "no guest here from {home_node} with home PID {home_pid}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_sender_may_hand_over_a_guest_it_sent() {
        let b = Balancer::new(BalanceConfig::default());
        b.arrived("a", "a", 42);
        assert!(b.sent_by("a", "a", 42));
        assert!(!b.sent_by("c", "a", 42), "another member");
        assert!(!b.sent_by("a", "a", 43), "another guest");
        assert!(!b.sent_by("a", "b", 42), "another home");
    }
}
