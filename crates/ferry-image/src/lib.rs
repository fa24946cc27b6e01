//! Ferry's checkpoint image: what a captured process tree is, and how it is laid out as a stream.
//!
//! The image is one byte stream (see `docs/image-format.md`): a fixed header, then records, each
//! framed with its kind, length and an XXH3 checksum, ending with an `End` record. The same
//! [`stream::ImageWriter`] writes to a file or a socket, and [`stream::ImageReader`] never seeks.
//! Metadata records hold CBOR-encoded [`model`] types; memory records hold raw page bytes.

#![forbid(unsafe_code)]

pub mod anon_inodes;
pub mod index;
pub mod model;
pub mod sockets;
pub mod stream;
pub mod tty;
pub mod validate;

pub use anon_inodes::*;
pub use model::*;
pub use sockets::*;
pub use stream::{ImageError, ImageReader, ImageWriter, Item, Record};
pub use tty::{PtyState, Termios, TtyDesc, RELAY_SOCKET, RELAY_TTY};
pub use validate::validate;

/// The 8 bytes every image starts with.
pub const MAGIC: [u8; 8] = *b"FERRYIMG";
/// The magic of a page stream (memory sent ahead of an image: pre-copy rounds).
pub const PAGES_MAGIC: [u8; 8] = *b"FERRYPGS";
/// Bumped whenever a change would make an older reader misread an image. Version 2 puts the
/// contents of shared objects before memory (version 1 put them after), so that a restore can
/// stream memory into processes whose shared mappings are already filled. Version 3 lets a
/// process take pages from an earlier transfer (`Process::inherited`), which an older reader
/// would leave zero. Version 4 lets a child take pages from its parent, copy-on-write
/// (`Process::cow`), which an older reader would also leave zero. Version 5 lets a record of
/// pages span adjacent mappings, which an older reader refuses only once it has made the
/// processes and is writing their memory (it wants each record inside one mapping).
pub const FORMAT_VERSION: u32 = 5;
/// The oldest version this Ferry still reads.
pub const OLDEST_READABLE_VERSION: u32 = 1;
/// The image file inside a checkpoint directory.
pub const IMAGE_FILE: &str = "image.ferry";
