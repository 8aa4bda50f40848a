//! The OpenAPI 3.1 document of the front end's routes, served at `GET
//! /openapi.json` by `tandem serve` and `tandem router` (they share
//! [`crate::app`]).
//!
//! The schemas are generated from the wire types: the request and response
//! structs of [`crate::openai`] derive `utoipa::ToSchema`, so field names,
//! types, optionality and doc comments come from the code the server runs.
//! This module adds what the serde types cannot say, from the same
//! constants the parser uses: the shapes of the fields kept as raw JSON
//! (`messages[].content`, `tools`, `tool_choice`, `response_format`,
//! `logit_bias`), the limits that [`crate::openai`] and `SamplingParams`
//! enforce, the fields accepted and ignored or accepted only as no-ops, and
//! that unknown fields are refused. The Responses API and the error, health
//! and metrics bodies are built from JSON by hand (on the server they are
//! JSON built by hand too). The tests below check the document against the
//! parsers; `tests/tests/openapi.rs` fuzzes a running server from it.

use std::sync::OnceLock;

use axum::Json;
use axum::routing::{MethodRouter, get};
use serde_json::{Map, Value, json};
use tandem_modelfile::stop::MAX_STOP_BYTES;
use tandem_types::{MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS};
use utoipa::OpenApi;

use crate::auth::ApiKeys;
use crate::openai::{
    CHAT_HINTS, ChatCompletion, ChatCompletionChunk, ChatRequest, Completion, CompletionRequest,
    IGNORED, MAX_MESSAGES, MAX_N, MAX_STOP, ModelList, UNSUPPORTED,
};
use crate::server::{MAX_PROMPTS, ServerConfig};
use crate::tools::MAX_TOOLS;

#[derive(OpenApi)]
#[openapi(components(schemas(
    ChatRequest,
    CompletionRequest,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    ModelList,
)))]
struct Derived;

/// Who must send an API key (`Authorization: Bearer KEY`), as the server
/// is configured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Security {
    /// Keys are configured: the API routes (and this document) need one.
    pub keys: bool,
    /// `/health` needs one too (`--protect-health`).
    pub health: bool,
    /// `/metrics` needs one too (`--protect-metrics`).
    pub metrics: bool,
}

/// `GET /openapi.json` for a server with `config`: the document, with
/// bearer authentication while API keys are configured (they can be
/// replaced while serving).
pub(crate) fn route<S: Clone + Send + Sync + 'static>(config: &ServerConfig) -> MethodRouter<S> {
    let keys: ApiKeys = config.api_keys.clone();
    let (health, metrics) = (config.protect_health, config.protect_metrics);
    let model = config.model_name.clone();
    get(move || {
        let security = Security {
            keys: keys.enabled(),
            health,
            metrics,
        };
        let doc = document(&model, security);
        async move { Json(doc) }
    })
}

/// The OpenAPI document of a front end serving `model`.
pub fn document(model: &str, security: Security) -> Value {
    static BASE: OnceLock<Value> = OnceLock::new();
    let mut doc = BASE.get_or_init(base).clone();
    // Another name is a 404.
    for request in ["ChatRequest", "CompletionRequest", "ResponsesRequest"] {
        doc["components"]["schemas"][request]["properties"]["model"] = json!({
            "description": "The served model (optional).",
            "enum": [model, null],
        });
    }
    if security.keys {
        doc["components"]["securitySchemes"] = json!({
            "bearerAuth": {
                "type": "http",
                "scheme": "bearer",
                "description": "An API key of the server (--api-key, --api-key-file)."
            }
        });
        doc["security"] = json!([{"bearerAuth": []}]);
        for (path, protected) in [("/health", security.health), ("/metrics", security.metrics)] {
            if !protected {
                doc["paths"][path]["get"]["security"] = json!([]);
            }
        }
    }
    doc
}

