//! Where requests run. The front end checks, tokenizes and renders; a
//! [`Backend`] runs the tokens: the local batch scheduler in `tandem serve`,
//! a cluster of prefill and decode nodes behind `tandem router`, or a fake
//! in the front end's tests.

use futures_util::future::BoxFuture;
use tandem_proto::trace::TraceContext;
use tandem_types::{GenEvent, GenFailure, GenerationRequest, InvalidRequest, RequestLimits};

/// One tokenized request, checked against the backend's [`RequestLimits`]
/// (its `max_tokens` within the room left; its constraint checked to
/// compile).
#[derive(Debug, Clone)]
pub struct BackendRequest {
    pub request: GenerationRequest,
    /// The context that calls to workers carry.
    pub trace: TraceContext,
}

/// Why a backend refused a request before running it.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    /// The request cannot run (400).
    #[error(transparent)]
    Invalid(#[from] InvalidRequest),
    /// The backend cannot run it now.
    #[error(transparent)]
    Failed(#[from] GenFailure),
}

/// The events of one running request. Dropping it cancels the request and
/// frees what it holds, wherever that is.
pub trait GenerationStream: Send {
    /// The next event; `None` only if the backend went away without a
    /// final event (the front end reports that as a shutdown).
    fn next(&mut self) -> BoxFuture<'_, Option<GenEvent>>;

    /// Prompt tokens served from a cache, as far as known now (a caller
    /// that stops reading early still reports them); 0 if only the final
    /// `Usage` tells.
    fn cached_tokens(&self) -> usize {
        0
    }
}

/// What `/health` reports for a backend.
#[derive(Debug, Clone)]
pub struct BackendHealth {
    /// Whether the backend can take requests now.
    pub ready: bool,
    /// `status` when not ready (e.g. "no decode workers").
    pub reason: &'static str,
    /// Backend-specific counters, merged into the `/health` body.
    pub details: serde_json::Map<String, serde_json::Value>,
}

/// Where requests run.
pub trait Backend: Send + Sync + std::fmt::Debug + 'static {
    /// The limits the front end checks every request against.
    fn limits(&self) -> RequestLimits;

    /// Starts `req`. Errors are refusals: nothing ran and nothing is held.
    fn submit(
        &self,
        req: BackendRequest,
    ) -> BoxFuture<'_, Result<Box<dyn GenerationStream>, SubmitError>>;

    fn health(&self) -> BackendHealth;
}
