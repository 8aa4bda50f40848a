//! Every GPU kernel against the CPU reference in `tandem-kernels`, on the
//! first Vulkan device (lavapipe on machines without a GPU; the test
//! command installs it). Tolerances are stated per kernel.

use std::sync::OnceLock;

use tandem_gpu::kernels::{QFormat, QMatrix};
use tandem_gpu::{GpuDevice, kernels};
use tandem_types::rng::SeededRng;

/// The device every test shares (opening one costs ~0.1 s).
fn dev() -> &'static GpuDevice {
    static DEV: OnceLock<GpuDevice> = OnceLock::new();
    DEV.get_or_init(|| match GpuDevice::open(0) {
        Ok(d) => d,
        Err(e) => panic!("the GPU tests need a Vulkan device: {e}"),
    })
}

fn values(rng: &mut SeededRng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.f32(lo, hi)).collect()
}

/// Largest `|got - want| / (|want| + floor)`.
fn worst_rel(got: &[f32], want: &[f32], floor: f32) -> f32 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(&g, &w)| (g - w).abs() / (w.abs() + floor))
        .fold(0.0, f32::max)
}

#[test]
fn rms_norm_matches_the_cpu_within_2e_6_relative() {
    let d = dev();
    let mut rng = SeededRng::new(1);
    for (rows, width) in [(1, 576), (7, 64), (3, 1000)] {
        let x = values(&mut rng, rows * width, -3.0, 3.0);
        let w = values(&mut rng, width, 0.5, 1.5);
        let mut want = vec![0.0; x.len()];
        for (o, xr) in want.chunks_exact_mut(width).zip(x.chunks_exact(width)) {
            tandem_kernels::ops::rms_norm(xr, &w, 1e-5, o);
        }
        let (xb, wb, ob) = (d.upload(&x), d.upload(&w), d.zeros(x.len()));
        kernels::rms_norm(d, &xb, &wb, 1e-5, &ob).expect("launch");
        let got = d.download(&ob).expect("read");
        let err = worst_rel(&got, &want, 1e-6);
        assert!(
            err <= 2e-6,
            "rows {rows} width {width}: worst relative error {err}"
        );
    }
}

#[test]
fn add_rms_norm_is_add_then_rms_norm() {
    let d = dev();
    let mut rng = SeededRng::new(13);
    for (rows, width) in [(1, 576), (3, 1000)] {
        let x = values(&mut rng, rows * width, -3.0, 3.0);
        let delta = values(&mut rng, rows * width, -1.0, 1.0);
        let w = values(&mut rng, width, 0.5, 1.5);
        let sum: Vec<f32> = x.iter().zip(&delta).map(|(a, b)| a + b).collect();
        let mut want = vec![0.0; x.len()];
        for (o, xr) in want.chunks_exact_mut(width).zip(sum.chunks_exact(width)) {
            tandem_kernels::ops::rms_norm(xr, &w, 1e-5, o);
        }
        let (xb, db, wb, ob) = (
            d.upload(&x),
            d.upload(&delta),
            d.upload(&w),
            d.zeros(x.len()),
        );
        kernels::add_rms_norm(d, &xb, &db, None, &wb, 1e-5, &ob).expect("launch");
        assert_eq!(d.download(&xb).expect("read"), sum, "the residual");
        let err = worst_rel(&d.download(&ob).expect("read"), &want, 1e-6);
        assert!(
            err <= 2e-6,
            "rows {rows} width {width}: worst relative error {err}"
        );
        // Bit for bit what the two kernels it replaces give.
        let (xb2, ob2) = (d.upload(&x), d.zeros(x.len()));
        kernels::add(d, &xb2, &db).expect("launch");
        kernels::rms_norm(d, &xb2, &wb, 1e-5, &ob2).expect("launch");
        assert_eq!(
            d.download(&ob).expect("read"),
            d.download(&ob2).expect("read")
        );
    }
}

#[test]
fn add_rms_norm_with_a_post_norm_matches_the_cpu_residual_norm() {
    // Gemma's sandwich norms: x += rms_norm(delta) * post, then the next
    // norm, as the CPU engine's residual step computes them (its sums of
    // squares run in f64, the device's in f32 in another order).
    let d = dev();
    let mut rng = SeededRng::new(14);
    for (rows, width) in [(1, 640), (3, 1000)] {
        let x = values(&mut rng, rows * width, -3.0, 3.0);
        let delta = values(&mut rng, rows * width, -40.0, 40.0);
        let post = values(&mut rng, width, 0.5, 1.5);
        let w = values(&mut rng, width, 0.5, 1.5);
        let (mut sum, mut want) = (x.clone(), vec![0.0; x.len()]);
        for ((xr, dr), o) in sum
            .chunks_exact_mut(width)
            .zip(delta.chunks_exact(width))
            .zip(want.chunks_exact_mut(width))
        {
            let mut normed = dr.to_vec();
            tandem_kernels::ops::rms_norm_in_place(&mut normed, &post, 1e-6);
            tandem_kernels::ops::add_assign(xr, &normed);
            tandem_kernels::ops::rms_norm(xr, &w, 1e-6, o);
        }
        let (xb, db, pb, wb, ob) = (
            d.upload(&x),
            d.upload(&delta),
            d.upload(&post),
            d.upload(&w),
            d.zeros(x.len()),
        );
        kernels::add_rms_norm(d, &xb, &db, Some(&pb), &wb, 1e-6, &ob).expect("launch");
        let err = worst_rel(&d.download(&xb).expect("read"), &sum, 1.0);
        assert!(
            err <= 2e-6,
            "rows {rows} width {width}: residual off by {err}"
        );
        // Relative to the rows' scale (about 1): the residual's rounding
        // differences carry over to the values near 0.
        let err = worst_rel(&d.download(&ob).expect("read"), &want, 1.0);
        assert!(err <= 4e-6, "rows {rows} width {width}: worst error {err}");
    }
    // Post-norm weights must match the row width.
    let (a, b) = (d.zeros(8), d.zeros(4));
    let err = kernels::add_rms_norm(d, &a, &a, Some(&d.zeros(3)), &b, 1e-6, &d.zeros(8));
    assert!(err.is_err());
}

