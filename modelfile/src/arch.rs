//! The decoder families Tandem runs, as data: one [`Family`] per
//! architecture says how its layers differ from Llama's (biases, norms,
//! activation, RoPE pairing, sliding windows, embedding scale), so the
//! forward pass is one piece of code with a few well-named branches, and a
//! new family is a table entry plus whatever it needs that is really new.
//!
//! GGUF files name their family in `general.architecture`, HF directories
//! in `config.json`'s `architectures`; both map here.

use tandem_kernels::ops::RopeStyle;

use crate::error::ModelError;
use crate::plan::names::HfNaming;

/// The gated feed-forward's activation: `down(act(gate x) * up x)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// SwiGLU (Llama, Qwen2, Mixtral).
    Silu,
    /// GeGLU with the tanh approximation of GELU (Gemma).
    GeluTanh,
}

/// How a family lays out the layers of its sliding-window attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlidingLayers {
    /// Every layer attends to its whole context.
    None,
    /// Layer `i` is global when `(i + 1) % period == 0`, sliding otherwise
    /// (Gemma 3: five local layers, then one global; the period may be
    /// overridden by the file).
    Periodic { default_period: usize },
}

/// What distinguishes a decoder family from Llama.
#[derive(Debug, PartialEq)]
pub struct Family {
    /// The GGUF `general.architecture` value (also the metadata key prefix).
    pub gguf: Option<&'static str>,
    /// HF `config.json` `architectures` entries.
    pub hf: &'static [&'static str],
    /// How RoPE pairs dimensions in this family's GGUF tensors (Llama's
    /// converter permutes Q/K rows into adjacent pairs; most others keep
    /// HF's halves).
    pub gguf_rope: RopeStyle,
    /// Q, K and V projections carry biases (Qwen2).
    pub qkv_bias: bool,
    /// Per-head RMS norms of Q and K before RoPE (Gemma 3).
    pub qk_norm: bool,
    /// RMS norms on the attention and FFN outputs before each residual add
    /// (Gemma 2/3 "sandwich" norms).
    pub post_norms: bool,
    pub activation: Activation,
    /// Token embeddings are multiplied by `sqrt(d_model)` (Gemma).
    pub scale_embeddings: bool,
    /// Where sliding-window layers are.
    pub sliding: SlidingLayers,
    /// RoPE base of sliding layers when the file gives none (llama.cpp's
    /// default for Gemma 3).
    pub sliding_rope_theta: f32,
    /// A sparse mixture-of-experts FFN in every layer.
    pub moe: bool,
    /// How its HF checkpoints name a layer's tensors.
    pub hf_naming: HfNaming,
}

const LLAMA_LIKE: Family = Family {
    gguf: None,
    hf: &[],
    gguf_rope: RopeStyle::Interleaved,
    qkv_bias: false,
    qk_norm: false,
    post_norms: false,
    activation: Activation::Silu,
    scale_embeddings: false,
    sliding: SlidingLayers::None,
    sliding_rope_theta: 10_000.0,
    moe: false,
    hf_naming: HfNaming::Llama,
};

pub static LLAMA: Family = Family {
    gguf: Some("llama"),
    hf: &["LlamaForCausalLM"],
    ..LLAMA_LIKE
};

pub static MIXTRAL: Family = Family {
    gguf: None,
    hf: &["MixtralForCausalLM"],
    moe: true,
    ..LLAMA_LIKE
};

pub static QWEN2: Family = Family {
    gguf: Some("qwen2"),
    hf: &["Qwen2ForCausalLM"],
    gguf_rope: RopeStyle::Neox,
    qkv_bias: true,
    ..LLAMA_LIKE
};

pub static GEMMA3: Family = Family {
    gguf: Some("gemma3"),
    hf: &[],
    gguf_rope: RopeStyle::Neox,
    qk_norm: true,
    post_norms: true,
    activation: Activation::GeluTanh,
    scale_embeddings: true,
    sliding: SlidingLayers::Periodic { default_period: 6 },
    hf_naming: HfNaming::Gemma,
    ..LLAMA_LIKE
};

/// Every family Tandem runs.
pub static FAMILIES: &[&Family] = &[&LLAMA, &MIXTRAL, &QWEN2, &GEMMA3];

impl Family {
    /// The family's name for messages: its GGUF name, else its HF class.
    pub fn name(&self) -> &'static str {
        self.gguf
            .or_else(|| self.hf.first().copied())
            .unwrap_or("unnamed")
    }

    /// The family a GGUF `general.architecture` names.
    pub fn from_gguf(arch: &str) -> Result<&'static Family, ModelError> {
        FAMILIES
            .iter()
            .copied()
            .find(|f| f.gguf == Some(arch))
            .ok_or_else(|| unsupported(arch))
    }

    /// The family of an HF `config.json`'s `architectures` list.
    pub fn from_hf(archs: &[String]) -> Result<&'static Family, ModelError> {
        FAMILIES
            .iter()
            .copied()
            .find(|f| archs.iter().any(|a| f.hf.contains(&a.as_str())))
            .ok_or_else(|| unsupported(&archs.join(",")))
    }
}

fn unsupported(found: &str) -> ModelError {
    let gguf: Vec<&str> = FAMILIES.iter().filter_map(|f| f.gguf).collect();
    let hf: Vec<&str> = FAMILIES.iter().flat_map(|f| f.hf.iter().copied()).collect();
    ModelError::UnsupportedArchitecture {
        found: found.to_string(),
        supported: format!("GGUF {}; HF {}", gguf.join(", "), hf.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_both_ways_and_unknown_ones_list_the_supported() {
        assert_eq!(
            Family::from_gguf("qwen2").map(Family::name).ok(),
            Some("qwen2")
        );
        assert_eq!(
            Family::from_gguf("gemma3").map(|f| f.qk_norm).ok(),
            Some(true)
        );
        assert_eq!(
            Family::from_hf(&["MixtralForCausalLM".to_string()])
                .map(|f| f.moe)
                .ok(),
            Some(true)
        );
        let e = Family::from_gguf("phi3")
            .expect_err("unsupported")
            .to_string();
        for name in ["phi3", "llama", "qwen2", "gemma3", "LlamaForCausalLM"] {
            assert!(e.contains(name), "{e}");
        }
        // Every family is reachable by some name, and no name is taken twice.
        let mut names: Vec<&str> = FAMILIES
            .iter()
            .flat_map(|f| f.gguf.into_iter().chain(f.hf.iter().copied()))
            .collect();
        let n = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), n);
        assert!(
            FAMILIES
                .iter()
                .all(|f| f.gguf.is_some() || !f.hf.is_empty())
        );
    }
}
