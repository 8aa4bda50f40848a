//! Decode role: a gRPC `Generate` service. For each request it looks up its
//! own prefix cache, reserves destination blocks for the rest of the prompt,
//! grants one prefill node (the router's ranked choices, in order) the right
//! to write exactly those blocks, asks it to compute and write them, and
//! meanwhile keeps decoding its other sequences. Short or mostly cached
//! prompts, and prefills that fail or stall past their deadline, are
//! prefilled here instead.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use opentelemetry::KeyValue;
use opentelemetry::metrics::Counter;
use tandem_dkv::Grant;
use tandem_engine::kv_cache::BlockId;
use tandem_engine::sampler::Sampled;
use tandem_engine::scheduler::{GenerateStream, ImportOutcome, ImportSlot, ImportStream};
use tandem_proto::trace::TraceContext;
use tandem_proto::{
    GenerateJob, KvRegion, PrefillJob, PrefillTarget, PrefixSource, finish_to_pb, pb,
};
use tandem_types::{GenEvent, GenFailure};
use tandem_worker::{NodeCore, WorkerError};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::task::TaskTracker;
use tonic::transport::Channel;
use tonic::{Code, Status};
use tracing::Instrument;

mod fetch;

use fetch::{FetchCost, Fetched};

/// Decode-side policy, validated at startup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeConfig {
    /// Prompts with fewer uncached tokens than this prefill here.
    pub remote_prefill_min_tokens: usize,
    /// Watchdog: a remote prefill (compute and transfer) that takes longer
    /// is abandoned and the prompt prefilled here.
    pub prefill_timeout: Duration,
    /// Longest a failed or abandoned transfer's blocks are kept out of use
    /// while a write its grant accepted is still landing (a rendezvous
    /// receive from a frozen peer); past it they are released anyway
    /// (logged, `tandem.decode.quarantine_expired`).
    pub quarantine_limit: Duration,
    /// Fetch a prompt's leading blocks from a peer the router names as
    /// holding them, when that is predicted cheaper than computing them.
    pub prefix_fetch: bool,
}

/// A [`DecodeConfig`] that cannot run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeConfigError {
    #[error("prefill timeout {got:?} must be between 1 ms and {max:?}")]
    PrefillTimeout { got: Duration, max: Duration },
    #[error("the quarantine limit must be at least 1 s")]
    QuarantineLimit,
}

impl DecodeConfig {
    pub fn validate(&self) -> Result<(), DecodeConfigError> {
        if self.prefill_timeout.is_zero() || self.prefill_timeout > tandem_proto::MAX_DEADLINE {
            return Err(DecodeConfigError::PrefillTimeout {
                got: self.prefill_timeout,
                max: tandem_proto::MAX_DEADLINE,
            });
        }
        if self.quarantine_limit.is_zero() {
            return Err(DecodeConfigError::QuarantineLimit);
        }
        Ok(())
    }
}

/// Every `outcome` of `tandem.decode.prefills`.
const PREFILL_OUTCOMES: [&str; 4] = ["local", "remote", "retried", "fallback"];

struct DecodeMetrics {
    /// Prefill placements, by `outcome` ([`PREFILL_OUTCOMES`]).
    prefills: Counter<u64>,
    /// Failed transfers whose blocks were held until no write was landing.
    quarantined: Counter<u64>,
    /// Quarantines released at the limit with a write still landing.
    quarantine_expired: Counter<u64>,
}

fn metrics() -> &'static DecodeMetrics {
    static M: OnceLock<DecodeMetrics> = OnceLock::new();
    M.get_or_init(|| {
        let meter = opentelemetry::global::meter("tandem");
        let m = DecodeMetrics {
            prefills: meter
                .u64_counter("tandem.decode.prefills")
                .with_description(
                    "Prompts by where they were prefilled: local (by policy), remote, \
                     retried (remote after a failed worker), fallback (local after remote failures)",
                )
                .build(),
            quarantined: meter
                .u64_counter("tandem.decode.quarantined")
                .with_description(
                    "Failed or abandoned KV transfers whose destination blocks were held \
                     until no write their grant accepted was still landing",
                )
                .build(),
            quarantine_expired: meter
                .u64_counter("tandem.decode.quarantine_expired")
                .with_description(
                    "Quarantined blocks released at --quarantine-limit-secs with a write \
                     still landing",
                )
                .build(),
        };
        // Every outcome exported at zero: alerts on the fallback rate see 0
        // rather than no series.
        for o in PREFILL_OUTCOMES {
            m.prefills.add(0, &[KeyValue::new("outcome", o)]);
        }
        m
    })
}

