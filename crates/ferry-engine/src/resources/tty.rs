//! Pseudo-terminals (Unix 98 ptys): the master (/dev/ptmx) and slave (/dev/pts/N) sides, and a
//! pty as a session's controlling terminal with its foreground process group.
//!
//! - **capture**: the pty's state is read through a copy of the master descriptor (on a master,
//!   the terminal ioctls reach the slave side): pts number, termios (TCGETS2), window size,
//!   packet mode, lock, the session it controls and its foreground group. Input queued for the
//!   slave is read out through a slave of our own and written straight back to the master, in
//!   order, so the live tree loses nothing; that is only exact without any input or echo
//!   processing (raw mode), so queued input is refused otherwise. Output not yet read from the
//!   master is refused. A slave whose master is neither held in the checkpointed tree nor in
//!   flight in its sockets' queues (SCM_RIGHTS: checked once the whole tree is captured,
//!   [`check_masters`]), and a pty controlling a session whose leader is not in the tree, are
//!   refused.
//! - **restore**: /dev/ptmx is opened until the same pts number comes back (lower ones are held
//!   meanwhile, then closed), unlocked, given its termios, window size, packet mode and queued
//!   input. A session leader takes it as its controlling terminal (TIOCSCTTY, injected) as soon
//!   as it is made, before it forks the rest of its session, which so inherit it; the
//!   foreground group is set (TIOCSPGRP) once every process exists.

use crate::error::{Context, Error, Result};
use crate::husk::Husk;
use crate::procfs;
use ferry_image::{FileDesc, FileKind, Process, PtyState, Termios, Tree, TtyDesc};
use ferry_sys::{fdops, pidfd, tty};
use std::collections::{BTreeMap, HashSet};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const TTYAUX_MAJOR: u32 = 5;
const PTMX_MINOR: u32 = 2;
const TTY_MINOR: u32 = 0;
const PTS_MAJOR_FIRST: u32 = 136;
const PTS_MAJOR_LAST: u32 = 143;
/// How long restore waits for a pts number still held by a terminal being torn down.
const INDEX_WAIT: Duration = Duration::from_secs(3);

fn unsupported(pid: i32, fd: i32, path: &str, why: String) -> Error {
    Error::Unsupported {
        pid,
        what: format!("fd {fd} ({path})"),
        why,
    }
}

/// Describes descriptor `fd` of `pid`, a character device at `path`, if it is a pty side;
/// `None` for any other device.
///
/// With `relay` (a migration from the tree's home), a slave whose master is outside the tree
/// is captured as relayed (`TtyDesc::relayed`) instead of refused; so is, in a body moving on,
/// the slave of a pty whose master its node's daemon holds as the stand-in for its terminal at
/// home (relay id `RELAY_TTY` | its number among `standins`' ids), with the home's settings
/// (the pty's, which its relay keeps in step with the home terminal's, without the `EXTPROC`
/// the relay added).
pub fn classify(
    pid: i32,
    fd: i32,
    path: &str,
    md: &std::fs::Metadata,
    relay: bool,
    standins: &std::collections::HashMap<u64, u32>,
) -> Result<Option<FileKind>> {
    let (major, minor) = (libc::major(md.rdev()), libc::minor(md.rdev()));
    if major == TTYAUX_MAJOR && minor == PTMX_MINOR {
        return capture_master(pid, fd, path).map(Some);
    }
    if major == TTYAUX_MAJOR && minor == TTY_MINOR && path == "/dev/tty" {
        return capture_dev_tty(pid, fd, path, md.rdev()).map(Some);
    }
    if (PTS_MAJOR_FIRST..=PTS_MAJOR_LAST).contains(&major) {
        let Some(index) = path
            .strip_prefix("/dev/pts/")
            .and_then(|n| n.parse::<u32>().ok())
        else {
            return Err(unsupported(
                pid,
                fd,
                path,
                "a pty slave not reached through /dev/pts (another devpts mount?)".into(),
            ));
        };
        // A master that no process of the tree holds may still be in flight in a queue not
        // read yet: [`check_masters`] looks again once the whole tree is captured.
        let standin = standins
            .values()
            .any(|&id| id == ferry_image::RELAY_TTY | index);
        if (relay || standin) && !master_in_tree(index)? {
            return relayed_slave(pid, fd, index, standin).map(Some);
        }
        return Ok(Some(FileKind::Tty(TtyDesc {
            index,
            master: false,
            state: None,
            relayed: None,
        })));
    }
    Ok(None)
}

