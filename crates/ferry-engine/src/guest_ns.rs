//! Guest namespaces: a PID namespace, a time namespace, a mount namespace (with a /proc and a
//! devpts instance of its own) and an IPC namespace in which a tree is rebuilt under the PIDs,
//! pty numbers and System V IDs it had, whatever this machine uses, with clocks that continue
//! from where the tree saw them.
//!
//! PID 1 of the namespaces is an exec'd init (`ferry __guest-init`): it reaps orphans, and it
//! exits once [`GuestNamespaces`] has been dropped and no other process is left in its PID
//! namespace (it looks once a second; its exit would SIGKILL every guest, so it never leaves
//! earlier). Being exec'd, it shares no memory with the process that made it.
//!
//! A body's namespaces ([`Home`] given) also stand for its home: their UTS namespace has the
//! home's host name, and the init is the supervisor of Ferry's seccomp filter in every process
//! of the tree ([`GuestNamespaces::hand_listeners`]): it answers `getppid`, `getpgrp`,
//! `getpgid` and `getsid` with the home's values. Since the kernel kills a PID namespace whose
//! init dies, a body never outlives its supervisor: it never sees a forwarded call fail.
//!
//! The engine keeps working with the PIDs of its own namespace (ptrace, /proc): a process in
//! the guest has one PID there (the tree's, as in the image) and another here (the host PID);
//! [`GuestNamespaces::host_pid`] and [`GuestNamespaces::guest_pid`] translate.

use crate::error::{Context, Error, Result};
use crate::procfs;
use ferry_image::Clocks;
use ferry_sys::ns::{dup_at_least, spawn_guest_init, GuestInitSpec};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

/// The hidden subcommand of the `ferry` binary that runs as the guest init.
pub const GUEST_INIT_COMMAND: &str = "__guest-init";

/// What a body's home says of its root: its host name, and the root's parent, process group
/// and session there (read at home when the tree first left it, then carried along).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Home {
    pub hostname: String,
    /// The root's PID (the tree's, and the home's).
    pub root: i32,
    pub ppid: i32,
    pub pgid: i32,
    pub sid: i32,
    /// The body is away from home: its mount namespace is confined (the guest init makes it
    /// show only the system's files and the shared tree; `ferry __guest-init --confine`).
    pub confine: Option<Confine>,
}

/// What a confined guest's mount namespace carries besides the system's files.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Confine {
    /// The cluster's shared tree, writable.
    pub shared: Option<PathBuf>,
    /// Directories of the node's own hidden wherever they would show (its data directory and
    /// credentials).
    pub hide: Vec<PathBuf>,
}

impl Home {
    /// The guest init's arguments that tell it of this home.
    pub fn init_args(&self) -> Vec<String> {
        // (`--name=value`: a host name from a peer may start with a dash.)
        let mut v = vec![
            format!("--hostname={}", self.hostname),
            format!(
                "--home={} {} {} {}",
                self.root, self.ppid, self.pgid, self.sid
            ),
        ];
        if let Some(c) = &self.confine {
            v.push("--confine".to_string());
            if let Some(s) = &c.shared {
                v.push(format!("--shared={}", s.display()));
            }
            v.extend(c.hide.iter().map(|h| format!("--hide={}", h.display())));
        }
        v
    }
}

/// Fresh PID, time, mount, IPC and UTS namespaces, held by their init.
pub struct GuestNamespaces {
    init: i32,
    pidfd: OwnedFd,
    /// Our end of a socket pair the init reads: while it is open, the init stays even with
    /// nothing else in its namespace (nothing has been restored into it yet). Seccomp
    /// listeners are handed to the init through it.
    hold: OwnedFd,
    /// `pid:[inode]` of the guest PID namespace.
    ns: String,
    offsets: Clocks,
}

impl std::fmt::Debug for GuestNamespaces {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuestNamespaces")
            .field("init", &self.init)
            .field("ns", &self.ns)
            .field("offsets", &self.offsets)
            .finish()
    }
}

fn last_ns_pid(status: &[(String, String)]) -> Option<i32> {
    procfs::field(status, "NSpid")
        .split_whitespace()
        .last()
        .and_then(|x| x.parse().ok())
}

