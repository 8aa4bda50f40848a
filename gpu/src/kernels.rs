//! The forward pass's kernels, each a CubeCL kernel and a host function
//! that checks sizes and launches it. Numerics follow the CPU reference in
//! `tandem-kernels` where the device allows (same formulas and orders);
//! the tests state how close each must come.

use cubecl::prelude::*;

use tandem_kernels::ops::{GELU_C, GELU_K2};
use tandem_modelfile::arch::Activation;

use crate::device::{Buffer, GpuDevice};
use crate::error::GpuError;

mod moe;
mod quant;
pub use moe::{MOE_MAX_EXPERTS, MoeRouting, moe_gather, moe_route, moe_scatter_add};
pub use quant::{QFormat, QMatrix, matmul_q, matmul_q_live};

/// Units per cube for the row-wise kernels (a power of two).
const ROW_UNITS: usize = 64;
/// Units per cube of the element-wise kernels (large: see
/// [`MATMUL_ROWS`]).
const UNITS: usize = 256;

fn shape(kernel: &'static str, what: String) -> GpuError {
    GpuError::Shape { kernel, what }
}

/// A buffer as a kernel argument.
fn arg<T>(b: &Buffer<T>) -> BufferArg {
    // SAFETY: a `Buffer` is created holding exactly `len` values of `T`
    // (`GpuDevice::upload`), so the handle covers `len` elements.
    unsafe { BufferArg::from_raw_parts(b.handle.clone(), b.len()) }
}

/// Cubes of `units` covering `n` items.
fn cubes(n: usize, units: usize) -> u32 {
    u32::try_from(n.div_ceil(units)).unwrap_or(u32::MAX)
}

/// A grid of one unit per item for `n` items, in cubes of [`UNITS`]
/// (along x, then y: kernels index it by `ABSOLUTE_POS`, which counts
/// across both).
fn line(n: usize) -> (CubeCount, CubeDim) {
    let total = n.div_ceil(UNITS);
    let x = total.clamp(1, MAX_CUBES_X);
    (
        CubeCount::Static(x as u32, cubes(total, x), 1),
        CubeDim::new_1d(UNITS as u32),
    )
}

/// A grid of one cube of [`ROW_UNITS`] per row, for `n` rows.
fn rows_grid(n: usize) -> (CubeCount, CubeDim) {
    (
        CubeCount::Static(cubes(n, 1), 1, 1),
        CubeDim::new_1d(ROW_UNITS as u32),
    )
}

/// An element-wise kernel's grid over `a` and `b`, which must hold as many
/// values; `None` when they are empty.
fn elementwise(
    kernel: &'static str,
    a: &Buffer,
    b: &Buffer,
) -> Result<Option<(CubeCount, CubeDim)>, GpuError> {
    if a.len() != b.len() {
        return Err(shape(
            kernel,
            format!("{} and {} values differ", a.len(), b.len()),
        ));
    }
    Ok((!a.is_empty()).then(|| line(a.len())))
}

/// The sum (`max` false) or maximum of every unit's `value` across the
/// cube, through `sh` (`units` slots) in a fixed pairwise tree, so every
/// run gives the same result. Every unit must call it (it synchronises).
#[cube]
fn cube_reduce(
    sh: &mut Shared<[f32]>,
    value: f32,
    unit: usize,
    #[comptime] units: usize,
    #[comptime] max: bool,
) -> f32 {
    segment_reduce(sh, value, unit, units, max)
}

/// [`cube_reduce`] within each run of `width` consecutive units (a power
/// of two dividing the cube): each unit gets its own segment's result.
#[cube]
fn segment_reduce(
    sh: &mut Shared<[f32]>,
    value: f32,
    unit: usize,
    #[comptime] width: usize,
    #[comptime] max: bool,
) -> f32 {
    let lane = unit % width;
    sh[unit] = value;
    sync_cube();
    #[unroll]
    for level in 0..width.trailing_zeros() {
        let stride = width >> (level + 1);
        if lane < stride {
            if max {
                sh[unit] = f32::max(sh[unit], sh[unit + stride]);
            } else {
                sh[unit] += sh[unit + stride];
            }
        }
        sync_cube();
    }
    let total = sh[unit - lane];
    // Nobody overwrites `sh` before every unit has read its total.
    sync_cube();
    total
}

/// An RMSNorm row's scale, `1 / rms`, once every unit holds its share
/// `ss` of the row's sum of squares.
#[cube]
fn rms_scale(ss: f32, eps: f32, #[comptime] d: usize, #[comptime] units: usize) -> f32 {
    let mut sh = Shared::<[f32]>::new_slice(units);
    let ss = cube_reduce(&mut sh, ss, UNIT_POS_X as usize, units, false);
    1.0f32 / f32::sqrt(ss / d as f32 + eps)
}

/// This unit's share of the sum of squares of `x[base..base + d]` (units
/// stride over it).
#[cube]
fn sum_squares(
    x: &[f32],
    base: usize,
    unit: usize,
    #[comptime] d: usize,
    #[comptime] units: usize,
) -> f32 {
    let mut ss = 0.0f32;
    for k in 0..d.div_ceil(units) {
        let i = unit + k * units;
        if i < d {
            let v = x[base + i];
            ss += v * v;
        }
    }
    ss
}

#[cube(launch, create_dummy_kernel)]
fn rms_norm_kernel(
    x: &[f32],
    w: &[f32],
    out: &mut [f32],
    eps: f32,
    #[comptime] d: usize,
    #[comptime] units: usize,
) {
    let base = CUBE_POS_X as usize * d;
    let unit = UNIT_POS_X as usize;
    let scale = rms_scale(sum_squares(x, base, unit, d, units), eps, d, units);
    for k in 0..d.div_ceil(units) {
        let i = unit + k * units;
        if i < d {
            out[base + i] = (x[base + i] * scale) * w[i];
        }
    }
}

