//! Attention of query heads over a paged f16 KV context.
//!
//! [`attend_tile`] serves several queries sharing one KV head at once (the
//! heads of a GQA group, for one token or a run of a prompt's tokens, each
//! with its own causal length): every K and V row is read and converted
//! from f16 once for all of them, and each query's result is bitwise what
//! [`attend`] computes for it alone.
//!
//! The caller hands the head's K and V slices of each block of the sequence,
//! in order (each `block_size x head_dim` f16 values), so the kernel knows
//! nothing of how blocks are stored. Numerics (shared by every ISA, bitwise):
//! - the query is rounded to f16 (ggml rounds it to the K cache's type);
//! - each score is a dot product with eight partial sums (lane `i % 8`),
//!   multiply then add, the lanes summed in order, then scaled;
//! - softmax subtracts the max, uses `expf`, sums in f64;
//! - probabilities are rounded to f16 (ggml multiplies V by f16
//!   probabilities) and accumulated over positions in order, multiply then add.

use half::f16;

use crate::cpu::{self, Isa};

/// Computes `out = softmax(scale * q . K^T) V` for one head over the first
/// `n_ctx` positions of the context. `scores` is scratch space.
///
/// # Panics
/// If the blocks do not cover `n_ctx` positions (each block holding
/// `block_size` rows of `head_dim` values, the last one at least the rows
/// used; callers build these from validated block tables), or if `head_dim`
/// is 0 or above 512.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    q: &[f32],
    k_blocks: &[&[f16]],
    v_blocks: &[&[f16]],
    block_size: usize,
    n_ctx: usize,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    attend_with_isa(
        cpu::isa(),
        q,
        k_blocks,
        v_blocks,
        block_size,
        n_ctx,
        scale,
        scores,
        out,
    );
}

/// Where [`prefetch_context`] asks the rows to be brought. V rows always go
/// to the second-level cache: they are read after all of K.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prefetch {
    /// K rows into the first-level cache: the current work item's.
    Now,
    /// K rows into the second-level cache too: rows read after the current
    /// work item, which must not push that item's rows out of the first.
    Next,
}

/// Asks the memory system for the first `n_ctx` positions' K and V rows of
/// a head (the blocks [`attend`] is about to read) all at once. A pure
/// hint, no effect on results: worth it where the context is cold, as for
/// a decode step's KV groups, whose scattered blocks would otherwise arrive
/// one miss at a time.
pub fn prefetch_context(
    k_blocks: &[&[f16]],
    v_blocks: &[&[f16]],
    block_size: usize,
    head_dim: usize,
    n_ctx: usize,
    to: Prefetch,
) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _MM_HINT_T1, _mm_prefetch};
        let used = n_ctx.div_ceil(block_size.max(1));
        let k = k_blocks.iter().take(used).map(|b| (b, to == Prefetch::Now));
        // Nearer than the second level, V would push K out of the first.
        let v = v_blocks.iter().take(used).map(|b| (b, false));
        for (b, first_level) in k.chain(v) {
            let bytes = std::mem::size_of_val(&b[..(block_size * head_dim).min(b.len())]);
            let p = b.as_ptr().cast::<i8>();
            for off in (0..bytes).step_by(64) {
                // SAFETY: `off` lies inside the slice; a prefetch never faults
                // and has no architectural effect.
                unsafe {
                    if first_level {
                        _mm_prefetch::<_MM_HINT_T0>(p.add(off));
                    } else {
                        _mm_prefetch::<_MM_HINT_T1>(p.add(off));
                    }
                };
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (k_blocks, v_blocks, block_size, head_dim, n_ctx, to);
}

/// [`attend`] with an explicit instruction set (tests compare them).
#[allow(clippy::too_many_arguments)]
pub fn attend_with_isa(
    isa: Isa,
    q: &[f32],
    k_blocks: &[&[f16]],
    v_blocks: &[&[f16]],
    block_size: usize,
    n_ctx: usize,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    attend_tile_with_isa(
        isa,
        q,
        &[],
        &[n_ctx],
        k_blocks,
        v_blocks,
        block_size,
        scale,
        scores,
        out,
    );
}

/// Attention of `n_ctx.len()` queries over one context: query `i` is
/// `qs[i * hd..(i + 1) * hd]` (with `hd = qs.len() / n_ctx.len()`), sees
/// positions `first[i]..n_ctx[i]` (`first` empty: all from 0; a sliding
/// window otherwise) and writes `out[i * hd..(i + 1) * hd]`. Bitwise
/// [`attend`] for each query without a window; each K and V row is
/// converted once for every query that sees it. Positions before
/// `first[i]` score `-inf`, so they weigh exactly 0 and a query's result
/// is the same in every tile it is part of. `scratch` is scratch space.
///
/// # Panics
/// As [`attend`], if `qs` and `out` are not `n_ctx.len()` equal rows, or
/// if `first` is neither empty nor one per query, or some
/// `first[i] >= n_ctx[i]` (a query always sees itself).
#[allow(clippy::too_many_arguments)]
pub fn attend_tile(
    qs: &[f32],
    first: &[usize],
    n_ctx: &[usize],
    k_blocks: &[&[f16]],
    v_blocks: &[&[f16]],
    block_size: usize,
    scale: f32,
    scratch: &mut Vec<f32>,
    out: &mut [f32],
) {
    attend_tile_with_isa(
        cpu::isa(),
        qs,
        first,
        n_ctx,
        k_blocks,
        v_blocks,
        block_size,
        scale,
        scratch,
        out,
    );
}

/// [`attend_tile`] with an explicit instruction set.
#[allow(clippy::too_many_arguments)]
pub fn attend_tile_with_isa(
    isa: Isa,
    qs: &[f32],
    first: &[usize],
    n_ctx: &[usize],
    k_blocks: &[&[f16]],
    v_blocks: &[&[f16]],
    block_size: usize,
    scale: f32,
    scratch: &mut Vec<f32>,
    out: &mut [f32],
) {
    let nq = n_ctx.len();
    assert!(
        first.is_empty() || (first.len() == nq && first.iter().zip(n_ctx).all(|(&f, &n)| f < n)),
        "each query's window must start before its own position"
    );
    let first_of = |i: usize| first.get(i).copied().unwrap_or(0);
    if nq == 0 {
        assert!(qs.is_empty() && out.is_empty(), "queries without lengths");
        return;
    }
    let hd = qs.len() / nq;
    assert!(
        qs.len() == nq * hd && out.len() == qs.len(),
        "queries and outputs must be {nq} rows of equal length"
    );
    assert!(hd > 0 && hd <= 512, "head_dim must be 1..=512");
    let max_ctx = n_ctx.iter().copied().max().unwrap_or(0);
    assert!(
        k_blocks.len().saturating_mul(block_size) >= max_ctx
            && v_blocks.len().saturating_mul(block_size) >= max_ctx,
        "blocks cover fewer than {max_ctx} positions"
    );
    // A short block would silently drop positions: check the rows each
    // block read must hold (once per call, per block).
    let used = if max_ctx == 0 {
        0
    } else {
        max_ctx.div_ceil(block_size)
    };
    assert!(
        (0..used).all(|i| {
            let need = block_size.min(max_ctx - i * block_size) * hd;
            k_blocks[i].len() >= need && v_blocks[i].len() >= need
        }),
        "a K or V block holds fewer than block_size * head_dim values"
    );
    let simd = isa >= Isa::Avx2 && Isa::Avx2.is_supported() && hd.is_multiple_of(8);
    // Converting rows once pays off only when enough queries share them: a
    // decode step's few heads of a group read the f16 rows directly.
    let tiled = simd && nq >= MIN_TILE_QUERIES && max_ctx >= MIN_TILE_CONTEXT;
    let ctx = TileCtx {
        n_ctx,
        k_blocks,
        v_blocks,
        block_size,
        scale,
        max_ctx,
    };
    match hd {
        64 if tiled => return tile::<64>(&ctx, qs, &first_of, scratch, out),
        128 if tiled => return tile::<128>(&ctx, qs, &first_of, scratch, out),
        256 if tiled => return tile::<256>(&ctx, qs, &first_of, scratch, out),
        _ => {}
    }
    // A decode step's GQA group: every query sees the same positions, so
    // each K and V row is converted once for up to three queries held
    // against it (AVX-512's 32 vector registers hold their accumulators).
    #[cfg(target_arch = "x86_64")]
    if simd
        && isa >= Isa::Avx512Vnni
        && Isa::Avx512Vnni.is_supported()
        && n_ctx.iter().all(|&n| n == max_ctx)
        && (0..nq).all(|i| first_of(i) == first_of(0))
    {
        let window = first_of(0)..max_ctx;
        match hd {
            64 => return group::<64>(&ctx, qs, window, scratch, out),
            128 => return group::<128>(&ctx, qs, window, scratch, out),
            256 => return group::<256>(&ctx, qs, window, scratch, out),
            _ => {}
        }
    }
    for (i, ((q, o), &n)) in qs
        .chunks_exact(hd)
        .zip(out.chunks_exact_mut(hd))
        .zip(n_ctx)
        .enumerate()
    {
        attend_one(
            simd,
            q,
            k_blocks,
            v_blocks,
            block_size,
            first_of(i)..n,
            scale,
            scratch,
            o,
        );
    }
}

/// The context a tile of queries attends over.
struct TileCtx<'a> {
    n_ctx: &'a [usize],
    k_blocks: &'a [&'a [f16]],
    v_blocks: &'a [&'a [f16]],
    block_size: usize,
    scale: f32,
    max_ctx: usize,
}

