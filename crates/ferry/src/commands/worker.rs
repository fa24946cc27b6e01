//! Engine workers: the daemon's hands. Each runs in its own single-threaded `ferry` process,
//! the only tracer of its tree, and talks to its daemon in frames over stdin and stdout (see
//! ferry_daemon::workers). If the daemon goes away, a worker backs out: a capture worker thaws
//! the tree, a restore worker kills what it built.

use anyhow::{Context, Result};
use ferry_engine::checkpoint::capture_keeping;
use ferry_engine::freeze::FrozenTree;
use ferry_engine::leases::WriteLeasesAside;
use ferry_engine::names::SocketFilesAside;
use ferry_transport::frame::blocking::{read_frame, write_end, write_msg, DataReader, DataWriter};
use ferry_transport::{Frame, Msg};
use std::io::{BufWriter, Write};
use std::time::Instant;

pub(crate) fn next_command(input: &mut impl std::io::Read) -> Option<Msg> {
    match read_frame(input) {
        Ok(Frame::Msg(m)) => Some(m),
        other => {
            log::debug!("worker: no command: {other:?}");
            None
        }
    }
}

fn fail(out: &mut impl Write, e: &anyhow::Error) -> Result<()> {
    write_msg(
        out,
        &Msg::Error {
            message: format!("{e:#}"),
        },
    )?;
    Ok(())
}

/// Resident memory of the tree rooted at `pid` (for the destination's admission check), and the
/// root's owner and command line.
fn describe_tree(pid: i32) -> Result<(u64, u32, String)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("PID {pid} does not exist"))?;
    let uid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let command = cmdline
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect::<Vec<_>>()
        .join(" ");
    let mut rss = 0u64;
    let mut todo = vec![pid];
    while let Some(p) = todo.pop() {
        if let Ok(s) = std::fs::read_to_string(format!("/proc/{p}/status")) {
            rss += s
                .lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
                .unwrap_or(0)
                * 1024;
        }
        if let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) {
            for t in tasks.flatten() {
                let children =
                    std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
                todo.extend(
                    children
                        .split_whitespace()
                        .filter_map(|c| c.parse::<i32>().ok()),
                );
            }
        }
    }
    Ok((rss, uid, command))
}

/// For a user (`owner`): the tree rooted at `pid` is theirs as it is now.
pub(crate) fn owned(pid: i32, owner: Option<&ferry_sys::owner::Owner>) -> Result<()> {
    match owner {
        Some(o) => Ok(ferry_engine::owner::check_live(
            pid,
            o,
            "move or checkpoint",
        )?),
        None => Ok(()),
    }
}

/// For a user (`owner`): every process of the frozen tree is theirs.
pub(crate) fn owned_frozen(
    frozen: &FrozenTree,
    owner: Option<&ferry_sys::owner::Owner>,
) -> Result<()> {
    match owner {
        Some(o) => {
            let pids: Vec<i32> = frozen.procs.iter().map(|p| p.pid).collect();
            Ok(ferry_engine::owner::check_pids(
                &pids,
                o,
                "move or checkpoint",
            )?)
        }
        None => Ok(()),
    }
}

/// Whether the tree of `pid` (a body) could be rebuilt at its home in place of its deputies
/// (`MigrateOffer::in_place`): every process root (the rebuild runs in the deputy, whose
/// credentials are the process's), running (not stopped), its root directory the namespace's,
/// and holding no socket (SO_PEERCRED would name the restorer's helper: the deputy holds the
/// PID) and no terminal.
fn rebuilt_in_place(pid: i32) -> bool {
    let mut todo = vec![pid];
    while let Some(p) = todo.pop() {
        let Ok(status) = std::fs::read_to_string(format!("/proc/{p}/status")) else {
            return false;
        };
        let field = |key: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(key))
                .unwrap_or("")
                .to_string()
        };
        let root_ids = |key: &str| field(key).split_whitespace().all(|v| v == "0");
        let state = field("State:");
        if !root_ids("Uid:")
            || !root_ids("Gid:")
            || state.trim_start().starts_with(['T', 't'])
            || std::fs::read_link(format!("/proc/{p}/root")).ok() != Some("/".into())
        {
            return false;
        }
        let Ok(fds) = std::fs::read_dir(format!("/proc/{p}/fd")) else {
            return false;
        };
        for fd in fds.flatten() {
            let link = std::fs::read_link(fd.path()).unwrap_or_default();
            let link = link.to_string_lossy();
            if link.starts_with("socket:") || link.starts_with("/dev/pts") || link == "/dev/ptmx" {
                return false;
            }
        }
        if let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) {
            for t in tasks.flatten() {
                let children =
                    std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
                todo.extend(
                    children
                        .split_whitespace()
                        .filter_map(|c| c.parse::<i32>().ok()),
                );
            }
        }
    }
    true
}

/// The TracerPid of `pid`; None if it is gone.
pub(crate) fn tracer_of(pid: i32) -> Option<i32> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("TracerPid:"))?
        .trim()
        .parse()
        .ok()
}

