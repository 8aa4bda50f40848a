//! Planning a step: which sequences run how many tokens, within the batch
//! limits and the free KV blocks (preempting the newest when they run
//! out), and the form of the logits the step asks for.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;

use opentelemetry::KeyValue;

use tandem_types::GenFailure;

use super::ImportSlot;
use super::actor::{Actor, Seq};
use crate::backend::LogitsForm;
use crate::block_manager::block_hashes;
use crate::kv_cache::KvCacheError;
use crate::metrics::{BatchType, metrics};

/// A sequence's share of one step.
pub(super) struct Planned {
    /// Index into `running`.
    pub(super) seq: usize,
    pub(super) len: usize,
}

impl Planned {
    /// Whether this chunk ends its sequence's known tokens, so the step
    /// samples the sequence's next one from the chunk's logits.
    pub(super) fn samples(&self, running: &[Seq]) -> bool {
        let s = &running[self.seq];
        s.computed + self.len == s.tokens.len()
    }
}

impl Actor {
    /// Chooses this step's work; reserves the KV blocks it needs.
    pub(super) fn plan(&mut self) -> Vec<Planned> {
        self.admit_holds();
        let mut tokens_left = self.config.max_batch_input_tokens;
        let mut plan: Vec<Planned> = Vec::new();
        let preempted = self.plan_running(&mut plan, &mut tokens_left);
        // New (or preempted) requests in arrival order; none in a step that
        // had to preempt, or the victim would be readmitted and evicted again.
        if !preempted {
            self.admit(&mut plan, tokens_left);
        }
        plan
    }

    /// Running sequences: decode tokens and continuing prefill chunks,
    /// oldest first. Preempts the newest when blocks run out; returns
    /// whether it did.
    fn plan_running(&mut self, plan: &mut Vec<Planned>, tokens_left: &mut usize) -> bool {
        self.running.sort_by_key(|s| s.admitted);
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() {
            if plan.len() == self.config.max_batch_size || *tokens_left == 0 {
                break;
            }
            let s = &self.running[i];
            let len = (s.tokens.len() - s.computed).min(*tokens_left);
            let need = s.computed + len;
            let mut table = std::mem::take(&mut self.running[i].table);
            let reserved = self.reserve(&mut table, need);
            self.running[i].table = table;
            match reserved {
                Ok(()) => {
                    plan.push(Planned { seq: i, len });
                    *tokens_left -= len;
                    i += 1;
                }
                Err(KvCacheError::OutOfBlocks { .. }) => {
                    // Free the newest sequence not yet planned (possibly this one).
                    let victim = self.running.len() - 1;
                    let mut s = self.running.remove(victim);
                    self.free(&mut s);
                    s.computed = 0;
                    self.stats.preemptions.fetch_add(1, Ordering::Relaxed);
                    metrics().preemptions.add(1, &[]);
                    self.waiting.push_front(s);
                    preempted = true;
                    // Retry the same index (unless it was the victim).
                }
                Err(e) => {
                    let mut s = self.running.remove(i);
                    s.sink.fail(GenFailure::Internal(e.to_string()));
                    self.free(&mut s);
                }
            }
        }
        preempted
    }

    /// Holds take no part in a step, so they are admitted whatever the
    /// batch's room and the queue ahead of them: a peer's fetch must not
    /// wait behind this node's own work (two nodes each fetching from the
    /// other would wait on each other). One whose prefix is being read
    /// from a tier keeps its place.
    fn admit_holds(&mut self) {
        if !self.waiting.iter().any(|s| s.sink.is_hold()) {
            return;
        }
        let mut rest = VecDeque::with_capacity(self.waiting.len());
        while let Some(mut s) = self.waiting.pop_front() {
            if !s.sink.is_hold() || (s.table.is_empty() && !self.match_prefix(&mut s, false)) {
                rest.push_back(s);
                continue;
            }
            self.hold(s);
        }
        self.waiting = rest;
    }

    /// Admits waiting requests in arrival order while the step has room; a
    /// request that does not fit keeps its place at the head of the queue.
    fn admit(&mut self, plan: &mut Vec<Planned>, mut tokens_left: usize) {
        let mut reading = Vec::new();
        self.admit_in_order(plan, &mut tokens_left, &mut reading);
        for s in reading.into_iter().rev() {
            self.waiting.push_front(s);
        }
    }

