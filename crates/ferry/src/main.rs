//! `ferry`: transparent process migration for Linux clusters. One binary: the user's commands,
//! the node daemon, and the engine workers the daemon runs. Each subcommand lives in
//! `commands/`, one file each.

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
    /// Which node is "here" where several daemons share this machine (a local cluster).
    #[arg(long, global = true, env = "FERRY_NODE")]
    node: Option<String>,
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
    /// Move a running process and its descendants to another node.
    Migrate(commands::migrate::Args),
    /// Run a command on another node as if it ran here: cwd, environment, stdio, signals, status.
    Run(commands::run::Args),
    /// List the cluster's nodes and their load.
    Nodes(commands::nodes::Args),
    /// List processes under Ferry across the cluster.
    Ps(commands::ps::Args),
    /// Watch the cluster live: nodes and processes, refreshing in place (q quits, s sorts).
    Top(commands::top::Args),
    /// Say when this node takes guests from now on: always, idle (only while idle), never.
    Accept(commands::accept::Args),
    /// Send every guest of a node away (home, or to another idle node).
    Evict(commands::evict::Args),
    /// Send every guest of a node away and take no new ones until `ferry accept`.
    Drain(commands::evict::Args),
    /// Get and give back idle hosts (Sprite's host selection); see each node's policy.
    #[command(subcommand)]
    Hosts(commands::hosts::Command),
    /// Automatic load balancing: hand a process to the balancer, list its decisions.
    #[command(subcommand)]
    Balance(commands::balance::Command),
    /// Run the node daemon in the foreground.
    Daemon(commands::daemon::Args),
    /// Run GNU make with its recipes spread over the cluster's nodes (Sprite's pmake):
    /// ferry make [-j N] [--nodes A,B,..] [--elsewhere] [--shell PATH] [MAKE ARGUMENTS].
    #[command(disable_help_flag = true)]
    Make {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, num_args = 0..)]
        args: Vec<std::ffi::OsString>,
    },
    /// Start or stop a local cluster of daemons on this machine.
    #[command(subcommand)]
    Cluster(commands::cluster::Command),
    /// Engine worker of a daemon: capture and stream a tree (internal).
    #[command(name = "__capture-worker", hide = true)]
    CaptureWorker {
        pid: i32,
        #[arg(long)]
        relay_pipes: bool,
        /// eager, precopy, lazy or auto.
        #[arg(long, default_value = "eager")]
        memory: String,
        /// The user the daemon moves the tree for: only a tree of theirs moves.
        #[arg(long)]
        owner: Option<ferry_sys::owner::Owner>,
        /// Where its deputies wait for a restarted daemon (DIR/PID.sock).
        #[arg(long)]
        deputies_dir: Option<std::path::PathBuf>,
        /// With --memory lazy: the daemon's descriptor of this worker's end of the page link.
        #[arg(long)]
        pages_fd: Option<i32>,
        /// With --memory auto and a page link: the link's speed to the destination (bytes/s,
        /// measured by an earlier move) and the freeze (ms) above which an eager move would
        /// stop the tree for too long: then it moves lazily.
        #[arg(long, requires = "lazy_above_ms")]
        link_bps: Option<f64>,
        #[arg(long, requires = "link_bps")]
        lazy_above_ms: Option<f64>,
        /// With --memory auto: never hybrid (a tree going home, rebuilt in place of its
        /// deputies only when the move is not lazy).
        #[arg(long)]
        no_auto_hybrid: bool,
        /// A body moving on: its node's stand-in for a relay to its home, as INO:ID (the
        /// pipe's inode, the relay's id at home); repeated.
        #[arg(long = "relay-standin", value_parser = parse_standin)]
        relay_standins: Vec<(u64, u32)>,
        /// A body moving on: its node's stand-in for a relayed socket, as ID:LINE (the relay's
        /// id at home; LINE: "INO LOCAL PEER HOME_INO", the body's socket inode, the names and
        /// inode the original had at home, as `RelayedNames::encode` writes them); repeated.
        #[arg(long = "relay-socket", value_parser = parse_relay_socket)]
        relay_sockets: Vec<ferry_engine::resources::sockets::RelayedNames>,
    },
    /// Engine worker of a daemon: receive and rebuild a tree (internal).
    #[command(name = "__restore-worker", hide = true)]
    RestoreWorker {
        /// The datagram socket the guest init reports the end of the tree's processes to.
        #[arg(long)]
        reports: Option<std::path::PathBuf>,
        /// The node's CPU cgroup the rebuilt processes join (a node held to a CPU quota).
        #[arg(long)]
        cpu_cgroup: Option<std::path::PathBuf>,
        /// The tree is a body: its home's host name ...
        #[arg(long, requires = "home")]
        hostname: Option<String>,
        /// ... and "ROOT PPID PGID SID", its root and the root's parent, process group and
        /// session at home (what Ferry's seccomp filter answers).
        #[arg(long, requires = "hostname")]
        home: Option<String>,
        /// A body away from home: its mount namespace shows only the system's files, read-only,
        /// and the shared tree (ferry::commands::guest_confine).
        #[arg(long, requires = "home")]
        confine: bool,
        /// With --confine: the cluster's shared tree on this node.
        #[arg(long, requires = "confine")]
        shared: Option<std::path::PathBuf>,
        /// With --confine: directories of the node's own hidden even where they would show.
        #[arg(long, requires = "confine")]
        hide: Vec<std::path::PathBuf>,
        /// A lazy migration from this node: the tree's private anonymous memory is served
        /// from it over the page link ...
        #[arg(long, requires = "pages_fd")]
        lazy_from: Option<String>,
        /// ... whose end, for this worker, is this descriptor of the daemon's.
        #[arg(long, requires = "lazy_from")]
        pages_fd: Option<i32>,
        /// How long the source may leave a page request unanswered.
        #[arg(long, default_value_t = 30)]
        stall_secs: u64,
        /// Pages sent after a faulting one.
        #[arg(long, default_value_t = 15)]
        prefetch: usize,
        /// The background push starts this many milliseconds after the tree runs (a test's
        /// fail point asks for it: until then only faults bring pages in).
        #[arg(long, default_value_t = 0, hide = true)]
        push_after_ms: u64,
        /// The tree is coming home: rebuild these processes in place of their deputies (if
        /// the image's tree fits; else it is rebuilt as a body, as `--home` says).
        #[arg(long, value_delimiter = ',')]
        adopt: Vec<i32>,
    },
    /// The guardian of a lazy restore's page server (internal): see ferry_memory::guard.
    #[command(name = "__lazy-guard", hide = true)]
    LazyGuard { server_pid: i32 },
    #[command(name = "__guest-init", hide = true)]
    GuestInit(commands::guest_init::Args),
    #[command(name = "__node-init", hide = true)]
    NodeInit(commands::node_init::Args),
    /// Makes the confined mount namespace a daemon's programs for other nodes enter
    /// (internal): see ferry_daemon::confine.
    #[command(name = "__guest-mounts", hide = true)]
    GuestMounts(commands::guest_confine::Args),
    /// Holds a pipe relay's home end and buffers across a home daemon's restart (internal):
    /// see ferry_daemon::relay_keep.
    #[command(name = "__relay-holder", hide = true)]
    RelayHolder(commands::relay_holder::Args),
}

