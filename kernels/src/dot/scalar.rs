//! Scalar reference dot products. These define the numerics: every SIMD
//! kernel must reproduce them bit for bit (see the module docs of `dot`).

use super::{ActQ8, Acts};
use crate::quant::{GgmlType, QK, QK_K, bf16_bits_to_f32, f16_bits_to_f32, f16_le, scale_min_k4};

/// ggml's `hsum_float_8`: ((v0+v4)+(v2+v6)) + ((v1+v5)+(v3+v7)).
#[inline]
pub(crate) fn hsum8(v: [f32; 8]) -> f32 {
    let r = [v[0] + v[4], v[1] + v[5], v[2] + v[6], v[3] + v[7]];
    (r[0] + r[2]) + (r[1] + r[3])
}

/// `_mm512_reduce_add_ps` order: halve to 8 lanes, then `hsum8`.
#[inline]
pub(crate) fn hsum16(v: [f32; 16]) -> f32 {
    hsum8(std::array::from_fn(|i| v[i] + v[i + 8]))
}

/// Lane of element `e` within a 32-element chunk, as `maddubs`+`madd` or
/// `vpdpbusd` group bytes.
#[inline]
fn lane(e: usize) -> usize {
    (e % 32) / 4
}

/// `_mm256_sign_epi8`-based signed product used by ggml's
/// `mul_sum_i8_pairs_float`: |w| (as u8) times y negated (wrapping) where w < 0.
#[inline]
fn signed_prod(w: i8, y: i8) -> i32 {
    let aw = w.unsigned_abs() as i32;
    let sy = if w < 0 { y.wrapping_neg() } else { y };
    aw * sy as i32
}

/// Dot product of weight row `w` (type `ty`, `cols` elements) with activation
/// row `j`.
pub(crate) fn dot(ty: GgmlType, w: &[u8], cols: usize, acts: &Acts<'_>, j: usize) -> f32 {
    match (ty, acts) {
        (GgmlType::F32, Acts::F32(x)) => dot_float(w, &x[j * cols..(j + 1) * cols], |b, k| {
            f32::from_le_bytes([b[4 * k], b[4 * k + 1], b[4 * k + 2], b[4 * k + 3]])
        }),
        (GgmlType::F16, Acts::Half(x)) => {
            let x: Vec<f32> = x[j * cols..(j + 1) * cols]
                .iter()
                .map(|&h| f16_bits_to_f32(h))
                .collect();
            dot_float(w, &x, |b, k| f16_le(b, 2 * k))
        }
        (GgmlType::BF16, Acts::Half(x)) => {
            let x: Vec<f32> = x[j * cols..(j + 1) * cols]
                .iter()
                .map(|&h| bf16_bits_to_f32(h))
                .collect();
            dot_float(w, &x, |b, k| {
                bf16_bits_to_f32(u16::from_le_bytes([b[2 * k], b[2 * k + 1]]))
            })
        }
        (GgmlType::Q4_0, Acts::Q8(a)) => dot_q4_0(w, a, cols, j),
        (GgmlType::Q4_1, Acts::Q8(a)) => dot_q4_1(w, a, cols, j),
        (GgmlType::Q5_0, Acts::Q8(a)) => dot_q5_0(w, a, cols, j),
        (GgmlType::Q8_0, Acts::Q8(a)) => dot_q8_0(w, a, cols, j),
        (GgmlType::Q4_K, Acts::Q8(a)) => dot_q4_k(w, a, cols, j),
        (GgmlType::Q6_K, Acts::Q8(a)) => dot_q6_k(w, a, cols, j),
        _ => unreachable!("activation form does not match weight type {ty:?}"),
    }
}

fn dot_float(w: &[u8], x: &[f32], wv: impl Fn(&[u8], usize) -> f32) -> f32 {
    let cols = x.len();
    let nc = cols / 16 * 16;
    let mut acc = [0.0f32; 16];
    for c in (0..nc).step_by(16) {
        for (l, a) in acc.iter_mut().enumerate() {
            *a = wv(w, c + l).mul_add(x[c + l], *a);
        }
    }
    let mut s = hsum16(acc);
    for (k, &xv) in x.iter().enumerate().skip(nc) {
        s += wv(w, k) * xv;
    }
    s
}

fn dot_q8_0(w: &[u8], a: &ActQ8, cols: usize, j: usize) -> f32 {
    let xq = &a.qs[j * cols..];
    let xd = &a.d[j * a.nb..];
    let mut acc = [0.0f32; 8];
    for b in 0..a.nb {
        let blk = &w[34 * b..34 * b + 34];
        let d = f16_le(blk, 0) * xd[b];
        let mut isum = [0i32; 8];
        for e in 0..QK {
            isum[lane(e)] += signed_prod(blk[2 + e] as i8, xq[QK * b + e]);
        }
        for l in 0..8 {
            acc[l] = d.mul_add(isum[l] as f32, acc[l]);
        }
    }
    hsum8(acc)
}

fn dot_q4_0(w: &[u8], a: &ActQ8, cols: usize, j: usize) -> f32 {
    let xq = &a.qs[j * cols..];
    let xd = &a.d[j * a.nb..];
    let mut acc = [0.0f32; 8];
    for b in 0..a.nb {
        let blk = &w[18 * b..18 * b + 18];
        let d = f16_le(blk, 0) * xd[b];
        let mut isum = [0i32; 8];
        for e in 0..16 {
            let q = blk[2 + e];
            let lo = (q & 0xF) as i8 - 8;
            let hi = (q >> 4) as i8 - 8;
            isum[lane(e)] += signed_prod(lo, xq[QK * b + e]);
            isum[lane(e + 16)] += signed_prod(hi, xq[QK * b + e + 16]);
        }
        for l in 0..8 {
            acc[l] = d.mul_add(isum[l] as f32, acc[l]);
        }
    }
    hsum8(acc)
}

