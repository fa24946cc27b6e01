//! `ferry __relay-holder --root PID` (internal): holds a pipe relay's home end and buffers
//! across a restart of the home daemon (`ferry_daemon::relay_keep`). The daemon starts it in a
//! process group of its own with the descriptors to hold as its stdin, stdout and stderr; it
//! closes everything else it may have been given, keeps those three open, and ends when home
//! PID `--root` (the tree's deputy) does, which it learns from a pidfd (poll), or when the
//! daemon kills it (SIGKILL) as the relay ends. SIGHUP, SIGINT and SIGTERM, sent to a process
//! group or a session (a terminal hanging up, a service manager stopping the daemon's group),
//! are ignored: the relay's state is in what it holds. Its name (`comm`) is
//! [`NAME`], so `ps` says what it is.
//!
//! With `--socket` it holds a relayed socket's home end instead (its stdin), and pumps
//! it to and from two pipes whose other ends the daemon relays as pipes (its stdout: what the
//! socket reads goes there; its stderr: what comes from there is sent on the socket, as
//! `--sender` PID:UID:GID when given). The socket's peer thus never notices the daemon's
//! restart: only the pipes' relays (kept as every pipe's) see it. End of file one way is a
//! shutdown the other; it ends once both ways are over. A socket of messages (seqpacket,
//! datagrams) has each message go whole: on the pipes as its length (4 bytes, little-endian)
//! and its bytes. With `--tty` it holds a relayed
//! terminal the same way: it reads the terminal only while the tree's root (`--root`) is in its
//! foreground process group (else the shell at home reads it), and ends once the daemon's pipe
//! to it ends (the body's terminal is gone).

use anyhow::{anyhow, Result};

/// What `ps` shows of a holder (at most 15 bytes, the kernel's `comm`).
pub const NAME: &str = "ferry-holder";

#[derive(clap::Args)]
pub struct Args {
    /// Home PID of the tree's root (its deputy): the holder ends with it.
    #[arg(long)]
    pub root: i32,
    /// Pump the stream socket on stdin to stdout and from stderr (see above).
    #[arg(long)]
    pub socket: bool,
    /// Pump the terminal on stdin to stdout and from stderr (see above).
    #[arg(long)]
    pub tty: bool,
    /// With `--socket`: whom what is sent comes from (SCM_CREDENTIALS), PID:UID:GID.
    #[arg(long)]
    pub sender: Option<String>,
}

