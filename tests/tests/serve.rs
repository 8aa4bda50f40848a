//! End to end: `tandem serve` as a child process with the real model, spoken
//! to over real HTTP (the harness's reqwest client).
//!
//! Needs the release binary (`cargo build --release -p tandem-cli`; found at
//! `$TANDEM_BIN`, `$CARGO_TARGET_DIR/release/tandem` or `target/release/tandem`)
//! and `TANDEM_TEST_GGUF` pointing at SmolLM2-135M-Instruct.Q4_1.gguf
//! (scripts/test.sh does both).

#![allow(clippy::unwrap_used)]

use std::io::Read;
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tandem_engine::sampler::SamplingParams;
use tandem_modelfile::chat::ChatMessage;
use tandem_tests::{
    Proc, Resp, assert_greedy_up_to_near_ties, gguf_path, http, http_all, http_with, metric, model,
    ports_in, raw_request, reference, reference_output, reference_outputs,
};
use tandem_types::FinishReason;

const MAX_LENGTH: usize = 512;

/// A running `tandem serve`; killed on drop.
struct Server {
    proc: Proc,
    port: u16,
}

impl Server {
    fn start(extra: &[&str]) -> Server {
        let gguf = gguf_path();
        let max_length = MAX_LENGTH.to_string();
        let defaults = [
            ("--model", gguf.to_str().unwrap()),
            ("--host", "127.0.0.1"),
            ("--port", "0"),
            ("--max-length", &max_length),
            ("--max-batch-size", "16"),
            ("--kv-cache-blocks", "1024"),
        ];
        // A default that `extra` sets again is left out: clap refuses a
        // flag given twice.
        let mut args = vec!["serve".to_string()];
        for (flag, value) in defaults {
            if !extra.contains(&flag) {
                args.extend([flag.to_string(), value.to_string()]);
            }
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut proc = Proc::spawn("tandem serve", &args, &[]);
        let line = proc.wait_line("tandem: serving ", Duration::from_secs(120));
        let port = ports_in(&line)[0];
        Server { proc, port }
    }

    fn get(&self, path: &str) -> Resp {
        http(self.port, "GET", path, "")
    }

    fn post(&self, path: &str, body: &Value) -> Resp {
        http(self.port, "POST", path, &body.to_string())
    }

    fn health(&self) -> Value {
        self.get("/health").json()
    }
}

fn chat_body(content: &str, max_tokens: usize) -> Value {
    json!({
        "model": "SmolLM2-135M-Instruct.Q4_1",
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": max_tokens,
    })
}

fn chat_prompt(messages: &[ChatMessage]) -> Vec<u32> {
    let m = model();
    let text = m
        .text
        .chat_template
        .as_ref()
        .unwrap()
        .render(messages, true)
        .unwrap();
    m.text.tokenizer.encode(&text, false).unwrap()
}

/// Concatenated content deltas, finish reason and usage of a chat SSE body.
fn read_chat_stream(events: &[String]) -> (String, Option<String>, Option<Value>) {
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let mut text = String::new();
    let mut finish = None;
    let mut usage = None;
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        assert!(v.get("error").is_none(), "stream error: {e}");
        assert_eq!(v["object"], "chat.completion.chunk");
        if let Some(c) = v["choices"].get(0) {
            if let Some(t) = c["delta"]["content"].as_str() {
                text.push_str(t);
            }
            if let Some(f) = c["finish_reason"].as_str() {
                finish = Some(f.to_string());
            }
        } else if !v["usage"].is_null() {
            usage = Some(v["usage"].clone());
        }
    }
    (text, finish, usage)
}

const QUESTION: &str = "What is the capital of France?";

#[test]
fn chat_and_completions_match_the_engine_greedy() {
    let server = Server::start(&[]);
    let r = server.post("/v1/chat/completions", &chat_body(QUESTION, 16));
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    let prompt = chat_prompt(&[ChatMessage::new("user", QUESTION)]);
    let n_prompt = prompt.len();
    let want = reference(prompt, 16);
    assert_eq!(v["choices"][0]["message"]["content"], want.as_str());
    let usage = &v["usage"];
    assert_eq!(usage["prompt_tokens"], n_prompt);
    assert_eq!(
        usage["total_tokens"].as_u64().unwrap(),
        usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap()
    );
    assert!(usage["prompt_tokens_details"]["cached_tokens"].is_u64());
    let finish = v["choices"][0]["finish_reason"].as_str().unwrap();
    assert!(finish == "stop" || finish == "length", "{finish}");

    let text = "The three primary colors are";
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": text, "temperature": 0, "max_tokens": 16, "logprobs": 2}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["object"], "text_completion");
    let prompt = model().text.tokenizer.encode(text, true).unwrap();
    assert_eq!(v["usage"]["prompt_tokens"], prompt.len());
    assert_eq!(v["choices"][0]["text"], reference(prompt, 16).as_str());
    let lp = &v["choices"][0]["logprobs"];
    let n = v["usage"]["completion_tokens"].as_u64().unwrap() as usize;
    assert_eq!(lp["tokens"].as_array().unwrap().len(), n);
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 2);
}

#[test]
fn streaming_chat_equals_non_streaming() {
    let server = Server::start(&[]);
    let plain = server.post("/v1/chat/completions", &chat_body(QUESTION, 24));
    assert_eq!(plain.status, 200, "{}", plain.body);
    let plain = plain.json();
    let mut body = chat_body(QUESTION, 24);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let r = server.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        r.header("content-type").starts_with("text/event-stream"),
        "{:?}",
        r.headers
    );
    let events = r.events();
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    let (text, finish, usage) = read_chat_stream(&events);
    assert_eq!(
        text,
        plain["choices"][0]["message"]["content"].as_str().unwrap()
    );
    assert_eq!(
        finish.as_deref(),
        plain["choices"][0]["finish_reason"].as_str()
    );
    let usage = usage.expect("usage chunk");
    assert_eq!(
        usage["completion_tokens"],
        plain["usage"]["completion_tokens"]
    );
    assert_eq!(usage["prompt_tokens"], plain["usage"]["prompt_tokens"]);
    // The usage chunk is last before [DONE], with empty choices.
    let last: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(last["choices"], json!([]));

    // Without include_usage there is no usage chunk.
    body["stream_options"] = Value::Null;
    let r = server.post("/v1/chat/completions", &body);
    let (text2, _, usage) = read_chat_stream(&r.events());
    assert_eq!(text2, text);
    assert!(usage.is_none());
}