#[test]
fn head_rms_norm_normalises_query_and_key_heads_and_leaves_values() {
    let d = dev();
    let mut rng = SeededRng::new(15);
    // Gemma 3 270M's heads (4 query, 1 KV, 256 wide), and a smaller shape
    // whose heads do not fill a cube's units evenly.
    for (rows, hq, hk, hd) in [(3, 4, 1, 256), (2, 6, 2, 40)] {
        let stride = (hq + 2 * hk) * hd;
        let x = values(&mut rng, rows * stride, -5.0, 5.0);
        let wq = values(&mut rng, hd, 0.5, 1.5);
        let wk = values(&mut rng, hd, 0.5, 1.5);
        let mut want = x.clone();
        for row in want.chunks_exact_mut(stride) {
            for (h, head) in row[..(hq + hk) * hd].chunks_exact_mut(hd).enumerate() {
                let w = if h < hq { &wq } else { &wk };
                tandem_kernels::ops::rms_norm_in_place(head, w, 1e-6);
            }
        }
        let xb = d.upload(&x);
        let (qb, kb) = (d.upload(&wq), d.upload(&wk));
        kernels::head_rms_norm(d, &xb, stride, hq, hk, &qb, &kb, 1e-6).expect("launch");
        let got = d.download(&xb).expect("read");
        let err = worst_rel(&got, &want, 1e-6);
        assert!(
            err <= 2e-6,
            "{hq}+{hk} heads of {hd}: worst relative error {err}"
        );
        // The values' part of each row is untouched.
        for (g, w) in got.chunks_exact(stride).zip(x.chunks_exact(stride)) {
            assert_eq!(g[(hq + hk) * hd..], w[(hq + hk) * hd..]);
        }
    }
    // Heads that do not fit the row, or weights of two widths: refused.
    let (x, w4, w3) = (d.zeros(16), d.zeros(4), d.zeros(3));
    assert!(kernels::head_rms_norm(d, &x, 8, 2, 1, &w4, &w4, 1e-6).is_err());
    assert!(kernels::head_rms_norm(d, &x, 8, 1, 1, &w4, &w3, 1e-6).is_err());
}

#[test]
fn swiglu_and_geglu_match_the_cpu_within_1e_6_and_4e_6_relative() {
    use tandem_modelfile::arch::Activation;
    let d = dev();
    let mut rng = SeededRng::new(2);
    // (tokens, ffn): rows of [gate | up], as one matmul over both writes.
    for (act, n, ffn) in [
        (Activation::Silu, 1, 1),
        (Activation::Silu, 3, 21),
        (Activation::Silu, 2, 1536),
        (Activation::GeluTanh, 1, 1),
        (Activation::GeluTanh, 3, 21),
        (Activation::GeluTanh, 2, 2048),
    ] {
        let gate = values(&mut rng, n * ffn, -8.0, 8.0);
        let up = values(&mut rng, n * ffn, -2.0, 2.0);
        let mut want = gate.clone();
        match act {
            Activation::Silu => tandem_kernels::ops::silu_mul(&mut want, &up),
            Activation::GeluTanh => tandem_kernels::ops::gelu_tanh_mul(&mut want, &up),
        }
        let rows: Vec<f32> = gate
            .chunks_exact(ffn)
            .zip(up.chunks_exact(ffn))
            .flat_map(|(g, u)| g.iter().chain(u).copied())
            .collect();
        let out = d.zeros(n * ffn);
        kernels::glu(d, &d.upload(&rows), ffn, act, &out).expect("launch");
        let got = d.download(&out).expect("read");
        let err = worst_rel(&got, &want, 1e-6);
        // GELU's `exp` argument is computed and reaches about 45 in
        // magnitude here, which magnifies its rounding in the result.
        let tol = match act {
            Activation::Silu => 1e-6,
            Activation::GeluTanh => 4e-6,
        };
        assert!(err <= tol, "{act:?} {n}x{ffn}: worst relative error {err}");
    }
}

#[test]
fn softcap_matches_the_cpu_within_1e_6_of_the_cap() {
    let d = dev();
    let mut rng = SeededRng::new(16);
    let x = values(&mut rng, 4099, -200.0, 200.0);
    for cap in [30.0f32, 2.5] {
        let mut want = x.clone();
        tandem_kernels::ops::softcap(&mut want, cap);
        let xb = d.upload(&x);
        kernels::softcap(d, &xb, cap).expect("launch");
        let got = d.download(&xb).expect("read");
        // The device's tanh is not libm's: relative to the cap, the scale
        // of every capped value.
        let err = worst_rel(&got, &want, cap);
        assert!(err <= 1e-6, "cap {cap}: worst error {err}");
    }
    for cap in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        assert!(kernels::softcap(d, &d.zeros(4), cap).is_err(), "cap {cap}");
    }
}

