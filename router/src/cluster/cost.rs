//! The cost-based routing policy, for both pools:
//! `prefill_weight * (prompt_blocks - overlap_blocks + host_hit_weight *
//! host_blocks + disk_hit_weight * disk_blocks) + kv_blocks_used +
//! queue_weight * queued`, argmin with ties broken at random. `queued`
//! counts the worker's waiting requests (from its load events) plus the
//! requests this router sent it that have not started yet, so that a burst
//! spreads before the next load update arrives. `host_blocks` and
//! `disk_blocks` are the overlap's blocks held below the worker's pool.
//!
//! The tier weights (defaults 0.1 for host memory, 0.3 for disk) say what
//! a block held below the pool costs as a fraction of computing it. A host
//! block is copied back (a block of SmolLM2 is ~225 KiB: tens of
//! microseconds, against milliseconds to compute 16 tokens on a CPU); a disk
//! block is read from a file first, and the prompt waits outside the batch
//! for the read and a wake-up (in bench/README.md's multi-turn runs, turns
//! 2+ took 13% longer from disk than from host memory, both well under a
//! third of recomputing). The weights stay well below 1 so that any tier
//! hit beats recomputing, and above 0 so that between two workers holding
//! the same prefix the one holding it nearer the pool wins; a GPU computes
//! a block faster relative to a copy, so there they are worth raising.

use std::sync::atomic::{AtomicU64, Ordering};

use tandem_discovery::Role;

use super::{Candidate, RoutingConfig, RoutingPolicy};

/// Cheapest first by the cost above, random among equals.
#[derive(Debug)]
pub struct CostPolicy {
    /// Cost of one prompt block a worker would have to compute.
    prefill_weight: f64,
    /// Fractions of `prefill_weight` a block held in host memory and on
    /// disk costs.
    host_hit_weight: f64,
    disk_hit_weight: f64,
    /// Cost of one queued request.
    queue_weight: f64,
    rng: AtomicU64,
}

impl CostPolicy {
    /// The policy of `cfg`'s weights.
    pub fn new(cfg: &RoutingConfig) -> Self {
        Self {
            prefill_weight: cfg.prefill_weight,
            host_hit_weight: cfg.host_hit_weight,
            disk_hit_weight: cfg.disk_hit_weight,
            queue_weight: cfg.queue_weight,
            rng: AtomicU64::new(0x2545_f491_4f6c_dd1d),
        }
    }

    fn cost(&self, prompt_blocks: usize, c: &Candidate) -> f64 {
        let o = &c.overlap;
        let blocks = prompt_blocks.saturating_sub(o.blocks) as f64
            + self.host_hit_weight * o.host as f64
            + self.disk_hit_weight * o.disk as f64;
        self.prefill_weight * blocks + c.kv_blocks_used as f64 + self.queue_weight * c.queued as f64
    }

    fn random(&self) -> u64 {
        // xorshift: tie-breaking needs no more.
        let mut x = self.rng.load(Ordering::Relaxed);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.rng.store(x, Ordering::Relaxed);
        x
    }
}

impl RoutingPolicy for CostPolicy {
    /// By ascending cost (random among equals).
    fn rank(&self, _role: Role, prompt_blocks: usize, candidates: &[Candidate]) -> Vec<usize> {
        let mut scored: Vec<(f64, u64, usize)> = candidates
            .iter()
            .enumerate()
            .map(|(i, c)| (self.cost(prompt_blocks, c), self.random(), i))
            .collect();
        scored.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        scored.into_iter().map(|(_, _, i)| i).collect()
    }
}
