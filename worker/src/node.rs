//! A node's shared state and its serving lifecycle: bind, announce, register
//! in etcd, serve gRPC and HTTP, then drain and deregister on shutdown.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tandem_discovery::{EtcdConfig, Registration};
use tandem_dkv::{Dkv, DkvConfig, KvLayout, Region, TransportKind};
use tandem_engine::kv_cache::{ExternalMemory, ExternalOwner};
use tandem_engine::scheduler::{Scheduler, SchedulerConfig, SchedulerHandle};
use tandem_engine::{ModelFingerprint, ServedModel};
use tandem_proto::tls::{ClusterTls, PeerConnector};
use tandem_proto::{WorkerRecord, pb};
use tokio::net::TcpListener;

use crate::error::WorkerError;
use crate::events::EventHub;
use crate::http::{Health, MetricsRenderer};

pub use tandem_discovery::Role;

/// KV events kept for routers that reconnect, unless
/// [`NodeOptions::kv_event_ring`] says otherwise.
pub const EVENT_RING: usize = 65_536;
/// How often load is sampled, and broadcast to routers if it changed.
const LOAD_PERIOD: Duration = Duration::from_millis(100);
/// An unchanged load is broadcast this often: idle nodes, most of a large
/// cluster, would otherwise cost every router ten messages a second each.
const LOAD_HEARTBEAT: Duration = Duration::from_secs(1);

/// How a node is reached and where it registers.
#[derive(Debug, Clone)]
pub struct NodeOptions {
    pub role: Role,
    pub id: String,
    pub grpc_addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    /// Host put in the advertised endpoints.
    pub advertise_host: String,
    /// `None`: serve without registering (a node addressed directly).
    pub etcd: Option<EtcdConfig>,
    pub transport: TransportKind,
    pub ucx_tls: Option<String>,
    /// UCX's libucp (`None`: `libucp.so.0` from the library path).
    pub ucx_library: Option<std::path::PathBuf>,
    /// Interfaces dkv's UCX network transports use (`UCX_NET_DEVICES`).
    pub ucx_net_devices: Option<String>,
    /// The cluster's dKV key (peers' KV addresses must verify under it);
    /// `None`: a key of this process alone.
    pub dkv_key: Option<tandem_dkv::DkvKey>,
    /// How long in-flight requests may run on after a shutdown signal.
    pub shutdown_grace: Duration,
    /// Mutual TLS for gRPC, both as a server and towards peers.
    pub tls: Option<ClusterTls>,
    /// gRPC connections with no traffic for this long are closed.
    pub grpc_idle_timeout: Duration,
    /// Prefix-cache events kept for routers that reconnect ([`EVENT_RING`]
    /// by default); a router further behind rebuilds its view.
    pub kv_event_ring: usize,
}

/// Everything a node's request handlers share.
#[derive(Debug)]
pub struct NodeCore {
    pub id: String,
    pub role: Role,
    pub model: Arc<dyn ServedModel>,
    pub scheduler: SchedulerHandle,
    pub fingerprint: ModelFingerprint,
    pub dkv: Dkv,
    /// The whole KV pool, registered for KV transfers (tensor-parallel rank
    /// 0's); peers write only what a grant on it allows.
    pub region: Arc<Region>,
    /// Shape of this node's blocks (a rank's share of the KV heads).
    pub layout: KvLayout,
    /// Pools of tensor-parallel ranks 1.., registered; same shape as rank 0's.
    pub peer_regions: Vec<Region>,
    /// Shape of a whole-model block, as a TP=1 decode node holds it.
    pub full_layout: KvLayout,
    pub tp: usize,
    pub hub: Arc<EventHub>,
    /// How this node dials its peers (plaintext or mutual TLS).
    pub peers: PeerConnector,
    draining: AtomicBool,
    registration: Mutex<Option<Registration>>,
}

