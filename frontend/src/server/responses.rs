//! `POST /v1/responses`: OpenAI's Responses API (the default of the OpenAI
//! Agents SDK and of langchain-openai's `use_responses_api`), over the same
//! path as chat completions. A request's `input` items, `instructions`,
//! function `tools`, `tool_choice` and `text.format` are translated to a
//! chat request (so they get the same validation, template, grammar and
//! tool parsing), and the answer is rendered as a `response` object or as
//! the Responses streaming events.
//!
//! Stateless: `previous_response_id` and `store: true` retrieval are not
//! offered (a request that needs them gets a 400); `reasoning` and
//! `truncation` are accepted and ignored. With a reasoning parser, the
//! model's thinking is a `reasoning` output item before the message.

use serde_json::{Map, Value, json};

use super::choices::Output;
use super::*;
use crate::reasoning::Split;

/// Fields accepted and ignored (they do not change the output here).
const IGNORED: &[&str] = &[
    "store",
    "metadata",
    "user",
    "reasoning",
    "truncation",
    "service_tier",
    "include",
    "prompt_cache_key",
    "prompt_cache_retention",
    "safety_identifier",
    "background",
];

const FIELDS: &[&str] = &[
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "previous_response_id",
    "top_logprobs",
    "stream_options",
];

fn invalid(message: impl Into<String>, param: &str) -> ApiError {
    ApiError::invalid(message, Some(param))
}

/// Text of a message item's `content`: a string or `input_text` /
/// `output_text` parts.
fn item_text(i: usize, content: Option<&Value>) -> Result<String, ApiError> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut out = String::new();
            for p in parts {
                match (p.get("type").and_then(Value::as_str), p.get("text")) {
                    (Some("input_text" | "output_text" | "text"), Some(Value::String(t))) => {
                        out.push_str(t)
                    }
                    _ => {
                        return Err(invalid(
                            format!("input[{i}].content: only text parts are supported"),
                            "input",
                        ));
                    }
                }
            }
            Ok(out)
        }
        Some(_) => Err(invalid(
            format!("input[{i}].content must be a string or an array of parts"),
            "input",
        )),
    }
}

/// The equivalent chat completions body.
fn to_chat(body: &[u8], allow_extra: bool) -> Result<(Value, Map<String, Value>), ApiError> {
    let req = parse_request(body, allow_extra)?;
    let mut chat = Map::new();
    chat.insert("messages".into(), Value::Array(chat_messages(&req)?));
    for (from, to) in [
        ("model", "model"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("max_output_tokens", "max_completion_tokens"),
        ("parallel_tool_calls", "parallel_tool_calls"),
    ] {
        if let Some(v) = req.get(from).filter(|v| !v.is_null()) {
            chat.insert(to.into(), v.clone());
        }
    }
    if let Some(n) = req.get("top_logprobs").filter(|v| !v.is_null()) {
        chat.insert("logprobs".into(), Value::Bool(true));
        chat.insert("top_logprobs".into(), n.clone());
    }
    if let Some(Value::Array(tools)) = req.get("tools") {
        chat.insert("tools".into(), chat_tools(tools)?);
    }
    if let Some(choice) = chat_tool_choice(req.get("tool_choice")) {
        chat.insert("tool_choice".into(), choice);
    }
    if let Some(format) = req.get("text").and_then(|t| t.get("format")) {
        chat.insert("response_format".into(), chat_response_format(format));
    }
    Ok((Value::Object(chat), req))
}

/// The body as a JSON object of known fields (any field with
/// `allow_extra`), without `previous_response_id`.
fn parse_request(body: &[u8], allow_extra: bool) -> Result<Map<String, Value>, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("Invalid JSON body: {e}"), None))?;
    let Value::Object(req) = v else {
        return Err(ApiError::invalid(
            "The request body must be a JSON object",
            None,
        ));
    };
    for k in req.keys() {
        if !FIELDS.contains(&k.as_str()) && !IGNORED.contains(&k.as_str()) && !allow_extra {
            return Err(invalid(format!("Unrecognized request field `{k}`"), k));
        }
    }
    if req
        .get("previous_response_id")
        .is_some_and(|v| !v.is_null())
    {
        return Err(invalid(
            "`previous_response_id` is not supported: this server does not store \
             responses; send the whole conversation in `input`",
            "previous_response_id",
        ));
    }
    Ok(req)
}

