//! AVX-512 (F/BW/VL) + VNNI kernels. Integer block products use `vpdpbusd`;
//! the per-block f32 accumulation stays in the exact order of `scalar.rs`
//! (one fused multiply-add per block and lane). K-quants reuse the AVX2
//! kernels; float types use 512-bit fmas.

use std::arch::x86_64::*;

use super::avx2::{self, f16_at, f16x2_at, float_block, hsum8};
use super::{ActPtr, Acts, QKernel, drive};
use crate::quant::GgmlType;

/// `dot::compute_block` for [`Isa::Avx512Vnni`](crate::Isa::Avx512Vnni).
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C;
/// the arguments must pass `dot::compute_block`'s checks.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn compute_block(
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
    // SAFETY (all arms): forwarded from the caller.
    unsafe {
        match (ty, acts) {
            (GgmlType::Q4_0, Acts::Q8(a)) => {
                drive::<Q4_0K>(w, row_bytes, nrows, cols, a, i0, n, out, ldo)
            }
            (GgmlType::Q4_1, Acts::Q8(a)) => {
                drive::<Q4_1K>(w, row_bytes, nrows, cols, a, i0, n, out, ldo)
            }
            (GgmlType::Q5_0, Acts::Q8(a)) => {
                drive::<Q5_0K>(w, row_bytes, nrows, cols, a, i0, n, out, ldo)
            }
            (GgmlType::Q8_0, Acts::Q8(a)) => {
                drive::<Q8_0K>(w, row_bytes, nrows, cols, a, i0, n, out, ldo)
            }
            (GgmlType::Q4_K, Acts::Q8(a)) => {
                drive::<avx2::Q4KK>(w, row_bytes, nrows, cols, a, i0, n, out, ldo)
            }
            (GgmlType::Q6_K, Acts::Q8(a)) => {
                drive::<avx2::Q6KK>(w, row_bytes, nrows, cols, a, i0, n, out, ldo)
            }
            (GgmlType::F32, Acts::F32(x)) => float_block(nrows, n, out, ldo, |r, j| {
                dot_float(
                    w[r * row_bytes..].as_ptr(),
                    x[(i0 + j) * cols..].as_ptr().cast(),
                    cols,
                    Kind::F32,
                )
            }),
            (GgmlType::F16, Acts::Half(x)) => float_block(nrows, n, out, ldo, |r, j| {
                dot_float(
                    w[r * row_bytes..].as_ptr(),
                    x[(i0 + j) * cols..].as_ptr().cast(),
                    cols,
                    Kind::F16,
                )
            }),
            (GgmlType::BF16, Acts::Half(x)) => float_block(nrows, n, out, ldo, |r, j| {
                dot_float(
                    w[r * row_bytes..].as_ptr(),
                    x[(i0 + j) * cols..].as_ptr().cast(),
                    cols,
                    Kind::Bf16,
                )
            }),
            _ => unreachable!("activation form does not match weight type {ty:?}"),
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    F32,
    F16,
    Bf16,
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn hsum16(v: __m512) -> f32 {
    let lo = _mm512_castps512_ps256(v);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    hsum8(_mm256_add_ps(lo, hi))
}

/// 16 elements of `kind` at `p` (bytes) widened to f32.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C;
/// `p` must be valid for reading 16 elements of `kind` (any alignment).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn load16(p: *const u8, kind: Kind) -> __m512 {
    // SAFETY: caller guarantees 16 readable elements.
    unsafe {
        match kind {
            Kind::F32 => _mm512_loadu_ps(p.cast()),
            Kind::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
            Kind::Bf16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                _mm256_loadu_si256(p.cast()),
            ))),
        }
    }
}

/// Element `k` of `kind` at `p` (bytes) as f32.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C;
/// `p` must be valid for reading `k + 1` elements of `kind` (any alignment).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn load1(p: *const u8, k: usize, kind: Kind) -> f32 {
    // SAFETY: caller guarantees element k is readable.
    unsafe {
        match kind {
            Kind::F32 => p.cast::<f32>().add(k).read_unaligned(),
            Kind::F16 => f16_at(p.add(2 * k)),
            Kind::Bf16 => f32::from_bits((p.cast::<u16>().add(k).read_unaligned() as u32) << 16),
        }
    }
}

/// 16-lane float dot of `cols` elements of `kind`.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C;
/// `w` and `x` must each be valid for reading `cols` elements of `kind`
/// (any alignment).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn dot_float(w: *const u8, x: *const u8, cols: usize, kind: Kind) -> f32 {
    let esz = if kind == Kind::F32 { 4 } else { 2 };
    let nc = cols / 16 * 16;
    let mut acc = _mm512_setzero_ps();
    // SAFETY: caller guarantees `cols` readable elements behind w and x.
    unsafe {
        for c in (0..nc).step_by(16) {
            acc = _mm512_fmadd_ps(
                load16(w.add(c * esz), kind),
                load16(x.add(c * esz), kind),
                acc,
            );
        }
        let mut s = hsum16(acc);
        for k in nc..cols {
            s += load1(w, k, kind) * load1(x, k, kind);
        }
        s
    }
}

/// One 16-byte nibble block unpacked to 32 bytes (low nibbles first).
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C;
/// `p` must be valid for reading 16 bytes (any alignment).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn nibbles1(p: *const u8) -> __m256i {
    // SAFETY: caller guarantees 16 readable bytes.
    let a = unsafe { _mm256_broadcastsi128_si256(_mm_loadu_si128(p.cast())) };
    _mm256_and_si256(
        _mm256_srlv_epi64(a, _mm256_set_epi64x(4, 4, 0, 0)),
        _mm256_set1_epi8(0x0F),
    )
}

