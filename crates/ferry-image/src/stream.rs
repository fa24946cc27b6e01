//! Framing: header, checksummed records, end marker. Writers and readers over any byte stream.

use crate::model::Tree;
use crate::{FORMAT_VERSION, MAGIC};
use std::io::{Read, Write};
use xxhash_rust::xxh3::Xxh3;

const KIND_TREE: u32 = 1;
const KIND_PAGES: u32 = 2;
const KIND_OBJECT: u32 = 3;
const KIND_END: u32 = 0xffff;

/// Largest record a reader accepts: bounds memory use on a hostile or corrupted stream.
pub const MAX_RECORD: u64 = 1 << 30;
/// Memory is written in chunks of at most this many bytes.
pub const CHUNK: usize = 64 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("not a Ferry image (bad magic {0:02x?})")]
    BadMagic([u8; 8]),
    #[error(
        "image format version {found} is not supported (this Ferry reads version {supported})"
    )]
    Version { found: u32, supported: u32 },
    #[error("image header: {0}")]
    Header(String),
    #[error("image is truncated: {0}")]
    Truncated(String),
    #[error("record {index} ({kind}) is corrupted: checksum mismatch")]
    Checksum { index: u64, kind: &'static str },
    #[error("record {index}: {reason}")]
    Malformed { index: u64, reason: String },
    #[error("image I/O: {0}")]
    Io(#[from] std::io::Error),
}

/// Which object an `ObjectData` record fills.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ObjectRef {
    Shmem(u32),
    Ghost(u32),
}

impl ObjectRef {
    fn encode(self) -> (u32, u32) {
        match self {
            ObjectRef::Shmem(id) => (1, id),
            ObjectRef::Ghost(id) => (2, id),
        }
    }
    fn decode(tag: u32, id: u32) -> Option<Self> {
        match tag {
            1 => Some(ObjectRef::Shmem(id)),
            2 => Some(ObjectRef::Ghost(id)),
            _ => None,
        }
    }
}

#[derive(Debug)]
pub enum Record {
    Tree(Box<Tree>),
    /// Bytes of private memory of process `pid` starting at `addr`.
    Pages {
        pid: i32,
        addr: u64,
        data: Vec<u8>,
    },
    /// Bytes of a shared memory object or ghost file starting at `offset`.
    Object {
        object: ObjectRef,
        offset: u64,
        data: Vec<u8>,
    },
    End {
        records: u64,
        data_bytes: u64,
    },
}

impl Record {
    pub fn kind_name(&self) -> &'static str {
        match self {
            Record::Tree(_) => "tree",
            Record::Pages { .. } => "pages",
            Record::Object { .. } => "object",
            Record::End { .. } => "end",
        }
    }
}

/// Writes an image to any byte sink, never seeking.
pub struct ImageWriter<W: Write> {
    out: W,
    records: u64,
    data_bytes: u64,
    bytes_written: u64,
}

impl<W: Write> ImageWriter<W> {
    pub fn new(mut out: W) -> std::io::Result<Self> {
        out.write_all(&MAGIC)?;
        out.write_all(&FORMAT_VERSION.to_le_bytes())?;
        out.write_all(&0u32.to_le_bytes())?;
        Ok(ImageWriter {
            out,
            records: 0,
            data_bytes: 0,
            bytes_written: 16,
        })
    }

    fn record(&mut self, kind: u32, prefix: &[u8], data: &[u8]) -> std::io::Result<()> {
        let len = (prefix.len() + data.len()) as u64;
        let mut h = Xxh3::new();
        h.update(&kind.to_le_bytes());
        h.update(&len.to_le_bytes());
        h.update(prefix);
        h.update(data);
        self.out.write_all(&kind.to_le_bytes())?;
        self.out.write_all(&len.to_le_bytes())?;
        self.out.write_all(prefix)?;
        self.out.write_all(data)?;
        self.out.write_all(&h.digest().to_le_bytes())?;
        self.records += 1;
        self.bytes_written += 4 + 8 + len + 8;
        Ok(())
    }

    pub fn write_tree(&mut self, tree: &Tree) -> std::io::Result<()> {
        let mut buf = Vec::new();
        ciborium::into_writer(tree, &mut buf).map_err(std::io::Error::other)?;
        self.record(KIND_TREE, &[], &buf)
    }

