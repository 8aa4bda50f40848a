//! The cluster backend of the router: worker membership from etcd, a view
//! of each worker's prefix cache and load built from its event stream, the
//! routing decision, and the `Generate` call to the chosen decode node.
//!
//! Routing follows the brief's cost function, for both pools:
//! `prefill_weight * (prompt_blocks - overlap_blocks) + kv_blocks_used +
//! queue_weight * queued`, argmin with ties broken at random. `queued`
//! counts the worker's waiting requests (from its load events) plus the
//! requests this router sent it that have not started yet, so that a burst
//! spreads before the next load update arrives.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, RwLock};
use std::time::{Duration, Instant};

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Gauge, Histogram};
use tandem_discovery::{EtcdConfig, Membership, Role, Snapshot};
use tandem_engine::ModelFingerprint;
use tandem_engine::block_manager::{BlockHash, block_hashes};
use tandem_engine::metrics::egress;
use tandem_engine::sampler::{Sampled, SamplingParams};
use tandem_engine::scheduler::{Event, Usage};
use tandem_proto::trace::TraceContext;
use tandem_proto::{GenerateJob, PrefillTarget, WorkerRecord, finish_from_pb, pb};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Streaming};

use crate::ApiError;

/// Routing weights and limits, validated at startup.
#[derive(Debug, Clone, PartialEq)]
pub struct RoutingConfig {
    /// Cost of one prompt block a worker would have to compute.
    pub prefill_weight: f64,
    /// Cost of one queued request.
    pub queue_weight: f64,
    /// Prefill workers named to the decode node, best first (retries).
    pub prefill_candidates: usize,
    /// Decode workers tried for one request before giving up.
    pub decode_attempts: usize,
}

impl RoutingConfig {
    pub fn validate(&self) -> Result<(), String> {
        for (name, v) in [
            ("prefill weight", self.prefill_weight),
            ("queue weight", self.queue_weight),
        ] {
            if !v.is_finite() || v < 0.0 {
                return Err(format!("{name} {v} must be a finite number >= 0"));
            }
        }
        if self.prefill_candidates == 0 || self.decode_attempts == 0 {
            return Err("prefill candidates and decode attempts must be at least 1".into());
        }
        Ok(())
    }
}

struct ClusterMetrics {
    hashing: Histogram<f64>,
    lookup: Histogram<f64>,
    scheduling: Histogram<f64>,
    overlap: Histogram<u64>,
    workers: Gauge<u64>,
}

const US_BUCKETS: [f64; 12] = [
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 5000.0, 20000.0,
];

fn metrics() -> &'static ClusterMetrics {
    static M: OnceLock<ClusterMetrics> = OnceLock::new();
    M.get_or_init(|| {
        let m = opentelemetry::global::meter("tandem");
        let us = |name: &'static str, d: &'static str| {
            m.f64_histogram(name)
                .with_description(d)
                .with_unit("us")
                .with_boundaries(US_BUCKETS.to_vec())
                .build()
        };
        ClusterMetrics {
            hashing: us(
                "tandem.router.hashing_time",
                "Time hashing a prompt's blocks",
            ),
            lookup: us(
                "tandem.router.index_lookup_time",
                "Time looking up prefix overlap in every worker's index",
            ),
            scheduling: us("tandem.router.scheduling_time", "Time choosing workers"),
            overlap: m
                .u64_histogram("tandem.router.chosen_overlap")
                .with_description("Prompt blocks already cached on the chosen decode worker")
                .build(),
            workers: m
                .u64_gauge("tandem.router.workers")
                .with_description("Workers this router routes to, by role")
                .build(),
        }
    })
}

/// `tandem.router.workers{role}`: the workers routed to now.
fn record_workers(workers: &BTreeMap<(Role, String), Arc<Worker>>) {
    for role in [Role::Prefill, Role::Decode] {
        let n = workers.values().filter(|w| w.role == role).count();
        metrics()
            .workers
            .record(n as u64, &[KeyValue::new("role", role.as_str())]);
    }
}

