//! Model hyper-parameters, read from GGUF metadata or an HF `config.json`,
//! validated once at load.

use serde::Deserialize;
use tandem_kernels::ops::RopeStyle;

use crate::arch::{Family, SlidingLayers};
use crate::error::ModelError;
use crate::gguf::GgufFile;

/// Hyper-parameters of a decoder: its [`Family`] plus the sizes and
/// constants its files give.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub family: &'static Family,
    pub n_layers: usize,
    pub d_model: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub ffn_dim: usize,
    pub vocab_size: usize,
    pub rope_theta: f32,
    pub rope_dims: usize,
    pub rope_style: RopeStyle,
    pub rms_eps: f32,
    /// Longest sequence the model was trained for (prompt + generation).
    pub context_length: usize,
    /// Sparse mixture-of-experts FFN in every layer (`ffn_dim` is then each
    /// expert's width); `None` for a dense model.
    pub moe: Option<MoeConfig>,
    /// Sliding-window attention on some layers; `None` when every layer
    /// sees its whole context.
    pub sliding: Option<SlidingWindow>,
    /// `logits = cap * tanh(logits / cap)` on the output (Gemma 2).
    pub final_logit_softcap: Option<f32>,
}

/// Which layers see only their last `size` positions, and their RoPE base.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SlidingWindow {
    /// A query at position `p` sees keys at `p - size + 1 ..= p`.
    pub size: usize,
    /// Layer `i` is global when `(i + 1) % period == 0`; 0: every layer slides.
    pub period: usize,
    pub rope_theta: f32,
}

impl ModelConfig {
    /// Reads a GGUF file's `general.architecture` and its `<arch>.*`
    /// hyper-parameters.
    pub fn from_gguf(g: &GgufFile) -> Result<Self, ModelError> {
        let arch = g.get_str("general.architecture")?;
        let family = Family::from_gguf(arch)?;
        let key = |k: &str| format!("{arch}.{k}");
        let u = |k: &str| g.get_u32(&key(k)).map(|v| v as usize);
        let n_heads = u("attention.head_count")?;
        let d_model = u("embedding_length")?;
        // Gemma 3's heads are wider than d_model / n_heads.
        let head_dim = match u("attention.key_length") {
            Ok(k) => k,
            Err(_) => d_model.checked_div(n_heads).unwrap_or(0),
        };
        if u("attention.value_length").is_ok_and(|v| v != head_dim) {
            return Err(ModelError::InvalidConfig(
                "attention key and value head sizes differ".into(),
            ));
        }
        let vocab_size = match u("vocab_size") {
            Ok(v) => v,
            Err(_) => g.get_str_array("tokenizer.ggml.tokens")?.len(),
        };
        if g.get(&key("attn_logit_softcapping")).is_some() {
            return Err(ModelError::InvalidConfig(
                "attention logit soft-capping (Gemma 2) is not supported".into(),
            ));
        }
        if let Some(t) = g.get(&key("rope.scaling.type"))
            && !matches!(t, crate::gguf::GgufValue::String(s) if s == "none")
        {
            return Err(ModelError::InvalidConfig(
                "RoPE scaling is not supported yet".into(),
            ));
        }
        let rope_theta = g.get_f32(&key("rope.freq_base")).unwrap_or(10_000.0);
        let sliding = match (family.sliding, u("attention.sliding_window")) {
            (SlidingLayers::Periodic { default_period }, Ok(size)) if size > 0 => {
                Some(SlidingWindow {
                    size,
                    period: u("attention.sliding_window_pattern").unwrap_or(default_period),
                    rope_theta: g
                        .get_f32(&key("rope.freq_base_swa"))
                        .unwrap_or(family.sliding_rope_theta),
                })
            }
            (SlidingLayers::None, Ok(size)) if size > 0 => {
                return Err(ModelError::InvalidConfig(format!(
                    "{arch}: sliding-window attention is not supported for this family"
                )));
            }
            _ => None,
        };
        let config = Self {
            family,
            n_layers: u("block_count")?,
            d_model,
            n_heads,
            n_kv_heads: u("attention.head_count_kv").unwrap_or(n_heads),
            head_dim,
            ffn_dim: u("feed_forward_length")?,
            vocab_size,
            rope_theta,
            rope_dims: u("rope.dimension_count").unwrap_or(head_dim),
            rope_style: family.gguf_rope,
            rms_eps: g.get_f32(&key("attention.layer_norm_rms_epsilon"))?,
            context_length: u("context_length")?,
            moe: None,
            sliding,
            final_logit_softcap: g
                .get_f32(&key("final_logit_softcapping"))
                .ok()
                .filter(|&c| c != 0.0),
        };
        config.validate()?;
        Ok(config)
    }

