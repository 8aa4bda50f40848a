//! Every tensor's name, in GGUF's and in HF's spelling, written once: a
//! [`TensorId`] says which tensor (the embeddings, a layer's part, an
//! expert's matrix), [`TensorId::name`] spells it for a file format and a
//! family, and [`TensorId::from_gguf`] reads GGUF's spelling back (the GPU
//! loader asks for tensors by GGUF's names, whatever the file).
//!
//! GGUF names are llama.cpp's, the same for every family. HF names differ
//! by family ([`HfNaming`]): Gemma's `post_attention_layernorm` is the norm
//! of the attention output, Llama's the norm before the FFN.

use crate::arch::Family;

/// The file format whose names are wanted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Gguf,
    Hf,
}

/// How a family's HF checkpoints name a layer's parts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HfNaming {
    /// `LlamaForCausalLM`, `Qwen2ForCausalLM`, `MixtralForCausalLM`.
    Llama,
    /// Gemma 2/3: Q/K norms, and four norms a layer.
    Gemma,
}

/// One part of a decoder layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    AttnNorm,
    AttnQ,
    AttnK,
    AttnV,
    AttnOutput,
    /// Per-head norms of Q and K (Gemma 3).
    AttnQNorm,
    AttnKNorm,
    /// The attention output's norm before its residual add (Gemma).
    PostAttnNorm,
    FfnNorm,
    FfnGate,
    FfnUp,
    FfnDown,
    /// The FFN output's norm before its residual add (Gemma).
    PostFfnNorm,
    /// A mixture of experts' router.
    Router,
    /// Its per-expert selection bias (DeepSeek-V3 routing).
    RouterBias,
    /// Expert `j`'s gate, up and down projections.
    ExpertGate(usize),
    ExpertUp(usize),
    ExpertDown(usize),
}

/// A layer part's weight or its bias.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Weight,
    Bias,
}

/// One tensor of a decoder model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorId {
    Embeddings,
    OutputNorm,
    /// The output head (absent when tied to the embeddings).
    Output,
    Layer {
        layer: usize,
        part: Part,
        kind: Kind,
    },
}

/// The parts without an expert index, for reading names back.
const PARTS: [Part; 15] = [
    Part::AttnNorm,
    Part::AttnQ,
    Part::AttnK,
    Part::AttnV,
    Part::AttnOutput,
    Part::AttnQNorm,
    Part::AttnKNorm,
    Part::PostAttnNorm,
    Part::FfnNorm,
    Part::FfnGate,
    Part::FfnUp,
    Part::FfnDown,
    Part::PostFfnNorm,
    Part::Router,
    Part::RouterBias,
];

/// GGUF's stem of a part (`blk.{i}.{stem}.{weight|bias}`). Experts are
/// `ffn_{gate,up,down}.{j}`: GGUF stacks them in one tensor, so these
/// per-expert names are the loaders' own.
fn gguf_stem(part: Part) -> String {
    let s = match part {
        Part::AttnNorm => "attn_norm",
        Part::AttnQ => "attn_q",
        Part::AttnK => "attn_k",
        Part::AttnV => "attn_v",
        Part::AttnOutput => "attn_output",
        Part::AttnQNorm => "attn_q_norm",
        Part::AttnKNorm => "attn_k_norm",
        Part::PostAttnNorm => "post_attention_norm",
        Part::FfnNorm => "ffn_norm",
        Part::FfnGate => "ffn_gate",
        Part::FfnUp => "ffn_up",
        Part::FfnDown => "ffn_down",
        Part::PostFfnNorm => "post_ffw_norm",
        Part::Router => "ffn_gate_inp",
        Part::RouterBias => "exp_probs_b",
        Part::ExpertGate(j) => return format!("ffn_gate.{j}"),
        Part::ExpertUp(j) => return format!("ffn_up.{j}"),
        Part::ExpertDown(j) => return format!("ffn_down.{j}"),
    };
    s.to_string()
}

