//! The crate's plain value types: the instruction sets ([`Isa`]) and the
//! ggml tensor types ([`GgmlType`]).
//!
//! This module depends on no other module of the crate, so `error` can
//! name these types without a cycle. Behaviour that needs more lives
//! with its owner: CPU detection and the process-wide ISA choice
//! ([`Isa::is_supported`], [`crate::limit_isa`], parsing) in `cpu`, block
//! layouts and (de)quantisation in [`crate::quant`].

use std::fmt;

/// The instruction set a kernel implementation uses. Ordered: a CPU that
/// supports an ISA supports every smaller one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Portable scalar reference code.
    Scalar,
    /// AVX2 + FMA + F16C (256-bit).
    Avx2,
    /// AVX-512 F/BW/VL + VNNI (`vpdpbusd`), plus everything in `Avx2`.
    Avx512Vnni,
}

impl Isa {
    /// Every ISA, smallest first.
    pub const ALL: [Isa; 3] = [Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni];

    /// Short lowercase name.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512Vnni => "avx512vnni",
        }
    }
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Elements per K-quant super-block.
pub const QK_K: usize = 256;
/// Elements per Q4_0/Q4_1/Q8_0/Q8_1 block.
pub const QK: usize = 32;

/// A ggml tensor element type (block layouts: see [`crate::quant`]).
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q8_0,
    Q8_1,
    Q4_K,
    Q6_K,
    Q8_K,
    BF16,
}

impl GgmlType {
    /// All supported types.
    pub const ALL: [GgmlType; 11] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::Q8_K,
        GgmlType::BF16,
    ];

    /// Maps a ggml type id (as stored in GGUF) to a type; `None` if unsupported.
    pub fn from_ggml_id(id: u32) -> Option<GgmlType> {
        Some(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            8 => GgmlType::Q8_0,
            9 => GgmlType::Q8_1,
            12 => GgmlType::Q4_K,
            14 => GgmlType::Q6_K,
            15 => GgmlType::Q8_K,
            30 => GgmlType::BF16,
            _ => return None,
        })
    }

    /// The ggml type id.
    pub fn ggml_id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q8_0 => 8,
            GgmlType::Q8_1 => 9,
            GgmlType::Q4_K => 12,
            GgmlType::Q6_K => 14,
            GgmlType::Q8_K => 15,
            GgmlType::BF16 => 30,
        }
    }

    /// The ggml name ("F32", "Q4_1", ...).
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q8_1 => "Q8_1",
            GgmlType::Q4_K => "Q4_K",
            GgmlType::Q6_K => "Q6_K",
            GgmlType::Q8_K => "Q8_K",
            GgmlType::BF16 => "BF16",
        }
    }

    /// Elements per block.
    pub fn block_len(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::Q8_1 => {
                QK
            }
            GgmlType::Q4_K | GgmlType::Q6_K | GgmlType::Q8_K => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q5_0 => 22,
            GgmlType::Q8_0 => 34,
            GgmlType::Q8_1 => 36,
            GgmlType::Q4_K => 144,
            GgmlType::Q6_K => 210,
            GgmlType::Q8_K => 292,
        }
    }

    /// Bytes in a row of `n` elements; `None` if `n` is not a multiple of the
    /// block length or the size overflows.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_len()) {
            return None;
        }
        (n / self.block_len()).checked_mul(self.block_bytes())
    }

    /// The type ggml-cpu quantises activations to before the dot product.
    pub fn vec_dot_type(self) -> GgmlType {
        match self {
            GgmlType::F32 => GgmlType::F32,
            GgmlType::F16 => GgmlType::F16,
            GgmlType::BF16 => GgmlType::BF16,
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => GgmlType::Q8_0,
            GgmlType::Q4_1 | GgmlType::Q8_1 => GgmlType::Q8_1,
            GgmlType::Q4_K | GgmlType::Q6_K | GgmlType::Q8_K => GgmlType::Q8_K,
        }
    }

    /// Whether `matmul` accepts weights of this type.
    pub fn supports_matmul(self) -> bool {
        !matches!(self, GgmlType::Q8_1 | GgmlType::Q8_K)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
