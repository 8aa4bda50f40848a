//! The actor's state and its life outside a step: the sequences it owns
//! (waiting, running, importing, held), the commands it takes, the end of
//! an import, and what it publishes after each step. A step itself is
//! `plan.rs` (what runs) and `step.rs` (run, sample, retire).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;

use tandem_grammar::ConstraintState;
use tandem_types::{FinishReason, GenFailure};

use super::stream::Sink;
use super::{
    Command, ImportOutcome, KvEventSink, SchedulerConfig, SchedulerStats, Submission, Usage,
};
use crate::backend::{ServedModel, StepLogits, StepRunner};
use crate::block_manager::{BlockHash, chain_hash};
use crate::kv_cache::{BlockId, KvCache};
use crate::metrics::metrics;
use crate::sampler::{Sampled, Sampler};
use tandem_kvtier::TierStore;

/// One sequence owned by the actor.
pub(super) struct Seq {
    pub(super) id: u64,
    /// The grammar state of a constrained request.
    pub(super) constraint: Option<ConstraintState>,
    /// Prompt followed by generated tokens.
    pub(super) tokens: Vec<u32>,
    pub(super) prompt_len: usize,
    /// Tokens whose K/V are in the cache.
    pub(super) computed: usize,
    pub(super) table: Vec<BlockId>,
    /// Hashes of the full blocks registered in the prefix cache so far.
    pub(super) hashes: Vec<BlockHash>,
    pub(super) sampler: Sampler,
    pub(super) max_tokens: usize,
    pub(super) stop_token_ids: Vec<u32>,
    pub(super) cached_tokens: usize,
    /// `cached_tokens`, shared with the request's stream.
    pub(super) cached_shared: Arc<AtomicUsize>,
    /// Admission order; the latest admitted is preempted first.
    pub(super) admitted: u64,
    /// Where its events go (and whether it is an export or an import).
    pub(super) sink: Sink,
    /// Times it waited for its prefix to be read from a KV tier.
    pub(super) tier_waits: u8,
}

impl Seq {
    pub(super) fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Appends a sampled token; returns why the sequence ends, if it does.
    pub(super) fn accept(&mut self, sampled: Sampled) -> Option<FinishReason> {
        if self.stop_token_ids.contains(&sampled.token) {
            return Some(FinishReason::Stop);
        }
        self.tokens.push(sampled.token);
        self.sink.token(sampled);
        (self.generated() >= self.max_tokens).then_some(FinishReason::Length)
    }
}

pub(super) struct Actor {
    pub(super) model: Arc<dyn ServedModel>,
    pub(super) exec: Box<dyn StepRunner>,
    pub(super) config: SchedulerConfig,
    pub(super) cache: KvCache,
    pub(super) rx: mpsc::Receiver<Command>,
    pub(super) waiting: VecDeque<Seq>,
    pub(super) running: Vec<Seq>,
    /// Admitted imports waiting for their KV.
    pub(super) importing: Vec<Seq>,
    /// Computed exports and holds, pinning their blocks.
    pub(super) held: Vec<Seq>,
    pub(super) kv_sink: Option<KvEventSink>,
    /// The KV tiers below the pool, if any (`scheduler/tiers.rs`).
    pub(super) tiers: Option<TierStore>,
    pub(super) stats: Arc<SchedulerStats>,
    pub(super) admitted: u64,
    /// The last step's logits, kept so each step reuses the memory.
    pub(super) logits: StepLogits,
}

