//! `ferry image show DIR`: what an image holds, like CRIU's crit.

use anyhow::{Context, Result};
use ferry_image::validate::GP_REG_RIP;
use ferry_image::{Backing, FileKind, ImageReader, Item};
use std::io::BufReader;
use std::path::PathBuf;

#[derive(clap::Subcommand)]
pub enum Command {
    /// Print the processes, threads, mappings and descriptors an image holds.
    Show {
        dir: PathBuf,
        /// Print the whole tree as JSON.
        #[arg(long)]
        json: bool,
    },
}

pub fn run(c: Command) -> Result<()> {
    let Command::Show { dir, json } = c;
    let path = dir.join(ferry_image::IMAGE_FILE);
    let file =
        std::fs::File::open(&path).with_context(|| format!("open image {}", path.display()))?;
    let read = || format!("read image {}", path.display());
    let mut r = ImageReader::new(BufReader::new(file)).with_context(read)?;
    // The tree is read and checked as a restore reads and checks it: a crafted image is refused,
    // naming what is wrong, before anything of it is printed.
    let tree = r.read_tree().with_context(read)?;
    let mut page_bytes = std::collections::HashMap::<i32, u64>::new();
    let mut object_bytes = 0u64;
    // Data is read through one buffer and checked record by record, never held whole.
    let mut buf = vec![0u8; 1 << 20];
    let mut drain = |r: &mut ImageReader<_>, mut len: u64| -> Result<u64> {
        let total = len;
        while len > 0 {
            let n = len.min(buf.len() as u64) as usize;
            r.read_data(&mut buf[..n]).with_context(read)?;
            len -= n as u64;
        }
        r.end_record().with_context(read)?;
        Ok(total)
    };
    while let Some(item) = r.next_item().with_context(read)? {
        match item {
            Item::Tree(_) => anyhow::bail!("{}: the image has two tree records", read()),
            Item::Pages { pid, len, .. } => {
                *page_bytes.entry(pid).or_default() += drain(&mut r, len)?
            }
            Item::Object { len, .. } => object_bytes += drain(&mut r, len)?,
            Item::End { .. } => {}
        }
    }
    if json {
        return super::print_json(&tree);
    }
    println!(
        "image {} (format {}), captured on {} running {}",
        path.display(),
        ferry_image::FORMAT_VERSION,
        tree.source.hostname,
        tree.source.kernel
    );
    for p in &tree.processes {
        println!(
            "\nprocess {} (parent {}, group {}, session {}) {:?} {}",
            p.pid,
            p.ppid,
            p.pgid,
            p.sid,
            p.comm,
            if p.zombie_status.is_some() {
                "zombie".to_string()
            } else {
                let mut notes = Vec::new();
                if let Some(sig) = p.stop_signal {
                    notes.push(format!(
                        "stopped by signal {sig}{}",
                        if p.stop_collected {
                            " (collected by its parent)"
                        } else {
                            ""
                        }
                    ));
                }
                if p.continued_uncollected {
                    notes.push("continued (not yet collected by its parent)".into());
                }
                if p.leader_exited {
                    notes.push("main thread exited".into());
                }
                if p.files_shared_with_parent {
                    notes.push("descriptor table shared with its parent".into());
                }
                notes.join(", ")
            }
        );
        if p.zombie_status.is_some() {
            continue;
        }
        println!(
            "  exe {}  cwd {}  uid {}  memory {} KiB stored",
            p.exe,
            p.cwd,
            p.creds.uids[0],
            page_bytes.get(&p.pid).unwrap_or(&0) / 1024
        );
        for t in &p.threads {
            println!(
                "  thread {} {:?} rip={:#x} sigmask={:#x} {:?}{}",
                t.tid,
                t.comm,
                t.gp_regs.get(GP_REG_RIP).copied().unwrap_or_default(),
                t.sigmask,
                t.syscall,
                pending_note(&t.pending)
            );
        }
        if !p.shared_pending.is_empty() {
            println!("  process-wide{}", pending_note(&p.shared_pending));
        }
        for t in p
            .itimers
            .iter()
            .filter(|t| t.value_us != 0 || t.interval_us != 0)
        {
            println!("  {}", itimer_line(t));
        }
        for t in &p.posix_timers {
            println!(
                "  POSIX timer {} clock {} signal {} notify {:#x}: {} ns left, every {} ns, \
                 overrun {}",
                t.id, t.clock, t.signo, t.notify, t.value_ns, t.interval_ns, t.overrun
            );
        }
        for v in &p.vmas {
            let backing = match &v.backing {
                Backing::Anonymous => "anon".to_string(),
                Backing::File { ghost: Some(_), .. } => "deleted file".to_string(),
                Backing::File { .. } => "file".to_string(),
                Backing::Shmem { object } => format!("shmem#{object}"),
                Backing::AioRing(r) => format!(
                    "aio ring: {} events, head {}, tail {}, {} unreaped",
                    r.nr,
                    r.head,
                    r.tail,
                    r.events.len() / 32
                ),
                other => format!("{other:?}").to_lowercase(),
            };
            println!(
                "  {:012x}-{:012x} {}{}{}{} {:<12} {}",
                v.start,
                v.end,
                if v.prot & 1 != 0 { 'r' } else { '-' },
                if v.prot & 2 != 0 { 'w' } else { '-' },
                if v.prot & 4 != 0 { 'x' } else { '-' },
                if v.shared { 's' } else { 'p' },
                backing,
                v.name
            );
        }
        for fd in &p.fds {
            let d = tree.files.get(fd.file as usize).with_context(|| {
                format!(
                    "PID {} fd {}: no file {} in the image",
                    p.pid, fd.fd, fd.file
                )
            })?;
            let what = match &d.kind {
                FileKind::Regular { path, ghost, .. } => format!(
                    "file {path}{}",
                    if ghost.is_some() { " (deleted)" } else { "" }
                ),
                FileKind::Directory { path, removed } => {
                    format!(
                        "directory {path}{}",
                        if *removed { " (removed)" } else { "" }
                    )
                }
                FileKind::Device { path, .. } => format!("device {path}"),
                FileKind::Pipe { pipe } => format!("pipe#{pipe}"),
                FileKind::EventFd { count, .. } => format!("eventfd count={count}"),
                FileKind::Memfd { object } => format!("memfd shmem#{object}"),
                FileKind::Epoll(e) => format!("epoll {e:?}"),
                FileKind::Timerfd(t) => format!("timerfd {t:?}"),
                FileKind::Signalfd(s) => format!("signalfd {s:?}"),
                FileKind::Inotify(i) => format!("inotify {i:?}"),
                FileKind::Fanotify(n) => format!("fanotify {n:?}"),
                FileKind::Socket(s) => format!("socket {s}"),
                FileKind::Tty(t) => format!("tty {t:?}"),
                FileKind::PathOnly { path } => format!("path {path} (O_PATH)"),
                FileKind::Pidfd { pid } => format!("pidfd of PID {pid}"),
                FileKind::ProcFile { pid, rest } => format!("/proc/{pid}{rest} (of the tree)"),
                FileKind::Unknown => "unknown".into(),
            };
            println!(
                "  fd {:>3} -> file#{} {} flags={:o} pos={}{}",
                fd.fd,
                d.id,
                what,
                d.flags,
                d.pos,
                if fd.cloexec { " cloexec" } else { "" }
            );
        }
    }
    println!(
        "\n{} pipes, {} shared memory objects ({} KiB stored), {} deleted files",
        tree.pipes.len(),
        tree.shmem.len(),
        object_bytes / 1024,
        tree.ghosts.len()
    );
    Ok(())
}

