//! How Ferry nodes talk. Daemons speak mutual TLS to each other ([`tls`]), authenticated by the
//! cluster CA ([`credentials`]); everything on a connection, between daemons or between the CLI
//! and its daemon, is a sequence of [`frame`]s carrying [`message`]s or raw stream bytes. The
//! engine's image stream crosses as data frames: no temporary files anywhere.

#![forbid(unsafe_code)]

pub mod credentials;
pub mod frame;
pub mod message;
pub mod revocation;
pub mod tls;

pub use credentials::{ClusterCa, CredentialPaths, Credentials};
pub use frame::{
    read_frame, read_msg, write_data, write_data_with, write_end, write_io, write_msg, Compressor,
    Frame, FrameError,
};
pub use message::Msg;
pub use revocation::RevocationList;
pub use tls::Conn;
