//! The routing decision: which ready workers of a role to try for a
//! request, in what order. The cluster gathers what it knows of each ready
//! worker (its prefix overlap with the prompt and its load) and a
//! [`RoutingPolicy`] orders them; [`CostPolicy`](super::CostPolicy) is the
//! one policy today.

use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};

use tandem_discovery::Role;
use tandem_types::BlockHash;

use super::{Cluster, Worker};

/// What a routing policy knows of one ready worker for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    /// Leading blocks of the prompt the worker has cached.
    pub overlap: usize,
    /// KV blocks in use on the worker (its last load report).
    pub kv_blocks_used: usize,
    /// Requests waiting on the worker: those of its last load report plus
    /// those this router sent it that have not started yet (so that a
    /// burst spreads before the next report arrives).
    pub queued: usize,
}

/// Orders the ready workers of one role for one request.
pub trait RoutingPolicy: fmt::Debug + Send + Sync {
    /// Indices into `candidates`, best first: the order in which they are
    /// tried (a decode worker) or named (prefill workers). A candidate left
    /// out is not used. `prompt_blocks` is the prompt's length in blocks.
    fn rank(&self, prompt_blocks: usize, candidates: &[Candidate]) -> Vec<usize>;
}

impl Worker {
    /// This worker as a candidate for a prompt with which it shares
    /// `overlap` leading blocks.
    fn candidate(&self, overlap: usize) -> Candidate {
        Candidate {
            overlap,
            kv_blocks_used: self.kv_blocks_used.load(Ordering::Relaxed),
            queued: self.waiting.load(Ordering::Relaxed) + self.pending.load(Ordering::Relaxed),
        }
    }
}

impl Cluster {
    /// Ready workers of `role` (none on probation) in the policy's order,
    /// with their overlap.
    pub(super) fn rank(
        &self,
        role: Role,
        hashes: &[BlockHash],
        prompt_blocks: usize,
    ) -> Vec<(Arc<Worker>, usize)> {
        let workers = self.workers.read().unwrap_or_else(PoisonError::into_inner);
        let ready: Vec<(&Arc<Worker>, Candidate)> = workers
            .values()
            .filter(|w| w.role == role && w.standing.is_ready())
            .map(|w| (w, w.candidate(w.overlap(hashes))))
            .collect();
        let candidates: Vec<Candidate> = ready.iter().map(|(_, c)| *c).collect();
        self.policy
            .rank(prompt_blocks, &candidates)
            .into_iter()
            .filter_map(|i| ready.get(i))
            .map(|&(w, c)| (Arc::clone(w), c.overlap))
            .collect()
    }
}