/// /dev/tty: a name for the controlling terminal the process had when it opened it. Made again
/// by the rebuilt process itself, once it has its controlling terminal back (`install`): so that
/// terminal must be a pty of the tree, and still the process's.
fn capture_dev_tty(pid: i32, fd: i32, path: &str, rdev: u64) -> Result<FileKind> {
    let pfd = pidfd::pidfd_open(pid).ctx(pid, || "open a pidfd".into())?;
    let copy = pidfd::pidfd_getfd(&pfd, fd).ctx(pid, || format!("copy fd {fd}"))?;
    let real = tty::real_dev(copy.as_raw_fd())
        .ctx(pid, || format!("the terminal behind fd {fd} (/dev/tty)"))?;
    let stat = procfs::read(pid, "stat")?;
    let ctty: Option<u32> = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(4)?.parse().ok());
    let (major, minor) = (libc::major(u64::from(real)), libc::minor(u64::from(real)));
    if ctty != Some(real) {
        return Err(unsupported(
            pid,
            fd,
            path,
            format!(
                "it was opened for terminal {major}:{minor}, which is no longer the process's \
                 controlling terminal, so opening /dev/tty again would not reach it"
            ),
        ));
    }
    if !(PTS_MAJOR_FIRST..=PTS_MAJOR_LAST).contains(&major) {
        return Err(unsupported(
            pid,
            fd,
            path,
            format!("its terminal {major}:{minor} is not a pty (a console or virtual terminal)"),
        ));
    }
    let index = (major - PTS_MAJOR_FIRST) * 256 + minor;
    if !master_in_tree(index)? {
        return Err(unsupported(
            pid,
            fd,
            path,
            format!(
                "its terminal /dev/pts/{index} is not made again as the process's controlling \
                 terminal (its master is not held in the tree)"
            ),
        ));
    }
    Ok(FileKind::Device {
        path: path.into(),
        rdev,
        terminal: None,
        kmsg_seq: None,
    })
}

/// Whether description `d` is /dev/tty (made again inside its process by [`install_dev_tty`]).
pub fn is_dev_tty(d: &FileDesc) -> bool {
    matches!(&d.kind, FileKind::Device { path, rdev, .. }
        if path == "/dev/tty"
            && libc::major(*rdev) == TTYAUX_MAJOR
            && libc::minor(*rdev) == TTY_MINOR)
}

/// Opens /dev/tty at descriptor `fd` of the rebuilt process `h` (which has its controlling
/// terminal back), with open flags `flags`.
pub fn install_dev_tty(h: &Husk, fd: i32, flags: i32, cloexec: bool) -> Result<()> {
    let inj = h.injector();
    let fail = |e: crate::Error| Error::Restore {
        pid: h.pid,
        what: format!("fd {fd}: open /dev/tty: {e}"),
    };
    let path = inj
        .write_scratch(0, b"/dev/tty\0")
        .map_err(|e| fail(e.into()))?;
    let keep = flags & (libc::O_ACCMODE | libc::O_NONBLOCK | libc::O_APPEND);
    let open_flags = keep | libc::O_NOCTTY | if cloexec { libc::O_CLOEXEC } else { 0 };
    let got = inj
        .syscall(
            "openat",
            libc::SYS_openat,
            &[libc::AT_FDCWD as u64, path, open_flags as u64, 0],
        )
        .map_err(|e| fail(e.into()))? as i32;
    if got != fd {
        let c = if cloexec { libc::O_CLOEXEC as u64 } else { 0 };
        inj.syscall("dup3", libc::SYS_dup3, &[got as u64, fd as u64, c])
            .map_err(|e| fail(e.into()))?;
        inj.syscall("close", libc::SYS_close, &[got as u64])
            .map_err(|e| fail(e.into()))?;
    }
    Ok(())
}

