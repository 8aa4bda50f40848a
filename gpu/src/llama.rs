//! Llama-family models on the device, with the variations the families of
//! `tandem_modelfile::arch` bring (Qwen2's Q/K/V biases; Gemma 3's QK
//! norms, post norms, GeGLU, scaled embeddings and sliding-window layers
//! with their own RoPE base; Mixtral's mixture-of-experts layers): layer
//! weights in any of the quantised formats [`QFormat`](crate::kernels::QFormat) lists, embeddings
//! and head of any type the CPU dequantises.
//! [`GpuModel`] holds the weights and runs the forward pass of a batch of
//! chunks (prompt pieces and decode tokens of several sequences) over a
//! paged KV pool in device memory, laid out as the CPU engine's pool, so a
//! block's bytes are the same on both sides. The engine's scheduler drives
//! it through `runner::GpuRunner`; [`GpuLlama`] is one greedy sequence over
//! a pool of its own (`tandem generate --devices gpu:N`, and the check
//! against the CPU engine). Weights, the KV pool and activations stay on
//! the device; per step the host uploads token ids and position data and
//! reads back the logits of the tokens that want them.

use tandem_kernels::dequantize_row;
use tandem_kernels::ops::RopeStyle;
use tandem_modelfile::arch::Activation;
use tandem_modelfile::config::ModelConfig;
use tandem_modelfile::plan::recipe::Recipe;
use tandem_modelfile::plan::{Part, ShardPlan, StoredBlocks, TensorId};

use tandem_engine::comm::Communicator;
use tandem_engine::error::RequestError;
use tandem_engine::generate::SequenceModel;

use crate::device::{Buffer, GpuDevice};
use crate::error::GpuError;
use crate::kernels::{self, KvLayout, KvRows, MoeRouting, QMatrix};
use crate::weights::{ModelFiles, Tensors};

mod load;

/// KV rows per block of [`GpuLlama`]'s pool.
const BLOCK_SIZE: usize = 16;
/// The largest attention scores buffer, by default: 64 MiB, half of the
/// smallest `maxStorageBufferRange` seen (lavapipe's 128 MiB).
const SCORES_CAP: usize = 64 << 20;
/// Query heads one attention launch may run: one grid axis of cubes.
const MAX_ATTENTION_CUBES: usize = 65_535;

struct Layer {
    attn_norm: Buffer,
    /// The Q, K and V biases (Qwen2), stacked as `wqkv`'s rows.
    qkv_bias: Option<Buffer>,
    /// Per-head norms of the queries and keys (Gemma 3).
    qk_norm: Option<[Buffer; 2]>,
    /// Norms of the attention and FFN outputs before their residual adds
    /// (Gemma 3).
    post_norms: Option<[Buffer; 2]>,
    /// The Q, K and V projections' rows, one matrix: one launch computes
    /// a token's `[q | k | v]` row (a launch per format where they differ).
    wqkv: Stacked,
    wo: Stacked,
    ffn_norm: Buffer,
    ffn: Ffn,
}

/// A layer's feed-forward block.
enum Ffn {
    /// The gate and up projections' rows, one matrix; the down projection.
    Dense { gate_up: Stacked, down: Stacked },
    /// A mixture of SwiGLU experts (this rank's share of them).
    Moe(MoeFfn),
}

struct MoeFfn {
    /// The first of this rank's experts (expert parallelism: the ranks
    /// hold contiguous shares, route every token alike, and their outputs
    /// are added across ranks as a split dense FFN's are).
    first_expert: usize,
    routing: MoeRouting,
    /// `experts x d`.
    router: Stacked,
    /// Per-expert selection bias (zeros where the model has none).
    bias: Buffer,
    /// Each of this rank's experts' gate and up rows (one matrix) and
    /// down projection.
    experts: Vec<(Stacked, Stacked)>,
}

/// Largest stored bytes of one part of a [`Stacked`] matrix: half of the
/// smallest `maxStorageBufferRange` seen (lavapipe's 128 MiB), the rest
/// left for repacking.
const PART_BYTES: usize = 64 << 20;

/// The token embeddings, on the host as the file stores them: a step
/// dequantises its tokens' rows there and uploads them (a 150k-token
/// vocabulary's f32 table would not fit one device buffer).
struct Embeddings {
    ty: tandem_kernels::GgmlType,
    bytes: Vec<u8>,
    row_bytes: usize,
    d: usize,
}

impl Embeddings {
    fn load(t: &dyn Tensors, vocab: usize, d: usize) -> Result<Embeddings, GpuError> {
        let name = TensorId::Embeddings.gguf();
        let info = t.tensor(&name)?;
        let row_bytes = info
            .ty
            .row_bytes(d)
            .ok_or_else(|| unsupported(format!("{name}: rows of {d} are not whole blocks")))?;
        if info.n_elements != vocab * d || info.data.len() != vocab * row_bytes {
            return Err(unsupported(format!(
                "{name} holds {} values, not {vocab}x{d}",
                info.n_elements
            )));
        }
        Ok(Embeddings {
            ty: info.ty,
            bytes: info.data.to_vec(),
            row_bytes,
            d,
        })
    }