/// `ferry __capture-worker PID [--relay-pipes] --memory MODE [--owner U] [--deputies-dir
/// DIR] [--pages-fd N]`: with `relay_pipes` (a tree leaving its home), pipes it shares with
/// processes outside it are captured to be relayed, not refused; `memory` says how memory
/// moves (eager, precopy, lazy, auto); `owner`: the user the tree is moved for;
/// `deputies_dir`: where the tree's deputies, should it leave its home, wait for a restarted
/// daemon (`DIR/PID.sock`; see `serve_deputies`). A lazy migration's private anonymous memory
/// stays out of the image and is served over the page link (`pages_fd`, see
/// [`super::pages`]) until the destination has it all. `relay_standins` (a body moving on,
/// `--relay-standin INO:ID`): its node's stand-in pipes for relays to its home, captured as
/// relayed with their buffered bytes (`FrozenTree::relay_standins`). `auto_hybrid_ok`: `auto`
/// may choose hybrid (not for a tree going home: see the daemon's `send`).
#[allow(clippy::too_many_arguments)]
pub fn capture_worker(
    pid: i32,
    relay_pipes: bool,
    memory: &str,
    owner: Option<&ferry_sys::owner::Owner>,
    deputies_dir: Option<std::path::PathBuf>,
    pages_fd: Option<i32>,
    auto_lazy: Option<(f64, f64)>,
    auto_hybrid_ok: bool,
    relay_standins: std::collections::HashMap<u64, u32>,
    relay_sockets: std::collections::HashMap<u64, ferry_engine::resources::sockets::RelayedNames>,
) -> Result<()> {
    ferry_sys::process::set_parent_death_signal(libc::SIGTERM).context("watch the daemon")?;
    let cancel = ferry_engine::cancel::flag();
    for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
        signal_hook::flag::register(sig, cancel.clone()).context("install signal handlers")?;
    }
    let mut input = std::io::stdin().lock();
    let mut out = BufWriter::with_capacity(1 << 20, std::io::stdout().lock());
    let asked_lazy = memory == "lazy";
    let asked_hybrid = memory == "hybrid";
    let link = match pages_fd.map(super::pages::take_link).transpose() {
        Ok(l) => l,
        Err(e) => return fail(&mut out, &e),
    };
    if (asked_lazy || asked_hybrid) && link.is_none() {
        return fail(
            &mut out,
            &anyhow::anyhow!("--memory {memory} needs a page link"),
        );
    }
    let checked = owned(pid, owner)
        .and_then(|()| describe_tree(pid))
        .and_then(|d| {
            ferry_engine::preflight::check_with(pid, relay_pipes, &relay_standins)
                .with_context(|| format!("cannot move PID {pid}"))?;
            if asked_lazy || asked_hybrid {
                ferry_engine::lazy::preflight(pid)
                    .map_err(|e| anyhow::anyhow!("cannot move PID {pid} lazily: {e}"))?;
            }
            Ok(d)
        });
    let (memory_bytes, uid, command) = match checked {
        Ok(x) => x,
        Err(e) => return fail(&mut out, &e),
    };
    // The contents of its files, hashed while it still runs (not in the freeze).
    ferry_engine::digests::warm(pid);
    // Its mappings' flags, read while it still runs (not in the freeze, where smaps would walk
    // every page): checked in the freeze, read again where they may have changed.
    let mut premaps = Some(ferry_engine::premaps::PreMaps::take(pid));
    // `auto` moves lazily what an eager move would freeze too long (docs: ARCHITECTURE.md,
    // "Choosing how memory moves").
    let (auto_lazy, auto_hybrid) = match auto_lazy {
        Some((link_bps, above_ms)) if memory == "auto" && link.is_some() => {
            match super::precopy::auto_lazy(pid, memory_bytes, link_bps, above_ms) {
                Some(why) => (Some(why), None),
                None if auto_hybrid_ok => (
                    None,
                    super::precopy::auto_hybrid(pid, memory_bytes, link_bps),
                ),
                None => (None, None),
            }
        }
        _ => (None, None),
    };
    // Pre-copy rounds, then the rest lazily.
    let hybrid = asked_hybrid || auto_hybrid.is_some();
    // Some private anonymous memory stays at the source after the commit, served over the
    // page link.
    let lazy = asked_lazy || auto_lazy.is_some() || hybrid;
    write_msg(
        &mut out,
        &Msg::Movable {
            memory_bytes,
            uid,
            command,
            // A body holding relays comes home as a body beside its deputies, its relays
            // attached again there (not rebuilt in their place: docs/limitations.md).
            in_place: !relay_pipes && relay_standins.is_empty() && rebuilt_in_place(pid),
            lazy,
            machine: ferry_engine::preflight::machine_bound(pid),
        },
    )?;
    if !matches!(next_command(&mut input), Some(Msg::Go)) {
        return Ok(());
    }
    let planned = if lazy && !hybrid {
        Ok(super::precopy::Outcome::Freeze(
            None,
            ferry_transport::message::MemoryPlan {
                mode: "lazy".into(),
                reason: auto_lazy.unwrap_or_else(|| {
                    "asked (--memory lazy): private anonymous memory stays at the source, \
                     served as the copy touches it and pushed meanwhile"
                        .into()
                }),
                ..Default::default()
            },
        ))
    } else {
        super::precopy::run(
            pid,
            memory,
            auto_hybrid.as_deref(),
            memory_bytes,
            &mut input,
            &mut out,
        )
    };
    let (precopy, plan) = match planned {
        Ok(super::precopy::Outcome::Freeze(p, plan)) => (p, plan),
        Ok(super::precopy::Outcome::Stopped { thaw }) => {
            if thaw {
                write_msg(&mut out, &Msg::Thawed)?;
            }
            return Ok(());
        }
        Err(e) => return fail(&mut out, &e.context(format!("pre-copy PID {pid}"))),
    };
    write_msg(&mut out, &Msg::MemoryPlan(Box::new(plan)))?;
    let stamp = ferry_transport::message::Stamp::now;
    let freezing = stamp("source: freeze begins");
    let mut frozen = match FrozenTree::freeze(pid).with_context(|| format!("freeze PID {pid}")) {
        Ok(f) => f,
        Err(e) => return fail(&mut out, &e),
    };
    // First, before any call is injected into the tree; the counters are closed once the
    // copy runs (closing them is slow, and would slow the rebuild).
    let mut counters = ferry_engine::premaps::Retired::default();
    if let Some(mut pre) = premaps.take() {
        counters = pre.settle();
        frozen.premaps = Some(pre);
    }
    frozen.relay_pipes = relay_pipes;
    frozen.relay_standins = relay_standins;
    frozen.relay_sockets = relay_sockets;
    // A move that fails from here lets the tree go where it was; the next one must still see
    // each sleeping thread's own call (`FrozenTree::reissue_on_thaw`).
    frozen.reissue_on_thaw = true;
    // Frozen, the tree can no longer change hands (exec a set-user-ID program, fork): the
    // check that counts.
    if let Err(e) = owned_frozen(&frozen, owner) {
        frozen.thaw();
        return fail(&mut out, &e);
    }
    let mut timeline = vec![freezing, stamp("source: tree frozen")];
    write_msg(&mut out, &Msg::Frozen)?;
    // The pages the destination has and the tree has not written since; in a lazy
    // migration, the private anonymous memory the destination will ask for (chosen from the
    // mappings the capture reads anyway); in a hybrid one, both: the destination asks for the
    // private anonymous memory it does not have from the rounds (`lazily`).
    let inherited = precopy.map(|p| p.finish()).unwrap_or_default();
    let clean = |host: i32| {
        ferry_memory::RangeSet::from_ranges(inherited.get(&host).cloned().unwrap_or_default())
    };
    let keep = |host: i32, vmas: &[ferry_image::Vma]| match (lazy, hybrid) {
        (true, true) => Some(
            ferry_memory::RangeSet::from_ranges(ferry_engine::lazy::source_ranges_of(vmas))
                .union(&clean(host))
                .ranges()
                .to_vec(),
        ),
        (true, false) => Some(ferry_engine::lazy::source_ranges_of(vmas)),
        (false, _) => inherited.get(&host).cloned(),
    };
    let lazily = |host: i32, vmas: &[ferry_image::Vma]| {
        Some(
            ferry_memory::RangeSet::from_ranges(ferry_engine::lazy::source_ranges_of(vmas))
                .minus(&clean(host))
                .ranges()
                .to_vec(),
        )
    };
    // Frames of up to 1 MiB however small the engine's writes.
    let framed = BufWriter::with_capacity(1 << 20, DataWriter(&mut out));
    // The socket files go aside once the tree is captured and before its image leaves: the
    // destination rebuilds as the image streams in, binding them as soon as it has the tree.
    // So do its write leases: the destination opens their files again as it rebuilds.
    let mut aside = None;
    let mut leases = None;
    let lazily: Option<ferry_engine::checkpoint::KeepRanges<'_>> = hybrid.then_some(&lazily);
    // (A lazy or hybrid move does not look for copy-on-write sharing: see capture_keeping.)
    let captured = capture_keeping(
        &frozen,
        framed,
        &keep,
        lazily,
        lazy,
        lazy && !hybrid,
        None,
        || {
            timeline.push(stamp("source: non-memory state captured"));
            aside = Some(SocketFilesAside::set_aside(&frozen)?);
            leases = Some(WriteLeasesAside::set_aside(&frozen)?);
            Ok(())
        },
    )
    .map_err(anyhow::Error::from)
    .and_then(|(framed, report)| {
        framed
            .into_inner()
            .map_err(|e| anyhow::anyhow!("stream the image: {}", e.error()))?;
        Ok(report)
    })
    .and_then(|report| {
        write_end(&mut out)?;
        Ok(report)
    });
    timeline.push(stamp("source: image written"));
    let (report, aside, leases) = match (captured, aside, leases) {
        (Ok(r), Some(aside), Some(leases)) => (r, aside, leases),
        (r, aside, leases) => {
            // The original gets its socket files and write leases back before it runs again.
            if let Some(Err(e)) = aside.map(|a| a.put_back()) {
                log::error!("PID {pid}: {e}");
            }
            if let Some(Err(e)) = leases.map(|l| l.put_back(&frozen)) {
                log::error!("PID {pid}: {e}");
            }
            frozen.thaw();
            let e = r
                .err()
                .unwrap_or_else(|| anyhow::anyhow!("no socket files set aside"));
            return fail(&mut out, &e.context(format!("capture PID {pid}")));
        }
    };
    write_msg(
        &mut out,
        &Msg::CapturedMemory {
            frozen_bytes: report.memory_bytes,
            inherited_bytes: report.inherited_bytes,
        },
    )?;
    // From now on the destination may ask for the memory the image left out.
    let serving = link.filter(|_| lazy).map(|link| {
        let hosts: std::collections::HashMap<i32, i32> = report
            .tree_pids
            .iter()
            .zip(&frozen.procs)
            .map(|(t, fp)| (*t, fp.host()))
            .collect();
        std::thread::spawn(move || super::pages::serve(link, hosts))
    });
    write_msg(
        &mut out,
        &Msg::Captured {
            image_bytes: report.image_bytes,
            relays: report
                .relays
                .iter()
                .map(|r| ferry_transport::message::RelayedPipe {
                    pipe: r.pipe,
                    pid: r.pid,
                    fd: r.fd,
                    body_reads: r.body_reads,
                    tty: r.tty,
                })
                .collect(),
            timeline,
        },
    )?;
    let mut order = next_command(&mut input);
    let mut committed = false;
    if serving.is_some() && matches!(order, Some(Msg::Committed)) {
        // The copy runs from now on: the original must never run again, even if this worker
        // dies (the kernel kills it with its tracer); its memory is served until the
        // destination has it all (the daemon then says Kill or Deputize).
        committed = true;
        if let Err(e) = frozen.set_exit_kill() {
            log::error!("PID {pid}: {e}");
        }
        order = next_command(&mut input);
    }
    counters.close();
    match order {
        Some(Msg::Kill) => {
            frozen.kill();
            aside.remove();
            write_msg(&mut out, &Msg::Killed)?;
        }
        Some(Msg::Deputize) => {
            // Relayed TCP connections stay open at home: the daemon took them for the body.
            let relayed: std::collections::HashSet<u64> = report
                .relays
                .iter()
                .filter(|r| r.pipe & ferry_image::RELAY_SOCKET != 0)
                .filter_map(|r| std::fs::read_link(format!("/proc/{}/fd/{}", r.pid, r.fd)).ok())
                .filter_map(|l| {
                    l.to_str()?
                        .strip_prefix("socket:[")?
                        .strip_suffix(']')?
                        .parse()
                        .ok()
                })
                .collect();
            let deputies = ferry_deputy::home::Deputies::from_frozen(frozen, &relayed);
            aside.remove();
            match deputies {
                Ok(d) => {
                    write_msg(&mut out, &Msg::Deputized { pids: d.pids() })?;
                    out.flush()?;
                    drop(input);
                    let sock = deputies_dir.map(|dir| dir.join(format!("{pid}.sock")));
                    return serve_deputies(d, out, sock);
                }
                Err(e) => {
                    // The originals are dead (as with `Kill`): the copy is the one that runs.
                    log::error!("PID {pid}: {e}");
                    write_msg(&mut out, &Msg::Killed)?;
                }
            }
        }
        _ if committed => {
            // The daemon is gone past the commit point of a lazy migration: the copy may run,
            // so the original must not.
            frozen.kill();
            aside.remove();
            let _ = write_msg(&mut out, &Msg::Killed);
        }
        _ => {
            // The original gets its socket files and write leases back before it runs again.
            if let Err(e) = aside.put_back() {
                log::error!("PID {pid}: {e}");
            }
            if let Err(e) = leases.put_back(&frozen) {
                log::error!("PID {pid}: {e}");
            }
            frozen.thaw();
            let _ = write_msg(&mut out, &Msg::Thawed);
        }
    }
    Ok(())
}

