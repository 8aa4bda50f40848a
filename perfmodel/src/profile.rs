//! The engine profile file: measured forward-call times, and the
//! interpolation the mock engine and the simulator share.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// The file format's version; a file of another version is refused.
pub const PROFILE_VERSION: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("reading the profile {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("parsing the profile {path}: {source}")]
    Parse {
        path: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("invalid profile: {0}")]
    Invalid(String),
}

/// One measured prefill point: a forward call of `tokens` prompt tokens of
/// one sequence starting at position 0.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PrefillPoint {
    pub tokens: usize,
    pub seconds: f64,
}

/// One measured decode step: `batch` sequences of one token each, every
/// sequence `context` tokens long.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DecodePoint {
    pub batch: usize,
    pub context: usize,
    pub seconds: f64,
}

/// What `tandem bench-engine --profile FILE` writes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineProfile {
    pub version: u32,
    /// The model's name, for reports.
    pub model: String,
    /// The kernel ISA and thread count it was measured with.
    pub isa: String,
    pub threads: usize,
    /// Tensor-parallel degree of the measured engine.
    pub tp: usize,
    /// Prefill points, sorted by `tokens`, at least one.
    pub prefill: Vec<PrefillPoint>,
    /// Decode points on a grid: every batch at every context, at least one.
    pub decode: Vec<DecodePoint>,
}

impl EngineProfile {
    pub fn load(path: &Path) -> Result<Self, ProfileError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ProfileError::Io {
            path: shown.clone(),
            source,
        })?;
        let profile: Self = serde_json::from_str(&text).map_err(|source| ProfileError::Parse {
            path: shown,
            source,
        })?;
        profile.validate()?;
        Ok(profile)
    }

    pub fn to_json(&self) -> String {
        // A struct of plain numbers and strings always serializes.
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// Checks what interpolation relies on: points present, finite and
    /// positive, prefill sorted by tokens, decode a full batch x context grid.
    pub fn validate(&self) -> Result<(), ProfileError> {
        let bad = |m: String| Err(ProfileError::Invalid(m));
        if self.version != PROFILE_VERSION {
            return bad(format!(
                "version {} (this build reads version {PROFILE_VERSION})",
                self.version
            ));
        }
        if self.tp == 0 || self.threads == 0 {
            return bad("tp and threads must be at least 1".into());
        }
        if self.prefill.is_empty() || self.decode.is_empty() {
            return bad("needs at least one prefill and one decode point".into());
        }
        let ok = |s: f64| s.is_finite() && s > 0.0;
        for w in self.prefill.windows(2) {
            if w[0].tokens >= w[1].tokens {
                return bad("prefill points must be sorted by strictly increasing tokens".into());
            }
        }
        if self.prefill.iter().any(|p| p.tokens == 0 || !ok(p.seconds)) {
            return bad("prefill points need tokens >= 1 and finite positive seconds".into());
        }
        if self
            .decode
            .iter()
            .any(|p| p.batch == 0 || p.context == 0 || !ok(p.seconds))
        {
            return bad(
                "decode points need batch, context >= 1 and finite positive seconds".into(),
            );
        }
        let (batches, contexts) = self.decode_axes();
        if batches.len() * contexts.len() != self.decode.len() {
            return bad(format!(
                "decode points must form a grid ({} batches x {} contexts, {} points)",
                batches.len(),
                contexts.len(),
                self.decode.len()
            ));
        }
        for &b in &batches {
            for &c in &contexts {
                if self.decode_at(b, c).is_none() {
                    return bad(format!("decode grid lacks batch {b} at context {c}"));
                }
            }
        }
        Ok(())
    }

    fn decode_axes(&self) -> (Vec<usize>, Vec<usize>) {
        let mut b: Vec<usize> = self.decode.iter().map(|p| p.batch).collect();
        let mut c: Vec<usize> = self.decode.iter().map(|p| p.context).collect();
        b.sort_unstable();
        b.dedup();
        c.sort_unstable();
        c.dedup();
        (b, c)
    }

    fn decode_at(&self, batch: usize, context: usize) -> Option<f64> {
        self.decode
            .iter()
            .find(|p| p.batch == batch && p.context == context)
            .map(|p| p.seconds)
    }

    /// Seconds for one forward call prefilling `tokens` prompt tokens of one
    /// sequence: piecewise linear between points, proportional below the
    /// first, and extended at the last segment's per-token slope.
    pub fn prefill_seconds(&self, tokens: usize) -> f64 {
        if tokens == 0 {
            return 0.0;
        }
        let xs: Vec<(f64, f64)> = self
            .prefill
            .iter()
            .map(|p| (p.tokens as f64, p.seconds))
            .collect();
        interpolate(&xs, tokens as f64, true)
    }

    /// Seconds for one decode step of `batch` single-token sequences whose
    /// mean context is `context`: bilinear on the measured grid, linear
    /// beyond its edges (clamped at zero below).
    pub fn decode_step_seconds(&self, batch: usize, context: usize) -> f64 {
        if batch == 0 {
            return 0.0;
        }
        let (batches, contexts) = self.decode_axes();
        let at_context = |c: usize| -> f64 {
            let pts: Vec<(f64, f64)> = batches
                .iter()
                .map(|&b| (b as f64, self.decode_at(b, c).unwrap_or(0.0)))
                .collect();
            interpolate(&pts, batch as f64, false)
        };
        let pts: Vec<(f64, f64)> = contexts
            .iter()
            .map(|&c| (c as f64, at_context(c)))
            .collect();
        interpolate(&pts, context.max(1) as f64, false).max(1e-9)
    }

    /// Seconds for one scheduler step holding `prefill_tokens` prompt tokens
    /// and `decode_batch` decoding sequences of mean context `context`: the
    /// two parts share the weights' pass, so the step costs the larger part
    /// plus the smaller part's marginal cost over an empty call.
    pub fn step_seconds(&self, prefill_tokens: usize, decode_batch: usize, context: usize) -> f64 {
        let p = self.prefill_seconds(prefill_tokens);
        let d = self.decode_step_seconds(decode_batch, context);
        if prefill_tokens == 0 {
            return d;
        }
        if decode_batch == 0 {
            return p;
        }
        // The weight read both parts would repeat is one batch-1 step.
        let floor = self.decode_step_seconds(1, context);
        p + (d - floor).max(0.0)
    }
}