/// The chat messages of `instructions` and `input`.
fn chat_messages(req: &Map<String, Value>) -> Result<Vec<Value>, ApiError> {
    let mut messages = Vec::new();
    if let Some(Value::String(s)) = req.get("instructions") {
        messages.push(json!({"role": "system", "content": s}));
    }
    match req.get("input") {
        Some(Value::String(s)) => messages.push(json!({"role": "user", "content": s})),
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                push_item(&mut messages, i, item)?;
            }
        }
        _ => {
            return Err(invalid(
                "`input` must be a string or an array of items",
                "input",
            ));
        }
    }
    Ok(messages)
}

/// Adds input item `i` to the chat messages.
fn push_item(messages: &mut Vec<Value>, i: usize, item: &Value) -> Result<(), ApiError> {
    let kind = item
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("message");
    match kind {
        "message" => {
            let role = item.get("role").and_then(Value::as_str).unwrap_or("user");
            let text = item_text(i, item.get("content"))?;
            messages.push(json!({"role": role, "content": text}));
        }
        "function_call" => push_function_call(messages, item),
        "function_call_output" => {
            let output = match item.get("output") {
                Some(Value::String(s)) => s.clone(),
                Some(other) => other.to_string(),
                None => String::new(),
            };
            messages.push(json!({
                "role": "tool",
                "tool_call_id": item.get("call_id").cloned().unwrap_or(Value::Null),
                "content": output,
            }));
        }
        // Reasoning items from an earlier turn carry nothing we use.
        "reasoning" => {}
        other => {
            return Err(invalid(
                format!("input[{i}].type `{other}` is not supported"),
                "input",
            ));
        }
    }
    Ok(())
}

/// A `function_call` item as an assistant tool call: consecutive calls
/// belong to one assistant turn.
fn push_function_call(messages: &mut Vec<Value>, item: &Value) {
    let call = json!({
        "id": item.get("call_id").cloned().unwrap_or(Value::Null),
        "type": "function",
        "function": {
            "name": item.get("name").cloned().unwrap_or(Value::Null),
            "arguments": item.get("arguments").cloned().unwrap_or(Value::Null),
        }
    });
    match messages.last_mut() {
        Some(m) if m["role"] == "assistant" && m["tool_calls"].is_array() => {
            if let Some(a) = m["tool_calls"].as_array_mut() {
                a.push(call);
            }
        }
        _ => messages.push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
    }
}

/// Function tools are flat here: {"type", "name", "description",
/// "parameters"}; chat nests all but the type under `function`.
fn chat_tools(tools: &[Value]) -> Result<Value, ApiError> {
    let mut out = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(invalid(
                format!("tools[{i}]: only function tools are supported"),
                "tools",
            ));
        }
        out.push(json!({"type": "function", "function": {
            "name": t.get("name").cloned().unwrap_or(Value::Null),
            "description": t.get("description").cloned().unwrap_or(Value::Null),
            "parameters": t.get("parameters").cloned().unwrap_or(Value::Null),
        }}));
    }
    Ok(Value::Array(out))
}

/// `tool_choice` in chat's form; `None` when absent or null.
fn chat_tool_choice(choice: Option<&Value>) -> Option<Value> {
    match choice {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(Value::String(s.clone())),
        Some(o) => {
            let name = o.get("name").cloned().unwrap_or(Value::Null);
            Some(json!({"type": "function", "function": {"name": name}}))
        }
    }
}

/// `text.format` as chat's `response_format`.
fn chat_response_format(format: &Value) -> Value {
    match format.get("type").and_then(Value::as_str) {
        Some("json_schema") => json!({"type": "json_schema", "json_schema": {
            "name": format.get("name").cloned().unwrap_or(Value::Null),
            "schema": format.get("schema").cloned().unwrap_or(Value::Null),
            "strict": format.get("strict").cloned().unwrap_or(Value::Null),
        }}),
        _ => format.clone(),
    }
}

