//! The test bed: `ferry cluster up --isolation separate`, with real namespaces and real daemons.
//! A program run on node b sees b's host name, b's /tmp and /run, b's network (not a's
//! loopback services), its own PID namespace, and the same shared tree as a; a process moved
//! a -> b -> a carries on, its files in the shared tree right throughout; `cluster down` leaves
//! no namespace, link, route or mount behind, even with a guest still on b; and two clusters up
//! at once each get their own subnet and bridge.

use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

mod common;

use common::cluster::{Cluster, Isolation};

fn text(o: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}stderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A fresh directory in the shared tree.
fn shared_scratch(name: &str) -> PathBuf {
    let d = Cluster::shared_tree()
        .join("testbed")
        .join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `ferry run --on NODE -- bash -c SCRIPT` from node a, in `cwd`; its output.
fn run_on(c: &Cluster, node: &str, cwd: &Path, script: &str) -> Output {
    c.ferry("a")
        .args(["run", "--on", node, "--", "bash", "-c", script])
        .current_dir(cwd)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

fn ip(args: &[&str]) -> Output {
    Command::new("ip").args(args).output().unwrap()
}

/// The inode numbers of namespace `kind` of every process on this machine.
fn namespaces(kind: &str) -> Vec<String> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.parse::<i32>().is_ok())
        })
        .filter_map(|e| std::fs::read_link(e.path().join("ns").join(kind)).ok())
        .map(|l| l.display().to_string())
        .collect()
}

fn ns_of(pid: &str, kind: &str) -> String {
    std::fs::read_link(format!("/proc/{pid}/ns/{kind}"))
        .unwrap()
        .display()
        .to_string()
}

fn wait_until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_program_on_b_sees_b() {
    let c = Cluster::up_isolated("tb-sees", 2, Isolation::Separate);
    let slot = c.net_slot().expect("a separate cluster has a subnet");
    let dir = shared_scratch("sees");
    let me = std::process::id();
    // Here (node a, this machine's namespaces): a marker in /tmp, a file in the shared tree, a
    // service on loopback.
    let marker = format!("/tmp/ferry-testbed-{me}");
    std::fs::write(&marker, "a").unwrap();
    std::fs::write(dir.join("from-a"), "written on a\n").unwrap();
    let service = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = service.local_addr().unwrap().port();
    let script = format!(
        "echo host=$(hostname); \
         test -e {marker} && echo tmp=a || echo tmp=own; \
         echo b > /tmp/ferry-testbed-b-{me}; \
         test -e /run/ferry/net.lock && echo run=a || echo run=own; \
         echo shared=$(cat from-a); echo written on b > from-b; \
         case \"$(tr '\\0' ' ' < /proc/1/cmdline)\" in *__node-init*) echo init=node;; *__run-init*|*' daemon '*) echo init=own;; *) echo init=other;; esac; \
         (exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null && echo loopback=a || echo loopback=own; \
         ip -4 route | sed 's/^/route=/'"
    );
    let o = run_on(&c, "b", &dir, &script);
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    let why = || {
        format!(
            "{}\n{}",
            text(&o),
            common::cluster::daemon_logs(&c.dir, &["a", "b"])
        )
    };
    assert!(o.status.success(), "{}", why());
    for want in [
        "host=b\n",
        "tmp=own\n",
        "run=own\n",
        "shared=written on a\n",
        // PID 1 is its own namespace's init (a program run for another node gets PID
        // namespaces of its own, under b's), not a's init, nor b's node init.
        "init=own\n",
        "loopback=own\n",
    ] {
        assert!(out.contains(want), "no {want:?} in:\n{}", why());
    }
    // Its only route is to the cluster's subnet: no default route, no way out.
    let routes: Vec<&str> = out.lines().filter(|l| l.starts_with("route=")).collect();
    assert_eq!(routes.len(), 1, "{}", why());
    assert!(
        routes[0].starts_with(&format!("route=169.254.{slot}.0/24 dev eth0")),
        "{}",
        why()
    );
    assert!(!Path::new(&format!("/tmp/ferry-testbed-b-{me}")).exists());
    assert_eq!(
        std::fs::read_to_string(dir.join("from-b")).unwrap(),
        "written on b\n"
    );
    // The same program on a does see a's /tmp and loopback service: the checks above can tell.
    let o = run_on(&c, "a", &dir, &script);
    let here = String::from_utf8_lossy(&o.stdout).to_string();
    for want in ["tmp=a\n", "run=a\n", "loopback=a\n"] {
        assert!(here.contains(want), "no {want:?} on a:\n{}", text(&o));
    }
    // Here, b's address is on the cluster's bridge.
    let o = ip(&["route", "get", &format!("169.254.{slot}.2")]);
    assert!(
        String::from_utf8_lossy(&o.stdout).contains(&format!("dev ferry{slot} ")),
        "{}",
        text(&o)
    );
    let _ = std::fs::remove_file(&marker);
    // (The run on a wrote its file into our /tmp.)
    let _ = std::fs::remove_file(format!("/tmp/ferry-testbed-b-{me}"));
    drop(service);
}

