//! Shared-memory backend: the ranks are threads of one process.
//!
//! Each collective publishes a small descriptor (op, sizes, pointers to the
//! caller's buffers) in the rank's slot, meets the others at a barrier, and
//! then every rank reads its peers' buffers directly; only small
//! all-reduces stage a copy, to save a barrier. Every rank computes the same
//! verdict on the published sizes, so a mismatch is an error on all ranks
//! and the group stays usable.
//!
//! Memory safety rests on the barriers: a caller's buffers are read by
//! peers only between the barrier after publishing and the rank's last
//! barrier of the call; what a rank leaves in its slot (descriptors, staged
//! inputs, reduced chunks) is double-buffered by call parity or rewritten
//! only after every rank has entered a later call. A panic inside a data
//! phase aborts rather than free a buffer a peer is reading.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::{CommError, Communicator};

/// Creates groups of thread ranks.
#[derive(Debug)]
pub struct CpuGroup;

impl CpuGroup {
    /// One handle per rank (index = rank); move each to its thread. A world
    /// of 0 gives no handles.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(world: usize) -> Vec<CpuComm> {
        let shared = Arc::new(Shared {
            world,
            slots: (0..world).map(|_| Slot::default()).collect(),
            barrier: Barrier::new(world),
        });
        (0..world)
            .map(|rank| CpuComm {
                rank,
                shared: Arc::clone(&shared),
                seq: Mutex::new(0),
            })
            .collect()
    }
}

/// One rank of a [`CpuGroup`]. Dropping it poisons the group (peers get
/// [`CommError::PeerGone`]).
pub struct CpuComm {
    rank: usize,
    shared: Arc<Shared>,
    /// Calls made on this rank; the lock also serializes concurrent calls
    /// on one handle, which would otherwise race on the rank's slot.
    seq: Mutex<u64>,
}

impl std::fmt::Debug for CpuComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuComm")
            .field("rank", &self.rank)
            .field("world", &self.shared.world)
            .finish()
    }
}

impl Drop for CpuComm {
    fn drop(&mut self) {
        self.shared.barrier.poison();
    }
}

/// Which collective a rank entered; part of the descriptor so diverged call
/// orders are caught.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    Barrier,
    AllReduce,
    AllGather,
    ReduceScatter,
    AllToAll,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Barrier => "barrier",
            Op::AllReduce => "all_reduce_sum",
            Op::AllGather => "all_gather",
            Op::ReduceScatter => "reduce_scatter_sum",
            Op::AllToAll => "all_to_all",
        }
    }
}

/// What a rank publishes for one call.
#[derive(Debug, Clone, Copy)]
struct Meta {
    op: Op,
    /// Send length (the buffer's, for all-reduce).
    len: usize,
    /// Receive length (all-gather, reduce-scatter).
    out_len: usize,
    /// The send buffer (the in-place buffer for all-reduce); null when the
    /// call only agrees on sizes.
    src: *const f32,
    /// All-to-all send counts, `world` long once validated.
    counts: *const usize,
    counts_len: usize,
}

impl Meta {
    fn new(op: Op) -> Self {
        Meta {
            op,
            len: 0,
            out_len: 0,
            src: std::ptr::null(),
            counts: std::ptr::null(),
            counts_len: 0,
        }
    }
}

// Padded so ranks writing their own slots do not share cache lines.
#[repr(align(128))]
struct Slot {
    meta: [UnsafeCell<Meta>; 2],
    /// This rank's reduced all-reduce chunk, read by the peers after the
    /// middle barrier so the caller's buffer is free once the rank returns.
    partial: UnsafeCell<Vec<f32>>,
    /// A copy of a small all-reduce's input, by call parity like `meta`,
    /// so the one-barrier path leaves the caller's buffer free on return.
    stage: [UnsafeCell<Vec<f32>>; 2],
}

impl Default for Slot {
    fn default() -> Self {
        Slot {
            meta: [
                UnsafeCell::new(Meta::new(Op::Barrier)),
                UnsafeCell::new(Meta::new(Op::Barrier)),
            ],
            partial: UnsafeCell::new(Vec::new()),
            stage: [UnsafeCell::new(Vec::new()), UnsafeCell::new(Vec::new())],
        }
    }
}

struct Shared {
    world: usize,
    slots: Box<[Slot]>,
    barrier: Barrier,
}

// SAFETY: the slots are written only by their own rank and read by peers
// only in windows the barrier separates from those writes (module docs);
// the raw pointers in `Meta` point at buffers their owners keep alive until
// the peers are done with them.
unsafe impl Sync for Shared {}
// SAFETY: as above; nothing in `Shared` is tied to a thread.
unsafe impl Send for Shared {}

/// Peers' descriptors for the current call.
struct Peers<'a> {
    shared: &'a Shared,
    parity: usize,
}

