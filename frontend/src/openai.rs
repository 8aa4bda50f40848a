//! OpenAI wire types for `/v1/chat/completions` and `/v1/completions`, and
//! their validation into what the engine needs.
//!
//! Requests are parsed in two steps: the body becomes a JSON object whose
//! keys are checked against the fields we know (unknown ones are a 400
//! unless `--allow-extra-request-fields`, then they are dropped with a
//! warning), then the object is deserialized into the typed request.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use tandem_modelfile::chat::ChatMessage;
use tandem_modelfile::stop::MAX_STOP_BYTES;
use tandem_types::FinishReason;
use tandem_types::{Constraint, MAX_TOP_LOGPROBS, SamplingParams};
use utoipa::ToSchema;

use crate::error::ApiError;
use crate::tools::ToolParser;

/// Most stop strings in one request (OpenAI's limit).
pub const MAX_STOP: usize = 4;

/// Most messages in one chat request (OpenAI's limit).
pub const MAX_MESSAGES: usize = 2048;

/// Fields accepted only when null (or their no-op value): features we do
/// not implement.
pub(crate) const UNSUPPORTED: &[&str] = &[
    "functions",
    "function_call",
    "audio",
    "moderation",
    "prediction",
    "suffix",
    "best_of",
    "web_search_options",
    "reasoning_effort",
];

/// Fields accepted and ignored (bookkeeping that does not change the output).
pub(crate) const IGNORED: &[&str] = &["user", "store", "metadata", "service_tier"];

/// Chat fields of OpenAI's current API that are accepted when well formed
/// and then ignored, with a debug log line: hints about OpenAI's prompt
/// cache (the prefix cache here needs none) and abuse tracking, the
/// `verbosity` of answers, and `modalities` (only `["text"]`: audio output
/// is a 400).
pub(crate) const CHAT_HINTS: &[&str] = &[
    "prompt_cache_key",
    "prompt_cache_retention",
    "safety_identifier",
    "verbosity",
    "modalities",
];

/// Checks a [`CHAT_HINTS`] field's value (`null` is always accepted).
fn check_hint(key: &str, v: &Value) -> Result<(), ApiError> {
    let ok = match (key, v) {
        (_, Value::Null) => true,
        ("prompt_cache_key" | "safety_identifier", Value::String(_)) => true,
        ("prompt_cache_retention", Value::String(s)) => {
            matches!(s.as_str(), "in_memory" | "in-memory" | "24h")
        }
        ("verbosity", Value::String(s)) => matches!(s.as_str(), "low" | "medium" | "high"),
        ("modalities", Value::Array(a)) => {
            if a.iter().any(|m| m.as_str() == Some("audio")) {
                return Err(invalid(
                    "`modalities` may only be [\"text\"]: this server does not generate audio",
                    key,
                ));
            }
            !a.is_empty() && a.iter().all(|m| m.as_str() == Some("text"))
        }
        _ => false,
    };
    if ok {
        return Ok(());
    }
    let expected = match key {
        "prompt_cache_retention" => "\"in_memory\" or \"24h\"",
        "verbosity" => "\"low\", \"medium\" or \"high\"",
        "modalities" => "[\"text\"]",
        _ => "a string",
    };
    Err(invalid(format!("`{key}` must be {expected}"), key))
}

pub(crate) const CHAT_FIELDS: &[&str] = &[
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "messages",
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "n",
    "stream",
    "stream_options",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "ignore_eos",
    "min_tokens",
    "logit_bias",
    "logprobs",
    "top_logprobs",
];

pub(crate) const COMPLETION_FIELDS: &[&str] = &[
    "response_format",
    "prompt",
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "n",
    "stream",
    "stream_options",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "ignore_eos",
    "min_tokens",
    "logit_bias",
    "logprobs",
    "echo",
];

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize, PartialEq, ToSchema)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq, ToSchema)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
    #[serde(default)]
    pub continuous_usage_stats: Option<bool>,
}

/// A chat message as sent; `content` is checked in [`ChatRequest::messages`].
#[derive(Debug, Clone, Deserialize, PartialEq, ToSchema)]
pub struct RequestMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<Value>,
    #[serde(default)]
    pub name: Option<String>,
    /// An assistant message's calls.
    #[serde(default)]
    pub tool_calls: Option<Value>,
    /// A `tool` message's answer to this call.
    #[serde(default)]
    pub tool_call_id: Option<String>,
}

/// Sampling and length fields shared by both endpoints.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, ToSchema)]
pub struct CommonParams {
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub max_tokens: Option<u64>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub top_k: Option<i64>,
    #[serde(default)]
    pub min_p: Option<f32>,
    #[serde(default)]
    pub seed: Option<i64>,
    #[serde(default)]
    pub stop: Option<Stop>,
    #[serde(default)]
    pub n: Option<u64>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    #[serde(default)]
    pub repetition_penalty: Option<f32>,
    /// `text`, `json_object`, `json_schema`, and the extensions `regex`
    /// (`{"type": "regex", "regex": ...}`) and `grammar` (a Lark grammar:
    /// `{"type": "grammar", "grammar": ...}`).
    #[serde(default)]
    pub response_format: Option<Value>,
    /// vLLM's extension: the model's stop tokens do not end the request
    /// (it runs to `max_tokens`; stop strings still apply).
    #[serde(default)]
    pub ignore_eos: Option<bool>,
    /// vLLM's extension: stop tokens are banned until this many tokens
    /// have been generated (stop strings still apply).
    #[serde(default)]
    pub min_tokens: Option<u64>,
    /// Token id (as a string) -> bias in [-100, 100] added to its logit.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub logit_bias: Option<Map<String, Value>>,
}

