//! `ferry migrate --memory lazy` (copy-on-reference) between the daemons of real local
//! clusters: a process whose memory is checked page by page every second (tests/victims/
//! dirtier.c: it rewrites pages and drops some with madvise(DONTNEED) as it goes, during the
//! lazy phase too) runs on the destination before its memory is there and finds every page
//! right, there and back; the source's capture worker killed during the lazy phase kills the
//! copy (never left running with pages missing) and the migration reports it; shared memory
//! is refused before anything is frozen, the process left running at home. The same for
//! `--memory hybrid` (pre-copy rounds, then what was written since the last one lazily).

mod common;

use common::cluster::Cluster;
use common::scratch;
use libtest_mimic::{Arguments, Failed, Trial};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn main() {
    common::seal_inherited_fds();
    let args = Arguments::from_args();
    let tests = vec![
        Trial::test(
            "a_lazily_moved_process_finds_all_its_memory",
            moves_there_and_back,
        ),
        Trial::test(
            "forks_mremaps_munmaps_madvises_and_threads_during_the_lazy_phase",
            || mapping_changes_in("lazy"),
        ),
        Trial::test("the_source_lost_in_the_lazy_phase_kills_the_copy", || {
            source_lost_in("lazy")
        }),
        Trial::test(
            "sparse_memory_moved_lazily_reads_right_through_the_sources_holes",
            sparse_memory_holes,
        ),
        Trial::test(
            "shared_memory_is_refused_and_left_running",
            shared_memory_refused,
        ),
        Trial::test(
            "sequential_faults_grow_their_window",
            sequential_faults_grow_their_window,
        ),
        Trial::test(
            "a_lazy_restore_counts_each_page_once",
            lazy_restore_counts_each_page_once,
        ),
        Trial::test(
            "auto_moves_a_large_tree_lazily_once_the_link_is_known",
            auto_chooses_lazy,
        ),
        Trial::test(
            "a_process_moved_hybrid_finds_every_page",
            hybrid_there_and_back,
        ),
        Trial::test(
            "a_hybrid_copy_runs_before_its_precopied_pages_are_written",
            hybrid_runs_before_precopied_pages_are_in,
        ),
        Trial::test(
            "forks_mremaps_munmaps_madvises_and_threads_during_a_hybrid_lazy_phase",
            || mapping_changes_in("hybrid"),
        ),
        Trial::test(
            "the_source_lost_in_a_hybrid_lazy_phase_kills_the_copy",
            || source_lost_in("hybrid"),
        ),
        Trial::test(
            "auto_moves_a_mid_sized_tree_hybrid_once_the_link_is_known",
            auto_chooses_hybrid,
        ),
    ];
    libtest_mimic::run(&args, tests).exit();
}

/// `tests/victims/NAME.c`, built once per test process.
fn victim_binary(name: &str) -> PathBuf {
    common::victim(name, &["-O2"])
}

