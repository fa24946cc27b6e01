//! The engine's errors: each names the process, and where it applies the fd or mapping.

use ferry_image::ImageError;
use ferry_inject::InjectError;
use ferry_sys::SysError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("no process with PID {pid}")]
    NoSuchProcess { pid: i32 },
    #[error("PID {pid} is a kernel thread; only user processes can be checkpointed")]
    KernelThread { pid: i32 },
    #[error("PID {pid} is ferry itself (or its tree contains ferry, PID {ferry})")]
    IsFerry { pid: i32, ferry: i32 },
    #[error("PID {pid}: {what} cannot be checkpointed: {why}")]
    Unsupported { pid: i32, what: String, why: String },
    #[error("PID {pid}: {what}: {source}")]
    Sys {
        pid: i32,
        what: String,
        source: SysError,
    },
    #[error("PID {pid}: {what}: {source}")]
    Io {
        pid: i32,
        what: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Inject(#[from] InjectError),
    #[error("image")]
    Image(#[from] ImageError),
    #[error("image is inconsistent: {0}")]
    BadImage(String),
    #[error("PID {pid} is already in use on this machine ({by}); the image needs it free")]
    PidTaken { pid: i32, by: String },
    #[error("restore of PID {pid}: {what}")]
    Restore { pid: i32, what: String },
    #[error("cancelled: {0}")]
    Cancelled(String),
}

pub type Result<T> = std::result::Result<T, Error>;

/// Attaches "which process, doing what" to low-level errors.
pub trait Context<T> {
    fn ctx(self, pid: i32, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T> Context<T> for std::result::Result<T, SysError> {
    fn ctx(self, pid: i32, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|source| Error::Sys {
            pid,
            what: what(),
            source,
        })
    }
}

impl<T> Context<T> for std::result::Result<T, std::io::Error> {
    fn ctx(self, pid: i32, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|source| Error::Io {
            pid,
            what: what(),
            source,
        })
    }
}
