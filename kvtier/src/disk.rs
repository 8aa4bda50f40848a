//! The disk tier: blocks evicted from host memory, one file each under
//! `<disk_offload_dir>/<namespace>/`, up to a byte budget (least recently
//! used files deleted first). A worker thread of its own does every file
//! operation, so the scheduler's thread never waits on the disk: it asks
//! for writes and reads, and reads come back on a channel, followed by a
//! wake-up call. Files outlive the process: a restarted node finds them.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Instant, SystemTime};

use tandem_types::block_hash::BlockHash;

use crate::config::DiskConfig;
use crate::error::TierError;
use crate::file::{self, ALIGN, HEADER_LEN, Key};
use crate::host::BlockBytes;
use crate::metrics::{ErrorKind, Tier, metrics};

/// Called on the worker thread after a read's results are sent.
pub type Waker = Arc<dyn Fn() + Send + Sync>;

/// Most block writes queued before new ones are dropped (counted as
/// `queue_full`): a disk slower than the evictions loses blocks, not memory.
pub const WRITE_QUEUE: usize = 64;

/// What the disk worker tells the scheduler's side.
#[derive(Debug)]
pub enum DiskEvent {
    /// A block read: its bytes, or `None` for a miss (gone, torn or
    /// corrupt: never wrong bytes; a file that failed is also `Dropped`).
    Loaded {
        hash: BlockHash,
        bytes: Option<BlockBytes>,
    },
    /// A block the disk no longer holds, or never took (budget, a failed
    /// write, a damaged file).
    Dropped(BlockHash),
}

#[derive(Debug)]
pub struct DiskTier {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    max_bytes: u64,
}

#[derive(Debug)]
struct Shared {
    index: Mutex<Index>,
    jobs: Mutex<Jobs>,
    ready: Condvar,
}

/// What the tier holds on disk.
#[derive(Debug, Default)]
struct Index {
    files: HashMap<BlockHash, FileEntry>,
    lru: BTreeMap<u64, BlockHash>,
    used: u64,
    tick: u64,
}

#[derive(Debug, Clone, Copy)]
struct FileEntry {
    size: u64,
    last_use: u64,
}

#[derive(Debug, Default)]
struct Jobs {
    reads: VecDeque<BlockHash>,
    /// Blocks to write, in order; their bytes are in `writing`.
    writes: VecDeque<BlockHash>,
    /// Blocks queued or being written: still readable from memory.
    writing: HashMap<BlockHash, BlockBytes>,
    closed: bool,
}

