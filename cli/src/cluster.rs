//! The disaggregated roles: `tandem prefill`, `tandem decode`, `tandem
//! router`, and `tandem cluster up`, which starts etcd, nodes and a router
//! as processes on loopback (for people and tests).

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use tandem_decode_node::{DecodeConfig, DecodeService};
use tandem_discovery::{EtcdConfig, EtcdSecurity, EtcdTls, EtcdUser, Role};
use tandem_dkv::TransportKind;
use tandem_frontend::AppState;
use tandem_modelfile::ModelMeta;
use tandem_prefill_node::PrefillService;
use tandem_proto::tls::{ClusterTls, PeerConnector, TlsFiles};
use tandem_router::ClusterBackend;
use tandem_router::cluster::{ClusterHandle, RoutingConfig};
use tandem_types::RequestLimits;
use tandem_worker::node::serve as serve_node;
use tandem_worker::service::WorkerService;
use tandem_worker::{NodeCore, NodeOptions};

use crate::serve::{
    EngineArgs, HttpArgs, SHUTDOWN_GRACE, parse_addr, runtime, served_name, shutdown_signal,
};
use crate::telemetry::{Telemetry, TelemetryArgs};

/// Where the cluster's etcd is and how workers register there.
#[derive(Debug, Args)]
pub struct EtcdArgs {
    /// etcd client URL(s), comma-separated (e.g. http://127.0.0.1:2379).
    #[arg(long, env = "TANDEM_ETCD", value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// Cluster name: workers and routers of one cluster share it.
    #[arg(long, env = "TANDEM_CLUSTER", default_value = "default")]
    pub cluster: String,
    /// Lease TTL in seconds: how long a crashed worker stays listed.
    #[arg(long, env = "TANDEM_LEASE_TTL", default_value_t = 5)]
    pub lease_ttl: u64,
    /// PEM CA of etcd's server certificate (for https:// etcd endpoints).
    #[arg(long, env = "TANDEM_ETCD_CA")]
    pub etcd_ca: Option<PathBuf>,
    /// PEM client certificate for an etcd run with --client-cert-auth.
    #[arg(long, env = "TANDEM_ETCD_CERT", requires = "etcd_key")]
    pub etcd_cert: Option<PathBuf>,
    /// PEM private key of --etcd-cert.
    #[arg(long, env = "TANDEM_ETCD_KEY", requires = "etcd_cert")]
    pub etcd_key: Option<PathBuf>,
    /// etcd user (etcd's own authentication; the password from
    /// TANDEM_ETCD_PASSWORD or --etcd-password-file).
    #[arg(long, env = "TANDEM_ETCD_USER")]
    pub etcd_user: Option<String>,
    /// The etcd user's password (prefer the environment variable or
    /// --etcd-password-file: a flag shows in the process list).
    #[arg(long, env = "TANDEM_ETCD_PASSWORD", hide_env_values = true)]
    pub etcd_password: Option<String>,
    /// File holding the etcd user's password (first line).
    #[arg(long, env = "TANDEM_ETCD_PASSWORD_FILE")]
    pub etcd_password_file: Option<PathBuf>,
}

impl EtcdArgs {
    fn security(&self) -> Result<EtcdSecurity> {
        let read = |p: &PathBuf, what: &str| {
            std::fs::read(p).with_context(|| format!("reading {what} {}", p.display()))
        };
        let tls = match &self.etcd_ca {
            None if self.etcd_cert.is_some() => bail!("--etcd-cert needs --etcd-ca"),
            None => None,
            Some(ca) => Some(EtcdTls {
                ca_pem: read(ca, "--etcd-ca")?,
                identity: match (&self.etcd_cert, &self.etcd_key) {
                    (Some(c), Some(k)) => Some((read(c, "--etcd-cert")?, read(k, "--etcd-key")?)),
                    _ => None,
                },
            }),
        };
        let password = match (&self.etcd_password_file, &self.etcd_password) {
            (Some(_), Some(_)) => {
                bail!("--etcd-password and --etcd-password-file are alternatives")
            }
            (Some(f), None) => Some(
                std::fs::read_to_string(f)
                    .with_context(|| format!("reading --etcd-password-file {}", f.display()))?
                    .lines()
                    .next()
                    .unwrap_or_default()
                    .to_string(),
            ),
            (None, p) => p.clone(),
        };
        let user = match (&self.etcd_user, password) {
            (Some(name), Some(password)) => Some(EtcdUser {
                name: name.clone(),
                password,
            }),
            (Some(_), None) => {
                bail!(
                    "--etcd-user needs --etcd-password (TANDEM_ETCD_PASSWORD) or --etcd-password-file"
                )
            }
            (None, Some(_)) => bail!("an etcd password was given without --etcd-user"),
            (None, None) => None,
        };
        Ok(EtcdSecurity { tls, user })
    }

