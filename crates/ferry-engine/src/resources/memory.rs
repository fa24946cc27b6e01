//! The address space: every mapping with its protection, sharing, backing and madvise state,
//! and the contents of the pages that are not simply the backing file or zero.

use crate::error::{Context, Error, Result};
use crate::husk::Husk;
use crate::objects::{CaptureObjects, RestoreObjects};
use crate::procfs::{self, MapEntry};
use ferry_image::stream::SealedPages;
use ferry_image::{Backing, ImageWriter, Process, Vma};
use ferry_inject::batch::{self, Call};
use ferry_sys::proc_mem::{vm_read, vm_write, ProcMem};
use ferry_sys::PAGE_SIZE;
use std::io::Write;
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::os::fd::{AsFd, OwnedFd};

const PM_PRESENT: u64 = 1 << 63;
const PM_SWAPPED: u64 = 1 << 62;
const PM_FILE: u64 = 1 << 61;
const ARCH_MAP_VDSO_64: u64 = 0x2003;
const MADV_DONTFORK: u64 = 10;
const MADV_WIPEONFORK: u64 = 18;
const MADV_DONTDUMP: u64 = 16;
const MADV_HUGEPAGE: u64 = 14;
const MADV_NOHUGEPAGE: u64 = 15;
const MADV_RANDOM: u64 = 1;
const MADV_SEQUENTIAL: u64 = 2;
const MADV_MERGEABLE: u64 = 12;
const MLOCK_ONFAULT: u64 = 1;
/// Memory is read (and written to the image) in runs of at most this many bytes. Small enough
/// that whoever consumes the image (a disk, or a migration's stream through two daemons into
/// a restore worker) works while the next run is read, instead of waiting for one large run
/// and then making us wait; large enough that each run costs a few system calls only.
const READ_RUN: usize = 4 << 20;

/// Describes every mapping of `pid`. Shared memory objects and deleted files are registered in
/// `objects`, whose contents are written once however many processes map them.
pub fn capture(pid: i32, maps: &[MapEntry], objects: &mut CaptureObjects) -> Result<Vec<Vma>> {
    let mut out = Vec::new();
    for m in maps {
        let backing = match m.name.as_str() {
            "[vdso]" => Backing::Vdso,
            "[vvar]" => Backing::Vvar,
            "[vvar_vclock]" => Backing::VvarVclock,
            "[vsyscall]" => Backing::Vsyscall,
            // Before the inode test: a System V segment's inode is its shmid, and the first
            // segment of an IPC namespace (of a freshly booted machine) is shmid 0.
            _ if objects.is_shmem(m) => Backing::Shmem {
                object: objects.shmem_for_mapping(pid, m)?,
            },
            _ if m.ino == 0 => Backing::Anonymous,
            _ if super::aio::is_ring(m) => {
                Backing::AioRing(super::aio::capture(pid, m, &mut objects.aio_rings)?)
            }
            // A packet socket's rings (checked once its socket is captured:
            // sockets::check_ring_mappings).
            name if name.starts_with("socket:[") && m.shared() => {
                Backing::PacketRing { ino: m.ino }
            }
            _ if m.name.starts_with('/') => {
                let ghost = if m.deleted() {
                    Some(objects.ghost_for_mapping(pid, m)?)
                } else {
                    None
                };
                let size =
                    std::fs::metadata(format!("/proc/{pid}/map_files/{:x}-{:x}", m.start, m.end))
                        .map(|md| md.len())
                        .unwrap_or(0);
                Backing::File {
                    path: m.path().to_string(),
                    dev: m.dev,
                    ino: m.ino,
                    size,
                    ghost,
                }
            }
            _ => {
                return Err(Error::Unsupported {
                    pid,
                    what: format!("mapping {:x}-{:x} ({})", m.start, m.end, m.name),
                    why: "this kind of mapping is not known to Ferry".into(),
                })
            }
        };
        out.push(Vma {
            start: m.start,
            end: m.end,
            prot: m.prot(),
            shared: m.shared(),
            offset: m.offset,
            backing,
            name: m.name.clone(),
            growsdown: m.has_flag("gd"),
            dontfork: m.has_flag("dc"),
            wipeonfork: m.has_flag("wf"),
            dontdump: m.has_flag("dd"),
            locked: m.has_flag("lo"),
            hugepage: m.has_flag("hg"),
            nohugepage: m.has_flag("nh"),
            huge_pages: m.anon_huge_kb > 0,
            may_write: m.shared() && m.has_flag("mw"),
            mergeable: m.has_flag("mg"),
            sequential: m.has_flag("sr"),
            random: m.has_flag("rr"),
            lock_onfault: m.has_flag("lf"),
            noreserve: m.has_flag("nr"),
        });
    }
    Ok(out)
}

/// Which pages of a private mapping hold data of their own (anonymous or copied-on-write).
fn dumpable_pages(pid: i32, pagemap: &std::fs::File, v: &Vma) -> Result<Vec<bool>> {
    use std::os::unix::fs::FileExt;
    let n = ((v.end - v.start) / PAGE_SIZE) as usize;
    let mut raw = vec![0u8; n * 8];
    pagemap
        .read_exact_at(&mut raw, v.start / PAGE_SIZE * 8)
        .ctx(pid, || format!("read pagemap of {:x}-{:x}", v.start, v.end))?;
    let file_backed = matches!(v.backing, Backing::File { .. } | Backing::Shmem { .. });
    Ok(raw
        .chunks_exact(8)
        .map(|c| {
            let e = u64::from_ne_bytes(c.try_into().expect("8 bytes"));
            e & (PM_PRESENT | PM_SWAPPED) != 0 && !(file_backed && e & PM_FILE != 0)
        })
        .collect())
}

