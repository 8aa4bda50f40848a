//! Feeds arbitrary KV region descriptors and write ops to the transfer
//! engine's receiving side (the in-process transport, which checks writes
//! against the receiver's grant table exactly as the UCX receiver does):
//! a live grant covers two ranges of a pool; the descriptor is the grant's
//! own with bytes of the input spliced into its address, token, envelope
//! and length, or raw input bytes. Whatever the input: no panic, and no
//! byte outside the granted ranges ever changes.
//! The body is `tandem_fuzz_harness::dkv_grants`.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tandem_fuzz_harness::dkv_grants::run(data));
