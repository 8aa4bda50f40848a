//! How cluster processes reach each other over gRPC, and how they prove who
//! they are: mutual TLS under one cluster CA. Every node serves with its
//! CA-signed certificate and demands one from its callers; every client
//! (router -> nodes, decode -> prefill, `Worker.Events`) presents its own
//! and accepts only servers whose certificate the CA signed for the host it
//! dialled. A process without such a certificate cannot register work, read
//! KV events or be handed a KV region.

use std::path::{Path, PathBuf};
use std::time::Duration;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};

/// How long a client waits for a TCP connection to a peer.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a server waits for a caller to finish the TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// HTTP/2 pings on idle client connections: a peer that vanished without a
/// reset (a partition, a frozen process) is found within interval + timeout.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(5);

/// A bad TLS setting, found at startup.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {what} {path}: {source}")]
    Read {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{what} {path}: {reason}")]
    Invalid {
        what: &'static str,
        path: PathBuf,
        reason: String,
    },
    #[error("TLS configuration rejected: {0}")]
    Config(String),
    #[error("endpoint {endpoint:?}: {reason}")]
    Endpoint { endpoint: String, reason: String },
}

/// The PEM files of a process's cluster identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The cluster CA certificate(s): the only issuers trusted for peers.
    pub ca: PathBuf,
    /// This process's certificate chain (signed by the CA; its subject
    /// alternative names must cover the host it advertises).
    pub cert: PathBuf,
    /// The certificate's private key.
    pub key: PathBuf,
    /// The name every node's certificate carries, checked instead of the
    /// dialled host (pods come and go with addresses no certificate names).
    /// `None`: the certificate must name the host in the endpoint.
    pub server_name: Option<String>,
}

/// Loaded and checked cluster TLS material.
#[derive(Debug, Clone)]
pub struct ClusterTls {
    ca: Certificate,
    identity: Identity,
    server_name: Option<String>,
}

impl ClusterTls {
    /// Reads and checks the files: each must hold what it claims (a CA
    /// certificate, a certificate chain, one private key), and tonic must
    /// accept them for both a server and a client, so that a bad file fails
    /// startup instead of every later connection.
    pub fn load(files: &TlsFiles) -> Result<ClusterTls, TlsError> {
        let ca = read(&files.ca, "cluster CA")?;
        certificates(&ca, &files.ca, "cluster CA")?;
        let cert = read(&files.cert, "certificate")?;
        certificates(&cert, &files.cert, "certificate")?;
        let key = read(&files.key, "private key")?;
        PrivateKeyDer::from_pem_slice(&key).map_err(|e| TlsError::Invalid {
            what: "private key",
            path: files.key.clone(),
            reason: format!("no usable PEM private key ({e})"),
        })?;
        let tls = ClusterTls {
            ca: Certificate::from_pem(ca),
            identity: Identity::from_pem(cert, key),
            server_name: files.server_name.clone(),
        };
        tonic::transport::Server::builder()
            .tls_config(tls.server_config())
            .map_err(|e| TlsError::Config(error_chain(&e)))?;
        Endpoint::from_static("https://localhost")
            .tls_config(tls.client_config())
            .map_err(|e| TlsError::Config(error_chain(&e)))?;
        Ok(tls)
    }

    /// A server that demands a client certificate signed by the cluster CA.
    pub fn server_config(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(self.identity.clone())
            .client_ca_root(self.ca.clone())
            .client_auth_optional(false)
            .timeout(HANDSHAKE_TIMEOUT)
    }

    /// A client that presents our certificate and trusts only the cluster CA.
    pub fn client_config(&self) -> ClientTlsConfig {
        let c = ClientTlsConfig::new()
            .ca_certificate(self.ca.clone())
            .identity(self.identity.clone())
            .timeout(HANDSHAKE_TIMEOUT);
        match &self.server_name {
            Some(name) => c.domain_name(name.clone()),
            None => c,
        }
    }
}

/// How this process dials cluster peers: plaintext, or mutual TLS. One value
/// per process, shared by every client it makes, so no call site can forget
/// the security settings or the timeouts.
#[derive(Debug, Clone, Default)]
pub struct PeerConnector {
    tls: Option<ClusterTls>,
}

impl PeerConnector {
    pub fn new(tls: Option<ClusterTls>) -> PeerConnector {
        PeerConnector { tls }
    }