/// A program in the shared tree that appends `N HOSTNAME` to a file it holds open, ten times a
/// second, until killed. (Moved, it still names its home.)
const COUNTER: &str =
    "exec 3>>count; i=0; while :; do i=$((i+1)); echo \"$i $(hostname)\" >&3; sleep 0.1; done";

#[test]
fn moved_a_to_b_and_back_keeps_its_shared_files() {
    let c = Cluster::up_isolated("tb-move", 2, Isolation::Separate);
    let dir = shared_scratch("move");
    let mut child = Command::new("setsid")
        .args(["sh", "-c", COUNTER])
        .current_dir(&dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id() as i32;
    let lines = || std::fs::read_to_string(dir.join("count")).unwrap_or_default();
    let grows = |what: &str| {
        let n = lines().lines().count();
        wait_until(what, Duration::from_secs(10), || {
            lines().lines().count() >= n + 5
        });
    };
    grows("the counter to start");
    let o = c.run("a", &["migrate", &pid.to_string(), "--to", "b"]);
    assert!(o.status.success(), "a -> b: {}", text(&o));
    // (The original stays here as the deputy of its body, our child still.)
    grows("the counter to count on b");
    let o = c.run("b", &["migrate", &pid.to_string(), "--to", "a", "--json"]);
    assert!(o.status.success(), "b -> a: {}", text(&o));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let there = report["dest_pid"].as_i64().unwrap() as i32;
    grows("the counter to count on a again");
    kill9(there);
    // The deputy ends as its body did.
    let st = child.wait().unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&st),
        Some(9),
        "{st:?}"
    );
    let all = lines();
    let mut hosts = Vec::new();
    for (i, l) in all.lines().enumerate() {
        let (n, host) = l.split_once(' ').unwrap_or_else(|| panic!("line {l:?}"));
        assert_eq!(n, (i + 1).to_string(), "lost or doubled lines:\n{all}");
        if hosts.last() != Some(&host) {
            hosts.push(host);
        }
    }
    // A body has its home's host name wherever it runs (its UTS namespace is named after it).
    let home = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    assert_eq!(hosts, [home.trim()], "the host names it saw:\n{all}");
}

fn kill9(pid: i32) {
    let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
}