/// How long the deputies' worker waits for a daemon to take it up again before it gives the
/// tree up (its deputies killed, as their parents then see).
const DETACHED_MAX: std::time::Duration = std::time::Duration::from_secs(600);

/// The deputies' worker's link to its daemon: the pipes of the daemon that started it, a
/// connection from a restarted daemon, or none (waiting on `DIR/ROOT.sock` for one).
enum Link {
    Attached {
        input: std::fs::File,
        out: Box<dyn Write>,
    },
    Detached {
        listener: std::os::unix::net::UnixListener,
        since: Instant,
    },
}
/// How long a release of deputies (a tree coming home) waits for a stop or continue of its
/// body still on its way to be mirrored.
const RELEASE_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

/// The capture worker after the commit point of a tree leaving home: the tracer of its
/// deputies until the last one ends. It tells the daemon of every signal sent to a deputy and of
/// every deputy's end, and makes a deputy end as its body did when the daemon says so
/// (`BodyStatus`). Its deputies outlive their daemon: if the daemon goes away, the worker keeps
/// them, holds what it has to tell, and listens on `sock` (in the daemon's data directory) for
/// the restarted daemon, which takes them up again (ferry_daemon::deputies::recover). Without
/// `sock`, or after [`DETACHED_MAX`] without a daemon, or told `Kill`, or sent SIGTERM, the
/// home gives the tree up: the deputies are killed (their parents see SIGKILL).
fn serve_deputies(
    mut deputies: ferry_deputy::home::Deputies,
    out: impl Write + 'static,
    sock: Option<std::path::PathBuf>,
) -> Result<()> {
    use ferry_deputy::home::Event;
    use std::os::fd::{AsFd, AsRawFd};
    // Its daemon's death is no reason to end: it waits for the next one.
    if sock.is_some() {
        ferry_sys::process::set_parent_death_signal(0).context("outlive the daemon")?;
    }
    ferry_sys::ns::block_signal(libc::SIGCHLD).context("block SIGCHLD")?;
    let sigchld = ferry_sys::anon_fds::signalfd(
        1 << (libc::SIGCHLD - 1),
        libc::SFD_CLOEXEC | libc::SFD_NONBLOCK,
    )
    .context("make a signalfd for SIGCHLD")?;
    // Read unbuffered, frame by frame, so that what poll says is all there is.
    let stdin = std::fs::File::from(
        std::io::stdin()
            .as_fd()
            .try_clone_to_owned()
            .context("take stdin")?,
    );
    let mut link = Link::Attached {
        input: stdin,
        out: Box::new(out),
    };
    // What the daemon has not heard yet (it was gone).
    let mut untold: Vec<Msg> = Vec::new();
    let cancel = ferry_engine::cancel::flag();
    let give_up = |deputies: &mut ferry_deputy::home::Deputies, link: &mut Link| {
        deputies.kill_all();
        for ev in deputies.poll() {
            if let (Event::Ended { pid, status, .. }, Link::Attached { out, .. }) = (ev, &mut *link)
            {
                let _ = write_msg(
                    out,
                    &Msg::DeputyEnded {
                        pid,
                        status,
                        mirrored: false,
                    },
                );
            }
        }
        if let Link::Attached { out, .. } = link {
            let _ = out.flush();
        }
    };
    // A release asked for and not done yet: until when it may wait.
    let mut release_due: Option<std::time::Instant> = None;
    loop {
        for ev in deputies.poll() {
            untold.push(match ev {
                Event::Signal { pid, sig, queued } => Msg::DeputySignal {
                    pid,
                    sig,
                    queued: queued.map(|(code, pid, uid, value)| {
                        ferry_transport::message::SigQueued {
                            code,
                            pid,
                            uid,
                            value,
                        }
                    }),
                },
                Event::Ended {
                    pid,
                    status,
                    mirrored,
                } => Msg::DeputyEnded {
                    pid,
                    status,
                    mirrored,
                },
            });
        }
        if let Link::Attached { out, .. } = &mut link {
            let told = untold
                .iter()
                .try_for_each(|m| write_msg(out, m))
                .and_then(|()| out.flush().map_err(Into::into));
            match told {
                Ok(()) => untold.clear(),
                Err(e) => {
                    log::warn!(
                        "deputies of PID {}: the daemon is gone: {e}",
                        deputies.root()
                    );
                    link = match detach(sock.as_deref(), deputies.root()) {
                        Some(l) => l,
                        None => {
                            deputies.kill_all();
                            return Ok(());
                        }
                    };
                }
            }
        }
        if deputies.is_empty() {
            if let Some(s) = &sock {
                if matches!(link, Link::Detached { .. }) {
                    let _ = std::fs::remove_file(s);
                }
            }
            return Ok(());
        }
        if let (Some(due), Link::Attached { out, .. }) = (release_due, &mut link) {
            let msg = match deputies.release() {
                Ok(pids) => Some(Msg::DeputiesReleased { pids }),
                Err(e @ ferry_deputy::home::Error::Refused(_)) => {
                    // Nothing changed: they go on as deputies, unless it lasts.
                    (std::time::Instant::now() > due).then(|| {
                        release_due = None;
                        Msg::Error {
                            message: format!("{e}"),
                        }
                    })
                }
                Err(e) => Some(Msg::Error {
                    message: format!("let the deputies go: {e}"),
                }),
            };
            if let Some(msg) = msg {
                for ev in deputies.poll() {
                    if let Event::Ended {
                        pid,
                        status,
                        mirrored,
                    } = ev
                    {
                        write_msg(
                            out,
                            &Msg::DeputyEnded {
                                pid,
                                status,
                                mirrored,
                            },
                        )?;
                    }
                }
                let released = matches!(msg, Msg::DeputiesReleased { .. });
                write_msg(out, &msg)?;
                out.flush()?;
                // Let go, or killed by a release that broke half way: nothing left to serve.
                if released || deputies.is_empty() {
                    return Ok(());
                }
            }
        }
        if cancel.load(std::sync::atomic::Ordering::Relaxed) {
            give_up(&mut deputies, &mut link);
            return Ok(());
        }
        if let Link::Detached { since, .. } = &link {
            if since.elapsed() > DETACHED_MAX {
                log::error!(
                    "deputies of PID {}: no daemon came back in {} s: they are given up",
                    deputies.root(),
                    DETACHED_MAX.as_secs()
                );
                give_up(&mut deputies, &mut link);
                return Ok(());
            }
        }
        let wait = if release_due.is_some() { 20 } else { 500 };
        let first = match &link {
            Link::Attached { input, .. } => input.as_raw_fd(),
            Link::Detached { listener, .. } => listener.as_raw_fd(),
        };
        let ready = ferry_sys::ns::poll_in(&[first, sigchld.as_raw_fd()], wait)
            .context("wait for the daemon and the deputies")?;
        if ready[1] {
            let mut buf = [0u8; 128];
            while matches!(ferry_sys::fdops::read_fd(sigchld.as_raw_fd(), &mut buf), Ok(n) if n > 0)
            {
            }
        }
        if !ready[0] {
            continue;
        }
        match &mut link {
            Link::Detached { listener, .. } => match listener.accept() {
                Ok((conn, _)) => {
                    let _ = conn.set_nonblocking(false);
                    match conn.try_clone() {
                        Ok(input) => {
                            log::warn!(
                                "deputies of PID {}: taken up again by a restarted daemon",
                                deputies.root()
                            );
                            if let Some(s) = &sock {
                                let _ = std::fs::remove_file(s);
                            }
                            link = Link::Attached {
                                input: std::fs::File::from(std::os::fd::OwnedFd::from(input)),
                                out: Box::new(std::io::BufWriter::new(conn)),
                            };
                        }
                        Err(e) => log::warn!("deputies: take a daemon's connection: {e}"),
                    }
                }
                Err(e) => log::debug!("deputies: accept: {e}"),
            },
            Link::Attached { input, .. } => match next_command(input) {
                Some(Msg::BodyStatus { pid, status, .. }) => {
                    if let Err(e) = deputies.mirror(pid, status) {
                        log::error!("{e}");
                    }
                }
                Some(Msg::ForkDeputy { pid, .. }) => {
                    // Answered at the top of the loop, in order with what else happened.
                    untold.push(match deputies.fork(pid) {
                        Ok(child) => Msg::DeputyForked {
                            parent: pid,
                            pid: child,
                        },
                        Err(e) => {
                            log::warn!("deputies: fork a deputy from PID {pid}: {e}");
                            Msg::ForkRefused {
                                parent: pid,
                                message: format!("{e}"),
                            }
                        }
                    });
                }
                Some(Msg::HomeCall {
                    pid,
                    nr,
                    args,
                    data,
                    uids,
                    ..
                }) => {
                    // A body's signal to a process at home, made by its deputy: answered at the
                    // top of the loop, in order with what else happened.
                    untold.push(match deputies.call(pid, nr, &args, &data, uids) {
                        Ok(ret) => Msg::HomeCalled {
                            pid,
                            ret,
                            error: None,
                        },
                        Err(e) => {
                            log::warn!("deputies: call {nr} of PID {pid} at home: {e}");
                            Msg::HomeCalled {
                                pid,
                                ret: -(libc::EPERM as i64),
                                error: Some(format!("{e}")),
                            }
                        }
                    });
                }
                Some(Msg::ReleaseDeputies) => {
                    // Coming home: the restore worker takes them over, once none is between
                    // a stop and a continue its body reported (the last report may still be on
                    // its way: a body that comes home is running).
                    release_due = Some(std::time::Instant::now() + RELEASE_WAIT);
                }
                Some(Msg::Kill) => {
                    // Told to: the home gives the tree up.
                    give_up(&mut deputies, &mut link);
                    return Ok(());
                }
                None => {
                    // The daemon is gone: its successor takes the deputies up again.
                    link = match detach(sock.as_deref(), deputies.root()) {
                        Some(l) => l,
                        None => {
                            deputies.kill_all();
                            return Ok(());
                        }
                    };
                }
                Some(other) => log::warn!(
                    "deputies: unexpected {}",
                    ferry_transport::message::kind(&other)
                ),
            },
        }
    }
}

