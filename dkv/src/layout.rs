//! Block ids -> `WriteOp`s for the engine's KV block layout
//! `[block][layer][k|v][kv_head][slot][head_dim]` (f16, blocks contiguous):
//! a whole block is one range, and one layer's K (or V) for a run of heads is
//! one range, which is what a tensor-parallel source owning some heads sends.

use std::ops::Range;

use crate::{DkvError, WriteOp};

/// Byte geometry of one KV block. `layer_bytes = 2 * num_kv_heads *
/// head_slice_bytes` (K then V) and `block_bytes = num_layers * layer_bytes`;
/// `head_slice_bytes` is one head's `[slot][head_dim]` for K or V.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub block_bytes: u64,
    pub layer_bytes: u64,
    pub head_slice_bytes: u64,
    pub num_layers: u32,
    pub num_kv_heads: u32,
}

impl KvLayout {
    /// Checks that the sizes agree with each other (a layout may come from a
    /// peer's handshake).
    pub fn validate(&self) -> Result<(), DkvError> {
        let bad = |m: String| Err(DkvError::InvalidLayout(m));
        if self.head_slice_bytes == 0 || self.num_layers == 0 || self.num_kv_heads == 0 {
            return bad(format!("zero-sized layout {self:?}"));
        }
        let layer = u64::from(self.num_kv_heads)
            .checked_mul(2)
            .and_then(|x| x.checked_mul(self.head_slice_bytes));
        if layer != Some(self.layer_bytes) {
            return bad(format!(
                "layer_bytes {} != 2 * {} heads * {} head_slice_bytes",
                self.layer_bytes, self.num_kv_heads, self.head_slice_bytes
            ));
        }
        if u64::from(self.num_layers).checked_mul(self.layer_bytes) != Some(self.block_bytes) {
            return bad(format!(
                "block_bytes {} != {} layers * {} layer_bytes",
                self.block_bytes, self.num_layers, self.layer_bytes
            ));
        }
        Ok(())
    }

    /// Whole blocks `src_blocks[i] -> dst_blocks[i]`; runs that are
    /// consecutive on both sides become one op.
    pub fn block_ops(
        &self,
        src_blocks: &[u32],
        dst_blocks: &[u32],
    ) -> Result<Vec<WriteOp>, DkvError> {
        self.validate()?;
        same_len(src_blocks, dst_blocks)?;
        let mut ops = Vec::with_capacity(src_blocks.len());
        for (&s, &d) in src_blocks.iter().zip(dst_blocks) {
            push_merged(
                &mut ops,
                WriteOp {
                    local_offset: offset(s, self.block_bytes)?,
                    remote_offset: offset(d, self.block_bytes)?,
                    len: self.block_bytes,
                },
            );
        }
        Ok(ops)
    }

    /// Head slices when both sides use this layout: heads `src_heads` of each
    /// source block go to heads starting at `dst_head_offset` of the
    /// destination block. See [`KvLayout::head_slice_ops_to`].
    pub fn head_slice_ops(
        &self,
        src_blocks: &[u32],
        dst_blocks: &[u32],
        src_heads: Range<u32>,
        dst_head_offset: u32,
    ) -> Result<Vec<WriteOp>, DkvError> {
        self.head_slice_ops_to(self, src_blocks, dst_blocks, src_heads, dst_head_offset)
    }

