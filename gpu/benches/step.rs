//! Where a decode step's time goes on a GPU: the host's time to enqueue it
//! (token and position uploads, activation buffers, some 300 launches for
//! SmolLM2; 430 before Q/K/V and gate/up were stacked) against the whole
//! step (the read of its logits waits for the device), for batches of
//! several sequences. If enqueueing is most of the step, the host's launch
//! path bounds decode, not the device.
//!
//! Seen on an H200 through NVIDIA's Vulkan driver, SmolLM2 Q4_1, with 430
//! launches per step: batch 1, 3.18 ms enqueued of a 4.37 ms step (73%,
//! 229 tok/s); batch 64, 4.71 of 16.89 ms (28%, 3789 tok/s). With 300
//! (10 per layer): batch 1, 2.10 of 3.85 ms (55%, 260 tok/s); batch 8,
//! 6.01 ms; batch 32, 9.83 ms; batch 64, 2.42 of 15.57 ms (16%, 4111
//! tok/s). Qwen2.5-0.5B Q4_K_M: batch 1, 2.50 of 4.79 ms (209 tok/s);
//! batch 32, 23.15 ms (1383 tok/s). Two fusions that took one launch per
//! layer each were measured and reverted: SwiGLU inside the down
//! projection made batches of 8-64 15-24% slower (each cube of rows
//! recomputes it), RoPE with the KV write changed nothing beyond the
//! run-to-run noise (batch 1 varied from 3.85 to 4.31 ms).
//!
//! `cargo bench -p tandem-gpu --bench step [-- GGUF]` (default:
//! `$TANDEM_TEST_GGUF`); `TANDEM_GPU_BENCH_SCALE=small` runs batches small
//! enough for lavapipe.

use std::time::{Duration, Instant};

use tandem_gpu::GpuDevice;
use tandem_gpu::llama::{Chunk, GpuModel};
use tandem_gpu::weights::ModelFiles;

const BLOCK: usize = 16;
const PROMPT: usize = 64;

fn main() {
    let path = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .or_else(|| std::env::var("TANDEM_TEST_GGUF").ok())
        .expect("a GGUF path (argument or TANDEM_TEST_GGUF)");
    let small = std::env::var("TANDEM_GPU_BENCH_SCALE").as_deref() == Ok("small");
    let (batches, steps): (&[usize], usize) = if small {
        (&[1, 4], 3)
    } else {
        (&[1, 8, 32, 64], 20)
    };
    let dev = GpuDevice::open(0).unwrap_or_else(|e| panic!("{e}"));
    let g = ModelFiles::open(std::path::Path::new(&path)).expect("model files");
    let ctx = PROMPT + steps + 1;
    let model = GpuModel::load(dev, &g, ctx, BLOCK).expect("loads");
    println!("device: {}", model.device().name());
    println!();
    println!("| batch | enqueue ms | step ms | enqueue share | tok/s |");
    println!("| --- | --- | --- | --- | --- |");
    let per_seq = ctx.div_ceil(BLOCK);
    let mut reads = Vec::new();
    for &b in batches {
        let pool = model.new_pool(b * per_seq).expect("pool");
        let tables: Vec<Vec<u32>> = (0..b)
            .map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect())
            .collect();
        let prompt: Vec<u32> = (0..PROMPT as u32).map(|i| 100 + i * 7).collect();
        let chunks: Vec<Chunk<'_>> = tables
            .iter()
            .map(|t| Chunk {
                tokens: &prompt,
                start_pos: 0,
                blocks: t,
                want_logits: true,
            })
            .collect();
        let logits = model.forward(&pool, &chunks).expect("prefill");
        if let Some(l) = logits {
            model.device().download(&l).expect("read");
        }
        let (mut enqueue, mut total) = (Duration::ZERO, Duration::ZERO);
        let mut last = None;
        // The first step compiles this batch's kernels: not counted.
        for step in 0..=steps {
            let token = [200 + step as u32];
            let chunks: Vec<Chunk<'_>> = tables
                .iter()
                .map(|t| Chunk {
                    tokens: &token,
                    start_pos: PROMPT + step,
                    blocks: t,
                    want_logits: true,
                })
                .collect();
            let t0 = Instant::now();
            let logits = model.forward(&pool, &chunks).expect("step");
            let t1 = Instant::now();
            if let Some(l) = &logits {
                model.device().download(l).expect("read");
            }
            last = logits;
            if step > 0 {
                enqueue += t1 - t0;
                total += t0.elapsed();
            }
        }
        let (e, t) = (
            enqueue.as_secs_f64() / steps as f64,
            total.as_secs_f64() / steps as f64,
        );
        println!(
            "| {b} | {:.2} | {:.2} | {:.0}% | {:.0} |",
            e * 1e3,
            t * 1e3,
            100.0 * e / t,
            b as f64 / t
        );
        if let Some(l) = last {
            reads.push((b, read_times(&model, &l, steps)));
        }
    }
    println!();
    println!(
        "Reading a step's logits: whole rows, or the top {TOP} of each (the kernel and three reads)"
    );
    println!();
    println!("| batch | whole rows ms | bytes | top {TOP} ms | bytes |");
    println!("| --- | --- | --- | --- | --- |");
    let vocab = model.config().vocab_size;
    for (b, (full, top)) in reads {
        println!(
            "| {b} | {:.3} | {} | {:.3} | {} |",
            full * 1e3,
            b * vocab * 4,
            top * 1e3,
            b * (TOP * 8 + 4)
        );
    }
}

/// Candidates per row in the logits-read comparison (a greedy step with
/// `top_logprobs` up to 8).
const TOP: usize = 8;

/// Seconds per read of the logits `l` off the device: whole, and as each
/// row's top [`TOP`] with its log-sum-exp (best of `n`; the first of each
/// warms up).
fn read_times(model: &GpuModel, l: &tandem_gpu::Buffer, n: usize) -> (f64, f64) {
    let dev = model.device();
    let vocab = model.config().vocab_size;
    let rows = l.len() / vocab;
    let best = |f: &dyn Fn()| {
        (0..=n)
            .map(|_| {
                let t0 = Instant::now();
                f();
                t0.elapsed().as_secs_f64()
            })
            .skip(1)
            .fold(f64::INFINITY, f64::min)
    };
    let full = best(&|| {
        dev.download(l).expect("read");
    });
    let top = best(&|| {
        let (ids, vals, z) = (
            dev.empty::<u32>(rows * TOP),
            dev.empty::<f32>(rows * TOP),
            dev.empty::<f32>(rows),
        );
        tandem_gpu::kernels::top_k(dev, l, vocab, TOP, &ids, &vals, &z).expect("top_k");
        dev.download(&ids).expect("read");
        dev.download(&vals).expect("read");
        dev.download(&z).expect("read");
    });
    (full, top)
}
