//! Statistics over requests: percentiles, summaries and the goodput SLO
//! check.

use serde_json::{Value, json};

use super::args::Slo;
use super::request::Outcome;

/// Percentile `p` (0..=100) of sorted values, linearly interpolated (numpy's
/// default).
pub(super) fn percentile(sorted: &[f64], p: f64) -> f64 {
    match sorted.len() {
        0 => f64::NAN,
        1 => sorted[0],
        n => {
            let rank = p.clamp(0.0, 100.0) / 100.0 * (n - 1) as f64;
            let lo = rank.floor() as usize;
            let hi = (lo + 1).min(n - 1);
            sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Summary {
    pub(super) mean: f64,
    pub(super) p50: f64,
    pub(super) p90: f64,
    pub(super) p99: f64,
    pub(super) max: f64,
    pub(super) n: usize,
}

pub(super) fn summarize(mut v: Vec<f64>) -> Summary {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let mean = if n == 0 {
        f64::NAN
    } else {
        v.iter().sum::<f64>() / n as f64
    };
    Summary {
        mean,
        p50: percentile(&v, 50.0),
        p90: percentile(&v, 90.0),
        p99: percentile(&v, 99.0),
        max: v.last().copied().unwrap_or(f64::NAN),
        n,
    }
}

impl Summary {
    /// In milliseconds, as JSON (NaN becomes null).
    pub(super) fn json_ms(&self) -> Value {
        let ms = |x: f64| {
            if x.is_finite() {
                json!(x * 1e3)
            } else {
                Value::Null
            }
        };
        json!({
            "mean_ms": ms(self.mean), "p50_ms": ms(self.p50), "p90_ms": ms(self.p90),
            "p99_ms": ms(self.p99), "max_ms": ms(self.max), "count": self.n,
        })
    }
}

/// Whether a successful request meets the SLOs (an unmeasurable TPOT, for a
/// one-token output, does not count against it).
pub(super) fn meets(o: &Outcome, slo: &Slo) -> bool {
    if !o.ok {
        return false;
    }
    let ok = |v: Option<f64>, lim: Option<f64>| match (v, lim) {
        (_, None) | (None, Some(_)) => true,
        (Some(v), Some(l)) => v * 1e3 <= l,
    };
    ok(o.ttft, slo.ttft_ms) && ok(o.tpot(), slo.tpot_ms) && ok(Some(o.e2e), slo.e2e_ms)
}