    /// Head slices from blocks in this (source) layout into blocks of `dst`,
    /// which may hold a different number of heads (prefill TP != decode TP):
    /// per block, layer and K|V, heads `src_heads` of the source go to heads
    /// `dst_head_offset..dst_head_offset + src_heads.len()` of the
    /// destination. Adjacent ranges are merged (all heads -> whole layers or
    /// blocks).
    pub fn head_slice_ops_to(
        &self,
        dst: &KvLayout,
        src_blocks: &[u32],
        dst_blocks: &[u32],
        src_heads: Range<u32>,
        dst_head_offset: u32,
    ) -> Result<Vec<WriteOp>, DkvError> {
        self.validate()?;
        dst.validate()?;
        same_len(src_blocks, dst_blocks)?;
        if self.num_layers != dst.num_layers || self.head_slice_bytes != dst.head_slice_bytes {
            return Err(DkvError::InvalidLayout(format!(
                "source ({} layers, {} B per head slice) and destination ({} layers, {} B) differ",
                self.num_layers, self.head_slice_bytes, dst.num_layers, dst.head_slice_bytes
            )));
        }
        if src_heads.start >= src_heads.end || src_heads.end > self.num_kv_heads {
            return Err(DkvError::InvalidLayout(format!(
                "source heads {src_heads:?} not a non-empty range within {} heads",
                self.num_kv_heads
            )));
        }
        let n = src_heads.end - src_heads.start;
        if dst_head_offset
            .checked_add(n)
            .is_none_or(|end| end > dst.num_kv_heads)
        {
            return Err(DkvError::InvalidLayout(format!(
                "destination heads {dst_head_offset}..+{n} exceed {} heads",
                dst.num_kv_heads
            )));
        }
        // All products below are bounded by the validated block_bytes.
        let len = u64::from(n) * self.head_slice_bytes;
        let s_head = u64::from(src_heads.start) * self.head_slice_bytes;
        let d_head = u64::from(dst_head_offset) * dst.head_slice_bytes;
        let s_kv = u64::from(self.num_kv_heads) * self.head_slice_bytes;
        let d_kv = u64::from(dst.num_kv_heads) * dst.head_slice_bytes;
        let mut ops = Vec::with_capacity(src_blocks.len() * self.num_layers as usize * 2);
        for (&s, &d) in src_blocks.iter().zip(dst_blocks) {
            let s_block = offset(s, self.block_bytes)?;
            let d_block = offset(d, dst.block_bytes)?;
            for layer in 0..u64::from(self.num_layers) {
                for kv in 0..2 {
                    let local = s_block + layer * self.layer_bytes + kv * s_kv + s_head;
                    let remote = d_block + layer * dst.layer_bytes + kv * d_kv + d_head;
                    push_merged(
                        &mut ops,
                        WriteOp {
                            local_offset: local,
                            remote_offset: remote,
                            len,
                        },
                    );
                }
            }
        }
        Ok(ops)
    }
}

fn same_len(src: &[u32], dst: &[u32]) -> Result<(), DkvError> {
    if src.len() != dst.len() {
        return Err(DkvError::InvalidLayout(format!(
            "{} source blocks but {} destination blocks",
            src.len(),
            dst.len()
        )));
    }
    Ok(())
}

/// Byte offset of a block, leaving room for one more block after it.
fn offset(block: u32, block_bytes: u64) -> Result<u64, DkvError> {
    u64::from(block)
        .checked_mul(block_bytes)
        .filter(|o| o.checked_add(block_bytes).is_some())
        .ok_or_else(|| DkvError::OutOfBounds(format!("block {block} x {block_bytes} B overflows")))
}

