//! Token sampling: penalties, temperature, top-k / top-p / min-p, seeded
//! randomness, and log-probabilities.
//!
//! Order of operations (as in vLLM and llama.cpp): `logit_bias` and the
//! `min_tokens` ban, repetition penalty
//! (prompt and output tokens), frequency/presence penalties (output tokens),
//! then greedy if temperature is 0, else temperature, top-k, top-p, min-p
//! and a draw. Reported log-probabilities are those of the model's raw
//! distribution, before penalties and truncation.

use std::collections::HashMap;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub use tandem_types::sampling::{MAX_TOP_LOGPROBS, Sampled, SamplingError, SamplingParams};

/// Per-request sampling state.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    /// How often each token has been generated so far.
    output_counts: HashMap<u32, u32>,
    /// Tokens seen in the prompt (for the repetition penalty).
    prompt_tokens: Vec<u32>,
    /// Tokens generated so far (sampled here or accepted from elsewhere).
    generated: usize,
}

impl Sampler {
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Result<Self, SamplingError> {
        params.validate()?;
        let rng = match params.seed {
            Some(s) => ChaCha8Rng::seed_from_u64(s),
            None => ChaCha8Rng::from_os_rng(),
        };
        let mut prompt_tokens = if params.repetition_penalty != 1.0 {
            prompt.to_vec()
        } else {
            Vec::new()
        };
        prompt_tokens.sort_unstable();
        prompt_tokens.dedup();
        Ok(Self {
            params,
            rng,
            output_counts: HashMap::new(),
            prompt_tokens,
            generated: 0,
        })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Records a token sampled elsewhere (the first token of a prompt
    /// prefilled on another node) as if this sampler had drawn it, so that
    /// penalties and a seeded generator continue exactly as they would have.
    pub fn accept_external(&mut self, token: u32) {
        *self.output_counts.entry(token).or_insert(0) += 1;
        self.generated += 1;
        if self.params.temperature != 0.0 {
            let _ = self.rng.random::<f64>();
        }
    }

    /// Picks the next token from `logits` (modified in place) and records it.
    pub fn sample(&mut self, logits: &mut [f32]) -> Sampled {
        let p = &self.params;
        let want_lp = p.logprobs || p.top_logprobs > 0;
        let raw_logprobs = want_lp.then(|| log_softmax(logits));

        self.apply_bias(logits);
        self.apply_penalties(logits);
        let token = if p.temperature == 0.0 {
            argmax(logits)
        } else {
            self.draw(logits)
        };
        *self.output_counts.entry(token).or_insert(0) += 1;
        self.generated += 1;

        let (logprob, top) = match raw_logprobs {
            Some(lp) => {
                let top = top_n(&lp, self.params.top_logprobs);
                (Some(lp[token as usize]), top)
            }
            None => (None, Vec::new()),
        };
        Sampled {
            token,
            logprob,
            top,
        }
    }

    /// `logit_bias`, then the `min_tokens` ban. The ban is skipped when it
    /// would leave nothing to sample (a grammar that only allows the end).
    fn apply_bias(&self, logits: &mut [f32]) {
        let p = &self.params;
        for &(t, b) in &p.logit_bias {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += b;
            }
        }
        let Some(m) = &p.min_tokens else { return };
        if self.generated >= m.count as usize {
            return;
        }
        let banned = |i: usize| m.stop_ids.iter().any(|&s| s as usize == i);
        let any_left = logits
            .iter()
            .enumerate()
            .any(|(i, l)| *l > f32::NEG_INFINITY && !banned(i));
        if any_left {
            for &s in &m.stop_ids {
                if let Some(l) = logits.get_mut(s as usize) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
    }

    fn apply_penalties(&self, logits: &mut [f32]) {
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            let penalise = |l: &mut f32| {
                *l = if *l > 0.0 {
                    *l / p.repetition_penalty
                } else {
                    *l * p.repetition_penalty
                };
            };
            let mut seen: Vec<u32> = self.prompt_tokens.clone();
            seen.extend(self.output_counts.keys());
            seen.sort_unstable();
            seen.dedup();
            for t in seen {
                if let Some(l) = logits.get_mut(t as usize) {
                    penalise(l);
                }
            }
        }
        if p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
            for (&t, &n) in &self.output_counts {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -= p.frequency_penalty * n as f32 + p.presence_penalty;
                }
            }
        }
    }

