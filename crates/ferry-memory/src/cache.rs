//! The receiving side's store of pages that came before the image naming them: pre-copy
//! rounds, or a parent image's pages. A page sent again replaces the one before.

use crate::{Error, RangeSet, Result, PAGE};
use ferry_image::{ImageReader, Item};
use std::collections::HashMap;
use std::io::Read;

/// Pages are kept in slabs of this many bytes.
const SLAB: usize = 64 << 20;

impl std::fmt::Debug for PageCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PageCache({} pages)", self.index.len())
    }
}

#[derive(Default)]
pub struct PageCache {
    /// (image PID, page address) -> offset in the slabs.
    index: HashMap<(i32, u64), usize>,
    slabs: Vec<Vec<u8>>,
}

impl PageCache {
    pub fn new() -> PageCache {
        PageCache::default()
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.index.len() as u64 * PAGE
    }

    /// Stores the pages of `data` (whole pages) at `addr` of process `pid`.
    pub fn insert(&mut self, pid: i32, addr: u64, data: &[u8]) {
        for (i, page) in data.chunks_exact(PAGE as usize).enumerate() {
            let at = addr + i as u64 * PAGE;
            let off = match self.index.get(&(pid, at)) {
                Some(&off) => off,
                None => {
                    let need_slab = self
                        .slabs
                        .last()
                        .is_none_or(|s| s.len() + PAGE as usize > SLAB);
                    if need_slab {
                        let slab = Vec::<u8>::with_capacity(SLAB);
                        // The restore forks its launchers (clone3 with a PID) while the cache
                        // holds the pre-copied memory: not copying the slabs' page tables
                        // into each (and into each husk, which unmaps them again) takes
                        // hundreds of ms out of the freeze at 512 MiB.
                        if let Err(e) = ferry_sys::proc_mem::dont_fork(slab.as_ptr() as usize, SLAB)
                        {
                            log::debug!("page cache: {e}");
                        }
                        self.slabs.push(slab);
                    }
                    let n = self.slabs.len() - 1;
                    let slab = &mut self.slabs[n];
                    let off = n * SLAB + slab.len();
                    slab.resize(slab.len() + PAGE as usize, 0);
                    self.index.insert((pid, at), off);
                    off
                }
            };
            let (n, o) = (off / SLAB, off % SLAB);
            self.slabs[n][o..o + PAGE as usize].copy_from_slice(page);
        }
    }

    /// The page at `addr` of `pid`, if held.
    pub fn get(&self, pid: i32, addr: u64) -> Option<&[u8]> {
        let off = *self.index.get(&(pid, addr))?;
        let (n, o) = (off / SLAB, off % SLAB);
        Some(&self.slabs[n][o..o + PAGE as usize])
    }

    /// The pages held for `pid` from `addr` on that lie one after another in the cache as in
    /// the process (at most `max` bytes, at least one page), if the page at `addr` is held:
    /// copied from in one piece.
    pub fn run(&self, pid: i32, addr: u64, max: usize) -> Option<&[u8]> {
        let off = *self.index.get(&(pid, addr))?;
        let (n, o) = (off / SLAB, off % SLAB);
        let slab = &self.slabs[n];
        let page = PAGE as usize;
        let mut len = page;
        while len < max
            && o + len + page <= slab.len()
            && self.index.get(&(pid, addr + len as u64)) == Some(&(off + len))
        {
            len += page;
        }
        Some(&slab[o..o + len])
    }

    /// The addresses of the pages held for `pid`, in order.
    pub fn pages_of(&self, pid: i32) -> Vec<u64> {
        let mut v: Vec<u64> = self
            .index
            .keys()
            .filter(|(p, _)| *p == pid)
            .map(|(_, a)| *a)
            .collect();
        v.sort_unstable();
        v
    }

    /// Whether every page of `ranges` of `pid` is held; the first one missing otherwise.
    pub fn missing(&self, pid: i32, ranges: &RangeSet) -> Option<u64> {
        ranges.ranges().iter().find_map(|&(s, e)| {
            (s..e)
                .step_by(PAGE as usize)
                .find(|a| !self.index.contains_key(&(pid, *a)))
        })
    }

    /// Keeps only the pages of `pid` in `ranges` (the others are dropped), for every PID of
    /// `keep`; the pages of PIDs not named are dropped.
    pub fn retain(&mut self, keep: &HashMap<i32, RangeSet>) {
        self.index
            .retain(|(pid, a), _| keep.get(pid).is_some_and(|r| r.covers(*a, *a + PAGE)));
    }

