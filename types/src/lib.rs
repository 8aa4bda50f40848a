//! Plain types every layer of Tandem shares: a request's sampling
//! parameters and limits, the events and failures of a generation, the
//! model fingerprint peers compare, chained block hashes, the egress
//! backlog's instruments and the one seeded RNG. No engine, no wire format,
//! no HTTP: `proto`, the front end and the router depend on this crate, not
//! on the engine.

pub mod block_hash;
pub mod clock;
pub mod egress;
pub mod fingerprint;
pub mod request;
pub mod rng;
pub mod sampling;

pub use block_hash::{BlockHash, block_hashes, chain_hash};
pub use fingerprint::ModelFingerprint;
pub use request::{
    Constraint, FinishReason, GenEvent, GenFailure, GenerationRequest, InvalidRequest,
    RequestLimits, Usage,
};
pub use rng::SeededRng;
pub use sampling::{
    MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, MinTokens, Sampled, SamplingError, SamplingParams,
};
