//! The prefill service on the real SmolLM2 GGUF, writing into a decode
//! node's registered region stood in for by an in-process `Dkv` of the
//! test: what it writes and where, what it refuses before any work, and a
//! deadline that expires while blocks are on the way. After every request
//! the node holds no blocks. Needs `TANDEM_TEST_GGUF`.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use tandem_dkv::{Dkv, DkvConfig, Grant, KvLayout, Region, TransportKind};
use tandem_engine::generate::{GenerateRequest, generate};
use tandem_engine::moe::Combine;
use tandem_engine::sampler::SamplingParams;
use tandem_engine::scheduler::{Scheduler, SchedulerConfig};
use tandem_engine::{LoadedModel, load};
use tandem_prefill_node::PrefillService;
use tandem_proto::{KvRegion, PrefillJob, pb};
use tandem_worker::{NodeCore, NodeOptions, Role};
use tonic::{Code, Request, Status};

/// One test at a time: the deadline test times a prefill, which must not
/// share the CPUs with another test's.
async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK.lock().await
}

fn model() -> Arc<LoadedModel> {
    static M: OnceLock<Arc<LoadedModel>> = OnceLock::new();
    Arc::clone(M.get_or_init(|| {
        let path = std::env::var_os("TANDEM_TEST_GGUF").expect(
            "set TANDEM_TEST_GGUF to the SmolLM2-135M-Instruct Q4_1 GGUF (scripts/test.sh does this)",
        );
        Arc::new(load(&PathBuf::from(path)).expect("model loads"))
    }))
}

/// A prefill node's core on the in-process KV transport.
struct Node {
    core: Arc<NodeCore>,
    svc: Option<PrefillService>,
    scheduler: Option<Scheduler>,
}

