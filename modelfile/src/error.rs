//! Problems with a model's files or its description, classified where they
//! arise.

use crate::chat::ChatTemplateError;
use crate::gguf::GgufError;
use crate::tokenizer::TokenizerError;

/// Problems with a model's files or its description.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("unsupported model architecture {found:?} (supported: {supported})")]
    UnsupportedArchitecture { found: String, supported: String },
    #[error("invalid model config: {0}")]
    InvalidConfig(String),
    #[error("tensor {name}: {problem}")]
    BadTensor { name: String, problem: String },
    #[error("missing tensor {0}")]
    MissingTensor(String),
    #[error("reading {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("safetensors {path}: {problem}")]
    Safetensors { path: String, problem: String },
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    ChatTemplate(#[from] ChatTemplateError),
    #[error("fetching model {alias}: {problem}")]
    Fetch { alias: String, problem: String },
    #[error(
        "model not found: {0} (expected a .gguf file, an HF model directory, a Hugging Face repo id ORG/NAME[@REVISION][:QUANT], or one of the aliases {aliases})",
        aliases = crate::fetch::alias_list()
    )]
    NotFound(String),
    #[error(
        "invalid Hugging Face repo id {id:?}: {reason} (expected ORG/NAME[@REVISION][:QUANT]; no file or directory of that name exists either)"
    )]
    InvalidRepoId { id: String, reason: String },
    #[error("Hugging Face repo {repo}: {problem}")]
    Hub { repo: String, problem: String },
}
