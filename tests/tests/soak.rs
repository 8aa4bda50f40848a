//! Soak: a 1P1D cluster (every process in its own network namespace, as in
//! the chaos suite) under a steady mixed load with random disconnects for
//! `TANDEM_SOAK_SECS` seconds (120 by default, the CI version;
//! `scripts/soak.sh` runs 600). The resident memory of every process is
//! sampled every 10 s; after the warm-up it must be flat (its least-squares
//! slope is printed and bounded); no request may fail, hang or come back
//! wrong; p99 TTFT and TPOT are printed per minute; no KV block may stay in
//! use once the load drains.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_tests::chaos::load::{Catalog, Load, LoadConfig, Outcome, Tally};
use tandem_tests::chaos::{ChaosCluster, quantile, rss_kib, slope, sustained_growth};

const SAMPLE: Duration = Duration::from_secs(10);
/// Samples before this are warm-up (allocator arenas, caches filling).
const WARM_UP: Duration = Duration::from_secs(30);
/// Flat: growth after warm-up at most this many KiB per minute per process
/// (or 1% of its RSS per minute, if more), unless the growth is a one-time
/// step (see [`sustained_growth`]: the high-water mark must rise in each of
/// [`WINDOWS`] slices of the run for it to count as a leak).
const MAX_SLOPE_KIB_PER_MIN: f64 = 1024.0;
const WINDOWS: usize = 3;

#[test]
fn soak_steady_mixed_load_keeps_memory_flat_and_never_fails() {
    let secs: u64 = std::env::var("TANDEM_SOAK_SECS")
        .ok()
        .map(|s| s.parse().expect("TANDEM_SOAK_SECS is a number of seconds"))
        .unwrap_or(120);
    let duration = Duration::from_secs(secs);
    assert!(
        duration > WARM_UP + 3 * SAMPLE,
        "a soak needs more than {:?}",
        WARM_UP + 3 * SAMPLE
    );
    let t0 = Instant::now();
    let catalog = Arc::new(Catalog::build(24, 6, 12));
    let c = ChaosCluster::start("soak", 1, 1, 96);
    let load = Load::start(
        c.router.addr(),
        catalog,
        &LoadConfig {
            clients: 4,
            deadline: Duration::from_secs(45),
            seed: 7,
            disconnect_per_mille: 100,
        },
    );
    let start = Instant::now();
    let procs: Vec<(String, u32)> = vec![
        ("etcd".into(), c.etcd.proc.as_ref().unwrap().pid()),
        ("router".into(), c.router.proc.as_ref().unwrap().pid()),
        ("prefill p0".into(), c.prefills[0].pid()),
        ("decode d0".into(), c.decodes[0].pid()),
    ];
    let mut samples: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    let mut next = start;
    while start.elapsed() < duration {
        let at = start.elapsed().as_secs_f64();
        for (name, pid) in &procs {
            let kib = rss_kib(*pid) as f64;
            assert!(kib > 0.0, "{name} is gone");
            samples.entry(name.clone()).or_default().push((at, kib));
        }
        let done = load.records();
        let errors = done
            .iter()
            .filter(|r| !matches!(r.outcome, Outcome::Correct | Outcome::Aborted))
            .count();
        println!(
            "t={at:>5.0} s  {} requests, {errors} errors  RSS KiB: {}",
            done.len(),
            procs
                .iter()
                .map(|(n, _)| format!("{n} {:.0}", samples[n].last().unwrap().1))
                .collect::<Vec<_>>()
                .join(", ")
        );
        next += SAMPLE;
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
    }
    let records = load.stop();
    let settled = c.settle(Duration::from_secs(30));

    // Per minute (by request start): p99 TTFT and TPOT of the streams.
    println!("\n| minute | requests | correct | p99 TTFT | p99 TPOT |\n|---|---|---|---|---|");
    let minutes = duration.as_secs().div_ceil(60);
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

    println!(
        "\n| process | RSS after warm-up (KiB) | last (KiB) | slope (KiB/min) |\n|---|---|---|---|"
    );
    let mut too_steep = Vec::new();
    for (name, pts) in &samples {
        let after: Vec<(f64, f64)> = pts
            .iter()
            .filter(|(t, _)| *t >= WARM_UP.as_secs_f64())
            .map(|(t, k)| (t / 60.0, *k))
            .collect();
        let s = slope(&after);
        let first = after.first().map_or(0.0, |p| p.1);
        let last = after.last().map_or(0.0, |p| p.1);
        println!("| {name} | {first:.0} | {last:.0} | {s:+.0} |");
        let bound = MAX_SLOPE_KIB_PER_MIN.max(first / 100.0);
        if sustained_growth(&after, WINDOWS, bound) {
            too_steep.push(format!("{name}: {s:+.0} KiB/min (bound {bound:.0})"));
        }
    }

    let tally = Tally::of(&records);
    let errors = tally.started - tally.correct - tally.aborted;
    println!(
        "\nsoak {secs} s: {} requests, {} correct, {} aborted by their client, {errors} errors \
         ({}), {} hung, {} wrong; wall {:?}",
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
    assert!(too_steep.is_empty(), "memory grows: {too_steep:?}");
}
