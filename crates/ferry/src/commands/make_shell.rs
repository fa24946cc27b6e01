//! The shell `ferry make` gives GNU make (`SHELL=.../ferry-make-shell`, a link to the ferry
//! binary): make runs every recipe as `ferry-make-shell -c 'RECIPE'`, and this sends it to a
//! node of the cluster through remote execution (`Msg::Run` to this node's daemon, which relays
//! it), as `REAL_SHELL -c 'RECIPE'` with make's cwd, environment, umask, rlimits and identity.
//!
//! - **Which node**: the pool of `ferry make` (a UNIX socket, `FERRY_MAKE_POOL`) hands out the
//!   node running the fewest of this build's recipes (`get`), and is told when one is lost.
//! - **Output** is collected per recipe and written once it ends (stdout, then stderr), so
//!   recipes running at once never mix their lines; a recipe writing more than
//!   [`COLLECT_MAX`] streams its whole lines from then on.
//! - **Exit status**: the recipe's own (code, or death by the same signal), so make's error
//!   handling (`-k`, `-i`, `.DELETE_ON_ERROR`) is make's as ever.
//! - **Never lost**: a node that dies, whose daemon goes, that refuses, or that the pool says
//!   is evicted (`leave`: the recipe there is killed first) gets the recipe re-run from the
//!   start on another node; after [`MAX_ATTEMPTS`] nodes, or with no node left, it runs here.
//!   Only a recipe's own end (an exit status from its node) is final.
//! - **Here**: a recipe make marks as recursive (it runs `$(MAKE)`: make passes it the
//!   jobserver's descriptors) runs here, with the real shell in our place: the sub-make needs
//!   the jobserver and dispatches its own recipes. So does everything when no pool is set. A
//!   recipe that falls back to here (no node left, or none reachable) runs as our child, its
//!   output collected like a remote one's.

use super::run;
use anyhow::{anyhow, bail, Context, Result};
use ferry_transport::frame::blocking::{read_frame, write_msg};
use ferry_transport::{Frame, FrameError, Msg};
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The name make runs: `ferry` recognizes it as `argv[0]`.
pub const SHIM_NAME: &str = "ferry-make-shell";
/// The pool's socket.
pub const ENV_POOL: &str = "FERRY_MAKE_POOL";
/// The shell the recipes really run with.
pub const ENV_SHELL: &str = "FERRY_MAKE_SHELL";
pub const DEFAULT_SHELL: &str = "/bin/sh";
/// Nodes a recipe is tried on before it runs here.
const MAX_ATTEMPTS: usize = 4;
/// Output kept per stream before whole lines are written as they come.
const COLLECT_MAX: usize = 8 << 20;
/// After a `leave` (or a signal that should end it), how long the recipe's node has to report
/// its end before the connection is given up (a node whose network vanished never answers).
const GIVE_UP: Duration = Duration::from_secs(3);

/// Runs as make's shell; never returns.
pub fn main(args: Vec<OsString>) -> ! {
    let shell = std::env::var_os(ENV_SHELL).unwrap_or_else(|| DEFAULT_SHELL.into());
    let rest: Vec<OsString> = args.into_iter().skip(1).collect();
    let pool = std::env::var_os(ENV_POOL);
    if pool.is_none() || recursive() {
        exec_here(&shell, &rest);
    }
    match dispatch(&shell, &rest, pool.as_deref().map(std::path::Path::new)) {
        Ok(Some(ending)) => finish(ending),
        Ok(None) => finish(run_here(&shell, &rest)),
        Err(e) => {
            eprintln!("ferry make: {e:#}; running the recipe here");
            finish(run_here(&shell, &rest))
        }
    }
}

/// The recipe run here as a child, its output collected and written out as a remote one's:
/// other recipes run beside it and theirs goes out whole, so must its own (a shell exec'd in
/// our place would write into the middle of their lines).
fn run_here(shell: &std::ffi::OsStr, rest: &[OsString]) -> Ending {
    match run_here_collected(shell, rest) {
        Ok(e) => e,
        Err(e) => {
            eprintln!("ferry make: {e:#}");
            Ending::Code(127)
        }
    }
}

