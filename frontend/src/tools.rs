//! Tool calling: the `tools` / `tool_choice` request fields, the prompt that
//! describes tools to a model whose chat template does not, the grammar
//! that forces a call (`required` or a named function), and the parsers
//! that turn a model's text into OpenAI `tool_calls`.

use std::fmt::Write as _;
use std::str::FromStr;

use serde_json::{Value, json};
use tandem_types::Constraint;

use crate::error::ApiError;

mod stream;

pub use stream::{CallDelta, Forced, Pushed, ToolStream};

/// Most tools one request may define.
pub const MAX_TOOLS: usize = 128;

/// A function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    pub name: String,
    pub description: Option<String>,
    /// JSON schema of the arguments (an object schema).
    pub parameters: Value,
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// Never call a tool (the tools are not shown to the model).
    None,
    /// The model decides.
    Auto,
    /// At least one call, enforced by the grammar.
    Required,
    /// A call of this function, enforced by the grammar.
    Named(String),
}

/// How a model writes tool calls (`--tool-parser`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ToolParser {
    /// `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one
    /// block per call (Hermes, Qwen 2.5).
    #[default]
    Hermes,
    /// The whole answer is `{"name": ..., "parameters": {...}}` (Llama 3.x
    /// JSON tool calling); several calls are separated by `;`.
    Llama3Json,
    /// Tool calls are not parsed: `tools` are refused.
    None,
}

/// A `--tool-parser` name that is not one of the parsers.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown tool parser `{0}` (hermes, llama3_json, none)")]
pub struct UnknownToolParser(pub String);

impl FromStr for ToolParser {
    type Err = UnknownToolParser;

    fn from_str(s: &str) -> Result<Self, UnknownToolParser> {
        match s {
            "hermes" => Ok(Self::Hermes),
            "llama3_json" => Ok(Self::Llama3Json),
            "none" => Ok(Self::None),
            other => Err(UnknownToolParser(other.to_string())),
        }
    }
}

/// One parsed call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedCall {
    pub name: String,
    /// The arguments as a JSON object's text.
    pub arguments: String,
}

fn invalid(message: impl Into<String>, param: &str) -> ApiError {
    ApiError::invalid(message, Some(param))
}

/// Parses `tools` (OpenAI's `[{"type": "function", "function": {...}}]`).
pub fn parse_tools(v: Option<&Value>) -> Result<Vec<Tool>, ApiError> {
    let items = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(invalid("`tools` must be an array", "tools")),
    };
    if items.len() > MAX_TOOLS {
        return Err(invalid(
            format!("`tools` has {} entries; at most {MAX_TOOLS}", items.len()),
            "tools",
        ));
    }
    let mut tools: Vec<Tool> = Vec::with_capacity(items.len());
    for (i, t) in items.iter().enumerate() {
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(invalid(
                format!("tools[{i}].type must be \"function\""),
                "tools",
            ));
        }
        let f = t
            .get("function")
            .ok_or_else(|| invalid(format!("tools[{i}].function is missing"), "tools"))?;
        let name = f
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| {
                !n.is_empty()
                    && n.len() <= 64
                    && n.chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
            })
            .ok_or_else(|| {
                invalid(
                    format!("tools[{i}].function.name must be 1-64 of a-z, A-Z, 0-9, _ and -"),
                    "tools",
                )
            })?;
        if tools.iter().any(|t| t.name == name) {
            return Err(invalid(format!("tool `{name}` is defined twice"), "tools"));
        }
        let parameters = match f.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
            Some(p @ Value::Object(_)) => p.clone(),
            Some(_) => {
                return Err(invalid(
                    format!("tools[{i}].function.parameters must be a JSON schema object"),
                    "tools",
                ));
            }
        };
        tools.push(Tool {
            name: name.to_string(),
            description: f
                .get("description")
                .and_then(Value::as_str)
                .map(str::to_string),
            parameters,
        });
    }
    Ok(tools)
}

