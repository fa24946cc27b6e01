//! Measuring this node's load, as published to the cluster (see `ferry_policy::NodeLoad`).

use ferry_policy::NodeLoad;
use std::time::SystemTime;

/// Keeps the previous CPU counters so each sample reports idleness over the last period.
#[derive(Default)]
pub struct LoadSampler {
    last_cpu: Option<(u64, u64)>,
}

impl LoadSampler {
    pub fn sample(&mut self, guests: u32, accepting: bool) -> NodeLoad {
        let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        let mut runnable = 0u32;
        let mut cpu = None;
        for line in stat.lines() {
            if let Some(rest) = line.strip_prefix("cpu ") {
                let v: Vec<u64> = rest
                    .split_whitespace()
                    .filter_map(|x| x.parse().ok())
                    .collect();
                let total: u64 = v.iter().take(8).sum();
                let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
                cpu = Some((total, idle));
            } else if let Some(rest) = line.strip_prefix("procs_running ") {
                // Less the thread reading this.
                runnable = rest.trim().parse::<u32>().unwrap_or(1).saturating_sub(1);
            }
        }
        let cpu_idle_pct = match (self.last_cpu, cpu) {
            (Some((t0, i0)), Some((t1, i1))) if t1 > t0 => {
                ((i1 - i0) as f64 * 100.0 / (t1 - t0) as f64) as f32
            }
            _ => 100.0,
        };
        self.last_cpu = cpu;
        NodeLoad {
            runnable,
            cpus: std::thread::available_parallelism()
                .map(|n| n.get() as u32)
                .unwrap_or(1),
            cpu_idle_pct,
            free_memory_bytes: mem_available(),
            console_idle_secs: console_idle_secs(),
            guests,
            accepting,
        }
    }
}

fn mem_available() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

/// Seconds since someone last used a physical console: a virtual terminal or an input device
/// (Sprite's test of an owner at the keyboard). Pseudo-terminals do not count: they are remote
/// sessions and Ferry's own `run` terminals.
fn console_idle_secs() -> Option<u64> {
    let mut latest: Option<SystemTime> = None;
    let mut consider = |path: std::path::PathBuf| {
        if let Ok(m) = std::fs::metadata(&path) {
            for t in [m.accessed(), m.modified()].into_iter().flatten() {
                latest = Some(latest.map_or(t, |l| l.max(t)));
            }
        }
    };
    if let Ok(dir) = std::fs::read_dir("/dev/input") {
        for e in dir.flatten() {
            consider(e.path());
        }
    }
    for n in 1..=12 {
        consider(format!("/dev/tty{n}").into());
    }
    latest.map(|t| t.elapsed().map(|d| d.as_secs()).unwrap_or(0))
}
