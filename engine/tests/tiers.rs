//! KV tiers below the pool (`--kv-connector-config`) on the real models:
//! prompts whose prefix blocks the pool evicted get them back from host
//! memory or disk, and every token and log-probability equals, bit for
//! bit, what the same requests give without tiers. Gemma 3's prompts pass
//! its 512-token sliding window, so its sliding and global layers must both
//! come back. Needs `TANDEM_TEST_GGUF`, `TANDEM_TEST_QWEN2_GGUF` and
//! `TANDEM_TEST_GEMMA3_GGUF`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_engine::backend::ServedModel;
use tandem_engine::block_manager::{BlockHash, KvEvent, KvEventKind, KvTier, block_hashes};
use tandem_engine::moe::Combine;
use tandem_engine::sampler::SamplingParams;
use tandem_engine::scheduler::{Scheduler, SchedulerConfig, SchedulerHandle};
use tandem_engine::{LoadedModel, load};
use tandem_kvtier::{DiskConfig, TierConfig};
use tandem_types::{GenEvent, GenerationRequest};

struct Case {
    env: &'static str,
    /// Prompt length in tokens (past Gemma 3's window).
    prompt_tokens: usize,
    /// Tensor-parallel ranks (CPU threads, each with a pool of its own).
    tp: usize,
}

const SMOLLM2: Case = Case {
    env: "TANDEM_TEST_GGUF",
    prompt_tokens: 300,
    tp: 1,
};
const QWEN2: Case = Case {
    env: "TANDEM_TEST_QWEN2_GGUF",
    prompt_tokens: 160,
    tp: 1,
};
const GEMMA3: Case = Case {
    env: "TANDEM_TEST_GEMMA3_GGUF",
    prompt_tokens: 600,
    tp: 1,
};

const BLOCK: usize = 16;
const MAX_TOKENS: usize = 6;

fn model(case: &Case) -> Arc<LoadedModel> {
    let path = std::env::var_os(case.env)
        .unwrap_or_else(|| panic!("set {} (scripts/test.sh does this)", case.env));
    Arc::new(load(&PathBuf::from(path)).expect("model loads"))
}

/// A pool that holds one prompt and its answer, not two: each prompt of
/// the workload evicts the one before.
fn config(case: &Case, kv_tiers: Option<TierConfig>) -> SchedulerConfig {
    let max_length = case.prompt_tokens + 2 * BLOCK;
    SchedulerConfig {
        max_batch_size: 4,
        max_batch_input_tokens: 128,
        max_length,
        block_size: BLOCK,
        num_blocks: max_length / BLOCK + 1,
        prefix_caching: true,
        tp: case.tp,
        moe_combine: Combine::AllReduce,
        kv_tiers,
    }
}

/// Two different prompts of `n` tokens.
fn prompts(m: &LoadedModel, n: usize) -> [Vec<u32>; 2] {
    let texts = [
        "The history of the printing press begins in the fifteenth century, when movable type spread across Europe. ",
        "Rivers carve valleys over millions of years, carrying sediment from the mountains down to the sea. ",
    ];
    texts.map(|t| {
        let mut p = m.text.tokenizer.encode(t, false).expect("tokenizes");
        while p.len() < n {
            let again = p.clone();
            p.extend(again);
        }
        p.truncate(n);
        p
    })
}

/// Tokens, their log-probabilities as bits, and the cached prompt tokens.
type Answer = (Vec<(u32, u32)>, usize);

fn ask(h: &SchedulerHandle, prompt: &[u32]) -> Answer {
    let mut sampling = SamplingParams::greedy();
    sampling.logprobs = true;
    let mut stream = h
        .generate(GenerationRequest {
            prompt: prompt.to_vec(),
            sampling,
            max_tokens: MAX_TOKENS,
            stop_token_ids: Vec::new(),
            constraint: None,
        })
        .expect("accepted");
    let mut tokens = Vec::new();
    loop {
        match stream.blocking_next() {
            Some(GenEvent::Token(s)) => {
                let lp = s.logprob.expect("logprob asked for");
                tokens.push((s.token, lp.to_bits()));
            }
            Some(GenEvent::Finished(u)) => return (tokens, u.cached_tokens),
            Some(GenEvent::Failed(e)) => panic!("request failed: {e}"),
            None => panic!("stream ended without Finished"),
        }
    }
}

/// A, B, A, B: with a pool of one prompt, the second A and B find their
/// prefix only in a tier.
fn workload(m: &Arc<LoadedModel>, case: &Case, tiers: Option<TierConfig>) -> Vec<Answer> {
    let sched = Scheduler::spawn(Arc::clone(m) as _, config(case, tiers)).expect("spawns");
    let [a, b] = prompts(m, case.prompt_tokens);
    let answers = [&a, &b, &a, &b]
        .iter()
        .map(|p| ask(sched.handle(), p))
        .collect();
    wait_idle(sched.handle());
    answers
}

