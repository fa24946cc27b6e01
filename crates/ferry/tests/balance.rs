//! Automatic load balancing between real daemons (ferry-daemon/src/balancer.rs), on a cluster
//! of two separate nodes held to half a CPU each (`--cpu-quota 0.5`): an overloaded node sheds a
//! CPU-bound process handed to Ferry to the idle node, which keeps it for its minimum stay even
//! when it becomes the busier one; a process nobody handed over is never moved; a program started
//! with `ferry run --balance` is moved like one handed over, its caller seeing its output and
//! exit status as if it had stayed; and the decision log says why, moving or not. Nothing here
//! times Ferry.

mod common;

use common::cluster::{Cluster, Isolation};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Busy loops this test started, killed however it ends (node a's are this machine's: they
/// would outlive the cluster).
#[derive(Default)]
struct Loops(Vec<Child>);

impl Loops {
    /// A busy loop at home on node a, in a's CPU cgroup (`cgroup`: its cgroup.procs file).
    fn start(&mut self, cgroup: &str) -> i32 {
        let child = Command::new("setsid")
            .args(["sh", "-c", "while :; do :; done"])
            // Not /tmp: a separate node has a /tmp of its own.
            .current_dir("/")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        self.0.push(child);
        std::fs::write(cgroup, pid.to_string()).unwrap();
        pid
    }

    /// A busy loop run on `node` through `ferry run` for `secs` seconds.
    fn run_on(&mut self, c: &Cluster, node: &str, secs: u32) {
        let child = c
            .ferry("a")
            .args([
                "run",
                "--on",
                node,
                "--",
                "timeout",
                &secs.to_string(),
                "sh",
                "-c",
            ])
            .arg("while :; do :; done")
            .current_dir("/")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.0.push(child);
    }
}

impl Drop for Loops {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The cgroup.procs file of node `node`'s CPU cgroup.
fn cgroup_procs(c: &Cluster, node: &str) -> String {
    let cg = std::fs::read_to_string(format!("/proc/{}/cgroup", c.daemon_pid(node))).unwrap();
    let path = cg
        .lines()
        .find_map(|l| {
            let mut f = l.splitn(3, ':');
            let _ = f.next();
            let ctl = f.next()?;
            ctl.split(',').any(|x| x == "cpu").then(|| f.next())?
        })
        .unwrap()
        .to_string();
    assert!(path.ends_with(&format!("/{node}")), "{node} in {path}");
    format!("/sys/fs/cgroup/cpu{path}/cgroup.procs")
}

fn quota_cluster(tag: &str) -> Cluster {
    common::seal_inherited_fds();
    let c = Cluster::up_full(tag, 2, &[], Isolation::Separate, &["--cpu-quota", "0.5"]);
    for n in ["a", "b"] {
        let o = c.run(
            n,
            &[
                "balance",
                "set",
                "period_ms = 500",
                "min_age_secs = 1",
                "min_stay_secs = 12",
                "cooldown_secs = 2",
            ],
        );
        assert!(o.status.success(), "balance set on {n}: {o:?}");
    }
    c
}

/// The balancer's decisions on `node`.
fn log(c: &Cluster, node: &str) -> Vec<serde_json::Value> {
    let o = c.run(node, &["balance", "log", "--json"]);
    assert!(o.status.success(), "balance log on {node}: {o:?}");
    serde_json::from_slice::<Vec<serde_json::Value>>(&o.stdout).unwrap()
}

/// (home PID, node) of every process under Ferry.
fn placed(c: &Cluster) -> Vec<(i64, String)> {
    let o = c.run("a", &["ps", "--json"]);
    assert!(o.status.success(), "ps: {o:?}");
    serde_json::from_slice::<Vec<serde_json::Value>>(&o.stdout)
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["home_pid"].as_i64().unwrap(),
                p["node"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

fn traced(pid: i32) -> bool {
    common::status_field(pid, "TracerPid") != "0"
}

#[test]
fn an_overloaded_node_sheds_a_process_handed_over_and_it_stays_its_minimum_stay() {
    let c = quota_cluster("balance-shed");
    let procs = cgroup_procs(&c, "a");
    let mut loops = Loops::default();
    // Three busy loops on a (half a CPU): two handed to Ferry, one not.
    let handed = [loops.start(&procs), loops.start(&procs)];
    let mine = loops.start(&procs);
    for p in handed {
        let o = c.run("a", &["balance", "add", &p.to_string()]);
        assert!(o.status.success(), "balance add {p}: {o:?}");
    }

    // One of the two goes to b, the idle node.
    let t0 = Instant::now();
    let moved = loop {
        if let Some((pid, node)) = placed(&c).into_iter().next() {
            assert_eq!(node, "b");
            break pid as i32;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "nothing moved in 30 s; a's decisions: {:#?}\n{}",
            log(&c, "a"),
            c.log("a")
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(
        handed.contains(&moved),
        "PID {moved} moved, handed: {handed:?}"
    );
    let arrived = Instant::now();
    // The move is listed (ps) as soon as it commits; a's balancer logs it when its migration
    // returns, a moment later.
    let a_log = loop {
        let a_log = log(&c, "a");
        if a_log.iter().any(|d| d["action"] == "moved")
            || arrived.elapsed() > Duration::from_secs(10)
        {
            break a_log;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let m = a_log
        .iter()
        .find(|d| d["action"] == "moved")
        .expect("a logged the move");
    assert_eq!(m["pid"], moved);
    assert_eq!(m["to"], "b");
    let decided = a_log
        .iter()
        .find(|d| d["action"] == "move")
        .expect("a logged its decision to move");
    let why = decided["reason"].as_str().unwrap();
    assert!(
        why.contains("least loaded") && why.contains("imbalance"),
        "{why}"
    );

    // Now b is made the busier one (four loops run there, not handed over): b would send
    // the process back at once, but it has not stayed its minimum stay (12 s).
    for _ in 0..4 {
        loops.run_on(&c, "b", 30);
    }
    while arrived.elapsed() < Duration::from_secs(10) {
        let now = placed(&c);
        assert!(
            now.iter().any(|(p, n)| *p == moved as i64 && n == "b"),
            "PID {moved} left b {:.1} s after it arrived (minimum stay 12 s): {now:?}\nb: {:#?}",
            arrived.elapsed().as_secs_f64(),
            log(&c, "b")
        );
        assert!(
            !now.iter().any(|(p, _)| *p == mine as i64),
            "PID {mine}, never handed over, was moved"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    let b_log = log(&c, "b");
    assert!(
        b_log.iter().any(
            |d| d["action"] == "stay" && d["reason"].as_str().unwrap().contains("minimum stay")
        ),
        "b never said it kept PID {moved} for its minimum stay: {b_log:#?}"
    );
    // The process not handed over never left, nor was touched.
    assert!(!traced(mine), "PID {mine} is traced");
    assert_eq!(common::proc_state(mine), Some('R'));
}

#[test]
fn a_process_not_handed_over_is_never_moved_and_the_log_says_why() {
    let c = quota_cluster("balance-none");
    let procs = cgroup_procs(&c, "a");
    let mut loops = Loops::default();
    let pids = [
        loops.start(&procs),
        loops.start(&procs),
        loops.start(&procs),
    ];
    // Loaded six times over (3 loops on half a CPU), b idle: long enough for several
    // decisions (every 0.5 s) with the node's load settled.
    std::thread::sleep(Duration::from_secs(6));
    assert!(placed(&c).is_empty(), "moved: {:?}", placed(&c));
    for p in pids {
        assert!(!traced(p), "PID {p} is traced");
    }
    let a_log = log(&c, "a");
    assert!(
        a_log.iter().all(|d| d["action"] == "stay"),
        "a did more than stay: {a_log:#?}"
    );
    assert!(
        a_log.iter().any(|d| d["reason"]
            .as_str()
            .unwrap()
            .contains("no process here is handed to Ferry")),
        "{a_log:#?}"
    );
    // a knows it is loaded (its CPU cgroup's demand, not the machine's), and b idle.
    let o = c.run("a", &["nodes", "--json"]);
    let nodes: Vec<serde_json::Value> = serde_json::from_slice(&o.stdout).unwrap();
    let demand = |n: &str| {
        nodes.iter().find(|x| x["name"] == n).unwrap()["load"]["demand"]
            .as_f64()
            .unwrap()
    };
    assert!(demand("a") > 2.0, "{nodes:#?}");
    assert!(demand("b") < 0.5, "{nodes:#?}");
}

/// `ferry run --on a [--balance]` of a busy loop that prints `started`, spins until `stop`
/// exists in `dir`, prints `done` and exits 3; its stdout goes to `dir/out-N`.
fn run_loop(c: &Cluster, dir: &std::path::Path, n: usize, balance: bool) -> Child {
    let mut args = vec!["run", "--on", "a"];
    if balance {
        args.push("--balance");
    }
    args.extend([
        "--",
        "python3",
        "-c",
        "import os, sys\nprint('started', flush=True)\n\
         while not os.path.exists('stop'):\n    pass\nprint('done', flush=True)\nsys.exit(3)\n",
    ]);
    c.ferry("a")
        .args(&args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(dir.join(format!("out-{n}"))).unwrap())
        .stderr(std::fs::File::create(dir.join(format!("err-{n}"))).unwrap())
        .spawn()
        .unwrap()
}

#[test]
fn a_program_started_with_ferry_run_balance_is_moved_off_a_loaded_node_its_stream_following() {
    let c = quota_cluster("balance-run");
    let dir = Cluster::shared_tree()
        .join("balance")
        .join(format!("run-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // Three busy loops run on a (half a CPU) through `ferry run`: two with --balance.
    let mut runs = Vec::new();
    for n in 0..3 {
        runs.push(run_loop(&c, &dir, n, n < 2));
    }
    let ps = || -> Vec<serde_json::Value> {
        let o = c.run("a", &["ps", "--json"]);
        serde_json::from_slice(&o.stdout).unwrap_or_default()
    };
    // Each program's PID on a, by its `ferry run`'s.
    let t0 = Instant::now();
    let programs: Vec<i64> = loop {
        let now = ps();
        let found: Vec<i64> = runs
            .iter()
            .filter_map(|r| {
                now.iter()
                    .find(|p| p["home_pid"] == r.id() && p["kind"] == "remote-exec")
                    .map(|p| p["pid"].as_i64().unwrap())
            })
            .collect();
        if found.len() == 3 {
            break found;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "not started: {now:#?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    // One of the two handed over goes to b; the third never moves.
    let moved = loop {
        if let Some(p) = ps().iter().find(|p| p["node"] == "b") {
            break p["home_pid"].as_i64().unwrap();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(40),
            "nothing moved in 40 s; a's decisions: {:#?}\n{}",
            log(&c, "a"),
            c.log("a")
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(
        programs[..2].contains(&moved),
        "PID {moved} moved; the --balance ones: {:?}",
        &programs[..2]
    );
    let t1 = Instant::now();
    let a_log = loop {
        let a_log = log(&c, "a");
        if a_log.iter().any(|d| d["action"] == "moved") || t1.elapsed() > Duration::from_secs(10) {
            break a_log;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let m = a_log
        .iter()
        .find(|d| d["action"] == "moved")
        .expect("a logged the move");
    assert_eq!(m["pid"], moved);
    assert_eq!(m["to"], "b");
    // Their callers see nothing: each prints what its program wrote and exits with its code.
    std::fs::write(dir.join("stop"), b"").unwrap();
    for (n, r) in runs.iter_mut().enumerate() {
        let t = Instant::now();
        let st = loop {
            if let Some(st) = r.try_wait().unwrap() {
                break st;
            }
            assert!(t.elapsed() < Duration::from_secs(20), "run {n} did not end");
            std::thread::sleep(Duration::from_millis(50));
        };
        let out = std::fs::read_to_string(dir.join(format!("out-{n}"))).unwrap();
        let err = std::fs::read_to_string(dir.join(format!("err-{n}"))).unwrap();
        assert_eq!(st.code(), Some(3), "run {n}: {st:?} {err}");
        assert_eq!(out, "started\ndone\n", "run {n}: {err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
