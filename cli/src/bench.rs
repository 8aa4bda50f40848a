//! `tandem bench`: a serving benchmark for any OpenAI-compatible server
//! (tandem serve, llama-server, vLLM, ...), in the spirit of vLLM's
//! `benchmark_serving.py`.
//!
//! Every request is a streaming `/v1/chat/completions` (or `/v1/completions`)
//! call with `stream_options.include_usage`, sent over a plain HTTP/1.1
//! connection (one per request, `Connection: close`; no TLS) by reqwest, its
//! server-sent events parsed by eventsource-stream. Per request it records
//! TTFT (time to the first token-bearing delta: non-empty content, text or
//! reasoning), ITL (gaps between token-bearing deltas; each timed when the
//! read that completed its event returned, not when the body ended), TPOT
//! (`(e2e - ttft) / (output tokens - 1)`), the end-to-end latency and the
//! token counts the server reports in `usage` (deltas are counted when it
//! reports none). Reasoning deltas (`delta.reasoning`, or vLLM's
//! `delta.reasoning_content`, from a server running a reasoning parser) are
//! also counted on their own.
//!
//! Prompts are random words from a fixed built-in list (seeded, so two runs
//! with the same flags send the same prompts), about one token per word.
//!
//! Multi-turn sessions (`--multi-turn-sessions N --turns T`): turn k of a
//! session sends the whole conversation so far (its earlier user messages and
//! the answers the server streamed back) plus a new random user message.
//! Fairness: a session holds a concurrency slot only while one of its turns is
//! in flight, and ready turns (first turns, and each next turn once the
//! previous one finished) wait in one FIFO queue, so a session that just
//! finished queues behind sessions that waited longer and none monopolises a
//! slot. There is no think time. With `--request-rate` the Poisson arrival
//! times pace all requests: the j-th request goes out at the j-th arrival, or
//! later when no turn is ready or no slot is free then (as single requests do
//! when the concurrency cap is hit). Per turn it reports the server's cached
//! prefix (`usage.prompt_tokens_details.cached_tokens`) against what the
//! previous turn could have left in the cache: its prompt plus completion
//! tokens, rounded down to whole KV blocks.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use clap::{Args, ValueEnum};
use eventsource_stream::{EventStreamError, Eventsource};
use futures_util::StreamExt;
use reqwest::StatusCode;
use reqwest::header::{ACCEPT, CONNECTION, CONTENT_TYPE, HeaderMap, HeaderValue};
use serde_json::{Value, json};
use tandem_types::SeededRng;
use tokio::sync::Semaphore;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Endpoint {
    /// `/v1/chat/completions` with one user message.
    Chat,
    /// `/v1/completions` with a raw prompt.
    Completions,
}

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Base URL of the server (http only).
    #[arg(
        long,
        env = "TANDEM_BENCH_URL",
        default_value = "http://127.0.0.1:8000"
    )]
    url: String,
    /// Model name sent in requests (default: the first id of /v1/models).
    #[arg(long, env = "TANDEM_BENCH_MODEL")]
    model: Option<String>,
    /// API endpoint to exercise.
    #[arg(
        long,
        env = "TANDEM_BENCH_ENDPOINT",
        value_enum,
        default_value = "chat"
    )]
    endpoint: Endpoint,
    /// Requests per run (per sweep point).
    #[arg(long, env = "TANDEM_BENCH_NUM_REQUESTS", default_value_t = 64)]
    num_requests: usize,
    /// Multi-turn chat: this many sessions of --turns turns each (N x T
    /// requests per point, instead of --num-requests).
    #[arg(
        long,
        env = "TANDEM_BENCH_MULTI_TURN_SESSIONS",
        conflicts_with = "num_requests"
    )]
    multi_turn_sessions: Option<usize>,
    /// Turns per multi-turn session; each turn's new user message takes its
    /// length from --input-len(-range).
    #[arg(long, env = "TANDEM_BENCH_TURNS")]
    turns: Option<usize>,
    /// The server's KV block size in tokens, for the multi-turn retention
    /// report (only whole blocks can be reused).
    #[arg(long, env = "TANDEM_BENCH_KV_BLOCK_SIZE", default_value_t = 16)]
    kv_block_size: usize,
    /// Requests in flight at once (default 8; with --request-rate: no cap
    /// unless given).
    #[arg(long, env = "TANDEM_BENCH_CONCURRENCY")]
    concurrency: Option<usize>,
    /// Open-loop load: Poisson arrivals at this many requests per second.
    #[arg(long, env = "TANDEM_BENCH_REQUEST_RATE")]
    request_rate: Option<f64>,
    /// Run once per concurrency in this comma-separated list (e.g. 1,8,32).
    #[arg(long, env = "TANDEM_BENCH_SWEEP_CONCURRENCY", value_delimiter = ',')]
    sweep_concurrency: Vec<usize>,
    /// Prompt length in words (about one token each).
    #[arg(long, env = "TANDEM_BENCH_INPUT_LEN", default_value_t = 128)]
    input_len: usize,
    /// Uniformly random prompt length per request, LO:HI (inclusive);
    /// overrides --input-len.
    #[arg(long, env = "TANDEM_BENCH_INPUT_LEN_RANGE", value_parser = parse_range)]
    input_len_range: Option<(usize, usize)>,
    /// max_tokens of every request.
    #[arg(long, env = "TANDEM_BENCH_OUTPUT_LEN", default_value_t = 64)]
    output_len: usize,
    /// Uniformly random max_tokens per request, LO:HI (inclusive); overrides
    /// --output-len.
    #[arg(long, env = "TANDEM_BENCH_OUTPUT_LEN_RANGE", value_parser = parse_range)]
    output_len_range: Option<(usize, usize)>,
    /// Number of distinct shared prompt prefixes (request i uses prefix i % G).
    #[arg(long, env = "TANDEM_BENCH_SHARED_PREFIX_GROUPS", default_value_t = 0)]
    shared_prefix_groups: usize,
    /// Words in each shared prefix (part of the input length).
    #[arg(long, env = "TANDEM_BENCH_SHARED_PREFIX_LEN", default_value_t = 0)]
    shared_prefix_len: usize,
    /// Seed of the prompts, lengths and arrival times.
    #[arg(long, env = "TANDEM_BENCH_SEED", default_value_t = 0)]
    seed: u64,
    /// Sampling temperature sent with every request.
    #[arg(long, env = "TANDEM_BENCH_TEMPERATURE", default_value_t = 0.0)]
    temperature: f64,
    /// Service-level objectives for goodput, e.g. ttft:500,tpot:50 (ms;
    /// keys ttft, tpot, e2e).
    #[arg(long, env = "TANDEM_BENCH_GOODPUT", value_parser = parse_slo)]
    goodput: Option<Slo>,
    /// Also write all aggregates (per sweep point) as JSON to this file.
    #[arg(long, env = "TANDEM_BENCH_JSON")]
    json: Option<PathBuf>,
    /// Send `ignore_eos: true` (llama-server accepts it; tandem serve only
    /// with --allow-extra-request-fields).
    #[arg(long, env = "TANDEM_BENCH_IGNORE_EOS")]
    ignore_eos: bool,
    /// Per-request timeout in seconds.
    #[arg(long, env = "TANDEM_BENCH_TIMEOUT", default_value_t = 600)]
    timeout: u64,
    /// No live progress line on stderr.
    #[arg(long, env = "TANDEM_BENCH_QUIET")]
    quiet: bool,
    /// Reuse connections (keep-alive), as a load balancer in front of the
    /// server does; by default every request opens its own.
    #[arg(long, env = "TANDEM_BENCH_KEEP_ALIVE")]
    keep_alive: bool,
}

