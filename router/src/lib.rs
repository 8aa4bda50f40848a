//! Router: the OpenAI-compatible HTTP API (`server`, `openai`, `error`,
//! request metrics and the admission backlog in `metrics`) over either the
//! local batch scheduler (`tandem serve`) or a cluster (`cluster`: etcd
//! membership, KV-event prefix index, KV- and load-aware routing, `Generate`
//! streams to decode nodes with their egress backlog).

pub mod cluster;
pub mod error;
pub mod metrics;
pub mod openai;
pub mod server;

pub use error::ApiError;
pub use metrics::MetricsRenderer;
pub use server::{AppState, Backend, ServerConfig, app, serve};
