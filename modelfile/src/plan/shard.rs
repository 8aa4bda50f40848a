//! How a model splits over tensor-parallel ranks, for every executor: the
//! CPU engine's shards, the GPU's ranks and dKV's head-slice transfers all
//! read one [`ShardPlan`], so a `--tp` one accepts the others accept.
//!
//! Ranks hold contiguous runs of query heads, KV heads (with their Q, K
//! and V rows), vocabulary rows and, under a mixture of experts, whole
//! experts. The attention output and FFN down projections (row-parallel:
//! their input columns are split) are cut into one column segment per KV
//! head at every degree, TP=1 included, each segment whole blocks of the
//! stored format; a rank holds a contiguous run of segments, and an
//! executor that sums the segments in order computes bitwise what the
//! whole model computes.
//!
//! The one rule: `world` ranks divide the query heads, the KV heads, the
//! vocabulary and the experts, and the row-parallel projections cut into a
//! whole-block segment per KV head (see [`segments`]).

use std::ops::Range;

use crate::config::ModelConfig;
use crate::error::ModelError;

/// Smallest column block a segment may be cut in: the GPU reads
/// unquantised rows 8 values at a time (quantised rows come in blocks of
/// 32 or 256 anyway).
pub const MIN_COLUMN_BLOCK: usize = 8;

/// Block lengths (values per block, `GgmlType::block_len`) of the stored
/// row-parallel weights, the coarsest over the layers (block lengths
/// divide each other).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoredBlocks {
    pub attn_output: usize,
    /// 1 for a mixture of experts (experts are not cut).
    pub ffn_down: usize,
}

/// A model's split over `world` ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardPlan {
    pub world: usize,
    /// Column segments every row-parallel projection is summed over, in
    /// order, the same at every degree.
    pub segments: usize,
    /// `segments + 1` offsets into the attention output's columns.
    pub attn_bounds: Vec<usize>,
    /// `segments + 1` offsets into the down projection's columns (the FFN
    /// units), cut on its blocks as evenly as they allow; a mixture of
    /// experts' are equal cuts, unused.
    pub ffn_bounds: Vec<usize>,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    vocab: usize,
    experts: usize,
}

/// What rank `rank` of a [`ShardPlan`] holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankShare {
    pub rank: usize,
    /// Query heads and KV heads (indices into the whole model's).
    pub heads: Range<usize>,
    pub kv_heads: Range<usize>,
    /// Rows of Q's projection (its heads' rows), and of K's and V's.
    pub q_rows: Range<usize>,
    pub kv_rows: Range<usize>,
    /// Vocabulary rows of the embeddings and the head.
    pub vocab: Range<usize>,
    /// Row-parallel segments, and the FFN units they cover (every unit of
    /// a mixture of experts, whose experts are not cut).
    pub segments: Range<usize>,
    pub ffn: Range<usize>,
    /// Whole experts (none for a dense model).
    pub experts: Range<usize>,
}

/// How many column segments the row-parallel projections of `c` are cut
/// into: one per KV head (the finest split tensor parallelism uses) when
/// each attention-output segment is whole blocks and the FFN has a block
/// per segment; otherwise 1, and no tensor parallelism.
pub fn segments(c: &ModelConfig, blocks: StoredBlocks) -> usize {
    let g = c.n_kv_heads;
    let block = |b: usize| b.max(MIN_COLUMN_BLOCK);
    let per_head =
        c.q_dim().is_multiple_of(g) && (c.q_dim() / g).is_multiple_of(block(blocks.attn_output));
    let ffn_block = block(blocks.ffn_down);
    let enough =
        c.moe.is_some() || (c.ffn_dim.is_multiple_of(ffn_block) && c.ffn_dim / ffn_block >= g);
    if g > 1 && per_head && enough { g } else { 1 }
}

impl ShardPlan {
    /// The split of `c` over `world` ranks, or why it cannot be split so.
    pub fn new(
        c: &ModelConfig,
        world: usize,
        blocks: StoredBlocks,
    ) -> Result<ShardPlan, ModelError> {
        let segments = segments(c, blocks);
        let experts = c.moe.as_ref().map_or(0, |m| m.n_experts);
        let refuse = |why: String| {
            Err(ModelError::InvalidConfig(format!(
                "{world} tensor-parallel ranks: {why}"
            )))
        };
        let mut must_divide = vec![
            ("attention heads", c.n_heads),
            ("KV heads", c.n_kv_heads),
            ("vocabulary", c.vocab_size),
        ];
        if c.moe.is_some() {
            must_divide.push(("experts", experts));
        }
        for (what, n) in must_divide {
            if world == 0 || !n.is_multiple_of(world) {
                return refuse(format!("{world} does not divide the {what} ({n})"));
            }
        }
        if world > 1 && segments != c.n_kv_heads {
            return refuse(format!(
                "the attention output ({} columns) and FFN ({} units) do not cut into a \
                 segment of whole {MIN_COLUMN_BLOCK}+-value blocks per KV head ({})",
                c.q_dim(),
                c.ffn_dim,
                c.n_kv_heads
            ));
        }
        let ffn_block = blocks.ffn_down.max(MIN_COLUMN_BLOCK);
        Ok(ShardPlan {
            world,
            segments,
            attn_bounds: equal_bounds(c.q_dim(), segments),
            ffn_bounds: match c.moe {
                Some(_) => equal_bounds(c.ffn_dim, segments),
                None => block_bounds(c.ffn_dim, segments, ffn_block),
            },
            heads: c.n_heads,
            kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
            vocab: c.vocab_size,
            experts,
        })
    }

