//! Worker registration (etcd lease + keepalive) and membership watch.
//!
//! Workers put their record under `/tandem/<cluster>/workers/<role>/<id>`
//! attached to a lease they keep alive ([`Registration`]); a crashed worker
//! stops renewing and etcd deletes its key after the lease TTL. Routers list
//! and watch that prefix ([`Membership`]). Both survive etcd outages: the
//! worker keeps serving and re-registers when etcd returns, the router keeps
//! the last known membership. Values are opaque bytes: the caller encodes
//! and validates them. [`get_or_create_secret`] keeps cluster-wide secrets
//! (the dKV key) under `/tandem/<cluster>/secrets/<name>`.

mod client;
mod membership;
mod registration;
mod secret;
#[cfg(feature = "testing")]
pub mod testing;

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

pub use client::CONNECT_TIMEOUT;
pub use membership::{Member, Membership, Snapshot};
pub use registration::Registration;
pub use secret::{get_or_create_secret, secret_key};

/// Where etcd is and how this cluster's keys are scoped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EtcdConfig {
    /// etcd client URLs (`http://host:port`).
    pub endpoints: Vec<String>,
    /// Cluster name: the key prefix segment, so several clusters can share one etcd.
    pub cluster: String,
    /// Lease TTL: how long a crashed worker stays visible. Rounded up to whole
    /// seconds (etcd's unit); etcd may raise it to its own minimum.
    pub lease_ttl: Duration,
    /// TLS and authentication towards etcd (none by default).
    pub security: EtcdSecurity,
}

/// How this process proves itself to etcd and checks etcd's identity.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EtcdSecurity {
    /// `https://` endpoints: etcd's certificate must be signed by this CA.
    pub tls: Option<EtcdTls>,
    /// etcd's own authentication (`etcdctl auth enable`).
    pub user: Option<EtcdUser>,
}

/// PEM material for TLS to etcd, read at startup.
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdTls {
    pub ca_pem: Vec<u8>,
    /// A client certificate and key, for an etcd run with
    /// `--client-cert-auth`.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl fmt::Debug for EtcdTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdTls")
            .field("client_certificate", &self.identity.is_some())
            .finish_non_exhaustive()
    }
}

/// A user name and password; the password never appears in `Debug`.
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdUser {
    pub name: String,
    pub password: String,
}

impl fmt::Debug for EtcdUser {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdUser")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl EtcdConfig {
    /// Rejects configs that would produce unusable keys or leases.
    pub fn validate(&self) -> Result<(), DiscoveryError> {
        if self.endpoints.is_empty() {
            return Err(DiscoveryError::InvalidConfig(
                "no etcd endpoints given".into(),
            ));
        }
        if let Some(e) = self.endpoints.iter().find(|e| e.trim().is_empty()) {
            return Err(DiscoveryError::InvalidConfig(format!(
                "empty etcd endpoint {e:?}"
            )));
        }
        let https = self
            .endpoints
            .iter()
            .filter(|e| e.starts_with("https://"))
            .count();
        match (self.security.tls.is_some(), https) {
            (true, n) if n != self.endpoints.len() => {
                return Err(DiscoveryError::InvalidConfig(
                    "etcd TLS is configured: every etcd endpoint must be https://".into(),
                ));
            }
            (false, n) if n > 0 => {
                return Err(DiscoveryError::InvalidConfig(
                    "https:// etcd endpoints need the etcd CA (--etcd-ca)".into(),
                ));
            }
            _ => {}
        }
        if let Some(u) = &self.security.user
            && (u.name.is_empty() || u.password.is_empty())
        {
            return Err(DiscoveryError::InvalidConfig(
                "etcd user name and password must both be non-empty".into(),
            ));
        }
        if !valid_cluster(&self.cluster) {
            return Err(DiscoveryError::InvalidConfig(format!(
                "cluster name {:?} must match [A-Za-z0-9_-]+",
                self.cluster
            )));
        }
        if self.lease_ttl < Duration::from_secs(1) {
            return Err(DiscoveryError::InvalidConfig(format!(
                "lease TTL {:?} is below 1 s",
                self.lease_ttl
            )));
        }
        if self.lease_ttl > Duration::from_secs(MAX_LEASE_TTL_SECS) {
            return Err(DiscoveryError::InvalidConfig(format!(
                "lease TTL {:?} is above {MAX_LEASE_TTL_SECS} s",
                self.lease_ttl
            )));
        }
        Ok(())
    }

    /// The TTL in etcd's unit (whole seconds, rounded up).
    pub(crate) fn ttl_secs(&self) -> i64 {
        let secs = self.lease_ttl.as_secs() + u64::from(self.lease_ttl.subsec_nanos() > 0);
        // validate() bounds the TTL, so this never saturates in practice.
        i64::try_from(secs).unwrap_or(i64::MAX)
    }
}

/// etcd's own cap on lease TTLs (9,000,000,000 s) is far above anything useful;
/// a day keeps typos like milliseconds-as-seconds from going unnoticed.
const MAX_LEASE_TTL_SECS: u64 = 24 * 3600;

fn valid_cluster(cluster: &str) -> bool {
    !cluster.is_empty()
        && cluster
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// A worker id is one key segment: printable ASCII without `/`, so every key
/// a worker writes is one that watchers can parse back.
fn valid_id(id: &str) -> bool {
    !id.is_empty() && id.bytes().all(|b| b.is_ascii_graphic() && b != b'/')
}

/// The part a worker plays in disaggregated serving.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    Prefill,
    Decode,
}

impl Role {
    /// The key segment for this role.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = DiscoveryError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            _ => Err(DiscoveryError::InvalidConfig(format!(
                "unknown role {s:?} (expected prefill or decode)"
            ))),
        }
    }
}

/// The prefix routers watch; the trailing `/` keeps cluster `a` from
/// matching cluster `ab`.
pub fn workers_prefix(cluster: &str) -> String {
    format!("/tandem/{cluster}/workers/")
}

/// The key one worker registers under.
pub fn worker_key(cluster: &str, role: Role, id: &str) -> String {
    format!("{}{}/{id}", workers_prefix(cluster), role.as_str())
}

/// Inverse of [`worker_key`]; `None` for anything that [`worker_key`] with a
/// valid id could not have produced.
pub fn parse_worker_key(cluster: &str, key: &str) -> Option<(Role, String)> {
    let rest = key.strip_prefix(&workers_prefix(cluster))?;
    let (role, id) = rest.split_once('/')?;
    let role = role.parse().ok()?;
    valid_id(id).then(|| (role, id.to_owned()))
}

/// Why discovery could not start or do what it was asked.
#[derive(thiserror::Error, Debug)]
pub enum DiscoveryError {
    #[error("invalid discovery config: {0}")]
    InvalidConfig(String),
    #[error("etcd unreachable: {0}")]
    Unreachable(String),
    #[error("etcd lease {0:x} expired")]
    LeaseExpired(i64),
    #[error("etcd: {0}")]
    Etcd(#[from] etcd_client::Error),
}
