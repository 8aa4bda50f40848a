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
use std::time::Instant;

use futures_util::future::BoxFuture;
use opentelemetry::metrics::{Histogram, UpDownCounter};
use tandem_discovery::{EtcdConfig, Membership, Role, Snapshot};
use tandem_frontend::{Backend, BackendHealth, BackendRequest, GenerationStream, SubmitError};
use tandem_proto::tls::PeerConnector;
use tandem_proto::{
    GenerateJob, PrefillTarget, WorkerRecord, failure_from_status, finish_from_pb, pb,
};
use tandem_types::egress;
use tandem_types::{
    BlockHash, GenEvent as Event, GenFailure, ModelFingerprint, RequestLimits, Sampled, Usage,
    block_hashes,
};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tonic::transport::Channel;
use tonic::{Code, Streaming};

mod probation;

use probation::{Census, Standing};

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
        if self.prefill_candidates > tandem_proto::MAX_PREFILL_TARGETS {
            return Err(format!(
                "prefill candidates must be at most {} (what a decode node accepts)",
                tandem_proto::MAX_PREFILL_TARGETS
            ));
        }
        Ok(())
    }
}

struct ClusterMetrics {
    hashing: Histogram<f64>,
    lookup: Histogram<f64>,
    scheduling: Histogram<f64>,
    overlap: Histogram<u64>,
    event_lag: Histogram<f64>,
    index_blocks: UpDownCounter<i64>,
    index_bytes: UpDownCounter<i64>,
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
            event_lag: m
                .f64_histogram("tandem.router.event_lag")
                .with_description(
                    "Time from a worker emitting a cache event to this router applying it",
                )
                .with_unit("ms")
                .with_boundaries(vec![
                    0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 500.0, 2000.0,
                ])
                .build(),
            index_blocks: m
                .i64_up_down_counter("tandem.router.prefix_index_blocks")
                .with_description("Cached blocks the prefix index holds, over every worker")
                .build(),
            index_bytes: m
                .i64_up_down_counter("tandem.router.prefix_index_bytes")
                .with_description("Memory of the prefix index's hash sets (their capacity)")
                .with_unit("By")
                .build(),
        }
    })
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
    /// Routable, or on probation (`probation.rs`).
    standing: Standing,
    events_task: Mutex<Option<JoinHandle<()>>>,
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Its index leaves with it.
        let cached = self
            .cached
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        let m = metrics();
        m.index_blocks.add(-(cached.len() as i64), &[]);
        m.index_bytes.add(-(index_bytes(cached) as i64), &[]);
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
        let (len0, bytes0) = (cached.len(), index_bytes(&cached));
        let m = metrics();
        if e.emitted_unix_us > 0 {
            let now = tandem_types::clock::unix_micros();
            m.event_lag
                .record(now.saturating_sub(e.emitted_unix_us) as f64 / 1e3, &[]);
        }
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
        m.index_blocks.add(cached.len() as i64 - len0 as i64, &[]);
        m.index_bytes
            .add(index_bytes(&cached) as i64 - bytes0 as i64, &[]);
        self.last_event.store(e.event_id, Ordering::Relaxed);
        true
    }
}

/// A hash set's table: a hash and a control byte per slot.
fn index_bytes(set: &HashSet<BlockHash>) -> usize {
    set.capacity() * (std::mem::size_of::<BlockHash>() + 1)
}

/// Live membership and routing state.
#[derive(Debug)]
pub struct Cluster {
    fingerprint: ModelFingerprint,
    routing: RoutingConfig,
    /// How workers are dialled: under mutual TLS a worker is used only over
    /// a connection on which it proved its identity.
    peers: PeerConnector,
    workers: RwLock<BTreeMap<(Role, String), Arc<Worker>>>,
    /// Workers by role and standing (the worker gauges).
    census: Arc<Census>,
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
        peers: PeerConnector,
    ) -> Result<Self, String> {
        let membership = Membership::watch(etcd)
            .await
            .map_err(|e| format!("watching workers in etcd: {e}"))?;
        let cluster = Arc::new(Cluster {
            fingerprint,
            routing,
            peers,
            workers: RwLock::new(BTreeMap::new()),
            census: Arc::default(),
            rng: AtomicU64::new(0x2545_f491_4f6c_dd1d),
        });
        cluster.census.publish();
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

    /// The next event; a broken stream (decode node gone) ends with
    /// `Failed`.
    pub async fn recv(&mut self) -> Option<Event> {
        if self.done {
            return None;
        }
        let ev = match self.rx.recv().await.and_then(Buffered::take) {
            Some(ev) => ev,
            // The reader ends only after a final event, or if aborted.
            None => Event::Failed(GenFailure::Internal("decode stream reader stopped".into())),
        };
        if !matches!(ev, Event::Token(_)) {
            self.done = true;
        }
        Some(ev)
    }
}