/// The ranges of mapping `v` (private) whose pages hold data of their own, sorted: for an
/// anonymous mapping, its present or swapped pages, found in one PAGEMAP_SCAN walk that
/// returns ranges (a freeze no longer reads and loops over a word per page of gigabytes);
/// for any other, or where that ioctl is not there, from the pagemap page by page.
fn owned_ranges(pid: i32, pagemap: &std::fs::File, v: &Vma) -> Result<Vec<(u64, u64)>> {
    if matches!(v.backing, Backing::Anonymous) {
        if let Ok(r) = ferry_sys::pagemap::scan_present(pagemap, v.start, v.end) {
            return Ok(r);
        }
    }
    let present = dumpable_pages(pid, pagemap, v)?;
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (i, p) in present.iter().enumerate() {
        if *p {
            let a = v.start + i as u64 * PAGE_SIZE;
            match out.last_mut() {
                Some((_, e)) if *e == a => *e = a + PAGE_SIZE,
                _ => out.push((a, a + PAGE_SIZE)),
            }
        }
    }
    Ok(out)
}

/// `a` and `b` (each sorted and disjoint) intersected.
pub fn intersect(a: &[(u64, u64)], b: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let (mut i, mut j, mut out) = (0, 0, Vec::new());
    while i < a.len() && j < b.len() {
        let (s, e) = (a[i].0.max(b[j].0), a[i].1.min(b[j].1));
        if s < e {
            out.push((s, e));
        }
        if a[i].1 < b[j].1 {
            i += 1;
        } else {
            j += 1;
        }
    }
    out
}

/// `a` without `b` (each sorted and disjoint).
pub fn subtract(a: &[(u64, u64)], b: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut j = 0;
    for &(s, e) in a {
        let mut at = s;
        while j < b.len() && b[j].1 <= at {
            j += 1;
        }
        let mut k = j;
        while at < e {
            match b.get(k) {
                Some(&(bs, be)) if bs < e => {
                    if bs > at {
                        out.push((at, bs));
                    }
                    at = at.max(be);
                    k += 1;
                }
                _ => {
                    out.push((at, e));
                    at = e;
                }
            }
        }
    }
    out
}

/// The pages of `keep` that hold data of their own in `vmas` (private mappings of `pid`, a
/// frozen process), per mapping: what the image leaves to the restorer's earlier copy.
pub fn inherited_pages(pid: i32, vmas: &[Vma], keep: &[(u64, u64)]) -> Result<Vec<(u64, u64)>> {
    let pagemap =
        std::fs::File::open(format!("/proc/{pid}/pagemap")).ctx(pid, || "open pagemap".into())?;
    let mut out = Vec::new();
    for v in vmas {
        if v.shared
            || !matches!(
                v.backing,
                Backing::Anonymous | Backing::File { .. } | Backing::Shmem { .. }
            )
            || !keep.iter().any(|&(s, e)| s < v.end && v.start < e)
        {
            continue;
        }
        // Ranges never span two mappings (a restore checks each lies in one).
        let mine = intersect(&owned_ranges(pid, &pagemap, v)?, keep);
        let first = out.len();
        for (s, e) in mine {
            let n = out.len();
            match out.last_mut() {
                Some((_, last)) if n > first && *last == s => *last = e,
                _ => out.push((s, e)),
            }
        }
    }
    Ok(out)
}

/// The pages of `vmas` (the private anonymous mappings of `pid`, a frozen process) that are
/// its parent's, copy-on-write: in a mapping it can have received from its parent by fork
/// ([`ferry_image::cow_compatible`] with one of `parent_vmas`), the very page (the same page
/// frame, present in both) that the parent `parent` maps at the same address. Sorted ranges.
/// Page frame numbers are shown to root only: for anyone else nothing is found, and every
/// page is the child's own, as before.
pub fn cow_pages(
    pid: i32,
    vmas: &[Vma],
    parent: i32,
    parent_vmas: &[Vma],
) -> Result<Vec<(u64, u64)>> {
    use std::os::unix::fs::FileExt;
    const PFN: u64 = (1 << 55) - 1;
    let open =
        |p: i32| std::fs::File::open(format!("/proc/{p}/pagemap")).ctx(p, || "open pagemap".into());
    let (mine, theirs) = (open(pid)?, open(parent)?);
    let mut out: Vec<(u64, u64)> = Vec::new();
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for v in vmas {
        if !parent_vmas
            .iter()
            .any(|w| ferry_image::cow_compatible(v, w))
        {
            continue;
        }
        // Ranges never span two mappings (a restore checks each lies in one).
        let first = out.len();
        // Only where the child has pages at all (one PAGEMAP_SCAN walk).
        let present = match ferry_sys::pagemap::scan_present(&mine, v.start, v.end) {
            Ok(r) => r,
            Err(_) => vec![(v.start, v.end)],
        };
        for (s, e) in present {
            let n = ((e - s) / PAGE_SIZE) as usize;
            a.resize(n * 8, 0);
            b.resize(n * 8, 0);
            mine.read_exact_at(&mut a, s / PAGE_SIZE * 8)
                .ctx(pid, || format!("read pagemap of {s:x}-{e:x}"))?;
            theirs
                .read_exact_at(&mut b, s / PAGE_SIZE * 8)
                .ctx(parent, || format!("read pagemap of {s:x}-{e:x}"))?;
            for (k, (x, y)) in a.chunks_exact(8).zip(b.chunks_exact(8)).enumerate() {
                let x = u64::from_ne_bytes(x.try_into().expect("8 bytes"));
                let y = u64::from_ne_bytes(y.try_into().expect("8 bytes"));
                let shared = x & PM_PRESENT != 0
                    && y & PM_PRESENT != 0
                    && x & PFN != 0
                    && x & PFN == y & PFN;
                if !shared {
                    continue;
                }
                let at = s + k as u64 * PAGE_SIZE;
                let n = out.len();
                match out.last_mut() {
                    Some((_, end)) if n > first && *end == at => *end = at + PAGE_SIZE,
                    _ => out.push((at, at + PAGE_SIZE)),
                }
            }
        }
    }
    Ok(out)
}

