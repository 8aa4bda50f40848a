//! The host tier: blocks evicted from the engine's pool, kept in host
//! memory up to a byte budget, least recently used out first (to the disk
//! tier when there is one). Owned by the scheduler's thread: no locks.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use tandem_types::block_hash::BlockHash;

/// A block's bytes: every layer of every tensor-parallel rank's share.
pub type BlockBytes = Arc<[u8]>;

#[derive(Debug)]
pub struct HostTier {
    capacity: u64,
    used: u64,
    entries: HashMap<BlockHash, Entry>,
    /// Entries by last use.
    lru: BTreeMap<u64, BlockHash>,
    tick: u64,
}

#[derive(Debug)]
struct Entry {
    bytes: BlockBytes,
    last_use: u64,
}

impl HostTier {
    pub fn new(capacity: u64) -> Self {
        Self {
            capacity,
            used: 0,
            entries: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
        }
    }

    pub fn used_bytes(&self) -> u64 {
        self.used
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn contains(&self, hash: BlockHash) -> bool {
        self.entries.contains_key(&hash)
    }

    /// The block's bytes, now the most recently used.
    pub fn get(&mut self, hash: BlockHash) -> Option<BlockBytes> {
        let e = self.entries.get_mut(&hash)?;
        self.lru.remove(&e.last_use);
        self.tick += 1;
        e.last_use = self.tick;
        self.lru.insert(self.tick, hash);
        Some(Arc::clone(&e.bytes))
    }

    /// Empties the tier; returns its blocks, least recently used first.
    pub fn take_all(&mut self) -> Vec<(BlockHash, BlockBytes)> {
        let lru = std::mem::take(&mut self.lru);
        let mut out = Vec::with_capacity(lru.len());
        for (_, h) in lru {
            if let Some(e) = self.entries.remove(&h) {
                out.push((h, e.bytes));
            }
        }
        self.used = 0;
        out
    }

    /// Keeps `bytes` as `hash` (most recently used), evicting the least
    /// recently used entries to make room; returns them, oldest first. A
    /// block larger than the whole tier is not kept (and is returned).
    pub fn insert(&mut self, hash: BlockHash, bytes: BlockBytes) -> Vec<(BlockHash, BlockBytes)> {
        if self.get(hash).is_some() {
            return Vec::new();
        }
        let size = bytes.len() as u64;
        if size > self.capacity {
            return vec![(hash, bytes)];
        }
        let mut evicted = Vec::new();
        while self.used + size > self.capacity {
            let Some((_, old)) = self.lru.pop_first() else {
                break;
            };
            if let Some(e) = self.entries.remove(&old) {
                self.used -= e.bytes.len() as u64;
                evicted.push((old, e.bytes));
            }
        }
        self.tick += 1;
        self.lru.insert(self.tick, hash);
        self.used += size;
        self.entries.insert(
            hash,
            Entry {
                bytes,
                last_use: self.tick,
            },
        );
        evicted
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn block(v: u8, n: usize) -> BlockBytes {
        vec![v; n].into()
    }

    #[test]
    fn least_recently_used_blocks_leave_first_within_the_budget() {
        let mut t = HostTier::new(30);
        assert!(t.insert(1, block(1, 10)).is_empty());
        assert!(t.insert(2, block(2, 10)).is_empty());
        assert!(t.insert(3, block(3, 10)).is_empty());
        assert_eq!(t.used_bytes(), 30);
        // 1 is used again, so 2 is now the oldest.
        assert_eq!(t.get(1).unwrap()[0], 1);
        let out = t.insert(4, block(4, 15));
        let hashes: Vec<_> = out.iter().map(|(h, b)| (*h, b[0])).collect();
        assert_eq!(hashes, [(2, 2), (3, 3)]);
        assert_eq!((t.used_bytes(), t.len()), (25, 2));
        assert!(t.contains(1) && t.contains(4) && !t.contains(2));
        let all: Vec<u64> = t.take_all().into_iter().map(|(h, _)| h).collect();
        assert_eq!(all, [1, 4]);
        assert!(t.is_empty() && t.used_bytes() == 0);
    }

    #[test]
    fn a_block_already_held_is_not_counted_twice() {
        let mut t = HostTier::new(20);
        t.insert(7, block(7, 10));
        assert!(t.insert(7, block(9, 10)).is_empty());
        assert_eq!((t.used_bytes(), t.get(7).unwrap()[0]), (10, 7));
    }

    #[test]
    fn a_block_larger_than_the_tier_is_handed_back() {
        let mut t = HostTier::new(8);
        let out = t.insert(5, block(5, 9));
        assert_eq!(out.len(), 1);
        assert!(t.is_empty() && t.used_bytes() == 0);
    }
}
