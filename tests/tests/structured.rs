//! Structured output (`response_format`) and forced tool calls end to end: `tandem serve` and a
//! 1P1D cluster produce text that an independent JSON-schema validator
//! accepts, at temperature 1 over many seeds; invalid constraints are 400s
//! naming `response_format`; unconstrained requests in the same batch stay
//! equal to the engine's greedy reference.

use std::thread;
use std::time::Duration;

use serde_json::{Value, json};
use tandem_discovery::testing::EtcdServer;
use tandem_modelfile::chat::ChatMessage;
use tandem_tests::cluster::{Node, Router, expected, short_prompt, unique_cluster};
use tandem_tests::{http, model, reference, start_serve};

fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
            "kind": {"enum": ["cat", "dog", "bird"]}
        },
        "required": ["name", "age", "tags", "kind"],
        "additionalProperties": false
    })
}

/// `long` prompts go to the prefill node in a cluster (past its
/// `--remote-prefill-min-tokens`), which samples the first token under the
/// constraint.
fn body(seed: u64, long: bool) -> Value {
    let content = if long {
        // Unique per seed, so no prompt is all in the decode node's cache.
        format!(
            "Record {seed}. You keep records of the animals at a small rescue shelter. Each record names the \
         animal, gives its age in years, a few short tags about its temperament, and its \
         kind. Describe one pet as JSON."
        )
    } else {
        "Describe a pet as JSON.".to_string()
    };
    json!({
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 160,
        "temperature": 1.0,
        "seed": seed,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "pet", "strict": true, "schema": schema()}
        }
    })
}

/// Runs `n` constrained generations, 16 at a time; returns how many were
/// invalid (with the first few for the message).
fn invalid_outputs(port: u16, n: u64, long: bool) -> (usize, Vec<String>) {
    let validator = jsonschema::validator_for(&schema()).expect("the test schema compiles");
    let mut bad = Vec::new();
    let mut count = 0;
    for batch in (0..n).collect::<Vec<_>>().chunks(16) {
        let handles: Vec<_> = batch
            .iter()
            .map(|&seed| {
                thread::spawn(move || {
                    let r = http(
                        port,
                        "POST",
                        "/v1/chat/completions",
                        &body(seed, long).to_string(),
                    );
                    (seed, r.status, r.json())
                })
            })
            .collect();
        for h in handles {
            let (seed, status, v) = h.join().expect("request thread");
            let choice = &v["choices"][0];
            let text = choice["message"]["content"].as_str().unwrap_or_default();
            let valid = status == 200
                && choice["finish_reason"] == "stop"
                && serde_json::from_str::<Value>(text).is_ok_and(|j| validator.is_valid(&j));
            if !valid {
                count += 1;
                if bad.len() < 3 {
                    bad.push(format!("seed {seed}: {status} {v}"));
                }
            }
        }
    }
    (count, bad)
}

