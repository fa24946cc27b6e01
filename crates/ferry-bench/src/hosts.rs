//! `ferry-bench hosts`: host selection as the cluster grows, and eviction.
//!
//! 1. The pure policy (`ferry_policy::hosts::select` for 1 and 10 hosts, and the fairness
//!    `reclaim_candidate`) over 10 to 10,000 node loads, median of many runs.
//! 2. A real request, `ferry hosts get 1 --class cc` and its release, on a local cluster of 3
//!    nodes whose daemons hold 0 and then 1,000 simulated gossip entries besides
//!    (FERRY_SIMULATED_NODES): the CLI's wall time and the daemon's own (the simulated nodes
//!    have been idle less than an hour, so the grant goes to a real node, over mutual TLS).
//!    Sprite: 36 ms to connect, get one host and close (Table 7.1).
//! 3. Eviction: `ferry evict b --json` with 1 and then 3 guests on b (each a small shell loop
//!    moved there from a), then with one `ferry run --on b` program, the total time to free b.
//!    Sprite: 3.44 s on average, 3.26 guests.

use crate::common::{ferry_binary, markdown, seal_inherited_fds, Cluster};
use anyhow::{bail, Result};
use ferry_policy::hosts::{reclaim_candidate, select, HostRequest};
use ferry_policy::{HostGrant, NodeLoad};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct Args {
    /// Requests through the daemon per cluster size.
    #[arg(long, default_value_t = 100)]
    requests: usize,
    /// Evictions per number of guests.
    #[arg(long, default_value_t = 5)]
    evictions: usize,
    /// The ferry binary to measure (default: the workspace's release build).
    #[arg(long)]
    ferry: Option<PathBuf>,
    /// TCP port of the benchmark's own local clusters (127.0.0.11-13).
    #[arg(long, default_value_t = 7420)]
    port: u16,
}

fn loads(n: usize) -> Vec<(String, NodeLoad)> {
    (0..n)
        .map(|i| {
            let mut l = NodeLoad {
                runnable: (i % 3) as u32,
                cpus: 4,
                cpu_idle_pct: 50.0,
                free_memory_bytes: 8 << 30,
                console_idle_secs: Some((i as u64 * 7919) % 86400),
                accepting: i % 10 != 7,
                ..Default::default()
            };
            if i % 2 == 0 {
                l.grants.push(HostGrant {
                    class: "cc".into(),
                    uid: 1000 + (i as u32 % 7),
                    requester: "x".into(),
                    holder: i as i32,
                    since_unix_ms: i as u64,
                });
            }
            (format!("n{i}"), l)
        })
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    v[v.len() / 2]
}

fn policy_table() -> String {
    let mut rows = vec![vec![
        "nodes".to_string(),
        "select 1 (µs)".into(),
        "select 10 (µs)".into(),
        "fairness reclaim (µs)".into(),
    ]];
    for n in [10, 100, 1000, 10000] {
        let l = loads(n);
        let refs: Vec<(&str, &NodeLoad)> = l.iter().map(|(n, l)| (n.as_str(), l)).collect();
        let runs = (200_000 / n).clamp(20, 2000);
        let time = |f: &dyn Fn()| {
            median(
                (0..runs)
                    .map(|_| {
                        let t = Instant::now();
                        f();
                        t.elapsed().as_secs_f64() * 1e6
                    })
                    .collect(),
            )
        };
        let req = |count| HostRequest {
            class: "sim",
            uid: 1,
            count,
            exclude: None,
        };
        let one = time(&|| {
            std::hint::black_box(select(refs.iter().copied(), &req(1)));
        });
        let ten = time(&|| {
            std::hint::black_box(select(refs.iter().copied(), &req(10)));
        });
        let fair = time(&|| {
            std::hint::black_box(reclaim_candidate(&refs, &req(1)));
        });
        rows.push(vec![
            n.to_string(),
            format!("{one:.1}"),
            format!("{ten:.1}"),
            format!("{fair:.1}"),
        ]);
    }
    markdown(&rows)
}