/// [`attend_tile`]'s tiled path for `D`-value heads: each K and V row is
/// converted from f16 once for every query, in batches of 8 rows, and the
/// queries go through in runs of [`TILE_RUN`] held against each batch in
/// registers. Each query's scores and output take the same operations in
/// the same order as [`attend_one`] (bitwise; tested). Requires AVX2 and
/// F16C (checked by the caller) and `qs` / `out` of `n_ctx.len()` rows of
/// `D` values.
fn tile<const D: usize>(
    c: &TileCtx<'_>,
    qs: &[f32],
    first_of: &dyn Fn(usize) -> usize,
    scratch: &mut Vec<f32>,
    out: &mut [f32],
) {
    let (nq, max_ctx) = (c.n_ctx.len(), c.max_ctx);
    // Scratch: the f16-rounded queries, then each query's score row. Every
    // score a query reads is written below first, so no zeroing is needed
    // beyond what `resize` does on growth.
    scratch.resize(nq * D + nq * max_ctx, 0.0);
    let (qh, scores) = scratch[..nq * D + nq * max_ctx].split_at_mut(nq * D);
    qh.copy_from_slice(qs);
    crate::ops::round_through_f16(qh);
    // The queries and outputs as D-value rows, so every kernel below gets
    // its lengths from its argument types.
    let (qh, _) = qh.as_chunks::<D>();
    // K batches transposed (lane r of `kt[d]` is row r's value d), so a
    // query's eight lane sums for eight rows need no shuffles.
    let mut kt = [[0.0f32; 8]; D];
    let mut p0 = 0;
    for batch in context_batches::<D>(c.k_blocks, c.block_size, max_ctx) {
        // SAFETY: AVX2/F16C support checked by the caller.
        unsafe { avx2::convert_rows_t(&batch.rows, &mut kt) };
        for (i, g) in tile_runs(nq) {
            let run = TileRun::new(c, i..i + g, p0, batch.len);
            let sc = &mut scores[i * max_ctx..(i + g) * max_ctx];
            match g {
                1 => run.scores::<D, 1>(&qh[i..i + 1], &kt, c.scale, sc),
                2 => run.scores::<D, 2>(&qh[i..i + 2], &kt, c.scale, sc),
                3 => run.scores::<D, 3>(&qh[i..i + 3], &kt, c.scale, sc),
                _ => run.scores::<D, 4>(&qh[i..i + 4], &kt, c.scale, sc),
            }
        }
        p0 += batch.len;
    }
    for (i, (sc, &n)) in scores.chunks_exact_mut(max_ctx).zip(c.n_ctx).enumerate() {
        sc[..first_of(i)].fill(f32::NEG_INFINITY);
        crate::ops::softmax(&mut sc[..n]);
        crate::ops::round_through_f16(&mut sc[..n]);
    }
    out.fill(0.0);
    let (out, _) = out.as_chunks_mut::<D>();
    let mut rows = [[0.0f32; D]; 8];
    let mut p0 = 0;
    for batch in context_batches::<D>(c.v_blocks, c.block_size, max_ctx) {
        // SAFETY: AVX2/F16C support checked by the caller.
        unsafe { avx2::convert_rows(&batch.rows[..batch.len], &mut rows) };
        for (i, g) in tile_runs(nq) {
            let run = TileRun::new(c, i..i + g, p0, batch.len);
            let sc = &scores[i * max_ctx..(i + g) * max_ctx];
            let o = &mut out[i..i + g];
            match g {
                1 => run.weighted::<D, 1>(sc, &rows, o),
                2 => run.weighted::<D, 2>(sc, &rows, o),
                3 => run.weighted::<D, 3>(sc, &rows, o),
                _ => run.weighted::<D, 4>(sc, &rows, o),
            }
        }
        p0 += batch.len;
    }
}

/// Queries [`tile`] holds against one batch of rows at once (their
/// accumulators fit AVX2's 16 vector registers).
const TILE_RUN: usize = 4;

/// A run of up to [`TILE_RUN`] consecutive queries of a [`tile`] against
/// the batch of `len` rows from position `p0`.
struct TileRun<'a> {
    n_ctx: &'a [usize],
    p0: usize,
    len: usize,
    max_ctx: usize,
}

/// `(first query, count)` of each run of [`TILE_RUN`] (the last shorter).
fn tile_runs(nq: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..nq)
        .step_by(TILE_RUN)
        .map(move |i| (i, (nq - i).min(TILE_RUN)))
}

impl<'a> TileRun<'a> {
    /// Queries `queries` of the tile against the batch of `len` rows from `p0`.
    fn new(c: &TileCtx<'a>, queries: std::ops::Range<usize>, p0: usize, len: usize) -> Self {
        TileRun {
            n_ctx: &c.n_ctx[queries],
            p0,
            len,
            max_ctx: c.max_ctx,
        }
    }

    /// Rows of the batch query `g` of the run sees.
    fn seen(&self, g: usize) -> usize {
        self.n_ctx[g].saturating_sub(self.p0).min(self.len)
    }

