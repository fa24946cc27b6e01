//! One module per kind of process state. Each holds both directions for its kind: `capture`
//! from a frozen process into the image model, and `restore` into a process being rebuilt.

pub mod aio;
pub mod anon_inodes;
pub mod asked;
pub mod cgroups;
pub mod devices;
pub mod files;
pub mod jobctl;
pub mod kmsg;
pub mod locks;
pub mod memory;
pub mod process;
pub mod removed;
pub mod seccomp;
pub mod signals;
pub mod sockets;
pub mod threads;
pub mod tty;
