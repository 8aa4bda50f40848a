//! Differential fuzzing of the streaming stop-string matcher against its
//! definition: after each piece, the text before the earliest stop string
//! the text so far contains. The input is split into stop strings and
//! pieces at 0xFF bytes (a separator that UTF-8 never uses).
//! The body is `tandem_fuzz_harness::stop_strings`.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tandem_fuzz_harness::stop_strings::run(data));
