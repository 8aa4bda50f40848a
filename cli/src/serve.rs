//! `tandem serve`: the OpenAI API with every role (router, prefill, decode)
//! in one process, over the engine's batch scheduler.

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;

use crate::kernel_args::KernelArgs;
use crate::telemetry::{Telemetry, TelemetryArgs};
use tandem_engine::ServedModel;
use tandem_engine::comm::{DeviceSpec, parse_devices};
use tandem_engine::mock::MockModel;
use tandem_engine::moe::Combine;
use tandem_engine::scheduler::{Scheduler, SchedulerConfig};
use tandem_frontend::auth::ApiKeys;
use tandem_frontend::reasoning::ReasoningParser;
use tandem_frontend::tools::ToolParser;
use tandem_frontend::{AppState, BodyPace, ServerConfig};
use tandem_http::HttpTls;
use tandem_kvtier::TierConfig;
use tandem_modelfile::{ModelMeta, fetch};
use tandem_perfmodel::EngineProfile;

use crate::local::LocalBackend;
use tandem_engine::comm::GpuSelection;
use tandem_gpu::runner::{GpuServed, KvCopyBack};

/// How long in-flight requests may run on after SIGINT/SIGTERM.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
/// `--max-length` default cap.
const DEFAULT_MAX_LENGTH: usize = 8192;
/// The default KV pool holds `max_batch_size` sequences of this many tokens.
const DEFAULT_SEQ_TOKENS: usize = 1024;

/// Flags of the model and its scheduler, shared by `serve`, `prefill` and
/// `decode`.
#[derive(Debug, Args)]
pub struct EngineArgs {
    /// A .gguf file, an HF model directory, an alias (smollm2-135m,
    /// qwen2.5-coder-0.5b, gemma3-270m), or a Hugging Face repo id
    /// ORG/NAME[@REVISION][:QUANT] (downloaded from $HF_ENDPOINT).
    #[arg(long, env = "TANDEM_MODEL", default_value = fetch::DEFAULT_MODEL)]
    pub model: String,
    /// Most sequences in one batch step.
    #[arg(long, env = "TANDEM_MAX_BATCH_SIZE", default_value_t = 32)]
    pub max_batch_size: usize,
    /// Most tokens (prompt chunks and decode tokens) in one batch step.
    #[arg(long, env = "TANDEM_MAX_BATCH_INPUT_TOKENS", default_value_t = 2048)]
    pub max_batch_input_tokens: usize,
    /// Longest sequence, prompt plus output (default: the model's context, at most 8192).
    #[arg(long, env = "TANDEM_MAX_LENGTH")]
    pub max_length: Option<usize>,
    /// Tokens per KV-cache block.
    #[arg(long, env = "TANDEM_KV_CACHE_PAGE_SIZE", default_value_t = 16)]
    pub kv_cache_page_size: usize,
    /// Blocks in the KV pool (default: max-batch-size sequences of 1024
    /// tokens, and at least one max-length sequence).
    #[arg(long, env = "TANDEM_KV_CACHE_BLOCKS")]
    pub kv_cache_blocks: Option<usize>,
    /// Do not reuse KV blocks of shared prompt prefixes.
    #[arg(long, env = "TANDEM_NO_PREFIX_CACHING")]
    pub no_prefix_caching: bool,
    /// KV tiers below the pool, as JSON: prefix blocks the pool evicts are
    /// kept in host memory (`host_kvcache_swap_space_gb`) and from there on
    /// disk (`disk_offload_dir`, `disk_offload_max_gb`, default 50,
    /// `disk_offload_direct_io`), and brought back instead of recomputed.
    /// E.g. '{"host_kvcache_swap_space_gb": 4, "disk_offload_dir": "/var/cache/tandem-kv"}'.
    #[arg(long, env = "TANDEM_KV_CONNECTOR_CONFIG", value_parser = parse_kv_tiers)]
    pub kv_connector_config: Option<TierConfig>,
    #[command(flatten)]
    pub kernels: KernelArgs,
    /// Tensor-parallel ranks (CPU threads sharing memory; must divide the
    /// model's heads, KV heads, FFN width and vocabulary).
    #[arg(long, env = "TANDEM_TP", default_value_t = 1)]
    pub tp: usize,
    /// Devices the ranks run on: `cpu` (one rank), `cpu:N` (N thread ranks,
    /// the same as --tp N), GPUs `gpu:I,J,...` (a tensor-parallel rank per
    /// GPU, on --gpu-runtime; partial sums are added through host memory),
    /// `gpu:all`, or `gpu:N` with --tp M (M ranks sharing one GPU).
    #[arg(long, env = "TANDEM_DEVICES", default_value = "cpu")]
    pub devices: String,
    /// How a mixture-of-experts model combines experts across ranks:
    /// `allreduce` (every rank routes every token, then an allreduce) or
    /// `dispatch` (tokens reduce-scattered, sent to their experts' ranks
    /// with all-to-all, then allgathered).
    #[arg(long, env = "TANDEM_MOE_COMBINE", default_value = "allreduce", value_parser = ["allreduce", "dispatch"])]
    pub moe_combine: String,
    /// Where fetched models are cached (default: $XDG_CACHE_HOME/tandem).
    #[arg(long, env = "TANDEM_CACHE")]
    pub cache_dir: Option<PathBuf>,
    /// What computes the steps: `model` (the forward pass) or `mock` (the
    /// model's tokenizer and KV shape without its weights, each step timed
    /// from --engine-profile; for router and cluster benchmarks).
    #[arg(long, env = "TANDEM_ENGINE", default_value = "model", value_parser = ["model", "mock"])]
    pub engine: String,
    /// The profile the mock engine times steps with (written by
    /// `tandem bench-engine --profile`).
    #[arg(long, env = "TANDEM_ENGINE_PROFILE")]
    pub engine_profile: Option<PathBuf>,
    /// The mock engine's step times are the profile's times this: 1 is the
    /// profiled engine, 0 answers at once.
    #[arg(long, env = "TANDEM_MOCK_TIME_SCALE", default_value_t = 1.0)]
    pub mock_time_scale: f64,
}

