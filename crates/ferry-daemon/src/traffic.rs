//! How many bytes a process moves: the data rate DUNES' Algorithm 3 weighs (its coupling),
//! read from the kernel's own counters, per process and, where the kernel keeps one, per
//! descriptor.
//!
//! - Per process: /proc/PID/io `rchar` and `wchar`, every byte the process passed through
//!   read(2)/write(2) and their vector, splice and sendfile relatives, on any descriptor: pipes,
//!   sockets, files, terminals. Not counted by the kernel: send/recv/sendto/recvfrom/sendmsg/
//!   recvmsg on sockets (they bypass the VFS), and memory shared with another process.
//! - Per descriptor: a regular file's offset (/proc/PID/fdinfo/FD `pos`) moves with each read
//!   and write, so its change is that descriptor's bytes (not for pread/pwrite, nor for
//!   O_APPEND writes to a file others extend too). Pipes, FIFOs, UNIX and UDP sockets keep no
//!   byte counter a third party can read (only what is queued now); their bytes are the
//!   process's total less its files'. TCP keeps one (tcp_info's bytes_acked and
//!   bytes_received, through sock_diag), not read yet.
//!
//! docs/limitations.md ("Automatic load balancing") says the same.

use std::collections::HashMap;
use std::time::Instant;

/// /proc/PID/io's byte counters.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Io {
    pub rchar: u64,
    pub wchar: u64,
}

/// `pid`'s byte counters, or None if it is gone or unreadable.
pub fn io(pid: i32) -> Option<Io> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/io")).ok()?;
    parse_io(&text)
}

fn parse_io(text: &str) -> Option<Io> {
    let mut io = Io::default();
    let mut seen = 0;
    for line in text.lines() {
        let (k, v) = line.split_once(':')?;
        let v: u64 = v.trim().parse().ok()?;
        match k {
            "rchar" => {
                io.rchar = v;
                seen += 1
            }
            "wchar" => {
                io.wchar = v;
                seen += 1
            }
            _ => {}
        }
    }
    (seen == 2).then_some(io)
}

/// What one descriptor is, and its offset if it is a regular file.
#[derive(Debug, Clone, PartialEq)]
pub struct Descriptor {
    pub fd: i32,
    /// "file", "pipe", "socket", "anon" or "other"
    pub kind: &'static str,
    /// Where /proc/PID/fd/FD points.
    pub target: String,
    pub pos: Option<u64>,
}

/// `pid`'s descriptors.
pub fn descriptors(pid: i32) -> Vec<Descriptor> {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Vec::new();
    };
    let mut v = Vec::new();
    for e in dir.flatten() {
        let Some(fd) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(target) = std::fs::read_link(e.path()) else {
            continue;
        };
        let target = target.to_string_lossy().into_owned();
        let kind = if target.starts_with("pipe:") {
            "pipe"
        } else if target.starts_with("socket:") {
            "socket"
        } else if target.starts_with("anon_inode:") {
            "anon"
        } else if target.starts_with('/') && !target.starts_with("/dev/") {
            "file"
        } else {
            "other"
        };
        let pos = (kind == "file")
            .then(|| {
                std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}"))
                    .ok()?
                    .lines()
                    .find_map(|l| l.strip_prefix("pos:"))?
                    .trim()
                    .parse()
                    .ok()
            })
            .flatten();
        v.push(Descriptor {
            fd,
            kind,
            target,
            pos,
        });
    }
    v.sort_by_key(|d| d.fd);
    v
}

/// One process's data rate over the last period.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Rate {
    /// Everything read and written, bytes per second.
    pub total_bps: f64,
    /// Of which through regular files (their offsets' movement).
    pub file_bps: f64,
}

#[derive(Default)]
struct Last {
    at: Option<Instant>,
    io: Io,
    /// fd -> (target, offset)
    files: HashMap<i32, (String, u64)>,
}

/// Keeps each process's last counters, so that each sample is a rate.
#[derive(Default)]
pub struct Traffic {
    last: HashMap<i32, Last>,
}

impl Traffic {
    /// `pid`'s data rate since the previous call for it (None the first time, or if it is
    /// gone).
    pub fn sample(&mut self, pid: i32) -> Option<Rate> {
        let now = Instant::now();
        let io = io(pid)?;
        let files: HashMap<i32, (String, u64)> = descriptors(pid)
            .into_iter()
            .filter_map(|d| Some((d.fd, (d.target, d.pos?))))
            .collect();
        let prev = self.last.insert(
            pid,
            Last {
                at: Some(now),
                io,
                files: files.clone(),
            },
        )?;
        let secs = now.duration_since(prev.at?).as_secs_f64().max(1e-3);
        let total = (io.rchar.saturating_sub(prev.io.rchar)
            + io.wchar.saturating_sub(prev.io.wchar)) as f64;
        let file: u64 = files
            .iter()
            .filter_map(|(fd, (target, pos))| {
                let (t0, p0) = prev.files.get(fd)?;
                (t0 == target).then(|| pos.abs_diff(*p0))
            })
            .sum();
        Some(Rate {
            total_bps: total / secs,
            file_bps: (file as f64).min(total) / secs,
        })
    }

    /// Forgets processes not in `keep`.
    pub fn retain(&mut self, keep: impl Fn(i32) -> bool) {
        self.last.retain(|pid, _| keep(*pid));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    #[test]
    fn io_counters_parse_and_refuse_garbage() {
        let t = "rchar: 10\nwchar: 20\nsyscr: 1\nsyscw: 2\nread_bytes: 0\n";
        assert_eq!(
            parse_io(t),
            Some(Io {
                rchar: 10,
                wchar: 20
            })
        );
        assert_eq!(parse_io("rchar: 10\n"), None);
        assert_eq!(parse_io("rchar: x\nwchar: 1\n"), None);
    }

    #[test]
    fn a_pipe_and_a_file_are_counted() {
        let me = std::process::id() as i32;
        let dir = std::env::temp_dir().join(format!("ferry-traffic-{me}"));
        let mut f = std::fs::File::create(&dir).unwrap();
        let mut t = Traffic::default();
        assert!(t.sample(me).is_none());
        f.write_all(&vec![7u8; 1 << 20]).unwrap();
        let (mut r, mut w) = std::io::pipe().unwrap();
        let writer = std::thread::spawn(move || w.write_all(&vec![1u8; 2 << 20]).unwrap());
        let mut buf = Vec::new();
        r.read_to_end(&mut buf).unwrap();
        writer.join().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let rate = t.sample(me).unwrap();
        // 2 MiB written and read through the pipe, 1 MiB written to the file.
        let secs = 10.0; // generous: the rate is over the few ms elapsed, so far above this
        assert!(rate.total_bps > (5 << 20) as f64 / secs, "{rate:?}");
        assert!(
            rate.file_bps > 0.0 && rate.file_bps < rate.total_bps,
            "{rate:?}"
        );
        let fds = descriptors(me);
        assert!(fds
            .iter()
            .any(|d| d.kind == "file" && d.pos == Some(1 << 20)));
        drop(f);
        std::fs::remove_file(&dir).unwrap();
    }
}
