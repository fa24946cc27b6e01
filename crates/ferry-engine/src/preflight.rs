//! Looking before freezing: the kinds of state the engine cannot move yet, found by reading
//! /proc alone, so that a migration is refused before the tree stops for even a moment. It is
//! advisory (the tree runs on while we look, and may open something new): the capture checks
//! everything again, and still refuses and thaws cleanly.

use crate::error::{Error, Result};
use crate::procfs;
use std::collections::{HashMap, HashSet};

/// TCP states a connection can be moved in (tcp_states.h): ESTABLISHED, SYN_SENT (opened
/// again), FIN_WAIT1, FIN_WAIT2, CLOSE_WAIT, LAST_ACK, CLOSING; not SYN_RECV.
const TCP_MOVABLE: [u8; 7] = [1, 2, 4, 5, 8, 9, 11];
const TCP_SYN_SENT: u8 = 2;

/// The tree rooted at `root`: every process, parents first.
pub(crate) fn tree(root: i32) -> Result<Vec<i32>> {
    procfs::stat(root)?;
    let mut out = Vec::new();
    let mut todo = vec![root];
    while let Some(p) = todo.pop() {
        out.push(p);
        todo.extend(procfs::children(p).unwrap_or_default());
    }
    Ok(out)
}

/// A TCP socket that is connected (or on its way to or from it): neither listening nor closed
/// (a socket that is only bound is listed as closed), from /proc/PID/net/tcp{,6}.
struct TcpSock {
    /// The kernel's state number.
    state: u8,
    /// Local and remote address (see `table_addr`).
    local: String,
    remote: String,
}

/// The TCP sockets of the network namespace of `pid` that are neither listening nor closed, by
/// inode.
fn tcp_connections(pid: i32) -> HashMap<u64, TcpSock> {
    let mut map = HashMap::new();
    for table in ["net/tcp", "net/tcp6"] {
        let Ok(text) = procfs::read(pid, table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            // sl local rem st tx:rx tr:when retrnsmt uid timeout inode
            if cols.len() > 9 && cols[3] != "0A" && cols[3] != "07" {
                let (Ok(ino), Ok(state)) = (cols[9].parse(), u8::from_str_radix(cols[3], 16))
                else {
                    continue;
                };
                map.insert(
                    ino,
                    TcpSock {
                        state,
                        local: table_addr(cols[1]),
                        remote: table_addr(cols[2]),
                    },
                );
            }
        }
    }
    map
}

/// The TCP sockets of the network namespace of `pid` that no descriptor holds any more and
/// that linger in FIN_WAIT2 (their process closed them): (local, remote) as `table_addr`
/// writes them.
fn tcp_orphans(pid: i32) -> HashSet<(String, String)> {
    let mut out = HashSet::new();
    for table in ["net/tcp", "net/tcp6"] {
        let Ok(text) = procfs::read(pid, table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            if cols.len() > 9 && cols[3] == "05" && cols[9] == "0" {
                out.insert((table_addr(cols[1]), table_addr(cols[2])));
            }
        }
    }
    out
}

/// The TCP listeners of the network namespace of `pid`: (address as `table_addr` writes it,
/// inode).
fn tcp_listeners(pid: i32) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    for table in ["net/tcp", "net/tcp6"] {
        let Ok(text) = procfs::read(pid, table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            if cols.len() > 9 && cols[3] == "0A" {
                if let Ok(ino) = cols[9].parse::<u64>() {
                    out.push((table_addr(cols[1]), ino));
                }
            }
        }
    }
    out
}

/// Which of the sockets `inodes` some process of this machine holds in its descriptor table
/// (one that none holds is in flight in a UNIX socket's queue, SCM_RIGHTS, or being closed).
fn held_by_some_process(inodes: &HashSet<u64>) -> HashSet<u64> {
    let mut out = HashSet::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        for fd in procfs::fds(pid).unwrap_or_default() {
            if let Some(ino) = procfs::readlink(pid, &format!("fd/{fd}"))
                .ok()
                .as_deref()
                .and_then(socket_ino)
            {
                if inodes.contains(&ino) {
                    out.insert(ino);
                }
            }
        }
        if out.len() == inodes.len() {
            break;
        }
    }
    out
}

/// Whether a listener on `listener` takes connections made to `to` (both as `table_addr`
/// writes them).
fn listener_reaches(listener: &str, to: &str) -> bool {
    match (listener.rsplit_once(':'), to.rsplit_once(':')) {
        (Some((lh, lp)), Some((_, tp))) => {
            lp == tp && (listener == to || lh == "0.0.0.0" || lh == "[::]")
        }
        _ => false,
    }
}