pub fn run(a: Args) -> Result<()> {
    // Only the three descriptors it holds: nothing of the daemon's stays open with it.
    ferry_sys::process::close_from(3).map_err(|e| anyhow!("close the rest: {e}"))?;
    ferry_sys::process::set_name(NAME).map_err(|e| anyhow!("name the holder: {e}"))?;
    for sig in [libc::SIGHUP, libc::SIGINT, libc::SIGTERM] {
        ferry_sys::spawn::ignore_signal(sig).map_err(|e| anyhow!("ignore signal {sig}: {e}"))?;
    }
    // It keeps no directory busy.
    let _ = std::env::set_current_dir("/");
    let pidfd = match ferry_sys::pidfd::pidfd_open(a.root) {
        Ok(p) => p,
        // The tree is already over: nothing to hold for.
        Err(e) if e.errno == libc::ESRCH => return Ok(()),
        Err(e) => return Err(anyhow!("open a pidfd of PID {}: {e}", a.root)),
    };
    use std::os::fd::AsRawFd;
    let done = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    // The way out (to the socket or terminal) has delivered all the daemon gave it.
    let out_done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let ways = if a.tty {
        ferry_sys::spawn::ignore_signal(libc::SIGPIPE)
            .map_err(|e| anyhow!("ignore SIGPIPE: {e}"))?;
        let root = a.root;
        let over = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let o = over.clone();
        std::thread::spawn(move || tty_to_pipe(root, &o));
        let (d, od) = (done.clone(), out_done.clone());
        std::thread::spawn(move || {
            pipe_to_tty();
            over.store(true, std::sync::atomic::Ordering::SeqCst);
            od.store(true, std::sync::atomic::Ordering::SeqCst);
            d.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        });
        1
    } else if a.socket {
        let sender = match &a.sender {
            Some(s) => {
                let v: Vec<&str> = s.split(':').collect();
                let bad = || anyhow!("--sender {s}: not PID:UID:GID");
                if v.len() != 3 {
                    return Err(bad());
                }
                Some((
                    v[0].parse::<i32>().map_err(|_| bad())?,
                    v[1].parse::<u32>().map_err(|_| bad())?,
                    v[2].parse::<u32>().map_err(|_| bad())?,
                ))
            }
            None => None,
        };
        ferry_sys::spawn::ignore_signal(libc::SIGPIPE)
            .map_err(|e| anyhow!("ignore SIGPIPE: {e}"))?;
        let kind = ferry_sys::sockets::getsockopt_int(SOCK, libc::SOL_SOCKET, libc::SO_TYPE)
            .map_err(|e| anyhow!("the held socket's type: {e}"))?;
        let d = done.clone();
        std::thread::spawn(move || {
            match kind {
                libc::SOCK_STREAM => socket_to_pipe(),
                _ => records_to_pipe(kind == libc::SOCK_DGRAM),
            }
            d.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        });
        let (d, od) = (done.clone(), out_done.clone());
        std::thread::spawn(move || {
            match kind {
                libc::SOCK_STREAM => pipe_to_socket(sender),
                _ => pipe_to_records(sender),
            }
            od.store(true, std::sync::atomic::Ordering::SeqCst);
            d.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        });
        2
    } else {
        usize::MAX
    };
    let pumps = a.socket || a.tty;
    let mut root_gone = false;
    loop {
        if done.load(std::sync::atomic::Ordering::SeqCst) >= ways {
            return Ok(());
        }
        // A pump whose tree is over still delivers what the daemon gave it (the body's last
        // words, its close): it ends once that way ends (the daemon's ends, and the relays'
        // holders, all close).
        if root_gone {
            if out_done.load(std::sync::atomic::Ordering::SeqCst) {
                return Ok(());
            }
            std::thread::sleep(std::time::Duration::from_millis(200));
            continue;
        }
        let wait = if pumps { 200 } else { -1 };
        match ferry_sys::ns::poll_in(&[pidfd.as_raw_fd()], wait) {
            Ok(r) if r[0] && pumps => root_gone = true,
            Ok(r) if r[0] => return Ok(()),
            Ok(_) => continue,
            Err(e) if e.errno == libc::EINTR => continue,
            Err(e) => return Err(anyhow!("wait for PID {}: {e}", a.root)),
        }
    }
}

/// The socket or terminal held.
const SOCK: i32 = 0;
const TO_DAEMON: i32 = 1;
const FROM_DAEMON: i32 = 2;

/// Waits until `fd` polls one of `events` (or an error or hang-up).
fn wait(fd: i32, events: i16) {
    let _ = ferry_sys::sockets::poll_wait(fd, events, 1000);
}

/// What the socket reads goes into the pipe to the daemon, in order; the socket's end of file
/// (or reset) closes that pipe; the daemon's end gone (EPIPE), the socket reads no more.
fn socket_to_pipe() {
    let mut d = Vec::with_capacity(1 << 16);
    loop {
        d.clear();
        match ferry_sys::sockets::recv_append(SOCK, &mut d, 1 << 16, libc::MSG_DONTWAIT) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.errno == libc::EINTR => continue,
            Err(e) if e.errno == libc::EAGAIN => {
                wait(SOCK, libc::POLLIN | libc::POLLRDHUP);
                continue;
            }
            Err(_) => break,
        }
        if !put_all(TO_DAEMON, &d) {
            let _ = ferry_sys::sockets::shutdown(SOCK, libc::SHUT_RD);
            break;
        }
    }
    // Our end of the pipe closed (/dev/null in its place): the daemon's end of file.
    close_pipe(TO_DAEMON);
}

