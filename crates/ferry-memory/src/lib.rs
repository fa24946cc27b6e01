//! Memory transfer: how a rebuilt process's memory reaches it after it runs again.
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

#![forbid(unsafe_code)]

pub mod ranges;
pub mod server;
pub mod source;

pub use server::{LazyServer, Options, Stats};
pub use source::{ImageSource, PageSource};