fn parse_range(s: &str) -> Result<(usize, usize), String> {
    let (lo, hi) = s.split_once(':').ok_or("expected LO:HI")?;
    let lo: usize = lo.trim().parse().map_err(|e| format!("LO: {e}"))?;
    let hi: usize = hi.trim().parse().map_err(|e| format!("HI: {e}"))?;
    if lo == 0 || lo > hi {
        return Err("need 1 <= LO <= HI".into());
    }
    Ok((lo, hi))
}

/// Goodput service-level objectives, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Slo {
    ttft_ms: Option<f64>,
    tpot_ms: Option<f64>,
    e2e_ms: Option<f64>,
}

fn parse_slo(s: &str) -> Result<Slo, String> {
    let mut slo = Slo::default();
    for part in s.split(',').filter(|p| !p.trim().is_empty()) {
        let (k, v) = part.split_once(':').ok_or("expected KEY:MS")?;
        let v: f64 = v.trim().parse().map_err(|e| format!("{k}: {e}"))?;
        if v.is_nan() || v <= 0.0 {
            return Err(format!("{k}: must be positive"));
        }
        match k.trim() {
            "ttft" => slo.ttft_ms = Some(v),
            "tpot" => slo.tpot_ms = Some(v),
            "e2e" => slo.e2e_ms = Some(v),
            other => return Err(format!("unknown SLO {other:?} (ttft, tpot, e2e)")),
        }
    }
    Ok(slo)
}

// --- prompts ------------------------------------------------------------------

/// Short, common words: about one token each (with the leading space) for
/// byte-level BPE tokenizers.
const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "was", "that", "for", "on", "with", "as", "by", "at",
    "from", "his", "her", "an", "are", "not", "be", "or", "had", "this", "one", "all", "but",
    "they", "which", "were", "there", "been", "has", "more", "new", "who", "can", "time", "some",
    "other", "when", "first", "two", "into", "city", "year", "school", "world", "house", "water",
    "light", "music", "river", "game", "book", "story", "night", "road", "small", "large", "old",
    "young", "long", "high", "great", "good", "last", "own", "war", "work", "life", "day", "way",
    "man", "state", "team", "film", "name", "part", "place", "point", "hand", "home", "side",
    "end", "family", "group", "power", "line", "head", "land", "early", "late", "red", "blue",
    "green", "black", "white", "king", "church", "army", "party", "club", "town", "car", "ship",
    "train", "field", "tree", "fire", "stone", "song", "law", "art", "food", "money", "market",
];

/// Appends `n` random words of `WORDS`, space-separated.
fn words(rng: &mut SeededRng, n: usize, out: &mut String) {
    for _ in 0..n {
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(WORDS[rng.below(WORDS.len())]);
    }
}

