//! Several generations behind one response (`n`, a list of prompts): their
//! merged streams, their summed usage, and how each choice's text becomes
//! reasoning, content and tool calls.

use futures_util::StreamExt;
use futures_util::stream::BoxStream;

use super::{Generation, Piece};
use crate::openai::UsageInfo;
use crate::reasoning::{ReasoningParser, ReasoningStream, Split};
use crate::tools::{CallDelta, Forced, ParsedCall, ToolParser, ToolStream};

/// The pieces of every generation, tagged with its choice index, in the
/// order they arrive. Dropping it cancels the generations still running.
/// One generation (the usual case) is its own stream: a `SelectAll` would
/// add a `FuturesUnordered` wake-up and poll to every token.
pub(super) fn merge(generations: Vec<Generation>) -> BoxStream<'static, (usize, Piece)> {
    let mut tagged = generations
        .into_iter()
        .enumerate()
        .map(|(i, g)| g.pieces(true).map(move |p| (i, p)).boxed());
    match (tagged.next(), tagged.next()) {
        (Some(only), None) => only,
        (first, second) => {
            futures_util::stream::select_all(first.into_iter().chain(second).chain(tagged)).boxed()
        }
    }
}

/// Runs every generation to completion (non-streaming responses); the first
/// failure cancels the others.
pub(super) async fn collect_all(
    generations: Vec<Generation>,
) -> Result<Vec<super::Collected>, crate::ApiError> {
    futures_util::future::try_join_all(generations.into_iter().map(Generation::collect)).await
}

/// Usage over all choices: each prompt counted once (as OpenAI counts `n`),
/// completion tokens summed.
#[derive(Debug)]
pub(super) struct UsageTally {
    /// Choices per prompt.
    n: usize,
    /// Per prompt.
    prompt_tokens: Vec<usize>,
    cached: Vec<usize>,
    /// Per choice.
    generated: Vec<usize>,
}

impl UsageTally {
    /// `generations[k]` is choice `k`, of prompt `k / n`.
    pub(super) fn new(generations: &[Generation], n: usize) -> Self {
        let n = n.max(1);
        Self {
            n,
            prompt_tokens: generations
                .iter()
                .step_by(n)
                .map(|g| g.prompt_tokens)
                .collect(),
            cached: vec![0; generations.len().div_ceil(n)],
            generated: vec![0; generations.len()],
        }
    }

    /// Choice `i` has generated `tokens` so far.
    pub(super) fn progress(&mut self, i: usize, tokens: usize) {
        if let Some(g) = self.generated.get_mut(i) {
            *g = tokens;
        }
    }

    /// Choice `i` finished with `u`.
    pub(super) fn done(&mut self, i: usize, u: &UsageInfo) {
        self.progress(i, u.completion_tokens);
        if let Some(c) = self.cached.get_mut(i / self.n) {
            *c = (*c).max(u.prompt_tokens_details.cached_tokens);
        }
    }

    pub(super) fn total(&self) -> UsageInfo {
        UsageInfo::new(
            self.prompt_tokens.iter().sum(),
            self.generated.iter().sum(),
            self.cached.iter().sum(),
        )
    }
}

/// How a choice's text divides into reasoning, content and tool calls.
#[derive(Debug, Clone)]
pub(super) struct OutputParser {
    pub reasoning: ReasoningParser,
    /// The template opened the reasoning block in the prompt.
    pub starts_inside: bool,
    /// `Some` when tool calls are parsed out of the content, with what
    /// the grammar forces.
    pub tools: Option<(ToolParser, Forced)>,
}

/// A whole choice, divided.
#[derive(Debug, Default)]
pub(super) struct Output {
    /// `None` when the model wrote no reasoning.
    pub reasoning: Option<String>,
    pub content: String,
    pub calls: Vec<ParsedCall>,
}

impl OutputParser {
    pub(super) fn stream(&self) -> OutputStream {
        OutputStream {
            reasoning: self.reasoning.stream(self.starts_inside),
            tools: self
                .tools
                .as_ref()
                .map(|(p, forced)| ToolStream::new(*p, forced.clone())),
        }
    }

    pub(super) fn whole(&self, text: &str) -> Output {
        let mut s = self.stream();
        let (mut split, _) = s.push(text);
        let (rest, _, calls) = s.finish();
        split.append(rest);
        Output {
            reasoning: (!split.reasoning.is_empty()).then_some(split.reasoning),
            content: split.content,
            calls,
        }
    }
}

/// One choice's text as it streams.
#[derive(Debug)]
pub(super) struct OutputStream {
    reasoning: ReasoningStream,
    tools: Option<ToolStream>,
}

impl OutputStream {
    /// Adds text; returns the reasoning, content and call pieces that can
    /// be sent now.
    pub(super) fn push(&mut self, text: &str) -> (Split, Vec<CallDelta>) {
        let mut s = self.reasoning.push(text);
        let Some(t) = &mut self.tools else {
            return (s, Vec::new());
        };
        let out = t.push(&s.content);
        s.content = out.content;
        (s, out.calls)
    }

    /// Ends the choice: what was held, the last call pieces, and every
    /// tool call of the choice.
    pub(super) fn finish(&mut self) -> (Split, Vec<CallDelta>, Vec<ParsedCall>) {
        let mut s = self.reasoning.finish();
        let Some(t) = &mut self.tools else {
            return (s, Vec::new(), Vec::new());
        };
        let mut out = t.push(&s.content);
        let (rest, calls) = t.finish();
        out.content.push_str(&rest.content);
        out.calls.extend(rest.calls);
        s.content = out.content;
        (s, out.calls, calls)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasoning_then_tool_call_are_separated() {
        let p = OutputParser {
            reasoning: ReasoningParser::Think,
            starts_inside: false,
            tools: Some((ToolParser::Hermes, Forced::No)),
        };
        let text = "<think>need weather</think>\n<tool_call>\n{\"name\": \"w\", \"arguments\": {\"c\": 1}}\n</tool_call>";
        let out = p.whole(text);
        assert_eq!(out.reasoning.as_deref(), Some("need weather"));
        assert_eq!(out.content.trim(), "");
        assert_eq!(out.calls.len(), 1);
        assert_eq!(out.calls[0].name, "w");
        // Streamed in small pieces: the same division.
        let mut s = p.stream();
        let mut all = Split::default();
        for c in text.as_bytes().chunks(3) {
            all.append(s.push(std::str::from_utf8(c).unwrap_or_default()).0);
        }
        let (rest, _, calls) = s.finish();
        all.append(rest);
        assert_eq!(all.reasoning, "need weather");
        assert_eq!(calls, out.calls);
    }

    #[test]
    fn without_parsers_everything_is_content() {
        let p = OutputParser {
            reasoning: ReasoningParser::None,
            starts_inside: false,
            tools: None,
        };
        let out = p.whole("<think>x</think> <tool_call>");
        assert_eq!(out.reasoning, None);
        assert_eq!(out.content, "<think>x</think> <tool_call>");
        assert!(out.calls.is_empty());
    }
}