    /// Writes each query's scaled scores for the rows it sees into its row
    /// of `scores` (`G` rows of `max_ctx`). All eight lanes are computed
    /// (rows past `len` repeat the first); only seen ones are kept.
    fn scores<const D: usize, const G: usize>(
        &self,
        q: &[[f32; D]],
        kt: &[[f32; 8]; D],
        scale: f32,
        scores: &mut [f32],
    ) {
        if (0..G).all(|g| self.seen(g) == 0) {
            return;
        }
        let q: &[[f32; D]; G] = q.try_into().expect("G query rows");
        // SAFETY: AVX2/F16C support checked by `tile`'s caller.
        let d = unsafe { avx2::scores8::<D, G>(q, kt, scale) };
        let p0 = self.p0;
        for (g, (sc, d)) in scores.chunks_exact_mut(self.max_ctx).zip(&d).enumerate() {
            match self.seen(g) {
                // The common case, as a fixed-size copy.
                8 => sc[p0..p0 + 8].copy_from_slice(d),
                seen => sc[p0..p0 + seen].copy_from_slice(&d[..seen]),
            }
        }
    }

    /// Adds each query's weighted rows of the batch (the rows it sees) to
    /// its output row; `scores` holds the run's `G` probability rows.
    fn weighted<const D: usize, const G: usize>(
        &self,
        scores: &[f32],
        rows: &[[f32; D]; 8],
        out: &mut [[f32; D]],
    ) {
        let p0 = self.p0;
        if (0..G).all(|g| self.seen(g) == 8) {
            let out: &mut [[f32; D]; G] = out.try_into().expect("G output rows");
            let p: [&[f32; 8]; G] = std::array::from_fn(|g| {
                let sc = &scores[g * self.max_ctx..];
                sc[p0..p0 + 8].try_into().expect("8 probabilities")
            });
            // SAFETY: AVX2/F16C support checked by `tile`'s caller.
            unsafe { avx2::weighted8::<D, G>(out, &p, rows) };
            return;
        }
        // A batch some queries see only part of (the causal diagonal).
        for (g, (o, sc)) in out
            .iter_mut()
            .zip(scores.chunks_exact(self.max_ctx))
            .enumerate()
        {
            let seen = self.seen(g);
            if seen > 0 {
                // SAFETY: as above.
                unsafe { avx2::weighted_rows(o, &sc[p0..p0 + seen], rows) };
            }
        }
    }
}

/// [`attend_tile`]'s grouped path for `D`-value heads whose queries all
/// see `window` (a decode step's query heads of one KV head): the queries
/// go through in runs of up to three, and each K and V row is converted
/// from f16 once per run, straight from the blocks. Each query's scores
/// and output take the same operations in the same order as
/// [`attend_one`] (bitwise; tested). Requires AVX-512 F/VL, AVX2 and F16C
/// (checked by the caller) and `qs` / `out` of `c.n_ctx.len()` rows of `D`
/// values.
#[cfg(target_arch = "x86_64")]
fn group<const D: usize>(
    c: &TileCtx<'_>,
    qs: &[f32],
    window: std::ops::Range<usize>,
    scratch: &mut Vec<f32>,
    out: &mut [f32],
) {
    let (qs, _) = qs.as_chunks::<D>();
    let (out, _) = out.as_chunks_mut::<D>();
    let mut i = 0;
    while i < qs.len() {
        let g = (qs.len() - i).min(3);
        let (q, o) = (&qs[i..i + g], &mut out[i..i + g]);
        match g {
            1 => group_run::<D, 1>(c, q, window.clone(), scratch, o),
            2 => group_run::<D, 2>(c, q, window.clone(), scratch, o),
            _ => group_run::<D, 3>(c, q, window.clone(), scratch, o),
        }
        i += g;
    }
}

/// [`group`] for exactly `G` queries (`q` and `out` hold `G` rows).
#[cfg(target_arch = "x86_64")]
fn group_run<const D: usize, const G: usize>(
    c: &TileCtx<'_>,
    q: &[[f32; D]],
    window: std::ops::Range<usize>,
    scratch: &mut Vec<f32>,
    out: &mut [[f32; D]],
) {
    let n = window.end;
    let q: &[[f32; D]; G] = q.try_into().expect("G query rows");
    let out: &mut [[f32; D]; G] = out.try_into().expect("G output rows");
    let mut qh = [[0.0f32; D]; G];
    for (d, s) in qh.iter_mut().zip(q) {
        // SAFETY: AVX-512 F/VL, AVX2 and F16C checked by the caller.
        unsafe { avx512::round_f16::<D>(s, d) };
    }
    scratch.clear();
    scratch.resize(G * n, 0.0);
    let mut scores: [&mut [f32]; G] = {
        let mut rest = &mut scratch[..];
        std::array::from_fn(|_| {
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(n);
            rest = tail;
            head
        })
    };
    // The used rows of each block, as `D`-value rows.
    fn used<'b, const D: usize>(
        blocks: &[&'b [f16]],
        bs: usize,
        n: usize,
        b: usize,
    ) -> &'b [[f16; D]] {
        let rows = bs.min(n - b * bs);
        &blocks[b].as_chunks::<D>().0[..rows]
    }
    let nb = n.div_ceil(c.block_size);
    let mut p0 = 0;
    for b in 0..nb {
        let rows = used::<D>(c.k_blocks, c.block_size, n, b);
        let (full, rest) = rows.as_chunks::<8>();
        for batch in full {
            // SAFETY: AVX-512 F/VL, AVX2 and F16C checked by the caller.
            let d = unsafe { avx512::dot8_group::<D, G>(&qh, batch) };
            for (sc, d) in scores.iter_mut().zip(&d) {
                for (s, &v) in sc[p0..p0 + 8].iter_mut().zip(d) {
                    *s = v * c.scale;
                }
            }
            p0 += 8;
        }
        for row in rest {
            // SAFETY: as above.
            let d = unsafe { avx512::dot_group::<D, G>(&qh, row) };
            for (sc, &v) in scores.iter_mut().zip(&d) {
                sc[p0] = v * c.scale;
            }
            p0 += 1;
        }
    }
    for sc in scores.iter_mut() {
        sc[..window.start].fill(f32::NEG_INFINITY);
        crate::ops::softmax(sc);
        crate::ops::round_through_f16(sc);
    }
    let scores: [&[f32]; G] = scores.map(|s| &*s);
    for seg in 0..D / 64 {
        // SAFETY: AVX-512 F/VL, AVX2 and F16C checked by the caller.
        let mut acc = unsafe { avx512::GroupAcc::<G>::zero() };
        let mut p0 = 0;
        for b in 0..nb {
            let rows = used::<D>(c.v_blocks, c.block_size, n, b);
            // SAFETY: as above.
            unsafe { avx512::weighted_group::<D, G>(&mut acc, seg, &scores, p0, rows) };
            p0 += rows.len();
        }
        for (o, a) in out.iter_mut().zip(&acc.0) {
            let dst: &mut [f32; 64] = (&mut o[seg * 64..seg * 64 + 64])
                .try_into()
                .expect("64 values");
            // SAFETY: as above.
            unsafe { avx512::store64(dst, a) };
        }
    }
}

/// Fewest queries, and shortest longest context, for which [`attend_tile`]
/// converts each row once (measured: below these, per-query is faster).
const MIN_TILE_QUERIES: usize = 8;
const MIN_TILE_CONTEXT: usize = 128;

