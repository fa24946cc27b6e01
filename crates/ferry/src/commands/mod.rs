//! One module per subcommand.

pub mod accept;
pub mod balance;
pub mod checkpoint;
pub mod client;
pub mod cluster;
pub mod cluster_cpu;
pub mod cluster_net;
pub mod daemon;
pub mod evict;
pub mod guest_confine;
pub mod guest_forks;
pub mod guest_init;
pub mod guest_kills;
pub mod hosts;
pub mod image;
pub mod make;
pub mod make_shell;
pub mod migrate;
pub mod node_init;
pub mod nodes;
pub mod pages;
pub mod precopy;
pub mod ps;
pub mod relay_holder;
pub mod restore;
pub mod run;
pub mod top;
pub mod worker;

/// Prints a report as pretty JSON on stdout.
pub fn print_json<T: serde::Serialize>(v: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

/// Whether this process runs as root (its effective uid).
pub fn is_root() -> anyhow::Result<bool> {
    use anyhow::Context;
    let (uid, _, _) = ferry_sys::spawn::ids().context("read our credentials")?;
    Ok(uid == 0)
}

/// `p` as an absolute path (relative to our working directory), for the daemon.
pub fn absolute_arg(p: &std::path::Path) -> anyhow::Result<String> {
    use anyhow::Context;
    let abs = std::path::absolute(p).with_context(|| format!("resolve {}", p.display()))?;
    abs.into_os_string()
        .into_string()
        .map_err(|p| anyhow::anyhow!("{} is not UTF-8", std::path::Path::new(&p).display()))
}

/// A command the daemon runs for a caller who is not root (`Checkpoint`, `Restore`): its
/// output is printed as it was, and this process exits with its code.
pub fn via_daemon(node: Option<&str>, request: &ferry_transport::Msg) -> anyhow::Result<()> {
    use std::io::Write;
    let answer = client::runtime()?.block_on(client::ask(node, request))?;
    match answer {
        ferry_transport::Msg::Output {
            code,
            stdout,
            stderr,
        } => {
            std::io::stdout().write_all(&stdout)?;
            std::io::stdout().flush()?;
            std::io::stderr().write_all(&stderr)?;
            std::process::exit(code)
        }
        other => anyhow::bail!(
            "the daemon answered {}",
            ferry_transport::message::kind(&other)
        ),
    }
}
