//! A discrete-event simulator of a Tandem deployment, timed by measured
//! [`EngineProfile`]s.
//!
//! Requests arrive as a Poisson process, pay the router's cost, and land on
//! a node. Every node runs the scheduler's loop: a step holds the running
//! sequences (oldest first: one decode token each, or their next prompt
//! chunk), then waiting prompts in arrival order, up to `max_batch_size`
//! sequences and `token_budget` tokens; a step lasts
//! [`EngineProfile::step_seconds`] of its prompt tokens and decode batch, and
//! requests arriving meanwhile wait for the next step. A prompt's last chunk
//! samples the first token at the end of its step; every later step gives
//! each decoding sequence one token.
//!
//! * Aggregated: N replicas behind the router (least loaded first), each
//!   prefilling and decoding its own requests.
//! * Disaggregated: P prefill nodes (the same loop, every request stopping
//!   after its first token) and D decode nodes. A prompt with at least
//!   `remote_prefill_min_tokens` uncached tokens is prefilled remotely: its
//!   KV is written to the decode node layer by layer while the prefill runs,
//!   so only the transfer time beyond the prefill step is added, plus a
//!   fixed latency; then it joins the decode node's batch. Shorter prompts
//!   are prefilled on the decode node, as `tandem decode` does.
//!
//! Not modelled: KV-pool capacity (no preemption), prefix-cache placement (a
//! request's shared prefix is a hit on whichever node computes it), the
//! cost of sampling and streaming beyond the fixed per-step overhead.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, VecDeque};
use std::fmt;
use std::str::FromStr;

use serde::Serialize;
use tandem_types::SeededRng;

use crate::EngineProfile;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SimError {
    #[error("invalid length {0:?}: {1}")]
    Length(String, String),
    #[error("invalid topology {0:?}: {1}")]
    Topology(String, String),
    #[error("invalid workload: {0}")]
    Workload(String),
    #[error("invalid cluster parameters: {0}")]
    Params(String),
    #[error("no profile measured at TP {0} (profiles given: TP {1})")]
    NoProfile(usize, String),
}

/// A distribution of token counts.
#[derive(Debug, Clone, PartialEq)]
pub enum LenDist {
    Fixed(usize),
    /// Uniform over `lo..=hi`.
    Uniform(usize, usize),
    /// Uniform over the listed values.
    List(Vec<usize>),
}

impl LenDist {
    pub fn sample(&self, rng: &mut SeededRng) -> usize {
        match self {
            Self::Fixed(n) => *n,
            Self::Uniform(lo, hi) => rng.range(*lo, *hi),
            Self::List(v) => v.get(rng.below(v.len())).copied().unwrap_or(1),
        }
    }

    pub fn mean(&self) -> f64 {
        match self {
            Self::Fixed(n) => *n as f64,
            Self::Uniform(lo, hi) => (*lo + *hi) as f64 / 2.0,
            Self::List(v) => v.iter().sum::<usize>() as f64 / v.len().max(1) as f64,
        }
    }

    pub fn max(&self) -> usize {
        match self {
            Self::Fixed(n) => *n,
            Self::Uniform(_, hi) => *hi,
            Self::List(v) => v.iter().copied().max().unwrap_or(1),
        }
    }
}

/// `128` (fixed), `64:256` (uniform, inclusive) or `32,64,512` (one of the
/// listed, equally likely); every value at least 1.
impl FromStr for LenDist {
    type Err = SimError;

    fn from_str(s: &str) -> Result<Self, SimError> {
        let bad = |m: &str| SimError::Length(s.to_string(), m.to_string());
        let num = |t: &str| -> Result<usize, SimError> {
            match t.trim().parse::<usize>() {
                Ok(0) => Err(bad("lengths must be at least 1")),
                Ok(n) => Ok(n),
                Err(_) => Err(bad("expected N, LO:HI or N,N,...")),
            }
        };
        if let Some((lo, hi)) = s.split_once(':') {
            let (lo, hi) = (num(lo)?, num(hi)?);
            if lo > hi {
                return Err(bad("LO must not exceed HI"));
            }
            return Ok(Self::Uniform(lo, hi));
        }
        if s.contains(',') {
            return s
                .split(',')
                .map(num)
                .collect::<Result<_, _>>()
                .map(Self::List);
        }
        num(s).map(Self::Fixed)
    }
}

impl fmt::Display for LenDist {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Fixed(n) => write!(f, "{n}"),
            Self::Uniform(lo, hi) => write!(f, "{lo}:{hi}"),
            Self::List(v) => {
                let s: Vec<String> = v.iter().map(ToString::to_string).collect();
                write!(f, "{}", s.join(","))
            }
        }
    }
}

