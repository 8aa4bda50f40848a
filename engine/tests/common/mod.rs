//! Helpers shared by the engine's integration tests.

use tandem_engine::kv_cache::KvCache;
use tandem_engine::model::{DecoderModel, SeqChunk};

/// The logits of `prompt`'s last position, the prompt run as one chunk
/// over a fresh cache.
pub fn last_logits(m: &DecoderModel, prompt: &[u32]) -> Vec<f32> {
    let mut cache = KvCache::new(m.kv_cache_config(16, prompt.len().div_ceil(16))).expect("cache");
    let mut table = Vec::new();
    cache.reserve(&mut table, prompt.len()).expect("space");
    m.forward(
        &[SeqChunk {
            tokens: prompt,
            start_pos: 0,
            block_table: &table,
            want_logits: true,
        }],
        &mut cache,
    )
    .expect("forward")
}