#[test]
fn rope_matches_the_cpu_within_1e_6_on_both_styles() {
    use tandem_kernels::ops::{Rope, RopeStyle};
    let d = dev();
    let mut rng = SeededRng::new(3);
    let (heads, head_dim, max_pos) = (3, 64, 4096);
    let width = heads * head_dim;
    for style in [RopeStyle::Neox, RopeStyle::Interleaved] {
        let rope = Rope::new(style, head_dim, 10_000.0);
        let pairs = head_dim / 2;
        let table: Vec<f32> = (0..max_pos)
            .flat_map(|p| {
                rope.angles(p)
                    .sin_cos()
                    .iter()
                    .flat_map(|&(s, c)| [s, c])
                    .collect::<Vec<_>>()
            })
            .collect();
        let pos: Vec<u32> = vec![0, 1, 17, 4095, 1000];
        // Rows of `stride` whose first `width` values rotate (Q and K at
        // the start of a fused QKV row); the rest stays as it is.
        let stride = width + 2 * head_dim;
        let x = values(&mut rng, pos.len() * stride, -2.0, 2.0);
        let mut want = x.clone();
        for (row, &p) in want.chunks_exact_mut(stride).zip(&pos) {
            rope.apply(&mut row[..width], head_dim, p as usize);
        }
        let (xb, pb, tb) = (d.upload(&x), d.upload(&pos), d.upload(&table));
        let neox = style == RopeStyle::Neox;
        kernels::rope(d, &xb, &pb, &tb, width, stride, head_dim, pairs, neox).expect("launch");
        let got = d.download(&xb).expect("read");
        // The device may fuse `x0 * cos - x1 * sin` into one FMA.
        let err = worst_rel(&got, &want, 1.0);
        assert!(err <= 1e-6, "{style:?}: worst error {err}");
    }
}

/// `x . w` per token and row in f64: the exact product the kernels round.
fn reference_matmul(x: &[f32], w: &[f32], cols: usize) -> Vec<f32> {
    x.chunks_exact(cols)
        .flat_map(|xt| {
            w.chunks_exact(cols).map(move |wr| {
                xt.iter()
                    .zip(wr)
                    .map(|(&a, &b)| f64::from(a) * f64::from(b))
                    .sum::<f64>() as f32
            })
        })
        .collect()
}

#[test]
fn matmul_matches_an_f64_reference_within_1e_5_of_the_row_scale() {
    let d = dev();
    let mut rng = SeededRng::new(4);
    // 70_000 rows run past one grid axis (65_535 cubes) onto the next.
    // Token tiles of 1, 4 and 8 (13 tokens: a full tile and a partial one).
    for (n_tok, rows, cols) in [
        (1, 70, 64),
        (3, 576, 576),
        (5, 1, 32),
        (1, 70_000, 8),
        (13, 40, 96),
    ] {
        let x = values(&mut rng, n_tok * cols, -1.0, 1.0);
        let w = values(&mut rng, rows * cols, -1.0, 1.0);
        let want = reference_matmul(&x, &w, cols);
        let (xb, wb, ob) = (d.upload(&x), d.upload(&w), d.zeros(n_tok * rows));
        kernels::matmul(d, &xb, &wb, cols, &ob).expect("launch");
        let got = d.download(&ob).expect("read");
        // An f32 sum of `cols` terms of magnitude <= 1: relative to sqrt(cols).
        let err = worst_rel(&got, &want, (cols as f32).sqrt());
        assert!(err <= 1e-5, "{n_tok}x{rows}x{cols}: worst error {err}");
    }
}

/// `rows` rows of `cols` random values in `format`: random quants, and
/// each block's f16 scales (and Q4_1's min) between 2^-7 and 2^-4; F16,
/// BF16 and F32 values in [-1, 1), rounded by the CPU's conversion.
fn random_blocks(rng: &mut SeededRng, format: QFormat, rows: usize, cols: usize) -> Vec<u8> {
    let ty = format.ggml();
    let (bl, bb) = (ty.block_len(), ty.block_bytes());
    let halves: &[usize] = match format {
        QFormat::Q4_1 | QFormat::Q4_K => &[0, 2],
        QFormat::Q5_0 | QFormat::Q8_0 => &[0],
        QFormat::Q6_K => &[208],
        QFormat::F16 | QFormat::BF16 | QFormat::F32 => {
            let v = values(rng, rows * cols, -1.0, 1.0);
            let mut bytes = vec![0u8; rows * cols * bb];
            tandem_kernels::quantize_row(ty, &v, &mut bytes).expect("halves");
            return bytes;
        }
    };
    let mut bytes: Vec<u8> = (0..rows * cols / bl * bb)
        .map(|_| (rng.next_u64() % 256) as u8)
        .collect();
    for block in bytes.chunks_exact_mut(bb) {
        for &at in halves {
            let h = 0x2000 + (rng.next_u64() % 0x0c00) as u16;
            block[at..at + 2].copy_from_slice(&h.to_le_bytes());
        }
    }
    bytes
}

