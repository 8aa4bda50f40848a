//! The egress backlog: responses produced (tokens and final events, by a
//! scheduler or received by the router from a decode node) that the layer
//! sending them on (HTTP, or a node's gRPC stream) has not taken yet. Every
//! [`produced`] is matched by one [`taken`] or [`discarded`].
//!
//! Recorded through the OpenTelemetry API on the global meter: without an
//! SDK installed by the binary, every call is a no-op.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Instant;

use opentelemetry::metrics::{Histogram, Meter, UpDownCounter};

/// Buckets of the backlog histogram (responses).
pub const BACKLOG_BUCKETS: [f64; 15] = [
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0,
    16384.0,
];

/// Buckets (ms) of the queue-time histogram.
pub const QUEUE_MS_BUCKETS: [f64; 18] = [
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0,
    10000.0, 30000.0, 60000.0,
];

/// The backlog's instruments.
#[derive(Debug)]
pub struct Egress {
    /// Responses produced, not yet taken.
    buffered: UpDownCounter<i64>,
    /// That backlog, sampled at each change.
    sampled: Histogram<u64>,
    /// Time responses wait in the backlog.
    queue_time: Histogram<f64>,
    now: AtomicI64,
}

fn global() -> &'static Egress {
    static E: OnceLock<Egress> = OnceLock::new();
    E.get_or_init(|| Egress::new(&opentelemetry::global::meter("tandem")))
}

/// A response entered the backlog; returns its timestamp.
pub fn produced() -> Instant {
    global().produced()
}

/// A response produced at `at` left the backlog to be sent on.
pub fn taken(at: Instant) {
    global().taken(at);
}

/// `n` responses left the backlog unsent (their reader went away).
pub fn discarded(n: usize) {
    global().discarded(n);
}

/// The backlog now.
pub fn buffered() -> i64 {
    global().buffered()
}

impl Egress {
    /// The instruments on `m` (the global meter's, or a test's).
    pub fn new(m: &Meter) -> Self {
        Self {
            buffered: m
                .i64_up_down_counter("tandem.num_responses_buffered")
                .with_description(
                    "Responses produced (by the scheduler, or received from a decode node) \
                     not yet taken by the layer that sends them on",
                )
                .build(),
            sampled: m
                .u64_histogram("tandem.responses_buffered")
                .with_description("Egress backlog, sampled at each change")
                .with_boundaries(BACKLOG_BUCKETS.to_vec())
                .build(),
            queue_time: m
                .f64_histogram("tandem.response_queue_time")
                .with_description(
                    "Time from a response being produced to the layer that sends it on taking it",
                )
                .with_unit("ms")
                .with_boundaries(QUEUE_MS_BUCKETS.to_vec())
                .build(),
            now: AtomicI64::new(0),
        }
    }

    fn change(&self, by: i64) {
        self.buffered.add(by, &[]);
        let now = self.now.fetch_add(by, Ordering::Relaxed) + by;
        self.sampled.record(now.max(0) as u64, &[]);
    }

    pub fn produced(&self) -> Instant {
        self.change(1);
        Instant::now()
    }

    pub fn taken(&self, at: Instant) {
        self.change(-1);
        self.queue_time
            .record(at.elapsed().as_secs_f64() * 1e3, &[]);
    }

    pub fn discarded(&self, n: usize) {
        if n > 0 {
            self.change(-(n as i64));
        }
    }

    pub fn buffered(&self) -> i64 {
        self.now.load(Ordering::Relaxed)
    }
}
