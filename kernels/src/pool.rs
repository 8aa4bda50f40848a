//! A persistent fork-join worker pool, and the process-wide one the
//! kernels share ([`set_num_threads`], [`num_threads`]).
//!
//! `threads - 1` workers are spawned once; the calling thread takes part as
//! worker 0. A call publishes the job in shared slots and bumps a generation
//! counter; workers spin on that counter for a short while after each job and
//! then park, so back-to-back calls (a decode step issues hundreds) cost a
//! few hundred nanoseconds while an idle pool costs no CPU. The caller waits
//! for the workers the same way (spin, then park until the last worker
//! unparks it). Nothing is allocated or spawned per call.
//!
//! Work is split into one contiguous index range per worker, identically for
//! the same `n` and thread count. A call made from inside a job (or while
//! another thread is dispatching) runs inline on the calling thread. A panic
//! in a job is caught, every worker is waited for, and the first payload is
//! re-raised on the caller.

use std::any::Any;
use std::cell::{Cell, UnsafeCell};
use std::ops::Range;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Mutex, OnceLock};
use std::thread::{self, Thread};
use std::time::{Duration, Instant};

use crate::error::KernelError;

/// The job shape the workers run.
type RangeFn<'a> = dyn Fn(usize, Range<usize>) + Sync + 'a;

/// How long an idle worker (or a waiting caller) spins before parking.
const SPIN: Duration = Duration::from_micros(200);
/// Busy-wait iterations (`pause`, tens of ns each) before a waiter starts
/// yielding its core for the rest of `SPIN`.
const PURE_SPINS: u32 = 2000;

thread_local! {
    /// Set on pool workers and on a caller while it dispatches: a nested call
    /// then runs inline instead of waiting for itself.
    static IN_POOL: Cell<bool> = const { Cell::new(false) };
}

struct Job {
    /// Lifetime-erased pointer to the caller's closure; only dereferenced
    /// between the generation bump and the worker's `pending` decrement,
    /// while the caller is blocked in `dispatch`.
    f: *const RangeFn<'static>,
    n: usize,
}

