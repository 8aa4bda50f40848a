//! HTTP and SSE: the client, the server's base URL and model, and the
//! parsing of one streamed chunk.

use anyhow::{Context, Result, anyhow, bail};
use eventsource_stream::EventStreamError;
use reqwest::StatusCode;
use reqwest::header::{CONNECTION, HeaderMap, HeaderValue};
use serde_json::Value;

/// What one streamed chunk says.
#[derive(Debug, Default, PartialEq)]
pub(super) struct Chunk {
    /// Non-empty generated text (or reasoning) in this chunk: token-bearing.
    pub(super) content: bool,
    /// Non-empty reasoning in this chunk.
    pub(super) reasoning: bool,
    /// The answer text (reasoning left out, as chat clients do in history).
    pub(super) text: String,
    pub(super) prompt_tokens: Option<u64>,
    pub(super) completion_tokens: Option<u64>,
    pub(super) cached_tokens: Option<u64>,
    pub(super) error: Option<String>,
    pub(super) done: bool,
}

pub(super) fn parse_event(data: &str) -> Chunk {
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
pub(super) fn parse_url(url: &str) -> Result<String> {
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
pub(super) fn http_client(keep_alive: bool) -> Result<reqwest::Client> {
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

pub(super) async fn default_model(client: &reqwest::Client, base: &str) -> Result<String> {
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
pub(super) fn stream_error(e: EventStreamError<reqwest::Error>) -> anyhow::Error {
    match e {
        EventStreamError::Transport(e) => anyhow::Error::new(e).context("reading the stream"),
        e => anyhow!("reading the stream: {e}"),
    }
}
