//! The process the engine benchmark checkpoints: it touches its memory with
//! data that is neither zero nor repetitive, so that no page can be skipped
//! or compressed away, and checks after the restore that every word is back.

use anyhow::{Context, Result};
use std::path::Path;
use std::time::Duration;

/// xorshift64: never yields 0 from a non-zero state.
pub fn xorshift(mut x: u64) -> u64 {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    x
}

/// Fill `words` with the xorshift sequence starting after `seed`.
pub fn fill(words: &mut [u64], seed: u64) {
    let mut x = seed | 1;
    for w in words {
        x = xorshift(x);
        *w = x;
    }
}

/// An order-sensitive checksum (four independent lanes, so it runs near
/// memory speed).
pub fn checksum(words: &[u64]) -> u64 {
    const K: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut lanes = [1u64, 2, 3, 4];
    let mut chunks = words.chunks_exact(4);
    for c in &mut chunks {
        for (l, w) in lanes.iter_mut().zip(c) {
            *l = (*l ^ w).wrapping_mul(K).rotate_left(29);
        }
    }
    for w in chunks.remainder() {
        lanes[0] = (lanes[0] ^ w).wrapping_mul(K).rotate_left(29);
    }
    lanes
        .iter()
        .fold(0u64, |h, l| (h ^ l).wrapping_mul(K).rotate_left(31))
}

fn write_atomic(dir: &Path, name: &str, text: &str) -> Result<()> {
    let tmp = dir.join(format!("{name}.tmp"));
    std::fs::write(&tmp, text).with_context(|| format!("write {}", tmp.display()))?;
    std::fs::rename(&tmp, dir.join(name)).with_context(|| format!("rename {}", tmp.display()))
}

/// What a benchmark process holds besides its memory: the shapes whose cost grows per item.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Shape {
    /// Separate one-page mappings, alternately writable and read-only (so the kernel cannot
    /// merge them), each holding a word of its own.
    pub maps: usize,
    /// Threads besides the main one, each asleep.
    pub threads: usize,
    /// Child processes, each asleep in pause().
    pub children: usize,
    /// Descriptors: pipes, two descriptors each.
    pub fds: usize,
    /// Address space reserved for memory (MiB), of which only the touched part is ever
    /// written (so only that is in an image); 0: just what is touched.
    pub reserve_mib: usize,
    /// Memory that compresses: each word one byte of noise and seven zero bytes.
    pub compressible: bool,
    /// Touched fraction (per mille): instead of waiting for `go`, the process watches its PID
    /// namespace, and once it has moved (a moved process runs in a namespace of its own) it
    /// reads this share of its pages (a pseudo-random spread) and writes their checksum with
    /// the wall-clock times of the move and of the last page read ([`touch_after_move`]).
    /// 0: every page, after `go`.
    pub touch_permille: usize,
    /// The children are forked once the memory is filled, sharing it copy-on-write (a
    /// pre-fork server's workers), not before.
    pub children_share: bool,
}

impl Shape {
    /// Parses `maps:8000`, `threads:200`, `children:30`, `fds:2000`, `cowchildren:30` (children
    /// forked once the memory is filled, sharing it copy-on-write; several joined by `+`).
    pub fn parse(s: &str) -> Result<Shape> {
        let mut shape = Shape::default();
        for part in s.split('+') {
            let (k, v) = part
                .split_once(':')
                .ok_or_else(|| anyhow::anyhow!("shape {part:?} is not KIND:COUNT"))?;
            let n: usize = v
                .parse()
                .with_context(|| format!("shape {part:?}: {v:?} is not a count"))?;
            match k {
                "maps" => shape.maps = n,
                "threads" => shape.threads = n,
                "children" => shape.children = n,
                "cowchildren" => {
                    shape.children = n;
                    shape.children_share = true;
                }
                "fds" => shape.fds = n,
                _ => {
                    anyhow::bail!("shape {part:?}: not maps, threads, children, cowchildren or fds")
                }
            }
        }
        Ok(shape)
    }

    pub fn args(&self) -> Vec<String> {
        vec![
            format!("--maps={}", self.maps),
            format!("--threads={}", self.threads),
            format!("--children={}", self.children),
            format!("--fds={}", self.fds),
            format!("--reserve-mib={}", self.reserve_mib),
        ]
        .into_iter()
        .chain(self.compressible.then(|| "--compressible".to_string()))
        .chain(self.children_share.then(|| "--children-share".to_string()))
        .chain(
            (self.touch_permille > 0).then(|| format!("--touch-permille={}", self.touch_permille)),
        )
        .collect()
    }

    pub fn label(&self) -> String {
        let mut parts = Vec::new();
        for (n, what) in [
            (self.maps, "mappings"),
            (self.threads, "threads"),
            (
                self.children,
                if self.children_share {
                    "children sharing its memory"
                } else {
                    "children"
                },
            ),
            (self.fds, "descriptors"),
        ] {
            if n > 0 {
                parts.push(format!("{n} {what}"));
            }
        }
        parts.join(", ")
    }
}

/// The one-page mappings of a [`Shape`]: one region, every other page made read-only.
fn make_maps(n: usize) -> Result<Vec<u64>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    let page = 4096usize;
    // SAFETY: a fresh anonymous mapping nobody else knows of; checked for failure.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            n * page,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        anyhow::bail!("mmap {n} pages: {}", std::io::Error::last_os_error());
    }
    let mut words = Vec::with_capacity(n);
    for i in 0..n {
        let at = base as usize + i * page;
        let w = xorshift(0x6d61_7073 ^ (i as u64 + 1));
        // SAFETY: `at` is a page of the writable mapping just made.
        unsafe { std::ptr::write(at as *mut u64, w) };
        words.push(w);
        if i % 2 == 1 {
            // SAFETY: changes the protection of one page of our own mapping.
            if unsafe { libc::mprotect(at as *mut libc::c_void, page, libc::PROT_READ) } != 0 {
                anyhow::bail!("mprotect: {}", std::io::Error::last_os_error());
            }
        }
    }
    words.push(base as u64);
    Ok(words)
}

