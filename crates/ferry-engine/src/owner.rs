//! Acting for a user who is not root: which processes are theirs, and which images they may
//! restore.
//!
//! The daemon serves users on its control socket (docs/security.md, "Users who are not root").
//! A user may checkpoint and migrate only processes that are theirs as the kernel's
//! `ptrace_may_access` sees it ([`check_live`]): every thread's real, effective and saved uids
//! are the user's, and its real, effective and saved gids the user's gid; the process is
//! dumpable (not changed by a set-user-ID or set-group-ID program, not made undumpable: its
//! /proc directory is then root's); and it holds no capability the user does not hold. A user
//! may restore an image only if every process in it would hold that user's credentials and
//! nothing more ([`check_image`]): an image is data the user could have written.

use ferry_image::Tree;

pub use ferry_sys::owner::Owner;
use ferry_sys::owner::{status_caps, status_ids};

/// Why a process is not the caller's, or an image not theirs to restore.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct NotYours(pub String);

/// Checks that every thread of the processes `pids` (PIDs in our namespace) is `owner`'s, as
/// `ptrace_may_access` would for `owner` (see the module's text). `what` names the request
/// ("checkpoint", "migrate").
pub fn check_pids(pids: &[i32], owner: &Owner, what: &str) -> Result<(), NotYours> {
    for &pid in pids {
        check_process(pid, owner, what)?;
    }
    Ok(())
}

fn check_process(pid: i32, owner: &Owner, what: &str) -> Result<(), NotYours> {
    use std::os::unix::fs::MetadataExt;
    let refuse =
        |why: String| NotYours(format!("uid {} may not {what} PID {pid}: {why}", owner.uid));
    // Not dumpable (a set-user-ID program, PR_SET_DUMPABLE 0): the kernel makes the files of
    // its /proc directory root's (not the directory itself: `task_dump_owner` leaves that to
    // the effective uid), and refuses ptrace to anyone without CAP_SYS_PTRACE.
    let meta = std::fs::metadata(format!("/proc/{pid}/status"))
        .map_err(|_| NotYours(format!("no process with PID {pid}")))?;
    if meta.uid() != owner.uid {
        return Err(refuse(format!(
            "it is not yours (its /proc files are uid {}'s: another user's, or it is not \
             dumpable)",
            meta.uid()
        )));
    }
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
        .map_err(|_| NotYours(format!("no process with PID {pid}")))?;
    for t in tasks.flatten() {
        let tid = t.file_name().to_string_lossy().into_owned();
        let Ok(status) = std::fs::read_to_string(t.path().join("status")) else {
            continue; // ended meanwhile
        };
        let uids = status_ids(&status, "Uid:").unwrap_or_default();
        if uids.len() < 3 || uids[..3].iter().any(|u| *u != owner.uid) {
            return Err(refuse(format!(
                "thread {tid} has uids (real, effective, saved) {:?}, not {}",
                &uids[..uids.len().min(3)],
                owner.uid
            )));
        }
        let gids = status_ids(&status, "Gid:").unwrap_or_default();
        if gids.len() < 3 || gids[..3].iter().any(|g| *g != owner.gid) {
            return Err(refuse(format!(
                "thread {tid} has gids (real, effective, saved) {:?}, not {}",
                &gids[..gids.len().min(3)],
                owner.gid
            )));
        }
        let prm = status_caps(&status, "CapPrm:").unwrap_or(u64::MAX);
        if prm & !owner.cap_prm != 0 {
            return Err(refuse(format!(
                "thread {tid} holds capabilities {:#x} that the caller does not",
                prm & !owner.cap_prm
            )));
        }
    }
    Ok(())
}

/// The PIDs of `root` and all its descendants, as /proc shows them now.
pub fn live_tree(root: i32) -> Vec<i32> {
    let mut out = Vec::new();
    let mut todo = vec![root];
    while let Some(p) = todo.pop() {
        out.push(p);
        if let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) {
            for t in tasks.flatten() {
                let children =
                    std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
                todo.extend(
                    children
                        .split_whitespace()
                        .filter_map(|c| c.parse::<i32>().ok()),
                );
            }
        }
    }
    out
}

