//! Revoked certificates, and the connections they still hold.
//!
//! A revocation list is a text file named in the node's config (`revoked = PATH`): one
//! certificate per line, as `sha256:HEX` (the SHA-256 of its DER encoding) followed by anything
//! (`ferry cluster revoke` writes the node's name and the date); `#` starts a comment. A node
//! refuses every connection, in either direction, whose peer presents a listed certificate, and
//! when the list changes it shuts down the connections such certificates still hold
//! ([`Credentials::set_revoked`](crate::Credentials::set_revoked)).

use anyhow::{bail, Context, Result};
use rustls::pki_types::CertificateDer;
use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// The SHA-256 of a certificate's DER encoding, as the list writes it: `sha256:` and 64
/// lower-case hex digits.
pub fn fingerprint(der: &CertificateDer<'_>) -> String {
    let d = ring::digest::digest(&ring::digest::SHA256, der.as_ref());
    let mut s = String::with_capacity(7 + 64);
    s.push_str("sha256:");
    for b in d.as_ref() {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// The fingerprint of the first certificate of a PEM file (a node's `NAME.pem`).
pub fn fingerprint_pem_file(path: &Path) -> Result<String> {
    use rustls::pki_types::pem::PemObject;
    let der = CertificateDer::from_pem_file(path)
        .with_context(|| format!("read the certificate {}", path.display()))?;
    Ok(fingerprint(&der))
}

/// The certificates a revocation list names.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RevocationList {
    fingerprints: HashSet<String>,
}

impl RevocationList {
    pub fn parse(text: &str) -> Result<RevocationList> {
        let mut fingerprints = HashSet::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            let Some(first) = line.split_whitespace().next() else {
                continue;
            };
            let hex = first.strip_prefix("sha256:").unwrap_or("");
            if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
                bail!(
                    "line {}: {first:?} is not a certificate fingerprint (sha256: and 64 hex digits)",
                    i + 1
                );
            }
            fingerprints.insert(format!("sha256:{}", hex.to_ascii_lowercase()));
        }
        Ok(RevocationList { fingerprints })
    }

    pub fn load(path: &Path) -> Result<RevocationList> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("read the revocation list {}", path.display()))?;
        RevocationList::parse(&text)
            .with_context(|| format!("parse the revocation list {}", path.display()))
    }

    pub fn contains(&self, fingerprint: &str) -> bool {
        self.fingerprints.contains(fingerprint)
    }

    pub fn len(&self) -> usize {
        self.fingerprints.len()
    }

    pub fn is_empty(&self) -> bool {
        self.fingerprints.is_empty()
    }
}

/// One authenticated connection, as the registry knows it: whose certificate, and a second
/// handle on its socket to shut it down with.
struct Entry {
    fingerprint: String,
    peer: String,
    addr: std::net::SocketAddr,
    socket: std::net::TcpStream,
}

/// The revocation list in force and every live connection between daemons. Shared by all
/// clones of a node's [`Credentials`](crate::Credentials).
#[derive(Default)]
pub(crate) struct Registry {
    revoked: Mutex<RevocationList>,
    conns: Mutex<HashMap<u64, Entry>>,
    next: AtomicU64,
}

/// Removes its connection from the registry when the connection is dropped.
pub struct ConnGuard {
    id: u64,
    registry: Arc<Registry>,
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.registry
            .conns
            .lock()
            .expect("registry lock")
            .remove(&self.id);
    }
}

impl Registry {
    pub(crate) fn is_revoked(&self, fingerprint: &str) -> bool {
        self.revoked
            .lock()
            .expect("registry lock")
            .contains(fingerprint)
    }

    /// Records a connection (refusing it if its certificate is revoked: the list may have
    /// changed during the handshake).
    pub(crate) fn register(
        self: &Arc<Self>,
        fingerprint: String,
        peer: &str,
        addr: std::net::SocketAddr,
        socket: std::net::TcpStream,
    ) -> Result<ConnGuard> {
        let revoked = self.revoked.lock().expect("registry lock");
        if revoked.contains(&fingerprint) {
            bail!("the certificate of {peer} ({fingerprint}) is revoked");
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.conns.lock().expect("registry lock").insert(
            id,
            Entry {
                fingerprint,
                peer: peer.to_string(),
                addr,
                socket,
            },
        );
        drop(revoked);
        Ok(ConnGuard {
            id,
            registry: self.clone(),
        })
    }

    /// Puts `list` in force and shuts down every connection whose certificate it names;
    /// returns those connections' (peer, address).
    pub(crate) fn set_revoked(&self, list: RevocationList) -> Vec<(String, std::net::SocketAddr)> {
        let mut revoked = self.revoked.lock().expect("registry lock");
        *revoked = list;
        let conns = self.conns.lock().expect("registry lock");
        let mut dropped = Vec::new();
        for e in conns.values() {
            if revoked.contains(&e.fingerprint) {
                // Both directions: the conversation's own reads and writes fail at once, and
                // it ends the way it would if the peer had gone (a remote program loses its
                // caller, a migration aborts).
                let _ = e.socket.shutdown(std::net::Shutdown::Both);
                dropped.push((e.peer.clone(), e.addr));
            }
        }
        dropped
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_fingerprints_and_refuses_anything_else() {
        let fp = format!("sha256:{}", "Ab".repeat(32));
        let list = RevocationList::parse(&format!(
            "# header\n\n{fp}  b 2026-11-24  # stolen laptop\n"
        ))
        .unwrap();
        assert_eq!(list.len(), 1);
        assert!(list.contains(&fp.to_ascii_lowercase()));
        for bad in ["b", "sha256:abc", &format!("sha1:{}", "a".repeat(64))] {
            let e = RevocationList::parse(&format!("{fp}\n{bad}\n")).unwrap_err();
            assert!(format!("{e:#}").contains("line 2"), "{e:#}");
        }
        assert!(RevocationList::parse("").unwrap().is_empty());
    }
}
