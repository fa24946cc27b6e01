//! `ferry restore --dir DIR [--pid-namespace]`

use anyhow::{Context, Result};
use ferry_engine::guest_ns::GuestNamespaces;
use ferry_engine::restore::{open, restore_with, RestoreOptions, RestoreReport};
use std::io::BufReader;
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// Directory holding the image.
    #[arg(long)]
    pub dir: PathBuf,
    /// Print a machine-readable report.
    #[arg(long)]
    pub json: bool,
    /// Rebuild the tree in fresh PID, time and mount namespaces of its own: it gets back its
    /// PIDs even if they are taken here (the original may still run), and its monotonic clocks
    /// continue from where it saw them. Prints the root's PID on this machine.
    #[arg(long)]
    pub pid_namespace: bool,
    /// Copy-on-reference: the tree runs at once, its private anonymous memory coming from the
    /// image as it is touched (each fault served with its page and `--prefetch` neighbours)
    /// while a background push copies the rest. The command stays until every page is in and
    /// then reports when the image stopped being needed; if the image cannot supply a page,
    /// the tree is killed and the command fails saying why.
    #[arg(long)]
    pub lazy: bool,
    /// With --lazy: pages copied after a faulting one.
    #[arg(long, default_value_t = 1, requires = "lazy")]
    pub prefetch: usize,
    /// With --lazy: start the background push this many milliseconds after the tree runs
    /// (until then only faults bring pages in).
    #[arg(long, default_value_t = 0, requires = "lazy")]
    pub push_after_ms: u64,
    /// The user the daemon restores for (internal): the image is read with their rights, and
    /// refused unless every process in it would hold their credentials and nothing more.
    #[arg(long, hide = true)]
    pub owner: Option<ferry_sys::owner::Owner>,
}

#[derive(serde::Serialize)]
struct Report {
    /// Reading the image's header and tree; the rest is read as the tree is rebuilt.
    read_ms: f64,
    total_ms: f64,
    image_data_bytes: u64,
    #[serde(flatten)]
    restore: RestoreReport,
}

/// With --lazy, printed when every page is in (after the report of the restore itself).
#[derive(serde::Serialize)]
struct LazyReport {
    /// From the moment the tree ran until the image was no longer needed.
    image_released_after_run_ms: f64,
    lazy: ferry_memory::Stats,
}