impl Peers<'_> {
    fn meta(&self, q: usize) -> Meta {
        // SAFETY: rank q wrote this before the barrier we passed and will
        // not write this parity again until every rank reached the next
        // call's first barrier.
        unsafe { *self.shared.slots[q].meta[self.parity].get() }
    }

    /// Rank q's send counts (all-to-all, after the verdict checked them).
    fn counts(&self, q: usize) -> &[usize] {
        let m = self.meta(q);
        if m.counts_len == 0 {
            return &[];
        }
        // SAFETY: rank q's `send_counts`, alive until it passes its last
        // barrier of this call, which it cannot do before we reach ours.
        unsafe { std::slice::from_raw_parts(m.counts, m.counts_len) }
    }

    /// `len` elements of rank q's send buffer from `start`.
    ///
    /// # Safety
    /// `start + len` must be within the published length, and no rank may
    /// write that range until this rank's next barrier.
    unsafe fn src(&self, q: usize, start: usize, len: usize) -> &[f32] {
        if len == 0 {
            return &[];
        }
        // SAFETY: per the caller's contract.
        unsafe { std::slice::from_raw_parts(self.meta(q).src.add(start), len) }
    }

    /// The same verdict on every rank: the first inconsistency in rank
    /// order.
    fn verdict(&self, world: usize) -> Result<(), CommError> {
        let m0 = self.meta(0);
        for q in 1..world {
            let op = self.meta(q).op;
            if op != m0.op {
                return Err(CommError::OpMismatch {
                    rank: q,
                    expected: m0.op.name(),
                    actual: op.name(),
                });
            }
        }
        let op = m0.op.name();
        let check = |rank, what, expected, actual| {
            if expected == actual {
                Ok(())
            } else {
                Err(CommError::SizeMismatch {
                    op,
                    rank,
                    what,
                    expected,
                    actual,
                })
            }
        };
        for q in 0..world {
            let m = self.meta(q);
            match m.op {
                Op::Barrier => {}
                Op::AllReduce => check(q, "a buffer", m0.len, m.len)?,
                Op::AllGather => {
                    check(q, "send", m0.len, m.len)?;
                    check(q, "recv", m0.len.saturating_mul(world), m.out_len)?;
                }
                Op::ReduceScatter => {
                    check(q, "recv", m0.out_len, m.out_len)?;
                    check(q, "send", m0.out_len.saturating_mul(world), m.len)?;
                }
                Op::AllToAll => {
                    check(q, "send_counts", world, m.counts_len)?;
                    let total = self
                        .counts(q)
                        .iter()
                        .try_fold(0usize, |acc, &c| acc.checked_add(c))
                        .unwrap_or(usize::MAX);
                    check(q, "send (vs. the sum of its send_counts)", total, m.len)?;
                }
            }
        }
        Ok(())
    }
}

/// Aborts if a panic unwinds out of a data phase: peers may be reading the
/// unwinding rank's buffers, so returning would let them read freed memory.
/// The data phases only index within validated bounds, so this never fires.
struct AbortOnUnwind {
    was_panicking: bool,
}

impl AbortOnUnwind {
    fn new() -> Self {
        AbortOnUnwind {
            was_panicking: std::thread::panicking(),
        }
    }
}

impl Drop for AbortOnUnwind {
    fn drop(&mut self) {
        if std::thread::panicking() && !self.was_panicking {
            eprintln!("tandem comm: panic inside a collective's data phase; aborting");
            std::process::abort();
        }
    }
}

/// Start of rank q's chunk of an `n`-element all-reduce: balanced, rounded
/// down to 16 elements (a cache line) so ranks' chunks do not share lines.
fn chunk_start(n: usize, world: usize, q: usize) -> usize {
    if q >= world {
        return n;
    }
    // floor(q * n / world) without overflow.
    let exact = (n / world) * q + (n % world) * q / world;
    exact & !15
}

/// Which of the double-buffered descriptors (and stages) call `seq` uses.
fn parity(seq: u64) -> usize {
    (seq & 1) as usize
}

/// Largest `len * world` of an all-reduce that takes the one-barrier path:
/// below this the second barrier costs more than reading every peer's
/// whole buffer.
const SMALL_ALL_REDUCE: usize = 16 << 10;

/// Elements per tile of a reduction: the partial sums stay in L1 while the
/// ranks' inputs stream through.
const TILE: usize = 2048;

