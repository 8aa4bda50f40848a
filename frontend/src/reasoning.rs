//! Reasoning output (`--reasoning-parser`): a thinking model writes its
//! thoughts between `<think>` and `</think>` before the answer. The thoughts
//! go to `message.reasoning` / `delta.reasoning` (the field MAX uses), the
//! answer to `content`; tool calls are parsed from the answer only.

use std::str::FromStr;

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// How a model marks its reasoning.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReasoningParser {
    /// Everything is content.
    #[default]
    None,
    /// `<think>...</think>` first (DeepSeek-R1, Qwen3, QwQ). A chat
    /// template that opens the block itself (the prompt ends in `<think>`)
    /// starts the output inside it.
    Think,
}

/// A `--reasoning-parser` name that is not one of the parsers.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown reasoning parser `{0}` (think, none)")]
pub struct UnknownReasoningParser(pub String);

impl FromStr for ReasoningParser {
    type Err = UnknownReasoningParser;

    fn from_str(s: &str) -> Result<Self, UnknownReasoningParser> {
        match s {
            "think" => Ok(Self::Think),
            "none" => Ok(Self::None),
            other => Err(UnknownReasoningParser(other.to_string())),
        }
    }
}

impl ReasoningParser {
    /// Whether the answer to `prompt` (the rendered chat prompt) starts
    /// inside the reasoning block: the template opened it.
    pub fn starts_inside(self, prompt: &str) -> bool {
        self == Self::Think && prompt.trim_end().ends_with(OPEN)
    }

    /// A splitter for one answer; `inside`: see [`Self::starts_inside`].
    pub fn stream(self, inside: bool) -> ReasoningStream {
        let state = match self {
            Self::None => State::Answer,
            Self::Think if inside => State::Thinking,
            Self::Think => State::Start,
        };
        ReasoningStream {
            state,
            held: String::new(),
            trim_answer: false,
        }
    }

    /// Splits a whole answer to `prompt` into reasoning and content.
    pub fn split(self, prompt: &str, text: &str) -> Split {
        let mut s = self.stream(self.starts_inside(prompt));
        let mut out = s.push(text);
        out.append(s.finish());
        out
    }
}

/// Text split into the two channels.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Split {
    pub reasoning: String,
    pub content: String,
}

impl Split {
    pub fn append(&mut self, other: Split) {
        self.reasoning.push_str(&other.reasoning);
        self.content.push_str(&other.content);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing but blanks yet: the answer may still open a think block.
    Start,
    Thinking,
    Answer,
}

/// Splits streamed text, holding back what may be part of a tag.
#[derive(Debug)]
pub struct ReasoningStream {
    state: State,
    held: String,
    /// Drop blanks between `</think>` and the answer.
    trim_answer: bool,
}

/// Length of the longest suffix of `s` that is a proper prefix of `tag`.
fn partial_tag(s: &str, tag: &str) -> usize {
    (1..tag.len())
        .rev()
        .find(|&n| s.ends_with(&tag[..n]))
        .unwrap_or(0)
}

impl ReasoningStream {
    /// Adds text; returns what can be sent now.
    pub fn push(&mut self, text: &str) -> Split {
        self.held.push_str(text);
        let mut out = Split::default();
        loop {
            match self.state {
                State::Start => {
                    let t = self.held.trim_start();
                    if let Some(rest) = t.strip_prefix(OPEN) {
                        self.held = rest.to_string();
                        self.state = State::Thinking;
                    } else if OPEN.starts_with(t) {
                        // Blanks or a partial tag: wait for more.
                        return out;
                    } else {
                        self.state = State::Answer;
                    }
                }
                State::Thinking => match self.held.find(CLOSE) {
                    Some(at) => {
                        out.reasoning.push_str(&self.held[..at]);
                        self.held.drain(..at + CLOSE.len());
                        self.state = State::Answer;
                        self.trim_answer = true;
                    }
                    None => {
                        let keep = partial_tag(&self.held, CLOSE);
                        let split = self.held.len() - keep;
                        out.reasoning.push_str(&self.held[..split]);
                        self.held.drain(..split);
                        return out;
                    }
                },
                State::Answer => {
                    if self.trim_answer {
                        let t = self.held.trim_start();
                        if t.is_empty() {
                            self.held.clear();
                            return out;
                        }
                        self.held = t.to_string();
                        self.trim_answer = false;
                    }
                    out.content.push_str(&self.held);
                    self.held.clear();
                    return out;
                }
            }
        }
    }

