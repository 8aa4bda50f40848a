//! The tiers on real files: blocks pushed out of host memory reach disk
//! within its budget, come back equal, survive a restart, and a file that
//! is torn, corrupt or gone is a miss (counted), never wrong bytes.

use std::path::Path;
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tandem_kvtier::{BlockBytes, DiskConfig, Found, Tier, TierBlock, TierConfig, TierStore};
use tandem_testkit::TestMeter;

const BLOCK: usize = 10_000;
const NAMESPACE: u64 = 0x5eed;

/// A meter installed before anything records; tests that read it run one
/// at a time (the instruments are process-wide).
fn meter() -> (&'static TestMeter, std::sync::MutexGuard<'static, ()>) {
    static LOCK: Mutex<()> = Mutex::new(());
    (installed(), LOCK.lock().unwrap_or_else(|p| p.into_inner()))
}

/// The test meter, installed by whichever test first records (the tiers
/// make their instruments once, from the provider installed then).
fn installed() -> &'static TestMeter {
    static M: OnceLock<TestMeter> = OnceLock::new();
    M.get_or_init(|| {
        let meter = TestMeter::new();
        opentelemetry::global::set_meter_provider(meter.provider().clone());
        meter
    })
}

fn counter(m: &TestMeter, name: &str, labels: &[(&str, &str)]) -> f64 {
    m.points()
        .named(name)
        .filter(|p| p.has_labels(labels))
        .map(|p| p.value)
        .sum()
}

fn bytes_of(hash: u64) -> BlockBytes {
    (0..BLOCK)
        .map(|i| (hash as usize * 31 + i * 7) as u8)
        .collect::<Vec<u8>>()
        .into()
}

struct Store {
    store: TierStore,
    woken: mpsc::Receiver<()>,
}

fn tiers(dir: &Path, host_blocks: u64, disk_max: u64) -> TierConfig {
    TierConfig {
        host_bytes: host_blocks * BLOCK as u64,
        disk: Some(DiskConfig {
            dir: dir.to_path_buf(),
            max_bytes: disk_max,
            direct_io: false,
        }),
    }
}

fn open_with(config: &TierConfig, namespace: u64) -> Store {
    installed();
    let (tx, woken) = mpsc::channel();
    let tx = Mutex::new(tx);
    let wake = Arc::new(move || {
        let _ = tx.lock().expect("lock").send(());
    });
    Store {
        store: TierStore::open(config, namespace, BLOCK, wake).expect("opens"),
        woken,
    }
}

fn open(dir: &Path, host_blocks: u64, disk_blocks: u64) -> Store {
    let max = disk_blocks * (BLOCK as u64 + 40);
    open_with(&tiers(dir, host_blocks, max), NAMESPACE)
}

impl Store {
    fn disk_len(&self) -> usize {
        self.store.disk().expect("disk tier").len()
    }

    /// Offloads blocks `hashes` in order and waits until `on_disk` blocks
    /// are on disk.
    fn fill(&mut self, hashes: std::ops::Range<u64>, on_disk: usize) {
        for h in hashes {
            self.store.offload(h, bytes_of(h));
        }
        poll("disk writes", || self.disk_len() == on_disk);
    }

    /// Looks `hashes` up, waiting for disk reads; returns the blocks found.
    fn lookup(&mut self, hashes: &[u64]) -> Vec<BlockBytes> {
        for _ in 0..3 {
            match self.store.lookup(hashes, true) {
                Found::Blocks(b) => return self.restore(b),
                Found::Reading => {
                    self.woken
                        .recv_timeout(Duration::from_secs(10))
                        .expect("woken after the read");
                }
            }
        }
        match self.store.lookup(hashes, false) {
            Found::Blocks(b) => self.restore(b),
            Found::Reading => panic!("a lookup without disk reads read"),
        }
    }

    /// What the scheduler does with blocks found: counts them restored.
    fn restore(&self, found: Vec<TierBlock>) -> Vec<BlockBytes> {
        self.store.restored(&found);
        found.into_iter().map(|b| b.bytes).collect()
    }
}

fn poll(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn files(dir: &Path) -> Vec<std::path::PathBuf> {
    let sub = dir.join(format!("{NAMESPACE:016x}"));
    let mut v: Vec<_> = std::fs::read_dir(sub)
        .expect("namespace dir")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "kv"))
        .collect();
    v.sort();
    v
}

