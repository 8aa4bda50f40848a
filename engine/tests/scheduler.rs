//! The batch scheduler on the real SmolLM2 GGUF: batching, chunked prefill,
//! preemption and prefix caching never change greedy outputs; cancellation
//! and completion free every block. Needs `TANDEM_TEST_GGUF`.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tandem_engine::backend::{LogitsForm, RunnerConfig, ServedModel, StepLogits, StepRunner};
use tandem_engine::generate::{GenerateRequest, generate};
use tandem_engine::kv_cache::{KvCache, KvCacheConfig, KvPool};
use tandem_engine::model::SeqChunk;
use tandem_engine::moe::Combine;
use tandem_engine::sampler::{SamplingParams, top_candidates};
use tandem_engine::scheduler::{
    ExportEvent, FAILING_AFTER, GenerateStream, ImportOutcome, ImportStream, Scheduler,
    SchedulerConfig, SchedulerHandle, Usage,
};
use tandem_engine::{LoadedModel, RequestError, load};
use tandem_types::{FinishReason, GenEvent, GenFailure, GenerationRequest, InvalidRequest};

fn model() -> Arc<LoadedModel> {
    static M: std::sync::OnceLock<Arc<LoadedModel>> = std::sync::OnceLock::new();
    Arc::clone(M.get_or_init(|| {
        let path = std::env::var_os("TANDEM_TEST_GGUF").expect(
            "set TANDEM_TEST_GGUF to the SmolLM2-135M-Instruct Q4_1 GGUF (scripts/test.sh does this)",
        );
        Arc::new(load(&PathBuf::from(path)).expect("model loads"))
    }))
}

fn config() -> SchedulerConfig {
    SchedulerConfig {
        max_batch_size: 16,
        max_batch_input_tokens: 256,
        max_length: 256,
        block_size: 16,
        num_blocks: 256,
        prefix_caching: true,
        tp: 1,
        moe_combine: Combine::AllReduce,
        kv_tiers: None,
    }
}

fn prompts() -> Vec<Vec<u32>> {
    let m = model();
    [
        "The capital of France is",
        "List of prime numbers: 2, 3, 5, 7,",
        "Once upon a time, in a small village at the edge of a great forest, there lived",
        "def fibonacci(n):",
        "Water boils at 100 degrees Celsius at sea level. At higher altitudes,",
        "The theory of relativity, developed by Albert Einstein, states that",
    ]
    .iter()
    .map(|t| m.text.tokenizer.encode(t, false).expect("tokenizes"))
    .collect()
}

fn request(prompt: &[u32], max_tokens: usize) -> GenerationRequest {
    GenerationRequest {
        prompt: prompt.to_vec(),
        sampling: SamplingParams::greedy(),
        max_tokens,
        stop_token_ids: model().text.tokenizer.stop_ids(),
        constraint: None,
    }
}

/// Tokens `generate` produces for the prompt alone: the reference.
fn alone(prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    let m = model();
    let req = GenerateRequest {
        prompt: prompt.to_vec(),
        sampling: SamplingParams::greedy(),
        max_tokens,
        stop_token_ids: m.text.tokenizer.stop_ids(),
        stop_strings: Vec::new(),
        prefill_chunk: 512,
    };
    generate(&m, &req, |_| {}).expect("generates").tokens
}

fn collect(mut stream: GenerateStream) -> (Vec<u32>, Usage) {
    let mut tokens = Vec::new();
    loop {
        match stream.blocking_next() {
            Some(GenEvent::Token(s)) => tokens.push(s.token),
            Some(GenEvent::Finished(u)) => return (tokens, u),
            Some(GenEvent::Failed(e)) => panic!("request failed: {e}"),
            None => panic!("stream ended without Finished"),
        }
    }
}

fn run_all(h: &SchedulerHandle, prompts: &[Vec<u32>], max_tokens: usize) -> Vec<(Vec<u32>, Usage)> {
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| h.generate(request(p, max_tokens)).expect("accepted"))
        .collect();
    streams.into_iter().map(collect).collect()
}

