//! Remote execution (`ferry run`): the caller's daemon relays, the chosen node runs the program
//! as if it ran at home.

use crate::node::Node;
use anyhow::Result;
use ferry_transport::message::RunSpec;
use ferry_transport::{write_msg, Conn, Msg};
use std::sync::Arc;
use tokio::net::UnixStream;

/// Home side: pick the node, connect, and relay between the CLI and the remote daemon.
pub async fn relay(_node: Arc<Node>, mut cli: UnixStream, _spec: RunSpec) -> Result<()> {
    write_msg(&mut cli, &Msg::error("ferry run is not implemented yet")).await?;
    Ok(())
}

/// Remote side: start the program and stream its I/O until it ends.
pub async fn serve(_node: Arc<Node>, mut conn: Conn, _spec: RunSpec) -> Result<()> {
    write_msg(
        &mut conn.stream,
        &Msg::error("ferry run is not implemented yet"),
    )
    .await?;
    Ok(())
}