    /// What rank `rank` holds; `None` past the last rank.
    pub fn rank(&self, rank: usize) -> Option<RankShare> {
        if rank >= self.world {
            return None;
        }
        let part = |n: usize| n / self.world * rank..n / self.world * (rank + 1);
        let (heads, kv_heads) = (part(self.heads), part(self.kv_heads));
        let rows = |h: &Range<usize>| h.start * self.head_dim..h.end * self.head_dim;
        let segments = part(self.segments);
        let dense = self.experts == 0;
        Some(RankShare {
            rank,
            q_rows: rows(&heads),
            kv_rows: rows(&kv_heads),
            heads,
            kv_heads,
            vocab: part(self.vocab),
            ffn: match dense {
                true => self.ffn_bounds[segments.start]..self.ffn_bounds[segments.end],
                false => 0..self.ffn_bounds[self.segments],
            },
            segments,
            experts: part(self.experts),
        })
    }
}

/// `groups + 1` offsets cutting `cols` columns into `groups` equal segments.
pub fn equal_bounds(cols: usize, groups: usize) -> Vec<usize> {
    (0..=groups).map(|k| k * cols / groups.max(1)).collect()
}

/// `groups + 1` offsets cutting `cols` columns into `groups` segments of
/// whole `block`-column blocks, as even as the blocks allow (Qwen2.5-0.5B's
/// FFN is 19 blocks of 256: 9 + 10 for two segments).
pub fn block_bounds(cols: usize, groups: usize, block: usize) -> Vec<usize> {
    let blocks = cols / block.max(1);
    (0..=groups)
        .map(|k| {
            if k == groups {
                cols
            } else {
                k * blocks / groups * block
            }
        })
        .collect()
}

/// KV heads one rank of a source group holds that one rank of a
/// destination group holds too (a prefill node's ranks writing into a
/// decode node's).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeadOverlap {
    pub src_rank: usize,
    pub dst_rank: usize,
    /// The heads, as the source rank numbers its own.
    pub src_heads: Range<u32>,
    /// Where the first of them is among the destination rank's heads.
    pub dst_first: u32,
}

