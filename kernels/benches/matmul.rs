//! Matmul throughput: Q4_1 576x1536 and Q8_0 49152x576 at m = 1 and m = 32,
//! Q5_0 4864x896 and Q6_K 896x4864 (rows x cols) at m = 1, 8, 32, 512,
//! single thread (set TANDEM_BENCH_THREADS to change), reported as weight
//! bytes per second: the ggml-order kernels (`generic`) and the packed ones
//! (`packed`), for every ISA this CPU has.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use tandem_kernels::{
    GgmlType, Isa, PackedMatrix, QMatrix, matmul_packed_with_isa, matmul_with_isa,
};

fn weights(ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let bytes = ty.row_bytes(cols).expect("aligned") * rows;
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut data: Vec<u8> = (0..bytes)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect();
    // Sane f16 scales (0.01) where each block keeps them.
    for blk in data.chunks_exact_mut(ty.block_bytes()) {
        let d = if ty == GgmlType::Q6_K { 208 } else { 0 };
        blk[d..d + 2].copy_from_slice(&0x211Eu16.to_le_bytes());
        if matches!(ty, GgmlType::Q4_1 | GgmlType::Q4_K) {
            blk[2..4].copy_from_slice(&0xA11Eu16.to_le_bytes());
        }
    }
    data
}

fn bench(c: &mut Criterion) {
    let threads = std::env::var("TANDEM_BENCH_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    tandem_kernels::set_num_threads(threads).expect("thread pool");
    let mut g = c.benchmark_group("matmul");
    g.measurement_time(Duration::from_secs(3));
    g.warm_up_time(Duration::from_millis(500));
    let cases: [(GgmlType, usize, usize, &[usize]); 5] = [
        (GgmlType::Q4_1, 1536, 576, &[1, 32]),
        (GgmlType::Q4_1, 576, 1536, &[1, 32]),
        (GgmlType::Q8_0, 49152, 576, &[1, 32]),
        (GgmlType::Q5_0, 4864, 896, &[1, 8, 32, 512]),
        (GgmlType::Q6_K, 896, 4864, &[1, 8, 32, 512]),
    ];
    for (ty, rows, cols, ms) in cases {
        let data = weights(ty, rows, cols);
        let w = QMatrix::new(ty, &data, rows, cols).expect("shape");
        let packed = PackedMatrix::pack_any_cpu(&w).expect("a packed type");
        for &m in ms {
            let x: Vec<f32> = (0..m * cols)
                .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
                .collect();
            let mut out = vec![0.0f32; m * rows];
            for isa in Isa::ALL
                .into_iter()
                .filter(|i| i.is_supported() && *i != Isa::Scalar)
            {
                g.throughput(Throughput::Bytes(data.len() as u64));
                g.bench_function(
                    format!("{ty}_{rows}x{cols}_m{m}_{isa}_generic_t{threads}"),
                    |b| {
                        b.iter(|| {
                            matmul_with_isa(isa, &w, black_box(&x), m, &mut out).expect("matmul");
                            black_box(&out);
                        })
                    },
                );
                g.bench_function(
                    format!("{ty}_{rows}x{cols}_m{m}_{isa}_packed_t{threads}"),
                    |b| {
                        b.iter(|| {
                            matmul_packed_with_isa(isa, &packed, black_box(&x), m, &mut out)
                                .expect("matmul");
                            black_box(&out);
                        })
                    },
                );
            }
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
