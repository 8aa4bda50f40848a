//! Where the GPU backend reads a model's tensors, by GGUF's names: a GGUF
//! file, or an HF safetensors directory (F32 / F16 / BF16), whose names
//! `tandem_modelfile::plan::names` spells for the family.

use std::path::Path;

use tandem_kernels::GgmlType;
use tandem_modelfile::arch::Family;
use tandem_modelfile::config::ModelConfig;
use tandem_modelfile::error::ModelError;
use tandem_modelfile::gguf::GgufFile;
use tandem_modelfile::plan::names::hf_name;
use tandem_modelfile::safetensors::SafetensorsDir;

use crate::error::GpuError;

/// One stored tensor, as the loader reads it.
#[derive(Debug, Clone, Copy)]
pub struct Tensor<'a> {
    pub ty: GgmlType,
    /// Values per row: GGUF's first dimension, safetensors' last.
    pub row_len: usize,
    pub n_elements: usize,
    pub data: &'a [u8],
}

/// Named tensors, by GGUF's names.
pub trait Tensors: Send + Sync {
    fn tensor(&self, name: &str) -> Result<Tensor<'_>, GpuError>;

    fn contains(&self, name: &str) -> bool {
        self.tensor(name).is_ok()
    }
}

impl Tensors for GgufFile {
    fn tensor(&self, name: &str) -> Result<Tensor<'_>, GpuError> {
        let info = GgufFile::tensor(self, name).map_err(ModelError::from)?;
        let data = self.tensor_data(name).map_err(ModelError::from)?;
        let big = |_| GpuError::UnsupportedModel(format!("{name}: beyond this machine's sizes"));
        Ok(Tensor {
            ty: info.ty,
            row_len: usize::try_from(info.dims.first().copied().unwrap_or(0)).map_err(big)?,
            n_elements: usize::try_from(info.n_elements()).map_err(big)?,
            data,
        })
    }
}

/// An HF checkpoint directory's tensors; with `tie` (`config.json`'s
/// `tie_word_embeddings`) it has no output head of its own, even where
/// the files hold an `lm_head.weight`, as for the CPU loader.
struct HfCheckpoint {
    dir: SafetensorsDir,
    tie: bool,
    family: &'static Family,
}

impl Tensors for HfCheckpoint {
    fn tensor(&self, name: &str) -> Result<Tensor<'_>, GpuError> {
        let t = hf_name(self.family, name)
            .filter(|_| !(self.tie && name == "output.weight"))
            .and_then(|hf| self.dir.get(&hf))
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
        Ok(Tensor {
            ty: t.ty,
            row_len: t.shape.last().copied().unwrap_or(0),
            n_elements: t.shape.iter().product(),
            data: t.data(),
        })
    }
}

/// A model's configuration and tensors.
pub struct ModelFiles {
    pub config: ModelConfig,
    pub tensors: Box<dyn Tensors>,
}

impl std::fmt::Debug for ModelFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelFiles")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl ModelFiles {
    /// `path`: an HF checkpoint directory or a GGUF file.
    pub fn open(path: &Path) -> Result<ModelFiles, GpuError> {
        if path.is_dir() {
            let (config, tie) = tandem_modelfile::meta::hf_config(path)?;
            let dir = SafetensorsDir::open(path)?;
            let family = config.family;
            return Ok(ModelFiles {
                config,
                tensors: Box::new(HfCheckpoint { dir, tie, family }),
            });
        }
        let g = GgufFile::open(path).map_err(ModelError::from)?;
        Ok(ModelFiles {
            config: ModelConfig::from_gguf(&g)?,
            tensors: Box::new(g),
        })
    }
}
