//! `ferry checkpoint PID --dir DIR [--leave-running]`

use anyhow::{Context, Result};
use ferry_engine::checkpoint::{capture_with, CaptureReport};
use ferry_engine::freeze::FrozenTree;
use std::collections::HashMap;
use std::ffi::OsStr;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// The process to capture, with all its descendants.
    pub pid: i32,
    /// Directory to write the image into (created if missing, mode 0700; the image in it is
    /// mode 0600).
    #[arg(long)]
    pub dir: PathBuf,
    /// Let the tree carry on after the checkpoint instead of killing it.
    #[arg(long)]
    pub leave_running: bool,
    /// Make an incremental image: store only the pages that differ from those of the image in
    /// this directory (its parent, which a restore needs, unchanged, where it is now).
    #[arg(long)]
    pub parent: Option<PathBuf>,
    /// Print a machine-readable report.
    #[arg(long)]
    pub json: bool,
    /// The user the daemon checkpoints for (internal): only a tree of theirs is captured, and
    /// the image directory is opened and written with their rights.
    #[arg(long, hide = true)]
    pub owner: Option<ferry_sys::owner::Owner>,
}

#[derive(serde::Serialize)]
struct Report {
    root_pid: i32,
    image: PathBuf,
    left_running: bool,
    freeze_ms: f64,
    frozen_ms: f64,
    total_ms: f64,
    #[serde(flatten)]
    capture: CaptureReport,
}

/// Runs the checkpoint in a worker process. The worker is the only tracer of the tree: if this
/// process is killed, even by SIGKILL, the worker is told (parent-death signal), stops at the
/// next safe point, puts every thread back as it was and detaches. The tree never notices.
pub fn run(a: Args, node: Option<&str>) -> Result<()> {
    use ferry_sys::process::{fork_single_threaded, Forked};
    if a.owner.is_none() && !super::is_root()? {
        // Not root: the daemon checkpoints for us, as us.
        let dir = super::absolute_arg(&a.dir)?;
        let parent = a.parent.as_deref().map(super::absolute_arg).transpose()?;
        return super::via_daemon(
            node,
            &ferry_transport::Msg::Checkpoint {
                pid: a.pid,
                dir,
                leave_running: a.leave_running,
                parent,
                json: a.json,
            },
        );
    }
    let parent = std::process::id() as i32;
    match fork_single_threaded().context("start the checkpoint worker")? {
        Forked::Parent { child } => {
            let code = ferry_sys::process::wait_exit_code(child)
                .context("wait for the checkpoint worker")?;
            std::process::exit(code);
        }
        Forked::Child => {
            let cancel = ferry_engine::cancel::flag();
            for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
                signal_hook::flag::register(sig, cancel.clone())
                    .context("install signal handlers")?;
            }
            ferry_sys::process::set_parent_death_signal(libc::SIGTERM)
                .context("watch the ferry process")?;
            if ferry_sys::process::parent_pid() != parent {
                anyhow::bail!("ferry exited before the checkpoint started");
            }
            work(a)
        }
    }
}

/// The directory an image is written into, held open: every name in it is made and replaced
/// relative to this descriptor, never through a symbolic link someone placed there.
struct ImageDir {
    fd: std::os::fd::OwnedFd,
    path: PathBuf,
    /// Whose rights every name in it is made, replaced and removed with (root's for root).
    creds: ferry_sys::fsid::FsCreds,
}

const PARTIAL: &str = "image.ferry.partial";

impl ImageDir {
    /// Opens `path`, creating it (mode 0700, its parents as usual) if it does not exist. A
    /// directory that exists is left as it is.
    fn open(path: &Path, creds: ferry_sys::fsid::FsCreds) -> Result<ImageDir> {
        let (fd, path) = ferry_sys::fsid::with_fs_creds(&creds, || Self::open_as_me(path))
            .map_err(|e| e.io())
            .with_context(|| format!("act as {creds}"))??;
        Ok(ImageDir { fd, path, creds })
    }