/// 32 concurrent streams (twice the batch size, so some queue) with mixed
/// prompt lengths and output lengths: every greedy text equals what the
/// engine produces for that prompt alone, so batch composition never
/// changes outputs.
#[test]
fn thirty_two_concurrent_streams_match_single_sequence_outputs() {
    let server = Server::start(&[]);
    let port = server.port;
    let question = |i: usize| {
        format!(
            "Tell me a fact about the number {i}.{}",
            " Please be precise.".repeat(i % 5)
        )
    };
    let max_tokens = |i: usize| if i.is_multiple_of(2) { 16 } else { 7 };
    let handles: Vec<_> = (0..32)
        .map(|i| {
            std::thread::spawn(move || {
                let mut body = chat_body(&question(i), max_tokens(i));
                body["stream"] = json!(true);
                body["stream_options"] = json!({"include_usage": true});
                let r = http(port, "POST", "/v1/chat/completions", &body.to_string());
                assert_eq!(r.status, 200, "{}", r.body);
                let (text, finish, usage) = read_chat_stream(&r.events());
                assert!(finish.is_some());
                assert!(usage.unwrap()["completion_tokens"].as_u64().unwrap() >= 1);
                text
            })
        })
        .collect();
    let texts: Vec<String> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    for (i, text) in texts.iter().enumerate() {
        let want = reference(
            chat_prompt(&[ChatMessage::new("user", question(i))]),
            max_tokens(i),
        );
        assert_eq!(
            text, &want,
            "request {i} differs from its single-sequence output"
        );
    }
    assert_eq!(server.health()["running"], 0);
}

#[test]
fn api_rules() {
    let server = Server::start(&[]);
    // Unknown field: 400 naming the field and the flag.
    let mut body = chat_body("hi", 2);
    body["frobnicate"] = json!(true);
    let r = server.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 400, "{}", r.body);
    let m = r.error_message();
    assert!(
        m.contains("frobnicate") && m.contains("--allow-extra-request-fields"),
        "{m}"
    );
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");

    // Explicit nulls are fine.
    let mut body = chat_body("hi", 2);
    for k in [
        "tools",
        "tool_choice",
        "response_format",
        "seed",
        "stop",
        "n",
        "user",
        "logprobs",
    ] {
        body[k] = Value::Null;
    }
    let r = server.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    // Non-null legacy `functions` are not (tools are; see tests/structured).
    let mut body = chat_body("hi", 2);
    body["functions"] = json!([{"name": "f"}]);
    let r = server.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 400);
    assert!(r.error_message().contains("not supported"));

    // Developer role and content parts.
    let body = json!({
        "messages": [
            {"role": "developer", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": QUESTION}]}
        ],
        "temperature": 0, "max_tokens": 8
    });
    let r = server.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let prompt = chat_prompt(&[
        ChatMessage::new("system", "You are terse."),
        ChatMessage::new("user", QUESTION),
    ]);
    assert_eq!(r.json()["usage"]["prompt_tokens"], prompt.len());

    // n out of range, too many stop strings, bad temperature, unknown model.
    for (k, v) in [
        ("n", json!(0)),
        ("stop", json!(["a", "b", "c", "d", "e"])),
        ("temperature", json!(5)),
    ] {
        let mut body = chat_body("hi", 2);
        body[k] = v;
        let r = server.post("/v1/chat/completions", &body);
        assert_eq!(r.status, 400, "{k}: {}", r.body);
        assert_eq!(r.json()["error"]["param"], k);
    }
    let mut body = chat_body("hi", 2);
    body["model"] = json!("gpt-17");
    assert_eq!(server.post("/v1/chat/completions", &body).status, 404);
    assert_eq!(server.get("/v1/nope").status, 404);

    // Prompt too long: the exact message, also when streaming.
    let long = "hello ".repeat(MAX_LENGTH);
    let n = chat_prompt(&[ChatMessage::new("user", long.as_str())]).len();
    let want = format!(
        "Prompt is too long: {n} tokens exceeds the configured maximum context length of {MAX_LENGTH} tokens. Please shorten your prompt."
    );
    let mut body = chat_body(&long, 4);
    let r = server.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.error_message(), want);
    body["stream"] = json!(true);
    let r = server.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.error_message(), want);
    let n = model().text.tokenizer.encode(&long, true).unwrap().len();
    let r = server.post("/v1/completions", &json!({"prompt": long, "stream": true}));
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(
        r.error_message(),
        format!(
            "Prompt is too long: {n} tokens exceeds the configured maximum context length of {MAX_LENGTH} tokens. Please shorten your prompt."
        )
    );

    // Stop strings cut the text: the greedy text up to the stop string.
    let text = "1, 2, 3, 4,";
    let full = reference(model().text.tokenizer.encode(text, true).unwrap(), 20);
    let cut = full
        .find(" 7")
        .unwrap_or_else(|| panic!("{full:?} has no \" 7\""));
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": text, "temperature": 0, "max_tokens": 20, "stop": " 7"}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert_eq!(v["choices"][0]["text"], &full[..cut], "{v}");

    // /v1/models lists the model.
    let v = server.get("/v1/models").json();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "SmolLM2-135M-Instruct.Q4_1");
    assert_eq!(v["data"][0]["object"], "model");
}