/// `ferry run ...` alone: remote execution is a process start per program run (a parallel make
/// pays it on every recipe), so its arguments are parsed without building the parser of every
/// other command first. Same options, help and errors as `ferry run` in [`Cli`].
#[derive(Parser)]
#[command(
    name = "ferry run",
    bin_name = "ferry run",
    about = "Run a command on another node as if it ran here: cwd, environment, stdio, signals, status"
)]
struct RunCli {
    /// Which node is "here" where several daemons share this machine (a local cluster).
    #[arg(long, env = "FERRY_NODE")]
    node: Option<String>,
    #[command(flatten)]
    args: commands::run::Args,
}

fn main() {
    // A `ferry run` program's init, exec'd afresh (ferry_sys::guest_spawn): nothing else runs.
    {
        let mut args = std::env::args_os().skip(1);
        if args
            .next()
            .is_some_and(|a| a == ferry_sys::guest_spawn::RUN_INIT_COMMAND)
        {
            let mut num = || {
                args.next()
                    .and_then(|a| a.to_str()?.parse::<i32>().ok())
                    .unwrap_or(-1)
            };
            let (program, status_fd) = (num(), num());
            ferry_sys::guest_spawn::run_init(program, status_fd);
        }
    }
    // Test builds only (feature `failpoints`): the fail points FAILPOINTS sets.
    ferry_inject::setup_failpoints();
    if std::env::args_os().nth(1).is_some_and(|a| a == "run") {
        let cli = RunCli::parse_from(std::env::args_os().skip(1));
        ferry_sys::process::default_sigpipe();
        env_logger::Builder::from_env(env_logger::Env::default().filter_or("FERRY_LOG", "warn"))
            .format_timestamp_millis()
            .init();
        if let Err(e) = commands::run::run(cli.args, cli.node.as_deref()) {
            eprintln!("ferry: {e:#}");
            std::process::exit(1);
        }
        return;
    }
    // Run by make as its shell (`ferry make`): no subcommand, make's arguments.
    let argv0 = std::env::args_os().next().unwrap_or_default();
    if std::path::Path::new(&argv0)
        .file_name()
        .is_some_and(|n| n == commands::make_shell::SHIM_NAME)
    {
        ferry_sys::process::default_sigpipe();
        env_logger::Builder::from_env(env_logger::Env::default().filter_or("FERRY_LOG", "warn"))
            .format_timestamp_millis()
            .init();
        commands::make_shell::main(std::env::args_os().collect());
    }
    let cli = Cli::parse();
    // A user command piped into `head` just ends; the daemon and its workers must instead see
    // EPIPE on a peer that went away, and back out properly (Rust ignores SIGPIPE by default).
    if !matches!(
        cli.command,
        Command::Daemon(_) | Command::CaptureWorker { .. } | Command::RestoreWorker { .. }
    ) {
        ferry_sys::process::default_sigpipe();
    }
    // The daemon logs structured lines through `tracing`; everything else uses env_logger.
    if !matches!(cli.command, Command::Daemon(_)) {
        env_logger::Builder::from_env(env_logger::Env::default().filter_or("FERRY_LOG", "warn"))
            .format_timestamp_millis()
            .init();
    }
    let node = cli.node.as_deref();
    let result = match cli.command {
        Command::Checkpoint(a) => commands::checkpoint::run(a, node),
        Command::Restore(a) => commands::restore::run(a, node),
        Command::Image(c) => commands::image::run(c),
        Command::GuestInit(a) => commands::guest_init::run(a),
        Command::NodeInit(a) => commands::node_init::run(a),
        Command::GuestMounts(a) => commands::guest_confine::hold(a),
        Command::RelayHolder(a) => commands::relay_holder::run(a),
        Command::Migrate(a) => commands::migrate::run(a, node),
        Command::Run(a) => commands::run::run(a, node),
        Command::Make { args } => commands::make::run(args, node),
        Command::Nodes(a) => commands::nodes::run(a, node),
        Command::Ps(a) => commands::ps::run(a, node),
        Command::Top(a) => commands::top::run(a, node),
        Command::Daemon(a) => commands::daemon::run(a),
        Command::Accept(a) => commands::accept::run(a, node),
        Command::Evict(a) => commands::evict::run(a, node, false),
        Command::Drain(a) => commands::evict::run(a, node, true),
        Command::Hosts(c) => commands::hosts::run(c, node),
        Command::Balance(c) => commands::balance::run(c, node),
        Command::Cluster(c) => commands::cluster::run(c),
        Command::RestoreWorker {
            reports,
            cpu_cgroup,
            hostname,
            home,
            confine,
            shared,
            hide,
            lazy_from,
            pages_fd,
            stall_secs,
            prefetch,
            push_after_ms,
            adopt,
        } => commands::worker::restore_worker(
            reports,
            cpu_cgroup,
            hostname.zip(home),
            confine.then_some(ferry_engine::guest_ns::Confine { shared, hide }),
            lazy_from
                .zip(pages_fd)
                .map(|(from, fd)| commands::worker::LazyArgs {
                    from,
                    pages_fd: fd,
                    stall: std::time::Duration::from_secs(stall_secs),
                    prefetch,
                    push_after: std::time::Duration::from_millis(push_after_ms),
                }),
            adopt,
        ),
        Command::CaptureWorker {
            pid,
            relay_pipes,
            memory,
            owner,
            deputies_dir,
            pages_fd,
            link_bps,
            lazy_above_ms,
            no_auto_hybrid,
            relay_standins,
            relay_sockets,
        } => commands::worker::capture_worker(
            pid,
            relay_pipes,
            &memory,
            owner.as_ref(),
            deputies_dir,
            pages_fd,
            link_bps.zip(lazy_above_ms),
            !no_auto_hybrid,
            relay_standins.into_iter().collect(),
            relay_sockets.into_iter().map(|n| (n.ino, n)).collect(),
        ),
        Command::LazyGuard { server_pid } => commands::restore::lazy_guard(server_pid),
    };
    if let Err(e) = result {
        eprintln!("ferry: {e:#}");
        std::process::exit(1);
    }
}

/// `ID:LINE`, a relayed socket's stand-in of `__capture-worker --relay-socket`.
fn parse_relay_socket(s: &str) -> Result<ferry_engine::resources::sockets::RelayedNames, String> {
    let (id, line) = s
        .split_once(':')
        .ok_or_else(|| format!("{s:?} is not ID:LINE"))?;
    let relay = id.parse().map_err(|e| format!("relay id {id:?}: {e}"))?;
    match ferry_engine::resources::sockets::RelayedNames::decode(line).as_deref() {
        Some([n]) => Ok(ferry_engine::resources::sockets::RelayedNames { relay, ..n.clone() }),
        _ => Err(format!("{line:?} is not INO LOCAL PEER HOME_INO")),
    }
}

/// `INO:ID`, a relay stand-in of `__capture-worker --relay-standin`.
fn parse_standin(s: &str) -> Result<(u64, u32), String> {
    let (ino, id) = s
        .split_once(':')
        .ok_or_else(|| format!("{s:?} is not INO:ID"))?;
    Ok((
        ino.parse().map_err(|e| format!("inode {ino:?}: {e}"))?,
        id.parse().map_err(|e| format!("relay id {id:?}: {e}"))?,
    ))
}
