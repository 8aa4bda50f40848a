//! `Worker.FetchBlocks`: a peer that lacks a prompt's leading blocks asks
//! this node, which holds them (in its pool or its KV tiers), to write them
//! into the peer's granted blocks. Nothing is computed: the node pins the
//! run of the prompt's blocks it has, writes those the peer asked for, and
//! lets go. It writes from the first asked block on and stops at the first
//! it lacks, so the peer knows which blocks landed from the count alone.

use std::time::Instant;

use futures_util::future::try_join_all;
use opentelemetry::KeyValue;
use tandem_proto::{FetchJob, pb};

use crate::error::WorkerError;
use crate::kv_send;
use crate::node::NodeCore;

/// Serves one fetch within the caller's deadline.
pub async fn fetch_blocks(
    core: &NodeCore,
    req: pb::FetchRequest,
) -> Result<pb::FetchResponse, WorkerError> {
    let job = FetchJob::validate(req, &core.fingerprint, core.full_layout.block_bytes)?;
    let remotes = kv_send::remotes(core, &job.regions)?;
    let deadline = Instant::now() + job.deadline;
    let work = async {
        // Dropping `hold` (on return, error or cancellation) unpins the
        // blocks; dropping the writes cancels transfers in flight.
        let mut hold = core.scheduler.hold_prefix(job.prompt.clone())?;
        let held = match hold.blocks().await {
            Some(Ok(b)) => b,
            Some(Err(f)) => return Err(WorkerError::Failed(f)),
            None => return Err(WorkerError::Stopped),
        };
        let n = held
            .len()
            .saturating_sub(job.skip_blocks)
            .min(job.dst_blocks.len());
        let src = &held[job.skip_blocks.min(held.len())..][..n];
        let span = tracing::info_span!(
            "dkv.write",
            connector = core.dkv.connector(),
            blocks = n as i64,
        );
        let writes = kv_send::block_writes(core, &remotes, src, &job.dst_blocks[..n])?
            .into_iter()
            .filter(|(_, _, ops)| !ops.is_empty())
            .map(|(region, remote, ops)| {
                kv_send::send(core, region, remote, ops, deadline, span.clone())
            });
        let bytes: u64 = try_join_all(writes).await?.iter().map(|s| s.bytes).sum();
        tandem_dkv::metrics().blocks_transferred.add(
            n as u64,
            &[KeyValue::new("connector", core.dkv.connector())],
        );
        drop(hold);
        Ok(pb::FetchResponse {
            blocks: n as u32,
            bytes,
        })
    };
    match tokio::time::timeout_at(deadline.into(), work).await {
        Ok(r) => r,
        Err(_) => Err(WorkerError::Deadline(format!(
            "fetching blocks did not finish within {:?}",
            job.deadline
        ))),
    }
}