    fn config(&self) -> Result<Option<EtcdConfig>> {
        if self.etcd.is_empty() {
            return Ok(None);
        }
        let c = EtcdConfig {
            endpoints: self.etcd.clone(),
            cluster: self.cluster.clone(),
            lease_ttl: Duration::from_secs(self.lease_ttl),
            security: self.security()?,
        };
        c.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(Some(c))
    }
}

/// The process's identity in the cluster: mutual TLS on every internal gRPC
/// connection (all three flags, or none for plaintext).
#[derive(Debug, Args)]
pub struct ClusterTlsArgs {
    /// PEM file of the cluster CA: peers must present certificates it signed.
    #[arg(long, env = "TANDEM_CLUSTER_CA")]
    pub cluster_ca: Option<PathBuf>,
    /// PEM certificate (chain) of this process, signed by the cluster CA; for
    /// nodes its names must cover --advertise-host.
    #[arg(long, env = "TANDEM_CLUSTER_CERT")]
    pub cluster_cert: Option<PathBuf>,
    /// PEM private key of --cluster-cert.
    #[arg(long, env = "TANDEM_CLUSTER_KEY")]
    pub cluster_key: Option<PathBuf>,
    /// The DNS name every node certificate carries, checked instead of the
    /// dialled host (for pods, whose addresses no certificate can name).
    #[arg(long, env = "TANDEM_CLUSTER_SERVER_NAME", requires = "cluster_ca")]
    pub cluster_server_name: Option<String>,
}

impl ClusterTlsArgs {
    fn load(&self) -> Result<Option<ClusterTls>> {
        match (&self.cluster_ca, &self.cluster_cert, &self.cluster_key) {
            (None, None, None) => Ok(None),
            (Some(ca), Some(cert), Some(key)) => {
                let files = TlsFiles {
                    ca: ca.clone(),
                    cert: cert.clone(),
                    key: key.clone(),
                    server_name: self.cluster_server_name.clone(),
                };
                Ok(Some(ClusterTls::load(&files)?))
            }
            _ => bail!("--cluster-ca, --cluster-cert and --cluster-key go together"),
        }
    }
}

