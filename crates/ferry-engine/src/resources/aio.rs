//! Kernel AIO contexts (`io_setup`). A context's state a process can see is its ring: a shared
//! mapping of the kernel's (`/[aio] (deleted)` in /proc/PID/maps) whose address is the
//! context's id, a 32-byte header (`struct aio_ring`: id, nr, head, tail, magic, features,
//! header length) and `nr` completion slots (`struct io_event`, 32 bytes). The capture reads
//! the header and the completions not yet reaped; the restore makes a context whose ring has
//! as many slots, moves its ring to the old address (the kernel follows the ring's `mremap`:
//! the old id names the new context), brings the kernel's own tail to the old one by
//! completing and reaping harmless reads, and writes the old completions back in their slots.
//!
//! Requests still in flight are kept by the kernel where nothing outside it can read them. A
//! ring whose tail moves while the process is frozen had some (`check_quiet`): the capture
//! fails, naming the context.

use crate::error::{Context, Error, Result};
use crate::husk::Husk;
use crate::procfs::MapEntry;
use ferry_image::{AioRing, Vma};
use ferry_sys::proc_mem::ProcMem;
use std::collections::HashMap;

/// The ring's header and each completion: 32 bytes.
const HEADER: u64 = 32;
const EVENT: u64 = 32;
/// `AIO_RING_MAGIC`.
const MAGIC: u32 = 0xa10a_10a1;
/// Reads completed and reaped per `io_submit`/`io_getevents` pair while the restore brings
/// the kernel's tail to its place (their pointers and events fit the injector's scratch page).
const CHUNK: u64 = 48;
const IOCB_AT: u64 = 64;
const PTRS_AT: u64 = 128;
const EVENTS_AT: u64 = PTRS_AT + CHUNK * 8;
const MREMAP_MAYMOVE: u64 = 1;
const MREMAP_FIXED: u64 = 2;

/// Whether a mapping of /proc/PID/maps is a kernel AIO context's ring.
pub fn is_ring(m: &MapEntry) -> bool {
    m.path() == "/[aio]" && m.shared()
}

fn what(start: u64, end: u64) -> String {
    format!("kernel AIO context {start:x} (its ring {start:x}-{end:x})")
}

fn header(bytes: &[u8]) -> [u32; 8] {
    let mut h = [0u32; 8];
    for (i, c) in bytes.chunks_exact(4).take(8).enumerate() {
        h[i] = u32::from_le_bytes(c.try_into().expect("4 bytes"));
    }
    h
}

fn read_header(mem: &ProcMem, pid: i32, start: u64, end: u64) -> Result<[u32; 8]> {
    let mut b = [0u8; HEADER as usize];
    mem.read_exact(start, &mut b)
        .ctx(pid, || format!("read the header of {}", what(start, end)))?;
    Ok(header(&b))
}

/// The ring of process `pid` (frozen) at mapping `m`: its header and unreaped completions.
/// `seen` holds the rings of the tree's processes captured before it (inode to PID).
pub fn capture(pid: i32, m: &MapEntry, seen: &mut HashMap<u64, i32>) -> Result<AioRing> {
    let unsupported = |why: String| Error::Unsupported {
        pid,
        what: what(m.start, m.end),
        why,
    };
    // A child forked after io_setup keeps its parent's ring mapped, without the context (the
    // kernel's contexts belong to one address space): which of the two owns it, nothing
    // outside them tells.
    if let Some(other) = seen.insert(m.ino, pid) {
        if other != pid {
            return Err(unsupported(format!(
                "PID {other} maps the same ring (one of them has it from a fork, without the \
                 context, and which one cannot be told from outside)"
            )));
        }
    }
    let mem = ProcMem::open(pid).ctx(pid, || "open /proc/PID/mem".into())?;
    let [_, nr, head, tail, magic, compat, incompat, header_length] =
        read_header(&mem, pid, m.start, m.end)?;
    let slots = (m.end - m.start).saturating_sub(HEADER) / EVENT;
    if magic != MAGIC || header_length as u64 != HEADER || incompat != 0 {
        return Err(unsupported(format!(
            "its ring header is not one Ferry knows (magic {magic:#x}, header length \
             {header_length}, incompatible features {incompat:#x})"
        )));
    }
    if nr as u64 != slots || head >= nr || tail >= nr {
        return Err(unsupported(format!(
            "its ring header says {nr} slots, head {head}, tail {tail}, for a ring of {slots} \
             slots"
        )));
    }
    if m.prot() & 3 != 3 {
        return Err(unsupported(
            "its ring is not mapped readable and writable as io_setup maps it".into(),
        ));
    }
    let pending = (tail + nr - head) % nr;
    let mut events = vec![0u8; (pending as u64 * EVENT) as usize];
    let first = pending.min(nr - head) as u64;
    let (a, b) = events.split_at_mut((first * EVENT) as usize);
    let slot = |i: u64| m.start + HEADER + i * EVENT;
    mem.read_exact(slot(head as u64), a).ctx(pid, || {
        format!("read the completions of {}", what(m.start, m.end))
    })?;
    if !b.is_empty() {
        mem.read_exact(slot(0), b).ctx(pid, || {
            format!("read the completions of {}", what(m.start, m.end))
        })?;
    }
    Ok(AioRing {
        nr,
        head,
        tail,
        magic,
        compat_features: compat,
        incompat_features: incompat,
        header_length,
        events,
    })
}