/// The seconds to the next Poisson arrival at `rate` per second: an
/// exponential draw, `-ln(u) / rate` with `u` uniform in (0, 1] (`unit_f64`
/// is in [0, 1) on a 2^-53 grid, so adding 2^-53 is exact and never 0).
fn next_arrival(rng: &mut SeededRng, rate: f64) -> f64 {
    let u = rng.unit_f64() + f64::EPSILON / 2.0;
    -u.ln() / rate
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    User,
    Assistant,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Msg {
    role: Role,
    content: String,
}

#[derive(Debug, Clone, Default)]
struct Spec {
    /// The prompt, or in a chat the new user message.
    prompt: String,
    /// Estimated prompt tokens (words), history included.
    input_words: usize,
    max_tokens: usize,
    /// Earlier messages of a multi-turn session.
    history: Vec<Msg>,
    /// 1-based turn of a multi-turn session; 0 for single requests.
    turn: usize,
    /// KV tokens the previous turn could have left for this one.
    carryable: Option<u64>,
}

fn shared_prefixes(args: &BenchArgs, rng: &mut SeededRng) -> Vec<String> {
    let groups = if args.shared_prefix_len > 0 {
        args.shared_prefix_groups
    } else {
        0
    };
    (0..groups)
        .map(|_| {
            let mut s = String::new();
            words(rng, args.shared_prefix_len, &mut s);
            s
        })
        .collect()
}

/// One random prompt (or user message), optionally after a shared prefix.
fn draw(args: &BenchArgs, rng: &mut SeededRng, prefix: Option<&str>) -> Spec {
    let input = match args.input_len_range {
        Some((lo, hi)) => rng.range(lo, hi),
        None => args.input_len.max(1),
    };
    let max_tokens = match args.output_len_range {
        Some((lo, hi)) => rng.range(lo, hi),
        None => args.output_len.max(1),
    };
    let mut prompt = String::new();
    let mut new_words = input;
    let mut input_words = input;
    if let Some(p) = prefix {
        prompt.push_str(p);
        new_words = input.saturating_sub(args.shared_prefix_len).max(1);
        input_words = args.shared_prefix_len + new_words;
    }
    words(rng, new_words, &mut prompt);
    Spec {
        prompt,
        input_words,
        max_tokens,
        ..Spec::default()
    }
}

fn make_specs(args: &BenchArgs) -> Vec<Spec> {
    let mut rng = SeededRng::new(args.seed);
    let prefixes = shared_prefixes(args, &mut rng);
    (0..args.num_requests)
        .map(|i| {
            let prefix = (!prefixes.is_empty()).then(|| prefixes[i % prefixes.len()].as_str());
            draw(args, &mut rng, prefix)
        })
        .collect()
}

/// The user messages of `sessions` sessions of `turns` turns (session i's
/// first message starts with shared prefix i % G). `point` salts the seed so
/// each sweep point gets fresh conversations: replaying the same ones would
/// find the previous point's blocks still cached and overstate retention.
fn make_sessions(args: &BenchArgs, sessions: usize, turns: usize, point: usize) -> Vec<Vec<Spec>> {
    let mut rng = SeededRng::new(args.seed ^ (point as u64).wrapping_mul(0xD1B5_4A32_D192_ED03));
    let prefixes = shared_prefixes(args, &mut rng);
    (0..sessions)
        .map(|i| {
            (0..turns)
                .map(|k| {
                    let prefix = (k == 0 && !prefixes.is_empty())
                        .then(|| prefixes[i % prefixes.len()].as_str());
                    draw(args, &mut rng, prefix)
                })
                .collect()
        })
        .collect()
}

const SKIPPED: &str = "skipped: an earlier turn of its session failed";

/// A multi-turn session as it runs: its conversation so far.
#[derive(Debug)]
struct Session {
    /// The user messages (and max_tokens) of all turns.
    turns: Vec<Spec>,
    /// Index of the next turn to send.
    next: usize,
    history: Vec<Msg>,
    /// Estimated tokens of the history, when the server reports no usage.
    history_words: usize,
    carryable: Option<u64>,
    failed: bool,
}

impl Session {
    fn new(turns: Vec<Spec>) -> Self {
        Session {
            turns,
            next: 0,
            history: Vec::new(),
            history_words: 0,
            carryable: None,
            failed: false,
        }
    }

    fn pending(&self) -> bool {
        !self.failed && self.next < self.turns.len()
    }

    /// The request of the next turn: the whole history plus its message.
    fn next_spec(&self) -> Spec {
        let mut s = self.turns[self.next].clone();
        s.input_words += self.history_words;
        s.history = self.history.clone();
        s.turn = self.next + 1;
        s.carryable = self.carryable;
        s
    }

    /// Records the outcome of the turn sent last (taking its answer text).
    fn finish(&mut self, o: &mut Outcome, block_size: usize) {
        let user = self.turns[self.next].prompt.clone();
        self.next += 1;
        if !o.ok {
            self.failed = true;
            return;
        }
        self.history.push(Msg {
            role: Role::User,
            content: user,
        });
        self.history.push(Msg {
            role: Role::Assistant,
            content: std::mem::take(&mut o.text),
        });
        self.history_words =
            o.prompt_tokens.map_or(o.input_words, |p| p as usize) + o.output_tokens as usize;
        self.carryable = carryable(o.prompt_tokens, o.output_tokens, block_size);
    }

    /// Error outcomes for the turns a failure left unsent.
    fn skip_rest(&mut self) -> Vec<Outcome> {
        let skipped = (self.next..self.turns.len())
            .map(|k| Outcome {
                turn: k + 1,
                error: Some(SKIPPED.into()),
                ..Outcome::default()
            })
            .collect();
        self.next = self.turns.len();
        skipped
    }
}

/// The prefix a turn can leave in the KV cache for the next one: its prompt
/// and completion, in whole blocks (unknown without the server's usage).
fn carryable(prompt_tokens: Option<u64>, completion_tokens: u64, block_size: usize) -> Option<u64> {
    let b = block_size.max(1) as u64;
    prompt_tokens.map(|p| (p + completion_tokens) / b * b)
}

// --- HTTP and SSE -----------------------------------------------------------------

/// What one streamed chunk says.
#[derive(Debug, Default, PartialEq)]
struct Chunk {
    /// Non-empty generated text (or reasoning) in this chunk: token-bearing.
    content: bool,
    /// Non-empty reasoning in this chunk.
    reasoning: bool,
    /// The answer text (reasoning left out, as chat clients do in history).
    text: String,
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    cached_tokens: Option<u64>,
    error: Option<String>,
    done: bool,
}

fn parse_event(data: &str) -> Chunk {
    let data = data.trim();
    if data == "[DONE]" {
        return Chunk {
            done: true,
            ..Chunk::default()
        };
    }
    let v: Value = match serde_json::from_str(data) {
        Ok(v) => v,
        Err(e) => {
            return Chunk {
                error: Some(format!("bad event JSON: {e}")),
                ..Chunk::default()
            };
        }
    };
    let mut c = Chunk::default();
    if let Some(err) = v.get("error") {
        c.error = Some(
            err.get("message")
                .and_then(Value::as_str)
                .map_or_else(|| err.to_string(), str::to_owned),
        );
    }
    if let Some(choices) = v.get("choices").and_then(Value::as_array) {
        for ch in choices {
            let s = |p: &str| ch.pointer(p).and_then(Value::as_str).unwrap_or("");
            // `reasoning` is tandem's (and current vLLM's) field,
            // `reasoning_content` older vLLM's and DeepSeek's.
            let (content, text) = (s("/delta/content"), s("/text"));
            let reasoning =
                !s("/delta/reasoning").is_empty() || !s("/delta/reasoning_content").is_empty();
            c.reasoning |= reasoning;
            c.content |= reasoning || !content.is_empty() || !text.is_empty();
            c.text.push_str(content);
            c.text.push_str(text);
        }
    }
    if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
        c.prompt_tokens = u.get("prompt_tokens").and_then(Value::as_u64);
        c.completion_tokens = u.get("completion_tokens").and_then(Value::as_u64);
        c.cached_tokens = u
            .pointer("/prompt_tokens_details/cached_tokens")
            .and_then(Value::as_u64);
    }
    c
}

/// The base URL of the server: `--url` without trailing slashes and without
/// a `/v1` suffix (so both `http://h:p` and `http://h:p/v1` work).
fn parse_url(url: &str) -> Result<String> {
    let u = reqwest::Url::parse(url).with_context(|| format!("--url {url}"))?;
    if u.scheme() != "http" {
        bail!("--url must start with http:// (no TLS): {url}");
    }
    let path = u.path().trim_end_matches('/');
    let path = path.strip_suffix("/v1").unwrap_or(path).to_string();
    let mut base = u;
    base.set_path(&path);
    base.set_query(None);
    base.set_fragment(None);
    Ok(base.as_str().trim_end_matches('/').to_string())
}

