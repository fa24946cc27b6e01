//! Opening connections between daemons: TCP, then mutual TLS with the cluster CA, then a
//! `Hello` naming the caller, which must match its certificate. Nothing else is read from a
//! connection before all three succeed.

use crate::credentials::{cert_node_name, Credentials, CLUSTER_SAN};
use crate::frame::{read_msg, write_msg};
use crate::message::Msg;
use anyhow::{anyhow, bail, Context, Result};
use rustls::pki_types::ServerName;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio_rustls::{TlsAcceptor, TlsConnector, TlsStream};

/// An authenticated, encrypted connection to another node.
pub struct Conn {
    pub stream: TlsStream<TcpStream>,
    /// The other node's name, as its certificate says.
    pub peer: String,
    pub peer_addr: SocketAddr,
}

/// How long a peer may take to connect and prove who it is.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

fn peer_name(certs: Option<&[rustls::pki_types::CertificateDer<'_>]>) -> Result<String> {
    let leaf = certs
        .and_then(|c| c.first())
        .ok_or_else(|| anyhow!("peer presented no certificate"))?;
    cert_node_name(leaf)
}

/// Dials the node listening at `addr`.
pub async fn connect(creds: &Credentials, addr: SocketAddr, timeout: Duration) -> Result<Conn> {
    let work = async {
        let tcp = TcpStream::connect(addr)
            .await
            .with_context(|| format!("connect to {addr}"))?;
        tcp.set_nodelay(true).ok();
        let name = ServerName::try_from(CLUSTER_SAN).expect("constant name is valid");
        let tls = TlsConnector::from(creds.client.clone())
            .connect(name, tcp)
            .await
            .with_context(|| format!("TLS handshake with {addr}"))?;
        let peer = peer_name(tls.get_ref().1.peer_certificates())
            .with_context(|| format!("identify the node at {addr}"))?;
        let mut stream = TlsStream::Client(tls);
        write_msg(
            &mut stream,
            &Msg::Hello {
                node: creds.node.clone(),
            },
        )
        .await
        .with_context(|| format!("greet {peer} at {addr}"))?;
        Ok(Conn {
            stream,
            peer,
            peer_addr: addr,
        })
    };
    tokio::time::timeout(timeout, work)
        .await
        .map_err(|_| anyhow!("no answer from {addr} within {timeout:?}"))?
}

/// Authenticates a connection a peer opened to us.
pub async fn accept(creds: &Credentials, tcp: TcpStream) -> Result<Conn> {
    let peer_addr = tcp.peer_addr().context("peer address")?;
    tcp.set_nodelay(true).ok();
    let work = async {
        let tls = TlsAcceptor::from(creds.server.clone())
            .accept(tcp)
            .await
            .context("TLS handshake")?;
        let peer = peer_name(tls.get_ref().1.peer_certificates())?;
        let mut stream = TlsStream::Server(tls);
        match read_msg(&mut stream).await? {
            Msg::Hello { node } if node == peer => {}
            Msg::Hello { node } => {
                bail!("peer says it is {node:?} but its certificate names {peer:?}")
            }
            other => bail!("expected Hello, got {}", crate::message::kind(&other)),
        }
        Ok(Conn {
            stream,
            peer,
            peer_addr,
        })
    };
    tokio::time::timeout(HANDSHAKE_TIMEOUT, work)
        .await
        .map_err(|_| anyhow!("{peer_addr} did not finish its handshake in time"))?
        .with_context(|| format!("refused connection from {peer_addr}"))
}
