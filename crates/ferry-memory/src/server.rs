//! The page server of a lazy restore: one thread that answers the faults of every process of
//! a rebuilt tree from a [`PageSource`], follows their mapping changes, and pushes the pages
//! still owed until none is; then it closes the userfaultfds (pages the source never held are
//! then zero-filled by the kernel on first touch, as in any fresh anonymous mapping) and the
//! source is no longer needed.
//!
//! Faults come first: between two pieces of the push, every readable userfaultfd is drained.
//! A fault is answered with its page and up to [`Options::prefetch`] following pages the
//! source holds and the process still lacks, in one `UFFDIO_COPY` (which wakes every thread
//! waiting in that range: many threads faulting on one page are served once; a fault whose
//! page is already there, its message read after the copy, gets `EEXIST` and a wake).
//! A page with no data is answered with `UFFDIO_ZEROPAGE`.
//!
//! If the source cannot supply a page (a record fails its checksum, the link to a migration's
//! source is gone), every process of the tree and every process forked from it since is
//! killed with SIGKILL (a fault-blocked thread dies in its fault) and the error names the
//! process, the address and why: nothing is left waiting for a page that will never come.

use crate::cache::PageCache;
use crate::guard::Guardian;
use crate::ranges::{RangeMap, Src};
use crate::source::PageSource;
use ferry_engine::lazy::{LazyMemory, LazyProcess};
use ferry_image::Backing;
use ferry_sys::proc_mem::{vm_write, ProcMem};
use ferry_sys::uffd::{self, Msg};
use ferry_sys::PAGE_SIZE;
use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How a server serves.
#[derive(Debug, Clone)]
pub struct Options {
    /// Pages copied after the faulting one, when the source holds them and the process lacks
    /// them (Accent measured 1 as always worth it).
    pub prefetch: usize,
    /// The background push starts this long after the tree was handed over (until then only
    /// faults are served). Zero: at once.
    pub push_after: Duration,
    /// Bytes the background push asks for in one request.
    pub push_piece: usize,
    /// Bytes the background push keeps asked for and not yet received (requests pipelined
    /// to a remote source; faults' requests go out at once beside them).
    pub push_window: usize,
    /// The most pages one fault's window may grow to: a fault right after the previous one's
    /// window doubles it (a process reading its memory in sequence), any other starts again
    /// at `1 + prefetch` (no growth with `prefetch` 0).
    pub fault_window_max: usize,
    /// The ferry binary, to run the lazy phase's guardian ([`crate::guard`]); `None`: no
    /// guardian (the tree's memory then depends on this process staying alive).
    pub guardian: Option<std::path::PathBuf>,
    /// When set, the background push waits until this flag is raised (and `push_after` has
    /// passed): a migration's copy is held stopped until its source commits, and nothing is
    /// pushed for a copy that may yet be thrown away.
    pub push_gate: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
    /// The source supplies what the image names as inherited, the image carrying the rest
    /// ([`LazyMemory::serves_inherited`]: a lazy migration).
    pub serves_inherited: bool,
    /// Pages that came before the image (a hybrid migration's pre-copy rounds), which the
    /// server supplies itself to the ranges the restore names ([`LazyProcess::precopied`]),
    /// by fault and by push like the source's, but without asking the source: the tree runs
    /// before they are written, and the source is released once the pages only it holds are
    /// in ([`LazyServer::wait_released`]), while these may still be going in.
    pub precopied: Option<Arc<PageCache>>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            prefetch: 1,
            push_after: Duration::ZERO,
            push_piece: 256 << 10,
            push_window: 4 << 20,
            fault_window_max: 256,
            guardian: None,
            push_gate: None,
            serves_inherited: false,
            precopied: None,
        }
    }
}

/// What a server did, from the hand-over until the source was no longer needed.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct Stats {
    /// Processes handed over, and address spaces forked from them while pages were owed.
    pub processes: usize,
    pub forked: usize,
    /// Bytes the processes were owed when they were handed over.
    pub owed_bytes: u64,
    /// Fault messages read; of them, faults whose page was there already (another thread's
    /// fault, or the push, had brought it): woken without a copy.
    pub faults: u64,
    pub faults_already_served: u64,
    /// Faults whose page was already asked for (by the push or another fault's window):
    /// served by that answer, never asked again.
    pub faults_on_the_way: u64,
    /// Pages copied in answer to faults (the faulting pages and their prefetched neighbours),
    /// and by the background push.
    pub fault_pages: u64,
    pub pushed_pages: u64,
    /// Faults answered with the zero page (no data for that page).
    pub zero_pages: u64,
    /// Pages the source named as holes (it holds none of them: never present, or dropped),
    /// copied nowhere: they read as zeros.
    pub hole_pages: u64,
    pub remaps: u64,
    pub removes: u64,
    pub unmaps: u64,
    /// Time spent answering faults (from reading the message to the copy's wake), in all.
    pub fault_service_us: u64,
    /// Requests made to the source, the most outstanding at once, and the largest window a
    /// fault asked for (pages).
    pub asks: u64,
    pub max_asks_in_flight: u64,
    pub max_fault_window_pages: u64,
    /// Bytes of memory the source delivered, the pages written before the hand-over included
    /// (private pages of file mappings, the pages the kernel reads for others): each page once,
    /// unless an address space forked from another asked for it again.
    pub source_bytes: u64,
    /// From the hand-over until the last page was in and the source let go.
    pub dependency_ms: f64,
    /// Address spaces that ended (their process exited or was killed) still owed pages.
    pub ended_owing: u64,
    /// Of the pages the server held itself ([`Options::precopied`]): bytes the processes were
    /// owed at the hand-over, pages copied in answer to faults (with their neighbours) and by
    /// the push, and bytes still owed when the source was released (they went in after).
    pub local_owed_bytes: u64,
    pub local_fault_pages: u64,
    pub local_pushed_pages: u64,
    pub local_pending_bytes: u64,
    /// From the hand-over until the last of those was in (0 in the statistics given when the
    /// source was released, if some were still owed then).
    pub local_done_ms: f64,
}

