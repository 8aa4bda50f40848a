//! ggml/GGUF tensor types: block layouts, reference dequantisation and the
//! activation quantisers used by the matmul kernels.
//!
//! Block layouts (little endian, no padding), bit-compatible with ggml:
//!
//! | type | elems | bytes | layout |
//! |------|-------|-------|--------|
//! | Q4_0 | 32  | 18  | `f16 d; u8 qs[16]` — x = (nib - 8) * d, low nibbles are elements 0..16 |
//! | Q4_1 | 32  | 20  | `f16 d; f16 m; u8 qs[16]` — x = nib * d + m |
//! | Q5_0 | 32  | 22  | `f16 d; u8 qh[4]; u8 qs[16]` — x = ((nib \| bit << 4) - 16) * d, bit j of qh (LE u32) is element j's |
//! | Q8_0 | 32  | 34  | `f16 d; i8 qs[32]` |
//! | Q8_1 | 32  | 36  | `f16 d; f16 s; i8 qs[32]` — s = d * sum(qs) |
//! | Q4_K | 256 | 144 | `f16 d; f16 dmin; u8 scales[12]; u8 qs[128]` |
//! | Q6_K | 256 | 210 | `u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d` |
//! | Q8_K | 256 | 292 | `f32 d; i8 qs[256]; i16 bsums[16]` |

use half::f16;

use crate::error::KernelError;

pub use crate::types::{GgmlType, QK, QK_K};

/// `ty.row_bytes(n)`, reporting why it failed.
pub(crate) fn row_bytes_checked(ty: GgmlType, n: usize) -> Result<usize, KernelError> {
    if !n.is_multiple_of(ty.block_len()) {
        return Err(KernelError::NotBlockAligned {
            ty,
            n,
            block_len: ty.block_len(),
        });
    }
    ty.row_bytes(n).ok_or(KernelError::Overflow("row bytes"))
}

// ---------------------------------------------------------------------------
// Scalar conversions (bit-exact with ggml).

#[inline]
pub(crate) fn f16_le(b: &[u8], off: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[off], b[off + 1]])).to_f32()
}

