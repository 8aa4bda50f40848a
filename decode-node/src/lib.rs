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
    /// After an abandoned transfer, how long to wait before reusing its
    /// destination blocks (the prefill node stops writing at the same
    /// deadline; this covers a write already on the wire).
    pub transfer_grace: Duration,
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
        Ok(())
    }
}

struct DecodeMetrics {
    /// Prefill placements, by `outcome` (local|remote|retried|fallback).
    prefills: Counter<u64>,
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
        }
    })
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
            let slot = match stream.next().await {
                Some(Event::ImportReady(slot)) => slot,
                other => {
                    let _ = out.send(Err(event_status(other))).await;
                    return;
                }
            };
            let placed = tokio::select! {
                placed = self.place_prefill(&job, &slot, &trace) => placed,
                () = out.closed() => {
                    // The router went away mid-prefill: dropping the call
                    // cancels it on the prefill node, but writes already
                    // under way may still land for a moment, so the blocks
                    // are held for the transfer grace, then freed with
                    // `stream`.
                    tokio::time::sleep(self.config.transfer_grace).await;
                    return;
                }
            };
            let (outcome, worker) = placed;
            prefill_worker = worker;
            stream.complete_import(outcome);
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
    ) -> (ImportOutcome, String) {
        let block_size = self.core.fingerprint.block_size;
        let uncached = job
            .prompt
            .len()
            .saturating_sub(slot.cached_blocks * block_size);
        let outcome = |o: &'static str| metrics().prefills.add(1, &[KeyValue::new("outcome", o)]);
        if uncached < self.config.remote_prefill_min_tokens {
            outcome("local");
            return (ImportOutcome::PrefillLocally, String::new());
        }
        // However many targets the router named, the prompt waits for
        // remote prefills at most this long in total.
        let budget = Instant::now() + 2 * self.config.prefill_timeout;
        for (i, target) in job.prefill.iter().enumerate() {
            if i > 0 && Instant::now() >= budget {
                break;
            }
            match self.remote_prefill(job, slot, target, trace).await {
                Ok((first, remote_cached_tokens)) => {
                    outcome(if i == 0 { "remote" } else { "retried" });
                    let ready = ImportOutcome::Ready {
                        first,
                        remote_cached_tokens,
                    };
                    return (ready, target.worker_id.clone());
                }
                Err(e) => {
                    tracing::warn!(worker = %target.worker_id, error = %e, "remote prefill failed");
                    self.forget_channel(&target.endpoint);
                }
            }
        }
        outcome("fallback");
        (ImportOutcome::PrefillLocally, String::new())
    }

    /// Asks one prefill node; a stalled call is abandoned at the deadline.
    async fn remote_prefill(
        &self,
        job: &GenerateJob,
        slot: &ImportSlot,
        target: &PrefillTarget,
        trace: &TraceContext,
    ) -> Result<(Sampled, usize), WorkerError> {
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
        }
        .to_pb(&core.fingerprint);
        let mut request = tonic::Request::new(req);
        trace.inject(request.metadata_mut());
        request.set_timeout(deadline);
        let mut client = pb::prefill_client::PrefillClient::new(self.channel(&target.endpoint)?);
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
                    let e = watchdog("prefill stalled");
                    tokio::time::sleep(self.config.transfer_grace).await;
                    return Err(e);
                }
                return Err(WorkerError::Internal(format!(
                    "prefill node {} answered {:?}: {}",
                    target.worker_id,
                    status.code(),
                    status.message()
                )));
            }
            Err(_) => {
                let e = watchdog("no prefill answer");
                tokio::time::sleep(self.config.transfer_grace).await;
                return Err(e);
            }
        };
        let first = Sampled::try_from(resp.first.ok_or_else(|| {
            WorkerError::Internal("prefill response without a first token".into())
        })?)?;
        let vocab = core.model.model.config().vocab_size;
        if first.token as usize >= vocab {
            return Err(WorkerError::Internal(format!(
                "prefill node sent token {} outside the vocabulary",
                first.token
            )));
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
