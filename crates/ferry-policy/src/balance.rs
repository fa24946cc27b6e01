//! Automatic load balancing: which process, if any, this node should send where, and why.
//!
//! Each node decides for itself (MOSIX): it knows the load every node gossips and the
//! processes its owners handed to Ferry for balancing, and it sheds one of its own processes to
//! a less loaded node when the difference is worth it. The rules, from DUNES §4.4 (Fig 4.4):
//!
//! 1. Take the least loaded node that may take guests. If this node's load (runnable demand
//!    per CPU of capacity) exceeds it by less than `theta1`, nothing moves.
//! 2. Choose the process (`choose_victim`): [`Algorithm::Cpu`] (DUNES Algorithm 1) takes the
//!    one using the most CPU; [`Algorithm::Coupling`] (Algorithm 3) the one with the highest
//!    average normalized rank of CPU use (higher is better) and data rate (lower is better): a
//!    busy process that talks little. (Demand, the time a process wants a CPU, decides whether
//!    it is CPU-bound and what a move does to the loads; use, the CPU it got, ranks.)
//! 3. Predict the imbalance after the move; unless it shrinks by at least `theta2`, nothing
//!    moves (this is the hysteresis that stops a lone process from bouncing between two idle
//!    nodes).
//! 4. [`Algorithm::Coupling`] also weighs gain against cost: the CPU time per second the move
//!    gains the cluster must beat what its data rate costs once it crosses the network plus its
//!    memory's transfer spread over the minimum stay.
//!
//! Around these: a process is considered only once it has been watched for `min_age_secs`
//! (long-running) and is CPU-bound (`min_demand`); one that arrived less than `min_stay_secs`
//! ago stays; a node that sent or received a process less than `cooldown_secs` ago waits (its
//! load and the others' must settle first). Memory ushering comes first: a node with less than
//! `memory_low_bytes` available sends its largest process to the node with the most.
//!
//! Everything returns a [`Plan`] with its reason, moving or not, for the decision log.

use crate::NodeLoad;
use serde::{Deserialize, Serialize};

/// How the victim is chosen (DUNES §4.4.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Algorithm {
    /// Algorithm 1: the highest CPU use, whatever it talks to.
    Cpu,
    /// Algorithm 3: CPU use and measured data rate, by average normalized rank, and a move
    /// only if its predicted gain beats its cost.
    #[default]
    Coupling,
}

impl Algorithm {
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Cpu => "cpu",
            Algorithm::Coupling => "coupling",
        }
    }
}

/// The `[balance]` section of a node's config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BalanceConfig {
    /// Balancing runs at all (it only ever moves processes handed to it).
    pub enabled: bool,
    pub algorithm: Algorithm,
    /// How often the node decides, in milliseconds.
    pub period_ms: u64,
    /// Least difference of load (runnable demand per CPU) between this node and the target
    /// for a move to be considered (DUNES θ1).
    pub theta1: f64,
    /// Least reduction of that difference a move must predict (DUNES θ2).
    pub theta2: f64,
    /// Least CPU demand (runnable threads, averaged) of a process to move: CPU-bound ones only.
    pub min_demand: f64,
    /// A process is watched this long before it may move (long-running ones only).
    pub min_age_secs: u64,
    /// A process that arrived stays at least this long.
    pub min_stay_secs: u64,
    /// After a node sent or received a process, it waits this long before sending another.
    pub cooldown_secs: u64,
    /// Weight of CPU demand against data rate in Algorithm 3's rank (DUNES ω).
    pub weight_cpu: f64,
    /// CPU seconds a byte costs once it crosses the network between two nodes instead of
    /// staying on one (the relays, the network stack at both ends).
    pub remote_cpu_per_byte: f64,
    /// CPU seconds a byte of the process's memory costs to migrate (about 1.7 ms per MiB
    /// measured between two nodes of one machine: docs/benchmarks.md).
    pub migrate_cpu_per_byte: f64,
    /// Below this much available memory, the node sends processes away (memory ushering).
    pub memory_low_bytes: u64,
    /// Commands (their `comm`, as /proc/PID/comm) this node's owner hands to Ferry for
    /// balancing, besides those handed one by one with `ferry balance add PID`.
    pub allow: Vec<String>,
}

