//! The HTTP server: routes, admission (body size and concurrency limits),
//! tokenization and chat templating on the request path, the request
//! checks, and the mapping of a [`Backend`]'s events to OpenAI responses
//! and SSE streams.

use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures_util::{Stream, StreamExt};
use serde::Serialize;
use tandem_grammar::{GrammarCompiler, GrammarError};
use tandem_http::{ConnectionLimits, HttpTls, serve_router};
use tandem_modelfile::ModelText;
use tandem_modelfile::stop::StopStrings;
use tandem_modelfile::tokenizer::Tokenizer;
use tandem_proto::trace::{TRACEPARENT, TraceContext};
use tandem_types::{Constraint, FinishReason, GenEvent, GenFailure, GenerationRequest, Sampled};
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tracing::Instrument;

use crate::auth::ApiKeys;
use crate::backend::{Backend, BackendRequest, GenerationStream};
use crate::error::ApiError;
use crate::metrics::{AwaitingAdmission, MetricsRenderer, RequestTracker, record_rejected};
use crate::openai::{
    AssistantMessage, ChatChoice, ChatCompletion, ChatCompletionChunk, ChatLogprobs, ChatRequest,
    ChunkChoice, Completion, CompletionChoice, CompletionLogprobs, CompletionRequest, Delta,
    FunctionCall, FunctionDelta, GenParams, ModelCard, ModelList, Prompt, TokenLogprob,
    ToolCallDelta, ToolCallOut, TopLogprob, UsageInfo, finish_str,
};
use crate::prompt::{Guard, render_chat};
use crate::reasoning::ReasoningParser;
use crate::tools::{self, ToolChoice, ToolParser};

mod body_budget;
mod body_pace;
mod choices;
mod responses;

use body_budget::{BodyBudget, KeyId};
pub use body_pace::BodyPace;

use choices::{OutputParser, UsageTally};

/// Settings of the HTTP layer (the scheduler has its own).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    /// Drop unknown request fields with a warning instead of a 400.
    pub allow_extra_request_fields: bool,
    /// Requests in flight beyond this are refused with 503.
    pub max_concurrent_requests: usize,
    /// Larger request bodies are refused with 413.
    pub max_body_bytes: usize,
    /// The id `/v1/models` reports and requests may name.
    pub model_name: String,
    /// How the model writes tool calls (`--tool-parser`).
    pub tool_parser: ToolParser,
    /// How the model marks its reasoning (`--reasoning-parser`).
    pub reasoning_parser: ReasoningParser,
    /// Keys the API requires (none: open). Replaceable while serving.
    pub api_keys: ApiKeys,
    /// Whether `/health` and `/metrics` require a key too.
    pub protect_health: bool,
    pub protect_metrics: bool,
    /// Requests one API key may have in flight (0: no limit); beyond it, 429.
    pub max_concurrent_requests_per_key: usize,
    /// A connection that sends no complete request head for this long (a
    /// new connection, or an idle keep-alive one) is closed.
    pub header_timeout: Duration,
    /// How long a request body may take, in all and by its rate (408
    /// beyond, and the connection is closed).
    pub body_pace: BodyPace,
    /// Open connections beyond this wait in the kernel's accept queue.
    pub max_connections: usize,
    /// Request bodies being received at once, in bytes (by their declared
    /// length); beyond it, 503. Bounds what slow uploads can hold.
    pub max_buffered_body_bytes: usize,
    /// Of those, what one client address (IPv6: its /64) or one API key
    /// may hold; beyond it, 429.
    pub max_buffered_body_bytes_per_client: usize,
}

/// Most prompts in one `/v1/completions` request.
pub const MAX_PROMPTS: usize = 64;

/// Shared by every handler. Cheap to clone.
#[derive(Debug, Clone)]
pub struct AppState {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    text: Arc<ModelText>,
    backend: Arc<dyn Backend>,
    config: ServerConfig,
    permits: Arc<Semaphore>,
    created: u64,
    next_id: AtomicU64,
    draining: AtomicBool,
    metrics: OnceLock<Renderer>,
    /// Bytes of request bodies being received (`max_buffered_body_bytes`),
    /// and each client's share.
    body_budget: Arc<BodyBudget>,
    /// Requests in flight per API key (by digest).
    per_key: std::sync::Mutex<std::collections::HashMap<[u8; 32], Arc<Semaphore>>>,
    /// Built on the first constrained request (indexing the vocabulary
    /// takes a moment), to reject invalid constraints with a 400.
    grammar: OnceLock<Result<GrammarCompiler, GrammarError>>,
}

/// The `/metrics` renderer (a newtype for `Debug`).
struct Renderer(MetricsRenderer);

impl std::fmt::Debug for Renderer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Renderer")
    }
}

fn unix_now() -> u64 {
    tandem_types::clock::since_epoch().as_secs()
}

