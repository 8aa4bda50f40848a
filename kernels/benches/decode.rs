//! Memory-bandwidth probe plus cold-weight (m = 1) and batched matmul
//! throughput, best of N (the machine is shared, so minima are what count).
//!
//! `TANDEM_THREADS=2 cargo bench -p tandem-kernels --bench decode`
//! (`TANDEM_BENCH=membw|cold|batch|peak|tiles` runs one section). `peak`
//! measures the core's `vpdpbusd` throughput, the ceiling of the packed
//! kernels; `batch` reports the generic and packed matmuls against it;
//! `tiles` (not in the default run) times the packed kernels on one thread
//! in thread CPU time, for A/B comparisons on a shared machine.
//! `TANDEM_CPU_ISA=avx2` (or `scalar`) measures a smaller ISA's kernels.

use std::hint::black_box;
use std::time::{Duration, Instant};

use tandem_kernels::{GgmlType, PackedMatrix, QMatrix, matmul, matmul_packed};

fn best_of(budget: Duration, min_iters: usize, mut f: impl FnMut()) -> f64 {
    let start = Instant::now();
    let mut best = f64::MAX;
    let mut iters = 0;
    while start.elapsed() < budget || iters < min_iters {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
        iters += 1;
    }
    best
}

/// Sums `v` with 8 independent u64 accumulators (vectorises; memory bound).
fn sum(v: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    for c in v.chunks_exact(8) {
        for (a, x) in acc.iter_mut().zip(c) {
            *a = a.wrapping_add(*x);
        }
    }
    acc.iter().fold(0, |a, &b| a.wrapping_add(b))
}

fn membw() {
    let threads = tandem_kernels::num_threads();
    for mb in [64usize, 256, 1024] {
        let n = mb * 1024 * 1024 / 8;
        let v: Vec<u64> = (0..n as u64).collect();
        for t in [1, threads] {
            let total = std::sync::atomic::AtomicU64::new(0);
            let secs = best_of(Duration::from_millis(1500), 3, || {
                if t == 1 {
                    total.fetch_add(sum(black_box(&v)), std::sync::atomic::Ordering::Relaxed);
                } else {
                    // Plain scoped threads, so the probe measures the
                    // machine rather than the pool.
                    std::thread::scope(|sc| {
                        for s in v.chunks(n.div_ceil(t)) {
                            let total = &total;
                            sc.spawn(move || {
                                total.fetch_add(
                                    sum(black_box(s)),
                                    std::sync::atomic::Ordering::Relaxed,
                                );
                            });
                        }
                    });
                }
            });
            black_box(total.into_inner());
            println!(
                "membw {mb:>5} MB  threads={t}  {:>6.2} GB/s",
                (n * 8) as f64 / secs / 1e9
            );
        }
    }
}

fn weights(ty: GgmlType, rows: usize, cols: usize, salt: usize) -> Vec<u8> {
    let bytes = ty.row_bytes(cols).expect("aligned") * rows;
    let mut data: Vec<u8> = (0..bytes)
        .map(|i| (((i + salt) * 2654435761usize) >> 7) as u8)
        .collect();
    // Finite scales: `d` (Q6_K's sits after its quants), and Q4_1's `m` /
    // Q4_K's `dmin`.
    let d = if ty == GgmlType::Q6_K { 208 } else { 0 };
    for blk in data.chunks_exact_mut(ty.block_bytes()) {
        blk[d..d + 2].copy_from_slice(&0x211Eu16.to_le_bytes());
        if matches!(ty, GgmlType::Q4_1 | GgmlType::Q4_K) {
            blk[2..4].copy_from_slice(&0xA11Eu16.to_le_bytes());
        }
    }
    data
}

fn acts(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
        .collect()
}

