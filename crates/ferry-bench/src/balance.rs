//! `ferry-bench balance`: DUNES Fig 4.5's workload (Cruz & Park §4.4) under Ferry's automatic
//! load balancing, with Algorithm 1 (CPU only) against Algorithm 3 (CPU and measured data
//! rate), on 2 and 3 emulated nodes of half a CPU each (`ferry cluster up --cpu-quota 0.5`).
//!
//! The workload (`balance/dunes.c`): a writer Gw computes and writes 64 KiB chunks to two
//! readers through pipes, ten to Grs for one to Grl; the readers compute on what they read
//! (Grl ten times more per chunk, so both readers need about the same CPU); an independent
//! process I computes 40 ms and sleeps 60 ms in turn. All four start on node a, in a's CPU
//! cgroup, handed to the balancer (`ferry balance add`); b (and c) are idle. A pipe between a
//! moved process and one that stayed home is relayed by the daemons (crates/ferry-daemon
//! relay), at a CPU cost on both nodes: that is the communication cost DUNES' Algorithm 3
//! avoids. Each run starts a fresh cluster; the balancer decides alone; the table gives what it
//! moved (from `ferry balance log`) and when the group (Gw, Grs, Grl) and I finished.

use crate::common::Cluster;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct Args {
    /// The ferry binary [default: the workspace's release build, built if needed].
    #[arg(long)]
    pub ferry: Option<PathBuf>,
    /// Chunks (64 KiB) Gw writes to Grs; Grl gets one in ten.
    #[arg(long, default_value_t = 6000)]
    pub chunks: u64,
    /// Units of computation (16 xorshift rounds) Gw does per chunk; Grs does a third of that
    /// per chunk it reads, Grl ten times as much per chunk (so the readers need the same CPU).
    /// Fewer units per chunk: more communication for the same computation.
    #[arg(long, default_value_t = 15000)]
    pub units: u64,
    /// Rounds (40 ms of CPU, 60 ms asleep) of I.
    #[arg(long, default_value_t = 100)]
    pub rounds: u64,
    /// Each node's CPU quota.
    #[arg(long, default_value_t = 0.5)]
    pub quota: f64,
    /// Node counts to run (2 and 3 as in DUNES Fig 4.5 left and right).
    #[arg(long, value_delimiter = ',', default_value = "2,3")]
    pub nodes: Vec<usize>,
    /// Algorithms: none (balancing off), cpu (Algorithm 1), coupling (Algorithm 3).
    #[arg(long, value_delimiter = ',', default_value = "none,cpu,coupling")]
    pub algorithms: Vec<String>,
}

const SOURCE: &str = include_str!("balance/dunes.c");

/// A cluster of `n` separate nodes held to `quota` each, stopped on drop.
fn cluster_up(ferry: &Path, n: usize, quota: f64) -> Result<Cluster> {
    Cluster::up_fresh(
        ferry,
        &format!("ferry-bench-balance.{}", std::process::id()),
        &[
            "--nodes",
            &n.to_string(),
            "--cpu-quota",
            &quota.to_string(),
            "--port",
            "7396",
        ],
        &[],
    )
}