/// One served address space.
struct Space {
    uffd: OwnedFd,
    /// Who it is, for messages: "PID 12" or "a process forked from PID 12".
    label: String,
    /// Where each registered range's contents come from.
    view: RangeMap,
    /// What the source holds that this address space still lacks, not yet asked for.
    owed: RangeMap,
    /// Asked for and not yet in: on its way, never asked for again.
    inflight: RangeMap,
    /// What it still lacks of the pages the server holds itself ([`Options::precopied`]: a
    /// hybrid migration's pre-copy rounds), copied in by fault and push, never asked of the
    /// source.
    local: RangeMap,
    /// Where the push of those goes on.
    local_cursor: u64,
    /// Where the push goes on in this space (where the last fault's window ended).
    cursor: u64,
    /// The last fault, the end of its window and the window's size in pages.
    last_fault: u64,
    fault_end: u64,
    window: u64,
    /// Ranges whose pages a forked child gets zeroed (MADV_WIPEONFORK in the image).
    wipe_on_fork: Vec<(u64, u64)>,
    /// Its process is gone.
    dead: bool,
}

impl Space {
    /// Its process is gone: nothing is owed to it any more.
    fn mark_dead(&mut self) {
        self.owed = RangeMap::default();
        self.inflight = RangeMap::default();
        self.local = RangeMap::default();
        self.dead = true;
    }

    /// Pages on their way to `[start, end)` that the process dropped or unmapped: no longer
    /// waited for; a thread blocked in a fault there is woken to fault again (and find the
    /// zero page, or its signal).
    fn forget_on_the_way(&mut self, start: u64, end: u64) {
        for (s, e, _) in self.inflight.remove(start, end) {
            let _ = uffd::wake(self.uffd.as_fd(), s, e - s);
        }
    }
}

/// A page server for [`ferry_engine::restore::RestoreOptions::lazy`]: [`LazyMemory::start`]
/// takes the tree's userfaultfds and starts the serving thread; [`LazyServer::wait`] returns
/// once the source is no longer needed.
pub struct LazyServer {
    source: Mutex<Option<Box<dyn PageSource>>>,
    opts: Options,
    /// The guardian, started with the server (before a migration's freeze: its start, an
    /// exec of the ferry binary, is then no part of it).
    guardian: Mutex<Option<Guardian>>,
    thread: Mutex<Option<JoinHandle<Result<Stats, String>>>>,
    handed_over: Mutex<Option<Instant>>,
    /// Told the statistics once the source is no longer needed.
    released: Mutex<Option<mpsc::Receiver<Stats>>>,
    released_tx: Mutex<Option<mpsc::Sender<Stats>>>,
}

impl std::fmt::Debug for LazyServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LazyServer")
            .field("opts", &self.opts)
            .finish()
    }
}

impl LazyServer {
    pub fn new(source: Box<dyn PageSource>, opts: Options) -> LazyServer {
        // One that fails to start now is tried again (and its error told) at the hand-over.
        let guardian = opts
            .guardian
            .as_ref()
            .and_then(|exe| Guardian::start(exe).ok());
        let (tx, rx) = mpsc::channel();
        LazyServer {
            source: Mutex::new(Some(source)),
            guardian: Mutex::new(guardian),
            opts,
            thread: Mutex::new(None),
            handed_over: Mutex::new(None),
            released: Mutex::new(Some(rx)),
            released_tx: Mutex::new(Some(tx)),
        }
    }

    /// Waits until every owed page is in (or the tree is gone): the source is then no longer
    /// needed. An error says why the tree was killed.
    pub fn wait(&self) -> Result<Stats, String> {
        let handle = self
            .thread
            .lock()
            .expect("not poisoned")
            .take()
            .ok_or("the page server was never started")?;
        handle
            .join()
            .unwrap_or_else(|_| Err("the page server thread panicked".into()))
    }

    /// Waits until the source is no longer needed: every page only it holds is in (the
    /// pre-copied pages the server holds itself may still be going in: [`Self::wait`] says
    /// when they are), or the tree is gone. Gives the statistics as they stood then. An error
    /// says why the tree was killed (and the server is then over).
    pub fn wait_released(&self) -> Result<Stats, String> {
        let rx = self.released.lock().expect("not poisoned").take();
        if let Some(stats) = rx.and_then(|rx| rx.recv().ok()) {
            return Ok(stats);
        }
        self.wait()
    }
}

impl LazyMemory for LazyServer {
    fn serves_inherited(&self) -> bool {
        self.opts.serves_inherited
    }

    fn serves_precopied(&self) -> bool {
        self.opts.serves_inherited && self.opts.precopied.is_some()
    }

    fn read_early(&self, pid: i32, addr: u64, buf: &mut [u8]) -> Result<(), String> {
        match self.source.lock().expect("not poisoned").as_mut() {
            Some(source) => source.read(pid, addr, buf),
            None => Err("the page server has started already".into()),
        }
    }