    /// The rows of `tokens` (each below the vocabulary size, checked by
    /// the caller), as f32.
    fn rows(&self, tokens: &[u32]) -> Result<Vec<f32>, GpuError> {
        let mut out = vec![0.0f32; tokens.len() * self.d];
        for (&t, dst) in tokens.iter().zip(out.chunks_exact_mut(self.d)) {
            let at = t as usize * self.row_bytes;
            let src = self
                .bytes
                .get(at..at + self.row_bytes)
                .ok_or_else(|| unsupported(format!("token {t} past the embeddings")))?;
            dequantize_row(self.ty, src, dst)
                .map_err(|e| unsupported(format!("token_embd.weight: {e}")))?;
        }
        Ok(out)
    }
}

/// A matrix stacked from the rows of several tensors: neighbouring
/// tensors of one format are one [`QMatrix`] (one launch); each part
/// writes its rows at its offset of the output's rows.
struct Stacked {
    parts: Vec<(QMatrix, usize)>,
    rows: usize,
}

impl Stacked {
    /// `out[t] = w . x[t]` for each token row of `x`.
    fn matmul(&self, dev: &GpuDevice, x: &Buffer, out: &Buffer) -> Result<(), GpuError> {
        for (m, at) in &self.parts {
            kernels::matmul_q(dev, x, m, out, self.rows, *at)?;
        }
        Ok(())
    }

    /// [`Stacked::matmul`] for the first `live[live_at]` token rows only
    /// (see [`kernels::matmul_q_live`]).
    fn matmul_live(
        &self,
        dev: &GpuDevice,
        x: &Buffer,
        out: &Buffer,
        live: &Buffer<u32>,
        live_at: usize,
    ) -> Result<(), GpuError> {
        for (m, at) in &self.parts {
            kernels::matmul_q_live(dev, x, m, out, self.rows, *at, live, live_at)?;
        }
        Ok(())
    }
}

/// Buffers of a step's MoE layers: every layer routes the same tokens
/// over as many experts, so one set serves them all.
struct MoeScratch {
    /// Router logits, `n x experts`.
    logits: Buffer,
    /// Each token's picks and their weights, `n x top_k`.
    sel: Buffer<u32>,
    sel_w: Buffer,
    /// The picks grouped per expert (`experts x n`) and their counts.
    order: Buffer<u32>,
    weight: Buffer,
    counts: Buffer<u32>,
    /// An expert's packed input rows and its output rows, `n x d`.
    rows: Buffer,
    y: Buffer,
}

impl MoeScratch {
    fn new(dev: &GpuDevice, r: &MoeRouting, n: usize, d: usize) -> MoeScratch {
        MoeScratch {
            logits: dev.empty(n * r.experts),
            sel: dev.empty(n * r.top_k),
            sel_w: dev.empty(n * r.top_k),
            order: dev.empty(r.experts * n),
            weight: dev.empty(r.experts * n),
            counts: dev.empty(r.experts),
            rows: dev.empty(n * d),
            y: dev.empty(n * d),
        }
    }
}

impl MoeFfn {
    /// The block's output for the `n` token rows (of `d`) of `xn` into
    /// `out`: routing and grouping on the device, then each of this rank's
    /// experts over its own tokens only, added in ascending expert order
    /// (this rank's share of the sum, under expert parallelism). `scratch`
    /// is made at the step's first MoE layer and reused by the others;
    /// `gate_up` and `h` are the dense FFN's (`2 * ffn` and `ffn` per
    /// token).
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        dev: &GpuDevice,
        xn: &Buffer,
        (n, d): (usize, usize),
        scratch: &mut Option<MoeScratch>,
        (gate_up, h): (&Buffer, &Buffer),
        (ffn, activation): (usize, Activation),
        out: &Buffer,
    ) -> Result<(), GpuError> {
        let r = &self.routing;
        let s = scratch.get_or_insert_with(|| MoeScratch::new(dev, r, n, d));
        self.router.matmul(dev, xn, &s.logits)?;
        kernels::moe_route(
            dev, &s.logits, &self.bias, r, &s.sel, &s.sel_w, &s.order, &s.weight, &s.counts,
        )?;
        kernels::fill(dev, out, 0.0)?;
        for (j, (w_gate_up, down)) in self.experts.iter().enumerate() {
            let e = self.first_expert + j;
            kernels::moe_gather(dev, xn, &s.order, &s.counts, e, d, &s.rows)?;
            w_gate_up.matmul_live(dev, &s.rows, gate_up, &s.counts, e)?;
            kernels::glu(dev, gate_up, ffn, activation, h)?;
            down.matmul_live(dev, h, &s.y, &s.counts, e)?;
            kernels::moe_scatter_add(dev, &s.y, &s.order, &s.weight, &s.counts, e, d, out)?;
        }
        Ok(())
    }
}

