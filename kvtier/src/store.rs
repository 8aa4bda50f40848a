//! The tiers as the scheduler sees them: blocks leaving the pool go down
//! ([`TierStore::offload`]), a prompt's next blocks are looked for on the
//! way up ([`TierStore::lookup`]). Host memory answers at once; the disk
//! answers later (its reads land in host memory, then the scheduler is
//! woken and looks again).

use std::collections::{HashMap, HashSet};
use std::sync::mpsc;

use tandem_types::block_hash::BlockHash;

use crate::config::TierConfig;
use crate::disk::{DiskEvent, DiskTier, Waker};
use crate::error::TierError;
use crate::host::{BlockBytes, HostTier};
use crate::metrics::{Tier, metrics};

#[derive(Debug)]
pub struct TierStore {
    host: HostTier,
    disk: Option<DiskTier>,
    events: mpsc::Receiver<DiskEvent>,
    /// Blocks that left every tier since [`TierStore::take_dropped`].
    dropped: Vec<BlockHash>,
    /// Blocks whose tier changed since [`TierStore::take_moved`].
    moved: Vec<BlockHash>,
    /// Blocks asked of the disk and not yet answered.
    reading: HashSet<BlockHash>,
    /// Blocks read from disk, kept for the lookup that asked for them
    /// (outside the host budget, which may be smaller than the run), then
    /// moved to host memory.
    staged: HashMap<BlockHash, BlockBytes>,
    block_len: usize,
}

/// What the tiers hold of a prompt's next blocks.
#[derive(Debug)]
pub enum Found {
    /// The leading blocks found (possibly none), in order.
    Blocks(Vec<TierBlock>),
    /// Some are being read from disk: look again after the wake-up.
    Reading,
}

/// A block found below the pool.
#[derive(Debug, Clone)]
pub struct TierBlock {
    pub bytes: BlockBytes,
    /// The tier it came up from (a disk hit is counted when it is read).
    pub from: Tier,
}

impl TierStore {
    /// The tiers of `config` for blocks of `block_len` bytes (every rank's
    /// share), their disk files under a directory named by `namespace`
    /// (the model and its KV layout). `wake` is called when disk reads
    /// have landed.
    pub fn open(
        config: &TierConfig,
        namespace: u64,
        block_len: usize,
        wake: Waker,
    ) -> Result<Self, TierError> {
        config.check_block(block_len)?;
        let (tx, events) = mpsc::channel();
        let disk = match &config.disk {
            Some(d) => Some(DiskTier::open(d, namespace, block_len, tx, wake)?),
            None => None,
        };
        let mut tiers = vec![Tier::Host];
        tiers.extend(disk.as_ref().map(|_| Tier::Disk));
        metrics().touch(&tiers);
        let store = Self {
            host: HostTier::new(config.host_bytes),
            disk,
            events,
            dropped: Vec::new(),
            moved: Vec::new(),
            reading: HashSet::new(),
            staged: HashMap::new(),
            block_len,
        };
        store.publish_host();
        Ok(store)
    }

    /// The bytes every block must have.
    pub fn block_len(&self) -> usize {
        self.block_len
    }

    pub fn host(&self) -> &HostTier {
        &self.host
    }

    pub fn disk(&self) -> Option<&DiskTier> {
        self.disk.as_ref()
    }

    /// Whether a block is kept below the pool (so its bytes need not be
    /// copied down again).
    pub fn holds(&self, hash: BlockHash) -> bool {
        self.host.contains(hash)
            || self
                .disk
                .as_ref()
                .is_some_and(|d| d.contains(hash) || d.writing(hash).is_some())
    }

    /// A block evicted from the pool: kept in host memory; what that
    /// pushes out goes to disk. Its tier is reported by
    /// [`TierStore::take_moved`].
    pub fn offload(&mut self, hash: BlockHash, bytes: BlockBytes) {
        if bytes.len() != self.block_len {
            return;
        }
        self.moved.push(hash);
        if self.host.get(hash).is_some() {
            return;
        }
        metrics().moved(Tier::Host, "down", bytes.len() as u64);
        let evicted = self.host.insert(hash, bytes);
        self.push_down(evicted);
        self.publish_host();
    }

    /// Blocks host memory let go: written to disk (unless there already),
    /// or, with no disk or no room in its queue, gone.
    fn push_down(&mut self, evicted: Vec<(BlockHash, BlockBytes)>) {
        for (h, b) in evicted {
            let kept = match &self.disk {
                Some(d) => d.contains(h) || d.write(h, b),
                None => false,
            };
            if kept {
                self.moved.push(h);
            } else {
                self.dropped.push(h);
            }
        }
    }

    /// A block the pool evicted that a tier holds already (so it was not
    /// offloaded again): its tier is reported by [`TierStore::take_moved`].
    pub fn left_pool(&mut self, hash: BlockHash) {
        self.moved.push(hash);
    }

    /// Where a block is kept below the pool: host memory, else the disk
    /// (a block queued for writing counts as the disk's); `None` if not.
    pub fn tier_of(&self, hash: BlockHash) -> Option<Tier> {
        if self.host.contains(hash) {
            return Some(Tier::Host);
        }
        let d = self.disk.as_ref()?;
        (d.contains(hash) || d.writing(hash).is_some() || self.staged.contains_key(&hash))
            .then_some(Tier::Disk)
    }