    /// Writes private memory of `pid` at `addr`, split into chunks of at most [`CHUNK`].
    pub fn write_pages(&mut self, pid: i32, addr: u64, data: &[u8]) -> std::io::Result<()> {
        for (i, chunk) in data.chunks(CHUNK).enumerate() {
            let mut prefix = [0u8; 16];
            prefix[0..4].copy_from_slice(&pid.to_le_bytes());
            prefix[8..16].copy_from_slice(&(addr + (i * CHUNK) as u64).to_le_bytes());
            self.record(KIND_PAGES, &prefix, chunk)?;
            self.data_bytes += chunk.len() as u64;
        }
        Ok(())
    }

    pub fn write_object(
        &mut self,
        object: ObjectRef,
        offset: u64,
        data: &[u8],
    ) -> std::io::Result<()> {
        let (tag, id) = object.encode();
        for (i, chunk) in data.chunks(CHUNK).enumerate() {
            let mut prefix = [0u8; 16];
            prefix[0..4].copy_from_slice(&tag.to_le_bytes());
            prefix[4..8].copy_from_slice(&id.to_le_bytes());
            prefix[8..16].copy_from_slice(&(offset + (i * CHUNK) as u64).to_le_bytes());
            self.record(KIND_OBJECT, &prefix, chunk)?;
            self.data_bytes += chunk.len() as u64;
        }
        Ok(())
    }

    /// Writes the end marker and flushes; returns the sink and the total bytes written.
    pub fn finish(mut self) -> std::io::Result<(W, u64)> {
        let mut p = [0u8; 16];
        p[0..8].copy_from_slice(&(self.records + 1).to_le_bytes());
        p[8..16].copy_from_slice(&self.data_bytes.to_le_bytes());
        self.record(KIND_END, &p, &[])?;
        self.out.flush()?;
        Ok((self.out, self.bytes_written))
    }

    pub fn bytes_written(&self) -> u64 {
        self.bytes_written
    }
}

/// Reads an image from any byte source, front to back.
pub struct ImageReader<R: Read> {
    input: R,
    index: u64,
    done: bool,
}

fn read_full<R: Read>(r: &mut R, buf: &mut [u8], what: &str) -> Result<(), ImageError> {
    r.read_exact(buf).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => {
            ImageError::Truncated(format!("stream ends inside {what}"))
        }
        _ => ImageError::Io(e),
    })
}

impl<R: Read> ImageReader<R> {
    pub fn new(mut input: R) -> Result<Self, ImageError> {
        let mut head = [0u8; 16];
        read_full(&mut input, &mut head, "the header")?;
        let magic: [u8; 8] = head[0..8].try_into().expect("8 bytes");
        if magic != MAGIC {
            return Err(ImageError::BadMagic(magic));
        }
        let version = u32::from_le_bytes(head[8..12].try_into().expect("4 bytes"));
        if version != FORMAT_VERSION {
            return Err(ImageError::Version {
                found: version,
                supported: FORMAT_VERSION,
            });
        }
        let flags = u32::from_le_bytes(head[12..16].try_into().expect("4 bytes"));
        if flags != 0 {
            return Err(ImageError::Header(format!(
                "header flags {flags:#x} are not understood"
            )));
        }
        Ok(ImageReader {
            input,
            index: 0,
            done: false,
        })
    }