/// The document without security requirements.
fn base() -> Value {
    // A derived document always serializes; `Null` would be caught by the
    // tests.
    let derived = serde_json::to_value(Derived::openapi()).unwrap_or(Value::Null);
    let mut schemas = match derived.pointer("/components/schemas") {
        Some(Value::Object(s)) => s.clone(),
        _ => Map::new(),
    };
    for name in ["ChatRequest", "CompletionRequest"] {
        inline_all_of(&mut schemas, name);
    }
    for (schema, property, patch) in property_patches() {
        let target = match (schemas.get_mut(schema), property) {
            (Some(s), "") => Some(s),
            (Some(s), p) => s.get_mut("properties").and_then(|ps| ps.get_mut(p)),
            (None, _) => None,
        };
        if let Some(t) = target {
            merge(t, patch);
        }
    }
    for name in ["ChatRequest", "CompletionRequest"] {
        let Some(Value::Object(s)) = schemas.get_mut(name) else {
            continue;
        };
        let props = s
            .entry("properties")
            .or_insert_with(|| json!({}))
            .as_object_mut();
        if let Some(props) = props {
            for f in IGNORED {
                props.insert((*f).into(), json!({"description": "Accepted and ignored."}));
            }
            for f in UNSUPPORTED {
                props.insert(
                    (*f).into(),
                    json!({
                        "type": "null",
                        "description": "Not supported: accepted only when null \
                                        (or its no-op value)."
                    }),
                );
            }
        }
        if name == "ChatRequest"
            && let Some(props) = s.get_mut("properties").and_then(Value::as_object_mut)
        {
            props.extend(chat_hint_schemas());
        }
        // Unknown fields are a 400 (unless --allow-extra-request-fields).
        s.insert("additionalProperties".into(), Value::Bool(false));
    }
    schemas.extend(hand_written_schemas());
    for (name, example) in examples() {
        if let Some(Value::Object(s)) = schemas.get_mut(name) {
            s.insert("examples".into(), json!([example]));
        }
    }
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "Tandem",
            "description": "OpenAI-compatible API of a Tandem server (`tandem serve`, \
                            `tandem router`). Errors are OpenAI's error object.",
            "version": env!("CARGO_PKG_VERSION"),
        },
        "paths": paths(),
        "components": {"schemas": schemas},
    })
}

/// The chat fields accepted when well formed and then ignored
/// ([`CHAT_HINTS`]), with the values accepted.
fn chat_hint_schemas() -> Map<String, Value> {
    let ignored = "Accepted and ignored: no effect on this server.";
    let mut m = Map::new();
    for (field, schema) in [
        ("prompt_cache_key", json!({"type": ["string", "null"]})),
        ("safety_identifier", json!({"type": ["string", "null"]})),
        (
            "prompt_cache_retention",
            json!({"enum": ["in_memory", "in-memory", "24h", null]}),
        ),
        (
            "verbosity",
            json!({"enum": ["low", "medium", "high", null]}),
        ),
        (
            "modalities",
            json!({"type": ["array", "null"], "items": {"const": "text"}, "minItems": 1,
                   "description": "Only [\"text\"]."}),
        ),
    ] {
        let mut schema = schema;
        if schema.get("description").is_none() {
            schema["description"] = json!(ignored);
        }
        m.insert(field.into(), schema);
    }
    debug_assert!(CHAT_HINTS.iter().all(|f| m.contains_key(*f)));
    m
}

