//! The chaos suite: a 1P2D cluster whose every process (etcd, router,
//! prefill and decode nodes) has its own network namespace, KV moving over
//! UCX/TCP on the namespaces' veths, the decode -> prefill gRPC path
//! through a fault proxy. Each scenario runs under a steady mixed load
//! (greedy completions and chats, streamed and not, short and long
//! prompts, clients hanging up at random) and is judged on: requests that
//! completed correctly (greedy output equal to the engine's reference),
//! failed cleanly (an HTTP error or an error event in OpenAI's shape, with
//! its code), hung (past a hard deadline: must be 0), KV blocks still in
//! use on any node once the load drained (must be 0), and the time from
//! the heal to the first window of full throughput.
//!
//! `TANDEM_CHAOS_ONLY=TEXT` runs only the scenarios whose name contains
//! TEXT (after the baseline); `TANDEM_CHAOS_DECODE_FLAGS` adds flags to the
//! decode nodes (experiments, e.g. `--quarantine-limit-secs 30`).
//!
//! Needs root (network namespaces, veth, policy rules, tbf), etcd, libucx,
//! the release binary and `TANDEM_TEST_GGUF`. Without namespaces it fails,
//! it never skips.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tandem_tests::chaos::load::{Catalog, Load, LoadConfig, Record, Tally, recovery, throughput};
use tandem_tests::chaos::{ChaosCluster, LEASE_TTL_S};

const MAX_TOKENS: usize = 12;
const CLIENTS: usize = 6;
/// A request still unanswered after this is hung.
const DEADLINE: Duration = Duration::from_secs(45);
/// Load before each fault.
const STEADY: Duration = Duration::from_secs(3);
/// Full throughput: this share of the baseline over WINDOW, no failure.
const FULL: f64 = 0.75;
const WINDOW: Duration = Duration::from_secs(4);
/// How long after the heal full throughput must be back.
const RECOVERY_LIMIT: Duration = Duration::from_secs(40);

struct Row {
    name: &'static str,
    tally: Tally,
    correct_after_heal: usize,
    leaked: Vec<(String, u64)>,
    recovery: Option<Duration>,
    /// Whether connections may fail without an HTTP answer (the router
    /// itself was killed).
    transport_ok: bool,
    wall: Duration,
}

struct Suite {
    c: ChaosCluster,
    catalog: Arc<Catalog>,
    baseline: f64,
    rows: Vec<Row>,
    seed: u64,
}

impl Suite {
    fn load(&mut self) -> Load {
        self.seed += 1;
        Load::start(
            self.c.router.addr(),
            Arc::clone(&self.catalog),
            &LoadConfig {
                clients: CLIENTS,
                deadline: DEADLINE,
                seed: self.seed,
                disconnect_per_mille: 100,
            },
        )
    }

    /// Runs `fault` under load; it returns when the fault is healed.
    fn scenario(
        &mut self,
        name: &'static str,
        transport_ok: bool,
        fault: impl FnOnce(&mut ChaosCluster, &Load),
    ) {
        if let Ok(only) = std::env::var("TANDEM_CHAOS_ONLY")
            && !name.contains(only.as_str())
        {
            return;
        }
        let t0 = Instant::now();
        println!("--- {name}");
        let load = self.load();
        std::thread::sleep(STEADY);
        fault(&mut self.c, &load);
        let healed = Instant::now();
        // Until a full window after the heal, or the limit.
        let mut rec = None;
        while healed.elapsed() < RECOVERY_LIMIT {
            std::thread::sleep(Duration::from_millis(500));
            rec = recovery(&load.records(), healed, self.baseline, FULL, WINDOW);
            if rec.is_some() {
                break;
            }
        }
        let records = load.stop();
        let row = self.judge(name, &records, healed, rec, transport_ok, t0);
        self.rows.push(row);
    }

