//! Signals a body sends (ferry::commands::guest_init's part in it): to a process of its own
//! tree they stay in the kernel; to a process at home they are made there, by the caller's
//! deputy.
//!
//! Ferry's filter hands the guest init every `kill`, `tkill`, `tgkill`, `rt_sigqueueinfo` and
//! `rt_tgsigqueueinfo` of the body (ferry_engine::resources::seccomp::KILLS). The body's PID
//! namespace holds only its tree, numbered as at home, and the init (PID 1). A call whose
//! target is a process of the namespace (not the init: PID 1 is the home's init to the body)
//! goes on in the kernel (SECCOMP_USER_NOTIF_FLAG_CONTINUE). Any other target is at home: the
//! home's parent of the root, another process of its shell job, a process group there, every
//! process (-1), or no process at all. Then the init asks its daemon ("NS call PID NR ARGS
//! UIDS SIGINFO" on the report socket, with one end of a socket pair for the answer), which asks
//! the home (`HomeCall`); the home's deputies' worker injects the same call into the caller's
//! deputy, so the home's kernel checks the process's credentials at home against the
//! target's and sends it with the deputy's PID (the caller's own) as the sender, and the
//! call's result (0, ESRCH, EPERM, EINVAL ...) is the caller's. A body whose uids are no longer
//! those of its deputy, or whose home cannot be asked, gets EPERM, and the node's log says why.
//!
//! Process groups: the tree's root was rebuilt leading a group of its own, whose number (the
//! root's PID) stands for its group at home (`getpgrp` answers the home's). `kill(0, sig)` from
//! a process of that group, and `kill(-g, sig)` for the home group or the root's number, go
//! home: there the group holds the deputies of the tree's members (whose bodies the signal
//! then reaches, as any signal sent to a deputy) and the processes that stayed home. A group
//! made in the body (`setpgid` there) is the body's own, and stays local.

/// Where a signal goes.
#[derive(Debug, PartialEq, Eq)]
pub enum Target {
    /// To a process of the body's namespace: the kernel sends it.
    Here,
    /// Home: the caller's deputy makes the call. For the `rt_*sigqueueinfo` calls, the
    /// siginfo's pointer is argument `info`.
    Home { info: Option<usize> },
}

/// Whether system call `nr` is one of Ferry's filter's signal calls.
pub fn is_kill(nr: i64) -> bool {
    ferry_engine::resources::seccomp::KILLS
        .iter()
        .any(|(k, _)| *k as i64 == nr)
}

/// Whether `pid` (a process or a thread) is one of the body's namespace, but its init.
fn here(pid: i32) -> bool {
    pid > 1 && std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// Whether some process of the namespace (but its init) is in process group `g`.
fn group_here(g: i32) -> bool {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return false;
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&p| p > 1)
        .any(|p| super::guest_init::ids_of(p).is_some_and(|(_, pgid, _)| pgid == g))
}

/// Where signal call `nr` with `args` from thread `caller` goes, in a body whose root is `root`
/// and whose home group is `home_pgid`.
pub fn target(nr: i64, args: &[u64; 6], caller: i32, root: i32, home_pgid: i32) -> Target {
    let a = |i: usize| args[i] as i32;
    let home = |info| Target::Home { info };
    match nr {
        libc::SYS_kill => match a(0) {
            p if p > 0 => {
                if here(p) {
                    Target::Here
                } else {
                    home(None)
                }
            }
            0 => match super::guest_init::ids_of(caller) {
                // The caller's group is the root's, which stands for its group at home.
                Some((_, pgid, _)) if pgid == root => home(None),
                _ => Target::Here,
            },
            -1 => home(None),
            g => {
                let g = g.wrapping_neg();
                if g == root || g == home_pgid || !group_here(g) {
                    home(None)
                } else {
                    Target::Here
                }
            }
        },
        // A thread's number: the kernel fails one that is not positive.
        libc::SYS_tkill if a(0) <= 0 || here(a(0)) => Target::Here,
        libc::SYS_tkill => home(None),
        libc::SYS_tgkill if a(0) <= 0 || a(1) <= 0 || here(a(1)) => Target::Here,
        libc::SYS_tgkill => home(None),
        libc::SYS_rt_sigqueueinfo if a(0) <= 0 || here(a(0)) => Target::Here,
        libc::SYS_rt_sigqueueinfo => home(Some(2)),
        libc::SYS_rt_tgsigqueueinfo if a(0) <= 0 || a(1) <= 0 || here(a(1)) => Target::Here,
        libc::SYS_rt_tgsigqueueinfo => home(Some(3)),
        _ => Target::Here,
    }
}

