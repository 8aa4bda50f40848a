//! Weight tensors as the loaders hand them to the model: matrices kept in
//! their stored (possibly quantized) form, repacked for the batched kernel
//! where there is one, and small tensors (norms) converted to `f32`. A leaf
//! module shared by the dense layers (`model`), the experts (`moe`) and both
//! loaders.

use std::ops::Range;
use std::sync::Arc;

use tandem_kernels::{GgmlType, PackedMatrix, QMatrix};
use tandem_modelfile::storage::Backing;

use crate::error::{ModelError, RequestError};

/// A weight matrix held in its stored (possibly quantized) form.
#[derive(Debug, Clone)]
pub struct Weight {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    backing: Arc<Backing>,
    range: Range<usize>,
    /// The same values repacked for the batched kernel, where this CPU and
    /// type have one (see `tandem_kernels::PackedMatrix`).
    packed: Option<Arc<PackedMatrix>>,
}

impl Weight {
    /// Checks that `range` of `backing` holds exactly `rows x cols` values of `ty`.
    pub fn new(
        name: &str,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        backing: Arc<Backing>,
        range: Range<usize>,
    ) -> Result<Self, ModelError> {
        let bad = |problem: String| ModelError::BadTensor {
            name: name.to_string(),
            problem,
        };
        let row_bytes = ty
            .row_bytes(cols)
            .ok_or_else(|| bad(format!("{cols} columns do not fit {} blocks", ty.name())))?;
        let want = row_bytes
            .checked_mul(rows)
            .ok_or_else(|| bad("size overflows".into()))?;
        if range.len() != want || range.end > backing.len() {
            return Err(bad(format!(
                "expected {want} bytes for {rows}x{cols} {}, found {} (file has {})",
                ty.name(),
                range.len(),
                backing.len()
            )));
        }
        Ok(Self {
            ty,
            rows,
            cols,
            backing,
            range,
            packed: None,
        }
        .with_packed())
    }

    /// The packed form, where this CPU and type have one.
    pub(crate) fn packed(&self) -> Option<&Arc<PackedMatrix>> {
        self.packed.as_ref()
    }

    /// Adds the packed form where there is one.
    fn with_packed(mut self) -> Self {
        self.packed = PackedMatrix::pack(&self.matrix()).map(Arc::new);
        self
    }

    /// `out[i * rows + r] = sum_k self[r, k] * x[i * cols + k]` for `i < m`.
    pub fn matmul(&self, x: &[f32], m: usize, out: &mut [f32]) -> Result<(), RequestError> {
        match &self.packed {
            Some(p) => tandem_kernels::matmul_packed(p, x, m, out)?,
            None => tandem_kernels::matmul(&self.matrix(), x, m, out)?,
        }
        Ok(())
    }

    pub fn matrix(&self) -> QMatrix<'_> {
        QMatrix {
            ty: self.ty,
            data: &self.backing[self.range.clone()],
            rows: self.rows,
            cols: self.cols,
        }
    }

    pub fn ty(&self) -> GgmlType {
        self.ty
    }

    pub fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// Rows `rows` (output features): a view of the same bytes.
    pub fn slice_rows(&self, rows: Range<usize>) -> Result<Weight, ModelError> {
        let row_bytes = self.row_bytes();
        if rows.start > rows.end || rows.end > self.rows {
            return Err(self.bad_slice(format!("rows {rows:?} of {}", self.rows)));
        }
        let start = self.range.start + rows.start * row_bytes;
        Ok(Weight {
            rows: rows.len(),
            range: start..start + rows.len() * row_bytes,
            backing: Arc::clone(&self.backing),
            packed: None,
            ..*self
        }
        .with_packed())
    }

    /// Columns `cols` (input features) of every row, copied: the range must
    /// start and end on the type's block boundaries.
    pub fn slice_cols(&self, cols: Range<usize>) -> Result<Weight, ModelError> {
        let (Some(skip), Some(take)) =
            (self.ty.row_bytes(cols.start), self.ty.row_bytes(cols.len()))
        else {
            return Err(self.bad_slice(format!(
                "columns {cols:?} do not fall on {}-element {} blocks",
                self.ty.block_len(),
                self.ty.name()
            )));
        };
        if cols.end > self.cols {
            return Err(self.bad_slice(format!("columns {cols:?} of {}", self.cols)));
        }
        let row_bytes = self.row_bytes();
        let src = &self.backing[self.range.clone()];
        let mut out = Vec::with_capacity(take * self.rows);
        for row in src.chunks_exact(row_bytes) {
            out.extend_from_slice(&row[skip..skip + take]);
        }
        let len = out.len();
        Ok(Weight {
            cols: cols.len(),
            backing: Arc::new(Backing::Owned(out)),
            range: 0..len,
            packed: None,
            ..*self
        }
        .with_packed())
    }

    fn row_bytes(&self) -> usize {
        self.range.len() / self.rows.max(1)
    }

    fn bad_slice(&self, problem: String) -> ModelError {
        ModelError::BadTensor {
            name: format!("{}x{} {}", self.rows, self.cols, self.ty.name()),
            problem: format!("cannot shard: {problem}"),
        }
    }

    /// Dequantizes one row (used for the embedding lookup).
    pub(crate) fn row_into(&self, row: usize, out: &mut [f32]) -> Result<(), RequestError> {
        let m = self.matrix();
        tandem_kernels::dequantize_row(self.ty, m.row(row), out)?;
        Ok(())
    }

    pub(crate) fn expect_shape(
        self,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<Self, ModelError> {
        if (self.rows, self.cols) != (rows, cols) {
            return Err(ModelError::BadTensor {
                name: name.to_string(),
                problem: format!(
                    "shape {}x{} (out x in), expected {rows}x{cols}",
                    self.rows, self.cols
                ),
            });
        }
        Ok(self)
    }
}

/// Packs `parts`' rows as one matrix where the packed kernel runs, and then
/// drops the parts' own packed forms.
pub(crate) fn fuse(parts: &mut [&mut Weight]) -> Option<Arc<PackedMatrix>> {
    let fused = {
        let ms: Vec<QMatrix<'_>> = parts.iter().map(|w| w.matrix()).collect();
        PackedMatrix::pack_concat(&ms).map(Arc::new)
    };
    if fused.is_some() {
        for w in parts.iter_mut() {
            w.packed = None;
        }
    }
    fused
}

/// Converts a small tensor (a norm weight) to `f32`.
pub(crate) fn to_f32(
    name: &str,
    ty: GgmlType,
    bytes: &[u8],
    n: usize,
) -> Result<Vec<f32>, ModelError> {
    let mut out = vec![0.0f32; n];
    tandem_kernels::dequantize_row(ty, bytes, &mut out).map_err(|e| ModelError::BadTensor {
        name: name.to_string(),
        problem: e.to_string(),
    })?;
    Ok(out)
}