impl Default for BalanceConfig {
    fn default() -> Self {
        BalanceConfig {
            enabled: true,
            algorithm: Algorithm::Coupling,
            period_ms: 1000,
            theta1: 0.5,
            theta2: 0.25,
            min_demand: 0.5,
            min_age_secs: 3,
            min_stay_secs: 30,
            cooldown_secs: 8,
            weight_cpu: 0.5,
            // About 100 MiB/s of relayed traffic per CPU (a TLS relay through two daemons).
            remote_cpu_per_byte: 1.0 / (100.0 * 1048576.0),
            migrate_cpu_per_byte: 1.7e-3 / 1048576.0,
            memory_low_bytes: 256 << 20,
            allow: Vec::new(),
        }
    }
}

impl BalanceConfig {
    /// Checks the figures make sense; the error names the field.
    pub fn check(&self) -> Result<(), String> {
        let nonneg = [
            ("theta1", self.theta1),
            ("theta2", self.theta2),
            ("min_demand", self.min_demand),
            ("remote_cpu_per_byte", self.remote_cpu_per_byte),
            ("migrate_cpu_per_byte", self.migrate_cpu_per_byte),
        ];
        for (name, v) in nonneg {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("balance.{name} must be a number >= 0, not {v}"));
            }
        }
        if !(0.0..=1.0).contains(&self.weight_cpu) {
            return Err(format!(
                "balance.weight_cpu must be between 0 and 1, not {}",
                self.weight_cpu
            ));
        }
        if self.period_ms < 100 {
            return Err(format!(
                "balance.period_ms must be at least 100, not {}",
                self.period_ms
            ));
        }
        Ok(())
    }
}

/// A node as the balancer sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeView {
    pub name: String,
    /// Runnable demand: threads wanting a CPU, averaged.
    pub demand: f64,
    /// CPUs it has (a fraction under a CPU quota).
    pub capacity: f64,
    pub free_memory_bytes: u64,
    /// It may take guests now (accepting, load known, owner away).
    pub open: bool,
}

impl NodeView {
    /// From what a node gossips: its balancing figures when it publishes them, else its
    /// runnable count over its CPUs.
    pub fn from_load(name: &str, l: &NodeLoad) -> NodeView {
        let (demand, capacity) = if l.capacity > 0.0 {
            (l.demand as f64, l.capacity as f64)
        } else {
            (l.runnable as f64, l.cpus.max(1) as f64)
        };
        NodeView {
            name: name.to_string(),
            demand,
            capacity,
            free_memory_bytes: l.free_memory_bytes,
            open: l.accepting && !l.stale && !l.owner_present(),
        }
    }

    /// Demand per CPU: 1.0 is a node exactly busy.
    pub fn ratio(&self) -> f64 {
        self.demand / self.capacity.max(1e-3)
    }
}

/// A process handed to the balancer, as measured on this node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    /// Its PID on this node.
    pub pid: i32,
    pub command: String,
    /// Why it is the balancer's: handed over with `ferry balance add`, allowed by the config,
    /// or sent here by another node's balancer.
    #[serde(default)]
    pub origin: String,
    /// Runnable threads of its tree, averaged (1.0: one thread always wanting a CPU).
    pub demand: f64,
    /// CPU it got, in CPUs (CPU seconds per second).
    pub cpu: f64,
    /// Bytes per second it reads and writes (its data rate: DUNES' coupling measure).
    pub rate_bps: f64,
    pub memory_bytes: u64,
    /// How long this node has watched it.
    pub watched_secs: f64,
    /// How long it has been on this node since another node's balancer sent it here (None for
    /// a process handed over where it runs: it may move as soon as it is watched long enough).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stayed_secs: Option<f64>,
}

