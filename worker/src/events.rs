//! Prefix-cache events and load, kept for routers.
//!
//! The scheduler pushes every batch of cache events here (through its
//! event sink). A bounded ring keeps recent ones so that a router that
//! reconnects with the id of the last event it saw gets exactly what it
//! missed; if that is older than the ring, it gets `cleared` first and
//! rebuilds its view from what follows.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};

use tandem_engine::block_manager::{KvEvent, KvEventKind, KvTier};
use tandem_engine::scheduler::KvEventSink;
use tandem_proto::pb;
use tokio::sync::broadcast;

/// Shared between the scheduler's sink and the gRPC event streams.
#[derive(Debug)]
pub struct EventHub {
    ring: Mutex<Ring>,
    live: broadcast::Sender<Arc<pb::WorkerEvent>>,
}

#[derive(Debug)]
struct Ring {
    events: VecDeque<Arc<pb::WorkerEvent>>,
    capacity: usize,
    last_id: u64,
}

/// What a new subscriber gets: the events it missed, then live ones.
#[derive(Debug)]
pub struct Subscription {
    pub backlog: Vec<Arc<pb::WorkerEvent>>,
    pub live: broadcast::Receiver<Arc<pb::WorkerEvent>>,
}

fn to_pb(e: KvEvent) -> pb::WorkerEvent {
    use pb::worker_event::Kind;
    let kind = match e.kind {
        KvEventKind::Stored { parent, hashes } => Kind::Stored(pb::BlockStored { parent, hashes }),
        KvEventKind::Removed { hashes } => Kind::Removed(pb::BlockRemoved { hashes }),
        KvEventKind::Moved { hashes, tier } => Kind::Moved(pb::BlockMoved {
            hashes,
            tier: tier_to_pb(tier) as i32,
        }),
        KvEventKind::Cleared => Kind::Cleared(pb::CacheCleared {}),
    };
    pb::WorkerEvent {
        event_id: e.id,
        kind: Some(kind),
        emitted_unix_us: tandem_types::clock::unix_micros(),
    }
}

fn tier_to_pb(t: KvTier) -> pb::KvTier {
    match t {
        KvTier::Pool => pb::KvTier::Pool,
        KvTier::Host => pb::KvTier::Host,
        KvTier::Disk => pb::KvTier::Disk,
    }
}

/// Most live messages a subscriber may fall behind before its stream ends
/// (it then reconnects and replays from the ring).
const LIVE_DEPTH: usize = 4096;

impl EventHub {
    /// A hub keeping the last `capacity` events; the live channel is no
    /// deeper (up to [`LIVE_DEPTH`]), so that what a node holds for
    /// routers, ring and channel, is bounded by `capacity`.
    pub fn new(capacity: usize) -> Arc<Self> {
        let (live, _) = broadcast::channel(capacity.clamp(1, LIVE_DEPTH));
        Arc::new(Self {
            ring: Mutex::new(Ring {
                events: VecDeque::new(),
                capacity: capacity.max(1),
                last_id: 0,
            }),
            live,
        })
    }

    /// The scheduler's sink feeding this hub.
    pub fn sink(self: &Arc<Self>) -> KvEventSink {
        let hub = Arc::clone(self);
        Box::new(move |events| hub.push(events))
    }

    pub fn push(&self, events: Vec<KvEvent>) {
        let mut ring = self.ring.lock().unwrap_or_else(PoisonError::into_inner);
        for e in events {
            let e = Arc::new(to_pb(e));
            ring.last_id = e.event_id;
            if ring.events.len() == ring.capacity {
                ring.events.pop_front();
            }
            ring.events.push_back(Arc::clone(&e));
            // No receivers is fine: nobody is routing on us right now.
            let _ = self.live.send(e);
        }
    }

    /// Broadcasts a load update (not kept: only the latest matters).
    pub fn push_load(&self, load: pb::Load) {
        let last_id = self.last_id();
        let _ = self.live.send(Arc::new(pb::WorkerEvent {
            event_id: last_id,
            kind: Some(pb::worker_event::Kind::Load(load)),
            emitted_unix_us: 0,
        }));
    }

    pub fn last_id(&self) -> u64 {
        self.ring
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .last_id
    }

    /// Events after `after` (0: everything kept), then live ones. Taken
    /// under the ring's lock so nothing falls between backlog and live.
    pub fn subscribe(&self, after: u64) -> Subscription {
        let ring = self.ring.lock().unwrap_or_else(PoisonError::into_inner);
        let live = self.live.subscribe();
        let oldest = ring.events.front().map_or(ring.last_id + 1, |e| e.event_id);
        let mut backlog = Vec::new();
        if after + 1 < oldest && after != ring.last_id {
            // The subscriber missed events we no longer have.
            backlog.push(Arc::new(pb::WorkerEvent {
                event_id: oldest.saturating_sub(1),
                kind: Some(pb::worker_event::Kind::Cleared(pb::CacheCleared {})),
                emitted_unix_us: 0,
            }));
        }
        backlog.extend(ring.events.iter().filter(|e| e.event_id > after).cloned());
        Subscription { backlog, live }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(id: u64, h: u64) -> KvEvent {
        KvEvent {
            id,
            kind: KvEventKind::Stored {
                parent: None,
                hashes: vec![h],
            },
        }
    }

    fn ids(s: &Subscription) -> Vec<u64> {
        s.backlog.iter().map(|e| e.event_id).collect()
    }

    /// Each tier reaches the wire as its own `KvTier`, the hashes and id
    /// unchanged.
    #[test]
    fn moves_reach_the_wire_with_their_tier() {
        for (tier, want) in [
            (KvTier::Pool, pb::KvTier::Pool),
            (KvTier::Host, pb::KvTier::Host),
            (KvTier::Disk, pb::KvTier::Disk),
        ] {
            let e = to_pb(KvEvent {
                id: 9,
                kind: KvEventKind::Moved {
                    hashes: vec![3, 4],
                    tier,
                },
            });
            assert_eq!(e.event_id, 9);
            assert_eq!(
                e.kind,
                Some(pb::worker_event::Kind::Moved(pb::BlockMoved {
                    hashes: vec![3, 4],
                    tier: want as i32,
                }))
            );
        }
    }

    #[test]
    fn replay_from_an_id_and_gap_beyond_the_ring() {
        let hub = EventHub::new(3);
        hub.push((1..=5).map(|i| stored(i, i * 10)).collect());
        assert_eq!(hub.last_id(), 5);
        // Caught up to 4: gets only 5.
        assert_eq!(ids(&hub.subscribe(4)), vec![5]);
        // Up to date: nothing.
        assert!(hub.subscribe(5).backlog.is_empty());
        // Saw up to 1, but 2 fell out of the ring: cleared, then 3..=5.
        let s = hub.subscribe(1);
        assert!(matches!(
            s.backlog[0].kind,
            Some(pb::worker_event::Kind::Cleared(_))
        ));
        assert_eq!(ids(&s)[1..], [3, 4, 5]);
    }

    #[tokio::test]
    async fn live_events_follow_the_backlog() {
        let hub = EventHub::new(16);
        hub.push(vec![stored(1, 10)]);
        let mut s = hub.subscribe(0);
        assert_eq!(ids(&s), vec![1]);
        hub.push(vec![stored(2, 20)]);
        hub.push_load(pb::Load {
            waiting: 1,
            ..Default::default()
        });
        let e = s.live.recv().await.expect("live event");
        assert_eq!(e.event_id, 2);
        let l = s.live.recv().await.expect("load");
        assert!(matches!(l.kind, Some(pb::worker_event::Kind::Load(_))));
    }
}
