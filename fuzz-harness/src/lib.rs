//! The bodies of the fuzz targets, one module per target, each a
//! `run(data: &[u8])` that panics on a finding. They live in the workspace
//! so that every build compiles and lints them and the test run replays
//! them on seeded inputs (`tests/replay.rs`); `fuzz/fuzz_targets/*.rs`
//! only hands libFuzzer's inputs to them (`scripts/fuzz.sh` runs those).

#![allow(clippy::unwrap_used, clippy::expect_used)]

pub mod chat_template;
pub mod dkv_grants;
pub mod dkv_ucx;
pub mod gguf_reader;
pub mod openai_request;
pub mod proto_messages;
pub mod stop_strings;
pub mod tokenizer;

/// A target's body: panics on a finding.
pub type Target = fn(&[u8]);

/// Every target by its fuzz binary's name (`fuzz/Cargo.toml`'s `[[bin]]`s).
pub const TARGETS: &[(&str, Target)] = &[
    ("chat_template", chat_template::run),
    ("dkv_grants", dkv_grants::run),
    ("dkv_ucx", dkv_ucx::run),
    ("gguf_reader", gguf_reader::run),
    ("openai_request", openai_request::run),
    ("proto_messages", proto_messages::run),
    ("stop_strings", stop_strings::run),
    ("tokenizer", tokenizer::run),
];
