//! `tandem plan`: recommends a topology (aggregated or disaggregated, the
//! P:D ratio, each pool's TP) for a workload and an SLO by simulating the
//! cluster on measured engine profiles (`tandem bench-engine --profile`);
//! with `--topology`, predicts one given topology's latencies instead (to
//! check the model against `tandem bench`).

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use serde_json::json;
use tandem_perfmodel::EngineProfile;
use tandem_perfmodel::search::{self, SearchSpace};
use tandem_perfmodel::sim::{ClusterParams, LenDist, SimReport, Slo, Topology, Workload, simulate};

#[derive(Debug, Args)]
pub struct PlanArgs {
    /// Engine profile (from `tandem bench-engine --profile`), one per TP
    /// degree; repeat the flag (or separate with commas) for several.
    #[arg(
        long,
        env = "TANDEM_PLAN_PROFILE",
        required = true,
        value_delimiter = ','
    )]
    profile: Vec<PathBuf>,
    /// Offered load: Poisson arrivals per second.
    #[arg(long, env = "TANDEM_PLAN_RATE")]
    rate: f64,
    /// Prompt tokens: N, LO:HI (uniform) or N,N,... (one of the list).
    #[arg(long, env = "TANDEM_PLAN_INPUT_LEN", default_value = "128")]
    input_len: LenDist,
    /// Generated tokens per request, in the same forms.
    #[arg(long, env = "TANDEM_PLAN_OUTPUT_LEN", default_value = "64")]
    output_len: LenDist,
    /// Share of each prompt already in the prefix cache, in [0, 1).
    #[arg(long, env = "TANDEM_PLAN_PREFIX_SHARE", default_value_t = 0.0)]
    prefix_share: f64,
    /// SLO: time to first token, p99, milliseconds.
    #[arg(long, env = "TANDEM_PLAN_TTFT_P99_MS", default_value_t = 1000.0)]
    ttft_p99_ms: f64,
    /// SLO: time per output token after the first, p99, milliseconds.
    #[arg(long, env = "TANDEM_PLAN_TPOT_P99_MS", default_value_t = 100.0)]
    tpot_p99_ms: f64,
    /// Node units to plan for (a TP-T node uses T).
    #[arg(long, env = "TANDEM_PLAN_NODES", default_value_t = 4)]
    nodes: usize,
    /// Only aggregated topologies.
    #[arg(long, env = "TANDEM_PLAN_NO_DISAGG")]
    no_disagg: bool,
    /// Share of requests that must meet the SLO for a rate to count as
    /// sustained, in (0, 1].
    #[arg(long, env = "TANDEM_PLAN_ATTAINMENT", default_value_t = 0.99)]
    attainment: f64,
    /// Simulate these topologies only (agg:N[:tpT], PpDd[:tpA[/tpB]], e.g.
    /// agg:1, agg:1:tp2, 1p1d, 1p2d), instead of searching.
    #[arg(long, env = "TANDEM_PLAN_TOPOLOGY", value_delimiter = ',')]
    topology: Vec<Topology>,
    /// KV transfer bandwidth between prefill and decode nodes, GB/s.
    #[arg(long, env = "TANDEM_PLAN_DKV_GBPS", default_value_t = 2.0)]
    dkv_gbps: f64,
    /// Fixed cost of one KV handoff (Prefill round trip, grant, flush), ms.
    #[arg(long, env = "TANDEM_PLAN_DKV_LATENCY_MS", default_value_t = 1.0)]
    dkv_latency_ms: f64,
    /// Router (or front end) time per request, microseconds.
    #[arg(long, env = "TANDEM_PLAN_ROUTER_US", default_value_t = 200.0)]
    router_us: f64,
    /// K+V bytes per token over all layers (default: SmolLM2-135M's, f16).
    #[arg(long, env = "TANDEM_PLAN_KV_BYTES_PER_TOKEN", default_value_t = 23_040)]
    kv_bytes_per_token: usize,
    /// The nodes' --max-batch-size.
    #[arg(long, env = "TANDEM_PLAN_MAX_BATCH_SIZE", default_value_t = 32)]
    max_batch_size: usize,
    /// The nodes' --max-batch-input-tokens (token budget of one step).
    #[arg(
        long,
        env = "TANDEM_PLAN_MAX_BATCH_INPUT_TOKENS",
        default_value_t = 2048
    )]
    max_batch_input_tokens: usize,
    /// The decode nodes' --remote-prefill-min-tokens.
    #[arg(
        long,
        env = "TANDEM_PLAN_REMOTE_PREFILL_MIN_TOKENS",
        default_value_t = 64
    )]
    remote_prefill_min_tokens: usize,
    /// Time a scheduler step costs beyond its forward call, microseconds.
    #[arg(long, env = "TANDEM_PLAN_STEP_OVERHEAD_US", default_value_t = 0.0)]
    step_overhead_us: f64,
    /// Requests to simulate (default: rate x --duration).
    #[arg(long, env = "TANDEM_PLAN_REQUESTS", conflicts_with = "duration")]
    requests: Option<usize>,
    /// Seconds of arrivals to simulate.
    #[arg(long, env = "TANDEM_PLAN_DURATION", default_value_t = 300.0)]
    duration: f64,
    /// Seed of the arrivals and lengths.
    #[arg(long, env = "TANDEM_PLAN_SEED", default_value_t = 0)]
    seed: u64,
    /// Also write the result as JSON to this file.
    #[arg(long, env = "TANDEM_PLAN_JSON")]
    json: Option<PathBuf>,
}

