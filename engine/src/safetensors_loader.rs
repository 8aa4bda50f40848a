//! Reads the weights of an HF-style `LlamaForCausalLM` directory:
//! `config.json` and one or more `*.safetensors` files with F32, F16 or
//! BF16 tensors. `loader::load_dir` adds the tokenizer and chat template
//! (`tokenizer.json`, `tokenizer_config.json`) to make a loaded model.

use std::path::Path;
use std::sync::Arc;

use tandem_modelfile::config::ModelConfig;
use tandem_modelfile::meta;
use tandem_modelfile::safetensors::{SafetensorsDir, hf_name};

use crate::error::ModelError;
use crate::model::{DecoderModel, FfnWeights, LayerWeights, ModelWeights};
use crate::moe::{Expert, MoeWeights};
use crate::weight::{Weight, to_f32};

/// The model alone (no tokenizer), from `config.json` and the
/// `*.safetensors` files: for checkpoints fed token ids directly, such as
/// the tiny mixture-of-experts test models.
pub fn load_model_dir(dir: &Path) -> Result<DecoderModel, ModelError> {
    let (config, weights, _) = read_weights(dir)?;
    DecoderModel::new(config, weights)
}

/// Parses `config.json` and maps every `*.safetensors` file; returns the
/// config, the weights and a hash of the files' bytes.
pub(crate) fn read_weights(dir: &Path) -> Result<(ModelConfig, ModelWeights, u64), ModelError> {
    let (config, tie) = meta::hf_config(dir)?;
    let files = SafetensorsDir::open(dir)?;
    let weights = hf_weights(&files, &config, tie)?;
    Ok((config, weights, files.weights_hash()))
}

fn hf_weights(t: &SafetensorsDir, c: &ModelConfig, tie: bool) -> Result<ModelWeights, ModelError> {
    let get = |name: &str| {
        t.get(name)
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))
    };
    let matrix = |name: &str| -> Result<Weight, ModelError> {
        let l = get(name)?;
        let [rows, cols] = l.shape[..] else {
            return Err(ModelError::BadTensor {
                name: name.to_string(),
                problem: format!("expected 2 dimensions, found {:?}", l.shape),
            });
        };
        Weight::new(
            name,
            l.ty,
            rows,
            cols,
            Arc::clone(&l.backing),
            l.range.clone(),
        )
    };
    let vector = |name: &str| -> Result<Vec<f32>, ModelError> {
        let l = get(name)?;
        let [n] = l.shape[..] else {
            return Err(ModelError::BadTensor {
                name: name.to_string(),
                problem: format!("expected 1 dimension, found {:?}", l.shape),
            });
        };
        to_f32(name, l.ty, &l.backing[l.range.clone()], n)
    };
    // The tensors' HF names, from GGUF's (one mapping, shared with the GPU
    // loader).
    let hf = |gguf: String| hf_name(&gguf).ok_or(ModelError::MissingTensor(gguf));
    let mut layers = Vec::with_capacity(c.n_layers);
    for i in 0..c.n_layers {
        let w = |s: &str| hf(format!("blk.{i}.{s}.weight"));
        let b = |s: &str| hf(format!("blk.{i}.{s}.bias"));
        let ffn = match &c.moe {
            None => FfnWeights::Dense {
                gate: matrix(&w("ffn_gate")?)?,
                up: matrix(&w("ffn_up")?)?,
                down: matrix(&w("ffn_down")?)?,
            },
            Some(moe) => {
                let e = |s: &str, j: usize| w(&format!("{s}.{j}"));
                let bias = b("exp_probs_b")?;
                FfnWeights::Moe(MoeWeights {
                    router: matrix(&w("ffn_gate_inp")?)?,
                    correction_bias: if t.contains(&bias) {
                        Some(vector(&bias)?)
                    } else {
                        None
                    },
                    experts: (0..moe.n_experts)
                        .map(|j| {
                            Ok(Expert {
                                gate: matrix(&e("ffn_gate", j)?)?,
                                up: matrix(&e("ffn_up", j)?)?,
                                down: matrix(&e("ffn_down", j)?)?,
                            })
                        })
                        .collect::<Result<_, ModelError>>()?,
                })
            }
        };
        layers.push(LayerWeights {
            attn_norm: vector(&w("attn_norm")?)?,
            wq: matrix(&w("attn_q")?)?,
            wk: matrix(&w("attn_k")?)?,
            wv: matrix(&w("attn_v")?)?,
            wo: matrix(&w("attn_output")?)?,
            ffn_norm: vector(&w("ffn_norm")?)?,
            ffn,
            // Qwen2's Q/K/V biases; Gemma-only parts have no HF family yet.
            qkv_bias: c
                .family
                .qkv_bias
                .then(|| -> Result<_, ModelError> {
                    Ok([
                        vector(&b("attn_q")?)?,
                        vector(&b("attn_k")?)?,
                        vector(&b("attn_v")?)?,
                    ])
                })
                .transpose()?,
            qk_norm: None,
            post_norms: None,
        });
    }
    let head = hf("output.weight".into())?;
    let output = if !tie && t.contains(&head) {
        Some(matrix(&head)?)
    } else {
        None
    };
    Ok(ModelWeights {
        token_embd: matrix(&hf("token_embd.weight".into())?)?,
        layers,
        output_norm: vector(&hf("output_norm.weight".into())?)?,
        output,
    })
}
