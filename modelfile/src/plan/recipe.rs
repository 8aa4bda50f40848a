//! A family's layer recipe, derived once from the config: what each layer
//! does beyond Llama's (Q/K/V biases, per-head Q/K norms, post norms, its
//! attention window and RoPE) and the model-wide switches (embedding
//! scale, activation, logit soft-capping). The CPU engine's forward pass
//! and the GPU's step read it rather than re-deriving the family's
//! switches, so a family's differences are written here once.

use tandem_kernels::ops::{Rope, RopeStyle};

use crate::arch::Activation;
use crate::config::ModelConfig;

/// What one layer does.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerRecipe {
    /// Q, K and V biases added after the projection (Qwen2).
    pub qkv_bias: bool,
    /// Per-head RMS norms of Q and K before RoPE (Gemma 3).
    pub qk_norm: bool,
    /// RMS norms of the attention and FFN outputs before their residual
    /// adds (Gemma 2/3).
    pub post_norms: bool,
    /// A query at position `p` sees keys at `p - window + 1 ..= p`; `None`:
    /// its whole context.
    pub window: Option<usize>,
    /// Which of [`Recipe::ropes`] rotates this layer's Q and K.
    pub rope: usize,
    /// A mixture-of-experts FFN.
    pub moe: bool,
}

/// The forward pass's recipe for one model.
#[derive(Clone, Debug)]
pub struct Recipe {
    pub layers: Vec<LayerRecipe>,
    /// The distinct RoPEs the layers use (a global base, and a sliding
    /// layers' base where they have their own).
    pub ropes: Vec<Rope>,
    /// RoPE bases of [`Recipe::ropes`], in the same order.
    pub rope_bases: Vec<f32>,
    pub rope_style: RopeStyle,
    pub rope_dims: usize,
    /// Token embeddings are multiplied by this (Gemma: `sqrt(d_model)`).
    pub embedding_scale: Option<f32>,
    /// The gated FFN's activation.
    pub activation: Activation,
    /// `logits = cap * tanh(logits / cap)` on the output (Gemma 2).
    pub final_logit_softcap: Option<f32>,
    /// Attention scores are `q . k * attn_scale`.
    pub attn_scale: f32,
    pub rms_eps: f32,
}

impl Recipe {
    pub fn new(c: &ModelConfig) -> Recipe {
        let f = c.family;
        let mut rope_bases: Vec<f32> = Vec::new();
        let layers = (0..c.n_layers)
            .map(|i| {
                let theta = c.layer_rope_theta(i);
                let rope = match rope_bases.iter().position(|&t| t == theta) {
                    Some(k) => k,
                    None => {
                        rope_bases.push(theta);
                        rope_bases.len() - 1
                    }
                };
                LayerRecipe {
                    qkv_bias: f.qkv_bias,
                    qk_norm: f.qk_norm,
                    post_norms: f.post_norms,
                    window: c.layer_window(i),
                    rope,
                    moe: c.moe.is_some(),
                }
            })
            .collect();
        Recipe {
            layers,
            ropes: rope_bases
                .iter()
                .map(|&t| Rope::new(c.rope_style, c.rope_dims, t))
                .collect(),
            rope_bases,
            rope_style: c.rope_style,
            rope_dims: c.rope_dims,
            embedding_scale: c.embedding_scale(),
            activation: f.activation,
            final_logit_softcap: c.final_logit_softcap,
            attn_scale: 1.0 / (c.head_dim as f32).sqrt(),
            rms_eps: c.rms_eps,
        }
    }

    /// Layer `i`'s RoPE.
    pub fn rope(&self, i: usize) -> &Rope {
        &self.ropes[self.layers[i].rope]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SlidingWindow;

    #[test]
    fn sliding_layers_get_their_window_and_their_own_rope() {
        let mut c = ModelConfig::from_hf_json(
            r#"{"architectures":["LlamaForCausalLM"],"hidden_size":576,
            "intermediate_size":1536,"num_attention_heads":9,"num_hidden_layers":12,
            "num_key_value_heads":3,"vocab_size":49152,"rms_norm_eps":1e-5,
            "rope_theta":100000.0,"max_position_embeddings":8192,"rope_scaling":null}"#,
        )
        .expect("valid");
        let r = Recipe::new(&c);
        assert_eq!(r.rope_bases, [100_000.0]);
        assert!(r.layers.iter().all(|l| l.window.is_none() && l.rope == 0));
        assert_eq!(r.embedding_scale, None);
        assert_eq!(r.attn_scale, 0.125);
        c.sliding = Some(SlidingWindow {
            size: 512,
            period: 6,
            rope_theta: 10_000.0,
        });
        let r = Recipe::new(&c);
        assert_eq!(r.rope_bases, [10_000.0, 100_000.0]);
        let global: Vec<usize> = (0..12).filter(|&i| r.layers[i].window.is_none()).collect();
        assert_eq!(global, [5, 11]);
        assert!(global.iter().all(|&i| r.layers[i].rope == 1));
        assert_eq!(r.layers[0].window, Some(512));
        assert_eq!(r.layers[0].rope, 0);
    }
}
