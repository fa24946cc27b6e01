//! Descriptors backed by anonymous inodes: epoll (with its interest list), timerfd, signalfd,
//! inotify, fanotify. (eventfd lives in files.rs.)
//!
//! Everything is read from /proc/PID/fdinfo, helped by a copy of the descriptor taken with
//! pidfd_getfd(2) where fdinfo is not enough (a timerfd's next expiration, the bytes queued in an
//! inotify instance), and by kcmp(2) to tell which process registered an epoll item.
//!
//! - **epoll**: the instance is created in ferry; its items are added from inside the rebuilt
//!   process that holds each watched file under the item's descriptor number, once every
//!   descriptor of that process is installed ([`after_install`]). Readiness is evaluated anew:
//!   a level-triggered item reports what is ready; an edge-triggered item whose file is ready
//!   reports once more. A one-shot item that has fired (disarmed) is re-added and made to fire
//!   once so that it is disarmed again, exactly; where its file cannot be made ready without
//!   side effects (anything but an empty anonymous pipe), it is left holding EPOLLERR|EPOLLHUP
//!   only (the kernel adds those two to every registration), with a warning.
//! - **timerfd**: clock, flags, interval and the time to the next expiration are restored; the
//!   time the tree spent checkpointed does not count (a relative or CLOCK_MONOTONIC/BOOTTIME
//!   timer resumes with the time it had left), except for TFD_TIMER_ABSTIME timers on
//!   CLOCK_REALTIME/TAI, which keep their wall-clock deadline. Unread expirations are put back
//!   with TFD_IOC_SET_TICKS.
//! - **signalfd**: its mask (the pending signals it reads are restored with the process).
//! - **inotify**: every watch is resolved to a path at checkpoint (from its file handle) and
//!   re-added under its original watch descriptor. Events queued but not read yet cannot be
//!   captured without consuming them: such an instance is refused.
//! - **fanotify**: a notification group with inode, mount and filesystem marks; each marked
//!   object is resolved to a path as an inotify watch is (a mount to its root in the process's
//!   mountinfo, a filesystem to the root of a mount of it), and marked again (mask, ignored
//!   mask) in a group made with the same flags, oldest mark first. Permission classes and
//!   queued events are refused.

use crate::error::{Context, Error, Result};
use crate::husk::Husk;
use crate::procfs;
use ferry_image::{
    EpollDesc, EpollItem, FanotifyDesc, FanotifyMark, FanotifyTarget, FileDesc, FileKind,
    InotifyDesc, InotifyWatch, Process, SignalfdDesc, TimerfdDesc,
};
use ferry_sys::{anon_fds, fdops, pidfd};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::MetadataExt;
use std::sync::Mutex;

const EPOLLERR: u32 = 0x8;
const EPOLLHUP: u32 = 0x10;
/// Flag bits of an epoll item, which survive a one-shot firing (EP_PRIVATE_BITS).
const EPOLL_FLAG_BITS: u32 = (1 << 28) | (1 << 29) | (1 << 30) | (1 << 31);
/// Every readiness bit a file's poll can report.
const EPOLL_ALL_EVENTS: u32 =
    0x1 | 0x2 | 0x4 | EPOLLERR | EPOLLHUP | 0x40 | 0x80 | 0x100 | 0x200 | 0x400 | 0x2000;
const EPOLL_CTL_ADD: u64 = 1;
const EPOLL_CTL_MOD: u64 = 3;
/// struct epoll_event is packed on x86_64: u32 events, u64 data.
const EPOLL_EVENT_SIZE: u64 = 12;
const IN_ATTRIB: u32 = 0x4;
/// How many watch descriptors may be skipped to give a watch its old number.
const MAX_WD_SKIP: i32 = 1 << 20;

/// Describes descriptor `fd` of `pid` (whose /proc link is `link`, e.g.
/// "anon_inode:[eventpoll]", and whose fdinfo lines are `info`), or `None` when this module
/// does not handle that kind (the caller then refuses it).
pub fn classify(
    pid: i32,
    fd: i32,
    link: &str,
    info: &[(String, String)],
) -> Result<Option<FileKind>> {
    Ok(Some(match link {
        "anon_inode:[eventpoll]" => FileKind::Epoll(capture_epoll(pid, fd, link, info)?),
        "anon_inode:[timerfd]" => FileKind::Timerfd(capture_timerfd(pid, fd, link, info)?),
        "anon_inode:[signalfd]" => FileKind::Signalfd(capture_signalfd(pid, fd, link, info)?),
        "anon_inode:inotify" => FileKind::Inotify(capture_inotify(pid, fd, link, info)?),
        "anon_inode:[pidfd]" => capture_pidfd(pid, fd, link, info)?,
        "anon_inode:[fanotify]" => FileKind::Fanotify(capture_fanotify(pid, fd, link, info)?),
        _ => return Ok(None),
    }))
}

/// A pidfd: which process it refers to, by our PID for now (the tree's number once
/// `pidview` has translated it, which refuses a process outside the tree).
fn capture_pidfd(pid: i32, fd: i32, link: &str, info: &[(String, String)]) -> Result<FileKind> {
    let flags = value(info, "flags")
        .and_then(|f| i64::from_str_radix(f, 8).ok())
        .unwrap_or(0);
    if flags & libc::O_EXCL as i64 != 0 {
        // PIDFD_THREAD
        return Err(unsupported(
            pid,
            fd,
            link,
            "a pidfd of a single thread is not supported yet".into(),
        ));
    }
    match value(info, "Pid").and_then(|v| v.parse::<i32>().ok()) {
        Some(target) if target > 0 => Ok(FileKind::Pidfd { pid: target }),
        Some(_) => Err(unsupported(
            pid,
            fd,
            link,
            "the process it refers to has exited and been reaped (or lives in a PID namespace \
             we cannot see), and a pidfd cannot be made again for it"
                .into(),
        )),
        None => Err(unsupported(
            pid,
            fd,
            link,
            "its fdinfo has no Pid line".into(),
        )),
    }
}