/// ggml's AVX2 `ggml_vec_dot_q5_0_q8_0`: as Q4_0, with quants
/// `(nib | bit << 4) - 16` (the kernel ORs 0xF0 into bytes whose bit is clear).
fn dot_q5_0(w: &[u8], a: &ActQ8, cols: usize, j: usize) -> f32 {
    let xq = &a.qs[j * cols..];
    let xd = &a.d[j * a.nb..];
    let mut acc = [0.0f32; 8];
    for b in 0..a.nb {
        let blk = &w[22 * b..22 * b + 22];
        let d = f16_le(blk, 0) * xd[b];
        let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
        let mut isum = [0i32; 8];
        for e in 0..16 {
            let q = blk[6 + e];
            let lo = ((q & 0xF) | (((qh >> e) & 1) as u8) << 4) as i8 - 16;
            let hi = ((q >> 4) | (((qh >> (e + 16)) & 1) as u8) << 4) as i8 - 16;
            isum[lane(e)] += signed_prod(lo, xq[QK * b + e]);
            isum[lane(e + 16)] += signed_prod(hi, xq[QK * b + e + 16]);
        }
        for l in 0..8 {
            acc[l] = d.mul_add(isum[l] as f32, acc[l]);
        }
    }
    hsum8(acc)
}

fn dot_q4_1(w: &[u8], a: &ActQ8, cols: usize, j: usize) -> f32 {
    let xq = &a.qs[j * cols..];
    let xd = &a.d[j * a.nb..];
    let xs = &a.s[j * a.nb..];
    let mut acc = [0.0f32; 8];
    let mut summs = 0.0f32;
    for b in 0..a.nb {
        let blk = &w[20 * b..20 * b + 20];
        let d = f16_le(blk, 0) * xd[b];
        summs = f16_le(blk, 2).mul_add(xs[b], summs);
        let mut isum = [0i32; 8];
        for e in 0..16 {
            let q = blk[4 + e];
            isum[lane(e)] += (q & 0xF) as i32 * xq[QK * b + e] as i32;
            isum[lane(e + 16)] += (q >> 4) as i32 * xq[QK * b + e + 16] as i32;
        }
        for l in 0..8 {
            acc[l] = d.mul_add(isum[l] as f32, acc[l]);
        }
    }
    hsum8(acc) + summs
}

fn dot_q4_k(w: &[u8], a: &ActQ8, cols: usize, j: usize) -> f32 {
    let xq = &a.qs[j * cols..];
    let xd = &a.d[j * a.nb..];
    let xb = &a.bsums[j * a.nb * 16..];
    let mut acc = [0.0f32; 8];
    let mut acc_m = [0.0f32; 4];
    for b in 0..a.nb {
        let blk = &w[144 * b..144 * b + 144];
        let yd = xd[b];
        let d = yd * f16_le(blk, 0);
        let dmin = -yd * f16_le(blk, 2);
        let scales = &blk[4..16];
        let qs = &blk[16..144];
        let bs = &xb[16 * b..16 * b + 16];
        for (k, am) in acc_m.iter_mut().enumerate() {
            let (_, m0) = scale_min_k4(2 * k, scales);
            let (_, m1) = scale_min_k4(2 * k + 1, scales);
            let s0 = bs[4 * k].wrapping_add(bs[4 * k + 1]) as i32;
            let s1 = bs[4 * k + 2].wrapping_add(bs[4 * k + 3]) as i32;
            let prod = m0 as i32 * s0 + m1 as i32 * s1;
            *am = dmin.mul_add(prod as f32, *am);
        }
        let mut isum = [0i32; 8];
        for c in 0..4 {
            let (sc_lo, _) = scale_min_k4(2 * c, scales);
            let (sc_hi, _) = scale_min_k4(2 * c + 1, scales);
            for l in 0..32 {
                let q = qs[32 * c + l];
                let e = QK_K * b + 64 * c + l;
                isum[lane(l)] += sc_lo as i32 * (q & 0xF) as i32 * xq[e] as i32;
                isum[lane(l)] += sc_hi as i32 * (q >> 4) as i32 * xq[e + 32] as i32;
            }
        }
        for l in 0..8 {
            acc[l] = d.mul_add(isum[l] as f32, acc[l]);
        }
    }
    let m = (acc_m[0] + acc_m[2]) + (acc_m[1] + acc_m[3]);
    hsum8(acc) + m
}

fn dot_q6_k(w: &[u8], a: &ActQ8, cols: usize, j: usize) -> f32 {
    let xq = &a.qs[j * cols..];
    let xd = &a.d[j * a.nb..];
    let mut acc = [0.0f32; 8];
    for b in 0..a.nb {
        let blk = &w[210 * b..210 * b + 210];
        let d = xd[b] * f16_le(blk, 208);
        let mut isum = [0i32; 8];
        for h in 0..2 {
            let ql = &blk[64 * h..64 * h + 64];
            let qh = &blk[128 + 32 * h..128 + 32 * h + 32];
            let sc = &blk[192 + 8 * h..192 + 8 * h + 8];
            for l in 0..32 {
                let q = [
                    (ql[l] & 0xF) | ((qh[l] & 3) << 4),
                    (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4),
                    (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                    (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
                ];
                for (c, &qv) in q.iter().enumerate() {
                    let e = QK_K * b + 128 * h + 32 * c + l;
                    let s = sc[2 * c + l / 16] as i8 as i32;
                    isum[lane(l)] += s * (qv as i32 - 32) * xq[e] as i32;
                }
            }
        }
        for l in 0..8 {
            acc[l] = d.mul_add(isum[l] as f32, acc[l]);
        }
    }
    hsum8(acc)
}
