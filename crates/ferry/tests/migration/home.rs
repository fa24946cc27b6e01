//! What the home keeps (the deputy): a shell's wait, a parent's view of stop, continue and
//! exit, a body lost with its node, a job under a real terminal, the home's identities, a
//! supervisor's death, a job brought home, fork after the move (the child's deputy at home,
//! moving on and coming home with it, a fork without its home), a raw terminal.

use super::*;

/// A shell's background job, moved to another node while it runs: the shell's `wait` gets its
/// exact exit code (the deputy at home ends as the body did), and a signal sent to its PID at
/// home reaches it over there, with the shell seeing the death by that signal. The shell, its
/// job table and `wait` are bash's own, untouched.
pub(super) fn shell_waits_for_moved_child() -> Result<(), Failed> {
    let c = Cluster::up("shell", 2);
    let dir = scratch("migration", "shell");
    let mut shell = JobShell::start(&dir);
    let job_pid = |k: &str| shell.job_pid(k);
    let counting = |k: &str, what: &str| shell.counting(k, what);

    // 1. Moved, then told to finish: the shell sees its exit code, 7.
    let pid = job_pid("exit")?;
    let r = migrate(&c, "a", pid, "b").map_err(|e| format!("a -> b: {e}"))?;
    let body = r["dest_pid"].as_i64().ok_or("no dest_pid")? as i32;
    let body = c.host_pid("b", body).ok_or("the body is not on b")?;
    assert_ne!(
        common::run::tracer_of(pid),
        0,
        "PID {pid} at home is not a deputy"
    );
    counting("exit", "after the move")?;
    let ppid = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .unwrap()
        .rsplit(')')
        .next()
        .unwrap()
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<u32>()
        .unwrap();
    assert_eq!(
        ppid,
        shell.pid(),
        "the deputy is no longer the shell's child"
    );
    std::fs::write(dir.join("exit").join("go"), "").unwrap();

    // 2. Moved, then signalled at home: the shell sees the job killed by SIGTERM (143). (Not
    // SIGINT: a non-interactive shell starts its background jobs with SIGINT ignored.)
    let pid = job_pid("signal")?;
    let r = migrate(&c, "a", pid, "b").map_err(|e| format!("a -> b: {e}"))?;
    let body2 = r["dest_pid"].as_i64().ok_or("no dest_pid")? as i32;
    let body2 = c.host_pid("b", body2).ok_or("the body is not on b")?;
    counting("signal", "after the move")?;
    let st = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    assert!(st.success());

    shell.saw_exit_7_then_sigterm()?;
    assert!(
        !pid_alive(body) && !pid_alive(body2),
        "a body outlived its job"
    );
    Ok(())
}

/// A non-interactive bash running two Python jobs in turn, `exit` then `signal`, each in a
/// directory of its own under `dir`: a job writes its PID, then counts in a file; on `go` it
/// exits with 7. The shell appends each job's status (`wait`) to `dir/statuses`.
struct JobShell {
    dir: PathBuf,
    shell: UnixServer,
}

impl JobShell {
    fn start(dir: &Path) -> JobShell {
        let job = "import os,sys,time\n\
            d=sys.argv[1]\n\
            open(d+'/pid.tmp','w').write(str(os.getpid())); os.rename(d+'/pid.tmp', d+'/pid')\n\
            n=0\n\
            while not os.path.exists(d+'/go'):\n\
            \x20   n+=1; open(d+'/count','w').write(str(n)); time.sleep(0.02)\n\
            sys.exit(7)\n";
        let script = "for k in exit signal; do mkdir -p \"$1/$k\"; python3 -c \"$2\" \"$1/$k\" & \
             wait $!; echo \"$k $?\" >> \"$1/statuses\"; done";
        let shell = UnixServer(
            common::bash(script, "shell")
                .arg(dir)
                .arg(job)
                .spawn()
                .unwrap(),
        );
        JobShell {
            dir: dir.to_owned(),
            shell,
        }
    }

    fn pid(&self) -> u32 {
        self.shell.0.id()
    }

    fn job_pid(&self, k: &str) -> Result<i32, Failed> {
        pid_from(&self.dir.join(k).join("pid"), &format!("job {k}"))
    }

