//! `tandem bench`'s tests: flags, prompts, SSE parsing and timing against
//! a fake server, statistics, and the multi-turn session scheduler.

use std::sync::atomic::{AtomicUsize, Ordering};

use futures_util::StreamExt;
use reqwest::StatusCode;
use reqwest::header::{ACCEPT, CONNECTION, CONTENT_TYPE, HeaderMap};
use serde_json::Value;

use super::args::*;
use super::client::*;
use super::load::*;
use super::prompts::*;
use super::report::*;
use super::request::*;
use super::session::*;
use super::stats::*;
use super::*;

#[test]
fn percentiles_interpolate() {
    let v = [1.0, 2.0, 3.0, 4.0, 5.0];
    assert_eq!(percentile(&v, 0.0), 1.0);
    assert_eq!(percentile(&v, 50.0), 3.0);
    assert_eq!(percentile(&v, 100.0), 5.0);
    assert!((percentile(&v, 90.0) - 4.6).abs() < 1e-12);
    assert!((percentile(&v, 99.0) - 4.96).abs() < 1e-12);
    assert_eq!(percentile(&[7.0], 99.0), 7.0);
    assert!(percentile(&[], 50.0).is_nan());
    let s = summarize(vec![4.0, 1.0, 3.0, 2.0]);
    assert_eq!(s.mean, 2.5);
    assert_eq!(s.p50, 2.5);
    assert_eq!(s.max, 4.0);
    assert_eq!(s.n, 4);
}

fn outcome(ttft: f64, e2e: f64, n: u64) -> Outcome {
    Outcome {
        ok: true,
        ttft: Some(ttft),
        e2e,
        output_tokens: n,
        ..Outcome::default()
    }
}

#[test]
fn tpot_and_goodput() {
    let a = outcome(0.1, 1.1, 11); // tpot 100 ms
    assert!((a.tpot().unwrap() - 0.1).abs() < 1e-12);
    assert_eq!(outcome(0.1, 0.1, 1).tpot(), None);
    let slo = parse_slo("ttft:200,tpot:50").unwrap();
    assert_eq!(slo.ttft_ms, Some(200.0));
    assert!(!meets(&a, &slo)); // tpot too slow
    let b = outcome(0.1, 0.6, 11); // tpot 50 ms
    assert!(meets(&b, &slo));
    let c = outcome(0.3, 0.8, 11); // ttft too slow
    assert!(!meets(&c, &slo));
    let d = outcome(0.1, 0.1, 1); // one token: tpot not measurable
    assert!(meets(&d, &slo));
    let e = Outcome {
        ok: false,
        error: Some("x".into()),
        ..b.clone()
    };
    assert!(!meets(&e, &slo));
    let r = aggregate("t".into(), Some(1), None, 2.0, &[a, b, c, d, e], Some(&slo));
    assert_eq!(r.good, Some(2));
    assert_eq!(r.errors, 1);
    assert_eq!(r.completed, 4);
    assert_eq!(r.per_s(2.0), 1.0);
    assert_eq!(r.output_tokens, 34);
    assert!(parse_slo("foo:1").is_err());
    assert!(parse_slo("ttft:-1").is_err());
    assert_eq!(parse_range("16:256"), Ok((16, 256)));
    assert!(parse_range("9:3").is_err());
}

#[test]
fn events_parse() {
    let chat = r#"{"choices":[{"index":0,"delta":{"content":"Hi"}}]}"#;
    assert!(parse_event(chat).content);
    let role = r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#;
    assert!(!parse_event(role).content);
    let text = r#"{"choices":[{"index":0,"text":" a"}]}"#;
    assert!(parse_event(text).content);
    let usage = r#"{"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":5}}"#;
    let c = parse_event(usage);
    assert!(!c.content);
    assert_eq!((c.prompt_tokens, c.completion_tokens), (Some(12), Some(5)));
    let null_usage = r#"{"choices":[{"delta":{"content":"x"}}],"usage":null}"#;
    assert_eq!(parse_event(null_usage).completion_tokens, None);
    assert!(parse_event(" [DONE]").done);
    let err = r#"{"error":{"message":"boom","type":"x"}}"#;
    assert_eq!(parse_event(err).error.as_deref(), Some("boom"));
    assert!(parse_event("not json").error.is_some());
}

