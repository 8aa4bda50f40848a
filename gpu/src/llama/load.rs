//! Loading a [`GpuModel`], or one tensor-parallel rank's share of it, from
//! a model's tensors, each asked for by the name
//! `tandem_modelfile::plan::names` gives it: the checks the device needs,
//! the rank's share, each layer's stacked matrices, the head and the RoPE
//! tables.

use std::ops::Range;

use tandem_kernels::dequantize_row;
use tandem_kernels::ops::Rope;
use tandem_modelfile::config::{ModelConfig, MoeConfig, Scoring};
use tandem_modelfile::plan::recipe::Recipe;
use tandem_modelfile::plan::{Part, TensorId};

use super::{
    Embeddings, Ffn, GpuModel, Layer, MoeFfn, PART_BYTES, SCORES_CAP, Shard, Stacked, f32_tensor,
    unsupported,
};
use crate::device::{Buffer, GpuDevice};
use crate::error::GpuError;
use crate::kernels::{self, KvLayout, MoeRouting, QFormat, QMatrix};
use crate::weights::{ModelFiles, Tensors};

/// What one rank holds of the whole model.
struct Share {
    /// Query heads and KV heads.
    heads: usize,
    kv_heads: usize,
    /// Rows of the Q projection, and of K's and V's.
    q: Range<usize>,
    kv: Range<usize>,
    /// FFN units (every one under a mixture of experts).
    ffn: Range<usize>,
    /// Whole experts.
    experts: Range<usize>,
}

/// A stacked matrix's part: a tensor's name, its rows, and the rows of it
/// this rank takes.
type StackPart = (String, usize, Range<usize>);

/// Runs of one format of a [`Stacked`] being read: (format, rows, stored
/// bytes).
type Runs = Vec<(QFormat, usize, Vec<u8>)>;

/// Reads one rank's tensors onto a device.
struct Loader<'a> {
    dev: &'a GpuDevice,
    g: &'a dyn Tensors,
    c: &'a ModelConfig,
    share: Share,
}

fn name(layer: usize, part: Part) -> String {
    TensorId::weight(layer, part).gguf()
}

/// Refuses what the device's forward pass cannot run.
fn check_model(c: &ModelConfig, max_ctx: usize, block_size: usize) -> Result<(), GpuError> {
    match &c.moe {
        Some(m) if m.n_experts > kernels::MOE_MAX_EXPERTS => {
            return Err(unsupported(format!(
                "{} experts (at most {})",
                m.n_experts,
                kernels::MOE_MAX_EXPERTS
            )));
        }
        None if c.family.moe => {
            return Err(unsupported(
                "a mixture-of-experts family without its routing",
            ));
        }
        _ => {}
    }
    if c.rope_dims != c.head_dim || max_ctx == 0 || block_size == 0 {
        return Err(unsupported(
            "partial RoPE, an empty context or empty KV blocks",
        ));
    }
    if u32::try_from(max_ctx).is_err() || u32::try_from(c.vocab_size).is_err() {
        return Err(unsupported("contexts or vocabularies beyond 32 bits"));
    }
    Ok(())
}

/// Rank `shard`'s heads, rows, FFN units and experts, by the shard plan
/// every executor splits by (`tandem_modelfile::plan::shard`).
fn share(files: &ModelFiles, shard: Shard) -> Result<Share, GpuError> {
    let c = &files.config;
    let plan = Shard::plan(files, shard.world)?;
    let s = plan
        .rank(shard.rank)
        .ok_or_else(|| unsupported(format!("rank {} of {}", shard.rank, shard.world)))?;
    Ok(Share {
        heads: s.heads.len(),
        kv_heads: s.kv_heads.len(),
        q: s.q_rows,
        kv: s.kv_rows,
        // Experts are not cut: each rank holds whole ones.
        ffn: if c.moe.is_some() { 0..c.ffn_dim } else { s.ffn },
        experts: s.experts,
    })
}

