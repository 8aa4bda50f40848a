//! AVX2 + FMA + F16C kernels. Mirror `scalar.rs` bit for bit.

use std::arch::x86_64::*;

use super::{ActPtr, Acts, QKernel, drive};
use crate::quant::{GgmlType, QK_K, scale_min_k4};

/// ggml's `hsum_float_8`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn hsum8(v: __m256) -> f32 {
    let mut r = _mm_add_ps(_mm256_extractf128_ps::<1>(v), _mm256_castps256_ps128(v));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    _mm_cvtss_f32(r)
}

/// Reads an f16 at `p` (unaligned) as f32.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `p` must be valid for reading
/// 2 bytes (any alignment).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn f16_at(p: *const u8) -> f32 {
    // SAFETY: caller guarantees 2 readable bytes.
    let h = unsafe { p.cast::<u16>().read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
}

/// Reads two adjacent f16 at `p` as (first, second).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `p` must be valid for reading
/// 4 bytes (any alignment).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn f16x2_at(p: *const u8) -> (f32, f32) {
    // SAFETY: caller guarantees 4 readable bytes.
    let h = unsafe { p.cast::<i32>().read_unaligned() };
    let v = _mm_cvtph_ps(_mm_cvtsi32_si128(h));
    (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
}

/// `dot::compute_block` for [`Isa::Avx2`](crate::Isa::Avx2).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; the arguments must pass
/// `dot::compute_block`'s checks.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
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
                drive::<Q4KK>(w, row_bytes, nrows, cols, a, i0, n, out, ldo)
            }
            (GgmlType::Q6_K, Acts::Q8(a)) => {
                drive::<Q6KK>(w, row_bytes, nrows, cols, a, i0, n, out, ldo)
            }
            (GgmlType::F32, Acts::F32(x)) => float_block(nrows, n, out, ldo, |r, j| {
                dot_f32(
                    w[r * row_bytes..].as_ptr(),
                    x[(i0 + j) * cols..].as_ptr(),
                    cols,
                )
            }),
            (GgmlType::F16, Acts::Half(x)) => float_block(nrows, n, out, ldo, |r, j| {
                dot_f16(
                    w[r * row_bytes..].as_ptr(),
                    x[(i0 + j) * cols..].as_ptr(),
                    cols,
                )
            }),
            (GgmlType::BF16, Acts::Half(x)) => float_block(nrows, n, out, ldo, |r, j| {
                dot_bf16(
                    w[r * row_bytes..].as_ptr(),
                    x[(i0 + j) * cols..].as_ptr(),
                    cols,
                )
            }),
            _ => unreachable!("activation form does not match weight type {ty:?}"),
        }
    }
}

#[inline]
pub(crate) fn float_block(
    nrows: usize,
    n: usize,
    out: &mut [f32],
    ldo: usize,
    f: impl Fn(usize, usize) -> f32,
) {
    for r in 0..nrows {
        for j in 0..n {
            out[r * ldo + j] = f(r, j);
        }
    }
}

/// 16-lane float dot: w as f32 bytes.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `w` must be valid for reading
/// `4 * cols` bytes (any alignment) and `x` for reading `cols` aligned f32.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_f32(w: *const u8, x: *const f32, cols: usize) -> f32 {
    let nc = cols / 16 * 16;
    let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    // SAFETY: caller guarantees `cols` readable elements behind w and x.
    unsafe {
        let wf = w.cast::<f32>();
        for c in (0..nc).step_by(16) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(wf.add(c)), _mm256_loadu_ps(x.add(c)), a0);
            a1 = _mm256_fmadd_ps(
                _mm256_loadu_ps(wf.add(c + 8)),
                _mm256_loadu_ps(x.add(c + 8)),
                a1,
            );
        }
        let mut s = hsum8(_mm256_add_ps(a0, a1));
        for k in nc..cols {
            s += wf.add(k).read_unaligned() * *x.add(k);
        }
        s
    }
}