    /// Whether peers are reached over mutual TLS.
    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// The URL scheme this process advertises and expects of its peers.
    pub fn scheme(&self) -> &'static str {
        if self.is_tls() { "https" } else { "http" }
    }

    /// A lazily connecting channel to a peer's advertised endpoint. Under TLS
    /// a plaintext (`http://`) endpoint is refused: a worker that cannot
    /// prove its identity is never sent a request.
    pub fn endpoint(&self, endpoint: &str) -> Result<Endpoint, TlsError> {
        let bad = |reason: String| TlsError::Endpoint {
            endpoint: endpoint.to_string(),
            reason,
        };
        let (scheme, _) = endpoint
            .split_once("://")
            .ok_or_else(|| bad("not a URL".into()))?;
        if scheme != self.scheme() {
            return Err(bad(format!(
                "scheme {scheme}, but this cluster uses {}",
                self.scheme()
            )));
        }
        let e = Endpoint::from_shared(endpoint.to_string())
            .map_err(|e| bad(error_chain(&e)))?
            .connect_timeout(CONNECT_TIMEOUT)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
            .keep_alive_timeout(KEEPALIVE_TIMEOUT)
            .keep_alive_while_idle(false);
        match &self.tls {
            None => Ok(e),
            Some(t) => e
                .tls_config(t.client_config())
                .map_err(|e| bad(error_chain(&e))),
        }
    }
}

fn read(path: &Path, what: &'static str) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })
}

fn certificates(pem: &[u8], path: &Path, what: &'static str) -> Result<usize, TlsError> {
    let invalid = |reason: String| TlsError::Invalid {
        what,
        path: path.to_path_buf(),
        reason,
    };
    let mut n = 0;
    for c in CertificateDer::pem_slice_iter(pem) {
        c.map_err(|e| invalid(format!("bad PEM certificate ({e})")))?;
        n += 1;
    }
    if n == 0 {
        return Err(invalid("no PEM certificate in it".into()));
    }
    Ok(n)
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, body: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, body).expect("write");
        p
    }

    #[test]
    fn missing_and_malformed_files_fail_loudly() {
        let dir = tempfile::tempdir().expect("tempdir");
        let files = |ca: &Path, cert: &Path, key: &Path| TlsFiles {
            ca: ca.to_path_buf(),
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            server_name: None,
        };
        let absent = dir.path().join("absent.pem");
        let junk = write(dir.path(), "junk.pem", "not a certificate");
        let err = ClusterTls::load(&files(&absent, &junk, &junk)).unwrap_err();
        assert!(
            matches!(
                err,
                TlsError::Read {
                    what: "cluster CA",
                    ..
                }
            ),
            "{err}"
        );
        let err = ClusterTls::load(&files(&junk, &junk, &junk)).unwrap_err();
        assert!(
            matches!(
                err,
                TlsError::Invalid {
                    what: "cluster CA",
                    ..
                }
            ),
            "{err}"
        );
        let broken = write(
            dir.path(),
            "broken.pem",
            "-----BEGIN CERTIFICATE-----\n!!!!\n-----END CERTIFICATE-----\n",
        );
        let err = ClusterTls::load(&files(&broken, &junk, &junk)).unwrap_err();
        assert!(matches!(err, TlsError::Invalid { .. }), "{err}");
    }

    #[test]
    fn tls_material_loads_and_the_connector_demands_https() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = tandem_testkit::tls::TestCa::new(dir.path(), "cluster");
        let pem = ca.issue("node", &["127.0.0.1", "localhost"]);
        let files = TlsFiles {
            ca: pem.ca.clone(),
            cert: pem.cert.clone(),
            key: pem.key.clone(),
            server_name: None,
        };
        let tls = PeerConnector::new(Some(ClusterTls::load(&files).expect("valid files")));
        assert_eq!(tls.scheme(), "https");
        assert!(tls.endpoint("https://127.0.0.1:1").is_ok());
        let err = tls.endpoint("http://127.0.0.1:1").unwrap_err();
        assert!(err.to_string().contains("this cluster uses https"), "{err}");
        // A certificate where the key should be.
        let swapped = TlsFiles {
            key: pem.cert.clone(),
            ..files
        };
        assert!(matches!(
            ClusterTls::load(&swapped),
            Err(TlsError::Invalid {
                what: "private key",
                ..
            })
        ));
    }

    #[test]
    fn plaintext_connector_refuses_tls_endpoints_and_garbage() {
        let plain = PeerConnector::default();
        assert_eq!(plain.scheme(), "http");
        assert!(plain.endpoint("http://127.0.0.1:1").is_ok());
        for bad in [
            "https://127.0.0.1:1",
            "127.0.0.1:1",
            "http://exa mple:1",
            "",
        ] {
            assert!(plain.endpoint(bad).is_err(), "{bad:?}");
        }
    }
}