impl Loader<'_> {
    /// Quantised matrices, rows `sel` of each `rows` x `cols` part, stacked
    /// in the order given, with columns `cols_sel` of each row (rows are
    /// independent, so a stacked matmul computes each matrix's rows bit
    /// for bit; a rank's columns must be whole blocks of the part's
    /// format).
    fn stacked(
        &self,
        parts: &[StackPart],
        cols: usize,
        cols_sel: Range<usize>,
    ) -> Result<Stacked, GpuError> {
        let mut runs = Runs::new();
        for part in parts {
            self.append_rows(&mut runs, part, cols, &cols_sel)?;
        }
        let mut out = Stacked {
            parts: Vec::with_capacity(runs.len()),
            rows: 0,
        };
        for (format, rows, bytes) in runs {
            let m = QMatrix::upload(self.dev, format, rows, cols_sel.len(), &bytes)?;
            out.parts.push((m, out.rows));
            out.rows += rows;
        }
        Ok(out)
    }

    /// Appends the selected rows and columns of one part to `runs`.
    fn append_rows(
        &self,
        runs: &mut Runs,
        (name, rows, sel): &StackPart,
        cols: usize,
        cols_sel: &Range<usize>,
    ) -> Result<(), GpuError> {
        let info = self.g.tensor(name)?;
        // A format the device has no decoder for (Q4_0, Q5_K, ...) runs as
        // F32, dequantised here row by row.
        let native = QFormat::of(info.ty);
        let format = native.unwrap_or(QFormat::F32);
        let bl = format.block_len();
        let stored_row = info.ty.row_bytes(cols);
        if info.n_elements != rows * cols || stored_row.is_none_or(|r| info.data.len() != rows * r)
        {
            return Err(unsupported(format!(
                "{name}: {} values in {} bytes are not {rows}x{cols} {:?}",
                info.n_elements,
                info.data.len(),
                info.ty
            )));
        }
        if !cols.is_multiple_of(bl)
            || !cols_sel.start.is_multiple_of(bl)
            || !cols_sel.end.is_multiple_of(bl)
        {
            return Err(unsupported(format!(
                "{name}: columns {cols_sel:?} of {cols} are not whole {format:?} blocks of {bl}"
            )));
        }
        let block = format.block_bytes();
        let (from, to) = (cols_sel.start / bl * block, cols_sel.end / bl * block);
        let (mut values, mut widened) = (vec![0.0f32; cols], Vec::new());
        let stored_rows = info.data.chunks_exact(stored_row.unwrap_or(1));
        for stored in stored_rows.take(sel.end).skip(sel.start) {
            let row = match native {
                Some(_) => stored,
                None => {
                    dequantize_row(info.ty, stored, &mut values)
                        .map_err(|e| unsupported(format!("{name}: {e}")))?;
                    widened.clear();
                    widened.extend(values.iter().flat_map(|v| v.to_le_bytes()));
                    &widened[..]
                }
            };
            // A new part where the format changes or the part is full (a
            // device binds a bounded range per buffer).
            let full = |r: &(QFormat, usize, Vec<u8>)| {
                r.0 != format || r.2.len() + (to - from) > PART_BYTES
            };
            if runs.last().is_none_or(full) {
                runs.push((format, 0, Vec::new()));
            }
            if let Some((_, run_rows, bytes)) = runs.last_mut() {
                bytes.extend_from_slice(&row[from..to]);
                *run_rows += 1;
            }
        }
        Ok(())
    }

    /// A vector tensor of `len` values, on the device.
    fn vector(&self, name: &str, len: usize) -> Result<Buffer, GpuError> {
        Ok(self.dev.upload(&f32_tensor(self.g, name, len)?))
    }

    /// Two of layer `i`'s vectors of `len` values.
    fn pair(&self, i: usize, parts: [Part; 2], len: usize) -> Result<[Buffer; 2], GpuError> {
        Ok([
            self.vector(&name(i, parts[0]), len)?,
            self.vector(&name(i, parts[1]), len)?,
        ])
    }

    /// This rank's rows of layer `i`'s Q, K and V biases, as `wqkv` stacks
    /// their weights.
    fn qkv_bias(&self, i: usize) -> Result<Buffer, GpuError> {
        let (c, s) = (self.c, &self.share);
        let b = |p: Part, n: usize, rows: &Range<usize>| -> Result<Vec<f32>, GpuError> {
            let all = f32_tensor(self.g, &TensorId::bias(i, p).gguf(), n)?;
            Ok(all[rows.clone()].to_vec())
        };
        let stacked = [
            b(Part::AttnQ, c.q_dim(), &s.q)?,
            b(Part::AttnK, c.kv_dim(), &s.kv)?,
            b(Part::AttnV, c.kv_dim(), &s.kv)?,
        ]
        .concat();
        Ok(self.dev.upload(&stacked))
    }

    fn layer(&self, i: usize) -> Result<Layer, GpuError> {
        let (c, s, f) = (self.c, &self.share, self.c.family);
        let (d, qd, kvd) = (c.d_model, c.q_dim(), c.kv_dim());
        let t = |p: Part| name(i, p);
        Ok(Layer {
            attn_norm: self.vector(&t(Part::AttnNorm), d)?,
            qkv_bias: f.qkv_bias.then(|| self.qkv_bias(i)).transpose()?,
            qk_norm: f
                .qk_norm
                .then(|| self.pair(i, [Part::AttnQNorm, Part::AttnKNorm], c.head_dim))
                .transpose()?,
            post_norms: f
                .post_norms
                .then(|| self.pair(i, [Part::PostAttnNorm, Part::PostFfnNorm], d))
                .transpose()?,
            wqkv: self.stacked(
                &[
                    (t(Part::AttnQ), qd, s.q.clone()),
                    (t(Part::AttnK), kvd, s.kv.clone()),
                    (t(Part::AttnV), kvd, s.kv.clone()),
                ],
                d,
                0..d,
            )?,
            wo: self.stacked(&[(t(Part::AttnOutput), d, 0..d)], qd, s.q.clone())?,
            ffn_norm: self.vector(&t(Part::FfnNorm), d)?,
            ffn: match &c.moe {
                None => self.dense_ffn(i)?,
                Some(m) => Ffn::Moe(self.moe_ffn(i, m)?),
            },
        })
    }

    /// Layer `i`'s gate and up rows and down columns of this rank's units.
    fn dense_ffn(&self, i: usize) -> Result<Ffn, GpuError> {
        let (c, units) = (self.c, &self.share.ffn);
        let d = c.d_model;
        Ok(Ffn::Dense {
            gate_up: self.stacked(
                &[
                    (name(i, Part::FfnGate), c.ffn_dim, units.clone()),
                    (name(i, Part::FfnUp), c.ffn_dim, units.clone()),
                ],
                d,
                0..d,
            )?,
            down: self.stacked(
                &[(name(i, Part::FfnDown), d, 0..d)],
                c.ffn_dim,
                units.clone(),
            )?,
        })
    }

    /// Expert `j` of layer `i`: its gate and up rows, its down projection.
    fn expert(&self, i: usize, j: usize) -> Result<(Stacked, Stacked), GpuError> {
        let (d, f) = (self.c.d_model, self.c.ffn_dim);
        Ok((
            self.stacked(
                &[
                    (name(i, Part::ExpertGate(j)), f, 0..f),
                    (name(i, Part::ExpertUp(j)), f, 0..f),
                ],
                d,
                0..d,
            )?,
            self.stacked(&[(name(i, Part::ExpertDown(j)), d, 0..d)], f, 0..f)?,
        ))
    }

    /// Layer `i`'s router and this rank's experts.
    fn moe_ffn(&self, i: usize, m: &MoeConfig) -> Result<MoeFfn, GpuError> {
        let (d, e) = (self.c.d_model, m.n_experts);
        let bias_name = TensorId::bias(i, Part::RouterBias).gguf();
        let bias = if self.g.contains(&bias_name) {
            f32_tensor(self.g, &bias_name, e)?
        } else {
            vec![0.0; e]
        };
        let experts = self.share.experts.clone();
        Ok(MoeFfn {
            first_expert: experts.start,
            routing: MoeRouting {
                experts: e,
                top_k: m.top_k,
                sigmoid: m.scoring == Scoring::Sigmoid,
                norm: m.norm_topk_prob,
                scaling: m.routed_scaling,
            },
            router: self.stacked(&[(name(i, Part::Router), e, 0..e)], d, 0..d)?,
            bias: self.dev.upload(&bias),
            experts: experts
                .map(|j| self.expert(i, j))
                .collect::<Result<_, _>>()?,
        })
    }

    /// The output head, or the embeddings when tied: quantised as stored
    /// where the device reads the format, else f32.
    fn head(&self) -> Result<Stacked, GpuError> {
        let (d, vocab) = (self.c.d_model, self.c.vocab_size);
        let output = TensorId::Output.gguf();
        let name = match self.g.contains(&output) {
            true => output,
            false => TensorId::Embeddings.gguf(),
        };
        self.stacked(&[(name, vocab, 0..vocab)], d, 0..d)
    }

    /// The CPU's angles of `rope`, `(sin, cos)` for every position and
    /// rotated pair.
    fn sin_cos(&self, rope: &Rope, max_ctx: usize) -> Buffer {
        let table: Vec<f32> = (0..max_ctx)
            .flat_map(|p| {
                let a = rope.angles(p);
                a.sin_cos()
                    .iter()
                    .flat_map(|&(s, c)| [s, c])
                    .collect::<Vec<_>>()
            })
            .collect();
        self.dev.upload(&table)
    }
}

