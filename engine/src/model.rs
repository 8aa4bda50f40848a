//! The Llama-family decoder forward pass over the paged KV cache.
//!
//! One call runs a batch of sequence chunks: prefill chunks (many tokens)
//! and decode steps (one token) mixed. Linear layers run once over all
//! tokens of the batch; attention runs per token over that token's own
//! sequence. Every kernel computes each row independently of the others, so
//! a sequence's logits are bitwise the same alone or inside any batch.

use std::sync::Arc;

use half::f16;
use tandem_kernels::attention::Prefetch;
use tandem_kernels::ops;
use tandem_kernels::{GgmlType, PackedMatrix};

use crate::block_allocator::{BlockId, KvCacheError};
use crate::comm::Communicator;
use crate::error::{ModelError, RequestError};
use crate::kv_cache::{KvCache, KvCacheConfig};
use crate::moe::{Combine, MoeBlock, MoeWeights};
use crate::weight::{Weight, fuse};
use tandem_modelfile::arch::Activation;
use tandem_modelfile::config::ModelConfig;
use tandem_modelfile::plan::recipe::Recipe;
use tandem_modelfile::plan::shard::{ShardPlan, StoredBlocks};

/// Weights of one decoder layer.
#[derive(Debug)]
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub wq: Weight,
    pub wk: Weight,
    pub wv: Weight,
    pub wo: Weight,
    pub ffn_norm: Vec<f32>,
    pub ffn: FfnWeights,
    /// Biases of Q, K and V (Qwen2).
    pub qkv_bias: Option<[Vec<f32>; 3]>,
    /// Per-head RMS norm weights of Q and K, applied before RoPE (Gemma 3).
    pub qk_norm: Option<[Vec<f32>; 2]>,
    /// Norms of the attention and FFN outputs, applied before each
    /// residual add (Gemma 3).
    pub post_norms: Option<[Vec<f32>; 2]>,
}

/// A layer's feed-forward weights.
#[derive(Debug)]
pub enum FfnWeights {
    /// SwiGLU: `down(silu(gate x) * up x)`.
    Dense {
        gate: Weight,
        up: Weight,
        down: Weight,
    },
    /// A sparse mixture of SwiGLU experts (see [`crate::moe`]).
    Moe(MoeWeights),
}

/// All weights, as found by a loader (GGUF or safetensors).
#[derive(Debug)]
pub struct ModelWeights {
    pub token_embd: Weight,
    pub layers: Vec<LayerWeights>,
    pub output_norm: Vec<f32>,
    /// `None` when the output head is tied to the token embedding.
    pub output: Option<Weight>,
}

/// A loaded Llama-family model, ready to run.
#[derive(Debug)]
pub struct DecoderModel {
    /// For a tensor-parallel shard: this rank's heads and FFN width (the
    /// vocabulary stays the model's).
    config: ModelConfig,
    token_embd: Weight,
    layers: Vec<Layer>,
    output_norm: Vec<f32>,
    /// `None` when tied to the embedding.
    output: Option<Weight>,
    tp: Option<TpShard>,
    /// Segments every row-parallel projection is summed over, in order (see
    /// [`RowParallel`]); the same for the whole model and for every shard.
    reduce_groups: usize,
    /// The stored blocks of the row-parallel weights, which the shard plan
    /// cuts on.
    blocks: StoredBlocks,
    /// How a shard's MoE layers meet their tokens (see [`Combine`]).
    moe_combine: Combine,
    /// What each layer does, and the model-wide switches, from the family.
    recipe: Recipe,
}

/// One decoder layer as the forward pass runs it.
#[derive(Debug)]
struct Layer {
    attn_norm: Vec<f32>,
    /// Q, K and V rows packed as one matrix, where the packed kernel runs
    /// (one call and one activation quantisation instead of three); the
    /// separate weights then stay unpacked (for sharding only).
    qkv: Option<Arc<PackedMatrix>>,
    wq: Weight,
    wk: Weight,
    wv: Weight,
    wo: RowParallel,
    ffn_norm: Vec<f32>,
    ffn: Ffn,
    /// Q | K | V biases, as one row added to each token's fused projection.
    qkv_bias: Option<Vec<f32>>,
    /// Q and K per-head norm weights (`head_dim` each).
    qk_norm: Option<[Vec<f32>; 2]>,
    /// Attention-output and FFN-output norm weights.
    post_norms: Option<[Vec<f32>; 2]>,
}

/// A layer's feed-forward block as the forward pass runs it.
#[derive(Debug)]
enum Ffn {
    /// Tensor parallel: gate and up by output rows, down row-parallel.
    Dense {
        /// Gate and up rows packed as one matrix (see `Layer::qkv`).
        gate_up: Option<Arc<PackedMatrix>>,
        gate: Weight,
        up: Weight,
        down: RowParallel,
    },
    /// Expert parallel over the same ranks as the attention's tensor
    /// parallelism.
    Moe(MoeBlock),
}

/// A projection whose input features are split across tensor-parallel
/// ranks (attention output, FFN down), kept as `reduce_groups` column
/// segments of which this rank holds a contiguous run.
///
/// Each segment's product is computed on its own and the segments are
/// summed in segment order, at every TP degree. A plain row-parallel
/// allreduce would add rank partial sums in a TP-dependent order, and the
/// float rounding difference flips near-tied greedy tokens within a few
/// dozen steps; with fixed segments a TP=3 shard computes bitwise what the
/// whole model computes.
#[derive(Debug)]
struct RowParallel {
    /// This rank's input columns (`count` segments), packed where this CPU
    /// and type allow: then one call computes every segment's partial.
    local: Weight,
    /// Each segment's column slice, for the unpacked kernels only.
    segments: Vec<Weight>,
    /// Segments this rank holds.
    count: usize,
    /// Output features (rows).
    rows: usize,
    /// Where each local segment's input features start, plus the end
    /// (`count + 1` offsets into `local`'s columns).
    bounds: Vec<usize>,
}