/// Flags of a prefill or decode node.
#[derive(Debug, Args)]
pub struct NodeArgs {
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// Address the gRPC and metrics servers bind.
    #[arg(long, env = "TANDEM_HOST", default_value = "127.0.0.1")]
    pub host: String,
    /// gRPC port (0 picks a free one; the bound port is printed).
    #[arg(long, env = "TANDEM_PORT", default_value_t = 0)]
    pub port: u16,
    /// Port of /metrics and /health (0 picks a free one; printed).
    #[arg(long, env = "TANDEM_METRICS_PORT", default_value_t = 0)]
    pub metrics_port: u16,
    /// Host other processes dial, as advertised in etcd.
    #[arg(long, env = "TANDEM_ADVERTISE_HOST", default_value = "127.0.0.1")]
    pub advertise_host: String,
    /// Worker id in the membership (default: role-pid).
    #[arg(long, env = "TANDEM_WORKER_ID")]
    pub id: Option<String>,
    /// KV transfer connector: ucx (libucp; UCX_TLS picks tcp/shm/rdma) or local (in-process only).
    #[arg(long, env = "TANDEM_KV_CONNECTOR", default_value = "ucx", value_parser = ["ucx", "local"])]
    pub kv_connector: String,
    /// UCX transports (UCX_TLS) for the ucx connector, e.g. tcp or posix,sysv,cma,self.
    #[arg(long, env = "TANDEM_UCX_TLS")]
    pub ucx_tls: Option<String>,
    /// Network interfaces the ucx connector uses (UCX_NET_DEVICES, e.g.
    /// eth0 or mlx5_0:1). Default: the interface holding --advertise-host
    /// (lo for 127.0.0.1), so KV ports never open on other interfaces.
    #[arg(long, env = "TANDEM_UCX_NET_DEVICES")]
    pub ucx_net_devices: Option<String>,
    /// UCX's libucp, loaded when the ucx connector starts (default
    /// `libucp.so.0` from the library path: Debian's libucx0).
    #[arg(long, env = "TANDEM_UCX_LIBRARY")]
    pub ucx_library: Option<PathBuf>,
    /// File holding the cluster's dKV key (64 hex digits, e.g. from
    /// `openssl rand -hex 32`): KV addresses are sealed with it and a
    /// peer's must verify under it. Default: the key in etcd under the
    /// cluster's prefix, created by the first node (etcd access is then
    /// key access: run etcd with authentication).
    #[arg(long, env = "TANDEM_DKV_KEY_FILE")]
    pub dkv_key_file: Option<PathBuf>,
    #[command(flatten)]
    pub tls: ClusterTlsArgs,
    /// Close gRPC connections that carried no traffic for this many seconds.
    #[arg(long, env = "TANDEM_GRPC_IDLE_TIMEOUT_SECS", default_value_t = 300)]
    pub grpc_idle_timeout_secs: u64,
    /// Prefix-cache events kept for routers that reconnect (a router
    /// further behind rebuilds its view from scratch); each holds a few
    /// hundred bytes until the ring is full.
    #[arg(long, env = "TANDEM_KV_EVENT_RING", default_value_t = tandem_worker::node::EVENT_RING)]
    pub kv_event_ring: usize,
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
}

/// The interface holding `host`'s address (resolved if it is a name).
fn interface_of(host: &str) -> Option<String> {
    use std::net::ToSocketAddrs;
    let ips: Vec<std::net::IpAddr> = (host, 0).to_socket_addrs().ok()?.map(|a| a.ip()).collect();
    if_addrs::get_if_addrs()
        .ok()?
        .into_iter()
        .find(|i| ips.contains(&i.ip()))
        .map(|i| i.name)
}

#[derive(Debug, Args)]
pub struct PrefillArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub node: NodeArgs,
}

#[derive(Debug, Args)]
pub struct DecodeArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub node: NodeArgs,
    /// Prompts with fewer uncached tokens than this are prefilled here.
    #[arg(long, env = "TANDEM_REMOTE_PREFILL_MIN_TOKENS", default_value_t = 64)]
    pub remote_prefill_min_tokens: usize,
    /// Decode-stall watchdog: a remote prefill taking longer is abandoned
    /// and the prompt prefilled here.
    #[arg(long, env = "TANDEM_PREFILL_TIMEOUT_MS", default_value_t = 30_000)]
    pub prefill_timeout_ms: u64,
    /// A failed or abandoned transfer's blocks stay out of use while a
    /// write its grant accepted is still landing (a frozen peer mid-way);
    /// at most this many seconds, then they are released anyway (logged).
    #[arg(long, env = "TANDEM_QUARANTINE_LIMIT_SECS", default_value_t = 600)]
    pub quarantine_limit_secs: u64,
}

#[derive(Debug, Args)]
pub struct RouterArgs {
    /// The model whose tokenizer and chat template the router uses (the
    /// workers' model: checked against their fingerprints).
    #[arg(long, env = "TANDEM_MODEL", default_value = tandem_modelfile::fetch::DEFAULT_MODEL)]
    pub model: String,
    /// Where fetched models are cached.
    #[arg(long, env = "TANDEM_CACHE")]
    pub cache_dir: Option<PathBuf>,
    #[command(flatten)]
    pub http: HttpArgs,
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// Longest sequence admitted (default: the model's context, at most 8192).
    #[arg(long, env = "TANDEM_MAX_LENGTH")]
    pub max_length: Option<usize>,
    /// KV block size of the workers (part of their fingerprint).
    #[arg(long, env = "TANDEM_KV_CACHE_PAGE_SIZE", default_value_t = 16)]
    pub kv_cache_page_size: usize,
    /// Routing cost of one prompt block a worker lacks.
    #[arg(long, env = "TANDEM_PREFILL_WEIGHT", default_value_t = 1.0)]
    pub prefill_weight: f64,
    /// Routing cost of one queued request.
    #[arg(long, env = "TANDEM_QUEUE_WEIGHT", default_value_t = 8.0)]
    pub queue_weight: f64,
    /// Prefill workers named per request, best first (the rest are retries).
    #[arg(long, env = "TANDEM_PREFILL_CANDIDATES", default_value_t = 2)]
    pub prefill_candidates: usize,
    /// Threads of the router's async runtime. One spends the least CPU per
    /// request (no cross-thread wake-ups; measured 113 vs 127 us per
    /// request and 3.8 vs 5.3 us per streamed token with two) and carries
    /// about 6,000 requests per second; raise it beyond that.
    #[arg(long, env = "TANDEM_IO_THREADS", default_value_t = 1)]
    pub io_threads: usize,
    #[command(flatten)]
    pub tls: ClusterTlsArgs,
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
}

