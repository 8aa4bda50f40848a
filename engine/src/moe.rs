//! A sparse mixture-of-experts feed-forward block (Mixtral routing, and
//! DeepSeek-V3-style sigmoid routing with a selection bias) with expert
//! parallelism.
//!
//! Each token's router logits pick `top_k` experts; the token's output is
//! the weighted sum of those experts' SwiGLU outputs. Tokens are grouped
//! by expert so each expert runs three matmuls over all its tokens at once.
//!
//! Under expert parallelism the experts are split contiguously across the
//! ranks of a [`Communicator`]; router and bias stay whole on every rank.
//! Two ways to meet the tokens:
//! - [`MoeBlock::forward_replicated`]: every rank already holds every token
//!   (after a tensor-parallel allreduce). Each rank computes its own
//!   experts' weighted outputs for the tokens routed to them, and an
//!   allreduce sums them. No dispatch traffic, but every rank routes and
//!   holds the whole batch.
//! - [`MoeBlock::forward_dispatch`]: each rank holds only its share of the
//!   tokens (after a reduce-scatter). Each (token, expert) item is sent to
//!   the expert's rank with all-to-all, computed there and sent back with a
//!   second all-to-all. Traffic scales with `top_k`, not with the ranks.
//!
//! Wire format of the dispatch (the communicator carries f32 only): an
//! item is `[expert id, x_0 .. x_{d-1}]`, items grouped by destination
//! rank; the reply is `d` floats per item in the order received. What
//! arrives is validated (counts, expert ownership) before use.

use std::sync::Arc;

use tandem_kernels::ops;

use crate::comm::Communicator;
use crate::error::{CollectiveError, ModelError, RequestError};
use crate::weight::Weight;

pub use tandem_modelfile::config::{MoeConfig, Scoring};

/// How a tensor-parallel model's MoE layers meet their tokens (see the
/// module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Combine {
    /// Allreduce the attention output, route every token on every rank,
    /// allreduce the experts' outputs.
    AllReduce,
    /// Reduce-scatter the attention output by tokens, dispatch each rank's
    /// tokens to their experts with all-to-all, allgather the layer output.
    Dispatch,
}

/// One SwiGLU expert.
#[derive(Clone, Debug)]
pub struct Expert {
    /// `ffn x d`.
    pub gate: Weight,
    /// `ffn x d`.
    pub up: Weight,
    /// `d x ffn`.
    pub down: Weight,
}

/// A layer's MoE weights, as loaded.
#[derive(Debug)]
pub struct MoeWeights {
    /// `n_experts x d`.
    pub router: Weight,
    /// Per-expert selection bias (sigmoid routing).
    pub correction_bias: Option<Vec<f32>>,
    /// All experts, in order.
    pub experts: Vec<Expert>,
}

/// A runnable MoE block: the whole model's, or one expert-parallel rank's.
pub struct MoeBlock {
    cfg: MoeConfig,
    d_model: usize,
    router: Weight,
    bias: Vec<f32>,
    /// This rank's experts: `first_expert..first_expert + experts.len()`.
    experts: Vec<Expert>,
    first_expert: usize,
    ep: Option<Arc<dyn Communicator>>,
}

impl std::fmt::Debug for MoeBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MoeBlock")
            .field("cfg", &self.cfg)
            .field(
                "experts",
                &(self.first_expert..self.first_expert + self.experts.len()),
            )
            .field("ep_rank", &self.ep.as_ref().map(|c| c.rank()))
            .finish()
    }
}

/// One token's chosen experts and weights, in selection order.
pub type Route = Vec<(usize, f32)>;

