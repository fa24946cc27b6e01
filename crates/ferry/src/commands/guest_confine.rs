//! A guest's file system (MOSIX-4's guest sandbox): what a body, a tree running on a node that
//! is not its home, may see of that node. The guest init (`ferry __guest-init --confine`)
//! makes its mount namespace's root, before anything is restored into it:
//!
//! - `/` is the node's root file system, read-only and without the mounts on it; every
//!   directory at its top is hidden under an empty, read-only tmpfs, except the system's
//!   ([`SYSTEM_DIRS`]: /usr, /bin, /lib..., /etc), carried in read-only with their mounts;
//! - the cluster's shared tree (`--shared`) is carried in, writable, at its path;
//! - /proc is the guest's own (its PID namespace's), /sys is read-only, /dev holds only
//!   null, zero, full, random, urandom and tty, the guest's own devpts and a /dev/shm of its
//!   own; /tmp and /run are empty tmpfs of its own;
//! - what the node keeps to itself inside those trees (`--hide`: its data directory, its
//!   credentials) is hidden under an empty tmpfs.
//!
//! Last, the namespace is replaced by a copy of it owned by a user namespace of its own (an
//! identity mapping): the kernel locks the copied mounts together (`MNT_LOCKED`), so no
//! process inside, root included, can unmount or move what covers the node's files.
//!
//! The root and the shared tree are the node's own mounts, so a directory or file there has
//! the device and inode the home captured (a working directory of `/` or in the shared tree
//! is found again); anything else of the node (its /root, its /tmp, /home, /var, /srv ...) is
//! not there at all.

use anyhow::{bail, Context, Result};
use ferry_sys::mounts;
use std::io::BufRead;
use std::path::{Path, PathBuf};

/// `ferry __guest-mounts`: a confined mount namespace for a daemon's programs from other
/// nodes (`ferry_daemon::confine`). Unshares, confines, says `R` on stdout and waits for its
/// stdin to end; the daemon holds the namespace by its descriptor from then on.
#[derive(clap::Args)]
pub struct Args {
    /// The cluster's shared tree.
    #[arg(long)]
    pub shared: Option<PathBuf>,
    /// Directories of the node's own hidden even where they would show.
    #[arg(long)]
    pub hide: Vec<PathBuf>,
    /// Make a network namespace too, its loopback up (`confine_network`).
    #[arg(long)]
    pub network: bool,
}

pub fn hold(a: Args) -> Result<()> {
    mounts::unshare_mount_ns().context("make a mount namespace")?;
    confine(a.shared.as_deref(), &a.hide).context("confine the guests' file system")?;
    if a.network {
        ferry_sys::mounts::unshare_loopback_only()
            .context("make the guests' network (a loopback only)")?;
    }
    println!("R");
    let mut line = String::new();
    if std::io::stdin().lock().read_line(&mut line).is_err() {
        bail!("read the daemon's word");
    }
    Ok(())
}

/// The top-level directories a guest sees (read-only), when they are directories here.
pub const SYSTEM_DIRS: [&str; 8] = [
    "usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc",
];

/// The devices a guest's /dev holds.
const DEVICES: [&str; 6] = ["null", "zero", "full", "random", "urandom", "tty"];

/// Where the new root is put together (a tmpfs mounted over the guest's view of /tmp, which
/// the guest never sees: it goes with the old root).
const STAGE: &str = "/tmp";

