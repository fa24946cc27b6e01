//! `ferry run [--on NODE | --auto [--elsewhere]] [--balance] -- CMD ARGS...`: run a command on
//! another node as if it ran here (Sprite's remote execution). With `--balance` the node that
//! runs it hands it to its load balancer, which may move it later (as MOSIX does); eviction may
//! move it in any case. Its stream follows it, relayed by the node it started on.
//!
//! The command gets this process's cwd, environment, umask, rlimits, uid, gid, groups and
//! ignored signals; its stdin, stdout and stderr are ours, streamed (a terminal becomes a pty
//! over there, sized like ours, ours in raw mode meanwhile); the signals we get are forwarded;
//! and its end is ours: `ferry run` exits with its exit code, or kills itself with the signal
//! that killed it. Ferry's own failures exit with 125 (as `env`, `nice` or `timeout` do), a
//! command that is not found with 127, one that cannot be executed with 126.
//!
//! Threads: the async loop reads the daemon's frames and our signals; one thread reads our
//! stdin (a file, a pipe or a terminal alike; none for /dev/null), one writes our stdout and
//! stderr (started with the first output). Both are fed through bounded channels, so a slow
//! reader of our stdout slows the remote program down rather than filling memory.

use super::client;
use anyhow::{anyhow, bail, Context, Result};
use ferry_sys::tty::Termios;
use ferry_transport::message::{kind, RunSpec};
use ferry_transport::{read_frame, read_msg, write_msg, Frame, FrameError, Msg};
use serde_bytes::ByteBuf;
use std::ffi::OsString;
use std::io::{IsTerminal, Read, Write};
use std::sync::Mutex;
use std::time::Duration;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::{mpsc, oneshot};

#[derive(clap::Args)]
pub struct Args {
    /// Run on this node (this one's own name runs it here, through the daemon).
    #[arg(long, value_name = "NODE", conflicts_with = "auto")]
    pub on: Option<String>,
    /// Run on the idlest node that accepts guests, possibly this one (the default).
    #[arg(long)]
    pub auto: bool,
    /// With --auto: never on this node.
    #[arg(long, requires = "auto")]
    pub elsewhere: bool,
    /// Hand the program to the load balancer of the node that runs it: it may be moved later,
    /// to a less loaded node, its stdio and exit status following it (see `ferry balance`).
    #[arg(long)]
    pub balance: bool,
    /// Should the program's tree leave the node running it (`ferry migrate`, the balancer),
    /// that node checkpoints it every SECS seconds to rebuild it from should its new node die
    /// (0: never), whatever that node's own `checkpoint_every_secs`.
    #[arg(long, value_name = "SECS")]
    pub checkpoint_every: Option<f32>,
    /// The command and its arguments (after `--`).
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "CMD"
    )]
    pub command: Vec<OsString>,
}

/// Ferry's own failures (as `env`, `nice` and `timeout` do).
pub const EXIT_FERRY_FAILED: i32 = 125;
/// Signals received here and sent on to the program.
const FORWARDED: [i32; 9] = [
    libc::SIGINT,
    libc::SIGTERM,
    libc::SIGHUP,
    libc::SIGQUIT,
    libc::SIGTSTP,
    libc::SIGCONT,
    libc::SIGWINCH,
    libc::SIGUSR1,
    libc::SIGUSR2,
];
const STDIN_CHUNK: usize = 64 << 10;

/// Our terminal's settings before raw mode, to put back on every way out.
static SAVED_TERMIOS: Mutex<Option<Termios>> = Mutex::new(None);

enum Ending {
    Code(i32),
    Signal(i32),
}

/// Runs the command and ends this process with its status: never returns.
pub fn run(a: Args, node: Option<&str>) -> Result<()> {
    let ending = match start(a, node) {
        Ok(e) => e,
        Err(e) => {
            restore_terminal();
            eprintln!("ferry run: {e:#}");
            Ending::Code(EXIT_FERRY_FAILED)
        }
    };
    restore_terminal();
    let _ = std::io::stdout().flush();
    match ending {
        Ending::Code(c) => std::process::exit(c),
        Ending::Signal(s) => ferry_sys::spawn::die_by_signal(s),
    }
}

