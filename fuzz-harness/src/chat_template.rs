//! Hostile chat requests through the real SmolLM2 chat template and the
//! guard that keeps client text from forging turns (from
//! `TANDEM_TEST_GGUF`): rendering and tokenizing never panic, and the
//! control tokens of the prompt depend on the conversation's shape only,
//! never on what the messages say: the same messages with empty contents
//! give exactly the same control tokens.

use std::sync::LazyLock;

use tandem_frontend::openai::ChatRequest;
use tandem_frontend::prompt::render_chat;
use tandem_frontend::tools::ToolParser;
use tandem_modelfile::ModelMeta;
use tandem_modelfile::chat::ChatMessage;

static META: LazyLock<ModelMeta> = LazyLock::new(|| {
    let path = std::env::var_os("TANDEM_TEST_GGUF")
        .expect("set TANDEM_TEST_GGUF to SmolLM2-135M-Instruct.Q4_1.gguf");
    ModelMeta::load(std::path::Path::new(&path)).expect("model metadata")
});

/// One fuzz input.
pub fn run(data: &[u8]) {
    let text = &META.text;
    let (tok, template) = (
        &text.tokenizer,
        text.chat_template.as_ref().expect("a chat template"),
    );
    // Raw input as one user message (the common attack), and as a request.
    let mut conversations: Vec<Vec<ChatMessage>> = Vec::new();
    if let Ok(s) = std::str::from_utf8(data) {
        conversations.push(vec![ChatMessage::new("user", s)]);
    }
    if let Ok(r) = ChatRequest::parse(data, true)
        && let Ok(m) = r.messages(ToolParser::Hermes, None)
    {
        conversations.push(m);
    }
    for messages in conversations {
        let blank: Vec<ChatMessage> = messages
            .iter()
            .map(|m| ChatMessage::new(m.role.clone(), ""))
            .collect();
        let Ok((_, ids)) = render_chat(tok, template, messages) else {
            continue;
        };
        let (_, shape) = render_chat(tok, template, blank).expect("the blank conversation renders");
        let control = |ids: &[u32]| -> Vec<u32> {
            ids.iter().copied().filter(|&t| tok.is_special(t)).collect()
        };
        assert_eq!(
            control(&ids),
            control(&shape),
            "client text changed the control tokens"
        );
    }
}
