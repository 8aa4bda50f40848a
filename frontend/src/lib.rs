//! The OpenAI-compatible HTTP front end: request types and validation
//! (`openai`), error rendering (`error`), tool-call and reasoning parsing
//! (`tools`, `reasoning`), the server with its SSE streams
//! and admission limits (`server`) and the API metrics (`metrics`), over a
//! [`Backend`] that runs the tokens: the local scheduler (`tandem serve`)
//! or a cluster (`tandem router`).

pub mod auth;
pub mod backend;
pub mod error;
pub mod metrics;
pub mod openai;
pub mod openapi;
pub mod prompt;
pub mod reasoning;
pub mod server;
pub mod tools;

pub use backend::{Backend, BackendHealth, BackendRequest, GenerationStream, SubmitError};
pub use error::ApiError;
pub use metrics::MetricsRenderer;
pub use server::{AppState, BodyPace, ServerConfig, app, serve};