/// Checks the tree rooted at `root` as it is now (a first answer, before anything is frozen;
/// the frozen tree is checked again with [`check_pids`]).
pub fn check_live(root: i32, owner: &Owner, what: &str) -> Result<(), NotYours> {
    check_pids(&live_tree(root), owner, what)
}

/// Checks that every process of `tree` would be rebuilt with `owner`'s credentials and nothing
/// the owner could not give it: the image's uid, gid, groups, capability, login uid,
/// oom_score_adj, rlimit and scheduling fields grant nothing. The first field that would is
/// named.
pub fn check_image(tree: &Tree, owner: &Owner) -> Result<(), NotYours> {
    const CAP_IPC_LOCK: u64 = 1 << 14;
    for p in &tree.processes {
        let refuse = |field: &str, value: String| {
            NotYours(format!(
                "the image's PID {} claims {field} {value}: uid {} may restore only processes \
                 with its own credentials",
                p.pid, owner.uid
            ))
        };
        let c = &p.creds;
        if c.uids.iter().any(|u| *u != owner.uid) {
            return Err(refuse(
                "uids (real, effective, saved, fs)",
                format!("{:?}", c.uids),
            ));
        }
        if let Some(g) = c.gids.iter().find(|g| !owner.has_group(**g)) {
            return Err(refuse("gid", g.to_string()));
        }
        if let Some(g) = c.groups.iter().find(|g| !owner.has_group(**g)) {
            return Err(refuse("supplementary group", g.to_string()));
        }
        for (field, caps) in [
            ("cap_prm", c.cap_prm),
            ("cap_eff", c.cap_eff),
            ("cap_inh", c.cap_inh),
            ("cap_amb", c.cap_amb),
        ] {
            if caps & !owner.cap_prm != 0 {
                return Err(refuse(field, format!("{caps:#x}")));
            }
        }
        if let Some(l) = p.loginuid {
            if l != u32::MAX && l != owner.loginuid {
                return Err(refuse("loginuid", l.to_string()));
            }
        }
        if let Some(o) = p.oom_score_adj {
            if o < owner.oom_score_adj {
                return Err(refuse("oom_score_adj", o.to_string()));
            }
        }
        for r in &p.rlimits {
            let mine = owner
                .hard_limits
                .iter()
                .find(|(res, _)| *res == r.resource)
                .map_or(0, |(_, m)| *m);
            if r.max > mine {
                return Err(refuse(
                    &format!("a hard limit of resource {}", r.resource),
                    format!("{} (above the caller's {mine})", r.max),
                ));
            }
        }
        // Locked memory counts against RLIMIT_MEMLOCK for the user, not for root.
        let locked: u64 = p
            .vmas
            .iter()
            .filter(|v| v.locked)
            .map(|v| v.end.saturating_sub(v.start))
            .sum();
        let memlock = owner
            .hard_limits
            .iter()
            .find(|(res, _)| *res == libc::RLIMIT_MEMLOCK)
            .map_or(0, |(_, m)| *m);
        if locked > memlock && owner.cap_prm & CAP_IPC_LOCK == 0 {
            return Err(refuse(
                "locked memory of",
                format!("{locked} bytes (above the caller's RLIMIT_MEMLOCK, {memlock})"),
            ));
        }
        for t in &p.threads {
            let policy = t.sched.policy & !libc::SCHED_RESET_ON_FORK;
            if policy != libc::SCHED_OTHER
                && policy != libc::SCHED_BATCH
                && policy != libc::SCHED_IDLE
            {
                return Err(refuse(
                    &format!("for thread {} the scheduling policy", t.tid),
                    policy.to_string(),
                ));
            }
            if t.sched.nice < 0 {
                return Err(refuse(
                    &format!("for thread {} the nice value", t.tid),
                    t.sched.nice.to_string(),
                ));
            }
        }
    }
    check_sockets(tree, owner)
}

