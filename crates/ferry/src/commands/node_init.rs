//! `ferry __node-init --config FILE --hostname H --address A/N --go-fd N` (hidden): PID 1 of an
//! emulated node of a local cluster (`ferry cluster up --isolation separate`), in the network,
//! UTS, mount, IPC and PID namespaces `ferry_sys::ns::spawn_node_init` made for it.
//!
//! It gives the node what differs between machines: its host name; a /tmp, /run and /dev/shm
//! of its own (fresh tmpfs), through which only the node's data directory, its credentials,
//! the ferry binary and the cluster's shared tree (`shared` in the config) are carried, bound
//! at the same paths; and, once `ferry cluster up` has moved the node's end of a veth pair in
//! (it then writes one byte on the go pipe), its own address on that link, loopback, and a
//! route to the cluster's subnet only, and the machine's network settings that a moving
//! process's state may depend on ([`NET_SYSCTLS`]). Then it starts the daemon (its log on
//! stdout and stderr), reaps every orphan of the node, and on SIGTERM or SIGINT passes SIGTERM to the
//! daemon and, once the daemon is gone, exits: the kernel then ends whatever still runs on the
//! node, as a machine's shutdown would. If the daemon ends on its own (killed, crashed), the
//! node stays up, as a machine whose daemon crashed does: its sockets close as they would
//! there (peers get their resets), and whatever else runs on it carries on.

use super::cluster_net::ip;
use anyhow::{bail, Context, Result};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

#[derive(clap::Args)]
pub struct Args {
    /// The node daemon's configuration.
    #[arg(long)]
    pub config: PathBuf,
    #[arg(long)]
    pub hostname: String,
    /// The node's address on the cluster's link, with its prefix length (169.254.70.2/24).
    #[arg(long)]
    pub address: String,
    /// The node's end of the veth pair, in its network namespace.
    #[arg(long, default_value = "eth0")]
    pub link: String,
    /// The read end of the go pipe: one byte once the link is in our namespace.
    #[arg(long)]
    pub go_fd: i32,
    /// Network settings of the machine to give the node too, `NAME=VALUE` (NAME under
    /// /proc/sys/net, e.g. `ipv4/ping_group_range=0 0`): a new network namespace starts with
    /// the kernel's defaults, not the machine's.
    #[arg(long = "net-sysctl")]
    pub net_sysctls: Vec<String>,
}

/// The settings of this machine's network namespace a separate node takes over: those a
/// process's state may depend on when it moves (a ping socket can only be made again where
/// its maker's group may make one).
pub const NET_SYSCTLS: [&str; 1] = ["ipv4/ping_group_range"];

/// The directories a node has to itself: fresh and empty on each node, like a machine's.
pub const PRIVATE_DIRS: [(&str, u32); 3] =
    [("/tmp", 0o1777), ("/run", 0o755), ("/dev/shm", 0o1777)];

pub fn run(a: Args) -> Result<()> {
    use ferry_sys::{anon_fds, fdops, ns};
    if ns::getpid() != 1 {
        bail!("`ferry __node-init` only runs as PID 1 of the namespaces `ferry cluster up` makes");
    }
    let go = ns::take_inherited_fd(a.go_fd)
        .with_context(|| format!("take the go pipe (fd {})", a.go_fd))?;
    let config = ferry_daemon::Config::load(&a.config)?;
    // Our stdio is /dev/null: from now on everything (ours, `ip`'s, the daemon's) goes to the
    // node's log.
    let log_path = config.data_dir.join("daemon.log");
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .with_context(|| format!("open {}", log_path.display()))?;
    for fd in [1, 2] {
        fdops::dup2(log.as_raw_fd(), fd).context("put the log on stdout and stderr")?;
    }
    let exe = std::env::current_exe().context("find the ferry binary")?;
    ns::sethostname(&a.hostname).with_context(|| format!("set the host name {}", a.hostname))?;
    private_trees(&config, &exe)?;
    // Wait for our end of the link.
    let mut b = [0u8; 1];
    match fdops::read_fd(go.as_raw_fd(), &mut b) {
        Ok(1) => {}
        _ => bail!("`ferry cluster up` gave up before this node's link was ready"),
    }
    drop(go);
    for kv in &a.net_sysctls {
        let (name, value) = kv
            .split_once('=')
            .filter(|(n, _)| NET_SYSCTLS.contains(n))
            .with_context(|| format!("--net-sysctl {kv:?}: not one of {NET_SYSCTLS:?}"))?;
        let path = Path::new("/proc/sys/net").join(name);
        std::fs::write(&path, value).with_context(|| format!("set {}", path.display()))?;
    }
    ip(&["link", "set", "lo", "up"])?;
    ip(&["addr", "add", &a.address, "dev", &a.link])?;
    ip(&["link", "set", &a.link, "up"])?;

    ns::block_signal(libc::SIGCHLD).context("block SIGCHLD")?;
    ns::block_signal(libc::SIGTERM).context("block SIGTERM")?;
    ns::block_signal(libc::SIGINT).context("block SIGINT")?;
    let signals = anon_fds::signalfd(
        (1 << (libc::SIGCHLD - 1)) | (1 << (libc::SIGTERM - 1)) | (1 << (libc::SIGINT - 1)),
        libc::SFD_CLOEXEC | libc::SFD_NONBLOCK,
    )
    .context("make a signalfd")?;
    let daemon_pid = start_daemon(&exe, &a.config, log.as_raw_fd())?;
    println!(
        "node init: {} up as {} in namespaces of its own; daemon PID {daemon_pid} here",
        a.hostname, a.address
    );
    let mut daemon_alive = true;
    let mut stopping = false;
    loop {
        while let Ok(Some((pid, status))) = ns::wait_any(true) {
            if pid == daemon_pid {
                daemon_alive = false;
                if !stopping {
                    println!(
                        "node init: the daemon ended ({}); the node stays up",
                        ferry_daemon::node::describe_status(status)
                    );
                }
            }
        }
        if !daemon_alive && stopping {
            println!("node init: {} shuts down", a.hostname);
            return Ok(());
        }
        match ns::poll_in(&[signals.as_raw_fd()], 1000) {
            Ok(r) if r[0] => {}
            Ok(_) => continue,
            Err(e) => {
                eprintln!("node init: {e}");
                std::thread::sleep(std::time::Duration::from_secs(1));
                continue;
            }
        }
        // signalfd_siginfo records, 128 bytes each, the signal number first.
        let mut buf = [0u8; 128 * 8];
        while let Ok(n) = fdops::read_fd(signals.as_raw_fd(), &mut buf) {
            if n == 0 {
                break;
            }
            for rec in buf[..n].chunks_exact(128) {
                let sig = u32::from_ne_bytes(rec[..4].try_into().expect("4 bytes")) as i32;
                if (sig == libc::SIGTERM || sig == libc::SIGINT) && !stopping {
                    stopping = true;
                    if daemon_alive {
                        let _ = ferry_sys::ptrace::kill(daemon_pid, libc::SIGTERM);
                    }
                }
            }
        }
    }
}