fn unsupported(pid: i32, fd: i32, link: &str, why: String) -> Error {
    Error::Unsupported {
        pid,
        what: format!("fd {fd} ({link})"),
        why,
    }
}

fn value<'a>(info: &'a [(String, String)], key: &str) -> Option<&'a str> {
    info.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
}

/// Splits an fdinfo line's fields ("events: 19", "ino:14a2a") into (key, value) pairs; a
/// leading bare value gets the key "".
fn fields(s: &str) -> Vec<(&str, &str)> {
    let mut out = Vec::new();
    let mut it = s.split_whitespace();
    while let Some(tok) = it.next() {
        if let Some(k) = tok.strip_suffix(':') {
            out.push((k, it.next().unwrap_or("")));
        } else if let Some((k, v)) = tok.split_once(':') {
            out.push((k, v));
        } else {
            out.push(("", tok));
        }
    }
    out
}

fn field<'a>(f: &[(&str, &'a str)], key: &str) -> Option<&'a str> {
    f.iter().find(|(k, _)| *k == key).map(|(_, v)| *v)
}

fn hex(f: &[(&str, &str)], key: &str) -> Option<u64> {
    field(f, key).and_then(|v| u64::from_str_radix(v, 16).ok())
}

/// A dev_t as the kernel prints it in fdinfo (major << 20 | minor), in user-space encoding.
fn user_dev(kdev: u64) -> u64 {
    libc::makedev((kdev >> 20) as u32, (kdev & 0xf_ffff) as u32)
}

/// A copy of descriptor `fd` of `pid`, sharing its open file description.
fn take_copy(pid: i32, fd: i32) -> Result<OwnedFd> {
    let pfd = pidfd::pidfd_open(pid).ctx(pid, || "open a pidfd".into())?;
    pidfd::pidfd_getfd(&pfd, fd).ctx(pid, || format!("take a copy of fd {fd}"))
}

// ---------------------------------------------------------------------------------------------
// epoll

/// Captures an epoll instance's interest list and, for each item, a process that can register
/// it again.
fn capture_epoll(pid: i32, fd: i32, link: &str, info: &[(String, String)]) -> Result<EpollDesc> {
    let mut items = Vec::new();
    let mut same_tfd: HashMap<i32, u32> = HashMap::new();
    // The other processes holding this very epoll instance, looked up only when needed.
    let mut holders: Option<Vec<i32>> = None;
    for (k, v) in info {
        if k != "tfd" {
            continue;
        }
        let f = fields(v);
        let parsed = (|| {
            let tfd: i32 = field(&f, "")?.parse().ok()?;
            Some((
                tfd,
                hex(&f, "events")? as u32,
                hex(&f, "data")?,
                hex(&f, "ino")?,
            ))
        })();
        let Some((tfd, events, data, ino)) = parsed else {
            return Err(unsupported(
                pid,
                fd,
                link,
                format!("unreadable fdinfo line \"tfd: {v}\""),
            ));
        };
        let toff = {
            let n = same_tfd.entry(tfd).or_insert(0);
            *n += 1;
            *n - 1
        };
        let owner = if registered_at(pid, pid, fd, tfd, toff)? {
            Some(pid)
        } else {
            let hs = match &mut holders {
                Some(h) => h,
                None => holders.insert(epoll_holders(pid, fd)?),
            };
            let mut found = None;
            for q in hs.iter() {
                if registered_at(*q, pid, fd, tfd, toff)? {
                    found = Some(*q);
                    break;
                }
            }
            found
        };
        let Some(owner) = owner else {
            return Err(unsupported(
                pid,
                fd,
                link,
                format!(
                    "its interest list holds fd {tfd} (inode {ino}), but no process holding \
                     this epoll instance has that file open as fd {tfd} any more (it was closed \
                     or replaced after EPOLL_CTL_ADD while the file stayed open elsewhere), so \
                     the item cannot be registered again"
                ),
            ));
        };
        items.push(EpollItem {
            fd: tfd,
            events,
            data,
            pid: owner,
        });
    }
    Ok(EpollDesc { items })
}

/// Whether descriptor `tfd` of process `q` is the file of item (`tfd`, `toff`) of the epoll
/// instance at descriptor `epfd` of `pid`.
fn registered_at(q: i32, pid: i32, epfd: i32, tfd: i32, toff: u32) -> Result<bool> {
    match anon_fds::kcmp_epoll_tfd(q, tfd, pid, epfd, tfd, toff) {
        Ok(same) => Ok(same),
        Err(e) if e.errno == libc::EBADF => Ok(false),
        Err(e) => Err(e).ctx(pid, || {
            format!("compare fd {tfd} of PID {q} with the epoll item of fd {epfd}")
        }),
    }
}

/// The other processes of the frozen tree that hold the epoll instance at `epfd` of `pid`.
fn epoll_holders(pid: i32, epfd: i32) -> Result<Vec<i32>> {
    let mut out = Vec::new();
    for q in frozen_tree_of(pid)? {
        if q == pid {
            continue;
        }
        let Ok(fds) = procfs::fds(q) else { continue };
        for n in fds {
            if fdops::kcmp_file(q, pid, n, epfd).unwrap_or(false) {
                out.push(q);
                break;
            }
        }
    }
    Ok(out)
}

/// Every process of the tree that `pid` belongs to and that we have frozen (we trace it),
/// parents first.
fn frozen_tree_of(pid: i32) -> Result<Vec<i32>> {
    let me = std::process::id() as i32;
    let mine: HashSet<i32> = procfs::tids(me)?.into_iter().collect();
    let traced = |q: i32| {
        procfs::status(q)
            .ok()
            .and_then(|s| procfs::field(&s, "TracerPid").parse::<i32>().ok())
            .is_some_and(|t| mine.contains(&t))
    };
    let mut top = pid;
    loop {
        let ppid = procfs::stat(top)?.ppid;
        if ppid > 1 && traced(ppid) {
            top = ppid;
        } else {
            break;
        }
    }
    let mut out = vec![top];
    let mut i = 0;
    while i < out.len() {
        for c in procfs::children(out[i]).unwrap_or_default() {
            if traced(c) && !out.contains(&c) {
                out.push(c);
            }
        }
        i += 1;
    }
    Ok(out)
}

