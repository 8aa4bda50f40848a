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
//! scheduler says their layers are done: KV is staged through host
//! memory; device memory registered with the transport is the step after.
//!
//! Under tensor parallelism each rank holds a [`Shard`] on its device and
//! has a host pool of its own (`peer_pools`, at rank 0's block ids): rank
//! 0 runs on the scheduler's thread, ranks 1.. on threads of their own,
//! each step and each upload sent to all and answered by all.

use std::sync::Arc;

use tandem_engine::backend::{
    LogitsForm, RunnerConfig, ServedModel, StepInput, StepLogits, StepRunner,
};
use tandem_engine::block_allocator::BlockId;
use tandem_engine::comm::{Communicator, CpuComm, CpuGroup};
use tandem_engine::error::{RequestError, RunnerError};
use tandem_engine::kv_cache::{KvCache, KvCacheConfig, KvPool};
use tandem_engine::model::SeqChunk;
use tandem_engine::ranks::PeerRanks;
use tandem_modelfile::ModelText;
use tandem_modelfile::config::ModelConfig;
use tandem_modelfile::meta::ModelMeta;

use crate::device::{Buffer, GpuDevice};
use crate::error::GpuError;
use crate::kernels;
use crate::llama::{Chunk, DevicePool, GpuModel, Shard};
use crate::weights::ModelFiles;

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

/// A model loaded on one GPU, or split over the ranks of a
/// tensor-parallel group, served through the scheduler.
pub struct GpuServed {
    /// Rank `i`'s share of the model, on its device (the whole model for
    /// one rank).
    ranks: Vec<GpuModel>,
    /// The whole model's configuration.
    config: ModelConfig,
    copy_back: KvCopyBack,
    text: Arc<ModelText>,
    weights_hash: u64,
}

impl std::fmt::Debug for GpuServed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuServed")
            .field("ranks", &self.ranks)
            .field("name", &self.text.name)
            .finish_non_exhaustive()
    }
}

impl GpuServed {
    /// Loads the model `meta` was read from (a GGUF file or an HF
    /// directory) onto the GPUs `devices`,
    /// one tensor-parallel rank per entry (an index may repeat: ranks
    /// sharing a device), for sequences of up to `max_ctx` tokens in KV
    /// blocks of `block_size`. `meta` (tokenizer, template, weights hash)
    /// is what a CPU node reads, so the fingerprint KV handoffs check is
    /// the same.
    pub fn load(
        meta: ModelMeta,
        devices: &[usize],
        max_ctx: usize,
        block_size: usize,
        copy_back: KvCopyBack,
    ) -> Result<GpuServed, GpuError> {
        let files = ModelFiles::open(&meta.path)?;
        Self::load_files(meta, &files, devices, max_ctx, block_size, copy_back)
    }

    /// [`load`](Self::load) from files already open, whose configuration
    /// is the one served (in place of `meta`'s): a model re-stored or cut
    /// to its first layers, as tests run the runner's mechanics. The
    /// tokenizer and the weights hash are still `meta`'s.
    pub fn load_files(
        meta: ModelMeta,
        files: &ModelFiles,
        devices: &[usize],
        max_ctx: usize,
        block_size: usize,
        copy_back: KvCopyBack,
    ) -> Result<GpuServed, GpuError> {
        let world = devices.len();
        Shard::check(&files.config, world)?;
        let ranks = devices
            .iter()
            .enumerate()
            .map(|(rank, &index)| {
                let shard = Shard { rank, world };
                GpuModel::load_shard(GpuDevice::open(index)?, files, max_ctx, block_size, shard)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(GpuServed {
            ranks,
            config: files.config.clone(),
            copy_back,
            text: Arc::new(meta.text),
            weights_hash: meta.weights_hash,
        })
    }

    /// The adapters, as the startup line names them (one name per distinct
    /// adapter, in rank order).
    pub fn device_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = Vec::new();
        for r in &self.ranks {
            if !names.contains(&r.device().name()) {
                names.push(r.device().name());
            }
        }
        names
    }

    fn rank0(&self) -> Result<&GpuModel, GpuError> {
        self.ranks.first().ok_or_else(|| GpuError::Shape {
            kernel: "model",
            what: "no ranks".into(),
        })
    }
}

impl ServedModel for GpuServed {
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
        let world = self.ranks.len();
        if config.tp != world {
            return Err(RunnerError::TpMismatch {
                loaded: world,
                asked: config.tp,
            });
        }
        let rank0 = self.rank0().map_err(|e| RunnerError::Device(Box::new(e)))?;
        let layout = *rank0.kv_layout();
        if config.block_size != layout.block_size {
            return Err(RunnerError::BlockSizeMismatch {
                loaded: layout.block_size,
                asked: config.block_size,
            });
        }
        // Every rank's host pool has rank 0's shape: its share of the KV heads.
        let kv = KvCacheConfig {
            n_kv_heads: layout.n_kv_heads,
            ..self.kv_cache_config(config.block_size, config.num_blocks)
        };
        let new_pool = |model: &GpuModel| -> Result<DevicePool, RunnerError> {
            let pool = model
                .new_pool(config.num_blocks)
                .map_err(|e| RunnerError::Device(Box::new(e)))?;
            if pool.block_bytes() != kv.block_bytes() {
                return Err(RunnerError::BlockBytesMismatch {
                    device: pool.block_bytes(),
                    host: kv.block_bytes(),
                });
            }
            Ok(pool)
        };
        let pool = new_pool(rank0)?;
        let mut comms = CpuGroup::new(world).into_iter();
        let comm = comms.next().map(|c| Box::new(c) as Box<dyn Communicator>);
        let mut peers = PeerRanks::default();
        let mut peer_pools = Vec::with_capacity(world.saturating_sub(1));
        for (rank, comm) in (1..world).zip(comms) {
            let cache = KvCache::new(kv)?;
            peer_pools.push(Arc::clone(cache.pool()));
            let mut state = PeerRank {
                served: Arc::clone(&self),
                rank,
                pool: new_pool(&self.ranks[rank])?,
                cache,
                comm,
            };
            peers
                .spawn(format!("tandem-gpu-rank{rank}"), move |cmd| state.run(cmd))
                .map_err(RunnerError::Spawn)?;
        }
        Ok(Box::new(GpuRunner {
            served: self,
            pool,
            kv,
            comm: if world > 1 { comm } else { None },
            peers,
            peer_pools,
        }))
    }
}

