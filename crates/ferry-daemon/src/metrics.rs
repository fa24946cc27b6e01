//! What a daemon counts about itself, exported in the Prometheus text format (`/metrics` on
//! the daemon's page, crate::web): migrations in and out and how long they took, failed moves
//! by reason, deputies, signals forwarded, remote executions, and the load of every node it
//! knows. Also the CPU meter behind the CPU column of `ferry top`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NodeLabel {
    node: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SideLabel {
    side: String,
}

type FloatGauge = Gauge<f64, AtomicU64>;

pub struct Metrics {
    registry: Registry,
    migrations_out: Counter,
    migrations_in: Counter,
    out_seconds: Histogram,
    in_seconds: Histogram,
    failed: Family<ReasonLabel, Counter>,
    remote_execs: Family<SideLabel, Counter>,
    signals_forwarded: Counter,
    deputies: Gauge,
    node_load: Family<NodeLabel, FloatGauge>,
    node_busyness: Family<NodeLabel, FloatGauge>,
    node_runnable: Family<NodeLabel, Gauge>,
    node_cpu_idle: Family<NodeLabel, FloatGauge>,
    node_free_memory: Family<NodeLabel, Gauge>,
    node_guests: Family<NodeLabel, Gauge>,
    node_accepting: Family<NodeLabel, Gauge>,
    /// Serializes scrapes: each refills the node gauges before encoding.
    scrape: Mutex<()>,
}