#[cube(launch, create_dummy_kernel)]
#[allow(clippy::too_many_arguments)]
fn add_rms_norm_kernel(
    x: &mut [f32],
    delta: &[f32],
    post: &[f32],
    w: &[f32],
    out: &mut [f32],
    eps: f32,
    #[comptime] d: usize,
    #[comptime] units: usize,
    #[comptime] has_post: bool,
) {
    let base = CUBE_POS_X as usize * d;
    let unit = UNIT_POS_X as usize;
    // With a post norm, `delta` is normalised (with weights `post`) before
    // it is added, as `rms_norm` would compute it.
    let mut post_scale = 1.0f32;
    if has_post {
        post_scale = rms_scale(sum_squares(delta, base, unit, d, units), eps, d, units);
    }
    let mut ss = 0.0f32;
    for k in 0..d.div_ceil(units) {
        let i = unit + k * units;
        if i < d {
            let mut dv = delta[base + i];
            if has_post {
                dv = (dv * post_scale) * post[i];
            }
            let v = x[base + i] + dv;
            x[base + i] = v;
            ss += v * v;
        }
    }
    let scale = rms_scale(ss, eps, d, units);
    // Each unit reads back only the values it wrote itself.
    for k in 0..d.div_ceil(units) {
        let i = unit + k * units;
        if i < d {
            out[base + i] = (x[base + i] * scale) * w[i];
        }
    }
}

/// Per-head RMSNorm in place over the first `q_heads + k_heads` heads of
/// `hd` values of each row of `stride` (a fused `[q | k | v]` row): query
/// heads with weights `wq`, key heads with `wk` (Gemma 3's QK norms).
#[cube(launch, create_dummy_kernel)]
#[allow(clippy::too_many_arguments)]
fn head_rms_norm_kernel(
    x: &mut [f32],
    wq: &[f32],
    wk: &[f32],
    eps: f32,
    #[comptime] stride: usize,
    #[comptime] q_heads: usize,
    #[comptime] hd: usize,
    #[comptime] units: usize,
) {
    // One cube per (head, row): the grid's x axis covers the query and
    // key heads only.
    let h = CUBE_POS_X as usize;
    let base = CUBE_POS_Y as usize * stride + h * hd;
    let unit = UNIT_POS_X as usize;
    // (`sum_squares` takes a read-only slice; this kernel's is mutable.)
    let mut ss = 0.0f32;
    for k in 0..hd.div_ceil(units) {
        let i = unit + k * units;
        if i < hd {
            let v = x[base + i];
            ss += v * v;
        }
    }
    let scale = rms_scale(ss, eps, hd, units);
    // Each unit rewrites only the values it read itself.
    for k in 0..hd.div_ceil(units) {
        let i = unit + k * units;
        if i < hd {
            let mut wv = wk[i];
            if h < q_heads {
                wv = wq[i];
            }
            x[base + i] = (x[base + i] * scale) * wv;
        }
    }
}

/// Rows of an RMSNorm over `x` (into `out`, with `delta` added first when
/// given) with weights `w`, or why the sizes do not fit.
fn norm_rows(
    kernel: &'static str,
    x: &Buffer,
    delta: Option<&Buffer>,
    w: &Buffer,
    out: &Buffer,
) -> Result<usize, GpuError> {
    let d = w.len();
    let delta_fits = delta.is_none_or(|b| b.len() == x.len());
    if d == 0 || x.len() % d != 0 || out.len() != x.len() || !delta_fits {
        return Err(shape(
            kernel,
            format!(
                "x {}, out {}{} must be rows of {d}",
                x.len(),
                out.len(),
                delta.map_or(String::new(), |b| format!(" and delta {}", b.len()))
            ),
        ));
    }
    Ok(x.len() / d)
}

/// `out[r] = x[r] / rms(x[r]) * w` for each row of `w.len()` values.
pub fn rms_norm(
    dev: &GpuDevice,
    x: &Buffer,
    w: &Buffer,
    eps: f32,
    out: &Buffer,
) -> Result<(), GpuError> {
    let rows = norm_rows("rms_norm", x, None, w, out)?;
    if rows > 0 {
        let (count, dim) = rows_grid(rows);
        rms_norm_kernel::launch(
            dev.client(),
            count,
            dim,
            arg(x),
            arg(w),
            arg(out),
            eps,
            w.len(),
            ROW_UNITS,
        );
    }
    Ok(())
}

/// The residual connection and the next norm in one launch:
/// `x += delta`, then `out = rms_norm(x) * w`, as [`add`] then
/// [`rms_norm`] compute them (the same operations in the same order).
/// With `post` (Gemma's norms on the attention and FFN outputs), `delta`
/// is first normalised with those weights: `x += rms_norm(delta) * post`.
pub fn add_rms_norm(
    dev: &GpuDevice,
    x: &Buffer,
    delta: &Buffer,
    post: Option<&Buffer>,
    w: &Buffer,
    eps: f32,
    out: &Buffer,
) -> Result<(), GpuError> {
    let rows = norm_rows("add_rms_norm", x, Some(delta), w, out)?;
    if let Some(p) = post
        && p.len() != w.len()
    {
        return Err(shape(
            "add_rms_norm",
            format!("post-norm weights {} for rows of {}", p.len(), w.len()),
        ));
    }
    if rows > 0 {
        let (count, dim) = rows_grid(rows);
        add_rms_norm_kernel::launch(
            dev.client(),
            count,
            dim,
            arg(x),
            arg(delta),
            // Unread without a post norm.
            arg(post.unwrap_or(w)),
            arg(w),
            arg(out),
            eps,
            w.len(),
            ROW_UNITS,
            post.is_some(),
        );
    }
    Ok(())
}

/// RMSNorm in place of each of the first `q_heads + k_heads` heads of
/// `hd` values in every row of `stride` values of `x` (a fused `[q | k |
/// v]` row): the query heads with weights `wq`, the key heads with `wk`,
/// as the CPU engine normalises Gemma 3's queries and keys.
#[allow(clippy::too_many_arguments)]
pub fn head_rms_norm(
    dev: &GpuDevice,
    x: &Buffer,
    stride: usize,
    q_heads: usize,
    k_heads: usize,
    wq: &Buffer,
    wk: &Buffer,
    eps: f32,
) -> Result<(), GpuError> {
    let hd = wq.len();
    let heads = q_heads + k_heads;
    if hd == 0 || wk.len() != hd || heads * hd > stride || !x.len().is_multiple_of(stride) {
        return Err(shape(
            "head_rms_norm",
            format!(
                "x {} in rows of {stride} with {heads} heads of weights {} and {}",
                x.len(),
                wq.len(),
                wk.len()
            ),
        ));
    }
    let rows = x.len() / stride;
    if rows == 0 || heads == 0 {
        return Ok(());
    }
    let (Ok(h32), Ok(r32), true) = (
        u32::try_from(heads),
        u32::try_from(rows),
        rows <= MAX_CUBES_X && heads <= MAX_CUBES_X,
    ) else {
        return Err(shape(
            "head_rms_norm",
            format!("{rows} rows of {heads} heads exceed the grid"),
        ));
    };
    head_rms_norm_kernel::launch(
        dev.client(),
        CubeCount::Static(h32, r32, 1),
        CubeDim::new_1d(ROW_UNITS as u32),
        arg(x),
        arg(wq),
        arg(wk),
        eps,
        stride,
        q_heads,
        hd,
        ROW_UNITS,
    );
    Ok(())
}