fn wait_idle(h: &SchedulerHandle) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !h.stats().idle() {
        assert!(Instant::now() < deadline, "scheduler did not go idle");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn concurrent_requests_match_single_sequence_generation() {
    let sched = Scheduler::spawn(model(), config()).expect("spawns");
    let prompts = prompts();
    let results = run_all(sched.handle(), &prompts, 24);
    for (p, (tokens, usage)) in prompts.iter().zip(&results) {
        assert_eq!(tokens, &alone(p, 24), "batched output differs");
        assert_eq!(usage.prompt_tokens, p.len());
        assert_eq!(usage.completion_tokens, tokens.len());
        assert!(usage.finish == FinishReason::Length || tokens.len() < 24);
    }
    wait_idle(sched.handle());
}

#[test]
fn chunked_prefill_and_preemption_do_not_change_outputs() {
    // 8-token steps force chunked prefill; 20 blocks of 8 tokens for six
    // sequences of up to ~50 tokens force preemption.
    let cfg = SchedulerConfig {
        max_batch_input_tokens: 8,
        max_batch_size: 8,
        block_size: 8,
        num_blocks: 20,
        max_length: 128,
        prefix_caching: false,
        tp: 1,
        moe_combine: Combine::AllReduce,
        kv_tiers: None,
    };
    let sched = Scheduler::spawn(model(), cfg).expect("spawns");
    let prompts = prompts();
    let results = run_all(sched.handle(), &prompts, 32);
    for (p, (tokens, _)) in prompts.iter().zip(&results) {
        assert_eq!(
            tokens,
            &alone(p, 32),
            "output changed under chunking/preemption"
        );
    }
    assert!(
        sched.handle().stats().preemptions.load(Ordering::Relaxed) > 0,
        "the pool was meant to be too small to avoid preemption"
    );
    wait_idle(sched.handle());
    assert_eq!(
        sched
            .handle()
            .stats()
            .kv_blocks_in_use
            .load(Ordering::Relaxed),
        0
    );
}

#[test]
fn repeated_prompt_hits_the_prefix_cache() {
    let (tx, rx) = std::sync::mpsc::channel();
    let sink: tandem_engine::scheduler::KvEventSink = Box::new(move |events| {
        let _ = tx.send(events);
    });
    let sched = Scheduler::spawn_with_kv_events(model(), config(), Some(sink)).expect("spawns");
    let h = sched.handle();
    let m = model();
    let long = m
        .text
        .tokenizer
        .encode(
            &"A long shared system prompt about many things. ".repeat(8),
            false,
        )
        .expect("tokenizes");
    let (first, u1) = collect(h.generate(request(&long, 8)).expect("accepted"));
    let (second, u2) = collect(h.generate(request(&long, 8)).expect("accepted"));
    assert_eq!(u1.cached_tokens, 0);
    assert_eq!(
        u2.cached_tokens,
        (long.len() - 1) / 16 * 16,
        "full blocks reused"
    );
    assert!(u2.cached_tokens > 0);
    assert_eq!(first, second, "cached prefix changes nothing");
    assert_eq!(first, alone(&long, 8));
    let events: Vec<_> = rx.try_iter().flatten().collect();
    assert!(!events.is_empty(), "stored events for the cached blocks");
    assert_eq!(events[0].id, 1, "ids start at 1 (0 means none seen)");
    assert!(events.windows(2).all(|w| w[1].id == w[0].id + 1));
    wait_idle(h);
}

/// How soon after its stream is dropped a request must be gone and its
/// blocks free: a few steps, far below what the request needs to finish.
const CANCEL_BOUND: Duration = Duration::from_secs(1);

#[test]
fn dropping_a_stream_cancels_and_frees_blocks() {
    // A long context and no stop tokens: the request can only end at its
    // max_tokens, thousands of steps away, so only cancellation ends it
    // within CANCEL_BOUND.
    let cfg = SchedulerConfig {
        max_length: 8192,
        num_blocks: 600,
        ..config()
    };
    let sched = Scheduler::spawn(model(), cfg.clone()).expect("spawns");
    let h = sched.handle();
    let p = prompts();
    let max_tokens = cfg.max_length - p[2].len();
    let endless = GenerationRequest {
        stop_token_ids: Vec::new(),
        ..request(&p[2], max_tokens)
    };
    let mut stream = h.generate(endless).expect("accepted");
    let mut next_token = || match stream.blocking_next() {
        Some(GenEvent::Token(_)) => {}
        other => panic!("expected a token, got {other:?}"),
    };
    next_token();
    // The decode rate, to show the request could not finish by itself
    // inside the bound (later steps only get slower as the context grows).
    let timed = 8;
    let t = Instant::now();
    (0..timed).for_each(|_| next_token());
    let per_token = t.elapsed() / timed as u32;
    let would_take = per_token * (max_tokens - 1 - timed) as u32;
    assert!(
        would_take >= 10 * CANCEL_BOUND,
        "finishing would take only {would_take:?}: the test could not tell cancellation \
         from completion"
    );
    let s = h.stats();
    assert_eq!(s.running.load(Ordering::Relaxed), 1);
    let held = s.kv_blocks_in_use.load(Ordering::Relaxed);
    assert!(held > 0);

    // Another request keeps running while the first is cancelled.
    let other = h.generate(request(&p[0], 6)).expect("accepted");
    let dropped = Instant::now();
    drop(stream);
    let (tokens, _) = collect(other);
    assert_eq!(tokens, alone(&p[0], 6));
    while !s.idle() {
        assert!(
            dropped.elapsed() <= CANCEL_BOUND,
            "{:?} after the drop the request still runs ({} running, {} waiting) and holds \
             {} blocks (it held {held}); finishing by itself would take {would_take:?}",
            dropped.elapsed(),
            s.running.load(Ordering::Relaxed),
            s.waiting.load(Ordering::Relaxed),
            s.kv_blocks_in_use.load(Ordering::Relaxed),
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    println!(
        "cancelled {:?} after the drop; finishing would take {would_take:?}",
        dropped.elapsed()
    );
}

#[test]
fn invalid_requests_are_rejected_at_submit() {
    let sched = Scheduler::spawn(model(), config()).expect("spawns");
    let h = sched.handle();
    let reject = |r: GenerationRequest| h.generate(r).expect_err("rejected");
    assert!(matches!(
        reject(request(&[], 4)),
        RequestError::Invalid(InvalidRequest::EmptyPrompt)
    ));
    assert!(matches!(
        reject(request(&[49152], 4)),
        RequestError::Invalid(InvalidRequest::TokenOutOfRange { .. })
    ));
    assert!(matches!(
        reject(request(&[1; 256], 4)),
        RequestError::Invalid(InvalidRequest::PromptTooLong {
            prompt: 256,
            max: 256
        })
    ));
    assert!(matches!(
        reject(request(&[1], 0)),
        RequestError::Invalid(InvalidRequest::ZeroMaxTokens)
    ));
    let mut bad = request(&[1], 4);
    bad.sampling.temperature = -1.0;
    assert!(matches!(
        reject(bad),
        RequestError::Invalid(InvalidRequest::Sampling(_))
    ));
    // And the scheduler still serves.
    let (tokens, _) = collect(h.generate(request(&prompts()[0], 3)).expect("accepted"));
    assert_eq!(tokens.len(), 3);
}

#[test]
fn bad_configs_fail_loudly() {
    let m = model();
    for bad in [
        SchedulerConfig {
            max_batch_size: 0,
            ..config()
        },
        SchedulerConfig {
            max_batch_input_tokens: 4,
            ..config()
        },
        SchedulerConfig {
            max_length: 100_000,
            ..config()
        },
        SchedulerConfig {
            block_size: 0,
            ..config()
        },
        SchedulerConfig {
            num_blocks: 2,
            ..config()
        },
    ] {
        assert!(Scheduler::spawn(m.clone(), bad).is_err());
    }
}

/// Copies whole blocks between two pools of the same shape: what the
/// transfer engine does between a prefill and a decode node.
fn copy_blocks(from: &SchedulerHandle, src: &[u32], to: &SchedulerHandle, dst: &[u32]) {
    let (sp, kc) = from.kv_pool();
    let (dp, _) = to.kv_pool();
    let bb = kc.block_bytes();
    assert_eq!(src.len(), dst.len());
    for (&s, &d) in src.iter().zip(dst) {
        assert!((s as usize + 1) * bb <= sp.byte_len() && (d as usize + 1) * bb <= dp.byte_len());
        // SAFETY: in bounds (checked); the destination blocks belong to an
        // importing sequence nobody reads, the source blocks are held.
        unsafe {
            std::ptr::copy_nonoverlapping(
                sp.as_mut_ptr().add(s as usize * bb),
                dp.as_mut_ptr().add(d as usize * bb),
                bb,
            );
        }
    }
}

fn expect_import_slot(stream: &mut ImportStream) -> tandem_engine::scheduler::ImportSlot {
    match stream.blocking_slot() {
        Some(Ok(slot)) => slot,
        other => panic!("expected ImportReady, got {other:?}"),
    }
}

/// Prefill on `prefill`, move the blocks the decode side lacks, decode on
/// `decode`. Returns the decode side's tokens and usage, and how many
/// blocks moved.
fn disaggregated(
    prefill: &SchedulerHandle,
    decode: &SchedulerHandle,
    prompt: &[u32],
    max_tokens: usize,
) -> (Vec<u32>, Usage, usize) {
    let mut d = decode
        .import(request(prompt, max_tokens))
        .expect("accepted");
    let slot = expect_import_slot(&mut d);
    assert_eq!(
        slot.blocks.len(),
        prompt.len().div_ceil(config().block_size)
    );
    let mut p = prefill
        .export(prompt.to_vec(), SamplingParams::greedy(), None)
        .expect("accepted");
    // Layers of blocks filled by the computation arrive first, then the
    // first token with the held blocks.
    let mut layers_of_block = std::collections::HashMap::<usize, usize>::new();
    let exported = loop {
        match p.blocking_next() {
            Some(ExportEvent::LayerDone(l)) => {
                for i in l.first_block..l.first_block + l.blocks.len() {
                    *layers_of_block.entry(i).or_default() += 1;
                }
            }
            Some(ExportEvent::Exported(e)) => break e,
            other => panic!("expected Exported, got {other:?}"),
        }
    };
    // Every block the prefill computed (full, not from its own cache) was
    // reported once per layer.
    let n_layers = model().model.config().n_layers;
    let computed_from = exported.cached_tokens / config().block_size;
    for i in computed_from..prompt.len() / config().block_size {
        assert_eq!(layers_of_block.get(&i), Some(&n_layers), "block {i}");
    }
    assert!(
        layers_of_block
            .keys()
            .all(|&i| i < prompt.len() / config().block_size)
    );
    assert_eq!(exported.blocks.len(), slot.blocks.len());
    let skip = slot.cached_blocks;
    copy_blocks(
        prefill,
        &exported.blocks[skip..],
        decode,
        &slot.blocks[skip..],
    );
    drop(p);
    let d = d.complete(ImportOutcome::Ready {
        first: exported.first,
        remote_cached_tokens: exported.cached_tokens,
    });
    let (tokens, usage) = collect(d);
    (tokens, usage, slot.blocks.len() - skip)
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn assert_idle_handoffs(h: &SchedulerHandle) {
    wait_idle(h);
    let s = h.stats();
    assert_eq!(s.importing.load(Ordering::Relaxed), 0);
    assert_eq!(s.exported.load(Ordering::Relaxed), 0);
}

#[test]
fn disaggregated_handoff_matches_local_generation() {
    let prefill = Scheduler::spawn(model(), config()).expect("starts");
    let decode = Scheduler::spawn(model(), config()).expect("starts");
    let (p, d) = (prefill.handle(), decode.handle());
    let mut cases: Vec<Vec<u32>> = prompts().into_iter().take(3).collect();
    cases.push(prompts().concat()); // several full blocks
    for prompt in &cases {
        let want = alone(prompt, 12);
        let (got, usage, moved) = disaggregated(p, d, prompt, 12);
        assert_eq!(got, want, "prompt of {} tokens", prompt.len());
        assert_eq!(usage.prompt_tokens, prompt.len());
        assert_eq!(usage.completion_tokens, want.len());
        assert_eq!(moved, prompt.len().div_ceil(config().block_size));
        // Again: the decode side now has the prompt's full blocks cached
        // (from the first import) and only the rest moves.
        let (again, usage, moved) = disaggregated(p, d, prompt, 12);
        assert_eq!(again, want);
        let full = (prompt.len() - 1) / config().block_size;
        assert_eq!(moved, prompt.len().div_ceil(config().block_size) - full);
        assert!(
            usage.cached_tokens >= full * config().block_size,
            "{usage:?}"
        );
    }
    assert_idle_handoffs(p);
    assert_idle_handoffs(d);
}

/// The blocks a hold pinned, waiting for the actor's answer.
fn held(h: &SchedulerHandle, prompt: &[u32]) -> (tandem_engine::scheduler::HoldStream, Vec<u32>) {
    let mut hold = h.hold_prefix(prompt.to_vec()).expect("accepted");
    match hold.blocking_blocks() {
        Some(Ok(b)) => (hold, b),
        other => panic!("expected held blocks, got {other:?}"),
    }
}

#[test]
fn a_held_prefix_fetched_by_a_peer_is_not_recomputed() {
    let holder = Scheduler::spawn(model(), config()).expect("starts");
    let fetcher = Scheduler::spawn(model(), config()).expect("starts");
    let (a, b) = (holder.handle(), fetcher.handle());
    let bs = config().block_size;
    let prompt = prompts().concat();
    let full = (prompt.len() - 1) / bs;
    assert!(full >= 3, "the test needs several full blocks");
    let want = alone(&prompt, 12);

    // Nothing cached yet: a hold is empty, and not an error.
    let (hold, blocks) = held(a, &prompt[..full * bs]);
    assert!(blocks.is_empty());
    drop(hold);
    assert_eq!(
        collect(a.generate(request(&prompt, 12)).expect("accepted")).0,
        want
    );

    // The holder has the prompt's full blocks; asked for more than it
    // holds (a last block of other tokens), it pins the run it has.
    let mut asked = prompt[..full * bs].to_vec();
    asked.extend(std::iter::repeat_n(7, bs));
    let (hold, blocks) = held(a, &asked);
    assert_eq!(blocks.len(), full);
    wait_for("the hold to be counted", || {
        a.stats().exported.load(Ordering::Relaxed) == 1
    });

    // The fetcher imports the prompt, gets the held blocks written into
    // its first ones, and computes only the rest.
    let mut d = b.import(request(&prompt, 12)).expect("accepted");
    let slot = expect_import_slot(&mut d);
    assert_eq!(slot.cached_blocks, 0);
    copy_blocks(a, &blocks, b, &slot.blocks[..full]);
    drop(hold);
    // More than fit before the last token is capped, not trusted.
    let d = d.complete(ImportOutcome::PrefillLocally {
        fetched_blocks: full + 5,
    });
    let (got, usage) = collect(d);
    assert_eq!(got, want, "tokens after a fetched prefix");
    assert_eq!(usage.cached_tokens, full * bs, "{usage:?}");
    // Fetched blocks count as prefix-cache hits, as tier hits do: only
    // the tokens computed here are misses.
    assert_eq!(
        b.stats().prefix_hit_tokens.load(Ordering::Relaxed),
        (full * bs) as u64
    );
    assert_eq!(
        b.stats().prefix_miss_tokens.load(Ordering::Relaxed),
        (prompt.len() - full * bs) as u64
    );
    // They are its own cache now.
    let (again, usage) = collect(b.generate(request(&prompt, 12)).expect("accepted"));
    assert_eq!(again, want);
    assert_eq!(usage.cached_tokens, full * bs);
    assert_idle_handoffs(a);
    assert_idle_handoffs(b);
}

#[test]
fn a_hold_is_answered_while_the_batch_is_full() {
    let sched = Scheduler::spawn(
        model(),
        SchedulerConfig {
            max_batch_size: 1,
            ..config()
        },
    )
    .expect("starts");
    let h = sched.handle();
    let bs = config().block_size;
    let prompt = prompts().concat();
    let full = (prompt.len() - 1) / bs;
    collect(h.generate(request(&prompt, 1)).expect("accepted"));
    // The one batch slot busy for a couple of hundred steps.
    let busy = h
        .generate(GenerationRequest {
            stop_token_ids: Vec::new(),
            ..request(&prompts()[1], 200)
        })
        .expect("accepted");
    wait_for("the long request to run", || {
        h.stats().running.load(Ordering::Relaxed) == 1
    });
    // A peer's fetch does not wait for it: the hold takes no batch slot.
    let (hold, blocks) = held(h, &prompt[..full * bs]);
    assert_eq!(blocks.len(), full);
    assert_eq!(
        h.stats().running.load(Ordering::Relaxed),
        1,
        "the hold waited for the batch to empty"
    );
    drop(hold);
    assert_eq!(collect(busy).0.len(), 200);
    assert_idle_handoffs(h);
}

#[test]
fn failed_import_falls_back_to_local_prefill_and_cancels_free_blocks() {
    let sched = Scheduler::spawn(model(), config()).expect("starts");
    let h = sched.handle();
    let prompt = &prompts()[1];
    let want = alone(prompt, 10);

    let mut d = h.import(request(prompt, 10)).expect("accepted");
    let _ = expect_import_slot(&mut d);
    // Stats are published after the step that emitted the event.
    wait_for("the import to be counted", || {
        h.stats().importing.load(Ordering::Relaxed) == 1
    });
    assert_eq!(
        collect(d.complete(ImportOutcome::PrefillLocally { fetched_blocks: 0 })).0,
        want
    );
    assert_idle_handoffs(h);

    // Cancelled while waiting for its KV: blocks return at once.
    let mut d = h.import(request(prompt, 10)).expect("accepted");
    let _ = expect_import_slot(&mut d);
    wait_for("the reserved blocks to be counted", || {
        h.stats().kv_blocks_in_use.load(Ordering::Relaxed) > 0
    });
    drop(d);
    assert_idle_handoffs(h);

    // An exported prompt holds its blocks until its stream is dropped.
    let mut p = h
        .export(prompt.to_vec(), SamplingParams::greedy(), None)
        .expect("accepted");
    assert!(matches!(p.blocking_next(), Some(ExportEvent::Exported(_))));
    wait_for("the held blocks to be counted", || {
        h.stats().exported.load(Ordering::Relaxed) == 1
            && h.stats().kv_blocks_in_use.load(Ordering::Relaxed) > 0
    });
    // And they stay held while the stream lives.
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(h.stats().exported.load(Ordering::Relaxed), 1);
    drop(p);
    assert_idle_handoffs(h);
}

/// The real model served through a runner that wraps the model's own:
/// how the tests below stand in for a device runner's behaviours.
struct Wrapped {
    model: Arc<LoadedModel>,
    wrap: Box<Wrap>,
}

type Wrap = dyn Fn(Box<dyn StepRunner>) -> Box<dyn StepRunner> + Send + Sync;

impl std::fmt::Debug for Wrapped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Wrapped").finish_non_exhaustive()
    }
}

impl ServedModel for Wrapped {
    fn config(&self) -> &tandem_modelfile::config::ModelConfig {
        self.model.config()
    }
    fn text(&self) -> &Arc<tandem_modelfile::ModelText> {
        self.model.text()
    }
    fn weights_hash(&self) -> u64 {
        self.model.weights_hash()
    }
    fn runner(
        self: Arc<Self>,
        config: RunnerConfig,
    ) -> Result<Box<dyn StepRunner>, tandem_engine::error::RunnerError> {
        Ok((self.wrap)(Arc::clone(&self.model).runner(config)?))
    }
}

fn wrapped(
    wrap: impl Fn(Box<dyn StepRunner>) -> Box<dyn StepRunner> + Send + Sync + 'static,
) -> Arc<Wrapped> {
    Arc::new(Wrapped {
        model: model(),
        wrap: Box::new(wrap),
    })
}

/// The model's runner, its steps failing while `fail` is set: a device
/// (or kernel) failure as the scheduler sees it.
struct FailingRunner {
    inner: Box<dyn StepRunner>,
    fail: Arc<std::sync::atomic::AtomicBool>,
}

impl StepRunner for FailingRunner {
    fn kv_cache_config(&self) -> KvCacheConfig {
        self.inner.kv_cache_config()
    }
    fn peer_pools(&self) -> Vec<Arc<KvPool>> {
        self.inner.peer_pools()
    }
    fn forward(
        &self,
        chunks: &[SeqChunk<'_>],
        cache: &mut KvCache,
        layer_done: &mut dyn FnMut(usize),
        want: LogitsForm,
        logits: &mut StepLogits,
    ) -> Result<(), RequestError> {
        if self.fail.load(Ordering::Relaxed) {
            return Err(RequestError::Device("injected failure".into()));
        }
        self.inner.forward(chunks, cache, layer_done, want, logits)
    }
}

#[test]
fn a_failing_step_fails_its_requests_and_the_scheduler_goes_on() {
    let fail = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let failing = Arc::clone(&fail);
    let served = wrapped(move |inner| {
        Box::new(FailingRunner {
            inner,
            fail: Arc::clone(&failing),
        })
    });
    let sched = Scheduler::spawn(served, config()).expect("spawns");
    let h = sched.handle();
    let p = prompts();
    // Each request of a failing step ends with an internal failure (a 500
    // at the edge), and its blocks go back; after FAILING_AFTER failed
    // steps in a row the scheduler says it is failing (health checks).
    for (i, q) in p.iter().take(FAILING_AFTER).enumerate() {
        assert!(!h.stats().failing(), "failing after {i} failed steps");
        let mut s = h.generate(request(q, 4)).expect("accepted");
        match s.blocking_next() {
            Some(GenEvent::Failed(GenFailure::Internal(msg))) => {
                assert!(msg.contains("injected failure"), "{msg}");
            }
            other => panic!("expected a failure, got {other:?}"),
        }
        assert!(s.blocking_next().is_none(), "events after the failure");
        wait_idle(h);
    }
    assert!(h.stats().failing());
    // The device is back: the next request runs as it would have, and one
    // good step clears the failing state.
    fail.store(false, Ordering::Relaxed);
    let (tokens, _) = collect(h.generate(request(&p[3], 6)).expect("accepted"));
    assert_eq!(tokens, alone(&p[3], 6));
    assert!(!h.stats().failing());
    wait_idle(h);
}

/// The model's runner, reducing rows to their top candidates on the host
/// when a step asks for them, as a GPU runner does on its device; it
/// records each step's asked form, and with `misshapen` set drops a
/// value, as a broken runner would.
struct ReducingRunner {
    inner: Box<dyn StepRunner>,
    asked: Arc<std::sync::Mutex<Vec<LogitsForm>>>,
    misshapen: bool,
    vocab: usize,
}

/// Most candidates a [`ReducingRunner`] returns.
const REDUCING_MAX: usize = 32;

fn reducing(asked: &Arc<std::sync::Mutex<Vec<LogitsForm>>>, misshapen: bool) -> Arc<Wrapped> {
    let asked = Arc::clone(asked);
    let vocab = model().config().vocab_size;
    wrapped(move |inner| {
        Box::new(ReducingRunner {
            inner,
            asked: Arc::clone(&asked),
            misshapen,
            vocab,
        })
    })
}

impl StepRunner for ReducingRunner {
    fn kv_cache_config(&self) -> KvCacheConfig {
        self.inner.kv_cache_config()
    }
    fn peer_pools(&self) -> Vec<Arc<KvPool>> {
        self.inner.peer_pools()
    }
    fn max_top_logits(&self) -> usize {
        REDUCING_MAX
    }
    fn forward(
        &self,
        chunks: &[SeqChunk<'_>],
        cache: &mut KvCache,
        layer_done: &mut dyn FnMut(usize),
        want: LogitsForm,
        logits: &mut StepLogits,
    ) -> Result<(), RequestError> {
        self.asked.lock().expect("lock").push(want);
        self.inner
            .forward(chunks, cache, layer_done, LogitsForm::Full, logits)?;
        if let LogitsForm::Top(k) = want {
            // Rounded up, as a device keeps few kernel variants.
            let k = k.next_power_of_two();
            let full = std::mem::take(&mut logits.values);
            let (mut ids, mut values, mut log_z) = (Vec::new(), Vec::new(), Vec::new());
            for row in full.chunks_exact(self.vocab) {
                let (i, v, z) = top_candidates(row, k);
                ids.extend(i);
                values.extend(v);
                log_z.push(z);
            }
            *logits = StepLogits {
                form: LogitsForm::Top(k),
                values,
                ids,
                log_z,
            };
        }
        if self.misshapen {
            logits.values.pop();
        }
        Ok(())
    }
}

fn collect_sampled(mut stream: GenerateStream) -> Vec<tandem_types::sampling::Sampled> {
    let mut out = Vec::new();
    loop {
        match stream.blocking_next() {
            Some(GenEvent::Token(s)) => out.push(s),
            Some(GenEvent::Finished(_)) => return out,
            other => panic!("unexpected {other:?}"),
        }
    }
}

#[test]
fn steps_on_top_candidates_sample_what_full_rows_sample() {
    let asked = Arc::new(std::sync::Mutex::new(Vec::new()));
    let reducing = Scheduler::spawn(reducing(&asked, false), config()).expect("spawns");
    let plain = Scheduler::spawn(model(), config()).expect("spawns");
    let p = prompts();
    let greedy = SamplingParams {
        logprobs: true,
        top_logprobs: 3,
        ..SamplingParams::greedy()
    };
    let drawn = SamplingParams {
        temperature: 0.9,
        top_k: 20,
        top_p: 0.95,
        seed: Some(7),
        logprobs: true,
        ..SamplingParams::default()
    };
    let penalised = SamplingParams {
        frequency_penalty: 0.5,
        ..drawn.clone()
    };
    let run = |h: &SchedulerHandle, params: &[SamplingParams]| {
        let streams: Vec<_> = params
            .iter()
            .zip(&p)
            .map(|(s, q)| {
                let r = GenerationRequest {
                    sampling: s.clone(),
                    ..request(q, 8)
                };
                h.generate(r).expect("accepted")
            })
            .collect();
        streams.into_iter().map(collect_sampled).collect::<Vec<_>>()
    };
    for (what, params) in [
        (
            "greedy and top-k draws",
            vec![greedy.clone(), drawn.clone()],
        ),
        ("with a penalised draw", vec![greedy, drawn, penalised]),
    ] {
        asked.lock().expect("lock").clear();
        let got = run(reducing.handle(), &params);
        let want = run(plain.handle(), &params);
        for (g, w) in got.iter().zip(&want) {
            let tokens = |s: &[tandem_types::sampling::Sampled]| {
                s.iter().map(|s| s.token).collect::<Vec<_>>()
            };
            assert_eq!(tokens(g), tokens(w), "{what}");
            for (g, w) in g.iter().zip(w) {
                let (g, w) = (g.logprob.expect("asked"), w.logprob.expect("asked"));
                assert!((g - w).abs() < 1e-4, "{what}: logprob {g} vs {w}");
            }
        }
        let asked = asked.lock().expect("lock").clone();
        if params.len() == 2 {
            // Every step samples from top rows: 3 (the greedy request's
            // top_logprobs) while it runs alone, 20 (the draw's top_k)
            // once the draw is in.
            assert!(asked.contains(&LogitsForm::Top(20)), "{asked:?}");
            assert!(
                asked.iter().all(|f| matches!(f, LogitsForm::Top(3 | 20))),
                "{asked:?}"
            );
        } else {
            // The penalty needs whole rows while its request samples.
            assert!(asked.contains(&LogitsForm::Full), "{asked:?}");
        }
    }
    wait_idle(reducing.handle());
}

#[test]
fn a_runner_returning_misshapen_logits_fails_its_step_only() {
    let sched = Scheduler::spawn(reducing(&Arc::default(), true), config()).expect("spawns");
    let h = sched.handle();
    let p = prompts();
    let mut s = h.generate(request(&p[0], 4)).expect("accepted");
    match s.blocking_next() {
        Some(GenEvent::Failed(GenFailure::Internal(msg))) => {
            assert!(msg.contains("logits"), "{msg}");
        }
        other => panic!("expected a failure, got {other:?}"),
    }
    assert!(s.blocking_next().is_none(), "events after the failure");
    wait_idle(h);
}
