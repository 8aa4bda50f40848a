//! Prefill role: gRPC server that computes prompt KV and writes it to decode nodes. Arrives with the disaggregated-cluster issue.
