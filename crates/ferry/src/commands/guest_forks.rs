//! Processes a body makes (ferry::commands::guest_init's part in it): each child gets its
//! PID from home, where a deputy forked from its parent's deputy holds it (MOSIX's fork of a
//! split process).
//!
//! Ferry's filter hands the guest init every `clone`, `clone3`, `fork` and `vfork` of the body
//! (ferry_engine::resources::seccomp::CLONES). A thread (CLONE_THREAD) goes on in the kernel at
//! once. For a process, the init asks its daemon ("NS fork PID" on the report socket, with one
//! end of a socket pair for the answer), which asks the home (`ForkDeputy`): the home's
//! deputies' worker forks a deputy from the parent's deputy and answers its PID X. The init
//! sets its PID namespace's `ns_last_pid` to X - 1 and lets the call go on in the kernel
//! (SECCOMP_USER_NOTIF_FLAG_CONTINUE), so the child gets X. The init answers one call at a time,
//! and every clone of the namespace comes to it, so nothing else takes X meanwhile; it waits
//! until the namespace's last PID says X was handed out (or the call failed) before it takes
//! the next call. A PID taken here already is given back and another asked for; a home that
//! cannot be asked, or refuses, fails the call with EAGAIN (the log says why).
//!
//! The init then watches each such child (a pidfd) and every process of the tree it is not
//! the parent of (whose ends the kernel tells only their parents): when one ends, its status
//! (read from its zombie, or once its parent reaped it from the pidfd: PIDFD_INFO_EXIT) goes
//! home, where its deputy ends the same way and is reaped by its parent's deputy.

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::FileExt;

/// How long a fork waits for its home's answer.
const ASK_MS: i32 = 45_000;
/// How long the init waits for a call it let go on to hand out its PID.
const MADE_WITHIN: std::time::Duration = std::time::Duration::from_secs(5);

/// What the init keeps for the processes the body makes.
pub struct Forks {
    /// /proc/sys/kernel/ns_last_pid, opened before the guest was confined: it reads and sets
    /// the next PID of the caller's PID namespace, this one.
    last_pid: Option<std::fs::File>,
    /// The daemon's report socket (connected) and this PID namespace's name.
    report: Option<(std::os::unix::net::UnixDatagram, String)>,
    /// Processes of the tree whose end is told home from here: PID, pidfd.
    pub watched: Vec<(i32, OwnedFd)>,
    /// Those of them found stopped (group-stop) at the last look, and when that was: their
    /// stops and continues are told home too (the kernel tells only their parents).
    stopped: std::collections::HashSet<i32>,
    looked: Option<std::time::Instant>,
}

/// What a clone call needs once it has been let go: the PID its child is to get.
pub struct Pending {
    pub child: i32,
    parent: i32,
    caller: i32,
}

fn proc_exists(pid: i32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// Whether thread `tid` has a signal pending that it does not block (its own or its
/// process's), which makes the kernel give a fork up before it makes anything.
fn signal_pending(tid: i32) -> bool {
    use ferry_engine::procfs::{hex_field, status};
    let Ok(s) = status(tid) else {
        return false;
    };
    (hex_field(&s, "SigPnd") | hex_field(&s, "ShdPnd")) & !hex_field(&s, "SigBlk") != 0
}

/// State, parent and exit code (field 52, the wait status) of process `pid`, from its stat.
fn stat_of(pid: i32) -> Option<(char, i32, i32)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let f: Vec<&str> = s[s.rfind(')')? + 1..].split_whitespace().collect();
    // f[0] is field 3 (state); field N is f[N - 3].
    let state = f.first()?.chars().next()?;
    let ppid = f.get(1)?.parse().ok()?;
    let code = f.get(49).and_then(|c| c.parse().ok()).unwrap_or(0);
    Some((state, ppid, code))
}