impl MoeBlock {
    /// Checks every shape against `cfg` and `d_model`.
    pub fn new(cfg: MoeConfig, w: MoeWeights, d_model: usize) -> Result<Self, ModelError> {
        cfg.validate()?;
        let bad = |name: &str, problem: String| ModelError::BadTensor {
            name: name.to_string(),
            problem,
        };
        if w.router.shape() != (cfg.n_experts, d_model) {
            return Err(bad(
                "router",
                format!(
                    "shape {:?}, expected ({}, {d_model})",
                    w.router.shape(),
                    cfg.n_experts
                ),
            ));
        }
        if w.experts.len() != cfg.n_experts {
            return Err(bad(
                "experts",
                format!("{} experts, config says {}", w.experts.len(), cfg.n_experts),
            ));
        }
        let bias = match w.correction_bias {
            Some(b) if b.len() != cfg.n_experts => {
                return Err(bad(
                    "e_score_correction_bias",
                    format!("{} values for {} experts", b.len(), cfg.n_experts),
                ));
            }
            Some(b) => b,
            None => vec![0.0; cfg.n_experts],
        };
        let ffn = w.experts.first().map_or(0, |e| e.gate.shape().0);
        for (j, e) in w.experts.iter().enumerate() {
            for (what, got, want) in [
                ("w1 (gate)", e.gate.shape(), (ffn, d_model)),
                ("w3 (up)", e.up.shape(), (ffn, d_model)),
                ("w2 (down)", e.down.shape(), (d_model, ffn)),
            ] {
                if got != want || ffn == 0 {
                    return Err(bad(
                        &format!("expert {j} {what}"),
                        format!("shape {got:?}, expected {want:?}"),
                    ));
                }
            }
        }
        Ok(Self {
            cfg,
            d_model,
            router: w.router,
            bias,
            experts: w.experts,
            first_expert: 0,
            ep: None,
        })
    }

    /// Rank `comm.rank()`'s share of the experts (contiguous); the router
    /// and bias stay whole.
    pub fn shard(&self, comm: Arc<dyn Communicator>) -> Result<MoeBlock, ModelError> {
        let (rank, world) = (comm.rank(), comm.world_size());
        let n = self.cfg.n_experts;
        if self.ep.is_some() {
            return Err(ModelError::InvalidConfig("cannot shard a shard".into()));
        }
        if world == 0 || rank >= world || !n.is_multiple_of(world) {
            return Err(ModelError::InvalidConfig(format!(
                "expert parallelism {world} (rank {rank}) does not divide the {n} experts"
            )));
        }
        let per = n / world;
        Ok(MoeBlock {
            cfg: self.cfg.clone(),
            d_model: self.d_model,
            router: self.router.clone(),
            bias: self.bias.clone(),
            experts: self.experts[rank * per..(rank + 1) * per].to_vec(),
            first_expert: rank * per,
            ep: Some(comm),
        })
    }

    /// Experts per rank (all of them when unsharded).
    fn per_rank(&self) -> usize {
        self.experts.len()
    }

    /// Top-k routing of each of `n_tok` rows of `xn`.
    pub fn route(&self, xn: &[f32], n_tok: usize) -> Result<Vec<Route>, RequestError> {
        let n = self.cfg.n_experts;
        let mut logits = vec![0.0f32; n_tok * n];
        self.router.matmul(xn, n_tok, &mut logits)?;
        Ok(logits
            .chunks_exact(n)
            .map(|l| route_token(&self.cfg, &self.bias, l))
            .collect())
    }

    /// Every rank holds the same `n_tok` rows; `out` (`n_tok x d`) becomes
    /// the block's output on every rank.
    pub fn forward_replicated(
        &self,
        xn: &[f32],
        n_tok: usize,
        out: &mut [f32],
    ) -> Result<(), RequestError> {
        let d = self.d_model;
        check_len("MoE input", xn.len(), n_tok * d)?;
        check_len("MoE output", out.len(), n_tok * d)?;
        let routes = self.route(xn, n_tok)?;
        // (token, expert, weight) items for this rank's experts.
        let mut items = Vec::new();
        for (t, r) in routes.iter().enumerate() {
            for &(e, w) in r {
                if self.owns(e) {
                    items.push((t, e, w));
                }
            }
        }
        out.fill(0.0);
        let rows: Vec<&[f32]> = items
            .iter()
            .map(|&(t, ..)| &xn[t * d..(t + 1) * d])
            .collect();
        let experts: Vec<usize> = items.iter().map(|&(_, e, _)| e).collect();
        let y = self.run_experts(&rows, &experts)?;
        accumulate(&items, &y, d, out);
        if let Some(comm) = &self.ep {
            comm.all_reduce_sum(out)?;
        }
        Ok(())
    }

