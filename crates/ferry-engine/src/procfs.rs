//! Parsing of /proc/PID/*: everything the engine learns without touching the process.

use crate::error::{Context, Error, Result};

pub fn read(pid: i32, file: &str) -> Result<String> {
    std::fs::read_to_string(format!("/proc/{pid}/{file}")).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            Error::NoSuchProcess { pid }
        } else {
            Error::Io {
                pid,
                what: format!("read /proc/{pid}/{file}"),
                source: e,
            }
        }
    })
}

pub fn read_bytes(pid: i32, file: &str) -> Result<Vec<u8>> {
    std::fs::read(format!("/proc/{pid}/{file}")).ctx(pid, || format!("read /proc/{pid}/{file}"))
}

pub fn readlink(pid: i32, file: &str) -> Result<String> {
    let p = std::fs::read_link(format!("/proc/{pid}/{file}"))
        .ctx(pid, || format!("readlink /proc/{pid}/{file}"))?;
    Ok(p.to_string_lossy().into_owned())
}

/// The fields of /proc/PID/stat that the engine uses.
#[derive(Debug, Clone, Default)]
pub struct Stat {
    pub comm: String,
    pub state: char,
    pub ppid: i32,
    pub pgid: i32,
    pub sid: i32,
    pub flags: u64,
    pub num_threads: i64,
    pub start_code: u64,
    pub end_code: u64,
    pub start_stack: u64,
    pub exit_signal: i32,
    pub start_data: u64,
    pub end_data: u64,
    pub start_brk: u64,
    pub arg_start: u64,
    pub arg_end: u64,
    pub env_start: u64,
    pub env_end: u64,
    pub exit_code: i32,
}

pub const PF_KTHREAD: u64 = 0x0020_0000;

pub fn stat(pid: i32) -> Result<Stat> {
    parse_stat(pid, &read(pid, "stat")?)
}

pub fn task_stat(pid: i32, tid: i32) -> Result<Stat> {
    parse_stat(pid, &read(pid, &format!("task/{tid}/stat"))?)
}

fn parse_stat(pid: i32, s: &str) -> Result<Stat> {
    let bad = || Error::BadImage(format!("/proc/{pid}/stat is malformed: {s}"));
    let open = s.find('(').ok_or_else(bad)?;
    let close = s.rfind(')').ok_or_else(bad)?;
    let comm = s[open + 1..close].to_string();
    // Fields from 3 (state) onward; f(n) is field n in proc(5)'s 1-based numbering.
    let rest: Vec<&str> = s[close + 1..].split_whitespace().collect();
    let f = |n: usize| -> &str { rest.get(n - 3).copied().unwrap_or("0") };
    let u = |n: usize| f(n).parse::<u64>().unwrap_or(0);
    let i = |n: usize| f(n).parse::<i64>().unwrap_or(0);
    Ok(Stat {
        comm,
        state: f(3).chars().next().unwrap_or('?'),
        ppid: i(4) as i32,
        pgid: i(5) as i32,
        sid: i(6) as i32,
        flags: u(9),
        num_threads: i(20),
        start_code: u(26),
        end_code: u(27),
        start_stack: u(28),
        exit_signal: i(38) as i32,
        start_data: u(45),
        end_data: u(46),
        start_brk: u(47),
        arg_start: u(48),
        arg_end: u(49),
        env_start: u(50),
        env_end: u(51),
        exit_code: i(52) as i32,
    })
}

/// /proc/PID/status as key/value pairs.
pub fn status(pid: i32) -> Result<Vec<(String, String)>> {
    Ok(read(pid, "status")?
        .lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.to_string(), v.trim().to_string()))
        .collect())
}

pub fn field<'a>(status: &'a [(String, String)], key: &str) -> &'a str {
    status
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
        .unwrap_or("")
}

/// The file-system credentials process `pid` acts with now: its fsuid, fsgid and groups.
pub fn fs_creds(pid: i32) -> Result<ferry_sys::fsid::FsCreds> {
    let status = status(pid)?;
    // The fourth of the real, effective, saved and file-system ids.
    let fs = |key: &str| {
        field(&status, key)
            .split_whitespace()
            .nth(3)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| Error::Io {
                pid,
                what: format!("read the file-system id of {key} in /proc/{pid}/status"),
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("{key}: {:?}", field(&status, key)),
                ),
            })
    };
    Ok(ferry_sys::fsid::FsCreds {
        uid: fs("Uid")?,
        gid: fs("Gid")?,
        groups: field(&status, "Groups")
            .split_whitespace()
            .filter_map(|g| g.parse().ok())
            .collect(),
    })
}

pub fn hex_field(status: &[(String, String)], key: &str) -> u64 {
    u64::from_str_radix(field(status, key), 16).unwrap_or(0)
}

