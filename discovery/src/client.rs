//! Connecting to etcd with bounded waits, error classification and backoff.

use std::future::Future;
use std::hash::BuildHasher;
use std::time::{Duration, Instant};

use etcd_client::{Certificate, Client, ConnectOptions, Identity, TlsOptions};

use crate::{DiscoveryError, EtcdConfig};

/// How long startup waits for etcd (connect plus the first requests) before
/// giving up with [`DiscoveryError::Unreachable`]; also bounds each request
/// of the background tasks, so a silent etcd never wedges them.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// Bound on the goodbye (revoke) at shutdown: a node that is stopping must
/// not hang on a dead etcd; its key then expires with the lease.
pub(crate) const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(2);

/// A fresh client. The channel connects lazily, so this is cheap and the
/// first request is what finds out whether etcd answers.
pub(crate) async fn connect(cfg: &EtcdConfig) -> Result<Client, DiscoveryError> {
    let options = ConnectOptions::new()
        .with_connect_timeout(CONNECT_TIMEOUT)
        // HTTP/2 pings find a silently dead peer (no RST, e.g. a partition).
        // etcd's default --grpc-keepalive-min-time is 5 s: ping less often
        // than that or it answers with GOAWAY (too many pings).
        .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5))
        .with_keep_alive_while_idle(false)
        // A member cut off from its leader fails requests and watches instead
        // of serving stale data or going quiet.
        .with_require_leader(true);
    let options = match &cfg.security.tls {
        None => options,
        Some(t) => {
            let mut tls = TlsOptions::new().ca_certificate(Certificate::from_pem(&t.ca_pem));
            if let Some((cert, key)) = &t.identity {
                tls = tls.identity(Identity::from_pem(cert, key));
            }
            options.with_tls(tls)
        }
    };
    let options = match &cfg.security.user {
        None => options,
        Some(u) => options.with_user(&u.name, &u.password),
    };
    Client::connect(&cfg.endpoints, Some(options))
        .await
        .map_err(classify)
}

/// Runs one etcd operation with a deadline; a timeout counts as unreachable.
pub(crate) async fn bounded<T>(
    limit: Duration,
    what: &str,
    fut: impl Future<Output = Result<T, DiscoveryError>>,
) -> Result<T, DiscoveryError> {
    match tokio::time::timeout(limit, fut).await {
        Ok(r) => r,
        Err(_) => Err(DiscoveryError::Unreachable(format!(
            "{what}: no answer within {limit:?}"
        ))),
    }
}

/// Transport failures (and their gRPC forms) mean "etcd is not there"; the
/// rest are real answers from etcd and keep their detail.
pub(crate) fn classify(e: etcd_client::Error) -> DiscoveryError {
    use etcd_client::Error as E;
    match &e {
        E::TransportError(_) | E::IoError(_) => DiscoveryError::Unreachable(e.to_string()),
        E::GRpcStatus(s)
            if matches!(
                s.code(),
                tonic::Code::Unavailable | tonic::Code::DeadlineExceeded
            ) =>
        {
            DiscoveryError::Unreachable(e.to_string())
        }
        E::InvalidUri(_) | E::InvalidArgs(_) => DiscoveryError::InvalidConfig(e.to_string()),
        _ => DiscoveryError::Etcd(e),
    }
}

/// Exponential backoff with jitter, so a fleet of workers that lost etcd
/// together does not hammer it in lockstep when it returns.
#[derive(Debug)]
pub(crate) struct Backoff {
    next: Duration,
}

impl Backoff {
    const FIRST: Duration = Duration::from_millis(100);
    const MAX: Duration = Duration::from_secs(2);

    pub(crate) fn new() -> Self {
        Backoff { next: Self::FIRST }
    }

    pub(crate) fn reset(&mut self) {
        self.next = Self::FIRST;
    }

    /// The next delay: uniformly in [50 %, 100 %] of the current step.
    pub(crate) fn next_delay(&mut self) -> Duration {
        let step = self.next;
        self.next = (self.next * 2).min(Self::MAX);
        // RandomState is seeded per instance: enough randomness for jitter
        // without another dependency.
        let r = std::collections::hash_map::RandomState::new().hash_one(Instant::now());
        step.mul_f64(0.5 + (r % 1024) as f64 / 2046.0)
    }
}

/// Tracks one outage so it is logged once at warn and once on recovery,
/// not on every retry.
#[derive(Debug, Default)]
pub(crate) struct Outage {
    since: Option<Instant>,
}

impl Outage {
    /// Records a failure; true only for the first one of an outage.
    pub(crate) fn failed(&mut self) -> bool {
        if self.since.is_some() {
            return false;
        }
        self.since = Some(Instant::now());
        true
    }

    /// Records a success; the outage's length if one just ended.
    pub(crate) fn recovered(&mut self) -> Option<Duration> {
        self.since.take().map(|t| t.elapsed())
    }
}
