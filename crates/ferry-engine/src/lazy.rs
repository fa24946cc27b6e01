//! Lazy restore (Accent's copy-on-reference): a rebuilt process's private anonymous memory is
//! not written before it runs. Instead each process gets a userfaultfd, made inside it by an
//! injected call and taken over by us, with every private anonymous mapping registered for
//! missing pages; the descriptors go to a page server ([`LazyMemory`], `crates/ferry-memory`)
//! that answers faults and pushes the rest while the tree runs.
//!
//! The descriptor is made while the husk still has Ferry's credentials (they are restored
//! last), so `vm.unprivileged_userfaultfd` does not apply to it; should the system call be
//! refused anyway, `/dev/userfaultfd` is asked (`USERFAULTFD_IOC_NEW`). It is never made
//! `UFFD_USER_MODE_ONLY`: the kernel's own accesses to a lazy page (`read(2)` into a lazy
//! buffer, a robust-futex list, rseq) must wait for the page, not fail with EFAULT.

use crate::error::{Context, Error, Result};
use crate::husk::Husk;
use ferry_image::{Backing, Vma};
use ferry_sys::uffd;
use std::os::fd::{AsFd, OwnedFd};

/// The events a lazy page server needs to stay correct while the process changes its
/// mappings: fork (the child's missing pages), mremap, madvise(DONTNEED), munmap.
pub const LAZY_FEATURES: u64 = uffd::FEATURE_EVENT_FORK
    | uffd::FEATURE_EVENT_REMAP
    | uffd::FEATURE_EVENT_REMOVE
    | uffd::FEATURE_EVENT_UNMAP;

/// One rebuilt process whose private anonymous memory is left to a page server.
#[derive(Debug)]
pub struct LazyProcess {
    /// Its PID as the tree (and the image's page records) know it.
    pub pid: i32,
    /// Its PID here.
    pub host_pid: i32,
    /// A pidfd of it (to kill it if its memory cannot be supplied).
    pub pidfd: OwnedFd,
    /// Its userfaultfd (non-blocking, close-on-exec), with [`LAZY_FEATURES`] enabled.
    pub uffd: OwnedFd,
    /// Its mappings, as the image has them.
    pub vmas: Vec<Vma>,
    /// The ranges registered for missing pages: every page of the image inside them is the
    /// server's to supply; the others ([`LazyMemory::start`]) must be written before it runs.
    pub registered: Vec<(u64, u64)>,
    /// Registered ranges whose pages must be in before the process runs: those the kernel
    /// reads on others' behalf (its arguments and environment, for /proc/PID/cmdline and
    /// environ), where a remote access cannot wait for a fault to be served.
    pub eager: Vec<(u64, u64)>,
    /// Registered ranges whose pages came before the image (a hybrid migration's pre-copy
    /// rounds: `Process::inherited`, not `inherited_lazily`), which the server supplies from
    /// the pages it holds itself ([`LazyMemory::serves_precopied`]); empty otherwise.
    pub precopied: Vec<(u64, u64)>,
}

/// A page server that takes over the memory of a tree being rebuilt.
pub trait LazyMemory: std::fmt::Debug {
    /// Called once the mappings of every live process exist, before anything else of the
    /// tree is rebuilt: writes the image's pages that lie outside the registered ranges (the
    /// private pages of file mappings) into the processes, and starts serving the registered
    /// ones. The rest of the rebuild may touch lazy memory (the kernel writes an rseq area as
    /// it is registered), so the server must be answering faults when this returns. An error
    /// (a description of what failed) fails the restore.
    fn start(&self, processes: Vec<LazyProcess>) -> std::result::Result<(), String>;
    /// Whether this server supplies exactly the pages the image names as inherited
    /// (`Process::inherited`: a lazy migration leaves a tree's private anonymous memory at its
    /// source), the image carrying the rest, which the restore then writes as usual before the
    /// server starts. False: the server supplies every page of the image (`ferry restore
    /// --lazy`), and the image must inherit nothing.
    fn serves_inherited(&self) -> bool {
        false
    }
    /// Whether this server (one that [`Self::serves_inherited`]) also supplies, from pages
    /// it holds itself, the inherited pages that came before the image (a hybrid migration's
    /// pre-copy rounds) inside the registered ranges ([`LazyProcess::precopied`]): the restore
    /// then leaves them out, so the tree runs before they are written. False: the restore
    /// writes them before the server starts.
    fn serves_precopied(&self) -> bool {
        false
    }
    /// Reads `[addr, addr + buf.len())` of image process `pid`'s memory from the server's
    /// source before [`LazyMemory::start`] (zeros where it holds nothing): the pages a
    /// parent's children share with it copy-on-write go into the parent before the children
    /// are forked from it. An error says why it cannot.
    fn read_early(&self, pid: i32, addr: u64, buf: &mut [u8]) -> std::result::Result<(), String> {
        let _ = (pid, addr, buf);
        Err("this page server cannot read pages before it starts".into())
    }
}

