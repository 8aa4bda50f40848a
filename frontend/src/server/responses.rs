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

use super::*;

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
    let mut messages = Vec::new();
    if let Some(Value::String(s)) = req.get("instructions") {
        messages.push(json!({"role": "system", "content": s}));
    }
    match req.get("input") {
        Some(Value::String(s)) => messages.push(json!({"role": "user", "content": s})),
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
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
                    "function_call" => {
                        let call = json!({
                            "id": item.get("call_id").cloned().unwrap_or(Value::Null),
                            "type": "function",
                            "function": {
                                "name": item.get("name").cloned().unwrap_or(Value::Null),
                                "arguments": item.get("arguments").cloned().unwrap_or(Value::Null),
                            }
                        });
                        // Consecutive calls belong to one assistant turn.
                        match messages.last_mut() {
                            Some(m) if m["role"] == "assistant" && m["tool_calls"].is_array() => {
                                if let Some(a) = m["tool_calls"].as_array_mut() {
                                    a.push(call);
                                }
                            }
                            _ => messages.push(
                                json!({"role": "assistant", "content": null, "tool_calls": [call]}),
                            ),
                        }
                    }
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
            }
        }
        _ => {
            return Err(invalid(
                "`input` must be a string or an array of items",
                "input",
            ));
        }
    }
    let mut chat = Map::new();
    chat.insert("messages".into(), Value::Array(messages));
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
    // Function tools are flat here: {"type", "name", "description", "parameters"}.
    if let Some(Value::Array(tools)) = req.get("tools") {
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
        chat.insert("tools".into(), Value::Array(out));
    }
    match req.get("tool_choice") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => {
            chat.insert("tool_choice".into(), Value::String(s.clone()));
        }
        Some(o) => {
            let name = o.get("name").cloned().unwrap_or(Value::Null);
            chat.insert(
                "tool_choice".into(),
                json!({"type": "function", "function": {"name": name}}),
            );
        }
    }
    if let Some(format) = req.get("text").and_then(|t| t.get("format")) {
        let rf = match format.get("type").and_then(Value::as_str) {
            Some("json_schema") => json!({"type": "json_schema", "json_schema": {
                "name": format.get("name").cloned().unwrap_or(Value::Null),
                "schema": format.get("schema").cloned().unwrap_or(Value::Null),
                "strict": format.get("strict").cloned().unwrap_or(Value::Null),
            }}),
            _ => format.clone(),
        };
        chat.insert("response_format".into(), rf);
    }
    Ok((Value::Object(chat), req))
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

