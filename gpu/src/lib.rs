//! GPU kernels for Tandem, written once in CubeCL's Rust dialect.
//!
//! One kernel source serves every GPU target: CubeCL compiles it for
//! CUDA (its C++ backend, then NVRTC at run time, on NVIDIA GPUs with a
//! CUDA driver) and for Vulkan through wgpu (WGSL; any GPU, and on
//! machines without one Mesa's lavapipe, a Vulkan device on the CPU, which
//! is how CI runs these kernels; a test compiles every kernel's CUDA form
//! to PTX with NVRTC there). This crate holds the device handle
//! ([`GpuDevice`]), device buffers ([`Buffer`]) and the kernels the
//! forward pass needs ([`kernels`]), each checked against the CPU
//! reference in `tandem-kernels` by this crate's tests.
//!
//! [`llama::GpuModel`] runs a Llama-family model's batch steps on the
//! device over a paged KV pool there; [`runner`] puts it under the
//! engine's scheduler, on one GPU or as a tensor-parallel group whose
//! partial sums are added through host memory. Deliberately absent so far:
//! NCCL collectives on device buffers and KV pools registered with the
//! transport. See ARCHITECTURE.md.

mod cuda;
mod device;
mod error;
pub mod kernels;
pub mod llama;
pub mod runner;
mod runtime;
pub mod weights;

pub use device::{Buffer, GpuDevice, GpuRuntime, RuntimeAlreadyChosen, prefer_runtime};
pub use error::GpuError;