#[cube(launch, create_dummy_kernel)]
fn glu_kernel(gate_up: &[f32], out: &mut [f32], #[comptime] ffn: usize, #[comptime] gelu: bool) {
    let i = ABSOLUTE_POS;
    if i < out.len() {
        let at = (i / ffn) * 2 * ffn + i % ffn;
        let g = gate_up[at];
        // SiLU is `g / (1 + e^-g)`; GELU's tanh form `g / (1 + e^-z)` with
        // the CPU's `z`, in its order of operations.
        let mut z = g;
        if gelu {
            z = (GELU_K2 * g) * (1.0f32 + GELU_C * (g * g));
        }
        out[i] = g / (1.0f32 + f32::exp(-z)) * gate_up[at + ffn];
    }
}

/// A gated FFN's activation over rows of `2 * ffn` values, the gate
/// projection then the up projection (one matmul's output over both
/// weights): `out[t][i] = act(gate[t][i]) * up[t][i]`, `act` SiLU
/// (SwiGLU) or GELU's tanh form (GeGLU).
pub fn glu(
    dev: &GpuDevice,
    gate_up: &Buffer,
    ffn: usize,
    act: Activation,
    out: &Buffer,
) -> Result<(), GpuError> {
    if ffn == 0 || gate_up.len() != 2 * out.len() || !out.len().is_multiple_of(ffn) {
        return Err(shape(
            "glu",
            format!(
                "gate_up {} must be rows of 2 x {ffn}, out {} rows of {ffn}",
                gate_up.len(),
                out.len()
            ),
        ));
    }
    if out.is_empty() {
        return Ok(());
    }
    let (count, dim) = line(out.len());
    let gelu = act == Activation::GeluTanh;
    glu_kernel::launch(dev.client(), count, dim, arg(gate_up), arg(out), ffn, gelu);
    Ok(())
}

#[cube(launch, create_dummy_kernel)]
fn rope_kernel(
    x: &mut [f32],
    pos: &[u32],
    cos_sin: &[f32],
    #[comptime] width: usize,
    #[comptime] stride: usize,
    #[comptime] head_dim: usize,
    #[comptime] pairs: usize,
    #[comptime] neox: bool,
) {
    // One unit per (token, head, pair).
    let id = ABSOLUTE_POS;
    let per_token = (width / head_dim) * pairs;
    let t = id / per_token;
    if t < pos.len() {
        let rest = id % per_token;
        let (head, i) = (rest / pairs, rest % pairs);
        let row = t * stride + head * head_dim;
        let mut a = row + 2 * i;
        let mut b = a + 1;
        if neox {
            a = row + i;
            b = row + i + pairs;
        }
        let at = (pos[t] as usize * pairs + i) * 2;
        let (sin, cos) = (cos_sin[at], cos_sin[at + 1]);
        let (x0, x1) = (x[a], x[b]);
        x[a] = x0 * cos - x1 * sin;
        x[b] = x0 * sin + x1 * cos;
    }
}

/// Rotary position embedding of `pairs` dimension pairs per head, in
/// place over the first `width = heads * head_dim` values of tokens' rows
/// of `stride` values (Q and K together, the start of a fused QKV row),
/// token `t` at position `pos[t]`. `sin_cos` holds `(sin, cos)` of every pair's angle
/// for positions `0..max`, `(pos * pairs + i) * 2` first: computed on the
/// host once (as the CPU forward does), so both backends rotate by the same
/// angles. `neox` pairs `i` with `i + pairs`, otherwise `2i` with `2i + 1`.
#[allow(clippy::too_many_arguments)]
pub fn rope(
    dev: &GpuDevice,
    x: &Buffer,
    pos: &Buffer<u32>,
    sin_cos: &Buffer,
    width: usize,
    stride: usize,
    head_dim: usize,
    pairs: usize,
    neox: bool,
) -> Result<(), GpuError> {
    if head_dim == 0
        || !width.is_multiple_of(head_dim)
        || 2 * pairs > head_dim
        || pairs == 0
        || width > stride
    {
        return Err(shape(
            "rope",
            format!(
                "width {width} of rows of {stride}, head_dim {head_dim} and {pairs} pairs do not fit"
            ),
        ));
    }
    if x.len() != pos.len() * stride || sin_cos.len() % (2 * pairs) != 0 {
        return Err(shape(
            "rope",
            format!(
                "x {} must be {} rows of {stride}, sin_cos whole positions of {pairs} pairs",
                x.len(),
                pos.len()
            ),
        ));
    }
    // Positions are read on the device: their range is the caller's
    // contract (the scheduler's positions stay below the table's length).
    let units = pos.len() * (width / head_dim) * pairs;
    if units == 0 {
        return Ok(());
    }
    let (count, dim) = line(units);
    rope_kernel::launch(
        dev.client(),
        count,
        dim,
        arg(x),
        arg(pos),
        arg(sin_cos),
        width,
        stride,
        head_dim,
        pairs,
        neox,
    );
    Ok(())
}

