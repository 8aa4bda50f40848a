//! Feeds arbitrary bytes to the protobuf decoders of the node-to-node
//! messages and, when they decode, to their validation into domain types
//! (what a node does with every gRPC request it gets). Validation must
//! return Ok or Err; what it accepts must round-trip.
//! The body is `tandem_fuzz_harness::proto_messages`.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tandem_fuzz_harness::proto_messages::run(data));