/// Makes a userfaultfd inside `h` for its own address space, takes it over, enables the lazy
/// events and registers every private anonymous mapping of `vmas`. With `precopied`, the
/// server supplies the pre-copied pages inside them too ([`LazyProcess::precopied`]).
pub fn prepare(h: &Husk, p: &ferry_image::Process, precopied: bool) -> Result<LazyProcess> {
    let vmas = &p.vmas[..];
    let inj = h.injector();
    let flags = (libc::O_CLOEXEC | libc::O_NONBLOCK) as u64;
    let n = match inj.syscall("userfaultfd", libc::SYS_userfaultfd, &[flags]) {
        Ok(n) => n,
        Err(first) => {
            // The device grants what the system call may refuse (vm.unprivileged_userfaultfd).
            let path = inj.write_scratch(0, b"/dev/userfaultfd\0")?;
            let dev = inj
                .syscall(
                    "openat(/dev/userfaultfd)",
                    libc::SYS_openat,
                    &[
                        libc::AT_FDCWD as u64,
                        path,
                        (libc::O_RDWR | libc::O_CLOEXEC) as u64,
                    ],
                )
                .map_err(|e| Error::Restore {
                    pid: h.pid,
                    what: format!(
                        "lazy memory needs a userfaultfd in the process: the system call \
                         failed ({first}) and so did /dev/userfaultfd ({e})"
                    ),
                })?;
            let r = inj.syscall(
                "ioctl(USERFAULTFD_IOC_NEW)",
                libc::SYS_ioctl,
                &[dev, uffd::USERFAULTFD_IOC_NEW, flags],
            );
            inj.syscall("close", libc::SYS_close, &[dev])?;
            r.map_err(|e| Error::Restore {
                pid: h.pid,
                what: format!(
                    "lazy memory needs a userfaultfd in the process: the system call failed \
                     ({first}) and so did /dev/userfaultfd's USERFAULTFD_IOC_NEW ({e})"
                ),
            })?
        }
    };
    let pidfd = ferry_sys::pidfd::pidfd_open(h.host).ctx(h.pid, || "open a pidfd".into())?;
    let taken = ferry_sys::pidfd::pidfd_getfd(&pidfd, n as i32);
    // Its number in the process must be free for the image's descriptors.
    inj.syscall("close", libc::SYS_close, &[n])?;
    let fd = taken.ctx(h.pid, || format!("take its userfaultfd (descriptor {n})"))?;
    uffd::api(fd.as_fd(), LAZY_FEATURES).ctx(h.pid, || {
        "enable its userfaultfd with the fork, remap, remove and unmap events".into()
    })?;
    let mut registered = Vec::new();
    // A mapping that had transparent huge pages is not lazy: the page server writes its pages
    // before the process runs, as it does for those outside registered ranges, by ordinary
    // writes whose faults get huge pages again (UFFDIO_COPY puts 4 KiB pages only).
    for v in vmas
        .iter()
        .filter(|v| matches!(v.backing, Backing::Anonymous) && !v.shared && !v.huge_pages)
    {
        uffd::register_missing(fd.as_fd(), v.start, v.end - v.start).ctx(h.pid, || {
            format!(
                "register {:x}-{:x} ({}) for lazy pages",
                v.start, v.end, v.name
            )
        })?;
        registered.push((v.start, v.end));
    }
    let precopied = match (&p.inherited_lazily, precopied) {
        (Some(lazily), true) => crate::resources::memory::intersect(
            &crate::resources::memory::subtract(&p.inherited, lazily),
            &registered,
        ),
        _ => Vec::new(),
    };
    Ok(LazyProcess {
        pid: h.pid,
        host_pid: h.host,
        pidfd,
        uffd: fd,
        vmas: vmas.to_vec(),
        registered,
        eager: eager_ranges(p),
        precopied,
    })
}