fn run_here_collected(shell: &std::ffi::OsStr, rest: &[OsString]) -> Result<Ending> {
    use std::os::fd::OwnedFd;
    use std::os::unix::process::ExitStatusExt;
    let signals = Signals::block()?;
    // std resets the child's signal mask: the recipe starts with the signals unblocked.
    let mut child = std::process::Command::new(shell)
        .args(rest)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot run {}", std::path::Path::new(shell).display()))?;
    let pid = child.id() as i32;
    let exited = ferry_sys::pidfd::pidfd_open(pid)
        .map_err(|e| anyhow!("open a pidfd for the recipe's shell {pid}: {e}"))?;
    let mut pipes: [Option<OwnedFd>; 2] = [
        child.stdout.take().map(OwnedFd::from),
        child.stderr.take().map(OwnedFd::from),
    ];
    let mut out = Output::default();
    let mut buf = vec![0u8; 64 << 10];
    let mut gone = false;
    while pipes.iter().any(Option::is_some) {
        let raw = |p: &Option<OwnedFd>| p.as_ref().map_or(-1, |f| f.as_raw_fd());
        // Once the shell is gone, only what is already in the pipes is taken: a background
        // job it left holding them must not hold the recipe open (make waits for the shell
        // alone).
        let fds = [
            raw(&pipes[0]),
            raw(&pipes[1]),
            signals.fd.as_raw_fd(),
            if gone { -1 } else { exited.as_raw_fd() },
        ];
        let ready = ferry_sys::ns::poll_events(&fds, if gone { 0 } else { -1 })
            .context("wait for the recipe's output")?;
        if gone && ready[..2].iter().all(|r| *r == 0) {
            break;
        }
        for (i, pipe) in pipes.iter_mut().enumerate() {
            let Some(fd) = pipe.as_ref().filter(|_| ready[i] != 0) else {
                continue;
            };
            match ferry_sys::fdops::read_fd(fd.as_raw_fd(), &mut buf) {
                Ok(0) | Err(_) => *pipe = None,
                Ok(n) => out.add(i as u8 + 1, &buf[..n]),
            }
        }
        if ready[2] != 0 {
            if let Some(sig) = signals.caught() {
                let _ = ferry_sys::ptrace::kill(pid, sig);
            }
        }
        gone |= ready[3] != 0;
    }
    let status = child
        .wait()
        .with_context(|| format!("wait for the recipe's shell {pid}"))?;
    out.write_out();
    Ok(Ending::of(status.signal(), status.code()))
}

/// The recipe, with the real shell, in this process's place.
fn exec_here(shell: &std::ffi::OsStr, rest: &[OsString]) -> ! {
    let e = std::process::Command::new(shell).args(rest).exec();
    eprintln!(
        "ferry make: cannot run {}: {e}",
        std::path::Path::new(shell).display()
    );
    std::process::exit(127)
}

/// Whether make handed this recipe the jobserver (`--jobserver-auth=R,W` in MAKEFLAGS, with R
/// open here): it does so only for recipes it knows run `$(MAKE)`. With a named-pipe jobserver
/// (`fifo:PATH`, make 4.4) a recipe whose first word is a make is taken as recursive.
fn recursive() -> bool {
    let flags = std::env::var("MAKEFLAGS").unwrap_or_default();
    let Some(auth) = flags
        .split_whitespace()
        .find_map(|w| w.strip_prefix("--jobserver-auth="))
    else {
        return false;
    };
    if let Some((r, _)) = auth.split_once(',') {
        return r
            .parse::<i32>()
            .is_ok_and(|fd| ferry_sys::fdops::get_fl(fd).is_ok());
    }
    // fifo:PATH: look at the recipe.
    let recipe = std::env::args().next_back().unwrap_or_default();
    recipe
        .split_whitespace()
        .next()
        .is_some_and(|w| w.rsplit('/').next().is_some_and(|b| b.contains("make")))
}

enum Ending {
    Code(i32),
    Signal(i32),
}

