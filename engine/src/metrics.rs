//! Engine instruments, recorded through the OpenTelemetry API only: the
//! binary installs the SDK (and exporter) before the first instrument is
//! used; without one every instrument is a no-op.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Instant;

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Gauge, Histogram, UpDownCounter};

use crate::loader::LoadTimes;

/// Buckets for counts of sequences or tokens in one step.
const COUNT_BUCKETS: [f64; 15] = [
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0,
    16384.0,
];

/// Buckets (ms) for short latencies: sub-millisecond queueing up to seconds.
pub const LATENCY_MS_BUCKETS: [f64; 18] = [
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0,
    10000.0, 30000.0, 60000.0,
];

/// What one scheduler step ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchType {
    /// The step runs prompt (context) tokens, possibly alongside decodes.
    ContextEncoding,
    /// The step runs only decode tokens (one generated token per sequence).
    TokenGeneration,
}

impl BatchType {
    pub fn label(self) -> &'static str {
        match self {
            Self::ContextEncoding => "CE",
            Self::TokenGeneration => "TG",
        }
    }

    /// Classifies a step from `(computed, prompt_len, chunk_len)` of each
    /// planned sequence, `computed` taken before the step: a chunk is a
    /// decode token when it is one token past the prompt.
    pub fn classify(chunks: impl IntoIterator<Item = (usize, usize, usize)>) -> Self {
        let all_decode = chunks
            .into_iter()
            .all(|(computed, prompt_len, len)| len == 1 && computed >= prompt_len);
        if all_decode {
            Self::TokenGeneration
        } else {
            Self::ContextEncoding
        }
    }
}

#[derive(Debug)]
pub(crate) struct EngineMetrics {
    pub batch_size: Histogram<u64>,
    pub batch_input_tokens: Histogram<u64>,
    pub num_requests_queued: Gauge<u64>,
    pub num_requests_running: Gauge<u64>,
    pub kv_blocks_used: Gauge<u64>,
    pub kv_blocks_free: Gauge<u64>,
    pub prefix_cache_hits: Counter<u64>,
    pub prefix_cache_misses: Counter<u64>,
    pub preemptions: Counter<u64>,
    /// Responses produced, not yet taken by the layer that sends them on.
    pub num_responses_buffered: UpDownCounter<i64>,
    /// That backlog, sampled at each change.
    pub responses_buffered: Histogram<u64>,
    /// Time responses wait in that backlog.
    pub response_queue_time: Histogram<f64>,
    /// The backlog now (the histogram's sample).
    responses_buffered_now: AtomicI64,
}

pub(crate) fn metrics() -> &'static EngineMetrics {
    static M: OnceLock<EngineMetrics> = OnceLock::new();
    M.get_or_init(|| {
        let m = opentelemetry::global::meter("tandem");
        EngineMetrics {
            batch_size: m
                .u64_histogram("tandem.batch_size")
                .with_description("Sequences in one scheduler step")
                .with_boundaries(COUNT_BUCKETS.to_vec())
                .build(),
            batch_input_tokens: m
                .u64_histogram("tandem.batch_input_tokens")
                .with_description("Tokens (prompt chunks and decode tokens) in one scheduler step")
                .with_boundaries(COUNT_BUCKETS.to_vec())
                .build(),
            num_requests_queued: m
                .u64_gauge("tandem.num_requests_queued")
                .with_description("Requests waiting for admission by the scheduler")
                .build(),
            num_requests_running: m
                .u64_gauge("tandem.num_requests_running")
                .with_description("Sequences admitted and running in the scheduler")
                .build(),
            kv_blocks_used: m
                .u64_gauge("tandem.kv_blocks_used")
                .with_description("KV blocks held by running sequences")
                .build(),
            kv_blocks_free: m
                .u64_gauge("tandem.kv_blocks_free")
                .with_description("KV blocks not held by any sequence (cached or empty)")
                .build(),
            prefix_cache_hits: m
                .u64_counter("tandem.prefix_cache_hits")
                .with_description("Prompt tokens served from the prefix cache at admission")
                .build(),
            prefix_cache_misses: m
                .u64_counter("tandem.prefix_cache_misses")
                .with_description("Prompt tokens not found in the prefix cache at admission")
                .build(),
            preemptions: m
                .u64_counter("tandem.preemptions")
                .with_description("Sequences preempted for lack of KV blocks")
                .build(),
            num_responses_buffered: m
                .i64_up_down_counter("tandem.num_responses_buffered")
                .with_description(
                    "Responses produced (by the scheduler, or received from a decode node) \
                     not yet taken by the layer that sends them on",
                )
                .build(),
            responses_buffered: m
                .u64_histogram("tandem.responses_buffered")
                .with_description("Egress backlog, sampled at each change")
                .with_boundaries(COUNT_BUCKETS.to_vec())
                .build(),
            response_queue_time: m
                .f64_histogram("tandem.response_queue_time")
                .with_description(
                    "Time from a response being produced to the layer that sends it on taking it",
                )
                .with_unit("ms")
                .with_boundaries(LATENCY_MS_BUCKETS.to_vec())
                .build(),
            responses_buffered_now: AtomicI64::new(0),
        }
    })
}