/// What comes from the daemon is sent on the socket (as `sender`), in order; the daemon's end
/// of file is a shutdown of the socket's way out; a send that fails closes the pipe (the
/// daemon sees its readers gone).
fn pipe_to_socket(mut sender: Option<(i32, u32, u32)>) {
    let mut buf = vec![0u8; 1 << 16];
    'read: loop {
        let n = match ferry_sys::fdops::read_fd(FROM_DAEMON, &mut buf) {
            Ok(0) => {
                let _ = ferry_sys::sockets::shutdown(SOCK, libc::SHUT_WR);
                break;
            }
            Ok(n) => n,
            Err(e) if e.errno == libc::EINTR => continue,
            Err(e) if e.errno == libc::EAGAIN => {
                wait(FROM_DAEMON, libc::POLLIN);
                continue;
            }
            Err(_) => break,
        };
        let mut at = 0;
        while at < n {
            match send_on_sock(&mut sender, &buf[at..n]) {
                Ok(k) => at += k,
                Err(e) if e.errno == libc::EINTR => {}
                Err(e) if e.errno == libc::EAGAIN => wait(SOCK, libc::POLLOUT),
                Err(_) => break 'read,
            }
        }
    }
    close_pipe(FROM_DAEMON);
}

/// Sends `d` on the socket without waiting, as `sender` (a process's PID, user and group:
/// SCM_CREDENTIALS) while that process lives, then as ourselves (`sender` becomes None).
fn send_on_sock(
    sender: &mut Option<(i32, u32, u32)>,
    d: &[u8],
) -> Result<usize, ferry_sys::SysError> {
    let flags = libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL;
    if let Some(who) = *sender {
        match ferry_sys::sockets::send_as(SOCK, d, who, flags) {
            // That process is gone: what is left goes as ourselves.
            Err(e) if e.errno == libc::ESRCH => *sender = None,
            r => return r,
        }
    }
    ferry_sys::sockets::send(SOCK, d, None, &[], flags)
}

/// Closes our end `fd` of a pipe to or from the daemon, /dev/null taking its number.
fn close_pipe(fd: i32) {
    use std::os::fd::AsRawFd;
    if let Ok(null) = ferry_sys::fdops::open_path("/dev/null", libc::O_RDWR | libc::O_CLOEXEC, 0) {
        let _ = ferry_sys::fdops::dup2(null.as_raw_fd(), fd);
    }
}

/// What is typed at the terminal while the tree at home (`root`) has it in the foreground goes
/// into the pipe to the daemon, in order, until the relay is `over`, the terminal hangs up, or
/// the daemon's end is gone.
fn tty_to_pipe(root: i32, over: &std::sync::atomic::AtomicBool) {
    let mut buf = vec![0u8; 1 << 16];
    while !over.load(std::sync::atomic::Ordering::SeqCst) {
        match ferry_daemon::relay_tty::in_foreground(root) {
            Some(true) => {}
            Some(false) => {
                std::thread::sleep(std::time::Duration::from_millis(50));
                continue;
            }
            None => break,
        }
        match ferry_sys::sockets::poll_wait(SOCK, libc::POLLIN, 100) {
            Ok(ev) if ev & libc::POLLIN != 0 => {}
            Ok(ev) if ev & (libc::POLLHUP | libc::POLLERR) != 0 => break,
            Ok(_) => continue,
            Err(_) => continue,
        }
        // The shell may have taken the terminal back while we waited.
        if ferry_daemon::relay_tty::in_foreground(root) == Some(false) {
            continue;
        }
        let n = match ferry_sys::fdops::read_fd(SOCK, &mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.errno == libc::EINTR || e.errno == libc::EAGAIN => continue,
            // EIO: the terminal hung up.
            Err(_) => break,
        };
        if !put_all(TO_DAEMON, &buf[..n]) {
            break;
        }
    }
    close_pipe(TO_DAEMON);
}

/// What comes from the daemon (the body's output) is written to the terminal, in order, until
/// the daemon's end of file.
fn pipe_to_tty() {
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = match ferry_sys::fdops::read_fd(FROM_DAEMON, &mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.errno == libc::EINTR => continue,
            Err(e) if e.errno == libc::EAGAIN => {
                wait(FROM_DAEMON, libc::POLLIN);
                continue;
            }
            Err(_) => break,
        };
        if !put_all(SOCK, &buf[..n]) {
            break;
        }
    }
    close_pipe(FROM_DAEMON);
}