/// m = 1 over copies of the matrix totalling ~768 MB (beyond the L3), so
/// every call streams its weights from DRAM; plus the cache-hot figure.
fn cold() {
    for (ty, rows, cols) in [
        (GgmlType::Q4_1, 1536, 576),
        (GgmlType::Q4_1, 576, 1536),
        (GgmlType::Q8_0, 49152, 576),
        // Qwen2.5-0.5B's Q4_K_M: FFN gate/up, down (Q4_K or Q6_K).
        (GgmlType::Q5_0, 4864, 896),
        (GgmlType::Q4_K, 896, 4864),
        (GgmlType::Q6_K, 896, 4864),
    ] {
        let bytes = ty.row_bytes(cols).expect("aligned") * rows;
        let copies = (768 << 20) / bytes + 1;
        let data: Vec<Vec<u8>> = (0..copies).map(|c| weights(ty, rows, cols, c)).collect();
        let ws: Vec<QMatrix<'_>> = data
            .iter()
            .map(|d| QMatrix::new(ty, d, rows, cols).expect("shape"))
            .collect();
        let x = acts(cols);
        let mut out = vec![0.0f32; rows];
        let report = |kind: &str, f: &mut dyn FnMut(usize)| {
            let mut k = 0;
            let cold = best_of(Duration::from_millis(1500), 20, || {
                k = (k + 1) % copies;
                f(k);
            });
            let hot = best_of(Duration::from_millis(500), 20, || f(0));
            println!(
                "m=1 {ty:>5} {rows:>6}x{cols:<5} threads={} {kind:>7}  cold {:>8.1} us {:>6.2} GB/s   hot {:>8.1} us {:>6.2} GB/s",
                tandem_kernels::num_threads(),
                cold * 1e6,
                bytes as f64 / cold / 1e9,
                hot * 1e6,
                bytes as f64 / hot / 1e9
            );
        };
        report("generic", &mut |k| {
            matmul(&ws[k], black_box(&x), 1, &mut out).expect("matmul");
        });
        let packed: Option<Vec<PackedMatrix>> = ws.iter().map(PackedMatrix::pack).collect();
        if let Some(ps) = packed {
            drop(data);
            report("packed", &mut |k| {
                matmul_packed(&ps[k], black_box(&x), 1, &mut out).expect("matmul");
            });
        }
    }
}

fn batch() {
    let peak = vnni_peak_gmacs().map(|p| p * tandem_kernels::num_threads() as f64);
    for (ty, rows, cols) in [
        (GgmlType::Q4_1, 3072, 576),
        (GgmlType::Q4_1, 1536, 576),
        (GgmlType::Q4_1, 576, 1536),
        (GgmlType::Q8_0, 49152, 576),
    ] {
        let data = weights(ty, rows, cols, 0);
        let w = QMatrix::new(ty, &data, rows, cols).expect("shape");
        let packed = PackedMatrix::pack(&w);
        for m in [8usize, 32, 128, 512] {
            let x = acts(m * cols);
            let mut out = vec![0.0f32; m * rows];
            let budget = Duration::from_millis(if rows * m > 1 << 24 { 3000 } else { 800 });
            let macs = (rows * cols * m) as f64;
            let generic = best_of(budget, 3, || {
                matmul(&w, black_box(&x), m, &mut out).expect("matmul");
            });
            let mut line = format!(
                "batch {ty:>5} {rows:>6}x{cols:<5} m={m:<4} threads={}  generic {:>9.1} us {:>7.2} GMAC/s",
                tandem_kernels::num_threads(),
                generic * 1e6,
                macs / generic / 1e9
            );
            if let Some(p) = &packed {
                let secs = best_of(budget, 3, || {
                    matmul_packed(p, black_box(&x), m, &mut out).expect("matmul");
                });
                let gmacs = macs / secs / 1e9;
                line += &format!("   packed {:>9.1} us {gmacs:>7.2} GMAC/s", secs * 1e6);
                if let Some(peak) = peak {
                    line += &format!(" ({:.0}% of vpdpbusd peak)", 100.0 * gmacs / peak);
                }
            }
            println!("{line}");
        }
    }
}