/// One sequence's share of a batch step: `tokens` at positions
/// `start_pos..`, whose KV goes to (and attention reads from) the pool
/// blocks `blocks` (the sequence's block table, in position order).
#[derive(Debug, Clone, Copy)]
pub struct Chunk<'a> {
    pub tokens: &'a [u32],
    pub start_pos: usize,
    pub blocks: &'a [u32],
    /// Whether the last token's logits are wanted.
    pub want_logits: bool,
}

/// A paged KV pool in device memory: a buffer per layer, each holding that
/// layer's K and V of every block in the CPU pool's order (KV head, row,
/// value), so a host block is the concatenation of its layers' device
/// blocks. A buffer per layer, not one for the pool, because a device
/// binds at most `maxStorageBufferRange` bytes per buffer (128 MiB on
/// lavapipe, 4 GiB on NVIDIA's Vulkan driver).
#[derive(Debug)]
pub struct DevicePool {
    layers: Vec<Buffer<u32>>,
    blocks: usize,
    /// 32-bit words of one layer of one block.
    words: usize,
}

impl DevicePool {
    /// Blocks held.
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// Bytes of one whole block (every layer), as the host pool holds it.
    pub fn block_bytes(&self) -> usize {
        self.layers.len() * self.words * 4
    }

    fn check(&self, block: usize) -> Result<(), GpuError> {
        if block < self.blocks {
            Ok(())
        } else {
            Err(GpuError::Shape {
                kernel: "kv pool",
                what: format!("block {block} of a pool of {}", self.blocks),
            })
        }
    }

    /// Copies one block, in the host pool's layout, to the device.
    pub fn upload_block(
        &self,
        dev: &GpuDevice,
        block: usize,
        bytes: &[u8],
    ) -> Result<(), GpuError> {
        self.check(block)?;
        if bytes.len() != self.block_bytes() {
            return Err(GpuError::Shape {
                kernel: "kv upload",
                what: format!(
                    "{} bytes for a block of {}",
                    bytes.len(),
                    self.block_bytes()
                ),
            });
        }
        for (layer, part) in self.layers.iter().zip(bytes.chunks_exact(self.words * 4)) {
            dev.write_bytes(layer, block * self.words, part)?;
        }
        Ok(())
    }

    /// Reads `count` blocks from `first` on, each in the host pool's
    /// layout, with one wait.
    pub fn download_blocks(
        &self,
        dev: &GpuDevice,
        runs: &[(usize, usize)],
    ) -> Result<Vec<Vec<u8>>, GpuError> {
        let mut ranges = Vec::with_capacity(runs.len() * self.layers.len());
        for &(first, count) in runs {
            if count > 0 {
                self.check(first + count - 1)?;
            }
            for layer in &self.layers {
                ranges.push((layer, first * self.words, count * self.words));
            }
        }
        let mut parts = dev.download_bytes(&ranges)?.into_iter();
        let layer_bytes = self.words * 4;
        let mut out = Vec::new();
        for &(_, count) in runs {
            let mut blocks = vec![Vec::with_capacity(self.block_bytes()); count];
            for _ in &self.layers {
                let part = parts.next().unwrap_or_default();
                for (b, piece) in blocks.iter_mut().zip(part.chunks_exact(layer_bytes)) {
                    b.extend_from_slice(piece);
                }
            }
            out.extend(blocks);
        }
        Ok(out)
    }
}

/// Which part of a tensor-parallel group a [`GpuModel`] holds: rank
/// `rank` of `world` keeps heads `rank * heads/world..` (and their KV
/// heads), the matching FFN rows, and the columns of the output and down
/// projections that read them; the partial sums of those two projections
/// are added across ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub world: usize,
}

impl Shard {
    /// The whole model.
    pub const WHOLE: Shard = Shard { rank: 0, world: 1 };

    /// Why `c` cannot be split `world` ways, by the shard plan's rule on
    /// the configuration alone (heads, KV heads, vocabulary, experts); the
    /// loader applies the whole rule, with the weights' blocks (see
    /// [`Shard::plan`]).
    pub fn check(c: &ModelConfig, world: usize) -> Result<(), GpuError> {
        let unquantised = StoredBlocks {
            attn_output: 1,
            ffn_down: 1,
        };
        ShardPlan::new(c, world, unquantised)?;
        Ok(())
    }

