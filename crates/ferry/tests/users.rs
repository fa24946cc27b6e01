//! Users who are not root (docs/security.md, "Users who are not root"): a local cluster of two
//! daemons whose control sockets are open to everyone (`--control-mode 0666`), used by real
//! unprivileged uids (no passwd entry needed: the kernel knows users by number), each `ferry`
//! run through `setpriv` with no capability. A user moves, checkpoints and restores their own
//! processes; cannot checkpoint, kill, move or see another user's or root's; and cannot make
//! a restore produce a process with more than their credentials. And a guest (a process moved
//! away from its home, or a program run for another node, `--confine-guests`) sees only the
//! shared tree and the system's files of the node it runs on.

mod common;

use common::cluster::{Cluster, Isolation, FERRY};
use libtest_mimic::{Arguments, Failed, Trial};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The user under test, and another one.
const ALICE: u32 = 61001;
const BOB: u32 = 61002;

fn main() {
    common::seal_inherited_fds();
    let args = Arguments::from_args();
    let cluster = if args.list {
        None
    } else {
        Some(Arc::new(Cluster::up_full(
            "users",
            2,
            &[],
            Isolation::default_for_tests(),
            &[
                "--control-mode",
                "0666",
                "--confine-guests",
                "--confine-network",
            ],
        )))
    };
    type Test = fn(&Cluster) -> Result<(), Failed>;
    let tests: [(&str, Test); 13] = [
        ("a_user_moves_checkpoints_and_restores_their_own", own),
        (
            "a_user_cannot_restore_a_kernel_log_reader_without_cap_syslog",
            kmsg_reader_needs_cap_syslog,
        ),
        ("a_user_cannot_touch_another_users_or_roots", others),
        ("an_image_claiming_root_is_refused", image_claims_root),
        ("ps_shows_a_user_only_their_own", ps_hides_others),
        (
            "a_guest_sees_only_the_shared_tree_and_the_system",
            guest_confined,
        ),
        (
            "a_program_run_for_another_node_sees_only_the_shared_tree_and_the_system",
            run_guest_confined,
        ),
        (
            "a_root_program_run_for_another_node_cannot_unmount_what_hides_the_node",
            run_guest_cannot_unmount,
        ),
        (
            "a_root_guest_cannot_unmount_what_hides_the_node",
            guest_cannot_unmount,
        ),
        (
            "a_program_run_for_another_node_reaches_no_network_but_a_loopback",
            run_guest_network,
        ),
        (
            "a_program_run_for_another_node_sees_no_process_but_its_own",
            run_guest_sees_no_other_process,
        ),
        (
            "programs_run_for_another_node_have_a_tmp_of_their_own",
            run_guests_have_their_own_tmp,
        ),
        (
            "a_program_run_for_another_node_has_its_orphans_reaped_by_its_init",
            run_guest_orphans_reaped,
        ),
    ];
    let trials = tests
        .into_iter()
        .map(|(name, f)| {
            let c = cluster.clone();
            Trial::test(name, move || match &c {
                Some(c) => f(c),
                None => Ok(()),
            })
        })
        .collect();
    let conclusion = libtest_mimic::run(&args, trials);
    if let Some(c) = cluster {
        if conclusion.has_failed() {
            eprintln!("{}", common::cluster::daemon_logs(&c.dir, &["a", "b"]));
        }
        drop(c);
    }
    conclusion.exit();
}

// ---- Helpers -------------------------------------------------------------------------------

/// `setpriv` turning into `uid` (gid the same, no groups, no capabilities), then `args`.
fn as_user(uid: u32, args: &[&str]) -> Command {
    let mut cmd = Command::new("setpriv");
    cmd.args([
        &format!("--reuid={uid}"),
        &format!("--regid={uid}"),
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
    ])
    .args(args)
    .current_dir("/")
    .stdin(Stdio::null());
    cmd
}

/// `ferry ARGS` on node a as `uid` (0: root itself).
fn ferry_as(c: &Cluster, uid: u32, args: &[&str]) -> Output {
    ferry_as_in(c, uid, None, args)
}

/// `ferry ARGS` as `uid`, in `dir` (None: this test's working directory).
fn ferry_as_in(c: &Cluster, uid: u32, dir: Option<&Path>, args: &[&str]) -> Output {
    let mut cmd = if uid == 0 {
        let mut cmd = Command::new(FERRY);
        cmd.args(args).stdin(Stdio::null());
        cmd
    } else {
        let mut all = vec![FERRY];
        all.extend_from_slice(args);
        as_user(uid, &all)
    };
    if let Some(d) = dir {
        cmd.current_dir(d);
    }
    cmd.env("FERRY_CLUSTER_DIR", &c.dir)
        .env("FERRY_NODE", "a")
        .output()
        .unwrap()
}

/// A process of a test's, killed and reaped when dropped.
struct Sleeper(Child);

impl Sleeper {
    fn pid(&self) -> i32 {
        self.0.id() as i32
    }

