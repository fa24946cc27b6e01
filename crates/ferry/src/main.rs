//! `ferry`: transparent process migration for Linux clusters. One binary: the user's commands
//! and (later) the node daemon. Each subcommand lives in `commands/`, one file each.

#![forbid(unsafe_code)]

mod commands;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "ferry",
    version,
    about = "Transparent process migration for Linux clusters"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Capture a running process and all its descendants into an image directory.
    Checkpoint(commands::checkpoint::Args),
    /// Rebuild a process tree from an image directory, under its original PIDs.
    Restore(commands::restore::Args),
    /// Inspect images.
    #[command(subcommand)]
    Image(commands::image::Command),
}

fn main() {
    ferry_sys::process::default_sigpipe();
    env_logger::Builder::from_env(env_logger::Env::default().filter_or("FERRY_LOG", "warn"))
        .format_timestamp_millis()
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Checkpoint(a) => commands::checkpoint::run(a),
        Command::Restore(a) => commands::restore::run(a),
        Command::Image(c) => commands::image::run(c),
    };
    if let Err(e) = result {
        eprintln!("ferry: {e:#}");
        std::process::exit(1);
    }
}
