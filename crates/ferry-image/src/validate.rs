//! The consistency of a tree read from an image. An image is data anyone could have written:
//! everything that a reader (a restore, `ferry image show`) would index, slice or follow is
//! checked here first, so that a crafted image is refused with an error naming what is wrong,
//! never a panic.

use crate::model::{Backing, FileKind, Tree};
use std::collections::HashSet;

/// Words in a thread's general registers (`user_regs_struct` on x86_64).
pub const GP_REGS_WORDS: usize = 27;
/// Index of the instruction pointer in the general registers.
pub const GP_REG_RIP: usize = 16;
/// Bytes in a raw `siginfo_t`.
pub const SIGINFO_SIZE: usize = 128;
/// Signals a process has handlers for (1..=64).
pub const SIGNALS: usize = 64;
/// Mappings start and end on pages of this size.
pub const PAGE_SIZE: u64 = 4096;

/// Checks that a tree is consistent: parents before children, unique PIDs and TIDs, register
/// sets and siginfo records of the right size, mappings in order, and every reference (fd to
/// file, file to pipe, shared memory object or deleted file, mapping to shared memory object
/// or deleted file) pointing at something the tree holds. The error names the process, thread,
/// fd, file or mapping.
pub fn validate(t: &Tree) -> Result<(), String> {
    match t.processes.first() {
        None => return Err("the tree holds no process".into()),
        Some(p) if p.pid != t.root_pid => {
            return Err(format!(
                "the first process (PID {}) is not the root (PID {})",
                p.pid, t.root_pid
            ))
        }
        Some(_) => {}
    }
    let shmem_ref = |what: String, id: u32| -> Result<(), String> {
        if id as usize >= t.shmem.len() {
            return Err(format!(
                "{what} refers to unknown shared memory object {id} (the image has {})",
                t.shmem.len()
            ));
        }
        Ok(())
    };
    let ghost_ref = |what: String, id: u32| -> Result<(), String> {
        if id as usize >= t.ghosts.len() {
            return Err(format!(
                "{what} refers to unknown deleted file {id} (the image has {})",
                t.ghosts.len()
            ));
        }
        Ok(())
    };
    let mut seen = HashSet::new();
    for p in &t.processes {
        if p.pid <= 0 || !seen.insert(p.pid) {
            return Err(format!("PID {} is invalid or repeated", p.pid));
        }
        if p.pid != t.root_pid && !seen.contains(&p.ppid) {
            return Err(format!("PID {} comes before its parent {}", p.pid, p.ppid));
        }
        if p.zombie_status.is_some() {
            continue;
        }
        for &(s, e) in &p.inherited {
            let page = PAGE_SIZE;
            let inside = p
                .vmas
                .iter()
                .any(|v| !v.shared && v.start <= s && e <= v.end);
            if s % page != 0 || e % page != 0 || s >= e || !inside {
                return Err(format!(
                    "PID {}: inherited pages {s:x}-{e:x} are not whole pages of one private mapping",
                    p.pid
                ));
            }
        }
        for &(s, e) in p.inherited_lazily.iter().flatten() {
            let within = p.inherited.iter().any(|&(is, ie)| is <= s && e <= ie);
            if s % PAGE_SIZE != 0 || e % PAGE_SIZE != 0 || s >= e || !within {
                return Err(format!(
                    "PID {}: lazily inherited pages {s:x}-{e:x} are not whole pages of one inherited range",
                    p.pid
                ));
            }
        }
        if !p.cow.is_empty() {
            let parent = t
                .processes
                .iter()
                .find(|q| q.pid == p.ppid && p.pid != t.root_pid && q.zombie_status.is_none());
            let Some(parent) = parent else {
                return Err(format!(
                    "PID {}: it shares pages with its parent {}, which is no live process of \
                     the image",
                    p.pid, p.ppid
                ));
            };
            let mut last = 0;
            for &(s, e) in &p.cow {
                let page = PAGE_SIZE;
                let inside = p.vmas.iter().any(|v| {
                    v.start <= s
                        && e <= v.end
                        && parent
                            .vmas
                            .iter()
                            .any(|w| crate::model::cow_compatible(v, w))
                });
                if s % page != 0 || e % page != 0 || s >= e || s < last || !inside {
                    return Err(format!(
                        "PID {}: pages {s:x}-{e:x} shared with its parent are not whole pages \
                         of one mapping it can have received from its parent",
                        p.pid
                    ));
                }
                last = e;
            }
        }
        if p.leader_exited {
            if p.threads.is_empty() || p.threads.iter().any(|t| t.tid == p.pid) {
                return Err(format!(
                    "PID {}: its main thread exited, yet it has no other thread or lists it",
                    p.pid
                ));
            }
        } else if p.threads.first().map(|t| t.tid) != Some(p.pid) {
            return Err(format!("PID {}: the first thread is not the leader", p.pid));
        }
        for th in &p.threads {
            if th.tid <= 0 || (th.tid != p.pid && !seen.insert(th.tid)) {
                return Err(format!(
                    "PID {}: TID {} is invalid or repeated",
                    p.pid, th.tid
                ));
            }
            if th.gp_regs.len() != GP_REGS_WORDS {
                return Err(format!(
                    "PID {} thread {}: register set has {} words, not {GP_REGS_WORDS}",
                    p.pid,
                    th.tid,
                    th.gp_regs.len()
                ));
            }
            if let Some(si) = th.pending.iter().find(|s| s.0.len() != SIGINFO_SIZE) {
                return Err(format!(
                    "PID {} thread {}: a pending signal's siginfo has {} bytes, not {SIGINFO_SIZE}",
                    p.pid,
                    th.tid,
                    si.0.len()
                ));
            }
        }
        if let Some(si) = p.shared_pending.iter().find(|s| s.0.len() != SIGINFO_SIZE) {
            return Err(format!(
                "PID {}: a pending signal's siginfo has {} bytes, not {SIGINFO_SIZE}",
                p.pid,
                si.0.len()
            ));
        }
        if p.sigactions.len() > SIGNALS {
            return Err(format!(
                "PID {}: {} signal handlers, more than the {SIGNALS} signals",
                p.pid,
                p.sigactions.len()
            ));
        }
        let mut last_end = 0;
        for v in &p.vmas {
            if v.start >= v.end
                || v.start < last_end
                || v.start % PAGE_SIZE != 0
                || v.end % PAGE_SIZE != 0
            {
                return Err(format!(
                    "PID {}: mapping {:x}-{:x} is malformed or overlaps",
                    p.pid, v.start, v.end
                ));
            }
            last_end = v.end;
            let what = || format!("PID {}: mapping {:x}-{:x}", p.pid, v.start, v.end);
            match &v.backing {
                Backing::Shmem { object } => shmem_ref(what(), *object)?,
                Backing::File { ghost: Some(g), .. } => ghost_ref(what(), *g)?,
                Backing::AioRing(r) => {
                    let slots = (v.end - v.start).saturating_sub(32) / 32;
                    let pending = (r.tail as u64 + r.nr as u64).saturating_sub(r.head as u64)
                        % (r.nr as u64).max(1);
                    if r.nr == 0
                        || r.nr as u64 != slots
                        || r.head >= r.nr
                        || r.tail >= r.nr
                        || r.events.len() as u64 != pending * 32
                    {
                        return Err(format!(
                            "{}: AIO ring of {} events (head {}, tail {}, {} bytes of events) \
                             does not fit its mapping",
                            what(),
                            r.nr,
                            r.head,
                            r.tail,
                            r.events.len()
                        ));
                    }
                }
                Backing::PacketRing { ino } => {
                    let has_rings = t.files.iter().any(|f| match &f.kind {
                        crate::FileKind::Socket(s) if s.ino == *ino => s
                            .packet
                            .as_ref()
                            .is_some_and(|p| p.rx_ring.is_some() || p.tx_ring.is_some()),
                        _ => false,
                    });
                    if !has_rings {
                        return Err(format!(
                            "{}: maps the rings of socket:[{ino}], which the image does not \
                             hold as a packet socket with rings",
                            what()
                        ));
                    }
                }
                _ => {}
            }
        }
        let mut fds = HashSet::new();
        for fd in &p.fds {
            if fd.fd < 0 || !fds.insert(fd.fd) {
                return Err(format!(
                    "PID {}: fd {} is invalid or repeated",
                    p.pid, fd.fd
                ));
            }
            if fd.file as usize >= t.files.len() {
                return Err(format!(
                    "PID {} fd {} refers to unknown file {} (the image has {})",
                    p.pid,
                    fd.fd,
                    fd.file,
                    t.files.len()
                ));
            }
        }
    }
    for (i, d) in t.files.iter().enumerate() {
        let what = || format!("file {i} (id {})", d.id);
        if d.owner.is_some_and(|o| o.pid <= 0) || !(0..=64).contains(&d.io_signal) {
            return Err(format!(
                "{} has an invalid signal-driven I/O owner or signal ({:?}, {})",
                what(),
                d.owner,
                d.io_signal
            ));
        }
        match &d.kind {
            FileKind::Pipe { pipe } if *pipe as usize >= t.pipes.len() => {
                return Err(format!(
                    "{} refers to unknown pipe {pipe} (the image has {})",
                    what(),
                    t.pipes.len()
                ))
            }
            FileKind::Memfd { object } => shmem_ref(what(), *object)?,
            FileKind::Regular { ghost: Some(g), .. } => ghost_ref(what(), *g)?,
            FileKind::Socket(s) => {
                if let Some(f) = &s.filter {
                    if f.insns.is_empty()
                        || !f.insns.len().is_multiple_of(8)
                        || f.insns.len() > 4096 * 8
                    {
                        return Err(format!(
                            "{} has a socket filter of {} bytes (whole instructions of 8 \
                             bytes, 1 to 4096 of them)",
                            what(),
                            f.insns.len()
                        ));
                    }
                }
                for r in s.queue.iter().flat_map(|m| &m.rights) {
                    if *r as usize >= t.files.len() {
                        return Err(format!(
                            "{} carries unknown file {r} in flight (the image has {})",
                            what(),
                            t.files.len()
                        ));
                    }
                }
            }
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::*;

    fn good() -> Tree {
        let thread = |tid| Thread {
            tid,
            gp_regs: vec![0; GP_REGS_WORDS],
            ..Default::default()
        };
        Tree {
            root_pid: 10,
            processes: vec![
                Process {
                    pid: 10,
                    threads: vec![thread(10), thread(11)],
                    fds: vec![Fd {
                        fd: 0,
                        file: 0,
                        ..Default::default()
                    }],
                    vmas: vec![Vma {
                        start: 0x1000,
                        end: 0x3000,
                        backing: Backing::Shmem { object: 0 },
                        ..Default::default()
                    }],
                    ..Default::default()
                },
                Process {
                    pid: 12,
                    ppid: 10,
                    threads: vec![thread(12)],
                    ..Default::default()
                },
            ],
            files: vec![FileDesc {
                kind: FileKind::Pipe { pipe: 0 },
                ..Default::default()
            }],
            pipes: vec![Pipe::default()],
            shmem: vec![ShmemObject::default()],
            ..Default::default()
        }
    }

    fn refused(change: impl FnOnce(&mut Tree), words: &str) {
        let mut t = good();
        change(&mut t);
        let e = validate(&t).expect_err("a bad tree was accepted");
        assert!(e.contains(words), "error {e:?} does not say {words:?}");
    }

    #[test]
    fn a_consistent_tree_is_accepted() {
        validate(&good()).unwrap();
    }

    #[test]
    fn an_aio_ring_must_fit_its_mapping() {
        // Two pages: 255 slots after the header; three completions wrapping round the end.
        let ring = || AioRing {
            nr: 255,
            head: 254,
            tail: 2,
            events: vec![0; 3 * 32],
            ..Default::default()
        };
        let mut t = good();
        t.processes[0].vmas[0].backing = Backing::AioRing(ring());
        validate(&t).unwrap();
        let with = |f: fn(&mut AioRing)| {
            move |t: &mut Tree| {
                let mut r = ring();
                f(&mut r);
                t.processes[0].vmas[0].backing = Backing::AioRing(r);
            }
        };
        refused(with(|r| r.nr = 127), "AIO ring of 127 events");
        refused(with(|r| r.nr = 0), "AIO ring of 0 events");
        refused(with(|r| r.head = 255), "head 255");
        refused(with(|r| r.tail = 300), "tail 300");
        refused(
            with(|r| {
                r.events.pop();
            }),
            "95 bytes of events",
        );
        refused(with(|r| r.events.clear()), "0 bytes of events");
    }

    #[test]
    fn every_bad_reference_is_named() {
        refused(|t| t.processes.clear(), "no process");
        refused(|t| t.root_pid = 12, "not the root");
        refused(|t| t.processes[1].ppid = 99, "before its parent 99");
        refused(|t| t.processes[1].pid = 10, "PID 10 is invalid or repeated");
        refused(
            |t| {
                t.processes[0].threads.remove(0);
            },
            "not the leader",
        );
        refused(
            |t| {
                let th = t.processes[0].threads[1].clone();
                t.processes[1].threads.push(th)
            },
            "TID 11",
        );
        refused(
            |t| t.processes[0].threads[1].gp_regs.truncate(3),
            "register set has 3 words",
        );
        refused(
            |t| t.processes[0].threads[1].pending = vec![SigInfo(vec![1])],
            "siginfo has 1 bytes",
        );
        refused(
            |t| t.processes[0].shared_pending = vec![SigInfo(vec![0; 200])],
            "siginfo has 200 bytes",
        );
        refused(
            |t| t.processes[0].sigactions = vec![SigAction::default(); 65],
            "65 signal handlers",
        );
        refused(|t| t.processes[0].vmas[0].end = 0x1800, "malformed");
        refused(
            |t| t.processes[0].vmas[0].backing = Backing::Shmem { object: 5 },
            "unknown shared memory object 5",
        );
        refused(
            |t| {
                t.processes[0].vmas[0].backing = Backing::File {
                    path: "/x".into(),
                    dev: 0,
                    ino: 0,
                    size: 0,
                    ghost: Some(0),
                }
            },
            "unknown deleted file 0",
        );
        refused(|t| t.processes[0].fds[0].file = 7, "unknown file 7");
        refused(
            |t| {
                let dup = t.processes[0].fds[0].clone();
                t.processes[0].fds.push(dup)
            },
            "fd 0 is invalid or repeated",
        );
        refused(|t| t.processes[0].fds[0].fd = -1, "fd -1");
        refused(
            |t| t.files[0].kind = FileKind::Pipe { pipe: 3 },
            "unknown pipe 3",
        );
        refused(
            |t| t.files[0].kind = FileKind::Memfd { object: 1 },
            "unknown shared memory object 1",
        );
        refused(
            |t| {
                t.files[0].kind = FileKind::Regular {
                    path: "/x".into(),
                    size: 0,
                    ghost: Some(2),
                }
            },
            "unknown deleted file 2",
        );
        refused(
            |t| {
                t.files[0].kind = FileKind::Socket(crate::SocketDesc {
                    queue: vec![crate::SockMsg {
                        rights: vec![0, 4],
                        ..Default::default()
                    }],
                    ..Default::default()
                })
            },
            "unknown file 4 in flight",
        );
    }
}
