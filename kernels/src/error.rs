//! Error type for the kernels crate.

use crate::types::{GgmlType, Isa};

/// Errors reported by the kernels. Bad input never panics; it returns one of these.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// A buffer had the wrong number of elements or bytes.
    #[error("{what}: expected length {expected}, got {actual}")]
    LengthMismatch {
        what: &'static str,
        expected: usize,
        actual: usize,
    },
    /// A row length is not a multiple of the type's block length.
    #[error("{ty:?}: {n} elements is not a multiple of the block length {block_len}")]
    NotBlockAligned {
        ty: GgmlType,
        n: usize,
        block_len: usize,
    },
    /// A size computation overflowed `usize`.
    #[error("size overflow: {0}")]
    Overflow(&'static str),
    /// The operation does not support this type.
    #[error("operation {op} does not support type {ty:?}")]
    UnsupportedType { op: &'static str, ty: GgmlType },
    /// An unknown ggml type id.
    #[error("unknown ggml type id {0}")]
    UnknownTypeId(u32),
    /// The requested instruction set is not available on this CPU.
    #[error("instruction set {requested} is not supported by this CPU (best: {available})")]
    UnsupportedIsa { requested: Isa, available: Isa },
    /// A name that is not one of [`Isa::name`]'s.
    #[error("unknown instruction set {0:?} (expected scalar, avx2 or avx512vnni)")]
    UnknownIsa(String),
    /// [`crate::limit_isa`] came after the kernels had chosen their ISA.
    #[error("kernels already use instruction set {current} (requested {requested})")]
    IsaAlreadyChosen { current: Isa, requested: Isa },
    /// A segmented matmul's segment count does not divide its blocks.
    #[error("{segments} column segments do not divide {blocks} blocks evenly")]
    Segments { segments: usize, blocks: usize },
    /// Thread count must be at least one.
    #[error("invalid thread count {0}")]
    InvalidThreadCount(usize),
    /// The worker pool was already built with a different size.
    #[error("thread pool already initialised with {current} threads (requested {requested})")]
    ThreadPoolAlreadyInitialized { current: usize, requested: usize },
    /// The worker pool could not be built.
    #[error("failed to build thread pool: {0}")]
    ThreadPool(String),
}
