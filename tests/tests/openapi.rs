//! The OpenAPI document `tandem serve` serves at `/openapi.json`, and an
//! HTTP-level fuzz of the running server generated from it: schemathesis
//! (pinned in `tests/clients/requirements.txt`) sends schema-valid and
//! schema-violating requests to every route for a bounded time, checking
//! that no response is a 5xx and that responses match the document
//! (status codes, content types, JSON bodies). Afterwards the server must
//! still be up, healthy and producing the engine's greedy reference.
//!
//! `tests/clients/schemathesis_hooks.py` bounds every generation to a few
//! tokens (`max_tokens` and its spellings); `TANDEM_FUZZ_SECONDS` sets the
//! fuzzing budget (default 45 s), `TANDEM_FUZZ_SEED` its seed.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tandem_tests::{http, http_with, model, reference, start_serve};

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The component schema `name` of `doc`.
fn schema<'a>(doc: &'a Value, name: &str) -> &'a Value {
    doc.pointer(&format!("/components/schemas/{name}"))
        .unwrap_or_else(|| panic!("no schema {name} in the document"))
}

/// The request schema of `POST path`.
fn request_schema<'a>(doc: &'a Value, path: &str) -> &'a Value {
    let op = &doc["paths"][path]["post"];
    let r = op
        .pointer("/requestBody/content/application~1json/schema/$ref")
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("POST {path} has no JSON request schema: {op}"));
    schema(doc, r.trim_start_matches("#/components/schemas/"))
}

/// The document is there, says OpenAPI 3.1, documents every route, and
/// every property it documents for a request is one the running server
/// accepts, while an undocumented one is refused.
fn check_document(port: u16) -> Value {
    let r = http(port, "GET", "/openapi.json", "");
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.header("content-type").starts_with("application/json"));
    let doc = r.json();
    assert!(
        doc["openapi"]
            .as_str()
            .is_some_and(|v| v.starts_with("3.1")),
        "{}",
        doc["openapi"]
    );
    for (path, method) in [
        ("/v1/chat/completions", "post"),
        ("/v1/completions", "post"),
        ("/v1/responses", "post"),
        ("/v1/models", "get"),
        ("/health", "get"),
        ("/metrics", "get"),
        ("/openapi.json", "get"),
    ] {
        let op = &doc["paths"][path][method];
        assert!(op["responses"]["200"].is_object(), "{method} {path}: {op}");
    }
    assert!(doc.get("security").is_none(), "no keys, no security");

    let hi = json!([{"role": "user", "content": "hi"}]);
    for (path, base) in [
        (
            "/v1/chat/completions",
            json!({"messages": hi, "max_tokens": 1}),
        ),
        ("/v1/completions", json!({"prompt": "hi", "max_tokens": 1})),
        (
            "/v1/responses",
            json!({"input": "hi", "max_output_tokens": 1}),
        ),
    ] {
        let s = request_schema(&doc, path);
        assert_eq!(s["additionalProperties"], false, "{path}");
        let props = s["properties"].as_object().expect("properties");
        assert!(props.len() >= 10, "{path}: {props:?}");
        for name in props.keys() {
            if base.get(name).is_some() {
                continue;
            }
            let mut body = base.clone();
            body[name] = Value::Null;
            let r = http(port, "POST", path, &body.to_string());
            assert_eq!(r.status, 200, "{path} with {name}: null: {}", r.body);
        }
        let mut body = base.clone();
        body["undocumented_field"] = json!(1);
        let r = http(port, "POST", path, &body.to_string());
        assert_eq!(r.status, 400, "{path}: {}", r.body);
    }
    doc
}