    /// How many of a row's largest logits decide this sampler's next
    /// token, its log-probability and its `top_logprobs`, given also the
    /// row's log-sum-exp: [`Sampler::sample_top`] over them then gives
    /// what [`Sampler::sample`] gives over the whole row. `None` when the
    /// whole row matters: a bias, a penalty or a `min_tokens` ban moves
    /// logits outside the top, and a draw without `top_k` weighs every
    /// token.
    pub fn candidates(&self) -> Option<usize> {
        let p = &self.params;
        let ban = p
            .min_tokens
            .as_ref()
            .is_some_and(|m| self.generated < m.count as usize);
        if !p.logit_bias.is_empty()
            || ban
            || p.repetition_penalty != 1.0
            || p.frequency_penalty != 0.0
            || p.presence_penalty != 0.0
        {
            return None;
        }
        let drawn = match (p.temperature == 0.0, p.top_k) {
            (true, _) => 1,
            (false, 0) => return None,
            (false, k) => k,
        };
        Some(drawn.max(p.top_logprobs))
    }

    /// [`Sampler::sample`] over a row's largest logits only: `ids` and
    /// `values` (largest first, as many as [`Sampler::candidates`] asked
    /// for, or fewer where the row had fewer finite values) and the
    /// row's log-sum-exp `log_z`. The caller checked `candidates()`; if
    /// it said `None`, this samples as if the row held only these.
    pub fn sample_top(&mut self, ids: &[u32], values: &[f32], log_z: f32) -> Sampled {
        let (temperature, top_logprobs) = (self.params.temperature, self.params.top_logprobs);
        let want_lp = self.params.logprobs || top_logprobs > 0;
        let mut top: Vec<(u32, f32)> = ids
            .iter()
            .zip(values)
            .filter(|(_, l)| l.is_finite())
            .map(|(&i, &l)| (i, l))
            .collect();
        top.sort_unstable_by(by_logit);
        let token = if temperature == 0.0 {
            top.first().map_or(0, |c| c.0)
        } else {
            let cand = top.iter().map(|&(i, l)| (i, l / temperature)).collect();
            self.draw_from(cand)
        };
        *self.output_counts.entry(token).or_insert(0) += 1;
        self.generated += 1;
        let (logprob, top) = if want_lp {
            let lp = |l: f32| (f64::from(l) - f64::from(log_z)) as f32;
            let chosen = top.iter().find(|c| c.0 == token).map(|c| lp(c.1));
            let shown = top
                .iter()
                .take(top_logprobs)
                .map(|&(i, l)| (i, lp(l)))
                .collect();
            (chosen, shown)
        } else {
            (None, Vec::new())
        };
        Sampled {
            token,
            logprob,
            top,
        }
    }

    fn draw(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        let cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, l)| l.is_finite())
            .map(|(i, &l)| (i as u32, l / p.temperature))
            .collect();
        self.draw_from(cand)
    }

    /// A draw among `cand` (token, logit / temperature): top-k, softmax,
    /// top-p, min-p.
    fn draw_from(&mut self, mut cand: Vec<(u32, f32)>) -> u32 {
        let p = &self.params;
        if cand.is_empty() {
            return 0;
        }
        // Most likely first (ties: lower id first).
        if p.top_k > 0 && p.top_k < cand.len() {
            cand.select_nth_unstable_by(p.top_k - 1, by_logit);
            cand.truncate(p.top_k);
        }
        cand.sort_unstable_by(by_logit);
        let max = cand[0].1;
        let mut probs: Vec<f64> = cand
            .iter()
            .map(|&(_, l)| f64::from(l - max).exp())
            .collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= total);
        let mut keep = probs.len();
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            for (i, &pr) in probs.iter().enumerate() {
                cum += pr;
                if cum >= f64::from(p.top_p) {
                    keep = i + 1;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            let floor = probs[0] * f64::from(p.min_p);
            keep = keep.min(probs.iter().take_while(|&&pr| pr >= floor).count().max(1));
        }
        let probs = &probs[..keep];
        let total: f64 = probs.iter().sum();
        let mut r = self.rng.random::<f64>() * total;
        for (i, &pr) in probs.iter().enumerate() {
            r -= pr;
            if r <= 0.0 {
                return cand[i].0;
            }
        }
        cand[keep - 1].0
    }
}

