//! Numerics regression: hashes of matmul outputs for fixed seeded inputs.
//!
//! The expected hashes were computed with the implementation that predates
//! the persistent worker pool and the m = 1 fast path, so any change to the
//! per-element reduction order or to activation quantisation shows up here.
//! Print the current hashes with `TANDEM_PRINT_HASHES=1 cargo test -p
//! tandem-kernels --test regression -- --nocapture`.

use tandem_kernels::{GgmlType, Isa, QMatrix, matmul, matmul_with_isa, quantize_row};

/// The project's one seeded generator (SplitMix64): stable across crate versions.
use tandem_types::SeededRng as Rng;

fn f16_bits(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_bits().to_le_bytes()
}

fn weights(ty: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let rb = ty.row_bytes(cols).expect("aligned");
    let mut data = vec![0u8; rb * rows];
    match ty {
        GgmlType::Q4_K | GgmlType::Q6_K => {
            for b in data.iter_mut() {
                *b = rng.next_u64() as u8;
            }
            for blk in data.chunks_exact_mut(ty.block_bytes()) {
                if ty == GgmlType::Q4_K {
                    blk[0..2].copy_from_slice(&f16_bits(rng.f32(0.0, 0.01)));
                    blk[2..4].copy_from_slice(&f16_bits(rng.f32(0.0, 0.01)));
                } else {
                    blk[208..210].copy_from_slice(&f16_bits(rng.f32(-0.01, 0.01)));
                }
            }
        }
        _ => {
            let x: Vec<f32> = (0..cols).map(|_| 0.0).collect();
            let mut row = x;
            for r in 0..rows {
                for v in row.iter_mut() {
                    *v = rng.f32(-1.0, 1.0);
                }
                quantize_row(ty, &row, &mut data[r * rb..(r + 1) * rb]).expect("quantize");
            }
        }
    }
    data
}

/// Activations with awkward cases mixed in: exact rounding ties, all-zero
/// blocks, large outliers.
fn acts(n: usize, rng: &mut Rng) -> Vec<f32> {
    let mut x: Vec<f32> = (0..n).map(|_| rng.f32(-2.0, 2.0)).collect();
    for (i, v) in x.iter_mut().enumerate() {
        match i % 97 {
            3 => *v = 0.5,
            5 => *v = -1.5,
            7 => *v = 127.0,
            _ => {}
        }
    }
    // One all-zero 32-block and one block whose amax makes ties exact.
    if n >= 96 {
        x[32..64].fill(0.0);
        for (k, v) in x[64..96].iter_mut().enumerate() {
            *v = (k as f32 - 15.5) * (2.0 / 127.0) * 127.0 / 31.0;
        }
    }
    x
}

fn fnv(out: &[f32]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for v in out {
        for b in v.to_bits().to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01B3);
        }
    }
    h
}

const CASES: [(GgmlType, usize, usize); 8] = [
    (GgmlType::F32, 200, 576),
    (GgmlType::F16, 200, 577),
    (GgmlType::BF16, 200, 576),
    (GgmlType::Q4_0, 300, 576),
    (GgmlType::Q4_1, 1536, 576),
    (GgmlType::Q8_0, 1000, 576),
    (GgmlType::Q4_K, 300, 512),
    (GgmlType::Q6_K, 300, 512),
];

const MS: [usize; 5] = [1, 2, 5, 8, 33];

