//! The cluster backend of the router: worker membership from etcd
//! (`membership`), a view of each worker's prefix cache and load built
//! from its event stream (`events`, `prefix_index`), verification of each
//! worker before it is routed to (`probation`), the routing decision behind
//! [`RoutingPolicy`] (`policy`; the cost function of `cost` today), the
//! `Generate` call to the chosen decode node with retries on another
//! (`dispatch`), naming it a worker that holds more of the prompt
//! (`prefix_source`), the stream of its answers through the egress backlog
//! (`egress`), the front end's [`Backend`](tandem_frontend::Backend) over
//! all of it (`backend`), and the routing metrics (`metrics`).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use tandem_discovery::Role;
use tandem_proto::WorkerRecord;
use tandem_proto::tls::PeerConnector;
use tandem_types::ModelFingerprint;
use tokio::task::JoinHandle;
use tonic::transport::Channel;

mod backend;
mod cost;
mod dispatch;
mod egress;
mod events;
mod membership;
mod metrics;
mod policy;
mod prefix_index;
mod prefix_source;
mod probation;
mod round_robin;

pub use backend::ClusterBackend;
pub use cost::CostPolicy;
pub use dispatch::Placement;
pub use egress::RemoteStream;
pub use membership::{ClusterHandle, MembershipRx};
pub use policy::{Candidate, RoutingPolicy};
pub use prefix_index::Overlap;
pub use round_robin::RoundRobinPolicy;

use crate::RouterError;
use metrics::metrics;
use prefix_index::index_bytes;
use probation::{Census, Standing};

/// Which [`RoutingPolicy`] orders the ready workers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum PolicyKind {
    /// [`CostPolicy`]: prefix overlap (by tier) against load.
    #[default]
    Cost,
    /// [`RoundRobinPolicy`]: each worker in turn.
    RoundRobin,
}

/// Routing weights and limits, validated at startup.
#[derive(Debug, Clone, PartialEq)]
pub struct RoutingConfig {
    /// The policy; the weights below are [`PolicyKind::Cost`]'s.
    pub policy: PolicyKind,
    /// Cost of one prompt block a worker would have to compute.
    pub prefill_weight: f64,
    /// Cost of one prompt block a worker holds in host memory, as a
    /// fraction of computing it (`prefill_weight`): see [`CostPolicy`].
    pub host_hit_weight: f64,
    /// Cost of one prompt block a worker holds on disk, as a fraction of
    /// computing it.
    pub disk_hit_weight: f64,
    /// Cost of one queued request.
    pub queue_weight: f64,
    /// Prefill workers named to the decode node, best first (retries).
    pub prefill_candidates: usize,
    /// Decode workers tried for one request before giving up.
    pub decode_attempts: usize,
}

impl RoutingConfig {
    /// The policy this configuration names.
    pub(crate) fn build_policy(&self) -> Box<dyn RoutingPolicy> {
        match self.policy {
            PolicyKind::Cost => Box::new(CostPolicy::new(self)),
            PolicyKind::RoundRobin => Box::new(RoundRobinPolicy::default()),
        }
    }

    pub fn validate(&self) -> Result<(), RouterError> {
        for (name, value) in [
            ("prefill weight", self.prefill_weight),
            ("queue weight", self.queue_weight),
        ] {
            if !value.is_finite() || value < 0.0 {
                return Err(RouterError::Weight { name, value });
            }
        }
        for (name, value) in [
            ("host hit weight", self.host_hit_weight),
            ("disk hit weight", self.disk_hit_weight),
        ] {
            if !(0.0..=1.0).contains(&value) {
                return Err(RouterError::HitWeight { name, value });
            }
        }
        if self.prefill_candidates == 0 || self.decode_attempts == 0 {
            return Err(RouterError::NoAttempts);
        }
        if self.prefill_candidates > tandem_proto::MAX_PREFILL_TARGETS {
            return Err(RouterError::TooManyCandidates {
                max: tandem_proto::MAX_PREFILL_TARGETS,
            });
        }
        Ok(())
    }
}

/// What the router knows about one worker.
#[derive(Debug)]
struct Worker {
    record: WorkerRecord,
    role: Role,
    channel: Channel,
    /// The blocks it holds, each with its tier (from its events).
    cached: Mutex<prefix_index::Index>,
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

/// Live membership and routing state.
#[derive(Debug)]
pub struct Cluster {
    fingerprint: ModelFingerprint,
    routing: RoutingConfig,
    /// Orders the candidate workers of each request.
    policy: Box<dyn RoutingPolicy>,
    /// How workers are dialled: under mutual TLS a worker is used only over
    /// a connection on which it proved its identity.
    peers: PeerConnector,
    workers: RwLock<BTreeMap<(Role, String), Arc<Worker>>>,
    /// Workers by role and standing (the worker gauges).
    census: Arc<Census>,
}

#[cfg(test)]
mod tests;
