//! Decode role: gRPC server that owns destination KV blocks and generates tokens. Arrives with the disaggregated-cluster issue.
