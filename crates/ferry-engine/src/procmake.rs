//! Making the processes of a rebuilt tree, beyond forking them: their sessions and process
//! groups (with a stand-in for a group whose leader has exited), zombies, and deputies of a
//! tree coming home that are made again from their parent.

use crate::error::{Context, Error, Result};
use crate::husk::Husk;
use crate::resources::seccomp;
use ferry_image::{Process, Tree};
use ferry_sys::ptrace;
use std::collections::HashSet;

/// Whether deputy `p` (a child in a tree coming home) may be made again by a fork of its
/// parent's husk (`parent_host`) instead of being taken over in place: it is in its parent's
/// session and process group, in the same cgroups, and neither has seccomp filters, so that a
/// child forked from the parent has all that its deputy kept at home.
pub(crate) fn deputy_refork_ok(p: &Process, tree: &Tree, parent_host: i32) -> bool {
    let Some(q) = tree.processes.iter().find(|q| q.pid == p.ppid) else {
        return false;
    };
    let cgroups = |pid: i32| std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok();
    q.zombie_status.is_none()
        && q.sid == p.sid
        && q.pgid == p.pgid
        && cgroups(p.pid).is_some()
        && cgroups(p.pid) == cgroups(parent_host)
        && seccomp::installed(p.pid) == 0
        && seccomp::installed(parent_host) == 0
}

/// Ends deputy `pid`, a child of `parent` (a husk, itself a deputy taken over, every signal
/// blocked), so that it can be forked again under its PID: it is killed and reaped by its
/// parent, and the SIGCHLD that its death queued there is taken back.
pub(crate) fn replace_deputy(parent: &Husk, pid: i32) -> Result<()> {
    let fail = |what: String| Error::Restore { pid, what };
    ptrace::kill(pid, libc::SIGKILL).map_err(|e| fail(format!("end its deputy: {e}")))?;
    let inj = parent.injector();
    inj.syscall(
        "wait4(deputy)",
        libc::SYS_wait4,
        &[pid as u64, 0, libc::__WALL as u64, 0],
    )?;
    let set = inj.write_scratch(0, &(1u64 << (libc::SIGCHLD - 1)).to_ne_bytes())?;
    let zero = inj.write_scratch(64, &[0u8; 16])?;
    // SIGCHLD, or EAGAIN where none was queued.
    inj.syscall_raw(
        "rt_sigtimedwait(SIGCHLD)",
        libc::SYS_rt_sigtimedwait,
        &[set, 0, zero, 8],
    )?;
    Ok(())
}

/// Puts a freshly forked husk (a child of `parent`) into its session and process group.
/// `stand_in_groups`: the groups made so far whose leader is not in the tree.
pub(crate) fn join_session(
    h: &Husk,
    p: &Process,
    tree: &Tree,
    parent: &Husk,
    made: &[Husk],
    stand_in_groups: &mut HashSet<i32>,
) -> Result<()> {
    let inj = h.injector();
    // Forked from its parent, it is in its parent's group already: the parent was put in the
    // group the image gives it before it forked (the root: in the group it leads).
    let root_pid = tree.processes.first().map(|r| r.pid);
    let in_parents_group = tree.processes.iter().any(|q| {
        q.pid == p.ppid
            && q.pid == parent.pid
            && q.pgid == p.pgid
            && q.sid == p.sid
            && (Some(q.pid) != root_pid || q.pgid == q.pid)
    });
    if p.sid != p.pid && p.pgid != p.pid && in_parents_group {
        return Ok(());
    }
    if p.sid == p.pid {
        inj.syscall("setsid", libc::SYS_setsid, &[])?;
    } else if p.pgid == p.pid {
        inj.syscall("setpgid", libc::SYS_setpgid, &[0, 0])?;
    } else if made.iter().any(|m| m.pid == p.pgid) || stand_in_groups.contains(&p.pgid) {
        inj.syscall("setpgid", libc::SYS_setpgid, &[0, p.pgid as u64])?;
    } else if p.pgid > 0
        && tree
            .processes
            .first()
            .is_some_and(|root| p.pgid != root.pgid)
        && !tree.processes.iter().any(|q| q.pid == p.pgid)
    {
        // A group whose leader has exited (the capture let only such groups through, whose
        // PIDs are outside the tree). A stand-in with the leader's PID, forked by the same
        // parent (so in the same session), makes the group; the husk joins it; the stand-in
        // dies, and the group lives on in its members, its number taken as before.
        let stand_in = parent.fork_child(p.pgid, 0)?;
        let joined = stand_in
            .injector()
            .syscall("setpgid", libc::SYS_setpgid, &[0, 0])
            .and_then(|_| inj.syscall("setpgid", libc::SYS_setpgid, &[0, p.pgid as u64]));
        stand_in.kill();
        let gone = reap_stand_in(parent, &stand_in);
        joined?;
        gone?;
        stand_in_groups.insert(p.pgid);
    }
    Ok(())
}

/// Waits until a killed stand-in is dead, and reaps it from its parent (its exit signal is
/// 0: the parent is not told).
fn reap_stand_in(parent: &Husk, stand_in: &Husk) -> Result<()> {
    let fail = |e: ferry_sys::SysError| Error::Restore {
        pid: stand_in.pid,
        what: format!(
            "reap the stand-in leader of process group {}: {e}",
            stand_in.pid
        ),
    };
    loop {
        match ferry_sys::wait::wait_tid(stand_in.host, false).map_err(fail)? {
            ferry_sys::wait::WaitStatus::Exited(_) | ferry_sys::wait::WaitStatus::Signaled(_) => {
                break
            }
            _ => {}
        }
    }
    parent.injector().syscall(
        "wait4",
        libc::SYS_wait4,
        &[stand_in.pid as u64, 0, libc::__WALL as u64, 0],
    )?;
    Ok(())
}

