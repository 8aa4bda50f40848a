//! Row-interleaved ("packed") Q4_1 / Q8_0 weights and their batched matmul.
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
//! each (row, token) the block integer sum `isum` is exact, and
//! `acc = fma(isum as f32, d_w * d_x, acc)` (then `acc = fma(m_w, s_x,
//! acc)` for Q4_1) runs block by block from `acc = 0`. The scalar reference
//! [`matmul_packed_with_isa`]`(Isa::Scalar, ..)` performs exactly these
//! operations, and the fast kernel is tested bitwise against it. The order
//! differs from ggml's, so results are close to, not equal to,
//! [`crate::matmul`]'s.
//!
//! AVX2 CPUs run the same layout in 256-bit halves (rows 0-7, then 8-15):
//! `vpmaddubsw` + `vpmaddwd` stand in for `vpdpbusd`. Q4_1's products are
//! small enough to sum eight of them in 16 bits before widening; Q8_0's
//! weights go back to signed and multiply by sign-adjusted activations
//! (`|w| * sign(w) x`), whose pair sums cannot saturate 16 bits. The integer
//! sums are the same exact values, so the result is bitwise that of the
//! reference too. Scalar-only CPUs keep the ggml-order kernels (see
//! [`PackedMatrix::pack`]).

use crate::cpu::{self, Isa};
use crate::dot::{self, ActScratch, Acts};
use crate::error::KernelError;
use crate::matmul::QMatrix;
use crate::pool;
use crate::quant::{self, GgmlType, QK};

/// Rows interleaved per group.
pub const PACK_ROWS: usize = 16;
/// Tokens per register tile.
const TILE_TOKENS: usize = 8;
/// Below this many multiply-adds the product runs on the calling thread.
const PAR_MIN_WORK: usize = 1 << 16;

/// A weight matrix repacked in groups of [`PACK_ROWS`] rows. Per group and
/// block, one record: the 16 rows' `d` (f16), for Q4_1 their `m` (f16),
/// then the quants as chunks of 64 bytes, each holding 4 bytes of every
/// row (Q4_1: 4 chunks, low nibbles are elements `4c..4c+4`, high nibbles
/// `16+4c..`; Q8_0: 8 chunks of `q + 128`). Rows past `rows` are zero.
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
        GgmlType::Q4_1 => PACK_ROWS * (2 + 2 + QK / 2),
        _ => PACK_ROWS * (2 + QK),
    }
}

