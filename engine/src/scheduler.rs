//! The batch scheduler: an actor that owns the KV cache and every sequence,
//! and runs the model in continuous batches.
//!
//! Each step packs, within `max_batch_size` sequences and
//! `max_batch_input_tokens` tokens: one token for every decoding sequence,
//! then the next prompt chunk of sequences still prefilling, then new
//! requests in arrival order (a request that does not fit waits at the head
//! of the queue, so long prompts are never starved by short ones behind
//! them). A request is admitted only when blocks for its chunk are
//! available; when a decoding sequence needs a block and none is left, the
//! most recently admitted sequence is preempted (its blocks freed, its
//! tokens recomputed later). Full blocks are registered in the prefix cache
//! as they fill, so later requests sharing a prefix skip that work.
//!
//! The actor runs on its own OS thread (the forward pass is CPU-bound);
//! callers talk to it through a [`SchedulerHandle`] and receive [`Event`]s on
//! a tokio channel. Dropping a [`RequestStream`] cancels the request and
//! frees its blocks at the next step.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use opentelemetry::KeyValue;

use tokio::sync::mpsc as tmpsc;

use tandem_grammar::{ConstraintState, GrammarCompiler, GrammarError, TokenMask};
use tandem_types::{Constraint, FinishReason, GenFailure, InvalidRequest, RequestLimits};

use crate::backend::{LogitsForm, RunnerConfig, ServedModel, StepLogits, StepRunner};
use crate::block_manager::{BlockHash, KvEvent, block_hashes, chain_hash};
use crate::error::RequestError;
use crate::kv_cache::{BlockId, ExternalMemory, KvCache, KvCacheConfig, KvCacheError, KvPool};
use crate::metrics::{BatchType, metrics};
use tandem_types::egress;

use crate::model::SeqChunk;
use crate::moe::Combine;
use crate::sampler::{Sampled, Sampler, SamplingParams};
pub use tandem_types::Usage;

/// Limits of the scheduler, validated at startup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Most sequences in one step.
    pub max_batch_size: usize,
    /// Most tokens (prompt chunks plus decode tokens) in one step.
    pub max_batch_input_tokens: usize,
    /// Longest sequence (prompt plus generated tokens).
    pub max_length: usize,
    /// Tokens per KV block (`--kv-cache-page-size`).
    pub block_size: usize,
    /// Blocks in the KV pool.
    pub num_blocks: usize,
    pub prefix_caching: bool,
    /// Tensor-parallel ranks (CPU threads over shared memory); 1 = none.
    pub tp: usize,
    /// How a mixture-of-experts model's layers combine experts across the
    /// ranks (dense models ignore it).
    pub moe_combine: Combine,
}

/// A configuration value the scheduler cannot run with.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid scheduler config: {0}")]
pub struct ConfigError(pub String);

impl SchedulerConfig {
    pub fn validate(&self, model_context: usize) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError(m));
        if self.max_batch_size == 0 {
            return bad("max_batch_size must be at least 1".into());
        }
        if self.max_batch_input_tokens < self.max_batch_size {
            return bad(format!(
                "max_batch_input_tokens ({}) must be at least max_batch_size ({}) so every running sequence can decode",
                self.max_batch_input_tokens, self.max_batch_size
            ));
        }
        if self.max_length < 2 || self.max_length > model_context {
            return bad(format!(
                "max_length {} must be between 2 and the model's context length {model_context}",
                self.max_length
            ));
        }
        if self.block_size == 0 || self.block_size > 1024 {
            return bad(format!(
                "block size {} must be between 1 and 1024",
                self.block_size
            ));
        }
        if self.tp == 0 || self.tp > 64 {
            return bad(format!(
                "tensor parallelism {} must be between 1 and 64",
                self.tp
            ));
        }
        if self.num_blocks < self.max_length.div_ceil(self.block_size) {
            return bad(format!(
                "{} KV blocks of {} tokens cannot hold one sequence of max_length {}",
                self.num_blocks, self.block_size, self.max_length
            ));
        }
        Ok(())
    }
}

/// One generation request, already tokenized.
#[derive(Debug, Clone)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    /// Sampling one of these ends the request; it is not reported as text.
    pub stop_token_ids: Vec<u32>,
    /// Where the prompt's KV comes from or goes to.
    pub handoff: KvHandoff,
    /// What the generated text must match (compiled at submit).
    pub constraint: Option<Constraint>,
}