/// The block files' names (their hashes), in order.
fn names(dir: &Path) -> Vec<String> {
    files(dir)
        .iter()
        .map(|p| {
            p.file_stem()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned()
        })
        .collect()
}

fn dir_bytes(dir: &Path) -> u64 {
    files(dir)
        .iter()
        .map(|p| std::fs::metadata(p).expect("stat").len())
        .sum()
}

#[test]
fn blocks_leave_host_memory_for_disk_and_come_back_equal() {
    let (m, _serial) = meter();
    let dir = tempfile::tempdir_in("/var/tmp").expect("temp dir");
    let mut s = open(dir.path(), 2, 100);
    let hits_before = counter(m, "tandem.kv.tier_hits", &[("tier", "disk")]);
    let host_before = counter(m, "tandem.kv.tier_hits", &[("tier", "host")]);
    s.fill(0..6, 4);
    assert_eq!(s.store.host().len(), 2);
    let hashes: Vec<u64> = (0..6).collect();
    let got = s.lookup(&hashes);
    assert_eq!(got.len(), 6);
    for (h, b) in hashes.iter().zip(&got) {
        assert_eq!(b, &bytes_of(*h), "block {h}");
    }
    let hits = counter(m, "tandem.kv.tier_hits", &[("tier", "disk")]) - hits_before;
    assert_eq!(hits, 4.0);
    // Each block is one tier's hit: the four read from disk are not host's.
    let host = counter(m, "tandem.kv.tier_hits", &[("tier", "host")]) - host_before;
    assert_eq!(host, 2.0);
    // A run ends where no tier holds the next block.
    assert_eq!(s.lookup(&[0, 1, 99, 2]).len(), 2);
}

/// The tiers report each block's moves by the tier that holds it when
/// asked (for the router's events): host memory when offloaded, the disk
/// once host memory pushed it out, host memory again when a read of it
/// landed there; a block no tier holds any more is dropped, not moved.
#[test]
fn moves_are_reported_with_the_tier_that_holds_the_block_now() {
    let dir = tempfile::tempdir_in("/var/tmp").expect("temp dir");
    let mut s = open(dir.path(), 2, 3);
    s.store.offload(0, bytes_of(0));
    s.store.offload(1, bytes_of(1));
    assert_eq!(s.store.take_moved(), [(0, Tier::Host), (1, Tier::Host)]);
    assert!(s.store.take_moved().is_empty(), "reported once");
    // 2 pushes 0 down (queued or written: the disk's either way).
    s.store.offload(2, bytes_of(2));
    assert_eq!(s.store.take_moved(), [(0, Tier::Disk), (2, Tier::Host)]);
    // 3 then 4 push 1 and 2 down: reported once each, where they are now.
    s.store.offload(3, bytes_of(3));
    s.store.offload(4, bytes_of(4));
    assert_eq!(
        s.store.take_moved(),
        [
            (1, Tier::Disk),
            (2, Tier::Disk),
            (3, Tier::Host),
            (4, Tier::Host)
        ]
    );
    poll("disk writes", || s.disk_len() == 3);
    // A block evicted from the pool again while a tier holds it.
    s.store.left_pool(0);
    s.store.left_pool(4);
    assert_eq!(s.store.take_moved(), [(0, Tier::Disk), (4, Tier::Host)]);
    // A disk of three: 5 and 6 push 3 and 4 down, and the disk drops its
    // oldest files (0 and 1) for them.
    s.store.offload(5, bytes_of(5));
    s.store.offload(6, bytes_of(6));
    poll("disk writes", || s.store.disk().expect("disk").contains(4));
    poll("the budget", || s.disk_len() == 3);
    let moved = s.store.take_moved();
    assert_eq!(
        moved,
        [
            (3, Tier::Disk),
            (4, Tier::Disk),
            (5, Tier::Host),
            (6, Tier::Host)
        ]
    );
    assert_eq!(s.store.take_dropped(), [0, 1]);
}

