//! The chaos suite: a 1P2D cluster whose every process (etcd, router,
//! prefill and decode nodes) has its own network namespace, KV moving over
//! UCX/TCP on the namespaces' veths, the decode -> prefill gRPC path
//! through a fault proxy. Each scenario runs under a steady mixed load
//! (greedy completions and chats, streamed and not, short and long
//! prompts, clients hanging up at random) and is judged on: requests that
//! completed correctly (greedy output equal to the engine's reference),
//! failed cleanly (an HTTP error or an error event in OpenAI's shape, with
//! its code), hung (past a hard deadline: must be 0), KV blocks still in
//! use on any node once the load drained (must be 0), the time from the
//! heal to the first window of full throughput, and what the scenario
//! expects of its requests (`Expect`: every one correct where retries and
//! the local-prefill fallback hide the fault; only those on a lost decode
//! node, or routed to it before the router noticed, may fail where one is
//! lost).
//!
//! Each fault is held until the cluster shows its effect, not for a fixed
//! time: faults between prefill and decode begin while the prefill node
//! computes a prompt and hold until the decode nodes fell back to local
//! prefill and a few long prompts started during the fault have ended;
//! the others until a few requests started during them (or after the
//! router dropped a lost node) have ended. The full form
//! (`TANDEM_CHAOS_FULL=1`, or `scripts/chaos.sh`) also holds each for the
//! duration in its name. `TANDEM_CHAOS_ONLY=TEXT` runs only the scenarios
//! whose name contains TEXT (after the baseline); `TANDEM_CHAOS_DECODE_FLAGS`
//! adds flags to the decode nodes (experiments, e.g.
//! `--quarantine-limit-secs 30`).
//!
//! Needs root (network namespaces, veth, policy rules, tbf), etcd, libucx,
//! the release binary and `TANDEM_TEST_GGUF`. Without namespaces it fails,
//! it never skips.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tandem_tests::chaos::load::{Catalog, Outcome};
use tandem_tests::chaos::scenario::{Expect, Fault, Form, Kind, Row, Suite};
use tandem_tests::chaos::{ChaosCluster, LEASE_TTL_S};

const MAX_TOKENS: usize = 12;
const S: fn(u64) -> Duration = Duration::from_secs;

