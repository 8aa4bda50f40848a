//! A worker's key in etcd, kept alive by one background task.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::Duration;

use etcd_client::{Client, LeaseKeepAliveStream, LeaseKeeper, PutOptions};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tracing::{debug, error, info, warn};

use crate::client::{
    Backoff, CONNECT_TIMEOUT, Outage, SHUTDOWN_TIMEOUT, bounded, classify, connect,
};
use crate::{DiscoveryError, EtcdConfig, Role, valid_id, worker_key};

/// Handle to a worker's registration. [`Registration::shutdown`] removes the
/// key at once; dropping the handle stops the task without removing it, as a
/// crash would, and etcd deletes the key when the lease runs out.
#[derive(Debug)]
pub struct Registration {
    key: String,
    state: Arc<State>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

/// What the task publishes for `/health` and tests.
#[derive(Debug, Default)]
struct State {
    registered: AtomicBool,
    /// The current lease id, 0 while there is none (etcd never grants 0).
    lease: AtomicI64,
}

impl State {
    fn set(&self, lease: Option<i64>) {
        self.lease.store(lease.unwrap_or(0), Ordering::Release);
        self.registered.store(lease.is_some(), Ordering::Release);
    }
}

impl Registration {
    /// Connects, grants a lease, puts `value` under the worker's key attached
    /// to it and keeps the lease alive (every TTL/3) from a background task.
    /// Startup fails with [`DiscoveryError::Unreachable`] if etcd does not
    /// answer within [`CONNECT_TIMEOUT`], so a misconfigured node exits
    /// instead of serving unseen. Later outages do not stop the node: the
    /// task retries with backoff and registers again (new lease, same key and
    /// value) when etcd is back.
    pub async fn start(
        cfg: &EtcdConfig,
        role: Role,
        id: &str,
        value: Vec<u8>,
    ) -> Result<Registration, DiscoveryError> {
        cfg.validate()?;
        if !valid_id(id) {
            return Err(DiscoveryError::InvalidConfig(format!(
                "worker id {id:?} must be non-empty printable ASCII without '/'"
            )));
        }
        let key = worker_key(&cfg.cluster, role, id);
        let what = format!("registering {key} at {:?}", cfg.endpoints);
        let lease = bounded(CONNECT_TIMEOUT, &what, Lease::grant(cfg, &key, &value)).await?;
        info!(key, lease = lease.id, ttl = ?lease.ttl, "registered in etcd");

        let state = Arc::new(State::default());
        state.set(Some(lease.id));
        let (stop_tx, stop_rx) = oneshot::channel();
        let task = tokio::spawn(run(
            cfg.clone(),
            key.clone(),
            value,
            state.clone(),
            Box::new(lease),
            stop_rx,
        ));
        Ok(Registration {
            key,
            state,
            stop: Some(stop_tx),
            task: Some(task),
        })
    }

    /// Whether the key is known to be in etcd under a live lease right now
    /// (false from a failed keepalive until registration succeeds again).
    pub fn is_registered(&self) -> bool {
        self.state.registered.load(Ordering::Acquire)
    }

    /// The etcd key this worker is registered under.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The lease currently holding the key, if registered.
    pub fn lease_id(&self) -> Option<i64> {
        match self.state.lease.load(Ordering::Acquire) {
            0 => None,
            id => Some(id),
        }
    }

