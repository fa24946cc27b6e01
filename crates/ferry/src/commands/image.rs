//! `ferry image show DIR`: what an image holds, like CRIU's crit.

use anyhow::{Context, Result};
use ferry_image::{Backing, FileKind, ImageReader, Record};
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
    let mut r = ImageReader::new(BufReader::new(file))
        .with_context(|| format!("read image {}", path.display()))?;
    let mut tree = None;
    let mut page_bytes = std::collections::HashMap::<i32, u64>::new();
    let mut object_bytes = 0u64;
    while let Some(rec) = r
        .next_record()
        .with_context(|| format!("read image {}", path.display()))?
    {
        match rec {
            Record::Tree(t) => tree = Some(t),
            Record::Pages { pid, data, .. } => {
                *page_bytes.entry(pid).or_default() += data.len() as u64
            }
            Record::Object { data, .. } => object_bytes += data.len() as u64,
            Record::End { .. } => {}
        }
    }
    let tree = tree.context("image has no tree record")?;
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
                "zombie"
            } else {
                ""
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
                "  thread {} {:?} rip={:#x} sigmask={:#x} {:?}",
                t.tid, t.comm, t.gp_regs[16], t.sigmask, t.syscall
            );
        }
        for v in &p.vmas {
            let backing = match &v.backing {
                Backing::Anonymous => "anon".to_string(),
                Backing::File { ghost: Some(_), .. } => "deleted file".to_string(),
                Backing::File { .. } => "file".to_string(),
                Backing::Shmem { object } => format!("shmem#{object}"),
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
            let d = &tree.files[fd.file as usize];
            let what = match &d.kind {
                FileKind::Regular { path, ghost, .. } => format!(
                    "file {path}{}",
                    if ghost.is_some() { " (deleted)" } else { "" }
                ),
                FileKind::Directory { path } => format!("directory {path}"),
                FileKind::Device { path, .. } => format!("device {path}"),
                FileKind::Pipe { pipe } => format!("pipe#{pipe}"),
                FileKind::EventFd { count, .. } => format!("eventfd count={count}"),
                FileKind::Memfd { object } => format!("memfd shmem#{object}"),
                FileKind::Epoll(e) => format!("epoll {e:?}"),
                FileKind::Timerfd(t) => format!("timerfd {t:?}"),
                FileKind::Signalfd(s) => format!("signalfd {s:?}"),
                FileKind::Inotify(i) => format!("inotify {i:?}"),
                FileKind::Socket(s) => format!("socket {s}"),
                FileKind::Tty(t) => format!("tty {t:?}"),
                FileKind::PathOnly { path } => format!("path {path} (O_PATH)"),
                FileKind::Pidfd { pid } => format!("pidfd of PID {pid}"),
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