    fn start(&self, processes: Vec<LazyProcess>) -> Result<(), String> {
        let mut source = self
            .source
            .lock()
            .expect("not poisoned")
            .take()
            .ok_or("this page server was already started")?;
        let early = self.guardian.lock().expect("not poisoned").take();
        let mut guardian = match (early, &self.opts.guardian) {
            (Some(g), _) => Some(g),
            (None, Some(exe)) => Some(Guardian::start(exe)?),
            (None, None) => None,
        };
        let mut spaces = Vec::new();
        let mut pidfds = Vec::new();
        let mut stats = Stats {
            processes: processes.len(),
            ..Stats::default()
        };
        for p in processes {
            let mut view = RangeMap::default();
            let mut owed = RangeMap::default();
            for &(s, e) in &p.registered {
                view.insert(
                    s,
                    e,
                    Src::Image {
                        pid: p.pid,
                        addr: s,
                    },
                );
            }
            let mut eager = Vec::new();
            for (s, e) in source.extents(p.pid) {
                // The parts of the extent inside registered ranges are owed; the rest (private
                // pages of file mappings) are written now, before the process runs.
                let mut at = s;
                while at < e {
                    match view.get(at) {
                        Some((_, re, _)) => {
                            let to = re.min(e);
                            owed.insert(
                                at,
                                to,
                                Src::Image {
                                    pid: p.pid,
                                    addr: at,
                                },
                            );
                            at = to;
                        }
                        None => {
                            let next = view
                                .iter()
                                .map(|(rs, _, _)| rs)
                                .find(|&rs| rs > at)
                                .unwrap_or(e)
                                .min(e);
                            eager.push((at, next));
                            at = next;
                        }
                    }
                }
            }
            if let Some(g) = guardian.as_mut() {
                g.process(p.host_pid)?;
                g.uffd(&p.uffd)?;
            }
            write_eager(&mut *source, &p, &eager)?;
            stats.owed_bytes += owed.bytes();
            let mut local = RangeMap::default();
            if let Some(cache) = &self.opts.precopied {
                for &(s, e) in &p.precopied {
                    let one = crate::RangeSet::from_ranges([(s, e)]);
                    if let Some(a) = cache.missing(p.pid, &one) {
                        return Err(format!(
                            "PID {}: page {a:x}, which the image takes from the pre-copy \
                             rounds, never arrived",
                            p.pid
                        ));
                    }
                    local.insert(
                        s,
                        e,
                        Src::Image {
                            pid: p.pid,
                            addr: s,
                        },
                    );
                }
            }
            stats.local_owed_bytes += local.bytes();
            let wipe_on_fork = p
                .vmas
                .iter()
                .filter(|v| v.wipeonfork && matches!(v.backing, Backing::Anonymous))
                .map(|v| (v.start, v.end))
                .collect();
            spaces.push(Space {
                uffd: p.uffd,
                label: format!("PID {}", p.pid),
                view,
                owed,
                inflight: RangeMap::default(),
                local,
                local_cursor: 0,
                cursor: 0,
                last_fault: 0,
                fault_end: 0,
                window: 1,
                wipe_on_fork,
                dead: false,
            });
            pidfds.push((p.host_pid, p.pidfd));
            // Pages the kernel reads for others (arguments, environment) go in now: a remote
            // access to a missing page fails instead of waiting for us.
            let space = spaces.last_mut().expect("just pushed");
            for &(s, e) in &p.eager {
                fill_now(&mut *source, space, p.pid, s, e)?;
                if let Some(cache) = &self.opts.precopied {
                    fill_now_local(cache, space, p.pid, s, e)?;
                }
            }
        }
        if let Some(g) = guardian.as_mut() {
            g.sync()?;
        }
        let opts = self.opts.clone();
        let released = self.released_tx.lock().expect("not poisoned").take();
        let t0 = Instant::now();
        *self.handed_over.lock().expect("not poisoned") = Some(t0);
        let handle = std::thread::Builder::new()
            .name("ferry-pages".into())
            .spawn(move || {
                let mut s = Serving {
                    spaces,
                    source,
                    opts,
                    stats,
                    t0,
                    guardian,
                    asks: HashMap::new(),
                    push_in_flight: 0,
                    arrived: Vec::new(),
                    released,
                    local_next: 0,
                };
                let r = s.run();
                let guardian = s.guardian.take();
                if s.released.is_some() {
                    s.stats.source_bytes = s.source.bytes_delivered();
                    s.stats.dependency_ms = t0.elapsed().as_secs_f64() * 1e3;
                }
                let r = match r {
                    Ok(()) => Ok(std::mem::take(&mut s.stats)),
                    Err(e) => {
                        let killed = kill_tree(&pidfds);
                        Err(format!(
                            "{e}; the tree was killed ({} processes) rather than left waiting \
                             for memory that will not come",
                            killed
                        ))
                    }
                };
                // Our descriptors close first: nothing is owed, or the tree is dead.
                drop(s);
                if let Some(g) = guardian {
                    g.done();
                }
                r
            })
            .map_err(|e| format!("start the page server thread: {e}"))?;
        *self.thread.lock().expect("not poisoned") = Some(handle);
        Ok(())
    }
}

/// `pieces` (an answer's destinations in one address space: start, end and offset in the
/// answer to the request at `addr`) cut where they meet `holes` (the source's addresses,
/// sorted): each piece of a piece says whether it is a hole.
fn split_holes(
    addr: u64,
    pieces: &[(u64, u64, usize)],
    holes: &[(u64, u64)],
) -> Vec<(u64, u64, usize, bool)> {
    let mut out = Vec::new();
    for &(ds, de, off) in pieces {
        if holes.is_empty() {
            out.push((ds, de, off, false));
            continue;
        }
        // The piece in the source's addresses.
        let (ss, se) = (addr + off as u64, addr + off as u64 + (de - ds));
        let mut at = ss;
        for &(hs, he) in holes {
            let (hs, he) = (hs.max(ss), he.min(se));
            if hs >= he || he <= at {
                continue;
            }
            if hs > at {
                out.push((ds + (at - ss), ds + (hs - ss), (at - addr) as usize, false));
            }
            out.push((ds + (hs - ss), ds + (he - ss), (hs - addr) as usize, true));
            at = he;
        }
        if at < se {
            out.push((ds + (at - ss), de, (at - addr) as usize, false));
        }
    }
    out
}

