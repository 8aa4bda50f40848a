//! A sweep point's report: the aggregates over its requests, per turn for
//! multi-turn runs, as text and JSON.

use std::fmt::Write as _;

use serde_json::{Value, json};

use super::args::Slo;
use super::request::Outcome;
use super::stats::{Summary, meets, summarize};

#[derive(Debug)]
pub(super) struct Report {
    pub(super) label: String,
    pub(super) concurrency: Option<usize>,
    pub(super) request_rate: Option<f64>,
    pub(super) duration: f64,
    pub(super) completed: usize,
    pub(super) errors: usize,
    pub(super) first_errors: Vec<String>,
    pub(super) prompt_tokens: u64,
    pub(super) prompt_tokens_from_usage: bool,
    pub(super) output_tokens: u64,
    /// Token-bearing chunks that carried reasoning.
    pub(super) reasoning_deltas: u64,
    pub(super) ttft: Summary,
    pub(super) tpot: Summary,
    pub(super) itl: Summary,
    pub(super) e2e: Summary,
    pub(super) good: Option<usize>,
    pub(super) multi_turn: Option<MultiTurn>,
}

pub(super) fn aggregate(
    label: String,
    concurrency: Option<usize>,
    request_rate: Option<f64>,
    duration: f64,
    outs: &[Outcome],
    slo: Option<&Slo>,
) -> Report {
    let ok: Vec<&Outcome> = outs.iter().filter(|o| o.ok).collect();
    let mut first_errors: Vec<String> = Vec::new();
    for o in outs.iter().filter(|o| !o.ok) {
        if let Some(e) = &o.error
            && first_errors.len() < 5
            && !first_errors.contains(e)
        {
            first_errors.push(e.clone());
        }
    }
    let prompt_tokens_from_usage = ok.iter().all(|o| o.prompt_tokens.is_some());
    Report {
        label,
        concurrency,
        request_rate,
        duration,
        completed: ok.len(),
        errors: outs.len() - ok.len(),
        first_errors,
        prompt_tokens: ok
            .iter()
            .map(|o| o.prompt_tokens.unwrap_or(o.input_words as u64))
            .sum(),
        prompt_tokens_from_usage,
        output_tokens: ok.iter().map(|o| o.output_tokens).sum(),
        reasoning_deltas: ok.iter().map(|o| o.reasoning_deltas).sum(),
        ttft: summarize(ok.iter().filter_map(|o| o.ttft).collect()),
        tpot: summarize(ok.iter().filter_map(|o| o.tpot()).collect()),
        itl: summarize(ok.iter().flat_map(|o| o.itl.iter().copied()).collect()),
        e2e: summarize(ok.iter().map(|o| o.e2e).collect()),
        good: slo.map(|s| ok.iter().filter(|o| meets(o, s)).count()),
        multi_turn: None,
    }
}

/// Per-turn statistics of a multi-turn run.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct TurnStats {
    pub(super) turn: usize,
    pub(super) completed: usize,
    pub(super) errors: usize,
    /// Means over the completed requests that know them; None is n/a.
    pub(super) cached: Option<f64>,
    pub(super) carryable: Option<f64>,
    /// Mean of cached / carryable over requests with both (carryable > 0).
    pub(super) retention: Option<f64>,
    pub(super) retention_n: usize,
    pub(super) ttft: Summary,
    pub(super) tpot: Summary,
    pub(super) e2e: Summary,
}

#[derive(Debug, Clone, PartialEq)]
pub(super) struct MultiTurn {
    pub(super) sessions: usize,
    pub(super) turns: usize,
    pub(super) block_size: usize,
    pub(super) per_turn: Vec<TurnStats>,
    /// Mean retention over all requests of turns 2+ that have one.
    pub(super) retention: Option<f64>,
    pub(super) retention_n: usize,
}

/// Retention of one request: None when the server reported no cached
/// tokens, the previous turn no usage, or nothing whole-block was carryable.
pub(super) fn retention(o: &Outcome) -> Option<f64> {
    match (o.cached_tokens, o.carryable) {
        (Some(c), Some(k)) if k > 0 => Some(c as f64 / k as f64),
        _ => None,
    }
}

