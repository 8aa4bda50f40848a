//! Engine instruments, recorded through the OpenTelemetry API only: the
//! binary installs the SDK (and exporter) before the first instrument is
//! used; without one every instrument is a no-op.

use std::sync::OnceLock;

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Gauge, Histogram, Meter};

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

/// Buckets (ms) for one forward call: a small model's decode step (a few
/// ms) finely enough to compare with an engine profile, up to long prompts.
const STEP_MS_BUCKETS: [f64; 22] = [
    0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 15.0, 20.0, 30.0, 50.0, 75.0, 100.0, 150.0,
    200.0, 300.0, 500.0, 1000.0, 2000.0, 5000.0,
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
    pub forward_time: Histogram<f64>,
    pub num_requests_queued: Gauge<u64>,
    pub num_requests_running: Gauge<u64>,
    pub kv_blocks_used: Gauge<u64>,
    pub kv_blocks_free: Gauge<u64>,
    pub prefix_cache_hits: Counter<u64>,
    pub prefix_cache_misses: Counter<u64>,
    pub preemptions: Counter<u64>,
}

/// The process's instruments, from the global meter provider (installed by
/// the binary before anything records).
pub(crate) fn metrics() -> &'static EngineMetrics {
    static M: OnceLock<EngineMetrics> = OnceLock::new();
    M.get_or_init(|| EngineMetrics::new(&opentelemetry::global::meter("tandem")))
}

impl EngineMetrics {
    /// The instruments on `m` (the global meter's, or a test's).
    pub(crate) fn new(m: &Meter) -> Self {
        Self {
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
            forward_time: m
                .f64_histogram("tandem.forward_time")
                .with_description(
                    "Wall time of one scheduler step's forward pass (what an engine profile predicts)",
                )
                .with_unit("ms")
                .with_boundaries(STEP_MS_BUCKETS.to_vec())
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
                .with_description("Prompt tokens not computed here: found in the pool or a KV tier at admission, or fetched from a peer")
                .build(),
            prefix_cache_misses: m
                .u64_counter("tandem.prefix_cache_misses")
                .with_description("Prompt tokens computed here or by a prefill node: found in no cache, tier or peer")
                .build(),
            preemptions: m
                .u64_counter("tandem.preemptions")
                .with_description("Sequences preempted for lack of KV blocks")
                .build(),
        }
    }
}

/// Records `tandem.model_load_time{phase}` (ms) for one model load. Call it
/// after the binary installs its meter provider.
pub fn record_load_times(t: &LoadTimes) {
    record_load_times_on(&opentelemetry::global::meter("tandem"), t);
}