fn node_options(node: &NodeArgs, role: Role) -> Result<NodeOptions> {
    let transport = match node.kv_connector.as_str() {
        "local" => TransportKind::InProcess,
        _ => TransportKind::Ucx,
    };
    Ok(NodeOptions {
        role,
        id: node
            .id
            .clone()
            .unwrap_or_else(|| format!("{}-{}", role.as_str(), std::process::id())),
        grpc_addr: parse_addr(&node.host, node.port)?,
        metrics_addr: parse_addr(&node.host, node.metrics_port)?,
        advertise_host: node.advertise_host.clone(),
        etcd: node.etcd.config()?,
        transport,
        ucx_tls: node.ucx_tls.clone(),
        ucx_library: node.ucx_library.clone(),
        ucx_net_devices: match &node.ucx_net_devices {
            Some(d) => Some(d.clone()),
            None if transport == TransportKind::Ucx => {
                let found = interface_of(&node.advertise_host);
                if found.is_none() {
                    tracing::warn!(
                        "no interface holds --advertise-host {}; UCX may listen on every \
                         interface (set --ucx-net-devices)",
                        node.advertise_host
                    );
                }
                found
            }
            None => None,
        },
        // Set by `run_node` (it may come from etcd).
        dkv_key: None,
        shutdown_grace: SHUTDOWN_GRACE,
        tls: node.tls.load()?,
        grpc_idle_timeout: match node.grpc_idle_timeout_secs {
            0 => bail!("--grpc-idle-timeout-secs must be at least 1"),
            s => Duration::from_secs(s),
        },
        kv_event_ring: match node.kv_event_ring {
            0 => bail!("--kv-event-ring must be at least 1"),
            n => n,
        },
    })
}

