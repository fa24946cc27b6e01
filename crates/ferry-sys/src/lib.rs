//! Every raw kernel call Ferry makes lives in this crate, one file per kernel interface.
//!
//! The rest of the workspace is `#![forbid(unsafe_code)]`; here every `unsafe` block carries a
//! `SAFETY:` comment. Wrappers return [`SysResult`], whose error names the operation and the errno.

pub mod anon_fds;
pub mod clone3;
pub mod fdops;
pub mod fsid;
pub mod guest_spawn;
pub mod mounts;
pub mod ns;
pub mod owner;
pub mod pagemap;
pub mod perf;
pub mod pidfd;
pub mod proc_mem;
pub mod process;
pub mod ptrace;
pub mod regs;
pub mod sched;
pub mod seccomp;
pub mod sockets;
pub mod spawn;
pub mod spawner;
pub mod tty;
pub mod uffd;
pub mod wait;

use std::fmt;

/// A failed system call: which operation, on what, and the errno it returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SysError {
    pub op: &'static str,
    pub errno: i32,
}

impl SysError {
    pub fn last(op: &'static str) -> Self {
        SysError {
            op,
            errno: std::io::Error::last_os_error().raw_os_error().unwrap_or(0),
        }
    }
    pub fn new(op: &'static str, errno: i32) -> Self {
        SysError { op, errno }
    }
    pub fn io(&self) -> std::io::Error {
        std::io::Error::from_raw_os_error(self.errno)
    }
}

impl fmt::Display for SysError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.op, self.io())
    }
}

impl std::error::Error for SysError {}

pub type SysResult<T> = Result<T, SysError>;

/// Turns a libc-style return value (-1 and errno on failure) into a result.
pub(crate) fn check(op: &'static str, ret: libc::c_long) -> SysResult<libc::c_long> {
    if ret < 0 {
        Err(SysError::last(op))
    } else {
        Ok(ret)
    }
}

pub const PAGE_SIZE: u64 = 4096;
