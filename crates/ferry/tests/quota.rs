//! Unequal nodes on one machine: `ferry cluster up --cpu-quota FRACTION` holds each node's
//! daemon and everything it runs to FRACTION of one CPU (cgroup v1 `cpu.cfs_quota_us`). A busy
//! loop run on such a node gets about its quota, not a whole CPU; a busy process moved there
//! from home joins the node's cgroup (not the one its image names) and is held to it as well;
//! `cluster down` removes the cgroups. The CPU checks have wide margins: they tell a quota from
//! none, they time nothing of Ferry's.

mod common;

use common::cluster::{Cluster, Isolation};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn text(o: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}stderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The cpu-hierarchy cgroup of `pid`, as /proc/PID/cgroup says (`/ferry-cluster-X/b`).
fn cpu_cgroup_of(pid: i32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            let mut f = l.splitn(3, ':');
            let _ = f.next();
            let ctl = f.next()?;
            ctl.split(',').any(|c| c == "cpu").then(|| f.next())?
        })
        .unwrap_or_default()
        .to_string()
}

/// CPU time (user + system) of `pid` in seconds.
fn cpu_seconds(pid: i32) -> f64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let f: Vec<&str> = s
        .rsplit_once(')')
        .map(|(_, r)| r.split_whitespace().collect())
        .unwrap_or_default();
    // utime and stime are fields 14 and 15 (1-based), 11 and 12 after the command.
    let ticks: f64 = [11, 12]
        .iter()
        .map(|i| f.get(*i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0))
        .sum();
    ticks / 100.0
}

/// The share of one CPU `pid` gets over `span`.
fn cpu_share(pid: i32, span: Duration) -> f64 {
    let (c0, t0) = (cpu_seconds(pid), Instant::now());
    std::thread::sleep(span);
    (cpu_seconds(pid) - c0) / t0.elapsed().as_secs_f64()
}

#[test]
fn busy_loops_get_their_nodes_quota() {
    common::seal_inherited_fds();
    let c = Cluster::up_full(
        "quota",
        2,
        &[],
        Isolation::Separate,
        &["--cpu-quota", "0.25"],
    );
    for n in ["a", "b"] {
        let cg = cpu_cgroup_of(c.daemon_pid(n));
        assert!(
            cg.starts_with("/ferry-cluster-") && cg.ends_with(&format!("/{n}")),
            "daemon of {n} in cpu cgroup {cg:?}"
        );
    }
    // A busy loop run on b: its node's cgroup, and about a quarter of a CPU.
    let o = c
        .ferry("a")
        .args([
            "run",
            "--on",
            "b",
            "--",
            "sh",
            "-c",
            "grep -E '[:,]cpu[:,]' /proc/self/cgroup; \
             timeout 2 sh -c 'while :; do :; done'; cat /proc/$$/stat",
        ])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(out.contains("/b\n"), "run on b: {}", text(&o));
    // cutime + cstime of the shell: what the loop (through `timeout`) used, in ticks.
    let stat = out.lines().last().unwrap_or_default();
    let f: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, r)| r.split_whitespace().collect())
        .unwrap_or_default();
    let ticks: f64 = [13, 14]
        .iter()
        .map(|i| f.get(*i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0))
        .sum();
    let share = ticks / 100.0 / 2.0;
    assert!(
        share > 0.02 && share < 0.45,
        "a 2 s busy loop on a node of 0.25 CPU used {share:.2} CPU: {}",
        text(&o)
    );

    // A busy process started here (not held to any quota), moved to b: held to b's.
    let mut child = Command::new("setsid")
        .args(["sh", "-c", "while :; do :; done"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id() as i32;
    let free = cpu_share(pid, Duration::from_millis(700));
    let o = c.run("a", &["migrate", &pid.to_string(), "--to", "b", "--json"]);
    assert!(o.status.success(), "a -> b: {}", text(&o));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let there = c
        .host_pid("b", report["dest_pid"].as_i64().unwrap() as i32)
        .expect("the moved loop runs on b");
    let cg = cpu_cgroup_of(there);
    let held = cpu_share(there, Duration::from_secs(2));
    let _ = Command::new("kill")
        .args(["-9", &there.to_string()])
        .status();
    let _ = child.wait();
    assert!(
        cg.starts_with("/ferry-cluster-") && cg.ends_with("/b"),
        "the loop moved to b is in cpu cgroup {cg:?}, not b's"
    );
    assert!(
        held < 0.45,
        "the loop moved to b used {held:.2} CPU (here, before: {free:.2}); b has 0.25"
    );

    // `cluster down` takes the cgroups away.
    let parent = std::path::Path::new("/sys/fs/cgroup/cpu").join(
        cg.trim_start_matches('/')
            .rsplit_once('/')
            .map(|(p, _)| p)
            .unwrap_or_default(),
    );
    assert!(parent.is_dir(), "{}", parent.display());
    drop(c);
    assert!(
        !parent.exists(),
        "{} left after cluster down",
        parent.display()
    );
}

#[test]
fn a_quota_must_be_a_fraction_of_the_machine() {
    for bad in ["0", "-1", "1000", "nan"] {
        let dir = Cluster::clusters_dir().join(format!("quota-bad-{}", std::process::id()));
        let o = Command::new(common::cluster::FERRY)
            .args([
                "cluster",
                "up",
                "--nodes",
                "1",
                &format!("--cpu-quota={bad}"),
                "--dir",
            ])
            .arg(&dir)
            .output()
            .unwrap();
        assert!(!o.status.success(), "--cpu-quota {bad}: {}", text(&o));
        assert!(
            String::from_utf8_lossy(&o.stderr).contains("--cpu-quota"),
            "{}",
            text(&o)
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
