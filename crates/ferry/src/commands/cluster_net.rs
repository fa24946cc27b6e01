//! The network of a local cluster of separate nodes: one bridge per cluster in this machine's
//! namespace, holding the first node's address, and one veth pair per other node, whose inner
//! end (`eth0`) is in that node's network namespace. Each cluster gets its own /24 of
//! link-local addresses (169.254.X.0/24, X in 64..=127), so clusters up at once never meet.
//!
//! Nothing may ever leave this machine: the range is covered by an `unreachable` route (the
//! guard), which a cluster's on-link /24 overrides while its bridge exists. The guard is put in
//! place by the first `cluster up` and deliberately left there by `cluster down`: a process
//! still holding a socket to a node's address would otherwise send it out of the default route.
//! Done with `ip` (iproute2), under a lock, so that parallel `cluster up`s pick different /24s.

use anyhow::{bail, Context, Result};
use std::net::Ipv4Addr;
use std::process::Command;

/// The whole range the clusters use, and where the guard route points.
pub const GUARD: &str = "169.254.64.0/18";
/// The guard loses to any other route of the same prefix (it has none of its own on purpose).
const GUARD_METRIC: &str = "4000";
const SLOTS: std::ops::RangeInclusive<u8> = 64..=127;
const LOCK: &str = "/run/ferry/net.lock";

/// One cluster's /24 and bridge.
#[derive(Clone, Copy, Debug, serde::Serialize, serde::Deserialize)]
pub struct Net {
    /// X of 169.254.X.0/24; also names the bridge (`ferryX`) and the veths (`ferryX-NODE`).
    pub slot: u8,
}

impl Net {
    /// Picks a free /24, makes its bridge with the first node's address, and makes sure the
    /// guard route is there.
    pub fn create() -> Result<Net> {
        std::fs::create_dir_all("/run/ferry").context("create /run/ferry")?;
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(LOCK)
            .with_context(|| format!("open {LOCK}"))?;
        lock.lock().with_context(|| format!("lock {LOCK}"))?;
        ip(&[
            "route",
            "replace",
            "unreachable",
            GUARD,
            "metric",
            GUARD_METRIC,
        ])?;
        for slot in SLOTS {
            let net = Net { slot };
            if std::path::Path::new("/sys/class/net")
                .join(net.bridge())
                .exists()
            {
                continue;
            }
            let used = ip_out(&["-4", "-o", "addr", "show", "to", &net.subnet()])?;
            let routed = ip_out(&["-4", "route", "show", "exact", &net.subnet()])?;
            if !used.trim().is_empty() || !routed.trim().is_empty() {
                continue;
            }
            let br = net.bridge();
            ip(&["link", "add", &br, "type", "bridge"])?;
            let made = ip(&["addr", "add", &format!("{}/24", net.addr(0)), "dev", &br])
                .and_then(|_| ip(&["link", "set", &br, "up"]));
            if let Err(e) = made {
                let _ = ip(&["link", "del", &br]);
                return Err(e);
            }
            return Ok(net);
        }
        bail!(
            "every /24 of {GUARD} is taken by another local cluster (or something else on this \
             machine): stop one with `ferry cluster down`"
        )
    }

    pub fn bridge(&self) -> String {
        format!("ferry{}", self.slot)
    }

    pub fn subnet(&self) -> String {
        format!("169.254.{}.0/24", self.slot)
    }

    /// Node `i`'s address (the first node's is the bridge's).
    pub fn addr(&self, i: usize) -> Ipv4Addr {
        Ipv4Addr::new(169, 254, self.slot, i as u8 + 1)
    }

    /// The name of the host end of node `node`'s veth pair.
    pub fn veth(&self, node: &str) -> String {
        format!("ferry{}-{node}", self.slot)
    }

    /// Makes node `node`'s veth pair: `eth0` in the network namespace of process `pid`, the
    /// other end on the bridge.
    pub fn attach(&self, node: &str, pid: i32) -> Result<()> {
        let host = self.veth(node);
        ip(&[
            "link",
            "add",
            &host,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            &pid.to_string(),
        ])?;
        ip(&["link", "set", &host, "master", &self.bridge(), "up"])
    }

    /// Removes the veth pairs of `nodes` (both ends go together) and the bridge; whatever is
    /// already gone is not an error.
    pub fn remove(&self, nodes: &[String]) -> Result<()> {
        // (A veth may vanish on its own meanwhile, with its node's network namespace.)
        let del = |link: &str| match ip(&["link", "del", link]) {
            Err(_) if !std::path::Path::new("/sys/class/net").join(link).exists() => Ok(()),
            r => r,
        };
        for n in nodes {
            del(&self.veth(n))?;
        }
        del(&self.bridge())
    }
}

fn ip_out(args: &[&str]) -> Result<String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .context("run `ip` (iproute2)")?;
    if !out.status.success() {
        bail!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs `ip ARGS` (iproute2) in the caller's network namespace; its complaint is the error.
pub fn ip(args: &[&str]) -> Result<()> {
    ip_out(args).map(drop)
}
