//! Feeds arbitrary bodies to the OpenAI request parsers and validators
//! (chat and completions) and, when a body parses, to everything that
//! derives from it: parameters, the conversation for the template (both
//! shapes), tools and tool choice. Each must return Ok or Err: no panic,
//! hang or unbounded allocation.

use tandem_frontend::openai::{ChatRequest, CompletionRequest};
use tandem_frontend::tools::{self, ToolParser};

/// One fuzz input.
pub fn run(data: &[u8]) {
    for allow_extra in [false, true] {
        if let Ok(r) = ChatRequest::parse(data, allow_extra) {
            let _ = r.params();
            for p in [ToolParser::Hermes, ToolParser::Llama3Json] {
                let _ = r.messages(p, Some("tools"));
            }
            let _ = r.messages_json();
            if let Ok(t) = tools::parse_tools(r.tools.as_ref())
                && let Ok(choice) = tools::parse_choice(r.tool_choice.as_ref(), &t)
            {
                let _ = ToolParser::Hermes.forced_call(&t, &choice, true);
                let _ = ToolParser::Hermes.system_prompt(&t);
            }
        }
        if let Ok(r) = CompletionRequest::parse(data, allow_extra) {
            let _ = r.params();
        }
    }
}
