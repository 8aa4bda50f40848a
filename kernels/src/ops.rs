//! Element-wise and normalisation ops used by the transformer forward pass.
//!
//! These are the scalar references; the compiler vectorises the simple
//! loops, and SwiGLU and softmax (which need `exp`) come from `vmath`, with
//! explicit SIMD bodies. Accumulations that ggml performs in double
//! precision (RMSNorm's sum of squares, softmax's sum of exponentials) are
//! done in `f64` here too, so that greedy decoding agrees with llama.cpp on
//! near-ties.

use half::f16;

/// `out[i] = x[i] / rms(x) * weight[i]`, with the mean of squares in `f64`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    debug_assert_eq!(x.len(), weight.len());
    debug_assert_eq!(x.len(), out.len());
    let sum: f64 = x.iter().map(|&v| f64::from(v * v)).sum();
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = (v * scale) * w;
    }
}

/// [`rms_norm`] of `x` into itself (the same operations).
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    debug_assert_eq!(x.len(), weight.len());
    let sum: f64 = x.iter().map(|&v| f64::from(v * v)).sum();
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    for (v, &w) in x.iter_mut().zip(weight) {
        *v = (*v * scale) * w;
    }
}

/// Soft-caps logits: `x = cap * tanh(x / cap)`.
pub fn softcap(x: &mut [f32], cap: f32) {
    for v in x {
        *v = cap * (*v / cap).tanh();
    }
}

/// How rotary embeddings pair up the dimensions of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs `(x[2i], x[2i+1])`: GGUF Llama (q/k weights permuted at conversion).
    Interleaved,
    /// Halves `(x[i], x[i + d/2])`: Hugging Face `rotate_half` convention.
    Neox,
}

/// Rotary position embedding for one head dimension.
#[derive(Clone, Debug)]
pub struct Rope {
    style: RopeStyle,
    rot_dims: usize,
    theta_scale: f32,
}

impl Rope {
    /// `rot_dims` dimensions of each head are rotated (the rest pass through).
    pub fn new(style: RopeStyle, rot_dims: usize, freq_base: f32) -> Self {
        Self {
            style,
            rot_dims,
            theta_scale: freq_base.powf(-2.0 / rot_dims as f32),
        }
    }

    /// Rotates every head of `x` (`n_heads * head_dim` values) in place for position `pos`.
    pub fn apply(&self, x: &mut [f32], head_dim: usize, pos: usize) {
        self.angles(pos).apply(x, head_dim);
    }

    /// The rotation of position `pos`, for rotating several rows (a token's
    /// queries and keys) with one set of sines and cosines.
    pub fn angles(&self, pos: usize) -> RopeAngles {
        // theta_i = pos * scale^i, built by repeated multiplication exactly as ggml
        // does, so rounding agrees with llama.cpp.
        let mut theta = pos as f32;
        let mut table = [(0.0f32, 1.0f32); 256];
        let pairs = (self.rot_dims / 2).min(table.len());
        for entry in table.iter_mut().take(pairs) {
            *entry = theta.sin_cos();
            theta *= self.theta_scale;
        }
        RopeAngles {
            style: self.style,
            half: self.rot_dims / 2,
            pairs,
            table,
        }
    }
}

/// [`Rope`]'s sines and cosines for one position.
#[derive(Clone, Debug)]
pub struct RopeAngles {
    style: RopeStyle,
    half: usize,
    pairs: usize,
    table: [(f32, f32); 256],
}

impl RopeAngles {
    /// `(sin, cos)` of each rotated pair's angle, first pair first: what a
    /// device backend's position table holds.
    pub fn sin_cos(&self) -> &[(f32, f32)] {
        &self.table[..self.pairs]
    }

