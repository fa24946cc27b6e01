//! `ferry checkpoint` and `ferry restore` for a caller who is not root (docs/security.md,
//! "Users who are not root"). The daemon runs the same commands a root caller runs, as a child
//! of its own, with `--owner` saying for whom: the command checks that the tree is the
//! caller's (before and after it is frozen), opens and writes the image directory with the
//! caller's rights, and restores only images whose processes hold the caller's credentials.
//! What the command prints, and its exit code, go back to the caller in one `Output`.

use crate::node::Node;
use anyhow::{bail, Context, Result};
use ferry_sys::owner::Owner;
use ferry_transport::message::kind;
use ferry_transport::Msg;
use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::Arc;
use tokio::net::UnixStream;

/// Runs the `Checkpoint` or `Restore` in `request` for `owner` (None: root) and answers
/// `Output`. A caller that goes away meanwhile stops the command (SIGTERM: a checkpoint thaws
/// the tree, a restore kills what it had made).
pub async fn serve(
    node: &Arc<Node>,
    cli: &mut UnixStream,
    request: Msg,
    owner: Option<&Owner>,
) -> Result<Msg> {
    let absolute = |what: &str, p: &str| -> Result<String> {
        if !p.starts_with('/') {
            bail!("{what} {p:?} is not an absolute path");
        }
        Ok(p.to_string())
    };
    let mut args: Vec<String> = Vec::new();
    match request {
        Msg::Checkpoint {
            pid,
            dir,
            leave_running,
            parent,
            json,
        } => {
            args.extend(["checkpoint".into(), pid.to_string(), "--dir".into()]);
            args.push(absolute("image directory", &dir)?);
            if leave_running {
                args.push("--leave-running".into());
            }
            if let Some(p) = parent {
                args.push("--parent".into());
                args.push(absolute("parent image directory", &p)?);
            }
            if json {
                args.push("--json".into());
            }
        }
        Msg::Restore {
            dir,
            pid_namespace,
            json,
        } => {
            args.extend(["restore".into(), "--dir".into()]);
            args.push(absolute("image directory", &dir)?);
            if pid_namespace {
                args.push("--pid-namespace".into());
            }
            if json {
                args.push("--json".into());
            }
        }
        other => bail!("not an engine command: {}", kind(&other)),
    }
    if let Some(o) = owner {
        args.push(format!("--owner={o}"));
    }
    tracing::info!(event = "engine-command", uid = owner.map_or(0, |o| o.uid), args = ?args);
    let mut child = Command::new(&node.exe)
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .current_dir("/")
        .spawn()
        .with_context(|| format!("start ferry {}", args.join(" ")))?;
    let pid = child.id() as i32;
    let mut out = child.stdout.take().expect("piped");
    let mut err = child.stderr.take().expect("piped");
    // The daemon's reaper collects the exit status; the Child handle is just dropped.
    drop(child);
    let read_out = tokio::task::spawn_blocking(move || {
        let mut b = Vec::new();
        let _ = out.read_to_end(&mut b);
        b
    });
    let read_err = tokio::task::spawn_blocking(move || {
        let mut b = Vec::new();
        let _ = err.read_to_end(&mut b);
        b
    });
    let status = tokio::select! {
        s = node.reaper.wait(pid) => s,
        _ = caller_gone(cli) => {
            let _ = ferry_sys::ptrace::kill(pid, libc::SIGTERM);
            node.reaper.wait(pid).await
        }
    };
    let stdout = read_out.await.unwrap_or_default();
    let stderr = read_err.await.unwrap_or_default();
    let code = if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        128 + libc::WTERMSIG(status)
    };
    Ok(Msg::Output {
        code,
        stdout: stdout.into(),
        stderr: stderr.into(),
    })
}

/// Returns once the caller has closed its end (it sends nothing more after its request).
async fn caller_gone(cli: &mut UnixStream) {
    let mut b = [0u8; 1];
    loop {
        if cli.readable().await.is_err() {
            return;
        }
        match cli.try_read(&mut b) {
            // A spurious wake-up.
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            // The end, an error, or bytes the caller should not have sent.
            _ => return,
        }
    }
}
