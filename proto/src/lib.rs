//! Wire types (gRPC/protobuf) shared by the router and the nodes. Arrives with the disaggregated-cluster issue.
