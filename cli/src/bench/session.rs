//! A multi-turn session as it runs: the conversation so far, the next
//! turn's request, and what the last turn could leave in the KV cache.

use super::prompts::{Msg, Role, Spec};
use super::request::Outcome;

pub(super) const SKIPPED: &str = "skipped: an earlier turn of its session failed";

/// A multi-turn session as it runs: its conversation so far.
#[derive(Debug)]
pub(super) struct Session {
    /// The user messages (and max_tokens) of all turns.
    pub(super) turns: Vec<Spec>,
    /// Index of the next turn to send.
    pub(super) next: usize,
    pub(super) history: Vec<Msg>,
    /// Estimated tokens of the history, when the server reports no usage.
    pub(super) history_words: usize,
    pub(super) carryable: Option<u64>,
    pub(super) failed: bool,
}

impl Session {
    pub(super) fn new(turns: Vec<Spec>) -> Self {
        Session {
            turns,
            next: 0,
            history: Vec::new(),
            history_words: 0,
            carryable: None,
            failed: false,
        }
    }

    pub(super) fn pending(&self) -> bool {
        !self.failed && self.next < self.turns.len()
    }

    /// The request of the next turn: the whole history plus its message.
    pub(super) fn next_spec(&self) -> Spec {
        let mut s = self.turns[self.next].clone();
        s.input_words += self.history_words;
        s.history = self.history.clone();
        s.turn = self.next + 1;
        s.carryable = self.carryable;
        s
    }

    /// Records the outcome of the turn sent last (taking its answer text).
    pub(super) fn finish(&mut self, o: &mut Outcome, block_size: usize) {
        let user = self.turns[self.next].prompt.clone();
        self.next += 1;
        if !o.ok {
            self.failed = true;
            return;
        }
        self.history.push(Msg {
            role: Role::User,
            content: user,
        });
        self.history.push(Msg {
            role: Role::Assistant,
            content: std::mem::take(&mut o.text),
        });
        self.history_words =
            o.prompt_tokens.map_or(o.input_words, |p| p as usize) + o.output_tokens as usize;
        self.carryable = carryable(o.prompt_tokens, o.output_tokens, block_size);
    }

    /// Error outcomes for the turns a failure left unsent.
    pub(super) fn skip_rest(&mut self) -> Vec<Outcome> {
        let skipped = (self.next..self.turns.len())
            .map(|k| Outcome {
                turn: k + 1,
                error: Some(SKIPPED.into()),
                ..Outcome::default()
            })
            .collect();
        self.next = self.turns.len();
        skipped
    }
}

/// The prefix a turn can leave in the KV cache for the next one: its prompt
/// and completion, in whole blocks (unknown without the server's usage).
pub(super) fn carryable(
    prompt_tokens: Option<u64>,
    completion_tokens: u64,
    block_size: usize,
) -> Option<u64> {
    let b = block_size.max(1) as u64;
    prompt_tokens.map(|p| (p + completion_tokens) / b * b)
}
