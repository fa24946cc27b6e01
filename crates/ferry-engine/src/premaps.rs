//! The mappings of a tree read before its freeze, so that the freeze does not read
//! /proc/PID/smaps: to print each mapping's Rss and Pss the kernel walks every page table entry
//! of it, which takes time in proportion to the memory (about 55 ms at 2 GiB here), while the
//! capture only needs each mapping's flags (VmFlags) and whether it holds huge pages.
//!
//! Before the freeze, every thread of each process gets counters of the system calls that can
//! change a mapping's flags without changing what /proc/PID/maps shows (madvise over a whole
//! mapping with an advice that sets a flag, the mlock family, prctl, mseal, an mmap, mremap,
//! brk or shmat that puts a mapping of the same shape in place of another, execve), then its
//! smaps is read ([`PreMaps::take`]). Right
//! after the freeze, before the capture injects any call, the counters are read and closed
//! ([`PreMaps::settle`]): a process whose threads made none of those calls keeps its early
//! read. In the freeze the capture then reads only /proc/PID/maps (no page walk) and takes the
//! early read if every mapping is the same (range, protection, offset, file, name); otherwise,
//! and for every process not read early (forked since, or without counters: no tracefs here),
//! it reads smaps as before ([`PreMaps::mappings`]).
//!
//! `AnonHugePages` is the one fact of the early read that can change without any call of the
//! process (khugepaged collapses pages into huge pages at any time, in the freeze too): it only
//! decides how a restore writes a mapping's pages (so that its faults get huge pages again, or
//! lazily), never what they hold.

use crate::error::Result;
use crate::procfs::{self, MapEntry};
use ferry_sys::perf::SyscallCounter;
use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The x86_64 system calls after which an early read of smaps is not trusted: those that
/// change a mapping's VmFlags in place (madvise, below; mlock, munlock, mlockall, munlockall,
/// mlock2, prctl (PR_SET_MEMORY_MERGE), mseal), or put a new mapping where one of the same shape
/// was (mmap, mremap, brk, shmat, remap_file_pages), or a new address space (execve, execveat).
const WATCHED: [u32; 14] = [
    9,   // mmap
    12,  // brk
    25,  // mremap
    30,  // shmat
    59,  // execve
    149, // mlock
    150, // munlock
    151, // mlockall
    152, // munlockall
    157, // prctl
    216, // remap_file_pages
    322, // execveat
    325, // mlock2
    462, // mseal
];
const MADVISE: u32 = 28;
/// The madvise advice that changes VmFlags: MADV_NORMAL, RANDOM, SEQUENTIAL (0-2), and
/// DONTFORK to KEEPONFORK (10-19: dontfork, mergeable, hugepage, dontdump, wipeonfork and their
/// undoing). Others (MADV_DONTNEED, which glibc gives an ending thread's stack and a trimmed
/// heap, MADV_FREE, ...) change pages, not flags, and are read in the freeze anyway.
const MADVISE_FLAGS: &str = "behavior <= 2 || (behavior >= 10 && behavior <= 19)";

/// The tracepoints counted on each thread: (id, filter).
fn watches() -> Option<Vec<(u64, String)>> {
    let raw = ferry_sys::perf::sys_enter_id()?;
    let ids = |nrs: &mut dyn Iterator<Item = u32>| {
        nrs.map(|n| format!("id == {n}"))
            .collect::<Vec<_>>()
            .join(" || ")
    };
    Some(
        match ferry_sys::perf::tracepoint_id("syscalls", "sys_enter_madvise") {
            Some(madvise) => vec![
                (raw, ids(&mut WATCHED.into_iter())),
                (madvise, MADVISE_FLAGS.to_string()),
            ],
            // Without the per-call event, every madvise counts.
            None => vec![(raw, ids(&mut WATCHED.into_iter().chain([MADVISE])))],
        },
    )
}

#[derive(Debug)]
struct Early {
    /// The process, so that a PID reused since is not taken for it.
    pidfd: OwnedFd,
    counters: Vec<SyscallCounter>,
    maps: Vec<MapEntry>,
}

/// Mappings of a tree's processes (by our PIDs) read before the freeze.
#[derive(Debug, Default)]
pub struct PreMaps {
    procs: HashMap<i32, Early>,
    settled: bool,
    /// How many processes' early reads were used, and how many were read again in the freeze.
    pub used: AtomicUsize,
    pub read_again: AtomicUsize,
}