#[cube(launch, create_dummy_kernel)]
fn matmul_kernel(
    x: &[f32],
    w: &[f32],
    out: &mut [f32],
    n_tok: u32,
    #[comptime] cols: usize,
    #[comptime] units: usize,
    #[comptime] tile: usize,
) {
    let rows = w.len() / cols;
    let r = matmul_row(rows);
    let t0 = CUBE_POS_Z as usize * tile;
    let n = n_tok as usize;
    let unit = UNIT_POS_X as usize % units;
    let wb = r * cols;
    let mut acc = Array::<f32>::new(tile);
    #[unroll]
    for j in 0..tile {
        acc[j] = 0.0f32;
    }
    if r < rows {
        // Neighbouring units read neighbouring columns: coalesced. Each
        // weight is read once for the tile's tokens.
        for k in 0..cols.div_ceil(units) {
            let c = unit + k * units;
            if c < cols {
                let wc = w[wb + c];
                #[unroll]
                for j in 0..tile {
                    if t0 + j < n {
                        acc[j] += x[(t0 + j) * cols + c] * wc;
                    }
                }
            }
        }
    }
    let mut sh = Shared::<[f32]>::new_slice(units * MATMUL_ROWS);
    #[unroll]
    for j in 0..tile {
        let total = segment_reduce(&mut sh, acc[j], UNIT_POS_X as usize, units, false);
        if r < rows && unit == 0 && t0 + j < n {
            out[(t0 + j) * rows + r] = total;
        }
    }
}

/// `out[t][r] = x[t] . w[r]` for f32 weights of `cols` columns.
pub fn matmul(
    dev: &GpuDevice,
    x: &Buffer,
    w: &Buffer,
    cols: usize,
    out: &Buffer,
) -> Result<(), GpuError> {
    if cols == 0 || w.len() % cols != 0 {
        return Err(shape(
            "matmul",
            format!("w {} is not rows of {cols}", w.len()),
        ));
    }
    let (n_tok, rows) = matmul_shape("matmul", x.len(), w.len() / cols, cols, out.len())?;
    if let Some((count, dim, tile, n_tok)) = matmul_grid("matmul", n_tok, rows)? {
        matmul_kernel::launch(
            dev.client(),
            count,
            dim,
            arg(x),
            arg(w),
            arg(out),
            n_tok,
            cols,
            MATMUL_UNITS,
            tile,
        );
    }
    Ok(())
}

/// Units per output row of a matmul, striding along the row (one
/// subgroup on most GPUs).
const MATMUL_UNITS: usize = 32;
/// Output rows per cube: large cubes, since cubes are not free (measured
/// on an H200 through Vulkan: ~4.5 ns each, the bound of a one-row cube
/// over a 14336-row matrix).
const MATMUL_ROWS: usize = 8;
/// Cubes along a grid's x axis, Vulkan's guaranteed minimum per axis;
/// more rows continue on the y axis.
const MAX_CUBES_X: usize = 65_535;

/// Tokens a matmul unit computes at once, each weight read once for all
/// of them: a power of two up to 8, the fewest covering `n_tok` (so one
/// token, a decode step of one sequence, runs the one-token kernel).
fn matmul_tile(n_tok: usize) -> usize {
    n_tok.next_power_of_two().clamp(1, MATMUL_TILE)
}

/// Most tokens per matmul tile.
const MATMUL_TILE: usize = 8;

/// A matmul's grid: one cube of [`MATMUL_UNITS`] units for each of
/// [`MATMUL_ROWS`] output rows (cubes laid along x, then y), a layer of
/// cubes per tile of tokens (z); with the tile and the token count as the
/// kernel takes them. `None` when the output is empty.
fn matmul_grid(
    kernel: &'static str,
    n_tok: usize,
    rows: usize,
) -> Result<Option<(CubeCount, CubeDim, usize, u32)>, GpuError> {
    if n_tok * rows == 0 {
        return Ok(None);
    }
    let cubes = rows.div_ceil(MATMUL_ROWS);
    let x = cubes.min(MAX_CUBES_X);
    let y = cubes.div_ceil(x);
    let tile = matmul_tile(n_tok);
    let z = n_tok.div_ceil(tile);
    let (Ok(n32), true) = (u32::try_from(n_tok), y <= MAX_CUBES_X && z <= MAX_CUBES_X) else {
        return Err(shape(
            kernel,
            format!("{rows} rows x {n_tok} tokens exceed the launch grid"),
        ));
    };
    Ok(Some((
        CubeCount::Static(x as u32, y as u32, z as u32),
        CubeDim::new_1d((MATMUL_UNITS * MATMUL_ROWS) as u32),
        tile,
        n32,
    )))
}

/// This unit's output row in a [`matmul_grid`] (`rows` or more past the
/// end, for the last cubes' spare units).
#[cube]
fn matmul_row(rows: usize) -> usize {
    let x = rows.div_ceil(MATMUL_ROWS).min(MAX_CUBES_X);
    let cube = CUBE_POS_Y as usize * x + CUBE_POS_X as usize;
    cube * MATMUL_ROWS + UNIT_POS_X as usize / MATMUL_UNITS
}

/// Tokens and rows of a matmul of `rows` weight rows whose `x` holds rows
/// of `cols` and whose output holds `tokens * rows`.
fn matmul_shape(
    kernel: &'static str,
    x_len: usize,
    rows: usize,
    cols: usize,
    out_len: usize,
) -> Result<(usize, usize), GpuError> {
    if cols == 0 || !x_len.is_multiple_of(cols) || out_len != (x_len / cols) * rows {
        return Err(shape(
            kernel,
            format!("x {x_len} must be rows of {cols} and out {out_len} tokens x {rows} rows"),
        ));
    }
    Ok((x_len / cols, rows))
}

/// `f32` of the IEEE half whose bits are the low 16 of `h`.
#[cube]
fn half_to_f32(h: u32) -> f32 {
    let sign = (h >> 15) & 1;
    let exp = (h >> 10) & 0x1f;
    let mant = h & 0x3ff;
    // Zero or subnormal: mant * 2^-24.
    let mut out = mant as f32 * 5.960_464_5e-8f32;
    if exp == 31 {
        out = f32::reinterpret(0x7f80_0000u32 | (mant << 13));
    } else if exp != 0 {
        out = f32::reinterpret(((exp + 112) << 23) | (mant << 13));
    }
    if sign == 1 {
        out = -out;
    }
    out
}

