//! `ferry __guest-init --hold-fd N` (hidden): PID 1 of the guest namespaces a tree is restored
//! into (`ferry restore --pid-namespace`, `ferry_engine::guest_ns`).
//!
//! It reaps every child (orphans of the guest are reparented to it), and exits once the process
//! that made the namespaces has closed the hold pipe (descriptor N) and no process other than
//! itself is left in its PID namespace. It looks once a second; it must never exit earlier,
//! since the kernel kills every process of a PID namespace whose init exits.

use anyhow::{bail, Context, Result};
use std::io::Read;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[derive(clap::Args)]
pub struct Args {
    /// The read end of the hold pipe: while its writer holds it open, stay even when alone.
    #[arg(long)]
    pub hold_fd: i32,
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

pub fn run(a: Args) -> Result<()> {
    if ferry_sys::ns::getpid() != 1 {
        bail!("`ferry __guest-init` only runs as PID 1 of the guest namespaces ferry makes");
    }
    let hold = ferry_sys::ns::take_inherited_fd(a.hold_fd)
        .with_context(|| format!("take the hold pipe (fd {})", a.hold_fd))?;
    let released = Arc::new(AtomicBool::new(false));
    let flag = released.clone();
    std::thread::spawn(move || {
        let mut f = std::fs::File::from(hold);
        let mut buf = [0u8; 64];
        while let Ok(n) = f.read(&mut buf) {
            if n == 0 {
                break;
            }
        }
        flag.store(true, Ordering::SeqCst);
    });
    loop {
        match ferry_sys::ns::wait_any(false) {
            Ok(_) => continue,
            Err(e) if e.errno == libc::ECHILD => {
                if released.load(Ordering::SeqCst) && alone() {
                    return Ok(());
                }
            }
            Err(e) => log::warn!("guest init: {e}"),
        }
        std::thread::sleep(Duration::from_secs(1));
    }
}