/// [`dot_f32`] for f16 weights and activations.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `w` must be valid for reading
/// `2 * cols` bytes and `x` for reading `cols` u16 (any alignment).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_f16(w: *const u8, x: *const u16, cols: usize) -> f32 {
    let nc = cols / 16 * 16;
    let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    // SAFETY: caller guarantees `cols` readable elements behind w and x.
    unsafe {
        let wh = w.cast::<u16>();
        let ld = |p: *const u16| _mm256_cvtph_ps(_mm_loadu_si128(p.cast()));
        for c in (0..nc).step_by(16) {
            a0 = _mm256_fmadd_ps(ld(wh.add(c)), ld(x.add(c)), a0);
            a1 = _mm256_fmadd_ps(ld(wh.add(c + 8)), ld(x.add(c + 8)), a1);
        }
        let mut s = hsum8(_mm256_add_ps(a0, a1));
        for k in nc..cols {
            s += f16_at(w.add(2 * k)) * f16_at(x.add(k).cast());
        }
        s
    }
}

/// [`dot_f32`] for bf16 weights and activations.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `w` must be valid for reading
/// `2 * cols` bytes (any alignment) and `x` for reading `cols` aligned u16.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_bf16(w: *const u8, x: *const u16, cols: usize) -> f32 {
    let nc = cols / 16 * 16;
    let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let bf = |h: u16| f32::from_bits((h as u32) << 16);
    // SAFETY: caller guarantees `cols` readable elements behind w and x.
    unsafe {
        let wh = w.cast::<u16>();
        let ld = |p: *const u16| {
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                _mm_loadu_si128(p.cast()),
            )))
        };
        for c in (0..nc).step_by(16) {
            a0 = _mm256_fmadd_ps(ld(wh.add(c)), ld(x.add(c)), a0);
            a1 = _mm256_fmadd_ps(ld(wh.add(c + 8)), ld(x.add(c + 8)), a1);
        }
        let mut s = hsum8(_mm256_add_ps(a0, a1));
        for k in nc..cols {
            s += bf(wh.add(k).read_unaligned()) * bf(*x.add(k));
        }
        s
    }
}

/// Sum of 4 adjacent u8×i8 products per i32 lane (no saturation for the
/// operand ranges used here).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn mul_sum_us8(ax: __m256i, sy: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), _mm256_set1_epi16(1))
}

/// ggml's `mul_sum_i8_pairs_float` integer part (sign trick).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn mul_sum_i8(x: __m256i, y: __m256i) -> __m256i {
    mul_sum_us8(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x))
}

pub(crate) struct Q4_1K;
impl QKernel for Q4_1K {
    /// # Safety
    /// As [`QKernel::run`], with AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn run<const R: usize, const N: usize>(
        w: [*const u8; R],
        x: [ActPtr; N],
        nb: usize,
    ) -> [[f32; N]; R] {
        let mut acc = [[_mm256_setzero_ps(); N]; R];
        let mut summs = [[0.0f32; N]; R];
        let m4 = _mm256_set1_epi8(0x0F);
        let shift = _mm256_set_epi64x(4, 4, 0, 0);
        // SAFETY: pointers cover nb blocks (caller).
        unsafe {
            for b in 0..nb {
                let xv: [__m256i; N] =
                    std::array::from_fn(|j| _mm256_loadu_si256(x[j].qs.add(32 * b).cast()));
                for r in 0..R {
                    let p = w[r].add(20 * b);
                    let (wd, wm) = f16x2_at(p);
                    let wdv = _mm256_set1_ps(wd);
                    let q = _mm256_broadcastsi128_si256(_mm_loadu_si128(p.add(4).cast()));
                    let wq = _mm256_and_si256(_mm256_srlv_epi64(q, shift), m4);
                    for j in 0..N {
                        summs[r][j] = wm.mul_add(*x[j].s.add(b), summs[r][j]);
                        let dd = _mm256_mul_ps(wdv, _mm256_broadcast_ss(&*x[j].d.add(b)));
                        let p = _mm256_cvtepi32_ps(mul_sum_us8(wq, xv[j]));
                        acc[r][j] = _mm256_fmadd_ps(dd, p, acc[r][j]);
                    }
                }
            }
        }
        std::array::from_fn(|r| std::array::from_fn(|j| hsum8(acc[r][j]) + summs[r][j]))
    }
}

