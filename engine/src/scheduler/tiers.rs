//! Blocks between the pool and the KV tiers below it
//! (`--kv-connector-config`): a cached block the pool evicts is copied
//! down before its new owner writes it, and a prompt whose next blocks a
//! tier holds gets them copied back up, registered in the prefix cache as
//! if computed here. A block's bytes are every rank's share, so all of the
//! model's caches (every layer, sliding-window and global) move together.

use tandem_kvtier::{Found, Tier, TierBlock};

use super::actor::{Actor, Seq};
use crate::block_manager::{BlockHash, KvTier};
use crate::kv_cache::{BlockId, KvCacheError};

/// Disk reads a prompt waits for at most. Restoring a run can evict the
/// pool's copy of the prompt's later blocks (to disk, when host memory is
/// small), so a second read may be needed; the bound keeps a prompt from
/// chasing its own blocks forever.
const MAX_TIER_WAITS: u8 = 3;

impl Actor {
    /// Grows `table` to hold `tokens` tokens, first copying down any cached
    /// blocks the allocation evicted.
    pub(super) fn reserve(
        &mut self,
        table: &mut Vec<BlockId>,
        tokens: usize,
    ) -> Result<(), KvCacheError> {
        let reserved = self.cache.reserve(table, tokens);
        self.offload_evicted();
        reserved
    }

    /// Copies the blocks the pool just evicted (their bytes still in
    /// place) to the tiers, unless a tier holds them already. Either way
    /// their tier is announced by [`Actor::publish_tier_drops`].
    pub(super) fn offload_evicted(&mut self) {
        let evicted = self.cache.blocks_mut().take_evicted();
        let Some(tiers) = self.tiers.as_mut() else {
            return;
        };
        let evicted: Vec<(BlockHash, BlockId)> = evicted
            .into_iter()
            .filter(|&(h, _)| {
                let held = tiers.holds(h);
                if held {
                    tiers.left_pool(h);
                }
                !held
            })
            .collect();
        if evicted.is_empty() {
            return;
        }
        let ids: Vec<BlockId> = evicted.iter().map(|&(_, b)| b).collect();
        if let Err(e) = self.exec.kv_read(&mut self.cache, &ids) {
            tracing::warn!(error = %e, "evicted KV blocks could not be read for the tiers");
            let gone = evicted.iter().map(|&(h, _)| h).collect();
            self.cache.blocks_mut().removed(gone);
            return;
        }
        let peers = self.exec.peer_pools();
        let config = *self.cache.config();
        let Some(tiers) = self.tiers.as_mut() else {
            return;
        };
        for (hash, block) in evicted {
            let mut bytes = Vec::with_capacity(tiers.block_len());
            bytes.extend_from_slice(self.cache.block_bytes(block));
            for p in &peers {
                bytes.extend_from_slice(p.block_bytes(&config, block));
            }
            tiers.offload(hash, bytes.into());
        }
    }

    /// Tells the event consumers where the blocks that moved below the
    /// pool since the last call are now (`Moved` to host memory, then to
    /// disk) and which left every tier (`Removed`); blocks back in the pool
    /// are left out (their `Stored` says where they are).
    pub(super) fn publish_tier_drops(&mut self) {
        let Some(tiers) = self.tiers.as_mut() else {
            return;
        };
        let moved = tiers.take_moved();
        let mut gone = tiers.take_dropped();
        let blocks = self.cache.blocks_mut();
        for tier in [Tier::Host, Tier::Disk] {
            let hashes = moved
                .iter()
                .filter(|&&(h, t)| t == tier && !blocks.is_cached(h))
                .map(|&(h, _)| h)
                .collect();
            blocks.moved(hashes, kv_tier(tier));
        }
        gone.retain(|&h| !blocks.is_cached(h));
        blocks.removed(gone);
    }

