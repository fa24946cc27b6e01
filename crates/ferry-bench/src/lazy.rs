//! `ferry-bench lazy`: Accent's copy-on-reference on one machine (`ferry restore --lazy`)
//! against an ordinary restore, for processes that reserve much and touch little (Accent's
//! tables 4-3 to 4-5) and for ones that touch all they reserve.
//!
//! For each (reserved, touched) pair, in one run:
//!
//! 1. `memcpy` of the touched size between two pre-faulted buffers (the physical limit);
//! 2. a child (`ferry-bench hold --reserve-mib R --mib T`) reserves R MiB and fills the first
//!    T with non-zero data; `ferry checkpoint` (which kills it);
//! 3. `ferry restore --json`: the time until the tree runs (its memory all in), then `go`:
//!    the child checksums its memory (go -> result: a resident read of T);
//! 4. from the same image, `ferry restore --lazy --json`: the time until the tree runs, then
//!    `go` at once (the child reads its memory while it is still arriving), and the time from
//!    the tree running until the image was let go (ferry's second report); the child's
//!    checksum must match;
//! 5. for the first pair only, a lazy restore with the push held back and no prefetch: every
//!    page the child reads is one fault, so go -> result over the pages read is the cost of a
//!    local userfaultfd fault as the process sees it (the server's own time per fault too).

use crate::common::{ferry_binary, markdown, memcpy_ms, random_bytes, wait_gone, Holder};
use crate::common::{FERRY_TIMEOUT, HOLD_TIMEOUT};
use anyhow::{anyhow, bail, Context, Result};
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct Args {
    /// Reserved sizes, in MiB, comma-separated (each touching `--touch` MiB, or all of it
    /// when smaller).
    #[arg(long, value_delimiter = ',', default_value = "1,64,512,2048,8192")]
    reserve: Vec<usize>,
    /// MiB touched by the processes that reserve more.
    #[arg(long, default_value_t = 64)]
    touch: usize,
    /// Sizes (MiB) of processes that touch all they reserve, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "64,512,2048")]
    all: Vec<usize>,
    /// Pages prefetched after a faulting one.
    #[arg(long, default_value_t = 1)]
    prefetch: usize,
    /// The ferry binary (default: the workspace's release build, brought up to date).
    #[arg(long)]
    ferry: Option<PathBuf>,
    /// Where images go (a fresh directory inside, removed afterwards).
    #[arg(long, default_value = "/tmp")]
    dir: PathBuf,
}

struct Row {
    reserved: usize,
    touched: usize,
    memcpy: f64,
    eager_run: f64,
    eager_read: f64,
    lazy_run: f64,
    lazy_read: f64,
    released: f64,
    faults: f64,
    fault_pages: f64,
    pushed: f64,
}

pub fn run(a: Args) -> Result<()> {
    let ferry = ferry_binary(a.ferry.as_deref())?;
    let work = a
        .dir
        .join(format!("ferry-bench-lazy-{}", std::process::id()));
    fs::create_dir_all(&work)?;
    let r = measure_all(&a, &ferry, &work);
    let _ = fs::remove_dir_all(&work);
    let (rows, fault) = r?;
    let mut lines = vec![[
        "reserved MiB",
        "touched MiB",
        "memcpy (touched) ms",
        "restore: runs after ms",
        "then reads all ms",
        "lazy: runs after ms",
        "then reads all ms",
        "image let go after run ms",
        "aim ms",
        "faults",
        "pages by faults",
        "pages pushed",
    ]
    .map(String::from)
    .to_vec()];
    for r in &rows {
        lines.push(vec![
            r.reserved.to_string(),
            r.touched.to_string(),
            format!("{:.1}", r.memcpy),
            format!("{:.1}", r.eager_run),
            format!("{:.1}", r.eager_read),
            format!("{:.1}", r.lazy_run),
            format!("{:.1}", r.lazy_read),
            format!("{:.1}", r.released),
            // The aim: touched bytes at 2 GiB/s, plus 100 ms.
            format!("{:.0}", r.touched as f64 / 2048.0 * 1e3 + 100.0),
            format!("{:.0}", r.faults),
            format!("{:.0}", r.fault_pages),
            format!("{:.0}", r.pushed),
        ]);
    }
    println!("{}", markdown(&lines));
    if let Some((pages, read_ms, resident_ms, server_us)) = fault {
        println!(
            "fault cost ({pages} pages read one fault each, push held back, no prefetch): \
             {:.1} us per page as the process sees it ({read_ms:.1} ms, against {resident_ms:.1} \
             ms resident), {server_us:.1} us of it in the page server",
            (read_ms - resident_ms) * 1e3 / pages
        );
    }
    Ok(())
}

