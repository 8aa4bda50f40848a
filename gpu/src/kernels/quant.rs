//! Matmuls over quantised weights, dequantised on the fly: the GGUF
//! formats the bundled models ship (Q4_1; Q5_0, Q8_0, Q4_K and Q6_K in the
//! "Q4_K_M" files), and F16 / BF16 / F32 (unquantised GGUF files and
//! safetensors checkpoints). A [`QMatrix`] holds a matrix's blocks repacked so each
//! starts on a 32-bit word (the device reads words); the values are
//! GGUF's, unchanged. One kernel serves every format (its block decoder
//! chosen when the kernel is expanded): 32 units per output row, each
//! taking one word of a block's quants at a time, so a cube's loads of
//! weights and `x` run along memory in order; each weight is dequantised
//! once for a tile of up to 8 tokens, and every token's sum runs in the
//! one-token order, so batching changes no bit.

use cubecl::prelude::*;
use tandem_kernels::GgmlType;

use super::{
    MATMUL_ROWS, MATMUL_UNITS, arg, half_to_f32, matmul_grid, matmul_row, matmul_shape,
    segment_reduce, shape,
};
use crate::device::{Buffer, GpuDevice};
use crate::error::GpuError;

/// A weight format the device's matmuls read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)] // GGUF's names
pub enum QFormat {
    Q4_1,
    Q5_0,
    Q8_0,
    Q4_K,
    Q6_K,
    F16,
    BF16,
    F32,
}

impl QFormat {
    /// Every format, in the order of [`GgmlType`].
    pub const ALL: [QFormat; 8] = [
        QFormat::Q4_1,
        QFormat::Q5_0,
        QFormat::Q8_0,
        QFormat::Q4_K,
        QFormat::Q6_K,
        QFormat::F16,
        QFormat::BF16,
        QFormat::F32,
    ];

    /// The device format of GGUF tensors of type `ty`, if it has one.
    pub fn of(ty: GgmlType) -> Option<QFormat> {
        match ty {
            GgmlType::Q4_1 => Some(QFormat::Q4_1),
            GgmlType::Q5_0 => Some(QFormat::Q5_0),
            GgmlType::Q8_0 => Some(QFormat::Q8_0),
            GgmlType::Q4_K => Some(QFormat::Q4_K),
            GgmlType::Q6_K => Some(QFormat::Q6_K),
            GgmlType::F16 => Some(QFormat::F16),
            GgmlType::BF16 => Some(QFormat::BF16),
            GgmlType::F32 => Some(QFormat::F32),
            _ => None,
        }
    }

    /// The GGUF type it reads.
    pub fn ggml(self) -> GgmlType {
        match self {
            QFormat::Q4_1 => GgmlType::Q4_1,
            QFormat::Q5_0 => GgmlType::Q5_0,
            QFormat::Q8_0 => GgmlType::Q8_0,
            QFormat::Q4_K => GgmlType::Q4_K,
            QFormat::Q6_K => GgmlType::Q6_K,
            QFormat::F16 => GgmlType::F16,
            QFormat::BF16 => GgmlType::BF16,
            QFormat::F32 => GgmlType::F32,
        }
    }

    /// Values per block: a row's columns come in whole blocks (and a
    /// tensor-parallel rank's share of them too). GGUF's blocks, except
    /// that the device reads unquantised values 8 at a time, so their
    /// rows are whole groups of 8.
    pub fn block_len(self) -> usize {
        match self {
            QFormat::F16 | QFormat::BF16 | QFormat::F32 => PLAIN_BLOCK,
            _ => self.ggml().block_len(),
        }
    }

    /// File bytes per block (of [`QFormat::block_len`] values).
    pub fn block_bytes(self) -> usize {
        match self {
            QFormat::F16 | QFormat::BF16 | QFormat::F32 => PLAIN_BLOCK * self.ggml().block_bytes(),
            _ => self.ggml().block_bytes(),
        }
    }