/// HF's name of a layer part under `model.layers.{i}.`, without the
/// `.weight` / `.bias` suffix where `suffixed` (the router's selection
/// bias is a bare parameter); `None` where the family has no such part.
fn hf_stem(naming: HfNaming, part: Part) -> Option<(String, bool)> {
    let s = match (naming, part) {
        (_, Part::AttnNorm) => "input_layernorm",
        (_, Part::AttnQ) => "self_attn.q_proj",
        (_, Part::AttnK) => "self_attn.k_proj",
        (_, Part::AttnV) => "self_attn.v_proj",
        (_, Part::AttnOutput) => "self_attn.o_proj",
        (_, Part::FfnGate) => "mlp.gate_proj",
        (_, Part::FfnUp) => "mlp.up_proj",
        (_, Part::FfnDown) => "mlp.down_proj",
        (HfNaming::Llama, Part::FfnNorm) => "post_attention_layernorm",
        (HfNaming::Llama, Part::Router) => "block_sparse_moe.gate",
        (HfNaming::Llama, Part::RouterBias) => {
            return Some((
                "block_sparse_moe.gate.e_score_correction_bias".into(),
                false,
            ));
        }
        (HfNaming::Llama, Part::ExpertGate(j)) => return expert(j, "w1"),
        (HfNaming::Llama, Part::ExpertUp(j)) => return expert(j, "w3"),
        (HfNaming::Llama, Part::ExpertDown(j)) => return expert(j, "w2"),
        (HfNaming::Gemma, Part::AttnQNorm) => "self_attn.q_norm",
        (HfNaming::Gemma, Part::AttnKNorm) => "self_attn.k_norm",
        (HfNaming::Gemma, Part::PostAttnNorm) => "post_attention_layernorm",
        (HfNaming::Gemma, Part::FfnNorm) => "pre_feedforward_layernorm",
        (HfNaming::Gemma, Part::PostFfnNorm) => "post_feedforward_layernorm",
        _ => return None,
    };
    Some((s.to_string(), true))
}

fn expert(j: usize, w: &str) -> Option<(String, bool)> {
    Some((format!("block_sparse_moe.experts.{j}.{w}"), true))
}

impl Kind {
    fn suffix(self) -> &'static str {
        match self {
            Kind::Weight => "weight",
            Kind::Bias => "bias",
        }
    }
}

impl TensorId {
    /// Layer `layer`'s `part`, its weight.
    pub fn weight(layer: usize, part: Part) -> TensorId {
        TensorId::Layer {
            layer,
            part,
            kind: Kind::Weight,
        }
    }

    /// Layer `layer`'s `part`, its bias.
    pub fn bias(layer: usize, part: Part) -> TensorId {
        TensorId::Layer {
            layer,
            part,
            kind: Kind::Bias,
        }
    }

    /// The tensor's name in `format`'s files of `family`; `None` where
    /// that format has no such tensor for the family.
    pub fn name(self, format: Format, family: &Family) -> Option<String> {
        match format {
            Format::Gguf => Some(self.gguf()),
            Format::Hf => self.hf(family.hf_naming),
        }
    }

    /// GGUF's name (the same for every family).
    pub fn gguf(self) -> String {
        match self {
            TensorId::Embeddings => "token_embd.weight".into(),
            TensorId::OutputNorm => "output_norm.weight".into(),
            TensorId::Output => "output.weight".into(),
            TensorId::Layer {
                layer: i,
                part: Part::RouterBias,
                ..
            } => format!("blk.{i}.exp_probs_b.bias"),
            TensorId::Layer { layer, part, kind } => {
                format!("blk.{layer}.{}.{}", gguf_stem(part), kind.suffix())
            }
        }
    }

    /// HF's name under `naming`.
    pub fn hf(self, naming: HfNaming) -> Option<String> {
        match self {
            TensorId::Embeddings => Some("model.embed_tokens.weight".into()),
            TensorId::OutputNorm => Some("model.norm.weight".into()),
            TensorId::Output => Some("lm_head.weight".into()),
            TensorId::Layer { layer, part, kind } => {
                let (stem, suffixed) = hf_stem(naming, part)?;
                Some(match suffixed {
                    true => format!("model.layers.{layer}.{stem}.{}", kind.suffix()),
                    false => format!("model.layers.{layer}.{stem}"),
                })
            }
        }
    }

