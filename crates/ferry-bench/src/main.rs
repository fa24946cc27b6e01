//! `ferry-bench`: benchmarks of Ferry.
//!
//! `ferry-bench engine` checkpoints and restores processes holding 1, 64,
//! 512 and 2048 MiB of touched memory with the release `ferry` binary and
//! prints one table: checkpoint and restore times, the time the process
//! stood still, the image size, and how all that compares with a plain
//! memory copy of the same size measured in the same run (the physical
//! limit) and with writing the same bytes to the image directory's disk.
//! See docs/benchmarks.md.

mod balance;
mod common;
mod criu;
mod deputy;
mod dirty;
mod engine;
mod floor;
mod hold;
mod hosts;
mod lazy;
mod load;
mod make;
mod migrate;
mod remote_exec;
mod sprite;
mod touch;

use clap::{Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser)]
#[command(name = "ferry-bench", about = "Benchmarks of Ferry")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Time checkpoint and restore of processes of several memory sizes
    /// against a plain memory copy of the same size.
    Engine(engine::Args),
    /// Time live migration of processes of several memory sizes between two nodes of a local
    /// cluster, against a plain memory copy of the same size.
    Migrate(migrate::Args),
    /// Time `ferry run` against a local fork/exec/wait of the same command, on a local
    /// cluster of two nodes started for the purpose.
    RemoteExec(remote_exec::Args),
    /// Build a real C project (LuaJIT) with `ferry make` on 1, 2 and 4 emulated half-CPU nodes
    /// against plain `make` on one such node.
    Make(make::Args),
    /// What a moved process's home costs its parent: a signal sent at home until the parent's
    /// `wait` sees the death, and the body's exit until the parent's `wait` sees it, against
    /// the same for a child that never moved.
    Deputy(deputy::Args),
    /// Sprite's Table 7.3 and MOSIX's Table 5.1: file calls and workloads (a compile, text
    /// formatting, a 1 MiB copy over TCP, fork + wait, gettimeofday) at home and moved.
    Sprite(sprite::Args),
    /// Lazy restore (copy-on-reference, `ferry restore --lazy`) against an ordinary one, for
    /// processes reserving 1 MiB to 8 GiB and touching 64 MiB or all of it: time until the
    /// tree runs, until the image is no longer needed, and a fault's cost.
    Lazy(lazy::Args),
    /// The touched fraction: a process of N MiB that, once moved, reads 1 %, 10 % or 100 % of
    /// its memory, moved eagerly, with pre-copy and lazily: when it runs on b, when every
    /// touched page is there, and the bytes moved, against memcpy of N MiB.
    Touch(touch::Args),
    /// Pre-copy, lazy and hybrid migration of a process that keeps rewriting its memory (512
    /// MiB at 10 % per second by default), in one run: freeze, resume, when the source was
    /// released, total time and bytes on the wire.
    Dirty(dirty::Args),
    /// Host selection over 10 to 10,000 nodes (the policy), a request through a daemon holding
    /// 1,000 simulated gossip entries, and the time eviction takes to free a node.
    Hosts(hosts::Args),
    /// DUNES Fig 4.5's workload (a writer feeding two readers at 10:1, an independent
    /// process) under automatic load balancing, Algorithm 1 against Algorithm 3, on 2 and 3
    /// emulated half-CPU nodes.
    Balance(balance::Args),
    /// Three nodes under load for minutes: concurrent `ferry run` jobs and migrations of
    /// long-running counters, round after round; reports exit codes, lost or duplicated
    /// processes, daemon RSS and fds over time, and migrations per second.
    Load(load::Args),
    /// (Internal) the process being checkpointed: fills MIB MiB of memory
    /// with non-zero pseudo-random data, writes `ready` in its cwd, waits
    /// for `go`, checks its memory and writes `result`.
    #[command(hide = true)]
    Hold {
        #[arg(long)]
        mib: usize,
        #[arg(long)]
        dir: PathBuf,
        #[arg(long, default_value_t = 0)]
        maps: usize,
        #[arg(long, default_value_t = 0)]
        threads: usize,
        #[arg(long, default_value_t = 0)]
        children: usize,
        #[arg(long, default_value_t = 0)]
        fds: usize,
        /// Address space to reserve (MiB), of which only the first MIB are touched.
        #[arg(long, default_value_t = 0)]
        reserve_mib: usize,
        /// Fill memory with data that compresses (each word a byte of noise and seven zero
        /// bytes, as a heap of small numbers does) instead of noise that does not.
        #[arg(long)]
        compressible: bool,
        /// Read this share (per mille) of the pages once moved, not all after `go`.
        #[arg(long, default_value_t = 0)]
        touch_permille: usize,
        /// Fork the children once the memory is filled, so that they share it
        /// copy-on-write (a pre-fork server's workers).
        #[arg(long)]
        children_share: bool,
    },
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Engine(a) => engine::run(a),
        Command::Migrate(a) => migrate::run(a),
        Command::RemoteExec(a) => remote_exec::run(a),
        Command::Make(a) => make::run(a),
        Command::Deputy(a) => deputy::run(a),
        Command::Sprite(a) => sprite::run(a),
        Command::Hosts(a) => hosts::run(a),
        Command::Balance(a) => balance::run(a),
        Command::Load(a) => load::run(a),
        Command::Hold {
            mib,
            dir,
            maps,
            threads,
            children,
            fds,
            reserve_mib,
            compressible,
            touch_permille,
            children_share,
        } => hold::run(
            mib,
            &dir,
            hold::Shape {
                maps,
                threads,
                children,
                fds,
                reserve_mib,
                compressible,
                touch_permille,
                children_share,
            },
        ),
        Command::Lazy(a) => lazy::run(a),
        Command::Touch(a) => touch::run(a),
        Command::Dirty(a) => dirty::run(a),
    };
    if let Err(e) = result {
        eprintln!("ferry-bench: {e:#}");
        std::process::exit(1);
    }
}
