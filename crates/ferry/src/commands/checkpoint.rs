//! `ferry checkpoint PID --dir DIR [--leave-running]`

use anyhow::{Context, Result};
use ferry_engine::checkpoint::{capture, CaptureReport};
use ferry_engine::freeze::FrozenTree;
use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// The process to capture, with all its descendants.
    pub pid: i32,
    /// Directory to write the image into (created if missing).
    #[arg(long)]
    pub dir: PathBuf,
    /// Let the tree carry on after the checkpoint instead of killing it.
    #[arg(long)]
    pub leave_running: bool,
    /// Print a machine-readable report.
    #[arg(long)]
    pub json: bool,
}

#[derive(serde::Serialize)]
struct Report {
    root_pid: i32,
    image: PathBuf,
    left_running: bool,
    freeze_ms: f64,
    frozen_ms: f64,
    total_ms: f64,
    #[serde(flatten)]
    capture: CaptureReport,
}

/// Runs the checkpoint in a worker process. The worker is the only tracer of the tree: if this
/// process is killed, even by SIGKILL, the worker is told (parent-death signal), stops at the
/// next safe point, puts every thread back as it was and detaches. The tree never notices.
pub fn run(a: Args) -> Result<()> {
    use ferry_sys::process::{fork_single_threaded, Forked};
    let parent = std::process::id() as i32;
    match fork_single_threaded().context("start the checkpoint worker")? {
        Forked::Parent { child } => {
            let code = ferry_sys::process::wait_exit_code(child)
                .context("wait for the checkpoint worker")?;
            std::process::exit(code);
        }
        Forked::Child => {
            let cancel = ferry_engine::cancel::flag();
            for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
                signal_hook::flag::register(sig, cancel.clone())
                    .context("install signal handlers")?;
            }
            ferry_sys::process::set_parent_death_signal(libc::SIGTERM)
                .context("watch the ferry process")?;
            if ferry_sys::process::parent_pid() != parent {
                anyhow::bail!("ferry exited before the checkpoint started");
            }
            work(a)
        }
    }
}

fn work(a: Args) -> Result<()> {
    let t0 = Instant::now();
    std::fs::create_dir_all(&a.dir)
        .with_context(|| format!("create image directory {}", a.dir.display()))?;
    let final_path = a.dir.join(ferry_image::IMAGE_FILE);
    let tmp_path = a.dir.join(format!("{}.partial", ferry_image::IMAGE_FILE));
    let frozen = FrozenTree::freeze(a.pid).with_context(|| format!("freeze PID {}", a.pid))?;
    let freeze_ms = t0.elapsed().as_secs_f64() * 1e3;
    let file = std::fs::File::create(&tmp_path)
        .with_context(|| format!("create {}", tmp_path.display()))?;
    // A buffer smaller than the engine's runs of memory (4 MiB): BufWriter copies what fits
    // in its buffer and passes larger writes straight to the file, so the small writes (record
    // headers, short runs) are gathered and the large ones are not copied once more.
    let out = BufWriter::with_capacity(256 << 10, file);
    let written = capture(&frozen, out).and_then(|done| {
        // Last chance to back out: after this point the tree is killed or let go as asked.
        ferry_engine::cancel::check("writing the image")?;
        Ok(done)
    });
    let (out, capture_report) = match written {
        Ok(ok) => ok,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp_path);
            // Dropping `frozen` lets the tree carry on untouched.
            return Err(e).with_context(|| format!("checkpoint PID {}", a.pid));
        }
    };
    let file = out
        .into_inner()
        .map_err(|e| e.into_error())
        .context("flush the image")?;
    file.sync_all().context("sync the image to disk")?;
    std::fs::rename(&tmp_path, &final_path)
        .with_context(|| format!("rename the image to {}", final_path.display()))?;
    if let Ok(d) = std::fs::File::open(&a.dir) {
        let _ = d.sync_all();
    }
    // The image is complete and on disk: only now may the tree go.
    let frozen_ms;
    if a.leave_running {
        frozen.thaw();
        frozen_ms = t0.elapsed().as_secs_f64() * 1e3;
    } else {
        frozen_ms = t0.elapsed().as_secs_f64() * 1e3;
        frozen.kill();
    }
    let report = Report {
        root_pid: a.pid,
        image: final_path,
        left_running: a.leave_running,
        freeze_ms,
        frozen_ms,
        total_ms: t0.elapsed().as_secs_f64() * 1e3,
        capture: capture_report,
    };
    if a.json {
        super::print_json(&report)?;
    } else {
        let mut o = std::io::stdout().lock();
        writeln!(
            o,
            "checkpointed PID {} ({} processes, {} threads): {:.1} MiB of memory in {:.1} MiB of image, {:.0} ms; {}",
            report.root_pid,
            report.capture.pids.len(),
            report.capture.threads,
            report.capture.memory_bytes as f64 / 1048576.0,
            report.capture.image_bytes as f64 / 1048576.0,
            report.total_ms,
            if a.leave_running { "left running" } else { "tree killed" }
        )?;
    }
    Ok(())
}