    /// The window of layer `layer`, if it slides.
    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        let s = self.sliding?;
        (s.period == 0 || !(layer + 1).is_multiple_of(s.period)).then_some(s.size)
    }

    /// The RoPE base of layer `layer`.
    pub fn layer_rope_theta(&self, layer: usize) -> f32 {
        match (self.layer_window(layer), self.sliding) {
            (Some(_), Some(s)) => s.rope_theta,
            _ => self.rope_theta,
        }
    }

    /// What token embeddings are multiplied by.
    pub fn embedding_scale(&self) -> Option<f32> {
        self.family
            .scale_embeddings
            .then(|| (self.d_model as f32).sqrt())
    }

    /// Reads an HF `config.json` of a `LlamaForCausalLM` or a
    /// `MixtralForCausalLM` (optionally with DeepSeek-style sigmoid routing:
    /// `scoring_func`, `norm_topk_prob`, `routed_scaling_factor`).
    pub fn from_hf_json(json: &str) -> Result<Self, ModelError> {
        #[derive(Deserialize)]
        struct Hf {
            architectures: Option<Vec<String>>,
            hidden_size: usize,
            intermediate_size: usize,
            num_attention_heads: usize,
            num_hidden_layers: usize,
            num_key_value_heads: Option<usize>,
            head_dim: Option<usize>,
            vocab_size: usize,
            rms_norm_eps: f32,
            rope_theta: Option<f32>,
            max_position_embeddings: usize,
            rope_scaling: Option<serde_json::Value>,
            sliding_window: Option<usize>,
            use_sliding_window: Option<bool>,
            num_local_experts: Option<usize>,
            num_experts_per_tok: Option<usize>,
            scoring_func: Option<String>,
            norm_topk_prob: Option<bool>,
            routed_scaling_factor: Option<f32>,
        }
        let hf: Hf = serde_json::from_str(json)
            .map_err(|e| ModelError::InvalidConfig(format!("config.json: {e}")))?;
        let archs = hf.architectures.unwrap_or_default();
        let family = Family::from_hf(&archs)?;
        let mixtral = family.moe;
        if hf.use_sliding_window != Some(false)
            && hf
                .sliding_window
                .is_some_and(|w| w < hf.max_position_embeddings)
        {
            return Err(ModelError::InvalidConfig(
                "config.json: sliding-window attention is not supported yet".into(),
            ));
        }
        let moe = if mixtral {
            let need = |v: Option<usize>, k: &str| {
                v.ok_or_else(|| ModelError::InvalidConfig(format!("config.json: {k} missing")))
            };
            let scoring = match hf.scoring_func.as_deref() {
                None | Some("softmax") => Scoring::Softmax,
                Some("sigmoid") => Scoring::Sigmoid,
                Some(other) => {
                    return Err(ModelError::InvalidConfig(format!(
                        "config.json: scoring_func {other:?} (expected softmax or sigmoid)"
                    )));
                }
            };
            Some(MoeConfig {
                n_experts: need(hf.num_local_experts, "num_local_experts")?,
                top_k: need(hf.num_experts_per_tok, "num_experts_per_tok")?,
                scoring,
                // Mixtral renormalises its top-k weights.
                norm_topk_prob: hf.norm_topk_prob.unwrap_or(true),
                routed_scaling: hf.routed_scaling_factor.unwrap_or(1.0),
            })
        } else {
            None
        };
        if hf.rope_scaling.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(ModelError::InvalidConfig(
                "config.json: rope_scaling is not supported yet".into(),
            ));
        }
        let head_dim = hf.head_dim.unwrap_or(
            hf.hidden_size
                .checked_div(hf.num_attention_heads)
                .unwrap_or(0),
        );
        let config = Self {
            family,
            n_layers: hf.num_hidden_layers,
            d_model: hf.hidden_size,
            n_heads: hf.num_attention_heads,
            n_kv_heads: hf.num_key_value_heads.unwrap_or(hf.num_attention_heads),
            head_dim,
            ffn_dim: hf.intermediate_size,
            vocab_size: hf.vocab_size,
            rope_theta: hf.rope_theta.unwrap_or(10_000.0),
            rope_dims: head_dim,
            rope_style: RopeStyle::Neox,
            rms_eps: hf.rms_norm_eps,
            context_length: hf.max_position_embeddings,
            moe,
            sliding: None,
            final_logit_softcap: None,
        };
        config.validate()?;
        Ok(config)
    }

    /// Rejects shapes the forward pass cannot run, with the offending value.
    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |m: String| Err(ModelError::InvalidConfig(m));
        if self.n_layers == 0 || self.d_model == 0 || self.ffn_dim == 0 || self.vocab_size == 0 {
            return bad(format!("zero-sized model dimension in {self:?}"));
        }
        if self.n_heads == 0
            || self.n_kv_heads == 0
            || !self.n_heads.is_multiple_of(self.n_kv_heads)
        {
            return bad(format!(
                "head_count {} must be a positive multiple of head_count_kv {}",
                self.n_heads, self.n_kv_heads
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) || self.head_dim > 512 {
            return bad(format!(
                "head_dim {} must be even and at most 512",
                self.head_dim
            ));
        }
        if self.rope_dims == 0
            || self.rope_dims > self.head_dim
            || !self.rope_dims.is_multiple_of(2)
        {
            return bad(format!(
                "rope dimension {} must be even and at most head_dim {}",
                self.rope_dims, self.head_dim
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return bad(format!("rope theta {} must be positive", self.rope_theta));
        }
        if !(self.rms_eps.is_finite() && self.rms_eps >= 0.0) {
            return bad(format!("rms epsilon {} must be non-negative", self.rms_eps));
        }
        if self.context_length == 0 {
            return bad("context length must be > 0".into());
        }
        if self.vocab_size > u32::MAX as usize {
            return bad(format!("vocab size {} too large", self.vocab_size));
        }
        if let Some(s) = &self.sliding
            && s.size == 0
        {
            return bad("sliding window of 0 positions".into());
        }
        if let Some(s) = &self.sliding
            && !(s.rope_theta.is_finite() && s.rope_theta > 0.0)
        {
            return bad(format!(
                "sliding-layer rope theta {} must be positive",
                s.rope_theta
            ));
        }
        if let Some(cap) = self.final_logit_softcap
            && !(cap.is_finite() && cap > 0.0)
        {
            return bad(format!("final logit soft-cap {cap} must be positive"));
        }
        if let Some(moe) = &self.moe {
            moe.validate()?;
        }
        Ok(())
    }

    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

/// How router scores become expert choices and weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scoring {
    /// Mixtral: softmax over all experts, top-k of the probabilities.
    Softmax,
    /// DeepSeek-V3: sigmoid per expert; top-k of score + correction bias,
    /// weighted by the unbiased scores.
    Sigmoid,
}

/// Routing hyper-parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    pub n_experts: usize,
    pub top_k: usize,
    pub scoring: Scoring,
    /// Divide the chosen weights by their sum.
    pub norm_topk_prob: bool,
    /// Multiplies the (normalised) weights.
    pub routed_scaling: f32,
}

impl MoeConfig {
    pub fn validate(&self) -> Result<(), ModelError> {
        if self.n_experts == 0 || self.top_k == 0 || self.top_k > self.n_experts {
            return Err(ModelError::InvalidConfig(format!(
                "mixture of experts: top-k {} of {} experts",
                self.top_k, self.n_experts
            )));
        }
        if !(self.routed_scaling.is_finite() && self.routed_scaling > 0.0) {
            return Err(ModelError::InvalidConfig(format!(
                "mixture of experts: routed scaling factor {} must be positive",
                self.routed_scaling
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMOL: &str = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":576,
        "intermediate_size":1536,"num_attention_heads":9,"num_hidden_layers":30,
        "num_key_value_heads":3,"vocab_size":49152,"rms_norm_eps":1e-5,
        "rope_theta":100000.0,"max_position_embeddings":8192,"rope_scaling":null}"#;

    #[test]
    fn sliding_layers_follow_the_period_and_use_their_own_rope_base() {
        let mut c = ModelConfig::from_hf_json(SMOL).expect("valid");
        assert_eq!(c.family.name(), "llama");
        assert_eq!(
            (c.layer_window(0), c.layer_rope_theta(0)),
            (None, 100_000.0)
        );
        // Gemma 3's layout: five sliding layers, then a global one.
        c.sliding = Some(SlidingWindow {
            size: 512,
            period: 6,
            rope_theta: 10_000.0,
        });
        let global: Vec<usize> = (0..18).filter(|&l| c.layer_window(l).is_none()).collect();
        assert_eq!(global, [5, 11, 17]);
        assert_eq!(c.layer_window(4), Some(512));
        assert_eq!(c.layer_rope_theta(4), 10_000.0);
        assert_eq!(c.layer_rope_theta(5), 100_000.0);
        // Period 0: every layer slides.
        c.sliding = Some(SlidingWindow {
            size: 64,
            period: 0,
            rope_theta: 10_000.0,
        });
        assert!((0..18).all(|l| c.layer_window(l) == Some(64)));
        c.sliding = Some(SlidingWindow {
            size: 0,
            period: 6,
            rope_theta: 10_000.0,
        });
        assert!(c.validate().is_err());
        c.sliding = None;
        c.final_logit_softcap = Some(-1.0);
        assert!(c.validate().is_err());
    }

    #[test]
    fn qwen2_hf_config_with_its_sliding_window_off_parses() {
        let json = SMOL
            .replace("LlamaForCausalLM", "Qwen2ForCausalLM")
            .replace(
                "\"rope_scaling\":null",
                "\"rope_scaling\":null,\"sliding_window\":4096,\"use_sliding_window\":false",
            );
        let c = ModelConfig::from_hf_json(&json).expect("valid");
        assert!(c.family.qkv_bias);
        assert_eq!(c.sliding, None);
        // Turned on, a window shorter than the context is refused.
        let on = json.replace(
            "\"use_sliding_window\":false",
            "\"use_sliding_window\":true",
        );
        assert!(ModelConfig::from_hf_json(&on).is_err());
    }

    #[test]
    fn hf_config_parses() {
        let c = ModelConfig::from_hf_json(SMOL).expect("valid");
        assert_eq!(c.head_dim, 64);
        assert_eq!(c.kv_dim(), 192);
        assert_eq!(c.rope_style, RopeStyle::Neox);
    }

    #[test]
    fn bad_configs_name_the_problem() {
        let e = ModelConfig::from_hf_json(
            &SMOL.replace("\"num_key_value_heads\":3", "\"num_key_value_heads\":4"),
        )
        .expect_err("9 heads / 4 kv heads");
        assert!(e.to_string().contains("head_count 9"), "{e}");
        let e = ModelConfig::from_hf_json(&SMOL.replace("LlamaForCausalLM", "GPT2LMHeadModel"))
            .expect_err("arch");
        assert!(e.to_string().contains("GPT2LMHeadModel"), "{e}");
        assert!(ModelConfig::from_hf_json("{").is_err());
        assert!(ModelConfig::from_hf_json(&SMOL.replace("8192", "0")).is_err());
    }
}
