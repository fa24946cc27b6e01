//! `ferry balance add PID` hands a process to this node's balancer (it may then move it, on its
//! own, to a less loaded node); `ferry balance log [--json]` lists the balancer's decisions,
//! moving or not, each with its reason (ferry-daemon/src/balancer.rs).

use super::client;
use anyhow::{bail, Result};
use ferry_transport::Msg;

#[derive(clap::Subcommand)]
pub enum Command {
    /// Hand PID (and its descendants) to this node's balancer.
    Add { pid: i32 },
    /// Change the balancer's settings while the daemon runs (`[balance]` keys of the config,
    /// as TOML: `ferry balance set 'algorithm = "cpu"' 'min_stay_secs = 10'`), then print them
    /// all; with none, just print them.
    Set { settings: Vec<String> },
    /// The balancer's decisions, oldest first.
    Log {
        #[arg(long)]
        json: bool,
    },
}

pub fn run(c: Command, node: Option<&str>) -> Result<()> {
    let rt = client::runtime()?;
    match c {
        Command::Add { pid } => match rt.block_on(client::ask(node, &Msg::BalanceAdd { pid }))? {
            Msg::Done => Ok(()),
            other => bail!(
                "unexpected answer {}",
                ferry_transport::message::kind(&other)
            ),
        },
        Command::Set { settings } => {
            let settings = settings.join("\n");
            match rt.block_on(client::ask(node, &Msg::BalanceSet { settings }))? {
                Msg::BalanceSettings { toml } => {
                    print!("{toml}");
                    Ok(())
                }
                other => bail!(
                    "unexpected answer {}",
                    ferry_transport::message::kind(&other)
                ),
            }
        }
        Command::Log { json } => {
            let log = match rt.block_on(client::ask(node, &Msg::BalanceLog))? {
                Msg::BalanceDecisions(d) => d,
                other => bail!(
                    "unexpected answer {}",
                    ferry_transport::message::kind(&other)
                ),
            };
            if json {
                return super::print_json(&log);
            }
            for d in log {
                let secs = d.unix_ms / 1000;
                println!(
                    "{:02}:{:02}:{:02}.{:03} {} {:<6} {:<8} {}{}{}",
                    secs / 3600 % 24,
                    secs / 60 % 60,
                    secs % 60,
                    d.unix_ms % 1000,
                    d.node,
                    d.action,
                    d.algorithm.name(),
                    d.pid.map(|p| format!("PID {p} ")).unwrap_or_default(),
                    d.to.map(|t| format!("-> {t} ")).unwrap_or_default(),
                    d.reason
                );
            }
            Ok(())
        }
    }
}
