//! Row-interleaved ("packed") Q4_0 / Q4_1 / Q5_0 / Q8_0 weights and their
//! batched matmul.
//!
//! [`crate::matmul`] keeps ggml's per-block accumulation order (8 float lanes
//! per block, one FMA each), which costs about four vector operations per
//! 32 multiply-adds for every (row, token) pair, so batches hardly run
//! faster per token than one sequence. Here weights are repacked at load so
//! one 512-bit register holds the same 4 quantised values of 16 rows:
//! `vpdpbusd` with one activation group broadcast computes 16 rows' partial
//! integer dot products at once, the block's integer sums are complete after
//! 8 of them, and one convert plus one or two FMAs per block finish 16 rows.
//! Unpacked weights stay in registers across a tile of tokens.
//!
//! Numerics, identical for every batch size, tile and thread count: for
//! each (row, token) the block integer sum `isum` (of the signed quants
//! times the activation quants) is exact, and `acc = fma(isum as f32,
//! d_w * d_x, acc)` (then `acc = fma(m_w, s_x, acc)` for Q4_1) runs block
//! by block from `acc = 0`. Q4_0, Q5_0 and Q8_0 weights are stored
//! unsigned (nibble, 5-bit value, `q + 128`); the kernels subtract the
//! offset (8, 16, 128) times the block's activation sum, which keeps
//! `isum` exact. The scalar reference
//! [`matmul_packed_with_isa`]`(Isa::Scalar, ..)` performs exactly these
//! operations, and the fast kernel is tested bitwise against it. The order
//! differs from ggml's, so results are close to, not equal to,
//! [`crate::matmul`]'s.
//!
//! AVX2 CPUs run the same layout in 256-bit halves (rows 0-7, then 8-15):
//! `vpmaddubsw` + `vpmaddwd` stand in for `vpdpbusd`. Q4_0's and Q4_1's
//! products are small enough to sum eight of them in 16 bits before
//! widening, Q5_0's four; Q8_0's
//! weights go back to signed and multiply by sign-adjusted activations
//! (`|w| * sign(w) x`), whose pair sums cannot saturate 16 bits. The integer
//! sums are the same exact values, so the result is bitwise that of the
//! reference too. Scalar-only CPUs keep the ggml-order kernels (see
//! [`PackedMatrix::pack`]).
//!
//! Q4_K and Q6_K work on their 256-element super-blocks against Q8_K
//! activations (`d_x` f32), one record per 16 rows and super-block. Q4_K:
//! `isum = sum_s sc_s * sum_{e in s} q_e x_e` over its eight 32-element
//! sub-blocks and `msum = sum_s m_s * sum_{e in s} x_e`, both exact in
//! i32, then `acc = fma(isum as f32, d_w * d_x, acc)` and `acc =
//! fma(-msum as f32, dmin_w * d_x, acc)`. Q6_K: `isum = sum_s sc_s *
//! sum_{e in s} (q_e - 32) x_e` over its sixteen 16-element sub-blocks
//! (|isum| < 2^28), then `acc = fma(isum as f32, d_w * d_x, acc)`. The
//! kernels get the sub-block sums from `vpdpbusd` (AVX2: `vpmaddubsw`
//! pairs, at most 30720 resp. 32640 in 16 bits), and scale them by the
//! rows' sub-block scales with `vpmulld` (AVX2: `vpmaddwd` against the
//! scale in both halves of the lane); Q4_K's mins use `vpdpwssd` (AVX2:
//! `vpmaddwd`). Q6_K's weights are stored as signed `q - 32`, one byte
//! each, and multiply the activations shifted to unsigned (`x + 128`):
//! the packed record carries each row's `128 * sum_s sc_s * sum_{e in s}
//! (q_e - 32)`, subtracted once per block, so `isum` is the same exact
//! value. Segments must span whole super-blocks.

use crate::cpu::{self, Isa};
use crate::dot::{self, ActScratch, Acts};
use crate::error::KernelError;
use crate::matmul::QMatrix;
use crate::pool;
use crate::quant::{self, GgmlType, QK, QK_K};

/// Rows interleaved per group.
pub const PACK_ROWS: usize = 16;
/// Tokens per register tile.
const TILE_TOKENS: usize = 8;
/// Below this many multiply-adds the product runs on the calling thread.
const PAR_MIN_WORK: usize = 1 << 16;

/// A weight matrix repacked in groups of [`PACK_ROWS`] rows. Per group and
/// block, one record: the 16 rows' `d` (f16), for Q4_1 their `m` (f16),
/// then the quants as chunks of 64 bytes, each holding 4 bytes of every
/// row (Q4_0, Q4_1, Q5_0: 4 chunks, low nibbles are elements `4c..4c+4`,
/// high nibbles `16+4c..`; Q8_0: 8 chunks of `q + 128`). Q5_0 follows with
/// eight 64-bit masks, one per 4-element group `v` (elements `4v..4v+4`),
/// whose bit `4r + k` is the fifth bit of row `r`'s element `4v + k`.
/// Rows past `rows` are zero.
#[derive(Clone)]
pub struct PackedMatrix {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
}

impl std::fmt::Debug for PackedMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedMatrix")
            .field("ty", &self.ty)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish()
    }
}

/// The rows being packed, from one or more matrices.
struct Rows<'a> {
    ty: GgmlType,
    cols: usize,
    rows: Vec<&'a [u8]>,
}

/// Bytes of one (group, block) record.
fn record_bytes(ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q4_0 => PACK_ROWS * (2 + QK / 2),
        GgmlType::Q4_1 => PACK_ROWS * (2 + 2 + QK / 2),
        GgmlType::Q5_0 => PACK_ROWS * (2 + QK / 2 + QK / 8),
        GgmlType::Q4_K => Q4K_QUANTS + PACK_ROWS * QK_K / 2,
        GgmlType::Q6_K => Q6K_QUANTS + PACK_ROWS * QK_K,
        _ => PACK_ROWS * (2 + QK),
    }
}

// Q4_K record: d[16], dmin[16] (f16), the 8 sub-block scales `u8[8][16]`
// (sub-block, row), the mins as `u8[4][16][2]` (sub-block pair, row, which
// of the pair), then 32 quant chunks `(c, k)`: row r's `qs[32c + 4k..+4]`,
// low nibbles sub-block 2c, high nibbles 2c + 1.
const Q4K_SCALES: usize = 64;
const Q4K_MINS: usize = 192;
const Q4K_QUANTS: usize = 320;
// Q6_K record: d[16] (f16), the 16 sub-block scales `i8[16][16]`
// (sub-block, row), the rows' offset corrections (i32[16], see
// `pack_block`), then 64 quant chunks `k`: row r's elements `4k..4k+4` as
// `q - 32` (i8).
const Q6K_SCALES: usize = 32;
const Q6K_CORR: usize = 288;
const Q6K_QUANTS: usize = 352;

/// The 6-bit quant (0..64) of element `e` of a Q6_K block.
fn q6k_quant(blk: &[u8], e: usize) -> u8 {
    let (h, c, l) = (e / 128, (e % 128) / 32, e % 32);
    let ql = blk[64 * h + 32 * (c % 2) + l];
    let nib = if c < 2 { ql & 0x0F } else { ql >> 4 };
    nib | (((blk[128 + 32 * h + l] >> (2 * c)) & 3) << 4)
}

/// Whether the packed kernels take this type.
fn packable(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q5_0
            | GgmlType::Q8_0
            | GgmlType::Q4_K
            | GgmlType::Q6_K
    )
}

/// What the stored (unsigned) quants of `ty` exceed the signed ones by; the
/// kernels subtract it times the block's activation sum.
fn quant_offset(ty: GgmlType) -> i32 {
    match ty {
        GgmlType::Q4_0 => 8,
        GgmlType::Q5_0 => 16,
        GgmlType::Q8_0 => 128,
        _ => 0,
    }
}

/// Type codes: the SIMD tiles' const generic parameter.
const K_Q4_1: u8 = 0;
const K_Q8_0: u8 = 1;
const K_Q4_0: u8 = 2;
const K_Q5_0: u8 = 3;
const K_Q4_K: u8 = 4;
const K_Q6_K: u8 = 5;

/// `ty`'s type code (packable types only).
fn kind(ty: GgmlType) -> u8 {
    match ty {
        GgmlType::Q4_1 => K_Q4_1,
        GgmlType::Q4_0 => K_Q4_0,
        GgmlType::Q5_0 => K_Q5_0,
        GgmlType::Q4_K => K_Q4_K,
        GgmlType::Q6_K => K_Q6_K,
        _ => K_Q8_0,
    }
}

/// Offset of Q5_0's fifth-bit masks in a record.
const Q5_MASKS: usize = PACK_ROWS * (2 + QK / 2);

/// Writes row `r`'s block `blk` (ggml layout) into the record `out`.
fn pack_block(ty: GgmlType, out: &mut [u8], r: usize, blk: &[u8]) {
    match ty {
        GgmlType::Q4_K => return pack_q4_k(out, r, blk),
        GgmlType::Q6_K => return pack_q6_k(out, r, blk),
        _ => {}
    }
    out[r * 2..r * 2 + 2].copy_from_slice(&blk[0..2]);
    // Nibble chunks: where they start in the record and in the block.
    let nibbles = match ty {
        GgmlType::Q4_0 => Some((32, 2)),
        GgmlType::Q4_1 => {
            out[32 + r * 2..32 + r * 2 + 2].copy_from_slice(&blk[2..4]);
            Some((64, 4))
        }
        GgmlType::Q5_0 => Some((32, 6)),
        _ => None,
    };
    if let Some((dst0, src0)) = nibbles {
        for c in 0..4 {
            let dst = dst0 + c * 64 + r * 4;
            out[dst..dst + 4].copy_from_slice(&blk[src0 + c * 4..src0 + c * 4 + 4]);
        }
    } else {
        for c in 0..8 {
            let dst = 32 + c * 64 + r * 4;
            for k in 0..4 {
                out[dst + k] = blk[2 + c * 4 + k] ^ 0x80;
            }
        }
    }
    if ty == GgmlType::Q5_0 {
        let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
        for v in 0..8 {
            let at = Q5_MASKS + 8 * v;
            let mut mask = u64::from_le_bytes(out[at..at + 8].try_into().unwrap_or([0; 8]));
            for k in 0..4 {
                mask |= u64::from((qh >> (4 * v + k)) & 1) << (4 * r + k);
            }
            out[at..at + 8].copy_from_slice(&mask.to_le_bytes());
        }
    }
}