/// Runs the scheduler's steps on the device (see the module docs): rank 0
/// on the scheduler's thread, ranks 1.. on threads of their own, stepping
/// together.
pub struct GpuRunner {
    served: Arc<GpuServed>,
    /// Rank 0's device pool, at the host pool's block ids.
    pool: DevicePool,
    kv: KvCacheConfig,
    /// Rank 0's handle of the group (`None` for one rank).
    comm: Option<Box<dyn Communicator>>,
    peers: PeerRanks<PeerCmd, GpuError>,
    /// Each peer rank's host pool (imports land in it; a prefill node's
    /// steps are copied back to it).
    peer_pools: Vec<Arc<KvPool>>,
}

impl std::fmt::Debug for GpuRunner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuRunner")
            .field("ranks", &(self.peers.len() + 1))
            .field("pool", &self.pool)
            .finish_non_exhaustive()
    }
}

/// What a peer rank is asked to do, in the order rank 0 does it.
enum PeerCmd {
    Step(Arc<StepInput>),
    /// Copy these blocks of the rank's host pool to its device pool.
    Upload(Arc<Vec<BlockId>>),
    /// Copy these blocks of the rank's device pool to its host pool.
    Download(Arc<Vec<BlockId>>),
}

/// A peer rank's state, owned by its thread.
struct PeerRank {
    served: Arc<GpuServed>,
    rank: usize,
    pool: DevicePool,
    cache: KvCache,
    comm: CpuComm,
}

impl PeerRank {
    fn run(&mut self, cmd: PeerCmd) -> Result<(), GpuError> {
        let model = &self.served.ranks[self.rank];
        match cmd {
            PeerCmd::Step(input) => {
                let chunks = input.chunks();
                model
                    .forward_rank(&self.pool, &device_chunks(&chunks), Some(&self.comm))
                    .and_then(|_| match self.served.copy_back {
                        KvCopyBack::EveryStep => {
                            copy_back(model, &self.pool, &chunks, &mut self.cache)
                        }
                        KvCopyBack::Never => Ok(()),
                    })
            }
            PeerCmd::Upload(blocks) => upload(model, &self.pool, &self.cache, &blocks),
            PeerCmd::Download(blocks) => {
                download(model, &self.pool, blocks.to_vec(), &mut self.cache)
            }
        }
    }
}

fn device_chunks<'a>(chunks: &[SeqChunk<'a>]) -> Vec<Chunk<'a>> {
    chunks
        .iter()
        .map(|c| Chunk {
            tokens: c.tokens,
            start_pos: c.start_pos,
            blocks: c.block_table,
            want_logits: c.want_logits,
        })
        .collect()
}