pub(super) fn mean(v: impl IntoIterator<Item = f64>) -> Option<f64> {
    let (n, sum) = v
        .into_iter()
        .fold((0usize, 0.0), |(n, s), x| (n + 1, s + x));
    (n > 0).then(|| sum / n as f64)
}

pub(super) fn multi_turn_stats(
    sessions: usize,
    turns: usize,
    block_size: usize,
    outs: &[Outcome],
) -> MultiTurn {
    let per_turn = (1..=turns)
        .map(|t| {
            let all = || outs.iter().filter(move |o| o.turn == t);
            let ok: Vec<&Outcome> = all().filter(|o| o.ok).collect();
            let ratios: Vec<f64> = ok.iter().filter_map(|o| retention(o)).collect();
            TurnStats {
                turn: t,
                completed: ok.len(),
                errors: all().count() - ok.len(),
                cached: mean(ok.iter().filter_map(|o| o.cached_tokens).map(|x| x as f64)),
                carryable: mean(ok.iter().filter_map(|o| o.carryable).map(|x| x as f64)),
                retention: mean(ratios.iter().copied()),
                retention_n: ratios.len(),
                ttft: summarize(ok.iter().filter_map(|o| o.ttft).collect()),
                tpot: summarize(ok.iter().filter_map(|o| o.tpot()).collect()),
                e2e: summarize(ok.iter().map(|o| o.e2e).collect()),
            }
        })
        .collect();
    let ratios: Vec<f64> = outs
        .iter()
        .filter(|o| o.ok && o.turn > 1)
        .filter_map(retention)
        .collect();
    MultiTurn {
        sessions,
        turns,
        block_size,
        per_turn,
        retention: mean(ratios.iter().copied()),
        retention_n: ratios.len(),
    }
}

fn fmt_opt(x: Option<f64>, prec: usize) -> String {
    x.map_or_else(|| "n/a".into(), |x| format!("{x:.prec$}"))
}

impl MultiTurn {
    pub(super) fn text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "multi-turn: {} sessions x {} turns; retention = server-cached / carryable \
             (previous prompt + completion in whole {}-token blocks)",
            self.sessions, self.turns, self.block_size
        );
        let _ = writeln!(
            s,
            "{:<5} {:>4} {:>4} {:>8} {:>9} {:>9} {:>10} {:>10} {:>10} {:>10}",
            "turn",
            "ok",
            "err",
            "cached",
            "carryable",
            "retention",
            "TTFT mean",
            "TTFT p50",
            "TPOT mean",
            "E2E mean"
        );
        for t in &self.per_turn {
            let ms = |x: f64| {
                if x.is_finite() {
                    format!("{:.2}", x * 1e3)
                } else {
                    "n/a".into()
                }
            };
            let _ = writeln!(
                s,
                "{:<5} {:>4} {:>4} {:>8} {:>9} {:>9} {:>10} {:>10} {:>10} {:>10}",
                t.turn,
                t.completed,
                t.errors,
                fmt_opt(t.cached, 1),
                if t.turn == 1 {
                    "-".into()
                } else {
                    fmt_opt(t.carryable, 1)
                },
                if t.turn == 1 {
                    "-".into()
                } else {
                    fmt_opt(t.retention, 3)
                },
                ms(t.ttft.mean),
                ms(t.ttft.p50),
                ms(t.tpot.mean),
                ms(t.e2e.mean)
            );
        }
        let _ = writeln!(
            s,
            "KV retention (turns 2+): {} over {} requests",
            fmt_opt(self.retention, 3),
            self.retention_n
        );
        s
    }

    pub(super) fn json(&self) -> Value {
        let num = |x: Option<f64>| {
            x.filter(|x| x.is_finite())
                .map_or(Value::Null, |x| json!(x))
        };
        json!({
            "sessions": self.sessions,
            "turns": self.turns,
            "kv_block_size": self.block_size,
            "retention": num(self.retention),
            "retention_requests": self.retention_n,
            "per_turn": self.per_turn.iter().map(|t| json!({
                "turn": t.turn,
                "completed": t.completed,
                "errors": t.errors,
                "cached_tokens_mean": num(t.cached),
                "carryable_tokens_mean": num(t.carryable),
                "retention": num(t.retention),
                "retention_requests": t.retention_n,
                "ttft": t.ttft.json_ms(),
                "tpot": t.tpot.json_ms(),
                "e2e": t.e2e.json_ms(),
            })).collect::<Vec<_>>(),
        })
    }
}