// The quantised kernels use 256-bit `vpdpbusd` (AVX512-VL VNNI): on current
// cores 512-bit integer ops halve the usable vector ports, and ggml's
// per-block accumulation order gives no way to merge two blocks' fmas, so
// 256-bit measured faster.

pub(crate) struct Q4_1K;
impl QKernel for Q4_1K {
    /// # Safety
    /// As [`QKernel::run`], with AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn run<const R: usize, const N: usize>(
        w: [*const u8; R],
        x: [ActPtr; N],
        nb: usize,
    ) -> [[f32; N]; R] {
        let mut acc = [[_mm256_setzero_ps(); N]; R];
        let mut summs = [[0.0f32; N]; R];
        // SAFETY: pointers cover nb blocks (caller).
        unsafe {
            for b in 0..nb {
                let xv: [__m256i; N] =
                    std::array::from_fn(|j| _mm256_loadu_si256(x[j].qs.add(32 * b).cast()));
                for r in 0..R {
                    let p = w[r].add(20 * b);
                    let (wd, wm) = f16x2_at(p);
                    let wdv = _mm256_set1_ps(wd);
                    let wq = nibbles1(p.add(4));
                    for j in 0..N {
                        summs[r][j] = wm.mul_add(*x[j].s.add(b), summs[r][j]);
                        let dd = _mm256_mul_ps(wdv, _mm256_broadcast_ss(&*x[j].d.add(b)));
                        let p = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(
                            _mm256_setzero_si256(),
                            wq,
                            xv[j],
                        ));
                        acc[r][j] = _mm256_fmadd_ps(dd, p, acc[r][j]);
                    }
                }
            }
        }
        std::array::from_fn(|r| std::array::from_fn(|j| hsum8(acc[r][j]) + summs[r][j]))
    }
}

/// Shared body of the Q8_0, Q4_0 and Q5_0 kernels: `$bs` block bytes, signed quants
/// of a block produced by `$wq`. Products use ggml's sign trick
/// (|w| × ±x, same wrapping for -128) so they match `maddubs` exactly.
macro_rules! q8_like_kernel {
    ($name:ident, $bs:expr, $wq:expr) => {
        pub(crate) struct $name;
        impl QKernel for $name {
            /// # Safety
            /// As [`QKernel::run`], with AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C.
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
            unsafe fn run<const R: usize, const N: usize>(
                w: [*const u8; R],
                x: [ActPtr; N],
                nb: usize,
            ) -> [[f32; N]; R] {
                let mut acc = [[_mm256_setzero_ps(); N]; R];
                // SAFETY: pointers cover nb blocks (caller).
                unsafe {
                    for b in 0..nb {
                        let xv: [__m256i; N] =
                            std::array::from_fn(|j| _mm256_loadu_si256(x[j].qs.add(32 * b).cast()));
                        for r in 0..R {
                            let p = w[r].add($bs * b);
                            let wdv = _mm256_set1_ps(f16_at(p));
                            let wq: __m256i = $wq(p.add(2));
                            let aw = _mm256_sign_epi8(wq, wq);
                            for j in 0..N {
                                let dd = _mm256_mul_ps(wdv, _mm256_broadcast_ss(&*x[j].d.add(b)));
                                let sx = _mm256_sign_epi8(xv[j], wq);
                                let p = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(
                                    _mm256_setzero_si256(),
                                    aw,
                                    sx,
                                ));
                                acc[r][j] = _mm256_fmadd_ps(dd, p, acc[r][j]);
                            }
                        }
                    }
                }
                std::array::from_fn(|r| std::array::from_fn(|j| hsum8(acc[r][j])))
            }
        }
    };
}

/// A Q8_0 block's 32 signed quants.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C;
/// `p` must be valid for reading 32 bytes (any alignment).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q8_w(p: *const u8) -> __m256i {
    // SAFETY: 32 readable bytes (caller).
    unsafe { _mm256_loadu_si256(p.cast()) }
}

/// A Q4_0 block's 32 quants, unpacked and re-centred to signed.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C;
/// `p` must be valid for reading 16 bytes (any alignment).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_0_w(p: *const u8) -> __m256i {
    // SAFETY: 16 readable bytes (caller).
    _mm256_sub_epi8(unsafe { nibbles1(p) }, _mm256_set1_epi8(8))
}

/// A Q5_0 block's 32 quants (`qh` at `p`, nibbles at `p + 4`) as signed
/// `(nib | bit << 4) - 16`: the nibble with 0xF0 ORed in where the bit is
/// clear, as ggml's AVX2 kernel builds them.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C;
/// `p` must be valid for reading 20 bytes (any alignment).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q5_0_w(p: *const u8) -> __m256i {
    // SAFETY: 20 readable bytes (caller).
    let (qh, lo) = unsafe { (p.cast::<u32>().read_unaligned(), nibbles1(p.add(4))) };
    // Byte i keeps 0 where bit i of qh is set, else takes 0xF0.
    let hi = _mm256_mask_mov_epi8(_mm256_set1_epi8(0xF0u8 as i8), qh, _mm256_setzero_si256());
    _mm256_or_si256(lo, hi)
}

q8_like_kernel!(Q8_0K, 34, q8_w);
q8_like_kernel!(Q5_0K, 22, q5_0_w);
q8_like_kernel!(Q4_0K, 18, q4_0_w);
