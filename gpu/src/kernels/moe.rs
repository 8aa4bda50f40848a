//! A mixture-of-experts layer's routing and the moves of tokens to and
//! from their experts, all on the device: the host never learns which
//! tokens went where, so a step has no round trip per layer.
//!
//! [`moe_route`] picks each token's experts and groups the picks per
//! expert (token ids and weights in token order, and a count). Then, per
//! expert, [`moe_gather`] packs its tokens' rows, the expert's matmuls run
//! over the first `counts[e]` rows only ([`super::matmul_q_live`]), and
//! [`moe_scatter_add`] adds the weighted rows into their tokens' output.
//! Experts are added in ascending order, as the CPU engine adds them.

use cubecl::prelude::*;

use super::{arg, line, shape};
use crate::device::{Buffer, GpuDevice};
use crate::error::GpuError;

/// Most experts a layer may have: a token's scores live in a local array
/// of this many values (DeepSeek-V3 has 256).
pub const MOE_MAX_EXPERTS: usize = 256;

/// How a layer routes: `top_k` of `experts` by score (softmax over the
/// router's logits, or a sigmoid per expert, plus a selection `bias`),
/// weighted by their scores, normalised to sum to 1 with `norm`, times
/// `scaling`: `tandem_modelfile::config::MoeConfig` on the device.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeRouting {
    pub experts: usize,
    pub top_k: usize,
    pub sigmoid: bool,
    pub norm: bool,
    pub scaling: f32,
}

#[cube(launch, create_dummy_kernel)]
pub(super) fn moe_route_kernel(
    logits: &[f32],
    bias: &[f32],
    sel: &mut [u32],
    sel_w: &mut [f32],
    scaling: f32,
    #[comptime] experts: usize,
    #[comptime] top_k: usize,
    #[comptime] sigmoid: bool,
    #[comptime] norm: bool,
) {
    let t = ABSOLUTE_POS;
    let n = logits.len() / experts;
    if t < n {
        let base = t * experts;
        // The CPU's formulas, in its order.
        let mut score = Array::<f32>::new(experts);
        if sigmoid {
            for e in 0..experts {
                score[e] = 1.0f32 / (1.0f32 + f32::exp(-logits[base + e]));
            }
        } else {
            let mut max = logits[base];
            for e in 1..experts {
                max = f32::max(max, logits[base + e]);
            }
            let mut sum = 0.0f32;
            for e in 0..experts {
                let v = f32::exp(logits[base + e] - max);
                score[e] = v;
                sum += v;
            }
            for e in 0..experts {
                score[e] /= sum;
            }
        }
        // Largest score + bias first; on equal keys the lower expert.
        let mut total = 0.0f32;
        for j in 0..top_k {
            let mut best = 0usize;
            let mut found = false;
            let mut best_key = 0.0f32;
            for e in 0..experts {
                let mut taken = false;
                for i in 0..j {
                    if sel[t * top_k + i] == e as u32 {
                        taken = true;
                    }
                }
                let key = score[e] + bias[e];
                if !taken && (!found || key > best_key) {
                    best = e;
                    best_key = key;
                    found = true;
                }
            }
            sel[t * top_k + j] = best as u32;
            sel_w[t * top_k + j] = score[best];
            total += score[best];
        }
        for j in 0..top_k {
            let mut w = sel_w[t * top_k + j];
            if norm && total > 0.0f32 {
                w /= total;
            }
            sel_w[t * top_k + j] = w * scaling;
        }
    }
}

#[cube(launch, create_dummy_kernel)]
pub(super) fn moe_group_kernel(
    sel: &[u32],
    sel_w: &[f32],
    order: &mut [u32],
    weight: &mut [f32],
    counts: &mut [u32],
    #[comptime] experts: usize,
    #[comptime] top_k: usize,
) {
    let e = ABSOLUTE_POS;
    let n = sel.len() / top_k;
    if e < experts {
        let mut count = 0usize;
        for t in 0..n {
            for j in 0..top_k {
                if sel[t * top_k + j] == e as u32 {
                    order[e * n + count] = t as u32;
                    weight[e * n + count] = sel_w[t * top_k + j];
                    count += 1;
                }
            }
        }
        counts[e] = count as u32;
    }
}

#[cube(launch, create_dummy_kernel)]
pub(super) fn moe_gather_kernel(
    src: &[f32],
    order: &[u32],
    counts: &[u32],
    dst: &mut [f32],
    expert: u32,
    #[comptime] d: usize,
) {
    let idx = ABSOLUTE_POS;
    let n = src.len() / d;
    let (e, i) = (expert as usize, idx / d);
    if idx < n * d && i < counts[e] as usize {
        let t = order[e * n + i] as usize;
        dst[idx] = src[t * d + idx % d];
    }
}

#[cube(launch, create_dummy_kernel)]
pub(super) fn moe_scatter_kernel(
    y: &[f32],
    order: &[u32],
    weight: &[f32],
    counts: &[u32],
    out: &mut [f32],
    expert: u32,
    #[comptime] d: usize,
) {
    let idx = ABSOLUTE_POS;
    let n = out.len() / d;
    let (e, i) = (expert as usize, idx / d);
    if idx < n * d && i < counts[e] as usize {
        let t = order[e * n + i] as usize;
        out[t * d + idx % d] += weight[e * n + i] * y[idx];
    }
}