impl Report {
    pub(super) fn per_s(&self, x: f64) -> f64 {
        if self.duration > 0.0 {
            x / self.duration
        } else {
            f64::NAN
        }
    }

    pub(super) fn text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "==== {} ====", self.label);
        let _ = writeln!(
            s,
            "requests: {} ok, {} errors in {:.2} s",
            self.completed, self.errors, self.duration
        );
        for e in &self.first_errors {
            let _ = writeln!(s, "  error: {e}");
        }
        let _ = writeln!(
            s,
            "tokens: {} prompt{}, {} output",
            self.prompt_tokens,
            if self.prompt_tokens_from_usage {
                ""
            } else {
                " (estimated)"
            },
            self.output_tokens
        );
        let _ = writeln!(s, "reasoning deltas: {}", self.reasoning_deltas);
        let _ = writeln!(
            s,
            "throughput: {:.2} req/s, {:.1} output tok/s, {:.1} total tok/s",
            self.per_s(self.completed as f64),
            self.per_s(self.output_tokens as f64),
            self.per_s((self.prompt_tokens + self.output_tokens) as f64)
        );
        if let Some(g) = self.good {
            let _ = writeln!(
                s,
                "goodput: {:.2} req/s ({g} of {} requests meet the SLOs)",
                self.per_s(g as f64),
                self.completed + self.errors
            );
        }
        let _ = writeln!(
            s,
            "{:<6} {:>10} {:>10} {:>10} {:>10} {:>10}",
            "(ms)", "mean", "p50", "p90", "p99", "max"
        );
        for (name, m) in [
            ("TTFT", &self.ttft),
            ("TPOT", &self.tpot),
            ("ITL", &self.itl),
            ("E2E", &self.e2e),
        ] {
            let _ = writeln!(
                s,
                "{name:<6} {:>10.2} {:>10.2} {:>10.2} {:>10.2} {:>10.2}",
                m.mean * 1e3,
                m.p50 * 1e3,
                m.p90 * 1e3,
                m.p99 * 1e3,
                m.max * 1e3
            );
        }
        if let Some(mt) = &self.multi_turn {
            s.push_str(&mt.text());
        }
        s
    }

    pub(super) fn json(&self) -> Value {
        let num = |x: f64| if x.is_finite() { json!(x) } else { Value::Null };
        json!({
            "label": self.label,
            "concurrency": self.concurrency,
            "request_rate": self.request_rate,
            "duration_s": self.duration,
            "completed": self.completed,
            "errors": self.errors,
            "error_samples": self.first_errors,
            "prompt_tokens": self.prompt_tokens,
            "prompt_tokens_from_usage": self.prompt_tokens_from_usage,
            "output_tokens": self.output_tokens,
            "reasoning_deltas": self.reasoning_deltas,
            "request_throughput": num(self.per_s(self.completed as f64)),
            "output_throughput": num(self.per_s(self.output_tokens as f64)),
            "total_token_throughput":
                num(self.per_s((self.prompt_tokens + self.output_tokens) as f64)),
            "goodput": self.good.map(|g| num(self.per_s(g as f64))),
            "good_requests": self.good,
            "ttft": self.ttft.json_ms(),
            "tpot": self.tpot.json_ms(),
            "itl": self.itl.json_ms(),
            "e2e": self.e2e.json_ms(),
            "multi_turn": self.multi_turn.as_ref().map(MultiTurn::json),
        })
    }
}
