//! How long a request body may take: all of it within the body timeout,
//! and, after a grace period, on average at least a minimum rate, so a
//! client that trickles bytes cannot hold its share of the body budget
//! (and a connection) for long. A body over either gets a 408 and its
//! connection is closed.

use std::time::Duration;

use axum::body::Body;
use futures_util::StreamExt;
use tokio::time::Instant;

/// What a body must keep up with (`--body-timeout-secs`,
/// `--body-min-bytes-per-sec`, `--body-rate-grace-secs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodyPace {
    /// The whole body within this long.
    pub timeout: Duration,
    /// After `grace`, at least this many bytes per second on average since
    /// the body began (0: no minimum).
    pub min_bytes_per_sec: u64,
    pub grace: Duration,
}

/// A body that fell behind its pace. Detected in `body_error` (a 408).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum BodyTooSlow {
    #[error("The request body did not arrive within {0:?}")]
    Timeout(Duration),
    #[error(
        "The request body arrived slower than {min} bytes per second on average \
         ({received} bytes in {elapsed:?})"
    )]
    Rate {
        min: u64,
        received: usize,
        elapsed: Duration,
    },
}

impl BodyPace {
    /// When a body that began at `start` and has delivered `received`
    /// bytes must have delivered more (or ended): the earlier of the end
    /// of its time, and the moment its average rate since `start` falls
    /// below the minimum (never before the grace period ends).
    pub(crate) fn deadline(&self, start: Instant, received: usize) -> Instant {
        let all = start + self.timeout;
        if self.min_bytes_per_sec == 0 {
            return all;
        }
        // `received` bytes pay for `received / rate` seconds after grace.
        let paid = Duration::try_from_secs_f64(received as f64 / self.min_bytes_per_sec as f64)
            .unwrap_or(Duration::MAX);
        match start.checked_add(self.grace.saturating_add(paid)) {
            Some(t) => t.min(all),
            None => all,
        }
    }

    /// Why a body that began at `start` and delivered `received` bytes is
    /// over its deadline.
    fn too_slow(&self, start: Instant, received: usize) -> BodyTooSlow {
        let elapsed = start.elapsed();
        if elapsed >= self.timeout {
            BodyTooSlow::Timeout(self.timeout)
        } else {
            BodyTooSlow::Rate {
                min: self.min_bytes_per_sec,
                received,
                elapsed,
            }
        }
    }

    /// `body`, failing with [`BodyTooSlow`] once it falls behind. The
    /// clock starts now (the request head has been read).
    pub(crate) fn apply(self, body: Body) -> Body {
        let start = Instant::now();
        let mut data = body.into_data_stream();
        let paced = async_stream::stream! {
            let mut received = 0usize;
            loop {
                let next = tokio::time::timeout_at(self.deadline(start, received), data.next());
                match next.await {
                    Ok(Some(Ok(chunk))) => {
                        received += chunk.len();
                        yield Ok(chunk);
                    }
                    Ok(Some(Err(e))) => {
                        yield Err(axum::BoxError::from(e));
                        return;
                    }
                    Ok(None) => return,
                    Err(_) => {
                        yield Err(self.too_slow(start, received).into());
                        return;
                    }
                }
            }
        };
        Body::from_stream(paced)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PACE: BodyPace = BodyPace {
        timeout: Duration::from_secs(30),
        min_bytes_per_sec: 1000,
        grace: Duration::from_secs(5),
    };

    #[test]
    fn a_body_earns_time_at_the_minimum_rate_up_to_the_timeout() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        assert_eq!(PACE.deadline(t0, 0), t0 + s(5));
        assert_eq!(PACE.deadline(t0, 2000), t0 + s(7));
        assert_eq!(PACE.deadline(t0, 25_000), t0 + s(30));
        assert_eq!(PACE.deadline(t0, usize::MAX), t0 + s(30));
        let no_rate = BodyPace {
            min_bytes_per_sec: 0,
            ..PACE
        };
        assert_eq!(no_rate.deadline(t0, 0), t0 + s(30));
        let huge_grace = BodyPace {
            grace: Duration::MAX,
            ..PACE
        };
        assert_eq!(huge_grace.deadline(t0, 7), t0 + s(30));
    }
}
