//! `tandem bench-engine`: raw engine throughput, measured with the engine API
//! directly (no HTTP, no scheduler), in the spirit of `llama-bench` and
//! `llama-batched-bench`.
//!
//! * `pp<N>`: prefill of N random tokens of one sequence, in forward calls of
//!   at most `--prefill-chunk` tokens.
//! * `tg<N>`: one sequence, a 1-token prompt (not timed), then N decode
//!   forward passes of one token each, greedy (argmax) on the logits.
//! * batched: B sequences are prefilled with `--npp` tokens each (forward
//!   calls batch whole sequences up to `--prefill-chunk` tokens per call),
//!   then `--ntg` decode steps, each ONE forward call with B single-token
//!   chunks, as continuous batching runs them. Generation speed is
//!   `B * ntg / decode time`.
//! * `--profile FILE`: also measures the planner's and mock engine's
//!   profile (`tandem_perfmodel::EngineProfile`): one prefill forward call
//!   per token count (best of `--reps`), and one decode step of B
//!   single-token sequences at each batch x context (the median of
//!   `2 x --reps + 1` steps, at least 5, after one untimed step).
//!
//! `--tp N` runs every test on N tensor-parallel ranks (threads over shared
//! memory, one shard each): the engine's `TpExecutor`, which the scheduler
//! drives too.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;

use crate::kernel_args::KernelArgs;
use tandem_engine::backend::{LogitsForm, RunnerConfig, StepLogits};
use tandem_engine::kv_cache::KvCache;
use tandem_engine::model::SeqChunk;
use tandem_engine::moe::Combine;
use tandem_engine::sampler::argmax;
use tandem_engine::{LoadedModel, ServedModel, StepRunner};
use tandem_modelfile::fetch;
use tandem_perfmodel::profile::PROFILE_VERSION;
use tandem_perfmodel::{DecodePoint, EngineProfile, PrefillPoint};

const BLOCK_SIZE: usize = 16;

/// Comma-separated batch sizes; the empty string is none.
#[derive(Debug, Clone)]
struct BatchSizes(Vec<usize>);

impl std::str::FromStr for BatchSizes {
    type Err = std::num::ParseIntError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.trim().is_empty() {
            return Ok(Self(Vec::new()));
        }
        s.split(',')
            .map(|b| b.trim().parse())
            .collect::<Result<_, _>>()
            .map(Self)
    }
}

#[derive(Debug, Args)]
pub struct BenchEngineArgs {
    /// A .gguf file, an HF model directory, an alias (smollm2-135m,
    /// qwen2.5-coder-0.5b, gemma3-270m), or a Hugging Face repo id
    /// ORG/NAME[@REVISION][:QUANT] (downloaded from $HF_ENDPOINT).
    #[arg(long, env = "TANDEM_MODEL", default_value = fetch::DEFAULT_MODEL)]
    model: String,
    #[command(flatten)]
    kernels: KernelArgs,
    /// Where fetched models are cached (default: $XDG_CACHE_HOME/tandem).
    #[arg(long, env = "TANDEM_CACHE")]
    cache_dir: Option<PathBuf>,
    /// Prompt-processing test: tokens of one sequence (0 skips it).
    #[arg(long, env = "TANDEM_BENCH_PP", default_value_t = 512)]
    pp: usize,
    /// Single-sequence generation test: decode steps (0 skips it).
    #[arg(long, env = "TANDEM_BENCH_TG", default_value_t = 128)]
    tg: usize,
    /// Batch sizes for the batched test, comma-separated (empty skips it).
    #[arg(long, env = "TANDEM_BENCH_BATCH", default_value = "1,8,32")]
    batch: BatchSizes,
    /// Batched test: prompt tokens per sequence.
    #[arg(long, env = "TANDEM_BENCH_NPP", default_value_t = 128)]
    npp: usize,
    /// Batched test: decode steps (tokens generated per sequence).
    #[arg(long, env = "TANDEM_BENCH_NTG", default_value_t = 128)]
    ntg: usize,
    /// Repetitions of each test (after one untimed warm-up).
    #[arg(long, env = "TANDEM_BENCH_REPS", default_value_t = 3)]
    reps: usize,
    /// Most prompt tokens run in one forward call.
    #[arg(long, env = "TANDEM_PREFILL_CHUNK", default_value_t = 512)]
    prefill_chunk: usize,
    /// Seed for the random prompt token ids.
    #[arg(long, env = "TANDEM_SEED", default_value_t = 1234)]
    seed: u64,
    /// Also write the results as JSON to this file.
    #[arg(long, env = "TANDEM_BENCH_JSON")]
    json: Option<PathBuf>,
    /// Tensor-parallel ranks (threads over shared memory), as `serve --tp`.
    #[arg(long, env = "TANDEM_TP", default_value_t = 1)]
    tp: usize,
    /// Also measure an engine profile (for `tandem plan` and the mock
    /// engine) and write it to this file.
    #[arg(long, env = "TANDEM_BENCH_PROFILE")]
    profile: Option<PathBuf>,
    /// Profile: prompt lengths of the prefill points, comma-separated.
    #[arg(
        long,
        env = "TANDEM_BENCH_PROFILE_PREFILL",
        default_value = "16,32,64,128,256,512"
    )]
    profile_prefill: BatchSizes,
    /// Profile: decode batch sizes, comma-separated.
    #[arg(
        long,
        env = "TANDEM_BENCH_PROFILE_BATCH",
        default_value = "1,2,4,8,16,32"
    )]
    profile_batch: BatchSizes,
    /// Profile: decode contexts (tokens already in each sequence), comma-separated.
    #[arg(long, env = "TANDEM_BENCH_PROFILE_CONTEXT", default_value = "128,512")]
    profile_context: BatchSizes,
}