/// The offered load.
#[derive(Debug, Clone, PartialEq)]
pub struct Workload {
    /// Poisson arrivals per second.
    pub rate: f64,
    pub input: LenDist,
    pub output: LenDist,
    /// Share of each prompt that is a prefix already cached (rounded down to
    /// whole KV blocks; at least one token is always computed).
    pub prefix_share: f64,
    pub requests: usize,
    pub seed: u64,
}

impl Workload {
    pub fn validate(&self) -> Result<(), SimError> {
        let bad = |m: &str| Err(SimError::Workload(m.to_string()));
        if !(self.rate.is_finite() && self.rate > 0.0) {
            return bad("the arrival rate must be positive");
        }
        if !(0.0..1.0).contains(&self.prefix_share) {
            return bad("the prefix share must be in [0, 1)");
        }
        if self.requests == 0 {
            return bad("at least one request");
        }
        Ok(())
    }

    /// The requests, deterministic for a seed: arrival gaps first, then
    /// input and output lengths, from one generator.
    pub fn requests(&self, block_size: usize) -> Vec<Request> {
        let mut rng = SeededRng::new(self.seed);
        let mut t = 0.0;
        (0..self.requests)
            .map(|_| {
                // In (0, 1]: never ln(0).
                let u = rng.unit_f64() + f64::EPSILON / 2.0;
                t += -u.ln() / self.rate;
                let input = self.input.sample(&mut rng).max(1);
                let output = self.output.sample(&mut rng).max(1);
                let block = block_size.max(1);
                let shared = (input as f64 * self.prefix_share) as usize / block * block;
                Request {
                    arrival: t,
                    input,
                    cached: shared.min(input - 1),
                    output,
                }
            })
            .collect()
    }
}

/// One simulated request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Request {
    pub arrival: f64,
    /// Prompt tokens.
    pub input: usize,
    /// Prompt tokens already in the prefix cache.
    pub cached: usize,
    /// Tokens generated (the first included).
    pub output: usize,
}

/// The service-level objective a request must meet to count as goodput.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Slo {
    pub ttft_s: f64,
    pub tpot_s: f64,
}

/// What the profiles do not say about a deployment.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ClusterParams {
    /// Router (or front end) time added before a request reaches a node.
    pub router_s: f64,
    /// KV transfer bandwidth between a prefill and a decode node, bytes/s.
    pub dkv_bytes_per_s: f64,
    /// Fixed cost of a KV handoff (the Prefill round trip, the grant, the
    /// flush and the landing check).
    pub dkv_latency_s: f64,
    /// K and V bytes of one token over all layers (f16 pools).
    pub kv_bytes_per_token: f64,
    pub max_batch_size: usize,
    /// Most tokens (prompt chunks plus decode tokens) in one step.
    pub token_budget: usize,
    /// A decode node prefills prompts with fewer uncached tokens itself.
    pub remote_prefill_min_tokens: usize,
    pub block_size: usize,
    /// Time a step costs beyond its forward call (planning, sampling,
    /// events).
    pub step_overhead_s: f64,
}

impl Default for ClusterParams {
    /// `tandem serve` / `tandem decode`'s defaults; the KV size is
    /// SmolLM2-135M's (30 layers x 3 KV heads x 64 x K,V x 2 bytes).
    fn default() -> Self {
        Self {
            router_s: 200e-6,
            dkv_bytes_per_s: 2e9,
            dkv_latency_s: 1e-3,
            kv_bytes_per_token: 23_040.0,
            max_batch_size: 32,
            token_budget: 2048,
            remote_prefill_min_tokens: 64,
            block_size: 16,
            step_overhead_s: 0.0,
        }
    }
}

impl ClusterParams {
    pub fn validate(&self) -> Result<(), SimError> {
        let bad = |m: &str| Err(SimError::Params(m.to_string()));
        let nonneg = |x: f64| x.is_finite() && x >= 0.0;
        if !(nonneg(self.router_s) && nonneg(self.dkv_latency_s) && nonneg(self.step_overhead_s)) {
            return bad("times must be finite and not negative");
        }
        if !(self.dkv_bytes_per_s.is_finite() && self.dkv_bytes_per_s > 0.0) {
            return bad("the KV transfer bandwidth must be positive");
        }
        if !nonneg(self.kv_bytes_per_token) {
            return bad("KV bytes per token must not be negative");
        }
        if self.max_batch_size == 0 || self.token_budget < self.max_batch_size {
            return bad("the token budget must be at least the batch size, which is at least 1");
        }
        if self.block_size == 0 {
            return bad("the block size must be at least 1");
        }
        Ok(())
    }
}

