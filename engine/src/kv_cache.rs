//! Paged KV cache: the pool of fixed-size blocks and the per-sequence block
//! tables into it. Block ids, the refcounting allocator and
//! [`KvCacheError`] live in `block_allocator`; the ownership of blocks
//! (prefix caching, eviction) in `block_manager`.
//!
//! # Block layout
//! One block holds `block_size` token slots for every layer, both K and V,
//! every KV head, stored as `f16`, laid out
//! `[layer][k|v][kv_head][slot][head_dim]` inside the block, blocks back to back.
//! Chosen so that
//! - a whole block is one contiguous byte range (one transfer moves a block),
//! - one layer of a block is contiguous (layer-by-layer transfer as prefill
//!   finishes each layer),
//! - one KV head of one layer is contiguous (a tensor-parallel prefill rank
//!   that owns a subset of KV heads writes its head slice directly),
//! - attention for one head scans contiguous `slot x head_dim` rows.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::Arc;

use half::f16;
use half::slice::HalfFloatSliceExt;
use tandem_modelfile::config::ModelConfig;

use crate::block_manager::BlockManager;

// Defined in `block_allocator`; re-exported because `KvCache`'s API takes
// and returns them (the scheduler names them from here).
pub use crate::block_allocator::{BlockId, KvCacheError};

/// Shape of a KV cache pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvCacheConfig {
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks in the pool.
    pub num_blocks: usize,
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl KvCacheConfig {
    /// A pool of `num_blocks` blocks holding every layer and KV head of a
    /// model with this shape.
    pub fn for_model(config: &ModelConfig, block_size: usize, num_blocks: usize) -> Self {
        KvCacheConfig {
            block_size,
            num_blocks,
            n_layers: config.n_layers,
            n_kv_heads: config.n_kv_heads,
            head_dim: config.head_dim,
        }
    }

    /// `f16` elements in one (layer, k|v, head) slice of a block.
    pub fn head_slice_len(&self) -> usize {
        self.block_size * self.head_dim
    }

    /// `f16` elements in one layer of a block (K and V, all heads).
    pub fn layer_len(&self) -> usize {
        2 * self.n_kv_heads * self.head_slice_len()
    }

    /// `f16` elements in one block.
    pub fn block_len(&self) -> usize {
        self.n_layers * self.layer_len()
    }

    /// Bytes in one block.
    pub fn block_bytes(&self) -> usize {
        self.block_len() * std::mem::size_of::<f16>()
    }

    /// Number of blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }
}

/// The memory of a KV pool: one zeroed, page-aligned allocation.
///
/// It is a raw allocation rather than a `Vec` because a transfer engine
/// registers it and writes into it from outside Rust's view (a peer's KV,
/// landing where the node granted it). The scheduler's block ownership is what keeps that sound:
/// a peer writes only blocks that belong to a sequence waiting for its KV,
/// and nothing reads those blocks until the transfer has completed.
#[derive(Debug)]
pub struct KvPool {
    ptr: NonNull<f16>,
    len: usize,
    /// Our own allocation (freed on drop), or `None` for external memory.
    layout: Option<Layout>,
    /// Keeps external memory alive.
    #[allow(dead_code)]
    owner: Option<ExternalOwner>,
}

/// Whatever keeps externally provided pool memory alive.
pub type ExternalOwner = Arc<dyn std::any::Any + Send + Sync>;

/// Memory for a KV pool allocated by someone else: a transfer engine's
/// registered allocation, so that peers write it directly.
#[derive(Clone)]
pub struct ExternalMemory {
    pub ptr: *mut u8,
    pub len: usize,
    /// Keeps `ptr..ptr + len` valid for as long as the pool holds it.
    pub owner: ExternalOwner,
}

impl std::fmt::Debug for ExternalMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExternalMemory")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}

// SAFETY: plain memory handed over with its owner; see `KvPool`.
unsafe impl Send for ExternalMemory {}
unsafe impl Sync for ExternalMemory {}

// SAFETY: the pool is plain memory; access is coordinated by the scheduler
// (see the type's documentation).
unsafe impl Send for KvPool {}
unsafe impl Sync for KvPool {}

impl KvPool {
    const ALIGN: usize = 4096;