/// Writes the image's pages that lie outside the registered ranges (private pages of file
/// mappings, which userfaultfd cannot serve) into the process, before it runs.
fn write_eager(
    source: &mut dyn PageSource,
    p: &LazyProcess,
    eager: &[(u64, u64)],
) -> Result<(), String> {
    if eager.is_empty() {
        return Ok(());
    }
    let mem =
        ProcMem::open(p.host_pid).map_err(|e| format!("PID {}: open its memory: {e}", p.pid))?;
    let mut buf = Vec::new();
    for &(s, e) in eager {
        let mut at = s;
        while at < e {
            let n = (e - at).min(4 << 20) as usize;
            buf.resize(n, 0);
            source.read(p.pid, at, &mut buf)?;
            let writable = p.vmas.iter().any(|v| {
                v.start <= at && at + n as u64 <= v.end && v.prot & libc::PROT_WRITE as u32 != 0
            });
            let done = if writable {
                vm_write(p.host_pid, at, &buf).unwrap_or(0)
            } else {
                0
            };
            if done < n {
                mem.write_all(at + done as u64, &buf[done..])
                    .map_err(|e| format!("PID {}: write memory at {at:x}: {e}", p.pid))?;
            }
            at += n as u64;
        }
    }
    Ok(())
}

/// Copies what `space` is owed in `[start, end)` at once (the process is not running yet).
fn fill_now(
    source: &mut dyn PageSource,
    space: &mut Space,
    pid: i32,
    start: u64,
    end: u64,
) -> Result<(), String> {
    for (s, e, src) in space.owed.remove(start, end) {
        let Src::Image { pid: from, addr } = src else {
            continue;
        };
        let mut buf = vec![0u8; (e - s) as usize];
        source.read(from, addr, &mut buf)?;
        copy_before_running(space, pid, s, &buf)?;
    }
    Ok(())
}

/// Copies `data` into `space` at `at` (the process is not running yet): pages already there
/// are passed over.
fn copy_before_running(space: &Space, pid: i32, at: u64, data: &[u8]) -> Result<(), String> {
    let mut done = 0;
    while done < data.len() {
        match uffd::copy(space.uffd.as_fd(), at + done as u64, &data[done..]) {
            Ok(n) if n > 0 => done += n,
            Err((err, n)) if err.errno == libc::EEXIST => done += n + PAGE as usize,
            Ok(_) => done += PAGE as usize,
            Err((err, _)) => {
                return Err(format!(
                    "PID {pid}: fill its memory at {:x}: {err}",
                    at + done as u64
                ))
            }
        }
    }
    Ok(())
}

/// Copies what `space` lacks of the pages the server holds itself in `[start, end)` at once
/// (the process is not running yet).
fn fill_now_local(
    cache: &PageCache,
    space: &mut Space,
    pid: i32,
    start: u64,
    end: u64,
) -> Result<(), String> {
    for (s, e, src) in space.local.remove(start, end) {
        let Src::Image { pid: from, addr } = src else {
            continue;
        };
        let mut at = s;
        while at < e {
            let run = cache
                .run(from, addr + (at - s), (e - at) as usize)
                .ok_or_else(|| format!("PID {pid}: the pre-copied page at {at:x} is missing"))?;
            copy_before_running(space, pid, at, run)?;
            at += run.len() as u64;
        }
    }
    Ok(())
}

/// Every process of the tree (by pidfd) and every process descended from them since, killed.
pub(crate) fn kill_tree(pidfds: &[(i32, OwnedFd)]) -> usize {
    // Descendants first collected, then all killed: a parent killed first would let its
    // children be adopted elsewhere, out of our sight.
    let mut all: Vec<i32> = Vec::new();
    let mut todo: Vec<i32> = pidfds.iter().map(|(p, _)| *p).collect();
    while let Some(pid) = todo.pop() {
        if all.contains(&pid) {
            continue;
        }
        all.push(pid);
        todo.extend(children_of(pid));
    }
    let mut n = 0;
    for (pid, fd) in pidfds {
        if ferry_sys::pidfd::pidfd_send_signal(fd, libc::SIGKILL).is_ok() {
            n += 1;
        }
        all.retain(|p| p != pid);
    }
    for pid in all {
        if let Ok(fd) = ferry_sys::pidfd::pidfd_open(pid) {
            if ferry_sys::pidfd::pidfd_send_signal(&fd, libc::SIGKILL).is_ok() {
                n += 1;
            }
        }
    }
    n
}

fn children_of(pid: i32) -> Vec<i32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|s| {
            s.split_whitespace()
                .filter_map(|w| w.parse().ok())
                .collect::<Vec<i32>>()
        })
        .collect()
}

/// The outcome of one copy into a range.
enum Fill {
    /// Done (pages already present skipped, their waiters woken).
    Done,
    /// The address space is changing (an event is waiting to be read): try again after it.
    Again,
    /// The range (or the whole address space) is gone.
    Gone { dead: bool },
}

/// A request to the source, outstanding or answered and not yet copied in everywhere.
#[derive(Debug, Clone, Copy)]
struct Ask {
    pid: i32,
    addr: u64,
    len: u64,
    /// The background push's (else a fault's window).
    push: bool,
    /// For a fault's: when the fault was read.
    fault_at: Option<Instant>,
}

struct Serving {
    spaces: Vec<Space>,
    source: Box<dyn PageSource>,
    opts: Options,
    stats: Stats,
    t0: Instant,
    guardian: Option<Guardian>,
    /// Outstanding requests, by number.
    asks: HashMap<u64, Ask>,
    /// Bytes the push has asked for and not yet received.
    push_in_flight: u64,
    /// Answers received whose pages are not yet in every address space waiting for them (a
    /// copy met a changing address space: tried again once its events are read).
    arrived: Vec<Arrived>,
    /// Told the statistics once the source is no longer needed (taken then).
    released: Option<mpsc::Sender<Stats>>,
    /// The space whose pre-copied pages the push copies next.
    local_next: usize,
}

/// An answer received: its request, its bytes, and the holes the source named in it (the
/// source's addresses: [`PageSource::take_holes`]).
type Arrived = (Ask, Vec<u8>, Vec<(u64, u64)>);

/// Bytes of pre-copied pages the push copies between two looks at the faults, and pages one
/// fault copies from them (its own and those after it).
const LOCAL_PIECE: u64 = 1 << 20;
const LOCAL_FAULT_PAGES: u64 = 32;

