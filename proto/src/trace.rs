//! W3C trace context carried in gRPC metadata (`traceparent`), so that one
//! request's spans on the router, the decode node and the prefill node
//! form one trace. When the binary exports spans (OTLP), each hop's
//! `tracing` span becomes an OpenTelemetry span whose parent is the
//! caller's; without an exporter the ids still tie every hop's logs
//! together.

use std::sync::atomic::{AtomicU64, Ordering};

use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The metadata key.
pub const TRACEPARENT: &str = "traceparent";

/// A trace id and the id of the span that made the outgoing call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceContext {
    pub trace_id: u128,
    pub span_id: u64,
    /// The caller's sampling decision (the `sampled` trace flag): every
    /// hop exports its span only if the trace is sampled.
    pub sampled: bool,
}

fn random_u64() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let t = tandem_types::clock::since_epoch().as_nanos() as u64;
    let x = t ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ u64::from(std::process::id()) << 32;
    // Ids need to be unique, not secret.
    tandem_types::rng::mix(x).max(1)
}

impl TraceContext {
    /// A new trace (the router starts one per request).
    pub fn new_root() -> Self {
        Self {
            trace_id: (u128::from(random_u64()) << 64) | u128::from(random_u64()),
            span_id: random_u64(),
            sampled: true,
        }
    }

    /// The same trace, with a new span id for this hop's outgoing calls.
    pub fn child(&self) -> Self {
        Self {
            trace_id: self.trace_id,
            span_id: random_u64(),
            sampled: self.sampled,
        }
    }

    pub fn to_header(&self) -> String {
        let flags = u8::from(self.sampled);
        format!(
            "00-{:032x}-{:016x}-{flags:02x}",
            self.trace_id, self.span_id
        )
    }