/// A model ready to serve, with what the startup line reports.
pub struct Served {
    pub model: Arc<dyn ServedModel>,
    pub path: PathBuf,
    /// "model (avx512vnni, 2 threads), loaded in 312 ms" or "mock (profile ...)".
    pub summary: String,
    /// What runs the steps: "cpu", "gpu:0 (<adapter>)" or "mock".
    pub device: String,
}

/// Flags of the OpenAI HTTP front end, shared by `serve` and `router`.
#[derive(Debug, Args)]
pub struct HttpArgs {
    /// Address to listen on.
    #[arg(long, env = "TANDEM_HOST", default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 picks a free one).
    #[arg(long, env = "TANDEM_PORT", default_value_t = 8000)]
    pub port: u16,
    /// Drop unknown request fields with a warning instead of answering 400.
    #[arg(long, env = "TANDEM_ALLOW_EXTRA_REQUEST_FIELDS")]
    pub allow_extra_request_fields: bool,
    /// Requests in flight beyond this are refused with 503.
    #[arg(long, env = "TANDEM_MAX_CONCURRENT_REQUESTS", default_value_t = 256)]
    pub max_concurrent_requests: usize,
    /// Largest accepted request body, in bytes.
    #[arg(long, env = "TANDEM_MAX_BODY_BYTES", default_value_t = 4 << 20)]
    pub max_body_bytes: usize,
    /// How the model writes tool calls: hermes (`<tool_call>` JSON
    /// blocks), llama3_json (the answer is one JSON call), or none (`tools`
    /// are refused).
    #[arg(long, env = "TANDEM_TOOL_PARSER", default_value = "hermes")]
    pub tool_parser: ToolParser,
    /// How the model marks its reasoning: think (`<think>...</think>`
    /// before the answer goes to `reasoning`, the rest to `content`) or
    /// none (everything is content).
    #[arg(long, env = "TANDEM_REASONING_PARSER", default_value = "none")]
    pub reasoning_parser: ReasoningParser,
    /// API keys clients must send (`Authorization: Bearer KEY`); repeat
    /// the flag or separate keys with commas. Without keys the API is open.
    #[arg(long = "api-key", env = "TANDEM_API_KEY", value_delimiter = ',')]
    pub api_keys: Vec<String>,
    /// A file of API keys, one per line (`#` starts a comment); re-read on
    /// SIGHUP, so keys can be rotated without a restart.
    #[arg(long, env = "TANDEM_API_KEY_FILE")]
    pub api_key_file: Option<PathBuf>,
    /// PEM certificate chain: serve HTTPS instead of HTTP (with --tls-key).
    #[arg(long, env = "TANDEM_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "TANDEM_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Require a key on `/health` too (probes usually have none).
    #[arg(long, env = "TANDEM_PROTECT_HEALTH")]
    pub protect_health: bool,
    /// Require a key on `/metrics` too.
    #[arg(long, env = "TANDEM_PROTECT_METRICS")]
    pub protect_metrics: bool,
    /// Requests one API key may have in flight (0: no limit); beyond it,
    /// 429 with Retry-After, so one client cannot take every slot.
    #[arg(
        long,
        env = "TANDEM_MAX_CONCURRENT_REQUESTS_PER_KEY",
        default_value_t = 0
    )]
    pub max_concurrent_requests_per_key: usize,
    /// Seconds a connection may take to send a request head (also how long
    /// an idle keep-alive connection stays open).
    #[arg(long, env = "TANDEM_HEADER_TIMEOUT_SECS", default_value_t = 10.0)]
    pub header_timeout_secs: f64,
    /// Seconds a request body may take to arrive, in all (408 after, and
    /// the connection is closed).
    #[arg(long, env = "TANDEM_BODY_TIMEOUT_SECS", default_value_t = 30.0)]
    pub body_timeout_secs: f64,
    /// After --body-rate-grace-secs, a request body must have arrived at
    /// this many bytes per second on average (408 otherwise; 0: no
    /// minimum). 64 KiB/s is below any real client's uplink, and makes a
    /// client that holds body budget by trickling pay for it in bandwidth.
    #[arg(long, env = "TANDEM_BODY_MIN_BYTES_PER_SEC", default_value_t = 64 << 10)]
    pub body_min_bytes_per_sec: u64,
    /// Seconds a request body may arrive slower than
    /// --body-min-bytes-per-sec (connection set-up, TLS, a slow start).
    #[arg(long, env = "TANDEM_BODY_RATE_GRACE_SECS", default_value_t = 5.0)]
    pub body_rate_grace_secs: f64,
    /// Open connections at most; more wait to be accepted.
    #[arg(long, env = "TANDEM_MAX_CONNECTIONS", default_value_t = 4096)]
    pub max_connections: usize,
    /// Bytes of request bodies received at once at most (by declared
    /// length); beyond it, 503. At least --max-body-bytes.
    #[arg(long, env = "TANDEM_MAX_BUFFERED_BODY_BYTES", default_value_t = 256 << 20)]
    pub max_buffered_body_bytes: usize,
    /// Of --max-buffered-body-bytes, what one client address (IPv6: its
    /// /64) or one API key may hold; beyond it, 429. Default: an eighth,
    /// at least --max-body-bytes. Behind a proxy every client has its
    /// address: raise it to --max-buffered-body-bytes there.
    #[arg(long, env = "TANDEM_MAX_BUFFERED_BODY_BYTES_PER_CLIENT")]
    pub max_buffered_body_bytes_per_client: Option<usize>,
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub http: HttpArgs,
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
}