/// Starts `ferry daemon --config CONFIG`, its stdout and stderr on `log`, with no signal
/// blocked (ours are, for the signalfd, and std's spawn would pass that on).
fn start_daemon(exe: &Path, config: &Path, log: i32) -> Result<i32> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let c = |b: &[u8]| CString::new(b).context("an argument with a NUL byte");
    let argv = vec![
        c(exe.as_os_str().as_bytes())?,
        c(b"daemon")?,
        c(b"--config")?,
        c(config.as_os_str().as_bytes())?,
    ];
    let envp = std::env::vars_os()
        .map(|(k, v)| c(&[k.as_bytes(), b"=", v.as_bytes()].concat()))
        .collect::<Result<Vec<_>>>()?;
    let (uid, gid, groups) = ferry_sys::spawn::ids().context("read our credentials")?;
    let null = std::fs::File::open("/dev/null").context("open /dev/null")?;
    let spawn = ferry_sys::spawn::Spawn {
        candidates: vec![argv[0].clone()],
        search: false,
        argv,
        envp,
        cwd: c(b"/")?,
        uid,
        gid,
        groups,
        umask: 0o022,
        rlimits: Vec::new(),
        stdio: [null.as_raw_fd(), log, log],
        controlling_tty: false,
        sig_ignored: 0,
        sig_blocked: 0,
        parent_death_signal: 0,
        mount_ns: None,
        user_ns: None,
    };
    ferry_sys::spawn::spawn(&spawn).map_err(|e| anyhow::anyhow!("start the node daemon: {e}"))
}

/// Fresh tmpfs on the private directories; the trees the node must share with the machine
/// that runs it (its data directory, where its control socket is; its credentials and
/// revocation list; the ferry binary; the cluster's shared tree) are carried through, at the
/// same paths.
fn private_trees(config: &ferry_daemon::Config, exe: &Path) -> Result<()> {
    let c = &config.credentials;
    let mut keep: Vec<PathBuf> = [
        Some(config.data_dir.as_path()),
        c.ca_cert.parent(),
        c.cert.parent(),
        c.key.parent(),
        config.revoked.as_deref().and_then(Path::parent),
        exe.parent(),
        config.shared.as_deref(),
    ]
    .into_iter()
    .flatten()
    .map(|p| {
        p.canonicalize()
            .with_context(|| format!("find {}", p.display()))
    })
    .collect::<Result<_>>()?;
    keep.retain(|p| PRIVATE_DIRS.iter().any(|(d, _)| p.starts_with(d)));
    keep.sort();
    keep.dedup();
    // A tree inside another one kept comes along with it.
    let outer: Vec<PathBuf> = keep
        .iter()
        .filter(|p| !keep.iter().any(|q| q != *p && p.starts_with(q)))
        .cloned()
        .collect();
    let trees = outer
        .iter()
        .map(|p| ferry_sys::mounts::clone_tree(p).with_context(|| format!("clone {}", p.display())))
        .collect::<Result<Vec<_>>>()?;
    for (dir, mode) in PRIVATE_DIRS {
        ferry_sys::mounts::mount_tmpfs(Path::new(dir), mode)
            .with_context(|| format!("mount a tmpfs on {dir}"))?;
    }
    for (p, t) in outer.iter().zip(&trees) {
        std::fs::create_dir_all(p).with_context(|| format!("make {}", p.display()))?;
        ferry_sys::mounts::attach_tree(t, p).with_context(|| format!("bind {}", p.display()))?;
    }
    Ok(())
}
