//! Looking before freezing: the kinds of state the engine cannot move yet, found by reading
//! /proc alone, so that a migration is refused before the tree stops for even a moment. It is
//! advisory (the tree runs on while we look, and may open something new): the capture checks
//! everything again, and still refuses and thaws cleanly.

use crate::error::{Error, Result};
use crate::procfs;
use std::collections::HashSet;

/// The tree rooted at `root`: every process, parents first.
fn tree(root: i32) -> Result<Vec<i32>> {
    procfs::stat(root)?;
    let mut out = Vec::new();
    let mut todo = vec![root];
    while let Some(p) = todo.pop() {
        out.push(p);
        todo.extend(procfs::children(p).unwrap_or_default());
    }
    Ok(out)
}

/// Inodes of TCP sockets that are connected (or on their way to or from it): neither listening
/// nor closed (a socket that is only bound is listed as closed), from the network namespace of
/// `pid`.
fn tcp_connections(pid: i32) -> HashSet<u64> {
    let mut set = HashSet::new();
    for table in ["net/tcp", "net/tcp6"] {
        let Ok(text) = procfs::read(pid, table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            // sl local rem st tx:rx tr:when retrnsmt uid timeout inode
            if cols.len() > 9 && cols[3] != "0A" && cols[3] != "07" {
                if let Ok(ino) = cols[9].parse() {
                    set.insert(ino);
                }
            }
        }
    }
    set
}

fn refuse(pid: i32, what: String, why: &str) -> Error {
    Error::Unsupported {
        pid,
        what,
        why: format!("{why} (refused before freezing anything)"),
    }
}

/// Checks the tree rooted at `root` for state the engine refuses, without stopping it.
pub fn check(root: i32) -> Result<()> {
    let pids = tree(root)?;
    let locks = std::fs::read_to_string("/proc/locks").unwrap_or_default();
    let lock_holders: HashSet<i32> = locks
        .lines()
        .filter_map(|l| l.split_whitespace().nth(4)?.parse().ok())
        .collect();
    for &pid in &pids {
        let status = procfs::status(pid)?;
        if procfs::field(&status, "Seccomp").trim() == "2" {
            return Err(refuse(
                pid,
                "seccomp".into(),
                "seccomp filters cannot be moved yet",
            ));
        }
        if lock_holders.contains(&pid) {
            return Err(refuse(
                pid,
                "file locks".into(),
                "it holds file locks (flock/POSIX/OFD), which cannot be moved yet",
            ));
        }
        let tcp = tcp_connections(pid);
        for fd in procfs::fds(pid).unwrap_or_default() {
            let Ok(link) = procfs::readlink(pid, &format!("fd/{fd}")) else {
                continue;
            };
            let what = format!("fd {fd} ({link})");
            if let Some(ino) = link
                .strip_prefix("socket:[")
                .and_then(|s| s.strip_suffix(']'))
                .and_then(|s| s.parse::<u64>().ok())
            {
                if tcp.contains(&ino) {
                    return Err(refuse(
                        pid,
                        what,
                        "an established TCP connection (or one opening or closing) cannot be \
                         migrated yet (ferry checkpoint and restore on one machine can move one \
                         whose both ends are in the tree, but on a local cluster the frozen \
                         original keeps its addresses until the copy is rebuilt)",
                    ));
                }
            }
        }
    }
    Ok(())
}
