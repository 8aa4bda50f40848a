//! Soak: a 1P1D cluster (every process in its own network namespace, as in
//! the chaos suite) under a steady mixed load with random disconnects. No
//! request may fail, hang or come back wrong; no KV block may stay in use
//! once the load drains; p99 TTFT and TPOT are printed per minute.
//!
//! Memory, two ways:
//! - heap in use (`tandem_process_heap_bytes`: what glibc handed out and
//!   was not given back) of the router and both nodes, read at quiescent
//!   points (load paused, drained, KV settled) after a warm-up stretch of
//!   load (caches, pools, arenas fill) and after each of two more. A leak
//!   grows the heap in both later stretches; a one-time step (a scratch
//!   buffer reaching a new high-water mark, a table doubling) in one at
//!   most. So the smaller of the two growths per request must stay under
//!   [`MAX_HEAP_GROWTH_PER_REQUEST`]: a leak of a few KiB per request fails
//!   one short run, where RSS (which moves with the pages the allocator
//!   keeps) would need many minutes;
//! - the resident memory of every process (etcd too), sampled all along:
//!   after the warm-up it must not grow steadily ([`sustained_growth`]),
//!   judged where the samples span [`MIN_RSS_WINDOW_MIN`] or more (the
//!   long form), printed in the short one.
//!
//! KV tiers: every node keeps a host tier and a small disk tier
//! (`--kv-connector-config`, [`HOST_TIER_GB`], [`DISK_TIER_GB`], files in a
//! directory of its own), which the pool's evictions fill early in the
//! warm-up. Each node's offload directory is measured all along and at the
//! end and must stay within `disk_offload_max_gb` (and hold files: the
//! tiers were used), besides the memory bounds above (which the host tier's
//! bytes count in) and the outputs' equality with the references (restored
//! blocks included).
//!
//! The short form (CI) runs [`WARM_UP_REQUESTS`], then twice
//! [`STRETCH_REQUESTS`] requests; `TANDEM_SOAK_SECS=S` (`scripts/soak.sh`:
//! 600) runs a third of S for each stretch.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tandem_tests::chaos::load::{Catalog, Load, LoadConfig, Outcome, Record, Tally};
use tandem_tests::chaos::{ChaosCluster, get_text, quantile, rss_kib, slope, sustained_growth};
use tandem_tests::metric;

/// Requests in the short form's warm-up, and in each stretch after it.
const WARM_UP_REQUESTS: usize = 200;
const STRETCH_REQUESTS: usize = 150;
/// Heap growth allowed per request (over the better of the two stretches
/// after the warm-up), per process.
const MAX_HEAP_GROWTH_PER_REQUEST: f64 = 512.0;
/// RSS flat: growth after the first stretch at most this many KiB per
/// minute per process (or 1% of its RSS per minute, if more), unless the
/// growth is a one-time step (see [`sustained_growth`]: the high-water mark
/// must rise in each of [`WINDOWS`] slices of the run for it to count).
const MAX_SLOPE_KIB_PER_MIN: f64 = 1024.0;
const WINDOWS: usize = 3;
/// The shortest stretch of RSS samples a slope is judged on. Shorter ones
/// (the short form's) are printed only: there a Go heap's collection cycle
/// (etcd's RSS moves by megabytes between collections) reads as minutes of
/// growth, and the heap check above bounds the tandem processes' growth.
const MIN_RSS_WINDOW_MIN: f64 = 2.0;
/// Each node's host tier: some 9 of SmolLM2's ~225 KiB blocks.
const HOST_TIER_GB: f64 = 0.002;
/// Each node's disk tier: some 46 blocks, below the load's working set
/// (its 24 long prompts alone are ~150 blocks), so the limit is kept
/// under load, not just never reached.
const DISK_TIER_GB: f64 = 0.01;
/// How often the offload directories are measured.
const DIR_SAMPLE: Duration = Duration::from_millis(200);

/// How long each stretch runs.
#[derive(Debug, Clone, Copy)]
enum Stretch {
    Requests(usize),
    Until(Duration),
}

/// A tandem process whose heap is read from its `/metrics`.
struct Tandem {
    name: &'static str,
    ip: std::net::Ipv4Addr,
    port: u16,
}

impl Tandem {
    fn heap(&self) -> f64 {
        let text = get_text(self.ip, self.port, "/metrics");
        let v = metric(&text, "tandem_process_heap_bytes", "");
        assert!(v > 0.0, "{} exports no heap in use:\n{text}", self.name);
        v
    }
}