/// A slave of a terminal outside the tree: its termios and window size, read through a copy of
/// the process's descriptor (on a slave, these ioctls need no controlling terminal). A
/// `standin` (a body's pty relayed to its terminal at home) reads as the home's: without the
/// `EXTPROC` its relay added ([`passthrough`]).
fn relayed_slave(pid: i32, fd: i32, index: u32, standin: bool) -> Result<FileKind> {
    let pfd = pidfd::pidfd_open(pid).ctx(pid, || "open a pidfd".into())?;
    let copy = pidfd::pidfd_getfd(&pfd, fd).ctx(pid, || format!("copy fd {fd}"))?;
    let mut termios = tty::get_termios(copy.as_raw_fd())
        .ctx(pid, || format!("termios of fd {fd} (/dev/pts/{index})"))?;
    if standin {
        termios.lflag &= !libc::EXTPROC;
    }
    let winsize = tty::get_winsize(copy.as_raw_fd())
        .ctx(pid, || format!("window size of fd {fd} (/dev/pts/{index})"))?;
    Ok(FileKind::Tty(TtyDesc {
        index,
        master: false,
        state: None,
        relayed: Some(PtyState {
            termios: to_image(termios),
            winsize,
            ..Default::default()
        }),
    }))
}

/// The termios of a relayed terminal's pty at the body's node: the home terminal's, so that
/// the body reads what it would read at home (tcgetattr), with `EXTPROC` added and output
/// processing off: the home terminal's own line discipline does the work (echo, line editing,
/// ^C and ^Z as signals for the home's foreground group, which the deputy forwards; its output
/// processing), and the body's pty passes input on as it comes (EXTPROC: "done elsewhere").
/// Output is processed on both sides (a newline reaches the home terminal as CR CR LF when both
/// have ONLCR, which looks the same). What the body sets (tcsetattr) its node sends home
/// (`ferry-daemon/src/relay.rs`, `RelayTermios`), without EXTPROC.
fn passthrough(home: &Termios) -> Termios {
    Termios {
        lflag: home.lflag | libc::EXTPROC,
        ..home.clone()
    }
}

/// Masters of relayed terminals made by this restore, by relay id, for the daemon to take
/// (`take_relayed`).
static RELAYED: Mutex<Vec<(u32, OwnedFd)>> = Mutex::new(Vec::new());

/// The masters of relayed terminals this restore made (and forgets them).
pub fn take_relayed() -> Vec<(u32, OwnedFd)> {
    std::mem::take(&mut *RELAYED.lock().unwrap_or_else(|e| e.into_inner()))
}

/// Every process frozen by us (traced by one of our threads).
fn frozen_pids() -> Result<Vec<i32>> {
    let me = std::process::id() as i32;
    let mine: HashSet<i32> = procfs::tids(me)?.into_iter().collect();
    let mut out = Vec::new();
    let dir = std::fs::read_dir("/proc").ctx(me, || "list /proc".into())?;
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let traced = procfs::status(pid)
            .ok()
            .and_then(|s| procfs::field(&s, "TracerPid").parse::<i32>().ok())
            .is_some_and(|t| mine.contains(&t));
        if traced {
            out.push(pid);
        }
    }
    Ok(out)
}

/// Once the whole tree is captured: refuses a pty slave whose master is neither held by a
/// process of the tree nor in flight (SCM_RIGHTS) in the queue of one of its sockets; a slave
/// taken for relayed (its master was not met yet) whose master was met in flight is not.
pub fn check_masters(tree: &mut Tree) -> Result<()> {
    let masters: HashSet<u32> = tree
        .files
        .iter()
        .filter_map(tty_of)
        .filter(|t| t.master)
        .map(|t| t.index)
        .collect();
    for f in tree.files.iter_mut() {
        if let FileKind::Tty(t) = &mut f.kind {
            if !t.master && masters.contains(&t.index) {
                t.relayed = None;
            }
        }
    }
    for f in &tree.files {
        let Some(t) = tty_of(f).filter(|t| !t.master) else {
            continue;
        };
        let holder = tree
            .processes
            .iter()
            .find_map(|p| p.fds.iter().find(|d| d.file == f.id).map(|d| (p.pid, d.fd)));
        let (pid, fd) = holder.unwrap_or((tree.root_pid, -1));
        if t.relayed.is_some() && holder.is_none() {
            return Err(unsupported(
                pid,
                fd,
                &format!("/dev/pts/{}", t.index),
                "a slave of a terminal outside the tree, in flight (SCM_RIGHTS): only a \
                 terminal that a process of the tree holds is relayed from home"
                    .into(),
            ));
        }
        if t.relayed.is_some() || masters.contains(&t.index) {
            continue;
        }
        return Err(unsupported(
            pid,
            fd,
            &format!("/dev/pts/{}", t.index),
            format!(
                "the master side of /dev/pts/{} is not held by any process of the checkpointed \
                 tree (a terminal provided from outside, e.g. by sshd or a terminal emulator), \
                 so the pty cannot be recreated",
                t.index
            ),
        ));
    }
    Ok(())
}

