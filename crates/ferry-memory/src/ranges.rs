//! Where the pages of an address space come from, by range of addresses, as mappings move.

use std::collections::BTreeMap;

/// The source of a range's contents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Src {
    /// The memory of process `pid` (as the image knows it) at `addr`, for the range's start.
    Image { pid: i32, addr: u64 },
    /// Zeros (the range was dropped with madvise since, or never had data).
    Zero,
}

impl Src {
    /// The source of the byte `off` bytes into a range that starts with this one.
    pub fn at(self, off: u64) -> Src {
        match self {
            Src::Image { pid, addr } => Src::Image {
                pid,
                addr: addr + off,
            },
            Src::Zero => Src::Zero,
        }
    }
}

/// Disjoint ranges `[start, end)` of an address space, each with its [`Src`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RangeMap {
    m: BTreeMap<u64, (u64, Src)>,
}

impl RangeMap {
    fn split(&mut self, at: u64) {
        if let Some((&s, &(e, src))) = self.m.range(..at).next_back() {
            if e > at {
                self.m.insert(s, (at, src));
                self.m.insert(at, (e, src.at(at - s)));
            }
        }
    }

    /// Takes `[start, end)` out, returning what it held as `(start, end, src)`.
    pub fn remove(&mut self, start: u64, end: u64) -> Vec<(u64, u64, Src)> {
        if start >= end {
            return Vec::new();
        }
        self.split(start);
        self.split(end);
        let keys: Vec<u64> = self.m.range(start..end).map(|(&s, _)| s).collect();
        keys.into_iter()
            .map(|s| {
                let (e, src) = self.m.remove(&s).expect("just listed");
                (s, e, src)
            })
            .collect()
    }

    /// Sets `[start, end)` to come from `src`.
    pub fn insert(&mut self, start: u64, end: u64, src: Src) {
        if start < end {
            self.remove(start, end);
            self.m.insert(start, (end, src));
        }
    }

    /// The range holding `addr`, as `(start, end, src)`.
    pub fn get(&self, addr: u64) -> Option<(u64, u64, Src)> {
        let (&s, &(e, src)) = self.m.range(..=addr).next_back()?;
        (e > addr).then_some((s, e, src))
    }

    /// The lowest range.
    pub fn first(&self) -> Option<(u64, u64, Src)> {
        self.m.iter().next().map(|(&s, &(e, src))| (s, e, src))
    }

    /// The range holding `addr`, or else the lowest one above it.
    pub fn at_or_after(&self, addr: u64) -> Option<(u64, u64, Src)> {
        self.get(addr).or_else(|| {
            self.m
                .range(addr..)
                .next()
                .map(|(&s, &(e, src))| (s, e, src))
        })
    }

    /// `[from, from+len)` moved to `[to, to+len)` (whatever was there is replaced).
    pub fn remap(&mut self, from: u64, to: u64, len: u64) {
        let moved = self.remove(from, from + len);
        self.remove(to, to + len);
        for (s, e, src) in moved {
            self.m.insert(s - from + to, (e - from + to, src));
        }
    }

    pub fn is_empty(&self) -> bool {
        self.m.is_empty()
    }

    /// Bytes covered.
    pub fn bytes(&self) -> u64 {
        self.m.iter().map(|(s, (e, _))| e - s).sum()
    }

    pub fn iter(&self) -> impl Iterator<Item = (u64, u64, Src)> + '_ {
        self.m.iter().map(|(&s, &(e, src))| (s, e, src))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn img(addr: u64) -> Src {
        Src::Image { pid: 1, addr }
    }

    #[test]
    fn split_move_and_drop() {
        let mut m = RangeMap::default();
        m.insert(0x1000, 0x5000, img(0x1000));
        // madvise(DONTNEED) of the middle page.
        m.insert(0x2000, 0x3000, Src::Zero);
        assert_eq!(m.get(0x2800), Some((0x2000, 0x3000, Src::Zero)));
        assert_eq!(m.get(0x3000), Some((0x3000, 0x5000, img(0x3000))));
        // mremap of the last two pages far away: they keep their source.
        m.remap(0x3000, 0x10000, 0x2000);
        assert_eq!(m.get(0x3000), None);
        assert_eq!(m.get(0x11000), Some((0x10000, 0x12000, img(0x3000))));
        // munmap of part of it.
        m.remove(0x10000, 0x11000);
        assert_eq!(m.get(0x10000), None);
        assert_eq!(m.first(), Some((0x1000, 0x2000, img(0x1000))));
        assert_eq!(m.bytes(), 0x3000);
    }
}
