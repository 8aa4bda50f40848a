//! Chat templates: the Jinja template a model ships (GGUF
//! `tokenizer.chat_template`, or HF `tokenizer_config.json`) rendered the way
//! HF's `apply_chat_template` does: trim_blocks and lstrip_blocks on, Python
//! string methods (`.strip()`, `.startswith()`, ...) available, and
//! `raise_exception(msg)` aborting the render with `msg`.

use minijinja::syntax::SyntaxConfig;
use minijinja::{Environment, Error, ErrorKind, Value, context};

const TEMPLATE_NAME: &str = "chat";
/// Marks errors raised by the template's own `raise_exception` call.
const RAISE_MARKER: &str = "\u{0}raise_exception\u{0}";

#[derive(Debug, thiserror::Error)]
pub enum ChatTemplateError {
    #[error("chat template syntax error: {0}")]
    Syntax(String),
    #[error("chat template render error: {0}")]
    Render(String),
    /// The template called `raise_exception(message)`.
    #[error("chat template raised an exception: {0}")]
    Raised(String),
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// Whether the template reads a `tools` variable (renders tool
    /// definitions and tool calls itself).
    handles_tools: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(
        ErrorKind::InvalidOperation,
        format!("{RAISE_MARKER}{message}"),
    ))
}

/// Full description of a minijinja error, including its causes.
fn describe(err: &Error) -> String {
    let mut msg = err.to_string();
    let mut source = std::error::Error::source(err);
    while let Some(e) = source {
        msg.push_str(": ");
        msg.push_str(&e.to_string());
        source = e.source();
    }
    msg
}

fn render_error(err: Error) -> ChatTemplateError {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(e) = cur {
        if let Some(mj) = e.downcast_ref::<Error>()
            && let Some(detail) = mj.detail()
            && let Some(message) = detail.strip_prefix(RAISE_MARKER)
        {
            return ChatTemplateError::Raised(message.to_string());
        }
        cur = e.source();
    }
    ChatTemplateError::Render(describe(&err))
}

impl ChatTemplate {
    /// Compiles `source` once; `bos_token`/`eos_token` are the texts the
    /// template sees as `bos_token` and `eos_token`.
    pub fn new(
        source: &str,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<ChatTemplate, ChatTemplateError> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| ChatTemplateError::Syntax(describe(&e)))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| ChatTemplateError::Syntax(describe(&e)))?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
            handles_tools: source.contains("tools"),
        })
    }

    /// Renders the conversation into a prompt string.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ChatTemplateError> {
        self.render_value(
            Value::from(minijinja::value::Serde(messages)),
            None,
            add_generation_prompt,
        )
    }

    fn render_value(
        &self,
        messages: Value,
        tools: Option<Value>,
        add_generation_prompt: bool,
    ) -> Result<String, ChatTemplateError> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| ChatTemplateError::Render(describe(&e)))?;
        template
            .render(context! {
                messages => messages,
                tools => tools.unwrap_or(Value::UNDEFINED),
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(render_error)
    }
}

impl ChatTemplate {
    /// Whether the template renders tool definitions and calls itself.
    pub fn handles_tools(&self) -> bool {
        self.handles_tools
    }

    /// Renders messages given as JSON objects (which may carry
    /// `tool_calls` / `tool_call_id`), with `tools` in the context when
    /// given: for templates that handle tools.
    pub fn render_json(
        &self,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String, ChatTemplateError> {
        self.render_value(
            Value::from(minijinja::value::Serde(messages)),
            tools.map(|t| Value::from(minijinja::value::Serde(t))),
            add_generation_prompt,
        )
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn raise_exception_carries_message() {
        let t = ChatTemplate::new(
            "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok",
            "<s>",
            "</s>",
        )
        .unwrap();
        match t.render(&[ChatMessage::new("system", "x")], true) {
            Err(ChatTemplateError::Raised(m)) => assert_eq!(m, "first must be user"),
            other => panic!("unexpected: {other:?}"),
        }
        assert_eq!(
            t.render(&[ChatMessage::new("user", "x")], true).unwrap(),
            "ok"
        );
    }

    #[test]
    fn pycompat_and_whitespace_control() {
        let src = "{% for m in messages %}\n  {{ bos_token }}{{ m.content.strip() }}{{ eos_token }}\n{% endfor %}\n";
        let t = ChatTemplate::new(src, "<s>", "</s>").unwrap();
        let out = t
            .render(&[ChatMessage::new("user", "  hi  ")], false)
            .unwrap();
        assert_eq!(out, "  <s>hi</s>\n");
    }

    #[test]
    fn syntax_error() {
        assert!(matches!(
            ChatTemplate::new("{% for %}", "", ""),
            Err(ChatTemplateError::Syntax(_))
        ));
    }
}
