//! The guardian of a lazy phase: a small process (`ferry __lazy-guard`) that holds a
//! duplicate of every userfaultfd the page server serves, so that the server's death (the
//! restoring `ferry` killed, even with SIGKILL) cannot let the kernel unregister the owed
//! ranges, which would make every owed page read as zeros. On that death it kills the tree
//! and every process descended from it, then lets the descriptors go: a thread blocked in a
//! fault dies there, and nothing runs on with memory it never got.
//!
//! The server tells it, one line at a time on its stdin (a pipe): `pid HOST_PID` for each
//! process of the tree, `uffd FD` for each userfaultfd (a descriptor number in the server's
//! process, taken with `pidfd_getfd`), `sync` (answered `ok` on its stdout once all of that
//! is held: the tree runs only after it), and `done` once nothing is owed. End of file without
//! `done` is the server's death.

use std::io::{BufRead, Write};
use std::os::fd::OwnedFd;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

/// The server's end: the guardian process and the pipes to and from it.
pub struct Guardian {
    child: Child,
    to: ChildStdin,
    from: std::io::BufReader<ChildStdout>,
}

impl Guardian {
    /// Starts `exe __lazy-guard` (the ferry binary) guarding the server, this process.
    pub fn start(exe: &std::path::Path) -> Result<Guardian, String> {
        let mut child = Command::new(exe)
            .arg("__lazy-guard")
            .arg(std::process::id().to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("start the lazy phase's guardian ({}): {e}", exe.display()))?;
        let to = child.stdin.take().expect("piped");
        let from = std::io::BufReader::new(child.stdout.take().expect("piped"));
        Ok(Guardian { child, to, from })
    }

    /// Waits until the guardian holds everything it was told of: only then may the tree run
    /// (a server killed before would leave owed pages unguarded).
    pub fn sync(&mut self) -> Result<(), String> {
        self.say("sync")?;
        let mut line = String::new();
        match self.from.read_line(&mut line) {
            Ok(_) if line.trim() == "ok" => Ok(()),
            Ok(_) => Err(format!("the lazy phase's guardian answered {line:?}")),
            Err(e) => Err(format!("hear from the lazy phase's guardian: {e}")),
        }
    }

    fn say(&mut self, line: &str) -> Result<(), String> {
        writeln!(self.to, "{line}")
            .and_then(|()| self.to.flush())
            .map_err(|e| format!("tell the lazy phase's guardian {line:?}: {e}"))
    }

    /// A process of the tree, by its PID here.
    pub fn process(&mut self, host_pid: i32) -> Result<(), String> {
        self.say(&format!("pid {host_pid}"))
    }

    /// A userfaultfd of ours to hold.
    pub fn uffd(&mut self, fd: &OwnedFd) -> Result<(), String> {
        use std::os::fd::AsRawFd;
        self.say(&format!("uffd {}", fd.as_raw_fd()))
    }

    /// Nothing is owed any more: the guardian lets everything go and exits.
    pub fn done(mut self) {
        let _ = self.say("done");
        drop(self.to);
        let _ = self.child.wait();
    }
}

/// The guardian process itself: reads the server's lines until end of file; returns whether
/// it had to kill the tree.
pub fn guard_main(server_pid: i32) -> Result<bool, String> {
    // A server already gone (killed before we started) still left us its lines: what it said
    // is read to the end, and a tree it did not declare done is killed.
    let server = match ferry_sys::pidfd::pidfd_open(server_pid) {
        Ok(fd) => Some(fd),
        Err(e) if e.errno == libc::ESRCH => None,
        Err(e) => {
            return Err(format!(
                "open a pidfd of the page server (PID {server_pid}): {e}"
            ))
        }
    };
    let mut pids: Vec<(i32, OwnedFd)> = Vec::new();
    let mut held: Vec<OwnedFd> = Vec::new();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let mut w = line.split_whitespace();
        match (w.next(), w.next().and_then(|n| n.parse::<i32>().ok())) {
            (Some("pid"), Some(pid)) => {
                if let Ok(fd) = ferry_sys::pidfd::pidfd_open(pid) {
                    pids.push((pid, fd));
                }
            }
            (Some("uffd"), Some(n)) => {
                match server.as_ref().map(|s| ferry_sys::pidfd::pidfd_getfd(s, n)) {
                    Some(Ok(fd)) => held.push(fd),
                    Some(Err(e)) => eprintln!("ferry: lazy guardian: take descriptor {n}: {e}"),
                    None => {}
                }
            }
            (Some("done"), _) => return Ok(false),
            (Some("sync"), _) => {
                let mut out = std::io::stdout().lock();
                let _ = writeln!(out, "ok").and_then(|()| out.flush());
            }
            _ => eprintln!("ferry: lazy guardian: {line:?} is not understood"),
        }
    }
    if pids.is_empty() && held.is_empty() {
        // Started ahead of a hand-over that never came (the restore failed or was given up
        // before it): nothing to guard.
        return Ok(false);
    }
    let n = crate::server::kill_tree(&pids);
    eprintln!(
        "ferry: the page server of a lazy restore (PID {server_pid}) died with pages still \
         owed: the tree was killed ({n} processes) rather than left running with missing memory"
    );
    drop(held);
    Ok(true)
}