impl AppState {
    /// A server whose requests run on `backend`; `text` tokenizes and
    /// templates them.
    pub fn new(text: Arc<ModelText>, backend: Arc<dyn Backend>, config: ServerConfig) -> Self {
        let permits = Arc::new(Semaphore::new(config.max_concurrent_requests));
        let body_budget = Arc::new(BodyBudget::new(
            config.max_buffered_body_bytes,
            config.max_buffered_body_bytes_per_client,
        ));
        Self {
            inner: Arc::new(Inner {
                text,
                backend,
                config,
                permits,
                created: unix_now(),
                next_id: AtomicU64::new(0),
                draining: AtomicBool::new(false),
                metrics: OnceLock::new(),
                body_budget,
                per_key: Default::default(),
                grammar: OnceLock::new(),
            }),
        }
    }

    /// Serves `/metrics` with `render` (Prometheus text format). Without
    /// it, `/metrics` answers 404. Only the first call takes effect.
    pub fn set_metrics_renderer(&self, render: MetricsRenderer) {
        let _ = self.inner.metrics.set(Renderer(render));
    }

    /// The accepted API keys (replace them to rotate keys while serving).
    pub fn api_keys(&self) -> &ApiKeys {
        &self.inner.config.api_keys
    }

    /// Marks the server as shutting down (`/health` then answers 503).
    pub fn begin_shutdown(&self) {
        self.inner.draining.store(true, Ordering::Relaxed);
    }

    fn config(&self) -> &ServerConfig {
        &self.inner.config
    }

    fn new_id(&self, prefix: &str) -> String {
        let n = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let nanos = tandem_types::clock::since_epoch().subsec_nanos();
        format!("{prefix}-{:x}{nanos:08x}{n:06x}", self.inner.created)
    }

    /// `count` admission permits at once (one per sequence), or none.
    fn permits(&self, count: usize) -> Result<Vec<OwnedSemaphorePermit>, ApiError> {
        let mut all = u32::try_from(count)
            .ok()
            .and_then(|c| {
                Arc::clone(&self.inner.permits)
                    .try_acquire_many_owned(c)
                    .ok()
            })
            .ok_or_else(|| {
                ApiError::Overloaded(format!(
                    "The server is overloaded: {} requests are already in flight \
                     (--max-concurrent-requests). Retry later.",
                    self.inner.config.max_concurrent_requests
                ))
            })?;
        let mut out = Vec::with_capacity(count);
        while all.num_permits() > 1 {
            out.extend(all.split(1));
        }
        out.push(all);
        Ok(out)
    }

    fn check_model(&self, requested: Option<&str>) -> Result<(), ApiError> {
        match requested {
            None | Some("") => Ok(()),
            Some(m) if m == self.inner.config.model_name || m == self.inner.text.name => Ok(()),
            Some(m) => Err(ApiError::ModelNotFound(format!(
                "The model `{m}` does not exist; this server serves `{}`",
                self.inner.config.model_name
            ))),
        }
    }

    /// Compiles `c` once to tell the client now, with a 400 naming the
    /// problem, if it cannot be used.
    fn check_constraint(&self, c: &Constraint) -> Result<(), ApiError> {
        let compiler = self
            .inner
            .grammar
            .get_or_init(|| GrammarCompiler::new(&self.inner.text.tokenizer));
        let result = match compiler {
            Ok(g) => g.compile(c).map(drop),
            Err(e) => Err(e.clone()),
        };
        result.map_err(|e| match e {
            GrammarError::Invalid(m) => ApiError::InvalidRequest {
                message: format!("Invalid response_format: {m}"),
                param: Some("response_format".into()),
                code: None,
            },
            GrammarError::Engine(m) => ApiError::internal(format!("grammar engine: {m}")),
        })
    }

    /// Starts `params.n` choices for each prompt: choice `k` is prompt
    /// `k / n`'s choice `k % n`, seeded with the request's seed plus
    /// `k % n` (so that choices differ and each is reproducible). Every
    /// choice is checked (the one place requests are checked before
    /// dispatch) before any is started.
    async fn submit_all(
        &self,
        prompts: Vec<Vec<u32>>,
        params: &GenParams,
        arrived: Instant,
        trace: &RequestTrace,
    ) -> Result<Vec<Generation>, ApiError> {
        let total = prompts.len() * params.n;
        let limit = self.inner.config.max_concurrent_requests;
        if total > limit {
            return Err(ApiError::invalid(
                format!(
                    "The request asks for {total} sequences (prompts × n); this server runs \
                     at most {limit} at once (--max-concurrent-requests)"
                ),
                Some("n"),
            ));
        }
        trace.span.record(
            "prompt_tokens",
            prompts.iter().map(Vec::len).sum::<usize>() as i64,
        );
        let stop_token_ids = if params.ignore_eos {
            Vec::new()
        } else {
            self.inner.text.tokenizer.stop_ids()
        };
        let limits = self.inner.backend.limits();
        let mut requests = Vec::with_capacity(total);
        let mut sampling = params.sampling.clone();
        if params.min_tokens > 0 && !stop_token_ids.is_empty() {
            sampling.min_tokens = Some(tandem_types::MinTokens {
                count: params.min_tokens,
                stop_ids: stop_token_ids.clone(),
            });
        }
        for prompt in prompts {
            // Choices differ only in their seed, which the check ignores.
            let max_tokens = params.max_tokens.check(&limits, &prompt, &sampling)?;
            for j in 0..params.n {
                let mut sampling = sampling.clone();
                sampling.seed = sampling.seed.map(|s| s.wrapping_add(j as u64));
                requests.push(BackendRequest {
                    request: GenerationRequest {
                        prompt: prompt.clone(),
                        sampling,
                        max_tokens,
                        stop_token_ids: stop_token_ids.clone(),
                        constraint: params.constraint.clone(),
                    },
                    trace: trace.outgoing,
                });
            }
        }
        if let Some(c) = &params.constraint {
            self.check_constraint(c)?;
        }
        let permits = self.permits(total)?;
        let mut out = Vec::with_capacity(total);
        for (req, permit) in requests.into_iter().zip(permits) {
            out.push(
                self.submit(req, &params.stop, permit, arrived, trace)
                    .await?,
            );
        }
        Ok(out)
    }

