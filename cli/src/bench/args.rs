//! `tandem bench`'s flags and the checks clap does not do.

use std::path::PathBuf;

use anyhow::{Result, bail};
use clap::{Args, ValueEnum};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Endpoint {
    /// `/v1/chat/completions` with one user message.
    Chat,
    /// `/v1/completions` with a raw prompt.
    Completions,
}

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Base URL of the server (http only).
    #[arg(
        long,
        env = "TANDEM_BENCH_URL",
        default_value = "http://127.0.0.1:8000"
    )]
    pub(super) url: String,
    /// Model name sent in requests (default: the first id of /v1/models).
    #[arg(long, env = "TANDEM_BENCH_MODEL")]
    pub(super) model: Option<String>,
    /// API endpoint to exercise.
    #[arg(
        long,
        env = "TANDEM_BENCH_ENDPOINT",
        value_enum,
        default_value = "chat"
    )]
    pub(super) endpoint: Endpoint,
    /// Requests per run (per sweep point).
    #[arg(long, env = "TANDEM_BENCH_NUM_REQUESTS", default_value_t = 64)]
    pub(super) num_requests: usize,
    /// Multi-turn chat: this many sessions of --turns turns each (N x T
    /// requests per point, instead of --num-requests).
    #[arg(
        long,
        env = "TANDEM_BENCH_MULTI_TURN_SESSIONS",
        conflicts_with = "num_requests"
    )]
    pub(super) multi_turn_sessions: Option<usize>,
    /// Turns per multi-turn session; each turn's new user message takes its
    /// length from --input-len(-range).
    #[arg(long, env = "TANDEM_BENCH_TURNS")]
    pub(super) turns: Option<usize>,
    /// The server's KV block size in tokens, for the multi-turn retention
    /// report (only whole blocks can be reused).
    #[arg(long, env = "TANDEM_BENCH_KV_BLOCK_SIZE", default_value_t = 16)]
    pub(super) kv_block_size: usize,
    /// Requests in flight at once (default 8; with --request-rate: no cap
    /// unless given).
    #[arg(long, env = "TANDEM_BENCH_CONCURRENCY")]
    pub(super) concurrency: Option<usize>,
    /// Open-loop load: Poisson arrivals at this many requests per second.
    #[arg(long, env = "TANDEM_BENCH_REQUEST_RATE")]
    pub(super) request_rate: Option<f64>,
    /// Run once per concurrency in this comma-separated list (e.g. 1,8,32).
    #[arg(long, env = "TANDEM_BENCH_SWEEP_CONCURRENCY", value_delimiter = ',')]
    pub(super) sweep_concurrency: Vec<usize>,
    /// Prompt length in words (about one token each).
    #[arg(long, env = "TANDEM_BENCH_INPUT_LEN", default_value_t = 128)]
    pub(super) input_len: usize,
    /// Uniformly random prompt length per request, LO:HI (inclusive);
    /// overrides --input-len.
    #[arg(long, env = "TANDEM_BENCH_INPUT_LEN_RANGE", value_parser = parse_range)]
    pub(super) input_len_range: Option<(usize, usize)>,
    /// max_tokens of every request.
    #[arg(long, env = "TANDEM_BENCH_OUTPUT_LEN", default_value_t = 64)]
    pub(super) output_len: usize,
    /// Uniformly random max_tokens per request, LO:HI (inclusive); overrides
    /// --output-len.
    #[arg(long, env = "TANDEM_BENCH_OUTPUT_LEN_RANGE", value_parser = parse_range)]
    pub(super) output_len_range: Option<(usize, usize)>,
    /// Number of distinct shared prompt prefixes (request i uses prefix i % G).
    #[arg(long, env = "TANDEM_BENCH_SHARED_PREFIX_GROUPS", default_value_t = 0)]
    pub(super) shared_prefix_groups: usize,
    /// Words in each shared prefix (part of the input length).
    #[arg(long, env = "TANDEM_BENCH_SHARED_PREFIX_LEN", default_value_t = 0)]
    pub(super) shared_prefix_len: usize,
    /// Seed of the prompts, lengths and arrival times.
    #[arg(long, env = "TANDEM_BENCH_SEED", default_value_t = 0)]
    pub(super) seed: u64,
    /// Sampling temperature sent with every request.
    #[arg(long, env = "TANDEM_BENCH_TEMPERATURE", default_value_t = 0.0)]
    pub(super) temperature: f64,
    /// Service-level objectives for goodput, e.g. ttft:500,tpot:50 (ms;
    /// keys ttft, tpot, e2e).
    #[arg(long, env = "TANDEM_BENCH_GOODPUT", value_parser = parse_slo)]
    pub(super) goodput: Option<Slo>,
    /// Also write all aggregates (per sweep point) as JSON to this file.
    #[arg(long, env = "TANDEM_BENCH_JSON")]
    pub(super) json: Option<PathBuf>,
    /// Send `ignore_eos: true` (llama-server accepts it; tandem serve only
    /// with --allow-extra-request-fields).
    #[arg(long, env = "TANDEM_BENCH_IGNORE_EOS")]
    pub(super) ignore_eos: bool,
    /// Per-request timeout in seconds.
    #[arg(long, env = "TANDEM_BENCH_TIMEOUT", default_value_t = 600)]
    pub(super) timeout: u64,
    /// No live progress line on stderr.
    #[arg(long, env = "TANDEM_BENCH_QUIET")]
    pub(super) quiet: bool,
    /// Reuse connections (keep-alive), as a load balancer in front of the
    /// server does; by default every request opens its own.
    #[arg(long, env = "TANDEM_BENCH_KEEP_ALIVE")]
    pub(super) keep_alive: bool,
}

