//! Cluster-wide prefix reuse, the fetching side: when the router names a
//! worker that holds more of the prompt's leading blocks than this node
//! (`GenerateJob::prefix_source`, from its KV-event index, any tier), the
//! blocks after this node's own cached ones are granted to that worker,
//! which writes those it holds over dKV (`Worker.FetchBlocks`), instead of
//! being computed. A fetch is made only when it is predicted cheaper than
//! computing the same tokens here ([`FetchCost`]); one that fails is a
//! miss: the blocks are computed, and where writes may still be landing
//! they wait in quarantine like a failed prefill's.

use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use opentelemetry::KeyValue;
use opentelemetry::metrics::Counter;
use tandem_dkv::Grant;
use tandem_engine::scheduler::ImportSlot;
use tandem_kvtier::peer;
use tandem_proto::trace::TraceContext;
use tandem_proto::{FetchJob, GenerateJob, PrefixSource, pb};
use tandem_worker::WorkerError;
use tonic::Code;

use super::{Inner, LANDING_WAIT, Tainted, never_connected};

/// Every `outcome` of `tandem.decode.prefix_fetches`.
const FETCH_OUTCOMES: [&str; 3] = ["fetched", "not_worth", "failed"];

fn fetches() -> &'static Counter<u64> {
    static C: OnceLock<Counter<u64>> = OnceLock::new();
    C.get_or_init(|| {
        let c = opentelemetry::global::meter("tandem")
            .u64_counter("tandem.decode.prefix_fetches")
            .with_description(
                "Prefixes a peer held, by outcome: fetched over dKV, not_worth (computing \
                 predicted cheaper), failed (computed instead)",
            )
            .build();
        for o in FETCH_OUTCOMES {
            c.add(0, &[KeyValue::new("outcome", o)]);
        }
        peer::touch();
        c
    })
}

fn count(outcome: &'static str) {
    fetches().add(1, &[KeyValue::new("outcome", outcome)]);
}

/// What fetching costs against computing, from what this node measured:
/// its own time per prompt token (the scheduler's) and the time per byte
/// of its past fetches (an average that favours recent ones; it includes
/// each fetch's fixed costs, so it errs against small fetches).
#[derive(Debug)]
pub(crate) struct FetchCost {
    secs_per_byte: Mutex<f64>,
}

/// Assumed before the first fetch is measured: 1 GB/s.
const FIRST_SECS_PER_BYTE: f64 = 1e-9;
/// Weight of the newest fetch in the running average.
const NEWEST: f64 = 0.25;
/// A fetch may take this many times computing its tokens...
const FETCH_SLACK: u32 = 4;
/// ... and at least this long (connection set-up, a first measurement).
const FETCH_FLOOR: Duration = Duration::from_millis(250);

impl FetchCost {
    pub(crate) fn new() -> Self {
        Self {
            secs_per_byte: Mutex::new(FIRST_SECS_PER_BYTE),
        }
    }

    /// Whether moving `bytes` is predicted faster than computing `tokens`
    /// at `token_time` each (`None`: nothing computed yet, so nothing to
    /// weigh; a fetch moves bytes where computing runs the model).
    pub(crate) fn worth(&self, bytes: u64, tokens: usize, token_time: Option<Duration>) -> bool {
        let Some(t) = token_time else { return true };
        let fetch = bytes as f64
            * *self
                .secs_per_byte
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
        fetch < tokens as f64 * t.as_secs_f64()
    }

    /// How long a fetch of `tokens` may take before it is abandoned and
    /// the tokens computed: [`FETCH_SLACK`] times computing them here (a
    /// peer that is slow or busy must not cost much more than the miss),
    /// at least [`FETCH_FLOOR`], at most `cap`.
    pub(crate) fn allowance(
        tokens: usize,
        token_time: Option<Duration>,
        cap: Duration,
    ) -> Duration {
        let compute = token_time.map_or(Duration::ZERO, |t| t * tokens as u32);
        (compute * FETCH_SLACK).max(FETCH_FLOOR).min(cap)
    }

