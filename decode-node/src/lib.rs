//! Decode role: a gRPC `Generate` service. For each request it looks up its
//! own prefix cache, reserves destination blocks for the rest of the prompt,
//! asks a prefill node (the router's ranked choices, in order) to compute
//! and write them, and meanwhile keeps decoding its other sequences. Short
//! or mostly cached prompts, and prefills that fail or stall past their
//! deadline, are prefilled here instead.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use opentelemetry::KeyValue;
use opentelemetry::metrics::Counter;
use tandem_engine::sampler::Sampled;
use tandem_engine::scheduler::{
    Event, ImportOutcome, ImportSlot, KvHandoff, Request, RequestStream,
};
use tandem_proto::trace::TraceContext;
use tandem_proto::{GenerateJob, KvRegion, PrefillJob, PrefillTarget, finish_to_pb, pb};
use tandem_worker::{NodeCore, WorkerError};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::task::TaskTracker;
use tonic::transport::Channel;
use tonic::{Code, Status};
use tracing::Instrument;

/// Decode-side policy, validated at startup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeConfig {
    /// Prompts with fewer uncached tokens than this prefill here.
    pub remote_prefill_min_tokens: usize,
    /// Watchdog: a remote prefill (compute and transfer) that takes longer
    /// is abandoned and the prompt prefilled here.
    pub prefill_timeout: Duration,
    /// Longest a failed or abandoned transfer's blocks are kept out of use
    /// while its prefill node cannot confirm (`Fence`) that none of its
    /// writes can land any more; past it they are released anyway (logged,
    /// `tandem.decode.quarantine_expired`).
    pub fence_limit: Duration,
}

impl DecodeConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.prefill_timeout.is_zero() || self.prefill_timeout > tandem_proto::MAX_DEADLINE {
            return Err(format!(
                "prefill timeout {:?} must be between 1 ms and {:?}",
                self.prefill_timeout,
                tandem_proto::MAX_DEADLINE
            ));
        }
        if self.fence_limit.is_zero() {
            return Err("the fence limit must be at least 1 s".into());
        }
        Ok(())
    }
}

struct DecodeMetrics {
    /// Prefill placements, by `outcome` (local|remote|retried|fallback).
    prefills: Counter<u64>,
    /// Transfers whose blocks were quarantined until fenced.
    quarantined: Counter<u64>,
    /// Quarantines released at the fence limit, unfenced.
    quarantine_expired: Counter<u64>,
}

fn metrics() -> &'static DecodeMetrics {
    static M: OnceLock<DecodeMetrics> = OnceLock::new();
    M.get_or_init(|| {
        let m = opentelemetry::global::meter("tandem");
        DecodeMetrics {
            prefills: m
                .u64_counter("tandem.decode.prefills")
                .with_description(
                    "Prompts by where they were prefilled: local (by policy), remote, \
                     retried (remote after a failed worker), fallback (local after remote failures)",
                )
                .build(),
            quarantined: m
                .u64_counter("tandem.decode.quarantined")
                .with_description(
                    "Failed or abandoned KV transfers whose destination blocks were held \
                     until the prefill node fenced them",
                )
                .build(),
            quarantine_expired: m
                .u64_counter("tandem.decode.quarantine_expired")
                .with_description(
                    "Quarantined blocks released at --fence-limit-secs without a fence",
                )
                .build(),
        }
    })
}

/// A transfer that may still be writing into a request's blocks, and where
/// to fence it.
#[derive(Debug, Clone)]
struct Fence {
    worker_id: String,
    endpoint: String,
    transfer_id: u64,
}

/// Where a prompt's prefill ended up.
enum Placement {
    /// The import is complete (remote) or to be computed here, in its blocks.
    Done(ImportOutcome, String),
    /// A remote attempt failed in a way that may leave writes in flight: its
    /// blocks cannot be trusted until fenced. The other targets from the
    /// given index on are still to be tried, with fresh blocks.
    Tainted(Fence, usize),
}

