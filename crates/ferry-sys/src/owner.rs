//! Who a user is, for Ferry acting on their behalf (docs/security.md, "Users who are not
//! root"): the credentials the daemon reads from its control socket and from the caller's
//! /proc, carried to the engine's commands as `--owner SPEC`. The checks made with it are in
//! `ferry_engine::owner`.

/// The user on whose behalf Ferry acts, as the daemon read it from its control socket
/// (SO_PEERCRED, SO_PEERGROUPS) and from the caller's /proc.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Owner {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
    /// The caller's permitted capabilities (usually none).
    pub cap_prm: u64,
    /// The caller's audit login uid (4294967295 when unset).
    pub loginuid: u32,
    /// The lowest oom_score_adj the caller may have (its own).
    pub oom_score_adj: i32,
    /// The caller's hard resource limits, by resource number (RLIM_INFINITY as u64::MAX).
    pub hard_limits: Vec<(u32, u64)>,
}

/// `--owner`'s form: `UID:GID:G1,G2:CAPPRM_HEX:LOGINUID:OOM:R=MAX,R=MAX`.
impl std::fmt::Display for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let groups: Vec<String> = self.groups.iter().map(|g| g.to_string()).collect();
        let limits: Vec<String> = self
            .hard_limits
            .iter()
            .map(|(r, m)| format!("{r}={m}"))
            .collect();
        write!(
            f,
            "{}:{}:{}:{:x}:{}:{}:{}",
            self.uid,
            self.gid,
            groups.join(","),
            self.cap_prm,
            self.loginuid,
            self.oom_score_adj,
            limits.join(",")
        )
    }
}

impl std::str::FromStr for Owner {
    type Err = String;
    fn from_str(s: &str) -> Result<Owner, String> {
        let bad = || format!("bad owner {s:?}");
        let f: Vec<&str> = s.split(':').collect();
        if f.len() != 7 {
            return Err(bad());
        }
        fn list(x: &str) -> Vec<&str> {
            x.split(',').filter(|v| !v.is_empty()).collect()
        }
        Ok(Owner {
            uid: f[0].parse().map_err(|_| bad())?,
            gid: f[1].parse().map_err(|_| bad())?,
            groups: list(f[2])
                .into_iter()
                .map(|g| g.parse().map_err(|_| bad()))
                .collect::<Result<_, _>>()?,
            cap_prm: u64::from_str_radix(f[3], 16).map_err(|_| bad())?,
            loginuid: f[4].parse().map_err(|_| bad())?,
            oom_score_adj: f[5].parse().map_err(|_| bad())?,
            hard_limits: list(f[6])
                .into_iter()
                .map(|l| {
                    let (r, m) = l.split_once('=').ok_or_else(bad)?;
                    Ok((r.parse().map_err(|_| bad())?, m.parse().map_err(|_| bad())?))
                })
                .collect::<Result<_, String>>()?,
        })
    }
}

impl Owner {
    /// The caller at the other end of a UNIX socket: `uid`, `gid` and `groups` from the
    /// socket, the rest from its /proc (`pid`); what cannot be read grants nothing (no
    /// capabilities, the login uid unset, oom_score_adj 1000, every hard limit 0).
    pub fn of_caller(uid: u32, gid: u32, groups: Vec<u32>, pid: Option<i32>) -> Owner {
        let status = pid
            .and_then(|p| std::fs::read_to_string(format!("/proc/{p}/status")).ok())
            .unwrap_or_default();
        let read = |name: &str| {
            pid.and_then(|p| std::fs::read_to_string(format!("/proc/{p}/{name}")).ok())
                .unwrap_or_default()
        };
        Owner {
            uid,
            gid,
            groups,
            cap_prm: status_caps(&status, "CapPrm:").unwrap_or(0),
            loginuid: read("loginuid").trim().parse().unwrap_or(u32::MAX),
            oom_score_adj: read("oom_score_adj").trim().parse().unwrap_or(1000),
            hard_limits: parse_limits(&read("limits")),
        }
    }

    /// The file-system rights to act with for this user.
    pub fn fs_creds(&self) -> crate::fsid::FsCreds {
        crate::fsid::FsCreds {
            uid: self.uid,
            gid: self.gid,
            groups: self.groups.clone(),
        }
    }

    pub fn has_group(&self, g: u32) -> bool {
        g == self.gid || self.groups.contains(&g)
    }
}

/// The names /proc/PID/limits gives the resources, in resource-number order (x86_64).
const LIMIT_NAMES: [&str; 16] = [
    "Max cpu time",
    "Max file size",
    "Max data size",
    "Max stack size",
    "Max core file size",
    "Max resident set",
    "Max processes",
    "Max open files",
    "Max locked memory",
    "Max address space",
    "Max file locks",
    "Max pending signals",
    "Max msgqueue size",
    "Max nice priority",
    "Max realtime priority",
    "Max realtime timeout",
];

/// Hard limits from the text of /proc/PID/limits.
fn parse_limits(text: &str) -> Vec<(u32, u64)> {
    let mut out = Vec::new();
    for line in text.lines() {
        let Some(r) = LIMIT_NAMES.iter().position(|n| line.starts_with(n)) else {
            continue;
        };
        let rest = &line[LIMIT_NAMES[r].len()..];
        let Some(hard) = rest.split_whitespace().nth(1) else {
            continue;
        };
        let max = if hard == "unlimited" {
            u64::MAX
        } else {
            match hard.parse() {
                Ok(m) => m,
                Err(_) => continue,
            }
        };
        out.push((r as u32, max));
    }
    out
}

pub fn status_caps(status: &str, field: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
}

pub fn status_ids(status: &str, field: &str) -> Option<Vec<u32>> {
    status.lines().find_map(|l| l.strip_prefix(field)).map(|v| {
        v.split_whitespace()
            .filter_map(|x| x.parse().ok())
            .collect()
    })
}
