//! The cluster's routing, prefix index and dispatch, over fake workers.

use super::prefix_index::Tier;
use super::prefix_source::prefix_source;
use super::*;
use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures_util::Stream;
use tandem_frontend::{BackendRequest, SubmitError};
use tandem_proto::pb;
use tandem_proto::trace::TraceContext;
use tandem_types::{
    BlockHash, GenEvent as Event, GenFailure, GenerationRequest, SamplingParams, block_hashes,
};
use tonic::Code;
use tonic::transport::Endpoint;
use tonic::{Request, Response, Status};

const BLOCK: usize = 4;

fn fingerprint() -> ModelFingerprint {
    ModelFingerprint {
        model_id: "m".into(),
        weights_hash: 1,
        kv_dtype: "f16".into(),
        block_size: BLOCK,
        kv_layout: "l".into(),
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: 1,
    }
}

fn routing() -> RoutingConfig {
    RoutingConfig {
        policy: PolicyKind::Cost,
        prefill_weight: 1.0,
        host_hit_weight: 0.1,
        disk_hit_weight: 0.3,
        queue_weight: 4.0,
        prefill_candidates: 2,
        decode_attempts: 2,
    }
}

/// What the router would know of a worker: the prompt blocks its pool
/// holds (by hash), those its tiers hold, and its load.
struct Spec<'a> {
    id: &'a str,
    role: Role,
    endpoint: String,
    cached: Vec<BlockHash>,
    below: Vec<(BlockHash, Tier)>,
    kv_blocks_used: usize,
    waiting: usize,
    pending: usize,
    on_probation: bool,
}

fn spec(id: &str, role: Role) -> Spec<'_> {
    Spec {
        id,
        role,
        // Nothing listens there: only tests that call workers set it.
        endpoint: "http://127.0.0.1:1".into(),
        cached: Vec::new(),
        below: Vec::new(),
        kv_blocks_used: 0,
        waiting: 0,
        pending: 0,
        on_probation: false,
    }
}

fn worker(s: &Spec<'_>) -> Worker {
    let standing = Standing::new(s.role, Arc::default());
    if !s.on_probation {
        standing.promote(s.id);
    }
    Worker {
        record: WorkerRecord {
            id: s.id.into(),
            role: s.role.as_str().into(),
            grpc_endpoint: s.endpoint.clone(),
            metrics_endpoint: String::new(),
            fingerprint: fingerprint(),
            kv_blocks_total: 100,
            max_batch_size: 1,
            tp: 1,
            dp: 1,
        },
        role: s.role,
        channel: Endpoint::from_shared(s.endpoint.clone())
            .expect("endpoint")
            .connect_lazy(),
        cached: Mutex::new(
            s.cached
                .iter()
                .map(|&h| (h, Tier::Pool))
                .chain(s.below.iter().copied())
                .collect(),
        ),
        last_event: AtomicU64::new(0),
        waiting: AtomicUsize::new(s.waiting),
        kv_blocks_used: AtomicUsize::new(s.kv_blocks_used),
        pending: AtomicUsize::new(s.pending),
        standing,
        events_task: Mutex::new(None),
    }
}