    fn judge(
        &self,
        name: &'static str,
        records: &[Record],
        healed: Instant,
        recovery: Option<Duration>,
        transport_ok: bool,
        t0: Instant,
    ) -> Row {
        let tally = Tally::of(records);
        let correct_after_heal = records
            .iter()
            .filter(|r| {
                r.start >= healed && r.outcome == tandem_tests::chaos::load::Outcome::Correct
            })
            .count();
        let settled = self.c.settle(Duration::from_secs(30));
        for (id, used, h) in &settled {
            if *used > 0 {
                println!("{name}: {id} still busy after the load drained: {h}");
            }
        }
        let row = Row {
            name,
            tally,
            correct_after_heal,
            leaked: settled.into_iter().map(|(id, u, _)| (id, u)).collect(),
            recovery,
            transport_ok,
            wall: t0.elapsed(),
        };
        println!("{}", line(&row));
        for w in row.tally.wrong.iter().take(5) {
            println!("  WRONG: {w}");
        }
        row
    }
}

fn line(r: &Row) -> String {
    let leaked: u64 = r.leaked.iter().map(|(_, u)| u).sum();
    format!(
        "| {} | {} | {} | {} | {} | {} | {} | {} | {:.0?} |",
        r.name,
        r.tally.started,
        r.tally.correct,
        r.tally.clean_summary(),
        r.tally.hung,
        r.tally.wrong.len(),
        leaked,
        r.recovery.map_or_else(
            || format!("not within {RECOVERY_LIMIT:?}"),
            |d| format!("{:.1} s", d.as_secs_f64())
        ),
        r.wall,
    )
}

