//! Hostile chat requests through the real SmolLM2 chat template and the
//! guard that keeps client text from forging turns (from
//! `TANDEM_TEST_GGUF`): rendering and tokenizing never panic, and the
//! control tokens of the prompt depend on the conversation's shape only,
//! never on what the messages say: the same messages with empty contents
//! give exactly the same control tokens.
//! The body is `tandem_fuzz_harness::chat_template`.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tandem_fuzz_harness::chat_template::run(data));