/// The grants of a transfer that failed in a way that may leave writes in
/// flight: its blocks stay out of use until every grant is revoked and
/// nothing it accepted is still landing.
#[derive(Debug, Clone)]
struct Tainted {
    worker_id: String,
    grants: Arc<[Grant]>,
}

/// Where a prompt's prefill ended up.
enum Placement {
    /// The import is complete (remote) or to be computed here, in its blocks.
    Done(ImportOutcome, String),
    /// A remote attempt failed in a way that may leave writes in flight:
    /// its blocks wait in quarantine. The other targets from the given
    /// index on are still to be tried, with fresh blocks.
    Tainted(Tainted, usize),
}

/// After a prefill node answers, how long its last bytes may take to land
/// here (they may still be in the network: the answer only says that our
/// transport has them queued, or the peer's does).
const LANDING_WAIT: Duration = Duration::from_secs(10);

#[derive(Debug, Clone)]
pub struct DecodeService {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    core: Arc<NodeCore>,
    config: DecodeConfig,
    channels: Mutex<HashMap<String, Channel>>,
    tasks: TaskTracker,
    fetch_cost: FetchCost,
}

type Outgoing = mpsc::Sender<Result<pb::GenerateResponse, Status>>;

/// A request as the scheduler took it: generating here, or waiting for
/// its prompt's KV.
enum Start {
    Local(GenerateStream),
    Import(ImportStream),
}

/// A failed remote prefill, and whether writes may still be in flight.
#[derive(Debug)]
struct Attempt {
    error: WorkerError,
    tainted: bool,
}

/// Whether a call failed because no connection could be made (so the
/// request never left): a refused or unroutable connect.
fn never_connected(status: &Status) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(status);
    while let Some(e) = cur {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            return matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionRefused
                    | std::io::ErrorKind::HostUnreachable
                    | std::io::ErrorKind::NetworkUnreachable
            );
        }
        cur = e.source();
    }
    false
}

impl DecodeService {
    pub fn new(core: Arc<NodeCore>, config: DecodeConfig) -> Self {
        Self {
            inner: Arc::new(Inner {
                core,
                config,
                channels: Mutex::new(HashMap::new()),
                tasks: TaskTracker::new(),
                fetch_cost: FetchCost::new(),
            }),
        }
    }

    pub fn into_server(self) -> pb::decode_server::DecodeServer<Self> {
        pb::decode_server::DecodeServer::new(self)
    }

    /// Waits (up to `grace`) for every request's task to end; call after
    /// the gRPC server stopped accepting.
    pub async fn drain(&self, grace: Duration) {
        self.inner.tasks.close();
        if tokio::time::timeout(grace, self.inner.tasks.wait())
            .await
            .is_err()
        {
            tracing::warn!("decode tasks still running after {grace:?}");
        }
    }
}

impl Inner {
    fn channel(&self, endpoint: &str) -> Result<Channel, WorkerError> {
        let mut map = self.channels.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(c) = map.get(endpoint) {
            return Ok(c.clone());
        }
        let ch = self
            .core
            .peers
            .endpoint(endpoint)
            .map_err(|e| WorkerError::Internal(format!("prefill endpoint: {e}")))?
            .connect_lazy();
        map.insert(endpoint.to_string(), ch.clone());
        Ok(ch)
    }

    fn forget_channel(&self, endpoint: &str) {
        self.channels
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(endpoint);
    }

    /// Runs one request: the handoff (if any), then streams its tokens.
    async fn drive(
        self: Arc<Self>,
        job: GenerateJob,
        start: Start,
        out: Outgoing,
        trace: TraceContext,
    ) {
        let (mut stream, mut prefill_worker) = match start {
            Start::Local(stream) => (stream, String::new()),
            Start::Import(stream) => match self.handoff(&job, stream, &out, &trace).await {
                Some(started) => started,
                None => return,
            },
        };
        loop {
            let ev = tokio::select! {
                ev = stream.next() => ev,
                // The router went away: dropping `stream` cancels.
                () = out.closed() => return,
            };
            let msg = match ev {
                Some(GenEvent::Token(s)) => Ok(pb::GenerateResponse {
                    kind: Some(pb::generate_response::Kind::Token((&s).into())),
                }),
                Some(GenEvent::Finished(u)) => Ok(pb::GenerateResponse {
                    kind: Some(pb::generate_response::Kind::Finished(pb::Finished {
                        prompt_tokens: u.prompt_tokens as u32,
                        completion_tokens: u.completion_tokens as u32,
                        cached_tokens: u.cached_tokens as u32,
                        finish: finish_to_pb(u.finish) as i32,
                        prefill_worker: std::mem::take(&mut prefill_worker),
                    })),
                }),
                Some(GenEvent::Failed(f)) => Err(ended(Some(f))),
                None => Err(ended(None)),
            };
            let last = !matches!(
                &msg,
                Ok(pb::GenerateResponse {
                    kind: Some(pb::generate_response::Kind::Token(_))
                })
            );
            if out.send(msg).await.is_err() || last {
                return;
            }
        }
    }