    /// Ends the answer: what was held goes out (an unclosed think block is
    /// all reasoning, as when `max_tokens` cuts the thoughts short).
    pub fn finish(&mut self) -> Split {
        let held = std::mem::take(&mut self.held);
        match self.state {
            State::Thinking => Split {
                reasoning: held,
                content: String::new(),
            },
            State::Start | State::Answer => Split {
                reasoning: String::new(),
                content: if self.trim_answer {
                    held.trim_start().to_string()
                } else {
                    held
                },
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(prompt: &str, text: &str) -> (String, String) {
        let s = ReasoningParser::Think.split(prompt, text);
        (s.reasoning, s.content)
    }

    fn streamed(prompt: &str, pieces: &[&str]) -> (String, String) {
        let p = ReasoningParser::Think;
        let mut s = p.stream(p.starts_inside(prompt));
        let mut all = Split::default();
        for p in pieces {
            all.append(s.push(p));
        }
        all.append(s.finish());
        (all.reasoning, all.content)
    }

    #[test]
    fn think_block_then_answer() {
        let want = ("a plan".to_string(), "Hi!".to_string());
        assert_eq!(split("", "<think>a plan</think>\n\nHi!"), want);
        assert_eq!(split("", "\n <think>a plan</think>Hi!"), want);
        // The template opened the block: the output starts inside it.
        assert_eq!(
            split("<|im_start|>assistant\n<think>\n", "a plan</think>Hi!"),
            want
        );
    }

    #[test]
    fn no_block_is_all_content_and_an_unclosed_one_all_reasoning() {
        assert_eq!(
            split("", "Hi <think>x</think>"),
            ("".into(), "Hi <think>x</think>".into())
        );
        assert_eq!(split("", "<think>cut sh"), ("cut sh".into(), "".into()));
        assert_eq!(split("", ""), ("".into(), "".into()));
        assert_eq!(split("", "  "), ("".into(), "  ".into()));
        assert_eq!(split("", "<thi"), ("".into(), "<thi".into()));
        let none = ReasoningParser::None.split("<think>", "<think>x</think>y");
        assert_eq!(none.content, "<think>x</think>y");
        assert!(none.reasoning.is_empty());
    }

    #[test]
    fn streaming_agrees_with_whole_text_at_every_cut() {
        for text in [
            "<think>a plan</think>\n\nHi!",
            "\n<think>x</think>",
            "plain answer </think>",
            "<think>never closed </thi",
            "<think></think>answer",
        ] {
            let whole = split("", text);
            for cut in 0..=text.len() {
                let (a, b) = text.split_at(cut);
                assert_eq!(streamed("", &[a, b]), whole, "{text:?} cut at {cut}");
            }
            // One character at a time.
            let chars: Vec<String> = text.chars().map(String::from).collect();
            let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
            assert_eq!(streamed("", &pieces), whole, "{text:?} by chars");
        }
    }

    #[test]
    fn reasoning_flows_before_the_block_closes() {
        let mut s = ReasoningParser::Think.stream(false);
        assert_eq!(
            s.push("<think>step one, "),
            Split {
                reasoning: "step one, ".into(),
                content: String::new(),
            }
        );
        // A partial closing tag is held, not sent as reasoning.
        assert_eq!(s.push("two</th").reasoning, "two");
        let end = s.push("ink>\nyes");
        assert_eq!(end.reasoning, "");
        assert_eq!(end.content, "yes");
    }

    #[test]
    fn parser_names() {
        assert_eq!("think".parse(), Ok(ReasoningParser::Think));
        assert_eq!("none".parse(), Ok(ReasoningParser::None));
        assert!("r1".parse::<ReasoningParser>().is_err());
    }
}