/// The real, effective and saved uids of thread `tid`.
fn uids_of(tid: i32) -> Option<[u32; 3]> {
    let s = std::fs::read_to_string(format!("/proc/{tid}/status")).ok()?;
    let v: Vec<u32> = s
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .filter_map(|u| u.parse().ok())
        .collect();
    Some([*v.first()?, *v.get(1)?, *v.get(2)?])
}

/// Has the caller's deputy at home make call `n` (a signal call [`target`] sent home, or a
/// group or session change): its result, a value or an errno. `listener`: the notification's listener; `pid`: the caller's
/// process (this namespace's number, its home PID).
pub fn at_home(
    forks: &super::guest_forks::Forks,
    n: &ferry_sys::seccomp::Notif,
    listener: i32,
    pid: i32,
    info: Option<usize>,
) -> Result<i64, i32> {
    let data = match info {
        Some(k) => {
            let mut si = [0u8; 128];
            match ferry_sys::proc_mem::vm_read(n.pid, n.args[k], &mut si) {
                Ok(128) => {}
                _ => return Err(libc::EFAULT),
            }
            si.iter().map(|b| format!("{b:02x}")).collect::<String>()
        }
        None => "-".to_string(),
    };
    let uids = uids_of(n.pid).ok_or(libc::ESRCH)?;
    // The caller is still waiting in this call (not killed meanwhile) before home acts for it.
    if !ferry_sys::seccomp::id_valid(listener, n.id) {
        return Err(libc::EINTR);
    }
    let a = &n.args;
    let question = format!(
        "call {pid} {} {} {} {} {} {} {} {} {} {} {data}",
        n.nr, a[0], a[1], a[2], a[3], a[4], a[5], uids[0], uids[1], uids[2]
    );
    let text = match forks.ask(&question) {
        Ok(t) => t,
        Err(why) => {
            forks.say(&format!(
                "PID {pid} makes call {}, which its deputy makes at home, but home could not be \
                 asked: {why}; the call fails with EPERM",
                n.nr
            ));
            return Err(libc::EPERM);
        }
    };
    match text.split_at_checked(1) {
        Some(("R", ret)) => match ret.trim().parse::<i64>() {
            Ok(r) if r < 0 => Err((-r) as i32),
            Ok(r) => Ok(r),
            Err(_) => {
                forks.say(&format!(
                    "a bad answer {text:?} to call {} of PID {pid}",
                    n.nr
                ));
                Err(libc::EPERM)
            }
        },
        Some(("E", why)) => {
            forks.say(&format!(
                "PID {pid} makes call {}, which its deputy makes at home, refused there: {why}; \
                 the call fails with EPERM",
                n.nr
            ));
            Err(libc::EPERM)
        }
        _ => {
            forks.say(&format!(
                "PID {pid} makes call {}, which its deputy makes at home: the daemon closed the \
                 question unanswered; the call fails with EPERM",
                n.nr
            ));
            Err(libc::EPERM)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{target, Target};

    #[test]
    fn signals_to_the_namespace_stay_and_others_go_home() {
        // This test runs in the machine's PID namespace: its own PID is "here", PID 1 never is.
        let me = std::process::id() as i32;
        let kill = |pid: i32| {
            target(
                libc::SYS_kill,
                &[pid as i64 as u64, 10, 0, 0, 0, 0],
                me,
                me,
                me,
            )
        };
        assert_eq!(kill(me), Target::Here);
        assert_eq!(kill(1), Target::Home { info: None });
        assert_eq!(kill(-1), Target::Home { info: None });
        // The root's group and the home group go home.
        assert_eq!(kill(-me), Target::Home { info: None });
        let none = i32::MAX - 7;
        assert_eq!(kill(none), Target::Home { info: None });
        let q = |nr: i64, a0: i32, a1: i32| {
            target(
                nr,
                &[a0 as i64 as u64, a1 as i64 as u64, 10, 0, 0, 0],
                me,
                me,
                me,
            )
        };
        assert_eq!(q(libc::SYS_tkill, me, 10), Target::Here);
        assert_eq!(q(libc::SYS_tkill, 0, 10), Target::Here);
        assert_eq!(q(libc::SYS_tkill, none, 10), Target::Home { info: None });
        assert_eq!(q(libc::SYS_tgkill, me, me), Target::Here);
        assert_eq!(q(libc::SYS_tgkill, none, none), Target::Home { info: None });
        assert_eq!(q(libc::SYS_rt_sigqueueinfo, me, 10), Target::Here);
        assert_eq!(
            q(libc::SYS_rt_sigqueueinfo, none, 10),
            Target::Home { info: Some(2) }
        );
        assert_eq!(
            q(libc::SYS_rt_tgsigqueueinfo, none, none),
            Target::Home { info: Some(3) }
        );
    }
}