/// Routes each token row of the router's `logits` (rows of
/// `r.experts`) and groups the picks per expert: `order[e * n + i]` is
/// the `i`-th token (ascending) routed to expert `e`, `weight` its
/// weight, `counts[e]` how many there are. `sel` and `sel_w` (`n *
/// top_k` each) are scratch: each token's picks.
#[allow(clippy::too_many_arguments)]
pub fn moe_route(
    dev: &GpuDevice,
    logits: &Buffer,
    bias: &Buffer,
    r: &MoeRouting,
    sel: &Buffer<u32>,
    sel_w: &Buffer,
    order: &Buffer<u32>,
    weight: &Buffer,
    counts: &Buffer<u32>,
) -> Result<(), GpuError> {
    let (e, k) = (r.experts, r.top_k);
    if !(1..=MOE_MAX_EXPERTS).contains(&e) || !(1..=e).contains(&k) {
        return Err(shape(
            "moe_route",
            format!("top {k} of {e} experts (at most {MOE_MAX_EXPERTS})"),
        ));
    }
    let n = logits.len() / e;
    if logits.len() % e != 0
        || bias.len() != e
        || sel.len() != n * k
        || sel_w.len() != n * k
        || order.len() != e * n
        || weight.len() != e * n
        || counts.len() != e
    {
        return Err(shape(
            "moe_route",
            format!(
                "logits {} (rows of {e}), bias {}, picks {} and {}, groups {} and {}, counts {}",
                logits.len(),
                bias.len(),
                sel.len(),
                sel_w.len(),
                order.len(),
                weight.len(),
                counts.len()
            ),
        ));
    }
    if n == 0 {
        return Ok(());
    }
    let (count, dim) = line(n);
    moe_route_kernel::launch(
        dev.client(),
        count,
        dim,
        arg(logits),
        arg(bias),
        arg(sel),
        arg(sel_w),
        r.scaling,
        e,
        k,
        r.sigmoid,
        r.norm,
    );
    let (count, dim) = line(e);
    moe_group_kernel::launch(
        dev.client(),
        count,
        dim,
        arg(sel),
        arg(sel_w),
        arg(order),
        arg(weight),
        arg(counts),
        e,
        k,
    );
    Ok(())
}

/// Rows of `order` and `counts` (as [`moe_route`] wrote them) for
/// `expert` over `n` tokens, or why not.
fn check_groups(
    kernel: &'static str,
    order: &Buffer<u32>,
    counts: &Buffer<u32>,
    expert: usize,
    n: usize,
) -> Result<u32, GpuError> {
    match u32::try_from(expert) {
        Ok(e) if expert < counts.len() && order.len() == counts.len() * n => Ok(e),
        _ => Err(shape(
            kernel,
            format!(
                "expert {expert} of {}, groups {} for {n} tokens",
                counts.len(),
                order.len()
            ),
        )),
    }
}

/// Packs the rows of `src` (rows of `d`) routed to `expert` into the
/// first `counts[expert]` rows of `dst`, in token order.
pub fn moe_gather(
    dev: &GpuDevice,
    src: &Buffer,
    order: &Buffer<u32>,
    counts: &Buffer<u32>,
    expert: usize,
    d: usize,
    dst: &Buffer,
) -> Result<(), GpuError> {
    if d == 0 || src.len() % d != 0 || dst.len() != src.len() {
        return Err(shape(
            "moe_gather",
            format!("src {} and dst {} rows of {d}", src.len(), dst.len()),
        ));
    }
    let e = check_groups("moe_gather", order, counts, expert, src.len() / d)?;
    if src.is_empty() {
        return Ok(());
    }
    let (count, dim) = line(src.len());
    moe_gather_kernel::launch(
        dev.client(),
        count,
        dim,
        arg(src),
        arg(order),
        arg(counts),
        arg(dst),
        e,
        d,
    );
    Ok(())
}

/// Adds row `i` of `y` (rows of `d`), times its weight, into the row of
/// `out` of the `i`-th token routed to `expert`, for the first
/// `counts[expert]` rows.
#[allow(clippy::too_many_arguments)]
pub fn moe_scatter_add(
    dev: &GpuDevice,
    y: &Buffer,
    order: &Buffer<u32>,
    weight: &Buffer,
    counts: &Buffer<u32>,
    expert: usize,
    d: usize,
    out: &Buffer,
) -> Result<(), GpuError> {
    if d == 0 || out.len() % d != 0 || y.len() != out.len() || weight.len() != order.len() {
        return Err(shape(
            "moe_scatter_add",
            format!(
                "y {} and out {} rows of {d}, weights {} for groups {}",
                y.len(),
                out.len(),
                weight.len(),
                order.len()
            ),
        ));
    }
    let e = check_groups("moe_scatter_add", order, counts, expert, out.len() / d)?;
    if out.is_empty() {
        return Ok(());
    }
    let (count, dim) = line(out.len());
    moe_scatter_kernel::launch(
        dev.client(),
        count,
        dim,
        arg(y),
        arg(order),
        arg(weight),
        arg(counts),
        arg(out),
        e,
        d,
    );
    Ok(())
}