fn finish_str(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

const STORY: &str = "Once upon a time, in a small village at the edge of a great forest,";
const LAUGH: &str = "ha ha ha ha ha ha ha ha";

/// Every sampling parameter sent over HTTP changes the output exactly as
/// it changes the engine's own generator in this process: seeded draws are
/// reproduced token for token, so a parameter the HTTP layer dropped or
/// altered shows up as a different text.
#[test]
fn every_sampling_parameter_reaches_the_sampler() {
    const N: usize = 24;
    let server = Server::start(&[]);
    let seeded = |seed: u64| SamplingParams {
        temperature: 1.0,
        seed: Some(seed),
        ..SamplingParams::default()
    };
    let story = |params: Value| (STORY, params);
    // Each parameter on top of seed 1: the engine's text, which differs
    // from seed 1's own (else the case would prove nothing).
    let cases: Vec<(&str, Value, SamplingParams)> = vec![
        (
            STORY,
            json!({"temperature": 0.5, "seed": 1}),
            SamplingParams {
                temperature: 0.5,
                ..seeded(1)
            },
        ),
        (
            STORY,
            json!({"temperature": 1, "seed": 1, "top_p": 0.5}),
            SamplingParams {
                top_p: 0.5,
                ..seeded(1)
            },
        ),
        (
            STORY,
            json!({"temperature": 1, "seed": 1, "top_k": 3}),
            SamplingParams {
                top_k: 3,
                ..seeded(1)
            },
        ),
        (
            STORY,
            json!({"temperature": 1, "seed": 1, "min_p": 0.2}),
            SamplingParams {
                min_p: 0.2,
                ..seeded(1)
            },
        ),
        (
            STORY,
            json!({"temperature": 1, "seed": 1, "frequency_penalty": 1.5}),
            SamplingParams {
                frequency_penalty: 1.5,
                ..seeded(1)
            },
        ),
        (
            STORY,
            json!({"temperature": 1, "seed": 1, "presence_penalty": 1.5}),
            SamplingParams {
                presence_penalty: 1.5,
                ..seeded(1)
            },
        ),
        (
            STORY,
            json!({"temperature": 1, "seed": 1, "repetition_penalty": 1.5}),
            SamplingParams {
                repetition_penalty: 1.5,
                ..seeded(1)
            },
        ),
    ];
    // Penalties on a repetitive greedy continuation.
    let penalties: Vec<(&str, Value, SamplingParams)> = [
        ("presence_penalty", 2.0),
        ("frequency_penalty", 2.0),
        ("repetition_penalty", 2.0),
    ]
    .into_iter()
    .map(|(name, value)| {
        let mut sampling = SamplingParams::greedy();
        match name {
            "presence_penalty" => sampling.presence_penalty = value,
            "frequency_penalty" => sampling.frequency_penalty = value,
            _ => sampling.repetition_penalty = value,
        }
        let mut params = json!({"temperature": 0});
        params[name] = json!(value);
        (name, params, sampling)
    })
    .collect();
    // Truncations that leave only the most likely token are greedy at
    // temperature 1, whatever the (unseeded) draw; -1 and 0 disable top_k.
    let truncations = [
        json!({"temperature": 1, "top_k": 1}),
        json!({"temperature": 1, "top_p": 1e-6}),
        json!({"temperature": 1, "min_p": 1.0}),
    ];
    let no_top_k = [-1, 0].map(|k| json!({"temperature": 1, "seed": 1, "top_k": k}));

    // Every completion and every engine reference the checks below read,
    // asked for at once: the requests concurrently (the server batches
    // them), the references in one batch (`reference_outputs`). Each is
    // what it would be alone; the checks read them in the order asked.
    let mut asked: Vec<(&str, Value)> = vec![
        story(json!({"temperature": 0})),
        story(json!({"temperature": 1, "seed": 1})),
        story(json!({"temperature": 1, "seed": 1})),
    ];
    asked.extend((2..=4u64).map(|seed| story(json!({"temperature": 1, "seed": seed}))));
    asked.push(story(json!({"temperature": 1, "seed": -7})));
    asked.extend(cases.iter().map(|(p, params, _)| (*p, params.clone())));
    asked.push((LAUGH, json!({"temperature": 0})));
    asked.extend(
        penalties
            .iter()
            .map(|(_, params, _)| (LAUGH, params.clone())),
    );
    asked.extend(truncations.iter().cloned().map(story));
    asked.extend(no_top_k.iter().cloned().map(story));
    let mut engine_asked: Vec<(&str, SamplingParams)> =
        vec![(STORY, SamplingParams::greedy()), (STORY, seeded(1))];
    engine_asked.extend((2..=4u64).map(|seed| (STORY, seeded(seed))));
    engine_asked.push((STORY, seeded(-7i64 as u64)));
    engine_asked.extend(cases.iter().map(|(p, _, s)| (*p, s.clone())));
    engine_asked.push((LAUGH, SamplingParams::greedy()));
    engine_asked.extend(penalties.iter().map(|(_, _, s)| (LAUGH, s.clone())));

    let bodies: Vec<String> = asked
        .iter()
        .map(|(prompt, params)| {
            let mut body = json!({"prompt": prompt, "max_tokens": N});
            body.as_object_mut()
                .unwrap()
                .extend(params.as_object().unwrap().clone());
            body.to_string()
        })
        .collect();
    let engine_texts: Vec<String> = {
        let requests: Vec<(Vec<u32>, SamplingParams)> = engine_asked
            .iter()
            .map(|(prompt, s)| {
                let ids = model().text.tokenizer.encode(prompt, true).unwrap();
                (ids, s.clone())
            })
            .collect();
        reference_outputs(&requests, N)
            .into_iter()
            .map(|r| r.text)
            .collect()
    };
    let responses = http_all(server.port, "POST", "/v1/completions", &bodies);
    let mut answers = asked.iter().zip(&bodies).zip(responses);
    let mut complete = |prompt: &str, params: &Value| {
        let (((p, v), body), r) = answers.next().expect("a completion asked for");
        assert_eq!((*p, v), (prompt, params), "read in the order asked");
        assert_eq!(r.status, 200, "{body}: {}", r.body);
        r.json()["choices"][0]["text"].as_str().unwrap().to_string()
    };
    let mut references = engine_asked.iter().zip(engine_texts);
    let mut engine = |prompt: &str, sampling: SamplingParams| {
        let ((p, s), text) = references.next().expect("a reference asked for");
        assert_eq!((*p, s), (prompt, &sampling), "read in the order asked");
        text
    };

    let greedy = engine(STORY, SamplingParams::greedy());
    assert_eq!(complete(STORY, &json!({"temperature": 0})), greedy);

    // Temperature 1 with a seed: the engine's draws, token for token.
    let base = engine(STORY, seeded(1));
    assert_ne!(base, greedy, "seed 1 happens to draw the greedy text");
    let first = complete(STORY, &json!({"temperature": 1, "seed": 1}));
    assert_eq!(first, base);
    assert_eq!(
        complete(STORY, &json!({"temperature": 1, "seed": 1})),
        first,
        "same seed, different text"
    );
    // Different seeds draw different texts (each checked against the
    // engine, so this is no accident of the seeds chosen).
    let mut texts = vec![first];
    for seed in 2..=4u64 {
        let got = complete(STORY, &json!({"temperature": 1, "seed": seed}));
        assert_eq!(got, engine(STORY, seeded(seed)), "seed {seed}");
        assert!(!texts.contains(&got), "seed {seed} repeats a text: {got:?}");
        texts.push(got);
    }
    // A negative seed is its two's-complement bits.
    assert_eq!(
        complete(STORY, &json!({"temperature": 1, "seed": -7})),
        engine(STORY, seeded(-7i64 as u64))
    );

    for (prompt, params, sampling) in &cases {
        let want = engine(prompt, sampling.clone());
        assert_ne!(want, base, "{params} does not change seed 1's text");
        assert_eq!(complete(prompt, params), want, "{params}");
    }

    // Penalties on a repetitive greedy continuation change it, exactly as
    // in the engine.
    let laughing = engine(LAUGH, SamplingParams::greedy());
    assert_eq!(complete(LAUGH, &json!({"temperature": 0})), laughing);
    for (name, params, sampling) in &penalties {
        let want = engine(LAUGH, sampling.clone());
        assert_ne!(want, laughing, "{name} changes nothing: {want:?}");
        let got = complete(LAUGH, params);
        assert_eq!(got, want, "{name}");
    }

    for params in &truncations {
        assert_eq!(complete(STORY, params), greedy, "{params}");
    }
    for (k, params) in [-1, 0].iter().zip(&no_top_k) {
        assert_eq!(complete(STORY, params), base, "top_k {k}");
    }
    assert!(answers.next().is_none(), "every completion checked");
    assert!(references.next().is_none(), "every reference checked");

    // n = 1 is the one choice we serve; more is refused.
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": STORY, "max_tokens": 2, "n": 1, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["choices"].as_array().unwrap().len(), 1);

    // Out-of-range values: 400 naming the field.
    for (path, field, value) in [
        ("/v1/completions", "temperature", json!(-0.5)),
        ("/v1/completions", "temperature", json!(2.5)),
        ("/v1/completions", "top_p", json!(0)),
        ("/v1/completions", "top_p", json!(1.5)),
        ("/v1/completions", "min_p", json!(1.5)),
        ("/v1/completions", "min_p", json!(-0.1)),
        ("/v1/completions", "top_k", json!(-5)),
        ("/v1/completions", "frequency_penalty", json!(2.5)),
        ("/v1/completions", "presence_penalty", json!(-2.5)),
        ("/v1/completions", "repetition_penalty", json!(0)),
        ("/v1/completions", "logprobs", json!(21)),
        ("/v1/completions", "max_tokens", json!(0)),
        ("/v1/completions", "n", json!(0)),
        ("/v1/completions", "logit_bias", json!({"1": 150})),
        ("/v1/chat/completions", "top_logprobs", json!(21)),
        ("/v1/chat/completions", "n", json!(33)),
        ("/v1/chat/completions", "logit_bias", json!({"999999": 1})),
    ] {
        let mut body = if path == "/v1/completions" {
            json!({"prompt": STORY, "max_tokens": 2})
        } else {
            json!({"messages": [{"role": "user", "content": "hi"}], "logprobs": true})
        };
        body[field] = value.clone();
        let r = server.post(path, &body);
        assert_eq!(r.status, 400, "{field} = {value}: {}", r.body);
        assert_eq!(r.json()["error"]["param"], field, "{}", r.body);
        assert!(r.error_message().contains(field), "{}", r.body);
    }
}

/// `logprobs` / `top_logprobs` report the model's own distribution: k
/// alternatives, most likely first, the greedy choice at their head, with
/// the engine's values; `max_completion_tokens` bounds a chat completion
/// and wins over `max_tokens`.
#[test]
fn logprobs_and_length_limits() {
    let server = Server::start(&[]);
    let ask = "Write a long story about a dragon who learns to fly.";
    let prompt = chat_prompt(&[ChatMessage::new("user", ask)]);
    let with_lp = SamplingParams {
        logprobs: true,
        top_logprobs: 5,
        ..SamplingParams::greedy()
    };
    let want = reference_output(prompt.clone(), with_lp, 12);
    assert_eq!(want.tokens.len(), 12, "the answer is meant to be longer");
    let mut body = chat_body(ask, 12);
    body["logprobs"] = json!(true);
    body["top_logprobs"] = json!(5);
    let r = server.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["choices"][0]["message"]["content"], want.text.as_str());
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 12, "{v}");
    let close = |a: f64, b: f32| (a - f64::from(b)).abs() <= 1e-4;
    for (entry, sampled) in content.iter().zip(&want.sampled) {
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 5, "{entry}");
        let lps: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
        assert!(lps.iter().all(|&l| l <= 0.0), "{entry}");
        assert!(lps.windows(2).all(|w| w[0] >= w[1]), "not sorted: {entry}");
        // Greedy: the chosen token is the most likely one.
        assert_eq!(top[0]["token"], entry["token"], "{entry}");
        assert_eq!(top[0]["logprob"], entry["logprob"], "{entry}");
        let lp = entry["logprob"].as_f64().unwrap();
        assert!(
            close(lp, sampled.logprob.unwrap()),
            "{entry} vs {sampled:?}"
        );
        for (t, (_, l)) in top.iter().zip(&sampled.top) {
            assert!(
                close(t["logprob"].as_f64().unwrap(), *l),
                "{entry} vs {sampled:?}"
            );
        }
    }

    // max_completion_tokens alone, and over max_tokens.
    for (limits, n) in [
        (json!({"max_completion_tokens": 5}), 5),
        (json!({"max_tokens": 9, "max_completion_tokens": 4}), 4),
        (json!({"max_tokens": 7}), 7),
    ] {
        let mut body = chat_body(ask, 1);
        body.as_object_mut().unwrap().remove("max_tokens");
        body.as_object_mut()
            .unwrap()
            .extend(limits.as_object().unwrap().clone());
        let r = server.post("/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        assert_eq!(v["usage"]["completion_tokens"], n, "{limits}: {v}");
        assert_eq!(v["choices"][0]["finish_reason"], "length", "{limits}: {v}");
        assert_eq!(
            v["choices"][0]["message"]["content"],
            reference(prompt.clone(), n).as_str(),
            "{limits}"
        );
    }
}