/// The egress backlog: responses produced (tokens and final events, by
/// this process's scheduler or received by the router from a decode node)
/// that the layer sending them on (HTTP, or a node's gRPC stream) has not
/// taken yet. Every `produced` is matched by one `taken` or `discarded`.
pub mod egress {
    use super::*;

    fn change(by: i64) {
        let m = metrics();
        m.num_responses_buffered.add(by, &[]);
        let now = m.responses_buffered_now.fetch_add(by, Ordering::Relaxed) + by;
        m.responses_buffered.record(now.max(0) as u64, &[]);
    }

    /// A response entered the backlog; returns its timestamp.
    pub fn produced() -> Instant {
        change(1);
        Instant::now()
    }

    /// A response produced at `at` left the backlog to be sent on.
    pub fn taken(at: Instant) {
        change(-1);
        metrics()
            .response_queue_time
            .record(at.elapsed().as_secs_f64() * 1e3, &[]);
    }

    /// `n` responses left the backlog unsent (their reader went away).
    pub fn discarded(n: usize) {
        if n > 0 {
            change(-(n as i64));
        }
    }

    /// The backlog now.
    pub fn buffered() -> i64 {
        metrics().responses_buffered_now.load(Ordering::Relaxed)
    }
}

/// Records `tandem.model_load_time{phase}` (ms) for one model load. Call it
/// after the binary installs its meter provider.
pub fn record_load_times(t: &LoadTimes) {
    let h = opentelemetry::global::meter("tandem")
        .f64_histogram("tandem.model_load_time")
        .with_description("Model load time by phase")
        .with_unit("ms")
        .with_boundaries(vec![
            1.0, 10.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0, 10000.0, 30000.0,
            60000.0, 300000.0,
        ])
        .build();
    for (phase, d) in [
        ("read", t.read),
        ("dequantize", t.dequantize),
        ("init", t.init),
        ("total", t.total),
    ] {
        h.record(d.as_secs_f64() * 1e3, &[KeyValue::new("phase", phase)]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_types() {
        // One decode token per sequence past its prompt.
        assert_eq!(
            BatchType::classify([(5, 5, 1), (9, 4, 1)]),
            BatchType::TokenGeneration
        );
        // A prompt chunk, alone or next to decodes.
        assert_eq!(BatchType::classify([(0, 5, 5)]), BatchType::ContextEncoding);
        assert_eq!(
            BatchType::classify([(5, 5, 1), (0, 3, 3)]),
            BatchType::ContextEncoding
        );
        // The last prompt token alone (the rest came from the prefix cache).
        assert_eq!(BatchType::classify([(4, 5, 1)]), BatchType::ContextEncoding);
        // Recomputing a preempted sequence's generated tokens is context work.
        assert_eq!(BatchType::classify([(0, 3, 6)]), BatchType::ContextEncoding);
        assert_eq!(BatchType::ContextEncoding.label(), "CE");
        assert_eq!(BatchType::TokenGeneration.label(), "TG");
    }

    #[test]
    fn instruments_are_noops_without_a_provider() {
        let m = metrics();
        m.batch_size.record(3, &[KeyValue::new("batch_type", "TG")]);
        m.num_responses_buffered.add(1, &[]);
        record_load_times(&LoadTimes::default());
    }
}