/// The role of a request in a disaggregated prefill/decode handoff.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum KvHandoff {
    /// Prefill and decode here.
    #[default]
    Local,
    /// Prefill here, sample the first token, then hold the prompt's blocks
    /// ([`Event::Exported`]) until the stream is dropped, so a transfer
    /// engine can copy them to a decode node. Nothing is decoded.
    Export,
    /// The prompt's KV arrives from elsewhere: blocks are reserved after the
    /// local prefix-cache lookup ([`Event::ImportReady`]), and the sequence
    /// waits, outside the batch, until [`RequestStream::complete_import`].
    Import,
}

/// Blocks of an exported prompt, held until the request stream is dropped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exported {
    /// The prompt's block table, in order.
    pub blocks: Vec<BlockId>,
    /// Prompt tokens found in this node's prefix cache.
    pub cached_tokens: usize,
}

/// Destination blocks reserved for an imported prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportSlot {
    /// The prompt's whole block table, in order.
    pub blocks: Vec<BlockId>,
    /// Leading blocks already present from the local prefix cache: only
    /// `blocks[cached_blocks..]` need to be written.
    pub cached_blocks: usize,
}

/// How an import ended, told to the scheduler by the transfer's owner.
#[derive(Debug, Clone, PartialEq)]
pub enum ImportOutcome {
    /// The prompt's KV is in place; `first` was sampled by the prefill node.
    Ready {
        first: Sampled,
        /// Prompt tokens the prefill node served from its own cache.
        remote_cached_tokens: usize,
    },
    /// The transfer failed or was abandoned: compute the prompt here,
    /// starting after the locally cached blocks.
    PrefillLocally,
}

/// What the scheduler tells a request's caller.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A generated token (not a stop token).
    Token(Sampled),
    /// The request is done; no more events follow.
    Finished(Usage),
    /// The request failed; no more events follow.
    Failed(GenFailure),
    /// An [`KvHandoff::Export`] prompt is computed; its blocks are held.
    Exported(Exported),
    /// An [`KvHandoff::Import`] request has its destination blocks.
    ImportReady(ImportSlot),
    /// An [`KvHandoff::Export`] prompt's blocks that became full in this
    /// step have layer `layer` final: a transfer engine may send that layer
    /// of them while later layers compute. Blocks completed this way, once
    /// their last layer is reported, are never written again.
    LayerDone(LayerDone),
}

/// Layer `layer` of the prompt blocks `first_block..first_block + blocks.len()`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerDone {
    pub layer: usize,
    /// Index of `blocks[0]` in the prompt's block table.
    pub first_block: usize,
    pub blocks: Vec<BlockId>,
}

/// Live counters, readable from any thread (for metrics and tests).
#[derive(Debug, Default)]
pub struct SchedulerStats {
    pub waiting: AtomicUsize,
    pub running: AtomicUsize,
    pub kv_blocks_total: AtomicUsize,
    pub kv_blocks_in_use: AtomicUsize,
    pub kv_blocks_cached: AtomicUsize,
    pub steps: AtomicU64,
    pub preemptions: AtomicU64,
    pub prefix_hit_tokens: AtomicU64,
    pub prefix_miss_tokens: AtomicU64,
    /// Sequences waiting for their KV from another node.
    pub importing: AtomicUsize,
    /// Exported prompts whose blocks are still held.
    pub exported: AtomicUsize,
    /// Forward passes failed in a row (0 after any that succeeds): a
    /// device that keeps failing shows here, for health checks.
    pub failed_steps_in_a_row: AtomicUsize,
    /// When the last step failed (`clock::unix_micros`; 0: never).
    pub last_failed_step_us: AtomicU64,
}

impl SchedulerStats {
    /// Whether the last [`FAILING_AFTER`] steps or more all failed, the
    /// last of them within [`FAILING_FOR`]. The state lapses by itself, so
    /// that a node a balancer stopped sending work to is tried again (one
    /// good step clears it; more failures set it again).
    pub fn failing(&self) -> bool {
        let last = self.last_failed_step_us.load(Ordering::Relaxed);
        let age = tandem_types::clock::unix_micros().saturating_sub(last);
        self.failed_steps_in_a_row.load(Ordering::Relaxed) >= FAILING_AFTER
            && u128::from(age) < FAILING_FOR.as_micros()
    }
}

/// Failed steps in a row after which the scheduler counts as failing.
pub const FAILING_AFTER: usize = 3;
/// How long the failing state lasts after the last failed step.
pub const FAILING_FOR: Duration = Duration::from_secs(30);

/// An event and when the scheduler sent it (for egress metrics).
type Stamped = (Instant, Event);
type EventTx = tmpsc::UnboundedSender<Stamped>;

/// Sends `ev`, counting it as buffered until the reader takes it. A reader
/// that went away is not an error: its stream's drop cancels the request.
fn emit(tx: &EventTx, ev: Event) {
    if tx.send((egress::produced(), ev)).is_err() {
        egress::discarded(1);
    }
}