/// `dst[i] = src(0)[i] + src(1)[i] + ...` in rank order, element by element;
/// each finished tile is also copied to `mirror` while it is in L1.
///
/// # Safety
/// `mirror`, if given, must be valid for writing `dst.len()` elements. It
/// may be the memory behind one of the `src` slices: a tile is written only
/// after its inputs were read, and no slice `src` returned is used again.
unsafe fn sum_in_rank_order<'a>(
    dst: &mut [f32],
    mirror: Option<*mut f32>,
    world: usize,
    src: impl Fn(usize) -> &'a [f32],
) {
    let n = dst.len();
    let mut start = 0;
    while start < n {
        let end = (start + TILE).min(n);
        let d = &mut dst[start..end];
        let s0 = &src(0)[start..end];
        if world == 1 {
            d.copy_from_slice(s0);
        } else {
            let s1 = &src(1)[start..end];
            for ((d, &a), &b) in d.iter_mut().zip(s0).zip(s1) {
                *d = a + b;
            }
            for q in 2..world {
                for (d, &s) in d.iter_mut().zip(&src(q)[start..end]) {
                    *d += s;
                }
            }
        }
        if let Some(m) = mirror {
            // SAFETY: in bounds per the contract; `d` is our own buffer.
            unsafe { std::ptr::copy_nonoverlapping(d.as_ptr(), m.add(start), d.len()) };
        }
        start = end;
    }
}

impl CpuComm {
    fn world(&self) -> usize {
        self.shared.world
    }

    fn lock_seq(&self) -> MutexGuard<'_, u64> {
        // Poisoned only by a panic in a data phase, which aborts.
        self.seq.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Publishes `meta` and waits for every rank's.
    fn begin(&self, seq: &mut u64, meta: Meta) -> Result<Peers<'_>, CommError> {
        let parity = parity(*seq);
        *seq = seq.wrapping_add(1);
        // SAFETY: only this rank writes its slot, and peers read this parity
        // only between the barrier below and the next call's first barrier.
        unsafe { *self.shared.slots[self.rank].meta[parity].get() = meta };
        self.shared.barrier.wait(self.rank)?;
        Ok(Peers {
            shared: &self.shared,
            parity,
        })
    }

    /// Publishes, agrees on the verdict, and on a mismatch meets the others
    /// once more (so no peer still reads this rank's descriptor or counts)
    /// before returning the error.
    fn begin_checked(&self, seq: &mut u64, meta: Meta) -> Result<Peers<'_>, CommError> {
        let peers = self.begin(seq, meta)?;
        if let Err(e) = peers.verdict(self.world()) {
            self.shared.barrier.wait(self.rank)?;
            return Err(e);
        }
        Ok(peers)
    }

    /// Agrees on sizes without moving data (backends whose data path is
    /// elsewhere, e.g. NCCL).
    pub(crate) fn check_sizes(&self, op: Op, len: usize, out_len: usize) -> Result<(), CommError> {
        let mut seq = self.lock_seq();
        let meta = Meta {
            len,
            out_len,
            ..Meta::new(op)
        };
        self.begin_checked(&mut seq, meta).map(|_| ())
    }

    /// The count exchange (and validation) of an all-to-all; with `recv`
    /// also the data.
    pub(crate) fn all_to_all_inner(
        &self,
        send: &[f32],
        send_counts: &[usize],
        recv: Option<&mut Vec<f32>>,
        recv_counts: &mut Vec<usize>,
    ) -> Result<(), CommError> {
        let mut seq = self.lock_seq();
        let meta = Meta {
            len: send.len(),
            src: send.as_ptr(),
            counts: send_counts.as_ptr(),
            counts_len: send_counts.len(),
            ..Meta::new(Op::AllToAll)
        };
        let peers = self.begin_checked(&mut seq, meta)?;
        {
            let _abort = AbortOnUnwind::new();
            let (world, r) = (self.world(), self.rank);
            recv_counts.clear();
            recv_counts.extend((0..world).map(|q| peers.counts(q)[r]));
            if let Some(recv) = recv {
                recv.clear();
                recv.reserve(recv_counts.iter().sum());
                for q in 0..world {
                    let counts = peers.counts(q);
                    let start: usize = counts[..r].iter().sum();
                    // SAFETY: the verdict checked that rank q's counts sum
                    // to its send length; q only reads its send buffer.
                    recv.extend_from_slice(unsafe { peers.src(q, start, counts[r]) });
                }
            }
        }
        self.shared.barrier.wait(self.rank)
    }
}