impl NodeCore {
    /// Starts the scheduler (publishing KV events to the hub) and registers
    /// its KV pool with the transfer engine. The returned [`Scheduler`] must
    /// outlive the node's serving and be shut down after it.
    pub fn start(
        model: Arc<dyn ServedModel>,
        config: SchedulerConfig,
        opts: &NodeOptions,
    ) -> Result<(Arc<Self>, Scheduler), WorkerError> {
        let hub = EventHub::new(opts.kv_event_ring);
        let fingerprint = model.fingerprint(config.block_size);
        let dkv = Dkv::new(DkvConfig {
            transport: opts.transport,
            ucx_tls: opts.ucx_tls.clone(),
            ucx_net_devices: opts.ucx_net_devices.clone(),
            ucx_library: opts.ucx_library.clone(),
            key: opts.dkv_key.clone(),
        })?;
        // The pool lives in memory the transfer engine allocates (suited to
        // its zero-copy receives); failing that, in our own memory,
        // registered.
        let kv = model.kv_cache_config(config.block_size, config.num_blocks);
        let bytes = kv.block_bytes() * kv.num_blocks;
        let external = match dkv.alloc(bytes) {
            Ok(r) => Some(Arc::new(r)),
            Err(e) => {
                tracing::warn!(
                    "transfer engine could not allocate the KV pool ({e}); registering our own"
                );
                None
            }
        };
        let memory = external.as_ref().map(|r| ExternalMemory {
            ptr: r.as_ptr(),
            len: r.len(),
            owner: Arc::clone(r) as ExternalOwner,
        });
        let scheduler =
            Scheduler::spawn_with_memory(Arc::clone(&model), config, Some(hub.sink()), memory)
                .map_err(|e| WorkerError::Internal(e.to_string()))?;
        let handle = scheduler.handle().clone();
        let (pool, kv) = handle.kv_pool();
        let region = match external {
            Some(r) => r,
            None => {
                let owner: Arc<dyn std::any::Any + Send + Sync> = Arc::clone(pool) as _;
                // SAFETY: the pool lives as long as `owner`, which the region keeps.
                Arc::new(unsafe { dkv.register(pool.as_mut_ptr(), pool.byte_len(), owner)? })
            }
        };
        let mut peer_regions = Vec::new();
        for p in handle.rank_pools().into_iter().skip(1) {
            let (ptr, len) = (p.as_mut_ptr(), p.byte_len());
            let owner: Arc<dyn std::any::Any + Send + Sync> = p;
            // SAFETY: the pool lives as long as `owner`, which the region keeps.
            peer_regions.push(unsafe { dkv.register(ptr, len, owner)? });
        }
        let layout = kv_layout(kv);
        // A whole-model block: every KV head, as a TP=1 decode node holds it.
        let heads = fingerprint.num_kv_heads as u64;
        let full_layer = layout.head_slice_bytes * 2 * heads;
        let full_layout = KvLayout {
            num_kv_heads: heads as u32,
            layer_bytes: full_layer,
            block_bytes: full_layer * u64::from(layout.num_layers),
            ..layout
        };
        let tp = handle.config().tp;
        let core = Arc::new(Self {
            id: opts.id.clone(),
            role: opts.role,
            model,
            scheduler: handle,
            fingerprint,
            dkv,
            region,
            layout,
            peer_regions,
            full_layout,
            tp,
            hub,
            peers: PeerConnector::new(opts.tls.clone()),
            draining: AtomicBool::new(false),
            registration: Mutex::new(None),
        });
        Ok((core, scheduler))
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    pub fn is_registered(&self) -> bool {
        self.registration
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .is_some_and(Registration::is_registered)
    }

    fn record(&self, grpc: SocketAddr, metrics: SocketAddr, host: &str) -> WorkerRecord {
        let c = self.scheduler.config();
        WorkerRecord {
            id: self.id.clone(),
            role: self.role.as_str().to_string(),
            grpc_endpoint: format!("{}://{host}:{}", self.peers.scheme(), grpc.port()),
            metrics_endpoint: format!("http://{host}:{}", metrics.port()),
            fingerprint: self.fingerprint.clone(),
            kv_blocks_total: c.num_blocks,
            max_batch_size: c.max_batch_size,
            tp: c.tp,
            dp: 1,
        }
    }

    /// What `/health` reports.
    fn health(&self) -> Health {
        let s = self.scheduler.stats();
        let load = |a: &std::sync::atomic::AtomicUsize| a.load(Ordering::Relaxed);
        let draining = self.is_draining();
        let failing = s.failing();
        let status = match (draining, failing) {
            (true, _) => "draining",
            (false, true) => "failing",
            (false, false) => "ok",
        };
        let body = serde_json::json!({
            "status": status,
            "id": self.id,
            "role": self.role.as_str(),
            "registered": self.is_registered(),
            "waiting": load(&s.waiting),
            "running": load(&s.running),
            "importing": load(&s.importing),
            "exported": load(&s.exported),
            "kv_blocks_total": load(&s.kv_blocks_total),
            "kv_blocks_in_use": load(&s.kv_blocks_in_use),
            "kv_blocks_cached": load(&s.kv_blocks_cached),
            "kv_connector": self.dkv.connector(),
            "last_kv_event_id": self.hub.last_id(),
        });
        Health {
            unavailable: draining || failing,
            body,
        }
    }

    fn load(&self) -> pb::Load {
        let s = self.scheduler.stats();
        let get = |a: &std::sync::atomic::AtomicUsize| a.load(Ordering::Relaxed) as u32;
        pb::Load {
            waiting: get(&s.waiting) + get(&s.importing),
            running: get(&s.running),
            kv_blocks_used: get(&s.kv_blocks_in_use),
            kv_blocks_total: get(&s.kv_blocks_total),
        }
    }
}

fn kv_layout(kv: &tandem_engine::kv_cache::KvCacheConfig) -> KvLayout {
    KvLayout {
        block_bytes: kv.block_bytes() as u64,
        layer_bytes: (kv.layer_len() * 2) as u64,
        head_slice_bytes: (kv.head_slice_len() * 2) as u64,
        num_layers: kv.n_layers as u32,
        num_kv_heads: kv.n_kv_heads as u32,
    }
}

/// Serves `grpc` (the role's services plus `service::WorkerService`)
/// and the HTTP endpoints until `shutdown` resolves, registered in etcd
/// meanwhile. Prints the bound addresses on stdout (tests read them).
pub async fn serve(
    core: Arc<NodeCore>,
    opts: &NodeOptions,
    grpc: tonic::transport::server::Router,
    render: MetricsRenderer,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), WorkerError> {
    let bind = |addr: SocketAddr| async move {
        TcpListener::bind(addr)
            .await
            .map_err(|e| WorkerError::Internal(format!("binding {addr}: {e}")))
    };
    let grpc_listener = bind(opts.grpc_addr).await?;
    let http_listener = bind(opts.metrics_addr).await?;
    let local = |l: &TcpListener| {
        l.local_addr()
            .map_err(|e| WorkerError::Internal(format!("reading the bound address: {e}")))
    };
    let (grpc_addr, http_addr) = (local(&grpc_listener)?, local(&http_listener)?);
    let record = core.record(grpc_addr, http_addr, &opts.advertise_host);
    println!(
        "tandem: {} node {} serving gRPC on {} and metrics on {} (KV connector {})",
        core.role.as_str(),
        core.id,
        record.grpc_endpoint,
        record.metrics_endpoint,
        core.dkv.connector(),
    );

    if let Some(etcd) = &opts.etcd {
        let reg = Registration::start(etcd, core.role, &core.id, record.encode())
            .await
            .map_err(|e| WorkerError::Internal(format!("registering in etcd: {e}")))?;
        *core
            .registration
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(reg);
    }

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let load_core = Arc::clone(&core);
    let mut load_stop = stop_rx.clone();
    let load_task = tokio::spawn(async move {
        let mut tick = tokio::time::interval(LOAD_PERIOD);
        let mut sent: Option<(pb::Load, std::time::Instant)> = None;
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    let load = load_core.load();
                    let due = sent.as_ref().is_none_or(|(last, at)| {
                        *last != load || at.elapsed() >= LOAD_HEARTBEAT
                    });
                    if due {
                        load_core.hub.push_load(load);
                        sent = Some((load, std::time::Instant::now()));
                    }
                }
                _ = load_stop.changed() => break,
            }
        }
    });

    let mut http_stop = stop_rx.clone();
    let health_core = Arc::clone(&core);
    let health = Arc::new(move || health_core.health());
    let http = tandem_http::serve_router(
        http_listener,
        crate::http::router(health, render),
        tandem_http::ConnectionLimits::default(),
        None,
        async move {
            let _ = http_stop.changed().await;
        },
        Duration::from_secs(1),
    );
    let http_task = tokio::spawn(http);

    let incoming = tokio_stream::wrappers::TcpListenerStream::new(grpc_listener);
    let idle = opts.grpc_idle_timeout;
    let incoming = futures_util::StreamExt::map(incoming, move |s| {
        s.map(|s| {
            let _ = s.set_nodelay(true);
            crate::grpc::IdleTimeoutIo::new(s, idle)
        })
    });
    let mut grpc_stop = stop_rx.clone();
    let grpc_task = tokio::spawn(grpc.serve_with_incoming_shutdown(incoming, async move {
        let _ = grpc_stop.changed().await;
    }));

    shutdown.await;
    core.draining.store(true, Ordering::Relaxed);
    // Leave the membership first so routers stop sending us work.
    let reg = core
        .registration
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take();
    if let Some(reg) = reg {
        reg.shutdown().await;
    }
    let _ = stop_tx.send(true);
    let grace = opts.shutdown_grace;
    let grpc_result = match tokio::time::timeout(grace, grpc_task).await {
        Ok(Ok(r)) => r.map_err(|e| WorkerError::Internal(format!("gRPC server: {e}"))),
        Ok(Err(e)) => Err(WorkerError::Internal(format!("gRPC server task: {e}"))),
        Err(_) => {
            tracing::warn!("in-flight requests did not finish within {grace:?}; stopping");
            Ok(())
        }
    };
    let _ = load_task.await;
    if let Ok(Err(e)) = tokio::time::timeout(Duration::from_secs(1), http_task)
        .await
        .map(|r| {
            r.map_err(|e| e.to_string())
                .and_then(|r| r.map_err(|e| e.to_string()))
        })
    {
        tracing::warn!("metrics server: {e}");
    }
    grpc_result
}
