//! The model families beyond Llama, end to end: Qwen2.5-Coder-0.5B and
//! Gemma 3 270M through `tandem serve` and through a disaggregated cluster
//! (real etcd, prefill and decode processes, KV over UCX), each output
//! equal to the engine's single-sequence generation in this process.
//! Qwen's prefill node runs TP=2 (its ranks write their KV head slices
//! into a TP=1 decode node); Gemma's prompts are longer than its 512-token
//! sliding window, so the decode node continues from handed-over KV whose
//! local layers already skip blocks; a decode node on `gpu:0` (lavapipe
//! without a GPU) continues such KV on the device.
//!
//! Needs the release binary, `TANDEM_TEST_QWEN2_GGUF`,
//! `TANDEM_TEST_GEMMA3_GGUF`, etcd and libucx (scripts/test.sh provides
//! all).

#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::time::Duration;

use serde_json::{Value, json};
use tandem_discovery::testing::EtcdServer;
use tandem_engine::generate::{GenerateRequest, generate};
use tandem_engine::sampler::SamplingParams;
use tandem_engine::{LoadedModel, load};
use tandem_tests::cluster::{Node, Router, unique_cluster};
use tandem_tests::{Proc, assert_greedy_up_to_near_ties_of, http, metric, ports_in};

const MAX_TOKENS: usize = 16;

fn model_path(var: &str) -> PathBuf {
    std::env::var_os(var).map(PathBuf::from).unwrap_or_else(|| {
        panic!("{var} is not set (scripts/test.sh fetches the model and sets it)")
    })
}

/// Greedy text of the engine's single-sequence generator.
fn reference(m: &LoadedModel, prompt: Vec<u32>, max_tokens: usize) -> String {
    let req = GenerateRequest {
        prompt,
        sampling: SamplingParams::greedy(),
        max_tokens,
        stop_token_ids: m.text.tokenizer.stop_ids(),
        stop_strings: Vec::new(),
        prefill_chunk: 512,
    };
    generate(m, &req, |_| {}).unwrap().text
}

fn expected(m: &LoadedModel, prompt: &str) -> String {
    reference(
        m,
        m.text.tokenizer.encode(prompt, true).unwrap(),
        MAX_TOKENS,
    )
}

fn serve(model: &str) -> (Proc, u16) {
    let args: Vec<String> = [
        "serve",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--max-length",
        "2048",
    ]
    .map(String::from)
    .to_vec();
    let mut proc = Proc::spawn("tandem serve", &args, &[]);
    let line = proc.wait_line("tandem: serving ", Duration::from_secs(120));
    let port = ports_in(&line)[0];
    (proc, port)
}