    /// 32-bit words per repacked block: GGUF's bytes with the two-byte
    /// scale of Q5_0 and Q8_0 widened to a word, and Q6_K's 210 bytes
    /// padded to 212.
    pub(super) fn block_words(self) -> usize {
        match self {
            QFormat::Q4_1 => 5,
            QFormat::Q5_0 => 6,
            QFormat::Q8_0 => 9,
            QFormat::Q4_K => 36,
            QFormat::Q6_K => 53,
            QFormat::F16 | QFormat::BF16 => PLAIN_BLOCK / 2,
            QFormat::F32 => PLAIN_BLOCK,
        }
    }

    /// GGUF blocks of this format, as the kernels read them.
    fn pack(self, bytes: &[u8]) -> Vec<u32> {
        let word = |b: &[u8]| {
            let mut w = [0u8; 4];
            w[..b.len()].copy_from_slice(b);
            u32::from_le_bytes(w)
        };
        let blocks = bytes.chunks_exact(self.block_bytes());
        let mut out = Vec::with_capacity(blocks.len() * self.block_words());
        for b in blocks {
            match self {
                // The scale alone in a word, then the rest as it is.
                QFormat::Q5_0 | QFormat::Q8_0 => {
                    out.push(word(&b[..2]));
                    out.extend(b[2..].chunks(4).map(word));
                }
                QFormat::Q4_1
                | QFormat::Q4_K
                | QFormat::Q6_K
                | QFormat::F16
                | QFormat::BF16
                | QFormat::F32 => {
                    out.extend(b.chunks(4).map(word));
                }
            }
        }
        out
    }
}

/// Unquantised values per device block.
const PLAIN_BLOCK: usize = 8;

/// A `rows` x `cols` matrix of quantised weights on a device.
#[derive(Debug, Clone)]
pub struct QMatrix {
    format: QFormat,
    w: Buffer<u32>,
    rows: usize,
    cols: usize,
}

impl QMatrix {
    /// Uploads `bytes`, `rows` GGUF rows of `cols` values in `format`.
    pub fn upload(
        dev: &GpuDevice,
        format: QFormat,
        rows: usize,
        cols: usize,
        bytes: &[u8],
    ) -> Result<QMatrix, GpuError> {
        let bl = format.block_len();
        if !cols.is_multiple_of(bl) || bytes.len() != rows * cols / bl * format.block_bytes() {
            return Err(shape(
                "quantised matrix",
                format!(
                    "{} bytes are not {rows} rows of {cols} {format:?} columns",
                    bytes.len()
                ),
            ));
        }
        Ok(QMatrix {
            format,
            w: dev.upload(&format.pack(bytes)),
            rows,
            cols,
        })
    }

    pub fn format(&self) -> QFormat {
        self.format
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }
}

/// `out[t][at + r] = x[t] . w[r]` for each token `t` of `x` (rows of
/// `w.cols()`) and row `r` of `w`, in an output of rows of `stride`: a
/// matrix stacked from parts of several formats writes each part's rows
/// at its offset.
pub fn matmul_q(
    dev: &GpuDevice,
    x: &Buffer,
    w: &QMatrix,
    out: &Buffer,
    stride: usize,
    at: usize,
) -> Result<(), GpuError> {
    matmul_q_live(dev, x, w, out, stride, at, dev.all_rows(), 0)
}

