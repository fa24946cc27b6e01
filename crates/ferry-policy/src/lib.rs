//! Where processes should run. Pure decisions over the load each node publishes: which node is
//! idlest (Sprite's idle-host selection), and whether a node takes a guest. The daemon measures;
//! this crate decides, so the rules can be read, and tested, in one place.

#![forbid(unsafe_code)]

use serde::{Deserialize, Serialize};

pub mod hosts;
pub mod owner;

pub use hosts::HostGrant;
pub use owner::{AcceptPolicy, OwnerState};
pub mod balance;

/// What a node publishes about itself through the membership gossip.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeLoad {
    /// Processes ready to run right now (/proc/stat procs_running), ourselves excluded.
    pub runnable: u32,
    pub cpus: u32,
    /// Share of CPU time idle over the last sampling period, 0..=100.
    pub cpu_idle_pct: f32,
    pub free_memory_bytes: u64,
    /// Seconds since a console (tty, input device) was last used; None: no console seen.
    pub console_idle_secs: Option<u64>,
    /// Guests this node runs: processes migrated in or started here by `ferry run`.
    pub guests: u32,
    /// The owner lets this node take guests.
    pub accepting: bool,
    /// The node could not measure its load this time (an unreadable /proc file): these are its
    /// last good figures, not today's. Policy treats a stale load as unknown: such a node takes
    /// no guest and is never chosen.
    #[serde(default)]
    pub stale: bool,
    /// The owner's policy and whether the machine is idle by it (crate::owner).
    #[serde(default)]
    pub owner: OwnerState,
    /// Who holds this host, one application per class (crate::hosts). The host itself is the
    /// authority on these; the gossip carries them for everyone's fairness decisions.
    #[serde(default)]
    pub grants: Vec<HostGrant>,
    /// Runnable demand of this node's own processes (threads wanting a CPU, averaged over a
    /// few seconds), measured in its CPU cgroup when it has one (`balance.rs`); 0 if unknown.
    #[serde(default)]
    pub demand: f32,
    /// CPUs this node has: its CPU quota when it has one, else its CPUs; 0 if unknown.
    #[serde(default)]
    pub capacity: f32,
}

/// A console used within this many seconds means someone is at the machine (Sprite used 30 s).
pub const CONSOLE_BUSY_SECS: u64 = 30;

impl NodeLoad {
    /// The owner is at the machine: guests are unwelcome.
    pub fn owner_present(&self) -> bool {
        matches!(self.console_idle_secs, Some(s) if s < CONSOLE_BUSY_SECS)
    }

    /// Lower is idler. Runnable work per CPU dominates; guests break ties, so that a local
    /// cluster whose nodes share one machine still spreads its guests.
    pub fn busyness(&self) -> f64 {
        let cpus = self.cpus.max(1) as f64;
        self.runnable as f64 / cpus
            + (100.0 - self.cpu_idle_pct as f64) / 100.0
            + self.guests as f64 * 0.25
    }
}

/// Whether a node with `load` should take a guest needing `memory_bytes`; the reason if not.
pub fn admit(load: &NodeLoad, memory_bytes: u64) -> Result<(), String> {
    if !load.accepting {
        let o = &load.owner;
        return Err(owner::accepts(o.policy, o.draining, o.idle)
            .err()
            .unwrap_or_else(|| "this node does not accept guests now".into()));
    }
    if load.stale {
        return Err("this node cannot measure its load now (see its log)".into());
    }
    // Keep a margin: a guest that fits only by exhausting memory would be killed later.
    let margin = 64 << 20;
    if memory_bytes.saturating_add(margin) > load.free_memory_bytes {
        return Err(format!(
            "not enough free memory: the guest needs {} MiB, {} MiB are free",
            memory_bytes >> 20,
            load.free_memory_bytes >> 20
        ));
    }
    Ok(())
}

/// Picks the idlest node that accepts guests and whose owner is away; `exclude` is the caller's
/// own node when it wants somewhere else.
pub fn choose_idlest<'a>(
    nodes: impl IntoIterator<Item = (&'a str, &'a NodeLoad)>,
    exclude: Option<&str>,
) -> Option<&'a str> {
    nodes
        .into_iter()
        .filter(|(name, load)| {
            Some(*name) != exclude && load.accepting && !load.stale && !load.owner_present()
        })
        .min_by(|(an, a), (bn, b)| {
            a.busyness()
                .partial_cmp(&b.busyness())
                .unwrap_or(std::cmp::Ordering::Equal)
                .then_with(|| an.cmp(bn))
        })
        .map(|(name, _)| name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(runnable: u32, guests: u32) -> NodeLoad {
        NodeLoad {
            runnable,
            cpus: 2,
            cpu_idle_pct: 50.0,
            free_memory_bytes: 8 << 30,
            console_idle_secs: None,
            guests,
            accepting: true,
            stale: false,
            ..Default::default()
        }
    }

    #[test]
    fn idlest_accepting_node_wins() {
        let a = load(4, 0);
        let b = load(0, 1);
        let mut c = load(0, 0);
        c.accepting = false;
        let mut d = load(0, 0);
        d.console_idle_secs = Some(3);
        let nodes = [("a", &a), ("b", &b), ("c", &c), ("d", &d)];
        assert_eq!(choose_idlest(nodes, None), Some("b"));
        assert_eq!(choose_idlest(nodes, Some("b")), Some("a"));
        assert_eq!(choose_idlest([("c", &c)], None), None);
    }

    #[test]
    fn ties_spread_by_guests_then_name() {
        let x = load(0, 2);
        let y = load(0, 0);
        let z = load(0, 0);
        assert_eq!(
            choose_idlest([("x", &x), ("z", &z), ("y", &y)], None),
            Some("y")
        );
    }

    #[test]
    fn admission_checks_acceptance_and_memory() {
        let mut l = load(0, 0);
        assert!(admit(&l, 1 << 30).is_ok());
        assert!(admit(&l, 9 << 30)
            .unwrap_err()
            .contains("not enough free memory"));
        l.accepting = false;
        assert!(admit(&l, 0).unwrap_err().contains("does not accept guests"));
    }

    #[test]
    fn a_stale_load_is_unknown_not_idle() {
        let mut s = load(0, 0);
        s.stale = true;
        s.free_memory_bytes = 1 << 50;
        let busy = load(8, 3);
        assert!(admit(&s, 0).unwrap_err().contains("cannot measure"));
        assert_eq!(choose_idlest([("s", &s), ("b", &busy)], None), Some("b"));
        assert_eq!(choose_idlest([("s", &s)], None), None);
    }
}