/// A valid request for each request schema (tested).
fn examples() -> [(&'static str, Value); 3] {
    [
        (
            "ChatRequest",
            json!({"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}),
        ),
        (
            "CompletionRequest",
            json!({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}),
        ),
        (
            "ResponsesRequest",
            json!({"input": "Say hello.", "max_output_tokens": 8}),
        ),
    ]
}

/// Replaces `allOf` (how `#[serde(flatten)]` is derived) with one object
/// holding every part's properties, so that `additionalProperties: false`
/// can be said of the whole.
fn inline_all_of(schemas: &mut Map<String, Value>, name: &str) {
    let Some(Value::Array(parts)) = schemas.get(name).and_then(|s| s.get("allOf")).cloned() else {
        return;
    };
    let mut props = Map::new();
    let mut required: Vec<Value> = Vec::new();
    for part in parts {
        let part = match part.get("$ref").and_then(Value::as_str) {
            Some(r) => schemas
                .get(r.trim_start_matches("#/components/schemas/"))
                .cloned()
                .unwrap_or(Value::Null),
            None => part,
        };
        if let Some(Value::Object(p)) = part.get("properties") {
            props.extend(p.clone());
        }
        if let Some(Value::Array(r)) = part.get("required") {
            required.extend(r.iter().cloned());
        }
    }
    let mut merged = json!({"type": "object", "properties": props});
    if !required.is_empty() {
        merged["required"] = Value::Array(required);
    }
    if let Some(d) = schemas.get(name).and_then(|s| s.get("description")) {
        merged["description"] = d.clone();
    }
    schemas.insert(name.into(), merged);
}

/// Sets `patch`'s keys on `target` (replacing them).
/// A patch with `anyOf` is the whole schema: it replaces the derived one
/// (keeping its description, from the doc comment).
fn merge(target: &mut Value, patch: Value) {
    if let (Value::Object(t), Value::Object(p)) = (target, patch) {
        if p.contains_key("anyOf") {
            t.retain(|k, _| k == "description");
        }
        t.extend(p);
    }
}

/// The roles a message may have.
const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// The smallest positive `f32`: the parameters that must be positive are
/// `f32`, and a smaller positive JSON number reads as 0.
const TINY: f32 = f32::MIN_POSITIVE;

/// `{"anyOf": [schema, null]}`.
fn nullable(schema: Value) -> Value {
    json!({"anyOf": [schema, {"type": "null"}]})
}

/// What the derived schemas cannot say: (schema, property, keys to set);
/// an empty property patches the schema itself. Every named property
/// exists (tested).
fn property_patches() -> Vec<(&'static str, &'static str, Value)> {
    let bounded = |min: f64, max: f64| json!({"minimum": min, "maximum": max});
    let top = MAX_TOP_LOGPROBS as f64;
    let mut patches = vec![("Stop", "", stop_schema()), ("Prompt", "", prompt_schema())];
    for req in ["ChatRequest", "CompletionRequest"] {
        patches.extend(sampling_patches(req));
    }
    patches.extend([
        (
            "ChatRequest",
            "messages",
            json!({"minItems": 1, "maxItems": MAX_MESSAGES}),
        ),
        (
            "ChatRequest",
            "max_completion_tokens",
            json!({"minimum": 1}),
        ),
        ("ChatRequest", "top_logprobs", bounded(0.0, top)),
        (
            "ChatRequest",
            "tools",
            nullable(json!({"type": "array", "maxItems": MAX_TOOLS, "items": tool_schema()})),
        ),
        ("ChatRequest", "tool_choice", tool_choice_schema()),
        ("CompletionRequest", "logprobs", bounded(0.0, top)),
        ("RequestMessage", "role", json!({"enum": ROLES})),
        (
            "RequestMessage",
            "content",
            json!({
                "description": "Text, or an array of text parts.",
                "anyOf": [
                    {"type": "string"},
                    {"type": "array", "items": text_part_schema()},
                    {"type": "null"},
                ],
            }),
        ),
        (
            "RequestMessage",
            "tool_calls",
            nullable(json!({"type": "array", "items": tool_call_schema()})),
        ),
    ]);
    patches
}

/// The sampling bounds shared by the chat and completion requests.
fn sampling_patches(req: &'static str) -> [(&'static str, &'static str, Value); 11] {
    let bounded = |min: f64, max: f64| json!({"minimum": min, "maximum": max});
    [
        (req, "n", json!({"minimum": 1, "maximum": MAX_N})),
        (req, "max_tokens", json!({"minimum": 1})),
        (req, "temperature", bounded(0.0, 2.0)),
        (req, "top_p", json!({"minimum": TINY, "maximum": 1})),
        (req, "top_k", json!({"minimum": -1})),
        (req, "min_p", bounded(0.0, 1.0)),
        (req, "frequency_penalty", bounded(-2.0, 2.0)),
        (req, "presence_penalty", bounded(-2.0, 2.0)),
        (
            req,
            "repetition_penalty",
            json!({"minimum": TINY, "maximum": 10}),
        ),
        (req, "logit_bias", logit_bias_schema()),
        (req, "response_format", response_format_schema()),
    ]
}

/// A chat message's text part.
fn text_part_schema() -> Value {
    json!({
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    })
}

/// An assistant message's tool call.
fn tool_call_schema() -> Value {
    json!({
        "type": "object",
        "required": ["function"],
        "properties": {
            "id": {"type": "string"},
            "type": {"const": "function"},
            "function": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string"},
                    "arguments": {
                        "description": "JSON text, or the arguments object.",
                        "anyOf": [{"type": "string"}, {"type": "object"}, {"type": "null"}],
                    },
                },
            },
        },
    })
}

/// A chat request's tool.
fn tool_schema() -> Value {
    json!({
        "type": "object",
        "required": ["type", "function"],
        "properties": {
            "type": {"const": "function"},
            "function": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                    "description": {"type": ["string", "null"]},
                    "parameters": {
                        "description": "JSON schema of the arguments.",
                        "type": ["object", "null"],
                    },
                    "strict": {"type": ["boolean", "null"]},
                },
            },
        },
    })
}

/// A chat request's `tool_choice`.
fn tool_choice_schema() -> Value {
    json!({
        "anyOf": [
            {"enum": ["none", "auto", "required"]},
            {
                "type": "object",
                "required": ["function"],
                "properties": {
                    "type": {"const": "function"},
                    "function": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {"name": {"type": "string"}},
                    },
                },
            },
            {"type": "null"},
        ],
    })
}

/// `response_format`, the extensions included.
fn response_format_schema() -> Value {
    json!({
        "description": "What the output must match. `regex` and `grammar` (Lark) are extensions.",
        "anyOf": [
            {
                "type": "object",
                "required": ["type"],
                "properties": {"type": {"enum": ["text", "json_object"]}},
            },
            {
                "type": "object",
                "required": ["type", "json_schema"],
                "properties": {
                    "type": {"const": "json_schema"},
                    "json_schema": {
                        "type": "object",
                        "required": ["schema"],
                        "properties": {
                            "name": {"type": "string"},
                            "schema": {"type": ["object", "boolean"]},
                            "strict": {"type": ["boolean", "null"]},
                        },
                    },
                },
            },
            {
                "type": "object",
                "required": ["type", "regex"],
                "properties": {"type": {"const": "regex"}, "regex": {"type": "string"}},
            },
            {
                "type": "object",
                "required": ["type", "grammar"],
                "properties": {"type": {"const": "grammar"}, "grammar": {"type": "string"}},
            },
            {"type": "null"},
        ],
    })
}