fn pack_q4_k(out: &mut [u8], r: usize, blk: &[u8]) {
    out[r * 2..r * 2 + 2].copy_from_slice(&blk[0..2]);
    out[32 + r * 2..32 + r * 2 + 2].copy_from_slice(&blk[2..4]);
    for s in 0..8 {
        let (sc, mn) = quant::scale_min_k4(s, &blk[4..16]);
        out[Q4K_SCALES + s * 16 + r] = sc;
        out[Q4K_MINS + (s / 2) * 32 + r * 2 + s % 2] = mn;
    }
    for ck in 0..32 {
        let dst = Q4K_QUANTS + ck * 64 + r * 4;
        out[dst..dst + 4].copy_from_slice(&blk[16 + ck * 4..16 + ck * 4 + 4]);
    }
}

/// Also stores the row's correction `128 * sum_s sc_s * sum_{e in s} (q_e -
/// 32)`: the kernels multiply the weights by activations shifted to
/// unsigned (`x + 128`) and subtract it.
fn pack_q6_k(out: &mut [u8], r: usize, blk: &[u8]) {
    out[r * 2..r * 2 + 2].copy_from_slice(&blk[208..210]);
    let mut corr = 0i32;
    for s in 0..16 {
        let sc = blk[192 + s] as i8;
        out[Q6K_SCALES + s * 16 + r] = sc as u8;
        let sum: i32 = (16 * s..16 * s + 16)
            .map(|e| i32::from(q6k_quant(blk, e)) - 32)
            .sum();
        corr += i32::from(sc) * sum;
    }
    out[Q6K_CORR + r * 4..Q6K_CORR + r * 4 + 4].copy_from_slice(&(128 * corr).to_le_bytes());
    for e in 0..QK_K {
        let w = (i32::from(q6k_quant(blk, e)) - 32) as i8;
        out[Q6K_QUANTS + (e / 4) * 64 + r * 4 + e % 4] = w as u8;
    }
}

impl PackedMatrix {
    /// Repacks `w` when the kernels have a packed fast path here (AVX2 or
    /// AVX-512 VNNI) and `w` is Q4_0, Q4_1, Q5_0 or Q8_0; `None` otherwise
    /// (keep using [`crate::matmul`]).
    pub fn pack(w: &QMatrix<'_>) -> Option<PackedMatrix> {
        if cpu::isa() < Isa::Avx2 {
            return None;
        }
        Self::pack_any_cpu(w)
    }

    /// [`PackedMatrix::pack`] regardless of the CPU (tests, the scalar path).
    pub fn pack_any_cpu(w: &QMatrix<'_>) -> Option<PackedMatrix> {
        Self::pack_concat_any_cpu(std::slice::from_ref(w))
    }

    /// The rows of `parts`, in order, as one packed matrix (fused
    /// projections: one call, one activation quantisation). `None` under
    /// the conditions of [`PackedMatrix::pack`], or when the parts differ
    /// in type or columns.
    pub fn pack_concat(parts: &[QMatrix<'_>]) -> Option<PackedMatrix> {
        if cpu::isa() < Isa::Avx2 {
            return None;
        }
        Self::pack_concat_any_cpu(parts)
    }

    /// [`PackedMatrix::pack_concat`] regardless of the CPU.
    pub fn pack_concat_any_cpu(parts: &[QMatrix<'_>]) -> Option<PackedMatrix> {
        let first = parts.first()?;
        if parts
            .iter()
            .any(|p| p.ty != first.ty || p.cols != first.cols)
            || !packable(first.ty)
            || first.cols == 0
            || !first.cols.is_multiple_of(first.ty.block_len())
        {
            return None;
        }
        let mut rows = Vec::new();
        for p in parts {
            rows.extend((0..p.rows).map(|r| p.row(r)));
        }
        if rows.is_empty() {
            return None;
        }
        let w = Rows {
            ty: first.ty,
            cols: first.cols,
            rows,
        };
        let (nb, bb) = (w.cols / w.ty.block_len(), w.ty.block_bytes());
        let n_rows = w.rows.len();
        let groups = n_rows.div_ceil(PACK_ROWS);
        let rec = record_bytes(w.ty);
        let mut data = vec![0u8; groups * nb * rec];
        for g in 0..groups {
            for b in 0..nb {
                let out = &mut data[(g * nb + b) * rec..(g * nb + b + 1) * rec];
                // Padded rows keep zero scales (and quants): they compute 0.
                for r in 0..PACK_ROWS.min(n_rows - g * PACK_ROWS) {
                    let blk = &w.rows[g * PACK_ROWS + r][b * bb..(b + 1) * bb];
                    pack_block(w.ty, out, r, blk);
                }
            }
        }
        Some(PackedMatrix {
            ty: w.ty,
            rows: n_rows,
            cols: w.cols,
            data,
        })
    }

    pub fn ty(&self) -> GgmlType {
        self.ty
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    fn groups(&self) -> usize {
        self.rows.div_ceil(PACK_ROWS)
    }

    /// Blocks per row.
    fn nb(&self) -> usize {
        self.cols / self.ty.block_len()
    }
}

/// `out[i * rows + r] = sum_k w[r, k] * x[i * cols + k]` for `i < m`, with
/// the packed kernel of this CPU.
pub fn matmul_packed(
    w: &PackedMatrix,
    x: &[f32],
    m: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    matmul_packed_segments(w, x, m, 1, out)
}

/// The product split into `segments` equal column segments, each summed on
/// its own: `out[(s * m + i) * rows + r] = sum_{k in segment s} w[r, k] *
/// x[i * cols + k]`. Bitwise what [`matmul_packed`] computes for each
/// segment's columns packed as their own matrix, in one call (one
/// activation quantisation, one dispatch, no copy of segment columns).
/// Each segment must span whole blocks of 32 columns.
pub fn matmul_packed_segments(
    w: &PackedMatrix,
    x: &[f32],
    m: usize,
    segments: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    matmul_packed_segments_with_isa(cpu::isa(), w, x, m, segments, out)
}

/// [`matmul_packed`] with a forced implementation (`Scalar` is the
/// reference).
pub fn matmul_packed_with_isa(
    isa: Isa,
    w: &PackedMatrix,
    x: &[f32],
    m: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    matmul_packed_segments_with_isa(isa, w, x, m, 1, out)
}

/// [`matmul_packed_segments`] with a forced implementation.
pub fn matmul_packed_segments_with_isa(
    isa: Isa,
    w: &PackedMatrix,
    x: &[f32],
    m: usize,
    segments: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    packed_impl(isa, w, x, m, segments, out, pool::num_threads())
}

/// `parts` only shapes the split of row groups (one part per pool worker
/// in production); results never depend on it.
fn packed_impl(
    isa: Isa,
    w: &PackedMatrix,
    x: &[f32],
    m: usize,
    segments: usize,
    out: &mut [f32],
    parts: usize,
) -> Result<(), KernelError> {
    if !isa.is_supported() {
        return Err(KernelError::UnsupportedIsa {
            requested: isa,
            available: cpu::isa(),
        });
    }
    if segments == 0 || !w.nb().is_multiple_of(segments) {
        return Err(KernelError::Segments {
            segments,
            blocks: w.nb(),
        });
    }
    let per_segment = out.len() / segments;
    if per_segment * segments != out.len() {
        return Err(KernelError::LengthMismatch {
            what: "matmul output",
            expected: per_segment * segments,
            actual: out.len(),
        });
    }
    let on = crate::matmul::check_io(w.rows, w.cols, x.len(), m, per_segment)?;
    if on == 0 {
        return Ok(());
    }
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut scratch) => run(isa, w, x, m, segments, out, parts, &mut scratch),
        // Only reachable if a matmul re-entered itself on this thread.
        Err(_) => run(
            isa,
            w,
            x,
            m,
            segments,
            out,
            parts,
            &mut ActScratch::default(),
        ),
    })
}

thread_local! {
    /// Quantised activations of the current call (the calling thread's).
    static SCRATCH: std::cell::RefCell<ActScratch> = std::cell::RefCell::new(ActScratch::default());
}

