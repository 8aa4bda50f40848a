//! A stand-in for the forward pass, for measuring everything around it
//! (router, gRPC, KV events, KV handoffs) at cluster scale on a laptop.
//!
//! [`MockModel`] serves a real model's tokenizer, template and fingerprint
//! (read without its weights) and times each step from an
//! [`EngineProfile`] measured by `tandem bench-engine --profile`. Its KV
//! cache is real: every token's K rows (every layer) carry a hash chained
//! over the sequence, and the next token is a pure function of the last
//! hash, read back from the cache. So tokens are deterministic, equal
//! whether a prompt was prefilled here or on a peer, and a KV handoff that
//! moved wrong bytes shows as a failed request, never as plausible output.

use std::sync::Arc;
use std::time::{Duration, Instant};

use half::f16;
use tandem_modelfile::config::ModelConfig;
use tandem_modelfile::{ModelMeta, ModelText};
use tandem_perfmodel::EngineProfile;

use crate::backend::{LogitsForm, RunnerConfig, ServedModel, StepLogits, StepRunner};
use crate::error::{MockError, RequestError, RunnerError};
use crate::kv_cache::{KvCache, KvCacheConfig, KvPool};
use crate::model::SeqChunk;

/// The hash "before" position 0.
const SEED: u64 = 0x7461_6e64_656d_6d6b;
/// f16 slots of a K row holding the hash (4 x 16 bits).
const HASH_SLOTS: usize = 4;
/// Steps whose per-layer share is shorter than this sleep once (a sleep's
/// own overshoot is tens of microseconds).
const MIN_LAYER_SLEEP: Duration = Duration::from_micros(200);
/// The logit of the chosen token; every other token's is 0.
const CHOSEN_LOGIT: f32 = 30.0;

/// A model served without weights; see the module docs.
#[derive(Debug)]
pub struct MockModel {
    config: ModelConfig,
    text: Arc<ModelText>,
    weights_hash: u64,
    profile: EngineProfile,
    /// Multiplies every profiled time: 1 is the measured engine, 0 instant.
    time_scale: f64,
    /// Tokens the mock emits: plain words, so streamed text is readable and
    /// no stop token ends a request early.
    words: Vec<u32>,
}

impl MockModel {
    pub fn new(
        meta: ModelMeta,
        profile: EngineProfile,
        time_scale: f64,
    ) -> Result<Self, MockError> {
        if !(time_scale.is_finite() && time_scale >= 0.0) {
            return Err(MockError::TimeScale(time_scale));
        }
        if meta.config.head_dim < HASH_SLOTS {
            return Err(MockError::HeadTooSmall {
                need: HASH_SLOTS,
                head_dim: meta.config.head_dim,
            });
        }
        let tok = &meta.text.tokenizer;
        let plain = |id: u32| {
            !tok.is_special(id)
                && tok.token_to_piece_bytes(id).is_some_and(|b| {
                    b.len() >= 3
                        && b.len() <= 9
                        && b[0] == b' '
                        && b[1..].iter().all(u8::is_ascii_lowercase)
                })
        };
        let vocab = meta.config.vocab_size.min(tok.vocab_size()) as u32;
        let mut words: Vec<u32> = (0..vocab).filter(|&id| plain(id)).take(4096).collect();
        if words.is_empty() {
            words = (0..vocab)
                .filter(|&id| !tok.is_special(id))
                .take(4096)
                .collect();
        }
        if words.is_empty() {
            words.push(0);
        }
        Ok(Self {
            config: meta.config,
            text: Arc::new(meta.text),
            weights_hash: meta.weights_hash,
            profile,
            time_scale,
            words,
        })
    }

    pub fn profile(&self) -> &EngineProfile {
        &self.profile
    }

    /// The token that follows a position whose chained hash is `h`.
    pub fn next_token(&self, h: u64) -> u32 {
        self.words[(mix(h, 0x9e37_79b9) % self.words.len() as u64) as usize]
    }

    /// The chained hash after `tokens` from position 0 (what the cache
    /// holds at the last position).
    pub fn chain(tokens: &[u32]) -> u64 {
        tokens
            .iter()
            .enumerate()
            .fold(SEED, |h, (pos, &t)| step_hash(h, t, pos))
    }

    /// The greedy continuation the mock produces for `prompt` (what any
    /// node, or any pair of nodes handing KV over, must stream).
    pub fn continuation(&self, prompt: &[u32], max_tokens: usize) -> Vec<u32> {
        let mut h = Self::chain(prompt);
        let mut out = Vec::with_capacity(max_tokens);
        for pos in prompt.len()..prompt.len() + max_tokens {
            let t = self.next_token(h);
            out.push(t);
            h = step_hash(h, t, pos);
        }
        out
    }