    fn admit_in_order(
        &mut self,
        plan: &mut Vec<Planned>,
        tokens_left: &mut usize,
        reading: &mut Vec<Seq>,
    ) {
        while plan.len() < self.config.max_batch_size && *tokens_left > 0 {
            let Some(mut s) = self.waiting.pop_front() else {
                break;
            };
            let first_admission = s.admitted == 0;
            if s.table.is_empty() && !self.match_prefix(&mut s, first_admission) {
                // Its prefix is being read from a KV tier: the others go on.
                reading.push(s);
                continue;
            }
            if s.sink.is_hold() {
                self.hold(s);
                continue;
            }
            let importing = s.sink.import.is_some();
            let len = if importing {
                // Room for the whole prompt, written by the prefill node.
                s.prompt_len - s.computed
            } else {
                (s.tokens.len() - s.computed).min(*tokens_left)
            };
            if self.reserve(&mut s.table, s.computed + len).is_err() {
                // Not enough blocks now: keep its place at the head of the queue.
                self.free(&mut s);
                s.computed = 0;
                self.waiting.push_front(s);
                break;
            }
            // An import is counted when it ends: a peer may fill more of
            // its prompt meanwhile (`Actor::take_fetched`).
            if first_admission && !importing {
                self.count_prefix_hits(&s);
            }
            self.admitted += 1;
            s.admitted = self.admitted;
            if importing {
                let slot = ImportSlot {
                    blocks: s.table.clone(),
                    cached_blocks: s.computed / self.config.block_size,
                };
                s.sink.slot(slot);
                self.importing.push(s);
                continue;
            }
            *tokens_left -= len;
            plan.push(Planned {
                seq: self.running.len(),
                len,
            });
            self.running.push(s);
        }
    }

    /// Reuses cached full blocks (from the pool, then the KV tiers),
    /// leaving at least one token to run so the step produces logits
    /// (a hold, which runs nothing, takes every full block). Returns false
    /// when the sequence must wait for a tier's read.
    fn match_prefix(&mut self, s: &mut Seq, first_admission: bool) -> bool {
        let matchable = if s.sink.is_hold() {
            s.tokens.len()
        } else {
            s.tokens.len() - 1
        };
        let hashes = block_hashes(&s.tokens[..matchable], self.config.block_size);
        s.table = self.cache.blocks_mut().match_prefix(&hashes);
        // The pool and the tiers may each hold parts of the prefix (the
        // pool evicts its oldest blocks first: a prompt's head, not its
        // tail): take from whichever holds the next block.
        loop {
            let had = s.table.len();
            if !self.restore_from_tiers(s, &hashes) {
                return false;
            }
            let more = self
                .cache
                .blocks_mut()
                .match_prefix(&hashes[s.table.len()..]);
            s.table.extend(more);
            if s.table.len() == had || s.table.len() == hashes.len() {
                break;
            }
        }
        s.computed = s.table.len() * self.config.block_size;
        s.hashes = hashes[..s.table.len()].to_vec();
        if first_admission {
            s.cached_tokens = s.computed.min(s.prompt_len);
            s.cached_shared.store(s.cached_tokens, Ordering::Relaxed);
        }
        true
    }

    /// A hold's cached blocks are matched: their bytes are brought to the
    /// host pool (where a transfer engine reads them) and they stay pinned
    /// until its caller lets go. It takes no part in any step.
    fn hold(&mut self, mut s: Seq) {
        if let Err(e) = self.exec.kv_read(&mut self.cache, &s.table) {
            tracing::warn!(request = s.id, error = %e, "held KV blocks could not be read");
            s.sink.fail(GenFailure::Internal(e.to_string()));
            self.free(&mut s);
            return;
        }
        s.sink.held(s.table.clone());
        self.held.push(s);
    }

    /// Counts a request's prompt as prefix-cache hits (its cached tokens:
    /// from the pool, a tier or a peer) and misses, once: at admission, or
    /// for an import when it ends.
    pub(super) fn count_prefix_hits(&self, s: &Seq) {
        let hit = s.cached_tokens as u64;
        let miss = s.prompt_len as u64 - hit;
        self.stats
            .prefix_hit_tokens
            .fetch_add(hit, Ordering::Relaxed);
        self.stats
            .prefix_miss_tokens
            .fetch_add(miss, Ordering::Relaxed);
        metrics().prefix_cache_hits.add(hit, &[]);
        metrics().prefix_cache_misses.add(miss, &[]);
    }

    /// Records the size and kind of a planned step; returns the kind.
    pub(super) fn record_batch(&self, plan: &[Planned]) -> BatchType {
        let kind = BatchType::classify(plan.iter().map(|p| {
            let s = &self.running[p.seq];
            (s.computed, s.prompt_len, p.len)
        }));
        let tokens: usize = plan.iter().map(|p| p.len).sum();
        let labels = [KeyValue::new("batch_type", kind.label())];
        let m = metrics();
        m.batch_size.record(plan.len() as u64, &labels);
        m.batch_input_tokens.record(tokens as u64, &labels);
        kind
    }

    /// The form of this step's logits: each row's top candidates where the
    /// runner can reduce rows and every sequence sampling this step needs
    /// no more than it gives (see `Sampler::candidates`), so that only
    /// those leave the device; full rows otherwise.
    pub(super) fn logits_form(&self, plan: &[Planned], unconstrained: bool) -> LogitsForm {
        let max = self.exec.max_top_logits();
        if max == 0 || !unconstrained {
            return LogitsForm::Full;
        }
        let mut k = 0;
        for p in plan.iter().filter(|p| p.samples(&self.running)) {
            match self.running[p.seq].sampler.candidates() {
                Some(n) if n <= max => k = k.max(n),
                _ => return LogitsForm::Full,
            }
        }
        if k == 0 {
            LogitsForm::Full
        } else {
            LogitsForm::Top(k)
        }
    }
}
