//! `ferry __relay-holder --root PID` (internal): holds a pipe relay's home end and buffers
//! across a restart of the home daemon (`ferry_daemon::relay_keep`). The daemon starts it in a
//! process group of its own with the descriptors to hold as its stdin, stdout and stderr; it
//! closes everything else it may have been given, keeps those three open, and ends when home
//! PID `--root` (the tree's deputy) does, which it learns from a pidfd (poll), or when the
//! daemon kills it (SIGKILL) as the relay ends. SIGHUP, SIGINT and SIGTERM, sent to a process
//! group or a session (a terminal hanging up, a service manager stopping the daemon's group),
//! are ignored: the relay's state is in what it holds. Its name (`comm`) is
//! [`NAME`], so `ps` says what it is.

use anyhow::{anyhow, Result};

/// What `ps` shows of a holder (at most 15 bytes, the kernel's `comm`).
pub const NAME: &str = "ferry-holder";

#[derive(clap::Args)]
pub struct Args {
    /// Home PID of the tree's root (its deputy): the holder ends with it.
    #[arg(long)]
    pub root: i32,
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
    loop {
        match ferry_sys::ns::poll_in(&[pidfd.as_raw_fd()], -1) {
            Ok(r) if r[0] => return Ok(()),
            Ok(_) => continue,
            Err(e) if e.errno == libc::EINTR => continue,
            Err(e) => return Err(anyhow!("wait for PID {}: {e}", a.root)),
        }
    }
}