/// Pauses the load until nothing is in flight and every node holds no
/// block, reads each process's heap (the smaller of two reads: a scrape
/// allocates too) and resumes the load.
fn quiescent_heaps(c: &ChaosCluster, load: &Load, procs: &[Tandem]) -> Vec<f64> {
    assert!(
        load.pause(Instant::now() + Duration::from_secs(60)),
        "the load did not drain"
    );
    for (id, used, h) in c.settle(Duration::from_secs(30)) {
        assert_eq!(used, 0, "{id} still busy after the load drained: {h}");
    }
    let heaps = procs.iter().map(|p| p.heap().min(p.heap())).collect();
    load.resume();
    heaps
}

/// Runs the load through `stretch`.
fn run(load: &Load, stretch: Stretch) {
    match stretch {
        Stretch::Requests(n) => {
            let from = load.records().len();
            assert!(
                load.wait_until(Instant::now() + Duration::from_secs(300), |rs, _| rs.len()
                    >= from + n),
                "fewer than {n} requests in 300 s"
            );
        }
        Stretch::Until(d) => {
            // The long form's fixed duration.
            load.wait_until(Instant::now() + d, |_, _| false);
        }
    }
}

/// RSS of `procs` every `every` until `stop`: `(seconds since start, KiB)`.
fn sample_rss(
    procs: &[(String, u32)],
    start: Instant,
    every: Duration,
    stop: &AtomicBool,
    out: &Mutex<BTreeMap<String, Vec<(f64, f64)>>>,
) {
    let mut next = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        let at = start.elapsed().as_secs_f64();
        for (name, pid) in procs {
            let kib = rss_kib(*pid) as f64;
            assert!(kib > 0.0, "{name} is gone");
            out.lock()
                .unwrap()
                .entry(name.clone())
                .or_default()
                .push((at, kib));
        }
        next += every;
        // The sampling period, not a wait for an event.
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
    }
}

/// Bytes of the files under `dir` (the disk tier's namespace directories
/// and their block files, `.tmp` ones included); files deleted while it
/// looks are skipped.
fn dir_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&e.path()),
            Ok(_) => e.metadata().map_or(0, |m| m.len()),
            Err(_) => 0,
        })
        .sum()
}

/// The largest size each of `dirs` had, measured every [`DIR_SAMPLE`]
/// until `stop`.
fn sample_dirs(dirs: &[PathBuf], stop: &AtomicBool, peak: &Mutex<Vec<u64>>) {
    let mut next = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        for (i, d) in dirs.iter().enumerate() {
            let b = dir_bytes(d);
            let mut p = peak.lock().unwrap();
            p[i] = p[i].max(b);
        }
        next += DIR_SAMPLE;
        // The sampling period, not a wait for an event.
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
    }
}

/// Each node's offload directory over its limit at its peak or now: those
/// (printed either way).
fn disk_over_limit(dirs: &[PathBuf], peaks: &[u64]) -> Vec<String> {
    let limit = (DISK_TIER_GB * (1u64 << 30) as f64) as u64;
    let mut over = Vec::new();
    for (d, &peak) in dirs.iter().zip(peaks) {
        let now = dir_bytes(d);
        println!(
            "offload dir {}: peak {peak} B, at the end {now} B, limit {limit} B",
            d.display()
        );
        if peak.max(now) > limit {
            over.push(format!("{}: {} B > {limit} B", d.display(), peak.max(now)));
        }
    }
    over
}

