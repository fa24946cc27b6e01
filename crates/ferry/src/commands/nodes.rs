//! `ferry nodes [--json]`: the cluster's nodes and the load each publishes.

use super::client;
use anyhow::{bail, Result};
use ferry_transport::Msg;

#[derive(clap::Args)]
pub struct Args {
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: Args, node: Option<&str>) -> Result<()> {
    let nodes = match client::runtime()?.block_on(client::ask(node, &Msg::ListNodes))? {
        Msg::Nodes(n) => n,
        other => bail!(
            "unexpected answer {}",
            ferry_transport::message::kind(&other)
        ),
    };
    if a.json {
        return super::print_json(&nodes);
    }
    println!(
        "{:<10} {:<21} {:<6} {:>8} {:>6} {:>9} {:>12} {:>7} {:>6}",
        "NODE",
        "ADDRESS",
        "STATE",
        "RUNNABLE",
        "IDLE%",
        "FREE-MEM",
        "CONSOLE-IDLE",
        "GUESTS",
        "ACCEPT"
    );
    for n in nodes {
        let l = n.load.unwrap_or_default();
        println!(
            "{:<10} {:<21} {:<6} {:>8} {:>6.0} {:>8}M {:>12} {:>7} {:>6}",
            n.name,
            n.addr,
            n.state,
            l.runnable,
            l.cpu_idle_pct,
            l.free_memory_bytes >> 20,
            l.console_idle_secs
                .map_or_else(|| "-".to_string(), |s| format!("{s}s")),
            l.guests,
            if l.stale {
                // The node could not measure its load: these figures are old.
                "stale"
            } else if l.accepting {
                "yes"
            } else {
                "no"
            }
        );
    }
    Ok(())
}
