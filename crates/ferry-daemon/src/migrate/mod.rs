//! Moving a live tree between nodes.
//!
//! Source (`send`): a capture worker checks the tree can move (before anything is frozen), the
//! destination is offered it and may refuse, then the worker freezes the tree and streams its
//! image, which this daemon forwards to the destination frame by frame. The destination
//! (`receive`) feeds the stream to a restore worker, which rebuilds the tree in namespaces of
//! its own and holds it stopped: `Rebuilt`. That message is the commit point: the source kills
//! its copy, says `Commit`, and the destination lets the tree run. Anything that fails before
//! the commit point thaws the original where it was.

mod receive;
mod send;
mod settle;

pub(crate) use receive::guest_running;
pub use receive::receive;
pub(crate) use send::home_ids;
pub use send::{moving_guest, send, REMOTE_EXEC};
pub use settle::{copy_state, recover};
// What each side uses of the others'.
use receive::*;
use settle::*;

use crate::node::Node;
use crate::outcomes::{Outcome, Outcomes};
use crate::state;
use crate::workers::Worker;
use anyhow::{anyhow, bail, Context, Result};
use ferry_transport::frame::LZ4;
use ferry_transport::message::{kind, MigrateOffer, MigrateReport, ProcInfo, Rebuilt, Stamp};
use ferry_transport::{
    read_frame, read_msg, tls, write_data, write_data_with, write_end, write_msg, Compressor, Conn,
    Frame, FrameError, Msg,
};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;

/// How long a destination waits for the source's decision after `Rebuilt`.
const COMMIT_TIMEOUT: Duration = Duration::from_secs(30);

fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The next message from a worker, skipping any stream data still in the pipe.
pub(crate) async fn worker_msg(worker: &mut Worker) -> Result<Msg> {
    loop {
        match worker.next_frame().await {
            Ok(Frame::Msg(m)) => return Ok(m),
            Ok(_) => continue,
            Err(FrameError::Closed) => bail!("the engine worker (PID {}) died", worker.pid),
            Err(e) => bail!("engine worker (PID {}): {e}", worker.pid),
        }
    }
}

async fn progress(cli: &mut UnixStream, phase: &str, bytes: u64) {
    let _ = write_msg(
        cli,
        &Msg::Progress {
            phase: phase.to_string(),
            bytes,
        },
    )
    .await;
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

/// This machine's kernel boot id (/proc/sys/kernel/random/boot_id; empty if unreadable).
pub(crate) fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .unwrap_or_default()
        .trim()
        .to_string()
}