/// Listens on `sock` for the daemon that takes the deputies of `root` up again; None (the
/// tree is given up) without a socket or if it cannot be made.
fn detach(sock: Option<&std::path::Path>, root: i32) -> Option<Link> {
    let sock = sock?;
    if let Some(dir) = sock.parent() {
        use std::os::unix::fs::DirBuilderExt;
        let _ = std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir);
    }
    let _ = std::fs::remove_file(sock);
    match std::os::unix::net::UnixListener::bind(sock) {
        Ok(listener) => {
            log::warn!(
                "deputies of PID {root}: their daemon is gone; waiting for the next on {}",
                sock.display()
            );
            Some(Link::Detached {
                listener,
                since: Instant::now(),
            })
        }
        Err(e) => {
            log::error!(
                "deputies of PID {root}: listen on {}: {e}: they are given up",
                sock.display()
            );
            None
        }
    }
}

/// Reads the stream's page stream of pre-copy rounds, if it starts with one, into `cache`;
/// then opens the image that follows.
fn open_after_pages<R: std::io::Read>(
    input: R,
    cache: &mut ferry_memory::cache::PageCache,
) -> Result<ferry_engine::restore::OpenImage<R>> {
    let mut reader = ferry_image::ImageReader::new(input)?;
    if reader.is_pages() {
        cache
            .load(&mut reader)
            .context("receive the pre-copied memory")?;
        reader = ferry_image::ImageReader::new(reader.into_inner())?;
    }
    Ok(ferry_engine::restore::open_reader(reader)?)
}

