//! `ferry evict NODE` and `ferry drain NODE`: every guest of NODE leaves it, home or to another
//! idle node; `drain` also stops new guests there until `ferry accept`. Prints what went where
//! and how long freeing the node took; a guest that could not move is listed with the reason
//! (it keeps running) and the command exits 1.

use super::client;
use anyhow::{bail, Result};
use ferry_transport::Msg;

#[derive(clap::Args)]
pub struct Args {
    /// The node to free.
    pub target: String,
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: Args, node: Option<&str>, drain: bool) -> Result<()> {
    let msg = Msg::Evict {
        node: a.target.clone(),
        drain,
    };
    let r = match client::runtime()?.block_on(client::ask(node, &msg))? {
        Msg::Evicted(r) => r,
        other => bail!(
            "unexpected answer {}",
            ferry_transport::message::kind(&other)
        ),
    };
    let stayed = r.guests.iter().filter(|g| g.to.is_none()).count();
    if a.json {
        super::print_json(&r)?;
    } else {
        println!(
            "node {}: {} guest(s) in {:.0} ms ({}){}",
            r.node,
            r.guests.len(),
            r.total_ms,
            r.reason,
            if r.draining {
                "; it takes no new guests until `ferry accept`"
            } else {
                ""
            }
        );
        for g in &r.guests {
            match &g.to {
                Some(to) => println!(
                    "  {}:{} {} -> {to} ({:.0} ms)",
                    g.home_node, g.home_pid, g.command, g.ms
                ),
                None => println!(
                    "  {}:{} {} stays: {}",
                    g.home_node,
                    g.home_pid,
                    g.command,
                    g.error.as_deref().unwrap_or("?")
                ),
            }
        }
    }
    if stayed > 0 {
        std::process::exit(1);
    }
    Ok(())
}