#[derive(Debug, Clone, Deserialize, PartialEq, ToSchema)]
pub struct ChatRequest {
    pub messages: Vec<RequestMessage>,
    #[serde(default)]
    pub tools: Option<Value>,
    #[serde(default)]
    pub tool_choice: Option<Value>,
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    #[serde(default)]
    pub max_completion_tokens: Option<u64>,
    #[serde(default)]
    pub logprobs: Option<bool>,
    #[serde(default)]
    pub top_logprobs: Option<u64>,
    #[serde(flatten)]
    pub common: CommonParams,
}

/// `prompt` of a completion: text, or one text / token list in an array.
#[derive(Debug, Clone, Deserialize, PartialEq, ToSchema)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Debug, Clone, Deserialize, PartialEq, ToSchema)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    /// Number of alternatives to report per token (OpenAI allows 0..=5).
    #[serde(default)]
    pub logprobs: Option<u64>,
    /// Return the prompt before the completion.
    #[serde(default)]
    pub echo: Option<bool>,
    #[serde(flatten)]
    pub common: CommonParams,
}

/// How many tokens a request may generate, as the client asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaxTokens {
    /// The client's value: with the prompt it must fit the context (a 400
    /// otherwise, by `RequestLimits::check`). `None`: the room left, or
    /// `default` if that is less.
    pub value: Option<usize>,
    /// The field that set it, named in errors.
    pub param: &'static str,
    /// Used when the client sets none (completions: 16, OpenAI's legacy
    /// default), capped by the room left.
    pub default: Option<usize>,
}

impl MaxTokens {
    /// Checks a tokenized prompt against `limits` (the one place requests
    /// are checked); returns how many tokens it may generate.
    pub fn check(
        &self,
        limits: &tandem_types::RequestLimits,
        prompt: &[u32],
        sampling: &SamplingParams,
    ) -> Result<usize, tandem_types::InvalidRequest> {
        let room = limits
            .check(prompt, self.value, sampling)
            .map_err(|e| e.asked_by(self.param))?;
        Ok(match (self.value, self.default) {
            (None, Some(d)) => room.min(d),
            _ => room,
        })
    }
}

/// What the engine needs from a request, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct GenParams {
    pub sampling: SamplingParams,
    pub max_tokens: MaxTokens,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub model: Option<String>,
    /// What the output must match (`response_format`), not yet compiled.
    pub constraint: Option<Constraint>,
    pub ignore_eos: bool,
    /// Choices per prompt (`n`).
    pub n: usize,
    /// `stream_options.continuous_usage_stats`: usage on every chunk.
    pub continuous_usage: bool,
    /// Stop tokens are banned until this many tokens are generated.
    pub min_tokens: u32,
}

/// Most choices per prompt (`n`): each is a sequence in the batch.
pub const MAX_N: u64 = 32;

fn invalid(message: impl Into<String>, param: &str) -> ApiError {
    ApiError::invalid(message, Some(param))
}

/// Whether `v` for unsupported field `key` is equivalent to leaving it out.
fn is_noop(key: &str, v: &Value) -> bool {
    match (key, v) {
        (_, Value::Null) => true,
        // Accepted and ignored: the served models do not take an effort
        // setting (OpenAI's values only; anything else is a 400).
        ("reasoning_effort", Value::String(s)) => {
            matches!(s.as_str(), "none" | "minimal" | "low" | "medium" | "high")
        }
        ("best_of", Value::Number(n)) => n.as_u64() == Some(1),
        ("functions", Value::Array(a)) => a.is_empty(),
        ("suffix", Value::String(s)) => s.is_empty(),
        _ => false,
    }
}

/// Checks the top-level keys of a request body against `known`; returns the
/// object with unknown keys dropped (only when `allow_extra`).
fn check_fields(
    body: &[u8],
    known: &[&str],
    hints: &[&str],
    allow_extra: bool,
) -> Result<Map<String, Value>, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("Invalid JSON body: {e}"), None))?;
    let Value::Object(mut map) = value else {
        return Err(ApiError::invalid(
            "The request body must be a JSON object",
            None,
        ));
    };
    let mut extra = Vec::new();
    let mut hinted = Vec::new();
    for (key, v) in &map {
        if known.contains(&key.as_str()) || IGNORED.contains(&key.as_str()) {
            continue;
        }
        if hints.contains(&key.as_str()) {
            check_hint(key, v)?;
            hinted.push(key.as_str());
            continue;
        }
        if UNSUPPORTED.contains(&key.as_str()) {
            if is_noop(key, v) {
                continue;
            }
            return Err(invalid(format!("`{key}` is not supported"), key));
        }
        extra.push(key.clone());
    }
    if let Some(first) = extra.first() {
        if !allow_extra {
            return Err(invalid(
                format!(
                    "Unrecognized request field `{first}`; start the server with \
                     --allow-extra-request-fields to ignore unknown fields"
                ),
                first,
            ));
        }
        tracing::warn!(fields = ?extra, "ignoring unknown request fields");
    }
    if !hinted.is_empty() {
        tracing::debug!(fields = ?hinted, "accepted and ignored: no effect on this server");
    }
    map.retain(|k, _| known.contains(&k.as_str()));
    Ok(map)
}