fn run_node(
    engine: &EngineArgs,
    node: &NodeArgs,
    role: Role,
    decode: Option<DecodeConfig>,
) -> Result<()> {
    let mut opts = node_options(node, role)?;
    if let Some(d) = &decode {
        d.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    let rt = runtime()?;
    // Before anything records: instruments made earlier would be no-ops.
    let telemetry = {
        let _rt = rt.enter();
        Telemetry::install(role.as_str(), &node.telemetry)?
    };
    let key = rt.block_on(crate::dkv_key::resolve(
        node.dkv_key_file.as_deref(),
        opts.etcd.as_ref(),
    ));
    let result = key.and_then(|key| {
        opts.dkv_key = Some(key);
        serve_node_role(engine, &opts, decode, &rt, &telemetry)
    });
    telemetry.shutdown();
    rt.shutdown_timeout(Duration::from_secs(1));
    eprintln!("tandem: {} node stopped", role.as_str());
    result
}

fn serve_node_role(
    engine: &EngineArgs,
    opts: &NodeOptions,
    decode: Option<DecodeConfig>,
    rt: &tokio::runtime::Runtime,
    telemetry: &Telemetry,
) -> Result<()> {
    let render = telemetry.render();
    let served = engine.load_served(opts.role == Role::Prefill)?;
    eprintln!(
        "tandem: {} node loaded {}; engine: {}",
        opts.role.as_str(),
        served.model.text().name,
        served.summary
    );
    let sched = engine.scheduler_config(served.model.config().context_length)?;
    let model = served.model;
    rt.block_on(async {
        let (core, scheduler) = NodeCore::start(model, sched, opts)?;
        let mut builder = tandem_worker::grpc::server(opts)?;
        let worker = WorkerService::new(Arc::clone(&core)).into_server();
        let r = match decode {
            None => {
                let grpc = builder
                    .add_service(worker)
                    .add_service(PrefillService::new(Arc::clone(&core)).into_server());
                serve_node(Arc::clone(&core), opts, grpc, render, shutdown_signal()).await
            }
            Some(cfg) => {
                let svc = DecodeService::new(Arc::clone(&core), cfg);
                let grpc = builder
                    .add_service(worker)
                    .add_service(svc.clone().into_server());
                let r = serve_node(Arc::clone(&core), opts, grpc, render, shutdown_signal()).await;
                svc.drain(SHUTDOWN_GRACE).await;
                r
            }
        };
        drop(core);
        // Every handle is gone with the node's tasks; the actor can stop.
        tokio::task::spawn_blocking(move || scheduler.shutdown())
            .await
            .context("stopping the scheduler")?;
        r.map_err(anyhow::Error::from)
    })
}

pub fn run_prefill(args: PrefillArgs) -> Result<()> {
    run_node(&args.engine, &args.node, Role::Prefill, None)
}

pub fn run_decode(args: DecodeArgs) -> Result<()> {
    let cfg = DecodeConfig {
        remote_prefill_min_tokens: args.remote_prefill_min_tokens,
        prefill_timeout: Duration::from_millis(args.prefill_timeout_ms),
        quarantine_limit: Duration::from_secs(args.quarantine_limit_secs),
    };
    run_node(&args.engine, &args.node, Role::Decode, Some(cfg))
}

pub fn run_router(args: RouterArgs) -> Result<()> {
    let addr = args.http.addr()?;
    let Some(etcd) = args.etcd.config()? else {
        bail!("--etcd is required: the router finds its workers there");
    };
    let routing = RoutingConfig {
        prefill_weight: args.prefill_weight,
        queue_weight: args.queue_weight,
        prefill_candidates: args.prefill_candidates,
        decode_attempts: 2,
    };
    routing.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
    if args.kv_cache_page_size == 0 {
        bail!("--kv-cache-page-size must be at least 1");
    }
    if args.io_threads == 0 {
        bail!("--io-threads must be at least 1");
    }
    let rt = crate::serve::runtime_with(Some(args.io_threads))?;
    let telemetry = {
        let _rt = rt.enter();
        Telemetry::install("router", &args.telemetry)?
    };
    let result = route(&args, addr, &etcd, routing, &rt, &telemetry);
    telemetry.shutdown();
    rt.shutdown_timeout(Duration::from_secs(1));
    eprintln!("tandem: router stopped");
    result
}

fn route(
    args: &RouterArgs,
    addr: std::net::SocketAddr,
    etcd: &EtcdConfig,
    routing: RoutingConfig,
    rt: &tokio::runtime::Runtime,
    telemetry: &Telemetry,
) -> Result<()> {
    let cache = args
        .cache_dir
        .clone()
        .unwrap_or_else(tandem_modelfile::fetch::cache_dir);
    let path = crate::fetch::resolve_model(&args.model, &cache)?;
    // The router never runs the model: it reads the tokenizer, template
    // and fingerprint, not the weights.
    let m = ModelMeta::load(&path).with_context(|| format!("reading {}", path.display()))?;
    let context = m.config.context_length;
    let max_length = args.max_length.unwrap_or(context.min(8192));
    if max_length < 2 || max_length > context {
        bail!(
            "--max-length {max_length} must be between 2 and the model's context length {context}"
        );
    }
    let fingerprint = m.fingerprint(args.kv_cache_page_size);
    let server = args.http.server_config(served_name(&args.model, &path))?;
    let limits = RequestLimits {
        max_length,
        vocab_size: m.config.vocab_size,
    };
    let text = Arc::new(m.text);
    let peers = PeerConnector::new(args.tls.load()?);
    let http_tls = args.http.tls()?;
    crate::release_freed_memory();
    rt.block_on(async {
        let cluster = ClusterHandle::start(etcd, fingerprint, routing, peers)
            .await
            .map_err(|e| anyhow::anyhow!(e))?;
        let backend = ClusterBackend::new(Arc::clone(&cluster.cluster), limits);
        let state = AppState::new(text, Arc::new(backend), server.clone());
        state.set_metrics_renderer(telemetry.render());
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        let local = listener.local_addr().context("reading the bound address")?;
        {
            let mut out = std::io::stdout().lock();
            writeln!(
                out,
                "tandem: router for {} on {}://{local} (cluster {})",
                server.model_name,
                if http_tls.is_some() { "https" } else { "http" },
                etcd.cluster
            )?;
            out.flush()?;
        }
        let r = args.http.serve(listener, state, http_tls).await;
        cluster.shutdown().await;
        r
    })
}

#[derive(Debug, Subcommand)]
pub enum ClusterCommand {
    /// Start etcd, prefill and decode nodes and a router on loopback; stop them all on Ctrl-C.
    Up(ClusterUpArgs),
}

#[derive(Debug, Args)]
pub struct ClusterUpArgs {
    /// Prefill nodes.
    #[arg(long, env = "TANDEM_CLUSTER_PREFILL", default_value_t = 1)]
    pub prefill: usize,
    /// Decode nodes.
    #[arg(long, env = "TANDEM_CLUSTER_DECODE", default_value_t = 1)]
    pub decode: usize,
    /// Router port.
    #[arg(long, env = "TANDEM_PORT", default_value_t = 8000)]
    pub port: u16,
    /// Model for every process.
    #[arg(long, env = "TANDEM_MODEL", default_value = tandem_modelfile::fetch::DEFAULT_MODEL)]
    pub model: String,
    /// Use this etcd instead of starting one.
    #[arg(long, env = "TANDEM_ETCD")]
    pub etcd: Option<String>,
    /// Kernel threads per node.
    #[arg(long, env = "TANDEM_THREADS", default_value_t = 1)]
    pub threads: usize,
    /// KV connector of the nodes.
    #[arg(long, env = "TANDEM_KV_CONNECTOR", default_value = "ucx", value_parser = ["ucx", "local"])]
    pub kv_connector: String,
    /// The nodes' dKV key file (see `tandem prefill --help`); default: a
    /// key the nodes create in the cluster's etcd.
    #[arg(long, env = "TANDEM_DKV_KEY_FILE")]
    pub dkv_key_file: Option<PathBuf>,
    /// Passed on to every process.
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
}

/// Children stopped when dropped, in drain order: the router first (it
/// stops taking requests and finishes its streams), then the nodes (they
/// drain and deregister from etcd), then etcd. Each stage gets SIGTERM,
/// then SIGKILL after a deadline.
struct Procs(Vec<(String, Stage, Child)>);

/// When a child stops: higher stages first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Stage {
    Etcd,
    Node,
    Router,
}

