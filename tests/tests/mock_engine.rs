//! End to end with the mock engine (`--engine mock`): real processes, a
//! real etcd, KV handed over UCX, real gRPC and HTTP, only the forward pass
//! replaced by a profile-timed stand-in that writes a hash chain into the
//! KV cache. What the router streams must be the chain's continuation of
//! the prompt (computed here, in-process), so a handoff that moved the
//! wrong bytes fails the test; the nodes must not map the weights.
//!
//! Needs the release binary, `TANDEM_TEST_GGUF`, `etcd` and libucx
//! (scripts/test.sh provides all).

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::json;
use tandem_discovery::testing::EtcdServer;
use tandem_engine::mock::MockModel;
use tandem_modelfile::ModelMeta;
use tandem_perfmodel::{DecodePoint, EngineProfile, PrefillPoint};
use tandem_tests::cluster::{Node, Router, long_prompt, short_prompt, unique_cluster};
use tandem_tests::{gguf_path, http, metric};

const MAX_TOKENS: usize = 12;
/// Profiled prefill time of the test profile's 128-token point.
const PREFILL_128_S: f64 = 0.150;

fn profile() -> EngineProfile {
    EngineProfile {
        version: 1,
        model: "test".into(),
        isa: "test".into(),
        threads: 1,
        tp: 1,
        prefill: vec![
            PrefillPoint {
                tokens: 16,
                seconds: 0.020,
            },
            PrefillPoint {
                tokens: 128,
                seconds: PREFILL_128_S,
            },
        ],
        decode: vec![
            DecodePoint {
                batch: 1,
                context: 128,
                seconds: 0.004,
            },
            DecodePoint {
                batch: 16,
                context: 128,
                seconds: 0.010,
            },
        ],
    }
}

fn write_profile(dir: &Path) -> String {
    let path = dir.join("profile.json");
    std::fs::write(&path, profile().to_json()).unwrap();
    path.to_str().unwrap().to_string()
}

fn mock() -> MockModel {
    MockModel::new(ModelMeta::load(&gguf_path()).unwrap(), profile(), 1.0).unwrap()
}

/// The text the mock engine streams for `prompt`.
fn mock_expected(m: &MockModel, prompt: &str, max_tokens: usize) -> String {
    let tok = &m_text(m).tokenizer;
    let ids = tok.encode(prompt, true).unwrap();
    tok.decode(&m.continuation(&ids, max_tokens), true).unwrap()
}

fn m_text(m: &MockModel) -> &tandem_modelfile::ModelText {
    use tandem_engine::ServedModel;
    m.text()
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap()
}