#[test]
fn soak_steady_mixed_load_keeps_memory_flat_and_never_fails() {
    let t0 = Instant::now();
    let offload = tempfile::tempdir_in("/var/tmp").expect("a temp dir");
    let tier_config = format!(
        r#"{{"host_kvcache_swap_space_gb": {HOST_TIER_GB}, "disk_offload_dir": "{}/{{id}}", "disk_offload_max_gb": {DISK_TIER_GB}}}"#,
        offload.path().display()
    );
    let (stretches, sample) = match std::env::var("TANDEM_SOAK_SECS") {
        Ok(s) => {
            let secs: u64 = s.parse().expect("TANDEM_SOAK_SECS is a number of seconds");
            assert!(secs >= 60, "a long soak needs at least 60 s");
            (
                [Stretch::Until(Duration::from_secs(secs / 3)); 3],
                Duration::from_secs(10),
            )
        }
        Err(_) => (
            [
                Stretch::Requests(WARM_UP_REQUESTS),
                Stretch::Requests(STRETCH_REQUESTS),
                Stretch::Requests(STRETCH_REQUESTS),
            ],
            Duration::from_secs(2),
        ),
    };
    let (catalog, c) = std::thread::scope(|s| {
        let catalog = s.spawn(|| Catalog::build(24, 6, 12));
        // A small event ring (and live channel) for routers, full within
        // the first stretch: at its default it would take thousands of
        // requests to fill and look like a leak of a few hundred bytes per
        // request meanwhile.
        let c = ChaosCluster::start_with(
            "soak",
            1,
            1,
            96,
            &[
                "--kv-event-ring",
                "256",
                "--kv-connector-config",
                &tier_config,
            ],
        );
        (catalog.join().unwrap(), c)
    });
    println!("references and the cluster up after {:?}", t0.elapsed());
    let tandems = [
        Tandem {
            name: "router",
            ip: c.router.space.ip,
            port: c.router.addr().port(),
        },
        Tandem {
            name: "prefill p0",
            ip: c.prefills[0].space.ip,
            port: c.prefills[0].metrics,
        },
        Tandem {
            name: "decode d0",
            ip: c.decodes[0].space.ip,
            port: c.decodes[0].metrics,
        },
    ];
    let pids: Vec<(String, u32)> = vec![
        ("etcd".into(), c.etcd.proc.as_ref().unwrap().pid()),
        ("router".into(), c.router.proc.as_ref().unwrap().pid()),
        ("prefill p0".into(), c.prefills[0].pid()),
        ("decode d0".into(), c.decodes[0].pid()),
    ];
    let dirs: Vec<PathBuf> = ["p0", "d0"]
        .iter()
        .map(|id| offload.path().join(id))
        .collect();
    let start = Instant::now();
    let load = Load::start(
        c.router.addr(),
        Arc::new(catalog),
        &LoadConfig {
            clients: 4,
            deadline: Duration::from_secs(45),
            seed: 7,
            disconnect_per_mille: 100,
        },
    );
    let stop = AtomicBool::new(false);
    let rss = Mutex::new(BTreeMap::new());
    let dir_peaks = Mutex::new(vec![0; dirs.len()]);
    let (points, warmed) = std::thread::scope(|s| {
        s.spawn(|| sample_rss(&pids, start, sample, &stop, &rss));
        s.spawn(|| sample_dirs(&dirs, &stop, &dir_peaks));
        let mut points = Vec::new();
        let mut warmed = 0.0;
        for (i, stretch) in stretches.iter().enumerate() {
            run(&load, *stretch);
            let heaps = quiescent_heaps(&c, &load, &tandems);
            let n = load.records().len();
            println!(
                "t={:>5.1} s  after {n} requests, heap in use: {}",
                start.elapsed().as_secs_f64(),
                tandems
                    .iter()
                    .zip(&heaps)
                    .map(|(p, h)| format!("{} {:.0} KiB", p.name, h / 1024.0))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            if i == 0 {
                warmed = start.elapsed().as_secs_f64();
            }
            points.push((n, heaps));
        }
        stop.store(true, Ordering::Relaxed);
        (points, warmed)
    });
    let records = load.stop();
    let settled = c.settle(Duration::from_secs(30));

    print_latencies(&records, start);
    let too_much_heap = heap_growth(&tandems, &points);
    let too_steep = rss_growth(&rss.into_inner().unwrap(), warmed);
    let dir_peaks = dir_peaks.into_inner().unwrap();
    let disk_over = disk_over_limit(&dirs, &dir_peaks);

    let tally = Tally::of(&records);
    let errors = tally.started - tally.correct - tally.aborted;
    println!(
        "\nsoak: {} requests, {} correct, {} aborted by their client, {errors} errors ({}), {} \
         hung, {} wrong; wall {:?}",
        tally.started,
        tally.correct,
        tally.aborted,
        tally.clean_summary(),
        tally.hung,
        tally.wrong.len(),
        t0.elapsed()
    );
    for (id, used, h) in &settled {
        assert_eq!(*used, 0, "{id} still busy after the load drained: {h}");
    }
    assert!(tally.correct > 0);
    assert_eq!(errors, 0, "wrong: {:?}", tally.wrong);
    assert!(too_much_heap.is_empty(), "heap grows: {too_much_heap:?}");
    assert!(too_steep.is_empty(), "memory grows: {too_steep:?}");
    assert!(
        disk_over.is_empty(),
        "disk tier over its limit: {disk_over:?}"
    );
    assert!(
        dir_peaks.iter().any(|&b| b > 0),
        "no node's disk tier held a block: the tiers were not exercised"
    );
}

/// Heap growth per request over each stretch after the warm-up, per
/// process: those whose smaller growth is over the bound.
fn heap_growth(procs: &[Tandem], points: &[(usize, Vec<f64>)]) -> Vec<String> {
    let [(n0, h0), (n1, h1), (n2, h2)] = points else {
        panic!("three quiescent points, got {}", points.len());
    };
    let per =
        |a: &[f64], b: &[f64], from: usize, to: usize, i: usize| (b[i] - a[i]) / (to - from) as f64;
    println!(
        "\n| process | heap after warm-up (KiB) | growth per request, stretch 1 (B) | stretch 2 \
         (B) |\n|---|---|---|---|"
    );
    let mut over = Vec::new();
    for (i, p) in procs.iter().enumerate() {
        let (g1, g2) = (per(h0, h1, *n0, *n1, i), per(h1, h2, *n1, *n2, i));
        println!(
            "| {} | {:.0} | {g1:+.0} | {g2:+.0} |",
            p.name,
            h0[i] / 1024.0
        );
        if g1.min(g2) > MAX_HEAP_GROWTH_PER_REQUEST {
            over.push(format!(
                "{}: {g1:+.0} and {g2:+.0} B per request over {} and {} requests (bound \
                 {MAX_HEAP_GROWTH_PER_REQUEST})",
                p.name,
                n1 - n0,
                n2 - n1
            ));
        }
    }
    over
}

/// RSS samples after `warmed` s that grow steadily over at least
/// [`MIN_RSS_WINDOW_MIN`]: those processes.
fn rss_growth(samples: &BTreeMap<String, Vec<(f64, f64)>>, warmed: f64) -> Vec<String> {
    println!(
        "\n| process | RSS after the warm-up (KiB) | last (KiB) | slope (KiB/min) \
         |\n|---|---|---|---|"
    );
    let mut too_steep = Vec::new();
    for (name, pts) in samples {
        let after: Vec<(f64, f64)> = pts
            .iter()
            .filter(|(t, _)| *t >= warmed)
            .map(|(t, k)| (t / 60.0, *k))
            .collect();
        let s = slope(&after);
        let first = after.first().map_or(0.0, |p| p.1);
        let last = after.last().map_or(0.0, |p| p.1);
        println!("| {name} | {first:.0} | {last:.0} | {s:+.0} |");
        let bound = MAX_SLOPE_KIB_PER_MIN.max(first / 100.0);
        let window = after.last().map_or(0.0, |p| p.0) - after.first().map_or(0.0, |p| p.0);
        if window >= MIN_RSS_WINDOW_MIN && sustained_growth(&after, WINDOWS, bound) {
            too_steep.push(format!("{name}: {s:+.0} KiB/min (bound {bound:.0})"));
        }
    }
    too_steep
}

/// Per minute (by request start): p99 TTFT and TPOT of the streams.
fn print_latencies(records: &[Record], start: Instant) {
    println!("\n| minute | requests | correct | p99 TTFT | p99 TPOT |\n|---|---|---|---|---|");
    let last = records.iter().map(|r| r.start).max().unwrap_or(start);
    let minutes = (last - start).as_secs() / 60 + 1;
    for m in 0..minutes {
        let lo = start + Duration::from_secs(m * 60);
        let hi = lo + Duration::from_secs(60);
        let in_min: Vec<_> = records
            .iter()
            .filter(|r| r.start >= lo && r.start < hi)
            .collect();
        let mut ttft: Vec<Duration> = in_min.iter().filter_map(|r| r.ttft).collect();
        let mut tpot: Vec<Duration> = in_min.iter().filter_map(|r| r.tpot).collect();
        let correct = in_min
            .iter()
            .filter(|r| r.outcome == Outcome::Correct)
            .count();
        let fmt = |d: Option<Duration>| {
            d.map_or("-".into(), |d| format!("{:.0} ms", d.as_secs_f64() * 1e3))
        };
        println!(
            "| {m} | {} | {correct} | {} | {} |",
            in_min.len(),
            fmt(quantile(&mut ttft, 0.99)),
            fmt(quantile(&mut tpot, 0.99)),
        );
    }
}
