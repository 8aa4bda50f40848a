//! `tandem prefill`: a prefill node.

use anyhow::Result;
use clap::Args;
use tandem_discovery::Role;

use super::args::NodeArgs;
use super::worker::run_node;
use crate::serve::EngineArgs;

#[derive(Debug, Args)]
pub struct PrefillArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub node: NodeArgs,
}

pub fn run_prefill(args: PrefillArgs) -> Result<()> {
    run_node(&args.engine, &args.node, Role::Prefill, None)
}