/// How the nodes are arranged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Topology {
    /// `agg:N[:tpT]`: N replicas of TP T, each prefilling and decoding.
    Aggregated { replicas: usize, tp: usize },
    /// `PpDd[:tpA[/tpB]]`: P prefill nodes of TP A, D decode nodes of TP B.
    Disaggregated {
        prefill: usize,
        prefill_tp: usize,
        decode: usize,
        decode_tp: usize,
    },
}

impl Topology {
    /// Node units: every TP rank counts as one.
    pub fn units(&self) -> usize {
        match *self {
            Self::Aggregated { replicas, tp } => replicas * tp,
            Self::Disaggregated {
                prefill,
                prefill_tp,
                decode,
                decode_tp,
            } => prefill * prefill_tp + decode * decode_tp,
        }
    }
}

impl fmt::Display for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::Aggregated { replicas, tp: 1 } => write!(f, "agg:{replicas}"),
            Self::Aggregated { replicas, tp } => write!(f, "agg:{replicas}:tp{tp}"),
            Self::Disaggregated {
                prefill,
                prefill_tp,
                decode,
                decode_tp,
            } => {
                write!(f, "{prefill}p{decode}d")?;
                match (prefill_tp, decode_tp) {
                    (1, 1) => Ok(()),
                    (a, b) if a == b => write!(f, ":tp{a}"),
                    (a, b) => write!(f, ":tp{a}/tp{b}"),
                }
            }
        }
    }
}

impl FromStr for Topology {
    type Err = SimError;

    fn from_str(s: &str) -> Result<Self, SimError> {
        let bad = |m: &str| SimError::Topology(s.to_string(), m.to_string());
        let count = |t: &str| -> Result<usize, SimError> {
            match t.parse::<usize>() {
                Ok(0) | Err(_) => Err(bad("counts must be whole numbers of at least 1")),
                Ok(n) => Ok(n),
            }
        };
        let tp = |t: &str| -> Result<usize, SimError> {
            t.strip_prefix("tp")
                .ok_or_else(|| bad("TP is written tpN"))
                .and_then(count)
        };
        let lower = s.trim().to_ascii_lowercase();
        if let Some(rest) = lower.strip_prefix("agg:") {
            let mut parts = rest.split(':');
            let replicas = count(parts.next().unwrap_or(""))?;
            let t = parts.next().map(tp).transpose()?.unwrap_or(1);
            if parts.next().is_some() {
                return Err(bad("expected agg:N or agg:N:tpT"));
            }
            return Ok(Self::Aggregated { replicas, tp: t });
        }
        let (shape, tps) = match lower.split_once(':') {
            Some((a, b)) => (a, Some(b)),
            None => (lower.as_str(), None),
        };
        let (p, d) = shape
            .strip_suffix('d')
            .and_then(|x| x.split_once('p'))
            .ok_or_else(|| bad("expected agg:N[:tpT] or PpDd[:tpA[/tpB]], e.g. 1p2d"))?;
        let (prefill_tp, decode_tp) = match tps {
            None => (1, 1),
            Some(t) => match t.split_once('/') {
                Some((a, b)) => (tp(a)?, tp(b)?),
                None => (tp(t)?, tp(t)?),
            },
        };
        Ok(Self::Disaggregated {
            prefill: count(p)?,
            prefill_tp,
            decode: count(d)?,
            decode_tp,
        })
    }
}

/// Percentiles of one metric, seconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Summary {
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl Summary {
    /// Linear interpolation between order statistics, as `tandem bench`
    /// (and numpy) computes them; NaN for no values.
    pub fn of(mut v: Vec<f64>) -> Self {
        v.sort_by(f64::total_cmp);
        let pct = |p: f64| -> f64 {
            match v.len() {
                0 => f64::NAN,
                1 => v[0],
                n => {
                    let rank = p / 100.0 * (n - 1) as f64;
                    let lo = rank.floor() as usize;
                    let hi = (lo + 1).min(n - 1);
                    v[lo] + (v[hi] - v[lo]) * (rank - lo as f64)
                }
            }
        };
        Self {
            mean: if v.is_empty() {
                f64::NAN
            } else {
                v.iter().sum::<f64>() / v.len() as f64
            },
            p50: pct(50.0),
            p90: pct(90.0),
            p99: pct(99.0),
            max: v.last().copied().unwrap_or(f64::NAN),
        }
    }
}

/// What a simulation predicts.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimReport {
    pub topology: String,
    pub units: usize,
    pub requests: usize,
    /// From time 0 to the last request's last token.
    pub duration_s: f64,
    pub request_throughput: f64,
    pub output_throughput: f64,
    pub ttft: Summary,
    /// (E2E - TTFT) / (output tokens - 1), over requests of 2+ tokens.
    pub tpot: Summary,
    pub e2e: Summary,
    /// Requests per second meeting the SLO (TTFT and TPOT).
    pub goodput: f64,
    /// Share of requests meeting the SLO.
    pub slo_attainment: f64,
    /// Mean sequences per decode-carrying step, and the busy share of the
    /// nodes' time: where the time went.
    pub mean_decode_batch: f64,
    pub utilisation: f64,
}

