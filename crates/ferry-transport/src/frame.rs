//! Frames: how bytes on a connection are cut into messages.
//!
//! Every frame is `[length: u32 big-endian][kind: u8][payload: length bytes]`. A `Msg` frame
//! carries one CBOR-encoded [`Msg`]; a `Data` frame carries raw bytes of a stream (an image, a
//! program's output) without re-encoding; an `End` frame closes that stream. Anything else, or a
//! frame longer than [`MAX_FRAME`], is a malformed peer: the connection is dropped.
//!
//! Between two daemons that both said so (a migration's offer and its answer), a data frame
//! may go compressed instead (`Lz4` frames: LZ4 blocks, [`Compressor`]); [`read_frame`] gives it
//! back as the `Data` frame it was, so nothing past the connection knows.

use crate::message::Msg;
use std::io::IoSlice;
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The largest payload a peer may send in one frame.
pub const MAX_FRAME: usize = 4 << 20;
/// Data frames are cut to this size when a stream is forwarded.
pub const DATA_CHUNK: usize = 1 << 20;

const KIND_MSG: u8 = 1;
const KIND_DATA: u8 = 2;
const KIND_END: u8 = 3;
/// A data frame compressed: `[raw length: u32 big-endian][LZ4 block]`.
const KIND_DATA_LZ4: u8 = 4;

/// The name both ends of a migration give the compression of [`Compressor`].
pub const LZ4: &str = "lz4";

/// Compresses the data frames of a stream where that pays: a frame goes compressed only if
/// that saves at least an eighth of it, and after a frame that did not compress so, the next
/// [`Compressor::SKIP`] (of at least [`Compressor::MIN`] bytes) go as they are without trying (memory that does not compress, random
/// or already compressed, then costs little CPU).
#[derive(Debug, Default)]
pub struct Compressor {
    skip: u32,
    /// Bytes given to it, and bytes of the frames it made (headers included).
    pub raw_bytes: u64,
    pub wire_bytes: u64,
}

impl Compressor {
    pub const SKIP: u32 = 15;
    /// Smaller frames go as they are, and do not count as frames that did not compress.
    pub const MIN: usize = 4096;

    /// The frame (header and payload) that carries `data`.
    pub fn frame(&mut self, data: &[u8]) -> Result<Vec<u8>, FrameError> {
        self.raw_bytes += data.len() as u64;
        if data.len() < Self::MIN {
            // (Headers and such, between runs of memory: they tell nothing of the memory.)
        } else if self.skip == 0 {
            let mut out = vec![0u8; 9 + lz4_flex::block::get_maximum_output_size(data.len())];
            let n = lz4_flex::block::compress_into(data, &mut out[9..])
                .map_err(|e| FrameError::malformed(format!("compress a data frame: {e}")))?;
            if n + 4 <= data.len() - data.len() / 8 {
                out.truncate(9 + n);
                out[..5].copy_from_slice(&header(KIND_DATA_LZ4, n + 4)?);
                out[5..9].copy_from_slice(&(data.len() as u32).to_be_bytes());
                self.wire_bytes += out.len() as u64;
                return Ok(out);
            }
            self.skip = Self::SKIP;
        } else {
            self.skip = self.skip.saturating_sub(1);
        }
        let mut out = Vec::with_capacity(5 + data.len());
        out.extend_from_slice(&header(KIND_DATA, data.len())?);
        out.extend_from_slice(data);
        self.wire_bytes += out.len() as u64;
        Ok(out)
    }
}

#[derive(Debug)]
pub enum Frame {
    Msg(Msg),
    Data(Vec<u8>),
    End,
}

#[derive(Debug, Error)]
pub enum FrameError {
    #[error("connection closed")]
    Closed,
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("malformed frame: {0}")]
    Malformed(String),
}

impl FrameError {
    pub fn malformed(what: impl Into<String>) -> Self {
        FrameError::Malformed(what.into())
    }
}

