//! Matmuls over quantised weights, dequantised on the fly: the GGUF
//! formats the bundled models ship (Q4_1; Q5_0, Q8_0, Q4_K and Q6_K in the
//! "Q4_K_M" files). A [`QMatrix`] holds a matrix's blocks repacked so each
//! starts on a 32-bit word (the device reads words); the values are
//! GGUF's, unchanged. Every kernel follows one plan: 32 units per output
//! row, each taking one word of a block's quants at a time, so a cube's
//! loads of weights and `x` run along memory in order; each weight is
//! dequantised once for a tile of up to 8 tokens, and every token's sum
//! runs in the one-token order, so batching changes no bit.

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
}

impl QFormat {
    /// Every format, in the order of [`GgmlType`].
    pub const ALL: [QFormat; 5] = [
        QFormat::Q4_1,
        QFormat::Q5_0,
        QFormat::Q8_0,
        QFormat::Q4_K,
        QFormat::Q6_K,
    ];

    /// The device format of GGUF tensors of type `ty`, if it has one.
    pub fn of(ty: GgmlType) -> Option<QFormat> {
        match ty {
            GgmlType::Q4_1 => Some(QFormat::Q4_1),
            GgmlType::Q5_0 => Some(QFormat::Q5_0),
            GgmlType::Q8_0 => Some(QFormat::Q8_0),
            GgmlType::Q4_K => Some(QFormat::Q4_K),
            GgmlType::Q6_K => Some(QFormat::Q6_K),
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
        }
    }

    /// Values per block: a row's columns come in whole blocks (and a
    /// tensor-parallel rank's share of them too).
    pub fn block_len(self) -> usize {
        self.ggml().block_len()
    }

    /// GGUF bytes per block.
    fn block_bytes(self) -> usize {
        self.ggml().block_bytes()
    }

    /// 32-bit words per repacked block: GGUF's bytes with the two-byte
    /// scale of Q5_0 and Q8_0 widened to a word, and Q6_K's 210 bytes
    /// padded to 212.
    fn block_words(self) -> usize {
        match self {
            QFormat::Q4_1 => 5,
            QFormat::Q5_0 => 6,
            QFormat::Q8_0 => 9,
            QFormat::Q4_K => 36,
            QFormat::Q6_K => 53,
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
                QFormat::Q4_1 | QFormat::Q4_K | QFormat::Q6_K => {
                    out.extend(b.chunks(4).map(word));
                }
            }
        }
        out
    }
}

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
    const KERNEL: &str = "quantised matmul";
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
    // The output's shape as if it were this part's alone.
    matmul_shape(KERNEL, x.len(), stride, cols, out.len())?;
    let (Ok(stride32), Ok(at32)) = (u32::try_from(stride), u32::try_from(at)) else {
        return Err(shape(KERNEL, format!("rows of {stride} beyond 32 bits")));
    };
    let Some((count, dim, tile, n_tok)) = matmul_grid(KERNEL, n, rows)? else {
        return Ok(());
    };
    let c = dev.client();
    let (x, wa, o) = (arg(x), arg(&w.w), arg(out));
    let (u, t) = (MATMUL_UNITS, tile);
    match w.format {
        QFormat::Q4_1 => {
            q4_1_kernel::launch(c, count, dim, x, wa, o, n_tok, stride32, at32, cols, u, t)
        }
        QFormat::Q5_0 => {
            q5_0_kernel::launch(c, count, dim, x, wa, o, n_tok, stride32, at32, cols, u, t)
        }
        QFormat::Q8_0 => {
            q8_0_kernel::launch(c, count, dim, x, wa, o, n_tok, stride32, at32, cols, u, t)
        }
        QFormat::Q4_K => {
            q4_k_kernel::launch(c, count, dim, x, wa, o, n_tok, stride32, at32, cols, u, t)
        }
        QFormat::Q6_K => {
            q6_k_kernel::launch(c, count, dim, x, wa, o, n_tok, stride32, at32, cols, u, t)
        }
    }
    Ok(())
}

