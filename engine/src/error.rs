//! Engine errors, classified where they arise. Rendering (HTTP status, gRPC
//! code) happens once at the edge, in the crates that own those protocols.

use crate::block_allocator::KvCacheError;
use tandem_modelfile::tokenizer::TokenizerError;
use tandem_types::InvalidRequest;

pub use tandem_modelfile::ModelError;

/// Problems with one request: the caller's input, or capacity.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// The caller's request cannot run (4xx).
    #[error(transparent)]
    Invalid(#[from] InvalidRequest),
    /// The scheduler has shut down (503: retry elsewhere).
    #[error("the scheduler has stopped")]
    Stopped,
    #[error("block table too short: {have} blocks for {tokens} tokens")]
    BlockTableTooShort { have: usize, tokens: usize },
    #[error(transparent)]
    KvCache(#[from] KvCacheError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error("kernel failure: {0}")]
    Kernel(#[from] tandem_kernels::KernelError),
    /// A tensor-parallel collective failed (a peer rank is gone).
    #[error("collective failed: {0}")]
    Collective(String),
    /// A device backend (a GPU) failed to run the step.
    #[error("device failure: {0}")]
    Device(String),
    /// A runner returned logits that do not fit the step's rows (a bug in
    /// the runner, not in the request).
    #[error("the step returned {got} logits for {rows} rows of {width}")]
    LogitsShape {
        rows: usize,
        width: usize,
        got: usize,
    },
    /// The mock engine found KV it did not write (a broken handoff).
    #[error("mock engine: {0}")]
    Mock(String),
}

impl From<tandem_types::SamplingError> for RequestError {
    fn from(e: tandem_types::SamplingError) -> Self {
        Self::Invalid(e.into())
    }
}