/// Epoll instances recreated by [`open`] whose items are still to be added from inside the
/// processes: the items need the processes' descriptor tables, which [`after_install`] sees
/// one process at a time. Keyed by file id.
static PENDING_EPOLL: Mutex<BTreeMap<u32, PendingEpoll>> = Mutex::new(BTreeMap::new());

struct PendingEpoll {
    /// Our descriptor of the instance, to recognise it in a process (kcmp).
    ours: RawFd,
    items: Vec<EpollItem>,
    /// Items already added.
    added: usize,
}

/// Adds, from inside process `p`, the epoll items that `p` registered.
fn restore_epoll_items(h: &Husk, p: &Process) -> Result<()> {
    let me = std::process::id() as i32;
    let mut pending = PENDING_EPOLL.lock().unwrap_or_else(|e| e.into_inner());
    for f in &p.fds {
        let Some(e) = pending.get_mut(&f.file) else {
            continue;
        };
        if !e.items.iter().any(|i| i.pid == p.pid)
            || !fdops::kcmp_file(h.host, me, f.fd, e.ours).unwrap_or(false)
        {
            continue;
        }
        let (mine, rest): (Vec<EpollItem>, Vec<EpollItem>) =
            e.items.drain(..).partition(|i| i.pid == p.pid);
        e.items = rest;
        // Making fired one-shot items fire again collects every ready event of the instance:
        // safe only while no item added before is ready.
        let quiet = e.added == 0 || !anon_fds::readable_now(e.ours).unwrap_or(true);
        e.added += mine.len();
        if e.items.is_empty() {
            pending.remove(&f.file);
        }
        add_epoll_items(h, f.fd, &mine, quiet)?;
    }
    Ok(())
}

fn epoll_ctl(h: &Husk, epfd: i32, op: u64, tfd: i32, events: u32, data: u64) -> Result<()> {
    let inj = h.injector();
    let mut ev = [0u8; EPOLL_EVENT_SIZE as usize];
    ev[..4].copy_from_slice(&events.to_ne_bytes());
    ev[4..].copy_from_slice(&data.to_ne_bytes());
    let addr = inj.write_scratch(0, &ev)?;
    inj.syscall(
        "epoll_ctl",
        libc::SYS_epoll_ctl,
        &[epfd as u64, op, tfd as u64, addr],
    )
    .map_err(|e| Error::Restore {
        pid: h.pid,
        what: format!(
            "register fd {tfd} (events {events:#x}) in the epoll instance at fd {epfd}: {e}"
        ),
    })?;
    Ok(())
}

/// Collects every event ready in the epoll instance (and so disarms fired one-shot items).
fn epoll_drain(h: &Husk, epfd: i32) -> Result<()> {
    let inj = h.injector();
    let max = 4096 / EPOLL_EVENT_SIZE;
    loop {
        let n = inj.syscall(
            "epoll_wait",
            libc::SYS_epoll_wait,
            &[epfd as u64, inj.scratch(0), max, 0],
        )?;
        if n < max {
            return Ok(());
        }
    }
}

/// Those of `tfds` whose items in the epoll instance at `epfd` of `pid` (registered by `pid`)
/// still wait for events, i.e. are not disarmed.
fn armed_tfds(pid: i32, epfd: i32, tfds: &HashSet<i32>) -> Result<HashSet<i32>> {
    let mut out = HashSet::new();
    let mut same_tfd: HashMap<i32, u32> = HashMap::new();
    for (k, v) in procfs::fdinfo(pid, epfd)? {
        if k != "tfd" {
            continue;
        }
        let f = fields(&v);
        let (Some(tfd), Some(events)) = (
            field(&f, "").and_then(|s| s.parse().ok()),
            hex(&f, "events"),
        ) else {
            continue;
        };
        let toff = {
            let n = same_tfd.entry(tfd).or_insert(0);
            *n += 1;
            *n - 1
        };
        // Other processes' items may have the same numbers: only `pid`'s own file counts.
        if tfds.contains(&tfd)
            && events as u32 & !EPOLL_FLAG_BITS != 0
            && registered_at(pid, pid, epfd, tfd, toff)?
        {
            out.insert(tfd);
        }
    }
    Ok(out)
}

fn add_epoll_items(h: &Husk, epfd: i32, items: &[EpollItem], quiet: bool) -> Result<()> {
    let (disarmed, armed): (Vec<&EpollItem>, Vec<&EpollItem>) =
        items.iter().partition(|i| i.events & !EPOLL_FLAG_BITS == 0);
    if !disarmed.is_empty() {
        if quiet {
            disarm_one_shots(h, epfd, &disarmed)?;
        } else {
            for i in &disarmed {
                log::warn!(
                    "PID {}: epoll fd {epfd}: fired one-shot item for fd {} restored as \
                     waiting for EPOLLERR|EPOLLHUP only",
                    h.pid,
                    i.fd
                );
                epoll_ctl(h, epfd, EPOLL_CTL_ADD, i.fd, i.events, i.data)?;
            }
        }
    }
    for i in armed {
        epoll_ctl(h, epfd, EPOLL_CTL_ADD, i.fd, i.events, i.data)?;
    }
    Ok(())
}

/// A file made ready for a moment, to be put back as it was.
enum Poke {
    /// One byte written into an empty pipe (through a descriptor of our own on it).
    Pipe(OwnedFd),
    /// An idle timerfd given one expiration (a copy of the process's descriptor).
    Timer(OwnedFd),
}