pub(crate) struct Q8_0K;
impl QKernel for Q8_0K {
    /// # Safety
    /// As [`QKernel::run`], with AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
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
                    let p = w[r].add(34 * b);
                    let wdv = _mm256_set1_ps(f16_at(p));
                    let wq = _mm256_loadu_si256(p.add(2).cast());
                    for j in 0..N {
                        let dd = _mm256_mul_ps(wdv, _mm256_broadcast_ss(&*x[j].d.add(b)));
                        let p = _mm256_cvtepi32_ps(mul_sum_i8(wq, xv[j]));
                        acc[r][j] = _mm256_fmadd_ps(dd, p, acc[r][j]);
                    }
                }
            }
        }
        std::array::from_fn(|r| std::array::from_fn(|j| hsum8(acc[r][j])))
    }
}

pub(crate) struct Q4_0K;
impl QKernel for Q4_0K {
    /// # Safety
    /// As [`QKernel::run`], with AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn run<const R: usize, const N: usize>(
        w: [*const u8; R],
        x: [ActPtr; N],
        nb: usize,
    ) -> [[f32; N]; R] {
        let mut acc = [[_mm256_setzero_ps(); N]; R];
        let m4 = _mm256_set1_epi8(0x0F);
        let off = _mm256_set1_epi8(8);
        let shift = _mm256_set_epi64x(4, 4, 0, 0);
        // SAFETY: pointers cover nb blocks (caller).
        unsafe {
            for b in 0..nb {
                let xv: [__m256i; N] =
                    std::array::from_fn(|j| _mm256_loadu_si256(x[j].qs.add(32 * b).cast()));
                for r in 0..R {
                    let p = w[r].add(18 * b);
                    let wdv = _mm256_set1_ps(f16_at(p));
                    let q = _mm256_broadcastsi128_si256(_mm_loadu_si128(p.add(2).cast()));
                    let wq =
                        _mm256_sub_epi8(_mm256_and_si256(_mm256_srlv_epi64(q, shift), m4), off);
                    for j in 0..N {
                        let dd = _mm256_mul_ps(wdv, _mm256_broadcast_ss(&*x[j].d.add(b)));
                        let p = _mm256_cvtepi32_ps(mul_sum_i8(wq, xv[j]));
                        acc[r][j] = _mm256_fmadd_ps(dd, p, acc[r][j]);
                    }
                }
            }
        }
        std::array::from_fn(|r| std::array::from_fn(|j| hsum8(acc[r][j])))
    }
}

/// ggml's `bytes_from_bits_32`: byte `i` is 0xFF where bit `i` of the
/// little-endian u32 at `p` is set, else 0.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `p` must be valid for reading
/// 4 bytes (any alignment).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn bytes_from_bits_32(p: *const u8) -> __m256i {
    // SAFETY: caller guarantees 4 readable bytes.
    let x32 = unsafe { p.cast::<i32>().read_unaligned() };
    let shuf = _mm256_set_epi64x(
        0x0303030303030303,
        0x0202020202020202,
        0x0101010101010101,
        0,
    );
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x32), shuf);
    let bits = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    _mm256_cmpeq_epi8(bits, _mm256_set1_epi64x(-1))
}

