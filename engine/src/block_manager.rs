//! Block ownership: a refcounting allocator plus a prefix cache of full,
//! immutable blocks keyed by chained block hashes.
//!
//! The cache holds one reference to every cached block. A cached block that
//! no sequence uses (refcount 1) is *evictable*: it stays reusable until an
//! allocation needs the space, then the least recently used one goes first.
//! Every change to the set of cached hashes is recorded as a [`KvEvent`]
//! with a monotonic id, for KV-aware routers.

use std::collections::{BTreeMap, HashMap};

use crate::block_allocator::{BlockAllocator, BlockId, KvCacheError};

pub use tandem_types::block_hash::{BlockHash, block_hashes, chain_hash};

/// Where a node keeps a block it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvTier {
    /// The engine's KV pool (what a step reads).
    Pool,
    /// Host memory below the pool (`--kv-connector-config`).
    Host,
    /// Files under the disk offload directory.
    Disk,
}

/// A change to the set of blocks a node holds.
///
/// A block's events, in order: `Stored` when it enters the pool (computed,
/// or brought back from a tier: `Stored` always means the pool), `Moved`
/// to `Host` or `Disk` when the pool evicted it into a tier or a tier moved
/// it down (one `Moved` per publication, naming where it is then: moves in
/// between are not reported), and `Removed` once it left every tier. A
/// restarted node announces its disk as `Stored` then `Moved` to `Disk`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEventKind {
    Stored {
        parent: Option<BlockHash>,
        hashes: Vec<BlockHash>,
    },
    Removed {
        hashes: Vec<BlockHash>,
    },
    /// Blocks this node still holds, now (only) below the pool, in `tier`.
    Moved {
        hashes: Vec<BlockHash>,
        tier: KvTier,
    },
    Cleared,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEvent {
    /// Monotonic per worker; a gap tells the consumer to resynchronise.
    pub id: u64,
    pub kind: KvEventKind,
}

/// Allocation with prefix caching.
#[derive(Debug)]
pub struct BlockManager {
    alloc: BlockAllocator,
    caching: bool,
    by_hash: HashMap<BlockHash, BlockId>,
    hash_of: HashMap<BlockId, BlockHash>,
    /// Evictable cached blocks by last use.
    lru: BTreeMap<u64, BlockId>,
    last_use: HashMap<BlockId, u64>,
    tick: u64,
    next_event: u64,
    events: Vec<KvEvent>,
    /// Whether evicted cached blocks are remembered for a tier below the
    /// pool (see [`BlockManager::take_evicted`]).
    keep_evicted: bool,
    evicted: Vec<(BlockHash, BlockId)>,
}

impl BlockManager {
    pub fn new(num_blocks: usize, caching: bool) -> Self {
        Self {
            alloc: BlockAllocator::new(num_blocks),
            caching,
            by_hash: HashMap::new(),
            hash_of: HashMap::new(),
            lru: BTreeMap::new(),
            last_use: HashMap::new(),
            tick: 0,
            next_event: 1,
            events: Vec::new(),
            keep_evicted: false,
            evicted: Vec::new(),
        }
    }

    /// Remembers the blocks each allocation evicts from the cache, with
    /// their hashes, until [`BlockManager::take_evicted`]: their bytes stay
    /// in the pool until the new owner writes them, so a tier below the
    /// pool can copy them out first.
    pub fn keep_evicted(&mut self) {
        self.keep_evicted = true;
    }

    /// Cached blocks evicted (and reallocated) since the last call, whose
    /// pool bytes are still the cached block's. Their `Removed` event is
    /// the caller's to emit ([`BlockManager::removed`]).
    pub fn take_evicted(&mut self) -> Vec<(BlockHash, BlockId)> {
        std::mem::take(&mut self.evicted)
    }

    /// Whether the pool holds the block `hash`.
    pub fn is_cached(&self, hash: BlockHash) -> bool {
        self.by_hash.contains_key(&hash)
    }

    /// Tells the event consumers that these blocks (held elsewhere than the
    /// pool, e.g. a KV tier) are gone from this node.
    pub fn removed(&mut self, hashes: Vec<BlockHash>) {
        if !hashes.is_empty() {
            self.emit(KvEventKind::Removed { hashes });
        }
    }

    /// Tells the event consumers that these blocks, no longer in the pool,
    /// are held in `tier` (the pool evicted them into it, or a tier moved
    /// them down).
    pub fn moved(&mut self, hashes: Vec<BlockHash>, tier: KvTier) {
        if !hashes.is_empty() {
            self.emit(KvEventKind::Moved { hashes, tier });
        }
    }

