//! The mock engine's runner: the tokens it picks are the chain's
//! continuation, steps last at least the profiled time, and KV it did not
//! write (a broken handoff) fails the step instead of yielding tokens.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Instant;

use tandem_engine::RequestError;
use tandem_engine::ServedModel;
use tandem_engine::backend::{LogitsForm, RunnerConfig, StepLogits};
use tandem_engine::kv_cache::KvCache;
use tandem_engine::mock::MockModel;
use tandem_engine::model::SeqChunk;
use tandem_engine::moe::Combine;
use tandem_engine::sampler::argmax;
use tandem_modelfile::ModelMeta;
use tandem_perfmodel::{DecodePoint, EngineProfile, PrefillPoint};

fn model(time_scale: f64) -> Arc<MockModel> {
    let path = std::env::var("TANDEM_TEST_GGUF").expect("TANDEM_TEST_GGUF");
    let profile = EngineProfile {
        version: 1,
        model: "t".into(),
        isa: "t".into(),
        threads: 1,
        tp: 1,
        prefill: vec![PrefillPoint {
            tokens: 64,
            seconds: 0.064,
        }],
        decode: vec![DecodePoint {
            batch: 1,
            context: 64,
            seconds: 0.002,
        }],
    };
    let meta = ModelMeta::load(std::path::Path::new(&path)).unwrap();
    Arc::new(MockModel::new(meta, profile, time_scale).unwrap())
}

#[test]
fn picks_the_chain_continuation_times_steps_and_detects_foreign_kv() {
    let m = model(1.0);
    let vocab = m.config().vocab_size;
    let runner = Arc::clone(&m)
        .runner(RunnerConfig {
            tp: 1,
            moe_combine: Combine::AllReduce,
            block_size: 16,
            num_blocks: 8,
        })
        .unwrap();
    let kv = runner.kv_cache_config();
    let mut cache = KvCache::new(kv).unwrap();
    let mut table = Vec::new();
    cache.reserve(&mut table, 100).unwrap();
    let prompt: Vec<u32> = (0..64).map(|i| 1000 + 7 * i).collect();
    let want = m.continuation(&prompt, 3);

    let mut logits = StepLogits::default();
    let t0 = Instant::now();
    runner
        .forward(
            &[SeqChunk {
                tokens: &prompt,
                start_pos: 0,
                block_table: &table,
                want_logits: true,
            }],
            &mut cache,
            &mut |_| {},
            LogitsForm::Full,
            &mut logits,
        )
        .unwrap();
    assert!(t0.elapsed().as_secs_f64() >= 0.064, "{:?}", t0.elapsed());
    assert_eq!(logits.values.len(), vocab);
    assert_eq!(argmax(&logits.values), want[0]);

    // Decoding reads the chain back from the cache.
    let mut layers = Vec::new();
    runner
        .forward(
            &[SeqChunk {
                tokens: &want[..1],
                start_pos: 64,
                block_table: &table,
                want_logits: true,
            }],
            &mut cache,
            &mut |l| layers.push(l),
            LogitsForm::Full,
            &mut logits,
        )
        .unwrap();
    assert_eq!(argmax(&logits.values), want[1]);
    assert_eq!(layers, (0..kv.n_layers).collect::<Vec<_>>());

    // One layer's row at the last position overwritten, as a transfer
    // that landed the wrong bytes would: the next step fails.
    let (block, slot) = (table[64 / 16], 64 % 16);
    let row = &mut cache.head_slice_mut(block, kv.n_layers - 1, 0, 0)[slot * kv.head_dim..];
    row[0] = half::f16::from_bits(row[0].to_bits() ^ 1);
    let r = runner.forward(
        &[SeqChunk {
            tokens: &want[1..2],
            start_pos: 65,
            block_table: &table,
            want_logits: true,
        }],
        &mut cache,
        &mut |_| {},
        LogitsForm::Full,
        &mut logits,
    );
    assert!(matches!(r, Err(RequestError::Mock(_))), "{r:?}");
}

#[test]
fn refuses_tensor_parallelism_and_bad_time_scales() {
    let m = model(0.0);
    let r = Arc::clone(&m).runner(RunnerConfig {
        tp: 2,
        moe_combine: Combine::AllReduce,
        block_size: 16,
        num_blocks: 8,
    });
    assert!(r.err().unwrap().to_string().contains("one rank"));
    let path = std::env::var("TANDEM_TEST_GGUF").unwrap();
    let meta = ModelMeta::load(std::path::Path::new(&path)).unwrap();
    assert!(MockModel::new(meta, m.profile().clone(), f64::NAN).is_err());
}