    fn new(len: usize) -> Result<Self, KvCacheError> {
        let bytes = len
            .checked_mul(std::mem::size_of::<f16>())
            .ok_or(KvCacheError::InvalidConfig("pool size overflows"))?;
        let layout = Layout::from_size_align(bytes.max(1), Self::ALIGN)
            .map_err(|_| KvCacheError::InvalidConfig("pool size overflows"))?;
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw.cast::<f16>())
            .ok_or(KvCacheError::InvalidConfig("cannot allocate the KV pool"))?;
        // Commit every page now: an allocator that maps fresh zero pages
        // would otherwise fault them in as the prefix cache first reaches
        // them, and a node's memory would creep up for hours (and first
        // use of a block would pay the fault inside a forward pass).
        for off in (0..layout.size()).step_by(Self::ALIGN) {
            // SAFETY: `off` is inside the allocation just made; the pool
            // is not shared yet.
            unsafe { std::ptr::write_volatile(raw.add(off), 0) };
        }
        Ok(Self {
            ptr,
            len,
            layout: Some(layout),
            owner: None,
        })
    }

    /// A pool of `len` elements in `mem`, which must be large enough and
    /// aligned for `f16`.
    fn external(mem: ExternalMemory, len: usize) -> Result<Self, KvCacheError> {
        let bytes = len
            .checked_mul(std::mem::size_of::<f16>())
            .ok_or(KvCacheError::InvalidConfig("pool size overflows"))?;
        if mem.len < bytes {
            return Err(KvCacheError::InvalidConfig(
                "external KV memory is smaller than the pool",
            ));
        }
        if !(mem.ptr as usize).is_multiple_of(std::mem::align_of::<f16>()) {
            return Err(KvCacheError::InvalidConfig(
                "external KV memory is not aligned for f16",
            ));
        }
        let ptr = NonNull::new(mem.ptr.cast::<f16>())
            .ok_or(KvCacheError::InvalidConfig("external KV memory is null"))?;
        Ok(Self {
            ptr,
            len,
            layout: None,
            owner: Some(mem.owner),
        })
    }

    /// Start of the pool (for registration with a transfer engine).
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr().cast()
    }

    /// Size of the pool in bytes.
    pub fn byte_len(&self) -> usize {
        self.len * std::mem::size_of::<f16>()
    }

    fn slice(&self, off: usize, len: usize) -> &[f16] {
        assert!(off.checked_add(len).is_some_and(|end| end <= self.len));
        // SAFETY: in bounds (checked above); see the type's documentation
        // for why no one writes this range concurrently.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(off), len) }
    }

    /// The bytes of `block` in a pool of `config`'s shape (a tensor-parallel
    /// peer's pool has rank 0's).
    pub fn block_bytes(&self, config: &KvCacheConfig, block: BlockId) -> &[u8] {
        let len = config.block_len();
        bytemuck::cast_slice(self.slice(block as usize * len, len))
    }

    /// [`KvPool::block_bytes`], writable: for the scheduler's thread,
    /// between steps, into blocks it owns (see the type's documentation).
    #[allow(clippy::mut_from_ref)]
    pub(crate) fn block_bytes_mut(&self, config: &KvCacheConfig, block: BlockId) -> &mut [u8] {
        let len = config.block_len();
        bytemuck::cast_slice_mut(self.slice_mut(block as usize * len, len))
    }

    #[allow(clippy::mut_from_ref)]
    fn slice_mut(&self, off: usize, len: usize) -> &mut [f16] {
        assert!(off.checked_add(len).is_some_and(|end| end <= self.len));
        // SAFETY: in bounds; only the scheduler thread that owns the cache
        // writes through here (`KvCache::write` takes `&mut self`), into
        // blocks of its own sequences.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(off), len) }
    }
}

impl Drop for KvPool {
    fn drop(&mut self) {
        if let Some(layout) = self.layout {
            // SAFETY: allocated in `new` with this layout.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr().cast(), layout) }
        }
    }
}

/// The KV storage pool plus the manager of its blocks.
#[derive(Debug)]
pub struct KvCache {
    config: KvCacheConfig,
    pool: Arc<KvPool>,
    blocks: BlockManager,
}

impl KvCache {
    /// A pool without prefix caching.
    pub fn new(config: KvCacheConfig) -> Result<Self, KvCacheError> {
        Self::with_prefix_caching(config, false)
    }

    /// A pool whose full blocks can be cached and shared across sequences.
    pub fn with_prefix_caching(config: KvCacheConfig, caching: bool) -> Result<Self, KvCacheError> {
        Self::with_memory(config, caching, None)
    }

    /// A pool in `memory` (e.g. a transfer engine's allocation), or in
    /// memory of its own when `None`.
    pub fn with_memory(
        config: KvCacheConfig,
        caching: bool,
        memory: Option<ExternalMemory>,
    ) -> Result<Self, KvCacheError> {
        if config.block_size == 0 || config.num_blocks == 0 {
            return Err(KvCacheError::InvalidConfig(
                "block_size and num_blocks must be > 0",
            ));
        }
        if config.n_layers == 0 || config.n_kv_heads == 0 || config.head_dim == 0 {
            return Err(KvCacheError::InvalidConfig(
                "layers, kv heads and head dim must be > 0",
            ));
        }
        if config.num_blocks > BlockId::MAX as usize {
            return Err(KvCacheError::InvalidConfig("too many blocks"));
        }
        let len = config
            .block_len()
            .checked_mul(config.num_blocks)
            .ok_or(KvCacheError::InvalidConfig("pool size overflows"))?;
        Ok(Self {
            config,
            pool: Arc::new(match memory {
                Some(m) => KvPool::external(m, len)?,
                None => KvPool::new(len)?,
            }),
            blocks: BlockManager::new(config.num_blocks, caching),
        })
    }