/// A lazy migration's restore: where the memory comes from.
pub struct LazyArgs {
    /// The source node.
    pub from: String,
    /// The daemon's descriptor of this worker's end of the page link.
    pub pages_fd: i32,
    /// How long the source may leave a request unanswered.
    pub stall: std::time::Duration,
    /// Pages sent after a faulting one.
    pub prefetch: usize,
    /// How long after the tree runs the background push starts.
    pub push_after: std::time::Duration,
}

/// `ferry __restore-worker`: the image arrives on stdin as data frames (after the pages of
/// pre-copy rounds, if any), and the tree is rebuilt as it streams in. With `lazy`, its
/// private anonymous memory is not in the image: a page server fetches it from the source
/// over the page link as it is touched, and pushes the rest once the tree runs; the worker
/// then says `LazyDone` (or, if the source is lost, kills the tree and says why).
pub fn restore_worker(
    reports: Option<std::path::PathBuf>,
    cpu_cgroup: Option<std::path::PathBuf>,
    home: Option<(String, String)>,
    confine: Option<ferry_engine::guest_ns::Confine>,
    lazy: Option<LazyArgs>,
    adopt: Vec<i32>,
) -> Result<()> {
    let mut out = BufWriter::new(std::io::stdout().lock());
    let t0 = Instant::now();
    let link = match lazy
        .as_ref()
        .map(|l| super::pages::take_link(l.pages_fd))
        .transpose()
    {
        Ok(l) => l,
        Err(e) => return fail(&mut out, &e),
    };
    let mut cache = ferry_memory::cache::PageCache::new();
    let mut img = match open_after_pages(DataReader::new(std::io::stdin().lock()), &mut cache)
        .context("receive the image")
    {
        Ok(i) => i,
        Err(e) => return fail(&mut out, &e),
    };
    // Shared with the page server of a hybrid migration, which copies the pre-copied pages
    // into the copy after it runs.
    let cache = std::sync::Arc::new(cache);
    let open_ms = t0.elapsed().as_secs_f64() * 1e3;
    let stamp = ferry_transport::message::Stamp::now;
    let mut timeline = vec![stamp("dest: tree received")];
    let home = match home.map(|(h, ids)| hold::parse_home(h, &ids)).transpose() {
        Ok(h) => h.map(|h| ferry_engine::guest_ns::Home { confine, ..h }),
        Err(e) => return fail(&mut out, &e),
    };
    let gate = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let server = match (lazy, link) {
        (Some(l), Some(link)) => {
            let made = std::env::current_exe()
                .context("find the ferry binary")
                .and_then(|exe| {
                    let source =
                        super::pages::RemoteSource::new(link, &img.tree, &l.from, l.stall)?;
                    Ok(ferry_memory::LazyServer::new(
                        Box::new(source),
                        ferry_memory::Options {
                            prefetch: l.prefetch,
                            push_after: l.push_after,
                            // One request per piece, four on their way at once (the
                            // source reads, both daemons relay, this server copies, all
                            // at the same time).
                            push_piece: ferry_transport::frame::DATA_CHUNK,
                            push_window: 4 * ferry_transport::frame::DATA_CHUNK,
                            guardian: Some(exe),
                            push_gate: Some(gate.clone()),
                            serves_inherited: true,
                            precopied: Some(cache.clone()),
                            ..Default::default()
                        },
                    ))
                });
            match made {
                Ok(s) => Some(s),
                Err(e) => return fail(&mut out, &e),
            }
        }
        _ => None,
    };
    let held = match hold::rebuild(
        &mut img,
        &cache,
        reports.as_deref(),
        cpu_cgroup.as_deref(),
        home.as_ref(),
        server.as_ref(),
        &adopt,
    ) {
        Ok(h) => h,
        Err(e) => return fail(&mut out, &e),
    };
    let mut input = match img.into_inner().finish().context("receive the image") {
        Ok(i) => i,
        Err(e) => {
            held.kill();
            return fail(&mut out, &e);
        }
    };
    // Time spent receiving the image (the tree, then waiting for and checking memory as it
    // arrived), and the rest of the rebuild.
    let load_ms = open_ms + held.report().image_read_ms;
    if let Some(g) = held.guest.as_ref() {
        timeline.push(g.made.clone());
    }
    timeline.extend(held.report().timeline.iter().map(|&(what, unix_us)| {
        ferry_transport::message::Stamp {
            what: what.into(),
            unix_us,
        }
    }));
    timeline.push(stamp("dest: image ended"));
    write_msg(
        &mut out,
        &Msg::Rebuilt(ferry_transport::message::Rebuilt {
            pid: held.root_pid(),
            load_ms,
            restore_ms: t0.elapsed().as_secs_f64() * 1e3 - load_ms,
            relays: held.relay_ends(),
            relay_names: held
                .relayed_names()
                .iter()
                .map(|n| ferry_transport::message::RelayName {
                    relay: n.relay,
                    line: ferry_engine::resources::sockets::RelayedNames::encode(
                        std::slice::from_ref(n),
                    ),
                })
                .collect(),
            timeline,
        }),
    )?;
    // After `Rebuilt` the source may already have destroyed the original; only an explicit
    // `Abort` kills the copy. Losing the daemon here (EOF) means it died after passing our
    // `Rebuilt` on: the source commits on it, so the copy must run.
    match next_command(&mut input) {
        Some(Msg::Abort { .. }) => held.kill(),
        _ => match held.resume() {
            Ok(()) => {
                // The copy runs: the rest of its memory is pushed from now on, once the
                // source has heard so (the push's first requests would otherwise be on the
                // way before the news, on the same links and the same two CPUs).
                let _ = write_msg(&mut out, &Msg::Resumed);
                gate.store(true, std::sync::atomic::Ordering::Release);
                if let Some(server) = server {
                    let _ = out.flush();
                    // The source is released as soon as the pages only it holds are in; a
                    // hybrid copy's pre-copied pages may still be going in from here.
                    match server.wait_released() {
                        Ok(stats) => {
                            let _ = write_msg(
                                &mut out,
                                &Msg::LazyDone(Box::new(super::pages::report(&stats))),
                            );
                            let _ = out.flush();
                            match server.wait() {
                                Ok(s) => log::debug!(
                                    "the pre-copied pages are all in, {:.1} ms after the \
                                     hand-over",
                                    s.local_done_ms
                                ),
                                Err(e) => log::error!("the lazy phase failed: {e}"),
                            }
                        }
                        Err(e) => {
                            let _ = write_msg(
                                &mut out,
                                &Msg::Error {
                                    message: format!("the lazy phase failed: {e}"),
                                },
                            );
                        }
                    }
                }
            }
            Err(e) => {
                let _ = fail(&mut out, &e);
            }
        },
    }
    Ok(())
}

