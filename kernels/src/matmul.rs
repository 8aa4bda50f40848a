//! Quantised matrix × activation products.

use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::cpu::{self, Isa};
use crate::dot;
use crate::error::KernelError;
use crate::pool;
use crate::quant::{self, GgmlType};

/// A row-major weight matrix: `rows` rows of `cols` elements, each row
/// `ty.row_bytes(cols)` bytes, rows contiguous.
#[derive(Clone, Copy, Debug)]
pub struct QMatrix<'a> {
    pub ty: GgmlType,
    pub data: &'a [u8],
    pub rows: usize,
    pub cols: usize,
}

impl<'a> QMatrix<'a> {
    /// Checks that `data` holds exactly `rows` rows of `cols` elements.
    pub fn new(
        ty: GgmlType,
        data: &'a [u8],
        rows: usize,
        cols: usize,
    ) -> Result<Self, KernelError> {
        let m = QMatrix {
            ty,
            data,
            rows,
            cols,
        };
        m.validate()?;
        Ok(m)
    }

    fn validate(&self) -> Result<usize, KernelError> {
        let rb = quant::row_bytes_checked(self.ty, self.cols)?;
        let expected = rb
            .checked_mul(self.rows)
            .ok_or(KernelError::Overflow("matrix bytes"))?;
        if self.data.len() != expected {
            return Err(KernelError::LengthMismatch {
                what: "QMatrix data bytes",
                expected,
                actual: self.data.len(),
            });
        }
        Ok(rb)
    }

    /// Bytes per row.
    pub fn row_bytes(&self) -> usize {
        self.ty.row_bytes(self.cols).unwrap_or(0)
    }

    /// The bytes of row `r`.
    ///
    /// # Panics
    /// If `r >= self.rows` (like slice indexing).
    pub fn row(&self, r: usize) -> &'a [u8] {
        let rb = self.row_bytes();
        &self.data[r * rb..(r + 1) * rb]
    }
}

/// `out[i*w.rows + r] = sum_k w[r,k] * x[i*w.cols + k]` for `i in 0..m`, using
/// the best ISA of this CPU. See [`matmul_with_isa`].
pub fn matmul(w: &QMatrix<'_>, x: &[f32], m: usize, out: &mut [f32]) -> Result<(), KernelError> {
    matmul_with_isa(cpu::isa(), w, x, m, out)
}

/// Weight bytes a task should own when activations are reused across rows.
const TILE_BYTES: usize = 48 * 1024;
/// Below this many multiply-adds the product runs on the calling thread.
const PAR_MIN_WORK: usize = 1 << 16;
/// Activation rows computed against a weight tile per output buffer fill.
const ACT_BLOCK: usize = 64;

/// As [`matmul`], with a forced instruction set (which must not exceed what
/// the CPU supports). Results are bitwise identical for every ISA, every `m`
/// and every thread count.
pub fn matmul_with_isa(
    isa: Isa,
    w: &QMatrix<'_>,
    x: &[f32],
    m: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    matmul_impl(isa, w, x, m, out, pool::num_threads())
}

/// `parts` only shapes the row partition (one contiguous part per pool
/// worker in production); results never depend on it.
fn matmul_impl(
    isa: Isa,
    w: &QMatrix<'_>,
    x: &[f32],
    m: usize,
    out: &mut [f32],
    parts: usize,
) -> Result<(), KernelError> {
    if !isa.is_supported() {
        return Err(KernelError::UnsupportedIsa {
            requested: isa,
            available: cpu::isa(),
        });
    }
    if !w.ty.supports_matmul() {
        return Err(KernelError::UnsupportedType {
            op: "matmul",
            ty: w.ty,
        });
    }
    let row_bytes = w.validate()?;
    let on = check_io(w.rows, w.cols, x.len(), m, out.len())?;
    if on == 0 {
        return Ok(());
    }
    if w.cols == 0 {
        out.fill(0.0);
        return Ok(());
    }

    let work = w.rows.saturating_mul(w.cols).saturating_mul(m);
    let parts = if work >= PAR_MIN_WORK { parts } else { 1 };
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut scratch) => run_parts(isa, w, row_bytes, x, m, out, parts, &mut scratch),
        // Only reachable if a matmul re-entered itself on this thread.
        Err(_) => run_parts(isa, w, row_bytes, x, m, out, parts, &mut Default::default()),
    });
    Ok(())
}

