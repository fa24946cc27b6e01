//! Terminal ioctls on pseudo-terminals: pts number and lock, termios (TCGETS2), window size,
//! packet mode, session and foreground process group.

use crate::{check, SysResult};
use std::os::fd::RawFd;

const TIOCGPTN: libc::c_ulong = 0x8004_5430;
const TIOCSPTLCK: libc::c_ulong = 0x4004_5431;
const TIOCGPKT: libc::c_ulong = 0x8004_5438;
const TIOCGPTLCK: libc::c_ulong = 0x8004_5439;
const TIOCPKT: libc::c_ulong = 0x5420;
const TIOCGDEV: libc::c_ulong = 0x8004_5432;

/// The parts of `struct termios2` Ferry keeps.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Termios {
    pub iflag: u32,
    pub oflag: u32,
    pub cflag: u32,
    pub lflag: u32,
    pub line: u8,
    pub cc: Vec<u8>,
    pub ispeed: u32,
    pub ospeed: u32,
}

fn get_int(fd: RawFd, req: libc::c_ulong, op: &'static str) -> SysResult<i32> {
    let mut v: libc::c_int = 0;
    // SAFETY: each request used here writes one int to the pointer.
    let r = unsafe { libc::ioctl(fd, req as _, &mut v) };
    check(op, r as libc::c_long)?;
    Ok(v)
}

fn set_int(fd: RawFd, req: libc::c_ulong, v: i32, op: &'static str) -> SysResult<()> {
    let v: libc::c_int = v;
    // SAFETY: each request used here reads one int from the pointer.
    let r = unsafe { libc::ioctl(fd, req as _, &v) };
    check(op, r as libc::c_long).map(drop)
}

/// The device number of the terminal `fd` refers to (for /dev/tty, the controlling terminal
/// it was opened for), encoded as `st_rdev` and /proc/PID/stat's `tty_nr` are.
pub fn real_dev(fd: RawFd) -> SysResult<u32> {
    get_int(fd, TIOCGDEV, "ioctl(TIOCGDEV)").map(|n| n as u32)
}

/// The pts number of a pty master.
pub fn ptn(master: RawFd) -> SysResult<u32> {
    get_int(master, TIOCGPTN, "ioctl(TIOCGPTN)").map(|n| n as u32)
}

pub fn locked(master: RawFd) -> SysResult<bool> {
    get_int(master, TIOCGPTLCK, "ioctl(TIOCGPTLCK)").map(|n| n != 0)
}

pub fn set_locked(master: RawFd, lock: bool) -> SysResult<()> {
    set_int(master, TIOCSPTLCK, lock as i32, "ioctl(TIOCSPTLCK)")
}

pub fn packet_mode(master: RawFd) -> SysResult<bool> {
    get_int(master, TIOCGPKT, "ioctl(TIOCGPKT)").map(|n| n != 0)
}

pub fn set_packet_mode(master: RawFd, on: bool) -> SysResult<()> {
    set_int(master, TIOCPKT, on as i32, "ioctl(TIOCPKT)")
}

/// The session whose controlling terminal this is (on a master: of its slave).
pub fn sid(fd: RawFd) -> SysResult<i32> {
    get_int(fd, libc::TIOCGSID as _, "ioctl(TIOCGSID)")
}

/// The foreground process group (on a master: of its slave).
pub fn pgrp(fd: RawFd) -> SysResult<i32> {
    get_int(fd, libc::TIOCGPGRP as _, "ioctl(TIOCGPGRP)")
}

pub fn get_termios(fd: RawFd) -> SysResult<Termios> {
    // SAFETY: termios2 is plain data; all-zero is a valid value.
    let mut t: libc::termios2 = unsafe { std::mem::zeroed() };
    // SAFETY: TCGETS2 writes one struct termios2.
    let r = unsafe { libc::ioctl(fd, libc::TCGETS2 as _, &mut t) };
    check("ioctl(TCGETS2)", r as libc::c_long)?;
    Ok(Termios {
        iflag: t.c_iflag,
        oflag: t.c_oflag,
        cflag: t.c_cflag,
        lflag: t.c_lflag,
        line: t.c_line,
        cc: t.c_cc.to_vec(),
        ispeed: t.c_ispeed,
        ospeed: t.c_ospeed,
    })
}

pub fn set_termios(fd: RawFd, v: &Termios) -> SysResult<()> {
    // SAFETY: termios2 is plain data; all-zero is a valid value.
    let mut t: libc::termios2 = unsafe { std::mem::zeroed() };
    t.c_iflag = v.iflag;
    t.c_oflag = v.oflag;
    t.c_cflag = v.cflag;
    t.c_lflag = v.lflag;
    t.c_line = v.line;
    let n = v.cc.len().min(t.c_cc.len());
    t.c_cc[..n].copy_from_slice(&v.cc[..n]);
    t.c_ispeed = v.ispeed;
    t.c_ospeed = v.ospeed;
    // SAFETY: TCSETS2 reads one struct termios2.
    let r = unsafe { libc::ioctl(fd, libc::TCSETS2 as _, &t) };
    check("ioctl(TCSETS2)", r as libc::c_long).map(drop)
}

/// Rows, columns, x pixels, y pixels.
pub fn get_winsize(fd: RawFd) -> SysResult<[u16; 4]> {
    let mut w = libc::winsize {
        ws_row: 0,
        ws_col: 0,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCGWINSZ writes one struct winsize.
    let r = unsafe { libc::ioctl(fd, libc::TIOCGWINSZ as _, &mut w) };
    check("ioctl(TIOCGWINSZ)", r as libc::c_long)?;
    Ok([w.ws_row, w.ws_col, w.ws_xpixel, w.ws_ypixel])
}

pub fn set_winsize(fd: RawFd, v: [u16; 4]) -> SysResult<()> {
    let w = libc::winsize {
        ws_row: v[0],
        ws_col: v[1],
        ws_xpixel: v[2],
        ws_ypixel: v[3],
    };
    // SAFETY: TIOCSWINSZ reads one struct winsize.
    let r = unsafe { libc::ioctl(fd, libc::TIOCSWINSZ as _, &w) };
    check("ioctl(TIOCSWINSZ)", r as libc::c_long).map(drop)
}

/// Opens the slave of a pty master (TIOCGPTPEER), with `flags` (O_RDWR, O_NOCTTY ...).
pub fn open_peer(master: RawFd, flags: i32) -> SysResult<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: TIOCGPTPEER takes the open flags as a plain integer.
    let r = unsafe { libc::ioctl(master, libc::TIOCGPTPEER as _, flags as libc::c_ulong) };
    let fd = check("ioctl(TIOCGPTPEER)", r as libc::c_long)?;
    // SAFETY: the kernel just returned this new descriptor; we are its only owner.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) })
}
