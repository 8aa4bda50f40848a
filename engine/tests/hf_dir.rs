#![allow(clippy::unwrap_used)]
//! The HF-style model directory loader (`safetensors_loader`) on a directory
//! converted from the SmolLM2 GGUF by an independent Python script
//! (`scripts/reference/gguf_to_hf.py`: weights dequantized by the `gguf`
//! package to F32 with the q/k rope permutation undone, split over two
//! safetensors files; tokenizer.json built with the `tokenizers` package).
//! Checks tokenizer and chat template equivalence with the GGUF, last-position
//! logits against the numpy float32 reference, greedy text against the GGUF
//! model, and clean errors for broken directories.
//!
//! Needs `TANDEM_TEST_GGUF` (SmolLM2-135M-Instruct.Q4_1.gguf) and
//! `TANDEM_TEST_HF_DIR` (made by `scripts/make-hf-fixture.sh DIR`);
//! `scripts/test.sh` sets both.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use safetensors::Dtype;
use safetensors::tensor::TensorView;
use serde_json::{Value, json};
use tandem_engine::generate::{GenerateOutput, GenerateRequest, generate};
use tandem_engine::kv_cache::KvCache;
use tandem_engine::model::SeqChunk;
use tandem_engine::sampler::SamplingParams;
use tandem_engine::{LoadedModel, ModelError, load};
use tandem_modelfile::chat::ChatMessage;

fn env_path(var: &str, what: &str) -> PathBuf {
    match std::env::var_os(var) {
        Some(p) => PathBuf::from(p),
        None => panic!(
            "{var} is not set: point it at {what}. scripts/test.sh sets it; by hand:\n  \
             export TANDEM_TEST_GGUF=~/.cache/tandem/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf\n  \
             scripts/make-hf-fixture.sh /tmp/tandem-hf-smollm2   # needs TANDEM_TEST_GGUF\n  \
             export TANDEM_TEST_HF_DIR=/tmp/tandem-hf-smollm2"
        ),
    }
}

fn hf() -> &'static LoadedModel {
    static M: OnceLock<LoadedModel> = OnceLock::new();
    M.get_or_init(|| {
        let dir = env_path(
            "TANDEM_TEST_HF_DIR",
            "the HF directory made by scripts/make-hf-fixture.sh",
        );
        assert!(
            dir.is_dir(),
            "TANDEM_TEST_HF_DIR={} is not a directory",
            dir.display()
        );
        load(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
    })
}

fn gguf() -> &'static LoadedModel {
    static M: OnceLock<LoadedModel> = OnceLock::new();
    M.get_or_init(|| {
        let path = env_path("TANDEM_TEST_GGUF", "SmolLM2-135M-Instruct.Q4_1.gguf");
        load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    })
}

#[test]
fn config_matches_the_gguf() {
    let (h, g) = (hf().model.config(), gguf().model.config());
    assert_eq!(h.n_layers, 30);
    assert_eq!(
        (h.n_layers, h.d_model, h.n_heads, h.n_kv_heads, h.head_dim),
        (g.n_layers, g.d_model, g.n_heads, g.n_kv_heads, g.head_dim)
    );
    assert_eq!((h.ffn_dim, h.vocab_size), (g.ffn_dim, g.vocab_size));
    assert_eq!((h.rope_theta, h.rope_dims), (g.rope_theta, g.rope_dims));
    assert_eq!((h.rms_eps, h.context_length), (g.rms_eps, g.context_length));
    assert_ne!(
        h.rope_style, g.rope_style,
        "HF is NeoX-style, GGUF interleaved"
    );
    // Tied embeddings, and the fixture really is F32 (the tolerances below assume it).
    assert!(hf().model.output_is_tied());
    assert_eq!(hf().model.embedding_type(), tandem_kernels::GgmlType::F32);
}

