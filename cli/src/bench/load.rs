//! Load generation: requests (or multi-turn sessions' turns) sent under a
//! concurrency cap, optionally at Poisson arrival times, with a progress
//! line.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tandem_types::SeededRng;
use tokio::sync::Semaphore;

use super::prompts::Spec;
use super::request::{Outcome, Shared, run_one};
use super::session::Session;

/// The seconds to the next Poisson arrival at `rate` per second: an
/// exponential draw, `-ln(u) / rate` with `u` uniform in (0, 1] (`unit_f64`
/// is in [0, 1) on a 2^-53 grid, so adding 2^-53 is exact and never 0).
pub(super) fn next_arrival(rng: &mut SeededRng, rate: f64) -> f64 {
    let u = rng.unit_f64() + f64::EPSILON / 2.0;
    -u.ln() / rate
}

pub(super) async fn run_point(
    sh: Arc<Shared>,
    specs: &[Spec],
    concurrency: Option<usize>,
    rate: Option<f64>,
    seed: u64,
    quiet: bool,
) -> (f64, Vec<Outcome>) {
    let total = specs.len();
    let sem = concurrency.map(|c| Arc::new(Semaphore::new(c.max(1))));
    let done = Arc::new(AtomicUsize::new(0));
    let errors = Arc::new(AtomicUsize::new(0));
    let mut arrivals = SeededRng::new(seed ^ 0xA5A5_5A5A_DEAD_BEEF);
    let start = Instant::now();
    let mut next_at = 0.0f64;
    let mut handles = Vec::with_capacity(total);
    let progress = move |done: usize, errors: usize| {
        if !quiet {
            eprint!("\r  {done}/{total} done, {errors} errors ");
        }
    };
    progress(0, 0);
    for spec in specs {
        if let Some(r) = rate {
            tokio::time::sleep_until((start + Duration::from_secs_f64(next_at)).into()).await;
            next_at += next_arrival(&mut arrivals, r);
        }
        let permit = match &sem {
            Some(sem) => Some(Arc::clone(sem).acquire_owned().await),
            None => None,
        };
        let spec = spec.clone();
        let sh = Arc::clone(&sh);
        let (done, errors) = (Arc::clone(&done), Arc::clone(&errors));
        handles.push(tokio::spawn(async move {
            let o = run_one(&sh, &spec).await;
            drop(permit);
            let e = errors.fetch_add(usize::from(!o.ok), Ordering::Relaxed) + usize::from(!o.ok);
            let d = done.fetch_add(1, Ordering::Relaxed) + 1;
            progress(d, e);
            o
        }));
    }
    let mut outs = Vec::with_capacity(total);
    for h in handles {
        outs.push(h.await.unwrap_or_else(|e| Outcome {
            error: Some(format!("task failed: {e}")),
            ..Outcome::default()
        }));
    }
    let dur = start.elapsed().as_secs_f64();
    if !quiet {
        eprintln!();
    }
    (dur, outs)
}

/// Sends a turn's outcome to the session driver when dropped, so that a
/// panicking turn is reported as failed instead of hanging the driver.
struct TurnDone {
    /// None once sent.
    tx: Option<tokio::sync::mpsc::UnboundedSender<(usize, Outcome)>>,
    session: usize,
    turn: usize,
}

impl TurnDone {
    fn send(&mut self, o: Outcome) {
        // The driver waits for every turn, so its receiver is still open.
        if let Some(tx) = self.tx.take() {
            let _ = tx.send((self.session, o));
        }
    }
}

impl Drop for TurnDone {
    fn drop(&mut self) {
        self.send(Outcome {
            turn: self.turn,
            error: Some("task failed".into()),
            ..Outcome::default()
        });
    }
}

/// Runs multi-turn sessions (see the module doc for the schedule);
/// `run_turn` sends one request.
pub(super) async fn run_sessions<F, Fut>(
    sessions: Vec<Vec<Spec>>,
    concurrency: Option<usize>,
    rate: Option<f64>,
    seed: u64,
    block_size: usize,
    quiet: bool,
    run_turn: F,
) -> (f64, Vec<Outcome>)
where
    F: Fn(Spec) -> Fut,
    Fut: Future<Output = Outcome> + Send + 'static,
{
    let total: usize = sessions.iter().map(Vec::len).sum();
    let mut state: Vec<Session> = sessions.into_iter().map(Session::new).collect();
    let mut ready: VecDeque<usize> = (0..state.len()).filter(|&i| state[i].pending()).collect();
    let sem = concurrency.map(|c| Arc::new(Semaphore::new(c.max(1))));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(usize, Outcome)>();
    let done = Arc::new(AtomicUsize::new(0));
    let errors = Arc::new(AtomicUsize::new(0));
    let mut arrivals = SeededRng::new(seed ^ 0xA5A5_5A5A_DEAD_BEEF);
    let start = Instant::now();
    let mut next_at = 0.0f64;
    let mut in_flight = 0usize;
    let mut outs = Vec::with_capacity(total);
    let progress = move |done: usize, errors: usize| {
        if !quiet {
            eprint!("\r  {done}/{total} done, {errors} errors ");
        }
    };
    progress(0, 0);
    loop {
        // Take in finished turns; block for one only when no turn is ready.
        loop {
            let msg = if ready.is_empty() && in_flight > 0 {
                rx.recv().await
            } else {
                rx.try_recv().ok()
            };
            let Some((i, mut o)) = msg else {
                break;
            };
            in_flight -= 1;
            let s = &mut state[i];
            s.finish(&mut o, block_size);
            outs.push(o);
            if s.pending() {
                ready.push_back(i);
            } else if s.failed {
                let skipped = s.skip_rest();
                let n = skipped.len();
                outs.extend(skipped);
                progress(
                    done.fetch_add(n, Ordering::Relaxed) + n,
                    errors.fetch_add(n, Ordering::Relaxed) + n,
                );
            }
        }
        if ready.is_empty() {
            break; // and nothing in flight
        }
        if let Some(r) = rate {
            tokio::time::sleep_until((start + Duration::from_secs_f64(next_at)).into()).await;
            next_at += next_arrival(&mut arrivals, r);
        }
        let permit = match &sem {
            Some(sem) => Some(Arc::clone(sem).acquire_owned().await),
            None => None,
        };
        let Some(i) = ready.pop_front() else {
            break;
        };
        let spec = state[i].next_spec();
        let mut reply = TurnDone {
            tx: Some(tx.clone()),
            session: i,
            turn: spec.turn,
        };
        let turn = run_turn(spec);
        in_flight += 1;
        let (done, errors) = (Arc::clone(&done), Arc::clone(&errors));
        tokio::spawn(async move {
            let o = turn.await;
            drop(permit);
            let e = errors.fetch_add(usize::from(!o.ok), Ordering::Relaxed) + usize::from(!o.ok);
            let d = done.fetch_add(1, Ordering::Relaxed) + 1;
            progress(d, e);
            reply.send(o);
        });
    }
    let dur = start.elapsed().as_secs_f64();
    if !quiet {
        eprintln!();
    }
    (dur, outs)
}