#[test]
fn serve_output_matches_the_schema_at_temperature_one() {
    let (_proc, port) = start_serve(&["--max-length", "512", "--max-batch-size", "32"]);
    let (n, bad) = invalid_outputs(port, 200, false);
    assert_eq!(n, 0, "{n} of 200 outputs invalid, e.g. {bad:?}");

    // The other constraint kinds.
    let ask_with = |content: &str, rf: Value, seed: u64, max_tokens: usize| {
        let b = json!({
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 1.0, "seed": seed,
            "response_format": rf,
        });
        http(port, "POST", "/v1/chat/completions", &b.to_string())
    };
    let ask = |rf: Value| ask_with("Answer.", rf, 3, 40);
    json_objects_or_their_prefixes(&|seed| {
        ask_with(
            "Describe a pet as a small JSON object.",
            json!({"type": "json_object"}),
            seed,
            80,
        )
    });
    // Exactly the pattern, letter case included, however the prompt pulls.
    let answers = concurrently(12, |seed| {
        ask_with(
            "Reply with a code such as 123-AB, in CAPITAL LETTERS.",
            json!({"type": "regex", "regex": "[0-9]{3}-[a-z]{2}"}),
            seed,
            40,
        )
    });
    for (seed, r) in answers.iter().enumerate() {
        assert_eq!(r.status, 200, "{}", r.body);
        let text = content(&r.json());
        let b = text.as_bytes();
        let exact = b.len() == 6
            && b[..3].iter().all(u8::is_ascii_digit)
            && b[3] == b'-'
            && b[4..].iter().all(u8::is_ascii_lowercase);
        assert!(exact, "seed {seed}: {text:?} is not [0-9]{{3}}-[a-z]{{2}}");
    }
    let r = ask(json!({"type": "grammar", "grammar": "start: \"yes\" | \"no\""}));
    let text = r.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(text == "yes" || text == "no", "{text}");

    // `ignore_eos` (sent by benchmark clients): the model's stop token no
    // longer ends a greedy answer that ends early without it.
    let eos = |ignore: bool| {
        let b = json!({
            "messages": [{"role": "user", "content": "What is 2+2? Answer with one number."}],
            "max_tokens": 40, "temperature": 0, "ignore_eos": ignore,
        });
        let v = http(port, "POST", "/v1/chat/completions", &b.to_string()).json();
        (
            v["choices"][0]["finish_reason"].clone(),
            v["usage"]["completion_tokens"].clone(),
        )
    };
    let (finish, n) = eos(false);
    assert!(
        finish == "stop" && n.as_u64().is_some_and(|n| n < 40),
        "{finish} {n}"
    );
    assert_eq!(eos(true), (json!("length"), json!(40)));

    // Invalid constraints are the client's error, named.
    for rf in [
        json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
        json!({"type": "regex", "regex": "("}),
        json!({"type": "grammar", "grammar": "start: undefined_rule"}),
        json!({"type": "json_schema", "json_schema": {"name": "x"}}),
        json!({"type": "xml"}),
    ] {
        let r = ask(rf.clone());
        assert_eq!(r.status, 400, "{rf}: {}", r.body);
        assert_eq!(
            r.json()["error"]["param"],
            "response_format",
            "{rf}: {}",
            r.body
        );
    }

    // Unconstrained greedy requests alongside constrained ones still equal
    // the engine's reference (batch invariance).
    let want = expected(short_prompt(), 16);
    let plain = thread::spawn(move || {
        (0..4)
            .map(|_| {
                let b = json!({"prompt": short_prompt(), "max_tokens": 16, "temperature": 0});
                http(port, "POST", "/v1/completions", &b.to_string()).json()["choices"][0]["text"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string()
            })
            .collect::<Vec<_>>()
    });
    let (n, bad) = invalid_outputs(port, 16, false);
    assert_eq!(n, 0, "{bad:?}");
    for got in plain.join().expect("plain requests") {
        assert_eq!(got, want);
    }
}

/// The message content of a chat completion ("" if none).
fn content(v: &Value) -> String {
    v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// Whether `text` is a JSON object, or the start of one (what a generation
/// cut by `max_tokens` leaves).
fn json_object_or_prefix(text: &str) -> bool {
    if !text.trim_start().starts_with('{') {
        return false;
    }
    let eof = |t: &str| match serde_json::from_str::<Value>(t) {
        Ok(v) => v.is_object(),
        Err(e) => e.is_eof(),
    };
    // A cut right after `-`, `.` or an exponent's `e` is a number's start:
    // serde_json calls that invalid rather than unfinished.
    eof(text) || eof(&format!("{text}0"))
}

/// `f(0..n)`, each on a thread of its own (the server batches them).
fn concurrently<T: Send>(n: u64, f: impl Fn(u64) -> T + Sync) -> Vec<T> {
    thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = (0..n).map(|i| s.spawn(move || f(i))).collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("request thread"))
            .collect()
    })
}

