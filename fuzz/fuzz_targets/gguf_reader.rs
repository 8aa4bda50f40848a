//! Feeds arbitrary bytes to the GGUF reader.  It must return Ok or Err,
//! never panic, hang, read out of bounds or allocate without bound; when it
//! returns Ok every tensor's data and every metadata getter must work.
//! The body is `tandem_fuzz_harness::gguf_reader`.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tandem_fuzz_harness::gguf_reader::run(data));
