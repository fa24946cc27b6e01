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
pub mod guest_init;
pub mod hosts;
pub mod image;
pub mod make;
pub mod make_shell;
pub mod migrate;
pub mod node_init;
pub mod nodes;
pub mod precopy;
pub mod ps;
pub mod restore;
pub mod run;
pub mod top;
pub mod worker;

/// Prints a report as pretty JSON on stdout.
pub fn print_json<T: serde::Serialize>(v: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}
