//! Framing: header, checksummed records, end marker. Writers and readers over any byte stream.

use crate::model::Tree;
use crate::{FORMAT_VERSION, MAGIC, OLDEST_READABLE_VERSION, PAGES_MAGIC};
use std::io::{Read, Write};
use xxhash_rust::xxh3::Xxh3;

pub(crate) const KIND_TREE: u32 = 1;
pub(crate) const KIND_PAGES: u32 = 2;
pub(crate) const KIND_OBJECT: u32 = 3;
pub(crate) const KIND_END: u32 = 0xffff;

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
    #[error("image tree is inconsistent: {0}")]
    Inconsistent(String),
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

/// A record's checksum: of its kind, length, prefix and data.
fn digest(kind: u32, prefix: &[u8], data: &[u8]) -> u64 {
    let len = (prefix.len() + data.len()) as u64;
    let mut h = Xxh3::new();
    h.update(&kind.to_le_bytes());
    h.update(&len.to_le_bytes());
    h.update(prefix);
    h.update(data);
    h.digest()
}

/// The header and checksum of a record of pages (at most [`CHUNK`] bytes), computed apart from
/// writing it: a capture checksums one run of memory while the image writer writes the last.
pub struct SealedPages {
    prefix: [u8; 16],
    len: usize,
    digest: u64,
}