struct Shared {
    threads: usize,
    /// Bumped once per dispatched job.
    generation: AtomicU64,
    /// Written by the dispatching caller only while every worker is idle
    /// (before the generation bump); read by workers after they observe it.
    job: UnsafeCell<Job>,
    /// Workers that have not finished the current job.
    pending: AtomicUsize,
    /// Held by the dispatching caller.
    busy: AtomicBool,
    /// Per worker (index 1..threads): parked or about to park.
    sleeping: Box<[AtomicBool]>,
    /// Worker thread handles, index 1..threads (index 0 unused).
    handles: OnceLock<Box<[Thread]>>,
    /// The caller parks waiting for the last worker.
    caller_sleeping: AtomicBool,
    caller: Mutex<Option<Thread>>,
    /// First panic payload of the current job.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

// SAFETY: `job` is only written by the thread holding `busy` while no worker
// reads it (all workers finished the previous job, `pending == 0`, and the
// next generation is not yet published); workers read it only after an
// acquiring (SeqCst) load of the bumped generation. The closure behind
// `Job::f` is `Sync`.
unsafe impl Sync for Shared {}
// SAFETY: as above; the raw pointer is only a borrowed `Sync` closure.
unsafe impl Send for Shared {}

/// The range of worker `i` out of `t` for `n` items: contiguous, sizes
/// differing by at most one, larger ones first.
pub(crate) fn split(n: usize, t: usize, i: usize) -> Range<usize> {
    let base = n / t;
    let rem = n % t;
    let start = i * base + i.min(rem);
    start..start + base + usize::from(i < rem)
}

fn noop(_: usize, _: Range<usize>) {}

fn run_catching(f: &RangeFn<'_>, i: usize, r: Range<usize>) -> Option<Box<dyn Any + Send>> {
    if r.is_empty() {
        return None;
    }
    catch_unwind(AssertUnwindSafe(|| f(i, r))).err()
}

fn worker_loop(sh: &'static Shared, idx: usize) {
    IN_POOL.with(|c| c.set(true));
    // The initial generation: a worker that starts late still sees the
    // first job as new.
    let mut seen = 0u64;
    loop {
        // Wait for a new generation: spin, then park.
        let mut start = Instant::now();
        let mut spins = 0u32;
        loop {
            if sh.generation.load(SeqCst) != seen {
                break;
            }
            spins = spins.saturating_add(1);
            if spins < PURE_SPINS {
                std::hint::spin_loop();
            } else if start.elapsed() < SPIN {
                // On an oversubscribed machine the thread we wait for may
                // need this core.
                thread::yield_now();
            } else {
                sh.sleeping[idx].store(true, SeqCst);
                if sh.generation.load(SeqCst) == seen {
                    thread::park();
                }
                sh.sleeping[idx].store(false, SeqCst);
                spins = 0;
                start = Instant::now();
            }
        }
        seen = sh.generation.load(SeqCst);
        // SAFETY: the generation bump published the job; the caller keeps
        // `job` and the closure alive until `pending` reaches zero, which
        // needs this worker's decrement below.
        let (f, n) = unsafe {
            let job = &*sh.job.get();
            (&*job.f, job.n)
        };
        if let Some(p) = run_catching(f, idx, split(n, sh.threads, idx)) {
            let mut slot = sh.panic.lock().unwrap_or_else(|e| e.into_inner());
            if slot.is_none() {
                *slot = Some(p);
            }
        }
        if sh.pending.fetch_sub(1, SeqCst) == 1 && sh.caller_sleeping.load(SeqCst) {
            let c = sh.caller.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(t) = c.as_ref() {
                // A stale handle only causes a spurious wakeup, which every
                // park loop tolerates.
                t.unpark();
            }
        }
    }
}

/// The pool: `None` when single threaded.
#[derive(Debug)]
pub(crate) struct Pool {
    shared: Option<&'static Shared>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("threads", &self.threads)
            .finish_non_exhaustive()
    }
}

