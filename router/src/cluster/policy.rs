//! The routing decision: which ready workers of a role to try for a
//! request, in what order. The cluster gathers what it knows of each ready
//! worker (its prefix overlap with the prompt and its load) and a
//! [`RoutingPolicy`] orders them: [`CostPolicy`](super::CostPolicy) (the
//! default) or [`RoundRobinPolicy`](super::RoundRobinPolicy).

use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};

use tandem_discovery::Role;
use tandem_types::BlockHash;

use super::{Cluster, Overlap, Worker};

/// What a routing policy knows of one ready worker for one request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Candidate {
    /// Leading blocks of the prompt the worker holds, and how many of
    /// them are below its pool (host memory, disk).
    pub overlap: Overlap,
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
    /// out is not used. `prompt_blocks` is the prompt's length in blocks;
    /// `role` the pool the candidates belong to.
    fn rank(&self, role: Role, prompt_blocks: usize, candidates: &[Candidate]) -> Vec<usize>;
}

impl Worker {
    /// This worker as a candidate for a prompt with which it shares
    /// `overlap` leading blocks.
    fn candidate(&self, overlap: Overlap) -> Candidate {
        Candidate {
            overlap,
            kv_blocks_used: self.kv_blocks_used.load(Ordering::Relaxed),
            queued: self.waiting.load(Ordering::Relaxed) + self.pending.load(Ordering::Relaxed),
        }
    }
}

/// A ready worker and what the policy knows of it for one prompt.
pub(super) type Ready = (Arc<Worker>, Candidate);

impl Cluster {
    /// Every ready worker (none on probation), of either role, as a
    /// candidate for the prompt of block hashes `hashes`.
    pub(super) fn ready(&self, hashes: &[BlockHash]) -> Vec<Ready> {
        let workers = self.workers.read().unwrap_or_else(PoisonError::into_inner);
        workers
            .values()
            .filter(|w| w.standing.is_ready())
            .map(|w| (Arc::clone(w), w.candidate(w.overlap(hashes))))
            .collect()
    }

    /// The workers of `role` among `ready`, in the policy's order.
    pub(super) fn rank_ready(
        &self,
        role: Role,
        ready: &[Ready],
        prompt_blocks: usize,
    ) -> Vec<Ready> {
        let of_role: Vec<&Ready> = ready.iter().filter(|(w, _)| w.role == role).collect();
        let candidates: Vec<Candidate> = of_role.iter().map(|(_, c)| *c).collect();
        self.policy
            .rank(role, prompt_blocks, &candidates)
            .into_iter()
            .filter_map(|i| of_role.get(i))
            .map(|&(w, c)| (Arc::clone(w), *c))
            .collect()
    }

    /// Ready workers of `role` (none on probation) in the policy's order,
    /// with what the policy knew of each.
    #[cfg(test)]
    pub(super) fn rank(
        &self,
        role: Role,
        hashes: &[BlockHash],
        prompt_blocks: usize,
    ) -> Vec<Ready> {
        self.rank_ready(role, &self.ready(hashes), prompt_blocks)
    }
}