/// Copies the blocks `chunks` wrote on `model`'s device back to the host
/// pool.
fn copy_back(
    model: &GpuModel,
    pool: &DevicePool,
    chunks: &[SeqChunk<'_>],
    cache: &mut KvCache,
) -> Result<(), GpuError> {
    let bs = cache.config().block_size;
    let written: Vec<BlockId> = chunks
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
    download(model, pool, written, cache)
}

/// Copies `blocks` of `model`'s device pool to the host pool, in runs of
/// adjacent block ids (one wait for all of them).
fn download(
    model: &GpuModel,
    pool: &DevicePool,
    mut blocks: Vec<BlockId>,
    cache: &mut KvCache,
) -> Result<(), GpuError> {
    blocks.sort_unstable();
    blocks.dedup();
    let mut runs: Vec<(BlockId, usize)> = Vec::new();
    for b in blocks {
        match runs.last_mut() {
            Some((start, n)) if *start as usize + *n == b as usize => *n += 1,
            _ => runs.push((b, 1)),
        }
    }
    let runs: Vec<(usize, usize)> = runs.iter().map(|&(b, n)| (b as usize, n)).collect();
    let blocks = pool.download_blocks(model.device(), &runs)?;
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

/// Copies `blocks` of the host pool to `model`'s device pool.
fn upload(
    model: &GpuModel,
    pool: &DevicePool,
    cache: &KvCache,
    blocks: &[BlockId],
) -> Result<(), GpuError> {
    for &b in blocks {
        if b as usize >= pool.blocks() {
            return Err(GpuError::Shape {
                kernel: "kv upload",
                what: format!("block {b} of a pool of {}", pool.blocks()),
            });
        }
        pool.upload_block(model.device(), b as usize, cache.block_bytes(b))?;
    }
    Ok(())
}

/// The step's logits (`out`, rows of the vocabulary) off the device:
/// each row's top candidates where the step asks for them, or whole rows.
fn read_logits(
    model: &GpuModel,
    out: &Buffer,
    want: LogitsForm,
    logits: &mut StepLogits,
) -> Result<(), GpuError> {
    let dev = model.device();
    let vocab = model.config().vocab_size;
    match want {
        LogitsForm::Top(k) if (1..=kernels::TOP_K_MAX).contains(&k) => {
            // Rounded up to a power of two: few kernel variants to compile.
            let k = k.next_power_of_two();
            let rows = out.len() / vocab;
            let (ids, values, log_z) = (dev.empty(rows * k), dev.empty(rows * k), dev.empty(rows));
            kernels::top_k(dev, out, vocab, k, &ids, &values, &log_z)?;
            logits.form = LogitsForm::Top(k);
            logits.ids = dev.download(&ids)?;
            logits.values = dev.download(&values)?;
            logits.log_z = dev.download(&log_z)?;
        }
        _ => {
            let full = logits.full();
            full.clear();
            full.extend(dev.download(out)?);
        }
    }
    Ok(())
}

fn device_error(e: GpuError) -> RequestError {
    match e {
        GpuError::Collective(e) => RequestError::Collective(e.into()),
        e => RequestError::Device(Box::new(e)),
    }
}

impl GpuRunner {
    fn rank0(&self) -> Result<&GpuModel, RequestError> {
        self.served.rank0().map_err(device_error)
    }
}

impl StepRunner for GpuRunner {
    fn kv_cache_config(&self) -> KvCacheConfig {
        self.kv
    }

    fn peer_pools(&self) -> Vec<Arc<KvPool>> {
        self.peer_pools.clone()
    }

    fn max_top_logits(&self) -> usize {
        kernels::TOP_K_MAX
    }

    fn forward(
        &self,
        chunks: &[SeqChunk<'_>],
        cache: &mut KvCache,
        layer_done: &mut dyn FnMut(usize),
        want: LogitsForm,
        logits: &mut StepLogits,
    ) -> Result<(), RequestError> {
        let model = self.rank0()?;
        if !self.peers.is_empty() {
            let input = Arc::new(StepInput::new(chunks));
            self.peers.broadcast(|| PeerCmd::Step(Arc::clone(&input)))?;
        }
        let mine = (|| {
            let out =
                model.forward_rank(&self.pool, &device_chunks(chunks), self.comm.as_deref())?;
            if self.served.copy_back == KvCopyBack::EveryStep {
                // Waits for the step; the logits' read below then only copies.
                copy_back(model, &self.pool, chunks, cache)?;
            }
            match out {
                Some(out) => read_logits(model, &out, want, logits),
                None => {
                    logits.full().clear();
                    Ok(())
                }
            }
        })()
        .map_err(device_error);
        // Every rank's answer, even after a failure here: the next step
        // must not meet a stale one.
        let peers = self.peers.gather(device_error);
        mine.and(peers)?;
        // Every layer is written (and, copied back, in the host pools, from
        // where a transfer engine may send them all).
        for l in 0..model.config().n_layers {
            layer_done(l);
        }
        Ok(())
    }

    fn kv_written(&self, cache: &KvCache, blocks: &[BlockId]) -> Result<(), RequestError> {
        let model = self.rank0()?;
        if !self.peers.is_empty() {
            let blocks = Arc::new(blocks.to_vec());
            self.peers
                .broadcast(|| PeerCmd::Upload(Arc::clone(&blocks)))?;
        }
        let mine = upload(model, &self.pool, cache, blocks).map_err(device_error);
        let peers = self.peers.gather(device_error);
        mine.and(peers)
    }

    fn kv_read(&self, cache: &mut KvCache, blocks: &[BlockId]) -> Result<(), RequestError> {
        if blocks.is_empty() || matches!(self.served.copy_back, KvCopyBack::EveryStep) {
            return Ok(()); // the host pools already hold every written block
        }
        let model = self.rank0()?;
        if !self.peers.is_empty() {
            let blocks = Arc::new(blocks.to_vec());
            self.peers
                .broadcast(|| PeerCmd::Download(Arc::clone(&blocks)))?;
        }
        let mine = download(model, &self.pool, blocks.to_vec(), cache).map_err(device_error);
        let peers = self.peers.gather(device_error);
        mine.and(peers)
    }
}