/// The pages of `p` that must be in before it runs: its arguments and environment (read by
/// the kernel for others, /proc/PID/cmdline), and each thread's `clear_child_tid` word and
/// robust-list head, which the kernel writes as the thread exits, when a fault can no longer
/// wait for a page server (`handle_userfault` fails an exiting task's fault: a joiner would
/// wait forever for a tid that is never cleared).
fn eager_ranges(p: &ferry_image::Process) -> Vec<(u64, u64)> {
    let page = ferry_sys::PAGE_SIZE;
    let mut out = Vec::new();
    if p.mm.arg_start < p.mm.env_end {
        out.push((
            p.mm.arg_start & !(page - 1),
            p.mm.env_end.div_ceil(page) * page,
        ));
    }
    for t in &p.threads {
        for a in [t.clear_child_tid, t.robust_list] {
            if a != 0 {
                let s = a & !(page - 1);
                out.push((s, s + page));
            }
        }
    }
    out
}

/// Whether a mapping of /proc/PID/maps is memory a lazy migration leaves at its source: private
/// anonymous memory that is not backed by transparent huge pages (those are written before
/// the process runs, so that their faults get huge pages again).
fn left_at_source(m: &crate::procfs::MapEntry) -> bool {
    m.ino == 0
        && !m.shared()
        && m.anon_huge_kb == 0
        && !matches!(
            m.name.as_str(),
            "[vdso]" | "[vvar]" | "[vvar_vclock]" | "[vsyscall]"
        )
}

/// The ranges of process `pid` (a frozen process, by our PID) whose pages a lazy migration
/// leaves at the source: its private anonymous mappings (see [`prepare`], which registers the
/// same mappings on the destination).
pub fn source_ranges(pid: i32) -> Result<Vec<(u64, u64)>> {
    Ok(crate::procfs::smaps(pid)?
        .iter()
        .filter(|m| left_at_source(m))
        .map(|m| (m.start, m.end))
        .collect())
}

/// [`source_ranges`] from the mappings a capture found (`Vma`s, read from the same smaps):
/// the private anonymous mappings without transparent huge pages.
pub fn source_ranges_of(vmas: &[ferry_image::Vma]) -> Vec<(u64, u64)> {
    vmas.iter()
        .filter(|v| matches!(v.backing, ferry_image::Backing::Anonymous))
        .filter(|v| !v.shared && !v.huge_pages)
        .map(|v| (v.start, v.end))
        .collect()
}

/// What `--memory lazy` refuses, before anything is frozen: memory a page server cannot
/// supply lazily. Shared memory (System V segments, shared anonymous mappings, memfds, files
/// of /dev/shm) would have to be sent whole before the tree runs, so the resume would grow
/// with it again; userfaultfd serves private anonymous memory only. The error names the PID,
/// the mapping and the kind.
pub fn preflight(root: i32) -> std::result::Result<(), String> {
    let pids = crate::preflight::tree(root).map_err(|e| e.to_string())?;
    for pid in pids {
        // (maps, not smaps: names and sharing only, without a walk of every page.)
        let Ok(maps) = crate::procfs::maps(pid) else {
            continue;
        };
        for m in &maps {
            let kind = if m.name.starts_with("/SYSV") {
                "System V shared memory"
            } else if m.name == "/dev/zero (deleted)" && m.shared() {
                "shared anonymous memory (MAP_SHARED|MAP_ANONYMOUS)"
            } else if m.name.starts_with("/memfd:") {
                "a memfd"
            } else if m.name.starts_with("/dev/shm/") {
                "a POSIX shared memory object (/dev/shm)"
            } else {
                continue;
            };
            return Err(format!(
                "PID {pid} maps {kind} at {:x}-{:x} ({}): --memory lazy serves private \
                 anonymous memory only (shared memory would have to be sent whole before the \
                 tree runs); move it with --memory eager",
                m.start, m.end, m.name
            ));
        }
    }
    Ok(())
}

/// A process of the tree of `root` (running) with more than 1 MiB of anonymous memory shared
/// copy-on-write with another process (a parent's and its forked children's: `Anonymous`
/// above `Pss_Anon` in /proc/PID/smaps_rollup), and how much: a lazy migration gives each
/// process its own copy of such memory (docs/limitations.md), which an eager or pre-copy move
/// keeps shared, so `--memory auto` does not choose lazy for it.
pub fn cow_shared(root: i32) -> Option<(i32, u64)> {
    let pids = crate::preflight::tree(root).ok()?;
    pids.into_iter().find_map(|pid| {
        let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
        let kb = |key: &str| -> Option<u64> {
            text.lines()
                .find_map(|l| l.strip_prefix(key))?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        };
        let shared = kb("Anonymous:")?.saturating_sub(kb("Pss_Anon:")?) * 1024;
        (shared > 1 << 20).then_some((pid, shared))
    })
}