/// Makes this mount namespace's root the guest's (see the module's text). Run by the guest
/// init, PID 1 of the namespace, before anything else is in it.
pub fn confine(shared: Option<&Path>, hide: &[PathBuf]) -> Result<()> {
    let clone = |p: &Path| mounts::clone_tree(p).with_context(|| format!("clone {}", p.display()));
    // Everything carried in is taken before anything is covered.
    let root = mounts::clone_mount(Path::new("/")).context("clone /")?;
    mounts::make_read_only(&root, false).context("make / read-only")?;
    let mut system = Vec::new();
    for d in SYSTEM_DIRS {
        let p = Path::new("/").join(d);
        if std::fs::symlink_metadata(&p).is_ok_and(|m| m.is_dir()) {
            let t = clone(&p)?;
            mounts::make_read_only(&t, true).with_context(|| format!("make {d} read-only"))?;
            system.push((d, t));
        }
    }
    let proc_ = clone(Path::new("/proc"))?;
    let sys = clone(Path::new("/sys"))?;
    mounts::make_read_only(&sys, true).context("make /sys read-only")?;
    let pts = clone(Path::new("/dev/pts"))?;
    let ptmx = clone(Path::new("/dev/ptmx"))?;
    let mut devices = Vec::new();
    for d in DEVICES {
        let p = Path::new("/dev").join(d);
        if p.exists() {
            devices.push((d, clone(&p)?));
        }
    }
    let shared = match shared {
        Some(s) => Some((s.to_path_buf(), clone(s)?)),
        None => None,
    };
    let top: Vec<(String, std::fs::FileType)> = std::fs::read_dir("/")
        .context("list /")?
        .flatten()
        .filter_map(|e| Some((e.file_name().into_string().ok()?, e.file_type().ok()?)))
        .collect();

    let stage = Path::new(STAGE);
    mounts::mount_tmpfs(stage, 0o755).context("mount the staging tmpfs")?;
    let new = stage.join("root");
    std::fs::create_dir(&new).context("make the staging root")?;
    mounts::attach_tree(&root, &new).context("attach /")?;
    let at = |p: &str| new.join(p.trim_start_matches('/'));
    let mut masks = Vec::new();
    for (name, kind) in &top {
        let target = at(name);
        if let Some((_, t)) = system.iter().find(|(d, _)| d == name) {
            mounts::attach_tree(t, &target).with_context(|| format!("attach /{name}"))?;
        } else if !kind.is_dir() {
            // Files and links at the top are the root file system's own (links lead inside).
        } else {
            match name.as_str() {
                "proc" => mounts::attach_tree(&proc_, &target).context("attach /proc")?,
                "sys" => mounts::attach_tree(&sys, &target).context("attach /sys")?,
                "dev" => {}
                "tmp" | "run" => {
                    let mode = if name == "tmp" { 0o1777 } else { 0o755 };
                    mounts::mount_tmpfs(&target, mode)
                        .with_context(|| format!("mount a tmpfs on /{name}"))?
                }
                _ => {
                    mounts::mount_tmpfs(&target, 0o755).with_context(|| format!("hide /{name}"))?;
                    masks.push(target);
                }
            }
        }
    }
    // /dev: the few devices, the guest's own terminals and shared memory.
    let dev = at("dev");
    mounts::mount_tmpfs(&dev, 0o755).context("mount a tmpfs on /dev")?;
    for (d, t) in &devices {
        let p = dev.join(d);
        std::fs::File::create(&p).with_context(|| format!("make {}", p.display()))?;
        mounts::attach_tree(t, &p).with_context(|| format!("attach /dev/{d}"))?;
    }
    std::fs::create_dir(dev.join("pts")).context("make /dev/pts")?;
    mounts::attach_tree(&pts, &dev.join("pts")).context("attach /dev/pts")?;
    std::fs::File::create(dev.join("ptmx")).context("make /dev/ptmx")?;
    mounts::attach_tree(&ptmx, &dev.join("ptmx")).context("attach /dev/ptmx")?;
    std::fs::create_dir(dev.join("shm")).context("make /dev/shm")?;
    mounts::mount_tmpfs(&dev.join("shm"), 0o1777).context("mount a tmpfs on /dev/shm")?;
    for (name, to) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        std::os::unix::fs::symlink(to, dev.join(name))
            .with_context(|| format!("link /dev/{name}"))?;
    }
    mounts::remount_read_only(&dev).context("make /dev read-only")?;
    // The shared tree, writable, at its path (made in the tmpfs that hides its top).
    if let Some((path, t)) = &shared {
        let target = at(&path.to_string_lossy());
        std::fs::create_dir_all(&target)
            .with_context(|| format!("make {} in the guest's root", path.display()))?;
        mounts::attach_tree(t, &target)
            .with_context(|| format!("attach the shared tree {}", path.display()))?;
    }
    // What the node keeps to itself, wherever it shows.
    for h in hide {
        let target = at(&h.to_string_lossy());
        if std::fs::symlink_metadata(&target).is_ok_and(|m| m.is_dir()) {
            mounts::mount_tmpfs(&target, 0o755).with_context(|| format!("hide {}", h.display()))?;
            masks.push(target);
        }
    }
    for m in &masks {
        mounts::remount_read_only(m).with_context(|| format!("make {} read-only", m.display()))?;
    }
    mounts::pivot_root_to(&new).context("enter the guest's root")?;
    // Locked together: not even root can unmount or move what covers the node's own files.
    mounts::lock_mounts().context("lock the guest's mounts (a user namespace of their own)")?;
    Ok(())
}
