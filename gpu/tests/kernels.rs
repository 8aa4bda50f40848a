//! Every GPU kernel against the CPU reference in `tandem-kernels`, on the
//! first Vulkan device (lavapipe on machines without a GPU; the test
//! command installs it). Tolerances are stated per kernel.

use std::sync::OnceLock;

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
        kernels::add_rms_norm(d, &xb, &db, &wb, 1e-5, &ob).expect("launch");
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
fn swiglu_matches_the_cpu_within_1e_6_relative() {
    let d = dev();
    let mut rng = SeededRng::new(2);
    // (tokens, ffn): rows of [gate | up], as one matmul over both writes.
    for (n, ffn) in [(1, 1), (3, 21), (2, 1536)] {
        let gate = values(&mut rng, n * ffn, -8.0, 8.0);
        let up = values(&mut rng, n * ffn, -2.0, 2.0);
        let mut want = gate.clone();
        tandem_kernels::ops::silu_mul(&mut want, &up);
        let rows: Vec<f32> = gate
            .chunks_exact(ffn)
            .zip(up.chunks_exact(ffn))
            .flat_map(|(g, u)| g.iter().chain(u).copied())
            .collect();
        let out = d.zeros(n * ffn);
        kernels::swiglu(d, &d.upload(&rows), ffn, &out).expect("launch");
        let got = d.download(&out).expect("read");
        let err = worst_rel(&got, &want, 1e-6);
        assert!(err <= 1e-6, "{n}x{ffn}: worst relative error {err}");
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

#[test]
fn a_token_s_matmul_row_is_bitwise_the_same_in_any_batch() {
    // Tokens share weight loads in tiles of up to 8, but each token's sum
    // runs in the one-token order: batching must not change a bit (the
    // scheduler's batches give what a lone sequence gets).
    let d = dev();
    let mut rng = SeededRng::new(12);
    let (rows, cols, n_tok) = (24, 576, 13);
    let x = values(&mut rng, n_tok * cols, -1.0, 1.0);
    let wf = values(&mut rng, rows * cols, -1.0, 1.0);
    let q: Vec<u8> = (0..rows * cols / 32 * 20)
        .map(|_| (rng.next_u64() % 256) as u8)
        .map(|b| b & 0x7b) // small f16 scales and mins, no NaNs
        .collect();
    let (wq, wb) = (d.upload_words(&q), d.upload(&wf));
    let all = |f32_weights: bool| {
        let ob = d.zeros(n_tok * rows);
        if f32_weights {
            kernels::matmul(d, &d.upload(&x), &wb, cols, &ob).expect("launch");
        } else {
            kernels::matmul_q4_1(d, &d.upload(&x), &wq, rows, cols, &ob).expect("launch");
        }
        d.download(&ob).expect("read")
    };
    for f32_weights in [true, false] {
        let batch = all(f32_weights);
        for (t, row) in x.chunks_exact(cols).enumerate() {
            let ob = d.zeros(rows);
            if f32_weights {
                kernels::matmul(d, &d.upload(row), &wb, cols, &ob).expect("launch");
            } else {
                kernels::matmul_q4_1(d, &d.upload(row), &wq, rows, cols, &ob).expect("launch");
            }
            let alone = d.download(&ob).expect("read");
            assert!(
                alone == batch[t * rows..(t + 1) * rows],
                "token {t} (f32 weights: {f32_weights})"
            );
        }
    }
}

#[test]
fn q4_1_matmul_matches_the_dequantised_weights_within_1e_5() {
    use tandem_kernels::{GgmlType, dequantize_row, quantize_row};
    let d = dev();
    let mut rng = SeededRng::new(5);
    for (n_tok, rows, cols) in [(1, 48, 576), (4, 130, 64), (13, 24, 576)] {
        let x = values(&mut rng, n_tok * cols, -1.0, 1.0);
        let wf = values(&mut rng, rows * cols, -1.0, 1.0);
        let row_bytes = GgmlType::Q4_1.row_bytes(cols).expect("whole blocks");
        let mut q = vec![0u8; rows * row_bytes];
        let mut deq = vec![0.0f32; rows * cols];
        for ((src, dst), back) in wf
            .chunks_exact(cols)
            .zip(q.chunks_exact_mut(row_bytes))
            .zip(deq.chunks_exact_mut(cols))
        {
            quantize_row(GgmlType::Q4_1, src, dst).expect("quantise");
            dequantize_row(GgmlType::Q4_1, dst, back).expect("dequantise");
        }
        let want = reference_matmul(&x, &deq, cols);
        let (xb, wb, ob) = (d.upload(&x), d.upload_words(&q), d.zeros(n_tok * rows));
        kernels::matmul_q4_1(d, &xb, &wb, rows, cols, &ob).expect("launch");
        let got = d.download(&ob).expect("read");
        let err = worst_rel(&got, &want, (cols as f32).sqrt());
        assert!(err <= 1e-5, "{n_tok}x{rows}x{cols}: worst error {err}");
    }
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
fn mismatched_shapes_are_errors_not_launches() {
    let d = dev();
    let (a, b) = (d.upload(&[1.0f32; 6]), d.upload(&[1.0f32; 4]));
    let out = d.zeros(6);
    let err = kernels::rms_norm(d, &a, &b, 1e-5, &out).expect_err("6 is not rows of 4");
    assert!(err.to_string().contains("rms_norm"), "{err}");
    assert!(kernels::swiglu(d, &a, 4, &b).is_err());
    assert!(kernels::copy(d, &a, &b).is_err());
    assert!(kernels::matmul(d, &a, &b, 4, &out).is_err());
    let w = d.upload(&[0u32; 9]);
    assert!(kernels::matmul_q4_1(d, &a, &w, 1, 32, &out).is_err());
    let idx = d.upload(&[0u32; 2]);
    assert!(kernels::argmax(d, &a, 4, &idx).is_err());
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
    let tokens = [(&seq_a, 0, 36), (&seq_a, 0, 37), (&seq_b, seq_a.len(), 100)];
    let (layer, scale) = (1, 0.125);
    let q = values(&mut rng, tokens.len() * n_heads * hd, -1.0, 1.0);

    // The CPU kernel over the same pool, one head slice per block.
    let slice = |b: u32, kv: usize, g: usize| {
        let off =
            b as usize * block_len + (layer * 2 + kv) * layout.n_kv_heads * bs * hd + g * bs * hd;
        &pool[off..off + bs * hd]
    };
    let mut want = vec![0.0f32; q.len()];
    let mut scratch = Vec::new();
    for (t, &(table, _, n)) in tokens.iter().enumerate() {
        for h in 0..n_heads {
            let g = h / (n_heads / layout.n_kv_heads);
            let ks: Vec<&[f16]> = table.iter().map(|&b| slice(b, 0, g)).collect();
            let vs: Vec<&[f16]> = table.iter().map(|&b| slice(b, 1, g)).collect();
            let at = (t * n_heads + h) * hd;
            tandem_kernels::attention::attend(
                &q[at..at + hd],
                &ks,
                &vs,
                bs,
                n,
                scale,
                &mut scratch,
                &mut want[at..at + hd],
            );
        }
    }

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
            d, &qb, q_stride, &pb, &layout, layer, n_heads, &tb, &mb, tokens, max_ctx, scale, &sb,
            &split,
        )
        .expect("launch");
    }
    assert!(d.download(&split).expect("read") == got, "split launches");
    // Same roundings as the CPU (f16 queries and probabilities); the dot
    // products and sums run in another order, and `exp` is the device's.
    let err = worst_rel(&got, &want, 1.0);

    assert!(err <= 1e-4, "worst error {err}");
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
