//! The rest of the OpenAI surface end to end with the real model, in
//! `tandem serve` and in a 1P1D cluster: `n` choices, prompt lists and
//! `echo`, `logit_bias`, `min_tokens` (honoured on the prefill node, which
//! samples the first token), `continuous_usage_stats`, and the reasoning
//! parser.

use std::time::Duration;

use serde_json::{Value, json};
use tandem_discovery::testing::EtcdServer;
use tandem_modelfile::ModelMeta;
use tandem_modelfile::tokenizer::Tokenizer;
use tandem_tests::cluster::{Node, Router, unique_cluster};
use tandem_tests::{gguf_path, http, sse_events, start_serve};

fn tokenizer() -> Tokenizer {
    ModelMeta::load(&gguf_path())
        .expect("model metadata")
        .text
        .tokenizer
}

fn post(port: u16, path: &str, body: &Value) -> Value {
    let r = http(port, "POST", path, &body.to_string());
    assert_eq!(r.status, 200, "{path} {body}: {}", r.body);
    r.json()
}

/// A prompt long enough (past `--remote-prefill-min-tokens`) that a
/// cluster prefills it on the prefill node, unique per `tag`.
fn prompt(tag: &str) -> String {
    format!(
        "Note {tag}. You are a careful assistant at a small public library. Visitors ask \
         about opening hours, how to renew a book, where the quiet rooms are, and how to \
         print a page. Answer in one short sentence. What can I ask you about?"
    )
}

fn chat(tag: &str, extra: Value) -> Value {
    let mut body =
        json!({"messages": [{"role": "user", "content": prompt(tag)}], "max_tokens": 12});
    for (k, v) in extra.as_object().expect("object") {
        body[k] = v.clone();
    }
    body
}

