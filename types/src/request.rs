//! One generation as every layer sees it: the checks a request must pass,
//! the events it produces, and how it ends.

use crate::sampling::{Sampled, SamplingError, SamplingParams};

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token or stop string.
    Stop,
    /// `max_tokens` or the context length.
    Length,
}

/// Token accounting of a finished request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens served from a prefix cache.
    pub cached_tokens: usize,
    pub finish: FinishReason,
}

/// What the generated text must match (OpenAI `response_format`, plus
/// regex and Lark grammars as extensions). Sources are kept as text: the
/// grammar engine parses them, and they cross the wire unchanged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Constraint {
    /// A JSON schema, as JSON text.
    JsonSchema(String),
    /// Any JSON object.
    JsonObject,
    Regex(String),
    /// A Lark grammar (llguidance's dialect).
    Lark(String),
}

/// One tokenized generation request, as every layer carries it: the front
/// end builds it, the router sends it to a decode node (`GenerateJob`), the
/// scheduler runs it. [`GenerationRequest::check`] holds it to the limits.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationRequest {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    /// Tokens it may generate (within the room the prompt leaves).
    pub max_tokens: usize,
    /// Sampling one of these ends the request; it is not reported as text.
    pub stop_token_ids: Vec<u32>,
    /// What the generated text must match.
    pub constraint: Option<Constraint>,
}

impl GenerationRequest {
    /// Checks the request against `limits` ([`RequestLimits::check`]).
    pub fn check(&self, limits: &RequestLimits) -> Result<(), InvalidRequest> {
        limits
            .check(&self.prompt, Some(self.max_tokens), &self.sampling)
            .map(|_| ())
    }
}

/// What a backend tells the front end about one request, in order: tokens,
/// then exactly one `Finished` or `Failed`.
#[derive(Debug, Clone, PartialEq)]
pub enum GenEvent {
    /// A generated token (not a stop token).
    Token(Sampled),
    Finished(Usage),
    Failed(GenFailure),
}

/// Why an accepted request ended without finishing. The variant decides
/// what the client is told (and the HTTP / gRPC status); the `String`s are
/// detail for logs, never sent to clients.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GenFailure {
    /// The process serving it is shutting down: retryable elsewhere.
    #[error("the server is shutting down")]
    ShuttingDown,
    /// No worker could run it to the end (gone, unreachable, timed out):
    /// retryable.
    #[error("no worker could serve the request: {0}")]
    Unavailable(String),
    /// A worker refused the request as invalid. The message describes the
    /// client's request and may be shown to it.
    #[error("{0}")]
    Rejected(String),
    /// A fault inside the engine or between nodes.
    #[error("internal error: {0}")]
    Internal(String),
}

/// A request that cannot run, whatever the load: the client's to fix.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InvalidRequest {
    #[error("empty prompt: at least one token is required")]
    EmptyPrompt,
    #[error("token id {id} out of range (vocabulary has {vocab} tokens)")]
    TokenOutOfRange { id: u32, vocab: usize },
    /// A sampling parameter (`logit_bias`, `min_tokens`) names a token the
    /// vocabulary does not have.
    #[error("{param}: token id {id} out of range (vocabulary has {vocab} tokens)")]
    ParamTokenOutOfRange {
        param: &'static str,
        id: u32,
        vocab: usize,
    },
    #[error(
        "Prompt is too long: {prompt} tokens exceeds the configured maximum context length of {max} tokens. Please shorten your prompt."
    )]
    PromptTooLong { prompt: usize, max: usize },
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    /// The prompt plus the tokens asked for do not fit the context.
    /// `param` is the field that asked (`max_tokens` unless renamed by
    /// [`InvalidRequest::asked_by`]).
    #[error(
        "`{param}` is too large: {max_tokens}. The prompt has {prompt} tokens and the maximum \
         context length is {max} tokens, so at most {room} tokens can be generated; lower \
         `{param}` (or leave it out to generate up to the context length) or shorten the prompt.",
        room = room(*.max, *.prompt)
    )]
    MaxTokensTooLarge {
        param: &'static str,
        max_tokens: usize,
        prompt: usize,
        max: usize,
    },
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    /// The output constraint (`response_format`) cannot be used.
    #[error("Invalid response_format: {0}")]
    Constraint(String),
}