impl Ending {
    /// How a shell ended, here or on its node: the signal that killed it, else its exit code
    /// (as a wait status holds it: the low byte), else Ferry's own failure.
    fn of(signal: Option<i32>, code: Option<i32>) -> Ending {
        match (signal, code) {
            (Some(s), _) => Ending::Signal(s),
            (None, Some(c)) => Ending::Code(c & 0xff),
            (None, None) => Ending::Code(run::EXIT_FERRY_FAILED),
        }
    }
}

fn finish(e: Ending) -> ! {
    match e {
        Ending::Code(c) => std::process::exit(c),
        Ending::Signal(s) => ferry_sys::spawn::die_by_signal(s),
    }
}

/// A line-oriented connection to the pool.
struct Pool {
    conn: UnixStream,
    reader: BufReader<UnixStream>,
}

impl Pool {
    fn connect(path: &std::path::Path) -> Result<Pool> {
        let conn = UnixStream::connect(path)
            .with_context(|| format!("reach the pool of ferry make at {}", path.display()))?;
        let reader = BufReader::new(conn.try_clone()?);
        Ok(Pool { conn, reader })
    }

    /// The node to run on next, avoiding `tried`; None: run here.
    fn get(&mut self, tried: &[String]) -> Result<Option<String>> {
        writeln!(self.conn, "get {}", tried.join(" ")).context("ask the pool for a node")?;
        loop {
            let mut line = String::new();
            if self.reader.read_line(&mut line)? == 0 {
                bail!("the pool of ferry make went away");
            }
            let line = line.trim();
            if let Some(n) = line.strip_prefix("node ") {
                return Ok(Some(n.to_string()));
            }
            if line == "local" {
                return Ok(None);
            }
            // A late `leave` about the previous node.
        }
    }

    fn lost(&mut self, node: &str, why: &str) {
        let _ = writeln!(self.conn, "lost {node} {why}");
    }
}

/// Runs the recipe on the pool's nodes until one reports its end; None: run it here.
fn dispatch(
    shell: &std::ffi::OsStr,
    rest: &[OsString],
    pool: Option<&std::path::Path>,
) -> Result<Option<Ending>> {
    let Some(pool) = pool else { return Ok(None) };
    let mut pool = Pool::connect(pool)?;
    let mut command = vec![shell.to_os_string()];
    command.extend(rest.iter().cloned());
    let status = std::fs::read_to_string("/proc/self/status").context("read /proc/self/status")?;
    let mut tried: Vec<String> = Vec::new();
    // Signals that should end the recipe are taken through a signalfd: blocked now (the spec
    // above was read before, so the recipe starts with make's mask).
    let spec_of = |node: &str| -> Result<ferry_transport::message::RunSpec> {
        let mut spec = run::build_spec(
            &run::Args {
                on: Some(node.to_string()),
                auto: false,
                elsewhere: false,
                balance: false,
                checkpoint_every: None,
                command: command.clone(),
            },
            &status,
        )?;
        spec.tty = None;
        spec.stderr_tty = false;
        Ok(spec)
    };
    let signals = Signals::block()?;
    while tried.len() < MAX_ATTEMPTS {
        let Some(node) = pool.get(&tried)? else {
            return Ok(None);
        };
        match attempt(&node, spec_of(&node)?, &pool.conn, &signals)? {
            Attempt::Ended(e, out) => {
                out.write_out();
                return Ok(Some(e));
            }
            Attempt::Failed(out) if out.started => {
                // Started there, then lost: whatever it wrote is dropped with it.
                log::info!("recipe lost on node {node}; running it again elsewhere");
                pool.lost(&node, "lost");
                tried.push(node);
            }
            Attempt::Failed(_) => {
                pool.lost(&node, "unreachable");
                tried.push(node);
            }
            Attempt::Refused(message, code) => {
                eprintln!("ferry make: {message}");
                return Ok(Some(Ending::Code(code)));
            }
        }
        if let Some(sig) = signals.caught() {
            // Interrupted between attempts: end as the recipe would have.
            return Ok(Some(Ending::Signal(sig)));
        }
    }
    Ok(None)
}