/// One row of the report.
#[derive(Debug)]
struct Row {
    test: String,
    /// `pp`, `tg`, `batched_prefill` or `batched_gen`.
    kind: &'static str,
    batch: usize,
    /// Tokens processed (or generated) per repetition.
    n_tokens: usize,
    /// Forward calls per repetition.
    n_calls: usize,
    samples: Vec<Duration>,
}

impl Row {
    fn rates(&self) -> Vec<f64> {
        self.samples
            .iter()
            .map(|d| self.n_tokens as f64 / d.as_secs_f64().max(1e-9))
            .collect()
    }
    fn best(&self) -> f64 {
        self.rates().into_iter().fold(0.0, f64::max)
    }
    fn mean(&self) -> f64 {
        let r = self.rates();
        r.iter().sum::<f64>() / r.len().max(1) as f64
    }
    fn stddev(&self) -> f64 {
        let r = self.rates();
        if r.len() < 2 {
            return 0.0;
        }
        let m = self.mean();
        (r.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (r.len() - 1) as f64).sqrt()
    }
    fn mean_ms(&self) -> f64 {
        self.samples.iter().map(|d| d.as_secs_f64()).sum::<f64>() * 1e3
            / self.samples.len().max(1) as f64
    }
}

use tandem_types::SeededRng as Rng;

/// A KV pool and the runner that steps it: under `--tp` the runner's peer
/// ranks own pools of their own with the same block ids, so the two are made
/// and dropped together.
struct Pool {
    cache: KvCache,
    runner: Box<dyn StepRunner>,
}

struct Bench {
    model: Arc<LoadedModel>,
    tp: usize,
    vocab: usize,
    prefill_chunk: usize,
    rng: Rng,
}

impl Bench {
    /// A pool holding `tokens` tokens (block size 16), stepped by the
    /// model's own `StepRunner`, as the scheduler steps it.
    fn pool(&self, tokens: usize) -> Result<Pool> {
        let runner = Arc::clone(&self.model)
            .runner(RunnerConfig {
                tp: self.tp,
                moe_combine: Combine::AllReduce,
                block_size: BLOCK_SIZE,
                num_blocks: tokens.div_ceil(BLOCK_SIZE).max(1),
            })
            .with_context(|| format!("--tp {}", self.tp))?;
        let kv = KvCache::new(runner.kv_cache_config()).context("creating KV cache")?;
        Ok(Pool { cache: kv, runner })
    }