    /// Each rank holds only its own `n_local` rows (any number, zero
    /// included, as long as every rank calls). Tokens travel to their
    /// experts' ranks and back.
    pub fn forward_dispatch(
        &self,
        xn: &[f32],
        n_local: usize,
        out: &mut [f32],
    ) -> Result<(), RequestError> {
        let Some(comm) = &self.ep else {
            return self.forward_replicated(xn, n_local, out);
        };
        let d = self.d_model;
        check_len("MoE input", xn.len(), n_local * d)?;
        check_len("MoE output", out.len(), n_local * d)?;
        let world = comm.world_size();
        let routes = self.route(xn, n_local)?;
        // Items sorted by destination rank (stable: token order within).
        let mut items: Vec<(usize, usize, f32)> = routes
            .iter()
            .enumerate()
            .flat_map(|(t, r)| r.iter().map(move |&(e, w)| (t, e, w)))
            .collect();
        let per = self.per_rank();
        items.sort_by_key(|&(_, e, _)| e / per);
        let mut send = Vec::with_capacity(items.len() * (d + 1));
        let mut send_counts = vec![0usize; world];
        for &(t, e, _) in &items {
            send.push(e as f32);
            send.extend_from_slice(&xn[t * d..(t + 1) * d]);
            send_counts[e / per] += d + 1;
        }
        let (mut recv, mut recv_counts) = (Vec::new(), Vec::new());
        comm.all_to_all(&send, &send_counts, &mut recv, &mut recv_counts)?;

        let owned = self.first_expert..self.first_expert + per;
        let computed = decode_items(&recv, &recv_counts, d, owned)
            .and_then(|(rows, experts)| self.run_experts(&rows, &experts));
        // A rank that cannot serve its payload still joins the reply
        // exchange, sending nothing: the peers that wrote to it then fail on
        // their reply counts below instead of blocking in the collective.
        let (y, back_counts): (&[f32], Vec<usize>) = match &computed {
            Ok(y) => (y, recv_counts.iter().map(|c| c / (d + 1) * d).collect()),
            Err(_) => (&[], vec![0; world]),
        };
        let (mut got, mut got_counts) = (Vec::new(), Vec::new());
        comm.all_to_all(y, &back_counts, &mut got, &mut got_counts)?;
        computed?;
        // Replies come back rank-major in the order sent, so each rank must
        // answer exactly the items it was sent.
        let want_counts: Vec<usize> = send_counts.iter().map(|c| c / (d + 1) * d).collect();
        if got_counts != want_counts {
            return Err(CollectiveError::ReplyCounts {
                got: got_counts,
                want: want_counts,
            }
            .into());
        }
        check_len("MoE combine", got.len(), items.len() * d)?;
        out.fill(0.0);
        accumulate(&items, &got, d, out);
        Ok(())
    }

    fn owns(&self, e: usize) -> bool {
        (self.first_expert..self.first_expert + self.experts.len()).contains(&e)
    }

    /// `expert(x)` for each row, `d` floats each, in the rows' order:
    /// rows are grouped by expert so each expert runs once over its tokens.
    fn run_experts(&self, rows: &[&[f32]], experts: &[usize]) -> Result<Vec<f32>, RequestError> {
        let d = self.d_model;
        let mut y = vec![0.0f32; rows.len() * d];
        let mut order: Vec<usize> = (0..rows.len()).collect();
        order.sort_by_key(|&i| experts[i]);
        let (mut x, mut gate, mut up, mut out) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for group in order.chunk_by(|&a, &b| experts[a] == experts[b]) {
            let Some(ex) = experts
                .get(group[0])
                .and_then(|&e| e.checked_sub(self.first_expert))
                .and_then(|i| self.experts.get(i))
            else {
                return Err(CollectiveError::ExpertNotHere(experts[group[0]]).into());
            };
            let (m, ffn) = (group.len(), ex.gate.shape().0);
            x.clear();
            for &i in group {
                x.extend_from_slice(rows[i]);
            }
            gate.resize(m * ffn, 0.0);
            up.resize(m * ffn, 0.0);
            out.resize(m * d, 0.0);
            ex.gate.matmul(&x, m, &mut gate)?;
            ex.up.matmul(&x, m, &mut up)?;
            ops::silu_mul(&mut gate, &up);
            ex.down.matmul(&gate, m, &mut out)?;
            for (k, &i) in group.iter().enumerate() {
                y[i * d..(i + 1) * d].copy_from_slice(&out[k * d..(k + 1) * d]);
            }
        }
        Ok(y)
    }
}