impl Procs {
    fn push(&mut self, name: &str, stage: Stage, child: Child) {
        self.0.push((name.to_string(), stage, child));
    }
}

impl Drop for Procs {
    fn drop(&mut self) {
        for stage in [Stage::Router, Stage::Node, Stage::Etcd] {
            let group: Vec<_> = self.0.iter_mut().filter(|(_, s, _)| *s == stage).collect();
            stop_all(group);
        }
    }
}

/// SIGTERM to each, then waits for all (SIGKILL past a deadline above the
/// binary's own drain grace).
fn stop_all(mut group: Vec<&mut (String, Stage, Child)>) {
    for (_, _, c) in group.iter_mut() {
        if let Ok(None) = c.try_wait() {
            // SAFETY: plain kill(2) on our own, not yet reaped child's pid.
            unsafe { libc_kill(c.id() as i32, 15) };
        }
    }
    let deadline = Instant::now() + SHUTDOWN_GRACE + Duration::from_secs(5);
    for (name, _, c) in group {
        while Instant::now() < deadline {
            if let Ok(Some(_)) = c.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        if let Ok(None) = c.try_wait() {
            eprintln!("tandem cluster: {name} did not stop; killing it");
            let _ = c.kill();
        }
        let _ = c.wait();
    }
}

/// A terminal's Ctrl-C signals the whole foreground process group; each
/// child gets its own group so that only we see it and stop them in order.
fn own_group(cmd: &mut Command) -> &mut Command {
    std::os::unix::process::CommandExt::process_group(cmd, 0)
}

unsafe extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(l.local_addr()?.port())
}

