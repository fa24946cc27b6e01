//! A relayed terminal's side of the relays (`relay.rs`): the settings and window size each
//! side takes as its baseline, whether the job at home has the terminal, and the input a body
//! had not read when it moves on.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Mutex;

/// A relayed terminal's settings and window size as they were when the tree was frozen (at
/// home: the home terminal's, read as its relay end is opened; at the body's node: what its pty
/// was rebuilt with, read as the end is taken from the restore worker, before the body runs),
/// by terminal (`tty_key`). Each side of the relay sends the other what differs from them, not
/// from what it first reads itself once the relay runs: by then the body may have set its own
/// size or settings (a `TIOCSWINSZ` or `tcsetattr` made before its node's relay started), which
/// would never reach home, and the home's unchanged size, sent as new, would undo it.
pub(crate) type TtyStart = (Option<ferry_sys::tty::Termios>, Option<[u16; 4]>);
static TTY_START: Mutex<Option<HashMap<(u64, u64), TtyStart>>> = Mutex::new(None);

/// Which terminal `fd` is, in this daemon: its file system's device and, for a pty master,
/// its number, else the device it is (a slave's).
pub(crate) fn tty_key(fd: &OwnedFd) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt as _;
    let m = fd
        .try_clone()
        .map(std::fs::File::from)
        .ok()?
        .metadata()
        .ok()?;
    match ferry_sys::tty::ptn(fd.as_raw_fd()) {
        Ok(n) => Some((m.dev(), u64::from(n))),
        Err(_) => Some((m.dev(), m.rdev() | 1 << 63)),
    }
}

/// Records terminal `fd`'s settings (through its slave if `master`) and size as they are now,
/// the tree frozen.
pub(crate) fn remember_tty_start(fd: &OwnedFd, master: bool) {
    let raw = fd.as_raw_fd();
    let termios = if master {
        slave_termios(raw)
    } else {
        ferry_sys::tty::get_termios(raw).ok()
    };
    let start = (termios, ferry_sys::tty::get_winsize(raw).ok());
    if let Some(key) = tty_key(fd) {
        TTY_START
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert_with(HashMap::new)
            .insert(key, start);
    }
}

/// What `remember_tty_start` recorded for terminal `fd`, taken.
pub(crate) fn take_tty_start(fd: &OwnedFd) -> Option<TtyStart> {
    let key = tty_key(fd)?;
    TTY_START
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_mut()?
        .remove(&key)
}

/// The settings of the slave of pty master `master` (through a short-lived descriptor of the
/// slave: one kept open would keep the master from seeing the body's last close).
pub(crate) fn slave_termios(master: std::os::fd::RawFd) -> Option<ferry_sys::tty::Termios> {
    let s = ferry_sys::tty::open_peer(master, libc::O_RDWR | libc::O_NOCTTY).ok()?;
    ferry_sys::tty::get_termios(s.as_raw_fd()).ok()
}

/// Whether home PID `pid` is in the foreground process group of its controlling terminal
/// (from its /proc stat: `pgrp` and `tpgid`; a deputy keeps its terminal and its group);
/// `None` once it is gone.
pub fn in_foreground(pid: i32) -> Option<bool> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let f: Vec<&str> = stat
        .get(stat.rfind(')')? + 2..)?
        .split_whitespace()
        .collect();
    let pgrp: i32 = f.get(2)?.parse().ok()?;
    let tpgid: i32 = f.get(5)?.parse().ok()?;
    Some(pgrp == tpgid)
}

/// The input the body has not read from its pty (master `master`), read back through its
/// slave: the body is frozen and moves on, and this goes to its next node. Read with `EXTPROC`
/// (as the relay sets the pty up: in canonical mode too, a read takes what is there, whole
/// lines or not).
pub(crate) fn unread_input(master: std::os::fd::RawFd) -> Vec<u8> {
    let mut out = Vec::new();
    let Ok(slave) = ferry_sys::tty::open_peer(
        master,
        libc::O_RDWR | libc::O_NOCTTY | libc::O_NONBLOCK | libc::O_CLOEXEC,
    ) else {
        return out;
    };
    let raw = slave.as_raw_fd();
    if let Ok(mut t) = ferry_sys::tty::get_termios(raw) {
        if t.lflag & libc::EXTPROC == 0 {
            t.lflag |= libc::EXTPROC;
            let _ = ferry_sys::tty::set_termios(raw, &t);
        }
    }
    let mut buf = vec![0u8; 1 << 16];
    loop {
        match ferry_sys::fdops::read_fd(raw, &mut buf) {
            Ok(0) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if e.errno == libc::EINTR => {}
            Err(_) => break,
        }
    }
    out
}