/// The worker's fixed facts.
struct Worker {
    shared: Arc<Shared>,
    dir: PathBuf,
    namespace: u64,
    block_len: usize,
    max_bytes: u64,
    direct: bool,
    events: std::sync::mpsc::Sender<DiskEvent>,
    wake: Waker,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere cannot leave these maps half-updated (each update
    // is a few infallible steps), so a poisoned lock is still usable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl DiskTier {
    /// Opens (creating) the namespace's directory, indexes the files a
    /// previous run left, and starts the worker. `block_len` is the payload
    /// every file must have.
    pub fn open(
        config: &DiskConfig,
        namespace: u64,
        block_len: usize,
        events: std::sync::mpsc::Sender<DiskEvent>,
        wake: Waker,
    ) -> Result<Self, TierError> {
        let dir = config.dir.join(format!("{namespace:016x}"));
        std::fs::create_dir_all(&dir).map_err(|source| TierError::Dir {
            dir: dir.clone(),
            source,
        })?;
        if config.direct_io {
            file::probe_direct_io(&dir).map_err(|source| TierError::DirectIo {
                dir: dir.clone(),
                source,
            })?;
        }
        let index = scan(&dir)?;
        let shared = Arc::new(Shared {
            index: Mutex::new(index),
            jobs: Mutex::new(Jobs::default()),
            ready: Condvar::new(),
        });
        let worker = Worker {
            shared: Arc::clone(&shared),
            dir,
            namespace,
            block_len,
            max_bytes: config.max_bytes,
            direct: config.direct_io,
            events,
            wake,
        };
        worker.make_room(0);
        worker.publish();
        let thread = std::thread::Builder::new()
            .name("tandem-kv-disk".into())
            .spawn(move || worker.run())
            .map_err(TierError::Thread)?;
        Ok(Self {
            shared,
            thread: Some(thread),
            max_bytes: config.max_bytes,
        })
    }

    pub fn contains(&self, hash: BlockHash) -> bool {
        lock(&self.shared.index).files.contains_key(&hash)
    }

    /// Every block on disk (a restarted node announces them).
    pub fn hashes(&self) -> Vec<BlockHash> {
        lock(&self.shared.index).files.keys().copied().collect()
    }

    /// Blocks on disk (for tests and reports).
    pub fn len(&self) -> usize {
        lock(&self.shared.index).files.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of block files on disk.
    pub fn used_bytes(&self) -> u64 {
        lock(&self.shared.index).used
    }

    /// Queues a block to be written; false (and counted) when the queue
    /// is full and the block is dropped.
    pub fn write(&self, hash: BlockHash, bytes: BlockBytes) -> bool {
        let mut jobs = lock(&self.shared.jobs);
        if jobs.writing.contains_key(&hash) {
            return true;
        }
        if jobs.writes.len() >= WRITE_QUEUE {
            metrics().error(Tier::Disk, ErrorKind::QueueFull);
            return false;
        }
        jobs.writes.push_back(hash);
        jobs.writing.insert(hash, bytes);
        self.shared.ready.notify_one();
        true
    }

    /// Queues a block to be written whatever the queue's length (at
    /// shutdown, when nothing else competes).
    pub fn persist(&self, hash: BlockHash, bytes: BlockBytes) {
        let mut jobs = lock(&self.shared.jobs);
        if jobs.writing.insert(hash, bytes).is_none() {
            jobs.writes.push_back(hash);
        }
        self.shared.ready.notify_one();
    }

    /// The most bytes of block files kept.
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// The bytes of a block queued for writing (or being written): not on
    /// disk yet, but not lost either.
    pub fn writing(&self, hash: BlockHash) -> Option<BlockBytes> {
        lock(&self.shared.jobs).writing.get(&hash).cloned()
    }

    /// Queues reads (ahead of writes); each answers with a
    /// [`DiskEvent::Loaded`].
    pub fn read(&self, hashes: impl IntoIterator<Item = BlockHash>) {
        let mut jobs = lock(&self.shared.jobs);
        jobs.reads.extend(hashes);
        self.shared.ready.notify_one();
    }
}

impl Drop for DiskTier {
    /// Finishes the queued writes (so a restart finds them), then stops.
    fn drop(&mut self) {
        lock(&self.shared.jobs).closed = true;
        self.shared.ready.notify_one();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

enum Job {
    Read(BlockHash),
    Write(BlockHash, BlockBytes),
}

impl Worker {
    fn run(self) {
        while let Some(job) = self.next() {
            match job {
                Job::Read(hash) => {
                    let started = Instant::now();
                    let bytes = self.read(hash);
                    if bytes.is_some() {
                        metrics().fetched(Tier::Disk, started.elapsed().as_secs_f64() * 1e3);
                    }
                    if self.events.send(DiskEvent::Loaded { hash, bytes }).is_err() {
                        continue;
                    }
                    if lock(&self.shared.jobs).reads.is_empty() {
                        (self.wake)();
                    }
                }
                Job::Write(hash, bytes) => {
                    self.write(hash, &bytes);
                    lock(&self.shared.jobs).writing.remove(&hash);
                }
            }
        }
    }

    /// The next job, reads first; `None` once closed and no write is left
    /// (reads still queued then are dropped: no one is waiting for them).
    fn next(&self) -> Option<Job> {
        let mut jobs = lock(&self.shared.jobs);
        loop {
            if !jobs.closed
                && let Some(h) = jobs.reads.pop_front()
            {
                return Some(Job::Read(h));
            }
            if let Some(h) = jobs.writes.pop_front()
                && let Some(b) = jobs.writing.get(&h)
            {
                return Some(Job::Write(h, BlockBytes::clone(b)));
            }
            if jobs.closed {
                return None;
            }
            jobs = self
                .shared
                .ready
                .wait(jobs)
                .unwrap_or_else(|p| p.into_inner());
        }
    }

    fn path(&self, hash: BlockHash, ext: &str) -> PathBuf {
        self.dir.join(format!("{hash:016x}.{ext}"))
    }

    fn key(&self, hash: BlockHash) -> Key {
        Key {
            namespace: self.namespace,
            hash,
        }
    }

    fn file_size(&self) -> u64 {
        let len = HEADER_LEN + self.block_len;
        (if self.direct {
            len.next_multiple_of(ALIGN)
        } else {
            len
        }) as u64
    }

    /// Writes a block's file (through a temporary name, so a reader or a
    /// restart never sees half of it under the real one).
    fn write(&self, hash: BlockHash, bytes: &[u8]) {
        if bytes.len() != self.block_len || lock(&self.shared.index).files.contains_key(&hash) {
            return;
        }
        self.make_room(self.file_size());
        let tmp = self.path(hash, "tmp");
        let written = file::write(&tmp, self.key(hash), bytes, self.direct)
            .and_then(|size| std::fs::rename(&tmp, self.path(hash, "kv")).map(|()| size));
        match written {
            Ok(size) => {
                let mut index = lock(&self.shared.index);
                index.insert(hash, size);
                drop(index);
                metrics().moved(Tier::Disk, "down", bytes.len() as u64);
            }
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                tracing::warn!(block = format!("{hash:016x}"), error = %e, "KV block not written to the disk tier");
                metrics().error(Tier::Disk, ErrorKind::Write);
                let _ = self.events.send(DiskEvent::Dropped(hash));
            }
        }
        self.publish();
    }

    /// Reads a block back; a file that fails its checks is deleted and
    /// counted, and is a miss.
    fn read(&self, hash: BlockHash) -> Option<BlockBytes> {
        if !lock(&self.shared.index).touch(hash) {
            metrics().miss(Tier::Disk);
            return None;
        }
        match file::read(
            &self.path(hash, "kv"),
            self.key(hash),
            self.block_len,
            self.direct,
        ) {
            Ok(bytes) => {
                metrics().hit(Tier::Disk, 1);
                metrics().moved(Tier::Disk, "up", bytes.len() as u64);
                Some(bytes.into())
            }
            Err(e) => {
                tracing::warn!(block = format!("{hash:016x}"), error = %e, "KV block file refused; recomputing");
                metrics().error(Tier::Disk, ErrorKind::Corrupt);
                metrics().miss(Tier::Disk);
                self.forget(hash);
                None
            }
        }
    }

    fn forget(&self, hash: BlockHash) {
        lock(&self.shared.index).remove(hash);
        let _ = std::fs::remove_file(self.path(hash, "kv"));
        let _ = self.events.send(DiskEvent::Dropped(hash));
        self.publish();
    }

    /// Deletes least recently used files until `incoming` more bytes fit.
    fn make_room(&self, incoming: u64) {
        loop {
            let victim = {
                let mut index = lock(&self.shared.index);
                if index.used + incoming <= self.max_bytes {
                    return;
                }
                match index.lru.pop_first() {
                    Some((_, h)) => {
                        index.remove(h);
                        h
                    }
                    None => return,
                }
            };
            let _ = std::fs::remove_file(self.path(victim, "kv"));
            let _ = self.events.send(DiskEvent::Dropped(victim));
        }
    }

    fn publish(&self) {
        let index = lock(&self.shared.index);
        metrics().occupancy(Tier::Disk, index.used, index.files.len() as u64);
    }
}

impl Index {
    fn insert(&mut self, hash: BlockHash, size: u64) {
        self.remove(hash);
        self.tick += 1;
        self.lru.insert(self.tick, hash);
        self.files.insert(
            hash,
            FileEntry {
                size,
                last_use: self.tick,
            },
        );
        self.used += size;
    }

    fn remove(&mut self, hash: BlockHash) {
        if let Some(e) = self.files.remove(&hash) {
            self.lru.remove(&e.last_use);
            self.used -= e.size;
        }
    }

    /// Marks a block used now; false if it is not on disk.
    fn touch(&mut self, hash: BlockHash) -> bool {
        let Some(e) = self.files.get_mut(&hash) else {
            return false;
        };
        self.lru.remove(&e.last_use);
        self.tick += 1;
        e.last_use = self.tick;
        self.lru.insert(self.tick, hash);
        true
    }
}

/// Indexes the block files a previous run left in `dir`, oldest first by
/// modification time; deletes (and counts) its unfinished temporary files.
fn scan(dir: &Path) -> Result<Index, TierError> {
    let err = |source| TierError::Dir {
        dir: dir.to_path_buf(),
        source,
    };
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(err)? {
        let entry = entry.map_err(err)?;
        let path = entry.path();
        let (Some(stem), Some(ext)) = (
            path.file_stem().and_then(|s| s.to_str()),
            path.extension().and_then(|s| s.to_str()),
        ) else {
            continue;
        };
        let Ok(hash) = BlockHash::from_str_radix(stem, 16) else {
            continue;
        };
        match ext {
            "tmp" => {
                metrics().error(Tier::Disk, ErrorKind::Unfinished);
                let _ = std::fs::remove_file(&path);
            }
            "kv" => {
                let Ok(meta) = entry.metadata() else { continue };
                let mtime = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
                found.push((mtime, hash, meta.len()));
            }
            _ => {}
        }
    }
    found.sort();
    let mut index = Index::default();
    for (_, hash, size) in found {
        index.insert(hash, size);
    }
    Ok(index)
}