fn typed<T: serde::de::DeserializeOwned>(map: Map<String, Value>) -> Result<T, ApiError> {
    serde_json::from_value(Value::Object(map))
        .map_err(|e| ApiError::invalid(format!("Invalid request: {e}"), None))
}

impl ChatRequest {
    pub fn parse(body: &[u8], allow_extra: bool) -> Result<Self, ApiError> {
        let req: Self = typed(check_fields(body, CHAT_FIELDS, CHAT_HINTS, allow_extra)?)?;
        if req.messages.len() > MAX_MESSAGES {
            return Err(invalid(
                format!(
                    "`messages` has {} entries; at most {MAX_MESSAGES} are allowed",
                    req.messages.len()
                ),
                "messages",
            ));
        }
        Ok(req)
    }

    /// The conversation for the chat template; `developer` becomes `system`.
    /// The conversation as plain role/content messages: assistant calls
    /// written the way `parser` writes them, tool results as
    /// `<tool_response>` user turns (for templates that do not render
    /// tools), and `system` (the tool instructions) merged into the first
    /// system message or put first.
    pub fn messages(
        &self,
        parser: ToolParser,
        system: Option<&str>,
    ) -> Result<Vec<ChatMessage>, ApiError> {
        if self.messages.is_empty() {
            return Err(invalid("`messages` must not be empty", "messages"));
        }
        let mut out = Vec::with_capacity(self.messages.len() + 1);
        for (i, m) in self.messages.iter().enumerate() {
            let text = content_text(i, m.content.as_ref())?;
            let msg = match m.role.as_str() {
                "system" | "developer" => ChatMessage::new("system", text),
                "user" => ChatMessage::new("user", text),
                "assistant" => {
                    let mut text = text;
                    for (name, args) in calls_of(i, m.tool_calls.as_ref())? {
                        if !text.is_empty() {
                            text.push('\n');
                        }
                        text.push_str(&parser.render_call(&name, &args));
                    }
                    ChatMessage::new("assistant", text)
                }
                "tool" => {
                    ChatMessage::new("user", format!("<tool_response>\n{text}\n</tool_response>"))
                }
                other => {
                    return Err(invalid(
                        format!(
                            "messages[{i}].role `{other}` is not supported \
                             (use system, developer, user, assistant or tool)"
                        ),
                        "messages",
                    ));
                }
            };
            out.push(msg);
        }
        if let Some(system) = system {
            match out.first_mut() {
                Some(first) if first.role == "system" => {
                    first.content = format!("{}\n\n{system}", first.content);
                }
                _ => out.insert(0, ChatMessage::new("system", system)),
            }
        }
        Ok(out)
    }

    /// The conversation in OpenAI's JSON shape, for templates that render
    /// tools themselves (call arguments as objects, as HF templates expect).
    pub fn messages_json(&self) -> Result<Value, ApiError> {
        let mut out = Vec::with_capacity(self.messages.len());
        for (i, m) in self.messages.iter().enumerate() {
            let role = match m.role.as_str() {
                "developer" => "system",
                r @ ("system" | "user" | "assistant" | "tool") => r,
                other => {
                    return Err(invalid(
                        format!("messages[{i}].role `{other}` is not supported"),
                        "messages",
                    ));
                }
            };
            let mut msg = serde_json::json!({
                "role": role,
                "content": content_text(i, m.content.as_ref())?,
            });
            let calls = calls_of(i, m.tool_calls.as_ref())?;
            if !calls.is_empty() {
                msg["tool_calls"] = calls
                    .into_iter()
                    .map(|(name, args)| {
                        let args: Value = serde_json::from_str(&args).unwrap_or(Value::String(args));
                        serde_json::json!({"type": "function", "function": {"name": name, "arguments": args}})
                    })
                    .collect();
            }
            if let Some(id) = &m.tool_call_id {
                msg["tool_call_id"] = Value::String(id.clone());
            }
            out.push(msg);
        }
        Ok(Value::Array(out))
    }

    pub fn params(&self) -> Result<GenParams, ApiError> {
        if self.top_logprobs.is_some_and(|n| n > 0) && self.logprobs != Some(true) {
            return Err(invalid(
                "`top_logprobs` requires `logprobs` to be true",
                "top_logprobs",
            ));
        }
        let logprobs = self.logprobs.unwrap_or(false);
        let top = self.top_logprobs.unwrap_or(0);
        let (value, param) = match self.max_completion_tokens {
            Some(m) => (Some(m), "max_completion_tokens"),
            None => (self.common.max_tokens, "max_tokens"),
        };
        self.common
            .params((value, param, None), logprobs, top, "top_logprobs")
    }
}

