//! Feeds arbitrary bodies to the OpenAI request parsers and validators
//! (chat and completions) and, when a body parses, to everything that
//! derives from it: parameters, the conversation for the template (both
//! shapes), tools and tool choice. Each must return Ok or Err: no panic,
//! hang or unbounded allocation.
//! The body is `tandem_fuzz_harness::openai_request`.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tandem_fuzz_harness::openai_request::run(data));
