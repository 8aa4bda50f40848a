//! Vectorised `exp`, SwiGLU, GeGLU and softmax, bitwise equal on every ISA.
//!
//! libm's `expf` is one call per element and cannot be vectorised, and a
//! batched decode step spends a few percent of its time in it (SwiGLU over
//! the FFN width, softmax over every context position). [`exp`] is our own
//! function, defined by its scalar body: Cephes-style range reduction
//! `x = n ln2 + r` (round to nearest even, `ln2` split in two, FMAs), a
//! degree-7 polynomial in FMAs, and `2^n` applied as two exact power-of-two
//! factors. The AVX2 and AVX-512 bodies perform the same IEEE operations
//! lane by lane, so every ISA returns the same bits; the error against the
//! true exponential is at most 2 ulp (tested), about what libm's is.
//!
//! Domain: `x > 88.72283` gives `+inf`, `x < -87.33654` (results below
//! `f32::MIN_POSITIVE`) gives `0`, NaN stays NaN.

use crate::cpu::{self, Isa};

const LOG2E: f32 = std::f32::consts::LOG2_E;
/// `ln 2 = LN2_HI + LN2_LO`, `LN2_HI` exact in 9 bits so `n * LN2_HI` is exact.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Above: `+inf` (`ln(f32::MAX)`).
const HI: f32 = 88.722_83;
/// Below: `0` (`ln(f32::MIN_POSITIVE)`).
const LO: f32 = -87.336_54;
/// Cephes `expf` coefficients: `e^r ~ 1 + r + r^2 (P0 + P1 r + ...)`.
const P: [f32; 6] = [
    0.5,
    1.666_666_5e-1,
    4.166_579_6e-2,
    8.333_452e-3,
    1.398_2e-3,
    1.987_569_1e-4,
];

/// `e^x` (see the module docs for accuracy and domain).
pub fn exp(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x > HI {
        return f32::INFINITY;
    }
    if x < LO {
        return 0.0;
    }
    let n = (x * LOG2E).round_ties_even();
    let r = n.mul_add(-LN2_HI, x);
    let r = n.mul_add(-LN2_LO, r);
    let mut p = P[5];
    for &c in P[..5].iter().rev() {
        p = p.mul_add(r, c);
    }
    let y = p.mul_add(r * r, r) + 1.0;
    // n is in [-126, 128]: two factors keep each power of two normal.
    let n = n as i32;
    let h = n >> 1;
    y * pow2(h) * pow2(n - h)
}

/// `2^k` for `k` in `[-126, 127]`.
fn pow2(k: i32) -> f32 {
    f32::from_bits(((k + 127) as u32) << 23)
}

/// `silu(g) = g / (1 + e^-g)`.
fn silu(g: f32) -> f32 {
    g / (1.0 + exp(-g))
}

/// `2 sqrt(2 / pi)` and the cubic coefficient of the tanh form of GELU
/// (public so that other backends compute the same `z`).
pub const GELU_K2: f32 = 1.595_769_2;
pub const GELU_C: f32 = 0.044_715;

/// GELU's tanh form, `0.5 g (1 + tanh(u))` with `u = sqrt(2/pi) (g + C g^3)`,
/// computed as the equal `g / (1 + e^-2u)`: one [`exp`] instead of libm's
/// `tanhf` (which costs an `expm1f` call per element).
fn gelu(g: f32) -> f32 {
    let z = (GELU_K2 * g) * (1.0 + GELU_C * (g * g));
    g / (1.0 + exp(-z))
}

/// `gate[i] = gelu(gate[i]) * up[i]` (GeGLU, tanh GELU), in place, on this
/// CPU's best ISA; bitwise the same on every ISA.
///
/// # Panics
/// If the lengths differ (callers size both from one shape).
pub fn gelu_mul(gate: &mut [f32], up: &[f32]) {
    gelu_mul_with_isa(cpu::isa(), gate, up);
}

