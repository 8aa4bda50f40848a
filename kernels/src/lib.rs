//! Compute kernels for Tandem. Knows nothing of models.
//!
//! Activations are quantised as ggml-cpu does (to the weight type's
//! `vec_dot_type`). [`matmul`] (scalar, AVX2 and AVX-512 VNNI kernels) then
//! accumulates in ggml's AVX2 order, with bitwise identical results on every
//! ISA. [`matmul_packed`] takes Q4_0, Q4_1, Q5_0, Q8_0, Q4_K and Q6_K
//! weights that [`PackedMatrix::pack`] repacked (it does so where the
//! kernels may use AVX2 or AVX-512 VNNI, and returns `None` on scalar-only
//! CPUs) and
//! accumulates block by block: 512-bit `vpdpbusd` on AVX-512 VNNI, the same
//! layout in 256-bit halves with `vpmaddubsw`/`vpmaddwd` on AVX2, both
//! bitwise equal to the scalar reference ([`matmul_packed_with_isa`] with
//! [`Isa::Scalar`]). Neither depends on batch size, tiling or thread count.

// Module layering (each uses only modules on earlier lines; keep it acyclic):
// types (Isa, GgmlType); error; cpu, pool, quant; dot, vmath; matmul, ops;
// packed, attention.

pub mod attention;
pub mod ops;

mod cpu;
mod dot;
mod error;
mod matmul;
mod packed;
mod pool;
pub mod quant;
mod types;
mod vmath;

pub use cpu::{Isa, isa, limit_isa};
pub use error::KernelError;
pub use matmul::{QMatrix, matmul, matmul_with_isa};
pub use packed::{
    PACK_ROWS, PackedMatrix, matmul_packed, matmul_packed_segments,
    matmul_packed_segments_with_isa, matmul_packed_with_isa,
};
pub use pool::{
    num_threads, parallel_chunks_mut, parallel_for, parallel_ranges, parallel_rows2,
    set_num_threads,
};
pub use quant::{GgmlType, dequantize_row, quantize_row};
