//! Write grants: the receiver's say over who writes where.
//!
//! A [`Grant`] names byte ranges of one registered region, carries a random
//! 128-bit secret and expires. A decode node makes one per transfer for the
//! blocks it reserved and hands its token to the one prefill node it asked
//! (over mutually authenticated gRPC). The receiving transport checks every
//! incoming write against its [`GrantTable`] before a byte is copied: an
//! unknown, revoked, expired or completed grant, a wrong secret, a range
//! outside the grant or one already written is refused and counted, and
//! nothing lands. Revoking is local and immediate: once [`Grant::revoke`]
//! resolves, no accepted write is still landing in its ranges, so the
//! memory is its owner's again whatever the peer still has in flight.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use opentelemetry::KeyValue;
use tokio::sync::watch;

use crate::descriptor::{self, MAGIC_GRANT};
use crate::{DkvError, DkvMetrics, RegionShared, RemoteRegion};

/// Why an incoming write was refused: the bounded `reason` label of
/// `tandem.dkv.refused_writes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Not a grant header (length, envelope).
    Malformed,
    /// No such grant (never issued, or revoked and gone).
    Unknown,
    /// A live grant, but the wrong secret or region.
    Forged,
    Expired,
    /// Revoked by its owner, or every granted byte already written.
    Closed,
    /// Outside the granted ranges, or over bytes already written.
    OutOfRange,
}

impl Refusal {
    pub const ALL: [Refusal; 6] = [
        Refusal::Malformed,
        Refusal::Unknown,
        Refusal::Forged,
        Refusal::Expired,
        Refusal::Closed,
        Refusal::OutOfRange,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Refusal::Malformed => "malformed",
            Refusal::Unknown => "unknown",
            Refusal::Forged => "forged",
            Refusal::Expired => "expired",
            Refusal::Closed => "closed",
            Refusal::OutOfRange => "out_of_range",
        }
    }
}

/// Bytes of a grant token's payload: grant id, region id, secret.
pub(crate) const TOKEN_LEN: usize = 8 + 8 + 16;

/// The parsed payload of a grant token.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct Token {
    pub id: u64,
    pub region: u64,
    pub secret: [u8; 16],
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The secret stays out of logs.
        f.debug_struct("Token")
            .field("id", &self.id)
            .field("region", &self.region)
            .finish_non_exhaustive()
    }
}

impl Token {
    pub(crate) fn to_bytes(self) -> [u8; TOKEN_LEN] {
        let mut b = [0u8; TOKEN_LEN];
        b[..8].copy_from_slice(&self.id.to_le_bytes());
        b[8..16].copy_from_slice(&self.region.to_le_bytes());
        b[16..].copy_from_slice(&self.secret);
        b
    }

    pub(crate) fn from_bytes(b: &[u8]) -> Option<Token> {
        if b.len() != TOKEN_LEN {
            return None;
        }
        let u = |r: Range<usize>| Some(u64::from_le_bytes(b.get(r)?.try_into().ok()?));
        Some(Token {
            id: u(0..8)?,
            region: u(8..16)?,
            secret: b.get(16..)?.try_into().ok()?,
        })
    }

    /// The token inside a descriptor's sealed `grant` blob.
    pub(crate) fn open(blob: &[u8]) -> Result<Token, DkvError> {
        let payload = descriptor::open("grant", MAGIC_GRANT, blob)?;
        Token::from_bytes(payload).ok_or_else(|| {
            DkvError::InvalidDescriptor(format!("grant: {} bytes, not a token", payload.len()))
        })
    }
}

/// Sorted, disjoint, non-empty ranges.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct RangeSet(Vec<Range<u64>>);

impl RangeSet {
    /// The union of `ranges` (empty ones dropped).
    pub(crate) fn union(ranges: impl IntoIterator<Item = Range<u64>>) -> Self {
        let mut v: Vec<Range<u64>> = ranges.into_iter().filter(|r| r.start < r.end).collect();
        v.sort_by_key(|r| r.start);
        let mut out: Vec<Range<u64>> = Vec::with_capacity(v.len());
        for r in v {
            match out.last_mut() {
                Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
                _ => out.push(r),
            }
        }
        Self(out)
    }

    pub(crate) fn total(&self) -> u64 {
        self.0.iter().map(|r| r.end - r.start).sum()
    }

    /// Index of the first range that ends after `at`.
    fn first_ending_after(&self, at: u64) -> usize {
        self.0.partition_point(|x| x.end <= at)
    }

