//! Host selection (Sprite, chapter 6): a request for N hosts of a class gets the longest-idle
//! hosts first, at most one application of a class per host, and fairly across users: when no
//! host is free, a user holding significantly more hosts than the requester gives one back.
//!
//! Each host grants itself (ARCHITECTURE.md, "Host selection"): its grants ride in its gossiped
//! `NodeLoad`, so a requester chooses from its own view of the cluster ([`select`],
//! [`reclaim_candidate`]) and the chosen host decides, against its own current state
//! ([`decide`]), whether to grant. These functions are pure and run over any number of loads.

use crate::NodeLoad;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// A host lent to one application of a class.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostGrant {
    /// The application's class (`cc`, `sim`, `run`...): one application per class per host.
    pub class: String,
    /// The user on whose behalf the host is held (fairness counts per user).
    pub uid: u32,
    /// The node that asked: the holder runs there.
    pub requester: String,
    /// The holder: a process on `requester` (its PID there); the host returns when it ends.
    pub holder: i32,
    pub since_unix_ms: u64,
}

/// What a requester asks for.
#[derive(Debug, Clone)]
pub struct HostRequest<'a> {
    pub class: &'a str,
    pub uid: u32,
    pub count: usize,
    /// Never this node (the requester's own, when it wants somewhere else).
    pub exclude: Option<&'a str>,
}

/// A user holding at least this many hosts more than the requester gives one back.
pub const FAIRNESS_MARGIN: usize = 2;

/// How long the node's owner has been away, for ordering: no input ever seen counts as
/// forever.
pub fn idle_age(load: &NodeLoad) -> u64 {
    load.console_idle_secs.unwrap_or(u64::MAX)
}

/// Whether `load`'s node can be granted to an application of `class` now.
pub fn available(load: &NodeLoad, class: &str) -> bool {
    load.accepting
        && !load.stale
        && !load.owner.draining
        && !load.grants.iter().any(|g| g.class == class)
}

/// The order of preference: longest idle first, then least busy, then name (so that every
/// requester with the same view agrees).
fn better(a: (&str, &NodeLoad), b: (&str, &NodeLoad)) -> std::cmp::Ordering {
    idle_age(b.1)
        .cmp(&idle_age(a.1))
        .then_with(|| {
            a.1.busyness()
                .partial_cmp(&b.1.busyness())
                .unwrap_or(std::cmp::Ordering::Equal)
        })
        .then_with(|| a.0.cmp(b.0))
}

/// Up to `req.count` available hosts, longest idle first. Linear in the number of nodes plus
/// `count log count`: a large cluster costs one pass.
pub fn select<'a>(
    nodes: impl IntoIterator<Item = (&'a str, &'a NodeLoad)>,
    req: &HostRequest,
) -> Vec<&'a str> {
    let mut free: Vec<(&str, &NodeLoad)> = nodes
        .into_iter()
        .filter(|(name, load)| Some(*name) != req.exclude && available(load, req.class))
        .collect();
    let k = req.count.min(free.len());
    if k == 0 {
        return Vec::new();
    }
    if k < free.len() {
        free.select_nth_unstable_by(k - 1, |a, b| better(*a, *b));
        free.truncate(k);
    }
    free.sort_by(|a, b| better(*a, *b));
    free.into_iter().map(|(n, _)| n).collect()
}

/// Hosts held per user, over every class (a user's share of the cluster).
pub fn holdings<'a>(
    nodes: impl IntoIterator<Item = (&'a str, &'a NodeLoad)>,
) -> HashMap<u32, usize> {
    let mut h: HashMap<u32, usize> = HashMap::new();
    for (_, load) in nodes {
        let mut users: Vec<u32> = load.grants.iter().map(|g| g.uid).collect();
        users.sort_unstable();
        users.dedup();
        for u in users {
            *h.entry(u).or_default() += 1;
        }
    }
    h
}

