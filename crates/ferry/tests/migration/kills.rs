//! Signals a moved process sends to processes at home (docs/syscalls.md, `kill`): its home
//! parent, a sibling of its shell job, its process group there, a process it may not signal,
//! one that does not exist. Each must do at home what it did before the move, and return the
//! same. And a group it makes in the body (`setpgid`) is made at home too.

use super::*;

/// The user the shell job runs as (no passwd entry needed).
const USER: u32 = 61011;

/// A sibling of the moved process in its shell job, at home: it takes SIGUSR1, SIGUSR2 (and
/// SIGTERM, which ends it) by sigwaitinfo and appends "SIGNO SENDER-PID SENDER-UID" to
/// DIR/sibsigs.
const SIBLING: &str = "import os,signal,sys\n\
d=sys.argv[1]\n\
s={signal.SIGUSR1,signal.SIGUSR2,signal.SIGTERM}\n\
signal.pthread_sigmask(signal.SIG_BLOCK,s)\n\
open(d+'/sib.tmp','w').write(str(os.getpid())); os.rename(d+'/sib.tmp',d+'/sib')\n\
while True:\n\
\x20   i=signal.sigwaitinfo(s)\n\
\x20   if i.si_signo==signal.SIGTERM: break\n\
\x20   open(d+'/sibsigs','a').write('%d %d %d\\n'%(i.si_signo,i.si_pid,i.si_uid))\n";