impl SimReport {
    /// The SLO's p99 targets hold.
    pub fn meets(&self, slo: &Slo) -> bool {
        self.ttft.p99 <= slo.ttft_s && (self.tpot.p99.is_nan() || self.tpot.p99 <= slo.tpot_s)
    }
}

/// The profile measured at `tp`.
pub fn profile_for(profiles: &[EngineProfile], tp: usize) -> Result<&EngineProfile, SimError> {
    profiles.iter().find(|p| p.tp == tp).ok_or_else(|| {
        let have: Vec<String> = profiles.iter().map(|p| p.tp.to_string()).collect();
        SimError::NoProfile(tp, have.join(", "))
    })
}

/// What a node does with a request's first token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum After {
    /// Keep decoding here.
    Decode,
    /// Hand the KV to this decode node.
    Handoff(usize),
}

#[derive(Debug, Clone, Copy)]
struct Seq {
    req: usize,
    prompt: usize,
    computed: usize,
    /// Tokens sampled so far.
    generated: usize,
    after: After,
}

impl Seq {
    fn prefilling(&self) -> bool {
        self.computed < self.prompt
    }
}

struct Node<'a> {
    profile: &'a EngineProfile,
    waiting: VecDeque<Seq>,
    /// In admission order, oldest first (the scheduler's order).
    running: Vec<Seq>,
    /// The step under way: (index into `running`, tokens), and its length.
    plan: Vec<(usize, usize)>,
    step_s: f64,
    busy: bool,
    /// Requests routed here and not finished (handoffs in flight included),
    /// and their uncomputed prompt tokens: the router's load signals.
    active: usize,
    queued_tokens: usize,
    busy_s: f64,
    decode_steps: usize,
    decode_seqs: usize,
}

impl<'a> Node<'a> {
    fn new(profile: &'a EngineProfile) -> Self {
        Self {
            profile,
            waiting: VecDeque::new(),
            running: Vec::new(),
            plan: Vec::new(),
            step_s: 0.0,
            busy: false,
            active: 0,
            queued_tokens: 0,
            busy_s: 0.0,
            decode_steps: 0,
            decode_seqs: 0,
        }
    }

    /// Plans the next step as the scheduler does; false when there is
    /// nothing to run.
    fn plan_step(&mut self, p: &ClusterParams) -> bool {
        self.plan.clear();
        let mut left = p.token_budget;
        for (i, s) in self.running.iter().enumerate() {
            if self.plan.len() == p.max_batch_size || left == 0 {
                break;
            }
            let len = if s.prefilling() {
                (s.prompt - s.computed).min(left)
            } else {
                1
            };
            self.plan.push((i, len));
            left -= len;
        }
        while self.plan.len() < p.max_batch_size && left > 0 {
            let Some(s) = self.waiting.pop_front() else {
                break;
            };
            let len = (s.prompt - s.computed).min(left);
            self.plan.push((self.running.len(), len));
            self.running.push(s);
            left -= len;
        }
        if self.plan.is_empty() {
            return false;
        }
        let (mut prompt_tokens, mut batch, mut context) = (0, 0, 0);
        for &(i, len) in &self.plan {
            let s = &self.running[i];
            if s.prefilling() {
                prompt_tokens += len;
            } else {
                batch += 1;
                context += s.prompt + s.generated;
            }
        }
        let mean_ctx = context.checked_div(batch).unwrap_or(0);
        self.step_s = self.profile.step_seconds(prompt_tokens, batch, mean_ctx) + p.step_overhead_s;
        if batch > 0 {
            self.decode_steps += 1;
            self.decode_seqs += batch;
        }
        true
    }
}

#[derive(Debug, Clone, Copy)]
enum Event {
    /// A request reaches its node (after the router).
    Arrive(usize),
    StepEnd(usize),
    /// A prefilled sequence's KV has landed on this decode node.
    Landed(usize, Seq),
}

struct Queued {
    t: f64,
    n: u64,
    ev: Event,
}

impl PartialEq for Queued {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Queued {}
impl PartialOrd for Queued {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Queued {
    /// Earliest first out of a max-heap; ties in insertion order, so a run
    /// is deterministic.
    fn cmp(&self, o: &Self) -> Ordering {
        o.t.total_cmp(&self.t).then(o.n.cmp(&self.n))
    }
}

struct Sim<'a> {
    p: &'a ClusterParams,
    reqs: &'a [Request],
    nodes: Vec<Node<'a>>,
    /// Index ranges of `nodes`: [0, split) take arrivals (replicas or
    /// decode nodes); [split, len) are prefill nodes.
    split: usize,
    disaggregated: bool,
    heap: BinaryHeap<Queued>,
    n: u64,
    /// Nodes that got work at the current time: they start a step once
    /// every event of this instant is in, so simultaneous arrivals share it.
    dirty: Vec<bool>,
    first: Vec<f64>,
    finish: Vec<f64>,
}

impl Sim<'_> {
    fn push(&mut self, t: f64, ev: Event) {
        self.n += 1;
        self.heap.push(Queued { t, n: self.n, ev });
    }

