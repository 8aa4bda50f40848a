//! Worker membership: the etcd watch, and each snapshot applied to the
//! workers the router knows (new ones checked and followed, vanished ones
//! dropped).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use tandem_discovery::{EtcdConfig, Membership, Role, Snapshot};
use tandem_proto::WorkerRecord;
use tandem_proto::tls::PeerConnector;
use tandem_types::ModelFingerprint;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::{Cluster, RoutingConfig, Standing, Worker, events};
use crate::RouterError;

/// Owns the membership watch; [`ClusterHandle::shutdown`] stops it.
#[derive(Debug)]
pub struct ClusterHandle {
    pub cluster: Arc<Cluster>,
    membership: Option<Membership>,
    task: Option<JoinHandle<()>>,
}

impl ClusterHandle {
    /// Watches the workers in etcd (fails if etcd is unreachable at start).
    pub async fn start(
        etcd: &EtcdConfig,
        fingerprint: ModelFingerprint,
        routing: RoutingConfig,
        peers: PeerConnector,
    ) -> Result<Self, RouterError> {
        let membership = Membership::watch(etcd).await?;
        let cluster = Arc::new(Cluster {
            fingerprint,
            policy: routing.build_policy(),
            routing,
            peers,
            workers: RwLock::new(BTreeMap::new()),
            census: Arc::default(),
        });
        cluster.census.publish();
        let mut rx = membership.subscribe();
        let c = Arc::clone(&cluster);
        let task = tokio::spawn(async move {
            loop {
                let snap = rx.borrow_and_update().clone();
                c.sync(&snap);
                if rx.changed().await.is_err() {
                    return;
                }
            }
        });
        Ok(Self {
            cluster,
            membership: Some(membership),
            task: Some(task),
        })
    }

    pub async fn shutdown(mut self) {
        if let Some(m) = self.membership.take() {
            m.shutdown().await;
        }
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
        let mut workers = self
            .cluster
            .workers
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        workers.clear();
    }

    pub fn is_connected(&self) -> bool {
        self.membership
            .as_ref()
            .is_some_and(Membership::is_connected)
    }
}

impl Cluster {
    /// Applies a membership snapshot: adds new workers (after checking
    /// their records), drops vanished ones.
    fn sync(&self, snap: &Snapshot) {
        let mut workers = self.workers.write().unwrap_or_else(PoisonError::into_inner);
        workers.retain(|k, _| {
            let keep = snap.contains_key(k);
            if !keep {
                tracing::info!(role = k.0.as_str(), id = %k.1, "worker left");
            }
            keep
        });
        for (key, member) in snap.iter() {
            if workers.contains_key(key) {
                continue;
            }
            let record = match WorkerRecord::decode(&member.value) {
                Ok(r) if r.id == member.id && r.role == member.role.as_str() => r,
                Ok(_) => {
                    tracing::warn!(id = %member.id, "worker record disagrees with its key; ignored");
                    continue;
                }
                Err(e) => {
                    tracing::warn!(id = %member.id, error = %e, "bad worker record; ignored");
                    continue;
                }
            };
            if let Some(m) = self.fingerprint.mismatch(&record.fingerprint) {
                tracing::error!(id = %record.id, "incompatible worker ignored: {m}");
                continue;
            }
            let channel = match self.peers.endpoint(&record.grpc_endpoint) {
                Ok(e) => e.connect_lazy(),
                Err(e) => {
                    tracing::warn!(id = %record.id, error = %e, "bad worker endpoint; ignored");
                    continue;
                }
            };
            tracing::info!(role = member.role.as_str(), id = %record.id, endpoint = %record.grpc_endpoint, "worker joined");
            let w = Arc::new(Worker {
                record,
                role: member.role,
                channel,
                cached: Mutex::default(),
                last_event: AtomicU64::new(0),
                waiting: AtomicUsize::new(0),
                kv_blocks_used: AtomicUsize::new(0),
                pending: AtomicUsize::new(0),
                standing: Standing::new(member.role, Arc::clone(&self.census)),
                events_task: Mutex::new(None),
            });
            let task = tokio::spawn(events::follow_events(Arc::downgrade(&w)));
            *w.events_task.lock().unwrap_or_else(PoisonError::into_inner) = Some(task);
            workers.insert(key.clone(), w);
        }
    }

    /// Ids of the workers routed to, by role (for `/health` and tests).
    pub fn members(&self) -> (Vec<String>, Vec<String>) {
        let workers = self.workers.read().unwrap_or_else(PoisonError::into_inner);
        let ids = |r: Role| {
            workers
                .values()
                .filter(|w| w.role == r && w.standing.is_ready())
                .map(|w| w.record.id.clone())
                .collect()
        };
        (ids(Role::Prefill), ids(Role::Decode))
    }
}

/// Watches for membership changes (tests and `/health`).
pub type MembershipRx = watch::Receiver<Snapshot>;
