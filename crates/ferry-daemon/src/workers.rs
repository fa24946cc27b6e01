//! Engine workers: the daemon never ptraces anything itself. Each capture or restore runs in a
//! fresh single-threaded `ferry` process (the only tracer of its tree, as ptrace wants), fed
//! and read through two pipes carrying the same frames as the network. A worker that crashes
//! takes nothing down with it; a daemon that dies closes the pipes, and the worker backs out.

use anyhow::{Context, Result};
use ferry_transport::{read_frame, Frame, FrameError};
use std::os::fd::OwnedFd;
use std::path::Path;
use std::process::{Command, Stdio};
use tokio::io::BufReader;
use tokio::net::unix::pipe;
use tokio::sync::mpsc;

pub struct Worker {
    pub pid: i32,
    /// Frames to the worker (its stdin, or the connection a restarted daemon made to it).
    pub tx: Box<dyn tokio::io::AsyncWrite + Unpin + Send>,
    /// Frames from the worker (its stdout), read by a task of their own so that waiting for
    /// one can be abandoned (in a `select!`) without losing half a frame.
    rx: mpsc::Receiver<Result<Frame, FrameError>>,
}

impl Worker {
    pub fn spawn(exe: &Path, args: &[String]) -> Result<Worker> {
        let mut child = Command::new(exe)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("start worker {} {}", exe.display(), args.join(" ")))?;
        let stdin: OwnedFd = child.stdin.take().expect("piped").into();
        let stdout: OwnedFd = child.stdout.take().expect("piped").into();
        let pid = child.id() as i32;
        // The daemon's reaper collects the exit status; the Child handle is just dropped.
        drop(child);
        let from = pipe::Receiver::from_owned_fd(stdout).context("worker stdout")?;
        let tx = pipe::Sender::from_owned_fd(stdin).context("worker stdin")?;
        Ok(Self::over(pid, from, tx))
    }

    /// A worker an earlier run of this daemon started, reached on the socket it listens on
    /// once its daemon is gone (the deputies' worker: crate::deputies::recover).
    pub async fn connect(pid: i32, sock: &Path) -> Result<Worker> {
        let conn = tokio::net::UnixStream::connect(sock)
            .await
            .with_context(|| format!("connect to worker {pid} on {}", sock.display()))?;
        let (from, tx) = conn.into_split();
        Ok(Self::over(pid, from, tx))
    }

    fn over(
        pid: i32,
        from: impl tokio::io::AsyncRead + Unpin + Send + 'static,
        tx: impl tokio::io::AsyncWrite + Unpin + Send + 'static,
    ) -> Worker {
        let mut from = BufReader::with_capacity(1 << 20, from);
        let (frames, rx) = mpsc::channel(4);
        tokio::spawn(async move {
            loop {
                let f = read_frame(&mut from).await;
                let last = f.is_err();
                if frames.send(f).await.is_err() || last {
                    return;
                }
            }
        });
        Worker {
            pid,
            tx: Box::new(tx),
            rx,
        }
    }

    /// Its stdin, and its stdout's frames, apart: to write to it while hearing what it says.
    #[allow(clippy::type_complexity)]
    pub fn split(
        &mut self,
    ) -> (
        &mut Box<dyn tokio::io::AsyncWrite + Send + Unpin>,
        &mut mpsc::Receiver<Result<Frame, FrameError>>,
    ) {
        (&mut self.tx, &mut self.rx)
    }

    /// The next frame from the worker; `Closed` once it has exited.
    pub async fn next_frame(&mut self) -> Result<Frame, FrameError> {
        self.rx.recv().await.unwrap_or(Err(FrameError::Closed))
    }
}

/// A lazy migration's page link to a worker (`ferry/src/commands/pages.rs`): a UNIX stream
/// socket apart from the worker's control pipes.
pub struct PageLink {
    pub stream: tokio::net::UnixStream,
}

impl Worker {
    /// Spawns a worker with a page link: its end is a descriptor of ours the worker takes with
    /// `pidfd_getfd` (`--pages-fd N`), greeting us on the link once it holds it; only then is
    /// our copy closed, so that the link closes when the worker dies.
    pub async fn spawn_paged(exe: &Path, args: &[String]) -> Result<(Worker, PageLink)> {
        use std::os::fd::AsRawFd;
        let (ours, theirs) =
            ferry_sys::sockets::socketpair(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC)
                .context("make a page link")?;
        let mut args = args.to_vec();
        args.push(format!("--pages-fd={}", theirs.as_raw_fd()));
        let worker = Worker::spawn(exe, &args)?;
        let ours = std::os::unix::net::UnixStream::from(ours);
        ours.set_nonblocking(true).context("page link")?;
        let mut stream = tokio::net::UnixStream::from_std(ours).context("page link")?;
        let hello =
            tokio::time::timeout(std::time::Duration::from_secs(10), read_frame(&mut stream)).await;
        drop(theirs);
        match hello {
            Ok(Ok(Frame::Msg(ferry_transport::Msg::Accept))) => Ok((worker, PageLink { stream })),
            Ok(Ok(_)) => anyhow::bail!("worker {} greeted its page link wrongly", worker.pid),
            Ok(Err(e)) => anyhow::bail!("worker {} did not take its page link: {e}", worker.pid),
            Err(_) => anyhow::bail!("worker {} did not take its page link in 10 s", worker.pid),
        }
    }
}