/// [`gelu_mul`] with an explicit instruction set (tests compare them).
pub fn gelu_mul_with_isa(isa: Isa, gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "gelu_mul: gate and up lengths differ");
    let done = match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: support checked by `is_supported`.
        Isa::Avx512Vnni if isa.is_supported() => unsafe { avx512::gelu_mul(gate, up) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 | Isa::Avx512Vnni if Isa::Avx2.is_supported() => unsafe {
            avx2::gelu_mul(gate, up)
        },
        _ => 0,
    };
    for (g, &u) in gate[done..].iter_mut().zip(&up[done..]) {
        *g = gelu(*g) * u;
    }
}

/// `gate[i] = silu(gate[i]) * up[i]` (SwiGLU), in place, on this CPU's best ISA.
///
/// # Panics
/// If the lengths differ (callers size both from one shape).
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    silu_mul_with_isa(cpu::isa(), gate, up);
}

/// [`silu_mul`] with an explicit instruction set (tests compare them).
pub fn silu_mul_with_isa(isa: Isa, gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "silu_mul: gate and up lengths differ");
    let done = match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: support checked by `is_supported`.
        Isa::Avx512Vnni if isa.is_supported() => unsafe { avx512::silu_mul(gate, up) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 | Isa::Avx512Vnni if Isa::Avx2.is_supported() => unsafe {
            avx2::silu_mul(gate, up)
        },
        _ => 0,
    };
    for (g, &u) in gate[done..].iter_mut().zip(&up[done..]) {
        *g = silu(*g) * u;
    }
}

/// The largest value, ignoring NaNs (`-inf` when there is none). Any
/// order of comparison finds the same value, so 16 lanes do (vectorised).
pub fn max(x: &[f32]) -> f32 {
    let mut m16 = [f32::NEG_INFINITY; 16];
    let (chunks, tail) = x.as_chunks::<16>();
    for c in chunks {
        for (m, &v) in m16.iter_mut().zip(c) {
            *m = if v > *m { v } else { *m };
        }
    }
    m16.iter()
        .chain(tail)
        .fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a })
}

/// In-place softmax: subtract the max, `exp`, divide by the sum, which is
/// accumulated in `f64` in 8 partial sums (element `i` into lane `i % 8`,
/// the lanes then added pairwise) so that every ISA adds the same numbers
/// in the same order. Empty input and all `-inf` input are left unchanged.
pub fn softmax(x: &mut [f32]) {
    softmax_with_isa(cpu::isa(), x);
}

/// [`softmax`] with an explicit instruction set (tests compare them).
pub fn softmax_with_isa(isa: Isa, x: &mut [f32]) {
    // NaN inputs give NaN outputs on every path, whichever max they see.
    let max = max(x);
    if max == f32::NEG_INFINITY {
        return;
    }
    let mut lanes = [0.0f64; 8];
    let done = match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: support checked by `is_supported`.
        Isa::Avx512Vnni if isa.is_supported() => unsafe { avx512::exp_sum(x, max, &mut lanes) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 | Isa::Avx512Vnni if Isa::Avx2.is_supported() => unsafe {
            avx2::exp_sum(x, max, &mut lanes)
        },
        _ => 0,
    };
    for (i, v) in x.iter_mut().enumerate().skip(done) {
        *v = exp(*v - max);
        lanes[i % 8] += f64::from(*v);
    }
    let sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3]))
        + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    let inv = (1.0 / sum) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// Rounds every value to the nearest `f16` (ties to even) and back, as
