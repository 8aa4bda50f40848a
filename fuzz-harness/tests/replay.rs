//! Replays every fuzz target's body on seeded inputs: the committed seeds,
//! typical inputs of each format, and seeded mutations of them (bit flips,
//! truncations, insertions, splices). Not a fuzzer (`scripts/fuzz.sh` is):
//! a regression check that each target still runs and holds its
//! assertions, compiled and run with the rest of the workspace. Also
//! checks that `fuzz/` wraps exactly these targets.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use prost::Message;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tandem_fuzz_harness::TARGETS;
use tandem_proto::pb;

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz")
}

/// A seeded mutation of `base` (or of random bytes when it is empty).
fn mutate(rng: &mut ChaCha8Rng, base: &[u8], others: &[Vec<u8>]) -> Vec<u8> {
    let mut v = base.to_vec();
    for _ in 0..rng.random_range(1..=4) {
        match rng.random_range(0..5) {
            0 if !v.is_empty() => {
                let i = rng.random_range(0..v.len());
                v[i] ^= 1 << rng.random_range(0..8);
            }
            1 if !v.is_empty() => v.truncate(rng.random_range(0..v.len())),
            2 => {
                let at = rng.random_range(0..=v.len());
                let n = rng.random_range(1..16);
                let bytes: Vec<u8> = (0..n).map(|_| rng.random()).collect();
                v.splice(at..at, bytes);
            }
            3 if !others.is_empty() => {
                let o = &others[rng.random_range(0..others.len())];
                let cut = rng.random_range(0..=v.len());
                let from = rng.random_range(0..=o.len());
                v.truncate(cut);
                v.extend_from_slice(&o[from..]);
            }
            _ => {
                let n = rng.random_range(0..64);
                v.extend((0..n).map(|_| rng.random::<u8>()));
            }
        }
    }
    v
}

/// Typical inputs of each target's format, before mutation.
fn seeds(target: &str) -> Vec<Vec<u8>> {
    let text = |s: &[&str]| s.iter().map(|s| s.as_bytes().to_vec()).collect();
    match target {
        "gguf_reader" => std::fs::read_dir(fuzz_dir().join("seeds"))
            .unwrap()
            .map(|e| std::fs::read(e.unwrap().path()).unwrap())
            .collect(),
        "openai_request" | "chat_template" => text(&[
            r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":4}"#,
            r#"{"messages":[{"role":"system","content":"<|im_start|>x"},{"role":"user","content":[{"type":"text","text":"a"}]}],"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}],"tool_choice":"required"}"#,
            r#"{"prompt":["a","b"],"n":2,"stop":["x"],"logit_bias":{"1":5}}"#,
            r#"{"messages":[{"role":"assistant","tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{}"}}]},{"role":"tool","tool_call_id":"c","content":"1"}]}"#,
        ]),
        "proto_messages" => vec![
            pb::PrefillRequest::default().encode_to_vec(),
            pb::FetchRequest {
                prompt: vec![1; 32],
                dst_blocks: vec![0, 1],
                ..Default::default()
            }
            .encode_to_vec(),
            pb::GenerateRequest {
                prompt: vec![1, 2, 3],
                ..Default::default()
            }
            .encode_to_vec(),
            pb::Token::default().encode_to_vec(),
        ],
        "stop_strings" => text(&[
            "ab\u{ff}cd",
            "\u{ff}x\u{ff}yz\u{ff}",
            "stop\u{ff}\u{ff}no stop here",
        ]),
        "tokenizer" => text(&[
            "Hello, world!",
            "<|im_start|>user\n",
            "日本語 🦀 \t\n  x",
            "def f():\n    return 1",
        ]),
        _ => vec![Vec::new(), vec![0; 8], (0..64).collect()],
    }
}

/// Inputs per target: the ones that load a model or a transport run fewer.
fn budget(target: &str) -> usize {
    match target {
        "tokenizer" | "chat_template" | "dkv_grants" => 300,
        // A child process with real UCX per 64 inputs.
        "dkv_ucx" => 200,
        _ => 3000,
    }
}

#[test]
fn every_target_holds_on_seeds_and_their_mutations() {
    for &(name, run) in TARGETS {
        let seeds = seeds(name);
        let mut rng = ChaCha8Rng::seed_from_u64(0x7a4d3e);
        for s in &seeds {
            run(s);
        }
        for i in 0..budget(name) {
            let base = if seeds.is_empty() {
                &[][..]
            } else {
                &seeds[i % seeds.len()]
            };
            run(&mutate(&mut rng, base, &seeds));
        }
    }
}

/// `fuzz/Cargo.toml`'s binaries, `fuzz/fuzz_targets/` and [`TARGETS`]
/// name the same targets, and each binary calls its own body.
#[test]
fn fuzz_binaries_wrap_exactly_these_targets() {
    let manifest = std::fs::read_to_string(fuzz_dir().join("Cargo.toml")).unwrap();
    let mut bins: Vec<String> = manifest
        .lines()
        .filter_map(|l| l.strip_prefix("name = \""))
        .filter_map(|l| l.strip_suffix('"'))
        .filter(|n| *n != "tandem-fuzz")
        .map(str::to_owned)
        .collect();
    bins.sort();
    let mut files: Vec<String> = std::fs::read_dir(fuzz_dir().join("fuzz_targets"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    files.sort();
    let names: Vec<String> = TARGETS.iter().map(|(n, _)| n.to_string()).collect();
    assert_eq!(bins, names, "fuzz/Cargo.toml [[bin]]s");
    assert_eq!(files, names, "fuzz/fuzz_targets/");
    for n in &names {
        let src = std::fs::read_to_string(fuzz_dir().join(format!("fuzz_targets/{n}.rs"))).unwrap();
        let call = format!("tandem_fuzz_harness::{n}::run(data)");
        assert!(
            src.contains(&call),
            "fuzz_targets/{n}.rs does not call {call}"
        );
    }
}
