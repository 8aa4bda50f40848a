//! Each worker's prefix index (the hashes of the blocks it holds, each
//! with the tier that holds it: its pool, host memory or disk) and load,
//! kept from its events; the overlap a prompt has with it.

use std::collections::HashMap;
use std::sync::PoisonError;
use std::sync::atomic::Ordering;

use tandem_proto::pb;
use tandem_types::BlockHash;

use super::{Worker, metrics};

/// Where a worker keeps a block it holds (its `KvTier`s, less
/// "unspecified").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(super) enum Tier {
    /// The engine's pool: a hit costs nothing to use.
    Pool,
    /// Host memory below the pool: copied back before use.
    Host,
    /// The disk offload directory: read, then copied back.
    Disk,
}

impl Tier {
    /// A `BlockMoved`'s tier; `None` for one this router does not know.
    fn from_pb(tier: i32) -> Option<Self> {
        match pb::KvTier::try_from(tier) {
            Ok(pb::KvTier::Pool) => Some(Tier::Pool),
            Ok(pb::KvTier::Host) => Some(Tier::Host),
            Ok(pb::KvTier::Disk) => Some(Tier::Disk),
            Ok(pb::KvTier::Unspecified) | Err(_) => None,
        }
    }
}

/// A worker's index: each block it holds and where.
pub(super) type Index = HashMap<BlockHash, Tier>;

/// The leading blocks of a prompt a worker holds, and how many of those
/// are below its pool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Overlap {
    /// Leading blocks held (in any tier).
    pub blocks: usize,
    /// Of those, blocks in host memory.
    pub host: usize,
    /// Of those, blocks on disk.
    pub disk: usize,
}

impl Worker {
    /// Leading blocks of `hashes` this worker holds, by tier.
    pub(super) fn overlap(&self, hashes: &[BlockHash]) -> Overlap {
        let cached = self.cached.lock().unwrap_or_else(PoisonError::into_inner);
        let mut o = Overlap::default();
        for h in hashes {
            match cached.get(h) {
                None => break,
                Some(Tier::Pool) => {}
                Some(Tier::Host) => o.host += 1,
                Some(Tier::Disk) => o.disk += 1,
            }
            o.blocks += 1;
        }
        o
    }

    /// Applies one event; returns false on a gap (the caller resubscribes).
    pub(super) fn apply(&self, e: &pb::WorkerEvent) -> bool {
        use pb::worker_event::Kind;
        let Some(kind) = &e.kind else { return true };
        if let Kind::Load(l) = kind {
            self.waiting.store(l.waiting as usize, Ordering::Relaxed);
            self.kv_blocks_used
                .store(l.kv_blocks_used as usize, Ordering::Relaxed);
            return true;
        }
        let last = self.last_event.load(Ordering::Relaxed);
        if e.event_id <= last {
            return true; // replayed twice
        }
        let mut cached = self.cached.lock().unwrap_or_else(PoisonError::into_inner);
        let (len0, bytes0) = (cached.len(), index_bytes(&cached));
        let m = metrics();
        if e.emitted_unix_us > 0 {
            let now = tandem_types::clock::unix_micros();
            m.event_lag
                .record(now.saturating_sub(e.emitted_unix_us) as f64 / 1e3, &[]);
        }
        match kind {
            Kind::Cleared(_) => cached.clear(),
            _ if last != 0 && e.event_id != last + 1 => return false,
            // `stored` blocks are in the pool (computed or brought back).
            Kind::Stored(s) => cached.extend(s.hashes.iter().map(|&h| (h, Tier::Pool))),
            Kind::Removed(r) => {
                for h in &r.hashes {
                    cached.remove(h);
                }
            }
            Kind::Moved(mv) => match Tier::from_pb(mv.tier) {
                Some(tier) => cached.extend(mv.hashes.iter().map(|&h| (h, tier))),
                // The blocks are still held; where is unknown, so what the
                // index says of them stands.
                None => {
                    tracing::debug!(worker = %self.record.id, tier = mv.tier, "a move to an unknown tier")
                }
            },
            Kind::Load(_) => {}
        }
        m.index_blocks.add(cached.len() as i64 - len0 as i64, &[]);
        m.index_bytes
            .add(index_bytes(&cached) as i64 - bytes0 as i64, &[]);
        self.last_event.store(e.event_id, Ordering::Relaxed);
        true
    }
}

/// A hash map's table: a (hash, tier) slot and a control byte per slot.
pub(super) fn index_bytes(index: &Index) -> usize {
    index.capacity() * (std::mem::size_of::<(BlockHash, Tier)>() + 1)
}