/// Reads the next frame; `Closed` at a clean end of the connection between frames.
pub async fn read_frame<R: AsyncRead + Unpin>(r: &mut R) -> Result<Frame, FrameError> {
    let mut head = [0u8; 5];
    match r.read_exact(&mut head).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Err(FrameError::Closed),
        Err(e) => return Err(e.into()),
    }
    let len = u32::from_be_bytes([head[0], head[1], head[2], head[3]]) as usize;
    if len > MAX_FRAME {
        return Err(FrameError::malformed(format!(
            "frame of {len} bytes (limit {MAX_FRAME})"
        )));
    }
    if head[4] == KIND_MSG && len >= IO_DIRECT_MIN {
        // A program's output or input (`Io`): its bytes are read straight into the buffer the
        // message keeps, rather than decoded out of the payload into another.
        let mut start = [0u8; IO_PREFIX_MAX];
        r.read_exact(&mut start).await.map_err(|e| inside(e, len))?;
        if let Some((stream, p)) = io_prefix_of(&start, len) {
            let mut data = Vec::with_capacity(len - p);
            data.extend_from_slice(&start[p..]);
            read_rest(r, &mut data, len - p).await?;
            return Ok(Frame::Msg(Msg::Io {
                stream,
                data: serde_bytes::ByteBuf::from(data),
            }));
        }
        let mut payload = Vec::with_capacity(len);
        payload.extend_from_slice(&start);
        read_rest(r, &mut payload, len).await?;
        return decode(head[4], payload);
    }
    // Read into spare capacity: no zeroing of each (up to 4 MiB) payload first.
    let mut payload = Vec::with_capacity(len);
    read_rest(r, &mut payload, len).await?;
    decode(head[4], payload)
}

/// Reads into `buf` until it holds `len` bytes.
async fn read_rest<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut Vec<u8>,
    len: usize,
) -> Result<(), FrameError> {
    while buf.len() < len {
        let want = (len - buf.len()) as u64;
        if (&mut *r).take(want).read_buf(buf).await? == 0 {
            return Err(FrameError::malformed(format!(
                "connection closed inside a frame of {len} bytes"
            )));
        }
    }
    Ok(())
}

fn inside(e: std::io::Error, len: usize) -> FrameError {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        FrameError::malformed(format!("connection closed inside a frame of {len} bytes"))
    } else {
        e.into()
    }
}

/// `Io` frames at least this long are read and written without a copy of their bytes.
const IO_DIRECT_MIN: usize = 4096;
/// The longest CBOR of `Msg::Io` before its bytes: `{"Io": {"stream": S, "data": <bytes>}}`,
/// with S up to 255 and a length up to 2^32 - 1.
const IO_PREFIX_MAX: usize = 24;

/// The CBOR that starts `Msg::Io { stream, data }` when `data` is `len` bytes long, exactly as
/// the general encoder writes it (map of one: "Io" to a map of two, "stream" then "data").
fn io_prefix(stream: u8, len: usize) -> ([u8; IO_PREFIX_MAX], usize) {
    let mut p = [0u8; IO_PREFIX_MAX];
    let head = b"\xa1\x62Io\xa2\x66stream";
    p[..head.len()].copy_from_slice(head);
    let mut n = head.len();
    if stream < 24 {
        p[n] = stream;
        n += 1;
    } else {
        p[n..n + 2].copy_from_slice(&[0x18, stream]);
        n += 2;
    }
    p[n..n + 5].copy_from_slice(b"\x64data");
    n += 5;
    if len < 24 {
        p[n] = 0x40 | len as u8;
        n += 1;
    } else if len < 1 << 8 {
        p[n..n + 2].copy_from_slice(&[0x58, len as u8]);
        n += 2;
    } else if len < 1 << 16 {
        p[n] = 0x59;
        p[n + 1..n + 3].copy_from_slice(&(len as u16).to_be_bytes());
        n += 3;
    } else {
        p[n] = 0x5a;
        p[n + 1..n + 5].copy_from_slice(&(len as u32).to_be_bytes());
        n += 5;
    }
    (p, n)
}

/// If a message payload of `len` bytes that starts with `start` is an `Io` message in the form
/// [`io_prefix`] writes, its stream and where its bytes start.
fn io_prefix_of(start: &[u8; IO_PREFIX_MAX], len: usize) -> Option<(u8, usize)> {
    let stream = match start[12] {
        s @ 0..=23 => s,
        0x18 => start[13],
        _ => return None,
    };
    // Whatever the length's form, the payload must be exactly the prefix and the bytes.
    (0..4).find_map(|form| {
        let p = 12 + usize::from(stream >= 24) + 5 + [1, 2, 3, 5][form];
        let data = len.checked_sub(p)?;
        let (want, n) = io_prefix(stream, data);
        (n == p && want[..n] == start[..n]).then_some((stream, p))
    })
}

