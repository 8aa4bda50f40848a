//! Cluster routing for `tandem router`: etcd membership, the KV-event
//! prefix index, KV- and load-aware choice of decode and prefill workers,
//! and `Generate` streams to decode nodes with their egress backlog,
//! offered to the HTTP front end as a [`ClusterBackend`].

pub mod cluster;
mod error;

pub use cluster::{Cluster, ClusterBackend};
pub use error::RouterError;