    /// Seconds one step of these chunks takes on the profiled engine.
    fn step_time(&self, chunks: &[SeqChunk<'_>]) -> Duration {
        let (mut prefill, mut decode, mut context) = (0usize, 0usize, 0usize);
        for c in chunks {
            // A one-token chunk over a cached context is a decode step's
            // work, whether it is a sampled token or a chunked prompt's tail.
            if c.tokens.len() == 1 && c.start_pos > 0 {
                decode += 1;
                context += c.start_pos + 1;
            } else {
                prefill += c.tokens.len();
            }
        }
        let mean_context = context.checked_div(decode).unwrap_or(0);
        let secs = self.profile.step_seconds(prefill, decode, mean_context) * self.time_scale;
        Duration::try_from_secs_f64(secs).unwrap_or(Duration::ZERO)
    }
}

fn mix(a: u64, b: u64) -> u64 {
    // SplitMix64's finaliser over the combined word.
    let mut z = a ^ b.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn step_hash(prev: u64, token: u32, pos: usize) -> u64 {
    mix(prev, (u64::from(token) << 32) | pos as u64)
}

fn to_slots(h: u64) -> [f16; HASH_SLOTS] {
    std::array::from_fn(|i| f16::from_bits((h >> (16 * i)) as u16))
}

fn from_slots(s: &[f16]) -> u64 {
    s.iter()
        .take(HASH_SLOTS)
        .enumerate()
        .fold(0, |h, (i, v)| h | (u64::from(v.to_bits()) << (16 * i)))
}

impl ServedModel for MockModel {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn text(&self) -> &Arc<ModelText> {
        &self.text
    }

    fn weights_hash(&self) -> u64 {
        self.weights_hash
    }

    fn runner(self: Arc<Self>, config: RunnerConfig) -> Result<Box<dyn StepRunner>, RunnerError> {
        if config.tp > 1 {
            return Err(MockError::TensorParallel(config.tp).into());
        }
        let kv = self.kv_cache_config(config.block_size, config.num_blocks);
        Ok(Box::new(MockRunner { model: self, kv }))
    }
}

struct MockRunner {
    model: Arc<MockModel>,
    kv: KvCacheConfig,
}

impl MockRunner {
    /// The hash at `pos`, checked to be the same in every layer.
    fn read(&self, cache: &KvCache, table: &[u32], pos: usize) -> Result<u64, RequestError> {
        let bs = self.kv.block_size;
        let block = *table
            .get(pos / bs)
            .ok_or(RequestError::BlockTableTooShort {
                have: table.len(),
                tokens: pos + 1,
            })?;
        let at = (pos % bs) * self.kv.head_dim;
        let mut first = None;
        for layer in 0..self.kv.n_layers {
            let row = &cache.head_slice(block, layer, 0, 0)[at..at + HASH_SLOTS];
            let h = from_slots(row);
            match first {
                None => first = Some(h),
                Some(f) if f != h => {
                    return Err(MockError::KvMismatch { pos, layer }.into());
                }
                Some(_) => {}
            }
        }
        Ok(first.unwrap_or(SEED))
    }

    fn write(&self, cache: &mut KvCache, block: u32, slot: usize, h: u64) {
        let at = slot * self.kv.head_dim;
        let slots = to_slots(h);
        for layer in 0..self.kv.n_layers {
            cache.head_slice_mut(block, layer, 0, 0)[at..at + HASH_SLOTS].copy_from_slice(&slots);
        }
    }
}

impl StepRunner for MockRunner {
    fn kv_cache_config(&self) -> KvCacheConfig {
        self.kv
    }

    fn peer_pools(&self) -> Vec<Arc<KvPool>> {
        Vec::new()
    }

    fn forward(
        &self,
        chunks: &[SeqChunk<'_>],
        cache: &mut KvCache,
        layer_done: &mut dyn FnMut(usize),
        _want: LogitsForm,
        logits: &mut StepLogits,
    ) -> Result<(), RequestError> {
        let t0 = Instant::now();
        let logits = logits.full();
        let vocab = self.model.config.vocab_size;
        let bs = self.kv.block_size;
        let rows = chunks.iter().filter(|c| c.want_logits).count();
        logits.clear();
        logits.resize(rows * vocab, 0.0);
        let mut row = 0;
        for c in chunks {
            let last = c.start_pos + c.tokens.len();
            if c.block_table.len() * bs < last {
                return Err(RequestError::BlockTableTooShort {
                    have: c.block_table.len(),
                    tokens: last,
                });
            }
            let mut h = match c.start_pos {
                0 => SEED,
                p => self.read(cache, c.block_table, p - 1)?,
            };
            for (i, &t) in c.tokens.iter().enumerate() {
                let pos = c.start_pos + i;
                h = step_hash(h, t, pos);
                self.write(cache, c.block_table[pos / bs], pos % bs, h);
            }
            if c.want_logits {
                let next = self.model.next_token(h) as usize;
                if let Some(l) = logits.get_mut(row * vocab + next) {
                    *l = CHOSEN_LOGIT;
                }
                row += 1;
            }
        }
        let total = self.model.step_time(chunks);
        let layers = self.kv.n_layers.max(1);
        if total / layers as u32 >= MIN_LAYER_SLEEP {
            // Layers "finish" in turn, so layer-streamed handoffs overlap
            // the step as they do on the real engine.
            for l in 0..layers {
                sleep_until(t0 + total * (l as u32 + 1) / layers as u32);
                layer_done(l);
            }
        } else {
            sleep_until(t0 + total);
            (0..layers).for_each(&mut *layer_done);
        }
        Ok(())
    }
}

fn sleep_until(t: Instant) {
    let now = Instant::now();
    if t > now {
        std::thread::sleep(t - now);
    }
}
