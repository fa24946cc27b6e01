//! Measuring this node's load, as published to the cluster (see `ferry_policy::NodeLoad`).

use anyhow::{bail, Context, Result};
use ferry_policy::NodeLoad;

/// Keeps the previous CPU counters so each sample reports idleness over the last period.
#[derive(Default)]
pub struct LoadSampler {
    last_cpu: Option<(u64, u64)>,
}

impl LoadSampler {
    /// Measures the load now. A /proc file that cannot be read or parsed is an error (naming
    /// it), never a zero: a node out of descriptors must not report itself idle and empty.
    pub fn sample(&mut self, guests: u32, accepting: bool) -> Result<NodeLoad> {
        let stat = std::fs::read_to_string("/proc/stat").context("read /proc/stat")?;
        let (runnable, cpu) = parse_stat(&stat).context("parse /proc/stat")?;
        let meminfo = std::fs::read_to_string("/proc/meminfo").context("read /proc/meminfo")?;
        let free_memory_bytes = parse_mem_available(&meminfo).context("parse /proc/meminfo")?;
        let cpu_idle_pct = match self.last_cpu {
            Some((t0, i0)) if cpu.0 > t0 => {
                (cpu.1.saturating_sub(i0) as f64 * 100.0 / (cpu.0 - t0) as f64) as f32
            }
            _ => 100.0,
        };
        self.last_cpu = Some(cpu);
        Ok(NodeLoad {
            runnable,
            cpus: std::thread::available_parallelism()
                .map(|n| n.get() as u32)
                .unwrap_or(1),
            cpu_idle_pct,
            free_memory_bytes,
            // The owner's input: crate::hosts fills it in.
            console_idle_secs: None,
            guests,
            accepting,
            stale: false,
            ..Default::default()
        })
    }
}

/// Runnable processes (ourselves excluded) and the CPU counters (total, idle) of /proc/stat.
fn parse_stat(stat: &str) -> Result<(u32, (u64, u64))> {
    let mut runnable = None;
    let mut cpu = None;
    for line in stat.lines() {
        if let Some(rest) = line.strip_prefix("cpu ") {
            let v = rest
                .split_whitespace()
                .map(|x| x.parse::<u64>())
                .collect::<Result<Vec<u64>, _>>()
                .with_context(|| format!("bad cpu line {line:?}"))?;
            if v.len() < 5 {
                bail!("cpu line {line:?} has {} fields", v.len());
            }
            let total: u64 = v.iter().take(8).sum();
            cpu = Some((total, v[3] + v[4]));
        } else if let Some(rest) = line.strip_prefix("procs_running ") {
            let n: u32 = rest
                .trim()
                .parse()
                .with_context(|| format!("bad line {line:?}"))?;
            // Less the thread reading this.
            runnable = Some(n.saturating_sub(1));
        }
    }
    match (runnable, cpu) {
        (Some(r), Some(c)) => Ok((r, c)),
        _ => bail!("no cpu or procs_running line"),
    }
}

fn parse_mem_available(meminfo: &str) -> Result<u64> {
    let v = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .ok_or_else(|| anyhow::anyhow!("no MemAvailable line"))?;
    let kb: u64 = v
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .with_context(|| format!("bad MemAvailable value {:?}", v.trim()))?;
    Ok(kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unreadable_figures_are_errors_not_zeros() {
        assert!(parse_mem_available("").is_err());
        assert!(parse_mem_available("MemAvailable:  x kB\n").is_err());
        assert_eq!(
            parse_mem_available("MemTotal: 9 kB\nMemAvailable:   2048 kB\n").unwrap(),
            2 << 20
        );
        assert!(parse_stat("").is_err());
        assert!(parse_stat("cpu  1 2 3 4 5 6 7 8 0 0\n").is_err());
        assert_eq!(
            parse_stat("cpu  1 2 3 4 5 6 7 8 0 0\nprocs_running 3\n").unwrap(),
            (2, (36, 9))
        );
        let mut s = LoadSampler::default();
        let l = s.sample(0, true).unwrap();
        assert!(l.free_memory_bytes > 0 && !l.stale);
    }
}