    /// Whether one range of the set covers all of `r`.
    pub(crate) fn covers(&self, r: &Range<u64>) -> bool {
        self.0
            .get(self.first_ending_after(r.start))
            .is_some_and(|x| x.start <= r.start && r.end <= x.end)
    }

    pub(crate) fn overlaps(&self, r: &Range<u64>) -> bool {
        self.0
            .get(self.first_ending_after(r.start))
            .is_some_and(|x| x.start < r.end)
    }

    /// Adds `r`, which must not overlap the set.
    pub(crate) fn insert(&mut self, r: Range<u64>) {
        if r.start >= r.end {
            return;
        }
        let i = self.first_ending_after(r.start);
        // Merge with the neighbours it touches.
        let joins_prev = i > 0 && self.0[i - 1].end == r.start;
        let joins_next = self.0.get(i).is_some_and(|x| x.start == r.end);
        match (joins_prev, joins_next) {
            (true, true) => {
                self.0[i - 1].end = self.0[i].end;
                self.0.remove(i);
            }
            (true, false) => self.0[i - 1].end = r.end,
            (false, true) => self.0[i].start = r.start,
            (false, false) => self.0.insert(i, r),
        }
    }

    /// Takes `r`, which the set covers, out of it.
    pub(crate) fn remove(&mut self, r: Range<u64>) {
        if r.start >= r.end {
            return;
        }
        let i = self.first_ending_after(r.start);
        let Some(x) = self.0.get(i).cloned() else {
            return;
        };
        let (left, right) = (x.start..r.start.max(x.start), r.end.min(x.end)..x.end);
        self.0.remove(i);
        for part in [right, left] {
            if part.start < part.end {
                self.0.insert(i, part);
            }
        }
    }
}

/// What the grant's owner can watch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Progress {
    landed: u64,
    in_flight: usize,
}

struct Entry {
    token: Token,
    /// Keeps the memory alive (and registered) while writes may land.
    region: Arc<RegionShared>,
    allowed: RangeSet,
    total: u64,
    /// Accepted (landing or landed) ranges.
    claimed: RangeSet,
    landed: u64,
    in_flight: usize,
    expires: Instant,
    revoked: bool,
    tx: watch::Sender<Progress>,
}

impl Entry {
    fn publish(&self) {
        let p = Progress {
            landed: self.landed,
            in_flight: self.in_flight,
        };
        self.tx.send_replace(p);
    }
}

/// Every live grant of one `Dkv`; the receiving transport consults it.
pub(crate) struct GrantTable {
    entries: Mutex<HashMap<u64, Entry>>,
    next: AtomicU64,
    refused: AtomicU64,
    /// Set once the transport shut down: no grant is issued any more.
    closed: AtomicBool,
    metrics: &'static DkvMetrics,
    connector: &'static str,
}

impl GrantTable {
    pub(crate) fn new(metrics: &'static DkvMetrics, connector: &'static str) -> Arc<Self> {
        for r in Refusal::ALL {
            metrics.refused_writes.add(
                0,
                &[
                    KeyValue::new("connector", connector),
                    KeyValue::new("reason", r.label()),
                ],
            );
        }
        Arc::new(Self {
            entries: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
            refused: AtomicU64::new(0),
            closed: AtomicBool::new(false),
            metrics,
            connector,
        })
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Entry>> {
        // Every critical section leaves the map consistent.
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    pub(crate) fn live(&self) -> usize {
        self.lock().len()
    }

    /// Counts a message that was not a grant header at all (only UCX
    /// messages can be malformed).
    pub(crate) fn refuse_malformed(&self) {
        self.refuse(Refusal::Malformed);
    }

    fn refuse(&self, why: Refusal) -> Refusal {
        self.refused.fetch_add(1, Ordering::Relaxed);
        self.metrics.refused_writes.add(
            1,
            &[
                KeyValue::new("connector", self.connector),
                KeyValue::new("reason", why.label()),
            ],
        );
        tracing::debug!(reason = why.label(), "dkv: refused an incoming write");
        why
    }

    pub(crate) fn issue(
        self: &Arc<Self>,
        region: Arc<RegionShared>,
        ranges: &[Range<u64>],
        expires: Instant,
    ) -> Result<Grant, DkvError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(DkvError::Shutdown);
        }
        let len = region.len as u64;
        if let Some(r) = ranges.iter().find(|r| r.start > r.end || r.end > len) {
            return Err(DkvError::OutOfBounds(format!(
                "grant range {r:?} outside the region of {len} bytes"
            )));
        }
        let allowed = RangeSet::union(ranges.iter().cloned());
        let total = allowed.total();
        if total == 0 {
            return Err(DkvError::OutOfBounds("empty grant".into()));
        }
        let mut secret = [0u8; 16];
        getrandom::fill(&mut secret)
            .map_err(|e| DkvError::InvalidRegion(format!("no randomness for a grant: {e}")))?;
        let token = Token {
            id: self.next.fetch_add(1, Ordering::Relaxed),
            region: region.id,
            secret,
        };
        let descriptor = RemoteRegion {
            worker_address: region.worker_address.clone(),
            grant: descriptor::seal(MAGIC_GRANT, &token.to_bytes()),
            len,
        };
        let (tx, rx) = watch::channel(Progress::default());
        self.lock().insert(
            token.id,
            Entry {
                token,
                region,
                allowed,
                total,
                claimed: RangeSet::default(),
                landed: 0,
                in_flight: 0,
                expires,
                revoked: false,
                tx,
            },
        );
        Ok(Grant {
            table: Arc::clone(self),
            id: token.id,
            total,
            descriptor,
            rx,
        })
    }