/// Parses `tool_choice` against the defined tools (`auto` by default when
/// tools are given, as OpenAI does).
pub fn parse_choice(v: Option<&Value>, tools: &[Tool]) -> Result<ToolChoice, ApiError> {
    const P: &str = "tool_choice";
    let choice = match v {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(invalid(
                    format!("`tool_choice` \"{other}\" is not one of none, auto, required"),
                    P,
                ));
            }
        },
        Some(o @ Value::Object(_)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    invalid(
                        "`tool_choice` must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                        P,
                    )
                })?;
            ToolChoice::Named(name.to_string())
        }
        Some(_) => return Err(invalid("`tool_choice` must be a string or an object", P)),
    };
    match &choice {
        ToolChoice::Required | ToolChoice::Named(_) if tools.is_empty() => Err(invalid(
            "`tool_choice` asks for a call but no `tools` are given",
            P,
        )),
        ToolChoice::Named(n) if !tools.iter().any(|t| &t.name == n) => Err(invalid(
            format!("`tool_choice` names `{n}`, which is not in `tools`"),
            P,
        )),
        _ => Ok(choice),
    }
}

/// OpenAI's wire form of the tools, for templates that render them.
pub fn tools_json(tools: &[Tool]) -> Value {
    Value::Array(
        tools
            .iter()
            .map(|t| {
                json!({"type": "function", "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.parameters,
                }})
            })
            .collect(),
    )
}

impl ToolParser {
    /// The system prompt that teaches a model this format, for chat
    /// templates that do not render tools themselves.
    pub fn system_prompt(self, tools: &[Tool]) -> String {
        let mut s = String::from(
            "You can call functions to help with the user's request. \
             The functions are described by these JSON schemas:\n",
        );
        for t in tools {
            let f = json!({
                "name": t.name,
                "description": t.description,
                "parameters": t.parameters,
            });
            let _ = writeln!(s, "{f}");
        }
        match self {
            Self::Hermes | Self::None => s.push_str(
                "To call a function, answer with one block per call, each exactly:\n\
                 <tool_call>\n{\"name\": <function name>, \"arguments\": <arguments object>}\n</tool_call>\n\
                 Otherwise answer normally.",
            ),
            Self::Llama3Json => s.push_str(
                "To call a function, answer only with a JSON object of the form \
                 {\"name\": <function name>, \"parameters\": <arguments object>}. \
                 Otherwise answer normally.",
            ),
        }
        s
    }

    /// A previous assistant call, as this format writes it (for history in
    /// templates that do not render `tool_calls`).
    pub fn render_call(self, name: &str, arguments: &str) -> String {
        let args: Value =
            serde_json::from_str(arguments).unwrap_or(Value::String(arguments.into()));
        match self {
            Self::Hermes | Self::None => {
                format!(
                    "<tool_call>\n{}\n</tool_call>",
                    json!({"name": name, "arguments": args})
                )
            }
            Self::Llama3Json => json!({"name": name, "parameters": args}).to_string(),
        }
    }

    /// Splits a finished answer into content and calls. Text that looks
    /// like a call but does not parse stays content.
    pub fn extract(self, text: &str) -> (String, Vec<ParsedCall>) {
        match self {
            Self::None => (text.to_string(), Vec::new()),
            Self::Hermes => extract_hermes(text),
            Self::Llama3Json => extract_llama3(text),
        }
    }