enum Attempt {
    /// The recipe ended on its node: final.
    Ended(Ending, Output),
    /// The node is lost (or was never reached): try another.
    Failed(Output),
    /// The node could not start the recipe's shell (`RunFailed`): final, with this code.
    Refused(String, i32),
}

/// A recipe's output, held until it ends.
#[derive(Default)]
struct Output {
    started: bool,
    bufs: [Vec<u8>; 2],
    streaming: [bool; 2],
}

impl Output {
    fn add(&mut self, stream: u8, data: &[u8]) {
        let i = usize::from(stream == 2);
        let b = &mut self.bufs[i];
        b.extend_from_slice(data);
        if b.len() > COLLECT_MAX {
            self.streaming[i] = true;
        }
        if self.streaming[i] {
            // Whole lines only, so that nothing else lands in the middle of one.
            if let Some(end) = b.iter().rposition(|c| *c == b'\n') {
                let rest = b.split_off(end + 1);
                write_fd(i + 1, b);
                *b = rest;
            }
        }
    }

    fn write_out(&self) {
        write_fd(1, &self.bufs[0]);
        write_fd(2, &self.bufs[1]);
    }
}

fn write_fd(fd: usize, data: &[u8]) {
    if data.is_empty() {
        return;
    }
    // Other recipes' shells write to the same stdout: a write into a full pipe can be cut short
    // and finished after theirs, so the whole of ours goes under an exclusive lock of the file.
    // Not of our descriptor: every shell make starts shares its open file description, and a
    // flock belongs to the description, so each would hold it at once. The file is opened
    // anew through /proc for a description of our own (best effort: a descriptor that cannot
    // be reopened, such as a socket, is written unlocked).
    let lock = own_description(fd as i32)
        .filter(|l| ferry_sys::fdops::flock(l.as_raw_fd(), libc::LOCK_EX).is_ok());
    let r = if fd == 1 {
        let mut o = std::io::stdout().lock();
        o.write_all(data).and_then(|_| o.flush())
    } else {
        std::io::stderr().lock().write_all(data)
    };
    drop(lock);
    if let Err(e) = r {
        log::debug!("writing the recipe's output to fd {fd}: {e}");
    }
}

/// A new open file description of what `fd` refers to (read-only and non-blocking, so that
/// opening a pipe neither waits nor needs its other end; never becoming a controlling tty).
fn own_description(fd: i32) -> Option<std::os::fd::OwnedFd> {
    let path = format!("/proc/self/fd/{fd}");
    [libc::O_RDONLY, libc::O_WRONLY]
        .into_iter()
        .find_map(|mode| {
            ferry_sys::fdops::open_path(
                &path,
                mode | libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC,
                0,
            )
            .ok()
        })
}