/// When no host is free: the host to take back from the user holding the most hosts, if that
/// user holds at least [`FAIRNESS_MARGIN`] more than the requester (Sprite: "significantly
/// more"). Of that user's hosts, the one granted last goes back (it has done the least work).
/// Returns the host and the grant it would give up.
pub fn reclaim_candidate<'a>(
    nodes: &[(&'a str, &'a NodeLoad)],
    req: &HostRequest,
) -> Option<(&'a str, HostGrant)> {
    let held = holdings(nodes.iter().copied());
    let mine = held.get(&req.uid).copied().unwrap_or(0);
    let (&victim, &most) = held
        .iter()
        .filter(|(u, _)| **u != req.uid)
        .max_by(|a, b| a.1.cmp(b.1).then_with(|| b.0.cmp(a.0)))?;
    if most < mine + FAIRNESS_MARGIN {
        return None;
    }
    nodes
        .iter()
        .filter(|(name, load)| {
            Some(*name) != req.exclude
                && load.accepting
                && !load.stale
                && !load.owner.draining
                // The class is free here but for the victim's own grant.
                && load
                    .grants
                    .iter()
                    .all(|g| g.class != req.class || g.uid == victim)
        })
        .filter_map(|(name, load)| {
            let g = load
                .grants
                .iter()
                .filter(|g| g.uid == victim)
                .max_by_key(|g| g.since_unix_ms)?;
            Some((*name, g.clone()))
        })
        .max_by(|a, b| {
            a.1.since_unix_ms
                .cmp(&b.1.since_unix_ms)
                .then_with(|| b.0.cmp(a.0))
        })
}

/// The host's own decision on a request for itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Granted; with the grants it takes back to make room (their guests must leave).
    Grant {
        reclaimed: Vec<HostGrant>,
    },
    Refuse(String),
}

