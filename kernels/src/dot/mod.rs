//! Row·activation dot-product kernels.
//!
//! Every implementation (scalar, AVX2, AVX-512) performs, for each output
//! element, exactly the same sequence of f32 operations as ggml-cpu's AVX2
//! `ggml_vec_dot_*` for that type: the integer block products are split into
//! 8 lanes (lane = (element % 32) / 4, exactly as `maddubs`/`madd` or
//! `vpdpbusd` group them), each lane is accumulated with one fused multiply-add
//! per block, and the lanes are reduced as ggml's `hsum_float_8`. Integer sums
//! are exact, so all ISAs give bitwise identical results, and the result for
//! one (row, activation) pair never depends on tiling, batch size or threads.
//!
//! Float types (F32/F16/BF16) use 16 lanes (element % 16) of fused
//! multiply-adds over the 16-aligned prefix, reduced like
//! `_mm512_reduce_add_ps`, then the tail is added sequentially (unfused).

pub(crate) mod scalar;

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};

use crate::cpu::Isa;
use crate::quant::{self, GgmlType, QK, QK_K};

/// Activations quantised to a weight type's `vec_dot_type`, stored as
/// structure-of-arrays (numerically identical to the ggml blocks: `d` and `s`
/// are the f16-rounded values widened to f32, Q8_K's `d` is f32).
#[derive(Debug, Default)]
pub(crate) struct ActQ8 {
    pub qs: Vec<i8>,
    pub d: Vec<f32>,
    pub s: Vec<f32>,
    pub bsums: Vec<i16>,
    /// Blocks per row.
    pub nb: usize,
}

/// Activations in the form a weight type's kernels consume.
#[derive(Debug)]
pub(crate) enum Acts<'a> {
    F32(&'a [f32]),
    /// f16 or bf16 bits.
    Half(&'a [u16]),
    Q8(&'a ActQ8),
}

/// Reusable buffers for [`prepare_acts`] (kept per thread by the matmul so a
/// call allocates nothing once the buffers have grown).
#[derive(Debug, Default)]
pub(crate) struct ActScratch {
    q8: ActQ8,
    half: Vec<u16>,
}

/// Clears `v` and resizes it to `n` copies of `x`, keeping its capacity.
fn reset<T: Clone>(v: &mut Vec<T>, n: usize, x: T) {
    v.clear();
    v.resize(n, x);
}

/// Quantises `m` rows of `cols` activations for weights of type `ty`, into
/// `scratch`.
pub(crate) fn prepare_acts<'a>(
    ty: GgmlType,
    x: &'a [f32],
    m: usize,
    cols: usize,
    scratch: &'a mut ActScratch,
) -> Acts<'a> {
    match ty.vec_dot_type() {
        GgmlType::F32 => Acts::F32(x),
        GgmlType::F16 => {
            let h = &mut scratch.half;
            h.clear();
            h.extend(x.iter().map(|&v| quant::f32_to_f16_bits(v)));
            Acts::Half(h)
        }
        GgmlType::BF16 => {
            let h = &mut scratch.half;
            h.clear();
            h.extend(x.iter().map(|&v| quant::f32_to_bf16_bits(v)));
            Acts::Half(h)
        }
        GgmlType::Q8_K => {
            let nb = cols / QK_K;
            let a = &mut scratch.q8;
            reset(&mut a.qs, m * cols, 0);
            reset(&mut a.d, m * nb, 0.0);
            a.s.clear();
            reset(&mut a.bsums, m * nb * 16, 0);
            a.nb = nb;
            quantize_q8_k(x, a);
            Acts::Q8(a)
        }
        vt => {
            let with_s = vt == GgmlType::Q8_1;
            let nb = cols / QK;
            let a = &mut scratch.q8;
            reset(&mut a.qs, m * cols, 0);
            reset(&mut a.d, m * nb, 0.0);
            if with_s {
                reset(&mut a.s, m * nb, 0.0);
            } else {
                a.s.clear();
            }
            a.bsums.clear();
            a.nb = nb;
            quantize_q8(x, a, with_s);
            Acts::Q8(a)
        }
    }
}

/// Q8_0 / Q8_1 quantisation of `x` into `qs`, `d` and (when not empty) `s`.
#[inline(always)]
fn quantize_q8_body(x: &[f32], qs: &mut [i8], d: &mut [f32], s: &mut [f32]) {
    let with_s = !s.is_empty();
    for (b, (xb, qb)) in x.chunks_exact(QK).zip(qs.chunks_exact_mut(QK)).enumerate() {
        let (dh, sum, df) = quant::quantize_block_q8(xb, qb);
        d[b] = quant::f16_bits_to_f32(dh);
        if with_s {
            s[b] = quant::f16_bits_to_f32(quant::f32_to_f16_bits(df * sum as f32));
        }
    }
}

