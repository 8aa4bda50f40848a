//! Tandem's engine: model loading (GGUF, HF safetensors), tokenizer and chat
//! template, the Llama-family forward pass over a paged KV cache, and the
//! sampler. It knows nothing of HTTP or gRPC.

pub mod block_manager;
pub mod chat;
pub mod comm;
pub mod config;
pub mod error;
pub mod fetch;
pub mod fingerprint;
pub mod generate;
pub mod gguf;
pub mod kv_cache;
pub mod loader;
pub mod metrics;
pub mod model;
pub mod moe;
pub mod safetensors_loader;
pub mod sampler;
pub mod scheduler;
pub mod storage;
pub mod tokenizer;

pub use error::{ModelError, RequestError};
pub use fingerprint::ModelFingerprint;
pub use loader::{LoadedModel, load};