/// [`matmul_q`] over only the first `live[live_at]` token rows of `x`
/// (the rest of `out` is left as it was), a count the device wrote: the
/// grid covers every row of `x`, and the tiles past the count end at
/// once, reading no weights. So a mixture-of-experts layer runs each
/// expert over its tokens without the host learning how many.
#[allow(clippy::too_many_arguments)]
pub fn matmul_q_live(
    dev: &GpuDevice,
    x: &Buffer,
    w: &QMatrix,
    out: &Buffer,
    stride: usize,
    at: usize,
    live: &Buffer<u32>,
    live_at: usize,
) -> Result<(), GpuError> {
    const KERNEL: &str = "quantised matmul";
    let Some(live_at32) = u32::try_from(live_at).ok().filter(|_| live_at < live.len()) else {
        return Err(shape(
            KERNEL,
            format!("live count {live_at} of {}", live.len()),
        ));
    };
    let (rows, cols) = (w.rows, w.cols);
    if cols == 0 || !x.len().is_multiple_of(cols) || at + rows > stride {
        return Err(shape(
            KERNEL,
            format!(
                "x {} must be rows of {cols}; rows {at}..{} of {stride}",
                x.len(),
                at + rows
            ),
        ));
    }
    let n = x.len() / cols;
    // The output holds `stride` rows per token (this part writes some).
    matmul_shape(KERNEL, x.len(), stride, cols, out.len())?;
    let (Ok(stride32), Ok(at32)) = (u32::try_from(stride), u32::try_from(at)) else {
        return Err(shape(KERNEL, format!("rows of {stride} beyond 32 bits")));
    };
    let Some((count, dim, tile, n_tok)) = matmul_grid(KERNEL, n, rows)? else {
        return Ok(());
    };
    quant_matmul_kernel::launch(
        dev.client(),
        count,
        dim,
        arg(x),
        arg(&w.w),
        arg(out),
        arg(live),
        live_at32,
        n_tok,
        stride32,
        at32,
        cols,
        MATMUL_UNITS,
        tile,
        w.format,
    );
    Ok(())
}

/// Adds `v * x[t][c]` to each of the tile's tokens from `t0` (of `n`).
#[cube]
fn accumulate(
    acc: &mut Array<f32>,
    x: &[f32],
    v: f32,
    c: usize,
    t0: usize,
    n: usize,
    #[comptime] cols: usize,
    #[comptime] tile: usize,
) {
    #[unroll]
    for j in 0..tile {
        if t0 + j < n {
            acc[j] += v * x[(t0 + j) * cols + c];
        }
    }
}

/// Byte `k` of the words from `at` on.
#[cube]
fn byte_at(w: &[u32], at: usize, k: usize) -> u32 {
    (w[at + k / 4] >> ((k % 4) as u32 * 8)) & 0xff
}

/// The signed value of byte `v` (0..256).
#[cube]
fn signed(v: u32) -> f32 {
    v as f32 - (v >> 7) as f32 * 256.0f32
}

/// Units sharing a block of `format`, a word of its quants each.
fn units_per_block(format: QFormat) -> usize {
    match format {
        QFormat::Q4_1 | QFormat::Q5_0 => 4,
        QFormat::Q8_0 => 8,
        QFormat::Q4_K | QFormat::Q6_K => 32,
        QFormat::F16 | QFormat::BF16 => PLAIN_BLOCK / 2,
        QFormat::F32 => PLAIN_BLOCK,
    }
}