/// Every non-empty overlap of `kv_heads` KV heads split over `src_world`
/// ranks (contiguous runs, as [`ShardPlan::rank`] gives them) with the same
/// heads split over `dst_world`, source-major; `None` when either group
/// does not divide the heads.
pub fn kv_head_overlaps(
    kv_heads: u32,
    src_world: usize,
    dst_world: usize,
) -> Option<Vec<HeadOverlap>> {
    let per = |world: usize| {
        let w = u32::try_from(world).ok().filter(|&w| w > 0)?;
        kv_heads.is_multiple_of(w).then(|| kv_heads / w)
    };
    let (hs, hd) = (per(src_world)?, per(dst_world)?);
    let mut out = Vec::new();
    for si in 0..src_world {
        let s = si as u32 * hs..(si as u32 + 1) * hs;
        for di in 0..dst_world {
            let d = di as u32 * hd..(di as u32 + 1) * hd;
            let (lo, hi) = (s.start.max(d.start), s.end.min(d.end));
            if lo < hi {
                out.push(HeadOverlap {
                    src_rank: si,
                    dst_rank: di,
                    src_heads: lo - s.start..hi - s.start,
                    dst_first: lo - d.start,
                });
            }
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn smol() -> ModelConfig {
        ModelConfig::from_hf_json(
            r#"{"architectures":["LlamaForCausalLM"],"hidden_size":576,
            "intermediate_size":1536,"num_attention_heads":9,"num_hidden_layers":30,
            "num_key_value_heads":3,"vocab_size":49152,"rms_norm_eps":1e-5,
            "rope_theta":100000.0,"max_position_embeddings":8192,"rope_scaling":null}"#,
        )
        .expect("valid")
    }

    const Q4_1: StoredBlocks = StoredBlocks {
        attn_output: 32,
        ffn_down: 32,
    };

    #[test]
    fn segment_bounds_cut_on_blocks_as_evenly_as_they_allow() {
        assert_eq!(equal_bounds(896, 2), [0, 448, 896]);
        assert_eq!(equal_bounds(576, 1), [0, 576]);
        // Qwen2.5-0.5B's FFN: 4864 columns, 19 blocks of 256.
        assert_eq!(block_bounds(4864, 2, 256), [0, 2304, 4864]);
        assert_eq!(block_bounds(1536, 3, 32), [0, 512, 1024, 1536]);
        assert_eq!(block_bounds(4864, 1, 256), [0, 4864]);
        for (cols, groups, block) in [(4864, 2, 256), (2048, 4, 256), (1536, 3, 32), (96, 3, 32)] {
            let b = block_bounds(cols, groups, block);
            assert_eq!(b.len(), groups + 1);
            assert!(
                b.windows(2)
                    .all(|w| w[0] < w[1] && (w[1] - w[0]) % block == 0)
            );
        }
    }

    #[test]
    fn smollm2_splits_three_ways_and_no_other() {
        let c = smol();
        let plan = ShardPlan::new(&c, 3, Q4_1).expect("3 ranks");
        assert_eq!(plan.segments, 3);
        let r1 = plan.rank(1).expect("rank 1");
        assert_eq!((r1.heads, r1.kv_heads), (3..6, 1..2));
        assert_eq!((r1.q_rows, r1.kv_rows), (192..384, 64..128));
        assert_eq!(
            (r1.vocab, r1.ffn, r1.segments),
            (16384..32768, 512..1024, 1..2)
        );
        assert_eq!(plan.rank(3), None);
        let e = ShardPlan::new(&c, 2, Q4_1)
            .expect_err("9 heads")
            .to_string();
        assert!(
            e.contains("2 tensor-parallel ranks: 2 does not divide the attention heads (9)"),
            "{e}"
        );
        assert!(ShardPlan::new(&c, 0, Q4_1).is_err());
        assert_eq!(ShardPlan::new(&c, 1, Q4_1).expect("whole").segments, 3);
        // An FFN with fewer 256-blocks than KV heads has one segment: no split.
        let mut narrow = c.clone();
        narrow.ffn_dim = 512;
        let k = StoredBlocks {
            attn_output: 32,
            ffn_down: 256,
        };
        assert_eq!(segments(&narrow, k), 1);
        let e = ShardPlan::new(&narrow, 3, k)
            .expect_err("2 blocks, 3 heads")
            .to_string();
        assert!(e.contains("per KV head"), "{e}");
        // Unquantised weights still cut in blocks of 8 (the GPU's reads).
        let mut odd = c;
        odd.n_heads = 3;
        odd.head_dim = 4;
        let f32s = StoredBlocks {
            attn_output: 1,
            ffn_down: 1,
        };
        assert_eq!(segments(&odd, f32s), 1);
        assert!(ShardPlan::new(&odd, 3, f32s).is_err());
    }

    #[test]
    fn head_overlaps_map_every_head_once() {
        // 3 KV heads on 3 ranks into 1: each source writes its head at its index.
        let o = kv_head_overlaps(3, 3, 1).expect("divides");
        let got: Vec<_> = o
            .iter()
            .map(|h| (h.src_rank, h.dst_rank, h.src_heads.clone(), h.dst_first))
            .collect();
        assert_eq!(got, [(0, 0, 0..1, 0), (1, 0, 0..1, 1), (2, 0, 0..1, 2)]);
        // 4 heads on 2 ranks into 4: each source rank feeds two.
        let o = kv_head_overlaps(4, 2, 4).expect("divides");
        let got: Vec<_> = o
            .iter()
            .map(|h| (h.src_rank, h.dst_rank, h.src_heads.clone(), h.dst_first))
            .collect();
        assert_eq!(
            got,
            [
                (0, 0, 0..1, 0),
                (0, 1, 1..2, 0),
                (1, 2, 0..1, 0),
                (1, 3, 1..2, 0)
            ]
        );
        // 6 heads, 2 into 3: overlaps straddle rank boundaries.
        let o = kv_head_overlaps(6, 2, 3).expect("divides");
        let got: Vec<_> = o
            .iter()
            .map(|h| (h.src_rank, h.dst_rank, h.src_heads.clone(), h.dst_first))
            .collect();
        assert_eq!(
            got,
            [
                (0, 0, 0..2, 0),
                (0, 1, 2..3, 0),
                (1, 1, 0..1, 1),
                (1, 2, 1..3, 0)
            ]
        );
        // Every head lands exactly once whatever the groups.
        for (h, s, d) in [(8u32, 2, 4), (8, 4, 2), (6, 3, 2), (12, 4, 3), (5, 1, 5)] {
            let mut seen = vec![0; h as usize];
            for o in kv_head_overlaps(h, s, d).expect("divides") {
                for k in o.src_heads.clone() {
                    let global = o.src_rank as u32 * (h / s as u32) + k;
                    let at =
                        o.dst_rank as u32 * (h / d as u32) + o.dst_first + (k - o.src_heads.start);
                    assert_eq!(global, at);
                    seen[global as usize] += 1;
                }
            }
            assert!(seen.iter().all(|&n| n == 1), "{h} heads, {s} into {d}");
        }
        assert_eq!(kv_head_overlaps(3, 2, 1), None);
        assert_eq!(kv_head_overlaps(3, 1, 0), None);
    }
}