    /// Starts one checked request on the backend.
    async fn submit(
        &self,
        req: BackendRequest,
        stop: &[String],
        permit: OwnedSemaphorePermit,
        arrived: Instant,
        trace: &RequestTrace,
    ) -> Result<Generation, ApiError> {
        let prompt_tokens = req.request.prompt.len();
        let logprobs = req.request.sampling.logprobs;
        let stream = self.inner.backend.submit(req).await?;
        Ok(Generation {
            text: Arc::clone(&self.inner.text),
            stream,
            prompt_tokens,
            stop: stop.to_vec(),
            logprobs,
            permit,
            tracker: RequestTracker::new(arrived, prompt_tokens),
            span: trace.span.clone(),
        })
    }
}

/// The span of one HTTP request (exported over OTLP when configured),
/// continuing the client's trace if it sent a `traceparent`, and the
/// context that calls to workers carry.
#[derive(Debug)]
struct RequestTrace {
    span: tracing::Span,
    outgoing: TraceContext,
}

impl RequestTrace {
    fn new(route: &'static str, headers: &HeaderMap) -> Self {
        let span = tracing::info_span!(
            "request",
            route,
            trace_id = tracing::field::Empty,
            prompt_tokens = tracing::field::Empty,
        );
        let parent = headers
            .get(TRACEPARENT)
            .and_then(|v| v.to_str().ok())
            .and_then(TraceContext::parse);
        let outgoing = TraceContext::start_hop(&span, parent);
        Self { span, outgoing }
    }
}

/// A submitted request, not yet read.
struct Generation {
    text: Arc<ModelText>,
    stream: Box<dyn GenerationStream>,
    prompt_tokens: usize,
    stop: Vec<String>,
    logprobs: bool,
    permit: OwnedSemaphorePermit,
    tracker: RequestTracker,
    /// The request's span: it ends when the generation's stream does.
    span: tracing::Span,
}

/// What a generation produces, in order: text pieces, then `Done` or `Error`.
enum Piece {
    /// Text, its tokens' log-probabilities (if asked for), and how many
    /// tokens the generation has produced so far.
    Text(String, Vec<TokenLogprob>, usize),
    Done(FinishReason, UsageInfo),
    Error(ApiError),
}

