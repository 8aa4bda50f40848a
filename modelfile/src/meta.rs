//! The text side and identity of a model, read from its files without the
//! weights: the tokenizer, the chat template, the hyper-parameters and the
//! fingerprint peers compare. The engine's loader builds its tokenizer and
//! template through the same functions, so a router and a node that read
//! the same files agree by construction.

use std::io::Read;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use tandem_types::ModelFingerprint;
use tandem_types::fingerprint::{KV_DTYPE, KV_LAYOUT};

use crate::chat::ChatTemplate;
use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::gguf::GgufFile;
use crate::tokenizer::{self, Tokenizer};

/// What turns text into a model's tokens and back: all the HTTP front end
/// needs of a model.
#[derive(Debug)]
pub struct ModelText {
    /// GGUF `general.name`, or the file / directory name.
    pub name: String,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
}

/// A model's description, text side and weights hash.
#[derive(Debug)]
pub struct ModelMeta {
    pub path: PathBuf,
    pub config: ModelConfig,
    pub text: ModelText,
    /// The same hash the engine computes over the weight files' bytes.
    pub weights_hash: u64,
}

impl ModelMeta {
    /// Reads `path` (a `.gguf` file or an HF directory). The weights are
    /// hashed by streaming through a small buffer, never mapped whole, so
    /// the process's memory stays that of the tokenizer.
    pub fn load(path: &Path) -> Result<Self, ModelError> {
        let (config, text) = read_config_and_text(path)?;
        let weights_hash = if path.is_dir() {
            let mut h = 0;
            for f in hf_weight_files(path)? {
                h = chain_file_hash(h, hash_file(&f)?);
            }
            h
        } else {
            hash_file(path)?
        };
        Ok(Self {
            path: path.to_path_buf(),
            config,
            text,
            weights_hash,
        })
    }

    /// What a peer must match to share KV blocks of `block_size` tokens.
    pub fn fingerprint(&self, block_size: usize) -> ModelFingerprint {
        fingerprint(&self.text.name, self.weights_hash, &self.config, block_size)
    }
}

/// `path`'s configuration and text side (name, tokenizer, chat template):
/// [`ModelMeta`] without the weights' hash, for a process that has no KV
/// to share (`tandem generate`).
pub fn read_config_and_text(path: &Path) -> Result<(ModelConfig, ModelText), ModelError> {
    if path.is_dir() {
        let (config, _) = hf_config(path)?;
        let (tokenizer, chat_template) = hf_text(path, &config)?;
        let text = ModelText {
            name: file_stem(path),
            tokenizer,
            chat_template,
        };
        Ok((config, text))
    } else if path.is_file() {
        let g = GgufFile::open(path)?;
        let config = ModelConfig::from_gguf(&g)?;
        let (tokenizer, chat_template) = gguf_text(&g, &config)?;
        let text = ModelText {
            name: gguf_name(&g, path),
            tokenizer,
            chat_template,
        };
        Ok((config, text))
    } else {
        Err(ModelError::NotFound(path.display().to_string()))
    }
}

/// The fingerprint of a model described by `config`.
pub fn fingerprint(
    name: &str,
    weights_hash: u64,
    config: &ModelConfig,
    block_size: usize,
) -> ModelFingerprint {
    ModelFingerprint {
        model_id: name.to_string(),
        weights_hash,
        kv_dtype: KV_DTYPE.to_string(),
        block_size,
        kv_layout: KV_LAYOUT.to_string(),
        num_layers: config.n_layers,
        num_kv_heads: config.n_kv_heads,
        head_dim: config.head_dim,
    }
}

/// The tokenizer and chat template from GGUF metadata.
pub fn gguf_text(
    g: &GgufFile,
    config: &ModelConfig,
) -> Result<(Tokenizer, Option<ChatTemplate>), ModelError> {
    let spec = tokenizer::spec_from_gguf(g)?;
    let tokenizer = Tokenizer::from_spec(spec)?;
    if tokenizer.vocab_size() != config.vocab_size {
        return Err(ModelError::InvalidConfig(format!(
            "tokenizer has {} tokens but the model's vocabulary is {}",
            tokenizer.vocab_size(),
            config.vocab_size
        )));
    }
    let chat_template = match g.get_str("tokenizer.chat_template") {
        Ok(src) => {
            let name = |id: Option<u32>| {
                id.and_then(|i| tokenizer.token_str(i))
                    .unwrap_or_default()
                    .to_string()
            };
            Some(ChatTemplate::new(
                src,
                &name(tokenizer.bos_id()),
                &name(tokenizer.eos_id()),
            )?)
        }
        Err(_) => None,
    };
    Ok((tokenizer, chat_template))
}