impl SealedPages {
    pub fn new(pid: i32, addr: u64, data: &[u8]) -> SealedPages {
        assert!(
            data.len() <= CHUNK,
            "a record of pages holds at most CHUNK bytes"
        );
        let mut prefix = [0u8; 16];
        prefix[0..4].copy_from_slice(&pid.to_le_bytes());
        prefix[8..16].copy_from_slice(&addr.to_le_bytes());
        SealedPages {
            prefix,
            len: data.len(),
            digest: digest(KIND_PAGES, &prefix, data),
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
    pub fn new(out: W) -> std::io::Result<Self> {
        Self::with_magic(out, MAGIC)
    }

    /// A page stream: records of pages (no tree) and an end marker, framed as an image is,
    /// under its own magic. Pre-copy rounds send one ahead of a migration's image.
    pub fn new_pages(out: W) -> std::io::Result<Self> {
        Self::with_magic(out, PAGES_MAGIC)
    }

    fn with_magic(mut out: W, magic: [u8; 8]) -> std::io::Result<Self> {
        out.write_all(&magic)?;
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
        self.record_digested(kind, prefix, data, digest(kind, prefix, data))
    }

    fn record_digested(
        &mut self,
        kind: u32,
        prefix: &[u8],
        data: &[u8],
        digest: u64,
    ) -> std::io::Result<()> {
        let len = (prefix.len() + data.len()) as u64;
        self.out.write_all(&kind.to_le_bytes())?;
        self.out.write_all(&len.to_le_bytes())?;
        self.out.write_all(prefix)?;
        self.out.write_all(data)?;
        self.out.write_all(&digest.to_le_bytes())?;
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
            let sealed = SealedPages::new(pid, addr + (i * CHUNK) as u64, chunk);
            self.write_sealed_pages(&sealed, chunk)?;
        }
        Ok(())
    }

    /// Writes a record of pages sealed beforehand (perhaps on another thread) from `data`.
    pub fn write_sealed_pages(&mut self, sealed: &SealedPages, data: &[u8]) -> std::io::Result<()> {
        if data.len() != sealed.len {
            return Err(std::io::Error::other(format!(
                "pages sealed as {} bytes, given {}",
                sealed.len,
                data.len()
            )));
        }
        self.record_digested(KIND_PAGES, &sealed.prefix, data, sealed.digest)?;
        self.data_bytes += data.len() as u64;
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

    /// Flushes what was written so far to the sink.
    pub fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }

    pub fn bytes_written(&self) -> u64 {
        self.bytes_written
    }
}

/// Reads an image from any byte source, front to back.
///
/// Records come either whole ([`ImageReader::next_record`]) or streamed
/// ([`ImageReader::next_item`]): the data of a `pages` or `object` record is then read piece by
/// piece into the caller's buffers ([`ImageReader::read_data`]) and the record's checksum checked
/// at its end ([`ImageReader::end_record`]), so that no record needs a buffer of its own size.
pub struct ImageReader<R: Read> {
    input: R,
    version: u32,
    /// A page stream ([`ImageWriter::new_pages`]), not an image.
    pages: bool,
    index: u64,
    done: bool,
    /// The streamed record whose data is being read.
    open: Option<OpenRecord>,
}

struct OpenRecord {
    kind: &'static str,
    hash: Xxh3,
    left: u64,
}

/// A record as [`ImageReader::next_item`] gives it: metadata whole, data still to be read.
#[derive(Debug)]
pub enum Item {
    Tree(Box<Tree>),
    /// `len` bytes of private memory of process `pid` at `addr` follow.
    Pages {
        pid: i32,
        addr: u64,
        len: u64,
    },
    /// `len` bytes of a shared memory object or ghost file at `offset` follow.
    Object {
        object: ObjectRef,
        offset: u64,
        len: u64,
    },
    End {
        records: u64,
        data_bytes: u64,
    },
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
        if magic != MAGIC && magic != PAGES_MAGIC {
            return Err(ImageError::BadMagic(magic));
        }
        let version = u32::from_le_bytes(head[8..12].try_into().expect("4 bytes"));
        if !(OLDEST_READABLE_VERSION..=FORMAT_VERSION).contains(&version) {
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
            version,
            pages: magic == PAGES_MAGIC,
            index: 0,
            done: false,
            open: None,
        })
    }

    /// The image's format version (version 1 stores the contents of shared objects after
    /// memory, version 2 before).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Whether this is a page stream rather than an image.
    pub fn is_pages(&self) -> bool {
        self.pages
    }

    /// The byte source, positioned after what was read.
    pub fn into_inner(self) -> R {
        self.input
    }

    /// The tree: the first record of every image, read whole, checked against its checksum and
    /// then for consistency ([`crate::validate`]). Everything that reads a tree from an image
    /// (a restore, `ferry image show`) reads it with this, so that a crafted tree is refused
    /// the same way everywhere, with an error naming what is wrong.
    pub fn read_tree(&mut self) -> Result<Tree, ImageError> {
        let index = self.index;
        if self.pages {
            return Err(ImageError::Header(
                "this is a page stream (pre-copied memory), not an image".into(),
            ));
        }
        if index != 0 {
            return Err(ImageError::Malformed {
                index,
                reason: "the tree is read only as the first record".into(),
            });
        }
        match self.next_item()? {
            Some(Item::Tree(t)) => {
                crate::validate::validate(&t).map_err(ImageError::Inconsistent)?;
                Ok(*t)
            }
            Some(other) => Err(ImageError::Malformed {
                index,
                reason: format!(
                    "the first record is {}, not the tree",
                    match other {
                        Item::Pages { .. } => "pages",
                        Item::Object { .. } => "an object",
                        _ => "the end marker",
                    }
                ),
            }),
            None => Err(ImageError::Truncated("the stream has no tree".into())),
        }
    }

    /// The next record, or `None` after the end marker. The data of a `pages` or `object`
    /// record is not read: the caller reads all of it with [`Self::read_data`], then calls
    /// [`Self::end_record`], which checks the checksum. Until then the data, and the record's
    /// `pid`, `addr`, `object` and `offset`, are unchecked. A tree or end record is checked
    /// whole before it is returned.
    pub fn next_item(&mut self) -> Result<Option<Item>, ImageError> {
        if self.done {
            return Ok(None);
        }
        let index = self.index;
        let malformed = |reason: String| ImageError::Malformed { index, reason };
        if let Some(open) = &self.open {
            return Err(malformed(format!(
                "the {} record before was not read to its end",
                open.kind
            )));
        }
        let mut head = [0u8; 12];
        read_full(
            &mut self.input,
            &mut head,
            &format!("the header of record {index}"),
        )?;
        let kind = u32::from_le_bytes(head[0..4].try_into().expect("4 bytes"));
        let len = u64::from_le_bytes(head[4..12].try_into().expect("8 bytes"));
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
        if kind == KIND_END && len != 16 {
            return Err(malformed(format!("end record of {len} bytes, not 16")));
        }
        let mut hash = Xxh3::new();
        hash.update(&head);
        if kind == KIND_TREE {
            let mut payload = vec![0u8; len as usize];
            read_full(
                &mut self.input,
                &mut payload,
                &format!("record {index} (tree)"),
            )?;
            hash.update(&payload);
            self.open = Some(OpenRecord {
                kind: kind_name,
                hash,
                left: 0,
            });
            self.end_record()?;
            let tree: Tree = ciborium::from_reader(&payload[..])
                .map_err(|e| malformed(format!("tree does not decode: {e}")))?;
            return Ok(Some(Item::Tree(Box::new(tree))));
        }
        // The 16-byte prefix of every other record: what the data is, where it goes.
        let mut prefix = [0u8; 16];
        read_full(
            &mut self.input,
            &mut prefix,
            &format!("record {index} ({kind_name})"),
        )?;
        hash.update(&prefix);
        self.open = Some(OpenRecord {
            kind: kind_name,
            hash,
            left: len - 16,
        });
        let u64_at = |at: usize| u64::from_le_bytes(prefix[at..at + 8].try_into().expect("8"));
        let u32_at = |at: usize| u32::from_le_bytes(prefix[at..at + 4].try_into().expect("4"));
        let item = match kind {
            KIND_PAGES => Item::Pages {
                pid: u32_at(0) as i32,
                addr: u64_at(8),
                len: len - 16,
            },
            KIND_OBJECT => Item::Object {
                object: ObjectRef::decode(u32_at(0), u32_at(4))
                    .ok_or_else(|| malformed(format!("unknown object tag {}", u32_at(0))))?,
                offset: u64_at(8),
                len: len - 16,
            },
            _ => {
                self.end_record()?;
                let records = u64_at(0);
                if records != self.index {
                    return Err(malformed(format!(
                        "end marker counts {records} records, the stream had {}",
                        self.index
                    )));
                }
                self.done = true;
                Item::End {
                    records,
                    data_bytes: u64_at(8),
                }
            }
        };
        Ok(Some(item))
    }

    /// Reads the next `buf.len()` bytes of the data of the record [`Self::next_item`] gave.
    /// They are not checked until [`Self::end_record`].
    pub fn read_data(&mut self, buf: &mut [u8]) -> Result<(), ImageError> {
        let index = self.index;
        let open = self.open.as_mut().ok_or_else(|| ImageError::Malformed {
            index,
            reason: "data read outside a record".into(),
        })?;
        if buf.len() as u64 > open.left {
            return Err(ImageError::Malformed {
                index,
                reason: format!(
                    "{} bytes read from a {} record with {} left",
                    buf.len(),
                    open.kind,
                    open.left
                ),
            });
        }
        read_full(
            &mut self.input,
            buf,
            &format!("record {index} ({})", open.kind),
        )?;
        open.hash.update(buf);
        open.left -= buf.len() as u64;
        Ok(())
    }

    /// Finishes the record whose data was read: its checksum must match.
    pub fn end_record(&mut self) -> Result<(), ImageError> {
        let index = self.index;
        let open = self.open.take().ok_or_else(|| ImageError::Malformed {
            index,
            reason: "no record to end".into(),
        })?;
        if open.left != 0 {
            return Err(ImageError::Malformed {
                index,
                reason: format!(
                    "{} bytes of the {} record were not read",
                    open.left, open.kind
                ),
            });
        }
        let mut sum = [0u8; 8];
        read_full(
            &mut self.input,
            &mut sum,
            &format!("the checksum of record {index}"),
        )?;
        if open.hash.digest() != u64::from_le_bytes(sum) {
            return Err(ImageError::Checksum {
                index,
                kind: open.kind,
            });
        }
        self.index += 1;
        Ok(())
    }

    /// The next record, whole and checked, or `None` after the end marker. A stream that
    /// stops before its end marker is an error, as is any record whose checksum does not
    /// match.
    pub fn next_record(&mut self) -> Result<Option<Record>, ImageError> {
        let whole = |r: &mut Self, len: u64| -> Result<Vec<u8>, ImageError> {
            let mut data = vec![0u8; len as usize];
            r.read_data(&mut data)?;
            r.end_record()?;
            Ok(data)
        };
        Ok(Some(match self.next_item()? {
            None => return Ok(None),
            Some(Item::Tree(t)) => Record::Tree(t),
            Some(Item::Pages { pid, addr, len }) => Record::Pages {
                pid,
                addr,
                data: whole(self, len)?,
            },
            Some(Item::Object {
                object,
                offset,
                len,
            }) => Record::Object {
                object,
                offset,
                data: whole(self, len)?,
            },
            Some(Item::End {
                records,
                data_bytes,
            }) => Record::End {
                records,
                data_bytes,
            },
        }))
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

    /// Reads every record streamed, data in pieces of `piece` bytes.
    fn stream_all(bytes: &[u8], piece: usize) -> Result<Vec<(String, Vec<u8>)>, ImageError> {
        let mut r = ImageReader::new(bytes)?;
        let mut out = Vec::new();
        while let Some(item) = r.next_item()? {
            let len = match &item {
                Item::Pages { len, .. } | Item::Object { len, .. } => *len as usize,
                _ => {
                    out.push((format!("{item:?}"), Vec::new()));
                    continue;
                }
            };
            let mut data = Vec::new();
            let mut buf = vec![0u8; piece];
            while data.len() < len {
                let n = piece.min(len - data.len());
                r.read_data(&mut buf[..n])?;
                data.extend_from_slice(&buf[..n]);
            }
            r.end_record()?;
            out.push((format!("{item:?}"), data));
        }
        Ok(out)
    }

    #[test]
    fn streamed_reading_matches_whole_records() {
        let bytes = sample();
        let whole = read_all(&bytes).unwrap();
        let streamed = stream_all(&bytes, 1000).unwrap();
        assert_eq!(whole.len(), streamed.len());
        assert!(matches!(&whole[1], Record::Pages { data, .. } if *data == streamed[1].1));
        assert!(matches!(&whole[2], Record::Object { data, .. } if *data == streamed[2].1));
        for cut in 0..bytes.len() {
            assert!(stream_all(&bytes[..cut], 1000).is_err(), "cut at {cut}");
        }
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x40;
            assert!(stream_all(&bad, 4096).is_err(), "byte {i} flipped");
        }
        // Data left unread, or read past its record, is refused.
        let mut r = ImageReader::new(&bytes[..]).unwrap();
        assert!(matches!(r.next_item().unwrap(), Some(Item::Tree(_))));
        assert!(matches!(r.next_item().unwrap(), Some(Item::Pages { .. })));
        assert!(r.next_item().is_err());
        let mut r = ImageReader::new(&bytes[..]).unwrap();
        r.next_item().unwrap();
        r.next_item().unwrap();
        assert!(r.read_data(&mut [0u8; 8193]).is_err());
    }

    #[test]
    fn version_1_is_still_read() {
        let mut bytes = sample();
        bytes[8] = 1;
        let r = ImageReader::new(&bytes[..]).unwrap();
        assert_eq!(r.version(), 1);
        assert_eq!(read_all(&bytes).unwrap().len(), 4);
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