/// Whether every one-page mapping still holds its word.
fn check_maps(words: &[u64]) -> bool {
    let Some((&base, words)) = words.split_last() else {
        return true;
    };
    words.iter().enumerate().all(|(i, w)| {
        // SAFETY: reads one word of a page of our own mapping, still mapped (readable).
        unsafe { std::ptr::read((base as usize + i * 4096) as *const u64) == *w }
    })
}

/// Forks `n` children that sleep until killed.
fn fork_children(n: usize) -> Result<Vec<i32>> {
    let mut children = Vec::new();
    for _ in 0..n {
        // SAFETY: the child only calls pause(), async-signal-safe, forever.
        match unsafe { libc::fork() } {
            0 => loop {
                // SAFETY: pause() has no arguments.
                unsafe { libc::pause() };
            },
            pid if pid > 0 => children.push(pid),
            _ => anyhow::bail!("fork: {}", std::io::Error::last_os_error()),
        }
    }
    Ok(children)
}

pub fn run(mib: usize, dir: &Path, shape: Shape) -> Result<()> {
    // Children first, while this process has one thread: each sleeps until killed (unless
    // they are to share the memory: then once it is filled, before any thread starts).
    let mut children = if shape.children_share {
        Vec::new()
    } else {
        fork_children(shape.children)?
    };
    let mut words: Vec<u64> = Vec::with_capacity(shape.reserve_mib.max(mib) << 17);
    if shape.children_share {
        words.resize(mib << 17, 0);
        fill(&mut words, 0x5eed ^ mib as u64);
        children = fork_children(shape.children)?;
    }
    let mut pipes = Vec::new();
    for _ in 0..shape.fds / 2 {
        let mut p = [0i32; 2];
        // SAFETY: pipe2 writes two descriptors into a local array.
        if unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            anyhow::bail!("pipe2: {}", std::io::Error::last_os_error());
        }
        pipes.push(p);
    }
    let maps = make_maps(shape.maps)?;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let threads: Vec<_> = (0..shape.threads)
        .map(|_| {
            let stop = stop.clone();
            std::thread::Builder::new()
                .stack_size(64 << 10)
                .spawn(move || {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                })
        })
        .collect::<std::io::Result<_>>()
        .context("start the benchmark's threads")?;
    // Reserved (address space never touched, so never in an image), of which the first `mib`
    // MiB are touched.
    if !shape.children_share {
        words.resize(mib << 17, 0);
        fill(&mut words, 0x5eed ^ mib as u64);
    }
    if shape.compressible {
        for w in &mut words {
            // Never 0: no page is all zero (those are never sent).
            *w = (*w & 0xff) | 1;
        }
    }
    if shape.touch_permille > 0 {
        return touch_after_move(dir, &words, shape.touch_permille);
    }
    let sum = checksum(&words);
    write_atomic(
        dir,
        "ready",
        &format!("{} {sum:016x}\n", std::process::id()),
    )?;
    // Wait, frozen at any point of this loop, for the bench to say go.
    while !dir.join("go").exists() {
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut again = checksum(&words);
    if !check_maps(&maps) {
        again ^= 1;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for t in threads {
        if t.join().is_err() {
            again ^= 2;
        }
    }
    for c in children {
        // SAFETY: kills and reaps a child of our own.
        unsafe {
            libc::kill(c, libc::SIGKILL);
            libc::waitpid(c, std::ptr::null_mut(), 0);
        }
    }
    drop(pipes);
    write_atomic(dir, "result", &format!("{again:016x}\n"))?;
    Ok(())
}

/// Whether page `p` is among the touched `permille` (a fixed pseudo-random spread).
fn touched(p: usize, permille: usize) -> bool {
    (xorshift(0x746f_7563 ^ (p as u64 + 1)) % 1000) < permille as u64
}

/// The checksum of the touched pages, in order.
fn touched_sum(words: &[u64], permille: usize) -> u64 {
    const K: u64 = 0x9e37_79b9_7f4a_7c15;
    words
        .chunks(512)
        .enumerate()
        .filter(|(p, _)| touched(*p, permille))
        .fold(7u64, |h, (_, page)| {
            (h ^ checksum(page)).wrapping_mul(K).rotate_left(31)
        })
}

fn wall_ns() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

/// `ready` with the touched pages' checksum; then, once this process runs in another PID
/// namespace (it has moved), reads the touched pages and writes `result`: their checksum, the
/// wall-clock time (ns) it first ran there, and when the last touched page had been read.
fn touch_after_move(dir: &Path, words: &[u64], permille: usize) -> Result<()> {
    let ns = || std::fs::read_link("/proc/self/ns/pid").ok();
    let home = ns().context("read /proc/self/ns/pid")?;
    let sum = touched_sum(words, permille);
    write_atomic(
        dir,
        "ready",
        &format!("{} {sum:016x}\n", std::process::id()),
    )?;
    while ns().is_none_or(|n| n == home) {
        std::thread::sleep(Duration::from_micros(500));
    }
    let moved = wall_ns();
    let again = touched_sum(words, permille);
    let done = wall_ns();
    write_atomic(dir, "result", &format!("{again:016x} {moved} {done}\n"))?;
    Ok(())
}