/// A request on its way to the actor, with what `submit` prepared.
struct Submission {
    id: u64,
    req: Request,
    constraint: Option<ConstraintState>,
    events: EventTx,
    cached: Arc<AtomicUsize>,
}

enum Command {
    Submit(Box<Submission>),
    Cancel(u64),
    ImportDone(u64, Box<ImportOutcome>),
}

/// Receives prefix-cache events after every step that produced some (on
/// the scheduler thread: keep it quick, e.g. a channel send).
pub type KvEventSink = Box<dyn FnMut(Vec<KvEvent>) + Send>;

/// The caller's side of the actor. Cheap to clone.
#[derive(Debug, Clone)]
pub struct SchedulerHandle {
    tx: mpsc::Sender<Command>,
    next_id: Arc<AtomicU64>,
    stats: Arc<SchedulerStats>,
    vocab: usize,
    config: SchedulerConfig,
    pool: Arc<KvPool>,
    kv_config: KvCacheConfig,
    /// The pools of tensor-parallel ranks 1.., each holding its KV heads at
    /// the same block ids as rank 0's.
    peer_pools: Vec<Arc<KvPool>>,
    /// Compiles constraints; built on the first constrained request.
    grammar: Arc<GrammarSlot>,
}

/// The model's constraint compiler, built once on first use.
struct GrammarSlot {
    text: Option<Arc<tandem_modelfile::ModelText>>,
    compiler: std::sync::OnceLock<Result<GrammarCompiler, GrammarError>>,
}

impl std::fmt::Debug for GrammarSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GrammarSlot")
    }
}

impl GrammarSlot {
    fn compile(&self, c: &Constraint) -> Result<ConstraintState, InvalidRequest> {
        let Some(text) = &self.text else {
            return Err(InvalidRequest::Constraint(
                "this model has no tokenizer".into(),
            ));
        };
        let compiler = self
            .compiler
            .get_or_init(|| GrammarCompiler::new(&text.tokenizer));
        match compiler {
            Ok(g) => g.compile(c),
            Err(e) => Err(e.clone()),
        }
        .map_err(|e| InvalidRequest::Constraint(e.to_string()))
    }
}

/// Events of one request. Dropping it cancels the request.
#[derive(Debug)]
pub struct RequestStream {
    id: u64,
    /// Prompt tokens served from the prefix cache, known at admission.
    cached: Arc<AtomicUsize>,
    rx: tmpsc::UnboundedReceiver<Stamped>,
    tx: mpsc::Sender<Command>,
    done: bool,
}

impl RequestStream {
    /// The next event; `None` after `Finished`/`Failed` or if the scheduler stopped.
    pub async fn next(&mut self) -> Option<Event> {
        let ev = self.rx.recv().await;
        self.note(ev)
    }

    /// Blocking variant of [`RequestStream::next`] for synchronous callers.
    pub fn blocking_next(&mut self) -> Option<Event> {
        let ev = self.rx.blocking_recv();
        self.note(ev)
    }

    /// Prompt tokens found in the prefix cache (0 until admitted): lets a
    /// caller that stops reading early still report them.
    pub fn cached_tokens(&self) -> usize {
        self.cached.load(Ordering::Relaxed)
    }

    /// Ends the wait of an [`KvHandoff::Import`] request after
    /// [`Event::ImportReady`]. Ignored if the request is gone.
    pub fn complete_import(&self, outcome: ImportOutcome) {
        let _ = self
            .tx
            .send(Command::ImportDone(self.id, Box::new(outcome)));
    }

    fn note(&mut self, ev: Option<Stamped>) -> Option<Event> {
        if let Some((sent, _)) = &ev {
            egress::taken(*sent);
        }
        let ev = ev.map(|(_, e)| e);
        if matches!(ev, None | Some(Event::Finished(_)) | Some(Event::Failed(_))) {
            self.done = true;
        }
        ev
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        // Events never read are no longer buffered.
        self.rx.close();
        let mut unread = 0usize;
        while self.rx.try_recv().is_ok() {
            unread += 1;
        }
        egress::discarded(unread);
        if !self.done {
            // The scheduler may already be gone; then there is nothing to free.
            let _ = self.tx.send(Command::Cancel(self.id));
        }
    }
}

/// Owns the scheduler thread; dropping it (after all handles) stops it.
#[derive(Debug)]
pub struct Scheduler {
    handle: SchedulerHandle,
    thread: Option<JoinHandle<()>>,
}

impl Scheduler {
    /// Starts the actor on its own thread.
    pub fn spawn(
        model: Arc<dyn ServedModel>,
        config: SchedulerConfig,
    ) -> Result<Self, ConfigError> {
        Self::spawn_with_kv_events(model, config, None)
    }