/// What the balancer decided, and why.
#[derive(Debug, Clone, PartialEq)]
pub enum Plan {
    Move {
        pid: i32,
        to: String,
        /// "load" or "memory"
        cause: &'static str,
        reason: String,
    },
    Stay {
        /// The process it would have moved, if it got that far.
        pid: Option<i32>,
        reason: String,
    },
}

impl Plan {
    fn stay(reason: impl Into<String>) -> Plan {
        Plan::Stay {
            pid: None,
            reason: reason.into(),
        }
    }
}

/// One line of the decision log (`ferry balance log`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    pub unix_ms: u64,
    pub node: String,
    pub algorithm: Algorithm,
    /// "move" (decided), "moved", "failed", "stay"
    pub action: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<String>,
    pub reason: String,
    /// This node's demand per CPU when deciding.
    pub load: f64,
    /// The candidates as measured then.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub candidates: Vec<Candidate>,
}

/// Normalized ranks of `v` (DUNES γ): 0 for the least, 1 for the greatest, all 1 if equal.
fn ranks(v: &[f64]) -> Vec<f64> {
    let lo = v.iter().cloned().fold(f64::INFINITY, f64::min);
    let hi = v.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    v.iter()
        .map(|x| if hi > lo { (x - lo) / (hi - lo) } else { 1.0 })
        .collect()
}

/// DUNES' `chooseProcessToMigrate()`: the index in `c` of the victim, and how it was chosen.
pub fn choose_victim(alg: Algorithm, weight_cpu: f64, c: &[Candidate]) -> Option<(usize, String)> {
    if c.is_empty() {
        return None;
    }
    match alg {
        Algorithm::Cpu => {
            let (i, v) = c.iter().enumerate().max_by(|(_, a), (_, b)| {
                a.cpu
                    .total_cmp(&b.cpu)
                    .then(a.demand.total_cmp(&b.demand))
                    .then(b.pid.cmp(&a.pid))
            })?;
            Some((i, format!("highest CPU use ({:.2} CPU)", v.cpu)))
        }
        Algorithm::Coupling => {
            let cpu = ranks(&c.iter().map(|x| x.cpu).collect::<Vec<_>>());
            // Less data is better: rank the negated rates.
            let quiet = ranks(&c.iter().map(|x| -x.rate_bps).collect::<Vec<_>>());
            let score: Vec<f64> = cpu
                .iter()
                .zip(&quiet)
                .map(|(a, b)| weight_cpu * a + (1.0 - weight_cpu) * b)
                .collect();
            let i = (0..c.len()).max_by(|&a, &b| {
                score[a]
                    .total_cmp(&score[b])
                    .then(c[b].rate_bps.total_cmp(&c[a].rate_bps))
                    .then(c[b].pid.cmp(&c[a].pid))
            })?;
            Some((
                i,
                format!(
                    "best rank {:.2} of CPU use ({:.2} CPU) and data rate ({})",
                    score[i],
                    c[i].cpu,
                    human_rate(c[i].rate_bps)
                ),
            ))
        }
    }
}

pub fn human_rate(bps: f64) -> String {
    if bps >= 1048576.0 {
        format!("{:.1} MiB/s", bps / 1048576.0)
    } else if bps >= 1024.0 {
        format!("{:.1} KiB/s", bps / 1024.0)
    } else {
        format!("{bps:.0} B/s")
    }
}

/// CPUs of work a node gets done with `demand`.
fn served(demand: f64, capacity: f64) -> f64 {
    demand.min(capacity)
}

/// The share of a CPU each unit of demand gets on a node (a fair scheduler).
fn share(demand: f64, capacity: f64) -> f64 {
    if demand <= capacity {
        1.0
    } else {
        capacity / demand
    }
}

