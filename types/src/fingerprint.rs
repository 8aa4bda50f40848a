//! What two nodes must agree on to share KV blocks: the same weights, and
//! the same KV element type, block size and in-block layout.

/// Element type of the KV cache.
pub const KV_DTYPE: &str = "f16";

/// In-block layout of the KV cache: layer-major, then K|V, then KV head,
/// then token slot, then head dimension.
pub const KV_LAYOUT: &str = "layer/kv/head/slot/dim";

/// A node's KV compatibility fingerprint. Plain data: the wire form lives in
/// the `proto` crate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelFingerprint {
    pub model_id: String,
    pub weights_hash: u64,
    pub kv_dtype: String,
    pub block_size: usize,
    pub kv_layout: String,
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl ModelFingerprint {
    /// The first field where `peer` differs from `self`, described for an
    /// error message; `None` when they are compatible.
    pub fn mismatch(&self, peer: &ModelFingerprint) -> Option<String> {
        let diff = |field: &str, ours: String, theirs: String| {
            Some(format!("{field} differs: ours {ours}, peer's {theirs}"))
        };
        if self.weights_hash != peer.weights_hash {
            return diff(
                "weights hash",
                format!("{:016x} ({})", self.weights_hash, self.model_id),
                format!("{:016x} ({})", peer.weights_hash, peer.model_id),
            );
        }
        if self.kv_dtype != peer.kv_dtype {
            return diff("KV dtype", self.kv_dtype.clone(), peer.kv_dtype.clone());
        }
        if self.block_size != peer.block_size {
            return diff(
                "KV block size",
                self.block_size.to_string(),
                peer.block_size.to_string(),
            );
        }
        if self.kv_layout != peer.kv_layout {
            return diff("KV layout", self.kv_layout.clone(), peer.kv_layout.clone());
        }
        let shape = |f: &Self| format!("{}x{}x{}", f.num_layers, f.num_kv_heads, f.head_dim);
        if shape(self) != shape(peer) {
            return diff("layers x KV heads x head dim", shape(self), shape(peer));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp() -> ModelFingerprint {
        ModelFingerprint {
            model_id: "m".into(),
            weights_hash: 7,
            kv_dtype: "f16".into(),
            block_size: 16,
            kv_layout: "layer/kv/head/slot/dim".into(),
            num_layers: 30,
            num_kv_heads: 3,
            head_dim: 64,
        }
    }

    #[test]
    fn equal_fingerprints_match_and_each_field_is_checked() {
        assert_eq!(fp().mismatch(&fp()), None);
        // Naming every field: a field added to the struct fails to compile
        // here until it gets a case below.
        let ModelFingerprint {
            model_id: _,
            weights_hash: _,
            kv_dtype: _,
            block_size: _,
            kv_layout: _,
            num_layers: _,
            num_kv_heads: _,
            head_dim: _,
        } = fp();
        // The model id is a label only; the weights decide.
        let renamed = ModelFingerprint {
            model_id: "other".into(),
            ..fp()
        };
        assert_eq!(fp().mismatch(&renamed), None);
        // Every other field, changed alone, is a mismatch that names it, from
        // either side.
        let shape = "layers x KV heads x head dim differs";
        let cases = [
            (
                ModelFingerprint {
                    weights_hash: 8,
                    ..fp()
                },
                "weights hash differs: ours 0000000000000007 (m), peer's 0000000000000008 (m)",
            ),
            (
                ModelFingerprint {
                    kv_dtype: "bf16".into(),
                    ..fp()
                },
                "KV dtype differs: ours f16, peer's bf16",
            ),
            (
                ModelFingerprint {
                    block_size: 32,
                    ..fp()
                },
                "KV block size differs: ours 16, peer's 32",
            ),
            (
                ModelFingerprint {
                    kv_layout: "x".into(),
                    ..fp()
                },
                "KV layout differs: ours layer/kv/head/slot/dim, peer's x",
            ),
            (
                ModelFingerprint {
                    num_layers: 31,
                    ..fp()
                },
                &format!("{shape}: ours 30x3x64, peer's 31x3x64"),
            ),
            (
                ModelFingerprint {
                    num_kv_heads: 1,
                    ..fp()
                },
                &format!("{shape}: ours 30x3x64, peer's 30x1x64"),
            ),
            (
                ModelFingerprint {
                    head_dim: 128,
                    ..fp()
                },
                &format!("{shape}: ours 30x3x64, peer's 30x3x128"),
            ),
        ];
        for (peer, want) in cases {
            assert_eq!(fp().mismatch(&peer).as_deref(), Some(want), "{peer:?}");
            assert!(peer.mismatch(&fp()).is_some(), "{peer:?}, the other way");
        }
    }
}
