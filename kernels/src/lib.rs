//! Compute kernels for Tandem. Knows nothing of models.
//!
//! The quantised matmul mirrors ggml-cpu's numerics (activation quantisation
//! to the weight type's `vec_dot_type` and the AVX2 accumulation order), so
//! greedy outputs can be compared token for token with llama.cpp. All ISAs
//! produce bitwise identical results, independent of batch size and thread
//! count.

pub mod attention;
pub mod ops;

mod cpu;
mod dot;
mod error;
mod matmul;
mod packed;
mod pool;
pub mod quant;

pub use cpu::{Isa, isa, num_threads, set_num_threads};
pub use error::KernelError;
pub use matmul::{QMatrix, matmul, matmul_with_isa};
pub use packed::{PACK_ROWS, PackedMatrix, matmul_packed, matmul_packed_with_isa};
pub use pool::{parallel_chunks_mut, parallel_for, parallel_ranges};
pub use quant::{GgmlType, dequantize_row, quantize_row};
