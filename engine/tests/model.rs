//! Properties of the forward pass on the real SmolLM2 GGUF: batched vs
//! single-sequence equivalence, independence from how a prompt is split
//! into prefill chunks and decode steps, and bad requests rejected. Its
//! comparisons with independent references (llama.cpp's greedy output,
//! perplexity and top-20 log-probabilities, a numpy float32 forward pass)
//! are the `smollm2` family in `tests/families.rs`.
//!
//! Needs `TANDEM_TEST_GGUF` pointing at SmolLM2-135M-Instruct.Q4_1.gguf
//! (`scripts/test.sh` fetches it and sets the variable).

mod common;

use std::path::PathBuf;
use std::sync::OnceLock;

use tandem_engine::generate::{GenerateRequest, generate};
use tandem_engine::kv_cache::KvCache;
use tandem_engine::model::SeqChunk;
use tandem_engine::sampler::SamplingParams;
use tandem_engine::{LoadedModel, load};

fn model() -> &'static LoadedModel {
    static M: OnceLock<LoadedModel> = OnceLock::new();
    M.get_or_init(|| {
        let path = std::env::var_os("TANDEM_TEST_GGUF").expect(
            "set TANDEM_TEST_GGUF to the SmolLM2-135M-Instruct Q4_1 GGUF (scripts/test.sh does this)",
        );
        load(&PathBuf::from(path)).expect("model loads")
    })
}

fn last_logits(prompt: &[u32]) -> Vec<f32> {
    common::last_logits(&model().model, prompt)
}

/// Prefill chunks and decode tokens of several sequences in one step give
/// bitwise the same logits as each sequence run alone.
#[test]
fn batched_forward_equals_single_sequence_forward() {
    let m = &model().model;
    let tok = &model().text.tokenizer;
    let texts = [
        "The quick brown fox jumps over the lazy dog because",
        "In 1905, Albert Einstein published",
        "fn main() { println!(\"hello\"); }",
        "Paris",
    ];
    let seqs: Vec<Vec<u32>> = texts
        .iter()
        .map(|t| tok.encode(t, false).expect("tok"))
        .collect();
    let bs = 4; // small blocks so sequences span several, non-contiguous blocks
    let mut cache = KvCache::new(m.kv_cache_config(bs, 64)).expect("cache");

    // Reference: each sequence alone, in its own cache, all tokens at once.
    let alone: Vec<Vec<f32>> = seqs.iter().map(|s| last_logits(s)).collect();

    // Batched: sequences 0 and 1 prefill a first part alone, then one step
    // mixes: seq 0 decodes its last token, seq 1 prefills its remaining
    // chunk, seq 2 prefills entirely, seq 3 (one token) too.
    let mut tables: Vec<Vec<u32>> = vec![Vec::new(); seqs.len()];
    // Interleave allocation so block tables are not contiguous ranges.
    for len in 1..=seqs.iter().map(Vec::len).max().expect("non-empty") {
        for (s, t) in seqs.iter().zip(tables.iter_mut()) {
            if len <= s.len() {
                cache.reserve(t, len).expect("space");
            }
        }
    }
    let split0 = seqs[0].len() - 1;
    let split1 = seqs[1].len() / 2;
    m.forward(
        &[
            SeqChunk {
                tokens: &seqs[0][..split0],
                start_pos: 0,
                block_table: &tables[0],
                want_logits: false,
            },
            SeqChunk {
                tokens: &seqs[1][..split1],
                start_pos: 0,
                block_table: &tables[1],
                want_logits: true,
            },
        ],
        &mut cache,
    )
    .expect("first step");
    // Into a reused buffer, longer than needed and full of NaN: it must be
    // resized and wholly overwritten.
    let vocab = m.config().vocab_size;
    let mut batched = vec![f32::NAN; 7 * vocab];
    m.forward_into(
        &[
            SeqChunk {
                tokens: &seqs[0][split0..],
                start_pos: split0,
                block_table: &tables[0],
                want_logits: true,
            },
            SeqChunk {
                tokens: &seqs[1][split1..],
                start_pos: split1,
                block_table: &tables[1],
                want_logits: true,
            },
            SeqChunk {
                tokens: &seqs[2],
                start_pos: 0,
                block_table: &tables[2],
                want_logits: true,
            },
            SeqChunk {
                tokens: &seqs[3],
                start_pos: 0,
                block_table: &tables[3],
                want_logits: true,
            },
        ],
        &mut cache,
        &mut |_| {},
        &mut batched,
    )
    .expect("mixed step");
    assert_eq!(batched.len(), 4 * vocab);
    for (i, want) in alone.iter().enumerate() {
        let got = &batched[i * vocab..(i + 1) * vocab];
        assert!(got == want.as_slice(), "sequence {i} differs in a batch");
    }
}

