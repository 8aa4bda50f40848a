//! The shard plan (`tandem_modelfile::plan::shard`) decides `--tp` for
//! both executors: every degree it accepts runs on the CPU engine and on
//! the GPU (lavapipe here) and gives each executor's one-rank greedy
//! tokens; every degree it refuses, both refuse. On the tiny
//! mixture-of-experts checkpoint (8 heads, 4 KV heads of 8 values, 8
//! experts, a vocabulary of 256, F32): 1, 2 and 4 ranks, not 3 or 8.

use std::path::PathBuf;
use std::sync::Arc;

use tandem_engine::comm::{Communicator, CpuGroup};
use tandem_engine::kv_cache::KvCache;
use tandem_engine::model::SeqChunk;
use tandem_engine::safetensors_loader::load_model_dir;
use tandem_engine::sampler::argmax;
use tandem_gpu::GpuDevice;
use tandem_gpu::llama::{Chunk, GpuModel, Shard};
use tandem_gpu::weights::ModelFiles;

const PROMPT: [u32; 7] = [1, 17, 42, 99, 3, 250, 7];
const STEPS: usize = 6;
const BLOCK: usize = 4;
const BLOCKS: usize = 16;

fn tiny() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../engine/tests/data/tiny-moe")
}

/// The CPU engine's greedy tokens over `world` ranks (every rank's, which
/// must agree), or the split's refusal.
fn cpu_greedy(world: usize) -> Result<Vec<u32>, String> {
    let whole = load_model_dir(&tiny()).map_err(|e| e.to_string())?;
    let shards = CpuGroup::new(world)
        .into_iter()
        .map(|c| whole.shard(Arc::new(c)).map_err(|e| e.to_string()))
        .collect::<Result<Vec<_>, _>>()?;
    let tokens: Vec<Vec<u32>> = std::thread::scope(|s| {
        let ranks: Vec<_> = shards
            .iter()
            .map(|m| {
                s.spawn(move || {
                    let mut cache =
                        KvCache::new(m.kv_cache_config(BLOCK, BLOCKS)).expect("a KV cache");
                    let mut table = Vec::new();
                    cache
                        .reserve(&mut table, PROMPT.len() + STEPS)
                        .expect("blocks");
                    let (mut tokens, mut pos) = (PROMPT.to_vec(), 0);
                    for _ in 0..STEPS {
                        let chunk = SeqChunk {
                            tokens: &tokens[pos..],
                            start_pos: pos,
                            block_table: &table,
                            want_logits: true,
                        };
                        let logits = m.forward(&[chunk], &mut cache).expect("a step");
                        pos = tokens.len();
                        tokens.push(argmax(&logits));
                    }
                    tokens.split_off(PROMPT.len())
                })
            })
            .collect();
        ranks
            .into_iter()
            .map(|r| r.join().expect("a rank"))
            .collect()
    });
    assert!(tokens.iter().all(|t| *t == tokens[0]), "{tokens:?}");
    Ok(tokens[0].clone())
}

/// One GPU rank's greedy run: rank 0 picks each token and shares it with
/// its peers through `comm` (the others add zeros).
fn gpu_rank(files: &ModelFiles, comm: &dyn Communicator) -> Vec<u32> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let dev = GpuDevice::open(0).expect("a Vulkan device (lavapipe: mesa-vulkan-drivers)");
    let m = GpuModel::load_shard(dev, files, 64, BLOCK, Shard { rank, world }).expect("loads");
    let pool = m.new_pool(BLOCKS).expect("a pool");
    let table: Vec<u32> = (0..BLOCKS as u32).collect();
    let (mut tokens, mut pos) = (PROMPT.to_vec(), 0);
    for _ in 0..STEPS {
        let chunk = Chunk {
            tokens: &tokens[pos..],
            start_pos: pos,
            blocks: &table,
            want_logits: true,
        };
        let logits = m.forward_rank(&pool, &[chunk], Some(comm)).expect("a step");
        let mut next = [0.0f32];
        if let Some(l) = logits {
            next[0] = argmax(&m.device().download(&l).expect("logits")) as f32;
        }
        comm.all_reduce_sum(&mut next).expect("the token");
        pos = tokens.len();
        tokens.push(next[0] as u32);
    }
    tokens.split_off(PROMPT.len())
}

/// The GPU's greedy tokens over `world` ranks sharing the device, or the
/// split's refusal (rank 0's load, before any rank runs: a refused rank
/// would leave its peers waiting at the step's collectives).
fn gpu_greedy(world: usize) -> Result<Vec<u32>, String> {
    let files = ModelFiles::open(&tiny()).expect("model files");
    let dev = GpuDevice::open(0).expect("a Vulkan device (lavapipe: mesa-vulkan-drivers)");
    GpuModel::load_shard(dev, &files, 64, BLOCK, Shard { rank: 0, world })
        .map_err(|e| e.to_string())?;
    let tokens: Vec<Vec<u32>> = std::thread::scope(|s| {
        let ranks: Vec<_> = CpuGroup::new(world)
            .into_iter()
            .map(|comm| {
                let files = &files;
                s.spawn(move || gpu_rank(files, &comm))
            })
            .collect();
        ranks
            .into_iter()
            .map(|r| r.join().expect("a rank"))
            .collect()
    });
    assert!(tokens.iter().all(|t| *t == tokens[0]), "{tokens:?}");
    Ok(tokens[0].clone())
}

#[test]
fn a_tp_the_plan_accepts_runs_on_both_executors_with_one_ranks_tokens() {
    let files = ModelFiles::open(&tiny()).expect("model files");
    let (cpu_one, gpu_one) = (
        cpu_greedy(1).expect("one rank"),
        gpu_greedy(1).expect("one rank"),
    );
    let mut accepted = Vec::new();
    for world in 1..=8 {
        let plan = Shard::plan(&files, world);
        let (cpu, gpu) = (cpu_greedy(world), gpu_greedy(world));
        match plan {
            Ok(_) => {
                accepted.push(world);
                assert_eq!(cpu.as_ref(), Ok(&cpu_one), "CPU, {world} ranks");
                assert_eq!(gpu.as_ref(), Ok(&gpu_one), "GPU, {world} ranks");
            }
            Err(e) => {
                let e = e.to_string();
                assert!(e.contains(&format!("{world} tensor-parallel ranks")), "{e}");
                assert!(cpu.is_err(), "CPU ran {world} ranks the plan refuses: {e}");
                assert!(gpu.is_err(), "GPU ran {world} ranks the plan refuses: {e}");
            }
        }
    }
    assert_eq!(accepted, [1, 2, 4]);
}