/// Rebuilding a tree in namespaces of its own (so it keeps its PIDs, and its monotonic clocks
/// never run backwards) and holding it stopped until the commit.
mod hold {
    use anyhow::{bail, Context, Result};
    use ferry_engine::guest_ns::{GuestNamespaces, Home};
    use ferry_engine::restore::{
        restore_with, OpenImage, RestoreOptions, RestoreReport, RestoredTree,
    };
    use std::io::Read;
    use std::path::Path;

    pub struct Held {
        /// None for a tree coming home, rebuilt in the home's own namespaces.
        pub guest: Option<Guest>,
        tree: RestoredTree,
    }

    /// The namespaces a tree is rebuilt in, and when they were ready.
    pub struct Guest {
        ns: GuestNamespaces,
        pub made: ferry_transport::message::Stamp,
    }

    /// A body's home: its host name and "ROOT PPID PGID SID".
    pub fn parse_home(hostname: String, ids: &str) -> Result<Home> {
        let v: Vec<i32> = ids
            .split_whitespace()
            .map(str::parse)
            .collect::<std::result::Result<_, _>>()
            .with_context(|| format!("--home {ids:?}"))?;
        let [root, ppid, pgid, sid] = v[..] else {
            bail!("--home {ids:?}: not four numbers");
        };
        Ok(Home {
            hostname,
            root,
            ppid,
            pgid,
            sid,
            confine: None,
        })
    }

