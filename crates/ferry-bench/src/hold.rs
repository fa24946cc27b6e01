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

pub fn run(mib: usize, dir: &Path) -> Result<()> {
    let mut words: Vec<u64> = vec![0; mib << 17];
    fill(&mut words, 0x5eed ^ mib as u64);
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
    let again = checksum(&words);
    write_atomic(dir, "result", &format!("{again:016x}\n"))?;
    Ok(())
}