/// One token's text and raw bytes for logprobs. From the token's own
/// bytes, not `decode`: decoding strips a SentencePiece token's leading
/// space (`▁Hello` is " Hello" mid-text). A token that is part of a UTF-8
/// character gets U+FFFD in `token`; `bytes` has the exact bytes.
fn token_text(tok: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let bytes = tok.token_to_piece_bytes(id).unwrap_or_default();
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

/// The least log-probability reported (OpenAI's floor): JSON has no
/// infinity, and a typed client reads `null` as 0 (certainty) or fails.
const LOGPROB_FLOOR: f32 = -9999.0;

/// One sampled token's logprobs as OpenAI reports them. Under a constraint
/// the sampler's log-probabilities are those of the distribution over the
/// tokens the grammar allows, and a token it masked (minus infinity) was
/// never possible: it is left out of `top_logprobs`, which may then hold
/// fewer entries than asked for. Every number is finite.
fn token_logprob(tok: &Tokenizer, s: &Sampled) -> TokenLogprob {
    let (token, bytes) = token_text(tok, s.token);
    let logprob = s.logprob.unwrap_or(0.0);
    TokenLogprob {
        token,
        logprob: if logprob.is_nan() {
            LOGPROB_FLOOR
        } else {
            logprob.max(LOGPROB_FLOOR)
        },
        bytes,
        top_logprobs: s
            .top
            .iter()
            .filter(|(_, logprob)| logprob.is_finite())
            .map(|&(id, logprob)| {
                let (token, bytes) = token_text(tok, id);
                TopLogprob {
                    token,
                    logprob: logprob.max(LOGPROB_FLOOR),
                    bytes,
                }
            })
            .collect(),
    }
}

impl Generation {
    /// Detokenizes the scheduler's events, applying stop strings. Dropping
    /// the stream (client gone, stop string hit) cancels the request.
    /// Errors are counted in `tandem.requests` only if `count_errors` (a
    /// non-streaming handler counts the error it returns itself).
    fn pieces(self, count_errors: bool) -> impl Stream<Item = Piece> + Send + 'static {
        let Generation {
            text,
            mut stream,
            prompt_tokens,
            stop,
            logprobs,
            permit,
            mut tracker,
            span,
        } = self;
        async_stream::stream! {
            let _permit = permit;
            let _span = span;
            let tok = &text.tokenizer;
            let mut decoder = tok.stream_decoder(true);
            let mut stops = StopStrings::new(&stop);
            let mut generated = 0;
            let mut lps = Vec::new();
            loop {
                match stream.next().await {
                    Some(GenEvent::Token(s)) => {
                        tracker.token();
                        generated += 1;
                        if logprobs {
                            lps.push(token_logprob(tok, &s));
                        }
                        let piece = match decoder.push(s.token) {
                            Ok(p) => p,
                            Err(e) => {
                                let e = ApiError::internal(format!("detokenizing: {e}"));
                                tracker.finish(Some(&e), count_errors);
                                yield Piece::Error(e);
                                return;
                            }
                        };
                        let (emit, hit) = stops.push(&piece);
                        if hit {
                            if !emit.is_empty() || !lps.is_empty() {
                                yield Piece::Text(emit, std::mem::take(&mut lps), generated);
                            }
                            let usage = UsageInfo::new(prompt_tokens, generated, stream.cached_tokens());
                            drop(stream);
                            tracker.finish(None, count_errors);
                            yield Piece::Done(FinishReason::Stop, usage);
                            return;
                        }
                        if !emit.is_empty() {
                            yield Piece::Text(emit, std::mem::take(&mut lps), generated);
                        }
                    }
                    Some(GenEvent::Finished(u)) => {
                        let rest = stops.finish(&decoder.finish());
                        if !rest.is_empty() || !lps.is_empty() {
                            yield Piece::Text(rest, std::mem::take(&mut lps), generated);
                        }
                        let usage =
                            UsageInfo::new(u.prompt_tokens, u.completion_tokens, u.cached_tokens);
                        tracker.finish(None, count_errors);
                        yield Piece::Done(u.finish, usage);
                        return;
                    }
                    Some(GenEvent::Failed(f)) => {
                        let err = ApiError::from(f);
                        tracker.finish(Some(&err), count_errors);
                        yield Piece::Error(err);
                        return;
                    }
                    None => {
                        let err = ApiError::from(GenFailure::ShuttingDown);
                        tracker.finish(Some(&err), count_errors);
                        yield Piece::Error(err);
                        return;
                    }
                }
            }
        }
    }

    /// Runs to completion (non-streaming responses).
    async fn collect(self) -> Result<Collected, ApiError> {
        let mut pieces = std::pin::pin!(self.pieces(false));
        let mut text = String::new();
        let mut lps = Vec::new();
        while let Some(p) = pieces.next().await {
            match p {
                Piece::Text(t, l, _) => {
                    text.push_str(&t);
                    lps.extend(l);
                }
                Piece::Done(f, u) => return Ok((text, lps, f, u)),
                Piece::Error(e) => return Err(e),
            }
        }
        Err(ApiError::internal("generation ended without a result"))
    }
}

/// A finished generation: its text, logprobs, finish reason and usage.
type Collected = (String, Vec<TokenLogprob>, FinishReason, UsageInfo);

/// One SSE event of `v`'s JSON, serialized straight into the event's
/// buffer (no intermediate string).
fn sse_json<T: Serialize>(v: &T) -> Result<SseEvent, Infallible> {
    Ok(SseEvent::default().json_data(v).unwrap_or_else(|e| {
        SseEvent::default().data(format!(
            r#"{{"error":{{"message":"serializing a chunk: {e}","type":"server_error"}}}}"#
        ))
    }))
}

fn done_event() -> Result<SseEvent, Infallible> {
    Ok(SseEvent::default().data("[DONE]"))
}

fn body_error(limit: usize, e: BytesRejection) -> ApiError {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(c) = cause {
        if let Some(slow) = c.downcast_ref::<body_pace::BodyTooSlow>() {
            return ApiError::RequestTimeout(slow.to_string());
        }
        cause = c.source();
    }
    if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::PayloadTooLarge(format!(
            "The request body is larger than the limit of {limit} bytes"
        ))
    } else {
        ApiError::invalid(
            format!("Could not read the request body: {}", e.body_text()),
            None,
        )
    }
}

/// Counts a request that ended with `r` before (or without) streaming; a
/// streaming response's outcome is counted by its [`RequestTracker`].
fn counted(r: Result<Response, ApiError>) -> Result<Response, ApiError> {
    if let Err(e) = &r {
        record_rejected(e);
    }
    r
}

async fn chat_completions(
    state: State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let trace = RequestTrace::new("chat", &headers);
    let span = trace.span.clone();
    counted(
        chat_completions_inner(state, body, arrived, trace)
            .instrument(span)
            .await,
    )
}