/// `logit_bias`: token ids to biases.
fn logit_bias_schema() -> Value {
    nullable(json!({
        "type": "object",
        "maxProperties": MAX_LOGIT_BIAS,
        "propertyNames": {"pattern": "^[0-9]+$"},
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
    }))
}

/// `stop`: a string or a bounded array of them.
fn stop_schema() -> Value {
    json!({
        "anyOf": [
            {"type": "string", "maxLength": MAX_STOP_BYTES},
            {
                "type": "array",
                "maxItems": MAX_STOP,
                "items": {"type": "string", "maxLength": MAX_STOP_BYTES},
            },
        ],
    })
}

/// `prompt`: text or token ids, one prompt or a bounded batch.
fn prompt_schema() -> Value {
    // An empty text is an empty prompt (a 400).
    let text = json!({"type": "string", "minLength": 1});
    let token = json!({"type": "integer", "minimum": 0, "maximum": u32::MAX});
    json!({
        "anyOf": [
            text,
            {"type": "array", "minItems": 1, "items": token},
            {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS, "items": text},
            {
                "type": "array",
                "minItems": 1,
                "maxItems": MAX_PROMPTS,
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "items": token,
                },
            },
        ],
    })
}

/// The bodies that are JSON built by hand on the server too.
fn hand_written_schemas() -> Map<String, Value> {
    let mut out = Map::new();
    out.insert("ResponsesRequest".into(), responses_request_schema());
    out.insert("Response".into(), response_schema());
    out.insert("ErrorResponse".into(), error_schema());
    out.insert("Health".into(), health_schema());
    out
}

/// `/v1/responses`' body.
fn responses_request_schema() -> Value {
    let mut responses_props = json!({
        "model": {"type": ["string", "null"]},
        "input": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "minItems": 1, "items": responses_input_item_schema()},
            ],
        },
        "instructions": {"type": ["string", "null"]},
        "max_output_tokens": {"type": ["integer", "null"], "minimum": 1},
        "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
        "top_p": {"type": ["number", "null"], "minimum": TINY, "maximum": 1},
        "stream": {"type": ["boolean", "null"]},
        "stream_options": {"type": ["object", "null"]},
        "tools": nullable(json!({
            "type": "array",
            "maxItems": MAX_TOOLS,
            "items": {
                "type": "object",
                "required": ["type", "name"],
                "properties": {
                    "type": {"const": "function"},
                    "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                    "description": {"type": ["string", "null"]},
                    "parameters": {"type": ["object", "null"]},
                    "strict": {"type": ["boolean", "null"]},
                },
            },
        })),
        "tool_choice": {
            "anyOf": [
                {"enum": ["none", "auto", "required"]},
                {
                    "type": "object",
                    "required": ["type", "name"],
                    "properties": {"type": {"const": "function"}, "name": {"type": "string"}},
                },
                {"type": "null"},
            ],
        },
        "parallel_tool_calls": {"type": ["boolean", "null"]},
        "text": {
            "type": ["object", "null"],
            "properties": {
                "format": {
                    "type": "object",
                    "required": ["type"],
                    "properties": {
                        "type": {"enum": ["text", "json_object", "json_schema", "regex", "grammar"]},
                        "name": {"type": "string"},
                        "schema": {"type": ["object", "boolean"]},
                        "strict": {"type": ["boolean", "null"]},
                    },
                },
            },
        },
        "previous_response_id": {
            "type": "null",
            "description": "Not supported (responses are not stored): only null.",
        },
        "top_logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_TOP_LOGPROBS},
    });
    for f in RESPONSES_IGNORED {
        responses_props[*f] = json!({"description": "Accepted and ignored."});
    }
    json!({
        "type": "object",
        "description": "OpenAI's Responses API, stateless: `input` is translated to a chat \
                        request.",
        "required": ["input"],
        "properties": responses_props,
        "additionalProperties": false,
    })
}

/// One item of a `/v1/responses` `input` array.
fn responses_input_item_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "type": {
                "enum": ["message", "function_call", "function_call_output", "reasoning"],
                "description": "`message` when absent.",
            },
            "role": {"enum": ROLES, "description": "`user` when absent."},
            "content": {
                "anyOf": [
                    {"type": "string"},
                    {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["type", "text"],
                            "properties": {
                                "type": {"enum": ["input_text", "output_text", "text"]},
                                "text": {"type": "string"},
                            },
                        },
                    },
                    {"type": "null"},
                ],
            },
            "call_id": {"type": "string"},
            "name": {"type": "string"},
            "arguments": {"type": "string"},
            "output": {"type": "string"},
        },
    })
}