/// A long prompt's attention runs in tiles of several tokens (each K/V row
/// converted once for all of them, threads balanced across the causal
/// triangle); chunked prefill and one-token decode steps read the same
/// cache one query at a time. Every split gives bitwise the same logits.
#[test]
fn long_prompt_logits_do_not_depend_on_how_it_is_split() {
    let m = &model().model;
    let tok = &model().text.tokenizer;
    let text = "Once upon a time, in a quiet village by the sea, there lived an old \
                fisherman who told stories to the children every evening. "
        .repeat(8);
    let prompt = tok.encode(&text, true).expect("tok");
    assert!(prompt.len() >= 200, "{} tokens", prompt.len());
    let whole = last_logits(&prompt);
    for splits in [vec![150], vec![64, 130, 131, 197], vec![9, 140]] {
        let mut cache =
            KvCache::new(m.kv_cache_config(16, prompt.len().div_ceil(16))).expect("cache");
        let mut table = Vec::new();
        cache.reserve(&mut table, prompt.len()).expect("space");
        let mut bounds = splits.clone();
        bounds.push(prompt.len());
        let mut start = 0;
        let mut logits = Vec::new();
        for &end in &bounds {
            logits = m
                .forward(
                    &[SeqChunk {
                        tokens: &prompt[start..end],
                        start_pos: start,
                        block_table: &table,
                        want_logits: end == prompt.len(),
                    }],
                    &mut cache,
                )
                .expect("forward");
            start = end;
        }
        assert!(logits == whole, "split at {splits:?} differs");
    }
    // The last tokens one at a time, as decode steps.
    let mut cache = KvCache::new(m.kv_cache_config(16, prompt.len().div_ceil(16))).expect("cache");
    let mut table = Vec::new();
    cache.reserve(&mut table, prompt.len()).expect("space");
    let first = prompt.len() - 3;
    m.forward(
        &[SeqChunk {
            tokens: &prompt[..first],
            start_pos: 0,
            block_table: &table,
            want_logits: false,
        }],
        &mut cache,
    )
    .expect("prefill");
    let mut logits = Vec::new();
    for p in first..prompt.len() {
        logits = m
            .forward(
                &[SeqChunk {
                    tokens: &prompt[p..p + 1],
                    start_pos: p,
                    block_table: &table,
                    want_logits: true,
                }],
                &mut cache,
            )
            .expect("decode");
    }
    assert!(logits == whole, "decode steps differ");
}

#[test]
fn bad_requests_are_rejected_not_panicked() {
    let m = &model().model;
    let mut cache = KvCache::new(m.kv_cache_config(16, 2)).expect("cache");
    let mut table = Vec::new();
    cache.reserve(&mut table, 8).expect("space");
    let run = |tokens: &[u32], start_pos: usize, table: &[u32], cache: &mut KvCache| {
        m.forward(
            &[SeqChunk {
                tokens,
                start_pos,
                block_table: table,
                want_logits: true,
            }],
            cache,
        )
    };
    let e = run(&[49152], 0, &table, &mut cache).expect_err("token out of range");
    assert!(e.to_string().contains("out of range"), "{e}");
    let e = run(&[1; 20], 0, &table, &mut cache).expect_err("table too short");
    assert!(e.to_string().contains("block table"), "{e}");
    let e = run(&[1], 0, &[99], &mut cache).expect_err("block id out of range");
    assert!(e.to_string().contains("out of range"), "{e}");
    let long = vec![1u32; model().model.config().context_length];
    let req = GenerateRequest {
        prompt: long,
        sampling: SamplingParams::greedy(),
        max_tokens: 1,
        stop_token_ids: vec![],
        stop_strings: vec![],
        prefill_chunk: 512,
    };
    let e = generate(model(), &req, |_| {}).expect_err("too long");
    assert!(
        e.to_string()
            .starts_with("Prompt is too long: 8192 tokens exceeds"),
        "{e}"
    );
}