/// Appends `op`, extending the previous op when both sides continue it.
pub(crate) fn push_merged(ops: &mut Vec<WriteOp>, op: WriteOp) {
    if let Some(last) = ops.last_mut()
        && last.local_offset.checked_add(last.len) == Some(op.local_offset)
        && last.remote_offset.checked_add(last.len) == Some(op.remote_offset)
        && let Some(len) = last.len.checked_add(op.len)
    {
        last.len = len;
        return;
    }
    ops.push(op);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 3 layers, 4 heads, 16 B per head slice.
    fn layout(heads: u32) -> KvLayout {
        let hs = 16;
        let layer = 2 * u64::from(heads) * hs;
        KvLayout {
            block_bytes: 3 * layer,
            layer_bytes: layer,
            head_slice_bytes: hs,
            num_layers: 3,
            num_kv_heads: heads,
        }
    }

    fn op(l: u64, r: u64, len: u64) -> WriteOp {
        WriteOp {
            local_offset: l,
            remote_offset: r,
            len,
        }
    }

    #[test]
    fn block_ops_merge_runs_on_both_sides() {
        let l = layout(4);
        let b = l.block_bytes;
        let ops = l
            .block_ops(&[1, 2, 3, 7, 8, 10], &[5, 6, 9, 10, 11, 12])
            .expect("valid ops");
        // 1,2 -> 5,6 merge; 3 -> 9 breaks on the destination side; 7,8 ->
        // 10,11 merge; 10 -> 12 breaks on the source side.
        assert_eq!(
            ops,
            vec![
                op(b, 5 * b, 2 * b),
                op(3 * b, 9 * b, b),
                op(7 * b, 10 * b, 2 * b),
                op(10 * b, 12 * b, b),
            ]
        );
        assert_eq!(l.block_ops(&[], &[]).ok(), Some(vec![]));
        // Merges only when consecutive on both sides.
        assert_eq!(l.block_ops(&[0, 1], &[1, 0]).map(|o| o.len()).ok(), Some(2));
        assert_eq!(l.block_ops(&[4, 4], &[0, 1]).map(|o| o.len()).ok(), Some(2));
    }

    #[test]
    fn block_ops_reject_bad_input() {
        let l = layout(4);
        assert!(matches!(
            l.block_ops(&[1, 2], &[1]),
            Err(DkvError::InvalidLayout(_))
        ));
        let huge = KvLayout {
            block_bytes: 1 << 40,
            layer_bytes: 1 << 40,
            head_slice_bytes: 1 << 39,
            num_layers: 1,
            num_kv_heads: 1,
        };
        assert!(matches!(
            huge.block_ops(&[u32::MAX], &[0]),
            Err(DkvError::OutOfBounds(_))
        ));
        let mut bad = l;
        bad.layer_bytes += 1;
        assert!(matches!(
            bad.block_ops(&[0], &[0]),
            Err(DkvError::InvalidLayout(_))
        ));
        bad = l;
        bad.num_layers = 0;
        assert!(bad.validate().is_err());
    }

    #[test]
    fn head_slices_per_layer_and_kv() {
        let l = layout(4);
        let hs = l.head_slice_bytes;
        // Heads 1..3 of block 2 into heads 0..2 of block 0, same layout.
        let ops = l.head_slice_ops(&[2], &[0], 1..3, 0).expect("valid ops");
        assert_eq!(ops.len(), 3 * 2);
        let b = l.block_bytes;
        for layer in 0..3u64 {
            for kv in 0..2u64 {
                let i = (layer * 2 + kv) as usize;
                let base = layer * l.layer_bytes + kv * 4 * hs;
                assert_eq!(
                    ops[i],
                    op(2 * b + base + hs, base, 2 * hs),
                    "layer {layer} kv {kv}"
                );
            }
        }
        // All heads of consecutive blocks collapse to one op.
        let all = l
            .head_slice_ops(&[3, 4], &[7, 8], 0..4, 0)
            .expect("valid ops");
        assert_eq!(all, vec![op(3 * b, 7 * b, 2 * b)]);
    }

    #[test]
    fn head_slices_between_tp_shapes() {
        // A TP=2 prefill rank holds 2 of 4 heads; decode (TP=1) holds all 4.
        let src = layout(2);
        let dst = layout(4);
        let hs = src.head_slice_bytes;
        let ops = src
            .head_slice_ops_to(&dst, &[1], &[5], 0..2, 2)
            .expect("valid ops");
        assert_eq!(ops.len(), 6);
        for layer in 0..3u64 {
            for kv in 0..2u64 {
                let i = (layer * 2 + kv) as usize;
                let local = src.block_bytes + layer * src.layer_bytes + kv * 2 * hs;
                let remote = 5 * dst.block_bytes + layer * dst.layer_bytes + kv * 4 * hs + 2 * hs;
                assert_eq!(ops[i], op(local, remote, 2 * hs));
            }
        }
        // Heads past either side, empty ranges, mismatched geometry.
        assert!(src.head_slice_ops_to(&dst, &[1], &[5], 0..3, 0).is_err());
        assert!(src.head_slice_ops_to(&dst, &[1], &[5], 0..2, 3).is_err());
        assert!(src.head_slice_ops_to(&dst, &[1], &[5], 1..1, 0).is_err());
        assert!(
            src.head_slice_ops_to(&dst, &[1], &[5], 0..2, u32::MAX)
                .is_err()
        );
        let mut other = dst;
        other.head_slice_bytes = 8;
        other.layer_bytes = 2 * 4 * 8;
        other.block_bytes = 3 * other.layer_bytes;
        assert!(src.head_slice_ops_to(&other, &[1], &[5], 0..2, 0).is_err());
        assert!(src.head_slice_ops_to(&dst, &[1, 2], &[5], 0..2, 0).is_err());
    }
}
