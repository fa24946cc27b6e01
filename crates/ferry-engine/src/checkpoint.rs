//! Capture: walks a frozen tree through every resource kind and streams the image.

use crate::error::Result;
use crate::freeze::FrozenTree;
use crate::objects::CaptureObjects;
use crate::pidview::PidView;
use crate::procfs;
use crate::resources::{files::FdCapture, jobctl, memory, process, signals, threads};
use ferry_image::{ImageWriter, Process, Source, Tree};
use ferry_inject::Injector;
use std::collections::HashMap;
use std::io::Write;
use std::time::Instant;

#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct CaptureReport {
    /// The processes, by our PIDs.
    pub pids: Vec<i32>,
    /// The same processes as the tree numbers them (in its own PID namespace), in the same order.
    pub tree_pids: Vec<i32>,
    /// The root as the tree numbers it (the image's `root_pid`).
    pub tree_root_pid: i32,
    pub threads: usize,
    pub pages_written: u64,
    pub zero_pages_skipped: u64,
    pub memory_bytes: u64,
    /// Bytes of memory left out because the restorer has them (`Process::inherited`).
    pub inherited_bytes: u64,
    /// Bytes of children's memory left out because it is their parent's, copy-on-write
    /// (`Process::cow`).
    pub cow_bytes: u64,
    pub image_bytes: u64,
    pub state_ms: f64,
    pub memory_ms: f64,
    /// The relayed pipes (`FrozenTree::relay_pipes`): for each, a process (our PID) and
    /// descriptor through which the tree holds it.
    pub relays: Vec<RelayedPipe>,
}

/// A pipe the tree shares with a process outside it, to be relayed from home.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct RelayedPipe {
    /// `Pipe::id` in the image.
    pub pipe: u32,
    /// A process of the tree (our PID) and its descriptor of the pipe.
    pub pid: i32,
    pub fd: i32,
    /// The tree holds the read end (data flows from home to the body); else the write end.
    pub body_reads: bool,
    /// A terminal at home (`pipe` is then `RELAY_TTY` and its pts number): relayed both ways.
    pub tty: bool,
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Captures everything about the frozen tree into `out`. The tree stays frozen.
pub fn capture<W: Write>(frozen: &FrozenTree, out: W) -> Result<(W, CaptureReport)> {
    capture_then(frozen, out, || Ok(()))
}

/// [`capture`], running `before_image` once the tree's state is captured and before any of
/// the image is written (a restore may act on the image as soon as its tree arrives).
pub fn capture_then<W: Write>(
    frozen: &FrozenTree,
    out: W,
    before_image: impl FnOnce() -> Result<()>,
) -> Result<(W, CaptureReport)> {
    capture_with(frozen, out, &HashMap::new(), None, before_image)
}

/// [`capture_then`], leaving out of the image the pages of `inherited` (by our PIDs: sorted,
/// disjoint ranges of pages the restorer has already and the process has not written since)
/// that still hold data of their own: the image names them as `Process::inherited` instead.
pub fn capture_with<W: Write>(
    frozen: &FrozenTree,
    out: W,
    inherited: &HashMap<i32, Vec<(u64, u64)>>,
    parent: Option<ferry_image::ParentImage>,
    before_image: impl FnOnce() -> Result<()>,
) -> Result<(W, CaptureReport)> {
    capture_keeping(
        frozen,
        out,
        &|host, _| inherited.get(&host).cloned(),
        None,
        false,
        false,
        parent,
        before_image,
    )
}

/// Which ranges of a process (by our PID, with the mappings the capture found) to leave out
/// of the image: sorted, disjoint; `None`, none.
pub type KeepRanges<'a> = &'a dyn Fn(i32, &[ferry_image::Vma]) -> Option<Vec<(u64, u64)>>;