/// `(name, arguments)` of an assistant message's `tool_calls`.
fn calls_of(i: usize, calls: Option<&Value>) -> Result<Vec<(String, String)>, ApiError> {
    let items = match calls {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(a)) => a,
        Some(_) => {
            return Err(invalid(
                format!("messages[{i}].tool_calls must be an array"),
                "messages",
            ));
        }
    };
    items
        .iter()
        .enumerate()
        .map(|(j, c)| {
            let f = c.get("function");
            let name = f.and_then(|f| f.get("name")).and_then(Value::as_str);
            let args = match f.and_then(|f| f.get("arguments")) {
                Some(Value::String(s)) => Some(s.clone()),
                Some(v @ Value::Object(_)) => Some(v.to_string()),
                None | Some(Value::Null) => Some("{}".to_string()),
                Some(_) => None,
            };
            match (name, args) {
                (Some(n), Some(a)) => Ok((n.to_string(), a)),
                _ => Err(invalid(
                    format!(
                        "messages[{i}].tool_calls[{j}] must be {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}"
                    ),
                    "messages",
                )),
            }
        })
        .collect()
}

/// Text of a message's `content`: a string, or an array of text parts.
fn content_text(i: usize, content: Option<&Value>) -> Result<String, ApiError> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Value::as_str);
                match (kind, part.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    _ => {
                        return Err(invalid(
                            format!(
                                "messages[{i}].content[{j}]: only parts of the form \
                                 {{\"type\": \"text\", \"text\": ...}} are supported"
                            ),
                            "messages",
                        ));
                    }
                }
            }
            Ok(text)
        }
        Some(_) => Err(invalid(
            format!("messages[{i}].content must be a string or an array of text parts"),
            "messages",
        )),
    }
}

impl CompletionRequest {
    pub fn parse(body: &[u8], allow_extra: bool) -> Result<Self, ApiError> {
        typed(check_fields(body, COMPLETION_FIELDS, &[], allow_extra)?)
    }

    pub fn params(&self) -> Result<GenParams, ApiError> {
        if self.echo == Some(true) && self.logprobs.is_some() {
            return Err(invalid(
                "`echo` with `logprobs` is not supported: the prompt's log-probabilities \
                 are not computed",
                "echo",
            ));
        }
        let top = self.logprobs.unwrap_or(0);
        // OpenAI's legacy default for completions.
        let max_tokens = (self.common.max_tokens, "max_tokens", Some(16));
        self.common
            .params(max_tokens, self.logprobs.is_some(), top, "logprobs")
    }
}

impl CommonParams {
    /// `max_tokens`: the client's value, the field it came in, the default.
    fn params(
        &self,
        max_tokens: (Option<u64>, &'static str, Option<usize>),
        logprobs: bool,
        top_logprobs: u64,
        top_name: &str,
    ) -> Result<GenParams, ApiError> {
        let n = self.n.unwrap_or(1);
        if !(1..=MAX_N).contains(&n) {
            return Err(invalid(
                format!("`n` must be between 1 and {MAX_N}, got {n}"),
                "n",
            ));
        }
        let stop = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if let Some(long) = stop.iter().find(|s| s.len() > MAX_STOP_BYTES) {
            return Err(invalid(
                format!(
                    "a `stop` string is {} bytes long; at most {MAX_STOP_BYTES} are allowed",
                    long.len()
                ),
                "stop",
            ));
        }
        if stop.len() > MAX_STOP {
            return Err(invalid(
                format!(
                    "`stop` has {} entries; at most {MAX_STOP} are allowed",
                    stop.len()
                ),
                "stop",
            ));
        }
        if top_logprobs > MAX_TOP_LOGPROBS as u64 {
            return Err(invalid(
                format!("`{top_name}` must be between 0 and {MAX_TOP_LOGPROBS}"),
                top_name,
            ));
        }
        let top_k = match self.top_k {
            None => 0,
            Some(-1 | 0) => 0, // disabled (-1 as vLLM spells it)
            Some(k) if k < 0 => {
                return Err(invalid(
                    "`top_k` must be -1 or 0 (disabled), or at least 1",
                    "top_k",
                ));
            }
            Some(k) => usize::try_from(k).unwrap_or(usize::MAX),
        };
        let (value, param, default) = max_tokens;
        let max_tokens = MaxTokens {
            value: match value {
                None => None,
                Some(0) => return Err(invalid(format!("`{param}` must be at least 1"), param)),
                Some(m) => Some(usize::try_from(m).unwrap_or(usize::MAX)),
            },
            param,
            default,
        };
        let sampling = SamplingParams {
            temperature: self.temperature.unwrap_or(1.0),
            top_k,
            top_p: self.top_p.unwrap_or(1.0),
            min_p: self.min_p.unwrap_or(0.0),
            // Negative seeds are accepted and reinterpreted as bits.
            seed: self.seed.map(|s| s as u64),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
            top_logprobs: top_logprobs as usize,
            logprobs,
            logit_bias: logit_bias(self.logit_bias.as_ref())?,
            min_tokens: None,
        };
        sampling
            .validate()
            .map_err(|e| invalid(e.to_string(), e.param()))?;
        let min_tokens = match self.min_tokens {
            None => 0,
            Some(m)
                if max_tokens
                    .value
                    .or(default)
                    .is_some_and(|max| m > max as u64) =>
            {
                return Err(invalid(
                    format!("`min_tokens` must not exceed `{param}`"),
                    "min_tokens",
                ));
            }
            Some(m) => u32::try_from(m).unwrap_or(u32::MAX),
        };
        let stream = self.stream.unwrap_or(false);
        let options = self.stream_options.clone().unwrap_or_default();
        let include_usage = options.include_usage.unwrap_or(false);
        let continuous_usage = options.continuous_usage_stats.unwrap_or(false);

        Ok(GenParams {
            sampling,
            max_tokens,
            stop,
            stream,
            include_usage,
            model: self.model.clone(),
            constraint: response_format(self.response_format.as_ref())?,
            ignore_eos: self.ignore_eos.unwrap_or(false),
            n: n as usize,
            continuous_usage,
            min_tokens,
        })
    }
}

/// `logit_bias` (`{"token id": bias}`) as sorted `(id, bias)` pairs; ranges
/// are checked with the other sampling parameters, ids against the
/// vocabulary by [`tandem_types::RequestLimits::check`].
fn logit_bias(v: Option<&Map<String, Value>>) -> Result<Vec<(u32, f32)>, ApiError> {
    const P: &str = "logit_bias";
    let Some(map) = v else { return Ok(Vec::new()) };
    let mut out = Vec::with_capacity(map.len());
    for (k, b) in map {
        let id: u32 = k
            .trim()
            .parse()
            .map_err(|_| invalid(format!("`logit_bias` keys must be token ids, got {k:?}"), P))?;
        let bias = b
            .as_f64()
            .ok_or_else(|| invalid(format!("`logit_bias[{k:?}]` must be a number"), P))?;
        out.push((id, bias as f32));
    }
    out.sort_by_key(|&(id, _)| id);
    if let Some(w) = out.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(invalid(
            format!("`logit_bias` names token {} more than once", w[0].0),
            P,
        ));
    }
    Ok(out)
}