#[test]
fn extra_fields_allowed_with_the_flag_and_body_limit() {
    let server = Server::start(&["--allow-extra-request-fields", "--max-body-bytes", "2000"]);
    let mut body = chat_body("hi", 2);
    body["frobnicate"] = json!(true);
    let r = server.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let r = server.post("/v1/chat/completions", &chat_body(&"x".repeat(3000), 2));
    assert_eq!(r.status, 413, "{}", r.body);
    assert!(r.error_message().contains("2000 bytes"));
}

#[test]
fn repeated_prompt_hits_the_prefix_cache() {
    let server = Server::start(&[]);
    let text = "The history of the printing press begins in the fifteenth century. ".repeat(12);
    let body = json!({"prompt": text, "temperature": 0, "max_tokens": 2});
    let first = server.post("/v1/completions", &body).json();
    let second = server.post("/v1/completions", &body).json();
    let prompt = first["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt > 64, "{first}");
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached > 0 && cached < prompt, "{second}");
    assert_eq!(first["choices"][0]["text"], second["choices"][0]["text"]);

    // A stop string that ends the request early still reports the hit.
    let generated = first["choices"][0]["text"].as_str().unwrap();
    let stop = generated.trim().chars().next().unwrap().to_string();
    let body = json!({"prompt": text, "temperature": 0, "max_tokens": 8, "stop": [stop]});
    let third = server.post("/v1/completions", &body).json();
    assert_eq!(third["choices"][0]["finish_reason"], "stop", "{third}");
    assert_eq!(
        third["usage"]["prompt_tokens_details"]["cached_tokens"], cached,
        "{third}"
    );
}

const COUNTING: &str = "Count from 1 to 1000: 1, 2, 3, 4, 5,";