fn cluster(specs: &[Spec<'_>], routing: RoutingConfig) -> Cluster {
    let workers = specs
        .iter()
        .map(|s| ((s.role, s.id.to_string()), Arc::new(worker(s))))
        .collect();
    Cluster {
        fingerprint: fingerprint(),
        policy: routing.build_policy(),
        routing,
        peers: PeerConnector::default(),
        workers: RwLock::new(workers),
        census: Arc::default(),
    }
}

/// A 10-block prompt and its block hashes.
fn prompt() -> (Vec<u32>, Vec<BlockHash>) {
    let prompt: Vec<u32> = (0..10 * BLOCK as u32).map(|t| t * 7 + 3).collect();
    let hashes = block_hashes(&prompt, BLOCK);
    (prompt, hashes)
}

/// `rank`'s answer as (worker id, overlap).
fn ranked(c: &Cluster, role: Role, hashes: &[BlockHash]) -> Vec<(String, usize)> {
    c.rank(role, hashes, hashes.len())
        .iter()
        .map(|(w, c)| (w.record.id.clone(), c.overlap.blocks))
        .collect()
}

/// `hashes` held in `tier`.
fn held(hashes: &[BlockHash], tier: Tier) -> Vec<(BlockHash, Tier)> {
    hashes.iter().map(|&h| (h, tier)).collect()
}

fn moved(id: u64, hashes: Vec<u64>, tier: i32) -> pb::WorkerEvent {
    pb::WorkerEvent {
        event_id: id,
        kind: Some(pb::worker_event::Kind::Moved(pb::BlockMoved {
            hashes,
            tier,
        })),
        ..Default::default()
    }
}

fn overlap(blocks: usize, host: usize, disk: usize) -> Overlap {
    Overlap { blocks, host, disk }
}

fn owned(v: &[(&str, usize)]) -> Vec<(String, usize)> {
    v.iter().map(|(id, o)| ((*id).to_owned(), *o)).collect()
}

fn stored(id: u64, hashes: Vec<u64>) -> pb::WorkerEvent {
    pb::WorkerEvent {
        event_id: id,
        kind: Some(pb::worker_event::Kind::Stored(pb::BlockStored {
            parent: None,
            hashes,
        })),
        ..Default::default()
    }
}

#[tokio::test]
async fn index_follows_events_and_detects_gaps() {
    let w = worker(&spec("w", Role::Decode));
    assert!(w.apply(&stored(1, vec![10, 11, 12])));
    assert_eq!(w.overlap(&[10, 11, 12, 13]).blocks, 3);
    assert_eq!(w.overlap(&[99, 11, 12]).blocks, 0, "overlap is a prefix");
    assert!(w.apply(&pb::WorkerEvent {
        event_id: 2,
        kind: Some(pb::worker_event::Kind::Removed(pb::BlockRemoved {
            hashes: vec![11]
        })),
        ..Default::default()
    }));
    assert_eq!(w.overlap(&[10, 11, 12]).blocks, 1);
    // A replayed event is ignored; a gap is reported.
    assert!(w.apply(&stored(2, vec![99])));
    assert_eq!(w.overlap(&[99]).blocks, 0);
    assert!(!w.apply(&stored(4, vec![5])));
    // After `cleared`, the view restarts from what follows.
    assert!(w.apply(&pb::WorkerEvent {
        event_id: 7,
        kind: Some(pb::worker_event::Kind::Cleared(pb::CacheCleared {})),
        ..Default::default()
    }));
    assert_eq!(w.overlap(&[10]).blocks, 0);
    assert!(w.apply(&stored(8, vec![10])));
    assert_eq!(w.overlap(&[10]).blocks, 1);
}

/// The index keeps each block's tier: `stored` is the pool, `moved` names
/// host memory or disk (a block first heard of in a move is held there),
/// a move to a tier this router does not know changes nothing but is
/// still an event (no gap after it), and `removed` forgets the block.
#[tokio::test]
async fn index_learns_which_tier_holds_each_block() {
    let w = worker(&spec("w", Role::Decode));
    let (host, disk) = (pb::KvTier::Host as i32, pb::KvTier::Disk as i32);
    assert!(w.apply(&stored(1, vec![10, 11, 12, 13])));
    assert_eq!(w.overlap(&[10, 11, 12, 13]), overlap(4, 0, 0));
    assert!(w.apply(&moved(2, vec![10, 11, 12], host)));
    assert!(w.apply(&moved(3, vec![10], disk)));
    assert_eq!(w.overlap(&[10, 11, 12, 13]), overlap(4, 2, 1));
    // Unspecified and unknown tiers: ignored, the ids still follow.
    assert!(w.apply(&moved(4, vec![11], pb::KvTier::Unspecified as i32)));
    assert!(w.apply(&moved(5, vec![12, 99], 42)));
    assert_eq!(w.overlap(&[10, 11, 12, 13, 99]), overlap(4, 2, 1));
    // A restarted node's disk: announced, then moved to disk.
    assert!(w.apply(&stored(6, vec![13, 14])));
    assert!(w.apply(&moved(7, vec![13, 14], disk)));
    assert_eq!(w.overlap(&[10, 11, 12, 13, 14]), overlap(5, 2, 3));
    // Brought back into the pool: `stored` again.
    assert!(w.apply(&stored(8, vec![10, 11])));
    assert_eq!(w.overlap(&[10, 11, 12, 13, 14]), overlap(5, 1, 2));
    assert!(w.apply(&moved(9, vec![20], host)));
    assert_eq!(w.overlap(&[20]), overlap(1, 1, 0));
    assert!(w.apply(&pb::WorkerEvent {
        event_id: 10,
        kind: Some(pb::worker_event::Kind::Removed(pb::BlockRemoved {
            hashes: vec![12, 20]
        })),
        ..Default::default()
    }));
    assert_eq!(w.overlap(&[10, 11, 12, 13]), overlap(2, 0, 0));
    assert_eq!(w.overlap(&[20]), overlap(0, 0, 0));
    assert!(!w.apply(&moved(12, vec![10], disk)), "a gap");
}

/// A block below a worker's pool costs a fraction of computing it:
/// `host_hit_weight` (0.1) in host memory, `disk_hit_weight` (0.3) on disk.
/// Of three workers holding the whole prompt the pool's wins, then host
/// memory's, then the disk's; a disk hit still beats half the prompt in a
/// pool (10 x 0.3 = 3 < 5).
#[tokio::test]
async fn rank_weighs_where_the_overlap_is_held() {
    let (_, h) = prompt();
    let specs = [
        Spec {
            below: held(&h, Tier::Disk),
            ..spec("disk", Role::Decode)
        },
        Spec {
            cached: h[..5].to_vec(),
            ..spec("half-pool", Role::Decode)
        },
        Spec {
            below: held(&h, Tier::Host),
            ..spec("host", Role::Decode)
        },
        Spec {
            cached: h.clone(),
            ..spec("pool", Role::Decode)
        },
        Spec {
            cached: h[..4].to_vec(),
            below: held(&h[4..], Tier::Host),
            ..spec("mixed", Role::Decode)
        },
    ];
    let c = cluster(&specs, routing());
    let order: Vec<String> = ranked(&c, Role::Decode, &h)
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    // Costs: pool 0, mixed 0.6, host 1, disk 3, half-pool 5.
    assert_eq!(order, ["pool", "mixed", "host", "disk", "half-pool"]);
    let mixed = c.rank(Role::Decode, &h, h.len());
    assert_eq!(mixed[1].1.overlap, overlap(10, 6, 0));
    // At full weight a disk block costs as much as computing it.
    let c = cluster(
        &specs,
        RoutingConfig {
            disk_hit_weight: 1.0,
            ..routing()
        },
    );
    assert_eq!(ranked(&c, Role::Decode, &h)[4].0, "disk");
}

/// The prefix source of a decode attempt: the ready worker of either role
/// holding the most leading blocks beyond the decode worker's (any tier),
/// ties to the blocks nearest a pool, then to the fewer queued; none when
/// no one holds more, and never the decode worker itself or a worker on
/// probation.
#[tokio::test]
async fn prefix_source_is_the_worker_holding_most_beyond_the_decode_worker() {
    let (_, h) = prompt();
    let source = |specs: &[Spec<'_>], decode: &str| {
        let c = cluster(specs, routing());
        let ready = c.ready(&h);
        let (w, cand) = ready
            .iter()
            .find(|(w, _)| w.record.id == decode)
            .expect("the decode worker is ready");
        prefix_source(w, cand.overlap.blocks, &ready, &c.routing)
            .map(|p| (p.worker_id, p.endpoint, p.blocks))
    };
    let d = || Spec {
        cached: h[..6].to_vec(),
        ..spec("d", Role::Decode)
    };
    let d8 = || Spec {
        cached: h[..8].to_vec(),
        ..spec("d-8", Role::Decode)
    };
    let far = Spec {
        endpoint: "http://10.0.0.2:7000".into(),
        below: held(&h[..9], Tier::Disk),
        ..spec("p-disk", Role::Prefill)
    };
    // The longest overlap wins, whatever its tier or role.
    assert_eq!(
        source(&[spec("x", Role::Decode), d8(), far, d()], "d"),
        Some(("p-disk".into(), "http://10.0.0.2:7000".into(), 9))
    );
    // Equal overlaps: the pool's blocks before the disk's; equal tiers:
    // the fewer queued.
    let p_disk = || Spec {
        below: held(&h[..9], Tier::Disk),
        ..spec("a-disk", Role::Prefill)
    };
    let pool9 = |id, waiting| Spec {
        cached: h[..9].to_vec(),
        waiting,
        ..spec(id, Role::Decode)
    };
    let name = |r: Option<(String, String, usize)>| r.map(|(id, _, n)| (id, n));
    assert_eq!(
        name(source(&[p_disk(), pool9("z-pool", 3), d()], "d")),
        Some(("z-pool".into(), 9))
    );
    assert_eq!(
        name(source(
            &[pool9("busy", 3), pool9("idle", 1), p_disk(), d()],
            "d"
        )),
        Some(("idle".into(), 9))
    );
    // No gain: none. The decode worker is not its own source.
    assert_eq!(source(&[pool9("same", 0), pool9("d", 0)], "d"), None);
    assert_eq!(source(&[pool9("d", 0)], "d"), None);
    // A worker on probation is not named, however much it holds.
    let stranger = Spec {
        cached: h.clone(),
        on_probation: true,
        ..spec("stranger", Role::Prefill)
    };
    assert_eq!(
        name(source(&[stranger, d8(), d()], "d")),
        Some(("d-8".into(), 8))
    );
}

/// Workers are ranked by `prefill_weight * uncached blocks + KV blocks
/// used + queue_weight * queued`, with their prefix overlap; each role
/// ranks only its own workers. A load event changes the order.
#[tokio::test]
async fn rank_prefers_overlap_then_light_load() {
    let (_, h) = prompt();
    let mut half = h[..5].to_vec();
    half.push(h[7]); // not a prefix block: does not count
    let specs = [
        // cost 10 - 0 + 0 + 0 = 10
        spec("cold-idle", Role::Decode),
        // 10 - 8 + 6 + 4 * 1 = 12
        Spec {
            cached: h[..8].to_vec(),
            kv_blocks_used: 6,
            waiting: 1,
            ..spec("warm-busy", Role::Decode)
        },
        // 10 - 8 + 1 = 3
        Spec {
            cached: h[..8].to_vec(),
            kv_blocks_used: 1,
            ..spec("warm-idle", Role::Decode)
        },
        // 10 - 5 = 5
        Spec {
            cached: half,
            ..spec("half", Role::Decode)
        },
        // 10 - 10 + 4 * 2 sent by this router, not started = 8
        Spec {
            cached: h.clone(),
            pending: 2,
            ..spec("queued", Role::Decode)
        },
        // 10 - 10 = 0, but a prefill worker
        Spec {
            cached: h.clone(),
            ..spec("p-warm", Role::Prefill)
        },
        Spec {
            kv_blocks_used: 3,
            ..spec("p-cold", Role::Prefill)
        },
    ];
    let c = cluster(&specs, routing());
    assert_eq!(
        ranked(&c, Role::Decode, &h),
        owned(&[
            ("warm-idle", 8),
            ("half", 5),
            ("queued", 10),
            ("cold-idle", 0),
            ("warm-busy", 8),
        ])
    );
    assert_eq!(
        ranked(&c, Role::Prefill, &h),
        owned(&[("p-warm", 10), ("p-cold", 0)])
    );
    // The idle warm worker reports a heavy load: it drops behind
    // everything but the busy one (10 - 8 + 9 = 11).
    let w = Arc::clone(&c.workers.read().expect("lock")[&(Role::Decode, "warm-idle".into())]);
    assert!(w.apply(&pb::WorkerEvent {
        event_id: 0,
        kind: Some(pb::worker_event::Kind::Load(pb::Load {
            waiting: 0,
            running: 4,
            kv_blocks_used: 9,
            kv_blocks_total: 100,
        })),
        ..Default::default()
    }));
    let order: Vec<String> = ranked(&c, Role::Decode, &h)
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    assert_eq!(
        order,
        ["half", "queued", "cold-idle", "warm-idle", "warm-busy"]
    );
    // With no weight on prefill work, overlap no longer matters: load
    // alone decides (0 for both idle workers, in either order).
    let c = cluster(
        &specs,
        RoutingConfig {
            prefill_weight: 0.0,
            ..routing()
        },
    );
    let mut first: Vec<String> = ranked(&c, Role::Decode, &h)[..2]
        .iter()
        .map(|(id, _)| id.clone())
        .collect();
    first.sort();
    assert_eq!(first, ["cold-idle", "half"]);
}

/// A worker on probation is never ranked (so never tried, not even as
/// a retry) nor listed as a member, however cheap it looks.
#[tokio::test]
async fn workers_on_probation_are_not_routed_to() {
    let (_, h) = prompt();
    let stranger = |id| Spec {
        cached: h.clone(),
        on_probation: true,
        ..spec(id, Role::Decode)
    };
    let c = cluster(
        &[
            stranger("s1"),
            stranger("s2"),
            Spec {
                kv_blocks_used: 50,
                ..spec("real", Role::Decode)
            },
            Spec {
                on_probation: true,
                ..spec("p", Role::Prefill)
            },
        ],
        routing(),
    );
    assert_eq!(ranked(&c, Role::Decode, &h), owned(&[("real", 0)]));
    assert!(ranked(&c, Role::Prefill, &h).is_empty());
    assert_eq!(c.members(), (vec![], vec!["real".to_string()]));
}

/// The policy sees each ready worker's overlap and load, and its order is
/// the cluster's; an index it makes up is not used.
#[tokio::test]
async fn the_policy_decides_the_order() {
    #[derive(Debug)]
    struct Reverse(Arc<Mutex<Vec<Candidate>>>);
    impl RoutingPolicy for Reverse {
        fn rank(&self, _: Role, _: usize, candidates: &[Candidate]) -> Vec<usize> {
            *self.0.lock().expect("lock") = candidates.to_vec();
            let mut order: Vec<usize> = (0..candidates.len()).rev().collect();
            order.push(candidates.len());
            order
        }
    }
    let (_, h) = prompt();
    let mut c = cluster(
        &[
            Spec {
                cached: h[..3].to_vec(),
                kv_blocks_used: 5,
                waiting: 1,
                pending: 2,
                ..spec("a", Role::Decode)
            },
            spec("b", Role::Decode),
            Spec {
                on_probation: true,
                ..spec("c", Role::Decode)
            },
            spec("p", Role::Prefill),
        ],
        routing(),
    );
    let seen: Arc<Mutex<Vec<Candidate>>> = Arc::default();
    c.policy = Box::new(Reverse(Arc::clone(&seen)));
    assert_eq!(ranked(&c, Role::Decode, &h), owned(&[("b", 0), ("a", 3)]));
    assert_eq!(
        *seen.lock().expect("lock"),
        [
            Candidate {
                overlap: overlap(3, 0, 0),
                kv_blocks_used: 5,
                queued: 3,
            },
            Candidate {
                overlap: overlap(0, 0, 0),
                kv_blocks_used: 0,
                queued: 0,
            },
        ]
    );
}

/// Equal costs are broken at random, so a burst spreads over equals.
#[tokio::test]
async fn ties_are_broken_at_random() {
    let (_, h) = prompt();
    let c = cluster(
        &[
            spec("a", Role::Decode),
            spec("b", Role::Decode),
            spec("c", Role::Decode),
        ],
        routing(),
    );
    let mut firsts = BTreeMap::new();
    for _ in 0..300 {
        let r = c.rank(Role::Decode, &h, h.len());
        assert_eq!(r.len(), 3);
        *firsts.entry(r[0].0.record.id.clone()).or_insert(0) += 1;
    }
    assert_eq!(firsts.len(), 3, "{firsts:?}");
    assert!(firsts.values().all(|&n| n >= 50), "{firsts:?}");
}

/// Round robin takes the decode workers in turn, however much of the
/// prompt each holds and however loaded (the one holding it all included).
#[tokio::test]
async fn round_robin_takes_each_decode_worker_in_turn() {
    let (_, h) = prompt();
    let c = cluster(
        &[
            Spec {
                cached: h.clone(),
                ..spec("a", Role::Decode)
            },
            Spec {
                waiting: 9,
                ..spec("b", Role::Decode)
            },
            spec("p", Role::Prefill),
        ],
        RoutingConfig {
            policy: PolicyKind::RoundRobin,
            ..routing()
        },
    );
    let firsts: Vec<String> = (0..4)
        .map(|_| {
            ranked(&c, Role::Prefill, &h);
            ranked(&c, Role::Decode, &h)[0].0.clone()
        })
        .collect();
    assert_eq!(firsts, ["a", "b", "a", "b"]);
}

/// How a fake decode node answers `Generate`.
#[derive(Clone, Copy)]
enum Answer {
    /// One token, then `Finished`.
    Tokens,
    Refuse(Code),
}

/// A decode node on a local port that records what it was asked.
#[derive(Clone)]
struct FakeDecode {
    answer: Answer,
    seen: Arc<Mutex<VecDeque<pb::GenerateRequest>>>,
}

type Responses = Pin<Box<dyn Stream<Item = Result<pb::GenerateResponse, Status>> + Send>>;

#[tonic::async_trait]
impl pb::decode_server::Decode for FakeDecode {
    type GenerateStream = Responses;

    async fn generate(
        &self,
        req: Request<pb::GenerateRequest>,
    ) -> Result<Response<Responses>, Status> {
        self.seen.lock().expect("lock").push_back(req.into_inner());
        match self.answer {
            Answer::Refuse(code) => Err(Status::new(code, "fake refusal")),
            Answer::Tokens => {
                let token = pb::GenerateResponse {
                    kind: Some(pb::generate_response::Kind::Token(pb::Token {
                        id: 42,
                        logprob: None,
                        top: Vec::new(),
                    })),
                };
                let done = pb::GenerateResponse {
                    kind: Some(pb::generate_response::Kind::Finished(pb::Finished {
                        prompt_tokens: 40,
                        completion_tokens: 1,
                        cached_tokens: 0,
                        finish: pb::FinishReason::Length as i32,
                        prefill_worker: String::new(),
                    })),
                };
                Ok(Response::new(Box::pin(futures_util::stream::iter([
                    Ok(token),
                    Ok(done),
                ]))))
            }
        }
    }
}

/// Serves a fake decode node until the test's runtime ends; returns
/// its endpoint and what it saw.
async fn fake_decode(answer: Answer) -> (String, Arc<Mutex<VecDeque<pb::GenerateRequest>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let fake = FakeDecode {
        answer,
        seen: Arc::default(),
    };
    let seen = Arc::clone(&fake.seen);
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(pb::decode_server::DecodeServer::new(fake))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    (format!("http://{addr}"), seen)
}

async fn run(c: &Cluster, prompt: &[u32]) -> Result<(Placement, Vec<Event>), SubmitError> {
    let req = BackendRequest {
        request: GenerationRequest {
            prompt: prompt.to_vec(),
            sampling: SamplingParams::greedy(),
            max_tokens: 4,
            stop_token_ids: Vec::new(),
            constraint: None,
        },
        trace: TraceContext::new_root(),
    };
    let (mut stream, placement) = c.generate(req, 100).await?;
    let mut events = Vec::new();
    while let Some(ev) = tokio::time::timeout(Duration::from_secs(10), stream.recv())
        .await
        .expect("the stream ends in time")
    {
        events.push(ev);
    }
    Ok((placement, events))
}

/// `generate` sends the request to the cheapest decode worker only,
/// naming the `prefill_candidates` cheapest prefill workers best first;
/// a refusing decode worker is passed over for the next, an invalid
/// request is not retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_goes_to_the_chosen_decode_worker() {
    let (prompt, h) = prompt();
    let (best_ep, best_seen) = fake_decode(Answer::Tokens).await;
    let (other_ep, other_seen) = fake_decode(Answer::Tokens).await;
    let prefills = [
        Spec {
            cached: h[..2].to_vec(),
            ..spec("p-some", Role::Prefill)
        },
        Spec {
            cached: h[..9].to_vec(),
            ..spec("p-most", Role::Prefill)
        },
        spec("p-none", Role::Prefill),
    ];
    let decodes = |best: &str, other: &str| {
        [
            Spec {
                endpoint: other.to_string(),
                kv_blocks_used: 7,
                ..spec("d-loaded", Role::Decode)
            },
            Spec {
                endpoint: best.to_string(),
                cached: h[..6].to_vec(),
                ..spec("d-best", Role::Decode)
            },
        ]
    };
    let specs: Vec<Spec<'_>> = decodes(&best_ep, &other_ep)
        .into_iter()
        .chain(prefills)
        .collect();
    let c = cluster(&specs, routing());
    let (placement, events) = run(&c, &prompt).await.expect("generate");
    assert_eq!(placement.decode, "d-best");
    assert_eq!(placement.prefill, ["p-most", "p-some"]);
    assert!(
        matches!(
            events.as_slice(),
            [Event::Token(t), Event::Finished(u)] if t.token == 42 && u.completion_tokens == 1
        ),
        "{events:?}"
    );
    let got = best_seen
        .lock()
        .expect("lock")
        .pop_front()
        .expect("a request");
    assert_eq!(got.prompt, prompt);
    let targets: Vec<(&str, &str)> = got
        .prefill
        .iter()
        .map(|t| (t.worker_id.as_str(), t.endpoint.as_str()))
        .collect();
    assert_eq!(
        targets,
        [
            ("p-most", "http://127.0.0.1:1"),
            ("p-some", "http://127.0.0.1:1")
        ]
    );
    // p-most holds 9 leading blocks, d-best 6: the decode node is told.
    let source = got.prefix_source.as_ref().expect("a prefix source");
    assert_eq!(
        (
            source.worker_id.as_str(),
            source.endpoint.as_str(),
            source.blocks
        ),
        ("p-most", "http://127.0.0.1:1", 9)
    );
    assert!(best_seen.lock().expect("lock").is_empty());
    assert!(other_seen.lock().expect("lock").is_empty());
    for (_, w) in c.workers.read().expect("lock").iter() {
        assert_eq!(w.pending.load(Ordering::Relaxed), 0, "{}", w.record.id);
    }

    // The best worker refuses: the next one takes the request.
    let (refusing, refused_seen) = fake_decode(Answer::Refuse(Code::Unavailable)).await;
    let c = cluster(&decodes(&refusing, &other_ep), routing());
    let (placement, _) = run(&c, &prompt).await.expect("generate");
    assert_eq!(placement.decode, "d-loaded");
    assert_eq!(refused_seen.lock().expect("lock").len(), 1);
    assert_eq!(other_seen.lock().expect("lock").len(), 1);
    // Each attempt names its own source: none holds more than d-best; the
    // one after it is told of d-best's 6 blocks.
    let refused = refused_seen.lock().expect("lock")[0].clone();
    assert_eq!(refused.prefix_source, None);
    let retried = other_seen.lock().expect("lock")[0].clone();
    let source = retried.prefix_source.expect("a prefix source");
    assert_eq!((source.worker_id.as_str(), source.blocks), ("d-best", 6));

    // An invalid request is the client's error: not sent elsewhere.
    let (invalid, invalid_seen) = fake_decode(Answer::Refuse(Code::InvalidArgument)).await;
    let c = cluster(&decodes(&invalid, &other_ep), routing());
    match run(&c, &prompt).await {
        Err(SubmitError::Failed(GenFailure::Rejected(message))) => {
            assert_eq!(message, "fake refusal")
        }
        other => panic!("{:?}", other.map(|(p, _)| p)),
    }
    assert_eq!(invalid_seen.lock().expect("lock").len(), 1);
    assert_eq!(other_seen.lock().expect("lock").len(), 1);
}

#[test]
fn routing_config_is_validated() {
    let cfg = routing();
    assert!(cfg.validate().is_ok());
    for bad in [
        RoutingConfig {
            prefill_weight: -1.0,
            ..cfg.clone()
        },
        RoutingConfig {
            queue_weight: f64::NAN,
            ..cfg.clone()
        },
        RoutingConfig {
            prefill_candidates: 0,
            ..cfg.clone()
        },
        RoutingConfig {
            decode_attempts: 0,
            ..cfg.clone()
        },
        RoutingConfig {
            host_hit_weight: -0.1,
            ..cfg.clone()
        },
        RoutingConfig {
            disk_hit_weight: 1.5,
            ..cfg.clone()
        },
        RoutingConfig {
            disk_hit_weight: f64::NAN,
            ..cfg.clone()
        },
    ] {
        assert!(bad.validate().is_err(), "{bad:?}");
    }
}