impl GpuModel {
    /// Uploads `shard`'s part of the model's weights to `dev` (the whole
    /// of the norms, embeddings and head, which every rank applies to the
    /// whole hidden state).
    pub fn load_shard(
        dev: GpuDevice,
        files: &ModelFiles,
        max_ctx: usize,
        block_size: usize,
        shard: Shard,
    ) -> Result<GpuModel, GpuError> {
        let c = files.config.clone();
        let g = files.tensors.as_ref();
        check_model(&c, max_ctx, block_size)?;
        let loader = Loader {
            dev: &dev,
            g,
            c: &c,
            share: share(files, shard)?,
        };
        let layers = (0..c.n_layers)
            .map(|i| loader.layer(i))
            .collect::<Result<Vec<_>, _>>()?;
        let embd = Embeddings::load(g, c.vocab_size, c.d_model)?;
        let head = loader.head()?;
        let out_norm = loader.vector(&TensorId::OutputNorm.gguf(), c.d_model)?;
        let recipe = Recipe::new(&c);
        let rope_tables = recipe
            .ropes
            .iter()
            .map(|r| loader.sin_cos(r, max_ctx))
            .collect();
        let Share {
            heads,
            kv_heads,
            ffn,
            ..
        } = loader.share;
        let layout = KvLayout {
            n_layers: c.n_layers,
            n_kv_heads: kv_heads,
            head_dim: c.head_dim,
            block_size,
        };
        Ok(GpuModel {
            recipe,
            rope_tables,
            dev,
            c,
            shard,
            heads,
            kv_heads,
            ffn: ffn.len(),
            layers,
            embd,
            head,
            out_norm,
            layout,
            max_ctx,
            scores_cap: SCORES_CAP,
        })
    }
}
