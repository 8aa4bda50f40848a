//! Naming a prefix source: the ready worker, of either role, that holds
//! more of a prompt's leading blocks than the decode worker tried (in any
//! tier), so that the decode node may fetch them over dKV instead of
//! computing them (`GenerateRequest.prefix_source`).

use std::sync::Arc;

use tandem_proto::PrefixSource;

use super::policy::Ready;
use super::{RoutingConfig, Worker};

/// The worker of `ready`, other than `decode`, holding the most leading
/// blocks of the prompt, if more than `decode` holds: ties go to the one
/// whose blocks are nearest its pool (the lower tier-weighted cost), then
/// to the one with fewer requests queued, then to the lower id.
pub(super) fn prefix_source(
    decode: &Arc<Worker>,
    decode_blocks: usize,
    ready: &[Ready],
    routing: &RoutingConfig,
) -> Option<PrefixSource> {
    let fetch_cost = |(_, c): &&Ready| {
        routing.host_hit_weight * c.overlap.host as f64
            + routing.disk_hit_weight * c.overlap.disk as f64
    };
    let (w, c) = ready
        .iter()
        .filter(|(w, c)| !Arc::ptr_eq(w, decode) && c.overlap.blocks > decode_blocks)
        .min_by(|a, b| {
            b.1.overlap
                .blocks
                .cmp(&a.1.overlap.blocks)
                .then(fetch_cost(a).total_cmp(&fetch_cost(b)))
                .then(a.1.queued.cmp(&b.1.queued))
                .then(a.0.record.id.cmp(&b.0.record.id))
        })?;
    Some(PrefixSource {
        worker_id: w.record.id.clone(),
        endpoint: w.record.grpc_endpoint.clone(),
        blocks: c.overlap.blocks,
    })
}