/// An address as /proc/net/tcp{,6} spells it ("0100007F:1F90"), for people, and to match the
/// two ends of a connection: an IPv4-mapped IPv6 address (an IPv6 socket's end of an IPv4
/// connection, in tcp6) is written as its IPv4 address, as the other end sees it (in tcp).
fn table_addr(a: &str) -> String {
    let Some((ip, port)) = a.split_once(':') else {
        return a.to_string();
    };
    let port = u16::from_str_radix(port, 16).unwrap_or(0);
    let words: Vec<u32> = (0..ip.len() / 8)
        .filter_map(|k| u32::from_str_radix(&ip[k * 8..k * 8 + 8], 16).ok())
        .collect();
    // Each 32-bit word is printed as the host (little-endian) reads it.
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    match bytes.len() {
        4 => format!("{}.{}.{}.{}:{port}", bytes[0], bytes[1], bytes[2], bytes[3]),
        16 => {
            let a = std::net::Ipv6Addr::from(<[u8; 16]>::try_from(bytes).expect("16 bytes"));
            match a.to_ipv4_mapped() {
                Some(v4) => format!("{v4}:{port}"),
                None => format!("[{a}]:{port}"),
            }
        }
        _ => a.to_string(),
    }
}

fn socket_ino(link: &str) -> Option<u64> {
    link.strip_prefix("socket:[")?
        .strip_suffix(']')?
        .parse()
        .ok()
}

fn refuse(pid: i32, what: String, why: &str) -> Error {
    Error::Unsupported {
        pid,
        what,
        why: format!("{why} (refused before freezing anything)"),
    }
}

/// A virtual terminal or serial tty held by `pid` (descriptor `fd`, /dev/ttyN or /dev/ttySN)
/// that is its controlling terminal (`resources/devices.rs`, which the capture checks again,
/// with /dev/console and /dev/tty0 too).
fn check_vt_ctty(pid: i32, fd: i32, link: &str) -> Result<()> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let Ok(md) = std::fs::metadata(format!("/proc/{pid}/fd/{fd}")) else {
        return Ok(());
    };
    let rdev = md.rdev();
    if !md.file_type().is_char_device() || libc::major(rdev) != 4 || libc::minor(rdev) == 0 {
        return Ok(());
    }
    let ctty = procfs::read(pid, "stat").ok().and_then(|stat| {
        stat.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(4)?.parse::<u64>().ok())
    });
    if ctty == Some(rdev) {
        return Err(refuse(
            pid,
            format!("fd {fd} ({link})"),
            "this terminal (a virtual terminal or serial line) is the process's controlling \
             terminal, which its session cannot take back yet (only a pty of the tree can be)",
        ));
    }
    Ok(())
}