/// Whether a frozen process holds the master of pty `index` (one in flight is found only by
/// [`check_masters`]: our own copies are not the tree's, a daemon holds relays' masters).
fn master_in_tree(index: u32) -> Result<bool> {
    for q in frozen_pids()? {
        let Ok(fds) = procfs::fds(q) else { continue };
        let Ok(pfd) = pidfd::pidfd_open(q) else {
            continue;
        };
        for n in fds {
            let link = procfs::readlink(q, &format!("fd/{n}")).unwrap_or_default();
            if link != "/dev/ptmx" && link != "/dev/pts/ptmx" {
                continue;
            }
            if let Ok(copy) = pidfd::pidfd_getfd(&pfd, n) {
                if tty::ptn(copy.as_raw_fd()).ok() == Some(index) {
                    return Ok(true);
                }
            }
        }
    }
    Ok(false)
}

fn to_image(t: tty::Termios) -> Termios {
    Termios {
        iflag: t.iflag,
        oflag: t.oflag,
        cflag: t.cflag,
        lflag: t.lflag,
        line: t.line,
        cc: t.cc,
        ispeed: t.ispeed,
        ospeed: t.ospeed,
    }
}

fn from_image(t: &Termios) -> tty::Termios {
    tty::Termios {
        iflag: t.iflag,
        oflag: t.oflag,
        cflag: t.cflag,
        lflag: t.lflag,
        line: t.line,
        cc: t.cc.clone(),
        ispeed: t.ispeed,
        ospeed: t.ospeed,
    }
}

/// Whether bytes written to the master reach the slave's reader exactly as they are, with no
/// echo, signals or line editing: only then can queued input be read out and put back.
fn input_passes_through(t: &Termios) -> bool {
    let iflag_mangles = libc::IGNBRK
        | libc::BRKINT
        | libc::PARMRK
        | libc::ISTRIP
        | libc::INLCR
        | libc::IGNCR
        | libc::ICRNL
        | libc::IUCLC
        | libc::IXON;
    let lflag_mangles = libc::ICANON | libc::ECHO | libc::ECHONL | libc::ISIG | libc::IEXTEN;
    t.iflag & iflag_mangles == 0 && t.lflag & lflag_mangles == 0
}

fn capture_master(pid: i32, fd: i32, path: &str) -> Result<FileKind> {
    let pfd = pidfd::pidfd_open(pid).ctx(pid, || "open a pidfd".into())?;
    let copy = pidfd::pidfd_getfd(&pfd, fd).ctx(pid, || format!("take a copy of fd {fd}"))?;
    let m = copy.as_raw_fd();
    let what = |op: &str| format!("{op} of pty master fd {fd}");
    let index = tty::ptn(m).ctx(pid, || what("pts number"))?;
    let termios = to_image(tty::get_termios(m).ctx(pid, || what("termios"))?);
    let winsize = tty::get_winsize(m).ctx(pid, || what("window size"))?;
    let packet_mode = tty::packet_mode(m).ctx(pid, || what("packet mode"))?;
    let locked = tty::locked(m).ctx(pid, || what("lock state"))?;
    let session = match tty::sid(m) {
        Ok(s) => s,
        Err(e) if e.errno == libc::ENOTTY => 0,
        Err(e) => return Err(e).ctx(pid, || what("session")),
    };
    let fg_pgrp = if session != 0 {
        tty::pgrp(m).ctx(pid, || what("foreground process group"))?
    } else {
        0
    };
    if session != 0 {
        let frozen = frozen_pids()?;
        let leader_ok =
            frozen.contains(&session) && procfs::stat(session).is_ok_and(|s| s.sid == session);
        if !leader_ok {
            return Err(unsupported(
                pid,
                fd,
                path,
                format!(
                    "/dev/pts/{index} is the controlling terminal of session {session}, whose \
                     leader is not part of the checkpointed tree"
                ),
            ));
        }
        if fg_pgrp != 0
            && !frozen
                .iter()
                .any(|q| procfs::stat(*q).is_ok_and(|s| s.pgid == fg_pgrp))
        {
            return Err(unsupported(
                pid,
                fd,
                path,
                format!(
                    "the foreground process group {fg_pgrp} of /dev/pts/{index} has no process \
                     in the checkpointed tree"
                ),
            ));
        }
    }
    let (output, slave_owner) = if locked {
        let queued = fdops::fionread(m).ctx(pid, || what("bytes queued"))?;
        if queued > 0 {
            return Err(unsupported(
                pid,
                fd,
                path,
                format!(
                    "{queued} bytes written on /dev/pts/{index} are not read from the master \
                     yet, and its slave is locked (TIOCSPTLCK): they cannot be put back"
                ),
            ));
        }
        (Vec::new(), None)
    } else {
        take_output(pid, m, index, packet_mode)?
    };
    let input = if locked {
        Vec::new()
    } else {
        take_input(pid, fd, path, m, index, &termios)?
    };
    Ok(FileKind::Tty(TtyDesc {
        index,
        master: true,
        state: Some(PtyState {
            termios,
            winsize,
            packet_mode,
            locked,
            session,
            fg_pgrp,
            input,
            output,
            slave_owner,
        }),
        relayed: None,
    }))
}