/// The validated inputs of a run.
struct Config {
    profiles: Vec<EngineProfile>,
    workload: Workload,
    slo: Slo,
    params: ClusterParams,
    space: SearchSpace,
}

impl PlanArgs {
    fn config(&self) -> Result<Config> {
        let mut profiles: Vec<EngineProfile> = Vec::new();
        for path in &self.profile {
            let p = EngineProfile::load(path)?;
            if profiles.iter().any(|q| q.tp == p.tp) {
                bail!(
                    "two profiles at TP {} ({}): give one per TP degree",
                    p.tp,
                    path.display()
                );
            }
            profiles.push(p);
        }
        let positive = |name: &str, x: f64| -> Result<()> {
            if x.is_finite() && x > 0.0 {
                Ok(())
            } else {
                bail!("{name} must be positive")
            }
        };
        positive("--rate", self.rate)?;
        positive("--ttft-p99-ms", self.ttft_p99_ms)?;
        positive("--tpot-p99-ms", self.tpot_p99_ms)?;
        positive("--dkv-gbps", self.dkv_gbps)?;
        positive("--duration", self.duration)?;
        for (name, x) in [
            ("--dkv-latency-ms", self.dkv_latency_ms),
            ("--router-us", self.router_us),
            ("--step-overhead-us", self.step_overhead_us),
        ] {
            if !(x.is_finite() && x >= 0.0) {
                bail!("{name} must not be negative");
            }
        }
        let requests = match self.requests {
            Some(n) => n,
            None => (self.rate * self.duration).ceil() as usize,
        };
        if requests == 0 {
            bail!("--requests must be at least 1");
        }
        if self.nodes == 0 {
            bail!("--nodes must be at least 1");
        }
        let workload = Workload {
            rate: self.rate,
            input: self.input_len.clone(),
            output: self.output_len.clone(),
            prefix_share: self.prefix_share,
            requests,
            seed: self.seed,
        };
        workload.validate()?;
        let params = ClusterParams {
            router_s: self.router_us * 1e-6,
            dkv_bytes_per_s: self.dkv_gbps * 1e9,
            dkv_latency_s: self.dkv_latency_ms * 1e-3,
            kv_bytes_per_token: self.kv_bytes_per_token as f64,
            max_batch_size: self.max_batch_size,
            token_budget: self.max_batch_input_tokens,
            remote_prefill_min_tokens: self.remote_prefill_min_tokens,
            block_size: 16,
            step_overhead_s: self.step_overhead_us * 1e-6,
        };
        params.validate()?;
        for t in &self.topology {
            for tp in tps(t) {
                tandem_perfmodel::sim::profile_for(&profiles, tp)?;
            }
        }
        let space = SearchSpace {
            units: self.nodes,
            disaggregated: !self.no_disagg,
            attainment: self.attainment,
        };
        if !(self.attainment > 0.0 && self.attainment <= 1.0) {
            bail!("--attainment must be in (0, 1]");
        }
        Ok(Config {
            profiles,
            workload,
            slo: Slo {
                ttft_s: self.ttft_p99_ms * 1e-3,
                tpot_s: self.tpot_p99_ms * 1e-3,
            },
            params,
            space,
        })
    }
}