/// A kernel AIO ring mapped by two processes of the tree: a child forked after `io_setup`
/// keeps its parent's ring mapped without the context, and which of them owns it nothing
/// outside them tells (`resources/aio.rs`, which the capture checks again).
fn check_aio_rings(pids: &[i32]) -> Result<()> {
    let mut seen: HashMap<u64, i32> = HashMap::new();
    for &pid in pids {
        let Ok(maps) = procfs::read(pid, "maps") else {
            continue;
        };
        for line in maps.lines().filter(|l| l.ends_with(" /[aio] (deleted)")) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            let Some(ino) = cols.get(4).and_then(|c| c.parse::<u64>().ok()) else {
                continue;
            };
            if let Some(other) = seen.insert(ino, pid).filter(|o| *o != pid) {
                return Err(refuse(
                    pid,
                    format!("kernel AIO context {} (its ring)", cols[0]),
                    &format!(
                        "PID {other} maps the same ring: one of them has it from a fork, \
                         without the context, and which one cannot be told from outside"
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Process-wide state the capture would refuse: seccomp strict mode or filters that differ
/// between threads, and a session whose leader is gone.
fn check_process(pid: i32, status: &[(String, String)], pids: &[i32], root_sid: i32) -> Result<()> {
    match procfs::field(status, "Seccomp").trim() {
        "1" => {
            return Err(refuse(
                pid,
                "seccomp strict mode".into(),
                "a process in strict mode may make no system call but read, write, exit and \
                 sigreturn, and its rebuilding needs many more",
            ))
        }
        "2" => {
            let count = |tid: &str| {
                std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/status"))
                    .ok()
                    .and_then(|s| {
                        s.lines()
                            .find_map(|l| l.strip_prefix("Seccomp_filters:"))
                            .map(|v| v.trim().to_string())
                    })
            };
            let tids: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/task"))
                .map(|d| {
                    d.flatten()
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .collect()
                })
                .unwrap_or_default();
            // A thread that ended since the listing has no status to read: it is no thread of
            // the process any more (a program that starts and ends threads all the time, a
            // timer's, was refused now and then for it).
            let counts: HashSet<String> = tids.iter().filter_map(|t| count(t)).collect();
            if counts.len() > 1 {
                return Err(refuse(
                    pid,
                    "seccomp filters".into(),
                    "its threads have different seccomp filters (only filters every thread \
                     shares can be rebuilt)",
                ));
            }
        }
        _ => {}
    }
    let sid = procfs::stat(pid)?.sid;
    if pid != pids[0] && sid != root_sid && !pids.contains(&sid) {
        return Err(refuse(
            pid,
            format!("session {sid}"),
            "its leader is no longer part of the tree, and a session is made only by its \
             leader",
        ));
    }
    Ok(())
}

/// The anonymous pipes (by inode) that the processes `pids` hold and a process outside them
/// holds too, each with one such outsider.
pub fn pipes_shared_outside(pids: &[i32]) -> HashMap<u64, i32> {
    let mut inside: HashSet<u64> = HashSet::new();
    for &pid in pids {
        for fd in procfs::fds(pid).unwrap_or_default() {
            if let Some(ino) = procfs::readlink(pid, &format!("fd/{fd}"))
                .ok()
                .as_deref()
                .and_then(pipe_ino)
            {
                inside.insert(ino);
            }
        }
    }
    let mut out = HashMap::new();
    if inside.is_empty() {
        return out;
    }
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for other in dir
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|p| !pids.contains(p))
    {
        let Ok(fds) = std::fs::read_dir(format!("/proc/{other}/fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            let Ok(link) = std::fs::read_link(fd.path()) else {
                continue;
            };
            if let Some(ino) = pipe_ino(&link.to_string_lossy()) {
                if inside.contains(&ino) {
                    out.entry(ino).or_insert(other);
                }
            }
        }
    }
    out
}

fn pipe_ino(link: &str) -> Option<u64> {
    link.strip_prefix("pipe:[")?.strip_suffix(']')?.parse().ok()
}

/// A pipe the tree shares with a process that stays behind (a shell pipeline of which only one
/// stage moves) cannot move by itself: the copy would hold a pipe of its own, and both ends
/// would see the other gone (end of file on one side, EPIPE on the other): a wrong result with
/// no error. A migration that leaves a deputy at home relays such pipes (`relay_pipes`); a
/// checkpoint, or a guest moving on from a node that is not its home, refuses them.
fn check_pipes(
    pids: &[i32],
    pipes: &HashMap<String, (i32, i32)>,
    standins: &HashMap<u64, u32>,
) -> Result<()> {
    if pipes.is_empty() {
        return Ok(());
    }
    for (ino, other) in pipes_shared_outside(pids) {
        if standins.contains_key(&ino) {
            // A stand-in for a relay to the tree's home: the relay follows the body.
            continue;
        }
        let link = format!("pipe:[{ino}]");
        let Some(&(pid, tfd)) = pipes.get(&link) else {
            continue;
        };
        let comm = procfs::stat(other).map(|s| s.comm).unwrap_or_default();
        return Err(refuse(
            pid,
            format!("fd {tfd} ({link})"),
            &format!(
                "the other end of this pipe is held by PID {other} ({comm}), which is not in \
                 the tree: such a pipe moves only with a migration from the tree's home, which \
                 relays it"
            ),
        ));
    }
    Ok(())
}

/// The first descriptor, in the tree rooted at `root`, of a device of this machine that moves
/// only within it (`resources::devices`): the console, a virtual terminal, a serial tty,
/// /dev/vcs*, /dev/kmsg open for reading; named ("PID 12 fd 3 (/dev/console)"). Read from
/// /proc alone, while the tree runs: a migration offers it only to a node on this machine
/// (its kernel's boot id), before anything is frozen.
pub fn machine_bound(root: i32) -> Option<String> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    for pid in tree(root).ok()? {
        for fd in procfs::fds(pid).unwrap_or_default() {
            let Ok(link) = procfs::readlink(pid, &format!("fd/{fd}")) else {
                continue;
            };
            if !link.starts_with("/dev/") {
                continue;
            }
            let Ok(md) = std::fs::metadata(format!("/proc/{pid}/fd/{fd}")) else {
                continue;
            };
            if !md.file_type().is_char_device() {
                continue;
            }
            let rdev = md.rdev();
            let reads = || {
                procfs::fdinfo(pid, fd)
                    .ok()
                    .and_then(|i| i64::from_str_radix(procfs::field(&i, "flags").trim(), 8).ok())
                    .is_some_and(|f| f & libc::O_ACCMODE as i64 != libc::O_WRONLY as i64)
            };
            if crate::resources::devices::is_machine_rdev(rdev)
                || (crate::resources::kmsg::is_kmsg(rdev) && reads())
            {
                return Some(format!("PID {pid} fd {fd} ({link})"));
            }
        }
    }
    None
}

/// Checks the tree rooted at `root` for state the engine refuses, without stopping it.
pub fn check(root: i32) -> Result<()> {
    check_with(root, false, &HashMap::new())
}

/// [`check`]; with `relay_pipes`, pipes shared with processes outside the tree, and TCP
/// connections whose other end is outside it, are accepted (the migration relays them:
/// `FrozenTree::relay_pipes`). `standins`: a body's stand-ins for relays to its home, by pipe
/// inode (`FrozenTree::relay_standins`), accepted too.
pub fn check_with(root: i32, relay_pipes: bool, standins: &HashMap<u64, u32>) -> Result<()> {
    let pids = tree(root)?;
    let root_sid = procfs::stat(root)?.sid;
    let mut tcp_fds: Vec<(i32, i32, String, u64)> = Vec::new();
    let mut pipes: HashMap<String, (i32, i32)> = HashMap::new();
    for &pid in &pids {
        let status = match procfs::status(pid) {
            Ok(s) => s,
            // A child that has ended and been collected since the tree was listed is not part
            // of it any more.
            Err(Error::NoSuchProcess { .. }) if pid != root => continue,
            Err(e) => return Err(e),
        };
        check_process(pid, &status, &pids, root_sid)?;
        if relay_pipes && pid == root {
            // Leaving its home: its root's PID must read the same in its namespace as here
            // (`PidView::first_renumbered`).
            let inner = procfs::field(&status, "NSpid")
                .split_whitespace()
                .last()
                .and_then(|v| v.parse::<i32>().ok());
            if let Some(inner) = inner.filter(|i| *i != pid) {
                let (what, why) = crate::pidview::renumbered(pid, inner);
                return Err(refuse(pid, what.into(), &why));
            }
        }
        for fd in procfs::fds(pid).unwrap_or_default() {
            let Ok(link) = procfs::readlink(pid, &format!("fd/{fd}")) else {
                continue;
            };
            if link == "anon_inode:[pidfd]" {
                let target = procfs::fdinfo(pid, fd)
                    .ok()
                    .and_then(|i| procfs::field(&i, "Pid").trim().parse::<i32>().ok())
                    .unwrap_or(-1);
                if !pids.contains(&target) {
                    return Err(refuse(
                        pid,
                        format!("fd {fd} (a pidfd of PID {target})"),
                        "a pidfd of a process outside the tree cannot be moved (that process \
                         stays behind)",
                    ));
                }
            }
            if link.starts_with("pipe:[") {
                pipes.entry(link.clone()).or_insert((pid, fd));
            }
            if link.starts_with("/dev/tty") {
                check_vt_ctty(pid, fd, &link)?;
            }
            if let Some(ino) = socket_ino(&link) {
                tcp_fds.push((pid, fd, link, ino));
            }
        }
    }
    check_aio_rings(&pids)?;
    if !relay_pipes {
        check_pipes(&pids, &pipes, standins)?;
    }
    // A connection (established, half-closed or closing) moves when both its ends are in the
    // tree (the copy makes it again, silently, once the original is gone, and sends its FINs
    // again); the capture checks it again, exactly.
    let Some(&first) = pids.first() else {
        return Ok(());
    };
    let tcp = tcp_connections(first);
    let inodes: HashSet<u64> = tcp_fds.iter().map(|(_, _, _, ino)| *ino).collect();
    let all_listeners = tcp_listeners(first);
    let listeners: Vec<&str> = all_listeners
        .iter()
        .filter(|(_, ino)| inodes.contains(ino))
        .map(|(a, _)| a.as_str())
        .collect();
    // Listeners no process holds: in flight (SCM_RIGHTS), perhaps in the tree's queues, as a
    // pre-fork server hands its listener to a worker (looked for only if needed).
    let in_flight_cell = std::cell::OnceCell::new();
    let in_flight = || {
        in_flight_cell.get_or_init(|| {
            let others: HashSet<u64> = all_listeners
                .iter()
                .map(|(_, ino)| *ino)
                .filter(|ino| !inodes.contains(ino))
                .collect();
            let held = held_by_some_process(&others);
            all_listeners
                .iter()
                .filter(|(_, ino)| others.contains(ino) && !held.contains(ino))
                .map(|(a, _)| a.clone())
                .collect::<Vec<String>>()
        })
    };
    let orphans = tcp_orphans(first);
    let mut ends: HashMap<(&str, &str), u32> = HashMap::new();
    for (_, _, _, ino) in &tcp_fds {
        if let Some(t) = tcp.get(ino) {
            *ends
                .entry((t.local.as_str(), t.remote.as_str()))
                .or_default() += 1;
        }
    }
    let mut seen = HashSet::new();
    for (pid, fd, link, ino) in &tcp_fds {
        let Some(t) = tcp.get(ino) else {
            continue;
        };
        if !seen.insert(*ino) {
            continue;
        }
        let what = format!("fd {fd} ({link}: TCP {} -> {})", t.local, t.remote);
        if !TCP_MOVABLE.contains(&t.state) {
            return Err(refuse(
                *pid,
                what,
                "a TCP connection accepted while still being opened (SYN_RECV, TCP Fast Open) cannot \
                 be moved yet",
            ));
        }
        // A connection still waiting to be accepted by a listener of the tree: its other end
        // has no descriptor yet (the capture checks that it carries nothing).
        // A listener in flight is found by the capture, which refuses the connection if that
        // listener is not the tree's.
        let waiting = || {
            listeners.iter().any(|l| listener_reaches(l, &t.remote))
                || in_flight().iter().any(|l| listener_reaches(l, &t.remote))
        };
        // A connection in CLOSE_WAIT whose other end its process closed (the capture makes a
        // stand-in for it).
        let orphaned = || t.state == 8 && orphans.contains(&(t.remote.clone(), t.local.clone()));
        // A connection being opened has no other end yet: it is opened again.
        let opening = t.state == TCP_SYN_SENT;
        // An other end that no process holds is in flight (SCM_RIGHTS), perhaps in the tree's
        // queues, as a server hands an accepted connection to a worker: the capture checks it.
        let in_flight_end = || {
            tcp.iter()
                .find(|(_, o)| o.local == t.remote && o.remote == t.local)
                .is_some_and(|(ino, _)| {
                    *ino != 0 && held_by_some_process(&HashSet::from([*ino])).is_empty()
                })
        };
        // A tree leaving its home relays a connection whose other end stays behind: the home
        // keeps the socket (its deputy's), the body gets the other end of a relay.
        if !ends.contains_key(&(t.remote.as_str(), t.local.as_str()))
            && !waiting()
            && !orphaned()
            && !opening
            && !relay_pipes
            && !standins.contains_key(ino)
            && !in_flight_end()
        {
            return Err(refuse(
                *pid,
                what,
                "the other end of this TCP connection is not in the tree, and a connection \
                 whose other end stays behind cannot be migrated yet",
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listeners_take_connections_to_their_port_and_address() {
        assert!(listener_reaches("127.0.0.1:80", "127.0.0.1:80"));
        assert!(listener_reaches("0.0.0.0:80", "127.0.0.2:80"));
        assert!(listener_reaches("[::]:80", "127.0.0.1:80"));
        assert!(!listener_reaches("127.0.0.1:80", "127.0.0.2:80"));
        assert!(!listener_reaches("0.0.0.0:80", "127.0.0.1:81"));
    }

    #[test]
    fn table_addresses_match_across_ipv4_mapped_addresses() {
        assert_eq!(table_addr("0100007F:1F90"), "127.0.0.1:8080");
        assert_eq!(
            table_addr("0000000000000000FFFF00000100007F:8CC1"),
            "127.0.0.1:36033"
        );
        assert_eq!(
            table_addr("00000000000000000000000001000000:0050"),
            "[::1]:80"
        );
    }
}