/// Linear interpolation over points sorted by x, extrapolating with the end
/// segments; with `through_origin`, below the first point the line runs
/// through (0, 0).
fn interpolate(pts: &[(f64, f64)], x: f64, through_origin: bool) -> f64 {
    match pts {
        [] => 0.0,
        [(x0, y0)] => {
            if through_origin {
                y0 * x / x0
            } else {
                *y0
            }
        }
        _ => {
            let first = pts[0];
            if x <= first.0 && through_origin {
                return first.1 * x / first.0;
            }
            let i = pts
                .windows(2)
                .position(|w| x <= w[1].0)
                .unwrap_or(pts.len() - 2);
            let (a, b) = (pts[i], pts[i + 1]);
            let y = a.1 + (b.1 - a.1) * (x - a.0) / (b.0 - a.0);
            y.max(0.0)
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn profile() -> EngineProfile {
        EngineProfile {
            version: PROFILE_VERSION,
            model: "m".into(),
            isa: "scalar".into(),
            threads: 2,
            tp: 1,
            prefill: vec![
                PrefillPoint {
                    tokens: 16,
                    seconds: 0.016,
                },
                PrefillPoint {
                    tokens: 128,
                    seconds: 0.100,
                },
                PrefillPoint {
                    tokens: 512,
                    seconds: 0.500,
                },
            ],
            decode: vec![
                DecodePoint {
                    batch: 1,
                    context: 128,
                    seconds: 0.010,
                },
                DecodePoint {
                    batch: 8,
                    context: 128,
                    seconds: 0.020,
                },
                DecodePoint {
                    batch: 1,
                    context: 1024,
                    seconds: 0.012,
                },
                DecodePoint {
                    batch: 8,
                    context: 1024,
                    seconds: 0.040,
                },
            ],
        }
    }

    #[test]
    fn interpolates_prefill_and_extends_the_last_slope() {
        let p = profile();
        assert!((p.prefill_seconds(8) - 0.008).abs() < 1e-12);
        assert!((p.prefill_seconds(128) - 0.100).abs() < 1e-12);
        assert!((p.prefill_seconds(320) - 0.300).abs() < 1e-12);
        assert!((p.prefill_seconds(1024) - 1.033_333_333_333_333_3).abs() < 1e-9);
        assert_eq!(p.prefill_seconds(0), 0.0);
    }

    #[test]
    fn interpolates_decode_bilinearly() {
        let p = profile();
        assert!((p.decode_step_seconds(1, 128) - 0.010).abs() < 1e-12);
        // Halfway in batch at both contexts, then halfway in context.
        let b = 1 + 7 / 2;
        let at128 = 0.010 + 0.010 * (b - 1) as f64 / 7.0;
        let at1024 = 0.012 + 0.028 * (b - 1) as f64 / 7.0;
        let want = at128 + (at1024 - at128) * (576.0 - 128.0) / 896.0;
        assert!((p.decode_step_seconds(b, 576) - want).abs() < 1e-12);
        // Below the grid it holds the edge segment's line.
        assert!(p.decode_step_seconds(1, 1) > 0.0);
    }

    #[test]
    fn mixed_steps_pay_one_weight_pass() {
        let p = profile();
        let mixed = p.step_seconds(128, 8, 128);
        assert!((mixed - (0.100 + 0.020 - 0.010)).abs() < 1e-12);
        assert_eq!(p.step_seconds(0, 8, 128), p.decode_step_seconds(8, 128));
        assert_eq!(p.step_seconds(16, 0, 128), p.prefill_seconds(16));
    }

    #[test]
    fn invalid_profiles_are_refused() {
        let mut p = profile();
        p.decode.pop();
        assert!(matches!(p.validate(), Err(ProfileError::Invalid(_))));
        let mut p = profile();
        p.prefill.swap(0, 1);
        assert!(p.validate().is_err());
        let mut p = profile();
        p.prefill[0].seconds = f64::NAN;
        assert!(p.validate().is_err());
        let mut p = profile();
        p.version = 99;
        assert!(p.validate().is_err());
        assert!(profile().validate().is_ok());
    }

    #[test]
    fn round_trips_through_json() {
        let p = profile();
        let back: EngineProfile = serde_json::from_str(&p.to_json()).unwrap();
        assert_eq!(back, p);
    }
}
