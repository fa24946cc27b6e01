//! Opening connections between daemons: TCP, then mutual TLS with the cluster CA, then a
//! `Hello` naming the caller, which must match its certificate. Nothing else is read from a
//! connection before all three succeed. Both ends check the other's certificate: the acceptor
//! that it names the caller's `Hello`, the dialler that it names the node it meant to reach;
//! and neither takes a revoked certificate.

use crate::credentials::{cert_node_name, Credentials, CLUSTER_SAN};
use crate::frame::{read_msg, write_msg};
use crate::message::Msg;
use crate::revocation::{fingerprint, ConnGuard};
use anyhow::{anyhow, bail, Context, Result};
use rustls::pki_types::ServerName;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::io::BufReader;
use tokio::net::{TcpSocket, TcpStream};
use tokio_rustls::{TlsAcceptor, TlsConnector, TlsStream};

/// The socket under TLS, read ahead: rustls reads its records in pieces of about 4 KiB, a
/// system call each, where one read of the buffer takes what the socket holds.
pub type Tcp = BufReader<TcpStream>;
/// How much is read ahead of rustls.
const READ_AHEAD: usize = 64 << 10;

/// An authenticated, encrypted connection to another node.
pub struct Conn {
    pub stream: TlsStream<Tcp>,
    /// The other node's name, as its certificate says.
    pub peer: String,
    pub peer_addr: SocketAddr,
    /// Keeps the connection listed for revocation; unlisted when dropped.
    pub guard: ConnGuard,
}

/// How long a peer may take to connect and prove who it is. Short: a connection waiting for
/// its handshake holds a descriptor and a slot of the few the daemon allows
/// (docs/security.md).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// The node name and the fingerprint of the certificate a peer presented.
fn peer_identity(
    certs: Option<&[rustls::pki_types::CertificateDer<'_>]>,
) -> Result<(String, String)> {
    let leaf = certs
        .and_then(|c| c.first())
        .ok_or_else(|| anyhow!("peer presented no certificate"))?;
    Ok((cert_node_name(leaf)?, fingerprint(leaf)))
}

/// A second handle on the socket, for shutting it down when its certificate is revoked.
fn split_handle(tcp: TcpStream) -> Result<(TcpStream, std::net::TcpStream)> {
    let std = tcp.into_std().context("take the socket")?;
    let other = std.try_clone().context("duplicate the socket")?;
    Ok((
        TcpStream::from_std(std).context("give the socket back")?,
        other,
    ))
}

async fn dial(creds: &Credentials, addr: SocketAddr) -> std::io::Result<TcpStream> {
    let Some(ip) = creds.local_ip.filter(|ip| !ip.is_unspecified()) else {
        return TcpStream::connect(addr).await;
    };
    if ip.is_ipv4() != addr.is_ipv4() {
        return TcpStream::connect(addr).await;
    }
    let sock = if ip.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    // The port is any free one; SO_REUSEADDR lets a listener (ours or another daemon's, which
    // set it too) later bind that port on this address while the connection lives.
    sock.set_reuseaddr(true)?;
    sock.bind(SocketAddr::new(ip, 0))?;
    sock.connect(addr).await
}

/// Dials node `expect`, listening at `addr`. The server's certificate must be of the cluster
/// and name `expect`: whoever else answers there is refused before anything is sent. `None`
/// only for a seed known by its address alone, to which a node sends nothing but its own
/// announcement.
pub async fn connect(
    creds: &Credentials,
    expect: Option<&str>,
    addr: SocketAddr,
    timeout: Duration,
) -> Result<Conn> {
    let work = async {
        let tcp = dial(creds, addr)
            .await
            .with_context(|| format!("connect to {addr}"))?;
        tcp.set_nodelay(true).ok();
        let (tcp, handle) = split_handle(tcp)?;
        let tcp = BufReader::with_capacity(READ_AHEAD, tcp);
        let name = ServerName::try_from(CLUSTER_SAN).expect("constant name is valid");
        let tls = TlsConnector::from(creds.client.clone())
            .connect(name, tcp)
            .await
            .with_context(|| format!("TLS handshake with {addr}"))?;
        let (peer, fp) = peer_identity(tls.get_ref().1.peer_certificates())
            .with_context(|| format!("identify the node at {addr}"))?;
        if let Some(expect) = expect.filter(|e| *e != peer) {
            bail!("the node at {addr} presents the certificate of {peer:?}, not of {expect:?}");
        }
        let guard = creds.registry.register(fp, &peer, addr, handle)?;
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
            guard,
        })
    };
    tokio::time::timeout(timeout, work)
        .await
        .map_err(|_| anyhow!("no answer from {addr} within {timeout:?}"))?
}

/// Authenticates a connection a peer opened to us: the TLS handshake (a certificate of the
/// cluster, not revoked), then its `Hello`, which must name the node its certificate names.
pub async fn accept(creds: &Credentials, tcp: TcpStream) -> Result<Conn> {
    let peer_addr = tcp.peer_addr().context("peer address")?;
    tcp.set_nodelay(true).ok();
    let work = async {
        let (tcp, handle) = split_handle(tcp)?;
        let tcp = BufReader::with_capacity(READ_AHEAD, tcp);
        let tls = TlsAcceptor::from(creds.server.clone())
            .accept(tcp)
            .await
            .context("TLS handshake")?;
        let (peer, fp) = peer_identity(tls.get_ref().1.peer_certificates())?;
        let guard = creds.registry.register(fp, &peer, peer_addr, handle)?;
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
            guard,
        })
    };
    tokio::time::timeout(HANDSHAKE_TIMEOUT, work)
        .await
        .map_err(|_| anyhow!("{peer_addr} did not finish its handshake in time"))?
        .with_context(|| format!("refused connection from {peer_addr}"))
}