/// Makes the file at descriptor `tfd` of `pid` ready without changing what the process will
/// see, if its kind allows: an empty anonymous pipe, a timerfd with no expiration to read.
fn poke(pid: i32, tfd: i32) -> Result<Option<Poke>> {
    let link = procfs::readlink(pid, &format!("fd/{tfd}"))?;
    if link.starts_with("pipe:[") {
        let path = format!("/proc/{pid}/fd/{tfd}");
        let Ok(p) = fdops::open_path(&path, libc::O_RDWR | libc::O_NONBLOCK | libc::O_CLOEXEC, 0)
        else {
            return Ok(None);
        };
        if fdops::fionread(p.as_raw_fd()) == Ok(0) && fdops::write_fd(p.as_raw_fd(), b"F") == Ok(1)
        {
            return Ok(Some(Poke::Pipe(p)));
        }
    } else if link == "anon_inode:[timerfd]" {
        let t = take_copy(pid, tfd)?;
        if !anon_fds::readable_now(t.as_raw_fd()).unwrap_or(true)
            && anon_fds::timerfd_set_ticks(t.as_raw_fd(), 1).is_ok()
        {
            return Ok(Some(Poke::Timer(t)));
        }
    }
    Ok(None)
}

fn unpoke(pid: i32, p: Poke) -> Result<()> {
    let what = || "undo what was done to make a file ready for an epoll item".to_string();
    match p {
        Poke::Pipe(fd) => {
            fdops::read_fd(fd.as_raw_fd(), &mut [0u8; 1]).ctx(pid, what)?;
        }
        Poke::Timer(fd) => {
            let mut b = [0u8; 8];
            fdops::read_fd(fd.as_raw_fd(), &mut b).ctx(pid, what)?;
            // A real expiration that came meanwhile is given back.
            let ticks = u64::from_ne_bytes(b);
            if ticks > 1 {
                anon_fds::timerfd_set_ticks(fd.as_raw_fd(), ticks - 1).ctx(pid, what)?;
            }
        }
    }
    Ok(())
}

