//! How the chaos suite runs and judges one scenario: a fresh load, a few
//! correct completions first, the fault held until the load shows what the
//! fault does to requests started during it, the heal, the recovery window
//! (observed on completions), the drain, and the checks: no request hung
//! or wrong, no KV block left in use, throughput back within the limit, and
//! the scenario's own expectation ([`Expect`]) for the requests started
//! while the fault held.
//!
//! Two forms: the short one (CI) holds each fault only until enough
//! requests started during it have ended; the full one
//! (`TANDEM_CHAOS_FULL=1`, `scripts/chaos.sh`) also holds each for its
//! fixed duration (the durations the suite always had) and measures
//! recovery over longer windows.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::ChaosCluster;
use super::load::{
    Catalog, Load, LoadConfig, Outcome, Probe, Record, Tally, recovery, window_rate,
};

/// A request still unanswered after this is hung.
pub const DEADLINE: Duration = Duration::from_secs(45);
/// Full throughput: this share of the baseline over a window, no failure.
const FULL: f64 = 0.75;
/// How long after the heal full throughput must be back.
const RECOVERY_LIMIT: Duration = Duration::from_secs(40);
/// The longest a fault is held waiting for its requests.
const HOLD_LIMIT: Duration = Duration::from_secs(30);
/// Correct completions before each fault (and before the baseline counts).
const STEADY_COMPLETIONS: usize = 6;
/// Correct completions the baseline rate is measured over (short form).
const BASELINE_COMPLETIONS: usize = 40;
const CLIENTS: usize = 6;

/// The short (CI) or the full form.
#[derive(Debug, Clone, Copy)]
pub struct Form {
    pub full: bool,
}

impl Form {
    /// `TANDEM_CHAOS_FULL=1`: the full form.
    pub fn from_env() -> Form {
        Form {
            full: std::env::var("TANDEM_CHAOS_FULL").is_ok_and(|v| v == "1"),
        }
    }

    /// Recovery is measured over windows this long.
    fn window(self) -> Duration {
        Duration::from_secs(if self.full { 4 } else { 2 })
    }

    /// Load before each fault, at least (full form).
    fn steady(self) -> Duration {
        if self.full {
            Duration::from_secs(3)
        } else {
            Duration::ZERO
        }
    }
}

/// Which requests a hold counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Any,
    /// Long prompts: the ones a decode node has prefilled remotely.
    Long,
    /// Streams read by slow clients.
    Slow,
}

impl Kind {
    fn matches(self, r: &Record) -> bool {
        match self {
            Kind::Any => true,
            Kind::Long => r.long,
            Kind::Slow => r.slow,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Any => "requests",
            Kind::Long => "long-prompt requests",
            Kind::Slow => "slow-client streams",
        }
    }
}

/// What a scenario's requests must show.
#[derive(Debug, Clone, Copy)]
pub enum Expect {
    /// Retries and the local-prefill fallback hide the fault: every request
    /// completes correctly (those in flight when it began, those started
    /// during it, those after the heal: no clean failure), and at least
    /// `min` of those started during it are of `kind` (the requests the
    /// fault is in the way of).
    Hidden { kind: Kind, min: usize },
    /// A decode node is lost: requests in flight on it, or started before
    /// the router stopped listing it ([`Fault::noticed`]; the fault's start
    /// where the router never has to, as in a partition whose streams
    /// resume on the heal) may have been routed to it and fail cleanly;
    /// every one started after completes correctly, and at least `min` do.
    NodeLost { min: usize },
    /// The router itself is down: connections fail without an HTTP answer
    /// until it is back.
    RouterDown,
}

/// A fault being held: what the scenario's closure works with.
#[derive(Debug)]
pub struct Fault<'a> {
    pub c: &'a mut ChaosCluster,
    pub load: &'a Load,
    pub catalog: &'a Catalog,
    pub form: Form,
    /// When the fault began (the closure may start it later than called,
    /// [`Fault::begin_when_prefill_busy`]).
    pub began: Instant,
    /// When the router stopped listing the lost node.
    pub noticed: Option<Instant>,
    /// The decode nodes' fallback and retry counts when the scenario began.
    pub fallbacks_before: Vec<f64>,
    /// What went wrong while holding (reported with the scenario).
    pub problems: Vec<String>,
}