fn wait_idle(h: &SchedulerHandle) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !h.stats().idle() {
        assert!(Instant::now() < deadline, "scheduler did not go idle");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn host_only(gb: f64) -> TierConfig {
    TierConfig {
        host_bytes: (gb * (1u64 << 30) as f64) as u64,
        disk: None,
    }
}

fn with_disk(host_bytes: u64, dir: &Path) -> TierConfig {
    TierConfig {
        host_bytes,
        disk: Some(DiskConfig {
            dir: dir.to_path_buf(),
            max_bytes: 1 << 30,
            direct_io: false,
        }),
    }
}

/// The second A and B: most of their prompt came from a tier.
fn assert_restored(answers: &[Answer], case: &Case, what: &str) {
    let full_blocks = (case.prompt_tokens - 1) / BLOCK * BLOCK;
    for (i, (_, cached)) in answers.iter().enumerate().skip(2) {
        assert_eq!(
            *cached, full_blocks,
            "{what}: request {i} restored {cached} tokens"
        );
    }
}

fn tiers_change_nothing(case: &Case) {
    let m = model(case);
    let plain = workload(&m, case, None);
    // Without tiers the pool has lost each prompt by the time it returns.
    assert!(plain.iter().all(|(_, cached)| *cached == 0), "{plain:?}");
    assert_eq!(plain[0].0, plain[2].0, "recomputing changed the answer");

    let host = workload(&m, case, Some(host_only(0.25)));
    assert_restored(&host, case, "host tier");
    for (i, ((t, _), (want, _))) in host.iter().zip(&plain).enumerate() {
        assert_eq!(t, want, "request {i} through the host tier");
    }

    // Host memory of two blocks: the prefix comes back from disk.
    let dir = tempfile::tempdir_in("/var/tmp").expect("temp dir");
    let block_bytes = m.kv_cache_config(BLOCK, 1).block_bytes() as u64;
    let disk = workload(&m, case, Some(with_disk(2 * block_bytes, dir.path())));
    assert_restored(&disk, case, "disk tier");
    for (i, ((t, _), (want, _))) in disk.iter().zip(&plain).enumerate() {
        assert_eq!(t, want, "request {i} through the disk tier");
    }
}

#[test]
fn smollm2_outputs_with_tiers_equal_outputs_without() {
    tiers_change_nothing(&SMOLLM2);
}

#[test]
fn qwen2_outputs_with_tiers_equal_outputs_without() {
    tiers_change_nothing(&QWEN2);
}

/// SmolLM2 over three ranks (one KV head each): a block is the three
/// ranks' shares, and all three come back.
#[test]
fn tensor_parallel_ranks_move_their_shares_together() {
    tiers_change_nothing(&Case { tp: 3, ..SMOLLM2 });
}

#[test]
fn gemma3_sliding_and_global_layers_come_back_together() {
    tiers_change_nothing(&GEMMA3);
}

type Events = Arc<std::sync::Mutex<Vec<KvEvent>>>;

/// The workload A, B on SmolLM2 with `tiers`, its prefix-cache events
/// collected; returns them with A's block hashes.
fn events_of(m: &Arc<LoadedModel>, tiers: TierConfig) -> (Vec<KvEvent>, Vec<BlockHash>) {
    let (events, a, _) = events_of_turns(m, tiers, &[0, 1]);
    (events, a)
}

/// SmolLM2 asked prompts A (0) and B (1) in `order` with `tiers`: the
/// prefix-cache events, A's block hashes and the answers.
fn events_of_turns(
    m: &Arc<LoadedModel>,
    tiers: TierConfig,
    order: &[usize],
) -> (Vec<KvEvent>, Vec<BlockHash>, Vec<Answer>) {
    let events: Events = Arc::default();
    let sink = Arc::clone(&events);
    let sched = Scheduler::spawn_with_kv_events(
        Arc::clone(m) as _,
        config(&SMOLLM2, Some(tiers)),
        Some(Box::new(move |e| sink.lock().expect("lock").extend(e))),
    )
    .expect("spawns");
    let ab = prompts(m, SMOLLM2.prompt_tokens);
    let answers = order.iter().map(|&i| ask(sched.handle(), &ab[i])).collect();
    wait_idle(sched.handle());
    drop(sched);
    let events = std::mem::take(&mut *events.lock().expect("lock"));
    (events, block_hashes(&ab[0], BLOCK), answers)
}

fn removed(events: &[KvEvent]) -> Vec<BlockHash> {
    events
        .iter()
        .flat_map(|e| match &e.kind {
            KvEventKind::Removed { hashes } => hashes.clone(),
            _ => Vec::new(),
        })
        .collect()
}

/// A router learns a block is gone only when no tier keeps it, and a
/// restarted node announces what its disk holds.
#[test]
fn events_say_removed_only_what_left_every_tier() {
    let m = model(&SMOLLM2);
    // Host memory for all of A: B evicts A from the pool, not from the node.
    let (events, a) = events_of(&m, host_only(0.25));
    let gone = removed(&events);
    assert!(a.iter().all(|h| !gone.contains(h)), "{gone:?}");
    // Host memory for two blocks and no disk: the rest of A is gone.
    let block_bytes = m.kv_cache_config(BLOCK, 1).block_bytes() as u64;
    let (events, a) = events_of(
        &m,
        TierConfig {
            host_bytes: 2 * block_bytes,
            disk: None,
        },
    );
    let gone = removed(&events);
    let a_gone = a.iter().filter(|h| gone.contains(h)).count();
    assert!(a_gone >= a.len() - 2, "{a_gone} of {} removed", a.len());

    // A disk tier: what it holds is announced again after a restart.
    let dir = tempfile::tempdir_in("/var/tmp").expect("temp dir");
    let tiers = with_disk(2 * block_bytes, dir.path());
    let (events, a) = events_of(&m, tiers.clone());
    assert!(a.iter().all(|h| !removed(&events).contains(h)));
    let (events, _) = events_of(&m, tiers);
    let (
        Some(KvEventKind::Stored {
            parent: None,
            hashes,
        }),
        Some(KvEventKind::Moved {
            hashes: on_disk,
            tier: KvTier::Disk,
        }),
    ) = (
        events.first().map(|e| &e.kind),
        events.get(1).map(|e| &e.kind),
    )
    else {
        panic!("the first events are not the disk's announcement: {events:?}");
    };
    assert_eq!(hashes, on_disk, "announced, then said to be on disk");
    assert!(
        a.iter().all(|h| hashes.contains(h)),
        "A's blocks are not all announced"
    );
}

/// What the events say of one block, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Stored,
    Moved(KvTier),
    Removed,
}

