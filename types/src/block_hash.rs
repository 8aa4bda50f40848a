//! Chained block hashes: the identity of a full KV block, shared by the
//! router's prefix index, the engine's prefix cache and the transfer engine.

/// Identity of a full block: `h_i = H(h_{i-1}, tokens of block i)`.
pub type BlockHash = u64;

/// Chained hashes of the full blocks of `tokens` (a trailing partial block
/// has none). One definition shared by router, engine and transfer engine.
pub fn block_hashes(tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
    let mut parent: BlockHash = 0;
    tokens
        .chunks_exact(block_size.max(1))
        .map(|block| {
            parent = chain_hash(parent, block);
            parent
        })
        .collect()
}

/// One link of the chain: the hash of `block` after a block hashed `parent`
/// (0 for the first block).
pub fn chain_hash(parent: BlockHash, block: &[u32]) -> BlockHash {
    let mut bytes = Vec::with_capacity(8 + 4 * block.len());
    bytes.extend_from_slice(&parent.to_le_bytes());
    for t in block {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    xxhash_rust::xxh3::xxh3_64(&bytes)
}
