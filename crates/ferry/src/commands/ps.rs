//! `ferry ps [--json]`: processes under Ferry across the cluster: where they are from, where
//! they run, their PID in both places, and whose they are. (User names come from this
//! machine's /etc/passwd: a cluster shares its users, as Sprite's did.) For a body (a moved
//! tree whose home is elsewhere), CALLS and CALL-US say what it costs: the system calls of its
//! tree handed to its supervisor (docs/syscalls.md, "forwarded") and the time spent answering
//! them (`forwarded_calls`, `forwarded_us` in `--json`). A tree its home rebuilt from its last
//! checkpoint after its node died has a line of its own below it (`recovered` in `--json`):
//! which node died, and which nodes were passed over for it, and why. Asked at a tree's home,
//! a tree with more deputies than its root (processes it had when it left, or forked since) has
//! a line listing their PIDs at home (`deputies` in `--json`).

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
    let users = user_names();
    let user = |uid: u32| users.get(&uid).cloned().unwrap_or_else(|| uid.to_string());
    if a.json {
        let mut rows = Vec::new();
        for p in &procs {
            let mut row = serde_json::to_value(p)?;
            row["user"] = user(p.uid).into();
            rows.push(row);
        }
        return super::print_json(&rows);
    }
    println!(
        "{:<8} {:>8} {:<8} {:>8} {:<8} {:<10} {:<11} {:>9} {:>7} {:>8}  COMMAND",
        "HOME", "HOME-PID", "NODE", "PID", "USER", "STATE", "KIND", "SINCE", "CALLS", "CALL-US"
    );
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    for p in procs {
        let secs = now.saturating_sub(p.since_unix_ms) / 1000;
        println!(
            "{:<8} {:>8} {:<8} {:>8} {:<8} {:<10} {:<11} {:>8}s {:>7} {:>8}  {}",
            p.home_node,
            p.home_pid,
            p.node,
            p.pid,
            user(p.uid),
            p.state,
            p.kind,
            secs,
            p.forwarded_calls,
            p.forwarded_us,
            p.command
        );
        if let Some(r) = &p.recovered {
            println!("{:<8} rebuilt from its last checkpoint {r}", "");
        }
        if p.deputies.len() > 1 {
            let pids: Vec<String> = p.deputies.iter().map(|d| d.to_string()).collect();
            println!("{:<8} deputies at home: {}", "", pids.join(" "));
        }
    }
    Ok(())
}

/// UID -> user name, from /etc/passwd (empty if it cannot be read: numbers are shown).
fn user_names() -> std::collections::HashMap<u32, String> {
    std::fs::read_to_string("/etc/passwd")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let mut f = l.split(':');
            let name = f.next()?;
            let uid = f.nth(1)?.parse().ok()?;
            Some((uid, name.to_string()))
        })
        .collect()
}