impl Forks {
    pub fn new(report: Option<(std::os::unix::net::UnixDatagram, String)>) -> Forks {
        let last_pid = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/proc/sys/kernel/ns_last_pid")
            .map_err(|e| {
                log::warn!("guest init: open ns_last_pid: {e}: the body's forks will fail")
            })
            .ok();
        Forks {
            last_pid,
            report,
            watched: Vec::new(),
            stopped: Default::default(),
            looked: None,
        }
    }

    fn last_pid(&self) -> Option<i32> {
        let f = self.last_pid.as_ref()?;
        let mut buf = [0u8; 32];
        let n = f.read_at(&mut buf, 0).ok()?;
        std::str::from_utf8(&buf[..n]).ok()?.trim().parse().ok()
    }

    fn set_last_pid(&self, pid: i32) -> std::io::Result<()> {
        let f = self
            .last_pid
            .as_ref()
            .ok_or_else(|| std::io::Error::other("ns_last_pid could not be opened"))?;
        f.write_at(pid.to_string().as_bytes(), 0).map(|_| ())
    }

    /// Logs `text`, and has the node's daemon log it ("NS log TEXT" on the report socket): this
    /// init's own stderr is /dev/null.
    pub fn say(&self, text: &str) {
        log::warn!("guest init: {text}");
        if let Some((sock, ns)) = &self.report {
            let _ = sock.send(format!("{ns} log {text}").as_bytes());
        }
    }

    /// Tells home that process `pid` of the body ended with wait status `status` (its deputy
    /// ends the same way).
    fn tell_end(&self, pid: i32, status: i32) {
        if let Some((sock, ns)) = &self.report {
            let _ = sock.send(format!("{ns} {pid} {status}\n").as_bytes());
        }
    }

    /// Tells the daemon the tree's root has this parent, group and session at home now (they
    /// travel with the body's next move).
    pub fn tell_ids(&self, ppid: i32, pgid: i32, sid: i32) {
        if let Some((sock, ns)) = &self.report {
            let _ = sock.send(format!("{ns} ids {ppid} {pgid} {sid}\n").as_bytes());
        }
    }