const PAGE: u64 = PAGE_SIZE;

/// The most push requests on their way at once, whatever their size. Owed memory in scattered
/// pages (a hybrid migration's: what was written after the last pre-copy round) makes one
/// small request per page; unbounded, thousands of them would fill the page link's socket
/// while its daemon, its own buffer full of their answers, waits for this server to read:
/// neither would ever move again.
const MAX_PUSH_ASKS: usize = 64;

impl Serving {
    fn run(&mut self) -> Result<(), String> {
        let mut next_push = 0usize;
        loop {
            // Address spaces whose process is gone (their descriptors close here).
            let before = self.spaces.len();
            self.spaces.retain(|s| !s.dead);
            self.stats.ended_owing += (before - self.spaces.len()) as u64;
            if self.asks.is_empty() && self.arrived.is_empty() {
                // Pages on their way with no request left for them (cannot happen; should it,
                // they are owed again rather than waited for in vain).
                for s in &mut self.spaces {
                    for (a, b, src) in s.inflight.remove(0, u64::MAX) {
                        s.owed.insert(a, b, src);
                    }
                }
                if self.spaces.iter().all(|s| s.owed.is_empty()) {
                    self.release();
                    if self.spaces.iter().all(|s| s.local.is_empty()) {
                        self.stats.local_done_ms = self.t0.elapsed().as_secs_f64() * 1e3;
                        return Ok(());
                    }
                }
            }
            let gate_open = self
                .opts
                .push_gate
                .as_ref()
                .is_none_or(|g| g.load(std::sync::atomic::Ordering::Acquire));
            let pushing = gate_open && self.t0.elapsed() >= self.opts.push_after;
            if pushing {
                next_push = self.push_more(next_push)?;
            }
            let local_work = pushing && self.spaces.iter().any(|s| !s.local.is_empty());
            let waiting = !self.asks.is_empty();
            let timeout = if !self.arrived.is_empty()
                || local_work
                || (waiting && self.source.ready_fd().is_none())
            {
                0
            } else if waiting {
                100
            } else if pushing {
                0
            } else if !gate_open {
                20
            } else {
                (self.opts.push_after.saturating_sub(self.t0.elapsed()))
                    .as_millis()
                    .clamp(1, 100) as i32
            };
            // (Once released, the source may go: its link's end is no news.)
            if !waiting && self.released.is_some() {
                self.source.check()?;
            }
            let mut fds: Vec<i32> = self.spaces.iter().map(|s| s.uffd.as_raw_fd()).collect();
            let nspaces = fds.len();
            if waiting {
                fds.extend(self.source.ready_fd());
            }
            let ready = ferry_sys::ns::poll_in(&fds, timeout)
                .map_err(|e| format!("wait for page faults: {e}"))?;
            let any = ready.iter().any(|r| *r);
            for i in (0..nspaces).rev() {
                if ready[i] {
                    self.drain(i)?;
                }
            }
            if !self.asks.is_empty() {
                self.collect()?;
            }
            self.apply_arrived()?;
            if local_work {
                self.push_local()?;
            }
            if !pushing && !any {
                self.find_dead();
            }
        }
    }

    /// Tells [`LazyServer::wait_released`] (once) that the source is no longer needed.
    fn release(&mut self) {
        if let Some(tx) = self.released.take() {
            self.stats.source_bytes = self.source.bytes_delivered();
            self.stats.dependency_ms = self.t0.elapsed().as_secs_f64() * 1e3;
            self.stats.local_pending_bytes = self.spaces.iter().map(|s| s.local.bytes()).sum();
            let _ = tx.send(self.stats.clone());
        }
    }

    /// Copies up to [`LOCAL_PIECE`] of what the spaces lack of the pre-copied pages (they
    /// take turns, each from where its push stands).
    fn push_local(&mut self) -> Result<(), String> {
        let n = self.spaces.len();
        for k in 0..n {
            let i = (self.local_next + k) % n;
            let sp = &self.spaces[i];
            if sp.dead {
                continue;
            }
            let Some((s, e, _)) = sp
                .local
                .at_or_after(sp.local_cursor)
                .or_else(|| sp.local.first())
            else {
                continue;
            };
            let from = if sp.local_cursor > s && sp.local_cursor < e {
                sp.local_cursor
            } else {
                s
            };
            let to = e.min(from + LOCAL_PIECE);
            let pages = self.fill_local(i, from, to)?;
            self.stats.local_pushed_pages += pages;
            self.spaces[i].local_cursor = to;
            self.local_next = i + 1;
            return Ok(());
        }
        Ok(())
    }

    /// Copies what space `i` lacks of the pre-copied pages in `[start, end)` from the pages
    /// the server holds; gives the pages copied, or `None` if the address space is changing
    /// (what is left stays owed, to be copied once its events are read).
    fn fill_local_at(&mut self, i: usize, start: u64, end: u64) -> Result<Option<u64>, String> {
        let Some(cache) = self.opts.precopied.clone() else {
            return Ok(Some(0));
        };
        let mut pages = 0;
        let mut taken = self.spaces[i].local.remove(start, end).into_iter();
        while let Some((s, e, src)) = taken.next() {
            let Src::Image { pid, addr } = src else {
                continue;
            };
            let mut at = s;
            while at < e {
                let run = cache
                    .run(pid, addr + (at - s), (e - at) as usize)
                    .ok_or_else(|| {
                        format!(
                            "{}: the pre-copied page at {at:x} (PID {pid}'s at {:x}) is missing",
                            self.spaces[i].label,
                            addr + (at - s)
                        )
                    })?;
                let (fill, done_to) = self.copy_data(i, at, run)?;
                pages += (done_to.saturating_sub(at)) / PAGE;
                match fill {
                    Fill::Done => at += run.len() as u64,
                    Fill::Again => {
                        // Owed again from where the copy stopped, with what was not reached.
                        let sp = &mut self.spaces[i];
                        sp.local.insert(done_to, e, src.at(done_to - s));
                        for (a, b, src) in taken {
                            sp.local.insert(a, b, src);
                        }
                        return Ok(None);
                    }
                    Fill::Gone { dead: true } => {
                        self.spaces[i].mark_dead();
                        return Ok(Some(pages));
                    }
                    Fill::Gone { dead: false } => at = done_to,
                }
            }
        }
        Ok(Some(pages))
    }

