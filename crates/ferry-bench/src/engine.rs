//! `ferry-bench engine`: checkpoint and restore against a plain memory copy.
//!
//! For each size, in one run and one after the other:
//!
//! 1. the physical limit: `memcpy` between two pre-faulted buffers of the
//!    size in this process (best of several copies), and writing the same
//!    bytes to a file in the image directory followed by fsync (what any
//!    image on that disk costs at least);
//! 2. a child (`ferry-bench hold`) fills that much memory with non-zero
//!    pseudo-random data and says ready;
//! 3. `ferry checkpoint PID --dir D --json` (which kills it), then
//!    `ferry restore --dir D --json`, each timed from outside as well;
//! 4. the restored child checksums its memory again: a restore that lost a
//!    page fails the benchmark.
//!
//! With the physical limit comes the floor of any copying engine (`floor.rs`):
//! the kernel's data movement alone, step by step.

pub(crate) use crate::common::{ferry_binary, markdown, HOLD_TIMEOUT};
use crate::common::{ferry_json, memcpy_ms, num, random_bytes, wait_gone, Holder};
use crate::floor;
use anyhow::{anyhow, bail, Context, Result};
use std::fmt::Write as _;
use std::fs::{self, File};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::thread::sleep;
use std::time::{Duration, Instant};

const MIB: f64 = 1048576.0;
const GIB: f64 = 1073741824.0;

#[derive(clap::Args)]
pub struct Args {
    /// Memory sizes to measure, in MiB, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,64,512,2048")]
    sizes: Vec<usize>,
    /// The ferry binary to measure. Default: the workspace's
    /// target/release/ferry, brought up to date with
    /// `cargo build --release -p ferry` first.
    #[arg(long)]
    ferry: Option<PathBuf>,
    /// Where the images go: a fresh directory is made inside it and
    /// removed afterwards.
    #[arg(long, default_value = "/tmp")]
    dir: PathBuf,
    /// Runs per size; the table shows the run with the median checkpoint +
    /// restore time.
    #[arg(long, default_value_t = 1)]
    runs: usize,
    /// Evict the image from the page cache before restoring, so that
    /// restore reads it from disk (as on another machine or after a reboot).
    #[arg(long)]
    cold: bool,
    /// What the checkpointed process holds besides its memory (see --shapes), e.g.
    /// `cowchildren:30`: 30 children forked once the memory is filled, sharing it
    /// copy-on-write (a pre-fork server).
    #[arg(long)]
    hold_shape: Option<String>,
    /// Also print ferry's JSON reports of every run.
    #[arg(long)]
    verbose: bool,
    /// A CRIU binary (v4.2 built from source: docs/benchmarks.md): instead of the memcpy
    /// tables, Ferry and CRIU take turns on every size and every shape of --shapes.
    #[arg(long)]
    criu: Option<PathBuf>,
    /// With --criu, the shapes measured besides the sizes (each holding 1 MiB of memory):
    /// KIND:COUNT joined by `+`, KIND one of maps, threads, children, fds.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "maps:8000,threads:200,children:30,fds:2000"
    )]
    shapes: Vec<String>,
}

/// Everything measured in one run of one size (times in ms).
#[derive(Default, Clone)]
struct Sample {
    base: Baselines,
    ck_wall: f64,
    ck_total: f64,
    freeze: f64,
    frozen: f64,
    state: f64,
    ck_memory: f64,
    image_bytes: f64,
    memory_bytes: f64,
    rs_wall: f64,
    rs_total: f64,
    read: f64,
    build: f64,
    rs_memory: f64,
    finish: f64,
    down: f64,
}