/// `out[t][at + r] = x[t] . w[r]` over `w`'s blocks of `format`: each
/// unit of a row's `units` takes word `q` of a block's quants, its
/// neighbours the next words, then the next blocks; the block decoders
/// below say which values a word holds.
#[cube(launch, create_dummy_kernel)]
pub(super) fn quant_matmul_kernel(
    x: &[f32],
    w: &[u32],
    out: &mut [f32],
    live: &[u32],
    live_at: u32,
    n_tok: u32,
    stride: u32,
    at: u32,
    #[comptime] cols: usize,
    #[comptime] units: usize,
    #[comptime] tile: usize,
    #[comptime] format: QFormat,
) {
    let words = comptime!(format.block_words());
    let per_block = comptime!(units_per_block(format));
    let nb = cols / comptime!(format.block_len());
    let rows = w.len() / (nb * words);
    let r = matmul_row(rows);
    let t0 = CUBE_POS_Z as usize * tile;
    // The launch covers `n_tok` rows of `x`; the first `live[live_at]` of
    // them are computed (a count the device wrote: an expert's tokens).
    let n = u32::min(n_tok, live[live_at as usize]) as usize;
    let unit = UNIT_POS_X as usize % units;
    let mut acc = Array::<f32>::new(tile);
    #[unroll]
    for j in 0..tile {
        acc[j] = 0.0f32;
    }
    // A tile past the live rows reads no weights.
    if r < rows && t0 < n {
        let q = unit % per_block;
        let per_pass = units / per_block;
        for i in 0..nb.div_ceil(per_pass) {
            let b = i * per_pass + unit / per_block;
            if b < nb {
                let blk = (r * nb + b) * words;
                match comptime!(format) {
                    QFormat::Q4_1 => q4_1_word(&mut acc, x, w, blk, q, b, t0, n, cols, tile),
                    QFormat::Q5_0 => q5_0_word(&mut acc, x, w, blk, q, b, t0, n, cols, tile),
                    QFormat::Q8_0 => q8_0_word(&mut acc, x, w, blk, q, b, t0, n, cols, tile),
                    QFormat::Q4_K => q4_k_word(&mut acc, x, w, blk, q, b, t0, n, cols, tile),
                    QFormat::Q6_K => q6_k_word(&mut acc, x, w, blk, q, b, t0, n, cols, tile),
                    QFormat::F16 => half_word(&mut acc, x, w, blk, q, b, t0, n, cols, tile, false),
                    QFormat::BF16 => half_word(&mut acc, x, w, blk, q, b, t0, n, cols, tile, true),
                    QFormat::F32 => {
                        let v = f32::reinterpret(w[blk + q]);
                        accumulate(
                            &mut acc,
                            x,
                            v,
                            b * comptime!(PLAIN_BLOCK) + q,
                            t0,
                            n,
                            cols,
                            tile,
                        );
                    }
                }
            }
        }
    }
    let mut sh = Shared::<[f32]>::new_slice(units * MATMUL_ROWS);
    let (stride, at) = (stride as usize, at as usize);
    #[unroll]
    for j in 0..tile {
        let total = segment_reduce(&mut sh, acc[j], UNIT_POS_X as usize, units, false);
        if r < rows && unit == 0 && t0 + j < n {
            out[(t0 + j) * stride + at + r] = total;
        }
    }
}

/// Q4_1, 5 words: f16 scale and f16 min, then 16 bytes whose low nibbles
/// are values 0..16 and high nibbles 16..32. Word `q` of the nibbles holds
/// values 4q..4q+4 and 16+4q..16+4q+4.
#[cube]
#[allow(clippy::too_many_arguments)]
fn q4_1_word(
    acc: &mut Array<f32>,
    x: &[f32],
    w: &[u32],
    blk: usize,
    q: usize,
    b: usize,
    t0: usize,
    n: usize,
    #[comptime] cols: usize,
    #[comptime] tile: usize,
) {
    let dm = w[blk];
    let d = half_to_f32(dm & 0xffff);
    let m = half_to_f32(dm >> 16);
    let word = w[blk + 1 + q];
    let c = b * 32 + q * 4;
    for byte in 0..4usize {
        let v = (word >> (byte as u32 * 8)) & 0xff;
        let lo = d * (v & 0xf) as f32 + m;
        let hi = d * (v >> 4) as f32 + m;
        // Per token: the low value's product, then the high one's.
        #[unroll]
        for j in 0..tile {
            if t0 + j < n {
                let xb = (t0 + j) * cols + c + byte;
                acc[j] += lo * x[xb];
                acc[j] += hi * x[xb + 16];
            }
        }
    }
}

