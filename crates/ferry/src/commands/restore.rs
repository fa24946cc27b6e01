//! `ferry restore --dir DIR [--pid-namespace]`

use anyhow::{Context, Result};
use ferry_engine::guest_ns::GuestNamespaces;
use ferry_engine::restore::{open, restore_with, RestoreOptions, RestoreReport};
use std::io::BufReader;
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// Directory holding the image.
    #[arg(long)]
    pub dir: PathBuf,
    /// Print a machine-readable report.
    #[arg(long)]
    pub json: bool,
    /// Rebuild the tree in fresh PID, time and mount namespaces of its own: it gets back its
    /// PIDs even if they are taken here (the original may still run), and its monotonic clocks
    /// continue from where it saw them. Prints the root's PID on this machine.
    #[arg(long)]
    pub pid_namespace: bool,
}

#[derive(serde::Serialize)]
struct Report {
    /// Reading the image's header and tree; the rest is read as the tree is rebuilt.
    read_ms: f64,
    total_ms: f64,
    image_data_bytes: u64,
    #[serde(flatten)]
    restore: RestoreReport,
}

pub fn run(a: Args) -> Result<()> {
    let t0 = Instant::now();
    let path = a.dir.join(ferry_image::IMAGE_FILE);
    let file =
        std::fs::File::open(&path).with_context(|| format!("open image {}", path.display()))?;
    let mut img = open(BufReader::with_capacity(1 << 20, file))
        .with_context(|| format!("read image {}", path.display()))?;
    let read_ms = t0.elapsed().as_secs_f64() * 1e3;
    let guest = if a.pid_namespace {
        let exe = std::env::current_exe().context("find the ferry executable")?;
        Some(
            GuestNamespaces::create(&exe, img.tree.clocks, None)
                .context("make the guest namespaces")?,
        )
    } else {
        None
    };
    let opts = RestoreOptions {
        guest: guest.as_ref(),
        // The CLI is root's: files are opened as each process, then as Ferry itself.
        caller: None,
        cpu_cgroup: None,
        relays: false,
    };
    let report = restore_with(&mut img, &opts)
        .and_then(|tree| tree.resume())
        .with_context(|| format!("restore from {}", path.display()))?;
    let report = Report {
        read_ms,
        total_ms: t0.elapsed().as_secs_f64() * 1e3,
        image_data_bytes: img.data_bytes(),
        restore: report,
    };
    if a.json {
        super::print_json(&report)?;
    } else {
        // Our PID of the root: the same as the image's unless it was rebuilt in a namespace.
        println!("{}", report.restore.root_host_pid);
    }
    Ok(())
}