/// A non-root shell job at home (bash without job control, leading its own session and
/// group: the job's processes are in its group) of two processes: the sibling above and
/// `home_kills`, which is moved to b. Before the move and after it, `home_kills` signals its
/// parent (the shell's trap runs), the sibling (`kill`, `sigqueue`, `tgkill`: the sibling sees
/// the sender's home PID and uid), its process group (`kill(-pgrp)` and `kill(0)`: the shell,
/// the sibling and itself), a process of root's (EPERM) and no process (ESRCH), and itself (in
/// the body); every call returns the same moved as at home. Then it ends, and the shell's
/// `wait` sees its status. Prints what a forwarded `kill(ppid, 0)` costs. Moved, it then makes
/// itself a group leader: its deputy leads that group at home, `getpgrp` answers it, and
/// `kill(0)` reaches only itself.
pub(super) fn a_body_signals_processes_at_home() -> Result<(), Failed> {
    use std::os::unix::fs::PermissionsExt;
    let c = Cluster::up("kills", 2);
    let dir = scratch("migration", "kills");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let victim = victim_binary("home_kills");
    // A process of root's at home, which the job's user may not signal.
    let root_proc = UnixServer(
        Command::new("sleep")
            .arg("600")
            .stdin(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let script = "trap 'echo usr1 >> \"$1/trapped\"' USR1\n\
        python3 -c \"$3\" \"$1\" & s=$!\n\
        \"$2\" \"$1\" & v=$!\n\
        while :; do wait $v; st=$?; [ $st -ne 138 ] && break; done\n\
        echo $st > \"$1/status\"\n\
        kill -TERM $s; wait $s\n";
    let user = USER.to_string();
    let mut shell = UnixServer(
        Command::new("setpriv")
            .args(["--reuid", &user, "--regid", &user, "--clear-groups"])
            .args(["setsid", "bash", "-c", script, "shell"])
            .arg(&dir)
            .arg(&victim)
            .arg(SIBLING)
            .current_dir(&dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let sh = shell.0.id() as i32;
    let pid = pid_from(&dir.join("pid"), "home_kills")?;
    let sib = pid_from(&dir.join("sib"), "the sibling")?;
    let rootpid = root_proc.0.id() as i32;
    let max: i32 = std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let nopid = (max - 100..max)
        .rev()
        .find(|p| !Path::new(&format!("/proc/{p}")).exists())
        .ok_or("no free PID")?;
    let lines = |f: &str| -> Vec<String> {
        std::fs::read_to_string(dir.join(f))
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    };
    let run = |n: usize, cmd: &str| -> Result<String, Failed> {
        let tmp = dir.join("ask.tmp");
        std::fs::write(&tmp, cmd).unwrap();
        std::fs::rename(&tmp, dir.join(format!("ask{n}"))).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let prefix = format!("{n} ");
            if let Some(l) = lines("out").iter().find(|l| l.starts_with(&prefix)) {
                return Ok(l[prefix.len()..].to_string());
            }
            if Instant::now() > deadline {
                return Err(format!("no answer to {cmd:?}: {:?}", lines("out")).into());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    let grows = |f: &str, before: usize, what: &str| eventually(what, || lines(f).len() > before);
    let sib_saw = |before: usize, want: String, what: &str| -> Result<(), Failed> {
        grows("sibsigs", before, what)?;
        let got = lines("sibsigs")[before].clone();
        assert_eq!(got, want, "{what}: signal, sender's PID and uid");
        Ok(())
    };
    let usr = (libc::SIGUSR1, libc::SIGUSR2);
    let round = |n: usize, moved: &str| -> Result<Vec<String>, Failed> {
        let mut got = Vec::new();
        let (t, s, m) = (
            lines("trapped").len(),
            lines("sibsigs").len(),
            lines("sigs").len(),
        );
        got.push(run(n, &format!("kill ppid {}", usr.0))?);
        grows("trapped", t, &format!("{moved}: the shell's trap"))?;
        got.push(run(n + 1, &format!("kill {sib} {}", usr.1))?);
        sib_saw(
            s,
            format!("{} {pid} {USER}", usr.1),
            &format!("{moved}: kill"),
        )?;
        for (i, cmd) in ["killpg", "kill0"].into_iter().enumerate() {
            let (t, s, m) = (
                lines("trapped").len(),
                lines("sibsigs").len(),
                lines("sigs").len(),
            );
            got.push(run(n + 2 + i, &format!("{cmd} {}", usr.0))?);
            let what = format!("{moved}: {cmd}");
            grows("trapped", t, &format!("{what}: the shell"))?;
            sib_saw(s, format!("{} {pid} {USER}", usr.0), &what)?;
            grows("sigs", m, &format!("{what}: itself"))?;
        }
        // A queued signal (with a value) and a thread's: each reaches the sibling as itself.
        for (k, call, value) in [(4, "sigqueue", " 77"), (5, "tgkill", "")] {
            let s = lines("sibsigs").len();
            got.push(run(n + k, &format!("{call} {sib} {}{value}", usr.1))?);
            sib_saw(
                s,
                format!("{} {pid} {USER}", usr.1),
                &format!("{moved}: {call}"),
            )?;
        }
        got.push(run(n + 6, &format!("kill {rootpid} {}", libc::SIGTERM))?);
        got.push(run(n + 7, &format!("kill {nopid} 0"))?);
        let m2 = lines("sigs").len().max(m);
        got.push(run(n + 8, &format!("kill self {}", usr.0))?);
        grows("sigs", m2, &format!("{moved}: a signal to itself"))?;
        Ok(got)
    };
    let want: Vec<String> = [
        "0 0", "0 0", "0 0", "0 0", "0 0", "0 0", "-1 1", "-1 3", "0 0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let home = round(1, "at home")?;
    assert_eq!(home, want, "at home: rc and errno of each call");
    let cost_home = run(10, "loop ppid 2000")?;
    migrate(&c, "a", pid, "b").map_err(|e| format!("a -> b: {e}"))?;
    let moved = round(11, "moved")?;
    assert_eq!(moved, want, "moved to b: rc and errno of each call");
    assert!(pid_alive(rootpid), "root's process was signalled");
    let cost_moved = run(20, "loop ppid 2000")?;
    let cost_local = run(21, "loop self 2000")?;
    eprintln!(
        "kill(PID, 0), rc errno ns per call: its parent at home {cost_home}, moved (forwarded) \
         {cost_moved}; itself, moved (by the init, local) {cost_local}"
    );
    assert!(cost_moved.starts_with("0 0 "), "{cost_moved}");
    // What it costs its home: every forwarded kill is a call its deputy made there.
    let o = c.run("a", &["top", "--once", "--json"]);
    assert!(
        o.status.success(),
        "top: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout)?;
    let calls = v["processes"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["home_pid"] == pid as i64))
        .map(|p| p["cost"]["calls_forwarded"].clone())
        .ok_or_else(|| format!("PID {pid} not in top: {v:#}"))?;
    assert!(
        calls.as_u64().is_some_and(|n| n >= 2000),
        "calls its deputy made at home: {calls} (2000 kills at least were forwarded)"
    );
    assert!(cost_local.starts_with("0 0 "), "{cost_local}");
    // Its own process group, made in the body: made at home too (the deputy leads it there),
    // and getpgrp answers it; its session stays the shell's. A signal to its group now
    // reaches only itself, not the shell or the sibling.
    assert_eq!(run(22, "setpgid 0 0")?, "0 0", "setpgid(0, 0) moved");
    let pgid_home = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .unwrap()
        .rsplit(')')
        .next()
        .unwrap()
        .split_whitespace()
        .nth(2)
        .unwrap()
        .parse::<i32>()
        .unwrap();
    assert_eq!(
        pgid_home, pid,
        "the deputy's group at home after setpgid in the body"
    );
    assert_eq!(run(23, "getpgrp")?, format!("{pid} 0"), "getpgrp moved");
    assert_eq!(run(24, "getsid")?, format!("{sh} 0"), "getsid moved");
    let (t, s, m) = (
        lines("trapped").len(),
        lines("sibsigs").len(),
        lines("sigs").len(),
    );
    assert_eq!(run(25, &format!("kill0 {}", usr.0))?, "0 0");
    grows("sigs", m, "kill(0) in its own group: itself")?;
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        lines("trapped").len(),
        t,
        "kill(0) in its own group reached the shell"
    );
    assert_eq!(
        lines("sibsigs").len(),
        s,
        "kill(0) in its own group reached the sibling"
    );
    // A group leader may not make a session: the home's kernel says so.
    assert_eq!(
        run(26, "setsid")?,
        "-1 1",
        "setsid of a group leader, moved"
    );
    let status = job_done(&mut shell, &dir, 20)?;
    assert_eq!(status.trim(), "3", "what the shell's wait got");
    Ok(())
}

/// Tells the job of `shell` in `dir` it is done (the file `done`), waits up to `secs` for
/// the shell to end, and returns what the shell's `wait` got for it (the file `status`).
pub(super) fn job_done(shell: &mut UnixServer, dir: &Path, secs: u64) -> Result<String, Failed> {
    std::fs::write(dir.join("done"), "").unwrap();
    let deadline = Instant::now() + Duration::from_secs(secs);
    while shell.0.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            return Err("the shell never saw its job end".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(std::fs::read_to_string(dir.join("status")).unwrap_or_default())
}

/// `home_kills`, writing in `dir`, run by a shell at home (`"$1" "$2" & wait`) in `dir`: the
/// shell is killed and reaped when dropped.
fn home_kills_shell(dir: &Path) -> UnixServer {
    UnixServer(
        common::bash("\"$1\" \"$2\" & wait", "shell")
            .arg(victim_binary("home_kills"))
            .arg(dir)
            .current_dir(dir)
            .spawn()
            .unwrap(),
    )
}

/// `home_kills` run by a shell at home (as root), moved to b; then the shell is killed, and
/// the deputy reparented at home (to init, or a subreaper): the body's `getppid` follows,
/// answering its new parent at home, as it would have had it never left. Then it drops its
/// uids over there: its signals to home are refused (EPERM, and b's log says why).
pub(super) fn a_body_follows_its_home_parents_death() -> Result<(), Failed> {
    use std::os::unix::fs::PermissionsExt;
    let c = Cluster::up("homeparent", 2);
    let dir = scratch("migration", "homeparent");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let mut shell = home_kills_shell(&dir);
    let sh = shell.0.id() as i32;
    let pid = pid_from(&dir.join("pid"), "home_kills")?;
    let n = std::cell::Cell::new(0usize);
    let run = |cmd: &str| -> Result<String, Failed> {
        n.set(n.get() + 1);
        let n = n.get();
        let tmp = dir.join("ask.tmp");
        std::fs::write(&tmp, cmd).unwrap();
        std::fs::rename(&tmp, dir.join(format!("ask{n}"))).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        let prefix = format!("{n} ");
        loop {
            let out = std::fs::read_to_string(dir.join("out")).unwrap_or_default();
            if let Some(l) = out.lines().find(|l| l.starts_with(&prefix)) {
                return Ok(l[prefix.len()..].to_string());
            }
            if Instant::now() > deadline {
                return Err(format!("no answer to {cmd:?}: {out:?}").into());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    migrate(&c, "a", pid, "b").map_err(|e| format!("a -> b: {e}"))?;
    assert_eq!(run("getppid")?, format!("{sh} 0"), "getppid moved");
    shell.0.kill().unwrap();
    shell.0.wait().unwrap();
    eventually("the deputy reparented at home", || {
        let parent = ppid_here(pid);
        parent != sh && parent != 0
    })?;
    let parent = ppid_here(pid);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let got = run("getppid")?;
        if got == format!("{parent} 0") {
            break;
        }
        if Instant::now() > deadline {
            return Err(format!(
                "the body's getppid says {got:?}, its deputy's parent at home is {parent}"
            )
            .into());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    // Its uids changed in the body (a root dropping them after the move): its deputy at home
    // keeps those it left with, and a signal to home is refused (EPERM), never sent with them.
    // (Its answers go on to a file it made as root.)
    std::fs::set_permissions(dir.join("out"), std::fs::Permissions::from_mode(0o666)).unwrap();
    assert_eq!(run("setuid 61012")?, "0 0", "setresuid moved");
    assert_eq!(
        run("kill ppid 0")?,
        "-1 1",
        "kill(ppid) with other uids than its deputy's"
    );
    eventually("b's log says why", || {
        c.log("b").contains("body-call-refused") && c.log("b").contains("is not followed")
    })?;
    std::fs::write(dir.join("done"), "").unwrap();
    eventually("the body's end", || !pid_alive(pid))?;
    Ok(())
}

/// Runs `home_kills`'s commands (its `askN` files, its `out` lines).
struct Asker {
    dir: PathBuf,
    n: std::cell::Cell<usize>,
}

impl Asker {
    fn run(&self, cmd: &str) -> Result<String, Failed> {
        self.n.set(self.n.get() + 1);
        let n = self.n.get();
        let tmp = self.dir.join("ask.tmp");
        std::fs::write(&tmp, cmd).unwrap();
        std::fs::rename(&tmp, self.dir.join(format!("ask{n}"))).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        let prefix = format!("{n} ");
        loop {
            let out = std::fs::read_to_string(self.dir.join("out")).unwrap_or_default();
            if let Some(l) = out.lines().find(|l| l.starts_with(&prefix)) {
                return Ok(l[prefix.len()..].to_string());
            }
            if Instant::now() > deadline {
                return Err(format!("no answer to {cmd:?}: {out:?}").into());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// The state letter of process `pid` at home ('?' if it is gone).
fn state_here(pid: i32) -> char {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit(')')
                .next()?
                .split_whitespace()
                .next()?
                .chars()
                .next()
        })
        .unwrap_or('?')
}

/// A child `home_kills` forks after its move to b is stopped there by SIGSTOP (from its
/// parent, in the body): its deputy at home stops too (held in its stop by the deputies'
/// tracer), and continues with it on SIGCONT; killed, its deputy ends.
pub(super) fn a_forked_childs_stop_and_continue_show_at_home() -> Result<(), Failed> {
    let c = Cluster::up("childstop", 2);
    let dir = scratch("migration", "childstop");
    let _shell = home_kills_shell(&dir);
    let pid = pid_from(&dir.join("pid"), "home_kills")?;
    migrate(&c, "a", pid, "b").map_err(|e| format!("a -> b: {e}"))?;
    let a = Asker {
        dir: dir.clone(),
        n: Default::default(),
    };
    let out = a.run("fork")?;
    let child: i32 = out
        .split_whitespace()
        .next()
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("fork: {out:?}"))?;
    assert!(child > 0, "fork: {out:?}");
    eventually("the child's deputy at home", || ppid_here(child) == pid)?;
    assert_eq!(state_here(child), 'S', "the child's deputy, parked");
    assert_eq!(a.run(&format!("kill {child} {}", libc::SIGSTOP))?, "0 0");
    let stopped = || matches!(state_here(child), 'T' | 't');
    eventually("the child's deputy stopped at home", stopped)?;
    std::thread::sleep(Duration::from_millis(600));
    assert!(
        stopped(),
        "the child's deputy at home: {}",
        state_here(child)
    );
    assert_eq!(a.run(&format!("kill {child} {}", libc::SIGCONT))?, "0 0");
    eventually("the child's deputy continued at home", || {
        matches!(state_here(child), 'S' | 'R')
    })?;
    assert_eq!(a.run(&format!("kill {child} {}", libc::SIGKILL))?, "0 0");
    eventually("the child's deputy gone", || state_here(child) == '?')?;
    std::fs::write(dir.join("done"), "").unwrap();
    eventually("the body's end", || !pid_alive(pid))?;
    Ok(())
}