impl GenerationStream for RemoteStream {
    fn next(&mut self) -> BoxFuture<'_, Option<Event>> {
        Box::pin(self.recv())
    }
}

/// The front end's [`Backend`] over a cluster: routes each request to a
/// decode node (and its prefill candidates) and streams its tokens back.
#[derive(Debug, Clone)]
pub struct ClusterBackend {
    cluster: Arc<Cluster>,
    limits: RequestLimits,
}

impl ClusterBackend {
    /// `limits.max_length` is the decode nodes' `--max-length`.
    pub fn new(cluster: Arc<Cluster>, limits: RequestLimits) -> Self {
        Self { cluster, limits }
    }
}

impl Backend for ClusterBackend {
    fn limits(&self) -> RequestLimits {
        self.limits
    }

    fn submit(
        &self,
        req: BackendRequest,
    ) -> BoxFuture<'_, Result<Box<dyn GenerationStream>, SubmitError>> {
        Box::pin(async move {
            let (stream, placement) = self.cluster.generate(req, self.limits.vocab_size).await?;
            tracing::debug!(decode = %placement.decode, prefill = ?placement.prefill, "routed");
            Ok(Box::new(stream) as Box<dyn GenerationStream>)
        })
    }

    fn health(&self) -> BackendHealth {
        let (prefill, decode) = self.cluster.members();
        let ready = !decode.is_empty();
        let mut details = serde_json::Map::new();
        details.insert("prefill_workers".into(), prefill.into());
        details.insert("decode_workers".into(), decode.into());
        let (total, listed) = probation::health_report(&self.cluster.workers);
        details.insert("probation_total".into(), total.into());
        details.insert("probation_workers".into(), listed.into());
        BackendHealth {
            ready,
            reason: "no decode workers",
            details,
        }
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
            Ok(s) => Event::Failed(GenFailure::Internal(format!(
                "decode node sent token {} outside the vocabulary",
                s.token
            ))),
            Err(e) => Event::Failed(GenFailure::Internal(format!(
                "decode node sent a bad token: {e}"
            ))),
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
            Err(e) => Event::Failed(GenFailure::Internal(format!(
                "decode node sent a bad finish: {e}"
            ))),
        },
        Ok(Some(_)) => Event::Failed(GenFailure::Internal(
            "decode node sent an empty message".into(),
        )),
        Ok(None) => Event::Failed(GenFailure::Unavailable(
            "decode node closed the stream before finishing".into(),
        )),
        Err(s) => Event::Failed(failure_from_status(&s)),
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
            let channel = match self.peers.endpoint(&record.grpc_endpoint) {
                Ok(e) => e.connect_lazy(),
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
                standing: Standing::new(member.role, Arc::clone(&self.census)),
                events_task: Mutex::new(None),
            });
            let task = tokio::spawn(probation::follow_events(Arc::downgrade(&w)));
            *w.events_task.lock().unwrap_or_else(PoisonError::into_inner) = Some(task);
            workers.insert(key.clone(), w);
        }
    }

    /// Ids of the workers routed to, by role (for `/health` and tests).
    pub fn members(&self) -> (Vec<String>, Vec<String>) {
        let workers = self.workers.read().unwrap_or_else(PoisonError::into_inner);
        let ids = |r: Role| {
            workers
                .values()
                .filter(|w| w.role == r && w.standing.is_ready())
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

    /// Ready workers of `role` (none on probation) by ascending cost
    /// (random among equals), with their overlap.
    fn rank(
        &self,
        role: Role,
        hashes: &[BlockHash],
        prompt_blocks: usize,
    ) -> Vec<(Arc<Worker>, usize)> {
        let workers = self.workers.read().unwrap_or_else(PoisonError::into_inner);
        let mut scored: Vec<(f64, u64, Arc<Worker>, usize)> = workers
            .values()
            .filter(|w| w.role == role && w.standing.is_ready())
            .map(|w| {
                let overlap = w.overlap(hashes);
                let cost = w.cost(&self.routing, prompt_blocks, overlap);
                (cost, self.random(), Arc::clone(w), overlap)
            })
            .collect();
        scored.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        scored.into_iter().map(|(_, _, w, o)| (w, o)).collect()
    }

    /// Routes and starts one generation on a decode node. `req` has
    /// passed the front end's checks; `vocab` bounds the tokens it returns.
    pub async fn generate(
        &self,
        req: BackendRequest,
        vocab: usize,
    ) -> Result<(RemoteStream, Placement), SubmitError> {
        let BackendRequest {
            prompt,
            sampling,
            max_tokens,
            stop_token_ids,
            constraint,
            trace,
        } = req;
        let m = metrics();
        let t0 = Instant::now();
        let hashes = block_hashes(&prompt, self.fingerprint.block_size);
        let prompt_blocks = prompt.len().div_ceil(self.fingerprint.block_size);
        let t1 = Instant::now();
        let decodes = self.rank(Role::Decode, &hashes, prompt_blocks);
        let prefills = self.rank(Role::Prefill, &hashes, prompt_blocks);
        let t2 = Instant::now();
        if decodes.is_empty() {
            return Err(
                GenFailure::Unavailable("no verified decode worker is available".into()).into(),
            );
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
            constraint,
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
                    return Err(failure_from_status(&s).into());
                }
                Err(s) => {
                    tracing::warn!(worker = %w.record.id, code = ?s.code(), error = %s.message(), "decode worker refused; trying another");
                    last_err = Some(s);
                }
            }
        }
        let why = last_err.map_or_else(String::new, |s| s.message().to_string());
        Err(
            GenFailure::Unavailable(format!("no decode worker could take the request: {why}"))
                .into(),
        )
    }
}

