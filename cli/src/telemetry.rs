//! What a serving process tells the outside: logs on stderr (`TANDEM_LOG`),
//! OpenTelemetry metrics on `/metrics` (Prometheus text), and, with an
//! OTLP endpoint, the same metrics plus one span per request hop exported
//! over OTLP/gRPC.
//!
//! Library crates record through the `opentelemetry` and `tracing` APIs
//! only; this module is the one place that installs providers. It also
//! exports the process's own heap in use (`tandem.process.heap`), which
//! the soak test reads at quiescent points to bound growth per request.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;
use opentelemetry::metrics::ObservableGauge;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::metrics::{PeriodicReader, SdkMeterProvider};
use opentelemetry_sdk::trace::SdkTracerProvider;
use prometheus::{Encoder, TextEncoder};
use tandem_frontend::MetricsRenderer;
use tracing_subscriber::Layer as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

/// The standard OpenTelemetry variables that also switch OTLP export on.
const OTEL_ENDPOINT_VARS: [&str; 3] = [
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
];

/// How long exporting what is left may delay the exit.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(3);

/// Flags of the telemetry every serving role shares.
#[derive(Debug, Clone, Args)]
pub struct TelemetryArgs {
    /// OTLP/gRPC collector receiving metrics and traces (e.g.
    /// http://otel-collector:4317). The standard OTEL_EXPORTER_OTLP_*
    /// variables (endpoints, headers, timeout), OTEL_SERVICE_NAME,
    /// OTEL_METRIC_EXPORT_INTERVAL and OTEL_BSP_* apply too.
    #[arg(long, env = "TANDEM_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
}

impl TelemetryArgs {
    /// Checks the flags without installing anything.
    pub fn validate(&self) -> Result<()> {
        self.otlp().map(drop)
    }

    /// Whether to export over OTLP, and to which endpoint if the flag names one.
    fn otlp(&self) -> Result<Option<Option<String>>> {
        if let Some(e) = &self.otlp_endpoint {
            let ok = e.parse::<tonic::transport::Uri>().ok().is_some_and(|u| {
                matches!(u.scheme_str(), Some("http" | "https")) && u.host().is_some()
            });
            if !ok {
                bail!("--otlp-endpoint {e:?} must be an http:// or https:// URL with a host");
            }
            return Ok(Some(Some(e.clone())));
        }
        let from_env = OTEL_ENDPOINT_VARS
            .iter()
            .any(|v| std::env::var_os(v).is_some_and(|s| !s.is_empty()));
        Ok(from_env.then_some(None))
    }
}

/// Logs for commands that export nothing (generate, bench, ...).
pub fn init_logs() {
    tracing_subscriber::registry().with(log_layer()).init();
}

fn log_filter() -> tracing_subscriber::EnvFilter {
    tracing_subscriber::EnvFilter::try_from_env("TANDEM_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"))
}

fn log_layer<S>() -> impl tracing_subscriber::Layer<S>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_filter(log_filter())
}

/// The installed providers of a serving process; [`Telemetry::shutdown`]
/// exports what is left.
pub struct Telemetry {
    meter: SdkMeterProvider,
    tracer: Option<SdkTracerProvider>,
    render: MetricsRenderer,
    _heap: Option<ObservableGauge<u64>>,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Telemetry")
            .field("otlp", &self.tracer.is_some())
            .finish_non_exhaustive()
    }
}