/// [`capture_with`], the ranges to leave out chosen per process (by our PID) from the
/// mappings the capture found: a lazy migration leaves out every private anonymous mapping
/// ([`crate::lazy::source_ranges_of`]) without reading the mappings once more in the freeze.
/// `lazily` (a hybrid migration): of the pages left out, those inside these ranges stay at the
/// source for a page server (`Process::inherited_lazily`); the rest came ahead of the image.
/// With `no_cow`, pages a child shares copy-on-write with its parent are not looked for: each
/// process's pages are its own in the image, as before (a lazy migration of a tree whose
/// sharing was kept gave its children zeros for their shared pages: docs/limitations.md).
/// With `whole` (a lazy migration, whose source answers for the pages it holds none of:
/// `Msg::PageReply::holes`), the ranges left out are named whole as `Process::inherited`,
/// not walked in the freeze for their present pages.
#[allow(clippy::too_many_arguments)]
pub fn capture_keeping<W: Write>(
    frozen: &FrozenTree,
    out: W,
    keep: KeepRanges<'_>,
    lazily: Option<KeepRanges<'_>>,
    no_cow: bool,
    whole: bool,
    parent: Option<ferry_image::ParentImage>,
    before_image: impl FnOnce() -> Result<()>,
) -> Result<(W, CaptureReport)> {
    let t0 = Instant::now();
    let root = frozen.procs.first().map(|p| p.pid).unwrap_or(0);
    let mut tree = Tree {
        root_pid: root,
        source: Source {
            hostname: std::fs::read_to_string("/proc/sys/kernel/hostname")
                .unwrap_or_default()
                .trim()
                .to_string(),
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .unwrap_or_default()
                .trim()
                .to_string(),
            boot_id: procfs::boot_id(),
            captured_unix_ms: now_ms(),
        },
        ..Default::default()
    };
    // Refuse trees that span PID or time namespaces before anything else.
    let view = PidView::of(frozen)?;
    if frozen.relay_pipes {
        if let Some((pid, inner)) = view.first_renumbered(&[root]) {
            let (what, why) = crate::pidview::renumbered(pid, inner);
            return Err(crate::error::Error::Unsupported {
                pid,
                what: what.into(),
                why,
            });
        }
    }
    let mut objects = CaptureObjects::default();
    let mut fdcap = FdCapture::default();
    fdcap.tree_ids = frozen
        .procs
        .iter()
        .flat_map(|p| std::iter::once(p.pid).chain(p.threads.iter().map(|t| t.tid)))
        .collect();
    fdcap.tree_pids = frozen.procs.iter().map(|p| p.pid).collect();
    if frozen.relay_pipes {
        let pids: Vec<i32> = frozen.procs.iter().map(|p| p.pid).collect();
        fdcap.relay = crate::preflight::pipes_shared_outside(&pids);
        fdcap.relay_ttys = true;
    }
    fdcap.relay_standins = frozen.relay_standins.clone();
    let mut report = CaptureReport::default();
    // Stopped children whose parent has already collected their stop (by our PIDs).
    let mut stops_collected = std::collections::HashSet::new();
    // Children continued after a stop whose parent has not collected that (by our PIDs).
    let mut continues_uncollected = std::collections::HashSet::new();
    // Every live process's main thread gets its injector first, so that the 64 signal-action
    // queries run in all the processes at once (their stops overlapping); each injector
    // then serves the rest of its process's capture. Until then (or on an error) they stay
    // parked: a ferry killed meanwhile leaves every thread as it was.
    let mut leaders: HashMap<i32, (u64, Injector)> = HashMap::new();
    for fp in frozen.procs.iter().filter(|fp| !fp.zombie) {
        crate::cancel::check(&format!("capturing PID {}", fp.pid))?;
        // Signals arriving while the tree is frozen stay queued, to be captured as pending: a
        // thread in a ptrace stop takes none, and one running injected calls has them blocked.
        let host = fp.host();
        let syscall_at = ferry_inject::find_syscall_insn(host)?;
        let leader = &fp.threads[0];
        let inj = Injector::on_stack(host, leader.tid, leader.regs, syscall_at)?;
        leaders.insert(fp.pid, (syscall_at, inj));
    }
    let (mut actions, mut rlimits) = {
        let injs: Vec<(i32, &Injector)> = frozen
            .procs
            .iter()
            .filter_map(|fp| leaders.get(&fp.pid).map(|(_, inj)| (fp.host(), inj)))
            .collect();
        let pids = || {
            frozen
                .procs
                .iter()
                .filter(|fp| leaders.contains_key(&fp.pid))
                .map(|fp| fp.pid)
        };
        let actions: HashMap<i32, Vec<ferry_image::SigAction>> =
            pids().zip(signals::capture_actions(&injs)?).collect();
        let rlimits: HashMap<i32, Vec<ferry_image::Rlimit>> =
            pids().zip(process::capture_rlimits(&injs)?).collect();
        (actions, rlimits)
    };
    for fp in &frozen.procs {
        crate::cancel::check(&format!("capturing PID {}", fp.pid))?;
        report.pids.push(fp.pid);
        let mut p = Process {
            pid: fp.pid,
            ppid: fp.stat.ppid,
            pgid: fp.stat.pgid,
            sid: fp.stat.sid,
            comm: fp.stat.comm.clone(),
            exit_signal: fp.stat.exit_signal,
            ..Default::default()
        };
        if fp.zombie {
            p.zombie_status = Some(fp.stat.exit_code);
            tree.processes.push(p);
            continue;
        }
        report.threads += fp.threads.len();
        p.stop_signal = fp.stop_signal;
        p.files_shared_with_parent = shared_files(frozen, fp)?;
        p.stop_collected = stops_collected.contains(&fp.pid);
        p.continued_uncollected = continues_uncollected.contains(&fp.pid);
        // The thread the process is read through (a live one when its main thread exited).
        let host = fp.host();
        p.leader_exited = fp.leader_exited;
        if fp.leader_exited && fp.stop_signal.is_some() {
            return Err(crate::Error::Unsupported {
                pid: fp.pid,
                what: "stopped, with its main thread exited".into(),
                why: "the stop is remade through the main thread; not written yet".into(),
            });
        }
        let leader = &fp.threads[0];
        let (syscall_at, inj) = leaders
            .remove(&fp.pid)
            .expect("every live process has its main thread's injector");
        // A main thread that has exited no longer shows its address space in its stat.
        let stat = if fp.leader_exited {
            let mut st = procfs::task_stat(fp.pid, host)?;
            st.comm = fp.stat.comm.clone();
            st.exit_signal = fp.stat.exit_signal;
            st
        } else {
            fp.stat.clone()
        };
        process::capture(
            host,
            &stat,
            &inj,
            &mut p,
            rlimits.remove(&fp.pid).unwrap_or_default(),
        )?;
        p.pid = fp.pid;
        crate::resources::cgroups::capture(host, &mut p)?;
        for child in frozen
            .procs
            .iter()
            .filter(|c| c.stat.ppid == fp.pid && !c.zombie)
        {
            if child.stop_signal.is_some() {
                if jobctl::stop_collected(&inj, view.of_pid(child.pid))? {
                    stops_collected.insert(child.pid);
                }
            } else if jobctl::continue_uncollected(&inj, view.of_pid(child.pid))? {
                continues_uncollected.insert(child.pid);
            }
        }
        let tids: Vec<i32> = fp.threads.iter().map(|t| t.tid).collect();
        crate::resources::seccomp::capture(host, &tids, &mut p)?;
        signals::capture(
            host,
            &inj,
            &mut p,
            actions.remove(&fp.pid).unwrap_or_default(),
        )?;
        p.threads.push(threads::capture(host, leader, &inj)?);
        inj.finish()?;
        for t in &fp.threads[1..] {
            crate::cancel::check(&format!("capturing thread {}", t.tid))?;
            let inj = Injector::on_stack(host, t.tid, t.regs, syscall_at)?;
            p.threads.push(threads::capture(host, t, &inj)?);
            inj.finish()?;
        }
        let maps = match &frozen.premaps {
            Some(pre) => pre.mappings(fp.pid, host)?,
            None => procfs::smaps(host)?,
        };
        p.vmas = memory::capture(host, &maps, &mut objects)?;
        memory::check_memfd_exe(host, &p)?;
        p.fds = fdcap.capture(host, &mut tree, &mut objects)?;
        tree.processes.push(p);
    }
    refuse_orphaned_groups(&tree)?;
    fdcap.finish(&mut tree)?;
    crate::resources::sockets::check_ring_mappings(&tree)?;
    crate::resources::sockets::finish_capture(frozen, &mut tree)?;
    // A body moving on: its node's stand-in for a relayed pipe stands for the pipe at home,
    // whose inode its fstat answers (what its node's restore said: a names line without names).
    for p in tree.pipes.iter_mut().filter(|p| p.relay.is_some()) {
        if let Some(n) = frozen.relay_sockets.get(&p.ino).filter(|n| n.is_pipe()) {
            p.ino = n.home_ino;
        }
    }
    report.relays = relayed_pipes(&tree, &frozen.relay_standins)?;
    tree.shmem = objects.shmem.clone();
    tree.ghosts = objects.ghosts.clone();
    // Everything was captured with our PIDs; the image holds the tree's own.
    let hosts: Vec<i32> = frozen.procs.iter().map(|p| p.host()).collect();
    // What the files it holds or maps contain, for a restore on another machine.
    tree.digests = crate::digests::capture(&tree, &hosts);
    view.translate(&mut tree, frozen)?;
    report.tree_pids = tree.processes.iter().map(|p| p.pid).collect();
    report.tree_root_pid = tree.root_pid;
    // The last thing read while the tree is frozen: no clock reading it made can be later.
    tree.clocks = Some(crate::pidview::clocks_seen_by(root)?);
    report.state_ms = t0.elapsed().as_secs_f64() * 1e3;
    before_image()?;

    let t1 = Instant::now();
    let io = |e: std::io::Error| crate::Error::Io {
        pid: root,
        what: "write the image".into(),
        source: e,
    };
    // Pages a child still shares with its parent since a fork are stored once, the parent's.
    for i in 0..tree.processes.len() {
        let p = &tree.processes[i];
        if no_cow || p.zombie_status.is_some() || p.pid == tree.root_pid {
            continue;
        }
        let Some(j) = tree
            .processes
            .iter()
            .position(|q| q.pid == p.ppid && q.zombie_status.is_none())
        else {
            continue;
        };
        let cow = memory::cow_pages(hosts[i], &p.vmas, hosts[j], &tree.processes[j].vmas)?;
        report.cow_bytes += cow.iter().map(|(s, e)| e - s).sum::<u64>();
        tree.processes[i].cow = cow;
    }
    // Per process, the ranges left out of the image: every page in them is inherited or
    // shared copy-on-write with the parent, so the image's pages are not looked for there.
    let mut left_out: Vec<Vec<(u64, u64)>> = vec![Vec::new(); hosts.len()];
    for (i, &host) in hosts.iter().enumerate() {
        let p = &tree.processes[i];
        let kept = match p.zombie_status {
            None => keep(host, &p.vmas),
            Some(_) => None,
        };
        if let Some(keep) = kept {
            let inherited = if whole {
                keep.clone()
            } else {
                memory::inherited_pages(host, &p.vmas, &keep)?
            };
            left_out[i] = keep;
            let p = &mut tree.processes[i];
            p.inherited = memory::without(&inherited, &p.cow);
            report.inherited_bytes += p.inherited.iter().map(|(s, e)| e - s).sum::<u64>();
        }
        let p = &mut tree.processes[i];
        if let (Some(lazily), None) = (lazily, p.zombie_status) {
            let ranges = lazily(host, &p.vmas).unwrap_or_default();
            p.inherited_lazily = Some(memory::intersect(&p.inherited, &ranges));
        }
    }
    tree.parent = parent;
    let mut w = ImageWriter::new(out).map_err(io)?;
    w.write_tree(&tree).map_err(io)?;
    // Shared objects before memory (format version 2): a restore fills them before it maps
    // them, then streams memory into the processes.
    let object_bytes = objects.write_contents(&mut w).map_err(io)?;
    let mut stats = memory::PageStats::default();
    for ((p, host), left_out) in tree.processes.iter().zip(hosts).zip(&left_out) {
        if p.zombie_status.is_none() {
            memory::write_pages(host, p, left_out, &mut w, &mut stats)?;
        }
    }
    let (out, total) = w.finish().map_err(io)?;
    report.pages_written = stats.pages_written;
    report.zero_pages_skipped = stats.zero_pages_skipped;
    report.memory_bytes = stats.pages_written * ferry_sys::PAGE_SIZE + object_bytes;
    report.image_bytes = total;
    report.memory_ms = t1.elapsed().as_secs_f64() * 1e3;
    Ok((out, report))
}