    /// One forward call (on every rank); its logits.
    fn forward(&self, chunks: &[SeqChunk<'_>], pool: &mut Pool) -> Result<Vec<f32>> {
        let mut logits = StepLogits::default();
        self.forward_into(chunks, pool, &mut logits)?;
        Ok(logits.values)
    }

    /// One forward call into a kept logits buffer.
    fn forward_into(
        &self,
        chunks: &[SeqChunk<'_>],
        pool: &mut Pool,
        logits: &mut StepLogits,
    ) -> Result<()> {
        pool.runner.forward(
            chunks,
            &mut pool.cache,
            &mut |_| {},
            LogitsForm::Full,
            logits,
        )?;
        Ok(())
    }

    /// A pool holding one sequence of `tokens` tokens, and its block table.
    /// Repetitions reuse both: each run overwrites the K/V it reads.
    fn cache_one(&self, tokens: usize) -> Result<(Pool, Vec<u32>)> {
        let mut pool = self.pool(tokens)?;
        let mut table = Vec::new();
        pool.cache.reserve(&mut table, tokens)?;
        Ok((pool, table))
    }

    /// Prefills one sequence of `n` tokens from position 0; returns the time
    /// and the forward-call count.
    fn prefill_one(
        &mut self,
        pool: &mut Pool,
        table: &[u32],
        n: usize,
    ) -> Result<(Duration, usize)> {
        let prompt = self.rng.tokens(n, self.vocab);
        let t0 = Instant::now();
        let mut calls = 0;
        for (i, piece) in prompt.chunks(self.prefill_chunk).enumerate() {
            let start_pos = i * self.prefill_chunk;
            let logits = self.forward(
                &[SeqChunk {
                    tokens: piece,
                    start_pos,
                    block_table: table,
                    want_logits: start_pos + piece.len() == n,
                }],
                pool,
            )?;
            std::hint::black_box(&logits);
            calls += 1;
        }
        Ok((t0.elapsed(), calls))
    }

    /// A 1-token prompt (untimed), then `n` greedy decode steps (timed).
    fn decode_one(&mut self, pool: &mut Pool, table: &[u32], n: usize) -> Result<Duration> {
        let first = self.rng.tokens(1, self.vocab);
        let logits = self.forward(
            &[SeqChunk {
                tokens: &first,
                start_pos: 0,
                block_table: table,
                want_logits: true,
            }],
            pool,
        )?;
        let mut tok = argmax(logits.get(..self.vocab).context("short logits")?);
        let mut logits = StepLogits::default();
        let t0 = Instant::now();
        for pos in 1..=n {
            self.forward_into(
                &[SeqChunk {
                    tokens: &[tok],
                    start_pos: pos,
                    block_table: table,
                    want_logits: true,
                }],
                pool,
                &mut logits,
            )?;
            tok = argmax(logits.values.get(..self.vocab).context("short logits")?);
        }
        Ok(t0.elapsed())
    }

    /// B sequences: prefill `npp` tokens each, then `ntg` batched decode
    /// steps. Returns (prefill time, prefill calls, decode time).
    fn batched(
        &mut self,
        pool: &mut Pool,
        tables: &[Vec<u32>],
        npp: usize,
        ntg: usize,
    ) -> Result<(Duration, usize, Duration)> {
        let b = tables.len();
        let prompts: Vec<Vec<u32>> = (0..b).map(|_| self.rng.tokens(npp, self.vocab)).collect();
        let mut next = vec![0u32; b];

        // Prefill: whole sequences grouped so that a call holds at most
        // `prefill_chunk` tokens (at least one sequence); a sequence longer
        // than that runs alone, in pieces.
        let per_call = (self.prefill_chunk / npp.max(1)).max(1);
        let t0 = Instant::now();
        let mut calls = 0;
        if npp > self.prefill_chunk {
            for (s, prompt) in prompts.iter().enumerate() {
                for (i, piece) in prompt.chunks(self.prefill_chunk).enumerate() {
                    let start_pos = i * self.prefill_chunk;
                    let last = start_pos + piece.len() == npp;
                    let logits = self.forward(
                        &[SeqChunk {
                            tokens: piece,
                            start_pos,
                            block_table: &tables[s],
                            want_logits: last,
                        }],
                        pool,
                    )?;
                    calls += 1;
                    if last {
                        next[s] = argmax(logits.get(..self.vocab).context("short logits")?);
                    }
                }
            }
        } else {
            for first in (0..b).step_by(per_call) {
                let group = first..(first + per_call).min(b);
                let chunks: Vec<SeqChunk<'_>> = group
                    .clone()
                    .map(|s| SeqChunk {
                        tokens: &prompts[s],
                        start_pos: 0,
                        block_table: &tables[s],
                        want_logits: true,
                    })
                    .collect();
                let logits = self.forward(&chunks, pool)?;
                calls += 1;
                for (s, row) in group.zip(logits.chunks_exact(self.vocab)) {
                    next[s] = argmax(row);
                }
            }
        }
        let t_pp = t0.elapsed();

        // One logits buffer for every step, as the scheduler keeps one.
        let mut logits = StepLogits::default();
        let t1 = Instant::now();
        for step in 0..ntg {
            let toks = next.clone();
            let chunks: Vec<SeqChunk<'_>> = (0..b)
                .map(|s| SeqChunk {
                    tokens: std::slice::from_ref(&toks[s]),
                    start_pos: npp + step,
                    block_table: &tables[s],
                    want_logits: true,
                })
                .collect();
            self.forward_into(&chunks, pool, &mut logits)?;
            let logits = &logits.values;
            if logits.len() != b * self.vocab {
                bail!(
                    "forward returned {} logits, want {}",
                    logits.len(),
                    b * self.vocab
                );
            }
            for (n, row) in next.iter_mut().zip(logits.chunks_exact(self.vocab)) {
                *n = argmax(row);
            }
        }
        Ok((t_pp, calls, t1.elapsed()))
    }

    /// Profile prefill point: one forward call of `n` prompt tokens from
    /// position 0, logits for the last (a prefill node samples it); the
    /// best of `reps`.
    fn profile_prefill(&mut self, n: usize, reps: usize) -> Result<f64> {
        let (mut pool, table) = self.cache_one(n)?;
        let mut best = f64::INFINITY;
        for _ in 0..reps {
            let prompt = self.rng.tokens(n, self.vocab);
            let t0 = Instant::now();
            let logits = self.forward(
                &[SeqChunk {
                    tokens: &prompt,
                    start_pos: 0,
                    block_table: &table,
                    want_logits: true,
                }],
                &mut pool,
            )?;
            best = best.min(t0.elapsed().as_secs_f64());
            std::hint::black_box(&logits);
        }
        Ok(best)
    }

    /// Profile decode point: `b` sequences already `context` tokens long
    /// (their K/V is not computed: attention costs the same whatever the
    /// values), one untimed step, then the median of `steps` timed steps of
    /// one token each, every sequence in one forward call (the median, as
    /// a step another process preempted says nothing about the engine).
    fn profile_decode(&mut self, b: usize, context: usize, steps: usize) -> Result<f64> {
        let per_seq = context + steps + 1;
        let mut pool = self.pool(b * per_seq.div_ceil(BLOCK_SIZE) * BLOCK_SIZE)?;
        let mut tables = Vec::with_capacity(b);
        for _ in 0..b {
            let mut t = Vec::new();
            pool.cache.reserve(&mut t, per_seq)?;
            tables.push(t);
        }
        let mut logits = StepLogits::default();
        let mut times = Vec::with_capacity(steps);
        for step in 0..=steps {
            let toks = self.rng.tokens(b, self.vocab);
            let chunks: Vec<SeqChunk<'_>> = (0..b)
                .map(|s| SeqChunk {
                    tokens: std::slice::from_ref(&toks[s]),
                    start_pos: context + step,
                    block_table: &tables[s],
                    want_logits: true,
                })
                .collect();
            let t0 = Instant::now();
            self.forward_into(&chunks, &mut pool, &mut logits)?;
            if step > 0 {
                times.push(t0.elapsed().as_secs_f64());
            }
        }
        times.sort_by(f64::total_cmp);
        Ok(times.get(times.len() / 2).copied().unwrap_or(0.0))
    }
}

/// Measures the `--profile` points.
fn measure_profile(
    bench: &mut Bench,
    args: &BenchEngineArgs,
    model: &str,
    isa: &str,
    threads: usize,
) -> Result<EngineProfile> {
    let mut prefill = Vec::new();
    let mut tokens = args.profile_prefill.0.clone();
    tokens.sort_unstable();
    tokens.dedup();
    for &n in &tokens {
        let seconds = bench.profile_prefill(n, args.reps)?;
        eprintln!("profile prefill {n} tokens: {:.2} ms", seconds * 1e3);
        prefill.push(PrefillPoint { tokens: n, seconds });
    }
    let mut decode = Vec::new();
    let steps = (2 * args.reps + 1).max(5);
    for &c in &args.profile_context.0 {
        for &b in &args.profile_batch.0 {
            let seconds = bench.profile_decode(b, c, steps)?;
            eprintln!(
                "profile decode batch {b} context {c}: {:.2} ms",
                seconds * 1e3
            );
            decode.push(DecodePoint {
                batch: b,
                context: c,
                seconds,
            });
        }
    }
    let profile = EngineProfile {
        version: PROFILE_VERSION,
        model: model.to_string(),
        isa: isa.to_string(),
        threads,
        tp: args.tp.max(1),
        prefill,
        decode,
    };
    profile.validate().context("measured profile")?;
    Ok(profile)
}

/// Refuses flag values no test can run with.
fn validate(args: &BenchEngineArgs) -> Result<()> {
    if args.prefill_chunk == 0 {
        bail!("--prefill-chunk must be at least 1");
    }
    if args.reps == 0 {
        bail!("--reps must be at least 1");
    }
    if args.batch.0.contains(&0) {
        bail!("--batch sizes must be at least 1");
    }
    if !args.batch.0.is_empty() && (args.npp == 0 || args.ntg == 0) {
        bail!("--npp and --ntg must be at least 1 for the batched test");
    }
    if args.tp == 0 {
        bail!("--tp must be at least 1");
    }
    if args.profile.is_some() {
        validate_profile_axes(args)?;
    }
    Ok(())
}

/// The `--profile-*` axes: non-empty, at least 1, batch and context
/// without repeats.
fn validate_profile_axes(args: &BenchEngineArgs) -> Result<()> {
    let axes = [
        ("--profile-prefill", &args.profile_prefill),
        ("--profile-batch", &args.profile_batch),
        ("--profile-context", &args.profile_context),
    ];
    for (flag, v) in axes {
        if v.0.is_empty() || v.0.contains(&0) {
            bail!("{flag} needs values of at least 1");
        }
    }
    let mut b = args.profile_batch.0.clone();
    let mut c = args.profile_context.0.clone();
    b.sort_unstable();
    b.dedup();
    c.sort_unstable();
    c.dedup();
    if b.len() != args.profile_batch.0.len() || c.len() != args.profile_context.0.len() {
        bail!("--profile-batch and --profile-context must not repeat a value");
    }
    Ok(())
}

/// The most positions any requested test needs.
fn longest_test(args: &BenchEngineArgs) -> usize {
    let mut longest = args.pp.max(args.tg + 1).max(if args.batch.0.is_empty() {
        0
    } else {
        args.npp + args.ntg
    });
    if args.profile.is_some() {
        let p = args.profile_prefill.0.iter().max().copied().unwrap_or(0);
        let c = args.profile_context.0.iter().max().copied().unwrap_or(0);
        longest = longest.max(p).max(c + (2 * args.reps + 1).max(5) + 1);
    }
    longest
}

/// The `pp` test: one sequence's prefill of `--pp` tokens.
fn bench_pp(bench: &mut Bench, args: &BenchEngineArgs) -> Result<Row> {
    let (mut pool, table) = bench.cache_one(args.pp)?;
    let mut row = Row {
        test: format!("pp{}", args.pp),
        kind: "pp",
        batch: 1,
        n_tokens: args.pp,
        n_calls: 0,
        samples: Vec::new(),
    };
    for _ in 0..args.reps {
        let (dt, calls) = bench.prefill_one(&mut pool, &table, args.pp)?;
        row.samples.push(dt);
        row.n_calls = calls;
    }
    eprintln!("{}: {:.1} t/s", row.test, row.best());
    Ok(row)
}

/// The `tg` test: one sequence decoding `--tg` tokens.
fn bench_tg(bench: &mut Bench, args: &BenchEngineArgs) -> Result<Row> {
    let (mut pool, table) = bench.cache_one(args.tg + 1)?;
    let mut row = Row {
        test: format!("tg{}", args.tg),
        kind: "tg",
        batch: 1,
        n_tokens: args.tg,
        n_calls: args.tg,
        samples: Vec::new(),
    };
    for _ in 0..args.reps {
        row.samples
            .push(bench.decode_one(&mut pool, &table, args.tg)?);
    }
    eprintln!("{}: {:.1} t/s", row.test, row.best());
    Ok(row)
}

/// The batched test of `b` sequences: its prefill row and its gen row.
fn bench_batched(bench: &mut Bench, args: &BenchEngineArgs, b: usize) -> Result<[Row; 2]> {
    let per_seq = args.npp + args.ntg;
    let mut pool = bench.pool(b * per_seq.div_ceil(BLOCK_SIZE) * BLOCK_SIZE)?;
    let mut tables = Vec::with_capacity(b);
    for _ in 0..b {
        let mut t = Vec::new();
        pool.cache.reserve(&mut t, per_seq)?;
        tables.push(t);
    }
    let name = format!("B={b} npp{} ntg{}", args.npp, args.ntg);
    let mut pre = Row {
        test: format!("{name} prefill"),
        kind: "batched_prefill",
        batch: b,
        n_tokens: b * args.npp,
        n_calls: 0,
        samples: Vec::new(),
    };
    let mut gen_row = Row {
        test: format!("{name} gen"),
        kind: "batched_gen",
        batch: b,
        n_tokens: b * args.ntg,
        n_calls: args.ntg,
        samples: Vec::new(),
    };
    for _ in 0..args.reps {
        let (t_pp, calls, t_tg) = bench.batched(&mut pool, &tables, args.npp, args.ntg)?;
        pre.samples.push(t_pp);
        pre.n_calls = calls;
        gen_row.samples.push(t_tg);
    }
    eprintln!(
        "{name}: prefill {:.1} t/s, gen {:.1} t/s",
        pre.best(),
        gen_row.best()
    );
    Ok([pre, gen_row])
}

/// Every requested test's rows, in the order they are printed.
fn bench_rows(bench: &mut Bench, args: &BenchEngineArgs) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    // Warm-up: page in the weights, spin up the thread pool, size buffers.
    {
        let (mut pool, table) = bench.cache_one(64)?;
        bench.prefill_one(&mut pool, &table, 32)?;
        bench.decode_one(&mut pool, &table, 8)?;
    }
    if args.pp > 0 {
        rows.push(bench_pp(bench, args)?);
    }
    if args.tg > 0 {
        rows.push(bench_tg(bench, args)?);
    }
    for &b in &args.batch.0 {
        rows.extend(bench_batched(bench, args, b)?);
    }
    Ok(rows)
}

pub fn run(args: BenchEngineArgs) -> Result<()> {
    validate(&args)?;
    args.kernels.apply()?;
    let cache_dir = args.cache_dir.clone().unwrap_or_else(fetch::cache_dir);
    let path = crate::fetch::resolve_model(&args.model, &cache_dir)?;
    let m = Arc::new(
        tandem_engine::load(&path).with_context(|| format!("loading {}", path.display()))?,
    );
    let cfg = m.model.config();
    let vocab = cfg.vocab_size;
    let longest = longest_test(&args);
    if longest > cfg.context_length && cfg.context_length > 0 {
        bail!(
            "a test needs {longest} positions; the model's context is {}",
            cfg.context_length
        );
    }
    let isa = tandem_kernels::isa().to_string();
    let threads = tandem_kernels::num_threads();
    println!(
        "model: {} ({}), {} layers, vocab {vocab}",
        m.text.name,
        path.display(),
        cfg.n_layers
    );
    println!(
        "kernels: {isa}, threads: {threads}, reps: {}, prefill chunk: {}",
        args.reps, args.prefill_chunk
    );
    if args.tp > 1 {
        println!("tensor parallel: {} ranks", args.tp);
    }

    let mut bench = Bench {
        model: Arc::clone(&m),
        tp: args.tp,
        vocab,
        prefill_chunk: args.prefill_chunk,
        rng: Rng::new(args.seed),
    };
    let rows = bench_rows(&mut bench, &args)?;
    let profile = match &args.profile {
        Some(_) => Some(measure_profile(
            &mut bench,
            &args,
            &m.text.name,
            &isa,
            threads,
        )?),
        None => None,
    };

    print!("{}", table(&rows));
    if let Some(file) = &args.json {
        let json = to_json(
            &m.text.name,
            &path.display().to_string(),
            &isa,
            threads,
            &args,
            &rows,
        );
        std::fs::write(file, json).with_context(|| format!("writing {}", file.display()))?;
        eprintln!("wrote {}", file.display());
    }
    if let (Some(file), Some(profile)) = (&args.profile, &profile) {
        std::fs::write(file, profile.to_json() + "\n")
            .with_context(|| format!("writing {}", file.display()))?;
        eprintln!("wrote profile {}", file.display());
    }
    Ok(())
}

fn table(rows: &[Row]) -> String {
    let w = rows.iter().map(|r| r.test.len()).max().unwrap_or(4).max(4);
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| {:<w$} | {:>7} | {:>5} | {:>12} | {:>20} | {:>10} |",
        "test", "tokens", "calls", "best t/s", "mean t/s", "mean ms"
    );
    let _ = writeln!(
        s,
        "| {:-<w$} | {:->7} | {:->5} | {:->12} | {:->20} | {:->10} |",
        "", "", "", "", "", ""
    );
    for r in rows {
        let _ = writeln!(
            s,
            "| {:<w$} | {:>7} | {:>5} | {:>12.2} | {:>20} | {:>10.2} |",
            r.test,
            r.n_tokens,
            r.n_calls,
            r.best(),
            format!("{:.2} ± {:.2}", r.mean(), r.stddev()),
            r.mean_ms()
        );
    }
    s
}

fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn to_json(
    name: &str,
    path: &str,
    isa: &str,
    threads: usize,
    args: &BenchEngineArgs,
    rows: &[Row],
) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "{{");
    let _ = writeln!(s, "  \"engine\": \"tandem\",");
    let _ = writeln!(s, "  \"model\": {},", json_str(name));
    let _ = writeln!(s, "  \"model_path\": {},", json_str(path));
    let _ = writeln!(s, "  \"isa\": {},", json_str(isa));
    let _ = writeln!(s, "  \"threads\": {threads},");
    let _ = writeln!(s, "  \"reps\": {},", args.reps);
    let _ = writeln!(s, "  \"prefill_chunk\": {},", args.prefill_chunk);
    let _ = writeln!(s, "  \"results\": [");
    for (i, r) in rows.iter().enumerate() {
        let ms: Vec<String> = r
            .samples
            .iter()
            .map(|d| format!("{:.3}", d.as_secs_f64() * 1e3))
            .collect();
        let _ = writeln!(
            s,
            "    {{\"test\": {}, \"kind\": \"{}\", \"batch\": {}, \"n_tokens\": {}, \"n_calls\": {}, \
             \"tokens_per_s_best\": {:.3}, \"tokens_per_s_mean\": {:.3}, \"tokens_per_s_stddev\": {:.3}, \
             \"ms_mean\": {:.3}, \"ms_samples\": [{}]}}{}",
            json_str(&r.test),
            r.kind,
            r.batch,
            r.n_tokens,
            r.n_calls,
            r.best(),
            r.mean(),
            r.stddev(),
            r.mean_ms(),
            ms.join(", "),
            if i + 1 < rows.len() { "," } else { "" }
        );
    }
    let _ = writeln!(s, "  ]");
    let _ = writeln!(s, "}}");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_strings_are_escaped() {
        assert_eq!(json_str("a\"b\\c\n\u{1}"), "\"a\\\"b\\\\c\\n\\u0001\"");
    }

    #[test]
    fn batch_sizes_parse_and_empty_is_none() {
        let parse = |s: &str| s.parse::<BatchSizes>().map(|b| b.0);
        assert_eq!(parse("1,8, 32"), Ok(vec![1, 8, 32]));
        assert_eq!(parse(""), Ok(vec![]));
        assert!(parse("1,,2").is_err());
        assert!(parse("x").is_err());
    }

    #[test]
    fn rng_stays_in_vocab() {
        let mut r = Rng::new(7);
        assert!(r.tokens(1000, 49152).iter().all(|&t| t < 49152));
    }

    #[test]
    fn row_stats() {
        let r = Row {
            test: "pp2".into(),
            kind: "pp",
            batch: 1,
            n_tokens: 100,
            n_calls: 1,
            samples: vec![Duration::from_millis(100), Duration::from_millis(200)],
        };
        assert!((r.best() - 1000.0).abs() < 1e-6);
        assert!((r.mean() - 750.0).abs() < 1e-6);
        assert!((r.mean_ms() - 150.0).abs() < 1e-6);
    }
}
