//! The `Worker` gRPC service every node serves: identity and fingerprint,
//! the stream of prefix-cache events and load that routers follow, and
//! fetches of cached prefix blocks by peers (`fetch.rs`).

use std::pin::Pin;
use std::sync::Arc;

use futures_util::Stream;
use tandem_proto::trace::TraceContext;
use tandem_proto::{PROTOCOL_VERSION, pb};
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::node::NodeCore;

#[derive(Debug, Clone)]
pub struct WorkerService {
    core: Arc<NodeCore>,
}

impl WorkerService {
    pub fn new(core: Arc<NodeCore>) -> Self {
        Self { core }
    }

    pub fn into_server(self) -> pb::worker_server::WorkerServer<Self> {
        pb::worker_server::WorkerServer::new(self)
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::WorkerEvent, Status>> + Send>>;

#[tonic::async_trait]
impl pb::worker_server::Worker for WorkerService {
    async fn info(&self, _: Request<pb::InfoRequest>) -> Result<Response<pb::WorkerInfo>, Status> {
        Ok(Response::new(pb::WorkerInfo {
            version: PROTOCOL_VERSION,
            id: self.core.id.clone(),
            role: self.core.role.as_str().to_string(),
            fingerprint: Some((&self.core.fingerprint).into()),
        }))
    }

    type EventsStream = EventStream;

    async fn events(
        &self,
        req: Request<pb::EventsRequest>,
    ) -> Result<Response<Self::EventsStream>, Status> {
        let after = req.into_inner().after_event_id;
        let sub = self.core.hub.subscribe(after);
        let mut live = sub.live;
        let backlog = sub.backlog;
        let stream = async_stream::stream! {
            for e in backlog {
                yield Ok((*e).clone());
            }
            // A slow reader that lost events (`Lagged`) gets the stream ended,
            // so that it reconnects from its last id and replays.
            while let Ok(e) = live.recv().await {
                yield Ok((*e).clone());
            }
        };
        Ok(Response::new(Box::pin(stream)))
    }

    async fn fetch_blocks(
        &self,
        req: Request<pb::FetchRequest>,
    ) -> Result<Response<pb::FetchResponse>, Status> {
        let asked = req.get_ref().dst_blocks.len();
        let span = tracing::info_span!(
            "fetch_blocks",
            trace_id = tracing::field::Empty,
            asked = asked as i64,
        );
        TraceContext::start_hop(&span, TraceContext::from_metadata(req.metadata()));
        async move {
            match crate::fetch::fetch_blocks(&self.core, req.into_inner()).await {
                Ok(r) => {
                    tracing::info!(asked, sent = r.blocks, "prefix blocks fetched");
                    Ok(Response::new(r))
                }
                Err(e) => {
                    tracing::warn!(asked, error = %e, "fetching prefix blocks failed");
                    Err(e.into())
                }
            }
        }
        .instrument(span)
        .await
    }
}