pub(crate) struct Q5_0K;
impl QKernel for Q5_0K {
    /// # Safety
    /// As [`QKernel::run`], with AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn run<const R: usize, const N: usize>(
        w: [*const u8; R],
        x: [ActPtr; N],
        nb: usize,
    ) -> [[f32; N]; R] {
        let mut acc = [[_mm256_setzero_ps(); N]; R];
        let m4 = _mm256_set1_epi8(0x0F);
        let f0 = _mm256_set1_epi8(0xF0u8 as i8);
        let shift = _mm256_set_epi64x(4, 4, 0, 0);
        // SAFETY: pointers cover nb blocks (caller).
        unsafe {
            for b in 0..nb {
                let xv: [__m256i; N] =
                    std::array::from_fn(|j| _mm256_loadu_si256(x[j].qs.add(32 * b).cast()));
                for r in 0..R {
                    let p = w[r].add(22 * b);
                    let wdv = _mm256_set1_ps(f16_at(p));
                    let q = _mm256_broadcastsi128_si256(_mm_loadu_si128(p.add(6).cast()));
                    let lo = _mm256_and_si256(_mm256_srlv_epi64(q, shift), m4);
                    // (nib | bit << 4) - 16 == nib | (bit clear ? 0xF0 : 0) as i8.
                    let hi = _mm256_andnot_si256(bytes_from_bits_32(p.add(2)), f0);
                    let wq = _mm256_or_si256(lo, hi);
                    for j in 0..N {
                        let dd = _mm256_mul_ps(wdv, _mm256_broadcast_ss(&*x[j].d.add(b)));
                        let p = _mm256_cvtepi32_ps(mul_sum_i8(wq, xv[j]));
                        acc[r][j] = _mm256_fmadd_ps(dd, p, acc[r][j]);
                    }
                }
            }
        }
        std::array::from_fn(|r| std::array::from_fn(|j| hsum8(acc[r][j])))
    }
}

/// Q4_K min correction for one block: updates the 4 `acc_m` lanes exactly as
/// ggml's `_mm_fmadd_ps(dmin, prod, acc_m)`.
#[inline]
pub(crate) fn q4k_mins(acc_m: &mut [f32; 4], dmin: f32, mins: &[u8; 8], bsums: &[i16]) {
    for (k, am) in acc_m.iter_mut().enumerate() {
        let s0 = bsums[4 * k].wrapping_add(bsums[4 * k + 1]) as i32;
        let s1 = bsums[4 * k + 2].wrapping_add(bsums[4 * k + 3]) as i32;
        let prod = mins[2 * k] as i32 * s0 + mins[2 * k + 1] as i32 * s1;
        *am = dmin.mul_add(prod as f32, *am);
    }
}

#[inline]
pub(crate) fn q4k_scales(scales: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for k in 0..8 {
        (sc[k], mn[k]) = scale_min_k4(k, scales);
    }
    (sc, mn)
}

pub(crate) struct Q4KK;
impl QKernel for Q4KK {
    /// # Safety
    /// As [`QKernel::run`], with AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn run<const R: usize, const N: usize>(
        w: [*const u8; R],
        x: [ActPtr; N],
        nb: usize,
    ) -> [[f32; N]; R] {
        let mut acc = [[_mm256_setzero_ps(); N]; R];
        let mut acc_m = [[[0.0f32; 4]; N]; R];
        let m4 = _mm256_set1_epi8(0x0F);
        // SAFETY: pointers cover nb blocks (caller).
        unsafe {
            for b in 0..nb {
                for r in 0..R {
                    let p = w[r].add(144 * b);
                    let (wd, wdmin) = f16x2_at(p);
                    let (sc, mn) = q4k_scales(std::slice::from_raw_parts(p.add(4), 12));
                    let mut isum = [_mm256_setzero_si256(); N];
                    for c in 0..4 {
                        let q = _mm256_loadu_si256(p.add(16 + 32 * c).cast());
                        let lo = _mm256_and_si256(q, m4);
                        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4);
                        let sl = _mm256_set1_epi16(sc[2 * c] as i16);
                        let sh = _mm256_set1_epi16(sc[2 * c + 1] as i16);
                        for j in 0..N {
                            let xp = x[j].qs.add(QK_K * b + 64 * c);
                            let pl = _mm256_madd_epi16(
                                _mm256_maddubs_epi16(lo, _mm256_loadu_si256(xp.cast())),
                                sl,
                            );
                            let ph = _mm256_madd_epi16(
                                _mm256_maddubs_epi16(hi, _mm256_loadu_si256(xp.add(32).cast())),
                                sh,
                            );
                            isum[j] = _mm256_add_epi32(isum[j], _mm256_add_epi32(pl, ph));
                        }
                    }
                    for j in 0..N {
                        let yd = *x[j].d.add(b);
                        let bs = std::slice::from_raw_parts(x[j].bsums.add(16 * b), 16);
                        q4k_mins(&mut acc_m[r][j], -yd * wdmin, &mn, bs);
                        acc[r][j] = _mm256_fmadd_ps(
                            _mm256_set1_ps(yd * wd),
                            _mm256_cvtepi32_ps(isum[j]),
                            acc[r][j],
                        );
                    }
                }
            }
        }
        std::array::from_fn(|r| {
            std::array::from_fn(|j| {
                let m = &acc_m[r][j];
                hsum8(acc[r][j]) + ((m[0] + m[2]) + (m[1] + m[3]))
            })
        })
    }
}