impl Pool {
    /// Spawns `threads - 1` workers.
    pub(crate) fn new(threads: usize) -> Result<Pool, KernelError> {
        if threads <= 1 {
            return Ok(Pool { shared: None });
        }
        let sh: &'static Shared = Box::leak(Box::new(Shared {
            threads,
            generation: AtomicU64::new(0),
            job: UnsafeCell::new(Job {
                f: &noop as &'static RangeFn<'static> as *const RangeFn<'static>,
                n: 0,
            }),
            pending: AtomicUsize::new(0),
            busy: AtomicBool::new(false),
            sleeping: (0..threads).map(|_| AtomicBool::new(false)).collect(),
            handles: OnceLock::new(),
            caller_sleeping: AtomicBool::new(false),
            caller: Mutex::new(None),
            panic: Mutex::new(None),
        }));
        let mut handles = Vec::with_capacity(threads);
        handles.push(thread::current());
        for idx in 1..threads {
            let h = thread::Builder::new()
                .name(format!("tandem-kernels-{idx}"))
                .spawn(move || worker_loop(sh, idx))
                .map_err(|e| KernelError::ThreadPool(e.to_string()))?;
            handles.push(h.thread().clone());
        }
        // Workers only touch `handles` through the dispatcher, which needs
        // the pool (and so this `set`) first.
        let _ = sh.handles.set(handles.into_boxed_slice());
        Ok(Pool { shared: Some(sh) })
    }

    /// A pool that runs everything on the caller.
    pub(crate) fn single() -> Pool {
        Pool { shared: None }
    }

    /// Threads taking part in a call, the caller included.
    pub(crate) fn threads(&self) -> usize {
        self.shared.map_or(1, |s| s.threads)
    }

    /// See [`parallel_ranges`].
    pub(crate) fn run(&self, n: usize, f: &RangeFn<'_>) {
        let Some(sh) = self.shared else {
            if n > 0 {
                f(0, 0..n);
            }
            return;
        };
        if n == 0 {
            return;
        }
        let threads = sh.threads;
        // Inline when nested, trivially small, or another thread is
        // dispatching: same per-index results, no waiting on ourselves.
        if n == 1 || IN_POOL.with(|c| c.get()) || sh.busy.swap(true, SeqCst) {
            for i in 0..threads {
                let r = split(n, threads, i);
                if !r.is_empty() {
                    f(i, r);
                }
            }
            return;
        }
        IN_POOL.with(|c| c.set(true));
        // SAFETY: we hold `busy` and the previous job completed
        // (`pending == 0`), so no worker reads `job` now. The erased
        // lifetime is sound because we return only after every worker has
        // finished with the closure (`pending == 0` below).
        unsafe {
            let job = &mut *sh.job.get();
            job.f = std::mem::transmute::<&RangeFn<'_>, &'static RangeFn<'static>>(f)
                as *const RangeFn<'static>;
            job.n = n;
        }
        sh.pending.store(threads - 1, SeqCst);
        sh.generation.fetch_add(1, SeqCst);
        if let Some(hs) = sh.handles.get() {
            for (idx, h) in hs.iter().enumerate().skip(1) {
                if sh.sleeping[idx].load(SeqCst) {
                    h.unpark();
                }
            }
        }
        let mine = run_catching(f, 0, split(n, threads, 0));
        self.wait(sh);
        let theirs = sh.panic.lock().unwrap_or_else(|e| e.into_inner()).take();
        IN_POOL.with(|c| c.set(false));
        sh.busy.store(false, SeqCst);
        if let Some(p) = mine.or(theirs) {
            resume_unwind(p);
        }
    }

    fn wait(&self, sh: &Shared) {
        let start = Instant::now();
        let mut spins = 0u32;
        while sh.pending.load(SeqCst) != 0 {
            spins = spins.saturating_add(1);
            if spins < PURE_SPINS {
                std::hint::spin_loop();
                continue;
            }
            if start.elapsed() < SPIN {
                thread::yield_now();
                continue;
            }
            *sh.caller.lock().unwrap_or_else(|e| e.into_inner()) = Some(thread::current());
            sh.caller_sleeping.store(true, SeqCst);
            while sh.pending.load(SeqCst) != 0 {
                thread::park();
            }
            sh.caller_sleeping.store(false, SeqCst);
            *sh.caller.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
    }
}

static POOL: OnceLock<Pool> = OnceLock::new();

fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// The process-wide worker pool, built on first use with the default size. If the workers
/// cannot be spawned, work runs on the caller's thread.
pub(crate) fn pool() -> &'static Pool {
    POOL.get_or_init(|| Pool::new(default_threads()).unwrap_or_else(|_| Pool::single()))
}

/// Sets the number of kernel worker threads (the calling thread counts as
/// one of them).
///
/// The pool is built once per process. Call this before the first `matmul`
/// (or `num_threads`, `parallel_for`) to choose its size; afterwards a call
/// with the same count is a no-op returning `Ok`, and a call with a different
/// count returns [`KernelError::ThreadPoolAlreadyInitialized`] and changes
/// nothing. `n == 0` is rejected.
pub fn set_num_threads(n: usize) -> Result<(), KernelError> {
    if n == 0 {
        return Err(KernelError::InvalidThreadCount(n));
    }
    let mut err = None;
    let got = POOL.get_or_init(|| match Pool::new(n) {
        Ok(p) => p,
        Err(e) => {
            err = Some(e);
            Pool::single()
        }
    });
    if let Some(e) = err {
        return Err(e);
    }
    let current = got.threads();
    if current == n {
        Ok(())
    } else {
        Err(KernelError::ThreadPoolAlreadyInitialized {
            current,
            requested: n,
        })
    }
}

/// Number of kernel worker threads (builds the default pool if needed).
pub fn num_threads() -> usize {
    pool().threads()
}