#[cube(launch, create_dummy_kernel)]
fn argmax_kernel(x: &[f32], out: &mut [u32], #[comptime] n: usize, #[comptime] units: usize) {
    let base = CUBE_POS_X as usize * n;
    let unit = UNIT_POS_X as usize;
    // Each unit's best (first on ties), then a tree keeping the lower index
    // on ties, so the result is the first maximum, as on the CPU.
    let mut best = 0.0f32;
    let mut at = 0usize;
    let mut found = false;
    for k in 0..n.div_ceil(units) {
        let i = unit + k * units;
        if i < n {
            let v = x[base + i];
            if v > best || !found {
                found = true;
                best = v;
                at = i;
            }
        }
    }
    let mut sv = Shared::<[f32]>::new_slice(units);
    let mut si = Shared::<[u32]>::new_slice(units);
    // A unit past the row's end holds no index (u32::MAX), which loses to
    // every index (WGSL has no infinity literal to use as a value).
    sv[unit] = best;
    si[unit] = 0xffff_ffffu32;
    if found {
        si[unit] = at as u32;
    }
    sync_cube();
    #[unroll]
    for level in 0..units.trailing_zeros() {
        let stride = units >> (level + 1);
        if unit < stride {
            let (v, i) = (sv[unit + stride], si[unit + stride]);
            let mine = si[unit];
            let wins = i != 0xffff_ffffu32
                && (mine == 0xffff_ffffu32 || v > sv[unit] || (v == sv[unit] && i < mine));
            if wins {
                sv[unit] = v;
                si[unit] = i;
            }
        }
        sync_cube();
    }
    if unit == 0 {
        out[CUBE_POS_X as usize] = si[0];
    }
}

/// Greedy sampling: the index of each row's first maximum (rows of `n`).
pub fn argmax(dev: &GpuDevice, x: &Buffer, n: usize, out: &Buffer<u32>) -> Result<(), GpuError> {
    if n == 0 || x.len() % n != 0 || out.len() != x.len() / n {
        return Err(shape(
            "argmax",
            format!("x {} must be {} rows of {n}", x.len(), out.len()),
        ));
    }
    if out.is_empty() {
        return Ok(());
    }
    let (count, dim) = rows_grid(out.len());
    argmax_kernel::launch(dev.client(), count, dim, arg(x), arg(out), n, ROW_UNITS);
    Ok(())
}

/// Most candidates [`top_k`] returns per row.
pub const TOP_K_MAX: usize = 64;

/// Marks an empty slot in [`top_k_kernel`]'s lists and output.
const NO_TOKEN: u32 = 0xffff_ffff;

#[cube(launch, create_dummy_kernel)]
fn top_k_kernel(
    x: &[f32],
    ids: &mut [u32],
    vals: &mut [f32],
    log_z: &mut [f32],
    #[comptime] n: usize,
    #[comptime] k: usize,
    #[comptime] units: usize,
) {
    let row = CUBE_POS_X as usize;
    let base = row * n;
    let unit = UNIT_POS_X as usize;
    // This unit's k largest of its strided share, largest first. Its
    // share is read in index order and a value moves up only past smaller
    // ones, so equal values keep the lower index first, as on the CPU.
    let mut best_v = Array::<f32>::new(k);
    let mut best_i = Array::<u32>::new(k);
    let mut filled = 0usize;
    for s in 0..n.div_ceil(units) {
        let i = unit + s * units;
        if i < n {
            let v = x[base + i];
            let mut keep = filled < k;
            if !keep {
                keep = v > best_v[k - 1];
            }
            if keep {
                let mut j = filled;
                if filled == k {
                    j = k - 1;
                } else {
                    filled += 1;
                }
                loop {
                    if j == 0 {
                        break;
                    }
                    if v > best_v[j - 1] {
                        best_v[j] = best_v[j - 1];
                        best_i[j] = best_i[j - 1];
                        j -= 1;
                    } else {
                        break;
                    }
                }
                best_v[j] = v;
                best_i[j] = i as u32;
            }
        }
    }
    // k rounds: the largest head among the units' lists (the lower index
    // on equal values) is the row's next value; its unit moves past it.
    let mut sv = Shared::<[f32]>::new_slice(units);
    let mut si = Shared::<[u32]>::new_slice(units);
    let mut head = 0usize;
    let mut row_max = 0.0f32;
    for out in 0..k {
        sv[unit] = 0.0f32;
        si[unit] = NO_TOKEN;
        if head < filled {
            sv[unit] = best_v[head];
            si[unit] = best_i[head];
        }
        sync_cube();
        #[unroll]
        for level in 0..units.trailing_zeros() {
            let stride = units >> (level + 1);
            if unit < stride {
                let (v, i) = (sv[unit + stride], si[unit + stride]);
                let mine = si[unit];
                let wins = i != NO_TOKEN
                    && (mine == NO_TOKEN || v > sv[unit] || (v == sv[unit] && i < mine));
                if wins {
                    sv[unit] = v;
                    si[unit] = i;
                }
            }
            sync_cube();
        }
        let (v, i) = (sv[0], si[0]);
        if out == 0 {
            row_max = v;
        }
        if unit == 0 {
            vals[row * k + out] = v;
            ids[row * k + out] = i;
        }
        if head < filled && best_i[head] == i {
            head += 1;
        }
        // Every unit has read the winner before the next round writes.
        sync_cube();
    }
    // log-sum-exp over the row, around its largest value.
    let mut sum = 0.0f32;
    for s in 0..n.div_ceil(units) {
        let i = unit + s * units;
        if i < n {
            sum += f32::exp(x[base + i] - row_max);
        }
    }
    let mut sh = Shared::<[f32]>::new_slice(units);
    let total = cube_reduce(&mut sh, sum, unit, units, false);
    if unit == 0 {
        log_z[row] = row_max + f32::ln(total);
    }
}

/// Each row's `k` largest values (largest first; on equal values the
/// lower index first) and their indices, and the row's log-sum-exp, for
/// rows of `n`: what a sampler needs of a row (see `Sampler::candidates`
/// in tandem-engine), `k` values instead of `n`. A row with fewer than
/// `k` values ends its indices with `u32::MAX`.
pub fn top_k(
    dev: &GpuDevice,
    x: &Buffer,
    n: usize,
    k: usize,
    ids: &Buffer<u32>,
    vals: &Buffer,
    log_z: &Buffer,
) -> Result<(), GpuError> {
    let rows = x.len().checked_div(n).unwrap_or(0);
    if n == 0 || x.len() % n != 0 || u32::try_from(n).is_err() {
        return Err(shape("top_k", format!("x {} is not rows of {n}", x.len())));
    }
    if !(1..=TOP_K_MAX).contains(&k)
        || ids.len() != rows * k
        || vals.len() != rows * k
        || log_z.len() != rows
    {
        return Err(shape(
            "top_k",
            format!(
                "k {k} (1..={TOP_K_MAX}) over {rows} rows: ids {}, values {} and log_z {}",
                ids.len(),
                vals.len(),
                log_z.len()
            ),
        ));
    }
    if rows == 0 {
        return Ok(());
    }
    let (count, dim) = rows_grid(rows);
    top_k_kernel::launch(
        dev.client(),
        count,
        dim,
        arg(x),
        arg(ids),
        arg(vals),
        arg(log_z),
        n,
        k,
        ROW_UNITS,
    );
    Ok(())
}

