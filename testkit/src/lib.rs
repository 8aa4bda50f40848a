//! Helpers shared by the tests of several crates; a dev-dependency only.
//!
//! [`TestMeter`]: a meter provider of a test's own whose instruments are
//! read back in memory (OpenTelemetry's `InMemoryMetricExporter` behind a
//! `PeriodicReader`, flushed on demand), as [`Points`]: one [`Point`] per
//! data point, with lookups by instrument name and labels.

pub mod tls;

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Deref;
use std::path::PathBuf;

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Meter, MeterProvider as _};
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, Metric, MetricData};
use opentelemetry_sdk::metrics::{InMemoryMetricExporter, PeriodicReader, SdkMeterProvider};

/// Something the test command caches for the tests (a model, a venv, a
/// tool): the path in the environment variable `var`, else
/// `~/.cache/tandem/<rel>`, where `scripts/test.sh` puts it.
pub fn cached_path(var: &str, rel: &str) -> PathBuf {
    std::env::var_os(var).map(PathBuf::from).unwrap_or_else(|| {
        let home = std::env::var_os("HOME")
            .map(PathBuf::from)
            .unwrap_or_default();
        home.join(".cache/tandem").join(rel)
    })
}

/// A meter provider whose recordings a test reads back in memory.
#[derive(Clone)]
pub struct TestMeter {
    provider: SdkMeterProvider,
    exporter: InMemoryMetricExporter,
}

impl fmt::Debug for TestMeter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TestMeter").finish_non_exhaustive()
    }
}

impl Default for TestMeter {
    fn default() -> Self {
        Self::new()
    }
}

impl TestMeter {
    pub fn new() -> Self {
        let exporter = InMemoryMetricExporter::default();
        let provider = SdkMeterProvider::builder()
            .with_reader(PeriodicReader::builder(exporter.clone()).build())
            .build();
        Self { provider, exporter }
    }

    /// The provider, e.g. to install as the global one.
    pub fn provider(&self) -> &SdkMeterProvider {
        &self.provider
    }

    /// A meter of this provider, with the scope the code under test uses.
    pub fn meter(&self) -> Meter {
        self.provider.meter("tandem")
    }

    /// Every data point recorded so far (cumulative), in export order.
    pub fn points(&self) -> Points {
        self.exporter.reset();
        self.provider
            .force_flush()
            .expect("flushing the test meter");
        let mut out = Vec::new();
        for rm in self
            .exporter
            .get_finished_metrics()
            .expect("reading the test meter")
        {
            for m in rm.scope_metrics().flat_map(|s| s.metrics()) {
                match m.data() {
                    AggregatedMetrics::F64(d) => add(&mut out, m, d, |x| x),
                    AggregatedMetrics::U64(d) => add(&mut out, m, d, |x| x as f64),
                    AggregatedMetrics::I64(d) => add(&mut out, m, d, |x| x as f64),
                }
            }
        }
        Points(out)
    }
}

/// The kind of instrument a point came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Counters and up-down counters.
    Sum,
    Gauge,
    Histogram,
}

/// One exported data point: a sum's or gauge's value (`count` 1), or a
/// histogram's sum, count and bucket bounds.
#[derive(Debug, Clone, PartialEq)]
pub struct Point {
    pub name: String,
    pub unit: String,
    pub kind: Kind,
    /// Sorted by key.
    pub labels: Vec<(String, String)>,
    pub value: f64,
    pub count: u64,
    /// A histogram's explicit bucket bounds; empty otherwise.
    pub bounds: Vec<f64>,
}

impl Point {
    /// The value of label `key`, if the point has it.
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// Whether the point has exactly these labels (in any order).
    pub fn has_labels(&self, labels: &[(&str, &str)]) -> bool {
        self.labels.len() == labels.len() && labels.iter().all(|(k, v)| self.label(k) == Some(*v))
    }
}

fn add<T: Copy>(out: &mut Vec<Point>, m: &Metric, d: &MetricData<T>, f: impl Fn(T) -> f64) {
    let point = |attrs: &mut dyn Iterator<Item = &KeyValue>, kind, value, count, bounds| {
        let mut labels: Vec<(String, String)> = attrs
            .map(|kv| (kv.key.to_string(), kv.value.to_string()))
            .collect();
        labels.sort();
        Point {
            name: m.name().to_owned(),
            unit: m.unit().to_owned(),
            kind,
            labels,
            value,
            count,
            bounds,
        }
    };
    match d {
        MetricData::Sum(s) => out.extend(
            s.data_points()
                .map(|p| point(&mut p.attributes(), Kind::Sum, f(p.value()), 1, vec![])),
        ),
        MetricData::Gauge(g) => out.extend(
            g.data_points()
                .map(|p| point(&mut p.attributes(), Kind::Gauge, f(p.value()), 1, vec![])),
        ),
        MetricData::Histogram(h) => out.extend(h.data_points().map(|p| {
            let bounds = p.bounds().collect();
            point(
                &mut p.attributes(),
                Kind::Histogram,
                f(p.sum()),
                p.count(),
                bounds,
            )
        })),
        MetricData::ExponentialHistogram(_) => {
            panic!("{}: no exponential histograms are configured", m.name())
        }
    }
}

