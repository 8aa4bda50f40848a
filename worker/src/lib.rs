//! The node runtime shared by the prefill and decode roles: the engine and
//! its KV pool registered with the transfer engine, the `Worker` gRPC
//! service (info, KV events and load for routers), `/metrics` and `/health`
//! over HTTP, etcd registration, and the one mapping of node errors to gRPC
//! statuses. The role crates add their own gRPC service on top.

pub mod error;
pub mod events;
pub mod fetch;
pub mod grpc;
pub mod http;
pub mod kv_send;
pub mod node;
pub mod service;

pub use error::WorkerError;
pub use events::EventHub;
pub use node::{NodeCore, NodeOptions, Role};