    /// Reads the page records of a page stream (or of an image after its tree) up to its end
    /// marker into the cache; objects are skipped. Returns the bytes read.
    pub fn load<R: Read>(&mut self, r: &mut ImageReader<R>) -> Result<u64> {
        let mut total = 0;
        let mut buf = Vec::new();
        loop {
            match r.next_item()? {
                Some(Item::Pages { pid, addr, len }) => {
                    if addr % PAGE != 0 || len % PAGE != 0 {
                        return Err(Error::Other(format!(
                            "pages of PID {pid} at {addr:x} ({len} bytes) are not whole pages"
                        )));
                    }
                    buf.resize(len as usize, 0);
                    r.read_data(&mut buf)?;
                    r.end_record()?;
                    self.insert(pid, addr, &buf);
                    total += len;
                }
                Some(Item::Object { len, .. }) => {
                    buf.resize(len as usize, 0);
                    r.read_data(&mut buf)?;
                    r.end_record()?;
                }
                Some(Item::End { .. }) => return Ok(total),
                Some(Item::Tree(_)) => {
                    return Err(Error::Other("a tree record among the pages".into()))
                }
                None => return Err(Error::Other("the page stream has already ended".into())),
            }
        }
    }
}

impl ferry_engine::restore::InheritedPages for PageCache {
    fn page(&self, pid: i32, addr: u64) -> Option<&[u8]> {
        self.get(pid, addr)
    }
}

/// XXH3-64 and size of the file at `path`.
pub fn file_digest(path: &std::path::Path) -> std::io::Result<(u64, u64)> {
    use std::io::Read;
    let mut f = std::fs::File::open(path)?;
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        let k = f.read(&mut buf)?;
        if k == 0 {
            return Ok((h.digest(), n));
        }
        h.update(&buf[..k]);
        n += k as u64;
    }
}

/// The pages an image in `dir` holds, with those it inherits from its parents (each parent
/// checked against the digest its child recorded), keyed by the image's PIDs; and the image's
/// own digest and size (what a child records as its parent).
/// With `expected`, the image must be that one (checked before it is read).
pub fn load_chain(
    dir: &std::path::Path,
    expected: Option<&ferry_image::ParentImage>,
) -> Result<(PageCache, ferry_image::ParentImage)> {
    load_chain_depth(dir, expected, 0)
}

fn load_chain_depth(
    dir: &std::path::Path,
    expected: Option<&ferry_image::ParentImage>,
    depth: usize,
) -> Result<(PageCache, ferry_image::ParentImage)> {
    if depth > 64 {
        return Err(Error::Other(format!(
            "{}: a chain of more than 64 parent images",
            dir.display()
        )));
    }
    let path = dir.join(ferry_image::IMAGE_FILE);
    let io = |e: std::io::Error| Error::Other(format!("read {}: {e}", path.display()));
    let (digest, bytes) = file_digest(&path).map_err(io)?;
    let me = ferry_image::ParentImage {
        dir: dir.to_string_lossy().into_owned(),
        digest,
        bytes,
    };
    if let Some(e) = expected {
        check_parent(e, &me)?;
    }
    let mut r = ImageReader::new(std::io::BufReader::new(
        std::fs::File::open(&path).map_err(io)?,
    ))?;
    let tree = r.read_tree()?;
    let mut cache = PageCache::new();
    if let Some(p) = &tree.parent {
        let (mut parent, _) = load_chain_depth(std::path::Path::new(&p.dir), Some(p), depth + 1)?;
        let keep: HashMap<i32, RangeSet> = tree
            .processes
            .iter()
            .map(|q| (q.pid, RangeSet::from_ranges(q.inherited.iter().copied())))
            .collect();
        parent.retain(&keep);
        cache = parent;
    }
    cache.load(&mut r)?;
    Ok((cache, me))
}

/// Refuses a parent image that is not the one recorded.
pub fn check_parent(
    recorded: &ferry_image::ParentImage,
    found: &ferry_image::ParentImage,
) -> Result<()> {
    if recorded.digest != found.digest || recorded.bytes != found.bytes {
        return Err(Error::Other(format!(
            "the parent image in {} is not the one this image was made from (it has {} bytes, \
             digest {:016x}; the image recorded {} bytes, digest {:016x}): refused",
            found.dir, found.bytes, found.digest, recorded.bytes, recorded.digest
        )));
    }
    Ok(())
}