/// `response_format` as a constraint (`None` for plain text).
fn response_format(v: Option<&Value>) -> Result<Option<Constraint>, ApiError> {
    const P: &str = "response_format";
    let o = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(o)) => o,
        Some(_) => return Err(invalid("`response_format` must be an object", P)),
    };
    let text = |key: &str| -> Result<String, ApiError> {
        match o.get(key) {
            Some(Value::String(s)) => Ok(s.clone()),
            _ => Err(invalid(
                format!("`response_format.{key}` must be a string"),
                P,
            )),
        }
    };
    match o.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Constraint::JsonObject)),
        Some("json_schema") => {
            let json_schema = o.get("json_schema");
            let mut schema = json_schema
                .and_then(|j| j.get("schema"))
                .filter(|s| s.is_object() || s.is_boolean())
                .cloned()
                .ok_or_else(|| {
                    invalid(
                        "`response_format.json_schema.schema` must be a JSON schema object",
                        P,
                    )
                })?;
            // Strict (OpenAI's meaning): the keys named and no others,
            // unless the schema opens an object itself. Otherwise JSON
            // Schema's meaning: objects take keys the schema does not name.
            let strict = match json_schema.and_then(|j| j.get("strict")) {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(_) => {
                    return Err(invalid(
                        "`response_format.json_schema.strict` must be a boolean",
                        P,
                    ));
                }
            };
            if strict {
                tandem_grammar::close_objects(&mut schema);
            }
            Ok(Some(Constraint::JsonSchema(schema.to_string())))
        }
        Some("regex") => Ok(Some(Constraint::Regex(text("regex")?))),
        Some("grammar") => Ok(Some(Constraint::Lark(text("grammar")?))),
        other => Err(invalid(
            format!(
                "`response_format.type` {other:?} is not supported (text, json_object, \
                 json_schema, regex, grammar)"
            ),
            P,
        )),
    }
}

// ---------------------------------------------------------------- responses

pub fn finish_str(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq, ToSchema)]
pub struct PromptTokensDetails {
    pub cached_tokens: usize,
}

#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq, ToSchema)]
pub struct UsageInfo {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
}

impl UsageInfo {
    pub fn new(prompt_tokens: usize, completion_tokens: usize, cached_tokens: usize) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptTokensDetails { cached_tokens },
        }
    }
}

/// One alternative token in OpenAI's chat `top_logprobs`.
#[derive(Debug, Clone, Serialize, PartialEq, ToSchema)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// One generated token in OpenAI's chat `logprobs.content`.
#[derive(Debug, Clone, Serialize, PartialEq, ToSchema)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Clone, Serialize, PartialEq, ToSchema)]
pub struct ChatLogprobs {
    pub content: Vec<TokenLogprob>,
}

/// The legacy completions `logprobs` object.
#[derive(Debug, Clone, Default, Serialize, PartialEq, ToSchema)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    #[schema(value_type = Vec<std::collections::HashMap<String, f32>>)]
    pub top_logprobs: Vec<Map<String, Value>>,
    pub text_offset: Vec<usize>,
}

impl CompletionLogprobs {
    /// Converts chat-shaped logprobs; offsets count bytes from `start`.
    pub fn from_tokens(tokens: &[TokenLogprob], start: usize) -> Self {
        let mut out = Self::default();
        let mut offset = start;
        for t in tokens {
            out.tokens.push(t.token.clone());
            out.token_logprobs.push(t.logprob);
            out.top_logprobs.push(
                t.top_logprobs
                    .iter()
                    .map(|a| (a.token.clone(), Value::from(a.logprob)))
                    .collect(),
            );
            out.text_offset.push(offset);
            offset += t.token.len();
        }
        out
    }
}