/// What the router knows about one worker.
#[derive(Debug)]
struct Worker {
    record: WorkerRecord,
    role: Role,
    channel: Channel,
    /// Hashes of the blocks in its prefix cache (from its events).
    cached: Mutex<HashSet<BlockHash>>,
    last_event: AtomicU64,
    waiting: AtomicUsize,
    kv_blocks_used: AtomicUsize,
    /// Requests this router sent that have not started yet.
    pending: AtomicUsize,
    events_task: Mutex<Option<JoinHandle<()>>>,
}

impl Drop for Worker {
    fn drop(&mut self) {
        if let Some(t) = self
            .events_task
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            t.abort();
        }
    }
}

impl Worker {
    /// Leading blocks of `hashes` this worker has cached.
    fn overlap(&self, hashes: &[BlockHash]) -> usize {
        let cached = self.cached.lock().unwrap_or_else(PoisonError::into_inner);
        hashes.iter().take_while(|h| cached.contains(h)).count()
    }

    fn cost(&self, cfg: &RoutingConfig, prompt_blocks: usize, overlap: usize) -> f64 {
        let queued = self.waiting.load(Ordering::Relaxed) + self.pending.load(Ordering::Relaxed);
        cfg.prefill_weight * (prompt_blocks - overlap) as f64
            + self.kv_blocks_used.load(Ordering::Relaxed) as f64
            + cfg.queue_weight * queued as f64
    }

    /// Applies one event; returns false on a gap (the caller resubscribes).
    fn apply(&self, e: &pb::WorkerEvent) -> bool {
        use pb::worker_event::Kind;
        let Some(kind) = &e.kind else { return true };
        if let Kind::Load(l) = kind {
            self.waiting.store(l.waiting as usize, Ordering::Relaxed);
            self.kv_blocks_used
                .store(l.kv_blocks_used as usize, Ordering::Relaxed);
            return true;
        }
        let last = self.last_event.load(Ordering::Relaxed);
        if e.event_id <= last {
            return true; // replayed twice
        }
        let mut cached = self.cached.lock().unwrap_or_else(PoisonError::into_inner);
        match kind {
            Kind::Cleared(_) => cached.clear(),
            _ if last != 0 && e.event_id != last + 1 => return false,
            Kind::Stored(s) => cached.extend(s.hashes.iter().copied()),
            Kind::Removed(r) => {
                for h in &r.hashes {
                    cached.remove(h);
                }
            }
            Kind::Load(_) => {}
        }
        self.last_event.store(e.event_id, Ordering::Relaxed);
        true
    }
}