    /// Places an import's prefill (on the router's prefill nodes in turn,
    /// or here) and completes it: its token stream and the prefill worker
    /// that served it (empty when prefilled here). `None` when the request
    /// ended meanwhile (what the router is owed was sent).
    async fn handoff(
        self: &Arc<Self>,
        job: &GenerateJob,
        mut stream: ImportStream,
        out: &Outgoing,
        trace: &TraceContext,
    ) -> Option<(GenerateStream, String)> {
        // However many targets the router named, the prompt waits for
        // remote prefills at most this long in total.
        let budget = Instant::now() + 2 * self.config.prefill_timeout;
        let mut from = 0;
        // A peer's prefix is fetched on the first attempt only.
        let mut source = job.prefix_source.as_ref();
        loop {
            let slot = match stream.slot().await {
                Some(Ok(slot)) => slot,
                Some(Err(f)) => {
                    let _ = out.send(Err(ended(Some(f)))).await;
                    return None;
                }
                None => {
                    let _ = out.send(Err(ended(None))).await;
                    return None;
                }
            };
            let attempt = Mutex::new(None);
            let placed = tokio::select! {
                placed = self.place_prefill(job, &slot, trace, &attempt, from, budget, source.take()) => placed,
                () = out.closed() => {
                    // The router went away mid-prefill: dropping the
                    // call cancels it; the grants are revoked and the
                    // blocks wait until nothing accepted is landing.
                    let pending = attempt.lock().unwrap_or_else(PoisonError::into_inner).take();
                    if let Some(tainted) = pending {
                        self.quarantine(stream, tainted);
                    }
                    return None;
                }
            };
            match placed {
                Placement::Done(outcome, worker) => {
                    return Some((stream.complete(outcome), worker));
                }
                Placement::Tainted(tainted, next) => {
                    // Go on in fresh blocks (the prefix-cache lookup
                    // again); the tainted ones stay reserved until
                    // nothing is landing in them.
                    match self.core.scheduler.import(job.request.clone()) {
                        Ok(fresh) => {
                            let old = std::mem::replace(&mut stream, fresh);
                            self.quarantine(old, tainted);
                            from = next;
                        }
                        Err(e) => {
                            self.quarantine(stream, tainted);
                            let _ = out.send(Err(WorkerError::from(e).into())).await;
                            return None;
                        }
                    }
                }
            }
        }
    }

