//! `ferry ps [--json]`: processes under Ferry across the cluster: where they are from, where
//! they run, and their PID in both places.

use super::client;
use anyhow::{bail, Result};
use ferry_transport::Msg;

#[derive(clap::Args)]
pub struct Args {
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: Args, node: Option<&str>) -> Result<()> {
    let procs = match client::runtime()?.block_on(client::ask(node, &Msg::ListProcesses))? {
        Msg::Processes(p) => p,
        other => bail!(
            "unexpected answer {}",
            ferry_transport::message::kind(&other)
        ),
    };
    if a.json {
        return super::print_json(&procs);
    }
    println!(
        "{:<8} {:>8} {:<8} {:>8} {:>6} {:<10} {:<11} {:>9}  COMMAND",
        "HOME", "HOME-PID", "NODE", "PID", "UID", "STATE", "KIND", "SINCE"
    );
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    for p in procs {
        let secs = now.saturating_sub(p.since_unix_ms) / 1000;
        println!(
            "{:<8} {:>8} {:<8} {:>8} {:>6} {:<10} {:<11} {:>8}s  {}",
            p.home_node, p.home_pid, p.node, p.pid, p.uid, p.state, p.kind, secs, p.command
        );
    }
    Ok(())
}