#[test]
fn cluster_down_leaves_nothing_behind() {
    let c = Cluster::up_isolated("tb-down", 3, Isolation::Separate);
    let slot = c.net_slot().unwrap();
    let dir = shared_scratch("down");
    // A guest on b, which must end with its node.
    let mut child = Command::new("setsid")
        .args(["sleep", "1000"])
        .current_dir(&dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let o = c.run("a", &["migrate", &child.id().to_string(), "--to", "b"]);
    assert!(o.status.success(), "{}", text(&o));
    // The original stays here as the guest's deputy (our child) until the cluster goes.
    let inits: Vec<i32> = ["b", "c"].iter().map(|n| c.init_pid(n).unwrap()).collect();
    let kinds = ["net", "mnt", "pid", "uts", "ipc"];
    let theirs: Vec<String> = inits
        .iter()
        .flat_map(|p| kinds.iter().map(move |k| ns_of(&p.to_string(), k)))
        .collect();
    for k in kinds {
        assert!(
            !theirs.contains(&ns_of("self", k)),
            "a node shares our {k} namespace"
        );
    }
    let links = || {
        let o = ip(&["-o", "link", "show"]);
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter(|l| l.contains(&format!(": ferry{slot}")))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    assert_eq!(links().len(), 3, "bridge and two veths: {:?}", links());
    let o = Command::new(common::cluster::FERRY)
        .args(["cluster", "down", "--dir"])
        .arg(&c.dir)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    for p in &inits {
        assert!(
            common::proc_state(*p).is_none_or(|s| s == 'Z'),
            "node init {p} still runs"
        );
    }
    // Its home's daemon gone, the deputy is gone too (killed with its tracer).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the deputy outlived the cluster"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(links(), Vec::<String>::new(), "links left");
    let o = ip(&[
        "-4",
        "route",
        "show",
        "exact",
        &format!("169.254.{slot}.0/24"),
    ]);
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "", "route left");
    // Nothing goes out of eth0 to the node's old address: the guard route stays.
    let o = ip(&["route", "get", &format!("169.254.{slot}.2")]);
    assert!(!o.status.success(), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("unreachable")
            || String::from_utf8_lossy(&o.stderr).contains("No route"),
        "{}",
        text(&o)
    );
    // The nodes' namespaces (and so their mounts) are gone once no process holds them.
    wait_until(
        "the nodes' namespaces to go",
        Duration::from_secs(5),
        || {
            let now: Vec<String> = kinds.iter().flat_map(|k| namespaces(k)).collect();
            !theirs.iter().any(|n| now.contains(n))
        },
    );
    let mut mounts = String::new();
    std::fs::File::open("/proc/self/mountinfo")
        .unwrap()
        .read_to_string(&mut mounts)
        .unwrap();
    assert!(
        !mounts.contains(&c.dir.display().to_string()),
        "mounts left:\n{mounts}"
    );
}

#[test]
fn two_separate_clusters_at_once() {
    let one = Cluster::up_isolated("tb-one", 2, Isolation::Separate);
    let two = Cluster::up_isolated("tb-two", 2, Isolation::Separate);
    let (s1, s2) = (one.net_slot().unwrap(), two.net_slot().unwrap());
    assert_ne!(s1, s2);
    let dir = shared_scratch("two");
    for (c, slot) in [(&one, s1), (&two, s2)] {
        let o = run_on(c, "b", &dir, "hostname; ip -4 -o addr show dev eth0");
        let out = String::from_utf8_lossy(&o.stdout).to_string();
        assert!(o.status.success(), "{}", text(&o));
        assert!(out.starts_with("b\n"), "{}", text(&o));
        assert!(
            out.contains(&format!("169.254.{slot}.2/24")),
            "{}",
            text(&o)
        );
        let o = c.run("a", &["nodes", "--json"]);
        let nodes: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(nodes.as_array().map(Vec::len), Some(2), "{}", text(&o));
    }
    drop(one);
    let o = run_on(&two, "b", &dir, "hostname");
    assert_eq!(String::from_utf8_lossy(&o.stdout), "b\n", "{}", text(&o));
}

#[test]
fn a_file_only_here_keeps_the_process_here() {
    let c = Cluster::up_isolated("tb-private", 2, Isolation::Separate);
    // Its stdout is a file in this node's /tmp, which b does not have; and it has enough
    // memory that the image is still on its way when b finds out.
    let out = format!("/tmp/ferry-testbed-private-{}", std::process::id());
    let script = "import time\nx = b'\\1' * (128 << 20)\ntime.sleep(1000)";
    let child = Command::new("setsid")
        .args(["sh", "-c", &format!("exec python3 -c \"{script}\" > {out}")])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let child = Killed(child);
    let pid = child.0.id() as i32;
    wait_until("python to start", Duration::from_secs(10), || {
        std::fs::read_to_string(format!("/proc/{pid}/status"))
            .is_ok_and(|s| s.contains("State:\tS") && s.contains("python"))
            && std::fs::read_link(format!("/proc/{pid}/fd/1")).is_ok_and(|l| l == Path::new(&out))
    });
    std::thread::sleep(Duration::from_millis(300));
    let o = c.run("a", &["migrate", &pid.to_string(), "--to", "b"]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{}", text(&o));
    // The reason is b's, and names the file.
    assert!(e.contains("keeps running on a"), "{}", text(&o));
    assert!(e.contains(&out), "{}", text(&o));
    assert_eq!(common::proc_state(pid).map(|s| s != 'Z'), Some(true));
    drop(child);
    let _ = std::fs::remove_file(&out);
}

/// A child killed (and reaped) when the test ends, passed or not.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_killed_tests_cluster_is_stopped_by_the_next() {
    // A cluster left by a test process that is gone (as if it had been killed mid-test), in a
    // directory of clusters of its own (the other tests here clear the usual one).
    let mut gone = Command::new("true").spawn().unwrap();
    let dead = gone.id();
    gone.wait().unwrap();
    let root = shared_scratch("stale");
    let dir = root.join(format!("tb-stale-{dead}"));
    let o = Command::new(common::cluster::FERRY)
        .args(["cluster", "up", "--nodes", "2", "--port", "7079", "--dir"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    // Guests are confined unless the cluster was told otherwise.
    for node in ["a", "b"] {
        let cfg = std::fs::read_to_string(dir.join(node).join("ferry.toml")).unwrap();
        assert!(
            cfg.lines()
                .any(|l| l.replace(' ', "") == "confine_guests=true"),
            "node {node}'s config does not confine guests:\n{cfg}"
        );
    }
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("cluster.json")).unwrap()).unwrap();
    let bridge = format!("/sys/class/net/ferry{}/ifindex", state["net"]["slot"]);
    let ifindex = std::fs::read_to_string(&bridge).unwrap();
    let init = common::cluster::init_pid(&dir, "b").unwrap();
    let daemon: i32 = std::fs::read_to_string(dir.join("a").join("daemon.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // What the next test's cluster does first.
    common::cluster::stop_stale_clusters(&root);
    // (Another cluster may have the bridge's name by now, not its index.)
    assert_ne!(
        std::fs::read_to_string(&bridge).ok(),
        Some(ifindex),
        "bridge left"
    );
    for p in [init, daemon] {
        assert!(
            common::proc_state(p).is_none_or(|s| s == 'Z'),
            "PID {p} left"
        );
    }
    assert!(!dir.exists());
}