/// One run of the recipe on `node`.
fn attempt(
    node: &str,
    spec: ferry_transport::message::RunSpec,
    pool: &UnixStream,
    signals: &Signals,
) -> Result<Attempt> {
    let mut out = Output::default();
    let sock = super::client::daemon_socket(std::env::var("FERRY_NODE").ok().as_deref())?;
    let mut conn = UnixStream::connect(&sock)
        .with_context(|| format!("reach the ferry daemon at {}", sock.display()))?;
    write_msg(&mut conn, &Msg::Run(spec)).context("send the recipe to the daemon")?;
    match read_frame(&mut conn) {
        Ok(Frame::Msg(Msg::Started { .. })) => out.started = true,
        Ok(Frame::Msg(Msg::RunFailed { message, exit_code })) => {
            return Ok(Attempt::Refused(message, exit_code))
        }
        Ok(Frame::Msg(Msg::Error { message })) => {
            log::info!("node {node}: {message}");
            return Ok(Attempt::Failed(out));
        }
        Ok(_) | Err(_) => return Ok(Attempt::Failed(out)),
    }
    // The recipe reads no input (make gives recipes none to share).
    write_msg(&mut conn, &Msg::IoEnd { stream: 0 }).ok();

    // A watcher: the pool's `leave` and our signals become signals to the recipe; if its
    // node does not report the end in time, the connection is cut.
    let evicted = Arc::new(AtomicBool::new(false));
    let stop = ferry_sys::fdops::pipe2(libc::O_CLOEXEC).context("make a pipe")?;
    let watcher = {
        let mut up = conn.try_clone()?;
        let pool = pool.try_clone()?;
        let evicted = evicted.clone();
        let sigfd = signals.fd.as_raw_fd();
        let stop_r = stop.0.as_raw_fd();
        let node = node.to_string();
        std::thread::spawn(move || {
            let mut deadline: Option<std::time::Instant> = None;
            let mut line = Vec::new();
            loop {
                let wait = deadline.map_or(1000, |d| {
                    d.saturating_duration_since(std::time::Instant::now())
                        .as_millis() as i32
                });
                let ready = match ferry_sys::ns::poll_in(&[pool.as_raw_fd(), sigfd, stop_r], wait) {
                    Ok(r) => r,
                    Err(_) => return,
                };
                if ready[2] {
                    return;
                }
                if deadline.is_some_and(|d| std::time::Instant::now() >= d) {
                    log::info!("node {node} did not report the recipe's end; giving it up");
                    let _ = up.shutdown(std::net::Shutdown::Both);
                    return;
                }
                if ready[0] {
                    let mut b = [0u8; 256];
                    match ferry_sys::fdops::read_fd(pool.as_raw_fd(), &mut b) {
                        Ok(0) | Err(_) => {}
                        Ok(n) => line.extend_from_slice(&b[..n]),
                    }
                    if line.windows(5).any(|w| w == b"leave") {
                        line.clear();
                        evicted.store(true, Ordering::SeqCst);
                        let _ = write_msg(
                            &mut up,
                            &Msg::Signal {
                                signal: libc::SIGKILL,
                            },
                        );
                        deadline.get_or_insert(std::time::Instant::now() + GIVE_UP);
                    }
                }
                if ready[1] {
                    if let Some(sig) = signals_read(sigfd) {
                        let _ = write_msg(&mut up, &Msg::Signal { signal: sig });
                    }
                }
            }
        })
    };
    let result = loop {
        match read_frame(&mut conn) {
            Ok(Frame::Msg(Msg::Io {
                stream: s @ (1 | 2),
                data,
            })) => out.add(s, &data),
            Ok(Frame::Msg(Msg::Exited { code, signal })) => break Some(Ending::of(signal, code)),
            Ok(Frame::Msg(Msg::Error { message })) => {
                log::info!("node {node}: {message}");
                break None;
            }
            Ok(_) => {}
            Err(FrameError::Closed) | Err(_) => break None,
        }
    };
    let _ = ferry_sys::fdops::write_fd(stop.1.as_raw_fd(), b"x");
    let _ = watcher.join();
    Ok(match result {
        Some(_) if evicted.load(Ordering::SeqCst) => Attempt::Failed(out),
        Some(e) => Attempt::Ended(e, out),
        None => Attempt::Failed(out),
    })
}

/// The signals make (or a terminal) sends a recipe to end it, held for the watcher.
struct Signals {
    fd: std::os::fd::OwnedFd,
}

const ENDING_SIGNALS: [i32; 4] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT];

impl Signals {
    fn block() -> Result<Signals> {
        let mut mask = 0u64;
        for s in ENDING_SIGNALS {
            ferry_sys::ns::block_signal(s).with_context(|| format!("block signal {s}"))?;
            mask |= 1 << (s - 1);
        }
        let fd = ferry_sys::anon_fds::signalfd(mask, libc::SFD_CLOEXEC | libc::SFD_NONBLOCK)
            .map_err(|e| anyhow!("make a signalfd: {e}"))?;
        Ok(Signals { fd })
    }

    /// A signal that came while no recipe ran.
    fn caught(&self) -> Option<i32> {
        signals_read(self.fd.as_raw_fd())
    }
}

/// The next signal queued on a signalfd, if any.
fn signals_read(fd: i32) -> Option<i32> {
    let mut rec = [0u8; 128];
    match ferry_sys::fdops::read_fd(fd, &mut rec) {
        Ok(128) => Some(u32::from_ne_bytes(rec[..4].try_into().expect("4 bytes")) as i32),
        _ => None,
    }
}