/// A pty slave's owner, group and mode.
type SlaveOwner = (u32, u32, u32);

/// Reads the output queued on master `m` (what its slave wrote and the master has not read)
/// and writes it straight back through the slave with output processing off, so that the
/// master reads the same bytes again; and the slave's owner, group and mode.
fn take_output(
    pid: i32,
    m: i32,
    index: u32,
    packet_mode: bool,
) -> Result<(Vec<u8>, Option<SlaveOwner>)> {
    let flags = libc::O_RDWR | libc::O_NOCTTY | libc::O_NONBLOCK | libc::O_CLOEXEC;
    let slave =
        tty::open_peer(m, flags).ctx(pid, || format!("open the slave of /dev/pts/{index}"))?;
    let owner = std::fs::File::from(
        slave
            .try_clone()
            .ctx(pid, || format!("dup the slave of /dev/pts/{index}"))?,
    )
    .metadata()
    .ok()
    .map(|md| (md.uid(), md.gid(), md.mode() & 0o7777));
    let mut out = Vec::new();
    let mut buf = vec![0u8; 1 << 16];
    let mut idle = 0;
    // What does not fit the master's read buffer waits in the pty's flip buffers, which the
    // kernel moves in as the master reads (a moment later): look until nothing comes twice.
    while idle < 2 {
        // The description is the process's, blocking: read only what is there.
        let ready = ferry_sys::sockets::poll_now(m, libc::POLLIN)
            .ctx(pid, || format!("poll the master of /dev/pts/{index}"))?;
        let got = if ready & libc::POLLIN != 0 {
            fdops::read_fd(m, &mut buf)
        } else {
            Err(ferry_sys::SysError {
                errno: libc::EAGAIN,
                op: "read",
            })
        };
        match got {
            Ok(0) => break,
            Ok(n) => {
                idle = 0;
                // In packet mode every read starts with a status byte (TIOCPKT_DATA, 0, before
                // data; a control status alone otherwise, which the read consumes).
                let data = if packet_mode { &buf[1..n] } else { &buf[..n] };
                if packet_mode && buf[0] != 0 {
                    log::warn!(
                        "PID {pid}: /dev/pts/{index}: a pending packet-mode status {:#x} was \
                         read with its output and is lost",
                        buf[0]
                    );
                }
                out.extend_from_slice(data);
            }
            Err(e) if e.errno == libc::EAGAIN || e.errno == libc::EIO => {
                idle += 1;
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => {
                return Err(e).ctx(pid, || format!("read the output of /dev/pts/{index}"));
            }
        }
    }
    if !out.is_empty() {
        write_output(slave.as_raw_fd(), &out).ctx(pid, || {
            format!(
                "put {} bytes of output back into /dev/pts/{index} (they were read out)",
                out.len()
            )
        })?;
    }
    Ok((out, owner))
}

/// Writes `data` through slave `s` with its output processing off (OPOST), so that its master
/// reads exactly `data`, then gives the slave its settings back.
fn write_output(s: i32, data: &[u8]) -> ferry_sys::SysResult<()> {
    let t = tty::get_termios(s)?;
    let mut raw = t.clone();
    raw.oflag &= !libc::OPOST;
    tty::set_termios(s, &raw)?;
    let mut done = 0;
    let mut r = Ok(());
    let deadline = Instant::now() + Duration::from_secs(2);
    while done < data.len() {
        match fdops::write_fd(s, &data[done..]) {
            Ok(n) => done += n,
            Err(e) if e.errno == libc::EAGAIN && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(2))
            }
            Err(e) => {
                r = Err(e);
                break;
            }
        }
    }
    tty::set_termios(s, &t)?;
    r
}