/// `a` without `b` (each sorted and disjoint).
pub fn without(a: &[(u64, u64)], b: &[(u64, u64)]) -> Vec<(u64, u64)> {
    subtract(a, b)
}

pub(crate) fn is_zero(bytes: &[u8]) -> bool {
    let words = bytes.chunks_exact(8);
    let tail = words.remainder();
    tail.iter().all(|b| *b == 0)
        && words
            .into_iter()
            .all(|w| u64::from_ne_bytes(w.try_into().expect("8 bytes")) == 0)
}

/// A run of memory's stretches of non-zero pages (byte ranges of the run), each sealed.
type Sealed = Vec<(Range<usize>, SealedPages)>;

/// Statistics of what a capture wrote.
#[derive(Debug, Default, Clone, Copy)]
pub struct PageStats {
    pub pages_scanned: u64,
    pub pages_written: u64,
    pub zero_pages_skipped: u64,
}

/// Writes the private pages of every mapping of `pid` that has data of its own, in records
/// that name the process `image_pid` (its PID as the tree sees it). Nothing is looked for in
/// `left_out` (sorted, disjoint: ranges whose pages are all `proc.inherited` or `proc.cow`):
/// a lazy migration's private anonymous memory is not walked a second time in the freeze.
///
/// Two buffers take turns: a helper thread reads the next run of memory out of the process
/// (`process_vm_readv`, or /proc/PID/mem for pages we may not read that way), splits it at zero
/// pages and checksums the rest, while this thread writes the last run to the image. (The
/// two halves then take about as long: reading and checksumming on one side, the image's copy
/// into the page cache or a socket on the other.)
pub fn write_pages<W: Write>(
    pid: i32,
    proc: &Process,
    left_out: &[(u64, u64)],
    out: &mut ImageWriter<W>,
    stats: &mut PageStats,
) -> Result<()> {
    let (image_pid, vmas) = (proc.pid, &proc.vmas[..]);
    let inherited = &proc.inherited[..];
    let pagemap =
        std::fs::File::open(format!("/proc/{pid}/pagemap")).ctx(pid, || "open pagemap".into())?;
    let mem = ProcMem::open(pid).ctx(pid, || "open /proc/PID/mem".into())?;
    // The mappings whose pages are stored, in address order.
    let stored: Vec<&Vma> = vmas
        .iter()
        .filter(|v| {
            !v.shared
                && matches!(
                    v.backing,
                    Backing::Anonymous | Backing::File { .. } | Backing::Shmem { .. }
                )
        })
        .inspect(|v| stats.pages_scanned += (v.end - v.start) / PAGE_SIZE)
        .filter(|v| !subtract(&[(v.start, v.end)], left_out).is_empty())
        .collect();
    let mut owned = owned_pages(pid, &pagemap, &stored)?;
    if !inherited.is_empty() {
        owned = subtract(&owned, inherited);
    }
    if !proc.cow.is_empty() {
        owned = subtract(&owned, &proc.cow);
    }
    // The runs to copy, (address, bytes): a run goes on across adjacent mappings, so that a
    // process of thousands of small mappings side by side is read and stored in a few runs
    // and records, not one (and a few system calls) per mapping.
    let mut runs: Vec<(u64, usize)> = Vec::new();
    for (s, e) in owned {
        let mut at = s;
        while at < e {
            let len = (e - at).min(READ_RUN as u64);
            runs.push((at, len as usize));
            at += len;
        }
    }
    std::thread::scope(|scope| {
        let (to_reader, free) = std::sync::mpsc::sync_channel::<Vec<u8>>(2);
        let (give, filled) = std::sync::mpsc::sync_channel::<Result<(Vec<u8>, Sealed)>>(2);
        for _ in 0..2 {
            to_reader.send(Vec::new()).expect("the receiver is here");
        }
        let runs = &runs;
        let mem = &mem;
        let pagemap = &pagemap;
        let stored = &stored[..];
        scope.spawn(move || {
            for &(addr, len) in runs {
                let Ok(mut buf) = free.recv() else { return };
                buf.resize(len, 0);
                let r = read_run(pid, pagemap, mem, stored, addr, &mut buf);
                let r = r.map(|()| {
                    let sealed = seal_nonzero(image_pid, addr, &buf);
                    (buf, sealed)
                });
                let failed = r.is_err();
                if give.send(r).is_err() || failed {
                    return;
                }
            }
        });
        for &(_, len) in runs {
            crate::cancel::check(&format!("copying the memory of PID {pid}"))?;
            let (buf, sealed) = filled.recv().map_err(|_| Error::Unsupported {
                pid,
                what: "copying its memory".into(),
                why: "the thread reading it stopped".into(),
            })??;
            let mut kept = 0;
            for (range, seal) in &sealed {
                out.write_sealed_pages(seal, &buf[range.clone()])
                    .ctx(pid, || "write pages to the image".into())?;
                kept += range.len();
            }
            stats.pages_written += (kept / PAGE_SIZE as usize) as u64;
            stats.zero_pages_skipped += ((len - kept) / PAGE_SIZE as usize) as u64;
            // The reader may have stopped after its last run: a buffer it will not need.
            let _ = to_reader.send(buf);
        }
        Ok::<(), Error>(())
    })?;
    // A kernel AIO context whose ring moved since the capture read it had requests in flight.
    super::aio::check_quiet(pid, vmas)
}