/// For each relayed pipe, a descriptor through which the tree holds it (the tree still numbered
/// with our PIDs). A pipe the tree holds at both ends while a process outside holds it too
/// cannot be relayed (which end would the outsider's data be for?): refused.
fn relayed_pipes(tree: &Tree, standins: &HashMap<u64, u32>) -> Result<Vec<RelayedPipe>> {
    let mut out: Vec<RelayedPipe> = Vec::new();
    for pipe in tree.pipes.iter().filter(|p| p.relayed) {
        for p in &tree.processes {
            for f in &p.fds {
                let Some(d) = tree.files.get(f.file as usize) else {
                    continue;
                };
                if d.kind != (ferry_image::FileKind::Pipe { pipe: pipe.id }) {
                    continue;
                }
                let body_reads =
                    match d.flags & libc::O_ACCMODE {
                        libc::O_RDONLY => true,
                        libc::O_WRONLY => false,
                        _ => return Err(crate::Error::Unsupported {
                            pid: p.pid,
                            what: format!(
                                "fd {} (pipe:[{}]) open for reading and writing",
                                f.fd, pipe.ino
                            ),
                            why: "a pipe shared with a process outside the tree is relayed one way"
                                .into(),
                        }),
                    };
                match out.iter().find(|r| r.pipe == pipe.id) {
                    Some(r) if r.body_reads != body_reads => {
                        return Err(crate::Error::Unsupported {
                            pid: p.pid,
                            what: format!("fd {} (pipe:[{}])", f.fd, pipe.ino),
                            why: "the tree holds both ends of a pipe that a process outside it \
                                  holds too: which end that process's data is for cannot be told"
                                .into(),
                        })
                    }
                    Some(_) => {}
                    None => out.push(RelayedPipe {
                        pipe: pipe.id,
                        pid: p.pid,
                        fd: f.fd,
                        body_reads,
                        tty: false,
                    }),
                }
            }
        }
    }
    // A body's stand-ins for relays at its home (a body moving on) have their home ends there
    // already.
    out.retain(|r| {
        !tree
            .pipes
            .iter()
            .any(|p| p.id == r.pipe && p.relay.is_some())
    });
    // UNIX sockets connected to a process at home: one relay per socket description.
    for p in &tree.processes {
        for f in &p.fds {
            let Some(d) = tree.files.get(f.file as usize) else {
                continue;
            };
            let ferry_image::FileKind::Socket(s) = &d.kind else {
                continue;
            };
            let id = ferry_image::RELAY_SOCKET | d.id;
            // (A body's stand-in for a socket at home: its relay's home end is there.)
            if s.relayed && s.relay.is_none() && !out.iter().any(|r| r.pipe == id) {
                out.push(RelayedPipe {
                    pipe: id,
                    pid: p.pid,
                    fd: f.fd,
                    body_reads: false,
                    tty: false,
                });
            }
        }
    }
    // Terminals at home: one relay per terminal, however many descriptors reach it.
    for p in &tree.processes {
        for f in &p.fds {
            let Some(ferry_image::FileKind::Tty(t)) =
                tree.files.get(f.file as usize).map(|d| &d.kind)
            else {
                continue;
            };
            let id = ferry_image::RELAY_TTY | t.index;
            // A body's stand-in pty for its terminal at home (a body moving on): that relay's
            // home end is there already.
            let standin = standins.values().any(|&s| s == id);
            if t.relayed.is_some() && !standin && !out.iter().any(|r| r.pipe == id) {
                out.push(RelayedPipe {
                    pipe: id,
                    pid: p.pid,
                    fd: f.fd,
                    body_reads: false,
                    tty: true,
                });
            }
        }
    }
    Ok(out)
}

