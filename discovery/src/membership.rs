//! The live set of registered workers, as seen by a router.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use etcd_client::{EventType, GetOptions, WatchOptions, WatchResponse, WatchStream};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tracing::{debug, error, info, warn};

use crate::client::{Backoff, CONNECT_TIMEOUT, Outage, bounded, classify, connect};
use crate::{DiscoveryError, EtcdConfig, Role, parse_worker_key, workers_prefix};

/// One registered worker. `value` is the worker's record as it put it; the
/// caller decodes and validates it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    pub role: Role,
    pub id: String,
    pub value: Vec<u8>,
}

/// An immutable membership snapshot, cheap to clone and hold while routing.
pub type Snapshot = Arc<BTreeMap<(Role, String), Member>>;

/// Handle to the task that lists and watches the workers prefix.
#[derive(Debug)]
pub struct Membership {
    rx: watch::Receiver<Snapshot>,
    connected: Arc<AtomicBool>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl Membership {
    /// Lists the prefix, then watches it from the listed revision so no
    /// change between the two is missed. Fails with
    /// [`DiscoveryError::Unreachable`] if etcd does not answer within
    /// [`CONNECT_TIMEOUT`]. Afterwards an etcd outage keeps the last known
    /// membership (routing on slightly stale data beats routing nowhere); the
    /// task reconnects with backoff, lists again and replaces the snapshot,
    /// which drops workers that vanished meanwhile.
    pub async fn watch(cfg: &EtcdConfig) -> Result<Membership, DiscoveryError> {
        cfg.validate()?;
        let what = format!(
            "watching {} at {:?}",
            workers_prefix(&cfg.cluster),
            cfg.endpoints
        );
        let (members, stream) = bounded(CONNECT_TIMEOUT, &what, open(cfg)).await?;
        info!(
            prefix = workers_prefix(&cfg.cluster),
            workers = members.len(),
            "watching worker membership"
        );
        let (tx, rx) = watch::channel(Arc::new(members.clone()));
        let connected = Arc::new(AtomicBool::new(true));
        let (stop_tx, stop_rx) = oneshot::channel();
        let task = tokio::spawn(run(
            cfg.clone(),
            tx,
            members,
            stream,
            connected.clone(),
            stop_rx,
        ));
        Ok(Membership {
            rx,
            connected,
            stop: Some(stop_tx),
            task: Some(task),
        })
    }

    /// A receiver whose value is always the latest snapshot; `changed()`
    /// wakes on every membership change.
    pub fn subscribe(&self) -> watch::Receiver<Snapshot> {
        self.rx.clone()
    }

    /// The latest snapshot.
    pub fn current(&self) -> Snapshot {
        self.rx.borrow().clone()
    }

    /// Whether the watch is live (false during an outage, when the snapshot
    /// may be stale).
    pub fn is_connected(&self) -> bool {
        self.connected.load(Ordering::Acquire)
    }

    /// Stops and joins the task.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take()
            && let Err(e) = task.await
        {
            error!(error = %e, "membership task failed");
        }
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

type Members = BTreeMap<(Role, String), Member>;

/// Lists the prefix and opens a watch from just after the listed revision;
/// returns once etcd confirmed the watch.
async fn open(cfg: &EtcdConfig) -> Result<(Members, WatchStream), DiscoveryError> {
    let prefix = workers_prefix(&cfg.cluster);
    let mut client = connect(cfg).await?;
    let listed = client
        .get(prefix.as_str(), Some(GetOptions::new().with_prefix()))
        .await
        .map_err(classify)?;
    let revision = listed.header().map_or(0, |h| h.revision());
    let mut members = Members::new();
    for kv in listed.kvs() {
        if let Some((role, id)) = parse_key(&cfg.cluster, kv.key()) {
            let value = kv.value().to_vec();
            members.insert((role, id.clone()), Member { role, id, value });
        }
    }
    let options = WatchOptions::new()
        .with_prefix()
        .with_start_revision(revision + 1);
    let mut stream = client
        .watch(prefix.as_str(), Some(options))
        .await
        .map_err(classify)?;
    match stream.message().await.map_err(classify)? {
        Some(r) if r.created() && !r.canceled() => Ok((members, stream)),
        Some(r) => Err(DiscoveryError::Unreachable(format!(
            "etcd refused the watch: {}",
            r.cancel_reason()
        ))),
        None => Err(DiscoveryError::Unreachable(
            "etcd closed the watch stream".into(),
        )),
    }
}

fn parse_key(cluster: &str, key: &[u8]) -> Option<(Role, String)> {
    let parsed = std::str::from_utf8(key)
        .ok()
        .and_then(|k| parse_worker_key(cluster, k));
    if parsed.is_none() {
        warn!(key = %String::from_utf8_lossy(key), "ignoring a key under the workers prefix that is not a worker key");
    }
    parsed
}

/// Applies a batch of watch events; true if the membership changed.
fn apply(cluster: &str, members: &mut Members, resp: &WatchResponse) -> bool {
    let mut changed = false;
    for event in resp.events() {
        let Some(kv) = event.kv() else { continue };
        let Some((role, id)) = parse_key(cluster, kv.key()) else {
            continue;
        };
        match event.event_type() {
            EventType::Put => {
                let member = Member {
                    role,
                    id: id.clone(),
                    value: kv.value().to_vec(),
                };
                // A worker re-registering after an outage puts the same value
                // again: not a change worth waking subscribers for.
                if members.get(&(role, id.clone())) != Some(&member) {
                    members.insert((role, id), member);
                    changed = true;
                }
            }
            EventType::Delete => changed |= members.remove(&(role, id)).is_some(),
        }
    }
    changed
}

enum Step {
    Stop,
    Message(Result<Option<WatchResponse>, DiscoveryError>),
    Opened(Result<(Members, WatchStream), DiscoveryError>),
}

async fn run(
    cfg: EtcdConfig,
    tx: watch::Sender<Snapshot>,
    mut members: Members,
    stream: WatchStream,
    connected: Arc<AtomicBool>,
    mut stop: oneshot::Receiver<()>,
) {
    let mut stream = Some(stream);
    let mut outage = Outage::default();
    let mut backoff = Backoff::new();
    let publish = |members: &Members| {
        tx.send_if_modified(|cur| {
            if **cur == *members {
                return false;
            }
            *cur = Arc::new(members.clone());
            true
        });
    };
    loop {
        let step = match stream.as_mut() {
            Some(s) => tokio::select! {
                biased;
                _ = &mut stop => Step::Stop,
                r = s.message() => Step::Message(r.map_err(classify)),
            },
            None => tokio::select! {
                biased;
                _ = &mut stop => Step::Stop,
                r = bounded(CONNECT_TIMEOUT, "membership watch", open(&cfg)) => Step::Opened(r),
            },
        };
        let failure = match step {
            Step::Stop => return,
            Step::Message(Ok(Some(resp))) if resp.canceled() => {
                // Compaction past our revision, or the member lost its
                // leader: list again rather than miss events.
                warn!(
                    reason = resp.cancel_reason(),
                    compact_revision = resp.compact_revision(),
                    "etcd canceled the membership watch; listing again"
                );
                connected.store(false, Ordering::Release);
                stream = None;
                continue;
            }
            Step::Message(Ok(Some(resp))) => {
                if apply(&cfg.cluster, &mut members, &resp) {
                    debug!(workers = members.len(), "membership changed");
                    publish(&members);
                }
                continue;
            }
            Step::Message(Ok(None)) => {
                DiscoveryError::Unreachable("etcd closed the watch stream".into())
            }
            Step::Message(Err(e)) => e,
            Step::Opened(Ok((listed, s))) => {
                members = listed;
                publish(&members);
                connected.store(true, Ordering::Release);
                stream = Some(s);
                backoff.reset();
                if let Some(down) = outage.recovered() {
                    info!(workers = members.len(), after = ?down, "membership watch restored");
                }
                continue;
            }
            Step::Opened(Err(e)) => {
                if outage.failed() {
                    warn!(error = %e, workers = members.len(), "etcd unreachable; keeping the last known membership, retrying");
                } else {
                    debug!(error = %e, "membership watch retry failed");
                }
                tokio::select! {
                    biased;
                    _ = &mut stop => return,
                    () = tokio::time::sleep(backoff.next_delay()) => {}
                }
                continue;
            }
        };
        // The watch broke: keep the snapshot, reconnect right away once,
        // then with backoff while etcd stays away.
        connected.store(false, Ordering::Release);
        stream = None;
        if outage.failed() {
            warn!(error = %failure, workers = members.len(), "lost the etcd watch; keeping the last known membership, retrying");
        }
    }
}
