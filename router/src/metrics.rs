//! Request-level instruments, recorded through the OpenTelemetry API only
//! (the binary installs the SDK and exporter; `/metrics` renders through
//! the [`MetricsRenderer`] it hands to [`crate::AppState`]).

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Histogram, UpDownCounter};
use tandem_engine::metrics::LATENCY_MS_BUCKETS;

use crate::ApiError;

/// Renders the Prometheus text exposition served on `/metrics`.
pub type MetricsRenderer = Arc<dyn Fn() -> String + Send + Sync>;

#[derive(Debug)]
struct RouterMetrics {
    time_to_first_token: Histogram<f64>,
    inter_token_latency: Histogram<f64>,
    time_per_output_token: Histogram<f64>,
    request_latency: Histogram<f64>,
    input_tokens: Counter<u64>,
    output_tokens: Counter<u64>,
    requests: Counter<u64>,
    awaiting: UpDownCounter<i64>,
    awaiting_hist: Histogram<u64>,
    awaiting_now: AtomicI64,
}

fn metrics() -> &'static RouterMetrics {
    static M: OnceLock<RouterMetrics> = OnceLock::new();
    M.get_or_init(|| {
        let m = opentelemetry::global::meter("tandem");
        let ms = |name: &'static str, description: &'static str| {
            m.f64_histogram(name)
                .with_description(description)
                .with_unit("ms")
                .with_boundaries(LATENCY_MS_BUCKETS.to_vec())
                .build()
        };
        RouterMetrics {
            time_to_first_token: ms(
                "tandem.time_to_first_token",
                "Time from a request's arrival to its first generated token",
            ),
            inter_token_latency: ms(
                "tandem.inter_token_latency",
                "Time between consecutive generated tokens of a request",
            ),
            time_per_output_token: ms(
                "tandem.time_per_output_token",
                "Per request: decode time / (output tokens - 1)",
            ),
            request_latency: ms(
                "tandem.request_latency",
                "Time from a request's arrival to its last event",
            ),
            input_tokens: m
                .u64_counter("tandem.input_tokens")
                .with_description("Prompt tokens of accepted requests")
                .build(),
            output_tokens: m
                .u64_counter("tandem.output_tokens")
                .with_description("Generated tokens")
                .build(),
            requests: m
                .u64_counter("tandem.requests")
                .with_description("Finished requests by status")
                .build(),
            awaiting: m
                .i64_up_down_counter("tandem.num_requests_awaiting_admission")
                .with_description(
                    "Requests accepted by the HTTP front end, not yet handed to a worker \
                     (the local scheduler's queue or a decode node)",
                )
                .build(),
            awaiting_hist: m
                .u64_histogram("tandem.requests_awaiting_admission")
                .with_description("Admission backlog, sampled at each change")
                .build(),
            awaiting_now: AtomicI64::new(0),
        }
    })
}

/// Counts a request in the admission backlog (templating, tokenization,
/// routing, the hand-off call) until dropped, in `tandem serve` and the
/// router alike.
#[derive(Debug)]
pub struct AwaitingAdmission(());

impl AwaitingAdmission {
    pub fn new() -> Self {
        change_awaiting(1);
        Self(())
    }
}

impl Default for AwaitingAdmission {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for AwaitingAdmission {
    fn drop(&mut self) {
        change_awaiting(-1);
    }
}

fn change_awaiting(by: i64) {
    let m = metrics();
    m.awaiting.add(by, &[]);
    let now = m.awaiting_now.fetch_add(by, Ordering::Relaxed) + by;
    m.awaiting_hist.record(now.max(0) as u64, &[]);
}

/// How a request ended (the `status` label of `tandem.requests`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Ok,
    ClientError,
    ServerError,
    Cancelled,
}