    /// Checks one incoming write of `len` bytes at `offset` of the region
    /// the token names; on success the bytes may be copied to
    /// [`Landing::dst`] and the landing finished.
    pub(crate) fn accept(
        self: &Arc<Self>,
        token: &Token,
        offset: u64,
        len: u64,
    ) -> Result<Landing, Refusal> {
        let mut entries = self.lock();
        let Some(e) = entries.get_mut(&token.id) else {
            return Err(self.refuse(Refusal::Unknown));
        };
        // Constant time in the secret: no byte-by-byte oracle.
        let diff = e
            .token
            .secret
            .iter()
            .zip(&token.secret)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        if diff != 0 || e.token.region != token.region {
            return Err(self.refuse(Refusal::Forged));
        }
        if e.revoked || e.landed == e.total {
            return Err(self.refuse(Refusal::Closed));
        }
        if Instant::now() >= e.expires {
            return Err(self.refuse(Refusal::Expired));
        }
        let Some(end) = offset.checked_add(len) else {
            return Err(self.refuse(Refusal::OutOfRange));
        };
        let range = offset..end;
        if len == 0 || !e.allowed.covers(&range) || e.claimed.overlaps(&range) {
            return Err(self.refuse(Refusal::OutOfRange));
        }
        e.claimed.insert(range.clone());
        e.in_flight += 1;
        e.publish();
        // In bounds: the allowed ranges lie inside the region (checked at
        // issue), and `e.region` keeps the memory alive until this landing
        // finishes (the entry stays while `in_flight > 0`).
        let dst = e.region.ptr as usize + offset as usize;
        Ok(Landing {
            table: Arc::clone(self),
            id: token.id,
            range,
            dst,
            done: false,
        })
    }

    fn finish(&self, id: u64, range: Range<u64>, landed: bool) {
        let mut entries = self.lock();
        let Some(e) = entries.get_mut(&id) else {
            return;
        };
        e.in_flight -= 1;
        if landed {
            e.landed += range.end - range.start;
        } else {
            // Never landed (the transport failed): the bytes are not there.
            e.claimed.remove(range);
        }
        e.publish();
        if e.revoked && e.in_flight == 0 {
            entries.remove(&id);
        }
    }

    fn revoke(&self, id: u64) {
        let mut entries = self.lock();
        let Some(e) = entries.get_mut(&id) else {
            return;
        };
        e.revoked = true;
        e.publish();
        if e.in_flight == 0 {
            entries.remove(&id);
        }
    }

    /// Drops every grant (the transport is shutting down: nothing lands
    /// any more).
    pub(crate) fn clear(&self) {
        self.closed.store(true, Ordering::Release);
        let gone: Vec<Entry> = self.lock().drain().map(|(_, e)| e).collect();
        for e in &gone {
            e.tx.send_replace(Progress {
                landed: e.landed,
                in_flight: 0,
            });
        }
        // Regions drop outside the lock.
        drop(gone);
    }
}

/// An accepted incoming write: copy into [`Landing::dst`], then
/// [`Landing::done`]. Dropped without `done`, the bytes count as never
/// landed (the range may be written again).
pub(crate) struct Landing {
    table: Arc<GrantTable>,
    id: u64,
    range: Range<u64>,
    pub(crate) dst: usize,
    done: bool,
}