impl EngineArgs {
    /// Sets up the kernels (ISA, threads), then fetches (if needed) and loads the model.
    pub fn load(&self) -> Result<(tandem_engine::LoadedModel, PathBuf)> {
        self.kernels.apply()?;
        let cache = self.cache_dir.clone().unwrap_or_else(fetch::cache_dir);
        let path = crate::fetch::resolve_model(&self.model, &cache)?;
        let m =
            tandem_engine::load(&path).with_context(|| format!("loading {}", path.display()))?;
        tandem_engine::metrics::record_load_times(&m.load_time);
        Ok((m, path))
    }

    /// Loads what `--engine` names: the model, or the mock engine over the
    /// model's metadata (no weights are mapped). `exports_kv`: a prefill
    /// node, whose KV leaves from the host pool (a GPU copies every step's
    /// KV back to it).
    pub fn load_served(&self, exports_kv: bool) -> Result<Served> {
        // Before `gpu()`, which may open devices (`gpu:all`) on the runtime
        // --gpu-runtime names.
        self.kernels.apply()?;
        if let Some(devices) = self.gpu()? {
            return self.load_on_gpu(&devices, exports_kv);
        }
        if self.engine != "mock" {
            if self.engine_profile.is_some() {
                bail!("--engine-profile is for --engine mock");
            }
            let (m, path) = self.load()?;
            let summary = format!(
                "model ({}, {} threads), loaded in {:.0} ms",
                tandem_kernels::isa(),
                tandem_kernels::num_threads(),
                m.load_time.total.as_secs_f64() * 1e3
            );
            return Ok(Served {
                model: Arc::new(m),
                path,
                summary,
                device: "cpu".into(),
            });
        }
        let Some(profile_path) = &self.engine_profile else {
            bail!(
                "--engine mock needs --engine-profile (written by `tandem bench-engine --profile`)"
            );
        };
        let profile = EngineProfile::load(profile_path)?;
        let cache = self.cache_dir.clone().unwrap_or_else(fetch::cache_dir);
        let path = crate::fetch::resolve_model(&self.model, &cache)?;
        let meta = ModelMeta::load(&path).with_context(|| format!("reading {}", path.display()))?;
        let summary = format!(
            "mock (profile {} of {}, time scale {})",
            profile_path.display(),
            profile.model,
            self.mock_time_scale
        );
        let mock = MockModel::new(meta, profile, self.mock_time_scale)?;
        Ok(Served {
            model: Arc::new(mock),
            path,
            summary,
            device: "mock".into(),
        })
    }