pub(crate) struct Q6KK;
impl QKernel for Q6KK {
    /// # Safety
    /// As [`QKernel::run`], with AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn run<const R: usize, const N: usize>(
        w: [*const u8; R],
        x: [ActPtr; N],
        nb: usize,
    ) -> [[f32; N]; R] {
        let mut acc = [[_mm256_setzero_ps(); N]; R];
        let m4 = _mm256_set1_epi8(0x0F);
        let m3 = _mm256_set1_epi8(3);
        let m32 = _mm256_set1_epi8(32);
        // SAFETY: pointers cover nb blocks (caller).
        unsafe {
            for b in 0..nb {
                for r in 0..R {
                    let p = w[r].add(210 * b);
                    let wd = f16_at(p.add(208));
                    let mut isum = [_mm256_setzero_si256(); N];
                    for h in 0..2 {
                        let ql0 = _mm256_loadu_si256(p.add(64 * h).cast());
                        let ql1 = _mm256_loadu_si256(p.add(64 * h + 32).cast());
                        let qh = _mm256_loadu_si256(p.add(128 + 32 * h).cast());
                        let q6 = [
                            _mm256_or_si256(
                                _mm256_and_si256(ql0, m4),
                                _mm256_slli_epi16::<4>(_mm256_and_si256(qh, m3)),
                            ),
                            _mm256_or_si256(
                                _mm256_and_si256(ql1, m4),
                                _mm256_slli_epi16::<4>(_mm256_and_si256(
                                    _mm256_srli_epi16::<2>(qh),
                                    m3,
                                )),
                            ),
                            _mm256_or_si256(
                                _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4),
                                _mm256_slli_epi16::<4>(_mm256_and_si256(
                                    _mm256_srli_epi16::<4>(qh),
                                    m3,
                                )),
                            ),
                            _mm256_or_si256(
                                _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4),
                                _mm256_slli_epi16::<4>(_mm256_and_si256(
                                    _mm256_srli_epi16::<6>(qh),
                                    m3,
                                )),
                            ),
                        ];
                        for (c, &qv) in q6.iter().enumerate() {
                            let s0 = *p.add(192 + 8 * h + 2 * c) as i8 as i16;
                            let s1 = *p.add(192 + 8 * h + 2 * c + 1) as i8 as i16;
                            let sv = _mm256_set_m128i(_mm_set1_epi16(s1), _mm_set1_epi16(s0));
                            for j in 0..N {
                                let xv = _mm256_loadu_si256(
                                    x[j].qs.add(QK_K * b + 128 * h + 32 * c).cast(),
                                );
                                let p16 = _mm256_sub_epi16(
                                    _mm256_maddubs_epi16(qv, xv),
                                    _mm256_maddubs_epi16(m32, xv),
                                );
                                isum[j] = _mm256_add_epi32(isum[j], _mm256_madd_epi16(p16, sv));
                            }
                        }
                    }
                    for j in 0..N {
                        let dd = _mm256_set1_ps(*x[j].d.add(b) * wd);
                        acc[r][j] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(isum[j]), acc[r][j]);
                    }
                }
            }
        }
        std::array::from_fn(|r| std::array::from_fn(|j| hsum8(acc[r][j])))
    }
}