    /// Fetches what a peer holds of the prompt's prefix (if the router
    /// named one), then decides where the rest is prefilled and, if
    /// remotely, runs it. Returns the outcome and the prefill worker that
    /// served it (empty when prefilled here).
    #[allow(clippy::too_many_arguments)]
    async fn place_prefill(
        &self,
        job: &GenerateJob,
        slot: &ImportSlot,
        trace: &TraceContext,
        attempt: &Mutex<Option<Tainted>>,
        from: usize,
        budget: Instant,
        source: Option<&PrefixSource>,
    ) -> Placement {
        // A prefill node that holds the prefix serves it with the prefill.
        let fetched = match source {
            Some(src)
                if job
                    .prefill
                    .first()
                    .is_none_or(|t| t.worker_id != src.worker_id) =>
            {
                match self.fetch_prefix(job, slot, src, trace, attempt).await {
                    Fetched::Blocks(n) => n,
                    Fetched::Tainted(t) => return Placement::Tainted(t, from),
                }
            }
            _ => 0,
        };
        let slot = &ImportSlot {
            blocks: slot.blocks.clone(),
            cached_blocks: slot.cached_blocks + fetched,
        };
        let block_size = self.core.fingerprint.block_size;
        let uncached = job
            .request
            .prompt
            .len()
            .saturating_sub(slot.cached_blocks * block_size);
        let outcome = |o: &'static str| metrics().prefills.add(1, &[KeyValue::new("outcome", o)]);
        if uncached < self.config.remote_prefill_min_tokens || job.prefill.is_empty() {
            outcome("local");
            let local = ImportOutcome::PrefillLocally {
                fetched_blocks: fetched,
            };
            return Placement::Done(local, String::new());
        }
        for (i, target) in job.prefill.iter().enumerate().skip(from) {
            if i > 0 && Instant::now() >= budget {
                break;
            }
            let grants = match self.grant(&slot.blocks[slot.cached_blocks..]) {
                Ok(g) => g,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot grant the prompt's blocks; prefilling here");
                    break;
                }
            };
            let pending = Tainted {
                worker_id: target.worker_id.clone(),
                grants,
            };
            let set = |t: Option<Tainted>| {
                *attempt.lock().unwrap_or_else(PoisonError::into_inner) = t;
            };
            set(Some(pending.clone()));
            let result = self
                .remote_prefill(job, slot, target, trace, &pending.grants)
                .await;
            set(None);
            match result {
                Ok((first, remote_cached_tokens)) => {
                    outcome(if i == 0 { "remote" } else { "retried" });
                    // Fetched tokens, too, were computed by no one here.
                    let ready = ImportOutcome::Ready {
                        first,
                        remote_cached_tokens: remote_cached_tokens
                            .max(slot.cached_blocks * block_size),
                    };
                    return Placement::Done(ready, target.worker_id.clone());
                }
                Err(Attempt { error, tainted }) => {
                    tracing::warn!(worker = %target.worker_id, error = %error, tainted, "remote prefill failed");
                    self.forget_channel(&target.endpoint);
                    if tainted {
                        return Placement::Tainted(pending, i + 1);
                    }
                }
            }
        }
        outcome("fallback");
        let local = ImportOutcome::PrefillLocally {
            fetched_blocks: fetched,
        };
        Placement::Done(local, String::new())
    }

    /// Grants `blocks` on every rank's pool, for one attempt; expiring a
    /// little after the attempt's deadline.
    fn grant(&self, blocks: &[BlockId]) -> Result<Arc<[Grant]>, WorkerError> {
        let core = &self.core;
        let block = core.layout.block_bytes;
        let ranges: Vec<std::ops::Range<u64>> = blocks
            .iter()
            .map(|&b| u64::from(b) * block..(u64::from(b) + 1) * block)
            .collect();
        let expires = Instant::now() + self.config.prefill_timeout + LANDING_WAIT;
        std::iter::once(&*core.region)
            .chain(core.peer_regions.iter())
            .map(|r| r.grant(&ranges, expires).map_err(WorkerError::Transfer))
            .collect()
    }

    /// Keeps `stream` (and so its blocks) until the transfer's grants are
    /// revoked and nothing they accepted is still landing; past the
    /// quarantine limit the blocks are released anyway.
    fn quarantine(self: &Arc<Self>, stream: ImportStream, tainted: Tainted) {
        metrics().quarantined.add(1, &[]);
        let limit = self.config.quarantine_limit;
        let task = async move {
            let revoked = async {
                for g in tainted.grants.iter() {
                    g.revoke().await;
                }
            };
            if tokio::time::timeout(limit, revoked).await.is_err() {
                metrics().quarantine_expired.add(1, &[]);
                tracing::warn!(
                    worker = %tainted.worker_id,
                    "a write from this prefill node was still landing after {limit:?}; \
                     releasing its blocks anyway"
                );
            }
            drop(stream);
        };
        self.tasks.spawn(task.in_current_span());
    }

    /// What a peer needs to write under `grants`, one region per rank.
    fn regions(&self, grants: &[Grant]) -> Vec<KvRegion> {
        let connector = self.core.dkv.connector();
        grants
            .iter()
            .map(|g| {
                let d = g.descriptor();
                KvRegion {
                    worker_address: d.worker_address,
                    grant: d.grant,
                    len: d.len,
                    connector: connector.to_string(),
                }
            })
            .collect()
    }

    /// Asks one prefill node; a stalled call is abandoned at the deadline.
    async fn remote_prefill(
        &self,
        job: &GenerateJob,
        slot: &ImportSlot,
        target: &PrefillTarget,
        trace: &TraceContext,
        grants: &[Grant],
    ) -> Result<(Sampled, usize), Attempt> {
        let core = &self.core;
        let regions = self.regions(grants);
        let deadline = self.config.prefill_timeout;
        let req = PrefillJob {
            prompt: job.request.prompt.clone(),
            sampling: job.request.sampling.clone(),
            skip_blocks: slot.cached_blocks,
            dst_blocks: slot.blocks[slot.cached_blocks..].to_vec(),
            regions,
            deadline,
            constraint: job.request.constraint.clone(),
        }
        .to_pb(&core.fingerprint);
        let mut request = tonic::Request::new(req);
        trace.inject(request.metadata_mut());
        request.set_timeout(deadline);
        // Nothing was sent yet: the blocks are untouched.
        let clean = |error| Attempt {
            error,
            tainted: false,
        };
        let tainted = |error| Attempt {
            error,
            tainted: true,
        };
        let channel = self.channel(&target.endpoint).map_err(clean)?;
        let mut client = pb::prefill_client::PrefillClient::new(channel);
        let watchdog = |what: &str| {
            tandem_dkv::metrics()
                .watchdog_firings
                .add(1, &[KeyValue::new("connector", core.dkv.connector())]);
            WorkerError::Deadline(format!(
                "{what} from {} after {deadline:?}",
                target.worker_id
            ))
        };
        // A little slack so the prefill node's own deadline fires first and
        // it stops writing before we give up on it.
        let resp = match tokio::time::timeout(
            deadline + Duration::from_millis(250),
            client.prefill(request),
        )
        .await
        {
            Ok(Ok(r)) => r.into_inner(),
            Ok(Err(status)) => {
                if status.code() == Code::DeadlineExceeded || status.code() == Code::Cancelled {
                    return Err(tainted(watchdog("prefill stalled")));
                }
                let e = WorkerError::Internal(format!(
                    "prefill node {} answered {:?}: {}",
                    target.worker_id,
                    status.code(),
                    status.message()
                ));
                // Refused before anything was written (an incompatible
                // peer, or no connection at all); any other failure may
                // leave writes in flight.
                return Err(
                    if status.code() == Code::FailedPrecondition || never_connected(&status) {
                        clean(e)
                    } else {
                        tainted(e)
                    },
                );
            }
            Err(_) => return Err(tainted(watchdog("no prefill answer"))),
        };
        // The answer says the prefill node sent everything; the grants say
        // whether it all landed here (only then are the blocks usable).
        let landing = Instant::now() + LANDING_WAIT;
        for g in grants {
            g.complete(landing).await.map_err(|e| {
                tainted(WorkerError::Deadline(format!(
                    "KV from {} did not all land ({} of {} bytes): {e}",
                    target.worker_id,
                    g.landed(),
                    g.total()
                )))
            })?;
        }
        let first = resp
            .first
            .ok_or_else(|| WorkerError::Internal("prefill response without a first token".into()))
            .and_then(|f| Sampled::try_from(f).map_err(WorkerError::from))
            .map_err(clean)?;
        let vocab = core.model.config().vocab_size;
        if first.token as usize >= vocab {
            return Err(clean(WorkerError::Internal(format!(
                "prefill node sent token {} outside the vocabulary",
                first.token
            ))));
        }
        Ok((first, resp.cached_tokens as usize))
    }
}