/// Fails if a ring of `vmas` (process `pid`, still frozen) is not as `capture` found it: its
/// tail moved, so requests were in flight at the freeze (the kernel completed them since), and
/// their completions, and whatever else was in flight, would be missing from the copy.
pub fn check_quiet(pid: i32, vmas: &[Vma]) -> Result<()> {
    let mut mem = None;
    for v in vmas {
        let ferry_image::Backing::AioRing(r) = &v.backing else {
            continue;
        };
        let mem = match &mut mem {
            Some(m) => m,
            None => mem.insert(ProcMem::open(pid).ctx(pid, || "open /proc/PID/mem".into())?),
        };
        let now = read_header(mem, pid, v.start, v.end)?;
        if now[3] != r.tail {
            return Err(Error::Unsupported {
                pid,
                what: what(v.start, v.end),
                why: format!(
                    "it had requests in flight (its ring's tail moved from {} to {} while the \
                     process was frozen): the kernel shows no request before it completes, so \
                     they cannot be moved; wait until they complete (io_getevents) first",
                    r.tail, now[3]
                ),
            });
        }
    }
    Ok(())
}

/// Makes in husk `h` the context whose ring was mapping `v`, with the ring's completions, at
/// the same address (so the same id). Every other mapping of the process must be made already
/// (the kernel places the new ring in a free gap first).
pub fn restore(h: &Husk, v: &Vma, r: &AioRing) -> Result<()> {
    let pid = h.pid;
    let inj = h.injector();
    let len = v.end - v.start;
    let fail = |what: String| Error::Restore {
        pid,
        what: format!("{}: {what}", self::what(v.start, v.end)),
    };
    // The kernel doubles what io_setup asks (at least 4 per possible CPU), adds 2 and rounds
    // the ring up to whole pages; nr is what those pages hold. Asking (nr - 2) / 2 gives the
    // same pages.
    let ask = (r.nr.saturating_sub(2) / 2).max(1) as u64;
    // The old address is held by a placeholder meanwhile, so that the kernel cannot put the
    // new ring over part of it (mremap cannot move a mapping onto itself); the move replaces
    // it.
    inj.syscall(
        "mmap",
        libc::SYS_mmap,
        &[
            v.start,
            len,
            libc::PROT_NONE as u64,
            (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE)
                as u64,
            u64::MAX,
            0,
        ],
    )
    .map_err(|e| fail(format!("hold its address: {e}")))?;
    let ctx_at = inj.write_scratch(0, &0u64.to_le_bytes())?;
    inj.syscall("io_setup", libc::SYS_io_setup, &[ask, ctx_at])
        .map_err(|e| fail(format!("io_setup({ask}): {e}")))?;
    let made = u64::from_le_bytes(inj.read_scratch(0, 8)?.try_into().expect("8 bytes"));
    let mem = h.mem();
    let got = read_header(mem, pid, made, made + len)?;
    if got[1] != r.nr {
        let _ = inj.syscall("io_destroy", libc::SYS_io_destroy, &[made]);
        return Err(fail(format!(
            "this kernel makes a ring of {} slots for io_setup({ask}), the image's had {}",
            got[1], r.nr
        )));
    }
    // The ring moves to its old place, and the context with it (aio_ring_mremap): its id is
    // the old one again.
    inj.syscall(
        "mremap",
        libc::SYS_mremap,
        &[made, len, len, MREMAP_MAYMOVE | MREMAP_FIXED, v.start],
    )
    .map_err(|e| fail(format!("move the new ring from {made:x}: {e}")))?;
    let pending = (r.events.len() as u64) / EVENT;
    // The kernel keeps its own copy of the tail, where it writes the next completion: reads
    // of nothing from a pipe, completed at once, bring it to the old tail; the first `head` of
    // them are reaped (the ring's head follows), the last `pending` are left in the ring, so
    // that their slots count as taken, and are overwritten below with the old completions.
    let (rd, _wr) = ferry_sys::fdops::pipe2(libc::O_CLOEXEC)
        .ctx(pid, || "make a pipe for the AIO ring's reads".into())?;
    let fd = h.install_fd(&rd, None)?;
    let run = advance(h, v.start, fd as u64, r.head as u64, pending);
    let _ = inj.syscall("close", libc::SYS_close, &[fd as u64]);
    run.map_err(|e| fail(format!("bring its tail to {}: {e}", r.tail)))?;
    let slot = |i: u64| v.start + HEADER + i * EVENT;
    let first = pending.min((r.nr - r.head) as u64);
    let (a, b) = r.events.split_at((first * EVENT) as usize);
    mem.write_all(slot(r.head as u64), a).ctx(pid, || {
        format!("write the completions of {}", what(v.start, v.end))
    })?;
    if !b.is_empty() {
        mem.write_all(slot(0), b).ctx(pid, || {
            format!("write the completions of {}", what(v.start, v.end))
        })?;
    }
    let now = read_header(mem, pid, v.start, v.end)?;
    if now[2] != r.head || now[3] != r.tail {
        return Err(fail(format!(
            "its ring came back with head {} and tail {}, not {} and {}",
            now[2], now[3], r.head, r.tail
        )));
    }
    Ok(())
}

