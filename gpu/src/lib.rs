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
//! [`llama::GpuModel`] runs a Llama-family model's batch steps on the
//! device over a paged KV pool there; [`runner`] puts it under the
//! engine's scheduler, on one GPU or as a tensor-parallel group whose
//! partial sums are added through host memory. Deliberately absent so far:
//! the CUDA runtime, NCCL collectives on device buffers and KV pools
//! registered with the transport. See ARCHITECTURE.md.

mod device;
mod error;
pub mod kernels;
pub mod llama;
pub mod runner;
pub mod weights;

pub use device::{Buffer, GpuDevice};
pub use error::GpuError;