/// `ferry ARGS` on node `node`: its stdout.
fn ferry_out(c: &Cluster, node: &str, args: &[&str]) -> Result<Vec<u8>> {
    let o = c
        .ferry_on(node)
        .args(args)
        .output()
        .with_context(|| format!("run ferry {args:?}"))?;
    if !o.status.success() {
        bail!(
            "ferry {args:?} on {node}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    Ok(o.stdout)
}

/// The workload's binary, compiled into a directory every node sees (not /tmp: a separate
/// node has its own).
fn build_workload() -> Result<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/ferry-bench-balance");
    std::fs::create_dir_all(&dir)?;
    let bin = crate::common::build_c(&dir, "dunes", SOURCE, "the DUNES workload")?;
    Ok(bin.canonicalize()?)
}

struct Proc {
    role: &'static str,
    child: Child,
    ended: Option<f64>,
}

/// Starts `args` in the CPU cgroup whose cgroup.procs is `procs` (joined before exec), from
/// `/` with the given stdio.
fn start(procs: &Path, args: &[&str], stdin: Stdio, stdout: Stdio, stderr: Stdio) -> Result<Child> {
    let script = format!("echo $$ > {} && exec {}", procs.display(), args.join(" "));
    Command::new("sh")
        .args(["-c", &script])
        .current_dir("/")
        .stdin(stdin)
        .stdout(stdout)
        .stderr(stderr)
        .spawn()
        .with_context(|| format!("start {args:?}"))
}

struct Outcome {
    group_s: f64,
    i_s: f64,
    moves: Vec<String>,
}

fn run_one(ferry: &Path, bin: &Path, a: &Args, nodes: usize, alg: &str) -> Result<Outcome> {
    let c = cluster_up(ferry, nodes, a.quota)?;
    let names: Vec<String> = (0..nodes)
        .map(|i| ((b'a' + i as u8) as char).to_string())
        .collect();
    let enabled = alg != "none";
    let algorithm = if enabled { alg } else { "cpu" };
    for n in &names {
        ferry_out(
            &c,
            n,
            &[
                "balance",
                "set",
                &format!("enabled = {enabled}"),
                &format!("algorithm = \"{algorithm}\""),
                "period_ms = 500",
                "min_age_secs = 2",
                // The readers wait for Gw much of the time: still candidates, as in DUNES.
                "min_demand = 0.2",
                "min_stay_secs = 20",
                "cooldown_secs = 3",
            ],
        )?;
    }
    let procs = c.cpu_cgroup("a")?.join("cgroup.procs");
    let bin_s = bin.display().to_string();
    let (rs_r, rs_w) = std::io::pipe()?;
    let (rl_r, rl_w) = std::io::pipe()?;
    let t0 = Instant::now();
    let chunks = a.chunks.to_string();
    let (w_units, rs_units, rl_units) = (
        a.units.to_string(),
        (a.units / 3).to_string(),
        (a.units * 10 / 3).to_string(),
    );
    let rounds = a.rounds.to_string();
    let mut ps = vec![
        Proc {
            role: "Gw",
            child: start(
                &procs,
                &[&bin_s, "writer", &chunks, &w_units],
                Stdio::null(),
                Stdio::from(rs_w),
                Stdio::from(rl_w),
            )?,
            ended: None,
        },
        Proc {
            role: "Grs",
            child: start(
                &procs,
                &[&bin_s, "reader", &rs_units],
                Stdio::from(rs_r),
                Stdio::null(),
                Stdio::null(),
            )?,
            ended: None,
        },
        Proc {
            role: "Grl",
            child: start(
                &procs,
                &[&bin_s, "reader", &rl_units],
                Stdio::from(rl_r),
                Stdio::null(),
                Stdio::null(),
            )?,
            ended: None,
        },
        Proc {
            role: "I",
            child: start(
                &procs,
                &[&bin_s, "independent", &rounds],
                Stdio::null(),
                Stdio::null(),
                Stdio::null(),
            )?,
            ended: None,
        },
    ];
    // The pipes' ends are the children's alone now (moved into their Stdio).
    std::thread::sleep(Duration::from_millis(100));
    for p in &ps {
        ferry_out(&c, "a", &["balance", "add", &p.child.id().to_string()])?;
    }
    let deadline = Instant::now() + Duration::from_secs(900);
    while ps.iter().any(|p| p.ended.is_none()) {
        for p in &mut ps {
            if p.ended.is_none() {
                if let Some(st) = p.child.try_wait()? {
                    if !st.success() {
                        eprintln!("ferry-bench: {} ended with {st}", p.role);
                    }
                    p.ended = Some(t0.elapsed().as_secs_f64());
                }
            }
        }
        if Instant::now() > deadline {
            for p in &mut ps {
                let _ = p.child.kill();
            }
            bail!("the workload did not end within 900 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let ended = |r: &str| {
        ps.iter()
            .find(|p| p.role == r)
            .and_then(|p| p.ended)
            .unwrap_or(0.0)
    };
    let group_s = ended("Gw").max(ended("Grs")).max(ended("Grl"));
    let i_s = ended("I");
    // What moved, from the decision logs of every node.
    let mut moves = Vec::new();
    let role_of = |cmd: &str, pid: i64| -> String {
        ps.iter()
            .find(|p| p.child.id() as i64 == pid)
            .map_or_else(|| format!("{cmd} {pid}"), |p| p.role.to_string())
    };
    let mut logged = Vec::new();
    for n in &names {
        let log: Vec<serde_json::Value> =
            serde_json::from_slice(&ferry_out(&c, n, &["balance", "log", "--json"])?)?;
        for d in log {
            if d["action"] == "move" {
                let seen: Vec<String> = d["candidates"]
                    .as_array()
                    .map(|v| {
                        v.iter()
                            .map(|x| {
                                format!(
                                    "{} demand {:.2} cpu {:.2} {:.0} KiB/s",
                                    role_of("?", x["pid"].as_i64().unwrap_or(0)),
                                    x["demand"].as_f64().unwrap_or(0.0),
                                    x["cpu"].as_f64().unwrap_or(0.0),
                                    x["rate_bps"].as_f64().unwrap_or(0.0) / 1024.0
                                )
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                eprintln!(
                    "ferry-bench:   {n} decided: {} [{}]",
                    d["reason"].as_str().unwrap_or(""),
                    seen.join("; ")
                );
            }
            if d["action"] == "moved" || d["action"] == "failed" {
                logged.push((d["unix_ms"].as_u64().unwrap_or(0), n.clone(), d));
            }
        }
    }
    logged.sort_by_key(|(t, _, _)| *t);
    let first = logged.first().map_or(0, |(t, _, _)| *t);
    for (t, from, d) in &logged {
        let pid = d["pid"].as_i64().unwrap_or(0);
        let cmd = d["command"].as_str().unwrap_or("?");
        let what = if from == "a" {
            role_of(cmd, pid)
        } else {
            format!("{cmd} (from {from})")
        };
        let sign = if d["action"] == "moved" { "→" } else { "✗" };
        moves.push(format!(
            "{what}{sign}{} (+{:.0} s)",
            d["to"].as_str().unwrap_or("?"),
            (*t - first) as f64 / 1e3
        ));
    }
    Ok(Outcome {
        group_s,
        i_s,
        moves,
    })
}

pub fn run(a: Args) -> Result<()> {
    let ferry = crate::common::ferry_binary(a.ferry.as_deref())?;
    let bin = build_workload()?;
    let mut lines = vec![vec![
        "nodes".to_string(),
        "algorithm".to_string(),
        "moved (time after the first move)".to_string(),
        "Gw, Grl, Grs done (s)".to_string(),
        "I done (s)".to_string(),
    ]];
    for &n in &a.nodes {
        for alg in &a.algorithms {
            eprintln!("ferry-bench: {n} nodes, {alg}");
            let o = run_one(&ferry, &bin, &a, n, alg)?;
            let name = match alg.as_str() {
                "none" => "none (balancing off)",
                "cpu" => "Algorithm 1 (cpu)",
                "coupling" => "Algorithm 3 (coupling)",
                other => other,
            };
            let row = vec![
                n.to_string(),
                name.to_string(),
                if o.moves.is_empty() {
                    "-".into()
                } else {
                    o.moves.join(", ")
                },
                format!("{:.1}", o.group_s),
                format!("{:.1}", o.i_s),
            ];
            eprintln!("ferry-bench: {}", row.join(" | "));
            lines.push(row);
        }
    }
    println!("{}", crate::common::markdown(&lines));
    Ok(())
}
