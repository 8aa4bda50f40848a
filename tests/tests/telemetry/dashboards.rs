//! The Grafana dashboards (`deploy/grafana/*.json`) and the Prometheus alert
//! rules (`deploy/prometheus/alerts.yaml`) against what the binary really
//! exports. A 1P1D cluster serves a mixed load while a real Prometheus
//! scrapes it; then every metric and label that a panel, a dashboard
//! variable or an alert names must be in a scrape of the router or a node,
//! and so must every label value a query filters on (label values a
//! counter may take are exported at zero, so the scrape has them before
//! they happen: a renamed `reason` or `outcome` would silently disarm the
//! alerts on it), every panel query must return data from that Prometheus,
//! and every rule must load, evaluate without error and stay quiet.
//! `promtool` checks the rule file and unit-tests the alerts' logic on
//! synthetic series: every alert is shown to fire on input that should
//! trigger it, and to stay quiet on input that should not.
//!
//! Needs `prometheus` and `promtool` (Debian package `prometheus`).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::fs::File;
use std::io::Read;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};
use tandem_discovery::testing::EtcdServer;
use tandem_tests::cluster::{
    Node, Router, counting_prompt, long_prompt, short_prompt, unique_cluster,
};
use tandem_tests::{free_port, http, metric, raw_request, sse_events};

/// Labels that Prometheus attaches to every scraped series.
const TARGET_LABELS: [&str; 2] = ["job", "instance"];

/// Grafana's built-in interval variables, and what they become when a
/// panel query is sent to Prometheus directly (the whole test fits in 5m).
const INTERVAL_VARIABLES: [&str; 3] = ["__rate_interval", "__interval", "__range"];

/// Metrics the issue asks the dashboard to show (#13, item 6): dropping
/// one from every panel fails `dashboards_are_well_formed`.
const DASHBOARD_MUST_SHOW: [&str; 22] = [
    "tandem_num_requests_awaiting_admission",
    "tandem_requests_awaiting_admission_bucket",
    "tandem_num_requests_queued",
    "tandem_num_responses_buffered",
    "tandem_responses_buffered_bucket",
    "tandem_response_queue_time_milliseconds_bucket",
    "tandem_time_to_first_token_milliseconds_bucket",
    "tandem_time_per_output_token_milliseconds_bucket",
    "tandem_inter_token_latency_milliseconds_bucket",
    "tandem_request_latency_milliseconds_bucket",
    "tandem_batch_size_bucket",
    "tandem_batch_input_tokens_bucket",
    "tandem_kv_blocks_used",
    "tandem_kv_blocks_free",
    "tandem_prefix_cache_hits_total",
    "tandem_dkv_bytes_transferred_bytes_total",
    "tandem_dkv_transfer_latency_milliseconds_bucket",
    "tandem_dkv_transfer_failures_total",
    "tandem_dkv_watchdog_firings_total",
    "tandem_router_chosen_overlap_bucket",
    "tandem_router_workers",
    "tandem_model_load_time_milliseconds_sum",
];

/// Alerts the issue asks for: backlog growth, no decode workers, transfer
/// failures (plus the stall watchdog and the error ratio).
const REQUIRED_ALERTS: [&str; 6] = [
    "TandemAdmissionBacklogGrowing",
    "TandemEgressBacklogGrowing",
    "TandemNoDecodeWorkers",
    "TandemDkvTransferFailures",
    "TandemDecodeStallWatchdog",
    "TandemHighErrorRatio",
];

#[test]
fn dashboards_and_alerts_match_a_real_scrape() {
    let prometheus_bin = tool("prometheus");
    let etcd = EtcdServer::start().unwrap();
    let cluster = unique_cluster("dash");
    let prefill = Node::start(&etcd.url(), &cluster, "prefill", "p0", &[]);
    // The decode node keeps KV tiers (host and disk), so their panels
    // have series to match.
    let tier_dir = tempfile::tempdir_in("/var/tmp").expect("a tier directory");
    let tiers = format!(
        r#"{{"host_kvcache_swap_space_gb": 0.05, "disk_offload_dir": "{}", "disk_offload_max_gb": 0.05}}"#,
        tier_dir.path().display()
    );
    let decode = Node::start(
        &etcd.url(),
        &cluster,
        "decode",
        "d0",
        &["--kv-connector-config", &tiers],
    );
    let router = Router::start(&etcd.url(), &cluster);
    router.wait_members(1, 1, Duration::from_secs(30));

    // Scraping from before the load, so that rates and quantiles cover it.
    let prom = Prometheus::start(
        &prometheus_bin,
        &[
            ("tandem-router", router.port),
            ("tandem-prefill", prefill.metrics),
            ("tandem-decode", decode.metrics),
        ],
        &tandem_tests::repo_root().join("deploy/prometheus/alerts.yaml"),
    );

    // Target discovery delays the first scrape by a few seconds.
    wait_for(
        Duration::from_secs(60),
        "Prometheus scraping every target",
        || prom.query("count(up == 1)")["data"]["result"][0]["value"][1] == "3",
    );
    mixed_load(&router);
    // The client that hung up mid-stream is counted once the router sees it.
    wait_for(
        Duration::from_secs(30),
        "the disconnected stream counted as cancelled",
        || {
            metric(
                &router_metrics(&router),
                "tandem_requests_total",
                "status=\"cancelled\"",
            ) >= 1.0
        },
    );
    prefill.assert_idle();
    decode.assert_idle();
    // An idle cluster has no backlog left, in or out.
    wait_for(
        Duration::from_secs(20),
        "admission and egress backlogs drained",
        || {
            let scrapes = [router_metrics(&router), prefill.metrics(), decode.metrics()];
            scrapes.iter().all(|s| {
                metric(s, "tandem_num_requests_awaiting_admission", "") == 0.0
                    && metric(s, "tandem_num_responses_buffered", "") == 0.0
            })
        },
    );

    let mut scrape = Exposition::default();
    for (who, text) in [
        ("router", router_metrics(&router)),
        ("prefill", prefill.metrics()),
        ("decode", decode.metrics()),
    ] {
        assert!(
            text.contains("# TYPE tandem_"),
            "{who} exported nothing:\n{text}"
        );
        scrape.add(&text);
    }

    let mut problems = Vec::new();
    let (queries, variables) = dashboard_queries(&mut problems);
    for q in queries.iter().chain(&alert_queries()) {
        problems.extend(check_names(q, &scrape));
        problems.extend(check_values(q, &scrape));
    }
    for v in &variables {
        problems.extend(check_variable(v, &scrape));
    }

    // The same queries through a real Prometheus: each must parse, and each
    // panel must show data from this cluster. A rate needs two samples: a
    // series born at the end of the load has them once every target was
    // scraped twice more (1 s apart).
    let after_load = unix_now() + 2;
    wait_for(
        Duration::from_secs(30),
        "Prometheus scraped every target after the load",
        || {
            let r = prom.query(&format!("count(timestamp(up == 1) > {after_load})"));
            r["data"]["result"][0]["value"][1] == "3"
        },
    );
    // A query may still lack its second sample when a scrape under load
    // came late: those without data are asked again, once a second, for a
    // while (a series that never appears still fails).
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut pending: Vec<_> = queries.iter().collect();
    loop {
        let mut empty = Vec::new();
        for q in pending {
            let expr = substitute(&q.expr, &variables);
            let r = prom.query(&expr);
            if r["status"] != "success" {
                problems.push(format!(
                    "{}: Prometheus rejects {expr:?}: {}",
                    q.origin, r["error"]
                ));
            } else if r["data"]["result"].as_array().is_none_or(Vec::is_empty) {
                empty.push(q);
            }
        }
        if empty.is_empty() || Instant::now() > deadline {
            problems.extend(empty.iter().map(|q| {
                format!(
                    "{}: no data from the cluster for {:?}",
                    q.origin,
                    substitute(&q.expr, &variables)
                )
            }));
            break;
        }
        pending = empty;
        std::thread::sleep(Duration::from_secs(1));
    }
    for v in &variables {
        if let Some(selector) = &v.selector {
            let path = format!(
                "/api/v1/label/{}/values?match[]={}",
                v.label,
                percent_encode(&substitute(selector, &variables))
            );
            let r = prom.get(&path);
            if r["data"].as_array().is_none_or(Vec::is_empty) {
                problems.push(format!("variable {}: no values from {path}: {r}", v.name));
            }
        }
    }

    // Every rule loaded, evaluates cleanly, and nothing fires on a healthy
    // cluster.
    let rules = wait_for_rules(&prom);
    let names: BTreeSet<&str> = rules.iter().filter_map(|r| r["name"].as_str()).collect();
    for name in REQUIRED_ALERTS {
        if !names.contains(name) {
            problems.push(format!("alerts.yaml: no alert {name}"));
        }
    }
    for r in &rules {
        if r["health"] != "ok" || r["state"] != "inactive" {
            problems.push(format!(
                "rule {}: health {}, state {}, error {}",
                r["name"], r["health"], r["state"], r["lastError"]
            ));
        }
    }

    assert!(
        problems.is_empty(),
        "{} problem(s):\n{}\n\nexported series:\n{}",
        problems.len(),
        problems.join("\n"),
        scrape.summary()
    );
}

