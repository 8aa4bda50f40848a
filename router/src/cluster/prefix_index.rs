//! Each worker's prefix index (the hashes of the blocks its prefix cache
//! holds) and load, kept from its events; the overlap a prompt has with it.

use std::collections::HashSet;
use std::sync::PoisonError;
use std::sync::atomic::Ordering;

use tandem_proto::pb;
use tandem_types::BlockHash;

use super::{Worker, metrics};

impl Worker {
    /// Leading blocks of `hashes` this worker has cached.
    pub(super) fn overlap(&self, hashes: &[BlockHash]) -> usize {
        let cached = self.cached.lock().unwrap_or_else(PoisonError::into_inner);
        hashes.iter().take_while(|h| cached.contains(h)).count()
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
            Kind::Stored(s) => cached.extend(s.hashes.iter().copied()),
            Kind::Removed(r) => {
                for h in &r.hashes {
                    cached.remove(h);
                }
            }
            Kind::Load(_) | Kind::Moved(_) => {}
        }
        m.index_blocks.add(cached.len() as i64 - len0 as i64, &[]);
        m.index_bytes
            .add(index_bytes(&cached) as i64 - bytes0 as i64, &[]);
        self.last_event.store(e.event_id, Ordering::Relaxed);
        true
    }
}

/// A hash set's table: a hash and a control byte per slot.
pub(super) fn index_bytes(set: &HashSet<BlockHash>) -> usize {
    set.capacity() * (std::mem::size_of::<BlockHash>() + 1)
}