    fn open_as_me(path: &Path) -> Result<(std::os::fd::OwnedFd, PathBuf)> {
        use std::os::unix::fs::DirBuilderExt;
        if !path.exists() {
            if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(parent)
                    .with_context(|| format!("create directory {}", parent.display()))?;
            }
            match std::fs::DirBuilder::new().mode(0o700).create(path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => {
                    return Err(e)
                        .with_context(|| format!("create image directory {}", path.display()))
                }
            }
        }
        let fd = ferry_sys::fdops::open_path(
            &path.to_string_lossy(),
            libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
            0,
        )
        .map_err(|e| e.io())
        .with_context(|| format!("open image directory {}", path.display()))?;
        Ok((fd, path.to_owned()))
    }

    /// Runs `f` with the rights of the image's owner.
    fn as_owner<T: Send>(&self, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
        ferry_sys::fsid::with_fs_creds(&self.creds, f)
            .map_err(|e| e.io())
            .with_context(|| format!("act as {}", self.creds))?
    }

    /// Creates the partial image, mode 0600: a new file, never one that a name in the
    /// directory points to (a partial image a killed checkpoint left, or a symbolic link
    /// someone put there, is removed first: the name, not what it points to).
    fn create_partial(&self) -> Result<std::fs::File> {
        self.as_owner(|| self.create_partial_as_me())
    }

    fn create_partial_as_me(&self) -> Result<std::fs::File> {
        use std::os::fd::AsRawFd;
        let create = || {
            ferry_sys::fsid::openat2(
                self.fd.as_raw_fd(),
                PARTIAL,
                libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                0o600,
                libc::RESOLVE_BENEATH | libc::RESOLVE_NO_SYMLINKS,
            )
        };
        let fd = match create() {
            Err(e) if e.errno == libc::EEXIST => {
                self.remove_partial();
                create()
            }
            r => r,
        }
        .map_err(|e| e.io())
        .with_context(|| format!("create {}", self.path.join(PARTIAL).display()))?;
        Ok(std::fs::File::from(fd))
    }

    fn remove_partial(&self) {
        use std::os::fd::AsRawFd;
        let _ = self.as_owner(|| {
            Ok(ferry_sys::fsid::unlink_in(
                self.fd.as_raw_fd(),
                OsStr::new(PARTIAL),
            ))
        });
    }

    /// The partial image becomes the image (whatever had that name is replaced, not followed).
    fn commit(&self) -> Result<PathBuf> {
        use std::os::fd::AsRawFd;
        let to = self.path.join(ferry_image::IMAGE_FILE);
        self.as_owner(|| {
            ferry_sys::fsid::rename_in(
                self.fd.as_raw_fd(),
                OsStr::new(PARTIAL),
                OsStr::new(ferry_image::IMAGE_FILE),
                false,
            )
            .map_err(|e| e.io())
            .with_context(|| format!("rename the image to {}", to.display()))
        })?;
        let dir = format!("/proc/self/fd/{}", self.fd.as_raw_fd());
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(to)
    }
}

/// Per process of a tree (by our PIDs), sorted ranges of pages.
type Inherited = HashMap<i32, Vec<(u64, u64)>>;

/// The pages of every process of the frozen tree (by our PIDs) that are exactly as the image in
/// `parent` (and its own parents) holds them: every page the parent holds is read and compared.
/// And the parent's identity, for the new image to record.
fn unchanged_pages(
    frozen: &FrozenTree,
    parent: &Path,
    creds: &ferry_sys::fsid::FsCreds,
) -> Result<(Inherited, Option<ferry_image::ParentImage>)> {
    // The parent images are read with the rights of whoever the checkpoint is for.
    let (cache, me) = ferry_sys::fsid::with_fs_creds(creds, || -> Result<_> {
        let dir = std::fs::canonicalize(parent)
            .with_context(|| format!("parent image {}", parent.display()))?;
        let (cache, me) = ferry_memory::cache::load_chain(&dir, None)
            .with_context(|| format!("read the parent image in {}", dir.display()))?;
        Ok((cache, me))
    })
    .map_err(|e| e.io())
    .with_context(|| format!("act as {creds}"))??;
    let page = ferry_sys::PAGE_SIZE as usize;
    let mut out = HashMap::new();
    let mut buf = vec![0u8; 4 << 20];
    for fp in frozen.procs.iter().filter(|p| !p.zombie) {
        let host = fp.host();
        let Some(image_pid) = ferry_memory::precopy::inner_pid(host) else {
            continue;
        };
        let mem = ferry_sys::proc_mem::ProcMem::open(host)
            .map_err(|e| e.io())
            .with_context(|| format!("open the memory of PID {host}"))?;
        let pagemap = std::fs::File::open(format!("/proc/{host}/pagemap"))
            .with_context(|| format!("open the pagemap of PID {host}"))?;
        let addrs = cache.pages_of(image_pid);
        let mut same: Vec<(u64, u64)> = Vec::new();
        let mut i = 0;
        while i < addrs.len() {
            // A run of consecutive pages the parent holds, at most the buffer's size.
            let mut j = i + 1;
            while j < addrs.len()
                && addrs[j] == addrs[j - 1] + page as u64
                && (j - i) * page < buf.len()
            {
                j += 1;
            }
            let len = (j - i) * page;
            // (Pages shared copy-on-write stay shared, for the capture to find them so.)
            let got = ferry_sys::proc_mem::read_keeping_shared(
                host,
                &pagemap,
                &mem,
                addrs[i],
                &mut buf[..len],
            );
            let got = if got < len {
                // Unreadable that way (PROT_NONE, say), or gone: /proc/PID/mem, page by page.
                let mut k = got / page * page;
                while k < len
                    && mem
                        .read_exact(addrs[i] + k as u64, &mut buf[k..k + page])
                        .is_ok()
                {
                    k += page;
                }
                k
            } else {
                len
            };
            for k in 0..got / page {
                let a = addrs[i + k];
                if cache.get(image_pid, a) == Some(&buf[k * page..(k + 1) * page]) {
                    match same.last_mut() {
                        Some((_, e)) if *e == a => *e = a + page as u64,
                        _ => same.push((a, a + page as u64)),
                    }
                }
            }
            i = j;
        }
        out.insert(fp.pid, same);
    }
    Ok((out, Some(me)))
}