/// The structure Grafana needs, checked without a cluster: titles, data
/// sources, ids, layout, variables, and PromQL that `promtool` accepts.
#[test]
fn dashboards_are_well_formed() {
    let promtool = tool("promtool");
    let mut problems = Vec::new();
    let (queries, variables) = dashboard_queries(&mut problems);
    assert!(!queries.is_empty(), "no panel queries in deploy/grafana");
    let used: BTreeSet<String> = queries
        .iter()
        .filter_map(|q| promql_refs(&q.expr).ok())
        .flat_map(|r| r.metrics())
        .collect();
    for m in DASHBOARD_MUST_SHOW {
        if !used.contains(m) {
            problems.push(format!("no panel shows {m}"));
        }
    }
    // Every expression as a recording rule: promtool parses them all.
    let dir = tempfile::tempdir().unwrap();
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, q) in queries.iter().enumerate() {
        let expr = substitute(&q.expr, &variables);
        writeln!(
            rules,
            "      - record: dashboard:query_{i}\n        expr: {}",
            json!(expr)
        )
        .unwrap();
    }
    let file = dir.path().join("dashboard_queries.yaml");
    std::fs::write(&file, &rules).unwrap();
    let out = Command::new(&promtool)
        .arg("check")
        .arg("rules")
        .arg(&file)
        .output()
        .unwrap();
    if !out.status.success() {
        let report = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        // promtool names the recording rule; name the panel.
        let culprits: Vec<String> = queries
            .iter()
            .enumerate()
            .filter(|(i, _)| report.contains(&format!("dashboard:query_{i}\"")))
            .map(|(_, q)| format!("{}: {:?}", q.origin, q.expr))
            .collect();
        problems.push(format!(
            "promtool rejects dashboard queries:\n{report}\n{}",
            culprits.join("\n")
        ));
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn promtool_checks_and_unit_tests_the_alert_rules() {
    let promtool = tool("promtool");
    let rules = tandem_tests::repo_root().join("deploy/prometheus/alerts.yaml");
    let out = Command::new(&promtool)
        .arg("check")
        .arg("rules")
        .arg(&rules)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "promtool check rules failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let untested = alerts_without_unit_tests();
    assert!(
        untested.is_empty(),
        "alerts the unit tests never show firing and quiet: {untested:?}"
    );
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("alerts_test.yaml");
    std::fs::write(
        &file,
        ALERT_UNIT_TESTS.replace("RULES", rules.to_str().unwrap()),
    )
    .unwrap();
    let out = Command::new(&promtool)
        .arg("test")
        .arg("rules")
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "promtool test rules failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The alerts' logic on synthetic series (one sample a minute): each alert
/// fires on input that should trigger it (`exp_alerts` listed) and stays
/// quiet before its `for:` has passed and on input that should not (a
/// sawtooth backlog that drains, cancelled transfers after client
/// disconnects, late KV writes, a queue at its bound, a router that sees
/// its workers).
const ALERT_UNIT_TESTS: &str = r#"
rule_files:
  - RULES
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      # r1 loses its decode worker at 3m; r2 never reports one.
      - series: 'tandem_router_workers{job="router", instance="r1", role="decode"}'
        values: '1 1 1 0x10'
      - series: 'tandem_router_workers{job="router", instance="r1", role="prefill"}'
        values: '1x12'
      - series: 'tandem_router_workers{job="router", instance="r2", role="prefill"}'
        values: '1x12'
      - series: 'tandem_num_requests_awaiting_admission{job="router", instance="r1"}'
        values: '1+1x40'
      - series: 'tandem_num_requests_awaiting_admission{job="router", instance="r2"}'
        values: '0 5 10 0 5 10 0 5 10 0 5 10 0 5 10 0 5 10 0 5 10 0 5 10 0 5 10 0 5 10 0 5 10 0 5 10 0 5 10 0'
      - series: 'tandem_num_responses_buffered{job="router", instance="r1"}'
        values: '10+10x40'
      - series: 'tandem_dkv_transfer_failures_total{job="prefill", instance="p1", connector="ucx", reason="deadline"}'
        values: '0 0 1x10'
      - series: 'tandem_dkv_transfer_failures_total{job="prefill", instance="p1", connector="ucx", reason="cancelled"}'
        values: '0+1x12'
      - series: 'tandem_dkv_watchdog_firings_total{job="decode", instance="d1", connector="ucx"}'
        values: '0 0 1x10'
      - series: 'tandem_requests_total{job="router", instance="r1", status="ok"}'
        values: '0+10x20'
      - series: 'tandem_requests_total{job="router", instance="r1", status="server_error"}'
        values: '0+1x20'
    alert_rule_test:
      - eval_time: 0m
        alertname: TandemNoDecodeWorkers
        exp_alerts: []
      - eval_time: 2m
        alertname: TandemNoDecodeWorkers
        exp_alerts:
          - exp_labels: {severity: critical, job: router, instance: r2}
            exp_annotations: &nodecode
              summary: "r2: router sees no decode worker"
              description: "The router has no decode worker in etcd: every request fails with 503. Check the decode pods and etcd."
      - eval_time: 6m
        alertname: TandemNoDecodeWorkers
        exp_alerts:
          - exp_labels: {severity: critical, job: router, instance: r1}
            exp_annotations:
              summary: "r1: router sees no decode worker"
              description: "The router has no decode worker in etcd: every request fails with 503. Check the decode pods and etcd."
          - exp_labels: {severity: critical, job: router, instance: r2}
            exp_annotations: *nodecode
      - eval_time: 9m
        alertname: TandemAdmissionBacklogGrowing
        exp_alerts: []
      - eval_time: 30m
        alertname: TandemAdmissionBacklogGrowing
        exp_alerts:
          - exp_labels: {severity: warning, job: router, instance: r1}
            exp_annotations:
              summary: "r1: admission backlog keeps growing"
              description: "The admission backlog has not been empty for 15 minutes and is still growing: demand exceeds what the decode pool admits."
      - eval_time: 5m
        alertname: TandemEgressBacklogGrowing
        exp_alerts: []
      - eval_time: 30m
        alertname: TandemEgressBacklogGrowing
        exp_alerts:
          - exp_labels: {severity: warning, job: router, instance: r1}
            exp_annotations:
              summary: "r1: egress backlog keeps growing"
              description: "Buffered responses have not drained for 15 minutes and are still growing."
      - eval_time: 1m
        alertname: TandemDkvTransferFailures
        exp_alerts: []
      - eval_time: 5m
        alertname: TandemDkvTransferFailures
        exp_alerts:
          - exp_labels: {severity: warning, job: prefill, instance: p1, reason: deadline}
            exp_annotations:
              summary: "p1: KV transfers failing (deadline)"
              description: "KV transfers from prefill to decode fail; the decode node retries or prefills locally, at a cost in latency."
      - eval_time: 1m
        alertname: TandemDecodeStallWatchdog
        exp_alerts: []
      - eval_time: 5m
        alertname: TandemDecodeStallWatchdog
        exp_alerts:
          - exp_labels: {severity: warning, job: decode, instance: d1}
            exp_annotations:
              summary: "d1: decode-stall watchdog fired"
              description: "A remote prefill did not answer within the decode node's --prefill-timeout-ms and was abandoned: a prefill node is stalled or the network between the pools is."
      - eval_time: 4m
        alertname: TandemHighErrorRatio
        exp_alerts: []
      - eval_time: 15m
        alertname: TandemHighErrorRatio
        exp_alerts:
          - exp_labels: {severity: critical, job: router}
            exp_annotations:
              summary: "router: 9.091% of requests fail"
              description: "More than 5% of finished requests end with a server error."
  - interval: 1m
    input_series:
      # r3 holds a backlog of 40 requests from the start; r4 stays at 20.
      - series: 'tandem_num_requests_awaiting_admission{job="router", instance="r3"}'
        values: '40x20'
      - series: 'tandem_num_requests_awaiting_admission{job="router", instance="r4"}'
        values: '20x20'
      # d1's scheduler queue is full (100); d2 sits at the bound (64).
      - series: 'tandem_num_requests_queued{job="decode", instance="d1"}'
        values: '100x20'
      - series: 'tandem_num_requests_queued{job="decode", instance="d2"}'
        values: '64x20'
      # r3 buffers 2000 responses; r4 1000.
      - series: 'tandem_num_responses_buffered{job="router", instance="r3"}'
        values: '2000x20'
      - series: 'tandem_num_responses_buffered{job="router", instance="r4"}'
        values: '1000x20'
      # r3's responses wait over 1 s (all in the +Inf bucket); r4's under 100 ms.
      - series: 'tandem_response_queue_time_milliseconds_bucket{job="router", instance="r3", le="100"}'
        values: '0x20'
      - series: 'tandem_response_queue_time_milliseconds_bucket{job="router", instance="r3", le="1000"}'
        values: '0x20'
      - series: 'tandem_response_queue_time_milliseconds_bucket{job="router", instance="r3", le="+Inf"}'
        values: '0+10x20'
      - series: 'tandem_response_queue_time_milliseconds_bucket{job="router", instance="r4", le="100"}'
        values: '0+10x20'
      - series: 'tandem_response_queue_time_milliseconds_bucket{job="router", instance="r4", le="1000"}'
        values: '0+10x20'
      - series: 'tandem_response_queue_time_milliseconds_bucket{job="router", instance="r4", le="+Inf"}'
        values: '0+10x20'
    alert_rule_test:
      - eval_time: 4m
        alertname: TandemAdmissionBacklogHigh
        exp_alerts: []
      - eval_time: 6m
        alertname: TandemAdmissionBacklogHigh
        exp_alerts:
          - exp_labels: {severity: warning, job: router, instance: r3}
            exp_annotations:
              summary: "r3: 40 requests awaiting admission"
              description: "More than 32 requests have waited for a worker for 5 minutes: decode workers are saturated or missing. Add decode replicas or check the Workers up per role panel."
      - eval_time: 9m
        alertname: TandemSchedulerQueueHigh
        exp_alerts: []
      - eval_time: 11m
        alertname: TandemSchedulerQueueHigh
        exp_alerts:
          - exp_labels: {severity: warning, job: decode, instance: d1}
            exp_annotations:
              summary: "d1: 100 requests queued in the scheduler"
              description: "Requests wait for the node's batch scheduler: KV blocks or batch slots are exhausted (see the KV usage and Preemptions panels)."
      - eval_time: 4m
        alertname: TandemEgressBacklogHigh
        exp_alerts: []
      - eval_time: 6m
        alertname: TandemEgressBacklogHigh
        exp_alerts:
          - exp_labels: {severity: warning, job: router, instance: r3}
            exp_annotations:
              summary: "r3: 2000 responses buffered"
              description: "More than 1024 responses have stayed buffered for 5 minutes: clients read slower than tokens are produced, or the router's CPU is saturated."
      - eval_time: 10m
        alertname: TandemResponseQueueTimeHigh
        exp_alerts: []
      - eval_time: 12m
        alertname: TandemResponseQueueTimeHigh
        exp_alerts:
          - exp_labels: {severity: warning, job: router, instance: r3}
            exp_annotations:
              summary: "r3: p99 response queue time 1000 ms"
              description: "Generated tokens wait more than 500 ms (p99) before they are sent on."
  - interval: 1m
    input_series:
      # r5 loses its prefill worker at 2m; r6 keeps one.
      - series: 'tandem_router_workers{job="router", instance="r5", role="prefill"}'
        values: '1 1 0x20'
      - series: 'tandem_router_workers{job="router", instance="r5", role="decode"}'
        values: '1x22'
      - series: 'tandem_router_workers{job="router", instance="r6", role="prefill"}'
        values: '1x22'
      - series: 'tandem_router_workers{job="router", instance="r6", role="decode"}'
        values: '1x22'
      # Refused KV writes: forged on d1 from 2m, out of range on d2 from
      # 3m, malformed on d3 from 4m; late ones (expired, closed, unknown)
      # on d4 all along: expected after failed transfers, no alert.
      - series: 'tandem_dkv_refused_writes_total{job="decode", instance="d1", connector="ucx", reason="forged"}'
        values: '0 0 1x20'
      - series: 'tandem_dkv_refused_writes_total{job="decode", instance="d2", connector="ucx", reason="out_of_range"}'
        values: '0 0 0 2x20'
      - series: 'tandem_dkv_refused_writes_total{job="decode", instance="d3", connector="ucx", reason="malformed"}'
        values: '0 0 0 0 5x20'
      - series: 'tandem_dkv_refused_writes_total{job="decode", instance="d4", connector="ucx", reason="expired"}'
        values: '0+1x22'
      - series: 'tandem_dkv_refused_writes_total{job="decode", instance="d4", connector="ucx", reason="closed"}'
        values: '0+1x22'
      - series: 'tandem_dkv_refused_writes_total{job="decode", instance="d4", connector="ucx", reason="unknown"}'
        values: '0+1x22'
      # d1 falls back to local prefill all along; d2 prefills remotely.
      - series: 'tandem_decode_prefills_total{job="decode", instance="d1", outcome="fallback"}'
        values: '0+1x22'
      - series: 'tandem_decode_prefills_total{job="decode", instance="d2", outcome="fallback"}'
        values: '0x22'
      - series: 'tandem_decode_prefills_total{job="decode", instance="d2", outcome="remote"}'
        values: '0+5x22'
    alert_rule_test:
      - eval_time: 5m
        alertname: TandemNoPrefillWorkers
        exp_alerts: []
      - eval_time: 8m
        alertname: TandemNoPrefillWorkers
        exp_alerts:
          - exp_labels: {severity: warning, job: router, instance: r5}
            exp_annotations:
              summary: "r5: router sees no prefill worker"
              description: "Long prompts are prefilled on the decode workers, which slows token generation for every running request."
      - eval_time: 1m
        alertname: TandemDkvForgedWrites
        exp_alerts: []
      - eval_time: 5m
        alertname: TandemDkvForgedWrites
        exp_alerts:
          - exp_labels: {severity: critical, job: decode, instance: d1, reason: forged}
            exp_annotations:
              summary: "d1: KV writes refused (forged)"
              description: "A peer sent KV writes that no grant of this node allows. Nothing landed, but a process on the KV network is misbehaving or hostile: find it."
          - exp_labels: {severity: critical, job: decode, instance: d2, reason: out_of_range}
            exp_annotations:
              summary: "d2: KV writes refused (out_of_range)"
              description: "A peer sent KV writes that no grant of this node allows. Nothing landed, but a process on the KV network is misbehaving or hostile: find it."
          - exp_labels: {severity: critical, job: decode, instance: d3, reason: malformed}
            exp_annotations:
              summary: "d3: KV writes refused (malformed)"
              description: "A peer sent KV writes that no grant of this node allows. Nothing landed, but a process on the KV network is misbehaving or hostile: find it."
      - eval_time: 9m
        alertname: TandemRemotePrefillFallbacks
        exp_alerts: []
      - eval_time: 12m
        alertname: TandemRemotePrefillFallbacks
        exp_alerts:
          - exp_labels: {severity: warning, job: decode, instance: d1}
            exp_annotations:
              summary: "d1: prompts fall back to local prefill"
              description: "Remote prefills keep failing on every prefill worker tried, so the decode node prefills prompts itself."
"#;

/// The alerts of alerts.yaml that [`ALERT_UNIT_TESTS`] never expects to
/// fire, or never expects to stay quiet, each with what is missing.
fn alerts_without_unit_tests() -> Vec<String> {
    let path = tandem_tests::repo_root().join("deploy/prometheus/alerts.yaml");
    let rules: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let tests: serde_yaml_ng::Value = serde_yaml_ng::from_str(ALERT_UNIT_TESTS).unwrap();
    let (mut fires, mut quiet) = (BTreeSet::new(), BTreeSet::new());
    for t in tests["tests"].as_sequence().into_iter().flatten() {
        for a in t["alert_rule_test"].as_sequence().into_iter().flatten() {
            let name = a["alertname"].as_str().unwrap_or_default().to_string();
            match a["exp_alerts"].as_sequence() {
                Some(e) if !e.is_empty() => fires.insert(name),
                _ => quiet.insert(name),
            };
        }
    }
    let mut missing = Vec::new();
    for g in rules["groups"].as_sequence().into_iter().flatten() {
        for r in g["rules"].as_sequence().into_iter().flatten() {
            let Some(name) = r["alert"].as_str() else {
                continue;
            };
            for (set, what) in [(&fires, "firing"), (&quiet, "quiet")] {
                if !set.contains(name) {
                    missing.push(format!("{name} ({what})"));
                }
            }
        }
    }
    missing
}

// ---------------------------------------------------------------- load

/// Short and long prompts (local and remote prefill), completions and chat,
/// streaming and not, concurrently; plus one client that hangs up
/// mid-stream.
fn mixed_load(router: &Router) {
    let port = router.port;
    std::thread::scope(|s| {
        for kind in 0..4 {
            s.spawn(move || {
                for i in 0..3 {
                    let prompt = if kind % 2 == 0 {
                        short_prompt().to_string()
                    } else {
                        long_prompt(i + 3 * kind)
                    };
                    let stream = kind >= 2;
                    let (path, body) = if i == 1 {
                        let mut body = json!({
                            "messages": [{"role": "user", "content": prompt}],
                            "max_tokens": 12, "temperature": 0, "stream": stream,
                        });
                        if stream {
                            body["stream_options"] = json!({"include_usage": true});
                        }
                        ("/v1/chat/completions", body)
                    } else {
                        let body = json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": stream});
                        ("/v1/completions", body)
                    };
                    let r = http(port, "POST", path, &body.to_string());
                    assert_eq!(r.status, 200, "{path} {body}: {}", r.body);
                    if stream {
                        let events = sse_events(&r.body);
                        assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{}", r.body);
                        assert!(!r.body.contains("\"error\""), "{}", r.body);
                    } else {
                        assert!(r.json()["usage"]["completion_tokens"].as_u64() > Some(0), "{}", r.body);
                    }
                }
            });
        }
        s.spawn(move || hang_up_mid_stream(port));
    });
}

/// Starts a long stream, reads its first event and closes the connection
/// (a raw socket: the hang-up is the point).
fn hang_up_mid_stream(port: u16) {
    let body =
        json!({"prompt": counting_prompt(0), "max_tokens": 300, "temperature": 0, "stream": true});
    let mut s = raw_request(port, "POST", "/v1/completions", &body.to_string());
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("data: ") {
        let n = s.read(&mut buf).unwrap();
        assert!(
            n > 0,
            "the stream ended before its first event: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
    assert!(
        !String::from_utf8_lossy(&seen).contains("[DONE]"),
        "the stream finished before the client hung up"
    );
}

fn router_metrics(r: &Router) -> String {
    http(r.port, "GET", "/metrics", "").body
}

// ------------------------------------------------------ dashboards, alerts

/// One PromQL expression and where it comes from.
#[derive(Debug)]
struct Query {
    origin: String,
    expr: String,
}

/// A Grafana query variable: `label_values(selector, label)` or
/// `label_values(label)`; other kinds keep only their name (for
/// substitution).
#[derive(Debug)]
struct Variable {
    name: String,
    selector: Option<String>,
    label: String,
}

fn dashboard_files() -> Vec<PathBuf> {
    let dir = tandem_tests::repo_root().join("deploy/grafana");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no dashboard in {}", dir.display());
    files
}

/// Every panel query and query variable of every dashboard; structural
/// problems go to `problems`.
fn dashboard_queries(problems: &mut Vec<String>) -> (Vec<Query>, Vec<Variable>) {
    let mut queries = Vec::new();
    let mut variables = Vec::new();
    for file in dashboard_files() {
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(&file).unwrap();
        let dash: Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{name} is not JSON: {e}"));
        if dash["title"].as_str().is_none_or(str::is_empty) || dash["uid"].as_str().is_none() {
            problems.push(format!("{name}: the dashboard needs a title and a uid"));
        }
        let vars = dash["templating"]["list"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if !vars.iter().any(|v| {
            v["name"] == "datasource" && v["type"] == "datasource" && v["query"] == "prometheus"
        }) {
            problems.push(format!(
                "{name}: no `datasource` variable of type prometheus"
            ));
        }
        for v in &vars {
            let vname = v["name"].as_str().unwrap_or_default().to_string();
            if v["type"] != "query" {
                variables.push(Variable {
                    name: vname,
                    selector: None,
                    label: String::new(),
                });
                continue;
            }
            let q = v["query"]["query"]
                .as_str()
                .or(v["query"].as_str())
                .unwrap_or_default();
            match parse_label_values(q) {
                Some((selector, label)) => variables.push(Variable {
                    name: vname,
                    selector,
                    label,
                }),
                None => problems.push(format!(
                    "{name}: variable {vname}: not label_values(...): {q:?}"
                )),
            }
        }
        let mut ids = BTreeSet::new();
        walk_panels(&dash["panels"], &name, &mut ids, &mut queries, problems);
    }
    // Every `$name` in a query is a dashboard variable or a Grafana interval.
    for q in &queries {
        for var in variables_in(&q.expr) {
            if !INTERVAL_VARIABLES.contains(&var.as_str())
                && !variables.iter().any(|v| v.name == var)
            {
                problems.push(format!("{}: unknown variable ${var}", q.origin));
            }
        }
    }
    (queries, variables)
}

/// Rows nest their panels when collapsed; both layouts are walked.
fn walk_panels(
    panels: &Value,
    file: &str,
    ids: &mut BTreeSet<u64>,
    queries: &mut Vec<Query>,
    problems: &mut Vec<String>,
) {
    for p in panels.as_array().into_iter().flatten() {
        let title = p["title"].as_str().unwrap_or_default();
        let origin = format!("{file} panel {:?}", title);
        if title.is_empty() {
            problems.push(format!("{file}: a panel without a title: {p}"));
        }
        match p["id"].as_u64() {
            Some(id) if ids.insert(id) => {}
            other => problems.push(format!("{origin}: missing or duplicate id {other:?}")),
        }
        let grid = &p["gridPos"];
        let (x, w) = (grid["x"].as_u64(), grid["w"].as_u64());
        if !matches!((x, w), (Some(x), Some(w)) if w > 0 && x + w <= 24)
            || grid["h"].as_u64().is_none()
        {
            problems.push(format!(
                "{origin}: gridPos {grid} is off the 24-column grid"
            ));
        }
        if p["type"] == "row" {
            walk_panels(&p["panels"], file, ids, queries, problems);
            continue;
        }
        if !is_templated_prometheus(&p["datasource"]) {
            problems.push(format!(
                "{origin}: datasource must be {{type: prometheus, uid: ${{datasource}}}}, is {}",
                p["datasource"]
            ));
        }
        let targets = p["targets"].as_array().cloned().unwrap_or_default();
        if targets.is_empty() {
            problems.push(format!("{origin}: no queries"));
        }
        let mut refs = BTreeSet::new();
        for t in &targets {
            if !t["datasource"].is_null() && !is_templated_prometheus(&t["datasource"]) {
                problems.push(format!(
                    "{origin}: a query's datasource is {}",
                    t["datasource"]
                ));
            }
            if !refs.insert(t["refId"].as_str().unwrap_or_default().to_string()) {
                problems.push(format!("{origin}: duplicate or missing refId"));
            }
            match t["expr"].as_str() {
                Some(e) if !e.trim().is_empty() => queries.push(Query {
                    origin: format!("{origin} query {}", t["refId"]),
                    expr: e.to_string(),
                }),
                _ => problems.push(format!("{origin}: a query without expr")),
            }
        }
    }
}

fn is_templated_prometheus(ds: &Value) -> bool {
    ds["type"] == "prometheus" && ds["uid"] == "${datasource}"
}

/// `label_values(selector, label)` or `label_values(label)`.
fn parse_label_values(q: &str) -> Option<(Option<String>, String)> {
    let inner = q.trim().strip_prefix("label_values(")?.strip_suffix(')')?;
    // The label follows the last comma outside braces and strings.
    let (mut depth, mut quoted, mut split) = (0i32, false, None);
    let mut prev = '\0';
    for (i, c) in inner.char_indices() {
        match c {
            '"' if prev != '\\' => quoted = !quoted,
            '{' | '(' if !quoted => depth += 1,
            '}' | ')' if !quoted => depth -= 1,
            ',' if !quoted && depth == 0 => split = Some(i),
            _ => {}
        }
        prev = c;
    }
    match split {
        Some(i) => Some((
            Some(inner[..i].trim().to_string()),
            inner[i + 1..].trim().to_string(),
        )),
        None => Some((None, inner.trim().to_string())),
    }
}

/// Every alerting and recording rule's `expr` in alerts.yaml.
fn alert_queries() -> Vec<Query> {
    let path = tandem_tests::repo_root().join("deploy/prometheus/alerts.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text).unwrap();
    let mut out = Vec::new();
    for g in doc["groups"].as_sequence().into_iter().flatten() {
        for r in g["rules"].as_sequence().into_iter().flatten() {
            let name = r["alert"].as_str().or(r["record"].as_str()).unwrap_or("?");
            out.push(Query {
                origin: format!("alerts.yaml rule {name}"),
                expr: r["expr"]
                    .as_str()
                    .unwrap_or_else(|| panic!("rule {name} has no expr"))
                    .to_string(),
            });
        }
    }
    assert!(!out.is_empty(), "no rules in {}", path.display());
    out
}

/// Grafana variables as Prometheus would see them from an "All" selection.
fn substitute(expr: &str, variables: &[Variable]) -> String {
    let mut out = expr.to_string();
    for v in INTERVAL_VARIABLES {
        out = out
            .replace(&format!("${{{v}}}"), "5m")
            .replace(&format!("${v}"), "5m");
    }
    // Longest names first, so that `$job` does not eat `$jobs`.
    let mut names: Vec<&str> = variables.iter().map(|v| v.name.as_str()).collect();
    names.sort_by_key(|n| std::cmp::Reverse(n.len()));
    for n in names {
        out = out
            .replace(&format!("${{{n}}}"), ".*")
            .replace(&format!("${n}"), ".*");
    }
    out
}

fn variables_in(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = expr;
    while let Some(i) = rest.find('$') {
        rest = &rest[i + 1..];
        let (name, after) = match rest.strip_prefix('{') {
            Some(r) => {
                let end = r.find('}').unwrap_or(r.len());
                (r[..end].split(':').next().unwrap_or_default(), &r[end..])
            }
            None => {
                let end = rest
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .unwrap_or(rest.len());
                (&rest[..end], &rest[end..])
            }
        };
        out.push(name.to_string());
        rest = after;
    }
    out
}

// ------------------------------------------------------------- the scrape

/// Series names (with the labels seen on them, and each label's values) and
/// `# TYPE` families of the Prometheus text expositions of several
/// processes.
#[derive(Debug, Default)]
struct Exposition {
    series: BTreeMap<String, BTreeSet<String>>,
    values: BTreeMap<String, BTreeMap<String, BTreeSet<String>>>,
    families: BTreeMap<String, String>,
}

impl Exposition {
    fn add(&mut self, text: &str) {
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let mut it = rest.split_whitespace();
                if let (Some(name), Some(kind)) = (it.next(), it.next()) {
                    self.families.insert(name.to_string(), kind.to_string());
                }
                continue;
            }
            if line.starts_with('#') || line.trim().is_empty() {
                continue;
            }
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            let name = line[..end].to_string();
            let labels = self.series.entry(name.clone()).or_default();
            if line[end..].starts_with('{') {
                let pairs = sample_labels(&line[end + 1..]);
                let values = self.values.entry(name).or_default();
                for (l, v) in pairs {
                    labels.insert(l.clone());
                    values.entry(l).or_default().insert(v);
                }
            }
        }
    }

    fn labels_of(&self, metric: &str) -> Option<&BTreeSet<String>> {
        self.series.get(metric)
    }

    /// The values `label` takes on `metric`'s series.
    fn values_of(&self, metric: &str, label: &str) -> Option<&BTreeSet<String>> {
        self.values.get(metric)?.get(label)
    }

    fn all_labels(&self) -> BTreeSet<&str> {
        self.series.values().flatten().map(String::as_str).collect()
    }

    fn summary(&self) -> String {
        self.series
            .iter()
            .map(|(n, l)| format!("  {n} {l:?}"))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// Label names and values of `a="x",b="y\"z"} 1` (the text after the
/// opening brace; values unescaped).
fn sample_labels(s: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut chars = s.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| *c == ',' || c.is_whitespace()) {
            chars.next();
        }
        let name: String =
            std::iter::from_fn(|| chars.next_if(|c| *c != '=' && *c != '}')).collect();
        if chars.next() != Some('=') || chars.next() != Some('"') {
            return out;
        }
        let (mut value, mut escaped) = (String::new(), false);
        for c in chars.by_ref() {
            match c {
                'n' if escaped => {
                    value.push('\n');
                    escaped = false;
                }
                _ if escaped => {
                    value.push(c);
                    escaped = false;
                }
                '\\' => escaped = true,
                '"' => break,
                _ => value.push(c),
            }
        }
        out.push((name.trim().to_string(), value));
    }
}

/// Names and labels of one query that the scrape does not have.
fn check_names(q: &Query, scrape: &Exposition) -> Vec<String> {
    let refs = match promql_refs(&q.expr) {
        Ok(r) => r,
        Err(e) => return vec![format!("{}: cannot read {:?}: {e}", q.origin, q.expr)],
    };
    let mut problems = Vec::new();
    if refs.selectors.is_empty() {
        problems.push(format!("{}: selects no metric: {:?}", q.origin, q.expr));
    }
    let mut known: BTreeSet<&str> = TARGET_LABELS.into_iter().collect();
    for sel in &refs.selectors {
        let Some(m) = &sel.metric else {
            // A selector without a name: only its labels can be checked.
            let all = scrape.all_labels();
            for l in &sel.labels {
                if !TARGET_LABELS.contains(&l.as_str()) && !all.contains(l.as_str()) {
                    problems.push(format!("{}: no exported series has label {l}", q.origin));
                }
            }
            continue;
        };
        let Some(labels) = scrape.labels_of(m) else {
            let why = match scrape.families.get(m) {
                Some(kind) => {
                    format!("is a {kind} family, not a series (select {m}_bucket, _sum or _count)")
                }
                None => "is in no scrape".to_string(),
            };
            problems.push(format!("{}: {m} {why}", q.origin));
            continue;
        };
        for l in &sel.labels {
            if !labels.contains(l) && !TARGET_LABELS.contains(&l.as_str()) {
                problems.push(format!(
                    "{}: {m} has no label {l} (it has {labels:?})",
                    q.origin
                ));
            }
        }
        known.extend(labels.iter().map(String::as_str));
    }
    for l in &refs.grouping {
        if !known.contains(l.as_str()) {
            problems.push(format!(
                "{}: groups by {l}, a label none of its metrics has",
                q.origin
            ));
        }
    }
    problems
}

/// Label values a query filters on (`=`, `!=`, and each alternative of a
/// `=~` / `!~` list of literals) that no exported series of its metric
/// has: the filter would never match, or never exclude anything. Values
/// with Grafana variables are the dashboard user's; regular expressions
/// other than a list of literals cannot be checked and are refused.
fn check_values(q: &Query, scrape: &Exposition) -> Vec<String> {
    let Ok(refs) = promql_refs(&q.expr) else {
        return Vec::new(); // check_names reports it
    };
    let mut problems = Vec::new();
    for sel in &refs.selectors {
        let Some(m) = &sel.metric else { continue };
        for mt in &sel.matchers {
            if mt.value.contains('$')
                || mt.value.is_empty()
                || TARGET_LABELS.contains(&mt.label.as_str())
            {
                continue;
            }
            let Some(seen) = scrape.values_of(m, &mt.label) else {
                continue; // check_names reports the missing label
            };
            let wanted: Vec<&str> = if mt.op.ends_with('~') {
                mt.value.split('|').collect()
            } else {
                vec![mt.value.as_str()]
            };
            for w in wanted {
                if mt.op.ends_with('~')
                    && w.contains(|c: char| !(c.is_ascii_alphanumeric() || "_-:.".contains(c)))
                {
                    problems.push(format!(
                        "{}: {m}{{{}{}\"{}\"}}: only a list of literal values can be checked",
                        q.origin, mt.label, mt.op, mt.value
                    ));
                } else if !seen.contains(w) {
                    problems.push(format!(
                        "{}: {m} never has {}=\"{w}\" (it has {seen:?})",
                        q.origin, mt.label
                    ));
                }
            }
        }
    }
    problems
}

fn check_variable(v: &Variable, scrape: &Exposition) -> Vec<String> {
    let mut problems = Vec::new();
    if let Some(selector) = &v.selector {
        problems.extend(check_names(
            &Query {
                origin: format!("variable {}", v.name),
                expr: selector.clone(),
            },
            scrape,
        ));
    }
    if !v.label.is_empty()
        && !TARGET_LABELS.contains(&v.label.as_str())
        && !scrape.all_labels().contains(v.label.as_str())
    {
        problems.push(format!(
            "variable {}: no exported series has label {}",
            v.name, v.label
        ));
    }
    problems
}

// ---------------------------------------------------------------- PromQL

/// A vector selector: its metric name (none for `{__name__=~"..."}`), the
/// labels its matchers name, and the matchers themselves.
#[derive(Debug, Default, PartialEq)]
struct Selector {
    metric: Option<String>,
    labels: Vec<String>,
    matchers: Vec<Matcher>,
}

/// `label op "value"` (the value unescaped as far as `\"` and `\\`).
#[derive(Debug, PartialEq)]
struct Matcher {
    label: String,
    op: String,
    value: String,
}

impl Matcher {
    #[cfg(test)]
    fn new(label: &str, op: &str, value: &str) -> Matcher {
        Matcher {
            label: label.into(),
            op: op.into(),
            value: value.into(),
        }
    }
}

/// What one PromQL expression refers to.
#[derive(Debug, Default)]
struct Refs {
    selectors: Vec<Selector>,
    /// Labels of `by`, `without`, `on`, `ignoring`, `group_left`, `group_right`.
    grouping: Vec<String>,
}

impl Refs {
    fn metrics(&self) -> BTreeSet<String> {
        self.selectors
            .iter()
            .filter_map(|s| s.metric.clone())
            .collect()
    }
}

/// Keywords followed by a label list.
const GROUPING_KEYWORDS: [&str; 6] = [
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];
/// Other words that are not metric names (when not called like functions).
const KEYWORDS: [&str; 8] = [
    "and", "or", "unless", "offset", "bool", "atan2", "inf", "nan",
];

/// The selectors and grouping labels of a PromQL expression (Grafana
/// variables allowed). A lexer, not a parser: a word followed by `(` is a
/// function or aggregation, ranges and subqueries in `[...]` and strings are
/// skipped, numbers and durations are not words.
fn promql_refs(expr: &str) -> Result<Refs, String> {
    let s: Vec<char> = expr.chars().collect();
    let mut refs = Refs::default();
    let mut i = 0;
    while i < s.len() {
        let c = s[i];
        if c == '#' {
            while i < s.len() && s[i] != '\n' {
                i += 1;
            }
        } else if c == '"' || c == '\'' || c == '`' {
            i = skip_string(&s, i)?;
        } else if c == '[' {
            i = skip_brackets(&s, i)?;
        } else if c == '{' {
            let (sel, end) = matchers(&s, i, None)?;
            refs.selectors.push(sel);
            i = end;
        } else if c == '$' {
            i = skip_variable(&s, i);
        } else if c.is_ascii_digit() || (c == '.' && s.get(i + 1).is_some_and(char::is_ascii_digit))
        {
            while i < s.len() && (s[i].is_ascii_alphanumeric() || s[i] == '.' || s[i] == '_') {
                i += 1;
            }
        } else if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let start = i;
            while i < s.len() && (s[i].is_ascii_alphanumeric() || s[i] == '_' || s[i] == ':') {
                i += 1;
            }
            let word: String = s[start..i].iter().collect();
            let lower = word.to_ascii_lowercase();
            let j = skip_ws(&s, i);
            let next = s.get(j).copied();
            if GROUPING_KEYWORDS.contains(&lower.as_str()) {
                if next == Some('(') {
                    let (labels, end) = label_list(&s, j)?;
                    refs.grouping.extend(labels);
                    i = end;
                }
            } else if KEYWORDS.contains(&lower.as_str())
                || next == Some('(')
                || ["by", "without"].contains(&next_word(&s, j).as_str())
            {
                // An operator, a function or aggregation being called, or an
                // aggregation with its grouping first (`sum by (le) (...)`).
            } else if next == Some('{') {
                let (sel, end) = matchers(&s, j, Some(word))?;
                refs.selectors.push(sel);
                i = end;
            } else {
                refs.selectors.push(Selector {
                    metric: Some(word),
                    ..Selector::default()
                });
            }
        } else if c == '}' || c == ']' {
            return Err(format!("unbalanced {c:?} at {i}"));
        } else {
            i += 1;
        }
    }
    Ok(refs)
}

/// The lowercased word at `i` (empty if none).
fn next_word(s: &[char], i: usize) -> String {
    s[i.min(s.len())..]
        .iter()
        .take_while(|c| c.is_ascii_alphanumeric() || **c == '_')
        .collect::<String>()
        .to_ascii_lowercase()
}

fn skip_ws(s: &[char], mut i: usize) -> usize {
    while i < s.len() && s[i].is_whitespace() {
        i += 1;
    }
    i
}

/// Index after the string literal starting at `i`.
fn skip_string(s: &[char], i: usize) -> Result<usize, String> {
    let quote = s[i];
    let mut j = i + 1;
    while j < s.len() {
        match s[j] {
            '\\' if quote != '`' => j += 2,
            c if c == quote => return Ok(j + 1),
            _ => j += 1,
        }
    }
    Err(format!("unterminated string at {i}"))
}

/// Index after the `[...]` starting at `i` (nested for Grafana's `[[var]]`).
fn skip_brackets(s: &[char], i: usize) -> Result<usize, String> {
    let mut depth = 0;
    for (j, &c) in s.iter().enumerate().skip(i) {
        match c {
            '[' => depth += 1,
            ']' => {
                depth -= 1;
                if depth == 0 {
                    return Ok(j + 1);
                }
            }
            _ => {}
        }
    }
    Err(format!("unterminated [ at {i}"))
}

/// Index after `$name` or `${name...}`.
fn skip_variable(s: &[char], i: usize) -> usize {
    let mut j = i + 1;
    if s.get(j) == Some(&'{') {
        while j < s.len() && s[j] != '}' {
            j += 1;
        }
        return j + 1;
    }
    while j < s.len() && (s[j].is_ascii_alphanumeric() || s[j] == '_') {
        j += 1;
    }
    j
}

/// A label name (bare or quoted) at `i`: the name and the index after it.
fn label_name(s: &[char], i: usize) -> Result<(String, usize), String> {
    if matches!(s.get(i), Some('"' | '\'' | '`')) {
        let end = skip_string(s, i)?;
        return Ok((s[i + 1..end - 1].iter().collect(), end));
    }
    let mut j = i;
    while j < s.len() && (s[j].is_ascii_alphanumeric() || s[j] == '_') {
        j += 1;
    }
    if j == i {
        return Err(format!("expected a label name at {i}"));
    }
    Ok((s[i..j].iter().collect(), j))
}

/// The `{...}` matchers at `i` of a selector named `metric`.
fn matchers(s: &[char], i: usize, mut metric: Option<String>) -> Result<(Selector, usize), String> {
    let (mut labels, mut found) = (Vec::new(), Vec::new());
    let mut j = skip_ws(s, i + 1);
    loop {
        match s.get(j) {
            None => return Err(format!("unterminated {{ at {i}")),
            Some('}') => {
                let sel = Selector {
                    metric,
                    labels,
                    matchers: found,
                };
                return Ok((sel, j + 1));
            }
            Some(',') => {
                j = skip_ws(s, j + 1);
                continue;
            }
            _ => {}
        }
        let quoted = matches!(s.get(j), Some('"' | '\'' | '`'));
        let (name, after) = label_name(s, j)?;
        j = skip_ws(s, after);
        let op: String = s[j..]
            .iter()
            .take_while(|c| matches!(c, '=' | '!' | '~'))
            .collect();
        if op.is_empty() && quoted {
            // `{"metric.name", ...}`: a quoted metric name.
            metric = Some(name);
            continue;
        }
        if !["=", "!=", "=~", "!~"].contains(&op.as_str()) {
            return Err(format!("expected a matcher operator after {name} at {j}"));
        }
        j = skip_ws(s, j + op.len());
        if !matches!(s.get(j), Some('"' | '\'' | '`')) {
            return Err(format!("expected a quoted value for {name} at {j}"));
        }
        let end = skip_string(s, j)?;
        let value = if s[j] == '`' {
            s[j + 1..end - 1].iter().collect()
        } else {
            unquote(&s[j + 1..end - 1])
        };
        if name == "__name__" {
            if op == "=" {
                metric = Some(value);
            }
        } else {
            labels.push(name.clone());
            found.push(Matcher {
                label: name,
                op,
                value,
            });
        }
        j = skip_ws(s, end);
    }
}

/// A PromQL string's characters without its escapes (`\x` is `x`).
fn unquote(s: &[char]) -> String {
    let mut out = String::new();
    let mut escaped = false;
    for &c in s {
        if c == '\\' && !escaped {
            escaped = true;
        } else {
            out.push(c);
            escaped = false;
        }
    }
    out
}

/// The `(a, b)` label list at `i`: the names and the index after it.
fn label_list(s: &[char], i: usize) -> Result<(Vec<String>, usize), String> {
    let mut out = Vec::new();
    let mut j = skip_ws(s, i + 1);
    loop {
        match s.get(j) {
            None => return Err(format!("unterminated label list at {i}")),
            Some(')') => return Ok((out, j + 1)),
            Some(',') => j = skip_ws(s, j + 1),
            _ => {
                let (name, end) = label_name(s, j)?;
                out.push(name);
                j = skip_ws(s, end);
            }
        }
    }
}

// ------------------------------------------------------------ Prometheus

/// A Prometheus server scraping the given targets every second and
/// evaluating `rules`; killed on drop.
struct Prometheus {
    // Declared first: dropped (killed) before its data directory goes.
    _child: KillOnDrop,
    port: u16,
    _dir: tempfile::TempDir,
}

/// A child process killed (and reaped) on drop, also when a test panics.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Prometheus {
    fn start(bin: &Path, targets: &[(&str, u16)], rules: &Path) -> Prometheus {
        let dir = tempfile::Builder::new()
            .prefix("tandem-prometheus-")
            .tempdir()
            .unwrap();
        let mut config = format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\nscrape_configs:\n",
            json!(rules.to_str().unwrap())
        );
        for (job, port) in targets {
            writeln!(
                config,
                "  - job_name: {job}\n    static_configs:\n      - targets: [\"127.0.0.1:{port}\"]"
            )
            .unwrap();
        }
        let config_file = dir.path().join("prometheus.yml");
        std::fs::write(&config_file, config).unwrap();
        let log = dir.path().join("prometheus.log");
        let read_log = || std::fs::read_to_string(&log).unwrap_or_default();
        let mut last = String::new();
        // A free port can be taken between picking and binding it.
        for _ in 0..3 {
            let port = free_port();
            let child = Command::new(bin)
                .arg(format!("--config.file={}", config_file.display()))
                .arg(format!(
                    "--storage.tsdb.path={}",
                    dir.path().join("data").display()
                ))
                .arg(format!("--web.listen-address=127.0.0.1:{port}"))
                .arg("--log.level=warn")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(File::create(&log).unwrap())
                .spawn()
                .unwrap_or_else(|e| panic!("spawning {}: {e}", bin.display()));
            let mut guard = KillOnDrop(child);
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                if TcpStream::connect(("127.0.0.1", port)).is_ok()
                    && http(port, "GET", "/-/ready", "").status == 200
                {
                    return Prometheus {
                        _child: guard,
                        port,
                        _dir: dir,
                    };
                }
                if let Ok(Some(status)) = guard.0.try_wait() {
                    last = format!("{status}: {}", read_log());
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "Prometheus was not ready within 60 s: {}",
                    read_log()
                );
                std::thread::sleep(Duration::from_millis(100));
            }
            if !last.contains("address already in use") {
                break;
            }
        }
        panic!("Prometheus did not start: {last}");
    }

    fn get(&self, path_and_query: &str) -> Value {
        let r = http(self.port, "GET", path_and_query, "");
        serde_json::from_str(&r.body).unwrap_or_else(|e| {
            panic!(
                "Prometheus answered {} to {path_and_query}: {e}: {}",
                r.status, r.body
            )
        })
    }

    /// An instant query; errors come back as `status: error`.
    fn query(&self, expr: &str) -> Value {
        self.get(&format!("/api/v1/query?query={}", percent_encode(expr)))
    }
}