/// Chooses `top_k` experts and their weights from one token's router
/// logits (public as the reference a device's routing is tested against).
pub fn route_token(cfg: &MoeConfig, bias: &[f32], logits: &[f32]) -> Route {
    let scores: Vec<f32> = match cfg.scoring {
        Scoring::Softmax => {
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let exp: Vec<f32> = logits.iter().map(|&l| (l - max).exp()).collect();
            let sum: f32 = exp.iter().sum();
            exp.iter().map(|&e| e / sum).collect()
        }
        Scoring::Sigmoid => logits.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect(),
    };
    // A NaN key (a diverged activation) ranks below every number:
    // `total_cmp` alone ranks a positive NaN above +inf, and x86's negative
    // NaN logits come out of the sigmoid positive.
    let key = |e: usize| match scores[e] + bias[e] {
        k if k.is_nan() => f32::NEG_INFINITY,
        k => k,
    };
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    // Descending by selection key; ties keep the lower expert first.
    idx.sort_by(|&a, &b| key(b).total_cmp(&key(a)).then(a.cmp(&b)));
    idx.truncate(cfg.top_k);
    let mut chosen: Route = idx.into_iter().map(|e| (e, scores[e])).collect();
    let sum: f32 = chosen.iter().map(|&(_, w)| w).sum();
    for (_, w) in &mut chosen {
        if cfg.norm_topk_prob && sum > 0.0 {
            *w /= sum;
        }
        *w *= cfg.routed_scaling;
    }
    chosen
}

/// Adds each item's weighted expert output (`y`, `d` floats per item, in
/// item order) into its token's row of `out`, in ascending expert order per
/// token so the sum does not depend on where the items were computed.
fn accumulate(items: &[(usize, usize, f32)], y: &[f32], d: usize, out: &mut [f32]) {
    let mut order: Vec<usize> = (0..items.len()).collect();
    order.sort_by_key(|&i| (items[i].0, items[i].1));
    for i in order {
        let (t, _, w) = items[i];
        for (o, &v) in out[t * d..(t + 1) * d]
            .iter_mut()
            .zip(&y[i * d..(i + 1) * d])
        {
            *o += w * v;
        }
    }
}

/// Splits a received dispatch payload (`recv_counts[q]` floats from rank
/// `q`, rank-major) into rows and expert ids, checking that every rank sent
/// whole items, for experts in `owned`.
fn decode_items<'a>(
    recv: &'a [f32],
    recv_counts: &[usize],
    d: usize,
    owned: std::ops::Range<usize>,
) -> Result<(Vec<&'a [f32]>, Vec<usize>), RequestError> {
    let item_len = d + 1;
    if let Some((q, c)) = recv_counts
        .iter()
        .enumerate()
        .find(|(_, c)| !c.is_multiple_of(item_len))
    {
        return Err(CollectiveError::PartialItems {
            rank: q,
            floats: *c,
            item_len,
        }
        .into());
    }
    let total = recv_counts
        .iter()
        .try_fold(0usize, |acc, &c| acc.checked_add(c));
    if total != Some(recv.len()) {
        return Err(CollectiveError::ReceivedTotal {
            received: recv.len(),
            counts: recv_counts.to_vec(),
        }
        .into());
    }
    let mut rows = Vec::with_capacity(recv.len() / item_len);
    let mut experts = Vec::with_capacity(rows.capacity());
    for item in recv.chunks_exact(item_len) {
        let id = item[0];
        let e = id as usize;
        if id.fract() != 0.0 || id < 0.0 || !owned.contains(&e) {
            return Err(CollectiveError::ForeignExpert { id, owned }.into());
        }
        experts.push(e);
        rows.push(&item[1..]);
    }
    Ok((rows, experts))
}