impl Node {
    /// `chunk`: the most prompt tokens one scheduler step runs.
    fn start(chunk: usize) -> Self {
        let config = SchedulerConfig {
            max_batch_size: 4,
            max_batch_input_tokens: chunk,
            max_length: 1024,
            block_size: 16,
            num_blocks: 128,
            prefix_caching: true,
            tp: 1,
            moe_combine: Combine::AllReduce,
            kv_tiers: None,
        };
        let local = "127.0.0.1:0".parse().expect("address");
        let opts = NodeOptions {
            role: Role::Prefill,
            id: "prefill".into(),
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
        let (core, scheduler) = NodeCore::start(model(), config, &opts).expect("node starts");
        let svc = Some(PrefillService::new(Arc::clone(&core)));
        Self {
            core,
            svc,
            scheduler: Some(scheduler),
        }
    }

    async fn prefill(&self, req: pb::PrefillRequest) -> Result<pb::PrefillResponse, Status> {
        use pb::prefill_server::Prefill;
        let svc = self.svc.as_ref().expect("service");
        let call = svc.prefill(Request::new(req));
        tokio::time::timeout(Duration::from_secs(60), call)
            .await
            .expect("prefill answers in time")
            .map(tonic::Response::into_inner)
    }

    fn steps(&self) -> u64 {
        self.core.scheduler.stats().steps.load(Ordering::Relaxed)
    }

    /// Waits until no request holds a block: exported blocks were released.
    async fn wait_idle(&self) {
        let s = self.core.scheduler.stats();
        let busy = || {
            [&s.kv_blocks_in_use, &s.running, &s.waiting, &s.exported]
                .map(|a| a.load(Ordering::Relaxed))
        };
        let until = Instant::now() + Duration::from_secs(10);
        while busy() != [0; 4] {
            assert!(
                Instant::now() < until,
                "blocks still held [in use, running, waiting, exported]: {:?}",
                busy()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Stops the scheduler once every handle on it is gone; bounded, so a
    /// leaked handle fails the test.
    async fn shutdown(mut self) {
        let scheduler = self.scheduler.take().expect("scheduler");
        drop(self);
        tokio::time::timeout(
            Duration::from_secs(10),
            tokio::task::spawn_blocking(move || scheduler.shutdown()),
        )
        .await
        .expect("scheduler still referenced after the test")
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

/// The decode side: a zeroed region of `blocks` whole-model blocks.
struct Dest {
    _dkv: Dkv,
    region: Region,
    layout: KvLayout,
    /// Every grant handed out so far, kept alive for the test.
    grants: std::sync::Mutex<Vec<Grant>>,
}

impl Dest {
    fn new(node: &Node, blocks: usize) -> Self {
        let dkv = Dkv::new(DkvConfig::in_process()).expect("dkv");
        let layout = node.core.full_layout;
        let region = dkv
            .alloc(blocks * layout.block_bytes as usize)
            .expect("alloc");
        Self {
            _dkv: dkv,
            region,
            layout,
            grants: Default::default(),
        }
    }

    /// A fresh grant of the whole region.
    fn kv_region(&self, connector: &str) -> KvRegion {
        let g = self
            .region
            .grant(
                std::slice::from_ref(&(0..self.region.len() as u64)),
                Instant::now() + Duration::from_secs(120),
            )
            .expect("grant");
        let d = g.descriptor();
        self.grants.lock().expect("grants").push(g);
        KvRegion {
            worker_address: d.worker_address,
            grant: d.grant,
            len: d.len,
            connector: connector.into(),
        }
    }

    fn block(&self, b: u32) -> &[u8] {
        let n = self.layout.block_bytes as usize;
        // SAFETY: the region is alive for `self`'s life and no write to it
        // is in flight (callers read after the prefill answered).
        let all = unsafe { std::slice::from_raw_parts(self.region.as_ptr(), self.region.len()) };
        &all[b as usize * n..(b as usize + 1) * n]
    }

    fn written(&self, b: u32) -> bool {
        self.block(b).iter().any(|&x| x != 0)
    }

    /// The bytes of the first `tokens` token rows of block `b`, per layer,
    /// K/V and head (the rest of a partial block is whatever the pool held).
    fn rows(&self, b: u32, tokens: usize, block_size: usize) -> Vec<u8> {
        let l = &self.layout;
        let row = l.head_slice_bytes as usize / block_size;
        let block = self.block(b);
        let mut out = Vec::new();
        for layer in 0..l.num_layers as usize {
            for slice in 0..2 * l.num_kv_heads as usize {
                let at = layer * l.layer_bytes as usize + slice * l.head_slice_bytes as usize;
                out.extend_from_slice(&block[at..at + tokens * row]);
            }
        }
        out
    }
}

fn prompt(text: &str) -> Vec<u32> {
    model()
        .text
        .tokenizer
        .encode(text, true)
        .expect("tokenizes")
}

/// A prompt of exactly `n` tokens (a text's tokens, repeated).
fn prompt_of(n: usize, text: &str) -> Vec<u32> {
    prompt(text).into_iter().cycle().take(n).collect()
}

fn job(
    node: &Node,
    prompt: &[u32],
    skip: usize,
    dst: &[u32],
    region: KvRegion,
    deadline: Duration,
) -> pb::PrefillRequest {
    PrefillJob {
        prompt: prompt.to_vec(),
        sampling: SamplingParams::greedy(),
        skip_blocks: skip,
        dst_blocks: dst.to_vec(),
        regions: vec![region],
        deadline,
        constraint: None,
    }
    .to_pb(&node.core.fingerprint)
}

fn first_greedy_token(prompt: &[u32]) -> u32 {
    let m = model();
    let req = GenerateRequest {
        prompt: prompt.to_vec(),
        sampling: SamplingParams::greedy(),
        max_tokens: 1,
        stop_token_ids: Vec::new(),
        stop_strings: Vec::new(),
        prefill_chunk: 512,
    };
    generate(&m, &req, |_| {}).expect("generates").tokens[0]
}

const LONG: Duration = Duration::from_secs(60);

/// The prompt's blocks land in exactly the destination blocks, the first
/// token is the greedy one; blocks the decode node has (`skip_blocks`) are
/// not sent, though computed here; a repeat served from this node's prefix
/// cache (whole blocks instead of layer by layer) sends the same bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_the_prompt_into_exactly_the_destination_blocks() {
    let _serial = serial().await;
    let node = Node::start(256);
    let bs = node.core.fingerprint.block_size;
    let dest = Dest::new(&node, 12);
    let written = |dest: &Dest| -> Vec<u32> { (0..12u32).filter(|&b| dest.written(b)).collect() };
    let p = prompt_of(
        2 * bs + 8,
        "The history of printing begins with carved wooden blocks.",
    );
    let r = node
        .prefill(job(&node, &p, 0, &[5, 2, 9], dest.kv_region("local"), LONG))
        .await
        .expect("prefill");
    assert_eq!(r.first.as_ref().map(|t| t.id), Some(first_greedy_token(&p)));
    assert_eq!((r.blocks, r.cached_tokens), (3, 0));
    assert_eq!(r.bytes, 3 * dest.layout.block_bytes);
    assert_eq!(written(&dest), [2, 5, 9]);
    node.wait_idle().await;

    // Another prompt; the decode node has its block 0: blocks 1 and 2 go
    // to 7 and 11 as their layers finish.
    let q = prompt_of(
        2 * bs + 8,
        "Bees dance to tell the hive where the flowers are.",
    );
    let r = node
        .prefill(job(&node, &q, 1, &[7, 11], dest.kv_region("local"), LONG))
        .await
        .expect("prefill");
    assert_eq!(r.first.as_ref().map(|t| t.id), Some(first_greedy_token(&q)));
    assert_eq!((r.blocks, r.cached_tokens), (2, 0));
    assert_eq!(written(&dest), [2, 5, 7, 9, 11]);
    node.wait_idle().await;

    // The same prompt whole, its full blocks now cached here.
    let r = node
        .prefill(job(&node, &q, 0, &[3, 4, 6], dest.kv_region("local"), LONG))
        .await
        .expect("prefill");
    assert_eq!((r.blocks, r.cached_tokens as usize), (3, 2 * bs));
    assert_eq!(written(&dest), [2, 3, 4, 5, 6, 7, 9, 11]);
    // (Compared with `==`: a failure must not print megabytes.)
    assert!(dest.block(4) == dest.block(7), "full block 1 differs");
    assert!(
        dest.rows(6, 8, bs) == dest.rows(11, 8, bs),
        "partial block 2 differs"
    );
    assert!(
        dest.block(3) != dest.block(5),
        "two prompts, one first block"
    );
    node.wait_idle().await;
    node.shutdown().await;
}

/// A region registered by another connector, another model's request, or
/// blocks outside the region are refused before the prompt is computed;
/// a descriptor the transport rejects fails the request and frees its
/// blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mismatched_requests_are_refused_with_their_error() {
    let _serial = serial().await;
    let node = Node::start(256);
    let dest = Dest::new(&node, 4);
    let p = prompt("A short prompt about rivers and the sea.");
    let steps = node.steps();

    let err = node
        .prefill(job(&node, &p, 0, &[1], dest.kv_region("ucx"), LONG))
        .await
        .expect_err("connector mismatch");
    assert_eq!(err.code(), Code::InvalidArgument);
    assert_eq!(
        err.message(),
        "KV region uses connector `ucx` but this node uses `local`"
    );

    let mut other = job(&node, &p, 0, &[1], dest.kv_region("local"), LONG);
    if let Some(fp) = other.fingerprint.as_mut() {
        fp.weights_hash = format!("{:016x}", node.core.fingerprint.weights_hash ^ 1);
    }
    let err = node.prefill(other).await.expect_err("other weights");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");

    let err = node
        .prefill(job(&node, &p, 0, &[4], dest.kv_region("local"), LONG))
        .await
        .expect_err("block outside the region");
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(
        err.message().contains("outside the registered region"),
        "{err:?}"
    );
    assert_eq!(node.steps(), steps, "a refused request computed something");

    let mut garbled = dest.kv_region("local");
    garbled.grant[0] ^= 0xff;
    let err = node
        .prefill(job(&node, &p, 0, &[1], garbled, LONG))
        .await
        .expect_err("garbled key");
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("KV transfer failed"), "{err:?}");
    assert!((0..4).all(|b| !dest.written(b)));
    node.wait_idle().await;
    node.shutdown().await;
}

/// A deadline that expires while the prompt's blocks are being written
/// (the first chunks' blocks have left, the last has not) fails the request
/// with `DEADLINE_EXCEEDED` and releases every exported block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_expiring_mid_transfer_fails_and_frees_the_blocks() {
    let _serial = serial().await;
    // Small chunks: blocks of the first chunks are written while later
    // chunks compute.
    let node = Node::start(32);
    let bs = node.core.fingerprint.block_size;
    let n_blocks = 32;
    let dst: Vec<u32> = (0..n_blocks as u32).collect();
    let text = "Tides rise and fall twice a day because the moon pulls on the oceans.";
    // Warm up, then time a whole prefill of this length.
    let warm = Dest::new(&node, n_blocks);
    let p = prompt_of(n_blocks * bs, text);
    let w = prompt_of(bs, "Warm up.");
    node.prefill(job(&node, &w, 0, &[0], warm.kv_region("local"), LONG))
        .await
        .expect("warm-up");
    let t = Instant::now();
    node.prefill(job(&node, &p, 0, &dst, warm.kv_region("local"), LONG))
        .await
        .expect("timed prefill");
    let whole = t.elapsed();
    node.wait_idle().await;

    // Other prompts (nothing cached) against a deadline that starts at half
    // that time and is halved while the whole prompt still gets through,
    // lengthened while nothing does: the machine's speed varies under
    // load, so one guess may miss the transfer.
    let mut deadline = (whole / 2).max(Duration::from_millis(1));
    let mut tried = Vec::new();
    for attempt in 0..10 {
        let q: Vec<u32> = prompt_of(n_blocks * bs, &format!("{attempt}: {text}"))
            .into_iter()
            .rev()
            .collect();
        let dest = Dest::new(&node, n_blocks);
        let out = node
            .prefill(job(&node, &q, 0, &dst, dest.kv_region("local"), deadline))
            .await;
        let written = dst.iter().filter(|&&b| dest.written(b)).count();
        node.wait_idle().await;
        tried.push((deadline, written));
        match out {
            Err(err) => {
                assert_eq!(err.code(), Code::DeadlineExceeded, "{err:?}");
                if written > 0 && !dest.written(n_blocks as u32 - 1) {
                    node.shutdown().await;
                    return;
                }
                if written == 0 {
                    deadline = deadline * 3 / 2;
                    continue;
                }
            }
            Ok(_) => assert_eq!(
                written, n_blocks,
                "a prefill answered with blocks unwritten"
            ),
        }
        deadline = (deadline / 2).max(Duration::from_millis(1));
    }
    panic!(
        "no deadline expired mid-transfer (whole prefill {whole:?}); \
         [deadline, blocks written of {n_blocks}]: {tried:?}"
    );
}
