//! `ferry hosts get N --class NAME`: N idle hosts for an application of a class (longest idle
//! first, one application of a class per host, fairly across users), held for a process of
//! this node (by default the caller's parent, the shell or script that asks) until it ends or
//! gives them back with `ferry hosts release`. `ferry hosts list`: each node's owner policy,
//! idleness and grants.

use super::client;
use anyhow::{bail, Result};
use ferry_transport::Msg;

#[derive(clap::Subcommand)]
pub enum Command {
    /// Get N hosts for an application of a class; prints them, one a line.
    Get(GetArgs),
    /// Give back hosts held by a process.
    Release(ReleaseArgs),
    /// Each node's owner policy, idleness and grants.
    List(ListArgs),
}

#[derive(clap::Args)]
pub struct GetArgs {
    pub count: u32,
    /// The application's class: one application of a class per host.
    #[arg(long)]
    pub class: String,
    /// The holder: a process here whose end gives the hosts back (default: our parent).
    #[arg(long)]
    pub holder: Option<i32>,
    /// On whose behalf (fairness counts per user); default: the caller's.
    #[arg(long)]
    pub uid: Option<u32>,
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::Args)]
pub struct ReleaseArgs {
    /// Only these hosts (default: all the holder holds).
    pub hosts: Vec<String>,
    #[arg(long)]
    pub class: Option<String>,
    #[arg(long)]
    pub holder: Option<i32>,
}

#[derive(clap::Args)]
pub struct ListArgs {
    #[arg(long)]
    pub json: bool,
}

fn parent() -> i32 {
    std::os::unix::process::parent_id() as i32
}

pub fn run(c: Command, node: Option<&str>) -> Result<()> {
    let rt = client::runtime()?;
    match c {
        Command::Get(a) => {
            let msg = Msg::HostsGet {
                count: a.count,
                class: a.class,
                uid: a.uid.unwrap_or_else(caller_uid),
                holder: a.holder.unwrap_or_else(parent),
            };
            let r = match rt.block_on(client::ask(node, &msg))? {
                Msg::HostsGranted(r) => r,
                other => bail!(
                    "unexpected answer {}",
                    ferry_transport::message::kind(&other)
                ),
            };
            if a.json {
                super::print_json(&r)?;
            } else {
                for h in &r.hosts {
                    println!("{h}");
                }
                for (h, uid) in &r.reclaimed {
                    eprintln!("ferry: {h} was taken back from uid {uid} (fairness)");
                }
            }
            if r.hosts.is_empty() {
                eprintln!("ferry: no host is free for class {}", r.class);
                std::process::exit(1);
            }
            Ok(())
        }
        Command::Release(a) => {
            let msg = Msg::HostsRelease {
                holder: a.holder.unwrap_or_else(parent),
                class: a.class,
                hosts: a.hosts,
            };
            match rt.block_on(client::ask(node, &msg))? {
                Msg::Done => Ok(()),
                other => bail!(
                    "unexpected answer {}",
                    ferry_transport::message::kind(&other)
                ),
            }
        }
        Command::List(a) => {
            let nodes = match rt.block_on(client::ask(node, &Msg::ListNodes))? {
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
                "{:<10} {:<7} {:<5} {:>7} {:>10}  GRANTS",
                "NODE", "ACCEPT", "IDLE", "LOAD1", "INPUT-IDLE"
            );
            for n in nodes {
                let l = n.load.unwrap_or_default();
                let grants: Vec<String> = l
                    .grants
                    .iter()
                    .map(|g| format!("{}:uid {} ({}:{})", g.class, g.uid, g.requester, g.holder))
                    .collect();
                println!(
                    "{:<10} {:<7} {:<5} {:>7.2} {:>10}  {}",
                    n.name,
                    if l.owner.draining {
                        "drain".to_string()
                    } else {
                        l.owner.policy.to_string()
                    },
                    if l.owner.idle { "yes" } else { "no" },
                    l.owner.load_avg_1m,
                    l.console_idle_secs
                        .map_or_else(|| "-".to_string(), |s| format!("{s}s")),
                    if grants.is_empty() {
                        "-".to_string()
                    } else {
                        grants.join(", ")
                    }
                );
            }
            Ok(())
        }
    }
}

/// The caller's real uid, as /proc/self/status says.
fn caller_uid() -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or(0)
}