fn history(events: &[KvEvent], h: BlockHash) -> Vec<Step> {
    events
        .iter()
        .filter_map(|e| match &e.kind {
            KvEventKind::Stored { hashes, .. } if hashes.contains(&h) => Some(Step::Stored),
            KvEventKind::Moved { hashes, tier } if hashes.contains(&h) => Some(Step::Moved(*tier)),
            KvEventKind::Removed { hashes } if hashes.contains(&h) => Some(Step::Removed),
            _ => None,
        })
        .collect()
}

/// A block's events, as specified (`KvEventKind`): `Stored` when it enters
/// the pool (computed or brought back), then, while it is below the pool,
/// `Moved` to the tier that holds it at each publication (host memory,
/// then disk: never back up without a `Stored`), and `Removed` only when
/// no tier holds it. A, B, A with host memory for two blocks over a disk:
/// B pushes A out of the pool into host memory and on to disk, and the
/// second A brings it back. Event ids have no gaps (a router resubscribes
/// on one).
#[test]
fn events_follow_a_block_from_the_pool_to_host_to_disk_and_back() {
    let m = model(&SMOLLM2);
    let block_bytes = m.kv_cache_config(BLOCK, 1).block_bytes() as u64;
    let dir = tempfile::tempdir_in("/var/tmp").expect("temp dir");
    let (events, a, answers) =
        events_of_turns(&m, with_disk(2 * block_bytes, dir.path()), &[0, 1, 0]);
    assert_restored(&answers, &SMOLLM2, "A after B");
    assert!(
        events.windows(2).all(|w| w[1].id == w[0].id + 1),
        "event ids with a gap"
    );
    let full = [
        Step::Stored,
        Step::Moved(KvTier::Host),
        Step::Moved(KvTier::Disk),
        Step::Stored,
    ];
    let mut whole_way = 0;
    for (i, &h) in a.iter().enumerate() {
        let steps = history(&events, h);
        assert_eq!(steps.first(), Some(&Step::Stored), "block {i}: {steps:?}");
        assert_eq!(steps.last(), Some(&Step::Stored), "block {i}: {steps:?}");
        assert!(!steps.contains(&Step::Removed), "block {i}: {steps:?}");
        // Below the pool a block only goes down, one report per tier.
        for w in steps.windows(2) {
            if let [Step::Moved(from), Step::Moved(to)] = w {
                assert!(
                    (*from, *to) == (KvTier::Host, KvTier::Disk),
                    "block {i}: {steps:?}"
                );
            }
        }
        whole_way += usize::from(steps == full);
    }
    // B's prefill evicts A a chunk at a time: the last two blocks of a
    // chunk wait in host memory until the next chunk pushes them to disk.
    assert!(whole_way > 0, "no block of A went pool, host, disk, pool");
}