    /// A grammar that makes the model call a tool: any of `tools` for
    /// `required`, the named one otherwise; one call unless `parallel`.
    pub fn forced_call(
        self,
        tools: &[Tool],
        choice: &ToolChoice,
        parallel: bool,
    ) -> Option<Constraint> {
        let allowed: Vec<&Tool> = match choice {
            ToolChoice::Required => tools.iter().collect(),
            ToolChoice::Named(n) => tools.iter().filter(|t| &t.name == n).collect(),
            ToolChoice::None | ToolChoice::Auto => return None,
        };
        let args_key = match self {
            Self::Llama3Json => "parameters",
            Self::Hermes | Self::None => "arguments",
        };
        let alternatives: Vec<Value> = allowed
            .iter()
            .map(|t| {
                // The arguments hold the parameters named and no others
                // (OpenAI's strict mode), unless the schema opens an object.
                let mut parameters = t.parameters.clone();
                tandem_grammar::close_objects(&mut parameters);
                json!({
                    "type": "object",
                    "properties": {"name": {"const": t.name}, args_key: parameters},
                    "required": ["name", args_key],
                    "additionalProperties": false,
                })
            })
            .collect();
        let schema = json!({"anyOf": alternatives, "x-guidance": {"whitespace_flexible": false}});
        let grammar = match self {
            Self::Hermes | Self::None => {
                // Parallel calls one per line, as chat templates write
                // them (Qwen 2.5's: "</tool_call>\n<tool_call>").
                let more = if parallel {
                    " (\"\\n\" call)* \"\\n\"?"
                } else {
                    ""
                };
                format!(
                    "start: call{more}\ncall: \"<tool_call>\\n\" body \"\\n</tool_call>\"\nbody: %json {schema}\n"
                )
            }
            Self::Llama3Json => {
                let more = if parallel { " (\"; \" body)*" } else { "" };
                format!("start: body{more}\nbody: %json {schema}\n")
            }
        };
        Some(Constraint::Lark(grammar))
    }
}

/// A JSON call object's name and arguments (`args_key` holds them).
fn call_of(v: &Value, args_key: &str) -> Option<ParsedCall> {
    let name = v.get("name")?.as_str()?.to_string();
    let args = v.get(args_key).cloned().unwrap_or_else(|| json!({}));
    let arguments = match args {
        Value::String(s) => s,
        other => other.to_string(),
    };
    Some(ParsedCall { name, arguments })
}

fn extract_hermes(text: &str) -> (String, Vec<ParsedCall>) {
    const OPEN: &str = "<tool_call>";
    const CLOSE: &str = "</tool_call>";
    let mut content = String::new();
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(OPEN) {
        let after = &rest[start + OPEN.len()..];
        // An unclosed last block still counts (max_tokens may cut the tag).
        let (body, next) = match after.find(CLOSE) {
            Some(end) => (&after[..end], &after[end + CLOSE.len()..]),
            None => (strip_partial(after, CLOSE), ""),
        };
        match serde_json::from_str::<Value>(body.trim())
            .ok()
            .and_then(|v| call_of(&v, "arguments"))
        {
            Some(call) => {
                content.push_str(&rest[..start]);
                calls.push(call);
            }
            None => content.push_str(&rest[..start + OPEN.len() + body.len()]),
        }
        rest = next;
    }
    content.push_str(rest);
    if !calls.is_empty() {
        content = content.trim().to_string();
    }
    (content, calls)
}

/// `s` without a trailing prefix of `tag` (a tag cut by `max_tokens`).
fn strip_partial<'a>(s: &'a str, tag: &str) -> &'a str {
    (1..tag.len())
        .rev()
        .find(|&n| s.ends_with(&tag[..n]))
        .map_or(s, |n| &s[..s.len() - n])
}

