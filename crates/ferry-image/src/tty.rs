//! Image schema of terminal descriptors: the two sides of a pseudo-terminal (Unix 98 ptys).

use serde::{Deserialize, Serialize};

/// One side of pseudo-terminal `/dev/pts/<index>`. The pty's own state (termios, window size,
/// packet mode, controlling session ...) is held by its master description; a slave
/// description carries only the index.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct TtyDesc {
    pub index: u32,
    /// The master side (/dev/ptmx), else the slave (/dev/pts/<index>).
    pub master: bool,
    /// Set on a master description: the state of the pty.
    pub state: Option<PtyState>,
    /// A slave of a terminal at the tree's home (its master held outside the tree: sshd, a
    /// terminal emulator): the home terminal's termios and window size as captured. A
    /// migration rebuilds it as a pty of the same number whose master the daemons relay to
    /// the home terminal (see ARCHITECTURE.md, "Relays"); any other restore refuses it.
    #[serde(default)]
    pub relayed: Option<PtyState>,
}

/// Relay ids (`RelayOpen`) of terminals: this bit and the pts number. (Pipes use their
/// `Pipe::id`.)
pub const RELAY_TTY: u32 = 1 << 31;
/// Relay ids of UNIX sockets connected to a process at home: this bit and the socket's
/// `FileDesc::id`.
pub const RELAY_SOCKET: u32 = 1 << 30;

#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct PtyState {
    pub termios: Termios,
    /// Rows, columns, x pixels, y pixels.
    pub winsize: [u16; 4],
    pub packet_mode: bool,
    pub locked: bool,
    /// The session that has the pty as its controlling terminal (its leader's PID), or 0.
    pub session: i32,
    /// The foreground process group, or 0.
    pub fg_pgrp: i32,
    /// Input queued for the slave to read, in order.
    #[serde(with = "serde_bytes")]
    pub input: Vec<u8>,
    /// Output the slave wrote that the master has not read yet, as the master reads it (after
    /// the slave's output processing), in order.
    #[serde(default, with = "serde_bytes")]
    pub output: Vec<u8>,
    /// The slave's owner, group and mode (what grantpt, chown and chmod made them), when the
    /// slave was open to read them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slave_owner: Option<(u32, u32, u32)>,
}

/// `struct termios2`.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct Termios {
    pub iflag: u32,
    pub oflag: u32,
    pub cflag: u32,
    pub lflag: u32,
    pub line: u8,
    #[serde(with = "serde_bytes")]
    pub cc: Vec<u8>,
    pub ispeed: u32,
    pub ospeed: u32,
}
