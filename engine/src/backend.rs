//! What the scheduler runs its steps on, behind two traits: a
//! [`ServedModel`] (what a node serves: sizes, tokenizer, fingerprint) makes
//! a [`StepRunner`] (the forward pass of a batch step over the KV cache).
//!
//! [`LoadedModel`] is the real model, run by [`TpExecutor`] on one thread or
//! as a tensor-parallel group; `mock::MockModel` times steps from a measured
//! profile instead. `tandem-gpu`'s `GpuRunner` is a third, over device
//! memory.

use std::sync::Arc;

use tandem_modelfile::config::ModelConfig;
use tandem_modelfile::{ModelText, meta};
use tandem_types::ModelFingerprint;

use crate::comm::{Communicator, CpuGroup};
use crate::error::{RequestError, RunnerError};
use crate::kv_cache::{BlockId, KvCache, KvCacheConfig, KvPool};
use crate::loader::LoadedModel;
use crate::model::{DecoderModel, SeqChunk};
use crate::moe::Combine;
use crate::ranks::PeerRanks;

/// How a runner is laid out: its tensor-parallel ranks and KV pool shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunnerConfig {
    pub tp: usize,
    pub moe_combine: Combine,
    pub block_size: usize,
    pub num_blocks: usize,
}

/// A model a node serves: what every part of the node needs to know of it,
/// and the runner that computes its steps.
pub trait ServedModel: Send + Sync + std::fmt::Debug {
    fn config(&self) -> &ModelConfig;
    /// Name, tokenizer and chat template.
    fn text(&self) -> &Arc<ModelText>;
    /// Hash of the weight file bytes (part of the fingerprint).
    fn weights_hash(&self) -> u64;

    /// What a peer must match to share KV blocks of `block_size` tokens.
    fn fingerprint(&self, block_size: usize) -> ModelFingerprint {
        meta::fingerprint(
            &self.text().name,
            self.weights_hash(),
            self.config(),
            block_size,
        )
    }

    /// The shape of a whole-model KV pool.
    fn kv_cache_config(&self, block_size: usize, num_blocks: usize) -> KvCacheConfig {
        KvCacheConfig::for_model(self.config(), block_size, num_blocks)
    }

    /// Builds the runner of this model's steps.
    fn runner(self: Arc<Self>, config: RunnerConfig) -> Result<Box<dyn StepRunner>, RunnerError>;
}

/// The form in which a step returns its logits, chosen by the scheduler
/// for each step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LogitsForm {
    /// Each row whole: `vocab_size` values.
    #[default]
    Full,
    /// Each row's `k` largest values with their token ids, and the row's
    /// log-sum-exp: all a sampler needs when `Sampler::candidates` says
    /// so, and far less to move off a device than a whole row.
    Top(usize),
}

/// A step's logits: a row for each chunk that wants them, in chunk order.
#[derive(Debug, Default)]
pub struct StepLogits {
    /// The rows' form. A runner asked for [`LogitsForm::Top`] may answer
    /// with full rows; never the other way round.
    pub form: LogitsForm,
    /// `Full`: rows of `vocab_size`. `Top(k)`: rows of `k`, largest first
    /// (on equal values the lower token id first).
    pub values: Vec<f32>,
    /// `Top(k)`: the token ids of `values`. An id past the vocabulary
    /// marks the end of a row with fewer than `k` values.
    pub ids: Vec<u32>,
    /// `Top(k)`: each row's log-sum-exp over the whole vocabulary.
    pub log_z: Vec<f32>,
}

impl StepLogits {
    /// Full rows to be written into `values`.
    pub fn full(&mut self) -> &mut Vec<f32> {
        self.form = LogitsForm::Full;
        self.ids.clear();
        self.log_z.clear();
        &mut self.values
    }
}

/// Computes batch steps. Owned by the scheduler's thread.
pub trait StepRunner: Send {
    /// Rank 0's KV pool shape (its share of the KV heads under TP).
    fn kv_cache_config(&self) -> KvCacheConfig;
    /// Pools of tensor-parallel ranks 1.., at rank 0's block ids.
    fn peer_pools(&self) -> Vec<Arc<KvPool>>;
    /// The most candidates per row this runner returns in
    /// [`LogitsForm::Top`]; 0 when it returns only full rows.
    fn max_top_logits(&self) -> usize {
        0
    }
    /// Runs one step: writes the chunks' K/V into `cache`, calls
    /// `layer_done(l)` once layer `l` of every chunk is written, and leaves
    /// a row of logits per chunk with `want_logits` in `logits`, in the
    /// form `want` where the runner can (see [`StepLogits::form`]).
    fn forward(
        &self,
        chunks: &[SeqChunk<'_>],
        cache: &mut KvCache,
        layer_done: &mut dyn FnMut(usize),
        want: LogitsForm,
        logits: &mut StepLogits,
    ) -> Result<(), RequestError>;
    /// `blocks` of `cache`'s pool were written from outside the runner (a
    /// KV import landed in them) and are read from the next step on. A
    /// runner that computes over the host pool has nothing to do; one that
    /// keeps KV in device memory copies them in.
    fn kv_written(&self, _cache: &KvCache, _blocks: &[BlockId]) -> Result<(), RequestError> {
        Ok(())
    }
    /// `blocks` of `cache`'s pool (and of the peer pools) are about to be
    /// read from outside the runner (copied to a KV tier below the pool):
    /// a runner that keeps KV in device memory copies them to the host
    /// pools first; one that computes over them has nothing to do.
    fn kv_read(&self, _cache: &mut KvCache, _blocks: &[BlockId]) -> Result<(), RequestError> {
        Ok(())
    }
}

impl ServedModel for LoadedModel {
    fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    fn text(&self) -> &Arc<ModelText> {
        &self.text
    }

