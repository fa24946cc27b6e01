//! `ferry __guest-init --hold-fd N` (hidden): PID 1 of the guest namespaces a tree is restored
//! into (`ferry restore --pid-namespace`, `ferry_engine::guest_ns`).
//!
//! It reaps every child as soon as it ends (orphans of the guest are reparented to it), and
//! exits once the process that made the namespaces has closed the hold pipe (descriptor N) and
//! no process other than itself is left in its PID namespace. It looks at least once a second;
//! it must never exit earlier, since the kernel kills every process of a PID namespace whose
//! init exits. It runs one thread only: a second thread would take a PID of the namespace,
//! which a restored tree may need.

use anyhow::{bail, Context, Result};
use std::os::fd::AsRawFd;

#[derive(clap::Args)]
pub struct Args {
    /// The read end of the hold pipe: while its writer holds it open, stay even when alone.
    #[arg(long)]
    pub hold_fd: i32,
    /// A datagram socket (the daemon's) told of every child that ends, stops or continues: "NS
    /// PID STATUS", where NS names this PID namespace as /proc/self/ns/pid does and STATUS is the
    /// raw wait status.
    #[arg(long)]
    pub report: Option<std::path::PathBuf>,
}

/// Whether this init is the only process of its PID namespace (its /proc is the namespace's).
fn alone() -> bool {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return false;
    };
    !dir.flatten().any(|e| {
        e.file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
            .is_some_and(|pid| pid != 1)
    })
}

/// Reaps every child that has ended, and reports each end, stop and continue to `report` (best
/// effort: a daemon that is gone misses them).
fn reap(report: Option<&(std::os::unix::net::UnixDatagram, String)>) {
    while let Ok(Some((pid, status))) = ferry_sys::ns::wait_any_changes() {
        if let Some((sock, ns)) = report {
            let _ = sock.send(format!("{ns} {pid} {status}\n").as_bytes());
        }
    }
}

pub fn run(a: Args) -> Result<()> {
    use ferry_sys::{anon_fds, fdops, ns};
    if ns::getpid() != 1 {
        bail!("`ferry __guest-init` only runs as PID 1 of the guest namespaces ferry makes");
    }
    let hold = ns::take_inherited_fd(a.hold_fd)
        .with_context(|| format!("take the hold pipe (fd {})", a.hold_fd))?;
    ns::block_signal(libc::SIGCHLD).context("block SIGCHLD")?;
    let sigchld = anon_fds::signalfd(
        1 << (libc::SIGCHLD - 1),
        libc::SFD_CLOEXEC | libc::SFD_NONBLOCK,
    )
    .context("make a signalfd for SIGCHLD")?;
    // Connected before anything is reaped; a report socket that cannot be reached is logged
    // and done without.
    let report = a.report.as_ref().and_then(|path| {
        let sock = std::os::unix::net::UnixDatagram::unbound()
            .and_then(|s| s.connect(path).map(|()| s))
            .map_err(|e| log::warn!("guest init: report socket {}: {e}", path.display()))
            .ok()?;
        let ns = std::fs::read_link("/proc/self/ns/pid").ok()?;
        Some((sock, ns.to_string_lossy().into_owned()))
    });
    let mut hold = Some(hold);
    loop {
        reap(report.as_ref());
        if hold.is_none() && alone() {
            return Ok(());
        }
        let mut fds = vec![sigchld.as_raw_fd()];
        fds.extend(hold.as_ref().map(|h| h.as_raw_fd()));
        let ready = match ns::poll_in(&fds, 1000) {
            Ok(r) => r,
            Err(e) => {
                log::warn!("guest init: {e}");
                std::thread::sleep(std::time::Duration::from_secs(1));
                continue;
            }
        };
        if ready[0] {
            let mut buf = [0u8; 128];
            while matches!(fdops::read_fd(sigchld.as_raw_fd(), &mut buf), Ok(n) if n > 0) {}
        }
        if ready.get(1) == Some(&true) {
            let mut buf = [0u8; 64];
            let fd = hold.as_ref().map(|h| h.as_raw_fd()).unwrap_or(-1);
            if !matches!(fdops::read_fd(fd, &mut buf), Ok(n) if n > 0) {
                hold = None;
            }
        }
    }
}