async fn completions(
    state: State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let trace = RequestTrace::new("completions", &headers);
    let span = trace.span.clone();
    counted(
        completions_inner(state, body, arrived, trace)
            .instrument(span)
            .await,
    )
}

/// A chat request, rendered, tokenized and started.
struct ChatJob {
    /// One per choice (`n`).
    generations: Vec<Generation>,
    params: GenParams,
    /// How each choice's text divides into reasoning, content and calls.
    output: OutputParser,
}

/// Everything between a parsed chat request and its running generations:
/// parameters, tools and their grammar, the template, the tokenizer and
/// the backend's checks. Shared by chat completions and the Responses API.
async fn start_chat(
    state: &AppState,
    req: &ChatRequest,
    arrived: Instant,
    trace: &RequestTrace,
) -> Result<ChatJob, ApiError> {
    let mut params = req.params()?;
    state.check_model(params.model.as_deref())?;
    let parser = state.config().tool_parser;
    let tools = tools::parse_tools(req.tools.as_ref())?;
    let choice = tools::parse_choice(req.tool_choice.as_ref(), &tools)?;
    let calling = !tools.is_empty() && choice != ToolChoice::None;
    if calling && parser == ToolParser::None {
        return Err(ApiError::invalid(
            "This server does not parse tool calls (--tool-parser none); `tools` cannot be used",
            Some("tools"),
        ));
    }
    if let Some(c) = parser.forced_call(&tools, &choice, req.parallel_tool_calls.unwrap_or(true)) {
        if params.constraint.is_some() {
            return Err(ApiError::invalid(
                "`response_format` cannot be combined with a `tool_choice` that forces a call",
                Some("tool_choice"),
            ));
        }
        params.constraint = Some(c);
    }
    let text = &state.inner.text;
    let template = text.chat_template.as_ref().ok_or_else(|| {
        ApiError::invalid(
            "This model has no chat template; use /v1/completions",
            Some("messages"),
        )
    })?;
    // Client text reaches the template guarded: only the template's own
    // markup becomes control tokens. (The template writes its own BOS where
    // the model wants one.)
    let (rendered, prompt) = if calling && template.handles_tools() {
        let mut guard = Guard::new(&text.tokenizer);
        let mut tools = tools::tools_json(&tools);
        let mut messages = req.messages_json()?;
        guard.json(&mut tools);
        guard.json(&mut messages);
        let rendered = template.render_json(&messages, Some(&tools), true)?;
        let prompt = guard.encode(&rendered)?;
        (rendered, prompt)
    } else {
        // The template does not render tools: describe them in the system
        // prompt, in the parser's format.
        let system = calling.then(|| parser.system_prompt(&tools));
        let messages = req.messages(parser, system.as_deref())?;
        render_chat(&text.tokenizer, template, messages)?
    };
    let reasoning = state.config().reasoning_parser;
    let forced = match (&choice, params.constraint.is_some()) {
        (ToolChoice::Named(name), true) => tools::Forced::Named(name.clone()),
        (ToolChoice::Required, true) => tools::Forced::Any,
        _ => tools::Forced::No,
    };
    let output = OutputParser {
        reasoning,
        starts_inside: reasoning.starts_inside(&rendered),
        tools: calling.then_some((parser, forced)),
    };
    let generations = state
        .submit_all(vec![prompt], &params, arrived, trace)
        .await?;
    Ok(ChatJob {
        generations,
        params,
        output,
    })
}

fn tool_calls_out(
    response_id: &str,
    choice: usize,
    calls: Vec<tools::ParsedCall>,
) -> Vec<ToolCallOut> {
    calls
        .into_iter()
        .enumerate()
        .map(|(i, c)| ToolCallOut {
            id: call_id(response_id, choice, i),
            kind: "function",
            function: FunctionCall {
                name: c.name,
                arguments: c.arguments,
            },
        })
        .collect()
}

/// `usage` of a streamed chunk: absent unless asked for; with
/// `continuous_usage_stats` the usage so far, else `null` until the end.
fn chunk_usage(params: &GenParams, tally: &UsageTally) -> Option<Option<UsageInfo>> {
    if params.continuous_usage {
        Some(Some(tally.total()))
    } else if params.include_usage {
        Some(None)
    } else {
        None
    }
}

