//! Random access to an image file's memory: an index of its page records (read from their
//! headers only, seeking over the data), and the reading of one record, checked against its
//! checksum. A lazy restore (`crates/ferry-memory`) serves each page from here when it is
//! first touched, instead of reading the image front to back before the tree runs.

use crate::stream::{ImageError, KIND_END, KIND_OBJECT, KIND_PAGES, KIND_TREE, MAX_RECORD};
use std::fs::File;
use std::os::unix::fs::FileExt;
use xxhash_rust::xxh3::Xxh3;

/// Where one record of pages lies in the image file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageRecord {
    /// Its number in the stream (the tree is record 0), for error messages.
    pub index: u64,
    pub pid: i32,
    pub addr: u64,
    /// Bytes of memory it holds (a whole number of pages).
    pub len: u64,
    /// The file offset of its header.
    pub at: u64,
}

/// Every record of pages of an image, in stream order.
#[derive(Debug, Default)]
pub struct PageIndex {
    pub records: Vec<PageRecord>,
    /// Bytes of memory the records hold.
    pub page_bytes: u64,
}

fn read_at(file: &File, buf: &mut [u8], at: u64, what: &str) -> Result<(), ImageError> {
    file.read_exact_at(buf, at).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => {
            ImageError::Truncated(format!("the file ends inside {what}"))
        }
        _ => ImageError::Io(e),
    })
}

/// Indexes the page records of the image `file` (its header was checked by whoever opened
/// it), reading only record headers. The end marker must be there, and its counts must agree
/// with the records seen: a truncated image is refused here, before anything runs. A record's
/// data is checked only when [`read_record`] reads it.
pub fn index_pages(file: &File) -> Result<PageIndex, ImageError> {
    let mut out = PageIndex::default();
    let mut at = 16u64;
    let mut index = 0u64;
    let mut data_bytes = 0u64;
    loop {
        let malformed = |reason: String| ImageError::Malformed { index, reason };
        let mut head = [0u8; 28];
        let head_len = {
            let mut h = [0u8; 12];
            read_at(file, &mut h, at, &format!("the header of record {index}"))?;
            head[..12].copy_from_slice(&h);
            12
        };
        let kind = u32::from_le_bytes(head[0..4].try_into().expect("4"));
        let len = u64::from_le_bytes(head[4..12].try_into().expect("8"));
        if len > MAX_RECORD {
            return Err(malformed(format!(
                "length {len} exceeds the {MAX_RECORD}-byte limit"
            )));
        }
        if kind != KIND_TREE && len < 16 {
            return Err(malformed(format!("record of {len} bytes is too short")));
        }
        if kind != KIND_TREE {
            read_at(
                file,
                &mut head[head_len..],
                at + 12,
                &format!("record {index}"),
            )?;
        }
        let u64_at = |at: usize| u64::from_le_bytes(head[at..at + 8].try_into().expect("8"));
        match kind {
            KIND_TREE if index == 0 => {}
            KIND_PAGES => {
                out.records.push(PageRecord {
                    index,
                    pid: u32::from_le_bytes(head[12..16].try_into().expect("4")) as i32,
                    addr: u64_at(20),
                    len: len - 16,
                    at,
                });
                out.page_bytes += len - 16;
                data_bytes += len - 16;
            }
            KIND_OBJECT => data_bytes += len - 16,
            KIND_END if len == 16 => {
                let mut sum = [0u8; 8];
                read_at(file, &mut sum, at + 28, "the end marker's checksum")?;
                let mut h = Xxh3::new();
                h.update(&head);
                if h.digest() != u64::from_le_bytes(sum) {
                    return Err(ImageError::Checksum { index, kind: "end" });
                }
                if u64_at(12) != index + 1 || u64_at(20) != data_bytes {
                    return Err(malformed(format!(
                        "the end marker counts {} records and {} bytes of data, the image \
                         has {} and {data_bytes}",
                        u64_at(12),
                        u64_at(20),
                        index + 1
                    )));
                }
                return Ok(out);
            }
            other => return Err(malformed(format!("unexpected record kind {other} here"))),
        }
        at += 12 + len + 8;
        index += 1;
    }
}

/// Reads record `r` of the image `file` whole into `buf` (resized to it) and checks it against
/// its checksum and its index entry. Returns the offset of its data within `buf`.
pub fn read_record(file: &File, r: &PageRecord, buf: &mut Vec<u8>) -> Result<usize, ImageError> {
    let total = (12 + 16 + r.len + 8) as usize;
    buf.resize(total, 0);
    read_at(file, buf, r.at, &format!("record {} (pages)", r.index))?;
    let (body, sum) = buf.split_at(total - 8);
    let mut h = Xxh3::new();
    h.update(body);
    if h.digest() != u64::from_le_bytes(sum.try_into().expect("8")) {
        return Err(ImageError::Checksum {
            index: r.index,
            kind: "pages",
        });
    }
    let kind = u32::from_le_bytes(body[0..4].try_into().expect("4"));
    let pid = u32::from_le_bytes(body[12..16].try_into().expect("4")) as i32;
    let addr = u64::from_le_bytes(body[20..28].try_into().expect("8"));
    if kind != KIND_PAGES || pid != r.pid || addr != r.addr {
        return Err(ImageError::Malformed {
            index: r.index,
            reason: "the record changed since it was indexed".into(),
        });
    }
    Ok(28)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::ImageWriter;
    use std::io::Write;

    fn image() -> (Vec<u8>, Vec<u8>) {
        let tree = crate::Tree::default();
        let mut w = ImageWriter::new(Vec::new()).unwrap();
        w.write_tree(&tree).unwrap();
        let a = vec![7u8; 8192];
        w.write_pages(5, 0x1000, &a).unwrap();
        w.write_pages(6, 0x9000, &[9u8; 4096]).unwrap();
        (w.finish().unwrap().0, a)
    }

    fn file_of(bytes: &[u8]) -> File {
        let mut f = tempfile();
        f.write_all(bytes).unwrap();
        f
    }

    fn tempfile() -> File {
        let p = std::env::temp_dir().join(format!(
            "ferry-index-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&p)
            .unwrap();
        std::fs::remove_file(&p).unwrap();
        f
    }

    #[test]
    fn indexes_and_reads_checked() {
        let (bytes, a) = image();
        let f = file_of(&bytes);
        let idx = index_pages(&f).unwrap();
        assert_eq!(idx.records.len(), 2);
        assert_eq!((idx.records[0].pid, idx.records[0].addr), (5, 0x1000));
        assert_eq!(idx.page_bytes, 8192 + 4096);
        let mut buf = Vec::new();
        let off = read_record(&f, &idx.records[0], &mut buf).unwrap();
        assert_eq!(&buf[off..off + 8192], &a[..]);
        // A flipped byte of its data is caught when it is read.
        let mut bad = bytes.clone();
        let at = idx.records[1].at as usize + 40;
        bad[at] ^= 1;
        let f = file_of(&bad);
        let idx = index_pages(&f).unwrap();
        assert!(matches!(
            read_record(&f, &idx.records[1], &mut buf),
            Err(ImageError::Checksum { .. })
        ));
    }

    #[test]
    fn every_truncation_is_refused() {
        let (bytes, _) = image();
        for cut in 16..bytes.len() {
            assert!(index_pages(&file_of(&bytes[..cut])).is_err(), "cut {cut}");
        }
    }
}