/// `bytes` (rows of `cols` in `format`) dequantised by the CPU reference.
fn dequantised(format: QFormat, bytes: &[u8], cols: usize) -> Vec<f32> {
    let ty = format.ggml();
    let row_bytes = ty.row_bytes(cols).expect("whole blocks");
    let mut out = vec![0.0f32; bytes.len() / row_bytes * cols];
    for (src, dst) in bytes
        .chunks_exact(row_bytes)
        .zip(out.chunks_exact_mut(cols))
    {
        tandem_kernels::dequantize_row(ty, src, dst).expect("dequantise");
    }
    out
}

#[test]
fn every_quantised_matmul_matches_its_dequantised_weights_within_1e_5() {
    // Against the CPU's dequantisation of the same GGUF bytes, summed in
    // f64; each output lands at rows 2.. of wider rows, whose other rows
    // stay as they were (a stacked matrix's parts share one output).
    let d = dev();
    let mut rng = SeededRng::new(5);
    for format in QFormat::ALL {
        for (n_tok, rows, cols) in [(1, 48, 512), (4, 130, 256), (13, 24, 768)] {
            let x = values(&mut rng, n_tok * cols, -1.0, 1.0);
            let q = random_blocks(&mut rng, format, rows, cols);
            let deq = dequantised(format, &q, cols);
            let want = reference_matmul(&x, &deq, cols);
            let w = QMatrix::upload(d, format, rows, cols, &q).expect("upload");
            let stride = rows + 3;
            let ob = d.upload(&vec![7.0f32; n_tok * stride]);
            kernels::matmul_q(d, &d.upload(&x), &w, &ob, stride, 2).expect("launch");
            let got = d.download(&ob).expect("read");
            let wmax = deq.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let mut mine = Vec::new();
            for t in got.chunks_exact(stride) {
                assert!(
                    t[..2].iter().chain(&t[2 + rows..]).all(|&v| v == 7.0),
                    "{format:?}: rows outside 2..{} written",
                    2 + rows
                );
                mine.extend_from_slice(&t[2..2 + rows]);
            }
            // An f32 sum of `cols` terms up to `wmax`.
            let err = worst_rel(&mine, &want, (cols as f32).sqrt() * wmax);
            assert!(
                err <= 1e-5,
                "{format:?} {n_tok}x{rows}x{cols}: worst error {err}"
            );
        }
    }
}

#[test]
fn a_token_s_matmul_row_is_bitwise_the_same_in_any_batch() {
    // Tokens share weight loads in tiles of up to 8, but each token's sum
    // runs in the one-token order: batching must not change a bit (the
    // scheduler's batches give what a lone sequence gets).
    let d = dev();
    let mut rng = SeededRng::new(12);
    let (rows, cols, n_tok) = (24, 768, 13);
    let x = values(&mut rng, n_tok * cols, -1.0, 1.0);
    let wf = d.upload(&values(&mut rng, rows * cols, -1.0, 1.0));
    let mut weights: Vec<Option<QMatrix>> = vec![None];
    for format in QFormat::ALL {
        let q = random_blocks(&mut rng, format, rows, cols);
        weights.push(Some(
            QMatrix::upload(d, format, rows, cols, &q).expect("upload"),
        ));
    }
    let run = |w: &Option<QMatrix>, x: &[f32]| {
        let ob = d.zeros(x.len() / cols * rows);
        match w {
            None => kernels::matmul(d, &d.upload(x), &wf, cols, &ob).expect("launch"),
            Some(w) => kernels::matmul_q(d, &d.upload(x), w, &ob, rows, 0).expect("launch"),
        }
        d.download(&ob).expect("read")
    };
    for w in &weights {
        let what = w.as_ref().map(QMatrix::format);
        let batch = run(w, &x);
        for (t, row) in x.chunks_exact(cols).enumerate() {
            let alone = run(w, row);
            assert!(
                alone == batch[t * rows..(t + 1) * rows],
                "token {t} ({what:?}; None is f32)"
            );
        }
    }
}

#[test]
fn a_live_matmul_computes_the_counted_rows_bitwise_and_leaves_the_rest() {
    let d = dev();
    let mut rng = SeededRng::new(17);
    let (rows, cols, n_tok) = (24, 256, 13);
    let x = d.upload(&values(&mut rng, n_tok * cols, -1.0, 1.0));
    let q = random_blocks(&mut rng, QFormat::Q8_0, rows, cols);
    let w = QMatrix::upload(d, QFormat::Q8_0, rows, cols, &q).expect("upload");
    let all = d.zeros(n_tok * rows);
    kernels::matmul_q(d, &x, &w, &all, rows, 0).expect("launch");
    let all = d.download(&all).expect("read");
    // Counts 0, 5 (a part tile) and 13; the one at index 1 applies.
    for live in [0u32, 5, 9, 13] {
        let counts = d.upload(&[7, live, 2]);
        let out = d.upload(&vec![-7.0f32; n_tok * rows]);
        kernels::matmul_q_live(d, &x, &w, &out, rows, 0, &counts, 1).expect("launch");
        let got = d.download(&out).expect("read");
        let cut = live as usize * rows;
        assert_eq!(got[..cut], all[..cut], "{live} live rows");
        assert!(
            got[cut..].iter().all(|&v| v == -7.0),
            "{live}: rows past the count"
        );
    }
    let counts = d.upload(&[1u32]);
    assert!(
        kernels::matmul_q_live(d, &x, &w, &d.zeros(n_tok * rows), rows, 0, &counts, 1).is_err()
    );
}

