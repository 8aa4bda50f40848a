//! `tandem decode`: a decode node.

use std::time::Duration;

use anyhow::Result;
use clap::Args;
use tandem_decode_node::DecodeConfig;
use tandem_discovery::Role;

use super::args::NodeArgs;
use super::worker::run_node;
use crate::serve::EngineArgs;

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
    /// Never fetch a prompt's prefix from a peer that holds it (the router
    /// names one when it knows it): always compute it.
    #[arg(long, env = "TANDEM_NO_PREFIX_FETCH")]
    pub no_prefix_fetch: bool,
}

pub fn run_decode(args: DecodeArgs) -> Result<()> {
    let cfg = DecodeConfig {
        remote_prefill_min_tokens: args.remote_prefill_min_tokens,
        prefill_timeout: Duration::from_millis(args.prefill_timeout_ms),
        quarantine_limit: Duration::from_secs(args.quarantine_limit_secs),
        prefix_fetch: !args.no_prefix_fetch,
    };
    run_node(&args.engine, &args.node, Role::Decode, Some(cfg))
}