/// Runs `f(i)` for every `i` in `0..n` across the pool (calling thread
/// included); returns when all are done. Work is split in contiguous index
/// ranges, one per worker, deterministically (same split for the same `n`
/// and thread count).
pub fn parallel_for(n: usize, f: &(dyn Fn(usize) + Sync)) {
    parallel_ranges(n, &|_, r: Range<usize>| {
        for i in r {
            f(i);
        }
    });
}

/// Like [`parallel_for`] but hands each worker its contiguous range once:
/// `f(worker_index, range)`. Empty ranges are skipped.
pub fn parallel_ranges(n: usize, f: &(dyn Fn(usize, Range<usize>) + Sync)) {
    pool().run(n, f);
}

/// Runs `f(i, chunk)` for every `chunk_len`-sized chunk of `data` (the last
/// may be shorter) across the pool, each chunk handed to exactly one worker.
pub fn parallel_chunks_mut<T: Send>(
    data: &mut [T],
    chunk_len: usize,
    f: &(dyn Fn(usize, &mut [T]) + Sync),
) {
    assert!(chunk_len > 0, "chunk_len must be positive");
    let len = data.len();
    let n = len.div_ceil(chunk_len);
    let base = SendPtr(data.as_mut_ptr());
    parallel_ranges(n, &|_, r: Range<usize>| {
        let base = &base;
        for i in r {
            let start = i * chunk_len;
            let end = (start + chunk_len).min(len);
            // SAFETY: chunk `i` is `start..end` of `data`, in bounds, and every
            // index `i` goes to exactly one worker, so no two threads alias;
            // `data` is borrowed mutably for the whole call.
            let chunk = unsafe { std::slice::from_raw_parts_mut(base.0.add(start), end - start) };
            f(i, chunk);
        }
    });
}

/// What [`parallel_rows2`] runs per row: `(row, a row, b row)`.
pub type RowPairFn<'a, A, B> = dyn Fn(usize, &mut [A], &mut [B]) + Sync + 'a;

/// Runs `f(i, a_i, b_i)` for every row `i` of two buffers cut into rows of
/// `a_row` and `b_row` elements (both must hold the same number of whole
/// rows), across the pool, each row handed to exactly one worker.
///
/// # Panics
/// If a row length is zero or the buffers do not hold the same whole
/// number of rows (a caller bug, not an input error).
pub fn parallel_rows2<A: Send, B: Send>(
    a: &mut [A],
    a_row: usize,
    b: &mut [B],
    b_row: usize,
    f: &RowPairFn<'_, A, B>,
) {
    assert!(a_row > 0 && b_row > 0, "row lengths must be positive");
    let n = a.len() / a_row;
    assert!(
        a.len() == n * a_row && b.len() == n * b_row,
        "buffers must hold the same number of whole rows"
    );
    let (pa, pb) = (SendPtr(a.as_mut_ptr()), SendPtr(b.as_mut_ptr()));
    parallel_ranges(n, &|_, r: Range<usize>| {
        let (pa, pb) = (&pa, &pb);
        for i in r {
            // SAFETY: row `i` of each buffer is in bounds (checked above) and
            // every index goes to exactly one worker, so no two threads
            // alias; both buffers are borrowed mutably for the whole call.
            let (ra, rb) = unsafe {
                (
                    std::slice::from_raw_parts_mut(pa.0.add(i * a_row), a_row),
                    std::slice::from_raw_parts_mut(pb.0.add(i * b_row), b_row),
                )
            };
            f(i, ra, rb);
        }
    });
}

/// A raw pointer that may cross threads; soundness is argued at each use.
struct SendPtr<T>(*mut T);
// SAFETY: only used by `parallel_chunks_mut` and `parallel_rows2`, which
// hand out disjoint chunks.
unsafe impl<T: Send> Sync for SendPtr<T> {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn parallel_chunks_mut_visits_each_chunk_once() {
        let mut v = vec![0usize; 103];
        parallel_chunks_mut(&mut v, 10, &|i, c| {
            for x in c.iter_mut() {
                *x += i + 1;
            }
        });
        for (j, &x) in v.iter().enumerate() {
            assert_eq!(x, j / 10 + 1);
        }
        let mut empty: [u8; 0] = [];
        parallel_chunks_mut(&mut empty, 4, &|_, _| panic!("no chunks"));
    }

