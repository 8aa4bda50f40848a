//! Engine errors, classified where they arise. Rendering (HTTP status, gRPC
//! code) happens once at the edge, in the crates that own those protocols.

use crate::chat::ChatTemplateError;
use crate::gguf::GgufError;
use crate::kv_cache::KvCacheError;
use crate::sampler::SamplingError;
use crate::tokenizer::TokenizerError;

/// Problems with a model's files or its description.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("unsupported model architecture {0:?} (supported: llama / LlamaForCausalLM)")]
    UnsupportedArchitecture(String),
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
        "model not found: {0} (expected a .gguf file, an HF model directory, or the alias smollm2-135m)"
    )]
    NotFound(String),
}

/// Problems with one request: the caller's input, or capacity.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("token id {id} out of range (vocabulary has {vocab} tokens)")]
    TokenOutOfRange { id: u32, vocab: usize },
    #[error(
        "Prompt is too long: {prompt} tokens exceeds the configured maximum context length of {max} tokens. Please shorten your prompt."
    )]
    PromptTooLong { prompt: usize, max: usize },
    #[error("empty prompt: at least one token is required")]
    EmptyPrompt,
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    #[error("service unavailable: {0}")]
    Unavailable(&'static str),
    #[error("block table too short: {have} blocks for {tokens} tokens")]
    BlockTableTooShort { have: usize, tokens: usize },
    #[error(transparent)]
    KvCache(#[from] KvCacheError),
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    ChatTemplate(#[from] ChatTemplateError),
    #[error("kernel failure: {0}")]
    Kernel(#[from] tandem_kernels::KernelError),
    /// A tensor-parallel collective failed (a peer rank is gone).
    #[error("collective failed: {0}")]
    Collective(String),
}