    /// The next record, or `None` after the end marker. A stream that stops before its end
    /// marker is an error, as is any record whose checksum does not match.
    pub fn next_record(&mut self) -> Result<Option<Record>, ImageError> {
        if self.done {
            return Ok(None);
        }
        let index = self.index;
        let mut head = [0u8; 12];
        read_full(
            &mut self.input,
            &mut head,
            &format!("the header of record {index}"),
        )?;
        let kind = u32::from_le_bytes(head[0..4].try_into().expect("4 bytes"));
        let len = u64::from_le_bytes(head[4..12].try_into().expect("8 bytes"));
        let malformed = |reason: String| ImageError::Malformed { index, reason };
        if len > MAX_RECORD {
            return Err(malformed(format!(
                "length {len} exceeds the {MAX_RECORD}-byte limit"
            )));
        }
        let kind_name = match kind {
            KIND_TREE => "tree",
            KIND_PAGES => "pages",
            KIND_OBJECT => "object",
            KIND_END => "end",
            other => return Err(malformed(format!("unknown record kind {other}"))),
        };
        if kind != KIND_TREE && len < 16 {
            return Err(malformed(format!(
                "{kind_name} record of {len} bytes is too short"
            )));
        }
        // The 16-byte prefix of every record but the tree's (what the data is, where it goes)
        // is read apart, so that the data lands at the start of its own buffer: no pass over
        // it to drop the prefix afterwards.
        let mut prefix = [0u8; 16];
        let prefix_len = if kind == KIND_TREE { 0 } else { 16 };
        read_full(
            &mut self.input,
            &mut prefix[..prefix_len],
            &format!("record {index} ({kind_name})"),
        )?;
        let mut payload = vec![0u8; len as usize - prefix_len];
        read_full(
            &mut self.input,
            &mut payload,
            &format!("record {index} ({kind_name})"),
        )?;
        let mut sum = [0u8; 8];
        read_full(
            &mut self.input,
            &mut sum,
            &format!("the checksum of record {index}"),
        )?;
        let mut h = Xxh3::new();
        h.update(&head);
        h.update(&prefix[..prefix_len]);
        h.update(&payload);
        if h.digest() != u64::from_le_bytes(sum) {
            return Err(ImageError::Checksum {
                index,
                kind: kind_name,
            });
        }
        self.index += 1;
        let u64_at =
            |p: &[u8], at: usize| u64::from_le_bytes(p[at..at + 8].try_into().expect("8 bytes"));
        let u32_at =
            |p: &[u8], at: usize| u32::from_le_bytes(p[at..at + 4].try_into().expect("4 bytes"));
        let rec = match kind {
            KIND_TREE => {
                let tree: Tree = ciborium::from_reader(&payload[..])
                    .map_err(|e| malformed(format!("tree does not decode: {e}")))?;
                Record::Tree(Box::new(tree))
            }
            KIND_PAGES => {
                let pid = u32_at(&prefix, 0) as i32;
                let addr = u64_at(&prefix, 8);
                Record::Pages {
                    pid,
                    addr,
                    data: payload,
                }
            }
            KIND_OBJECT => {
                let object =
                    ObjectRef::decode(u32_at(&prefix, 0), u32_at(&prefix, 4)).ok_or_else(|| {
                        malformed(format!("unknown object tag {}", u32_at(&prefix, 0)))
                    })?;
                let offset = u64_at(&prefix, 8);
                Record::Object {
                    object,
                    offset,
                    data: payload,
                }
            }
            _ => {
                let records = u64_at(&prefix, 0);
                if records != self.index {
                    return Err(malformed(format!(
                        "end marker counts {records} records, the stream had {}",
                        self.index
                    )));
                }
                self.done = true;
                Record::End {
                    records,
                    data_bytes: u64_at(&prefix, 8),
                }
            }
        };
        Ok(Some(rec))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<u8> {
        let mut w = ImageWriter::new(Vec::new()).unwrap();
        w.write_tree(&Tree {
            root_pid: 42,
            ..Default::default()
        })
        .unwrap();
        w.write_pages(42, 0x1000, &[7u8; 8192]).unwrap();
        w.write_object(ObjectRef::Shmem(3), 4096, &[9u8; 100])
            .unwrap();
        w.finish().unwrap().0
    }

    fn read_all(bytes: &[u8]) -> Result<Vec<Record>, ImageError> {
        let mut r = ImageReader::new(bytes)?;
        let mut out = Vec::new();
        while let Some(rec) = r.next_record()? {
            out.push(rec);
        }
        Ok(out)
    }

    #[test]
    fn round_trip() {
        let recs = read_all(&sample()).unwrap();
        assert_eq!(recs.len(), 4);
        assert!(matches!(&recs[0], Record::Tree(t) if t.root_pid == 42));
        assert!(
            matches!(&recs[1], Record::Pages { pid: 42, addr: 0x1000, data } if data.len() == 8192)
        );
        assert!(matches!(
            &recs[2],
            Record::Object {
                object: ObjectRef::Shmem(3),
                offset: 4096,
                ..
            }
        ));
        assert!(matches!(
            &recs[3],
            Record::End {
                records: 4,
                data_bytes: 8292
            }
        ));
    }

    #[test]
    fn every_truncation_is_rejected() {
        let bytes = sample();
        for cut in 0..bytes.len() {
            assert!(
                read_all(&bytes[..cut]).is_err(),
                "image cut at {cut} of {} was accepted",
                bytes.len()
            );
        }
    }

    #[test]
    fn every_flipped_byte_is_rejected() {
        let bytes = sample();
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x40;
            assert!(
                read_all(&bad).is_err(),
                "image with byte {i} flipped was accepted"
            );
        }
    }

    #[test]
    fn foreign_and_future_images_are_named() {
        let mut bytes = sample();
        bytes[8] = 99;
        assert!(matches!(
            read_all(&bytes),
            Err(ImageError::Version { found: 99, .. })
        ));
        assert!(matches!(
            read_all(b"ELF\x7f............"),
            Err(ImageError::BadMagic(_))
        ));
    }
}
