//! `tandem bench`: a serving benchmark for any OpenAI-compatible server
//! (tandem serve, llama-server, vLLM, ...), in the spirit of vLLM's
//! `benchmark_serving.py`.
//!
//! Every request is a streaming `/v1/chat/completions` (or `/v1/completions`)
//! call with `stream_options.include_usage`, sent over a plain HTTP/1.1
//! connection (one per request, `Connection: close`; no TLS) by reqwest, its
//! server-sent events parsed by eventsource-stream. Per request it records
//! TTFT (time to the first token-bearing delta: non-empty content, text or
//! reasoning), ITL (gaps between token-bearing deltas; each timed when the
//! read that completed its event returned, not when the body ended), TPOT
//! (`(e2e - ttft) / (output tokens - 1)`), the end-to-end latency and the
//! token counts the server reports in `usage` (deltas are counted when it
//! reports none). Reasoning deltas (`delta.reasoning`, or vLLM's
//! `delta.reasoning_content`, from a server running a reasoning parser) are
//! also counted on their own.
//!
//! Prompts are random words from a fixed built-in list (seeded, so two runs
//! with the same flags send the same prompts), about one token per word.
//!
//! Multi-turn sessions (`--multi-turn-sessions N --turns T`): turn k of a
//! session sends the whole conversation so far (its earlier user messages and
//! the answers the server streamed back) plus a new random user message.
//! Fairness: a session holds a concurrency slot only while one of its turns is
//! in flight, and ready turns (first turns, and each next turn once the
//! previous one finished) wait in one FIFO queue, so a session that just
//! finished queues behind sessions that waited longer and none monopolises a
//! slot. There is no think time. With `--request-rate` the Poisson arrival
//! times pace all requests: the j-th request goes out at the j-th arrival, or
//! later when no turn is ready or no slot is free then (as single requests do
//! when the concurrency cap is hit). Per turn it reports the server's cached
//! prefix (`usage.prompt_tokens_details.cached_tokens`) against what the
//! previous turn could have left in the cache: its prompt plus completion
//! tokens, rounded down to whole KV blocks.
//!
//! The parts: `args` (flags and their checks), `prompts` (what is sent),
//! `session` (a multi-turn conversation as it runs), `client` (HTTP and
//! SSE), `request` (one request, timed), `load` (the schedule of requests
//! and sessions), `stats` and `report` (aggregates, text and JSON); `run`
//! here drives a sweep.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::json;

mod args;
mod client;
mod load;
mod prompts;
mod report;
mod request;
mod session;
mod stats;

pub use args::BenchArgs;

use args::{Endpoint, check_args};
use client::{default_model, http_client, parse_url};
use load::{run_point, run_sessions};
use prompts::{Spec, make_sessions, make_specs};
use report::{Report, aggregate, multi_turn_stats};
use request::{Shared, run_one};

pub fn run(args: BenchArgs) -> Result<()> {
    check_args(&args)?;
    let multi_turn = args.multi_turn_sessions.zip(args.turns);
    let base = parse_url(&args.url)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let client = http_client(args.keep_alive)?;
        let model = match &args.model {
            Some(m) => m.clone(),
            None => default_model(&client, &base)
                .await
                .context("finding the model name (or pass --model)")?,
        };
        let path = match args.endpoint {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
        };
        let sh = Arc::new(Shared {
            client,
            url: format!("{base}{path}"),
            path,
            model: model.clone(),
            endpoint: args.endpoint,
            temperature: args.temperature,
            ignore_eos: args.ignore_eos,
            timeout: Duration::from_secs(args.timeout.max(1)),
        });
        let specs = if multi_turn.is_none() {
            make_specs(&args)
        } else {
            Vec::new()
        };
        let num_requests = multi_turn.map_or(specs.len(), |(n, t)| n * t);
        let points: Vec<Option<usize>> = if args.sweep_concurrency.is_empty() {
            vec![match args.request_rate {
                Some(_) => args.concurrency,
                None => Some(args.concurrency.unwrap_or(8)),
            }]
        } else {
            args.sweep_concurrency.iter().map(|&c| Some(c)).collect()
        };
        let per_point = match multi_turn {
            Some((n, t)) => format!("{n} sessions x {t} turns ({num_requests} requests)"),
            None => format!("{num_requests} requests"),
        };
        eprintln!(
            "tandem bench: {} ({model}), {per_point} per point",
            args.url
        );
        let mut reports = Vec::new();
        for (point, c) in points.into_iter().enumerate() {
            let label = match (c, args.request_rate) {
                (Some(c), Some(r)) => format!("rate {r} req/s, concurrency <= {c}"),
                (None, Some(r)) => format!("rate {r} req/s"),
                (Some(c), None) => format!("concurrency {c}"),
                (None, None) => "unbounded".to_string(),
            };
            if !args.quiet {
                eprintln!("{label}:");
            }
            let (dur, outs) = match multi_turn {
                None => {
                    run_point(
                        Arc::clone(&sh),
                        &specs,
                        c,
                        args.request_rate,
                        args.seed,
                        args.quiet,
                    )
                    .await
                }
                Some((n, t)) => {
                    let sh = Arc::clone(&sh);
                    let run_turn = move |spec: Spec| {
                        let sh = Arc::clone(&sh);
                        async move { run_one(&sh, &spec).await }
                    };
                    run_sessions(
                        make_sessions(&args, n, t, point),
                        c,
                        args.request_rate,
                        args.seed,
                        args.kv_block_size,
                        args.quiet,
                        run_turn,
                    )
                    .await
                }
            };
            let mut r = aggregate(
                label,
                c,
                args.request_rate,
                dur,
                &outs,
                args.goodput.as_ref(),
            );
            if let Some((n, t)) = multi_turn {
                r.multi_turn = Some(multi_turn_stats(n, t, args.kv_block_size, &outs));
            }
            print!("{}", r.text());
            reports.push(r);
        }
        if let Some(path) = &args.json {
            let slo = args
                .goodput
                .map(|s| json!({"ttft_ms": s.ttft_ms, "tpot_ms": s.tpot_ms, "e2e_ms": s.e2e_ms}));
            let v = json!({
                "url": args.url,
                "model": model,
                "endpoint": sh.path,
                "num_requests": num_requests,
                "multi_turn_sessions": args.multi_turn_sessions,
                "turns": args.turns,
                "kv_block_size": args.kv_block_size,
                "input_len": args.input_len,
                "input_len_range": args.input_len_range.map(|(a, b)| [a, b]),
                "output_len": args.output_len,
                "output_len_range": args.output_len_range.map(|(a, b)| [a, b]),
                "shared_prefix_groups": args.shared_prefix_groups,
                "shared_prefix_len": args.shared_prefix_len,
                "seed": args.seed,
                "temperature": args.temperature,
                "ignore_eos": args.ignore_eos,
                "goodput_slo": slo,
                "results": reports.iter().map(Report::json).collect::<Vec<_>>(),
            });
            std::fs::write(path, serde_json::to_string_pretty(&v)? + "\n")
                .with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(())
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests;