/// Sockets an unprivileged user could not make: a TCP connection (remade in TCP repair mode,
/// which needs CAP_NET_ADMIN: its addresses and sequence numbers would be the image's word),
/// and an internet socket bound to a port below `net.ipv4.ip_unprivileged_port_start`
/// (CAP_NET_BIND_SERVICE), unless the caller holds those capabilities.
fn check_sockets(tree: &Tree, owner: &Owner) -> Result<(), NotYours> {
    const CAP_NET_BIND_SERVICE: u64 = 1 << 10;
    const CAP_NET_ADMIN: u64 = 1 << 12;
    let start: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_unprivileged_port_start")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(1024);
    for f in &tree.files {
        let ferry_image::FileKind::Socket(s) = &f.kind else {
            continue;
        };
        let refuse = |what: String| {
            NotYours(format!(
                "the image's file {} is {what}: uid {} may not make it",
                f.id, owner.uid
            ))
        };
        if s.tcp.is_some() && owner.cap_prm & CAP_NET_ADMIN == 0 {
            return Err(refuse(
                "a TCP connection (remade in TCP repair mode, which needs CAP_NET_ADMIN)".into(),
            ));
        }
        let port = match &s.local {
            Some(ferry_image::SockAddr::Inet { port, .. }) => *port,
            Some(ferry_image::SockAddr::Inet6 { port, .. }) => *port,
            _ => continue,
        };
        if port != 0 && port < start && owner.cap_prm & CAP_NET_BIND_SERVICE == 0 {
            return Err(refuse(format!(
                "a socket bound to port {port} (below {start}: CAP_NET_BIND_SERVICE)"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alice() -> Owner {
        Owner {
            uid: 1000,
            gid: 1000,
            groups: vec![100],
            cap_prm: 0,
            loginuid: 1000,
            oom_score_adj: 0,
            hard_limits: vec![(7, 4096), (8, 65536)],
        }
    }

    #[test]
    fn an_owner_survives_its_command_line_form() {
        let o = alice();
        assert_eq!(o.to_string().parse::<Owner>().unwrap(), o);
        let none = Owner::default();
        assert_eq!(none.to_string().parse::<Owner>().unwrap(), none);
        assert!("1:2:3".parse::<Owner>().is_err());
    }

    #[test]
    fn an_image_grants_the_user_nothing() {
        let mine = ferry_image::Process {
            pid: 7,
            creds: ferry_image::Creds {
                uids: [1000; 4],
                gids: [1000, 1000, 100, 1000],
                groups: vec![100, 1000],
                ..Default::default()
            },
            rlimits: vec![ferry_image::Rlimit {
                resource: 7,
                cur: 1024,
                max: 4096,
            }],
            ..Default::default()
        };
        let tree = |p: ferry_image::Process| Tree {
            processes: vec![p],
            ..Default::default()
        };
        check_image(&tree(mine.clone()), &alice()).unwrap();
        let refused = |edit: fn(&mut ferry_image::Process), field: &str| {
            let mut p = mine.clone();
            edit(&mut p);
            let e = check_image(&tree(p), &alice()).unwrap_err().to_string();
            assert!(e.contains(field), "{field}: {e}");
        };
        refused(|p| p.creds.uids[1] = 0, "uids");
        refused(|p| p.creds.gids[0] = 0, "gid 0");
        refused(|p| p.creds.groups.push(0), "supplementary group 0");
        refused(|p| p.creds.cap_eff = 1 << 21, "cap_eff");
        refused(|p| p.creds.cap_amb = 1, "cap_amb");
        refused(|p| p.loginuid = Some(0), "loginuid 0");
        refused(|p| p.oom_score_adj = Some(-1000), "oom_score_adj -1000");
        refused(|p| p.rlimits[0].max = 1 << 20, "hard limit of resource 7");
    }
}