const TEXTS: &[&str] = &[
    "",
    "Hello world",
    "The capital of France is",
    "  leading spaces, trailing spaces   ",
    "line one\nline two\n\n\ttabbed\r\nwindows",
    "1234567890 3.14159 -42 1e-5 0x1F 2024-06-01",
    "List of prime numbers: 2, 3, 5, 7,",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "fn main() { let v: Vec<u32> = (0..10).map(|x| x * x).collect(); println!(\"{v:?}\"); }",
    "Émile naïve café — “quotes” ‘single’ … ñ ß ø",
    "emoji: 😀👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️",
    "中文测试：你好，世界！日本語のテキスト、한국어 텍스트",
    "Привет, мир! Ελληνικά. مرحبا بالعالم. שלום",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>tandem<file_sep>src/main.rs<|endoftext|>",
    "not special: <|im_sta <im_start> |im_end| <|unknown|>",
    "URL https://example.com/path?q=1&r=two#frag and email a.b@c.de",
    "MiXeD CaSe WORDS and snake_case and camelCase and kebab-case",
    "$$\\int_0^1 x^2\\,dx = \\frac{1}{3}$$ and <b>html</b> &amp; {\"json\": [1, 2]}",
];

#[test]
fn tokenizer_matches_the_gguf() {
    let (h, g) = (&hf().text.tokenizer, &gguf().text.tokenizer);
    assert_eq!(h.vocab_size(), g.vocab_size());
    assert_eq!((h.bos_id(), h.eos_id()), (g.bos_id(), g.eos_id()));
    assert_eq!(h.add_bos(), g.add_bos());
    assert_eq!(h.stop_ids(), g.stop_ids());
    let mut failures = Vec::new();
    for &t in TEXTS {
        let a = h.encode(t, false).unwrap();
        let b = g.encode(t, false).unwrap();
        if a != b {
            failures.push(format!("{t:?}\n  hf   {a:?}\n  gguf {b:?}"));
            continue;
        }
        let (da, db) = (h.decode(&a, false).unwrap(), g.decode(&b, false).unwrap());
        if da != db || da != t {
            failures.push(format!("{t:?} decodes to hf {da:?}, gguf {db:?}"));
        }
        // With add_special both follow their add_bos (false for SmolLM2).
        assert_eq!(h.encode(t, true).unwrap(), g.encode(t, true).unwrap());
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // The special tokens really are single tokens.
    assert_eq!(
        h.encode("<|im_start|>user\nhi<|im_end|>", false).unwrap()[0],
        1
    );
}

#[test]
fn chat_template_matches_the_gguf() {
    let h = hf()
        .text
        .chat_template
        .as_ref()
        .expect("HF dir has a chat template");
    let g = gguf()
        .text
        .chat_template
        .as_ref()
        .expect("GGUF has a chat template");
    let conversations = [
        vec![ChatMessage::new("user", "hi")],
        vec![
            ChatMessage::new("system", "You are a concise assistant."),
            ChatMessage::new("user", "Describe how a bicycle works."),
        ],
        vec![
            ChatMessage::new("user", "What is 12 times 13?"),
            ChatMessage::new("assistant", "12 times 13 is 156."),
            ChatMessage::new("user", "Now explain how, in détail 😀."),
        ],
    ];
    for conv in &conversations {
        for add_generation_prompt in [true, false] {
            let a = h.render(conv, add_generation_prompt).unwrap();
            let b = g.render(conv, add_generation_prompt).unwrap();
            assert_eq!(a, b, "{conv:?}");
            assert!(a.contains("<|im_start|>user\n"), "{a:?}");
        }
    }
}

fn last_logits(m: &LoadedModel, prompt: &[u32]) -> Vec<f32> {
    let model = &m.model;
    let mut cache = KvCache::new(model.kv_cache_config(16, prompt.len().div_ceil(16))).unwrap();
    let mut table = Vec::new();
    cache.reserve(&mut table, prompt.len()).unwrap();
    model
        .forward(
            &[SeqChunk {
                tokens: prompt,
                start_pos: 0,
                block_table: &table,
                want_logits: true,
            }],
            &mut cache,
        )
        .unwrap()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .unwrap()
        .0
}

/// The numpy reference runs the same dequantized weights in float32 with an
/// f32 KV cache; with F32 safetensors the only differences left are our f16
/// KV cache, summation order and the reference's rounding to 3 decimals.
/// Measured: max |diff| 0.0138 over the 4 prompts (per prompt 0.0083 to
/// 0.0138; logits span about -20..+25). For scale, on the same prompts: the
/// GGUF path (8-bit activations) is 0.60 to 0.86 off the reference, the same
/// directory stored as BF16 0.19, as F16 0.047, and with the q/k rope
/// permutation left in place (the bug this guards against) 6 to 21. So 0.05
/// is ~3.5x the measured value and still rejects all of those but F16
/// (this fixture is F32: `config_matches_the_gguf` checks that).
#[test]
fn last_position_logits_match_numpy_f32_reference() {
    const TOL: f32 = 0.05;
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/logits_refs.json");
    let refs: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    let m = hf();
    let mut worst = 0.0f32;
    for r in refs["prompts"].as_array().unwrap() {
        let prompt: Vec<u32> = r["prompt_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        let want: Vec<f32> = r["numpy_f32_logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        let got = last_logits(m, &prompt);
        let d = max_abs_diff(&got, &want);
        let dg = max_abs_diff(&last_logits(gguf(), &prompt), &want);
        eprintln!(
            "{} tokens: HF F32 max |diff| {d:.4} (GGUF path {dg:.4}), argmax {} vs {}",
            prompt.len(),
            argmax(&got),
            argmax(&want)
        );
        assert_eq!(argmax(&got), argmax(&want), "{:?}", r["text"]);
        worst = worst.max(d);
    }
    eprintln!("HF directory vs numpy f32: max |logit diff| {worst:.4} (tolerance {TOL})");
    assert!(worst <= TOL, "max |logit diff| {worst} > {TOL}");
}

fn greedy(m: &LoadedModel, text: &str) -> GenerateOutput {
    let req = GenerateRequest {
        prompt: m.text.tokenizer.encode(text, false).unwrap(),
        sampling: SamplingParams {
            logprobs: true,
            top_logprobs: 5,
            ..SamplingParams::greedy()
        },
        max_tokens: 48,
        stop_token_ids: m.text.tokenizer.stop_ids(),
        stop_strings: vec![],
        prefill_chunk: 512,
    };
    generate(m, &req, |_| {}).unwrap()
}

/// The GGUF path quantizes activations to 8 bits (as llama.cpp does) and the
/// F32 path does not, so greedy continuations part at near-ties. Measured
/// over the 13 prompts of greedy_refs.json (48 tokens): 3 agree fully, and
/// every divergence is a near-tie, the GGUF's token 0.02 to 0.29 nats below
/// the F32 choice in the F32 model's own log-probabilities.
///
/// - "List of prime numbers: 2, 3, 5, 7," agrees for all 48 tokens (no
///   near-tie: the closest runner-up is 2.7 nats behind).
/// - "The capital of France is" agrees for 5 tokens (" Paris.\n\nThe"), then
///   the F32 model says " answer" (-3.210) over " United" (-3.427), a 0.22
///   nat near-tie, while the GGUF path (and llama.cpp on the same GGUF, see
///   greedy_refs.json) says " United". An independent numpy float32
///   forward over the converted safetensors (HF rotate_half rope, no KV
///   cache) agrees with the F32 path: " answer" -3.209 vs " United" -3.429,
///   greedy " Paris.\n\nThe answer is: 201" for 12 tokens. So for this
///   prompt: exact agreement up to the divergence, a near-tie there, and
///   the F32 text the numpy reference produced.
#[test]
fn greedy_text_matches_the_gguf() {
    const NEAR_TIE: f32 = 0.35;
    // (prompt, tokens that must agree, what the F32 text starts with)
    let cases = [
        (
            "List of prime numbers: 2, 3, 5, 7,",
            48,
            " 11, 13, 17, 19, 23,",
        ),
        (
            "The capital of France is",
            5,
            " Paris.\n\nThe answer is: 201",
        ),
    ];
    for (prompt, must_agree, f32_prefix) in cases {
        let (h, g) = (greedy(hf(), prompt), greedy(gguf(), prompt));
        let agree = h
            .tokens
            .iter()
            .zip(&g.tokens)
            .take_while(|(a, b)| a == b)
            .count();
        eprintln!(
            "{prompt:?}: {agree}/{} tokens agree\n  hf   {:?}\n  gguf {:?}",
            g.tokens.len(),
            h.text,
            g.text
        );
        assert!(
            h.text.starts_with(f32_prefix),
            "{prompt:?}: F32 text {:?}",
            h.text
        );
        if must_agree == 48 {
            assert_eq!(h.text, g.text, "{prompt:?}");
            assert_eq!(h.tokens, g.tokens, "{prompt:?}");
            continue;
        }
        assert!(agree >= must_agree, "{prompt:?}: only {agree} tokens agree");
        if let (Some(step), Some(&theirs)) = (h.sampled.get(agree), g.tokens.get(agree)) {
            let ours = step.logprob.unwrap();
            assert!(
                step.top
                    .iter()
                    .any(|&(id, lp)| id == theirs && ours - lp <= NEAR_TIE),
                "{prompt:?}: diverges at token {agree} where the GGUF chose {theirs}, \
                 not a near-tie (F32 chose {} lp {ours:.3}, top {:?})",
                step.token,
                step.top
            );
        }
    }
}

// ---- broken directories -------------------------------------------------

const TINY_CONFIG: &str = r#"{
  "architectures": ["LlamaForCausalLM"],
  "hidden_size": 8, "intermediate_size": 16,
  "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 2,
  "vocab_size": 6, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
  "max_position_embeddings": 64, "tie_word_embeddings": true
}"#;

/// A byte-level BPE with 6 tokens, no merges.
fn tiny_tokenizer() -> Value {
    json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "vocab": {"a": 0, "b": 1, "c": 2, "d": 3, "Ġ": 4, "e": 5}, "merges": []}
    })
}