    /// [`Self::fill_local_at`] for the push: a changing address space leaves the rest owed.
    fn fill_local(&mut self, i: usize, start: u64, end: u64) -> Result<u64, String> {
        Ok(self.fill_local_at(i, start, end)?.unwrap_or(0))
    }

    /// Answers a fault at `page` of space `i`, which lacks that pre-copied page: it and the
    /// pre-copied pages after it (up to [`LOCAL_FAULT_PAGES`]) are copied at once from the
    /// pages the server holds. False: try again (the address space changes).
    fn fault_local(&mut self, i: usize, page: u64) -> Result<bool, String> {
        let t = Instant::now();
        let (_, e, _) = self.spaces[i].local.get(page).expect("the caller found it");
        let end = e.min(page + LOCAL_FAULT_PAGES * PAGE);
        match self.fill_local_at(i, page, end)? {
            Some(pages) => {
                self.stats.local_fault_pages += pages;
                self.stats.fault_service_us += t.elapsed().as_micros() as u64;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Takes the answers that have arrived.
    fn collect(&mut self) -> Result<(), String> {
        let mut got = Vec::new();
        self.source.answers(&mut got).map_err(|e| {
            format!(
                "memory owed to the tree cannot be supplied ({} requests outstanding): {e}",
                self.asks.len()
            )
        })?;
        for (id, data) in got {
            // An answer to a request asked again comes twice: the second finds none.
            let Some(a) = self.asks.remove(&id) else {
                continue;
            };
            if a.push {
                self.push_in_flight -= a.len;
            }
            if data.len() as u64 != a.len {
                return Err(format!(
                    "{} bytes came for PID {}'s memory at {:x} ({} asked)",
                    data.len(),
                    a.pid,
                    a.addr,
                    a.len
                ));
            }
            let holes = self.source.take_holes(id);
            self.arrived.push((a, data, holes));
        }
        Ok(())
    }

    /// Copies what has arrived into every address space waiting for it.
    fn apply_arrived(&mut self) -> Result<(), String> {
        for (a, data, holes) in std::mem::take(&mut self.arrived) {
            if self.apply(&a, &data, &holes)? {
                if let Some(t) = a.fault_at {
                    self.stats.fault_service_us += t.elapsed().as_micros() as u64;
                }
            } else {
                self.arrived.push((a, data, holes));
            }
        }
        Ok(())
    }

    /// Copies the answer to `a` wherever its pages are on their way (a range moved by
    /// mremap since is found at its new place, a forked child gets them too, a range
    /// unmapped or dropped since is no longer waited for). False: a copy met a changing
    /// address space, to be tried again once its events are read. `holes` (the source's
    /// addresses): pages the source holds none of, copied nowhere: no longer on their way,
    /// a thread waiting there is woken and its fault answered with the zero page.
    fn apply(&mut self, a: &Ask, data: &[u8], holes: &[(u64, u64)]) -> Result<bool, String> {
        let mut complete = true;
        for j in 0..self.spaces.len() {
            if self.spaces[j].dead {
                continue;
            }
            let pieces: Vec<(u64, u64, usize)> = self.spaces[j]
                .inflight
                .iter()
                .filter_map(|(s, e, src)| match src {
                    Src::Image { pid, addr } if pid == a.pid => {
                        let lo = addr.max(a.addr);
                        let hi = (addr + (e - s)).min(a.addr + a.len);
                        (lo < hi)
                            .then(|| (s + (lo - addr), s + (hi - addr), (lo - a.addr) as usize))
                    }
                    _ => None,
                })
                .collect();
            let pieces = split_holes(a.addr, &pieces, holes);
            'pieces: for (ds, de, off, hole) in pieces {
                if hole {
                    self.spaces[j].forget_on_the_way(ds, de);
                    self.stats.hole_pages += (de - ds) / PAGE;
                    continue;
                }
                let mut at = ds;
                while at < de {
                    let from = off + (at - ds) as usize;
                    let (fill, done_to) =
                        self.copy_data(j, at, &data[from..off + (de - ds) as usize])?;
                    self.spaces[j].inflight.remove(at, done_to);
                    match fill {
                        Fill::Done => break,
                        Fill::Again => {
                            complete = false;
                            break;
                        }
                        Fill::Gone { dead: true } => {
                            self.spaces[j].mark_dead();
                            break 'pieces;
                        }
                        // One page gone (a hole unmapped in the middle): the rest goes on.
                        Fill::Gone { dead: false } => at = done_to,
                    }
                }
            }
        }
        Ok(complete)
    }

    /// Marks the address spaces whose process is gone (while the push waits, nothing else
    /// would notice: the kernel says nothing on a userfaultfd when its process exits). The
    /// probe is a zero page at the lowest address a mapping may have; where the space has
    /// nothing registered there it can only fail, with ESRCH once the process is gone.
    fn find_dead(&mut self) {
        const PROBE: u64 = 0x10000;
        for s in &mut self.spaces {
            if (s.owed.is_empty() && s.inflight.is_empty() && s.local.is_empty())
                || s.view.get(PROBE).is_some()
            {
                continue;
            }
            if let Err((e, _)) = uffd::zeropage(s.uffd.as_fd(), PROBE, PAGE) {
                if e.errno == libc::ESRCH {
                    s.mark_dead();
                }
            }
        }
    }

    /// Reads and handles every message waiting on space `i` (faults retried until served).
    fn drain(&mut self, i: usize) -> Result<(), String> {
        let mut queue: VecDeque<Msg> = VecDeque::new();
        let mut msgs = Vec::new();
        let mut idle_rounds = 0;
        loop {
            msgs.clear();
            if i >= self.spaces.len() {
                return Ok(());
            }
            let n = uffd::read_msgs(self.spaces[i].uffd.as_fd(), &mut msgs)
                .map_err(|e| format!("{}: read its userfaultfd: {e}", self.spaces[i].label))?;
            queue.extend(msgs.drain(..));
            if queue.is_empty() {
                return Ok(());
            }
            let mut retry = VecDeque::new();
            while let Some(m) = queue.pop_front() {
                if let Some(m) = self.handle(i, m)? {
                    retry.push_back(m);
                }
            }
            if retry.is_empty() {
                if n == 0 {
                    return Ok(());
                }
                continue;
            }
            // A fault met a changing address space: its event is about to be queued.
            idle_rounds = if n == 0 { idle_rounds + 1 } else { 0 };
            if idle_rounds > 0 {
                std::thread::sleep(Duration::from_micros(50));
            }
            queue = retry;
        }
    }

    /// Handles one message of space `i`; gives back a fault to retry.
    fn handle(&mut self, i: usize, m: Msg) -> Result<Option<Msg>, String> {
        match m {
            Msg::Pagefault { address, .. } => {
                if self.fault(i, address & !(PAGE - 1))? {
                    self.stats.faults += 1;
                    Ok(None)
                } else {
                    Ok(Some(m))
                }
            }
            Msg::Fork { child } => {
                let parent = &self.spaces[i];
                let mut view = parent.view.clone();
                let mut owed = parent.owed.clone();
                let mut inflight = parent.inflight.clone();
                let mut local = parent.local.clone();
                for &(s, e) in &parent.wipe_on_fork {
                    view.remove(s, e);
                    owed.remove(s, e);
                    inflight.remove(s, e);
                    local.remove(s, e);
                }
                let label = if parent.label.starts_with("a process forked from") {
                    parent.label.clone()
                } else {
                    format!("a process forked from {}", parent.label)
                };
                let wipe_on_fork = parent.wipe_on_fork.clone();
                if let Some(g) = self.guardian.as_mut() {
                    g.uffd(&child)?;
                }
                self.spaces.push(Space {
                    uffd: child,
                    label,
                    view,
                    owed,
                    inflight,
                    local,
                    local_cursor: 0,
                    cursor: 0,
                    last_fault: 0,
                    fault_end: 0,
                    window: 1,
                    wipe_on_fork,
                    dead: false,
                });
                self.stats.forked += 1;
                Ok(None)
            }
            Msg::Remap { from, to, len } => {
                let s = &mut self.spaces[i];
                s.view.remap(from, to, len);
                s.owed.remap(from, to, len);
                s.inflight.remap(from, to, len);
                s.local.remap(from, to, len);
                self.stats.remaps += 1;
                Ok(None)
            }
            Msg::Remove { start, end } => {
                let s = &mut self.spaces[i];
                // Private anonymous pages dropped read as zeros from now on.
                if s.view.get(start).is_some() || !s.view.remove(start, end).is_empty() {
                    s.view.insert(start, end, Src::Zero);
                }
                s.owed.remove(start, end);
                s.local.remove(start, end);
                s.forget_on_the_way(start, end);
                self.stats.removes += 1;
                Ok(None)
            }
            Msg::Unmap { start, end } => {
                let s = &mut self.spaces[i];
                s.view.remove(start, end);
                s.owed.remove(start, end);
                s.local.remove(start, end);
                s.forget_on_the_way(start, end);
                self.stats.unmaps += 1;
                Ok(None)
            }
            Msg::Other(e) => {
                log::warn!("{}: unknown userfaultfd event {e:#x}", self.spaces[i].label);
                Ok(None)
            }
        }
    }

    /// Answers a fault at `page` of space `i`: a page on its way is left to its answer (whose
    /// copy wakes every thread waiting there); an owed page is asked for with a window of
    /// the owed pages after it, which doubles while the faults go on in sequence (up to
    /// [`Options::fault_window_max`]); a page with no data gets the zero page. False: try
    /// again (the address space changes).
    fn fault(&mut self, i: usize, page: u64) -> Result<bool, String> {
        if self.spaces[i].inflight.get(page).is_some() {
            self.stats.faults_on_the_way += 1;
            return Ok(true);
        }
        if self.spaces[i].local.get(page).is_some() {
            return self.fault_local(i, page);
        }
        if self.spaces[i].owed.get(page).is_none() {
            return Ok(match self.zero(i, page) {
                Fill::Done => true,
                Fill::Again => false,
                Fill::Gone { dead } => {
                    if dead {
                        self.spaces[i].mark_dead();
                    }
                    true
                }
            });
        }
        let first = 1 + self.opts.prefetch as u64;
        let max = if self.opts.prefetch == 0 {
            1
        } else {
            first.max(self.opts.fault_window_max as u64)
        };
        let s = &mut self.spaces[i];
        let in_sequence = page >= s.last_fault && page <= s.fault_end + s.window * PAGE;
        s.window = if in_sequence {
            (s.window * 2).min(max)
        } else {
            first
        };
        s.last_fault = page;
        s.fault_end = page + s.window * PAGE;
        // The push goes on from here: what the process touches next is likely near.
        s.cursor = s.fault_end;
        let (end, window) = (s.fault_end, s.window);
        self.stats.max_fault_window_pages = self.stats.max_fault_window_pages.max(window);
        let pages = self.ask_range(i, page, end, Some(Instant::now()), false)?;
        self.stats.fault_pages += pages;
        Ok(true)
    }

    /// Asks the source for what space `i` is owed in `[start, end)` (in requests of at most
    /// the source's limit), which is then on its way, never asked for again; gives the pages
    /// asked.
    fn ask_range(
        &mut self,
        i: usize,
        start: u64,
        end: u64,
        fault_at: Option<Instant>,
        push: bool,
    ) -> Result<u64, String> {
        let max = (self.source.max_ask() as u64).max(PAGE) & !(PAGE - 1);
        let mut pages = 0;
        for (s, e, src) in self.spaces[i].owed.remove(start, end) {
            let Src::Image { pid, addr } = src else {
                continue;
            };
            self.spaces[i].inflight.insert(s, e, src);
            let mut at = 0;
            while at < e - s {
                let len = (e - s - at).min(max);
                let id = self
                    .source
                    .ask(pid, addr + at, len as usize)
                    .map_err(|err| {
                        format!(
                            "{}: its memory at {:x}-{:x} cannot be supplied: {err}",
                            self.spaces[i].label,
                            s + at,
                            s + at + len
                        )
                    })?;
                self.asks.insert(
                    id,
                    Ask {
                        pid,
                        addr: addr + at,
                        len,
                        push,
                        fault_at,
                    },
                );
                if push {
                    self.push_in_flight += len;
                }
                self.stats.asks += 1;
                at += len;
            }
            pages += (e - s) / PAGE;
        }
        self.stats.max_asks_in_flight = self.stats.max_asks_in_flight.max(self.asks.len() as u64);
        Ok(pages)
    }

    /// Copies `buf` into space `i` at `start`; gives how it ended and how far it got (the
    /// end of what was copied or found present; past the page that is gone, for a range
    /// with a hole).
    fn copy_data(&mut self, i: usize, start: u64, buf: &[u8]) -> Result<(Fill, u64), String> {
        let len = buf.len();
        let end = start + len as u64;
        let fd = self.spaces[i].uffd.as_fd();
        let mut done = 0usize;
        // A copy must lie within one mapping (else ENOENT): a range that spans two (split by
        // mprotect, munmap or mremap since) is halved until a piece fits.
        let mut span = len;
        let outcome = loop {
            if done >= len {
                break Fill::Done;
            }
            span = span.min(len - done);
            let at = start + done as u64;
            match uffd::copy(fd, at, &buf[done..done + span]) {
                Ok(n) if n > 0 => {
                    done += n;
                    span = len;
                }
                Ok(_) => {
                    let _ = uffd::wake(fd, at, PAGE);
                    done += PAGE as usize;
                }
                Err((e, n)) if e.errno == libc::EEXIST => {
                    let p = at + n as u64;
                    let _ = uffd::wake(fd, p, PAGE);
                    done += n + PAGE as usize;
                    span = len;
                }
                // Part done, then a page already there (the kernel says EAGAIN with the part):
                // go on from there.
                Err((e, n)) if e.errno == libc::EAGAIN && n > 0 => {
                    done += n;
                    span = len;
                }
                Err((e, _)) if e.errno == libc::EAGAIN => break Fill::Again,
                Err((e, _)) if e.errno == libc::ESRCH => break Fill::Gone { dead: true },
                Err((e, n)) if e.errno == libc::ENOENT || e.errno == libc::EFAULT => {
                    if n > 0 {
                        done += n;
                        continue;
                    }
                    if span > PAGE as usize {
                        span = (span / 2) & !(PAGE as usize - 1);
                        continue;
                    }
                    // No mapping at this page any more (its event is on its way).
                    let _ = uffd::wake(fd, at, PAGE);
                    break Fill::Gone { dead: false };
                }
                Err((e, _)) => {
                    return Err(format!(
                        "{}: fill its memory at {at:x}: {e}",
                        self.spaces[i].label
                    ));
                }
            }
        };
        let done_to = match outcome {
            Fill::Gone { dead: true } => end,
            // Only the page that is gone: the rest of the range may still be mapped (a hole
            // unmapped in its middle), and its own event will say what left.
            Fill::Gone { dead: false } => (start + done as u64 + PAGE).min(end),
            _ => start + (done as u64).min(len as u64),
        };
        Ok((outcome, done_to))
    }

    fn zero(&mut self, i: usize, page: u64) -> Fill {
        let fd = self.spaces[i].uffd.as_fd();
        match uffd::zeropage(fd, page, PAGE) {
            Ok(_) => {
                self.stats.zero_pages += 1;
                Fill::Done
            }
            Err((e, _)) if e.errno == libc::EEXIST => {
                let _ = uffd::wake(fd, page, PAGE);
                self.stats.faults_already_served += 1;
                Fill::Done
            }
            Err((e, _)) if e.errno == libc::EAGAIN => Fill::Again,
            Err((e, _)) if e.errno == libc::ESRCH => Fill::Gone { dead: true },
            Err(_) => {
                let _ = uffd::wake(fd, page, PAGE);
                Fill::Gone { dead: false }
            }
        }
    }

    /// Asks for pieces of what the spaces are still owed (they take turns from `next`, each
    /// from where its push stands) until [`Options::push_window`] bytes are on their way.
    fn push_more(&mut self, mut next: usize) -> Result<usize, String> {
        let window = (self.opts.push_window.max(self.opts.push_piece)) as u64;
        let mut asks = self.asks.values().filter(|a| a.push).count();
        while self.push_in_flight < window && asks < MAX_PUSH_ASKS {
            let n = self.spaces.len();
            let mut asked = false;
            for k in 0..n {
                let i = (next + k) % n;
                let sp = &self.spaces[i];
                if sp.dead {
                    continue;
                }
                let Some((s, e, _)) = sp.owed.at_or_after(sp.cursor).or_else(|| sp.owed.first())
                else {
                    continue;
                };
                let from = if sp.cursor > s && sp.cursor < e {
                    sp.cursor
                } else {
                    s
                };
                let to = e.min(from + self.opts.push_piece.max(PAGE as usize) as u64);
                let before = self.asks.len();
                let pages = self.ask_range(i, from, to, None, true)?;
                asks += self.asks.len() - before;
                self.stats.pushed_pages += pages;
                self.spaces[i].cursor = to;
                next = i + 1;
                asked = true;
                break;
            }
            if !asked {
                break;
            }
        }
        Ok(next)
    }
}
