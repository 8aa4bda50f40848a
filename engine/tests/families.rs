//! The forward pass of each model family on a real GGUF against independent
//! references: llama.cpp on the same GGUF (greedy continuations,
//! perplexity, last-position top-20 log-probabilities) and a numpy float32
//! forward pass over the dequantized weights, plus the prompt tokens and
//! chat prompts the references were made from. `tests/model.rs` checks
//! further properties of the forward pass on SmolLM2 (batching, prompt
//! splits, bad requests).
//!
//! References (tests/data/{prefix}-*.json; SmolLM2's, with no prefix,
//! tests/data/*.json) come from scripts/reference/model_refs.py and
//! perplexity_refs.py (llama.cpp vendored in llama-cpp-python 0.3.36, 2
//! threads, one slot, greedy, flash attention off and on). Run with a
//! prefix, the scripts record how each file was made; run without one (for
//! SmolLM2) they write their first format, which the checks also read: no
//! `add_special` per prompt (false: no BOS), no `made_with`, no
//! `bos_per_chunk` (false), the float reference's logits over the whole
//! vocabulary instead of its top tokens and log-sum-exp, and llama.cpp's
//! top 20 with flash attention off only.
//!
//! Every family is one [`Family`] entry and one `family_tests!` line. Needs
//! the GGUFs named by each entry's variable (`scripts/test.sh` sets them):
//! - `TANDEM_TEST_GGUF`: SmolLM2-135M-Instruct.Q4_1.gguf
//! - `TANDEM_TEST_QWEN2_GGUF`: qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
//! - `TANDEM_TEST_GEMMA3_GGUF`: gemma-3-270m-q4_k_m.gguf

mod common;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use serde_json::Value;
use tandem_engine::kv_cache::KvCache;
use tandem_engine::model::SeqChunk;
use tandem_engine::moe::Combine;
use tandem_engine::sampler::{Sampled, SamplingParams, argmax, log_softmax};
use tandem_engine::scheduler::{Scheduler, SchedulerConfig};
use tandem_engine::{LoadedModel, load};
use tandem_modelfile::chat::ChatTemplate;
use tandem_modelfile::gguf::GgufFile;
use tandem_modelfile::tokenizer::{Tokenizer, spec_from_gguf};
use tandem_types::{GenEvent, GenerationRequest};

/// One model family under test, its GGUF and its tolerances.
struct Family {
    /// Its name in test output.
    name: &'static str,
    /// Prefix of its reference files: tests/data/{prefix}-greedy_refs.json
    /// and {prefix}-logits_refs.json; "" for greedy_refs.json and
    /// logits_refs.json.
    prefix: &'static str,
    /// Environment variable holding the GGUF's path.
    env: &'static str,
    /// The GGUF's file name (the references record its sha256).
    gguf: &'static str,
    /// Greedy divergence allowed where llama.cpp's token is at most this far
    /// below ours in log-probability (see `check_greedy`).
    near_tie: f32,
    /// Greedy: at least this many prompts match a llama.cpp variant for all
    /// tokens (a tripwire for systematic drift).
    min_full_matches: usize,
    /// Bound on |our log-probability - llama.cpp's| over llama.cpp's top-20
    /// tokens at the last prompt position, each attention path.
    top20_bound: f32,
    /// How much further than llama.cpp's ours may sit from the float
    /// reference on llama.cpp's top-20 tokens.
    float_margin: FloatMargin,
    /// Our last-position argmax must be the float reference's wherever its
    /// top two logits are more than this apart; `None`: on every prompt.
    argmax_gap: Option<f32>,
    /// Bound on the max |logit difference| from the float reference over
    /// the whole vocabulary (needs a reference file holding every logit);
    /// `None`: not checked.
    max_logit_diff: Option<f32>,
    /// Perplexity reference files, each checked as in `check_perplexity`.
    perplexity: &'static [&'static str],
}

/// The bound on our top-20 log-probabilities' distance from the float
/// reference, beyond llama.cpp's own distance (per prompt the max over its
/// top-20 tokens, the worse of its attention paths where it has two).
enum FloatMargin {
    /// On every prompt.
    PerPrompt(f32),
    /// On average over the prompts.
    Mean(f32),
}

/// On average over a family's prompts, our top-20 log-probabilities may sit
/// at most this much further from the numpy float32 reference than
/// llama.cpp's (per prompt the worse of its two attention paths). Per prompt
/// the max over 20 tokens is set by tail tokens (log-probabilities -5 to
/// -13) and moved by up to 0.14 between two builds of our kernels (qwen2's
/// 205-token tool prompt: 0.19, then 0.33, llama.cpp 0.19); the mean over
/// 8-13 prompts is steadier. Measured means: see each family.
const FLOAT_MARGIN: f32 = 0.05;
/// Perplexity within 1% of each llama.cpp attention path's.
const PPL_BOUND: f64 = 0.01;
/// Mean per-token |NLL difference| at most this times llama.cpp's own
/// between its two attention paths.
const PER_TOKEN_FACTOR: f64 = 1.5;