/// One query, any head size: the scalar reference, or AVX2 (eight rows at
/// a time for 64-value heads; the same operations). `simd` requires AVX2
/// and F16C support (checked by the caller) and `q.len()` a multiple of 8.
///
/// # Panics
/// If `out.len() != q.len()` on the 64-value path.
#[allow(clippy::too_many_arguments)]
fn attend_one(
    simd: bool,
    q: &[f32],
    k_blocks: &[&[f16]],
    v_blocks: &[&[f16]],
    block_size: usize,
    window: std::ops::Range<usize>,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let n_ctx = window.end;
    let hd = q.len();
    let mut qbuf = [0.0f32; 512];
    for (d, &s) in qbuf.iter_mut().zip(q) {
        *d = f16::from_f32(s).to_f32();
    }
    let qh = &qbuf[..hd];
    scores.clear();
    if simd && hd == 64 {
        let q64: &[f32; 64] = qh.try_into().expect("64 query values");
        for batch in context_batches::<64>(k_blocks, block_size, n_ctx) {
            if batch.len == 8 {
                // SAFETY: the caller checked AVX2/F16C support.
                let d = unsafe { avx2::dot8_f32_f16_64(q64, &batch.rows) };
                scores.extend(d.iter().map(|&v| v * scale));
            } else {
                for &k in &batch.rows[..batch.len] {
                    // SAFETY: as above.
                    scores.push(unsafe { avx2::dot_f32_f16(qh, k) } * scale);
                }
            }
        }
    } else {
        for k in context_rows(k_blocks, hd, block_size, n_ctx) {
            let dot = if simd {
                // SAFETY: the caller checked AVX2/F16C support.
                unsafe { avx2::dot_f32_f16(qh, k) }
            } else {
                crate::ops::dot_f32_f16(qh, k)
            };
            scores.push(dot * scale);
        }
    }
    scores[..window.start].fill(f32::NEG_INFINITY);
    crate::ops::softmax(scores);
    crate::ops::round_through_f16(scores);
    if simd && hd == 64 {
        let out: &mut [f32; 64] = out.try_into().expect("output row of head_dim values");
        let v_rows = context_rows_n::<64>(v_blocks, block_size, n_ctx);
        // SAFETY: the caller checked AVX2/F16C support.
        unsafe { avx2::weighted_f16_rows_64(out, scores, v_rows) };
        return;
    }
    out.fill(0.0);
    for (&p, v) in scores
        .iter()
        .zip(context_rows(v_blocks, hd, block_size, n_ctx))
    {
        if simd {
            // SAFETY: as above.
            unsafe { avx2::axpy_f16(out, p, v) }
        } else {
            crate::ops::axpy_f16(out, p, v);
        }
    }
}

/// One K or V row of a 64-value head.
type Row64 = [f16; 64];

/// Up to 8 consecutive context rows of a `D`-value head (slots past `len`
/// repeat the first row and are never read).
struct Batch<'a, const D: usize> {
    rows: [&'a [f16; D]; 8],
    len: usize,
}

/// The first `n_ctx` rows of a paged context of `D`-value heads in runs of
/// 8 (a short run only at the end).
///
/// # Panics
/// If the blocks hold fewer than `n_ctx` rows (`block_size` from each but
/// the last); callers check the blocks first.
fn context_batches<'a, const D: usize>(
    blocks: &'a [&'a [f16]],
    block_size: usize,
    n_ctx: usize,
) -> impl Iterator<Item = Batch<'a, D>> + 'a {
    // Walks (block, row in block) forward: no division per row.
    let (mut p, mut b, mut off) = (0, 0, 0);
    std::iter::from_fn(move || {
        if p >= n_ctx {
            return None;
        }
        let len = (n_ctx - p).min(8);
        let mut next = || {
            let row = &blocks[b].as_chunks::<D>().0[off];
            off += 1;
            if off == block_size {
                (b, off) = (b + 1, 0);
            }
            row
        };
        let first = next();
        let mut rows = [first; 8];
        for r in &mut rows[1..len] {
            *r = next();
        }
        p += len;
        Some(Batch { rows, len })
    })
}

/// The first `n_ctx` rows (`head_dim` values each) of a paged context, in order.
fn context_rows<'a>(
    blocks: &'a [&'a [f16]],
    hd: usize,
    block_size: usize,
    n_ctx: usize,
) -> impl Iterator<Item = &'a [f16]> + 'a {
    blocks
        .iter()
        .flat_map(move |b| b.chunks_exact(hd).take(block_size))
        .take(n_ctx)
}