/// Writes `Msg::Io { stream, data }`, the same frame [`write_msg`] would write, without
/// copying a large `data` into an encoded message first. Flushed.
pub async fn write_io<W: AsyncWrite + Unpin>(
    w: &mut W,
    stream: u8,
    data: &[u8],
) -> Result<(), FrameError> {
    let (prefix, n) = io_prefix(stream, data.len());
    let head = header(KIND_MSG, n + data.len())?;
    if data.len() < IO_DIRECT_MIN {
        let mut frame = Vec::with_capacity(5 + n + data.len());
        frame.extend_from_slice(&head);
        frame.extend_from_slice(&prefix[..n]);
        frame.extend_from_slice(data);
        w.write_all(&frame).await?;
    } else {
        let mut start = [0u8; 5 + IO_PREFIX_MAX];
        start[..5].copy_from_slice(&head);
        start[5..5 + n].copy_from_slice(&prefix[..n]);
        // Header and bytes in one vectored write: one system call on a socket, and over TLS
        // the header shares the bytes' first record rather than making one of its own.
        let start = &start[..5 + n];
        let mut done = 0;
        while done < start.len() + data.len() {
            let wrote = if done < start.len() {
                let bufs = [IoSlice::new(&start[done..]), IoSlice::new(data)];
                w.write_vectored(&bufs).await?
            } else {
                w.write(&data[done - start.len()..]).await?
            };
            if wrote == 0 {
                return Err(std::io::Error::from(std::io::ErrorKind::WriteZero).into());
            }
            done += wrote;
        }
    }
    w.flush().await?;
    Ok(())
}

async fn write_raw<W: AsyncWrite + Unpin>(
    w: &mut W,
    kind: u8,
    payload: &[u8],
) -> Result<(), FrameError> {
    w.write_all(&header(kind, payload.len())?).await?;
    w.write_all(payload).await?;
    Ok(())
}

pub async fn write_msg<W: AsyncWrite + Unpin>(w: &mut W, msg: &Msg) -> Result<(), FrameError> {
    let frame = encode_msg(msg)?;
    w.write_all(&frame).await?;
    w.flush().await?;
    Ok(())
}

/// A whole `Msg` frame, header and payload in one buffer: one write, hence one TLS record
/// (or one socket write) per message rather than two.
fn encode_msg(msg: &Msg) -> Result<Vec<u8>, FrameError> {
    let mut buf = vec![0u8; 5];
    ciborium::into_writer(msg, &mut buf)
        .map_err(|e| FrameError::malformed(format!("encode {msg:?}: {e}")))?;
    let head = header(KIND_MSG, buf.len() - 5)?;
    buf[..5].copy_from_slice(&head);
    Ok(buf)
}

/// Writes stream bytes, cut into frames of at most [`DATA_CHUNK`]. Not flushed: callers stream.
pub async fn write_data<W: AsyncWrite + Unpin>(w: &mut W, data: &[u8]) -> Result<(), FrameError> {
    for chunk in data.chunks(DATA_CHUNK) {
        write_raw(w, KIND_DATA, chunk).await?;
    }
    Ok(())
}

/// Writes one message of a relay that keeps them whole (a datagram): one `Data` frame of
/// exactly `data`, however short (empty too) or long (up to [`MAX_FRAME`]). Not flushed.
pub async fn write_record<W: AsyncWrite + Unpin>(w: &mut W, data: &[u8]) -> Result<(), FrameError> {
    write_raw(w, KIND_DATA, data).await
}

/// Like [`write_data`], each frame compressed by `c` where that pays (only to a peer that said
/// it reads compressed frames).
pub async fn write_data_with<W: AsyncWrite + Unpin>(
    w: &mut W,
    c: &mut Compressor,
    data: &[u8],
) -> Result<(), FrameError> {
    for chunk in data.chunks(DATA_CHUNK) {
        w.write_all(&c.frame(chunk)?).await?;
    }
    Ok(())
}

pub async fn write_end<W: AsyncWrite + Unpin>(w: &mut W) -> Result<(), FrameError> {
    write_raw(w, KIND_END, &[]).await?;
    w.flush().await?;
    Ok(())
}

/// Reads frames until a `Msg` arrives; stream frames at this point are a protocol error.
pub async fn read_msg<R: AsyncRead + Unpin>(r: &mut R) -> Result<Msg, FrameError> {
    match read_frame(r).await? {
        Frame::Msg(m) => Ok(m),
        Frame::Data(d) => Err(FrameError::malformed(format!(
            "{} bytes of stream data where a message was expected",
            d.len()
        ))),
        Frame::End => Err(FrameError::malformed(
            "end of stream where a message was expected",
        )),
    }
}

