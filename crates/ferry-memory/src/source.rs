//! Where owed pages come from.

use ferry_image::index::{index_pages, read_record, PageIndex, PageRecord};
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

/// The memory a page server hands out: the private pages of the image's processes, by the
/// PIDs and addresses the image knows them by.
pub trait PageSource: Send {
    /// The ranges `[start, end)` of process `pid`'s memory that the source holds data for,
    /// sorted; everything else reads as zeros.
    fn extents(&self, pid: i32) -> Vec<(u64, u64)>;
    /// Reads `[addr, addr + buf.len())` of process `pid`'s memory (zeros where the source
    /// holds nothing), checked. An error says why the source cannot supply it.
    fn read(&mut self, pid: i32, addr: u64, buf: &mut [u8]) -> Result<(), String>;
    /// What the source is, for messages ("image /path/image.ferry").
    fn describe(&self) -> String;
    /// Bytes of the processes' memory the source has delivered so far (read from a file, or
    /// received over a link): each page as often as it was asked for, never the records,
    /// headers or re-reads behind it.
    fn bytes_delivered(&self) -> u64;
    /// Whether the source can still supply pages, asked while the server waits (at least
    /// every 100 ms): a migration's source whose link is gone fails here, so the tree is
    /// killed at once rather than at its next fault.
    fn check(&mut self) -> Result<(), String> {
        Ok(())
    }
    /// Asks for `[addr, addr + len)` of process `pid`'s memory (at most [`Self::max_ask`]
    /// bytes) without waiting for it: its bytes come later from [`Self::answers`], under the
    /// number returned. Many may be outstanding at once (the server keeps a window of them in
    /// flight, faults' and the push's).
    fn ask(&mut self, pid: i32, addr: u64, len: usize) -> Result<u64, String>;
    /// Appends the answers that have arrived, `(number, bytes)`, without waiting. An error
    /// says why an outstanding request will never be answered.
    fn answers(&mut self, out: &mut Vec<(u64, Vec<u8>)>) -> Result<(), String>;
    /// A descriptor that becomes readable when an answer may have arrived; `None`: every
    /// answer is there as soon as it is asked for.
    fn ready_fd(&self) -> Option<std::os::fd::RawFd> {
        None
    }
    /// The ranges of answer `number`'s request (the source's addresses) that the source holds
    /// no page of, named by it rather than sent (their bytes in the answer are zeros): taken
    /// once, as the answer is collected. The server copies nothing there; a thread waiting
    /// on such a page is woken and finds the zero page.
    fn take_holes(&mut self, _number: u64) -> Vec<(u64, u64)> {
        Vec::new()
    }
    /// The most bytes one request may ask for.
    fn max_ask(&self) -> usize {
        1 << 20
    }
}

/// An image file, read at random: each record whole and checked against its checksum when
/// first needed, the last few kept.
pub struct ImageSource {
    path: PathBuf,
    file: File,
    by_pid: HashMap<i32, Vec<PageRecord>>,
    /// Records read and checked, most recent last: (record, its bytes, data offset).
    cache: Vec<(PageRecord, Vec<u8>, usize)>,
    delivered: u64,
    /// Requests read at once ([`PageSource::ask`]) and not yet collected.
    ready: Vec<(u64, Vec<u8>)>,
    asked: u64,
}

/// Records kept after they were read (a fault's neighbours, and the background push's
/// sequential reads, are mostly in the record read last).
const CACHED_RECORDS: usize = 4;

impl ImageSource {
    /// Opens and indexes the image at `path` (a truncated image is refused here).
    pub fn open(path: &Path) -> Result<ImageSource, String> {
        let file = File::open(path).map_err(|e| format!("open image {}: {e}", path.display()))?;
        let idx: PageIndex =
            index_pages(&file).map_err(|e| format!("index image {}: {e}", path.display()))?;
        let mut by_pid: HashMap<i32, Vec<PageRecord>> = HashMap::new();
        for r in idx.records {
            by_pid.entry(r.pid).or_default().push(r);
        }
        for v in by_pid.values_mut() {
            v.sort_by_key(|r| r.addr);
            if v.windows(2).any(|w| w[0].addr + w[0].len > w[1].addr) {
                return Err(format!(
                    "image {}: two records of pages of one process overlap",
                    path.display()
                ));
            }
        }
        Ok(ImageSource {
            path: path.to_path_buf(),
            file,
            by_pid,
            cache: Vec::new(),
            delivered: 0,
            ready: Vec::new(),
            asked: 0,
        })
    }

    /// Bytes of memory the image holds.
    pub fn page_bytes(&self) -> u64 {
        self.by_pid.values().flatten().map(|r| r.len).sum()
    }

    fn record(&mut self, r: &PageRecord) -> Result<usize, String> {
        if let Some(i) = self.cache.iter().position(|(c, _, _)| c == r) {
            let hit = self.cache.remove(i);
            self.cache.push(hit);
            return Ok(self.cache.len() - 1);
        }
        let mut buf = if self.cache.len() >= CACHED_RECORDS {
            self.cache.remove(0).1
        } else {
            Vec::new()
        };
        let off = read_record(&self.file, r, &mut buf).map_err(|e| {
            format!(
                "image {}: PID {}'s memory at {:x}-{:x}: {e}",
                self.path.display(),
                r.pid,
                r.addr,
                r.addr + r.len
            )
        })?;
        self.cache.push((*r, buf, off));
        Ok(self.cache.len() - 1)
    }
}

impl PageSource for ImageSource {
    fn extents(&self, pid: i32) -> Vec<(u64, u64)> {
        let mut out: Vec<(u64, u64)> = Vec::new();
        for r in self.by_pid.get(&pid).into_iter().flatten() {
            match out.last_mut() {
                Some(last) if last.1 == r.addr => last.1 = r.addr + r.len,
                _ => out.push((r.addr, r.addr + r.len)),
            }
        }
        out
    }

    fn read(&mut self, pid: i32, addr: u64, buf: &mut [u8]) -> Result<(), String> {
        buf.fill(0);
        let end = addr + buf.len() as u64;
        let hits: Vec<PageRecord> = self
            .by_pid
            .get(&pid)
            .into_iter()
            .flatten()
            .filter(|r| r.addr < end && addr < r.addr + r.len)
            .copied()
            .collect();
        for r in hits {
            let i = self.record(&r)?;
            let (_, bytes, off) = &self.cache[i];
            let from = addr.max(r.addr);
            let to = end.min(r.addr + r.len);
            let src = off + (from - r.addr) as usize;
            let dst = (from - addr) as usize;
            let n = (to - from) as usize;
            buf[dst..dst + n].copy_from_slice(&bytes[src..src + n]);
            // The memory handed out, not the records read for it: a record is read whole for
            // any piece of it, and again if it left the cache in between.
            self.delivered += n as u64;
        }
        Ok(())
    }

    fn describe(&self) -> String {
        format!("image {}", self.path.display())
    }

    fn ask(&mut self, pid: i32, addr: u64, len: usize) -> Result<u64, String> {
        let mut buf = vec![0u8; len];
        self.read(pid, addr, &mut buf)?;
        self.asked += 1;
        self.ready.push((self.asked, buf));
        Ok(self.asked)
    }

    fn answers(&mut self, out: &mut Vec<(u64, Vec<u8>)>) -> Result<(), String> {
        out.append(&mut self.ready);
        Ok(())
    }

    fn bytes_delivered(&self) -> u64 {
        self.delivered
    }
}