    /// Gives the daemon one end of a socket pair ("NS watch" on the report socket) on which
    /// it tells this init the root's new identities at home ("I PPID PGID SID"); returns the
    /// other end. None without a daemon.
    pub fn watch_home(&self) -> Option<OwnedFd> {
        let (sock, ns) = self.report.as_ref()?;
        let (ours, theirs) = ferry_sys::sockets::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
        )
        .map_err(|e| log::warn!("guest init: make a socket pair to watch home: {e}"))
        .ok()?;
        ferry_sys::sockets::send(
            sock.as_raw_fd(),
            format!("{ns} watch\n").as_bytes(),
            None,
            &[theirs.as_raw_fd()],
            0,
        )
        .map_err(|e| log::warn!("guest init: ask the daemon to tell home's changes: {e}"))
        .ok()?;
        Some(ours)
    }

    /// Asks home, through the daemon, for the PID of a child of `parent`.
    fn ask_home(&self, parent: i32) -> Result<i32, String> {
        let text = self.ask(&format!("fork {parent}"))?;
        match text.split_at_checked(1) {
            Some(("P", pid)) => pid
                .trim()
                .parse::<i32>()
                .map_err(|_| format!("a bad answer {text:?}")),
            Some(("E", why)) => Err(why.to_string()),
            _ => Err("the daemon closed the question unanswered".into()),
        }
    }

    /// Asks the daemon `question` ("NS QUESTION" on the report socket, with one end of a
    /// socket pair for the answer) and returns its answer, waiting 45 s at most.
    pub fn ask(&self, question: &str) -> Result<String, String> {
        let (sock, ns) = self
            .report
            .as_ref()
            .ok_or("no daemon to ask (no report socket)")?;
        let (ours, theirs) = ferry_sys::sockets::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
        )
        .map_err(|e| format!("make a socket pair: {e}"))?;
        ferry_sys::sockets::send(
            sock.as_raw_fd(),
            format!("{ns} {question}\n").as_bytes(),
            None,
            &[theirs.as_raw_fd()],
            0,
        )
        .map_err(|e| format!("ask the daemon: {e}"))?;
        drop(theirs);
        match ferry_sys::ns::poll_in(&[ours.as_raw_fd()], ASK_MS) {
            Ok(r) if r[0] => {}
            Ok(_) => return Err(format!("no answer within {} s", ASK_MS / 1000)),
            Err(e) => return Err(format!("wait for the answer: {e}")),
        }
        let r = ferry_sys::sockets::recv(ours.as_raw_fd(), 4096, 0)
            .map_err(|e| format!("read the answer: {e}"))?;
        Ok(String::from_utf8_lossy(&r.data).into_owned())
    }

    /// Prepares clone call `n` (already known to be one of CLONES): `Ok(None)` lets a thread
    /// (or a call the kernel will fail) go on at once, `Ok(Some(p))` lets a process's go on once
    /// its PID is set (then [`Forks::made`]), `Err(errno)` fails it.
    pub fn prepare(
        &self,
        n: &ferry_sys::seccomp::Notif,
        listener: i32,
        tgid: Option<i32>,
    ) -> Result<Option<Pending>, i32> {
        let nr = n.nr as i64;
        let flags = if nr == libc::SYS_clone {
            n.args[0]
        } else if nr == libc::SYS_clone3 {
            // struct clone_args: flags first. One the kernel would refuse it refuses.
            let mut b = [0u8; 8];
            if n.args[1] < 8
                || !matches!(
                    ferry_sys::proc_mem::vm_read(n.pid, n.args[0], &mut b),
                    Ok(8)
                )
            {
                return Ok(None);
            }
            u64::from_ne_bytes(b)
        } else {
            0
        };
        if flags & libc::CLONE_THREAD as u64 != 0 {
            return Ok(None);
        }
        let Some(parent) = tgid else {
            return Err(libc::ESRCH);
        };
        for _ in 0..4 {
            let child = match self.ask_home(parent) {
                Ok(c) => c,
                Err(why) => {
                    self.say(&format!(
                        "PID {parent} forks, but home gave its child no PID: {why}; the call \
                         fails with EAGAIN"
                    ));
                    return Err(libc::EAGAIN);
                }
            };
            if child <= 1 || proc_exists(child) {
                // Taken here (a process of this namespace that is no longer one at home): that
                // deputy goes, and home is asked again.
                log::info!("guest init: PID {child} from home is taken here; asking again");
                self.tell_end(child, libc::SIGKILL);
                continue;
            }
            if let Err(e) = self.set_last_pid(child - 1) {
                self.say(&format!(
                    "PID {parent} forks: set ns_last_pid to {}: {e}; the call fails with EAGAIN",
                    child - 1
                ));
                self.tell_end(child, libc::SIGKILL);
                return Err(libc::EAGAIN);
            }
            if !ferry_sys::seccomp::id_valid(listener, n.id) {
                // The caller is gone, or was interrupted: its deputy goes too.
                self.tell_end(child, libc::SIGKILL);
                return Err(libc::EINTR);
            }
            return Ok(Some(Pending {
                child,
                parent,
                caller: n.pid,
            }));
        }
        self.say(&format!(
            "PID {parent} forks, but every PID home gave is taken here; the call fails with \
             EAGAIN"
        ));
        Err(libc::EAGAIN)
    }

    /// The call of `p` was let go: waits until the namespace handed out its PID (or the call
    /// failed, or its caller is gone), then watches the child; if it was not made, its deputy
    /// at home goes.
    pub fn made(&mut self, p: Pending) {
        let start = std::time::Instant::now();
        let before = p.child - 1;
        let mut nap = std::time::Duration::from_micros(50);
        // (A caller with a signal to take gives its fork up before making anything, and makes
        // it again once the signal is handled: a new notification.)
        while self.last_pid() == Some(before)
            && start.elapsed() < MADE_WITHIN
            && proc_exists(p.caller)
            && !signal_pending(p.caller)
        {
            std::thread::sleep(nap);
            nap = (nap * 2).min(std::time::Duration::from_millis(5));
        }
        let last = self.last_pid();
        if last != Some(p.child) {
            self.say(&format!(
                "the fork of PID {} made no PID {} (the namespace's last PID is {last:?}): its \
                 deputy at home goes",
                p.parent, p.child
            ));
            self.tell_end(p.child, libc::SIGKILL);
            return;
        }
        self.watch(p.child);
    }

    /// Watches process `pid` of the tree: its end goes home.
    pub fn watch(&mut self, pid: i32) {
        if self.watched.iter().any(|(w, _)| *w == pid) {
            return;
        }
        match ferry_sys::pidfd::pidfd_open(pid) {
            Ok(fd) => self.watched.push((pid, fd)),
            // Gone already (it ended and its parent reaped it): its status is lost.
            Err(_) => self.tell_end(pid, 0),
        }
    }

    /// Watches every process of the namespace but this init, the tree's `root` and the
    /// init's own children (whose ends the init reaps and reports).
    pub fn watch_tree(&mut self, root: i32) {
        let Ok(dir) = std::fs::read_dir("/proc") else {
            return;
        };
        let pids: Vec<i32> = dir
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .filter(|&p| p > 1 && p != root)
            .collect();
        for pid in pids {
            if stat_of(pid).is_some_and(|(_, ppid, _)| ppid > 1) {
                self.watch(pid);
            }
        }
    }

    /// Looks (at most five times a second) whether a watched process stopped or continued
    /// since the last look, and tells home (its deputy stops or continues the same way). A
    /// process of the body can only be stopped by SIGSTOP here (its group is orphaned in the
    /// body's namespace, so the kernel discards SIGTSTP, SIGTTIN and SIGTTOU), or by a stop
    /// signal from home delivered as SIGSTOP, which the daemon reports as the signal home sent:
    /// the stop is told as SIGSTOP's. A process stopped by a tracer (ferry capturing the body) is
    /// neither.
    pub fn look_for_stops(&mut self) {
        if self.watched.is_empty()
            || self
                .looked
                .is_some_and(|t| t.elapsed() < std::time::Duration::from_millis(200))
        {
            return;
        }
        self.looked = Some(std::time::Instant::now());
        let pids: Vec<i32> = self.watched.iter().map(|(p, _)| *p).collect();
        for pid in pids {
            let Some((state, _, _)) = stat_of(pid) else {
                continue;
            };
            let was = self.stopped.contains(&pid);
            match state {
                'T' if !was => {
                    self.stopped.insert(pid);
                    self.tell_end(pid, (libc::SIGSTOP << 8) | 0x7f);
                }
                't' | 'T' | 'Z' | 'X' => {}
                _ if was => {
                    self.stopped.remove(&pid);
                    self.tell_end(pid, 0xffff);
                }
                _ => {}
            }
        }
    }

    /// The init reaped (and reported) these: no longer watched.
    pub fn reaped(&mut self, pids: &[i32]) {
        self.watched.retain(|(w, _)| !pids.contains(w));
    }

    /// Watched process number `i` ended: its status goes home (unless it is the init's own
    /// child, which the init reaps and reports), and it is no longer watched.
    pub fn ended(&mut self, i: usize) {
        let (pid, fd) = self.watched.remove(i);
        self.stopped.remove(&pid);
        match stat_of(pid) {
            Some((_, 1, _)) => {}
            Some(('Z', _, status)) => self.tell_end(pid, status),
            Some(_) => {}
            // Reaped by its parent before we looked: the kernel keeps its status for the
            // pidfd (PIDFD_INFO_EXIT); on an older kernel it is lost.
            None => self.tell_end(pid, ferry_sys::pidfd::exit_status(&fd).unwrap_or(0)),
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn stat_reads_state_parent_and_exit_code() {
        let me = std::process::id() as i32;
        let (state, ppid, code) = super::stat_of(me).unwrap();
        assert!(state == 'R' || state == 'S', "{state}");
        assert_eq!(ppid, std::os::unix::process::parent_id() as i32);
        assert_eq!(code, 0);
    }
}
