//! Cluster credentials: a cluster CA, and per node a certificate it signed. Every connection
//! between daemons is mutual TLS: each side proves it holds a certificate of this cluster's CA
//! before a single message is read, and the node name a peer claims must be the one in its
//! certificate.

use crate::revocation::{Registry, RevocationList};
use anyhow::{anyhow, bail, Context, Result};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The name every node certificate carries besides its own, and the one clients check: a peer
/// is dialled by address, and what matters is that it belongs to the cluster. Its own name is
/// then read from the certificate.
pub const CLUSTER_SAN: &str = "ferry-node.cluster";

/// Where a node's credential files are, as named in its config file.
#[derive(Debug, Clone, serde::Deserialize, serde::Serialize)]
pub struct CredentialPaths {
    pub ca_cert: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// A CA that can sign node certificates (only `ferry cluster up` and `ferry cluster certs` hold
/// its key).
pub struct ClusterCa {
    issuer: Issuer<'static, KeyPair>,
    pem: String,
    key_pem: String,
}

impl ClusterCa {
    pub fn generate(cluster: &str) -> Result<ClusterCa> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params
            .distinguished_name
            .push(DnType::CommonName, format!("Ferry cluster CA {cluster}"));
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().context("generate the CA key")?;
        let cert = params
            .self_signed(&key)
            .context("sign the CA certificate")?;
        Ok(ClusterCa {
            pem: cert.pem(),
            key_pem: key.serialize_pem(),
            issuer: Issuer::new(params, key),
        })
    }

    pub fn cert_pem(&self) -> &str {
        &self.pem
    }

    /// Writes the CA's certificate and key (mode 0600) into `dir`.
    pub fn save(&self, dir: &Path) -> Result<()> {
        write_private(&dir.join("ca.pem"), self.pem.as_bytes())?;
        write_private(&dir.join("ca.key"), self.key_pem.as_bytes())
    }

    pub fn load(dir: &Path) -> Result<ClusterCa> {
        let read = |name: &str| {
            std::fs::read_to_string(dir.join(name))
                .with_context(|| format!("read {}", dir.join(name).display()))
        };
        let pem = read("ca.pem")?;
        let key_pem = read("ca.key")?;
        let key = KeyPair::from_pem(&key_pem).context("parse the CA key")?;
        let issuer = Issuer::from_ca_cert_pem(&pem, key).context("parse the CA certificate")?;
        Ok(ClusterCa {
            issuer,
            pem,
            key_pem,
        })
    }

    /// Issues the certificate of node `name`; returns (certificate PEM, key PEM).
    pub fn issue_node(&self, name: &str) -> Result<(String, String)> {
        check_node_name(name)?;
        let mut params = CertificateParams::new(vec![CLUSTER_SAN.to_string()])?;
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate().context("generate a node key")?;
        let cert = params
            .signed_by(&key, &self.issuer)
            .with_context(|| format!("sign the certificate of node {name}"))?;
        Ok((cert.pem(), key.serialize_pem()))
    }

    /// Writes `name.pem` and `name.key` for node `name` into `dir` and returns their paths.
    pub fn issue_node_files(&self, name: &str, dir: &Path) -> Result<CredentialPaths> {
        let (cert, key) = self.issue_node(name)?;
        let paths = CredentialPaths {
            ca_cert: dir.join("ca.pem"),
            cert: dir.join(format!("{name}.pem")),
            key: dir.join(format!("{name}.key")),
        };
        write_private(&paths.cert, cert.as_bytes())?;
        write_private(&paths.key, key.as_bytes())?;
        if !paths.ca_cert.exists() {
            write_private(&paths.ca_cert, self.pem.as_bytes())?;
        }
        Ok(paths)
    }
}

/// Node names travel in certificates, file names and messages: keep them plain.
pub fn check_node_name(name: &str) -> Result<()> {
    if name.is_empty()
        || name.len() > 63
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        bail!("bad node name {name:?}: use 1 to 63 letters, digits, '-' or '_'");
    }
    Ok(())
}

fn write_private(path: &Path, data: &[u8]) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("create {}", path.display()))?;
    f.write_all(data)
        .with_context(|| format!("write {}", path.display()))
}

/// A node's loaded credentials: TLS configurations for both directions, the revocation list
/// in force, and the live connections it may have to close.
#[derive(Clone)]
pub struct Credentials {
    pub node: String,
    /// This node's own certificate, as a revocation list names it.
    pub fingerprint: String,
    pub server: Arc<ServerConfig>,
    pub client: Arc<ClientConfig>,
    /// The address outgoing connections are made from (the node's listen address): on a machine
    /// with several addresses, a peer then sees each node come from its own, and can count
    /// connections per node. None: the kernel chooses.
    pub local_ip: Option<std::net::IpAddr>,
    pub(crate) registry: Arc<Registry>,
}

impl Credentials {
    pub fn load(paths: &CredentialPaths) -> Result<Credentials> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let ca = CertificateDer::from_pem_file(&paths.ca_cert)
            .with_context(|| format!("read the cluster CA {}", paths.ca_cert.display()))?;
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&paths.cert)
            .with_context(|| format!("read {}", paths.cert.display()))?
            .collect::<Result<_, _>>()
            .with_context(|| format!("parse {}", paths.cert.display()))?;
        let Some(leaf) = certs.first() else {
            bail!("{} holds no certificate", paths.cert.display());
        };
        let node = cert_node_name(leaf)
            .with_context(|| format!("read the node name in {}", paths.cert.display()))?;
        let fingerprint = crate::revocation::fingerprint(leaf);
        let key = PrivateKeyDer::from_pem_file(&paths.key)
            .with_context(|| format!("read {}", paths.key.display()))?;
        let mut roots = RootCertStore::empty();
        roots
            .add(ca)
            .with_context(|| format!("use {} as the cluster CA", paths.ca_cert.display()))?;
        let roots = Arc::new(roots);
        let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
            .build()
            .context("build the client certificate verifier")?;
        let server = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()?
            .with_client_cert_verifier(verifier)
            .with_single_cert(certs.clone(), key.clone_key())
            .context("use the node certificate for serving")?;
        let client = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_client_auth_cert(certs, key)
            .context("use the node certificate as a client")?;
        Ok(Credentials {
            node,
            fingerprint,
            server: Arc::new(server),
            client: Arc::new(client),
            local_ip: None,
            registry: Arc::default(),
        })
    }

    /// Puts a revocation list in force: from now on connections with a listed certificate are
    /// refused, and those open now are shut down. Returns the (peer, address) of each shut.
    pub fn set_revoked(&self, list: RevocationList) -> Vec<(String, std::net::SocketAddr)> {
        self.registry.set_revoked(list)
    }

    /// Whether the certificate with this fingerprint is revoked.
    pub fn is_revoked(&self, fingerprint: &str) -> bool {
        self.registry.is_revoked(fingerprint)
    }
}

/// The node name (common name) in a certificate this cluster's CA signed.
pub fn cert_node_name(der: &CertificateDer<'_>) -> Result<String> {
    let (_, x509) =
        x509_parser::parse_x509_certificate(der).map_err(|e| anyhow!("parse certificate: {e}"))?;
    let cn = x509
        .subject()
        .iter_common_name()
        .next()
        .ok_or_else(|| anyhow!("certificate has no common name"))?
        .as_str()
        .map_err(|e| anyhow!("certificate common name: {e}"))?
        .to_string();
    check_node_name(&cn)?;
    Ok(cn)
}