/// `x` rounded to the nearest f16-precision value (ties to even) for
/// values in f16's normal range, as the CPU rounds attention's queries and
/// probabilities. Below it (|x| < 2^-14) the f32 precision is kept: those
/// probabilities weigh under 2^-14 of a value row.
#[cube]
fn round_f16_precision(x: f32) -> f32 {
    let bits = u32::reinterpret(x);
    let bias = ((bits >> 13) & 1) + 0xfff;
    f32::reinterpret((bits + bias) & 0xffff_e000u32)
}

/// Where a head's K and V rows live in a KV pool of f16 pairs (32-bit
/// words), the CPU pool's layout: block-major, then layer, then K|V, then
/// head, then `block_size` rows of `head_dim`.
#[derive(Clone, Copy, Debug)]
pub struct KvLayout {
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
}

impl KvLayout {
    /// 32-bit words in one block.
    pub fn block_words(&self) -> usize {
        self.n_layers * 2 * self.n_kv_heads * self.block_size * self.head_dim / 2
    }
}

#[cube(launch, create_dummy_kernel)]
#[allow(clippy::too_many_arguments)]
fn attention_kernel(
    q: &[f32],
    pool: &[u32],
    tables: &[u32],
    meta: &[u32],
    scores: &mut [f32],
    out: &mut [f32],
    scale: f32,
    layer: u32,
    block_words: u32,
    max_ctx: u32,
    first: u32,
    window: u32,
    #[comptime] q_stride: usize,
    #[comptime] hd: usize,
    #[comptime] n_heads: usize,
    #[comptime] n_kv: usize,
    #[comptime] bs: usize,
    #[comptime] units: usize,
) {
    // One cube per (token, query head) of the tokens from `first` on; its
    // units stride over positions for the scores, then over the head's
    // values for the output. `scores` holds rows for this launch only.
    let qi = first as usize * n_heads + CUBE_POS_X as usize;
    let unit = UNIT_POS_X as usize;
    let t = qi / n_heads;
    let g = (qi % n_heads) / (n_heads / n_kv);
    let n = meta[t * 2] as usize;
    let table = meta[t * 2 + 1] as usize;
    // A sliding window's first position (`window` is u32::MAX for none).
    let lo = n - usize::min(n, window as usize);
    let half = hd / 2;
    let head_words = bs * half;
    let k_off = layer as usize * 2 * n_kv * head_words + g * head_words;
    let v_off = k_off + n_kv * head_words;
    let srow = CUBE_POS_X as usize * max_ctx as usize;
    let qrow = t * q_stride + (qi % n_heads) * hd;
    let steps = (n - lo).div_ceil(units);
    let mut sh = Shared::<[f32]>::new_slice(units);

    let mut local_max = (-3.402_823_5e38f32).runtime();
    for k in 0..steps {
        let p = lo + unit + k * units;
        if p < n {
            let base =
                tables[table + p / bs] as usize * block_words as usize + k_off + (p % bs) * half;
            let mut dot = 0.0f32;
            for i in 0..half {
                let w = pool[base + i];
                let q0 = round_f16_precision(q[qrow + 2 * i]);
                let q1 = round_f16_precision(q[qrow + 2 * i + 1]);
                dot += q0 * half_to_f32(w & 0xffff) + q1 * half_to_f32(w >> 16);
            }
            let s = dot * scale;
            scores[srow + p] = s;
            local_max = f32::max(local_max, s);
        }
    }
    let max = cube_reduce(&mut sh, local_max, unit, units, true);

    let mut local_sum = 0.0f32;
    for k in 0..steps {
        let p = lo + unit + k * units;
        if p < n {
            let e = f32::exp(scores[srow + p] - max);
            scores[srow + p] = e;
            local_sum += e;
        }
    }
    let inv = 1.0f32 / cube_reduce(&mut sh, local_sum, unit, units, false);
    // The exponentials other units wrote must be visible before any unit
    // reads a whole row of them.
    sync_storage();
    sync_cube();

    for j in 0..hd.div_ceil(units) {
        let d = unit + j * units;
        if d < hd {
            let shift = ((d % 2) * 16) as u32;
            let mut acc = 0.0f32;
            for p in lo..n {
                let base = tables[table + p / bs] as usize * block_words as usize
                    + v_off
                    + (p % bs) * half;
                let v = half_to_f32((pool[base + d / 2] >> shift) & 0xffff);
                acc += round_f16_precision(scores[srow + p] * inv) * v;
            }
            out[qi * hd + d] = acc;
        }
    }
}