#[test]
fn moe_routing_and_grouping_follow_the_cpu_engine() {
    use tandem_engine::moe::{MoeConfig, Scoring, route_token};
    let d = dev();
    let mut rng = SeededRng::new(18);
    let (n, experts, k, width) = (37, 8, 2, 48);
    let mut logits = values(&mut rng, n * experts, -3.0, 3.0);
    // Ties: equal logits pick the lower expert first.
    logits[..experts].fill(0.5);
    let x = values(&mut rng, n * width, -1.0, 1.0);
    for (scoring, bias, scaling) in [
        (Scoring::Softmax, vec![0.0; experts], 1.0),
        (Scoring::Sigmoid, values(&mut rng, experts, -0.3, 0.3), 2.5),
    ] {
        let cfg = MoeConfig {
            n_experts: experts,
            top_k: k,
            scoring,
            norm_topk_prob: true,
            routed_scaling: scaling,
        };
        let r = kernels::MoeRouting {
            experts,
            top_k: k,
            sigmoid: scoring == Scoring::Sigmoid,
            norm: true,
            scaling,
        };
        let (sel, sel_w) = (d.empty::<u32>(n * k), d.zeros(n * k));
        let (order, weight, counts) = (
            d.empty::<u32>(experts * n),
            d.zeros(experts * n),
            d.empty::<u32>(experts),
        );
        let (lb, bb) = (d.upload(&logits), d.upload(&bias));
        kernels::moe_route(d, &lb, &bb, &r, &sel, &sel_w, &order, &weight, &counts)
            .expect("launch");
        let (order_h, weight_h, counts_h) = (
            d.download(&order).expect("read"),
            d.download(&weight).expect("read"),
            d.download(&counts).expect("read"),
        );
        // The CPU's routes, grouped per expert in token order.
        let routes: Vec<_> = logits
            .chunks_exact(experts)
            .map(|l| route_token(&cfg, &bias, l))
            .collect();
        if scoring == Scoring::Softmax {
            // (A selection bias breaks the tie otherwise.)
            let first: Vec<usize> = routes[0].iter().map(|r| r.0).collect();
            assert_eq!(first, [0, 1], "ties");
        }
        let (xb, packed, out) = (d.upload(&x), d.zeros(n * width), d.zeros(n * width));
        let mut want_out = vec![0.0f32; n * width];
        for e in 0..experts {
            let group: Vec<(usize, f32)> = routes
                .iter()
                .enumerate()
                .filter_map(|(t, r)| r.iter().find(|c| c.0 == e).map(|c| (t, c.1)))
                .collect();
            let c = counts_h[e] as usize;
            assert_eq!(c, group.len(), "{scoring:?}: expert {e}'s count");
            for (i, &(t, w)) in group.iter().enumerate() {
                assert_eq!(order_h[e * n + i] as usize, t, "{scoring:?}: expert {e}");
                let got = weight_h[e * n + i];
                assert!(
                    (got - w).abs() <= 1e-6 * w.abs().max(1.0),
                    "{scoring:?}: {got} vs {w}"
                );
            }
            // Packed rows, then (as an expert's output) added back weighted.
            kernels::moe_gather(d, &xb, &order, &counts, e, width, &packed).expect("launch");
            let got = d.download(&packed).expect("read");
            for (i, &(t, w)) in group.iter().enumerate() {
                assert_eq!(
                    got[i * width..(i + 1) * width],
                    x[t * width..(t + 1) * width]
                );
                for (o, v) in want_out[t * width..(t + 1) * width]
                    .iter_mut()
                    .zip(&x[t * width..])
                {
                    *o += w * v;
                }
            }
            kernels::moe_scatter_add(d, &packed, &order, &weight, &counts, e, width, &out)
                .expect("launch");
        }
        let got = d.download(&out).expect("read");
        let err = worst_rel(&got, &want_out, 1e-3);
        assert!(
            err <= 1e-5,
            "{scoring:?}: scatter-add worst relative error {err}"
        );
    }
    // Shapes: more picks than experts, and a group past the counts.
    let u = d.empty::<u32>(8);
    let bad = kernels::MoeRouting {
        experts: 2,
        top_k: 3,
        sigmoid: false,
        norm: true,
        scaling: 1.0,
    };
    assert!(
        kernels::moe_route(
            d,
            &d.zeros(4),
            &d.zeros(2),
            &bad,
            &u,
            &d.zeros(6),
            &u,
            &d.zeros(4),
            &d.empty(2)
        )
        .is_err()
    );
    let counts = d.empty::<u32>(2);
    assert!(kernels::moe_gather(d, &d.zeros(8), &u, &counts, 2, 2, &d.zeros(8)).is_err());
}

#[test]
fn copy_and_add_cover_buffers_past_one_grid_axis() {
    let d = dev();
    let mut rng = SeededRng::new(12);
    // 65_535 cubes of 64 units cover 4_194_240 values; these need a second
    // row of cubes.
    let n = 4_200_000;
    let a = values(&mut rng, n, -1.0, 1.0);
    let b = values(&mut rng, n, -1.0, 1.0);
    let (ab, bb, cb) = (d.upload(&a), d.upload(&b), d.zeros(n));
    kernels::copy(d, &ab, &cb).expect("launch");
    assert_eq!(d.download(&cb).expect("read"), a, "copy");
    kernels::add(d, &cb, &bb).expect("launch");
    let got = d.download(&cb).expect("read");
    let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
    assert_eq!(got, want, "add");
}