/// Transfer ids: unique across the decode nodes that share a prefill node
/// (a random base per process, then a counter; never 0).
fn next_transfer_id() -> u64 {
    use std::hash::BuildHasher;
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: OnceLock<AtomicU64> = OnceLock::new();
    let next = NEXT.get_or_init(|| {
        let base = std::collections::hash_map::RandomState::new().hash_one(std::process::id());
        AtomicU64::new(base)
    });
    loop {
        let id = next.fetch_add(1, Ordering::Relaxed);
        if id != 0 {
            return id;
        }
    }
}

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
}

type Outgoing = mpsc::Sender<Result<pb::GenerateResponse, Status>>;

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

/// After finding a prefill node gone (connection refused), how long its
/// transfer's blocks stay quarantined for bytes its dead sockets still
/// held to arrive.
const PEER_GONE_SETTLE: Duration = Duration::from_secs(2);

/// How long one `Fence` call may take (the prefill node waits up to 10 s for
/// the transfer to stop and 10 s per endpoint flush).
const FENCE_CALL_TIMEOUT: Duration = Duration::from_secs(30);

impl DecodeService {
    pub fn new(core: Arc<NodeCore>, config: DecodeConfig) -> Self {
        Self {
            inner: Arc::new(Inner {
                core,
                config,
                channels: Mutex::new(HashMap::new()),
                tasks: TaskTracker::new(),
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

    /// Runs one request: the handoff (if any), then streams its events.
    async fn drive(
        self: Arc<Self>,
        job: GenerateJob,
        mut stream: RequestStream,
        out: Outgoing,
        trace: TraceContext,
    ) {
        let mut prefill_worker = String::new();
        if !job.prefill.is_empty() {
            // However many targets the router named, the prompt waits for
            // remote prefills at most this long in total.
            let budget = Instant::now() + 2 * self.config.prefill_timeout;
            let mut from = 0;
            loop {
                let slot = match stream.next().await {
                    Some(Event::ImportReady(slot)) => slot,
                    other => {
                        let _ = out.send(Err(event_status(other))).await;
                        return;
                    }
                };
                let attempt = Mutex::new(None);
                let placed = tokio::select! {
                    placed = self.place_prefill(&job, &slot, &trace, &attempt, from, budget) => placed,
                    () = out.closed() => {
                        // The router went away mid-prefill: dropping the
                        // call cancels it, but writes already under way may
                        // still land, so the blocks wait for the fence.
                        let pending = attempt.lock().unwrap_or_else(PoisonError::into_inner).take();
                        if let Some(fence) = pending {
                            self.quarantine(stream, fence);
                        }
                        return;
                    }
                };
                match placed {
                    Placement::Done(outcome, worker) => {
                        prefill_worker = worker;
                        stream.complete_import(outcome);
                        break;
                    }
                    Placement::Tainted(fence, next) => {
                        // Go on in fresh blocks (the prefix-cache lookup
                        // again); the tainted ones stay reserved until the
                        // prefill node fences them.
                        let fresh = self.core.scheduler.submit(Request {
                            prompt: job.prompt.clone(),
                            sampling: job.sampling.clone(),
                            max_tokens: job.max_tokens,
                            stop_token_ids: job.stop_token_ids.clone(),
                            handoff: KvHandoff::Import,
                            constraint: job.constraint.clone(),
                        });
                        match fresh {
                            Ok(fresh) => {
                                let old = std::mem::replace(&mut stream, fresh);
                                self.quarantine(old, fence);
                                from = next;
                            }
                            Err(e) => {
                                self.quarantine(stream, fence);
                                let _ = out.send(Err(WorkerError::from(e).into())).await;
                                return;
                            }
                        }
                    }
                }
            }
        }
        loop {
            let ev = tokio::select! {
                ev = stream.next() => ev,
                // The router went away: dropping `stream` cancels.
                () = out.closed() => return,
            };
            let msg = match ev {
                Some(Event::Token(s)) => Ok(pb::GenerateResponse {
                    kind: Some(pb::generate_response::Kind::Token((&s).into())),
                }),
                Some(Event::Finished(u)) => Ok(pb::GenerateResponse {
                    kind: Some(pb::generate_response::Kind::Finished(pb::Finished {
                        prompt_tokens: u.prompt_tokens as u32,
                        completion_tokens: u.completion_tokens as u32,
                        cached_tokens: u.cached_tokens as u32,
                        finish: finish_to_pb(u.finish) as i32,
                        prefill_worker: std::mem::take(&mut prefill_worker),
                    })),
                }),
                other => Err(event_status(other)),
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

    /// Decides where the prompt is prefilled and, if remotely, runs it.
    /// Returns the outcome and the prefill worker that served it (empty
    /// when prefilled here).
    async fn place_prefill(
        &self,
        job: &GenerateJob,
        slot: &ImportSlot,
        trace: &TraceContext,
        attempt: &Mutex<Option<Fence>>,
        from: usize,
        budget: Instant,
    ) -> Placement {
        let block_size = self.core.fingerprint.block_size;
        let uncached = job
            .prompt
            .len()
            .saturating_sub(slot.cached_blocks * block_size);
        let outcome = |o: &'static str| metrics().prefills.add(1, &[KeyValue::new("outcome", o)]);
        if uncached < self.config.remote_prefill_min_tokens {
            outcome("local");
            return Placement::Done(ImportOutcome::PrefillLocally, String::new());
        }
        for (i, target) in job.prefill.iter().enumerate().skip(from) {
            if i > 0 && Instant::now() >= budget {
                break;
            }
            let fence = Fence {
                worker_id: target.worker_id.clone(),
                endpoint: target.endpoint.clone(),
                transfer_id: next_transfer_id(),
            };
            let set = |f: Option<Fence>| {
                *attempt.lock().unwrap_or_else(PoisonError::into_inner) = f;
            };
            set(Some(fence.clone()));
            let result = self
                .remote_prefill(job, slot, target, trace, fence.transfer_id)
                .await;
            set(None);
            match result {
                Ok((first, remote_cached_tokens)) => {
                    outcome(if i == 0 { "remote" } else { "retried" });
                    let ready = ImportOutcome::Ready {
                        first,
                        remote_cached_tokens,
                    };
                    return Placement::Done(ready, target.worker_id.clone());
                }
                Err(Attempt { error, tainted }) => {
                    tracing::warn!(worker = %target.worker_id, error = %error, tainted, "remote prefill failed");
                    self.forget_channel(&target.endpoint);
                    if tainted {
                        return Placement::Tainted(fence, i + 1);
                    }
                }
            }
        }
        outcome("fallback");
        Placement::Done(ImportOutcome::PrefillLocally, String::new())
    }

    /// Keeps `stream` (and so its blocks) until the prefill node confirms
    /// that none of `fence`'s writes can land any more, retrying with
    /// backoff; past the fence limit the blocks are released anyway.
    fn quarantine(self: &Arc<Self>, stream: RequestStream, fence: Fence) {
        metrics().quarantined.add(1, &[]);
        let me = Arc::clone(self);
        let task = async move {
            let start = Instant::now();
            let mut backoff = Duration::from_millis(100);
            loop {
                match me.fence(&fence).await {
                    Ok(()) => {
                        tracing::debug!(worker = %fence.worker_id, transfer = fence.transfer_id, "transfer fenced; blocks released");
                        break;
                    }
                    Err(e) if start.elapsed() >= me.config.fence_limit => {
                        metrics().quarantine_expired.add(1, &[]);
                        tracing::warn!(
                            worker = %fence.worker_id,
                            transfer = fence.transfer_id,
                            error = %e,
                            "no fence within {:?}; releasing the transfer's blocks anyway",
                            me.config.fence_limit
                        );
                        break;
                    }
                    Err(e) => {
                        tracing::debug!(worker = %fence.worker_id, error = %e, "fence not reached yet");
                        me.forget_channel(&fence.endpoint);
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(5));
                    }
                }
            }
            drop(stream);
        };
        self.tasks.spawn(task.in_current_span());
    }

    async fn fence(&self, fence: &Fence) -> Result<(), WorkerError> {
        let core = &self.core;
        let worker_addresses = std::iter::once(&*core.region)
            .chain(core.peer_regions.iter())
            .map(|r| r.descriptor().worker_address)
            .collect();
        let mut client = pb::prefill_client::PrefillClient::new(self.channel(&fence.endpoint)?);
        let mut request = tonic::Request::new(pb::FenceRequest {
            transfer_id: fence.transfer_id,
            worker_addresses,
        });
        request.set_timeout(FENCE_CALL_TIMEOUT);
        match tokio::time::timeout(FENCE_CALL_TIMEOUT, client.fence(request)).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(status)) if never_connected(&status) => {
                // Nobody listens there any more: the prefill process is
                // gone, and the kernel delivers what its closed sockets
                // still held right away (on a network that is not itself
                // partitioned). Let that settle, then count it as fenced.
                tracing::info!(worker = %fence.worker_id, "prefill node gone; its transfer counts as fenced");
                tokio::time::sleep(PEER_GONE_SETTLE).await;
                Ok(())
            }
            Ok(Err(status)) => Err(WorkerError::Internal(format!(
                "fence answered {:?}: {}",
                status.code(),
                status.message()
            ))),
            Err(_) => Err(WorkerError::Deadline("fence call".into())),
        }
    }

    /// Asks one prefill node; a stalled call is abandoned at the deadline.
    async fn remote_prefill(
        &self,
        job: &GenerateJob,
        slot: &ImportSlot,
        target: &PrefillTarget,
        trace: &TraceContext,
        transfer_id: u64,
    ) -> Result<(Sampled, usize), Attempt> {
        let core = &self.core;
        let connector = core.dkv.connector().to_string();
        let regions: Vec<KvRegion> = std::iter::once(&*core.region)
            .chain(core.peer_regions.iter())
            .map(|r| {
                let d = r.descriptor();
                KvRegion {
                    worker_address: d.worker_address,
                    rkey: d.rkey,
                    base: d.base,
                    len: d.len,
                    connector: connector.clone(),
                }
            })
            .collect();
        let deadline = self.config.prefill_timeout;
        let req = PrefillJob {
            prompt: job.prompt.clone(),
            sampling: job.sampling.clone(),
            skip_blocks: slot.cached_blocks,
            dst_blocks: slot.blocks[slot.cached_blocks..].to_vec(),
            regions,
            deadline,
            constraint: job.constraint.clone(),
            transfer_id,
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
        // An answer means every write was flushed: nothing is in flight.
        let first = resp
            .first
            .ok_or_else(|| WorkerError::Internal("prefill response without a first token".into()))
            .and_then(|f| Sampled::try_from(f).map_err(WorkerError::from))
            .map_err(clean)?;
        let vocab = core.model.model.config().vocab_size;
        if first.token as usize >= vocab {
            return Err(clean(WorkerError::Internal(format!(
                "prefill node sent token {} outside the vocabulary",
                first.token
            ))));
        }
        Ok((first, resp.cached_tokens as usize))
    }
}

fn event_status(ev: Option<Event>) -> Status {
    match ev {
        None => Status::unavailable("the scheduler stopped"),
        Some(Event::Failed(f)) => Status::from(WorkerError::Failed(f)),
        Some(other) => Status::internal(format!("unexpected scheduler event {other:?}")),
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
        let handoff = if job.prefill.is_empty() {
            KvHandoff::Local
        } else {
            KvHandoff::Import
        };
        let stream = core
            .scheduler
            .submit(Request {
                prompt: job.prompt.clone(),
                sampling: job.sampling.clone(),
                max_tokens: job.max_tokens,
                stop_token_ids: job.stop_token_ids.clone(),
                handoff,
                constraint: job.constraint.clone(),
            })
            .map_err(|e| Status::from(WorkerError::from(e)))?;
        let (tx, rx) = mpsc::channel(64);
        let task = Arc::clone(inner).drive(job, stream, tx, trace);
        inner.tasks.spawn(task.instrument(span));
        Ok(tonic::Response::new(ReceiverStream::new(rx)))
    }
}