/// Causal attention of tokens' query heads over their sequences' paged
/// KV, in the CPU pool's block layout: `q` holds a row of `q_stride`
/// values per token starting with its `n_heads` heads (a fused QKV row,
/// or just the heads), `out` the heads' results; token `t` sees positions
/// `0..meta[2t]` of the sequence whose block table starts at
/// `tables[meta[2t + 1]]`, or with a sliding `window` only the last
/// `window` of them. One launch runs the queries of `tokens` (a range of
/// the tokens in `meta`), with `scores` as scratch of `n_heads * max_ctx`
/// values per token launched. Block ids and lengths are read on the device: the
/// caller keeps them in range (the scheduler's block tables are checked
/// where they are built; out-of-range reads on Vulkan are clamped, never
/// outside the buffer).
#[allow(clippy::too_many_arguments)]
pub fn attention(
    dev: &GpuDevice,
    q: &Buffer,
    q_stride: usize,
    pool: &Buffer<u32>,
    layout: &KvLayout,
    layer: usize,
    n_heads: usize,
    tables: &Buffer<u32>,
    meta: &Buffer<u32>,
    tokens: std::ops::Range<usize>,
    max_ctx: usize,
    scale: f32,
    window: Option<usize>,
    scores: &Buffer,
    out: &Buffer,
) -> Result<(), GpuError> {
    let KvLayout {
        n_layers,
        n_kv_heads,
        head_dim,
        block_size,
    } = *layout;
    let bad = |what: String| Err(shape("attention", what));
    if head_dim == 0 || !head_dim.is_multiple_of(2) || n_kv_heads == 0 || block_size == 0 {
        return bad(format!("{layout:?} is not a KV layout"));
    }
    if !n_heads.is_multiple_of(n_kv_heads) || layer >= n_layers {
        return bad(format!(
            "{n_heads} heads over {n_kv_heads} KV heads, layer {layer} of {n_layers}"
        ));
    }
    let words = layout.block_words();
    if !pool.len().is_multiple_of(words) {
        return bad(format!(
            "pool {} is not whole blocks of {words} words",
            pool.len()
        ));
    }
    let n_tok = meta.len() / 2;
    let n_q = n_tok * n_heads;
    if !meta.len().is_multiple_of(2)
        || q_stride < n_heads * head_dim
        || q.len() != n_tok * q_stride
        || out.len() != n_q * head_dim
    {
        return bad(format!(
            "q {} must be {n_tok} rows of {q_stride} starting with {n_heads} x {head_dim}, \
             out {} {n_tok} tokens of {n_heads} x {head_dim}",
            q.len(),
            out.len()
        ));
    }
    if tokens.start > tokens.end || tokens.end > n_tok {
        return bad(format!("tokens {tokens:?} of {n_tok}"));
    }
    let launched = tokens.len() * n_heads;
    if scores.len() < launched * max_ctx || launched > MAX_CUBES_X {
        return bad(format!(
            "{launched} queries: scores {} under {launched} x {max_ctx}, or past one grid axis",
            scores.len()
        ));
    }
    // A window of 0 positions would attend to nothing.
    if window == Some(0) {
        return bad("a sliding window of 0 positions".into());
    }
    // No window: every position (u32::MAX, more than any context holds).
    let window = window.map_or(Ok(u32::MAX), u32::try_from);
    let (Ok(layer), Ok(words), Ok(max_ctx32), Ok(first), Ok(window)) = (
        u32::try_from(layer),
        u32::try_from(words),
        u32::try_from(max_ctx),
        u32::try_from(tokens.start),
        window,
    ) else {
        return bad("sizes beyond 32 bits".into());
    };
    if launched == 0 {
        return Ok(());
    }
    let (count, dim) = rows_grid(launched);
    attention_kernel::launch(
        dev.client(),
        count,
        dim,
        arg(q),
        arg(pool),
        arg(tables),
        arg(meta),
        arg(scores),
        arg(out),
        scale,
        layer,
        words,
        max_ctx32,
        first,
        window,
        q_stride,
        head_dim,
        n_heads,
        n_kv_heads,
        block_size,
        ROW_UNITS,
    );
    Ok(())
}

#[cube(launch, create_dummy_kernel)]
fn add_kernel(acc: &mut [f32], x: &[f32]) {
    let i = ABSOLUTE_POS;
    if i < acc.len() {
        acc[i] += x[i];
    }
}

#[cube(launch, create_dummy_kernel)]
fn add_bias_kernel(x: &mut [f32], bias: &[f32]) {
    let i = ABSOLUTE_POS;
    if i < x.len() {
        x[i] += bias[i % bias.len()];
    }
}

#[cube(launch, create_dummy_kernel)]
fn softcap_kernel(x: &mut [f32], cap: f32) {
    let i = ABSOLUTE_POS;
    if i < x.len() {
        x[i] = cap * f32::tanh(x[i] / cap);
    }
}

#[cube(launch, create_dummy_kernel)]
fn fill_kernel(x: &mut [f32], v: f32) {
    let i = ABSOLUTE_POS;
    if i < x.len() {
        x[i] = v;
    }
}

/// Sets every value of `x` to `v`.
pub fn fill(dev: &GpuDevice, x: &Buffer, v: f32) -> Result<(), GpuError> {
    if !x.is_empty() {
        let (count, dim) = line(x.len());
        fill_kernel::launch(dev.client(), count, dim, arg(x), v);
    }
    Ok(())
}

#[cube(launch, create_dummy_kernel)]
fn copy_kernel(src: &[f32], dst: &mut [f32]) {
    let i = ABSOLUTE_POS;
    if i < dst.len() {
        dst[i] = src[i];
    }
}

/// `dst[i] = src[i]`.
pub fn copy(dev: &GpuDevice, src: &Buffer, dst: &Buffer) -> Result<(), GpuError> {
    if let Some((count, dim)) = elementwise("copy", dst, src)? {
        copy_kernel::launch(dev.client(), count, dim, arg(src), arg(dst));
    }
    Ok(())
}

#[cube(launch, create_dummy_kernel)]
fn gather_rows_kernel(src: &[f32], rows: &[u32], dst: &mut [f32], #[comptime] width: usize) {
    let i = ABSOLUTE_POS;
    if i < dst.len() {
        // A row index past `src` reads nothing: the host cannot check
        // indices that live on the device.
        let at = rows[i / width] as usize * width + i % width;
        if at < src.len() {
            dst[i] = src[at];
        } else {
            dst[i] = 0.0f32;
        }
    }
}

/// `dst[i] = src[rows[i]]` for rows of `width` values: token embeddings
/// by token id, the hidden states of the tokens whose logits are wanted.
pub fn gather_rows(
    dev: &GpuDevice,
    src: &Buffer,
    rows: &Buffer<u32>,
    width: usize,
    dst: &Buffer,
) -> Result<(), GpuError> {
    if width == 0 || !src.len().is_multiple_of(width) || dst.len() != rows.len() * width {
        return Err(shape(
            "gather_rows",
            format!(
                "src {} and dst {} are not rows of {width} ({} rows wanted)",
                src.len(),
                dst.len(),
                rows.len()
            ),
        ));
    }
    if dst.is_empty() {
        return Ok(());
    }
    let (count, dim) = line(dst.len());
    gather_rows_kernel::launch(
        dev.client(),
        count,
        dim,
        arg(src),
        arg(rows),
        arg(dst),
        width,
    );
    Ok(())
}

/// `acc[i] += x[i]` (the residual connections).
pub fn add(dev: &GpuDevice, acc: &Buffer, x: &Buffer) -> Result<(), GpuError> {
    if let Some((count, dim)) = elementwise("add", acc, x)? {
        add_kernel::launch(dev.client(), count, dim, arg(acc), arg(x));
    }
    Ok(())
}