    /// How `files`' model splits `world` ways, or why it cannot: the shard
    /// plan the CPU engine splits by too (`tandem_modelfile::plan::shard`),
    /// cut on the stored blocks of the attention output and down
    /// projections, so both executors accept and refuse the same `--tp`.
    pub fn plan(files: &ModelFiles, world: usize) -> Result<ShardPlan, GpuError> {
        let (c, g) = (&files.config, files.tensors.as_ref());
        let coarsest = |part: Part| -> Result<usize, GpuError> {
            let mut block = 1;
            for i in 0..c.n_layers {
                block = block.max(g.tensor(&TensorId::weight(i, part).gguf())?.ty.block_len());
            }
            Ok(block)
        };
        let blocks = StoredBlocks {
            attn_output: coarsest(Part::AttnOutput)?,
            ffn_down: match c.moe {
                Some(_) => 1,
                None => coarsest(Part::FfnDown)?,
            },
        };
        Ok(ShardPlan::new(c, world, blocks)?)
    }
}

/// A model's weights on a device, or one rank's share of them (see
/// [`Shard`]), and the forward pass of a batch over a paged KV pool of
/// `block_size`-token blocks.
pub struct GpuModel {
    dev: GpuDevice,
    /// The whole model's configuration.
    c: ModelConfig,
    shard: Shard,
    /// This rank's query heads, KV heads and FFN width.
    heads: usize,
    kv_heads: usize,
    ffn: usize,
    layers: Vec<Layer>,
    embd: Embeddings,
    /// The output head (the embeddings' rows when tied).
    head: Stacked,
    out_norm: Buffer,
    /// What each layer does, and the model-wide switches, from the family.
    recipe: Recipe,
    /// `(sin, cos)` per position and rotated pair, for each of the
    /// recipe's RoPEs: the CPU's angles.
    rope_tables: Vec<Buffer>,
    layout: KvLayout,
    max_ctx: usize,
    /// Bytes of attention scores one step may allocate.
    scores_cap: usize,
}

impl std::fmt::Debug for GpuModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuModel")
            .field("device", &self.dev)
            .field("shard", &self.shard)
            .field("layers", &self.layers.len())
            .field("layout", &self.layout)
            .field("max_ctx", &self.max_ctx)
            .finish_non_exhaustive()
    }
}

/// One greedy sequence of up to `max_ctx` positions on a [`GpuModel`],
/// over a KV pool of its own.
pub struct GpuLlama {
    model: GpuModel,
    pool: DevicePool,
    /// The pool's blocks in order: position `p` is in block `p / 16`.
    table: Vec<u32>,
    next: Buffer<u32>,
}

impl std::fmt::Debug for GpuLlama {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuLlama")
            .field("model", &self.model)
            .finish_non_exhaustive()
    }
}

fn unsupported(what: impl Into<String>) -> GpuError {
    GpuError::UnsupportedModel(what.into())
}

/// A tensor's values as f32 (any type the CPU can dequantise).
fn f32_tensor(t: &dyn Tensors, name: &str, len: usize) -> Result<Vec<f32>, GpuError> {
    let info = t.tensor(name)?;
    let row = info.row_len;
    if row == 0 || info.n_elements != len {
        return Err(unsupported(format!(
            "{name} holds {} values, not {len}",
            info.n_elements
        )));
    }
    let row_bytes = info
        .ty
        .row_bytes(row)
        .ok_or_else(|| unsupported(format!("{name}: rows of {row} are not whole blocks")))?;
    if info.data.len() != len / row * row_bytes {
        return Err(unsupported(format!(
            "{name}: {} bytes for {len} values",
            info.data.len()
        )));
    }
    let mut out = vec![0.0f32; len];
    for (src, dst) in info
        .data
        .chunks_exact(row_bytes)
        .zip(out.chunks_exact_mut(row))
    {
        dequantize_row(info.ty, src, dst).map_err(|e| unsupported(format!("{name}: {e}")))?;
    }
    Ok(out)
}

impl GpuModel {
    /// Uploads the model's weights to `dev`, for sequences of up to
    /// `max_ctx` positions over pools of `block_size`-token blocks.
    pub fn load(
        dev: GpuDevice,
        files: &ModelFiles,
        max_ctx: usize,
        block_size: usize,
    ) -> Result<GpuModel, GpuError> {
        Self::load_shard(dev, files, max_ctx, block_size, Shard::WHOLE)
    }

    /// Caps the attention scores buffer at `bytes` (default 64 MiB):
    /// tokens beyond what it holds run in further attention launches.
    pub fn with_scores_cap(mut self, bytes: usize) -> Self {
        self.scores_cap = bytes;
        self
    }

    /// The device it runs on.
    pub fn device(&self) -> &GpuDevice {
        &self.dev
    }

