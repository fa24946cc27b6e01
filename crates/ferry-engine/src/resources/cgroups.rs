//! cgroup membership: each process comes back in the cgroups it was in, in every hierarchy
//! (cgroup v1, one per controller set or name, and the unified v2 one).
//!
//! Capture reads /proc/PID/cgroup. The restore moves each husk as soon as it exists, before
//! its memory is filled (charged to the right memory cgroup) and before its CPU affinity is
//! set (joining a cpuset resets it): ferry writes its PID to `cgroup.procs` of the cgroup in
//! the hierarchy mounted with the same controllers here. A cgroup that does not exist here
//! fails the restore, naming it: creating it would invent its limits.

use crate::error::{Context, Error, Result};
use crate::husk::Husk;
use crate::procfs;
use ferry_image::{Cgroup, Process};
use std::collections::BTreeSet;
use std::path::PathBuf;

fn parse(text: &str) -> Vec<Cgroup> {
    text.lines()
        .filter_map(|l| {
            let mut it = l.splitn(3, ':');
            let _id = it.next()?;
            Some(Cgroup {
                controllers: it.next()?.to_string(),
                path: it.next()?.to_string(),
            })
        })
        .collect()
}

pub fn capture(pid: i32, p: &mut Process) -> Result<()> {
    p.cgroups = parse(&procfs::read(pid, "cgroup")?);
    Ok(())
}

/// The set of controllers (and `name=` of a named hierarchy) a hierarchy is known by; empty for
/// v2.
fn key(controllers: &str) -> BTreeSet<String> {
    controllers
        .split(',')
        .filter(|c| !c.is_empty())
        .map(str::to_string)
        .collect()
}

/// A mounted hierarchy: its key, the mount point, and the cgroup path the mount shows as its
/// root.
struct Mount {
    key: BTreeSet<String>,
    point: PathBuf,
    root: String,
}

fn mounts_here() -> Vec<Mount> {
    let known: BTreeSet<String> = std::fs::read_to_string("/proc/cgroups")
        .unwrap_or_default()
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect();
    let mut out = Vec::new();
    for line in std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
    {
        let fields: Vec<&str> = line.split(' ').collect();
        let Some(sep) = fields.iter().position(|f| *f == "-") else {
            continue;
        };
        let (Some(fstype), Some(options)) = (fields.get(sep + 1), fields.get(sep + 3)) else {
            continue;
        };
        let key = match *fstype {
            "cgroup" => options
                .split(',')
                .filter(|o| known.contains(*o) || o.starts_with("name="))
                .map(str::to_string)
                .collect(),
            "cgroup2" => BTreeSet::new(),
            _ => continue,
        };
        // The first mount of a hierarchy wins (later ones are usually binds of a part of it).
        if out.iter().any(|m: &Mount| m.key == key) {
            continue;
        }
        out.push(Mount {
            key,
            point: PathBuf::from(unescape(fields[4])),
            root: unescape(fields[3]),
        });
    }
    out
}

/// mountinfo escapes space, tab, newline and backslash as octal.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(u8::is_ascii_digit) {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Moves a rebuilt process into the cgroups of the image, in every hierarchy it names that is
/// mounted here (a hierarchy that is not is skipped, with a warning: the process cannot be in
/// it). A cgroup missing from its hierarchy fails, naming it. With `cpu_cgroup` (the node's
/// own CPU cgroup, `RestoreOptions::cpu_cgroup`), the process joins that one instead in the
/// v1 hierarchy holding the `cpu` controller.
pub fn restore(h: &Husk, p: &Process, cpu_cgroup: Option<&std::path::Path>) -> Result<()> {
    if let Some(dir) = cpu_cgroup {
        std::fs::write(dir.join("cgroup.procs"), h.host.to_string()).ctx(p.pid, || {
            format!("join the node's CPU cgroup {}", dir.display())
        })?;
    }
    if p.cgroups.is_empty() {
        return Ok(());
    }
    let now = parse(&procfs::read(h.host, "cgroup")?);
    // Read once a cgroup differs (a child is mostly in its parent's, which it has by fork).
    let mut mounts = None;
    for cg in &p.cgroups {
        let k = key(&cg.controllers);
        if cpu_cgroup.is_some() && k.contains("cpu") {
            continue;
        }
        if now
            .iter()
            .any(|n| key(&n.controllers) == k && n.path == cg.path)
        {
            continue;
        }
        let Some(m) = mounts
            .get_or_insert_with(mounts_here)
            .iter()
            .find(|m| m.key == k)
        else {
            log::warn!(
                "PID {}: cgroup hierarchy {:?} is not mounted here; left out of {}",
                p.pid,
                cg.controllers,
                cg.path
            );
            continue;
        };
        let rel = if m.root == "/" {
            Some(cg.path.as_str())
        } else {
            cg.path
                .strip_prefix(m.root.as_str())
                .filter(|r| r.is_empty() || r.starts_with('/'))
        };
        let name = if cg.controllers.is_empty() {
            "v2"
        } else {
            cg.controllers.as_str()
        };
        let Some(rel) = rel else {
            return Err(Error::Restore {
                pid: p.pid,
                what: format!(
                    "cgroup {name}:{} is outside the part of the hierarchy mounted at {} ({})",
                    cg.path,
                    m.point.display(),
                    m.root
                ),
            });
        };
        let dir = m.point.join(rel.trim_start_matches('/'));
        if !dir.is_dir() {
            return Err(Error::Restore {
                pid: p.pid,
                what: format!(
                    "cgroup {name}:{} does not exist on this machine ({} is missing)",
                    cg.path,
                    dir.display()
                ),
            });
        }
        std::fs::write(dir.join("cgroup.procs"), h.host.to_string()).ctx(p.pid, || {
            format!("join cgroup {name}:{} ({})", cg.path, dir.display())
        })?;
    }
    Ok(())
}