async fn chat_completions_inner(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
    arrived: Instant,
    trace: RequestTrace,
) -> Result<Response, ApiError> {
    let awaiting = AwaitingAdmission::new();
    let body = body.map_err(|e| body_error(state.config().max_body_bytes, e))?;
    let req = ChatRequest::parse(&body, state.config().allow_extra_request_fields)?;
    let ChatJob {
        generations,
        params,
        output,
    } = start_chat(&state, &req, arrived, &trace).await?;
    drop(awaiting);
    let id = state.new_id("chatcmpl");
    let created = unix_now();
    let name = state.config().model_name.clone();
    let mut tally = UsageTally::new(&generations, params.n);
    if !params.stream {
        let mut choices = Vec::with_capacity(generations.len());
        for (i, (text, lps, finish, usage)) in choices::collect_all(generations)
            .await?
            .into_iter()
            .enumerate()
        {
            tally.done(i, &usage);
            let out = output.whole(&text);
            let tool_calls = tool_calls_out(&id, i, out.calls);
            let finish_reason = chat_finish(finish, !tool_calls.is_empty());
            choices.push(ChatChoice {
                index: i as u32,
                message: AssistantMessage {
                    role: "assistant",
                    content: (!out.content.is_empty() || tool_calls.is_empty())
                        .then_some(out.content),
                    reasoning: out.reasoning,
                    tool_calls,
                },
                logprobs: params
                    .sampling
                    .logprobs
                    .then_some(ChatLogprobs { content: lps }),
                finish_reason,
            });
        }
        return Ok(Json(ChatCompletion {
            id,
            object: "chat.completion",
            created,
            model: name,
            choices,
            usage: tally.total(),
        })
        .into_response());
    }
    let want_logprobs = params.sampling.logprobs;
    let call_ids = id.clone();
    let chunk = move |i: usize,
                      delta: Delta,
                      lps: Option<Vec<TokenLogprob>>,
                      finish: Option<&'static str>,
                      usage: Option<Option<UsageInfo>>| {
        ChatCompletionChunk {
            id: id.clone(),
            object: "chat.completion.chunk",
            created,
            model: name.clone(),
            choices: vec![ChunkChoice {
                index: i as u32,
                delta,
                logprobs: lps
                    .filter(|_| want_logprobs)
                    .map(|content| ChatLogprobs { content }),
                finish_reason: finish,
            }],
            usage,
        }
    };
    let mut outs: Vec<_> = generations.iter().map(|_| output.stream()).collect();
    let events = async_stream::stream! {
        for i in 0..outs.len() {
            let first = Delta { role: Some("assistant"), content: Some(String::new()), ..Delta::default() };
            yield sse_json(&chunk(i, first, None, None, chunk_usage(&params, &tally)));
        }
        let mut pieces = choices::merge(generations);
        let mut failed = false;
        while let Some((i, p)) = pieces.next().await {
            match p {
                Piece::Text(t, l, generated) => {
                    tally.progress(i, generated);
                    let (s, deltas) = outs[i].push(&t);
                    let has_reasoning = !s.reasoning.is_empty();
                    if has_reasoning || !s.content.is_empty() || !l.is_empty() {
                        let delta = Delta {
                            reasoning: has_reasoning.then_some(s.reasoning),
                            // Logprobs alone ride on an empty content delta.
                            content: (!s.content.is_empty() || !has_reasoning).then_some(s.content),
                            ..Delta::default()
                        };
                        yield sse_json(&chunk(i, delta, Some(l), None, chunk_usage(&params, &tally)));
                    }
                    for d in deltas {
                        let delta = Delta { tool_calls: Some(vec![call_delta(&call_ids, i, d)]), ..Delta::default() };
                        yield sse_json(&chunk(i, delta, None, None, chunk_usage(&params, &tally)));
                    }
                }
                Piece::Done(f, u) => {
                    tally.done(i, &u);
                    let (rest, deltas, calls) = outs[i].finish();
                    if !rest.reasoning.is_empty() || !rest.content.is_empty() {
                        let delta = Delta {
                            reasoning: (!rest.reasoning.is_empty()).then_some(rest.reasoning),
                            content: (!rest.content.is_empty()).then_some(rest.content),
                            ..Delta::default()
                        };
                        yield sse_json(&chunk(i, delta, None, None, chunk_usage(&params, &tally)));
                    }
                    for d in deltas {
                        let delta = Delta { tool_calls: Some(vec![call_delta(&call_ids, i, d)]), ..Delta::default() };
                        yield sse_json(&chunk(i, delta, None, None, chunk_usage(&params, &tally)));
                    }
                    let finish = chat_finish(f, !calls.is_empty());
                    yield sse_json(&chunk(i, Delta::default(), None, Some(finish), chunk_usage(&params, &tally)));
                }
                Piece::Error(e) => {
                    e.log();
                    yield sse_json(&e.body());
                    failed = true;
                    break;
                }
            }
        }
        if params.include_usage && !failed {
            let mut last = chunk(0, Delta::default(), None, None, Some(Some(tally.total())));
            last.choices.clear();
            yield sse_json(&last);
        }
        yield done_event();
    };
    Ok(Sse::new(events).into_response())
}

/// A chat choice's `finish_reason`: `length` whenever `max_tokens` cut it
/// (a call it cut is returned as far as it was written), `tool_calls` when
/// it ended after calls.
fn chat_finish(finish: FinishReason, calls: bool) -> &'static str {
    match finish {
        FinishReason::Stop if calls => "tool_calls",
        f => finish_str(f),
    }
}

/// A streamed call piece in OpenAI's shape: id, type and name once, then
/// the arguments as fragments.
fn call_delta(response_id: &str, choice: usize, d: tools::CallDelta) -> ToolCallDelta {
    match d {
        tools::CallDelta::Start { index, name } => ToolCallDelta {
            index: index as u32,
            id: Some(call_id(response_id, choice, index)),
            kind: Some("function"),
            function: FunctionDelta {
                name: Some(name),
                arguments: Some(String::new()),
            },
        },
        tools::CallDelta::Arguments { index, text } => ToolCallDelta {
            index: index as u32,
            id: None,
            kind: None,
            function: FunctionDelta {
                name: None,
                arguments: Some(text),
            },
        },
    }
}

