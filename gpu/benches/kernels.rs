//! Decode-shaped matmuls on a GPU device against the device's own copy
//! bandwidth, measured in the same run: a one-token matmul reads its whole
//! weight matrix once, so a plain device-to-device copy (every byte read
//! once and written once) is the speed it can approach.
//!
//! `cargo bench -p tandem-gpu --bench kernels [-- gpu:N]`
//! `TANDEM_GPU_BENCH_SCALE=small` runs shapes small enough for lavapipe;
//! `GPU_BW_GBS=x` (the datasheet's memory bandwidth) adds each matmul's
//! share of it.
//!
//! Seen on an H200 through NVIDIA's Vulkan driver: the copy reaches only
//! ~140 GB/s while a matmul reads its weights at up to 1.7 TB/s, so there
//! the datasheet column is the one to read (cause of the slow copy not
//! found yet).

use std::time::Instant;

use tandem_gpu::{GpuDevice, kernels};

/// Seconds per call of `launch`, over `iters` calls queued back to back and
/// one read of `sync` (which waits for all of them); best of 3 batches.
fn time_per_call(
    dev: &GpuDevice,
    sync: &tandem_gpu::Buffer,
    iters: usize,
    mut launch: impl FnMut(),
) -> f64 {
    launch();
    dev.download(sync).expect("warm-up");
    (0..3)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..iters {
                launch();
            }
            dev.download(sync).expect("sync");
            t.elapsed().as_secs_f64() / iters as f64
        })
        .fold(f64::MAX, f64::min)
}

/// Deterministic filler (no RNG needed: the values only have to be finite
/// and not all equal).
fn filler(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ salt) & 0x3bff_3bff)
        .collect()
}

fn main() {
    let spec = std::env::args()
        .skip(1)
        .find(|a| a.starts_with("gpu:"))
        .unwrap_or_else(|| "gpu:0".into());
    let index: usize = spec[4..].parse().expect("gpu:N");
    let dev = GpuDevice::open(index).unwrap_or_else(|e| panic!("{e}"));
    let small = std::env::var("TANDEM_GPU_BENCH_SCALE").as_deref() == Ok("small");
    println!("device: {}", dev.name());

    // The ceiling: f32 copies of 32-128 MiB (small: 8-32 MiB), bytes
    // read + written, past any GPU's L2 and within wgpu's default binding
    // limit; the best size counts.
    let sizes = if small {
        [2 << 20, 8 << 20]
    } else {
        [8 << 20, 32 << 20]
    };
    let mut copy_gbs = 0.0f64;
    for n in sizes {
        let src = dev.upload(&vec![1.0f32; n]);
        let dst = dev.zeros(n);
        let t = time_per_call(&dev, &dst, if small { 5 } else { 50 }, || {
            kernels::copy(&dev, &src, &dst).expect("launch");
        });
        let gbs = (2 * n * 4) as f64 / t / 1e9;
        println!(
            "copy {} MiB: {gbs:.1} GB/s (read + written), {:.1} us",
            (n * 4) >> 20,
            t * 1e6
        );
        copy_gbs = copy_gbs.max(gbs);
        let t = time_per_call(&dev, &dst, if small { 5 } else { 50 }, || {
            kernels::add(&dev, &dst, &src).expect("launch");
        });
        let gbs = (3 * n * 4) as f64 / t / 1e9;
        println!(
            "add {} MiB: {gbs:.1} GB/s (2 read + 1 written), {:.1} us",
            (n * 4) >> 20,
            t * 1e6
        );
    }
    // What one small launch costs, end to end: the floor under every step.
    let (a, b) = (dev.zeros(576), dev.zeros(576));
    let t = time_per_call(&dev, &a, if small { 20 } else { 1000 }, || {
        kernels::add(&dev, &a, &b).expect("launch");
    });
    println!("one launch (add, 576 values): {:.1} us", t * 1e6);
    println!();
    let datasheet: Option<f64> = std::env::var("GPU_BW_GBS")
        .ok()
        .and_then(|v| v.parse().ok());
    println!(
        "| matmul, 1 token | weights MB | us per call | GB/s | vs copy | share of datasheet |"
    );
    println!("| --- | --- | --- | --- | --- | --- |");
    // (rows, cols): SmolLM2's q/o and up; Qwen2.5-0.5B's down (its K-quant
    // matrices); a 7-8B model's q and up. A format whose block does not
    // divide a shape's columns (the K-quants' 256 into 576) skips it.
    let shapes: &[(usize, usize)] = if small {
        &[(576, 576), (1536, 576), (896, 4864), (4096, 4096)]
    } else {
        &[
            (576, 576),
            (1536, 576),
            (896, 4864),
            (4096, 4096),
            (14336, 4096),
        ]
    };
    let iters = if small { 5 } else { 200 };
    for &(rows, cols) in shapes {
        let x = dev.upload(&vec![0.5f32; cols]);
        let out = dev.zeros(rows);
        for format in kernels::QFormat::ALL {
            let ty = format.ggml();
            if cols % ty.block_len() != 0 {
                continue;
            }
            let bytes = rows * cols / ty.block_len() * ty.block_bytes();
            // Small finite scales in every f16 field (the filler's words
            // keep each half below 0x3c00).
            let gguf: Vec<u8> = filler(bytes.div_ceil(4), 0x1234)
                .into_iter()
                .flat_map(u32::to_le_bytes)
                .take(bytes)
                .collect();
            let w = kernels::QMatrix::upload(&dev, format, rows, cols, &gguf).expect("upload");
            let t = time_per_call(&dev, &out, iters, || {
                kernels::matmul_q(&dev, &x, &w, &out, rows, 0).expect("launch");
            });
            report(
                &format!("{format:?} {rows}x{cols}"),
                bytes,
                t,
                copy_gbs,
                datasheet,
            );
        }
    }
    // An f32 head of SmolLM2's shape (the form an unquantised head loads in).
    let (rows, cols) = if small { (8192, 576) } else { (49152, 576) };
    let x = dev.upload(&vec![0.5f32; cols]);
    let out = dev.zeros(rows);
    let w = dev.upload(&vec![0.25f32; rows * cols]);
    let t = time_per_call(&dev, &out, iters, || {
        kernels::matmul(&dev, &x, &w, cols, &out).expect("launch");
    });
    report(
        &format!("f32 {rows}x{cols}"),
        rows * cols * 4,
        t,
        copy_gbs,
        datasheet,
    );
}

fn report(what: &str, bytes: usize, secs: f64, copy_gbs: f64, datasheet: Option<f64>) {
    let gbs = bytes as f64 / secs / 1e9;
    let share = datasheet.map_or("-".to_string(), |bw| format!("{:.1}%", 100.0 * gbs / bw));
    println!(
        "| {what} | {:.1} | {:.1} | {gbs:.1} | {:.2}x | {share} |",
        bytes as f64 / 1e6,
        secs * 1e6,
        gbs / copy_gbs
    );
}
