//! Dirty-page tracking of a running process: a userfaultfd made inside it, in async
//! write-protect mode (`UFFD_FEATURE_WP_ASYNC | WP_UNPOPULATED`), covers its private
//! mappings; a write to a protected page costs the process one minor fault, in which the
//! kernel merely clears the page's protection bit. `PAGEMAP_SCAN` reads those bits back and
//! protects the written pages again in the same walk, so a write after a scan is seen by the
//! next. The process never waits on us, and closing the descriptor (dropping the tracker)
//! unregisters everything: the process is left as it was.

use crate::{Error, RangeSet, Result, PAGE};
use ferry_engine::freeze::FrozenTree;
use ferry_inject::Injector;
use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};

/// userfaultfd(2)'s flag for a descriptor that handles faults of user mode only (which needs
/// no privilege, and is all async write protection involves).
const UFFD_USER_MODE_ONLY: u64 = 1;

/// A private mapping of a process, as /proc/PID/smaps shows it.
#[derive(Debug, Clone)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    /// Backed by a file (its clean pages are the file's, never sent).
    pub file_backed: bool,
    /// Registered for write-protect tracking ("uw" in its VmFlags).
    pub wp: bool,
}

/// The private mappings of `pid` whose pages an image carries (all but the vDSO and its kin).
pub fn private_mappings(pid: i32) -> Result<Vec<Mapping>> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps")).map_err(|e| Error::Io {
        pid,
        what: "read /proc/PID/smaps".into(),
        source: e,
    })?;
    let mut out: Vec<Mapping> = Vec::new();
    let mut current: Option<Mapping> = None;
    for line in text.lines() {
        if let Some(flags) = line.strip_prefix("VmFlags:") {
            if let Some(mut m) = current.take() {
                m.wp = flags.split_whitespace().any(|f| f == "uw");
                out.push(m);
            }
            continue;
        }
        let mut f = line.split_whitespace();
        let (Some(range), Some(perms)) = (f.next(), f.next()) else {
            continue;
        };
        let Some((s, e)) = range.split_once('-') else {
            continue;
        };
        let (Ok(start), Ok(end)) = (u64::from_str_radix(s, 16), u64::from_str_radix(e, 16)) else {
            continue;
        };
        // A header line: start-end perms offset dev inode [name].
        let _offset = f.next();
        let _dev = f.next();
        let inode: u64 = f.next().and_then(|i| i.parse().ok()).unwrap_or(0);
        let name: String = f.collect::<Vec<_>>().join(" ");
        let special = matches!(
            name.as_str(),
            "[vdso]" | "[vvar]" | "[vvar_vclock]" | "[vsyscall]"
        );
        current = (perms.as_bytes().get(3) == Some(&b'p') && !special).then_some(Mapping {
            start,
            end,
            file_backed: inode != 0,
            wp: false,
        });
    }
    Ok(out)
}

/// Starts dirty-page tracking ([`Tracker`]) in every live process of the
/// frozen tree: a userfaultfd is made inside each by an injected call. A process that cannot
/// have one (a seccomp filter, a kernel without async write protection) is left out: its
/// memory then all goes with the image.
pub fn start_trackers(frozen: &FrozenTree) -> Vec<Tracker> {
    let mut out = Vec::new();
    for fp in frozen
        .procs
        .iter()
        .filter(|p| !p.zombie && !p.leader_exited)
    {
        let made = (|| -> std::result::Result<_, String> {
            let at = ferry_inject::find_syscall_insn(fp.pid).map_err(|e| e.to_string())?;
            let t = &fp.threads[0];
            let inj = Injector::on_stack(fp.pid, t.tid, t.regs, at).map_err(|e| e.to_string())?;
            let tracker = Tracker::start(fp.pid, &inj);
            inj.finish().map_err(|e| e.to_string())?;
            tracker.map_err(|e| e.to_string())
        })();
        match made {
            Ok(t) => out.push(t),
            Err(e) => log::warn!("PID {}: no dirty-page tracking: {e}", fp.pid),
        }
    }
    out
}

/// The write-protect tracker of one process.
pub struct Tracker {
    pub pid: i32,
    uffd: OwnedFd,
    pagemap: File,
}