/// Every rule once all have been evaluated at least once.
fn wait_for_rules(prom: &Prometheus) -> Vec<Value> {
    let mut rules = Vec::new();
    wait_for(Duration::from_secs(30), "every rule evaluated", || {
        let r = prom.get("/api/v1/rules");
        rules = r["data"]["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
            .collect();
        !rules.is_empty() && rules.iter().all(|r| r["health"] != "unknown")
    });
    rules
}

fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

fn wait_for(timeout: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `name` from `PATH` (or /usr/bin), or a panic naming the package.
fn tool(name: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin")])
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "`{name}` is missing: install the Debian package `prometheus` \
                 (`apt-get install --no-install-recommends prometheus`, which ships prometheus \
                 and promtool); scripts/test.sh does"
            )
        })
}

// ------------------------------------------------- the extractor's own tests

fn names(expr: &str) -> Vec<String> {
    promql_refs(expr).unwrap().metrics().into_iter().collect()
}

#[test]
fn promql_histogram_quantile_with_grafana_variables() {
    let r = promql_refs(
        r#"histogram_quantile(0.99, sum by (le, batch_type) (rate(tandem_batch_size_bucket{job=~"$job", instance=~"${instance}"}[$__rate_interval])))"#,
    )
    .unwrap();
    assert_eq!(
        r.selectors,
        [Selector {
            metric: Some("tandem_batch_size_bucket".into()),
            labels: vec!["job".into(), "instance".into()],
            matchers: vec![
                Matcher::new("job", "=~", "$job"),
                Matcher::new("instance", "=~", "${instance}")
            ],
        }]
    );
    assert_eq!(r.grouping, ["le", "batch_type"]);
}

