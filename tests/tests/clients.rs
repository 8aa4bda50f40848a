//! Real, unmodified OpenAI clients against `tandem serve` and a 1P1D
//! cluster: the OpenAI Python SDK (`chat.completions.parse`, streaming tool
//! calls, `responses.create` / `responses.parse`), langchain-openai
//! (`with_structured_output` in its three methods, `bind_tools`, the
//! Responses API path), the OpenAI Agents SDK with a function tool on its
//! default Responses model, instructor (TOOLS and JSON modes), all driven by
//! `tests/clients/clients.py`, and aiperf with its default request bodies.
//!
//! The libraries are pinned in `tests/clients/requirements.txt`;
//! `scripts/test.sh` installs them and sets `TANDEM_CLIENTS_PYTHON`.
//!
//! Two more clients, each in a place of its own, check what issue #41
//! found with them, against Qwen2.5 (a model that writes tool calls): the
//! Vercel AI SDK from npm (`tests/clients/ai_sdk.cjs`, pinned in
//! `tests/clients/js`, installed by `scripts/js-clients.sh`,
//! `TANDEM_JS_CLIENTS`) and pydantic-ai (`tests/clients/pydantic_ai_checks.py`,
//! pinned in `tests/clients/requirements-pydantic-ai.txt`, which needs
//! openai 3: its own venv, `TANDEM_PYDANTIC_AI_PYTHON`).

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;
use tandem_discovery::testing::EtcdServer;
use tandem_tests::cluster::{Node, Router, unique_cluster};
use tandem_tests::{Proc, http, ports_in, start_serve};

/// The model's HF tokenizer directory, for aiperf's token counts.
fn tokenizer_dir() -> PathBuf {
    tandem_testkit::cached_path("TANDEM_TEST_HF_DIR", "test-fixtures/smollm2-135m-hf-f32")
}

/// Runs `cmd` to the end (killed after `limit`); its exit success and its
/// combined output.
fn run(mut cmd: Command, limit: Duration) -> (bool, String) {
    static RUNS: AtomicUsize = AtomicUsize::new(0);
    let out_path = std::env::temp_dir().join(format!(
        "tandem-clients-{}-{}.log",
        std::process::id(),
        RUNS.fetch_add(1, Ordering::Relaxed)
    ));
    let out = std::fs::File::create(&out_path).expect("log file");
    let err = out.try_clone().expect("log file");
    let mut child = cmd
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err))
        .spawn()
        .expect("spawning a client");
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(s) = child.try_wait().expect("waiting for a client") {
            break Some(s);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let text = std::fs::read_to_string(&out_path).unwrap_or_default();
    let _ = std::fs::remove_file(&out_path);
    match status {
        Some(s) => (s.success(), text),
        None => (false, format!("{text}\n(killed after {limit:?})")),
    }
}

fn model_name(port: u16) -> String {
    let v = http(port, "GET", "/v1/models", "").json();
    v["data"][0]["id"].as_str().expect("a model id").to_string()
}

/// Every check of `clients.py` passes against the server on `port`.
fn python_clients(port: u16) {
    let mut cmd = Command::new(tandem_tests::clients_python());
    cmd.arg(tandem_tests::repo_root().join("tests/clients/clients.py"))
        .arg(format!("http://127.0.0.1:{port}/v1"))
        .env("PYTHONUNBUFFERED", "1");
    let (ok, out) = run(cmd, Duration::from_secs(600));
    assert!(ok, "client checks failed:\n{out}");
    assert!(out.contains("6 of 6 client checks passed"), "{out}");
    eprintln!("{out}");
}

/// aiperf, streaming chat with its default bodies: every request succeeds
/// and its metrics come out.
fn aiperf(port: u16) {
    let py = tandem_tests::clients_python();
    let bin = py.with_file_name("aiperf");
    let dir = tempfile::tempdir().expect("temp dir");
    let mut cmd = Command::new(&bin);
    cmd.args(["profile", "--model", &model_name(port)])
        .args(["--url", &format!("http://127.0.0.1:{port}")])
        .args(["--endpoint-type", "chat", "--streaming"])
        .args(["--request-count", "8", "--concurrency", "2"])
        .args(["--synthetic-input-tokens-mean", "64"])
        .args(["--output-tokens-mean", "16"])
        .arg("--tokenizer")
        .arg(tokenizer_dir())
        .arg("--artifact-dir")
        .arg(dir.path())
        .args(["--ui-type", "none"]);
    let (ok, out) = run(cmd, Duration::from_secs(300));
    assert!(ok, "aiperf failed:\n{out}");
    let report = std::fs::read_to_string(dir.path().join("profile_export_aiperf.json"))
        .unwrap_or_else(|e| panic!("no aiperf report ({e}):\n{out}"));
    let v: Value = serde_json::from_str(&report).expect("aiperf JSON");
    let avg = |k: &str| v[k]["avg"].as_f64();
    assert_eq!(avg("request_count"), Some(8.0), "{report}");
    let errors = avg("error_request_count").unwrap_or(0.0);
    assert_eq!(errors, 0.0, "{report}");
    assert!(
        avg("time_to_first_token").is_some_and(|t| t > 0.0),
        "{report}"
    );
    assert!(
        avg("inter_token_latency").is_some_and(|t| t > 0.0),
        "{report}"
    );
    assert!(
        avg("output_sequence_length").is_some_and(|n| n >= 1.0),
        "{report}"
    );
    // The server's usage honours max_completion_tokens and agrees with
    // aiperf's own count (it re-tokenizes the text, which can merge a
    // token here and there).
    let usage = avg("usage_completion_tokens").unwrap_or(0.0);
    let counted = avg("output_sequence_length").unwrap_or(0.0);
    assert!((1.0..=16.0).contains(&usage), "{report}");
    assert!((usage - counted).abs() <= 0.1 * usage, "{report}");
}