fn record_load_times_on(m: &Meter, t: &LoadTimes) {
    let h = m
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
    use std::time::{Duration, Instant};

    use tandem_testkit::TestMeter;

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

    /// Every response that enters the egress backlog leaves it once: the
    /// up-down counter returns to 0, the histogram samples the backlog at
    /// each change, queue time is sampled for responses taken (not for
    /// discarded ones).
    #[test]
    fn egress_backlog_returns_to_zero() {
        let meter = TestMeter::new();
        let m = tandem_types::egress::Egress::new(&meter.meter());
        let at: Vec<Instant> = (0..3).map(|_| m.produced()).collect();
        assert_eq!(m.buffered(), 3);
        let p = meter.points();
        assert_eq!(p.only("tandem.num_responses_buffered").value, 3.0);
        m.taken(at[0]);
        m.discarded(0);
        m.discarded(2);
        assert_eq!(m.buffered(), 0);

        let p = meter.points();
        assert_eq!(p.only("tandem.num_responses_buffered").value, 0.0);
        // Samples 1, 2, 3 (produced), 2 (taken), 0 (two discarded at once).
        let sampled = p.only("tandem.responses_buffered");
        assert_eq!((sampled.count, sampled.value), (5, 8.0), "{sampled:?}");
        assert_eq!(sampled.bounds, COUNT_BUCKETS);
        let queued = p.only("tandem.response_queue_time");
        assert_eq!((queued.count, queued.unit.as_str()), (1, "ms"));
        assert!(queued.value >= 0.0 && queued.value < 10_000.0, "{queued:?}");
        assert_eq!(queued.bounds, LATENCY_MS_BUCKETS);
    }

    /// The scheduler's instruments export under their documented names,
    /// kinds, units and buckets, with the labels they are given.
    #[test]
    fn scheduler_instruments_export_their_names_and_labels() {
        let meter = TestMeter::new();
        let m = EngineMetrics::new(&meter.meter());
        let tg = [KeyValue::new(
            "batch_type",
            BatchType::TokenGeneration.label(),
        )];
        m.batch_size.record(3, &tg);
        m.batch_size.record(5, &tg);
        m.batch_input_tokens.record(40, &[]);
        m.forward_time.record(3.5, &tg);
        m.num_requests_queued.record(2, &[]);
        m.num_requests_running.record(7, &[]);
        m.kv_blocks_used.record(11, &[]);
        m.kv_blocks_free.record(13, &[]);
        m.prefix_cache_hits.add(16, &[]);
        m.prefix_cache_misses.add(4, &[]);
        m.preemptions.add(1, &[]);
        let p = meter.points();
        let batch = match p.named("tandem.batch_size").collect::<Vec<_>>().as_slice() {
            [b] => (*b).clone(),
            other => panic!("{other:?}"),
        };
        assert_eq!(batch.labels, [("batch_type".into(), "TG".into())]);
        assert_eq!((batch.count, batch.value), (2, 8.0));
        assert_eq!(batch.bounds, COUNT_BUCKETS);
        let fwd = p.point("tandem.forward_time", &[("batch_type", "TG")]);
        assert_eq!((fwd.count, fwd.value, fwd.unit.as_str()), (1, 3.5, "ms"));
        assert_eq!(fwd.bounds, STEP_MS_BUCKETS);
        for (name, value) in [
            ("tandem.num_requests_queued", 2.0),
            ("tandem.num_requests_running", 7.0),
            ("tandem.kv_blocks_used", 11.0),
            ("tandem.kv_blocks_free", 13.0),
            ("tandem.prefix_cache_hits", 16.0),
            ("tandem.prefix_cache_misses", 4.0),
            ("tandem.preemptions", 1.0),
        ] {
            assert_eq!(p.only(name).value, value, "{name}");
        }
        assert_eq!(p.only("tandem.batch_input_tokens").value, 40.0);
    }

    /// One load-time sample per phase, in milliseconds.
    #[test]
    fn load_times_are_recorded_per_phase() {
        let meter = TestMeter::new();
        let ms = Duration::from_millis;
        let t = LoadTimes {
            read: ms(12),
            dequantize: ms(3),
            init: ms(5),
            total: ms(20),
        };
        record_load_times_on(&meter.meter(), &t);
        let p = meter.points();
        let mut phases: Vec<(String, f64, u64)> = p
            .named("tandem.model_load_time")
            .map(|pt| {
                assert_eq!(pt.unit, "ms");
                match pt.labels.as_slice() {
                    [(k, v)] if k == "phase" => (v.clone(), pt.value, pt.count),
                    other => panic!("labels {other:?}"),
                }
            })
            .collect();
        phases.sort_by(|a, b| a.0.cmp(&b.0));
        let want = [
            ("dequantize", 3.0),
            ("init", 5.0),
            ("read", 12.0),
            ("total", 20.0),
        ];
        assert_eq!(phases.len(), want.len(), "{phases:?}");
        for ((phase, value, count), (wp, wv)) in phases.iter().zip(want) {
            assert_eq!((phase.as_str(), count), (wp, &1));
            assert!((value - wv).abs() < 1e-9, "{phase}: {value}");
        }
    }
}