/// Writes all of `d` into `fd` (our end of a pipe to the daemon, or the terminal), waiting
/// while it is full (false: its reader is gone, or another error).
fn put_all(fd: i32, d: &[u8]) -> bool {
    let mut at = 0;
    while at < d.len() {
        match ferry_sys::fdops::write_fd(fd, &d[at..]) {
            Ok(n) => at += n,
            Err(e) if e.errno == libc::EINTR => {}
            Err(e) if e.errno == libc::EAGAIN => wait(fd, libc::POLLOUT),
            Err(_) => return false,
        }
    }
    true
}

/// Reads exactly `buf.len()` bytes from our end `fd` of the daemon's pipe (false: its end of
/// file or an error first).
fn get_all(fd: i32, buf: &mut [u8]) -> bool {
    let mut at = 0;
    while at < buf.len() {
        match ferry_sys::fdops::read_fd(fd, &mut buf[at..]) {
            Ok(0) => return false,
            Ok(n) => at += n,
            Err(e) if e.errno == libc::EINTR => {}
            Err(e) if e.errno == libc::EAGAIN => wait(fd, libc::POLLIN),
            Err(_) => return false,
        }
    }
    true
}

/// A socket of messages (seqpacket, datagrams): each message it reads goes into the pipe to
/// the daemon whole, as its length (4 bytes, little-endian) and its bytes; a seqpacket's end
/// of file, or a datagram socket's peer gone, closes that pipe.
fn records_to_pipe(dgram: bool) {
    let mut checked = std::time::Instant::now();
    loop {
        let len = match ferry_sys::sockets::next_message_len(SOCK) {
            Ok(n) => n,
            Err(e) if e.errno == libc::EINTR => continue,
            Err(e) if e.errno == libc::EAGAIN => {
                let _ = ferry_sys::sockets::poll_wait(SOCK, libc::POLLIN | libc::POLLRDHUP, 200);
                if dgram && checked.elapsed() >= std::time::Duration::from_millis(200) {
                    checked = std::time::Instant::now();
                    if ferry_sys::sockets::unix_dgram_peer_gone(SOCK) {
                        break;
                    }
                }
                continue;
            }
            Err(_) => break,
        };
        let mut d = Vec::new();
        match ferry_sys::sockets::recv_append(SOCK, &mut d, len, libc::MSG_DONTWAIT) {
            // A seqpacket's end (no empty records there).
            Ok(0) if !dgram => break,
            Ok(_) => {}
            Err(e) if e.errno == libc::EINTR || e.errno == libc::EAGAIN => continue,
            Err(_) => break,
        }
        let mut framed = (d.len() as u32).to_le_bytes().to_vec();
        framed.extend_from_slice(&d);
        if !put_all(TO_DAEMON, &framed) {
            let _ = ferry_sys::sockets::shutdown(SOCK, libc::SHUT_RD);
            break;
        }
    }
    close_pipe(TO_DAEMON);
}

/// Each message from the daemon (length and bytes) is sent on the socket whole (as `sender`);
/// one too long for the socket is dropped, as its sender would have found.
fn pipe_to_records(mut sender: Option<(i32, u32, u32)>) {
    'read: loop {
        let mut len = [0u8; 4];
        if !get_all(FROM_DAEMON, &mut len) {
            let _ = ferry_sys::sockets::shutdown(SOCK, libc::SHUT_WR);
            break;
        }
        let mut d = vec![0u8; u32::from_le_bytes(len) as usize];
        if !get_all(FROM_DAEMON, &mut d) {
            break;
        }
        loop {
            match send_on_sock(&mut sender, &d) {
                Ok(_) => break,
                Err(e) if e.errno == libc::EINTR => {}
                Err(e) if e.errno == libc::EAGAIN => wait(SOCK, libc::POLLOUT),
                Err(e) if e.errno == libc::EMSGSIZE => break,
                Err(_) => break 'read,
            }
        }
    }
    close_pipe(FROM_DAEMON);
}
