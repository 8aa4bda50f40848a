//! A request's channels, typed by its purpose: the actor's sending side
//! ([`Sink`]) and the caller's streams ([`GenerateStream`],
//! [`ExportStream`], [`ImportStream`]). Each stream receives only the
//! events its kind of request produces. Events are stamped when sent and
//! counted as the egress backlog until read or dropped; dropping a stream
//! before its request ended cancels the request.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Instant;

use tokio::sync::mpsc as tmpsc;

use tandem_types::{GenEvent, GenFailure, Sampled, Usage, egress};

use super::{Command, ExportEvent, Exported, ImportOutcome, ImportSlot, LayerDone};
use crate::kv_cache::BlockId;

/// The sending half of a request's channel of `E`s.
pub(super) type Tx<E> = tmpsc::UnboundedSender<(Instant, E)>;

/// A new channel of `E`s: the actor's half and the caller's.
pub(super) fn channel<E>() -> (Tx<E>, Events<E>) {
    let (tx, rx) = tmpsc::unbounded_channel();
    (tx, Events { rx })
}

/// Sends `ev`, counting it as buffered until the reader takes it. A reader
/// that went away is not an error: its stream's drop cancels the request.
fn emit<E>(tx: &Tx<E>, ev: E) {
    if tx.send((egress::produced(), ev)).is_err() {
        egress::discarded(1);
    }
}

/// Where a sequence's events go, by what the request is for.
#[derive(Debug)]
pub(super) enum Output {
    /// A generation's tokens: generated here from the start, or after an
    /// import once its KV is in place.
    Tokens(Tx<GenEvent>),
    /// An export: layers as they are written, then the held blocks.
    Export(Tx<ExportEvent>),
    /// A hold: the prompt's leading blocks this node has cached (pool or
    /// KV tiers), held for a peer to copy; nothing is computed.
    Hold(Tx<Result<Vec<BlockId>, GenFailure>>),
}

/// The actor's side of a request.
#[derive(Debug)]
pub(super) struct Sink {
    pub(super) output: Output,
    /// An import not yet admitted: where its destination blocks (or its
    /// failure) go. Taken when they are sent.
    pub(super) import: Option<Tx<Result<ImportSlot, GenFailure>>>,
}

impl Sink {
    pub(super) fn is_export(&self) -> bool {
        matches!(self.output, Output::Export(_))
    }

    pub(super) fn is_hold(&self) -> bool {
        matches!(self.output, Output::Hold(_))
    }

    /// Reports a hold's blocks, now pinned until its stream is dropped.
    pub(super) fn held(&self, blocks: Vec<BlockId>) {
        if let Output::Hold(tx) = &self.output {
            emit(tx, Ok(blocks));
        }
    }

    /// Reports a generated token. An export's one token leaves with its
    /// blocks ([`Sink::exported`]) instead.
    pub(super) fn token(&self, sampled: Sampled) {
        if let Output::Tokens(tx) = &self.output {
            emit(tx, GenEvent::Token(sampled));
        }
    }

    /// Reports a finished generation (never an export: it is held, then
    /// dropped by its caller).
    pub(super) fn finished(&self, usage: Usage) {
        if let Output::Tokens(tx) = &self.output {
            emit(tx, GenEvent::Finished(usage));
        }
    }

    /// The sender of an export's layer events (`None` for a generation).
    pub(super) fn layers(&self) -> Option<&Tx<ExportEvent>> {
        match &self.output {
            Output::Export(tx) => Some(tx),
            Output::Tokens(_) | Output::Hold(_) => None,
        }
    }

    /// Reports that an export's prompt is computed and its blocks held.
    pub(super) fn exported(&self, exported: Exported) {
        if let Output::Export(tx) = &self.output {
            emit(tx, ExportEvent::Exported(exported));
        }
    }

    /// Sends an import its destination blocks.
    pub(super) fn slot(&mut self, slot: ImportSlot) {
        if let Some(tx) = self.import.take() {
            emit(&tx, Ok(slot));
        }
    }