/// `/v1/responses`' answer.
fn response_schema() -> Value {
    json!({
        "type": "object",
        "required": ["id", "object", "created_at", "status", "model", "output"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "response"},
            "created_at": {"type": "integer"},
            "status": {"enum": ["completed", "incomplete", "failed", "in_progress"]},
            "model": {"type": "string"},
            "output": {"type": "array", "items": {"type": "object"}},
            "usage": {"type": ["object", "null"]},
        },
    })
}

/// Every error's body.
fn error_schema() -> Value {
    json!({
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
            },
        },
    })
}

/// `/health`'s body.
fn health_schema() -> Value {
    json!({
        "type": "object",
        "required": ["status", "requests_in_flight"],
        "properties": {
            "status": {"type": "string", "description": "`ok` when ready, `draining`, or why not ready."},
            "requests_in_flight": {"type": "integer", "minimum": 0},
        },
    })
}

/// Fields of `/v1/responses` accepted and ignored.
const RESPONSES_IGNORED: &[&str] = &[
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

fn schema_ref(name: &str) -> Value {
    json!({"$ref": format!("#/components/schemas/{name}")})
}

fn error(description: &str) -> Value {
    json!({
        "description": description,
        "content": {"application/json": {"schema": schema_ref("ErrorResponse")}},
    })
}

/// The error statuses every route may answer.
fn common_errors() -> Map<String, Value> {
    let mut m = Map::new();
    m.insert(
        "401".into(),
        error("No API key, or not one of the server's."),
    );
    m.insert("404".into(), error("No such route."));
    m.insert(
        "429".into(),
        error("This API key has too many requests in flight (retryable)."),
    );
    m.insert(
        "503".into(),
        error("Overloaded, not ready or shutting down (retryable)."),
    );
    m.insert("500".into(), error("An internal error."));
    m
}

/// A generation endpoint: JSON in, a JSON body or (with `stream`) an SSE
/// stream, each of whose events `event` describes.
fn generation(summary: &str, request: &str, response: &str, event: Value) -> Value {
    let mut responses = common_errors();
    responses.insert(
        "200".into(),
        json!({
            "description": "The result; with `stream: true`, server-sent events (an error \
                            after the stream started is an error event).",
            "content": {
                "application/json": {"schema": schema_ref(response)},
                "text/event-stream": {"schema": event},
            },
        }),
    );
    responses.insert(
        "400".into(),
        error("The request is malformed or asks for what the server does not do."),
    );
    responses.insert(
        "404".into(),
        error("No such route, or the request names another model."),
    );
    responses.insert(
        "408".into(),
        error("The request body did not arrive in time."),
    );
    responses.insert(
        "413".into(),
        error("The request body is larger than the server accepts."),
    );
    responses.insert("415".into(), error("The request body is not JSON."));
    json!({
        "post": {
            "summary": summary,
            "requestBody": {
                "required": true,
                "content": {"application/json": {"schema": schema_ref(request)}},
            },
            "responses": by_status(responses),
        }
    })
}

/// One event of an OpenAI stream: a `chunk` object, an error object, or
/// the closing `[DONE]`.
fn openai_event(chunk: &str) -> Value {
    json!({
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "anyOf": [
                    {"const": "[DONE]"},
                    {
                        "contentMediaType": "application/json",
                        "contentSchema": {
                            "anyOf": [schema_ref(chunk), schema_ref("ErrorResponse")],
                        },
                    },
                ],
            },
        },
    })
}

/// One event of a Responses stream: `event: response.*`, and data of that
/// `type` with its `sequence_number`.
fn responses_event() -> Value {
    let kind = json!({"type": "string", "pattern": "^response\\."});
    json!({
        "type": "object",
        "required": ["event", "data"],
        "properties": {
            "event": kind,
            "data": {
                "contentMediaType": "application/json",
                "contentSchema": {
                    "type": "object",
                    "required": ["type", "sequence_number"],
                    "properties": {
                        "type": kind,
                        "sequence_number": {"type": "integer", "minimum": 0},
                    },
                },
            },
        },
    })
}

/// `responses` in the order of their status codes.
fn by_status(responses: Map<String, Value>) -> Map<String, Value> {
    let mut all: Vec<(String, Value)> = responses.into_iter().collect();
    all.sort_by(|a, b| a.0.cmp(&b.0));
    all.into_iter().collect()
}

