//! `tandem generate`: one prompt, streamed to stdout, speed to stderr.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Args;

use crate::kernel_args::KernelArgs;
use tandem_engine::RequestError;
use tandem_engine::comm::{DeviceSpec, GpuSelection, parse_devices};
use tandem_engine::generate::{GenerateOutput, GenerateRequest, generate, generate_on};
use tandem_engine::sampler::SamplingParams;
use tandem_gpu::GpuDevice;
use tandem_gpu::llama::GpuLlama;
use tandem_gpu::weights::ModelFiles;
use tandem_modelfile::ModelText;
use tandem_modelfile::chat::ChatMessage;
use tandem_modelfile::fetch;
use tandem_types::RequestLimits;

#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// A .gguf file, an HF model directory, an alias (smollm2-135m,
    /// qwen2.5-coder-0.5b, gemma3-270m), or a Hugging Face repo id
    /// ORG/NAME[@REVISION][:QUANT] (downloaded from $HF_ENDPOINT).
    #[arg(long, env = "TANDEM_MODEL", default_value = fetch::DEFAULT_MODEL)]
    model: String,
    /// The prompt text.
    #[arg(long, env = "TANDEM_PROMPT")]
    prompt: String,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long, env = "TANDEM_CHAT")]
    chat: bool,
    /// System message (with --chat).
    #[arg(long, env = "TANDEM_SYSTEM")]
    system: Option<String>,
    #[arg(long, env = "TANDEM_MAX_TOKENS", default_value_t = 128)]
    max_tokens: usize,
    /// 0 is greedy.
    #[arg(long, env = "TANDEM_TEMPERATURE", default_value_t = 0.8)]
    temperature: f32,
    /// 0 disables top-k.
    #[arg(long, env = "TANDEM_TOP_K", default_value_t = 40)]
    top_k: usize,
    #[arg(long, env = "TANDEM_TOP_P", default_value_t = 0.95)]
    top_p: f32,
    #[arg(long, env = "TANDEM_MIN_P", default_value_t = 0.05)]
    min_p: f32,
    #[arg(long, env = "TANDEM_REPETITION_PENALTY", default_value_t = 1.0)]
    repetition_penalty: f32,
    #[arg(long, env = "TANDEM_FREQUENCY_PENALTY", default_value_t = 0.0)]
    frequency_penalty: f32,
    #[arg(long, env = "TANDEM_PRESENCE_PENALTY", default_value_t = 0.0)]
    presence_penalty: f32,
    #[arg(long, env = "TANDEM_SEED")]
    seed: Option<u64>,
    /// Stop when the text contains this string (repeatable).
    #[arg(long, env = "TANDEM_STOP")]
    stop: Vec<String>,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long, env = "TANDEM_IGNORE_EOS")]
    ignore_eos: bool,
    #[command(flatten)]
    kernels: KernelArgs,
    /// Where fetched models are cached (default: $XDG_CACHE_HOME/tandem).
    #[arg(long, env = "TANDEM_CACHE")]
    cache_dir: Option<PathBuf>,
    /// Longest prompt slice run in one forward pass.
    #[arg(long, env = "TANDEM_PREFILL_CHUNK", default_value_t = 512)]
    prefill_chunk: usize,
    /// Where the model runs: `cpu`, or one GPU `gpu:N` (a CUDA device, or
    /// a Vulkan device; Mesa's lavapipe where there is no GPU). The GPU
    /// runs Llama, Qwen2 and Gemma 3 models, from GGUF files or HF
    /// safetensors directories.
    #[arg(long, env = "TANDEM_DEVICES", default_value = "cpu")]
    devices: String,
}

/// Which device `generate` runs on.
enum Placement {
    Cpu,
    Gpu(usize),
}

impl GenerateArgs {
    fn placement(&self) -> Result<Placement> {
        match parse_devices(&self.devices)? {
            DeviceSpec::Cpu { ranks: 1 } => Ok(Placement::Cpu),
            DeviceSpec::Cpu { ranks } => bail!(
                "--devices {}: generate runs one rank ({ranks} given; `serve --tp` shards)",
                self.devices
            ),
            DeviceSpec::Gpu(GpuSelection::All) => Ok(Placement::Gpu(0)),
            DeviceSpec::Gpu(GpuSelection::Ids(ids)) => match ids[..] {
                [id] => Ok(Placement::Gpu(id)),
                _ => bail!("--devices {}: generate runs on one GPU", self.devices),
            },
        }
    }
}