    /// Reaps it once it has ended (a checkpoint killed it).
    fn reap(&mut self) {
        let _ = self.0.wait();
    }
}

impl Drop for Sleeper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A `sleep` of `uid`'s (0: root's), its stdio on /dev/null; returns once it runs as such.
fn sleeper(uid: u32) -> Sleeper {
    let mut cmd = if uid == 0 {
        Command::new("sleep")
    } else {
        as_user(uid, &["sleep"])
    };
    // (In `/`: a guest sees only the system's files and the shared tree of b.)
    let child = cmd
        .arg("1000")
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id() as i32;
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(5) {
        let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap_or_default();
        if exe.to_string_lossy().contains("sleep") {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Sleeper(child)
}

/// A directory of `uid`'s, mode 0755, empty.
fn user_dir(name: &str, uid: u32) -> PathBuf {
    let d = common::scratch("users", name);
    std::os::unix::fs::chown(&d, Some(uid), Some(uid)).unwrap();
    std::fs::set_permissions(&d, PermissionsExt::from_mode(0o755)).unwrap();
    d
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn describe(o: &Output) -> String {
    format!(
        "status {:?}, stdout {:?}, stderr {:?}",
        o.status,
        text(&o.stdout),
        text(&o.stderr)
    )
}

/// Alice checkpoints her process `pid` into `img` (which kills it): it must succeed.
fn alice_checkpoints(c: &Cluster, pid: i32, img: &Path) -> Result<(), Failed> {
    let o = ferry_as(
        c,
        ALICE,
        &[
            "checkpoint",
            &pid.to_string(),
            "--dir",
            img.to_str().unwrap(),
        ],
    );
    check(o.status.success(), || {
        format!("alice's checkpoint: {}", describe(&o))
    })
}

fn check(ok: bool, what: impl FnOnce() -> String) -> Result<(), Failed> {
    if ok {
        Ok(())
    } else {
        Err(what().into())
    }
}

/// The uids (real, effective, saved, fs) of `pid`.
fn uids(pid: i32) -> String {
    common::status_field(pid, "Uid")
}

fn alive(pid: i32) -> bool {
    common::proc_state(pid).is_some_and(|s| s != 'Z')
}

/// `ferry ps --json` as `uid`: the rows' (home PID, uid, command).
fn ps_rows(c: &Cluster, uid: u32) -> Result<Vec<(i64, u64, String)>, Failed> {
    let o = ferry_as(c, uid, &["ps", "--json"]);
    check(o.status.success(), || {
        format!("ps as uid {uid}: {}", describe(&o))
    })?;
    let v: serde_json::Value = serde_json::from_slice(&o.stdout)
        .map_err(|e| format!("ps --json: {e}: {}", describe(&o)))?;
    Ok(v.as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|r| {
            (
                r["home_pid"].as_i64().unwrap_or(0),
                r["uid"].as_u64().unwrap_or(u64::MAX),
                r["command"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect())
}

// ---- Tests ---------------------------------------------------------------------------------

/// Alice moves her process to b and sees it there; checkpoints another into a directory of
/// hers (the image is hers, 0600) and restores it, as herself.
fn own(c: &Cluster) -> Result<(), Failed> {
    let moved = sleeper(ALICE);
    let pid = moved.pid();
    let o = ferry_as(c, ALICE, &["migrate", &pid.to_string(), "--to", "b"]);
    check(o.status.success(), || {
        format!("alice's migrate: {}", describe(&o))
    })?;
    let rows = ps_rows(c, ALICE)?;
    check(
        rows.iter()
            .any(|(p, u, _)| *p == pid as i64 && *u == ALICE as u64),
        || format!("alice's ps does not show her moved PID {pid}: {rows:?}"),
    )?;
    drop(moved);

    let dir = user_dir("own", ALICE);
    let img = dir.join("img");
    let mut kept = sleeper(ALICE);
    let pid = kept.pid();
    alice_checkpoints(c, pid, &img)?;
    kept.reap(); // the checkpoint killed it
    let image = img.join("image.ferry");
    let m = std::fs::metadata(&image).map_err(|e| format!("{}: {e}", image.display()))?;
    let d = std::fs::metadata(&img).unwrap();
    check(
        m.uid() == ALICE
            && m.mode() & 0o777 == 0o600
            && d.uid() == ALICE
            && d.mode() & 0o777 == 0o700,
        || {
            format!(
                "image {} is uid {} mode {:o}, its directory uid {} mode {:o}: want alice's, 0600 and 0700",
                image.display(),
                m.uid(),
                m.mode() & 0o777,
                d.uid(),
                d.mode() & 0o777
            )
        },
    )?;
    let o = ferry_as(c, ALICE, &["restore", "--dir", img.to_str().unwrap()]);
    check(o.status.success(), || {
        format!("alice's restore: {}", describe(&o))
    })?;
    let ok = alive(pid) && uids(pid) == format!("{ALICE}\t{ALICE}\t{ALICE}\t{ALICE}");
    let got = uids(pid);
    let _ = ferry_sys_kill(pid);
    check(ok, || {
        format!("restored PID {pid}: uids {got:?}, want alice's")
    })
}

/// Alice's process holds /dev/kmsg open for reading (opened by root, inherited: under
/// `kernel.dmesg_restrict` she could not open it herself). She may checkpoint it, but her
/// restore would have Ferry (root's capabilities) open it for her: refused.
fn kmsg_reader_needs_cap_syslog(c: &Cluster) -> Result<(), Failed> {
    let restricted =
        std::fs::read_to_string("/proc/sys/kernel/dmesg_restrict").is_ok_and(|v| v.trim() != "0");
    if !restricted {
        return Err("this test needs kernel.dmesg_restrict = 1".into());
    }
    let kmsg = std::fs::File::open("/dev/kmsg").map_err(|e| format!("open /dev/kmsg: {e}"))?;
    let raw = std::os::fd::AsRawFd::as_raw_fd(&kmsg);
    // At its end: its position is not at risk of being overwritten meanwhile.
    // SAFETY: lseek on our own descriptor.
    unsafe { libc::lseek(raw, 0, libc::SEEK_END) };
    let mut cmd = as_user(ALICE, &["sleep", "1000"]);
    cmd.stdout(Stdio::null()).stderr(Stdio::null());
    // SAFETY: dup2 is async-signal-safe; `raw` stays open in the parent until spawn returns.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
            // (Through a copy: `raw` may be 3 itself, close-on-exec.)
            let copy = libc::dup(raw);
            if copy < 0 || libc::dup2(copy, 3) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut kept = Sleeper(cmd.spawn().unwrap());
    drop(kmsg);
    let pid = kept.pid();
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(5)
        && !std::fs::read_link(format!("/proc/{pid}/exe"))
            .unwrap_or_default()
            .to_string_lossy()
            .contains("sleep")
    {
        std::thread::sleep(Duration::from_millis(10));
    }
    let dir = user_dir("kmsg", ALICE);
    let img = dir.join("img");
    alice_checkpoints(c, pid, &img)?;
    kept.reap();
    let o = ferry_as(c, ALICE, &["restore", "--dir", img.to_str().unwrap()]);
    if o.status.success() {
        let _ = ferry_sys_kill(pid);
    }
    let err = text(&o.stderr);
    check(
        !o.status.success() && err.contains("CAP_SYSLOG") && err.contains("fd 3"),
        || format!("alice's restore of a /dev/kmsg reader: {}", describe(&o)),
    )
}

fn ferry_sys_kill(pid: i32) -> bool {
    Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success())
}

/// Alice may not checkpoint (which kills), move or ask anything else about Bob's process or
/// root's: each is refused naming her uid and the PID, and the processes run on.
fn others(c: &Cluster) -> Result<(), Failed> {
    let bob = sleeper(BOB);
    let root = sleeper(0);
    let dir = user_dir("others", ALICE);
    let mut failures = Vec::new();
    for (whose, child) in [("bob's", &bob), ("root's", &root)] {
        let pid = child.pid().to_string();
        let img = dir.join(format!("img-{pid}"));
        for args in [
            vec!["checkpoint", &pid, "--dir", img.to_str().unwrap()],
            vec![
                "checkpoint",
                &pid,
                "--leave-running",
                "--dir",
                img.to_str().unwrap(),
            ],
            vec!["migrate", &pid, "--to", "b"],
        ] {
            let o = ferry_as(c, ALICE, &args);
            let want = format!("uid {ALICE} may not move or checkpoint PID {pid}");
            if o.status.success() || !text(&o.stderr).contains(&want) {
                failures.push(format!(
                    "{args:?} of {whose}: want {want:?}: {}",
                    describe(&o)
                ));
            }
            if !alive(child.pid()) {
                failures.push(format!("{args:?} ended {whose} PID {pid}"));
            }
        }
        if img.join("image.ferry").exists() {
            failures.push(format!("an image of {whose} PID {pid} was written"));
        }
    }
    // Alice's own process that made itself undumpable (as a set-user-ID program is): its
    // /proc is root's, and ptrace would refuse her.
    let mut undumpable = as_user(
        ALICE,
        &[
            "/usr/bin/python3",
            "-c",
            "import ctypes,os,time; ctypes.CDLL(None).prctl(4, 0, 0, 0, 0); \
             open('ready', 'w').close(); time.sleep(1000)",
        ],
    );
    let child = undumpable
        .current_dir(&dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let undumpable = Sleeper(child);
    let t0 = Instant::now();
    while !dir.join("ready").exists() {
        if t0.elapsed() > Duration::from_secs(10) {
            return Err("python3 did not start as alice in 10 s".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let pid = undumpable.pid().to_string();
    let img = dir.join("img-undumpable");
    let o = ferry_as(
        c,
        ALICE,
        &["checkpoint", &pid, "--dir", img.to_str().unwrap()],
    );
    if o.status.success() || !text(&o.stderr).contains("not dumpable") {
        failures.push(format!(
            "checkpoint of an undumpable process: {}",
            describe(&o)
        ));
    }
    drop(undumpable);
    // Nothing else is a user's to ask.
    for args in [vec!["nodes"], vec!["evict", "b"], vec!["accept", "never"]] {
        let o = ferry_as(c, ALICE, &args);
        if o.status.success() || !text(&o.stderr).contains("only root may") {
            failures.push(format!("{args:?}: want a refusal: {}", describe(&o)));
        }
    }
    drop((bob, root));
    check(failures.is_empty(), || failures.join("\n"))
}

/// Alice checkpoints her own process, then the image is edited to say its process is root's
/// (its uids 0, every capability): her restore is refused naming the field, and no process
/// comes back (the image's PID stays free).
fn image_claims_root(c: &Cluster) -> Result<(), Failed> {
    let dir = user_dir("claims-root", ALICE);
    let img = dir.join("img");
    let mut child = sleeper(ALICE);
    let pid = child.pid();
    alice_checkpoints(c, pid, &img)?;
    child.reap();
    let mut failures = Vec::new();
    for (field, edit) in [
        ("uids", edit_uids as fn(&mut ferry_image::Creds)),
        ("cap_prm", edit_caps),
    ] {
        let edited = dir.join(format!("edited-{field}"));
        edit_image(&img, &edited, edit);
        let o = ferry_as(c, ALICE, &["restore", "--dir", edited.to_str().unwrap()]);
        let want = format!("the image's PID {pid} claims {field}");
        if o.status.success() || !text(&o.stderr).contains(&want) {
            failures.push(format!("edited {field}: want {want:?}: {}", describe(&o)));
        }
        if alive(pid) {
            failures.push(format!(
                "edited {field}: PID {pid} runs, uids {:?}, CapEff {:?}",
                uids(pid),
                common::status_field(pid, "CapEff")
            ));
            ferry_sys_kill(pid);
        }
    }
    check(failures.is_empty(), || failures.join("\n"))
}

fn edit_uids(c: &mut ferry_image::Creds) {
    c.uids = [0; 4];
    c.gids = [0; 4];
}

fn edit_caps(c: &mut ferry_image::Creds) {
    c.cap_prm = u64::MAX >> 23;
    c.cap_eff = u64::MAX >> 23;
}

/// Copies the image in `from` to `to` (a directory of alice's, as she could make it), with
/// every process's credentials changed by `edit`, its checksums made right again.
fn edit_image(from: &Path, to: &Path, edit: fn(&mut ferry_image::Creds)) {
    let mut b = std::fs::read(from.join("image.ferry")).unwrap();
    let (at, _, range) = ferry_fuzz::image_records(&b)
        .into_iter()
        .next()
        .expect("a tree record");
    let mut tree: ferry_image::Tree = ciborium::from_reader(&b[range.clone()]).unwrap();
    for p in &mut tree.processes {
        edit(&mut p.creds);
    }
    let mut payload = Vec::new();
    ciborium::into_writer(&tree, &mut payload).unwrap();
    ferry_fuzz::replace_payload(&mut b, at, range, &payload);
    ferry_fuzz::reseal_image(&mut b);
    std::fs::create_dir_all(to).unwrap();
    std::fs::write(to.join("image.ferry"), &b).unwrap();
    for p in [to, &to.join("image.ferry")] {
        std::os::unix::fs::chown(p, Some(ALICE), Some(ALICE)).unwrap();
    }
}

/// Root's and Bob's moved processes are not in Alice's `ferry ps`; hers is; root sees all.
fn ps_hides_others(c: &Cluster) -> Result<(), Failed> {
    let mut children = Vec::new();
    for uid in [0, BOB, ALICE] {
        let child = sleeper(uid);
        let pid = child.pid().to_string();
        children.push(child);
        let o = ferry_as(c, uid, &["migrate", &pid, "--to", "b"]);
        check(o.status.success(), || {
            format!("migrate as uid {uid}: {}", describe(&o))
        })?;
    }
    let pids: Vec<i64> = children.iter().map(|c| c.pid() as i64).collect();
    let alice = ps_rows(c, ALICE)?;
    let root = ps_rows(c, 0)?;
    drop(children);
    check(
        alice.iter().all(|(_, u, _)| *u == ALICE as u64)
            && alice.iter().any(|(p, _, _)| *p == pids[2])
            && pids.iter().all(|p| root.iter().any(|(q, _, _)| q == p)),
        || format!("alice's ps {alice:?}, root's {root:?}; PIDs (root's, bob's, alice's) {pids:?}"),
    )
}

/// Writes `path` (under /tmp) into node b's private /tmp, through its init's root, and checks
/// that this machine (node a) does not see it.
fn plant_secret_on_b(c: &Cluster, path: &str) -> Result<(), Failed> {
    let init = c.init_pid("b").ok_or("node b has no init")?;
    let on_b = format!("/proc/{init}/root{path}");
    std::fs::write(&on_b, "b-secret\n").map_err(|e| format!("write {on_b}: {e}"))?;
    check(!Path::new(path).exists(), || {
        format!("{path} is b's own, yet shows here")
    })
}

/// A program run on b for a (`ferry run --on b`) is a guest there too: it cannot read a file
/// in b's private /tmp nor see this machine's /root; it reads the system's files and writes in
/// the shared tree, as root or as a user. Started in a directory outside the shared tree, it
/// does not start, and the error says why.
fn run_guest_confined(c: &Cluster) -> Result<(), Failed> {
    let secret = "/tmp/ferry-run-guest-secret";
    plant_secret_on_b(c, secret)?;
    let dir = common::scratch("users", "run-confined");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let script = format!(
        "cat {secret}; echo cat=$?; ls -A /root | wc -l; head -c 4 /etc/passwd; echo; \
         echo passwd=$?; id -u > wrote-$(id -u)"
    );
    for uid in [0, ALICE] {
        let sh = ["sh", "-c", script.as_str()];
        let o = ferry_as_in(
            c,
            uid,
            Some(&dir),
            &[&["run", "--on", "b", "--"][..], &sh[..]].concat(),
        );
        let out = String::from_utf8_lossy(&o.stdout);
        let lines: Vec<&str> = out.lines().collect();
        check(
            String::from_utf8_lossy(&o.stderr).contains("No such file or directory")
                && lines.contains(&"cat=1")
                && lines.contains(&"0")
                && lines.contains(&"root")
                && lines.contains(&"passwd=0"),
            || {
                format!(
                    "uid {uid}'s program on b: {} (want {secret} missing, /root empty, \
                     /etc/passwd read)",
                    describe(&o)
                )
            },
        )?;
        let wrote = std::fs::read_to_string(dir.join(format!("wrote-{uid}"))).unwrap_or_default();
        check(wrote.trim() == uid.to_string(), || {
            format!("uid {uid}'s program did not write in the shared tree: {wrote:?}")
        })?;
    }
    // A directory outside the shared tree (this crate's) is not there for a guest.
    let o = ferry_as(c, 0, &["run", "--on", "b", "--", "true"]);
    let err = String::from_utf8_lossy(&o.stderr);
    check(
        o.status.code() == Some(125)
            && err.contains("cannot change to directory")
            && err.contains("sees only the shared tree"),
        || format!("run on b from outside the shared tree: {}", describe(&o)),
    )
}

/// A root shell moved from a to b cannot read a file in b's private /tmp (which its home a
/// cannot see either), nor see this machine's /root; it still reads the system's files and
/// writes in the shared tree.
fn guest_confined(c: &Cluster) -> Result<(), Failed> {
    let secret = "/tmp/ferry-guest-secret";
    plant_secret_on_b(c, secret)?;
    let dir = common::scratch("users", "confined");
    let script = format!(
        "while [ ! -e go ]; do sleep 0.05; done; \
         (cat {secret}; echo cat=$?; ls -A /root | wc -l; head -c 4 /etc/passwd; echo; \
          echo passwd=$?) > out.part 2>&1; mv out.part out; exec sleep 1000"
    );
    let out = moved_guest_output(c, &dir, &script, 10)?;
    let lines: Vec<&str> = out.lines().collect();
    check(
        out.contains("No such file or directory")
            && lines.contains(&"cat=1")
            && lines.contains(&"0")
            && lines.contains(&"root")
            && lines.contains(&"passwd=0"),
        || {
            format!(
                "the guest on b: {out:?} (want {secret} missing, /root empty, /etc/passwd read, \
                 the shared tree written)"
            )
        },
    )
}

/// A root script that tries to reveal what the confinement hides on b: its data directory
/// (which lies in the shared tree here) and this machine's /root, by unmounting what covers
/// them (plainly, then lazily) and by moving it away; it then counts what it sees there and
/// names its user namespace. (One command after the other, no pipeline: a body's forks are made
/// one at a time.)
fn unmount_script(c: &Cluster) -> String {
    let data = c.dir.join("b");
    let data = data.display();
    format!(
        "mkdir -p /tmp/m; for d in {data} /root; do umount $d; umount -l $d; \
         mount --move $d /tmp/m; done 2>/dev/null; \
         ls -A {data} > /tmp/data; ls -A /root > /tmp/root; \
         printf data=; wc -l < /tmp/data; printf root=; wc -l < /tmp/root; \
         printf userns=; readlink /proc/self/ns/user"
    )
}

/// What `unmount_script` printed says nothing was revealed.
fn nothing_revealed(c: &Cluster, who: &str, out: &str) -> Result<(), Failed> {
    let data = c.dir.join("b");
    let there = std::fs::read_dir(&data).map(|d| d.count()).unwrap_or(0);
    check(there > 0, || {
        format!("b's data directory {} is empty here", data.display())
    })?;
    let lines: Vec<&str> = out.lines().collect();
    check(
        lines.contains(&"data=0") && lines.contains(&"root=0"),
        || format!("{who}: {out:?} (want data=0 and root=0: nothing revealed)"),
    )
}

/// The user namespace `unmount_script` named.
fn user_ns(out: &str) -> Option<&str> {
    out.lines().find_map(|l| l.strip_prefix("userns="))
}

/// A program run on b for a as root (`ferry run --on b`) cannot unmount or move the mounts that
/// hide b's data directory and this machine's /root: it holds capabilities only in the guests'
/// user namespace (an identity mapping), which owns their locked mounts.
fn run_guest_cannot_unmount(c: &Cluster) -> Result<(), Failed> {
    let dir = common::scratch("users", "run-unmount");
    let script = unmount_script(c);
    let o = ferry_as_in(
        c,
        0,
        Some(&dir),
        &["run", "--on", "b", "--", "sh", "-c", &script],
    );
    let out = String::from_utf8_lossy(&o.stdout);
    nothing_revealed(c, "root's program on b", &out)?;
    // Its user namespace is not the machine's (nor node b's, which is the machine's).
    let ours = std::fs::read_link("/proc/self/ns/user").unwrap();
    check(
        user_ns(&out).is_some_and(|u| u.starts_with("user:[") && Path::new(u) != ours),
        || {
            format!(
                "root's program on b: {} (want a user namespace other than {})",
                describe(&o),
                ours.display()
            )
        },
    )
}

/// Runs `sh -c script` in `dir` as root on a, moves it to b, lets it go on (the file `go`
/// in `dir`) and returns what it wrote to `out` there within `secs` seconds: what a root guest
/// on b can see or do. The script ends in a sleep, killed once its output is in.
fn moved_guest_output(c: &Cluster, dir: &Path, script: &str, secs: u64) -> Result<String, Failed> {
    let child = Command::new("sh")
        .args(["-c", script])
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let shell = Sleeper(child);
    std::thread::sleep(Duration::from_millis(200));
    let pid = shell.pid().to_string();
    let o = ferry_as(c, 0, &["migrate", &pid, "--to", "b"]);
    check(o.status.success(), || {
        format!("migrate to b: {}", describe(&o))
    })?;
    std::fs::write(dir.join("go"), "").unwrap();
    let t0 = Instant::now();
    let out = loop {
        if let Ok(s) = std::fs::read_to_string(dir.join("out")) {
            break s;
        }
        if t0.elapsed() > Duration::from_secs(secs) {
            return Err(format!("the guest wrote nothing in {secs} s").into());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    drop(shell);
    Ok(out)
}

/// A root shell moved from a to b cannot unmount or move the mounts that hide b's data
/// directory and this machine's /root: the guest's mounts are locked together.
fn guest_cannot_unmount(c: &Cluster) -> Result<(), Failed> {
    let dir = common::scratch("users", "unmount");
    let script = format!(
        "while [ ! -e go ]; do sleep 0.05; done; ({}) > out.part 2>&1; mv out.part out; \
         exec sleep 1000",
        unmount_script(c)
    );
    let out = moved_guest_output(c, &dir, &script, 30)?;
    nothing_revealed(c, "the root guest on b", &out)
}

/// On a node with `confine_network`, a program run there for another node has a network of
/// its own: its only interface is a loopback, up, which it can use (a server and its client
/// on 127.0.0.1), and its node's daemon, reachable from the node itself, is not reachable
/// from it.
fn run_guest_network(c: &Cluster) -> Result<(), Failed> {
    let dir = common::scratch("users", "run-network");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let listen = c.listen_addr("b");
    let (addr, port) = listen
        .rsplit_once(':')
        .ok_or("no port in b's listen address")?;
    let script = format!(
        "ip -o link show | cut -d' ' -f2-3; \
         python3 -c 'import socket as s; l=s.create_server((\"127.0.0.1\", 0)); \
         c=s.create_connection(l.getsockname()); a=l.accept()[0]; c.sendall(b\"x\"); \
         print(\"lo=\" + a.recv(1).decode())'; \
         bash -c 'exec 3<>/dev/tcp/{addr}/{port}' 2>/dev/null; echo daemon=$?"
    );
    for uid in [0, ALICE] {
        let o = ferry_as_in(
            c,
            uid,
            Some(&dir),
            &["run", "--on", "b", "--", "sh", "-c", &script],
        );
        let out = String::from_utf8_lossy(&o.stdout);
        let lines: Vec<&str> = out.lines().collect();
        let links: Vec<&&str> = lines.iter().filter(|l| l.ends_with('>')).collect();
        check(
            links.len() == 1
                && links[0].starts_with("lo: <")
                && links[0].contains(",UP")
                && lines.contains(&"lo=x")
                && lines.contains(&"daemon=1"),
            || {
                format!(
                    "uid {uid}'s program on b: {} (want one link, lo, up and working, and b's \
                     daemon at {listen} unreachable)",
                    describe(&o)
                )
            },
        )?;
    }
    // From b itself (its init's namespaces), its daemon is there.
    let init = c.init_pid("b").ok_or("node b has no init")?;
    let o = Command::new("nsenter")
        .args(["-t", &init.to_string(), "-n", "--", "bash", "-c"])
        .arg(format!("exec 3<>/dev/tcp/{addr}/{port}"))
        .output()
        .unwrap();
    check(o.status.success(), || {
        format!("b's daemon from b itself: {}", describe(&o))
    })
}

// ---- Programs run for another node: namespaces of their own -----------------------------

/// `ferry ARGS` as `uid` on `node`'s CLI, in `dir`, left running (its stdout piped).
fn ferry_child(c: &Cluster, uid: u32, node: &str, dir: &Path, args: &[&str]) -> Sleeper {
    let mut cmd = if uid == 0 {
        let mut cmd = Command::new(FERRY);
        cmd.args(args).stdin(Stdio::null());
        cmd
    } else {
        let mut all = vec![FERRY];
        all.extend_from_slice(args);
        as_user(uid, &all)
    };
    let child = cmd
        .current_dir(dir)
        .env("FERRY_CLUSTER_DIR", &c.dir)
        .env("FERRY_NODE", node)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    Sleeper(child)
}

/// The PID on b (b's view) of the program `ferry ps` on b lists with command `command`.
fn pid_on_b(c: &Cluster, command: &str) -> Result<i64, Failed> {
    let t0 = Instant::now();
    loop {
        let o = Command::new(FERRY)
            .args(["ps", "--json"])
            .env("FERRY_CLUSTER_DIR", &c.dir)
            .env("FERRY_NODE", "b")
            .output()
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
        let pid = v.as_array().into_iter().flatten().find_map(|r| {
            (r["command"] == command && r["node"] == "b")
                .then(|| r["pid"].as_i64())
                .flatten()
        });
        if let Some(p) = pid {
            return Ok(p);
        }
        if t0.elapsed() > Duration::from_secs(20) {
            return Err(format!("{command:?} not in b's ps after 20 s: {}", describe(&o)).into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A `sleep SECS` of `uid`'s started on node b outside Ferry (in b's PID and mount
/// namespaces, through its init), and its PID there.
fn native_on_b(c: &Cluster, uid: u32, secs: &str) -> Result<(Sleeper, i64), Failed> {
    let mut args: Vec<String> = Vec::new();
    if let Some(init) = c.init_pid("b") {
        args.extend(["nsenter", "-t", &init.to_string(), "-p", "-m", "--"].map(String::from));
    }
    args.extend(
        [
            "setpriv",
            &format!("--reuid={uid}"),
            &format!("--regid={uid}"),
            "--clear-groups",
            "sleep",
            secs,
        ]
        .map(String::from),
    );
    let child = Command::new(&args[0])
        .args(&args[1..])
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let holder = Sleeper(child);
    let t0 = Instant::now();
    loop {
        for e in std::fs::read_dir("/proc").unwrap().flatten() {
            let path = e.path();
            let cmd = std::fs::read(path.join("cmdline")).unwrap_or_default();
            if cmd == format!("sleep\0{secs}\0").as_bytes() {
                let status = std::fs::read_to_string(path.join("status")).unwrap_or_default();
                let pid = status
                    .lines()
                    .find_map(|l| l.strip_prefix("NSpid:"))
                    .and_then(|v| v.split_whitespace().last()?.parse().ok());
                if let Some(p) = pid {
                    return Ok((holder, p));
                }
            }
        }
        if t0.elapsed() > Duration::from_secs(20) {
            return Err(format!("no `sleep {secs}` on b after 20 s").into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A program run on b for a cannot see or signal a process of b started outside it, nor
/// another guest's, as root or as a user, each of those processes its own user's (so that
/// `kill -0` would succeed if they were in its reach). PID 1 of its namespace is its init.
fn run_guest_sees_no_other_process(c: &Cluster) -> Result<(), Failed> {
    let dir = common::scratch("users", "run-pidns");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    for uid in [0, ALICE] {
        let guest = format!("sleep 10{uid}2");
        let (_native, n) = native_on_b(c, uid, &format!("10{uid}1"))?;
        let _other = ferry_child(
            c,
            uid,
            "a",
            &dir,
            &["run", "--on", "b", "--", "sh", "-c", &guest],
        );
        let g = pid_on_b(c, &format!("sh -c {guest}"))?;
        let script = format!(
            "echo self=$$; echo init=$(cut -d' ' -f1 /proc/1/stat); \
             for p in {n} {g}; do \
               if [ -e /proc/$p ] && tr '\\0' ' ' < /proc/$p/cmdline | grep -q 'sleep 10'; then echo sees-$p; fi; \
               if kill -0 $p 2>/dev/null && tr '\\0' ' ' < /proc/$p/cmdline 2>/dev/null | grep -q 'sleep 10'; then echo kills-$p; fi; \
             done; echo count=$(ls /proc | grep -c '^[0-9]')"
        );
        let o = ferry_as_in(
            c,
            uid,
            Some(&dir),
            &["run", "--on", "b", "--", "sh", "-c", &script],
        );
        let out = String::from_utf8_lossy(&o.stdout).to_string();
        let count = out
            .lines()
            .find_map(|l| l.strip_prefix("count="))
            .and_then(|n| n.parse::<u32>().ok())
            .unwrap_or(u32::MAX);
        check(
            o.status.success()
                && out
                    .lines()
                    .any(|l| l.strip_prefix("self=").is_some_and(|p| p != "1"))
                && out.lines().any(|l| l == "init=1")
                && !out.contains("sees-")
                && !out.contains("kills-")
                && count <= 6,
            || {
                format!(
                    "uid {uid}'s program on b, b's own process {n} and another guest {g} \
                     running: {} (want its init PID 1, neither seen nor signalled, only its \
                     own processes in /proc)",
                    describe(&o)
                )
            },
        )?;
    }
    Ok(())
}

/// Two programs run on b at once have different /tmp and /dev/shm: what one writes there the
/// other does not see, and its own stays as written.
fn run_guests_have_their_own_tmp(c: &Cluster) -> Result<(), Failed> {
    let dir = common::scratch("users", "run-tmp");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    for uid in [0, ALICE] {
        let ready = dir.join(format!("ready-{uid}"));
        let done = dir.join(format!("done-{uid}"));
        let first = format!(
            "echo $$ > /tmp/mine; echo $$ > /dev/shm/mine; touch {r}; \
             while [ ! -e {d} ]; do sleep 0.05; done; cat /tmp/mine /dev/shm/mine",
            r = ready.display(),
            d = done.display()
        );
        let mut one = ferry_child(
            c,
            uid,
            "a",
            &dir,
            &["run", "--on", "b", "--", "sh", "-c", &first],
        );
        let t0 = Instant::now();
        while !ready.exists() {
            if t0.elapsed() > Duration::from_secs(20) {
                return Err(format!("uid {uid}'s first program did not start in 20 s").into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let o = ferry_as_in(
            c,
            uid,
            Some(&dir),
            &[
                "run",
                "--on",
                "b",
                "--",
                "sh",
                "-c",
                "ls -A /tmp /dev/shm; cat /tmp/mine",
            ],
        );
        std::fs::write(&done, "").unwrap();
        let out = String::from_utf8_lossy(&o.stdout).to_string();
        check(!o.status.success() && !out.contains("mine"), || {
            format!(
                "uid {uid}'s second program saw the first one's /tmp: {}",
                describe(&o)
            )
        })?;
        let first_out = one.0.wait_with_output_ok();
        check(
            first_out.lines().count() == 2
                && first_out
                    .lines()
                    .all(|l| Some(l) == first_out.lines().next()),
            || format!("uid {uid}'s first program lost its /tmp: {first_out:?}"),
        )?;
    }
    Ok(())
}

/// A program run on b whose child leaves an orphan behind: the orphan's parent is the
/// program's init (PID 1 of its namespace), and once it ends nothing of it is left (no zombie
/// in the program's /proc). A program that runs on for more than a second has an init exec'd
/// afresh (`ferry __run-init`, not a copy of the daemon).
fn run_guest_orphans_reaped(c: &Cluster) -> Result<(), Failed> {
    let dir = common::scratch("users", "run-orphans");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let script = "o=$(sh -c 'sleep 0.5 >/dev/null 2>&1 & echo $!'); sleep 0.2; \
                  echo ppid=$(cut -d' ' -f4 /proc/$o/stat); sleep 0.8; \
                  [ -e /proc/$o ] && echo orphan-left; \
                  echo zombies=$(cat /proc/[0-9]*/stat 2>/dev/null | awk '$3 == \"Z\"' | wc -l); \
                  sleep 1; echo init=$(tr '\\0' ' ' < /proc/1/cmdline)";
    for uid in [0, ALICE] {
        let o = ferry_as_in(
            c,
            uid,
            Some(&dir),
            &["run", "--on", "b", "--", "sh", "-c", script],
        );
        let out = String::from_utf8_lossy(&o.stdout).to_string();
        check(
            o.status.success()
                && out.lines().any(|l| l == "ppid=1")
                && out.lines().any(|l| l == "zombies=0")
                && !out.contains("orphan-left")
                && out.contains("__run-init"),
            || format!("uid {uid}'s program's orphan on b: {}", describe(&o)),
        )?;
    }
    Ok(())
}

trait WaitOk {
    /// Its stdout once it has ended.
    fn wait_with_output_ok(&mut self) -> String;
}

impl WaitOk for Child {
    fn wait_with_output_ok(&mut self) -> String {
        use std::io::Read;
        let mut out = String::new();
        if let Some(mut o) = self.stdout.take() {
            let _ = o.read_to_string(&mut out);
        }
        let _ = self.wait();
        out
    }
}
