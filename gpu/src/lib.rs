//! GPU kernels for Tandem, written once in CubeCL's Rust dialect.
//!
//! One kernel source serves every GPU target: CubeCL compiles it for
//! Vulkan through wgpu (WGSL; NVIDIA GPUs through their Vulkan driver, and
//! on machines without a GPU Mesa's lavapipe, a Vulkan device on the CPU,
//! which is how CI runs these kernels), and its C++ backend compiles the
//! same source to CUDA C++, which a test compiles to PTX with NVRTC.
//! CubeCL's CUDA runtime is not built in (it needs an LLVM bundle
//! downloaded at build time). This crate holds the device handle
//! ([`GpuDevice`]), device buffers ([`Buffer`]) and the kernels the
//! forward pass needs ([`kernels`]), each checked against the CPU
//! reference in `tandem-kernels` by this crate's tests.
//!
//! Deliberately absent so far: the engine's device backend (weights, KV
//! pool and activations resident on the device, driven by the scheduler),
//! the CUDA runtime and NCCL wiring. See ARCHITECTURE.md.

mod device;
mod error;
pub mod kernels;
pub mod llama;

pub use device::{Buffer, GpuDevice};
pub use error::GpuError;
