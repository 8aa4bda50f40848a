//! The round-robin routing policy (`--routing-policy round-robin`): each
//! request of a role starts one worker further along that role's ready
//! workers, whatever they hold and however loaded they are. The baseline
//! that cache-aware routing is measured against (SGLang's and Dynamo's
//! routers offer it too), and a load spread evenly where prefixes barely
//! matter; a prefix a worker lacks is still fetched from the one holding
//! it (`prefix_source`).

use std::sync::atomic::{AtomicUsize, Ordering};

use tandem_discovery::Role;

use super::{Candidate, RoutingPolicy};

/// Each role's ready workers in turn.
#[derive(Debug, Default)]
pub struct RoundRobinPolicy {
    /// The next start, per role (prefill, decode): a request ranks both.
    next: [AtomicUsize; 2],
}

impl RoutingPolicy for RoundRobinPolicy {
    /// All candidates, starting one further along than the last request of
    /// the same role.
    fn rank(&self, role: Role, _prompt_blocks: usize, candidates: &[Candidate]) -> Vec<usize> {
        let n = candidates.len();
        if n == 0 {
            return Vec::new();
        }
        let turn = match role {
            Role::Prefill => &self.next[0],
            Role::Decode => &self.next[1],
        };
        let start = turn.fetch_add(1, Ordering::Relaxed) % n;
        (0..n).map(|i| (start + i) % n).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_role_takes_its_workers_in_turn() {
        let p = RoundRobinPolicy::default();
        let c = |n| vec![Candidate::default(); n];
        assert_eq!(p.rank(Role::Decode, 4, &c(3)), [0, 1, 2]);
        // A prefill ranking between two decode ones does not skip a turn.
        assert_eq!(p.rank(Role::Prefill, 4, &c(2)), [0, 1]);
        assert_eq!(p.rank(Role::Decode, 4, &c(3)), [1, 2, 0]);
        assert_eq!(p.rank(Role::Decode, 4, &c(3)), [2, 0, 1]);
        assert_eq!(p.rank(Role::Decode, 4, &c(3)), [0, 1, 2]);
        assert_eq!(p.rank(Role::Prefill, 4, &c(2)), [1, 0]);
        assert!(p.rank(Role::Decode, 4, &[]).is_empty());
    }
}