#[test]
fn the_disk_budget_is_kept_oldest_files_first() {
    let dir = tempfile::tempdir_in("/var/tmp").expect("temp dir");
    let mut s = open(dir.path(), 1, 3);
    for h in 0..8 {
        s.store.offload(h, bytes_of(h));
    }
    // The newest three written (4, 5, 6; 7 is in host memory) are kept.
    let want = ["0000000000000004", "0000000000000005", "0000000000000006"];
    poll("the last writes", || {
        names(dir.path()) == want
            && s.store.disk().expect("disk").used_bytes() == dir_bytes(dir.path())
    });
    assert!(dir_bytes(dir.path()) <= 3 * (BLOCK as u64 + 40));
    assert_eq!(s.disk_len(), 3);
}

#[test]
fn a_restart_finds_the_files_and_skips_unfinished_ones() {
    let (m, _serial) = meter();
    let unfinished = || {
        counter(
            m,
            "tandem.kv.tier_errors",
            &[("tier", "disk"), ("kind", "unfinished")],
        )
    };
    let dir = tempfile::tempdir_in("/var/tmp").expect("temp dir");
    {
        let mut s = open(dir.path(), 1, 100);
        s.fill(0..5, 4);
    }
    // A write a crash interrupted: only its temporary name exists.
    let sub = dir.path().join(format!("{NAMESPACE:016x}"));
    std::fs::write(sub.join("00000000000000aa.tmp"), b"half").expect("write");
    // Four written while it ran, the fifth (in host memory) at shutdown.
    let before = unfinished();
    let mut s = open(dir.path(), 1, 100);
    assert_eq!(s.disk_len(), 5);
    assert!(!sub.join("00000000000000aa.tmp").exists());
    assert_eq!(
        unfinished() - before,
        1.0,
        "the unfinished write is counted"
    );
    let got = s.lookup(&[0, 1, 2, 3]);
    assert_eq!(got, (0..4).map(bytes_of).collect::<Vec<_>>());
    // Another model's files (another namespace) are not this one's.
    let other = open_with(&tiers(dir.path(), 1, 1 << 30), NAMESPACE + 1);
    assert_eq!(other.disk_len(), 0);
}

#[test]
fn torn_and_corrupt_files_are_misses_counted_and_deleted() {
    let (m, _serial) = meter();
    let dir = tempfile::tempdir_in("/var/tmp").expect("temp dir");
    {
        let mut s = open(dir.path(), 1, 100);
        s.fill(0..5, 4);
    }
    let f = files(dir.path());
    // Block 1 corrupt (a payload bit), block 2 torn (cut short).
    let mut b = std::fs::read(&f[1]).expect("read");
    b[100] ^= 1;
    std::fs::write(&f[1], b).expect("write");
    let b = std::fs::read(&f[2]).expect("read");
    std::fs::write(&f[2], &b[..b.len() / 2]).expect("write");
    let corrupt_before = counter(
        m,
        "tandem.kv.tier_errors",
        &[("tier", "disk"), ("kind", "corrupt")],
    );
    let mut s = open(dir.path(), 1, 100);
    let got = s.lookup(&[0, 1, 2, 3]);
    assert_eq!(got, [bytes_of(0)], "only the block before the corrupt one");
    let corrupt = counter(
        m,
        "tandem.kv.tier_errors",
        &[("tier", "disk"), ("kind", "corrupt")],
    ) - corrupt_before;
    assert_eq!(corrupt, 2.0);
    assert!(!f[1].exists() && !f[2].exists());
    assert_eq!(s.disk_len(), 3);
}

#[test]
fn host_blocks_are_written_to_disk_at_shutdown() {
    let dir = tempfile::tempdir_in("/var/tmp").expect("temp dir");
    {
        let mut s = open(dir.path(), 3, 100);
        s.fill(0..3, 0);
        assert_eq!(s.store.host().len(), 3);
    }
    assert_eq!(files(dir.path()).len(), 3);
    let mut s = open(dir.path(), 1, 100);
    assert_eq!(
        s.lookup(&[0, 1, 2]),
        (0..3).map(bytes_of).collect::<Vec<_>>()
    );
}

#[test]
fn only_the_newest_host_blocks_that_fit_the_disk_are_written_at_shutdown() {
    let dir = tempfile::tempdir_in("/var/tmp").expect("temp dir");
    {
        let mut s = open(dir.path(), 5, 2);
        s.fill(0..5, 0);
    }
    let names = names(dir.path());
    assert_eq!(names, ["0000000000000003", "0000000000000004"]);
}
