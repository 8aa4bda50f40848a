//! Attention over a paged f16 context: decode steps (one token, a GQA
//! group of query heads) and prompt tiles (8 or 16 tokens x the group),
//! single thread, best of many runs (contention-robust).
//!
//! `cargo bench -p tandem-kernels --bench attention`

use std::hint::black_box;
use std::time::{Duration, Instant};

use half::f16;
use tandem_kernels::attention::attend_tile;

fn best_of(budget: Duration, mut f: impl FnMut()) -> f64 {
    let start = Instant::now();
    let mut best = f64::MAX;
    let mut iters = 0;
    while start.elapsed() < budget || iters < 5 {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
        iters += 1;
    }
    best
}

fn main() {
    println!("kernels: {}", tandem_kernels::isa());
    let bs = 16;
    // (head_dim, queries per KV head, context, tokens): SmolLM2 (3), Qwen2.5-0.5B (7), Gemma 3 (4).
    for &(hd, group, ctx, toks) in &[
        (64usize, 3usize, 256usize, 1usize),
        (64, 3, 1024, 1),
        (64, 7, 256, 1),
        (256, 4, 256, 1),
        (64, 3, 512, 8),
        (64, 3, 512, 16),
        (64, 3, 256, 8),
    ] {
        let nb = ctx.div_ceil(bs);
        let mk = |salt: usize| -> Vec<Vec<f16>> {
            (0..nb)
                .map(|b| {
                    (0..bs * hd)
                        .map(|i| {
                            f16::from_f32(
                                (((b * bs * hd + i + salt) * 7919) % 997) as f32 / 498.0 - 1.0,
                            )
                        })
                        .collect()
                })
                .collect()
        };
        let (kd, vd) = (mk(1), mk(2));
        let kb: Vec<&[f16]> = kd.iter().map(|b| &b[..]).collect();
        let vb: Vec<&[f16]> = vd.iter().map(|b| &b[..]).collect();
        let nq = group * toks;
        let qs: Vec<f32> = (0..nq * hd)
            .map(|i| ((i * 31) % 101) as f32 / 50.0 - 1.0)
            .collect();
        let n_ctx: Vec<usize> = (0..toks)
            .flat_map(|t| std::iter::repeat_n(ctx - toks + 1 + t, group))
            .collect();
        let mut scratch = Vec::new();
        let mut out = vec![0.0f32; nq * hd];
        let secs = best_of(Duration::from_millis(700), || {
            attend_tile(
                black_box(&qs),
                &[],
                &n_ctx,
                &kb,
                &vb,
                bs,
                0.125,
                &mut scratch,
                &mut out,
            );
            black_box(&out);
        });
        let macs: usize = n_ctx.iter().map(|&n| 2 * n * hd).sum();
        println!(
            "attend hd={hd:<3} queries={group}x{toks} ctx={ctx:<5} {:>8.2} us {:>6.2} GMAC/s",
            secs * 1e6,
            macs as f64 / secs / 1e9
        );
    }
}