impl GuestNamespaces {
    /// Makes new PID, time, mount and IPC namespaces whose PID 1 is `init_exe __guest-init`.
    ///
    /// `clocks_seen`: CLOCK_MONOTONIC and CLOCK_BOOTTIME as the tree to be rebuilt last saw
    /// them (`Tree::clocks`). Each clock of the time namespace is offset by
    /// `max(0, seen - now)`, so that it continues from where the tree left it and never runs
    /// backwards (it runs on from the later of the two). Without it, the offsets are 0.
    ///
    /// `reports`: a datagram socket the init tells of every child it reaps (its daemon's).
    pub fn create(
        init_exe: &Path,
        clocks_seen: Option<Clocks>,
        reports: Option<&Path>,
    ) -> Result<GuestNamespaces> {
        Self::create_for(init_exe, clocks_seen, reports, None)
    }

    /// [`GuestNamespaces::create`] for a body whose home is `home`: the UTS namespace gets the
    /// home's host name, and the init answers the calls of Ferry's filter from `home`.
    pub fn create_for(
        init_exe: &Path,
        clocks_seen: Option<Clocks>,
        reports: Option<&Path>,
        home: Option<&Home>,
    ) -> Result<GuestNamespaces> {
        let me = ferry_sys::ns::getpid();
        let now = |clock: i32| {
            ferry_sys::anon_fds::clock_now_ns(clock).ctx(me, || format!("read clock {clock}"))
        };
        let offsets = match clocks_seen {
            Some(c) => Clocks {
                monotonic_ns: c.monotonic_ns.saturating_sub(now(libc::CLOCK_MONOTONIC)?),
                boottime_ns: c.boottime_ns.saturating_sub(now(libc::CLOCK_BOOTTIME)?),
            },
            None => Clocks::default(),
        };
        let (r, w) =
            ferry_sys::sockets::socketpair(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC)
                .ctx(me, || "make the guest init's hold socket".into())?;
        let r = dup_at_least(r, 3).ctx(me, || "move the hold pipe above stdio".into())?;
        let mut args = vec![
            GUEST_INIT_COMMAND.to_string(),
            "--hold-fd".to_string(),
            r.as_raw_fd().to_string(),
        ];
        if let Some(p) = reports {
            args.push("--report".to_string());
            args.push(p.to_string_lossy().into_owned());
        }
        if let Some(h) = home {
            args.extend(h.init_args());
        }
        let init = spawn_guest_init(&GuestInitSpec {
            exe: init_exe,
            args: &args,
            monotonic_offset_ns: offsets.monotonic_ns,
            boottime_offset_ns: offsets.boottime_ns,
            keep_fd: r.as_raw_fd(),
        })
        .map_err(|source| Error::Sys {
            pid: me,
            what: format!(
                "make guest namespaces with {} {GUEST_INIT_COMMAND} as their init",
                init_exe.display()
            ),
            source,
        })?;
        drop(r);
        let pidfd = ferry_sys::pidfd::pidfd_open(init)
            .ctx(init, || "open a pidfd of the guest init".into())?;
        // Make sure the pidfd is the init we made (its PID could not have been reused before it
        // exits, and it only exits once we close the hold pipe).
        let status = procfs::status(init)?;
        let ns = procfs::readlink(init, "ns/pid")?;
        let ours = procfs::readlink(me, "ns/pid")?;
        if last_ns_pid(&status) != Some(1) || ns == ours {
            return Err(Error::Restore {
                pid: init,
                what: format!(
                    "the guest init is not PID 1 of a new PID namespace (NSpid {:?}, {ns})",
                    procfs::field(&status, "NSpid")
                ),
            });
        }
        if home.is_some_and(|h| h.confine.is_some()) {
            // The init confines the mount namespace before anything may join it.
            let r = ferry_sys::sockets::recv(w.as_raw_fd(), 4096, 0).ctx(init, || {
                "wait for the guest init to confine the guest".into()
            })?;
            match r.data.split_first() {
                Some((b'R', _)) => {}
                Some((b'E', why)) => {
                    return Err(Error::Restore {
                        pid: init,
                        what: String::from_utf8_lossy(why).into_owned(),
                    })
                }
                _ => {
                    return Err(Error::Restore {
                        pid: init,
                        what: "the guest init ended before confining the guest".into(),
                    })
                }
            }
        }
        Ok(GuestNamespaces {
            init,
            pidfd,
            hold: w,
            ns,
            offsets,
        })
    }