/// The same frames over blocking streams, for engine workers (single-threaded processes that talk
/// to their daemon through pipes).
pub mod blocking {
    use super::*;
    use std::io::{Read, Write};

    pub fn read_frame<R: Read>(r: &mut R) -> Result<Frame, FrameError> {
        let mut head = [0u8; 5];
        match r.read_exact(&mut head) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return Err(FrameError::Closed)
            }
            Err(e) => return Err(e.into()),
        }
        let len = u32::from_be_bytes([head[0], head[1], head[2], head[3]]) as usize;
        if len > MAX_FRAME {
            return Err(FrameError::malformed(format!(
                "frame of {len} bytes (limit {MAX_FRAME})"
            )));
        }
        let mut payload = vec![0u8; len];
        r.read_exact(&mut payload)?;
        decode(head[4], payload)
    }

    pub fn write_msg<W: Write>(w: &mut W, msg: &Msg) -> Result<(), FrameError> {
        w.write_all(&encode_msg(msg)?)?;
        w.flush()?;
        Ok(())
    }

    pub fn write_data<W: Write>(w: &mut W, data: &[u8]) -> Result<(), FrameError> {
        for chunk in data.chunks(DATA_CHUNK) {
            w.write_all(&header(KIND_DATA, chunk.len())?)?;
            w.write_all(chunk)?;
        }
        Ok(())
    }

    pub fn write_end<W: Write>(w: &mut W) -> Result<(), FrameError> {
        w.write_all(&header(KIND_END, 0)?)?;
        w.flush()?;
        Ok(())
    }

    /// A `Write` that sends everything written to it as data frames: the engine writes its
    /// image into this, and never knows it goes to a pipe or a socket.
    pub struct DataWriter<W: Write>(pub W);

    impl<W: Write> Write for DataWriter<W> {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let n = buf.len().min(DATA_CHUNK);
            write_data(&mut self.0, &buf[..n]).map_err(std::io::Error::other)?;
            Ok(n)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            self.0.flush()
        }
    }

    /// A `Read` over the data frames of a stream, up to its `End` frame. A message frame in
    /// the middle, or the connection closing before `End`, is an error.
    ///
    /// Payloads are read straight from the connection into the caller's buffer: no frame is
    /// allocated or copied on the way (an image crosses this reader in the restore worker).
    pub struct DataReader<R: Read> {
        inner: R,
        /// Bytes of the current data frame not read yet.
        left: usize,
        done: bool,
    }

    impl<R: Read> DataReader<R> {
        pub fn new(inner: R) -> Self {
            DataReader {
                inner,
                left: 0,
                done: false,
            }
        }
        /// Reads on to the stream's `End` frame (a consumer such as the image reader stops at
        /// its own end marker, before it) and returns the connection. Stream bytes left over
        /// are an error: the two ends disagree about the stream.
        pub fn finish(mut self) -> std::io::Result<R> {
            let mut rest = [0u8; 64];
            match self.read(&mut rest)? {
                0 => Ok(self.inner),
                n => Err(std::io::Error::other(format!(
                    "{n} or more unexpected bytes after the end of the stream"
                ))),
            }
        }

        /// Reads frame headers until a data frame with bytes in it (or `End`).
        fn next_frame(&mut self) -> std::io::Result<()> {
            let closed = || {
                std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "stream closed before its end",
                )
            };
            while self.left == 0 && !self.done {
                let mut head = [0u8; 5];
                self.inner.read_exact(&mut head).map_err(|e| {
                    if e.kind() == std::io::ErrorKind::UnexpectedEof {
                        closed()
                    } else {
                        e
                    }
                })?;
                let len = u32::from_be_bytes([head[0], head[1], head[2], head[3]]) as usize;
                if len > MAX_FRAME {
                    return Err(std::io::Error::other(format!(
                        "malformed frame: frame of {len} bytes (limit {MAX_FRAME})"
                    )));
                }
                match head[4] {
                    KIND_DATA => self.left = len,
                    KIND_END if len == 0 => self.done = true,
                    kind => {
                        let mut payload = vec![0u8; len];
                        self.inner.read_exact(&mut payload).map_err(|_| closed())?;
                        return Err(std::io::Error::other(match decode(kind, payload) {
                            Ok(Frame::Msg(m)) => format!(
                                "stream interrupted by a {} message",
                                crate::message::kind(&m)
                            ),
                            Ok(_) => "stream interrupted".to_string(),
                            Err(e) => e.to_string(),
                        }));
                    }
                }
            }
            Ok(())
        }
    }

    impl<R: Read> Read for DataReader<R> {
        fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
            if out.is_empty() {
                return Ok(0);
            }
            self.next_frame()?;
            if self.done {
                return Ok(0);
            }
            let want = out.len().min(self.left);
            let n = self.inner.read(&mut out[..want])?;
            if n == 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "stream closed inside a frame",
                ));
            }
            self.left -= n;
            Ok(n)
        }
    }
}