pub fn run(a: Args) -> Result<()> {
    if a.sizes.is_empty() || a.sizes.contains(&0) {
        bail!("--sizes needs sizes in MiB, all above 0");
    }
    if a.runs == 0 {
        bail!("--runs must be at least 1");
    }
    if cfg!(debug_assertions) {
        eprintln!(
            "ferry-bench: this is a debug build: filling and checking memory will be slow \
             (the measurements of ferry are not affected); use cargo run --release -p ferry-bench"
        );
    }
    let ferry = ferry_binary(a.ferry.as_deref())?;
    // Restored processes are detached by `ferry restore`; as a subreaper we
    // become their parent and can reap them.
    // SAFETY: prctl with integer arguments only changes this process's flag.
    if unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) } != 0 {
        eprintln!(
            "ferry-bench: PR_SET_CHILD_SUBREAPER failed: {}",
            std::io::Error::last_os_error()
        );
    }
    fs::create_dir_all(&a.dir).with_context(|| format!("create {}", a.dir.display()))?;
    let work = a
        .dir
        .join(format!("ferry-bench-engine.{}", std::process::id()));
    fs::create_dir_all(&work).with_context(|| format!("create {}", work.display()))?;
    if let Some(criu) = &a.criu {
        let mut cases: Vec<crate::criu::Case> = a
            .sizes
            .iter()
            .map(|&mib| crate::criu::Case {
                mib,
                shape: Default::default(),
            })
            .collect();
        for sh in &a.shapes {
            cases.push(crate::criu::Case {
                mib: 1,
                shape: crate::hold::Shape::parse(sh)?,
            });
        }
        let result = crate::criu::compare(&cases, a.runs, &ferry, criu, &work);
        let _ = fs::remove_dir_all(&work);
        let report = result?;
        print!("{}", machine(&a.dir, &ferry));
        println!("criu:    {}", criu.display());
        print!("{report}");
        return Ok(());
    }
    let result = measure_all(&a, &ferry, &work);
    let _ = fs::remove_dir_all(&work);
    let rows = result?;
    print!("{}", machine(&a.dir, &ferry));
    print!("{}", table(&rows, a.runs, a.cold));
    Ok(())
}

fn measure_all(a: &Args, ferry: &Path, work: &Path) -> Result<Vec<(usize, Sample)>> {
    let mut rows = Vec::new();
    for &mib in &a.sizes {
        let mut samples = Vec::new();
        for r in 0..a.runs {
            eprintln!("ferry-bench: {mib} MiB, run {}/{}", r + 1, a.runs);
            let dir = work.join(format!("{mib}-{r}"));
            fs::create_dir_all(&dir)?;
            let s =
                measure(a, ferry, &dir, mib).with_context(|| format!("{mib} MiB, run {}", r + 1));
            let s = match s {
                Ok(s) => s,
                Err(e) => {
                    // Keep the evidence: move it out of the directory about to be removed.
                    let kept = a
                        .dir
                        .join(format!("ferry-bench-failed.{}", std::process::id()));
                    if fs::rename(&dir, &kept).is_ok() {
                        return Err(e.context(format!("files kept in {}", kept.display())));
                    }
                    return Err(e);
                }
            };
            let _ = fs::remove_dir_all(&dir);
            samples.push(s);
        }
        rows.push((mib, median(&samples)));
    }
    Ok(rows)
}

// ---------------------------------------------------------------------------
// The baselines.

/// What a run of one size is measured against (ms).
#[derive(Default, Clone, Copy)]
struct Baselines {
    /// Best time of `memcpy` between two pre-faulted buffers.
    copy: f64,
    /// Writing the same bytes to a file in the image directory and fsyncing it.
    disk: f64,
    /// The rest of the floor (see `floor.rs`): reading another process's memory, reading the
    /// file back (from the disk with `--cold`), filling fresh pages with UFFDIO_COPY.
    read_out: f64,
    read_back: f64,
    fill: f64,
}

impl Baselines {
    /// What any engine that keeps an image in a file pays: the bytes copied into the file (and
    /// fsynced), and copied from it into fresh pages of the new process.
    fn least(&self) -> f64 {
        self.disk + self.fill
    }

    /// Ferry's four steps: reading the memory from outside the process, and the image back
    /// into a buffer, come on top of the least.
    fn ferry_steps(&self) -> f64 {
        self.read_out + self.least() + self.read_back
    }
}