    /// The GPU of each tensor-parallel rank `--devices` and `--tp` name,
    /// if they name GPUs: one rank per listed GPU, or `--tp N` ranks
    /// sharing the one GPU listed (the sharded path on a single device).
    /// `gpu:all` is every adapter that opens, from `gpu:0` on.
    fn gpu(&self) -> Result<Option<Vec<usize>>> {
        let ids = match parse_devices(&self.devices)? {
            DeviceSpec::Cpu { .. } => return Ok(None),
            DeviceSpec::Gpu(GpuSelection::All) => {
                let count = (0..)
                    .take_while(|&i| tandem_gpu::GpuDevice::open(i).is_ok())
                    .count();
                (0..count.max(1)).collect()
            }
            DeviceSpec::Gpu(GpuSelection::Ids(ids)) => ids,
        };
        match ids[..] {
            [id] => Ok(Some(vec![id; self.tp.max(1)])),
            _ if self.tp == 1 || self.tp == ids.len() => Ok(Some(ids)),
            _ => bail!(
                "--devices {} gives {} ranks but --tp is {}",
                self.devices,
                ids.len(),
                self.tp
            ),
        }
    }

    /// The model on the GPUs of `devices` (a tensor-parallel rank each),
    /// driven by the scheduler like the CPU engine; nothing of the CPU
    /// engine is loaded.
    fn load_on_gpu(&self, devices: &[usize], exports_kv: bool) -> Result<Served> {
        if self.engine == "mock" {
            bail!("--engine mock runs on the CPU (drop --devices gpu:N)");
        }
        if self.engine_profile.is_some() {
            bail!("--engine-profile is for --engine mock");
        }
        if self.kv_cache_page_size == 0 {
            bail!("--kv-cache-page-size must be at least 1");
        }
        let t0 = std::time::Instant::now();
        let cache = self.cache_dir.clone().unwrap_or_else(fetch::cache_dir);
        let path = crate::fetch::resolve_model(&self.model, &cache)?;
        let meta = ModelMeta::load(&path).with_context(|| format!("reading {}", path.display()))?;
        let context = meta.config.context_length;
        let max_length = self.max_length.unwrap_or(context.min(DEFAULT_MAX_LENGTH));
        let copy_back = if exports_kv {
            KvCopyBack::EveryStep
        } else {
            KvCopyBack::Never
        };
        let ids = devices
            .iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join(",");
        let served = GpuServed::load(
            meta,
            devices,
            max_length,
            self.kv_cache_page_size,
            copy_back,
        )
        .with_context(|| format!("loading {} on gpu:{ids}", path.display()))?;
        let device = format!("gpu:{ids} ({})", served.device_names().join(", "));
        let summary = format!(
            "{device}, loaded in {:.0} ms",
            t0.elapsed().as_secs_f64() * 1e3
        );
        Ok(Served {
            model: Arc::new(served),
            path,
            summary,
            device,
        })
    }

