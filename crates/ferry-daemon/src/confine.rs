//! What a guest may see of this node's file system (docs/security.md, "Guests are confined"):
//! the system's files, read-only, and the cluster's shared tree; never what the node keeps to
//! itself. Two kinds of guests get it:
//!
//! - a body (a tree migrated here from another home): its guest init confines the body's own
//!   mount namespace before anything is restored into it ([`guest_init_args`]);
//! - a program run here for another node (`ferry run`, `ferry make`'s recipes): it enters a
//!   confined mount namespace the daemon made once at its start ([`GuestMounts`]), as the
//!   first step of its spawn, while still root.
//!
//! Both are built by the same code (`ferry/src/commands/guest_confine.rs`) from the same
//! arguments.

use crate::config::Config;
use anyhow::{bail, Context, Result};
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::process::{Command, Stdio};

/// Whether guests from other homes are confined here.
pub fn confines(config: &Config) -> bool {
    config.confine_guests.unwrap_or(true)
}

/// Whether programs run here for other nodes get a network of their own (a loopback only).
pub fn confines_network(config: &Config) -> bool {
    confines(config) && config.confine_network.unwrap_or(false)
}

/// The confinement's arguments: the shared tree, and what the node keeps to itself (its data
/// directory and the directories of its credentials), hidden wherever they would show.
pub fn args(config: &Config) -> Vec<String> {
    let mut a = Vec::new();
    if let Some(s) = &config.shared {
        a.push(format!("--shared={}", s.display()));
    }
    let c = &config.credentials;
    let mut hide: Vec<&Path> = vec![config.data_dir.as_path()];
    hide.extend(
        [&c.ca_cert, &c.cert, &c.key]
            .into_iter()
            .filter_map(|p| p.parent()),
    );
    for h in hide {
        a.push(format!("--hide={}", h.display()));
    }
    a
}

/// A body's guest init's arguments for the confinement.
pub fn guest_init_args(config: &Config) -> Vec<String> {
    let mut a = vec!["--confine".to_string()];
    a.extend(args(config));
    a
}

/// The mount namespace programs run here for other nodes enter: made once, by
/// `ferry __guest-mounts` (which unshares, confines, says so and exits), and held by its nsfs
/// descriptor alone; with the user namespace that owns it (its mounts are locked together),
/// which every such program enters before it runs (its capabilities, even root's, then count
/// only there).
pub enum GuestMounts {
    /// Guests are not confined here.
    Open,
    Confined {
        mnt: OwnedFd,
        user: OwnedFd,
        /// With `confine_network`: the programs' network namespace (a loopback only).
        net: Option<OwnedFd>,
    },
    /// Guests should be confined but their namespace could not be made: programs from other
    /// nodes are refused, never run unconfined.
    Broken(String),
}

impl GuestMounts {
    /// Made before the daemon reaps children (the helper is waited for here).
    pub fn make(config: &Config, exe: &Path) -> GuestMounts {
        if !confines(config) {
            return GuestMounts::Open;
        }
        match make_ns(config, exe) {
            Ok((mnt, user, net)) => GuestMounts::Confined { mnt, user, net },
            Err(e) => {
                let why = format!("{e:#}");
                tracing::error!(event = "guest-mounts-failed", error = %why);
                GuestMounts::Broken(why)
            }
        }
    }

    /// The namespaces a program run for another node enters (None: its node's own), or why
    /// it cannot run.
    pub fn for_guest(&self) -> std::result::Result<Option<GuestNs>, String> {
        match self {
            GuestMounts::Open => Ok(None),
            GuestMounts::Confined { mnt, user, net } => Ok(Some(GuestNs {
                mnt: mnt.as_raw_fd(),
                user: user.as_raw_fd(),
                net: net.as_ref().map(|n| n.as_raw_fd()),
            })),
            GuestMounts::Broken(why) => Err(format!(
                "this node confines guests, but could not make their file system: {why}"
            )),
        }
    }
}

/// The namespaces of a program run for another node (nsfs descriptors the daemon holds).
#[derive(Debug, Clone, Copy)]
pub struct GuestNs {
    pub mnt: RawFd,
    pub user: RawFd,
    pub net: Option<RawFd>,
}

type Namespaces = (OwnedFd, OwnedFd, Option<OwnedFd>);

fn make_ns(config: &Config, exe: &Path) -> Result<Namespaces> {
    let network = confines_network(config);
    let mut child = Command::new(exe)
        .arg("__guest-mounts")
        .args(args(config))
        .args(network.then_some("--network"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("start {} __guest-mounts", exe.display()))?;
    let pid = child.id();
    let mut word = String::new();
    let read =
        BufReader::new(child.stdout.take().context("the helper's stdout")?).read_line(&mut word);
    let open = |what: &str| {
        ferry_sys::fdops::open_path(
            &format!("/proc/{pid}/ns/{what}"),
            libc::O_RDONLY | libc::O_CLOEXEC,
            0,
        )
        .map_err(|e| anyhow::anyhow!("open the {what} namespace of helper {pid}: {e}"))
    };
    let ns = if read.is_ok() && word.trim() == "R" {
        open("mnt").and_then(|m| Ok((m, network.then(|| open("net")).transpose()?)))
    } else {
        Err(anyhow::anyhow!(
            "the helper did not confine its mount namespace"
        ))
    };
    // Its end: the namespace lives on in our descriptor.
    if let Some(mut stdin) = child.stdin.take() {
        let _ = stdin.write_all(b"done\n");
    }
    let out = child
        .wait_with_output()
        .with_context(|| format!("wait for helper {pid}"))?;
    let ns = ns.with_context(|| {
        format!(
            "{} ({})",
            String::from_utf8_lossy(&out.stderr).trim(),
            out.status
        )
    })?;
    if !out.status.success() {
        bail!("helper {pid} ended with {}", out.status);
    }
    let (mnt, net) = ns;
    let user = ferry_sys::mounts::owner_user_ns(mnt.as_raw_fd())
        .map_err(|e| anyhow::anyhow!("the user namespace of helper {pid}'s mounts: {e}"))?;
    Ok((mnt, user, net))
}