fn baselines(len: usize, dir: &Path, cold: bool) -> Result<Baselines> {
    let src = random_bytes(len, 42);
    let copy = memcpy_ms(&src)?;
    let read_out = floor::read_out_ms(&src)?;
    let fill = floor::fill_ms(&src)?;
    let path = dir.join("baseline-write");
    let t = Instant::now();
    let mut f = File::create(&path).with_context(|| format!("create {}", path.display()))?;
    for chunk in src.chunks(8 << 20) {
        f.write_all(chunk)
            .with_context(|| format!("write {}", path.display()))?;
    }
    f.sync_all()
        .with_context(|| format!("fsync {}", path.display()))?;
    let disk = t.elapsed().as_secs_f64() * 1e3;
    drop(f);
    if cold {
        evict(&path)?;
    }
    let read_back = floor::read_back_ms(&path, len);
    let _ = fs::remove_file(&path);
    Ok(Baselines {
        copy,
        disk,
        read_out,
        read_back: read_back?,
        fill,
    })
}

// ---------------------------------------------------------------------------
// One measurement.

/// The `hold` child, killed and reaped whatever happens.
fn measure(a: &Args, ferry: &Path, dir: &Path, mib: usize) -> Result<Sample> {
    let len = mib << 20;
    let base = baselines(len, dir, a.cold)?;

    let shape = match &a.hold_shape {
        Some(sh) => crate::hold::Shape::parse(sh)?,
        None => Default::default(),
    };
    let (mut holder, sum) = Holder::start_shaped(dir, mib, shape, Duration::from_millis(5))?;
    let pid = holder.pid;
    sleep(Duration::from_millis(100));

    let img = dir.join("img");
    let img_s = img.to_string_lossy().into_owned();
    let pid_s = pid.to_string();
    let t0 = Instant::now();
    let ck = ferry_json(
        Command::new(ferry),
        &["checkpoint", &pid_s, "--dir", &img_s, "--json"],
        dir,
        "checkpoint",
    )?;
    let ck_wall = t0.elapsed().as_secs_f64() * 1e3;
    // The checkpoint killed the child: reap it so its PID is free again.
    if let Some(mut c) = holder.child.take() {
        c.wait().context("reap the checkpointed child")?;
    }
    // Its children (a shape's) were ours once it died (we are a subreaper): reap them too.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut reaped = 0;
    while reaped < shape.children && Instant::now() < deadline {
        // SAFETY: waitpid with a null status pointer only reaps a child of ours.
        match unsafe { libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG) } {
            n if n > 0 => reaped += 1,
            0 => sleep(Duration::from_millis(5)),
            _ => break,
        }
    }
    if a.cold {
        let image = ck
            .get("image")
            .and_then(|v| v.as_str())
            .ok_or_else(|| anyhow!("ferry's checkpoint report names no image file: {ck}"))?;
        evict(Path::new(image))?;
    }
    let t1 = Instant::now();
    let rs = ferry_json(
        Command::new(ferry),
        &["restore", "--dir", &img_s, "--json"],
        dir,
        "restore",
    )?;
    let rs_wall = t1.elapsed().as_secs_f64() * 1e3;
    let down = t0.elapsed().as_secs_f64() * 1e3;
    if a.verbose {
        eprintln!("checkpoint: {ck}\nrestore: {rs}");
    }
    let restored = num(&rs, "root_pid")? as i32;
    if restored != pid {
        bail!("ferry restore gave PID {restored}, expected {pid}");
    }

    File::create(dir.join("go"))?;
    let result = holder.wait_file(&dir.join("result"), HOLD_TIMEOUT, Duration::from_millis(5))?;
    if result.trim() != sum {
        bail!(
            "the restored child's memory differs: checksum {} after restore, {sum} before",
            result.trim()
        );
    }
    if !wait_gone(pid, Duration::from_secs(30)) {
        bail!("the restored child did not exit after writing its result");
    }
    std::mem::forget(holder); // gone and reaped
    let _ = fs::remove_dir_all(&img);

    Ok(Sample {
        base,
        ck_wall,
        ck_total: num(&ck, "total_ms")?,
        freeze: num(&ck, "freeze_ms")?,
        frozen: num(&ck, "frozen_ms")?,
        state: num(&ck, "state_ms")?,
        ck_memory: num(&ck, "memory_ms")?,
        image_bytes: num(&ck, "image_bytes")?,
        memory_bytes: num(&ck, "memory_bytes")?,
        rs_wall,
        rs_total: num(&rs, "total_ms")?,
        read: num(&rs, "read_ms")?,
        build: num(&rs, "build_ms")?,
        rs_memory: num(&rs, "memory_ms")?,
        finish: num(&rs, "finish_ms")?,
        down,
    })
}