#[allow(clippy::too_many_arguments)]
fn run(
    isa: Isa,
    w: &PackedMatrix,
    x: &[f32],
    m: usize,
    segments: usize,
    out: &mut [f32],
    parts: usize,
    scratch: &mut ActScratch,
) -> Result<(), KernelError> {
    let acts = dot::prepare_acts(w.ty, x, m, w.cols, scratch);
    let Acts::Q8(a) = &acts else {
        return Err(KernelError::UnsupportedType {
            op: "packed matmul",
            ty: w.ty,
        });
    };
    // Offset quants: the kernels subtract the offset times sum(x_q).
    let xsum: Vec<i32> = if quant_offset(w.ty) != 0 {
        a.qs.chunks_exact(QK)
            .map(|c| c.iter().map(|&v| i32::from(v)).sum())
            .collect()
    } else {
        Vec::new()
    };
    // Q6_K multiplies its signed weights by the activations made unsigned.
    let xu: Vec<u8> = if w.ty == GgmlType::Q6_K {
        a.qs.iter().map(|&v| (v as u8) ^ 0x80).collect()
    } else {
        Vec::new()
    };
    // Q4_K's mins need the activation sums of its 32-element sub-blocks.
    let xs: Vec<i16> = if w.ty == GgmlType::Q4_K {
        a.bsums
            .chunks_exact(2)
            .map(|p| p[0].wrapping_add(p[1]))
            .collect()
    } else {
        Vec::new()
    };
    let ctx = Ctx::new(
        w,
        a,
        Extra {
            xsum: &xsum,
            xu: &xu,
            xs: &xs,
        },
        m,
        segments,
    );
    let groups = w.groups();
    let work = w.rows.saturating_mul(w.cols).saturating_mul(m);
    let parts = if work >= PAR_MIN_WORK {
        parts.clamp(1, groups)
    } else {
        1
    };
    let op = OutPtr(out.as_mut_ptr());
    let part = |p: usize| {
        for g in pool::split(groups, parts, p) {
            // SAFETY: `isa` is supported (checked on entry) and `g < groups`
            // (`split`); `out` holds `segments x m x rows` values (checked on
            // entry), group `g` writes only rows g*16..g*16+16 (clamped) of
            // each output row, and each group belongs to one part.
            unsafe { ctx.group(isa, g, op) };
        }
    };
    if parts == 1 {
        part(0);
    } else {
        pool::parallel_for(parts, &part);
    }
    Ok(())
}

/// A raw output pointer shared by the parts, which write disjoint rows.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: parts write pairwise disjoint elements; the caller holds the
// unique borrow until every part is done.
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

/// Per-call activation data some types need besides the quantised
/// activations: Q4_0/Q5_0/Q8_0 block sums (`xsum`, per 32 elements), Q6_K
/// activations made unsigned (`xu`, `x + 128`), Q4_K sub-block sums (`xs`,
/// per 32 elements). Empty where unused.
struct Extra<'a> {
    xsum: &'a [i32],
    xu: &'a [u8],
    xs: &'a [i16],
}

/// Everything a group computation reads. Built by [`Ctx::new`] only,
/// which checks the sizes the SIMD tiles rely on.
struct Ctx<'a> {
    w: &'a PackedMatrix,
    qs: &'a [i8],
    d: &'a [f32],
    s: &'a [f32],
    xsum: &'a [i32],
    xu: &'a [u8],
    xs: &'a [i16],
    m: usize,
    /// Column segments, each reduced on its own (`nb` divides evenly).
    segments: usize,
}

impl<'a> Ctx<'a> {
    /// The context of `m` tokens' activations `a` (with their Q8_0 sums
    /// `xsum`) against `w`, in `segments` column segments.
    ///
    /// # Panics
    /// If a buffer is too short for `m` tokens or `segments` does not divide
    /// the blocks: the tiles read them unchecked, so this check (once per
    /// call) is what keeps them in bounds.
    fn new(
        w: &'a PackedMatrix,
        a: &'a dot::ActQ8,
        extra: Extra<'a>,
        m: usize,
        segments: usize,
    ) -> Self {
        let Extra { xsum, xu, xs } = extra;
        let (nb, cols) = (w.nb(), w.cols);
        let covers =
            |len: usize, per_token: usize| m.checked_mul(per_token).is_some_and(|need| len >= need);
        assert!(
            packable(w.ty) && w.data.len() == w.groups() * nb * record_bytes(w.ty),
            "malformed packed matrix"
        );
        assert!(
            covers(a.qs.len(), cols) && covers(a.d.len(), nb),
            "activations too short"
        );
        match w.ty {
            GgmlType::Q4_1 => assert!(covers(a.s.len(), nb), "activation sums too short"),
            GgmlType::Q4_K => assert!(covers(xs.len(), nb * 8), "activation sums too short"),
            GgmlType::Q6_K => assert!(covers(xu.len(), cols), "activations too short"),
            _ => assert!(covers(xsum.len(), nb), "activation sums too short"),
        }
        assert!(
            segments > 0 && nb.is_multiple_of(segments),
            "segments must divide the blocks"
        );
        Ctx {
            w,
            qs: &a.qs,
            d: &a.d,
            s: &a.s,
            xsum,
            xu,
            xs,
            m,
            segments,
        }
    }