pub(super) fn parse_range(s: &str) -> Result<(usize, usize), String> {
    let (lo, hi) = s.split_once(':').ok_or("expected LO:HI")?;
    let lo: usize = lo.trim().parse().map_err(|e| format!("LO: {e}"))?;
    let hi: usize = hi.trim().parse().map_err(|e| format!("HI: {e}"))?;
    if lo == 0 || lo > hi {
        return Err("need 1 <= LO <= HI".into());
    }
    Ok((lo, hi))
}

/// Goodput service-level objectives, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Slo {
    pub(super) ttft_ms: Option<f64>,
    pub(super) tpot_ms: Option<f64>,
    pub(super) e2e_ms: Option<f64>,
}

pub(super) fn parse_slo(s: &str) -> Result<Slo, String> {
    let mut slo = Slo::default();
    for part in s.split(',').filter(|p| !p.trim().is_empty()) {
        let (k, v) = part.split_once(':').ok_or("expected KEY:MS")?;
        let v: f64 = v.trim().parse().map_err(|e| format!("{k}: {e}"))?;
        if v.is_nan() || v <= 0.0 {
            return Err(format!("{k}: must be positive"));
        }
        match k.trim() {
            "ttft" => slo.ttft_ms = Some(v),
            "tpot" => slo.tpot_ms = Some(v),
            "e2e" => slo.e2e_ms = Some(v),
            other => return Err(format!("unknown SLO {other:?} (ttft, tpot, e2e)")),
        }
    }
    Ok(slo)
}

/// Flag checks clap does not do.
pub(super) fn check_args(args: &BenchArgs) -> Result<()> {
    if args.num_requests == 0 {
        bail!("--num-requests must be at least 1");
    }
    match (args.multi_turn_sessions, args.turns) {
        (Some(0), _) => bail!("--multi-turn-sessions must be at least 1"),
        (_, Some(0)) => bail!("--turns must be at least 1"),
        (Some(_), None) => bail!("--multi-turn-sessions needs --turns"),
        (None, Some(_)) => bail!("--turns needs --multi-turn-sessions"),
        (Some(_), Some(_)) if args.endpoint != Endpoint::Chat => {
            bail!("multi-turn sessions need --endpoint chat")
        }
        _ => {}
    }
    if args.kv_block_size == 0 {
        bail!("--kv-block-size must be at least 1");
    }
    if let Some(r) = args.request_rate
        && !(r > 0.0 && r.is_finite())
    {
        bail!("--request-rate must be positive");
    }
    if args.concurrency == Some(0) || args.sweep_concurrency.contains(&0) {
        bail!("concurrency must be at least 1");
    }
    if args.shared_prefix_groups > 0 && args.shared_prefix_len == 0 {
        bail!("--shared-prefix-groups needs --shared-prefix-len");
    }
    Ok(())
}