/// Drop one file's pages from the page cache (they are clean: the image was
/// fsynced), leaving everyone else's cache alone.
fn evict(path: &Path) -> Result<()> {
    let f = File::open(path).with_context(|| format!("open {}", path.display()))?;
    use std::os::fd::AsRawFd;
    // SAFETY: posix_fadvise on an fd we own; it only drops cached pages.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc != 0 {
        bail!(
            "posix_fadvise(DONTNEED) {}: {}",
            path.display(),
            std::io::Error::from_raw_os_error(rc)
        );
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// The report.

/// The run whose checkpoint + restore time is the median one, whole: its
/// parts add up, unlike medians taken column by column.
fn median(samples: &[Sample]) -> Sample {
    let mut v: Vec<&Sample> = samples.iter().collect();
    v.sort_by(|a, b| (a.ck_wall + a.rs_wall).total_cmp(&(b.ck_wall + b.rs_wall)));
    v[v.len() / 2].clone()
}

fn first_line_with(path: &str, key: &str) -> Option<String> {
    fs::read_to_string(path)
        .ok()?
        .lines()
        .find(|l| l.starts_with(key))
        .map(|l| {
            l.split_once(':')
                .map(|x| x.1)
                .unwrap_or(l)
                .trim()
                .to_owned()
        })
}

/// What the numbers were measured on.
fn machine(dir: &Path, ferry: &Path) -> String {
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let kernel = fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let model = first_line_with("/proc/cpuinfo", "model name").unwrap_or_default();
    let mem = first_line_with("/proc/meminfo", "MemTotal")
        .and_then(|m| m.split_whitespace().next()?.parse::<f64>().ok())
        .map(|kib| format!("{:.1} GiB", kib / MIB))
        .unwrap_or_default();
    // The filesystem holding the images: the longest mount point above dir.
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    let fs_line = fs::read_to_string("/proc/mounts")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() > 2 && dir.starts_with(f[1]))
                .then(|| (f[1].len(), format!("{} ({} on {})", f[2], f[0], f[1])))
        })
        .max()
        .map(|x| x.1)
        .unwrap_or_default();
    let mut s = String::new();
    let _ = writeln!(
        s,
        "machine: {cpus} CPUs ({model}), {mem}, kernel {}",
        kernel.trim()
    );
    let _ = writeln!(
        s,
        "images:  {} on {fs_line}; ferry: {}",
        dir.display(),
        ferry.display()
    );
    s
}

