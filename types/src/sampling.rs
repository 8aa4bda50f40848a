//! What a request asks of the sampler, and what it gets back per token.
//! Plain data, validated here once; the sampler itself lives in the engine.

/// How to pick tokens for one request.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means no top-k truncation.
    pub top_k: usize,
    /// 1.0 means no nucleus truncation.
    pub top_p: f32,
    /// 0.0 means no min-p truncation.
    pub min_p: f32,
    /// Seed of the request's own generator; `None` draws one from the OS.
    pub seed: Option<u64>,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    /// 1.0 means none (HF/llama.cpp style: divide positive logits, multiply negative).
    pub repetition_penalty: f32,
    /// Number of most likely alternatives to report with each token (0 = none).
    pub top_logprobs: usize,
    /// Report the chosen token's log-probability.
    pub logprobs: bool,
    /// Added to these tokens' logits before sampling (OpenAI `logit_bias`),
    /// sorted by token id, at most one entry per token.
    pub logit_bias: Vec<(u32, f32)>,
    /// Tokens that may not be sampled before a number of tokens has been
    /// generated (vLLM's `min_tokens`).
    pub min_tokens: Option<MinTokens>,
}

/// vLLM's `min_tokens`: `stop_ids` (the request's stop tokens) are banned
/// until `count` tokens have been generated. Carried with the sampling
/// parameters so that a prefill node sampling the first token honours it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MinTokens {
    pub count: u32,
    pub stop_ids: Vec<u32>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            repetition_penalty: 1.0,
            top_logprobs: 0,
            logprobs: false,
            logit_bias: Vec::new(),
            min_tokens: None,
        }
    }
}

/// The largest `top_logprobs` accepted (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Most `logit_bias` entries in one request (OpenAI's limit).
pub const MAX_LOGIT_BIAS: usize = 300;

/// Most stop tokens `min_tokens` may ban (a model has a handful).
pub const MAX_MIN_TOKENS_STOPS: usize = 64;

/// A sampling parameter outside its range.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum SamplingError {
    #[error("{name} must be {range}, got {value}")]
    OutOfRange {
        name: &'static str,
        range: &'static str,
        value: f64,
    },
    #[error("{name} has {got} entries; at most {max} are allowed")]
    TooMany {
        name: &'static str,
        max: usize,
        got: usize,
    },
    #[error("{name} names token id {id} more than once or out of order")]
    Unsorted { name: &'static str, id: u32 },
}

impl SamplingError {
    /// The request field at fault, in OpenAI's API terms.
    pub fn param(&self) -> &'static str {
        match self {
            Self::OutOfRange { name, .. }
            | Self::TooMany { name, .. }
            | Self::Unsorted { name, .. } => name,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding with no penalties.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    pub fn validate(&self) -> Result<(), SamplingError> {
        let check = |ok: bool, name, range, value: f64| {
            if ok {
                Ok(())
            } else {
                Err(SamplingError::OutOfRange { name, range, value })
            }
        };
        let t = self.temperature;
        check(
            t.is_finite() && (0.0..=2.0).contains(&t),
            "temperature",
            "between 0 and 2",
            t.into(),
        )?;
        let p = self.top_p;
        check(
            p.is_finite() && p > 0.0 && p <= 1.0,
            "top_p",
            "in (0, 1]",
            p.into(),
        )?;
        let m = self.min_p;
        check(
            m.is_finite() && (0.0..=1.0).contains(&m),
            "min_p",
            "between 0 and 1",
            m.into(),
        )?;
        for (name, v) in [
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ] {
            check(
                v.is_finite() && (-2.0..=2.0).contains(&v),
                name,
                "between -2 and 2",
                v.into(),
            )?;
        }
        let r = self.repetition_penalty;
        check(
            r.is_finite() && r > 0.0 && r <= 10.0,
            "repetition_penalty",
            "in (0, 10]",
            r.into(),
        )?;
        check(
            self.top_logprobs <= MAX_TOP_LOGPROBS,
            "top_logprobs",
            "between 0 and 20",
            self.top_logprobs as f64,
        )?;
        if self.logit_bias.len() > MAX_LOGIT_BIAS {
            return Err(SamplingError::TooMany {
                name: "logit_bias",
                max: MAX_LOGIT_BIAS,
                got: self.logit_bias.len(),
            });
        }
        let mut last = None;
        for &(id, b) in &self.logit_bias {
            check(
                b.is_finite() && (-100.0..=100.0).contains(&b),
                "logit_bias",
                "between -100 and 100",
                b.into(),
            )?;
            if last.is_some_and(|l| l >= id) {
                return Err(SamplingError::Unsorted {
                    name: "logit_bias",
                    id,
                });
            }
            last = Some(id);
        }
        if let Some(m) = &self.min_tokens
            && m.stop_ids.len() > MAX_MIN_TOKENS_STOPS
        {
            return Err(SamplingError::TooMany {
                name: "min_tokens",
                max: MAX_MIN_TOKENS_STOPS,
                got: m.stop_ids.len(),
            });
        }
        Ok(())
    }

    /// Every token id the parameters name (to check against the vocabulary).
    pub fn token_ids(&self) -> impl Iterator<Item = (u32, &'static str)> + '_ {
        let bias = self.logit_bias.iter().map(|&(id, _)| (id, "logit_bias"));
        let stops = self
            .min_tokens
            .iter()
            .flat_map(|m| m.stop_ids.iter().map(|&id| (id, "min_tokens")));
        bias.chain(stops)
    }
}

/// One sampled token and, if asked for, its log-probabilities.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    /// Log-probability of `token` under the raw model distribution.
    pub logprob: Option<f32>,
    /// Most likely alternatives, most likely first.
    pub top: Vec<(u32, f32)>,
}