    pub fn config(&self) -> &KvCacheConfig {
        &self.config
    }

    /// The pool's memory, shared with a transfer engine that registers it.
    pub fn pool(&self) -> &Arc<KvPool> {
        &self.pool
    }

    pub fn blocks(&self) -> &BlockManager {
        &self.blocks
    }

    pub fn blocks_mut(&mut self) -> &mut BlockManager {
        &mut self.blocks
    }

    /// Grows `table` so that it can hold `tokens` tokens.
    pub fn reserve(&mut self, table: &mut Vec<BlockId>, tokens: usize) -> Result<(), KvCacheError> {
        let needed = self.config.blocks_for(tokens);
        if needed > table.len() {
            let new = self.blocks.allocate(needed - table.len())?;
            table.extend(new);
        }
        Ok(())
    }

    fn head_offset(&self, block: BlockId, layer: usize, kv: usize, head: usize) -> usize {
        let c = &self.config;
        block as usize * c.block_len()
            + layer * c.layer_len()
            + (kv * c.n_kv_heads + head) * c.head_slice_len()
    }

    /// K (kv = 0) or V (kv = 1) rows of one head of one layer of a block:
    /// `block_size x head_dim` values.
    pub fn head_slice(&self, block: BlockId, layer: usize, kv: usize, head: usize) -> &[f16] {
        let off = self.head_offset(block, layer, kv, head);
        self.pool.slice(off, self.config.head_slice_len())
    }

    /// [`KvCache::head_slice`], writable.
    pub fn head_slice_mut(
        &mut self,
        block: BlockId,
        layer: usize,
        kv: usize,
        head: usize,
    ) -> &mut [f16] {
        let off = self.head_offset(block, layer, kv, head);
        self.pool.slice_mut(off, self.config.head_slice_len())
    }

    /// Stores one token's K and V (each `n_kv_heads * head_dim` values) for a layer.
    pub fn write(&mut self, layer: usize, block: BlockId, slot: usize, k: &[f32], v: &[f32]) {
        let hd = self.config.head_dim;
        for (kv, src) in [k, v].into_iter().enumerate() {
            for (head, row) in src.chunks_exact(hd).enumerate() {
                let off = self.head_offset(block, layer, kv, head) + slot * hd;
                // Round to nearest even, as `f16::from_f32`, vectorised.
                self.pool.slice_mut(off, hd).convert_from_f32_slice(row);
            }
        }
    }

    /// The raw bytes of one block (what a transfer engine moves).
    pub fn block_bytes(&self, block: BlockId) -> &[u8] {
        self.pool.block_bytes(&self.config, block)
    }

    /// [`KvCache::block_bytes`], writable (a device runner's copy back).
    pub fn block_bytes_mut(&mut self, block: BlockId) -> &mut [u8] {
        self.pool.block_bytes_mut(&self.config, block)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> KvCacheConfig {
        KvCacheConfig {
            block_size: 4,
            num_blocks: 8,
            n_layers: 2,
            n_kv_heads: 3,
            head_dim: 2,
        }
    }

    #[test]
    fn layout_places_head_slices_contiguously() {
        let mut cache = KvCache::new(cfg()).expect("valid config");
        let mut table = Vec::new();
        cache.reserve(&mut table, 5).expect("space");
        assert_eq!(table.len(), 2);
        let k = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let v = [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0];
        cache.write(1, table[1], 2, &k, &v);
        let k_head2 = cache.head_slice(table[1], 1, 0, 2);
        assert_eq!(k_head2[4].to_f32(), 5.0);
        assert_eq!(k_head2[5].to_f32(), 6.0);
        let v_head0 = cache.head_slice(table[1], 1, 1, 0);
        assert_eq!(v_head0[4].to_f32(), -1.0);
        // Layer 0 of the same block is untouched.
        assert!(
            cache
                .head_slice(table[1], 0, 0, 2)
                .iter()
                .all(|x| x.to_f32() == 0.0)
        );
        assert_eq!(cache.block_bytes(table[1]).len(), cfg().block_bytes());
    }

    #[test]
    fn invalid_configs_are_rejected() {
        let mut c = cfg();
        c.block_size = 0;
        assert!(KvCache::new(c).is_err());
        let mut c = cfg();
        c.num_blocks = usize::MAX / 2;
        assert!(KvCache::new(c).is_err());
    }
}