/// The pages of `stored` (private mappings of `pid`, in address order) that hold data of
/// their own, as sorted ranges, merged across adjacent mappings: each group of adjacent
/// anonymous mappings is walked by one PAGEMAP_SCAN (not one per mapping); any other
/// mapping, or a group the ioctl refuses, mapping by mapping ([`owned_ranges`]).
fn owned_pages(pid: i32, pagemap: &std::fs::File, stored: &[&Vma]) -> Result<Vec<(u64, u64)>> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    let mut push = |found: Vec<(u64, u64)>| {
        for (s, e) in found {
            match out.last_mut() {
                Some((_, last)) if *last == s => *last = e,
                _ => out.push((s, e)),
            }
        }
    };
    let anon = |v: &Vma| matches!(v.backing, Backing::Anonymous);
    let mut i = 0;
    while i < stored.len() {
        let mut j = i + 1;
        if anon(stored[i]) {
            while j < stored.len() && anon(stored[j]) && stored[j].start == stored[j - 1].end {
                j += 1;
            }
        }
        let scanned = if j > i + 1 {
            ferry_sys::pagemap::scan_present(pagemap, stored[i].start, stored[j - 1].end).ok()
        } else {
            None
        };
        match scanned {
            Some(r) => push(r),
            None => {
                for v in &stored[i..j] {
                    push(owned_ranges(pid, pagemap, v)?);
                }
            }
        }
        i = j;
    }
    Ok(out)
}

/// Reads the run `[addr, addr + buf.len())` of `pid`'s memory, which lies in adjacent
/// mappings of `stored`: the stretches of readable mappings with `process_vm_readv` (keeping
/// pages shared copy-on-write shared), the others (and whatever that could not read) through
/// /proc/PID/mem.
fn read_run(
    pid: i32,
    pagemap: &std::fs::File,
    mem: &ProcMem,
    stored: &[&Vma],
    addr: u64,
    buf: &mut [u8],
) -> Result<()> {
    let end = addr + buf.len() as u64;
    let mut i = stored.partition_point(|v| v.end <= addr);
    let mut at = addr;
    while at < end {
        let Some(first) = stored.get(i).filter(|v| v.start <= at) else {
            return Err(Error::Unsupported {
                pid,
                what: format!("reading its memory at {at:x}"),
                why: "the address is in no mapping captured".into(),
            });
        };
        let readable = |v: &Vma| v.prot & libc::PROT_READ as u32 != 0;
        // The adjacent mappings as readable as this one.
        let mut seg_end = first.end;
        i += 1;
        while seg_end < end {
            match stored.get(i) {
                Some(v) if v.start == seg_end && readable(v) == readable(first) => {
                    seg_end = v.end;
                    i += 1;
                }
                _ => break,
            }
        }
        let seg_end = seg_end.min(end);
        let part = &mut buf[(at - addr) as usize..(seg_end - addr) as usize];
        // (Pages shared copy-on-write stay shared: a process left running keeps its memory
        // use.)
        let done = if readable(first) {
            ferry_sys::proc_mem::read_keeping_shared(pid, pagemap, mem, at, part)
        } else {
            0
        };
        if done < part.len() {
            mem.read_exact(at + done as u64, &mut part[done..])
                .ctx(pid, || format!("read memory at {:x} ({})", at, first.name))?;
        }
        at = seg_end;
    }
    Ok(())
}

/// Splits a run of memory read at `addr` at its zero pages, which are not stored, and seals
/// each stretch of the rest as a record of `image_pid`'s pages.
fn seal_nonzero(image_pid: i32, addr: u64, buf: &[u8]) -> Sealed {
    let page_len = PAGE_SIZE as usize;
    let zero = |k: usize| is_zero(&buf[k * page_len..(k + 1) * page_len]);
    let pages = buf.len() / page_len;
    let mut out = Vec::new();
    let mut k = 0;
    while k < pages {
        if zero(k) {
            k += 1;
            continue;
        }
        let mut e = k;
        while e < pages && !zero(e) {
            e += 1;
        }
        let range = k * page_len..e * page_len;
        let seal = SealedPages::new(image_pid, addr + range.start as u64, &buf[range.clone()]);
        out.push((range, seal));
        k = e;
    }
    out
}

/// Maps every mapping of the process into the husk, empty. Contents come afterwards.
pub fn restore_mappings(h: &Husk, p: &Process, objects: &RestoreObjects) -> Result<()> {
    restore_mappings_keeping(h, p, objects, &[])
}

/// Which mappings of child `p` keep what it receives from its parent `parent` by fork
/// (`kept[i]` for `p.vmas[i]`): those that hold pages shared with it (`Process::cow`) and
/// can be the parent's mapping ([`ferry_image::cow_compatible`]).
pub fn kept_from_parent(p: &Process, parent: &Process) -> Vec<bool> {
    p.vmas
        .iter()
        .map(|v| {
            p.cow.iter().any(|&(s, e)| v.start <= s && e <= v.end)
                && parent
                    .vmas
                    .iter()
                    .any(|w| ferry_image::cow_compatible(v, w))
        })
        .collect()
}

