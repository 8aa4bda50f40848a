//! GPU kernels for Tandem, written once in CubeCL's Rust dialect.
//!
//! One kernel source serves every GPU target: CubeCL compiles it for
//! Vulkan through wgpu (WGSL in this build; on machines without a GPU,
//! Mesa's lavapipe is a Vulkan device on the CPU, which is how CI runs
//! these kernels), and its CUDA runtime compiles the same source to CUDA
//! C++ (not built into this crate yet). This crate holds the device handle
//! ([`GpuDevice`]), device buffers ([`Buffer`]) and the kernels the
//! forward pass needs ([`kernels`]), each checked against the CPU
//! reference in `tandem-kernels` by this crate's tests.
//!
//! Deliberately absent so far: the engine's device backend (weights, KV
//! pool and activations resident on the device), the CUDA runtime and
//! NCCL wiring. See ARCHITECTURE.md.

mod device;
mod error;
pub mod kernels;
pub mod llama;

pub use device::{Buffer, GpuDevice};
pub use error::GpuError;