/// Tensor name -> shape for the tiny config (tied embeddings).
fn tiny_shapes() -> Vec<(String, Vec<usize>)> {
    let mut v = vec![
        ("model.embed_tokens.weight".to_string(), vec![6, 8]),
        ("model.norm.weight".to_string(), vec![8]),
    ];
    for i in 0..2 {
        for (n, s) in [
            ("input_layernorm", vec![8]),
            ("post_attention_layernorm", vec![8]),
            ("self_attn.q_proj", vec![8, 8]),
            ("self_attn.k_proj", vec![4, 8]),
            ("self_attn.v_proj", vec![4, 8]),
            ("self_attn.o_proj", vec![8, 8]),
            ("mlp.gate_proj", vec![16, 8]),
            ("mlp.up_proj", vec![16, 8]),
            ("mlp.down_proj", vec![8, 16]),
        ] {
            v.push((format!("model.layers.{i}.{n}.weight"), s));
        }
    }
    v
}

/// Writes `tensors` (all F32, small deterministic values) to `path`.
fn write_safetensors(path: &Path, tensors: &[(String, Vec<usize>)]) {
    let data: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(name, shape)| {
            let n: usize = shape.iter().product();
            let vals: Vec<f32> = (0..n).map(|i| ((i % 7) as f32 - 3.0) * 0.05).collect();
            (
                name.clone(),
                shape.clone(),
                bytemuck::cast_slice(&vals).to_vec(),
            )
        })
        .collect();
    let views: Vec<(String, TensorView<'_>)> = data
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                TensorView::new(Dtype::F32, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// A valid tiny directory, its tensors split over two files.
fn tiny_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    std::fs::write(p.join("config.json"), TINY_CONFIG).unwrap();
    std::fs::write(p.join("tokenizer.json"), tiny_tokenizer().to_string()).unwrap();
    std::fs::write(
        p.join("tokenizer_config.json"),
        json!({"bos_token": "a", "eos_token": "b", "add_bos_token": false,
               "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"})
        .to_string(),
    )
    .unwrap();
    let shapes = tiny_shapes();
    let (first, second) = shapes.split_at(shapes.len() / 2);
    write_safetensors(&p.join("model-00001-of-00002.safetensors"), first);
    write_safetensors(&p.join("model-00002-of-00002.safetensors"), second);
    dir
}

/// Loads `dir`, expecting an error whose message contains all of `needles`.
fn load_err(dir: &Path, needles: &[&str]) -> ModelError {
    let e = match load(dir) {
        Ok(_) => panic!(
            "{} loaded, expected an error with {needles:?}",
            dir.display()
        ),
        Err(e) => e,
    };
    let msg = e.to_string();
    for n in needles {
        assert!(msg.contains(n), "error {msg:?} does not mention {n:?}");
    }
    e
}

#[test]
fn tiny_valid_directory_loads_and_runs() {
    let dir = tiny_dir();
    let m = load(dir.path()).unwrap();
    assert_eq!(m.model.config().n_layers, 2);
    assert_eq!(m.text.tokenizer.vocab_size(), 6);
    assert_eq!(
        m.text.tokenizer.encode("ab e", false).unwrap(),
        vec![0, 1, 4, 5]
    );
    let logits = last_logits(&m, &[0, 1, 2]);
    assert_eq!(logits.len(), 6);
    assert!(logits.iter().all(|x| x.is_finite()), "{logits:?}");
}

#[test]
fn missing_config_is_an_io_error() {
    let dir = tiny_dir();
    std::fs::remove_file(dir.path().join("config.json")).unwrap();
    let e = load_err(dir.path(), &["config.json"]);
    assert!(matches!(e, ModelError::Io { .. }), "{e:?}");
}

#[test]
fn wrong_architecture_is_rejected() {
    let dir = tiny_dir();
    std::fs::write(
        dir.path().join("config.json"),
        TINY_CONFIG.replace("LlamaForCausalLM", "GPT2LMHeadModel"),
    )
    .unwrap();
    let e = load_err(dir.path(), &["GPT2LMHeadModel"]);
    assert!(
        matches!(e, ModelError::UnsupportedArchitecture { .. }),
        "{e:?}"
    );
}

#[test]
fn malformed_config_is_rejected() {
    let dir = tiny_dir();
    std::fs::write(dir.path().join("config.json"), "{\"architectures\": [").unwrap();
    let e = load_err(dir.path(), &["config.json"]);
    assert!(matches!(e, ModelError::InvalidConfig(_)), "{e:?}");
}

#[test]
fn truncated_safetensors_is_rejected() {
    let dir = tiny_dir();
    let f = dir.path().join("model-00002-of-00002.safetensors");
    let bytes = std::fs::read(&f).unwrap();
    for keep in [bytes.len() - 7, bytes.len() / 2, 20, 5, 0] {
        std::fs::write(&f, &bytes[..keep]).unwrap();
        let e = load_err(dir.path(), &["model-00002-of-00002.safetensors"]);
        assert!(matches!(e, ModelError::Safetensors { .. }), "{keep}: {e:?}");
    }
}

#[test]
fn wrong_tensor_shapes_are_rejected() {
    // (tensor, wrong shape, words the error must contain)
    let cases: [(&str, Vec<usize>, &[&str]); 5] = [
        // Right element count, wrong orientation: caught against the config.
        (
            "model.layers.1.self_attn.k_proj.weight",
            vec![8, 4],
            &["attn_k", "8x4", "4x8"],
        ),
        (
            "model.layers.0.mlp.down_proj.weight",
            vec![16, 8],
            &["ffn_down", "16x8"],
        ),
        (
            "model.embed_tokens.weight",
            vec![7, 8],
            &["token_embd", "7x8"],
        ),
        (
            "model.layers.0.input_layernorm.weight",
            vec![9],
            &["attn_norm", "9 values"],
        ),
        // Wrong rank.
        (
            "model.layers.0.self_attn.q_proj.weight",
            vec![8, 8, 1],
            &["q_proj", "2 dimensions"],
        ),
    ];
    for (name, shape, needles) in cases {
        let dir = tiny_dir();
        let mut shapes = tiny_shapes();
        for (n, s) in &mut shapes {
            if n == name {
                *s = shape.clone();
            }
        }
        // Rewrite both files so the tensor stays in the same one.
        let (first, second) = shapes.split_at(shapes.len() / 2);
        write_safetensors(&dir.path().join("model-00001-of-00002.safetensors"), first);
        write_safetensors(&dir.path().join("model-00002-of-00002.safetensors"), second);
        let e = load_err(dir.path(), needles);
        assert!(matches!(e, ModelError::BadTensor { .. }), "{name}: {e:?}");
    }
}

#[test]
fn missing_tensor_and_missing_files_are_rejected() {
    let dir = tiny_dir();
    let mut shapes = tiny_shapes();
    shapes.retain(|(n, _)| n != "model.layers.1.mlp.up_proj.weight");
    std::fs::remove_file(dir.path().join("model-00002-of-00002.safetensors")).unwrap();
    write_safetensors(
        &dir.path().join("model-00001-of-00002.safetensors"),
        &shapes,
    );
    let e = load_err(dir.path(), &["model.layers.1.mlp.up_proj.weight"]);
    assert!(matches!(e, ModelError::MissingTensor(_)), "{e:?}");

    // The same tensor in two files.
    write_safetensors(
        &dir.path().join("model-00002-of-00002.safetensors"),
        &tiny_shapes()[..1],
    );
    load_err(
        dir.path(),
        &["model.embed_tokens.weight", "more than one file"],
    );

    // No safetensors at all.
    for f in [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ] {
        std::fs::remove_file(dir.path().join(f)).unwrap();
    }
    let e = load_err(dir.path(), &["no *.safetensors"]);
    assert!(matches!(e, ModelError::NotFound(_)), "{e:?}");

    // No tokenizer.json.
    let dir = tiny_dir();
    std::fs::remove_file(dir.path().join("tokenizer.json")).unwrap();
    let e = load_err(dir.path(), &["tokenizer.json"]);
    assert!(matches!(e, ModelError::Tokenizer(_)), "{e:?}");
}

#[test]
fn unsupported_dtype_is_rejected() {
    let dir = tiny_dir();
    let f = dir.path().join("model-00001-of-00002.safetensors");
    let shapes = tiny_shapes();
    let (first, _) = shapes.split_at(shapes.len() / 2);
    let data: Vec<(String, Vec<usize>, Vec<u8>)> = first
        .iter()
        .map(|(n, s)| {
            (
                n.clone(),
                s.clone(),
                vec![0u8; 4 * s.iter().product::<usize>()],
            )
        })
        .collect();
    let views: Vec<(String, TensorView<'_>)> = data
        .iter()
        .enumerate()
        .map(|(i, (n, s, b))| {
            let dt = if i == 0 { Dtype::I32 } else { Dtype::F32 };
            (n.clone(), TensorView::new(dt, s.clone(), b).unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, None, &f).unwrap();
    load_err(dir.path(), &["unsupported dtype"]);
}