    /// The least loaded node of a range (fewest active requests, then
    /// fewest queued prompt tokens, then the lowest index).
    fn least_loaded(&self, range: std::ops::Range<usize>, by_tokens: bool) -> usize {
        let key = |i: usize| {
            let n = &self.nodes[i];
            if by_tokens {
                (n.queued_tokens, n.active)
            } else {
                (n.active, n.queued_tokens)
            }
        };
        range.min_by_key(|&i| (key(i), i)).unwrap_or(0)
    }

    fn kick_dirty(&mut self, t: f64) {
        for i in 0..self.nodes.len() {
            if std::mem::take(&mut self.dirty[i]) {
                self.kick(t, i);
            }
        }
    }

    fn kick(&mut self, t: f64, i: usize) {
        let node = &mut self.nodes[i];
        if !node.busy && node.plan_step(self.p) {
            node.busy = true;
            node.busy_s += node.step_s;
            let dt = node.step_s;
            self.push(t + dt, Event::StepEnd(i));
        }
    }

    fn arrive(&mut self, r: usize) {
        let req = self.reqs[r];
        let dnode = self.least_loaded(0..self.split, false);
        let uncached = req.input - req.cached;
        let (target, after) = if self.disaggregated && uncached >= self.p.remote_prefill_min_tokens
        {
            let pnode = self.least_loaded(self.split..self.nodes.len(), true);
            self.nodes[dnode].active += 1;
            (pnode, After::Handoff(dnode))
        } else {
            (dnode, After::Decode)
        };
        let node = &mut self.nodes[target];
        node.active += 1;
        node.queued_tokens += uncached;
        node.waiting.push_back(Seq {
            req: r,
            prompt: req.input,
            computed: req.cached,
            generated: 0,
            after,
        });
        self.dirty[target] = true;
    }

    fn step_end(&mut self, t: f64, i: usize) {
        let step_s = self.nodes[i].step_s;
        let plan = std::mem::take(&mut self.nodes[i].plan);
        let mut done = Vec::new();
        for &(k, len) in &plan {
            let node = &mut self.nodes[i];
            let s = &mut node.running[k];
            if s.prefilling() {
                s.computed += len;
                node.queued_tokens -= len;
                if s.prefilling() {
                    continue;
                }
                // A remote prefill's token reaches the client with the
                // prefill node's answer, after the handoff.
                if s.after == After::Decode {
                    self.first[s.req] = t;
                }
            }
            s.generated += 1;
            let out = self.reqs[s.req].output;
            match s.after {
                After::Handoff(_) => done.push(k),
                After::Decode if s.generated >= out => {
                    self.finish[s.req] = t;
                    done.push(k);
                }
                After::Decode => {}
            }
        }
        // Remove from the back so earlier indices stay valid.
        done.sort_unstable();
        for &k in done.iter().rev() {
            let node = &mut self.nodes[i];
            let s = node.running.remove(k);
            node.active -= 1;
            if let After::Handoff(d) = s.after {
                // The writes overlap the prefill; what they need beyond it
                // remains, plus the fixed cost.
                let bytes = s.prompt as f64 * self.p.kv_bytes_per_token;
                let xfer = bytes / self.p.dkv_bytes_per_s;
                let dt = self.p.dkv_latency_s + (xfer - step_s).max(0.0);
                self.push(t + dt, Event::Landed(d, s));
            }
        }
        self.nodes[i].busy = false;
        self.dirty[i] = true;
    }

    fn landed(&mut self, t: f64, d: usize, mut s: Seq) {
        self.first[s.req] = t;
        if s.generated >= self.reqs[s.req].output {
            // One token: nothing left to decode.
            self.finish[s.req] = t;
            self.nodes[d].active -= 1;
            return;
        }
        s.after = After::Decode;
        self.nodes[d].running.push(s);
        self.dirty[d] = true;
    }
}

/// Simulates `workload` on `topology`.
pub fn simulate(
    topology: Topology,
    profiles: &[EngineProfile],
    params: &ClusterParams,
    workload: &Workload,
    slo: &Slo,
) -> Result<SimReport, SimError> {
    params.validate()?;
    workload.validate()?;
    let reqs = workload.requests(params.block_size);
    simulate_requests(topology, profiles, params, &reqs, slo)
}