/// An error about the output length of the chat request made from a
/// Responses request names the field the client sent, `max_output_tokens`.
fn output_field(e: ApiError) -> ApiError {
    const OURS: &str = "max_output_tokens";
    match e {
        ApiError::InvalidRequest {
            message,
            param: Some(p),
            code,
        } if p == "max_completion_tokens" => ApiError::InvalidRequest {
            message: message.replace(&format!("`{p}`"), &format!("`{OURS}`")),
            param: Some(OURS.into()),
            code,
        },
        e => e,
    }
}

/// The parts of a response object that echo the request.
fn echo(req: &Map<String, Value>) -> Map<String, Value> {
    let get = |k: &str, d: Value| req.get(k).filter(|v| !v.is_null()).cloned().unwrap_or(d);
    let mut m = Map::new();
    m.insert("instructions".into(), get("instructions", Value::Null));
    m.insert(
        "max_output_tokens".into(),
        get("max_output_tokens", Value::Null),
    );
    m.insert(
        "parallel_tool_calls".into(),
        get("parallel_tool_calls", json!(true)),
    );
    m.insert("temperature".into(), get("temperature", json!(1.0)));
    m.insert("top_p".into(), get("top_p", json!(1.0)));
    m.insert("tool_choice".into(), get("tool_choice", json!("auto")));
    m.insert("tools".into(), get("tools", json!([])));
    m.insert(
        "text".into(),
        get("text", json!({"format": {"type": "text"}})),
    );
    m.insert("metadata".into(), get("metadata", json!({})));
    m.insert("previous_response_id".into(), Value::Null);
    m.insert("reasoning".into(), Value::Null);
    m.insert("store".into(), json!(false));
    m.insert("truncation".into(), json!("disabled"));
    m.insert("user".into(), Value::Null);
    m
}

fn usage_json(u: &UsageInfo) -> Value {
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.prompt_tokens_details.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.total_tokens,
    })
}

/// One function call item.
fn call_item(id: &str, i: usize, c: &tools::ParsedCall, status: &str) -> Value {
    json!({
        "type": "function_call",
        "id": format!("fc_{}_{i}", suffix(id)),
        "call_id": call_id(id, 0, i),
        "name": c.name,
        "arguments": c.arguments,
        "status": status,
    })
}

/// The model's thinking (with a reasoning parser), as a reasoning item.
fn reasoning_item(id: &str, text: &str, status: &str) -> Value {
    let content = if text.is_empty() {
        json!([])
    } else {
        json!([{"type": "reasoning_text", "text": text}])
    };
    json!({
        "type": "reasoning",
        "id": format!("rs_{}", suffix(id)),
        "status": status,
        "summary": [],
        "content": content,
    })
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    json!({
        "type": "message",
        "id": format!("msg_{}", suffix(id)),
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    })
}

fn suffix(id: &str) -> &str {
    id.rsplit('_').next().unwrap_or(id)
}

/// What every response object of one request repeats.
struct ResponseHead {
    id: String,
    created: u64,
    model: String,
    /// The request's parameters, echoed.
    echo: Map<String, Value>,
}

impl ResponseHead {
    /// The response object.
    fn json(
        &self,
        status: &str,
        output: Vec<Value>,
        usage: Option<&UsageInfo>,
        incomplete: bool,
    ) -> Value {
        let mut r = Map::new();
        r.insert("id".into(), json!(self.id));
        r.insert("object".into(), json!("response"));
        r.insert("created_at".into(), json!(self.created));
        r.insert("status".into(), json!(status));
        r.insert("model".into(), json!(self.model));
        r.insert("output".into(), Value::Array(output));
        r.insert("usage".into(), usage.map_or(Value::Null, usage_json));
        r.insert("error".into(), Value::Null);
        r.insert(
            "incomplete_details".into(),
            if incomplete {
                json!({"reason": "max_output_tokens"})
            } else {
                Value::Null
            },
        );
        r.extend(self.echo.clone());
        Value::Object(r)
    }