fn text(o: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn ps(c: &Cluster, on: &str) -> Vec<serde_json::Value> {
    let o = c.run(on, &["ps", "--json"]);
    assert!(o.status.success(), "ps: {}", text(&o));
    serde_json::from_slice::<Vec<serde_json::Value>>(&o.stdout).unwrap()
}

fn guest(c: &Cluster, on: &str, home_pid: i32) -> Option<serde_json::Value> {
    ps(c, on)
        .into_iter()
        .find(|p| p["home_pid"].as_i64() == Some(home_pid as i64))
}

/// The dirtier: `mib` of memory, `rate` pages rewritten per second, all checked each second;
/// its status line says `ok=0` once a page is wrong.
struct Dirtier {
    child: Child,
    status: PathBuf,
}

impl Dirtier {
    fn start(dir: &Path, mib: u32, rate: u32) -> Dirtier {
        Dirtier::sweeping(dir, mib, rate, 0)
    }

    /// [`Dirtier::start`], and one word of each of the first `sweep` % of its pages rewritten
    /// every 20 ms (same bytes): pre-copy rounds find them all written every time.
    fn sweeping(dir: &Path, mib: u32, rate: u32, sweep: u32) -> Dirtier {
        let status = dir.join("dirtier.status");
        let file = |ext: &str| {
            Stdio::from(std::fs::File::create(dir.join(format!("dirtier.{ext}"))).unwrap())
        };
        let child = Command::new(victim_binary("dirtier"))
            .args([&mib.to_string(), &rate.to_string()])
            .arg(&status)
            .args((sweep > 0).then(|| sweep.to_string()))
            .stdin(Stdio::null())
            .stdout(file("out"))
            .stderr(file("err"))
            .spawn()
            .unwrap();
        let d = Dirtier { child, status };
        let deadline = Instant::now() + Duration::from_secs(20);
        while d
            .field("count=")
            .is_none_or(|c| c.parse::<u64>().unwrap_or(0) < 2)
        {
            assert!(Instant::now() < deadline, "dirtier did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        d
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    fn field(&self, k: &str) -> Option<String> {
        let text = std::fs::read_to_string(&self.status).ok()?;
        text.split_whitespace()
            .find_map(|w| w.strip_prefix(k))
            .map(str::to_string)
    }

    fn count(&self) -> u64 {
        self.field("count=")
            .and_then(|c| c.parse().ok())
            .unwrap_or(0)
    }

    /// Fails unless it counts on for `secs` seconds (each second checks every page), intact.
    fn assert_intact_for(&self, secs: u64, what: &str) {
        let before = self.count();
        let deadline = Instant::now() + Duration::from_secs(secs + 10);
        loop {
            assert_eq!(
                self.field("ok=").as_deref(),
                Some("1"),
                "{what}: a page came back wrong"
            );
            if self.count() >= before + secs * 50 {
                return;
            }
            assert!(Instant::now() < deadline, "{what}: the dirtier stopped");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn wait_end(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return Some(st);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Dirtier {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn migrate_lazy(c: &Cluster, on: &str, pid: i32, to: &str) -> Result<serde_json::Value, String> {
    migrate_with(c, on, pid, to, "lazy")
}

fn migrate_with(
    c: &Cluster,
    on: &str,
    pid: i32,
    to: &str,
    memory: &str,
) -> Result<serde_json::Value, String> {
    let o = c.run(
        on,
        &[
            "migrate",
            &pid.to_string(),
            "--to",
            to,
            "--memory",
            memory,
            "--json",
        ],
    );
    if o.status.success() {
        serde_json::from_slice(&o.stdout).map_err(|e| format!("bad json: {e}: {}", text(&o)))
    } else {
        Err(text(&o))
    }
}

/// 48 MiB moved lazily a -> b -> a while it rewrites and drops pages: the copy runs before
/// its memory is there, faults bring pages, the push the rest, and every page checks out.
fn moves_there_and_back() -> Result<(), Failed> {
    let c = Cluster::up("lazy", 2);
    let dir = scratch("lazy_migration", "there_and_back");
    let d = Dirtier::start(&dir, 48, 2000);
    let pid = d.pid();
    for (from, to) in [("a", "b"), ("b", "a")] {
        let r = migrate_lazy(&c, from, pid, to).map_err(|e| format!("{from} -> {to}: {e}"))?;
        assert_eq!(r["memory"]["mode"], "lazy", "{r}");
        let l = &r["lazy"];
        assert!(
            l["owed_bytes"].as_u64().unwrap() > 40 << 20,
            "the memory did not stay at the source: {r}"
        );
        let pages = l["fault_pages"].as_u64().unwrap() + l["pushed_pages"].as_u64().unwrap();
        assert!(
            pages * 4096 > 40 << 20,
            "the pages did not come by fault and push: {r}"
        );
        assert!(
            l["faults"].as_u64().unwrap() > 0,
            "the copy ran before its memory was there, so it faulted: {r}"
        );
        assert!(r["resumed_ms"].as_f64().unwrap() > 0.0, "{r}");
        assert!(
            l["max_asks_in_flight"].as_u64().unwrap_or(0) > 1,
            "page requests went one at a time: {r}"
        );
        assert!(
            l["source_bytes"].as_u64().unwrap() <= l["owed_bytes"].as_u64().unwrap(),
            "a page came over the link twice: {r}"
        );
        d.assert_intact_for(2, &format!("after a lazy move {from} -> {to}"));
    }
    Ok(())
}

/// tests/victims/lazychanger.c, 96 MiB: as soon as it runs on the destination, while most of
/// its pages are still owed, eight threads read the same pages at once, it moves a piece with
/// mremap, unmaps, drops (madvise) and write-protects others, checks every page it still has,
/// and forks a child that checks them again: all must be right (the dropped ones zero).
/// Moved `hybrid`, it rewrites three quarters of its pages until it moves: those are owed
/// after the freeze, the last quarter came in the pre-copy rounds.
fn mapping_changes_in(mode: &str) -> Result<(), Failed> {
    let hybrid = mode == "hybrid";
    // b's push starts 2 s late: on a loaded machine it once brought every page in before the
    // victim, waiting for a core, made a single change (remaps 0).
    let c = Cluster::up_with(
        if hybrid { "hychg" } else { "lazychg" },
        2,
        &[("FAILPOINTS", "b:lazy-push-late=return")],
    );
    let dir = scratch("lazy_migration", &format!("changes-{mode}"));
    let status = dir.join("changer.status");
    let _ = std::fs::remove_file(&status);
    let mut child = Command::new(victim_binary("lazychanger"))
        .arg("96")
        .arg(&status)
        .args(hybrid.then_some("dirty"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id() as i32;
    let read = || std::fs::read_to_string(&status).unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !read().starts_with("ready") {
        assert!(Instant::now() < deadline, "the victim did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let r = migrate_with(&c, "a", pid, "b", mode);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !read().starts_with("result=") && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let result = read();
    let _ = child.kill();
    let _ = child.wait();
    let r = r?;
    assert_eq!(result.trim(), "result=ok", "{r}");
    assert_eq!(r["memory"]["mode"], mode, "{r}");
    let l = &r["lazy"];
    if hybrid {
        let owed = l["owed_bytes"].as_u64().unwrap_or(0);
        assert!(
            (48 << 20..90 << 20).contains(&owed),
            "the rewritten pages (72 MiB) were not left to the lazy phase, or the rest was: {r}"
        );
    }
    // (Not "forked": a fork in the body waits for its home to make the child's deputy, which
    // it can once the original is one, after the lazy phase. The page server's forks are
    // the engine suite's lazy:: mem_lazy_mapping_changes; the child here checks its memory
    // after the phase, and "result=ok" says it found it whole.)
    for k in ["remaps", "unmaps", "removes"] {
        assert!(
            l[k].as_u64().unwrap() >= 1,
            "the lazy phase did not see the {k}: {r}"
        );
    }
    Ok(())
}

/// The source's capture worker (which holds the frozen original's memory) is killed while
/// the copy still lacks pages: the copy is killed at once rather than left running with
/// memory missing, the destination logs why, the migration fails saying so, and the original
/// (which died with its tracer: the commit had passed) is seen dead by its parent.
/// Moved `hybrid`, it rewrites nine tenths of its pages until it moves (so that they are owed
/// after the freeze, and the lazy phase lasts).
fn source_lost_in(mode: &str) -> Result<(), Failed> {
    let hybrid = mode == "hybrid";
    let c = Cluster::up(if hybrid { "hylost" } else { "lazylost" }, 2);
    let dir = scratch("lazy_migration", &format!("source_lost-{mode}"));
    let mut d = Dirtier::sweeping(&dir, 160, 200, if hybrid { 90 } else { 0 });
    let pid = d.pid();
    let mut cmd = c.ferry("a");
    cmd.args(["migrate", &pid.to_string(), "--to", "b", "--memory", mode]);
    let mig = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait for the copy to run on b (its lazy phase under way), then kill the source's worker.
    let deadline = Instant::now() + Duration::from_secs(30);
    let copy = loop {
        if let Some(g) = guest(&c, "b", pid) {
            break g["pid"].as_i64().unwrap() as i32;
        }
        assert!(Instant::now() < deadline, "the copy never ran on b");
        std::thread::sleep(Duration::from_millis(20));
    };
    let workers = Command::new("pgrep")
        .args(["-f", &format!("__capture-worker {pid} ")])
        .output()
        .unwrap();
    let worker: Option<i32> = String::from_utf8_lossy(&workers.stdout)
        .split_whitespace()
        .next()
        .and_then(|w| w.parse().ok());
    if let Some(w) = worker {
        Command::new("kill")
            .args(["-9", &w.to_string()])
            .status()
            .unwrap();
    }
    let out = mig.wait_with_output().unwrap();
    worker.ok_or("no capture worker to kill")?;
    let said = text(&out);
    assert!(!out.status.success(), "the migration succeeded: {said}");
    assert!(
        said.contains("lazy phase failed")
            && said.contains("killed")
            && said.contains(&format!("--memory {mode}")),
        "the failure is not reported: {said}"
    );
    let host_copy = c.host_pid("b", copy);
    let deadline = Instant::now() + Duration::from_secs(5);
    while host_copy.is_some_and(|p| std::path::Path::new(&format!("/proc/{p}")).exists())
        && guest(&c, "b", pid).is_some()
    {
        assert!(
            Instant::now() < deadline,
            "the copy runs on with memory missing"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // (b's daemon logs it once the page server's last word is in, a moment after the copy's
    // death, or after 10 s without it.)
    let deadline = Instant::now() + Duration::from_secs(15);
    let log = loop {
        let log = c.log("b");
        if log.contains("lazy-copy-killed") || Instant::now() > deadline {
            break log;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        log.contains("lazy-copy-killed"),
        "b did not log the copy's death: {log}"
    );
    let st = d
        .wait_end(Duration::from_secs(10))
        .ok_or("the original lives on")?;
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(st.signal(), Some(libc::SIGKILL), "{st:?}");
    Ok(())
}

/// Shared memory (here a MAP_SHARED|MAP_ANONYMOUS mapping) cannot be served lazily: the
/// migration is refused before anything is frozen, naming the PID and the kind, and the
/// process runs on at home.
/// tests/victims/sparse.c moved lazily: 32 MiB of which a quarter is written, a quarter never
/// touched, a quarter written and dropped (MADV_DONTNEED), a quarter only read (the zero page),
/// a run of 4 MiB never touched, and beside it a reservation of 512 MiB with two pages
/// written. The image names its mappings whole (nothing walks them in the freeze) and the
/// source answers for the pages it holds none of with holes, never sent: the copy, checking
/// as soon as it runs (its pages still owed), finds every written page right and every
/// other page zero, and can write them all.
fn sparse_memory_holes() -> Result<(), Failed> {
    let c = Cluster::up("lzholes", 2);
    let dir = scratch("lazy_migration", "holes");
    let status = dir.join("sparse.status");
    let _ = std::fs::remove_file(&status);
    let mut child = Command::new(victim_binary("sparse"))
        .arg("32")
        .arg(&status)
        .arg("512")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id() as i32;
    let read = || std::fs::read_to_string(&status).unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !read().starts_with("ready") {
        assert!(Instant::now() < deadline, "the victim did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let r = migrate_lazy(&c, "a", pid, "b");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !read().starts_with("result=") && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let result = read();
    let _ = child.kill();
    let _ = child.wait();
    let r = r?;
    assert_eq!(result.trim(), "result=ok", "{r}");
    assert_eq!(r["memory"]["mode"], "lazy", "{r}");
    let l = &r["lazy"];
    let n = |k: &str| l[k].as_u64().unwrap_or(0);
    assert!(
        n("owed_bytes") >= 544 << 20,
        "the image did not name the mappings whole: {r}"
    );
    // Holes: the 512 MiB reservation but two pages, and in the 32 MiB the quarters never
    // touched and dropped (at least).
    assert!(
        n("hole_pages") >= (512 << 20) / 4096 - 2 + (12 << 20) / 4096,
        "the source did not answer for its holes: {r}"
    );
    assert!(
        n("source_bytes") < 24 << 20,
        "pages the source never had crossed the link: {r}"
    );
    Ok(())
}

fn shared_memory_refused() -> Result<(), Failed> {
    let c = Cluster::up("lazyshm", 2);
    let mut child = Command::new("python3")
        .args([
            "-c",
            "import mmap,sys,time\nm=mmap.mmap(-1,1<<20)\nm[0]=7\nprint('up',flush=True)\ntime.sleep(120)",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    let pid = child.id() as i32;
    let e = migrate_lazy(&c, "a", pid, "b").expect_err("shared memory moved lazily");
    assert!(
        e.contains("shared anonymous memory") && e.contains(&format!("PID {pid}")),
        "{e}"
    );
    assert!(child.try_wait().unwrap().is_none(), "the process died");
    let stat = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    assert!(stat.contains("TracerPid:\t0"), "left traced: {stat}");
    let _ = child.kill();
    let _ = child.wait();
    Ok(())
}

/// `ferry restore --lazy --prefetch 15` of the dirtier (16 MiB), the push held back for 1.5 s:
/// its checks read every page in order each second, so its faults come in sequence and each
/// asks for a window twice the one before (more pages per fault than the fixed 1 + 15 of the
/// prefetch), and every page still checks out.
fn sequential_faults_grow_their_window() -> Result<(), Failed> {
    let dir = scratch("lazy_migration", "window");
    let mut d = Dirtier::start(&dir, 16, 10);
    let pid = d.pid().to_string();
    let img = dir.join("img");
    let img = img.to_str().unwrap();
    let (ok, out, err) = common::ferry(&["checkpoint", &pid, "--dir", img]);
    assert!(ok, "checkpoint: {out}{err}");
    // (Killed by the checkpoint: its PID is free once collected.)
    let _ = d.child.wait();
    let (ok, out, err) = common::ferry(&[
        "restore",
        "--dir",
        img,
        "--lazy",
        "--prefetch",
        "15",
        "--push-after-ms",
        "1500",
        "--json",
    ]);
    let kill = || {
        let _ = Command::new("kill").args(["-9", &pid]).status();
    };
    if !ok {
        kill();
        return Err(format!("restore --lazy: {out}{err}").into());
    }
    let docs: Vec<serde_json::Value> = serde_json::Deserializer::from_str(&out)
        .into_iter()
        .collect::<Result<_, _>>()
        .map_err(|e| format!("bad json: {e}: {out}"))?;
    let l = &docs.last().ok_or("no report")?["lazy"];
    let intact = std::panic::catch_unwind(|| d.assert_intact_for(1, "after a lazy restore"));
    kill();
    intact.map_err(|_| "a page came back wrong after the lazy restore")?;
    let n = |k: &str| l[k].as_u64().unwrap_or(0);
    // Faults that asked for pages (not those on a dropped page, or on one already coming).
    let faults =
        n("faults") - n("zero_pages") - n("faults_already_served") - n("faults_on_the_way");
    let pages = n("fault_pages");
    assert!(pages > 3000, "the pages did not come by fault: {l}");
    assert!(
        pages > 16 * faults && n("max_fault_window_pages") >= 64,
        "the faults' window did not grow ({faults} faults brought {pages} pages): {l}"
    );
    Ok(())
}

/// `ferry restore --lazy` of the dirtier (16 MiB, nothing rewritten or dropped): the report's
/// `source_bytes` is exactly the memory the checkpoint stored, each page counted once (not the
/// image's records, read whole for a piece and again once out of the page server's cache).
fn lazy_restore_counts_each_page_once() -> Result<(), Failed> {
    let dir = scratch("lazy_migration", "count");
    let mut d = Dirtier::start(&dir, 16, 0);
    let pid = d.pid().to_string();
    let img = dir.join("img");
    let img = img.to_str().unwrap();
    let (ok, out, err) = common::ferry(&["checkpoint", &pid, "--dir", img, "--json"]);
    assert!(ok, "checkpoint: {out}{err}");
    let _ = d.child.wait();
    let stored = serde_json::from_str::<serde_json::Value>(&out)
        .map_err(|e| format!("bad json: {e}: {out}"))?["memory_bytes"]
        .as_u64()
        .ok_or("no memory_bytes")?;
    let (ok, out, err) = common::ferry(&["restore", "--dir", img, "--lazy", "--json"]);
    let kill = || {
        let _ = Command::new("kill").args(["-9", &pid]).status();
    };
    if !ok {
        kill();
        return Err(format!("restore --lazy: {out}{err}").into());
    }
    let intact = std::panic::catch_unwind(|| d.assert_intact_for(1, "after a lazy restore"));
    kill();
    intact.map_err(|_| "a page came back wrong after the lazy restore")?;
    let docs: Vec<serde_json::Value> = serde_json::Deserializer::from_str(&out)
        .into_iter()
        .collect::<Result<_, _>>()
        .map_err(|e| format!("bad json: {e}: {out}"))?;
    let l = &docs.last().ok_or("no report")?["lazy"];
    assert!(l["owed_bytes"].as_u64().unwrap_or(0) >= 16 << 20, "{l}");
    assert_eq!(
        l["source_bytes"].as_u64(),
        Some(stored),
        "the image holds {stored} bytes of memory: {l}"
    );
    Ok(())
}

/// `--memory auto` with `lazy_above_ms` 1: a tree of 80 MiB goes a -> b, b -> a without a
/// known link (not lazily: neither node has moved memory to the other yet), then a -> b again,
/// now lazily, the report saying why (the speed measured by the first move), and every page
/// checks out.
fn auto_chooses_lazy() -> Result<(), Failed> {
    let c = Cluster::up_full(
        "lazyauto",
        2,
        &[],
        common::cluster::Isolation::default_for_tests(),
        &["--lazy-above-ms", "1"],
    );
    let dir = scratch("lazy_migration", "auto");
    let d = Dirtier::start(&dir, 80, 200);
    let pid = d.pid();
    for (from, to, lazy) in [("a", "b", false), ("b", "a", false), ("a", "b", true)] {
        let r =
            migrate_with(&c, from, pid, to, "auto").map_err(|e| format!("{from} -> {to}: {e}"))?;
        let plan = &r["memory"];
        if lazy {
            assert_eq!(plan["mode"], "lazy", "{from} -> {to}, the link known: {r}");
            let why = plan["reason"].as_str().unwrap_or("");
            assert!(why.starts_with("auto:") && why.contains("measured"), "{r}");
            assert!(
                r["lazy"]["owed_bytes"].as_u64().unwrap_or(0) > 64 << 20,
                "{r}"
            );
        } else {
            assert_ne!(plan["mode"], "lazy", "{from} -> {to}, no link known: {r}");
        }
        d.assert_intact_for(1, &format!("after an auto move {from} -> {to}"));
    }
    Ok(())
}

/// `--memory hybrid`: a process of 96 MiB that rewrites random pages all the time (8 MiB/s,
/// some dropped) and a quarter of its pages every 20 ms moves a -> b -> a. Each time, the
/// pre-copy rounds send its memory while it runs, the pages it wrote after the last round
/// (a quarter when it gets a core to itself) are owed after the freeze and come by fault and push, the pages the
/// rounds sent are in before it runs (never asked of the source again), the report says when
/// the source was released, and every page checks out.
fn hybrid_there_and_back() -> Result<(), Failed> {
    let c = Cluster::up("hybrid", 2);
    let dir = scratch("lazy_migration", "hybrid");
    let d = Dirtier::sweeping(&dir, 96, 2000, 25);
    let pid = d.pid();
    for (from, to) in [("a", "b"), ("b", "a")] {
        let r = migrate_with(&c, from, pid, to, "hybrid")
            .map_err(|e| format!("{from} -> {to}: {e}"))?;
        let m = &r["memory"];
        assert_eq!(m["mode"], "hybrid", "{r}");
        assert_eq!(m["reason"], "asked (--memory hybrid)", "{r}");
        let rounds = m["rounds"].as_array().map_or(0, Vec::len);
        assert!(rounds >= 2, "no pre-copy rounds: {r}");
        let sent: u64 = m["rounds"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x["sent_bytes"].as_u64().unwrap_or(0))
            .sum();
        assert!(sent > 90 << 20, "the rounds did not send the memory: {r}");
        let l = &r["lazy"];
        let owed = l["owed_bytes"].as_u64().unwrap_or(0);
        // What it wrote after the last round's scan, and far less than all of it. (Not "the
        // swept quarter at least": on a loaded machine the writer, waiting for a core, once
        // wrote only 320 KiB between the last round and the freeze.)
        assert!(
            (4096..64 << 20).contains(&owed),
            "the pages written since the last round were not (alone) left to the lazy phase: {r}"
        );
        assert!(
            m["inherited_bytes"].as_u64().unwrap_or(0) > owed + (24 << 20),
            "the rounds' pages were not taken from them: {r}"
        );
        assert!(
            l["source_bytes"].as_u64().unwrap_or(u64::MAX) <= owed,
            "pages the rounds had sent were asked of the source again: {r}"
        );
        let pages = l["fault_pages"].as_u64().unwrap() + l["pushed_pages"].as_u64().unwrap();
        assert!(
            pages * 4096 >= owed - (1 << 20),
            "the owed pages did not come by fault and push: {r}"
        );
        assert!(r["resumed_ms"].as_f64().unwrap() > 0.0, "{r}");
        assert!(
            l["source_released_after_resume_ms"].as_f64().unwrap_or(0.0) > 0.0,
            "the report does not say when the source was released: {r}"
        );
        d.assert_intact_for(2, &format!("after a hybrid move {from} -> {to}"));
    }
    Ok(())
}

/// `--memory hybrid`: a process of 128 MiB that rewrites few pages (so the rounds send
/// nearly all of it) moves a -> b. The copy is handed to the destination's page server with
/// the pre-copied pages still to write (the report's `local_owed_bytes`: not written during
/// the freeze, as they were until 2026-11-28), runs, and gets them by fault and by the
/// push from the pages the destination holds, never from the source (which only sends what
/// was written after the last round); every page checks out, before and after the source is
/// released.
fn hybrid_runs_before_precopied_pages_are_in() -> Result<(), Failed> {
    let c = Cluster::up("hyrun", 2);
    let dir = scratch("lazy_migration", "hybrid-runs");
    let d = Dirtier::start(&dir, 128, 200);
    let pid = d.pid();
    let r = migrate_with(&c, "a", pid, "b", "hybrid").map_err(|e| format!("a -> b: {e}"))?;
    let m = &r["memory"];
    assert_eq!(m["mode"], "hybrid", "{r}");
    let sent: u64 = m["rounds"]
        .as_array()
        .ok_or_else(|| format!("no rounds: {r}"))?
        .iter()
        .map(|x| x["sent_bytes"].as_u64().unwrap_or(0))
        .sum();
    assert!(sent > 120 << 20, "the rounds did not send the memory: {r}");
    let l = &r["lazy"];
    let local = l["local_owed_bytes"].as_u64().unwrap_or(0);
    assert!(
        local > 100 << 20,
        "the pre-copied pages were written before the copy ran (not left to its page server): {r}"
    );
    let page = |k: &str| l[k].as_u64().unwrap_or(0) * 4096;
    let came = page("local_fault_pages")
        + page("local_pushed_pages")
        + l["local_pending_bytes"].as_u64().unwrap_or(0);
    // (A few pages it dropped with madvise(DONTNEED) after it ran are never copied.)
    assert!(
        came <= local && came >= local - local / 10,
        "the pre-copied pages did not come by fault and push: {r}"
    );
    let owed = l["owed_bytes"].as_u64().unwrap_or(0);
    assert!(
        l["source_bytes"].as_u64().unwrap_or(u64::MAX) <= owed && owed < 32 << 20,
        "pages the rounds had sent were asked of the source: {r}"
    );
    d.assert_intact_for(3, "after a hybrid move a -> b");
    Ok(())
}

/// `--memory auto` (each node's `lazy_above_ms` 100 s, so that no speed of a loaded machine
/// makes it lazy): 96 MiB go a -> b, b -> a by pre-copy (neither node has moved memory to the
/// other yet), then a -> b again, now hybrid (the link is known, and an eager move would stand
/// still less than `lazy_above_ms`), the report saying why, then home again by pre-copy (a
/// tree going home is rebuilt in place of its deputies only by a move that is not lazy), and
/// every page checks out.
fn auto_chooses_hybrid() -> Result<(), Failed> {
    let c = Cluster::up_full(
        "hyauto",
        2,
        &[],
        common::cluster::Isolation::default_for_tests(),
        &["--lazy-above-ms", "100000"],
    );
    let dir = scratch("lazy_migration", "hybrid-auto");
    let d = Dirtier::sweeping(&dir, 96, 2000, 25);
    let pid = d.pid();
    for (from, to, hybrid) in [
        ("a", "b", false),
        ("b", "a", false),
        ("a", "b", true),
        ("b", "a", false),
    ] {
        let r =
            migrate_with(&c, from, pid, to, "auto").map_err(|e| format!("{from} -> {to}: {e}"))?;
        let plan = &r["memory"];
        if hybrid {
            assert_eq!(
                plan["mode"], "hybrid",
                "{from} -> {to}, the link known: {r}"
            );
            let why = plan["reason"].as_str().unwrap_or("");
            assert!(
                why.starts_with("auto:") && why.contains("measured") && why.contains("lazily"),
                "{r}"
            );
            assert!(r["lazy"]["owed_bytes"].as_u64().unwrap_or(0) > 0, "{r}");
        } else {
            assert_eq!(
                plan["mode"], "precopy",
                "{from} -> {to}, no link known, or going home: {r}"
            );
        }
        d.assert_intact_for(1, &format!("after an auto move {from} -> {to}"));
    }
    Ok(())
}
