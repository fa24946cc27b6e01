//! Ferry's engine: capture the complete state of a running tree of Linux processes, and
//! rebuild it, on an unmodified kernel, from user space. It knows nothing of networks: images
//! are written to and read from any byte stream.
//!
//! - [`freeze`] stops a tree in place (and lets it go unharmed if anything fails).
//! - [`checkpoint`] walks the frozen tree through every kind in [`resources`] and streams the
//!   image.
//! - [`pidview`] turns the PIDs the engine works with into those the tree sees (its own PID
//!   namespace), for the image.
//! - [`guest_ns`] makes the PID, time, mount and IPC namespaces a tree can be rebuilt in,
//!   under its own PIDs (pty numbers, System V IDs) whatever this machine's are.
//! - [`late`] makes system calls inside a rebuilt process just before it runs (what had to
//!   wait for the original of a migration to be gone: a lock, an abstract socket name).
//! - [`names`] moves the files of a tree's bound UNIX sockets aside while it migrates.
//! - [`leases`] lets go of a tree's write leases while it migrates (taken back if it fails).
//! - [`lazy`] hands a rebuilt tree's private anonymous memory to a page server that fills
//!   it as the tree runs (copy-on-reference).
//! - [`premaps`] reads a tree's mappings before its freeze, so that the freeze need not walk
//!   its page tables (/proc/PID/smaps).
//! - [`restore`] reads an image completely, checks it, and rebuilds the tree through
//!   [`husk`]s: processes created under their old PIDs and refilled from outside.

#![forbid(unsafe_code)]

pub mod cancel;
pub mod checkpoint;
pub mod digests;
pub mod error;
pub mod freeze;
pub mod guest_ns;
pub mod husk;
pub mod late;
pub mod lazy;
pub mod leases;
pub mod names;
pub mod objects;
pub mod owner;
pub mod pidview;
pub mod preflight;
pub mod premaps;
pub mod procfs;
mod procmake;
pub mod reopen;
pub mod resources;
pub mod restore;

pub use error::{Error, Result};
