//! Cancellation: a flag that a signal handler (or another thread) raises, checked by the
//! engine between steps. A cancelled checkpoint returns [`Error::Cancelled`], and dropping the
//! frozen tree lets every process go exactly as it was.

use crate::error::{Error, Result};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

static FLAG: OnceLock<Arc<AtomicBool>> = OnceLock::new();

/// The process-wide cancellation flag, for registering with a signal handler.
pub fn flag() -> Arc<AtomicBool> {
    FLAG.get_or_init(|| Arc::new(AtomicBool::new(false)))
        .clone()
}

/// Fails with [`Error::Cancelled`] once cancellation was requested.
pub fn check(during: &str) -> Result<()> {
    if FLAG.get().is_some_and(|f| f.load(Ordering::Relaxed)) {
        return Err(Error::Cancelled(format!("stopped while {during}")));
    }
    Ok(())
}