/// Checks that `x` holds `m` rows of `cols` activations and `out` `m` rows
/// of `rows` outputs; returns the output length.
pub(crate) fn check_io(
    rows: usize,
    cols: usize,
    x_len: usize,
    m: usize,
    out_len: usize,
) -> Result<usize, KernelError> {
    let xn = m
        .checked_mul(cols)
        .ok_or(KernelError::Overflow("activation elements"))?;
    if x_len != xn {
        return Err(KernelError::LengthMismatch {
            what: "matmul activations",
            expected: xn,
            actual: x_len,
        });
    }
    let on = m
        .checked_mul(rows)
        .ok_or(KernelError::Overflow("output elements"))?;
    if out_len != on {
        return Err(KernelError::LengthMismatch {
            what: "matmul output",
            expected: on,
            actual: out_len,
        });
    }
    Ok(on)
}

thread_local! {
    /// Quantised activations of the current call (the calling thread's).
    static SCRATCH: RefCell<dot::ActScratch> = RefCell::new(dot::ActScratch::default());
    /// A worker's output tile for batched products.
    static TILE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// A raw output pointer shared by the parts, which write disjoint elements.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: parts write pairwise disjoint elements of the output, and the
// caller of `run_parts` holds the unique borrow until all parts finished.
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// Pointer to element `i` (a method, so closures capture the whole
    /// `Sync` wrapper rather than the raw field).
    fn at(self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

#[allow(clippy::too_many_arguments)]
fn run_parts(
    isa: Isa,
    w: &QMatrix<'_>,
    row_bytes: usize,
    x: &[f32],
    m: usize,
    out: &mut [f32],
    parts: usize,
    scratch: &mut dot::ActScratch,
) {
    // Quantised once, on the calling thread; shared read-only by the parts.
    let acts = dot::prepare_acts(w.ty, x, m, w.cols, scratch);
    let rows = w.rows;
    let groups = rows.div_ceil(4);
    let parts = parts.clamp(1, groups);
    // Rows per weight tile for batches: the tile stays cache-resident while
    // every activation row passes over it.
    let tile_rows = (TILE_BYTES / row_bytes.max(1)).max(4).next_multiple_of(4);
    let op = OutPtr(out.as_mut_ptr());
    let acts = &acts;
    // m = 1: one contiguous range of rows per part (in units of 4 rows), so
    // each thread streams its own slice of the weights.
    let single = |p: usize| {
        let g = pool::split(groups, parts, p);
        let (r0, r1) = (g.start * 4, (g.end * 4).min(rows));
        if r0 >= r1 {
            return;
        }
        // SAFETY: rows r0..r1 of the single output row belong to this part
        // only; `out` has `rows` elements (checked by the caller).
        let o = unsafe { std::slice::from_raw_parts_mut(op.at(r0), r1 - r0) };
        let wblk = &w.data[r0 * row_bytes..r1 * row_bytes];
        let nr = r1 - r0;
        dot::compute_block(isa, w.ty, wblk, row_bytes, nr, w.cols, acts, 0, 1, o, 1);
    };
    // Batches: weight tiles of `tile_rows` rows, claimed dynamically (the
    // machine may be shared, so a static split would wait on the slowest
    // core); each tile's weights stay cache-resident while every activation
    // row passes over them.
    let ntiles = rows.div_ceil(tile_rows);
    let next = AtomicUsize::new(0);
    let tile = |ti: usize, t: &mut Vec<f32>| {
        let t0 = ti * tile_rows;
        let nr = tile_rows.min(rows - t0);
        let wblk = &w.data[t0 * row_bytes..(t0 + nr) * row_bytes];
        t.resize(tile_rows * m.min(ACT_BLOCK), 0.0);
        for i0 in (0..m).step_by(ACT_BLOCK) {
            let n = ACT_BLOCK.min(m - i0);
            let buf = &mut t[..nr * n];
            dot::compute_block(isa, w.ty, wblk, row_bytes, nr, w.cols, acts, i0, n, buf, n);
            for j in 0..n {
                // SAFETY: elements (i0+j, t0..t0+nr) lie inside `out`
                // (m × rows) and tile `ti` is claimed by one worker only.
                let o = unsafe { std::slice::from_raw_parts_mut(op.at((i0 + j) * rows + t0), nr) };
                for (r, v) in o.iter_mut().enumerate() {
                    *v = buf[r * n + j];
                }
            }
        }
    };
    let batched = |_: usize| {
        TILE.with(|t| {
            let mut t = t.borrow_mut();
            loop {
                let ti = next.fetch_add(1, Ordering::Relaxed);
                if ti >= ntiles {
                    break;
                }
                tile(ti, &mut t);
            }
        })
    };
    let part: &(dyn Fn(usize) + Sync) = if m == 1 { &single } else { &batched };
    if parts == 1 {
        part(0);
    } else {
        pool::parallel_for(parts, part);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::IsaCoverage;
    use crate::quant::{self, f32_to_f16_bits};
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    const TYPES: [GgmlType; 9] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
    ];

    /// Random but well-formed weights: finite f16/bf16 scales of moderate
    /// size, arbitrary quant bits.
    fn rand_weights(ty: GgmlType, rows: usize, cols: usize, rng: &mut ChaCha8Rng) -> Vec<u8> {
        let n = rows * cols;
        let rb = ty.row_bytes(cols).expect("aligned");
        let mut data = vec![0u8; rb * rows];
        let h = |rng: &mut ChaCha8Rng, lo: f32, hi: f32| {
            f32_to_f16_bits(rng.random_range(lo..hi)).to_le_bytes()
        };
        match ty {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
                let x: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect();
                quant::quantize_row(ty, &x, &mut data).expect("quantize");
            }
            _ => {
                rng.fill(&mut data[..]);
                for blk in data.chunks_exact_mut(ty.block_bytes()) {
                    match ty {
                        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => {
                            blk[0..2].copy_from_slice(&h(rng, -0.05, 0.05))
                        }
                        GgmlType::Q4_1 => {
                            blk[0..2].copy_from_slice(&h(rng, 0.0, 0.05));
                            blk[2..4].copy_from_slice(&h(rng, -0.4, 0.0));
                        }
                        GgmlType::Q4_K => {
                            blk[0..2].copy_from_slice(&h(rng, 0.0, 0.01));
                            blk[2..4].copy_from_slice(&h(rng, 0.0, 0.01));
                        }
                        GgmlType::Q6_K => blk[208..210].copy_from_slice(&h(rng, -0.01, 0.01)),
                        _ => unreachable!(),
                    }
                    if ty == GgmlType::Q8_0 {
                        // ggml never produces -128 in Q8_0 weights.
                        for q in &mut blk[2..] {
                            if *q == 0x80 {
                                *q = 0x81;
                            }
                        }
                    }
                }
            }
        }
        data
    }

    fn rand_x(n: usize, rng: &mut ChaCha8Rng) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.5f32..1.5)).collect()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|f| f.to_bits()).collect()
    }

    fn run(isa: Isa, w: &QMatrix<'_>, x: &[f32], m: usize) -> Vec<f32> {
        let mut out = vec![f32::NAN; m * w.rows];
        matmul_with_isa(isa, w, x, m, &mut out).expect("matmul");
        out
    }

    /// f64 reference from dequantised weights and dequantised activations.
    fn reference_f64(w: &QMatrix<'_>, x: &[f32], m: usize) -> Vec<f64> {
        let mut wf = vec![0.0f32; w.cols];
        let mut out = vec![0.0f64; m * w.rows];
        let vt = w.ty.vec_dot_type();
        let mut xq = vec![0u8; vt.row_bytes(w.cols).expect("aligned")];
        let mut xf = vec![0.0f32; w.cols];
        for i in 0..m {
            quant::quantize_row(vt, &x[i * w.cols..(i + 1) * w.cols], &mut xq).expect("q");
            quant::dequantize_row(vt, &xq, &mut xf).expect("dq");
            for r in 0..w.rows {
                quant::dequantize_row(w.ty, w.row(r), &mut wf).expect("dq");
                out[i * w.rows + r] = wf.iter().zip(&xf).map(|(&a, &b)| a as f64 * b as f64).sum();
            }
        }
        out
    }

    fn shapes(ty: GgmlType) -> Vec<(usize, usize, usize)> {
        let bl = ty.block_len().max(16);
        let mut v = vec![
            (1, bl, 1),
            (3, bl, 5),
            (7, bl * 3, 0),
            (5, bl * 5, 4),
            (13, bl * 2, 9),
            (1, bl * 9, 33),
            (64, bl * 2, 8),
        ];
        if ty.block_len() == 1 {
            v.push((6, 37, 3)); // tail handling
            v.push((4, 1, 2));
        } else {
            v.push((9, ty.block_len() * 18, 3));
        }
        v
    }

    #[test]
    fn all_isas_match_scalar_bitwise() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let mut cov = IsaCoverage::new("matmul::all_isas_match_scalar_bitwise");
        let isas = cov.isas();
        for ty in TYPES {
            for (rows, cols, m) in shapes(ty) {
                let data = rand_weights(ty, rows, cols, &mut rng);
                let w = QMatrix::new(ty, &data, rows, cols).expect("shape");
                let x = rand_x(m * cols, &mut rng);
                let want = run(Isa::Scalar, &w, &x, m);
                for &isa in &isas {
                    let got = run(isa, &w, &x, m);
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "{ty:?} {isa} rows={rows} cols={cols} m={m}"
                    );
                    cov.ran(isa);
                }
                // Sanity against an f64 reference of the same quantised data.
                let r = reference_f64(&w, &x, m);
                for (g, r) in want.iter().zip(&r) {
                    let tol = 1e-4 * (cols as f64).sqrt() * (1.0 + r.abs());
                    assert!((*g as f64 - r).abs() <= tol, "{ty:?} {g} vs {r}");
                }
            }
        }
    }

    #[test]
    fn batch_invariance() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let mut cov = IsaCoverage::new("matmul::batch_invariance");
        for ty in TYPES {
            let (rows, cols) = (37, ty.block_len().max(32) * 4);
            let data = rand_weights(ty, rows, cols, &mut rng);
            let w = QMatrix::new(ty, &data, rows, cols).expect("shape");
            let m = 19;
            let x = rand_x(m * cols, &mut rng);
            for isa in cov.isas() {
                let all = run(isa, &w, &x, m);
                for i in 0..m {
                    let one = run(isa, &w, &x[i * cols..(i + 1) * cols], 1);
                    assert_eq!(
                        bits(&one),
                        bits(&all[i * rows..(i + 1) * rows]),
                        "{ty:?} {isa} i={i}"
                    );
                }
                // Prefix batches.
                for mm in [2, 4, 5, 8] {
                    let part = run(isa, &w, &x[..mm * cols], mm);
                    assert_eq!(bits(&part), bits(&all[..mm * rows]), "{ty:?} {isa} m={mm}");
                }
                cov.ran(isa);
            }
        }
    }

    #[test]
    fn large_parallel_is_deterministic() {
        // Big enough to take the parallel path; compare with the scalar ISA
        // and against m=1 rows.
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        for ty in [GgmlType::Q4_1, GgmlType::Q8_0] {
            let (rows, cols, m) = (300, 576, 6);
            let data = rand_weights(ty, rows, cols, &mut rng);
            let w = QMatrix::new(ty, &data, rows, cols).expect("shape");
            let x = rand_x(m * cols, &mut rng);
            let a = run(cpu::isa(), &w, &x, m);
            let b = run(Isa::Scalar, &w, &x, m);
            assert_eq!(bits(&a), bits(&b));
            let last = run(cpu::isa(), &w, &x[(m - 1) * cols..], 1);
            assert_eq!(bits(&last), bits(&a[(m - 1) * rows..]));
        }
    }

    #[test]
    fn thread_partition_invariance() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let mut cov = IsaCoverage::new("matmul::thread_partition_invariance");
        for ty in TYPES {
            let (rows, cols, m) = (203, ty.block_len().max(32) * 12, 5);
            let data = rand_weights(ty, rows, cols, &mut rng);
            let w = QMatrix::new(ty, &data, rows, cols).expect("shape");
            let x = rand_x(m * cols, &mut rng);
            for isa in cov.isas() {
                let mut base = vec![0.0f32; m * rows];
                matmul_impl(isa, &w, &x, m, &mut base, 1).expect("matmul");
                for threads in [2, 3, 7, 64] {
                    for mm in [1, m] {
                        let mut o = vec![0.0f32; mm * rows];
                        matmul_impl(isa, &w, &x[..mm * cols], mm, &mut o, threads).expect("matmul");
                        assert_eq!(
                            bits(&o),
                            bits(&base[..mm * rows]),
                            "{ty:?} {isa} t={threads} m={mm}"
                        );
                    }
                }
                cov.ran(isa);
            }
        }
    }

    #[test]
    fn matmul_inside_parallel_for_and_concurrently() {
        // Nested use runs inline; concurrent callers fall back to inline
        // execution. Both must give the same bits as a plain call.
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        let (rows, cols) = (257, 576);
        let data = rand_weights(GgmlType::Q4_1, rows, cols, &mut rng);
        let w = QMatrix::new(GgmlType::Q4_1, &data, rows, cols).expect("shape");
        let x = rand_x(8 * cols, &mut rng);
        let want: Vec<Vec<u32>> = [1, 8]
            .iter()
            .map(|&m| bits(&run(cpu::isa(), &w, &x[..m * cols], m)))
            .collect();
        pool::parallel_for(4, &|i| {
            let m = if i % 2 == 0 { 1 } else { 8 };
            let got = run(cpu::isa(), &w, &x[..m * cols], m);
            assert_eq!(bits(&got), want[i % 2]);
        });
        std::thread::scope(|s| {
            for t in 0..3 {
                let (w, x, want) = (&w, &x, &want);
                s.spawn(move || {
                    for k in 0..20 {
                        let m = if (t + k) % 2 == 0 { 1 } else { 8 };
                        let got = run(cpu::isa(), w, &x[..m * cols], m);
                        assert_eq!(bits(&got), want[(t + k) % 2]);
                    }
                });
            }
        });
    }

    #[test]
    fn bad_inputs_return_errors() {
        let data = vec![0u8; 20 * 2 * 3];
        let w = QMatrix::new(GgmlType::Q4_1, &data, 3, 64).expect("shape");
        let x = vec![0.0f32; 64 * 2];
        let mut out = vec![0.0f32; 3 * 2];
        assert!(matmul(&w, &x, 2, &mut out).is_ok());
        assert!(matmul(&w, &x[1..], 2, &mut out).is_err());
        assert!(matmul(&w, &x, 2, &mut out[1..]).is_err());
        assert!(matmul(&w, &x, 3, &mut out).is_err());
        assert!(matmul(&w, &x, usize::MAX, &mut out).is_err());
        assert!(QMatrix::new(GgmlType::Q4_1, &data, 3, 65).is_err());
        assert!(QMatrix::new(GgmlType::Q4_1, &data, 4, 64).is_err());
        assert!(QMatrix::new(GgmlType::Q4_1, &data[1..], 3, 64).is_err());
        // Inconsistent hand-built matrix.
        let bad = QMatrix {
            ty: GgmlType::Q4_1,
            data: &data,
            rows: 2,
            cols: 64,
        };
        assert!(matmul(&bad, &x, 2, &mut out[..4]).is_err());
        let k = QMatrix::new(GgmlType::Q8_K, &[0u8; 292], 1, 256).expect("shape");
        assert!(matches!(
            matmul(&k, &[0.0; 256], 1, &mut [0.0]),
            Err(KernelError::UnsupportedType { .. })
        ));
        // Empty shapes.
        let e = QMatrix::new(GgmlType::Q4_1, &[], 0, 64).expect("shape");
        assert!(matmul(&e, &x, 2, &mut []).is_ok());
        assert!(matmul(&w, &[], 0, &mut []).is_ok());
        let z = QMatrix::new(GgmlType::F32, &[], 3, 0).expect("shape");
        let mut o = vec![1.0; 6];
        matmul(&z, &[], 2, &mut o).expect("zero cols");
        assert_eq!(o, vec![0.0; 6]);
        assert_eq!(w.row(1).len(), 40);
    }

    #[test]
    fn isa_and_threads() {
        let best = cpu::isa();
        assert!(best.is_supported());
        assert!(!best.to_string().is_empty());
        assert!(pool::num_threads() >= 1);
        assert!(pool::set_num_threads(0).is_err());
        let n = pool::num_threads();
        assert!(pool::set_num_threads(n).is_ok());
        assert!(pool::set_num_threads(n + 1).is_err());
        if best < Isa::Avx512Vnni {
            let data = vec![0u8; 20];
            let w = QMatrix::new(GgmlType::Q4_1, &data, 1, 32).expect("shape");
            assert!(matmul_with_isa(Isa::Avx512Vnni, &w, &[0.0; 32], 1, &mut [0.0]).is_err());
        }
    }

    #[test]
    fn known_small_product() {
        // Q8_0 weights with d = 1 and qs = k - 16; activations all 1.0 quantise
        // to d = 1/127 (f16), q = 127.
        let mut blk = f32_to_f16_bits(1.0).to_le_bytes().to_vec();
        blk.extend((0..32).map(|k| (k as i8 - 16) as u8));
        let w = QMatrix::new(GgmlType::Q8_0, &blk, 1, 32).expect("shape");
        let x = vec![1.0f32; 32];
        let mut out = [0.0f32];
        let mut cov = IsaCoverage::new("matmul::known_small_product");
        for isa in cov.isas() {
            matmul_with_isa(isa, &w, &x, 1, &mut out).expect("matmul");
            let d = quant::f16_bits_to_f32(f32_to_f16_bits(1.0 / 127.0));
            let want = (0..32).map(|k| (k - 16) * 127).sum::<i32>() as f32 * d;
            assert!((out[0] - want).abs() < 1e-3, "{isa}: {} vs {want}", out[0]);
            cov.ran(isa);
        }
        // F32 exact small product.
        let wf: Vec<u8> = [1.0f32, 2.0, 3.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let w = QMatrix::new(GgmlType::F32, &wf, 1, 3).expect("shape");
        matmul(&w, &[4.0, 5.0, 6.0], 1, &mut out).expect("matmul");
        assert_eq!(out[0], 32.0);
    }
}