/// The gain of moving `v` from `src` to `dst`, in CPU seconds per second: what the two nodes
/// get done in addition, plus how much faster `v` itself runs (DUNES' progress rate, in CPU
/// terms; a move between two saturated nodes gains only the latter). And its cost, in the same
/// unit: the data it reads and writes crossing the network instead of staying on one node, plus
/// its memory's transfer spread over the minimum stay.
pub fn gain_and_cost(
    cfg: &BalanceConfig,
    src: &NodeView,
    dst: &NodeView,
    v: &Candidate,
) -> (f64, f64) {
    let d = v.demand;
    let before = served(src.demand, src.capacity) + served(dst.demand, dst.capacity);
    let after =
        served((src.demand - d).max(0.0), src.capacity) + served(dst.demand + d, dst.capacity);
    let faster = d * (share(dst.demand + d, dst.capacity) - share(src.demand, src.capacity));
    let gain = after - before + faster;
    let horizon = cfg.min_stay_secs.max(1) as f64;
    let cost = v.rate_bps * cfg.remote_cpu_per_byte
        + v.memory_bytes as f64 * cfg.migrate_cpu_per_byte / horizon;
    (gain, cost)
}

/// What this node should do now. `me` is this node; `others` the live members; `candidates`
/// the processes handed to the balancer here (all of them: those not yet old enough, or not
/// staying long enough, are filtered here so the reason can say so); `cooling` how many
/// seconds of cool-down remain, if any.
pub fn plan(
    cfg: &BalanceConfig,
    me: &NodeView,
    others: &[NodeView],
    candidates: &[Candidate],
    cooling: Option<f64>,
) -> Plan {
    if let Some(left) = cooling {
        return Plan::stay(format!(
            "cooling down: a process moved to or from this node, {left:.0} s more before the next move"
        ));
    }
    if candidates.is_empty() {
        return Plan::stay(
            "no process here is handed to Ferry for balancing (`ferry balance add PID`, or \
             `allow` in the config)",
        );
    }
    let settled: Vec<&Candidate> = candidates
        .iter()
        .filter(|c| c.stayed_secs.is_none_or(|s| s >= cfg.min_stay_secs as f64))
        .collect();
    if settled.is_empty() {
        let c = candidates
            .iter()
            .max_by(|a, b| {
                a.stayed_secs
                    .unwrap_or(0.0)
                    .total_cmp(&b.stayed_secs.unwrap_or(0.0))
            })
            .expect("not empty");
        return Plan::stay(format!(
            "every process handed over arrived less than the minimum stay ({} s) ago (the \
             longest here, PID {}, {:.0} s)",
            cfg.min_stay_secs,
            c.pid,
            c.stayed_secs.unwrap_or(0.0)
        ));
    }
    let open: Vec<&NodeView> = others.iter().filter(|n| n.open).collect();

    // Memory ushering first: a node short of memory sends its largest process away.
    if me.free_memory_bytes < cfg.memory_low_bytes {
        let victim = settled
            .iter()
            .max_by_key(|c| c.memory_bytes)
            .expect("not empty");
        let target = open
            .iter()
            .filter(|n| n.free_memory_bytes >= cfg.memory_low_bytes + victim.memory_bytes)
            .max_by_key(|n| n.free_memory_bytes);
        return match target {
            Some(t) => Plan::Move {
                pid: victim.pid,
                to: t.name.clone(),
                cause: "memory",
                reason: format!(
                    "memory ushering: {} MiB available here, under {} MiB; PID {} holds the \
                     most ({} MiB); node {} has {} MiB available",
                    me.free_memory_bytes >> 20,
                    cfg.memory_low_bytes >> 20,
                    victim.pid,
                    victim.memory_bytes >> 20,
                    t.name,
                    t.free_memory_bytes >> 20
                ),
            },
            None => Plan::Stay {
                pid: Some(victim.pid),
                reason: format!(
                    "short of memory ({} MiB available, under {} MiB), but no node could take \
                     PID {} ({} MiB) and stay above that",
                    me.free_memory_bytes >> 20,
                    cfg.memory_low_bytes >> 20,
                    victim.pid,
                    victim.memory_bytes >> 20
                ),
            },
        };
    }

    let Some(dst) = open.iter().min_by(|a, b| {
        a.ratio()
            .total_cmp(&b.ratio())
            .then_with(|| a.name.cmp(&b.name))
    }) else {
        return Plan::stay("no other node takes guests now");
    };
    let imbalance = me.ratio() - dst.ratio();
    if imbalance < cfg.theta1 {
        return Plan::stay(format!(
            "balanced enough: load {:.2} here, {:.2} on {} (the least loaded), a difference \
             under theta1 = {}",
            me.ratio(),
            dst.ratio(),
            dst.name,
            cfg.theta1
        ));
    }
    // The choice is made among all CPU-bound candidates; one chosen before it was watched long
    // enough waits (choosing among the older ones only would favour whoever was handed first).
    let eligible: Vec<Candidate> = settled
        .iter()
        .filter(|c| c.demand >= cfg.min_demand)
        .map(|c| (*c).clone())
        .collect();
    if eligible.is_empty() {
        return Plan::stay(format!(
            "overloaded (load {:.2} against {:.2} on {}), but no process handed over here is \
             CPU-bound (demand >= {})",
            me.ratio(),
            dst.ratio(),
            dst.name,
            cfg.min_demand
        ));
    }
    let (i, why) =
        choose_victim(cfg.algorithm, cfg.weight_cpu, &eligible).expect("eligible is not empty");
    let v = &eligible[i];
    if v.watched_secs < cfg.min_age_secs as f64 {
        return Plan::Stay {
            pid: Some(v.pid),
            reason: format!(
                "PID {} ({why}) would go, but it has been watched {:.1} s only (min_age_secs = {})",
                v.pid, v.watched_secs, cfg.min_age_secs
            ),
        };
    }
    let after_src = NodeView {
        demand: (me.demand - v.demand).max(0.0),
        ..me.clone()
    };
    let after_dst = NodeView {
        demand: dst.demand + v.demand,
        ..(*dst).clone()
    };
    let predicted = (after_src.ratio() - after_dst.ratio()).abs();
    if predicted >= imbalance - cfg.theta2 {
        return Plan::Stay {
            pid: Some(v.pid),
            reason: format!(
                "moving PID {} ({why}) to {} would leave an imbalance of {predicted:.2} against \
                 {imbalance:.2} now: not smaller by theta2 = {}",
                v.pid, dst.name, cfg.theta2
            ),
        };
    }
    let (gain, cost) = gain_and_cost(cfg, me, dst, v);
    let weighed = format!(
        "predicted gain {gain:.2} CPU, cost {cost:.3} CPU ({} of data, {} MiB of memory)",
        human_rate(v.rate_bps),
        v.memory_bytes >> 20
    );
    if cfg.algorithm == Algorithm::Coupling && gain <= cost {
        return Plan::Stay {
            pid: Some(v.pid),
            reason: format!(
                "moving PID {} ({why}) to {} does not pay: {weighed}",
                v.pid, dst.name
            ),
        };
    }
    Plan::Move {
        pid: v.pid,
        to: dst.name.clone(),
        cause: "load",
        reason: format!(
            "load {:.2} here against {:.2} on {} (least loaded); PID {}: {why}; imbalance \
             {imbalance:.2} -> {predicted:.2}; {weighed}",
            me.ratio(),
            dst.ratio(),
            dst.name,
            v.pid
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, demand: f64, capacity: f64) -> NodeView {
        NodeView {
            name: name.into(),
            demand,
            capacity,
            free_memory_bytes: 8 << 30,
            open: true,
        }
    }

    fn cand(pid: i32, demand: f64, rate_bps: f64) -> Candidate {
        Candidate {
            pid,
            command: format!("p{pid}"),
            origin: String::new(),
            demand,
            cpu: demand,
            rate_bps,
            memory_bytes: 4 << 20,
            watched_secs: 100.0,
            stayed_secs: None,
        }
    }

    fn cfg(alg: Algorithm) -> BalanceConfig {
        BalanceConfig {
            algorithm: alg,
            ..Default::default()
        }
    }

    /// DUNES Fig 4.4: Gw (busiest, writes 10:1 to Grs and Grl), I (independent).
    fn dunes() -> Vec<Candidate> {
        vec![
            cand(1, 0.95, 11.0 * 1048576.0), // Gw
            cand(2, 0.6, 10.0 * 1048576.0),  // Grs
            cand(3, 0.6, 1.0 * 1048576.0),   // Grl
            cand(4, 0.65, 0.0),              // I
        ]
    }

    #[test]
    fn algorithm_1_takes_the_busiest_algorithm_3_the_busy_and_quiet() {
        let c = dunes();
        let (i, _) = choose_victim(Algorithm::Cpu, 0.5, &c).unwrap();
        assert_eq!(c[i].pid, 1);
        let (i, why) = choose_victim(Algorithm::Coupling, 0.5, &c).unwrap();
        assert_eq!(c[i].pid, 4, "{why}");
        // Once I is gone: the weakly coupled reader, not the strongly coupled one.
        let rest: Vec<Candidate> = c.into_iter().filter(|x| x.pid != 4).collect();
        let (i, _) = choose_victim(Algorithm::Coupling, 0.5, &rest).unwrap();
        assert_eq!(rest[i].pid, 3);
    }

    #[test]
    fn an_overloaded_node_sheds_to_the_idlest() {
        let me = node("a", 2.8, 1.0);
        let others = [node("b", 0.0, 1.0), node("c", 0.5, 1.0)];
        match plan(&cfg(Algorithm::Cpu), &me, &others, &dunes(), None) {
            Plan::Move { pid, to, .. } => assert_eq!((pid, to.as_str()), (1, "b")),
            p => panic!("{p:?}"),
        }
        match plan(&cfg(Algorithm::Coupling), &me, &others, &dunes(), None) {
            Plan::Move {
                pid, to, reason, ..
            } => {
                assert_eq!((pid, to.as_str()), (4, "b"), "{reason}")
            }
            p => panic!("{p:?}"),
        }
    }

    #[test]
    fn a_lone_process_does_not_bounce() {
        // One CPU-bound process on a, b idle: moving it just swaps the imbalance.
        let me = node("a", 1.0, 1.0);
        let c = [cand(7, 1.0, 0.0)];
        match plan(&cfg(Algorithm::Cpu), &me, &[node("b", 0.0, 1.0)], &c, None) {
            Plan::Stay { pid, reason } => {
                assert_eq!(pid, Some(7));
                assert!(reason.contains("theta2"), "{reason}");
            }
            p => panic!("{p:?}"),
        }
        // Two on a: one goes; then with one each nothing more happens.
        let two = [cand(7, 1.0, 0.0), cand(8, 1.0, 0.0)];
        assert!(matches!(
            plan(
                &cfg(Algorithm::Cpu),
                &node("a", 2.0, 1.0),
                &[node("b", 0.0, 1.0)],
                &two,
                None
            ),
            Plan::Move { .. }
        ));
        assert!(matches!(
            plan(
                &cfg(Algorithm::Cpu),
                &node("a", 1.0, 1.0),
                &[node("b", 1.0, 1.0)],
                &c,
                None
            ),
            Plan::Stay { .. }
        ));
    }

    #[test]
    fn stays_cooldowns_and_thresholds_are_reasons() {
        let me = node("a", 3.0, 1.0);
        let b = [node("b", 0.0, 1.0)];
        let mut fresh = dunes();
        for c in &mut fresh {
            c.stayed_secs = Some(2.0);
        }
        let reason = |p: Plan| match p {
            Plan::Stay { reason, .. } => reason,
            p => panic!("{p:?}"),
        };
        let c = cfg(Algorithm::Cpu);
        assert!(reason(plan(&c, &me, &b, &fresh, None)).contains("minimum stay"));
        assert!(reason(plan(&c, &me, &b, &dunes(), Some(3.0))).contains("cooling down"));
        assert!(reason(plan(&c, &me, &b, &[], None)).contains("handed to Ferry"));
        assert!(reason(plan(&c, &node("a", 0.3, 1.0), &b, &dunes(), None)).contains("theta1"));
        let mut closed = b.clone();
        closed[0].open = false;
        assert!(reason(plan(&c, &me, &closed, &dunes(), None)).contains("takes guests"));
        let idle: Vec<Candidate> = dunes()
            .into_iter()
            .map(|mut x| {
                x.demand = 0.1;
                x
            })
            .collect();
        assert!(reason(plan(&c, &me, &b, &idle, None)).contains("CPU-bound"));
    }

    #[test]
    fn a_victim_watched_too_briefly_waits_and_is_not_replaced_by_an_older_one() {
        let me = node("a", 2.8, 1.0);
        let b = [node("b", 0.0, 1.0)];
        let mut c = dunes();
        c[3].watched_secs = 0.5; // I, the one Algorithm 3 wants, was handed over last
        match plan(&cfg(Algorithm::Coupling), &me, &b, &c, None) {
            Plan::Stay { pid, reason } => {
                assert_eq!(pid, Some(4));
                assert!(reason.contains("watched"), "{reason}");
            }
            p => panic!("{p:?}"),
        }
    }

    #[test]
    fn algorithm_3_refuses_a_move_that_costs_more_than_it_gains() {
        let me = node("a", 2.0, 1.0);
        let b = [node("b", 0.0, 1.0)];
        // Both chatty: moving either sends 500 MiB/s across the network.
        let c = [
            cand(1, 1.0, 500.0 * 1048576.0),
            cand(2, 1.0, 500.0 * 1048576.0),
        ];
        match plan(&cfg(Algorithm::Coupling), &me, &b, &c, None) {
            Plan::Stay { reason, .. } => assert!(reason.contains("does not pay"), "{reason}"),
            p => panic!("{p:?}"),
        }
        // Algorithm 1 does not weigh it.
        assert!(matches!(
            plan(&cfg(Algorithm::Cpu), &me, &b, &c, None),
            Plan::Move { .. }
        ));
    }

    #[test]
    fn memory_ushering_sends_the_largest_where_memory_is() {
        let mut me = node("a", 0.1, 1.0);
        me.free_memory_bytes = 100 << 20;
        let mut b = node("b", 3.0, 1.0);
        b.free_memory_bytes = 4 << 30;
        let mut c = node("c", 0.0, 1.0);
        c.free_memory_bytes = 1 << 30;
        let mut big = cand(9, 0.0, 0.0);
        big.memory_bytes = 512 << 20;
        let procs = [cand(1, 1.0, 0.0), big];
        match plan(&cfg(Algorithm::Cpu), &me, &[b, c], &procs, None) {
            Plan::Move { pid, to, cause, .. } => {
                assert_eq!((pid, to.as_str(), cause), (9, "b", "memory"))
            }
            p => panic!("{p:?}"),
        }
    }

    #[test]
    fn config_is_checked() {
        assert!(BalanceConfig::default().check().is_ok());
        let bad = BalanceConfig {
            weight_cpu: 2.0,
            ..Default::default()
        };
        assert!(bad.check().unwrap_err().contains("weight_cpu"));
        let bad = BalanceConfig {
            theta1: f64::NAN,
            ..Default::default()
        };
        assert!(bad.check().unwrap_err().contains("theta1"));
    }
}
