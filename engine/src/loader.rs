//! Loads a model from a GGUF file or an HF-style directory into a
//! [`DecoderModel`] plus its tokenizer and chat template.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_modelfile::ModelText;
use tandem_modelfile::config::ModelConfig;
use tandem_modelfile::gguf::GgufFile;
use tandem_modelfile::meta;
use tandem_modelfile::plan::Format;
use tandem_types::ModelFingerprint;

use crate::error::ModelError;
use crate::model::DecoderModel;
use crate::safetensors_loader;
use crate::tensor_source::{TensorSource, read_weights};
use crate::weight::{Weight, to_f32};

/// A model with everything needed to turn text into tokens and back.
#[derive(Debug)]
pub struct LoadedModel {
    pub model: DecoderModel,
    /// Name, tokenizer and chat template: shared with the HTTP front end.
    pub text: Arc<ModelText>,
    pub path: PathBuf,
    /// xxh3-64 of the weight file bytes: nodes compare it at connect so that
    /// KV computed by one set of weights is never read by another.
    pub weights_hash: u64,
    pub load_time: LoadTimes,
}

impl LoadedModel {
    /// What a peer must match to share KV blocks of `block_size` tokens.
    pub fn fingerprint(&self, block_size: usize) -> ModelFingerprint {
        meta::fingerprint(
            &self.text.name,
            self.weights_hash,
            self.model.config(),
            block_size,
        )
    }
}

/// Where load time went (reported as `tandem.model_load_time{phase}`).
#[derive(Debug, Clone, Copy, Default)]
pub struct LoadTimes {
    /// Opening and parsing the file(s), mapping tensor data.
    pub read: Duration,
    /// Converting small tensors (norms) to f32.
    pub dequantize: Duration,
    /// Tokenizer and chat template construction, shape checks.
    pub init: Duration,
    pub total: Duration,
}

/// Loads `path`: a `.gguf` file or a directory with `config.json`.
pub fn load(path: &Path) -> Result<LoadedModel, ModelError> {
    if path.is_dir() {
        load_dir(path)
    } else if path.is_file() {
        load_gguf(path)
    } else {
        Err(ModelError::NotFound(path.display().to_string()))
    }
}

/// Loads a GGUF model file.
pub fn load_gguf(path: &Path) -> Result<LoadedModel, ModelError> {
    let t0 = Instant::now();
    let g = GgufFile::open(path)?;
    let weights_hash = xxhash_rust::xxh3::xxh3_64(g.backing());
    let config = ModelConfig::from_gguf(&g)?;
    let read = t0.elapsed();

    let t1 = Instant::now();
    let weights = read_weights(&GgufSource(&g), &config, false)?;
    let dequantize = t1.elapsed();

    let t2 = Instant::now();
    let (tokenizer, chat_template) = meta::gguf_text(&g, &config)?;
    let model = DecoderModel::new(config, weights)?;
    let init = t2.elapsed();
    let name = meta::gguf_name(&g, path);
    Ok(LoadedModel {
        model,
        text: Arc::new(ModelText {
            name,
            tokenizer,
            chat_template,
        }),
        path: path.to_path_buf(),
        weights_hash,
        load_time: LoadTimes {
            read,
            dequantize,
            init,
            total: t0.elapsed(),
        },
    })
}

/// Loads an HF-style model directory: the weights (read by
/// [`safetensors_loader`]), the tokenizer and the chat template.
pub fn load_dir(dir: &Path) -> Result<LoadedModel, ModelError> {
    let t0 = Instant::now();
    let (config, weights, weights_hash) = safetensors_loader::read_weights(dir)?;
    let read = t0.elapsed();
    let dequantize = Duration::ZERO;

    let t2 = Instant::now();
    let (tokenizer, chat_template) = meta::hf_text(dir, &config)?;
    let model = DecoderModel::new(config, weights)?;
    let init = t2.elapsed();
    Ok(LoadedModel {
        model,
        text: Arc::new(ModelText {
            name: meta::file_stem(dir),
            tokenizer,
            chat_template,
        }),
        path: dir.to_path_buf(),
        weights_hash,
        load_time: LoadTimes {
            read,
            dequantize,
            init,
            total: t0.elapsed(),
        },
    })
}

/// A GGUF file's tensors, by GGUF's names.
struct GgufSource<'a>(&'a GgufFile);

impl TensorSource for GgufSource<'_> {
    fn format(&self) -> Format {
        Format::Gguf
    }

    fn matrix(&self, name: &str) -> Result<Weight, ModelError> {
        let g = self.0;
        let info = g
            .tensor(name)
            .map_err(|_| ModelError::MissingTensor(name.to_string()))?;
        let (cols, rows) = match info.dims.as_slice() {
            [cols, rows] => (*cols as usize, *rows as usize),
            dims => {
                return Err(ModelError::BadTensor {
                    name: name.to_string(),
                    problem: format!("expected 2 dimensions, found {dims:?}"),
                });
            }
        };
        Weight::new(
            name,
            info.ty,
            rows,
            cols,
            Arc::clone(g.backing()),
            g.tensor_range(info),
        )
    }

    fn vector(&self, name: &str) -> Result<Vec<f32>, ModelError> {
        let g = self.0;
        let info = g
            .tensor(name)
            .map_err(|_| ModelError::MissingTensor(name.to_string()))?;
        let n = info.n_elements() as usize;
        if info.dims.len() != 1 {
            return Err(ModelError::BadTensor {
                name: name.to_string(),
                problem: format!("expected 1 dimension, found {:?}", info.dims),
            });
        }
        to_f32(name, info.ty, g.tensor_data(name)?, n)
    }

    fn contains(&self, name: &str) -> bool {
        self.0.tensor(name).is_ok()
    }
}
