//! A Llama-family forward pass on the device for one sequence, greedy:
//! SmolLM2's shape (GGUF Q4_1 layer weights, tied Q8_0 or f32 embeddings,
//! no biases, no sliding windows). It is the kernels' first consumer and
//! the end-to-end check that they compose into the CPU model's results;
//! the engine's device backend (batches, the scheduler, dKV) is to run the
//! same kernels. Weights, the KV pool and activations stay on the device;
//! per step the host uploads the token's embedding row and position data
//! and reads back the logits.

use tandem_kernels::ops::{Rope, RopeStyle};
use tandem_kernels::{GgmlType, dequantize_row};
use tandem_modelfile::config::ModelConfig;
use tandem_modelfile::gguf::GgufFile;

use crate::device::{Buffer, GpuDevice};
use crate::error::GpuError;
use crate::kernels::{self, KvLayout};

/// KV rows per block of the device pool.
const BLOCK_SIZE: usize = 16;

struct Layer {
    attn_norm: Buffer,
    wq: Buffer<u32>,
    wk: Buffer<u32>,
    wv: Buffer<u32>,
    wo: Buffer<u32>,
    ffn_norm: Buffer,
    gate: Buffer<u32>,
    up: Buffer<u32>,
    down: Buffer<u32>,
}

/// One step's activations, allocated once (a step is one token).
struct Scratch {
    xn: Buffer,
    q: Buffer,
    k: Buffer,
    v: Buffer,
    att: Buffer,
    o: Buffer,
    gate: Buffer,
    up: Buffer,
    ffn_out: Buffer,
    scores: Buffer,
    logits: Buffer,
    next: Buffer<u32>,
}

/// A loaded model on a device, with a KV pool for one sequence of up to
/// `max_ctx` positions.
pub struct GpuLlama {
    dev: GpuDevice,
    c: ModelConfig,
    layers: Vec<Layer>,
    /// Host copy of the token embeddings (one row is uploaded per step).
    embd: Vec<f32>,
    /// The output head (the embeddings when tied), f32.
    head: Buffer,
    out_norm: Buffer,
    /// `(sin, cos)` per position and rotated pair: the CPU's angles.
    sin_cos: Buffer,
    pool: Buffer<u32>,
    layout: KvLayout,
    table: Buffer<u32>,
    max_ctx: usize,
    s: Scratch,
}

impl std::fmt::Debug for GpuLlama {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuLlama")
            .field("device", &self.dev)
            .field("layers", &self.layers.len())
            .field("max_ctx", &self.max_ctx)
            .finish_non_exhaustive()
    }
}

fn unsupported(what: impl Into<String>) -> GpuError {
    GpuError::UnsupportedModel(what.into())
}

/// A tensor's values as f32 (any type the CPU can dequantise).
fn f32_tensor(g: &GgufFile, name: &str, len: usize) -> Result<Vec<f32>, GpuError> {
    let info = g
        .tensor(name)
        .map_err(tandem_modelfile::error::ModelError::from)?;
    let data = g
        .tensor_data(name)
        .map_err(tandem_modelfile::error::ModelError::from)?;
    let row = usize::try_from(info.dims.first().copied().unwrap_or(0)).unwrap_or(0);
    if row == 0 || info.n_elements() != len as u64 {
        return Err(unsupported(format!(
            "{name} holds {} values, not {len}",
            info.n_elements()
        )));
    }
    let row_bytes = info
        .ty
        .row_bytes(row)
        .ok_or_else(|| unsupported(format!("{name}: rows of {row} are not whole blocks")))?;
    let mut out = vec![0.0f32; len];
    for (src, dst) in data.chunks_exact(row_bytes).zip(out.chunks_exact_mut(row)) {
        dequantize_row(info.ty, src, dst).map_err(|e| unsupported(format!("{name}: {e}")))?;
    }
    Ok(out)
}

