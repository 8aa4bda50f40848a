//! Contention-robust matmul timing: best of many runs, single thread.
//! `cargo bench -p tandem-kernels --bench quick`

use std::hint::black_box;
use std::time::Instant;

use tandem_kernels::{GgmlType, Isa, QMatrix, matmul_with_isa};

fn main() {
    tandem_kernels::set_num_threads(1).expect("thread pool");
    let cases = [
        (GgmlType::Q4_1, 1536, 576),
        (GgmlType::Q4_1, 576, 1536),
        (GgmlType::Q8_0, 49152, 576),
        (GgmlType::Q4_0, 1536, 576),
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
                blk[0..2].copy_from_slice(&0x211Eu16.to_le_bytes());
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