impl Actor {
    pub(super) fn run(mut self) {
        let mut idle = true;
        loop {
            // Block for a command only when there is nothing to compute.
            if idle {
                match self.rx.recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(_) => break,
                }
            }
            let mut closed = false;
            loop {
                match self.rx.try_recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        closed = true;
                        break;
                    }
                }
            }
            if closed {
                break;
            }
            idle = !self.step();
            self.publish_stats();
            self.publish_kv_events();
        }
        let all = self.waiting.drain(..).chain(self.running.drain(..));
        for mut seq in all
            .chain(self.importing.drain(..))
            .chain(self.held.drain(..))
        {
            seq.sink.fail(GenFailure::ShuttingDown);
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit(b) => {
                let Submission {
                    id,
                    req,
                    constraint,
                    mut sink,
                    cached: cached_shared,
                } = *b;
                let sampler = match Sampler::new(req.sampling, &req.prompt) {
                    Ok(s) => s,
                    Err(e) => {
                        self.stats.waiting.fetch_sub(1, Ordering::Relaxed);
                        sink.fail(GenFailure::Internal(e.to_string()));
                        return;
                    }
                };
                let max_tokens = if sink.is_export() { 1 } else { req.max_tokens }
                    .min(self.config.max_length - req.prompt.len());
                self.waiting.push_back(Seq {
                    id,
                    prompt_len: req.prompt.len(),
                    tokens: req.prompt,
                    computed: 0,
                    table: Vec::new(),
                    hashes: Vec::new(),
                    sampler,
                    max_tokens,
                    stop_token_ids: req.stop_token_ids,
                    cached_tokens: 0,
                    cached_shared,
                    admitted: 0,
                    constraint,
                    sink,
                    tier_waits: 0,
                });
            }
            Command::Cancel(id) => {
                if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
                    if let Some(mut s) = self.waiting.remove(i) {
                        self.free(&mut s);
                    }
                } else {
                    for list in [&mut self.running, &mut self.importing, &mut self.held] {
                        if let Some(i) = list.iter().position(|s| s.id == id) {
                            let mut s = list.swap_remove(i);
                            release(&mut self.cache, &mut s);
                            break;
                        }
                    }
                }
            }
            Command::ImportDone(id, outcome) => self.finish_import(id, *outcome),
            // The next plan finds the landed blocks.
            Command::TierLoaded => {}
        }
    }

    pub(super) fn free(&mut self, seq: &mut Seq) {
        release(&mut self.cache, seq);
    }

    /// An import ended: the sequence joins the batch, either decoding after
    /// the first token from the prefill node or prefilling here.
    fn finish_import(&mut self, id: u64, outcome: ImportOutcome) {
        let Some(i) = self.importing.iter().position(|s| s.id == id) else {
            return; // cancelled meanwhile
        };
        let mut s = self.importing.swap_remove(i);
        let (first, remote_cached) = match outcome {
            ImportOutcome::PrefillLocally { fetched_blocks } => {
                self.take_fetched(s, fetched_blocks);
                return;
            }
            ImportOutcome::Ready {
                first,
                remote_cached_tokens,
            } => (first, remote_cached_tokens),
        };
        // This node's own hits: the prefill node's are its own to count.
        self.count_prefix_hits(&s);
        // What the prefill node wrote must reach the runner's own KV
        // memory (a device's) before the sequence's next step reads it.
        let landed = &s.table[(s.computed / self.config.block_size).min(s.table.len())..];
        if let Err(e) = self.exec.kv_written(&self.cache, landed) {
            tracing::warn!(request = id, error = %e, "imported KV did not reach the runner");
            s.sink.fail(GenFailure::Internal(e.to_string()));
            self.free(&mut s);
            return;
        }
        s.computed = s.prompt_len;
        // Tokens computed by nobody: cached here or on the prefill node.
        s.cached_tokens = s.cached_tokens.max(remote_cached.min(s.prompt_len));
        s.cached_shared.store(s.cached_tokens, Ordering::Relaxed);
        register_full_blocks(&mut self.cache, &mut s, self.config.block_size);
        s.sampler.accept_external(first.token);
        if let Some(c) = &mut s.constraint
            && let Err(e) = c.consume(first.token)
        {
            s.sink.fail(GenFailure::Internal(e.to_string()));
            self.free(&mut s);
            return;
        }
        match s.accept(first) {
            Some(finish) => self.finish(s, finish),
            None => self.running.push(s),
        }
    }

    /// An import to be computed here joins the batch, after the
    /// `fetched` blocks a peer wrote behind its cached ones (at most up to
    /// the prompt's last full block before its last token, which must run
    /// to produce logits), registered in the prefix cache as if computed.
    fn take_fetched(&mut self, mut s: Seq, fetched: usize) {
        let bs = self.config.block_size;
        let cached = s.computed / bs;
        let fetched = fetched.min(((s.prompt_len - 1) / bs).saturating_sub(cached));
        if fetched > 0 {
            let landed = &s.table[cached..cached + fetched];
            if let Err(e) = self.exec.kv_written(&self.cache, landed) {
                tracing::warn!(request = s.id, error = %e, "fetched KV did not reach the runner");
                s.sink.fail(GenFailure::Internal(e.to_string()));
                self.free(&mut s);
                return;
            }
            s.computed += fetched * bs;
            // Computed by nobody here: cached, as far as usage says.
            s.cached_tokens = s.cached_tokens.max(s.computed);
            s.cached_shared.store(s.cached_tokens, Ordering::Relaxed);
            register_full_blocks(&mut self.cache, &mut s, bs);
        }
        self.count_prefix_hits(&s);
        self.running.push(s);
    }

    /// A sequence that finished: its usage reported, its blocks freed.
    pub(super) fn finish(&mut self, mut s: Seq, finish: FinishReason) {
        let usage = Usage {
            prompt_tokens: s.prompt_len,
            completion_tokens: s.generated(),
            cached_tokens: s.cached_tokens,
            finish,
        };
        s.sink.finished(usage);
        self.free(&mut s);
    }

    fn publish_kv_events(&mut self) {
        self.publish_tier_drops();
        let events = self.cache.blocks_mut().take_events();
        if let (false, Some(sink)) = (events.is_empty(), self.kv_sink.as_mut()) {
            sink(events);
        }
    }

    fn publish_stats(&self) {
        let b = self.cache.blocks();
        let m = metrics();
        m.num_requests_queued.record(self.waiting.len() as u64, &[]);
        m.num_requests_running
            .record(self.running.len() as u64, &[]);
        m.kv_blocks_used.record(b.num_in_use() as u64, &[]);
        m.kv_blocks_free.record(
            self.config.num_blocks.saturating_sub(b.num_in_use()) as u64,
            &[],
        );
        self.stats
            .waiting
            .store(self.waiting.len(), Ordering::Relaxed);
        self.stats
            .running
            .store(self.running.len(), Ordering::Relaxed);
        self.stats
            .kv_blocks_in_use
            .store(b.num_in_use(), Ordering::Relaxed);
        self.stats
            .kv_blocks_cached
            .store(b.num_cached(), Ordering::Relaxed);
        self.stats
            .importing
            .store(self.importing.len(), Ordering::Relaxed);
        self.stats
            .exported
            .store(self.held.len(), Ordering::Relaxed);
    }
}

pub(super) fn release(cache: &mut KvCache, seq: &mut Seq) {
    if let Err(e) = cache.blocks_mut().release(&mut seq.table) {
        tracing::error!(seq = seq.id, error = %e, "releasing KV blocks");
    }
    seq.hashes.clear();
}

/// Registers the sequence's newly completed full blocks in the prefix cache.
pub(super) fn register_full_blocks(cache: &mut KvCache, s: &mut Seq, block_size: usize) {
    let full = s.computed / block_size;
    while s.hashes.len() < full {
        let i = s.hashes.len();
        let parent = s.hashes.last().copied();
        let block = &s.tokens[i * block_size..(i + 1) * block_size];
        let hash = chain_hash(parent.unwrap_or(0), block);
        if let Err(e) = cache.blocks_mut().register(s.table[i], hash, parent) {
            tracing::error!(seq = s.id, error = %e, "registering a cached block");
        }
        s.hashes.push(hash);
    }
}