    /// Ends the request with `failure`: where an import waits for its
    /// blocks, there; otherwise on its events.
    pub(super) fn fail(&mut self, failure: GenFailure) {
        if let Some(tx) = self.import.take() {
            emit(&tx, Err(failure));
            return;
        }
        match &self.output {
            Output::Tokens(tx) => emit(tx, GenEvent::Failed(failure)),
            Output::Export(tx) => emit(tx, ExportEvent::Failed(failure)),
            Output::Hold(tx) => emit(tx, Err(failure)),
        }
    }
}

/// Sends layer `layer` of `blocks` to an export's caller.
pub(super) fn layer_done(tx: &Tx<ExportEvent>, layer: LayerDone) {
    emit(tx, ExportEvent::LayerDone(layer));
}

/// The caller's half of a channel of `E`s.
#[derive(Debug)]
pub(super) struct Events<E> {
    rx: tmpsc::UnboundedReceiver<(Instant, E)>,
}

impl<E> Events<E> {
    async fn recv(&mut self) -> Option<E> {
        let ev = self.rx.recv().await;
        Self::taken(ev)
    }

    fn blocking_recv(&mut self) -> Option<E> {
        let ev = self.rx.blocking_recv();
        Self::taken(ev)
    }

    fn taken(ev: Option<(Instant, E)>) -> Option<E> {
        ev.map(|(sent, e)| {
            egress::taken(sent);
            e
        })
    }
}

impl<E> Drop for Events<E> {
    fn drop(&mut self) {
        // Events never read are no longer buffered.
        self.rx.close();
        let mut unread = 0usize;
        while self.rx.try_recv().is_ok() {
            unread += 1;
        }
        egress::discarded(unread);
    }
}

/// A request's identity with the actor: cancels it when dropped before it
/// ended.
#[derive(Debug)]
pub(super) struct Ticket {
    pub(super) id: u64,
    /// Prompt tokens served from the prefix cache, known at admission.
    pub(super) cached: Arc<AtomicUsize>,
    pub(super) tx: mpsc::Sender<Command>,
    /// The request ended (or the actor is gone): nothing to cancel.
    pub(super) done: bool,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if !self.done {
            // The scheduler may already be gone; then there is nothing to free.
            let _ = self.tx.send(Command::Cancel(self.id));
        }
    }
}

/// The tokens of a generation, then exactly one `Finished` or `Failed`.
/// Dropping it cancels the request.
#[derive(Debug)]
pub struct GenerateStream {
    pub(super) events: Events<GenEvent>,
    pub(super) ticket: Ticket,
}

impl GenerateStream {
    /// The next event; `None` after `Finished`/`Failed` or if the scheduler stopped.
    pub async fn next(&mut self) -> Option<GenEvent> {
        let ev = self.events.recv().await;
        self.note(ev)
    }

    /// Blocking variant of [`GenerateStream::next`] for synchronous callers.
    pub fn blocking_next(&mut self) -> Option<GenEvent> {
        let ev = self.events.blocking_recv();
        self.note(ev)
    }

    /// Prompt tokens found in the prefix cache (0 until admitted): lets a
    /// caller that stops reading early still report them.
    pub fn cached_tokens(&self) -> usize {
        self.ticket.cached.load(Ordering::Relaxed)
    }

    fn note(&mut self, ev: Option<GenEvent>) -> Option<GenEvent> {
        if matches!(ev, None | Some(GenEvent::Finished(_) | GenEvent::Failed(_))) {
            self.ticket.done = true;
        }
        ev
    }
}

/// The events of an export: layers as they are written, then `Exported`
/// (the blocks are held until this stream is dropped), or `Failed`.
#[derive(Debug)]
pub struct ExportStream {
    pub(super) events: Events<ExportEvent>,
    pub(super) ticket: Ticket,
}

