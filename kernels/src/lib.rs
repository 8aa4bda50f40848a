//! Compute kernels for Tandem. Knows nothing of models.
//!
//! Activations are quantised as ggml-cpu does (to the weight type's
//! `vec_dot_type`). [`matmul`] then accumulates in ggml's AVX2 order, with
//! bitwise identical results on every ISA; [`matmul_packed`] (Q4_1 and Q8_0
//! repacked for AVX-512 VNNI) accumulates block by block, bitwise equal to
//! its scalar reference. Neither depends on batch size, tiling or thread
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
mod vmath;

pub use cpu::{Isa, isa, limit_isa, num_threads, set_num_threads};
pub use error::KernelError;
pub use matmul::{QMatrix, matmul, matmul_with_isa};
pub use packed::{
    PACK_ROWS, PackedMatrix, matmul_packed, matmul_packed_segments,
    matmul_packed_segments_with_isa, matmul_packed_with_isa,
};
pub use pool::{parallel_chunks_mut, parallel_for, parallel_ranges, parallel_rows2};
pub use quant::{GgmlType, dequantize_row, quantize_row};