/// Readies a husk to dump core when it dies, so that its parent sees "core dumped" as it
/// would have: a tiny core (the husk maps nothing but the trampoline) goes into a private
/// directory of ours, removed once it is written. Only where `core_pattern` names a file
/// relative to the dying process's directory (a pipe or an absolute path would hand the core
/// to someone else): otherwise the zombie comes back without the flag, with a warning.
fn core_dump_dir(h: &Husk) -> Result<Option<tempfile_dir::Dir>> {
    let pattern = std::fs::read_to_string("/proc/sys/kernel/core_pattern").unwrap_or_default();
    let pattern = pattern.trim();
    if pattern.is_empty() || pattern.starts_with('|') || pattern.contains('/') {
        log::warn!(
            "PID {}: its core-dumped flag is lost (core_pattern {pattern:?} does not write \
             into the process's directory)",
            h.pid
        );
        ferry_sys::fdops::set_rlimit(h.host, libc::RLIMIT_CORE, 0, 0)
            .ctx(h.pid, || "set RLIMIT_CORE".into())?;
        return Ok(None);
    }
    let dir = tempfile_dir::Dir::new(h.pid)?;
    let inj = h.injector();
    let mut path = dir.path().as_os_str().as_encoded_bytes().to_vec();
    path.push(0);
    inj.syscall("chdir", libc::SYS_chdir, &[inj.write_scratch(0, &path)?])?;
    ferry_sys::fdops::set_rlimit(h.host, libc::RLIMIT_CORE, u64::MAX, u64::MAX)
        .ctx(h.pid, || "set RLIMIT_CORE".into())?;
    inj.syscall("prctl(PR_SET_DUMPABLE)", libc::SYS_prctl, &[4, 1])?;
    Ok(Some(dir))
}

mod tempfile_dir {
    use crate::error::{Context, Result};
    use std::path::{Path, PathBuf};

    /// A directory of ours (mode 0700, under /run or the temporary directory).
    pub struct Dir(PathBuf);

    impl Dir {
        pub fn new(pid: i32) -> Result<Dir> {
            let base = if Path::new("/run").is_dir() {
                PathBuf::from("/run")
            } else {
                std::env::temp_dir()
            };
            let p = base.join(format!("ferry-core-{}-{pid}", std::process::id()));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(&p)
                .ctx(pid, || format!("make {}", p.display()))?;
            Ok(Dir(p))
        }
        pub fn path(&self) -> &Path {
            &self.0
        }
    }

    use std::os::unix::fs::DirBuilderExt;

    impl AsRef<Path> for Dir {
        fn as_ref(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

pub(crate) fn make_zombie(h: &Husk, status: i32) -> Result<()> {
    let pid = h.host;
    let fail = |e: ferry_sys::SysError| Error::Restore {
        pid,
        what: format!("turn into a zombie: {e}"),
    };
    if libc::WIFSIGNALED(status) {
        // Die of the same signal, with its default action (SIGKILL has no other), and with a
        // core file only if the original dumped one (its parent sees WCOREDUMP).
        let sig = libc::WTERMSIG(status);
        let core_dir = if libc::WCOREDUMP(status) {
            core_dump_dir(h)?
        } else {
            ferry_sys::fdops::set_rlimit(pid, libc::RLIMIT_CORE, 0, 0).map_err(fail)?;
            None
        };
        let inj = h.injector();
        if sig != libc::SIGKILL {
            inj.syscall(
                "rt_sigaction",
                libc::SYS_rt_sigaction,
                &[sig as u64, inj.write_scratch(0, &[0u8; 32])?, 0, 8],
            )?;
        }
        ptrace::set_sigmask(pid, 0).map_err(fail)?;
        ptrace::tgkill(pid, pid, sig).map_err(fail)?;
        // (A thread that SIGKILL has reached is already past resuming: ESRCH.)
        let resume = |s: i32| match ptrace::cont(pid, s) {
            Err(e) if e.errno != libc::ESRCH => Err(fail(e)),
            _ => Ok(()),
        };
        let died = resume(0).and_then(|()| loop {
            match ferry_sys::wait::wait_tid(pid, false) {
                Ok(ferry_sys::wait::WaitStatus::Stopped { sig: s, event: 0 }) => {
                    if let Err(e) = resume(s) {
                        break Err(e);
                    }
                }
                Ok(ferry_sys::wait::WaitStatus::Stopped { .. }) => {
                    if let Err(e) = resume(0) {
                        break Err(e);
                    }
                }
                Ok(_) => break Ok(()),
                Err(e) => break Err(fail(e)),
            }
        });
        if let Some(dir) = core_dir {
            let _ = std::fs::remove_dir_all(dir);
        }
        died?;
    } else {
        // The call never returns: the injector reports the thread's exit, which is the point.
        let _ = h.injector().syscall_raw(
            "exit_group",
            libc::SYS_exit_group,
            &[libc::WEXITSTATUS(status) as u64],
        );
    }
    Ok(())
}