    /// Tensor-parallel ranks from `--tp` and `--devices`, which must agree.
    fn ranks(&self) -> Result<usize> {
        match parse_devices(&self.devices)? {
            DeviceSpec::Cpu { ranks } if ranks == 1 || self.tp == 1 || ranks == self.tp => {
                Ok(ranks.max(self.tp))
            }
            DeviceSpec::Cpu { ranks } => bail!(
                "--devices {} gives {ranks} ranks but --tp is {}",
                self.devices,
                self.tp
            ),
            DeviceSpec::Gpu(_) => Ok(self.gpu()?.map_or(1, |ranks| ranks.len())),
        }
    }

    /// The scheduler's limits for a model with `context` tokens of context.
    pub fn scheduler_config(&self, context: usize) -> Result<SchedulerConfig> {
        if self.kv_cache_page_size == 0 {
            bail!("--kv-cache-page-size must be at least 1");
        }
        let max_length = self.max_length.unwrap_or(context.min(DEFAULT_MAX_LENGTH));
        if max_length > context {
            bail!(
                "--max-length {max_length} exceeds the model's context length of {context} tokens"
            );
        }
        let tp = self.ranks()?;
        let moe_combine = match self.moe_combine.as_str() {
            "dispatch" => Combine::Dispatch,
            _ => Combine::AllReduce,
        };
        let bs = self.kv_cache_page_size;
        let num_blocks = self.kv_cache_blocks.unwrap_or_else(|| {
            (self.max_batch_size.max(1) * DEFAULT_SEQ_TOKENS.div_ceil(bs))
                .max(max_length.div_ceil(bs))
        });
        let scheduler = SchedulerConfig {
            max_batch_size: self.max_batch_size,
            max_batch_input_tokens: self.max_batch_input_tokens,
            max_length,
            block_size: bs,
            num_blocks,
            prefix_caching: !self.no_prefix_caching,
            tp,
            moe_combine,
            kv_tiers: self.kv_connector_config.clone(),
        };
        scheduler
            .validate(context)
            .map_err(|e| anyhow::anyhow!("{e} (check --max-batch-size, --max-batch-input-tokens, --max-length, --kv-cache-page-size, --kv-cache-blocks)"))?;
        Ok(scheduler)
    }
}

/// `--kv-connector-config`, parsed and validated (unknown keys refused by
/// name).
fn parse_kv_tiers(json: &str) -> Result<TierConfig, tandem_kvtier::ConfigError> {
    json.parse()
}

impl HttpArgs {
    pub fn addr(&self) -> Result<SocketAddr> {
        parse_addr(&self.host, self.port)
    }

    /// The keys of `--api-key` and `--api-key-file`.
    fn keys(&self) -> Result<Vec<String>> {
        let mut keys = self.api_keys.clone();
        if let Some(path) = &self.api_key_file {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading --api-key-file {}", path.display()))?;
            keys.extend(ApiKeys::parse_file(&text));
        }
        Ok(keys)
    }

    pub fn server_config(&self, model_name: String) -> Result<ServerConfig> {
        let keys = self.keys()?;
        if keys.is_empty()
            && (self.protect_health
                || self.protect_metrics
                || self.max_concurrent_requests_per_key > 0)
        {
            bail!(
                "--protect-health, --protect-metrics and --max-concurrent-requests-per-key \
                 need --api-key or --api-key-file"
            );
        }
        if self.api_key_file.is_some() && keys.is_empty() {
            bail!("--api-key-file holds no keys");
        }
        let api_keys = ApiKeys::new(&keys).context("--api-key / --api-key-file")?;
        let secs = |name: &str, v: f64| -> Result<Duration> {
            if !(v.is_finite() && v > 0.0 && v <= 86_400.0) {
                bail!("{name} must be between 0 and 86400 seconds, got {v}");
            }
            Ok(Duration::from_secs_f64(v))
        };
        if self.max_connections == 0 {
            bail!("--max-connections must be at least 1");
        }
        if self.max_buffered_body_bytes < self.max_body_bytes {
            bail!("--max-buffered-body-bytes must be at least --max-body-bytes");
        }
        if self.max_concurrent_requests == 0 {
            bail!("--max-concurrent-requests must be at least 1");
        }
        if self.max_body_bytes == 0 {
            bail!("--max-body-bytes must be at least 1");
        }
        let per_client = self
            .max_buffered_body_bytes_per_client
            .unwrap_or((self.max_buffered_body_bytes / 8).max(self.max_body_bytes));
        if !(self.max_body_bytes..=self.max_buffered_body_bytes).contains(&per_client) {
            bail!(
                "--max-buffered-body-bytes-per-client must be between --max-body-bytes and \
                 --max-buffered-body-bytes"
            );
        }
        let body_pace = BodyPace {
            timeout: secs("--body-timeout-secs", self.body_timeout_secs)?,
            min_bytes_per_sec: self.body_min_bytes_per_sec,
            grace: secs("--body-rate-grace-secs", self.body_rate_grace_secs)?,
        };
        Ok(ServerConfig {
            allow_extra_request_fields: self.allow_extra_request_fields,
            max_concurrent_requests: self.max_concurrent_requests,
            max_body_bytes: self.max_body_bytes,
            model_name,
            tool_parser: self.tool_parser,
            reasoning_parser: self.reasoning_parser,
            api_keys,
            protect_health: self.protect_health,
            protect_metrics: self.protect_metrics,
            max_concurrent_requests_per_key: self.max_concurrent_requests_per_key,
            header_timeout: secs("--header-timeout-secs", self.header_timeout_secs)?,
            body_pace,
            max_connections: self.max_connections,
            max_buffered_body_bytes: self.max_buffered_body_bytes,
            max_buffered_body_bytes_per_client: per_client,
        })
    }