    pub fn rebuild<R: Read>(
        img: &mut OpenImage<R>,
        pages: &ferry_memory::cache::PageCache,
        reports: Option<&Path>,
        cpu_cgroup: Option<&Path>,
        home: Option<&Home>,
        lazy: Option<&ferry_memory::LazyServer>,
        adopt: &[i32],
    ) -> Result<Held> {
        let fits = !adopt.is_empty()
            && match ferry_engine::restore::check_in_place(&img.tree, adopt) {
                Ok(()) => true,
                Err(e) => {
                    log::warn!("rebuilt as a body beside its deputies at home: {e}");
                    false
                }
            };
        if fits {
            // Coming home: rebuilt in place of its deputies, in this node's own namespaces,
            // an ordinary process again (no supervisor, nothing of Ferry in its path). Once
            // the tree is known fit, the daemon is asked to have them let go, and each is
            // waited for: untraced (parked by its worker before it detaches).
            let release = || -> std::result::Result<(), String> {
                use std::io::Write;
                let mut o = std::io::stdout().lock();
                ferry_transport::frame::blocking::write_msg(
                    &mut o,
                    &ferry_transport::Msg::ReleaseDeputies,
                )
                .and_then(|()| o.flush().map_err(Into::into))
                .map_err(|e| format!("ask for them: {e}"))?;
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
                for &pid in adopt {
                    while super::tracer_of(pid) != Some(0) {
                        if std::time::Instant::now() > deadline {
                            return Err(format!("deputy {pid} is still held by its tracer"));
                        }
                        std::thread::sleep(std::time::Duration::from_millis(5));
                    }
                }
                Ok(())
            };
            let tree = restore_with(
                img,
                &RestoreOptions {
                    guest: None,
                    caller: None,
                    cpu_cgroup: None,
                    relays: false,
                    lazy: None,
                    supervised: false,
                    pages: Some(pages),
                    adopt,
                    release: Some(ferry_engine::restore::ReleaseHook(&release)),
                },
            )
            .context("rebuild the tree in place of its deputies")?;
            return Ok(Held { guest: None, tree });
        }
        let exe = std::env::current_exe().context("find the ferry binary")?;
        let guest = GuestNamespaces::create_for(&exe, img.tree.clocks, reports, home)
            .context("make namespaces for the guest")?;
        let made = ferry_transport::message::Stamp::now("dest: guest namespaces made");
        let tree = restore_with(
            img,
            &RestoreOptions {
                guest: Some(&guest),
                // The daemon's own restore (root): see RestoreOptions::caller.
                caller: None,
                cpu_cgroup,
                relays: true,
                lazy: lazy.map(|l| l as &dyn ferry_engine::lazy::LazyMemory),
                supervised: home.is_some(),
                pages: Some(pages),
                adopt: &[],
                release: None,
            },
        )
        .map_err(anyhow::Error::from)
        .and_then(|mut tree| {
            // The init answers the tree's forwarded calls from now on.
            let listeners = tree.take_listeners();
            guest.hand_listeners(listeners, tree.relayed_names())?;
            Ok(tree)
        });
        match tree {
            Ok(tree) => Ok(Held {
                guest: Some(Guest { ns: guest, made }),
                tree,
            }),
            Err(e) => {
                let _ = guest.kill();
                Err(e.context("rebuild the tree"))
            }
        }
    }

    impl Held {
        pub fn root_pid(&self) -> i32 {
            self.tree.root_host_pid()
        }

        pub fn report(&self) -> &RestoreReport {
            self.tree.report()
        }

        pub fn relay_ends(&self) -> Vec<(u32, i32)> {
            self.tree.relay_ends()
        }

        /// What the relayed sockets the body got were at home (handed to its supervisor).
        pub fn relayed_names(&self) -> &[ferry_engine::resources::sockets::RelayedNames] {
            self.tree.relayed_names()
        }

        /// Lets the tree run; the namespaces' init stays as long as the tree does.
        pub fn resume(self) -> Result<()> {
            self.tree.resume().context("let the rebuilt tree run")?;
            drop(self.guest.map(|g| g.ns));
            Ok(())
        }

        pub fn kill(self) {
            self.tree.kill();
            if let Some(g) = self.guest {
                let _ = g.ns.kill();
            }
        }
    }
}
