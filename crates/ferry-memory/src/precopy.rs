//! V's pre-copy (Theimer): memory is copied while the process runs; then, round after round,
//! what it dirtied meanwhile, until the dirty set stops shrinking (or a round cap); then the
//! tree is frozen and only what is still dirty goes with the image. The receiving side keeps
//! the pages in a [`crate::cache::PageCache`]; the image names, per process, which pages it
//! takes from there (`Process::inherited`), so a page dirtied and then dropped or zeroed
//! since it was sent is never taken from the cache.

use crate::dirty::{private_mappings, Tracker};
use crate::{is_zero, RangeSet, Result, PAGE};
use ferry_image::ImageWriter;
use ferry_sys::proc_mem::vm_read;
use std::collections::HashMap;
use std::io::Write;
use std::time::Instant;

/// At most this many rounds before the freeze (the first copies everything).
pub const MAX_ROUNDS: usize = 8;
/// A round that finds no more than this dirty ends the rounds: the freeze would gain nothing.
pub const SMALL_DIRTY: u64 = 1 << 20;
/// Memory is read in runs of at most this many bytes.
const RUN: usize = 4 << 20;

/// What one round did.
#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize)]
pub struct RoundStats {
    /// Bytes found written since the round before (the first round: every private page).
    pub dirty_bytes: u64,
    /// Bytes sent (dirty pages that hold data and are not all zero).
    pub sent_bytes: u64,
    pub ms: f64,
}

struct Tracked {
    tracker: Tracker,
    /// The process's PID as the image numbers it (its innermost PID namespace's).
    image_pid: i32,
    /// Its start time (field 22 of /proc/PID/stat): a PID taken over by another process
    /// during the rounds is not mistaken for the one tracked.
    start_time: u64,
    /// Pages whose latest contents the receiver has.
    sent: RangeSet,
}

/// The pre-copy of a tree: one tracker per process, and what each round did.
pub struct Precopy {
    procs: Vec<Tracked>,
    pub rounds: Vec<RoundStats>,
}

/// Field 22 (start time) of /proc/PID/stat.
pub fn start_time(pid: i32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &s[s.rfind(')')? + 2..];
    after.split_whitespace().nth(19)?.parse().ok()
}

/// The PID of `pid` in its innermost PID namespace (the last of NSpid).
pub fn inner_pid(pid: i32) -> Option<i32> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("NSpid:"))?
        .split_whitespace()
        .last()?
        .parse()
        .ok()
}

impl Precopy {
    /// Tracks the processes of `trackers` (made while the tree was briefly stopped).
    pub fn new(trackers: Vec<Tracker>) -> Precopy {
        let procs = trackers
            .into_iter()
            .filter_map(|tracker| {
                let pid = tracker.pid;
                Some(Tracked {
                    image_pid: inner_pid(pid)?,
                    start_time: start_time(pid)?,
                    tracker,
                    sent: RangeSet::new(),
                })
            })
            .collect();
        Precopy {
            procs,
            rounds: Vec::new(),
        }
    }

    /// One round, the tree running: every tracked process's pages dirtied since the last
    /// round (all of them, the first time) are protected again and sent to `out`, a page
    /// stream. A process that has ended is dropped (it will not be in the image). `go_on` is
    /// asked before each run of memory: false ends the round at once (`None`: whoever asked
    /// for the pre-copy gave up).
    pub fn round<W: Write>(
        &mut self,
        out: &mut ImageWriter<W>,
        go_on: &mut dyn FnMut() -> bool,
    ) -> Result<Option<RoundStats>> {
        let t = Instant::now();
        let mut stats = RoundStats::default();
        let mut buf = vec![0u8; RUN];
        self.procs
            .retain(|p| start_time(p.tracker.pid) == Some(p.start_time));
        for p in &mut self.procs {
            let pid = p.tracker.pid;
            let Ok(maps) = private_mappings(pid) else {
                continue;
            };
            let dirty = p.tracker.collect(&maps);
            stats.dirty_bytes += dirty.len();
            let present = p.tracker.dumpable(&maps, &dirty)?;
            let mut sent_now = Vec::new();
            let files = std::fs::File::open(format!("/proc/{pid}/pagemap"))
                .ok()
                .zip(ferry_sys::proc_mem::ProcMem::open(pid).ok());
            for &(s, e) in present.ranges() {
                let mut at = s;
                while at < e {
                    if !go_on() {
                        return Ok(None);
                    }
                    let len = ((e - at) as usize).min(RUN);
                    // Pages shared copy-on-write (a parent's and its children's) stay
                    // shared: the capture finds them shared and stores them once.
                    let got = match &files {
                        Some((pagemap, mem)) => ferry_sys::proc_mem::read_keeping_shared(
                            pid,
                            pagemap,
                            mem,
                            at,
                            &mut buf[..len],
                        ),
                        None => vm_read(pid, at, &mut buf[..len]).unwrap_or(0),
                    };
                    // Whole pages only; what could not be read is simply not sent now.
                    let got = got / PAGE as usize * PAGE as usize;
                    let mut k = 0;
                    while k < got {
                        let page = |k: usize| &buf[k..k + PAGE as usize];
                        if is_zero(page(k)) {
                            k += PAGE as usize;
                            continue;
                        }
                        let mut j = k;
                        while j < got && !is_zero(page(j)) {
                            j += PAGE as usize;
                        }
                        out.write_pages(p.image_pid, at + k as u64, &buf[k..j])
                            .map_err(|source| crate::Error::Io {
                                pid,
                                what: "send pre-copied pages".into(),
                                source,
                            })?;
                        sent_now.push((at + k as u64, at + j as u64));
                        stats.sent_bytes += (j - k) as u64;
                        k = j;
                    }
                    at += len as u64;
                }
            }
            p.sent = p.sent.minus(&dirty).union(&RangeSet::from_ranges(sent_now));
        }
        stats.ms = t.elapsed().as_secs_f64() * 1e3;
        self.rounds.push(stats);
        Ok(Some(stats))
    }

    /// Whether another round is worth it: not past the cap, and the last round's dirty set
    /// was neither small nor larger than nine tenths of the one before (it stopped shrinking).
    pub fn worth_another(&self) -> bool {
        let n = self.rounds.len();
        if n >= MAX_ROUNDS {
            return false;
        }
        match (n.checked_sub(2).map(|i| self.rounds[i]), self.rounds.last()) {
            (_, None) => true,
            (_, Some(last)) if last.dirty_bytes <= SMALL_DIRTY => false,
            (None, Some(_)) => true,
            (Some(before), Some(last)) => last.dirty_bytes * 10 < before.dirty_bytes * 9,
        }
    }

    /// Once the tree is frozen: per process (by our PID), the pages the receiver has and the
    /// process has not written since they were sent. The image takes these from the
    /// receiver's cache instead of carrying them (where they still hold data of their own).
    pub fn finish(mut self) -> HashMap<i32, Vec<(u64, u64)>> {
        let mut keep = HashMap::new();
        for p in &mut self.procs {
            let pid = p.tracker.pid;
            if start_time(pid) != Some(p.start_time) {
                continue;
            }
            let Ok(maps) = private_mappings(pid) else {
                continue;
            };
            let dirty = p.tracker.collect(&maps);
            keep.insert(pid, p.sent.minus(&dirty).ranges().to_vec());
        }
        keep
    }

    /// Pages the receiver holds now, over all processes.
    pub fn sent_bytes(&self) -> u64 {
        self.procs.iter().map(|p| p.sent.len()).sum()
    }
}
