//! OTLP export end to end: a real OTLP/gRPC receiver (the collector
//! protocol's generated server, run in this test), a 1P1D cluster started
//! with `--otlp-endpoint`, and requests with and without a client
//! `traceparent`. Each request must arrive as one connected trace across
//! three processes (router `request` -> decode `generate` -> prefill
//! `prefill` -> prefill `dkv.write`), with bounded attributes; metrics must
//! arrive over OTLP too.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_server::{
    MetricsService, MetricsServiceServer,
};
use opentelemetry_proto::tonic::collector::metrics::v1::{
    ExportMetricsServiceRequest, ExportMetricsServiceResponse,
};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use serde_json::{Value, json};
use tandem_discovery::testing::EtcdServer;
use tandem_tests::cluster::{Node, Router, expected, long_prompt, unique_cluster};
use tandem_tests::{http_with, metric};

/// A span as received, with the service that sent it.
#[derive(Debug, Clone)]
struct Received {
    service: String,
    name: String,
    trace_id: Vec<u8>,
    span_id: Vec<u8>,
    parent_span_id: Vec<u8>,
    attributes: Vec<KeyValue>,
}

#[derive(Debug, Default)]
struct Store {
    spans: Mutex<Vec<Received>>,
    /// Metric name -> services that sent it.
    metrics: Mutex<BTreeMap<String, BTreeSet<String>>>,
}

#[derive(Debug, Clone)]
struct Receiver(Arc<Store>);