fn check_len(what: &'static str, got: usize, want: usize) -> Result<(), RequestError> {
    if got == want {
        Ok(())
    } else {
        Err(CollectiveError::Length { what, got, want }.into())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::comm::CpuGroup;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;
    use tandem_kernels::GgmlType;
    use tandem_modelfile::storage::Backing;

    const D: usize = 32;
    const FFN: usize = 48;
    const E: usize = 8;

    fn weight(rows: usize, cols: usize, rng: &mut ChaCha8Rng, scale: f32) -> (Weight, Vec<f32>) {
        let v: Vec<f32> = (0..rows * cols)
            .map(|_| rng.random_range(-scale..scale))
            .collect();
        let bytes: Vec<u8> = bytemuck::cast_slice(&v).to_vec();
        let n = bytes.len();
        let w = Weight::new(
            "t",
            GgmlType::F32,
            rows,
            cols,
            Arc::new(Backing::Owned(bytes)),
            0..n,
        )
        .expect("weight");
        (w, v)
    }

    /// The block plus plain copies of its weights for the f64 reference.
    struct Fixture {
        cfg: MoeConfig,
        router: Vec<f32>,
        bias: Vec<f32>,
        experts: Vec<[Vec<f32>; 3]>,
        block: MoeBlock,
    }

    fn fixture(scoring: Scoring, norm: bool, seed: u64) -> Fixture {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let cfg = MoeConfig {
            n_experts: E,
            top_k: 2,
            scoring,
            norm_topk_prob: norm,
            routed_scaling: if scoring == Scoring::Sigmoid {
                2.5
            } else {
                1.0
            },
        };
        let (router_w, router) = weight(E, D, &mut rng, 1.0);
        let bias: Vec<f32> = (0..E).map(|_| rng.random_range(-0.5..0.5)).collect();
        let mut experts = Vec::new();
        let mut plain = Vec::new();
        for _ in 0..E {
            let (g, gv) = weight(FFN, D, &mut rng, 0.3);
            let (u, uv) = weight(FFN, D, &mut rng, 0.3);
            let (dn, dv) = weight(D, FFN, &mut rng, 0.3);
            experts.push(Expert {
                gate: g,
                up: u,
                down: dn,
            });
            plain.push([gv, uv, dv]);
        }
        let w = MoeWeights {
            router: router_w,
            correction_bias: (scoring == Scoring::Sigmoid).then(|| bias.clone()),
            experts,
        };
        let block = MoeBlock::new(cfg.clone(), w, D).expect("block");
        let bias = if scoring == Scoring::Sigmoid {
            bias
        } else {
            vec![0.0; E]
        };
        Fixture {
            cfg,
            router,
            bias,
            experts: plain,
            block,
        }
    }

    /// Independent f64 reference: plain loops, no kernels.
    fn reference(f: &Fixture, x: &[f32]) -> Vec<f32> {
        let dot = |w: &[f32], row: usize, cols: usize, v: &[f64]| -> f64 {
            (0..cols).map(|k| f64::from(w[row * cols + k]) * v[k]).sum()
        };
        let mut out = Vec::new();
        for xr in x.chunks_exact(D) {
            let xv: Vec<f64> = xr.iter().map(|&v| f64::from(v)).collect();
            let logits: Vec<f64> = (0..E).map(|e| dot(&f.router, e, D, &xv)).collect();
            let scores: Vec<f64> = match f.cfg.scoring {
                Scoring::Softmax => {
                    let m = logits.iter().copied().fold(f64::MIN, f64::max);
                    let s: f64 = logits.iter().map(|l| (l - m).exp()).sum();
                    logits.iter().map(|l| (l - m).exp() / s).collect()
                }
                Scoring::Sigmoid => logits.iter().map(|l| 1.0 / (1.0 + (-l).exp())).collect(),
            };
            let mut idx: Vec<usize> = (0..E).collect();
            idx.sort_by(|&a, &b| {
                (scores[b] + f64::from(f.bias[b])).total_cmp(&(scores[a] + f64::from(f.bias[a])))
            });
            let chosen = &idx[..f.cfg.top_k];
            let sum: f64 = chosen.iter().map(|&e| scores[e]).sum();
            let mut y = vec![0.0f64; D];
            for &e in chosen {
                let mut w = scores[e];
                if f.cfg.norm_topk_prob {
                    w /= sum;
                }
                w *= f64::from(f.cfg.routed_scaling);
                let [g, u, dn] = &f.experts[e];
                let h: Vec<f64> = (0..FFN)
                    .map(|i| {
                        let a = dot(g, i, D, &xv);
                        a / (1.0 + (-a).exp()) * dot(u, i, D, &xv)
                    })
                    .collect();
                for (r, yr) in y.iter_mut().enumerate() {
                    *yr += w * dot(dn, r, FFN, &h);
                }
            }
            out.extend(y.iter().map(|&v| v as f32));
        }
        out
    }

    fn inputs(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        (0..n * D).map(|_| rng.random_range(-1.0..1.0)).collect()
    }

    fn assert_close(got: &[f32], want: &[f32], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}");
        let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-3);
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-4 * scale,
                "{what}: element {i}: {g} vs {w}"
            );
        }
    }

    #[test]
    fn unsharded_block_matches_the_f64_reference() {
        for (scoring, norm) in [
            (Scoring::Softmax, true),
            (Scoring::Softmax, false),
            (Scoring::Sigmoid, true),
            (Scoring::Sigmoid, false),
        ] {
            let f = fixture(scoring, norm, 7);
            let x = inputs(9, 1);
            let mut out = vec![0.0; x.len()];
            f.block.forward_replicated(&x, 9, &mut out).unwrap();
            assert_close(
                &out,
                &reference(&f, &x),
                &format!("{scoring:?} norm={norm}"),
            );
        }
    }

    #[test]
    fn routing_ties_and_biased_selection() {
        let cfg = MoeConfig {
            n_experts: 4,
            top_k: 2,
            scoring: Scoring::Softmax,
            norm_topk_prob: true,
            routed_scaling: 1.0,
        };
        // Ties pick the lower index.
        let r = route_token(&cfg, &[0.0; 4], &[1.0, 2.0, 2.0, 2.0]);
        assert_eq!(r.iter().map(|p| p.0).collect::<Vec<_>>(), vec![1, 2]);
        assert!((r[0].1 - 0.5).abs() < 1e-6);
        // Sigmoid: the bias changes the choice, not the weights.
        let cfg = MoeConfig {
            scoring: Scoring::Sigmoid,
            norm_topk_prob: false,
            routed_scaling: 2.0,
            ..cfg
        };
        let logits = [2.0, 1.0, 0.0, -1.0];
        let r = route_token(&cfg, &[0.0, 0.0, 0.0, 5.0], &logits);
        assert_eq!(r.iter().map(|p| p.0).collect::<Vec<_>>(), vec![3, 0]);
        let sig = |l: f32| 1.0 / (1.0 + (-l).exp());
        assert!((r[0].1 - 2.0 * sig(-1.0)).abs() < 1e-6);
        assert!((r[1].1 - 2.0 * sig(2.0)).abs() < 1e-6);
        // A NaN logit (a diverged activation) neither panics nor wins,
        // whatever its sign bit (arithmetic yields NaNs of either sign): the
        // best two of the others are chosen, with their own weights.
        for nan in [f32::NAN, -f32::NAN] {
            for (logits, want) in [
                ([nan, 1.0, 0.5, 0.0], [1, 2]),
                ([1.0, 0.5, nan, 2.0], [3, 0]),
            ] {
                let r = route_token(&cfg, &[0.0; 4], &logits);
                let what = format!("logits {logits:?}, NaN sign bit {}", nan.is_sign_negative());
                assert_eq!(r.iter().map(|p| p.0).collect::<Vec<_>>(), want, "{what}");
                for (&(e, w), l) in r.iter().zip(want.map(|e| logits[e])) {
                    assert!(
                        (w - 2.0 * sig(l)).abs() < 1e-6,
                        "{what}: expert {e} weight {w}"
                    );
                }
            }
        }
    }

    /// Runs `f(rank's block, rank)` on every rank of a `world`-way split.
    fn on_ranks<T: Send>(
        block: &MoeBlock,
        world: usize,
        f: impl Fn(&MoeBlock, usize) -> T + Sync,
    ) -> Vec<T> {
        let shards: Vec<MoeBlock> = CpuGroup::new(world)
            .into_iter()
            .map(|c| block.shard(Arc::new(c)).unwrap())
            .collect();
        std::thread::scope(|s| {
            let hs: Vec<_> = shards
                .iter()
                .enumerate()
                .map(|(r, b)| {
                    let f = &f;
                    s.spawn(move || f(b, r))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn expert_parallel_replicated_matches_unsharded() {
        let f = fixture(Scoring::Sigmoid, true, 3);
        let x = inputs(11, 2);
        let mut want = vec![0.0; x.len()];
        f.block.forward_replicated(&x, 11, &mut want).unwrap();
        for world in [2, 4] {
            for got in on_ranks(&f.block, world, |b, _| {
                let mut out = vec![0.0; x.len()];
                b.forward_replicated(&x, 11, &mut out).unwrap();
                out
            }) {
                assert_close(&got, &want, &format!("EP={world} replicated"));
            }
        }
    }

    #[test]
    fn expert_parallel_dispatch_handles_uneven_and_empty_shares() {
        let f = fixture(Scoring::Softmax, true, 5);
        for (world, shares) in [
            (4, vec![2, 2, 1, 0]),
            (4, vec![1, 0, 0, 0]),
            (4, vec![0, 0, 0, 0]),
            (2, vec![3, 4]),
        ] {
            let n: usize = shares.iter().sum();
            let x = inputs(n, 9);
            let mut want = vec![0.0; x.len()];
            f.block.forward_replicated(&x, n, &mut want).unwrap();
            let starts: Vec<usize> = shares
                .iter()
                .scan(0, |acc, &s| {
                    let a = *acc;
                    *acc += s;
                    Some(a)
                })
                .collect();
            let outs = on_ranks(&f.block, world, |b, r| {
                let rows = starts[r]..starts[r] + shares[r];
                let mut out = vec![0.0; rows.len() * D];
                b.forward_dispatch(&x[rows.start * D..rows.end * D], rows.len(), &mut out)
                    .unwrap();
                out
            });
            assert_close(&outs.concat(), &want, &format!("EP={world} {shares:?}"));
        }
    }

    #[test]
    fn bad_shapes_and_splits_are_refused() {
        let f = fixture(Scoring::Softmax, true, 1);
        let e = f
            .block
            .shard(Arc::new(CpuGroup::new(3).remove(0)))
            .unwrap_err();
        assert!(
            e.to_string().contains("does not divide the 8 experts"),
            "{e}"
        );
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let mk = |router: Weight, top_k: usize, rng: &mut ChaCha8Rng| {
            let experts = (0..E)
                .map(|_| Expert {
                    gate: weight(FFN, D, rng, 0.1).0,
                    up: weight(FFN, D, rng, 0.1).0,
                    down: weight(D, FFN, rng, 0.1).0,
                })
                .collect();
            MoeBlock::new(
                MoeConfig {
                    top_k,
                    ..f.cfg.clone()
                },
                MoeWeights {
                    router,
                    correction_bias: None,
                    experts,
                },
                D,
            )
        };
        let wrong_router = weight(E + 1, D, &mut rng, 0.1).0;
        assert!(mk(wrong_router, 2, &mut rng).is_err());
        let router = weight(E, D, &mut rng, 0.1).0;
        assert!(mk(router, E + 1, &mut rng).is_err());
    }

    #[test]
    fn malformed_dispatch_payloads_are_errors() {
        let d = 4;
        // The collective error a payload is refused with.
        let kind = |r: Result<(Vec<&[f32]>, Vec<usize>), RequestError>| match r {
            Err(RequestError::Collective(e)) => Some(e),
            _ => None,
        };
        // Not a whole number of items.
        assert!(matches!(
            kind(decode_items(&[0.0; 7], &[7], d, 0..2)),
            Some(CollectiveError::PartialItems {
                rank: 0,
                floats: 7,
                item_len: 5
            })
        ));
        // Whole in total (10 = 2 items) but split 3 + 7 across two ranks.
        assert!(matches!(
            kind(decode_items(&[1.0; 10], &[3, 7], d, 0..2)),
            Some(CollectiveError::PartialItems { rank: 0, .. })
        ));
        // Counts that disagree with the payload, or overflow.
        assert!(matches!(
            kind(decode_items(&[1.0; 5], &[5, 5], d, 0..2)),
            Some(CollectiveError::ReceivedTotal { received: 5, .. })
        ));
        assert!(matches!(
            kind(decode_items(&[1.0; 5], &[usize::MAX, 5], d, 0..2)),
            Some(CollectiveError::PartialItems { .. } | CollectiveError::ReceivedTotal { .. })
        ));
        // An expert this rank does not own; fractional, negative, NaN and
        // infinite ids.
        for id in [2.0, 0.5, -1.0, f32::NAN, f32::INFINITY, 1e30] {
            let mut item = vec![0.0; d + 1];
            item[0] = id;
            assert!(
                matches!(
                    kind(decode_items(&item, &[d + 1], d, 0..2)),
                    Some(CollectiveError::ForeignExpert { .. })
                ),
                "{id}"
            );
        }
        let ok = [1.0, 1.0, 2.0, 3.0, 4.0];
        let (rows, experts) = decode_items(&ok, &[0, 5], d, 0..2).unwrap();
        assert_eq!((rows[0], experts[0]), (&ok[1..], 1));
        assert!(decode_items(&[], &[0, 0], d, 0..2).unwrap().0.is_empty());
    }
}