impl Tracker {
    /// Makes a userfaultfd inside `pid` through `inj` (an injector on one of its stopped
    /// threads), takes it over with pidfd_getfd and closes it there (its descriptor number is
    /// the process's again), and enables async write protection on it. Nothing is registered
    /// yet: [`Tracker::collect`] registers every mapping it finds untracked.
    pub fn start(pid: i32, inj: &Injector) -> Result<Tracker> {
        let flags = (libc::O_CLOEXEC | libc::O_NONBLOCK) as u64 | UFFD_USER_MODE_ONLY;
        let n = inj
            .syscall("userfaultfd", libc::SYS_userfaultfd, &[flags])
            .map_err(|source| Error::Inject {
                pid,
                what: "make a userfaultfd inside it".into(),
                source,
            })?;
        let taken = ferry_sys::pidfd::pidfd_open(pid)
            .and_then(|p| ferry_sys::pidfd::pidfd_getfd(&p, n as i32));
        let closed = inj.syscall("close", libc::SYS_close, &[n]);
        let uffd = taken.map_err(|source| Error::Sys {
            pid,
            what: format!("take its userfaultfd (descriptor {n})"),
            source,
        })?;
        closed.map_err(|source| Error::Inject {
            pid,
            what: format!("close its userfaultfd (descriptor {n})"),
            source,
        })?;
        ferry_sys::uffd::api(
            uffd.as_fd(),
            ferry_sys::uffd::FEATURE_WP_ASYNC | ferry_sys::uffd::FEATURE_WP_UNPOPULATED,
        )
        .map_err(|source| Error::Sys {
            pid,
            what: "enable async write protection on its userfaultfd".into(),
            source,
        })?;
        let pagemap = File::open(format!("/proc/{pid}/pagemap")).map_err(|source| Error::Io {
            pid,
            what: "open /proc/PID/pagemap".into(),
            source,
        })?;
        Ok(Tracker { pid, uffd, pagemap })
    }

    /// The pages of `maps` (the process's private mappings, read just before) written since
    /// the last call, each protected again; a mapping not tracked yet is registered and
    /// protected now and counts as written whole (so does one the kernel will not let us
    /// track, or whose scan fails: the answer errs only on the side of sending more).
    pub fn collect(&mut self, maps: &[Mapping]) -> RangeSet {
        let mut dirty = Vec::new();
        for m in maps {
            let len = m.end - m.start;
            if !m.wp {
                let fd = self.uffd.as_fd();
                let tracked = ferry_sys::uffd::register_wp(fd, m.start, len)
                    .and_then(|()| ferry_sys::uffd::write_protect(fd, m.start, len, true));
                if let Err(e) = tracked {
                    log::debug!("PID {}: {:x}-{:x} untracked: {e}", self.pid, m.start, m.end);
                }
                dirty.push((m.start, m.end));
                continue;
            }
            match ferry_sys::pagemap::scan_written(&self.pagemap, m.start, m.end) {
                Ok(w) => dirty.extend(w),
                Err(e) => {
                    log::debug!("PID {}: scan {:x}-{:x}: {e}", self.pid, m.start, m.end);
                    dirty.push((m.start, m.end));
                }
            }
        }
        RangeSet::from_ranges(dirty)
    }

    /// Which pages of `ranges` hold data of their own (present or swapped, and for a file
    /// mapping not simply the file's page): those an image would carry.
    pub fn dumpable(&self, maps: &[Mapping], ranges: &RangeSet) -> Result<RangeSet> {
        dumpable(self.pid, &self.pagemap, maps, ranges)
    }
}

const PM_PRESENT: u64 = 1 << 63;
const PM_SWAPPED: u64 = 1 << 62;
const PM_FILE: u64 = 1 << 61;

/// Which pages of `ranges` (inside `maps`) hold data of their own, read from `pagemap`.
pub fn dumpable(pid: i32, pagemap: &File, maps: &[Mapping], ranges: &RangeSet) -> Result<RangeSet> {
    use std::os::unix::fs::FileExt;
    let mut out = Vec::new();
    for m in maps {
        for &(s, e) in RangeSet::from_ranges([(m.start, m.end)])
            .intersect(ranges)
            .ranges()
        {
            let n = ((e - s) / PAGE) as usize;
            let mut raw = vec![0u8; n * 8];
            if let Err(source) = pagemap.read_exact_at(&mut raw, s / PAGE * 8) {
                return Err(Error::Io {
                    pid,
                    what: format!("read the pagemap of {s:x}-{e:x}"),
                    source,
                });
            }
            for (i, c) in raw.chunks_exact(8).enumerate() {
                let v = u64::from_ne_bytes(c.try_into().expect("8 bytes"));
                if v & (PM_PRESENT | PM_SWAPPED) != 0 && !(m.file_backed && v & PM_FILE != 0) {
                    let a = s + i as u64 * PAGE;
                    match out.last_mut() {
                        Some((_, end)) if *end == a => *end = a + PAGE,
                        _ => out.push((a, a + PAGE)),
                    }
                }
            }
        }
    }
    Ok(RangeSet::from_ranges(out))
}