/// `json_object` answers over several seeds: each one an object when it
/// stopped by itself, the start of one when `max_tokens` cut it; at least
/// one must have stopped by itself.
fn json_objects_or_their_prefixes(ask: &(dyn Fn(u64) -> tandem_tests::Resp + Sync)) {
    let mut whole = 0;
    for (seed, r) in concurrently(8, ask).into_iter().enumerate() {
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        let text = content(&v);
        match v["choices"][0]["finish_reason"].as_str() {
            Some("stop") => {
                let parsed = serde_json::from_str::<Value>(&text);
                assert!(
                    parsed.is_ok_and(|j| j.is_object()),
                    "seed {seed}: not a JSON object: {text:?}"
                );
                whole += 1;
            }
            Some("length") => assert!(
                json_object_or_prefix(&text),
                "seed {seed}: cut short, and not the start of a JSON object: {text:?}"
            ),
            other => panic!("seed {seed}: finish_reason {other:?}: {v}"),
        }
    }
    assert!(whole > 0, "no json_object answer ended by itself");
}

#[test]
fn json_prefixes() {
    for ok in [
        "{}",
        " {\"a\": [1, 2.5e-3, {\"b\": null}]}",
        "{",
        "{\"a\": -",
        "{\"a\": 1.",
        "{\"a\": 1e",
        "{\"a\": tr",
        "{\"a\": \"x\\u00",
        "{\"a\"",
    ] {
        assert!(json_object_or_prefix(ok), "{ok:?}");
    }
    for bad in [
        "",
        "[1]",
        "\"x\"",
        "{} x",
        "{\"a\" 1",
        "{a",
        "{\"a\": 1,}",
        "{\"a\": tx",
    ] {
        assert!(!json_object_or_prefix(bad), "{bad:?}");
    }
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {"type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20},
                               "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"], "additionalProperties": false}}},
        {"type": "function", "function": {
            "name": "add",
            "parameters": {"type": "object",
                "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                               "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
                "required": ["a", "b"], "additionalProperties": false}}}
    ])
}

/// The arguments schema of tool `name`.
fn params_of(name: &str) -> Value {
    tools()
        .as_array()
        .into_iter()
        .flatten()
        .find(|t| t["function"]["name"] == name)
        .map(|t| t["function"]["parameters"].clone())
        .unwrap_or(Value::Null)
}