/// Whether `fp` shares its parent's descriptor table (CLONE_FILES without CLONE_THREAD). A
/// table shared with a process outside the tree, or with one of the tree other than the parent
/// (the parent since unshared it, or a sibling made by the same clone), cannot be rebuilt: a
/// process can only be made sharing the table of the process that makes it.
fn shared_files(frozen: &FrozenTree, fp: &crate::freeze::FrozenProc) -> Result<bool> {
    // Compared through live threads: a main thread that has exited holds no table.
    let host_of = |pid: i32| {
        frozen
            .procs
            .iter()
            .find(|q| q.pid == pid)
            .map(|q| q.host())
            .unwrap_or(pid)
    };
    let shares = |other: i32| {
        ferry_sys::fdops::kcmp_files(fp.host(), host_of(other)).map_err(|source| {
            crate::Error::Sys {
                pid: fp.pid,
                what: format!("compare its descriptor table with PID {other}'s (kcmp)"),
                source,
            }
        })
    };
    let in_tree = frozen.procs.iter().any(|q| q.pid == fp.stat.ppid);
    // (A parent that is gone or not ours to compare with shares nothing with us.)
    let parent_shares = fp.stat.ppid > 0 && shares(fp.stat.ppid).unwrap_or(false);
    if parent_shares && !in_tree {
        return Err(crate::Error::Unsupported {
            pid: fp.pid,
            what: format!(
                "its descriptor table is shared with its parent, PID {}, outside the tree",
                fp.stat.ppid
            ),
            why: "a table shared with a process that stays behind cannot be moved".into(),
        });
    }
    if !parent_shares {
        // A table the parent does not share was made for this process (fork, or unshare):
        // only its descendants, which come after it, can share it.
        for q in frozen
            .procs
            .iter()
            .take_while(|q| q.pid != fp.pid)
            .filter(|q| !q.zombie)
        {
            if shares(q.pid)? {
                return Err(crate::Error::Unsupported {
                    pid: fp.pid,
                    what: format!("its descriptor table is shared with PID {}", q.pid),
                    why: "only a table shared with the parent (CLONE_FILES) is rebuilt: a \
                          process is made sharing the table of the process that makes it"
                        .into(),
                });
            }
        }
    }
    Ok(parent_shares)
}

/// A session whose leader has left the tree (but still has members in it) cannot be
/// recreated: only its leader's own `setsid` makes a session, and its ID would have to belong
/// to a process that no longer exists. (A process group whose leader has left is made again
/// by a short-lived stand-in under the leader's PID: see `restore::join_session`.)
fn refuse_orphaned_groups(tree: &Tree) -> Result<()> {
    let root = &tree.processes[0];
    let pids: Vec<i32> = tree.processes.iter().map(|p| p.pid).collect();
    for p in &tree.processes[1..] {
        if !pids.contains(&p.sid) && p.sid != root.sid {
            return Err(crate::Error::Unsupported {
                pid: p.pid,
                what: format!("session {}", p.sid),
                why: format!("its leader, PID {}, is no longer part of the tree", p.sid),
            });
        }
    }
    Ok(())
}