    /// Starts the actor, publishing prefix-cache events to `sink` (for
    /// KV-aware routing); without a sink they are dropped.
    pub fn spawn_with_kv_events(
        model: Arc<dyn ServedModel>,
        config: SchedulerConfig,
        sink: Option<KvEventSink>,
    ) -> Result<Self, ConfigError> {
        Self::spawn_with_memory(model, config, sink, None)
    }

    /// Starts the actor with its KV pool in `memory` (a transfer engine's
    /// registered allocation, so that peers write it directly).
    pub fn spawn_with_memory(
        model: Arc<dyn ServedModel>,
        config: SchedulerConfig,
        sink: Option<KvEventSink>,
        memory: Option<ExternalMemory>,
    ) -> Result<Self, ConfigError> {
        config.validate(model.config().context_length)?;
        let exec = Arc::clone(&model)
            .runner(RunnerConfig {
                tp: config.tp,
                moe_combine: config.moe_combine,
                block_size: config.block_size,
                num_blocks: config.num_blocks,
            })
            .map_err(ConfigError)?;
        let kv_config = exec.kv_cache_config();
        let cache = KvCache::with_memory(kv_config, config.prefix_caching, memory)
            .map_err(|e| ConfigError(e.to_string()))?;
        let stats = Arc::new(SchedulerStats::default());
        // Export the counters from the start, not from their first event.
        let m = metrics();
        for c in [&m.preemptions, &m.prefix_cache_hits, &m.prefix_cache_misses] {
            c.add(0, &[]);
        }
        stats
            .kv_blocks_total
            .store(config.num_blocks, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel();
        let handle = SchedulerHandle {
            tx,
            next_id: Arc::new(AtomicU64::new(0)),
            stats: Arc::clone(&stats),
            vocab: model.config().vocab_size,
            config: config.clone(),
            pool: Arc::clone(cache.pool()),
            kv_config,
            peer_pools: exec.peer_pools(),
            grammar: Arc::new(GrammarSlot {
                text: Some(Arc::clone(model.text())),
                compiler: std::sync::OnceLock::new(),
            }),
        };
        let actor = Actor {
            model,
            exec,
            config,
            cache,
            rx,
            waiting: VecDeque::new(),
            running: Vec::new(),
            importing: Vec::new(),
            held: Vec::new(),
            kv_sink: sink,
            stats,
            admitted: 0,
            logits: StepLogits::default(),
        };
        let thread = std::thread::Builder::new()
            .name("tandem-scheduler".into())
            .spawn(move || actor.run())
            .map_err(|e| ConfigError(format!("spawning the scheduler thread: {e}")))?;
        Ok(Self {
            handle,
            thread: Some(thread),
        })
    }

    pub fn handle(&self) -> &SchedulerHandle {
        &self.handle
    }

    /// Stops the actor once every handle clone is dropped, and waits for it.
    /// In-flight requests end with `Failed(GenFailure::ShuttingDown)`.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        // Replace our sender with a dangling one so the channel can close.
        let (dead, _) = mpsc::channel();
        self.handle.tx = dead;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        self.stop();
    }
}

impl SchedulerHandle {
    /// Validates and queues a request. Errors here are the caller's (4xx).
    pub fn submit(&self, req: Request) -> Result<RequestStream, RequestError> {
        let limits = RequestLimits {
            max_length: self.config.max_length,
            vocab_size: self.vocab,
        };
        let mut req = req;
        req.max_tokens = limits.check(&req.prompt, Some(req.max_tokens), &req.sampling)?;
        // Compiled here, on the caller's thread, not the scheduler's.
        let constraint = match &req.constraint {
            Some(c) => Some(self.grammar.compile(c)?),
            None => None,
        };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (etx, erx) = tmpsc::unbounded_channel();
        let cached = Arc::new(AtomicUsize::new(0));
        self.stats.waiting.fetch_add(1, Ordering::Relaxed);
        if self
            .tx
            .send(Command::Submit(Box::new(Submission {
                id,
                req,
                constraint,
                events: etx,
                cached: Arc::clone(&cached),
            })))
            .is_err()
        {
            self.stats.waiting.fetch_sub(1, Ordering::Relaxed);
            return Err(RequestError::Stopped);
        }
        Ok(RequestStream {
            id,
            cached,
            rx: erx,
            tx: self.tx.clone(),
            done: false,
        })
    }