/// Forced calls (`required`, a named function) always parse and match the
/// tool's schema, streamed in OpenAI's delta shape; history with calls and
/// results renders; bad choices are 400s.
#[test]
fn forced_tool_calls_parse_and_match_their_schema() {
    let (_proc, port) = start_serve(&["--max-length", "512", "--max-batch-size", "32"]);
    let ask = |choice: Value, seed: u64, stream: bool| {
        let b = json!({
            "messages": [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}],
            "tools": tools(), "tool_choice": choice, "parallel_tool_calls": false,
            "max_tokens": 120, "temperature": 1.0, "seed": seed, "stream": stream,
        });
        http(port, "POST", "/v1/chat/completions", &b.to_string())
    };
    let named = json!({"type": "function", "function": {"name": "add"}});
    for seed in 0..24 {
        let (choice, want) = if seed % 2 == 0 {
            (json!("required"), None)
        } else {
            (named.clone(), Some("add"))
        };
        let r = ask(choice, seed, false);
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        let choice = &v["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
        let calls = choice["message"]["tool_calls"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        assert_eq!(calls.len(), 1, "{v}");
        let name = calls[0]["function"]["name"].as_str().unwrap_or_default();
        if let Some(w) = want {
            assert_eq!(name, w, "{v}");
        }
        assert_eq!(calls[0]["type"], "function");
        assert!(
            calls[0]["id"]
                .as_str()
                .is_some_and(|id| id.starts_with("call_"))
        );
        let args: Value =
            serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap_or(""))
                .unwrap_or_else(|e| panic!("arguments are not JSON ({e}): {v}"));
        let validator = jsonschema::validator_for(&params_of(name)).expect("schema");
        assert!(
            validator.is_valid(&args),
            "{name} {args} does not match: {v}"
        );
    }

    // Streaming: id, type and name once, then argument fragments.
    let r = ask(json!("required"), 5, true);
    let (mut name, mut args, mut finish, mut heads) = (String::new(), String::new(), None, 0);
    for e in r.events().iter().filter(|e| e.as_str() != "[DONE]") {
        let c: Value = serde_json::from_str(e).expect("chunk JSON");
        let ch = &c["choices"][0];
        if let Some(f) = ch["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
        for d in ch["delta"]["tool_calls"].as_array().into_iter().flatten() {
            assert_eq!(d["index"], 0);
            if let Some(id) = d["id"].as_str() {
                heads += 1;
                assert!(id.starts_with("call_"));
                assert_eq!(d["type"], "function");
                name.push_str(d["function"]["name"].as_str().unwrap_or_default());
            }
            args.push_str(d["function"]["arguments"].as_str().unwrap_or_default());
        }
    }
    assert_eq!(
        (heads, finish.as_deref()),
        (1, Some("tool_calls")),
        "{}",
        r.body
    );
    let args: Value = serde_json::from_str(&args).expect("streamed arguments are JSON");
    assert!(
        jsonschema::validator_for(&params_of(&name))
            .expect("schema")
            .is_valid(&args)
    );

    // A conversation with a call and its result renders and answers: the
    // greedy answer is the engine's to the documented rendering (for a
    // template that does not render tools): the call written as the
    // parser writes calls, the result as a `<tool_response>` user turn.
    let b = json!({
        "messages": [
            {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 3}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "5"}
        ],
        "tools": tools(), "tool_choice": "none", "max_tokens": 8, "temperature": 0,
    });
    let r = http(port, "POST", "/v1/chat/completions", &b.to_string());
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["choices"][0]["message"]["role"], "assistant", "{v}");
    assert!(v["choices"][0]["message"]["tool_calls"].is_null(), "{v}");
    let m = model();
    let history = [
        ChatMessage::new("user", "What is 2 + 3?"),
        ChatMessage::new(
            "assistant",
            "<tool_call>\n{\"name\":\"add\",\"arguments\":{\"a\":2,\"b\":3}}\n</tool_call>",
        ),
        ChatMessage::new("user", "<tool_response>\n5\n</tool_response>"),
    ];
    let rendered = m
        .text
        .chat_template
        .as_ref()
        .expect("a chat template")
        .render(&history, true)
        .expect("the history renders");
    let ids = m
        .text
        .tokenizer
        .encode(&rendered, false)
        .expect("tokenizes");
    let want = reference(ids, 8);
    assert_eq!(content(&v), want, "{v}");

    for (choice, param) in [
        (
            json!({"type": "function", "function": {"name": "nope"}}),
            "tool_choice",
        ),
        (json!("always"), "tool_choice"),
    ] {
        let r = ask(choice, 0, false);
        assert_eq!(r.status, 400, "{}", r.body);
        assert_eq!(r.json()["error"]["param"], param, "{}", r.body);
    }
}

#[test]
fn cluster_output_matches_the_schema() {
    let etcd = EtcdServer::start().expect("etcd");
    let cluster = unique_cluster("structured");
    let _p = Node::start(&etcd.url(), &cluster, "prefill", "p0", &[]);
    let d = Node::start(&etcd.url(), &cluster, "decode", "d0", &[]);
    let r = Router::start(&etcd.url(), &cluster);
    r.wait_members(1, 1, Duration::from_secs(20));
    let (n, bad) = invalid_outputs(r.port, 48, true);
    assert_eq!(n, 0, "{n} of 48 outputs invalid, e.g. {bad:?}");
    let (n, bad) = invalid_outputs(r.port, 16, false);
    assert_eq!(n, 0, "{n} of 16 short-prompt outputs invalid, e.g. {bad:?}");
    // The long prompts were prefilled remotely: the prefill node sampled
    // their first token under the constraint.
    let remote = d.remote_prefills();
    assert!(remote >= 48.0, "only {remote} remote prefills");
    let bad_rf = json!({
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
        "response_format": {"type": "regex", "regex": "("}
    });
    let resp = http(r.port, "POST", "/v1/chat/completions", &bad_rf.to_string());
    assert_eq!(resp.status, 400, "{}", resp.body);
}