/// Makes the address space a freshly forked child husk received from its rebuilt parent its
/// own, before [`restore_mappings_keeping`]: every inherited mapping goes but the trampoline
/// and the parts of the parent's mappings that are the child's `kept` ones (by
/// [`kept_from_parent`]); in those, the child's protection is set and every page that is not
/// shared with the parent (`Process::cow`) is dropped, so that its own pages are written into
/// empty ones and the pages it did not have read as zeros again.
pub fn take_inherited(h: &Husk, p: &Process, kept: &[bool]) -> Result<()> {
    let trampoline = h.trampoline_range();
    let keep: Vec<(u64, u64)> = p
        .vmas
        .iter()
        .zip(kept)
        .filter(|(_, k)| **k)
        .map(|(v, _)| (v.start, v.end))
        .collect();
    let mut calls = Vec::new();
    // (maps, not smaps: nothing here needs the kernel to walk the pages it received.)
    for line in procfs::read(h.host, "maps")?.lines() {
        let range = line.split_whitespace().next().and_then(|r| {
            let (a, b) = r.split_once('-')?;
            Some((
                u64::from_str_radix(a, 16).ok()?,
                u64::from_str_radix(b, 16).ok()?,
            ))
        });
        let Some((start, end)) = range else {
            continue;
        };
        if line.ends_with("[vsyscall]") || (start < trampoline.1 && trampoline.0 < end) {
            continue;
        }
        for (s, e) in subtract(&[(start, end)], &keep) {
            calls.push(Call::new("munmap", libc::SYS_munmap, &[s, e - s]));
        }
    }
    for (v, _) in p.vmas.iter().zip(kept).filter(|(_, k)| **k) {
        calls.push(Call::new(
            "mprotect",
            libc::SYS_mprotect,
            &[v.start, v.end - v.start, v.prot as u64],
        ));
        let mine = intersect(&p.cow, &[(v.start, v.end)]);
        for (s, e) in subtract(&[(v.start, v.end)], &mine) {
            calls.push(Call::new(
                "madvise(MADV_DONTNEED)",
                libc::SYS_madvise,
                &[s, e - s, libc::MADV_DONTNEED as u64],
            ));
        }
    }
    h.batch(&calls, |i| {
        format!("make the address space received from the parent its own (call {i})")
    })
}

/// Copies the pages child `p` shares with its parent (`Process::cow`) from the rebuilt
/// parent's memory (`parent_host`, whose memory is in), where the child could not receive
/// them by fork (a deputy taken over in place at home): its memory is then right, not shared.
pub fn copy_from_parent(
    h: &Husk,
    p: &Process,
    parent_host: i32,
    filler: Option<&AnonFiller>,
) -> Result<u64> {
    let mut buf = vec![0u8; READ_RUN];
    let mut total = 0;
    for &(s, e) in &p.cow {
        let mut at = s;
        while at < e {
            let n = ((e - at) as usize).min(buf.len());
            let got = vm_read(parent_host, at, &mut buf[..n]).unwrap_or(0);
            if got < n {
                ProcMem::open(parent_host)
                    .and_then(|m| m.read_exact(at + got as u64, &mut buf[got..n]))
                    .ctx(p.pid, || {
                        format!("read its parent's page at {:x}", at + got as u64)
                    })?;
            }
            restore_pages(h.host, h.mem(), filler, &p.vmas, at, &buf[..n])?;
            at += n as u64;
            total += n as u64;
        }
    }
    Ok(total)
}

