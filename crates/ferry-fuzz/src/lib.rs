//! What Ferry's fuzz targets share.
//!
//! The targets (`crates/ferry-engine/tests/fuzz_image.rs`, `crates/ferry-transport/tests/fuzz.rs`,
//! `crates/ferry-daemon/tests/fuzz_config.rs`, `crates/ferry-daemon/src/membership.rs`) run under `cargo test` on stable Rust with
//! [bolero](https://docs.rs/bolero): `bolero::check!()` draws random inputs for a bounded time
//! (a few seconds; `BOLERO_RANDOM_TEST_TIME_MS` sets it) and reports, and shrinks, any input
//! that makes the target panic. The same targets run under a coverage-guided fuzzer with
//! `cargo bolero test` where a nightly toolchain and cargo-bolero are installed.
//!
//! Random bytes alone would be rejected at the first header or checksum. So the inputs the
//! targets draw are not bytes but [`Edit`]s, applied to valid seeds (a real image, real
//! frames, a real config): mostly valid inputs with a few things wrong. For images, the
//! records' checksums can be recomputed after the edits ([`reseal_image`]), so that what is
//! wrong reaches the code behind the checksums.

#![forbid(unsafe_code)]

use bolero::TypeGenerator;
use xxhash_rust::xxh3::Xxh3;

/// One change to a byte string. Positions are taken modulo its length.
#[derive(Debug, Clone, TypeGenerator)]
pub enum Edit {
    Flip {
        at: u32,
        bit: u8,
    },
    Byte {
        at: u32,
        value: u8,
    },
    /// A value that often sits on a boundary, written over 1, 2, 4 or 8 bytes.
    Word {
        at: u32,
        value: Interesting,
        width: u8,
        big_endian: bool,
    },
    Insert {
        at: u32,
        bytes: Vec<u8>,
    },
    Remove {
        at: u32,
        len: u16,
    },
    Truncate {
        at: u32,
    },
    /// Copies `len` bytes from one place over another (a field repeated, a record doubled).
    Copy {
        from: u32,
        to: u32,
        len: u16,
    },
}

#[derive(Debug, Clone, Copy, TypeGenerator)]
pub enum Interesting {
    Zero,
    One,
    Max,
    Min,
    Half,
    Small(u8),
    Any(u64),
}

impl Interesting {
    fn value(self, width: usize) -> u64 {
        let bits = width as u32 * 8;
        let max = if bits >= 64 {
            u64::MAX
        } else {
            (1u64 << bits) - 1
        };
        match self {
            Interesting::Zero => 0,
            Interesting::One => 1,
            Interesting::Max => max,
            Interesting::Min => 1u64 << (bits - 1),
            Interesting::Half => max >> 1,
            Interesting::Small(n) => n as u64,
            Interesting::Any(n) => n & max,
        }
    }
}

/// Applies `edits` to a copy of `seed`.
pub fn apply(seed: &[u8], edits: &[Edit]) -> Vec<u8> {
    let mut b = seed.to_vec();
    for e in edits {
        let n = b.len();
        let at = |x: u32| if n == 0 { 0 } else { x as usize % n };
        match e {
            Edit::Flip { at: x, bit } if n > 0 => b[at(*x)] ^= 1 << (bit % 8),
            Edit::Byte { at: x, value } if n > 0 => b[at(*x)] = *value,
            Edit::Word {
                at: x,
                value,
                width,
                big_endian,
            } => {
                let width = 1usize << (width % 4);
                let v = value.value(width);
                let bytes = if *big_endian {
                    v.to_be_bytes()[8 - width..].to_vec()
                } else {
                    v.to_le_bytes()[..width].to_vec()
                };
                let start = at(*x);
                for (i, byte) in bytes.into_iter().enumerate() {
                    if let Some(slot) = b.get_mut(start + i) {
                        *slot = byte;
                    }
                }
            }
            Edit::Insert { at: x, bytes } => {
                let start = if n == 0 { 0 } else { *x as usize % (n + 1) };
                b.splice(start..start, bytes.iter().copied());
            }
            Edit::Remove { at: x, len } if n > 0 => {
                let start = at(*x);
                let end = (start + *len as usize).min(n);
                b.drain(start..end);
            }
            Edit::Truncate { at: x } => b.truncate(at(*x)),
            Edit::Copy { from, to, len } if n > 0 => {
                let from = at(*from);
                let to = at(*to);
                let len = (*len as usize).min(n - from).min(n - to);
                b.copy_within(from..from + len, to);
            }
            _ => {}
        }
    }
    b
}

/// Recomputes the checksum of every whole record of an image (see docs/image-format.md: a
/// 16-byte header, then records of `kind: u32, len: u64, payload, xxh3: u64`, all little
/// endian; the checksum covers kind, length and payload). Stops at the first record whose
/// length runs past the end.
pub fn reseal_image(b: &mut [u8]) {
    let mut at = 16;
    while at + 12 <= b.len() {
        let len = u64::from_le_bytes(b[at + 4..at + 12].try_into().expect("8 bytes"));
        let Some(end) = (at as u64 + 12)
            .checked_add(len)
            .filter(|e| e + 8 <= b.len() as u64)
        else {
            return;
        };
        let end = end as usize;
        let mut h = Xxh3::new();
        h.update(&b[at..end]);
        b[end..end + 8].copy_from_slice(&h.digest().to_le_bytes());
        at = end + 8;
    }
}

/// The records of an image: (offset of the record, kind, payload range). Stops where the
/// framing breaks.
pub fn image_records(b: &[u8]) -> Vec<(usize, u32, std::ops::Range<usize>)> {
    let mut out = Vec::new();
    let mut at = 16;
    while at + 12 <= b.len() {
        let kind = u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"));
        let len = u64::from_le_bytes(b[at + 4..at + 12].try_into().expect("8 bytes"));
        let Some(end) = (at as u64 + 12)
            .checked_add(len)
            .filter(|e| e + 8 <= b.len() as u64)
        else {
            break;
        };
        out.push((at, kind, at + 12..end as usize));
        at = end as usize + 8;
    }
    out
}

/// Replaces the payload of the record at `at` (as [`image_records`] found it) and fixes its
/// length; the checksum is left for [`reseal_image`].
pub fn replace_payload(b: &mut Vec<u8>, at: usize, range: std::ops::Range<usize>, new: &[u8]) {
    b.splice(range, new.iter().copied());
    b[at + 4..at + 12].copy_from_slice(&(new.len() as u64).to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edits_stay_in_bounds() {
        bolero::check!()
            .with_type::<(Vec<u8>, Vec<Edit>)>()
            .for_each(|(seed, edits)| {
                apply(seed, edits);
            });
    }

    #[test]
    fn resealing_a_sealed_image_changes_nothing() {
        let mut b = vec![0u8; 16];
        let payload = b"hello";
        let mut h = Xxh3::new();
        h.update(&7u32.to_le_bytes());
        h.update(&(payload.len() as u64).to_le_bytes());
        h.update(payload);
        b.extend_from_slice(&7u32.to_le_bytes());
        b.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        b.extend_from_slice(payload);
        b.extend_from_slice(&h.digest().to_le_bytes());
        let mut r = b.clone();
        r[b.len() - 1] ^= 1;
        reseal_image(&mut r);
        assert_eq!(r, b);
        assert_eq!(image_records(&b).len(), 1);
    }
}
