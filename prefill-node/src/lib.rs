//! Prefill role: a gRPC `Prefill` service that computes a prompt's KV
//! (reusing this node's prefix cache), samples the first token, and writes
//! the blocks the decode node lacks into the decode node's registered
//! memory, under the grant the decode node sent for them.

use std::sync::Arc;
use std::time::Instant;

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use opentelemetry::KeyValue;
use tandem_dkv::{KvLayout, Region, RemoteRegion, WriteOp};
use tandem_engine::scheduler::{ExportEvent, LayerDone};
use tandem_modelfile::plan::shard::kv_head_overlaps;
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
        // Destination blocks hold every KV head (decode nodes run TP=1).
        let job = PrefillJob::validate(req, &core.fingerprint, core.full_layout.block_bytes)?;
        if let Some(r) = job
            .regions
            .iter()
            .find(|r| r.connector != core.dkv.connector())
        {
            return Err(WorkerError::Connector {
                ours: core.dkv.connector().to_string(),
                theirs: r.connector.clone(),
            });
        }
        let deadline = Instant::now() + job.deadline;
        let remotes: Vec<RemoteRegion> = job
            .regions
            .iter()
            .map(|r| RemoteRegion {
                worker_address: r.worker_address.clone(),
                grant: r.grant.clone(),
                len: r.len,
            })
            .collect();
        // Before any work: every region's address must be one a node of
        // this cluster sealed (nothing else ever reaches UCX).
        for r in &remotes {
            core.dkv.check(r)?;
        }
        let remote = &remotes[0];
        // Same sharding on both sides (TP=1 to TP=1): whole blocks and
        // layers, sent as they are computed. Otherwise head slices mapped
        // rank to rank once the prompt is done.
        let same_shape = core.tp == 1 && remotes.len() == 1;
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
            if same_shape {
                let ops = layout.block_ops(&src, &dst)?;
                if !ops.is_empty() {
                    writes.push(send(
                        core,
                        &core.region,
                        remote,
                        ops,
                        deadline,
                        xfer.get(core),
                    ));
                }
            } else if !src.is_empty() {
                for (region, remote, ops) in head_slice_writes(core, &remotes, &src, &dst)? {
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

/// One source rank's writes into one destination rank's region.
type SliceWrite<'a> = (&'a Region, &'a RemoteRegion, Vec<WriteOp>);

/// The writes that move a tensor-parallel prefill's blocks `src` into the
/// decode ranks' blocks `dst`: each rank holds a contiguous run of KV heads
/// of every block (the shard plan's split), all at the same block ids, so
/// each source rank writes each overlap straight into the destination
/// rank's pool, no gather on either side.
fn head_slice_writes<'a>(
    core: &'a NodeCore,
    remotes: &'a [RemoteRegion],
    src: &[u32],
    dst: &[u32],
) -> Result<Vec<SliceWrite<'a>>, WorkerError> {
    let layout = &core.layout;
    let heads = core.full_layout.num_kv_heads;
    let sources: Vec<&Region> = std::iter::once(&*core.region)
        .chain(core.peer_regions.iter())
        .collect();
    let overlaps = kv_head_overlaps(heads, sources.len(), remotes.len()).ok_or_else(|| {
        WorkerError::Internal(format!(
            "{heads} KV heads do not split over {} source and {} destination ranks",
            sources.len(),
            remotes.len()
        ))
    })?;
    let hd = heads / remotes.len() as u32;
    let dst_layout = KvLayout {
        num_kv_heads: hd,
        layer_bytes: layout.head_slice_bytes * 2 * u64::from(hd),
        block_bytes: layout.head_slice_bytes * 2 * u64::from(hd) * u64::from(layout.num_layers),
        ..*layout
    };
    let mut writes = Vec::new();
    for o in overlaps {
        let ops = layout.head_slice_ops_to(&dst_layout, src, dst, o.src_heads, o.dst_first)?;
        writes.push((sources[o.src_rank], &remotes[o.dst_rank], ops));
    }
    Ok(writes)
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

/// One transfer owning its ops (so that all of a request's transfers are
/// the same future type), in the request's `dkv.write` span.
async fn send(
    core: &NodeCore,
    region: &Region,
    remote: &RemoteRegion,
    ops: Vec<WriteOp>,
    deadline: Instant,
    span: tracing::Span,
) -> Result<tandem_dkv::TransferStats, tandem_dkv::DkvError> {
    core.dkv
        .write(region, remote, &ops, deadline)
        .instrument(span)
        .await
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
