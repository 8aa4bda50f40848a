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
//! callers talk to it through a [`SchedulerHandle`], whose entry points are
//! typed by purpose, each with a stream of only the events it can produce:
//! [`SchedulerHandle::generate`] (tokens, then finished or failed),
//! [`SchedulerHandle::export`] (a prefill for a decode node elsewhere:
//! layers as they are written, then the held blocks) and
//! [`SchedulerHandle::import`] (a decode whose prompt KV comes from
//! elsewhere: the destination blocks, then tokens). Dropping a stream
//! cancels the request and frees its blocks at the next step.
//!
//! This file holds the caller's side (requests, events, the handle);
//! `scheduler/stream.rs` the channels and streams; the actor is in
//! `scheduler/`: `actor.rs` (its state, commands, imports ending,
//! publishing), `plan.rs` (choosing a step's work) and `step.rs` (running
//! it, sampling, retiring sequences).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use tandem_grammar::{ConstraintState, GrammarCompiler, GrammarError};
use tandem_types::{Constraint, GenFailure, GenerationRequest, InvalidRequest, RequestLimits};

use crate::backend::{RunnerConfig, ServedModel, StepLogits};
use crate::block_manager::KvEvent;
use crate::error::RequestError;
use crate::kv_cache::{BlockId, ExternalMemory, KvCache, KvCacheConfig, KvPool};
use crate::metrics::metrics;

use crate::moe::Combine;
use crate::sampler::{Sampled, SamplingParams};
use tandem_kvtier::{TierConfig, TierStore};
pub use tandem_types::Usage;

mod actor;
mod plan;
mod step;
mod stream;
mod tiers;

