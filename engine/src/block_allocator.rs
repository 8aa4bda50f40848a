//! Block ids and the refcounting block allocator of a paged KV pool, with
//! the error of KV cache operations. A leaf module: the pool (`kv_cache`)
//! and block ownership with prefix caching (`block_manager`) both build on
//! it.

/// Index of a block in the cache pool.
pub type BlockId = u32;

/// Why a KV cache operation was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KvCacheError {
    #[error("KV cache config invalid: {0}")]
    InvalidConfig(&'static str),
    #[error("KV cache exhausted: need {needed} blocks, {free} free")]
    OutOfBlocks { needed: usize, free: usize },
    #[error("block {0} is not allocated")]
    NotAllocated(BlockId),
    #[error("block {block} out of range (pool has {num_blocks})")]
    OutOfRange { block: BlockId, num_blocks: usize },
}

/// Hands out blocks and counts references to them. A block returns to the
/// free list when its last reference is released.
#[derive(Debug, Clone)]
pub struct BlockAllocator {
    free: Vec<BlockId>,
    refcount: Vec<u32>,
}

impl BlockAllocator {
    pub fn new(num_blocks: usize) -> Self {
        // Reverse so that block 0 is handed out first.
        let free = (0..num_blocks as BlockId).rev().collect();
        Self {
            free,
            refcount: vec![0; num_blocks],
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.refcount.len()
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    pub fn num_used(&self) -> usize {
        self.num_blocks() - self.num_free()
    }

    pub fn refcount(&self, block: BlockId) -> u32 {
        self.refcount.get(block as usize).copied().unwrap_or(0)
    }

    /// Allocates `n` blocks with refcount 1, all or nothing.
    pub fn allocate(&mut self, n: usize) -> Result<Vec<BlockId>, KvCacheError> {
        if n > self.free.len() {
            return Err(KvCacheError::OutOfBlocks {
                needed: n,
                free: self.free.len(),
            });
        }
        let blocks = self.free.split_off(self.free.len() - n);
        for &b in &blocks {
            self.refcount[b as usize] = 1;
        }
        Ok(blocks)
    }

    /// Adds a reference to an allocated block (sharing it).
    pub fn retain(&mut self, block: BlockId) -> Result<(), KvCacheError> {
        let rc = self.slot(block)?;
        if *rc == 0 {
            return Err(KvCacheError::NotAllocated(block));
        }
        *rc += 1;
        Ok(())
    }

    /// Drops a reference; returns true if the block became free.
    pub fn release(&mut self, block: BlockId) -> Result<bool, KvCacheError> {
        let rc = self.slot(block)?;
        if *rc == 0 {
            return Err(KvCacheError::NotAllocated(block));
        }
        *rc -= 1;
        let freed = *rc == 0;
        if freed {
            self.free.push(block);
        }
        Ok(freed)
    }

    /// Releases every block of a table, leaving it empty.
    pub fn release_all(&mut self, blocks: &mut Vec<BlockId>) -> Result<(), KvCacheError> {
        for b in blocks.drain(..) {
            self.release(b)?;
        }
        Ok(())
    }

    fn slot(&mut self, block: BlockId) -> Result<&mut u32, KvCacheError> {
        let num_blocks = self.refcount.len();
        self.refcount
            .get_mut(block as usize)
            .ok_or(KvCacheError::OutOfRange { block, num_blocks })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn allocation_is_all_or_nothing() {
        let mut a = BlockAllocator::new(3);
        let got = a.allocate(2).expect("fits");
        assert_eq!(
            a.allocate(2),
            Err(KvCacheError::OutOfBlocks { needed: 2, free: 1 })
        );
        assert_eq!(a.num_free(), 1);
        for b in got {
            assert!(a.release(b).expect("allocated"));
        }
        assert_eq!(a.num_free(), 3);
        assert_eq!(a.release(0), Err(KvCacheError::NotAllocated(0)));
        assert!(matches!(a.retain(7), Err(KvCacheError::OutOfRange { .. })));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(usize),
        Share(usize),
        Free(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0usize..4).prop_map(Op::Alloc),
            (0usize..64).prop_map(Op::Share),
            (0usize..64).prop_map(Op::Free),
        ]
    }

    proptest! {
        /// Any interleaving of allocate / share / free keeps refcounts equal
        /// to the references held, never double-frees, and returns every
        /// block once all references are dropped.
        #[test]
        fn refcounts_balance(ops in proptest::collection::vec(op(), 0..200)) {
            const N: usize = 16;
            let mut a = BlockAllocator::new(N);
            let mut held: Vec<BlockId> = Vec::new();
            for op in ops {
                match op {
                    Op::Alloc(n) => {
                        let before = a.num_free();
                        match a.allocate(n) {
                            Ok(bs) => { prop_assert_eq!(bs.len(), n); held.extend(bs); }
                            Err(_) => prop_assert!(n > before),
                        }
                    }
                    Op::Share(i) if !held.is_empty() => {
                        let b = held[i % held.len()];
                        a.retain(b).expect("held block is allocated");
                        held.push(b);
                    }
                    Op::Free(i) if !held.is_empty() => {
                        let b = held.swap_remove(i % held.len());
                        let freed = a.release(b).expect("held block is allocated");
                        prop_assert_eq!(freed, !held.contains(&b));
                    }
                    _ => {}
                }
                for b in 0..N as BlockId {
                    let refs = held.iter().filter(|&&h| h == b).count() as u32;
                    prop_assert_eq!(a.refcount(b), refs);
                }
                let distinct: std::collections::HashSet<_> = held.iter().collect();
                prop_assert_eq!(a.num_used(), distinct.len());
            }
            a.release_all(&mut held).expect("all held");
            prop_assert_eq!(a.num_free(), N);
        }
    }
}
