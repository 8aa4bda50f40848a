//! The `tandem` binary.

mod bench;
mod bench_engine;
mod cluster;
mod dkv_key;
mod fetch;
mod generate;
mod hub;
mod kernel_args;
mod local;
mod node;
mod plan;
mod serve;
mod telemetry;

use anyhow::Result;
use clap::{Parser, Subcommand};

/// Returns what start-up freed (the tokenizer's and template's build
/// temporaries) to the OS; glibc keeps such pages until the heap's top is
/// free. (mimalloc cut the router's allocation cost, but a prefill node's
/// memory under it crept up for as long as the soak test ran.)
pub fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free heap memory to the OS; any
    // thread may call it at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// `tandem --version`: the release and the hash of the sources it was
/// built from (the end-to-end tests compare it with theirs).
const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (source ",
    env!("TANDEM_SOURCE_HASH"),
    ")"
);

#[derive(Debug, Parser)]
#[command(name = "tandem", version = VERSION, about = "Disaggregated LLM serving")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Benchmark an OpenAI-compatible server (TTFT, TPOT, ITL, throughput, goodput)
    Bench(bench::BenchArgs),
    /// Generate text for one prompt and print tokens/s.
    Generate(generate::GenerateArgs),
    /// Measure raw engine throughput (prompt processing, single and batched decode)
    #[command(name = "bench-engine")]
    BenchEngine(bench_engine::BenchEngineArgs),
    /// Serve the OpenAI API with all roles in one process
    Serve(serve::ServeArgs),
    /// Run a prefill node (gRPC; registers in etcd)
    Prefill(node::PrefillArgs),
    /// Run a decode node (gRPC; registers in etcd)
    Decode(node::DecodeArgs),
    /// Run the OpenAI API router in front of prefill and decode nodes found in etcd
    Router(node::RouterArgs),
    /// Run a whole local cluster as processes
    #[command(subcommand)]
    Cluster(cluster::ClusterCommand),
    /// Recommend a topology for a workload and SLO by simulating measured profiles
    Plan(plan::PlanArgs),
}

fn main() -> Result<()> {
    let command = Cli::parse().command;
    // The serving roles install logging with their telemetry (spans may
    // be exported); the others only log.
    if !matches!(
        command,
        Command::Serve(_) | Command::Prefill(_) | Command::Decode(_) | Command::Router(_)
    ) {
        telemetry::init_logs();
    }
    match command {
        Command::Bench(args) => bench::run(args),
        Command::Generate(args) => generate::run(args),
        Command::BenchEngine(args) => bench_engine::run(args),
        Command::Serve(args) => serve::run(args),
        Command::Prefill(args) => node::run_prefill(args),
        Command::Decode(args) => node::run_decode(args),
        Command::Router(args) => node::run_router(args),
        Command::Cluster(cmd) => cluster::run_cluster(cmd),
        Command::Plan(args) => plan::run(args),
    }
}