#[test]
fn promql_trailing_grouping_and_set_operators() {
    let r = promql_refs(
        "sum(rate(a_total[5m])) by (job) / ignoring(reason) group_left(role) b unless on() c and d or e",
    )
    .unwrap();
    assert_eq!(
        r.metrics().into_iter().collect::<Vec<_>>(),
        ["a_total", "b", "c", "d", "e"]
    );
    assert_eq!(r.grouping, ["job", "reason", "role"]);
    // Keywords are case-insensitive; `bool` and `group_left` without a list.
    let r = promql_refs("SUM BY (le) (x) > BOOL 1 * on(i) GROUP_LEFT y").unwrap();
    assert_eq!(r.metrics().into_iter().collect::<Vec<_>>(), ["x", "y"]);
    assert_eq!(r.grouping, ["le", "i"]);
}

#[test]
fn promql_ranges_subqueries_offsets_and_at() {
    assert_eq!(
        names(
            "max_over_time(deriv(q[5m])[30m:1m]) offset 1h30m + rate(r[1m] offset -5m) + s @ start() + t @ 1609746000"
        ),
        ["q", "r", "s", "t"]
    );
    // Grafana's old `[[var]]` inside a range.
    assert_eq!(names("rate(u[[[interval]]])"), ["u"]);
}