impl InvalidRequest {
    /// The request field at fault, in OpenAI's API terms.
    pub fn param(&self) -> Option<&'static str> {
        match self {
            Self::EmptyPrompt | Self::TokenOutOfRange { .. } | Self::PromptTooLong { .. } => {
                Some("prompt")
            }
            Self::ZeroMaxTokens => Some("max_tokens"),
            Self::MaxTokensTooLarge { param, .. } => Some(param),
            Self::ParamTokenOutOfRange { param, .. } => Some(param),
            Self::Sampling(e) => Some(e.param()),
            Self::Constraint(_) => Some("response_format"),
        }
    }

    /// OpenAI's error code, where it has one: `context_length_exceeded`
    /// when the prompt (with the tokens asked for) does not fit, and
    /// `invalid_value` when the tokens asked for alone cannot.
    pub fn code(&self) -> Option<&'static str> {
        match self {
            Self::PromptTooLong { .. } => Some("context_length_exceeded"),
            Self::MaxTokensTooLarge {
                max_tokens, max, ..
            } if max_tokens >= max => Some("invalid_value"),
            Self::MaxTokensTooLarge { .. } => Some("context_length_exceeded"),
            _ => None,
        }
    }

    /// The same error, naming `field` as the one that set `max_tokens`
    /// (`max_completion_tokens`, `max_output_tokens`).
    pub fn asked_by(self, field: &'static str) -> Self {
        match self {
            Self::MaxTokensTooLarge {
                max_tokens,
                prompt,
                max,
                ..
            } => Self::MaxTokensTooLarge {
                param: field,
                max_tokens,
                prompt,
                max,
            },
            other => other,
        }
    }
}

/// Tokens left to generate after a prompt of `prompt` in a context of `max`.
fn room(max: usize, prompt: usize) -> usize {
    max.saturating_sub(prompt)
}

/// The limits every request is checked against: the one place those checks
/// live, used by the front end before dispatch and by the engine on submit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestLimits {
    /// Longest sequence (prompt plus generated tokens).
    pub max_length: usize,
    pub vocab_size: usize,
}