#[test]
fn mock_prefill_and_decode_nodes_hand_over_real_kv_without_loading_weights() {
    let dir = tempfile::tempdir().unwrap();
    let profile_path = write_profile(dir.path());
    let etcd = EtcdServer::start().unwrap();
    let cluster = unique_cluster("mock");
    let flags = [
        "--engine",
        "mock",
        "--engine-profile",
        profile_path.as_str(),
        "--kv-cache-blocks",
        "128",
    ];
    let p = Node::start(&etcd.url(), &cluster, "prefill", "mp0", &flags);
    let d = Node::start(&etcd.url(), &cluster, "decode", "md0", &flags);
    let r = Router::start(&etcd.url(), &cluster);
    r.wait_members(1, 1, Duration::from_secs(10));
    let m = mock();

    // Neither node maps the weight file, and each stays small.
    let gguf = gguf_path();
    for (name, pid) in [("prefill", p.proc.pid()), ("decode", d.proc.pid())] {
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
        assert!(
            !maps.contains(gguf.to_str().unwrap()),
            "{name} node mapped the weights"
        );
        let rss = rss_kib(pid);
        assert!(rss < 120 * 1024, "{name} node RSS {rss} KiB");
    }

    // A short prompt stays on the decode node; long ones are prefilled
    // remotely and their KV is read back by the decode node's mock, whose
    // tokens depend on every byte of the chain it reads.
    let v = r.complete(short_prompt(), MAX_TOKENS);
    assert_eq!(
        v["choices"][0]["text"],
        mock_expected(&m, short_prompt(), MAX_TOKENS).as_str()
    );
    for i in 0..3 {
        let prompt = long_prompt(i);
        let t0 = Instant::now();
        let v = r.complete(&prompt, MAX_TOKENS);
        let took = t0.elapsed().as_secs_f64();
        assert_eq!(
            v["choices"][0]["text"],
            mock_expected(&m, &prompt, MAX_TOKENS).as_str(),
            "prompt {i}"
        );
        assert_eq!(v["usage"]["completion_tokens"], MAX_TOKENS);
        // The mock sleeps at least the profiled prefill of ~120 tokens.
        assert!(took > PREFILL_128_S * 0.8, "prompt {i} took {took} s");
    }
    let dm = d.metrics();
    assert_eq!(
        metric(&dm, "tandem_decode_prefills_total", "outcome=\"remote\""),
        3.0
    );
    assert_eq!(
        metric(&dm, "tandem_decode_prefills_total", "outcome=\"local\""),
        1.0
    );
    // Streaming, through the same path.
    let body = json!({"prompt": long_prompt(4), "max_tokens": MAX_TOKENS, "stream": true});
    let resp = http(r.port, "POST", "/v1/completions", &body.to_string());
    assert_eq!(resp.status, 200, "{}", resp.body);
    let text: String = resp
        .events()
        .iter()
        .filter(|e| *e != "[DONE]")
        .filter_map(|e| {
            let v: serde_json::Value = serde_json::from_str(e).unwrap();
            v["choices"][0]["text"].as_str().map(str::to_string)
        })
        .collect();
    assert_eq!(text, mock_expected(&m, &long_prompt(4), MAX_TOKENS));
    d.assert_idle();
    p.assert_idle();
}

#[test]
fn mock_serve_streams_the_chain_and_refuses_bad_setups() {
    let dir = tempfile::tempdir().unwrap();
    let profile_path = write_profile(dir.path());
    let (serve, port) = tandem_tests::start_serve(&[
        "--engine",
        "mock",
        "--engine-profile",
        &profile_path,
        "--mock-time-scale",
        "0",
        "--kv-cache-blocks",
        "64",
        "--max-length",
        "512",
    ]);
    let m = mock();
    for i in 0..4 {
        let prompt = long_prompt(i);
        let body = json!({"prompt": prompt, "max_tokens": MAX_TOKENS});
        let resp = http(port, "POST", "/v1/completions", &body.to_string());
        assert_eq!(resp.status, 200, "{}", resp.body);
        assert_eq!(
            resp.json()["choices"][0]["text"],
            mock_expected(&m, &prompt, MAX_TOKENS).as_str()
        );
    }
    drop(serve);

    // Each refusal names what is wrong, before anything serves.
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, r#"{"version": 1, "prefill": []}"#).unwrap();
    let cases: [(&[&str], &str); 4] = [
        (
            &["--engine", "mock"],
            "--engine mock needs --engine-profile",
        ),
        (
            &[
                "--engine",
                "mock",
                "--engine-profile",
                bad.to_str().unwrap(),
            ],
            "parsing the profile",
        ),
        (
            &[
                "--engine",
                "mock",
                "--engine-profile",
                &profile_path,
                "--mock-time-scale=-1",
            ],
            "--mock-time-scale",
        ),
        (
            &[
                "--engine",
                "mock",
                "--engine-profile",
                &profile_path,
                "--tp",
                "2",
            ],
            "--engine mock runs one rank",
        ),
    ];
    for (args, want) in cases {
        let out = std::process::Command::new(tandem_tests::binary())
            .arg("serve")
            .args(["--model", gguf_path().to_str().unwrap(), "--port", "0"])
            .args(args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} started");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
    }
}