    /// The whole response to a request that does not stream.
    fn whole(&self, out: &Output, finish: FinishReason, usage: &UsageInfo) -> Value {
        let id = &self.id;
        let mut items = Vec::new();
        if let Some(r) = &out.reasoning {
            items.push(reasoning_item(id, r, "completed"));
        }
        if !out.content.is_empty() || out.calls.is_empty() {
            items.push(message_item(id, &out.content, "completed"));
        }
        // Cut by max_output_tokens, calls too (the last one partial).
        let incomplete = finish == FinishReason::Length;
        let status = if incomplete {
            "incomplete"
        } else {
            "completed"
        };
        items.extend(
            out.calls
                .iter()
                .enumerate()
                .map(|(i, c)| call_item(id, i, c, status)),
        );
        self.json(status, items, Some(usage), incomplete)
    }
}

pub(super) async fn responses(
    state: State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let trace = RequestTrace::new("responses", &headers);
    let span = trace.span.clone();
    counted(
        responses_inner(state, body, arrived, trace)
            .instrument(span)
            .await,
    )
}

async fn responses_inner(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
    arrived: Instant,
    trace: RequestTrace,
) -> Result<Response, ApiError> {
    let awaiting = AwaitingAdmission::new();
    let body = body.map_err(|e| body_error(state.config().max_body_bytes, e))?;
    let allow_extra = state.config().allow_extra_request_fields;
    let (chat, req) = to_chat(&body, allow_extra)?;
    let stream = req.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let chat_bytes = serde_json::to_vec(&chat)
        .map_err(|e| ApiError::internal(format!("re-encoding a request: {e}")))?;
    let chat_req = ChatRequest::parse(&chat_bytes, allow_extra).map_err(output_field)?;
    let ChatJob {
        mut generations,
        output,
        ..
    } = start_chat(&state, &chat_req, arrived, &trace)
        .await
        .map_err(output_field)?;
    // The Responses API has no `n`: one generation.
    let generation = generations
        .pop()
        .ok_or_else(|| ApiError::internal("no generation started"))?;
    drop(awaiting);
    let head = ResponseHead {
        id: state.new_id("resp").replace('-', "_"),
        created: unix_now(),
        model: state.config().model_name.clone(),
        echo: echo(&req),
    };
    if !stream {
        let (text, _lps, finish, usage) = generation.collect().await?;
        let r = head.whole(&output.whole(&text), finish, &usage);
        return Ok(Json(r).into_response());
    }
    let events = async_stream::stream! {
        let mut seq = 0u64;
        let mut event = |(kind, mut data): Event| {
            data["type"] = json!(kind);
            data["sequence_number"] = json!(seq);
            seq += 1;
            let text = serde_json::to_string(&data).unwrap_or_default();
            Ok::<_, Infallible>(SseEvent::default().event(kind).data(text))
        };
        let mut items = StreamedItems::new(head);
        for e in items.start() {
            yield event(e);
        }
        let mut split = output.stream();
        let mut pieces = std::pin::pin!(generation.pieces(true));
        loop {
            let (s, done) = match pieces.next().await {
                // Calls are sent whole when the answer ends.
                Some(Piece::Text(t, _, _)) => (split.push(&t).0, None),
                Some(Piece::Done(f, u)) => {
                    let (s, _, calls) = split.finish();
                    (s, Some((f, u, calls)))
                }
                Some(Piece::Error(e)) => {
                    e.log();
                    yield event(items.failed(&e));
                    break;
                }
                None => break,
            };
            let mut out = Vec::new();
            items.piece(&s, done.as_ref().map(|(_, _, calls)| calls.is_empty()), &mut out);
            let finished = done.is_some();
            if let Some((f, u, calls)) = done {
                items.finish(f, &u, &calls, &mut out);
            }
            for e in out {
                yield event(e);
            }
            if finished {
                break;
            }
        }
    };
    Ok(Sse::new(events).into_response())
}

