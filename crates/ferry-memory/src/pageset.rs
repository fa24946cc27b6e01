//! A set of address ranges (page-aligned in use), kept sorted, disjoint and coalesced.

/// Sorted, disjoint, non-adjacent `[start, end)` ranges.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RangeSet {
    r: Vec<(u64, u64)>,
}

impl RangeSet {
    pub fn new() -> RangeSet {
        RangeSet::default()
    }

    /// From ranges in any order, overlapping or not.
    pub fn from_ranges(it: impl IntoIterator<Item = (u64, u64)>) -> RangeSet {
        let mut v: Vec<(u64, u64)> = it.into_iter().filter(|(s, e)| s < e).collect();
        v.sort_unstable();
        let mut r: Vec<(u64, u64)> = Vec::with_capacity(v.len());
        for (s, e) in v {
            match r.last_mut() {
                Some(last) if s <= last.1 => last.1 = last.1.max(e),
                _ => r.push((s, e)),
            }
        }
        RangeSet { r }
    }

    pub fn ranges(&self) -> &[(u64, u64)] {
        &self.r
    }

    pub fn is_empty(&self) -> bool {
        self.r.is_empty()
    }

    /// Bytes covered.
    pub fn len(&self) -> u64 {
        self.r.iter().map(|(s, e)| e - s).sum()
    }

    pub fn insert(&mut self, start: u64, end: u64) {
        if start >= end {
            return;
        }
        let mut all = std::mem::take(&mut self.r);
        all.push((start, end));
        *self = RangeSet::from_ranges(all);
    }

    pub fn union(&self, other: &RangeSet) -> RangeSet {
        RangeSet::from_ranges(self.r.iter().chain(other.r.iter()).copied())
    }

    /// The parts of `self` that `other` does not cover.
    pub fn minus(&self, other: &RangeSet) -> RangeSet {
        let mut out = Vec::new();
        let mut j = 0;
        for &(s, e) in &self.r {
            let mut at = s;
            while j < other.r.len() && other.r[j].1 <= at {
                j += 1;
            }
            let mut k = j;
            while at < e {
                match other.r.get(k) {
                    Some(&(os, oe)) if os < e => {
                        if os > at {
                            out.push((at, os));
                        }
                        at = at.max(oe);
                        k += 1;
                    }
                    _ => {
                        out.push((at, e));
                        at = e;
                    }
                }
            }
        }
        RangeSet { r: out }
    }

    /// The parts covered by both.
    pub fn intersect(&self, other: &RangeSet) -> RangeSet {
        let (mut i, mut j) = (0, 0);
        let mut out = Vec::new();
        while i < self.r.len() && j < other.r.len() {
            let (a, b) = (self.r[i], other.r[j]);
            let s = a.0.max(b.0);
            let e = a.1.min(b.1);
            if s < e {
                out.push((s, e));
            }
            if a.1 < b.1 {
                i += 1;
            } else {
                j += 1;
            }
        }
        RangeSet::from_ranges(out)
    }

    /// Whether `[start, end)` is wholly covered.
    pub fn covers(&self, start: u64, end: u64) -> bool {
        let i = self.r.partition_point(|&(_, e)| e <= start);
        matches!(self.r.get(i), Some(&(s, e)) if s <= start && end <= e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn algebra() {
        let a = RangeSet::from_ranges([(0, 10), (20, 30), (5, 12), (12, 14)]);
        assert_eq!(a.ranges(), &[(0, 14), (20, 30)]);
        let b = RangeSet::from_ranges([(2, 4), (13, 22), (29, 40)]);
        assert_eq!(a.minus(&b).ranges(), &[(0, 2), (4, 13), (22, 29)]);
        assert_eq!(
            a.intersect(&b).ranges(),
            &[(2, 4), (13, 14), (20, 22), (29, 30)]
        );
        assert_eq!(a.union(&b).ranges(), &[(0, 40)]);
        assert!(a.covers(20, 30) && a.covers(1, 13) && !a.covers(13, 21));
        assert_eq!(a.len(), 24);
        assert_eq!(RangeSet::from_ranges([(0, 10)]).minus(&a).len(), 0);
    }
}