pub fn tids(pid: i32) -> Result<Vec<i32>> {
    let dir = std::fs::read_dir(format!("/proc/{pid}/task")).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            Error::NoSuchProcess { pid }
        } else {
            Error::Io {
                pid,
                what: "list threads".into(),
                source: e,
            }
        }
    })?;
    let mut out: Vec<i32> = dir
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    out.sort();
    Ok(out)
}

/// Children of every thread of `pid`.
pub fn children(pid: i32) -> Result<Vec<i32>> {
    let mut out = Vec::new();
    for tid in tids(pid)? {
        if let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/children")) {
            out.extend(s.split_whitespace().filter_map(|c| c.parse::<i32>().ok()));
        }
    }
    out.sort();
    out.dedup();
    Ok(out)
}

/// One line of /proc/PID/maps plus the VmFlags line of smaps.
#[derive(Debug, Clone, Default)]
pub struct MapEntry {
    pub start: u64,
    pub end: u64,
    pub perms: String,
    pub offset: u64,
    pub dev: u64,
    pub ino: u64,
    pub name: String,
    pub vm_flags: Vec<String>,
    /// smaps `AnonHugePages`, in KiB.
    pub anon_huge_kb: u64,
}

impl MapEntry {
    pub fn shared(&self) -> bool {
        self.perms.as_bytes().get(3) == Some(&b's')
    }
    pub fn prot(&self) -> u32 {
        let p = self.perms.as_bytes();
        let mut prot = 0;
        if p[0] == b'r' {
            prot |= libc::PROT_READ as u32;
        }
        if p[1] == b'w' {
            prot |= libc::PROT_WRITE as u32;
        }
        if p[2] == b'x' {
            prot |= libc::PROT_EXEC as u32;
        }
        prot
    }
    pub fn has_flag(&self, f: &str) -> bool {
        self.vm_flags.iter().any(|x| x == f)
    }
    pub fn deleted(&self) -> bool {
        self.name.ends_with(" (deleted)")
    }
    pub fn path(&self) -> &str {
        self.name.strip_suffix(" (deleted)").unwrap_or(&self.name)
    }
}

fn parse_map_line(line: &str) -> Option<MapEntry> {
    let mut it = line.splitn(6, ' ');
    let range = it.next()?;
    let perms = it.next()?.to_string();
    let offset = u64::from_str_radix(it.next()?, 16).ok()?;
    let dev = it.next()?;
    let ino = it.next()?.parse().ok()?;
    let name = it.next().unwrap_or("").trim_start().to_string();
    let (s, e) = range.split_once('-')?;
    let (maj, min) = dev.split_once(':')?;
    let dev = libc::makedev(
        u32::from_str_radix(maj, 16).ok()?,
        u32::from_str_radix(min, 16).ok()?,
    );
    Some(MapEntry {
        start: u64::from_str_radix(s, 16).ok()?,
        end: u64::from_str_radix(e, 16).ok()?,
        perms,
        offset,
        dev,
        ino,
        name,
        vm_flags: Vec::new(),
        anon_huge_kb: 0,
    })
}

/// The mappings of a process, with their VmFlags, from /proc/PID/smaps.
pub fn smaps(pid: i32) -> Result<Vec<MapEntry>> {
    let text = read(pid, "smaps")?;
    let mut out: Vec<MapEntry> = Vec::new();
    for line in text.lines() {
        if let Some(flags) = line.strip_prefix("VmFlags:") {
            if let Some(last) = out.last_mut() {
                last.vm_flags = flags.split_whitespace().map(str::to_string).collect();
            }
        } else if let Some(kb) = line.strip_prefix("AnonHugePages:") {
            if let Some(last) = out.last_mut() {
                last.anon_huge_kb = kb
                    .split_whitespace()
                    .next()
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(0);
            }
        } else if line
            .as_bytes()
            .first()
            .is_some_and(|c| c.is_ascii_hexdigit())
            && line.contains('-')
        {
            if let Some(m) = parse_map_line(line) {
                if !line.split_whitespace().next().unwrap_or("").contains(':') {
                    out.push(m);
                }
            }
        }
    }
    Ok(out)
}

/// The mappings of a process from /proc/PID/maps, which the kernel prints without walking
/// their pages (unlike smaps): no VmFlags, no AnonHugePages.
pub fn maps(pid: i32) -> Result<Vec<MapEntry>> {
    Ok(read(pid, "maps")?
        .lines()
        .filter_map(parse_map_line)
        .collect())
}

/// /proc/PID/fdinfo/FD as key/value pairs (multi-valued keys such as `tfd` repeat).
pub fn fdinfo(pid: i32, fd: i32) -> Result<Vec<(String, String)>> {
    Ok(read(pid, &format!("fdinfo/{fd}"))?
        .lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect())
}

pub fn fds(pid: i32) -> Result<Vec<i32>> {
    let dir =
        std::fs::read_dir(format!("/proc/{pid}/fd")).ctx(pid, || "list /proc/PID/fd".into())?;
    let mut out: Vec<i32> = dir
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    out.sort();
    Ok(out)
}

pub fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .unwrap_or_default()
        .trim()
        .to_string()
}