#[test]
fn chaos_scenarios_under_steady_mixed_load() {
    let started = Instant::now();
    let form = Form::from_env();
    // References (the engine in this process) while the cluster starts. A
    // small decode KV pool (96 blocks) so that the long prompts, cycling,
    // keep missing the decode nodes' prefix caches and go to the prefill
    // node.
    let (catalog, c) = std::thread::scope(|s| {
        let catalog = s.spawn(|| Catalog::build(24, 6, MAX_TOKENS));
        let c = ChaosCluster::start("chaos", 1, 2, 96);
        (catalog.join().unwrap(), c)
    });
    println!(
        "{} prompts with references and the cluster up after {:?} ({} form)",
        catalog.prompts.len(),
        started.elapsed(),
        if form.full { "full" } else { "short" }
    );
    let mut s = Suite::new(c, Arc::new(catalog), form);
    s.baseline();

    let hidden = |kind, min| Expect::Hidden { kind, min };
    let p0 = s.c.prefills[0].space.ip;
    let proxy = s.c.net.proxy_ip();
    s.scenario(
        "partition prefill <-> decode (10 s full)",
        hidden(Kind::Long, 3),
        |f| {
            f.begin_when_prefill_busy(|c| {
                for d in &c.decodes {
                    // The KV path (UCX, both ways) and the gRPC path, which
                    // goes through the proxy's address.
                    c.net.partition(p0, d.space.ip);
                    c.net.partition(proxy, d.space.ip);
                }
            });
            f.await_fallbacks(1);
            f.hold(f.began, Kind::Long, 3, S(10));
            f.c.net.heal_partitions();
        },
    );
    s.scenario(
        "prefill -> decode KV link at 10 Mbit/s (10 s full)",
        hidden(Kind::Long, 3),
        |f| {
            let sp = f.c.prefills[0].space.clone();
            f.begin_when_prefill_busy(|c| c.net.throttle(&sp, "10mbit"));
            f.await_fallbacks(1);
            f.hold(f.began, Kind::Long, 3, S(10));
            f.c.net.unthrottle(&sp);
        },
    );
    s.scenario(
        "decode -> prefill gRPC +200 ms, then stalled (6 + 5 s full)",
        hidden(Kind::Long, 6),
        |f| {
            f.c.proxies[0].set_latency(Duration::from_millis(200));
            f.hold(f.began, Kind::Long, 3, S(6));
            let stalled = Instant::now();
            f.c.proxies[0].set_stalled(true);
            f.await_fallbacks(1);
            f.hold(stalled, Kind::Long, 3, S(11));
            f.c.proxies[0].heal();
        },
    );
    s.scenario(
        "partition router <-> d1 (10 s full)",
        Expect::NodeLost { min: 2 },
        |f| {
            let (r, d1) = (f.c.router.space.ip, f.c.decodes[1].space.ip);
            f.c.net.partition(r, d1);
            // Streams on d1 stall and resume on the heal: the router never
            // has to drop it (its keepalive gives up after 15 s), and
            // nothing started during the fault fails. Held until d1 has
            // generated all it was asked (its streams wait in the network)
            // and d0 answered requests started since.
            f.await_decode_idle(1);
            f.hold(f.began, Kind::Any, 2, S(10));
            f.c.net.heal_partitions();
        },
    );
    s.scenario(
        "SIGSTOP prefill, SIGCONT (8 s full)",
        hidden(Kind::Long, 3),
        |f| {
            f.begin_when_prefill_busy(|c| c.prefills[0].freeze(true));
            f.await_fallbacks(1);
            f.hold(f.began, Kind::Long, 3, S(8));
            f.c.prefills[0].freeze(false);
            f.c.router.wait_members(1, 2, S(20));
        },
    );
    s.scenario(
        "SIGSTOP decode mid-stream, SIGCONT (6 s full)",
        Expect::NodeLost { min: 4 },
        freeze_decode_mid_stream,
    );
    s.scenario(
        "kill -9 prefill, restart same id",
        hidden(Kind::Long, 3),
        |f| {
            f.begin_when_prefill_busy(|c| c.prefills[0].kill9());
            f.await_fallbacks(1);
            f.hold(f.began, Kind::Long, 3, S(1));
            f.c.prefills[0].restart();
            f.c.router.wait_members(1, 2, S(20));
        },
    );
    s.scenario(
        "kill -9 decode, restart same id",
        Expect::NodeLost { min: 4 },
        |f| {
            f.c.decodes[1].kill9();
            let id = f.c.decodes[1].id.clone();
            f.notice_lost_decode(&id);
            let since = f.noticed.unwrap_or_else(Instant::now);
            f.hold(since, Kind::Any, 4, S(LEASE_TTL_S + 1));
            f.c.decodes[1].restart();
            f.c.router.wait_members(1, 2, S(20));
        },
    );
    s.scenario("kill -9 router, restart", Expect::RouterDown, |f| {
        f.c.router.kill9();
        f.hold(f.began, Kind::Any, 6, S(2));
        f.c.router.restart();
        f.c.router.wait_members(1, 2, S(20));
    });
    s.scenario(
        "etcd killed, restarted (8 s full)",
        hidden(Kind::Long, 3),
        |f| {
            f.c.etcd.kill9();
            f.hold(f.began, Kind::Long, 3, S(8));
            f.c.etcd.restart();
            f.c.router.wait_members(1, 2, S(30));
        },
    );
    s.scenario(
        "slow clients (1 token/s full, 4 short) + 30% disconnects (15 s full)",
        hidden(Kind::Slow, 1),
        |f| {
            let knobs = &f.load.knobs;
            let per_token = if f.form.full { 1000 } else { 250 };
            knobs.slow_token_ms.store(per_token, Ordering::Relaxed);
            knobs.slow.store(3, Ordering::Relaxed);
            knobs.disconnect_per_mille.store(300, Ordering::Relaxed);
            f.hold(f.began, Kind::Slow, 3, S(15));
            knobs.slow.store(0, Ordering::Relaxed);
            knobs.disconnect_per_mille.store(100, Ordering::Relaxed);
        },
    );

    println!("\n{}", Row::HEADER);
    for r in &s.rows {
        println!("{}", r.line());
    }
    println!("chaos suite wall time {:?}", started.elapsed());
    let problems: Vec<String> = s.rows.iter().flat_map(Row::problems).collect();
    assert!(problems.is_empty(), "{problems:#?}");
}

/// Freezes the decode node that is verifiably running a stream (the test's
/// own probe, started alone on an idle cluster), holds until the router
/// stopped routing to it and requests started since completed, thaws it;
/// the probe must have been stalled by the freeze (its stream resumed after
/// the thaw, or failed cleanly).
fn freeze_decode_mid_stream(f: &mut Fault) {
    let Some((probe, i)) = f.probe_decode() else {
        return;
    };
    f.c.decodes[i].freeze(true);
    let frozen = Instant::now();
    let id = f.c.decodes[i].id.clone();
    f.notice_lost_decode(&id);
    let since = f.noticed.unwrap_or_else(Instant::now);
    f.hold(since, Kind::Any, 4, S(6));
    f.c.decodes[i].freeze(false);
    let thawed = Instant::now();
    f.c.router.wait_members(1, 2, S(20));
    let r = probe.finish();
    let stalled = r.first_event.is_some_and(|t| t < frozen)
        && (r.end >= thawed || matches!(r.outcome, Outcome::Clean(_)));
    let fine = matches!(r.outcome, Outcome::Correct | Outcome::Clean(_));
    if !(stalled && fine) {
        f.problems.push(format!(
            "the probe stream on {id} was not caught mid-stream by the freeze, or ended badly: \
             {:?}, first event {:?} before the freeze, ended {:?} after the thaw",
            r.outcome,
            r.first_event.map(|t| frozen.saturating_duration_since(t)),
            r.end.checked_duration_since(thawed),
        ));
    }
}