fn table(rows: &[(usize, Sample)], runs: usize, cold: bool) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\n{} (of {runs} run{} per size, the one with the median checkpoint + restore time; \
         times in ms; %copy = throughput as a percentage of memcpy's)\n",
        if cold {
            "restore from disk (image evicted from the page cache)"
        } else {
            "restore from the page cache"
        },
        if runs == 1 { "" } else { "s" }
    );
    let head = [
        "size MiB",
        "memcpy GiB/s",
        "write+fsync",
        "checkpoint",
        "frozen",
        "restore",
        "downtime",
        "image MiB",
        "ckpt %copy",
        "restore %copy",
        "ck+rs %copy",
    ];
    let mut lines = vec![head.iter().map(|h| h.to_string()).collect::<Vec<_>>()];
    for (mib, x) in rows {
        let gib = *mib as f64 / 1024.0;
        let pct = |t: f64| format!("{:.1}%", 100.0 * x.base.copy / t);
        lines.push(vec![
            mib.to_string(),
            format!("{:.1}", gib / (x.base.copy / 1e3)),
            format!("{:.0}", x.base.disk),
            format!("{:.0}", x.ck_wall),
            format!("{:.0}", x.frozen),
            format!("{:.0}", x.rs_wall),
            format!("{:.0}", x.down),
            format!("{:.1}", x.image_bytes / MIB),
            pct(x.ck_wall),
            pct(x.rs_wall),
            pct(x.ck_wall + x.rs_wall),
        ]);
    }
    s.push_str(&markdown(&lines));
    let _ = writeln!(
        s,
        "\nwhere the time goes (ms; checkpoint and restore as measured inside ferry; \
         'other' = ferry's own total minus the parts, 'start' = wall time minus ferry's total)\n"
    );
    let head = [
        "size MiB",
        "ck: start",
        "freeze",
        "state",
        "memory",
        "other (flush, fsync, kill)",
        "rs: start",
        "read image",
        "build",
        "memory",
        "finish",
        "other",
        "ck memory GiB/s",
        "rs memory GiB/s",
    ];
    let mut lines = vec![head.iter().map(|h| h.to_string()).collect::<Vec<_>>()];
    for (mib, x) in rows {
        let rate = |ms: f64| {
            if ms > 0.0 {
                format!("{:.2}", x.memory_bytes / GIB / (ms / 1e3))
            } else {
                "-".into()
            }
        };
        lines.push(vec![
            mib.to_string(),
            format!("{:.0}", x.ck_wall - x.ck_total),
            format!("{:.0}", x.freeze),
            format!("{:.0}", x.state),
            format!("{:.0}", x.ck_memory),
            format!("{:.0}", x.ck_total - x.freeze - x.state - x.ck_memory),
            format!("{:.0}", x.rs_wall - x.rs_total),
            format!("{:.0}", x.read),
            format!("{:.0}", x.build),
            format!("{:.0}", x.rs_memory),
            format!("{:.0}", x.finish),
            format!(
                "{:.0}",
                x.rs_total - x.read - x.build - x.rs_memory - x.finish
            ),
            rate(x.ck_memory),
            rate(x.rs_memory),
        ]);
    }
    s.push_str(&markdown(&lines));
    let _ = writeln!(
        s,
        "\nthe floor: the kernel's data movement alone (ms, measured in this process; no \
         checksums): process_vm_readv out of a process, write and fsync the image, read it \
         back{}, UFFDIO_COPY into fresh pages. 'least' = write + fill, which any engine keeping \
         an image in a file pays; 'steps' = all four, Ferry's design. %copy on 2 cores: if both \
         cores split every step perfectly\n",
        if cold { " from disk" } else { "" }
    );
    let head = [
        "size MiB",
        "memcpy",
        "read out",
        "write+fsync",
        "read back",
        "fill",
        "least",
        "least %copy, 2 cores",
        "steps",
        "steps %copy, 2 cores",
        "ferry ck+rs",
        "ferry %copy",
    ];
    let mut lines = vec![head.iter().map(|h| h.to_string()).collect::<Vec<_>>()];
    for (mib, x) in rows {
        let b = &x.base;
        let pct = |t: f64| format!("{:.1}%", 100.0 * b.copy / t);
        lines.push(vec![
            mib.to_string(),
            format!("{:.0}", b.copy),
            format!("{:.0}", b.read_out),
            format!("{:.0}", b.disk),
            format!("{:.0}", b.read_back),
            format!("{:.0}", b.fill),
            format!("{:.0}", b.least()),
            pct(b.least() / 2.0),
            format!("{:.0}", b.ferry_steps()),
            pct(b.ferry_steps() / 2.0),
            format!("{:.0}", x.ck_wall + x.rs_wall),
            pct(x.ck_wall + x.rs_wall),
        ]);
    }
    s.push_str(&markdown(&lines));
    s
}