impl Fault<'_> {
    /// Waits until the prefill node holds a prompt (waiting, computing it,
    /// or sending its KV), so that the fault cuts a remote prefill in
    /// flight, applies `fault` and marks the fault's start.
    pub fn begin_when_prefill_busy(&mut self, fault: impl FnOnce(&mut ChaosCluster)) {
        let deadline = Instant::now() + Duration::from_secs(20);
        let busy = |n: &super::NsNode| {
            n.health().is_some_and(|h| {
                ["waiting", "running", "exported"]
                    .iter()
                    .any(|k| h[*k].as_u64().is_some_and(|v| v > 0))
            })
        };
        while !busy(&self.c.prefills[0]) {
            if Instant::now() >= deadline {
                self.problems
                    .push("the prefill node held no prompt in 20 s".into());
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        fault(self.c);
        self.began = Instant::now();
    }

    /// Holds the fault until the decode nodes have prefilled `n` prompts
    /// locally after failed remote attempts (or retried them elsewhere)
    /// since the scenario began: the fault was met, and the fallback ran.
    /// Gives up after [`HOLD_LIMIT`], noting it.
    pub fn await_fallbacks(&mut self, n: usize) {
        let deadline = Instant::now() + HOLD_LIMIT;
        loop {
            let got = self.c.fallbacks_since(&self.fallbacks_before);
            if got >= n as f64 {
                return;
            }
            if Instant::now() >= deadline {
                self.problems.push(format!(
                    "only {got} of {n} fallbacks to local prefill within {HOLD_LIMIT:?}"
                ));
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Holds the fault until `n` requests of `kind` started at or after
    /// `since` have been answered (correctly or not; not those whose client
    /// hung up), and in the full form until `full` after the fault began
    /// too. Gives up after [`HOLD_LIMIT`], noting it.
    pub fn hold(&mut self, since: Instant, kind: Kind, n: usize, full: Duration) {
        let ended = |rs: &[Record]| {
            rs.iter()
                .filter(|r| r.start >= since && kind.matches(r) && r.outcome != Outcome::Aborted)
                .count()
        };
        if !self
            .load
            .wait_until(since + HOLD_LIMIT, |rs, _| ended(rs) >= n)
        {
            let got = ended(&self.load.records());
            self.problems.push(format!(
                "only {got} of {n} {} started during the fault ended within {HOLD_LIMIT:?}",
                kind.name()
            ));
        }
        if self.form.full {
            // The full form's fixed duration: nothing to wait for but time.
            self.load.wait_until(self.began + full, |_, _| false);
        }
    }

    /// Waits until the router no longer lists decode node `id` and notes
    /// when ([`Expect::NodeLost`] judges from then on).
    pub fn notice_lost_decode(&mut self, id: &str) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let h = self.c.router.health().unwrap_or_default();
            let listed = h["decode_workers"]
                .as_array()
                .is_some_and(|ws| ws.iter().any(|w| w == id));
            if h.is_object() && !listed {
                self.noticed = Some(Instant::now());
                return;
            }
            if Instant::now() >= deadline {
                self.problems.push(format!(
                    "the router still lists {id} 20 s into its fault: {h}"
                ));
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until decode node `i` runs and waits for nothing: cut off from
    /// the router, it has generated what it was asked, and the streams it
    /// served wait in the network.
    pub fn await_decode_idle(&mut self, i: usize) {
        let deadline = Instant::now() + Duration::from_secs(20);
        let idle = |n: &super::NsNode| {
            n.health().is_some_and(|h| {
                ["waiting", "running"]
                    .iter()
                    .all(|k| h[*k].as_u64() == Some(0))
            })
        };
        while !idle(&self.c.decodes[i]) {
            if Instant::now() >= deadline {
                let id = &self.c.decodes[i].id;
                self.problems.push(format!("{id} was never idle in 20 s"));
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Pauses the load until nothing runs, starts a [`Probe`] stream, waits
    /// for its first event and resumes the load: returns the probe and the
    /// index of the one decode node running it. `None` (noted) if no
    /// stream ever ran.
    pub fn probe_decode(&mut self) -> Option<(Probe, usize)> {
        let deadline = Instant::now() + DEADLINE;
        let found = self.find_probe_node(deadline);
        self.load.resume();
        if found.is_none() {
            self.problems
                .push("no stream was ever running on a decode node".into());
        }
        found
    }

    fn find_probe_node(&self, deadline: Instant) -> Option<(Probe, usize)> {
        if !self.load.pause(deadline) {
            return None;
        }
        let running = |d: &super::NsNode| {
            d.health()
                .map_or(u64::MAX, |h| h["running"].as_u64().unwrap_or(u64::MAX))
        };
        while self.c.decodes.iter().any(|d| running(d) != 0) {
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let probe = Probe::start(self.c.router.addr(), self.catalog, DEADLINE);
        while probe.first_event().is_none() {
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        // Its first token may come from the prefill node while its KV is
        // still landing: the node holds it once it runs there.
        loop {
            if let Some(node) = self.c.decodes.iter().position(|d| running(d) > 0) {
                return Some((probe, node));
            }
            if Instant::now() >= deadline || probe.is_finished() {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// One scenario's figures.
#[derive(Debug)]
pub struct Row {
    pub name: &'static str,
    pub tally: Tally,
    /// Of the requests started while the fault held.
    pub during: Tally,
    /// Fallbacks to local prefill (and retries) the decode nodes counted.
    pub fallbacks: f64,
    pub correct_after_heal: usize,
    pub leaked: Vec<(String, u64)>,
    pub recovery: Option<Duration>,
    /// Whether connections may fail without an HTTP answer.
    pub transport_ok: bool,
    pub problems: Vec<String>,
    pub wall: Duration,
}

impl Row {
    pub fn line(&self) -> String {
        let leaked: u64 = self.leaked.iter().map(|(_, u)| u).sum();
        format!(
            "| {} | {} | {} | {} | {} / {} / {} | {} | {} | {} | {} | {} | {:.0?} |",
            self.name,
            self.tally.started,
            self.tally.correct,
            self.tally.clean_summary(),
            self.during.started,
            self.during.correct,
            self.during.started - self.during.correct - self.during.aborted,
            self.fallbacks,
            self.tally.hung,
            self.tally.wrong.len(),
            leaked,
            self.recovery.map_or_else(
                || format!("not within {RECOVERY_LIMIT:?}"),
                |d| format!("{:.1} s", d.as_secs_f64())
            ),
            self.wall,
        )
    }

    pub const HEADER: &'static str = "| scenario | started | correct | clean failures (codes) | \
         during the fault: started / correct / failed | fallbacks | hung | wrong | leaked blocks \
         | recovery time | wall |\n|---|---|---|---|---|---|---|---|---|---|---|";

    /// Everything this scenario got wrong.
    pub fn problems(&self) -> Vec<String> {
        let mut p: Vec<String> = self
            .problems
            .iter()
            .map(|m| format!("{}: {m}", self.name))
            .collect();
        let leaked: u64 = self.leaked.iter().map(|(_, u)| u).sum();
        let mut add = |ok: bool, what: String| {
            if !ok {
                p.push(format!("{}: {what}", self.name));
            }
        };
        add(self.tally.hung == 0, format!("{} hung", self.tally.hung));
        add(leaked == 0, format!("blocks left in use {:?}", self.leaked));
        add(
            self.tally.wrong.is_empty(),
            format!("wrong answers {:?}", self.tally.wrong),
        );
        add(
            self.transport_ok || self.tally.transport.is_empty(),
            format!("failures without an HTTP error {:?}", self.tally.transport),
        );
        add(
            self.correct_after_heal > 0,
            "nothing completed after the heal".into(),
        );
        add(
            self.recovery.is_some(),
            format!("throughput not back to {FULL} of baseline within {RECOVERY_LIMIT:?}"),
        );
        p
    }
}

/// The requests started in `[from, to)`.
fn started_in(records: &[Record], from: Instant, to: Instant) -> Vec<Record> {
    records
        .iter()
        .filter(|r| r.start >= from && r.start < to)
        .cloned()
        .collect()
}

/// What `expect` finds wrong with a scenario's requests (its fault held
/// from `began` to `healed`).
pub fn check_expectation(
    expect: Expect,
    records: &[Record],
    began: Instant,
    noticed: Option<Instant>,
    healed: Instant,
) -> Vec<String> {
    let mut p = Vec::new();
    let describe = |rs: &[Record]| {
        let t = Tally::of(rs);
        format!("{} correct, failures: {}", t.correct, t.clean_summary())
    };
    let all_correct = |rs: &[Record], what: &str, p: &mut Vec<String>| {
        if rs.iter().any(Record::failed) {
            p.push(format!("{what} failed: {}", describe(rs)));
        }
    };
    match expect {
        Expect::Hidden { kind, min } => {
            all_correct(records, "requests", &mut p);
            let during = started_in(records, began, healed);
            let ok = during
                .iter()
                .filter(|r| kind.matches(r) && r.outcome == Outcome::Correct)
                .count();
            if ok < min {
                p.push(format!(
                    "only {ok} {} started during the fault completed correctly, want {min}",
                    kind.name()
                ));
            }
        }
        Expect::NodeLost { min } => {
            let from = noticed.unwrap_or(began);
            let after = started_in(records, from, healed);
            all_correct(
                &after,
                "requests started after the router stopped routing to the lost node",
                &mut p,
            );
            let ok = after
                .iter()
                .filter(|r| r.outcome == Outcome::Correct)
                .count();
            if ok < min {
                p.push(format!(
                    "only {ok} requests started after the node was lost completed correctly, \
                     want {min}"
                ));
            }
        }
        Expect::RouterDown => {}
    }
    p
}

/// When a scenario began, its fault began and healed, and how it ended.
#[derive(Debug)]
struct Span {
    t0: Instant,
    began: Instant,
    healed: Instant,
    recovery: Option<Duration>,
    transport_ok: bool,
    fallbacks: f64,
}

/// The suite: one cluster, scenarios run one after another.
#[derive(Debug)]
pub struct Suite {
    pub c: ChaosCluster,
    pub catalog: Arc<Catalog>,
    pub form: Form,
    pub baseline: f64,
    pub rows: Vec<Row>,
    seed: u64,
}

impl Suite {
    pub fn new(c: ChaosCluster, catalog: Arc<Catalog>, form: Form) -> Suite {
        Suite {
            c,
            catalog,
            form,
            baseline: 0.0,
            rows: Vec::new(),
            seed: 0,
        }
    }

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

    /// Waits for `n` correct completions (and in the full form `steady`
    /// since the load began); the moment they were reached.
    fn warm(&self, load: &Load, n: usize, problems: &mut Vec<String>) -> Instant {
        let t0 = Instant::now();
        let correct = |rs: &[Record]| rs.iter().filter(|r| r.outcome == Outcome::Correct).count();
        if !load.wait_until(t0 + Duration::from_secs(60), |rs, _| correct(rs) >= n) {
            problems.push(format!("fewer than {n} correct completions within 60 s"));
        }
        load.wait_until(t0 + self.form.steady(), |_, _| false);
        Instant::now()
    }

    /// The baseline: correct completions per recovery window, no fault.
    pub fn baseline(&mut self) {
        let t0 = Instant::now();
        let load = self.load();
        let mut problems = Vec::new();
        let from = self.warm(&load, STEADY_COMPLETIONS, &mut problems);
        let correct_since = |rs: &[Record]| {
            rs.iter()
                .filter(|r| r.start >= from && r.outcome == Outcome::Correct)
                .count()
        };
        load.wait_until(from + Duration::from_secs(60), |rs, _| {
            correct_since(rs) >= BASELINE_COMPLETIONS
        });
        if self.form.full {
            load.wait_until(t0 + Duration::from_secs(12), |_, _| false);
        }
        let to = Instant::now();
        let records = load.stop();
        self.baseline = window_rate(&records, from, to, self.form.window());
        println!(
            "baseline: {:.2} correct completions/s over {:?} windows",
            self.baseline,
            self.form.window()
        );
        if self.baseline <= 0.0 {
            problems.push("no throughput at all".into());
        }
        let span = Span {
            t0,
            began: t0,
            healed: t0,
            recovery: Some(Duration::ZERO),
            transport_ok: false,
            fallbacks: 0.0,
        };
        let row = self.judge("no fault (baseline)", &records, problems, &span);
        self.rows.push(row);
    }

    /// Runs `fault` under a fresh load and judges it by `expect`; `fault`
    /// returns once it healed the fault.
    pub fn scenario(&mut self, name: &'static str, expect: Expect, fault: impl FnOnce(&mut Fault)) {
        if let Ok(only) = std::env::var("TANDEM_CHAOS_ONLY")
            && !name.contains(only.as_str())
        {
            return;
        }
        let t0 = Instant::now();
        println!("--- {name}");
        let load = self.load();
        let mut problems = Vec::new();
        self.warm(&load, STEADY_COMPLETIONS, &mut problems);
        let fallbacks_before = self.c.fallbacks();
        let mut f = Fault {
            c: &mut self.c,
            load: &load,
            catalog: &self.catalog,
            form: self.form,
            began: Instant::now(),
            noticed: None,
            fallbacks_before,
            problems,
        };
        fault(&mut f);
        let (began, noticed, mut problems) = (f.began, f.noticed, f.problems);
        let fallbacks_before = f.fallbacks_before;
        let healed = Instant::now();
        let (baseline, window) = (self.baseline, self.form.window());
        load.wait_until(healed + RECOVERY_LIMIT, |rs, _| {
            recovery(rs, healed, baseline, FULL, window).is_some()
        });
        let records = load.stop();
        let rec = recovery(&records, healed, baseline, FULL, window);
        problems.extend(check_expectation(expect, &records, began, noticed, healed));
        let span = Span {
            t0,
            began,
            healed,
            recovery: rec,
            transport_ok: matches!(expect, Expect::RouterDown),
            fallbacks: self.c.fallbacks_since(&fallbacks_before),
        };
        let row = self.judge(name, &records, problems, &span);
        self.rows.push(row);
    }

    /// Drains the nodes and tallies what the scenario's load saw.
    fn judge(
        &self,
        name: &'static str,
        records: &[Record],
        problems: Vec<String>,
        s: &Span,
    ) -> Row {
        let correct_after_heal = records
            .iter()
            .filter(|r| r.start >= s.healed && r.outcome == Outcome::Correct)
            .count();
        let settled = self.c.settle(Duration::from_secs(30));
        for (id, used, h) in &settled {
            if *used > 0 {
                println!("{name}: {id} still busy after the load drained: {h}");
            }
        }
        let row = Row {
            name,
            tally: Tally::of(records),
            during: Tally::of(&started_in(records, s.began, s.healed)),
            fallbacks: s.fallbacks,
            correct_after_heal,
            leaked: settled.into_iter().map(|(id, u, _)| (id, u)).collect(),
            recovery: s.recovery,
            transport_ok: s.transport_ok,
            problems,
            wall: s.t0.elapsed(),
        };
        println!("{}", row.line());
        for w in row.tally.wrong.iter().take(5) {
            println!("  WRONG: {w}");
        }
        let at = |t: Instant| {
            let (d, sign) = match t.checked_duration_since(s.began) {
                Some(d) => (d, ""),
                None => (s.began - t, "-"),
            };
            format!("{sign}{:.2} s", d.as_secs_f64())
        };
        for r in records.iter().filter(|r| r.failed()).take(8) {
            println!(
                "  FAILED: started {} ended {} after the fault began (healed at {}): {:?}{}{}",
                at(r.start),
                at(r.end),
                at(s.healed),
                r.outcome,
                if r.long { ", long" } else { "" },
                if r.stream { ", stream" } else { "" },
            );
        }
        for p in &row.problems {
            println!("  PROBLEM: {p}");
        }
        row
    }
}
