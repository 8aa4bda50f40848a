//! Tandem's engine: the Llama-family forward pass over a paged KV cache,
//! the sampler, the batch scheduler, tensor-parallel communicators, and
//! model loading (files are read through `tandem-modelfile`). It knows
//! nothing of HTTP or gRPC.
//!
//! Modules, in layers: each uses only modules listed before it, so the
//! module graph has no cycles.
//! - Foundations: `block_allocator` (block ids, the refcounting allocator,
//!   `KvCacheError`), `comm` (tensor-parallel communicators), `error`,
//!   `weight` (weight matrices in their stored form), `sampler`.
//! - The KV cache: `block_manager` (block ownership, prefix caching), then
//!   `kv_cache` (the paged pool).
//! - The forward pass: `moe` (mixture-of-experts blocks), then `model`.
//! - Loading: `tensor_source` (a model's weights by their names in any
//!   format), `safetensors_loader` (weights of an HF directory), then
//!   `loader` (GGUF files and HF directories into a [`LoadedModel`]), then
//!   `metrics`.
//! - Running steps: `backend` (the `ServedModel` / `StepRunner` traits, the
//!   tensor-parallel CPU executor), `mock` (a stand-in timed by a measured
//!   profile, for router and cluster benchmarks).
//! - `generate` and `scheduler` on top.

pub mod backend;
pub mod block_allocator;
pub mod block_manager;
pub mod comm;
pub mod error;
pub mod generate;
pub mod kv_cache;
pub mod loader;
pub mod metrics;
pub mod mock;
pub mod model;
pub mod moe;
pub mod ranks;
pub mod safetensors_loader;
pub mod sampler;
pub mod scheduler;
mod tensor_source;
pub mod weight;

pub use backend::{ServedModel, StepRunner};
pub use error::{ModelError, RequestError};
pub use loader::{LoadedModel, load};
pub use tandem_types::ModelFingerprint;