/// [`context_rows`] for `D`-value heads, as arrays.
fn context_rows_n<'a, const D: usize>(
    blocks: &'a [&'a [f16]],
    block_size: usize,
    n_ctx: usize,
) -> impl Iterator<Item = &'a [f16; D]> + 'a {
    blocks
        .iter()
        .flat_map(move |b| b.as_chunks::<D>().0.iter().take(block_size))
        .take(n_ctx)
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    //! The grouped decode kernels. `unsafe` only for their target
    //! features: the caller must make sure the CPU supports AVX-512 F/VL
    //! (their 32 vector registers hold a run's accumulators), AVX2 and
    //! F16C. Lengths come from the argument types.

    use std::arch::x86_64::*;

    use half::f16;

    /// Output accumulators of `G` queries for 64 values of the head.
    pub(super) struct GroupAcc<const G: usize>(pub(super) [[__m256; 8]; G]);

    impl<const G: usize> GroupAcc<G> {
        /// All zeros.
        ///
        /// # Safety
        /// The CPU must support AVX-512 F/VL, AVX2 and F16C.
        #[target_feature(enable = "avx512f,avx512vl,avx2,f16c")]
        pub(super) unsafe fn zero() -> Self {
            GroupAcc([[_mm256_setzero_ps(); 8]; G])
        }
    }

    /// One row's lane accumulators for `G` queries: lane `i % 8`, chunks in
    /// order from zero, mul then add (as `avx2::dot_f32_f16`).
    ///
    /// # Safety
    /// The CPU must support AVX-512 F/VL, AVX2 and F16C.
    #[inline]
    #[target_feature(enable = "avx512f,avx512vl,avx2,f16c")]
    unsafe fn row_lanes<const D: usize, const G: usize>(
        q: &[[f32; D]; G],
        row: &[f16; D],
    ) -> [__m256; G] {
        // SAFETY (whole body): q's rows and `row` hold D values, c * 8 + 8 <= D.
        unsafe {
            let mut acc = [_mm256_setzero_ps(); G];
            for c in 0..D / 8 {
                let k = _mm256_cvtph_ps(_mm_loadu_si128(row.as_ptr().add(c * 8).cast()));
                for (a, qg) in acc.iter_mut().zip(q) {
                    let qv = _mm256_loadu_ps(qg.as_ptr().add(c * 8));
                    *a = _mm256_add_ps(*a, _mm256_mul_ps(qv, k));
                }
            }
            acc
        }
    }

    /// `G` queries' dot products with 8 f16 rows: each row's lanes as
    /// [`row_lanes`], summed as `avx2::sum_lanes8` does (so bitwise
    /// `avx2::dot_f32_f16` per row and query).
    ///
    /// # Safety
    /// The CPU must support AVX-512 F/VL, AVX2 and F16C.
    #[target_feature(enable = "avx512f,avx512vl,avx2,f16c")]
    pub(super) unsafe fn dot8_group<const D: usize, const G: usize>(
        q: &[[f32; D]; G],
        rows: &[[f16; D]; 8],
    ) -> [[f32; 8]; G] {
        // SAFETY (whole body): target features as the caller guarantees.
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); 8]; G];
            for (r, row) in rows.iter().enumerate() {
                let l = row_lanes::<D, G>(q, row);
                for (a, v) in acc.iter_mut().zip(l) {
                    a[r] = v;
                }
            }
            let mut out = [[0.0f32; 8]; G];
            for (o, a) in out.iter_mut().zip(&acc) {
                *o = super::avx2::sum_lanes8(a);
            }
            out
        }
    }

    /// [`dot8_group`] for one row: its lanes summed left to right from
    /// -0.0, as `lanes.iter().sum()`.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F/VL, AVX2 and F16C.
    #[target_feature(enable = "avx512f,avx512vl,avx2,f16c")]
    pub(super) unsafe fn dot_group<const D: usize, const G: usize>(
        q: &[[f32; D]; G],
        row: &[f16; D],
    ) -> [f32; G] {
        // SAFETY: target features as the caller guarantees.
        let l = unsafe { row_lanes::<D, G>(q, row) };
        l.map(|v| {
            let mut lanes = [0.0f32; 8];
            // SAFETY: `lanes` holds 8 f32.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), v) };
            lanes.iter().sum::<f32>()
        })
    }

    /// `acc[g] += p[g][p0 + j] * v_j[seg * 64..seg * 64 + 64]` for each row
    /// `j` of `rows` in order, mul then add per element (as
    /// `avx2::weighted_f16_rows_64` and `axpy_f16`).
    ///
    /// # Panics
    /// If some `p[g]` is shorter than `p0 + rows.len()`, or `seg * 64 + 64 > D`.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F/VL, AVX2 and F16C.
    #[target_feature(enable = "avx512f,avx512vl,avx2,f16c")]
    pub(super) unsafe fn weighted_group<const D: usize, const G: usize>(
        acc: &mut super::avx512::GroupAcc<G>,
        seg: usize,
        p: &[&[f32]; G],
        p0: usize,
        rows: &[[f16; D]],
    ) {
        assert!(seg * 64 + 64 <= D, "segment past the head");
        let w: [&[f32]; G] = std::array::from_fn(|g| &p[g][p0..p0 + rows.len()]);
        // SAFETY (whole body): each row holds D >= seg * 64 + 64 values.
        unsafe {
            let mut a = acc.0;
            for (j, row) in rows.iter().enumerate() {
                let src = row.as_ptr().add(seg * 64);
                let wv: [__m256; G] =
                    std::array::from_fn(|g| _mm256_set1_ps(*w[g].get_unchecked(j)));
                for c in 0..8 {
                    let x = _mm256_cvtph_ps(_mm_loadu_si128(src.add(c * 8).cast()));
                    for (ag, &wg) in a.iter_mut().zip(&wv) {
                        ag[c] = _mm256_add_ps(ag[c], _mm256_mul_ps(wg, x));
                    }
                }
            }
            acc.0 = a;
        }
    }

    /// `dst = f32(f16(src))`, rounding to nearest even (as `half`).
    ///
    /// # Safety
    /// The CPU must support AVX-512 F/VL, AVX2 and F16C.
    #[target_feature(enable = "avx512f,avx512vl,avx2,f16c")]
    pub(super) unsafe fn round_f16<const D: usize>(src: &[f32; D], dst: &mut [f32; D]) {
        for c in 0..D / 8 {
            // SAFETY: both hold D values, c * 8 + 8 <= D.
            unsafe {
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(
                    src.as_ptr().add(c * 8),
                ));
                _mm256_storeu_ps(dst.as_mut_ptr().add(c * 8), _mm256_cvtph_ps(h));
            }
        }
    }

    /// Stores 64 accumulated values.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F/VL, AVX2 and F16C.
    #[target_feature(enable = "avx512f,avx512vl,avx2,f16c")]
    pub(super) unsafe fn store64(dst: &mut [f32; 64], a: &[__m256; 8]) {
        for (c, v) in a.iter().enumerate() {
            // SAFETY: `dst` holds 64 values, c * 8 + 8 <= 64.
            unsafe { _mm256_storeu_ps(dst.as_mut_ptr().add(c * 8), *v) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! Every function here is `unsafe` only for its target features: the
    //! caller must make sure the CPU supports AVX2 and F16C. Lengths the
    //! loads rely on come from the argument types (`[_; 64]` rows) or from
    //! `chunks_exact`, so no slice length is a safety condition.

    use std::arch::x86_64::*;

    use half::f16;

    use super::Row64;

    /// Same arithmetic as `ops::dot_f32_f16`: lane `i % 8`, mul then add,
    /// lanes summed left to right. Reads whole 8-value chunks only: for
    /// that result `q` and `k` must have the same length, a multiple of 8
    /// (checked in debug builds; any lengths are memory safe).
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn dot_f32_f16(q: &[f32], k: &[f16]) -> f32 {
        debug_assert_eq!(q.len(), k.len());
        debug_assert_eq!(q.len() % 8, 0);
        let mut acc = _mm256_setzero_ps();
        for (qc, kc) in q.chunks_exact(8).zip(k.chunks_exact(8)) {
            // SAFETY: both chunks hold exactly 8 elements; unaligned loads.
            let (qv, kv) = unsafe {
                (
                    _mm256_loadu_ps(qc.as_ptr()),
                    _mm256_cvtph_ps(_mm_loadu_si128(kc.as_ptr().cast())),
                )
            };
            acc = _mm256_add_ps(acc, _mm256_mul_ps(qv, kv));
        }
        let mut lanes = [0.0f32; 8];
        // SAFETY: `lanes` holds 8 f32.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
        lanes.iter().sum::<f32>()
    }

    /// `rows[r] = f32(batch[r])` for each row of `batch` (at most 8; any
    /// beyond are ignored); exact.
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn convert_rows<const D: usize>(
        batch: &[&[f16; D]],
        rows: &mut [[f32; D]; 8],
    ) {
        for (dst, src) in rows.iter_mut().zip(batch) {
            for c in 0..D / 8 {
                // SAFETY: both rows hold D values (their types), c * 8 + 8 <= D.
                unsafe {
                    let x = _mm256_cvtph_ps(_mm_loadu_si128(src.as_ptr().add(c * 8).cast()));
                    _mm256_storeu_ps(dst.as_mut_ptr().add(c * 8), x);
                }
            }
        }
    }

    /// `kt[d][r] = f32(batch[r][d])` for the 8 rows of a batch, exact:
    /// converted and transposed, so lane `r` of `kt[d]` is row `r`'s value
    /// `d`.
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn convert_rows_t<const D: usize>(
        batch: &[&[f16; D]; 8],
        kt: &mut [[f32; 8]; D],
    ) {
        for c in 0..D / 8 {
            // SAFETY (whole block): every row holds D values and `kt` D
            // rows of 8, c * 8 + 8 <= D.
            unsafe {
                let a: [__m256; 8] = std::array::from_fn(|r| {
                    _mm256_cvtph_ps(_mm_loadu_si128(batch[r].as_ptr().add(c * 8).cast()))
                });
                for (j, v) in transpose8(&a).into_iter().enumerate() {
                    _mm256_storeu_ps(kt[c * 8 + j].as_mut_ptr(), v);
                }
            }
        }
    }

    /// `G` queries' scaled dot products with the 8 rows of a transposed
    /// batch (see [`convert_rows_t`]), bitwise [`dot_f32_f16`] times
    /// `scale` per query and row: lane `j`'s partial sum takes the values
    /// `c * 8 + j` in chunk order from +0.0, multiply then add, and the
    /// lanes are added in order from -0.0. Here each row is a vector lane,
    /// so lane sums are plain vector additions.
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn scores8<const D: usize, const G: usize>(
        q: &[[f32; D]; G],
        kt: &[[f32; 8]; D],
        scale: f32,
    ) -> [[f32; 8]; G] {
        // SAFETY (whole body): `kt` rows hold 8 values, c * 8 + j < D.
        unsafe {
            let mut sum = [_mm256_set1_ps(-0.0); G];
            for j in 0..8 {
                let mut acc = [_mm256_setzero_ps(); G];
                for c in 0..D / 8 {
                    let k = _mm256_loadu_ps(kt[c * 8 + j].as_ptr());
                    for (a, qg) in acc.iter_mut().zip(q) {
                        *a = _mm256_add_ps(*a, _mm256_mul_ps(_mm256_set1_ps(qg[c * 8 + j]), k));
                    }
                }
                for (s, a) in sum.iter_mut().zip(acc) {
                    *s = _mm256_add_ps(*s, a);
                }
            }
            let sv = _mm256_set1_ps(scale);
            let mut out = [[0.0f32; 8]; G];
            for (o, s) in out.iter_mut().zip(sum) {
                _mm256_storeu_ps(o.as_mut_ptr(), _mm256_mul_ps(s, sv));
            }
            out
        }
    }

    /// `out[g] += sum_r p[g][r] * rows[r]` over all 8 converted rows, in
    /// row order, multiply then add per element (as [`weighted_rows`] for
    /// each query), 16 output values of all `G` queries at a time in
    /// registers, so each row value loaded serves every query.
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn weighted8<const D: usize, const G: usize>(
        out: &mut [[f32; D]; G],
        p: &[&[f32; 8]; G],
        rows: &[[f32; D]; 8],
    ) {
        // SAFETY (whole body): `out` rows and `rows` hold D values, and
        // part * 16 + 16 <= D (D is a multiple of 64 here).
        unsafe {
            for part in 0..D / 16 {
                let at = part * 16;
                let mut acc: [[__m256; 2]; G] = std::array::from_fn(|g| {
                    [
                        _mm256_loadu_ps(out[g].as_ptr().add(at)),
                        _mm256_loadu_ps(out[g].as_ptr().add(at + 8)),
                    ]
                });
                for (r, row) in rows.iter().enumerate() {
                    let x0 = _mm256_loadu_ps(row.as_ptr().add(at));
                    let x1 = _mm256_loadu_ps(row.as_ptr().add(at + 8));
                    for (a, pg) in acc.iter_mut().zip(p) {
                        let w = _mm256_set1_ps(pg[r]);
                        a[0] = _mm256_add_ps(a[0], _mm256_mul_ps(w, x0));
                        a[1] = _mm256_add_ps(a[1], _mm256_mul_ps(w, x1));
                    }
                }
                for (o, a) in out.iter_mut().zip(acc) {
                    _mm256_storeu_ps(o.as_mut_ptr().add(at), a[0]);
                    _mm256_storeu_ps(o.as_mut_ptr().add(at + 8), a[1]);
                }
            }
        }
    }

    /// [`dot_f32_f16`] of a 64-value query with 8 f16 rows at once.
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn dot8_f32_f16_64(q: &[f32; 64], rows: &[&Row64; 8]) -> [f32; 8] {
        // SAFETY (whole body): q and every row hold 64 elements.
        unsafe {
            let mut qv = [_mm256_setzero_ps(); 8];
            for (c, v) in qv.iter_mut().enumerate() {
                *v = _mm256_loadu_ps(q.as_ptr().add(c * 8));
            }
            let mut acc = [_mm256_setzero_ps(); 8];
            for (a, row) in acc.iter_mut().zip(rows) {
                for (c, &qc) in qv.iter().enumerate() {
                    let k = _mm256_cvtph_ps(_mm_loadu_si128(row.as_ptr().add(c * 8).cast()));
                    *a = _mm256_add_ps(*a, _mm256_mul_ps(qc, k));
                }
            }
            sum_lanes8(&acc)
        }
    }

    /// 8x8 transpose: lane `r` of result `l` is lane `l` of `a[r]`.
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn transpose8(a: &[__m256; 8]) -> [__m256; 8] {
        let t0 = _mm256_unpacklo_ps(a[0], a[1]);
        let t1 = _mm256_unpackhi_ps(a[0], a[1]);
        let t2 = _mm256_unpacklo_ps(a[2], a[3]);
        let t3 = _mm256_unpackhi_ps(a[2], a[3]);
        let t4 = _mm256_unpacklo_ps(a[4], a[5]);
        let t5 = _mm256_unpackhi_ps(a[4], a[5]);
        let t6 = _mm256_unpacklo_ps(a[6], a[7]);
        let t7 = _mm256_unpackhi_ps(a[6], a[7]);
        let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
        let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
        [
            _mm256_permute2f128_ps::<0x20>(u0, u4),
            _mm256_permute2f128_ps::<0x20>(u1, u5),
            _mm256_permute2f128_ps::<0x20>(u2, u6),
            _mm256_permute2f128_ps::<0x20>(u3, u7),
            _mm256_permute2f128_ps::<0x31>(u0, u4),
            _mm256_permute2f128_ps::<0x31>(u1, u5),
            _mm256_permute2f128_ps::<0x31>(u2, u6),
            _mm256_permute2f128_ps::<0x31>(u3, u7),
        ]
    }

    /// Sums each of 8 rows' lane accumulators: transposed into place, then
    /// added in lane order from -0.0 as `lanes.iter().sum()` does, so the
    /// same additions per row as the one-row kernels.
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn sum_lanes8(acc: &[__m256; 8]) -> [f32; 8] {
        // SAFETY (whole body): `out` holds 8 f32.
        unsafe {
            let lanes = transpose8(acc);
            // `f32: Sum` starts from -0.0 (so x + start == x for every x).
            let mut sum = _mm256_set1_ps(-0.0);
            for l in lanes {
                sum = _mm256_add_ps(sum, l);
            }
            let mut out = [0.0f32; 8];
            _mm256_storeu_ps(out.as_mut_ptr(), sum);
            out
        }
    }

    /// `out = sum_j p[j] * v_j` over 64-value f16 rows, in row order, mul
    /// then add per element as [`axpy_f16`] (from zeros), the accumulators
    /// in registers.
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn weighted_f16_rows_64<'a>(
        out: &mut [f32; 64],
        p: &[f32],
        rows: impl Iterator<Item = &'a Row64>,
    ) {
        let mut acc = [_mm256_setzero_ps(); 8];
        for (&w, v) in p.iter().zip(rows) {
            let wv = _mm256_set1_ps(w);
            for (c, a) in acc.iter_mut().enumerate() {
                // SAFETY: the row holds 64 values.
                let x = unsafe { _mm256_cvtph_ps(_mm_loadu_si128(v.as_ptr().add(c * 8).cast())) };
                *a = _mm256_add_ps(*a, _mm256_mul_ps(wv, x));
            }
        }
        for (c, a) in acc.iter().enumerate() {
            // SAFETY: `out` holds 64 values.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(c * 8), *a) };
        }
    }

    /// `out += sum_j p[j] * rows[j]` over converted `D`-value rows (the
    /// first `p.len()`, at most 8), in row order, mul then add per element
    /// as [`axpy_f16`], the accumulators kept in registers across the rows
    /// (64 output values at a time; each element's additions keep their
    /// row order).
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn weighted_rows<const D: usize>(
        out: &mut [f32; D],
        p: &[f32],
        rows: &[[f32; D]; 8],
    ) {
        // SAFETY (whole body): `out` and every row hold D values, and
        // seg * 64 + c * 8 + 8 <= D (D is a multiple of 64 here).
        unsafe {
            for seg in 0..D / 64 {
                let mut acc = [_mm256_setzero_ps(); 8];
                for (c, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_loadu_ps(out.as_ptr().add(seg * 64 + c * 8));
                }
                for (&w, v) in p.iter().zip(rows) {
                    let wv = _mm256_set1_ps(w);
                    for (c, a) in acc.iter_mut().enumerate() {
                        let x = _mm256_loadu_ps(v.as_ptr().add(seg * 64 + c * 8));
                        *a = _mm256_add_ps(*a, _mm256_mul_ps(wv, x));
                    }
                }
                for (c, a) in acc.iter().enumerate() {
                    _mm256_storeu_ps(out.as_mut_ptr().add(seg * 64 + c * 8), *a);
                }
            }
        }
    }

    /// `acc[i] += w * v[i]`, mul then add, over whole 8-value chunks only:
    /// for that result `acc` and `v` must have the same length, a multiple
    /// of 8 (checked in debug builds; any lengths are memory safe).
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn axpy_f16(acc: &mut [f32], w: f32, v: &[f16]) {
        debug_assert_eq!(acc.len(), v.len());
        let wv = _mm256_set1_ps(w);
        for (ac, vc) in acc.chunks_exact_mut(8).zip(v.chunks_exact(8)) {
            // SAFETY: both chunks hold exactly 8 elements; unaligned loads/stores.
            unsafe {
                let x = _mm256_cvtph_ps(_mm_loadu_si128(vc.as_ptr().cast()));
                let a = _mm256_loadu_ps(ac.as_ptr());
                _mm256_storeu_ps(ac.as_mut_ptr(), _mm256_add_ps(a, _mm256_mul_ps(wv, x)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::IsaCoverage;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn blocks(rng: &mut ChaCha8Rng, n: usize, len: usize) -> Vec<Vec<f16>> {
        (0..n)
            .map(|_| {
                (0..len)
                    .map(|_| f16::from_f32(rng.random_range(-2.0..2.0)))
                    .collect()
            })
            .collect()
    }

    #[test]
    fn every_isa_matches_the_scalar_reference_bitwise() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let mut cov = IsaCoverage::new("attention::every_isa_matches_the_scalar_reference_bitwise");
        for &(hd, bs, n_ctx) in &[
            (64usize, 16usize, 1usize),
            (64, 16, 37),
            (64, 4, 64),
            (8, 3, 10),
            (128, 16, 200),
            (6, 2, 5),
            (64, 16, 7),
            (64, 16, 8),
            (64, 16, 9),
            (64, 3, 130),
        ] {
            let n_blocks = n_ctx.div_ceil(bs) + 1;
            let mut kb = blocks(&mut rng, n_blocks, bs * hd);
            // Some all-zero key rows: their scores are signed zeros.
            kb[0][..hd.min(bs * hd)].fill(f16::from_f32(-0.0));
            let vb = blocks(&mut rng, n_blocks, bs * hd);
            let ks: Vec<&[f16]> = kb.iter().map(Vec::as_slice).collect();
            let vs: Vec<&[f16]> = vb.iter().map(Vec::as_slice).collect();
            let q: Vec<f32> = (0..hd).map(|_| rng.random_range(-1.0..1.0)).collect();
            let mut scratch = Vec::new();
            let mut want = vec![0.0; hd];
            attend_with_isa(
                Isa::Scalar,
                &q,
                &ks,
                &vs,
                bs,
                n_ctx,
                0.125,
                &mut scratch,
                &mut want,
            );
            for isa in cov.isas() {
                let mut got = vec![0.0; hd];
                attend_with_isa(isa, &q, &ks, &vs, bs, n_ctx, 0.125, &mut scratch, &mut got);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "{isa} hd {hd} bs {bs} n_ctx {n_ctx}"
                );
                cov.ran(isa);
            }
        }
    }

    #[test]
    fn a_tile_is_bitwise_each_query_alone() {
        let mut rng = ChaCha8Rng::seed_from_u64(29);
        let mut cov = IsaCoverage::new("attention::a_tile_is_bitwise_each_query_alone");
        // (head_dim, block_size, per-query context lengths): GQA groups of
        // one token, causal runs of a prompt, lengths around the 8-row
        // batches, a query that sees nothing; both sides of the
        // converted-rows thresholds.
        let cases: &[(usize, usize, Vec<usize>)] = &[
            (64, 16, vec![37; 3]),
            (64, 16, (1..=10).collect()),
            (64, 16, (5..13).flat_map(|n| [n; 3]).collect()),
            (64, 3, vec![130, 7, 8, 9, 0, 64]),
            // The converted-rows path: enough queries and context.
            (64, 16, (120..=140).collect()),
            (64, 16, (125..133).flat_map(|n| [n; 3]).collect()),
            (64, 3, vec![130, 7, 8, 9, 0, 64, 1, 200]),
            // Wider heads on the same path (Gemma 3's are 256 wide).
            (128, 16, (125..133).flat_map(|n| [n; 3]).collect()),
            (256, 16, (120..=140).collect()),
            (256, 3, vec![130, 7, 8, 9, 0, 64, 1, 200]),
            (64, 16, vec![1]),
            // A decode step's groups (one context for every query): runs of
            // three and the rest, short blocks splitting 8-row batches.
            (64, 16, vec![37; 2]),
            (64, 16, vec![200; 7]),
            (64, 3, vec![29; 4]),
            (128, 16, vec![45; 4]),
            (256, 5, vec![33; 4]),
            (32, 4, vec![5, 6, 7, 20]),
            (6, 2, vec![3, 5]),
        ];
        for (hd, bs, n_ctx) in cases {
            let (hd, bs) = (*hd, *bs);
            let max = n_ctx.iter().copied().max().unwrap_or(0);
            let n_blocks = max.div_ceil(bs) + 1;
            let kb = blocks(&mut rng, n_blocks, bs * hd);
            let vb = blocks(&mut rng, n_blocks, bs * hd);
            let ks: Vec<&[f16]> = kb.iter().map(Vec::as_slice).collect();
            let vs: Vec<&[f16]> = vb.iter().map(Vec::as_slice).collect();
            let qs: Vec<f32> = (0..n_ctx.len() * hd)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let mut scratch = Vec::new();
            let mut want = vec![0.0; qs.len()];
            for ((q, o), &n) in qs.chunks(hd).zip(want.chunks_mut(hd)).zip(n_ctx) {
                attend_with_isa(Isa::Scalar, q, &ks, &vs, bs, n, 0.125, &mut scratch, o);
            }
            for isa in cov.isas() {
                let mut got = vec![f32::NAN; qs.len()];
                attend_tile_with_isa(
                    isa,
                    &qs,
                    &[],
                    n_ctx,
                    &ks,
                    &vs,
                    bs,
                    0.125,
                    &mut scratch,
                    &mut got,
                );
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{isa} hd {hd} bs {bs} {n_ctx:?}");
                cov.ran(isa);
            }
        }
    }

    #[test]
    fn matches_a_direct_float_computation() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let (hd, bs, n_ctx) = (16, 4, 11);
        let kb = blocks(&mut rng, 3, bs * hd);
        let vb = blocks(&mut rng, 3, bs * hd);
        let ks: Vec<&[f16]> = kb.iter().map(Vec::as_slice).collect();
        let vs: Vec<&[f16]> = vb.iter().map(Vec::as_slice).collect();
        let q: Vec<f32> = (0..hd).map(|_| rng.random_range(-1.0..1.0)).collect();
        let row = |b: &[Vec<f16>], j: usize| -> Vec<f64> {
            b[j / bs][(j % bs) * hd..(j % bs + 1) * hd]
                .iter()
                .map(|x| f64::from(x.to_f32()))
                .collect()
        };
        let s: Vec<f64> = (0..n_ctx)
            .map(|j| {
                row(&kb, j)
                    .iter()
                    .zip(&q)
                    .map(|(k, &q)| k * f64::from(q))
                    .sum::<f64>()
                    * 0.25
            })
            .collect();
        let max = s.iter().copied().fold(f64::MIN, f64::max);
        let z: f64 = s.iter().map(|x| (x - max).exp()).sum();
        let mut want = vec![0.0f64; hd];
        for (j, sj) in s.iter().enumerate() {
            for (w, v) in want.iter_mut().zip(row(&vb, j)) {
                *w += (sj - max).exp() / z * v;
            }
        }
        let mut got = vec![0.0; hd];
        attend(&q, &ks, &vs, bs, n_ctx, 0.25, &mut Vec::new(), &mut got);
        for (g, w) in got.iter().zip(&want) {
            // f16 rounding of the query and the probabilities bounds the error.
            assert!((f64::from(*g) - w).abs() < 5e-3, "{g} vs {w}");
        }
    }

    #[test]
    fn a_window_hides_earlier_positions_on_every_path() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let (hd, bs, nq) = (64, 16, 8);
        let kb = blocks(&mut rng, 10, bs * hd);
        let vb = blocks(&mut rng, 10, bs * hd);
        let ks: Vec<&[f16]> = kb.iter().map(Vec::as_slice).collect();
        let vs: Vec<&[f16]> = vb.iter().map(Vec::as_slice).collect();
        let qs: Vec<f32> = (0..nq * hd).map(|_| rng.random_range(-1.0..1.0)).collect();
        // Long enough contexts for the tiled path, windows of 20 positions.
        let n_ctx: Vec<usize> = (0..nq).map(|i| 140 + i).collect();
        let first: Vec<usize> = n_ctx.iter().map(|n| n - 20).collect();
        let row = |b: &[Vec<f16>], j: usize| -> Vec<f64> {
            b[j / bs][(j % bs) * hd..(j % bs + 1) * hd]
                .iter()
                .map(|x| f64::from(x.to_f32()))
                .collect()
        };
        let mut reference = vec![0.0; nq * hd];
        attend_tile_with_isa(
            Isa::Scalar,
            &qs,
            &first,
            &n_ctx,
            &ks,
            &vs,
            bs,
            0.125,
            &mut Vec::new(),
            &mut reference,
        );
        for isa in Isa::ALL.iter().copied().filter(|i| i.is_supported()) {
            let mut got = vec![0.0; nq * hd];
            attend_tile_with_isa(
                isa,
                &qs,
                &first,
                &n_ctx,
                &ks,
                &vs,
                bs,
                0.125,
                &mut Vec::new(),
                &mut got,
            );
            assert_eq!(got, reference, "{isa:?}");
            // One query alone is bitwise the same as in the tile.
            let mut one = vec![0.0; hd];
            attend_tile_with_isa(
                isa,
                &qs[3 * hd..4 * hd],
                &first[3..4],
                &n_ctx[3..4],
                &ks,
                &vs,
                bs,
                0.125,
                &mut Vec::new(),
                &mut one,
            );
            assert_eq!(one, reference[3 * hd..4 * hd], "{isa:?} alone");
        }
        for (i, got) in reference.chunks_exact(hd).enumerate() {
            let q = &qs[i * hd..(i + 1) * hd];
            let window = first[i]..n_ctx[i];
            let s: Vec<f64> = window
                .clone()
                .map(|j| {
                    row(&kb, j)
                        .iter()
                        .zip(q)
                        .map(|(k, &q)| k * f64::from(q))
                        .sum::<f64>()
                        * 0.125
                })
                .collect();
            let max = s.iter().copied().fold(f64::MIN, f64::max);
            let z: f64 = s.iter().map(|x| (x - max).exp()).sum();
            let mut want = vec![0.0f64; hd];
            for (j, sj) in window.zip(&s) {
                for (w, v) in want.iter_mut().zip(row(&vb, j)) {
                    *w += (sj - max).exp() / z * v;
                }
            }
            for (g, w) in got.iter().zip(&want) {
                assert!((f64::from(*g) - w).abs() < 5e-3, "query {i}: {g} vs {w}");
            }
        }
    }

    #[test]
    fn a_group_sharing_a_window_is_bitwise_each_query_alone() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let mut cov =
            IsaCoverage::new("attention::a_group_sharing_a_window_is_bitwise_each_query_alone");
        for &(hd, bs, nq, n, lo) in &[
            (64usize, 16usize, 3usize, 150usize, 130usize),
            (256, 7, 4, 61, 9),
        ] {
            let kb = blocks(&mut rng, n.div_ceil(bs), bs * hd);
            let vb = blocks(&mut rng, n.div_ceil(bs), bs * hd);
            let ks: Vec<&[f16]> = kb.iter().map(Vec::as_slice).collect();
            let vs: Vec<&[f16]> = vb.iter().map(Vec::as_slice).collect();
            let qs: Vec<f32> = (0..nq * hd).map(|_| rng.random_range(-1.0..1.0)).collect();
            let (first, n_ctx) = (vec![lo; nq], vec![n; nq]);
            let mut want = vec![0.0; nq * hd];
            for (i, (q, o)) in qs.chunks(hd).zip(want.chunks_mut(hd)).enumerate() {
                attend_tile_with_isa(
                    Isa::Scalar,
                    q,
                    &first[i..i + 1],
                    &n_ctx[i..i + 1],
                    &ks,
                    &vs,
                    bs,
                    0.125,
                    &mut Vec::new(),
                    o,
                );
            }
            for isa in cov.isas() {
                let mut got = vec![f32::NAN; nq * hd];
                attend_tile_with_isa(
                    isa,
                    &qs,
                    &first,
                    &n_ctx,
                    &ks,
                    &vs,
                    bs,
                    0.125,
                    &mut Vec::new(),
                    &mut got,
                );
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{isa} hd {hd} bs {bs}");
                cov.ran(isa);
            }
        }
    }

    #[test]
    fn a_block_short_of_the_rows_used_is_rejected() {
        let full = vec![f16::from_f32(1.0); 4 * 8];
        let short = vec![f16::from_f32(1.0); 3 * 8];
        let run = |n_ctx: usize| {
            std::panic::catch_unwind(|| {
                let mut out = [0.0; 8];
                attend(
                    &[1.0; 8],
                    &[&full, &short],
                    &[&full, &full],
                    4,
                    n_ctx,
                    1.0,
                    &mut Vec::new(),
                    &mut out,
                );
            })
        };
        // Seven positions use three rows of the second block; eight use four.
        assert!(run(7).is_ok());
        assert!(run(8).is_err());
    }

    #[test]
    fn single_position_returns_its_value_row() {
        let v = vec![f16::from_f32(0.5); 8];
        let k = vec![f16::from_f32(1.0); 8];
        let mut out = vec![0.0; 8];
        attend(
            &[1.0; 8],
            &[&k],
            &[&v],
            1,
            1,
            1.0,
            &mut Vec::new(),
            &mut out,
        );
        assert_eq!(out, vec![0.5; 8]);
    }
}
