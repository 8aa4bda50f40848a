//! The front end's [`Backend`] over the cluster.

use std::sync::Arc;

use futures_util::future::BoxFuture;
use tandem_frontend::{Backend, BackendHealth, BackendRequest, GenerationStream, SubmitError};
use tandem_types::RequestLimits;

use super::{Cluster, probation};

/// The front end's [`Backend`] over a cluster: routes each request to a
/// decode node (and its prefill candidates) and streams its tokens back.
#[derive(Debug, Clone)]
pub struct ClusterBackend {
    cluster: Arc<Cluster>,
    limits: RequestLimits,
}

impl ClusterBackend {
    /// `limits.max_length` is the decode nodes' `--max-length`.
    pub fn new(cluster: Arc<Cluster>, limits: RequestLimits) -> Self {
        Self { cluster, limits }
    }
}

impl Backend for ClusterBackend {
    fn limits(&self) -> RequestLimits {
        self.limits
    }

    fn submit(
        &self,
        req: BackendRequest,
    ) -> BoxFuture<'_, Result<Box<dyn GenerationStream>, SubmitError>> {
        Box::pin(async move {
            let (stream, placement) = self.cluster.generate(req, self.limits.vocab_size).await?;
            tracing::debug!(decode = %placement.decode, prefill = ?placement.prefill, "routed");
            Ok(Box::new(stream) as Box<dyn GenerationStream>)
        })
    }

    fn health(&self) -> BackendHealth {
        let (prefill, decode) = self.cluster.members();
        let ready = !decode.is_empty();
        let mut details = serde_json::Map::new();
        details.insert("prefill_workers".into(), prefill.into());
        details.insert("decode_workers".into(), decode.into());
        let (total, listed) = probation::health_report(&self.cluster.workers);
        details.insert("probation_total".into(), total.into());
        details.insert("probation_workers".into(), listed.into());
        BackendHealth {
            ready,
            reason: "no decode workers",
            details,
        }
    }
}