/// SmolLM2-135M-Instruct Q4_1 (llama; 8 plain and 5 chat prompts, no BOS;
/// the first family, with reference files in the scripts' first format: see
/// the module doc). Its tolerances were set before the others' and are
/// tighter where they differ.
///
/// Greedy: llama.cpp's two attention paths disagree within 64 tokens on 9
/// of the 13 prompts. At least 2 prompts must match a llama.cpp variant for
/// all tokens. Measured when the check still counted llama-server's
/// trailing EOS as llama.cpp's last token: 2 with our block-order matmuls,
/// 5 when they summed in ggml's order; llama.cpp's two variants, which
/// share their matmul kernels, agree fully on 4. Now 3 of 13 (either way:
/// on the one chat prompt where llama.cpp stopped on EOS, after 62 tokens
/// with flash attention off, ours leaves it at token 29, where its two
/// variants split); at each divergence llama.cpp's token is at most 0.14
/// below ours in our log-probabilities. `near_tie` 0.35: logprobs of
/// llama.cpp and ours differ by 0.18-0.31 at the first position.
///
/// Last position (4 prompts, llama.cpp's top 20 with flash attention off
/// only), checked per prompt: our top-20 log-probabilities within 0.5 of
/// llama.cpp's (measured 0.18-0.31; now 0.21-0.29) and no more than 0.1
/// further from the float reference than llama.cpp's (measured: ours
/// 0.15-0.30, now 0.15-0.24, on average 0.20; llama.cpp's 0.20-0.43, on
/// average 0.29), with the float reference's argmax on every prompt (its
/// top two 0.36-5.0 apart); a full-vocabulary max |logit diff| from the
/// float reference of at most 1.5 (4% of the ~40-wide logit range;
/// measured 0.65-1.14, now 0.67-1.14) catches gross errors. The forward pass itself is checked tightly where no quantization
/// interferes: the F32 safetensors path agrees with the float reference to
/// ~0.01 (tests/hf_dir.rs).
///
/// Perplexity (3409 tokens, 6 chunks of 512, 1530 scored tokens): ours
/// 16.264, llama.cpp 16.321 and 16.276 (0.35% and 0.08% apart; llama.cpp's
/// paths are 0.27% apart); mean per-token |NLL difference| 0.057 and 0.059
/// nats, llama.cpp's paths 0.058, so the bound is 0.087. Regressions tried,
/// our perplexity and per-token difference (vs flash attention off):
/// activations quantized to 7 bits instead of 8: 16.460 (+1.2%), 0.119,
/// fails; 6 bits: 16.965, 0.205; layer 15's attention dropped: 18.315,
/// 0.333. Too small to fail, and to matter: RoPE base 10% off: 16.341,
/// 0.064; K/V stored as bf16: 16.306, 0.059.
const SMOLLM2: Family = Family {
    name: "smollm2",
    prefix: "",
    env: "TANDEM_TEST_GGUF",
    gguf: "SmolLM2-135M-Instruct.Q4_1.gguf",
    near_tie: 0.35,
    min_full_matches: 2,
    top20_bound: 0.5,
    float_margin: FloatMargin::PerPrompt(0.1),
    argmax_gap: None,
    max_logit_diff: Some(1.5),
    perplexity: &["perplexity_refs.json"],
};

/// Qwen2.5-Coder-0.5B-Instruct Q4_K_M (qwen2: q/k/v biases, NEOX RoPE,
/// untied output; 8 plain and 5 chat prompts, two of them with a tool
/// definition, one with a tool call and its result).
///
/// Measured at the last prompt position: llama.cpp's two attention paths
/// differ by 0.13-0.30 in top-20 log-probability (0.33 at most in the gap
/// between the top token and any other above -4, the near-ties that
/// matter), and lie 0.08-0.43 from the float reference; ours lie 0.07-0.46
/// from llama.cpp's and on average 0.19 from the float reference
/// (llama.cpp 0.21). Greedy: 8 of 13 prompts match a llama.cpp variant for
/// all tokens (its two variants agree on 6); at each divergence
/// llama.cpp's token is at most 0.047 below ours in our log-probabilities.
/// Perplexity 25.95 vs llama.cpp's 25.91 and 25.91 (per token 0.040 apart;
/// its paths 0.042).
const QWEN2: Family = Family {
    name: "qwen2",
    prefix: "qwen2",
    env: "TANDEM_TEST_QWEN2_GGUF",
    gguf: "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    near_tie: 0.35,
    min_full_matches: 4,
    top20_bound: 0.6,
    float_margin: FloatMargin::Mean(FLOAT_MARGIN),
    argmax_gap: Some(0.35),
    max_logit_diff: None,
    perplexity: &["qwen2-perplexity_refs.json"],
};