/// Reads the input queued for the slave of master `m` and writes it straight back.
fn take_input(
    pid: i32,
    fd: i32,
    path: &str,
    m: i32,
    index: u32,
    termios: &Termios,
) -> Result<Vec<u8>> {
    let flags = libc::O_RDWR | libc::O_NOCTTY | libc::O_NONBLOCK | libc::O_CLOEXEC;
    let slave =
        tty::open_peer(m, flags).ctx(pid, || format!("open the slave of /dev/pts/{index}"))?;
    let queued = fdops::fionread(slave.as_raw_fd())
        .ctx(pid, || format!("bytes queued for /dev/pts/{index}"))?;
    if queued == 0 {
        return Ok(Vec::new());
    }
    if !input_passes_through(termios) {
        return Err(unsupported(
            pid,
            fd,
            path,
            format!(
                "{queued} bytes of input are queued for /dev/pts/{index} and not read yet; \
                 outside raw mode (no ICANON, ECHO, ISIG, IEXTEN, no input translation) they \
                 cannot be read out and put back unchanged (retry once they are read)"
            ),
        ));
    }
    let mut buf = vec![0u8; queued];
    let mut got = 0;
    while got < queued {
        match fdops::read_fd(slave.as_raw_fd(), &mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.errno == libc::EAGAIN => break,
            Err(e) => return Err(e).ctx(pid, || format!("read the input of /dev/pts/{index}")),
        }
    }
    buf.truncate(got);
    put_back(m, &buf).ctx(pid, || {
        format!("put {got} bytes of input back into /dev/pts/{index}")
    })?;
    Ok(buf)
}