/// Opens a streaming greedy completion of `COUNTING` and reads until `n`
/// events have arrived. A raw socket: the tests drop it to hang up and time
/// the server's reaction from that moment.
fn open_stream(port: u16, n: usize, max_tokens: usize) -> TcpStream {
    let body = json!({
        "prompt": COUNTING, "temperature": 0, "max_tokens": max_tokens, "stream": true,
    });
    let mut s = raw_request(port, "POST", "/v1/completions", &body.to_string());
    let mut seen = String::new();
    let mut buf = [0u8; 4096];
    while seen.matches("data: ").count() < n {
        let k = s.read(&mut buf).unwrap();
        assert!(k > 0, "stream ended early: {seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..k]));
    }
    assert!(seen.starts_with("HTTP/1.1 200"), "{seen}");
    s
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// How soon after a client disconnects its request must be gone: a few
/// steps and polls.
const CANCEL_BOUND: Duration = Duration::from_secs(1);

#[test]
fn client_disconnect_frees_blocks() {
    // Greedy counting up to a long context: the request cannot end by
    // itself anywhere near CANCEL_BOUND, only cancellation ends it.
    const CONTEXT: usize = 4096;
    let server = Server::start(&["--max-length", &CONTEXT.to_string()]);
    let max_tokens = CONTEXT - model().text.tokenizer.encode(COUNTING, true).unwrap().len();
    let decoded = || {
        sample(
            &server.get("/metrics").body,
            "tandem_batch_size_sum",
            &[r#"batch_type="TG""#],
        )
        .unwrap_or(0.0)
    };
    let s = open_stream(server.port, 3, max_tokens);
    let h = server.health();
    assert_eq!(h["running"], 1, "{h}");
    assert!(h["kv_blocks_in_use"].as_u64().unwrap() > 0, "{h}");
    // The decode rate (one step per token of a lone stream), to show the
    // request could not finish by itself within the bound.
    let (t0, g0) = (Instant::now(), decoded());
    wait_until("16 decode steps", || decoded() - g0 >= 16.0);
    let steps = decoded() - g0;
    let would_take = t0.elapsed().div_f64(steps) * (max_tokens - steps as usize) as u32;
    assert!(
        would_take >= 10 * CANCEL_BOUND,
        "finishing would take only {would_take:?}: the test could not tell cancellation from \
         completion"
    );
    let before_drop = decoded();
    let dropped = Instant::now();
    drop(s);
    loop {
        let h = server.health();
        let m = server.get("/metrics").body;
        let cancelled = sample(&m, "tandem_requests_total", &[r#"status="cancelled""#]);
        if h["kv_blocks_in_use"] == 0
            && h["running"] == 0
            && h["waiting"] == 0
            && h["requests_in_flight"] == 0
            && cancelled == Some(1.0)
        {
            break;
        }
        assert!(
            dropped.elapsed() <= CANCEL_BOUND,
            "{:?} after the disconnect: {h}, cancelled {cancelled:?}; finishing by itself would \
             take {would_take:?}",
            dropped.elapsed()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // Cancelled, not completed: decoding stopped far short of max_tokens.
    let after_drop = decoded() - before_drop;
    println!(
        "cancelled {:?} after the disconnect ({after_drop} steps after it; finishing would take \
         {would_take:?})",
        dropped.elapsed()
    );
    assert!(
        after_drop < max_tokens as f64 / 10.0,
        "{after_drop} decode steps after the disconnect, of {max_tokens}"
    );
    let m = server.get("/metrics").body;
    assert_eq!(
        sample(&m, "tandem_requests_total", &[r#"status="ok""#]).unwrap_or(0.0),
        0.0,
        "{m}"
    );
    // Events the scheduler sent after the client left are no longer buffered.
    assert_eq!(
        sample(&m, "tandem_num_responses_buffered", &[]),
        Some(0.0),
        "{m}"
    );
    // The server still works.
    let r = server.post("/v1/chat/completions", &chat_body("hi", 4));
    assert_eq!(r.status, 200, "{}", r.body);
}

#[test]
fn concurrency_limit_answers_503() {
    let server = Server::start(&["--max-concurrent-requests", "1"]);
    let s = open_stream(server.port, 2, 400);
    let r = server.post("/v1/chat/completions", &chat_body("hi", 2));
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(r.error_message().contains("--max-concurrent-requests"));
    drop(s);
    wait_until("the slot to free", || {
        server.health()["requests_in_flight"] == 0
    });
    let r = server.post("/v1/chat/completions", &chat_body("hi", 2));
    assert_eq!(r.status, 200, "{}", r.body);
}

#[test]
fn sigterm_lets_in_flight_requests_finish() {
    let mut server = Server::start(&[]);
    let port = server.port;
    let body = {
        let mut b = chat_body(QUESTION, 32);
        b["stream"] = json!(true);
        b.to_string()
    };
    let t = std::thread::spawn(move || http(port, "POST", "/v1/chat/completions", &body));
    wait_until("the request to start", || server.health()["running"] == 1);
    let pid = server.proc.pid().to_string();
    let killed = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(killed.success());
    let r = t.join().unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    // The request ran to its natural end, exactly as without the signal.
    let (text, finish, _) = read_chat_stream(&r.events());
    let want = reference_output(
        chat_prompt(&[ChatMessage::new("user", QUESTION)]),
        SamplingParams::greedy(),
        32,
    );
    assert_eq!(text, want.text);
    assert_eq!(finish.as_deref(), Some(finish_str(want.finish)));
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(status) = server.proc.try_wait() {
            assert!(status.success(), "{status:?}: {}", server.proc.stderr());
            break;
        }
        assert!(
            Instant::now() < deadline,
            "server did not exit after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(TcpStream::connect(("127.0.0.1", port)).is_err());
}

/// The value of the first sample of `name` whose labels include every one of
/// `labels` (`key="value"`), in Prometheus text format.
fn sample(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (series, value) = l.rsplit_once(' ')?;
        let (n, rest) = series.split_once('{').unwrap_or((series, ""));
        (n == name && labels.iter().all(|lb| rest.contains(lb))).then(|| value.parse().ok())?
    })
}

#[test]
fn metrics_endpoint_reports_engine_and_request_metrics() {
    let server = Server::start(&[]);
    let chat = server.post("/v1/chat/completions", &chat_body("Say hello.", 6));
    assert_eq!(chat.status, 200, "{}", chat.body);
    let body = json!({
        "prompt": "The capital of France is", "temperature": 0, "max_tokens": 6,
        "stream": true, "stream_options": {"include_usage": true},
    });
    let streamed = server.post("/v1/completions", &body);
    assert_eq!(streamed.status, 200, "{}", streamed.body);
    let usage: Value = streamed
        .events()
        .iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str::<Value>(e).unwrap())
        .find(|v| !v["usage"].is_null())
        .map(|v| v["usage"].clone())
        .unwrap_or_else(|| panic!("no usage chunk: {}", streamed.body));
    let generated = chat.json()["usage"]["completion_tokens"].as_u64().unwrap()
        + usage["completion_tokens"].as_u64().unwrap();

    let metrics = || {
        let r = server.get("/metrics");
        assert_eq!(r.status, 200, "{}", r.body);
        assert!(
            r.header("content-type").starts_with("text/plain"),
            "{:?}",
            r.headers
        );
        r.body
    };
    // The scheduler publishes its gauges just after the last event.
    wait_until("KV blocks to be released", || {
        sample(&metrics(), "tandem_kv_blocks_used", &[]) == Some(0.0)
    });
    let m = metrics();
    let get = |name: &str, labels: &[&str]| {
        sample(&m, name, labels).unwrap_or_else(|| panic!("no {name}{labels:?} in:\n{m}"))
    };
    assert!(get("tandem_batch_size_count", &[r#"batch_type="CE""#]) >= 2.0);
    assert!(get("tandem_batch_size_count", &[r#"batch_type="TG""#]) >= 1.0);
    assert!(get("tandem_batch_input_tokens_sum", &[r#"batch_type="CE""#]) >= 10.0);
    assert!(get("tandem_time_to_first_token_milliseconds_count", &[]) >= 2.0);
    assert!(get("tandem_time_to_first_token_milliseconds_sum", &[]) > 0.0);
    assert!(get("tandem_inter_token_latency_milliseconds_count", &[]) >= 1.0);
    assert!(get("tandem_time_per_output_token_milliseconds_count", &[]) >= 1.0);
    assert_eq!(get("tandem_request_latency_milliseconds_count", &[]), 2.0);
    assert!(get("tandem_output_tokens_total", &[]) >= generated as f64);
    assert!(get("tandem_input_tokens_total", &[]) >= 10.0);
    assert_eq!(get("tandem_requests_total", &[r#"status="ok""#]), 2.0);
    assert_eq!(get("tandem_kv_blocks_used", &[]), 0.0);
    assert_eq!(get("tandem_kv_blocks_free", &[]), 1024.0);
    assert_eq!(get("tandem_num_requests_running", &[]), 0.0);
    assert_eq!(get("tandem_num_requests_queued", &[]), 0.0);
    assert_eq!(get("tandem_num_responses_buffered", &[]), 0.0);
    assert!(get("tandem_response_queue_time_milliseconds_count", &[]) >= generated as f64);
    assert_eq!(
        get(
            "tandem_model_load_time_milliseconds_count",
            &[r#"phase="total""#]
        ),
        1.0
    );
    assert!(
        get(
            "tandem_model_load_time_milliseconds_sum",
            &[r#"phase="total""#]
        ) > 0.0
    );
    assert_eq!(get("tandem_preemptions_total", &[]), 0.0);
    assert!(!m.contains("otel_scope_name"), "{m}");

    // A repeated long prompt is served from the prefix cache.
    let hits = |m: &str| sample(m, "tandem_prefix_cache_hits_total", &[]).unwrap_or(0.0);
    let before = hits(&m);
    let text = "The history of the printing press begins in the fifteenth century. ".repeat(12);
    let body = json!({"prompt": text, "temperature": 0, "max_tokens": 2});
    for _ in 0..2 {
        let r = server.post("/v1/completions", &body);
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let m = metrics();
    assert!(hits(&m) >= before + 64.0, "{m}");
    assert!(sample(&m, "tandem_prefix_cache_misses_total", &[]).unwrap() > 64.0);

    // A refused request counts as a client error.
    let r = server.post("/v1/completions", &json!({"prompt": "x", "max_tokens": 0}));
    assert_eq!(r.status, 400, "{}", r.body);
    let m = metrics();
    assert_eq!(
        sample(&m, "tandem_requests_total", &[r#"status="client_error""#]),
        Some(1.0),
        "{m}"
    );
}

#[test]
fn device_flags_that_cannot_run_are_refused_at_startup() {
    for (args, want) in [
        // Tensor-parallel GPU ranks: SmolLM2's 9 heads do not split 2 ways,
        // whether the ranks have a GPU each or share one; refused by the
        // shard plan the CPU's ranks follow too, in its words.
        (
            &["--devices", "gpu:0,1"][..],
            "2 does not divide the attention heads (9)",
        ),
        (
            &["--devices", "gpu:0", "--tp", "2"][..],
            "2 does not divide the attention heads (9)",
        ),
        (
            &["--devices", "gpu:0,1", "--tp", "3"][..],
            "gives 2 ranks but --tp is 3",
        ),
        (&["--devices", "gpu:0,0"][..], "device 0 listed twice"),
        (&["--devices", "gpu:7"][..], "no GPU for gpu:7"),
        (
            &["--devices", "cpu:3", "--tp", "2"][..],
            "gives 3 ranks but --tp is 2",
        ),
        (&["--devices", "tpu:1"][..], "invalid devices"),
        // SmolLM2's 9 query heads do not split in two.
        (
            &["--devices", "cpu:2"][..],
            "does not divide the attention heads",
        ),
    ] {
        let out = Command::new(tandem_tests::binary())
            .args(["serve", "--model"])
            .arg(gguf_path())
            .args(["--port", "0"])
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} started");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

#[test]
fn generate_on_a_gpu_names_the_adapter_and_follows_the_cpu() {
    // On machines without a GPU, gpu:0 is Mesa's lavapipe (scripts/test.sh
    // installs it). This prompt's greedy tokens are the GPU's own choices
    // at every step (gpu/tests/llama.rs), so the texts are equal.
    let text = "def fibonacci(n):";
    let run = |devices: &str, no_driver: bool| {
        let mut cmd = Command::new(tandem_tests::binary());
        cmd.args(["generate", "--model"])
            .arg(gguf_path())
            .args(["--prompt", text, "--max-tokens", "8", "--temperature", "0"])
            .args(["--devices", devices]);
        if no_driver {
            cmd.env("VK_ICD_FILENAMES", "/nonexistent/icd.json")
                .env("VK_DRIVER_FILES", "/nonexistent/icd.json");
        }
        cmd.output().unwrap()
    };
    let cpu = run("cpu", false);
    assert!(
        cpu.status.success(),
        "{}",
        String::from_utf8_lossy(&cpu.stderr)
    );
    let gpu = run("gpu:0", false);
    let err = String::from_utf8_lossy(&gpu.stderr);
    assert!(gpu.status.success(), "{err}");
    assert!(err.contains("on gpu:0,") && err.contains("Vulkan"), "{err}");
    assert_eq!(
        String::from_utf8_lossy(&gpu.stdout),
        String::from_utf8_lossy(&cpu.stdout)
    );
    // No GPU and no Vulkan driver: a startup error naming both.
    let none = run("gpu:0", true);
    let err = String::from_utf8_lossy(&none.stderr);
    assert!(!none.status.success(), "ran without a device: {err}");
    for part in ["no GPU for gpu:0", "CUDA", "Vulkan"] {
        assert!(err.contains(part), "{part}: {err}");
    }
    // One sequence runs on one device.
    let two = run("gpu:0,1", false);
    assert!(!two.status.success());
    assert!(String::from_utf8_lossy(&two.stderr).contains("generate runs on one GPU"));
}

#[test]
fn serve_on_a_gpu_agrees_with_the_cpu_up_to_near_ties() {
    // gpu:0 is Mesa's lavapipe on machines without a GPU; the scheduler
    // drives it as it drives the CPU engine.
    let server = Server::start(&["--devices", "gpu:0", "--max-length", "128"]);
    let health = server.health();
    let device = health["device"].as_str().unwrap();
    assert!(
        device.starts_with("gpu:0 (") && device.contains("Vulkan"),
        "{health}"
    );
    let name = server.get("/v1/models").json()["data"][0]["id"].clone();
    // Lavapipe takes about a second a token; gpu/tests/llama.rs compares
    // longer runs below the scheduler.
    let n = 8;
    for text in ["The capital of France is", "def fibonacci(n):"] {
        let body = json!({"model": name, "prompt": text, "max_tokens": n, "temperature": 0,
                          "logprobs": 5});
        let r = server.post("/v1/completions", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        assert_greedy_up_to_near_ties(text, n, &r.json());
    }
    // A seeded top-k draw, sampled from the candidates the device picked
    // out of each row: the same seed, the same text.
    let body = json!({"model": name, "prompt": "The capital of France is", "max_tokens": 2,
                      "temperature": 0.8, "top_k": 10, "seed": 5, "logprobs": 2});
    let drawn: Vec<Value> = (0..2)
        .map(|_| {
            let r = server.post("/v1/completions", &body);
            assert_eq!(r.status, 200, "{}", r.body);
            r.json()
        })
        .collect();
    assert_eq!(drawn[0]["usage"]["completion_tokens"], 2, "{}", drawn[0]);
    assert_eq!(drawn[0]["choices"][0], drawn[1]["choices"][0]);
    let lps = &drawn[0]["choices"][0]["logprobs"]["token_logprobs"];
    assert!(
        lps.as_array()
            .unwrap()
            .iter()
            .all(|lp| lp.as_f64().unwrap() <= 0.0),
        "{lps}"
    );

    // Requests run as one batch and all finish; a prompt of whole blocks
    // run again is served from the prefix cache (KV computed on the
    // device, found by the scheduler's block hashes), with the same text.
    let port = server.port;
    // 19 tokens: one whole block to find again, few for lavapipe to run.
    let prompt = "Once upon a time, in a small village at the edge of a great forest, there \
                  lived";
    let body = json!({"model": name, "prompt": prompt, "max_tokens": 2, "temperature": 0});
    let runs: Vec<_> = (0..3)
        .map(|_| {
            let body = body.to_string();
            std::thread::spawn(move || http(port, "POST", "/v1/completions", &body))
        })
        .collect();
    let outs: Vec<Value> = runs
        .into_iter()
        .map(|r| {
            let r = r.join().unwrap();
            assert_eq!(r.status, 200, "{}", r.body);
            r.json()
        })
        .collect();
    for v in &outs {
        assert_eq!(v["usage"]["completion_tokens"], 2, "{v}");
        assert_eq!(v["choices"][0]["text"], outs[0]["choices"][0]["text"]);
    }
    let again = server.post("/v1/completions", &body).json();
    let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached >= 16, "{again}");
    assert_eq!(again["choices"][0]["text"], outs[0]["choices"][0]["text"]);
    let m = server.get("/metrics").body;
    assert!(
        metric(&m, "tandem_prefix_cache_hits_total", "") >= 16.0,
        "{m}"
    );

    // Structured output: the scheduler's grammar masks the device's logits.
    let body = json!({"model": name, "prompt": "A JSON object:", "max_tokens": 3,
                      "temperature": 0, "response_format": {"type": "json_object"}});
    let r = server.post("/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let text = r.json()["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(text.starts_with('{'), "{text:?}");
    // The last response may reach the client just before the scheduler
    // retires its sequence.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let health = server.health();
        if health["waiting"] == 0 && health["running"] == 0 && health["kv_blocks_in_use"] == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "never went idle: {health}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn cpu_isa_flag_picks_the_kernels_and_keeps_greedy_output() {
    let text = "The capital of France is";
    let want = reference(model().text.tokenizer.encode(text, true).unwrap(), 12);
    let run = |isa: &str| {
        Command::new(tandem_tests::binary())
            .args(["generate", "--model"])
            .arg(gguf_path())
            .args(["--prompt", text, "--max-tokens", "12", "--temperature", "0"])
            .args(["--cpu-isa", isa])
            .output()
            .unwrap()
    };
    for isa in tandem_kernels::Isa::ALL {
        let out = run(isa.name());
        let err = String::from_utf8_lossy(&out.stderr);
        if !isa.is_supported_by_cpu() {
            assert!(!out.status.success(), "{isa} ran: {err}");
            assert!(err.contains("this CPU supports at most"), "{isa}: {err}");
            continue;
        }
        assert!(out.status.success(), "{isa}: {err}");
        assert!(err.contains(&format!("kernels: {isa},")), "{isa}: {err}");
        // Each instruction set's kernels are tested against the scalar
        // reference; end to end, greedy decoding must not notice the switch.
        let got = String::from_utf8_lossy(&out.stdout);
        assert_eq!(got.strip_suffix('\n'), Some(want.as_str()), "{isa}");
    }
    let out = run("sse2");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown instruction set"));
}

/// `--api-key-file`: requests need a listed key (401 otherwise, before any
/// work); SIGHUP re-reads the file, so a rotated key takes over without a
/// restart; a file that became unusable keeps the keys in use.
#[test]
fn api_keys_rotate_on_sighup() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("keys");
    std::fs::write(&file, "# ops\nsk-first\n").unwrap();
    let mut server = Server::start(&["--api-key-file", file.to_str().unwrap()]);
    let body = chat_body("hi", 1).to_string();
    let status = |key: Option<&str>| {
        let auth = key.map(|k| format!("Bearer {k}"));
        let headers: Vec<(&str, &str)> = auth
            .as_deref()
            .map(|a| vec![("authorization", a)])
            .unwrap_or_default();
        http_with(server.port, "POST", "/v1/chat/completions", &body, &headers).status
    };
    // What the server has generated: requests answered, tokens in and
    // out, scheduler steps. A refused key must move none of it.
    let generated = || {
        let m = server.get("/metrics").body;
        [
            metric(&m, "tandem_requests_total", r#"status="ok""#),
            metric(&m, "tandem_input_tokens_total", ""),
            metric(&m, "tandem_output_tokens_total", ""),
            metric(&m, "tandem_batch_size_count", ""),
        ]
    };
    let refused = |keys: &[Option<&str>]| {
        let before = generated();
        for &key in keys {
            assert_eq!(status(key), 401, "{key:?}");
        }
        assert_eq!(generated(), before, "a refused request was generated");
    };
    refused(&[None, Some("sk-second")]);
    let before = generated();
    assert_eq!(status(Some("sk-first")), 200);
    let after = generated();
    assert!(
        before.iter().zip(&after).all(|(b, a)| a > b),
        "an answered request moved every count: {before:?} -> {after:?}"
    );
    assert_eq!(server.get("/health").status, 200, "probes stay open");

    let hup = || {
        let ok = Command::new("kill")
            .args(["-HUP", &server.proc.pid().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok);
    };
    // Waits until the server answers `want` for `key`.
    let settle = |key: &str, want: u16| {
        let deadline = Instant::now() + Duration::from_secs(10);
        while status(Some(key)) != want {
            assert!(Instant::now() < deadline, "{key} never got {want}");
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    std::fs::write(&file, "sk-second\n").unwrap();
    hup();
    settle("sk-second", 200);
    refused(&[Some("sk-first")]);
    // A key with a space is refused: the old set stays, once the server
    // has read the file and said so.
    std::fs::write(&file, "sk third\n").unwrap();
    hup();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !server.proc.stderr().contains("keeping the API keys in use") {
        assert!(
            Instant::now() < deadline,
            "no refusal of the bad key file logged: {}",
            server.proc.stderr()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(status(Some("sk-second")), 200);
    refused(&[Some("sk-first"), None]);
    assert!(server.proc.is_running(), "SIGHUP must not stop the server");
}

/// A client that connects and sends nothing is disconnected after
/// `--header-timeout-secs` (stalled connections cannot pile up), and the
/// server keeps answering others meanwhile.
#[test]
fn silent_connections_are_closed_after_the_header_timeout() {
    let server = Server::start(&["--header-timeout-secs", "0.5"]);
    let started = Instant::now();
    let mut silent: Vec<TcpStream> = (0..20)
        .map(|_| TcpStream::connect(("127.0.0.1", server.port)).unwrap())
        .collect();
    assert_eq!(server.get("/health").status, 200);
    for c in &mut silent {
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut buf = Vec::new();
        let n = c.read_to_end(&mut buf).unwrap();
        assert_eq!(n, 0, "closed without an answer");
    }
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(400) && waited < Duration::from_secs(5),
        "{waited:?}"
    );
}

/// Issue 36, item 4: bodies trickled from one address lock no one out.
/// 64 connections from 127.0.0.1 declare 4 MiB bodies (together the whole
/// default `--max-buffered-body-bytes`, 256 MiB) and send a byte every
/// 250 ms, which no inactivity timeout would ever catch. The body timeout
/// (4 s here, 30 s by default) bounds a body's whole time, so every one of
/// them is answered and closed by then; one address holds at most its
/// share of the budget (an eighth by default: 8 such bodies), the rest are
/// refused at once with 429 and `Retry-After`; and a client on another
/// address (127.0.0.2) is served throughout.
#[test]
fn trickled_bodies_are_cut_off_and_lock_no_one_out() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const TIMEOUT: Duration = Duration::from_secs(4);
    const SLACK: Duration = Duration::from_millis(1500);
    const TRICKLERS: usize = 64;
    let server = Server::start(&["--body-timeout-secs", "4"]);
    let port = server.port;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // A connection that declares 4 MiB and trickles until the server
    // answers and closes it (or TIMEOUT + 10 s pass): how long that took
    // from the end of its request head, and what the server said.
    let trickle = |heads: std::sync::Arc<tokio::sync::Barrier>| async move {
        let mut c = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{{\"prompt\": \"",
            4 << 20
        );
        c.write_all(head.as_bytes()).await.unwrap();
        let sent = tokio::time::Instant::now();
        heads.wait().await;
        let mut answer = Vec::new();
        let mut buf = [0u8; 4096];
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        while sent.elapsed() < TIMEOUT + Duration::from_secs(10) {
            tokio::select! {
                r = c.read(&mut buf) => match r {
                    Ok(0) | Err(_) => break,
                    Ok(n) => answer.extend_from_slice(&buf[..n]),
                },
                _ = tick.tick() => {
                    // A write after the server closed may fail: the read
                    // then sees the end.
                    let _ = c.write_all(b"a").await;
                }
            }
        }
        (
            sent.elapsed(),
            String::from_utf8_lossy(&answer).into_owned(),
        )
    };
    // One small request from another address.
    let other = || async move {
        let s = tokio::net::TcpSocket::new_v4().unwrap();
        s.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        let mut c = s.connect(([127, 0, 0, 1], port).into()).await.unwrap();
        let body = json!({"prompt": "Hello", "max_tokens": 1}).to_string();
        let req = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        c.write_all(req.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        tokio::time::timeout(Duration::from_secs(60), c.read_to_end(&mut answer))
            .await
            .expect("the other client is answered")
            .unwrap();
        String::from_utf8_lossy(&answer).into_owned()
    };
    rt.block_on(async {
        let heads = std::sync::Arc::new(tokio::sync::Barrier::new(TRICKLERS + 1));
        let tricklers: Vec<_> = (0..TRICKLERS)
            .map(|_| tokio::spawn(trickle(std::sync::Arc::clone(&heads))))
            .collect();
        heads.wait().await;
        let mut served = 0;
        while !tricklers.iter().all(|t| t.is_finished()) {
            let answer = other().await;
            assert!(
                answer.starts_with("HTTP/1.1 200"),
                "a client on another address was refused while bodies trickled in \
                 ({served} served before):\n{answer}"
            );
            served += 1;
        }
        assert!(
            served >= 3,
            "only {served} requests while the bodies trickled"
        );
        let mut admitted = 0;
        let mut latest = Duration::ZERO;
        for t in tricklers {
            let (took, answer) = t.await.unwrap();
            latest = latest.max(took);
            assert!(
                took <= TIMEOUT + SLACK,
                "a trickled body held its connection for {took:?} (deadline {TIMEOUT:?}):\n{answer}"
            );
            let status = answer.lines().next().unwrap_or("");
            if status.starts_with("HTTP/1.1 408") {
                // Cut off at the body timeout, not before it.
                assert!(took + SLACK >= TIMEOUT, "{took:?}: {answer}");
                assert!(answer.contains("request_timeout"), "{answer}");
                admitted += 1;
            } else {
                assert!(status.starts_with("HTTP/1.1 429"), "{answer}");
                assert!(
                    answer.to_ascii_lowercase().contains("retry-after: "),
                    "{answer}"
                );
            }
        }
        // 4 MiB bodies, an eighth of 256 MiB each address.
        assert!((1..=8).contains(&admitted), "{admitted} bodies admitted");
        println!(
            "{admitted} trickled bodies admitted and cut off, the last closed {latest:?} after \
             its head (deadline {TIMEOUT:?}); {served} other requests served meanwhile"
        );
    });
    // The budget is whole again: the trickling address is served too.
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": "Hello", "max_tokens": 1}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
}
