//! The decode node's prefill placement, on the real SmolLM2 GGUF, against
//! prefill peers on local ports: a real prefill node (in-process KV
//! transport) and fakes that fail, answer nonsense, stall, or are not
//! there. Every case must end with the tokens a local greedy run gives,
//! count its outcome in `tandem.decode.prefills{outcome}`, and free its
//! blocks. Needs `TANDEM_TEST_GGUF`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use tandem_decode_node::{DecodeConfig, DecodeService};
use tandem_dkv::{Dkv, DkvConfig, DkvError, Refusal, RemoteRegion, TransportKind, WriteOp};
use tandem_engine::generate::{GenerateRequest, generate};
use tandem_engine::moe::Combine;
use tandem_engine::sampler::SamplingParams;
use tandem_engine::scheduler::{Scheduler, SchedulerConfig};
use tandem_engine::{LoadedModel, load};
use tandem_prefill_node::PrefillService;
use tandem_proto::{GenerateJob, PrefillTarget, PrefixSource, pb};
use tandem_testkit::{Kind, TestMeter};
use tandem_types::GenerationRequest;
use tandem_worker::{NodeCore, NodeOptions, Role};
use tokio::sync::oneshot;
use tokio_stream::StreamExt;
use tonic::{Code, Request, Response, Status};

/// Generated tokens per request.
const MAX_TOKENS: usize = 8;
/// An address where nothing listens.
const UNREACHABLE: &str = "http://127.0.0.1:1";

struct Harness {
    model: Arc<LoadedModel>,
    meter: TestMeter,
}

/// The model, and a meter provider installed before anything records
/// (instruments bind to the provider present at their first use).
fn harness() -> &'static Harness {
    static H: OnceLock<Harness> = OnceLock::new();
    H.get_or_init(|| {
        let meter = TestMeter::new();
        opentelemetry::global::set_meter_provider(meter.provider().clone());
        let path = std::env::var_os("TANDEM_TEST_GGUF").expect(
            "set TANDEM_TEST_GGUF to the SmolLM2-135M-Instruct Q4_1 GGUF (scripts/test.sh does this)",
        );
        let model = Arc::new(load(&PathBuf::from(path)).expect("model loads"));
        Harness { model, meter }
    })
}

/// The counters are process-wide: tests that compare them run one at a time.
async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK.lock().await
}

/// Cumulative values of the counter `name`, by the value of `label`.
fn counter(name: &str, label: &str) -> BTreeMap<String, u64> {
    let points = harness().meter.points();
    assert!(
        points.named(name).all(|p| p.kind == Kind::Sum),
        "{name} is not a counter"
    );
    points
        .by_label(name, label)
        .into_iter()
        .map(|(k, v)| (k, v as u64))
        .collect()
}

/// What changed in `counter(name, label)` since `before`.
fn delta(before: &BTreeMap<String, u64>, name: &str, label: &str) -> BTreeMap<String, u64> {
    counter(name, label)
        .into_iter()
        .filter_map(|(k, v)| {
            let d = v - before.get(&k).copied().unwrap_or(0);
            (d > 0).then_some((k, d))
        })
        .collect()
}

fn counts(v: &[(&str, u64)]) -> BTreeMap<String, u64> {
    v.iter().map(|(k, n)| ((*k).to_owned(), *n)).collect()
}

/// A node's core on the in-process KV transport, serving nothing yet.
struct Node {
    core: Arc<NodeCore>,
    scheduler: Option<Scheduler>,
}

impl Node {
    fn start(role: Role, id: &str) -> Self {
        let config = SchedulerConfig {
            max_batch_size: 4,
            max_batch_input_tokens: 256,
            max_length: 512,
            block_size: 16,
            num_blocks: 96,
            prefix_caching: true,
            tp: 1,
            moe_combine: Combine::AllReduce,
            kv_tiers: None,
        };
        let local = "127.0.0.1:0".parse().expect("address");
        let opts = NodeOptions {
            role,
            id: id.into(),
            grpc_addr: local,
            metrics_addr: local,
            advertise_host: "127.0.0.1".into(),
            etcd: None,
            transport: TransportKind::InProcess,
            ucx_tls: None,
            ucx_library: None,
            ucx_net_devices: None,
            dkv_key: None,
            shutdown_grace: Duration::from_secs(1),
            tls: None,
            grpc_idle_timeout: Duration::from_secs(60),
            kv_event_ring: 1024,
        };
        let (core, scheduler) =
            NodeCore::start(harness().model.clone(), config, &opts).expect("node starts");
        Self {
            core,
            scheduler: Some(scheduler),
        }
    }