/// Recreates one-shot items that had fired. The kernel adds EPOLLERR|EPOLLHUP to every
/// registration; only firing clears them. So, in an instance with nothing ready, each item is
/// added listening for everything and made to fire: at once if its file is ready for anything,
/// else, for an empty anonymous pipe or an idle timerfd, by making it ready for a moment.
/// Whatever cannot be made to fire keeps EPOLLERR|EPOLLHUP.
fn disarm_one_shots(h: &Husk, epfd: i32, items: &[&EpollItem]) -> Result<()> {
    // /proc and pidfd_getfd: our number for the process.
    let pid = h.host;
    for i in items {
        epoll_ctl(
            h,
            epfd,
            EPOLL_CTL_ADD,
            i.fd,
            i.events | EPOLL_ALL_EVENTS,
            i.data,
        )?;
    }
    epoll_drain(h, epfd)?;
    let all: HashSet<i32> = items.iter().map(|i| i.fd).collect();
    let mut left = armed_tfds(pid, epfd, &all)?;
    if left.is_empty() {
        return Ok(());
    }
    let mut poked = Vec::new();
    let mut result = Ok(());
    for tfd in &left {
        match poke(pid, *tfd) {
            Ok(Some(p)) => poked.push(p),
            Ok(None) => {}
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    if result.is_ok() && !poked.is_empty() {
        result = epoll_drain(h, epfd);
    }
    for p in poked {
        unpoke(pid, p)?;
    }
    result?;
    left = armed_tfds(pid, epfd, &left)?;
    for i in items.iter().filter(|i| left.contains(&i.fd)) {
        log::warn!(
            "PID {pid}: epoll fd {epfd}: fired one-shot item for fd {} restored as waiting for \
             EPOLLERR|EPOLLHUP only",
            i.fd
        );
        epoll_ctl(h, epfd, EPOLL_CTL_MOD, i.fd, i.events, i.data)?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// timerfd

fn capture_timerfd(
    pid: i32,
    fd: i32,
    link: &str,
    info: &[(String, String)],
) -> Result<TimerfdDesc> {
    let bad = |what: &str| unsupported(pid, fd, link, format!("unreadable fdinfo field {what}"));
    let clockid: i32 = value(info, "clockid")
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| bad("clockid"))?;
    let settime_flags = value(info, "settime flags")
        .and_then(|v| i32::from_str_radix(v, 8).ok())
        .ok_or_else(|| bad("settime flags"))?;
    // fdinfo shows 0 left for a periodic timer that has expired but not been read since;
    // timerfd_gettime first counts the expirations (as a read would) and moves the timer on.
    let copy = take_copy(pid, fd)?;
    let (value_ns, interval_ns) =
        anon_fds::timerfd_gettime(copy.as_raw_fd()).ctx(pid, || format!("read timerfd fd {fd}"))?;
    let me = std::process::id() as i32;
    let ticks = procfs::fdinfo(me, copy.as_raw_fd())
        .ok()
        .and_then(|i| value(&i, "ticks").and_then(|v| v.parse().ok()))
        .or_else(|| value(info, "ticks").and_then(|v| v.parse().ok()))
        .ok_or_else(|| bad("ticks"))?;
    let deadline_ns = if settime_flags & anon_fds::TFD_TIMER_ABSTIME != 0 && value_ns != 0 {
        anon_fds::clock_now_ns(clockid).ctx(pid, || format!("read clock {clockid}"))? + value_ns
    } else {
        0
    };
    Ok(TimerfdDesc {
        clockid,
        settime_flags,
        ticks,
        value_ns,
        interval_ns,
        deadline_ns,
    })
}

/// Clocks whose absolute times mean the same on any machine and after a reboot.
fn wall_clock(clockid: i32) -> bool {
    [
        libc::CLOCK_REALTIME,
        libc::CLOCK_REALTIME_ALARM,
        libc::CLOCK_TAI,
    ]
    .contains(&clockid)
}

fn open_timerfd(t: &TimerfdDesc) -> ferry_sys::SysResult<OwnedFd> {
    let fd = anon_fds::timerfd_create(t.clockid, libc::TFD_CLOEXEC)?;
    let raw = fd.as_raw_fd();
    let abs = t.settime_flags & anon_fds::TFD_TIMER_ABSTIME != 0;
    let value = match (t.value_ns, abs) {
        (0, _) => 0,
        (v, false) => v,
        (_, true) if wall_clock(t.clockid) && t.deadline_ns != 0 => t.deadline_ns,
        // A monotonic clock starts anew with every boot: keep the time left instead.
        (v, true) => anon_fds::clock_now_ns(t.clockid)? + v,
    };
    anon_fds::timerfd_settime(raw, t.settime_flags, value, t.interval_ns)?;
    if t.ticks > 0 {
        match anon_fds::timerfd_set_ticks(raw, t.ticks) {
            Ok(()) => {}
            Err(e) if e.errno == libc::ENOTTY && t.value_ns == 0 && t.interval_ns == 0 => {
                // Without CONFIG_CHECKPOINT_RESTORE: let a one-shot timer expire once more
                // (the settime flags then read 0).
                log::warn!("timerfd: {e}; re-arming it to expire at once");
                anon_fds::timerfd_settime(raw, 0, 1, 0)?;
            }
            Err(e) => return Err(e),
        }
    }
    Ok(fd)
}

// ---------------------------------------------------------------------------------------------
// signalfd

fn capture_signalfd(
    pid: i32,
    fd: i32,
    link: &str,
    info: &[(String, String)],
) -> Result<SignalfdDesc> {
    let sigmask = value(info, "sigmask")
        .and_then(|v| u64::from_str_radix(v, 16).ok())
        .ok_or_else(|| unsupported(pid, fd, link, "unreadable fdinfo field sigmask".into()))?;
    Ok(SignalfdDesc { sigmask })
}

// ---------------------------------------------------------------------------------------------
// inotify

fn capture_inotify(
    pid: i32,
    fd: i32,
    link: &str,
    info: &[(String, String)],
) -> Result<InotifyDesc> {
    let copy = take_copy(pid, fd)?;
    let queued = fdops::fionread(copy.as_raw_fd()).ctx(pid, || {
        format!("count the events queued in inotify fd {fd}")
    })?;
    if queued > 0 {
        return Err(unsupported(
            pid,
            fd,
            link,
            format!(
                "{queued} bytes of inotify events are queued and not read yet; they cannot be \
                 captured without consuming them (retry once the process has read them)"
            ),
        ));
    }
    let mut mounts = MountCache::default();
    let mut watches = Vec::new();
    for (k, v) in info {
        if k != "inotify wd" {
            continue;
        }
        let f = fields(v);
        let parsed = (|| {
            let wd = i32::from_str_radix(field(&f, "")?, 16).ok()?;
            let handle_type = i32::from_str_radix(field(&f, "fhandle-type")?, 16).ok()?;
            let h = field(&f, "f_handle")?;
            let handle = (0..h.len() / 2)
                .map(|i| u8::from_str_radix(&h[2 * i..2 * i + 2], 16).ok())
                .collect::<Option<Vec<u8>>>()?;
            Some((
                wd,
                hex(&f, "ino")?,
                hex(&f, "sdev")?,
                hex(&f, "mask")? as u32,
                handle_type,
                handle,
            ))
        })();
        let Some((wd, ino, sdev, mask, handle_type, handle)) = parsed else {
            return Err(unsupported(
                pid,
                fd,
                link,
                format!(
                    "the watch \"inotify wd:{v}\" carries no usable file handle (its \
                     filesystem cannot name its files by handle), so it cannot be resolved \
                     to a path"
                ),
            ));
        };
        let dev = user_dev(sdev);
        let path = resolve_handle(&mut mounts, dev, ino, handle_type, &handle).map_err(|why| {
            unsupported(
                pid,
                fd,
                link,
                format!(
                    "watch {wd} (inode {ino} on device {}:{}) cannot be resolved to a path: {why}",
                    libc::major(dev),
                    libc::minor(dev)
                ),
            )
        })?;
        watches.push(InotifyWatch {
            wd,
            path,
            mask,
            dev,
            ino,
            handle_type,
            handle,
        });
    }
    watches.sort_by_key(|w| w.wd);
    Ok(InotifyDesc { watches })
}

/// One open directory per filesystem, to resolve file handles against.
#[derive(Default)]
struct MountCache {
    by_dev: HashMap<u64, OwnedFd>,
}

/// Undoes the octal escapes (\040 ...) of /proc/PID/mountinfo.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 4 <= b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push(u8::from_str_radix(&s[i + 1..i + 4], 8).unwrap_or(b'?'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl MountCache {
    fn mount_fd(&mut self, dev: u64) -> std::result::Result<RawFd, String> {
        if let Some(fd) = self.by_dev.get(&dev) {
            return Ok(fd.as_raw_fd());
        }
        let text = std::fs::read_to_string("/proc/self/mountinfo")
            .map_err(|e| format!("read /proc/self/mountinfo: {e}"))?;
        let want = format!("{}:{}", libc::major(dev), libc::minor(dev));
        // Mounts of the whole filesystem first: a handle may name a file outside a bind mount.
        let mut candidates: Vec<(bool, String)> = text
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split(' ').collect();
                (f.len() > 4 && f[2] == want).then(|| (f[3] != "/", unescape(f[4])))
            })
            .collect();
        candidates.sort();
        for (_, mnt) in candidates {
            if let Ok(fd) = fdops::open_path(
                &mnt,
                libc::O_RDONLY | libc::O_CLOEXEC | libc::O_NONBLOCK | libc::O_NOCTTY,
                0,
            ) {
                let raw = fd.as_raw_fd();
                self.by_dev.insert(dev, fd);
                return Ok(raw);
            }
        }
        Err(format!("no mount of device {want} is visible to ferry"))
    }
}