impl ExportStream {
    /// The next event; `None` after `Failed`, if the scheduler stopped, or
    /// (never, in practice) after `Exported`.
    pub async fn next(&mut self) -> Option<ExportEvent> {
        let ev = self.events.recv().await;
        self.note(ev)
    }

    /// Blocking variant of [`ExportStream::next`] for synchronous callers.
    pub fn blocking_next(&mut self) -> Option<ExportEvent> {
        let ev = self.events.blocking_recv();
        self.note(ev)
    }

    fn note(&mut self, ev: Option<ExportEvent>) -> Option<ExportEvent> {
        // After `Exported` the blocks stay held: dropping the stream
        // releases them.
        if matches!(ev, None | Some(ExportEvent::Failed(_))) {
            self.ticket.done = true;
        }
        ev
    }
}

/// A hold on a prompt's cached leading blocks ([`SchedulerHandle::hold_prefix`]):
/// they stay pinned, unchanged, until this is dropped.
///
/// [`SchedulerHandle::hold_prefix`]: super::SchedulerHandle::hold_prefix
#[derive(Debug)]
pub struct HoldStream {
    pub(super) events: Events<Result<Vec<BlockId>, GenFailure>>,
    pub(super) ticket: Ticket,
}

impl HoldStream {
    /// The held blocks, in prompt order (possibly none); `Err` if the
    /// hold failed; `None` if the scheduler stopped.
    pub async fn blocks(&mut self) -> Option<Result<Vec<BlockId>, GenFailure>> {
        let ev = self.events.recv().await;
        self.note(ev)
    }

    /// Blocking variant of [`HoldStream::blocks`] for synchronous callers.
    pub fn blocking_blocks(&mut self) -> Option<Result<Vec<BlockId>, GenFailure>> {
        let ev = self.events.blocking_recv();
        self.note(ev)
    }

    fn note(
        &mut self,
        ev: Option<Result<Vec<BlockId>, GenFailure>>,
    ) -> Option<Result<Vec<BlockId>, GenFailure>> {
        // Held blocks stay pinned: dropping the stream releases them.
        if !matches!(ev, Some(Ok(_))) {
            self.ticket.done = true;
        }
        ev
    }
}

/// An import: first its destination blocks ([`ImportStream::slot`]), then,
/// once the caller says how the KV arrived ([`ImportStream::complete`]),
/// the generation's tokens. Dropping it cancels the request.
#[derive(Debug)]
pub struct ImportStream {
    pub(super) slot: Events<Result<ImportSlot, GenFailure>>,
    pub(super) tokens: Events<GenEvent>,
    pub(super) ticket: Ticket,
}

impl ImportStream {
    /// The destination blocks, once reserved; `Err` if the request failed
    /// first; `None` if the scheduler stopped.
    pub async fn slot(&mut self) -> Option<Result<ImportSlot, GenFailure>> {
        let slot = self.slot.recv().await;
        self.note(slot)
    }

    /// Blocking variant of [`ImportStream::slot`] for synchronous callers.
    pub fn blocking_slot(&mut self) -> Option<Result<ImportSlot, GenFailure>> {
        let slot = self.slot.blocking_recv();
        self.note(slot)
    }

    /// Ends the wait after [`ImportStream::slot`]: the prompt's KV is in
    /// place, or is to be computed here. Its tokens follow on the returned
    /// stream.
    pub fn complete(self, outcome: ImportOutcome) -> GenerateStream {
        let t = &self.ticket;
        // Ignored by the actor if the request is gone.
        let _ = t.tx.send(Command::ImportDone(t.id, Box::new(outcome)));
        GenerateStream {
            events: self.tokens,
            ticket: self.ticket,
        }
    }

    fn note(
        &mut self,
        slot: Option<Result<ImportSlot, GenFailure>>,
    ) -> Option<Result<ImportSlot, GenFailure>> {
        if !matches!(slot, Some(Ok(_))) {
            self.ticket.done = true;
        }
        slot
    }
}