/// `half::f16::from_f32(v).to_f32()` does, 8 at a time with F16C.
pub fn round_through_f16(x: &mut [f32]) {
    let done = if Isa::Avx2.is_supported() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 (which implies F16C here, see `cpu::detect`) checked.
        unsafe {
            avx2::round_through_f16(x)
        }
        #[cfg(not(target_arch = "x86_64"))]
        0
    } else {
        0
    };
    for v in &mut x[done..] {
        *v = half::f16::from_f32(*v).to_f32();
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{GELU_C, GELU_K2, HI, LN2_HI, LN2_LO, LO, LOG2E, P};

    /// Eight lanes of [`super::exp`], the same operations.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn exp8(x: __m256) -> __m256 {
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
        );
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), x);
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
        let mut p = _mm256_set1_ps(P[5]);
        for &c in P[..5].iter().rev() {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let y = _mm256_add_ps(
            _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r),
            _mm256_set1_ps(1.0),
        );
        let n = _mm256_cvtps_epi32(n);
        let h = _mm256_srai_epi32::<1>(n);
        let pow2 = |k: __m256i| {
            _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
                k,
                _mm256_set1_epi32(127),
            )))
        };
        let y = _mm256_mul_ps(_mm256_mul_ps(y, pow2(h)), pow2(_mm256_sub_epi32(n, h)));
        // Out-of-range lanes computed garbage above; replace them.
        let y = _mm256_blendv_ps(
            y,
            _mm256_setzero_ps(),
            _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(LO)),
        );
        let y = _mm256_blendv_ps(
            y,
            _mm256_set1_ps(f32::INFINITY),
            _mm256_cmp_ps::<_CMP_GT_OQ>(x, _mm256_set1_ps(HI)),
        );
        _mm256_blendv_ps(y, x, _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x))
    }

    /// [`super::round_through_f16`] over whole 8-lane chunks; returns how
    /// many were done.
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn round_through_f16(x: &mut [f32]) -> usize {
        let n = x.len() / 8 * 8;
        for i in (0..n).step_by(8) {
            // SAFETY: i + 8 <= n <= x.len().
            unsafe {
                let h = _mm256_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT }>(_mm256_loadu_ps(
                    x.as_ptr().add(i),
                ));
                _mm256_storeu_ps(x.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
            }
        }
        n
    }

    /// SwiGLU over the whole 8-lane chunks; returns how many were done.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; `up.len() >= gate.len()`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn silu_mul(gate: &mut [f32], up: &[f32]) -> usize {
        let n = gate.len() / 8 * 8;
        let one = _mm256_set1_ps(1.0);
        for i in (0..n).step_by(8) {
            // SAFETY: i + 8 <= n <= both lengths.
            unsafe {
                let g = _mm256_loadu_ps(gate.as_ptr().add(i));
                let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
                let s = _mm256_div_ps(g, _mm256_add_ps(one, e));
                let u = _mm256_loadu_ps(up.as_ptr().add(i));
                _mm256_storeu_ps(gate.as_mut_ptr().add(i), _mm256_mul_ps(s, u));
            }
        }
        n
    }

    /// GeGLU over the whole 8-lane chunks, the scalar `gelu`'s operations
    /// lane by lane (no fused multiply-adds); returns how many were done.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; `up.len() >= gate.len()`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn gelu_mul(gate: &mut [f32], up: &[f32]) -> usize {
        let n = gate.len() / 8 * 8;
        let one = _mm256_set1_ps(1.0);
        let (k2, c) = (_mm256_set1_ps(GELU_K2), _mm256_set1_ps(GELU_C));
        for i in (0..n).step_by(8) {
            // SAFETY: i + 8 <= n <= both lengths.
            unsafe {
                let g = _mm256_loadu_ps(gate.as_ptr().add(i));
                let cubic = _mm256_add_ps(one, _mm256_mul_ps(c, _mm256_mul_ps(g, g)));
                let z = _mm256_mul_ps(_mm256_mul_ps(k2, g), cubic);
                let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), z));
                let s = _mm256_div_ps(g, _mm256_add_ps(one, e));
                let u = _mm256_loadu_ps(up.as_ptr().add(i));
                _mm256_storeu_ps(gate.as_mut_ptr().add(i), _mm256_mul_ps(s, u));
            }
        }
        n
    }

    /// `x[i] = exp(x[i] - max)` over whole 8-lane chunks, each value added
    /// in `f64` to lane `i % 8`; returns how many were done.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_sum(x: &mut [f32], max: f32, lanes: &mut [f64; 8]) -> usize {
        let n = x.len() / 8 * 8;
        let m = _mm256_set1_ps(max);
        // SAFETY: `lanes` holds 8 doubles.
        let (mut lo, mut hi) = unsafe {
            (
                _mm256_loadu_pd(lanes.as_ptr()),
                _mm256_loadu_pd(lanes.as_ptr().add(4)),
            )
        };
        for i in (0..n).step_by(8) {
            // SAFETY: i + 8 <= n <= x.len().
            unsafe {
                let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x.as_ptr().add(i)), m));
                _mm256_storeu_ps(x.as_mut_ptr().add(i), e);
                lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
                hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(e)));
            }
        }
        // SAFETY: as above.
        unsafe {
            _mm256_storeu_pd(lanes.as_mut_ptr(), lo);
            _mm256_storeu_pd(lanes.as_mut_ptr().add(4), hi);
        }
        n
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{GELU_C, GELU_K2, HI, LN2_HI, LN2_LO, LO, LOG2E, P};

    /// Sixteen lanes of [`super::exp`], the same operations.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn exp16(x: __m512) -> __m512 {
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
        );
        let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_HI), x);
        let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_LO), r);
        let mut p = _mm512_set1_ps(P[5]);
        for &c in P[..5].iter().rev() {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        let y = _mm512_add_ps(
            _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r),
            _mm512_set1_ps(1.0),
        );
        let n = _mm512_cvtps_epi32(n);
        let h = _mm512_srai_epi32::<1>(n);
        let pow2 = |k: __m512i| {
            _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(
                k,
                _mm512_set1_epi32(127),
            )))
        };
        let y = _mm512_mul_ps(_mm512_mul_ps(y, pow2(h)), pow2(_mm512_sub_epi32(n, h)));
        let y = _mm512_mask_mov_ps(
            y,
            _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(LO)),
            _mm512_setzero_ps(),
        );
        let y = _mm512_mask_mov_ps(
            y,
            _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, _mm512_set1_ps(HI)),
            _mm512_set1_ps(f32::INFINITY),
        );
        _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x), x)
    }

    /// As `avx2::gelu_mul`, 16 lanes at a time.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F; `up.len() >= gate.len()`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn gelu_mul(gate: &mut [f32], up: &[f32]) -> usize {
        let n = gate.len() / 16 * 16;
        let one = _mm512_set1_ps(1.0);
        let (k2, c) = (_mm512_set1_ps(GELU_K2), _mm512_set1_ps(GELU_C));
        for i in (0..n).step_by(16) {
            // SAFETY: i + 16 <= n <= both lengths.
            unsafe {
                let g = _mm512_loadu_ps(gate.as_ptr().add(i));
                let cubic = _mm512_add_ps(one, _mm512_mul_ps(c, _mm512_mul_ps(g, g)));
                let z = _mm512_mul_ps(_mm512_mul_ps(k2, g), cubic);
                let e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), z));
                let s = _mm512_div_ps(g, _mm512_add_ps(one, e));
                let u = _mm512_loadu_ps(up.as_ptr().add(i));
                _mm512_storeu_ps(gate.as_mut_ptr().add(i), _mm512_mul_ps(s, u));
            }
        }
        n
    }

    /// As `avx2::silu_mul`, 16 lanes at a time.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F; `up.len() >= gate.len()`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn silu_mul(gate: &mut [f32], up: &[f32]) -> usize {
        let n = gate.len() / 16 * 16;
        let one = _mm512_set1_ps(1.0);
        for i in (0..n).step_by(16) {
            // SAFETY: i + 16 <= n <= both lengths.
            unsafe {
                let g = _mm512_loadu_ps(gate.as_ptr().add(i));
                let e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
                let s = _mm512_div_ps(g, _mm512_add_ps(one, e));
                let u = _mm512_loadu_ps(up.as_ptr().add(i));
                _mm512_storeu_ps(gate.as_mut_ptr().add(i), _mm512_mul_ps(s, u));
            }
        }
        n
    }

    /// As `avx2::exp_sum`, 16 lanes at a time (lanes `i % 8` line up
    /// because each chunk starts at a multiple of 16), the tail under a
    /// mask (its missing lanes add `+0.0`, which changes no sum), so all of
    /// `x` is done.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn exp_sum(x: &mut [f32], max: f32, lanes: &mut [f64; 8]) -> usize {
        let m = _mm512_set1_ps(max);
        // SAFETY: `lanes` holds 8 doubles.
        let mut acc = unsafe { _mm512_loadu_pd(lanes.as_ptr()) };
        for i in (0..x.len()).step_by(16) {
            let k: __mmask16 = if x.len() - i >= 16 {
                0xFFFF
            } else {
                (1u16 << (x.len() - i)) - 1
            };
            // SAFETY: the mask covers only elements i..x.len().
            unsafe {
                let v = _mm512_maskz_loadu_ps(k, x.as_ptr().add(i));
                let e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(v, m)));
                _mm512_mask_storeu_ps(x.as_mut_ptr().add(i), k, e);
                // Elements i..i+8 then i+8..i+16: lane order kept.
                acc = _mm512_add_pd(acc, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
                acc = _mm512_add_pd(
                    acc,
                    _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
                        _mm512_castps_pd(e),
                    ))),
                );
            }
        }
        // SAFETY: as above.
        unsafe { _mm512_storeu_pd(lanes.as_mut_ptr(), acc) };
        x.len()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::cpu::IsaCoverage;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn ulps(a: f32, b: f64) -> f64 {
        let b32 = b as f32;
        let ulp = (f32::from_bits(b32.abs().to_bits() + 1) - b32.abs()) as f64;
        (f64::from(a) - b).abs() / ulp
    }

    #[test]
    fn exp_is_within_two_ulp_of_the_true_exponential() {
        let mut worst = 0.0f64;
        let n = 2_000_000;
        for i in 0..=n {
            let x = LO + (HI - LO) * i as f32 / n as f32;
            let want = f64::from(x).exp();
            if want < f64::from(f32::MIN_POSITIVE) || want > f64::from(f32::MAX) {
                continue;
            }
            worst = worst.max(ulps(exp(x), want));
        }
        assert!(worst <= 2.0, "worst error {worst} ulp");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-0.0), 1.0);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert!(exp(f32::NAN).is_nan());
    }

    /// Inputs that exercise every branch: random, the domain edges, specials.
    fn inputs(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
        let special = [
            0.0,
            -0.0,
            HI,
            LO,
            HI + 1e-3,
            LO - 1e-3,
            f32::INFINITY,
            f32::NEG_INFINITY,
            88.0,
            -87.0,
            -90.0,
            1e-30,
        ];
        (0..n)
            .map(|i| {
                if i % 7 == 3 {
                    special[i % special.len()]
                } else {
                    rng.random_range(-30.0f32..30.0)
                }
            })
            .collect()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn silu_mul_is_bitwise_the_scalar_reference_on_every_isa() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let mut cov =
            IsaCoverage::new("vmath::silu_mul_is_bitwise_the_scalar_reference_on_every_isa");
        for len in [0, 1, 7, 8, 15, 16, 17, 33, 1536] {
            let g = inputs(&mut rng, len);
            let u: Vec<f32> = (0..len).map(|_| rng.random_range(-2.0f32..2.0)).collect();
            let mut want = g.clone();
            silu_mul_with_isa(Isa::Scalar, &mut want, &u);
            for (w, (&gi, &ui)) in want.iter().zip(g.iter().zip(&u)) {
                assert_eq!(w.to_bits(), (silu(gi) * ui).to_bits());
            }
            for isa in cov.isas() {
                let mut got = g.clone();
                silu_mul_with_isa(isa, &mut got, &u);
                assert_eq!(bits(&got), bits(&want), "{isa} len {len}");
                cov.ran(isa);
            }
        }
        let mut nan = [f32::NAN; 19];
        silu_mul(&mut nan, &[1.0; 19]);
        assert!(nan.iter().all(|v| v.is_nan()));
    }

    #[test]
    fn gelu_mul_is_bitwise_the_scalar_reference_on_every_isa() {
        let mut rng = ChaCha8Rng::seed_from_u64(6);
        let mut cov =
            IsaCoverage::new("vmath::gelu_mul_is_bitwise_the_scalar_reference_on_every_isa");
        for len in [0, 1, 7, 8, 15, 16, 17, 33, 2048] {
            let g = inputs(&mut rng, len);
            let u: Vec<f32> = (0..len).map(|_| rng.random_range(-2.0f32..2.0)).collect();
            let mut want = g.clone();
            gelu_mul_with_isa(Isa::Scalar, &mut want, &u);
            for (w, (&gi, &ui)) in want.iter().zip(g.iter().zip(&u)) {
                assert_eq!(w.to_bits(), (gelu(gi) * ui).to_bits());
            }
            for isa in cov.isas() {
                let mut got = g.clone();
                gelu_mul_with_isa(isa, &mut got, &u);
                assert_eq!(bits(&got), bits(&want), "{isa} len {len}");
                cov.ran(isa);
            }
        }
    }

    #[test]
    fn gelu_is_close_to_the_tanh_definition() {
        for i in -3000..3000 {
            let g = i as f32 * 0.01;
            let want = 0.5 * g * (1.0 + (0.797_884_6 * (g + 0.044_715 * g * g * g)).tanh());
            assert!(
                (gelu(g) - want).abs() <= 4e-7 * (1.0 + want.abs()),
                "{g}: {} vs {want}",
                gelu(g)
            );
        }
        // The tails: 0 far left (not NaN), the identity far right.
        assert_eq!(gelu(-100.0), 0.0);
        assert_eq!(gelu(100.0), 100.0);
    }

    #[test]
    fn silu_is_close_to_the_libm_definition() {
        for i in -2000..2000 {
            let g = i as f32 * 0.01;
            let want = g / (1.0 + (-g).exp());
            assert!((silu(g) - want).abs() <= 2e-7 * (1.0 + want.abs()), "{g}");
        }
    }

    #[test]
    fn f16_rounding_matches_the_half_crate() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        for len in [0, 1, 7, 8, 9, 31, 200] {
            let mut x = inputs(&mut rng, len);
            for (i, v) in x.iter_mut().enumerate() {
                // Probabilities, f16 subnormals, halfway cases, overflow.
                match i % 5 {
                    0 => *v = rng.random_range(0.0f32..1.0),
                    1 => *v = rng.random_range(0.0f32..1e-5),
                    2 => *v = 1.0 + (2 * (i % 4) + 1) as f32 * 2f32.powi(-11),
                    _ => {}
                }
            }
            let want: Vec<f32> = x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect();
            round_through_f16(&mut x);
            assert_eq!(bits(&x), bits(&want), "len {len}");
        }
    }

    #[test]
    fn softmax_is_bitwise_the_scalar_reference_on_every_isa() {
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        let mut cov =
            IsaCoverage::new("vmath::softmax_is_bitwise_the_scalar_reference_on_every_isa");
        for len in [0, 1, 5, 8, 9, 16, 23, 64, 193, 1000] {
            let mut x: Vec<f32> = (0..len).map(|_| rng.random_range(-20.0f32..5.0)).collect();
            if len > 4 {
                x[len / 2] = f32::NEG_INFINITY;
            }
            let mut want = x.clone();
            softmax_with_isa(Isa::Scalar, &mut want);
            if len > 0 {
                let s: f64 = want.iter().map(|&v| f64::from(v)).sum();
                assert!((s - 1.0).abs() < 1e-5, "sum {s}");
                // Close to a float64 softmax.
                let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let z: f64 = x.iter().map(|&v| f64::from(v - m).exp()).sum();
                for (&w, &v) in want.iter().zip(&x) {
                    let p = f64::from(v - m).exp() / z;
                    assert!((f64::from(w) - p).abs() <= 1e-6 * p + 1e-30, "{w} vs {p}");
                }
            }
            for isa in cov.isas() {
                let mut got = x.clone();
                softmax_with_isa(isa, &mut got);
                assert_eq!(bits(&got), bits(&want), "{isa} len {len}");
                cov.ran(isa);
            }
        }
        let mut masked = [f32::NEG_INFINITY; 9];
        softmax(&mut masked);
        assert!(masked.iter().all(|&v| v == f32::NEG_INFINITY));
    }
}