    fn weights_hash(&self) -> u64 {
        self.weights_hash
    }

    fn runner(self: Arc<Self>, config: RunnerConfig) -> Result<Box<dyn StepRunner>, RunnerError> {
        Ok(Box::new(TpExecutor::new(self, config)?))
    }
}

/// Runs forward passes: the whole model, or rank 0 of a tensor-parallel
/// group whose other ranks run the same step on their own threads (each
/// with its own KV pool holding its KV heads, at the same block ids).
pub struct TpExecutor {
    /// The tensor-parallel shard of rank 0, or `None` for the whole model.
    shard: Option<DecoderModel>,
    model: Arc<LoadedModel>,
    block_size: usize,
    num_blocks: usize,
    peers: PeerRanks<Arc<StepInput>, RequestError>,
    peer_pools: Vec<Arc<KvPool>>,
}

/// A step's chunks, owned so peer ranks (threads of a tensor-parallel
/// runner) can run them.
#[derive(Debug)]
pub struct StepInput {
    chunks: Vec<(Vec<u32>, usize, Vec<BlockId>, bool)>,
}

impl StepInput {
    pub fn new(chunks: &[SeqChunk<'_>]) -> StepInput {
        StepInput {
            chunks: chunks
                .iter()
                .map(|c| {
                    (
                        c.tokens.to_vec(),
                        c.start_pos,
                        c.block_table.to_vec(),
                        c.want_logits,
                    )
                })
                .collect(),
        }
    }

    /// The chunks, borrowed from here.
    pub fn chunks(&self) -> Vec<SeqChunk<'_>> {
        self.chunks
            .iter()
            .map(|(tokens, start_pos, table, want_logits)| SeqChunk {
                tokens,
                start_pos: *start_pos,
                block_table: table,
                want_logits: *want_logits,
            })
            .collect()
    }
}

impl std::fmt::Debug for TpExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TpExecutor")
            .field("ranks", &(self.peers.len() + 1))
            .finish()
    }
}

impl TpExecutor {
    pub fn new(model: Arc<LoadedModel>, config: RunnerConfig) -> Result<Self, RunnerError> {
        let tp = config.tp;
        if tp <= 1 {
            return Ok(Self {
                shard: None,
                model,
                block_size: config.block_size,
                num_blocks: config.num_blocks,
                peers: PeerRanks::default(),
                peer_pools: Vec::new(),
            });
        }
        let mut shards = Vec::with_capacity(tp);
        for comm in CpuGroup::new(tp) {
            let comm: Arc<dyn Communicator> = Arc::new(comm);
            shards.push(
                model
                    .model
                    .shard_with(comm, config.moe_combine)
                    .map_err(|source| RunnerError::Shard { tp, source })?,
            );
        }
        let rank0 = shards.remove(0);
        let mut peers = PeerRanks::default();
        let mut peer_pools = Vec::new();
        for (i, shard) in shards.into_iter().enumerate() {
            // The same block ids as rank 0's pool, holding this rank's heads.
            let mut cache =
                KvCache::new(shard.kv_cache_config(config.block_size, config.num_blocks))?;
            peer_pools.push(Arc::clone(cache.pool()));
            peers
                .spawn(
                    format!("tandem-tp-rank{}", i + 1),
                    move |input: Arc<StepInput>| {
                        shard.forward(&input.chunks(), &mut cache).map(|_| ())
                    },
                )
                .map_err(RunnerError::Spawn)?;
        }
        Ok(Self {
            shard: Some(rank0),
            model,
            block_size: config.block_size,
            num_blocks: config.num_blocks,
            peers,
            peer_pools,
        })
    }

    fn rank0(&self) -> &DecoderModel {
        self.shard.as_ref().unwrap_or(&self.model.model)
    }
}

impl StepRunner for TpExecutor {
    fn kv_cache_config(&self) -> KvCacheConfig {
        self.rank0()
            .kv_cache_config(self.block_size, self.num_blocks)
    }

    fn peer_pools(&self) -> Vec<Arc<KvPool>> {
        self.peer_pools.clone()
    }

    fn forward(
        &self,
        chunks: &[SeqChunk<'_>],
        cache: &mut KvCache,
        layer_done: &mut dyn FnMut(usize),
        _want: LogitsForm,
        logits: &mut StepLogits,
    ) -> Result<(), RequestError> {
        if !self.peers.is_empty() {
            let input = Arc::new(StepInput::new(chunks));
            self.peers.broadcast(|| Arc::clone(&input))?;
        }
        let mine = self
            .rank0()
            .forward_into(chunks, cache, layer_done, logits.full());
        // Every rank's answer, even after a failure here: the next step
        // must not meet a stale one.
        let peers = self.peers.gather(|e| e);
        mine.and(peers)
    }
}
