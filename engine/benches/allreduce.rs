//! CPU `all_reduce_sum` (thread ranks over shared memory) against a
//! `copy_from_slice` of the same buffer measured in the same run, and the
//! per-call latency of the allreduce tensor parallelism issues per layer per
//! token (SmolLM2's hidden size, 576 floats).
//!
//! Run with `cargo bench -p tandem-engine --bench allreduce` (or
//! `bench/allreduce.sh`). Environment: `ALLREDUCE_REPS` (samples, best
//! wins; default 7), `ALLREDUCE_WORLDS` (default "2,3").

use std::hint::black_box;
use std::time::{Duration, Instant};

use tandem_engine::comm::{Communicator, CpuGroup};

const SIZES: [usize; 4] = [4 << 10, 64 << 10, 1 << 20, 16 << 20];
const LATENCY_FLOATS: usize = 576;

fn env_list(name: &str, default: &[usize]) -> Vec<usize> {
    match std::env::var(name) {
        Ok(s) => s
            .split(',')
            .map(|x| {
                x.trim()
                    .parse()
                    .unwrap_or_else(|_| panic!("{name}: not a number: {x:?}"))
            })
            .collect(),
        Err(_) => default.to_vec(),
    }
}

/// Calls per sample: about 64 MiB of buffer, 8 to 10k calls.
fn iters_for(bytes: usize) -> usize {
    ((64 << 20) / bytes.max(1)).clamp(8, 10_000)
}

/// Per-op times of each sample (total / iters).
fn memcpy_samples(bytes: usize, reps: usize) -> Vec<Duration> {
    let n = bytes / 4;
    let src = vec![1.0f32; n];
    let mut dst = vec![0.0f32; n];
    let iters = iters_for(bytes);
    dst.copy_from_slice(&src);
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..iters {
                dst.copy_from_slice(black_box(&src));
                black_box(&mut dst);
            }
            t.elapsed() / iters as u32
        })
        .collect()
}

/// Per-call times of each sample, timed on rank 0 from a barrier to a
/// barrier after the last call (so the slowest rank counts).
fn allreduce_samples(world: usize, floats: usize, iters: usize, reps: usize) -> Vec<Duration> {
    collective_samples(world, floats, iters, reps, false)
}

/// As [`allreduce_samples`], for `all_gather` of `floats` per rank (what a
/// TP-invariant row-parallel sum exchanges: one segment partial per rank).
fn allgather_samples(world: usize, floats: usize, iters: usize, reps: usize) -> Vec<Duration> {
    collective_samples(world, floats, iters, reps, true)
}

fn collective_samples(
    world: usize,
    floats: usize,
    iters: usize,
    reps: usize,
    gather: bool,
) -> Vec<Duration> {
    let comms = CpuGroup::new(world);
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| {
                s.spawn(move || {
                    // Zeros: no denormals or overflow however often summed.
                    let mut buf = vec![0.0f32; floats];
                    let mut all = vec![0.0f32; floats * world];
                    let mut call = |buf: &mut Vec<f32>| {
                        if gather {
                            c.all_gather(black_box(buf), &mut all).expect("all_gather");
                        } else {
                            c.all_reduce_sum(black_box(buf)).expect("all_reduce_sum");
                        }
                    };
                    for _ in 0..iters.min(100) {
                        call(&mut buf);
                    }
                    let mut samples = Vec::with_capacity(reps);
                    for _ in 0..reps {
                        c.barrier().expect("barrier");
                        let t = Instant::now();
                        for _ in 0..iters {
                            call(&mut buf);
                        }
                        c.barrier().expect("barrier");
                        samples.push(t.elapsed() / iters as u32);
                    }
                    samples
                })
            })
            .collect();
        let mut per_rank: Vec<Vec<Duration>> = handles
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect();
        per_rank.swap_remove(0)
    })
}

fn best(v: &[Duration]) -> Duration {
    v.iter().copied().min().unwrap_or_default()
}

fn median(v: &[Duration]) -> Duration {
    let mut v = v.to_vec();
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

fn gbps(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64().max(1e-12) / 1e9
}

fn human(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{} KiB", bytes >> 10)
    }
}

fn main() {
    let reps = env_list("ALLREDUCE_REPS", &[7])[0].max(1);
    let worlds = env_list("ALLREDUCE_WORLDS", &[2, 3]);
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "all_reduce_sum (CpuGroup thread ranks) vs copy_from_slice, best of {reps} samples; {cores} CPUs"
    );
    println!(
        "GB/s = buffer bytes / time per call (1e9 B/s); ratio = allreduce time / memcpy time\n"
    );
    println!(
        "{:>5} {:>8} {:>14} {:>12} {:>11} {:>11} {:>7}",
        "world", "size", "allreduce GB/s", "memcpy GB/s", "allreduce", "memcpy", "ratio"
    );
    for &world in &worlds {
        for &bytes in &SIZES {
            // Interleave so both see the same machine state.
            let copy = best(&memcpy_samples(bytes, reps));
            let ar = best(&allreduce_samples(world, bytes / 4, iters_for(bytes), reps));
            println!(
                "{:>5} {:>8} {:>14.2} {:>12.2} {:>9.2}us {:>9.2}us {:>7.2}",
                world,
                human(bytes),
                gbps(bytes, ar),
                gbps(bytes, copy),
                ar.as_secs_f64() * 1e6,
                copy.as_secs_f64() * 1e6,
                ar.as_secs_f64() / copy.as_secs_f64().max(1e-12),
            );
        }
    }
    println!(
        "\nlatency of one all_reduce_sum of {LATENCY_FLOATS} floats (SmolLM2 hidden size, per layer per token x2)"
    );
    println!(
        "(all_gather: the same {LATENCY_FLOATS} floats from each rank, as TP-invariant row-parallel sums send)"
    );
    println!(
        "{:>5} {:>10} {:>12} {:>17} {:>14}",
        "world", "best us", "median us", "all_gather best us", "memcpy us"
    );
    let copy = best(&memcpy_samples(LATENCY_FLOATS * 4, reps));
    for &world in &worlds {
        let s = allreduce_samples(world, LATENCY_FLOATS, 5_000, reps);
        let g = allgather_samples(world, LATENCY_FLOATS, 5_000, reps);
        println!(
            "{:>5} {:>10.2} {:>12.2} {:>17.2} {:>14.3}",
            world,
            best(&s).as_secs_f64() * 1e6,
            median(&s).as_secs_f64() * 1e6,
            best(&g).as_secs_f64() * 1e6,
            copy.as_secs_f64() * 1e6,
        );
    }
}