fn paths() -> Value {
    let get_json = |summary: &str, schema: Value| {
        let mut responses = common_errors();
        responses.insert(
            "200".into(),
            json!({"description": summary, "content": {"application/json": {"schema": schema}}}),
        );
        json!({"get": {"summary": summary, "responses": by_status(responses)}})
    };
    let mut health = common_errors();
    let health_body = json!({"application/json": {"schema": schema_ref("Health")}});
    health.insert(
        "200".into(),
        json!({"description": "Ready.", "content": health_body}),
    );
    health.insert(
        "503".into(),
        json!({"description": "Draining or not ready.", "content": health_body}),
    );
    let mut metrics = common_errors();
    metrics.insert(
        "200".into(),
        json!({
            "description": "Prometheus text exposition.",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }),
    );
    metrics.insert("404".into(), error("Metrics are not enabled."));
    json!({
        "/v1/chat/completions": generation(
            "Chat completion", "ChatRequest", "ChatCompletion", openai_event("ChatCompletionChunk")),
        "/v1/completions": generation(
            "Text completion", "CompletionRequest", "Completion", openai_event("Completion")),
        "/v1/responses": generation(
            "Responses API (stateless)", "ResponsesRequest", "Response", responses_event()),
        "/v1/models": get_json("The served model.", schema_ref("ModelList")),
        "/health": {"get": {"summary": "Readiness and load.", "responses": by_status(health)}},
        "/metrics": {"get": {"summary": "Prometheus metrics.", "responses": by_status(metrics)}},
        "/openapi.json": get_json("This document.", json!({"type": "object"})),
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::error::ApiError;
    use crate::openai::{CHAT_FIELDS, COMPLETION_FIELDS};

    fn doc() -> Value {
        document("m", Security::default())
    }

    fn schema<'a>(doc: &'a Value, name: &str) -> &'a Value {
        doc.pointer(&format!("/components/schemas/{name}"))
            .unwrap_or_else(|| panic!("no schema {name}"))
    }

    fn properties(doc: &Value, name: &str) -> Vec<String> {
        let mut v: Vec<String> = schema(doc, name)["properties"]
            .as_object()
            .unwrap_or_else(|| panic!("{name} has no properties"))
            .keys()
            .cloned()
            .collect();
        v.sort();
        v
    }

    fn required(doc: &Value, name: &str) -> Vec<String> {
        let mut v: Vec<String> = schema(doc, name)["required"]
            .as_array()
            .map(|a| a.iter().map(|s| s.as_str().unwrap().to_string()).collect())
            .unwrap_or_default();
        v.sort();
        v
    }

    fn sorted(lists: &[&[&str]]) -> Vec<String> {
        let mut v: Vec<String> = lists
            .iter()
            .flat_map(|l| l.iter().map(|s| s.to_string()))
            .collect();
        v.sort();
        v.dedup();
        v
    }

    /// Every `$ref` in `v` names a schema of `doc`.
    fn refs_resolve(doc: &Value, v: &Value, at: &str) {
        match v {
            Value::Object(o) => {
                if let Some(r) = o.get("$ref") {
                    let r = r.as_str().unwrap();
                    assert!(
                        doc.pointer(r.trim_start_matches('#')).is_some(),
                        "{at}: dangling {r}"
                    );
                }
                for (k, x) in o {
                    refs_resolve(doc, x, &format!("{at}/{k}"));
                }
            }
            Value::Array(a) => {
                for (i, x) in a.iter().enumerate() {
                    refs_resolve(doc, x, &format!("{at}/{i}"));
                }
            }
            _ => {}
        }
    }

    #[test]
    fn every_route_is_documented_and_every_ref_resolves() {
        let d = doc();
        assert_eq!(d["openapi"], "3.1.0");
        let mut paths: Vec<&String> = d["paths"].as_object().unwrap().keys().collect();
        paths.sort();
        assert_eq!(
            paths,
            [
                "/health",
                "/metrics",
                "/openapi.json",
                "/v1/chat/completions",
                "/v1/completions",
                "/v1/models",
                "/v1/responses"
            ]
        );
        refs_resolve(&d, &d, "");
        assert!(d.get("security").is_none());
        for request in ["ChatRequest", "CompletionRequest", "ResponsesRequest"] {
            let model = &schema(&d, request)["properties"]["model"];
            assert_eq!(model["enum"], json!(["m", null]), "{request}");
        }
    }

    #[test]
    fn chat_fields_are_the_parsers() {
        let d = doc();
        assert_eq!(
            properties(&d, "ChatRequest"),
            sorted(&[CHAT_FIELDS, IGNORED, UNSUPPORTED, CHAT_HINTS])
        );
        assert_eq!(
            properties(&d, "CompletionRequest"),
            sorted(&[COMPLETION_FIELDS, IGNORED, UNSUPPORTED])
        );
        for name in ["ChatRequest", "CompletionRequest", "ResponsesRequest"] {
            assert_eq!(schema(&d, name)["additionalProperties"], false, "{name}");
        }
        // Required in the document exactly when the parser requires it.
        assert_eq!(required(&d, "ChatRequest"), ["messages"]);
        assert_eq!(required(&d, "CompletionRequest"), ["prompt"]);
        assert!(ChatRequest::parse(b"{}", false).is_err());
        assert!(ChatRequest::parse(br#"{"messages":[]}"#, false).is_ok());
        assert!(CompletionRequest::parse(b"{}", false).is_err());
        assert!(CompletionRequest::parse(br#"{"prompt":"x"}"#, false).is_ok());
        // Every documented optional field is accepted by the parser (as
        // null, which every one of them allows), and an undocumented one
        // is refused.
        for f in properties(&d, "ChatRequest") {
            if f == "messages" {
                continue;
            }
            let body = json!({"messages": [], f.clone(): null}).to_string();
            assert!(ChatRequest::parse(body.as_bytes(), false).is_ok(), "{f}");
        }
        for f in properties(&d, "CompletionRequest") {
            if f == "prompt" {
                continue;
            }
            let body = json!({"prompt": "x", f.clone(): null}).to_string();
            assert!(
                CompletionRequest::parse(body.as_bytes(), false).is_ok(),
                "{f}"
            );
        }
        assert!(ChatRequest::parse(br#"{"messages":[],"undocumented":1}"#, false).is_err());
    }

    #[test]
    fn documented_values_parse_and_limits_are_the_parsers() {
        let d = doc();
        let chat = |extra: Value| {
            let mut body = json!({"messages": [{"role": "user", "content": "hi"}]});
            body.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            ChatRequest::parse(body.to_string().as_bytes(), false).and_then(|r| {
                r.params()?;
                r.messages(crate::tools::ToolParser::Hermes, None)?;
                crate::tools::parse_choice(
                    r.tool_choice.as_ref(),
                    &crate::tools::parse_tools(r.tools.as_ref())?,
                )?;
                Ok(())
            })
        };
        let p = |name: &str| schema(&d, "ChatRequest")["properties"][name].clone();
        // At the documented bounds: accepted; past them: refused.
        assert_eq!(p("n")["maximum"], MAX_N as f64);
        assert!(chat(json!({"n": MAX_N})).is_ok());
        assert!(chat(json!({"n": MAX_N + 1})).is_err());
        assert!(chat(json!({"n": 0})).is_err());
        assert_eq!(p("top_logprobs")["maximum"], MAX_TOP_LOGPROBS as f64);
        assert!(chat(json!({"logprobs": true, "top_logprobs": MAX_TOP_LOGPROBS})).is_ok());
        assert!(chat(json!({"logprobs": true, "top_logprobs": MAX_TOP_LOGPROBS + 1})).is_err());
        for (name, lo, hi) in [
            ("temperature", 0.0, 2.0),
            ("min_p", 0.0, 1.0),
            ("frequency_penalty", -2.0, 2.0),
            ("presence_penalty", -2.0, 2.0),
        ] {
            assert_eq!(
                (p(name)["minimum"].as_f64(), p(name)["maximum"].as_f64()),
                (Some(lo), Some(hi)),
                "{name}"
            );
            assert!(
                chat(json!({name: lo})).is_ok() && chat(json!({name: hi})).is_ok(),
                "{name}"
            );
            assert!(chat(json!({name: hi + 0.5})).is_err(), "{name}");
            assert!(chat(json!({name: lo - 0.5})).is_err(), "{name}");
        }
        assert!(chat(json!({"top_p": 1})).is_ok() && chat(json!({"top_p": 0})).is_err());
        assert_eq!(p("top_p")["minimum"], TINY);
        assert!(chat(json!({"top_p": TINY})).is_ok());
        assert!(chat(json!({"repetition_penalty": TINY})).is_ok());
        // Below the smallest f32, a positive number reads as 0.
        assert!(chat(json!({"top_p": 1e-50})).is_err());
        assert!(chat(json!({"repetition_penalty": 10})).is_ok());
        assert!(chat(json!({"repetition_penalty": 0})).is_err());
        assert!(chat(json!({"top_k": -1})).is_ok() && chat(json!({"top_k": -2})).is_err());
        assert!(chat(json!({"max_tokens": 1})).is_ok() && chat(json!({"max_tokens": 0})).is_err());
        assert_eq!(schema(&d, "Stop")["anyOf"][1]["maxItems"], MAX_STOP);
        assert!(chat(json!({"stop": vec!["a"; MAX_STOP]})).is_ok());
        assert!(chat(json!({"stop": vec!["a"; MAX_STOP + 1]})).is_err());
        // The shapes of the raw-JSON fields: each documented alternative
        // is accepted.
        for rf in [
            json!({"type": "text"}),
            json!({"type": "json_object"}),
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}),
            json!({"type": "regex", "regex": "a+"}),
            json!({"type": "grammar", "grammar": "start: \"a\""}),
        ] {
            assert!(chat(json!({"response_format": rf})).is_ok(), "{rf}");
        }
        let tools = json!([{"type": "function", "function": {"name": "get_x",
            "description": "d", "parameters": {"type": "object"}}}]);
        for choice in [
            json!("none"),
            json!("auto"),
            json!("required"),
            json!({"type": "function", "function": {"name": "get_x"}}),
        ] {
            assert!(
                chat(json!({"tools": tools, "tool_choice": choice})).is_ok(),
                "{choice}"
            );
        }
        for role in ["system", "developer", "user", "assistant", "tool"] {
            let body = json!({"messages": [{"role": role, "content": [{"type": "text", "text": "a"}],
                "tool_calls": [{"id": "c", "type": "function",
                    "function": {"name": "f", "arguments": "{}"}}]}]});
            let r = ChatRequest::parse(body.to_string().as_bytes(), false).unwrap();
            assert!(
                r.messages(crate::tools::ToolParser::Hermes, None).is_ok(),
                "{role}"
            );
        }
        assert!(chat(json!({"logit_bias": {"5": -100, "7": 100}})).is_ok());
        assert!(chat(json!({"logit_bias": {"5": 101}})).is_err());
        // Completions: every documented prompt shape.
        for prompt in [
            json!("a"),
            json!([1, 2]),
            json!(["a", "b"]),
            json!([[1], [2, 3]]),
        ] {
            let body = json!({"prompt": prompt}).to_string();
            assert!(
                CompletionRequest::parse(body.as_bytes(), false).is_ok(),
                "{prompt}"
            );
        }
    }

    #[test]
    fn every_patch_lands_on_a_derived_property() {
        let d = doc();
        for (name, property, patch) in property_patches() {
            let s = schema(&d, name);
            let p = if property.is_empty() {
                s
            } else {
                &s["properties"][property]
            };
            for (k, v) in patch.as_object().unwrap() {
                assert_eq!(&p[k], v, "{name}.{property}.{k}");
            }
        }
    }

    #[test]
    fn examples_are_valid_requests() {
        let d = doc();
        for (name, example) in examples() {
            assert_eq!(schema(&d, name)["examples"], json!([example]), "{name}");
        }
        let [(_, chat), (_, completion), _] = examples();
        let chat = ChatRequest::parse(chat.to_string().as_bytes(), false).unwrap();
        assert!(chat.params().is_ok());
        assert!(
            chat.messages(crate::tools::ToolParser::Hermes, None)
                .is_ok()
        );
        let completion =
            CompletionRequest::parse(completion.to_string().as_bytes(), false).unwrap();
        assert!(completion.params().is_ok());
    }

    #[test]
    fn error_bodies_match_their_schema() {
        let d = doc();
        let s = schema(&d, "ErrorResponse");
        let fields: Vec<&String> = s["properties"]["error"]["properties"]
            .as_object()
            .unwrap()
            .keys()
            .collect();
        for e in [
            ApiError::invalid("bad", Some("n")),
            ApiError::internal("detail"),
            ApiError::RouteNotFound("x".into()),
        ] {
            let body = serde_json::to_value(e.body()).unwrap();
            let mut got: Vec<&String> = body["error"].as_object().unwrap().keys().collect();
            got.sort();
            let mut want = fields.clone();
            want.sort();
            assert_eq!(got, want);
            assert!(body["error"]["message"].is_string() && body["error"]["type"].is_string());
        }
    }

    #[test]
    fn response_schemas_are_derived() {
        let d = doc();
        assert_eq!(
            required(&d, "ChatCompletion"),
            ["choices", "created", "id", "model", "object", "usage"]
        );
        assert!(properties(&d, "ModelCard").contains(&"max_model_len".to_string()));
        // Fields skipped when empty are not required.
        assert!(!required(&d, "AssistantMessage").contains(&"tool_calls".to_string()));
    }

    #[test]
    fn keys_add_bearer_auth() {
        let open = document("m", Security::default());
        assert!(open.pointer("/components/securitySchemes").is_none());
        let d = document(
            "m",
            Security {
                keys: true,
                health: false,
                metrics: true,
            },
        );
        assert_eq!(
            d["components"]["securitySchemes"]["bearerAuth"]["scheme"],
            "bearer"
        );
        assert_eq!(d["security"], json!([{"bearerAuth": []}]));
        assert_eq!(d["paths"]["/health"]["get"]["security"], json!([]));
        assert!(d["paths"]["/metrics"]["get"].get("security").is_none());
    }
}