impl Telemetry {
    /// Installs logging, the global meter provider (Prometheus, plus OTLP
    /// when configured) and, when configured, OTLP span export for
    /// `tandem_*` spans. `role` names the service (`tandem-<role>`) unless
    /// OTEL_SERVICE_NAME does. Call inside the tokio runtime that will
    /// outlive the exports (the OTLP gRPC channels live on it), before any
    /// instrument is made (instruments made earlier stay no-ops).
    pub fn install(role: &str, args: &TelemetryArgs) -> Result<Self> {
        let otlp = args.otlp()?;
        let registry = prometheus::Registry::new();
        let prometheus = opentelemetry_prometheus::exporter()
            .with_registry(registry.clone())
            .scope_info_enabled(false)
            .without_target_info()
            .build()
            .context("building the Prometheus exporter")?;
        let mut meter = SdkMeterProvider::builder().with_reader(prometheus);
        let mut tracer = None;
        if let Some(endpoint) = &otlp {
            let resource = resource(role);
            let mut metrics = opentelemetry_otlp::MetricExporter::builder().with_tonic();
            let mut spans = opentelemetry_otlp::SpanExporter::builder().with_tonic();
            if let Some(e) = endpoint {
                metrics = metrics.with_endpoint(e);
                spans = spans.with_endpoint(e);
            }
            let metrics = metrics
                .build()
                .context("building the OTLP metric exporter")?;
            let spans = spans.build().context("building the OTLP span exporter")?;
            meter = meter
                .with_reader(PeriodicReader::builder(metrics).build())
                .with_resource(resource.clone());
            tracer = Some(
                SdkTracerProvider::builder()
                    .with_batch_exporter(spans)
                    .with_resource(resource)
                    .build(),
            );
        }
        let meter = meter.build();
        opentelemetry::global::set_meter_provider(meter.clone());
        let heap = heap_gauge();
        // Our own spans only: one per request hop, with bounded fields.
        let spans = tracer.as_ref().map(|t| {
            tracing_opentelemetry::layer()
                .with_tracer(t.tracer("tandem"))
                .with_location(false)
                .with_threads(false)
                .with_tracked_inactivity(false)
                .with_filter(
                    tracing_subscriber::filter::Targets::new()
                        .with_target("tandem", tracing::Level::INFO),
                )
        });
        tracing_subscriber::registry()
            .with(log_layer())
            .with(spans)
            .try_init()
            .context("installing the log subscriber")?;
        if let Some(e) = &otlp {
            tracing::info!(
                endpoint = e.as_deref().unwrap_or("from OTEL_EXPORTER_OTLP_*"),
                "exporting metrics and traces over OTLP"
            );
        }
        let render: MetricsRenderer = Arc::new(move || {
            let mut out = Vec::new();
            if let Err(e) = TextEncoder::new().encode(&registry.gather(), &mut out) {
                tracing::warn!("encoding metrics: {e}");
            }
            String::from_utf8_lossy(&out).into_owned()
        });
        Ok(Self {
            meter,
            tracer,
            render,
            _heap: heap,
        })
    }

    /// The `/metrics` renderer.
    pub fn render(&self) -> MetricsRenderer {
        Arc::clone(&self.render)
    }

    /// Exports what is buffered (bounded in time). Call while the runtime
    /// the exporters were built in still runs.
    pub fn shutdown(self) {
        if let Some(t) = self.tracer
            && let Err(e) = t.shutdown_with_timeout(FLUSH_TIMEOUT)
        {
            tracing::warn!("stopping trace export: {e}");
        }
        if let Err(e) = self.meter.shutdown_with_timeout(FLUSH_TIMEOUT) {
            tracing::warn!("stopping metrics: {e}");
        }
    }
}

/// `tandem.process.heap`: bytes the allocator has handed out and not had
/// back (glibc's `mallinfo2`, every arena: `uordblks` + `hblkhd`), read at
/// each collection. Unlike RSS it does not move with pages the allocator
/// keeps or returns, so a leak of a few KiB per request shows at once.
/// `None` where the allocator is not glibc's.
fn heap_gauge() -> Option<ObservableGauge<u64>> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let gauge = opentelemetry::global::meter("tandem")
            .u64_observable_gauge("tandem.process.heap")
            .with_description(
                "Heap bytes allocated and not yet freed (glibc mallinfo2, all arenas)",
            )
            .with_unit("By")
            .with_callback(|o| o.observe(heap_in_use(), &[]))
            .build();
        Some(gauge)
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    None
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn heap_in_use() -> u64 {
    // SAFETY: mallinfo2 takes each arena's lock and only reads counters;
    // any thread may call it at any time.
    let m = unsafe { libc::mallinfo2() };
    (m.uordblks + m.hblkhd) as u64
}

/// `service.name` = `tandem-<role>` unless OTEL_SERVICE_NAME sets it (the
/// builder reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES itself).
fn resource(role: &str) -> Resource {
    let b = Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_some() {
        b.build()
    } else {
        b.with_service_name(format!("tandem-{role}")).build()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn heap_in_use_follows_allocations() {
        let before = heap_in_use();
        let block = vec![1u8; 64 << 20];
        let during = heap_in_use();
        drop(std::hint::black_box(block));
        let after = heap_in_use();
        assert!(during >= before + (64 << 20), "{before} -> {during}");
        assert!(after + (64 << 20) <= during, "{during} -> {after}");
    }

    #[test]
    fn endpoint_must_be_a_url() {
        let args = |e: &str| TelemetryArgs {
            otlp_endpoint: Some(e.into()),
        };
        assert_eq!(
            args("http://collector:4317").otlp().unwrap(),
            Some(Some("http://collector:4317".into()))
        );
        assert!(args("https://127.0.0.1:4317").otlp().is_ok());
        for bad in ["collector:4317", "ftp://x:1", "", "http://"] {
            assert!(args(bad).otlp().is_err(), "{bad:?} accepted");
        }
    }
}
