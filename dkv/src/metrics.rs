//! dkv instruments, recorded through the OpenTelemetry API only (the binary
//! installs the SDK; without one they are no-ops). Every instrument carries
//! the `connector` label (`ucx` or `local`).

use std::sync::OnceLock;

use opentelemetry::metrics::{Counter, Histogram};

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
    /// (deadline|peer|bounds|cancelled|transport).
    pub transfer_failures: Counter<u64>,
    /// Decode-stall watchdog firings (recorded by the decode node).
    pub watchdog_firings: Counter<u64>,
}

pub fn metrics() -> &'static DkvMetrics {
    static M: OnceLock<DkvMetrics> = OnceLock::new();
    M.get_or_init(|| {
        let m = opentelemetry::global::meter("tandem");
        DkvMetrics {
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
        }
    })
}
