//! One request: its body, the streamed answer timed as it arrives (TTFT,
//! ITL, end to end) and its outcome.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use reqwest::StatusCode;
use reqwest::header::{ACCEPT, CONTENT_TYPE};
use serde_json::{Value, json};

use super::args::Endpoint;
use super::client::{parse_event, stream_error};
use super::prompts::{Role, Spec};

#[derive(Debug, Clone, Default)]
pub(super) struct Outcome {
    pub(super) ok: bool,
    pub(super) error: Option<String>,
    /// Seconds since the request was sent.
    pub(super) ttft: Option<f64>,
    pub(super) e2e: f64,
    /// Gaps between token-bearing deltas, seconds.
    pub(super) itl: Vec<f64>,
    pub(super) output_tokens: u64,
    /// Chunks with non-empty reasoning.
    pub(super) reasoning_deltas: u64,
    pub(super) prompt_tokens: Option<u64>,
    pub(super) input_words: usize,
    /// As in `Spec`.
    pub(super) turn: usize,
    pub(super) carryable: Option<u64>,
    /// Prompt tokens the server says it took from its prefix cache.
    pub(super) cached_tokens: Option<u64>,
    /// The streamed answer (kept for multi-turn requests only).
    pub(super) text: String,
}

impl Outcome {
    pub(super) fn tpot(&self) -> Option<f64> {
        let ttft = self.ttft?;
        (self.output_tokens > 1).then(|| (self.e2e - ttft) / (self.output_tokens - 1) as f64)
    }
}

#[derive(Debug)]
pub(super) struct Shared {
    pub(super) client: reqwest::Client,
    /// Where requests go: the base URL and `path`.
    pub(super) url: String,
    pub(super) path: &'static str,
    pub(super) model: String,
    pub(super) endpoint: Endpoint,
    pub(super) temperature: f64,
    pub(super) ignore_eos: bool,
    pub(super) timeout: Duration,
}

pub(super) fn request_body(sh: &Shared, spec: &Spec) -> String {
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

pub(super) async fn run_one(sh: &Shared, spec: &Spec) -> Outcome {
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