/// Completes `reap + keep` reads of nothing from descriptor `fd` of the husk on context `ctx`,
/// reaping the first `reap`.
fn advance(h: &Husk, ctx: u64, fd: u64, reap: u64, keep: u64) -> Result<()> {
    let inj = h.injector();
    // struct iocb: PREAD (opcode 0) of 0 bytes at offset 0 into the scratch page.
    let mut iocb = [0u8; 64];
    iocb[20..24].copy_from_slice(&(fd as u32).to_le_bytes());
    iocb[24..32].copy_from_slice(&inj.scratch(0).to_le_bytes());
    let iocb_at = inj.write_scratch(IOCB_AT, &iocb)?;
    let ptrs: Vec<u8> = (0..CHUNK).flat_map(|_| iocb_at.to_le_bytes()).collect();
    let ptrs_at = inj.write_scratch(PTRS_AT, &ptrs)?;
    let events_at = inj.scratch(EVENTS_AT);
    let total = reap + keep;
    let mut done = 0;
    while done < total {
        let n = if done < reap {
            CHUNK.min(reap - done)
        } else {
            CHUNK.min(total - done)
        };
        let got = inj.syscall("io_submit", libc::SYS_io_submit, &[ctx, n, ptrs_at])?;
        if got != n {
            return Err(Error::Restore {
                pid: h.pid,
                what: format!("io_submit took {got} of {n} reads"),
            });
        }
        if done < reap {
            let got = inj.syscall(
                "io_getevents",
                libc::SYS_io_getevents,
                &[ctx, n, n, events_at, 0],
            )?;
            if got != n {
                return Err(Error::Restore {
                    pid: h.pid,
                    what: format!("io_getevents reaped {got} of {n} reads"),
                });
            }
        }
        done += n;
    }
    Ok(())
}