/// Runs schemathesis against the server on `port` for `seconds` of
/// fuzzing; returns whether it passed, its output and its JSON report.
fn schemathesis(port: u16, seconds: u64, seed: u64) -> (bool, String, Value) {
    let dir = tempfile::tempdir().expect("temp dir");
    let report = dir.path().join("report.json");
    let log = dir.path().join("output.log");
    let out = std::fs::File::create(&log).expect("log file");
    let err = out.try_clone().expect("log file");
    let bin = tandem_tests::clients_python().with_file_name("schemathesis");
    let mut cmd = Command::new(&bin);
    cmd.arg("run")
        .arg(format!("http://127.0.0.1:{port}/openapi.json"))
        .args([
            "--checks",
            "not_a_server_error,status_code_conformance,content_type_conformance,\
             response_schema_conformance",
        ])
        .args(["--phases", "examples,coverage,fuzzing"])
        .args(["--workers", "1"])
        .args(["--seed", &seed.to_string()])
        .args(["--max-time", &seconds.to_string()])
        // A response that takes this long is a hang (a generation is at
        // most a few tokens).
        .args(["--request-timeout", "60"])
        .args(["--suppress-health-check", "all"])
        .args(["--report", "json"])
        .arg("--report-json-path")
        .arg(&report)
        .env("SCHEMATHESIS_HOOKS", "schemathesis_hooks")
        .env(
            "PYTHONPATH",
            tandem_tests::repo_root().join("tests/clients"),
        )
        // Its cache (.schemathesis/) goes with the temporary directory.
        .current_dir(dir.path())
        .env("NO_COLOR", "1")
        .env("COLUMNS", "120")
        .stdin(Stdio::null())
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err));
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("spawning {}: {e}", bin.display()));
    // The time budget, the coverage phase and the last requests.
    let limit = Duration::from_secs(seconds + 240);
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(s) = child.try_wait().expect("waiting for schemathesis") {
            break Some(s);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let report: Value = std::fs::read_to_string(&report)
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok())
        .unwrap_or(Value::Null);
    match status {
        Some(s) => (s.success(), text, report),
        None => (false, format!("{text}\n(killed after {limit:?})"), report),
    }
}

#[test]
fn fuzzing_from_the_openapi_document_finds_no_server_error() {
    let started = Instant::now();
    // Short contexts keep the prompts schemathesis makes cheap to prefill.
    let (mut proc, port) = start_serve(&["--max-length", "512"]);
    check_document(port);

    let seconds = env_or("TANDEM_FUZZ_SECONDS", 45);
    let seed = env_or("TANDEM_FUZZ_SEED", 1);
    let (ok, out, report) = schemathesis(port, seconds, seed);
    eprintln!("{out}");
    assert!(ok, "schemathesis found failures (see above)");
    // It ran: every operation, and many cases, with nothing failing.
    let generated = report["test_cases"]["generated"].as_u64().unwrap_or(0);
    assert_eq!(report["operations"]["tested"], 6, "{report}");
    assert!(generated >= 300, "only {generated} test cases: {report}");
    assert_eq!(report["test_cases"]["with_failures"], 0, "{report}");
    assert_eq!(report["errors"], json!([]), "{report}");
    eprintln!(
        "schemathesis: {generated} test cases in {:.0} s (seed {seed}), none failed; \
         schema-valid cases accepted / rejected per operation: {}",
        report["running_time"].as_f64().unwrap_or(0.0),
        report["valid_rates"]
    );

    // Still alive, healthy, and computing what the engine computes.
    assert!(proc.is_running(), "the server died:\n{}", proc.stderr());
    let h = http(port, "GET", "/health", "");
    assert_eq!(h.status, 200, "{}", h.body);
    assert_eq!(h.json()["status"], "ok");
    assert_eq!(h.json()["requests_in_flight"], 0, "{}", h.body);
    let text = "The capital of France is";
    let r = http(
        port,
        "POST",
        "/v1/completions",
        &json!({"prompt": text, "temperature": 0, "max_tokens": 12}).to_string(),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let prompt = model()
        .text
        .tokenizer
        .encode(text, true)
        .expect("tokenizing");
    assert_eq!(
        r.json()["choices"][0]["text"],
        reference(prompt, 12).as_str()
    );
    let log = proc.stderr();
    assert!(!log.contains("panicked"), "a panic was logged:\n{log}");
    eprintln!(
        "openapi fuzz: {:.0} s in all",
        started.elapsed().as_secs_f64()
    );
}

#[test]
fn with_api_keys_the_document_needs_one_and_documents_bearer_auth() {
    let (_proc, port) = start_serve(&["--api-key", "sk-fuzz", "--max-length", "512"]);
    let r = http(port, "GET", "/openapi.json", "");
    assert_eq!(r.status, 401, "{}", r.body);
    let r = http_with(
        port,
        "GET",
        "/openapi.json",
        "",
        &[("authorization", "Bearer sk-fuzz")],
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let doc = r.json();
    assert_eq!(
        doc["components"]["securitySchemes"]["bearerAuth"],
        json!({"type": "http", "scheme": "bearer",
               "description": "An API key of the server (--api-key, --api-key-file)."})
    );
    assert_eq!(doc["security"], json!([{"bearerAuth": []}]));
    // /health and /metrics stay open unless protected, and say so.
    assert_eq!(doc["paths"]["/health"]["get"]["security"], json!([]));
    assert_eq!(http(port, "GET", "/health", "").status, 200);
}