pub fn run(a: Args, node: Option<&str>) -> Result<()> {
    if a.owner.is_none() && !super::is_root()? {
        // Not root: the daemon restores for us, as us.
        if a.lazy {
            anyhow::bail!("ferry restore --lazy is root's only (the daemon does not serve it)");
        }
        return super::via_daemon(
            node,
            &ferry_transport::Msg::Restore {
                dir: super::absolute_arg(&a.dir)?,
                pid_namespace: a.pid_namespace,
                json: a.json,
            },
        );
    }
    let t0 = Instant::now();
    let path = a.dir.join(ferry_image::IMAGE_FILE);
    // What is read from the image directory is read with the rights of whoever the restore is
    // for.
    let creds = a
        .owner
        .as_ref()
        .map_or_else(ferry_sys::fsid::FsCreds::root, |o| o.fs_creds());
    let as_owner = |what: &str| format!("{what} as {creds}");
    let file = ferry_sys::fsid::with_fs_creds(&creds, || std::fs::File::open(&path))
        .map_err(|e| e.io())
        .with_context(|| as_owner("open the image"))?
        .with_context(|| format!("open image {}", path.display()))?;
    let mut img = open(BufReader::with_capacity(1 << 20, file))
        .with_context(|| format!("read image {}", path.display()))?;
    if let Some(o) = &a.owner {
        // An image is data the user could have written: it grants them nothing.
        ferry_engine::owner::check_image(&img.tree, o)
            .with_context(|| format!("restore from {}", path.display()))?;
        // The processes stay in the restorer's cgroups: joining the image's would be root's
        // choice, not theirs.
        for p in &mut img.tree.processes {
            p.cgroups.clear();
        }
    }
    // An incremental image: its parents' pages, each parent checked to be the one recorded.
    let parent_pages = match &img.tree.parent {
        Some(p) => {
            let (cache, _) = ferry_sys::fsid::with_fs_creds(&creds, || {
                ferry_memory::cache::load_chain(std::path::Path::new(&p.dir), Some(p))
            })
            .map_err(|e| e.io())
            .with_context(|| as_owner("read the parent image"))?
            .with_context(|| {
                format!("read the parent image in {} (of {})", p.dir, path.display())
            })?;
            Some(cache)
        }
        None => None,
    };
    let read_ms = t0.elapsed().as_secs_f64() * 1e3;
    let guest = if a.pid_namespace {
        let exe = std::env::current_exe().context("find the ferry executable")?;
        Some(
            GuestNamespaces::create(&exe, img.tree.clocks, None)
                .context("make the guest namespaces")?,
        )
    } else {
        None
    };
    // Indexed before anything is made: a truncated image is refused here.
    let server = if a.lazy {
        let source = ferry_memory::ImageSource::open(&path).map_err(anyhow::Error::msg)?;
        Some(ferry_memory::LazyServer::new(
            Box::new(source),
            ferry_memory::Options {
                prefetch: a.prefetch,
                push_after: std::time::Duration::from_millis(a.push_after_ms),
                guardian: Some(std::env::current_exe().context("find the ferry executable")?),
                ..Default::default()
            },
        ))
    } else {
        None
    };
    let opts = RestoreOptions {
        guest: guest.as_ref(),
        // Files are opened as each process, then (only the very file captured) as the caller:
        // Ferry itself for root, else the user the daemon restores for.
        caller: a.owner.as_ref().map(|_| &creds),
        cpu_cgroup: None,
        relays: false,
        lazy: server
            .as_ref()
            .map(|s| s as &dyn ferry_engine::lazy::LazyMemory),
        supervised: false,
        pages: parent_pages
            .as_ref()
            .map(|c| c as &dyn ferry_engine::restore::InheritedPages),
        adopt: &[],
        release: None,
    };
    let report = restore_with(&mut img, &opts)
        .and_then(|tree| tree.resume())
        .with_context(|| format!("restore from {}", path.display()))?;
    let resumed = Instant::now();
    let report = Report {
        read_ms,
        total_ms: t0.elapsed().as_secs_f64() * 1e3,
        image_data_bytes: img.data_bytes(),
        restore: report,
    };
    if a.json {
        super::print_json(&report)?;
    } else {
        // Our PID of the root: the same as the image's unless it was rebuilt in a namespace.
        println!("{}", report.restore.root_host_pid);
    }
    if let Some(server) = server {
        use std::io::Write;
        std::io::stdout().flush().context("write the report")?;
        let stats = server
            .wait()
            .map_err(|e| anyhow::anyhow!("lazy restore from {}: {e}", path.display()))?;
        let released_ms = resumed.elapsed().as_secs_f64() * 1e3;
        if a.json {
            super::print_json(&LazyReport {
                image_released_after_run_ms: released_ms,
                lazy: stats,
            })?;
        } else {
            let how = if stats.ended_owing > 0 {
                format!(
                    "{} of the tree's address spaces ended before all their pages were in",
                    stats.ended_owing
                )
            } else {
                "every page is in".to_string()
            };
            eprintln!(
                "ferry: {how}: the image was needed for {released_ms:.1} ms after \
                 the tree ran ({} faults, {} pages brought by faults, {} pushed, {} zero; {} \
                 forks, {} mremaps, {} munmaps, {} madvises followed)",
                stats.faults,
                stats.fault_pages,
                stats.pushed_pages,
                stats.zero_pages,
                stats.forked,
                stats.remaps,
                stats.unmaps,
                stats.removes
            );
        }
    }
    Ok(())
}

/// `ferry __lazy-guard SERVER_PID`: see `ferry_memory::guard`. It outlives a Ctrl-C, a hang-up
/// or a SIGTERM that ends the restoring ferry, so as to kill the tree that ferry was serving.
pub fn lazy_guard(server_pid: i32) -> Result<()> {
    let ignored = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    for sig in [
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGHUP,
        signal_hook::consts::SIGQUIT,
    ] {
        signal_hook::flag::register(sig, ignored.clone()).context("hold back a signal")?;
    }
    let killed = ferry_memory::guard::guard_main(server_pid).map_err(anyhow::Error::msg)?;
    if killed {
        std::process::exit(2);
    }
    Ok(())
}