/// The response object.
#[allow(clippy::too_many_arguments)]
fn response_json(
    id: &str,
    created: u64,
    model: &str,
    status: &str,
    output: Vec<Value>,
    usage: Option<&UsageInfo>,
    incomplete: bool,
    echo: &Map<String, Value>,
) -> Value {
    let mut r = Map::new();
    r.insert("id".into(), json!(id));
    r.insert("object".into(), json!("response"));
    r.insert("created_at".into(), json!(created));
    r.insert("status".into(), json!(status));
    r.insert("model".into(), json!(model));
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
    r.extend(echo.clone());
    Value::Object(r)
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
    let id = state.new_id("resp").replace('-', "_");
    let created = unix_now();
    let model = state.config().model_name.clone();
    let echo = echo(&req);
    if !stream {
        let (text, _lps, finish, usage) = generation.collect().await?;
        let out = output.whole(&text);
        let mut items = Vec::new();
        if let Some(r) = &out.reasoning {
            items.push(reasoning_item(&id, r, "completed"));
        }
        if !out.content.is_empty() || out.calls.is_empty() {
            items.push(message_item(&id, &out.content, "completed"));
        }
        // Cut by max_output_tokens, calls too (the last one partial).
        let incomplete = finish == FinishReason::Length;
        let call_status = if incomplete {
            "incomplete"
        } else {
            "completed"
        };
        items.extend(
            out.calls
                .iter()
                .enumerate()
                .map(|(i, c)| call_item(&id, i, c, call_status)),
        );
        let status = if incomplete {
            "incomplete"
        } else {
            "completed"
        };
        let r = response_json(
            &id,
            created,
            &model,
            status,
            items,
            Some(&usage),
            incomplete,
            &echo,
        );
        return Ok(Json(r).into_response());
    }
    let events = async_stream::stream! {
        let mut seq = 0u64;
        let mut event = |kind: &str, mut data: Value| {
            data["type"] = json!(kind);
            data["sequence_number"] = json!(seq);
            seq += 1;
            let text = serde_json::to_string(&data).unwrap_or_default();
            Ok::<_, Infallible>(SseEvent::default().event(kind).data(text))
        };
        let start = response_json(&id, created, &model, "in_progress", Vec::new(), None, false, &echo);
        yield event("response.created", json!({"response": start.clone()}));
        yield event("response.in_progress", json!({"response": start}));
        let msg_id = format!("msg_{}", suffix(&id));
        let rs_id = format!("rs_{}", suffix(&id));
        let mut split = output.stream();
        // Finished output items, in order.
        let mut items: Vec<Value> = Vec::new();
        // The open reasoning item's text, and the open message's (with
        // their output indices).
        let mut thinking: Option<(usize, String)> = None;
        let mut message: Option<(usize, String)> = None;
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
                    let b = e.body().error;
                    let mut failed = response_json(&id, created, &model, "failed", Vec::new(), None, false, &echo);
                    failed["error"] = json!({"code": b.code.unwrap_or(b.kind), "message": b.message});
                    yield event("response.failed", json!({"response": failed}));
                    break;
                }
                None => break,
            };
            if !s.reasoning.is_empty() {
                if thinking.is_none() {
                    let index = items.len();
                    yield event("response.output_item.added", json!({"output_index": index,
                        "item": reasoning_item(&id, "", "in_progress")}));
                    thinking = Some((index, String::new()));
                }
                if let Some((index, text)) = &mut thinking {
                    text.push_str(&s.reasoning);
                    yield event("response.reasoning_text.delta", json!({"item_id": rs_id,
                        "output_index": *index, "content_index": 0, "delta": s.reasoning}));
                }
            }
            // A response always has its message, even an empty one, unless
            // it made calls.
            let needs_message = !s.content.is_empty()
                || done.as_ref().is_some_and(|(_, _, calls)| calls.is_empty());
            if (needs_message || done.is_some())
                && let Some((index, text)) = thinking.take()
            {
                yield event("response.reasoning_text.done", json!({"item_id": rs_id,
                    "output_index": index, "content_index": 0, "text": text}));
                let item = reasoning_item(&id, &text, "completed");
                yield event("response.output_item.done", json!({"output_index": index, "item": item.clone()}));
                items.push(item);
            }
            if needs_message && message.is_none() {
                let index = items.len();
                yield event("response.output_item.added", json!({"output_index": index,
                    "item": message_item(&id, "", "in_progress")}));
                yield event("response.content_part.added", json!({"item_id": msg_id, "output_index": index,
                    "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}}));
                message = Some((index, String::new()));
            }
            if !s.content.is_empty()
                && let Some((index, text)) = &mut message
            {
                text.push_str(&s.content);
                yield event("response.output_text.delta", json!({"item_id": msg_id,
                    "output_index": *index, "content_index": 0, "delta": s.content, "logprobs": []}));
            }
            let Some((f, u, calls)) = done else { continue };
            if let Some((index, text)) = message.take() {
                yield event("response.output_text.done", json!({"item_id": msg_id,
                    "output_index": index, "content_index": 0, "text": text, "logprobs": []}));
                yield event("response.content_part.done", json!({"item_id": msg_id,
                    "output_index": index, "content_index": 0,
                    "part": {"type": "output_text", "text": text, "annotations": []}}));
                let item = message_item(&id, &text, "completed");
                yield event("response.output_item.done", json!({"output_index": index, "item": item.clone()}));
                items.push(item);
            }
            let incomplete = f == FinishReason::Length;
            let call_status = if incomplete { "incomplete" } else { "completed" };
            for (i, c) in calls.iter().enumerate() {
                let index = items.len();
                let mut added = call_item(&id, i, c, "in_progress");
                added["arguments"] = json!("");
                let item_id = added["id"].clone();
                yield event("response.output_item.added", json!({"output_index": index, "item": added}));
                yield event("response.function_call_arguments.delta", json!({"item_id": item_id,
                    "output_index": index, "delta": c.arguments}));
                yield event("response.function_call_arguments.done", json!({"item_id": item_id,
                    "output_index": index, "arguments": c.arguments}));
                let done = call_item(&id, i, c, call_status);
                yield event("response.output_item.done", json!({"output_index": index, "item": done.clone()}));
                items.push(done);
            }
            let (status, kind) = if incomplete {
                ("incomplete", "response.incomplete")
            } else {
                ("completed", "response.completed")
            };
            let r = response_json(&id, created, &model, status, items, Some(&u), incomplete, &echo);
            yield event(kind, json!({"response": r}));
            break;
        }
    };
    Ok(Sse::new(events).into_response())
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