impl RowParallel {
    /// Segments `first..first + count` of `w`, whose columns are cut into
    /// segments at `bounds` (segment `s` is `bounds[s]..bounds[s + 1]`).
    fn new(w: &Weight, bounds: &[usize], first: usize, count: usize) -> Result<Self, ModelError> {
        let (rows, cols) = w.shape();
        let groups = bounds.len().saturating_sub(1);
        if count == 0
            || first + count > groups
            || bounds.first() != Some(&0)
            || bounds.last() != Some(&cols)
            || bounds.windows(2).any(|b| b[0] >= b[1])
        {
            return Err(ModelError::InvalidConfig(format!(
                "row-parallel segments {first}..{} of {bounds:?} over {cols} columns",
                first + count
            )));
        }
        let cols = bounds[first]..bounds[first + count];
        let local = if cols.len() == w.shape().1 {
            w.clone()
        } else {
            w.slice_cols(cols.clone())?
        };
        let bounds: Vec<usize> = bounds[first..=first + count]
            .iter()
            .map(|b| b - cols.start)
            .collect();
        let equal = bounds.windows(2).all(|b| b[1] - b[0] == bounds[1]);
        // The packed kernel computes equal segments in one call; anything
        // else goes segment by segment.
        let segments = if (local.packed().is_some() && equal) || count == 1 {
            Vec::new()
        } else {
            bounds
                .windows(2)
                .map(|b| local.slice_cols(b[0]..b[1]))
                .collect::<Result<_, _>>()?
        };
        Ok(Self {
            local,
            segments,
            count,
            rows,
            bounds,
        })
    }

    /// This projection's segment bounds as a whole-model list, for a
    /// projection that has not been sharded.
    fn all_bounds(&self) -> &[usize] {
        &self.bounds
    }

    /// `n_tok` rows of this rank's input features (`count * seg_cols`
    /// each) -> one `n_tok x rows` partial product per segment,
    /// segment-major, into `partials`.
    fn partials(
        &self,
        x: &[f32],
        n_tok: usize,
        gathered: &mut Vec<f32>,
        partials: &mut [f32],
    ) -> Result<(), RequestError> {
        if self.count == 1 {
            return self.local.matmul(x, n_tok, partials);
        }
        if let Some(p) = self.local.packed()
            && self.segments.is_empty()
        {
            tandem_kernels::matmul_packed_segments(p, x, n_tok, self.count, partials)?;
            return Ok(());
        }
        let width = self.bounds[self.count];
        let out_len = n_tok * self.rows;
        for ((w, b), out) in self
            .segments
            .iter()
            .zip(self.bounds.windows(2))
            .zip(partials.chunks_exact_mut(out_len.max(1)))
        {
            let xs: &[f32] = if n_tok == 1 {
                &x[b[0]..b[1]]
            } else {
                gathered.clear();
                for row in x.chunks_exact(width) {
                    gathered.extend_from_slice(&row[b[0]..b[1]]);
                }
                gathered
            };
            w.matmul(xs, n_tok, out)?;
        }
        Ok(())
    }
}

/// One rank of a tensor-parallel group (Megatron-style): attention heads,
/// KV heads and the FFN width are split across ranks (Q/K/V, gate and up
/// by output rows; the attention output and down projections by input
/// column segments, see [`RowParallel`]); the embedding and the output head
/// are split by vocabulary (lookup + allreduce, logits + allgather).
pub struct TpShard {
    comm: Arc<dyn Communicator>,
    /// This rank's vocabulary rows: `vocab_start..vocab_start + vocab_len`.
    vocab_start: usize,
    vocab_len: usize,
}

impl std::fmt::Debug for TpShard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TpShard")
            .field("rank", &self.comm.rank())
            .field("world", &self.comm.world_size())
            .field("vocab_start", &self.vocab_start)
            .finish()
    }
}

/// One sequence's share of a forward batch.
#[derive(Debug, Clone, Copy)]
pub struct SeqChunk<'a> {
    /// New tokens to run, at positions `start_pos..start_pos + tokens.len()`.
    pub tokens: &'a [u32],
    /// Tokens of this sequence already in the KV cache.
    pub start_pos: usize,
    /// The sequence's blocks, covering at least `start_pos + tokens.len()` tokens.
    pub block_table: &'a [BlockId],
    /// Whether to return logits for the chunk's last token.
    pub want_logits: bool,
}

impl DecoderModel {
    /// Checks every weight's shape against the config.
    pub fn new(config: ModelConfig, weights: ModelWeights) -> Result<Self, ModelError> {
        config.validate()?;
        let c = &config;
        let check_norm = |name: &str, v: &[f32], n: usize| {
            if v.len() == n {
                Ok(())
            } else {
                Err(ModelError::BadTensor {
                    name: name.to_string(),
                    problem: format!("{} values, expected {n}", v.len()),
                })
            }
        };
        if weights.layers.len() != c.n_layers {
            return Err(ModelError::InvalidConfig(format!(
                "{} layers of weights for {} layers",
                weights.layers.len(),
                c.n_layers
            )));
        }
        let ModelWeights {
            token_embd,
            layers,
            output_norm,
            output,
        } = weights;
        let token_embd = token_embd.expect_shape("token_embd", c.vocab_size, c.d_model)?;
        check_norm("output_norm", &output_norm, c.d_model)?;
        let output = output
            .map(|w| w.expect_shape("output", c.vocab_size, c.d_model))
            .transpose()?;
        // One cut of each row-parallel projection for every layer, by the
        // shard plan, on the coarsest block any layer's weight has (block
        // sizes divide each other).
        let blocks = stored_blocks(&layers);
        let plan = ShardPlan::new(c, 1, blocks)?;
        let reduce_groups = plan.segments;
        let mut checked = Vec::with_capacity(layers.len());
        let fam = c.family;
        for (i, l) in layers.into_iter().enumerate() {
            let n = |s: &str| format!("blk.{i}.{s}");
            check_norm(&n("attn_norm"), &l.attn_norm, c.d_model)?;
            check_norm(&n("ffn_norm"), &l.ffn_norm, c.d_model)?;
            let family_mismatch = |what: &str| {
                ModelError::InvalidConfig(format!(
                    "layer {i}: {what} do not match the {} family",
                    fam.name()
                ))
            };
            if l.qkv_bias.is_some() != fam.qkv_bias {
                return Err(family_mismatch("Q/K/V biases"));
            }
            if l.qk_norm.is_some() != fam.qk_norm {
                return Err(family_mismatch("Q/K norms"));
            }
            if l.post_norms.is_some() != fam.post_norms {
                return Err(family_mismatch("post-attention / post-FFN norms"));
            }
            if let Some([bq, bk, bv]) = &l.qkv_bias {
                check_norm(&n("attn_q.bias"), bq, c.q_dim())?;
                check_norm(&n("attn_k.bias"), bk, c.kv_dim())?;
                check_norm(&n("attn_v.bias"), bv, c.kv_dim())?;
            }
            if let Some([q, k]) = &l.qk_norm {
                check_norm(&n("attn_q_norm"), q, c.head_dim)?;
                check_norm(&n("attn_k_norm"), k, c.head_dim)?;
            }
            if let Some([a, f]) = &l.post_norms {
                check_norm(&n("post_attention_norm"), a, c.d_model)?;
                check_norm(&n("post_ffw_norm"), f, c.d_model)?;
            }
            let wo = l.wo.expect_shape(&n("attn_output"), c.d_model, c.q_dim())?;
            let ffn = match (l.ffn, &c.moe) {
                (FfnWeights::Dense { gate, up, down }, None) => Ffn::Dense {
                    gate_up: None,
                    gate: gate.expect_shape(&n("ffn_gate"), c.ffn_dim, c.d_model)?,
                    up: up.expect_shape(&n("ffn_up"), c.ffn_dim, c.d_model)?,
                    down: RowParallel::new(
                        &down.expect_shape(&n("ffn_down"), c.d_model, c.ffn_dim)?,
                        &plan.ffn_bounds,
                        0,
                        reduce_groups,
                    )?,
                },
                (FfnWeights::Moe(w), Some(moe)) => {
                    Ffn::Moe(MoeBlock::new(moe.clone(), w, c.d_model)?)
                }
                _ => {
                    return Err(ModelError::InvalidConfig(format!(
                        "layer {i}: feed-forward weights do not match the config (dense vs mixture of experts)"
                    )));
                }
            };
            checked.push(fused_layer(Layer {
                qkv: None,
                attn_norm: l.attn_norm,
                wq: l.wq.expect_shape(&n("attn_q"), c.q_dim(), c.d_model)?,
                wk: l.wk.expect_shape(&n("attn_k"), c.kv_dim(), c.d_model)?,
                wv: l.wv.expect_shape(&n("attn_v"), c.kv_dim(), c.d_model)?,
                wo: RowParallel::new(&wo, &plan.attn_bounds, 0, reduce_groups)?,
                ffn_norm: l.ffn_norm,
                ffn,
                qkv_bias: l.qkv_bias.map(|b| b.concat()),
                qk_norm: l.qk_norm,
                post_norms: l.post_norms,
            }));
        }
        let recipe = Recipe::new(&config);
        Ok(Self {
            config,
            token_embd,
            layers: checked,
            output_norm,
            output,
            tp: None,
            reduce_groups,
            blocks,
            moe_combine: Combine::AllReduce,
            recipe,
        })
    }