pub fn run(args: GenerateArgs) -> Result<()> {
    if args.prefill_chunk == 0 {
        bail!("--prefill-chunk must be at least 1");
    }
    let placement = args.placement()?;
    args.kernels.apply()?;
    let cache = args.cache_dir.clone().unwrap_or_else(fetch::cache_dir);
    let path = crate::fetch::resolve_model(&args.model, &cache)?;
    if let Placement::Gpu(id) = placement {
        return run_on_gpu(&args, &path, id);
    }
    let m = tandem_engine::load(&path).with_context(|| format!("loading {}", path.display()))?;
    eprintln!(
        "tandem: loaded {} ({} layers) in {:.0} ms; kernels: {}, {} threads",
        m.text.name,
        m.model.config().n_layers,
        m.load_time.total.as_secs_f64() * 1e3,
        tandem_kernels::isa(),
        tandem_kernels::num_threads()
    );

    let req = request(&args, &m.text)?;
    stream(&req, |on_text| generate(&m, &req, on_text))
}

/// Runs a generation, its text streamed to stdout, then the speed line.
fn stream(
    req: &GenerateRequest,
    run: impl FnOnce(&mut dyn FnMut(&str)) -> Result<GenerateOutput, RequestError>,
) -> Result<()> {
    let mut stdout = std::io::stdout().lock();
    let out = run(&mut |piece: &str| {
        // A closed stdout (e.g. piped into `head`) just ends the output.
        let _ = stdout.write_all(piece.as_bytes());
        let _ = stdout.flush();
    })?;
    let _ = writeln!(stdout);
    report(req, &out);
    Ok(())
}

/// The request `args` describe, the prompt tokenized by `text`.
fn request(args: &GenerateArgs, model: &ModelText) -> Result<GenerateRequest> {
    let text = if args.chat {
        let template = model
            .chat_template
            .as_ref()
            .context("--chat: this model has no chat template")?;
        let mut messages = Vec::new();
        if let Some(s) = &args.system {
            messages.push(ChatMessage::new("system", s.as_str()));
        }
        messages.push(ChatMessage::new("user", args.prompt.as_str()));
        template.render(&messages, true)?
    } else {
        args.prompt.clone()
    };
    // A chat template writes its own BOS where the model wants one.
    let prompt = model.tokenizer.encode(&text, !args.chat)?;
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        seed: args.seed,
        frequency_penalty: args.frequency_penalty,
        presence_penalty: args.presence_penalty,
        repetition_penalty: args.repetition_penalty,
        ..SamplingParams::default()
    };
    Ok(GenerateRequest {
        prompt,
        sampling,
        max_tokens: args.max_tokens,
        stop_token_ids: if args.ignore_eos {
            Vec::new()
        } else {
            model.tokenizer.stop_ids()
        },
        stop_strings: args.stop.clone(),
        prefill_chunk: args.prefill_chunk,
    })
}

/// The speed line on stderr.
fn report(req: &GenerateRequest, out: &GenerateOutput) {
    let n_prompt = req.prompt.len();
    let n_gen = out.tokens.len();
    let rate = |n: usize, d: std::time::Duration| n as f64 / d.as_secs_f64().max(1e-9);
    eprintln!(
        "tandem: prompt {n_prompt} tokens in {:.1} ms ({:.1} tok/s); generated {n_gen} tokens in {:.1} ms ({:.1} tok/s); finish: {:?}",
        out.prefill_time.as_secs_f64() * 1e3,
        rate(n_prompt, out.prefill_time),
        out.decode_time.as_secs_f64() * 1e3,
        // The first token comes from the prefill's logits: n - 1 decode steps.
        rate(n_gen.saturating_sub(1), out.decode_time),
        out.finish
    );
}

/// `generate` on GPU `id`: the tokenizer from the GGUF's metadata, the
/// weights on the device (nothing of the CPU engine is loaded).
fn run_on_gpu(args: &GenerateArgs, path: &Path, id: usize) -> Result<()> {
    let t0 = std::time::Instant::now();
    let (config, text) = tandem_modelfile::meta::read_config_and_text(path)
        .with_context(|| format!("reading {}", path.display()))?;
    let files = ModelFiles::open(path).with_context(|| format!("reading {}", path.display()))?;
    let req = request(args, &text)?;
    let limits = RequestLimits {
        max_length: config.context_length,
        vocab_size: config.vocab_size,
    };
    let max_tokens = limits.check(&req.prompt, Some(req.max_tokens), &req.sampling)?;
    let (mut seq, adapter) = load_on_gpu(&files, id, req.prompt.len() + max_tokens)?;
    eprintln!(
        "tandem: loaded {} ({} layers) on gpu:{id}, {adapter}, in {:.0} ms",
        text.name,
        config.n_layers,
        t0.elapsed().as_secs_f64() * 1e3
    );
    stream(&req, |on_text| {
        generate_on(&mut seq, &text.tokenizer, limits, &req, on_text)
    })
}

/// The model's weights on GPU `id` with a KV pool of `max_ctx` positions,
/// and the adapter's name for the startup line.
fn load_on_gpu(files: &ModelFiles, id: usize, max_ctx: usize) -> Result<(GpuLlama, String)> {
    let dev = GpuDevice::open(id)?;
    let adapter = dev.name().to_string();
    Ok((GpuLlama::load(dev, files, max_ctx)?, adapter))
}