/// [`restore_mappings`], leaving alone the mappings that are `kept` (see [`take_inherited`]):
/// only their madvise state and lock are set.
pub fn restore_mappings_keeping(
    h: &Husk,
    p: &Process,
    objects: &RestoreObjects,
    kept: &[bool],
) -> Result<()> {
    let vmas = &p.vmas;
    let is_kept = |i: usize| kept.get(i).copied().unwrap_or(false);
    let rights = &objects.rights(p);
    // The husk is root when it maps: a user's image locks nothing (it could lock more than
    // the user's RLIMIT_MEMLOCK allows).
    let lock = objects.caller().is_none_or(|c| c.uid == 0);
    let inj = h.injector();
    let pid = h.pid;
    // The vDSO and its data pages come first, at their old place, as one unit.
    let special: Vec<&Vma> = vmas
        .iter()
        .filter(|v| {
            matches!(
                v.backing,
                Backing::Vdso | Backing::Vvar | Backing::VvarVclock
            )
        })
        .collect();
    if let Some(first) = special.iter().map(|v| v.start).min() {
        inj.syscall(
            "arch_prctl(ARCH_MAP_VDSO_64)",
            libc::SYS_arch_prctl,
            &[ARCH_MAP_VDSO_64, first],
        )
        .map_err(|e| Error::Restore {
            pid,
            what: format!("map the vDSO at {first:x}: {e}"),
        })?;
        let now = procfs::smaps(h.host)?;
        for v in &special {
            if !now
                .iter()
                .any(|m| m.start == v.start && m.end == v.end && m.name == v.name)
            {
                return Err(Error::Restore {
                    pid,
                    what: format!(
                        "this kernel's vDSO layout differs from the image's ({} at {:x}-{:x})",
                        v.name, v.start, v.end
                    ),
                });
            }
        }
    }
    // Every other mapping, made by batches of calls the husk runs itself (one injection for
    // thousands of calls); a descriptor ferry opened for a mapping stays open here until the
    // batch that maps it has run.
    let mut calls: Vec<Call> = Vec::new();
    // For each call, the mapping it is for (to name it in an error).
    let mut whose: Vec<usize> = Vec::new();
    let mut held: Vec<std::fs::File> = Vec::new();
    let flush = |calls: &mut Vec<Call>, whose: &mut Vec<usize>, held: &mut Vec<std::fs::File>| {
        let r = h.batch(calls, |i| {
            let v = &vmas[whose[i]];
            format!("map {:x}-{:x} ({})", v.start, v.end, v.name)
        });
        calls.clear();
        whose.clear();
        held.clear();
        r
    };
    let pidfd = h.ferry_pidfd();
    for (i, v) in vmas.iter().enumerate() {
        let before = calls.len();
        let len = v.end - v.start;
        if is_kept(i) {
            madvise_flags(&mut calls, v, lock);
            whose.resize(calls.len(), i);
            continue;
        }
        let private_anon =
            |w: &Vma| matches!(w.backing, Backing::Anonymous) && !w.shared && !w.growsdown;
        // Nor into a kept mapping right after it, received from the parent (its offset may
        // continue this one's).
        let before_kept = is_kept(i + 1) && vmas[i + 1].start == v.end;
        // A neighbour of another protection cannot merge with it (the kernel merges only
        // mappings of the same flags, and nothing here changes a protection it made): `v` is
        // mapped in place, one call instead of three. (As if the two were one mapping split
        // by mprotect: see docs/limitations.md.) One received from the parent may still have
        // another protection now than it will have.
        let after_alike = i > 0 && {
            let w = &vmas[i - 1];
            w.end == v.start && private_anon(w) && (is_kept(i - 1) || w.prot == v.prot)
        };
        if private_anon(v) && (after_alike || before_kept) {
            map_apart(&mut calls, v, h.spare_area());
            madvise_flags(&mut calls, v, lock);
            whose.resize(calls.len(), i);
            continue;
        }
        let mut flags = (libc::MAP_FIXED
            | if v.shared {
                libc::MAP_SHARED
            } else {
                libc::MAP_PRIVATE
            }) as u64;
        if v.noreserve {
            flags |= libc::MAP_NORESERVE as u64;
        }
        let fd = match &v.backing {
            Backing::Vdso | Backing::Vvar | Backing::VvarVclock | Backing::Vsyscall => continue,
            // Once every other mapping is made (below).
            Backing::AioRing(_) => continue,
            Backing::Anonymous => {
                flags |= libc::MAP_ANONYMOUS as u64;
                if v.growsdown {
                    flags |= libc::MAP_GROWSDOWN as u64;
                }
                None
            }
            Backing::File { .. } => Some(objects.mapping_file(rights, &v.backing, v)?),
            Backing::Shmem { object } if objects.is_sysv(*object) => {
                // An injected shmat of its own, after everything before it.
                flush(&mut calls, &mut whose, &mut held)?;
                objects.attach_sysv(h, *object, v)?;
                let mut after = Vec::new();
                madvise_flags(&mut after, v, lock);
                h.batch(&after, |_| format!("advise {:x}-{:x}", v.start, v.end))?;
                continue;
            }
            Backing::PacketRing { ino } => Some(std::fs::File::from(
                crate::resources::sockets::ring_socket(*ino).ok_or_else(|| Error::Restore {
                    pid,
                    what: format!(
                        "map {:x}-{:x}: socket:[{ino}] was not rebuilt with its rings",
                        v.start, v.end
                    ),
                })?,
            )),
            Backing::Shmem { object } => Some(
                objects
                    .shmem_file(*object)?
                    .try_clone()
                    .ctx(pid, || format!("share memory object {object}"))?,
            ),
        };
        let mmap = Call::new(
            "mmap",
            libc::SYS_mmap,
            &[v.start, len, v.prot as u64, flags, u64::MAX, v.offset],
        )
        .expecting(v.start);
        match fd {
            Some(f) => {
                let pidfd = pidfd.ok_or_else(|| Error::Restore {
                    pid,
                    what: "the husk's pidfd of ferry is already closed".into(),
                })?;
                // The husk takes ferry's descriptor, maps it and closes it again.
                calls.push(
                    Call::new(
                        "pidfd_getfd",
                        SYS_PIDFD_GETFD,
                        &[pidfd as u64, f.as_raw_fd() as u64, 0],
                    )
                    .with(batch::KEEP),
                );
                calls.push(mmap.with(batch::ARG4_IS_KEPT));
                calls.push(Call::new("close", libc::SYS_close, &[0]).with(batch::ARG0_PLUS_KEPT));
                held.push(f);
            }
            None => calls.push(mmap),
        }
        madvise_flags(&mut calls, v, lock);
        debug_assert!(calls.len() > before);
        whose.resize(calls.len(), i);
        if held.len() >= HELD_FDS {
            flush(&mut calls, &mut whose, &mut held)?;
        }
    }
    flush(&mut calls, &mut whose, &mut held)?;
    // Kernel AIO contexts last: io_setup puts each new ring in a free gap, which must not be
    // one an image's mapping is still to fill, before it moves to its old address.
    for v in vmas {
        if let Backing::AioRing(r) = &v.backing {
            super::aio::restore(h, v, r)?;
        }
    }
    Ok(())
}

/// The recreated memfd process `p` runs from, when its executable is a memfd (a program
/// started with fexecve or execveat of one): the object of its mapping of that memfd.
pub fn memfd_exe(p: &Process, objects: &RestoreObjects) -> Result<Option<std::fs::File>> {
    if !p.exe.starts_with("/memfd:") {
        return Ok(None);
    }
    let Some(object) = p.vmas.iter().find_map(|v| match v.backing {
        Backing::Shmem { object } if v.name == p.exe && !objects.is_sysv(object) => Some(object),
        _ => None,
    }) else {
        return Ok(None);
    };
    objects
        .shmem_file(object)?
        .try_clone()
        .ctx(p.pid, || {
            format!("share memory object {object}, its executable")
        })
        .map(Some)
}

/// Refuses a process running from a memfd that it no longer maps (its executable could not
/// be made again: [`memfd_exe`]).
pub fn check_memfd_exe(pid: i32, p: &Process) -> Result<()> {
    let mapped = p
        .vmas
        .iter()
        .any(|v| matches!(v.backing, Backing::Shmem { .. }) && v.name == p.exe);
    if p.exe.starts_with("/memfd:") && !mapped {
        return Err(Error::Unsupported {
            pid,
            what: format!("its executable {}", p.exe),
            why: "it runs from a memfd it no longer maps, which cannot be made again".into(),
        });
    }
    Ok(())
}

/// How many descriptors of mapped files ferry keeps open for one batch at most.
const HELD_FDS: usize = 256;
const SYS_PIDFD_GETFD: i64 = 438;