/// Why a move failed, as a metric label: a few fixed words, from the error's text.
pub fn failure_reason(message: &str) -> &'static str {
    let m = message.to_ascii_lowercase();
    let any = |words: &[&str]| words.iter().any(|w| m.contains(w));
    if any(&["could not rebuild", "the source gave up", "did not commit"]) {
        "destination-failed"
    } else if any(&[
        "cannot move",
        "cannot be checkpointed",
        "capture worker",
        "unsupported",
    ]) {
        "unmovable"
    } else if any(&[" refused pid", "refused the offer", "does not accept"]) {
        "refused"
    } else if any(&[
        "already on node",
        "no such process",
        "no live node",
        "no process",
    ]) {
        "bad-request"
    } else if any(&[
        "did not answer",
        "lost node",
        "reach node",
        "did not confirm",
        "timed out",
    ]) {
        "peer-unreachable"
    } else {
        "other"
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("ferry");
        // From 1 ms to about 65 s.
        let buckets = || exponential_buckets(0.001, 2.0, 17);
        let m = Metrics {
            migrations_out: Counter::default(),
            migrations_in: Counter::default(),
            out_seconds: Histogram::new(buckets()),
            in_seconds: Histogram::new(buckets()),
            failed: Family::default(),
            remote_execs: Family::default(),
            signals_forwarded: Counter::default(),
            deputies: Gauge::default(),
            node_load: Family::default(),
            node_busyness: Family::default(),
            node_runnable: Family::default(),
            node_cpu_idle: Family::default(),
            node_free_memory: Family::default(),
            node_guests: Family::default(),
            node_accepting: Family::default(),
            scrape: Mutex::new(()),
            registry: Registry::default(),
        };
        registry.register(
            "migrations_out",
            "Trees this node sent away that run at their destination",
            m.migrations_out.clone(),
        );
        registry.register(
            "migrations_in",
            "Trees this node received that run here",
            m.migrations_in.clone(),
        );
        registry.register(
            "migration_out_duration_seconds",
            "A successful move from this node, from the request to the tree running there",
            m.out_seconds.clone(),
        );
        registry.register(
            "migration_in_duration_seconds",
            "A successful move to this node, from the offer to the tree running here",
            m.in_seconds.clone(),
        );
        registry.register(
            "migrations_failed",
            "Moves from this node that failed (the tree stayed), by reason",
            m.failed.clone(),
        );
        registry.register(
            "remote_execs",
            "Remote executions: side=caller, asked from here; side=host, run here for another node",
            m.remote_execs.clone(),
        );
        registry.register(
            "signals_forwarded",
            "Signals sent to deputies here and forwarded to their bodies",
            m.signals_forwarded.clone(),
        );
        registry.register(
            "deputies",
            "Deputies kept at this home for trees that run elsewhere",
            m.deputies.clone(),
        );
        registry.register(
            "node_load1",
            "Each known node's load average over the last minute",
            m.node_load.clone(),
        );
        registry.register(
            "node_busyness",
            "Each known node's busyness as host selection ranks it (runnable per CPU, CPU busy, guests)",
            m.node_busyness.clone(),
        );
        registry.register(
            "node_runnable",
            "Processes ready to run on each known node",
            m.node_runnable.clone(),
        );
        registry.register(
            "node_cpu_idle_percent",
            "Share of CPU time idle on each known node over its last sampling second",
            m.node_cpu_idle.clone(),
        );
        registry.register(
            "node_free_memory_bytes",
            "Memory available on each known node",
            m.node_free_memory.clone(),
        );
        registry.register(
            "node_guests",
            "Guests each known node runs",
            m.node_guests.clone(),
        );
        registry.register(
            "node_accepting",
            "1 if the node takes guests",
            m.node_accepting.clone(),
        );
        Metrics { registry, ..m }
    }

    /// A move from this node ended: `Ok` with its duration, or the error's message.
    pub fn migration_out(&self, result: Result<Duration, &str>) {
        match result {
            Ok(d) => {
                self.migrations_out.inc();
                self.out_seconds.observe(d.as_secs_f64());
            }
            Err(message) => {
                self.failed
                    .get_or_create(&ReasonLabel {
                        reason: failure_reason(message).to_string(),
                    })
                    .inc();
            }
        }
    }

    /// A tree offered at `since` runs here now.
    pub fn migration_in(&self, since: Instant) {
        self.migrations_in.inc();
        self.in_seconds.observe(since.elapsed().as_secs_f64());
    }

    /// A remote execution: asked from here (`caller`) or run here (`host`).
    pub fn remote_exec(&self, side: &str) {
        self.remote_execs
            .get_or_create(&SideLabel {
                side: side.to_string(),
            })
            .inc();
    }

    pub fn signal_forwarded(&self) {
        self.signals_forwarded.inc();
    }

    /// The text exposition, with the node gauges set from `nodes` and the deputies gauge from
    /// `deputies` first.
    pub fn encode(
        &self,
        nodes: &[ferry_transport::message::NodeInfo],
        deputies: usize,
    ) -> Result<String, std::fmt::Error> {
        let _one = self.scrape.lock().expect("metrics lock");
        self.deputies.set(deputies as i64);
        for f in [
            &self.node_runnable,
            &self.node_free_memory,
            &self.node_guests,
            &self.node_accepting,
        ] {
            f.clear();
        }
        self.node_load.clear();
        self.node_busyness.clear();
        self.node_cpu_idle.clear();
        for n in nodes {
            let Some(l) = &n.load else { continue };
            let label = NodeLabel {
                node: n.name.clone(),
            };
            self.node_load
                .get_or_create(&label)
                .set(l.owner.load_avg_1m as f64);
            self.node_busyness.get_or_create(&label).set(l.busyness());
            self.node_runnable
                .get_or_create(&label)
                .set(l.runnable as i64);
            self.node_cpu_idle
                .get_or_create(&label)
                .set(l.cpu_idle_pct as f64);
            self.node_free_memory
                .get_or_create(&label)
                .set(l.free_memory_bytes.min(i64::MAX as u64) as i64);
            self.node_guests.get_or_create(&label).set(l.guests as i64);
            self.node_accepting
                .get_or_create(&label)
                .set(i64::from(l.accepting && !l.stale));
        }
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

/// CPU use of process trees between two looks.
#[derive(Default)]
pub struct CpuMeter {
    /// Root PID -> (its start time, CPU ticks of the tree, when read).
    last: Mutex<HashMap<i32, (u64, u64, Instant)>>,
}

impl CpuMeter {
    /// CPU use of the tree rooted at `pid`, percent of one CPU, since the previous call for it
    /// (since the root started, the first time); and the root's state letter. None if gone.
    pub fn sample(&self, pid: i32) -> Option<(f32, String)> {
        let (state, start) = stat_fields(pid)?;
        let ticks = tree_ticks(pid);
        let now = Instant::now();
        let hz = ticks_per_second();
        let mut last = self.last.lock().expect("cpu meter lock");
        let pct = match last.get(&pid) {
            Some(&(s, t0, at)) if s == start && now > at => {
                let secs = now.duration_since(at).as_secs_f64();
                ticks.saturating_sub(t0) as f64 / hz / secs * 100.0
            }
            _ => {
                // Since the root started: its age from the boot clock.
                let up = uptime_secs()?;
                let age = up - start as f64 / hz;
                if age > 0.0 {
                    ticks as f64 / hz / age * 100.0
                } else {
                    0.0
                }
            }
        };
        last.insert(pid, (start, ticks, now));
        Some((pct as f32, state))
    }

    /// Forgets trees no longer among `alive`.
    pub fn retain(&self, alive: &[i32]) {
        self.last
            .lock()
            .expect("cpu meter lock")
            .retain(|p, _| alive.contains(p));
    }
}

fn ticks_per_second() -> f64 {
    // The kernel's USER_HZ, 100 on every Linux architecture Ferry runs on.
    100.0
}

fn uptime_secs() -> Option<f64> {
    std::fs::read_to_string("/proc/uptime")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The fields of /proc/PID/stat after the command: state and, from index 11, utime, stime; 19:
/// start time.
fn stat_after_comm(pid: i32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = stat.rsplit_once(')')?.1;
    Some(after.split_whitespace().map(str::to_string).collect())
}

fn stat_fields(pid: i32) -> Option<(String, u64)> {
    let f = stat_after_comm(pid)?;
    Some((f.first()?.clone(), f.get(19)?.parse().ok()?))
}

fn own_ticks(pid: i32) -> u64 {
    stat_after_comm(pid)
        .map(|f| {
            let n = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            n(11) + n(12)
        })
        .unwrap_or(0)
}

/// CPU ticks (user and system) of `root` and its live descendants.
fn tree_ticks(root: i32) -> u64 {
    let mut total = 0;
    let mut todo = vec![root];
    let mut seen = 0;
    while let Some(pid) = todo.pop() {
        seen += 1;
        if seen > 10_000 {
            break;
        }
        total += own_ticks(pid);
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        for t in tasks.flatten() {
            if let Ok(c) = std::fs::read_to_string(t.path().join("children")) {
                todo.extend(c.split_whitespace().filter_map(|p| p.parse::<i32>().ok()));
            }
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_are_few_fixed_words() {
        assert_eq!(failure_reason("node b refused PID 3: no memory"), "refused");
        assert_eq!(
            failure_reason("lost node b while it rebuilt the tree: eof"),
            "peer-unreachable"
        );
        assert_eq!(
            failure_reason("node b could not rebuild the tree: x"),
            "destination-failed"
        );
        assert_eq!(failure_reason("something new"), "other");
        assert_eq!(
            failure_reason(
                "cannot move PID 3: fd 4 cannot be checkpointed (refused before freezing anything)"
            ),
            "unmovable"
        );
        assert_eq!(
            failure_reason(
                "PID 3 keeps running on a: node b could not rebuild the tree: x; refused"
            ),
            "destination-failed"
        );
    }

    #[test]
    fn exposition_is_prometheus_text() {
        let m = Metrics::new();
        m.migration_out(Ok(Duration::from_millis(30)));
        m.migration_out(Err("node b refused PID 3: full"));
        m.remote_exec("caller");
        let text = m.encode(&[], 2).unwrap();
        assert!(text.contains("ferry_migrations_out_total 1"), "{text}");
        assert!(
            text.contains("ferry_migrations_failed_total{reason=\"refused\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("ferry_migration_out_duration_seconds_count 1"),
            "{text}"
        );
        assert!(text.contains("ferry_deputies 2"), "{text}");
        assert!(
            text.contains("ferry_remote_execs_total{side=\"caller\"} 1"),
            "{text}"
        );
    }

    #[test]
    fn cpu_of_a_busy_tree_is_seen() {
        let meter = CpuMeter::default();
        let me = std::process::id() as i32;
        let (_, state) = meter.sample(me).unwrap();
        assert!(!state.is_empty());
        // Spin until this process has used 100 ms of CPU (however long that takes here).
        let t0 = own_ticks(me);
        let mut x = 0u64;
        while own_ticks(me) < t0 + 10 {
            for _ in 0..100_000 {
                x = x.wrapping_add(std::hint::black_box(1));
            }
        }
        let (pct, _) = meter.sample(me).unwrap();
        assert!(pct > 0.0, "a spinning thread used {pct}% CPU ({x})");
        assert!(meter.sample(-5).is_none());
    }
}