    pub(crate) fn observe(&self, bytes: u64, took: Duration) {
        if bytes == 0 {
            return;
        }
        let mut s = self
            .secs_per_byte
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        *s = (1.0 - NEWEST) * *s + NEWEST * took.as_secs_f64() / bytes as f64;
    }
}

/// How a fetch ended.
pub(crate) enum Fetched {
    /// These many blocks after the cached ones landed (possibly none).
    Blocks(usize),
    /// It failed in a way that may leave writes in flight: the slot's
    /// blocks wait in quarantine.
    Tainted(Tainted),
}

impl Inner {
    /// Fetches the prompt's blocks after the slot's cached ones from
    /// `source`, as far as it holds them and it pays.
    pub(crate) async fn fetch_prefix(
        &self,
        job: &GenerateJob,
        slot: &ImportSlot,
        source: &PrefixSource,
        trace: &TraceContext,
        attempt: &Mutex<Option<Tainted>>,
    ) -> Fetched {
        let core = &self.core;
        let bs = core.fingerprint.block_size;
        // Never the block of the prompt's last token: it must run here
        // to produce the first token's logits.
        let end = source.blocks.min((job.request.prompt.len() - 1) / bs);
        let from = slot.cached_blocks;
        if !self.config.prefix_fetch || end <= from {
            return Fetched::Blocks(0);
        }
        let bytes = (end - from) as u64 * core.full_layout.block_bytes;
        let token_time = core.scheduler.stats().prompt_token_time();
        if !self.fetch_cost.worth(bytes, (end - from) * bs, token_time) {
            count("not_worth");
            return Fetched::Blocks(0);
        }
        let allowed =
            FetchCost::allowance((end - from) * bs, token_time, self.config.prefill_timeout);
        let grants = match self.grant(&slot.blocks[from..end]) {
            Ok(g) => g,
            Err(e) => {
                tracing::warn!(error = %e, "cannot grant blocks for a prefix fetch");
                return Fetched::Blocks(0);
            }
        };
        let pending = Tainted {
            worker_id: source.worker_id.clone(),
            grants,
        };
        let set = |t: Option<Tainted>| *attempt.lock().unwrap_or_else(PoisonError::into_inner) = t;
        set(Some(pending.clone()));
        let started = Instant::now();
        let result = self
            .call_fetch(job, slot, end, source, trace, &pending.grants, allowed)
            .await;
        set(None);
        match result {
            Ok((n, moved)) => {
                count("fetched");
                peer::fetched(n as u64, from + n < end, moved, started.elapsed());
                self.fetch_cost.observe(moved, started.elapsed());
                tracing::debug!(worker = %source.worker_id, blocks = n, asked = end - from, "prefix fetched");
                Fetched::Blocks(n)
            }
            Err((error, tainted)) => {
                count("failed");
                peer::failed();
                tracing::warn!(worker = %source.worker_id, error = %error, tainted, "prefix fetch failed");
                self.forget_channel(&source.endpoint);
                if tainted {
                    Fetched::Tainted(pending)
                } else {
                    Fetched::Blocks(0)
                }
            }
        }
    }

