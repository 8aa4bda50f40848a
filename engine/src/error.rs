//! Engine errors, classified where they arise. Rendering (HTTP status, gRPC
//! code) happens once at the edge, in the crates that own those protocols.

use crate::block_allocator::KvCacheError;
use crate::comm::CommError;
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
    /// A tensor- or expert-parallel collective failed (a peer rank is
    /// gone, or the ranks disagree).
    #[error("collective failed: {0}")]
    Collective(#[from] CollectiveError),
    /// A device backend (a GPU) failed to run the step: the backend's own
    /// error, boxed (the device crates depend on this one, so it cannot
    /// name their types).
    #[error("device failure: {0}")]
    Device(Box<dyn std::error::Error + Send + Sync>),
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
    Mock(#[from] MockError),
}

impl From<CommError> for RequestError {
    fn from(e: CommError) -> Self {
        Self::Collective(e.into())
    }
}

/// A tensor- or expert-parallel collective that failed, or whose ranks
/// exchanged what the step's shapes do not allow.
#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    /// The communicator failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// A peer rank's thread ended (it panicked, or its channel closed), so
    /// the group cannot step.
    #[error("a tensor-parallel rank stopped")]
    RankGone,
    #[error("{what}: {got} values, expected {want}")]
    Length {
        what: &'static str,
        got: usize,
        want: usize,
    },
    #[error("MoE combine: replies of {got:?} floats per rank, expected {want:?}")]
    ReplyCounts { got: Vec<usize>, want: Vec<usize> },
    #[error("expert {0} is not on this rank")]
    ExpertNotHere(usize),
    #[error(
        "MoE dispatch: rank {rank} sent {floats} floats, not a whole number of {item_len}-float items"
    )]
    PartialItems {
        rank: usize,
        floats: usize,
        item_len: usize,
    },
    #[error("MoE dispatch: {received} floats received, the counts {counts:?} say otherwise")]
    ReceivedTotal { received: usize, counts: Vec<usize> },
    #[error("MoE dispatch: expert id {id} is not one of this rank's experts {owned:?}")]
    ForeignExpert {
        id: f32,
        owned: std::ops::Range<usize>,
    },
}

/// What the mock engine (`mock.rs`) refuses or finds wrong.
#[derive(Debug, thiserror::Error)]
pub enum MockError {
    #[error("--engine mock needs K rows of at least {need} values (head_dim {head_dim})")]
    HeadTooSmall { need: usize, head_dim: usize },
    #[error("--mock-time-scale must be finite and >= 0 (got {0})")]
    TimeScale(f64),
    #[error(
        "--engine mock runs one rank (got --tp {0}): profile the tensor-parallel engine with \
         bench-engine and mock that instead"
    )]
    TensorParallel(usize),
    /// KV it did not write (a broken handoff).
    #[error("KV at position {pos} differs between layer 0 and layer {layer}")]
    KvMismatch { pos: usize, layer: usize },
}

/// Why a model's step runner could not be built (the node refuses to
/// start).
#[derive(Debug, thiserror::Error)]
pub enum RunnerError {
    /// The model does not split over `tp` ranks.
    #[error("--tp {tp}: {source}")]
    Shard {
        tp: usize,
        #[source]
        source: ModelError,
    },
    #[error(transparent)]
    KvCache(#[from] KvCacheError),
    #[error("spawning a tensor-parallel rank: {0}")]
    Spawn(#[source] std::io::Error),
    #[error("the model was loaded for {loaded} tensor-parallel ranks, the scheduler runs {asked}")]
    TpMismatch { loaded: usize, asked: usize },
    #[error("the model was loaded for KV blocks of {loaded} tokens, the scheduler uses {asked}")]
    BlockSizeMismatch { loaded: usize, asked: usize },
    #[error("device blocks of {device} bytes, host blocks of {host}")]
    BlockBytesMismatch { device: usize, host: usize },
    /// The device backend's own error, boxed (see [`RequestError::Device`]).
    #[error("{0}")]
    Device(Box<dyn std::error::Error + Send + Sync>),
    #[error(transparent)]
    Mock(#[from] MockError),
}

impl From<tandem_types::SamplingError> for RequestError {
    fn from(e: tandem_types::SamplingError) -> Self {
        Self::Invalid(e.into())
    }
}