/// The path of the object a file handle names, checked to lead to the inode `ino` of `dev`.
fn resolve_handle(
    mounts: &mut MountCache,
    dev: u64,
    ino: u64,
    handle_type: i32,
    handle: &[u8],
) -> std::result::Result<String, String> {
    let mfd = mounts.mount_fd(dev)?;
    let obj = anon_fds::open_by_handle_at(mfd, handle_type, handle, libc::O_PATH | libc::O_CLOEXEC)
        .map_err(|e| e.to_string())?;
    let path = std::fs::read_link(format!("/proc/self/fd/{}", obj.as_raw_fd()))
        .map_err(|e| format!("readlink: {e}"))?
        .to_string_lossy()
        .into_owned();
    if path.ends_with(" (deleted)") {
        return Err(format!("it has been deleted ({path})"));
    }
    match std::fs::symlink_metadata(&path) {
        Ok(md) if md.dev() == dev && md.ino() == ino => Ok(path),
        Ok(_) => Err(format!("{path} now names another file")),
        Err(e) => Err(format!("{path}: {e}")),
    }
}

fn open_inotify(
    d: &FileDesc,
    n: &InotifyDesc,
    creds: &ferry_sys::fsid::FsCreds,
) -> Result<OwnedFd> {
    let me = std::process::id() as i32;
    let fd = anon_fds::inotify_init1(libc::IN_CLOEXEC | libc::IN_NONBLOCK)
        .ctx(me, || "create an inotify instance".into())?;
    let raw = fd.as_raw_fd();
    // Watch descriptors are handed out cyclically, each one past the last: watches added and
    // removed at once on a file of our own move the counter to each old number.
    let mut dummy: Option<OwnedFd> = None;
    let mut next = 1;
    for w in &n.watches {
        if w.wd < next || w.wd - next > MAX_WD_SKIP {
            return Err(Error::Restore {
                pid: me,
                what: format!(
                    "file {}: cannot give inotify watch {} ({}) its descriptor back",
                    d.id, w.wd, w.path
                ),
            });
        }
        while next < w.wd {
            if dummy.is_none() {
                dummy = Some(
                    fdops::memfd_create("ferry-inotify-wd", libc::MFD_CLOEXEC)
                        .ctx(me, || "create a file to skip watch descriptors with".into())?,
                );
            }
            let p = format!(
                "/proc/self/fd/{}",
                dummy.as_ref().map_or(-1, |f| f.as_raw_fd())
            );
            let got = anon_fds::inotify_add_watch(raw, &p, IN_ATTRIB)
                .ctx(me, || "add a watch to skip watch descriptors".into())?;
            anon_fds::inotify_rm_watch(raw, got)
                .ctx(me, || "remove a watch to skip watch descriptors".into())?;
            next = got + 1;
        }
        // Added with the process's rights (the kernel checks read permission on the watched
        // object as the caller), on the object captured, found without following links.
        let added =
            ferry_sys::fsid::with_fs_creds(creds, || -> std::result::Result<i32, String> {
                let o = open_captured(libc::AT_FDCWD, &w.path, w.dev, w.ino)?;
                let through = format!("/proc/self/fd/{}", o.as_raw_fd());
                anon_fds::inotify_add_watch(raw, &through, w.mask).map_err(|e| e.to_string())
            });
        let got = added
            .map_err(|e| e.to_string())
            .and_then(|r| r)
            .map_err(|e| Error::Restore {
                pid: me,
                what: format!(
                    "re-add inotify watch {} on {} (as {creds}): {e}",
                    w.wd, w.path
                ),
            })?;
        if got != w.wd {
            return Err(Error::Restore {
                pid: me,
                what: format!(
                    "inotify watch on {} came back as watch {got}, not {} (two watches now \
                     name the same file?)",
                    w.path, w.wd
                ),
            });
        }
        next = got + 1;
    }
    // Removing the skipping watches queued IN_IGNORED events: read them away.
    let mut buf = [0u8; 4096];
    while let Ok(n) = fdops::read_fd(raw, &mut buf) {
        if n == 0 {
            break;
        }
    }
    Ok(fd)
}

// ---------------------------------------------------------------------------------------------
// fanotify

/// fanotify_init's FAN_CLOEXEC.
const FAN_CLOEXEC: u32 = 0x1;
/// The permission classes (FAN_CLASS_CONTENT, FAN_CLASS_PRE_CONTENT).
const FAN_CLASS_MASK: u32 = 0xc;
/// Mark flags fdinfo shows that a rebuilt mark can be given again.
const FAN_MARK_IGNORED_MASK: u32 = 0x20;
const FAN_MARK_IGNORED_SURV_MODIFY: u32 = 0x40;
const FAN_MARK_EVICTABLE: u32 = 0x200;
const FAN_MARK_MOUNT: u32 = 0x10;
const FAN_MARK_FILESYSTEM: u32 = 0x100;