/// Signal names for `image show` (standard signals; real-time ones by number).
fn signal_name(sig: i32) -> String {
    const NAMES: [&str; 31] = [
        "SIGHUP",
        "SIGINT",
        "SIGQUIT",
        "SIGILL",
        "SIGTRAP",
        "SIGABRT",
        "SIGBUS",
        "SIGFPE",
        "SIGKILL",
        "SIGUSR1",
        "SIGSEGV",
        "SIGUSR2",
        "SIGPIPE",
        "SIGALRM",
        "SIGTERM",
        "SIGSTKFLT",
        "SIGCHLD",
        "SIGCONT",
        "SIGSTOP",
        "SIGTSTP",
        "SIGTTIN",
        "SIGTTOU",
        "SIGURG",
        "SIGXCPU",
        "SIGXFSZ",
        "SIGVTALRM",
        "SIGPROF",
        "SIGWINCH",
        "SIGIO",
        "SIGPWR",
        "SIGSYS",
    ];
    usize::try_from(sig)
        .ok()
        .and_then(|s| s.checked_sub(1))
        .and_then(|i| NAMES.get(i))
        .map_or_else(|| format!("signal {sig}"), |n| n.to_string())
}

/// " pending: SIGALRM SIGUSR1" (queued signals, in order), or nothing.
fn pending_note(queue: &[ferry_image::SigInfo]) -> String {
    if queue.is_empty() {
        return String::new();
    }
    let names: Vec<String> = queue.iter().map(|s| signal_name(s.signo())).collect();
    format!(" pending: {}", names.join(" "))
}

/// One armed interval timer (setitimer). A timer with an interval and nothing left has expired
/// while its signal could not be taken (the tree frozen, or the signal blocked): the kernel arms
/// it again when the signal is taken, and a restore arms it an interval from the resume.
fn itimer_line(t: &ferry_image::ITimer) -> String {
    let which = match t.which {
        0 => "ITIMER_REAL".to_string(),
        1 => "ITIMER_VIRTUAL".to_string(),
        2 => "ITIMER_PROF".to_string(),
        n => format!("interval timer {n}"),
    };
    let every = if t.interval_us == 0 {
        "once".to_string()
    } else {
        format!("every {} us", t.interval_us)
    };
    if t.value_us == 0 {
        format!("{which}: expired, its signal not yet taken, {every}")
    } else {
        format!("{which}: {} us left, {every}", t.value_us)
    }
}