/// Q5_0, 6 words: the f16 scale, the 32 high bits, then 16 bytes of low
/// nibbles laid as Q4_1's; a value is (nibble | high << 4) - 16 times the
/// scale.
#[cube]
#[allow(clippy::too_many_arguments)]
fn q5_0_word(
    acc: &mut Array<f32>,
    x: &[f32],
    w: &[u32],
    blk: usize,
    q: usize,
    b: usize,
    t0: usize,
    n: usize,
    #[comptime] cols: usize,
    #[comptime] tile: usize,
) {
    let d = half_to_f32(w[blk] & 0xffff);
    let qh = w[blk + 1];
    let word = w[blk + 2 + q];
    for byte in 0..4usize {
        let e = q * 4 + byte;
        let v = (word >> (byte as u32 * 8)) & 0xff;
        let h0 = (qh >> e as u32) & 1;
        let h1 = (qh >> (e as u32 + 16)) & 1;
        let lo = d * (((v & 0xf) | (h0 << 4)) as f32 - 16.0f32);
        let hi = d * (((v >> 4) | (h1 << 4)) as f32 - 16.0f32);
        let c = b * 32 + e;
        accumulate(acc, x, lo, c, t0, n, cols, tile);
        accumulate(acc, x, hi, c + 16, t0, n, cols, tile);
    }
}

/// Q8_0, 9 words: the f16 scale, then 32 signed bytes, word `q` values
/// 4q..4q+4.
#[cube]
#[allow(clippy::too_many_arguments)]
fn q8_0_word(
    acc: &mut Array<f32>,
    x: &[f32],
    w: &[u32],
    blk: usize,
    q: usize,
    b: usize,
    t0: usize,
    n: usize,
    #[comptime] cols: usize,
    #[comptime] tile: usize,
) {
    let d = half_to_f32(w[blk] & 0xffff);
    let word = w[blk + 1 + q];
    for byte in 0..4usize {
        let v = signed((word >> (byte as u32 * 8)) & 0xff);
        accumulate(acc, x, d * v, b * 32 + q * 4 + byte, t0, n, cols, tile);
    }
}

/// Q4_K, 36 words per 256 values: f16 scale and f16 min-scale, 12 bytes
/// of 6-bit sub-block scales and mins, then 4 groups of 32 bytes whose low
/// nibbles are values 64g..64g+32 (sub-block 2g) and high nibbles
/// 64g+32..64g+64 (sub-block 2g+1). Word `q` is in group q / 8 and holds
/// values 4 (q % 8).. of both halves.
#[cube]
#[allow(clippy::too_many_arguments)]
fn q4_k_word(
    acc: &mut Array<f32>,
    x: &[f32],
    w: &[u32],
    blk: usize,
    q: usize,
    b: usize,
    t0: usize,
    n: usize,
    #[comptime] cols: usize,
    #[comptime] tile: usize,
) {
    let g = q / 8;
    let dm = w[blk];
    let d = half_to_f32(dm & 0xffff);
    let dmin = half_to_f32(dm >> 16);
    // Sub-blocks 2g and 2g + 1: 6-bit scale and min each, the last four
    // split across two bytes.
    let s = blk + 1;
    let mut sc_lo = byte_at(w, s, 2 * g) & 63;
    let mut m_lo = byte_at(w, s, 2 * g + 4) & 63;
    let mut sc_hi = byte_at(w, s, 2 * g + 1) & 63;
    let mut m_hi = byte_at(w, s, 2 * g + 5) & 63;
    if g >= 2 {
        let j = 2 * g;
        sc_lo = (byte_at(w, s, j + 4) & 0xf) | ((byte_at(w, s, j - 4) >> 6) << 4);
        m_lo = (byte_at(w, s, j + 4) >> 4) | ((byte_at(w, s, j) >> 6) << 4);
        sc_hi = (byte_at(w, s, j + 5) & 0xf) | ((byte_at(w, s, j - 3) >> 6) << 4);
        m_hi = (byte_at(w, s, j + 5) >> 4) | ((byte_at(w, s, j + 1) >> 6) << 4);
    }
    let (d1, m1) = (d * sc_lo as f32, dmin * m_lo as f32);
    let (d2, m2) = (d * sc_hi as f32, dmin * m_hi as f32);
    let word = w[blk + 4 + q];
    let c = b * 256 + g * 64 + (q % 8) * 4;
    for byte in 0..4usize {
        let v = (word >> (byte as u32 * 8)) & 0xff;
        let lo = d1 * (v & 0xf) as f32 - m1;
        let hi = d2 * (v >> 4) as f32 - m2;
        accumulate(acc, x, lo, c + byte, t0, n, cols, tile);
        accumulate(acc, x, hi, c + 32 + byte, t0, n, cols, tile);
    }
}