#[test]
fn urls() {
    assert_eq!(
        parse_url("http://127.0.0.1:8000").unwrap(),
        "http://127.0.0.1:8000"
    );
    assert_eq!(
        parse_url("http://localhost/v1/").unwrap(),
        "http://localhost"
    );
    assert_eq!(
        parse_url("http://[::1]:9/api").unwrap(),
        "http://[::1]:9/api"
    );
    assert_eq!(parse_url("http://h:1/api/v1").unwrap(), "http://h:1/api");
    assert_eq!(parse_url("http://v1").unwrap(), "http://v1");
    assert!(parse_url("https://x").is_err());
    assert!(parse_url("http://x:port").is_err());
    assert!(parse_url("127.0.0.1:8000").is_err());
}

/// One piece of a fake server's response body: sent after a pause (ms),
/// or `None`: the body fails there (the connection is cut).
type Part = (u64, Option<&'static str>);

/// What the fake server saw of each request.
type Seen = Arc<std::sync::Mutex<Vec<(std::net::SocketAddr, HeaderMap)>>>;

/// A fake OpenAI server on loopback: `GET /v1/models` lists `fake`, and
/// every POST is answered with `status` and a body written in `parts`.
async fn fake_server(status: u16, parts: Vec<Part>) -> (String, Seen) {
    use axum::extract::ConnectInfo;
    use axum::routing::{get, post};
    let seen: Seen = Arc::default();
    let log = Arc::clone(&seen);
    let answer = move |ConnectInfo(peer): ConnectInfo<std::net::SocketAddr>, headers: HeaderMap| {
        log.lock().unwrap().push((peer, headers));
        let parts = parts.clone();
        async move {
            let body = futures_util::stream::iter(parts).then(|(ms, part)| async move {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                part.ok_or_else(|| std::io::Error::other("cut"))
            });
            (
                StatusCode::from_u16(status).unwrap(),
                [(CONTENT_TYPE, "text/event-stream")],
                axum::body::Body::from_stream(body),
            )
        }
    };
    let app = axum::Router::new()
        .route(
            "/v1/models",
            get(|| async { r#"{"data":[{"id":"fake"}]}"# }),
        )
        .route("/v1/chat/completions", post(answer));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let app = app.into_make_service_with_connect_info::<std::net::SocketAddr>();
        axum::serve(listener, app).await.unwrap();
    });
    (base, seen)
}

fn shared_for(base: &str) -> Shared {
    Shared {
        client: http_client(false).unwrap(),
        url: format!("{}/v1/chat/completions", parse_url(base).unwrap()),
        path: "/v1/chat/completions",
        model: "fake".into(),
        endpoint: Endpoint::Chat,
        temperature: 0.0,
        ignore_eos: false,
        timeout: Duration::from_secs(10),
    }
}

const ROLE: Option<&str> =
    Some("data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n");
const A: Option<&str> = Some("data: {\"choices\":[{\"delta\":{\"content\":\"A\"}}]}\n\n");
/// An event whose blank line comes in a later read.
const B_OPEN: Option<&str> = Some("data: {\"choices\":[{\"delta\":{\"content\":\"B\"}}]}\n");
const THINK: Option<&str> = Some("data: {\"choices\":[{\"delta\":{\"reasoning\":\"hm\"}}]}\n\n");

const USAGE_DONE: Option<&str> = Some(
    "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2}}\n\n\
     data: [DONE]\n\n",
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_are_timed_when_they_arrive() {
    let (base, seen) = fake_server(
        200,
        vec![
            (0, ROLE),
            (0, A),
            (100, B_OPEN),
            (100, Some("\n")),
            (300, USAGE_DONE),
        ],
    )
    .await;
    let sh = shared_for(&base);
    assert_eq!(default_model(&sh.client, &base).await.unwrap(), "fake");
    let spec = Spec {
        prompt: "hi".into(),
        max_tokens: 2,
        turn: 1,
        ..Spec::default()
    };
    let o = run_one(&sh, &spec).await;
    assert!(o.ok, "{:?}", o.error);
    assert_eq!(o.text, "AB");
    assert_eq!((o.output_tokens, o.prompt_tokens), (2, Some(5)));
    assert_eq!(o.reasoning_deltas, 0);
    let ttft = o.ttft.unwrap();
    // B counts from the read that completed it, 200 ms after A's.
    assert_eq!(o.itl.len(), 1);
    assert!(o.itl[0] >= 0.19, "{:?}", o.itl);
    // And not when the body ended, 300 ms after that.
    assert!(o.e2e - (ttft + o.itl[0]) >= 0.29, "{o:?}");

    // Every request on a connection of its own, closed after it.
    let again = run_one(&sh, &spec).await;
    assert!(again.ok, "{:?}", again.error);
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 2);
    assert_ne!(seen[0].0, seen[1].0, "a connection was reused");
    for (_, h) in seen.iter() {
        assert_eq!(h[CONNECTION], "close");
        assert_eq!(h[ACCEPT], "text/event-stream");
        assert_eq!(h[CONTENT_TYPE], "application/json");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reasoning_deltas_bear_tokens() {
    let (base, _) = fake_server(
        200,
        vec![
            (0, ROLE),
            (0, THINK),
            (100, THINK),
            (100, A),
            (0, Some("data: [DONE]\n\n")),
        ],
    )
    .await;
    let sh = shared_for(&base);
    let spec = Spec {
        prompt: "hi".into(),
        max_tokens: 3,
        turn: 1,
        ..Spec::default()
    };
    let o = run_one(&sh, &spec).await;
    assert!(o.ok, "{:?}", o.error);
    // TTFT from the first reasoning delta, ITL over all three; the
    // answer text leaves the reasoning out. No usage: deltas counted.
    assert!(o.ttft.unwrap() < 0.09, "{o:?}");
    assert_eq!(o.itl.len(), 2, "{o:?}");
    assert!(o.itl.iter().all(|&g| g >= 0.09), "{o:?}");
    assert_eq!((o.output_tokens, o.reasoning_deltas), (3, 2));
    assert_eq!(o.text, "A");
    let r = aggregate("t".into(), Some(1), None, 1.0, &[o], None);
    assert_eq!(r.reasoning_deltas, 2);
    assert!(r.text().contains("\nreasoning deltas: 2\n"), "{}", r.text());
    assert_eq!(r.json()["reasoning_deltas"], json!(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_streams_are_errors() {
    let spec = &Spec {
        prompt: "hi".into(),
        max_tokens: 2,
        ..Spec::default()
    };
    let error = |parts: Vec<Part>, status: u16| async move {
        let (base, _) = fake_server(status, parts).await;
        let o = run_one(&shared_for(&base), spec).await;
        assert!(!o.ok);
        o.error.unwrap()
    };
    let e = error(vec![(0, Some("no such model"))], 404).await;
    assert_eq!(e, "HTTP 404: no such model");
    let e = error(vec![(0, A)], 200).await;
    assert_eq!(e, "stream ended without [DONE]");
    // A stream cut mid-body (no last chunk) is an error, not a hang.
    let e = error(vec![(0, A), (0, B_OPEN), (50, None)], 200).await;
    assert!(e.starts_with("reading the stream"), "{e}");
    let err = "data: {\"error\":{\"message\":\"boom\"}}\n\ndata: [DONE]\n\n";
    assert_eq!(error(vec![(0, Some(err))], 200).await, "boom");
    let e = error(vec![(0, ROLE), (0, Some("data: [DONE]\n\n"))], 200).await;
    assert_eq!(e, "no content in the response");
    // Nothing listening.
    let o = run_one(&shared_for("http://127.0.0.1:1"), spec).await;
    assert!(!o.ok && o.error.is_some());
}

fn base_args() -> BenchArgs {
    BenchArgs {
        url: String::new(),
        model: None,
        endpoint: Endpoint::Chat,
        num_requests: 6,
        multi_turn_sessions: None,
        turns: None,
        kv_block_size: 16,
        concurrency: None,
        request_rate: None,
        sweep_concurrency: vec![],
        input_len: 10,
        input_len_range: None,
        output_len: 4,
        output_len_range: Some((2, 9)),
        shared_prefix_groups: 2,
        shared_prefix_len: 4,
        seed: 3,
        temperature: 0.0,
        goodput: None,
        json: None,
        ignore_eos: false,
        timeout: 1,
        quiet: true,
        keep_alive: false,
    }
}

#[test]
fn prompts_are_seeded() {
    let args = base_args();
    let a = make_specs(&args);
    let b = make_specs(&args);
    assert_eq!(a.len(), 6);
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.prompt, y.prompt);
        assert_eq!(x.prompt.split(' ').count(), 10);
        assert!((2..=9).contains(&x.max_tokens));
    }
    fn prefix(s: &Spec) -> Vec<&str> {
        s.prompt.split(' ').take(4).collect()
    }
    assert_eq!(prefix(&a[0]), prefix(&a[2]));
    assert_eq!(prefix(&a[1]), prefix(&a[3]));
}

#[test]
fn multi_turn_flags() {
    let with = |f: &dyn Fn(&mut BenchArgs)| {
        let mut a = base_args();
        a.multi_turn_sessions = Some(2);
        a.turns = Some(3);
        f(&mut a);
        check_args(&a).map_err(|e| e.to_string())
    };
    assert!(with(&|_| {}).is_ok());
    let err = |f: &dyn Fn(&mut BenchArgs)| with(f).unwrap_err();
    assert!(err(&|a| a.turns = None).contains("needs --turns"));
    assert!(err(&|a| a.multi_turn_sessions = None).contains("needs --multi-turn-sessions"));
    assert!(err(&|a| a.turns = Some(0)).contains("--turns must be at least 1"));
    assert!(err(&|a| a.multi_turn_sessions = Some(0)).contains("at least 1"));
    assert!(err(&|a| a.endpoint = Endpoint::Completions).contains("--endpoint chat"));
    assert!(err(&|a| a.kv_block_size = 0).contains("--kv-block-size"));

    #[derive(Debug, clap::Parser)]
    struct Cli {
        #[command(flatten)]
        bench: BenchArgs,
    }
    use clap::Parser as _;
    let parse = |v: &[&str]| Cli::try_parse_from([&["bench"], v].concat());
    let ok = parse(&["--multi-turn-sessions", "8", "--turns", "4"]).unwrap();
    assert_eq!(
        (
            ok.bench.multi_turn_sessions,
            ok.bench.turns,
            ok.bench.kv_block_size
        ),
        (Some(8), Some(4), 16)
    );
    let e = parse(&[
        "--multi-turn-sessions",
        "8",
        "--turns",
        "4",
        "--num-requests",
        "9",
    ])
    .unwrap_err();
    assert_eq!(e.kind(), clap::error::ErrorKind::ArgumentConflict);
}

#[test]
fn sessions_are_seeded() {
    let mut args = base_args();
    args.input_len_range = Some((5, 12));
    let a = make_sessions(&args, 5, 3, 0);
    assert_eq!(a.len(), 5);
    for (sa, sb) in a.iter().zip(&make_sessions(&args, 5, 3, 0)) {
        assert_eq!(sa.len(), 3);
        for (x, y) in sa.iter().zip(sb) {
            assert_eq!((&x.prompt, x.max_tokens), (&y.prompt, y.max_tokens));
            assert!((5..=12).contains(&x.prompt.split(' ').count()));
            assert!((2..=9).contains(&x.max_tokens));
            assert_eq!((x.turn, x.history.len()), (0, 0));
        }
    }
    // Shared prefixes start each session's first message only.
    let head = |s: &Spec| s.prompt.split(' ').take(4).collect::<Vec<_>>().join(" ");
    assert_eq!(head(&a[0][0]), head(&a[2][0]));
    assert_eq!(head(&a[1][0]), head(&a[3][0]));
    assert_ne!(head(&a[0][0]), head(&a[1][0]));
    assert_ne!(head(&a[0][1]), head(&a[0][0]));
    // Another sweep point gets other conversations.
    let b = make_sessions(&args, 5, 3, 1);
    assert_ne!(a[0][0].prompt, b[0][0].prompt);
    // Another seed, other conversations.
    args.seed = 4;
    assert_ne!(make_sessions(&args, 5, 3, 0)[0][0].prompt, a[0][0].prompt);
}

fn answered(spec: &Spec, text: &str, prompt_tokens: u64, output_tokens: u64) -> Outcome {
    Outcome {
        ok: true,
        ttft: Some(0.01),
        e2e: 0.02,
        text: text.into(),
        prompt_tokens: Some(prompt_tokens),
        output_tokens,
        input_words: spec.input_words,
        turn: spec.turn,
        carryable: spec.carryable,
        ..Outcome::default()
    }
}

#[test]
fn session_history() {
    let mut args = base_args();
    args.shared_prefix_groups = 0;
    let turns = make_sessions(&args, 1, 4, 0).remove(0);
    let users: Vec<String> = turns.iter().map(|t| t.prompt.clone()).collect();
    let mut s = Session::new(turns);
    let t1 = s.next_spec();
    assert_eq!((t1.turn, t1.history.len(), t1.carryable), (1, 0, None));
    assert_eq!(t1.input_words, 10);
    let mut o = answered(&t1, "Hello there", 40, 9);
    s.finish(&mut o, 16);
    assert!(o.text.is_empty(), "the answer moves into the history");
    let t2 = s.next_spec();
    assert_eq!(t2.turn, 2);
    assert_eq!(t2.prompt, users[1]);
    assert_eq!(t2.carryable, Some(48)); // 40 + 9 = 49 -> 3 blocks
    assert_eq!(t2.input_words, 49 + 10);
    let user = |c: &str| Msg {
        role: Role::User,
        content: c.into(),
    };
    let assistant = |c: &str| Msg {
        role: Role::Assistant,
        content: c.into(),
    };
    assert_eq!(t2.history, [user(&users[0]), assistant("Hello there")]);
    let sh = Shared {
        model: "m".into(),
        ..shared_for("http://127.0.0.1:1")
    };
    let body: Value = serde_json::from_str(&request_body(&sh, &t2)).unwrap();
    assert_eq!(
        body["messages"],
        json!([
            {"role": "user", "content": users[0]},
            {"role": "assistant", "content": "Hello there"},
            {"role": "user", "content": users[1]},
        ])
    );
    assert_eq!(body["stream_options"]["include_usage"], json!(true));
    // A server without usage: no carry-over known.
    let mut o = answered(&t2, "Sure", 0, 3);
    o.prompt_tokens = None;
    s.finish(&mut o, 16);
    let t3 = s.next_spec();
    assert_eq!(t3.history.len(), 4);
    assert_eq!(t3.history[3], assistant("Sure"));
    assert_eq!(t3.carryable, None);
    assert_eq!(t3.input_words, t2.input_words + 3 + 10);
    // A failed turn ends the session; the rest are reported as skipped.
    let mut o = Outcome {
        turn: 3,
        error: Some("HTTP 500".into()),
        ..Outcome::default()
    };
    s.finish(&mut o, 16);
    assert!(!s.pending() && s.failed);
    let rest = s.skip_rest();
    assert_eq!(rest.len(), 1);
    assert_eq!((rest[0].turn, rest[0].ok), (4, false));
    assert_eq!(rest[0].error.as_deref(), Some(SKIPPED));
    assert!(s.skip_rest().is_empty());
}

#[test]
fn retention_math() {
    assert_eq!(carryable(Some(100), 30, 16), Some(128));
    assert_eq!(carryable(Some(100), 28, 16), Some(128));
    assert_eq!(carryable(Some(100), 27, 16), Some(112));
    assert_eq!(carryable(Some(10), 5, 16), Some(0));
    assert_eq!(carryable(None, 5, 16), None);
    let o = |turn: usize, cached: Option<u64>, carry: Option<u64>| Outcome {
        ok: true,
        ttft: Some(0.1 * turn as f64),
        e2e: 0.5,
        output_tokens: 4,
        turn,
        cached_tokens: cached,
        carryable: carry,
        ..Outcome::default()
    };
    assert_eq!(retention(&o(2, Some(96), Some(128))), Some(0.75));
    assert_eq!(retention(&o(2, None, Some(128))), None);
    assert_eq!(retention(&o(2, Some(0), Some(0))), None);
    assert_eq!(retention(&o(2, Some(16), None)), None);
    let outs = [
        o(1, Some(16), None),
        o(1, Some(0), None),
        o(2, Some(64), Some(64)),
        o(2, Some(32), Some(64)),
        o(3, Some(96), Some(128)),
        Outcome {
            turn: 3,
            error: Some("x".into()),
            ..Outcome::default()
        },
    ];
    let mt = multi_turn_stats(2, 3, 16, &outs);
    let t = &mt.per_turn;
    assert_eq!(t.len(), 3);
    assert_eq!(
        (t[0].cached, t[0].carryable, t[0].retention),
        (Some(8.0), None, None)
    );
    assert_eq!((t[1].completed, t[1].errors), (2, 0));
    assert_eq!((t[1].cached, t[1].carryable), (Some(48.0), Some(64.0)));
    assert_eq!((t[1].retention, t[1].retention_n), (Some(0.75), 2));
    assert_eq!(
        (t[2].completed, t[2].errors, t[2].retention),
        (1, 1, Some(0.75))
    );
    assert!((t[2].ttft.mean - 0.3).abs() < 1e-12);
    // Overall: the mean of the per-request ratios of turns 2+.
    assert_eq!(
        (mt.retention, mt.retention_n),
        (Some((1.0 + 0.5 + 0.75) / 3.0), 3)
    );
    let text = mt.text();
    assert!(
        text.contains("KV retention (turns 2+): 0.750 over 3 requests"),
        "{text}"
    );
    let j = mt.json();
    assert_eq!(j["per_turn"][1]["retention"], json!(0.75));
    assert_eq!(j["per_turn"][0]["retention"], Value::Null);
    assert_eq!(j["per_turn"][2]["ttft"]["count"], json!(1));

    // A server that reports no cached tokens (llama-server): n/a, no panic.
    let outs = [o(1, None, None), o(2, None, Some(64)), o(2, None, None)];
    let mt = multi_turn_stats(1, 3, 16, &outs);
    assert_eq!((mt.retention, mt.retention_n), (None, 0));
    assert_eq!(mt.per_turn[2].completed, 0);
    let text = mt.text();
    assert!(
        text.contains("KV retention (turns 2+): n/a over 0 requests"),
        "{text}"
    );
    assert!(text.lines().nth(3).unwrap().contains("n/a"), "{text}");
    assert_eq!(mt.json()["retention"], Value::Null);
    let mut r = aggregate("t".into(), Some(1), None, 1.0, &outs, None);
    r.multi_turn = Some(mt);
    assert!(r.text().contains("multi-turn: 1 sessions x 3 turns"));
    assert_eq!(
        r.json()["multi_turn"]["per_turn"][1]["cached_tokens_mean"],
        Value::Null
    );
    assert_eq!(
        r.json()["multi_turn"]["per_turn"][1]["carryable_tokens_mean"],
        json!(64.0)
    );
}

#[test]
fn usage_and_text_parse() {
    let c = parse_event(r#"{"choices":[{"delta":{"content":"Hi "}}]}"#);
    assert_eq!((c.content, c.text.as_str()), (true, "Hi "));
    let c = parse_event(r#"{"choices":[{"text":"x"}]}"#);
    assert_eq!(c.text, "x");
    // Reasoning counts for TTFT but is not part of the answer, under
    // either field name.
    let c = parse_event(r#"{"choices":[{"delta":{"content":"","reasoning_content":"hm"}}]}"#);
    assert_eq!((c.content, c.reasoning, c.text.as_str()), (true, true, ""));
    let c = parse_event(r#"{"choices":[{"delta":{"reasoning":"hm"}}]}"#);
    assert_eq!((c.content, c.reasoning, c.text.as_str()), (true, true, ""));
    let c = parse_event(r#"{"choices":[{"delta":{"reasoning":"","content":"x"}}]}"#);
    assert_eq!((c.content, c.reasoning), (true, false));
    let c = parse_event(r#"{"choices":[{"delta":{"reasoning":null,"content":""}}]}"#);
    assert_eq!((c.content, c.reasoning), (false, false));
    let u = r#"{"choices":[],"usage":{"prompt_tokens":80,"completion_tokens":5,
        "prompt_tokens_details":{"cached_tokens":64}}}"#;
    let c = parse_event(u);
    assert_eq!((c.prompt_tokens, c.cached_tokens), (Some(80), Some(64)));
    let u = r#"{"choices":[],"usage":{"prompt_tokens":80,"completion_tokens":5,
        "prompt_tokens_details":null}}"#;
    assert_eq!(parse_event(u).cached_tokens, None);
}

/// A fake server for the session scheduler: answers after a short sleep,
/// logging (session, turn) in send order and the peak concurrency.
#[derive(Default)]
struct Fake {
    log: std::sync::Mutex<Vec<(String, usize)>>,
    in_flight: AtomicUsize,
    peak: AtomicUsize,
}

fn run_fake(
    sessions: Vec<Vec<Spec>>,
    concurrency: Option<usize>,
    rate: Option<f64>,
    fail: Option<(usize, usize)>,
) -> (Arc<Fake>, Vec<Outcome>) {
    let firsts: Vec<String> = sessions.iter().map(|s| s[0].prompt.clone()).collect();
    let fake = Arc::new(Fake::default());
    let f = Arc::clone(&fake);
    let run_turn = move |spec: Spec| {
        let f = Arc::clone(&f);
        let firsts = firsts.clone();
        async move {
            let n = f.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
            f.peak.fetch_max(n, Ordering::SeqCst);
            // Which session: by its first user message.
            let first = spec.history.first().map_or(&spec.prompt, |m| &m.content);
            let session = firsts.iter().position(|p| p == first).unwrap();
            // The history is exactly the earlier turns and our answers.
            assert_eq!(spec.history.len(), 2 * (spec.turn - 1));
            for (k, pair) in spec.history.chunks(2).enumerate() {
                assert_eq!(pair[0].role, Role::User);
                assert_eq!(pair[1].content, format!("answer {session}.{}", k + 1));
            }
            f.log.lock().unwrap().push((first.clone(), spec.turn));
            tokio::time::sleep(Duration::from_millis(2)).await;
            f.in_flight.fetch_sub(1, Ordering::SeqCst);
            let mut o = answered(&spec, &format!("answer {session}.{}", spec.turn), 30, 4);
            o.cached_tokens = spec.carryable;
            if fail == Some((session, spec.turn)) {
                o.ok = false;
                o.error = Some("boom".into());
            }
            o
        }
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (_, outs) = rt.block_on(run_sessions(
        sessions,
        concurrency,
        rate,
        0,
        16,
        true,
        run_turn,
    ));
    (fake, outs)
}

#[test]
fn sessions_schedule() {
    let mut args = base_args();
    args.shared_prefix_groups = 0;
    let sessions = make_sessions(&args, 4, 3, 0);
    let firsts: Vec<String> = sessions.iter().map(|s| s[0].prompt.clone()).collect();

    // One slot: FIFO over ready turns is round robin over the sessions.
    let (fake, outs) = run_fake(sessions.clone(), Some(1), None, None);
    let order: Vec<(usize, usize)> = fake
        .log
        .lock()
        .unwrap()
        .iter()
        .map(|(p, t)| (firsts.iter().position(|f| f == p).unwrap(), *t))
        .collect();
    let want: Vec<(usize, usize)> = (1..=3).flat_map(|t| (0..4).map(move |s| (s, t))).collect();
    assert_eq!(order, want);
    assert_eq!(fake.peak.load(Ordering::SeqCst), 1);
    assert_eq!(outs.len(), 12);
    assert!(outs.iter().all(|o| o.ok));
    let mt = multi_turn_stats(4, 3, 16, &outs);
    assert_eq!(mt.per_turn[1].carryable, Some(32.0)); // 30 + 4 -> 2 blocks
    assert_eq!((mt.retention, mt.retention_n), (Some(1.0), 8));

    // Two slots: never more in flight; with more slots than sessions, at
    // most one turn per session (each turn checks its own history).
    let (fake, _) = run_fake(sessions.clone(), Some(2), None, None);
    assert_eq!(fake.peak.load(Ordering::SeqCst), 2);
    let (fake, outs) = run_fake(sessions.clone(), Some(16), Some(1e6), None);
    assert_eq!(fake.peak.load(Ordering::SeqCst), 4);
    assert_eq!(outs.len(), 12);

    // A failed turn ends its session: its later turns are skipped.
    let (fake, outs) = run_fake(sessions, Some(2), None, Some((1, 2)));
    assert_eq!(fake.log.lock().unwrap().len(), 11);
    assert_eq!(outs.len(), 12);
    let bad: Vec<(usize, &str)> = outs
        .iter()
        .filter(|o| !o.ok)
        .map(|o| (o.turn, o.error.as_deref().unwrap()))
        .collect();
    assert_eq!(bad.len(), 2);
    assert!(bad.contains(&(2, "boom")) && bad.contains(&(3, SKIPPED)));
}
