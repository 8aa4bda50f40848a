//! Mixture of experts against an independent implementation: two tiny
//! random Mixtral-style checkpoints (softmax routing; sigmoid routing with
//! a selection bias) and the logits HuggingFace transformers computed for
//! them (`scripts/moe/make_tiny_moe.py`, float64), run whole, with expert
//! parallelism over 2 and 4 CPU ranks (attention tensor-parallel over the
//! same ranks), with both ways of combining experts, and with batches that
//! do not split evenly over the ranks.

#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::sync::Arc;

use tandem_engine::comm::{Communicator, CpuGroup};
use tandem_engine::kv_cache::KvCache;
use tandem_engine::model::{DecoderModel, SeqChunk};
use tandem_engine::moe::Combine;
use tandem_engine::safetensors_loader::load_model_dir;

/// Our f32 weights and f16 KV cache against a float64 reference: logits
/// span about ±9 with std 2; measured max |diff| 0.0022 (softmax) and
/// 0.0029 (sigmoid), whole and split alike.
const TOL: f32 = 0.01;

/// `reference.json`: the prompts and, per prompt and position, the
/// vocabulary's logits.
#[derive(serde::Deserialize)]
struct Reference {
    prompts: Vec<Vec<u32>>,
    logits: Vec<Vec<Vec<f32>>>,
}

fn dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

fn reference(name: &str) -> Reference {
    let text = std::fs::read_to_string(dir(name).join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Logits of every position, feeding each prompt one token per step.
fn stepwise(m: &DecoderModel, prompt: &[u32]) -> Vec<Vec<f32>> {
    let mut cache = KvCache::new(m.kv_cache_config(4, 8)).unwrap();
    let mut table = Vec::new();
    cache.reserve(&mut table, prompt.len()).unwrap();
    (0..prompt.len())
        .map(|pos| {
            let chunk = SeqChunk {
                tokens: &prompt[pos..pos + 1],
                start_pos: pos,
                block_table: &table,
                want_logits: true,
            };
            m.forward(&[chunk], &mut cache).unwrap()
        })
        .collect()
}

/// Last-position logits of every prompt, all prompts in one batch.
fn batched(m: &DecoderModel, prompts: &[Vec<u32>]) -> Vec<Vec<f32>> {
    let mut cache = KvCache::new(m.kv_cache_config(4, 32)).unwrap();
    let tables: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            let mut t = Vec::new();
            cache.reserve(&mut t, p.len()).unwrap();
            t
        })
        .collect();
    let chunks: Vec<SeqChunk<'_>> = prompts
        .iter()
        .zip(&tables)
        .map(|(p, t)| SeqChunk {
            tokens: p,
            start_pos: 0,
            block_table: t,
            want_logits: true,
        })
        .collect();
    let logits = m.forward(&chunks, &mut cache).unwrap();
    let vocab = logits.len() / prompts.len();
    logits.chunks_exact(vocab).map(<[f32]>::to_vec).collect()
}

/// Checks one model (a whole model or one rank of a split) against the
/// reference: every position step by step, and all prompts batched
/// (35 tokens, and the 5-token prompt alone). Returns the largest diff.
fn check(m: &DecoderModel, r: &Reference, what: &str) -> f32 {
    let mut worst = 0.0f32;
    for (p, want) in r.prompts.iter().zip(&r.logits) {
        for (pos, got) in stepwise(m, p).iter().enumerate() {
            let d = max_diff(got, &want[pos]);
            assert!(d <= TOL, "{what}: prompt of {} at {pos}: {d}", p.len());
            worst = worst.max(d);
        }
    }
    for (i, got) in batched(m, &r.prompts).iter().enumerate() {
        let d = max_diff(got, r.logits[i].last().unwrap());
        assert!(d <= TOL, "{what}: batched prompt {i}: {d}");
        worst = worst.max(d);
    }
    let got = batched(m, &r.prompts[1..2]);
    let d = max_diff(&got[0], r.logits[1].last().unwrap());
    assert!(d <= TOL, "{what}: 5-token batch: {d}");
    worst.max(d)
}

#[test]
fn whole_model_matches_transformers() {
    for name in ["tiny-moe", "tiny-moe-sigmoid"] {
        let m = load_model_dir(&dir(name)).unwrap();
        let worst = check(&m, &reference(name), name);
        eprintln!("{name}: max |logit diff| {worst:.5}");
    }
}

#[test]
fn expert_parallel_ranks_match_transformers() {
    for name in ["tiny-moe", "tiny-moe-sigmoid"] {
        let whole = load_model_dir(&dir(name)).unwrap();
        let r = reference(name);
        for world in [2, 4] {
            for combine in [Combine::AllReduce, Combine::Dispatch] {
                let shards: Vec<DecoderModel> = CpuGroup::new(world)
                    .into_iter()
                    .map(|c| {
                        let comm: Arc<dyn Communicator> = Arc::new(c);
                        whole.shard_with(comm, combine).unwrap()
                    })
                    .collect();
                let what = format!("{name} EP={world} {combine:?}");
                let worst = std::thread::scope(|s| {
                    let hs: Vec<_> = shards
                        .iter()
                        .enumerate()
                        .map(|(rank, m)| {
                            let (r, what) = (&r, format!("{what} rank {rank}"));
                            s.spawn(move || check(m, r, &what))
                        })
                        .collect();
                    hs.into_iter()
                        .map(|h| h.join().unwrap())
                        .fold(0.0f32, f32::max)
                });
                eprintln!("{what}: max |logit diff| {worst:.5}");
            }
        }
    }
}

#[test]
fn splits_that_do_not_divide_the_experts_are_refused() {
    let whole = load_model_dir(&dir("tiny-moe")).unwrap();
    // 8 experts and 4 KV heads: 3 ranks divide neither.
    let comm: Arc<dyn Communicator> = Arc::new(CpuGroup::new(3).remove(0));
    let e = whole.shard(comm).unwrap_err().to_string();
    assert!(e.contains("does not divide"), "{e}");
}
