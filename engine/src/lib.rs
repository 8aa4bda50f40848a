//! Tandem's engine: the Llama-family forward pass over a paged KV cache,
//! the sampler, the batch scheduler, tensor-parallel communicators, and
//! model loading (files are read through `tandem-modelfile`). It knows
//! nothing of HTTP or gRPC.

pub mod block_manager;
pub mod comm;
pub mod error;
pub mod generate;
pub mod kv_cache;
pub mod loader;
pub mod metrics;
pub mod model;
pub mod moe;
pub mod safetensors_loader;
pub mod sampler;
pub mod scheduler;

pub use error::{ModelError, RequestError};
pub use loader::{LoadedModel, load};
pub use tandem_types::ModelFingerprint;