/// (type, m, hash) computed with the original implementation.
const EXPECTED: &[(GgmlType, usize, u64)] = &[
    (GgmlType::F32, 1, 0x8946e377d353406a),
    (GgmlType::F32, 2, 0x10a0cbcafb5f081f),
    (GgmlType::F32, 5, 0x645ce386f0cd255a),
    (GgmlType::F32, 8, 0x579e1bfc50759b8d),
    (GgmlType::F32, 33, 0x7d63985a5e0f0918),
    (GgmlType::F16, 1, 0x9a3d352abd69e120),
    (GgmlType::F16, 2, 0x7b60e52570f78372),
    (GgmlType::F16, 5, 0xb5707b4e88aa1816),
    (GgmlType::F16, 8, 0x14238979282dc49c),
    (GgmlType::F16, 33, 0xc78e67958aa15a15),
    (GgmlType::BF16, 1, 0xdf336492c19127e5),
    (GgmlType::BF16, 2, 0xa8b280853beed589),
    (GgmlType::BF16, 5, 0x7236d9f33fdebd61),
    (GgmlType::BF16, 8, 0x3e0b867ee9d220f5),
    (GgmlType::BF16, 33, 0xc8ce28ea2eb972e2),
    (GgmlType::Q4_0, 1, 0x77bb596d0820b171),
    (GgmlType::Q4_0, 2, 0xe9ad429f93067d8e),
    (GgmlType::Q4_0, 5, 0xeb215fbe058e81b0),
    (GgmlType::Q4_0, 8, 0x79e368f8037ae6ce),
    (GgmlType::Q4_0, 33, 0x870e9b092ac05fe3),
    (GgmlType::Q4_1, 1, 0x2b13b398a20c2833),
    (GgmlType::Q4_1, 2, 0x2fede1a5e03b8c32),
    (GgmlType::Q4_1, 5, 0x89237bd9647face2),
    (GgmlType::Q4_1, 8, 0x625997d7ab6e445b),
    (GgmlType::Q4_1, 33, 0x39b46b11e1c0f716),
    (GgmlType::Q8_0, 1, 0xa7b1bc9f67219f67),
    (GgmlType::Q8_0, 2, 0x72d01c00e7cffc2b),
    (GgmlType::Q8_0, 5, 0xcb7af30070c1cbfc),
    (GgmlType::Q8_0, 8, 0x03469f14ee660c9a),
    (GgmlType::Q8_0, 33, 0x5fccd4e58c3f87f5),
    (GgmlType::Q4_K, 1, 0x04c9c66b590224e0),
    (GgmlType::Q4_K, 2, 0x1fb2fdecaba9a93d),
    (GgmlType::Q4_K, 5, 0x23e93021a821a9a6),
    (GgmlType::Q4_K, 8, 0x871880dc0397c3b6),
    (GgmlType::Q4_K, 33, 0xbe57d15805f18e72),
    (GgmlType::Q6_K, 1, 0x5c5ffc63303acc64),
    (GgmlType::Q6_K, 2, 0xc88811702054c020),
    (GgmlType::Q6_K, 5, 0xa3dcdb46a0045877),
    (GgmlType::Q6_K, 8, 0x51059e9edf51711d),
    (GgmlType::Q6_K, 33, 0x565526896d576c98),
];

fn hashes() -> Vec<(GgmlType, usize, u64)> {
    let mut v = Vec::new();
    // Every ISA this CPU has must be compared (none skipped silently).
    let mut ran = std::collections::BTreeSet::new();
    let mut rng = Rng::new(0x7a6d_656d);
    for (ty, rows, cols) in CASES {
        let data = weights(ty, rows, cols, &mut rng);
        let w = QMatrix::new(ty, &data, rows, cols).expect("shape");
        let x = acts(*MS.iter().max().expect("ms") * cols, &mut rng);
        for m in MS {
            let mut out = vec![f32::NAN; m * rows];
            matmul(&w, &x[..m * cols], m, &mut out).expect("matmul");
            for isa in Isa::ALL.into_iter().filter(|i| *i <= Isa::detected()) {
                if isa == Isa::Scalar && m > 8 {
                    continue;
                }
                let mut o = vec![f32::NAN; m * rows];
                matmul_with_isa(isa, &w, &x[..m * cols], m, &mut o).expect("matmul");
                assert_eq!(fnv(&o), fnv(&out), "{ty:?} m={m} {isa}");
                ran.insert(isa);
            }
            v.push((ty, m, fnv(&out)));
        }
    }
    let ran: Vec<Isa> = ran.into_iter().collect();
    let names: Vec<&str> = ran.iter().map(|i| i.name()).collect();
    use std::io::Write as _;
    // Past the test harness's capture, so that CI logs show it.
    let _ = writeln!(
        std::io::stderr(),
        "tandem-kernels: regression::matmul_outputs_unchanged ran {} (CPU: {})",
        names.join(", "),
        Isa::detected()
    );
    let want: Vec<Isa> = Isa::ALL
        .into_iter()
        .filter(|i| *i <= Isa::detected())
        .collect();
    assert_eq!(ran, want, "ISAs compared vs ISAs this CPU has");
    v
}

#[test]
fn matmul_outputs_unchanged() {
    let got = hashes();
    if std::env::var_os("TANDEM_PRINT_HASHES").is_some() {
        for (ty, m, h) in &got {
            println!("    (GgmlType::{ty:?}, {m}, 0x{h:016x}),");
        }
    }
    assert_eq!(got.len(), EXPECTED.len(), "expected table incomplete");
    for (g, e) in got.iter().zip(EXPECTED) {
        assert_eq!(g, e, "matmul output hash changed");
    }
}