/// Starts `cmd` and waits for its stdout line containing `marker`.
fn start(
    procs: &mut Procs,
    name: &str,
    stage: Stage,
    mut cmd: Command,
    marker: &str,
) -> Result<String> {
    let mut child = own_group(&mut cmd)
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {name}"))?;
    let stdout = child.stdout.take().context("child stdout")?;
    procs.push(name, stage, child);
    let mut lines = BufReader::new(stdout).lines();
    loop {
        match lines.next() {
            Some(Ok(line)) => {
                println!("[{name}] {line}");
                if line.contains(marker) {
                    // Keep draining its stdout so it never blocks on a full pipe.
                    std::thread::spawn(move || lines.for_each(drop));
                    return Ok(line);
                }
            }
            _ => bail!("{name} exited before it was ready"),
        }
    }
}

pub fn run_cluster(cmd: ClusterCommand) -> Result<()> {
    let ClusterCommand::Up(args) = cmd;
    if args.prefill == 0 && args.decode == 0 {
        bail!("--decode must be at least 1");
    }
    if args.decode == 0 {
        bail!("--decode must be at least 1 (the router needs a decode node)");
    }
    args.telemetry.validate()?;
    if let Some(f) = &args.dkv_key_file {
        crate::dkv_key::read(f)?;
    }
    let telemetry = |c: &mut Command| {
        if let Some(e) = &args.telemetry.otlp_endpoint {
            c.args(["--otlp-endpoint", e]);
        }
    };
    let exe = std::env::current_exe().context("locating the tandem binary")?;
    let mut procs = Procs(Vec::new());
    let data = std::env::temp_dir().join(format!("tandem-cluster-etcd-{}", std::process::id()));
    let etcd_url = match &args.etcd {
        Some(u) => u.clone(),
        None => {
            let (client, peer) = (free_port()?, free_port()?);
            let url = format!("http://127.0.0.1:{client}");
            let peer_url = format!("http://127.0.0.1:{peer}");
            let mut c = Command::new("etcd");
            c.args(["--data-dir", &data.to_string_lossy()])
                .args([
                    "--listen-client-urls",
                    &url,
                    "--advertise-client-urls",
                    &url,
                ])
                .args([
                    "--listen-peer-urls",
                    &peer_url,
                    "--initial-advertise-peer-urls",
                    &peer_url,
                ])
                .args(["--initial-cluster", &format!("default={peer_url}")])
                .stderr(Stdio::null());
            let child = own_group(&mut c)
                .stdout(Stdio::null())
                .spawn()
                .context("starting etcd (apt install etcd-server)")?;
            procs.push("etcd", Stage::Etcd, child);
            let deadline = Instant::now() + Duration::from_secs(20);
            while std::net::TcpStream::connect(("127.0.0.1", client)).is_err() {
                if Instant::now() > deadline {
                    bail!("etcd did not start on {url}");
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            println!("tandem cluster: etcd on {url}");
            url
        }
    };
    let node = |role: &str, i: usize| {
        let mut c = Command::new(&exe);
        c.arg(role)
            .args(["--etcd", &etcd_url, "--model", &args.model])
            .args(["--id", &format!("{role}-{i}")])
            .args(["--threads", &args.threads.to_string()])
            .args(["--kv-connector", &args.kv_connector]);
        if let Some(f) = &args.dkv_key_file {
            c.arg("--dkv-key-file").arg(f);
        }
        telemetry(&mut c);
        c
    };
    for i in 0..args.prefill {
        start(
            &mut procs,
            &format!("prefill-{i}"),
            Stage::Node,
            node("prefill", i),
            "serving gRPC",
        )?;
    }
    for i in 0..args.decode {
        start(
            &mut procs,
            &format!("decode-{i}"),
            Stage::Node,
            node("decode", i),
            "serving gRPC",
        )?;
    }
    let mut router = Command::new(&exe);
    router
        .arg("router")
        .args(["--etcd", &etcd_url, "--model", &args.model])
        .args(["--port", &args.port.to_string()]);
    telemetry(&mut router);
    start(&mut procs, "router", Stage::Router, router, "router for")?;
    println!(
        "tandem cluster: up ({} prefill, {} decode); Ctrl-C stops it",
        args.prefill, args.decode
    );
    let rt = runtime()?;
    rt.block_on(shutdown_signal());
    drop(procs);
    let _ = std::fs::remove_dir_all(&data);
    Ok(())
}