    /// Waits until no request holds a block: every one freed its KV.
    async fn wait_idle(&self) {
        let s = self.core.scheduler.stats();
        let busy = || {
            [
                &s.kv_blocks_in_use,
                &s.running,
                &s.waiting,
                &s.importing,
                &s.exported,
            ]
            .map(|a| a.load(Ordering::Relaxed))
        };
        let until = Instant::now() + Duration::from_secs(10);
        while busy() != [0; 5] {
            assert!(
                Instant::now() < until,
                "{} still holds blocks [in use, running, waiting, importing, exported]: {:?}",
                self.core.id,
                busy()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Stops the scheduler once every handle on it is gone (the caller
    /// drops the services first); bounded, so a leaked handle fails.
    async fn shutdown(mut self) {
        let scheduler = self.scheduler.take().expect("scheduler");
        let id = self.core.id.clone();
        drop(self);
        tokio::time::timeout(
            Duration::from_secs(10),
            tokio::task::spawn_blocking(move || scheduler.shutdown()),
        )
        .await
        .unwrap_or_else(|_| panic!("{id}: scheduler still referenced after the test"))
        .expect("scheduler shutdown");
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        // A test that failed midway may still hold handles: joining the
        // scheduler would hang, so leave its thread to the process's end.
        if let Some(s) = self.scheduler.take() {
            std::mem::forget(s);
        }
    }
}

/// A gRPC server on a local port, stopped on `stop` or drop.
struct Server {
    endpoint: String,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl Server {
    async fn start(router: tonic::transport::server::Router) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let endpoint = format!("http://{}", listener.local_addr().expect("address"));
        let (stop, stopped) = oneshot::channel::<()>();
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
        let task = tokio::spawn(async move {
            let _ = router
                .serve_with_incoming_shutdown(incoming, async {
                    let _ = stopped.await;
                })
                .await;
        });
        Self {
            endpoint,
            stop: Some(stop),
            task,
        }
    }

    /// The `Worker` service of `node` (which serves prefix fetches).
    async fn worker(node: &Node) -> Self {
        let svc = tandem_worker::service::WorkerService::new(Arc::clone(&node.core)).into_server();
        Self::start(tonic::transport::Server::builder().add_service(svc)).await
    }

    async fn real_prefill(node: &Node) -> Self {
        let svc = PrefillService::new(Arc::clone(&node.core)).into_server();
        Self::start(tonic::transport::Server::builder().add_service(svc)).await
    }

    /// Stops serving and waits for the server (and the service it owns) to go.
    async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let task = std::mem::replace(&mut self.task, tokio::spawn(async {}));
        tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("server stops")
            .expect("server task");
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// How a fake prefill node answers.
#[derive(Clone, Copy, Debug)]
enum Fake {
    Fail(Code),
    /// Never answers: only the caller's deadline ends the call.
    Stall,
    /// A "first token" outside the vocabulary.
    BadToken,
    /// A response without a first token.
    NoToken,
}

#[derive(Clone)]
struct FakePrefill {
    how: Fake,
    calls: Arc<AtomicUsize>,
    /// The last request received (with the decode node's grant in it).
    last: Arc<Mutex<Option<pb::PrefillRequest>>>,
    /// Calls whose handler has not finished or been dropped.
    open: Arc<AtomicUsize>,
}

/// Counts a call as open until its handler ends or is dropped.
struct Open(Arc<AtomicUsize>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

#[tonic::async_trait]
impl pb::prefill_server::Prefill for FakePrefill {
    async fn prefill(
        &self,
        req: Request<pb::PrefillRequest>,
    ) -> Result<Response<pb::PrefillResponse>, Status> {
        *self.last.lock().unwrap_or_else(PoisonError::into_inner) = Some(req.into_inner());
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.open.fetch_add(1, Ordering::SeqCst);
        let _open = Open(Arc::clone(&self.open));
        let first = match self.how {
            Fake::Fail(code) => return Err(Status::new(code, "fake prefill failure")),
            Fake::Stall => return std::future::pending().await,
            Fake::BadToken => Some(pb::Token {
                id: u32::MAX,
                logprob: None,
                top: Vec::new(),
            }),
            Fake::NoToken => None,
        };
        Ok(Response::new(pb::PrefillResponse {
            first,
            cached_tokens: 0,
            bytes: 0,
            blocks: 0,
        }))
    }
}

struct FakeServer {
    server: Server,
    calls: Arc<AtomicUsize>,
    last: Arc<Mutex<Option<pb::PrefillRequest>>>,
    open: Arc<AtomicUsize>,
}

impl FakeServer {
    async fn start(how: Fake) -> Self {
        let fake = FakePrefill {
            how,
            calls: Arc::default(),
            last: Arc::default(),
            open: Arc::default(),
        };
        let (calls, open) = (Arc::clone(&fake.calls), Arc::clone(&fake.open));
        let last = Arc::clone(&fake.last);
        let svc = pb::prefill_server::PrefillServer::new(fake);
        let server = Server::start(tonic::transport::Server::builder().add_service(svc)).await;
        Self {
            server,
            calls,
            last,
            open,
        }
    }

    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    fn last_request(&self) -> Option<pb::PrefillRequest> {
        self.last
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

fn target(id: &str, endpoint: &str) -> PrefillTarget {
    PrefillTarget {
        worker_id: id.into(),
        endpoint: endpoint.into(),
    }
}

/// Writes one whole block `block` into the pool `req`'s region names,
/// as a prefill node holding that request's grant would (from its own
/// in-process transport).
async fn write_block(req: &pb::PrefillRequest, block: u32) -> Result<(), DkvError> {
    let region = req.region.as_ref().expect("a region");
    let remote = RemoteRegion {
        worker_address: region.worker_address.clone(),
        grant: region.grant.clone(),
        len: region.len,
    };
    // Node::start's pool: 96 blocks.
    let block_bytes = region.len / 96;
    let writer = Dkv::new(DkvConfig::in_process())?;
    let src = writer.alloc(block_bytes as usize)?;
    let op = WriteOp {
        local_offset: 0,
        remote_offset: u64::from(block) * block_bytes,
        len: block_bytes,
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    writer
        .write(&src, &remote, &[op], deadline)
        .await
        .map(|_| ())
}

fn config(prefill_timeout: Duration, quarantine_limit: Duration) -> DecodeConfig {
    let c = DecodeConfig {
        remote_prefill_min_tokens: 1,
        prefill_timeout,
        quarantine_limit,
        prefix_fetch: true,
    };
    c.validate().expect("valid decode config");
    c
}

/// A prompt of about 50 tokens (several full blocks and a partial one).
fn prompt(topic: &str) -> Vec<u32> {
    let text = format!(
        "Write three short paragraphs about {topic}. Start with its history, then describe how \
         it is used today, and finish with one surprising fact that most people do not know."
    );
    harness()
        .model
        .text
        .tokenizer
        .encode(&text, true)
        .expect("tokenizes")
}

/// The tokens `generate` gives for the prompt alone, greedily: the reference.
fn reference(prompt: &[u32]) -> Vec<u32> {
    let m = &harness().model;
    let req = GenerateRequest {
        prompt: prompt.to_vec(),
        sampling: SamplingParams::greedy(),
        max_tokens: MAX_TOKENS,
        stop_token_ids: m.text.tokenizer.stop_ids(),
        stop_strings: Vec::new(),
        prefill_chunk: 512,
    };
    generate(m, &req, |_| {}).expect("generates").tokens
}

#[derive(Debug)]
struct Generated {
    tokens: Vec<u32>,
    finished: pb::Finished,
    /// From the call to the first token.
    first_token_after: Duration,
}

/// One `Generate` call straight to the service, read to its end.
async fn run(
    svc: &DecodeService,
    node: &Node,
    prompt: &[u32],
    prefill: Vec<PrefillTarget>,
) -> Generated {
    run_with(svc, node, prompt, prefill, None).await
}

/// [`run`], naming a peer that holds the prompt's first blocks.
async fn run_with(
    svc: &DecodeService,
    node: &Node,
    prompt: &[u32],
    prefill: Vec<PrefillTarget>,
    prefix_source: Option<PrefixSource>,
) -> Generated {
    use pb::decode_server::Decode;
    let m = &harness().model;
    let job = GenerateJob {
        request: GenerationRequest {
            prompt: prompt.to_vec(),
            sampling: SamplingParams::greedy(),
            max_tokens: MAX_TOKENS,
            stop_token_ids: m.text.tokenizer.stop_ids(),
            constraint: None,
        },
        prefill,
        prefix_source,
    };
    let t0 = Instant::now();
    let read = async {
        let mut stream = svc
            .generate(Request::new(job.to_pb(&node.core.fingerprint)))
            .await
            .expect("generate accepted")
            .into_inner();
        let mut tokens = Vec::new();
        let mut first_token_after = None;
        while let Some(msg) = stream.next().await {
            match msg.expect("stream message").kind {
                Some(pb::generate_response::Kind::Token(t)) => {
                    first_token_after.get_or_insert_with(|| t0.elapsed());
                    tokens.push(t.id);
                }
                Some(pb::generate_response::Kind::Finished(finished)) => {
                    assert!(stream.next().await.is_none(), "messages after Finished");
                    return Generated {
                        tokens,
                        finished,
                        first_token_after: first_token_after.expect("a token"),
                    };
                }
                None => panic!("empty message"),
            }
        }
        panic!("stream ended without Finished after {tokens:?}");
    };
    tokio::time::timeout(Duration::from_secs(60), read)
        .await
        .expect("generation ends in time")
}

const PREFILLS: &str = "tandem.decode.prefills";
const WATCHDOG: &str = "tandem.dkv.watchdog_firings";
const BLOCKS: &str = "tandem.dkv.blocks_transferred";

/// A remote prefill over the in-process transport: the decode node decodes
/// from KV written into its pool by the prefill node and gives the local
/// greedy tokens; every block is freed on both sides.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_prefill_gives_the_local_greedy_tokens() {
    let _serial = serial().await;
    let p = prompt("lighthouses");
    let want = reference(&p);
    let (decode, prefill) = (
        Node::start(Role::Decode, "decode"),
        Node::start(Role::Prefill, "prefill-real"),
    );
    let real = Server::real_prefill(&prefill).await;
    let svc = DecodeService::new(
        Arc::clone(&decode.core),
        config(Duration::from_secs(30), Duration::from_secs(60)),
    );
    let (outcomes, blocks) = (counter(PREFILLS, "outcome"), counter(BLOCKS, "connector"));

    let got = run(
        &svc,
        &decode,
        &p,
        vec![target("prefill-real", &real.endpoint)],
    )
    .await;
    assert_eq!(got.tokens, want);
    assert_eq!(got.finished.prefill_worker, "prefill-real");
    assert_eq!(got.finished.prompt_tokens as usize, p.len());
    assert_eq!(
        delta(&outcomes, PREFILLS, "outcome"),
        counts(&[("remote", 1)])
    );
    // Every prompt block crossed over (the decode node had none cached).
    let n = p.len().div_ceil(decode.core.fingerprint.block_size) as u64;
    assert_eq!(delta(&blocks, BLOCKS, "connector"), counts(&[("local", n)]));

    decode.wait_idle().await;
    prefill.wait_idle().await;
    drop(svc);
    real.stop().await;
    decode.shutdown().await;
    prefill.shutdown().await;
}

/// Workers that cannot be reached or fail are passed over in the router's
/// order; the next one's prefill is used (outcome `retried`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_and_unreachable_workers_are_passed_over() {
    let _serial = serial().await;
    let p = prompt("volcanoes");
    let want = reference(&p);
    let (decode, prefill) = (
        Node::start(Role::Decode, "decode"),
        Node::start(Role::Prefill, "prefill-real"),
    );
    let real = Server::real_prefill(&prefill).await;
    let failing = FakeServer::start(Fake::Fail(Code::Internal)).await;
    let svc = DecodeService::new(
        Arc::clone(&decode.core),
        config(Duration::from_secs(30), Duration::from_secs(60)),
    );
    let (outcomes, watchdog) = (counter(PREFILLS, "outcome"), counter(WATCHDOG, "connector"));

    let targets = vec![
        target("prefill-gone", UNREACHABLE),
        target("prefill-failing", &failing.server.endpoint),
        target("prefill-real", &real.endpoint),
    ];
    let got = run(&svc, &decode, &p, targets).await;
    assert_eq!(got.tokens, want);
    assert_eq!(got.finished.prefill_worker, "prefill-real");
    assert_eq!(failing.calls(), 1);
    assert_eq!(
        delta(&outcomes, PREFILLS, "outcome"),
        counts(&[("retried", 1)])
    );
    assert!(delta(&watchdog, WATCHDOG, "connector").is_empty());

    decode.wait_idle().await;
    prefill.wait_idle().await;
    drop(svc);
    real.stop().await;
    failing.server.stop().await;
    decode.shutdown().await;
    prefill.shutdown().await;
}

/// A prefill node that never answers is abandoned at the prefill timeout;
/// the prompt is prefilled here in fresh blocks (outcome `fallback`, one
/// watchdog firing), the call to the stalled node is cancelled, the
/// abandoned blocks are released, and a late write from the stalled node
/// is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_prefill_falls_back_after_the_timeout_and_cannot_write_late() {
    let _serial = serial().await;
    let p = prompt("glaciers");
    let want = reference(&p);
    let decode = Node::start(Role::Decode, "decode");
    let stalled = FakeServer::start(Fake::Stall).await;
    let timeout = Duration::from_millis(400);
    let svc = DecodeService::new(
        Arc::clone(&decode.core),
        config(timeout, Duration::from_secs(60)),
    );
    let (outcomes, watchdog) = (counter(PREFILLS, "outcome"), counter(WATCHDOG, "connector"));

    let got = run(
        &svc,
        &decode,
        &p,
        vec![target("prefill-stalled", &stalled.server.endpoint)],
    )
    .await;
    assert_eq!(got.tokens, want);
    assert_eq!(got.finished.prefill_worker, "");
    assert!(
        got.first_token_after >= timeout,
        "first token after {:?}: before the timeout",
        got.first_token_after
    );
    assert!(got.first_token_after < Duration::from_secs(10), "{got:?}");
    assert_eq!(stalled.calls(), 1);
    assert_eq!(
        delta(&outcomes, PREFILLS, "outcome"),
        counts(&[("fallback", 1)])
    );
    assert_eq!(
        delta(&watchdog, WATCHDOG, "connector"),
        counts(&[("local", 1)])
    );
    let until = Instant::now() + Duration::from_secs(10);
    while stalled.open.load(Ordering::SeqCst) != 0 {
        assert!(
            Instant::now() < until,
            "the stalled call was never cancelled"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    decode.wait_idle().await;
    let late = stalled.last_request().expect("the stalled node was asked");
    let refused = decode.core.dkv.refused_writes();
    let block = late.dst_blocks[0];
    assert!(matches!(
        write_block(&late, block).await,
        Err(DkvError::Refused(_))
    ));
    assert_eq!(decode.core.dkv.refused_writes(), refused + 1);
    assert_eq!(decode.core.dkv.live_grants(), 0, "grants leaked");
    drop(svc);
    stalled.server.stop().await;
    decode.shutdown().await;
}

/// When no worker gives a usable answer (a token outside the vocabulary,
/// no token, an error, no server) the prompt is prefilled here: outcome
/// `fallback`, no watchdog firing, the local greedy tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unusable_answers_fall_back_to_a_local_prefill() {
    let _serial = serial().await;
    let p = prompt("bridges");
    let want = reference(&p);
    let decode = Node::start(Role::Decode, "decode");
    let fakes = [
        FakeServer::start(Fake::BadToken).await,
        FakeServer::start(Fake::NoToken).await,
        FakeServer::start(Fake::Fail(Code::Unavailable)).await,
    ];
    let svc = DecodeService::new(
        Arc::clone(&decode.core),
        config(Duration::from_secs(30), Duration::from_secs(60)),
    );
    let (outcomes, watchdog) = (counter(PREFILLS, "outcome"), counter(WATCHDOG, "connector"));

    let mut targets: Vec<PrefillTarget> = fakes
        .iter()
        .enumerate()
        .map(|(i, f)| target(&format!("prefill-{i}"), &f.server.endpoint))
        .collect();
    targets.push(target("prefill-gone", UNREACHABLE));
    let got = run(&svc, &decode, &p, targets).await;
    assert_eq!(got.tokens, want);
    assert_eq!(got.finished.prefill_worker, "");
    for f in &fakes {
        assert_eq!(f.calls(), 1);
    }
    assert_eq!(
        delta(&outcomes, PREFILLS, "outcome"),
        counts(&[("fallback", 1)])
    );
    assert!(delta(&watchdog, WATCHDOG, "connector").is_empty());

    decode.wait_idle().await;
    drop(svc);
    for f in fakes {
        f.server.stop().await;
    }
    decode.shutdown().await;
}

/// Only the uncached part of a prompt counts for remote prefill: a prompt
/// whose blocks this node computed before is prefilled here without asking
/// anyone (outcome `local`), as is one shorter than the threshold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_or_cached_prompts_are_prefilled_here() {
    let _serial = serial().await;
    let p = prompt("kites");
    let want = reference(&p);
    let (decode, prefill) = (
        Node::start(Role::Decode, "decode"),
        Node::start(Role::Prefill, "prefill-real"),
    );
    let real = Server::real_prefill(&prefill).await;
    let failing = FakeServer::start(Fake::Fail(Code::Internal)).await;
    let bs = decode.core.fingerprint.block_size;
    // Remote from the first uncached block on.
    let svc = DecodeService::new(
        Arc::clone(&decode.core),
        DecodeConfig {
            remote_prefill_min_tokens: bs,
            ..config(Duration::from_secs(30), Duration::from_secs(60))
        },
    );
    let outcomes = counter(PREFILLS, "outcome");

    let first = run(
        &svc,
        &decode,
        &p,
        vec![target("prefill-real", &real.endpoint)],
    )
    .await;
    assert_eq!(first.tokens, want);
    assert_eq!(first.finished.prefill_worker, "prefill-real");
    decode.wait_idle().await;
    // The same prompt again: all but its partial last block is cached here,
    // fewer uncached tokens than the threshold.
    let uncached = p.len() % bs;
    assert!(uncached > 0 && uncached < bs, "{} tokens", p.len());
    let again = run(
        &svc,
        &decode,
        &p,
        vec![target("prefill-failing", &failing.server.endpoint)],
    )
    .await;
    assert_eq!(again.tokens, want);
    assert_eq!(again.finished.prefill_worker, "");
    assert_eq!(again.finished.cached_tokens as usize, p.len() - uncached);
    // A prompt shorter than one block, never seen before.
    let short = &prompt("owls")[..bs - 1];
    let short_got = run(
        &svc,
        &decode,
        short,
        vec![target("prefill-failing", &failing.server.endpoint)],
    )
    .await;
    assert_eq!(short_got.tokens, reference(short));
    assert_eq!(failing.calls(), 0, "no worker is asked for a local prefill");
    assert_eq!(
        delta(&outcomes, PREFILLS, "outcome"),
        counts(&[("local", 2), ("remote", 1)])
    );

    decode.wait_idle().await;
    prefill.wait_idle().await;
    drop(svc);
    real.stop().await;
    failing.server.stop().await;
    decode.shutdown().await;
    prefill.shutdown().await;
}

/// A caller that goes away while its prompt waits on a prefill node that
/// never answers frees the reserved blocks at once, not after the prefill
/// timeout of every target; more than `MAX_PREFILL_TARGETS` targets are
/// refused. Meanwhile the prefill node's grant lets it write the request's
/// own blocks and nothing else, and only until the caller left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_gone_mid_prefill_frees_its_blocks_at_once() {
    use pb::decode_server::Decode;
    let _serial = serial().await;
    let decode = Node::start(Role::Decode, "decode");
    let stalled = FakeServer::start(Fake::Stall).await;
    // A long timeout: only the cancellation can free the blocks in time.
    let timeout = Duration::from_secs(30);
    let svc = DecodeService::new(
        Arc::clone(&decode.core),
        config(timeout, Duration::from_secs(60)),
    );
    let m = &harness().model;
    let job = |targets: usize| GenerateJob {
        request: GenerationRequest {
            prompt: prompt("volcanoes"),
            sampling: SamplingParams::greedy(),
            max_tokens: MAX_TOKENS,
            stop_token_ids: m.text.tokenizer.stop_ids(),
            constraint: None,
        },
        prefill: (0..targets)
            .map(|i| target(&format!("stalled-{i}"), &stalled.server.endpoint))
            .collect(),

        prefix_source: None,
    };
    let too_many = svc
        .generate(Request::new(
            job(tandem_proto::MAX_PREFILL_TARGETS + 1).to_pb(&decode.core.fingerprint),
        ))
        .await
        .expect_err("too many targets");
    assert_eq!(too_many.code(), tonic::Code::InvalidArgument);

    let stream = svc
        .generate(Request::new(
            job(tandem_proto::MAX_PREFILL_TARGETS).to_pb(&decode.core.fingerprint),
        ))
        .await
        .expect("generate accepted")
        .into_inner();
    let until = Instant::now() + Duration::from_secs(10);
    while stalled.calls() == 0 {
        assert!(Instant::now() < until, "the prefill was never asked");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let in_use = decode
        .core
        .scheduler
        .stats()
        .kv_blocks_in_use
        .load(Ordering::Relaxed);
    assert!(in_use > 0, "blocks are reserved while the prefill runs");
    let asked = stalled.last_request().expect("the stalled node was asked");
    let dkv = &decode.core.dkv;
    let refused = dkv.refused_writes();
    let outside = (0..96u32)
        .find(|b| !asked.dst_blocks.contains(b))
        .expect("a block outside the request");
    assert!(matches!(
        write_block(&asked, outside).await,
        Err(DkvError::Refused(Refusal::OutOfRange))
    ));
    assert_eq!(dkv.refused_writes(), refused + 1);
    write_block(&asked, asked.dst_blocks[0])
        .await
        .expect("the granted block is writable");
    // Each granted byte once: a replay is refused.
    assert!(matches!(
        write_block(&asked, asked.dst_blocks[0]).await,
        Err(DkvError::Refused(Refusal::OutOfRange))
    ));
    let cancelled = Instant::now();
    drop(stream);
    decode.wait_idle().await;
    // The grant went with the caller.
    let last = asked.dst_blocks[asked.dst_blocks.len() - 1];
    assert!(matches!(
        write_block(&asked, last).await,
        Err(DkvError::Refused(_))
    ));
    assert_eq!(dkv.refused_writes(), refused + 3);
    assert_eq!(dkv.live_grants(), 0, "grants leaked");
    assert!(
        cancelled.elapsed() < Duration::from_secs(5),
        "blocks held {:?} after the caller left",
        cancelled.elapsed()
    );
    assert_eq!(stalled.calls(), 1, "no retry after the caller left");
    drop(svc);
    stalled.server.stop().await;
    decode.shutdown().await;
}

/// A `Worker` whose fetches never answer (a peer frozen mid-fetch).
struct StalledWorker {
    calls: Arc<AtomicUsize>,
}

#[tonic::async_trait]
impl pb::worker_server::Worker for StalledWorker {
    async fn info(&self, _: Request<pb::InfoRequest>) -> Result<Response<pb::WorkerInfo>, Status> {
        Err(Status::unimplemented("fake"))
    }

    type EventsStream = tokio_stream::Empty<Result<pb::WorkerEvent, Status>>;

    async fn events(
        &self,
        _: Request<pb::EventsRequest>,
    ) -> Result<Response<Self::EventsStream>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn fetch_blocks(
        &self,
        _: Request<pb::FetchRequest>,
    ) -> Result<Response<pb::FetchResponse>, Status> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        std::future::pending().await
    }
}

const FETCHES: &str = "tandem.decode.prefix_fetches";
const TIER_HITS: &str = "tandem.kv.tier_hits";
const TIER_MISSES: &str = "tandem.kv.tier_misses";
const TIER_ERRORS: &str = "tandem.kv.tier_errors";

fn source(id: &str, endpoint: &str, blocks: usize) -> Option<PrefixSource> {
    Some(PrefixSource {
        worker_id: id.into(),
        endpoint: endpoint.into(),
        blocks,
    })
}

/// A decode node that lacks a prompt's prefix another node computed
/// fetches those blocks over dKV instead of computing them: the same
/// tokens, the fetched tokens reported cached, counted as peer-tier hits,
/// and the holder's blocks unpinned afterwards. A holder that lacks what
/// the router claimed is a miss, not an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_a_peer_holds_is_fetched_not_computed() {
    let _serial = serial().await;
    let p = prompt("windmills");
    let want = reference(&p);
    let (holder, fetcher, empty) = (
        Node::start(Role::Decode, "holder"),
        Node::start(Role::Decode, "fetcher"),
        Node::start(Role::Decode, "empty"),
    );
    let (worker, empty_worker) = (Server::worker(&holder).await, Server::worker(&empty).await);
    let cfg = config(Duration::from_secs(30), Duration::from_secs(60));
    let (hold_svc, svc) = (
        DecodeService::new(Arc::clone(&holder.core), cfg.clone()),
        DecodeService::new(Arc::clone(&fetcher.core), cfg),
    );
    let bs = fetcher.core.fingerprint.block_size;
    let full = (p.len() - 1) / bs;
    assert!(full >= 2, "the prompt needs full blocks");
    assert_eq!(run(&hold_svc, &holder, &p, vec![]).await.tokens, want);
    holder.wait_idle().await;

    let before = [FETCHES, TIER_HITS, TIER_MISSES].map(|n| {
        let label = if n == FETCHES { "outcome" } else { "tier" };
        (n, label, counter(n, label))
    });
    let got = run_with(
        &svc,
        &fetcher,
        &p,
        vec![],
        source("holder", &worker.endpoint, full),
    )
    .await;
    assert_eq!(got.tokens, want, "tokens after a fetched prefix");
    assert_eq!(got.finished.cached_tokens as usize, full * bs);
    let changed: Vec<_> = before.iter().map(|(n, l, b)| delta(b, n, l)).collect();
    assert_eq!(changed[0], counts(&[("fetched", 1)]));
    assert_eq!(changed[1], counts(&[("peer", full as u64)]));
    assert!(changed[2].is_empty(), "{changed:?}");
    holder.wait_idle().await;
    fetcher.wait_idle().await;

    // The fetched blocks are the fetcher's own cache now: no second fetch.
    let fetches = counter(FETCHES, "outcome");
    let again = run_with(
        &svc,
        &fetcher,
        &p,
        vec![],
        source("holder", &worker.endpoint, full),
    )
    .await;
    assert_eq!(again.tokens, want);
    assert!(delta(&fetches, FETCHES, "outcome").is_empty());

    // A peer that does not hold what the router said: nothing lands, the
    // prompt is computed, one miss.
    let q = prompt("tunnels");
    let misses = counter(TIER_MISSES, "tier");
    let got = run_with(
        &svc,
        &fetcher,
        &q,
        vec![],
        source("empty", &empty_worker.endpoint, 2),
    )
    .await;
    assert_eq!(got.tokens, reference(&q));
    assert_eq!(got.finished.cached_tokens, 0);
    assert_eq!(delta(&misses, TIER_MISSES, "tier"), counts(&[("peer", 1)]));

    for n in [&holder, &fetcher, &empty] {
        n.wait_idle().await;
    }
    assert_eq!(fetcher.core.dkv.live_grants(), 0, "grants leaked");
    drop((hold_svc, svc));
    worker.stop().await;
    empty_worker.stop().await;
    holder.shutdown().await;
    fetcher.shutdown().await;
    empty.shutdown().await;
}

/// A peer that freezes mid-fetch is abandoned once the fetch took a few
/// times what computing the blocks would (at least a quarter second, far
/// below the prefill timeout) and one that cannot be reached at once:
/// each a counted failure, the prompt computed here with the local greedy
/// tokens, every block and grant freed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_stalls_or_is_gone_mid_fetch_is_a_miss() {
    let _serial = serial().await;
    let p = prompt("volcanoes");
    let want = reference(&p);
    let fetcher = Node::start(Role::Decode, "fetcher");
    let calls = Arc::new(AtomicUsize::new(0));
    let stalled = Server::start(tonic::transport::Server::builder().add_service(
        pb::worker_server::WorkerServer::new(StalledWorker {
            calls: Arc::clone(&calls),
        }),
    ))
    .await;
    let svc = DecodeService::new(
        Arc::clone(&fetcher.core),
        config(Duration::from_secs(30), Duration::from_secs(60)),
    );
    let full = (p.len() - 1) / fetcher.core.fingerprint.block_size;
    let errors = counter(TIER_ERRORS, "kind");
    let quarantined = counter("tandem.decode.quarantined", "");

    let got = run_with(
        &svc,
        &fetcher,
        &p,
        vec![],
        source("frozen", &stalled.endpoint, full),
    )
    .await;
    assert_eq!(got.tokens, want);
    assert_eq!(got.finished.cached_tokens, 0);
    assert!(
        (Duration::from_millis(250)..Duration::from_secs(5)).contains(&got.first_token_after),
        "{got:?}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    // (Another prompt: the first is cached here now.)
    let q = prompt("earthquakes");
    let got = run_with(
        &svc,
        &fetcher,
        &q,
        vec![],
        source("gone", UNREACHABLE, full),
    )
    .await;
    assert_eq!(got.tokens, reference(&q));
    assert_eq!(delta(&errors, TIER_ERRORS, "kind"), counts(&[("fetch", 2)]));
    // The frozen peer's grant may still have writes landing: its blocks
    // waited in quarantine; the unreachable one's never left.
    assert_eq!(
        delta(&quarantined, "tandem.decode.quarantined", ""),
        counts(&[("", 1)])
    );
    fetcher.wait_idle().await;
    assert_eq!(fetcher.core.dkv.live_grants(), 0, "grants leaked");
    drop(svc);
    stalled.stop().await;
    fetcher.shutdown().await;
}
