//! `ferry migrate PID --to NODE [--json]`: move a live process tree to another node.

use super::client;
use anyhow::{bail, Context, Result};
use ferry_transport::{read_msg, write_msg, Msg};
use std::io::IsTerminal;

#[derive(clap::Args)]
pub struct Args {
    /// The process (with its descendants) to move: a PID on this node, or the home PID of a
    /// guest running here.
    pub pid: i32,
    /// The node to move it to.
    #[arg(long)]
    pub to: String,
    /// How memory moves: `eager` (all of it while the tree stands still), `precopy` (copied
    /// while it runs, then what it dirtied, in rounds; a short freeze sends the rest), `lazy`
    /// (copy-on-reference: the tree runs on the destination as soon as its other state is
    /// there, its private memory fetched from here as it touches it while the rest is pushed;
    /// the command returns once the source is no longer needed), `hybrid` (pre-copy rounds,
    /// then a short freeze after which what was dirtied since the last round follows lazily),
    /// or `auto` (chosen from the tree's size, its dirty rate and the link's speed; the report
    /// says which and why).
    #[arg(long, default_value = "auto", value_parser = ["eager", "precopy", "lazy", "hybrid", "auto"])]
    pub memory: String,
    /// Print a machine-readable report.
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: Args, node: Option<&str>) -> Result<()> {
    let rt = client::runtime()?;
    let report = rt.block_on(async {
        let mut s = client::connect(node).await?;
        write_msg(
            &mut s,
            &Msg::Migrate {
                pid: a.pid,
                to: a.to.clone(),
                memory: a.memory.clone(),
            },
        )
        .await?;
        let bar = std::io::stderr().is_terminal().then(|| {
            let b = indicatif::ProgressBar::new_spinner();
            b.set_style(
                indicatif::ProgressStyle::with_template(
                    "{spinner} {msg} {bytes} ({bytes_per_sec}) {elapsed}",
                )
                .expect("valid template"),
            );
            b.enable_steady_tick(std::time::Duration::from_millis(100));
            b
        });
        let result = loop {
            match read_msg(&mut s)
                .await
                .context("the daemon stopped answering")?
            {
                Msg::Progress { phase, bytes } => {
                    if let Some(b) = &bar {
                        b.set_message(format!("PID {} to {}: {phase}", a.pid, a.to));
                        b.set_position(bytes);
                    }
                }
                Msg::Migrated(r) => break Ok(r),
                Msg::Error { message } => break Err(anyhow::anyhow!("{message}")),
                other => bail!(
                    "unexpected answer {}",
                    ferry_transport::message::kind(&other)
                ),
            }
        };
        if let Some(b) = bar {
            b.finish_and_clear();
        }
        result
    })?;
    if a.json {
        return super::print_json(&report);
    }
    println!(
        "moved PID {} from {} to {} (PID {} there): stood still {:.0} ms, {:.1} MiB on the wire, \
         {:.0} ms in all",
        report.pid,
        report.from,
        report.to,
        report.dest_pid,
        report.freeze_ms,
        report.wire_bytes as f64 / (1 << 20) as f64,
        report.total_ms
    );
    if !report.compression.is_empty() {
        println!(
            "wire: {} compressed: {:.1} MiB for an image of {:.1} MiB",
            report.compression,
            report.wire_bytes as f64 / (1 << 20) as f64,
            report.image_bytes as f64 / (1 << 20) as f64
        );
    }
    let m = &report.memory;
    if !m.mode.is_empty() {
        println!("memory: {} ({})", m.mode, m.reason);
    }
    if report.resumed_ms > 0.0 {
        println!(
            "running on {} {:.1} ms after the migration started",
            report.to, report.resumed_ms
        );
    }
    if let Some(l) = &report.lazy {
        println!(
            "  lazy phase: {:.1} MiB owed; {} pages asked by {} faults, {} pushed, {} of them \
             holes (not sent), {} zero-filled; the source was released {:.0} ms after the copy ran",
            l.owed_bytes as f64 / (1 << 20) as f64,
            l.fault_pages,
            l.faults,
            l.pushed_pages,
            l.hole_pages,
            l.zero_pages,
            l.source_released_after_resume_ms
        );
    }
    for (i, r) in m.rounds.iter().enumerate() {
        println!(
            "  round {}: {:.1} MiB dirty, {:.1} MiB sent, {:.0} ms",
            i + 1,
            r.dirty_bytes as f64 / (1 << 20) as f64,
            r.sent_bytes as f64 / (1 << 20) as f64,
            r.ms
        );
    }
    if !m.rounds.is_empty() {
        println!(
            "  frozen: {:.1} MiB sent with the image, {:.1} MiB taken from the rounds; \
             tracking started with a {:.1} ms stop",
            m.frozen_bytes as f64 / (1 << 20) as f64,
            m.inherited_bytes as f64 / (1 << 20) as f64,
            m.setup_stop_ms
        );
    }
    Ok(())
}