fn extract_llama3(text: &str) -> (String, Vec<ParsedCall>) {
    let trimmed = text.trim();
    if !trimmed.starts_with('{') {
        return (text.to_string(), Vec::new());
    }
    let mut calls = Vec::new();
    for part in trimmed.split(';') {
        match serde_json::from_str::<Value>(part.trim())
            .ok()
            .and_then(|v| call_of(&v, "parameters").or_else(|| call_of(&v, "arguments")))
        {
            Some(c) => calls.push(c),
            None => return (text.to_string(), Vec::new()),
        }
    }
    (String::new(), calls)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn weather() -> Value {
        json!([{"type": "function", "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
        }}])
    }

    #[test]
    fn tools_and_choices_are_validated() {
        let tools = parse_tools(Some(&weather())).unwrap();
        assert_eq!(tools[0].name, "get_weather");
        for bad in [
            json!({}),
            json!([{"type": "retrieval"}]),
            json!([{"type": "function", "function": {"name": "has space"}}]),
            json!([{"type": "function", "function": {"name": "f", "parameters": 3}}]),
            json!([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]),
        ] {
            let e = parse_tools(Some(&bad)).unwrap_err();
            assert_eq!(e.body().error.param.as_deref(), Some("tools"), "{bad}");
        }
        assert_eq!(parse_choice(None, &tools).unwrap(), ToolChoice::Auto);
        assert_eq!(
            parse_choice(Some(&json!("required")), &tools).unwrap(),
            ToolChoice::Required
        );
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        assert_eq!(
            parse_choice(Some(&named), &tools).unwrap(),
            ToolChoice::Named("get_weather".into())
        );
        for bad in [
            json!("always"),
            json!({"type": "function", "function": {"name": "nope"}}),
            json!(7),
        ] {
            let e = parse_choice(Some(&bad), &tools).unwrap_err();
            assert_eq!(
                e.body().error.param.as_deref(),
                Some("tool_choice"),
                "{bad}"
            );
        }
        assert!(parse_choice(Some(&json!("required")), &[]).is_err());
    }

    #[test]
    fn hermes_calls_are_extracted() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}</tool_call>";
        let (content, calls) = ToolParser::Hermes.extract(text);
        assert_eq!(content, "Let me check.");
        assert_eq!(
            calls,
            vec![
                ParsedCall {
                    name: "get_weather".into(),
                    arguments: r#"{"city":"Paris"}"#.into()
                },
                ParsedCall {
                    name: "get_weather".into(),
                    arguments: r#"{"city":"Oslo"}"#.into()
                },
            ]
        );
        // Not JSON: stays text.
        let (content, calls) = ToolParser::Hermes.extract("a <tool_call>oops</tool_call> b");
        assert!(calls.is_empty());
        assert!(content.contains("oops"));
        // Cut by max_tokens after the JSON.
        let (_, calls) =
            ToolParser::Hermes.extract("<tool_call>{\"name\": \"f\", \"arguments\": {}}\n</tool_");
        assert_eq!(calls.len(), 1);
        assert_eq!(ToolParser::Hermes.extract("plain").0, "plain");
    }

    #[test]
    fn llama3_calls_are_extracted() {
        let (content, calls) = ToolParser::Llama3Json
            .extract(r#" {"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}"#);
        assert_eq!(content, "");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].arguments, r#"{"x":1}"#);
        let (content, calls) = ToolParser::Llama3Json.extract("{not json");
        assert_eq!((content.as_str(), calls.len()), ("{not json", 0));
    }

    #[test]
    fn rendered_calls_parse_back() {
        for p in [ToolParser::Hermes, ToolParser::Llama3Json] {
            let text = p.render_call("get_weather", r#"{"city":"Rome"}"#);
            let (_, calls) = p.extract(&text);
            assert_eq!(calls[0].name, "get_weather", "{p:?}");
            assert_eq!(calls[0].arguments, r#"{"city":"Rome"}"#, "{p:?}");
            assert!(text.starts_with("<tool_call>") || p == ToolParser::Llama3Json);
        }
    }

    #[test]
    fn forced_calls_name_the_allowed_tools() {
        let tools = parse_tools(Some(&weather())).unwrap();
        assert_eq!(
            ToolParser::Hermes.forced_call(&tools, &ToolChoice::Auto, true),
            None
        );
        let Some(Constraint::Lark(g)) =
            ToolParser::Hermes.forced_call(&tools, &ToolChoice::Required, false)
        else {
            panic!("expected a Lark grammar");
        };
        assert!(g.contains("get_weather") && g.contains("<tool_call>") && !g.contains("call)*"));
        let Some(Constraint::Lark(g)) =
            ToolParser::Hermes.forced_call(&tools, &ToolChoice::Named("get_weather".into()), true)
        else {
            panic!("expected a Lark grammar");
        };
        assert!(g.contains("(\"\\n\" call)*"), "{g}");
        assert_eq!("llama3_json".parse(), Ok(ToolParser::Llama3Json));
        assert!("xml".parse::<ToolParser>().is_err());
    }
}