fn header(kind: u8, len: usize) -> Result<[u8; 5], FrameError> {
    if len > MAX_FRAME {
        return Err(FrameError::malformed(format!(
            "refusing to send a frame of {len} bytes"
        )));
    }
    let mut head = [0u8; 5];
    head[..4].copy_from_slice(&(len as u32).to_be_bytes());
    head[4] = kind;
    Ok(head)
}

fn decode(kind: u8, payload: Vec<u8>) -> Result<Frame, FrameError> {
    let len = payload.len();
    match kind {
        KIND_MSG => ciborium::from_reader(payload.as_slice())
            .map(Frame::Msg)
            .map_err(|e| FrameError::malformed(format!("undecodable message: {e}"))),
        KIND_DATA => Ok(Frame::Data(payload)),
        KIND_DATA_LZ4 => {
            let (raw, block) = payload
                .split_first_chunk::<4>()
                .ok_or_else(|| FrameError::malformed("compressed frame without its length"))?;
            let raw = u32::from_be_bytes(*raw) as usize;
            if raw > MAX_FRAME {
                return Err(FrameError::malformed(format!(
                    "compressed frame of {raw} bytes (limit {MAX_FRAME})"
                )));
            }
            let mut out = vec![0u8; raw];
            match lz4_flex::block::decompress_into(block, &mut out) {
                Ok(n) if n == raw => Ok(Frame::Data(out)),
                Ok(n) => Err(FrameError::malformed(format!(
                    "compressed frame of {n} bytes, {raw} announced"
                ))),
                Err(e) => Err(FrameError::malformed(format!(
                    "undecodable compressed frame: {e}"
                ))),
            }
        }
        KIND_END if len == 0 => Ok(Frame::End),
        kind => Err(FrameError::malformed(format!(
            "unknown frame kind {kind} ({len} bytes)"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn round_trip_and_rejects() {
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        write_msg(&mut a, &Msg::Commit).await.unwrap();
        write_data(&mut a, b"hello").await.unwrap();
        write_end(&mut a).await.unwrap();
        assert!(matches!(
            read_frame(&mut b).await.unwrap(),
            Frame::Msg(Msg::Commit)
        ));
        assert!(matches!(read_frame(&mut b).await.unwrap(), Frame::Data(d) if d == b"hello"));
        assert!(matches!(read_frame(&mut b).await.unwrap(), Frame::End));

        // Too long, unknown kind, garbage CBOR, truncated: all malformed, none panics.
        for bad in [
            vec![0xff, 0xff, 0xff, 0xff, 1],
            vec![0, 0, 0, 0, 9],
            vec![0, 0, 0, 2, 1, 0xff, 0xff],
            vec![0, 0, 0, 9, 2, 1],
        ] {
            let (mut a, mut b) = tokio::io::duplex(1 << 16);
            a.write_all(&bad).await.unwrap();
            drop(a);
            let got = read_frame(&mut b).await;
            assert!(
                matches!(got, Err(FrameError::Malformed(_))),
                "{bad:?}: {got:?}"
            );
        }
        let (a, mut b) = tokio::io::duplex(16);
        drop(a);
        assert!(matches!(read_frame(&mut b).await, Err(FrameError::Closed)));
    }

    /// `write_io` writes the very frame `write_msg` would, and `read_frame` reads it (and the
    /// general encoder's) back whole, whatever the length's form and the stream's.
    #[tokio::test]
    async fn io_frames_written_and_read_without_copies() {
        for stream in [0u8, 1, 2, 23, 24, 255] {
            for len in [
                0usize,
                5,
                23,
                24,
                255,
                256,
                4095,
                4096,
                65535,
                65536,
                1 << 20,
            ] {
                let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
                let msg = Msg::Io {
                    stream,
                    data: serde_bytes::ByteBuf::from(data.clone()),
                };
                let general = encode_msg(&msg).unwrap();
                let mut direct = Vec::new();
                write_io(&mut direct, stream, &data).await.unwrap();
                assert_eq!(direct, general, "stream {stream}, {len} bytes");
                let mut wire = general.as_slice();
                match read_frame(&mut wire).await.unwrap() {
                    Frame::Msg(Msg::Io { stream: s, data: d }) => {
                        assert_eq!((s, d.as_slice()), (stream, data.as_slice()))
                    }
                    other => panic!("stream {stream}, {len} bytes: read back {other:?}"),
                }
                assert!(wire.is_empty());
            }
        }
        // Other messages as long still go through the general decoder; an `Io` cut short is
        // malformed.
        let long = Msg::error("x".repeat(10_000));
        let wire = encode_msg(&long).unwrap();
        assert!(matches!(
            read_frame(&mut wire.as_slice()).await.unwrap(),
            Frame::Msg(Msg::Error { message }) if message.len() == 10_000
        ));
        let mut cut = Vec::new();
        write_io(&mut cut, 1, &[7u8; 10_000]).await.unwrap();
        cut.truncate(cut.len() - 1);
        assert!(matches!(
            read_frame(&mut cut.as_slice()).await,
            Err(FrameError::Malformed(_))
        ));
    }

    #[test]
    fn data_reader_reads_a_stream_and_rejects_interruptions() {
        use std::io::Read;
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        let mut wire = Vec::new();
        blocking::write_data(&mut wire, &data).unwrap();
        blocking::write_data(&mut wire, &[]).unwrap();
        blocking::write_end(&mut wire).unwrap();
        blocking::write_msg(&mut wire, &Msg::Commit).unwrap();
        let mut r = blocking::DataReader::new(wire.as_slice());
        let mut got = Vec::new();
        let mut chunk = vec![0u8; 777_777];
        loop {
            let n = r.read(&mut chunk).unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&chunk[..n]);
        }
        assert_eq!(got, data);
        let mut rest = r.finish().unwrap();
        assert!(matches!(
            blocking::read_frame(&mut rest).unwrap(),
            Frame::Msg(Msg::Commit)
        ));

        // A message inside the stream, a stream cut short (inside a frame, between frames),
        // an oversized frame.
        let mut interrupted = Vec::new();
        blocking::write_data(&mut interrupted, b"abc").unwrap();
        blocking::write_msg(&mut interrupted, &Msg::Commit).unwrap();
        let mut cut = Vec::new();
        blocking::write_data(&mut cut, b"abcdef").unwrap();
        let between = cut.clone();
        cut.truncate(cut.len() - 2);
        for (wire, want) in [
            (interrupted, "Commit"),
            (cut, "inside a frame"),
            (between, "before its end"),
            (vec![0xff, 0xff, 0xff, 0xff, 2], "limit"),
        ] {
            let mut r = blocking::DataReader::new(wire.as_slice());
            let mut all = Vec::new();
            let e = r.read_to_end(&mut all).unwrap_err();
            assert!(e.to_string().contains(want), "{e}");
        }
    }

    #[tokio::test]
    async fn compressed_frames_come_back_as_they_were() {
        let (mut a, mut b) = tokio::io::duplex(8 << 20);
        let text: Vec<u8> = b"all work and no play ".repeat(50_000);
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let random: Vec<u8> = (0..(1 << 20))
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let mut c = Compressor::default();
        write_data_with(&mut a, &mut c, &text).await.unwrap();
        write_data_with(&mut a, &mut c, &random).await.unwrap();
        let mut got = Vec::new();
        while got.len() < text.len() + random.len() {
            match read_frame(&mut b).await.unwrap() {
                Frame::Data(d) => got.extend_from_slice(&d),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(&got[..text.len()], &text[..]);
        assert_eq!(&got[text.len()..], &random[..]);
        // The text went compressed, the random bytes as they were.
        assert!(c.wire_bytes < (text.len() / 4 + random.len() + (2 << 10)) as u64);
        assert!(c.wire_bytes > random.len() as u64);
        assert_eq!(c.skip, Compressor::SKIP);
        // A small frame (a header between runs of memory) goes as it is, and does not stop the
        // next from being compressed.
        let mut c = Compressor::default();
        assert_eq!(c.frame(&random[..100]).unwrap()[4], KIND_DATA);
        assert_eq!(c.frame(&text[..65536]).unwrap()[4], KIND_DATA_LZ4);
        // A compressed frame that lies about its length, or is not LZ4, is refused.
        let mut bad = Compressor::default().frame(&text[..4096]).unwrap();
        assert_eq!(bad[4], KIND_DATA_LZ4);
        bad[8] ^= 1;
        a.write_all(&bad).await.unwrap();
        assert!(read_frame(&mut b).await.is_err());
    }
}
