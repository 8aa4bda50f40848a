//! A throwaway certificate authority for TLS tests: a cluster CA and leaf
//! certificates (server and client use in one, as cluster nodes need),
//! written as PEM files into a directory the test owns.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

/// The PEM files of one identity.
#[derive(Debug, Clone)]
pub struct PemFiles {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// A CA whose certificate lives at `dir/<name>-ca.pem`.
pub struct TestCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
    dir: PathBuf,
    ca_path: PathBuf,
}

impl std::fmt::Debug for TestCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCa").field("ca", &self.ca_path).finish()
    }
}

impl TestCa {
    /// A new CA named `name` (its common name and file prefix) in `dir`.
    pub fn new(dir: &Path, name: &str) -> TestCa {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        params
            .distinguished_name
            .push(DnType::CommonName, format!("{name} test CA"));
        let key = KeyPair::generate().expect("CA key");
        let issuer = CertifiedIssuer::self_signed(params, key).expect("CA certificate");
        let ca_path = dir.join(format!("{name}-ca.pem"));
        std::fs::write(&ca_path, issuer.pem()).expect("writing the CA certificate");
        TestCa {
            issuer,
            dir: dir.to_path_buf(),
            ca_path,
        }
    }

    /// The CA certificate's path.
    pub fn ca_path(&self) -> &Path {
        &self.ca_path
    }

    /// A leaf certificate for `sans` (DNS names or IP addresses), usable as
    /// both a TLS server and a TLS client, at `dir/<name>.pem` + `-key.pem`.
    pub fn issue(&self, name: &str, sans: &[&str]) -> PemFiles {
        let sans: Vec<String> = sans.iter().map(|s| s.to_string()).collect();
        let mut params = CertificateParams::new(sans).expect("leaf params");
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate().expect("leaf key");
        let cert = params
            .signed_by(&key, &self.issuer)
            .expect("leaf certificate");
        let cert_path = self.dir.join(format!("{name}.pem"));
        let key_path = self.dir.join(format!("{name}-key.pem"));
        std::fs::write(&cert_path, cert.pem()).expect("writing a certificate");
        std::fs::write(&key_path, key.serialize_pem()).expect("writing a key");
        PemFiles {
            ca: self.ca_path.clone(),
            cert: cert_path,
            key: key_path,
        }
    }
}
