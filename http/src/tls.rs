//! HTTPS for the OpenAI port: a rustls server over the certificate and key
//! an operator names (`--tls-cert` / `--tls-key`), HTTP/1.1 only (what the
//! connection loop speaks).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls;

/// A bad certificate or key, found at startup.
#[derive(Debug, thiserror::Error)]
pub enum HttpTlsError {
    #[error("reading {what} {path}: {reason}")]
    File {
        what: &'static str,
        path: PathBuf,
        reason: String,
    },
    #[error("certificate and key rejected: {0}")]
    Config(#[from] rustls::Error),
}

/// The server side of HTTPS. Cheap to clone.
#[derive(Clone)]
pub struct HttpTls {
    acceptor: TlsAcceptor,
}

impl std::fmt::Debug for HttpTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HttpTls")
    }
}

impl HttpTls {
    /// Loads a PEM certificate chain and its private key; the key must match
    /// the certificate.
    pub fn load(cert: &Path, key: &Path) -> Result<HttpTls, HttpTlsError> {
        let file_err = |what: &'static str, path: &Path, reason: String| HttpTlsError::File {
            what,
            path: path.to_path_buf(),
            reason,
        };
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
            .map_err(|e| file_err("certificate", cert, e.to_string()))?
            .collect::<Result<_, _>>()
            .map_err(|e| file_err("certificate", cert, e.to_string()))?;
        if chain.is_empty() {
            return Err(file_err(
                "certificate",
                cert,
                "no PEM certificate in it".into(),
            ));
        }
        let key_der = PrivateKeyDer::from_pem_file(key)
            .map_err(|e| file_err("private key", key, e.to_string()))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(chain, key_der)?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(HttpTls {
            acceptor: TlsAcceptor::from(Arc::new(config)),
        })
    }

    pub(crate) fn acceptor(&self) -> &TlsAcceptor {
        &self.acceptor
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn matching_files_load_and_bad_ones_are_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = tandem_testkit::tls::TestCa::new(dir.path(), "http");
        let a = ca.issue("a", &["localhost"]);
        let b = ca.issue("b", &["localhost"]);
        assert!(HttpTls::load(&a.cert, &a.key).is_ok());
        // Another certificate's key.
        assert!(matches!(
            HttpTls::load(&a.cert, &b.key),
            Err(HttpTlsError::Config(_))
        ));
        let missing = dir.path().join("missing.pem");
        let err = HttpTls::load(&missing, &a.key).unwrap_err();
        assert!(err.to_string().contains("missing.pem"), "{err}");
        let err = HttpTls::load(&a.key, &a.key).unwrap_err();
        assert!(err.to_string().contains("no PEM certificate"), "{err}");
    }
}