#[test]
fn argmax_is_the_cpu_greedy_choice_first_maximum_on_ties() {
    let d = dev();
    let mut rng = SeededRng::new(6);
    let n = 49_152;
    let mut rows: Vec<Vec<f32>> = (0..3).map(|_| values(&mut rng, n, -30.0, 30.0)).collect();
    // Ties: the first maximum must win, wherever it lies.
    rows[1][7] = 99.0;
    rows[1][40_000] = 99.0;
    rows[2].fill(-1.0);
    let mut short = values(&mut rng, 5, -30.0, -10.0);
    short[3] = -5.0;
    for (i, row) in rows.iter().chain([&short]).enumerate() {
        let want = tandem_kernels::ops::max(row);
        let want = row.iter().position(|&v| v == want).expect("a maximum") as u32;
        let (xb, ob) = (d.upload(row), d.upload(&[0u32]));
        kernels::argmax(d, &xb, row.len(), &ob).expect("launch");
        assert_eq!(d.download(&ob).expect("read"), vec![want], "row {i}");
    }
}

#[test]
fn top_k_is_the_cpu_samplers_candidates_and_log_sum_exp() {
    let d = dev();
    let mut rng = SeededRng::new(16);
    let n = 49_152;
    // Rows of a vocabulary: spread values; quarter steps, so equal values
    // fall at the k-th place; one value repeated everywhere; and a row
    // shorter than k.
    let spread: Vec<f32> = values(&mut rng, n, -30.0, 30.0);
    let steps: Vec<f32> = (0..n)
        .map(|_| (rng.f32(-8.0, 8.0) * 4.0).round() / 4.0)
        .collect();
    let flat = vec![-1.5f32; n];
    for k in [1, 8, 64] {
        for (what, rows, width) in [
            (
                "three rows",
                [spread.clone(), steps.clone(), flat.clone()].concat(),
                n,
            ),
            ("a short row", vec![0.5, 2.0, -1.0, 2.0, 7.0], 5),
        ] {
            let r = rows.len() / width;
            let (xb, ib, vb, zb) = (
                d.upload(&rows),
                d.empty::<u32>(r * k),
                d.zeros(r * k),
                d.zeros(r),
            );
            kernels::top_k(d, &xb, width, k, &ib, &vb, &zb).expect("launch");
            let (ids, vals, log_z) = (
                d.download(&ib).expect("read"),
                d.download(&vb).expect("read"),
                d.download(&zb).expect("read"),
            );
            for (j, row) in rows.chunks_exact(width).enumerate() {
                let (want_ids, want_vals, want_z) = tandem_engine::sampler::top_candidates(row, k);
                let got = &ids[j * k..(j + 1) * k];
                let kept = want_ids.len();
                assert_eq!(&got[..kept], &want_ids[..], "{what}, k {k}, row {j}: ids");
                assert!(
                    got[kept..].iter().all(|&i| i == u32::MAX),
                    "{what}: past the row"
                );
                assert_eq!(&vals[j * k..j * k + kept], &want_vals[..], "{what}: values");
                assert!(
                    (log_z[j] - want_z).abs() <= 1e-5 * want_z.abs().max(1.0),
                    "{what}, k {k}, row {j}: log-sum-exp {} vs {want_z}",
                    log_z[j]
                );
            }
        }
    }
}

#[test]
fn mismatched_shapes_are_errors_not_launches() {
    let d = dev();
    let (a, b) = (d.upload(&[1.0f32; 6]), d.upload(&[1.0f32; 4]));
    let out = d.zeros(6);
    let err = kernels::rms_norm(d, &a, &b, 1e-5, &out).expect_err("6 is not rows of 4");
    assert!(err.to_string().contains("rms_norm"), "{err}");
    assert!(kernels::glu(d, &a, 4, tandem_modelfile::arch::Activation::Silu, &b).is_err());
    assert!(kernels::copy(d, &a, &b).is_err());
    assert!(kernels::matmul(d, &a, &b, 4, &out).is_err());
    // 20 bytes are one Q4_1 block, not 33 values or two rows.
    assert!(QMatrix::upload(d, QFormat::Q4_1, 1, 33, &[0; 20]).is_err());
    assert!(QMatrix::upload(d, QFormat::Q4_1, 2, 32, &[0; 20]).is_err());
    let w = QMatrix::upload(d, QFormat::Q4_1, 1, 32, &[0; 20]).expect("one block");
    let x = d.upload(&[1.0f32; 64]);
    // Rows 6.. of rows of 6; 6 values are not rows of 32; out too short.
    assert!(kernels::matmul_q(d, &x, &w, &d.zeros(12), 6, 6).is_err());
    assert!(kernels::matmul_q(d, &a, &w, &out, 1, 0).is_err());
    assert!(kernels::matmul_q(d, &x, &w, &d.zeros(1), 1, 0).is_err());
    let idx = d.upload(&[0u32; 2]);
    assert!(kernels::argmax(d, &a, 4, &idx).is_err());
    // k past the most, and outputs that do not hold rows x k.
    let (ids, z) = (d.upload(&[0u32; 130]), d.zeros(2));
    assert!(kernels::top_k(d, &a, 3, 65, &ids, &d.zeros(130), &z).is_err());
    assert!(kernels::top_k(d, &a, 3, 2, &idx, &d.zeros(4), &z).is_err());
    assert!(kernels::top_k(d, &a, 3, 0, &idx, &d.zeros(2), &z).is_err());
}