    #[test]
    fn parallel_rows2_pairs_rows_of_both_buffers() {
        let (mut a, mut b) = (vec![0usize; 3 * 37], vec![0u32; 5 * 37]);
        parallel_rows2(&mut a, 3, &mut b, 5, &|i, ra, rb| {
            ra.fill(i);
            rb.fill(i as u32 * 2);
        });
        for i in 0..37 {
            assert!(a[i * 3..i * 3 + 3].iter().all(|&v| v == i));
            assert!(b[i * 5..i * 5 + 5].iter().all(|&v| v == i as u32 * 2));
        }
        let (mut e, mut f) = ([0u8; 0], [0u8; 0]);
        parallel_rows2(&mut e, 2, &mut f, 3, &|_, _, _| panic!("no rows"));
    }

    #[test]
    fn split_covers_exactly() {
        for n in 0..50 {
            for t in 1..9 {
                let mut next = 0;
                for i in 0..t {
                    let r = split(n, t, i);
                    assert_eq!(r.start, next);
                    assert!(r.len() <= n / t + 1);
                    next = r.end;
                }
                assert_eq!(next, n);
            }
        }
    }

    fn check_pool(p: &Pool) {
        for n in [0usize, 1, 2, 3, 17, 1000] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            p.run(n, &|w, r| {
                assert_eq!(r, split(n, p.threads(), w));
                for i in r {
                    hits[i].fetch_add(1, SeqCst);
                }
            });
            assert!(hits.iter().all(|h| h.load(SeqCst) == 1), "n={n}");
        }
    }

    #[test]
    fn private_pools_run_every_index_once() {
        for t in [1, 2, 3, 5] {
            let p = Pool::new(t).expect("pool");
            assert_eq!(p.threads(), t);
            for _ in 0..200 {
                check_pool(&p);
            }
        }
    }

    #[test]
    fn nested_calls_run_inline() {
        let p = Pool::new(3).expect("pool");
        let total = AtomicUsize::new(0);
        p.run(6, &|_, r| {
            for _ in r {
                p.run(4, &|_, r2| {
                    total.fetch_add(r2.len(), SeqCst);
                });
                parallel_for(5, &|_| {
                    total.fetch_add(1, SeqCst);
                });
            }
        });
        assert_eq!(total.load(SeqCst), 6 * 9);
    }

    #[test]
    fn panics_propagate_and_pool_survives() {
        let p = Pool::new(3).expect("pool");
        for bad in [0usize, 5, 9] {
            let r = catch_unwind(AssertUnwindSafe(|| {
                p.run(10, &|_, r| {
                    if r.contains(&bad) {
                        panic!("boom {bad}");
                    }
                })
            }));
            assert!(r.is_err(), "panic at {bad} must propagate");
        }
        check_pool(&p);
    }

    #[test]
    fn concurrent_callers() {
        let p = Pool::new(2).expect("pool");
        thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..300 {
                        check_pool(&p);
                    }
                });
            }
        });
    }

    #[test]
    fn wakes_after_parking() {
        let p = Pool::new(2).expect("pool");
        check_pool(&p);
        thread::sleep(SPIN * 5);
        check_pool(&p);
        // Slow job: the caller parks while the worker finishes.
        p.run(2, &|w, _| {
            if w == 1 {
                thread::sleep(SPIN * 3);
            }
        });
    }

    #[test]
    fn global_parallel_for() {
        let sum = AtomicUsize::new(0);
        parallel_for(1000, &|i| {
            sum.fetch_add(i, SeqCst);
        });
        assert_eq!(sum.load(SeqCst), 999 * 1000 / 2);
    }
}