fn start(a: Args, node: Option<&str>) -> Result<Ending> {
    let status = std::fs::read_to_string("/proc/self/status").context("read /proc/self/status")?;
    let spec = build_spec(&a, &status)?;
    // A reader of our stdout that goes away must show as EPIPE, to be passed on.
    ferry_sys::spawn::ignore_signal(libc::SIGPIPE).context("ignore SIGPIPE")?;
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        restore_terminal();
        previous(info)
    }));
    let rt = client::runtime()?;
    let ending = rt.block_on(session(spec, node));
    // The stdin thread may sit in a read that never ends: do not wait for it.
    rt.shutdown_background();
    ending
}

pub(crate) fn build_spec(a: &Args, status: &str) -> Result<RunSpec> {
    let argv = a
        .command
        .iter()
        .map(|s| {
            s.to_str().map(str::to_string).ok_or_else(|| {
                anyhow!("argument {s:?} is not valid UTF-8, which ferry run cannot pass on")
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let mut env = Vec::new();
    for (k, v) in std::env::vars_os() {
        match (k.into_string(), v.into_string()) {
            (Ok(k), Ok(v)) => env.push((k, v)),
            (k, _) => log::warn!("not passing environment variable {k:?}: not valid UTF-8"),
        }
    }
    let cwd = std::env::current_dir().context("find the current directory")?;
    let cwd = cwd
        .to_str()
        .ok_or_else(|| anyhow!("the current directory {cwd:?} is not valid UTF-8"))?
        .to_string();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(str::trim)
            .ok_or_else(|| anyhow!("no {name} line in /proc/self/status"))
    };
    let umask = u32::from_str_radix(field("Umask:")?, 8).context("parse Umask")?;
    let sig_ignored = u64::from_str_radix(field("SigIgn:")?, 16).context("parse SigIgn")?;
    let sig_blocked = u64::from_str_radix(field("SigBlk:")?, 16).context("parse SigBlk")?;
    let (uid, gid, groups) = ferry_sys::spawn::ids().context("read our credentials")?;
    let mut rlimits = Vec::new();
    // RLIMIT_CPU (0) to RLIMIT_RTTIME (15): every limit Linux has.
    for r in 0..16u32 {
        let (soft, hard) =
            ferry_sys::fdops::get_rlimit(0, r).with_context(|| format!("read rlimit {r}"))?;
        rlimits.push((r, soft, hard));
    }
    let tty = if std::io::stdin().is_terminal() && std::io::stdout().is_terminal() {
        let [rows, cols, ..] = ferry_sys::tty::get_winsize(1).context("read the window size")?;
        Some((rows, cols))
    } else {
        None
    };
    Ok(RunSpec {
        argv,
        env,
        cwd,
        umask,
        uid,
        gid,
        groups,
        rlimits,
        tty,
        stderr_tty: tty.is_some() && std::io::stderr().is_terminal(),
        home_node: String::new(),
        home_pid: std::process::id() as i32,
        target: a.on.clone(),
        elsewhere: a.elsewhere,
        balance: a.balance,
        sig_ignored,
        sig_blocked,
        checkpoint_every_secs: match a.checkpoint_every {
            Some(s) if !(s.is_finite() && s >= 0.0) => {
                bail!("--checkpoint-every {s}: not a number of seconds (0 for never)")
            }
            s => s,
        },
    })
}

/// A frame for the daemon, and who wants to know it was written.
type Up = (Msg, Option<oneshot::Sender<()>>);

/// What the output thread writes.
enum Out {
    Data(u8, Vec<u8>),
    /// The program closed that stream.
    End(u8),
}

async fn session(spec: RunSpec, node: Option<&str>) -> Result<Ending> {
    let tty = spec.tty.is_some();
    let command = spec.argv[0].clone();
    // Signals first: one that comes while the program starts is delivered once it runs. A
    // signal we were started ignoring stays ignored (the program ignores it too).
    let (sig_tx, mut sig_rx) = mpsc::unbounded_channel::<i32>();
    for sig in FORWARDED {
        if spec.sig_ignored & (1u64 << (sig - 1)) != 0 {
            continue;
        }
        let mut s =
            signal(SignalKind::from_raw(sig)).with_context(|| format!("watch signal {sig}"))?;
        let tx = sig_tx.clone();
        tokio::spawn(async move {
            while s.recv().await.is_some() {
                if tx.send(sig).is_err() {
                    break;
                }
            }
        });
    }

    let mut s = client::connect(node).await?;
    write_msg(&mut s, &Msg::Run(spec))
        .await
        .context("send the command to the daemon")?;
    // Until the program runs, a signal that would end it ends us instead (the daemon hangs up
    // whatever it was starting when our connection closes); the others wait until it runs.
    let mut early = Vec::new();
    let answer = {
        let read = read_msg(&mut s);
        tokio::pin!(read);
        loop {
            tokio::select! {
                m = &mut read => break m.context("the daemon did not answer")?,
                Some(sig) = sig_rx.recv() => {
                    if matches!(sig, libc::SIGINT | libc::SIGTERM | libc::SIGHUP | libc::SIGQUIT) {
                        return Ok(Ending::Signal(sig));
                    }
                    early.push(sig);
                }
            }
        }
    };
    let (there, pid) = match answer {
        Msg::Started { node, pid } => (node, pid),
        Msg::RunFailed { message, exit_code } => {
            eprintln!("ferry run: {message}");
            return Ok(Ending::Code(exit_code));
        }
        Msg::Error { message } => bail!("{message}"),
        other => bail!("unexpected answer {}", kind(&other)),
    };
    log::info!("{command} runs on node {there} as PID {pid}");
    if tty {
        raw_mode().context("put the terminal in raw mode")?;
    }

    let (mut rd, mut wr) = s.into_split();
    // Frames are read by a task of their own: a read cut short by a signal would lose part of
    // a frame. Two frames at most wait for the output thread.
    let (frame_tx, mut frames) = mpsc::channel(2);
    tokio::spawn(async move {
        loop {
            let f = read_frame(&mut rd).await;
            let last = f.is_err();
            if frame_tx.send(f).await.is_err() || last {
                break;
            }
        }
    });
    let (up_tx, mut up_rx) = mpsc::channel::<Up>(16);
    tokio::spawn(async move {
        while let Some((m, ack)) = up_rx.recv().await {
            if write_msg(&mut wr, &m).await.is_err() {
                break;
            }
            if let Some(a) = ack {
                let _ = a.send(());
            }
        }
    });
    // Nothing to read from /dev/null: its end goes at once, without a thread.
    if stdin_is_dev_null() {
        let _ = up_tx.send((Msg::IoEnd { stream: 0 }, None)).await;
    } else {
        let up = up_tx.clone();
        std::thread::Builder::new()
            .name("stdin".into())
            .spawn(move || pump_stdin(up))
            .context("start the stdin thread")?;
    }
    // The output thread starts with the first output (a program that writes nothing, as many
    // of a build's are, costs no thread); until then a stream's end is done here.
    let mut output: Option<Output> = None;
    let mut closed = [false; 3];

    for sig in early {
        on_signal(sig, tty, &up_tx).await;
    }
    let ending = loop {
        tokio::select! {
            f = frames.recv() => match f.unwrap_or(Err(FrameError::Closed)) {
                Ok(Frame::Msg(Msg::Io { stream: s @ (1 | 2), data })) => {
                    if output.is_none() {
                        output = Some(Output::start(closed, &up_tx, tty)?);
                    }
                    if let Some(o) = &output {
                        let _ = o.tx.send(Out::Data(s, data.into_vec())).await;
                    }
                }
                Ok(Frame::Msg(Msg::IoEnd { stream: s @ (1 | 2) })) => match &output {
                    Some(o) => {
                        let _ = o.tx.send(Out::End(s)).await;
                    }
                    None => end_stream(&mut closed, s, tty),
                },
                Ok(Frame::Msg(Msg::Exited { code, signal })) => {
                    break Ok(match (signal, code) {
                        (Some(s), _) => Ending::Signal(s),
                        (None, Some(c)) => Ending::Code(c & 0xff),
                        (None, None) => Ending::Code(EXIT_FERRY_FAILED),
                    });
                }
                Ok(Frame::Msg(Msg::Error { message })) => break Err(anyhow!("{message}")),
                Ok(Frame::Msg(other)) => log::debug!("ignored {} from the daemon", kind(&other)),
                Ok(_) => {}
                Err(FrameError::Closed) => break Err(anyhow!(
                    "lost the connection to node {there} (or to this node's daemon) before \
                     {command} ended; it is hung up there"
                )),
                Err(e) => break Err(anyhow!("connection to node {there}: {e}")),
            },
            Some(sig) = sig_rx.recv() => on_signal(sig, tty, &up_tx).await,
        }
    };
    // Everything received is written before we go.
    if let Some(o) = output {
        drop(o.tx);
        let _ = o.done.await;
    }
    ending
}

/// The output thread: what it is to write, and its word that it wrote everything.
struct Output {
    tx: mpsc::Sender<Out>,
    done: oneshot::Receiver<()>,
}

impl Output {
    fn start(closed: [bool; 3], up: &mpsc::Sender<Up>, tty: bool) -> Result<Output> {
        let (tx, rx) = mpsc::channel::<Out>(4);
        let (done_tx, done) = oneshot::channel();
        let up = up.clone();
        std::thread::Builder::new()
            .name("output".into())
            .spawn(move || {
                write_output(rx, up, tty, closed);
                let _ = done_tx.send(());
            })
            .context("start the output thread")?;
        Ok(Output { tx, done })
    }
}

/// Whether our stdin is /dev/null (read: nothing, at once).
fn stdin_is_dev_null() -> bool {
    use std::os::fd::AsFd;
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let Ok(fd) = std::io::stdin().as_fd().try_clone_to_owned() else {
        return false;
    };
    let Ok(md) = std::fs::File::from(fd).metadata() else {
        return false;
    };
    // /dev/null is the character device 1:3.
    md.file_type().is_char_device() && md.rdev() == libc::makedev(1, 3)
}

/// A signal we received: sent on to the program (window sizes as `Resize`). SIGTSTP stops us
/// too, after the program, with the terminal back in its own mode; SIGCONT undoes that.
async fn on_signal(sig: i32, tty: bool, up: &mpsc::Sender<Up>) {
    match sig {
        libc::SIGWINCH => {
            if tty {
                send_resize(up).await;
            }
        }
        libc::SIGTSTP => {
            let (ack, done) = oneshot::channel();
            if up
                .send((Msg::Signal { signal: sig }, Some(ack)))
                .await
                .is_ok()
            {
                let _ = tokio::time::timeout(Duration::from_secs(1), done).await;
            }
            restore_terminal();
            ferry_sys::spawn::stop_self();
        }
        libc::SIGCONT => {
            if tty {
                if let Err(e) = raw_mode() {
                    log::warn!("cannot put the terminal back in raw mode: {e:#}");
                }
                send_resize(up).await;
            }
            let _ = up.send((Msg::Signal { signal: sig }, None)).await;
        }
        _ => {
            let _ = up.send((Msg::Signal { signal: sig }, None)).await;
        }
    }
}

async fn send_resize(up: &mpsc::Sender<Up>) {
    if let Ok([rows, cols, ..]) = ferry_sys::tty::get_winsize(1) {
        let _ = up.send((Msg::Resize { rows, cols }, None)).await;
    }
}

/// Our stdin, streamed as it comes, then its end.
fn pump_stdin(up: mpsc::Sender<Up>) {
    let mut stdin = std::io::stdin().lock();
    let mut buf = vec![0u8; STDIN_CHUNK];
    loop {
        match stdin.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                let m = Msg::Io {
                    stream: 0,
                    data: ByteBuf::from(buf[..n].to_vec()),
                };
                if up.blocking_send((m, None)).is_err() {
                    return;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                log::debug!("stdin: {e}");
                break;
            }
        }
    }
    let _ = up.blocking_send((Msg::IoEnd { stream: 0 }, None));
}

/// Writes the program's output to our stdout and stderr. A reader that went away (EPIPE) is
/// reported upstream as `IoEnd` on that stream, and the program gets EPIPE in turn.
fn write_output(
    mut rx: mpsc::Receiver<Out>,
    up: mpsc::Sender<Up>,
    tty: bool,
    mut closed: [bool; 3],
) {
    while let Some(o) = rx.blocking_recv() {
        match o {
            Out::Data(s, d) => {
                let s = s as usize;
                if closed[s] {
                    continue;
                }
                // Straight to the descriptor: nothing else here writes to our stdout, and its
                // line buffer would only scan and split what is already a whole chunk.
                if let Err(e) = write_all_fd(s as i32, &d) {
                    log::debug!("writing stream {s}: {e}");
                    closed[s] = true;
                    let _ = up.blocking_send((Msg::IoEnd { stream: s as u8 }, None));
                }
            }
            Out::End(s) => end_stream(&mut closed, s, tty),
        }
    }
}

/// Writes all of `data` to descriptor `fd`.
fn write_all_fd(fd: i32, mut data: &[u8]) -> std::io::Result<()> {
    while !data.is_empty() {
        match ferry_sys::fdops::write_fd(fd, data) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => data = &data[n..],
            Err(e) if e.errno == libc::EINTR => {}
            Err(e) => return Err(std::io::Error::from_raw_os_error(e.errno)),
        }
    }
    Ok(())
}

/// The program closed its stdout (1) or stderr (2): so do we, so that a reader sees the end (a
/// terminal stays, it is also the program's terminal).
fn end_stream(closed: &mut [bool; 3], s: u8, tty: bool) {
    let s = s as usize;
    if closed[s] {
        return;
    }
    closed[s] = true;
    let is_tty = if s == 1 {
        std::io::stdout().is_terminal()
    } else {
        std::io::stderr().is_terminal()
    };
    if !tty && !is_tty {
        let _ = std::io::stdout().flush();
        let _ = ferry_sys::spawn::release_stdio(s as i32);
    }
}

fn raw_mode() -> Result<()> {
    let current = ferry_sys::tty::get_termios(0)?;
    let mut raw = current.clone();
    // cfmakeraw(3).
    raw.iflag &= !(libc::IGNBRK
        | libc::BRKINT
        | libc::PARMRK
        | libc::ISTRIP
        | libc::INLCR
        | libc::IGNCR
        | libc::ICRNL
        | libc::IXON);
    raw.oflag &= !libc::OPOST;
    raw.lflag &= !(libc::ECHO | libc::ECHONL | libc::ICANON | libc::ISIG | libc::IEXTEN);
    raw.cflag &= !(libc::CSIZE | libc::PARENB);
    raw.cflag |= libc::CS8;
    if raw.cc.len() > libc::VMIN.max(libc::VTIME) {
        raw.cc[libc::VMIN] = 1;
        raw.cc[libc::VTIME] = 0;
    }
    let mut saved = SAVED_TERMIOS.lock().unwrap_or_else(|p| p.into_inner());
    if saved.is_none() {
        *saved = Some(current);
    }
    ferry_sys::tty::set_termios(0, &raw)?;
    Ok(())
}

fn restore_terminal() {
    let mut saved = SAVED_TERMIOS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(t) = saved.take() {
        let _ = ferry_sys::tty::set_termios(0, &t);
    }
}