use actor::Actor;
pub use stream::{ExportStream, GenerateStream, HoldStream, ImportStream};
use stream::{Output, Sink, Ticket, channel};

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
    /// Tiers below the pool for evicted prefix blocks
    /// (`--kv-connector-config`); they need prefix caching.
    pub kv_tiers: Option<TierConfig>,
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
        if self.kv_tiers.is_some() && !self.prefix_caching {
            return bad(
                "KV tiers keep prefix-cache blocks, so they need prefix caching (drop --no-prefix-caching or --kv-connector-config)"
                    .into(),
            );
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

/// An exported prompt: its first token and its blocks, held until the
/// export's stream is dropped.
#[derive(Debug, Clone, PartialEq)]
pub struct Exported {
    /// The token sampled after the prompt (the decode node judges whether
    /// it stops).
    pub first: Sampled,
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
    /// Compute the rest of the prompt here, after the locally cached
    /// blocks and the `fetched_blocks` that follow them, which a peer wrote
    /// from its own cache (0 when the transfer failed or was abandoned).
    PrefillLocally { fetched_blocks: usize },
}

/// What an export tells its caller (a prefill node), in order: layers,
/// then one `Exported` or `Failed`.
#[derive(Debug, Clone, PartialEq)]
pub enum ExportEvent {
    /// The prompt's blocks that became full in this step have layer
    /// `layer` final: a transfer engine may send that layer of them while
    /// later layers compute. Blocks completed this way, once their last
    /// layer is reported, are never written again.
    LayerDone(LayerDone),
    /// The prompt is computed and its first token sampled; its blocks are
    /// held until the stream is dropped.
    Exported(Exported),
    /// The export failed; no more events follow.
    Failed(GenFailure),
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
    /// Prompt tokens run through the model, and the steps' time spent on
    /// them (each step's time split by token count).
    pub prompt_tokens_computed: AtomicU64,
    pub prompt_compute_nanos: AtomicU64,
}

impl SchedulerStats {
    /// Whether nothing waits or runs and no sequence holds a KV block
    /// (cached blocks no one uses do not count).
    pub fn idle(&self) -> bool {
        self.running.load(Ordering::Relaxed) + self.waiting.load(Ordering::Relaxed) == 0
            && self.kv_blocks_in_use.load(Ordering::Relaxed) == 0
    }

    /// Mean time to compute one prompt token so far; `None` before any.
    pub fn prompt_token_time(&self) -> Option<Duration> {
        let tokens = self.prompt_tokens_computed.load(Ordering::Relaxed);
        let nanos = self.prompt_compute_nanos.load(Ordering::Relaxed);
        (tokens > 0).then(|| Duration::from_nanos(nanos / tokens))
    }

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

/// A request on its way to the actor, with what `submit` prepared.
struct Submission {
    id: u64,
    req: GenerationRequest,
    constraint: Option<ConstraintState>,
    sink: Sink,
    cached: Arc<AtomicUsize>,
}

enum Command {
    Submit(Box<Submission>),
    Cancel(u64),
    ImportDone(u64, Box<ImportOutcome>),
    /// Blocks read from a KV tier have landed: waiting prompts can use them.
    TierLoaded,
}

/// Receives prefix-cache events after every step that produced some (on
/// the scheduler thread: keep it quick, e.g. a channel send).
pub type KvEventSink = Box<dyn FnMut(Vec<KvEvent>) + Send>;

/// The caller's side of the actor. Cheap to clone.
#[derive(Debug, Clone)]
pub struct SchedulerHandle {
    /// Shared by the clones; a KV tier's wake-up holds it weakly, so the
    /// actor still stops once every handle is gone.
    tx: Arc<mpsc::Sender<Command>>,
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
            .map_err(|e| ConfigError(e.to_string()))?;
        let kv_config = exec.kv_cache_config();
        let mut cache = KvCache::with_memory(kv_config, config.prefix_caching, memory)
            .map_err(|e| ConfigError(e.to_string()))?;
        let (tx, rx) = mpsc::channel();
        let tx = Arc::new(tx);
        let tiers = match &config.kv_tiers {
            Some(t) => {
                cache.blocks_mut().keep_evicted();
                let ranks = 1 + exec.peer_pools().len();
                let wake = Arc::downgrade(&tx);
                let tiers = open_tiers(t, &*model, config.block_size, &kv_config, ranks, wake)?;
                // A restarted node's disk blocks are its own again.
                cache.blocks_mut().announce(tiers.on_disk());
                Some(tiers)
            }
            None => None,
        };
        let stats = Arc::new(SchedulerStats::default());
        // Export the counters from the start, not from their first event.
        let m = metrics();
        for c in [&m.preemptions, &m.prefix_cache_hits, &m.prefix_cache_misses] {
            c.add(0, &[]);
        }
        stats
            .kv_blocks_total
            .store(config.num_blocks, Ordering::Relaxed);
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
            tiers,
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
        self.handle.tx = Arc::new(dead);
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

/// The tiers of `tiers` below pools of `kv`'s shape on `ranks` ranks: their
/// blocks hold every rank's share, their files are kept apart by model and
/// layout, and a landed disk read wakes the actor through `tx`.
fn open_tiers(
    tiers: &TierConfig,
    model: &dyn ServedModel,
    block_size: usize,
    kv: &KvCacheConfig,
    ranks: usize,
    tx: std::sync::Weak<mpsc::Sender<Command>>,
) -> Result<TierStore, ConfigError> {
    let fingerprint = model.fingerprint(block_size);
    let namespace = xxhash_rust::xxh3::xxh3_64(format!("{fingerprint:?} ranks={ranks}").as_bytes());
    let wake = Arc::new(move || {
        if let Some(tx) = tx.upgrade() {
            let _ = tx.send(Command::TierLoaded);
        }
    });
    TierStore::open(tiers, namespace, kv.block_bytes() * ranks, wake)
        .map_err(|e| ConfigError(e.to_string()))
}

impl SchedulerHandle {
    /// Generates here: prefills the prompt (reusing the prefix cache) and
    /// decodes. Errors here are the caller's (4xx).
    pub fn generate(&self, req: GenerationRequest) -> Result<GenerateStream, RequestError> {
        let (tx, events) = channel();
        let ticket = self.submit(
            req,
            Sink {
                output: Output::Tokens(tx),
                import: None,
            },
        )?;
        Ok(GenerateStream { events, ticket })
    }

    /// Prefills for a decode node elsewhere: computes the prompt, reporting
    /// each layer of its blocks as it is final, samples the first token
    /// and holds the blocks until the stream is dropped, so that a
    /// transfer engine can copy them. Nothing is decoded.
    pub fn export(
        &self,
        prompt: Vec<u32>,
        sampling: SamplingParams,
        constraint: Option<Constraint>,
    ) -> Result<ExportStream, RequestError> {
        let req = GenerationRequest {
            prompt,
            sampling,
            max_tokens: 1,
            stop_token_ids: Vec::new(),
            constraint,
        };
        let (tx, events) = channel();
        let ticket = self.submit(
            req,
            Sink {
                output: Output::Export(tx),
                import: None,
            },
        )?;
        Ok(ExportStream { events, ticket })
    }

    /// Pins the longest run of `prompt`'s leading full blocks this node has
    /// cached, in its pool or its KV tiers (brought up to the pool), so
    /// that a peer can copy them; nothing is computed. The blocks stay
    /// pinned, their bytes in the (host) pool, until the stream is dropped.
    pub fn hold_prefix(&self, prompt: Vec<u32>) -> Result<HoldStream, RequestError> {
        let req = GenerationRequest {
            prompt,
            sampling: SamplingParams::greedy(),
            max_tokens: 1,
            stop_token_ids: Vec::new(),
            constraint: None,
        };
        let (tx, events) = channel();
        let ticket = self.submit(
            req,
            Sink {
                output: Output::Hold(tx),
                import: None,
            },
        )?;
        Ok(HoldStream { events, ticket })
    }

    /// Decodes a prompt whose KV comes from elsewhere: reserves its blocks
    /// after the prefix-cache lookup ([`ImportStream::slot`]) and waits,
    /// outside the batch, until [`ImportStream::complete`].
    pub fn import(&self, req: GenerationRequest) -> Result<ImportStream, RequestError> {
        let (tx, tokens) = channel();
        let (slot_tx, slot) = channel();
        let ticket = self.submit(
            req,
            Sink {
                output: Output::Tokens(tx),
                import: Some(slot_tx),
            },
        )?;
        Ok(ImportStream {
            slot,
            tokens,
            ticket,
        })
    }

    /// Validates and queues a request whose events go to `sink`; its
    /// constraint is compiled here, on the caller's thread.
    fn submit(&self, req: GenerationRequest, sink: Sink) -> Result<Ticket, RequestError> {
        req.check(&RequestLimits {
            max_length: self.config.max_length,
            vocab_size: self.vocab,
        })?;
        let constraint = match &req.constraint {
            Some(c) => Some(self.grammar.compile(c)?),
            None => None,
        };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let cached = Arc::new(AtomicUsize::new(0));
        self.stats.waiting.fetch_add(1, Ordering::Relaxed);
        if self
            .tx
            .send(Command::Submit(Box::new(Submission {
                id,
                req,
                constraint,
                sink,
                cached: Arc::clone(&cached),
            })))
            .is_err()
        {
            self.stats.waiting.fetch_sub(1, Ordering::Relaxed);
            return Err(RequestError::Stopped);
        }
        Ok(Ticket {
            id,
            cached,
            tx: (*self.tx).clone(),
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