fn content(v: &Value, i: usize) -> String {
    v["choices"][i]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// The checks shared by `serve` and the cluster.
fn sampling_extensions(port: u16) {
    let tok = tokenizer();
    let stops = tok.stop_ids();
    assert!(!stops.is_empty());
    let to_stop: serde_json::Map<String, Value> = stops
        .iter()
        .map(|id| (id.to_string(), json!(100)))
        .collect();

    // logit_bias pushes every stop token to the top: greedy ends at once.
    // With min_tokens they are banned for the first three tokens (the first
    // sampled where the prompt was prefilled), then end it.
    let v = post(
        port,
        "/v1/chat/completions",
        &chat("eos", json!({"temperature": 0, "logit_bias": to_stop})),
    );
    assert_eq!(v["usage"]["completion_tokens"], 0, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    let v = post(
        port,
        "/v1/chat/completions",
        &chat(
            "eos",
            json!({"temperature": 0, "logit_bias": to_stop, "min_tokens": 3}),
        ),
    );
    assert_eq!(v["usage"]["completion_tokens"], 3, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");

    // A ban on the greedy first token changes it.
    let greedy = post(
        port,
        "/v1/chat/completions",
        &chat("ban", json!({"temperature": 0, "max_tokens": 1})),
    );
    let first = content(&greedy, 0);
    let ids = tok.encode(&first, false).expect("encode");
    assert_eq!(ids.len(), 1, "one token re-encodes as one: {first:?}");
    let banned = post(
        port,
        "/v1/chat/completions",
        &chat(
            "ban",
            json!({"temperature": 0, "max_tokens": 1, "logit_bias": {ids[0].to_string(): -100}}),
        ),
    );
    assert_ne!(content(&banned, 0), first, "{banned}");

    // n = 2 at temperature 1: choice j is the single request seeded
    // seed + j, so the choices are reproducible one by one.
    let v = post(
        port,
        "/v1/chat/completions",
        &chat("n", json!({"temperature": 1, "seed": 11, "n": 2})),
    );
    assert_eq!(v["choices"].as_array().map(Vec::len), Some(2), "{v}");
    for (j, seed) in [11, 12].into_iter().enumerate() {
        let one = post(
            port,
            "/v1/chat/completions",
            &chat("n", json!({"temperature": 1, "seed": seed})),
        );
        assert_eq!(content(&v, j), content(&one, 0), "choice {j}");
    }
    let single = post(
        port,
        "/v1/chat/completions",
        &chat("n", json!({"temperature": 1, "seed": 11})),
    );
    let prompt_tokens = single["usage"]["prompt_tokens"].as_u64().expect("usage");
    assert_eq!(
        v["usage"]["prompt_tokens"], prompt_tokens,
        "the prompt counts once"
    );

    // A list of prompts with echo: each choice is its prompt followed by
    // that prompt's greedy answer alone.
    let prompts = [prompt("list-a"), prompt("list-b")];
    let v = post(
        port,
        "/v1/completions",
        &json!({"prompt": prompts, "echo": true, "temperature": 0, "max_tokens": 6}),
    );
    for (k, p) in prompts.iter().enumerate() {
        let alone = post(
            port,
            "/v1/completions",
            &json!({"prompt": p, "temperature": 0, "max_tokens": 6}),
        );
        let want = format!(
            "{p}{}",
            alone["choices"][0]["text"].as_str().unwrap_or_default()
        );
        assert_eq!(v["choices"][k]["text"], want, "prompt {k}");
    }

    // continuous_usage_stats: usage on every chunk, counting up.
    let r = http(
        port,
        "POST",
        "/v1/chat/completions",
        &chat(
            "usage",
            json!({"temperature": 0, "stream": true, "ignore_eos": true,
                   "stream_options": {"continuous_usage_stats": true}}),
        )
        .to_string(),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let counts: Vec<u64> = sse_events(&r.body)
        .iter()
        .filter(|e| e.as_str() != "[DONE]")
        .map(|e| {
            let v: Value = serde_json::from_str(e).expect("chunk JSON");
            v["usage"]["completion_tokens"]
                .as_u64()
                .expect("usage on every chunk")
        })
        .collect();
    assert!(counts.windows(2).all(|w| w[0] <= w[1]), "{counts:?}");
    assert_eq!(counts.last(), Some(&12));
}

#[test]
fn serve_honours_the_sampling_extensions() {
    let (_proc, port) = start_serve(&["--max-length", "512"]);
    sampling_extensions(port);
}

#[test]
fn cluster_honours_the_sampling_extensions() {
    let etcd = EtcdServer::start().expect("etcd");
    let cluster = unique_cluster("api");
    let _p = Node::start(&etcd.url(), &cluster, "prefill", "p0", &[]);
    let d = Node::start(&etcd.url(), &cluster, "decode", "d0", &[]);
    let r = Router::start(&etcd.url(), &cluster);
    r.wait_members(1, 1, Duration::from_secs(20));
    sampling_extensions(r.port);
    // The long prompts went to the prefill node (which honoured min_tokens
    // and logit_bias on the first token).
    let remote = d.remote_prefills();
    assert!(remote >= 4.0, "only {remote} remote prefills");
    d.assert_idle();
}

/// `--reasoning-parser think`: a model made to think (by a grammar: SmolLM2
/// does not on its own) gets its thoughts in `reasoning` and its answer in
/// `content`, whole and streamed.
#[test]
fn reasoning_parser_splits_real_output() {
    let (_proc, port) = start_serve(&["--max-length", "512", "--reasoning-parser", "think"]);
    let body = json!({
        "messages": [{"role": "user", "content": "Is water wet? Think first."}],
        "max_tokens": 60,
        "temperature": 0,
        "response_format": {"type": "regex", "regex": "<think>[a-z ]{8,40}</think>[A-Z][a-z ]{4,40}\\."},
    });
    let v = post(port, "/v1/chat/completions", &body);
    let m = &v["choices"][0]["message"];
    let reasoning = m["reasoning"].as_str().expect("reasoning");
    let answer = m["content"].as_str().expect("content");
    assert!(
        reasoning.len() >= 8
            && reasoning
                .chars()
                .all(|c| c.is_ascii_lowercase() || c == ' '),
        "{v}"
    );
    assert!(answer.ends_with('.') && !answer.contains('<'), "{v}");

    let mut stream = body.clone();
    stream["stream"] = json!(true);
    let r = http(port, "POST", "/v1/chat/completions", &stream.to_string());
    assert_eq!(r.status, 200, "{}", r.body);
    let (mut r_text, mut c_text) = (String::new(), String::new());
    for e in sse_events(&r.body)
        .iter()
        .filter(|e| e.as_str() != "[DONE]")
    {
        let v: Value = serde_json::from_str(e).expect("chunk JSON");
        let d = &v["choices"][0]["delta"];
        r_text.push_str(d["reasoning"].as_str().unwrap_or_default());
        c_text.push_str(d["content"].as_str().unwrap_or_default());
    }
    assert_eq!((r_text.as_str(), c_text.as_str()), (reasoning, answer));
}

/// `max_tokens` (and `max_completion_tokens`, `max_output_tokens`) plus
/// the prompt must fit `--max-length` (512 here): beyond it a 400 in
/// OpenAI's shape naming the field, never a silent cap (issues 36 and 41).
/// Exactly the context is served to its end; no `max_tokens` gets the room
/// left.
fn max_tokens_must_fit_the_context(port: u16) {
    const MAX_LENGTH: usize = 512;
    let tok = tokenizer();
    // A prompt of exactly 500 tokens, as token ids.
    let words = tok
        .encode(
            &"The quick brown fox jumps over the lazy dog. ".repeat(60),
            true,
        )
        .expect("tokenizing");
    let prompt: Vec<u32> = words[..MAX_LENGTH - 12].to_vec();
    let refused = |path: &str, body: Value, param: &str, code: &str| {
        let r = http(port, "POST", path, &body.to_string());
        assert_eq!(r.status, 400, "{path} {body}: {}", r.body);
        let e = &r.json()["error"];
        assert_eq!(e["type"], "invalid_request_error", "{}", r.body);
        assert_eq!(e["param"], param, "{}", r.body);
        assert_eq!(e["code"], code, "{}", r.body);
        e["message"].as_str().unwrap_or_default().to_string()
    };
    let cmpl = |max_tokens: Value| json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true});
    let m = refused(
        "/v1/completions",
        cmpl(json!(u64::MAX)),
        "max_tokens",
        "invalid_value",
    );
    assert!(
        m.contains(&u64::MAX.to_string()) && m.contains("512"),
        "{m}"
    );
    refused(
        "/v1/completions",
        cmpl(json!(999_999_999)),
        "max_tokens",
        "invalid_value",
    );
    // One token over: 500 + 13 = 513.
    let m = refused(
        "/v1/completions",
        cmpl(json!(13)),
        "max_tokens",
        "context_length_exceeded",
    );
    assert!(
        m.contains("500") && m.contains("13") && m.contains("512"),
        "{m}"
    );
    let chat = |extra: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "Hi"}]});
        for (k, v) in extra.as_object().expect("object") {
            body[k] = v.clone();
        }
        body
    };
    refused(
        "/v1/chat/completions",
        chat(json!({"max_tokens": 999_999_999})),
        "max_tokens",
        "invalid_value",
    );
    refused(
        "/v1/chat/completions",
        chat(json!({"max_completion_tokens": u64::MAX})),
        "max_completion_tokens",
        "invalid_value",
    );
    refused(
        "/v1/responses",
        json!({"input": "Hi", "max_output_tokens": 999_999_999}),
        "max_output_tokens",
        "invalid_value",
    );

    // Exactly the context: served, and run to its end.
    let v = post(port, "/v1/completions", &cmpl(json!(12)));
    assert_eq!(v["usage"]["prompt_tokens"], 500, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 12, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    // No max_tokens: the room left (a chat's default), not an error.
    let v = post(
        port,
        "/v1/chat/completions",
        &chat(json!({"temperature": 0})),
    );
    let used = v["usage"]["total_tokens"].as_u64().unwrap_or(u64::MAX);
    assert!(used <= MAX_LENGTH as u64, "{v}");
}

#[test]
fn serve_refuses_max_tokens_beyond_the_context() {
    let (_proc, port) = start_serve(&["--max-length", "512"]);
    max_tokens_must_fit_the_context(port);
}

#[test]
fn cluster_refuses_max_tokens_beyond_the_context() {
    let etcd = EtcdServer::start().expect("etcd");
    let cluster = unique_cluster("max-tokens");
    let _p = Node::start(&etcd.url(), &cluster, "prefill", "p0", &[]);
    let d = Node::start(&etcd.url(), &cluster, "decode", "d0", &[]);
    let r = Router::start(&etcd.url(), &cluster);
    r.wait_members(1, 1, Duration::from_secs(20));
    max_tokens_must_fit_the_context(r.port);
    d.assert_idle();
}
