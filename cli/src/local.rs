//! The front end's [`Backend`] over this process's batch scheduler
//! (`tandem serve`).

use std::sync::atomic::Ordering;

use futures_util::future::BoxFuture;
use tandem_engine::RequestError;
use tandem_engine::scheduler::{GenerateStream, SchedulerHandle};
use tandem_frontend::{Backend, BackendHealth, BackendRequest, GenerationStream, SubmitError};
use tandem_types::{GenEvent, GenFailure, RequestLimits};

#[derive(Debug, Clone)]
pub struct LocalBackend {
    scheduler: SchedulerHandle,
    vocab_size: usize,
    /// What runs the steps, for `/health` ("cpu", "gpu:0 (...)", "mock").
    device: String,
}

impl LocalBackend {
    pub fn new(scheduler: SchedulerHandle, vocab_size: usize, device: String) -> Self {
        Self {
            scheduler,
            vocab_size,
            device,
        }
    }
}

impl Backend for LocalBackend {
    fn limits(&self) -> RequestLimits {
        RequestLimits {
            max_length: self.scheduler.config().max_length,
            vocab_size: self.vocab_size,
        }
    }

    fn submit(
        &self,
        req: BackendRequest,
    ) -> BoxFuture<'_, Result<Box<dyn GenerationStream>, SubmitError>> {
        let submitted = self.scheduler.generate(req.request);
        Box::pin(async move {
            match submitted {
                Ok(stream) => Ok(Box::new(LocalStream(stream)) as Box<dyn GenerationStream>),
                Err(RequestError::Invalid(e)) => Err(e.into()),
                Err(RequestError::Stopped) => Err(GenFailure::ShuttingDown.into()),
                Err(e) => Err(GenFailure::Internal(e.to_string()).into()),
            }
        })
    }

    fn health(&self) -> BackendHealth {
        let s = self.scheduler.stats();
        let mut details = serde_json::Map::new();
        for (k, v) in [
            ("running", &s.running),
            ("waiting", &s.waiting),
            ("kv_blocks_total", &s.kv_blocks_total),
            ("kv_blocks_in_use", &s.kv_blocks_in_use),
            ("kv_blocks_cached", &s.kv_blocks_cached),
        ] {
            details.insert(k.into(), v.load(Ordering::Relaxed).into());
        }
        details.insert("device".into(), self.device.clone().into());
        // A device failing every step fails every request: say so, so that
        // a balancer stops sending work (and an orchestrator may restart).
        let failing = s.failing();
        BackendHealth {
            ready: !failing,
            reason: if failing { "failing" } else { "ok" },
            details,
        }
    }
}

/// A scheduler generation as the front end's stream.
struct LocalStream(GenerateStream);

impl GenerationStream for LocalStream {
    fn next(&mut self) -> BoxFuture<'_, Option<GenEvent>> {
        Box::pin(self.0.next())
    }

    fn cached_tokens(&self) -> usize {
        self.0.cached_tokens()
    }
}