fn work(a: Args) -> Result<()> {
    let t0 = Instant::now();
    let owner = a.owner.as_ref();
    super::worker::owned(a.pid, owner)?;
    let creds = owner.map_or_else(ferry_sys::fsid::FsCreds::root, |o| o.fs_creds());
    let dir = ImageDir::open(&a.dir, creds)?;
    // The contents of its files, hashed while it still runs (not in the freeze).
    ferry_engine::digests::warm(a.pid);
    let frozen = FrozenTree::freeze(a.pid).with_context(|| format!("freeze PID {}", a.pid))?;
    // Frozen, the tree can no longer change hands: the check that counts (dropping `frozen`
    // lets it go unharmed).
    super::worker::owned_frozen(&frozen, owner)?;
    let freeze_ms = t0.elapsed().as_secs_f64() * 1e3;
    let file = dir.create_partial()?;
    // A buffer smaller than the engine's runs of memory (4 MiB): BufWriter copies what fits
    // in its buffer and passes larger writes straight to the file, so the small writes (record
    // headers, short runs) are gathered and the large ones are not copied once more.
    let out = BufWriter::with_capacity(256 << 10, file);
    let base = match a
        .parent
        .as_deref()
        .map(|p| unchanged_pages(&frozen, p, &dir.creds))
        .transpose()
    {
        Ok(b) => b,
        Err(e) => {
            dir.remove_partial();
            return Err(e.context(format!("checkpoint PID {}", a.pid)));
        }
    };
    let (inherited, parent) = base.unwrap_or_default();
    let written = capture_with(&frozen, out, &inherited, parent, || Ok(())).and_then(|done| {
        // Last chance to back out: after this point the tree is killed or let go as asked.
        ferry_engine::cancel::check("writing the image")?;
        Ok(done)
    });
    let (out, capture_report) = match written {
        Ok(ok) => ok,
        Err(e) => {
            dir.remove_partial();
            // Dropping `frozen` lets the tree carry on untouched.
            return Err(e).with_context(|| format!("checkpoint PID {}", a.pid));
        }
    };
    let file = out
        .into_inner()
        .map_err(|e| e.into_error())
        .context("flush the image")?;
    file.sync_all().context("sync the image to disk")?;
    let final_path = dir.commit()?;
    // The image is complete and on disk: only now may the tree go.
    let frozen_ms;
    if a.leave_running {
        frozen.thaw();
        frozen_ms = t0.elapsed().as_secs_f64() * 1e3;
    } else {
        frozen_ms = t0.elapsed().as_secs_f64() * 1e3;
        frozen.kill();
    }
    let report = Report {
        root_pid: a.pid,
        image: final_path,
        left_running: a.leave_running,
        freeze_ms,
        frozen_ms,
        total_ms: t0.elapsed().as_secs_f64() * 1e3,
        capture: capture_report,
    };
    if a.json {
        super::print_json(&report)?;
    } else {
        let mut o = std::io::stdout().lock();
        writeln!(
            o,
            "checkpointed PID {} ({} processes, {} threads): {:.1} MiB of memory in {:.1} MiB of image, {:.0} ms; {}",
            report.root_pid,
            report.capture.pids.len(),
            report.capture.threads,
            report.capture.memory_bytes as f64 / 1048576.0,
            report.capture.image_bytes as f64 / 1048576.0,
            report.total_ms,
            if a.leave_running { "left running" } else { "tree killed" }
        )?;
    }
    Ok(())
}