/// Gemma 3 270M base Q4_K_M (gemma3: sliding-window attention on 5 of 6
/// layers, QK-norm, GELU; 8 plain prompts with BOS, no chat template).
/// Perplexity at n_ctx 512 never reaches the 512-token window; at n_ctx
/// 1024 every scored position is past it.
///
/// Measured at the last prompt position: llama.cpp's two attention paths
/// differ by 0.20-0.88 in top-20 log-probability (0.88 on a prompt whose
/// top token has probability 0.999: the tail at -8..-14 shifts together;
/// 0.46 at most in the gap between the top token and any other above -4),
/// and lie 0.19-0.78 from the float reference; ours lie 0.16-0.88 from
/// llama.cpp's and on average 0.34 from the float reference (llama.cpp
/// 0.37). Greedy: 2 of 8 prompts match a llama.cpp variant for all tokens
/// (its two variants agree on 4): this small base model's continuations
/// are flat; at each divergence llama.cpp's token is at most 0.10 below
/// ours in our log-probabilities. Perplexity 16.91 vs 16.94 and 16.92 at n_ctx 512,
/// 16.99 vs 16.96 and 16.98 at 1024 (per token 0.078-0.082 apart; its
/// paths 0.079, 0.082).
const GEMMA3: Family = Family {
    name: "gemma3",
    prefix: "gemma3",
    env: "TANDEM_TEST_GEMMA3_GGUF",
    gguf: "gemma-3-270m-q4_k_m.gguf",
    near_tie: 0.35,
    min_full_matches: 1,
    top20_bound: 1.2,
    float_margin: FloatMargin::Mean(FLOAT_MARGIN),
    argmax_gap: Some(0.35),
    max_logit_diff: None,
    perplexity: &[
        "gemma3-perplexity_refs.json",
        "gemma3-perplexity_ctx1024_refs.json",
    ],
};

macro_rules! family_tests {
    ($name:ident, $family:expr) => {
        mod $name {
            use super::*;

            fn model() -> &'static Arc<LoadedModel> {
                static M: std::sync::OnceLock<Arc<LoadedModel>> = std::sync::OnceLock::new();
                M.get_or_init(|| Arc::new(load_model(&$family)))
            }

            #[test]
            fn prompt_tokens_match_llama_cpp() {
                check_tokens(&$family);
            }

            #[test]
            fn chat_prompts_render_like_the_references() {
                check_chat_rendering(&$family);
            }

            #[test]
            fn greedy_decoding_matches_llama_cpp() {
                check_greedy(&$family, model());
            }

            #[test]
            fn perplexity_matches_llama_cpp() {
                check_perplexity(&$family, model());
            }

            #[test]
            fn last_position_logits_match_references() {
                check_last_logits(&$family, model());
            }
        }
    };
}

family_tests!(smollm2, SMOLLM2);
family_tests!(qwen2, QWEN2);
family_tests!(gemma3, GEMMA3);

fn gguf_path(f: &Family) -> PathBuf {
    let path = std::env::var_os(f.env).unwrap_or_else(|| {
        panic!(
            "set {} to {} ({} family tests; scripts/test.sh does this)",
            f.env, f.gguf, f.name
        )
    });
    PathBuf::from(path)
}

fn load_model(f: &Family) -> LoadedModel {
    let path = gguf_path(f);
    load(&path).unwrap_or_else(|e| panic!("{} ({}) loads: {e}", path.display(), f.name))
}

fn open_gguf(f: &Family) -> GgufFile {
    let path = gguf_path(f);
    GgufFile::open(&path).unwrap_or_else(|e| panic!("cannot open {}: {e}", path.display()))
}

fn tokenizer(g: &GgufFile) -> Tokenizer {
    Tokenizer::from_spec(spec_from_gguf(g).expect("tokenizer metadata")).expect("tokenizer")
}

fn data(name: &str) -> Value {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name);
    let s = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&s).expect("valid JSON")
}

fn refs(f: &Family, kind: &str) -> Value {
    if f.prefix.is_empty() {
        data(&format!("{kind}_refs.json"))
    } else {
        data(&format!("{}-{kind}_refs.json", f.prefix))
    }
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn perplexity_text() -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/perplexity_text.txt");
    let text = std::fs::read_to_string(&p).expect("text");
    // llama-perplexity's -f drops one trailing newline.
    text.strip_suffix('\n').unwrap_or(&text).to_string()
}