impl Landing {
    pub(crate) fn len(&self) -> usize {
        (self.range.end - self.range.start) as usize
    }

    pub(crate) fn done(mut self) {
        self.done = true;
        self.table.finish(self.id, self.range.clone(), true);
    }
}

impl Drop for Landing {
    fn drop(&mut self) {
        if !self.done {
            self.table.finish(self.id, self.range.clone(), false);
        }
    }
}

/// The owner's handle on a grant: its descriptor for the peer, and when its
/// bytes have landed. Dropping it revokes the grant.
pub struct Grant {
    table: Arc<GrantTable>,
    id: u64,
    total: u64,
    descriptor: RemoteRegion,
    rx: watch::Receiver<Progress>,
}

impl std::fmt::Debug for Grant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grant")
            .field("id", &self.id)
            .field("total", &self.total)
            .field("landed", &self.landed())
            .finish()
    }
}

impl Grant {
    /// What the peer needs to write the granted ranges.
    pub fn descriptor(&self) -> RemoteRegion {
        self.descriptor.clone()
    }

    /// Granted bytes.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Granted bytes landed so far.
    pub fn landed(&self) -> u64 {
        self.rx.borrow().landed
    }

    /// Resolves once every granted byte has landed;
    /// [`DkvError::DeadlineExceeded`] past `deadline`.
    pub async fn complete(&self, deadline: Instant) -> Result<(), DkvError> {
        self.landed_at_least(self.total, deadline).await
    }

    /// Resolves once at least `bytes` granted bytes have landed and no
    /// accepted write is still landing (for a peer that writes only part
    /// of what was granted and says how much); [`DkvError::DeadlineExceeded`]
    /// past `deadline`.
    pub async fn landed_at_least(&self, bytes: u64, deadline: Instant) -> Result<(), DkvError> {
        let mut rx = self.rx.clone();
        let wait = rx.wait_for(|p| p.landed >= bytes && p.in_flight == 0);
        match tokio::time::timeout_at(deadline.into(), wait).await {
            Ok(Ok(_)) => Ok(()),
            // The table let go of the grant: the transport shut down.
            Ok(Err(_)) => Err(DkvError::Shutdown),
            Err(_) => Err(DkvError::DeadlineExceeded),
        }
    }

    /// Refuses every later write, then resolves once no accepted write is
    /// still landing: from then on nothing the peer sends can touch the
    /// granted memory. A rendezvous receive from a peer that froze
    /// mid-message lands (or fails) when the transport says so; that can
    /// take long, and the memory is not safe to reuse before: callers
    /// bound the wait and decide (the decode node's quarantine limit).
    pub async fn revoke(&self) {
        self.table.revoke(self.id);
        let mut rx = self.rx.clone();
        // An error means the entry is gone, which is quiescent too.
        let _ = rx.wait_for(|p| p.in_flight == 0).await;
    }
}

impl Drop for Grant {
    fn drop(&mut self) {
        self.table.revoke(self.id);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn range_set_union_cover_insert_remove() {
        let s = RangeSet::union([10..20, 0..5, 5..8, 18..30, 40..40]);
        assert_eq!(s.0, vec![0..8, 10..30]);
        assert_eq!(s.total(), 28);
        assert!(s.covers(&(0..8)) && s.covers(&(12..30)));
        assert!(!s.covers(&(7..11)) && !s.covers(&(29..31)) && !s.covers(&(30..31)));
        let mut c = RangeSet::default();
        c.insert(10..12);
        c.insert(14..16);
        assert!(c.overlaps(&(11..13)) && c.overlaps(&(0..11)) && !c.overlaps(&(12..14)));
        c.insert(12..14);
        assert_eq!(c.0, vec![10..16]);
        c.remove(11..13);
        assert_eq!(c.0, vec![10..11, 13..16]);
        c.remove(10..11);
        c.remove(13..16);
        assert!(c.0.is_empty());
    }

    #[test]
    fn token_round_trip_and_length() {
        let t = Token {
            id: 7,
            region: 9,
            secret: [3; 16],
        };
        assert_eq!(Token::from_bytes(&t.to_bytes()), Some(t));
        assert_eq!(Token::from_bytes(&t.to_bytes()[1..]), None);
        assert!(!format!("{t:?}").contains("3, 3"));
    }
}