/// The points of one read, with lookups; derefs to the slice of points.
#[derive(Debug, Clone, PartialEq)]
pub struct Points(pub Vec<Point>);

impl Deref for Points {
    type Target = [Point];

    fn deref(&self) -> &[Point] {
        &self.0
    }
}

impl Points {
    /// The points of instrument `name`.
    pub fn named<'a, 'n>(&'a self, name: &'n str) -> impl Iterator<Item = &'a Point> + use<'a, 'n> {
        self.0.iter().filter(move |p| p.name == name)
    }

    /// The single point of `name` if there is exactly one and it carries
    /// no labels.
    pub fn try_only(&self, name: &str) -> Option<&Point> {
        let mut found = self.named(name);
        match (found.next(), found.next()) {
            (Some(p), None) if p.labels.is_empty() => Some(p),
            _ => None,
        }
    }

    /// The single point of `name`, which must carry no labels; panics
    /// otherwise (none, several, or labeled).
    pub fn only(&self, name: &str) -> &Point {
        self.try_only(name).unwrap_or_else(|| {
            let found: Vec<&Point> = self.named(name).collect();
            panic!("{name}: expected one unlabeled point, found {found:?}")
        })
    }

    /// The one point of `name` with exactly `labels`; panics when there is
    /// not exactly one.
    pub fn point(&self, name: &str, labels: &[(&str, &str)]) -> &Point {
        let found: Vec<&Point> = self.named(name).filter(|p| p.has_labels(labels)).collect();
        match found.as_slice() {
            [p] => p,
            _ => panic!("{name}{labels:?}: {found:?} among {:#?}", self.0),
        }
    }

    /// The values of `name`'s points summed by the value of `label` ("" for
    /// points without it).
    pub fn by_label(&self, name: &str, label: &str) -> BTreeMap<String, f64> {
        let mut out = BTreeMap::new();
        for p in self.named(name) {
            *out.entry(p.label(label).unwrap_or_default().to_owned())
                .or_default() += p.value;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_back_sums_gauges_and_histograms() {
        let t = TestMeter::new();
        let m = t.meter();
        let c = m.u64_counter("c").build();
        c.add(2, &[KeyValue::new("k", "a")]);
        c.add(3, &[KeyValue::new("k", "b")]);
        c.add(4, &[KeyValue::new("k", "a")]);
        let u = m.i64_up_down_counter("u").build();
        u.add(5, &[]);
        u.add(-2, &[]);
        let g = m.f64_gauge("g").with_unit("ms").build();
        g.record(1.5, &[]);
        let h = m
            .f64_histogram("h")
            .with_unit("ms")
            .with_boundaries(vec![1.0, 10.0])
            .build();
        h.record(0.5, &[KeyValue::new("z", "1"), KeyValue::new("a", "2")]);
        h.record(20.0, &[KeyValue::new("a", "2"), KeyValue::new("z", "1")]);

        let p = t.points();
        assert_eq!(
            p.by_label("c", "k"),
            BTreeMap::from([("a".into(), 6.0), ("b".into(), 3.0)])
        );
        assert_eq!(p.point("c", &[("k", "b")]).value, 3.0);
        let up = p.only("u");
        assert_eq!((up.kind, up.value, up.count), (Kind::Sum, 3.0, 1));
        let gauge = p.only("g");
        assert_eq!(
            (gauge.kind, gauge.value, gauge.unit.as_str()),
            (Kind::Gauge, 1.5, "ms")
        );
        let hist = p.point("h", &[("z", "1"), ("a", "2")]);
        assert_eq!(
            (hist.kind, hist.value, hist.count),
            (Kind::Histogram, 20.5, 2)
        );
        assert_eq!(hist.bounds, [1.0, 10.0]);
        assert_eq!(
            hist.labels,
            [("a".into(), "2".into()), ("z".into(), "1".into())]
        );
        assert_eq!(hist.label("z"), Some("1"));
        assert_eq!(p.named("nothing").count(), 0);
        assert!(p.by_label("nothing", "k").is_empty());

        // Cumulative: a second read sees the totals so far.
        c.add(1, &[KeyValue::new("k", "b")]);
        assert_eq!(t.points().point("c", &[("k", "b")]).value, 4.0);
    }

    #[test]
    fn only_refuses_labeled_missing_and_repeated_points() {
        let t = TestMeter::new();
        let c = t.meter().u64_counter("c").build();
        c.add(1, &[KeyValue::new("k", "a")]);
        t.meter().u64_counter("one").build().add(2, &[]);
        let p = t.points();
        assert!(p.try_only("c").is_none(), "labeled");
        assert!(p.try_only("missing").is_none());
        assert_eq!(p.try_only("one").map(|p| p.value), Some(2.0));
        c.add(1, &[KeyValue::new("k", "b")]);
        assert!(t.points().try_only("c").is_none(), "two points");
    }
}
