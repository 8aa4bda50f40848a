//! Contention-robust matmul timing: best of many runs, single thread.
//! `cargo bench -p tandem-kernels --bench quick` (`TANDEM_QUICK=packed`
//! runs only the ggml-order vs packed comparison).

use std::hint::black_box;
use std::time::Instant;

use tandem_kernels::{
    GgmlType, Isa, PackedMatrix, QMatrix, matmul_packed_with_isa, matmul_with_isa,
};

/// Best time of `f` over a budget (at least 3 runs).
fn best_of(budget: std::time::Duration, mut f: impl FnMut()) -> f64 {
    let start = Instant::now();
    let mut best = f64::MAX;
    let mut iters = 0;
    while start.elapsed() < budget || iters < 3 {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
        iters += 1;
    }
    best
}

/// The ggml-order kernels against the packed ones on the new models'
/// shapes (rows x cols), best ISA, GFLOP/s (2 flops per multiply-add).
fn packed_vs_generic() {
    let isa = tandem_kernels::isa();
    for (ty, rows, cols) in [
        (GgmlType::Q5_0, 4864, 896),
        (GgmlType::Q6_K, 896, 4864),
        (GgmlType::Q4_K, 896, 4864),
        (GgmlType::Q4_0, 4864, 896),
    ] {
        let bytes = ty.row_bytes(cols).expect("aligned") * rows;
        let mut data: Vec<u8> = (0..bytes)
            .map(|i| ((i * 2654435761usize) >> 7) as u8)
            .collect();
        for blk in data.chunks_exact_mut(ty.block_bytes()) {
            let d = if ty == GgmlType::Q6_K { 208 } else { 0 };
            blk[d..d + 2].copy_from_slice(&0x211Eu16.to_le_bytes());
        }
        let w = QMatrix::new(ty, &data, rows, cols).expect("shape");
        let p = PackedMatrix::pack_any_cpu(&w).expect("a packed type");
        for m in [1usize, 8, 32, 512] {
            let x: Vec<f32> = (0..m * cols)
                .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
                .collect();
            let mut out = vec![0.0f32; m * rows];
            let budget = std::time::Duration::from_millis(if m >= 512 { 1500 } else { 500 });
            let g = best_of(budget, || {
                matmul_with_isa(isa, &w, black_box(&x), m, &mut out).expect("matmul");
                black_box(&out);
            });
            let pk = best_of(budget, || {
                matmul_packed_with_isa(isa, &p, black_box(&x), m, &mut out).expect("matmul");
                black_box(&out);
            });
            let gf = |t: f64| 2.0 * (rows * cols * m) as f64 / t / 1e9;
            println!(
                "{ty:>5} {rows:>5}x{cols:<5} m={m:<4} {isa:<11} generic {:>9.1} us {:>7.2} GFLOP/s  packed {:>9.1} us {:>7.2} GFLOP/s  x{:.2}",
                g * 1e6,
                gf(g),
                pk * 1e6,
                gf(pk),
                g / pk
            );
        }
    }
}

fn main() {
    tandem_kernels::set_num_threads(1).expect("thread pool");
    packed_vs_generic();
    if std::env::var("TANDEM_QUICK").is_ok_and(|v| v == "packed") {
        return;
    }
    let cases = [
        (GgmlType::Q4_1, 1536, 576),
        (GgmlType::Q4_1, 576, 1536),
        (GgmlType::Q8_0, 49152, 576),
        (GgmlType::Q4_0, 1536, 576),
        (GgmlType::Q5_0, 1536, 576),
        (GgmlType::Q4_K, 1536, 768),
        (GgmlType::Q6_K, 1536, 768),
        (GgmlType::F16, 1536, 576),
        (GgmlType::F32, 1536, 576),
    ];
    for (ty, rows, cols) in cases {
        let bytes = ty.row_bytes(cols).expect("aligned") * rows;
        let mut data: Vec<u8> = (0..bytes)
            .map(|i| ((i * 2654435761usize) >> 7) as u8)
            .collect();
        if matches!(ty, GgmlType::F16 | GgmlType::F32) {
            data.fill(0x3c);
        } else {
            for blk in data.chunks_exact_mut(ty.block_bytes()) {
                let d = if ty == GgmlType::Q6_K { 208 } else { 0 };
                blk[d..d + 2].copy_from_slice(&0x211Eu16.to_le_bytes());
            }
        }
        let w = QMatrix::new(ty, &data, rows, cols).expect("shape");
        for m in [1usize, 32] {
            let x: Vec<f32> = (0..m * cols)
                .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
                .collect();
            let mut out = vec![0.0f32; m * rows];
            for isa in Isa::ALL.into_iter().filter(|i| i.is_supported()) {
                if isa == Isa::Scalar && (m > 1 || rows > 2000) {
                    continue;
                }
                let budget = std::time::Duration::from_millis(if m == 1 { 300 } else { 600 });
                let start = Instant::now();
                let mut best = f64::MAX;
                let mut iters = 0;
                while start.elapsed() < budget || iters < 3 {
                    let t = Instant::now();
                    matmul_with_isa(isa, &w, black_box(&x), m, &mut out).expect("matmul");
                    black_box(&out);
                    best = best.min(t.elapsed().as_secs_f64());
                    iters += 1;
                }
                let gbs = bytes as f64 / best / 1e9;
                let gmacs = (rows * cols * m) as f64 / best / 1e9;
                println!(
                    "{ty:>5} {rows:>6}x{cols:<5} m={m:<3} {isa:<11} best {:>9.1} us  {gbs:>7.2} GB/s weights  {gmacs:>7.2} GMAC/s",
                    best * 1e6
                );
            }
        }
    }
}