impl RequestLimits {
    /// Checks a tokenized request; returns how many tokens it may generate:
    /// `max_tokens`, which with the prompt must fit `max_length` (as
    /// OpenAI's API, a request asking for more is refused, not cut short),
    /// or all the room left when `None`.
    pub fn check(
        &self,
        prompt: &[u32],
        max_tokens: Option<usize>,
        sampling: &SamplingParams,
    ) -> Result<usize, InvalidRequest> {
        if prompt.is_empty() {
            return Err(InvalidRequest::EmptyPrompt);
        }
        if let Some(&id) = prompt.iter().find(|&&t| t as usize >= self.vocab_size) {
            return Err(InvalidRequest::TokenOutOfRange {
                id,
                vocab: self.vocab_size,
            });
        }
        if prompt.len() >= self.max_length {
            return Err(InvalidRequest::PromptTooLong {
                prompt: prompt.len(),
                max: self.max_length,
            });
        }
        if max_tokens == Some(0) {
            return Err(InvalidRequest::ZeroMaxTokens);
        }
        let room = room(self.max_length, prompt.len());
        if let Some(m) = max_tokens.filter(|&m| m > room) {
            return Err(InvalidRequest::MaxTokensTooLarge {
                param: "max_tokens",
                max_tokens: m,
                prompt: prompt.len(),
                max: self.max_length,
            });
        }
        sampling.validate()?;
        if let Some((id, param)) = sampling
            .token_ids()
            .find(|&(id, _)| id as usize >= self.vocab_size)
        {
            return Err(InvalidRequest::ParamTokenOutOfRange {
                param,
                id,
                vocab: self.vocab_size,
            });
        }
        Ok(max_tokens.unwrap_or(room))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::MinTokens;

    const LIMITS: RequestLimits = RequestLimits {
        max_length: 8,
        vocab_size: 100,
    };

    #[test]
    fn every_check_names_its_field() {
        let ok = SamplingParams::default();
        let cases: [(&[u32], Option<usize>, SamplingParams, InvalidRequest); 9] = [
            (&[], None, ok.clone(), InvalidRequest::EmptyPrompt),
            (
                &[1, 100],
                None,
                ok.clone(),
                InvalidRequest::TokenOutOfRange {
                    id: 100,
                    vocab: 100,
                },
            ),
            (
                &[1; 8],
                None,
                ok.clone(),
                InvalidRequest::PromptTooLong { prompt: 8, max: 8 },
            ),
            (&[1], Some(0), ok.clone(), InvalidRequest::ZeroMaxTokens),
            (
                &[1],
                None,
                SamplingParams {
                    top_p: 0.0,
                    ..SamplingParams::default()
                },
                InvalidRequest::Sampling(SamplingError::OutOfRange {
                    name: "top_p",
                    range: "in (0, 1]",
                    value: 0.0,
                }),
            ),
            (
                &[1],
                None,
                SamplingParams {
                    logit_bias: vec![(3, 1.0), (100, -1.0)],
                    ..SamplingParams::default()
                },
                InvalidRequest::ParamTokenOutOfRange {
                    param: "logit_bias",
                    id: 100,
                    vocab: 100,
                },
            ),
            (
                &[1],
                None,
                SamplingParams {
                    logit_bias: vec![(3, 101.0)],
                    ..SamplingParams::default()
                },
                InvalidRequest::Sampling(SamplingError::OutOfRange {
                    name: "logit_bias",
                    range: "between -100 and 100",
                    value: 101.0,
                }),
            ),
            (
                &[1],
                None,
                SamplingParams {
                    logit_bias: vec![(3, 1.0), (3, 2.0)],
                    ..SamplingParams::default()
                },
                InvalidRequest::Sampling(SamplingError::Unsorted {
                    name: "logit_bias",
                    id: 3,
                }),
            ),
            (
                &[1],
                None,
                SamplingParams {
                    min_tokens: Some(MinTokens {
                        count: 2,
                        stop_ids: vec![7, 1000],
                    }),
                    ..SamplingParams::default()
                },
                InvalidRequest::ParamTokenOutOfRange {
                    param: "min_tokens",
                    id: 1000,
                    vocab: 100,
                },
            ),
        ];
        let params = [
            "prompt",
            "prompt",
            "prompt",
            "max_tokens",
            "top_p",
            "logit_bias",
            "logit_bias",
            "logit_bias",
            "min_tokens",
        ];
        for ((prompt, max, sampling, want), param) in cases.into_iter().zip(params) {
            let got = LIMITS.check(prompt, max, &sampling);
            assert_eq!(got.as_ref().err(), Some(&want), "{prompt:?} {max:?}");
            assert_eq!(want.param(), Some(param));
        }
    }

    #[test]
    fn max_tokens_must_fit_the_room_left() {
        let s = SamplingParams::default();
        assert_eq!(LIMITS.check(&[1, 2, 3], None, &s), Ok(5));
        assert_eq!(LIMITS.check(&[1, 2, 3], Some(2), &s), Ok(2));
        assert_eq!(LIMITS.check(&[1, 2, 3], Some(5), &s), Ok(5));
        assert_eq!(LIMITS.check(&[99; 7], Some(1), &s), Ok(1));
        let too_large = |max_tokens| InvalidRequest::MaxTokensTooLarge {
            param: "max_tokens",
            max_tokens,
            prompt: 3,
            max: 8,
        };
        for m in [6, 8, 999_999_999, usize::MAX] {
            let e = LIMITS
                .check(&[1, 2, 3], Some(m), &s)
                .expect_err("too large");
            assert_eq!(e, too_large(m));
            assert_eq!(e.param(), Some("max_tokens"));
        }
        // Over by one token is the context's fault; more than the context
        // holds is the value's.
        assert_eq!(too_large(6).code(), Some("context_length_exceeded"));
        assert_eq!(too_large(7).code(), Some("context_length_exceeded"));
        assert_eq!(too_large(8).code(), Some("invalid_value"));
        assert_eq!(too_large(usize::MAX).code(), Some("invalid_value"));
        let named = too_large(6).asked_by("max_output_tokens");
        assert_eq!(named.param(), Some("max_output_tokens"));
        assert_eq!(
            named.to_string(),
            "`max_output_tokens` is too large: 6. The prompt has 3 tokens and the maximum \
             context length is 8 tokens, so at most 5 tokens can be generated; lower \
             `max_output_tokens` (or leave it out to generate up to the context length) or \
             shorten the prompt."
        );
        // Other errors keep their field.
        assert_eq!(
            InvalidRequest::ZeroMaxTokens.asked_by("x").param(),
            Some("max_tokens")
        );
    }
}
