//! Sending KV blocks into a peer's granted memory: the checks every sender
//! makes on the peer's regions first, and the writes that move blocks of
//! this node's pool into the peer's, whole blocks when both sides hold
//! every KV head (TP=1 to TP=1) and head slices rank to rank otherwise.
//! Shared by the prefill role (a computed prompt) and `Worker.FetchBlocks`
//! (a cached prefix).

use std::time::Instant;

use tandem_dkv::{KvLayout, Region, RemoteRegion, TransferStats, WriteOp};
use tandem_modelfile::plan::shard::kv_head_overlaps;
use tandem_proto::KvRegion;
use tracing::Instrument;

use crate::error::WorkerError;
use crate::node::NodeCore;

/// One source rank's writes into one destination rank's region.
pub type SliceWrite<'a> = (&'a Region, &'a RemoteRegion, Vec<WriteOp>);

/// The peer's regions, once each is known to be one this node can write:
/// registered by the connector this node uses, at an address a node of
/// this cluster sealed (nothing else ever reaches the transport).
pub fn remotes(core: &NodeCore, regions: &[KvRegion]) -> Result<Vec<RemoteRegion>, WorkerError> {
    if let Some(r) = regions.iter().find(|r| r.connector != core.dkv.connector()) {
        return Err(WorkerError::Connector {
            ours: core.dkv.connector().to_string(),
            theirs: r.connector.clone(),
        });
    }
    let remotes: Vec<RemoteRegion> = regions
        .iter()
        .map(|r| RemoteRegion {
            worker_address: r.worker_address.clone(),
            grant: r.grant.clone(),
            len: r.len,
        })
        .collect();
    for r in &remotes {
        core.dkv.check(r)?;
    }
    Ok(remotes)
}

/// Whether this node's blocks and the peer's have the same shape (every KV
/// head on one rank each side), so that whole blocks and layers move as
/// they are.
pub fn same_shape(core: &NodeCore, remotes: &[RemoteRegion]) -> bool {
    core.tp == 1 && remotes.len() == 1
}

/// The writes that move this node's blocks `src` into the peer's blocks
/// `dst`, whatever the two sides' tensor-parallel shapes.
pub fn block_writes<'a>(
    core: &'a NodeCore,
    remotes: &'a [RemoteRegion],
    src: &[u32],
    dst: &[u32],
) -> Result<Vec<SliceWrite<'a>>, WorkerError> {
    if src.is_empty() {
        return Ok(Vec::new());
    }
    if same_shape(core, remotes) {
        let ops = core.layout.block_ops(src, dst)?;
        return Ok(vec![(&*core.region, &remotes[0], ops)]);
    }
    head_slice_writes(core, remotes, src, dst)
}

/// Head slices: each rank holds a contiguous run of KV heads of every
/// block (the shard plan's split), all at the same block ids, so each
/// source rank writes each overlap straight into the destination rank's
/// pool, no gather on either side.
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

/// One transfer owning its ops (so that all of a request's transfers are
/// the same future type), in `span`.
pub async fn send(
    core: &NodeCore,
    region: &Region,
    remote: &RemoteRegion,
    ops: Vec<WriteOp>,
    deadline: Instant,
    span: tracing::Span,
) -> Result<TransferStats, tandem_dkv::DkvError> {
    core.dkv
        .write(region, remote, &ops, deadline)
        .instrument(span)
        .await
}
