//! Single-sequence generation: chunked prefill, then token-by-token decode
//! with streaming text, stop tokens and stop strings. Used by
//! `tandem generate`; the batch scheduler reuses [`StopStrings`].

use std::time::{Duration, Instant};

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

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token or stop string.
    Stop,
    /// `max_tokens` or the context length.
    Length,
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

/// Runs `req` to completion, calling `on_text` with each new piece of text.
pub fn generate(
    m: &LoadedModel,
    req: &GenerateRequest,
    mut on_text: impl FnMut(&str),
) -> Result<GenerateOutput, RequestError> {
    let cfg = m.model.config();
    let max_len = cfg.context_length;
    if req.prompt.is_empty() {
        return Err(RequestError::EmptyPrompt);
    }
    if req.prompt.len() >= max_len {
        return Err(RequestError::PromptTooLong {
            prompt: req.prompt.len(),
            max: max_len,
        });
    }
    let max_tokens = req.max_tokens.min(max_len - req.prompt.len());
    let total = req.prompt.len() + max_tokens;
    let kv_cfg = m
        .model
        .kv_cache_config(BLOCK_SIZE, total.div_ceil(BLOCK_SIZE).max(1));
    let mut cache = KvCache::new(kv_cfg)?;
    let mut table = Vec::new();
    let mut sampler = Sampler::new(req.sampling.clone(), &req.prompt)?;

    let t0 = Instant::now();
    let chunk = req.prefill_chunk.max(1);
    let mut logits = Vec::new();
    let mut pos = 0;
    for piece in req.prompt.chunks(chunk) {
        cache.reserve(&mut table, pos + piece.len())?;
        let last = pos + piece.len() == req.prompt.len();
        logits = m.model.forward(
            &[SeqChunk {
                tokens: piece,
                start_pos: pos,
                block_table: &table,
                want_logits: last,
            }],
            &mut cache,
        )?;
        pos += piece.len();
    }
    let prefill_time = t0.elapsed();
    let prompt_logits = logits.clone();

    let t1 = Instant::now();
    let mut decoder = m.tokenizer.stream_decoder(true);
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
        if let Err(e) = cache.reserve(&mut table, pos + 1) {
            // Sized for prompt + max_tokens up front, so this cannot run out.
            return Err(RequestError::KvCache(e));
        }
        logits = m.model.forward(
            &[SeqChunk {
                tokens: &[token],
                start_pos: pos,
                block_table: &table,
                want_logits: true,
            }],
            &mut cache,
        )?;
        pos += 1;
    }
    if out.finish == FinishReason::Length {
        let rest = stops.finish(&decoder.finish());
        out.text.push_str(&rest);
        on_text(&rest);
    }
    out.decode_time = t1.elapsed();
    cache.blocks_mut().release(&mut table)?;
    Ok(out)
}

/// Streams text while watching for stop strings: holds back any tail that
/// could still become a stop string, and cuts the text before a match.
#[derive(Debug, Clone)]
pub struct StopStrings {
    stops: Vec<String>,
    pending: String,
}

impl StopStrings {
    pub fn new(stops: &[String]) -> Self {
        Self {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            pending: String::new(),
        }
    }

    /// Adds new text; returns the text that is safe to emit and whether a
    /// stop string was found (then nothing more should be generated).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        self.pending.push_str(text);
        if let Some(cut) = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min()
        {
            let emit = self.pending[..cut].to_string();
            self.pending.clear();
            return (emit, true);
        }
        // Keep the longest suffix that is a proper prefix of some stop string.
        let mut keep = 0;
        for s in &self.stops {
            for (i, _) in s.char_indices().skip(1) {
                if i > keep && self.pending.ends_with(&s[..i]) {
                    keep = i;
                }
            }
        }
        let split = self.pending.len() - keep;
        let emit = self.pending[..split].to_string();
        self.pending.drain(..split);
        (emit, false)
    }

    /// Flushes what was held back (generation ended for another reason).
    pub fn finish(&mut self, tail: &str) -> String {
        let (mut emit, hit) = self.push(tail);
        if !hit {
            emit.push_str(&std::mem::take(&mut self.pending));
        }
        emit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut s = StopStrings::new(&stops);
        let mut out = String::new();
        for p in pieces {
            let (emit, hit) = s.push(p);
            out.push_str(&emit);
            if hit {
                return (out, true);
            }
        }
        out.push_str(&s.finish(""));
        (out, false)
    }

    #[test]
    fn stop_string_split_across_pieces_is_cut() {
        assert_eq!(
            run(&["STOP"], &["ab", "cS", "TO", "Pxyz"]),
            ("abc".into(), true)
        );
    }

    #[test]
    fn held_back_prefix_is_released_when_it_diverges() {
        let mut s = StopStrings::new(&["END".to_string()]);
        assert_eq!(s.push("xE"), ("x".into(), false));
        assert_eq!(s.push("Nd"), ("ENd".into(), false));
        assert_eq!(run(&["END"], &["aE", "N"]), ("aEN".into(), false));
    }

    #[test]
    fn earliest_stop_wins_and_multibyte_is_safe() {
        assert_eq!(run(&["é!", "b"], &["aé", "!b"]), ("a".into(), true));
        assert_eq!(run(&["日本"], &["x日", "y"]), ("x日y".into(), false));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
    }
}