    /// Asks `source` for blocks `slot.cached_blocks..end` within
    /// `deadline` and waits until what it says it wrote has landed, then
    /// revokes the grants (nothing lands after). Returns the blocks that
    /// landed and their bytes, or the error and whether writes may be in
    /// flight.
    #[allow(clippy::too_many_arguments)]
    async fn call_fetch(
        &self,
        job: &GenerateJob,
        slot: &ImportSlot,
        end: usize,
        source: &PrefixSource,
        trace: &TraceContext,
        grants: &[Grant],
        deadline: Duration,
    ) -> Result<(usize, u64), (WorkerError, bool)> {
        let core = &self.core;
        let bs = core.fingerprint.block_size;
        let from = slot.cached_blocks;
        let req = FetchJob {
            prompt: job.request.prompt[..end * bs].to_vec(),
            skip_blocks: from,
            dst_blocks: slot.blocks[from..end].to_vec(),
            regions: self.regions(grants),
            deadline,
        }
        .to_pb(&core.fingerprint);
        let mut request = tonic::Request::new(req);
        trace.inject(request.metadata_mut());
        request.set_timeout(deadline);
        let channel = self.channel(&source.endpoint).map_err(|e| (e, false))?;
        let mut client = pb::worker_client::WorkerClient::new(channel);
        let resp = match tokio::time::timeout(
            deadline + Duration::from_millis(250),
            client.fetch_blocks(request),
        )
        .await
        {
            Ok(Ok(r)) => r.into_inner(),
            Ok(Err(status)) => {
                let clean = status.code() == Code::FailedPrecondition || never_connected(&status);
                let e = WorkerError::Internal(format!(
                    "{} answered {:?}: {}",
                    source.worker_id,
                    status.code(),
                    status.message()
                ));
                return Err((e, !clean));
            }
            Err(_) => {
                let e = WorkerError::Deadline(format!("no answer from {}", source.worker_id));
                return Err((e, true));
            }
        };
        let n = resp.blocks as usize;
        if n > end - from {
            let e = WorkerError::Internal(format!(
                "{} says it wrote {n} blocks of {} asked",
                source.worker_id,
                end - from
            ));
            return Err((e, true));
        }
        let landing = Instant::now() + LANDING_WAIT;
        let per_rank = n as u64 * core.layout.block_bytes;
        for g in grants {
            g.landed_at_least(per_rank, landing).await.map_err(|e| {
                let e = WorkerError::Deadline(format!(
                    "fetched KV from {} did not all land ({} of {per_rank} bytes): {e}",
                    source.worker_id,
                    g.landed()
                ));
                (e, true)
            })?;
            g.revoke().await;
        }
        Ok((n, resp.bytes))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_fetch_pays_when_moving_the_bytes_beats_computing_the_tokens() {
        let c = FetchCost::new();
        let ms = |n| Some(Duration::from_millis(n));
        // Nothing computed yet: nothing to weigh against.
        assert!(c.worth(u64::MAX, 1, None));
        // 1 GB/s assumed: 1 MB is 1 ms, against 16 tokens at 1 ms each.
        assert!(c.worth(1_000_000, 16, ms(1)));
        assert!(!c.worth(100_000_000, 16, ms(1)));
        // Slow fetches measured (1 MB in 100 ms, again and again) move the
        // estimate toward 100 ns a byte: now 16 tokens are cheaper.
        for _ in 0..20 {
            c.observe(1_000_000, Duration::from_millis(100));
        }
        assert!(!c.worth(1_000_000, 16, ms(1)));
        assert!(c.worth(1_000_000, 16, ms(10)));
        // An empty fetch teaches nothing.
        let before = *c.secs_per_byte.lock().unwrap();
        c.observe(0, Duration::from_secs(1));
        assert_eq!(*c.secs_per_byte.lock().unwrap(), before);
    }

    #[test]
    fn a_fetch_may_take_a_few_times_computing_its_tokens_within_bounds() {
        let cap = Duration::from_secs(30);
        let ms = Duration::from_millis;
        // 64 tokens at 2 ms: computing is 128 ms, a fetch may take 4x.
        assert_eq!(FetchCost::allowance(64, Some(ms(2)), cap), ms(512));
        // Never below the floor (nothing measured, or a quick model)...
        assert_eq!(FetchCost::allowance(64, None, cap), FETCH_FLOOR);
        assert_eq!(FetchCost::allowance(1, Some(ms(1)), cap), FETCH_FLOOR);
        // ... nor beyond the prefill timeout.
        assert_eq!(FetchCost::allowance(100_000, Some(ms(10)), cap), cap);
    }
}