#[derive(Debug, Clone, Serialize, PartialEq, ToSchema)]
pub struct AssistantMessage {
    pub role: &'static str,
    /// `null` when the answer is only tool calls.
    pub content: Option<String>,
    /// The model's thinking, with a reasoning parser (absent otherwise).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallOut>,
}

/// One call in a response.
#[derive(Debug, Clone, Serialize, PartialEq, ToSchema)]
pub struct ToolCallOut {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, Serialize, PartialEq, ToSchema)]
pub struct FunctionCall {
    pub name: String,
    pub arguments: String,
}

/// A streamed piece of one call: the first carries `id`, `type` and the
/// name, later ones argument text.
#[derive(Debug, Clone, Serialize, PartialEq, ToSchema)]
pub struct ToolCallDelta {
    pub index: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionDelta,
}

#[derive(Debug, Clone, Serialize, PartialEq, ToSchema)]
pub struct FunctionDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub arguments: Option<String>,
}

#[derive(Debug, Clone, Serialize, PartialEq, ToSchema)]
pub struct ChatChoice {
    pub index: u32,
    pub message: AssistantMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: &'static str,
}

/// `chat.completion`
#[derive(Debug, Clone, Serialize, PartialEq, ToSchema)]
pub struct ChatCompletion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: UsageInfo,
}

#[derive(Debug, Clone, Default, Serialize, PartialEq, ToSchema)]
pub struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

#[derive(Debug, Clone, Serialize, PartialEq, ToSchema)]
pub struct ChunkChoice {
    pub index: u32,
    pub delta: Delta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// `chat.completion.chunk`
#[derive(Debug, Clone, Serialize, PartialEq, ToSchema)]
pub struct ChatCompletionChunk {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChunkChoice>,
    /// Present (null until the last chunk) when `include_usage` is set.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<UsageInfo>>,
}

#[derive(Debug, Clone, Serialize, PartialEq, ToSchema)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// `text_completion` (also its streamed chunks).
#[derive(Debug, Clone, Serialize, PartialEq, ToSchema)]
pub struct Completion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<UsageInfo>>,
}

#[derive(Debug, Clone, Serialize, PartialEq, ToSchema)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    pub max_model_len: usize,
}