impl PackedMatrix {
    /// Repacks `w` when the kernels have a packed fast path here (AVX2 or
    /// AVX-512 VNNI) and `w` is Q4_1 or Q8_0; `None` otherwise (keep using
    /// [`crate::matmul`]).
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
            || !matches!(first.ty, GgmlType::Q4_1 | GgmlType::Q8_0)
            || first.cols == 0
            || !first.cols.is_multiple_of(QK)
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
        let (nb, bb) = (w.cols / QK, w.ty.block_bytes());
        let n_rows = w.rows.len();
        let groups = n_rows.div_ceil(PACK_ROWS);
        let rec = record_bytes(w.ty);
        let mut data = vec![0u8; groups * nb * rec];
        let q4 = w.ty == GgmlType::Q4_1;
        for g in 0..groups {
            for b in 0..nb {
                let out = &mut data[(g * nb + b) * rec..(g * nb + b + 1) * rec];
                for r in 0..PACK_ROWS {
                    let row = g * PACK_ROWS + r;
                    if row >= n_rows {
                        // Zero scales and quants: the padded rows compute 0.
                        if !q4 {
                            for c in 0..8 {
                                out[32 + c * 64 + r * 4..32 + c * 64 + r * 4 + 4].fill(0x80);
                            }
                        }
                        continue;
                    }
                    let blk = &w.rows[row][b * bb..(b + 1) * bb];
                    out[r * 2..r * 2 + 2].copy_from_slice(&blk[0..2]);
                    if q4 {
                        out[32 + r * 2..32 + r * 2 + 2].copy_from_slice(&blk[2..4]);
                        for c in 0..4 {
                            let dst = 64 + c * 64 + r * 4;
                            out[dst..dst + 4].copy_from_slice(&blk[4 + c * 4..4 + c * 4 + 4]);
                        }
                    } else {
                        for c in 0..8 {
                            let dst = 32 + c * 64 + r * 4;
                            for k in 0..4 {
                                out[dst + k] = blk[2 + c * 4 + k] ^ 0x80;
                            }
                        }
                    }
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

    fn nb(&self) -> usize {
        self.cols / QK
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
        Ok(mut scratch) => run(isa, w, x, m, segments, out, &mut scratch),
        // Only reachable if a matmul re-entered itself on this thread.
        Err(_) => run(isa, w, x, m, segments, out, &mut ActScratch::default()),
    })
}

thread_local! {
    /// Quantised activations of the current call (the calling thread's).
    static SCRATCH: std::cell::RefCell<ActScratch> = std::cell::RefCell::new(ActScratch::default());
}

fn run(
    isa: Isa,
    w: &PackedMatrix,
    x: &[f32],
    m: usize,
    segments: usize,
    out: &mut [f32],
    scratch: &mut ActScratch,
) -> Result<(), KernelError> {
    let acts = dot::prepare_acts(w.ty, x, m, w.cols, scratch);
    let Acts::Q8(a) = &acts else {
        return Err(KernelError::UnsupportedType {
            op: "packed matmul",
            ty: w.ty,
        });
    };
    // Q8_0 weights are stored as q + 128; the kernel subtracts 128 * sum(x_q).
    let xsum: Vec<i32> = if w.ty == GgmlType::Q8_0 {
        a.qs.chunks_exact(QK)
            .map(|c| c.iter().map(|&v| i32::from(v)).sum())
            .collect()
    } else {
        Vec::new()
    };
    let ctx = Ctx::new(w, a, &xsum, m, segments);
    let groups = w.groups();
    let work = w.rows.saturating_mul(w.cols).saturating_mul(m);
    let parts = if work >= PAR_MIN_WORK {
        pool::num_threads().clamp(1, groups)
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

/// Everything a group computation reads. Built by [`Ctx::new`] only,
/// which checks the sizes the SIMD tiles rely on.
struct Ctx<'a> {
    w: &'a PackedMatrix,
    qs: &'a [i8],
    d: &'a [f32],
    s: &'a [f32],
    xsum: &'a [i32],
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
        xsum: &'a [i32],
        m: usize,
        segments: usize,
    ) -> Self {
        let (nb, cols) = (w.nb(), w.cols);
        let covers =
            |len: usize, per_token: usize| m.checked_mul(per_token).is_some_and(|need| len >= need);
        assert!(
            matches!(w.ty, GgmlType::Q4_1 | GgmlType::Q8_0)
                && w.data.len() == w.groups() * nb * record_bytes(w.ty),
            "malformed packed matrix"
        );
        assert!(
            covers(a.qs.len(), cols) && covers(a.d.len(), nb),
            "activations too short"
        );
        if w.ty == GgmlType::Q4_1 {
            assert!(covers(a.s.len(), nb), "activation sums too short");
        } else {
            assert!(covers(xsum.len(), nb), "activation sums too short");
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
        let mut i0 = 0;
        while i0 < self.m {
            let n = TILE_TOKENS.min(self.m - i0);
            for s in 0..self.segments {
                let blocks = s * seg_nb..(s + 1) * seg_nb;
                let mut acc = [[0.0f32; PACK_ROWS]; TILE_TOKENS];
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

    /// The reference: the exact operation sequence the SIMD kernel runs.
    fn tile_scalar(
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
                    if ty == GgmlType::Q4_1 {
                        for c in 0..4 {
                            for k in 0..4 {
                                let byte = data[64 + c * 64 + r * 4 + k];
                                isum += i32::from(byte & 0x0F) * i32::from(x[c * 4 + k]);
                                isum += i32::from(byte >> 4) * i32::from(x[16 + c * 4 + k]);
                            }
                        }
                    } else {
                        for c in 0..8 {
                            for k in 0..4 {
                                let q = i32::from(data[32 + c * 64 + r * 4 + k]) - 128;
                                isum += q * i32::from(x[c * 4 + k]);
                            }
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

    use super::{Ctx, PACK_ROWS, QK, TILE_TOKENS, record_bytes};
    use crate::quant::GgmlType;

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
        // Monomorphised per token count so accumulators stay in registers.
        macro_rules! by_count {
            ($($n:literal)*) => {
                match (c.w.ty == GgmlType::Q4_1, n) {
                    $(
                        (true, $n) => unsafe { tile_n::<$n, true>(c, g, blocks, i0, out) },
                        (false, $n) => unsafe { tile_n::<$n, false>(c, g, blocks, i0, out) },
                    )*
                    (true, _) => unsafe { tile_n::<TILE_TOKENS, true>(c, g, blocks, i0, out) },
                    (false, _) => unsafe { tile_n::<TILE_TOKENS, false>(c, g, blocks, i0, out) },
                }
            };
        }
        by_count!(1 2 3 4 5 6 7)
    }

    /// [`tile`] for exactly `N` tokens of Q4_1 (`Q4`) or Q8_0 weights.
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
    unsafe fn tile_n<const N: usize, const Q4: bool>(
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
        // nb records), activation offsets inside `qs`/`d`/`s`/`xsum`
        // (m x cols, m x nb) because i0 + N <= m.
        unsafe {
            for b in blocks {
                let r = base.add((g * nb + b) * rec);
                let dw = _mm512_cvtph_ps(_mm256_loadu_si256(r.cast()));
                let mut w = [_mm512_setzero_si512(); 8];
                let mw;
                if Q4 {
                    mw = _mm512_cvtph_ps(_mm256_loadu_si256(r.add(32).cast()));
                    for k in 0..4 {
                        let raw = _mm512_loadu_si512(r.add(64 + k * 64).cast());
                        w[k] = _mm512_and_si512(raw, low);
                        w[k + 4] = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), low);
                    }
                } else {
                    mw = _mm512_setzero_ps();
                    for (k, wk) in w.iter_mut().enumerate() {
                        *wk = _mm512_loadu_si512(r.add(32 + k * 64).cast());
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
                    if !Q4 {
                        let corr = _mm512_set1_epi32(128 * *c.xsum.get_unchecked(t * nb + b));
                        is = _mm512_sub_epi32(is, corr);
                    }
                    let dx = _mm512_set1_ps(*c.d.get_unchecked(t * nb + b));
                    acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_mul_ps(dw, dx), acc[j]);
                    if Q4 {
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

    use super::{Ctx, PACK_ROWS, QK, TILE_TOKENS, record_bytes};
    use crate::quant::GgmlType;

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
        let q4 = c.w.ty == GgmlType::Q4_1;
        let mut j0 = 0;
        while j0 < n {
            let k = (n - j0).min(TOKENS);
            let out = &mut out[j0..j0 + k];
            let (b, t) = (blocks.clone(), i0 + j0);
            // SAFETY: as this function's; `t + k <= m`.
            unsafe {
                match (q4, k) {
                    (true, 1) => tile_n::<1, 2, true>(c, g, b, t, 0, out),
                    (true, 2) => tile_n::<2, 2, true>(c, g, b, t, 0, out),
                    (false, 1) => tile_n::<1, 2, false>(c, g, b, t, 0, out),
                    (false, 2) => tile_n::<2, 2, false>(c, g, b, t, 0, out),
                    _ => {
                        for half in 0..2 {
                            let b = blocks.clone();
                            match (q4, k) {
                                (true, 3) => tile_n::<3, 1, true>(c, g, b, t, half, out),
                                (true, _) => tile_n::<TOKENS, 1, true>(c, g, b, t, half, out),
                                (false, 3) => tile_n::<3, 1, false>(c, g, b, t, half, out),
                                (false, _) => tile_n::<TOKENS, 1, false>(c, g, b, t, half, out),
                            }
                        }
                    }
                }
            }
            j0 += k;
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
    unsafe fn tile_n<const N: usize, const H: usize, const Q4: bool>(
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
                if Q4 {
                    // Eight products of a nibble (<= 15) and an activation
                    // (|x| <= 128) pairwise: |sum| <= 8 * 2 * 15 * 128 =
                    // 30720, exact in 16 bits; widened once per block.
                    for k in 0..4 {
                        for h in 0..H {
                            let off = 64 + k * 64 + (half0 + h) * 32;
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
                    let mw = if Q4 {
                        _mm256_cvtph_ps(_mm_loadu_si128(r.add(32 + half * 16).cast()))
                    } else {
                        _mm256_setzero_ps()
                    };
                    for j in 0..N {
                        let t = i0 + j;
                        let dx = _mm256_set1_ps(*c.d.get_unchecked(t * nb + b));
                        let a = &mut acc[j][h];
                        *a = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(isum[j][h]),
                            _mm256_mul_ps(dw, dx),
                            *a,
                        );
                        if Q4 {
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

    fn weights(ty: GgmlType, rows: usize, cols: usize, rng: &mut ChaCha8Rng) -> Vec<u8> {
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

    #[test]
    fn fast_kernel_is_bitwise_the_scalar_reference() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let mut cov = IsaCoverage::new("packed::fast_kernel_is_bitwise_the_scalar_reference");
        for ty in [GgmlType::Q4_1, GgmlType::Q8_0] {
            for (rows, cols) in [(1, 32), (15, 64), (16, 32), (17, 96), (40, 576), (3, 1536)] {
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
        let (rows, cols) = (19, 128);
        let mut cov = IsaCoverage::new("packed::extreme_quants_match_the_reference_on_every_isa");
        let one = half::f16::from_f32(1.0).to_bits().to_le_bytes();
        for ty in [GgmlType::Q4_1, GgmlType::Q8_0] {
            let mut data = Vec::new();
            for r in 0..rows {
                for b in 0..cols / QK {
                    data.extend_from_slice(&one);
                    if ty == GgmlType::Q4_1 {
                        data.extend_from_slice(&one); // m
                        // Every nibble 15; row 3 all zero.
                        data.extend_from_slice(&[if r == 3 { 0 } else { 0xFF }; 16]);
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
        for ty in [GgmlType::Q4_1, GgmlType::Q8_0] {
            for (rows, cols, segments) in [(17, 96, 3), (40, 576, 3), (5, 128, 4), (16, 64, 1)] {
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