    /// HTTPS settings, loaded and checked (`None`: plain HTTP).
    pub fn tls(&self) -> Result<Option<HttpTls>> {
        match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Ok(Some(HttpTls::load(cert, key)?)),
            (None, None) => Ok(None),
            _ => bail!("--tls-cert and --tls-key go together"),
        }
    }

    /// Serves `state` until SIGINT/SIGTERM, re-reading `--api-key-file` on
    /// SIGHUP (a bad file keeps the keys in use).
    pub async fn serve(
        &self,
        listener: tokio::net::TcpListener,
        state: AppState,
        tls: Option<HttpTls>,
    ) -> Result<()> {
        let keys = state.api_keys().clone();
        let reload = async {
            #[cfg(unix)]
            if self.api_key_file.is_some() {
                use tokio::signal::unix::{SignalKind, signal};
                match signal(SignalKind::hangup()) {
                    Ok(mut hup) => {
                        while hup.recv().await.is_some() {
                            match self.keys().and_then(|k| {
                                keys.replace(&k).context("the new keys")?;
                                Ok(k.len())
                            }) {
                                Ok(n) => tracing::info!("reloaded {n} API keys"),
                                Err(e) => tracing::error!("keeping the API keys in use: {e:#}"),
                            }
                        }
                    }
                    Err(e) => tracing::warn!("listening for SIGHUP: {e}"),
                }
            }
            std::future::pending::<()>().await;
        };
        tokio::select! {
            r = tandem_frontend::serve(listener, state, tls, shutdown_signal(), SHUTDOWN_GRACE) => {
                r.context("serving HTTP")
            }
            () = reload => Ok(()),
        }
    }
}

/// `host:port` for an IP address (IPv6 with or without brackets).
pub fn parse_addr(host: &str, port: u16) -> Result<SocketAddr> {
    format!("{host}:{port}")
        .parse()
        .or_else(|_| format!("[{host}]:{port}").parse())
        .with_context(|| {
            format!("--host {host:?} is not an IP address (e.g. 127.0.0.1, 0.0.0.0, ::1)")
        })
}

/// Everything `serve` runs with, checked before anything starts.
#[derive(Debug, Clone)]
struct ServeConfig {
    addr: SocketAddr,
    scheduler: SchedulerConfig,
    server: ServerConfig,
    tls: Option<HttpTls>,
}

impl ServeConfig {
    /// Validates `args` against a model with `context` tokens of context.
    fn new(args: &ServeArgs, context: usize, model_name: String) -> Result<Self> {
        let addr = args.http.addr()?;
        args.engine.kernels.validate()?;
        Ok(Self {
            addr,
            scheduler: args.engine.scheduler_config(context)?,
            server: args.http.server_config(model_name)?,
            tls: args.http.tls()?,
        })
    }
}

