//! `ferry daemon --config FILE`: a node daemon, in the foreground.

use anyhow::{Context, Result};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// The node's TOML configuration.
    #[arg(long)]
    pub config: PathBuf,
}

pub fn run(a: Args) -> Result<()> {
    // Structured lines: `ts level event=... node=... key=value`; FERRY_LOG filters.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("FERRY_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_target(false)
        .with_ansi(false)
        .init();
    let config = ferry_daemon::Config::load(&a.config)?;
    // Before any thread or child: all of them are the node's.
    if let Some(cg) = &config.cpu_cgroup {
        let procs = cg.join("cgroup.procs");
        std::fs::write(&procs, std::process::id().to_string())
            .with_context(|| format!("join the node's CPU cgroup ({})", procs.display()))?;
    }
    ferry_daemon::hosts::set_config_path(&a.config);
    let exe = std::env::current_exe().context("find the ferry binary")?;
    // Programs' processes are made by a small copy of this process taken now, before the
    // runtime's threads and memory exist (ferry_sys::spawner); this thread, which forks it,
    // lives as long as the daemon.
    ferry_sys::spawner::start().context("fork the spawner (which makes programs' processes)")?;
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("start the async runtime")?
        .block_on(ferry_daemon::node::run(config, exe))
}
