//! The routing metrics: time spent hashing, looking up and choosing, the
//! chosen worker's overlap, the requests sent with a prefix source, the lag
//! of workers' cache events, and the prefix index's size.

use std::sync::OnceLock;

use opentelemetry::metrics::{Counter, Histogram, UpDownCounter};

pub(super) struct ClusterMetrics {
    pub(super) hashing: Histogram<f64>,
    pub(super) lookup: Histogram<f64>,
    pub(super) scheduling: Histogram<f64>,
    pub(super) overlap: Histogram<u64>,
    pub(super) prefix_sources: Counter<u64>,
    pub(super) event_lag: Histogram<f64>,
    pub(super) index_blocks: UpDownCounter<i64>,
    pub(super) index_bytes: UpDownCounter<i64>,
}

const US_BUCKETS: [f64; 12] = [
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 5000.0, 20000.0,
];

pub(super) fn metrics() -> &'static ClusterMetrics {
    static M: OnceLock<ClusterMetrics> = OnceLock::new();
    M.get_or_init(|| {
        let m = opentelemetry::global::meter("tandem");
        let us = |name: &'static str, d: &'static str| {
            m.f64_histogram(name)
                .with_description(d)
                .with_unit("us")
                .with_boundaries(US_BUCKETS.to_vec())
                .build()
        };
        ClusterMetrics {
            hashing: us(
                "tandem.router.hashing_time",
                "Time hashing a prompt's blocks",
            ),
            lookup: us(
                "tandem.router.index_lookup_time",
                "Time looking up prefix overlap in every worker's index",
            ),
            scheduling: us("tandem.router.scheduling_time", "Time choosing workers"),
            overlap: m
                .u64_histogram("tandem.router.chosen_overlap")
                .with_description("Prompt blocks already cached on the chosen decode worker")
                .build(),
            prefix_sources: m
                .u64_counter("tandem.router.prefix_sources")
                .with_description(
                    "Requests a decode worker took naming another worker that holds more of the prompt's leading blocks",
                )
                .build(),
            event_lag: m
                .f64_histogram("tandem.router.event_lag")
                .with_description(
                    "Time from a worker emitting a cache event to this router applying it",
                )
                .with_unit("ms")
                .with_boundaries(vec![
                    0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 500.0, 2000.0,
                ])
                .build(),
            index_blocks: m
                .i64_up_down_counter("tandem.router.prefix_index_blocks")
                .with_description("Cached blocks the prefix index holds, over every worker")
                .build(),
            index_bytes: m
                .i64_up_down_counter("tandem.router.prefix_index_bytes")
                .with_description("Memory of the prefix index's hash sets (their capacity)")
                .with_unit("By")
                .build(),
        }
    })
}
