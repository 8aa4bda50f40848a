//! The tiers' instruments, through the OpenTelemetry API (the binary
//! installs the SDK; without one they are no-ops). Labels are bounded:
//! `tier` is one of [`Tier`] or `peer` ([`peer`]), `direction` up or
//! down, `kind` one of [`ErrorKind`].

use std::sync::OnceLock;

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Gauge, Histogram, Meter};

/// Where a block is kept below the engine's pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    Host,
    Disk,
}

impl Tier {
    pub fn label(self) -> &'static str {
        match self {
            Tier::Host => "host",
            Tier::Disk => "disk",
        }
    }
}

/// Why a tier lost a block it was given or asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// A file failed its integrity check (or could not be read): a miss.
    Corrupt,
    /// A file could not be written (disk full, I/O error): not kept.
    Write,
    /// The disk writer was behind: the block was dropped, not queued.
    QueueFull,
    /// A write a previous run did not finish (killed mid-write), found
    /// and deleted at start.
    Unfinished,
    /// A fetch from a peer node failed (the peer died, stalled or
    /// refused): the blocks are computed instead.
    Fetch,
}

impl ErrorKind {
    fn label(self) -> &'static str {
        match self {
            ErrorKind::Corrupt => "corrupt",
            ErrorKind::Write => "write",
            ErrorKind::QueueFull => "queue_full",
            ErrorKind::Unfinished => "unfinished",
            ErrorKind::Fetch => "fetch",
        }
    }
}

#[derive(Debug)]
pub(crate) struct TierMetrics {
    hits: Counter<u64>,
    misses: Counter<u64>,
    bytes: Counter<u64>,
    errors: Counter<u64>,
    used_bytes: Gauge<u64>,
    blocks: Gauge<u64>,
    fetch_time: Histogram<f64>,
}

pub(crate) fn metrics() -> &'static TierMetrics {
    static M: OnceLock<TierMetrics> = OnceLock::new();
    M.get_or_init(|| TierMetrics::new(&opentelemetry::global::meter("tandem")))
}

fn tier(t: Tier) -> [KeyValue; 1] {
    [KeyValue::new("tier", t.label())]
}

/// The label of blocks fetched from a peer node's pool or tiers.
const PEER: &str = "peer";

/// What the node that fetches a prompt's leading blocks from a peer over
/// dKV records, under `tier="peer"`: the blocks it got (hits), a fetch
/// that got fewer than the router said the peer held (a miss), the bytes
/// moved up, the time, and failed fetches (`kind="fetch"`).
pub mod peer {
    use std::time::Duration;

    use opentelemetry::KeyValue;

    use super::{ErrorKind, PEER, metrics};

    /// Zero points, so the peer series exist before the first fetch.
    pub fn touch() {
        let m = metrics();
        m.hits.add(0, &[KeyValue::new("tier", PEER)]);
        m.misses.add(0, &[KeyValue::new("tier", PEER)]);
        m.bytes.add(
            0,
            &[
                KeyValue::new("tier", PEER),
                KeyValue::new("direction", "up"),
            ],
        );
        m.errors.add(
            0,
            &[
                KeyValue::new("tier", PEER),
                KeyValue::new("kind", ErrorKind::Fetch.label()),
            ],
        );
    }

    /// A fetch that ended: `blocks` landed, `short` when the peer held
    /// fewer than asked.
    pub fn fetched(blocks: u64, short: bool, bytes: u64, took: Duration) {
        let m = metrics();
        let tier = [KeyValue::new("tier", PEER)];
        m.hits.add(blocks, &tier);
        if short {
            m.misses.add(1, &tier);
        }
        m.bytes.add(
            bytes,
            &[
                KeyValue::new("tier", PEER),
                KeyValue::new("direction", "up"),
            ],
        );
        m.fetch_time.record(took.as_secs_f64() * 1e3, &tier);
    }

    /// A fetch that failed: its blocks are computed instead.
    pub fn failed() {
        metrics().errors.add(
            1,
            &[
                KeyValue::new("tier", PEER),
                KeyValue::new("kind", ErrorKind::Fetch.label()),
            ],
        );
    }
}

impl TierMetrics {
    pub(crate) fn new(m: &Meter) -> Self {
        Self {
            hits: m
                .u64_counter("tandem.kv.tier_hits")
                .with_description("KV blocks found in a tier below the pool and brought back")
                .build(),
            misses: m
                .u64_counter("tandem.kv.tier_misses")
                .with_description("Prefix lookups that ended at a tier without the next block")
                .build(),
            bytes: m
                .u64_counter("tandem.kv.tier_moved")
                .with_description("Bytes moved into a tier (down) and out of it toward the pool (up)")
                .with_unit("By")
                .build(),
            errors: m
                .u64_counter("tandem.kv.tier_errors")
                .with_description("Blocks a tier lost: corrupt or unreadable files, failed writes, a full write queue")
                .build(),
            used_bytes: m
                .u64_gauge("tandem.kv.tier_used")
                .with_description("Bytes held by a tier")
                .with_unit("By")
                .build(),
            blocks: m
                .u64_gauge("tandem.kv.tier_blocks")
                .with_description("KV blocks held by a tier")
                .build(),
            fetch_time: m
                .f64_histogram("tandem.kv.tier_fetch_time")
                .with_description("Time to bring a run of blocks up from a tier")
                .with_unit("ms")
                .with_boundaries(vec![
                    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 1000.0,
                ])
                .build(),
        }
    }

    /// Zero points for every counter, tier and error kind, so they are
    /// exported from the start rather than from their first event.
    pub(crate) fn touch(&self, tiers: &[Tier]) {
        for &t in tiers {
            self.hits.add(0, &tier(t));
            self.misses.add(0, &tier(t));
            for d in ["up", "down"] {
                self.moved(t, d, 0);
            }
        }
        if tiers.contains(&Tier::Disk) {
            for kind in [
                ErrorKind::Corrupt,
                ErrorKind::Write,
                ErrorKind::QueueFull,
                ErrorKind::Unfinished,
            ] {
                self.errors.add(
                    0,
                    &[
                        KeyValue::new("tier", Tier::Disk.label()),
                        KeyValue::new("kind", kind.label()),
                    ],
                );
            }
        }
    }

    pub(crate) fn hit(&self, t: Tier, blocks: u64) {
        self.hits.add(blocks, &tier(t));
    }

    pub(crate) fn miss(&self, t: Tier) {
        self.misses.add(1, &tier(t));
    }

    pub(crate) fn moved(&self, t: Tier, direction: &'static str, bytes: u64) {
        self.bytes.add(
            bytes,
            &[
                KeyValue::new("tier", t.label()),
                KeyValue::new("direction", direction),
            ],
        );
    }

    pub(crate) fn error(&self, t: Tier, kind: ErrorKind) {
        self.errors.add(
            1,
            &[
                KeyValue::new("tier", t.label()),
                KeyValue::new("kind", kind.label()),
            ],
        );
    }

    pub(crate) fn occupancy(&self, t: Tier, bytes: u64, blocks: u64) {
        self.used_bytes.record(bytes, &tier(t));
        self.blocks.record(blocks, &tier(t));
    }

    pub(crate) fn fetched(&self, t: Tier, ms: f64) {
        self.fetch_time.record(ms, &tier(t));
    }
}