impl Communicator for CpuComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world()
    }

    /// Large buffers: reduce-scatter then all-gather over the ranks' own
    /// buffers. Rank r sums chunk r of every buffer in rank order into its
    /// slot's partial (and its own chunk), then after a barrier copies the
    /// other chunks from the peers' partials; two barriers per call.
    ///
    /// Small buffers (the per-layer TP case): each rank stages a copy of its
    /// input, and after one barrier every rank sums all the copies itself.
    ///
    /// Either way each element is the same rank-order sum of the same
    /// inputs, so every rank gets the same bits whichever path runs.
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CommError> {
        let mut seq = self.lock_seq();
        let (world, r) = (self.world(), self.rank);
        let n = buf.len();
        // Decided from the local length; the verdict makes it agree.
        if n.saturating_mul(world) <= SMALL_ALL_REDUCE {
            // SAFETY: peers read this parity's stage only between the
            // barrier in `begin` and every rank's next call's first barrier,
            // so no one reads it now.
            let stage = unsafe { &mut *self.shared.slots[r].stage[parity(*seq)].get() };
            stage.clear();
            stage.extend_from_slice(buf);
            let meta = Meta {
                len: n,
                src: stage.as_ptr(),
                ..Meta::new(Op::AllReduce)
            };
            let peers = self.begin_checked(&mut seq, meta)?;
            let _abort = AbortOnUnwind::new();
            // SAFETY: stages are only read until everyone's next call.
            unsafe { sum_in_rank_order(buf, None, world, |q| peers.src(q, 0, n)) };
            return Ok(());
        }
        let ptr = buf.as_mut_ptr();
        let meta = Meta {
            len: n,
            src: ptr,
            ..Meta::new(Op::AllReduce)
        };
        let peers = self.begin_checked(&mut seq, meta)?;
        let (lo, hi) = (chunk_start(n, world, r), chunk_start(n, world, r + 1));
        {
            let _abort = AbortOnUnwind::new();
            // SAFETY: only this rank touches its partial outside the window
            // between the middle barrier and every rank's next call.
            let partial = unsafe { &mut *self.shared.slots[r].partial.get() };
            if partial.len() < hi - lo {
                partial.resize(hi - lo, 0.0);
            }
            let partial = &mut partial[..hi - lo];
            // SAFETY: chunk r of every buffer is read only by this rank and
            // written by nobody else during this phase (peers write only
            // their own chunk of their own buffer). The mirror is chunk r of
            // this rank's buffer, in bounds, written tile by tile after the
            // tile was read.
            unsafe {
                sum_in_rank_order(partial, Some(ptr.add(lo)), world, |q| {
                    peers.src(q, lo, hi - lo)
                })
            };
        }
        // After this no peer reads `buf`, and the partials are complete.
        self.shared.barrier.wait(self.rank)?;
        let _abort = AbortOnUnwind::new();
        for q in (0..world).filter(|&q| q != r) {
            let (qlo, qhi) = (chunk_start(n, world, q), chunk_start(n, world, q + 1));
            // SAFETY: rank q wrote its partial before the barrier and does
            // not touch it again until every rank entered the next call.
            let part = unsafe { &*self.shared.slots[q].partial.get() };
            buf[qlo..qhi].copy_from_slice(&part[..qhi - qlo]);
        }
        Ok(())
    }

    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        let mut seq = self.lock_seq();
        let m = send.len();
        let meta = Meta {
            len: m,
            out_len: recv.len(),
            src: send.as_ptr(),
            ..Meta::new(Op::AllGather)
        };
        let peers = self.begin_checked(&mut seq, meta)?;
        {
            let _abort = AbortOnUnwind::new();
            for (q, dst) in recv
                .chunks_exact_mut(m.max(1))
                .enumerate()
                .take(self.world())
            {
                // SAFETY: send buffers are only read; lengths checked.
                dst.copy_from_slice(unsafe { peers.src(q, 0, m) });
            }
        }
        self.shared.barrier.wait(self.rank)
    }

    fn reduce_scatter_sum(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        let mut seq = self.lock_seq();
        let m = recv.len();
        let meta = Meta {
            len: send.len(),
            out_len: m,
            src: send.as_ptr(),
            ..Meta::new(Op::ReduceScatter)
        };
        let peers = self.begin_checked(&mut seq, meta)?;
        {
            let _abort = AbortOnUnwind::new();
            let start = self.rank * m;
            // SAFETY: send buffers are only read; lengths checked; no mirror.
            unsafe { sum_in_rank_order(recv, None, self.world(), |q| peers.src(q, start, m)) };
        }
        self.shared.barrier.wait(self.rank)
    }

    fn all_to_all(
        &self,
        send: &[f32],
        send_counts: &[usize],
        recv: &mut Vec<f32>,
        recv_counts: &mut Vec<usize>,
    ) -> Result<(), CommError> {
        self.all_to_all_inner(send, send_counts, Some(recv), recv_counts)
    }

    fn barrier(&self) -> Result<(), CommError> {
        let mut seq = self.lock_seq();
        self.begin_checked(&mut seq, Meta::new(Op::Barrier))
            .map(|_| ())
    }
}