#[inline]
pub(crate) fn f32_le(b: &[u8], off: usize) -> f32 {
    f32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

/// f32 -> f16 bits, round to nearest even (as F16C `vcvtps2ph` with imm 0).
#[inline]
pub fn f32_to_f16_bits(x: f32) -> u16 {
    f16::from_f32(x).to_bits()
}

/// f16 bits -> f32 (exact).
#[inline]
pub fn f16_bits_to_f32(h: u16) -> f32 {
    f16::from_bits(h).to_f32()
}

/// f32 -> bf16 bits exactly as ggml's `GGML_FP32_TO_BF16` (round to nearest
/// even, NaN forced quiet).
#[inline]
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    let u = x.to_bits();
    if (u & 0x7fff_ffff) > 0x7f80_0000 {
        return ((u >> 16) | 64) as u16;
    }
    (u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

/// bf16 bits -> f32 (exact).
#[inline]
pub fn bf16_bits_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// The 6-bit scale and min of sub-block `j` (0..8) of a Q4_K/Q5_K block.
#[inline]
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

// ---------------------------------------------------------------------------
// Dequantisation (scalar reference).

fn check_row(ty: GgmlType, src: &[u8], n: usize) -> Result<(), KernelError> {
    let expected = row_bytes_checked(ty, n)?;
    if src.len() != expected {
        return Err(KernelError::LengthMismatch {
            what: "dequantize_row src bytes",
            expected,
            actual: src.len(),
        });
    }
    Ok(())
}

/// Scalar-reference dequantisation of `dst.len()` elements from `src`, which
/// must be exactly `ty.row_bytes(dst.len())` bytes.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), KernelError> {
    check_row(ty, src, dst.len())?;
    let bs = ty.block_bytes();
    let bl = ty.block_len();
    for (b, y) in src.chunks_exact(bs).zip(dst.chunks_exact_mut(bl)) {
        match ty {
            GgmlType::F32 => y[0] = f32_le(b, 0),
            GgmlType::F16 => y[0] = f16_le(b, 0),
            GgmlType::BF16 => y[0] = bf16_bits_to_f32(u16::from_le_bytes([b[0], b[1]])),
            GgmlType::Q4_0 => {
                let d = f16_le(b, 0);
                for j in 0..16 {
                    let q = b[2 + j];
                    y[j] = ((q & 0xF) as i32 - 8) as f32 * d;
                    y[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
                }
            }
            GgmlType::Q5_0 => {
                let d = f16_le(b, 0);
                let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                for j in 0..16 {
                    let q = b[6 + j];
                    let h0 = ((qh >> j) & 1) as u8;
                    let h1 = ((qh >> (j + 16)) & 1) as u8;
                    y[j] = (((q & 0xF) | (h0 << 4)) as i32 - 16) as f32 * d;
                    y[j + 16] = (((q >> 4) | (h1 << 4)) as i32 - 16) as f32 * d;
                }
            }
            GgmlType::Q4_1 => {
                let d = f16_le(b, 0);
                let m = f16_le(b, 2);
                for j in 0..16 {
                    let q = b[4 + j];
                    y[j] = (q & 0xF) as f32 * d + m;
                    y[j + 16] = (q >> 4) as f32 * d + m;
                }
            }
            GgmlType::Q8_0 => {
                let d = f16_le(b, 0);
                for j in 0..32 {
                    y[j] = b[2 + j] as i8 as f32 * d;
                }
            }
            GgmlType::Q8_1 => {
                let d = f16_le(b, 0);
                for j in 0..32 {
                    y[j] = b[4 + j] as i8 as f32 * d;
                }
            }
            GgmlType::Q4_K => {
                let d = f16_le(b, 0);
                let dmin = f16_le(b, 2);
                let scales = &b[4..16];
                let qs = &b[16..144];
                for j in 0..4 {
                    let (sc1, m1) = scale_min_k4(2 * j, scales);
                    let (sc2, m2) = scale_min_k4(2 * j + 1, scales);
                    let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
                    let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
                    let q = &qs[32 * j..32 * j + 32];
                    for l in 0..32 {
                        y[64 * j + l] = d1 * (q[l] & 0xF) as f32 - m1;
                        y[64 * j + 32 + l] = d2 * (q[l] >> 4) as f32 - m2;
                    }
                }
            }
            GgmlType::Q6_K => {
                let ql = &b[0..128];
                let qh = &b[128..192];
                let sc = &b[192..208];
                let d = f16_le(b, 208);
                for h in 0..2 {
                    let ql = &ql[64 * h..];
                    let qh = &qh[32 * h..];
                    let sc = &sc[8 * h..];
                    let y = &mut y[128 * h..];
                    for l in 0..32 {
                        let is = l / 16;
                        let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                        let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                        let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                        let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                        y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                        y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                        y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                        y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                    }
                }
            }
            GgmlType::Q8_K => {
                let d = f32_le(b, 0);
                for j in 0..QK_K {
                    y[j] = b[4 + j] as i8 as f32 * d;
                }
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Quantisation.

/// Max |x| over a block, with `maxps` semantics (a NaN operand yields the
/// other operand, as in ggml's `_mm256_max_ps(maxAbs, |v|)` chain).
#[inline(always)]
fn block_amax(x: &[f32]) -> f32 {
    x.iter()
        .fold(0.0f32, |m, v| if v.abs() > m { v.abs() } else { m })
}

/// Q8_0 activation quantisation of one 32-element block exactly as ggml-cpu's
/// x86 `quantize_row_q8_0` (AVX2 path): d = amax/127 stored as f16,
/// q = round_half_even(x * (127/amax)), saturated to i8.
/// Returns (d as stored f16 bits, sum of the quants as i32, d as f32 unrounded).
#[inline(always)]
pub(crate) fn quantize_block_q8(x: &[f32], qs: &mut [i8]) -> (u16, i32, f32) {
    let amax = block_amax(x);
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    let mut sum = 0i32;
    for (q, &v) in qs.iter_mut().zip(x) {
        let r = (v * id).round_ties_even();
        // cvtps2dq: out-of-range and NaN give i32::MIN; then packs saturate.
        let i = if r.is_nan() || !(-2147483648.0..2147483648.0).contains(&r) {
            i32::MIN
        } else {
            r as i32
        };
        sum = sum.wrapping_add(i);
        *q = i.clamp(-128, 127) as i8;
    }
    (f32_to_f16_bits(d), sum, d)
}

/// Q8_K quantisation of one 256-element block exactly as ggml's
/// `quantize_row_q8_K_ref` (the x86 build uses the reference).
/// Returns d; fills `qs` and `bsums`.
#[inline(always)]
pub(crate) fn quantize_block_q8_k(x: &[f32], qs: &mut [i8], bsums: &mut [i16]) -> f32 {
    let mut max = 0.0f32;
    let mut amax = 0.0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax == 0.0 {
        qs.fill(0);
        bsums.fill(0);
        return 0.0;
    }
    let iscale = -127.0 / max;
    for (q, &v) in qs.iter_mut().zip(x) {
        // ggml's nearest_int: round half to even.
        let r = (iscale * v).round_ties_even();
        *q = (r as i32).min(127) as i8;
    }
    for (j, s) in bsums.iter_mut().enumerate() {
        *s = qs[16 * j..16 * j + 16].iter().map(|&q| q as i16).sum();
    }
    1.0 / iscale
}

/// The value of largest magnitude, with its sign (the first of equal
/// magnitudes): ggml's Q4_0 / Q5_0 quantisers scale by it.
fn signed_absmax(x: &[f32]) -> f32 {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}

/// Quantise a row of f32 into `ty`, writing exactly `ty.row_bytes(src.len())`
/// bytes. Supported: F32, F16, BF16 (round to nearest even), Q8_0 / Q8_1 (as
/// ggml-cpu quantises activations on x86), Q8_K (`quantize_row_q8_K_ref`),
/// Q4_0 / Q4_1 / Q5_0 (`quantize_row_q4_0_ref` / `quantize_row_q4_1_ref` /
/// `quantize_row_q5_0_ref`).
pub fn quantize_row(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<(), KernelError> {
    let expected = row_bytes_checked(ty, src.len())?;
    if dst.len() != expected {
        return Err(KernelError::LengthMismatch {
            what: "quantize_row dst bytes",
            expected,
            actual: dst.len(),
        });
    }
    let bs = ty.block_bytes();
    let bl = ty.block_len();
    for (x, b) in src.chunks_exact(bl).zip(dst.chunks_exact_mut(bs)) {
        match ty {
            GgmlType::F32 => b.copy_from_slice(&x[0].to_le_bytes()),
            GgmlType::F16 => b.copy_from_slice(&f32_to_f16_bits(x[0]).to_le_bytes()),
            GgmlType::BF16 => b.copy_from_slice(&f32_to_bf16_bits(x[0]).to_le_bytes()),
            GgmlType::Q8_0 => {
                let mut qs = [0i8; QK];
                let (d, _, _) = quantize_block_q8(x, &mut qs);
                b[0..2].copy_from_slice(&d.to_le_bytes());
                for (o, q) in b[2..].iter_mut().zip(qs) {
                    *o = q as u8;
                }
            }
            GgmlType::Q8_1 => {
                let mut qs = [0i8; QK];
                let (d, sum, df) = quantize_block_q8(x, &mut qs);
                b[0..2].copy_from_slice(&d.to_le_bytes());
                b[2..4].copy_from_slice(&f32_to_f16_bits(df * sum as f32).to_le_bytes());
                for (o, q) in b[4..].iter_mut().zip(qs) {
                    *o = q as u8;
                }
            }
            GgmlType::Q8_K => {
                let mut qs = [0i8; QK_K];
                let mut bsums = [0i16; 16];
                let d = quantize_block_q8_k(x, &mut qs, &mut bsums);
                b[0..4].copy_from_slice(&d.to_le_bytes());
                for (o, q) in b[4..260].iter_mut().zip(qs) {
                    *o = q as u8;
                }
                for (j, s) in bsums.iter().enumerate() {
                    b[260 + 2 * j..262 + 2 * j].copy_from_slice(&s.to_le_bytes());
                }
            }
            GgmlType::Q4_0 => {
                let d = signed_absmax(x) / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                b[0..2].copy_from_slice(&f32_to_f16_bits(d).to_le_bytes());
                for j in 0..16 {
                    let x0 = x[j] * id;
                    let x1 = x[16 + j] * id;
                    let q0 = ((x0 + 8.5) as i8).min(15) as u8;
                    let q1 = ((x1 + 8.5) as i8).min(15) as u8;
                    b[2 + j] = q0 | (q1 << 4);
                }
            }
            GgmlType::Q5_0 => {
                let d = signed_absmax(x) / -16.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                b[0..2].copy_from_slice(&f32_to_f16_bits(d).to_le_bytes());
                let mut qh = 0u32;
                for j in 0..16 {
                    let x0 = x[j] * id;
                    let x1 = x[16 + j] * id;
                    // C's (int8_t) cast truncates; in range here, as in ggml.
                    let q0 = ((x0 + 16.5) as i8).min(31) as u8;
                    let q1 = ((x1 + 16.5) as i8).min(31) as u8;
                    b[6 + j] = (q0 & 0xF) | ((q1 & 0xF) << 4);
                    qh |= u32::from(q0 >> 4) << j;
                    qh |= u32::from(q1 >> 4) << (j + 16);
                }
                b[2..6].copy_from_slice(&qh.to_le_bytes());
            }
            GgmlType::Q4_1 => {
                let mut min = f32::MAX;
                let mut max = f32::MIN;
                for &v in x {
                    if v < min {
                        min = v;
                    }
                    if v > max {
                        max = v;
                    }
                }
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                b[0..2].copy_from_slice(&f32_to_f16_bits(d).to_le_bytes());
                b[2..4].copy_from_slice(&f32_to_f16_bits(min).to_le_bytes());
                for j in 0..16 {
                    let x0 = (x[j] - min) * id;
                    let x1 = (x[16 + j] - min) * id;
                    let q0 = ((x0 + 0.5) as i8).min(15) as u8;
                    let q1 = ((x1 + 0.5) as i8).min(15) as u8;
                    b[4 + j] = q0 | (q1 << 4);
                }
            }
            GgmlType::Q4_K | GgmlType::Q6_K => {
                return Err(KernelError::UnsupportedType {
                    op: "quantize_row",
                    ty,
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_sizes() {
        for ty in GgmlType::ALL {
            assert_eq!(GgmlType::from_ggml_id(ty.ggml_id()), Some(ty));
            assert_eq!(ty.row_bytes(ty.block_len() * 3), Some(ty.block_bytes() * 3));
            assert_eq!(ty.to_string(), ty.name());
        }
        assert_eq!(GgmlType::from_ggml_id(7), None);
        assert_eq!(GgmlType::Q4_1.row_bytes(33), None);
        assert_eq!(GgmlType::F32.row_bytes(usize::MAX / 2), None);
        assert_eq!(GgmlType::Q4_K.row_bytes(100), None);
        assert_eq!(GgmlType::Q4_1.name(), "Q4_1");
        assert_eq!(GgmlType::from_ggml_id(6), Some(GgmlType::Q5_0));
        assert_eq!(GgmlType::Q5_0.name(), "Q5_0");
        assert_eq!(GgmlType::Q5_0.vec_dot_type(), GgmlType::Q8_0);
        assert_eq!(GgmlType::Q5_0.row_bytes(896), Some(28 * 22));
        let sizes = [
            (GgmlType::Q4_0, 18),
            (GgmlType::Q4_1, 20),
            (GgmlType::Q5_0, 22),
            (GgmlType::Q8_0, 34),
            (GgmlType::Q8_1, 36),
            (GgmlType::Q4_K, 144),
            (GgmlType::Q6_K, 210),
            (GgmlType::Q8_K, 292),
        ];
        for (t, s) in sizes {
            assert_eq!(t.block_bytes(), s);
        }
    }

    fn h(x: f32) -> [u8; 2] {
        f32_to_f16_bits(x).to_le_bytes()
    }

    fn deq(ty: GgmlType, src: &[u8], n: usize) -> Vec<f32> {
        let mut out = vec![0.0; n];
        dequantize_row(ty, src, &mut out).expect("valid block");
        out
    }

    #[test]
    fn dequant_plain_floats() {
        let v = [1.5f32, -2.25, 0.0, 65504.0];
        let mut b = Vec::new();
        for x in v {
            b.extend_from_slice(&x.to_le_bytes());
        }
        assert_eq!(deq(GgmlType::F32, &b, 4), v);
        let b: Vec<u8> = v.iter().flat_map(|&x| h(x)).collect();
        assert_eq!(deq(GgmlType::F16, &b, 4), v);
        let b: Vec<u8> = v[..3]
            .iter()
            .flat_map(|&x| f32_to_bf16_bits(x).to_le_bytes())
            .collect();
        assert_eq!(deq(GgmlType::BF16, &b, 3), &v[..3]);
        assert_eq!(f32_to_bf16_bits(1.0 + 1.0 / 256.0), 0x3f80); // tie -> even
        assert_eq!(f32_to_bf16_bits(1.0 + 3.0 / 256.0), 0x3f82);
    }

    #[test]
    fn dequant_q4_0_q4_1_q8() {
        // Q4_0: d = 0.5, qs[j] = lo j, hi 15-j.
        let mut b = h(0.5).to_vec();
        for j in 0..16u8 {
            b.push(j | ((15 - j) << 4));
        }
        let y = deq(GgmlType::Q4_0, &b, 32);
        for j in 0..16 {
            assert_eq!(y[j], (j as f32 - 8.0) * 0.5);
            assert_eq!(y[j + 16], (7.0 - j as f32) * 0.5);
        }
        // Q4_1: d = 0.25, m = -1.
        let mut b = h(0.25).to_vec();
        b.extend_from_slice(&h(-1.0));
        for j in 0..16u8 {
            b.push(j | ((15 - j) << 4));
        }
        let y = deq(GgmlType::Q4_1, &b, 32);
        for j in 0..16 {
            assert_eq!(y[j], j as f32 * 0.25 - 1.0);
            assert_eq!(y[j + 16], (15 - j) as f32 * 0.25 - 1.0);
        }
        // Q8_0 / Q8_1: d = 2.
        let mut b = h(2.0).to_vec();
        b.extend((0..32).map(|j| (j as i8 - 16) as u8));
        let y = deq(GgmlType::Q8_0, &b, 32);
        for (j, v) in y.iter().enumerate() {
            assert_eq!(*v, (j as f32 - 16.0) * 2.0);
        }
        let mut b1 = h(2.0).to_vec();
        b1.extend_from_slice(&h(123.0));
        b1.extend_from_slice(&b[2..]);
        assert_eq!(deq(GgmlType::Q8_1, &b1, 32), y);
        // Q8_K: d = 0.5 (f32).
        let mut b = 0.5f32.to_le_bytes().to_vec();
        b.extend((0..256).map(|j| (j as u8).wrapping_sub(128)));
        b.extend([0u8; 32]);
        let y = deq(GgmlType::Q8_K, &b, 256);
        for (j, v) in y.iter().enumerate() {
            assert_eq!(*v, ((j as u8).wrapping_sub(128) as i8) as f32 * 0.5);
        }
    }

    #[test]
    fn dequant_q5_0_known() {
        // d = 0.5; qs[j] = lo j, hi 15-j; qh = 0xA5C3_0F81: bit e is the
        // fifth bit of element e.
        let qh: u32 = 0xA5C3_0F81;
        let mut b = h(0.5).to_vec();
        b.extend_from_slice(&qh.to_le_bytes());
        for j in 0..16u8 {
            b.push(j | ((15 - j) << 4));
        }
        let y = deq(GgmlType::Q5_0, &b, 32);
        for j in 0..16 {
            let bit = |e: usize| ((qh >> e) & 1) as f32 * 16.0;
            assert_eq!(y[j], (j as f32 + bit(j) - 16.0) * 0.5, "element {j}");
            let hi = (15 - j) as f32 + bit(j + 16) - 16.0;
            assert_eq!(y[j + 16], hi * 0.5, "element {}", j + 16);
        }
        // The extremes: all bits clear is -16 d, all set with nibble 15 is 15 d.
        let mut b = h(2.0).to_vec();
        b.extend_from_slice(&0xFFFF_0000u32.to_le_bytes());
        b.extend_from_slice(&[0xF0; 16]);
        let y = deq(GgmlType::Q5_0, &b, 32);
        assert!(y[..16].iter().all(|&v| v == -32.0));
        assert!(y[16..].iter().all(|&v| v == 30.0));
    }

    #[test]
    fn quantize_q5_0_known_block() {
        // max = -16 (the largest magnitude) gives d = 1: every integer in
        // -16..=15 quantises to itself, and x = 15.6 rounds to 16 and clamps
        // to 15.
        let mut x: Vec<f32> = (0..32).map(|e| (e as f32) - 16.0).collect();
        x[31] = 15.6;
        let mut b = [0u8; 22];
        quantize_row(GgmlType::Q5_0, &x, &mut b).expect("quantize");
        assert_eq!(f16_le(&b, 0), 1.0);
        let y = deq(GgmlType::Q5_0, &b, 32);
        for e in 0..31 {
            assert_eq!(y[e], x[e], "element {e}");
        }
        assert_eq!(y[31], 15.0);
        // All zero: d = 0 and every quant 16 (the zero point).
        quantize_row(GgmlType::Q5_0, &[0.0; 32], &mut b).expect("quantize");
        assert_eq!(f16_le(&b, 0), 0.0);
        assert_eq!(u32::from_le_bytes([b[2], b[3], b[4], b[5]]), u32::MAX);
        assert!(b[6..].iter().all(|&q| q == 0));
    }

    #[test]
    fn dequant_q4_k_known() {
        // d = 1, dmin = 0.5; 6-bit sub-block scales and mins (packed as ggml).
        let sc: [u8; 8] = [1, 20, 33, 63, 5, 47, 18, 62];
        let mn: [u8; 8] = [10, 41, 12, 60, 34, 15, 50, 17];
        let mut packed = [0u8; 12];
        packed[..4].copy_from_slice(&sc[..4]);
        packed[4..8].copy_from_slice(&mn[..4]);
        for j in 4..8 {
            packed[j + 4] = (sc[j] & 0xF) | ((mn[j] & 0xF) << 4);
            packed[j - 4] |= (sc[j] >> 4) << 6;
            packed[j] |= (mn[j] >> 4) << 6;
        }
        for j in 0..8 {
            assert_eq!(scale_min_k4(j, &packed), (sc[j], mn[j]));
        }
        let mut b = h(1.0).to_vec();
        b.extend_from_slice(&h(0.5));
        b.extend_from_slice(&packed);
        b.extend((0..128).map(|i| ((i % 16) as u8) | (((i / 8) % 16) as u8) << 4));
        let y = deq(GgmlType::Q4_K, &b, 256);
        for (e, &got) in y.iter().enumerate() {
            let j = e / 64;
            let l = e % 32;
            let hi = (e % 64) >= 32;
            let byte = 32 * j + l;
            let q = if hi { (byte / 8) % 16 } else { byte % 16 } as f32;
            let s = if hi { 2 * j + 1 } else { 2 * j };
            let want = sc[s] as f32 * q - 0.5 * mn[s] as f32;
            assert_eq!(got, want, "element {e}");
        }
    }

    #[test]
    fn dequant_q6_k_known() {
        // Build from desired 6-bit values q[e] in 0..64 and scales.
        let q: Vec<u8> = (0..256).map(|e| ((e * 7 + 3) % 64) as u8).collect();
        let scales: [i8; 16] = [
            1, -2, 3, -4, 5, -6, 7, -8, 9, -10, 11, -12, 13, -14, 15, -16,
        ];
        let mut ql = [0u8; 128];
        let mut qh = [0u8; 64];
        for h in 0..2 {
            for l in 0..32 {
                let base = 128 * h;
                let (a, b, c, d) = (
                    q[base + l],
                    q[base + l + 32],
                    q[base + l + 64],
                    q[base + l + 96],
                );
                ql[64 * h + l] = (a & 0xF) | ((c & 0xF) << 4);
                ql[64 * h + l + 32] = (b & 0xF) | ((d & 0xF) << 4);
                qh[32 * h + l] = (a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((d >> 4) << 6);
            }
        }
        let mut b = ql.to_vec();
        b.extend_from_slice(&qh);
        b.extend(scales.iter().map(|&s| s as u8));
        b.extend_from_slice(&h(0.5));
        let y = deq(GgmlType::Q6_K, &b, 256);
        for e in 0..256 {
            let want = 0.5 * scales[e / 16] as f32 * (q[e] as i32 - 32) as f32;
            assert_eq!(y[e], want, "element {e}");
        }
    }

    #[test]
    fn dequant_rejects_bad_lengths() {
        let mut out = vec![0.0; 32];
        assert!(dequantize_row(GgmlType::Q4_1, &[0u8; 19], &mut out).is_err());
        assert!(dequantize_row(GgmlType::Q4_1, &[0u8; 21], &mut out).is_err());
        let mut out = vec![0.0; 33];
        assert!(dequantize_row(GgmlType::Q4_1, &[0u8; 20], &mut out).is_err());
        assert!(quantize_row(GgmlType::Q8_0, &[0.0; 32], &mut [0u8; 33]).is_err());
        assert!(quantize_row(GgmlType::Q6_K, &[0.0; 256], &mut [0u8; 210]).is_err());
    }

    fn rand_row(n: usize, seed: u64) -> Vec<f32> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| rng.random_range(-3.0f32..3.0)).collect()
    }

    #[test]
    fn q8_roundtrip_error_bounds() {
        let n = 32 * 64;
        let x = rand_row(n, 1);
        for ty in [GgmlType::Q8_0, GgmlType::Q8_1] {
            let mut b = vec![0u8; ty.row_bytes(n).expect("aligned")];
            quantize_row(ty, &x, &mut b).expect("quantize");
            let y = deq(ty, &b, n);
            for (blk, (xs, ys)) in x.chunks(32).zip(y.chunks(32)).enumerate() {
                let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let d = f16_le(&b, blk * ty.block_bytes());
                // Rounding to the grid costs d/2; the f16 rounding of d adds up
                // to 127 * |d - amax/127| <= 127 * 2^-11 * d.
                let bound = d * 0.5 + 127.0 * d * (1.0 / 2048.0) + 1e-6;
                for (a, c) in xs.iter().zip(ys) {
                    assert!((a - c).abs() <= bound, "{ty:?} {a} vs {c} (amax {amax})");
                }
                if ty == GgmlType::Q8_1 {
                    let s = f16_le(&b, blk * 36 + 2);
                    let sum: i32 = b[blk * 36 + 4..blk * 36 + 36]
                        .iter()
                        .map(|&q| q as i8 as i32)
                        .sum();
                    let want = f32_to_f16_bits((amax / 127.0) * sum as f32);
                    assert_eq!(f32_to_f16_bits(s), want);
                }
            }
        }
        // Q8_K
        let n = 512;
        let x = rand_row(n, 2);
        let mut b = vec![0u8; GgmlType::Q8_K.row_bytes(n).expect("aligned")];
        quantize_row(GgmlType::Q8_K, &x, &mut b).expect("quantize");
        let y = deq(GgmlType::Q8_K, &b, n);
        for (blk, (xs, ys)) in x.chunks(256).zip(y.chunks(256)).enumerate() {
            let d = f32_le(&b, blk * 292).abs();
            for (a, c) in xs.iter().zip(ys) {
                assert!((a - c).abs() <= d * 0.5001);
            }
            for j in 0..16 {
                let off = blk * 292 + 260 + 2 * j;
                let s = i16::from_le_bytes([b[off], b[off + 1]]) as i32;
                let want: i32 = (0..16)
                    .map(|i| b[blk * 292 + 4 + 16 * j + i] as i8 as i32)
                    .sum();
                assert_eq!(s, want);
            }
        }
    }

    #[test]
    fn q4_roundtrip_error_bounds() {
        // The quantisers round to the nearest point of the block's grid,
        // (q - 8) d for Q4_0, q d + m for Q4_1 (q in 0..16) and (q - 16) d
        // for Q5_0 (q in 0..32): an error of at most d/2, plus the distance
        // beyond the grid's ends for values that clamp (Q4_0's and Q5_0's
        // grids stop one step short on the side opposite the largest
        // value). Truncating instead would cost up to d. The only slack: d
        // and m are stored as f16 (relative error 2^-11) after the
        // quantiser used their f32 values, which moves the chosen point by
        // at most levels |Δd| + |Δm|, and the nearest one as much.
        let n = 32 * 16;
        let x = rand_row(n, 3);
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0] {
            let mut b = vec![0u8; ty.row_bytes(n).expect("aligned")];
            quantize_row(ty, &x, &mut b).expect("quantize");
            let y = deq(ty, &b, n);
            for (blk, (xs, ys)) in x.chunks(32).zip(y.chunks(32)).enumerate() {
                let off = blk * ty.block_bytes();
                let d = f16_le(&b, off);
                let (first, last, levels) = match ty {
                    GgmlType::Q4_0 => (-8.0 * d, 7.0 * d, 16.0),
                    GgmlType::Q5_0 => (-16.0 * d, 15.0 * d, 32.0),
                    _ => {
                        let m = f16_le(&b, off + 2);
                        (m, m + 15.0 * d, 16.0)
                    }
                };
                let (lo, hi) = (first.min(last), first.max(last));
                let slack = 2.0 * (levels * d.abs() + lo.abs().max(hi.abs())) / 2048.0 + 1e-6;
                for (a, c) in xs.iter().zip(ys) {
                    let beyond = (lo - a).max(a - hi).max(0.0);
                    let bound = d.abs() / 2.0 + beyond + slack;
                    assert!(
                        (a - c).abs() <= bound,
                        "{ty:?} block {blk}: {a} came back as {c}, off by more than {bound} (d={d})"
                    );
                }
            }
        }
    }

    #[test]
    fn q8_0_matches_ggml_rounding() {
        // amax = 127 -> id = 1, ties go to even.
        let mut x = [0.0f32; 32];
        x[0] = 127.0;
        x[1] = 2.5;
        x[2] = -3.5;
        x[3] = 0.5;
        let mut qs = [0i8; 32];
        let (d, sum, _) = quantize_block_q8(&x, &mut qs);
        assert_eq!(f16_bits_to_f32(d), 1.0);
        assert_eq!(&qs[..4], &[127, 2, -4, 0]);
        assert_eq!(sum, 125);
        let (d, sum, _) = quantize_block_q8(&[0.0; 32], &mut qs);
        assert_eq!((d, sum), (0, 0));
        assert!(qs.iter().all(|&q| q == 0));
    }
}