    /// Rotates every head of `x` (`n_heads * head_dim` values) in place.
    pub fn apply(&self, x: &mut [f32], head_dim: usize) {
        let half = self.half;
        for head in x.chunks_exact_mut(head_dim) {
            for (i, &(sin, cos)) in self.table[..self.pairs].iter().enumerate() {
                let (a, b) = match self.style {
                    RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                    RopeStyle::Neox => (i, i + half),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * cos - x1 * sin;
                head[b] = x0 * sin + x1 * cos;
            }
        }
    }
}

/// GeGLU with the tanh form of GELU (Gemma's `gelu_pytorch_tanh`), in
/// f32. ggml looks GELU up in an f16 table instead; the exact form is what
/// the model was trained with.
pub use crate::vmath::gelu_mul as gelu_tanh_mul;
pub use crate::vmath::{
    GELU_C, GELU_K2, gelu_mul_with_isa, max, round_through_f16, silu_mul, silu_mul_with_isa,
    softmax, softmax_with_isa,
};

/// `acc[i] += x[i]`.
pub fn add_assign(acc: &mut [f32], x: &[f32]) {
    debug_assert_eq!(acc.len(), x.len());
    for (a, &v) in acc.iter_mut().zip(x) {
        *a += v;
    }
}

/// Dot product of an `f32` query with an `f16` key row, accumulated in `f32`.
#[inline]
pub fn dot_f32_f16(q: &[f32], k: &[f16]) -> f32 {
    debug_assert_eq!(q.len(), k.len());
    // Eight independent partial sums let the compiler vectorise the loop.
    let mut acc = [0.0f32; 8];
    let (q8, q_tail) = q.as_chunks::<8>();
    let (k8, k_tail) = k.as_chunks::<8>();
    for (qc, kc) in q8.iter().zip(k8) {
        for ((a, &x), &y) in acc.iter_mut().zip(qc).zip(kc) {
            *a += x * y.to_f32();
        }
    }
    let tail: f32 = q_tail
        .iter()
        .zip(k_tail)
        .map(|(&x, &y)| x * y.to_f32())
        .sum();
    acc.iter().sum::<f32>() + tail
}

/// `acc[i] += w * v[i]` for an `f16` value row.
#[inline]
pub fn axpy_f16(acc: &mut [f32], w: f32, v: &[f16]) {
    debug_assert_eq!(acc.len(), v.len());
    for (a, &x) in acc.iter_mut().zip(v) {
        *a += w * x.to_f32();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_unit_weights_gives_unit_rms() {
        let x = [1.0f32, -2.0, 3.0, -4.0];
        let w = [1.0f32; 4];
        let mut out = [0.0f32; 4];
        rms_norm(&x, &w, 0.0, &mut out);
        let rms = (out.iter().map(|v| v * v).sum::<f32>() / 4.0).sqrt();
        assert!((rms - 1.0).abs() < 1e-6, "rms {rms}");
        assert!((out[0] - 1.0 / 7.5f32.sqrt()).abs() < 1e-6);
    }

    #[test]
    fn in_place_norm_gelu_and_softcap() {
        let x: Vec<f32> = (0..24).map(|i| i as f32 * 0.31 - 3.0).collect();
        let w: Vec<f32> = (0..24).map(|i| 1.0 + i as f32 * 0.01).collect();
        let mut out = vec![0.0; 24];
        rms_norm(&x, &w, 1e-6, &mut out);
        let mut y = x.clone();
        rms_norm_in_place(&mut y, &w, 1e-6);
        assert_eq!(y, out);
        // gelu(0) = 0, gelu(x) ~ x for large x, ~ 0 for very negative x,
        // and gelu(1) = 0.8412 (tanh form).
        let mut g = vec![0.0, 8.0, -8.0, 1.0];
        gelu_tanh_mul(&mut g, &[1.0, 1.0, 1.0, 2.0]);
        assert_eq!(g[0], 0.0);
        assert!((g[1] - 8.0).abs() < 1e-5 && g[2].abs() < 1e-5, "{g:?}");
        assert!((g[3] - 2.0 * 0.841_192).abs() < 1e-4, "{g:?}");
        let mut l = vec![0.0, 1.0, 1000.0, -1000.0];
        softcap(&mut l, 30.0);
        assert_eq!(l[0], 0.0);
        assert!(
            (l[1] - 1.0).abs() < 1e-3 && (l[2] - 30.0).abs() < 1e-4 && (l[3] + 30.0).abs() < 1e-4
        );
    }

    #[test]
    fn rope_position_zero_is_identity_and_preserves_norm() {
        for style in [RopeStyle::Interleaved, RopeStyle::Neox] {
            let rope = Rope::new(style, 8, 10000.0);
            let orig: Vec<f32> = (0..16).map(|i| i as f32 * 0.37 - 2.0).collect();
            let mut x = orig.clone();
            rope.apply(&mut x, 8, 0);
            assert_eq!(x, orig);
            rope.apply(&mut x, 8, 17);
            for (a, b) in x.chunks(8).zip(orig.chunks(8)) {
                let na: f32 = a.iter().map(|v| v * v).sum();
                let nb: f32 = b.iter().map(|v| v * v).sum();
                assert!((na - nb).abs() < 1e-3, "{style:?}: {na} vs {nb}");
            }
        }
    }

    #[test]
    fn rope_styles_are_permutations_of_each_other() {
        // Interleaved on (a0,b0,a1,b1,..) equals Neox on (a0,a1,..,b0,b1,..).
        let d = 8;
        let inter: Vec<f32> = (0..d).map(|i| (i as f32).sin()).collect();
        let mut neox = vec![0.0; d];
        for i in 0..d / 2 {
            neox[i] = inter[2 * i];
            neox[i + d / 2] = inter[2 * i + 1];
        }
        let mut a = inter.clone();
        let mut b = neox.clone();
        Rope::new(RopeStyle::Interleaved, d, 500.0).apply(&mut a, d, 5);
        Rope::new(RopeStyle::Neox, d, 500.0).apply(&mut b, d, 5);
        for i in 0..d / 2 {
            assert!((a[2 * i] - b[i]).abs() < 1e-6);
            assert!((a[2 * i + 1] - b[i + d / 2]).abs() < 1e-6);
        }
    }

    #[test]
    fn softmax_sums_to_one_and_handles_masked_values() {
        let mut x = [1.0f32, 2.0, f32::NEG_INFINITY, 0.5];
        softmax(&mut x);
        assert_eq!(x[2], 0.0);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        let mut empty: [f32; 0] = [];
        softmax(&mut empty);
    }

    #[test]
    fn silu_mul_matches_definition() {
        let mut g = [0.0f32, 1.0, -3.0];
        silu_mul(&mut g, &[2.0, 2.0, 1.0]);
        assert_eq!(g[0], 0.0);
        assert!((g[1] - 2.0 / (1.0 + (-1.0f32).exp())).abs() < 1e-6);
        assert!((g[2] - (-3.0 / (1.0 + 3.0f32.exp()))).abs() < 1e-6);
    }

    #[test]
    fn f16_dot_and_axpy_match_f32_math() {
        let q: Vec<f32> = (0..19).map(|i| i as f32 * 0.25 - 1.0).collect();
        let k: Vec<f16> = (0..19)
            .map(|i| f16::from_f32(1.0 - i as f32 * 0.125))
            .collect();
        let want: f32 = q.iter().zip(&k).map(|(a, b)| a * b.to_f32()).sum();
        assert!((dot_f32_f16(&q, &k) - want).abs() < 1e-4);
        let mut acc = vec![1.0f32; 19];
        axpy_f16(&mut acc, 2.0, &k);
        assert!((acc[3] - (1.0 + 2.0 * k[3].to_f32())).abs() < 1e-6);
    }
}