/// A streamed event's type and data (without `type` and
/// `sequence_number`, which the stream adds).
type Event = (&'static str, Value);

/// A streamed response's output items as they open and close.
struct StreamedItems {
    head: ResponseHead,
    msg_id: String,
    rs_id: String,
    /// Finished output items, in order.
    items: Vec<Value>,
    /// The open reasoning item's text, and the open message's (with
    /// their output indices).
    thinking: Option<(usize, String)>,
    message: Option<(usize, String)>,
}

impl StreamedItems {
    fn new(head: ResponseHead) -> Self {
        Self {
            msg_id: format!("msg_{}", suffix(&head.id)),
            rs_id: format!("rs_{}", suffix(&head.id)),
            head,
            items: Vec::new(),
            thinking: None,
            message: None,
        }
    }

    /// The events before the first piece.
    fn start(&self) -> [Event; 2] {
        let start = self.head.json("in_progress", Vec::new(), None, false);
        [
            ("response.created", json!({"response": start.clone()})),
            ("response.in_progress", json!({"response": start})),
        ]
    }

    /// The last event of a generation that failed.
    fn failed(&self, e: &ApiError) -> Event {
        let b = e.body().error;
        let mut failed = self.head.json("failed", Vec::new(), None, false);
        failed["error"] = json!({"code": b.code.unwrap_or(b.kind), "message": b.message});
        ("response.failed", json!({"response": failed}))
    }

    /// The events of one piece of the answer. `last`: `None` before the
    /// answer ends; with its last piece, whether it made no calls.
    fn piece(&mut self, s: &Split, last: Option<bool>, out: &mut Vec<Event>) {
        if !s.reasoning.is_empty() {
            self.reasoning(&s.reasoning, out);
        }
        // A response always has its message, even an empty one, unless
        // it made calls.
        let needs_message = !s.content.is_empty() || last == Some(true);
        if needs_message || last.is_some() {
            self.close_reasoning(out);
        }
        if needs_message && self.message.is_none() {
            self.open_message(out);
        }
        if !s.content.is_empty()
            && let Some((index, text)) = &mut self.message
        {
            text.push_str(&s.content);
            out.push((
                "response.output_text.delta",
                json!({
                    "item_id": self.msg_id,
                    "output_index": *index,
                    "content_index": 0,
                    "delta": s.content,
                    "logprobs": [],
                }),
            ));
        }
    }

    /// Reasoning text: opens the reasoning item first if it is not open.
    fn reasoning(&mut self, delta: &str, out: &mut Vec<Event>) {
        let (index, text) = self.thinking.get_or_insert_with(|| {
            let index = self.items.len();
            out.push((
                "response.output_item.added",
                json!({
                    "output_index": index,
                    "item": reasoning_item(&self.head.id, "", "in_progress"),
                }),
            ));
            (index, String::new())
        });
        text.push_str(delta);
        out.push((
            "response.reasoning_text.delta",
            json!({
                "item_id": self.rs_id,
                "output_index": *index,
                "content_index": 0,
                "delta": delta,
            }),
        ));
    }

    fn close_reasoning(&mut self, out: &mut Vec<Event>) {
        let Some((index, text)) = self.thinking.take() else {
            return;
        };
        out.push((
            "response.reasoning_text.done",
            json!({
                "item_id": self.rs_id,
                "output_index": index,
                "content_index": 0,
                "text": text,
            }),
        ));
        let item = reasoning_item(&self.head.id, &text, "completed");
        out.push((
            "response.output_item.done",
            json!({"output_index": index, "item": item.clone()}),
        ));
        self.items.push(item);
    }

    fn open_message(&mut self, out: &mut Vec<Event>) {
        let index = self.items.len();
        out.push((
            "response.output_item.added",
            json!({
                "output_index": index,
                "item": message_item(&self.head.id, "", "in_progress"),
            }),
        ));
        out.push((
            "response.content_part.added",
            json!({
                "item_id": self.msg_id,
                "output_index": index,
                "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": []},
            }),
        ));
        self.message = Some((index, String::new()));
    }

    fn close_message(&mut self, out: &mut Vec<Event>) {
        let Some((index, text)) = self.message.take() else {
            return;
        };
        out.push((
            "response.output_text.done",
            json!({
                "item_id": self.msg_id,
                "output_index": index,
                "content_index": 0,
                "text": text,
                "logprobs": [],
            }),
        ));
        out.push((
            "response.content_part.done",
            json!({
                "item_id": self.msg_id,
                "output_index": index,
                "content_index": 0,
                "part": {"type": "output_text", "text": text, "annotations": []},
            }),
        ));
        let item = message_item(&self.head.id, &text, "completed");
        out.push((
            "response.output_item.done",
            json!({"output_index": index, "item": item.clone()}),
        ));
        self.items.push(item);
    }

    /// The answer ended: the message closes, the calls are sent whole,
    /// and the response is complete (or cut by its length limit).
    fn finish(
        &mut self,
        finish: FinishReason,
        usage: &UsageInfo,
        calls: &[tools::ParsedCall],
        out: &mut Vec<Event>,
    ) {
        self.close_message(out);
        let incomplete = finish == FinishReason::Length;
        let call_status = if incomplete {
            "incomplete"
        } else {
            "completed"
        };
        for (i, c) in calls.iter().enumerate() {
            self.call(i, c, call_status, out);
        }
        let (status, kind) = if incomplete {
            ("incomplete", "response.incomplete")
        } else {
            ("completed", "response.completed")
        };
        let items = std::mem::take(&mut self.items);
        let r = self.head.json(status, items, Some(usage), incomplete);
        out.push((kind, json!({"response": r})));
    }

    /// Call `i`, sent whole: added, its arguments, done.
    fn call(&mut self, i: usize, c: &tools::ParsedCall, status: &str, out: &mut Vec<Event>) {
        let index = self.items.len();
        let id = &self.head.id;
        let mut added = call_item(id, i, c, "in_progress");
        added["arguments"] = json!("");
        let item_id = added["id"].clone();
        out.push((
            "response.output_item.added",
            json!({"output_index": index, "item": added}),
        ));
        out.push((
            "response.function_call_arguments.delta",
            json!({"item_id": item_id, "output_index": index, "delta": c.arguments}),
        ));
        out.push((
            "response.function_call_arguments.done",
            json!({"item_id": item_id, "output_index": index, "arguments": c.arguments}),
        ));
        let done = call_item(id, i, c, status);
        out.push((
            "response.output_item.done",
            json!({"output_index": index, "item": done.clone()}),
        ));
        self.items.push(done);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn input_items_become_chat_messages() {
        let body = json!({
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "2+3?"}]},
                {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{\"a\":2,\"b\":3}"},
                {"type": "function_call_output", "call_id": "c1", "output": "5"}
            ],
            "tools": [{"type": "function", "name": "add", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "add"},
            "max_output_tokens": 7,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
            "store": false,
        });
        let (chat, _) = to_chat(body.to_string().as_bytes(), false).unwrap();
        let m = &chat["messages"];
        assert_eq!(m[0], json!({"role": "system", "content": "Be brief."}));
        assert_eq!(m[1], json!({"role": "user", "content": "2+3?"}));
        assert_eq!(m[2]["tool_calls"][0]["function"]["name"], "add");
        assert_eq!(m[3]["role"], "tool");
        assert_eq!(m[3]["tool_call_id"], "c1");
        assert_eq!(chat["tools"][0]["function"]["name"], "add");
        assert_eq!(chat["tool_choice"]["function"]["name"], "add");
        assert_eq!(chat["max_completion_tokens"], 7);
        assert_eq!(
            chat["response_format"]["json_schema"]["schema"],
            json!({"type": "object"})
        );
        // And the chat parser accepts what came out.
        let req = ChatRequest::parse(chat.to_string().as_bytes(), false).unwrap();
        assert!(req.params().is_ok());
    }

    #[test]
    fn what_cannot_be_served_is_named() {
        for (body, param) in [
            (
                json!({"input": "x", "previous_response_id": "resp_1"}),
                "previous_response_id",
            ),
            (json!({"input": 3}), "input"),
            (
                json!({"input": "x", "tools": [{"type": "web_search"}]}),
                "tools",
            ),
            (
                json!({"input": [{"type": "image_generation_call"}]}),
                "input",
            ),
            (json!({"input": "x", "bogus": 1}), "bogus"),
        ] {
            let e = to_chat(body.to_string().as_bytes(), false).unwrap_err();
            assert_eq!(e.body().error.param.as_deref(), Some(param), "{body}");
        }
    }
}