/// A host's decision on `want` given its own state (`own`, whose grants are current) and its
/// view of the cluster (for fairness). `reclaim`: the requester found no free host and asks
/// this one to take itself back from a user holding more. The same holder asking again for
/// the same class is granted again (requests may be retried).
pub fn decide(
    own: &NodeLoad,
    cluster: &[(&str, &NodeLoad)],
    want: &HostGrant,
    reclaim: bool,
) -> Decision {
    if own.stale {
        return Decision::Refuse("this node cannot measure its load now".into());
    }
    if own.owner.draining {
        return Decision::Refuse("this node is being drained".into());
    }
    if !own.accepting {
        return Decision::Refuse(format!(
            "this node does not accept guests now (accept = {}, idle: {})",
            own.owner.policy, own.owner.idle
        ));
    }
    let same = |g: &HostGrant| g.class == want.class;
    let Some(holder) = own.grants.iter().find(|g| same(g)) else {
        return Decision::Grant { reclaimed: vec![] };
    };
    if holder.requester == want.requester && holder.holder == want.holder {
        return Decision::Grant { reclaimed: vec![] };
    }
    if !reclaim {
        return Decision::Refuse(format!(
            "class {} is held here by uid {} (for PID {} on {})",
            want.class, holder.uid, holder.holder, holder.requester
        ));
    }
    let held = holdings(cluster.iter().copied());
    let theirs = held.get(&holder.uid).copied().unwrap_or(0);
    let mine = held.get(&want.uid).copied().unwrap_or(0);
    if holder.uid == want.uid || theirs < mine + FAIRNESS_MARGIN {
        return Decision::Refuse(format!(
            "class {} is held here by uid {}, who holds {theirs} hosts against uid {}'s {mine}: \
             not enough more to give one back",
            want.class, holder.uid, want.uid
        ));
    }
    Decision::Grant {
        reclaimed: own
            .grants
            .iter()
            .filter(|g| g.uid == holder.uid && same(g))
            .cloned()
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(idle: Option<u64>) -> NodeLoad {
        NodeLoad {
            cpus: 2,
            cpu_idle_pct: 100.0,
            free_memory_bytes: 8 << 30,
            console_idle_secs: idle,
            accepting: true,
            ..Default::default()
        }
    }

    fn grant(class: &str, uid: u32, holder: i32, since: u64) -> HostGrant {
        HostGrant {
            class: class.into(),
            uid,
            requester: "r".into(),
            holder,
            since_unix_ms: since,
        }
    }

    fn req(class: &str, uid: u32, count: usize) -> HostRequest<'_> {
        HostRequest {
            class,
            uid,
            count,
            exclude: None,
        }
    }

    #[test]
    fn longest_idle_first_one_application_per_class() {
        let a = node(Some(40));
        let b = node(Some(4000));
        let mut c = node(None);
        c.grants.push(grant("cc", 1, 10, 1));
        let d = node(Some(400));
        let mut e = node(Some(90000));
        e.accepting = false;
        let nodes = [("a", &a), ("b", &b), ("c", &c), ("d", &d), ("e", &e)];
        assert_eq!(select(nodes, &req("cc", 2, 2)), ["b", "d"]);
        assert_eq!(select(nodes, &req("sim", 2, 2)), ["c", "b"]);
        assert_eq!(select(nodes, &req("cc", 2, 10)), ["b", "d", "a"]);
        let mut r = req("cc", 2, 1);
        r.exclude = Some("b");
        assert_eq!(select(nodes, &r), ["d"]);
    }

    #[test]
    fn one_holding_many_gives_one_back_to_one_holding_none() {
        let mut hosts: Vec<NodeLoad> = (0..3).map(|_| node(None)).collect();
        for (i, h) in hosts.iter_mut().enumerate() {
            h.grants.push(grant("cc", 1000, 7, i as u64));
        }
        let names = ["h0", "h1", "h2"];
        let view: Vec<(&str, &NodeLoad)> = names.iter().copied().zip(hosts.iter()).collect();
        assert!(select(view.iter().copied(), &req("cc", 2000, 1)).is_empty());
        let (host, g) = reclaim_candidate(&view, &req("cc", 2000, 1)).unwrap();
        assert_eq!((host, g.uid, g.since_unix_ms), ("h2", 1000, 2));
        // The host agrees, and names what it takes back.
        let mut want = grant("cc", 2000, 8, 9);
        want.requester = "s".into();
        match decide(&hosts[2], &view, &want, true) {
            Decision::Grant { reclaimed } => assert_eq!(reclaimed, [g]),
            other => panic!("{other:?}"),
        }
        // Without asking for fairness, or for the holder itself, no.
        assert!(matches!(
            decide(&hosts[2], &view, &want, false),
            Decision::Refuse(_)
        ));
        // A user holding one host more than the requester keeps it.
        let two: Vec<(&str, &NodeLoad)> = view[..1].to_vec();
        assert!(reclaim_candidate(&two, &req("cc", 2000, 1)).is_none());
        assert!(matches!(
            decide(&hosts[0], &two, &want, true),
            Decision::Refuse(_)
        ));
        // The same holder asking again is granted again.
        let again = grant("cc", 1000, 7, 5);
        assert_eq!(
            decide(&hosts[0], &view, &again, false),
            Decision::Grant { reclaimed: vec![] }
        );
    }

    #[test]
    fn hosts_that_may_not_be_granted() {
        let mut n = node(None);
        n.owner.draining = true;
        assert!(!available(&n, "cc"));
        let want = grant("cc", 1, 1, 1);
        assert!(
            matches!(decide(&n, &[], &want, false), Decision::Refuse(r) if r.contains("drained"))
        );
        let mut s = node(None);
        s.stale = true;
        assert!(!available(&s, "cc"));
    }

    #[test]
    fn a_thousand_nodes_in_one_pass() {
        let loads: Vec<NodeLoad> = (0..1000).map(|i| node(Some(i * 7 % 1000))).collect();
        let names: Vec<String> = (0..1000).map(|i| format!("n{i}")).collect();
        let view = names.iter().map(String::as_str).zip(loads.iter());
        let got = select(view, &req("cc", 1, 3));
        assert_eq!(got.len(), 3);
        assert!(got
            .iter()
            .all(|n| idle_age(&loads[n[1..].parse::<usize>().unwrap()]) >= 997));
    }
}