/// The id clients use: the alias as given, `ORG/NAME` for a Hugging Face
/// repo id, or the file/directory stem.
pub fn served_name(model: &str, path: &Path) -> String {
    if !model.contains('/') && !model.ends_with(".gguf") {
        return model.to_string();
    }
    if !Path::new(model).exists()
        && tandem_modelfile::hub::looks_like_repo_id(model)
        && let Ok(id) = tandem_modelfile::hub::RepoId::parse(model)
    {
        return id.repo();
    }
    let stem = if path.is_dir() {
        path.file_name()
    } else {
        path.file_stem()
    };
    stem.map_or_else(|| model.to_string(), |s| s.to_string_lossy().into_owned())
}

/// The async runtime of a serving process (HTTP, gRPC, telemetry export).
pub fn runtime() -> Result<tokio::runtime::Runtime> {
    runtime_with(None)
}

/// The async runtime with `threads` I/O threads (default: the CPUs, at
/// most 4).
pub fn runtime_with(threads: Option<usize>) -> Result<tokio::runtime::Runtime> {
    let default = std::thread::available_parallelism().map_or(2, |n| n.get().min(4));
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.unwrap_or(default).max(1))
        .thread_name("tandem-io")
        .enable_all()
        .build()
        .context("starting the async runtime")
}

pub fn run(args: ServeArgs) -> Result<()> {
    // Flags that need no model are checked before the (slow) load.
    args.http.addr()?;
    let runtime = runtime()?;
    // Before anything records: instruments made earlier would be no-ops.
    let telemetry = {
        let _rt = runtime.enter();
        Telemetry::install("serve", &args.telemetry)?
    };
    let mut scheduler = None;
    let result = serve_loaded(&args, &runtime, &telemetry, &mut scheduler);
    telemetry.shutdown();
    // Dropping the runtime drops every task still holding a scheduler
    // handle, so the scheduler can stop.
    runtime.shutdown_timeout(Duration::from_secs(1));
    if let Some(s) = scheduler {
        s.shutdown();
    }
    eprintln!("tandem: stopped");
    result
}

fn serve_loaded(
    args: &ServeArgs,
    runtime: &tokio::runtime::Runtime,
    telemetry: &Telemetry,
    scheduler_slot: &mut Option<Scheduler>,
) -> Result<()> {
    let Served {
        model,
        path,
        summary,
        device,
    } = args.engine.load_served(false)?;
    let context = model.config().context_length;
    let config = ServeConfig::new(args, context, served_name(&args.engine.model, &path))?;
    eprintln!(
        "tandem: loaded {} ({} layers); engine: {summary}; \
         max length {}, {} KV blocks of {} tokens, prefix caching {}",
        model.text().name,
        model.config().n_layers,
        config.scheduler.max_length,
        config.scheduler.num_blocks,
        config.scheduler.block_size,
        if config.scheduler.prefix_caching {
            "on"
        } else {
            "off"
        },
    );
    let scheduler = scheduler_slot.insert(Scheduler::spawn(
        Arc::clone(&model),
        config.scheduler.clone(),
    )?);
    let backend = LocalBackend::new(
        scheduler.handle().clone(),
        model.config().vocab_size,
        device,
    );
    let state = AppState::new(
        Arc::clone(model.text()),
        Arc::new(backend),
        config.server.clone(),
    );
    state.set_metrics_renderer(telemetry.render());
    let name = config.server.model_name.clone();
    listen(args, runtime, state, config.addr, config.tls.clone(), &name)
}