    /// Computes rows `16g..16g+16` (clamped) of every segment for every
    /// token into `out`.
    ///
    /// # Safety
    /// `isa` must be supported by the CPU ([`Isa::is_supported`]) and
    /// `g < self.w.groups()`; `out` must point at a `segments x m x rows`
    /// f32 buffer whose rows of group `g` no other thread accesses meanwhile.
    unsafe fn group(&self, isa: Isa, g: usize, out: OutPtr) {
        let rows = self.w.rows;
        let valid = (rows - g * PACK_ROWS).min(PACK_ROWS);
        let seg_nb = self.w.nb() / self.segments;
        // Every tile writes its first `n` rows whole (the scalar one zeroes
        // them first), so one buffer serves the group's tiles.
        let mut acc = [[0.0f32; PACK_ROWS]; TILE_TOKENS];
        let mut i0 = 0;
        while i0 < self.m {
            let n = TILE_TOKENS.min(self.m - i0);
            for s in 0..self.segments {
                let blocks = s * seg_nb..(s + 1) * seg_nb;
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx512Vnni => {
                        // SAFETY: CPU support and `g` checked by the caller,
                        // sizes by `Ctx::new`; `blocks` lies in `0..nb` and
                        // `i0 + n <= m` with `1 <= n <= TILE_TOKENS`.
                        unsafe { avx512::tile(self, g, blocks, i0, n, &mut acc) }
                    }
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 => {
                        // SAFETY: as above.
                        unsafe { avx2::tile(self, g, blocks, i0, n, &mut acc) }
                    }
                    _ => self.tile_scalar(g, blocks, i0, n, &mut acc),
                }
                for (j, a) in acc.iter().enumerate().take(n) {
                    let base = (s * self.m + i0 + j) * rows + g * PACK_ROWS;
                    // SAFETY: `valid` values from `base` are in bounds
                    // (segments x m x rows) and owned by this group; a
                    // constant count keeps the usual full group a plain
                    // vector move.
                    unsafe {
                        if valid == PACK_ROWS {
                            std::ptr::copy_nonoverlapping(a.as_ptr(), out.0.add(base), PACK_ROWS);
                        } else {
                            std::ptr::copy_nonoverlapping(a.as_ptr(), out.0.add(base), valid);
                        }
                    }
                }
            }
            i0 += n;
        }
    }

    /// [`Ctx::tile_scalar`] for Q4_K and Q6_K: per (row, token) and block
    /// the exact integer sums, then the float epilogue.
    fn tile_scalar_k(
        &self,
        g: usize,
        blocks: std::ops::Range<usize>,
        i0: usize,
        n: usize,
        acc: &mut [[f32; PACK_ROWS]; TILE_TOKENS],
    ) {
        let (nb, cols, ty) = (self.w.nb(), self.w.cols, self.w.ty);
        let rec = record_bytes(ty);
        for b in blocks {
            let r0 = (g * nb + b) * rec;
            let data = &self.w.data[r0..r0 + rec];
            let f16 =
                |off: usize| quant::f16_bits_to_f32(u16::from_le_bytes([data[off], data[off + 1]]));
            for (j, accj) in acc.iter_mut().enumerate().take(n) {
                let t = i0 + j;
                let x = &self.qs[t * cols + b * QK_K..t * cols + (b + 1) * QK_K];
                let dx = self.d[t * nb + b];
                for (r, a) in accj.iter_mut().enumerate() {
                    let dw = f16(r * 2);
                    if ty == GgmlType::Q4_K {
                        let (mut isum, mut msum) = (0i32, 0i32);
                        for s in 0..8 {
                            let (c, hi) = (s / 2, s % 2 == 1);
                            let mut dp = 0i32;
                            for (i, &xe) in x[32 * s..32 * s + 32].iter().enumerate() {
                                let byte = data[Q4K_QUANTS + (c * 8 + i / 4) * 64 + r * 4 + i % 4];
                                let q = if hi { byte >> 4 } else { byte & 0x0F };
                                dp += i32::from(q) * i32::from(xe);
                            }
                            let xsub: i32 =
                                x[32 * s..32 * s + 32].iter().map(|&v| i32::from(v)).sum();
                            isum += i32::from(data[Q4K_SCALES + s * 16 + r]) * dp;
                            msum += i32::from(data[Q4K_MINS + (s / 2) * 32 + r * 2 + s % 2]) * xsub;
                        }
                        let dmw = f16(32 + r * 2);
                        *a = (isum as f32).mul_add(dw * dx, *a);
                        *a = ((-msum) as f32).mul_add(dmw * dx, *a);
                    } else {
                        let mut isum = 0i32;
                        for s in 0..16 {
                            let mut dp = 0i32;
                            for (i, &xe) in x[16 * s..16 * s + 16].iter().enumerate() {
                                let e = 16 * s + i;
                                let w = data[Q6K_QUANTS + (e / 4) * 64 + r * 4 + e % 4] as i8;
                                dp += i32::from(w) * i32::from(xe);
                            }
                            isum += i32::from(data[Q6K_SCALES + s * 16 + r] as i8) * dp;
                        }
                        *a = (isum as f32).mul_add(dw * dx, *a);
                    }
                }
            }
        }
    }

    /// The reference: the exact operation sequence the SIMD kernel runs.
    /// Overwrites the first `n` rows of `acc`, as the SIMD tiles do.
    fn tile_scalar(
        &self,
        g: usize,
        blocks: std::ops::Range<usize>,
        i0: usize,
        n: usize,
        acc: &mut [[f32; PACK_ROWS]; TILE_TOKENS],
    ) {
        for a in acc.iter_mut().take(n) {
            a.fill(0.0);
        }
        let (nb, cols, ty) = (self.w.nb(), self.w.cols, self.w.ty);
        let rec = record_bytes(ty);
        if matches!(ty, GgmlType::Q4_K | GgmlType::Q6_K) {
            return self.tile_scalar_k(g, blocks, i0, n, acc);
        }
        for b in blocks {
            let r0 = (g * nb + b) * rec;
            let data = &self.w.data[r0..r0 + rec];
            for (j, accj) in acc.iter_mut().enumerate().take(n) {
                let t = i0 + j;
                let x = &self.qs[t * cols + b * QK..t * cols + (b + 1) * QK];
                let dx = self.d[t * nb + b];
                for (r, a) in accj.iter_mut().enumerate() {
                    let f16 = |off: usize| {
                        quant::f16_bits_to_f32(u16::from_le_bytes([data[off], data[off + 1]]))
                    };
                    let dw = f16(r * 2);
                    let mut isum = 0i32;
                    if ty == GgmlType::Q8_0 {
                        for c in 0..8 {
                            for k in 0..4 {
                                let q = i32::from(data[32 + c * 64 + r * 4 + k]) - 128;
                                isum += q * i32::from(x[c * 4 + k]);
                            }
                        }
                    } else {
                        let base = if ty == GgmlType::Q4_1 { 64 } else { 32 };
                        let off = quant_offset(ty);
                        // The 5-bit value of element e (the nibble for Q4s).
                        let quant = |e: usize| {
                            let (v, k) = (e / 4, e % 4);
                            let byte = data[base + (v % 4) * 64 + r * 4 + k];
                            let nib = if v < 4 { byte & 0x0F } else { byte >> 4 };
                            let mut q = i32::from(nib);
                            if ty == GgmlType::Q5_0 {
                                let at = Q5_MASKS + 8 * v;
                                let mask = u64::from_le_bytes(
                                    data[at..at + 8].try_into().unwrap_or([0; 8]),
                                );
                                q |= (((mask >> (4 * r + k)) & 1) as i32) << 4;
                            }
                            q
                        };
                        for (e, &xe) in x.iter().enumerate() {
                            isum += (quant(e) - off) * i32::from(xe);
                        }
                    }
                    *a = (isum as f32).mul_add(dw * dx, *a);
                    if ty == GgmlType::Q4_1 {
                        *a = f16(32 + r * 2).mul_add(self.s[t * nb + b], *a);
                    }
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::{
        Ctx, K_Q4_0, K_Q4_1, K_Q4_K, K_Q5_0, K_Q6_K, K_Q8_0, PACK_ROWS, Q4K_MINS, Q4K_QUANTS,
        Q4K_SCALES, Q5_MASKS, Q6K_CORR, Q6K_QUANTS, Q6K_SCALES, QK, QK_K, TILE_TOKENS, kind,
        quant_offset, record_bytes,
    };

    /// One group's 16 rows over `blocks` for tokens `i0..i0 + n` (`1 <= n
    /// <= TILE_TOKENS`).
    ///
    /// # Safety
    /// The CPU must support AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C; `c`
    /// must come from `Ctx::new`, `g < c.w.groups()`, `blocks` must lie in
    /// `0..c.w.nb()`, and `1 <= n <= TILE_TOKENS` with `i0 + n <= c.m`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn tile(
        c: &Ctx<'_>,
        g: usize,
        blocks: Range<usize>,
        i0: usize,
        n: usize,
        out: &mut [[f32; PACK_ROWS]; TILE_TOKENS],
    ) {
        // Monomorphised per type and token count so accumulators stay in
        // registers.
        macro_rules! by_count {
            ($t:expr; $($n:literal)*) => {
                match n {
                    $($n => unsafe { tile_n::<$n, { $t }>(c, g, blocks, i0, out) },)*
                    _ => unsafe { tile_n::<TILE_TOKENS, { $t }>(c, g, blocks, i0, out) },
                }
            };
        }
        match kind(c.w.ty) {
            K_Q4_1 => by_count!(K_Q4_1; 1 2 3 4 5 6 7),
            K_Q4_0 => by_count!(K_Q4_0; 1 2 3 4 5 6 7),
            K_Q5_0 => by_count!(K_Q5_0; 1 2 3 4 5 6 7),
            K_Q4_K => by_count!(K_Q4_K; 1 2 3 4 5 6 7),
            K_Q6_K => by_count!(K_Q6_K; 1 2 3 4 5 6 7),
            _ => by_count!(K_Q8_0; 1 2 3 4 5 6 7),
        }
    }

    /// [`tile`] for exactly `N` tokens of Q4_K weights: per sub-block of 32
    /// the rows' exact `vpdpbusd` sums times their scales (`vpmulld`), the
    /// mins times the activation sub-block sums with `vpdpwssd`.
    ///
    /// # Safety
    /// As [`tile`], with `N` for `n`, for a Q4_K matrix.
    // Token indices address several arrays at once.
    #[allow(clippy::needless_range_loop)]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn tile_q4_k<const N: usize>(
        c: &Ctx<'_>,
        g: usize,
        blocks: Range<usize>,
        i0: usize,
        out: &mut [[f32; PACK_ROWS]; TILE_TOKENS],
    ) {
        let (nb, cols) = (c.w.nb(), c.w.cols);
        let rec = record_bytes(c.w.ty);
        let mut acc = [_mm512_setzero_ps(); N];
        let low = _mm512_set1_epi8(0x0F);
        let base = c.w.data.as_ptr();
        // SAFETY (whole body): record offsets stay inside `data` (groups x
        // nb records of `rec` bytes), activation offsets inside `qs`, `d`
        // and `xs` (m x cols, m x nb, m x nb x 8) because i0 + N <= m.
        unsafe {
            for b in blocks {
                let r = base.add((g * nb + b) * rec);
                let x: [*const i32; N] = std::array::from_fn(|j| {
                    c.qs.as_ptr().add((i0 + j) * cols + b * QK_K).cast::<i32>()
                });
                let mut isum = [_mm512_setzero_si512(); N];
                for s in 0..8 {
                    let mut dp = [_mm512_setzero_si512(); N];
                    for k in 0..8 {
                        let raw =
                            _mm512_loadu_si512(r.add(Q4K_QUANTS + ((s / 2) * 8 + k) * 64).cast());
                        let wv = if s % 2 == 0 {
                            _mm512_and_si512(raw, low)
                        } else {
                            _mm512_and_si512(_mm512_srli_epi16::<4>(raw), low)
                        };
                        for j in 0..N {
                            let xb = _mm512_set1_epi32(x[j].add(8 * s + k).read_unaligned());
                            dp[j] = _mm512_dpbusd_epi32(dp[j], wv, xb);
                        }
                    }
                    let sc =
                        _mm512_cvtepu8_epi32(_mm_loadu_si128(r.add(Q4K_SCALES + s * 16).cast()));
                    for j in 0..N {
                        isum[j] = _mm512_add_epi32(isum[j], _mm512_mullo_epi32(dp[j], sc));
                    }
                }
                let mut msum = [_mm512_setzero_si512(); N];
                for p in 0..4 {
                    let mn =
                        _mm512_cvtepu8_epi16(_mm256_loadu_si256(r.add(Q4K_MINS + p * 32).cast()));
                    for j in 0..N {
                        let xs = c.xs.as_ptr().add(((i0 + j) * nb + b) * 8 + 2 * p);
                        let xb = _mm512_set1_epi32(xs.cast::<i32>().read_unaligned());
                        msum[j] = _mm512_dpwssd_epi32(msum[j], mn, xb);
                    }
                }
                let dw = _mm512_cvtph_ps(_mm256_loadu_si256(r.cast()));
                let dmw = _mm512_cvtph_ps(_mm256_loadu_si256(r.add(32).cast()));
                for j in 0..N {
                    let dx = _mm512_set1_ps(*c.d.get_unchecked((i0 + j) * nb + b));
                    let neg = _mm512_sub_epi32(_mm512_setzero_si512(), msum[j]);
                    acc[j] =
                        _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[j]), _mm512_mul_ps(dw, dx), acc[j]);
                    acc[j] =
                        _mm512_fmadd_ps(_mm512_cvtepi32_ps(neg), _mm512_mul_ps(dmw, dx), acc[j]);
                }
            }
            for (o, a) in out.iter_mut().zip(&acc) {
                _mm512_storeu_ps(o.as_mut_ptr(), *a);
            }
        }
    }

    /// [`tile`] for exactly `N` tokens of Q6_K weights: signed weights times
    /// the activations made unsigned, per sub-block of 16 the rows' exact
    /// `vpdpbusd` sums times their scales, less the packed correction.
    ///
    /// # Safety
    /// As [`tile`], with `N` for `n`, for a Q6_K matrix.
    // Token indices address several arrays at once.
    #[allow(clippy::needless_range_loop)]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn tile_q6_k<const N: usize>(
        c: &Ctx<'_>,
        g: usize,
        blocks: Range<usize>,
        i0: usize,
        out: &mut [[f32; PACK_ROWS]; TILE_TOKENS],
    ) {
        let (nb, cols) = (c.w.nb(), c.w.cols);
        let rec = record_bytes(c.w.ty);
        let mut acc = [_mm512_setzero_ps(); N];
        let base = c.w.data.as_ptr();
        // SAFETY (whole body): record offsets stay inside `data` (groups x
        // nb records of `rec` bytes), activation offsets inside `xu` and
        // `d` (m x cols, m x nb) because i0 + N <= m.
        unsafe {
            for b in blocks {
                let r = base.add((g * nb + b) * rec);
                let x: [*const i32; N] = std::array::from_fn(|j| {
                    c.xu.as_ptr().add((i0 + j) * cols + b * QK_K).cast::<i32>()
                });
                let mut isum = [_mm512_setzero_si512(); N];
                for s in 0..16 {
                    let mut dp = [_mm512_setzero_si512(); N];
                    for k in 4 * s..4 * s + 4 {
                        let wv = _mm512_loadu_si512(r.add(Q6K_QUANTS + k * 64).cast());
                        for j in 0..N {
                            let xb = _mm512_set1_epi32(x[j].add(k).read_unaligned());
                            dp[j] = _mm512_dpbusd_epi32(dp[j], xb, wv);
                        }
                    }
                    let sc =
                        _mm512_cvtepi8_epi32(_mm_loadu_si128(r.add(Q6K_SCALES + s * 16).cast()));
                    for j in 0..N {
                        isum[j] = _mm512_add_epi32(isum[j], _mm512_mullo_epi32(dp[j], sc));
                    }
                }
                let corr = _mm512_loadu_si512(r.add(Q6K_CORR).cast());
                let dw = _mm512_cvtph_ps(_mm256_loadu_si256(r.cast()));
                for j in 0..N {
                    let dx = _mm512_set1_ps(*c.d.get_unchecked((i0 + j) * nb + b));
                    let is = _mm512_sub_epi32(isum[j], corr);
                    acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_mul_ps(dw, dx), acc[j]);
                }
            }
            for (o, a) in out.iter_mut().zip(&acc) {
                _mm512_storeu_ps(o.as_mut_ptr(), *a);
            }
        }
    }

    /// [`tile`] for exactly `N` tokens of weights of type code `T`.
    ///
    /// Per (row, token) and block the integer sum is exact whatever order
    /// its products are added in, so the tokens' `vpdpbusd` chains are
    /// interleaved for throughput; the float operations that follow run in
    /// the reference's order.
    ///
    /// # Safety
    /// As [`tile`], with `N` for `n`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn tile_n<const N: usize, const T: u8>(
        c: &Ctx<'_>,
        g: usize,
        blocks: Range<usize>,
        i0: usize,
        out: &mut [[f32; PACK_ROWS]; TILE_TOKENS],
    ) {
        // SAFETY: forwarded; the type code is the matrix's.
        unsafe {
            match T {
                K_Q4_K => return tile_q4_k::<N>(c, g, blocks, i0, out),
                K_Q6_K => return tile_q6_k::<N>(c, g, blocks, i0, out),
                _ => {}
            }
        }
        let (nb, cols) = (c.w.nb(), c.w.cols);
        let rec = record_bytes(c.w.ty);
        let offset = quant_offset(c.w.ty);
        let mut acc = [_mm512_setzero_ps(); N];
        let low = _mm512_set1_epi8(0x0F);
        let sixteen = _mm512_set1_epi8(16);
        let base = c.w.data.as_ptr();
        // SAFETY (whole body): record offsets stay inside `data` (groups x
        // nb records), activation offsets inside `qs`/`d`/`s`/`xsum`
        // (m x cols, m x nb) because i0 + N <= m.
        unsafe {
            for b in blocks {
                let r = base.add((g * nb + b) * rec);
                let dw = _mm512_cvtph_ps(_mm256_loadu_si256(r.cast()));
                let mut w = [_mm512_setzero_si512(); 8];
                let mw = if T == K_Q4_1 {
                    _mm512_cvtph_ps(_mm256_loadu_si256(r.add(32).cast()))
                } else {
                    _mm512_setzero_ps()
                };
                if T == K_Q8_0 {
                    for (k, wk) in w.iter_mut().enumerate() {
                        *wk = _mm512_loadu_si512(r.add(32 + k * 64).cast());
                    }
                } else {
                    let q0 = if T == K_Q4_1 { 64 } else { 32 };
                    for k in 0..4 {
                        let raw = _mm512_loadu_si512(r.add(q0 + k * 64).cast());
                        w[k] = _mm512_and_si512(raw, low);
                        w[k + 4] = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), low);
                    }
                }
                if T == K_Q5_0 {
                    // Add 16 where the fifth bit is set.
                    for (v, wv) in w.iter_mut().enumerate() {
                        let m = r.add(Q5_MASKS + 8 * v).cast::<u64>().read_unaligned();
                        *wv = _mm512_mask_add_epi8(*wv, m, *wv, sixteen);
                    }
                }
                let x: [*const i32; N] = std::array::from_fn(|j| {
                    c.qs.as_ptr().add((i0 + j) * cols + b * QK).cast::<i32>()
                });
                let mut isum = [_mm512_setzero_si512(); N];
                for (k, &wk) in w.iter().enumerate() {
                    for j in 0..N {
                        let xb = _mm512_set1_epi32(x[j].add(k).read_unaligned());
                        isum[j] = _mm512_dpbusd_epi32(isum[j], wk, xb);
                    }
                }
                for j in 0..N {
                    let t = i0 + j;
                    let mut is = isum[j];
                    if T != K_Q4_1 {
                        let corr = _mm512_set1_epi32(offset * *c.xsum.get_unchecked(t * nb + b));
                        is = _mm512_sub_epi32(is, corr);
                    }
                    let dx = _mm512_set1_ps(*c.d.get_unchecked(t * nb + b));
                    acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_mul_ps(dw, dx), acc[j]);
                    if T == K_Q4_1 {
                        let sx = _mm512_set1_ps(*c.s.get_unchecked(t * nb + b));
                        acc[j] = _mm512_fmadd_ps(mw, sx, acc[j]);
                    }
                }
            }
            for (o, a) in out.iter_mut().zip(&acc) {
                _mm512_storeu_ps(o.as_mut_ptr(), *a);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::{
        Ctx, K_Q4_0, K_Q4_1, K_Q4_K, K_Q5_0, K_Q6_K, K_Q8_0, PACK_ROWS, Q4K_MINS, Q4K_QUANTS,
        Q4K_SCALES, Q5_MASKS, Q6K_CORR, Q6K_QUANTS, Q6K_SCALES, QK, QK_K, TILE_TOKENS, kind,
        quant_offset, record_bytes,
    };

    /// Tokens per 256-bit tile: 16 registers hold 4 tokens' float and
    /// integer accumulators plus the weights in flight.
    const TOKENS: usize = 4;

    /// [`super::avx512::tile`] for AVX2 CPUs, in runs of up to [`TOKENS`]
    /// tokens: one pass over both halves of the group (rows 0-7, 8-15) for
    /// one or two tokens (each weight byte read once, as the memory-bound
    /// single sequence wants), one pass per half for more (weights unpacked
    /// once for four tokens).
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `c` must come from
    /// `Ctx::new`, `g < c.w.groups()`, `blocks` must lie in `0..c.w.nb()`,
    /// and `n <= TILE_TOKENS` with `i0 + n <= c.m`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn tile(
        c: &Ctx<'_>,
        g: usize,
        blocks: Range<usize>,
        i0: usize,
        n: usize,
        out: &mut [[f32; PACK_ROWS]; TILE_TOKENS],
    ) {
        let mut j0 = 0;
        while j0 < n {
            let k = (n - j0).min(TOKENS);
            let out = &mut out[j0..j0 + k];
            let t = i0 + j0;
            macro_rules! by_count {
                ($t:expr) => {
                    match k {
                        1 => tile_n::<1, 2, { $t }>(c, g, blocks.clone(), t, 0, out),
                        2 => tile_n::<2, 2, { $t }>(c, g, blocks.clone(), t, 0, out),
                        3 => {
                            for half in 0..2 {
                                tile_n::<3, 1, { $t }>(c, g, blocks.clone(), t, half, out);
                            }
                        }
                        _ => {
                            for half in 0..2 {
                                tile_n::<TOKENS, 1, { $t }>(c, g, blocks.clone(), t, half, out);
                            }
                        }
                    }
                };
            }
            // SAFETY: as this function's; `t + k <= m`.
            unsafe {
                match kind(c.w.ty) {
                    K_Q4_1 => by_count!(K_Q4_1),
                    K_Q4_0 => by_count!(K_Q4_0),
                    K_Q5_0 => by_count!(K_Q5_0),
                    K_Q4_K => by_count!(K_Q4_K),
                    K_Q6_K => by_count!(K_Q6_K),
                    _ => by_count!(K_Q8_0),
                }
            }
            j0 += k;
        }
    }

    /// 8 bytes at `p` widened to 16 i16, each byte twice (a row's scale for
    /// both halves of its `vpmaddwd` lane); `SIGNED` sign-extends.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `p` must be valid for
    /// reading 8 bytes (any alignment).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scales_x2<const SIGNED: bool>(p: *const u8) -> __m256i {
        // SAFETY: caller guarantees 8 readable bytes.
        let v = unsafe { _mm_loadl_epi64(p.cast()) };
        let dup = _mm_shuffle_epi8(
            v,
            _mm_set_epi8(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0),
        );
        if SIGNED {
            _mm256_cvtepi8_epi16(dup)
        } else {
            _mm256_cvtepu8_epi16(dup)
        }
    }

    /// [`tile_n`] for Q4_K: per sub-block of 32, eight nibble products pairwise
    /// (|sum| <= 8 * 2 * 15 * 128 = 30720, exact in 16 bits), then
    /// `vpmaddwd` by the rows' scales; mins times the activation sub-block
    /// sums with `vpmaddwd`.
    ///
    /// # Safety
    /// As [`tile_n`], for a Q4_K matrix.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::needless_range_loop)]
    unsafe fn tile_q4_k<const N: usize, const H: usize>(
        c: &Ctx<'_>,
        g: usize,
        blocks: Range<usize>,
        i0: usize,
        half0: usize,
        out: &mut [[f32; PACK_ROWS]],
    ) {
        let (nb, cols) = (c.w.nb(), c.w.cols);
        let rec = record_bytes(c.w.ty);
        let mut acc = [[_mm256_setzero_ps(); H]; N];
        let low = _mm256_set1_epi8(0x0F);
        let base = c.w.data.as_ptr();
        // SAFETY (whole body): record offsets stay inside `data` (groups x
        // nb records; a half is 16 bytes of each f16 run, 8 of each scale
        // run, 16 of each min run and 32 of each 64-byte quant chunk),
        // activation offsets inside `qs`, `d` and `xs` because i0 + N <= m.
        unsafe {
            for b in blocks {
                let r = base.add((g * nb + b) * rec);
                let x: [*const i32; N] = std::array::from_fn(|j| {
                    c.qs.as_ptr().add((i0 + j) * cols + b * QK_K).cast::<i32>()
                });
                let xs: [*const i32; N] = std::array::from_fn(|j| {
                    c.xs.as_ptr().add(((i0 + j) * nb + b) * 8).cast::<i32>()
                });
                for h in 0..H {
                    let half = half0 + h;
                    let mut isum = [_mm256_setzero_si256(); N];
                    for s in 0..8 {
                        let mut p16 = [_mm256_setzero_si256(); N];
                        for k in 0..8 {
                            let off = Q4K_QUANTS + ((s / 2) * 8 + k) * 64 + half * 32;
                            let raw = _mm256_loadu_si256(r.add(off).cast());
                            let wv = if s % 2 == 0 {
                                _mm256_and_si256(raw, low)
                            } else {
                                _mm256_and_si256(_mm256_srli_epi16::<4>(raw), low)
                            };
                            for j in 0..N {
                                let xb = _mm256_set1_epi32(x[j].add(8 * s + k).read_unaligned());
                                p16[j] = _mm256_add_epi16(p16[j], _mm256_maddubs_epi16(wv, xb));
                            }
                        }
                        let sc = scales_x2::<false>(r.add(Q4K_SCALES + s * 16 + half * 8));
                        for j in 0..N {
                            isum[j] = _mm256_add_epi32(isum[j], _mm256_madd_epi16(p16[j], sc));
                        }
                    }
                    let mut msum = [_mm256_setzero_si256(); N];
                    for p in 0..4 {
                        let mn = _mm256_cvtepu8_epi16(_mm_loadu_si128(
                            r.add(Q4K_MINS + p * 32 + half * 16).cast(),
                        ));
                        for j in 0..N {
                            let xb = _mm256_set1_epi32(xs[j].add(p).read_unaligned());
                            msum[j] = _mm256_add_epi32(msum[j], _mm256_madd_epi16(mn, xb));
                        }
                    }
                    let dw = _mm256_cvtph_ps(_mm_loadu_si128(r.add(half * 16).cast()));
                    let dmw = _mm256_cvtph_ps(_mm_loadu_si128(r.add(32 + half * 16).cast()));
                    for j in 0..N {
                        let dx = _mm256_set1_ps(*c.d.get_unchecked((i0 + j) * nb + b));
                        let neg = _mm256_sub_epi32(_mm256_setzero_si256(), msum[j]);
                        let a = &mut acc[j][h];
                        *a =
                            _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[j]), _mm256_mul_ps(dw, dx), *a);
                        *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(neg), _mm256_mul_ps(dmw, dx), *a);
                    }
                }
            }
            for (o, a) in out.iter_mut().zip(&acc) {
                for (h, ah) in a.iter().enumerate() {
                    _mm256_storeu_ps(o.as_mut_ptr().add((half0 + h) * 8), *ah);
                }
            }
        }
    }

    /// [`tile_n`] for Q6_K: unsigned activations (<= 255) times signed
    /// weights (|w| <= 32), two chunks pairwise (|sum| <= 4 * 255 * 32 =
    /// 32640, exact in 16 bits), then `vpmaddwd` by the rows' scales, less
    /// the packed correction.
    ///
    /// # Safety
    /// As [`tile_n`], for a Q6_K matrix.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::needless_range_loop)]
    unsafe fn tile_q6_k<const N: usize, const H: usize>(
        c: &Ctx<'_>,
        g: usize,
        blocks: Range<usize>,
        i0: usize,
        half0: usize,
        out: &mut [[f32; PACK_ROWS]],
    ) {
        let (nb, cols) = (c.w.nb(), c.w.cols);
        let rec = record_bytes(c.w.ty);
        let mut acc = [[_mm256_setzero_ps(); H]; N];
        let base = c.w.data.as_ptr();
        // SAFETY (whole body): record offsets stay inside `data` (groups x
        // nb records; a half is 16 bytes of the f16 run, 8 of each scale
        // run, 32 of the corrections and of each 64-byte quant chunk),
        // activation offsets inside `xu` and `d` because i0 + N <= m.
        unsafe {
            for b in blocks {
                let r = base.add((g * nb + b) * rec);
                let x: [*const i32; N] = std::array::from_fn(|j| {
                    c.xu.as_ptr().add((i0 + j) * cols + b * QK_K).cast::<i32>()
                });
                for h in 0..H {
                    let half = half0 + h;
                    let mut isum = [_mm256_setzero_si256(); N];
                    for s in 0..16 {
                        let sc = scales_x2::<true>(r.add(Q6K_SCALES + s * 16 + half * 8));
                        for k2 in 0..2 {
                            let k = 4 * s + 2 * k2;
                            let w0 =
                                _mm256_loadu_si256(r.add(Q6K_QUANTS + k * 64 + half * 32).cast());
                            let w1 = _mm256_loadu_si256(
                                r.add(Q6K_QUANTS + (k + 1) * 64 + half * 32).cast(),
                            );
                            for j in 0..N {
                                let x0 = _mm256_set1_epi32(x[j].add(k).read_unaligned());
                                let x1 = _mm256_set1_epi32(x[j].add(k + 1).read_unaligned());
                                let p16 = _mm256_add_epi16(
                                    _mm256_maddubs_epi16(x0, w0),
                                    _mm256_maddubs_epi16(x1, w1),
                                );
                                isum[j] = _mm256_add_epi32(isum[j], _mm256_madd_epi16(p16, sc));
                            }
                        }
                    }
                    let corr = _mm256_loadu_si256(r.add(Q6K_CORR + half * 32).cast());
                    let dw = _mm256_cvtph_ps(_mm_loadu_si128(r.add(half * 16).cast()));
                    for j in 0..N {
                        let dx = _mm256_set1_ps(*c.d.get_unchecked((i0 + j) * nb + b));
                        let is = _mm256_sub_epi32(isum[j], corr);
                        let a = &mut acc[j][h];
                        *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_mul_ps(dw, dx), *a);
                    }
                }
            }
            for (o, a) in out.iter_mut().zip(&acc) {
                for (h, ah) in a.iter().enumerate() {
                    _mm256_storeu_ps(o.as_mut_ptr().add((half0 + h) * 8), *ah);
                }
            }
        }
    }

    /// Rows `8 * half0..8 * (half0 + H)` of group `g` for exactly `N`
    /// tokens from `i0`, into `out[j][8 * half0..]`.
    ///
    /// # Safety
    /// As [`tile`], with `N` for `n`, and `half0 + H <= 2`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    // Token and half indices address several arrays at once.
    #[allow(clippy::needless_range_loop)]
    unsafe fn tile_n<const N: usize, const H: usize, const T: u8>(
        c: &Ctx<'_>,
        g: usize,
        blocks: Range<usize>,
        i0: usize,
        half0: usize,
        out: &mut [[f32; PACK_ROWS]],
    ) {
        // SAFETY: forwarded; the type code is the matrix's.
        unsafe {
            match T {
                K_Q4_K => return tile_q4_k::<N, H>(c, g, blocks, i0, half0, out),
                K_Q6_K => return tile_q6_k::<N, H>(c, g, blocks, i0, half0, out),
                _ => {}
            }
        }
        let (nb, cols) = (c.w.nb(), c.w.cols);
        let rec = record_bytes(c.w.ty);
        let offset = quant_offset(c.w.ty);
        let mut acc = [[_mm256_setzero_ps(); H]; N];
        let low = _mm256_set1_epi8(0x0F);
        let bit4 = _mm256_set1_epi8(0x10);
        let bias = _mm256_set1_epi8(-128);
        let ones = _mm256_set1_epi16(1);
        let base = c.w.data.as_ptr();
        // SAFETY (whole body): record offsets stay inside `data` (groups x
        // nb records; a half is 16 bytes of each scale run and 32 of each
        // 64-byte quant chunk), activation offsets inside `qs`/`d`/`s`
        // (m x cols, m x nb) because i0 + N <= m.
        unsafe {
            for b in blocks {
                let r = base.add((g * nb + b) * rec);
                let x: [*const i32; N] = std::array::from_fn(|j| {
                    c.qs.as_ptr().add((i0 + j) * cols + b * QK).cast::<i32>()
                });
                let mut isum = [[_mm256_setzero_si256(); H]; N];
                if T == K_Q4_1 || T == K_Q4_0 {
                    // Eight products of a nibble (<= 15) and an activation
                    // (|x| <= 128) pairwise: |sum| <= 8 * 2 * 15 * 128 =
                    // 30720, exact in 16 bits; widened once per block.
                    let q0 = if T == K_Q4_1 { 64 } else { 32 };
                    for k in 0..4 {
                        for h in 0..H {
                            let off = q0 + k * 64 + (half0 + h) * 32;
                            let raw = _mm256_loadu_si256(r.add(off).cast());
                            let lo = _mm256_and_si256(raw, low);
                            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), low);
                            for j in 0..N {
                                let xl = _mm256_set1_epi32(x[j].add(k).read_unaligned());
                                let xh = _mm256_set1_epi32(x[j].add(k + 4).read_unaligned());
                                let s = &mut isum[j][h];
                                *s = _mm256_add_epi16(*s, _mm256_maddubs_epi16(lo, xl));
                                *s = _mm256_add_epi16(*s, _mm256_maddubs_epi16(hi, xh));
                            }
                        }
                    }
                    for s in isum.iter_mut().flatten() {
                        *s = _mm256_madd_epi16(*s, ones);
                    }
                } else if T == K_Q5_0 {
                    // 5-bit values (<= 31): four pairwise products sum to at
                    // most 4 * 2 * 31 * 128 = 31744 in 16 bits, so each
                    // pair of chunks (k, k + 1) is widened on its own.
                    for k2 in 0..2 {
                        for h in 0..H {
                            let hoff = (half0 + h) * 32;
                            let mut p16 = [_mm256_setzero_si256(); N];
                            for k in 2 * k2..2 * k2 + 2 {
                                let raw = _mm256_loadu_si256(r.add(32 + k * 64 + hoff).cast());
                                let five = |nib: __m256i, v: usize| {
                                    let at = Q5_MASKS + 8 * v + 4 * (half0 + h);
                                    let bits = crate::dot::avx2::bytes_from_bits_32(r.add(at));
                                    _mm256_or_si256(nib, _mm256_and_si256(bits, bit4))
                                };
                                let lo = five(_mm256_and_si256(raw, low), k);
                                let hi =
                                    five(_mm256_and_si256(_mm256_srli_epi16::<4>(raw), low), k + 4);
                                for j in 0..N {
                                    let xl = _mm256_set1_epi32(x[j].add(k).read_unaligned());
                                    let xh = _mm256_set1_epi32(x[j].add(k + 4).read_unaligned());
                                    let s = &mut p16[j];
                                    *s = _mm256_add_epi16(*s, _mm256_maddubs_epi16(lo, xl));
                                    *s = _mm256_add_epi16(*s, _mm256_maddubs_epi16(hi, xh));
                                }
                            }
                            for j in 0..N {
                                let s = &mut isum[j][h];
                                *s = _mm256_add_epi32(*s, _mm256_madd_epi16(p16[j], ones));
                            }
                        }
                    }
                } else {
                    // Stored as q + 128: back to signed, then |q| (<= 128,
                    // unsigned) times sign(q) x (|x| <= 127): pair sums
                    // <= 32512, no saturation.
                    for k in 0..8 {
                        for h in 0..H {
                            let off = 32 + k * 64 + (half0 + h) * 32;
                            let q = _mm256_xor_si256(_mm256_loadu_si256(r.add(off).cast()), bias);
                            let aq = _mm256_abs_epi8(q);
                            for j in 0..N {
                                let xb = _mm256_set1_epi32(x[j].add(k).read_unaligned());
                                let p = _mm256_maddubs_epi16(aq, _mm256_sign_epi8(xb, q));
                                let s = &mut isum[j][h];
                                *s = _mm256_add_epi32(*s, _mm256_madd_epi16(p, ones));
                            }
                        }
                    }
                }
                for h in 0..H {
                    let half = half0 + h;
                    let dw = _mm256_cvtph_ps(_mm_loadu_si128(r.add(half * 16).cast()));
                    let mw = if T == K_Q4_1 {
                        _mm256_cvtph_ps(_mm_loadu_si128(r.add(32 + half * 16).cast()))
                    } else {
                        _mm256_setzero_ps()
                    };
                    for j in 0..N {
                        let t = i0 + j;
                        let dx = _mm256_set1_ps(*c.d.get_unchecked(t * nb + b));
                        let mut is = isum[j][h];
                        // (Q8_0's sums are signed already: no offset.)
                        if T == K_Q4_0 || T == K_Q5_0 {
                            let xs = *c.xsum.get_unchecked(t * nb + b);
                            is = _mm256_sub_epi32(is, _mm256_set1_epi32(offset * xs));
                        }
                        let a = &mut acc[j][h];
                        *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_mul_ps(dw, dx), *a);
                        if T == K_Q4_1 {
                            let sx = _mm256_set1_ps(*c.s.get_unchecked(t * nb + b));
                            *a = _mm256_fmadd_ps(mw, sx, *a);
                        }
                    }
                }
            }
            for (o, a) in out.iter_mut().zip(&acc) {
                for (h, ah) in a.iter().enumerate() {
                    _mm256_storeu_ps(o.as_mut_ptr().add((half0 + h) * 8), *ah);
                }
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::cpu::IsaCoverage;
    use crate::matmul::matmul_with_isa;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// Quantised random weights; K-quants (no quantiser here) as random
    /// bytes with moderate f16 scales.
    fn weights(ty: GgmlType, rows: usize, cols: usize, rng: &mut ChaCha8Rng) -> Vec<u8> {
        if matches!(ty, GgmlType::Q4_K | GgmlType::Q6_K) {
            let mut data = vec![0u8; ty.row_bytes(cols).unwrap() * rows];
            rng.fill(&mut data[..]);
            let mut h = |lo: f32, hi: f32| {
                half::f16::from_f32(rng.random_range(lo..hi))
                    .to_bits()
                    .to_le_bytes()
            };
            for blk in data.chunks_exact_mut(ty.block_bytes()) {
                if ty == GgmlType::Q4_K {
                    blk[0..2].copy_from_slice(&h(0.0, 0.01));
                    blk[2..4].copy_from_slice(&h(0.0, 0.01));
                } else {
                    blk[208..210].copy_from_slice(&h(-0.01, 0.01));
                }
            }
            return data;
        }
        let x: Vec<f32> = (0..rows * cols)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let mut data = vec![0u8; ty.row_bytes(cols).unwrap() * rows];
        quant::quantize_row(ty, &x, &mut data).unwrap();
        data
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    const PACKED_TYPES: [GgmlType; 6] = [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
    ];

    #[test]
    fn fast_kernel_is_bitwise_the_scalar_reference() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let mut cov = IsaCoverage::new("packed::fast_kernel_is_bitwise_the_scalar_reference");
        for ty in PACKED_TYPES {
            for (rows, cols) in [(1, 32), (15, 64), (16, 32), (17, 96), (40, 576), (3, 1536)] {
                let cols = cols / QK * ty.block_len();
                let data = weights(ty, rows, cols, &mut rng);
                let q = QMatrix::new(ty, &data, rows, cols).unwrap();
                let p = PackedMatrix::pack_any_cpu(&q).unwrap();
                for m in [0, 1, 2, 7, 8, 9, 33] {
                    let x: Vec<f32> = (0..m * cols)
                        .map(|_| rng.random_range(-2.0f32..2.0))
                        .collect();
                    let mut want = vec![0.0; m * rows];
                    matmul_packed_with_isa(Isa::Scalar, &p, &x, m, &mut want).unwrap();
                    // Close to ggml's order (same quantisation, other sums).
                    let mut ggml = vec![0.0; m * rows];
                    matmul_with_isa(Isa::Scalar, &q, &x, m, &mut ggml).unwrap();
                    for (a, b) in want.iter().zip(&ggml) {
                        assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{ty:?} {a} vs {b}");
                    }
                    // Each row alone equals the batch: batch invariance.
                    for i in 0..m {
                        let mut one = vec![0.0; rows];
                        matmul_packed_with_isa(
                            Isa::Scalar,
                            &p,
                            &x[i * cols..(i + 1) * cols],
                            1,
                            &mut one,
                        )
                        .unwrap();
                        assert_eq!(bits(&one), bits(&want[i * rows..(i + 1) * rows]));
                    }
                    for isa in cov.isas() {
                        let mut got = vec![0.0; m * rows];
                        matmul_packed_with_isa(isa, &p, &x, m, &mut got).unwrap();
                        assert_eq!(bits(&got), bits(&want), "{isa} {ty:?} {rows}x{cols} m={m}");
                        cov.ran(isa);
                    }
                }
            }
        }
    }

    /// The largest products each format allows: AVX2 sums them in 16 bits.
    #[test]
    fn extreme_quants_match_the_reference_on_every_isa() {
        let rows = 19;
        let mut cov = IsaCoverage::new("packed::extreme_quants_match_the_reference_on_every_isa");
        let one = half::f16::from_f32(1.0).to_bits().to_le_bytes();
        for ty in PACKED_TYPES {
            let cols = 4 * ty.block_len();
            let mut data = Vec::new();
            for r in 0..rows {
                for b in 0..cols / ty.block_len() {
                    let hi = (r + b) % 2 == 1;
                    if ty == GgmlType::Q4_K {
                        // d = dmin = 1, every scale and min 63, every
                        // nibble 15 (or, by row and block, 0).
                        data.extend_from_slice(&one);
                        data.extend_from_slice(&one);
                        data.extend_from_slice(&[0xFF; 12]);
                        data.extend_from_slice(&[if hi { 0xFF } else { 0 }; 128]);
                        continue;
                    }
                    if ty == GgmlType::Q6_K {
                        // Quants 63 with scales 127, or 0 (-32) with -128.
                        let (q, sc) = if hi { (0xFF, 0x7F) } else { (0, 0x80) };
                        data.extend_from_slice(&[q; 192]);
                        data.extend_from_slice(&[sc; 16]);
                        data.extend_from_slice(&one);
                        continue;
                    }
                    data.extend_from_slice(&one);
                    if ty == GgmlType::Q4_1 {
                        data.extend_from_slice(&one); // m
                        // Every nibble 15; row 3 all zero.
                        data.extend_from_slice(&[if r == 3 { 0 } else { 0xFF }; 16]);
                    } else if ty == GgmlType::Q4_0 {
                        // +7 and -8, by row and block.
                        let q: u8 = if (r + b) % 2 == 0 { 0x00 } else { 0xFF };
                        data.extend_from_slice(&[q; 16]);
                    } else if ty == GgmlType::Q5_0 {
                        // +15 and -16 by row and block; row 5 alternates bits.
                        let (qh, q) = match ((r + b) % 2, r) {
                            (_, 5) => (0x5555_5555u32, 0xA5),
                            (0, _) => (0, 0x00),
                            _ => (u32::MAX, 0xFF),
                        };
                        data.extend_from_slice(&qh.to_le_bytes());
                        data.extend_from_slice(&[q; 16]);
                    } else {
                        // -128 and 127 (the extremes of i8), by row and block.
                        let q: u8 = if (r + b) % 2 == 0 { 0x80 } else { 0x7F };
                        data.extend_from_slice(&[q; 32]);
                    }
                }
            }
            let q = QMatrix::new(ty, &data, rows, cols).unwrap();
            let p = PackedMatrix::pack_any_cpu(&q).unwrap();
            for sign in [1.0f32, -1.0] {
                // Every activation quantises to +-127 (the block's max).
                let x: Vec<f32> = (0..9 * cols)
                    .map(|i| sign * (3.0 + (i % 2) as f32 * 1e-3))
                    .collect();
                let mut want = vec![0.0; 9 * rows];
                matmul_packed_with_isa(Isa::Scalar, &p, &x, 9, &mut want).unwrap();
                for isa in cov.isas() {
                    let mut got = vec![0.0; 9 * rows];
                    matmul_packed_with_isa(isa, &p, &x, 9, &mut got).unwrap();
                    assert_eq!(bits(&got), bits(&want), "{isa} {ty:?} sign {sign}");
                    cov.ran(isa);
                }
                let mut ggml = vec![0.0; 9 * rows];
                matmul_with_isa(Isa::Scalar, &q, &x, 9, &mut ggml).unwrap();
                for (a, b) in want.iter().zip(&ggml) {
                    assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{ty:?} {a} vs {b}");
                }
            }
        }
    }

    /// Every row of a batch equals that row alone, and any prefix of the
    /// batch, for every packed type, ISA and thread split.
    #[test]
    fn batch_and_thread_invariance_for_every_type() {
        let mut rng = ChaCha8Rng::seed_from_u64(31);
        let mut cov = IsaCoverage::new("packed::batch_and_thread_invariance_for_every_type");
        let isas = cov.isas();
        for ty in PACKED_TYPES {
            let (rows, cols, m) = (37, 2 * ty.block_len(), 19);
            let data = weights(ty, rows, cols, &mut rng);
            let p =
                PackedMatrix::pack_any_cpu(&QMatrix::new(ty, &data, rows, cols).unwrap()).unwrap();
            let x: Vec<f32> = (0..m * cols)
                .map(|_| rng.random_range(-2.0f32..2.0))
                .collect();
            for &isa in &isas {
                let mut all = vec![0.0; m * rows];
                packed_impl(isa, &p, &x, m, 1, &mut all, 1).unwrap();
                for i in 0..m {
                    let mut one = vec![0.0; rows];
                    let xi = &x[i * cols..(i + 1) * cols];
                    packed_impl(isa, &p, xi, 1, 1, &mut one, 1).unwrap();
                    assert_eq!(
                        bits(&one),
                        bits(&all[i * rows..(i + 1) * rows]),
                        "{ty:?} {isa} i={i}"
                    );
                }
                for mm in [2, 3, 4, 5, 8, 9, 12] {
                    for threads in [1, 2, 3, 64] {
                        let mut part = vec![0.0; mm * rows];
                        packed_impl(isa, &p, &x[..mm * cols], mm, 1, &mut part, threads).unwrap();
                        assert_eq!(
                            bits(&part),
                            bits(&all[..mm * rows]),
                            "{ty:?} {isa} m={mm} threads={threads}"
                        );
                    }
                }
                cov.ran(isa);
            }
        }
    }

    #[test]
    fn concatenated_packing_equals_each_part() {
        let mut rng = ChaCha8Rng::seed_from_u64(4);
        let (a, b) = (
            weights(GgmlType::Q4_1, 9, 64, &mut rng),
            weights(GgmlType::Q4_1, 20, 64, &mut rng),
        );
        let (qa, qb) = (
            QMatrix::new(GgmlType::Q4_1, &a, 9, 64).unwrap(),
            QMatrix::new(GgmlType::Q4_1, &b, 20, 64).unwrap(),
        );
        let fused = PackedMatrix::pack_concat_any_cpu(&[qa, qb]).unwrap();
        let x: Vec<f32> = (0..3 * 64)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let mut both = vec![0.0; 3 * 29];
        matmul_packed_with_isa(Isa::Scalar, &fused, &x, 3, &mut both).unwrap();
        for (q, off, n) in [(qa, 0, 9), (qb, 9, 20)] {
            let mut one = vec![0.0; 3 * n];
            let p = PackedMatrix::pack_any_cpu(&q).unwrap();
            matmul_packed_with_isa(Isa::Scalar, &p, &x, 3, &mut one).unwrap();
            for t in 0..3 {
                assert_eq!(
                    bits(&one[t * n..(t + 1) * n]),
                    bits(&both[t * 29 + off..t * 29 + off + n])
                );
            }
        }
        let other = weights(GgmlType::Q8_0, 4, 64, &mut rng);
        let qo = QMatrix::new(GgmlType::Q8_0, &other, 4, 64).unwrap();
        assert!(PackedMatrix::pack_concat_any_cpu(&[qa, qo]).is_none());
    }

    #[test]
    fn segments_equal_each_column_slice_packed_alone() {
        let mut rng = ChaCha8Rng::seed_from_u64(23);
        let mut cov = IsaCoverage::new("packed::segments_equal_each_column_slice_packed_alone");
        for ty in PACKED_TYPES {
            for (rows, cols, segments) in [(17, 96, 3), (40, 576, 3), (5, 128, 4), (16, 64, 1)] {
                let cols = cols / QK * ty.block_len();
                let data = weights(ty, rows, cols, &mut rng);
                let q = QMatrix::new(ty, &data, rows, cols).unwrap();
                let p = PackedMatrix::pack_any_cpu(&q).unwrap();
                let sc = cols / segments;
                let (rb, sb) = (ty.row_bytes(cols).unwrap(), ty.row_bytes(sc).unwrap());
                for m in [1, 3, 8, 9, 20] {
                    let x: Vec<f32> = (0..m * cols)
                        .map(|_| rng.random_range(-2.0f32..2.0))
                        .collect();
                    let mut want = vec![0.0; segments * m * rows];
                    for s in 0..segments {
                        let slice: Vec<u8> = (0..rows)
                            .flat_map(|r| data[r * rb + s * sb..r * rb + (s + 1) * sb].to_vec())
                            .collect();
                        let ps = PackedMatrix::pack_any_cpu(
                            &QMatrix::new(ty, &slice, rows, sc).unwrap(),
                        )
                        .unwrap();
                        let xs: Vec<f32> = x
                            .chunks_exact(cols)
                            .flat_map(|row| row[s * sc..(s + 1) * sc].to_vec())
                            .collect();
                        let out = &mut want[s * m * rows..(s + 1) * m * rows];
                        matmul_packed_with_isa(Isa::Scalar, &ps, &xs, m, out).unwrap();
                    }
                    for isa in cov.isas() {
                        let mut got = vec![0.0; segments * m * rows];
                        matmul_packed_segments_with_isa(isa, &p, &x, m, segments, &mut got)
                            .unwrap();
                        assert_eq!(
                            bits(&got),
                            bits(&want),
                            "{ty:?} {isa} {rows}x{cols}/{segments} m={m}"
                        );
                        cov.ran(isa);
                    }
                }
            }
        }
    }

    #[test]
    fn only_packable_matrices_pack_and_bad_lengths_are_errors() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let f = weights(GgmlType::F16, 4, 32, &mut rng);
        assert!(
            PackedMatrix::pack_any_cpu(&QMatrix::new(GgmlType::F16, &f, 4, 32).unwrap()).is_none()
        );
        let data = weights(GgmlType::Q8_0, 4, 64, &mut rng);
        let p = PackedMatrix::pack_any_cpu(&QMatrix::new(GgmlType::Q8_0, &data, 4, 64).unwrap())
            .unwrap();
        let mut out = vec![0.0; 4];
        assert!(matmul_packed(&p, &[0.0; 63], 1, &mut out).is_err());
        assert!(matmul_packed(&p, &[0.0; 64], 1, &mut out[..3]).is_err());
        if !Isa::Avx512Vnni.is_supported() {
            assert!(matmul_packed_with_isa(Isa::Avx512Vnni, &p, &[0.0; 64], 1, &mut out).is_err());
        }
        // Two blocks split three ways, or zero ways, and a wrong output size.
        let mut seg_out = vec![0.0; 12];
        assert!(matmul_packed_segments(&p, &[0.0; 64], 1, 3, &mut seg_out).is_err());
        assert!(matmul_packed_segments(&p, &[0.0; 64], 1, 0, &mut seg_out).is_err());
        assert!(matmul_packed_segments(&p, &[0.0; 64], 1, 2, &mut seg_out).is_err());
        assert!(matmul_packed_segments(&p, &[0.0; 64], 1, 2, &mut seg_out[..8]).is_ok());
    }
}