/// `x[t] += bias` for each row `t` of `x` (rows of `bias.len()`).
pub fn add_bias(dev: &GpuDevice, x: &Buffer, bias: &Buffer) -> Result<(), GpuError> {
    if bias.is_empty() || !x.len().is_multiple_of(bias.len()) {
        return Err(shape(
            "add_bias",
            format!("x {} is not rows of {}", x.len(), bias.len()),
        ));
    }
    if !x.is_empty() {
        let (count, dim) = line(x.len());
        add_bias_kernel::launch(dev.client(), count, dim, arg(x), arg(bias));
    }
    Ok(())
}

/// Soft-caps logits in place: `x = cap * tanh(x / cap)`, as the CPU
/// engine's `ops::softcap` (Gemma's final logit soft-capping).
pub fn softcap(dev: &GpuDevice, x: &Buffer, cap: f32) -> Result<(), GpuError> {
    if !(cap.is_finite() && cap > 0.0) {
        return Err(shape("softcap", format!("a cap of {cap}")));
    }
    if !x.is_empty() {
        let (count, dim) = line(x.len());
        softcap_kernel::launch(dev.client(), count, dim, arg(x), cap);
    }
    Ok(())
}

/// The IEEE half bits (low 16) of `x`, rounded to nearest even, with
/// overflow to infinity and half subnormals: as `half::f16::from_f32`.
#[cube]
fn f32_to_half_bits(x: f32) -> u32 {
    let b = u32::reinterpret(x);
    let sign = (b >> 16) & 0x8000;
    let a = b & 0x7fff_ffff;
    let mut h = 0u32;
    if a > 0x7f80_0000 {
        h = 0x7e00;
    } else if a >= 0x4780_0000 {
        // |x| >= 65536 (and infinity): infinity.
        h = 0x7c00;
    } else if a >= 0x3880_0000 {
        // Half normal range (|x| >= 2^-14); rounding may carry into the
        // exponent, up to infinity at 65520.
        let base = (a - 0x3800_0000) >> 13;
        let rem = a & 0x1fff;
        h = base;
        if rem > 0x1000 || (rem == 0x1000 && (base & 1) == 1) {
            h = base + 1;
        }
    } else if a >= 0x3300_0000 {
        // Half subnormals: the 24-bit significand shifted to units of 2^-24.
        let exp = a >> 23;
        let m = (a & 0x7f_ffff) | 0x80_0000;
        let shift = 126 - exp;
        let base = m >> shift;
        let rem = m & ((1u32 << shift) - 1);
        let halfway = 1u32 << (shift - 1);
        h = base;
        if rem > halfway || (rem == halfway && (base & 1) == 1) {
            h = base + 1;
        }
    }
    sign | h
}

#[cube(launch, create_dummy_kernel)]
#[allow(clippy::too_many_arguments)]
fn kv_write_kernel(
    rows: &[f32],
    pool: &mut [u32],
    slots: &[u32],
    layer: u32,
    block_words: u32,
    #[comptime] stride: usize,
    #[comptime] k_at: usize,
    #[comptime] v_at: usize,
    #[comptime] hd: usize,
    #[comptime] n_kv: usize,
    #[comptime] bs: usize,
) {
    // One unit per (token, KV head, value pair), K and V both.
    let half = hd / 2;
    let id = ABSOLUTE_POS;
    let per_token = n_kv * half;
    let t = id / per_token;
    if t < slots.len() / 2 {
        let g = (id % per_token) / half;
        let i = id % half;
        let head_words = bs * half;
        let at = slots[t * 2] as usize * block_words as usize
            + layer as usize * 2 * n_kv * head_words
            + g * head_words
            + slots[t * 2 + 1] as usize * half
            + i;
        let k = t * stride + k_at + g * hd + 2 * i;
        let v = t * stride + v_at + g * hd + 2 * i;
        pool[at] = f32_to_half_bits(rows[k]) | (f32_to_half_bits(rows[k + 1]) << 16);
        pool[at + n_kv * head_words] =
            f32_to_half_bits(rows[v]) | (f32_to_half_bits(rows[v + 1]) << 16);
    }
}

/// Where a token's K and V sit in rows of `stride` values: K from `k_at`
/// on, V from `v_at` on, `n_kv_heads * head_dim` values each (the tail of
/// a fused QKV row, or rows of K then V).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvRows {
    pub stride: usize,
    pub k_at: usize,
    pub v_at: usize,
}

/// Stores tokens' K and V (f32, where `at` says in `rows`) into the pool
/// as f16, token `t` at row `slots[2t + 1]` of block `slots[2t]` of
/// `layer` (the CPU cache's `write`).
#[allow(clippy::too_many_arguments)]
pub fn kv_write(
    dev: &GpuDevice,
    rows: &Buffer,
    at: KvRows,
    pool: &Buffer<u32>,
    layout: &KvLayout,
    layer: usize,
    slots: &Buffer<u32>,
) -> Result<(), GpuError> {
    let kv_dim = layout.n_kv_heads * layout.head_dim;
    let n_tok = slots.len() / 2;
    if !layout.head_dim.is_multiple_of(2)
        || layer >= layout.n_layers
        || rows.len() != n_tok * at.stride
        || at.k_at.max(at.v_at) + kv_dim > at.stride
        || !pool.len().is_multiple_of(layout.block_words().max(1))
    {
        return Err(shape(
            "kv_write",
            format!(
                "rows {} must be {n_tok} tokens of {at:?} holding K and V of {kv_dim} for \
                 {layout:?} layer {layer}",
                rows.len()
            ),
        ));
    }
    let (Ok(layer), Ok(words)) = (u32::try_from(layer), u32::try_from(layout.block_words())) else {
        return Err(shape("kv_write", "sizes beyond 32 bits".into()));
    };
    let units = n_tok * kv_dim / 2;
    if units == 0 {
        return Ok(());
    }
    let (count, dim) = line(units);
    kv_write_kernel::launch(
        dev.client(),
        count,
        dim,
        arg(rows),
        arg(pool),
        arg(slots),
        layer,
        words,
        at.stride,
        at.k_at,
        at.v_at,
        layout.head_dim,
        layout.n_kv_heads,
        layout.block_size,
    );
    Ok(())
}

#[cfg(test)]
mod cuda_form;