fn put_back(m: i32, data: &[u8]) -> ferry_sys::SysResult<()> {
    let mut done = 0;
    while done < data.len() {
        done += fdops::write_fd(m, &data[done..])?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// restore

/// Ptys recreated by [`open`], by pts number: the master until its description takes it, and
/// how many descriptions of the pty are still to be opened.
static MADE: Mutex<BTreeMap<u32, Made>> = Mutex::new(BTreeMap::new());
/// Controlling terminals to give, by session leader's PID.
static CTTY: Mutex<BTreeMap<i32, Ctty>> = Mutex::new(BTreeMap::new());

struct Ctty {
    index: u32,
    /// The foreground process group.
    fg_pgrp: i32,
    /// The slave's path from here (in the devpts the pty was made in).
    slave: PathBuf,
}

struct Made {
    master: Option<OwnedFd>,
    left: usize,
}

fn tty_of(d: &FileDesc) -> Option<&TtyDesc> {
    match &d.kind {
        FileKind::Tty(t) => Some(t),
        _ => None,
    }
}

/// Recreates the open file description `d` (a pty side) in this (the restoring) process, from
/// the ptmx and devpts in `dev` (`/dev`, or a guest's).
pub fn open(
    d: &FileDesc,
    tree: &Tree,
    dev: &Path,
    caller: Option<&ferry_sys::fsid::FsCreds>,
) -> Result<OwnedFd> {
    let me = std::process::id() as i32;
    let t = tty_of(d)
        .ok_or_else(|| Error::BadImage(format!("file {}: {:?} is not a tty", d.id, d.kind)))?;
    let mut made = MADE.lock().unwrap_or_else(|e| e.into_inner());
    if let std::collections::btree_map::Entry::Vacant(e) = made.entry(t.index) {
        let descs: Vec<&TtyDesc> = tree
            .files
            .iter()
            .filter_map(tty_of)
            .filter(|x| x.index == t.index)
            .collect();
        if let Some(home) = descs.iter().find_map(|x| x.relayed.as_ref()) {
            if descs.iter().any(|x| x.master || x.relayed.is_none()) {
                return Err(Error::BadImage(format!(
                    "pty {}: a relayed terminal with a side that is not",
                    t.index
                )));
            }
            let state = PtyState {
                termios: passthrough(&home.termios),
                winsize: home.winsize,
                ..Default::default()
            };
            let master = make_pty(dev, t.index, &state, true, caller)?;
            RELAYED
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((ferry_image::RELAY_TTY | t.index, master));
            e.insert(Made {
                master: None,
                left: descs.len(),
            });
        } else {
            let state = descs
                .iter()
                .find_map(|x| x.state.as_ref().filter(|_| x.master))
                .ok_or_else(|| {
                    Error::BadImage(format!("pty {} has no master description", t.index))
                })?;
            let has_slave = descs.iter().any(|x| !x.master);
            let master = make_pty(dev, t.index, state, has_slave, caller)?;
            if state.session != 0 {
                CTTY.lock().unwrap_or_else(|e| e.into_inner()).insert(
                    state.session,
                    Ctty {
                        index: t.index,
                        fg_pgrp: state.fg_pgrp,
                        slave: slave_path(dev, t.index),
                    },
                );
            }
            e.insert(Made {
                master: Some(master),
                left: descs.len(),
            });
        }
    }
    let entry = made.get_mut(&t.index).expect("inserted above");
    entry.left = entry.left.saturating_sub(1);
    let fd = if t.master {
        entry.master.take().ok_or_else(|| {
            Error::BadImage(format!("pty {} has two master descriptions", t.index))
        })?
    } else {
        let path = slave_path(dev, t.index);
        let flags = (d.flags & !(libc::O_CREAT | libc::O_EXCL | libc::O_TRUNC))
            | libc::O_NOCTTY
            | libc::O_CLOEXEC;
        open_at(&path, flags).ctx(me, || format!("reopen {}", path.display()))?
    };
    if entry.left == 0 {
        made.remove(&t.index);
    }
    Ok(fd)
}

fn slave_path(dev: &Path, index: u32) -> PathBuf {
    dev.join("pts").join(index.to_string())
}

fn open_at(path: &Path, flags: i32) -> ferry_sys::SysResult<OwnedFd> {
    fdops::open_path(&path.to_string_lossy(), flags, 0)
}

/// Opens `dev`/ptmx until pty `index` comes out, and gives it its state.
/// Makes pty `index` again with state `s`. `caller`: whoever asked for the restore (`None`:
/// root); a user's restore gives the slave only to that user and their groups.
fn make_pty(
    dev: &Path,
    index: u32,
    s: &PtyState,
    has_slave: bool,
    caller: Option<&ferry_sys::fsid::FsCreds>,
) -> Result<OwnedFd> {
    let ptmx = dev.join("ptmx");
    let me = std::process::id() as i32;
    let deadline = Instant::now() + INDEX_WAIT;
    let master = loop {
        let mut held = Vec::new();
        let mut found = None;
        let mut past = None;
        for _ in 0..=index {
            let m = open_at(&ptmx, libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC)
                .ctx(me, || format!("open {}", ptmx.display()))?;
            let n = tty::ptn(m.as_raw_fd()).ctx(me, || "pts number of a new pty".into())?;
            if n == index {
                found = Some(m);
                break;
            }
            if n > index {
                past = Some(n);
                break;
            }
            held.push(m);
        }
        drop(held);
        if let Some(m) = found {
            break m;
        }
        if Instant::now() > deadline {
            let got = past.map_or(String::new(), |n| format!(" (the kernel handed out {n})"));
            return Err(Error::Restore {
                pid: me,
                what: format!(
                    "pty /dev/pts/{index} is in use {}{got}, so it cannot be recreated under its \
                     number",
                    pts_holder(index)
                ),
            });
        }
        // A terminal whose last holder just died is released a moment later.
        std::thread::sleep(Duration::from_millis(10));
    };
    let m = master.as_raw_fd();
    let what = |op: &str| format!("{op} of /dev/pts/{index}");
    tty::set_locked(m, false).ctx(me, || what("unlock"))?;
    tty::set_termios(m, &from_image(&s.termios)).ctx(me, || what("set the termios"))?;
    tty::set_winsize(m, s.winsize).ctx(me, || what("set the window size"))?;
    if s.packet_mode {
        tty::set_packet_mode(m, true).ctx(me, || what("set packet mode"))?;
    }
    if !s.input.is_empty() {
        put_back(m, &s.input).ctx(me, || what("refill the input"))?;
    }
    // (Only where a slave is held or wrote: our closing the last descriptor of a slave makes
    // the master's reads fail with EIO.)
    let owner = s.slave_owner.filter(|_| has_slave);
    if !s.output.is_empty() || owner.is_some() {
        let flags = libc::O_RDWR | libc::O_NOCTTY | libc::O_NONBLOCK | libc::O_CLOEXEC;
        let slave = tty::open_peer(m, flags).ctx(me, || what("open the slave"))?;
        if !s.output.is_empty() {
            write_output(slave.as_raw_fd(), &s.output).ctx(me, || what("refill the output"))?;
        }
        if let Some((uid, gid, mode)) = owner {
            use std::os::unix::fs::PermissionsExt;
            // A user's image grants nothing: the slave goes to no one else, nor to a group
            // the user is not in.
            let (uid, gid, mode) = match caller.filter(|c| c.uid != 0) {
                Some(c) => (
                    (uid == c.uid).then_some(uid),
                    (gid == c.gid || c.groups.contains(&gid)).then_some(gid),
                    mode & 0o777,
                ),
                None => (Some(uid), Some(gid), mode),
            };
            std::os::unix::fs::fchown(&slave, uid, gid)
                .ctx(me, || what(&format!("give the slave to {uid:?}:{gid:?}")))?;
            std::fs::File::from(slave)
                .set_permissions(std::fs::Permissions::from_mode(mode))
                .ctx(me, || what(&format!("set the slave's mode {mode:o}")))?;
        }
    }
    if s.locked && !has_slave {
        tty::set_locked(m, true).ctx(me, || what("lock"))?;
    }
    Ok(master)
}

/// Who holds /dev/pts/`index`, for error messages.
fn pts_holder(index: u32) -> String {
    let want = format!("/dev/pts/{index}");
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return "by another program".into();
    };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(fds) = procfs::fds(pid) else { continue };
        if fds
            .iter()
            .any(|n| procfs::readlink(pid, &format!("fd/{n}")).is_ok_and(|l| l == want))
        {
            return format!("by PID {pid} ({})", crate::restore::describe_pid(pid));
        }
    }
    "by another program".into()
}