/// Binds `addr`, prints the serving line and serves `state` until a signal.
fn listen(
    args: &ServeArgs,
    runtime: &tokio::runtime::Runtime,
    state: AppState,
    addr: SocketAddr,
    tls: Option<HttpTls>,
    model_name: &str,
) -> Result<()> {
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        let local = listener.local_addr().context("reading the bound address")?;
        let mut stdout = std::io::stdout().lock();
        let scheme = if tls.is_some() { "https" } else { "http" };
        writeln!(stdout, "tandem: serving {model_name} on {scheme}://{local}")?;
        stdout.flush()?;
        drop(stdout);
        args.http.serve(listener, state, tls).await
    })
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::warn!("listening for SIGINT: {e}");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!("listening for SIGTERM: {e}");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
    eprintln!("tandem: shutting down (in-flight requests get {SHUTDOWN_GRACE:?})");
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        args: ServeArgs,
    }

    fn config(flags: &[&str]) -> Result<ServeConfig> {
        let mut argv = vec!["serve"];
        argv.extend_from_slice(flags);
        let cli = Cli::try_parse_from(argv)?;
        ServeConfig::new(&cli.args, 8192 * 2, "m".into())
    }

    #[test]
    fn defaults() {
        let c = config(&[]).unwrap();
        assert_eq!(c.addr.to_string(), "127.0.0.1:8000");
        assert_eq!(c.scheduler.max_length, 8192);
        assert_eq!(c.scheduler.num_blocks, 32 * 64);
        assert!(c.scheduler.prefix_caching);
        assert_eq!(c.server.max_concurrent_requests, 256);
        // Bodies: 30 s in all, 64 KiB/s after 5 s, an eighth of the budget
        // per client.
        let pace = c.server.body_pace;
        assert_eq!(pace.timeout, Duration::from_secs(30));
        assert_eq!(
            (pace.min_bytes_per_sec, pace.grace),
            (64 << 10, Duration::from_secs(5))
        );
        assert_eq!(c.server.max_buffered_body_bytes_per_client, 32 << 20);
        let small = config(&["--max-buffered-body-bytes", "8000000"]).unwrap();
        assert_eq!(small.server.max_buffered_body_bytes_per_client, 4 << 20);
    }

    #[test]
    fn blocks_cover_one_max_length_sequence() {
        let c = config(&["--max-batch-size", "1", "--max-length", "4096"]).unwrap();
        assert_eq!(c.scheduler.num_blocks, 4096 / 16);
    }

    #[test]
    fn bad_values_are_rejected() {
        for flags in [
            &["--host", "not a host"][..],
            &["--max-batch-size", "0"],
            &["--max-length", "100000"],
            &["--kv-cache-page-size", "0"],
            &["--kv-cache-blocks", "1"],
            &["--max-concurrent-requests", "0"],
            &["--threads", "0"],
            &["--max-batch-input-tokens", "4"],
            &["--body-rate-grace-secs", "0"],
            &["--max-buffered-body-bytes-per-client", "1000"],
            &["--max-buffered-body-bytes-per-client", "300000000"],
        ] {
            assert!(config(flags).is_err(), "{flags:?} accepted");
        }
        assert_eq!(
            config(&["--host", "::1"]).unwrap().addr.to_string(),
            "[::1]:8000"
        );
    }

    #[test]
    fn gpu_ranks_come_from_devices_and_tp() {
        let ranks = |flags: &[&str]| {
            let mut argv = vec!["serve"];
            argv.extend_from_slice(flags);
            let cli = Cli::try_parse_from(argv).unwrap();
            let e = &cli.args.engine;
            e.gpu().and_then(|g| Ok((g, e.ranks()?)))
        };
        assert_eq!(ranks(&[]).unwrap(), (None, 1));
        assert_eq!(ranks(&["--devices", "gpu:0"]).unwrap(), (Some(vec![0]), 1));
        // Three ranks sharing one GPU, or a rank per listed GPU.
        assert_eq!(
            ranks(&["--devices", "gpu:1", "--tp", "3"]).unwrap(),
            (Some(vec![1, 1, 1]), 3)
        );
        assert_eq!(
            ranks(&["--devices", "gpu:2,0"]).unwrap(),
            (Some(vec![2, 0]), 2)
        );
        assert_eq!(
            ranks(&["--devices", "gpu:2,0", "--tp", "2"]).unwrap(),
            (Some(vec![2, 0]), 2)
        );
        let err = ranks(&["--devices", "gpu:0,1", "--tp", "3"]).unwrap_err();
        assert!(
            err.to_string().contains("gives 2 ranks but --tp is 3"),
            "{err}"
        );
    }

    #[test]
    fn served_names() {
        assert_eq!(
            served_name("smollm2-135m", Path::new("/x/y.gguf")),
            "smollm2-135m"
        );
        assert_eq!(
            served_name("/tmp/a/Model.Q4.gguf", Path::new("/tmp/a/Model.Q4.gguf")),
            "Model.Q4"
        );
        // A hub id is served under its repo name, not the snapshot's sha.
        assert_eq!(
            served_name(
                "Qwen/Qwen2.5-0.5B-Instruct@main:Q4_K_M",
                Path::new("/c/hub/models--Qwen--Qwen2.5-0.5B-Instruct/snapshots/0123abcd/m.gguf")
            ),
            "Qwen/Qwen2.5-0.5B-Instruct"
        );
    }
}
