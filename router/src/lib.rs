//! Router: the OpenAI-compatible HTTP API over the engine's batch scheduler
//! (`tandem serve`). KV-aware routing across nodes arrives with the cluster
//! issues.

pub mod cluster;
pub mod error;
pub mod metrics;
pub mod openai;
pub mod server;

pub use error::ApiError;
pub use metrics::MetricsRenderer;
pub use server::{AppState, Backend, ServerConfig, app, serve};