/// How long a waiter spins, then yields, before sleeping on the condvar: a
/// peer usually arrives within microseconds, and a sleep costs a futex
/// wake-up (tens of microseconds under load) on the critical path. With more
/// ranks than CPUs it skips the spin, which would only hold the CPU the
/// late rank needs.
const SPIN_FOR: Duration = Duration::from_micros(20);
const YIELD_FOR: Duration = Duration::from_micros(50);

/// A reusable barrier that can be poisoned. Each rank counts its arrivals
/// in its own cache line and waits until every count reaches its own: one
/// line transfer per peer, with no shared counter to bounce between cores.
/// Poison wakes every waiter with `PeerGone` unless its barrier already
/// completed.
struct Barrier {
    spin_for: Duration,
    arrivals: Box<[PaddedCount]>,
    poisoned: AtomicBool,
    /// Waiters parked on `cv`; arrivers only take the lock and notify when
    /// there are some.
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    cv: Condvar,
}

#[repr(align(128))]
struct PaddedCount(AtomicU64);

impl Barrier {
    fn new(world: usize) -> Self {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        Barrier {
            spin_for: if world <= cpus {
                SPIN_FOR
            } else {
                Duration::ZERO
            },
            arrivals: (0..world).map(|_| PaddedCount(AtomicU64::new(0))).collect(),
            poisoned: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            cv: Condvar::new(),
        }
    }

    /// Every rank has arrived `target` times (a rank may already be one
    /// barrier further on).
    fn complete(&self, target: u64) -> bool {
        self.arrivals
            .iter()
            .all(|a| a.0.load(Ordering::SeqCst) >= target)
    }

    // SeqCst throughout: the sleeper/arriver handshake (store arrival, load
    // sleepers vs. add sleeper, load arrivals) needs a total order, and the
    // arrival stores carry each rank's slot writes to the others.
    fn wait(&self, rank: usize) -> Result<(), CommError> {
        use Ordering::SeqCst;
        if self.poisoned.load(SeqCst) {
            // The leaver never arrives again, so this barrier cannot finish.
            return Err(CommError::PeerGone);
        }
        let mine = &self.arrivals[rank].0;
        // Only this rank writes its count.
        let target = mine.load(SeqCst) + 1;
        mine.store(target, SeqCst);
        if self.sleepers.load(SeqCst) > 0 {
            let _g = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
            self.cv.notify_all();
        }
        let start = Instant::now();
        let mut yielding = self.spin_for.is_zero();
        let mut spins = 0u32;
        loop {
            if self.complete(target) {
                return Ok(());
            }
            if self.poisoned.load(SeqCst) {
                break;
            }
            if yielding {
                if start.elapsed() > self.spin_for + YIELD_FOR {
                    break;
                }
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
                spins = spins.wrapping_add(1);
                // Reading the clock costs more than a pause: not every time.
                yielding = spins.is_multiple_of(32) && start.elapsed() > self.spin_for;
            }
        }
        let mut g = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
        self.sleepers.fetch_add(1, SeqCst);
        let result = loop {
            // A completed barrier wins over poison: a rank may leave right
            // after the last barrier it took part in.
            if self.complete(target) {
                break Ok(());
            }
            if self.poisoned.load(SeqCst) {
                break Err(CommError::PeerGone);
            }
            g = self.cv.wait(g).unwrap_or_else(PoisonError::into_inner);
        };
        self.sleepers.fetch_sub(1, SeqCst);
        result
    }

