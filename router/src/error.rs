//! The router's start-up failures, rendered once by the binary.

use tandem_discovery::DiscoveryError;

/// Why the router cannot start.
#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    /// A routing weight is negative, infinite or not a number.
    #[error("{name} {value} must be a finite number >= 0")]
    Weight { name: &'static str, value: f64 },
    /// A tier's hit weight is not a fraction of computing the block.
    #[error("{name} {value} must be between 0 and 1 (a fraction of computing the block)")]
    HitWeight { name: &'static str, value: f64 },
    #[error("prefill candidates and decode attempts must be at least 1")]
    NoAttempts,
    #[error("prefill candidates must be at most {max} (what a decode node accepts)")]
    TooManyCandidates { max: usize },
    /// The workers cannot be watched in etcd.
    #[error("watching workers in etcd: {0}")]
    Membership(#[from] DiscoveryError),
}