#[derive(Debug, Clone, Serialize, PartialEq, ToSchema)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn chat(body: &str) -> Result<ChatRequest, ApiError> {
        ChatRequest::parse(body.as_bytes(), false)
    }

    fn message(err: ApiError) -> String {
        err.to_string()
    }

    #[test]
    fn minimal_chat_parses_with_defaults() {
        let r = chat(r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#).unwrap();
        let p = r.params().unwrap();
        assert_eq!(p.sampling.temperature, 1.0);
        assert_eq!(p.max_tokens.value, None);
        assert_eq!(p.max_tokens.default, None);
        assert!(!p.stream);
        assert_eq!(
            r.messages(ToolParser::Hermes, None).unwrap(),
            vec![ChatMessage::new("user", "hi")]
        );
    }

    #[test]
    fn unknown_field_names_field_and_flag() {
        let e =
            chat(r#"{"messages":[{"role":"user","content":"hi"}],"frobnicate":1}"#).unwrap_err();
        let m = message(e);
        assert!(m.contains("frobnicate"), "{m}");
        assert!(m.contains("--allow-extra-request-fields"), "{m}");
        // With the flag the field is dropped.
        let r = ChatRequest::parse(
            br#"{"messages":[{"role":"user","content":"hi"}],"frobnicate":1}"#,
            true,
        )
        .unwrap();
        assert_eq!(r.messages.len(), 1);
    }

    #[test]
    fn explicit_nulls_are_accepted() {
        let r = chat(
            r#"{"messages":[{"role":"user","content":"hi"}],"tools":null,"tool_choice":null,
               "response_format":null,"temperature":null,"stop":null,"n":null,"seed":null,
               "max_tokens":null,"logprobs":null,"top_logprobs":null,"stream_options":null,
               "user":null,"logit_bias":null,"functions":null,"parallel_tool_calls":null}"#,
        )
        .unwrap();
        let p = r.params().unwrap();
        assert_eq!(p.sampling, SamplingParams::default());
    }

    #[test]
    fn reasoning_effort_is_accepted_and_ignored() {
        for e in ["minimal", "low", "medium", "high"] {
            let body = format!(
                r#"{{"messages":[{{"role":"user","content":"hi"}}],"reasoning_effort":"{e}"}}"#
            );
            assert!(chat(&body).is_ok(), "{e}");
        }
        let m = message(
            chat(r#"{"messages":[{"role":"user","content":"hi"}],"reasoning_effort":"extreme"}"#)
                .unwrap_err(),
        );
        assert!(m.contains("reasoning_effort"), "{m}");
    }

    #[test]
    fn current_hint_fields_are_accepted_and_checked() {
        let body = r#"{"messages":[{"role":"user","content":"hi"}],"prompt_cache_key":"k1",
            "safety_identifier":"user-42","verbosity":"low","modalities":["text"],
            "prompt_cache_retention":"24h"}"#;
        let r = chat(body).unwrap();
        assert!(r.params().is_ok());
        for (field, value) in [
            ("prompt_cache_key", "3"),
            ("safety_identifier", "{}"),
            ("verbosity", r#""loud""#),
            ("prompt_cache_retention", r#""1y""#),
            ("modalities", r#"["audio"]"#),
            ("modalities", r#"["text","audio"]"#),
            ("modalities", "[]"),
        ] {
            let body =
                format!(r#"{{"messages":[{{"role":"user","content":"hi"}}],"{field}":{value}}}"#);
            let e = chat(&body).unwrap_err();
            assert_eq!(e.body().error.param.as_deref(), Some(field), "{body}");
        }
        // Chat fields: the legacy completions endpoint does not know them.
        let e =
            CompletionRequest::parse(br#"{"prompt":"x","verbosity":"low"}"#, false).unwrap_err();
        assert!(message(e).contains("verbosity"));
    }

    #[test]
    fn legacy_functions_are_rejected() {
        let m = message(
            chat(r#"{"messages":[{"role":"user","content":"hi"}],"functions":[{"name":"f"}]}"#)
                .unwrap_err(),
        );
        assert!(
            m.contains("functions") && m.contains("not supported"),
            "{m}"
        );
    }

    #[test]
    fn developer_role_becomes_system_and_parts_concatenate() {
        let r = chat(
            r#"{"messages":[{"role":"developer","content":"be brief"},
               {"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}"#,
        )
        .unwrap();
        assert_eq!(
            r.messages(ToolParser::Hermes, None).unwrap(),
            vec![
                ChatMessage::new("system", "be brief"),
                ChatMessage::new("user", "ab")
            ]
        );
        let bad = chat(
            r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{}}]}]}"#,
        )
        .unwrap();
        assert!(bad.messages(ToolParser::Hermes, None).is_err());
        let other = chat(r#"{"messages":[{"role":"function","content":"x"}]}"#).unwrap();
        assert!(
            message(other.messages(ToolParser::Hermes, None).unwrap_err()).contains("function")
        );
        // Tool history: the call is written in the parser's format, the
        // result as a tool response, the instructions join the system turn.
        let tool = chat(
            r#"{"messages":[{"role":"system","content":"S"},{"role":"user","content":"q"},
               {"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function",
                 "function":{"name":"f","arguments":"{\"a\":1}"}}]},
               {"role":"tool","tool_call_id":"c1","content":"42"}]}"#,
        )
        .unwrap();
        let m = tool.messages(ToolParser::Hermes, Some("TOOLS")).unwrap();
        assert_eq!(m[0], ChatMessage::new("system", "S\n\nTOOLS"));
        assert_eq!(m[2].role, "assistant");
        let (_, calls) = ToolParser::Hermes.extract(&m[2].content);
        assert_eq!(
            (calls[0].name.as_str(), calls[0].arguments.as_str()),
            ("f", r#"{"a":1}"#)
        );
        assert_eq!(
            m[3],
            ChatMessage::new("user", "<tool_response>\n42\n</tool_response>")
        );
        let j = tool.messages_json().unwrap();
        assert_eq!(j[2]["tool_calls"][0]["function"]["arguments"]["a"], 1);
        assert_eq!(j[3]["tool_call_id"], "c1");
        let empty = chat(r#"{"messages":[]}"#).unwrap();
        assert!(empty.messages(ToolParser::Hermes, None).is_err());
    }

    #[test]
    fn stop_string_or_array_and_limit() {
        let one = chat(r#"{"messages":[],"stop":"x"}"#).unwrap();
        assert_eq!(one.params().unwrap().stop, vec!["x".to_string()]);
        let many = chat(r#"{"messages":[],"stop":["a","b"]}"#).unwrap();
        assert_eq!(many.params().unwrap().stop, vec!["a", "b"]);
        let five = chat(r#"{"messages":[],"stop":["a","b","c","d","e"]}"#).unwrap();
        assert!(message(five.params().unwrap_err()).contains("at most 4"));
        let long = format!(
            r#"{{"messages":[],"stop":["{}"]}}"#,
            "x".repeat(MAX_STOP_BYTES + 1)
        );
        assert!(message(chat(&long).unwrap().params().unwrap_err()).contains("bytes long"));
        let at_limit = format!(
            r#"{{"messages":[],"stop":"{}"}}"#,
            "x".repeat(MAX_STOP_BYTES)
        );
        assert!(chat(&at_limit).unwrap().params().is_ok());
        assert!(chat(r#"{"messages":[],"stop":3}"#).is_err());
    }

    #[test]
    fn n_is_bounded() {
        assert_eq!(chat(r#"{"messages":[]}"#).unwrap().params().unwrap().n, 1);
        assert_eq!(
            chat(r#"{"messages":[],"n":4}"#)
                .unwrap()
                .params()
                .unwrap()
                .n,
            4
        );
        for bad in [0, MAX_N + 1] {
            let e = chat(&format!(r#"{{"messages":[],"n":{bad}}}"#))
                .unwrap()
                .params()
                .unwrap_err();
            assert!(message(e).contains("`n` must be between 1"), "{bad}");
        }
    }

    #[test]
    fn logit_bias_min_tokens_and_continuous_usage() {
        let p = chat(
            r#"{"messages":[],"logit_bias":{"7":-100,"3":2.5},"min_tokens":4,"max_tokens":9,
               "stream":true,"stream_options":{"continuous_usage_stats":true}}"#,
        )
        .unwrap()
        .params()
        .unwrap();
        assert_eq!(p.sampling.logit_bias, vec![(3, 2.5), (7, -100.0)]);
        assert_eq!(p.min_tokens, 4);
        assert!(p.continuous_usage && !p.include_usage);
        let err = |body: &str| message(chat(body).unwrap().params().unwrap_err());
        assert!(err(r#"{"messages":[],"logit_bias":{"x":1}}"#).contains("token ids"));
        assert!(err(r#"{"messages":[],"logit_bias":{"1":"a"}}"#).contains("number"));
        assert!(err(r#"{"messages":[],"logit_bias":{"1":101}}"#).contains("logit_bias"));
        assert!(err(r#"{"messages":[],"logit_bias":{"1":1," 1":2}}"#).contains("more than once"));
        assert!(err(r#"{"messages":[],"min_tokens":5,"max_tokens":4}"#).contains("min_tokens"));
        assert!(chat(r#"{"messages":[],"logit_bias":[1]}"#).is_err());
    }

    #[test]
    fn echo_is_a_completions_field_without_prompt_logprobs() {
        let r = CompletionRequest::parse(br#"{"prompt":"x","echo":true}"#, false).unwrap();
        assert_eq!(r.echo, Some(true));
        assert!(r.params().is_ok());
        let both =
            CompletionRequest::parse(br#"{"prompt":"x","echo":true,"logprobs":1}"#, false).unwrap();
        assert!(message(both.params().unwrap_err()).contains("echo"));
        assert!(chat(r#"{"messages":[],"echo":true}"#).is_err());
    }

    #[test]
    fn sampling_and_lengths() {
        let r = chat(
            r#"{"messages":[],"max_tokens":5,"max_completion_tokens":7,"temperature":0,
               "top_k":-1,"top_p":0.5,"seed":-1,"logprobs":true,"top_logprobs":3,
               "stream":true,"stream_options":{"include_usage":true}}"#,
        )
        .unwrap();
        let p = r.params().unwrap();
        assert_eq!(p.max_tokens.value, Some(7));
        assert_eq!(p.max_tokens.param, "max_completion_tokens");
        assert_eq!(p.sampling.top_k, 0);
        assert_eq!(p.sampling.seed, Some(u64::MAX));
        assert!(p.sampling.logprobs);
        assert_eq!(p.sampling.top_logprobs, 3);
        assert!(p.stream && p.include_usage);
        let bad = chat(r#"{"messages":[],"temperature":3}"#).unwrap();
        assert!(message(bad.params().unwrap_err()).contains("temperature"));
        let zero = chat(r#"{"messages":[],"max_tokens":0}"#).unwrap();
        assert!(zero.params().is_err());
        let top_only = chat(r#"{"messages":[],"top_logprobs":2}"#).unwrap();
        assert!(top_only.params().is_err());
        assert!(chat(r#"{"messages":[],"max_tokens":-1}"#).is_err());
    }

    #[test]
    fn top_k_off_spellings_and_bad_negatives() {
        let top_k = |k: i64| {
            chat(&format!(r#"{{"messages":[],"top_k":{k}}}"#))
                .unwrap()
                .params()
                .map(|p| p.sampling.top_k)
        };
        assert_eq!(top_k(-1).unwrap(), 0);
        assert_eq!(top_k(0).unwrap(), 0);
        assert_eq!(top_k(3).unwrap(), 3);
        for k in [-2, -5, i64::MIN] {
            let e = top_k(k).unwrap_err();
            assert!(message(e).contains("`top_k` must be -1 or 0"), "{k}");
        }
    }

    #[test]
    fn completion_prompt_shapes() {
        let p = |b: &str| {
            CompletionRequest::parse(b.as_bytes(), false)
                .unwrap()
                .prompt
        };
        assert_eq!(p(r#"{"prompt":"hi"}"#), Prompt::Text("hi".into()));
        assert_eq!(p(r#"{"prompt":[1,2]}"#), Prompt::Tokens(vec![1, 2]));
        assert_eq!(p(r#"{"prompt":["a"]}"#), Prompt::Texts(vec!["a".into()]));
        let r = CompletionRequest::parse(br#"{"prompt":"x","logprobs":2,"echo":false}"#, false)
            .unwrap();
        let g = r.params().unwrap();
        assert_eq!(g.max_tokens.value, None);
        assert_eq!(g.max_tokens.default, Some(16));
        assert!(g.sampling.logprobs);
        assert_eq!(g.sampling.top_logprobs, 2);
        // Chat-only fields are unknown here.
        let e = CompletionRequest::parse(br#"{"prompt":"x","messages":[]}"#, false).unwrap_err();
        assert!(message(e).contains("messages"));
    }

    #[test]
    fn message_count_is_capped() {
        let msg = r#"{"role":"user","content":"x"}"#;
        let body = |n: usize| format!(r#"{{"messages":[{}]}}"#, vec![msg; n].join(","));
        assert!(chat(&body(MAX_MESSAGES)).is_ok());
        let m = message(chat(&body(MAX_MESSAGES + 1)).unwrap_err());
        assert!(m.contains("at most 2048"), "{m}");
    }

    #[test]
    fn not_an_object() {
        assert!(chat("[1]").is_err());
        assert!(chat("{").is_err());
    }
}
