//! dKV's network-facing entry points with the real UCX, each batch of
//! inputs in a child process, so that an abort inside UCX is a finding
//! (its batch saved under artifacts/dkv_ucx/) rather than a lost fuzzer:
//! forged worker addresses through `Dkv::check`/`write` to `ucp_ep_create`,
//! and raw active messages (any header, length, eager or rendezvous) from a
//! stranger's own UCX at a receiver with a live grant.
//! The body is `tandem_fuzz_harness::dkv_ucx`.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tandem_fuzz_harness::dkv_ucx::run(data));
