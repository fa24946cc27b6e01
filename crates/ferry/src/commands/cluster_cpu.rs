//! Unequal nodes on one machine (`ferry cluster up --cpu-quota FRACTION`): each node's daemon,
//! with everything it starts (remote runs, engine workers, the guests it rebuilds), is held to
//! FRACTION of one CPU by a cgroup of its own in the cgroup v1 `cpu` hierarchy
//! (`cpu.cfs_quota_us` over `cpu.cfs_period_us`). So 4 nodes of half a CPU share a 2-core
//! machine as 4 slow machines would, and a node's load is its own.
//!
//! Layout: `CPU/ferry-cluster-HASH/NODE`, where CPU is where the hierarchy is mounted and HASH
//! names the cluster's directory (so clusters up at once do not share one). The node's config
//! names its cgroup (`cpu_cgroup`); the daemon joins it as it starts.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// The scheduler period: 100 ms, the kernel's default.
pub const PERIOD_US: u64 = 100_000;

/// Where the cgroup v1 hierarchy holding the `cpu` controller is mounted, from
/// /proc/self/mountinfo.
pub fn cpu_hierarchy() -> Result<PathBuf> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").context("read mountinfo")?;
    for line in info.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        let Some(sep) = fields.iter().position(|f| *f == "-") else {
            continue;
        };
        if fields.get(sep + 1) != Some(&"cgroup") {
            continue;
        }
        let options = fields.get(sep + 3).copied().unwrap_or("");
        if options.split(',').any(|o| o == "cpu") && fields[3] == "/" {
            return Ok(PathBuf::from(fields[4]));
        }
    }
    bail!(
        "--cpu-quota needs the cgroup v1 `cpu` controller mounted (no `cgroup` mount with the \
         `cpu` option in /proc/self/mountinfo)"
    )
}

/// The cluster's own cgroup under the hierarchy: one per cluster directory.
pub fn cluster_cgroup(hierarchy: &Path, cluster_dir: &Path) -> PathBuf {
    // FNV-1a of the directory's path: short, stable, and the same for `up` and `down`.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in cluster_dir.as_os_str().as_encoded_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    hierarchy.join(format!("ferry-cluster-{:012x}", h & 0xffff_ffff_ffff))
}

/// Checks FRACTION: more than nothing, at most the machine's CPUs.
pub fn check_fraction(f: f64) -> Result<u64> {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    if !(f.is_finite() && f > 0.0 && f <= cpus) {
        bail!("--cpu-quota must be a fraction of one CPU above 0 and at most {cpus} (this machine's CPUs), not {f}");
    }
    // The kernel refuses quotas under 1 ms.
    Ok(((f * PERIOD_US as f64).round() as u64).max(1_000))
}

/// Makes (or takes back, after a crash) the cgroup of node `name` under `cluster` with a quota
/// of `quota_us` per period; returns its directory.
pub fn make_node_cgroup(cluster: &Path, name: &str, quota_us: u64) -> Result<PathBuf> {
    let dir = cluster.join(name);
    std::fs::create_dir_all(&dir).with_context(|| format!("make cgroup {}", dir.display()))?;
    let set = |file: &str, v: u64| -> Result<()> {
        let p = dir.join(file);
        std::fs::write(&p, v.to_string()).with_context(|| format!("write {v} to {}", p.display()))
    };
    set("cpu.cfs_period_us", PERIOD_US)?;
    set("cpu.cfs_quota_us", quota_us)?;
    Ok(dir)
}

/// Gives the cluster's cgroup the weight of `nodes` machines (`cpu.shares`, 1024 each, as
/// each node's own): when this machine is busy with other work, the cluster's nodes get what
/// as many separate processes' groups would, not one group's share split among them all.
pub fn weigh_cluster(cluster: &Path, nodes: usize) -> Result<()> {
    let p = cluster.join("cpu.shares");
    let w = 1024 * nodes.max(1);
    std::fs::write(&p, w.to_string()).with_context(|| format!("write {w} to {}", p.display()))
}

/// Removes the cluster's cgroups once its nodes are down. Processes still in them (guests of
/// the first node, which is this machine and whose guests outlive its daemon) go back to the
/// hierarchy's root, the CPU cgroup of everything else here.
pub fn remove(cluster: &Path) -> Result<()> {
    let Some(root) = cluster.parent() else {
        return Ok(());
    };
    let Ok(nodes) = std::fs::read_dir(cluster) else {
        return Ok(());
    };
    for n in nodes.flatten() {
        let dir = n.path();
        if !dir.is_dir() {
            continue;
        }
        // A task may be forking as we move it: a few passes.
        for _ in 0..10 {
            let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
            if procs.trim().is_empty() {
                break;
            }
            for pid in procs.lines() {
                let _ = std::fs::write(root.join("cgroup.procs"), pid);
            }
        }
        // The tasks of a node just shut down may take a moment to leave.
        let mut tries = 0;
        while let Err(e) = std::fs::remove_dir(&dir) {
            tries += 1;
            if tries == 50 {
                eprintln!("ferry: cannot remove cgroup {}: {e}", dir.display());
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
    std::fs::remove_dir(cluster).with_context(|| format!("remove cgroup {}", cluster.display()))
}
