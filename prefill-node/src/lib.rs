//! Prefill role: a gRPC `Prefill` service that computes a prompt's KV
//! (reusing this node's prefix cache), samples the first token, and writes
//! the blocks the decode node lacks into the decode node's registered
//! memory, under the grant the decode node sent for them.

use std::sync::Arc;
use std::time::Instant;

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use opentelemetry::KeyValue;
use tandem_dkv::{KvLayout, WriteOp};
use tandem_engine::scheduler::{ExportEvent, LayerDone};
use tandem_proto::trace::TraceContext;
use tandem_proto::{PrefillJob, pb};
use tandem_worker::kv_send::{self, send};
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
        // Destination blocks hold every KV head (decode nodes run TP=1).
        let job = PrefillJob::validate(req, &core.fingerprint, core.full_layout.block_bytes)?;
        // Before any work: every region must be one this node can write.
        let remotes = kv_send::remotes(core, &job.regions)?;
        let deadline = Instant::now() + job.deadline;
        let remote = &remotes[0];
        // Same sharding on both sides (TP=1 to TP=1): whole blocks and
        // layers, sent as they are computed. Otherwise head slices mapped
        // rank to rank once the prompt is done.
        let same_shape = kv_send::same_shape(core, &remotes);
        let layout = &core.layout;
        let skip = job.skip_blocks;
        let n_layers = layout.num_layers as usize;
        let work = async {
            // Dropping `stream` (on return, error or cancellation) releases
            // the held blocks; dropping `writes` cancels transfers in flight.
            let mut stream = core.scheduler.export(
                job.prompt.clone(),
                job.sampling.clone(),
                job.constraint.clone(),
            )?;
            let mut writes = FuturesUnordered::new();
            let mut xfer = TransferSpan(None);
            let mut sent = vec![false; skip + job.dst_blocks.len()];
            let mut bytes = 0u64;
            // Layers of blocks leave as the prefill writes them, overlapping
            // the remaining layers' compute.
            let exported = {
                loop {
                    tokio::select! {
                        ev = stream.next() => match ev {
                            // A tensor-parallel node sends each rank's head
                            // slices once the prompt is done.
                            Some(ExportEvent::LayerDone(_)) if !same_shape => {}
                            Some(ExportEvent::LayerDone(l)) => {
                                let ops = layer_ops(layout, &l, skip, &job.dst_blocks)?;
                                if l.layer + 1 == n_layers {
                                    for i in l.first_block..l.first_block + l.blocks.len() {
                                        if let Some(s) = sent.get_mut(i) {
                                            *s = true;
                                        }
                                    }
                                }
                                if !ops.is_empty() {
                                    writes.push(send(core, &core.region, remote, ops, deadline, xfer.get(core)));
                                }
                            }
                            Some(ExportEvent::Exported(e)) => break e,
                            Some(ExportEvent::Failed(f)) => return Err(WorkerError::Failed(f)),
                            None => return Err(WorkerError::Stopped),
                        },
                        Some(r) = writes.next(), if !writes.is_empty() => {
                            bytes += r?.bytes;
                        }
                    }
                }
            };
            // Whole blocks not sent layer by layer: those found in this
            // node's prefix cache and the partial last block.
            let rest: Vec<usize> = (skip..sent.len()).filter(|&i| !sent[i]).collect();
            let src: Vec<u32> = rest
                .iter()
                .map(|&i| exported.blocks.get(i).copied())
                .collect::<Option<_>>()
                .ok_or_else(|| WorkerError::Internal("exported fewer blocks than asked".into()))?;
            let dst: Vec<u32> = rest.iter().map(|&i| job.dst_blocks[i - skip]).collect();
            for (region, remote, ops) in kv_send::block_writes(core, &remotes, &src, &dst)? {
                if !ops.is_empty() {
                    writes.push(send(core, region, remote, ops, deadline, xfer.get(core)));
                }
            }
            while let Some(r) = writes.next().await {
                bytes += r?.bytes;
            }
            let blocks = job.dst_blocks.len();
            record_transfer(
                core,
                &xfer,
                blocks,
                bytes,
                sent.iter().filter(|&&s| s).count(),
            );
            Ok(pb::PrefillResponse {
                first: Some((&exported.first).into()),
                cached_tokens: exported.cached_tokens as u32,
                bytes,
                blocks: blocks as u32,
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

/// A finished transfer's figures: on its span, in the blocks counter and
/// in the debug log (`layered`: blocks sent layer by layer).
fn record_transfer(
    core: &NodeCore,
    xfer: &TransferSpan,
    blocks: usize,
    bytes: u64,
    layered: usize,
) {
    if let Some(span) = &xfer.0 {
        // Signed: exporters carry integers as i64 (a u64 arrives as text).
        span.record("bytes", i64::try_from(bytes).unwrap_or(i64::MAX));
        span.record("blocks", blocks as i64);
    }
    tandem_dkv::metrics().blocks_transferred.add(
        blocks as u64,
        &[KeyValue::new("connector", core.dkv.connector())],
    );
    tracing::debug!(blocks, bytes, layered, "KV written");
}

/// The request's `dkv.write` span: opened by its first write (layer writes
/// overlap the rest of the prefill), closed once the last write and the
/// request are done.
struct TransferSpan(Option<tracing::Span>);

impl TransferSpan {
    fn get(&mut self, core: &NodeCore) -> tracing::Span {
        self.0
            .get_or_insert_with(|| {
                tracing::info_span!(
                    "dkv.write",
                    connector = core.dkv.connector(),
                    blocks = tracing::field::Empty,
                    bytes = tracing::field::Empty,
                )
            })
            .clone()
    }
}

/// One layer of the blocks in `l` that the decode node lacks, block by
/// block (a layer of a block is contiguous; consecutive blocks' layers are
/// not).
fn layer_ops(
    layout: &KvLayout,
    l: &LayerDone,
    skip: usize,
    dst_blocks: &[u32],
) -> Result<Vec<WriteOp>, WorkerError> {
    let mut ops = Vec::new();
    for (k, &src) in l.blocks.iter().enumerate() {
        let i = l.first_block + k;
        let Some(&dst) = i.checked_sub(skip).and_then(|j| dst_blocks.get(j)) else {
            continue; // the decode node has it
        };
        let within = l.layer as u64 * layout.layer_bytes;
        ops.push(WriteOp {
            local_offset: u64::from(src) * layout.block_bytes + within,
            remote_offset: u64::from(dst) * layout.block_bytes + within,
            len: layout.layer_bytes,
        });
    }
    Ok(ops)
}

#[tonic::async_trait]
impl pb::prefill_server::Prefill for PrefillService {
    async fn prefill(
        &self,
        req: tonic::Request<pb::PrefillRequest>,
    ) -> Result<tonic::Response<pb::PrefillResponse>, tonic::Status> {
        let prompt_tokens = req.get_ref().prompt.len();
        let span = tracing::info_span!(
            "prefill",
            trace_id = tracing::field::Empty,
            prompt_tokens = prompt_tokens as i64,
        );
        TraceContext::start_hop(&span, TraceContext::from_metadata(req.metadata()));
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
