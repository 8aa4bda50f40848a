//! The model plan every executor reads: what a family's tensors are called
//! in GGUF and HF files ([`names`]). The CPU engine and the GPU backend
//! consume it; they differ only in how they run each operation.

pub mod names;

pub use names::{Format, Kind, Part, TensorId};