#[test]
fn paged_attention_matches_the_cpu_kernel_on_the_cpu_pool_layout() {
    use half::f16;
    use kernels::KvLayout;
    let d = dev();
    let mut rng = SeededRng::new(7);
    let layout = KvLayout {
        n_layers: 2,
        n_kv_heads: 3,
        head_dim: 64,
        block_size: 16,
    };
    let (n_heads, hd, bs) = (9, layout.head_dim, layout.block_size);
    let n_blocks = 16;
    let block_len = layout.block_words() * 2;
    let pool: Vec<f16> = (0..n_blocks * block_len)
        .map(|_| f16::from_f32(rng.f32(-2.0, 2.0)))
        .collect();
    // Two sequences over shuffled blocks: a prompt's last two tokens (a
    // causal prefill chunk) and one decoding token with a longer context.
    let seq_a: Vec<u32> = vec![5, 2, 11];
    let seq_b: Vec<u32> = vec![0, 7, 3, 14, 9, 1, 12];
    let tokens: [(&Vec<u32>, usize, usize); 3] =
        [(&seq_a, 0, 36), (&seq_a, 0, 37), (&seq_b, seq_a.len(), 100)];
    let (layer, scale) = (1, 0.125);
    let q = values(&mut rng, tokens.len() * n_heads * hd, -1.0, 1.0);

    // The CPU kernel over the same pool, one head slice per block.
    let slice = |b: u32, kv: usize, g: usize| {
        let off =
            b as usize * block_len + (layer * 2 + kv) * layout.n_kv_heads * bs * hd + g * bs * hd;
        &pool[off..off + bs * hd]
    };
    // Without a window, and with sliding windows of 20 positions (inside
    // a block: every token's window starts mid-block) and of 40 (wider than
    // the first two tokens' contexts).
    let reference = |window: Option<usize>| {
        let mut want = vec![0.0f32; q.len()];
        let mut scratch = Vec::new();
        for (t, &(table, _, n)) in tokens.iter().enumerate() {
            let first: Vec<usize> = window.map(|w| n.saturating_sub(w)).into_iter().collect();
            for h in 0..n_heads {
                let g = h / (n_heads / layout.n_kv_heads);
                let ks: Vec<&[f16]> = table.iter().map(|&b| slice(b, 0, g)).collect();
                let vs: Vec<&[f16]> = table.iter().map(|&b| slice(b, 1, g)).collect();
                let at = (t * n_heads + h) * hd;
                tandem_kernels::attention::attend_tile(
                    &q[at..at + hd],
                    &first,
                    &[n],
                    &ks,
                    &vs,
                    bs,
                    scale,
                    &mut scratch,
                    &mut want[at..at + hd],
                );
            }
        }
        want
    };

    let bytes: Vec<u8> = pool.iter().flat_map(|h| h.to_le_bytes()).collect();
    let tables: Vec<u32> = seq_a.iter().chain(&seq_b).copied().collect();
    let meta: Vec<u32> = tokens
        .iter()
        .flat_map(|&(_, off, n)| [n as u32, off as u32])
        .collect();
    let max_ctx = 100;
    // Each token's queries at the start of a longer row (a fused QKV row).
    let q_stride = n_heads * hd + 7;
    let q_rows: Vec<f32> = q
        .chunks_exact(n_heads * hd)
        .flat_map(|row| row.iter().copied().chain([9.0; 7]))
        .collect();
    let (qb, pb, tb, mb) = (
        d.upload(&q_rows),
        d.upload_words(&bytes),
        d.upload(&tables),
        d.upload(&meta),
    );
    let (sb, ob) = (d.zeros(q.len() / hd * max_ctx), d.zeros(q.len()));
    let n = tokens.len();
    for window in [None, Some(20), Some(40)] {
        kernels::attention(
            d,
            &qb,
            q_stride,
            &pb,
            &layout,
            layer,
            n_heads,
            &tb,
            &mb,
            0..n,
            max_ctx,
            scale,
            window,
            &sb,
            &ob,
        )
        .expect("launch");
        let got = d.download(&ob).expect("read");
        // In two launches (tokens 0..1, then the rest), reusing the scratch:
        // the same bits.
        let split = d.zeros(ob.len());
        for tokens in [0..1, 1..n] {
            kernels::attention(
                d, &qb, q_stride, &pb, &layout, layer, n_heads, &tb, &mb, tokens, max_ctx, scale,
                window, &sb, &split,
            )
            .expect("launch");
        }
        assert!(d.download(&split).expect("read") == got, "split launches");
        // Same roundings as the CPU (f16 queries and probabilities); the dot
        // products and sums run in another order, and `exp` is the device's.
        let err = worst_rel(&got, &reference(window), 1.0);
        assert!(err <= 1e-4, "window {window:?}: worst error {err}");
    }
}