    pub fn stats(&self) -> &SchedulerStats {
        &self.stats
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// The KV pool's memory (for a transfer engine to register) and shape:
    /// rank 0's under tensor parallelism (its share of the KV heads).
    pub fn kv_pool(&self) -> (&Arc<KvPool>, &KvCacheConfig) {
        (&self.pool, &self.kv_config)
    }

    /// Every tensor-parallel rank's pool, rank 0 first; all have rank 0's
    /// shape (`kv_pool().1`).
    pub fn rank_pools(&self) -> Vec<Arc<KvPool>> {
        std::iter::once(Arc::clone(&self.pool))
            .chain(self.peer_pools.iter().cloned())
            .collect()
    }
}

/// One sequence owned by the actor.
struct Seq {
    id: u64,
    /// The grammar state of a constrained request.
    constraint: Option<ConstraintState>,
    /// Prompt followed by generated tokens.
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Tokens whose K/V are in the cache.
    computed: usize,
    table: Vec<BlockId>,
    /// Hashes of the full blocks registered in the prefix cache so far.
    hashes: Vec<BlockHash>,
    sampler: Sampler,
    max_tokens: usize,
    stop_token_ids: Vec<u32>,
    cached_tokens: usize,
    /// `cached_tokens`, shared with the request's stream.
    cached_shared: Arc<AtomicUsize>,
    /// Admission order; the latest admitted is preempted first.
    admitted: u64,
    handoff: KvHandoff,
    events: EventTx,
}

impl Seq {
    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Appends a sampled token; returns why the sequence ends, if it does.
    fn accept(&mut self, sampled: Sampled) -> Option<FinishReason> {
        if self.stop_token_ids.contains(&sampled.token) {
            return Some(FinishReason::Stop);
        }
        self.tokens.push(sampled.token);
        emit(&self.events, Event::Token(sampled));
        (self.generated() >= self.max_tokens).then_some(FinishReason::Length)
    }
}

struct Actor {
    model: Arc<dyn ServedModel>,
    exec: Box<dyn StepRunner>,
    config: SchedulerConfig,
    cache: KvCache,
    rx: mpsc::Receiver<Command>,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    /// Admitted [`KvHandoff::Import`] sequences waiting for their KV.
    importing: Vec<Seq>,
    /// Computed [`KvHandoff::Export`] sequences holding their blocks.
    held: Vec<Seq>,
    kv_sink: Option<KvEventSink>,
    stats: Arc<SchedulerStats>,
    admitted: u64,
    /// The last step's logits, kept so each step reuses the memory.
    logits: StepLogits,
}

/// Whether a runner's `logits` hold `rows` rows in the form asked for
/// (`want`) or full: the sampling below indexes them.
fn check_logits(
    logits: &StepLogits,
    want: LogitsForm,
    rows: usize,
    vocab: usize,
) -> Result<(), RequestError> {
    let (width, fits) = match (logits.form, want) {
        (LogitsForm::Full, _) => (vocab, logits.values.len() == rows * vocab),
        (LogitsForm::Top(k), LogitsForm::Top(asked)) => (
            k,
            k >= asked
                && logits.values.len() == rows * k
                && logits.ids.len() == rows * k
                && logits.log_z.len() == rows,
        ),
        (LogitsForm::Top(k), LogitsForm::Full) => (k, false),
    };
    if fits {
        Ok(())
    } else {
        Err(RequestError::LogitsShape {
            rows,
            width,
            got: logits.values.len(),
        })
    }
}

/// Why a sequence leaves the batch after a step.
enum Leave {
    Finished(FinishReason),
    /// An exported prompt, now held for its transfer.
    Exported,
    Failed(GrammarError),
}

/// A sequence's share of one step.
struct Planned {
    /// Index into `running`.
    seq: usize,
    len: usize,
}

impl Planned {
    /// Whether this chunk ends its sequence's known tokens, so the step
    /// samples the sequence's next one from the chunk's logits.
    fn samples(&self, running: &[Seq]) -> bool {
        let s = &running[self.seq];
        s.computed + self.len == s.tokens.len()
    }
}

impl Actor {
    fn run(mut self) {
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
        for seq in all
            .chain(self.importing.drain(..))
            .chain(self.held.drain(..))
        {
            emit(&seq.events, Event::Failed(GenFailure::ShuttingDown));
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit(b) => {
                let Submission {
                    id,
                    req,
                    constraint,
                    events,
                    cached: cached_shared,
                } = *b;
                let sampler = match Sampler::new(req.sampling, &req.prompt) {
                    Ok(s) => s,
                    Err(e) => {
                        self.stats.waiting.fetch_sub(1, Ordering::Relaxed);
                        emit(&events, Event::Failed(GenFailure::Internal(e.to_string())));
                        return;
                    }
                };
                let max_tokens = match req.handoff {
                    KvHandoff::Export => 1,
                    _ => req.max_tokens,
                }
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
                    handoff: req.handoff,
                    constraint,
                    events,
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
        }
    }

    fn free(&mut self, seq: &mut Seq) {
        release(&mut self.cache, seq);
    }

    /// An import ended: the sequence joins the batch, either decoding after
    /// the first token from the prefill node or prefilling here.
    fn finish_import(&mut self, id: u64, outcome: ImportOutcome) {
        let Some(i) = self.importing.iter().position(|s| s.id == id) else {
            return; // cancelled meanwhile
        };
        let mut s = self.importing.swap_remove(i);
        s.handoff = KvHandoff::Local;
        let (first, remote_cached) = match outcome {
            ImportOutcome::PrefillLocally => {
                self.running.push(s);
                return;
            }
            ImportOutcome::Ready {
                first,
                remote_cached_tokens,
            } => (first, remote_cached_tokens),
        };
        // What the prefill node wrote must reach the runner's own KV
        // memory (a device's) before the sequence's next step reads it.
        let landed = &s.table[(s.computed / self.config.block_size).min(s.table.len())..];
        if let Err(e) = self.exec.kv_written(&self.cache, landed) {
            tracing::warn!(request = id, error = %e, "imported KV did not reach the runner");
            emit(
                &s.events,
                Event::Failed(GenFailure::Internal(e.to_string())),
            );
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
            emit(
                &s.events,
                Event::Failed(GenFailure::Internal(e.to_string())),
            );
            self.free(&mut s);
            return;
        }
        match s.accept(first) {
            Some(finish) => self.retire(s, finish),
            None => self.running.push(s),
        }
    }

    fn retire(&mut self, mut s: Seq, finish: FinishReason) {
        let usage = Usage {
            prompt_tokens: s.prompt_len,
            completion_tokens: s.generated(),
            cached_tokens: s.cached_tokens,
            finish,
        };
        emit(&s.events, Event::Finished(usage));
        self.free(&mut s);
    }

    /// Plans and runs one batch, then samples and retires sequences.
    /// Returns false when there was nothing to run.
    fn step(&mut self) -> bool {
        let plan = self.plan();
        if plan.is_empty() {
            return false;
        }
        let batch_type = self.record_batch(&plan);
        // Export sequences' blocks that this step fills: their layers can
        // leave as soon as each layer is written.
        let bs = self.config.block_size;
        let filling: Vec<(EventTx, usize, Vec<BlockId>)> = plan
            .iter()
            .filter_map(|p| {
                let s = &self.running[p.seq];
                if s.handoff != KvHandoff::Export {
                    return None;
                }
                let (from, to) = (s.computed / bs, (s.computed + p.len).min(s.prompt_len) / bs);
                (to > from).then(|| (s.events.clone(), from, s.table[from..to].to_vec()))
            })
            .collect();
        let mut layer_done = |layer: usize| {
            for (tx, first_block, blocks) in &filling {
                let ev = LayerDone {
                    layer,
                    first_block: *first_block,
                    blocks: blocks.clone(),
                };
                emit(tx, Event::LayerDone(ev));
            }
        };
        // Constrained sequences sampling this step: their token masks are
        // computed on another thread while the forward pass runs.
        let mut constrained: Vec<(usize, ConstraintState)> = plan
            .iter()
            .filter_map(|p| {
                p.samples(&self.running)
                    .then(|| self.running[p.seq].constraint.take())
                    .flatten()
                    .map(|c| (p.seq, c))
            })
            .collect();
        let want = self.logits_form(&plan, constrained.is_empty());
        // The step's logits, in a buffer kept across steps.
        let mut logits = std::mem::take(&mut self.logits);
        let (result, masks) = std::thread::scope(|scope| {
            let masker = (!constrained.is_empty()).then(|| {
                scope.spawn(|| {
                    constrained
                        .iter_mut()
                        .map(|(_, c)| c.mask())
                        .collect::<Vec<_>>()
                })
            });
            let chunks: Vec<SeqChunk<'_>> = plan
                .iter()
                .map(|p| {
                    let s = &self.running[p.seq];
                    SeqChunk {
                        tokens: &s.tokens[s.computed..s.computed + p.len],
                        start_pos: s.computed,
                        block_table: &s.table,
                        want_logits: p.samples(&self.running),
                    }
                })
                .collect();
            let t0 = std::time::Instant::now();
            let result =
                self.exec
                    .forward(&chunks, &mut self.cache, &mut layer_done, want, &mut logits);
            metrics().forward_time.record(
                t0.elapsed().as_secs_f64() * 1e3,
                &[KeyValue::new("batch_type", batch_type.label())],
            );
            let masks = masker.map(|h| {
                h.join().unwrap_or_else(|_| {
                    vec![Err(GrammarError::Engine("mask thread panicked".into())); 1]
                })
            });
            (result, masks)
        });
        let mut masks: std::collections::HashMap<usize, Result<TokenMask, GrammarError>> =
            constrained
                .iter()
                .map(|(i, _)| *i)
                .zip(masks.unwrap_or_default())
                .collect();
        for (i, c) in constrained {
            self.running[i].constraint = Some(c);
        }
        self.stats.steps.fetch_add(1, Ordering::Relaxed);
        let vocab = self.model.config().vocab_size;
        let rows = plan.iter().filter(|p| p.samples(&self.running)).count();
        let result = result.and_then(|()| check_logits(&logits, want, rows, vocab));
        match result {
            Ok(()) => self.stats.failed_steps_in_a_row.store(0, Ordering::Relaxed),
            Err(e) => {
                self.stats
                    .failed_steps_in_a_row
                    .fetch_add(1, Ordering::Relaxed);
                self.stats
                    .last_failed_step_us
                    .store(tandem_types::clock::unix_micros(), Ordering::Relaxed);
                // Inputs are validated at submit, so this is a bug: fail the
                // batch's sequences rather than the whole server.
                tracing::error!(error = %e, "forward pass failed");
                let mut idx: Vec<usize> = plan.iter().map(|p| p.seq).collect();
                idx.sort_unstable_by(|a, b| b.cmp(a));
                for i in idx {
                    let mut s = self.running.swap_remove(i);
                    emit(
                        &s.events,
                        Event::Failed(GenFailure::Internal(e.to_string())),
                    );
                    self.free(&mut s);
                }
                return true;
            }
        };
        let mut row = 0;
        // Sequences leaving the batch: finished (Some) or exported (None).
        let mut leaving = Vec::new();
        for p in &plan {
            let s = &mut self.running[p.seq];
            s.computed += p.len;
            register_full_blocks(&mut self.cache, s, self.config.block_size);
            if s.computed < s.tokens.len() {
                continue;
            }
            let this = row;
            row += 1;
            let mask = match masks.remove(&p.seq) {
                Some(Ok(mask)) => Some(mask),
                Some(Err(e)) => {
                    leaving.push((p.seq, Leave::Failed(e)));
                    continue;
                }
                None if s.constraint.is_some() => {
                    leaving.push((
                        p.seq,
                        Leave::Failed(GrammarError::Engine("no mask computed".into())),
                    ));
                    continue;
                }
                None => None,
            };
            // The rows' shape was checked above.
            let sampled = match (logits.form, mask) {
                (LogitsForm::Full, mask) => {
                    // Sampled in place: each row belongs to one sequence.
                    let l = &mut logits.values[this * vocab..(this + 1) * vocab];
                    if let Some(mask) = mask {
                        mask.apply(l);
                    }
                    s.sampler.sample(l)
                }
                (LogitsForm::Top(k), None) => {
                    let at = this * k..(this + 1) * k;
                    let ids = &logits.ids[at.clone()];
                    let n = ids.iter().take_while(|&&i| (i as usize) < vocab).count();
                    let values = &logits.values[at];
                    s.sampler
                        .sample_top(&ids[..n], &values[..n], logits.log_z[this])
                }
                // Top rows are asked for only when no sequence is
                // constrained.
                (LogitsForm::Top(_), Some(_)) => {
                    leaving.push((
                        p.seq,
                        Leave::Failed(GrammarError::Engine(
                            "a constrained sequence got reduced logits".into(),
                        )),
                    ));
                    continue;
                }
            };
            if let Some(c) = &mut s.constraint
                && let Err(e) = c.consume(sampled.token)
            {
                leaving.push((p.seq, Leave::Failed(e)));
                continue;
            }
            if s.handoff == KvHandoff::Export {
                // The decode node judges stop tokens; report whatever came.
                emit(&s.events, Event::Token(sampled));
                leaving.push((p.seq, Leave::Exported));
                continue;
            }
            if let Some(finish) = s.accept(sampled) {
                leaving.push((p.seq, Leave::Finished(finish)));
            }
        }
        self.logits = logits;
        leaving.sort_unstable_by_key(|f| std::cmp::Reverse(f.0));
        for (i, finish) in leaving {
            let mut s = self.running.swap_remove(i);
            match finish {
                Leave::Finished(finish) => self.retire(s, finish),
                // A grammar engine failure ends its sequence, not the batch.
                Leave::Failed(e) => {
                    emit(
                        &s.events,
                        Event::Failed(GenFailure::Internal(e.to_string())),
                    );
                    self.free(&mut s);
                }
                Leave::Exported => {
                    let exported = Exported {
                        blocks: s.table.clone(),
                        cached_tokens: s.cached_tokens,
                    };
                    emit(&s.events, Event::Exported(exported));
                    self.held.push(s);
                }
            }
        }
        true
    }

    /// The form of this step's logits: each row's top candidates where the
    /// runner can reduce rows and every sequence sampling this step needs
    /// no more than it gives (see `Sampler::candidates`), so that only
    /// those leave the device; full rows otherwise.
    fn logits_form(&self, plan: &[Planned], unconstrained: bool) -> LogitsForm {
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

    /// Chooses this step's work; reserves the KV blocks it needs.
    fn plan(&mut self) -> Vec<Planned> {
        let mut tokens_left = self.config.max_batch_input_tokens;
        let mut plan: Vec<Planned> = Vec::new();

        // 1. Running sequences: decode tokens and continuing prefill chunks,
        //    oldest first. Preempt the newest when blocks run out.
        self.running.sort_by_key(|s| s.admitted);
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() {
            if plan.len() == self.config.max_batch_size || tokens_left == 0 {
                break;
            }
            let s = &self.running[i];
            let len = (s.tokens.len() - s.computed).min(tokens_left);
            let need = s.computed + len;
            let mut table = std::mem::take(&mut self.running[i].table);
            let reserved = self.cache.reserve(&mut table, need);
            self.running[i].table = table;
            match reserved {
                Ok(()) => {
                    plan.push(Planned { seq: i, len });
                    tokens_left -= len;
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
                    emit(
                        &s.events,
                        Event::Failed(GenFailure::Internal(e.to_string())),
                    );
                    self.free(&mut s);
                }
            }
        }

        // 2. New (or preempted) requests in arrival order; none in a step that
        //    had to preempt, or the victim would be readmitted and evicted again.
        while !preempted && plan.len() < self.config.max_batch_size && tokens_left > 0 {
            let Some(mut s) = self.waiting.pop_front() else {
                break;
            };
            let first_admission = s.admitted == 0;
            if s.table.is_empty() {
                // Reuse cached full blocks, leaving at least one token to run
                // so the step produces logits.
                let hashes = block_hashes(&s.tokens[..s.tokens.len() - 1], self.config.block_size);
                s.table = self.cache.blocks_mut().match_prefix(&hashes);
                s.computed = s.table.len() * self.config.block_size;
                s.hashes = hashes[..s.table.len()].to_vec();
                if first_admission {
                    s.cached_tokens = s.computed.min(s.prompt_len);
                    s.cached_shared.store(s.cached_tokens, Ordering::Relaxed);
                }
            }
            let len = match s.handoff {
                // Room for the whole prompt, written by the prefill node.
                KvHandoff::Import => s.prompt_len - s.computed,
                _ => (s.tokens.len() - s.computed).min(tokens_left),
            };
            if self.cache.reserve(&mut s.table, s.computed + len).is_err() {
                // Not enough blocks now: keep its place at the head of the queue.
                self.free(&mut s);
                s.computed = 0;
                self.waiting.push_front(s);
                break;
            }
            if first_admission {
                let hit = s.cached_tokens as u64;
                self.stats
                    .prefix_hit_tokens
                    .fetch_add(hit, Ordering::Relaxed);
                self.stats
                    .prefix_miss_tokens
                    .fetch_add(s.prompt_len as u64 - hit, Ordering::Relaxed);
                metrics().prefix_cache_hits.add(hit, &[]);
                metrics()
                    .prefix_cache_misses
                    .add(s.prompt_len as u64 - hit, &[]);
            }
            self.admitted += 1;
            s.admitted = self.admitted;
            if s.handoff == KvHandoff::Import {
                let slot = ImportSlot {
                    blocks: s.table.clone(),
                    cached_blocks: s.computed / self.config.block_size,
                };
                emit(&s.events, Event::ImportReady(slot));
                self.importing.push(s);
                continue;
            }
            tokens_left -= len;
            plan.push(Planned {
                seq: self.running.len(),
                len,
            });
            self.running.push(s);
        }
        plan
    }

    /// Records the size and kind of a planned step; returns the kind.
    fn record_batch(&self, plan: &[Planned]) -> BatchType {
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

    fn publish_kv_events(&mut self) {
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

fn release(cache: &mut KvCache, seq: &mut Seq) {
    if let Err(e) = cache.blocks_mut().release(&mut seq.table) {
        tracing::error!(seq = seq.id, error = %e, "releasing KV blocks");
    }
    seq.hashes.clear();
}

/// Registers the sequence's newly completed full blocks in the prefix cache.
fn register_full_blocks(cache: &mut KvCache, s: &mut Seq, block_size: usize) {
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