impl PreMaps {
    /// Counters on every thread of every process of the tree of `root`, then each process's
    /// smaps. Empty if the kernel cannot count system calls here (no tracefs): the capture
    /// then reads smaps in the freeze, as it always did. Call it while the tree runs.
    pub fn take(root: i32) -> PreMaps {
        let mut out = PreMaps::default();
        let Some(watches) = watches() else {
            return out;
        };
        let Ok(pids) = crate::preflight::tree(root) else {
            return out;
        };
        for pid in pids {
            if let Some(e) = Self::early(pid, &watches) {
                out.procs.insert(pid, e);
            }
        }
        out
    }

    fn early(pid: i32, watches: &[(u64, String)]) -> Option<Early> {
        let pidfd = ferry_sys::pidfd::pidfd_open(pid).ok()?;
        let mut counters = Vec::new();
        let mut seen = Vec::new();
        // Threads may be created while counters are opened; one created by a thread counted
        // already is counted with it (inherit). Repeat until a pass finds none new.
        loop {
            let mut new = 0;
            for tid in procfs::tids(pid).ok()? {
                if seen.contains(&tid) {
                    continue;
                }
                for (tp, filter) in watches {
                    match SyscallCounter::open(tid, *tp, filter) {
                        Ok(c) => counters.push(c),
                        // Gone meanwhile: it makes no call any more.
                        Err(e) if e.errno == libc::ESRCH => {}
                        Err(e) => {
                            log::debug!("PID {pid}: no system call counter on thread {tid}: {e}");
                            return None;
                        }
                    }
                }
                seen.push(tid);
                new += 1;
            }
            if new == 0 {
                break;
            }
        }
        let maps = procfs::smaps(pid).ok()?;
        Some(Early {
            pidfd,
            counters,
            maps,
        })
    }

    /// Reads the counters (the tree is frozen: it makes no call now, and the capture's own
    /// injected calls must not count): a process that made a watched call since its early
    /// read, or is not the process it was, will be read again. The counters are handed back,
    /// to be closed once the move no longer waits ([`Retired::close`]): the last close of a
    /// tracepoint's perf events unregisters its probe, which walks every thread of the machine
    /// under the task list's lock and waits for RCU grace periods (tens of milliseconds on a
    /// loaded machine).
    #[must_use = "the counters count until closed"]
    pub fn settle(&mut self) -> Retired {
        let mut retired = Vec::new();
        self.procs.retain(|pid, e| {
            let alive = ferry_sys::pidfd::pidfd_send_signal(&e.pidfd, 0).is_ok();
            let quiet = e.counters.iter().all(|c| c.count().is_ok_and(|n| n == 0));
            if alive && !quiet {
                log::debug!("PID {pid}: changed its mappings before the freeze; smaps read in it");
            }
            retired.append(&mut e.counters);
            alive && quiet
        });
        self.settled = true;
        Retired(retired)
    }

    /// The mappings of frozen process `pid` (read through `host`, a live thread of it) with
    /// their VmFlags: the early read if it is still right, else /proc/PID/smaps.
    pub fn mappings(&self, pid: i32, host: i32) -> Result<Vec<MapEntry>> {
        if let Some(e) = self.procs.get(&pid).filter(|_| self.settled) {
            let now = procfs::maps(host)?;
            if same_shape(&now, &e.maps) {
                self.used.fetch_add(1, Ordering::Relaxed);
                return Ok(e.maps.clone());
            }
            log::debug!("PID {pid}: its mappings changed since the early read; smaps read");
        }
        self.read_again.fetch_add(1, Ordering::Relaxed);
        procfs::smaps(host)
    }
}

/// Whether two reads show the same mappings: ranges, protection and sharing, offset, file and
/// name.
fn same_shape(a: &[MapEntry], b: &[MapEntry]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            x.start == y.start
                && x.end == y.end
                && x.perms == y.perms
                && x.offset == y.offset
                && x.dev == y.dev
                && x.ino == y.ino
                && x.name == y.name
        })
}

/// System call counters read already, still open ([`PreMaps::settle`]).
#[derive(Debug, Default)]
pub struct Retired(Vec<SyscallCounter>);

impl Retired {
    /// Closes them in a thread of their own (dropping them closes them here).
    pub fn close(self) {
        if self.0.is_empty() {
            return;
        }
        let spawned = std::thread::Builder::new()
            .name("perf-close".into())
            .spawn(move || drop(self));
        if let Err(e) = spawned {
            log::debug!("close the system call counters: {e}");
        }
    }
}