    /// Parses a `traceparent` value; `None` if malformed (then the callee
    /// starts its own trace).
    pub fn parse(v: &str) -> Option<Self> {
        let mut parts = v.split('-');
        let (ver, trace, span, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if ver != "00"
            || trace.len() != 32
            || span.len() != 16
            || flags.len() != 2
            || parts.next().is_some()
        {
            return None;
        }
        let trace_id = u128::from_str_radix(trace, 16).ok().filter(|&t| t != 0)?;
        let span_id = u64::from_str_radix(span, 16).ok().filter(|&s| s != 0)?;
        let flags = u8::from_str_radix(flags, 16).ok()?;
        Some(Self {
            trace_id,
            span_id,
            sampled: flags & 1 == 1,
        })
    }

    /// Reads the context from a request's metadata.
    pub fn from_metadata(md: &tonic::metadata::MetadataMap) -> Option<Self> {
        md.get(TRACEPARENT)?.to_str().ok().and_then(Self::parse)
    }

    /// Writes the context into outgoing metadata.
    pub fn inject(&self, md: &mut tonic::metadata::MetadataMap) {
        if let Ok(v) = self.to_header().parse() {
            md.insert(TRACEPARENT, v);
        }
    }

    pub fn trace_id_hex(&self) -> String {
        format!("{:032x}", self.trace_id)
    }

    /// The ids of `span`'s exported OpenTelemetry span; `None` when spans
    /// are not exported (no OpenTelemetry layer) or `span` is disabled.
    pub fn of_span(span: &tracing::Span) -> Option<Self> {
        let cx = span.context();
        let sc = cx.span().span_context().clone();
        sc.is_valid().then(|| Self {
            trace_id: u128::from_be_bytes(sc.trace_id().to_bytes()),
            span_id: u64::from_be_bytes(sc.span_id().to_bytes()),
            sampled: sc.is_sampled(),
        })
    }

    /// Starts one hop of a request in `span` (not yet entered): the span
    /// continues the caller's trace when there is one (`parent`, from the
    /// incoming `traceparent`) and otherwise starts a trace. Returns the
    /// context that this hop's outgoing calls carry: the span's own ids
    /// when spans are exported (so the next hop becomes its child), else a
    /// child of `parent` or a new root. Records `trace_id` on the span if it
    /// has that field.
    pub fn start_hop(span: &tracing::Span, parent: Option<Self>) -> Self {
        if let Some(p) = parent {
            let remote = SpanContext::new(
                TraceId::from_bytes(p.trace_id.to_be_bytes()),
                SpanId::from_bytes(p.span_id.to_be_bytes()),
                if p.sampled {
                    TraceFlags::SAMPLED
                } else {
                    TraceFlags::default()
                },
                true,
                TraceState::NONE,
            );
            // Fails only without an OpenTelemetry layer (nothing exported,
            // nothing to parent) or on a span already started, which
            // callers never pass.
            let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(remote));
        }
        let out = Self::of_span(span)
            .unwrap_or_else(|| parent.map_or_else(Self::new_root, |p| p.child()));
        span.record("trace_id", out.trace_id_hex());
        out
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_rejects_malformed() {
        let c = TraceContext::new_root();
        assert_eq!(TraceContext::parse(&c.to_header()), Some(c));
        let child = c.child();
        assert_eq!(child.trace_id, c.trace_id);
        assert_ne!(child.span_id, c.span_id);
        let unsampled =
            TraceContext::parse("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00").unwrap();
        assert!(!unsampled.sampled && c.sampled);
        assert!(unsampled.to_header().ends_with("-00"));
        assert!(!unsampled.child().sampled);
        for bad in [
            "",
            "00-abc-def-01",
            "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-x",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-1",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-zz",
            "00-0af7651916cd43dd8448eb211c80319z-b7ad6b7169203331-01",
        ] {
            assert_eq!(TraceContext::parse(bad), None, "{bad}");
        }
    }

    /// With spans exported, a hop's span is the caller's child and its
    /// outgoing context names the hop's own span; without, the trace id
    /// still carries through.
    #[test]
    fn hops_join_the_callers_trace() {
        use opentelemetry::trace::TracerProvider as _;
        use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
        use tracing_subscriber::layer::SubscriberExt;

        let parent = TraceContext::new_root();
        let span = tracing::info_span!("hop", trace_id = tracing::field::Empty);
        let out = TraceContext::start_hop(&span, Some(parent));
        assert_eq!(out.trace_id, parent.trace_id);
        assert_ne!(out.span_id, parent.span_id);
        assert_eq!(TraceContext::of_span(&span), None);

        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("test"));
        let subscriber = tracing_subscriber::registry().with(layer);
        let (out, root_out) = tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("hop", trace_id = tracing::field::Empty);
            let out = TraceContext::start_hop(&span, Some(parent));
            let root = tracing::info_span!("root");
            let root_out = TraceContext::start_hop(&root, None);
            // A caller that did not sample: this hop exports nothing either,
            // and passes the decision on.
            let skipped = tracing::info_span!("skipped");
            let unsampled = TraceContext {
                sampled: false,
                ..TraceContext::new_root()
            };
            assert!(!TraceContext::start_hop(&skipped, Some(unsampled)).sampled);
            (out, root_out)
        });
        let spans = exporter.get_finished_spans().unwrap();
        assert_eq!(spans.len(), 2, "{spans:?}");
        let hop = spans.iter().find(|s| s.name == "hop").unwrap();
        assert_eq!(
            hop.span_context.trace_id().to_bytes(),
            parent.trace_id.to_be_bytes()
        );
        assert_eq!(hop.parent_span_id.to_bytes(), parent.span_id.to_be_bytes());
        assert_eq!(
            hop.span_context.span_id().to_bytes(),
            out.span_id.to_be_bytes()
        );
        assert_eq!(out.trace_id, parent.trace_id);
        let root = spans.iter().find(|s| s.name == "root").unwrap();
        assert_eq!(root.parent_span_id, opentelemetry::trace::SpanId::INVALID);
        assert_eq!(
            root.span_context.trace_id().to_bytes(),
            root_out.trace_id.to_be_bytes()
        );
        assert_ne!(root_out.trace_id, parent.trace_id);
    }
}