impl Status {
    pub fn label(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::ClientError => "client_error",
            Self::ServerError => "server_error",
            Self::Cancelled => "cancelled",
        }
    }

    pub fn of_error(e: &ApiError) -> Self {
        if e.status().is_server_error() {
            Self::ServerError
        } else {
            Self::ClientError
        }
    }
}

/// Counts a request that failed before it reached the scheduler.
pub fn record_rejected(e: &ApiError) {
    record_status(Status::of_error(e));
}

fn record_status(s: Status) {
    metrics()
        .requests
        .add(1, &[KeyValue::new("status", s.label())]);
}

/// `decode time / (n - 1)` in ms, when a request produced two tokens or more.
pub fn time_per_output_token(first: Instant, last: Instant, n: u64) -> Option<f64> {
    (n >= 2).then(|| last.duration_since(first).as_secs_f64() * 1e3 / (n - 1) as f64)
}

/// Follows one submitted request's tokens; a request dropped before it
/// finishes counts as cancelled.
#[derive(Debug)]
pub struct RequestTracker {
    arrived: Instant,
    first: Option<Instant>,
    last: Option<Instant>,
    tokens: u64,
    done: bool,
}

impl RequestTracker {
    /// Starts tracking an accepted request of `prompt_tokens` tokens.
    pub fn new(arrived: Instant, prompt_tokens: usize) -> Self {
        metrics().input_tokens.add(prompt_tokens as u64, &[]);
        Self {
            arrived,
            first: None,
            last: None,
            tokens: 0,
            done: false,
        }
    }

    /// A generated token reached the HTTP layer.
    pub fn token(&mut self) {
        let now = Instant::now();
        let m = metrics();
        match self.last {
            None => m
                .time_to_first_token
                .record(ms(now.duration_since(self.arrived)), &[]),
            Some(prev) => m
                .inter_token_latency
                .record(ms(now.duration_since(prev)), &[]),
        }
        self.first.get_or_insert(now);
        self.last = Some(now);
        self.tokens += 1;
        m.output_tokens.add(1, &[]);
    }

    /// The request ended: successfully, or with `error` (recorded only when
    /// `count_error`, i.e. when no caller will count it).
    pub fn finish(&mut self, error: Option<&ApiError>, count_error: bool) {
        if self.done {
            return;
        }
        self.done = true;
        let m = metrics();
        m.request_latency.record(ms(self.arrived.elapsed()), &[]);
        match error {
            None => {
                if let (Some(first), Some(last)) = (self.first, self.last)
                    && let Some(t) = time_per_output_token(first, last, self.tokens)
                {
                    m.time_per_output_token.record(t, &[]);
                }
                record_status(Status::Ok);
            }
            Some(e) if count_error => record_status(Status::of_error(e)),
            Some(_) => {}
        }
    }
}

impl Drop for RequestTracker {
    fn drop(&mut self) {
        if !self.done {
            self.done = true;
            record_status(Status::Cancelled);
        }
    }
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn tpot() {
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_millis(30);
        assert_eq!(time_per_output_token(t0, t1, 0), None);
        assert_eq!(time_per_output_token(t0, t0, 1), None);
        let t = time_per_output_token(t0, t1, 4).unwrap();
        assert!((t - 10.0).abs() < 1e-9, "{t}");
    }

    #[test]
    fn statuses() {
        assert_eq!(
            Status::of_error(&ApiError::invalid("x", None)),
            Status::ClientError
        );
        assert_eq!(
            Status::of_error(&ApiError::Internal("x".into())),
            Status::ServerError
        );
        assert_eq!(
            Status::of_error(&ApiError::Overloaded("x".into())),
            Status::ServerError
        );
        assert_eq!(Status::Cancelled.label(), "cancelled");
    }

    #[test]
    fn tracker_without_a_provider() {
        let mut t = RequestTracker::new(Instant::now(), 3);
        t.token();
        t.token();
        t.finish(None, true);
        drop(RequestTracker::new(Instant::now(), 1));
    }
}
