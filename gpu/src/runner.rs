//! The GPU as the scheduler's step runner: [`GpuServed`] is a
//! `ServedModel` whose [`GpuRunner`] computes batch steps with
//! [`GpuModel`] over a KV pool in device memory, at the scheduler's block
//! ids. So everything the scheduler does (continuous batching, chunked
//! prefill, the prefix cache, preemption, the sampler, KV handoffs) runs
//! unchanged over a GPU.
//!
//! The scheduler's host pool is the memory a transfer engine registers:
//! blocks an import wrote into it are copied to the device before a step
//! reads them ([`StepRunner::kv_written`]), and on a node whose KV leaves
//! from it (a prefill node: [`KvCopyBack::EveryStep`]) the blocks each
//! step wrote are copied back with the logits (one wait), before the
//! scheduler says their layers are done. Host staging, in the brief's
//! words; device memory registered with the transport is the step after.

use std::sync::Arc;

use tandem_engine::backend::{RunnerConfig, ServedModel, StepRunner};
use tandem_engine::block_allocator::BlockId;
use tandem_engine::error::RequestError;
use tandem_engine::kv_cache::{KvCache, KvCacheConfig, KvPool};
use tandem_engine::model::SeqChunk;
use tandem_modelfile::ModelText;
use tandem_modelfile::config::ModelConfig;
use tandem_modelfile::gguf::GgufFile;
use tandem_modelfile::meta::ModelMeta;

use crate::device::GpuDevice;
use crate::error::GpuError;
use crate::llama::{Chunk, DevicePool, GpuModel};

/// Whether the KV a step writes on the device is copied back to the host
/// pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvCopyBack {
    /// After every step: KV leaves the node from the host pool (a prefill
    /// node exporting prompts). Costs a read of every written block.
    EveryStep,
    /// Never: the KV is only read on the device (`serve`, decode nodes).
    /// The host pool then holds only what imports wrote; nothing may
    /// export from it.
    Never,
}

/// A GGUF model loaded on a GPU, served through the scheduler.
pub struct GpuServed {
    model: GpuModel,
    copy_back: KvCopyBack,
    text: Arc<ModelText>,
    weights_hash: u64,
}

impl std::fmt::Debug for GpuServed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuServed")
            .field("model", &self.model)
            .field("name", &self.text.name)
            .finish_non_exhaustive()
    }
}

impl GpuServed {
    /// Loads the GGUF file `meta` was read from onto GPU `device`, for
    /// sequences of up to `max_ctx` tokens in KV blocks of `block_size`.
    /// `meta` (tokenizer, template, weights hash) is what a CPU node reads,
    /// so the fingerprint KV handoffs check is the same.
    pub fn load(
        meta: ModelMeta,
        device: usize,
        max_ctx: usize,
        block_size: usize,
        copy_back: KvCopyBack,
    ) -> Result<GpuServed, GpuError> {
        let g = GgufFile::open(&meta.path).map_err(tandem_modelfile::error::ModelError::from)?;
        let dev = GpuDevice::open(device)?;
        let model = GpuModel::load(dev, &g, max_ctx, block_size)?;
        Ok(GpuServed {
            model,
            copy_back,
            text: Arc::new(meta.text),
            weights_hash: meta.weights_hash,
        })
    }

    /// The adapter, as the startup line names it.
    pub fn device_name(&self) -> &str {
        self.model.device().name()
    }
}

impl ServedModel for GpuServed {
    fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    fn text(&self) -> &Arc<ModelText> {
        &self.text
    }

    fn weights_hash(&self) -> u64 {
        self.weights_hash
    }

    fn runner(self: Arc<Self>, config: RunnerConfig) -> Result<Box<dyn StepRunner>, String> {
        let layout = *self.model.kv_layout();
        if config.tp != 1 {
            return Err(format!(
                "tensor parallelism over GPUs is not built yet (--tp {})",
                config.tp
            ));
        }
        if config.block_size != layout.block_size {
            return Err(format!(
                "the model was loaded for KV blocks of {} tokens, the scheduler uses {}",
                layout.block_size, config.block_size
            ));
        }
        let pool = self
            .model
            .new_pool(config.num_blocks)
            .map_err(|e| e.to_string())?;
        let kv = self.kv_cache_config(config.block_size, config.num_blocks);
        if pool.block_bytes() != kv.block_bytes() {
            return Err(format!(
                "device blocks of {} bytes, host blocks of {}",
                pool.block_bytes(),
                kv.block_bytes()
            ));
        }
        Ok(Box::new(GpuRunner {
            served: self,
            pool,
            kv,
        }))
    }
}