/// A tool call's id, unique within the server's responses.
fn call_id(response_id: &str, choice: usize, i: usize) -> String {
    let suffix = response_id.rsplit('-').next().unwrap_or(response_id);
    format!("call_{suffix}_{choice}_{i}")
}

async fn completions_inner(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
    arrived: Instant,
    trace: RequestTrace,
) -> Result<Response, ApiError> {
    let awaiting = AwaitingAdmission::new();
    let body = body.map_err(|e| body_error(state.config().max_body_bytes, e))?;
    let req = CompletionRequest::parse(&body, state.config().allow_extra_request_fields)?;
    let params = req.params()?;
    state.check_model(params.model.as_deref())?;
    let tok = &state.inner.text.tokenizer;
    let encode = |t: &str| tok.encode(t, true).map_err(ApiError::from);
    let prompts: Vec<Vec<u32>> = match &req.prompt {
        Prompt::Text(t) => vec![encode(t)?],
        Prompt::Tokens(ids) => vec![ids.clone()],
        Prompt::Texts(v) => v.iter().map(|t| encode(t)).collect::<Result<_, _>>()?,
        Prompt::TokenLists(v) => v.clone(),
    };
    if prompts.is_empty() {
        return Err(ApiError::invalid(
            "`prompt` must not be empty",
            Some("prompt"),
        ));
    }
    if prompts.len() > MAX_PROMPTS {
        return Err(ApiError::invalid(
            format!(
                "`prompt` holds {} prompts; at most {MAX_PROMPTS} are allowed",
                prompts.len()
            ),
            Some("prompt"),
        ));
    }
    // `echo`: each prompt's text goes before its choices' completions.
    let echoes: Vec<String> = if req.echo == Some(true) {
        match &req.prompt {
            Prompt::Text(t) => vec![t.clone()],
            Prompt::Texts(v) => v.clone(),
            Prompt::Tokens(_) | Prompt::TokenLists(_) => prompts
                .iter()
                .map(|p| tok.decode(p, false).map_err(ApiError::from))
                .collect::<Result<_, _>>()?,
        }
    } else {
        Vec::new()
    };
    let n = params.n;
    let echo_of = move |k: usize| echoes.get(k / n).cloned().unwrap_or_default();
    let generations = state.submit_all(prompts, &params, arrived, &trace).await?;
    drop(awaiting);
    let id = state.new_id("cmpl");
    let created = unix_now();
    let name = state.config().model_name.clone();
    let want_logprobs = params.sampling.logprobs;
    let mut tally = UsageTally::new(&generations, n);
    if !params.stream {
        let mut choices = Vec::with_capacity(generations.len());
        for (k, (text, lps, finish, usage)) in choices::collect_all(generations)
            .await?
            .into_iter()
            .enumerate()
        {
            tally.done(k, &usage);
            choices.push(CompletionChoice {
                index: k as u32,
                text: echo_of(k) + &text,
                logprobs: want_logprobs.then(|| CompletionLogprobs::from_tokens(&lps, 0)),
                finish_reason: Some(finish_str(finish)),
            });
        }
        return Ok(Json(Completion {
            id,
            object: "text_completion",
            created,
            model: name,
            choices,
            usage: Some(Some(tally.total())),
        })
        .into_response());
    }
    let chunk = move |k: usize,
                      text: String,
                      logprobs: Option<CompletionLogprobs>,
                      finish: Option<FinishReason>,
                      usage: Option<Option<UsageInfo>>| Completion {
        id: id.clone(),
        object: "text_completion",
        created,
        model: name.clone(),
        choices: vec![CompletionChoice {
            index: k as u32,
            text,
            logprobs,
            finish_reason: finish.map(finish_str),
        }],
        usage,
    };
    let mut offsets = vec![0; generations.len()];
    let events = async_stream::stream! {
        for (k, offset) in offsets.iter_mut().enumerate() {
            let echo = echo_of(k);
            if !echo.is_empty() {
                *offset = echo.len();
                yield sse_json(&chunk(k, echo, None, None, chunk_usage(&params, &tally)));
            }
        }
        let mut pieces = choices::merge(generations);
        let mut failed = false;
        while let Some((k, p)) = pieces.next().await {
            match p {
                Piece::Text(t, l, generated) => {
                    tally.progress(k, generated);
                    let lp = want_logprobs.then(|| CompletionLogprobs::from_tokens(&l, offsets[k]));
                    offsets[k] += t.len();
                    yield sse_json(&chunk(k, t, lp, None, chunk_usage(&params, &tally)));
                }
                Piece::Done(f, u) => {
                    tally.done(k, &u);
                    yield sse_json(&chunk(k, String::new(), None, Some(f), chunk_usage(&params, &tally)));
                }
                Piece::Error(e) => {
                    e.log();
                    yield sse_json(&e.body());
                    failed = true;
                    break;
                }
            }
        }
        if params.include_usage && !failed {
            let mut last = chunk(0, String::new(), None, None, Some(Some(tally.total())));
            last.choices.clear();
            yield sse_json(&last);
        }
        yield done_event();
    };
    Ok(Sse::new(events).into_response())
}