#[test]
fn promql_numbers_are_not_names() {
    assert_eq!(
        names("1e-3 * Inf + NaN - 0x1f + .5 + 2.5e+3 + 1h"),
        Vec::<String>::new()
    );
    assert_eq!(names("vector(0) + time() + scalar(x)"), ["x"]);
}

#[test]
fn promql_strings_and_matchers() {
    let r = promql_refs(
        r#"label_replace(v{a="}{,\"b", c!~'x|y', d=~`z\`}, "dst", "$1", "src", "(sum|by) (.*)")"#,
    )
    .unwrap();
    assert_eq!(
        r.selectors,
        [Selector {
            metric: Some("v".into()),
            labels: vec!["a".into(), "c".into(), "d".into()],
            matchers: vec![
                Matcher::new("a", "=", "}{,\"b"),
                Matcher::new("c", "!~", "x|y"),
                Matcher::new("d", "=~", "z\\"),
            ],
        }]
    );
    assert!(r.grouping.is_empty());
    // Names given as matchers, and selectors without one.
    let r = promql_refs(
        r#"{__name__="w", job="j"} + {__name__=~"tandem_.+"} + {"dotted.name", x="1"}"#,
    )
    .unwrap();
    assert_eq!(
        r.selectors,
        [
            Selector {
                metric: Some("w".into()),
                labels: vec!["job".into()],
                matchers: vec![Matcher::new("job", "=", "j")],
            },
            Selector::default(),
            Selector {
                metric: Some("dotted.name".into()),
                labels: vec!["x".into()],
                matchers: vec![Matcher::new("x", "=", "1")],
            },
        ]
    );
}