/// Runs `f` with the slave at `path` installed in the husk at a free number.
fn with_slave_in(h: &Husk, path: &Path, f: impl FnOnce(i32) -> Result<()>) -> Result<()> {
    let me = std::process::id() as i32;
    let slave = open_at(path, libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC)
        .ctx(me, || format!("open {}", path.display()))?;
    let n = h.install_fd(&slave, None)?;
    let r = f(n);
    h.injector()
        .syscall("close", libc::SYS_close, &[n as u64])?;
    r
}

/// Makes a freshly made session leader take its controlling terminal, before it forks the
/// rest of its session.
pub fn take_ctty(h: &Husk, p: &Process) -> Result<()> {
    let Some((index, slave)) = CTTY
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&p.pid)
        .map(|c| (c.index, c.slave.clone()))
    else {
        return Ok(());
    };
    with_slave_in(h, &slave, |n| {
        h.injector()
            .syscall(
                "ioctl(TIOCSCTTY)",
                libc::SYS_ioctl,
                &[n as u64, libc::TIOCSCTTY, 0],
            )
            .map_err(|e| Error::Restore {
                pid: h.pid,
                what: format!("make /dev/pts/{index} the controlling terminal: {e}"),
            })?;
        Ok(())
    })
}

/// Once every process exists: the foreground process group of the terminal `p` controls.
pub fn after_install(h: &Husk, p: &Process) -> Result<()> {
    let Some(Ctty {
        index,
        fg_pgrp: fg,
        slave,
    }) = CTTY
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&p.pid)
    else {
        return Ok(());
    };
    if fg == 0 {
        return Ok(());
    }
    with_slave_in(h, &slave, |n| {
        let inj = h.injector();
        let addr = inj.write_scratch(0, &fg.to_ne_bytes())?;
        inj.syscall(
            "ioctl(TIOCSPGRP)",
            libc::SYS_ioctl,
            &[n as u64, libc::TIOCSPGRP, addr],
        )
        .map_err(|e| Error::Restore {
            pid: h.pid,
            what: format!("make group {fg} the foreground of /dev/pts/{index}: {e}"),
        })?;
        Ok(())
    })
}
