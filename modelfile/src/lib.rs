//! A model's files without the compute: the GGUF container (`gguf`,
//! `storage`), the model description read from GGUF metadata or an HF
//! `config.json` (`config`), the tokenizer and chat template built from
//! them, model aliases (`fetch`), Hugging Face hub repo ids and their
//! cache (`hub`), the model plan every executor reads (`plan`: tensor
//! names, the tensor-parallel split), and [`ModelMeta`]: everything a
//! process that never runs the model (the router) needs, read without
//! touching the weights.

pub mod arch;
pub mod chat;
pub mod config;
pub mod error;
pub mod fetch;
pub mod gguf;
pub mod hub;
pub mod meta;
pub mod plan;
pub mod safetensors;
mod spm;
pub mod stop;
pub mod storage;
pub mod tokenizer;

pub use error::ModelError;
pub use meta::{ModelMeta, ModelText};
