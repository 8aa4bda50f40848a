//! Reads the weights of an HF-style `LlamaForCausalLM` directory:
//! `config.json` and one or more `*.safetensors` files with F32, F16 or
//! BF16 tensors. `loader::load_dir` adds the tokenizer and chat template
//! (`tokenizer.json`, `tokenizer_config.json`) to make a loaded model.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use safetensors::{Dtype, SafeTensors};
use tandem_kernels::GgmlType;

use tandem_modelfile::config::ModelConfig;
use tandem_modelfile::meta;
use tandem_modelfile::storage::Backing;

use crate::error::ModelError;
use crate::model::{DecoderModel, FfnWeights, LayerWeights, ModelWeights};
use crate::moe::{Expert, MoeWeights};
use crate::weight::{Weight, to_f32};

/// Where one tensor lives: which file's bytes, at which range.
struct Located {
    backing: Arc<Backing>,
    range: std::ops::Range<usize>,
    ty: GgmlType,
    shape: Vec<usize>,
}

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
    let files = meta::hf_weight_files(dir)?;
    let mut tensors: HashMap<String, Located> = HashMap::new();
    let mut weights_hash = 0u64;
    for f in &files {
        let h = index_file(f, &mut tensors)?;
        weights_hash = meta::chain_file_hash(weights_hash, h);
    }
    let weights = hf_weights(&tensors, &config, tie)?;
    Ok((config, weights, weights_hash))
}

/// Indexes one file's tensors; returns the hash of its bytes.
fn index_file(path: &Path, out: &mut HashMap<String, Located>) -> Result<u64, ModelError> {
    let bad = |problem: String| ModelError::Safetensors {
        path: path.display().to_string(),
        problem,
    };
    let file = std::fs::File::open(path).map_err(|source| ModelError::Io {
        path: path.display().to_string(),
        source,
    })?;
    // SAFETY: the map is read-only; a file truncated by another process
    // underneath us is outside what we can defend against (as for GGUF).
    let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|source| ModelError::Io {
        path: path.display().to_string(),
        source,
    })?;
    let backing = Arc::new(Backing::Mmap(mmap));
    let st = SafeTensors::deserialize(&backing).map_err(|e| bad(e.to_string()))?;
    let base = backing.as_ptr() as usize;
    for (name, view) in st.tensors() {
        let ty = match view.dtype() {
            Dtype::F32 => GgmlType::F32,
            Dtype::F16 => GgmlType::F16,
            Dtype::BF16 => GgmlType::BF16,
            other => return Err(bad(format!("tensor {name}: unsupported dtype {other:?}"))),
        };
        let start = view.data().as_ptr() as usize - base;
        let located = Located {
            backing: Arc::clone(&backing),
            range: start..start + view.data().len(),
            ty,
            shape: view.shape().to_vec(),
        };
        if out.insert(name.clone(), located).is_some() {
            return Err(bad(format!("tensor {name} appears in more than one file")));
        }
    }
    Ok(xxhash_rust::xxh3::xxh3_64(&backing))
}

fn hf_weights(
    t: &HashMap<String, Located>,
    c: &ModelConfig,
    tie: bool,
) -> Result<ModelWeights, ModelError> {
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
    let mut layers = Vec::with_capacity(c.n_layers);
    for i in 0..c.n_layers {
        let n = |s: &str| format!("model.layers.{i}.{s}.weight");
        let ffn = match &c.moe {
            None => FfnWeights::Dense {
                gate: matrix(&n("mlp.gate_proj"))?,
                up: matrix(&n("mlp.up_proj"))?,
                down: matrix(&n("mlp.down_proj"))?,
            },
            Some(moe) => {
                let e = |j: usize, w: &str| n(&format!("block_sparse_moe.experts.{j}.{w}"));
                let bias =
                    format!("model.layers.{i}.block_sparse_moe.gate.e_score_correction_bias");
                FfnWeights::Moe(MoeWeights {
                    router: matrix(&n("block_sparse_moe.gate"))?,
                    correction_bias: if t.contains_key(&bias) {
                        Some(vector(&bias)?)
                    } else {
                        None
                    },
                    experts: (0..moe.n_experts)
                        .map(|j| {
                            Ok(Expert {
                                gate: matrix(&e(j, "w1"))?,
                                up: matrix(&e(j, "w3"))?,
                                down: matrix(&e(j, "w2"))?,
                            })
                        })
                        .collect::<Result<_, ModelError>>()?,
                })
            }
        };
        layers.push(LayerWeights {
            attn_norm: vector(&n("input_layernorm"))?,
            wq: matrix(&n("self_attn.q_proj"))?,
            wk: matrix(&n("self_attn.k_proj"))?,
            wv: matrix(&n("self_attn.v_proj"))?,
            wo: matrix(&n("self_attn.o_proj"))?,
            ffn_norm: vector(&n("post_attention_layernorm"))?,
            ffn,
            // Qwen2's Q/K/V biases; Gemma-only parts have no HF family yet.
            qkv_bias: c
                .family
                .qkv_bias
                .then(|| -> Result<_, ModelError> {
                    Ok([
                        vector(&format!("model.layers.{i}.self_attn.q_proj.bias"))?,
                        vector(&format!("model.layers.{i}.self_attn.k_proj.bias"))?,
                        vector(&format!("model.layers.{i}.self_attn.v_proj.bias"))?,
                    ])
                })
                .transpose()?,
            qk_norm: None,
            post_norms: None,
        });
    }
    let output = if !tie && t.contains_key("lm_head.weight") {
        Some(matrix("lm_head.weight")?)
    } else {
        None
    };
    Ok(ModelWeights {
        token_embd: matrix("model.embed_tokens.weight")?,
        layers,
        output_norm: vector("model.norm.weight")?,
        output,
    })
}