/// (token, logit) pairs most likely first; on equal logits the lower
/// token id first (the order every candidate list here is in).
fn by_logit(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// Index of the largest value; the first one wins ties (as llama.cpp's
/// greedy sampler); NaNs never win, except a NaN at index 0 (nothing
/// compares greater than it), which is returned as is.
pub fn argmax(x: &[f32]) -> u32 {
    match x.first() {
        None => return 0,
        Some(v) if v.is_nan() => return 0,
        Some(_) => {}
    }
    // The max first (vectorised), then the first index holding it: the
    // same answer as one left-to-right scan.
    let max = tandem_kernels::ops::max(x);
    x.iter().position(|&v| v == max).unwrap_or(0) as u32
}

/// A row's `k` largest logits (largest first; on equal values the lower
/// token id first), their token ids, and the row's log-sum-exp: what a
/// runner returns for the row in `LogitsForm::Top(k)`, computed on the
/// host (the reference a device's reduction is tested against).
pub fn top_candidates(row: &[f32], k: usize) -> (Vec<u32>, Vec<f32>, f32) {
    let top = top_n(row, k);
    (
        top.iter().map(|c| c.0).collect(),
        top.iter().map(|c| c.1).collect(),
        log_sum_exp(row) as f32,
    )
}

/// `log(sum(exp(x)))`, computed stably in `f64`.
fn log_sum_exp(x: &[f32]) -> f64 {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = x.iter().map(|&v| f64::from(v - max).exp()).sum();
    f64::from(max) + sum.ln()
}

/// `log(softmax(x))`, computed stably in `f64`.
pub fn log_softmax(x: &[f32]) -> Vec<f32> {
    let log_z = log_sum_exp(x);
    x.iter().map(|&v| (f64::from(v) - log_z) as f32).collect()
}

/// The `n` largest of `lp`, in [`by_logit`] order.
fn top_n(lp: &[f32], n: usize) -> Vec<(u32, f32)> {
    if n == 0 {
        return Vec::new();
    }
    let mut idx: Vec<(u32, f32)> = lp.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
    let n = n.min(idx.len());
    if n < idx.len() {
        idx.select_nth_unstable_by(n - 1, by_logit);
        idx.truncate(n);
    }
    idx.sort_unstable_by(by_logit);
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        vec![1.0, 3.0, 2.0, 3.0, -1.0, 0.5]
    }

    #[test]
    fn argmax_equals_a_left_to_right_scan() {
        use rand::{Rng, SeedableRng};
        let scan = |x: &[f32]| {
            let mut best = 0;
            for (i, &v) in x.iter().enumerate() {
                if v > x[best] {
                    best = i;
                }
            }
            best as u32
        };
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(17);
        let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, 2.0];
        for len in [0, 1, 2, 15, 16, 17, 33, 49152] {
            for round in 0..20 {
                // Few distinct values, so ties are common.
                let mut x: Vec<f32> = (0..len).map(|_| rng.random_range(0..4) as f32).collect();
                for v in x.iter_mut() {
                    if rng.random_range(0..10) == 0 {
                        *v = specials[rng.random_range(0..specials.len())];
                    }
                }
                if round == 0 && len > 0 {
                    x[0] = f32::NAN;
                }
                assert_eq!(argmax(&x), scan(&x), "{x:?}");
            }
        }
    }

    #[test]
    fn greedy_takes_first_maximum() {
        let mut s = Sampler::new(SamplingParams::greedy(), &[]).expect("valid");
        assert_eq!(s.sample(&mut logits()).token, 1);
    }

    #[test]
    fn logit_bias_moves_the_choice_and_not_the_reported_logprob() {
        let raw = log_softmax(&logits());
        let mut s = Sampler::new(
            SamplingParams {
                logit_bias: vec![(1, -100.0), (4, 5.0)],
                logprobs: true,
                ..SamplingParams::greedy()
            },
            &[],
        )
        .expect("valid");
        let got = s.sample(&mut logits());
        // -1 + 5 = 4 beats 3 (token 3; token 1 is pushed down).
        assert_eq!(got.token, 4);
        assert_eq!(got.logprob, Some(raw[4]));
    }

    #[test]
    fn min_tokens_bans_stop_tokens_until_the_count() {
        let params = SamplingParams {
            min_tokens: Some(tandem_types::MinTokens {
                count: 2,
                stop_ids: vec![1, 3],
            }),
            ..SamplingParams::greedy()
        };
        let mut s = Sampler::new(params.clone(), &[]).expect("valid");
        assert_eq!(s.sample(&mut logits()).token, 2);
        assert_eq!(s.sample(&mut logits()).token, 2);
        assert_eq!(s.sample(&mut logits()).token, 1);
        // A token accepted from elsewhere (the prefill node's) counts.
        let mut s = Sampler::new(params.clone(), &[]).expect("valid");
        s.accept_external(0);
        assert_eq!(s.sample(&mut logits()).token, 2);
        assert_eq!(s.sample(&mut logits()).token, 1);
        // When only stop tokens are left (a finished grammar), the ban
        // yields rather than sampling a masked token.
        let mut s = Sampler::new(params, &[]).expect("valid");
        let mut only_stops = vec![f32::NEG_INFINITY; 6];
        only_stops[3] = 0.0;
        assert_eq!(s.sample(&mut only_stops).token, 3);
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_varies_with_seed() {
        let params = |seed| SamplingParams {
            temperature: 1.0,
            seed,
            ..SamplingParams::default()
        };
        let run = |seed| {
            let mut s = Sampler::new(params(seed), &[]).expect("valid");
            (0..64)
                .map(|_| s.sample(&mut logits()).token)
                .collect::<Vec<_>>()
        };
        assert_eq!(run(Some(7)), run(Some(7)));
        // Each of 16 seeds gives its own sequence (64 draws over 6 tokens:
        // a collision by chance is below 1e-40).
        let mut runs: Vec<_> = (0..16).map(|s| run(Some(s))).collect();
        runs.sort();
        runs.dedup();
        assert_eq!(runs.len(), 16, "two seeds gave the same sequence");
        // Without a seed every sampler draws its own from the OS.
        assert_ne!(run(None), run(None));
        // A token accepted from elsewhere advances the generator as a draw
        // would, so the rest of the sequence is the one the seed gives.
        let whole = run(Some(9));
        let mut s = Sampler::new(params(Some(9)), &[]).expect("valid");
        s.accept_external(whole[0]);
        let rest: Vec<u32> = (1..64).map(|_| s.sample(&mut logits()).token).collect();
        assert_eq!(rest, whole[1..]);
    }

    #[test]
    fn top_k_one_is_greedy_and_top_k_limits_support() {
        let reversed: Vec<f32> = logits().into_iter().rev().collect();
        for l in [logits(), reversed, LOGITS.to_vec()] {
            let greedy = argmax(&l);
            for seed in 0..8 {
                let mut s = Sampler::new(
                    SamplingParams {
                        temperature: 1.5,
                        top_k: 1,
                        seed: Some(seed),
                        ..SamplingParams::default()
                    },
                    &[],
                )
                .expect("valid");
                for _ in 0..200 {
                    assert_eq!(s.sample(&mut l.clone()).token, greedy, "{l:?}");
                }
            }
        }
        let mut s = Sampler::new(
            SamplingParams {
                temperature: 1.5,
                top_k: 2,
                seed: Some(1),
                ..SamplingParams::default()
            },
            &[],
        )
        .expect("valid");
        for _ in 0..200 {
            let t = s.sample(&mut logits()).token;
            assert!(t == 1 || t == 3, "token {t} outside top-2");
        }
    }

    /// Logits with comparable masses (softmax at T = 1, by id: .102 .228
    /// .042 .228 .153 .019 .076 .153) and two ties (1 = 3, 4 = 7), so every
    /// truncation below cuts through real mass and some cut between equals.
    const LOGITS: [f32; 8] = [1.2, 2.0, 0.3, 2.0, 1.6, -0.5, 0.9, 1.6];

    /// Draws per distribution test.
    const DRAWS: usize = 40_000;

    /// The logits after the penalties, in f64, from the definitions:
    /// repetition penalty (CTRL / HF, on prompt and generated tokens):
    /// positive logits divided by it, the others multiplied; then OpenAI's
    /// `logit -= count * frequency_penalty + (count > 0) * presence_penalty`
    /// over the generated tokens.
    fn penalised(p: &SamplingParams, prompt: &[u32], generated: &[u32], l: &[f32]) -> Vec<f64> {
        let r = f64::from(p.repetition_penalty);
        (0..l.len())
            .map(|t| {
                let mut v = f64::from(l[t]);
                let id = t as u32;
                if prompt.contains(&id) || generated.contains(&id) {
                    v = if v > 0.0 { v / r } else { v * r };
                }
                let count = generated.iter().filter(|&&g| g == id).count() as f64;
                let present = if count > 0.0 { 1.0 } else { 0.0 };
                v - count * f64::from(p.frequency_penalty) - present * f64::from(p.presence_penalty)
            })
            .collect()
    }

    /// The exact distribution the sampler should draw from, by token id (0
    /// outside the truncation set), computed in f64 one documented step at a
    /// time, each on what the step before left: temperature, top-k, top-p
    /// (the shortest most-likely-first prefix whose mass reaches top_p),
    /// min-p (p >= min_p * p_max). Equal logits rank the lower id first.
    fn reference(p: &SamplingParams, l: &[f64]) -> Vec<f64> {
        let mut dist = vec![0.0; l.len()];
        let mut order: Vec<usize> = (0..l.len()).collect();
        order.sort_by(|&a, &b| l[b].partial_cmp(&l[a]).expect("finite").then(a.cmp(&b)));
        if p.temperature == 0.0 {
            dist[order[0]] = 1.0;
            return dist;
        }
        let t = f64::from(p.temperature);
        let softmax = |keep: &[usize]| -> Vec<f64> {
            let e: Vec<f64> = keep.iter().map(|&i| (l[i] / t).exp()).collect();
            let z: f64 = e.iter().sum();
            e.iter().map(|x| x / z).collect()
        };
        if p.top_k > 0 {
            order.truncate(p.top_k);
        }
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            let nucleus = softmax(&order)
                .iter()
                .take_while(|&&q| {
                    let short = cum < f64::from(p.top_p);
                    cum += q;
                    short
                })
                .count();
            order.truncate(nucleus);
        }
        let q = softmax(&order);
        let q_max = q.iter().copied().fold(0.0, f64::max);
        let order: Vec<usize> = order
            .iter()
            .zip(&q)
            .filter(|&(_, &qi)| qi >= f64::from(p.min_p) * q_max)
            .map(|(&i, _)| i)
            .collect();
        for (&i, q) in order.iter().zip(softmax(&order)) {
            dist[i] = q;
        }
        dist
    }

    /// Upper tail of the chi-square distribution with `k` degrees of
    /// freedom: the regularised incomplete gamma Q(k/2, x/2), from its power
    /// series below a + 1 and its continued fraction (modified Lentz) above.
    fn chi2_sf(x: f64, k: usize) -> f64 {
        let (a, x) = (k as f64 / 2.0, x / 2.0);
        if x <= 0.0 {
            return 1.0;
        }
        // ln Γ(a) for a half-integer: Γ(1) = 1, Γ(1/2) = √π, Γ(s+1) = s Γ(s).
        let (mut s, mut ln_gamma) = if k.is_multiple_of(2) {
            (1.0, 0.0)
        } else {
            (0.5, 0.5 * std::f64::consts::PI.ln())
        };
        while s < a {
            ln_gamma += f64::ln(s);
            s += 1.0;
        }
        let front = (a * x.ln() - x - ln_gamma).exp();
        if x < a + 1.0 {
            let (mut term, mut sum, mut n) = (1.0 / a, 1.0 / a, a);
            while term > sum * 1e-17 {
                n += 1.0;
                term *= x / n;
                sum += term;
            }
            1.0 - front * sum
        } else {
            let tiny = 1e-300;
            let mut b = x + 1.0 - a;
            let (mut c, mut d) = (1.0 / tiny, 1.0 / b);
            let mut h = d;
            for i in 1..10_000 {
                let an = -(i as f64) * (i as f64 - a);
                b += 2.0;
                d = an * d + b;
                d = if d.abs() < tiny { tiny } else { d };
                c = b + an / c;
                c = if c.abs() < tiny { tiny } else { c };
                d = 1.0 / d;
                h *= d * c;
                if (d * c - 1.0).abs() < 1e-15 {
                    break;
                }
            }
            front * h
        }
    }

    #[test]
    fn chi2_tail_matches_known_values() {
        // Two degrees of freedom: exactly exp(-x/2), on both branches.
        for x in [0.5, 1.0, 3.0, 10.0, 40.0, 200.0] {
            let want = (-x / 2.0f64).exp();
            assert!((chi2_sf(x, 2) / want - 1.0).abs() < 1e-9, "x={x}");
        }
        // Critical values from the standard tables (5 significant digits).
        for (x, k, p) in [
            (3.8415, 1, 0.05),
            (10.828, 1, 0.001),
            (7.8147, 3, 0.05),
            (11.070, 5, 0.05),
            (20.515, 5, 0.001),
            (18.307, 10, 0.05),
            (29.588, 10, 0.001),
            (2.3420, 4, 0.673),
        ] {
            let got = chi2_sf(x, k);
            assert!(
                (got / p - 1.0).abs() < 2e-3,
                "Q({x}, {k}) = {got}, want {p}"
            );
        }
        assert!(chi2_sf(500.0, 7) < 1e-90);
    }

    /// Draws `DRAWS` tokens with `p` after `generated` was output and tests
    /// them against [`reference`]: tokens outside its support are never
    /// drawn, and the counts pass chi-square at 1e-6 (a fixed seed keeps it
    /// deterministic; a correct sampler fails it once in a million seeds).
    fn assert_draws_follow_reference(
        what: &str,
        p: &SamplingParams,
        prompt: &[u32],
        generated: &[u32],
        l: &[f32],
    ) {
        let want = reference(p, &penalised(p, prompt, generated, l));
        let seed = p.seed.expect("seeded");
        let mut counts = vec![0u64; l.len()];
        let mut stream = Sampler::new(p.clone(), prompt).expect("valid");
        let no_penalties = prompt.is_empty()
            && generated.is_empty()
            && p.repetition_penalty == 1.0
            && p.frequency_penalty == 0.0
            && p.presence_penalty == 0.0;
        for i in 0..DRAWS {
            let token = if no_penalties {
                // No penalties: one generator's successive draws.
                stream.sample(&mut l.to_vec()).token
            } else {
                // Each draw changes the penalties, so every draw starts from
                // the same history in a fresh, differently seeded sampler.
                let params = SamplingParams {
                    seed: Some(seed.wrapping_add(i as u64)),
                    ..p.clone()
                };
                let mut s = Sampler::new(params, prompt).expect("valid");
                generated.iter().for_each(|&g| s.accept_external(g));
                s.sample(&mut l.to_vec()).token
            };
            counts[token as usize] += 1;
        }
        let mut stat = 0.0;
        let mut cells = 0;
        for (t, (&q, &c)) in want.iter().zip(&counts).enumerate() {
            if q == 0.0 {
                assert_eq!(
                    c, 0,
                    "{what}: token {t} is outside the truncation set, drawn {c} times; counts {counts:?}, want {want:.4?}"
                );
                continue;
            }
            let expected = q * DRAWS as f64;
            assert!(
                expected >= 20.0,
                "{what}: token {t} expected {expected:.1} times, too few for chi-square"
            );
            assert!(
                c > 0,
                "{what}: token {t} (p = {q:.4}) never drawn; counts {counts:?}"
            );
            stat += (c as f64 - expected).powi(2) / expected;
            cells += 1;
        }
        if cells > 1 {
            let p_value = chi2_sf(stat, cells - 1);
            assert!(
                p_value > 1e-6,
                "{what}: chi-square {stat:.1} on {} degrees of freedom, p = {p_value:.1e}; counts {counts:?}, want {want:.4?}",
                cells - 1
            );
        }
    }

    /// Support of the reference distribution, ascending.
    fn support(p: &SamplingParams, l: &[f32]) -> Vec<usize> {
        let want = reference(p, &penalised(p, &[], &[], l));
        (0..l.len()).filter(|&t| want[t] > 0.0).collect()
    }

    proptest::proptest! {
        /// Over the candidates it asks for, `sample_top` draws what
        /// `sample` draws over the whole row, with the same seed, step
        /// after step, and reports the same log-probabilities.
        #[test]
        fn sampling_the_top_candidates_is_sampling_the_row(
            seed in 0u64..1000,
            // Quarter steps: many ties, also at the k-th place.
            row in proptest::collection::vec(-12i32..12, 2..300),
            temperature in proptest::sample::select(vec![0.0f32, 0.5, 1.0, 1.7]),
            top_k in 1usize..40,
            top_p in proptest::sample::select(vec![1.0f32, 0.9, 0.3]),
            min_p in proptest::sample::select(vec![0.0f32, 0.05, 0.5]),
            top_logprobs in 0usize..6,
            logprobs: bool,
        ) {
            let l: Vec<f32> = row.iter().map(|&v| v as f32 / 4.0).collect();
            let p = SamplingParams {
                temperature,
                top_k,
                top_p,
                min_p,
                top_logprobs,
                logprobs,
                ..seeded(seed)
            };
            let mut whole = Sampler::new(p.clone(), &[]).expect("valid params");
            let mut top = Sampler::new(p, &[]).expect("valid params");
            for step in 0..4 {
                let k = top.candidates();
                proptest::prop_assert!(k.is_some(), "no penalties or bias, a bounded draw");
                let (ids, values, log_z) = top_candidates(&l, k.unwrap_or(0));
                let want = whole.sample(&mut l.clone());
                let got = top.sample_top(&ids, &values, log_z);
                proptest::prop_assert_eq!(got.token, want.token, "step {}", step);
                let close = |a: Option<f32>, b: Option<f32>| match (a, b) {
                    (Some(a), Some(b)) => (a - b).abs() <= 1e-5,
                    (a, b) => a.is_none() && b.is_none(),
                };
                proptest::prop_assert!(close(got.logprob, want.logprob), "{:?} vs {:?}", got.logprob, want.logprob);
                proptest::prop_assert_eq!(got.top.len(), want.top.len());
                for (g, w) in got.top.iter().zip(&want.top) {
                    proptest::prop_assert_eq!(g.0, w.0);
                    proptest::prop_assert!((g.1 - w.1).abs() <= 1e-5);
                }
            }
        }
    }

    #[test]
    fn rows_are_needed_whole_where_a_token_outside_the_top_matters() {
        let greedy = SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        };
        let with = |f: &dyn Fn(&mut SamplingParams)| {
            let mut p = greedy.clone();
            f(&mut p);
            Sampler::new(p, &[1, 2]).expect("valid params").candidates()
        };
        assert_eq!(with(&|_| {}), Some(1));
        assert_eq!(with(&|p| p.top_logprobs = 5), Some(5));
        assert_eq!(
            with(&|p| {
                p.temperature = 0.8;
                p.top_k = 40;
                p.top_logprobs = 3;
            }),
            Some(40)
        );
        assert_eq!(
            with(&|p| p.temperature = 0.8),
            None,
            "a draw over every token"
        );
        assert_eq!(with(&|p| p.logit_bias = vec![(3, 5.0)]), None);
        assert_eq!(with(&|p| p.repetition_penalty = 1.1), None);
        assert_eq!(with(&|p| p.frequency_penalty = 0.5), None);
        assert_eq!(with(&|p| p.presence_penalty = -0.5), None);
        let ban = |p: &mut SamplingParams| {
            p.min_tokens = Some(tandem_types::MinTokens {
                count: 1,
                stop_ids: vec![0],
            });
        };
        assert_eq!(with(&ban), None, "stop tokens banned");
        let mut p = greedy.clone();
        ban(&mut p);
        let mut s = Sampler::new(p, &[]).expect("valid params");
        s.accept_external(4);
        assert_eq!(s.candidates(), Some(1), "the ban is over");
    }

    fn seeded(seed: u64) -> SamplingParams {
        SamplingParams {
            seed: Some(seed),
            ..SamplingParams::default()
        }
    }

    #[test]
    fn temperature_scales_the_softmax() {
        for (i, t) in [0.5f32, 1.0, 1.7].into_iter().enumerate() {
            let p = SamplingParams {
                temperature: t,
                ..seeded(100 + i as u64)
            };
            assert_draws_follow_reference(&format!("temperature {t}"), &p, &[], &[], &LOGITS);
        }
    }

    #[test]
    fn top_k_top_p_and_min_p_keep_their_exact_sets() {
        // Each case with the set the definitions give (the reference is
        // checked against these hand-computed sets, so it cannot drift into
        // the sampler's own mistakes), then the draws against the reference.
        let cases = [
            // Ties at the cut: 4 = 7, the lower id stays.
            (
                "top_k 3",
                SamplingParams {
                    top_k: 3,
                    ..seeded(1)
                },
                vec![1, 3, 4],
            ),
            // Mass by rank .228 .456 .609: 0.5 is reached at the third, again
            // cutting between the tied 4 and 7.
            (
                "top_p 0.5",
                SamplingParams {
                    top_p: 0.5,
                    ..seeded(2)
                },
                vec![1, 3, 4],
            ),
            // .761 .864 .940: the sixth token (6) reaches 0.9.
            (
                "top_p 0.9",
                SamplingParams {
                    top_p: 0.9,
                    ..seeded(3)
                },
                vec![0, 1, 3, 4, 6, 7],
            ),
            // p / p_max: 0 at e^-0.8 = .449 stays, 6 at e^-1.1 = .333 goes.
            (
                "min_p 0.4",
                SamplingParams {
                    min_p: 0.4,
                    ..seeded(4)
                },
                vec![0, 1, 3, 4, 7],
            ),
            // top_k then top_p on what top_k left: the top 5 renormalised
            // reach 0.8 at the fourth (.812); top_p on the full distribution
            // would need the fifth (.761 < 0.8).
            (
                "top_k 5 then top_p 0.8",
                SamplingParams {
                    top_k: 5,
                    top_p: 0.8,
                    ..seeded(5)
                },
                vec![1, 3, 4, 7],
            ),
            // At T = 1.5, top_p 0.74 keeps five tokens, then min_p 0.65
            // drops 0 (p / p_max = e^-0.8/1.5 = .587); min_p first would
            // leave four, whose renormalised mass reaches 0.74 at the third
            // and cut 7 instead.
            (
                "T 1.5, top_p 0.74 then min_p 0.65",
                SamplingParams {
                    temperature: 1.5,
                    top_p: 0.74,
                    min_p: 0.65,
                    ..seeded(6)
                },
                vec![1, 3, 4, 7],
            ),
            // All three cutting: at T = 0.6 top_k 6 drops 2 and 5; the rest
            // renormalised reach 0.92 at the fifth (.877, .954), keeping 0;
            // min_p 0.4 then drops 0 (p / p_max = .264).
            (
                "T 0.6, top_k 6, top_p 0.92, min_p 0.4",
                SamplingParams {
                    temperature: 0.6,
                    top_k: 6,
                    top_p: 0.92,
                    min_p: 0.4,
                    ..seeded(7)
                },
                vec![1, 3, 4, 7],
            ),
        ];
        for (what, p, set) in cases {
            assert_eq!(support(&p, &LOGITS), set, "{what}: reference set");
            assert_draws_follow_reference(what, &p, &[], &[], &LOGITS);
        }
    }

    #[test]
    fn penalties_shift_the_distribution_as_defined() {
        // Prompt tokens 0 and 5 (a negative logit); 1 generated twice, 4 and
        // 6 once.
        let prompt = [0, 5];
        let generated = [1, 4, 1, 6];
        for (i, (rep, freq, pres, t)) in [
            (1.3f32, 0.4f32, 0.3f32, 1.0f32),
            (0.8, -0.3, 0.6, 0.7),
            (1.0, 1.5, -1.0, 1.2),
            (2.0, 0.0, 0.0, 1.0),
        ]
        .into_iter()
        .enumerate()
        {
            let p = SamplingParams {
                temperature: t,
                repetition_penalty: rep,
                frequency_penalty: freq,
                presence_penalty: pres,
                ..seeded(1000 * (i as u64 + 1))
            };
            let what = format!("repetition {rep}, frequency {freq}, presence {pres}, T {t}");
            // The logits are penalised in place, as the definitions say.
            let mut s = Sampler::new(p.clone(), &prompt).expect("valid");
            generated.iter().for_each(|&g| s.accept_external(g));
            let mut l = LOGITS.to_vec();
            s.sample(&mut l);
            let want = penalised(&p, &prompt, &generated, &LOGITS);
            for (t, (&got, &want)) in l.iter().zip(&want).enumerate() {
                assert!(
                    (f64::from(got) - want).abs() < 1e-5,
                    "{what}: logit {t} is {got}, want {want}"
                );
            }
            assert_draws_follow_reference(&what, &p, &prompt, &generated, &LOGITS);
            // Greedy decoding takes the penalised maximum.
            let greedy = SamplingParams {
                temperature: 0.0,
                ..p
            };
            assert_draws_follow_reference(
                &format!("{what}, greedy"),
                &greedy,
                &prompt,
                &generated,
                &LOGITS,
            );
        }
    }

    #[test]
    fn penalties_discourage_repeats() {
        let mut s = Sampler::new(
            SamplingParams {
                temperature: 0.0,
                frequency_penalty: 2.0,
                ..SamplingParams::default()
            },
            &[],
        )
        .expect("valid");
        let l = vec![1.0, 1.5, 0.0];
        assert_eq!(s.sample(&mut l.clone()).token, 1);
        assert_eq!(s.sample(&mut l.clone()).token, 0, "1.5 - 2 < 1");
        let mut s = Sampler::new(
            SamplingParams {
                temperature: 0.0,
                repetition_penalty: 2.0,
                ..SamplingParams::default()
            },
            &[1],
        )
        .expect("valid");
        assert_eq!(
            s.sample(&mut l.clone()).token,
            0,
            "prompt token 1 penalised to 0.75"
        );
    }

    #[test]
    fn logprobs_are_raw_and_sorted() {
        let mut s = Sampler::new(
            SamplingParams {
                temperature: 0.0,
                logprobs: true,
                top_logprobs: 3,
                ..SamplingParams::default()
            },
            &[],
        )
        .expect("valid");
        let out = s.sample(&mut logits());
        let lp = log_softmax(&logits());
        assert_eq!(out.logprob, Some(lp[1]));
        assert_eq!(
            out.top.iter().map(|t| t.0).collect::<Vec<_>>(),
            vec![1, 3, 2]
        );
        let total: f64 = lp.iter().map(|&l| f64::from(l).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
    }

    #[test]
    fn out_of_range_params_are_rejected() {
        for bad in [
            SamplingParams {
                temperature: -0.1,
                ..SamplingParams::default()
            },
            SamplingParams {
                temperature: f32::NAN,
                ..SamplingParams::default()
            },
            SamplingParams {
                top_p: 0.0,
                ..SamplingParams::default()
            },
            SamplingParams {
                min_p: 1.5,
                ..SamplingParams::default()
            },
            SamplingParams {
                presence_penalty: 3.0,
                ..SamplingParams::default()
            },
            SamplingParams {
                repetition_penalty: 0.0,
                ..SamplingParams::default()
            },
            SamplingParams {
                top_logprobs: 21,
                ..SamplingParams::default()
            },
        ] {
            assert!(Sampler::new(bad, &[]).is_err());
        }
    }
}