/// The madvise states that change semantics or the page size, as captured, and the mapping's
/// lock if `lock`.
fn madvise_flags(calls: &mut Vec<Call>, v: &Vma, lock: bool) {
    for (on, advice) in [
        (v.dontfork, MADV_DONTFORK),
        (v.wipeonfork, MADV_WIPEONFORK),
        (v.dontdump, MADV_DONTDUMP),
        (v.hugepage, MADV_HUGEPAGE),
        (v.nohugepage, MADV_NOHUGEPAGE),
        (v.mergeable, MADV_MERGEABLE),
        (v.sequential, MADV_SEQUENTIAL),
        (v.random, MADV_RANDOM),
    ] {
        if on {
            calls.push(Call::new(
                "madvise",
                libc::SYS_madvise,
                &[v.start, v.end - v.start, advice],
            ));
        }
    }
    // Locked on fault, so that nothing is faulted in here: pages are locked as their contents
    // are written (or, lazily, fetched), untouched ones when first touched. A lock that was
    // not on fault (plain mlock) comes back on fault too (see docs/limitations.md).
    if v.locked && lock {
        calls.push(Call::new(
            "mlock2",
            libc::SYS_mlock2,
            &[v.start, v.end - v.start, MLOCK_ONFAULT],
        ));
    }
}

/// Maps private anonymous `v` right after another one without merging into it, as the two
/// were separate in the image (the kernel merges a fresh anonymous mapping into an adjacent
/// one whose page offset continues it; an anonymous mapping's offset is the address it was
/// first made at, so two made apart, one then moved by mremap, stay separate). It is made
/// one page into a fresh mapping elsewhere, whose offset therefore cannot continue the
/// neighbour's (that would need the neighbour's last page), and moved into place.
///
/// The fresh mapping is asked for at `hint`, in a gap of the image's address space: left to
/// itself, the kernel may put it where `v` goes (a deputy taken over at home has the layout the
/// image has), and mremap cannot move a mapping onto itself.
fn map_apart(calls: &mut Vec<Call>, v: &Vma, hint: u64) {
    let len = v.end - v.start;
    let page = ferry_sys::PAGE_SIZE;
    let mut flags = (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS) as u64;
    if v.noreserve {
        flags |= libc::MAP_NORESERVE as u64;
    }
    calls.push(
        Call::new(
            "mmap (to map apart)",
            libc::SYS_mmap,
            &[hint, len + page, v.prot as u64, flags, u64::MAX, 0],
        )
        .with(batch::KEEP),
    );
    // From the fresh mapping's second page ...
    calls.push(
        Call::new(
            "mremap (to map apart)",
            libc::SYS_mremap,
            &[
                page,
                len,
                len,
                (libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED) as u64,
                v.start,
            ],
        )
        .with(batch::ARG0_PLUS_KEPT)
        .expecting(v.start),
    );
    // ... its first page dropped.
    calls.push(
        Call::new("munmap (to map apart)", libc::SYS_munmap, &[0, page])
            .with(batch::ARG0_PLUS_KEPT),
    );
}

/// Fills the private anonymous mappings of a rebuilt process through a userfaultfd made inside
/// it: `UFFDIO_COPY` puts each page in place without the page fault and the clearing that
/// `process_vm_writev` costs per page of a fresh mapping (a third of the restore's memory
/// time). Pages the image does not hold stay missing and, once the descriptor is closed
/// (which unregisters every range), are zero-filled on first touch as before.
pub struct AnonFiller {
    pid: i32,
    fd: OwnedFd,
    /// The registered mappings, as (start, end), in address order.
    ranges: Vec<(u64, u64)>,
}

impl AnonFiller {
    /// Makes a userfaultfd in `h` for its own address space, takes it over, and registers
    /// every private anonymous mapping of `vmas` (those the kernel refuses are left to the
    /// ordinary path). `None` if the process cannot have one (its kernel refuses
    /// userfaultfd): its memory is then written as before.
    pub fn open(h: &Husk, vmas: &[Vma]) -> Result<Option<AnonFiller>> {
        let inj = h.injector();
        // O_CLOEXEC | O_NONBLOCK: nobody reads events from it; it only serves UFFDIO_COPY.
        let flags = (libc::O_CLOEXEC | libc::O_NONBLOCK) as u64;
        let Ok(n) = inj.syscall("userfaultfd", libc::SYS_userfaultfd, &[flags]) else {
            return Ok(None);
        };
        let taken = ferry_sys::pidfd::pidfd_open(h.host)
            .and_then(|p| ferry_sys::pidfd::pidfd_getfd(&p, n as i32));
        // Its number in the husk must be free for the image's descriptors.
        inj.syscall("close", libc::SYS_close, &[n])?;
        let fd = taken.ctx(h.pid, || format!("take its userfaultfd (descriptor {n})"))?;
        // SIGBUS: a fault in a registered range fails at once instead of waiting for a
        // handler, so a mistake here is an error, never a hang.
        ferry_sys::uffd::api(fd.as_fd(), ferry_sys::uffd::FEATURE_SIGBUS)
            .ctx(h.pid, || "enable its userfaultfd".into())?;
        // A mapping that had transparent huge pages is written the ordinary way: the faults
        // that makes let the kernel give it huge pages again (UFFDIO_COPY puts 4 KiB pages
        // only).
        let served: Vec<&Vma> = vmas
            .iter()
            .filter(|v| matches!(v.backing, Backing::Anonymous) && !v.shared && !v.huge_pages)
            .collect();
        // One registration for each group of adjacent mappings (one per mapping where the
        // kernel refuses the group).
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        let mut i = 0;
        while i < served.len() {
            let mut j = i + 1;
            while j < served.len() && served[j].start == served[j - 1].end {
                j += 1;
            }
            let (s, e) = (served[i].start, served[j - 1].end);
            if j > i + 1 && ferry_sys::uffd::register_missing(fd.as_fd(), s, e - s).is_ok() {
                ranges.extend(served[i..j].iter().map(|v| (v.start, v.end)));
            } else {
                for v in &served[i..j] {
                    if ferry_sys::uffd::register_missing(fd.as_fd(), v.start, v.end - v.start)
                        .is_ok()
                    {
                        ranges.push((v.start, v.end));
                    }
                }
            }
            i = j;
        }
        Ok(Some(AnonFiller {
            pid: h.pid,
            fd,
            ranges,
        }))
    }