/// Follows a worker's event stream, reconnecting (and replaying from the
/// last event seen) until the worker leaves the membership.
async fn follow_events(worker: std::sync::Weak<Worker>) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let Some(w) = worker.upgrade() else { return };
        let mut client = pb::worker_client::WorkerClient::new(w.channel.clone());
        let after = w.last_event.load(Ordering::Relaxed);
        drop(w);
        if let Ok(resp) = client
            .events(pb::EventsRequest {
                after_event_id: after,
            })
            .await
        {
            let mut stream = resp.into_inner();
            backoff = Duration::from_millis(100);
            while let Ok(Some(e)) = stream.message().await {
                let Some(w) = worker.upgrade() else { return };
                if !w.apply(&e) {
                    tracing::debug!(worker = %w.record.id, "event gap; resubscribing");
                    break;
                }
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// Live membership and routing state.
#[derive(Debug)]
pub struct Cluster {
    fingerprint: ModelFingerprint,
    routing: RoutingConfig,
    workers: RwLock<BTreeMap<(Role, String), Arc<Worker>>>,
    rng: AtomicU64,
}

/// Owns the membership watch; [`ClusterHandle::shutdown`] stops it.
#[derive(Debug)]
pub struct ClusterHandle {
    pub cluster: Arc<Cluster>,
    membership: Option<Membership>,
    task: Option<JoinHandle<()>>,
}

impl ClusterHandle {
    /// Watches the workers in etcd (fails if etcd is unreachable at start).
    pub async fn start(
        etcd: &EtcdConfig,
        fingerprint: ModelFingerprint,
        routing: RoutingConfig,
    ) -> Result<Self, String> {
        let membership = Membership::watch(etcd)
            .await
            .map_err(|e| format!("watching workers in etcd: {e}"))?;
        let cluster = Arc::new(Cluster {
            fingerprint,
            routing,
            workers: RwLock::new(BTreeMap::new()),
            rng: AtomicU64::new(0x2545_f491_4f6c_dd1d),
        });
        let mut rx = membership.subscribe();
        let c = Arc::clone(&cluster);
        let task = tokio::spawn(async move {
            loop {
                let snap = rx.borrow_and_update().clone();
                c.sync(&snap);
                if rx.changed().await.is_err() {
                    return;
                }
            }
        });
        Ok(Self {
            cluster,
            membership: Some(membership),
            task: Some(task),
        })
    }

    pub async fn shutdown(mut self) {
        if let Some(m) = self.membership.take() {
            m.shutdown().await;
        }
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
        let mut workers = self
            .cluster
            .workers
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        workers.clear();
        record_workers(&workers);
    }

    pub fn is_connected(&self) -> bool {
        self.membership
            .as_ref()
            .is_some_and(Membership::is_connected)
    }
}

/// A generation in flight on a decode node. A reader task takes the
/// decode node's messages off the gRPC stream as they arrive, so that
/// responses waiting for a slow client are counted in the egress backlog
/// (`tandem.num_responses_buffered`, `tandem.response_queue_time`) instead of
/// hiding in HTTP/2 flow control. Dropping the stream stops the reader,
/// which drops the gRPC stream: the decode node sees the cancellation.
#[derive(Debug)]
pub struct RemoteStream {
    rx: mpsc::Receiver<Buffered>,
    _reader: AbortOnDrop,
    done: bool,
}

/// Responses the reader may run ahead of the client before it waits.
const EGRESS_BUFFER: usize = 1024;

/// One response in the egress backlog until taken or dropped.
#[derive(Debug)]
struct Buffered {
    event: Option<Event>,
    at: Instant,
}

impl Buffered {
    fn new(event: Event) -> Self {
        Self {
            event: Some(event),
            at: egress::produced(),
        }
    }

    fn take(mut self) -> Option<Event> {
        egress::taken(self.at);
        self.event.take()
    }
}

impl Drop for Buffered {
    fn drop(&mut self) {
        if self.event.is_some() {
            egress::discarded(1);
        }
    }
}

/// Aborts the task when dropped, so that no reader outlives its stream.
#[derive(Debug)]
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl RemoteStream {
    fn start(stream: Streaming<pb::GenerateResponse>, vocab: usize) -> Self {
        let (tx, rx) = mpsc::channel(EGRESS_BUFFER);
        let reader = AbortOnDrop(tokio::spawn(read_remote(stream, vocab, tx)));
        Self {
            rx,
            _reader: reader,
            done: false,
        }
    }

    /// The next event, in the scheduler's terms; a broken stream (decode
    /// node gone) ends with `Failed`.
    pub async fn next(&mut self) -> Option<Event> {
        if self.done {
            return None;
        }
        let ev = match self.rx.recv().await.and_then(Buffered::take) {
            Some(ev) => ev,
            // The reader ends only after a final event, or if aborted.
            None => Event::Failed("decode stream reader stopped".into()),
        };
        if !matches!(ev, Event::Token(_)) {
            self.done = true;
        }
        Some(ev)
    }
}

/// Moves a decode node's messages into the egress backlog until the final
/// one, or until the client side goes away (then dropping `stream` cancels
/// the request on the decode node at once, even mid-wait).
async fn read_remote(
    mut stream: Streaming<pb::GenerateResponse>,
    vocab: usize,
    tx: mpsc::Sender<Buffered>,
) {
    loop {
        let msg = tokio::select! {
            () = tx.closed() => return,
            msg = stream.message() => msg,
        };
        let ev = remote_event(msg, vocab);
        let last = !matches!(ev, Event::Token(_));
        if tx.send(Buffered::new(ev)).await.is_err() || last {
            return;
        }
    }
}

/// A decode node's message (or the stream's end) in the scheduler's terms,
/// validated: anything malformed is a failure of the request.
fn remote_event(msg: Result<Option<pb::GenerateResponse>, tonic::Status>, vocab: usize) -> Event {
    use pb::generate_response::Kind;
    match msg {
        Ok(Some(pb::GenerateResponse {
            kind: Some(Kind::Token(t)),
        })) => match Sampled::try_from(t) {
            Ok(s) if (s.token as usize) < vocab => Event::Token(s),
            Ok(s) => Event::Failed(format!(
                "decode node sent token {} outside the vocabulary",
                s.token
            )),
            Err(e) => Event::Failed(format!("decode node sent a bad token: {e}")),
        },
        Ok(Some(pb::GenerateResponse {
            kind: Some(Kind::Finished(f)),
        })) => match finish_from_pb(f.finish) {
            Ok(finish) => Event::Finished(Usage {
                prompt_tokens: f.prompt_tokens as usize,
                completion_tokens: f.completion_tokens as usize,
                cached_tokens: f.cached_tokens as usize,
                finish,
            }),
            Err(e) => Event::Failed(format!("decode node sent a bad finish: {e}")),
        },
        Ok(Some(_)) => Event::Failed("decode node sent an empty message".into()),
        Ok(None) => Event::Failed("decode node closed the stream before finishing".into()),
        Err(s) => Event::Failed(format!("decode node failed: {}", s.message())),
    }
}

/// One request, routed.
#[derive(Debug)]
pub struct Placement {
    pub decode: String,
    pub prefill: Vec<String>,
}

impl Cluster {
    /// Applies a membership snapshot: adds new workers (after checking
    /// their records), drops vanished ones.
    fn sync(&self, snap: &Snapshot) {
        let mut workers = self.workers.write().unwrap_or_else(PoisonError::into_inner);
        workers.retain(|k, _| {
            let keep = snap.contains_key(k);
            if !keep {
                tracing::info!(role = k.0.as_str(), id = %k.1, "worker left");
            }
            keep
        });
        for (key, member) in snap.iter() {
            if workers.contains_key(key) {
                continue;
            }
            let record = match WorkerRecord::decode(&member.value) {
                Ok(r) if r.id == member.id && r.role == member.role.as_str() => r,
                Ok(_) => {
                    tracing::warn!(id = %member.id, "worker record disagrees with its key; ignored");
                    continue;
                }
                Err(e) => {
                    tracing::warn!(id = %member.id, error = %e, "bad worker record; ignored");
                    continue;
                }
            };
            if let Some(m) = self.fingerprint.mismatch(&record.fingerprint) {
                tracing::error!(id = %record.id, "incompatible worker ignored: {m}");
                continue;
            }
            let channel = match Endpoint::from_shared(record.grpc_endpoint.clone()) {
                Ok(e) => e
                    .connect_timeout(Duration::from_secs(2))
                    .tcp_nodelay(true)
                    .connect_lazy(),
                Err(e) => {
                    tracing::warn!(id = %record.id, error = %e, "bad worker endpoint; ignored");
                    continue;
                }
            };
            tracing::info!(role = member.role.as_str(), id = %record.id, endpoint = %record.grpc_endpoint, "worker joined");
            let w = Arc::new(Worker {
                record,
                role: member.role,
                channel,
                cached: Mutex::new(HashSet::new()),
                last_event: AtomicU64::new(0),
                waiting: AtomicUsize::new(0),
                kv_blocks_used: AtomicUsize::new(0),
                pending: AtomicUsize::new(0),
                events_task: Mutex::new(None),
            });
            let task = tokio::spawn(follow_events(Arc::downgrade(&w)));
            *w.events_task.lock().unwrap_or_else(PoisonError::into_inner) = Some(task);
            workers.insert(key.clone(), w);
        }
        record_workers(&workers);
    }

    /// Worker ids by role (for `/health` and tests).
    pub fn members(&self) -> (Vec<String>, Vec<String>) {
        let workers = self.workers.read().unwrap_or_else(PoisonError::into_inner);
        let ids = |r: Role| {
            workers
                .values()
                .filter(|w| w.role == r)
                .map(|w| w.record.id.clone())
                .collect()
        };
        (ids(Role::Prefill), ids(Role::Decode))
    }

    fn random(&self) -> u64 {
        // xorshift: tie-breaking needs no more.
        let mut x = self.rng.load(Ordering::Relaxed);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.rng.store(x, Ordering::Relaxed);
        x
    }

    /// Workers of `role` by ascending cost (random among equals), with
    /// their overlap.
    fn rank(
        &self,
        role: Role,
        hashes: &[BlockHash],
        prompt_blocks: usize,
    ) -> Vec<(Arc<Worker>, usize)> {
        let workers = self.workers.read().unwrap_or_else(PoisonError::into_inner);
        let mut scored: Vec<(f64, u64, Arc<Worker>, usize)> = workers
            .values()
            .filter(|w| w.role == role)
            .map(|w| {
                let overlap = w.overlap(hashes);
                let cost = w.cost(&self.routing, prompt_blocks, overlap);
                (cost, self.random(), Arc::clone(w), overlap)
            })
            .collect();
        scored.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        scored.into_iter().map(|(_, _, w, o)| (w, o)).collect()
    }

    /// Routes and starts one generation on a decode node.
    pub async fn generate(
        &self,
        prompt: Vec<u32>,
        sampling: SamplingParams,
        max_tokens: usize,
        stop_token_ids: Vec<u32>,
        vocab: usize,
        trace: TraceContext,
    ) -> Result<(RemoteStream, Placement), ApiError> {
        let m = metrics();
        let t0 = Instant::now();
        let hashes = block_hashes(&prompt, self.fingerprint.block_size);
        let prompt_blocks = prompt.len().div_ceil(self.fingerprint.block_size);
        let t1 = Instant::now();
        let decodes = self.rank(Role::Decode, &hashes, prompt_blocks);
        let prefills = self.rank(Role::Prefill, &hashes, prompt_blocks);
        let t2 = Instant::now();
        if decodes.is_empty() {
            return Err(ApiError::Unavailable(
                "No decode worker is available; retry later".into(),
            ));
        }
        let targets: Vec<PrefillTarget> = prefills
            .iter()
            .take(self.routing.prefill_candidates)
            .map(|(w, _)| PrefillTarget {
                worker_id: w.record.id.clone(),
                endpoint: w.record.grpc_endpoint.clone(),
            })
            .collect();
        let job = GenerateJob {
            prompt,
            sampling,
            max_tokens,
            stop_token_ids,
            prefill: targets,
        };
        let req = job.to_pb(&self.fingerprint);
        m.hashing.record((t1 - t0).as_secs_f64() * 1e6, &[]);
        m.lookup.record((t2 - t1).as_secs_f64() * 1e6, &[]);
        m.scheduling.record(t2.elapsed().as_secs_f64() * 1e6, &[]);
        let mut last_err = None;
        for (w, overlap) in decodes.iter().take(self.routing.decode_attempts) {
            let mut request = tonic::Request::new(req.clone());
            trace.inject(request.metadata_mut());
            let mut client = pb::decode_client::DecodeClient::new(w.channel.clone());
            w.pending.fetch_add(1, Ordering::Relaxed);
            let result = client.generate(request).await;
            w.pending.fetch_sub(1, Ordering::Relaxed);
            match result {
                Ok(resp) => {
                    m.overlap.record(*overlap as u64, &[]);
                    let placement = Placement {
                        decode: w.record.id.clone(),
                        prefill: job.prefill.iter().map(|t| t.worker_id.clone()).collect(),
                    };
                    let stream = RemoteStream::start(resp.into_inner(), vocab);
                    return Ok((stream, placement));
                }
                Err(s) if s.code() == Code::InvalidArgument => {
                    return Err(ApiError::invalid(s.message().to_string(), None));
                }
                Err(s) => {
                    tracing::warn!(worker = %w.record.id, code = ?s.code(), error = %s.message(), "decode worker refused; trying another");
                    last_err = Some(s);
                }
            }
        }
        let why = last_err.map_or_else(String::new, |s| s.message().to_string());
        Err(ApiError::Unavailable(format!(
            "No decode worker could take the request: {why}"
        )))
    }
}

/// Watches for membership changes (tests and `/health`).
pub type MembershipRx = watch::Receiver<Snapshot>;

#[cfg(test)]
mod tests {
    use super::*;

    fn worker() -> Worker {
        let fp = ModelFingerprint {
            model_id: "m".into(),
            weights_hash: 1,
            kv_dtype: "f16".into(),
            block_size: 4,
            kv_layout: "l".into(),
            num_layers: 1,
            num_kv_heads: 1,
            head_dim: 1,
        };
        Worker {
            record: WorkerRecord {
                id: "w".into(),
                role: "decode".into(),
                grpc_endpoint: "http://127.0.0.1:1".into(),
                metrics_endpoint: String::new(),
                fingerprint: fp,
                kv_blocks_total: 10,
                max_batch_size: 1,
                tp: 1,
                dp: 1,
            },
            role: Role::Decode,
            channel: Endpoint::from_static("http://127.0.0.1:1").connect_lazy(),
            cached: Mutex::new(HashSet::new()),
            last_event: AtomicU64::new(0),
            waiting: AtomicUsize::new(0),
            kv_blocks_used: AtomicUsize::new(0),
            pending: AtomicUsize::new(0),
            events_task: Mutex::new(None),
        }
    }

    fn stored(id: u64, hashes: Vec<u64>) -> pb::WorkerEvent {
        pb::WorkerEvent {
            event_id: id,
            kind: Some(pb::worker_event::Kind::Stored(pb::BlockStored {
                parent: None,
                hashes,
            })),
        }
    }

    #[tokio::test]
    async fn index_follows_events_and_detects_gaps() {
        let w = worker();
        assert!(w.apply(&stored(1, vec![10, 11, 12])));
        assert_eq!(w.overlap(&[10, 11, 12, 13]), 3);
        assert_eq!(w.overlap(&[99, 11, 12]), 0, "overlap is a prefix");
        assert!(w.apply(&pb::WorkerEvent {
            event_id: 2,
            kind: Some(pb::worker_event::Kind::Removed(pb::BlockRemoved {
                hashes: vec![11]
            })),
        }));
        assert_eq!(w.overlap(&[10, 11, 12]), 1);
        // A replayed event is ignored; a gap is reported.
        assert!(w.apply(&stored(2, vec![99])));
        assert_eq!(w.overlap(&[99]), 0);
        assert!(!w.apply(&stored(4, vec![5])));
        // After `cleared`, the view restarts from what follows.
        assert!(w.apply(&pb::WorkerEvent {
            event_id: 7,
            kind: Some(pb::worker_event::Kind::Cleared(pb::CacheCleared {})),
        }));
        assert_eq!(w.overlap(&[10]), 0);
        assert!(w.apply(&stored(8, vec![10])));
        assert_eq!(w.overlap(&[10]), 1);
    }

    #[tokio::test]
    async fn cost_prefers_overlap_then_light_load() {
        let cfg = RoutingConfig {
            prefill_weight: 1.0,
            queue_weight: 4.0,
            prefill_candidates: 2,
            decode_attempts: 2,
        };
        let w = worker();
        assert_eq!(w.cost(&cfg, 10, 0), 10.0);
        assert_eq!(w.cost(&cfg, 10, 6), 4.0);
        w.apply(&pb::WorkerEvent {
            event_id: 0,
            kind: Some(pb::worker_event::Kind::Load(pb::Load {
                waiting: 2,
                running: 1,
                kv_blocks_used: 5,
                kv_blocks_total: 10,
            })),
        });
        w.pending.store(1, Ordering::Relaxed);
        assert_eq!(w.cost(&cfg, 10, 6), 4.0 + 5.0 + 4.0 * 3.0);
        assert!(cfg.validate().is_ok());
        assert!(
            RoutingConfig {
                prefill_weight: -1.0,
                ..cfg.clone()
            }
            .validate()
            .is_err()
        );
        assert!(
            RoutingConfig {
                prefill_candidates: 0,
                ..cfg
            }
            .validate()
            .is_err()
        );
    }
}
