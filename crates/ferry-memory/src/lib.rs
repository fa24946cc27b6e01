//! Memory transfer: how a process's memory moves apart from the rest of its state.
//!
//! Accent's copy-on-reference, on today's Linux: the engine ([`ferry_engine::lazy`]) hands
//! over one userfaultfd per rebuilt process, every private anonymous mapping registered for
//! missing pages; a [`server::LazyServer`] answers each fault with the page and a few of its
//! neighbours ([`server::Options::prefetch`]) from a [`source::PageSource`] (an image file
//! here; the migration's source node in a migration), while a background push copies every
//! page still owed, so that the dependency on the source ends in bounded time. Forks, mremap,
//! munmap and madvise(DONTNEED) during that time are followed through the userfaultfd's
//! events ([`ranges::RangeMap`] keeps, per address space, where each range's data comes
//! from).
//!
//! V's pre-copy: [`dirty`] tells which pages a running process wrote since we last looked
//! (userfaultfd write protection in async mode, read back with PAGEMAP_SCAN; this kernel has
//! no soft-dirty bits); [`precopy`] copies memory while the tree runs, then what it dirtied,
//! round after round, until the dirty set stops shrinking; [`cache`] is the receiving side's
//! store of pages that arrived before the image naming them; [`pageset`] holds sets of page
//! ranges.

#![forbid(unsafe_code)]

pub mod cache;
pub mod dirty;
pub mod guard;
pub mod pageset;
pub mod precopy;
pub mod ranges;
pub mod server;
pub mod source;

pub use pageset::RangeSet;
pub use server::{LazyServer, Options, Stats};
pub use source::{ImageSource, PageSource};

/// What dirty tracking and pre-copy fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("PID {pid}: {what}: {source}")]
    Sys {
        pid: i32,
        what: String,
        source: ferry_sys::SysError,
    },
    #[error("PID {pid}: {what}: {source}")]
    Inject {
        pid: i32,
        what: String,
        source: ferry_inject::InjectError,
    },
    #[error("PID {pid}: {what}: {source}")]
    Io {
        pid: i32,
        what: String,
        source: std::io::Error,
    },
    #[error("{0}")]
    Image(#[from] ferry_image::stream::ImageError),
    #[error("{0}")]
    Other(String),
}

pub type Result<T> = std::result::Result<T, Error>;

pub const PAGE: u64 = ferry_sys::PAGE_SIZE;

/// Whether `bytes` are all zero.
pub fn is_zero(bytes: &[u8]) -> bool {
    let words = bytes.chunks_exact(8);
    let tail = words.remainder();
    tail.iter().all(|b| *b == 0)
        && words
            .into_iter()
            .all(|w| u64::from_ne_bytes(w.try_into().expect("8 bytes")) == 0)
}
