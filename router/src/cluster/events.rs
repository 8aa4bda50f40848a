//! The event follower: one task per worker verifies it (`Worker.Info`),
//! then applies its `Worker.Events` stream (cache events and load) to the
//! router's view of it, promoting it off probation at its first load
//! report, and reconnects with backoff when the stream breaks.

use std::sync::Weak;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tandem_proto::pb;
use tonic::Status;
use tonic::transport::Channel;

use super::Worker;
use super::probation::{Reason, check_identity, classify, detail};

/// How long one verification step (`Info`, opening `Events`) may take.
const STEP_TIMEOUT: Duration = Duration::from_secs(10);

/// The first pause before reconnecting; it doubles up to
/// [`Standing::max_backoff`](super::Standing::max_backoff) while attempts fail.
const FIRST_BACKOFF: Duration = Duration::from_millis(100);

/// How a connection to a worker ended.
enum Ended {
    /// The worker left the membership.
    Gone,
    /// Its event stream skipped events: resubscribe (still routable).
    Gap,
    Failed(Reason, String),
}

/// Follows a worker: verifies it, then applies its events and load,
/// promoting it at its first load report; reconnects (replaying from the
/// last event seen) with backoff until the worker leaves the membership.
pub(super) async fn follow_events(worker: Weak<Worker>) {
    let mut backoff = FIRST_BACKOFF;
    loop {
        let Some(w) = worker.upgrade() else { return };
        let channel = w.channel.clone();
        drop(w);
        let ended = session(&worker, channel).await;
        let Some(w) = worker.upgrade() else { return };
        // A connection that got as far as a load report was a good one:
        // reconnect soon. Anything else backs off further each time.
        if w.standing.is_ready() {
            backoff = FIRST_BACKOFF;
        }
        match ended {
            Ended::Gone => return,
            Ended::Gap => tracing::debug!(worker = %w.record.id, "event gap; resubscribing"),
            Ended::Failed(reason, detail) => w.standing.demote(&w.record.id, reason, &detail),
        }
        let pause = backoff;
        backoff = (backoff * 2).min(w.standing.max_backoff());
        drop(w);
        tokio::time::sleep(pause).await;
    }
}

/// One connection: `Info` (who answers), then `Events` from the last
/// event seen, until it breaks.
async fn session(worker: &Weak<Worker>, channel: Channel) -> Ended {
    let mut client = pb::worker_client::WorkerClient::new(channel);
    let info = match step(client.info(pb::InfoRequest {})).await {
        Ok(info) => info,
        Err(e) => return e,
    };
    let after = {
        let Some(w) = worker.upgrade() else {
            return Ended::Gone;
        };
        if let Err(why) = check_identity(&w.record, info) {
            return Ended::Failed(Reason::Identity, why);
        }
        w.last_event.load(Ordering::Relaxed)
    };
    let mut stream = match step(client.events(pb::EventsRequest {
        after_event_id: after,
    }))
    .await
    {
        Ok(s) => s,
        Err(e) => return e,
    };
    loop {
        let e = match stream.message().await {
            Ok(Some(e)) => e,
            Ok(None) => {
                return Ended::Failed(Reason::Lost, "the worker ended its event stream".into());
            }
            Err(s) => return Ended::Failed(Reason::Lost, detail(&s)),
        };
        let Some(w) = worker.upgrade() else {
            return Ended::Gone;
        };
        if !w.apply(&e) {
            return Ended::Gap;
        }
        if matches!(e.kind, Some(pb::worker_event::Kind::Load(_))) {
            w.standing.promote(&w.record.id);
        }
    }
}

/// One verification call, bounded by [`STEP_TIMEOUT`].
async fn step<T>(
    call: impl Future<Output = Result<tonic::Response<T>, Status>>,
) -> Result<T, Ended> {
    match tokio::time::timeout(STEP_TIMEOUT, call).await {
        Ok(Ok(r)) => Ok(r.into_inner()),
        Ok(Err(s)) => Err(Ended::Failed(classify(&s), detail(&s))),
        Err(_) => Err(Ended::Failed(
            Reason::Unreachable,
            format!("no answer within {STEP_TIMEOUT:?}"),
        )),
    }
}