/// Our tokenizer gives llama.cpp's ids: every greedy prompt (as
/// llama-server's /tokenize gave them, BOS first where the vocab adds it),
/// and the perplexity text (as llama-tokenize gave it). Needs only the
/// GGUF's metadata, not the model. A greedy prompt without `add_special`
/// (the scripts' first format) was tokenized without it.
fn check_tokens(f: &Family) {
    let g = open_gguf(f);
    let tok = tokenizer(&g);
    let greedy = refs(f, "greedy");
    assert_eq!(
        sha256_hex(g.backing()),
        greedy["model_sha256"].as_str().expect("sha256"),
        "{} is not the GGUF the references were made with",
        gguf_path(f).display()
    );
    if let Some(add_bos) = greedy["made_with"]["gguf"]["add_bos"].as_bool() {
        assert_eq!(tok.add_bos(), add_bos, "add_bos");
    }
    let mut failures = Vec::new();
    for p in greedy["prompts"].as_array().expect("prompts") {
        let text = p["text"].as_str().expect("text");
        let add_special = p
            .get("add_special")
            .is_some_and(|a| a.as_bool().expect("add_special"));
        let ours = tok.encode(text, add_special).expect("tokenizes");
        let theirs = ids(&p["prompt_ids"]);
        if ours != theirs {
            failures.push(format!(
                "{text:?} (add_special {add_special}): ours {ours:?}\n  llama.cpp {theirs:?}"
            ));
        }
    }
    let text = perplexity_text();
    for name in f.perplexity {
        let want = ids(&data(name)["tokens"]);
        let ours = tok.encode(&text, true).expect("tokenizes");
        if ours != want {
            let at = ours.iter().zip(&want).take_while(|(a, b)| a == b).count();
            failures.push(format!(
                "perplexity text ({name}): {} tokens vs llama-tokenize's {}, first difference at {at}: \
                 ours {:?}, theirs {:?}",
                ours.len(),
                want.len(),
                &ours[at..(at + 8).min(ours.len())],
                &want[at..(at + 8).min(want.len())]
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Chat prompts were rendered by Python's jinja2 from the GGUF's template,
/// as transformers' apply_chat_template does (trim_blocks, lstrip_blocks,
/// `tojson` = json.dumps without HTML escaping); ours must give the same
/// text, tool definitions, tool calls and tool results included.
fn check_chat_rendering(f: &Family) {
    let g = open_gguf(f);
    let greedy = refs(f, "greedy");
    let chats: Vec<&Value> = greedy["prompts"]
        .as_array()
        .expect("prompts")
        .iter()
        .filter(|p| p["kind"] == "chat")
        .collect();
    let Ok(source) = g.get_str("tokenizer.chat_template") else {
        assert!(chats.is_empty(), "chat prompts but no chat template");
        return;
    };
    let tok = tokenizer(&g);
    let name = |id: Option<u32>| {
        id.and_then(|i| tok.token_str(i))
            .unwrap_or_default()
            .to_string()
    };
    let template =
        ChatTemplate::new(source, &name(tok.bos_id()), &name(tok.eos_id())).expect("template");
    let mut failures = Vec::new();
    for p in chats {
        let tools = p.get("tools");
        let ours = template
            .render_json(&p["messages"], tools, true)
            .expect("renders");
        let theirs = p["text"].as_str().expect("text");
        if ours != theirs {
            failures.push(format!("ours:\n{ours}\n---- jinja2:\n{theirs}\n----"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Greedy continuations against llama.cpp's. Two implementations with the
/// same weights agree on a greedy token only when the top two logits are
/// further apart than their numeric noise. Both engines quantize
/// activations to 8 bits, and a single low-bit difference upstream of a
/// quantization point flips roundings that grow through the layers:
/// llama.cpp's own two attention paths (flash attention on and off)
/// disagree within 64 tokens on most prompts. So the rule is:
/// - tokens match exactly up to the first divergence from a llama.cpp
///   variant (llama-server's trailing stop token dropped, ours cut before
///   a stop token);
/// - a divergence is only allowed where llama.cpp itself is split (its
///   other variant made our choice at that step) or at a near-tie:
///   llama.cpp's token is among our top 5, at most `near_tie` below ours in
///   log-probability (about the distance between llama.cpp's
///   log-probabilities and ours at the last prompt position, measured in
///   `check_last_logits`);
/// - at least `min_full_matches` prompts match a llama.cpp variant for all
///   tokens, a tripwire for systematic drift.
///
/// Ours are generated for all prompts together (`generate_together`).
/// `check_perplexity` compares with llama.cpp without ties.
fn check_greedy(f: &Family, m: &Arc<LoadedModel>) {
    let refs = refs(f, "greedy");
    let prompts = refs["prompts"].as_array().expect("prompts");
    let n_predict = refs["n_predict"].as_u64().expect("n") as usize;
    let stops = m.text.tokenizer.stop_ids();
    let mut full_matches = 0;
    let mut llama_self_matches = 0;
    let mut failures = Vec::new();
    let sampling = SamplingParams {
        logprobs: true,
        top_logprobs: 5,
        ..SamplingParams::greedy()
    };
    let prompt_ids: Vec<Vec<u32>> = prompts.iter().map(|p| ids(&p["prompt_ids"])).collect();
    let outs = generate_together(m, &prompt_ids, &sampling, n_predict);
    for (p, sampled) in prompts.iter().zip(&outs) {
        let text = p["text"].as_str().expect("text");
        let tokens: Vec<u32> = sampled.iter().map(|s| s.token).collect();
        // Ours up to (not including) a stop token; generated without stop
        // ids so the step where llama.cpp stopped still has our logprobs.
        let ours_end = tokens
            .iter()
            .position(|t| stops.contains(t))
            .unwrap_or(tokens.len());
        let variants = ["flash_attn_off", "flash_attn_on"];
        // llama-server lists the stop token it ended on (stop_type "eos");
        // ours are cut before it.
        let theirs_of = |variant: &str| {
            let mut t = ids(&p[variant]["tokens"]);
            if p[variant]["stop_type"] == "eos" && t.last().is_some_and(|l| stops.contains(l)) {
                t.pop();
            }
            t
        };
        let agreement = |want: &[u32]| {
            tokens[..ours_end]
                .iter()
                .zip(want)
                .take_while(|(a, b)| a == b)
                .count()
        };
        let agrees: Vec<usize> = variants.iter().map(|v| agreement(&theirs_of(v))).collect();
        llama_self_matches += usize::from(theirs_of(variants[0]) == theirs_of(variants[1]));
        let mut matched_fully = false;
        let mut summary = Vec::new();
        for (vi, variant) in variants.iter().enumerate() {
            let want = theirs_of(variant);
            let agree = agrees[vi];
            if tokens[..ours_end] == want[..] {
                matched_fully = true;
                summary.push(format!("{variant}: all {agree}"));
                continue;
            }
            summary.push(format!("{variant}: {agree}/{}", want.len()));
            // llama.cpp stopped at `agree` when it produced fewer tokens than
            // asked: its choice there was a stop token.
            let theirs: Vec<u32> = match want.get(agree) {
                Some(&t) => vec![t],
                None if want.len() < n_predict => stops.clone(),
                None => Vec::new(),
            };
            let Some(step) = sampled.get(agree) else {
                failures.push(format!(
                    "{text:?} vs {variant}: lengths differ after {agree} equal tokens"
                ));
                continue;
            };
            if agrees[1 - vi] > agree {
                // llama.cpp's other variant made our choice here.
                summary.push("(llama.cpp split)".to_string());
                continue;
            }
            let ours = step.logprob.expect("logprobs requested");
            let gap = step
                .top
                .iter()
                .filter(|(id, _)| theirs.contains(id))
                .map(|&(_, lp)| ours - lp)
                .reduce(f32::min);
            if let Some(gap) = gap {
                summary.push(format!(
                    "(near-tie gap {gap:.4}: ours {}, theirs {theirs:?})",
                    step.token
                ));
            }
            if !gap.is_some_and(|g| g <= f.near_tie) {
                failures.push(format!(
                    "{text:?} vs {variant}: diverges at token {agree} where llama.cpp chose {theirs:?}, \
                     not a near-tie (ours {} lp {ours:.3}, top {:?}); ours so far {:?}",
                    step.token,
                    step.top,
                    m.text
                        .tokenizer
                        .decode(&tokens[..(agree + 1).min(tokens.len())], false)
                        .unwrap_or_default()
                ));
            }
        }
        full_matches += usize::from(matched_fully);
        eprintln!(
            "{} {:5} {}",
            f.name,
            p["kind"].as_str().unwrap_or("?"),
            summary.join(", ")
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    eprintln!(
        "{}: {full_matches}/{} prompts match a llama.cpp variant for all tokens; \
         llama.cpp's two variants match each other on {llama_self_matches}",
        f.name,
        prompts.len()
    );
    assert!(
        full_matches >= f.min_full_matches,
        "only {full_matches} prompts match llama.cpp fully \
         (its own variants agree on {llama_self_matches})"
    );
}

/// What `generate` gives for each of `prompts` alone with `sampling` and
/// no stop tokens (every token it samples, with its log-probabilities),
/// generated together: the scheduler runs them in one batch, so each
/// decode step reads the weights once for all of them instead of once per
/// prompt. The outputs are the same: a sequence's logits are bitwise
/// identical alone or in any batch (ARCHITECTURE.md, "Batch invariance";
/// `tests/scheduler.rs` checks the scheduler's tokens against
/// `generate`'s), and the scheduler samples each row with the `Sampler`
/// that `generate` uses.
fn generate_together(
    m: &Arc<LoadedModel>,
    prompts: &[Vec<u32>],
    sampling: &SamplingParams,
    max_tokens: usize,
) -> Vec<Vec<Sampled>> {
    let block_size = 16;
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0) + max_tokens;
    let config = SchedulerConfig {
        max_batch_size: prompts.len(),
        // Every prompt in the first step.
        max_batch_input_tokens: prompts
            .iter()
            .map(Vec::len)
            .sum::<usize>()
            .max(prompts.len()),
        max_length: longest,
        block_size,
        num_blocks: prompts
            .iter()
            .map(|p| (p.len() + max_tokens).div_ceil(block_size))
            .sum(),
        prefix_caching: false,
        tp: 1,
        moe_combine: Combine::AllReduce,
        kv_tiers: None,
    };
    let sched = Scheduler::spawn(Arc::clone(m) as _, config).expect("scheduler starts");
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| {
            sched
                .handle()
                .generate(GenerationRequest {
                    prompt: p.clone(),
                    sampling: sampling.clone(),
                    max_tokens,
                    stop_token_ids: Vec::new(),
                    constraint: None,
                })
                .expect("request accepted")
        })
        .collect();
    let outs = streams
        .into_iter()
        .map(|mut stream| {
            let mut sampled = Vec::new();
            loop {
                match stream.blocking_next() {
                    Some(GenEvent::Token(s)) => sampled.push(s),
                    Some(GenEvent::Finished(u)) => {
                        assert_eq!(u.completion_tokens, max_tokens, "no stop tokens");
                        return sampled;
                    }
                    other => panic!("generation did not finish: {other:?}"),
                }
            }
        })
        .collect();
    sched.shutdown();
    outs
}

/// Perplexity of the model on a fixed English text
/// (tests/data/perplexity_text.txt) against llama.cpp's `llama-perplexity`
/// on the same GGUF, for each of the family's perplexity files. Unlike
/// greedy tokens, these means over some 1500 scored tokens do not hinge on
/// near-ties.
///
/// Same tokens, same scheme as llama-perplexity's default: the text less
/// one trailing newline, tokenized as llama-tokenize does, cut into whole
/// chunks of `n_ctx` tokens; where the vocab adds BOS ("bos_per_chunk",
/// false where the file does not say), each chunk's first token is
/// replaced by BOS; each chunk runs from an empty cache at positions
/// 0..n_ctx, and the logits at positions n_ctx/2 ..= n_ctx-2 score the next
/// token. Here the first half of every chunk is prefilled, then the chunks
/// advance together one token per step (the split does not change the
/// logits: see `tests/model.rs`,
/// `long_prompt_logits_do_not_depend_on_how_it_is_split`).
///
/// Against each of llama.cpp's two attention paths (flash attention off,
/// on): perplexity within `PPL_BOUND`, and the mean per-token |NLL
/// difference| at most `PER_TOKEN_FACTOR` times the one between llama.cpp's
/// two paths. Quantization noise sets this floor; a model error adds to it
/// even where it leaves perplexity unchanged.
fn check_perplexity(f: &Family, m: &LoadedModel) {
    let gguf = gguf_path(f);
    let sha = sha256_hex(&std::fs::read(&gguf).expect("reads the GGUF"));
    let text = perplexity_text();
    let mut failures = Vec::new();
    for name in f.perplexity {
        let refs = data(name);
        assert_eq!(
            sha,
            refs["gguf"]["sha256"].as_str().expect("sha256"),
            "{} is not the GGUF {name} was made with",
            gguf.display()
        );
        let tokens = ids(&refs["tokens"]);
        let bos_per_chunk = refs
            .get("bos_per_chunk")
            .is_some_and(|b| b.as_bool().expect("bos_per_chunk"));
        assert_eq!(
            m.text.tokenizer.add_bos(),
            bos_per_chunk,
            "llama-perplexity puts BOS first in each chunk iff the vocab adds BOS"
        );
        assert_eq!(
            m.text.tokenizer.encode(&text, true).expect("tokenizes"),
            tokens,
            "our tokens differ from llama-tokenize's"
        );
        let n_ctx = refs["n_ctx"].as_u64().expect("n_ctx") as usize;
        let first = n_ctx / 2;
        let scored = n_ctx - first - 1;
        let chunks: Vec<Vec<u32>> = tokens
            .chunks_exact(n_ctx)
            .map(|c| {
                let mut c = c.to_vec();
                if bos_per_chunk {
                    c[0] = m.text.tokenizer.bos_id().expect("BOS id");
                }
                c
            })
            .collect();
        let mm = &m.model;
        let vocab = mm.config().vocab_size;
        let bs = 16;
        let mut cache =
            KvCache::new(mm.kv_cache_config(bs, chunks.len() * n_ctx.div_ceil(bs))).expect("cache");
        let tables: Vec<Vec<u32>> = chunks
            .iter()
            .map(|_| {
                let mut t = Vec::new();
                cache.reserve(&mut t, n_ctx).expect("space");
                t
            })
            .collect();
        let step = |range: std::ops::Range<usize>, want_logits: bool| -> Vec<SeqChunk> {
            chunks
                .iter()
                .zip(&tables)
                .map(|(c, t)| SeqChunk {
                    tokens: &c[range.clone()],
                    start_pos: range.start,
                    block_table: t,
                    want_logits,
                })
                .collect()
        };
        mm.forward(&step(0..first, false), &mut cache)
            .expect("prefill");
        let mut nll = vec![0.0f64; chunks.len() * scored];
        let mut logits = Vec::new();
        for pos in first..n_ctx - 1 {
            mm.forward_into(
                &step(pos..pos + 1, true),
                &mut cache,
                &mut |_| {},
                &mut logits,
            )
            .expect("decode step");
            for (ci, c) in chunks.iter().enumerate() {
                let l = &logits[ci * vocab..(ci + 1) * vocab];
                let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let sum: f64 = l.iter().map(|&v| f64::from(v - max).exp()).sum();
                nll[ci * scored + pos - first] = sum.ln() - f64::from(l[c[pos + 1] as usize] - max);
            }
        }
        let running: Vec<f64> = (1..=chunks.len())
            .map(|k| (nll[..k * scored].iter().sum::<f64>() / (k * scored) as f64).exp())
            .collect();
        let ours = running[running.len() - 1];
        let ours_nll: Vec<Option<f64>> = nll.iter().copied().map(Some).collect();
        let their_nll = |run: &Value| -> Vec<Option<f64>> {
            run["next_token_logprobs"]
                .as_array()
                .expect("logprobs")
                .iter()
                .map(|x| x.as_f64().map(|lp| -lp))
                .collect()
        };
        let mean_abs_diff = |a: &[Option<f64>], b: &[Option<f64>]| {
            assert_eq!(a.len(), b.len(), "scored tokens");
            let d: Vec<f64> = a
                .iter()
                .zip(b)
                .filter_map(|(x, y)| Some((x.as_ref()? - y.as_ref()?).abs()))
                .collect();
            assert!(d.len() * 10 >= a.len() * 9, "too many clipped values");
            d.iter().sum::<f64>() / d.len() as f64
        };
        let runs = refs["runs"].as_array().expect("runs");
        assert_eq!(runs.len(), 2, "llama.cpp with flash attention off and on");
        let llama_spread = mean_abs_diff(&their_nll(&runs[0]), &their_nll(&runs[1]));
        let per_token_bound = PER_TOKEN_FACTOR * llama_spread;
        eprintln!(
            "{name}: {} chunks of {n_ctx}, {} scored tokens; llama.cpp's two attention paths \
             {llama_spread:.4} apart per token (bound {per_token_bound:.4})",
            chunks.len(),
            nll.len()
        );
        for run in runs {
            let path = format!(
                "llama.cpp (flash attention {})",
                run["flash_attn"].as_str().expect("name")
            );
            let theirs = run["ppl"].as_f64().expect("ppl");
            let their_running: Vec<f64> = run["running_ppl"]
                .as_array()
                .expect("running")
                .iter()
                .map(|x| x.as_f64().expect("ppl"))
                .collect();
            assert_eq!(their_running.len(), chunks.len(), "chunk count");
            let per_token = mean_abs_diff(&ours_nll, &their_nll(run));
            let ratios: Vec<String> = running
                .iter()
                .zip(&their_running)
                .map(|(a, b)| format!("{:.4}", a / b))
                .collect();
            eprintln!(
                "{name}: perplexity ours {ours:.4}, {path} {theirs:.4}: ratio {:.5} (after each \
                 chunk {}); mean per-token |NLL difference| {per_token:.4}",
                ours / theirs,
                ratios.join(" ")
            );
            if (ours / theirs - 1.0).abs() > PPL_BOUND {
                failures.push(format!(
                    "{name}: perplexity {ours:.4} vs {path} {theirs:.4}: more than {}% apart",
                    PPL_BOUND * 100.0
                ));
            }
            if per_token > per_token_bound {
                failures.push(format!(
                    "{name}: mean per-token |NLL difference| vs {path} {per_token:.4} > \
                     {per_token_bound:.4} ({PER_TOKEN_FACTOR} x llama.cpp's own {llama_spread:.4})"
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Our last-position logits against two independent references: a numpy
/// float32 forward pass, and llama.cpp's top-20 log-probabilities.
///
/// Like llama.cpp we quantize activations to 8 bits before each integer dot
/// product and keep K/V in f16, so neither engine equals the float
/// reference, and the two engines' rounding noise is independent (our
/// matmuls sum blocks in another order than ggml's: see
/// `tandem_kernels::PackedMatrix` and `model::RowParallel`). The yardstick
/// is llama.cpp's own distance from the float reference. Checked for every
/// prompt, on llama.cpp's top-20 tokens (each attention path the file
/// holds): our log-probabilities within `top20_bound` of llama.cpp's; no
/// more than `float_margin` further from the float reference than
/// llama.cpp's (on each prompt or on average over them); our argmax the
/// float reference's (where its top two are more than `argmax_gap` apart);
/// and, where the file holds the whole vocabulary's float logits, the max
/// |logit difference| within `max_logit_diff`.
fn check_last_logits(f: &Family, m: &LoadedModel) {
    let refs = refs(f, "logits");
    let prompts = refs["prompts"].as_array().expect("prompts");
    let mut failures = Vec::new();
    let mut from_float_sums = (0.0f32, 0.0f32);
    for p in prompts {
        let text = p["text"].as_str().expect("text");
        let prompt = ids(&p["prompt_ids"]);
        let got = common::last_logits(&m.model, &prompt);
        assert_eq!(got.len(), m.model.config().vocab_size);
        let lp = log_softmax(&got);
        let float = FloatRef::new(p, got.len());
        let top = |key: &str| -> Option<Vec<(usize, f32)>> {
            let pairs = p.get(key)?.as_array().expect("top logprobs");
            Some(
                pairs
                    .iter()
                    .map(|pair| {
                        (
                            pair[0].as_u64().expect("id") as usize,
                            pair[1].as_f64().expect("lp") as f32,
                        )
                    })
                    .collect(),
            )
        };
        // llama.cpp's top 20 with flash attention off, and on where the
        // file holds it.
        let paths: Vec<(&str, Vec<(usize, f32)>)> = [
            ("fa off", "llama_cpp_top_logprobs"),
            ("fa on", "llama_cpp_top_logprobs_fa_on"),
        ]
        .into_iter()
        .filter_map(|(name, key)| Some((name, top(key)?)))
        .collect();
        assert!(
            paths.first().is_some_and(|(n, _)| *n == "fa off"),
            "no llama_cpp_top_logprobs"
        );
        let vs_llama: Vec<f32> = paths
            .iter()
            .map(|(_, want)| {
                want.iter()
                    .map(|&(id, theirs)| (lp[id] - theirs).abs())
                    .fold(0.0f32, f32::max)
            })
            .collect();
        // Distance from the float reference: llama.cpp's (the worse of its
        // paths, each on its own top 20) is the yardstick for ours (on every
        // path's top 20).
        let from_float = |want: &[(usize, f32)], ours: bool| {
            want.iter()
                .map(|&(id, theirs)| (if ours { lp[id] } else { theirs } - float.lp(id)).abs())
                .fold(0.0f32, f32::max)
        };
        let ours_vs_float = paths
            .iter()
            .map(|(_, w)| from_float(w, true))
            .fold(0.0f32, f32::max);
        let llama_vs_float = paths
            .iter()
            .map(|(_, w)| from_float(w, false))
            .fold(0.0f32, f32::max);
        let ours_argmax = argmax(&got);
        // The token where ours is furthest from the float reference, with
        // each log-probability there: for a failure's diagnosis.
        let worst = paths
            .iter()
            .flat_map(|(_, w)| w.iter().map(|&(id, _)| id))
            .max_by(|&a, &b| {
                (lp[a] - float.lp(a))
                    .abs()
                    .total_cmp(&(lp[b] - float.lp(b)).abs())
            })
            .expect("top 20");
        let at_worst: Vec<String> = paths
            .iter()
            .map(|(_, want)| {
                want.iter()
                    .find(|&&(id, _)| id == worst)
                    .map_or("-".to_string(), |&(_, v)| format!("{v:.3}"))
            })
            .collect();
        let vs_llama_text: Vec<String> = paths
            .iter()
            .zip(&vs_llama)
            .map(|((name, _), d)| format!("{d:.4} ({name})"))
            .collect();
        let full_vocab_diff = float.max_logit_diff(&got);
        eprintln!(
            "{} {:3} prompt tokens: top-20 logprobs vs llama.cpp {}; vs float ours \
             {ours_vs_float:.4}, llama.cpp {llama_vs_float:.4} (worst token {worst}: ours {:.3}, \
             llama.cpp {}, float {:.3}); argmax ours {ours_argmax}, float {} (gap {:.3}){}",
            f.name,
            prompt.len(),
            vs_llama_text.join(" "),
            lp[worst],
            at_worst.join(" / "),
            float.lp(worst),
            float.argmax,
            float.top2_gap,
            full_vocab_diff.map_or(String::new(), |d| format!(
                "; max |logit diff| vs float {d:.4}"
            ))
        );
        let vs_llama_max = vs_llama.iter().copied().fold(0.0f32, f32::max);
        if vs_llama_max > f.top20_bound {
            failures.push(format!(
                "{text:?}: top-20 logprobs {} from llama.cpp's, bound {}",
                vs_llama_text.join(", "),
                f.top20_bound
            ));
        }
        from_float_sums.0 += ours_vs_float;
        from_float_sums.1 += llama_vs_float;
        if let FloatMargin::PerPrompt(margin) = f.float_margin
            && ours_vs_float > llama_vs_float + margin
        {
            failures.push(format!(
                "{text:?}: top-20 logprobs {ours_vs_float:.4} from the float reference, \
                 llama.cpp's {llama_vs_float:.4} (margin {margin})"
            ));
        }
        if f.argmax_gap.is_none_or(|g| float.top2_gap > g) && ours_argmax != float.argmax {
            failures.push(format!(
                "{text:?}: argmax {ours_argmax}, the float reference's {} (its top two {:.3} \
                 apart)",
                float.argmax, float.top2_gap
            ));
        }
        if let Some(bound) = f.max_logit_diff {
            let d = full_vocab_diff.expect("max_logit_diff needs every float logit");
            if d > bound {
                failures.push(format!(
                    "{text:?}: max |logit diff| vs the float reference {d:.4} > {bound}"
                ));
            }
        }
    }
    let n = prompts.len() as f32;
    let (ours_mean, llama_mean) = (from_float_sums.0 / n, from_float_sums.1 / n);
    eprintln!(
        "{}: mean over prompts of the top-20 distance from the float reference: ours \
         {ours_mean:.4}, llama.cpp {llama_mean:.4}",
        f.name
    );
    if let FloatMargin::Mean(margin) = f.float_margin
        && ours_mean > llama_mean + margin
    {
        failures.push(format!(
            "top-20 logprobs {ours_mean:.4} from the float reference on average over the \
             prompts, llama.cpp's {llama_mean:.4} (margin {margin})"
        ));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// One prompt's numpy float32 reference at the last position: either every
/// logit (the scripts' first format), or its log-sum-exp, argmax, top-two
/// gap and logits at its top 64 and llama.cpp's top-20 tokens.
struct FloatRef {
    /// Log-probability by token id (every token, or the stored ones).
    lp: HashMap<usize, f32>,
    /// Every logit, where the file holds them.
    logits: Option<Vec<f32>>,
    argmax: u32,
    top2_gap: f32,
}

impl FloatRef {
    fn new(p: &Value, vocab: usize) -> FloatRef {
        let stored = p["numpy_f32_logits"].as_array().expect("float logits");
        if stored.first().is_some_and(Value::is_number) {
            let logits: Vec<f32> = stored
                .iter()
                .map(|x| x.as_f64().expect("logit") as f32)
                .collect();
            assert_eq!(logits.len(), vocab, "float logits");
            let mut sorted = logits.clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            FloatRef {
                lp: log_softmax(&logits).into_iter().enumerate().collect(),
                argmax: argmax(&logits),
                top2_gap: sorted[0] - sorted[1],
                logits: Some(logits),
            }
        } else {
            let lse = p["numpy_f32_logsumexp"].as_f64().expect("lse");
            FloatRef {
                lp: stored
                    .iter()
                    .map(|pair| {
                        (
                            pair[0].as_u64().expect("id") as usize,
                            (pair[1].as_f64().expect("logit") - lse) as f32,
                        )
                    })
                    .collect(),
                logits: None,
                argmax: p["numpy_f32_argmax"].as_u64().expect("argmax") as u32,
                top2_gap: p["numpy_f32_top2_gap"].as_f64().expect("gap") as f32,
            }
        }
    }

    /// Log-probability of `id`, stored for llama.cpp's top 20.
    fn lp(&self, id: usize) -> f32 {
        *self
            .lp
            .get(&id)
            .expect("float logit stored for llama.cpp's top 20")
    }

    /// Max |logit difference| over the whole vocabulary, where the file
    /// holds every logit.
    fn max_logit_diff(&self, got: &[f32]) -> Option<f32> {
        let want = self.logits.as_ref()?;
        Some(
            got.iter()
                .zip(want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max),
        )
    }
}
