//! Prefill role: a gRPC `Prefill` service that computes a prompt's KV
//! (reusing this node's prefix cache), samples the first token, and writes
//! the blocks the decode node lacks straight into the decode node's
//! registered memory with one-sided puts.

use std::sync::Arc;
use std::time::Instant;

use opentelemetry::KeyValue;
use tandem_dkv::RemoteRegion;
use tandem_engine::scheduler::{Event, KvHandoff, Request};
use tandem_proto::trace::TraceContext;
use tandem_proto::{PrefillJob, pb};
use tandem_worker::{NodeCore, WorkerError};
use tracing::Instrument;

#[derive(Debug, Clone)]
pub struct PrefillService {
    core: Arc<NodeCore>,
}

impl PrefillService {
    pub fn new(core: Arc<NodeCore>) -> Self {
        Self { core }
    }

    pub fn into_server(self) -> pb::prefill_server::PrefillServer<Self> {
        pb::prefill_server::PrefillServer::new(self)
    }

    async fn prefill(&self, req: pb::PrefillRequest) -> Result<pb::PrefillResponse, WorkerError> {
        let core = &self.core;
        let job = PrefillJob::validate(req, &core.fingerprint, core.layout.block_bytes)?;
        if job.region.connector != core.dkv.connector() {
            return Err(WorkerError::Connector {
                ours: core.dkv.connector().to_string(),
                theirs: job.region.connector,
            });
        }
        let deadline = Instant::now() + job.deadline;
        let work = async {
            // Dropping `stream` (on return, error or cancellation) releases
            // the held blocks.
            let mut stream = core.scheduler.submit(Request {
                prompt: job.prompt.clone(),
                sampling: job.sampling.clone(),
                max_tokens: 1,
                stop_token_ids: Vec::new(),
                handoff: KvHandoff::Export,
            })?;
            let first = match stream.next().await {
                Some(Event::Token(s)) => s,
                other => return Err(unexpected(other)),
            };
            let exported = match stream.next().await {
                Some(Event::Exported(e)) => e,
                other => return Err(unexpected(other)),
            };
            let src = exported
                .blocks
                .get(job.skip_blocks..)
                .ok_or_else(|| WorkerError::Internal("exported fewer blocks than asked".into()))?;
            let ops = core.layout.block_ops(src, &job.dst_blocks)?;
            let remote = RemoteRegion {
                worker_address: job.region.worker_address.clone(),
                rkey: job.region.rkey.clone(),
                base: job.region.base,
                len: job.region.len,
            };
            let stats = core
                .dkv
                .write(&core.region, &remote, &ops, deadline)
                .await?;
            tandem_dkv::metrics().blocks_transferred.add(
                src.len() as u64,
                &[KeyValue::new("connector", core.dkv.connector())],
            );
            tracing::debug!(
                blocks = src.len(),
                bytes = stats.bytes,
                ms = stats.elapsed.as_secs_f64() * 1e3,
                "KV written"
            );
            Ok(pb::PrefillResponse {
                first: Some((&first).into()),
                cached_tokens: exported.cached_tokens as u32,
                bytes: stats.bytes,
                blocks: src.len() as u32,
            })
        };
        match tokio::time::timeout_at(deadline.into(), work).await {
            Ok(r) => r,
            Err(_) => Err(WorkerError::Deadline(format!(
                "prefill did not finish within {:?}",
                job.deadline
            ))),
        }
    }
}

fn unexpected(ev: Option<Event>) -> WorkerError {
    match ev {
        None => WorkerError::Stopped,
        Some(Event::Failed(m)) => WorkerError::Internal(m),
        Some(other) => WorkerError::Internal(format!("unexpected scheduler event {other:?}")),
    }
}

#[tonic::async_trait]
impl pb::prefill_server::Prefill for PrefillService {
    async fn prefill(
        &self,
        req: tonic::Request<pb::PrefillRequest>,
    ) -> Result<tonic::Response<pb::PrefillResponse>, tonic::Status> {
        let trace =
            TraceContext::from_metadata(req.metadata()).unwrap_or_else(TraceContext::new_root);
        let span = tracing::info_span!("prefill", trace_id = %trace.trace_id_hex());
        let prompt_tokens = req.get_ref().prompt.len();
        async move {
            match self.prefill(req.into_inner()).await {
                Ok(r) => {
                    tracing::info!(prompt_tokens, blocks = r.blocks, "prefilled");
                    Ok(tonic::Response::new(r))
                }
                Err(e) => {
                    tracing::warn!(prompt_tokens, error = %e, "prefill failed");
                    Err(e.into())
                }
            }
        }
        .instrument(span)
        .await
    }
}