/// A relayed terminal's window size as this daemon last saw or set it, shared by both ways of
/// its relay: a size the far side sent is set under the lock and not sent back (a stale size
/// echoed would undo a newer one).
pub(crate) type Known = std::sync::Arc<Mutex<Option<[u16; 4]>>>;
static KNOWN: Mutex<Option<HashMap<(u64, u64), Known>>> = Mutex::new(None);

/// The known size of terminal `fd` (see [`Known`]): at first the size it had when the tree
/// was frozen (`remember_tty_start`), else the size it has now.
pub(crate) fn known_size(fd: &OwnedFd) -> Known {
    let key = tty_key(fd);
    let mut all = KNOWN.lock().unwrap_or_else(|e| e.into_inner());
    let all = all.get_or_insert_with(HashMap::new);
    if let Some(k) = key.and_then(|k| all.get(&k)) {
        return k.clone();
    }
    let start = take_tty_start(fd)
        .and_then(|s| s.1)
        .or_else(|| ferry_sys::tty::get_winsize(fd.as_raw_fd()).ok());
    let k: Known = std::sync::Arc::new(Mutex::new(start));
    if let Some(key) = key {
        all.insert(key, k.clone());
    }
    k
}

/// A new relay of terminal `fd` starts (kept as two ways): its known size is the one it had
/// when the tree was frozen, not an earlier relay's.
pub(crate) fn start_known(fd: &OwnedFd) {
    if let Some(key) = tty_key(fd) {
        if let Some(all) = KNOWN.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            all.remove(&key);
        }
    }
    let _ = known_size(fd);
}

/// The size of terminal `raw` if it is not `known` (which it becomes).
pub(crate) fn size_changed(
    known: &Mutex<Option<[u16; 4]>>,
    raw: std::os::fd::RawFd,
) -> Option<[u16; 4]> {
    let mut known = known.lock().unwrap_or_else(|e| e.into_inner());
    let now = ferry_sys::tty::get_winsize(raw).ok()?;
    (known.replace(now) != Some(now)).then_some(now)
}

/// Sets terminal `raw` to `size`, which the far side sent (known first: not sent back).
pub(crate) fn set_size(known: &Mutex<Option<[u16; 4]>>, raw: std::os::fd::RawFd, size: [u16; 4]) {
    let mut known = known.lock().unwrap_or_else(|e| e.into_inner());
    *known = Some(size);
    let _ = ferry_sys::tty::set_winsize(raw, size);
}

/// The home terminal `raw` takes the settings the body set (`RelayTermios`), its speeds kept,
/// as a tcsetattr at home would have set it.
pub(crate) fn apply_termios(raw: std::os::fd::RawFd, m: &ferry_transport::Msg) {
    let ferry_transport::Msg::RelayTermios {
        iflag,
        oflag,
        cflag,
        lflag,
        line,
        cc,
    } = m
    else {
        return;
    };
    if let Ok(mut t) = ferry_sys::tty::get_termios(raw) {
        (t.iflag, t.oflag, t.cflag, t.lflag, t.line) = (*iflag, *oflag, *cflag, *lflag, *line);
        if cc.len() == t.cc.len() {
            t.cc = cc.clone();
        }
        if let Err(e) = ferry_sys::tty::set_termios(raw, &t) {
            tracing::warn!(event = "relay-termios", error = %e);
        }
    }
}

/// `RelayTermios` for settings `t` (the body's pty's, sent home).
pub(crate) fn termios_msg(t: ferry_sys::tty::Termios) -> ferry_transport::Msg {
    ferry_transport::Msg::RelayTermios {
        iflag: t.iflag,
        oflag: t.oflag,
        cflag: t.cflag,
        lflag: t.lflag & !libc::EXTPROC,
        line: t.line,
        cc: t.cc,
    }
}
