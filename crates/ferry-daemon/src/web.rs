//! The daemon's read-only web door: a page with the cluster's picture (crate::view, refreshed
//! every 2 s), the same picture as JSON, and the daemon's metrics in the Prometheus text
//! format (crate::metrics).
//!
//! | path | answer |
//! |---|---|
//! | `/` | the page (HTML, no script: the browser reloads it) |
//! | `/cluster.json` | `ClusterView` as JSON |
//! | `/metrics` | the metrics, text exposition format |
//!
//! Only GET and HEAD; nothing here changes anything. Bound to loopback by default (see
//! `Config::web_addr`); on any other address every connection must present a certificate of
//! the cluster (mutual TLS, the peers' own configuration), and a revoked one is refused.
//! docs/security.md, "The web page and metrics", says why.

use crate::node::Node;
use crate::view;
use anyhow::{Context, Result};
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use std::convert::Infallible;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// At most this many connections at once; more wait for the kernel's backlog.
const MAX_CONNECTIONS: usize = 32;
/// A client has this long to send its request's headers.
const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the page reloads itself.
pub const REFRESH_SECS: u32 = 2;

const STYLE: &str = include_str!("../static/page.css");

/// Binds the web door at `addr`; the caller spawns [`serve`] with the listener.
pub async fn bind(addr: SocketAddr) -> Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("listen for the web page on {addr}"))
}

/// Serves the page until the daemon stops. Plain HTTP on loopback, mutual TLS elsewhere.
pub async fn serve(node: Arc<Node>, listener: TcpListener) {
    let tls = listener
        .local_addr()
        .map(|a| !a.ip().is_loopback())
        .unwrap_or(true);
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let (tcp, from) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(error = %e, "accept on the web door");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let node = node.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let r = if tls {
                match authenticate(&node, tcp).await {
                    Ok(stream) => http(node, stream).await,
                    Err(e) => Err(e),
                }
            } else {
                http(node, tcp).await
            };
            if let Err(e) = r {
                tracing::debug!(from = %from, error = %format!("{e:#}"), "web connection");
            }
        });
    }
}

/// The TLS handshake of a web client: a certificate of the cluster, not revoked.
async fn authenticate(
    node: &Node,
    tcp: tokio::net::TcpStream,
) -> Result<tokio_rustls::server::TlsStream<tokio::net::TcpStream>> {
    let from = tcp.peer_addr().ok();
    let tls = tokio::time::timeout(
        ferry_transport::tls::HANDSHAKE_TIMEOUT,
        tokio_rustls::TlsAcceptor::from(node.creds.server.clone()).accept(tcp),
    )
    .await
    .map_err(|_| anyhow::anyhow!("no TLS handshake in time"))?
    .context("TLS handshake")?;
    let leaf = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .context("no client certificate")?;
    let fp = ferry_transport::revocation::fingerprint(leaf);
    if node.creds.is_revoked(&fp) {
        tracing::warn!(event = "web-refused", from = ?from, "revoked certificate");
        anyhow::bail!("revoked certificate");
    }
    Ok(tls)
}

async fn http<S>(node: Arc<Node>, stream: S) -> Result<()>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |req| {
        let node = node.clone();
        async move { Ok::<_, Infallible>(answer(&node, &req).await) }
    });
    hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .serve_connection(TokioIo::new(stream), service)
        .await
        .context("HTTP")
}

fn reply(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .header("cache-control", "no-store")
        .header("x-content-type-options", "nosniff")
        .header(
            "content-security-policy",
            "default-src 'none'; style-src 'unsafe-inline'",
        )
        .body(Full::new(body.into()))
        .expect("static headers are valid")
}

async fn answer(node: &Arc<Node>, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return reply(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain; charset=utf-8",
            "read only: GET or HEAD\n",
        );
    }
    match req.uri().path() {
        "/" | "/index.html" => {
            let v = view::cluster_view(node).await;
            reply(StatusCode::OK, "text/html; charset=utf-8", page(&v))
        }
        "/cluster.json" => {
            let v = view::cluster_view(node).await;
            match serde_json::to_vec_pretty(&v) {
                Ok(b) => reply(StatusCode::OK, "application/json", b),
                Err(e) => reply(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "text/plain; charset=utf-8",
                    format!("encode the view: {e}\n"),
                ),
            }
        }
        "/metrics" => {
            let nodes = crate::node::nodes(node);
            match node.metrics.encode(&nodes, node.deputies.count()) {
                Ok(text) => reply(
                    StatusCode::OK,
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    text,
                ),
                Err(e) => reply(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "text/plain; charset=utf-8",
                    format!("encode the metrics: {e}\n"),
                ),
            }
        }
        _ => reply(
            StatusCode::NOT_FOUND,
            "text/plain; charset=utf-8",
            "not found: / (the page), /cluster.json, /metrics\n",
        ),
    }
}

/// Text for HTML: commands and names come from users and peers.
fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

fn table(out: &mut String, id: &str, columns: &[&str], rows: &[Vec<String>]) {
    let _ = write!(out, "<table id=\"{id}\"><thead><tr>");
    for c in columns {
        let _ = write!(out, "<th>{}</th>", escape(c));
    }
    out.push_str("</tr></thead><tbody>");
    for r in rows {
        out.push_str("<tr>");
        for c in r {
            let _ = write!(out, "<td>{}</td>", escape(c));
        }
        out.push_str("</tr>");
    }
    out.push_str("</tbody></table>");
}

/// The page: both tables, rendered here (the page runs no script).
pub fn page(v: &ferry_transport::message::ClusterView) -> String {
    let mut out = String::new();
    let _ = write!(
        out,
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta http-equiv=\"refresh\" content=\"{REFRESH_SECS}\">\
         <title>Ferry: {node}</title><style>{STYLE}</style></head><body>\
         <h1>Ferry cluster, seen from {node}</h1>\
         <p class=\"when\">{nodes} nodes, {procs} processes under Ferry; \
         taken at {when} ms since the epoch, refreshed every {REFRESH_SECS} s.</p>",
        node = escape(&v.node),
        nodes = v.nodes.len(),
        procs = v.processes.len(),
        when = v.taken_unix_ms,
    );
    if !v.unanswered.is_empty() {
        let _ = write!(
            out,
            "<p class=\"warn\">Did not answer: {}</p>",
            escape(&v.unanswered.join(", "))
        );
    }
    out.push_str("<h2>Nodes</h2>");
    let rows: Vec<Vec<String>> = v.nodes.iter().map(view::node_row).collect();
    table(&mut out, "nodes", view::NODE_COLUMNS, &rows);
    out.push_str("<h2>Processes</h2>");
    let rows: Vec<Vec<String>> = v
        .processes
        .iter()
        .map(|p| view::proc_row(p, v.taken_unix_ms))
        .collect();
    table(&mut out, "processes", view::PROC_COLUMNS, &rows);
    out.push_str(
        "<p class=\"foot\">Read only. <a href=\"/cluster.json\">cluster.json</a> \
         &middot; <a href=\"/metrics\">metrics</a></p></body></html>\n",
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_text_is_escaped() {
        let v = ferry_transport::message::ClusterView {
            node: "a<b>".into(),
            ..Default::default()
        };
        let p = page(&v);
        assert!(p.contains("a&lt;b&gt;") && !p.contains("a<b>"));
        assert_eq!(escape("<script>'&\""), "&lt;script&gt;&#39;&amp;&quot;");
    }
}