    /// Extends `s.table` (its pool hits for `hashes`) with the blocks the
    /// tiers hold next. Returns false when some are being read from disk:
    /// the sequence then holds no blocks and waits for the wake-up (up to
    /// [`MAX_TIER_WAITS`] times; after that it takes what memory has).
    pub(super) fn restore_from_tiers(&mut self, s: &mut Seq, hashes: &[BlockHash]) -> bool {
        let have = s.table.len();
        let Some(tiers) = self.tiers.as_mut() else {
            return true;
        };
        if have == hashes.len() {
            return true;
        }
        let found = match tiers.lookup(&hashes[have..], s.tier_waits < MAX_TIER_WAITS) {
            Found::Reading => {
                s.tier_waits += 1;
                self.free(s);
                return false;
            }
            Found::Blocks(b) if b.is_empty() => return true,
            Found::Blocks(b) => b,
        };
        // The pool's copy of the blocks after these is held first, so that
        // making room for them cannot evict it (the pool evicts a prompt's
        // head before its tail).
        let mut tail = self
            .cache
            .blocks_mut()
            .match_prefix(&hashes[have + found.len()..]);
        let new = match self.cache.blocks_mut().allocate(found.len()) {
            Ok(new) => new,
            Err(_) => {
                // No room beside the tail: restore the head over it (it is
                // evicted into the tiers, and found there next).
                self.release_blocks(s.id, &mut tail);
                match self.cache.blocks_mut().allocate(found.len()) {
                    Ok(new) => new,
                    // No room at all: compute them (the pool's blocks go to running work).
                    Err(_) => return true,
                }
            }
        };
        self.offload_evicted();
        match self.place(s.id, &hashes[..have + found.len()], new, &found) {
            Some(placed) => {
                s.table.extend(placed);
                s.table.extend(tail);
            }
            None => self.release_blocks(s.id, &mut tail),
        }
        true
    }

    /// Copies `found` into the fresh pool blocks `new` and registers them
    /// as the last blocks of `hashes`; returns them, or `None` (released)
    /// when the runner could not take them.
    fn place(
        &mut self,
        seq: u64,
        hashes: &[BlockHash],
        mut new: Vec<BlockId>,
        found: &[TierBlock],
    ) -> Option<Vec<BlockId>> {
        if let Err(e) = self.copy_up(&new, found) {
            tracing::warn!(seq, error = %e, "KV from a tier did not reach the runner; recomputing");
            self.release_blocks(seq, &mut new);
            return None;
        }
        let first = hashes.len() - new.len();
        for (i, &b) in new.iter().enumerate() {
            let at = first + i;
            let parent = at.checked_sub(1).map(|p| hashes[p]);
            if let Err(e) = self.cache.blocks_mut().register(b, hashes[at], parent) {
                tracing::error!(seq, error = %e, "registering a restored block");
            }
        }
        if let Some(t) = &self.tiers {
            t.restored(found);
        }
        Some(new)
    }

    fn release_blocks(&mut self, seq: u64, blocks: &mut Vec<BlockId>) {
        if let Err(e) = self.cache.blocks_mut().release(blocks) {
            tracing::error!(seq, error = %e, "releasing KV blocks");
        }
    }

    /// Writes each block's bytes (rank 0's share, then each peer's) into
    /// the pools, and has the runner take them.
    fn copy_up(
        &mut self,
        blocks: &[BlockId],
        found: &[TierBlock],
    ) -> Result<(), crate::error::RequestError> {
        let config = *self.cache.config();
        let per = config.block_bytes();
        let peers = self.exec.peer_pools();
        for (&b, found) in blocks.iter().zip(found) {
            let mut shares = found.bytes.chunks_exact(per);
            if let Some(mine) = shares.next() {
                self.cache.block_bytes_mut(b).copy_from_slice(mine);
            }
            for (p, share) in peers.iter().zip(shares) {
                p.block_bytes_mut(&config, b).copy_from_slice(share);
            }
        }
        self.exec.kv_written(&self.cache, blocks)
    }
}

/// The events' name for a tier below the pool.
fn kv_tier(t: Tier) -> KvTier {
    match t {
        Tier::Host => KvTier::Host,
        Tier::Disk => KvTier::Disk,
    }
}