    /// The whole model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.c
    }

    /// Which part of the model this is.
    pub fn shard(&self) -> Shard {
        self.shard
    }

    /// The KV pool's block layout (this rank's KV heads).
    pub fn kv_layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Longest sequence a step may run.
    pub fn max_ctx(&self) -> usize {
        self.max_ctx
    }

    /// A KV pool of `blocks` blocks, zeroed. Zeroed, not just allocated:
    /// CubeCL allocates an empty buffer lazily on the allocating thread's
    /// stream, and the scheduler's thread, which uses the pool, would find
    /// it "never initialized".
    pub fn new_pool(&self, blocks: usize) -> Result<DevicePool, GpuError> {
        let layer = self.layer_layout();
        let words = layer.block_words();
        let len = blocks
            .checked_mul(words)
            .filter(|&w| {
                blocks > 0 && u32::try_from(blocks).is_ok() && w <= isize::MAX as usize / 4
            })
            .ok_or_else(|| GpuError::Shape {
                kernel: "kv pool",
                what: format!("{blocks} blocks of {layer:?}"),
            })?;
        // Written in pieces of at most 16 MiB, not from one host copy.
        let zeros = vec![0u32; len.min(1 << 22)];
        let mut layers = Vec::with_capacity(self.layout.n_layers);
        for _ in 0..self.layout.n_layers {
            let buf = self.dev.empty(len);
            for at in (0..len).step_by(zeros.len()) {
                self.dev
                    .write_at(&buf, at, &zeros[..zeros.len().min(len - at)])?;
            }
            layers.push(buf);
        }
        Ok(DevicePool {
            layers,
            blocks,
            words,
        })
    }

    /// One layer's share of the KV layout: what each layer's buffer holds.
    fn layer_layout(&self) -> KvLayout {
        KvLayout {
            n_layers: 1,
            ..self.layout
        }
    }

    /// Runs one batch step of the whole model over `pool`: each chunk's K
    /// and V go to its blocks, and the logits of the chunks that want them
    /// come back as one device buffer, `vocab_size` values per such chunk
    /// in chunk order (`None` when no chunk wants logits). Every size, token
    /// id, position and block id is checked here, before anything reaches
    /// the device.
    pub fn forward(
        &self,
        pool: &DevicePool,
        chunks: &[Chunk<'_>],
    ) -> Result<Option<Buffer>, GpuError> {
        self.forward_rank(pool, chunks, None)
    }

    /// [`GpuModel::forward`] of one rank of a tensor-parallel group: every
    /// rank runs the same chunks at the same time, each over its own pool
    /// (its KV heads), and `comm` adds the output and down projections'
    /// partial sums across ranks, staged through host memory. Only rank 0
    /// computes logits. A rank that fails (its inputs refused, its device
    /// failing) still takes part in every later collective, with zeros,
    /// so its peers never wait for a rank that gave up; their results of
    /// that step are then meaningless, and the caller fails the step if
    /// any rank failed (`GpuRunner` does).
    pub fn forward_rank(
        &self,
        pool: &DevicePool,
        chunks: &[Chunk<'_>],
        comm: Option<&dyn Communicator>,
    ) -> Result<Option<Buffer>, GpuError> {
        match comm {
            None if self.shard.world == 1 => {}
            Some(comm)
                if comm.world_size() == self.shard.world && comm.rank() == self.shard.rank => {}
            _ => {
                return Err(GpuError::Shape {
                    kernel: "step",
                    what: format!(
                        "{:?} with a group of {:?} ranks",
                        self.shard,
                        comm.map(|c| (c.rank(), c.world_size()))
                    ),
                });
            }
        }
        let mut met = 0;
        let result = self.step(pool, chunks, comm, &mut met);
        // A rank that stopped short of the step's collectives (its inputs
        // were refused here, or its device failed before the first one)
        // still meets its peers at each of them, so none waits forever.
        // Not after a failed collective: that fails on every rank.
        if let (Err(e), Some(comm)) = (&result, comm)
            && !matches!(e, GpuError::Collective(_))
        {
            let n: usize = chunks.iter().map(|ch| ch.tokens.len()).sum();
            let mut zeros = vec![0.0; n * self.c.d_model];
            for _ in met..2 * self.layers.len() {
                zeros.fill(0.0);
                comm.all_reduce_sum(&mut zeros)?;
            }
        }
        result
    }

    /// The step of [`GpuModel::forward_rank`]; `met` counts the
    /// collectives this rank took part in. Each layer runs its attention
    /// half ([`GpuModel::attention_half`]), the sum of its output across
    /// ranks, its FFN half ([`GpuModel::ffn_half`]) and that sum, each
    /// residual add with the norm after it; then the logits.
    fn step(
        &self,
        pool: &DevicePool,
        chunks: &[Chunk<'_>],
        comm: Option<&dyn Communicator>,
        met: &mut usize,
    ) -> Result<Option<Buffer>, GpuError> {
        let c = &self.c;
        let batch = self.batch(pool, chunks)?;
        if batch.tokens.is_empty() {
            return Ok(None);
        }
        let s = self.step_buffers(&batch)?;
        let dev = &self.dev;
        match self.layers.first() {
            Some(first) => kernels::rms_norm(dev, &s.x, &first.attn_norm, c.rms_eps, &s.xn)?,
            None => kernels::rms_norm(dev, &s.x, &self.out_norm, c.rms_eps, &s.xn)?,
        }
        let mut moe_scratch = None;
        // A device failure under tensor parallelism: kept until the peers
        // have been met at every collective of the step.
        let mut failed: Option<GpuError> = None;
        // Each residual add runs with the norm after it; the last leaves
        // the final hidden states, normalised for the head, in `xn`.
        for (li, (l, kv)) in self.layers.iter().zip(&pool.layers).enumerate() {
            stage(&mut failed, || self.attention_half(li, kv, &s));
            self.all_reduce(comm, &s.o, &mut failed, met)?;
            let [post_attn, post_ffn] = match &l.post_norms {
                Some([a, f]) => [Some(a), Some(f)],
                None => [None, None],
            };
            stage(&mut failed, || {
                kernels::add_rms_norm(dev, &s.x, &s.o, post_attn, &l.ffn_norm, c.rms_eps, &s.xn)?;
                self.ffn_half(l, &s, &mut moe_scratch)
            });
            self.all_reduce(comm, &s.ffn_out, &mut failed, met)?;
            let next_norm = self
                .layers
                .get(li + 1)
                .map_or(&self.out_norm, |n| &n.attn_norm);
            stage(&mut failed, || {
                kernels::add_rms_norm(dev, &s.x, &s.ffn_out, post_ffn, next_norm, c.rms_eps, &s.xn)
            });
        }
        if let Some(e) = failed {
            return Err(e);
        }
        // Every rank holds the final hidden states; rank 0 makes logits.
        if batch.want.is_empty() || self.shard.rank != 0 {
            return Ok(None);
        }
        self.logits(&batch.want, s.xn).map(Some)
    }

    /// The step's chunks flattened and checked against the pool, the
    /// context and the vocabulary, before anything reaches the device.
    fn batch(&self, pool: &DevicePool, chunks: &[Chunk<'_>]) -> Result<Batch, GpuError> {
        let c = &self.c;
        let bs = self.layout.block_size;
        let pool_blocks = pool.blocks;
        let bad = |what: String| {
            Err(GpuError::Shape {
                kernel: "step",
                what,
            })
        };
        let layer_layout = self.layer_layout();
        if pool.layers.len() != self.layers.len() || pool.words != layer_layout.block_words() {
            return bad(format!(
                "{pool:?} is not a pool of {layer_layout:?} per layer"
            ));
        }
        let mut b = Batch::default();
        for ch in chunks {
            let end = ch.start_pos.saturating_add(ch.tokens.len());
            if end > self.max_ctx {
                return bad(format!("positions up to {end} of {}", self.max_ctx));
            }
            let Some(table) = ch.blocks.get(..end.div_ceil(bs)) else {
                return bad(format!("{} blocks for {end} positions", ch.blocks.len()));
            };
            if let Some(blk) = table.iter().find(|&&blk| blk as usize >= pool_blocks) {
                return bad(format!("block {blk} of a pool of {pool_blocks}"));
            }
            if let Some(t) = ch.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
                return bad(format!("token {t} of a vocabulary of {}", c.vocab_size));
            }
            let table_at = b.tables.len() as u32;
            b.tables.extend_from_slice(table);
            for (i, &t) in ch.tokens.iter().enumerate() {
                // Below max_ctx, checked at load to fit 32 bits.
                let p = ch.start_pos + i;
                b.tokens.push(t);
                b.positions.push(p as u32);
                b.slots.extend([table[p / bs], (p % bs) as u32]);
                b.meta.extend([p as u32 + 1, table_at]);
            }
            if ch.want_logits && !ch.tokens.is_empty() {
                b.want.push(b.tokens.len() as u32 - 1);
            }
            b.longest = b.longest.max(end);
        }
        Ok(b)
    }

    /// The step's inputs on the device (the embeddings scaled as the
    /// recipe says) and its activation buffers.
    fn step_buffers(&self, b: &Batch) -> Result<StepBuffers, GpuError> {
        let c = &self.c;
        let dev = &self.dev;
        let n = b.tokens.len();
        let (d, hd) = (c.d_model, c.head_dim);
        let mut embedded = self.embd.rows(&b.tokens)?;
        if let Some(scale) = self.recipe.embedding_scale {
            for v in &mut embedded {
                *v *= scale;
            }
        }
        // A token's `[q | k | v]` row (this rank's heads): Q and K rotated
        // in place, K and V stored from there, Q read by attention from
        // there.
        let (qd, kvd) = (self.heads * hd, self.kv_heads * hd);
        let qkv_width = qd + 2 * kvd;
        // Attention runs in groups of tokens whose scores fit the cap (a
        // long prompt's would not fit one buffer a device can bind).
        let heads = self.heads;
        let group = (self.scores_cap / (4 * heads * b.longest).max(1))
            .min(MAX_ATTENTION_CUBES / heads.max(1))
            .clamp(1, n);
        Ok(StepBuffers {
            n,
            longest: b.longest,
            group,
            x: dev.upload(&embedded),
            xn: dev.empty(n * d),
            positions: dev.upload(&b.positions),
            slots: dev.upload(&b.slots),
            meta: dev.upload(&b.meta),
            tables: dev.upload(&b.tables),
            qkv: dev.empty(n * qkv_width),
            kv_rows: KvRows {
                stride: qkv_width,
                k_at: qd,
                v_at: qd + kvd,
            },
            att: dev.empty(n * qd),
            gate_up: dev.empty(2 * n * self.ffn),
            h: dev.empty(n * self.ffn),
            o: dev.empty(n * d),
            ffn_out: dev.empty(n * d),
            scores: dev.empty(group * heads * b.longest),
        })
    }

    /// Layer `li`'s attention from the normed hidden states `s.xn` to its
    /// output projection (this rank's share of it) in `s.o`: Q, K and V
    /// (biases added, Q and K normed and rotated as the recipe says), K
    /// and V into the pool's layer `kv`, attention over each token's
    /// context (its window, on a sliding layer).
    fn attention_half(&self, li: usize, kv: &Buffer<u32>, s: &StepBuffers) -> Result<(), GpuError> {
        let (c, dev) = (&self.c, &self.dev);
        let (l, r) = (&self.layers[li], &self.recipe.layers[li]);
        let hd = c.head_dim;
        let qkv_width = s.kv_rows.stride;
        l.wqkv.matmul(dev, &s.xn, &s.qkv)?;
        if let Some(b) = &l.qkv_bias {
            kernels::add_bias(dev, &s.qkv, b)?;
        }
        if let Some([qn, kn]) = &l.qk_norm {
            let (hq, hk) = (self.heads, self.kv_heads);
            kernels::head_rms_norm(dev, &s.qkv, qkv_width, hq, hk, qn, kn, c.rms_eps)?;
        }
        kernels::rope(
            dev,
            &s.qkv,
            &s.positions,
            &self.rope_tables[r.rope],
            s.kv_rows.v_at,
            qkv_width,
            hd,
            self.recipe.rope_dims / 2,
            self.recipe.rope_style == RopeStyle::Neox,
        )?;
        let layer_layout = self.layer_layout();
        kernels::kv_write(dev, &s.qkv, s.kv_rows, kv, &layer_layout, 0, &s.slots)?;
        for first in (0..s.n).step_by(s.group) {
            kernels::attention(
                dev,
                &s.qkv,
                qkv_width,
                kv,
                &layer_layout,
                0,
                self.heads,
                &s.tables,
                &s.meta,
                first..(first + s.group).min(s.n),
                s.longest,
                self.recipe.attn_scale,
                r.window,
                &s.scores,
                &s.att,
            )?;
        }
        l.wo.matmul(dev, &s.att, &s.o)
    }

    /// Layer `l`'s FFN from the normed `s.xn` to this rank's share of its
    /// output in `s.ffn_out`.
    fn ffn_half(
        &self,
        l: &Layer,
        s: &StepBuffers,
        moe_scratch: &mut Option<MoeScratch>,
    ) -> Result<(), GpuError> {
        let dev = &self.dev;
        let act = self.recipe.activation;
        match &l.ffn {
            Ffn::Dense { gate_up: w, down } => {
                w.matmul(dev, &s.xn, &s.gate_up)?;
                kernels::glu(dev, &s.gate_up, self.ffn, act, &s.h)?;
                down.matmul(dev, &s.h, &s.ffn_out)
            }
            Ffn::Moe(m) => m.forward(
                dev,
                &s.xn,
                (s.n, self.c.d_model),
                moe_scratch,
                (&s.gate_up, &s.h),
                (self.ffn, act),
                &s.ffn_out,
            ),
        }
    }

    /// The logits of the rows `want` of the final normed hidden states
    /// `xn`, soft-capped as the recipe says.
    fn logits(&self, want: &[u32], xn: Buffer) -> Result<Buffer, GpuError> {
        let (c, dev) = (&self.c, &self.dev);
        let d = c.d_model;
        // A decode batch wants every row, in order: no gather.
        let rows = if want.len() * d == xn.len() {
            xn
        } else {
            let rows = dev.empty(want.len() * d);
            kernels::gather_rows(dev, &xn, &dev.upload(want), d, &rows)?;
            rows
        };
        let logits = dev.empty(want.len() * c.vocab_size);
        self.head.matmul(dev, &rows, &logits)?;
        if let Some(cap) = self.recipe.final_logit_softcap {
            kernels::softcap(dev, &logits, cap)?;
        }
        Ok(logits)
    }

    /// Adds `buf` across the ranks of `comm` in place, through host memory
    /// (nothing to do for the whole model). After a device failure
    /// (`failed`) this rank contributes zeros and keeps the failure; a
    /// failed collective ends the step on every rank at once.
    fn all_reduce(
        &self,
        comm: Option<&dyn Communicator>,
        buf: &Buffer,
        failed: &mut Option<GpuError>,
        met: &mut usize,
    ) -> Result<(), GpuError> {
        let Some(comm) = comm else {
            return Ok(());
        };
        let mut host = match failed {
            None => self.dev.download(buf).unwrap_or_else(|e| {
                *failed = Some(e);
                vec![0.0; buf.len()]
            }),
            Some(_) => vec![0.0; buf.len()],
        };
        comm.all_reduce_sum(&mut host)?;
        *met += 1;
        if failed.is_none()
            && let Err(e) = self.dev.write_at(buf, 0, &host)
        {
            *failed = Some(e);
        }
        Ok(())
    }
}

impl GpuLlama {
    /// Uploads the model's weights to `dev`, with room for `max_ctx` positions.
    pub fn load(dev: GpuDevice, files: &ModelFiles, max_ctx: usize) -> Result<GpuLlama, GpuError> {
        let model = GpuModel::load(dev, files, max_ctx, BLOCK_SIZE)?;
        let blocks = max_ctx.div_ceil(BLOCK_SIZE);
        Ok(GpuLlama {
            pool: model.new_pool(blocks)?,
            // Below max_ctx, which fits 32 bits (checked by the load).
            table: (0..blocks as u32).collect(),
            next: model.dev.empty(1),
            model,
        })
    }

    /// The device it runs on.
    pub fn device(&self) -> &GpuDevice {
        &self.model.dev
    }

    /// Runs `tokens` at positions `start_pos..` in one forward pass (every
    /// earlier position of the sequence must have run) and returns the
    /// last one's logits, or nothing when `want_logits` is false.
    pub fn forward(
        &self,
        tokens: &[u32],
        start_pos: usize,
        want_logits: bool,
    ) -> Result<Vec<f32>, GpuError> {
        let chunk = Chunk {
            tokens,
            start_pos,
            blocks: &self.table,
            want_logits,
        };
        match self.model.forward(&self.pool, &[chunk])? {
            Some(logits) => self.model.dev.download(&logits),
            None => Ok(Vec::new()),
        }
    }

    /// Runs `token` at position `pos` and samples the next token greedily
    /// on the device: only the chosen token comes back.
    pub fn step_greedy(&self, token: u32, pos: usize) -> Result<u32, GpuError> {
        let chunk = Chunk {
            tokens: &[token],
            start_pos: pos,
            blocks: &self.table,
            want_logits: true,
        };
        let logits = self
            .model
            .forward(&self.pool, &[chunk])?
            .ok_or_else(no_logits)?;
        let dev = &self.model.dev;
        kernels::argmax(dev, &logits, self.model.c.vocab_size, &self.next)?;
        let next = dev.download(&self.next)?;
        next.first().copied().ok_or_else(no_logits)
    }
}

/// A step's chunks flattened: per token its id, its position, its KV slot
/// (block id, row in block) and what it attends to (positions seen,
/// offset of its table); the chunks' block tables end to end; the token
/// rows whose logits are wanted; the longest context.
#[derive(Default)]
struct Batch {
    tokens: Vec<u32>,
    positions: Vec<u32>,
    slots: Vec<u32>,
    meta: Vec<u32>,
    tables: Vec<u32>,
    want: Vec<u32>,
    longest: usize,
}

/// A step's inputs and activations on the device: `n` tokens, attention
/// run `group` tokens at a time over up to `longest` positions.
struct StepBuffers {
    n: usize,
    longest: usize,
    group: usize,
    x: Buffer,
    xn: Buffer,
    positions: Buffer<u32>,
    slots: Buffer<u32>,
    meta: Buffer<u32>,
    tables: Buffer<u32>,
    qkv: Buffer,
    kv_rows: KvRows,
    att: Buffer,
    gate_up: Buffer,
    h: Buffer,
    o: Buffer,
    ffn_out: Buffer,
    scores: Buffer,
}

/// Runs `run` unless an earlier stage of the step failed; keeps its error.
fn stage(failed: &mut Option<GpuError>, run: impl FnOnce() -> Result<(), GpuError>) {
    if failed.is_none()
        && let Err(e) = run()
    {
        *failed = Some(e);
    }
}

fn no_logits() -> GpuError {
    GpuError::Device {
        kernel: "step",
        message: "no result".into(),
    }
}

impl SequenceModel for GpuLlama {
    fn forward(
        &mut self,
        tokens: &[u32],
        start_pos: usize,
        want_logits: bool,
    ) -> Result<Vec<f32>, RequestError> {
        GpuLlama::forward(self, tokens, start_pos, want_logits)
            .map_err(|e| RequestError::Device(Box::new(e)))
    }
}