    /// Fails unless job `k` counts on (5 more) within 10 s.
    fn counting(&self, k: &str, what: &str) -> Result<(), Failed> {
        let count = || -> u64 {
            std::fs::read_to_string(self.dir.join(k).join("count"))
                .ok()
                .and_then(|s| s.trim().parse().ok())
                .unwrap_or(0)
        };
        let start = count();
        let deadline = Instant::now() + Duration::from_secs(10);
        while count() < start + 5 {
            if Instant::now() > deadline {
                return Err(format!("{what}: job {k} stopped counting").into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// Waits (15 s) for the shell to end, and checks that its `wait` saw the first job exit
    /// with 7 and the second killed by SIGTERM (143).
    fn saw_exit_7_then_sigterm(&mut self) -> Result<(), Failed> {
        let deadline = Instant::now() + Duration::from_secs(15);
        let status = loop {
            if let Some(st) = self.shell.0.try_wait().unwrap() {
                break st;
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "the shell never saw its jobs end: {:?}",
                    std::fs::read_to_string(self.dir.join("statuses"))
                )
                .into());
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(status.success(), "{status:?}");
        let statuses = std::fs::read_to_string(self.dir.join("statuses")).unwrap();
        assert_eq!(statuses, "exit 7\nsignal 143\n", "what the shell saw");
        Ok(())
    }
}

/// The terminal the job runs in: an interactive bash under a pty that a Python driver holds
/// (a terminal Ferry did not make). See `shell_job_under_a_terminal`.
pub(super) const TERMINAL_DRIVER: &str = r#"
import os, sys, time, select, subprocess, fcntl, termios
d, job = sys.argv[1], sys.argv[2]
m, s = os.openpty()
def pre():
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
env = dict(os.environ, PS1='$ ', TERM='dumb', HISTFILE='/dev/null')
p = subprocess.Popen(['bash', '--norc', '--noprofile', '-i'], stdin=s, stdout=s, stderr=s,
                     preexec_fn=pre, env=env, close_fds=True)
os.close(s)
screen = b''
def pump(t):
    global screen
    end = time.time() + t
    while time.time() < end:
        r, _, _ = select.select([m], [], [], 0.05)
        if r:
            try:
                b = os.read(m, 65536)
            except OSError:
                return
            screen += b
            open(d + '/screen', 'wb').write(screen)
def until(pat, since=0, t=20):
    end = time.time() + t
    while time.time() < end:
        if pat in screen[since:]:
            return
        pump(0.1)
    sys.exit('timed out waiting for %r' % pat)
def typ(b):
    os.write(m, b)
pump(0.5)
typ(b'python3 ' + job.encode() + b' ' + d.encode() + b'\n')
until(b'tick 3')
while not os.path.exists(d + '/moved'):
    pump(0.1)
until(b'tick', since=len(screen))
typ(b'hello from home\n')
end = time.time() + 20
def typed():
    try:
        return b'hello from home' in open(d + '/input', 'rb').read()
    except OSError:
        return False
while not typed():
    pump(0.1)
    if time.time() > end:
        sys.exit('the moved job never read the line typed at home')
typ(b'\x1a')
until(b'Stopped')
typ(b'echo status=$?\n')
until(b'status=148')
mark = len(screen)
typ(b'fg\n')
until(b'tick', since=mark + 10)
mark = len(screen)
typ(b'\x03')
# Input typed while the moved job has the terminal goes to the job (see docs/limitations.md):
# wait for the shell's prompt.
until(b'$ ', since=mark)
mark = len(screen)
typ(b'echo status=$?\n')
until(b'status=130', since=mark)
typ(b'exit\n')
p.wait(10)
"#;

/// The job: prints a tick every 0.2 s, and appends every line it reads to `input`.
pub(super) const TERMINAL_JOB: &str = r#"
import os, sys, time, threading, signal
d = sys.argv[1]
signal.signal(signal.SIGINT, signal.SIG_DFL)
open(d + '/pid.tmp', 'w').write(str(os.getpid()))
os.rename(d + '/pid.tmp', d + '/pid')
def rd():
    for l in sys.stdin:
        with open(d + '/input', 'a') as f:
            f.write(l)
threading.Thread(target=rd, daemon=True).start()
i = 0
while True:
    i += 1
    print('tick', i, flush=True)
    time.sleep(0.2)
"#;

/// Runs `driver` (a Python program holding a pty with an interactive bash, see
/// `TERMINAL_DRIVER`) with job `job` in `dir`, moves the job (it writes `dir/pid`) from a to b,
/// tells the driver (`dir/moved`), and returns how the driver ended (killed after `limit`).
pub(super) fn drive_terminal_job(
    c: &Cluster,
    dir: &Path,
    driver: &str,
    job: &str,
    limit: Duration,
) -> Result<std::process::ExitStatus, Failed> {
    drive_terminal_job_via(c, dir, driver, job, &[("a", "b")], limit)
}

/// [`drive_terminal_job`], the job moved along `hops` (each from the node named first, run
/// there); before each hop but the first the driver is told `dir/moving` (a driver that
/// answers `dir/moving-seen` is waited for, so that what it does then comes before the hop). A destination named
/// `!NODE` refuses the job first (`accept never`: the move fails after its node has paused its
/// relays), then takes it.
pub(super) fn drive_terminal_job_via(
    c: &Cluster,
    dir: &Path,
    driver: &str,
    job: &str,
    hops: &[(&str, &str)],
    limit: Duration,
) -> Result<std::process::ExitStatus, Failed> {
    let job_path = dir.join("job.py");
    std::fs::write(&job_path, job).unwrap();
    let driver_text = driver;
    let mut driver = UnixServer(
        Command::new("python3")
            .args(["-c", driver])
            .arg(dir)
            .arg(&job_path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("driver.err")).unwrap())
            .spawn()
            .unwrap(),
    );
    let acks = driver_text.contains("moving-seen");
    let pid = pid_from(&dir.join("pid"), "the job")?;
    let mut moved = Ok(serde_json::Value::Null);
    for (i, (from, to)) in hops.iter().enumerate() {
        if i > 0 {
            std::fs::write(dir.join("moving"), "").unwrap();
            if acks {
                pid_from(
                    &dir.join("moving-seen"),
                    "the driver's typing before the move",
                )?;
            }
        }
        let to = match to.strip_prefix('!') {
            Some(to) => {
                assert!(c.run(to, &["accept", "never"]).status.success());
                let refused = migrate(c, from, pid, to);
                assert!(c.run(to, &["accept", "always"]).status.success());
                if let Ok(r) = refused {
                    return Err(format!("{from} -> {to} was not refused: {r}").into());
                }
                to
            }
            None => to,
        };
        moved = migrate(c, from, pid, to).map_err(|e| format!("{from} -> {to}: {e}"));
        if moved.is_err() {
            break;
        }
    }
    std::fs::write(dir.join("moved"), "").unwrap();
    moved.map_err(|e| format!("the job did not move: {e}"))?;
    let deadline = Instant::now() + limit;
    Ok(loop {
        if let Some(st) = driver.0.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > deadline {
            let _ = driver.0.kill();
            break driver.0.wait().unwrap();
        }
        std::thread::sleep(Duration::from_millis(50));
    })
}

/// A job started from an interactive shell under a terminal Ferry did not make moves while it
/// runs: its output still reaches that terminal, a line typed there reaches it, ^Z stops it
/// (the shell says Stopped, status 148), `fg` resumes it, ^C ends it (status 130).
pub(super) fn shell_job_under_a_terminal() -> Result<(), Failed> {
    let c = Cluster::up("terminal", 2);
    let dir = scratch("migration", "terminal");
    let st = drive_terminal_job(
        &c,
        &dir,
        TERMINAL_DRIVER,
        TERMINAL_JOB,
        Duration::from_secs(90),
    )?;
    if !st.success() {
        return Err(format!(
            "{}\nthe terminal showed:\n{}\n{}",
            std::fs::read_to_string(dir.join("driver.err")).unwrap_or_default(),
            String::from_utf8_lossy(&std::fs::read(dir.join("screen")).unwrap_or_default()),
            c.log("a") + &c.log("b")
        )
        .into());
    }
    Ok(())
}

/// A parent that waits with WUNTRACED and WCONTINUED for a child that has moved: SIGTSTP and
/// SIGCONT sent to the child's PID at home stop and continue its body over there, and the
/// parent sees the stop (by SIGTSTP), the continue and the exit code, in that order, as if the
/// child had never left.
pub(super) fn parent_sees_stop_continue_exit() -> Result<(), Failed> {
    let c = Cluster::up("jobctl", 2);
    let dir = scratch("migration", "jobctl");
    let mut p = UnixServer(
        Command::new("python3")
            .args(["-c", JOBCTL_PARENT])
            .arg(&dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let pid = pid_from(&dir.join("pid"), "the child")?;
    let r = migrate(&c, "a", pid, "b").map_err(|e| format!("a -> b: {e}"))?;
    let body = r["dest_pid"].as_i64().ok_or("no dest_pid")? as i32;
    let body = c.host_pid("b", body).ok_or("the body is not on b")?;
    let events = || std::fs::read_to_string(dir.join("events")).unwrap_or_default();
    let wait_events = |want: &str, what: &str| -> Result<(), Failed> {
        let deadline = Instant::now() + Duration::from_secs(10);
        while events() != want {
            if Instant::now() > deadline {
                return Err(format!("{what}: the parent saw {:?}, not {want:?}", events()).into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    };
    let kill = |sig: &str| {
        assert!(Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .unwrap()
            .success())
    };
    kill("-TSTP");
    wait_events("stopped 20\n", "after SIGTSTP at home")?;
    assert_eq!(proc_state_of(body), Some('T'), "the body did not stop");
    kill("-CONT");
    wait_events("stopped 20\ncontinued\n", "after SIGCONT at home")?;
    std::fs::write(dir.join("go"), "").unwrap();
    wait_events("stopped 20\ncontinued\nexited 3\n", "after the end")?;
    let st = p.0.wait().unwrap();
    assert!(st.success(), "the parent failed: {st:?}");
    Ok(())
}

/// A parent (argv[1]: a directory) leading a session of its own, that forks a child (in a
/// process group of its own, which is therefore not orphaned: the kernel discards SIGTSTP sent
/// to an orphaned group) waiting for `DIR/go` to exit with 3,
/// writes its PID in `DIR/pid`, and appends every change `waitpid(WUNTRACED | WCONTINUED)`
/// reports to `DIR/events`.
pub(super) const JOBCTL_PARENT: &str = r#"import os,sys
d=sys.argv[1]
os.setsid()
pid=os.fork()
if pid==0:
    os.setpgid(0,0)
    os.execvp('python3',['python3','-c','import os,sys,time\nwhile not os.path.exists(sys.argv[1]+"/go"): time.sleep(0.02)\nsys.exit(3)',d])
open(d+'/pid.tmp','w').write(str(pid)); os.rename(d+'/pid.tmp',d+'/pid')
while True:
    p,st=os.waitpid(pid,os.WUNTRACED|os.WCONTINUED)
    if os.WIFSTOPPED(st): ev='stopped %d'%os.WSTOPSIG(st)
    elif os.WIFCONTINUED(st): ev='continued'
    elif os.WIFEXITED(st): ev='exited %d'%os.WEXITSTATUS(st)
    else: ev='signaled %d'%os.WTERMSIG(st)
    open(d+'/events','a').write(ev+'\n')
    if not (os.WIFSTOPPED(st) or os.WIFCONTINUED(st)): break
"#;

/// The node running a body dies (its whole machine: the node's init and everything in its
/// namespaces): once the membership declares it dead, the deputy at home ends as a process
/// killed by SIGKILL, and its parent sees exactly that. Nothing waits forever.
pub(super) fn body_lost_with_its_node() -> Result<(), Failed> {
    let c = Cluster::up("bodylost", 2);
    let dir = scratch("migration", "bodylost");
    let mut t = Ticker::start(&dir, 4);
    let home = t.pid();
    migrate(&c, "a", home, "b").map_err(|e| format!("a -> b: {e}"))?;
    assert_ne!(common::run::tracer_of(home), 0, "no deputy at home");
    let init = c
        .init_pid("b")
        .ok_or("node b has no init of its own (not a separate node)")?;
    kill_host_pid(init as i64);
    let st = t
        .wait_end(Duration::from_secs(60))
        .ok_or("the deputy outlived its body's node")?;
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(st.signal(), Some(libc::SIGKILL), "{st:?}");
    Ok(())
}

/// A program started by a shell at home (its parent; its group and session those of the
/// shell) prints its parent, group, session and host name, and the errno its own seccomp filter
/// gives: moved to b and back (in guest namespaces of its own both times), it prints exactly
/// what it printed at home, its own filter still acting; and the shell's `wait` gets its exit
/// code. Ferry's filter is not its own: moving it on from b (a capture of it) keeps its filter
/// and leaves Ferry's out. `ferry ps` counts the calls its supervisor answered. A signal
/// queued to it at home (sigqueue) reaches the body with its si_code and value.
pub(super) fn keeps_home_identities() -> Result<(), Failed> {
    let c = Cluster::up("homeids", 2);
    let dir = scratch("migration", "homeids");
    let victim = victim_binary("home_ids");
    let mut shell = UnixServer(
        Command::new("setsid")
            .args([
                "bash",
                "-c",
                "\"$1\" \"$2\" & wait $!; echo $? > \"$2/status\"",
                "shell",
            ])
            .arg(&victim)
            .arg(&dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let sh = shell.0.id() as i32;
    let pid = pid_from(&dir.join("pid"), "home_ids")?;
    let ask = |n: usize| -> Result<String, Failed> {
        std::fs::write(dir.join(format!("ask{n}")), "").unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let ids = std::fs::read_to_string(dir.join("ids")).unwrap_or_default();
            if let Some(l) = ids.lines().find(|l| l.starts_with(&format!("{n} "))) {
                return Ok(l.split_once(' ').unwrap().1.to_string());
            }
            if Instant::now() > deadline {
                return Err(format!("no answer {n}: {ids:?}").into());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    // `kill -q V -USR1 PID` (sigqueue) from a process at home: the handler sees SI_QUEUE and
    // the value, at home and moved alike; the sender's PID at home (moved: 0, which the kernel
    // gives a sender outside the body's PID namespace: docs/limitations.md).
    let sigqueue = |value: i32, moved: bool| -> Result<(), Failed> {
        let sent = std::fs::read_to_string(dir.join("sigs")).unwrap_or_default();
        let mut kill = Command::new("/usr/bin/kill")
            .args(["-s", "USR1", "-q", &value.to_string(), &pid.to_string()])
            .spawn()
            .unwrap();
        let sender = kill.id() as i32;
        assert!(kill.wait().unwrap().success());
        let want = format!("{} {} {value}", -1, if moved { 0 } else { sender });
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let sigs = std::fs::read_to_string(dir.join("sigs")).unwrap_or_default();
            if let Some(got) = sigs.strip_prefix(&sent).and_then(|s| s.lines().next()) {
                assert_eq!(got, want, "si_code, si_pid, si_value (SI_QUEUE is -1)");
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("signal {value} never arrived: {sigs:?}").into());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    sigqueue(41, false)?;
    let home = ask(1)?;
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    assert_eq!(
        home,
        format!(
            "ppid={sh} pgrp={sh} pgid={sh} sid={sh} sid_self={sh} host={} own=13",
            host.trim()
        ),
        "at home"
    );
    migrate(&c, "a", pid, "b").map_err(|e| format!("a -> b: {e}"))?;
    let on_b = ask(2)?;
    sigqueue(42, true)?;
    // What it cost, in `ferry ps`: the five calls of its answer went to its supervisor (the
    // count reaches the daemon within a second or so).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let row = guest(&c, "a", pid).ok_or("the body is not in ferry ps")?;
        let calls = row["forwarded_calls"].as_u64().unwrap_or(0);
        if calls >= 5 {
            assert!(calls < 100, "{row}");
            assert_eq!(row["node"], "b", "{row}");
            break;
        }
        if Instant::now() > deadline {
            return Err(format!("ferry ps never counted its forwarded calls: {row}").into());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    migrate(&c, "b", pid, "a").map_err(|e| format!("b -> a: {e}"))?;
    let back = ask(3)?;
    assert_eq!(on_b, home, "on b");
    assert_eq!(back, home, "back on a");
    let status = job_done(&mut shell, &dir, 10)?;
    assert_eq!(status.trim(), "5", "what the shell's wait got");
    Ok(())
}

/// The guest init on b (the body's supervisor: it answers its forwarded calls and reports its
/// end) is killed: the kernel kills the body with it, and b tells the home, whose deputy ends
/// as SIGKILL for its parent. Nothing waits forever.
pub(super) fn supervisor_dies() -> Result<(), Failed> {
    let c = Cluster::up("supdies", 2);
    let dir = scratch("migration", "supdies");
    let mut t = Ticker::start(&dir, 4);
    let home = t.pid();
    let r = migrate(&c, "a", home, "b").map_err(|e| format!("a -> b: {e}"))?;
    let body = r["dest_pid"].as_i64().ok_or("no dest_pid")? as i32;
    let body = c.host_pid("b", body).ok_or("the body is not on b")?;
    let init = common::parent_pid(body).ok_or("the body has no parent")?;
    assert!(
        common::is_guest_init(init),
        "the body's parent {init} is no guest init"
    );
    kill_host_pid(init as i64);
    let st = t
        .wait_end(Duration::from_secs(15))
        .ok_or("the deputy outlived its body's supervisor")?;
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(st.signal(), Some(libc::SIGKILL), "{st:?}");
    Ok(())
}

/// The PID a victim wrote to `path` (atomically, by rename), waiting up to 10 s for it.
pub(super) fn pid_from(path: &Path, what: &str) -> Result<i32, Failed> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(p) = std::fs::read_to_string(path)
            .ok()
            .and_then(|s| s.parse().ok())
        {
            return Ok(p);
        }
        if Instant::now() > deadline {
            return Err(format!("{what} did not start").into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A shell's background jobs, each moved a -> b and brought back to a: at home again each is
/// the ordinary process under its own PID (no deputy, no tracer, no Ferry filter, in this
/// machine's own PID namespace, no longer a guest in `ferry ps`), still the shell's child, and
/// still counting. The shell's `wait` then gets the first one's exit code (7) from the process
/// itself, and `kill -TERM PID` at home ends the second (143).
pub(super) fn job_brought_home() -> Result<(), Failed> {
    let c = Cluster::up("home", 2);
    let dir = scratch("migration", "home");
    let mut shell = JobShell::start(&dir);
    let counting = |k: &str, what: &str| shell.counting(k, what);
    let status_field = |pid: i32, key: &str| -> String {
        std::fs::read_to_string(format!("/proc/{pid}/status"))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix(key).map(|v| v.trim().to_string()))
            .unwrap_or_default()
    };
    let ppid_of = |pid: i32| -> i32 { status_field(pid, "PPid:").parse().unwrap_or(0) };
    for k in ["exit", "signal"] {
        let pid = shell.job_pid(k)?;
        migrate(&c, "a", pid, "b").map_err(|e| format!("{k}: a -> b: {e}"))?;
        assert_ne!(common::run::tracer_of(pid), 0, "{k}: no deputy at home");
        counting(k, "on b")?;
        let r = migrate(&c, "b", pid, "a").map_err(|e| format!("{k}: b -> a: {e}"))?;
        assert_eq!(r["dest_pid"].as_i64(), Some(pid as i64), "{k}: {r}");
        // Home again: the process itself, under its PID, in this machine's namespaces.
        assert!(pid_alive(pid), "{k}: PID {pid} is gone at home");
        assert_eq!(
            common::run::tracer_of(pid),
            0,
            "{k}: PID {pid} is still traced (a deputy)"
        );
        assert_eq!(
            std::fs::read_link(format!("/proc/{pid}/ns/pid")).ok(),
            std::fs::read_link("/proc/self/ns/pid").ok(),
            "{k}: PID {pid} runs in a PID namespace of its own"
        );
        assert_eq!(status_field(pid, "Seccomp:"), "0", "{k}: a filter is left");
        assert_eq!(
            ppid_of(pid),
            shell.pid() as i32,
            "{k}: not the shell's child"
        );
        assert!(
            guest(&c, "a", pid).is_none(),
            "{k}: still listed as a guest"
        );
        assert!(guest(&c, "b", pid).is_none(), "{k}: still listed on b");
        counting(k, "back home")?;
        if k == "exit" {
            std::fs::write(dir.join(k).join("go"), "").unwrap();
        } else {
            let st = Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status()
                .unwrap();
            assert!(st.success());
        }
    }
    shell.saw_exit_7_then_sigterm()?;
    Ok(())
}

/// A process forks after it moved: the child sees what a child forked at home would: its
/// parent is the parent's home PID, its process group and session are the parent's home ones,
/// and the parent's `wait` gets its exit status (its deputy at home: the trials below).
pub(super) fn fork_after_move() -> Result<(), Failed> {
    let c = Cluster::up("forked", 2);
    let dir = scratch("migration", "forked");
    let prog = "import os,sys,time\n\
        d=sys.argv[1]\n\
        def ids(): return '%d %d %d %d' % (os.getpid(), os.getppid(), os.getpgrp(), os.getsid(0))\n\
        open(d+'/home','w').write(ids())\n\
        open(d+'/pid.tmp','w').write(str(os.getpid())); os.rename(d+'/pid.tmp', d+'/pid')\n\
        while not os.path.exists(d+'/fork'): time.sleep(0.02)\n\
        open(d+'/moved','w').write(ids())\n\
        k=os.fork()\n\
        if k==0:\n\
        \x20   open(d+'/child','w').write(ids()); os._exit(5)\n\
        _,st=os.waitpid(k,0)\n\
        open(d+'/status','w').write(str(os.waitstatus_to_exitcode(st)))\n";
    let (out, err) = victim_output(&dir, "forked");
    let mut p = UnixServer(
        Command::new("python3")
            .args(["-c", prog])
            .arg(&dir)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap(),
    );
    let pid = pid_from(&dir.join("pid"), "the parent")?;
    let home = std::fs::read_to_string(dir.join("home")).unwrap();
    migrate(&c, "a", pid, "b").map_err(|e| format!("a -> b: {e}"))?;
    std::fs::write(dir.join("fork"), "").unwrap();
    let st = p.0.wait().unwrap();
    assert_eq!(st.code(), Some(0), "the parent: {st:?}");
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_default();
    let moved = read("moved");
    assert_eq!(
        moved, home,
        "the parent's ids after the move (pid ppid pgrp sid)"
    );
    let f: Vec<i64> = home.split(' ').map(|v| v.parse().unwrap()).collect();
    let child: Vec<i64> = read("child")
        .split(' ')
        .filter_map(|v| v.parse().ok())
        .collect();
    assert_eq!(child.len(), 4, "the child wrote {:?}", read("child"));
    assert_eq!(
        &child[1..],
        &[f[0], f[2], f[3]],
        "the child's parent, group and session (the parent's: {home})"
    );
    assert_eq!(read("status"), "5", "the parent's wait for its child");
    Ok(())
}

/// A full-screen program's terminal, after it moved: its settings read as the home terminal's
/// (tcgetattr), its window size is the home terminal's, a size it sets (TIOCSWINSZ) reaches
/// the home terminal (which signals SIGWINCH back), and `stty raw -echo` (tty.setraw)
/// reaches the home terminal, so that keys typed there arrive one by one, unechoed.
pub(super) const RAW_JOB: &str = r#"
import os, sys, time, tty, termios, fcntl, struct, signal
d = sys.argv[1]
def flags():
    a = termios.tcgetattr(0)
    return '%d %d %d' % (a[0], a[1], a[3] & ~0o200000)
open(d + '/home', 'w').write(flags())
open(d + '/pid.tmp', 'w').write(str(os.getpid()))
os.rename(d + '/pid.tmp', d + '/pid')
while not os.path.exists(d + '/moved'):
    time.sleep(0.05)
open(d + '/seen', 'w').write(flags())
rows, cols = struct.unpack('HHHH', fcntl.ioctl(0, termios.TIOCGWINSZ, b'\0' * 8))[:2]
open(d + '/size', 'w').write('%d %d' % (rows, cols))
winch = []
signal.signal(signal.SIGWINCH, lambda *a: winch.append(1))
fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack('HHHH', 40, 120, 0, 0))
end = time.time() + 10
while not winch and time.time() < end:
    time.sleep(0.05)
open(d + '/winch', 'w').write(str(len(winch)))
saved = termios.tcgetattr(0)
tty.setraw(0)
open(d + '/raw', 'w').write('')
got = b''
while len(got) < 2:
    got += os.read(0, 1)
open(d + '/keys', 'wb').write(got)
termios.tcsetattr(0, termios.TCSADRAIN, saved)
print('done', flush=True)
"#;

pub(super) const RAW_DRIVER: &str = r#"
import os, sys, time, select, subprocess, fcntl, termios, struct
d, job = sys.argv[1], sys.argv[2]
m, s = os.openpty()
fcntl.ioctl(m, termios.TIOCSWINSZ, struct.pack('HHHH', 33, 101, 0, 0))
def pre():
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
env = dict(os.environ, PS1='$ ', TERM='dumb', HISTFILE='/dev/null')
p = subprocess.Popen(['bash', '--norc', '--noprofile', '-i'], stdin=s, stdout=s, stderr=s,
                     preexec_fn=pre, env=env, close_fds=True)
screen = b''
def pump(t):
    global screen
    end = time.time() + t
    while time.time() < end:
        r, _, _ = select.select([m], [], [], 0.05)
        if r:
            try:
                b = os.read(m, 65536)
            except OSError:
                return
            screen += b
            open(d + '/screen', 'wb').write(screen)
def until(cond, what, t=20):
    end = time.time() + t
    while time.time() < end:
        if cond():
            return
        pump(0.1)
    sys.exit('timed out waiting for ' + what)
pump(0.5)
os.write(m, b'python3 ' + job.encode() + b' ' + d.encode() + b'\n')
until(lambda: os.path.exists(d + '/raw'), 'the moved job to set raw mode')
size = lambda: struct.unpack('HHHH', fcntl.ioctl(m, termios.TIOCGWINSZ, b'\0' * 8))[:2]
until(lambda: size() == (40, 120), 'the window size the job set to reach home')
pump(0.5)
mark = len(screen)
os.write(m, b'xy')
until(lambda: os.path.exists(d + '/keys'), 'the keys typed without a newline to arrive')
until(lambda: b'done' in screen[mark:], 'the job to end')
if b'xy' in screen[mark:]:
    sys.exit('the keys were echoed: %r' % screen[mark:])
os.write(m, b'exit\n')
p.wait(10)
"#;

pub(super) fn raw_terminal_after_move() -> Result<(), Failed> {
    raw_terminal_after(&[("a", "b")])
}

/// As [`raw_terminal_after_move`], the job moved a -> b -> c before it sets its terminal: its
/// settings, window size and keys go through the relay that followed it to c.
pub(super) fn raw_terminal_after_moving_on() -> Result<(), Failed> {
    raw_terminal_after(&[("a", "b"), ("b", "c")])
}

fn raw_terminal_after(hops: &[(&str, &str)]) -> Result<(), Failed> {
    // The last node's relays start 2 s after the body runs (as on a node under load): the
    // size and settings the job sets first must still reach home.
    let (last, tag) = if hops.len() > 1 {
        ("c", "rawon")
    } else {
        ("b", "raw")
    };
    let c = Cluster::up_with(
        tag,
        hops.len() + 1,
        &[("FAILPOINTS", &format!("{last}:relay-dial-late=return"))],
    );
    let dir = scratch("migration", tag);
    let st = drive_terminal_job_via(&c, &dir, RAW_DRIVER, RAW_JOB, hops, Duration::from_secs(40))?;
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_default();
    assert!(
        st.success(),
        "{}\nthe terminal showed:\n{}",
        read("driver.err"),
        String::from_utf8_lossy(&std::fs::read(dir.join("screen")).unwrap_or_default())
    );
    assert_eq!(
        read("seen"),
        read("home"),
        "tcgetattr after the move (iflag oflag lflag)"
    );
    assert_eq!(read("size"), "33 101", "the window size after the move");
    assert_eq!(
        read("winch"),
        "1",
        "SIGWINCH after the job set its window size (TIOCSWINSZ): the home terminal's"
    );
    assert_eq!(read("keys"), "xy", "the keys the job read");
    Ok(())
}

/// The parent of the fork trials: writes its PID, forks once `fork` exists (the child writes
/// its getpid() and getppid() and waits to be killed), waits for it and writes the exit code
/// it saw; then posix_spawns a shell (CLONE_VM | CLONE_VFORK) that writes its `$$` and waits
/// for `go`, and writes that one's exit code too; then waits for `end`.
const FORKING: &str = r#"
import os, sys, time
d = sys.argv[1]
def wr(name, text):
    open(d + '/' + name + '.tmp', 'w').write(text)
    os.rename(d + '/' + name + '.tmp', d + '/' + name)
def until(name):
    while not os.path.exists(d + '/' + name):
        time.sleep(0.02)
wr('pid', str(os.getpid()))
until('fork')
k = os.fork()
if k == 0:
    wr('child', '%d %d' % (os.getpid(), os.getppid()))
    while True:
        time.sleep(1)
wr('forked', str(k))
_, st = os.waitpid(k, 0)
wr('status', str(os.waitstatus_to_exitcode(st)))
script = 'echo $$ > %s/spawned.tmp; mv %s/spawned.tmp %s/spawned; ' \
         'while [ ! -e %s/go ]; do sleep 0.05; done' % (d, d, d, d)
s = os.posix_spawn('/bin/sh', ['sh', '-c', script], os.environ)
wr('spawn', str(s))
_, st = os.waitpid(s, 0)
wr('spawn_status', str(os.waitstatus_to_exitcode(st)))
until('end')
"#;

/// Waits up to 20 s for `cond`.
pub(super) fn eventually(what: &str, cond: impl Fn() -> bool) -> Result<(), Failed> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cond() {
        if Instant::now() > deadline {
            return Err(format!("timed out waiting for {what}").into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// PPid of `pid` at home (this machine), 0 if it is gone.
pub(super) fn ppid_here(pid: i32) -> i32 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("PPid:"))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or(0)
}

/// The home PIDs `ferry ps --json` lists as deputies of the tree of `root` (asked on `on`,
/// its home).
fn deputy_pids(c: &Cluster, on: &str, root: i32) -> Vec<i64> {
    guest(c, on, root)
        .and_then(|g| {
            g["deputies"]
                .as_array()
                .map(|a| a.iter().filter_map(|p| p.as_i64()).collect())
        })
        .unwrap_or_default()
}

/// A child a moved process forks (os.fork) and one it posix_spawns (clone with CLONE_VM and
/// CLONE_VFORK) each get a deputy at home: the child's getpid() there is a PID alive at home,
/// traced (a deputy), whose parent is the parent's home PID, listed by `ferry ps` with the
/// tree's deputies and in their durable record. `kill -TERM` of that PID at home ends the
/// child over there, and the parent's wait there sees SIGTERM; once a child ended, its deputy
/// has ended the same way and is gone at home, reaped (no zombie left under the parent's
/// deputy).
pub(super) fn forked_child_has_a_deputy() -> Result<(), Failed> {
    let c = Cluster::up("forkdep", 2);
    let dir = scratch("migration", "forkdep");
    let (out, err) = victim_output(&dir, "forking");
    let mut p = UnixServer(
        Command::new("python3")
            .args(["-c", FORKING])
            .arg(&dir)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap(),
    );
    let pid = pid_from(&dir.join("pid"), "the parent")?;
    migrate(&c, "a", pid, "b").map_err(|e| format!("a -> b: {e}"))?;
    std::fs::write(dir.join("fork"), "").unwrap();
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_default();
    let child = pid_from(&dir.join("forked"), "the fork")?;
    eventually("the child to write its ids", || !read("child").is_empty())?;
    assert_eq!(
        read("child"),
        format!("{child} {pid}"),
        "the child's getpid() and getppid() (fork returned {child})"
    );
    // At home: that PID is the child's deputy, a child of the parent's.
    assert!(pid_alive(child), "PID {child} is not alive at home");
    assert_eq!(ppid_here(child), pid, "the parent at home of PID {child}");
    assert_ne!(
        common::run::tracer_of(child),
        0,
        "PID {child} at home is no deputy"
    );
    eventually("ferry ps to list the child's deputy", || {
        deputy_pids(&c, "a", pid).contains(&(child as i64))
    })
    .map_err(|e| format!("{e:?}: {:?}", ps(&c, "a")))?;
    // Recorded durably with the tree's other deputies (a restarted daemon takes it up).
    let record = c
        .dir
        .join("a")
        .join("state")
        .join(format!("deputy-{pid}.json"));
    let pids: Vec<i64> = std::fs::read(&record)
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|v| {
            v["pids"]
                .as_array()
                .map(|a| a.iter().filter_map(|p| p.as_i64()).collect())
        })
        .unwrap_or_default();
    assert!(
        pids.contains(&(child as i64)) && pids.contains(&(pid as i64)),
        "{} lists {pids:?}",
        record.display()
    );
    let st = Command::new("kill")
        .args(["-TERM", &child.to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    eventually("the parent's wait", || !read("status").is_empty())?;
    assert_eq!(read("status"), "-15", "the parent's wait for its child");
    eventually("the child's deputy to be reaped at home", || {
        !Path::new(&format!("/proc/{child}")).exists()
    })?;
    // Its deputy ended as the child did (killed by SIGTERM), though its parent over there may
    // have reaped it before its node looked.
    let ended = format!("event=\"deputy-ended\" pid={child} status=15 mirrored=true");
    eventually(
        "home's log to say the child's deputy ended by SIGTERM",
        || c.log("a").contains(&ended),
    )?;
    // posix_spawn: CLONE_VM | CLONE_VFORK.
    let spawned = pid_from(&dir.join("spawn"), "posix_spawn")?;
    eventually("the spawned shell to write its PID", || {
        !read("spawned").is_empty()
    })?;
    assert_eq!(
        read("spawned").trim(),
        spawned.to_string(),
        "the shell's $$"
    );
    assert!(pid_alive(spawned), "PID {spawned} is not alive at home");
    assert_eq!(
        ppid_here(spawned),
        pid,
        "the parent at home of PID {spawned}"
    );
    assert_ne!(
        common::run::tracer_of(spawned),
        0,
        "PID {spawned} is no deputy"
    );
    std::fs::write(dir.join("go"), "").unwrap();
    eventually("the parent's wait for the shell", || {
        !read("spawn_status").is_empty()
    })?;
    assert_eq!(read("spawn_status"), "0");
    eventually("the shell's deputy to be reaped at home", || {
        !Path::new(&format!("/proc/{spawned}")).exists()
    })?;
    std::fs::write(dir.join("end"), "").unwrap();
    let st = p.0.wait().unwrap();
    assert_eq!(st.code(), Some(0), "the parent: {st:?}");
    Ok(())
}

/// The parent of the trials below: forks once `fork` exists; the child writes its getpid()
/// and getppid() and exits 3 once `stop` exists; the parent writes the exit code its wait saw,
/// and ends once `end` exists.
const FORKS_THEN_WAITS: &str = r#"
import os, sys, time
d = sys.argv[1]
def wr(name, text):
    open(d + '/' + name + '.tmp', 'w').write(text)
    os.rename(d + '/' + name + '.tmp', d + '/' + name)
def until(name):
    while not os.path.exists(d + '/' + name):
        time.sleep(0.02)
wr('pid', str(os.getpid()))
until('fork')
try:
    k = os.fork()
except BlockingIOError as e:
    wr('forked', 'EAGAIN')
    until('end')
    sys.exit(0)
if k == 0:
    wr('child', '%d %d' % (os.getpid(), os.getppid()))
    until('stop')
    os._exit(3)
wr('forked', str(k))
_, st = os.waitpid(k, 0)
wr('status', str(os.waitstatus_to_exitcode(st)))
until('end')
"#;

fn start_forker(dir: &Path) -> UnixServer {
    let (out, err) = victim_output(dir, "forker");
    UnixServer(
        Command::new("python3")
            .args(["-c", FORKS_THEN_WAITS])
            .arg(dir)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap(),
    )
}

/// A tree with a child forked after the move moves on (a -> b -> c) and comes home (c -> a):
/// on c the child's deputy is still the tree's (listed, alive, traced at home); at home again
/// the deputies, the child's too, are adopted: parent and child are the ordinary processes
/// under their PIDs (no tracer), the child still the parent's child, and the parent's wait
/// gets the child's exit code.
pub(super) fn forked_child_moves_on_and_comes_home() -> Result<(), Failed> {
    let c = Cluster::up("forkon", 3);
    let dir = scratch("migration", "forkon");
    let mut p = start_forker(&dir);
    let pid = pid_from(&dir.join("pid"), "the parent")?;
    migrate(&c, "a", pid, "b").map_err(|e| format!("a -> b: {e}"))?;
    std::fs::write(dir.join("fork"), "").unwrap();
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_default();
    let child = pid_from(&dir.join("forked"), "the fork")?;
    eventually("the child to write its ids", || !read("child").is_empty())?;
    assert_eq!(read("child"), format!("{child} {pid}"));
    assert_ne!(common::run::tracer_of(child), 0, "PID {child} is no deputy");
    migrate(&c, "b", pid, "c").map_err(|e| format!("b -> c: {e}"))?;
    assert!(
        pid_alive(child),
        "PID {child}'s deputy is gone after b -> c"
    );
    assert_ne!(
        common::run::tracer_of(child),
        0,
        "PID {child} is no deputy on c"
    );
    eventually("ferry ps to list the child's deputy", || {
        deputy_pids(&c, "a", pid).contains(&(child as i64))
    })?;
    let r = migrate(&c, "c", pid, "a").map_err(|e| format!("c -> a: {e}"))?;
    assert_eq!(r["dest_pid"].as_i64(), Some(pid as i64), "{r}");
    for (who, p) in [("the parent", pid), ("the child", child)] {
        assert!(pid_alive(p), "{who} (PID {p}) is gone at home");
        assert_eq!(
            common::run::tracer_of(p),
            0,
            "{who} (PID {p}) is still traced (a deputy)"
        );
        assert_eq!(
            std::fs::read_link(format!("/proc/{p}/ns/pid")).ok(),
            std::fs::read_link("/proc/self/ns/pid").ok(),
            "{who} (PID {p}) runs in a PID namespace of its own"
        );
    }
    assert_eq!(ppid_here(child), pid, "the child's parent at home");
    std::fs::write(dir.join("stop"), "").unwrap();
    eventually("the parent's wait", || !read("status").is_empty())?;
    assert_eq!(read("status"), "3", "the parent's wait for its child");
    std::fs::write(dir.join("end"), "").unwrap();
    let st = p.0.wait().unwrap();
    assert_eq!(st.code(), Some(0), "the parent: {st:?}");
    Ok(())
}

/// A moved process whose home cannot be reached (its daemon killed) forks: the fork fails
/// with EAGAIN, which the program handles, rather than giving the child a PID home does not
/// know; the guest init's log (in its node's) says why.
pub(super) fn fork_without_home_fails_with_eagain() -> Result<(), Failed> {
    let c = Cluster::up("forkgone", 2);
    let dir = scratch("migration", "forkgone");
    let p = start_forker(&dir);
    let pid = pid_from(&dir.join("pid"), "the parent")?;
    migrate(&c, "a", pid, "b").map_err(|e| format!("a -> b: {e}"))?;
    let home = c.daemon_pid("a");
    let st = Command::new("kill")
        .args(["-KILL", &home.to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    eventually("home's daemon to be gone", || !pid_alive(home))?;
    std::fs::write(dir.join("fork"), "").unwrap();
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_default();
    eventually("the fork to fail", || !read("forked").is_empty())?;
    assert_eq!(read("forked"), "EAGAIN", "what the fork gave");
    assert!(
        c.log("b").contains("home gave its child no PID"),
        "b's log does not say why: {}",
        c.log("b")
    );
    std::fs::write(dir.join("end"), "").unwrap();
    drop(p);
    Ok(())
}

/// A moved process forks and waits 300 times in a row, as fast as it can: every fork succeeds
/// (a SIGCHLD from the last child's deputy, pending as the next is forked at home, once made
/// them fail), every child's getpid() is the PID fork returned, each had its deputy at home,
/// and no deputy is left there afterwards.
pub(super) fn many_forks_after_the_move() -> Result<(), Failed> {
    const PROG: &str = r#"
import os, sys, time
d = sys.argv[1]
open(d + '/pid.tmp', 'w').write(str(os.getpid()))
os.rename(d + '/pid.tmp', d + '/pid')
while not os.path.exists(d + '/fork'):
    time.sleep(0.02)
bad = []
t = time.time()
for i in range(300):
    r, w = os.pipe()
    k = os.fork()
    if k == 0:
        os.write(w, str(os.getpid()).encode())
        os._exit(0)
    os.close(w)
    got = int(os.read(r, 32))
    os.close(r)
    _, st = os.waitpid(k, 0)
    if got != k or st != 0:
        bad.append((k, got, st))
open(d + '/ms', 'w').write('%.3f' % ((time.time() - t) * 1000 / 300))
open(d + '/bad', 'w').write(repr(bad))
"#;
    let c = Cluster::up("forkmany", 2);
    let dir = scratch("migration", "forkmany");
    let (out, err) = victim_output(&dir, "forkmany");
    let mut p = UnixServer(
        Command::new("python3")
            .args(["-c", PROG])
            .arg(&dir)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap(),
    );
    let pid = pid_from(&dir.join("pid"), "the parent")?;
    migrate(&c, "a", pid, "b").map_err(|e| format!("a -> b: {e}"))?;
    std::fs::write(dir.join("fork"), "").unwrap();
    let st = p.0.wait().unwrap();
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_default();
    assert_eq!(
        st.code(),
        Some(0),
        "the parent: {st:?}: {}\nb: {}",
        read("forkmany.err"),
        c.log("b")
    );
    assert_eq!(
        read("bad"),
        "[]",
        "forks whose child had another PID, or failed"
    );
    eprintln!("a fork and wait after the move: {} ms", read("ms"));
    // Each child had its deputy at home.
    let forked = format!("event=\"deputy-forked\" root={pid} ");
    assert_eq!(
        c.log("a").matches(&forked).count(),
        300,
        "deputies forked at home for the tree of {pid}"
    );
    // The parent's own deputy ended with it; none of its children's is left.
    eventually("no deputy left at home", || {
        deputy_pids(&c, "a", pid).is_empty() && common::run::tracer_of(pid) == 0
    })?;
    Ok(())
}
