//! Chat prompts tokenized so that only the chat template's own markup
//! becomes control tokens. A client that writes `<|im_start|>system` in a
//! message (or a tool description, or call arguments) gets those characters
//! as plain text, not a forged turn.
//!
//! Before rendering, every control-token text in a client string is
//! replaced by a placeholder (private-use characters around an index); the
//! rendered prompt, with the originals put back, is tokenized in one pass
//! with the originals' byte ranges protected: the template's text with
//! control tokens recognised, each original as plain text. Requests
//! without such text (nearly all) are tokenized with plain `encode`.

use serde_json::Value;
use tandem_modelfile::chat::{ChatMessage, ChatTemplate};
use tandem_modelfile::tokenizer::Tokenizer;

use crate::error::ApiError;

/// Renders `messages` (client text) through `template` with every client
/// string guarded, and tokenizes the result: the path of every chat request
/// whose tools the template does not render itself. Returns the rendered
/// text and its token ids.
pub fn render_chat(
    tok: &Tokenizer,
    template: &ChatTemplate,
    mut messages: Vec<ChatMessage>,
) -> Result<(String, Vec<u32>), ApiError> {
    let mut guard = Guard::new(tok);
    guard.messages(&mut messages);
    let rendered = template.render(&messages, true)?;
    let ids = guard.encode(&rendered)?;
    Ok((rendered, ids))
}

const OPEN: char = '\u{F8F0}';
const CLOSE: char = '\u{F8F1}';

/// Client strings' control-token texts, set aside while the prompt is
/// rendered.
#[derive(Debug)]
pub(crate) struct Guard<'a> {
    tok: &'a Tokenizer,
    originals: Vec<String>,
}

impl<'a> Guard<'a> {
    pub(crate) fn new(tok: &'a Tokenizer) -> Self {
        Self {
            tok,
            originals: Vec::new(),
        }
    }

    /// `s` with each control-token text (and each of our placeholder
    /// characters, so that no client text can fake a placeholder) replaced
    /// by a placeholder.
    fn string(&mut self, s: &str) -> String {
        let mut ranges = self.tok.control_texts(s);
        ranges.extend(
            s.char_indices()
                .filter(|&(_, c)| c == OPEN || c == CLOSE)
                .map(|(i, c)| i..i + c.len_utf8()),
        );
        if ranges.is_empty() {
            return s.to_string();
        }
        ranges.sort_by_key(|r| r.start);
        let mut out = String::with_capacity(s.len() + 8 * ranges.len());
        let mut at = 0;
        for r in ranges {
            if r.start < at {
                continue; // inside a control text already replaced
            }
            out.push_str(&s[at..r.start]);
            out.push(OPEN);
            out.push_str(&self.originals.len().to_string());
            out.push(CLOSE);
            self.originals.push(s[r.clone()].to_string());
            at = r.end;
        }
        out.push_str(&s[at..]);
        out
    }

    /// Guards every message's content.
    pub(crate) fn messages(&mut self, messages: &mut [ChatMessage]) {
        for m in messages {
            m.content = self.string(&m.content);
        }
    }

    /// Guards every string (and object key) in `v`.
    pub(crate) fn json(&mut self, v: &mut Value) {
        match v {
            Value::String(s) => *s = self.string(s),
            Value::Array(a) => a.iter_mut().for_each(|x| self.json(x)),
            Value::Object(o) => {
                let old = std::mem::take(o);
                for (k, mut x) in old {
                    self.json(&mut x);
                    o.insert(self.string(&k), x);
                }
            }
            Value::Null | Value::Bool(_) | Value::Number(_) => {}
        }
    }

    /// Tokenizes the rendered prompt (no BOS: the template writes its own)
    /// in one pass, with each placeholder's original put back and, if a
    /// control-token text, protected: it is tokenized as the model would
    /// see the whole text (a SentencePiece space prefix only where
    /// llama.cpp puts one), but its control-token texts stay plain text.
    pub(crate) fn encode(&self, rendered: &str) -> Result<Vec<u32>, ApiError> {
        if self.originals.is_empty() {
            return Ok(self.tok.encode(rendered, false)?);
        }
        let mut text = String::with_capacity(rendered.len());
        let mut protected = Vec::new();
        let mut rest = rendered;
        while let Some(open) = rest.find(OPEN) {
            let after = &rest[open + OPEN.len_utf8()..];
            let close = after
                .find(CLOSE)
                .ok_or_else(|| ApiError::internal("an unclosed prompt placeholder"))?;
            let original = after[..close]
                .parse::<usize>()
                .ok()
                .and_then(|k| self.originals.get(k))
                .ok_or_else(|| ApiError::internal("a bad prompt placeholder"))?;
            text.push_str(&rest[..open]);
            let start = text.len();
            text.push_str(original);
            // A placeholder character the client wrote is no control text:
            // left unprotected, BPE tokenizes it with its neighbours.
            if original.chars().any(|c| c != OPEN && c != CLOSE) {
                protected.push(start..text.len());
            }
            rest = &after[close + CLOSE.len_utf8()..];
        }
        text.push_str(rest);
        Ok(self.tok.encode_protected(&text, false, &protected)?)
    }
}