    fn poison(&self) {
        self.poisoned.store(true, Ordering::SeqCst);
        let _g = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
        self.cv.notify_all();
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    const WATCHDOG: Duration = Duration::from_secs(60);
    const LENS: [usize; 5] = [0, 1, 7, 1000, 4097];

    /// Runs `f` on every rank of a new group, one thread each; a rank that
    /// panics yields `Err(message)`. Fails the test (instead of hanging)
    /// if the ranks have not all finished within the watchdog.
    fn run_ranks<T, F>(world: usize, f: F) -> Vec<Result<T, String>>
    where
        T: Send + 'static,
        F: Fn(CpuComm) -> T + Send + Sync + 'static,
    {
        let f = Arc::new(f);
        let (tx, rx) = mpsc::channel();
        for comm in CpuGroup::new(world) {
            let (f, tx) = (Arc::clone(&f), tx.clone());
            std::thread::spawn(move || {
                let rank = comm.rank();
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(comm)));
                let r = r.map_err(|p| {
                    p.downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| p.downcast_ref::<String>().cloned())
                        .unwrap_or_default()
                });
                let _ = tx.send((rank, r));
            });
        }
        drop(tx);
        let deadline = Instant::now() + WATCHDOG;
        let mut out: Vec<Option<Result<T, String>>> = (0..world).map(|_| None).collect();
        for _ in 0..world {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok((rank, r)) => out[rank] = Some(r),
                Err(_) => panic!("collective hung: ranks did not finish within {WATCHDOG:?}"),
            }
        }
        out.into_iter().map(|r| r.unwrap()).collect()
    }

    fn ok<T>(results: Vec<Result<T, String>>) -> Vec<T> {
        results
            .into_iter()
            .enumerate()
            .map(|(rank, r)| r.unwrap_or_else(|e| panic!("rank {rank} panicked: {e}")))
            .collect()
    }

    /// Values of mixed magnitude and sign, so summation order shows in the
    /// bits.
    fn value(rank: usize, i: usize, salt: usize) -> f32 {
        let h = (rank * 0x9E37 + i * 0x85EB + salt * 0xC2B2 + 1) as u32;
        let h = h.wrapping_mul(0x27D4_EB2D) ^ (h >> 15);
        let mantissa = (h % 2001) as f32 / 1000.0 - 1.0;
        mantissa * [1e-3, 1.0, 1e3, 1e6][(h >> 11) as usize % 4]
    }

    fn input(rank: usize, n: usize, salt: usize) -> Vec<f32> {
        (0..n).map(|i| value(rank, i, salt)).collect()
    }

    /// Rank-order f32 sum, the contract's reference.
    fn reference_sum(world: usize, n: usize, salt: usize, offset: usize) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let mut acc = value(0, offset + i, salt);
                for q in 1..world {
                    acc += value(q, offset + i, salt);
                }
                acc
            })
            .collect()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn all_reduce_matches_rank_order_reference_bitwise() {
        for world in 1..=4 {
            let got = ok(run_ranks(world, move |c| {
                let mut outs = Vec::new();
                // One group for every length: partials are reused, grown
                // and shrunk between calls.
                for (salt, &n) in LENS.iter().chain(LENS.iter().rev()).enumerate() {
                    let mut buf = input(c.rank(), n, salt);
                    c.all_reduce_sum(&mut buf).unwrap();
                    outs.push(buf);
                }
                outs
            }));
            for (salt, &n) in LENS.iter().chain(LENS.iter().rev()).enumerate() {
                let want = bits(&reference_sum(world, n, salt, 0));
                for (rank, outs) in got.iter().enumerate() {
                    assert_eq!(bits(&outs[salt]), want, "world {world} n {n} rank {rank}");
                }
            }
        }
    }

    #[test]
    fn all_reduce_sums_in_rank_order_not_another() {
        // (1e8 + 1) + -1e8 + 3 == 3 in f32, while 1 + 3 + (1e8 + -1e8) == 4.
        let got = ok(run_ranks(4, |c| {
            let mut buf = vec![[1e8f32, 1.0, -1e8, 3.0][c.rank()]; 33];
            c.all_reduce_sum(&mut buf).unwrap();
            buf
        }));
        for buf in got {
            assert!(buf.iter().all(|&x| x == 3.0), "{buf:?}");
        }
    }

    #[test]
    fn all_gather_matches_reference() {
        for world in 1..=4 {
            let got = ok(run_ranks(world, move |c| {
                LENS.iter()
                    .enumerate()
                    .map(|(salt, &n)| {
                        let send = input(c.rank(), n, salt);
                        let mut recv = vec![f32::NAN; world * n];
                        c.all_gather(&send, &mut recv).unwrap();
                        recv
                    })
                    .collect::<Vec<_>>()
            }));
            for (salt, &n) in LENS.iter().enumerate() {
                let want: Vec<f32> = (0..world).flat_map(|q| input(q, n, salt)).collect();
                for outs in &got {
                    assert_eq!(bits(&outs[salt]), bits(&want), "world {world} n {n}");
                }
            }
        }
    }

    #[test]
    fn reduce_scatter_matches_reference() {
        for world in 1..=4 {
            let got = ok(run_ranks(world, move |c| {
                LENS.iter()
                    .enumerate()
                    .map(|(salt, &m)| {
                        let send = input(c.rank(), world * m, salt);
                        let mut recv = vec![f32::NAN; m];
                        c.reduce_scatter_sum(&send, &mut recv).unwrap();
                        recv
                    })
                    .collect::<Vec<_>>()
            }));
            for (salt, &m) in LENS.iter().enumerate() {
                for (rank, outs) in got.iter().enumerate() {
                    let want = reference_sum(world, m, salt, rank * m);
                    assert_eq!(bits(&outs[salt]), bits(&want), "world {world} m {m}");
                }
            }
        }
    }

    /// How many elements rank `q` sends to rank `p` in round `round`: uneven,
    /// often zero, and in round 2 rank 1 sends nothing at all.
    fn a2a_count(q: usize, p: usize, round: usize) -> usize {
        if round == 2 && q == 1 {
            return 0;
        }
        [0, 3, 1, 0, 7, 1000, 2][(q * 5 + p * 3 + round) % 7]
    }

    fn a2a_send(q: usize, world: usize, round: usize) -> (Vec<f32>, Vec<usize>) {
        let counts: Vec<usize> = (0..world).map(|p| a2a_count(q, p, round)).collect();
        let send = (0..counts.iter().sum())
            .map(|i| (q * 100_000 + round * 10_000 + i) as f32)
            .collect();
        (send, counts)
    }

    #[test]
    fn all_to_all_uneven_and_zero_counts() {
        for world in 1..=4 {
            let got = ok(run_ranks(world, move |c| {
                (0..4)
                    .map(|round| {
                        let (send, counts) = a2a_send(c.rank(), world, round);
                        let (mut recv, mut recv_counts) = (vec![f32::NAN; 5], vec![9; 9]);
                        c.all_to_all(&send, &counts, &mut recv, &mut recv_counts)
                            .unwrap();
                        (recv, recv_counts)
                    })
                    .collect::<Vec<_>>()
            }));
            for (p, outs) in got.iter().enumerate() {
                for (round, (recv, recv_counts)) in outs.iter().enumerate() {
                    let mut want = Vec::new();
                    let mut want_counts = Vec::new();
                    for q in 0..world {
                        let (send, counts) = a2a_send(q, world, round);
                        let start: usize = counts[..p].iter().sum();
                        want.extend_from_slice(&send[start..start + counts[p]]);
                        want_counts.push(counts[p]);
                    }
                    assert_eq!(
                        recv_counts, &want_counts,
                        "world {world} rank {p} round {round}"
                    );
                    assert_eq!(recv, &want, "world {world} rank {p} round {round}");
                }
            }
        }
    }

    #[test]
    fn barrier_separates_phases() {
        for world in 1..=4 {
            let counter = Arc::new(AtomicUsize::new(0));
            let c2 = Arc::clone(&counter);
            ok(run_ranks(world, move |c| {
                for round in 1..=50 {
                    c2.fetch_add(1, Ordering::SeqCst);
                    c.barrier().unwrap();
                    assert_eq!(c2.load(Ordering::SeqCst), round * world);
                    c.barrier().unwrap();
                }
            }));
            assert_eq!(counter.load(Ordering::SeqCst), 50 * world);
        }
    }

    #[test]
    fn mixed_collectives_stress() {
        // Many back-to-back calls of varying shapes: exercises descriptor
        // parity and partial reuse with ranks drifting apart.
        for world in [2, 3, 4] {
            let got = ok(run_ranks(world, move |c| {
                let mut mismatches = 0;
                for it in 0..300 {
                    let n = (it * 37) % 300;
                    let mut buf = input(c.rank(), n, it);
                    c.all_reduce_sum(&mut buf).unwrap();
                    if bits(&buf) != bits(&reference_sum(world, n, it, 0)) {
                        mismatches += 1;
                    }
                    let send = input(c.rank(), n % 17, it);
                    let mut recv = vec![0.0; world * send.len()];
                    c.all_gather(&send, &mut recv).unwrap();
                    let want: Vec<f32> = (0..world).flat_map(|q| input(q, n % 17, it)).collect();
                    if bits(&recv) != bits(&want) {
                        mismatches += 1;
                    }
                }
                mismatches
            }));
            assert!(got.iter().all(|&m| m == 0), "world {world}: {got:?}");
        }
    }

    #[test]
    fn size_mismatch_is_an_error_on_every_rank_and_the_group_survives() {
        let got = ok(run_ranks(3, |c| {
            let r = c.rank();
            let mut errs = Vec::new();
            let mut buf = vec![1.0; if r == 2 { 12 } else { 10 }];
            errs.push(c.all_reduce_sum(&mut buf).unwrap_err());
            let send = vec![1.0; 4];
            let mut recv = vec![0.0; if r == 1 { 11 } else { 12 }];
            errs.push(c.all_gather(&send, &mut recv).unwrap_err());
            let send = vec![1.0; if r == 0 { 8 } else { 9 }];
            let mut recv = vec![0.0; 3];
            errs.push(c.reduce_scatter_sum(&send, &mut recv).unwrap_err());
            let (mut out, mut out_counts) = (Vec::new(), Vec::new());
            let counts = if r == 1 { vec![1, 1] } else { vec![1, 1, 1] };
            errs.push(
                c.all_to_all(&[0.0; 3], &counts, &mut out, &mut out_counts)
                    .unwrap_err(),
            );
            errs.push(
                c.all_to_all(&[0.0; 3], &[1, 1, 2], &mut out, &mut out_counts)
                    .unwrap_err(),
            );
            // Still usable: a consistent call works.
            let mut buf = vec![r as f32; 10];
            c.all_reduce_sum(&mut buf).unwrap();
            assert_eq!(buf, vec![3.0; 10]);
            errs
        }));
        let want = [
            CommError::SizeMismatch {
                op: "all_reduce_sum",
                rank: 2,
                what: "a buffer",
                expected: 10,
                actual: 12,
            },
            CommError::SizeMismatch {
                op: "all_gather",
                rank: 1,
                what: "recv",
                expected: 12,
                actual: 11,
            },
            CommError::SizeMismatch {
                op: "reduce_scatter_sum",
                rank: 0,
                what: "send",
                expected: 9,
                actual: 8,
            },
            CommError::SizeMismatch {
                op: "all_to_all",
                rank: 1,
                what: "send_counts",
                expected: 3,
                actual: 2,
            },
            CommError::SizeMismatch {
                op: "all_to_all",
                rank: 0,
                what: "send (vs. the sum of its send_counts)",
                expected: 4,
                actual: 3,
            },
        ];
        for errs in &got {
            assert_eq!(errs.as_slice(), &want);
        }
        let msg = want[0].to_string();
        assert!(msg.contains("12") && msg.contains("10"), "{msg}");
    }

    #[test]
    fn diverged_call_order_is_an_error_on_every_rank() {
        let got = ok(run_ranks(2, |c| {
            let e = if c.rank() == 0 {
                c.barrier().unwrap_err()
            } else {
                c.all_to_all(&[], &[0, 0], &mut Vec::new(), &mut Vec::new())
                    .unwrap_err()
            };
            c.barrier().unwrap();
            e
        }));
        for e in got {
            assert_eq!(
                e,
                CommError::OpMismatch {
                    rank: 1,
                    expected: "barrier",
                    actual: "all_to_all"
                }
            );
        }
    }

    #[test]
    fn a_rank_that_leaves_makes_its_peers_fail_not_hang() {
        for world in [2, 3] {
            let got = ok(run_ranks(world, move |c| {
                let last = world - 1;
                let mut results = Vec::new();
                for i in 0..3 {
                    if c.rank() == last && i == 2 {
                        // Let the others park on the condvar first.
                        std::thread::sleep(Duration::from_millis(50));
                        drop(c);
                        return results;
                    }
                    let mut buf = vec![1.0; 100];
                    results.push(c.all_reduce_sum(&mut buf).map(|()| buf[0]));
                }
                results.push(c.barrier().map(|()| 0.0));
                results
            }));
            for (rank, results) in got.iter().enumerate() {
                let n = world as f32;
                if rank == world - 1 {
                    assert_eq!(results, &[Ok(n), Ok(n)]);
                } else {
                    assert_eq!(
                        results,
                        &[
                            Ok(n),
                            Ok(n),
                            Err(CommError::PeerGone),
                            Err(CommError::PeerGone)
                        ]
                    );
                }
            }
        }
    }

    #[test]
    fn a_rank_that_panics_makes_its_peers_fail_not_hang() {
        let got = run_ranks(4, |c| {
            let mut buf = vec![1.0; 64];
            c.all_reduce_sum(&mut buf).unwrap();
            if c.rank() == 1 {
                panic!("rank 1 fails on purpose");
            }
            let mut recv = vec![0.0; 4 * 64];
            c.all_gather(&buf, &mut recv)
        });
        for (rank, r) in got.into_iter().enumerate() {
            match r {
                Err(msg) => {
                    assert_eq!(rank, 1);
                    assert!(msg.contains("on purpose"));
                }
                Ok(res) => assert_eq!(res, Err(CommError::PeerGone), "rank {rank}"),
            }
        }
    }

    #[test]
    fn world_of_one_and_zero() {
        assert!(CpuGroup::new(0).is_empty());
        let c = CpuGroup::new(1).pop().unwrap();
        assert_eq!((c.rank(), c.world_size()), (0, 1));
        let mut buf = vec![1.5, -2.0];
        c.all_reduce_sum(&mut buf).unwrap();
        assert_eq!(buf, [1.5, -2.0]);
        c.barrier().unwrap();
    }

    #[test]
    fn handles_are_object_safe_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<CpuComm>();
        let comms: Vec<Arc<dyn Communicator>> = CpuGroup::new(2)
            .into_iter()
            .map(|c| Arc::new(c) as Arc<dyn Communicator>)
            .collect();
        assert_eq!(comms[1].rank(), 1);
    }

    #[test]
    fn chunks_cover_the_buffer_in_order() {
        for world in 1..=5 {
            for n in [0, 1, 15, 16, 17, 576, 1000, 4097] {
                assert_eq!(chunk_start(n, world, 0), 0);
                assert_eq!(chunk_start(n, world, world), n);
                for q in 0..world {
                    assert!(chunk_start(n, world, q) <= chunk_start(n, world, q + 1));
                }
            }
        }
        assert_eq!(chunk_start(576, 2, 1), 288);
    }
}