fn capture_fanotify(
    pid: i32,
    fd: i32,
    link: &str,
    info: &[(String, String)],
) -> Result<FanotifyDesc> {
    let refuse = |why: String| unsupported(pid, fd, link, format!("a fanotify group: {why}"));
    let head =
        value(info, "fanotify flags").ok_or_else(|| refuse("its fdinfo shows no flags".into()))?;
    let f = fields(head);
    let (Some(flags), Some(event_flags)) = (hex(&f, ""), hex(&f, "event-flags")) else {
        return Err(refuse(format!("unreadable flags ({head:?})")));
    };
    let flags = flags as u32;
    if flags & FAN_CLASS_MASK != 0 {
        return Err(refuse(
            "of a permission class (FAN_CLASS_CONTENT or FAN_CLASS_PRE_CONTENT): the accesses \
             waiting for its replies are not captured"
                .into(),
        ));
    }
    let copy = take_copy(pid, fd)?;
    let queued = fdops::fionread(copy.as_raw_fd()).ctx(pid, || {
        format!("count the events queued in fanotify fd {fd}")
    })?;
    if queued > 0 {
        return Err(refuse(format!(
            "{queued} bytes of events are queued and not read yet; they cannot be captured \
             without consuming them (retry once the process has read them)"
        )));
    }
    let mut mounts = MountCache::default();
    let mut marks = Vec::new();
    for (k, v) in info.iter().filter(|(k, _)| k.starts_with("fanotify ")) {
        let target = match k.as_str() {
            "fanotify flags" => continue,
            "fanotify ino" => FanotifyTarget::Inode,
            "fanotify mnt_id" => FanotifyTarget::Mount,
            "fanotify sdev" => FanotifyTarget::Filesystem,
            _ => {
                return Err(refuse(format!(
                    "its mark \"{k}:{v}\" is of a kind Ferry does not know"
                )))
            }
        };
        let f = fields(v);
        if target != FanotifyTarget::Inode {
            marks.push(
                mount_mark(pid, target, &f).map_err(|why| {
                    refuse(format!("its mark \"{k}:{v}\" cannot be rebuilt: {why}"))
                })?,
            );
            continue;
        }
        let parsed = (|| {
            let h = field(&f, "f_handle")?;
            let handle = (0..h.len() / 2)
                .map(|i| u8::from_str_radix(&h[2 * i..2 * i + 2], 16).ok())
                .collect::<Option<Vec<u8>>>()?;
            Some((
                hex(&f, "")?,
                hex(&f, "sdev")?,
                hex(&f, "mflags")? as u32,
                hex(&f, "mask")?,
                hex(&f, "ignored_mask")?,
                i32::from_str_radix(field(&f, "fhandle-type")?, 16).ok()?,
                handle,
            ))
        })();
        let Some((ino, sdev, mflags, mask, ignored_mask, handle_type, handle)) = parsed else {
            return Err(refuse(format!(
                "its mark \"{k}:{v}\" carries no usable file handle, so it cannot be resolved \
                 to a path"
            )));
        };
        if mflags & !(FAN_MARK_IGNORED_SURV_MODIFY | FAN_MARK_EVICTABLE) != 0 {
            return Err(refuse(format!(
                "its mark \"{k}:{v}\" has mark flags {mflags:#x} Ferry does not rebuild"
            )));
        }
        let dev = user_dev(sdev);
        let path = resolve_handle(&mut mounts, dev, ino, handle_type, &handle).map_err(|why| {
            refuse(format!(
                "its mark on inode {ino} of device {}:{} cannot be resolved to a path: {why}",
                libc::major(dev),
                libc::minor(dev)
            ))
        })?;
        marks.push(FanotifyMark {
            target,
            path,
            dev,
            ino,
            mflags,
            mask,
            ignored_mask,
            handle_type,
            handle,
        });
    }
    Ok(FanotifyDesc {
        flags,
        event_flags: event_flags as u32,
        marks,
    })
}

/// A mount mark (`fanotify mnt_id:ID mflags:.. mask:.. ignored_mask:..`) or a filesystem mark
/// (`fanotify sdev:DEV ...`) of a group of `pid`: the mount's root, or the root of a mount of
/// that filesystem (a whole one first), as the process sees it (its mountinfo), with the device
/// and inode found there.
fn mount_mark(
    pid: i32,
    target: FanotifyTarget,
    f: &[(&str, &str)],
) -> std::result::Result<FanotifyMark, String> {
    let (Some(id), Some(mflags), Some(mask), Some(ignored_mask)) = (
        hex(f, ""),
        hex(f, "mflags"),
        hex(f, "mask"),
        hex(f, "ignored_mask"),
    ) else {
        return Err("its fields are unreadable".into());
    };
    let mflags = mflags as u32;
    if mflags & !(FAN_MARK_IGNORED_SURV_MODIFY | FAN_MARK_EVICTABLE) != 0 {
        return Err(format!("mark flags {mflags:#x} Ferry does not rebuild"));
    }
    let text = std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))
        .map_err(|e| format!("read /proc/{pid}/mountinfo: {e}"))?;
    let mounts: Vec<Vec<&str>> = text
        .lines()
        .map(|l| l.split(' ').collect::<Vec<&str>>())
        .filter(|f| f.len() > 4)
        .collect();
    let found = match target {
        FanotifyTarget::Mount => mounts
            .iter()
            .find(|m| m[0].parse::<u64>().ok() == Some(id))
            .ok_or_else(|| format!("mount {id} is not in the process's mount namespace"))?,
        _ => {
            let dev = user_dev(id);
            let want = format!("{}:{}", libc::major(dev), libc::minor(dev));
            mounts
                .iter()
                .filter(|m| m[2] == want)
                .min_by_key(|m| m[3] != "/")
                .ok_or_else(|| format!("no mount of device {want} is in its mount namespace"))?
        }
    };
    let path = unescape(found[4]);
    let md = std::fs::metadata(format!("/proc/{pid}/root{path}"))
        .map_err(|e| format!("stat {path}: {e}"))?;
    Ok(FanotifyMark {
        target,
        path,
        dev: md.dev(),
        ino: md.ino(),
        mflags,
        mask,
        ignored_mask,
        handle_type: 0,
        handle: Vec::new(),
    })
}

