//! An HF checkpoint directory's `*.safetensors` files, mapped and indexed
//! by tensor name: what the CPU engine's loader and the GPU's read from.

use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use ::safetensors::{Dtype, SafeTensors};
use tandem_kernels::GgmlType;

use crate::error::ModelError;
use crate::meta;
use crate::storage::Backing;

/// Where one tensor's bytes live.
#[derive(Debug, Clone)]
pub struct StTensor {
    pub backing: Arc<Backing>,
    pub range: Range<usize>,
    pub ty: GgmlType,
    /// Row-major, as safetensors stores it: the last dimension is a row.
    pub shape: Vec<usize>,
}

impl StTensor {
    pub fn data(&self) -> &[u8] {
        &self.backing[self.range.clone()]
    }
}

/// Every tensor of a directory's `*.safetensors` files (F32, F16, BF16).
#[derive(Debug)]
pub struct SafetensorsDir {
    tensors: HashMap<String, StTensor>,
    /// The mapped files, in file-name order.
    files: Vec<Arc<Backing>>,
}

impl SafetensorsDir {
    pub fn open(dir: &Path) -> Result<SafetensorsDir, ModelError> {
        let mut tensors = HashMap::new();
        let mut files = Vec::new();
        for f in &meta::hf_weight_files(dir)? {
            files.push(index_file(f, &mut tensors)?);
        }
        Ok(SafetensorsDir { tensors, files })
    }

    /// A hash of the files' bytes, chained in file-name order (what
    /// `ModelMeta` computes by streaming them): read on demand, since only
    /// a process that shares KV needs it.
    pub fn weights_hash(&self) -> u64 {
        self.files.iter().fold(0, |h, f| {
            meta::chain_file_hash(h, xxhash_rust::xxh3::xxh3_64(f))
        })
    }

    pub fn get(&self, name: &str) -> Option<&StTensor> {
        self.tensors.get(name)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
}

/// Indexes one file's tensors; returns its mapping.
fn index_file(
    path: &Path,
    out: &mut HashMap<String, StTensor>,
) -> Result<Arc<Backing>, ModelError> {
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
        let located = StTensor {
            backing: Arc::clone(&backing),
            range: start..start + view.data().len(),
            ty,
            shape: view.shape().to_vec(),
        };
        if out.insert(name.clone(), located).is_some() {
            return Err(bad(format!("tensor {name} appears in more than one file")));
        }
    }
    Ok(backing)
}

/// The HF (`LlamaForCausalLM` / `Qwen2ForCausalLM`) name of the dense
/// model tensor GGUF calls `gguf`, if it has one.
pub fn hf_name(gguf: &str) -> Option<String> {
    match gguf {
        "token_embd.weight" => return Some("model.embed_tokens.weight".into()),
        "output_norm.weight" => return Some("model.norm.weight".into()),
        "output.weight" => return Some("lm_head.weight".into()),
        _ => {}
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (part, kind) = rest.rsplit_once('.')?;
    if kind != "weight" && kind != "bias" {
        return None;
    }
    // Mixture of experts: the router, its selection bias, and expert j's
    // matrices as `ffn_{gate,up,down}.j` (GGUF stacks the experts in one
    // tensor; these per-expert names are the loaders' own).
    let moe = |s: &str| Some(format!("model.layers.{layer}.block_sparse_moe.{s}"));
    match (part.split_once('.'), kind) {
        (None, "weight") if part == "ffn_gate_inp" => return moe("gate.weight"),
        (None, "bias") if part == "exp_probs_b" => return moe("gate.e_score_correction_bias"),
        (Some((matrix, j)), "weight") => {
            let j: usize = j.parse().ok()?;
            let w = match matrix {
                "ffn_gate" => "w1",
                "ffn_up" => "w3",
                "ffn_down" => "w2",
                _ => return None,
            };
            return moe(&format!("experts.{j}.{w}.weight"));
        }
        (Some(_), _) => return None,
        _ => {}
    }
    let hf = match part {
        "attn_norm" => "input_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "ffn_norm" => "post_attention_layernorm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{kind}"))
}

#[cfg(test)]
mod tests {
    use super::hf_name;

    #[test]
    fn gguf_names_map_to_hf_names() {
        assert_eq!(
            hf_name("blk.12.attn_q.bias").as_deref(),
            Some("model.layers.12.self_attn.q_proj.bias")
        );
        assert_eq!(
            hf_name("blk.0.ffn_norm.weight").as_deref(),
            Some("model.layers.0.post_attention_layernorm.weight")
        );
        assert_eq!(hf_name("output.weight").as_deref(), Some("lm_head.weight"));
        assert_eq!(
            hf_name("blk.1.ffn_gate_inp.weight").as_deref(),
            Some("model.layers.1.block_sparse_moe.gate.weight")
        );
        assert_eq!(
            hf_name("blk.0.exp_probs_b.bias").as_deref(),
            Some("model.layers.0.block_sparse_moe.gate.e_score_correction_bias")
        );
        assert_eq!(
            hf_name("blk.2.ffn_down.7.weight").as_deref(),
            Some("model.layers.2.block_sparse_moe.experts.7.w2.weight")
        );
        assert_eq!(hf_name("blk.2.ffn_down.x.weight"), None);
        assert_eq!(hf_name("blk.2.attn_q.3.weight"), None);
        for odd in [
            "blk.x.attn_q.weight",
            "blk.1.attn_q",
            "blk.1.nope.weight",
            "rope_freqs.weight",
        ] {
            assert_eq!(hf_name(odd), None, "{odd}");
        }
    }
}