    /// The blocks that entered a tier or moved between tiers since the
    /// last call (offloaded, pushed from host memory to disk, read back
    /// into host memory, or evicted from the pool while a tier held them),
    /// each with the tier that holds it now, by hash; those no tier holds
    /// any more are [`TierStore::take_dropped`]'s.
    pub fn take_moved(&mut self) -> Vec<(BlockHash, Tier)> {
        self.take_loaded();
        let mut moved = std::mem::take(&mut self.moved);
        moved.sort_unstable();
        moved.dedup();
        moved
            .into_iter()
            .filter_map(|h| self.tier_of(h).map(|t| (h, t)))
            .collect()
    }

    /// Blocks that left every tier since the last call (for the prefix
    /// cache's events: a block a tier holds is still this node's).
    pub fn take_dropped(&mut self) -> Vec<BlockHash> {
        self.take_loaded();
        let mut dropped = std::mem::take(&mut self.dropped);
        dropped.retain(|&h| !self.holds(h) && !self.staged.contains_key(&h));
        dropped.sort_unstable();
        dropped.dedup();
        dropped
    }

    /// The blocks on disk (a restarted node's, to announce).
    pub fn on_disk(&self) -> Vec<BlockHash> {
        self.disk.as_ref().map(DiskTier::hashes).unwrap_or_default()
    }

    /// The leading blocks of `hashes` the tiers hold. With `read_disk`, a
    /// run that continues on disk is asked for and the answer is
    /// [`Found::Reading`]; without, the lookup stops at the first block not
    /// in memory. Misses are counted here; host memory's hits by
    /// [`TierStore::restored`], once the blocks are in the pool (the disk's
    /// when they are read).
    pub fn lookup(&mut self, hashes: &[BlockHash], read_disk: bool) -> Found {
        self.take_loaded();
        let mut found = Vec::new();
        for (i, &h) in hashes.iter().enumerate() {
            if let Some(bytes) = self.staged.remove(&h) {
                found.push(TierBlock {
                    bytes,
                    from: Tier::Disk,
                });
                continue;
            }
            // A block queued for the disk is still in memory, on its way down.
            let queued = || self.disk.as_ref().and_then(|d| d.writing(h));
            if let Some(bytes) = self.host.get(h).or_else(queued) {
                found.push(TierBlock {
                    bytes,
                    from: Tier::Host,
                });
                continue;
            }
            if let Some(d) = &self.disk
                && d.contains(h)
            {
                if !read_disk {
                    break;
                }
                self.read_run(&hashes[i..]);
                return Found::Reading;
            }
            metrics().miss(Tier::Host);
            if self.disk.is_some() {
                metrics().miss(Tier::Disk);
            }
            break;
        }
        if self.reading.is_empty() {
            self.unstage();
        }
        Found::Blocks(found)
    }

    /// Asks the disk for the run of blocks `hashes` starts with that the
    /// tiers hold, less those already in memory or asked for.
    fn read_run(&mut self, hashes: &[BlockHash]) {
        let Some(d) = &self.disk else {
            return;
        };
        let in_memory = |h: BlockHash| {
            self.host.contains(h) || self.staged.contains_key(&h) || d.writing(h).is_some()
        };
        let run: Vec<BlockHash> = hashes
            .iter()
            .copied()
            .take_while(|&h| in_memory(h) || d.contains(h))
            .filter(|&h| !in_memory(h))
            .collect();
        let run: Vec<BlockHash> = run
            .into_iter()
            .filter(|&h| self.reading.insert(h))
            .collect();
        d.read(run);
    }

    /// `blocks` found by [`TierStore::lookup`] are back in the pool: host
    /// memory's are counted as its hits (the disk's were, when read).
    pub fn restored(&self, blocks: &[TierBlock]) {
        let host = blocks.iter().filter(|b| b.from == Tier::Host);
        let (n, bytes) = host.fold((0, 0), |(n, s), b| (n + 1, s + b.bytes.len() as u64));
        metrics().hit(Tier::Host, n);
        metrics().moved(Tier::Host, "up", bytes);
    }

    /// Takes what the disk worker said: landed reads, dropped blocks.
    fn take_loaded(&mut self) {
        while let Ok(event) = self.events.try_recv() {
            match event {
                DiskEvent::Loaded { hash, bytes } => {
                    self.reading.remove(&hash);
                    if let Some(b) = bytes {
                        self.staged.insert(hash, b);
                    }
                }
                DiskEvent::Dropped(hash) => self.dropped.push(hash),
            }
        }
    }

    /// Moves blocks read from disk that no lookup took into host memory
    /// (their files stay; what they push out goes down).
    fn unstage(&mut self) {
        if self.staged.is_empty() {
            return;
        }
        for (hash, b) in std::mem::take(&mut self.staged) {
            self.moved.push(hash);
            let evicted = self.host.insert(hash, b);
            self.push_down(evicted);
        }
        self.publish_host();
    }

    fn publish_host(&self) {
        metrics().occupancy(Tier::Host, self.host.used_bytes(), self.host.len() as u64);
    }
}

impl Drop for TierStore {
    /// Host memory goes with the process: its blocks are written to disk
    /// (the newest that fit the disk's budget, oldest first so that the
    /// newest are the last evicted), so a restarted node finds them. The
    /// disk tier's own drop then waits for the writes.
    fn drop(&mut self) {
        let Some(d) = &self.disk else {
            return;
        };
        let all = self.host.take_all();
        let mut budget = d.max_bytes();
        let mut first = all.len();
        for (i, (_, b)) in all.iter().enumerate().rev() {
            let Some(left) = budget.checked_sub(b.len() as u64) else {
                break;
            };
            budget = left;
            first = i;
        }
        for (h, b) in all.into_iter().skip(first) {
            if !d.contains(h) {
                d.persist(h, b);
            }
        }
    }
}