/// A prepared client install at `cached_path(var, rel)`, or a message
/// naming how to make it.
fn installed(var: &str, rel: &str, how: &str) -> PathBuf {
    let path = tandem_testkit::cached_path(var, rel);
    assert!(
        path.exists(),
        "{} is missing: run {how} (scripts/test.sh does) or set {var}",
        path.display()
    );
    path
}

/// `tandem serve` of Qwen2.5-Coder-0.5B-Instruct, which writes Hermes tool
/// calls as the chat template teaches it.
fn serve_qwen() -> (Proc, u16) {
    let model = tandem_testkit::cached_path(
        "TANDEM_TEST_QWEN2_GGUF",
        "qwen2.5-coder-0.5b/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    );
    let args: Vec<String> = [
        "serve",
        "--model",
        &model.to_string_lossy(),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--max-length",
        "2048",
    ]
    .map(String::from)
    .to_vec();
    let mut proc = Proc::spawn("tandem serve (qwen2.5)", &args, &[]);
    let line = proc.wait_line("tandem: serving ", Duration::from_secs(120));
    (proc, ports_in(&line)[0])
}

/// Runs a client script's checks against `port`: every one passes.
fn client_checks(mut cmd: Command, port: u16, checks: usize) {
    cmd.arg(format!("http://127.0.0.1:{port}/v1"));
    let (ok, out) = run(cmd, Duration::from_secs(300));
    assert!(ok, "client checks failed:\n{out}");
    let all = format!("{checks} of {checks} client checks passed");
    assert!(out.contains(&all), "{out}");
    eprintln!("{out}");
}

/// Issue #41 part 2, with the clients that found it: the Vercel AI SDK and
/// pydantic-ai, each check named after what it holds (see the scripts).
#[test]
fn vercel_ai_sdk_and_pydantic_ai_against_serve() {
    let (_proc, port) = serve_qwen();
    let node_path = installed(
        "TANDEM_JS_CLIENTS",
        "js-clients/node_modules",
        "scripts/js-clients.sh",
    );
    let mut node = Command::new("node");
    node.arg(tandem_tests::repo_root().join("tests/clients/ai_sdk.cjs"))
        .env("NODE_PATH", node_path);
    client_checks(node, port, 5);
    let python = installed(
        "TANDEM_PYDANTIC_AI_PYTHON",
        "pydantic-ai-venv/bin/python",
        "scripts/clients-venv.sh \"$TANDEM_CACHE/pydantic-ai-venv\" tests/clients/requirements-pydantic-ai.txt",
    );
    let mut py = Command::new(python);
    py.arg(tandem_tests::repo_root().join("tests/clients/pydantic_ai_checks.py"))
        .env("PYTHONUNBUFFERED", "1");
    client_checks(py, port, 4);
}

#[test]
fn real_clients_against_serve() {
    let (_proc, port) = start_serve(&["--max-length", "2048"]);
    python_clients(port);
    aiperf(port);
}

#[test]
fn real_clients_against_a_cluster() {
    let etcd = EtcdServer::start().expect("etcd");
    let cluster = unique_cluster("clients");
    let _p = Node::start(
        &etcd.url(),
        &cluster,
        "prefill",
        "p0",
        &["--max-length", "2048"],
    );
    // Every prompt is prefilled remotely, so the prefill node samples the
    // first token under each constraint.
    let d = Node::start(
        &etcd.url(),
        &cluster,
        "decode",
        "d0",
        &["--max-length", "2048", "--remote-prefill-min-tokens", "1"],
    );
    let r = Router::start(&etcd.url(), &cluster);
    r.wait_members(1, 1, Duration::from_secs(20));
    python_clients(r.port);
    aiperf(r.port);
    let remote = d.remote_prefills();
    assert!(remote >= 10.0, "only {remote} remote prefills");
    d.assert_idle();
}