impl GpuLlama {
    /// Uploads `g`'s weights to `dev`, with room for `max_ctx` positions.
    pub fn load(dev: GpuDevice, g: &GgufFile, max_ctx: usize) -> Result<GpuLlama, GpuError> {
        let c = ModelConfig::from_gguf(g)?;
        let f = c.family;
        if f.qkv_bias
            || f.qk_norm
            || f.post_norms
            || f.scale_embeddings
            || f.moe
            || c.moe.is_some()
            || c.sliding.is_some()
            || c.final_logit_softcap.is_some()
        {
            return Err(unsupported(
                "only Llama-like families (no biases, extra norms, MoE or sliding windows)",
            ));
        }
        if c.rope_dims != c.head_dim || max_ctx == 0 {
            return Err(unsupported("partial RoPE or an empty context"));
        }
        let (d, qd, kvd, ffn) = (c.d_model, c.q_dim(), c.kv_dim(), c.ffn_dim);
        let q4_1 = |name: String, rows: usize, cols: usize| -> Result<Buffer<u32>, GpuError> {
            let info = g
                .tensor(&name)
                .map_err(tandem_modelfile::error::ModelError::from)?;
            if info.ty != GgmlType::Q4_1 || info.n_elements() != (rows * cols) as u64 {
                return Err(unsupported(format!(
                    "{name} is {:?} of {} values; the GPU backend runs Q4_1 {rows}x{cols}",
                    info.ty,
                    info.n_elements()
                )));
            }
            let data = g
                .tensor_data(&name)
                .map_err(tandem_modelfile::error::ModelError::from)?;
            Ok(dev.upload_words(data))
        };
        let mut layers = Vec::with_capacity(c.n_layers);
        for i in 0..c.n_layers {
            let t = |s: &str| format!("blk.{i}.{s}.weight");
            layers.push(Layer {
                attn_norm: dev.upload(&f32_tensor(g, &t("attn_norm"), d)?),
                wq: q4_1(t("attn_q"), qd, d)?,
                wk: q4_1(t("attn_k"), kvd, d)?,
                wv: q4_1(t("attn_v"), kvd, d)?,
                wo: q4_1(t("attn_output"), d, qd)?,
                ffn_norm: dev.upload(&f32_tensor(g, &t("ffn_norm"), d)?),
                gate: q4_1(t("ffn_gate"), ffn, d)?,
                up: q4_1(t("ffn_up"), ffn, d)?,
                down: q4_1(t("ffn_down"), d, ffn)?,
            });
        }
        let embd = f32_tensor(g, "token_embd.weight", c.vocab_size * d)?;
        let head = if g.tensor("output.weight").is_ok() {
            dev.upload(&f32_tensor(g, "output.weight", c.vocab_size * d)?)
        } else {
            dev.upload(&embd)
        };
        let out_norm = dev.upload(&f32_tensor(g, "output_norm.weight", d)?);
        let rope = Rope::new(c.rope_style, c.rope_dims, c.rope_theta);
        let sin_cos: Vec<f32> = (0..max_ctx)
            .flat_map(|p| {
                let a = rope.angles(p);
                a.sin_cos()
                    .iter()
                    .flat_map(|&(s, c)| [s, c])
                    .collect::<Vec<_>>()
            })
            .collect();
        let layout = KvLayout {
            n_layers: c.n_layers,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
            block_size: BLOCK_SIZE,
        };
        let blocks = max_ctx.div_ceil(BLOCK_SIZE);
        let table: Vec<u32> = (0..blocks as u32).collect();
        let s = Scratch {
            xn: dev.zeros(d),
            q: dev.zeros(qd),
            k: dev.zeros(kvd),
            v: dev.zeros(kvd),
            att: dev.zeros(qd),
            o: dev.zeros(d),
            gate: dev.zeros(ffn),
            up: dev.zeros(ffn),
            ffn_out: dev.zeros(d),
            scores: dev.zeros(c.n_heads * max_ctx),
            logits: dev.zeros(c.vocab_size),
            next: dev.upload(&[0u32]),
        };
        Ok(GpuLlama {
            pool: dev.upload(&vec![0u32; blocks * layout.block_words()]),
            table: dev.upload(&table),
            sin_cos: dev.upload(&sin_cos),
            dev,
            c,
            layers,
            embd,
            head,
            out_norm,
            layout,
            max_ctx,
            s,
        })
    }

    /// The device it runs on.
    pub fn device(&self) -> &GpuDevice {
        &self.dev
    }

    /// Runs token `token` at position `pos` (every earlier position of the
    /// sequence must have run) and returns the next token's logits.
    pub fn step(&self, token: u32, pos: usize) -> Result<Vec<f32>, GpuError> {
        self.forward(token, pos)?;
        self.logits()?;
        self.dev.download(&self.s.logits)
    }

    /// Runs token `token` at position `pos` into the KV pool only: a
    /// prompt token whose logits nobody reads (no output head, no copy
    /// back).
    pub fn feed(&self, token: u32, pos: usize) -> Result<(), GpuError> {
        self.forward(token, pos)
    }

