//! dkv instruments, recorded through the OpenTelemetry API only (the binary
//! installs the SDK; without one they are no-ops). Every instrument carries
//! the `connector` label (`ucx` or `local`).

use std::sync::OnceLock;

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Histogram, Meter};

/// Every `reason` of `tandem.dkv.transfer_failures`: [`crate::DkvError::reason`]
/// and `cancelled` (a transfer dropped before it completed).
pub const FAILURE_REASONS: [&str; 7] = [
    "deadline",
    "peer",
    "bounds",
    "transport",
    "refused",
    "unauthenticated",
    "cancelled",
];

/// Buckets (ms) for one transfer: sub-millisecond local copies up to stalls.
const TRANSFER_MS_BUCKETS: [f64; 16] = [
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 5000.0,
    30000.0,
];

#[derive(Debug)]
pub struct DkvMetrics {
    /// Bytes written to remote memory by successful transfers (recorded by `write`).
    pub bytes_transferred: Counter<u64>,
    /// KV blocks moved (recorded by the nodes, which know what a block is).
    pub blocks_transferred: Counter<u64>,
    /// Time of successful `write` calls, submit to remote completion (ms).
    pub transfer_latency: Histogram<f64>,
    /// Failed or cancelled transfers, labeled `reason`
    /// (deadline|peer|bounds|refused|unauthenticated|cancelled|transport);
    /// `unauthenticated`: a peer address whose tag failed (never given to
    /// UCX).
    pub transfer_failures: Counter<u64>,
    /// Decode-stall watchdog firings (recorded by the decode node).
    pub watchdog_firings: Counter<u64>,
    /// Incoming writes a receiver refused (no valid grant for them),
    /// labeled `reason` ([`crate::Refusal::label`]).
    pub refused_writes: Counter<u64>,
}

/// The process's instruments, from the global meter provider (installed by
/// the binary before anything records).
pub fn metrics() -> &'static DkvMetrics {
    static M: OnceLock<DkvMetrics> = OnceLock::new();
    M.get_or_init(|| DkvMetrics::new(&opentelemetry::global::meter("tandem")))
}

impl DkvMetrics {
    /// The instruments on `m` (the global meter's, or a test's).
    pub fn new(m: &Meter) -> Self {
        Self {
            bytes_transferred: m
                .u64_counter("tandem.dkv.bytes_transferred")
                .with_description("Bytes written into remote KV memory")
                .with_unit("By")
                .build(),
            blocks_transferred: m
                .u64_counter("tandem.dkv.blocks_transferred")
                .with_description("KV blocks handed from prefill to decode")
                .build(),
            transfer_latency: m
                .f64_histogram("tandem.dkv.transfer_latency")
                .with_description("Time of one KV transfer until remote completion")
                .with_unit("ms")
                .with_boundaries(TRANSFER_MS_BUCKETS.to_vec())
                .build(),
            transfer_failures: m
                .u64_counter("tandem.dkv.transfer_failures")
                .with_description("KV transfers that failed or were cancelled, by reason")
                .build(),
            watchdog_firings: m
                .u64_counter("tandem.dkv.watchdog_firings")
                .with_description("Decode-stall watchdog firings")
                .build(),
            refused_writes: m
                .u64_counter("tandem.dkv.refused_writes")
                .with_description("Incoming KV writes refused for want of a valid grant, by reason")
                .build(),
        }
    }

    /// Exports the failure counters of `connector` at zero, so that they
    /// exist before the first failure: alerts and dashboards on their rate
    /// then see 0 rather than no series.
    pub fn expose_zeros(&self, connector: &'static str) {
        let c = KeyValue::new("connector", connector);
        for reason in FAILURE_REASONS {
            self.transfer_failures
                .add(0, &[c.clone(), KeyValue::new("reason", reason)]);
        }
        self.watchdog_firings.add(0, &[c]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DkvError;

    #[test]
    fn every_error_reason_is_a_label_exposed_at_zero() {
        let s = String::new;
        let errors = [
            DkvError::UcxUnavailable(s()),
            DkvError::Ucx {
                op: "put",
                status: s(),
            },
            DkvError::OutOfBounds(s()),
            DkvError::InvalidDescriptor(s()),
            DkvError::InvalidRegion(s()),
            DkvError::InvalidLayout(s()),
            DkvError::DeadlineExceeded,
            DkvError::PeerUnreachable(s()),
            DkvError::Shutdown,
            DkvError::Refused(crate::Refusal::Forged),
            DkvError::Unauthenticated(s()),
            DkvError::InvalidKey(s()),
        ];
        for e in &errors {
            assert!(FAILURE_REASONS.contains(&e.reason()), "{e:?}");
        }
    }
}