fn complete(port: u16, prompt: &str) -> Value {
    let body = json!({"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0});
    let r = http(port, "POST", "/v1/completions", &body.to_string());
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()
}

/// Runs `prompts` through a 1P1D cluster on `model` (the prefill node
/// with `prefill_extra` flags) and checks each completion against
/// in-process generation, every prompt prefilled remotely with KV bytes
/// moved, and both nodes idle (no leaked blocks) afterwards.
fn disaggregated(
    m: &LoadedModel,
    model: &str,
    name: &str,
    prefill_extra: &[&str],
    prompts: &[String],
) {
    let etcd = EtcdServer::start().unwrap();
    let cluster = unique_cluster(name);
    let flags = ["--model", model, "--max-length", "2048"];
    let prefill: Vec<&str> = flags.iter().chain(prefill_extra).copied().collect();
    let p = Node::start(&etcd.url(), &cluster, "prefill", "p0", &prefill);
    let d = Node::start(&etcd.url(), &cluster, "decode", "d0", &flags);
    let r = Router::start_with(&etcd.url(), &cluster, &flags);
    r.wait_members(1, 1, Duration::from_secs(20));
    for prompt in prompts {
        let v = r.complete(prompt, MAX_TOKENS);
        assert_eq!(
            v["choices"][0]["text"],
            expected(m, prompt).as_str(),
            "{prompt:?}"
        );
    }
    assert_eq!(
        d.remote_prefills(),
        prompts.len() as f64,
        "every prompt prefilled by the prefill node"
    );
    assert!(metric(&p.metrics(), "tandem_dkv_bytes_transferred_bytes_total", "") > 0.0);
    p.assert_idle();
    d.assert_idle();
}

/// Code-flavoured prompts of about 100 tokens (over the decode node's
/// 32-token threshold for remote prefill).
fn code_prompt(i: usize) -> String {
    let names = ["binary_search", "merge_sort", "parse_csv", "lru_cache"];
    format!(
        "# Python utilities, part {i}.\n# Each function has a docstring, type hints and doctests.\n\n\
         from typing import List, Optional\n\n\
         def {name}(items: List[int], target: Optional[int] = None) -> int:\n    \
         \"\"\"Implements {name} over a list of integers and returns the result.\n\n    \
         >>> {name}([1, 2, 3, 4, 5], 3)\n    ",
        name = names[i % names.len()]
    )
}

/// About 700 tokens of prose: past Gemma 3's 512-token window.
fn long_story(i: usize) -> String {
    let mut s = format!("Chapter {i}. ");
    for k in 0..24 {
        s.push_str(&format!(
            "On day {k} the travellers crossed another valley, counted their supplies, \
             and wrote a short note about the weather and the road ahead. "
        ));
    }
    s.push_str("At last, on the final evening, the eldest traveller said");
    s
}

#[test]
fn qwen2_serves_and_runs_disaggregated_with_a_tp2_prefill_node() {
    let path = model_path("TANDEM_TEST_QWEN2_GGUF");
    let m = load(&path).unwrap();
    let model = path.to_str().unwrap();

    let (serve_proc, port) = serve(model);
    let prompts: Vec<String> = (0..3).map(code_prompt).collect();
    for p in &prompts {
        let v = complete(port, p);
        assert_eq!(v["choices"][0]["text"], expected(&m, p).as_str(), "{p:?}");
    }
    // Chat through the model's own template.
    let messages = [json!({"role": "user", "content": "Write a haiku about Rust."})];
    let body = json!({"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0});
    let r = http(port, "POST", "/v1/chat/completions", &body.to_string());
    assert_eq!(r.status, 200, "{}", r.body);
    let rendered = m
        .text
        .chat_template
        .as_ref()
        .expect("Qwen2.5-Coder ships a chat template")
        .render(
            &[tandem_modelfile::chat::ChatMessage::new(
                "user",
                "Write a haiku about Rust.",
            )],
            true,
        )
        .unwrap();
    let want = reference(
        &m,
        m.text.tokenizer.encode(&rendered, false).unwrap(),
        MAX_TOKENS,
    );
    assert_eq!(r.json()["choices"][0]["message"]["content"], want.as_str());
    drop(serve_proc);

    disaggregated(&m, model, "qwen2", &["--tp", "2"], &prompts);
}

#[test]
fn gemma3_serves_and_runs_disaggregated_past_its_sliding_window() {
    let path = model_path("TANDEM_TEST_GEMMA3_GGUF");
    let m = load(&path).unwrap();
    let model = path.to_str().unwrap();
    let window = m.model.config().sliding.expect("Gemma 3 slides").size;
    let prompts: Vec<String> = (0..2).map(long_story).collect();
    for p in &prompts {
        let n = m.text.tokenizer.encode(p, true).unwrap().len();
        assert!(
            n > window + 16,
            "prompt of {n} tokens does not pass the {window}-token window"
        );
    }

    let (serve_proc, port) = serve(model);
    for p in &prompts {
        let v = complete(port, p);
        assert_eq!(v["choices"][0]["text"], expected(&m, p).as_str(), "{p:?}");
    }
    drop(serve_proc);

    disaggregated(&m, model, "gemma3", &[], &prompts);
}

#[test]
fn gemma3_decodes_on_a_gpu_past_its_sliding_window_from_cpu_prefilled_kv() {
    // The prompt's KV, computed by a CPU prefill node past the 512-token
    // window, crosses over UCX into a GPU decode node, whose sliding layers
    // attend to the last 512 positions (their own RoPE base) and global
    // layers to all of them. The continuation is the CPU engine's up to
    // near-ties; a few tokens, since lavapipe runs Gemma's 262,144-token
    // head slowly.
    let path = model_path("TANDEM_TEST_GEMMA3_GGUF");
    let m = load(&path).unwrap();
    let model = path.to_str().unwrap();
    let etcd = EtcdServer::start().unwrap();
    let cluster = unique_cluster("gemma3-gpu");
    let flags = ["--model", model, "--max-length", "1024"];
    let p = Node::start(&etcd.url(), &cluster, "prefill", "p-cpu", &flags);
    let gpu: Vec<&str> = flags
        .iter()
        .copied()
        .chain(["--devices", "gpu:0"])
        .collect();
    let d = Node::start(&etcd.url(), &cluster, "decode", "d-gpu", &gpu);
    let r = Router::start_with(&etcd.url(), &cluster, &flags);
    r.wait_members(1, 1, Duration::from_secs(20));
    let prompt = long_story(7);
    let n = 4;
    let body = json!({"prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 5});
    let resp = http(r.port, "POST", "/v1/completions", &body.to_string());
    assert_eq!(resp.status, 200, "{}\n{}", resp.body, d.proc.stderr());
    assert_greedy_up_to_near_ties_of(&m, &prompt, n, &resp.json());
    assert_eq!(d.remote_prefills(), 1.0, "prefilled by the prefill node");
    p.assert_idle();
    d.assert_idle();
}