type FaultCost = Option<(f64, f64, f64, f64)>;

fn measure_all(a: &Args, ferry: &Path, work: &Path) -> Result<(Vec<Row>, FaultCost)> {
    let mut pairs: Vec<(usize, usize)> = a.reserve.iter().map(|&r| (r, r.min(a.touch))).collect();
    pairs.extend(a.all.iter().map(|&s| (s, s)));
    let mut rows = Vec::new();
    let mut fault = None;
    for (i, &(reserved, touched)) in pairs.iter().enumerate() {
        eprintln!("ferry-bench lazy: reserving {reserved} MiB, touching {touched} MiB");
        let dir = work.join(format!("{reserved}-{touched}"));
        fs::create_dir_all(&dir)?;
        let (row, f) = measure(a, ferry, &dir, reserved, touched, i == 0 && touched >= 16)?;
        if f.is_some() {
            fault = f;
        }
        rows.push(row);
        let _ = fs::remove_dir_all(&dir);
    }
    if fault.is_none() {
        let dir = work.join("fault");
        fs::create_dir_all(&dir)?;
        fault = measure(a, ferry, &dir, a.touch, a.touch, true)?.1;
    }
    Ok((rows, fault))
}

fn measure(
    a: &Args,
    ferry: &Path,
    dir: &Path,
    reserved: usize,
    touched: usize,
    fault_run: bool,
) -> Result<(Row, FaultCost)> {
    let memcpy = memcpy_ms(&random_bytes(touched << 20, 7))?;
    let (mut holder, sum) = Holder::start_shaped(
        dir,
        touched,
        crate::hold::Shape {
            reserve_mib: reserved,
            ..Default::default()
        },
        Duration::from_millis(5),
    )?;
    let pid = holder.pid;
    let img = dir.join("img");
    let img_s = img.to_string_lossy().into_owned();
    let ck = Command::new(ferry)
        .args(["checkpoint", &pid.to_string(), "--dir", &img_s])
        .stdout(Stdio::null())
        .status()?;
    if !ck.success() {
        bail!("ferry checkpoint of PID {pid} failed ({ck})");
    }
    if let Some(mut c) = holder.child.take() {
        c.wait().context("reap the checkpointed child")?;
    }
    std::mem::forget(holder);
    let (eager_run, eager_read, _) = restore(ferry, dir, &img_s, pid, &sum, &[])?;
    let prefetch = a.prefetch.to_string();
    let (lazy_run, lazy_read, lazy) = restore(
        ferry,
        dir,
        &img_s,
        pid,
        &sum,
        &["--lazy", "--prefetch", &prefetch],
    )?;
    let lazy = lazy.ok_or_else(|| anyhow!("ferry restore --lazy gave no second report"))?;
    let stat = |k: &str| lazy["lazy"][k].as_f64().unwrap_or(f64::NAN);
    let row = Row {
        reserved,
        touched,
        memcpy,
        eager_run,
        eager_read,
        lazy_run,
        lazy_read,
        released: lazy["image_released_after_run_ms"]
            .as_f64()
            .unwrap_or(f64::NAN),
        faults: stat("faults"),
        fault_pages: stat("fault_pages"),
        pushed: stat("pushed_pages"),
    };
    let fault = if fault_run {
        let args = ["--lazy", "--prefetch", "0", "--push-after-ms", "600000"];
        let (_, read, r) = restore(ferry, dir, &img_s, pid, &sum, &args)?;
        let r = r.ok_or_else(|| anyhow!("no second report"))?;
        let faults = r["lazy"]["faults"].as_f64().unwrap_or(f64::NAN);
        let service = r["lazy"]["fault_service_us"].as_f64().unwrap_or(f64::NAN);
        Some((
            (touched << 8) as f64,
            read,
            eager_read,
            service / faults.max(1.0),
        ))
    } else {
        None
    };
    Ok((row, fault))
}