    /// Removes the key and revokes the lease (best effort, bounded by a short
    /// timeout, so a dead etcd cannot hold up a node that is stopping), then
    /// stops and joins the task. Revoking is what removes the key: etcd
    /// deletes it atomically with the lease, and only if it is still ours.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            // Err: the task already ended (it only does so when told to).
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take()
            && let Err(e) = task.await
        {
            error!(key = self.key, error = %e, "registration task failed");
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        // Abort before the stop sender is dropped, and the task treats a
        // dropped sender as "leave the key" anyway: a dropped handle must look
        // like a crash, so the key lingers until the lease expires.
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// One granted lease with its keepalive stream.
struct Lease {
    client: Client,
    id: i64,
    ttl: Duration,
    keeper: LeaseKeeper,
    responses: LeaseKeepAliveStream,
}

impl Lease {
    /// Grant, put, open the keepalive stream: after this the key is visible
    /// and will stay so while [`Lease::renew`] succeeds.
    async fn grant(cfg: &EtcdConfig, key: &str, value: &[u8]) -> Result<Lease, DiscoveryError> {
        let mut client = connect(cfg).await?;
        let grant = client
            .lease_grant(cfg.ttl_secs(), None)
            .await
            .map_err(classify)?;
        let id = grant.id();
        // etcd may raise the TTL to its minimum; renew against what it granted.
        let ttl = Duration::from_secs(grant.ttl().max(1).unsigned_abs());
        client
            .put(key, value, Some(PutOptions::new().with_lease(id)))
            .await
            .map_err(classify)?;
        let (keeper, responses) = client.lease_keep_alive(id).await.map_err(classify)?;
        Ok(Lease {
            client,
            id,
            ttl,
            keeper,
            responses,
        })
    }

    fn renew_every(&self) -> Duration {
        self.ttl / 3
    }

    /// One keepalive round trip. A TTL of 0 in the answer means the lease is
    /// gone (it expired while we could not reach etcd), and so is the key.
    async fn renew(&mut self) -> Result<(), DiscoveryError> {
        self.keeper.keep_alive().await.map_err(classify)?;
        match self.responses.message().await.map_err(classify)? {
            Some(r) if r.ttl() > 0 => Ok(()),
            Some(_) => Err(DiscoveryError::LeaseExpired(self.id)),
            None => Err(DiscoveryError::Unreachable(
                "etcd closed the lease keepalive stream".into(),
            )),
        }
    }

    /// Revokes `id` (ours or an older one), best effort: a lease we fail to
    /// revoke expires on its own.
    async fn revoke(&mut self, id: i64) -> Result<(), DiscoveryError> {
        let client = &mut self.client;
        let revoke = async { client.lease_revoke(id).await.map_err(classify) };
        bounded(SHUTDOWN_TIMEOUT, "lease revoke", revoke)
            .await
            .map(drop)
    }
}

enum Step {
    /// Told to stop: `true` for shutdown (remove the key), `false` when the
    /// handle was dropped (leave it, like a crash).
    Stop(bool),
    Renewed(Result<(), DiscoveryError>),
    // Boxed: a Client is several KiB.
    Registered(Result<Box<Lease>, DiscoveryError>),
}

async fn run(
    cfg: EtcdConfig,
    key: String,
    value: Vec<u8>,
    state: Arc<State>,
    lease: Box<Lease>,
    mut stop: oneshot::Receiver<()>,
) {
    let mut lease = Some(lease);
    let mut outage = Outage::default();
    let mut backoff = Backoff::new();
    // A lease we lost contact with; revoked once a new one holds the key so
    // it does not linger in etcd for a full TTL.
    let mut stale: Option<i64> = None;
    loop {
        let step = match lease.as_mut() {
            Some(l) => {
                let every = l.renew_every();
                let renew = async {
                    tokio::time::sleep(every).await;
                    bounded(
                        every.max(Duration::from_secs(1)),
                        "lease keepalive",
                        l.renew(),
                    )
                    .await
                };
                tokio::select! {
                    biased;
                    r = &mut stop => Step::Stop(r.is_ok()),
                    r = renew => Step::Renewed(r),
                }
            }
            None => {
                let attempt = bounded(
                    CONNECT_TIMEOUT,
                    "registration",
                    Lease::grant(&cfg, &key, &value),
                );
                tokio::select! {
                    biased;
                    r = &mut stop => Step::Stop(r.is_ok()),
                    r = attempt => Step::Registered(r.map(Box::new)),
                }
            }
        };
        match step {
            Step::Stop(graceful) => {
                if graceful && let Some(mut l) = lease.take() {
                    let id = l.id;
                    match l.revoke(id).await {
                        Ok(()) => info!(key, lease = id, "deregistered from etcd"),
                        Err(e) => {
                            warn!(key, lease = id, error = %e, "could not deregister; the key expires with its lease")
                        }
                    }
                }
                state.set(None);
                return;
            }
            Step::Renewed(Ok(())) => {}
            Step::Renewed(Err(e)) => {
                state.set(None);
                stale = lease.take().map(|l| l.id);
                if outage.failed() {
                    warn!(key, error = %e, "lost the etcd lease; still serving, retrying registration");
                }
            }
            Step::Registered(Ok(mut l)) => {
                state.set(Some(l.id));
                backoff.reset();
                if let Some(down) = outage.recovered() {
                    info!(key, lease = l.id, after = ?down, "registered in etcd again");
                }
                if let Some(old) = stale.take() {
                    // Usually already expired; nothing to do then.
                    if let Err(e) = l.revoke(old).await {
                        debug!(lease = old, error = %e, "revoking the lost lease failed");
                    }
                }
                lease = Some(l);
            }
            Step::Registered(Err(e)) => {
                if outage.failed() {
                    warn!(key, error = %e, "etcd unreachable; still serving, retrying registration");
                } else {
                    debug!(key, error = %e, "registration retry failed");
                }
                let delay = backoff.next_delay();
                tokio::select! {
                    biased;
                    r = &mut stop => {
                        // Not registered: nothing to remove either way.
                        let _ = r;
                        state.set(None);
                        return;
                    }
                    () = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
}