/// The client of every request: HTTP/1.1, by default a fresh connection per
/// request (`Connection: close` and no idle pool: every simulated user pays
/// its own connect, and no request waits for another's connection), with
/// `keep_alive` pooled connections; TCP_NODELAY, no proxy, no redirects.
fn http_client(keep_alive: bool) -> Result<reqwest::Client> {
    let mut headers = HeaderMap::new();
    if !keep_alive {
        headers.insert(CONNECTION, HeaderValue::from_static("close"));
    }
    reqwest::Client::builder()
        .default_headers(headers)
        .pool_max_idle_per_host(if keep_alive { usize::MAX } else { 0 })
        .tcp_nodelay(true)
        .no_proxy()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .context("building the HTTP client")
}

async fn default_model(client: &reqwest::Client, base: &str) -> Result<String> {
    let r = client
        .get(format!("{base}/v1/models"))
        .send()
        .await
        .context("GET /v1/models")?;
    let status = r.status();
    let body = r.text().await.context("GET /v1/models")?;
    if status != StatusCode::OK {
        bail!("GET /v1/models: HTTP {}: {body}", status.as_u16());
    }
    let v: Value = serde_json::from_str(&body).context("GET /v1/models: not JSON")?;
    v.pointer("/data/0/id")
        .and_then(Value::as_str)
        .map(str::to_owned)
        .ok_or_else(|| anyhow!("GET /v1/models lists no model"))
}

/// An error of the event stream, with the transport error's causes kept.
fn stream_error(e: EventStreamError<reqwest::Error>) -> anyhow::Error {
    match e {
        EventStreamError::Transport(e) => anyhow::Error::new(e).context("reading the stream"),
        e => anyhow!("reading the stream: {e}"),
    }
}

// --- one request ------------------------------------------------------------------

#[derive(Debug, Clone, Default)]
struct Outcome {
    ok: bool,
    error: Option<String>,
    /// Seconds since the request was sent.
    ttft: Option<f64>,
    e2e: f64,
    /// Gaps between token-bearing deltas, seconds.
    itl: Vec<f64>,
    output_tokens: u64,
    /// Chunks with non-empty reasoning.
    reasoning_deltas: u64,
    prompt_tokens: Option<u64>,
    input_words: usize,
    /// As in `Spec`.
    turn: usize,
    carryable: Option<u64>,
    /// Prompt tokens the server says it took from its prefix cache.
    cached_tokens: Option<u64>,
    /// The streamed answer (kept for multi-turn requests only).
    text: String,
}

impl Outcome {
    fn tpot(&self) -> Option<f64> {
        let ttft = self.ttft?;
        (self.output_tokens > 1).then(|| (self.e2e - ttft) / (self.output_tokens - 1) as f64)
    }
}

#[derive(Debug)]
struct Shared {
    client: reqwest::Client,
    /// Where requests go: the base URL and `path`.
    url: String,
    path: &'static str,
    model: String,
    endpoint: Endpoint,
    temperature: f64,
    ignore_eos: bool,
    timeout: Duration,
}