async fn models(State(state): State<AppState>) -> Json<ModelList> {
    Json(ModelList {
        object: "list",
        data: vec![ModelCard {
            id: state.config().model_name.clone(),
            object: "model",
            created: state.inner.created,
            owned_by: "tandem",
            max_model_len: state.inner.backend.limits().max_length,
        }],
    })
}

/// `/health`: 200 with the backend's counters while it can serve, 503
/// while draining or while the backend is not ready.
async fn health(State(state): State<AppState>) -> Response {
    let draining = state.inner.draining.load(Ordering::Relaxed);
    let in_flight =
        state.config().max_concurrent_requests - state.inner.permits.available_permits();
    let h = state.inner.backend.health();
    let status = if draining {
        "draining"
    } else if h.ready {
        "ok"
    } else {
        h.reason
    };
    let mut body = serde_json::Map::new();
    body.insert("status".into(), status.into());
    body.extend(h.details);
    body.insert("requests_in_flight".into(), in_flight.into());
    let code = if h.ready && !draining {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, Json(serde_json::Value::Object(body))).into_response()
}

/// `/metrics`: the Prometheus text exposition, when a renderer is set.
async fn metrics_text(State(state): State<AppState>) -> Response {
    match state.inner.metrics.get() {
        Some(r) => (
            [(
                header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            (r.0)(),
        )
            .into_response(),
        None => {
            ApiError::RouteNotFound("Not found: metrics are not enabled".into()).into_response()
        }
    }
}

async fn not_found() -> ApiError {
    ApiError::RouteNotFound("Not found: no such route".into())
}

/// A known route with the wrong method: OpenAI's error JSON (axum's default
/// is an empty body); axum adds the `Allow` header.
async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::MethodNotAllowed(format!("Method {method} is not allowed for {}", uri.path()))
}

/// Refuses a request without a valid key (when keys are configured);
/// `/health` and `/metrics` only when configured so.
async fn require_key(
    State(state): State<AppState>,
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let c = state.config();
    let protected = match req.uri().path() {
        "/health" => c.protect_health,
        "/metrics" => c.protect_metrics,
        _ => true,
    };
    if !protected {
        return next.run(req).await;
    }
    let auth = req
        .headers()
        .get(header::AUTHORIZATION)
        .map(|v| v.as_bytes());
    let key = match c.api_keys.check(auth) {
        Ok(key) => key,
        Err(e) => {
            record_rejected(&e);
            return e.into_response();
        }
    };
    if let Some(key) = key {
        // The body budget charges the key too.
        req.extensions_mut().insert(KeyId(key));
    }
    let limit = c.max_concurrent_requests_per_key;
    let Some(key) = key.filter(|_| limit > 0) else {
        return next.run(req).await;
    };
    let slots = {
        let mut map = state
            .inner
            .per_key
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Keys that are idle again are forgotten (rotated keys go away).
        map.retain(|_, s| s.available_permits() < limit);
        Arc::clone(
            map.entry(key)
                .or_insert_with(|| Arc::new(Semaphore::new(limit))),
        )
    };
    let Ok(slot) = slots.try_acquire_owned() else {
        let e = ApiError::RateLimited(format!(
            "This API key already has {limit} requests in flight \
             (--max-concurrent-requests-per-key). Retry later."
        ));
        record_rejected(&e);
        return e.into_response();
    };
    // The slot is held until the response body is done (a stream's end).
    let response = next.run(req).await;
    let (parts, body) = response.into_parts();
    let body = axum::body::Body::from_stream(body.into_data_stream().map(move |chunk| {
        let _held = &slot;
        chunk
    }));
    Response::from_parts(parts, body)
}

/// The OpenAI API routes.
pub fn app(state: AppState) -> Router {
    let limit = state.config().max_body_bytes;
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/responses", post(responses::responses))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .route("/openapi.json", crate::openapi::route(state.config()))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            body_budget::admit_body,
        ))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            require_key,
        ))
        .with_state(state)
}

/// Serves `state` on `listener` until `shutdown` resolves; then marks the
/// server as draining (`/health` answers 503), stops accepting, lets
/// in-flight requests finish for up to `grace`, and returns.
pub async fn serve(
    listener: TcpListener,
    state: AppState,
    tls: Option<HttpTls>,
    shutdown: impl Future<Output = ()> + Send + 'static,
    grace: Duration,
) -> std::io::Result<()> {
    let config = state.config();
    let limits = ConnectionLimits {
        header_timeout: config.header_timeout,
        max_connections: config.max_connections,
    };
    let draining = state.clone();
    let signal = async move {
        shutdown.await;
        draining.begin_shutdown();
    };
    serve_router(listener, app(state), limits, tls, signal, grace).await
}