    /// [`GpuLlama::step`], sampling greedily on the device: only the chosen
    /// token comes back.
    pub fn step_greedy(&self, token: u32, pos: usize) -> Result<u32, GpuError> {
        self.forward(token, pos)?;
        self.logits()?;
        let s = &self.s;
        kernels::argmax(&self.dev, &s.logits, self.c.vocab_size, &s.next)?;
        let next = self.dev.download(&s.next)?;
        next.first().copied().ok_or(GpuError::Device {
            kernel: "argmax",
            message: "no result".into(),
        })
    }

    /// The forward pass of one token through the layers: its K and V go to
    /// the pool, its final hidden state, normalised for the output head,
    /// to `s.xn`. Each residual add runs with the norm after it.
    fn forward(&self, token: u32, pos: usize) -> Result<(), GpuError> {
        let c = &self.c;
        let (d, hd) = (c.d_model, c.head_dim);
        let t = token as usize;
        if t >= c.vocab_size || pos >= self.max_ctx {
            return Err(GpuError::Shape {
                kernel: "step",
                what: format!(
                    "token {token} of {} or position {pos} of {}",
                    c.vocab_size, self.max_ctx
                ),
            });
        }
        let dev = &self.dev;
        let s = &self.s;
        let x = dev.upload(&self.embd[t * d..(t + 1) * d]);
        let pos32 = pos as u32;
        let positions = dev.upload(&[pos32]);
        let slots = dev.upload(&[pos32 / BLOCK_SIZE as u32, pos32 % BLOCK_SIZE as u32]);
        let meta = dev.upload(&[pos32 + 1, 0]);
        let neox = c.rope_style == RopeStyle::Neox;
        let pairs = c.rope_dims / 2;
        let scale = 1.0 / (hd as f32).sqrt();
        if let Some(first) = self.layers.first() {
            kernels::rms_norm(dev, &x, &first.attn_norm, c.rms_eps, &s.xn)?;
        }
        for (li, l) in self.layers.iter().enumerate() {
            kernels::matmul_q4_1(dev, &s.xn, &l.wq, c.q_dim(), d, &s.q)?;
            kernels::matmul_q4_1(dev, &s.xn, &l.wk, c.kv_dim(), d, &s.k)?;
            kernels::matmul_q4_1(dev, &s.xn, &l.wv, c.kv_dim(), d, &s.v)?;
            let sc = &self.sin_cos;
            kernels::rope(dev, &s.q, &positions, sc, c.q_dim(), hd, pairs, neox)?;
            kernels::rope(dev, &s.k, &positions, sc, c.kv_dim(), hd, pairs, neox)?;
            kernels::kv_write(dev, &s.k, &s.v, &self.pool, &self.layout, li, &slots)?;
            kernels::attention(
                dev,
                &s.q,
                &self.pool,
                &self.layout,
                li,
                c.n_heads,
                &self.table,
                &meta,
                self.max_ctx,
                scale,
                &s.scores,
                &s.att,
            )?;
            kernels::matmul_q4_1(dev, &s.att, &l.wo, d, c.q_dim(), &s.o)?;
            kernels::add_rms_norm(dev, &x, &s.o, &l.ffn_norm, c.rms_eps, &s.xn)?;
            kernels::matmul_q4_1(dev, &s.xn, &l.gate, c.ffn_dim, d, &s.gate)?;
            kernels::matmul_q4_1(dev, &s.xn, &l.up, c.ffn_dim, d, &s.up)?;
            kernels::silu_mul(dev, &s.gate, &s.up)?;
            kernels::matmul_q4_1(dev, &s.gate, &l.down, d, c.ffn_dim, &s.ffn_out)?;
            let next_norm = self
                .layers
                .get(li + 1)
                .map_or(&self.out_norm, |n| &n.attn_norm);
            kernels::add_rms_norm(dev, &x, &s.ffn_out, next_norm, c.rms_eps, &s.xn)?;
        }
        if self.layers.is_empty() {
            kernels::rms_norm(dev, &x, &self.out_norm, c.rms_eps, &s.xn)?;
        }
        Ok(())
    }

    /// The output head over the normalised final state in `s.xn`, into
    /// `s.logits`.
    fn logits(&self) -> Result<(), GpuError> {
        let s = &self.s;
        kernels::matmul(&self.dev, &s.xn, &self.head, self.c.d_model, &s.logits)
    }
}