    /// This model's shard for rank `comm.rank()` of a tensor-parallel group
    /// of `comm.world_size()` ranks. Every rank must run the same forward
    /// calls (collectives inside pair them up); each gets the full logits,
    /// bitwise equal to the whole model's.
    pub fn shard(&self, comm: Arc<dyn Communicator>) -> Result<DecoderModel, ModelError> {
        self.shard_with(comm, Combine::AllReduce)
    }

    /// [`DecoderModel::shard`], choosing how MoE layers combine: `AllReduce`
    /// (every rank routes every token, computes its own experts, then an
    /// allreduce) or `Dispatch` (the attention output is reduce-scattered
    /// by tokens, each rank sends its tokens to their experts' ranks with
    /// all-to-all, and an allgather restores every token on every rank).
    /// Dense models ignore it.
    pub fn shard_with(
        &self,
        comm: Arc<dyn Communicator>,
        moe_combine: Combine,
    ) -> Result<DecoderModel, ModelError> {
        let (rank, world) = (comm.rank(), comm.world_size());
        let c = &self.config;
        if self.tp.is_some() {
            return Err(ModelError::InvalidConfig("cannot shard a shard".into()));
        }
        // The one plan every executor splits by.
        let plan = ShardPlan::new(c, world, self.blocks)?;
        let share = plan.rank(rank).ok_or_else(|| {
            ModelError::InvalidConfig(format!("rank {rank} of {world} tensor-parallel ranks"))
        })?;
        let (q, kv, vocab, segs) = (share.q_rows, share.kv_rows, share.vocab, share.segments);
        let row_parallel =
            |w: &RowParallel| RowParallel::new(&w.local, w.all_bounds(), segs.start, segs.len());
        // The FFN width this rank holds: the columns of its down-projection
        // segments (which follow the weights' blocks, so ranks may differ).
        let ffn = share.ffn;

        let mut layers = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            let ffn = match &l.ffn {
                Ffn::Dense { gate, up, down, .. } => Ffn::Dense {
                    gate_up: None,
                    gate: gate.slice_rows(ffn.clone())?,
                    up: up.slice_rows(ffn.clone())?,
                    down: row_parallel(down)?,
                },
                Ffn::Moe(m) => Ffn::Moe(m.shard(Arc::clone(&comm))?),
            };
            layers.push(fused_layer(Layer {
                qkv: None,
                attn_norm: l.attn_norm.clone(),
                wq: l.wq.slice_rows(q.clone())?,
                wk: l.wk.slice_rows(kv.clone())?,
                wv: l.wv.slice_rows(kv.clone())?,
                wo: row_parallel(&l.wo)?,
                ffn_norm: l.ffn_norm.clone(),
                ffn,
                // This rank's rows of each of Q, K and V.
                qkv_bias: l.qkv_bias.as_ref().map(|b| {
                    let (qd, kvd) = (c.q_dim(), c.kv_dim());
                    [
                        &b[q.clone()],
                        &b[qd + kv.start..qd + kv.end],
                        &b[qd + kvd + kv.start..qd + kvd + kv.end],
                    ]
                    .concat()
                }),
                qk_norm: l.qk_norm.clone(),
                post_norms: l.post_norms.clone(),
            }));
        }
        let config = ModelConfig {
            n_heads: c.n_heads / world,
            n_kv_heads: c.n_kv_heads / world,
            // Experts stay whole; each rank holds a share of them.
            ffn_dim: if c.moe.is_some() {
                c.ffn_dim
            } else {
                ffn.len()
            },
            ..c.clone()
        };
        Ok(DecoderModel {
            config,
            token_embd: self.token_embd.slice_rows(vocab.clone())?,
            layers,
            output_norm: self.output_norm.clone(),
            output: self
                .output
                .as_ref()
                .map(|w| w.slice_rows(vocab.clone()))
                .transpose()?,
            tp: Some(TpShard {
                comm,
                vocab_start: vocab.start,
                vocab_len: vocab.len(),
            }),
            reduce_groups: self.reduce_groups,
            blocks: self.blocks,
            moe_combine,
            recipe: self.recipe.clone(),
        })
    }

    /// Every rank's segment partials of a row-parallel projection (this
    /// rank's are `local`, segment-major), in segment order: `local` itself
    /// alone, else gathered from the group into `gathered`.
    fn gather_segments<'a>(
        &self,
        local: &'a [f32],
        gathered: &'a mut Vec<f32>,
    ) -> Result<&'a [f32], RequestError> {
        match &self.tp {
            Some(tp) => {
                gathered.clear();
                gathered.resize(local.len() * tp.comm.world_size(), 0.0);
                tp.comm.all_gather(local, gathered)?;
                Ok(&gathered[..])
            }
            None => Ok(local),
        }
    }

    /// Sums partial results across the tensor-parallel group (no-op alone).
    fn all_reduce(&self, buf: &mut [f32]) -> Result<(), RequestError> {
        match &self.tp {
            Some(tp) => tp.comm.all_reduce_sum(buf).map_err(RequestError::from),
            None => Ok(()),
        }
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Whether the output head reuses the token embedding.
    pub fn output_is_tied(&self) -> bool {
        self.output.is_none()
    }

    /// The token embedding's storage type.
    pub fn embedding_type(&self) -> GgmlType {
        self.token_embd.ty()
    }

    /// Segments each row-parallel projection is summed over (any TP degree
    /// must divide it).
    pub fn reduce_groups(&self) -> usize {
        self.reduce_groups
    }

    /// A KV cache shape for this model.
    pub fn kv_cache_config(&self, block_size: usize, num_blocks: usize) -> KvCacheConfig {
        KvCacheConfig::for_model(&self.config, block_size, num_blocks)
    }

    fn output_head(&self) -> &Weight {
        self.output.as_ref().unwrap_or(&self.token_embd)
    }

    /// Runs one batch step. Writes the new tokens' K/V into `cache` and
    /// returns `vocab_size` logits for each chunk with `want_logits`, in order.
    pub fn forward(
        &self,
        chunks: &[SeqChunk<'_>],
        cache: &mut KvCache,
    ) -> Result<Vec<f32>, RequestError> {
        self.forward_with_hook(chunks, cache, &mut |_| {})
    }

    /// [`DecoderModel::forward`], calling `layer_done(l)` once layer `l`'s K/V
    /// for every token of the batch are in `cache` (so a transfer engine can
    /// start moving that layer while later layers compute).
    pub fn forward_with_hook(
        &self,
        chunks: &[SeqChunk<'_>],
        cache: &mut KvCache,
        layer_done: &mut dyn FnMut(usize),
    ) -> Result<Vec<f32>, RequestError> {
        let mut logits = Vec::new();
        self.forward_into(chunks, cache, layer_done, &mut logits)?;
        Ok(logits)
    }

    /// [`DecoderModel::forward_with_hook`] writing the logits into `logits`
    /// (resized; every value overwritten), so a caller that keeps the
    /// buffer across steps does not zero and fault in megabytes of fresh
    /// memory per step (32 rows of a 49k vocabulary are 6 MB).
    pub fn forward_into(
        &self,
        chunks: &[SeqChunk<'_>],
        cache: &mut KvCache,
        layer_done: &mut dyn FnMut(usize),
        logits: &mut Vec<f32>,
    ) -> Result<(), RequestError> {
        let c = &self.config;
        let kvc = *cache.config();
        if (kvc.n_layers, kvc.n_kv_heads, kvc.head_dim) != (c.n_layers, c.n_kv_heads, c.head_dim) {
            return Err(RequestError::KvCache(KvCacheError::InvalidConfig(
                "KV cache shape does not match the model",
            )));
        }
        // Where each token of the flattened batch lives: (chunk, position).
        let mut token_ids = Vec::new();
        let mut placement = Vec::new();
        for (ci, ch) in chunks.iter().enumerate() {
            let end = ch.start_pos + ch.tokens.len();
            if ch.block_table.len() < kvc.blocks_for(end) {
                return Err(RequestError::BlockTableTooShort {
                    have: ch.block_table.len(),
                    tokens: end,
                });
            }
            if let Some(&b) = ch
                .block_table
                .iter()
                .find(|&&b| b as usize >= kvc.num_blocks)
            {
                return Err(KvCacheError::OutOfRange {
                    block: b,
                    num_blocks: kvc.num_blocks,
                }
                .into());
            }
            for (i, &t) in ch.tokens.iter().enumerate() {
                if t as usize >= c.vocab_size {
                    return Err(tandem_types::InvalidRequest::TokenOutOfRange {
                        id: t,
                        vocab: c.vocab_size,
                    }
                    .into());
                }
                token_ids.push(t);
                placement.push((ci, ch.start_pos + i));
            }
        }
        FORWARD_BUFFERS.with(|cell| match cell.try_borrow_mut() {
            Ok(mut bufs) => self.forward_rest(
                chunks, cache, layer_done, logits, &token_ids, &placement, &mut bufs,
            ),
            // Only reachable if a forward pass re-entered itself on this thread.
            Err(_) => self.forward_rest(
                chunks,
                cache,
                layer_done,
                logits,
                &token_ids,
                &placement,
                &mut ForwardBuffers::default(),
            ),
        })
    }

    /// [`DecoderModel::forward_into`] after the batch was checked and
    /// flattened: `token_ids` and their `(chunk, position)` placement.
    /// Each layer: the attention half ([`DecoderModel::attention_half`]),
    /// then the FFN half ([`DecoderModel::ffn_half`]); then the logits.
    #[allow(clippy::too_many_arguments)]
    fn forward_rest(
        &self,
        chunks: &[SeqChunk<'_>],
        cache: &mut KvCache,
        layer_done: &mut dyn FnMut(usize),
        logits: &mut Vec<f32>,
        token_ids: &[u32],
        placement: &[(usize, usize)],
        bufs: &mut ForwardBuffers,
    ) -> Result<(), RequestError> {
        let c = &self.config;
        let n_tok = token_ids.len();
        let d = c.d_model;
        // Every buffer starts empty, so resizing it gives what a fresh
        // zeroed one would (a rank relies on that where it leaves rows zero);
        // they go back into `bufs` when the pass succeeds.
        bufs.clear();
        let mut b = std::mem::take(bufs);
        self.embed(token_ids, &mut b.x)?;
        let (qd, kvd) = (c.q_dim(), c.kv_dim());
        b.xn.resize(n_tok * d, 0.0);
        // Each token's q | k | v, as the fused projection writes them.
        b.qkv.resize(n_tok * (qd + 2 * kvd), 0.0);
        b.attn.resize(n_tok * qd, 0.0);
        b.proj.resize(n_tok * d, 0.0);
        // Outputs of unfused projections, and the dense FFN activations,
        // are sized on first use (fused or MoE layers need some of them not).
        // Segment partials of a row-parallel projection, and the gather.
        let local_segs = self.layers.first().map_or(0, |l| l.wo.count);
        b.partials.resize(local_segs * n_tok * d, 0.0);
        // Whether `xn` already holds this layer's attention-norm input.
        let mut xn_ready = false;
        for (li, layer) in self.layers.iter().enumerate() {
            if !xn_ready {
                let x = &b.x;
                tandem_kernels::parallel_chunks_mut(&mut b.xn, d, &|t, o| {
                    ops::rms_norm(&x[t * d..(t + 1) * d], &layer.attn_norm, c.rms_eps, o);
                });
            }
            self.attention_half(li, chunks, placement, cache, &mut b)?;
            layer_done(li);
            self.attention(li, chunks, placement, &b.qkv, cache, &mut b.attn);
            layer
                .wo
                .partials(&b.attn, n_tok, &mut b.seg_x, &mut b.partials)?;
            if let (Ffn::Moe(moe), Some(tp), Combine::Dispatch) =
                (&layer.ffn, &self.tp, &self.moe_combine)
            {
                self.moe_dispatch_tail(tp, layer, moe, &b.partials, &mut b.x, n_tok)?;
                xn_ready = false;
                continue;
            }
            xn_ready = self.ffn_half(li, n_tok, &mut b)?;
        }
        self.logits(chunks, &b.x, logits)?;
        *bufs = b;
        Ok(())
    }

    /// The tokens' embeddings into `x` (each rank's vocabulary rows summed
    /// across a tensor-parallel group), scaled where the recipe says.
    fn embed(&self, token_ids: &[u32], x: &mut Vec<f32>) -> Result<(), RequestError> {
        let d = self.config.d_model;
        x.resize(token_ids.len() * d, 0.0);
        match &self.tp {
            None => {
                for (row, &t) in x.chunks_exact_mut(d).zip(token_ids) {
                    self.token_embd.row_into(t as usize, row)?;
                }
            }
            Some(tp) => {
                // The rank owning the token's row writes it, the others
                // leave zeros; the sum is exact.
                for (row, &t) in x.chunks_exact_mut(d).zip(token_ids) {
                    if let Some(local) = (t as usize).checked_sub(tp.vocab_start)
                        && local < tp.vocab_len
                    {
                        self.token_embd.row_into(local, row)?;
                    }
                }
                self.all_reduce(x)?;
            }
        }
        if let Some(scale) = self.recipe.embedding_scale {
            for v in x.iter_mut() {
                *v *= scale;
            }
        }
        Ok(())
    }

    /// Layer `li`'s Q, K and V of every token from `b.xn` into `b.qkv`
    /// (biases added, Q and K normed and rotated as the recipe says), and
    /// each token's K and V into `cache`.
    fn attention_half(
        &self,
        li: usize,
        chunks: &[SeqChunk<'_>],
        placement: &[(usize, usize)],
        cache: &mut KvCache,
        b: &mut ForwardBuffers,
    ) -> Result<(), RequestError> {
        let c = &self.config;
        let layer = &self.layers[li];
        let n_tok = placement.len();
        let (qd, kvd) = (c.q_dim(), c.kv_dim());
        let qkv_w = qd + 2 * kvd;
        match &layer.qkv {
            Some(p) => tandem_kernels::matmul_packed(p, &b.xn, n_tok, &mut b.qkv)?,
            None => {
                b.q.resize(n_tok * qd, 0.0);
                b.k.resize(n_tok * kvd, 0.0);
                b.v.resize(n_tok * kvd, 0.0);
                layer.wq.matmul(&b.xn, n_tok, &mut b.q)?;
                layer.wk.matmul(&b.xn, n_tok, &mut b.k)?;
                layer.wv.matmul(&b.xn, n_tok, &mut b.v)?;
                for (t, row) in b.qkv.chunks_exact_mut(qkv_w).enumerate() {
                    row[..qd].copy_from_slice(&b.q[t * qd..(t + 1) * qd]);
                    row[qd..qd + kvd].copy_from_slice(&b.k[t * kvd..(t + 1) * kvd]);
                    row[qd + kvd..].copy_from_slice(&b.v[t * kvd..(t + 1) * kvd]);
                }
            }
        }
        let rope = self.recipe.rope(li);
        tandem_kernels::parallel_chunks_mut(&mut b.qkv, qkv_w, &|t, row| {
            let pos = placement[t].1;
            if let Some(bias) = &layer.qkv_bias {
                ops::add_assign(row, bias);
            }
            let (q_row, kv_row) = row.split_at_mut(qd);
            if let Some([qn, kn]) = &layer.qk_norm {
                for h in q_row.chunks_exact_mut(c.head_dim) {
                    ops::rms_norm_in_place(h, qn, c.rms_eps);
                }
                for h in kv_row[..kvd].chunks_exact_mut(c.head_dim) {
                    ops::rms_norm_in_place(h, kn, c.rms_eps);
                }
            }
            let angles = rope.angles(pos);
            angles.apply(q_row, c.head_dim);
            angles.apply(&mut kv_row[..kvd], c.head_dim);
        });
        let bs = cache.config().block_size;
        for (row, &(ci, pos)) in b.qkv.chunks_exact(qkv_w).zip(placement) {
            let table = chunks[ci].block_table;
            cache.write(
                li,
                table[pos / bs],
                pos % bs,
                &row[qd..qd + kvd],
                &row[qd + kvd..],
            );
        }
        Ok(())
    }

    /// Layer `li` from its attention output's segment partials in
    /// `b.partials`: the residual add (through the post-attention norm
    /// where the layer has one), the FFN norm, the FFN and its residual
    /// add. Returns whether `b.xn` then holds the next layer's
    /// attention-norm input (a dense layer computes it on the way).
    fn ffn_half(
        &self,
        li: usize,
        n_tok: usize,
        b: &mut ForwardBuffers,
    ) -> Result<bool, RequestError> {
        let c = &self.config;
        let d = c.d_model;
        let layer = &self.layers[li];
        let all = self.gather_segments(&b.partials, &mut b.gathered)?;
        let [post_attn, post_ffn] = match &layer.post_norms {
            Some([a, f]) => [Some(&a[..]), Some(&f[..])],
            None => [None, None],
        };
        residual_norm(
            all,
            d,
            &mut b.x,
            &mut b.xn,
            post_attn,
            Some(&layer.ffn_norm),
            c.rms_eps,
        );
        let down = match &layer.ffn {
            Ffn::Dense {
                gate_up,
                gate,
                up,
                down,
            } => {
                self.gated(gate_up.as_deref(), gate, up, n_tok, b)?;
                down
            }
            Ffn::Moe(moe) => {
                moe.forward_replicated(&b.xn, n_tok, &mut b.proj)?;
                ops::add_assign(&mut b.x, &b.proj);
                return Ok(false);
            }
        };
        down.partials(&b.act, n_tok, &mut b.seg_x, &mut b.partials)?;
        let all = self.gather_segments(&b.partials, &mut b.gathered)?;
        // The next layer's attention norm rides along.
        let next = self.layers.get(li + 1).map(|l| &l.attn_norm[..]);
        residual_norm(all, d, &mut b.x, &mut b.xn, post_ffn, next, c.rms_eps);
        Ok(next.is_some())
    }

    /// The gated FFN's activations `act(gate xn) * up xn` into `b.act`, by
    /// the fused gate-up matrix where there is one.
    fn gated(
        &self,
        gate_up: Option<&PackedMatrix>,
        w_gate: &Weight,
        w_up: &Weight,
        n_tok: usize,
        b: &mut ForwardBuffers,
    ) -> Result<(), RequestError> {
        let f = self.config.ffn_dim;
        let act_fn = self.recipe.activation;
        b.act.resize(n_tok * f, 0.0);
        match gate_up {
            Some(p) => {
                b.gate_up.resize(n_tok * 2 * f, 0.0);
                tandem_kernels::matmul_packed(p, &b.xn, n_tok, &mut b.gate_up)?;
                let gu = &b.gate_up;
                tandem_kernels::parallel_chunks_mut(&mut b.act, f, &|t, a| {
                    let row = &gu[t * 2 * f..(t + 1) * 2 * f];
                    a.copy_from_slice(&row[..f]);
                    activate(act_fn, a, &row[f..]);
                });
            }
            None => {
                b.gate.resize(n_tok * f, 0.0);
                b.up.resize(n_tok * f, 0.0);
                w_gate.matmul(&b.xn, n_tok, &mut b.gate)?;
                w_up.matmul(&b.xn, n_tok, &mut b.up)?;
                let (g, u) = (&b.gate, &b.up);
                tandem_kernels::parallel_chunks_mut(&mut b.act, f, &|t, a| {
                    a.copy_from_slice(&g[t * f..(t + 1) * f]);
                    activate(act_fn, a, &u[t * f..(t + 1) * f]);
                });
            }
        }
        Ok(())
    }

    /// The final norm and the output head for the rows whose logits are
    /// wanted (each rank's vocabulary slice gathered under tensor
    /// parallelism), soft-capped where the recipe says.
    fn logits(
        &self,
        chunks: &[SeqChunk<'_>],
        x: &[f32],
        logits: &mut Vec<f32>,
    ) -> Result<(), RequestError> {
        let c = &self.config;
        let d = c.d_model;
        let mut rows = Vec::new();
        let mut t0 = 0;
        for ch in chunks {
            t0 += ch.tokens.len();
            if ch.want_logits && !ch.tokens.is_empty() {
                rows.push(t0 - 1);
            }
        }
        let mut last = vec![0.0f32; rows.len() * d];
        for (o, &r) in last.chunks_exact_mut(d).zip(&rows) {
            ops::rms_norm(&x[r * d..(r + 1) * d], &self.output_norm, c.rms_eps, o);
        }
        logits.resize(rows.len() * c.vocab_size, 0.0);
        match &self.tp {
            None => self.output_head().matmul(&last, rows.len(), logits)?,
            Some(tp) => {
                // Each rank's vocabulary slice, gathered rank-major, then
                // laid out row by row.
                let vl = tp.vocab_len;
                let mut local = vec![0.0f32; rows.len() * vl];
                self.output_head().matmul(&last, rows.len(), &mut local)?;
                let world = tp.comm.world_size();
                let mut all = vec![0.0f32; world * local.len()];
                tp.comm.all_gather(&local, &mut all)?;
                for (r, part) in all.chunks_exact(local.len().max(1)).enumerate() {
                    for (row, src) in part.chunks_exact(vl).enumerate() {
                        logits[row * c.vocab_size + r * vl..row * c.vocab_size + (r + 1) * vl]
                            .copy_from_slice(src);
                    }
                }
            }
        }
        if let Some(cap) = self.recipe.final_logit_softcap {
            ops::softcap(logits, cap);
        }
        Ok(())
    }

    /// The rest of an MoE layer under [`Combine::Dispatch`], from this
    /// rank's attention-output segment partials to the layer's output in
    /// `x` (`n_tok` rows, the same on every rank):
    /// - reduce-scatter the attention output by tokens: rank `r` owns rows
    ///   `r * cap..(r + 1) * cap` (clamped), `cap = ceil(n_tok / world)`, so
    ///   uneven batches only leave the last ranks' slots short or empty;
    /// - residual, norm and the MoE block on those rows (tokens travel to
    ///   their experts' ranks and back inside `forward_dispatch`);
    /// - allgather the rows so every rank holds every token again.
    fn moe_dispatch_tail(
        &self,
        tp: &TpShard,
        layer: &Layer,
        moe: &MoeBlock,
        partials: &[f32],
        x: &mut [f32],
        n_tok: usize,
    ) -> Result<(), RequestError> {
        let c = &self.config;
        let d = c.d_model;
        let (rank, world) = (tp.comm.rank(), tp.comm.world_size());
        let collective = |e: crate::comm::CommError| RequestError::Collective(e.into());
        let cap = n_tok.div_ceil(world);
        let rows = (rank * cap).min(n_tok)..((rank + 1) * cap).min(n_tok);
        let n_local = rows.len();

        let mut send = vec![0.0f32; world * cap * d];
        if n_tok > 0 {
            for seg in partials.chunks_exact(n_tok * d) {
                ops::add_assign(&mut send[..n_tok * d], seg);
            }
        }
        let mut attn_out = vec![0.0f32; cap * d];
        tp.comm
            .reduce_scatter_sum(&send, &mut attn_out)
            .map_err(collective)?;

        let mut xs = x[rows.start * d..rows.end * d].to_vec();
        ops::add_assign(&mut xs, &attn_out[..n_local * d]);
        let mut xn = vec![0.0f32; n_local * d];
        for (o, xi) in xn.chunks_exact_mut(d).zip(xs.chunks_exact(d)) {
            ops::rms_norm(xi, &layer.ffn_norm, c.rms_eps, o);
        }
        let mut out = vec![0.0f32; n_local * d];
        moe.forward_dispatch(&xn, n_local, &mut out)?;
        ops::add_assign(&mut xs, &out);

        let mut slot = vec![0.0f32; cap * d];
        slot[..n_local * d].copy_from_slice(&xs);
        let mut all = vec![0.0f32; world * cap * d];
        tp.comm.all_gather(&slot, &mut all).map_err(collective)?;
        x.copy_from_slice(&all[..n_tok * d]);
        Ok(())
    }

    /// Causal attention of every new token over its own sequence's cache;
    /// token `t`'s query heads are the first `q_dim` values of row `t` of
    /// `qkv` (rows of `q_dim + 2 * kv_dim`).
    fn attention(
        &self,
        layer: usize,
        chunks: &[SeqChunk<'_>],
        placement: &[(usize, usize)],
        qkv: &[f32],
        cache: &KvCache,
        out: &mut [f32],
    ) {
        let c = &self.config;
        let hd = c.head_dim;
        let bs = cache.config().block_size;
        let group = c.n_heads / c.n_kv_heads;
        let scale = 1.0 / (hd as f32).sqrt();
        // Each sequence's per-head K and V block slices, gathered once per layer.
        let slices = |ch: &SeqChunk<'_>, kv: usize| -> Vec<Vec<&[f16]>> {
            let n_blocks = kvc_blocks(ch, bs);
            (0..c.n_kv_heads)
                .map(|g| {
                    ch.block_table[..n_blocks]
                        .iter()
                        .map(|&b| cache.head_slice(b, layer, kv, g))
                        .collect()
                })
                .collect()
        };
        let k_slices: Vec<_> = chunks.iter().map(|ch| slices(ch, 0)).collect();
        let v_slices: Vec<_> = chunks.iter().map(|ch| slices(ch, 1)).collect();
        // Work items: a run of up to ATTN_TILE_TOKENS consecutive tokens of
        // one sequence with one KV head's query heads, so each K/V row is
        // read once for all of them.
        let tiles = attention_tiles(placement);
        let (n_kv, width) = (c.n_kv_heads, group * hd);
        let qkv_w = c.q_dim() + 2 * c.kv_dim();
        let window = self.recipe.layers[layer].window;
        // Whole blocks before a query's window are skipped (the rest of the
        // window's first block is masked by the kernel). The skip depends
        // only on the query's own position, so its result does not depend
        // on which other tokens share its batch or tile.
        let skip_of = |pos: usize| window.map_or(0, |w| (pos + 1).saturating_sub(w) / bs);
        // A decode step's context is cold (the previous step touched other
        // sequences): fetch it in parallel before reading it.
        let prefetch = |t0: usize, g: usize, to: Prefetch| {
            let ci = placement[t0].0;
            if chunks[ci].tokens.len() == 1 {
                let pos = placement[t0].1;
                let skip = skip_of(pos);
                tandem_kernels::attention::prefetch_context(
                    &k_slices[ci][g][skip..],
                    &v_slices[ci][g][skip..],
                    bs,
                    hd,
                    pos + 1 - skip * bs,
                    to,
                );
            }
        };
        let run = |(t0, nt): (usize, usize), g: usize, dst: &mut [f32]| {
            let ci = placement[t0].0;
            let (ks, vs) = (&k_slices[ci][g], &v_slices[ci][g]);
            ATTN_SCRATCH.with_borrow_mut(|(qs, n_ctx, first, scratch)| {
                // Runs of the tile's tokens that skip the same blocks.
                let mut j = 0;
                while j < nt {
                    let skip = skip_of(placement[t0 + j].1);
                    let mut end = j + 1;
                    while end < nt && skip_of(placement[t0 + end].1) == skip {
                        end += 1;
                    }
                    qs.clear();
                    n_ctx.clear();
                    first.clear();
                    for (t, &(_, pos)) in placement.iter().enumerate().take(t0 + end).skip(t0 + j) {
                        let q = t * qkv_w + g * width;
                        qs.extend_from_slice(&qkv[q..q + width]);
                        n_ctx.extend(std::iter::repeat_n(pos + 1 - skip * bs, group));
                        if let Some(w) = window {
                            let lo = (pos + 1).saturating_sub(w) - skip * bs;
                            first.extend(std::iter::repeat_n(lo, group));
                        }
                    }
                    tandem_kernels::attention::attend_tile(
                        qs,
                        first,
                        n_ctx,
                        &ks[skip..],
                        &vs[skip..],
                        bs,
                        scale,
                        scratch,
                        &mut dst[j * width..end * width],
                    );
                    j = end;
                }
            });
        };
        if tiles.iter().all(|&(_, nt)| nt == 1) {
            // One token per sequence (decode): item (token, KV head) owns
            // its slice of `out`.
            tandem_kernels::parallel_chunks_mut(out, width, &|i, dst| {
                prefetch(tiles[i / n_kv].0, i % n_kv, Prefetch::Now);
                // The next item's rows arrive while this one computes.
                if let Some(next) = tiles.get((i + 1) / n_kv) {
                    prefetch(next.0, (i + 1) % n_kv, Prefetch::Next);
                }
                run(tiles[i / n_kv], i % n_kv, dst);
            });
            return;
        }
        // Runs write to their own rows of `results`, in a balanced order,
        // copied into place afterwards.
        let order = balanced_order(tiles.len());
        let item_len = ATTN_TILE_TOKENS * width;
        ATTN_RESULTS.with_borrow_mut(|results| {
            // Kept across calls (a prompt's would be megabytes to fault in
            // and zero per layer); every slot read below is written first.
            results.resize(results.len().max(order.len() * n_kv * item_len), 0.0);
            tandem_kernels::parallel_chunks_mut(
                &mut results[..order.len() * n_kv * item_len],
                item_len,
                &|i, res| {
                    let tile = tiles[order[i / n_kv]];
                    prefetch(tile.0, i % n_kv, Prefetch::Now);
                    run(tile, i % n_kv, &mut res[..tile.1 * width]);
                },
            );
            let mut item_of = vec![0; tiles.len()];
            for (k, &ti) in order.iter().enumerate() {
                item_of[ti] = k;
            }
            for (ti, &(t0, nt)) in tiles.iter().enumerate() {
                for j in 0..nt {
                    let row = &mut out[(t0 + j) * c.q_dim()..(t0 + j + 1) * c.q_dim()];
                    for (g, dst) in row.chunks_exact_mut(width).enumerate() {
                        let at = (item_of[ti] * n_kv + g) * item_len + j * width;
                        dst.copy_from_slice(&results[at..at + width]);
                    }
                }
            }
        });
    }
}

/// `0..n` with first and last alternating (0, n-1, 1, n-2, ...): a
/// prompt's later runs see more context, and the thread pool hands each
/// thread a contiguous range of items, so this order balances the threads.
fn balanced_order(n: usize) -> Vec<usize> {
    (0..n)
        .map(|k| if k % 2 == 0 { k / 2 } else { n - 1 - k / 2 })
        .collect()
}

/// Most tokens of one sequence whose attention runs as one work item.
const ATTN_TILE_TOKENS: usize = 8;

/// Runs `(first token, count)` of at most [`ATTN_TILE_TOKENS`] consecutive
/// tokens of the same sequence, covering every token in order.
fn attention_tiles(placement: &[(usize, usize)]) -> Vec<(usize, usize)> {
    let mut tiles: Vec<(usize, usize)> = Vec::new();
    for (t, &(ci, _)) in placement.iter().enumerate() {
        match tiles.last_mut() {
            Some((t0, n)) if *n < ATTN_TILE_TOKENS && placement[*t0].0 == ci => *n += 1,
            _ => tiles.push((t, 1)),
        }
    }
    tiles
}

/// The forward pass's activation buffers, kept across calls on the thread
/// that runs them (a 512-token prompt's are tens of megabytes: allocated
/// afresh, every call faulted in and zeroed them page by page).
#[derive(Default)]
struct ForwardBuffers {
    x: Vec<f32>,
    xn: Vec<f32>,
    qkv: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
    partials: Vec<f32>,
    seg_x: Vec<f32>,
    gathered: Vec<f32>,
}

impl ForwardBuffers {
    /// Empties every buffer, keeping its capacity.
    fn clear(&mut self) {
        for b in [
            &mut self.x,
            &mut self.xn,
            &mut self.qkv,
            &mut self.attn,
            &mut self.proj,
            &mut self.q,
            &mut self.k,
            &mut self.v,
            &mut self.gate,
            &mut self.up,
            &mut self.gate_up,
            &mut self.act,
            &mut self.partials,
            &mut self.seg_x,
            &mut self.gathered,
        ] {
            b.clear();
        }
    }
}

thread_local! {
    static FORWARD_BUFFERS: std::cell::RefCell<ForwardBuffers> =
        std::cell::RefCell::new(ForwardBuffers::default());
    /// Attention scratch reused across calls on each pool thread: a work
    /// item's queries, their context lengths and window starts, the
    /// kernel's scratch.
    #[allow(clippy::type_complexity)]
    static ATTN_SCRATCH: std::cell::RefCell<(Vec<f32>, Vec<usize>, Vec<usize>, Vec<f32>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new(), Vec::new(), Vec::new())) };
    /// A prompt's attention outputs by work item, on the calling thread.
    static ATTN_RESULTS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The layer, with fused projections where they can be packed.
fn fused_layer(mut l: Layer) -> Layer {
    l.qkv = fuse(&mut [&mut l.wq, &mut l.wk, &mut l.wv]);
    if let Ffn::Dense {
        gate_up, gate, up, ..
    } = &mut l.ffn
    {
        *gate_up = fuse(&mut [gate, up]);
    }
    l
}

/// The coarsest stored blocks of the layers' row-parallel weights (the
/// attention output and, for dense layers, the down projection), which
/// the shard plan cuts on.
fn stored_blocks(layers: &[LayerWeights]) -> StoredBlocks {
    let coarsest = |w: fn(&LayerWeights) -> Option<&Weight>| {
        layers
            .iter()
            .filter_map(w)
            .map(|w| w.ty().block_len())
            .max()
            .unwrap_or(1)
    };
    StoredBlocks {
        attn_output: coarsest(|l| Some(&l.wo)),
        ffn_down: coarsest(|l| match &l.ffn {
            FfnWeights::Dense { down, .. } => Some(down),
            FfnWeights::Moe(_) => None,
        }),
    }
}

/// The residual add of a row-parallel projection, then optionally the next
/// norm, token by token across the pool: `x[t] += post(p_0[t] + p_1[t] +
/// ...)` over the segment partials of `all` (segment-major, summed in
/// segment order before the add; `post` is `post_norm`'s RMS norm, or
/// nothing), and with `norm`, `xn[t] = rms_norm(x[t])` (without, `xn` is
/// left holding scratch).
fn residual_norm(
    all: &[f32],
    d: usize,
    x: &mut [f32],
    xn: &mut [f32],
    post_norm: Option<&[f32]>,
    norm: Option<&[f32]>,
    eps: f32,
) {
    let n = x.len();
    if n == 0 || d == 0 {
        return;
    }
    tandem_kernels::parallel_rows2(x, d, xn, d, &|t, xr, on| {
        // `on` is scratch for the segment sum until the norm overwrites it.
        let row = t * d..(t + 1) * d;
        on.copy_from_slice(&all[row.clone()]);
        for seg in all[n..].chunks_exact(n) {
            ops::add_assign(on, &seg[row.clone()]);
        }
        if let Some(w) = post_norm {
            ops::rms_norm_in_place(on, w, eps);
        }
        ops::add_assign(xr, on);
        if let Some(w) = norm {
            ops::rms_norm(xr, w, eps, on);
        }
    });
}

/// Blocks holding the chunk's context after this step.
fn kvc_blocks(ch: &SeqChunk<'_>, block_size: usize) -> usize {
    (ch.start_pos + ch.tokens.len()).div_ceil(block_size)
}

/// The gated FFN's activation, in place: `gate = act(gate) * up`.
fn activate(act: Activation, gate: &mut [f32], up: &[f32]) {
    match act {
        Activation::Silu => ops::silu_mul(gate, up),
        Activation::GeluTanh => ops::gelu_tanh_mul(gate, up),
    }
}