#[test]
fn kv_write_stores_rows_as_the_cpu_cache_does_bit_for_bit() {
    use half::f16;
    use kernels::KvLayout;
    let d = dev();
    let mut rng = SeededRng::new(8);
    let layout = KvLayout {
        n_layers: 2,
        n_kv_heads: 3,
        head_dim: 64,
        block_size: 16,
    };
    let (kv_dim, bs, hd) = (3 * 64, 16, 64);
    let block_len = layout.block_words() * 2;
    let n_blocks = 4;
    let slots: Vec<u32> = vec![2, 0, 2, 15, 0, 7];
    let mut k = values(&mut rng, 3 * kv_dim, -3.0, 3.0);
    let mut v = values(&mut rng, 3 * kv_dim, -3.0, 3.0);
    // Values at f16's edges: ties, subnormals, overflow, signed zero.
    let edges = [
        1.0 + 1.0 / 2048.0,
        1.0 + 3.0 / 2048.0,
        65504.0,
        65519.0,
        65520.0,
        1e6,
        -0.0,
        6.0e-5,
        3.0e-8,
        2.98e-8,
        -1.0e-7,
        f32::INFINITY,
        1.0e-40,
    ];
    k[..edges.len()].copy_from_slice(&edges);
    v[kv_dim..kv_dim + edges.len()].copy_from_slice(&edges);
    let mut want = vec![f16::ZERO; n_blocks * block_len];
    let layer = 1;
    for (t, s) in slots.chunks_exact(2).enumerate() {
        for (kv, src) in [&k, &v].into_iter().enumerate() {
            for g in 0..3 {
                let off = s[0] as usize * block_len
                    + (layer * 2 + kv) * 3 * bs * hd
                    + g * bs * hd
                    + s[1] as usize * hd;
                for i in 0..hd {
                    want[off + i] = f16::from_f32(src[t * kv_dim + g * hd + i]);
                }
            }
        }
    }
    let pool = d.upload(&vec![0u32; n_blocks * layout.block_words()]);
    // Each token's row: a gap, V, then K (stored from wherever the row
    // says they are).
    let stride = 5 + 2 * kv_dim;
    let rows: Vec<f32> = (0..3)
        .flat_map(|t| {
            let (k, v) = (&k[t * kv_dim..][..kv_dim], &v[t * kv_dim..][..kv_dim]);
            [0.5; 5]
                .into_iter()
                .chain(v.iter().copied())
                .chain(k.iter().copied())
        })
        .collect();
    let at = kernels::KvRows {
        stride,
        k_at: 5 + kv_dim,
        v_at: 5,
    };
    let (rb, sb) = (d.upload(&rows), d.upload(&slots));
    kernels::kv_write(d, &rb, at, &pool, &layout, layer, &sb).expect("launch");
    let got = d.download(&pool).expect("read");
    let want: Vec<u32> = want
        .chunks_exact(2)
        .map(|p| u32::from(p[0].to_bits()) | (u32::from(p[1].to_bits()) << 16))
        .collect();
    let diff = got.iter().zip(&want).position(|(a, b)| a != b);
    assert_eq!(diff, None, "first differing word");
}

#[test]
fn add_bias_adds_the_bias_to_every_row_exactly() {
    let d = dev();
    let mut rng = SeededRng::new(14);
    let (rows, width) = (5, 1152);
    let x = values(&mut rng, rows * width, -4.0, 4.0);
    let bias = values(&mut rng, width, -1.0, 1.0);
    let xb = d.upload(&x);
    kernels::add_bias(d, &xb, &d.upload(&bias)).expect("launch");
    let want: Vec<f32> = x
        .chunks_exact(width)
        .flat_map(|r| r.iter().zip(&bias).map(|(a, b)| a + b))
        .collect();
    assert_eq!(d.download(&xb).expect("read"), want);
    assert!(kernels::add_bias(d, &xb, &d.upload(&[0.0f32; 7])).is_err());
}

#[test]
fn add_is_exact() {
    let d = dev();
    let mut rng = SeededRng::new(9);
    let (a, b) = (
        values(&mut rng, 1000, -5.0, 5.0),
        values(&mut rng, 1000, -5.0, 5.0),
    );
    let (ab, bb) = (d.upload(&a), d.upload(&b));
    kernels::add(d, &ab, &bb).expect("launch");
    let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
    assert_eq!(d.download(&ab).expect("read"), want);
}

#[test]
fn opening_a_device_again_shares_it() {
    let first = dev();
    let again = GpuDevice::open(0).expect("the same device, a second time");
    assert_eq!(again.name(), first.name());
    let (a, b) = (again.upload(&[1.0f32, 2.0]), again.upload(&[3.0f32, 4.0]));
    kernels::add(&again, &a, &b).expect("launch");
    assert_eq!(again.download(&a).expect("read"), vec![4.0, 6.0]);
}

#[test]
fn gather_rows_copies_the_rows_named_and_zeros_for_rows_past_the_source() {
    let d = dev();
    let mut rng = SeededRng::new(11);
    let width = 5;
    let src = values(&mut rng, 7 * width, -3.0, 3.0);
    // Repeats, any order, and one index past the 7 rows (which a device
    // cannot refuse: it reads zeros).
    let rows = [6u32, 0, 3, 3, 7];
    let dst = d.zeros(rows.len() * width);
    kernels::gather_rows(d, &d.upload(&src), &d.upload(&rows), width, &dst).expect("launch");
    let mut want = Vec::new();
    for &r in &rows {
        let r = r as usize;
        match src.get(r * width..(r + 1) * width) {
            Some(row) => want.extend_from_slice(row),
            None => want.extend(std::iter::repeat_n(0.0, width)),
        }
    }
    assert_eq!(d.download(&dst).expect("read"), want);
    // Sizes that do not fit are refused on the host.
    let short = d.zeros(rows.len() * width - 1);
    assert!(kernels::gather_rows(d, &d.upload(&src), &d.upload(&rows), width, &short).is_err());
}