fn request_body(sh: &Shared, spec: &Spec) -> String {
    let mut body = json!({
        "model": sh.model,
        "max_tokens": spec.max_tokens,
        "temperature": sh.temperature,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    match sh.endpoint {
        Endpoint::Chat => {
            let msg = |role: &str, content: &str| json!({"role": role, "content": content});
            let mut messages: Vec<Value> = spec
                .history
                .iter()
                .map(|m| match m.role {
                    Role::User => msg("user", &m.content),
                    Role::Assistant => msg("assistant", &m.content),
                })
                .collect();
            messages.push(msg("user", &spec.prompt));
            body["messages"] = Value::Array(messages);
        }
        Endpoint::Completions => body["prompt"] = json!(spec.prompt),
    }
    if sh.ignore_eos {
        body["ignore_eos"] = json!(true);
    }
    body.to_string()
}

async fn run_one(sh: &Shared, spec: &Spec) -> Outcome {
    let start = Instant::now();
    let mut o = Outcome {
        input_words: spec.input_words,
        turn: spec.turn,
        carryable: spec.carryable,
        ..Outcome::default()
    };
    let r = tokio::time::timeout(sh.timeout, stream_one(sh, spec, start, &mut o)).await;
    o.e2e = start.elapsed().as_secs_f64();
    let err = match r {
        Ok(Ok(())) => o.error.take(),
        Ok(Err(e)) => Some(format!("{e:#}")),
        Err(_) => Some(format!("timed out after {:?}", sh.timeout)),
    };
    o.ok = err.is_none();
    o.error = err;
    o
}

async fn stream_one(sh: &Shared, spec: &Spec, start: Instant, o: &mut Outcome) -> Result<()> {
    let resp = sh
        .client
        .post(&sh.url)
        .header(CONTENT_TYPE, "application/json")
        .header(ACCEPT, "text/event-stream")
        .body(request_body(sh, spec))
        .send()
        .await?;
    let status = resp.status();
    if status != StatusCode::OK {
        let body = resp.text().await.unwrap_or_default();
        bail!("HTTP {}: {}", status.as_u16(), body.trim());
    }
    // When the body bytes last read arrived (ns since `start`). The event
    // parser reads more only once it has no complete event left, so an
    // event it yields was completed by those bytes: this is the time the
    // event arrived, as precise as the read, whatever the parsing costs.
    let arrived = AtomicU64::new(0);
    let mut events = resp
        .bytes_stream()
        .inspect(|_| {
            let ns = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
            arrived.store(ns, Ordering::Relaxed);
        })
        .eventsource();
    let mut deltas = 0u64;
    let mut last: Option<Duration> = None;
    let mut done = false;
    while !done && let Some(ev) = events.next().await {
        let ev = ev.map_err(stream_error)?;
        let at = Duration::from_nanos(arrived.load(Ordering::Relaxed));
        let c = parse_event(&ev.data);
        if let Some(e) = c.error {
            o.error.get_or_insert(e);
        }
        if spec.turn > 0 {
            o.text.push_str(&c.text);
        }
        if c.content {
            deltas += 1;
            match last {
                None => o.ttft = Some(at.as_secs_f64()),
                Some(prev) => o.itl.push((at - prev).as_secs_f64()),
            }
            last = Some(at);
        }
        if c.reasoning {
            o.reasoning_deltas += 1;
        }
        if c.completion_tokens.is_some() {
            o.completion_tokens_from_usage(c.completion_tokens, c.prompt_tokens);
        }
        if c.cached_tokens.is_some() {
            o.cached_tokens = c.cached_tokens;
        }
        done |= c.done;
    }
    if o.output_tokens == 0 {
        o.output_tokens = deltas;
    }
    if !done && o.error.is_none() {
        bail!("stream ended without [DONE]");
    }
    if o.ttft.is_none() && o.error.is_none() {
        bail!("no content in the response");
    }
    Ok(())
}

impl Outcome {
    fn completion_tokens_from_usage(&mut self, completion: Option<u64>, prompt: Option<u64>) {
        if let Some(n) = completion {
            self.output_tokens = n;
        }
        if prompt.is_some() {
            self.prompt_tokens = prompt;
        }
    }
}

// --- statistics -------------------------------------------------------------------

/// Percentile `p` (0..=100) of sorted values, linearly interpolated (numpy's
/// default).
fn percentile(sorted: &[f64], p: f64) -> f64 {
    match sorted.len() {
        0 => f64::NAN,
        1 => sorted[0],
        n => {
            let rank = p.clamp(0.0, 100.0) / 100.0 * (n - 1) as f64;
            let lo = rank.floor() as usize;
            let hi = (lo + 1).min(n - 1);
            sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct Summary {
    mean: f64,
    p50: f64,
    p90: f64,
    p99: f64,
    max: f64,
    n: usize,
}

fn summarize(mut v: Vec<f64>) -> Summary {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let mean = if n == 0 {
        f64::NAN
    } else {
        v.iter().sum::<f64>() / n as f64
    };
    Summary {
        mean,
        p50: percentile(&v, 50.0),
        p90: percentile(&v, 90.0),
        p99: percentile(&v, 99.0),
        max: v.last().copied().unwrap_or(f64::NAN),
        n,
    }
}

impl Summary {
    /// In milliseconds, as JSON (NaN becomes null).
    fn json_ms(&self) -> Value {
        let ms = |x: f64| {
            if x.is_finite() {
                json!(x * 1e3)
            } else {
                Value::Null
            }
        };
        json!({
            "mean_ms": ms(self.mean), "p50_ms": ms(self.p50), "p90_ms": ms(self.p90),
            "p99_ms": ms(self.p99), "max_ms": ms(self.max), "count": self.n,
        })
    }
}

/// Whether a successful request meets the SLOs (an unmeasurable TPOT, for a
/// one-token output, does not count against it).
fn meets(o: &Outcome, slo: &Slo) -> bool {
    if !o.ok {
        return false;
    }
    let ok = |v: Option<f64>, lim: Option<f64>| match (v, lim) {
        (_, None) | (None, Some(_)) => true,
        (Some(v), Some(l)) => v * 1e3 <= l,
    };
    ok(o.ttft, slo.ttft_ms) && ok(o.tpot(), slo.tpot_ms) && ok(Some(o.e2e), slo.e2e_ms)
}

#[derive(Debug)]
struct Report {
    label: String,
    concurrency: Option<usize>,
    request_rate: Option<f64>,
    duration: f64,
    completed: usize,
    errors: usize,
    first_errors: Vec<String>,
    prompt_tokens: u64,
    prompt_tokens_from_usage: bool,
    output_tokens: u64,
    /// Token-bearing chunks that carried reasoning.
    reasoning_deltas: u64,
    ttft: Summary,
    tpot: Summary,
    itl: Summary,
    e2e: Summary,
    good: Option<usize>,
    multi_turn: Option<MultiTurn>,
}

fn aggregate(
    label: String,
    concurrency: Option<usize>,
    request_rate: Option<f64>,
    duration: f64,
    outs: &[Outcome],
    slo: Option<&Slo>,
) -> Report {
    let ok: Vec<&Outcome> = outs.iter().filter(|o| o.ok).collect();
    let mut first_errors: Vec<String> = Vec::new();
    for o in outs.iter().filter(|o| !o.ok) {
        if let Some(e) = &o.error
            && first_errors.len() < 5
            && !first_errors.contains(e)
        {
            first_errors.push(e.clone());
        }
    }
    let prompt_tokens_from_usage = ok.iter().all(|o| o.prompt_tokens.is_some());
    Report {
        label,
        concurrency,
        request_rate,
        duration,
        completed: ok.len(),
        errors: outs.len() - ok.len(),
        first_errors,
        prompt_tokens: ok
            .iter()
            .map(|o| o.prompt_tokens.unwrap_or(o.input_words as u64))
            .sum(),
        prompt_tokens_from_usage,
        output_tokens: ok.iter().map(|o| o.output_tokens).sum(),
        reasoning_deltas: ok.iter().map(|o| o.reasoning_deltas).sum(),
        ttft: summarize(ok.iter().filter_map(|o| o.ttft).collect()),
        tpot: summarize(ok.iter().filter_map(|o| o.tpot()).collect()),
        itl: summarize(ok.iter().flat_map(|o| o.itl.iter().copied()).collect()),
        e2e: summarize(ok.iter().map(|o| o.e2e).collect()),
        good: slo.map(|s| ok.iter().filter(|o| meets(o, s)).count()),
        multi_turn: None,
    }
}

/// Per-turn statistics of a multi-turn run.
#[derive(Debug, Clone, PartialEq)]
struct TurnStats {
    turn: usize,
    completed: usize,
    errors: usize,
    /// Means over the completed requests that know them; None is n/a.
    cached: Option<f64>,
    carryable: Option<f64>,
    /// Mean of cached / carryable over requests with both (carryable > 0).
    retention: Option<f64>,
    retention_n: usize,
    ttft: Summary,
    tpot: Summary,
    e2e: Summary,
}

#[derive(Debug, Clone, PartialEq)]
struct MultiTurn {
    sessions: usize,
    turns: usize,
    block_size: usize,
    per_turn: Vec<TurnStats>,
    /// Mean retention over all requests of turns 2+ that have one.
    retention: Option<f64>,
    retention_n: usize,
}

/// Retention of one request: None when the server reported no cached
/// tokens, the previous turn no usage, or nothing whole-block was carryable.
fn retention(o: &Outcome) -> Option<f64> {
    match (o.cached_tokens, o.carryable) {
        (Some(c), Some(k)) if k > 0 => Some(c as f64 / k as f64),
        _ => None,
    }
}

fn mean(v: impl IntoIterator<Item = f64>) -> Option<f64> {
    let (n, sum) = v
        .into_iter()
        .fold((0usize, 0.0), |(n, s), x| (n + 1, s + x));
    (n > 0).then(|| sum / n as f64)
}

fn multi_turn_stats(
    sessions: usize,
    turns: usize,
    block_size: usize,
    outs: &[Outcome],
) -> MultiTurn {
    let per_turn = (1..=turns)
        .map(|t| {
            let all = || outs.iter().filter(move |o| o.turn == t);
            let ok: Vec<&Outcome> = all().filter(|o| o.ok).collect();
            let ratios: Vec<f64> = ok.iter().filter_map(|o| retention(o)).collect();
            TurnStats {
                turn: t,
                completed: ok.len(),
                errors: all().count() - ok.len(),
                cached: mean(ok.iter().filter_map(|o| o.cached_tokens).map(|x| x as f64)),
                carryable: mean(ok.iter().filter_map(|o| o.carryable).map(|x| x as f64)),
                retention: mean(ratios.iter().copied()),
                retention_n: ratios.len(),
                ttft: summarize(ok.iter().filter_map(|o| o.ttft).collect()),
                tpot: summarize(ok.iter().filter_map(|o| o.tpot()).collect()),
                e2e: summarize(ok.iter().map(|o| o.e2e).collect()),
            }
        })
        .collect();
    let ratios: Vec<f64> = outs
        .iter()
        .filter(|o| o.ok && o.turn > 1)
        .filter_map(retention)
        .collect();
    MultiTurn {
        sessions,
        turns,
        block_size,
        per_turn,
        retention: mean(ratios.iter().copied()),
        retention_n: ratios.len(),
    }
}

fn fmt_opt(x: Option<f64>, prec: usize) -> String {
    x.map_or_else(|| "n/a".into(), |x| format!("{x:.prec$}"))
}

impl MultiTurn {
    fn text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "multi-turn: {} sessions x {} turns; retention = server-cached / carryable \
             (previous prompt + completion in whole {}-token blocks)",
            self.sessions, self.turns, self.block_size
        );
        let _ = writeln!(
            s,
            "{:<5} {:>4} {:>4} {:>8} {:>9} {:>9} {:>10} {:>10} {:>10} {:>10}",
            "turn",
            "ok",
            "err",
            "cached",
            "carryable",
            "retention",
            "TTFT mean",
            "TTFT p50",
            "TPOT mean",
            "E2E mean"
        );
        for t in &self.per_turn {
            let ms = |x: f64| {
                if x.is_finite() {
                    format!("{:.2}", x * 1e3)
                } else {
                    "n/a".into()
                }
            };
            let _ = writeln!(
                s,
                "{:<5} {:>4} {:>4} {:>8} {:>9} {:>9} {:>10} {:>10} {:>10} {:>10}",
                t.turn,
                t.completed,
                t.errors,
                fmt_opt(t.cached, 1),
                if t.turn == 1 {
                    "-".into()
                } else {
                    fmt_opt(t.carryable, 1)
                },
                if t.turn == 1 {
                    "-".into()
                } else {
                    fmt_opt(t.retention, 3)
                },
                ms(t.ttft.mean),
                ms(t.ttft.p50),
                ms(t.tpot.mean),
                ms(t.e2e.mean)
            );
        }
        let _ = writeln!(
            s,
            "KV retention (turns 2+): {} over {} requests",
            fmt_opt(self.retention, 3),
            self.retention_n
        );
        s
    }

    fn json(&self) -> Value {
        let num = |x: Option<f64>| {
            x.filter(|x| x.is_finite())
                .map_or(Value::Null, |x| json!(x))
        };
        json!({
            "sessions": self.sessions,
            "turns": self.turns,
            "kv_block_size": self.block_size,
            "retention": num(self.retention),
            "retention_requests": self.retention_n,
            "per_turn": self.per_turn.iter().map(|t| json!({
                "turn": t.turn,
                "completed": t.completed,
                "errors": t.errors,
                "cached_tokens_mean": num(t.cached),
                "carryable_tokens_mean": num(t.carryable),
                "retention": num(t.retention),
                "retention_requests": t.retention_n,
                "ttft": t.ttft.json_ms(),
                "tpot": t.tpot.json_ms(),
                "e2e": t.e2e.json_ms(),
            })).collect::<Vec<_>>(),
        })
    }
}

impl Report {
    fn per_s(&self, x: f64) -> f64 {
        if self.duration > 0.0 {
            x / self.duration
        } else {
            f64::NAN
        }
    }

    fn text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "==== {} ====", self.label);
        let _ = writeln!(
            s,
            "requests: {} ok, {} errors in {:.2} s",
            self.completed, self.errors, self.duration
        );
        for e in &self.first_errors {
            let _ = writeln!(s, "  error: {e}");
        }
        let _ = writeln!(
            s,
            "tokens: {} prompt{}, {} output",
            self.prompt_tokens,
            if self.prompt_tokens_from_usage {
                ""
            } else {
                " (estimated)"
            },
            self.output_tokens
        );
        let _ = writeln!(s, "reasoning deltas: {}", self.reasoning_deltas);
        let _ = writeln!(
            s,
            "throughput: {:.2} req/s, {:.1} output tok/s, {:.1} total tok/s",
            self.per_s(self.completed as f64),
            self.per_s(self.output_tokens as f64),
            self.per_s((self.prompt_tokens + self.output_tokens) as f64)
        );
        if let Some(g) = self.good {
            let _ = writeln!(
                s,
                "goodput: {:.2} req/s ({g} of {} requests meet the SLOs)",
                self.per_s(g as f64),
                self.completed + self.errors
            );
        }
        let _ = writeln!(
            s,
            "{:<6} {:>10} {:>10} {:>10} {:>10} {:>10}",
            "(ms)", "mean", "p50", "p90", "p99", "max"
        );
        for (name, m) in [
            ("TTFT", &self.ttft),
            ("TPOT", &self.tpot),
            ("ITL", &self.itl),
            ("E2E", &self.e2e),
        ] {
            let _ = writeln!(
                s,
                "{name:<6} {:>10.2} {:>10.2} {:>10.2} {:>10.2} {:>10.2}",
                m.mean * 1e3,
                m.p50 * 1e3,
                m.p90 * 1e3,
                m.p99 * 1e3,
                m.max * 1e3
            );
        }
        if let Some(mt) = &self.multi_turn {
            s.push_str(&mt.text());
        }
        s
    }

    fn json(&self) -> Value {
        let num = |x: f64| if x.is_finite() { json!(x) } else { Value::Null };
        json!({
            "label": self.label,
            "concurrency": self.concurrency,
            "request_rate": self.request_rate,
            "duration_s": self.duration,
            "completed": self.completed,
            "errors": self.errors,
            "error_samples": self.first_errors,
            "prompt_tokens": self.prompt_tokens,
            "prompt_tokens_from_usage": self.prompt_tokens_from_usage,
            "output_tokens": self.output_tokens,
            "reasoning_deltas": self.reasoning_deltas,
            "request_throughput": num(self.per_s(self.completed as f64)),
            "output_throughput": num(self.per_s(self.output_tokens as f64)),
            "total_token_throughput":
                num(self.per_s((self.prompt_tokens + self.output_tokens) as f64)),
            "goodput": self.good.map(|g| num(self.per_s(g as f64))),
            "good_requests": self.good,
            "ttft": self.ttft.json_ms(),
            "tpot": self.tpot.json_ms(),
            "itl": self.itl.json_ms(),
            "e2e": self.e2e.json_ms(),
            "multi_turn": self.multi_turn.as_ref().map(MultiTurn::json),
        })
    }
}

// --- driver -------------------------------------------------------------------------

async fn run_point(
    sh: Arc<Shared>,
    specs: &[Spec],
    concurrency: Option<usize>,
    rate: Option<f64>,
    seed: u64,
    quiet: bool,
) -> (f64, Vec<Outcome>) {
    let total = specs.len();
    let sem = concurrency.map(|c| Arc::new(Semaphore::new(c.max(1))));
    let done = Arc::new(AtomicUsize::new(0));
    let errors = Arc::new(AtomicUsize::new(0));
    let mut arrivals = SeededRng::new(seed ^ 0xA5A5_5A5A_DEAD_BEEF);
    let start = Instant::now();
    let mut next_at = 0.0f64;
    let mut handles = Vec::with_capacity(total);
    let progress = move |done: usize, errors: usize| {
        if !quiet {
            eprint!("\r  {done}/{total} done, {errors} errors ");
        }
    };
    progress(0, 0);
    for spec in specs {
        if let Some(r) = rate {
            tokio::time::sleep_until((start + Duration::from_secs_f64(next_at)).into()).await;
            next_at += next_arrival(&mut arrivals, r);
        }
        let permit = match &sem {
            Some(sem) => Some(Arc::clone(sem).acquire_owned().await),
            None => None,
        };
        let spec = spec.clone();
        let sh = Arc::clone(&sh);
        let (done, errors) = (Arc::clone(&done), Arc::clone(&errors));
        handles.push(tokio::spawn(async move {
            let o = run_one(&sh, &spec).await;
            drop(permit);
            let e = errors.fetch_add(usize::from(!o.ok), Ordering::Relaxed) + usize::from(!o.ok);
            let d = done.fetch_add(1, Ordering::Relaxed) + 1;
            progress(d, e);
            o
        }));
    }
    let mut outs = Vec::with_capacity(total);
    for h in handles {
        outs.push(h.await.unwrap_or_else(|e| Outcome {
            error: Some(format!("task failed: {e}")),
            ..Outcome::default()
        }));
    }
    let dur = start.elapsed().as_secs_f64();
    if !quiet {
        eprintln!();
    }
    (dur, outs)
}

/// Sends a turn's outcome to the session driver when dropped, so that a
/// panicking turn is reported as failed instead of hanging the driver.
struct TurnDone {
    /// None once sent.
    tx: Option<tokio::sync::mpsc::UnboundedSender<(usize, Outcome)>>,
    session: usize,
    turn: usize,
}

impl TurnDone {
    fn send(&mut self, o: Outcome) {
        // The driver waits for every turn, so its receiver is still open.
        if let Some(tx) = self.tx.take() {
            let _ = tx.send((self.session, o));
        }
    }
}

impl Drop for TurnDone {
    fn drop(&mut self) {
        self.send(Outcome {
            turn: self.turn,
            error: Some("task failed".into()),
            ..Outcome::default()
        });
    }
}

/// Runs multi-turn sessions (see the module doc for the schedule);
/// `run_turn` sends one request.
async fn run_sessions<F, Fut>(
    sessions: Vec<Vec<Spec>>,
    concurrency: Option<usize>,
    rate: Option<f64>,
    seed: u64,
    block_size: usize,
    quiet: bool,
    run_turn: F,
) -> (f64, Vec<Outcome>)
where
    F: Fn(Spec) -> Fut,
    Fut: Future<Output = Outcome> + Send + 'static,
{
    let total: usize = sessions.iter().map(Vec::len).sum();
    let mut state: Vec<Session> = sessions.into_iter().map(Session::new).collect();
    let mut ready: VecDeque<usize> = (0..state.len()).filter(|&i| state[i].pending()).collect();
    let sem = concurrency.map(|c| Arc::new(Semaphore::new(c.max(1))));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(usize, Outcome)>();
    let done = Arc::new(AtomicUsize::new(0));
    let errors = Arc::new(AtomicUsize::new(0));
    let mut arrivals = SeededRng::new(seed ^ 0xA5A5_5A5A_DEAD_BEEF);
    let start = Instant::now();
    let mut next_at = 0.0f64;
    let mut in_flight = 0usize;
    let mut outs = Vec::with_capacity(total);
    let progress = move |done: usize, errors: usize| {
        if !quiet {
            eprint!("\r  {done}/{total} done, {errors} errors ");
        }
    };
    progress(0, 0);
    loop {
        // Take in finished turns; block for one only when no turn is ready.
        loop {
            let msg = if ready.is_empty() && in_flight > 0 {
                rx.recv().await
            } else {
                rx.try_recv().ok()
            };
            let Some((i, mut o)) = msg else {
                break;
            };
            in_flight -= 1;
            let s = &mut state[i];
            s.finish(&mut o, block_size);
            outs.push(o);
            if s.pending() {
                ready.push_back(i);
            } else if s.failed {
                let skipped = s.skip_rest();
                let n = skipped.len();
                outs.extend(skipped);
                progress(
                    done.fetch_add(n, Ordering::Relaxed) + n,
                    errors.fetch_add(n, Ordering::Relaxed) + n,
                );
            }
        }
        if ready.is_empty() {
            break; // and nothing in flight
        }
        if let Some(r) = rate {
            tokio::time::sleep_until((start + Duration::from_secs_f64(next_at)).into()).await;
            next_at += next_arrival(&mut arrivals, r);
        }
        let permit = match &sem {
            Some(sem) => Some(Arc::clone(sem).acquire_owned().await),
            None => None,
        };
        let Some(i) = ready.pop_front() else {
            break;
        };
        let spec = state[i].next_spec();
        let mut reply = TurnDone {
            tx: Some(tx.clone()),
            session: i,
            turn: spec.turn,
        };
        let turn = run_turn(spec);
        in_flight += 1;
        let (done, errors) = (Arc::clone(&done), Arc::clone(&errors));
        tokio::spawn(async move {
            let o = turn.await;
            drop(permit);
            let e = errors.fetch_add(usize::from(!o.ok), Ordering::Relaxed) + usize::from(!o.ok);
            let d = done.fetch_add(1, Ordering::Relaxed) + 1;
            progress(d, e);
            reply.send(o);
        });
    }
    let dur = start.elapsed().as_secs_f64();
    if !quiet {
        eprintln!();
    }
    (dur, outs)
}

/// Flag checks clap does not do.
fn check_args(args: &BenchArgs) -> Result<()> {
    if args.num_requests == 0 {
        bail!("--num-requests must be at least 1");
    }
    match (args.multi_turn_sessions, args.turns) {
        (Some(0), _) => bail!("--multi-turn-sessions must be at least 1"),
        (_, Some(0)) => bail!("--turns must be at least 1"),
        (Some(_), None) => bail!("--multi-turn-sessions needs --turns"),
        (None, Some(_)) => bail!("--turns needs --multi-turn-sessions"),
        (Some(_), Some(_)) if args.endpoint != Endpoint::Chat => {
            bail!("multi-turn sessions need --endpoint chat")
        }
        _ => {}
    }
    if args.kv_block_size == 0 {
        bail!("--kv-block-size must be at least 1");
    }
    if let Some(r) = args.request_rate
        && !(r > 0.0 && r.is_finite())
    {
        bail!("--request-rate must be positive");
    }
    if args.concurrency == Some(0) || args.sweep_concurrency.contains(&0) {
        bail!("concurrency must be at least 1");
    }
    if args.shared_prefix_groups > 0 && args.shared_prefix_len == 0 {
        bail!("--shared-prefix-groups needs --shared-prefix-len");
    }
    Ok(())
}

pub fn run(args: BenchArgs) -> Result<()> {
    check_args(&args)?;
    let multi_turn = args.multi_turn_sessions.zip(args.turns);
    let base = parse_url(&args.url)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let client = http_client(args.keep_alive)?;
        let model = match &args.model {
            Some(m) => m.clone(),
            None => default_model(&client, &base)
                .await
                .context("finding the model name (or pass --model)")?,
        };
        let path = match args.endpoint {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
        };
        let sh = Arc::new(Shared {
            client,
            url: format!("{base}{path}"),
            path,
            model: model.clone(),
            endpoint: args.endpoint,
            temperature: args.temperature,
            ignore_eos: args.ignore_eos,
            timeout: Duration::from_secs(args.timeout.max(1)),
        });
        let specs = if multi_turn.is_none() {
            make_specs(&args)
        } else {
            Vec::new()
        };
        let num_requests = multi_turn.map_or(specs.len(), |(n, t)| n * t);
        let points: Vec<Option<usize>> = if args.sweep_concurrency.is_empty() {
            vec![match args.request_rate {
                Some(_) => args.concurrency,
                None => Some(args.concurrency.unwrap_or(8)),
            }]
        } else {
            args.sweep_concurrency.iter().map(|&c| Some(c)).collect()
        };
        let per_point = match multi_turn {
            Some((n, t)) => format!("{n} sessions x {t} turns ({num_requests} requests)"),
            None => format!("{num_requests} requests"),
        };
        eprintln!(
            "tandem bench: {} ({model}), {per_point} per point",
            args.url
        );
        let mut reports = Vec::new();
        for (point, c) in points.into_iter().enumerate() {
            let label = match (c, args.request_rate) {
                (Some(c), Some(r)) => format!("rate {r} req/s, concurrency <= {c}"),
                (None, Some(r)) => format!("rate {r} req/s"),
                (Some(c), None) => format!("concurrency {c}"),
                (None, None) => "unbounded".to_string(),
            };
            if !args.quiet {
                eprintln!("{label}:");
            }
            let (dur, outs) = match multi_turn {
                None => {
                    run_point(
                        Arc::clone(&sh),
                        &specs,
                        c,
                        args.request_rate,
                        args.seed,
                        args.quiet,
                    )
                    .await
                }
                Some((n, t)) => {
                    let sh = Arc::clone(&sh);
                    let run_turn = move |spec: Spec| {
                        let sh = Arc::clone(&sh);
                        async move { run_one(&sh, &spec).await }
                    };
                    run_sessions(
                        make_sessions(&args, n, t, point),
                        c,
                        args.request_rate,
                        args.seed,
                        args.kv_block_size,
                        args.quiet,
                        run_turn,
                    )
                    .await
                }
            };
            let mut r = aggregate(
                label,
                c,
                args.request_rate,
                dur,
                &outs,
                args.goodput.as_ref(),
            );
            if let Some((n, t)) = multi_turn {
                r.multi_turn = Some(multi_turn_stats(n, t, args.kv_block_size, &outs));
            }
            print!("{}", r.text());
            reports.push(r);
        }
        if let Some(path) = &args.json {
            let slo = args
                .goodput
                .map(|s| json!({"ttft_ms": s.ttft_ms, "tpot_ms": s.tpot_ms, "e2e_ms": s.e2e_ms}));
            let v = json!({
                "url": args.url,
                "model": model,
                "endpoint": sh.path,
                "num_requests": num_requests,
                "multi_turn_sessions": args.multi_turn_sessions,
                "turns": args.turns,
                "kv_block_size": args.kv_block_size,
                "input_len": args.input_len,
                "input_len_range": args.input_len_range.map(|(a, b)| [a, b]),
                "output_len": args.output_len,
                "output_len_range": args.output_len_range.map(|(a, b)| [a, b]),
                "shared_prefix_groups": args.shared_prefix_groups,
                "shared_prefix_len": args.shared_prefix_len,
                "seed": args.seed,
                "temperature": args.temperature,
                "ignore_eos": args.ignore_eos,
                "goodput_slo": slo,
                "results": reports.iter().map(Report::json).collect::<Vec<_>>(),
            });
            std::fs::write(path, serde_json::to_string_pretty(&v)? + "\n")
                .with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(())
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
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
        let answer = move |ConnectInfo(peer): ConnectInfo<std::net::SocketAddr>,
                           headers: HeaderMap| {
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
    const THINK: Option<&str> =
        Some("data: {\"choices\":[{\"delta\":{\"reasoning\":\"hm\"}}]}\n\n");

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
}