    /// Tells the event consumers that this node holds these blocks on disk
    /// (a restarted node's disk tier): `Stored`, then `Moved` to `Disk`.
    pub fn announce(&mut self, hashes: Vec<BlockHash>) {
        if !hashes.is_empty() {
            self.emit(KvEventKind::Stored {
                parent: None,
                hashes: hashes.clone(),
            });
            self.moved(hashes, KvTier::Disk);
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.alloc.num_blocks()
    }

    /// Blocks an allocation can get right now (free plus evictable).
    pub fn num_available(&self) -> usize {
        self.alloc.num_free() + self.lru.len()
    }

    /// Blocks on the free list (never used, or evicted).
    pub fn num_free(&self) -> usize {
        self.alloc.num_free()
    }

    /// Blocks held by sequences (not counting evictable cached ones).
    pub fn num_in_use(&self) -> usize {
        self.num_blocks() - self.num_available()
    }

    /// Cached blocks (in use or evictable).
    pub fn num_cached(&self) -> usize {
        self.by_hash.len()
    }

    pub fn refcount(&self, block: BlockId) -> u32 {
        self.alloc.refcount(block)
    }

    /// Allocates `n` fresh blocks, evicting least recently used cached
    /// blocks if the free list is short. All or nothing.
    pub fn allocate(&mut self, n: usize) -> Result<Vec<BlockId>, KvCacheError> {
        if n > self.num_available() {
            return Err(KvCacheError::OutOfBlocks {
                needed: n,
                free: self.num_available(),
            });
        }
        let mut evicted = Vec::new();
        while self.alloc.num_free() < n {
            let Some((_, block)) = self.lru.pop_first() else {
                break;
            };
            self.last_use.remove(&block);
            if let Some(h) = self.hash_of.remove(&block) {
                self.by_hash.remove(&h);
                evicted.push(h);
                if self.keep_evicted {
                    self.evicted.push((h, block));
                }
            }
            self.alloc.release(block)?;
        }
        // With a tier below, the owner of the evicted blocks says which are
        // gone (`removed`): the ones a tier keeps are still this node's.
        if !evicted.is_empty() && !self.keep_evicted {
            self.emit(KvEventKind::Removed { hashes: evicted });
        }
        self.alloc.allocate(n)
    }

    /// Longest cached prefix of `hashes`: the matching blocks, each retained
    /// for the caller (release them like any other block).
    pub fn match_prefix(&mut self, hashes: &[BlockHash]) -> Vec<BlockId> {
        if !self.caching {
            return Vec::new();
        }
        let mut out = Vec::new();
        for h in hashes {
            let Some(&block) = self.by_hash.get(h) else {
                break;
            };
            if let Some(t) = self.last_use.remove(&block) {
                self.lru.remove(&t);
            }
            // A cached block is always allocated (the cache holds a reference).
            if self.alloc.retain(block).is_err() {
                break;
            }
            out.push(block);
        }
        out
    }

    /// Records that `block` (owned by the caller) now holds the full block
    /// with hash `hash`, child of `parent`. If that hash is already cached by
    /// another block, nothing changes (the caller keeps its own copy).
    pub fn register(
        &mut self,
        block: BlockId,
        hash: BlockHash,
        parent: Option<BlockHash>,
    ) -> Result<(), KvCacheError> {
        if !self.caching || self.by_hash.contains_key(&hash) || self.hash_of.contains_key(&block) {
            return Ok(());
        }
        self.alloc.retain(block)?;
        self.by_hash.insert(hash, block);
        self.hash_of.insert(block, hash);
        self.emit(KvEventKind::Stored {
            parent,
            hashes: vec![hash],
        });
        Ok(())
    }

    /// Drops the caller's references to `blocks` (emptying the vector).
    /// Cached blocks whose only remaining reference is the cache's become
    /// evictable.
    pub fn release(&mut self, blocks: &mut Vec<BlockId>) -> Result<(), KvCacheError> {
        for b in blocks.drain(..) {
            self.alloc.release(b)?;
            if self.alloc.refcount(b) == 1 && self.hash_of.contains_key(&b) {
                self.tick += 1;
                self.lru.insert(self.tick, b);
                self.last_use.insert(b, self.tick);
            }
        }
        Ok(())
    }

    /// Forgets every evictable cached block (in-use ones stay cached).
    pub fn clear_cache(&mut self) -> Result<(), KvCacheError> {
        while let Some((_, block)) = self.lru.pop_first() {
            self.last_use.remove(&block);
            if let Some(h) = self.hash_of.remove(&block) {
                self.by_hash.remove(&h);
            }
            self.alloc.release(block)?;
        }
        self.emit(KvEventKind::Cleared);
        Ok(())
    }

    /// Events since the last call.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    fn emit(&mut self, kind: KvEventKind) {
        self.events.push(KvEvent {
            id: self.next_event,
            kind,
        });
        self.next_event += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn hashes_chain_and_ignore_partial_blocks() {
        let a = block_hashes(&[1, 2, 3, 4, 5], 2);
        assert_eq!(a.len(), 2);
        let b = block_hashes(&[1, 2, 3, 4], 2);
        assert_eq!(a, b);
        // Same second block after a different first block: different hash.
        let c = block_hashes(&[9, 9, 3, 4], 2);
        assert_ne!(a[1], c[1]);
        assert!(block_hashes(&[1], 2).is_empty());
    }

    #[test]
    fn evicted_blocks_are_remembered_only_when_asked() {
        let h = block_hashes(&[1, 2, 3, 4], 2);
        for keep in [false, true] {
            let mut m = BlockManager::new(2, true);
            if keep {
                m.keep_evicted();
            }
            let mut seq = m.allocate(2).expect("space");
            let blocks = seq.clone();
            m.register(seq[0], h[0], None).expect("owned");
            m.register(seq[1], h[1], Some(h[0])).expect("owned");
            m.release(&mut seq).expect("held");
            assert!(m.take_evicted().is_empty());
            // The oldest (h[0]) goes first, and its block is the one handed out.
            let mut fresh = m.allocate(1).expect("evicts");
            let want = if keep {
                vec![(h[0], blocks[0])]
            } else {
                vec![]
            };
            assert_eq!(m.take_evicted(), want);
            assert_eq!(fresh, [blocks[0]]);
            assert!(m.take_evicted().is_empty());
            m.release(&mut fresh).expect("held");
        }
    }

    #[test]
    fn cached_prefix_is_shared_then_evicted_lru() {
        let mut m = BlockManager::new(4, true);
        let h = block_hashes(&[1, 2, 3, 4, 5, 6], 2);
        let mut seq = m.allocate(3).expect("space");
        for (i, (&b, &hash)) in seq.iter().zip(&h).enumerate() {
            m.register(b, hash, i.checked_sub(1).map(|p| h[p]))
                .expect("owned");
        }
        m.release(&mut seq).expect("held");
        assert_eq!(m.num_available(), 4);
        assert_eq!(m.num_cached(), 3);
        // A second sequence with the same first two blocks reuses them.
        let mut hit = m.match_prefix(&h[..2]);
        assert_eq!(hit.len(), 2);
        assert_eq!(m.num_available(), 2);
        // Allocating 2 evicts only the unused cached block (h[2]) and the free one.
        let mut fresh = m.allocate(2).expect("evicts");
        assert_eq!(m.num_cached(), 2);
        let events = m.take_events();
        assert!(
            matches!(&events.last().expect("event").kind, KvEventKind::Removed { hashes } if hashes == &vec![h[2]])
        );
        assert!(events.windows(2).all(|w| w[1].id == w[0].id + 1));
        assert!(m.allocate(1).is_err());
        m.release(&mut hit).expect("held");
        m.release(&mut fresh).expect("held");
        m.clear_cache().expect("clear");
        assert_eq!(m.num_free(), 4);
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// A sequence with this many blocks drawn from a small token alphabet.
        Admit(Vec<u8>),
        Finish(usize),
        Clear,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => proptest::collection::vec(0u8..3, 0..5).prop_map(Op::Admit),
            3 => (0usize..16).prop_map(Op::Finish),
            1 => Just(Op::Clear),
        ]
    }