#[test]
fn chaos_scenarios_under_steady_mixed_load() {
    let started = Instant::now();
    // References first (the engine in this process), then the cluster.
    let catalog = Arc::new(Catalog::build(24, 6, MAX_TOKENS));
    println!(
        "{} prompts with references in {:?}",
        catalog.prompts.len(),
        started.elapsed()
    );
    // A small decode KV pool (96 blocks) so that the long prompts, cycling,
    // keep missing the decode nodes' prefix caches and go to the prefill
    // node.
    let c = ChaosCluster::start("chaos", 1, 2, 96);
    println!("cluster up after {:?}", started.elapsed());
    let mut s = Suite {
        c,
        catalog,
        baseline: 0.0,
        rows: Vec::new(),
        seed: 0,
    };

    // Baseline: steady load, no fault.
    {
        let t0 = Instant::now();
        let load = s.load();
        std::thread::sleep(Duration::from_secs(12));
        let records = load.stop();
        let from = t0 + Duration::from_secs(3);
        let to = records.iter().map(|r| r.end).max().unwrap();
        s.baseline = throughput(&records, from, to);
        println!("baseline: {:.2} correct completions/s", s.baseline);
        let row = s.judge(
            "no fault (baseline)",
            &records,
            t0,
            Some(Duration::ZERO),
            false,
            t0,
        );
        s.rows.push(row);
        assert!(s.baseline > 0.0);
    }

    let p0 = s.c.prefills[0].space.ip;
    let proxy = s.c.net.proxy_ip();
    s.scenario("partition prefill <-> decode 10 s", false, |c, _| {
        for d in &c.decodes {
            // The KV path (UCX, both ways) and the gRPC path, which goes
            // through the proxy's address.
            c.net.partition(p0, d.space.ip);
            c.net.partition(proxy, d.space.ip);
        }
        std::thread::sleep(Duration::from_secs(10));
        c.net.heal_partitions();
    });
    s.scenario("prefill -> decode KV link at 10 Mbit/s", false, |c, _| {
        let sp = c.prefills[0].space.clone();
        c.net.throttle(&sp, "10mbit");
        std::thread::sleep(Duration::from_secs(10));
        c.net.unthrottle(&sp);
    });
    s.scenario(
        "decode -> prefill gRPC +200 ms, then stalled",
        false,
        |c, _| {
            c.proxies[0].set_latency(Duration::from_millis(200));
            std::thread::sleep(Duration::from_secs(6));
            c.proxies[0].set_stalled(true);
            std::thread::sleep(Duration::from_secs(5));
            c.proxies[0].heal();
        },
    );
    s.scenario("partition router <-> d1 10 s", false, |c, _| {
        let (r, d1) = (c.router.space.ip, c.decodes[1].space.ip);
        c.net.partition(r, d1);
        std::thread::sleep(Duration::from_secs(10));
        c.net.heal_partitions();
    });
    s.scenario("SIGSTOP prefill 8 s, SIGCONT", false, |c, _| {
        c.prefills[0].freeze(true);
        std::thread::sleep(Duration::from_secs(8));
        c.prefills[0].freeze(false);
        c.router.wait_members(1, 2, Duration::from_secs(20));
    });
    s.scenario("SIGSTOP decode mid-stream 6 s, SIGCONT", false, |c, _| {
        let d0 = &c.decodes[0];
        let deadline = Instant::now() + Duration::from_secs(10);
        while d0.health().is_some_and(|h| h["running"] == 0) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        d0.freeze(true);
        std::thread::sleep(Duration::from_secs(6));
        d0.freeze(false);
        c.router.wait_members(1, 2, Duration::from_secs(20));
    });
    s.scenario("kill -9 prefill, restart same id", false, |c, _| {
        c.prefills[0].kill9();
        std::thread::sleep(Duration::from_secs(1));
        c.prefills[0].restart();
        c.router.wait_members(1, 2, Duration::from_secs(20));
    });
    s.scenario("kill -9 decode, restart same id", false, |c, _| {
        c.decodes[1].kill9();
        std::thread::sleep(Duration::from_secs(LEASE_TTL_S + 1));
        c.decodes[1].restart();
        c.router.wait_members(1, 2, Duration::from_secs(20));
    });
    s.scenario("kill -9 router, restart", true, |c, _| {
        c.router.kill9();
        std::thread::sleep(Duration::from_secs(2));
        c.router.restart();
        c.router.wait_members(1, 2, Duration::from_secs(20));
    });
    s.scenario("etcd killed 8 s, restarted", false, |c, _| {
        c.etcd.kill9();
        std::thread::sleep(Duration::from_secs(8));
        c.etcd.restart();
        c.router.wait_members(1, 2, Duration::from_secs(30));
    });
    s.scenario(
        "slow clients (1 token/s) + 30% disconnects",
        false,
        |_, load| {
            load.knobs.slow.store(3, Ordering::Relaxed);
            load.knobs
                .disconnect_per_mille
                .store(300, Ordering::Relaxed);
            std::thread::sleep(Duration::from_secs(15));
            load.knobs.slow.store(0, Ordering::Relaxed);
            load.knobs
                .disconnect_per_mille
                .store(100, Ordering::Relaxed);
        },
    );

    println!(
        "\n| scenario | started | correct | clean failures (codes) | hung | wrong | leaked blocks | \
         recovery time | wall |\n|---|---|---|---|---|---|---|---|---|"
    );
    for r in &s.rows {
        println!("{}", line(r));
    }
    println!("chaos suite wall time {:?}", started.elapsed());

    let mut problems = Vec::new();
    for r in &s.rows {
        let leaked: u64 = r.leaked.iter().map(|(_, u)| u).sum();
        if r.tally.hung > 0 {
            problems.push(format!("{}: {} hung", r.name, r.tally.hung));
        }
        if leaked > 0 {
            problems.push(format!("{}: blocks left in use {:?}", r.name, r.leaked));
        }
        if !r.tally.wrong.is_empty() {
            problems.push(format!("{}: wrong answers {:?}", r.name, r.tally.wrong));
        }
        if !r.transport_ok && !r.tally.transport.is_empty() {
            problems.push(format!(
                "{}: failures without an HTTP error {:?}",
                r.name, r.tally.transport
            ));
        }
        if r.correct_after_heal == 0 {
            problems.push(format!("{}: nothing completed after the heal", r.name));
        }
        if r.recovery.is_none() {
            problems.push(format!(
                "{}: throughput not back to {FULL} of baseline within {RECOVERY_LIMIT:?}",
                r.name
            ));
        }
    }
    assert!(problems.is_empty(), "{problems:#?}");
}