/// Restores the image at `img` with `extra` arguments, says go as soon as the tree runs, and
/// checks the child's checksum. Returns (restore until the tree runs, go until the child's
/// result, ms; the lazy server's report when there is one).
fn restore(
    ferry: &Path,
    dir: &Path,
    img: &str,
    pid: i32,
    sum: &str,
    extra: &[&str],
) -> Result<(f64, f64, Option<serde_json::Value>)> {
    let _ = fs::remove_file(dir.join("go"));
    let _ = fs::remove_file(dir.join("result"));
    let out = dir.join("restore.stdout");
    let err = dir.join("restore.stderr");
    let t0 = Instant::now();
    let mut child = Command::new(ferry)
        .args(["restore", "--dir", img, "--json"])
        .args(extra)
        .stdin(Stdio::null())
        .stdout(File::create(&out)?)
        .stderr(File::create(&err)?)
        .spawn()
        .context("run ferry restore")?;
    let docs = |text: &str| -> Vec<serde_json::Value> {
        serde_json::Deserializer::from_str(text)
            .into_iter::<serde_json::Value>()
            .map_while(|v| v.ok())
            .collect()
    };
    let failed = |st: std::process::ExitStatus| {
        anyhow!(
            "ferry restore {} failed ({st}): {}",
            extra.join(" "),
            fs::read_to_string(&err).unwrap_or_default().trim()
        )
    };
    // The first report is printed once the tree runs.
    let first = loop {
        let d = docs(&fs::read_to_string(&out).unwrap_or_default());
        if let Some(first) = d.into_iter().next() {
            break first;
        }
        if let Some(st) = child.try_wait()? {
            if !st.success() {
                return Err(failed(st));
            }
        }
        if t0.elapsed() > FERRY_TIMEOUT {
            let _ = child.kill();
            bail!("ferry restore printed nothing within {FERRY_TIMEOUT:?}");
        }
        sleep(Duration::from_micros(200));
    };
    let runs = first["total_ms"].as_f64().unwrap_or(f64::NAN);
    if first["root_pid"].as_i64() != Some(pid as i64) {
        bail!("ferry restore gave {first}, not PID {pid}");
    }
    let go = Instant::now();
    File::create(dir.join("go"))?;
    let mut holder = Holder { pid, child: None };
    let result = holder.wait_file(
        &dir.join("result"),
        HOLD_TIMEOUT,
        Duration::from_micros(200),
    );
    let read = go.elapsed().as_secs_f64() * 1e3;
    let result = result?;
    if result.trim() != sum {
        bail!(
            "the restored child's memory differs: checksum {} now, {sum} before",
            result.trim()
        );
    }
    if !wait_gone(pid, Duration::from_secs(30)) {
        bail!("the restored child did not exit after its result");
    }
    std::mem::forget(holder);
    let st = child.wait()?;
    if !st.success() {
        return Err(failed(st));
    }
    let second = docs(&fs::read_to_string(&out).unwrap_or_default())
        .into_iter()
        .nth(1);
    Ok((runs, read, second))
}