/// A tile's zeroed sums.
#[cube]
fn tile_acc(#[comptime] tile: usize) -> Array<f32> {
    let mut acc = Array::<f32>::new(tile);
    #[unroll]
    for j in 0..tile {
        acc[j] = 0.0f32;
    }
    acc
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

/// Sums the row's units' shares and stores each token's total at its
/// row `at + r` of `out` (rows of `stride`).
#[cube]
fn store_rows(
    acc: &Array<f32>,
    out: &mut [f32],
    r: usize,
    rows: usize,
    t0: usize,
    n: usize,
    stride: usize,
    at: usize,
    #[comptime] units: usize,
    #[comptime] tile: usize,
) {
    let unit = UNIT_POS_X as usize % units;
    let mut sh = Shared::<[f32]>::new_slice(units * MATMUL_ROWS);
    #[unroll]
    for j in 0..tile {
        let total = segment_reduce(&mut sh, acc[j], UNIT_POS_X as usize, units, false);
        if r < rows && unit == 0 && t0 + j < n {
            out[(t0 + j) * stride + at + r] = total;
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

#[cube(launch, create_dummy_kernel)]
pub(super) fn q4_1_kernel(
    x: &[f32],
    w: &[u32],
    out: &mut [f32],
    n_tok: u32,
    stride: u32,
    at: u32,
    #[comptime] cols: usize,
    #[comptime] units: usize,
    #[comptime] tile: usize,
) {
    // 5 words: f16 scale and f16 min, then 16 bytes whose low nibbles are
    // elements 0..16 and high nibbles 16..32. Four units share a block,
    // each taking one word of its nibbles (elements 4q..4q+4 and
    // 16+4q..16+4q+4).
    let nb = cols / 32;
    let rows = w.len() / (nb * 5);
    let r = matmul_row(rows);
    let t0 = CUBE_POS_Z as usize * tile;
    let n = n_tok as usize;
    let unit = UNIT_POS_X as usize % units;
    let mut acc = tile_acc(tile);
    if r < rows {
        let q = unit % 4;
        let per_pass = units / 4;
        for i in 0..nb.div_ceil(per_pass) {
            let b = i * per_pass + unit / 4;
            if b < nb {
                let at = (r * nb + b) * 5;
                let dm = w[at];
                let d = half_to_f32(dm & 0xffff);
                let m = half_to_f32(dm >> 16);
                let word = w[at + 1 + q];
                let x0 = b * 32 + q * 4;
                for byte in 0..4usize {
                    let v = (word >> (byte as u32 * 8)) & 0xff;
                    let lo = d * (v & 0xf) as f32 + m;
                    let hi = d * (v >> 4) as f32 + m;
                    #[unroll]
                    for j in 0..tile {
                        if t0 + j < n {
                            let xb = (t0 + j) * cols + x0 + byte;
                            acc[j] += lo * x[xb];
                            acc[j] += hi * x[xb + 16];
                        }
                    }
                }
            }
        }
    }
    store_rows(
        &acc,
        out,
        r,
        rows,
        t0,
        n,
        stride as usize,
        at as usize,
        units,
        tile,
    );
}

#[cube(launch, create_dummy_kernel)]
pub(super) fn q5_0_kernel(
    x: &[f32],
    w: &[u32],
    out: &mut [f32],
    n_tok: u32,
    stride: u32,
    at: u32,
    #[comptime] cols: usize,
    #[comptime] units: usize,
    #[comptime] tile: usize,
) {
    // 6 words: the f16 scale, the 32 high bits, then 16 bytes of low
    // nibbles laid as Q4_1's; a value is (nibble | high << 4) - 16 times
    // the scale. Four units share a block, as in Q4_1.
    let nb = cols / 32;
    let rows = w.len() / (nb * 6);
    let r = matmul_row(rows);
    let t0 = CUBE_POS_Z as usize * tile;
    let n = n_tok as usize;
    let unit = UNIT_POS_X as usize % units;
    let mut acc = tile_acc(tile);
    if r < rows {
        let q = unit % 4;
        let per_pass = units / 4;
        for i in 0..nb.div_ceil(per_pass) {
            let b = i * per_pass + unit / 4;
            if b < nb {
                let at = (r * nb + b) * 6;
                let d = half_to_f32(w[at] & 0xffff);
                let qh = w[at + 1];
                let word = w[at + 2 + q];
                for byte in 0..4usize {
                    let e = q * 4 + byte;
                    let v = (word >> (byte as u32 * 8)) & 0xff;
                    let h0 = (qh >> e as u32) & 1;
                    let h1 = (qh >> (e as u32 + 16)) & 1;
                    let lo = d * (((v & 0xf) | (h0 << 4)) as f32 - 16.0f32);
                    let hi = d * (((v >> 4) | (h1 << 4)) as f32 - 16.0f32);
                    let c = b * 32 + e;
                    accumulate(&mut acc, x, lo, c, t0, n, cols, tile);
                    accumulate(&mut acc, x, hi, c + 16, t0, n, cols, tile);
                }
            }
        }
    }
    store_rows(
        &acc,
        out,
        r,
        rows,
        t0,
        n,
        stride as usize,
        at as usize,
        units,
        tile,
    );
}

#[cube(launch, create_dummy_kernel)]
pub(super) fn q8_0_kernel(
    x: &[f32],
    w: &[u32],
    out: &mut [f32],
    n_tok: u32,
    stride: u32,
    at: u32,
    #[comptime] cols: usize,
    #[comptime] units: usize,
    #[comptime] tile: usize,
) {
    // 9 words: the f16 scale, then 32 signed bytes. Eight units share a
    // block, a word each.
    let nb = cols / 32;
    let rows = w.len() / (nb * 9);
    let r = matmul_row(rows);
    let t0 = CUBE_POS_Z as usize * tile;
    let n = n_tok as usize;
    let unit = UNIT_POS_X as usize % units;
    let mut acc = tile_acc(tile);
    if r < rows {
        let q = unit % 8;
        let per_pass = units / 8;
        for i in 0..nb.div_ceil(per_pass) {
            let b = i * per_pass + unit / 8;
            if b < nb {
                let at = (r * nb + b) * 9;
                let d = half_to_f32(w[at] & 0xffff);
                let word = w[at + 1 + q];
                for byte in 0..4usize {
                    let v = signed((word >> (byte as u32 * 8)) & 0xff);
                    accumulate(&mut acc, x, d * v, b * 32 + q * 4 + byte, t0, n, cols, tile);
                }
            }
        }
    }
    store_rows(
        &acc,
        out,
        r,
        rows,
        t0,
        n,
        stride as usize,
        at as usize,
        units,
        tile,
    );
}

#[cube(launch, create_dummy_kernel)]
pub(super) fn q4_k_kernel(
    x: &[f32],
    w: &[u32],
    out: &mut [f32],
    n_tok: u32,
    stride: u32,
    at: u32,
    #[comptime] cols: usize,
    #[comptime] units: usize,
    #[comptime] tile: usize,
) {
    // 36 words per 256 values: f16 scale and f16 min-scale, 12 bytes of
    // 6-bit sub-block scales and mins, then 4 groups of 32 bytes whose low
    // nibbles are values 64g..64g+32 (sub-block 2g) and high nibbles
    // 64g+32..64g+64 (sub-block 2g+1). 32 units share a block, a word
    // each: unit u has group u / 8, values 4 (u % 8).. of both halves.
    let nb = cols / 256;
    let rows = w.len() / (nb * 36);
    let r = matmul_row(rows);
    let t0 = CUBE_POS_Z as usize * tile;
    let n = n_tok as usize;
    let unit = UNIT_POS_X as usize % units;
    let mut acc = tile_acc(tile);
    if r < rows {
        let u = unit % 32;
        let g = u / 8;
        let l0 = (u % 8) * 4;
        let per_pass = units / 32;
        for i in 0..nb.div_ceil(per_pass) {
            let b = i * per_pass + unit / 32;
            if b < nb {
                let at = (r * nb + b) * 36;
                let dm = w[at];
                let d = half_to_f32(dm & 0xffff);
                let dmin = half_to_f32(dm >> 16);
                // Sub-blocks 2g and 2g + 1: 6-bit scale and min each,
                // the last four split across two bytes.
                let s = at + 1;
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
                let word = w[at + 4 + u];
                let c0 = b * 256 + g * 64 + l0;
                for byte in 0..4usize {
                    let v = (word >> (byte as u32 * 8)) & 0xff;
                    let lo = d1 * (v & 0xf) as f32 - m1;
                    let hi = d2 * (v >> 4) as f32 - m2;
                    accumulate(&mut acc, x, lo, c0 + byte, t0, n, cols, tile);
                    accumulate(&mut acc, x, hi, c0 + 32 + byte, t0, n, cols, tile);
                }
            }
        }
    }
    store_rows(
        &acc,
        out,
        r,
        rows,
        t0,
        n,
        stride as usize,
        at as usize,
        units,
        tile,
    );
}

#[cube(launch, create_dummy_kernel)]
pub(super) fn q6_k_kernel(
    x: &[f32],
    w: &[u32],
    out: &mut [f32],
    n_tok: u32,
    stride: u32,
    at: u32,
    #[comptime] cols: usize,
    #[comptime] units: usize,
    #[comptime] tile: usize,
) {
    // 53 words per 256 values: 128 bytes of low nibbles (ql), 64 of high
    // bit pairs (qh), 16 signed sub-block scales, the f16 scale, 2 bytes
    // of padding. Half h (values 128h..) reads ql[64h..], qh[32h..]: for
    // l in 0..32, ql[l]'s nibbles are values l and l + 64, ql[l + 32]'s
    // values l + 32 and l + 96, their high bits in qh[l] (bits 0-1, 4-5
    // and 2-3, 6-7); value v's scale is the half's scale (v % 128) / 16.
    // 32 units share a block: unit u has half u / 16, ql part (u / 8) % 2,
    // and l = 4 (u % 8)..+4.
    let nb = cols / 256;
    let rows = w.len() / (nb * 53);
    let r = matmul_row(rows);
    let t0 = CUBE_POS_Z as usize * tile;
    let n = n_tok as usize;
    let unit = UNIT_POS_X as usize % units;
    let mut acc = tile_acc(tile);
    if r < rows {
        let u = unit % 32;
        let h = u / 16;
        let part = (u / 8) % 2;
        let lw = u % 8;
        let per_pass = units / 32;
        for i in 0..nb.div_ceil(per_pass) {
            let b = i * per_pass + unit / 32;
            if b < nb {
                let at = (r * nb + b) * 53;
                let d = half_to_f32(w[at + 52] & 0xffff);
                let ql = w[at + h * 16 + part * 8 + lw];
                let qh = w[at + 32 + h * 8 + lw];
                // The four l share a scale (16 | 4 lw).
                let is = lw / 4;
                let sc = at + 48;
                let d_lo = d * signed(byte_at(w, sc, 8 * h + is + 2 * part));
                let d_hi = d * signed(byte_at(w, sc, 8 * h + is + 2 * part + 4));
                let c0 = b * 256 + h * 128 + part * 32 + lw * 4;
                for byte in 0..4usize {
                    let shift = byte as u32 * 8;
                    let v = (ql >> shift) & 0xff;
                    let hb = (qh >> shift) & 0xff;
                    let q_lo = (v & 0xf) | (((hb >> (2 * part as u32)) & 3) << 4);
                    let q_hi = (v >> 4) | (((hb >> (4 + 2 * part as u32)) & 3) << 4);
                    let lo = d_lo * (q_lo as f32 - 32.0f32);
                    let hi = d_hi * (q_hi as f32 - 32.0f32);
                    accumulate(&mut acc, x, lo, c0 + byte, t0, n, cols, tile);
                    accumulate(&mut acc, x, hi, c0 + 64 + byte, t0, n, cols, tile);
                }
            }
        }
    }
    store_rows(
        &acc,
        out,
        r,
        rows,
        t0,
        n,
        stride as usize,
        at as usize,
        units,
        tile,
    );
}