/// Q6_K, 53 words per 256 values: 128 bytes of low nibbles (ql), 64 of
/// high bit pairs (qh), 16 signed sub-block scales, the f16 scale, 2
/// bytes of padding. Half h (values 128h..) reads ql[64h..], qh[32h..]:
/// for l in 0..32, ql[l]'s nibbles are values l and l + 64, ql[l + 32]'s
/// values l + 32 and l + 96, their high bits in qh[l] (bits 0-1, 4-5 and
/// 2-3, 6-7); value v's scale is the half's scale (v % 128) / 16. Word
/// `q` has half q / 16, ql part (q / 8) % 2, and l = 4 (q % 8)..+4.
#[cube]
#[allow(clippy::too_many_arguments)]
fn q6_k_word(
    acc: &mut Array<f32>,
    x: &[f32],
    w: &[u32],
    blk: usize,
    q: usize,
    b: usize,
    t0: usize,
    n: usize,
    #[comptime] cols: usize,
    #[comptime] tile: usize,
) {
    let h = q / 16;
    let part = (q / 8) % 2;
    let lw = q % 8;
    let d = half_to_f32(w[blk + 52] & 0xffff);
    let ql = w[blk + h * 16 + part * 8 + lw];
    let qh = w[blk + 32 + h * 8 + lw];
    // The four l share a scale (16 | 4 lw).
    let is = lw / 4;
    let sc = blk + 48;
    let d_lo = d * signed(byte_at(w, sc, 8 * h + is + 2 * part));
    let d_hi = d * signed(byte_at(w, sc, 8 * h + is + 2 * part + 4));
    let c = b * 256 + h * 128 + part * 32 + lw * 4;
    for byte in 0..4usize {
        let shift = byte as u32 * 8;
        let v = (ql >> shift) & 0xff;
        let hb = (qh >> shift) & 0xff;
        let q_lo = (v & 0xf) | (((hb >> (2 * part as u32)) & 3) << 4);
        let q_hi = (v >> 4) | (((hb >> (4 + 2 * part as u32)) & 3) << 4);
        let lo = d_lo * (q_lo as f32 - 32.0f32);
        let hi = d_hi * (q_hi as f32 - 32.0f32);
        accumulate(acc, x, lo, c + byte, t0, n, cols, tile);
        accumulate(acc, x, hi, c + 64 + byte, t0, n, cols, tile);
    }
}

/// F16 or BF16 (`brain`), 4 words per 8 values: word `q` holds values
/// 2q (low half) and 2q + 1.
#[cube]
#[allow(clippy::too_many_arguments)]
fn half_word(
    acc: &mut Array<f32>,
    x: &[f32],
    w: &[u32],
    blk: usize,
    q: usize,
    b: usize,
    t0: usize,
    n: usize,
    #[comptime] cols: usize,
    #[comptime] tile: usize,
    #[comptime] brain: bool,
) {
    let word = w[blk + q];
    // A bf16 is the top half of an f32.
    let lo = if brain {
        f32::reinterpret(word << 16)
    } else {
        half_to_f32(word & 0xffff)
    };
    let hi = if brain {
        f32::reinterpret(word & 0xffff_0000u32)
    } else {
        half_to_f32(word >> 16)
    };
    let c = b * comptime!(PLAIN_BLOCK) + q * 2;
    accumulate(acc, x, lo, c, t0, n, cols, tile);
    accumulate(acc, x, hi, c + 1, t0, n, cols, tile);
}