/// How a request that ended without finishing is told to the router:
/// `failure`, or the scheduler gone.
fn ended(failure: Option<GenFailure>) -> Status {
    match failure {
        None => Status::unavailable("the scheduler stopped"),
        Some(f) => Status::from(WorkerError::Failed(f)),
    }
}

#[tonic::async_trait]
impl pb::decode_server::Decode for DecodeService {
    type GenerateStream = ReceiverStream<Result<pb::GenerateResponse, Status>>;

    async fn generate(
        &self,
        req: tonic::Request<pb::GenerateRequest>,
    ) -> Result<tonic::Response<Self::GenerateStream>, Status> {
        let inner = &self.inner;
        let core = &inner.core;
        if core.is_draining() {
            return Err(Status::unavailable("decode node is shutting down"));
        }
        let span = tracing::info_span!(
            "generate",
            trace_id = tracing::field::Empty,
            prompt_tokens = req.get_ref().prompt.len() as i64,
        );
        let trace = TraceContext::start_hop(&span, TraceContext::from_metadata(req.metadata()));
        let job = GenerateJob::validate(req.into_inner(), &core.fingerprint)
            .map_err(|e| Status::from(WorkerError::from(e)))?;
        // A prompt whose prefix a peer holds waits for it as an import.
        let start = if job.prefill.is_empty() && job.prefix_source.is_none() {
            core.scheduler
                .generate(job.request.clone())
                .map(Start::Local)
        } else {
            core.scheduler
                .import(job.request.clone())
                .map(Start::Import)
        }
        .map_err(|e| Status::from(WorkerError::from(e)))?;
        let (tx, rx) = mpsc::channel(64);
        let task = Arc::clone(inner).drive(job, start, tx, trace);
        inner.tasks.spawn(task.instrument(span));
        Ok(tonic::Response::new(ReceiverStream::new(rx)))
    }
}
