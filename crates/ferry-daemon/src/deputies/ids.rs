//! A moved root's identities at home (its parent, group and session there), followed on the
//! body's node: told by its guest init after a `setpgid` or `setsid` of its own ("NS ids"), or
//! by its home after a change there (`BodyIds`, told on to the init on the socket it gave,
//! "NS watch"), and recorded with the guest for its next move.

use super::*;

/// The root of the body in PID namespace `ns` has parent `ppid`, group `pgid` and session `sid`
/// at home now: recorded with the guest, whose next move carries them.
pub(super) fn record_ids(node: &Node, ns: &str, ppid: i32, pgid: i32, sid: i32) {
    let guest = node
        .guests
        .list()
        .into_iter()
        .find(|g| g.home_ids.is_some() && pid_ns(g.pid).as_deref() == Some(ns));
    if let Some(mut g) = guest {
        if let Some(h) = g.home_ids.as_mut() {
            if (h.ppid, h.pgid, h.sid) == (ppid, pgid, sid) {
                return;
            }
            (h.ppid, h.pgid, h.sid) = (ppid, pgid, sid);
        }
        tracing::info!(event = "body-ids", ns = %ns, pid = g.pid, ppid, pgid, sid);
        node.guests.add(g);
    }
}

/// Home `from` says the root of its tree `root` has `ids` at home now: recorded, and told to
/// the body's guest init (on the socket it gave, "I PPID PGID SID").
pub(super) fn body_ids(
    node: &Node,
    from: &str,
    root: i32,
    ids: &ferry_transport::message::HomeIds,
) -> Result<()> {
    let ns = {
        let m = node.bodies.map.lock().expect("bodies lock");
        m.iter()
            .find(|(_, (home, r))| home == from && *r == root)
            .map(|(ns, _)| ns.clone())
    }
    .ok_or_else(|| anyhow!("no body of PID {root} from {from} runs here"))?;
    record_ids(node, &ns, ids.ppid, ids.pgid, ids.sid);
    let w = node.bodies.watchers.lock().expect("bodies lock");
    let fd = w
        .get(&ns)
        .ok_or_else(|| anyhow!("the guest init of PID {root} from {from} watches nothing"))?;
    use std::os::fd::AsRawFd;
    ferry_sys::sockets::send(
        fd.as_raw_fd(),
        format!("I {} {} {}", ids.ppid, ids.pgid, ids.sid).as_bytes(),
        None,
        &[],
        libc::MSG_DONTWAIT,
    )
    .map(|_| ())
    .map_err(|e| anyhow!("tell the guest init of PID {root}: {e}"))
}

/// A guest init's report "NS ids PPID PGID SID": its tree's root has these at home now.
pub(super) fn ids_report(line: &str) -> Option<(String, i32, i32, i32)> {
    let f: Vec<&str> = line.split_whitespace().collect();
    let [ns, "ids", ppid, pgid, sid] = f[..] else {
        return None;
    };
    Some((
        ns.to_string(),
        ppid.parse().ok()?,
        pgid.parse().ok()?,
        sid.parse().ok()?,
    ))
}
