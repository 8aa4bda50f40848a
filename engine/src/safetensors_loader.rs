//! Reads the weights of an HF-style directory (the families with HF names
//! in `tandem_modelfile::arch`):
//! `config.json` and one or more `*.safetensors` files with F32, F16 or
//! BF16 tensors. `loader::load_dir` adds the tokenizer and chat template
//! (`tokenizer.json`, `tokenizer_config.json`) to make a loaded model.

use std::path::Path;
use std::sync::Arc;

use tandem_modelfile::config::ModelConfig;
use tandem_modelfile::meta;
use tandem_modelfile::plan::Format;
use tandem_modelfile::safetensors::{SafetensorsDir, StTensor};

use crate::error::ModelError;
use crate::model::{DecoderModel, ModelWeights};
use crate::tensor_source::{self, TensorSource};
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
    let weights = tensor_source::read_weights(&HfSource(&files), &config, tie)?;
    Ok((config, weights, files.weights_hash()))
}

/// An HF directory's tensors, by HF's names.
struct HfSource<'a>(&'a SafetensorsDir);

impl HfSource<'_> {
    fn get(&self, name: &str) -> Result<&StTensor, ModelError> {
        self.0
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))
    }
}

impl TensorSource for HfSource<'_> {
    fn format(&self) -> Format {
        Format::Hf
    }

    fn matrix(&self, name: &str) -> Result<Weight, ModelError> {
        let l = self.get(name)?;
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
    }

    fn vector(&self, name: &str) -> Result<Vec<f32>, ModelError> {
        let l = self.get(name)?;
        let [n] = l.shape[..] else {
            return Err(ModelError::BadTensor {
                name: name.to_string(),
                problem: format!("expected 1 dimension, found {:?}", l.shape),
            });
        };
        to_f32(name, l.ty, l.data(), n)
    }

    fn contains(&self, name: &str) -> bool {
        self.0.contains(name)
    }
}