fn tps(t: &Topology) -> Vec<usize> {
    match *t {
        Topology::Aggregated { tp, .. } => vec![tp],
        Topology::Disaggregated {
            prefill_tp,
            decode_tp,
            ..
        } => vec![prefill_tp, decode_tp],
    }
}

pub fn run(args: PlanArgs) -> Result<()> {
    let cfg = args.config()?;
    let w = &cfg.workload;
    println!(
        "workload: {:.3} req/s, input {}, output {}, prefix share {:.2}, {} requests (seed {})",
        w.rate, w.input, w.output, w.prefix_share, w.requests, w.seed
    );
    println!(
        "SLO: TTFT p99 <= {:.0} ms, TPOT p99 <= {:.1} ms; profiles: {}",
        cfg.slo.ttft_s * 1e3,
        cfg.slo.tpot_s * 1e3,
        cfg.profiles
            .iter()
            .map(|p| format!("TP {} ({}, {} threads)", p.tp, p.isa, p.threads))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let out = if args.topology.is_empty() {
        let plan = search::plan(&cfg.space, &cfg.profiles, &cfg.params, w, &cfg.slo)?;
        print!("{}", candidate_table(&plan.candidates));
        println!();
        println!("recommendation: {}", plan.reasoning);
        json!({
            "workload": workload_json(w),
            "slo": cfg.slo,
            "params": cfg.params,
            "nodes": cfg.space.units,
            "candidates": plan.candidates,
            "best": plan.candidates.first().map(|c| &c.topology),
            "reasoning": plan.reasoning,
        })
    } else {
        let mut reports = Vec::new();
        for &t in &args.topology {
            reports.push(simulate(t, &cfg.profiles, &cfg.params, w, &cfg.slo)?);
        }
        print!("{}", report_table(&reports));
        json!({
            "workload": workload_json(w),
            "slo": cfg.slo,
            "params": cfg.params,
            "results": reports,
        })
    };
    if let Some(file) = &args.json {
        let text = serde_json::to_string_pretty(&out).context("encoding the plan")?;
        std::fs::write(file, text + "\n").with_context(|| format!("writing {}", file.display()))?;
        eprintln!("wrote {}", file.display());
    }
    Ok(())
}

fn workload_json(w: &Workload) -> serde_json::Value {
    json!({
        "rate": w.rate,
        "input_len": w.input.to_string(),
        "output_len": w.output.to_string(),
        "prefix_share": w.prefix_share,
        "requests": w.requests,
        "seed": w.seed,
    })
}

fn report_table(reports: &[SimReport]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| topology | req/s | out tok/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | E2E p50 | E2E p99 | goodput | SLO met | decode batch | busy |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in reports {
        let ms = |x: f64| x * 1e3;
        let _ = writeln!(
            s,
            "| {} | {:.2} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0} | {:.0} | {:.2} | {:.1}% | {:.1} | {:.0}% |",
            r.topology,
            r.request_throughput,
            r.output_throughput,
            ms(r.ttft.p50),
            ms(r.ttft.p99),
            ms(r.tpot.p50),
            ms(r.tpot.p99),
            ms(r.e2e.p50),
            ms(r.e2e.p99),
            r.goodput,
            r.slo_attainment * 100.0,
            r.mean_decode_batch,
            r.utilisation * 100.0
        );
    }
    s
}

fn candidate_table(c: &[search::Candidate]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| rank | topology | units | meets SLO | TTFT p99 ms | TPOT p99 ms | goodput req/s | max good req/s | per unit |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|");
    for (i, x) in c.iter().enumerate() {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {:.1} | {:.1} | {:.2} | {:.2} | {:.2} |",
            i + 1,
            x.topology,
            x.units,
            if x.meets_slo { "yes" } else { "no" },
            x.report.ttft.p99 * 1e3,
            x.report.tpot.p99 * 1e3,
            x.report.goodput,
            x.max_good_rate,
            x.max_good_rate_per_unit
        );
    }
    s
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use clap::Parser;
    use tandem_perfmodel::profile::PROFILE_VERSION;
    use tandem_perfmodel::{DecodePoint, PrefillPoint};

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        plan: PlanArgs,
    }

    fn parse(flags: &[&str]) -> Result<PlanArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("t").chain(flags.iter().copied())).map(|c| c.plan)
    }

    fn write_profile(dir: &std::path::Path, tp: usize) -> PathBuf {
        let p = EngineProfile {
            version: PROFILE_VERSION,
            model: "m".into(),
            isa: "scalar".into(),
            threads: 1,
            tp,
            prefill: vec![PrefillPoint {
                tokens: 100,
                seconds: 0.1,
            }],
            decode: vec![DecodePoint {
                batch: 1,
                context: 100,
                seconds: 0.01,
            }],
        };
        let path = dir.join(format!("p{tp}.json"));
        std::fs::write(&path, p.to_json()).unwrap();
        path
    }

    #[test]
    fn flags_are_validated_at_startup() {
        let dir = std::env::temp_dir().join(format!("tandem-plan-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p1 = write_profile(&dir, 1);
        let p1s = p1.to_str().unwrap();
        let ok = parse(&[
            "--profile",
            p1s,
            "--rate",
            "2",
            "--input-len",
            "64:256",
            "--topology",
            "agg:1,1p1d",
        ])
        .unwrap();
        let cfg = ok.config().unwrap();
        assert_eq!(cfg.workload.input, LenDist::Uniform(64, 256));
        assert_eq!(cfg.workload.requests, 600);
        assert_eq!(ok.topology.len(), 2);
        // No TP-2 profile for this topology.
        let bad = parse(&["--profile", p1s, "--rate", "2", "--topology", "agg:1:tp2"]).unwrap();
        assert!(bad.config().is_err());
        // The same TP twice.
        let twice = parse(&["--profile", p1s, "--profile", p1s, "--rate", "2"]).unwrap();
        assert!(twice.config().is_err());
        for flags in [
            &["--profile", p1s, "--rate", "0"][..],
            &["--profile", p1s, "--rate", "1", "--prefix-share", "1"],
            &["--profile", p1s, "--rate", "1", "--nodes", "0"],
            &["--profile", p1s, "--rate", "1", "--attainment", "0"],
            &["--profile", p1s, "--rate", "1", "--dkv-gbps=-1"],
        ] {
            assert!(parse(flags).unwrap().config().is_err(), "{flags:?}");
        }
        assert!(parse(&["--profile", p1s, "--rate", "1", "--input-len", "0"]).is_err());
        assert!(parse(&["--profile", p1s, "--rate", "1", "--topology", "2x"]).is_err());
        assert!(
            parse(&[
                "--profile",
                p1s,
                "--rate",
                "1",
                "--requests",
                "5",
                "--duration",
                "3"
            ])
            .is_err()
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn tables_show_every_row() {
        let c = search::Candidate {
            topology: "1p1d".into(),
            units: 2,
            report: SimReport {
                topology: "1p1d".into(),
                units: 2,
                requests: 1,
                duration_s: 1.0,
                request_throughput: 1.0,
                output_throughput: 1.0,
                ttft: tandem_perfmodel::sim::Summary::of(vec![0.1]),
                tpot: tandem_perfmodel::sim::Summary::of(vec![0.01]),
                e2e: tandem_perfmodel::sim::Summary::of(vec![0.2]),
                goodput: 1.0,
                slo_attainment: 1.0,
                mean_decode_batch: 1.0,
                utilisation: 0.5,
            },
            meets_slo: true,
            max_good_rate: 3.0,
            max_good_rate_per_unit: 1.5,
        };
        assert!(candidate_table(std::slice::from_ref(&c)).contains("| 1 | 1p1d | 2 | yes |"));
        assert!(report_table(&[c.report]).contains("| 1p1d | 1.00 |"));
    }
}
