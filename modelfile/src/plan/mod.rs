//! The model plan every executor reads: what a family's tensors are called
//! in GGUF and HF files ([`names`]), how the model splits over
//! tensor-parallel ranks ([`shard`]), and what each layer does
//! ([`recipe`]). The CPU engine, the GPU backend and dKV's head-slice
//! transfers consume these; they differ only in how they run each
//! operation.

pub mod names;
pub mod recipe;
pub mod shard;

pub use names::{Format, Kind, Part, TensorId};
pub use shard::{RankShare, ShardPlan, StoredBlocks};