/// Simulates a given list of requests (sorted by arrival).
pub fn simulate_requests(
    topology: Topology,
    profiles: &[EngineProfile],
    params: &ClusterParams,
    reqs: &[Request],
    slo: &Slo,
) -> Result<SimReport, SimError> {
    let (nodes, split, disaggregated) = match topology {
        Topology::Aggregated { replicas, tp } => {
            let prof = profile_for(profiles, tp)?;
            (
                (0..replicas).map(|_| Node::new(prof)).collect(),
                replicas,
                false,
            )
        }
        Topology::Disaggregated {
            prefill,
            prefill_tp,
            decode,
            decode_tp,
        } => {
            let pp = profile_for(profiles, prefill_tp)?;
            let dp = profile_for(profiles, decode_tp)?;
            let nodes: Vec<Node<'_>> = (0..decode)
                .map(|_| Node::new(dp))
                .chain((0..prefill).map(|_| Node::new(pp)))
                .collect();
            (nodes, decode, true)
        }
    };
    if nodes.is_empty() {
        return Err(SimError::Topology(
            topology.to_string(),
            "no nodes".to_string(),
        ));
    }
    let dirty = vec![false; nodes.len()];
    let mut sim = Sim {
        p: params,
        reqs,
        nodes,
        dirty,
        split,
        disaggregated,
        heap: BinaryHeap::new(),
        n: 0,
        first: vec![f64::NAN; reqs.len()],
        finish: vec![f64::NAN; reqs.len()],
    };
    for (r, req) in reqs.iter().enumerate() {
        sim.push(req.arrival + params.router_s, Event::Arrive(r));
    }
    while let Some(Queued { t, ev, .. }) = sim.heap.pop() {
        match ev {
            Event::Arrive(r) => sim.arrive(r),
            Event::StepEnd(i) => sim.step_end(t, i),
            Event::Landed(d, s) => sim.landed(t, d, s),
        }
        if sim.heap.peek().is_none_or(|q| q.t > t) {
            sim.kick_dirty(t);
        }
    }
    let duration = sim.finish.iter().copied().fold(0.0, f64::max);
    let (mut ttft, mut tpot, mut e2e) = (Vec::new(), Vec::new(), Vec::new());
    let (mut good, mut out_tokens) = (0usize, 0usize);
    for (r, req) in reqs.iter().enumerate() {
        let (a, f, l) = (req.arrival, sim.first[r], sim.finish[r]);
        ttft.push(f - a);
        e2e.push(l - a);
        out_tokens += req.output;
        let per_token = (req.output > 1).then(|| (l - f) / (req.output - 1) as f64);
        if let Some(x) = per_token {
            tpot.push(x);
        }
        if f - a <= slo.ttft_s && per_token.is_none_or(|x| x <= slo.tpot_s) {
            good += 1;
        }
    }
    let per_s = |x: f64| if duration > 0.0 { x / duration } else { 0.0 };
    let (steps, seqs, busy) = sim.nodes.iter().fold((0, 0, 0.0), |(a, b, c), n| {
        (a + n.decode_steps, b + n.decode_seqs, c + n.busy_s)
    });
    Ok(SimReport {
        topology: topology.to_string(),
        units: topology.units(),
        requests: reqs.len(),
        duration_s: duration,
        request_throughput: per_s(reqs.len() as f64),
        output_throughput: per_s(out_tokens as f64),
        ttft: Summary::of(ttft),
        tpot: Summary::of(tpot),
        e2e: Summary::of(e2e),
        goodput: per_s(good as f64),
        slo_attainment: good as f64 / reqs.len().max(1) as f64,
        mean_decode_batch: seqs as f64 / steps.max(1) as f64,
        utilisation: if duration > 0.0 {
            busy / (duration * sim.nodes.len() as f64)
        } else {
            0.0
        },
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
pub(crate) mod tests {
    use super::*;
    use crate::profile::PROFILE_VERSION;
    use crate::{DecodePoint, PrefillPoint};

    /// Prefill 1 ms per token; decode 10 ms + 1 ms per sequence, flat in
    /// context: easy to do by hand.
    pub(crate) fn linear_profile(tp: usize) -> EngineProfile {
        let decode = [1usize, 64]
            .iter()
            .flat_map(|&c| {
                [1usize, 32].map(|b| DecodePoint {
                    batch: b,
                    context: c,
                    seconds: 0.010 + 0.001 * b as f64,
                })
            })
            .collect();
        EngineProfile {
            version: PROFILE_VERSION,
            model: "m".into(),
            isa: "scalar".into(),
            threads: 1,
            tp,
            prefill: vec![
                PrefillPoint {
                    tokens: 1,
                    seconds: 0.001,
                },
                PrefillPoint {
                    tokens: 1000,
                    seconds: 1.0,
                },
            ],
            decode,
        }
    }

    fn params() -> ClusterParams {
        ClusterParams {
            router_s: 0.0005,
            dkv_bytes_per_s: 1e9,
            dkv_latency_s: 0.002,
            kv_bytes_per_token: 1e3,
            ..ClusterParams::default()
        }
    }

    const SLO: Slo = Slo {
        ttft_s: 1.0,
        tpot_s: 1.0,
    };

    fn one(input: usize, output: usize) -> Vec<Request> {
        vec![Request {
            arrival: 0.0,
            input,
            cached: 0,
            output,
        }]
    }

    #[test]
    fn a_single_request_costs_router_prefill_and_decode_steps() {
        let prof = [linear_profile(1)];
        let agg = Topology::Aggregated { replicas: 1, tp: 1 };
        let r = simulate_requests(agg, &prof, &params(), &one(100, 5), &SLO).unwrap();
        assert!((r.ttft.p50 - (0.0005 + 0.100)).abs() < 1e-9, "{r:?}");
        // Four more tokens, one 11 ms batch-1 decode step each.
        assert!((r.tpot.p50 - 0.011).abs() < 1e-9);
        assert!((r.e2e.p50 - (0.1005 + 4.0 * 0.011)).abs() < 1e-9);

        // Disaggregated: prefill on the prefill node, then the handoff:
        // 100 KB at 1 GB/s (0.1 ms) hides under the 100 ms prefill, so only
        // the fixed 2 ms remains before the decode node takes it.
        let d = Topology::Disaggregated {
            prefill: 1,
            prefill_tp: 1,
            decode: 1,
            decode_tp: 1,
        };
        let r = simulate_requests(d, &prof, &params(), &one(100, 5), &SLO).unwrap();
        // The first token comes back with the prefill node's answer, once
        // the writes are flushed.
        assert!((r.ttft.p50 - 0.1025).abs() < 1e-9, "{r:?}");
        assert!((r.e2e.p50 - (0.1025 + 4.0 * 0.011)).abs() < 1e-9);
    }

    #[test]
    fn short_prompts_stay_on_the_decode_node() {
        let prof = [linear_profile(1)];
        let d: Topology = "1p1d".parse().unwrap();
        let r = simulate_requests(d, &prof, &params(), &one(10, 2), &SLO).unwrap();
        // No handoff latency: prefilled locally (10 ms), one decode step.
        assert!((r.e2e.p50 - (0.0005 + 0.010 + 0.011)).abs() < 1e-9, "{r:?}");
    }

    #[test]
    fn long_prompts_are_chunked_by_the_token_budget() {
        let prof = [linear_profile(1)];
        let p = ClusterParams {
            token_budget: 64,
            ..params()
        };
        let agg: Topology = "agg:1".parse().unwrap();
        let r = simulate_requests(agg, &prof, &p, &one(200, 1), &SLO).unwrap();
        // 64 + 64 + 64 + 8 tokens in four steps: the same 200 ms.
        assert!((r.ttft.p50 - 0.2005).abs() < 1e-9);
    }

    #[test]
    fn saturated_throughput_matches_step_time_math() {
        // Everything arrives at once: 32 prompts of 10 tokens fill one step
        // (320 ms), then 9 decode steps of the full batch (10 + 32 ms each).
        let prof = [linear_profile(1)];
        let reqs: Vec<Request> = (0..32)
            .map(|_| Request {
                arrival: 0.0,
                input: 10,
                cached: 0,
                output: 10,
            })
            .collect();
        let agg: Topology = "agg:1".parse().unwrap();
        let r = simulate_requests(agg, &prof, &params(), &reqs, &SLO).unwrap();
        let want = 0.0005 + 0.320 + 9.0 * 0.042;
        assert!((r.duration_s - want).abs() < 1e-9, "{r:?}");
        assert!((r.output_throughput - 320.0 / want).abs() < 1e-6);
        assert!((r.mean_decode_batch - 32.0).abs() < 1e-12);
        // Two replicas halve the batch: 16 per node, 26 ms steps.
        let two: Topology = "agg:2".parse().unwrap();
        let r = simulate_requests(two, &prof, &params(), &reqs, &SLO).unwrap();
        let want = 0.0005 + 0.160 + 9.0 * 0.026;
        assert!((r.duration_s - want).abs() < 1e-9, "{r:?}");
    }

    #[test]
    fn queueing_follows_m_d_1() {
        // Single-token requests of 50 ms prefill at 10/s, one per step:
        // utilisation 0.5, and M/D/1's mean wait rho S / (2 (1 - rho)) =
        // 25 ms.
        let prof = [linear_profile(1)];
        let w = Workload {
            rate: 10.0,
            input: LenDist::Fixed(50),
            output: LenDist::Fixed(1),
            prefix_share: 0.0,
            requests: 20_000,
            seed: 7,
        };
        let p = ClusterParams {
            router_s: 0.0,
            max_batch_size: 1,
            ..params()
        };
        let agg: Topology = "agg:1".parse().unwrap();
        let r = simulate(agg, &prof, &p, &w, &SLO).unwrap();
        let wait = r.ttft.mean - 0.050;
        assert!(
            (0.015..0.035).contains(&wait),
            "mean wait {wait} not near 25 ms"
        );
        assert!((r.utilisation - 0.5).abs() < 0.03, "{}", r.utilisation);
        assert!((r.request_throughput - 10.0).abs() < 0.3);
    }

    #[test]
    fn prefix_sharing_cuts_prefill() {
        let prof = [linear_profile(1)];
        let w = |share| Workload {
            rate: 1.0,
            input: LenDist::Fixed(160),
            output: LenDist::Fixed(1),
            prefix_share: share,
            requests: 1,
            seed: 1,
        };
        let reqs = w(0.5).requests(16);
        assert_eq!(reqs[0].cached, 80);
        let agg: Topology = "agg:1".parse().unwrap();
        let r = simulate(agg, &prof, &params(), &w(0.5), &SLO).unwrap();
        assert!((r.ttft.p50 - (0.0005 + 0.080)).abs() < 1e-9);
    }

    #[test]
    fn deterministic_under_the_seed() {
        let prof = [linear_profile(1)];
        let w = Workload {
            rate: 20.0,
            input: "32:256".parse().unwrap(),
            output: "8,16,64".parse().unwrap(),
            prefix_share: 0.25,
            requests: 300,
            seed: 42,
        };
        let d: Topology = "1p2d".parse().unwrap();
        let a = simulate(d, &prof, &params(), &w, &SLO).unwrap();
        let b = simulate(d, &prof, &params(), &w, &SLO).unwrap();
        assert_eq!(a, b);
        let c = simulate(d, &prof, &params(), &Workload { seed: 43, ..w }, &SLO).unwrap();
        assert_ne!(a, c);
    }

    #[test]
    fn goodput_counts_requests_within_the_slo() {
        let prof = [linear_profile(1)];
        let agg: Topology = "agg:1".parse().unwrap();
        let reqs = one(100, 5);
        let tight = Slo {
            ttft_s: 0.05,
            tpot_s: 1.0,
        };
        let r = simulate_requests(agg, &prof, &params(), &reqs, &tight).unwrap();
        assert_eq!(r.goodput, 0.0);
        assert!(!r.meets(&tight));
        let r = simulate_requests(agg, &prof, &params(), &reqs, &SLO).unwrap();
        assert!((r.goodput - 1.0 / r.duration_s).abs() < 1e-12);
        assert!(r.meets(&SLO));
    }

    #[test]
    fn topologies_and_lengths_parse_and_print() {
        for s in [
            "agg:2",
            "agg:1:tp2",
            "1p1d",
            "1p2d",
            "2p3d:tp2",
            "1p1d:tp2/tp1",
        ] {
            assert_eq!(s.parse::<Topology>().unwrap().to_string(), s);
        }
        assert_eq!(
            "1p1d:tp1/tp1".parse::<Topology>().unwrap().to_string(),
            "1p1d"
        );
        assert_eq!("agg:1:tp2".parse::<Topology>().unwrap().units(), 2);
        assert_eq!("2p3d:tp2/tp1".parse::<Topology>().unwrap().units(), 7);
        for bad in ["agg:0", "agg", "p1d", "1p1", "1p1d:2", "agg:1:tp0", "xyz"] {
            assert!(bad.parse::<Topology>().is_err(), "{bad}");
        }
        assert_eq!("128".parse::<LenDist>().unwrap(), LenDist::Fixed(128));
        assert_eq!(
            "64:256".parse::<LenDist>().unwrap(),
            LenDist::Uniform(64, 256)
        );
        assert_eq!(
            "1,2,3".parse::<LenDist>().unwrap(),
            LenDist::List(vec![1, 2, 3])
        );
        for bad in ["0", "5:1", "", "a", "1,,2"] {
            assert!(bad.parse::<LenDist>().is_err(), "{bad}");
        }
        assert_eq!("64:256".parse::<LenDist>().unwrap().mean(), 160.0);
    }

    #[test]
    fn a_missing_profile_is_an_error() {
        let prof = [linear_profile(1)];
        let t: Topology = "agg:1:tp2".parse().unwrap();
        let e = simulate_requests(t, &prof, &params(), &one(10, 2), &SLO).unwrap_err();
        assert!(matches!(e, SimError::NoProfile(2, _)));
    }
}