/// Three nodes (with `simulated` more that a's policy only imagines), once a sees both
/// peers' loads.
fn cluster_up(ferry: &Path, port: u16, simulated: usize) -> Result<Cluster> {
    let c = Cluster::up_fresh(
        ferry,
        &format!("ferry-bench-hosts.{}.{simulated}", std::process::id()),
        &[
            "--nodes",
            "3",
            "--port",
            &port.to_string(),
            "--isolation",
            "shared",
        ],
        &[("FERRY_SIMULATED_NODES", &simulated.to_string())],
    )?;
    // Until a sees both peers' loads.
    let t = Instant::now();
    loop {
        let o = ferry_cmd(&c, "a", &["nodes", "--json"]).output()?;
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
        let loaded = v
            .as_array()
            .map(|a| a.iter().filter(|n| !n["load"].is_null()).count())
            .unwrap_or(0);
        if loaded == 3 {
            break;
        }
        if t.elapsed() > Duration::from_secs(20) {
            bail!("the cluster's nodes never saw each other's load");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(c)
}

fn ferry_cmd(c: &Cluster, node: &str, args: &[&str]) -> Command {
    let mut cmd = c.ferry_on(node);
    cmd.args(args);
    cmd
}

fn json(c: &Cluster, node: &str, args: &[&str]) -> Result<serde_json::Value> {
    let o = ferry_cmd(c, node, args).output()?;
    if !o.status.success() {
        bail!(
            "ferry {} failed ({}): {}{}",
            args.join(" "),
            o.status,
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
    }
    Ok(serde_json::from_slice(&o.stdout)?)
}

struct Killed(Child);
impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn request_table(ferry: &Path, port: u16, requests: usize) -> Result<String> {
    let mut rows = vec![vec![
        "gossip entries".to_string(),
        "CLI wall (ms)".into(),
        "daemon (ms)".into(),
        "of which policy (µs)".into(),
        "release (ms)".into(),
        "no host".into(),
    ]];
    for sim in [0usize, 1000] {
        let c = cluster_up(ferry, port, sim)?;
        let holder = Killed(
            Command::new("sleep")
                .arg("3600")
                .stdin(Stdio::null())
                .spawn()?,
        );
        let h = holder.0.id().to_string();
        let (mut wall, mut daemon, mut pol, mut rel) = (vec![], vec![], vec![], vec![]);
        let mut failed = 0;
        for i in 0..requests + 5 {
            let t = Instant::now();
            let o = ferry_cmd(
                &c,
                "a",
                &[
                    "hosts", "get", "1", "--class", "cc", "--holder", &h, "--json",
                ],
            )
            .output()?;
            let w = t.elapsed().as_secs_f64() * 1e3;
            let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
            if r["hosts"][0].as_str().is_none() {
                // Reported, not fatal: on a loaded machine a host may not answer in time.
                eprintln!(
                    "ferry-bench: request {i} got no host: {}{}",
                    String::from_utf8_lossy(&o.stdout),
                    String::from_utf8_lossy(&o.stderr)
                );
                failed += 1;
                continue;
            }
            let t = Instant::now();
            let st = ferry_cmd(&c, "a", &["hosts", "release", "--holder", &h])
                .stdout(Stdio::null())
                .status()?;
            if !st.success() {
                bail!("ferry hosts release failed");
            }
            let rl = t.elapsed().as_secs_f64() * 1e3;
            if i >= 5 {
                wall.push(w);
                daemon.push(r["total_ms"].as_f64().unwrap_or(0.0));
                pol.push(r["select_us"].as_f64().unwrap_or(0.0));
                rel.push(rl);
            }
        }
        rows.push(vec![
            format!("{}", sim + 3),
            format!("{:.2}", median(wall)),
            format!("{:.2}", median(daemon)),
            format!("{:.0}", median(pol)),
            format!("{:.2}", median(rel)),
            failed.to_string(),
        ]);
    }
    Ok(markdown(&rows))
}

fn eviction_table(ferry: &Path, port: u16, evictions: usize) -> Result<String> {
    let c = cluster_up(ferry, port, 0)?;
    let dir = c.dir.join("evict");
    std::fs::create_dir_all(&dir)?;
    let mut rows = vec![vec![
        "guests".to_string(),
        "free b (ms, median)".into(),
        "per guest (ms, median)".into(),
        "runs".into(),
    ]];
    for guests in [1usize, 3] {
        let kids: Vec<Killed> = (0..guests)
            .map(|_| {
                // One process without children: nothing in it starts or ends mid-move.
                Command::new("setsid")
                    .args(["sleep", "3600"])
                    .current_dir(&dir)
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .map(Killed)
            })
            .collect::<std::io::Result<_>>()?;
        let (mut total, mut each) = (vec![], vec![]);
        for _ in 0..evictions {
            for k in &kids {
                let pid = k.0.id().to_string();
                let o = ferry_cmd(&c, "a", &["migrate", &pid, "--to", "b"]).output()?;
                if !o.status.success() {
                    bail!("migrate {pid} to b: {}", String::from_utf8_lossy(&o.stderr));
                }
            }
            let r = json(&c, "a", &["evict", "b", "--json"])?;
            let g = r["guests"].as_array().cloned().unwrap_or_default();
            if g.len() != guests || g.iter().any(|g| g["to"].is_null()) {
                bail!("eviction did not move every guest: {r}");
            }
            total.push(r["total_ms"].as_f64().unwrap_or(0.0));
            each.extend(g.iter().filter_map(|g| g["ms"].as_f64()));
        }
        rows.push(vec![
            guests.to_string(),
            format!("{:.0}", median(total)),
            format!("{:.0}", median(each)),
            evictions.to_string(),
        ]);
        drop(kids);
        std::thread::sleep(Duration::from_millis(500));
    }
    // A `ferry run --on b` program: b becomes its home (a deputy stays there, its stdio are
    // relayed); once evicted it no longer runs on b: a fresh one each run.
    let (mut total, mut each) = (vec![], vec![]);
    for _ in 0..evictions {
        let mut run = Killed(
            ferry_cmd(&c, "a", &["run", "--on", "b", "--", "sleep", "3600"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()?,
        );
        let t = Instant::now();
        while !ps_lists_run(&c, run.0.id())? {
            if t.elapsed() > Duration::from_secs(10) {
                bail!("ferry run --on b never started its program");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let r = json(&c, "a", &["evict", "b", "--json"])?;
        let g = r["guests"].as_array().cloned().unwrap_or_default();
        if g.len() != 1 || g[0]["to"].is_null() {
            bail!("eviction did not move the ferry run program: {r}");
        }
        if run.0.try_wait()?.is_some() {
            bail!("ferry run ended when its program was evicted");
        }
        total.push(r["total_ms"].as_f64().unwrap_or(0.0));
        each.extend(g.iter().filter_map(|g| g["ms"].as_f64()));
    }
    rows.push(vec![
        "1 (`ferry run`)".into(),
        format!("{:.0}", median(total)),
        format!("{:.0}", median(each)),
        evictions.to_string(),
    ]);
    Ok(markdown(&rows))
}

/// Whether b runs the program of `ferry run` PID `home_pid` (ps on b).
fn ps_lists_run(c: &Cluster, home_pid: u32) -> Result<bool> {
    let v = json(c, "b", &["ps", "--json"])?;
    Ok(v.as_array().is_some_and(|a| {
        a.iter()
            .any(|p| p["home_pid"] == home_pid && p["kind"] == "remote-exec" && p["node"] == "b")
    }))
}

pub fn run(a: Args) -> Result<()> {
    // The guests must hold nothing of whatever started the benchmark: a pipe inherited from it
    // is shared with a process that stays behind, which a move from a guest's node refuses.
    seal_inherited_fds();
    let ferry = ferry_binary(a.ferry.as_deref())?;
    let load = || std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "ferry: {}; load average at the start: {}",
        ferry.display(),
        load().trim()
    );
    println!(
        "Host selection, the policy alone (median):\n\n{}",
        policy_table()
    );
    println!(
        "A request for one host through node a's daemon (median of {}; Sprite: 36 ms):\n\n{}",
        a.requests,
        request_table(&ferry, a.port, a.requests)?
    );
    println!(
        "Eviction (Sprite: 3.44 s to free a host, 3.26 guests on average):\n\n{}",
        eviction_table(&ferry, a.port, a.evictions)?
    );
    println!("load average at the end: {}", load().trim());
    Ok(())
}
