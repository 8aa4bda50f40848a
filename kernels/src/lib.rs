//! Compute kernels for Tandem. Knows nothing of models.
//!
//! Placeholder: filled in by the kernels work (quant formats, dequantize,
//! quantized dot products and matmul, runtime ISA dispatch).