/// Watches for membership changes (tests and `/health`).
pub type MembershipRx = watch::Receiver<Snapshot>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;
    use std::pin::Pin;
    use std::time::Duration;

    use futures_util::Stream;
    use tandem_proto::trace::TraceContext;
    use tandem_types::SamplingParams;
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
            prefill_weight: 1.0,
            queue_weight: 4.0,
            prefill_candidates: 2,
            decode_attempts: 2,
        }
    }

    /// What the router would know of a worker: the prompt blocks its cache
    /// holds (by hash) and its load.
    struct Spec<'a> {
        id: &'a str,
        role: Role,
        endpoint: String,
        cached: Vec<BlockHash>,
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
            cached: Mutex::new(s.cached.iter().copied().collect()),
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
            routing,
            peers: PeerConnector::default(),
            workers: RwLock::new(workers),
            census: Arc::default(),
            rng: AtomicU64::new(0x2545_f491_4f6c_dd1d),
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
            .map(|(w, o)| (w.record.id.clone(), *o))
            .collect()
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
        assert_eq!(w.overlap(&[10, 11, 12, 13]), 3);
        assert_eq!(w.overlap(&[99, 11, 12]), 0, "overlap is a prefix");
        assert!(w.apply(&pb::WorkerEvent {
            event_id: 2,
            kind: Some(pb::worker_event::Kind::Removed(pb::BlockRemoved {
                hashes: vec![11]
            })),
            ..Default::default()
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
            ..Default::default()
        }));
        assert_eq!(w.overlap(&[10]), 0);
        assert!(w.apply(&stored(8, vec![10])));
        assert_eq!(w.overlap(&[10]), 1);
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
            prompt: prompt.to_vec(),
            sampling: SamplingParams::greedy(),
            max_tokens: 4,
            stop_token_ids: Vec::new(),
            constraint: None,
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
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }
}
