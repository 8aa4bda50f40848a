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