fn service_name(attrs: &[KeyValue]) -> String {
    attrs
        .iter()
        .find(|kv| kv.key == "service.name")
        .and_then(|kv| match kv.value.as_ref()?.value.as_ref()? {
            AnyValue::StringValue(s) => Some(s.clone()),
            _ => None,
        })
        .unwrap_or_default()
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut out = self.0.spans.lock().unwrap();
        for rs in req.into_inner().resource_spans {
            let service = service_name(&rs.resource.map(|r| r.attributes).unwrap_or_default());
            for ss in rs.scope_spans {
                for s in ss.spans {
                    out.push(Received {
                        service: service.clone(),
                        name: s.name,
                        trace_id: s.trace_id,
                        span_id: s.span_id,
                        parent_span_id: s.parent_span_id,
                        attributes: s.attributes,
                    });
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

#[tonic::async_trait]
impl MetricsService for Receiver {
    async fn export(
        &self,
        req: tonic::Request<ExportMetricsServiceRequest>,
    ) -> Result<tonic::Response<ExportMetricsServiceResponse>, tonic::Status> {
        let mut out = self.0.metrics.lock().unwrap();
        for rm in req.into_inner().resource_metrics {
            let service = service_name(&rm.resource.map(|r| r.attributes).unwrap_or_default());
            for sm in rm.scope_metrics {
                for m in sm.metrics {
                    out.entry(m.name).or_default().insert(service.clone());
                }
            }
        }
        Ok(tonic::Response::new(ExportMetricsServiceResponse::default()))
    }
}

/// Starts the receiver on a free loopback port; it runs until `rt` drops.
fn start_receiver(rt: &tokio::runtime::Runtime) -> (Arc<Store>, u16) {
    let store = Arc::new(Store::default());
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let port = listener.local_addr().unwrap().port();
    let r = Receiver(Arc::clone(&store));
    rt.spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(r.clone()))
            .add_service(MetricsServiceServer::new(r))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    (store, port)
}

/// POST with an optional `traceparent`; returns status and body.
fn post(port: u16, path: &str, body: &str, traceparent: Option<&str>) -> (u16, String) {
    let headers: Vec<(&str, &str)> = traceparent
        .map(|t| ("traceparent", t))
        .into_iter()
        .collect();
    let r = http_with(port, "POST", path, body, &headers);
    (r.status, r.body)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The spans of one trace, checked to form the chain router -> decode ->
/// prefill -> dkv.write; returns the router span's parent id (empty for a
/// root).
fn check_chain(spans: &[Received], trace: &[u8], prompt: &str) -> Vec<u8> {
    let of = |name: &str| -> Vec<&Received> {
        spans
            .iter()
            .filter(|s| s.trace_id == trace && s.name == name)
            .collect()
    };
    let (router, decode, prefill, dkv) = (
        of("request"),
        of("generate"),
        of("prefill"),
        of("dkv.write"),
    );
    let ctx = format!(
        "trace {}: {:?}",
        hex(trace),
        spans
            .iter()
            .filter(|s| s.trace_id == trace)
            .map(|s| (&s.service, &s.name))
            .collect::<Vec<_>>()
    );
    assert_eq!(router.len(), 1, "one router span per request; {ctx}");
    assert_eq!(decode.len(), 1, "{ctx}");
    assert_eq!(prefill.len(), 1, "{ctx}");
    assert_eq!(dkv.len(), 1, "{ctx}");
    let (router, decode, prefill, dkv) = (router[0], decode[0], prefill[0], dkv[0]);
    assert_eq!(router.service, "tandem-router");
    assert_eq!(decode.service, "tandem-decode");
    assert_eq!(prefill.service, "tandem-prefill");
    assert_eq!(dkv.service, "tandem-prefill");
    assert_eq!(decode.parent_span_id, router.span_id, "{ctx}");
    assert_eq!(prefill.parent_span_id, decode.span_id, "{ctx}");
    assert_eq!(dkv.parent_span_id, prefill.span_id, "{ctx}");
    // Bounded attributes: a few numbers and names, never the prompt.
    let marker = prompt.split_whitespace().nth(10).unwrap();
    for s in [router, decode, prefill, dkv] {
        assert!(
            s.attributes.len() <= 12,
            "{} has {:?}",
            s.name,
            s.attributes
        );
        for kv in &s.attributes {
            let v = format!("{:?}", kv.value);
            assert!(v.len() < 200, "{}: {} = {v}", s.name, kv.key);
            assert!(
                !v.contains(marker),
                "{}: {} carries prompt text",
                s.name,
                kv.key
            );
        }
    }
    let attr = |s: &Received, k: &str| {
        s.attributes
            .iter()
            .find(|kv| kv.key == k)
            .and_then(|kv| kv.value.clone()?.value)
    };
    assert!(
        matches!(attr(dkv, "bytes"), Some(AnyValue::IntValue(b)) if b > 0),
        "{:?}",
        dkv.attributes
    );
    assert!(matches!(attr(router, "prompt_tokens"), Some(AnyValue::IntValue(n)) if n > 64));
    router.parent_span_id.clone()
}

#[test]
fn one_connected_trace_per_request_across_three_processes() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (store, port) = start_receiver(&rt);
    let endpoint = format!("http://127.0.0.1:{port}");
    let env = [
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ("OTEL_METRIC_EXPORT_INTERVAL", "500"),
    ];
    let otlp = ["--otlp-endpoint", endpoint.as_str()];
    let etcd = EtcdServer::start().unwrap();
    let cluster = unique_cluster("otlp");
    let p = Node::start_env(&etcd.url(), &cluster, "prefill", "p0", &otlp, &env);
    let d = Node::start_env(&etcd.url(), &cluster, "decode", "d0", &otlp, &env);
    let r = Router::start_env(&etcd.url(), &cluster, &otlp, &env);
    r.wait_members(1, 1, Duration::from_secs(10));

    // A: the client sends its own trace context; the router joins it.
    let client_trace = "0af7651916cd43dd8448eb211c80319c";
    let client_span = "b7ad6b7169203331";
    let prompt_a = long_prompt(0);
    let body = json!({"prompt": prompt_a, "max_tokens": 8, "temperature": 0});
    let (status, text) = post(
        r.port,
        "/v1/completions",
        &body.to_string(),
        Some(&format!("00-{client_trace}-{client_span}-01")),
    );
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["choices"][0]["text"], expected(&prompt_a, 8).as_str());

    // B: no trace context (a new trace per request), streamed.
    let prompt_b = long_prompt(1);
    let body = json!({"prompt": prompt_b, "max_tokens": 8, "temperature": 0, "stream": true});
    let (status, text) = post(r.port, "/v1/completions", &body.to_string(), None);
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("[DONE]"), "{text}");

    // Both traces, complete, within a deadline (the batch exporters flush
    // every 100 ms here).
    let deadline = Instant::now() + Duration::from_secs(30);
    let complete = |spans: &[Received], trace: &[u8]| {
        ["request", "generate", "prefill", "dkv.write"]
            .iter()
            .all(|n| spans.iter().any(|s| s.trace_id == trace && s.name == *n))
    };
    let client_trace_bytes: Vec<u8> = (0..16)
        .map(|i| u8::from_str_radix(&client_trace[2 * i..2 * i + 2], 16).unwrap())
        .collect();
    let spans = loop {
        let spans = store.spans.lock().unwrap().clone();
        let roots: Vec<Vec<u8>> = spans
            .iter()
            .filter(|s| s.name == "request" && s.parent_span_id.is_empty())
            .map(|s| s.trace_id.clone())
            .collect();
        if complete(&spans, &client_trace_bytes) && roots.iter().any(|t| complete(&spans, t)) {
            break spans;
        }
        assert!(
            Instant::now() < deadline,
            "traces incomplete after 30 s: {:?}",
            spans
                .iter()
                .map(|s| (&s.service, &s.name, hex(&s.trace_id)))
                .collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let parent = check_chain(&spans, &client_trace_bytes, &prompt_a);
    assert_eq!(
        hex(&parent),
        client_span,
        "the router span continues the client's"
    );
    let root_traces: BTreeSet<Vec<u8>> = spans
        .iter()
        .filter(|s| s.name == "request" && s.parent_span_id.is_empty())
        .map(|s| s.trace_id.clone())
        .collect();
    assert_eq!(root_traces.len(), 1, "one new trace for request B");
    let b = root_traces.iter().next().unwrap();
    assert_ne!(b, &client_trace_bytes);
    assert!(check_chain(&spans, b, &prompt_b).is_empty());

    // Metrics arrive over OTLP from every role.
    let deadline = Instant::now() + Duration::from_secs(15);
    let want = [
        ("tandem.requests", "tandem-router"),
        ("tandem.time_to_first_token", "tandem-router"),
        ("tandem.response_queue_time", "tandem-router"),
        ("tandem.router.workers", "tandem-router"),
        ("tandem.batch_size", "tandem-decode"),
        ("tandem.batch_size", "tandem-prefill"),
        ("tandem.dkv.bytes_transferred", "tandem-prefill"),
    ];
    loop {
        let got = store.metrics.lock().unwrap();
        let missing: Vec<_> = want
            .iter()
            .filter(|(m, svc)| !got.get(*m).is_some_and(|s| s.contains(*svc)))
            .collect();
        if missing.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "metrics missing over OTLP: {missing:?}; got {:?}",
            got.keys().collect::<Vec<_>>()
        );
        drop(got);
        std::thread::sleep(Duration::from_millis(100));
    }

    // The router's own egress and admission backlogs drained, after having
    // seen every response.
    let text = tandem_tests::http(r.port, "GET", "/metrics", "").body;
    assert_eq!(
        metric(&text, "tandem_num_responses_buffered", ""),
        0.0,
        "{text}"
    );
    assert_eq!(
        metric(&text, "tandem_num_requests_awaiting_admission", ""),
        0.0
    );
    assert!(metric(&text, "tandem_response_queue_time_milliseconds_count", "") >= 16.0);
    assert!(metric(&text, "tandem_responses_buffered_count", "") >= 16.0);
    assert!(metric(&text, "tandem_requests_awaiting_admission_count", "") >= 2.0);
    assert_eq!(
        metric(&text, "tandem_router_workers", "role=\"decode\""),
        1.0
    );
    assert_eq!(
        metric(&text, "tandem_router_workers", "role=\"prefill\""),
        1.0
    );
    p.assert_idle();
    d.assert_idle();
}

/// A bad endpoint is refused at startup with a message naming the flag.
#[test]
fn a_malformed_otlp_endpoint_is_refused_at_startup() {
    let out = std::process::Command::new(tandem_tests::binary())
        .args([
            "router",
            "--etcd",
            "http://127.0.0.1:1",
            "--otlp-endpoint",
            "collector:4317",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--otlp-endpoint"), "{err}");
}