/// Runs the scheduler's steps on the device (see the module docs).
#[derive(Debug)]
pub struct GpuRunner {
    served: Arc<GpuServed>,
    /// The device pool, at the host pool's block ids.
    pool: DevicePool,
    kv: KvCacheConfig,
}

impl GpuRunner {
    fn dev(&self) -> &GpuDevice {
        self.served.model.device()
    }

    /// Copies the blocks `chunks` wrote back to the host pool, in runs of
    /// adjacent block ids (one wait for all of them).
    fn copy_back(&self, chunks: &[SeqChunk<'_>], cache: &mut KvCache) -> Result<(), GpuError> {
        let bs = self.kv.block_size;
        let mut written: Vec<BlockId> = chunks
            .iter()
            .filter(|c| !c.tokens.is_empty())
            .flat_map(|c| {
                let first = c.start_pos / bs;
                let last = (c.start_pos + c.tokens.len() - 1) / bs;
                c.block_table
                    .get(first..=last)
                    .unwrap_or_default()
                    .iter()
                    .copied()
            })
            .collect();
        written.sort_unstable();
        written.dedup();
        let mut runs: Vec<(BlockId, usize)> = Vec::new();
        for b in written {
            match runs.last_mut() {
                Some((start, n)) if *start as usize + *n == b as usize => *n += 1,
                _ => runs.push((b, 1)),
            }
        }
        let runs: Vec<(usize, usize)> = runs.iter().map(|&(b, n)| (b as usize, n)).collect();
        let blocks = self.pool.download_blocks(self.dev(), &runs)?;
        let ids = runs.iter().flat_map(|&(b, n)| b..b + n);
        for (id, src) in ids.zip(blocks) {
            // Below the pool's size, which the download checked.
            let dst = cache.block_bytes_mut(id as BlockId);
            if dst.len() != src.len() {
                return Err(GpuError::Shape {
                    kernel: "kv copy back",
                    what: format!("host blocks of {} bytes, device {}", dst.len(), src.len()),
                });
            }
            dst.copy_from_slice(&src);
        }
        Ok(())
    }
}

fn device_error(e: GpuError) -> RequestError {
    RequestError::Device(e.to_string())
}

impl StepRunner for GpuRunner {
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
        logits: &mut Vec<f32>,
    ) -> Result<(), RequestError> {
        let batch: Vec<Chunk<'_>> = chunks
            .iter()
            .map(|c| Chunk {
                tokens: c.tokens,
                start_pos: c.start_pos,
                blocks: c.block_table,
                want_logits: c.want_logits,
            })
            .collect();
        let model = &self.served.model;
        let out = model.forward(&self.pool, &batch).map_err(device_error)?;
        if self.served.copy_back == KvCopyBack::EveryStep {
            // Waits for the step; the logits' read below then only copies.
            self.copy_back(chunks, cache).map_err(device_error)?;
        }
        logits.clear();
        if let Some(out) = out {
            logits.extend(self.dev().download(&out).map_err(device_error)?);
        }
        // Every layer is written (and, copied back, in the host pool, from
        // where a transfer engine may send them all).
        for l in 0..model.config().n_layers {
            layer_done(l);
        }
        Ok(())
    }

    fn kv_written(&self, cache: &KvCache, blocks: &[BlockId]) -> Result<(), RequestError> {
        for &b in blocks {
            if b as usize >= self.kv.num_blocks {
                return Err(RequestError::Device(format!(
                    "block {b} of a pool of {}",
                    self.kv.num_blocks
                )));
            }
            self.pool
                .upload_block(self.dev(), b as usize, cache.block_bytes(b))
                .map_err(device_error)?;
        }
        Ok(())
    }
}