/// Blocks below which quantisation stays on the calling thread.
const PAR_QUANT_BLOCKS: usize = 256;

/// Raw pointers to an `ActQ8`'s buffers, for workers filling disjoint
/// block ranges.
#[derive(Clone, Copy)]
struct Q8Ptrs {
    qs: *mut i8,
    d: *mut f32,
    s: *mut f32,
    with_s: bool,
}
// SAFETY: workers write pairwise disjoint block ranges; the caller holds the
// unique borrow of the buffers until all are done.
unsafe impl Send for Q8Ptrs {}
// SAFETY: as above.
unsafe impl Sync for Q8Ptrs {}

impl Q8Ptrs {
    /// Blocks `r` of the buffers.
    ///
    /// # Safety
    /// The buffers must hold at least `r.end` blocks (`qs` `r.end * QK`
    /// values, `d` and, when `with_s`, `s` `r.end`) and stay alive and
    /// otherwise unaccessed at those blocks while the returned slices (whose
    /// `'static` is a lie) are used.
    unsafe fn blocks(
        self,
        r: std::ops::Range<usize>,
    ) -> (&'static mut [i8], &'static mut [f32], &'static mut [f32]) {
        let n = r.len();
        // SAFETY: forwarded from the caller.
        unsafe {
            (
                std::slice::from_raw_parts_mut(self.qs.add(r.start * QK), n * QK),
                std::slice::from_raw_parts_mut(self.d.add(r.start), n),
                if self.with_s {
                    std::slice::from_raw_parts_mut(self.s.add(r.start), n)
                } else {
                    &mut []
                },
            )
        }
    }
}

/// Q8_K quantisation of `x` into `a` (sized by the caller).
#[inline(always)]
fn quantize_q8_k_body(x: &[f32], a: &mut ActQ8) {
    for ((xb, qb), (d, bs)) in x
        .chunks_exact(QK_K)
        .zip(a.qs.chunks_exact_mut(QK_K))
        .zip(a.d.iter_mut().zip(a.bsums.chunks_exact_mut(16)))
    {
        *d = quant::quantize_block_q8_k(xb, qb, bs);
    }
}

// The same source compiled with AVX2 enabled, so `round_ties_even` becomes
// `vroundps` instead of a libm `rintf` call. Identical results by
// construction (IEEE round-half-even either way).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn quantize_q8_avx2(x: &[f32], qs: &mut [i8], d: &mut [f32], s: &mut [f32]) {
    quantize_q8_body(x, qs, d, s)
}