/// One core's `vpdpbusd` (512-bit) multiply-accumulates per second, in
/// billions, from 12 independent accumulator chains; `None` without VNNI.
fn vnni_peak_gmacs() -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
        if !(is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512f")) {
            return None;
        }
        const ITERS: u64 = 1 << 22;
        let secs = best_of(Duration::from_millis(600), 5, || {
            // SAFETY: support checked above.
            black_box(unsafe { vnni_chains(ITERS) });
        });
        // 12 chains x 64 byte products per instruction.
        Some((ITERS * 12 * 64) as f64 / secs / 1e9)
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vnni")]
unsafe fn vnni_chains(iters: u64) -> i32 {
    use std::arch::x86_64::*;
    let a = _mm512_set1_epi8(3);
    let b = _mm512_set1_epi8(5);
    let mut acc = [_mm512_setzero_si512(); 12];
    for _ in 0..iters {
        for v in acc.iter_mut() {
            *v = _mm512_dpbusd_epi32(*v, a, b);
        }
    }
    acc.iter()
        .fold(0, |s, &v| s.wrapping_add(_mm512_reduce_add_epi32(v)))
}

/// On-CPU time of the calling thread in seconds: unlike the wall clock, it
/// stops while another process has the core, so a single-threaded kernel
/// can be timed on a shared machine.
#[cfg(target_os = "linux")]
fn thread_cpu_secs() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

#[cfg(not(target_os = "linux"))]
fn thread_cpu_secs() -> f64 {
    use std::sync::OnceLock;
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_secs_f64()
}

/// The packed kernels one at a time on the calling thread (run with
/// `TANDEM_THREADS=1`), timed in thread CPU time, best of many: the A/B
/// figure for kernel changes on a busy machine. The models' prefill shapes
/// (SmolLM2 Q4_1; Qwen2.5-0.5B Q4_K_M: Q5_0 gate/up, Q4_K / Q6_K down, Q8_0
/// head) against one core's `vpdpbusd` peak.
fn tiles() {
    let peak = vnni_peak_gmacs();
    for (ty, rows, cols) in [
        (GgmlType::Q4_1, 3072, 576),
        (GgmlType::Q4_1, 576, 1536),
        (GgmlType::Q5_0, 4864, 896),
        (GgmlType::Q4_K, 896, 4864),
        (GgmlType::Q6_K, 896, 4864),
        (GgmlType::Q8_0, 1152, 896),
    ] {
        let data = weights(ty, rows, cols, 0);
        let w = QMatrix::new(ty, &data, rows, cols).expect("shape");
        let Some(p) = PackedMatrix::pack(&w) else {
            println!("tiles {ty:>5}: not packed on this CPU");
            continue;
        };
        for m in [32usize, 512] {
            let x = acts(m * cols);
            let mut out = vec![0.0f32; m * rows];
            let mut best = f64::MAX;
            let start = Instant::now();
            let mut iters = 0;
            while iters < 5 || start.elapsed() < Duration::from_millis(1500) {
                let t = thread_cpu_secs();
                matmul_packed(&p, black_box(&x), m, &mut out).expect("matmul");
                best = best.min(thread_cpu_secs() - t);
                iters += 1;
            }
            let gmacs = (rows * cols * m) as f64 / best / 1e9;
            let share = peak.map_or(String::new(), |pk| {
                format!(" ({:.0}% of one core's vpdpbusd peak)", 100.0 * gmacs / pk)
            });
            println!(
                "tiles {ty:>5} {rows:>5}x{cols:<5} m={m:<4} {:>9.1} us cpu {gmacs:>7.2} GMAC/s{share}",
                best * 1e6
            );
        }
    }
}

fn peak() {
    match vnni_peak_gmacs() {
        Some(p) => println!("peak vpdpbusd (512-bit) {p:>8.1} GMAC/s per core"),
        None => println!("peak vpdpbusd: no AVX-512 VNNI on this CPU"),
    }
}

fn main() {
    let threads = std::env::var("TANDEM_THREADS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    tandem_kernels::set_num_threads(threads).expect("thread pool");
    if let Ok(isa) = std::env::var("TANDEM_CPU_ISA") {
        let isa = isa.parse().expect("TANDEM_CPU_ISA");
        tandem_kernels::limit_isa(isa).expect("TANDEM_CPU_ISA");
    }
    println!("kernels: {}", tandem_kernels::isa());
    let which = std::env::var("TANDEM_BENCH").unwrap_or_default();
    if which.is_empty() || which == "membw" {
        membw();
    }
    if which.is_empty() || which == "cold" {
        cold();
    }
    if which.is_empty() || which == "peak" {
        peak();
    }
    if which.is_empty() || which == "batch" {
        batch();
    }
    if which == "tiles" {
        tiles();
    }
}
