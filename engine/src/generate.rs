//! Single-sequence generation: chunked prefill, then token-by-token decode
//! with streaming text, stop tokens and stop strings, over any
//! [`SequenceModel`]. Used by `tandem generate`.

use std::time::{Duration, Instant};

use tandem_modelfile::stop::StopStrings;
use tandem_modelfile::tokenizer::Tokenizer;
use tandem_types::{FinishReason, RequestLimits};

use crate::error::RequestError;
use crate::kv_cache::KvCache;
use crate::loader::LoadedModel;
use crate::model::SeqChunk;
use crate::sampler::{Sampled, Sampler, SamplingParams};

/// Tokens per block of the KV cache used by `generate`.
pub const BLOCK_SIZE: usize = 16;

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    /// Generation ends when one of these is sampled (it is not part of the text).
    pub stop_token_ids: Vec<u32>,
    /// Generation ends when the text contains one of these (cut before it).
    pub stop_strings: Vec<String>,
    /// Longest prompt prefill runs in one forward call.
    pub prefill_chunk: usize,
}

/// What was generated, and how fast.
#[derive(Debug, Clone)]
pub struct GenerateOutput {
    pub tokens: Vec<u32>,
    pub sampled: Vec<Sampled>,
    pub text: String,
    pub finish: FinishReason,
    pub prefill_time: Duration,
    pub decode_time: Duration,
    /// Logits after the prompt (before the first sampled token).
    pub prompt_logits: Vec<f32>,
}

/// What `generate` runs: one sequence's forward passes. The CPU engine over
/// its own KV cache ([`generate`]), or a device backend (`tandem generate
/// --devices gpu:N`).
pub trait SequenceModel {
    /// Runs `tokens` from position `start_pos` (every earlier position has
    /// run) and returns the logits after the last of them, or nothing when
    /// `want_logits` is false (a prompt chunk before the last).
    fn forward(
        &mut self,
        tokens: &[u32],
        start_pos: usize,
        want_logits: bool,
    ) -> Result<Vec<f32>, RequestError>;
}

/// The CPU engine as a [`SequenceModel`]: a KV cache sized for `tokens`.
struct CpuSequence<'a> {
    m: &'a LoadedModel,
    cache: KvCache,
    table: Vec<crate::block_allocator::BlockId>,
}

impl SequenceModel for CpuSequence<'_> {
    fn forward(
        &mut self,
        tokens: &[u32],
        start_pos: usize,
        want_logits: bool,
    ) -> Result<Vec<f32>, RequestError> {
        self.cache
            .reserve(&mut self.table, start_pos + tokens.len())?;
        self.m.model.forward(
            &[SeqChunk {
                tokens,
                start_pos,
                block_table: &self.table,
                want_logits,
            }],
            &mut self.cache,
        )
    }
}

/// Runs `req` on the CPU engine to completion, calling `on_text` with each
/// new piece of text.
pub fn generate(
    m: &LoadedModel,
    req: &GenerateRequest,
    on_text: impl FnMut(&str),
) -> Result<GenerateOutput, RequestError> {
    let cfg = m.model.config();
    let limits = RequestLimits {
        max_length: cfg.context_length,
        vocab_size: cfg.vocab_size,
    };
    // Checked before sizing the cache by it.
    let max_tokens = limits.check(&req.prompt, Some(req.max_tokens), &req.sampling)?;
    let total = req.prompt.len() + max_tokens;
    let kv_cfg = m
        .model
        .kv_cache_config(BLOCK_SIZE, total.div_ceil(BLOCK_SIZE).max(1));
    let mut seq = CpuSequence {
        m,
        cache: KvCache::new(kv_cfg)?,
        table: Vec::new(),
    };
    let out = generate_on(&mut seq, &m.text.tokenizer, limits, req, on_text);
    seq.cache.blocks_mut().release(&mut seq.table)?;
    out
}

/// Runs `req` on `model` to completion: chunked prefill, then sampling,
/// streaming text through `on_text`, stop tokens and stop strings.
pub fn generate_on(
    model: &mut dyn SequenceModel,
    tokenizer: &Tokenizer,
    limits: RequestLimits,
    req: &GenerateRequest,
    mut on_text: impl FnMut(&str),
) -> Result<GenerateOutput, RequestError> {
    let max_tokens = limits.check(&req.prompt, Some(req.max_tokens), &req.sampling)?;
    let mut sampler = Sampler::new(req.sampling.clone(), &req.prompt)?;

    let t0 = Instant::now();
    let chunk = req.prefill_chunk.max(1);
    let mut logits = Vec::new();
    let mut pos = 0;
    for piece in req.prompt.chunks(chunk) {
        let last = pos + piece.len() == req.prompt.len();
        logits = model.forward(piece, pos, last)?;
        pos += piece.len();
    }
    let prefill_time = t0.elapsed();
    let prompt_logits = logits.clone();

    let t1 = Instant::now();
    let mut decoder = tokenizer.stream_decoder(true);
    let mut stops = StopStrings::new(&req.stop_strings);
    let mut out = GenerateOutput {
        tokens: Vec::new(),
        sampled: Vec::new(),
        text: String::new(),
        finish: FinishReason::Length,
        prefill_time,
        decode_time: Duration::ZERO,
        prompt_logits,
    };
    while out.tokens.len() < max_tokens {
        let s = sampler.sample(&mut logits);
        let token = s.token;
        if req.stop_token_ids.contains(&token) {
            out.finish = FinishReason::Stop;
            break;
        }
        out.tokens.push(token);
        out.sampled.push(s);
        let piece = decoder.push(token)?;
        let (emit, hit) = stops.push(&piece);
        out.text.push_str(&emit);
        on_text(&emit);
        if hit {
            out.finish = FinishReason::Stop;
            break;
        }
        if out.tokens.len() == max_tokens {
            break;
        }
        logits = model.forward(&[token], pos, true)?;
        pos += 1;
    }
    if out.finish == FinishReason::Length {
        let rest = stops.finish(&decoder.finish());
        out.text.push_str(&rest);
        on_text(&rest);
    }
    out.decode_time = t1.elapsed();
    Ok(out)
}