    /// Puts `data` at `addr` if that lies in a registered mapping; false if it does not (the
    /// caller writes it the ordinary way). A page already there (the kernel allocated it
    /// since the mapping was made) is overwritten the ordinary way, which cannot fault.
    fn fill(&self, mem: &ProcMem, addr: u64, data: &[u8]) -> Result<bool> {
        let end = addr + data.len() as u64;
        let i = self.ranges.partition_point(|&(_, e)| e <= addr);
        if !self
            .ranges
            .get(i)
            .is_some_and(|&(s, e)| s <= addr && end <= e)
        {
            return Ok(false);
        }
        let page = PAGE_SIZE as usize;
        let mut done = 0;
        while done < data.len() {
            let at = addr + done as u64;
            match ferry_sys::uffd::copy(self.fd.as_fd(), at, &data[done..]) {
                Ok(n) => done += n,
                Err((e, n)) if e.errno == libc::EEXIST => {
                    let p = at + n as u64;
                    let upto = (done + n + page).min(data.len());
                    mem.write_all(p, &data[done + n..upto])
                        .ctx(self.pid, || format!("write memory at {p:x}"))?;
                    done = upto;
                }
                // The address space changed under the copy (it cannot here: the process is
                // stopped); the kernel asks to try again.
                Err((e, n)) if e.errno == libc::EAGAIN => done += n,
                Err((e, _)) => return Err(e).ctx(self.pid, || format!("fill memory at {at:x}")),
            }
        }
        Ok(true)
    }
}

/// Whether `[addr, end)` lies in mappings of `vmas` (in address order) that follow one
/// another without a gap: where a record of pages may lie (it may span adjacent mappings).
pub fn within_mappings(vmas: &[Vma], addr: u64, end: u64) -> bool {
    let mut i = vmas.partition_point(|v| v.end <= addr);
    if vmas.get(i).is_none_or(|v| v.start > addr) {
        return false;
    }
    let mut at = addr;
    while at < end {
        match vmas.get(i) {
            Some(v) if v.start <= at => at = v.end,
            _ => return false,
        }
        i += 1;
    }
    true
}

/// Writes one run of captured private memory into the rebuilt process, mapping by mapping
/// (a run may span adjacent mappings; `vmas` in address order): through `filler` where it
/// serves the mapping, else with `process_vm_writev` into a writable mapping, else through
/// /proc/PID/mem.
pub fn restore_pages(
    pid: i32,
    mem: &ProcMem,
    filler: Option<&AnonFiller>,
    vmas: &[Vma],
    addr: u64,
    data: &[u8],
) -> Result<()> {
    let end = addr + data.len() as u64;
    let mut i = vmas.partition_point(|v| v.end <= addr);
    let mut at = addr;
    while at < end {
        // (A piece in no mapping is written the ordinary way, which fails naming it.)
        let v = vmas.get(i).filter(|v| v.start <= at);
        let upto = v.map_or(end, |v| v.end.min(end));
        let piece = &data[(at - addr) as usize..(upto - addr) as usize];
        i += 1;
        if let Some(f) = filler {
            if f.fill(mem, at, piece)? {
                at = upto;
                continue;
            }
        }
        let writable = v.is_some_and(|v| v.prot & libc::PROT_WRITE as u32 != 0);
        let mut done = 0;
        if writable {
            done = vm_write(pid, at, piece).unwrap_or(0);
        }
        if done < piece.len() {
            mem.write_all(at + done as u64, &piece[done..])
                .ctx(pid, || format!("write memory at {:x}", at + done as u64))?;
        }
        at = upto;
    }
    Ok(())
}

/// Fills a shared memory object from its captured contents.
pub fn restore_object_data(file: &std::fs::File, offset: u64, data: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    file.write_all_at(data, offset)
}

#[cfg(test)]
mod range_tests {
    use super::{intersect, subtract, within_mappings};
    use ferry_image::Vma;

    #[test]
    fn a_record_may_span_adjacent_mappings_not_a_gap() {
        let vma = |start, end| Vma {
            start,
            end,
            ..Vma::default()
        };
        let vmas = [
            vma(0x1000, 0x3000),
            vma(0x3000, 0x4000),
            vma(0x6000, 0x7000),
        ];
        assert!(within_mappings(&vmas, 0x1000, 0x4000));
        assert!(within_mappings(&vmas, 0x2000, 0x4000));
        assert!(within_mappings(&vmas, 0x6000, 0x7000));
        assert!(!within_mappings(&vmas, 0x3000, 0x7000), "across the gap");
        assert!(!within_mappings(&vmas, 0x3000, 0x5000), "into the gap");
        assert!(!within_mappings(&vmas, 0x0, 0x2000), "before the first");
        assert!(!within_mappings(&vmas, 0x6000, 0x8000), "past the last");
        assert!(!within_mappings(&vmas, 0x8000, 0x9000));
    }

    #[test]
    fn ranges_intersect_and_subtract() {
        let a = [(0, 10), (20, 30), (40, 50)];
        let b = [(5, 25), (28, 29), (45, 60)];
        assert_eq!(
            intersect(&a, &b),
            vec![(5, 10), (20, 25), (28, 29), (45, 50)]
        );
        assert_eq!(subtract(&a, &b), vec![(0, 5), (25, 28), (29, 30), (40, 45)]);
        assert_eq!(subtract(&a, &[]), a.to_vec());
        assert_eq!(subtract(&a, &[(0, 100)]), vec![]);
        assert_eq!(intersect(&a, &[]), vec![]);
        assert_eq!(
            subtract(&[(0, 10)], &[(2, 3), (3, 4), (8, 12)]),
            vec![(0, 2), (4, 8)]
        );
    }
}
