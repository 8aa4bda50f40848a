//! Request-level instruments, recorded through the OpenTelemetry API only
//! (the binary installs the SDK and exporter; `/metrics` renders through
//! the [`MetricsRenderer`] it hands to [`crate::AppState`]).

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Histogram, Meter, UpDownCounter};
use tandem_types::egress::QUEUE_MS_BUCKETS as LATENCY_MS_BUCKETS;

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

/// The process's instruments, from the global meter provider (installed by
/// the binary before anything records).
fn metrics() -> &'static RouterMetrics {
    static M: OnceLock<RouterMetrics> = OnceLock::new();
    M.get_or_init(|| {
        let m = RouterMetrics::new(&opentelemetry::global::meter("tandem"));
        // Every status exported at zero: alerts and dashboards filtering on
        // one (the error ratio) see 0 rather than no series.
        for s in Status::ALL {
            m.requests.add(0, &[KeyValue::new("status", s.label())]);
        }
        m
    })
}

impl RouterMetrics {
    /// The instruments on `m` (the global meter's, or a test's).
    fn new(m: &Meter) -> Self {
        let ms = |name: &'static str, description: &'static str| {
            m.f64_histogram(name)
                .with_description(description)
                .with_unit("ms")
                .with_boundaries(LATENCY_MS_BUCKETS.to_vec())
                .build()
        };
        Self {
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
    }

    fn change_awaiting(&self, by: i64) {
        self.awaiting.add(by, &[]);
        let now = self.awaiting_now.fetch_add(by, Ordering::Relaxed) + by;
        self.awaiting_hist.record(now.max(0) as u64, &[]);
    }

    fn record_status(&self, s: Status) {
        self.requests.add(1, &[KeyValue::new("status", s.label())]);
    }
}

/// Counts a request in the admission backlog (templating, tokenization,
/// routing, the hand-off call) until dropped, in `tandem serve` and the
/// router alike.
#[derive(Debug)]
pub struct AwaitingAdmission(&'static RouterMetrics);

impl AwaitingAdmission {
    pub fn new() -> Self {
        Self::on(metrics())
    }

    fn on(m: &'static RouterMetrics) -> Self {
        m.change_awaiting(1);
        Self(m)
    }
}

impl Default for AwaitingAdmission {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for AwaitingAdmission {
    fn drop(&mut self) {
        self.0.change_awaiting(-1);
    }
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
    pub const ALL: [Status; 4] = [
        Status::Ok,
        Status::ClientError,
        Status::ServerError,
        Status::Cancelled,
    ];

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
    metrics().record_status(Status::of_error(e));
}

/// `decode time / (n - 1)` in ms, when a request produced two tokens or more.
pub fn time_per_output_token(first: Instant, last: Instant, n: u64) -> Option<f64> {
    (n >= 2).then(|| last.duration_since(first).as_secs_f64() * 1e3 / (n - 1) as f64)
}

/// Follows one submitted request's tokens; a request dropped before it
/// finishes counts as cancelled.
#[derive(Debug)]
pub struct RequestTracker {
    m: &'static RouterMetrics,
    arrived: Instant,
    first: Option<Instant>,
    last: Option<Instant>,
    tokens: u64,
    done: bool,
}

impl RequestTracker {
    /// Starts tracking an accepted request of `prompt_tokens` tokens.
    pub fn new(arrived: Instant, prompt_tokens: usize) -> Self {
        Self::on(metrics(), arrived, prompt_tokens)
    }

    fn on(m: &'static RouterMetrics, arrived: Instant, prompt_tokens: usize) -> Self {
        m.input_tokens.add(prompt_tokens as u64, &[]);
        Self {
            m,
            arrived,
            first: None,
            last: None,
            tokens: 0,
            done: false,
        }
    }

    /// A generated token reached the HTTP layer.
    pub fn token(&mut self) {
        self.token_at(Instant::now());
    }

    fn token_at(&mut self, now: Instant) {
        let m = self.m;
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
        self.finish_at(Instant::now(), error, count_error);
    }

    fn finish_at(&mut self, now: Instant, error: Option<&ApiError>, count_error: bool) {
        if self.done {
            return;
        }
        self.done = true;
        let m = self.m;
        m.request_latency
            .record(ms(now.saturating_duration_since(self.arrived)), &[]);
        match error {
            None => {
                if let (Some(first), Some(last)) = (self.first, self.last)
                    && let Some(t) = time_per_output_token(first, last, self.tokens)
                {
                    m.time_per_output_token.record(t, &[]);
                }
                m.record_status(Status::Ok);
            }
            Some(e) if count_error => m.record_status(Status::of_error(e)),
            Some(_) => {}
        }
    }
}

impl Drop for RequestTracker {
    fn drop(&mut self) {
        if !self.done {
            self.done = true;
            self.m.record_status(Status::Cancelled);
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
    use std::collections::BTreeMap;
    use std::time::Duration;

    use tandem_testkit::{Point, TestMeter};

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
            Status::of_error(&ApiError::internal("x")),
            Status::ServerError
        );
        assert_eq!(
            Status::of_error(&ApiError::Overloaded("x".into())),
            Status::ServerError
        );
        assert_eq!(Status::Cancelled.label(), "cancelled");
    }

    /// The router's instruments on `meter`'s provider (leaked: trackers
    /// hold them for `'static`, as they hold the process's).
    fn metrics(meter: &TestMeter) -> &'static RouterMetrics {
        Box::leak(Box::new(RouterMetrics::new(&meter.meter())))
    }

    /// (sum or value, count) of the unlabeled point of `name`, asserting
    /// its unit; (0, 0) if nothing was recorded.
    fn read(points: &[Point], name: &str, unit: &str) -> (f64, u64) {
        let found: Vec<&Point> = points.iter().filter(|p| p.name == name).collect();
        match found.as_slice() {
            [] => (0.0, 0),
            [p] if p.labels.is_empty() && p.unit == unit => (p.value, p.count),
            _ => panic!("{name}: {found:?}"),
        }
    }

    fn by_status(points: &[Point]) -> BTreeMap<String, f64> {
        points
            .iter()
            .filter(|p| p.name == "tandem.requests")
            .map(|p| match p.labels.as_slice() {
                [(k, v)] if k == "status" => (v.clone(), p.value),
                other => panic!("tandem.requests labels {other:?}"),
            })
            .collect()
    }

    fn close(got: (f64, u64), want: (f64, u64), what: &str) {
        assert!(
            got.1 == want.1 && (got.0 - want.0).abs() < 1e-6,
            "{what}: {got:?} != {want:?}"
        );
    }

    /// TTFT once per request, ITL for every later token, TPOT and latency
    /// once per finished request, and one status per request: `ok`,
    /// `cancelled` when dropped unfinished, an error's class only when the
    /// tracker is to count it.
    #[test]
    fn tracker_records_latencies_and_one_status_per_request() {
        let meter = TestMeter::new();
        let m = metrics(&meter);
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);

        let mut t = RequestTracker::on(m, t0, 7);
        for ms in [10, 30, 60] {
            t.token_at(at(ms));
        }
        t.finish_at(at(65), None, true);
        t.finish_at(at(99), None, true); // a second finish changes nothing
        drop(t);
        let p = meter.points();
        close(
            read(&p, "tandem.time_to_first_token", "ms"),
            (10.0, 1),
            "ttft",
        );
        close(
            read(&p, "tandem.inter_token_latency", "ms"),
            (50.0, 2),
            "itl",
        );
        // (60 - 10) ms over 3 - 1 tokens.
        close(
            read(&p, "tandem.time_per_output_token", "ms"),
            (25.0, 1),
            "tpot",
        );
        close(
            read(&p, "tandem.request_latency", "ms"),
            (65.0, 1),
            "latency",
        );
        close(read(&p, "tandem.input_tokens", ""), (7.0, 1), "input");
        close(read(&p, "tandem.output_tokens", ""), (3.0, 1), "output");
        assert_eq!(by_status(&p), BTreeMap::from([("ok".into(), 1.0)]));

        // Dropped after two tokens: cancelled; no TPOT or latency sample.
        let mut c = RequestTracker::on(m, t0, 2);
        c.token_at(at(5));
        c.token_at(at(8));
        drop(c);
        // One token, then finished: no TPOT (it needs two).
        let mut one = RequestTracker::on(m, t0, 1);
        one.token_at(at(4));
        one.finish_at(at(6), None, true);
        // Failures: counted here only when no caller counts them.
        let mut bad = RequestTracker::on(m, t0, 1);
        bad.finish_at(at(1), Some(&ApiError::invalid("x", None)), true);
        let mut counted_elsewhere = RequestTracker::on(m, t0, 1);
        counted_elsewhere.finish_at(at(1), Some(&ApiError::internal("x")), false);
        drop((bad, counted_elsewhere));

        let p = meter.points();
        close(
            read(&p, "tandem.time_to_first_token", "ms"),
            (19.0, 3),
            "ttft",
        );
        close(
            read(&p, "tandem.inter_token_latency", "ms"),
            (53.0, 3),
            "itl",
        );
        close(
            read(&p, "tandem.time_per_output_token", "ms"),
            (25.0, 1),
            "tpot",
        );
        close(
            read(&p, "tandem.request_latency", "ms"),
            (73.0, 4),
            "latency",
        );
        close(read(&p, "tandem.input_tokens", ""), (12.0, 1), "input");
        close(read(&p, "tandem.output_tokens", ""), (6.0, 1), "output");
        assert_eq!(
            by_status(&p),
            BTreeMap::from([
                ("cancelled".into(), 1.0),
                ("client_error".into(), 1.0),
                ("ok".into(), 2.0),
            ])
        );
    }

    /// Every request counted into the admission backlog leaves it on drop.
    #[test]
    fn admission_backlog_returns_to_zero() {
        let meter = TestMeter::new();
        let m = metrics(&meter);
        let a = AwaitingAdmission::on(m);
        let b = AwaitingAdmission::on(m);
        let p = meter.points();
        close(
            read(&p, "tandem.num_requests_awaiting_admission", ""),
            (2.0, 1),
            "backlog",
        );
        drop(a);
        drop(b);
        let p = meter.points();
        close(
            read(&p, "tandem.num_requests_awaiting_admission", ""),
            (0.0, 1),
            "backlog",
        );
        // Sampled at each change: 1, 2, 1, 0.
        close(
            read(&p, "tandem.requests_awaiting_admission", ""),
            (4.0, 4),
            "samples",
        );
        assert_eq!(m.awaiting_now.load(Ordering::Relaxed), 0);
    }
}
