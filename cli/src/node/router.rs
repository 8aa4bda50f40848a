//! `tandem router`: the OpenAI API in front of the prefill and decode
//! nodes it finds in etcd.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use tandem_discovery::EtcdConfig;
use tandem_frontend::AppState;
use tandem_modelfile::ModelMeta;
use tandem_proto::tls::PeerConnector;
use tandem_router::ClusterBackend;
use tandem_router::cluster::{ClusterHandle, PolicyKind, RoutingConfig};
use tandem_types::RequestLimits;

use super::args::{ClusterTlsArgs, EtcdArgs};
use crate::serve::{HttpArgs, served_name};
use crate::telemetry::{Telemetry, TelemetryArgs};

/// `--routing-policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Policy {
    Cost,
    RoundRobin,
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
    /// How decode (and prefill) workers are chosen: `cost` weighs each
    /// worker's cached share of the prompt against its load (the weights
    /// below), `round-robin` takes them in turn.
    #[arg(long, env = "TANDEM_ROUTING_POLICY", value_enum, default_value_t = Policy::Cost)]
    pub routing_policy: Policy,
    /// Routing cost of one prompt block a worker lacks.
    #[arg(long, env = "TANDEM_PREFILL_WEIGHT", default_value_t = 1.0)]
    pub prefill_weight: f64,
    /// Routing cost of one prompt block a worker holds in host memory
    /// below its pool, as a fraction (0 to 1) of computing it.
    #[arg(long, env = "TANDEM_HOST_HIT_WEIGHT", default_value_t = 0.1)]
    pub host_hit_weight: f64,
    /// Routing cost of one prompt block a worker holds on disk, as a
    /// fraction (0 to 1) of computing it.
    #[arg(long, env = "TANDEM_DISK_HIT_WEIGHT", default_value_t = 0.3)]
    pub disk_hit_weight: f64,
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

pub fn run_router(args: RouterArgs) -> Result<()> {
    let addr = args.http.addr()?;
    let Some(etcd) = args.etcd.config()? else {
        bail!("--etcd is required: the router finds its workers there");
    };
    let routing = RoutingConfig {
        policy: match args.routing_policy {
            Policy::Cost => PolicyKind::Cost,
            Policy::RoundRobin => PolicyKind::RoundRobin,
        },
        prefill_weight: args.prefill_weight,
        host_hit_weight: args.host_hit_weight,
        disk_hit_weight: args.disk_hit_weight,
        queue_weight: args.queue_weight,
        prefill_candidates: args.prefill_candidates,
        decode_attempts: 2,
    };
    routing.validate()?;
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
        let cluster = ClusterHandle::start(etcd, fingerprint, routing, peers).await?;
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