    /// Hands the seccomp listeners of the tree rebuilt here (`RestoredTree::take_listeners`)
    /// to the init, which answers them from then on, with the names of the tree's relayed
    /// sockets (`RestoredTree::relayed_names`), sent first.
    ///
    /// The hold socket is a stream: each message is a letter, `L` (listeners, in its
    /// SCM_RIGHTS) or `N` followed by the length of the text that follows (decimal, then a
    /// newline) and that text
    /// ([`crate::resources::sockets::RelayedNames::encode`]).
    pub fn hand_listeners(
        &self,
        listeners: Vec<OwnedFd>,
        names: &[crate::resources::sockets::RelayedNames],
    ) -> Result<()> {
        if !names.is_empty() {
            let text = crate::resources::sockets::RelayedNames::encode(names);
            let msg = format!("N{}\n{text}", text.len());
            let mut at = 0;
            while at < msg.len() {
                at += ferry_sys::sockets::send(
                    self.hold.as_raw_fd(),
                    &msg.as_bytes()[at..],
                    None,
                    &[],
                    0,
                )
                .ctx(self.init, || {
                    format!(
                        "hand the names of {} relayed socket(s) to the guest init",
                        names.len()
                    )
                })?;
            }
        }
        for chunk in listeners.chunks(200) {
            let raw: Vec<i32> = chunk.iter().map(|f| f.as_raw_fd()).collect();
            ferry_sys::sockets::send(self.hold.as_raw_fd(), b"L", None, &raw, 0)
                .ctx(self.init, || {
                    format!("hand {} seccomp listener(s) to the guest init", raw.len())
                })?;
        }
        Ok(())
    }

    /// The init's PID in our namespace.
    pub fn init_host_pid(&self) -> i32 {
        self.init
    }

    /// A pidfd of the init: `setns(pidfd, ferry_sys::ns::GUEST_NAMESPACES)` joins the guest
    /// namespaces (the PID and time namespaces for the caller's next children).
    pub fn pidfd(&self) -> BorrowedFd<'_> {
        self.pidfd.as_fd()
    }

    /// `pid:[inode]`: the guest PID namespace, as /proc/PID/ns/pid reads.
    pub fn pid_namespace(&self) -> &str {
        &self.ns
    }

    /// The offsets of CLOCK_MONOTONIC and CLOCK_BOOTTIME in the guest time namespace.
    pub fn clock_offsets(&self) -> Clocks {
        self.offsets
    }

    /// The guest's /proc, as seen from here (through the init's root).
    pub fn proc_root(&self) -> PathBuf {
        PathBuf::from(format!("/proc/{}/root/proc", self.init))
    }

    /// The guest's /dev, as seen from here: its own devpts instance is mounted on `pts`, and
    /// its `ptmx` makes ptys there.
    pub fn dev_dir(&self) -> PathBuf {
        PathBuf::from(format!("/proc/{}/root/dev", self.init))
    }

    /// Whether host process `host` lives in the guest PID namespace; its PID there if so.
    pub fn guest_pid(&self, host: i32) -> Option<i32> {
        if procfs::readlink(host, "ns/pid").ok()? != self.ns {
            return None;
        }
        last_ns_pid(&procfs::status(host).ok()?)
    }

    /// The host PID of the process whose PID in the guest namespace is `guest`: searched among
    /// the init's descendants, then among every process.
    pub fn host_pid(&self, guest: i32) -> Result<i32> {
        if guest == 1 {
            return Ok(self.init);
        }
        let mut queue = vec![self.init];
        let mut seen = std::collections::HashSet::new();
        while let Some(p) = queue.pop() {
            if !seen.insert(p) {
                continue;
            }
            for c in procfs::children(p).unwrap_or_default() {
                if self.guest_pid(c) == Some(guest) {
                    return Ok(c);
                }
                queue.push(c);
            }
        }
        // Processes that joined the namespace with setns are nobody's descendants here.
        let dir = std::fs::read_dir("/proc").ctx(self.init, || "list /proc".into())?;
        for e in dir.flatten() {
            if let Some(h) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) {
                if !seen.contains(&h) && self.guest_pid(h) == Some(guest) {
                    return Ok(h);
                }
            }
        }
        Err(Error::Restore {
            pid: guest,
            what: format!("no process has PID {guest} in guest namespace {}", self.ns),
        })
    }

    /// Kills the init, and with it every process of the guest PID namespace.
    pub fn kill(self) -> Result<()> {
        ferry_sys::pidfd::pidfd_send_signal(&self.pidfd, libc::SIGKILL)
            .ctx(self.init, || "kill the guest init".into())
    }
}