    proptest! {
        /// Whatever sequences come and go, refcounts equal the references
        /// held (sequences + cache), no block is freed twice, every cached
        /// hash maps to a block holding exactly that hash, and once all
        /// sequences finish and the cache is cleared every block is free.
        #[test]
        fn blocks_balance_under_any_workload(ops in proptest::collection::vec(op(), 0..120)) {
            const N: usize = 12;
            let mut m = BlockManager::new(N, true);
            let mut seqs: Vec<Vec<BlockId>> = Vec::new();
            for op in ops {
                match op {
                    Op::Admit(blocks) => {
                        let tokens: Vec<u32> = blocks.iter().map(|&b| u32::from(b)).collect();
                        let hashes = block_hashes(&tokens, 1);
                        let mut table = m.match_prefix(&hashes);
                        let hit = table.len();
                        match m.allocate(hashes.len() - hit) {
                            Ok(new) => {
                                table.extend(new);
                                for i in hit..hashes.len() {
                                    let parent = i.checked_sub(1).map(|p| hashes[p]);
                                    m.register(table[i], hashes[i], parent).expect("owned");
                                }
                                seqs.push(table);
                            }
                            Err(_) => m.release(&mut table).expect("held"),
                        }
                    }
                    Op::Finish(i) if !seqs.is_empty() => {
                        let mut t = seqs.swap_remove(i % seqs.len());
                        m.release(&mut t).expect("held");
                    }
                    Op::Clear => m.clear_cache().expect("clear"),
                    _ => {}
                }
                for b in 0..N as BlockId {
                    let held = seqs.iter().flatten().filter(|&&x| x == b).count() as u32;
                    let cached = u32::from(m.hash_of.contains_key(&b));
                    prop_assert_eq!(m.refcount(b), held + cached);
                }
                for (h, b) in &m.by_hash {
                    prop_assert_eq!(m.hash_of.get(b), Some(h));
                }
                prop_assert_eq!(m.lru.len(), m.last_use.len());
            }
            for mut t in seqs.drain(..) {
                m.release(&mut t).expect("held");
            }
            m.clear_cache().expect("clear");
            prop_assert_eq!(m.num_free(), N);
        }
    }
}
