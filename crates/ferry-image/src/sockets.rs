//! Image schema of sockets.

use serde::{Deserialize, Serialize};

/// A socket: its family, type, addresses, options, state and queued data.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct SocketDesc {}