    /// The tensor GGUF's `name` names, if it is one of a decoder's.
    pub fn from_gguf(name: &str) -> Option<TensorId> {
        let global = [TensorId::Embeddings, TensorId::OutputNorm, TensorId::Output];
        if let Some(g) = global.into_iter().find(|g| g.gguf() == name) {
            return Some(g);
        }
        let (layer, rest) = name.strip_prefix("blk.")?.split_once('.')?;
        let layer: usize = layer.parse().ok()?;
        let (stem, kind) = rest.rsplit_once('.')?;
        let kind = match kind {
            "weight" => Kind::Weight,
            "bias" => Kind::Bias,
            _ => return None,
        };
        let part = match stem.split_once('.') {
            Some((m, j)) => {
                let j: usize = j.parse().ok()?;
                match m {
                    "ffn_gate" => Part::ExpertGate(j),
                    "ffn_up" => Part::ExpertUp(j),
                    "ffn_down" => Part::ExpertDown(j),
                    _ => return None,
                }
            }
            None => *PARTS.iter().find(|&&p| gguf_stem(p) == stem)?,
        };
        let id = TensorId::Layer { layer, part, kind };
        // Spelled back exactly (the router bias is a bias, nothing else).
        (id.gguf() == name).then_some(id)
    }
}

/// The HF name, in `family`'s checkpoints, of the tensor GGUF calls `gguf`.
pub fn hf_name(family: &Family, gguf: &str) -> Option<String> {
    TensorId::from_gguf(gguf)?.hf(family.hf_naming)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::{GEMMA3, LLAMA, MIXTRAL, QWEN2};

    #[test]
    fn gguf_names_map_to_hf_names() {
        let hf = |f: &Family, g: &str| hf_name(f, g);
        assert_eq!(
            hf(&QWEN2, "blk.12.attn_q.bias").as_deref(),
            Some("model.layers.12.self_attn.q_proj.bias")
        );
        assert_eq!(
            hf(&LLAMA, "blk.0.ffn_norm.weight").as_deref(),
            Some("model.layers.0.post_attention_layernorm.weight")
        );
        assert_eq!(
            hf(&LLAMA, "output.weight").as_deref(),
            Some("lm_head.weight")
        );
        assert_eq!(
            hf(&MIXTRAL, "blk.1.ffn_gate_inp.weight").as_deref(),
            Some("model.layers.1.block_sparse_moe.gate.weight")
        );
        assert_eq!(
            hf(&MIXTRAL, "blk.0.exp_probs_b.bias").as_deref(),
            Some("model.layers.0.block_sparse_moe.gate.e_score_correction_bias")
        );
        assert_eq!(
            hf(&MIXTRAL, "blk.2.ffn_down.7.weight").as_deref(),
            Some("model.layers.2.block_sparse_moe.experts.7.w2.weight")
        );
        // Gemma's norms are named for where they sit.
        assert_eq!(
            hf(&GEMMA3, "blk.3.ffn_norm.weight").as_deref(),
            Some("model.layers.3.pre_feedforward_layernorm.weight")
        );
        assert_eq!(
            hf(&GEMMA3, "blk.3.post_attention_norm.weight").as_deref(),
            Some("model.layers.3.post_attention_layernorm.weight")
        );
        assert_eq!(hf(&LLAMA, "blk.3.attn_q_norm.weight"), None);
        assert_eq!(hf(&LLAMA, "blk.2.ffn_down.x.weight"), None);
        assert_eq!(hf(&LLAMA, "blk.2.attn_q.3.weight"), None);
        for odd in [
            "blk.x.attn_q.weight",
            "blk.1.attn_q",
            "blk.1.nope.weight",
            "rope_freqs.weight",
            "blk.1.exp_probs_b.weight",
        ] {
            assert_eq!(hf(&LLAMA, odd), None, "{odd}");
        }
    }

    #[test]
    fn every_part_reads_back_from_its_gguf_name() {
        let all = PARTS.iter().copied().chain([
            Part::ExpertGate(3),
            Part::ExpertUp(0),
            Part::ExpertDown(11),
        ]);
        for part in all {
            for kind in [Kind::Weight, Kind::Bias] {
                let id = TensorId::Layer {
                    layer: 7,
                    part,
                    kind,
                };
                if part == Part::RouterBias && kind == Kind::Weight {
                    continue;
                }
                assert_eq!(TensorId::from_gguf(&id.gguf()), Some(id), "{id:?}");
            }
        }
        for g in [TensorId::Embeddings, TensorId::OutputNorm, TensorId::Output] {
            assert_eq!(TensorId::from_gguf(&g.gguf()), Some(g));
            assert!(g.name(Format::Hf, &LLAMA).is_some());
        }
    }
}
