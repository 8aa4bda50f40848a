//! Token sampling: penalties, temperature, top-k / top-p / min-p, seeded
//! randomness, and log-probabilities.
//!
//! Order of operations (as in vLLM and llama.cpp): repetition penalty
//! (prompt and output tokens), frequency/presence penalties (output tokens),
//! then greedy if temperature is 0, else temperature, top-k, top-p, min-p
//! and a draw. Reported log-probabilities are those of the model's raw
//! distribution, before penalties and truncation.

use std::collections::HashMap;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// How to pick tokens for one request.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means no top-k truncation.
    pub top_k: usize,
    /// 1.0 means no nucleus truncation.
    pub top_p: f32,
    /// 0.0 means no min-p truncation.
    pub min_p: f32,
    /// Seed of the request's own generator; `None` draws one from the OS.
    pub seed: Option<u64>,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    /// 1.0 means none (HF/llama.cpp style: divide positive logits, multiply negative).
    pub repetition_penalty: f32,
    /// Number of most likely alternatives to report with each token (0 = none).
    pub top_logprobs: usize,
    /// Report the chosen token's log-probability.
    pub logprobs: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            repetition_penalty: 1.0,
            top_logprobs: 0,
            logprobs: false,
        }
    }
}

/// The largest `top_logprobs` accepted (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// A sampling parameter outside its range.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SamplingError {
    #[error("{name} must be {range}, got {value}")]
    OutOfRange {
        name: &'static str,
        range: &'static str,
        value: f64,
    },
}

impl SamplingParams {
    /// Greedy decoding with no penalties.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    pub fn validate(&self) -> Result<(), SamplingError> {
        let check = |ok: bool, name, range, value: f64| {
            if ok {
                Ok(())
            } else {
                Err(SamplingError::OutOfRange { name, range, value })
            }
        };
        let t = self.temperature;
        check(
            t.is_finite() && (0.0..=2.0).contains(&t),
            "temperature",
            "between 0 and 2",
            t.into(),
        )?;
        let p = self.top_p;
        check(
            p.is_finite() && p > 0.0 && p <= 1.0,
            "top_p",
            "in (0, 1]",
            p.into(),
        )?;
        let m = self.min_p;
        check(
            m.is_finite() && (0.0..=1.0).contains(&m),
            "min_p",
            "between 0 and 1",
            m.into(),
        )?;
        for (name, v) in [
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ] {
            check(
                v.is_finite() && (-2.0..=2.0).contains(&v),
                name,
                "between -2 and 2",
                v.into(),
            )?;
        }
        let r = self.repetition_penalty;
        check(
            r.is_finite() && r > 0.0 && r <= 10.0,
            "repetition_penalty",
            "in (0, 10]",
            r.into(),
        )?;
        check(
            self.top_logprobs <= MAX_TOP_LOGPROBS,
            "top_logprobs",
            "between 0 and 20",
            self.top_logprobs as f64,
        )?;
        Ok(())
    }
}

/// One sampled token and, if asked for, its log-probabilities.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    /// Log-probability of `token` under the raw model distribution.
    pub logprob: Option<f32>,
    /// Most likely alternatives, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// Per-request sampling state.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    /// How often each token has been generated so far.
    output_counts: HashMap<u32, u32>,
    /// Tokens seen in the prompt (for the repetition penalty).
    prompt_tokens: Vec<u32>,
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
        if self.params.temperature != 0.0 {
            let _ = self.rng.random::<f64>();
        }
    }

    /// Picks the next token from `logits` (modified in place) and records it.
    pub fn sample(&mut self, logits: &mut [f32]) -> Sampled {
        let p = &self.params;
        let want_lp = p.logprobs || p.top_logprobs > 0;
        let raw_logprobs = want_lp.then(|| log_softmax(logits));

        self.apply_penalties(logits);
        let token = if p.temperature == 0.0 {
            argmax(logits)
        } else {
            self.draw(logits)
        };
        *self.output_counts.entry(token).or_insert(0) += 1;

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

    fn draw(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        // Candidates sorted by logit, most likely first (ties: lower id first).
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, l)| l.is_finite())
            .map(|(i, &l)| (i as u32, l / p.temperature))
            .collect();
        if cand.is_empty() {
            return 0;
        }
        let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
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

/// `log(softmax(x))`, computed stably in `f64`.
pub fn log_softmax(x: &[f32]) -> Vec<f32> {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = x.iter().map(|&v| f64::from(v - max).exp()).sum();
    let log_z = f64::from(max) + sum.ln();
    x.iter().map(|&v| (f64::from(v) - log_z) as f32).collect()
}

fn top_n(lp: &[f32], n: usize) -> Vec<(u32, f32)> {
    if n == 0 {
        return Vec::new();
    }
    let mut idx: Vec<(u32, f32)> = lp.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
    let by = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let n = n.min(idx.len());
    if n < idx.len() {
        idx.select_nth_unstable_by(n - 1, by);
        idx.truncate(n);
    }
    idx.sort_unstable_by(by);
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
    fn seeded_sampling_is_reproducible_and_varies_with_seed() {
        let params = |seed| SamplingParams {
            temperature: 1.0,
            seed: Some(seed),
            ..SamplingParams::default()
        };
        let run = |seed| {
            let mut s = Sampler::new(params(seed), &[]).expect("valid");
            (0..64)
                .map(|_| s.sample(&mut logits()).token)
                .collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    #[test]
    fn top_k_one_is_greedy_and_top_k_limits_support() {
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

    #[test]
    fn top_p_and_min_p_truncate() {
        // One dominant token: top_p 0.5 and min_p 0.5 keep only it.
        let l = vec![10.0, 0.0, 0.0, 0.0];
        for params in [
            SamplingParams {
                top_p: 0.5,
                seed: Some(3),
                ..SamplingParams::default()
            },
            SamplingParams {
                min_p: 0.5,
                seed: Some(3),
                ..SamplingParams::default()
            },
        ] {
            let mut s = Sampler::new(params, &[]).expect("valid");
            for _ in 0..100 {
                assert_eq!(s.sample(&mut l.clone()).token, 0);
            }
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