/// GGUF `general.name`, else the file name.
pub fn gguf_name(g: &GgufFile, path: &Path) -> String {
    g.get_str("general.name")
        .map(str::to_string)
        .unwrap_or_else(|_| file_stem(path))
}

pub fn file_stem(path: &Path) -> String {
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}

fn read_text(dir: &Path, name: &str) -> Result<String, ModelError> {
    let p = dir.join(name);
    std::fs::read_to_string(&p).map_err(|source| ModelError::Io {
        path: p.display().to_string(),
        source,
    })
}

/// An HF directory's `config.json`: the description, and whether the
/// output head is tied to the embeddings.
pub fn hf_config(dir: &Path) -> Result<(ModelConfig, bool), ModelError> {
    let json = read_text(dir, "config.json")?;
    let config = ModelConfig::from_hf_json(&json)?;
    let tie = serde_json::from_str::<serde_json::Value>(&json)
        .ok()
        .and_then(|v| v.get("tie_word_embeddings").and_then(|t| t.as_bool()))
        .unwrap_or(false);
    Ok((config, tie))
}

/// The `*.safetensors` files of an HF directory, in name order.
pub fn hf_weight_files(dir: &Path) -> Result<Vec<PathBuf>, ModelError> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .map_err(|source| ModelError::Io {
            path: dir.display().to_string(),
            source,
        })?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(ModelError::NotFound(format!(
            "{}: no *.safetensors files",
            dir.display()
        )));
    }
    Ok(files)
}

/// Folds one weight file's hash into an HF directory's hash.
pub fn chain_file_hash(acc: u64, file_hash: u64) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(&file_hash.to_le_bytes(), acc)
}

/// xxh3-64 of a file's bytes, read in 1 MiB pieces.
pub fn hash_file(path: &Path) -> Result<u64, ModelError> {
    let io = |source| ModelError::Io {
        path: path.display().to_string(),
        source,
    };
    let mut f = std::fs::File::open(path).map_err(io)?;
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(io)?;
        if n == 0 {
            return Ok(h.digest());
        }
        h.update(&buf[..n]);
    }
}

/// The tokenizer and chat template of an HF directory (`tokenizer.json`,
/// `tokenizer_config.json`).
pub fn hf_text(
    dir: &Path,
    config: &ModelConfig,
) -> Result<(Tokenizer, Option<ChatTemplate>), ModelError> {
    #[derive(Deserialize, Default)]
    struct TokCfg {
        chat_template: Option<serde_json::Value>,
        bos_token: Option<serde_json::Value>,
        eos_token: Option<serde_json::Value>,
        add_bos_token: Option<bool>,
    }
    let tok_cfg: TokCfg = match read_text(dir, "tokenizer_config.json") {
        Ok(s) => serde_json::from_str(&s)
            .map_err(|e| ModelError::InvalidConfig(format!("tokenizer_config.json: {e}")))?,
        Err(_) => TokCfg::default(),
    };
    let tokenizer = Tokenizer::from_hf_file(&dir.join("tokenizer.json"), tok_cfg.add_bos_token)?;
    // HF vocabularies may be padded past the tokenizer, never the reverse.
    if tokenizer.vocab_size() > config.vocab_size {
        return Err(ModelError::InvalidConfig(format!(
            "tokenizer has {} tokens but config.json's vocab_size is {}",
            tokenizer.vocab_size(),
            config.vocab_size
        )));
    }
    // Special tokens are either plain strings or {"content": ...} objects.
    let token_text = |v: &Option<serde_json::Value>| -> String {
        match v {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Object(o)) => o
                .get("content")
                .and_then(|c| c.as_str())
                .unwrap_or_default()
                .to_string(),
            _ => String::new(),
        }
    };
    let chat_template = match &tok_cfg.chat_template {
        Some(serde_json::Value::String(src)) => Some(ChatTemplate::new(
            src,
            &token_text(&tok_cfg.bos_token),
            &token_text(&tok_cfg.eos_token),
        )?),
        Some(other) if !other.is_null() => {
            return Err(ModelError::InvalidConfig(
                "tokenizer_config.json: only a single string chat_template is supported".into(),
            ));
        }
        _ => None,
    };
    Ok((tokenizer, chat_template))
}