/// [`quantize_q8_body`] with explicit AVX-512: the same operations per
/// element (max ignoring NaN, `x * (127 / amax)` rounded half-even, the
/// i32 conversion's out-of-range value, saturation to i8, a wrapping sum),
/// so bitwise the same result.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn quantize_q8_avx512(x: &[f32], qs: &mut [i8], d: &mut [f32], s: &mut [f32]) {
    use std::arch::x86_64::*;
    let with_s = !s.is_empty();
    for (b, (xb, qb)) in x.chunks_exact(QK).zip(qs.chunks_exact_mut(QK)).enumerate() {
        // SAFETY: `xb` has 32 floats and `qb` 32 bytes (chunks_exact).
        unsafe {
            let v0 = _mm512_loadu_ps(xb.as_ptr());
            let v1 = _mm512_loadu_ps(xb.as_ptr().add(16));
            let (a0, a1) = (_mm512_abs_ps(v0), _mm512_abs_ps(v1));
            // max(|v|, m): a NaN |v| yields m, as the scalar fold does.
            let m = _mm512_max_ps(a1, _mm512_max_ps(a0, _mm512_setzero_ps()));
            let amax = _mm512_reduce_max_ps(m);
            let dd = amax / 127.0;
            let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
            let idv = _mm512_set1_ps(id);
            const RN: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
            let i0 = _mm512_cvt_roundps_epi32::<RN>(_mm512_mul_ps(v0, idv));
            let i1 = _mm512_cvt_roundps_epi32::<RN>(_mm512_mul_ps(v1, idv));
            let sum = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
            _mm_storeu_si128(qb.as_mut_ptr().cast(), _mm512_cvtsepi32_epi8(i0));
            _mm_storeu_si128(qb.as_mut_ptr().add(16).cast(), _mm512_cvtsepi32_epi8(i1));
            d[b] = quant::f16_bits_to_f32(quant::f32_to_f16_bits(dd));
            if with_s {
                s[b] = quant::f16_bits_to_f32(quant::f32_to_f16_bits(dd * sum as f32));
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn quantize_q8_k_avx2(x: &[f32], a: &mut ActQ8) {
    quantize_q8_k_body(x, a)
}

/// Quantises every block of `x` into `a`: on the pool for large batches
/// (blocks are independent, so the split never changes the result).
fn quantize_q8(x: &[f32], a: &mut ActQ8, with_s: bool) {
    let blocks = x.len() / QK;
    let ptrs = Q8Ptrs {
        qs: a.qs.as_mut_ptr(),
        d: a.d.as_mut_ptr(),
        s: a.s.as_mut_ptr(),
        with_s,
    };
    let run = |r: std::ops::Range<usize>| {
        let xr = &x[r.start * QK..r.end * QK];
        // SAFETY: `r` is within `blocks` (the buffers hold that many, sized
        // by the caller) and each range goes to one worker.
        let (qs, d, s) = unsafe { ptrs.blocks(r) };
        #[cfg(target_arch = "x86_64")]
        if Isa::Avx512Vnni.is_supported() {
            // SAFETY: AVX-512 support checked at runtime.
            return unsafe { quantize_q8_avx512(xr, qs, d, s) };
        }
        #[cfg(target_arch = "x86_64")]
        if Isa::Avx2.is_supported() {
            // SAFETY: AVX2/FMA/F16C support checked at runtime.
            return unsafe { quantize_q8_avx2(xr, qs, d, s) };
        }
        quantize_q8_body(xr, qs, d, s)
    };
    if blocks < PAR_QUANT_BLOCKS {
        run(0..blocks);
    } else {
        crate::pool::parallel_ranges(blocks, &|_, r| run(r));
    }
}

fn quantize_q8_k(x: &[f32], a: &mut ActQ8) {
    #[cfg(target_arch = "x86_64")]
    if Isa::Avx2.is_supported() {
        // SAFETY: AVX2/FMA/F16C support checked at runtime.
        return unsafe { quantize_q8_k_avx2(x, a) };
    }
    quantize_q8_k_body(x, a)
}

/// Computes `out[r * ldo + j] = dot(w row r, activation row i0 + j)` for
/// `r < nrows`, `j < n`. `w` holds `nrows` rows of `row_bytes` bytes.
#[allow(clippy::too_many_arguments)]
pub(crate) fn compute_block(
    isa: Isa,
    ty: GgmlType,
    w: &[u8],
    row_bytes: usize,
    nrows: usize,
    cols: usize,
    acts: &Acts<'_>,
    i0: usize,
    n: usize,
    out: &mut [f32],
    ldo: usize,
) {
    if nrows == 0 || n == 0 {
        return;
    }
    check_block(ty, w, row_bytes, nrows, cols, acts, i0, n, out.len(), ldo);
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni if isa.is_supported() => {
            // SAFETY: CPU support checked; buffer sizes by `check_block`.
            unsafe { avx512::compute_block(ty, w, row_bytes, nrows, cols, acts, i0, n, out, ldo) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 if isa.is_supported() => {
            // SAFETY: CPU support checked; buffer sizes by `check_block`.
            unsafe { avx2::compute_block(ty, w, row_bytes, nrows, cols, acts, i0, n, out, ldo) }
        }
        _ => {
            for r in 0..nrows {
                let row = &w[r * row_bytes..(r + 1) * row_bytes];
                for j in 0..n {
                    out[r * ldo + j] = scalar::dot(ty, row, cols, acts, i0 + j);
                }
            }
        }
    }
}

/// [`compute_block`]'s size checks, once per call and overflow-proof: the
/// SIMD kernels read through raw pointers, and these are what keep them in
/// bounds. Out of line, so they leave the hot loops' code alone (inline,
/// they measurably slowed some m = 1 kernels).
#[inline(never)]
#[allow(clippy::too_many_arguments)]
fn check_block(
    ty: GgmlType,
    w: &[u8],
    row_bytes: usize,
    nrows: usize,
    cols: usize,
    acts: &Acts<'_>,
    i0: usize,
    n: usize,
    out_len: usize,
    ldo: usize,
) {
    let end = i0.checked_add(n).expect("activation rows overflow");
    assert!(
        covers(w.len(), &[nrows, row_bytes]),
        "weight block too short"
    );
    assert!(
        n <= ldo
            && (nrows - 1)
                .checked_mul(ldo)
                .and_then(|v| v.checked_add(n))
                .is_some_and(|need| out_len >= need),
        "output block too short"
    );
    match acts {
        Acts::F32(x) => assert!(covers(x.len(), &[end, cols])),
        Acts::Half(x) => assert!(covers(x.len(), &[end, cols])),
        Acts::Q8(a) => {
            assert!(covers(a.qs.len(), &[end, cols]) && covers(a.d.len(), &[end, a.nb]));
            assert!(a.nb.checked_mul(ty.block_len()) == Some(cols));
            if ty.vec_dot_type() == GgmlType::Q8_1 {
                assert!(covers(a.s.len(), &[end, a.nb]));
            }
            if ty.vec_dot_type() == GgmlType::Q8_K {
                assert!(covers(a.bsums.len(), &[end, a.nb, 16]));
            }
        }
    }
    assert_eq!(ty.row_bytes(cols), Some(row_bytes));
}

/// Whether `len` is at least the product of `dims` (false if it overflows).
fn covers(len: usize, dims: &[usize]) -> bool {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .is_some_and(|need| len >= need)
}

/// Raw per-activation-row pointers for the SIMD kernels.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, Debug)]
pub(crate) struct ActPtr {
    pub qs: *const i8,
    pub d: *const f32,
    pub s: *const f32,
    pub bsums: *const i16,
}

#[cfg(target_arch = "x86_64")]
impl ActPtr {
    pub(crate) fn new(a: &ActQ8, cols: usize, i: usize) -> ActPtr {
        ActPtr {
            qs: a.qs[i * cols..].as_ptr(),
            d: a.d[i * a.nb..].as_ptr(),
            s: if a.s.is_empty() {
                std::ptr::null()
            } else {
                a.s[i * a.nb..].as_ptr()
            },
            bsums: if a.bsums.is_empty() {
                std::ptr::null()
            } else {
                a.bsums[i * a.nb * 16..].as_ptr()
            },
        }
    }
}

/// A quantised kernel computing an R×N tile of dot products over `nb` blocks.
#[cfg(target_arch = "x86_64")]
pub(crate) trait QKernel {
    /// # Safety
    /// The CPU must support the kernel's ISA; each `w[r]` must point at `nb`
    /// readable weight blocks of the kernel's type, and each `x[j]` at an
    /// activation row of `nb` blocks of its `vec_dot_type` (`qs`, `d`, plus
    /// `s` for Q8_1 or `bsums` for Q8_K; aligned, as from [`ActPtr::new`]).
    unsafe fn run<const R: usize, const N: usize>(
        w: [*const u8; R],
        x: [ActPtr; N],
        nb: usize,
    ) -> [[f32; N]; R];
}

/// How many rows beyond the next 4-row group the m = 1 path prefetches.
#[cfg(target_arch = "x86_64")]
const PREFETCH_ROWS: usize = 4;

/// Software prefetch of `w[start..start + len]` (clamped to `w`) into L1:
/// with one activation row the kernels stream weights, and the hardware
/// prefetchers alone keep too few lines in flight from L3/DRAM.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_rows(w: &[u8], start: usize, len: usize) {
    let end = (start + len).min(w.len());
    let mut off = start;
    while off < end {
        // SAFETY: `off < w.len()`, so the pointer is in bounds; prefetch
        // never faults and has no architectural effect.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(w.as_ptr().add(off).cast()) };
        off += 64;
    }
}

/// Drives a [`QKernel`] over an `nrows × n` block with 2×4 / 1×4 / 4×1 / 1×1
/// tiles. Tiling never changes results (each element is computed alone).
///
/// # Safety
/// The CPU must support `K`'s ISA, `K` must be the kernel for `w`'s type,
/// and the buffers must pass [`compute_block`]'s checks.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn drive<K: QKernel>(
    w: &[u8],
    row_bytes: usize,
    nrows: usize,
    cols: usize,
    a: &ActQ8,
    i0: usize,
    n: usize,
    out: &mut [f32],
    ldo: usize,
) {
    let nb = a.nb;
    let wp = |r: usize| w[r * row_bytes..].as_ptr();
    let n4 = n / 4 * 4;
    for j0 in (0..n4).step_by(4) {
        let x: [ActPtr; 4] = std::array::from_fn(|j| ActPtr::new(a, cols, i0 + j0 + j));
        let mut r = 0;
        while r + 2 <= nrows {
            // SAFETY: forwarded from the caller.
            let res = unsafe { K::run::<2, 4>([wp(r), wp(r + 1)], x, nb) };
            for (dr, row) in res.iter().enumerate() {
                out[(r + dr) * ldo + j0..(r + dr) * ldo + j0 + 4].copy_from_slice(row);
            }
            r += 2;
        }
        if r < nrows {
            // SAFETY: forwarded from the caller.
            let res = unsafe { K::run::<1, 4>([wp(r)], x, nb) };
            out[r * ldo + j0..r * ldo + j0 + 4].copy_from_slice(&res[0]);
        }
    }
    for j in n4..n {
        let x = [ActPtr::new(a, cols, i0 + j)];
        let mut r = 0;
        while r + 4 <= nrows {
            prefetch_rows(w, (r + 4 + PREFETCH_ROWS) * row_bytes, 4 * row_bytes);
            // SAFETY: forwarded from the caller.
            let res = unsafe { K::run::<4, 1>([wp(r), wp(r + 1), wp(r + 2), wp(r + 3)], x, nb) };
            for (dr, v) in res.iter().enumerate() {
                out[(r + dr) * ldo + j] = v[0];
            }
            r += 4;
        }
        while r < nrows {
            // SAFETY: forwarded from the caller.
            let res = unsafe { K::run::<1, 1>([wp(r)], x, nb) };
            out[r * ldo + j] = res[0][0];
            r += 1;
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::cpu::IsaCoverage;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// Every fast quantiser against the scalar body, bitwise, on random
    /// blocks and the edge cases (zeros, NaN, infinities, huge values,
    /// exact .5 ties).
    #[test]
    fn q8_quantisers_match_the_scalar_body() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let mut x: Vec<f32> = (0..64 * QK)
            .map(|_| rng.random_range(-3.0f32..3.0))
            .collect();
        x[..QK].fill(0.0);
        x[QK] = f32::NAN;
        x[2 * QK] = f32::INFINITY;
        x[3 * QK + 5] = 1e38;
        x[3 * QK + 6] = -1e38;
        for (i, v) in x[4 * QK..5 * QK].iter_mut().enumerate() {
            *v = i as f32 - 15.5;
        }
        x[5 * QK] = 127.0;
        x[5 * QK + 1] = 0.5;
        let n = x.len() / QK;
        let reference = {
            let (mut qs, mut d, mut s) = (vec![0i8; x.len()], vec![0.0f32; n], vec![0.0f32; n]);
            quantize_q8_body(&x, &mut qs, &mut d, &mut s);
            (qs, d, s)
        };
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        type Quantiser = unsafe fn(&[f32], &mut [i8], &mut [f32], &mut [f32]);
        let mut cov = IsaCoverage::new("dot::q8_quantisers_match_the_scalar_body");
        for isa in cov.isas() {
            let f: Quantiser = match isa {
                Isa::Scalar => quantize_q8_body,
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => quantize_q8_avx2,
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512Vnni => quantize_q8_avx512,
                #[cfg(not(target_arch = "x86_64"))]
                _ => unreachable!("only x86_64 CPUs report SIMD ISAs"),
            };
            let (mut qs, mut d, mut s) = (vec![0i8; x.len()], vec![0.0f32; n], vec![0.0f32; n]);
            // SAFETY: `cov.isas()` lists only ISAs this CPU supports.
            unsafe { f(&x, &mut qs, &mut d, &mut s) };
            assert_eq!(qs, reference.0, "{isa} quants");
            assert_eq!(bits(&d), bits(&reference.1), "{isa} scales");
            assert_eq!(bits(&s), bits(&reference.2), "{isa} sums");
            cov.ran(isa);
        }
        // The pooled path splits blocks across workers: the same result.
        let mut a = ActQ8 {
            qs: vec![0; x.len()],
            d: vec![0.0; n],
            s: vec![0.0; n],
            bsums: Vec::new(),
            nb: n,
        };
        let big: Vec<f32> = x.iter().cycle().take(x.len() * 8).copied().collect();
        a.qs.resize(big.len(), 0);
        a.d.resize(8 * n, 0.0);
        a.s.resize(8 * n, 0.0);
        quantize_q8(&big, &mut a, true);
        assert_eq!(&a.qs[..x.len()], &reference.0[..]);
        assert_eq!(&a.qs[7 * x.len()..], &reference.0[..]);
        assert_eq!(bits(&a.d[7 * n..]), bits(&reference.1));
    }
}
