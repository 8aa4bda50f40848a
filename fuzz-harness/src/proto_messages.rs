//! Feeds arbitrary bytes to the protobuf decoders of the node-to-node
//! messages and, when they decode, to their validation into domain types
//! (what a node does with every gRPC request it gets). Validation must
//! return Ok or Err; what it accepts must round-trip.

use prost::Message;
use tandem_proto::{FetchJob, GenerateJob, PrefillJob, pb};
use tandem_types::ModelFingerprint;

fn fingerprint() -> ModelFingerprint {
    ModelFingerprint {
        model_id: "m".into(),
        weights_hash: 0xabc,
        kv_dtype: "f16".into(),
        block_size: 16,
        kv_layout: "layer/kv/head/slot/dim".into(),
        num_layers: 2,
        num_kv_heads: 3,
        head_dim: 4,
    }
}

/// One fuzz input.
pub fn run(data: &[u8]) {
    let fp = fingerprint();
    if let Ok(req) = pb::PrefillRequest::decode(data)
        && let Ok(job) = PrefillJob::validate(req, &fp, 1 << 20)
    {
        let again = PrefillJob::validate(job.to_pb(&fp), &fp, 1 << 20);
        assert_eq!(again.as_ref().ok(), Some(&job));
    }
    if let Ok(req) = pb::FetchRequest::decode(data)
        && let Ok(job) = FetchJob::validate(req, &fp, 1 << 20)
    {
        let again = FetchJob::validate(job.to_pb(&fp), &fp, 1 << 20);
        assert_eq!(again.as_ref().ok(), Some(&job));
    }
    if let Ok(req) = pb::GenerateRequest::decode(data)
        && let Ok(job) = GenerateJob::validate(req, &fp)
    {
        assert!(GenerateJob::validate(job.to_pb(&fp), &fp).is_ok());
    }
    if let Ok(t) = pb::Token::decode(data) {
        let _ = tandem_types::Sampled::try_from(t);
    }
}
