//! The answer stream of a generation on a decode node, through the egress
//! backlog: a reader task per stream takes the decode node's messages as
//! they arrive and validates them.

use std::time::Instant;

use futures_util::future::BoxFuture;
use tandem_frontend::GenerationStream;
use tandem_proto::{failure_from_status, finish_from_pb, pb};
use tandem_types::egress;
use tandem_types::{GenEvent as Event, GenFailure, Sampled, Usage};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tonic::Streaming;

/// A generation in flight on a decode node. A reader task takes the
/// decode node's messages off the gRPC stream as they arrive, so that
/// responses waiting for a slow client are counted in the egress backlog
/// (`tandem.num_responses_buffered`, `tandem.response_queue_time`) instead of
/// hiding in HTTP/2 flow control. Dropping the stream stops the reader,
/// which drops the gRPC stream: the decode node sees the cancellation.
#[derive(Debug)]
pub struct RemoteStream {
    rx: mpsc::Receiver<Buffered>,
    _reader: AbortOnDrop,
    done: bool,
}

/// Responses the reader may run ahead of the client before it waits.
const EGRESS_BUFFER: usize = 1024;

/// One response in the egress backlog until taken or dropped.
#[derive(Debug)]
struct Buffered {
    event: Option<Event>,
    at: Instant,
}

impl Buffered {
    fn new(event: Event) -> Self {
        Self {
            event: Some(event),
            at: egress::produced(),
        }
    }

    fn take(mut self) -> Option<Event> {
        egress::taken(self.at);
        self.event.take()
    }
}

impl Drop for Buffered {
    fn drop(&mut self) {
        if self.event.is_some() {
            egress::discarded(1);
        }
    }
}

/// Aborts the task when dropped, so that no reader outlives its stream.
#[derive(Debug)]
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl RemoteStream {
    pub(super) fn start(stream: Streaming<pb::GenerateResponse>, vocab: usize) -> Self {
        let (tx, rx) = mpsc::channel(EGRESS_BUFFER);
        let reader = AbortOnDrop(tokio::spawn(read_remote(stream, vocab, tx)));
        Self {
            rx,
            _reader: reader,
            done: false,
        }
    }

    /// The next event; a broken stream (decode node gone) ends with
    /// `Failed`.
    pub async fn recv(&mut self) -> Option<Event> {
        if self.done {
            return None;
        }
        let ev = match self.rx.recv().await.and_then(Buffered::take) {
            Some(ev) => ev,
            // The reader ends only after a final event, or if aborted.
            None => Event::Failed(GenFailure::Internal("decode stream reader stopped".into())),
        };
        if !matches!(ev, Event::Token(_)) {
            self.done = true;
        }
        Some(ev)
    }
}

impl GenerationStream for RemoteStream {
    fn next(&mut self) -> BoxFuture<'_, Option<Event>> {
        Box::pin(self.recv())
    }
}

/// Moves a decode node's messages into the egress backlog until the final
/// one, or until the client side goes away (then dropping `stream` cancels
/// the request on the decode node at once, even mid-wait).
async fn read_remote(
    mut stream: Streaming<pb::GenerateResponse>,
    vocab: usize,
    tx: mpsc::Sender<Buffered>,
) {
    // One waiter on the channel's closing for the whole stream: a fresh
    // `closed()` per message would register and unregister a waiter (two
    // lock round trips) for every token.
    let closed = tx.closed();
    tokio::pin!(closed);
    loop {
        let msg = tokio::select! {
            () = &mut closed => return,
            msg = stream.message() => msg,
        };
        let ev = remote_event(msg, vocab);
        let last = !matches!(ev, Event::Token(_));
        if tx.send(Buffered::new(ev)).await.is_err() || last {
            return;
        }
    }
}

/// A decode node's message (or the stream's end) in the scheduler's terms,
/// validated: anything malformed is a failure of the request.
fn remote_event(msg: Result<Option<pb::GenerateResponse>, tonic::Status>, vocab: usize) -> Event {
    use pb::generate_response::Kind;
    match msg {
        Ok(Some(pb::GenerateResponse {
            kind: Some(Kind::Token(t)),
        })) => match Sampled::try_from(t) {
            Ok(s) if (s.token as usize) < vocab => Event::Token(s),
            Ok(s) => Event::Failed(GenFailure::Internal(format!(
                "decode node sent token {} outside the vocabulary",
                s.token
            ))),
            Err(e) => Event::Failed(GenFailure::Internal(format!(
                "decode node sent a bad token: {e}"
            ))),
        },
        Ok(Some(pb::GenerateResponse {
            kind: Some(Kind::Finished(f)),
        })) => match finish_from_pb(f.finish) {
            Ok(finish) => Event::Finished(Usage {
                prompt_tokens: f.prompt_tokens as usize,
                completion_tokens: f.completion_tokens as usize,
                cached_tokens: f.cached_tokens as usize,
                finish,
            }),
            Err(e) => Event::Failed(GenFailure::Internal(format!(
                "decode node sent a bad finish: {e}"
            ))),
        },
        Ok(Some(_)) => Event::Failed(GenFailure::Internal(
            "decode node sent an empty message".into(),
        )),
        Ok(None) => Event::Failed(GenFailure::Unavailable(
            "decode node closed the stream before finishing".into(),
        )),
        Err(s) => Event::Failed(failure_from_status(&s)),
    }
}