#[test]
fn promql_comments_functions_and_colons() {
    assert_eq!(
        names(
            "sum without (le) (rate(job:tandem_requests:rate5m[5m])) # total by (x)\n + count_values(\"v\", k)"
        ),
        ["job:tandem_requests:rate5m", "k"]
    );
    assert_eq!(promql_refs("sum without(le)(m)").unwrap().grouping, ["le"]);
    // `$__interval_ms` outside a range, and a templated quantile.
    assert_eq!(
        names("histogram_quantile($q, n_bucket) * $__interval_ms"),
        ["n_bucket"]
    );
}

#[test]
fn promql_malformed_expressions_are_errors() {
    for bad in [
        r#"x{a="b""#,
        r#"x{a="b}"#,
        "rate(x[5m)",
        "x}",
        "x{a}",
        "sum by (le (x)",
    ] {
        assert!(
            promql_refs(bad).is_err(),
            "{bad:?} read as {:?}",
            promql_refs(bad)
        );
    }
}

#[test]
fn scrape_labels_and_families() {
    let mut e = Exposition::default();
    e.add(concat!(
        "# HELP h A histogram\n# TYPE h histogram\n",
        "h_bucket{batch_type=\"CE\",le=\"1\"} 2\nh_sum{batch_type=\"CE\"} 3\n",
        "# TYPE c_total counter\nc_total{reason=\"a \\\"quoted\\\", b=1\",connector=\"ucx\"} 1\n",
        "g 0\n",
    ));
    assert_eq!(e.families["h"], "histogram");
    assert_eq!(
        e.labels_of("h_bucket").unwrap().iter().collect::<Vec<_>>(),
        ["batch_type", "le"]
    );
    assert_eq!(
        e.labels_of("c_total").unwrap().iter().collect::<Vec<_>>(),
        ["connector", "reason"]
    );
    assert!(e.labels_of("g").unwrap().is_empty());
    let q = |expr: &str| Query {
        origin: "q".into(),
        expr: expr.into(),
    };
    assert!(check_names(&q(r#"sum by (le) (rate(h_bucket{job="x"}[1m])) + g"#), &e).is_empty());
    let p = check_names(
        &q(r#"h + c_total{status="ok"} + missing + sum by (phase) (g)"#),
        &e,
    );
    assert_eq!(p.len(), 4, "{p:?}");
    assert!(p[0].contains("h is a histogram family"), "{p:?}");
    assert!(p[1].contains("c_total has no label status"), "{p:?}");
    assert!(p[2].contains("missing is in no scrape"), "{p:?}");
    assert!(p[3].contains("groups by phase"), "{p:?}");

    // Label values: those a query filters on must be exported.
    assert_eq!(
        e.values_of("c_total", "reason")
            .unwrap()
            .iter()
            .collect::<Vec<_>>(),
        ["a \"quoted\", b=1"]
    );
    let ok = r#"c_total{connector="ucx", job="j"} + c_total{connector!="ucx"} + c_total{connector=~"ucx|ucx", reason=~"$r"} + h_bucket{batch_type!~"CE"}"#;
    assert_eq!(check_values(&q(ok), &e), Vec::<String>::new());
    let p = check_values(
        &q(
            r#"c_total{connector="local"} + c_total{connector=~"ucx|tcp"} + h_bucket{batch_type=~"C.*"} + c_total{connector!="tcp"}"#,
        ),
        &e,
    );
    assert_eq!(p.len(), 4, "{p:?}");
    assert!(
        p[0].contains(r#"c_total never has connector="local""#),
        "{p:?}"
    );
    assert!(
        p[1].contains(r#"c_total never has connector="tcp""#),
        "{p:?}"
    );
    assert!(p[2].contains("only a list of literal values"), "{p:?}");
    assert!(
        p[3].contains(r#"c_total never has connector="tcp""#),
        "{p:?}"
    );
}

#[test]
fn grafana_variables() {
    assert_eq!(
        parse_label_values(r#"label_values({__name__=~"tandem_.+", job=~"$job"}, instance)"#),
        Some((
            Some(r#"{__name__=~"tandem_.+", job=~"$job"}"#.into()),
            "instance".into()
        ))
    );
    assert_eq!(
        parse_label_values("label_values(job)"),
        Some((None, "job".into()))
    );
    assert_eq!(parse_label_values("up"), None);
    assert_eq!(
        variables_in("rate(x{a=~\"$job\"}[$__rate_interval]) * ${q:raw}"),
        ["job", "__rate_interval", "q"]
    );
    let vars = [
        Variable {
            name: "job".into(),
            selector: None,
            label: String::new(),
        },
        Variable {
            name: "jobs".into(),
            selector: None,
            label: String::new(),
        },
    ];
    assert_eq!(
        substitute(
            r#"rate(x{a=~"$jobs", b=~"${job}"}[$__rate_interval])"#,
            &vars
        ),
        r#"rate(x{a=~".*", b=~".*"}[5m])"#
    );
}