fn open_fanotify(
    d: &FileDesc,
    n: &FanotifyDesc,
    creds: &ferry_sys::fsid::FsCreds,
    mount_root: Option<&str>,
) -> Result<OwnedFd> {
    let me = std::process::id() as i32;
    // With the very flags of the original (fdinfo shows them), FAN_CLOEXEC and FAN_NONBLOCK
    // included; our copy is made close-on-exec at once.
    let made = anon_fds::fanotify_init(n.flags, n.event_flags).ctx(me, || {
        format!(
            "file {}: create a fanotify group (flags {:#x}, event flags {:#x})",
            d.id, n.flags, n.event_flags
        )
    })?;
    let fd = if n.flags & FAN_CLOEXEC == 0 {
        fdops::dup_cloexec(made.as_raw_fd())
            .ctx(me, || format!("file {}: copy its fanotify group", d.id))?
    } else {
        made
    };
    let raw = fd.as_raw_fd();
    // fdinfo lists a group's marks newest first: added oldest first, they list as they did.
    for m in n.marks.iter().rev() {
        // A mount is found in the tree's mount namespace (its path from that root, which is
        // ours to open: the process's rights are for its files).
        let root = match (m.target, mount_root) {
            (FanotifyTarget::Mount, Some(r)) => {
                Some(std::fs::File::open(r).map_err(|e| Error::Restore {
                    pid: me,
                    what: format!("file {}: open {r} to mark {} again: {e}", d.id, m.path),
                })?)
            }
            _ => None,
        };
        // Added with the process's rights (the kernel checks read permission on the marked
        // object as the caller), on the object captured, found without following links.
        let added = ferry_sys::fsid::with_fs_creds(creds, || -> std::result::Result<(), String> {
            let (dirfd, path) = match &root {
                Some(r) => (r.as_raw_fd(), format!(".{}", m.path)),
                None => (libc::AT_FDCWD, m.path.clone()),
            };
            let o = open_captured(dirfd, &path, m.dev, m.ino)?;
            let through = format!("/proc/self/fd/{}", o.as_raw_fd());
            let evictable = m.mflags & FAN_MARK_EVICTABLE
                | match m.target {
                    FanotifyTarget::Inode => 0,
                    FanotifyTarget::Mount => FAN_MARK_MOUNT,
                    FanotifyTarget::Filesystem => FAN_MARK_FILESYSTEM,
                };
            if m.mask != 0 {
                anon_fds::fanotify_mark(raw, libc::FAN_MARK_ADD | evictable, m.mask, &through)
                    .map_err(|e| e.to_string())?;
            }
            if m.ignored_mask != 0 || m.mflags & FAN_MARK_IGNORED_SURV_MODIFY != 0 {
                let surv = m.mflags & FAN_MARK_IGNORED_SURV_MODIFY;
                anon_fds::fanotify_mark(
                    raw,
                    libc::FAN_MARK_ADD | FAN_MARK_IGNORED_MASK | surv | evictable,
                    m.ignored_mask,
                    &through,
                )
                .map_err(|e| e.to_string())?;
            }
            Ok(())
        });
        added
            .map_err(|e| e.to_string())
            .and_then(|r| r)
            .map_err(|e| Error::Restore {
                pid: me,
                what: format!(
                    "file {}: mark {} again in its fanotify group (as {creds}): {e}",
                    d.id, m.path
                ),
            })?;
    }
    Ok(fd)
}

// ---------------------------------------------------------------------------------------------

/// Recreates the open file description `d` in this (the restoring) process; what it does by
/// path (inotify watches) with the file-system rights `creds` of the process holding it.
///
/// `mount_root`: where the tree's mount namespace is seen from here (`/proc/PID/root` of a
/// process in it), when it is rebuilt in one of its own: fanotify mount marks are made there.
pub fn open(
    d: &FileDesc,
    creds: &ferry_sys::fsid::FsCreds,
    mount_root: Option<&str>,
) -> Result<OwnedFd> {
    let me = std::process::id() as i32;
    match &d.kind {
        FileKind::Epoll(e) => {
            let fd = anon_fds::epoll_create1(libc::EPOLL_CLOEXEC)
                .ctx(me, || format!("recreate epoll instance {}", d.id))?;
            PENDING_EPOLL
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(
                    d.id,
                    PendingEpoll {
                        ours: fd.as_raw_fd(),
                        items: e.items.clone(),
                        added: 0,
                    },
                );
            Ok(fd)
        }
        FileKind::Timerfd(t) => {
            open_timerfd(t).ctx(me, || format!("recreate timerfd {} ({t:?})", d.id))
        }
        FileKind::Signalfd(s) => anon_fds::signalfd(s.sigmask, libc::SFD_CLOEXEC).ctx(me, || {
            format!("recreate signalfd {} (mask {:#x})", d.id, s.sigmask)
        }),
        FileKind::Inotify(n) => open_inotify(d, n, creds),
        FileKind::Fanotify(n) => open_fanotify(d, n, creds, mount_root),
        _ => Err(Error::BadImage(format!(
            "file {}: {:?} is not an anonymous-inode descriptor",
            d.id, d.kind
        ))),
    }
}

/// Completes state that refers to the process's descriptor numbers, once all are installed:
/// the epoll items this process registered.
pub fn after_install(h: &Husk, p: &Process) -> Result<()> {
    restore_epoll_items(h, p)
}

/// Opens (O_PATH, no symbolic link anywhere in `path`, relative to `dirfd`) the object a watch
/// or mark was captured on, and checks that it is still that object (device `dev`, inode
/// `ino`); the error says what differs. Called with the process's file-system credentials.
fn open_captured(
    dirfd: RawFd,
    path: &str,
    dev: u64,
    ino: u64,
) -> std::result::Result<OwnedFd, String> {
    let o = ferry_sys::fsid::openat2(
        dirfd,
        path,
        libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        0,
        libc::RESOLVE_NO_SYMLINKS,
    )
    .map_err(|e| match e.errno {
        libc::ELOOP => "a symbolic link is in its path now".to_string(),
        _ => e.to_string(),
    })?;
    let md =
        std::fs::metadata(format!("/proc/self/fd/{}", o.as_raw_fd())).map_err(|e| e.to_string())?;
    if (md.dev(), md.ino()) != (dev, ino) {
        return Err(format!(
            "not the file that was captured (inode {} on device {:#x} now, inode {} on device \
             {:#x} captured); refused",
            md.ino(),
            md.dev(),
            ino,
            dev
        ));
    }
    Ok(o)
}
