//! Where a node's dKV key comes from: `--dkv-key-file`, else the cluster's
//! key in etcd (created by the first node that asks), else, with neither,
//! a key of this process alone (its KV addresses are then accepted by no
//! other node).

use std::path::Path;

use anyhow::{Context, Result, anyhow};
use tandem_discovery::EtcdConfig;
use tandem_dkv::DkvKey;

/// The name of the dKV key among the cluster's secrets in etcd.
pub const ETCD_NAME: &str = "dkv-key";

/// The key of a node started with `file` (`--dkv-key-file`) and `etcd`.
pub async fn resolve(file: Option<&Path>, etcd: Option<&EtcdConfig>) -> Result<DkvKey> {
    if let Some(path) = file {
        return read(path);
    }
    let Some(cfg) = etcd else {
        tracing::warn!(
            "no --dkv-key-file and no --etcd: KV addresses are sealed with a key of this \
             process alone, so no other node will accept them"
        );
        return Ok(DkvKey::generate()?);
    };
    let fresh = DkvKey::generate()?;
    let stored = tandem_discovery::get_or_create_secret(cfg, ETCD_NAME, fresh.as_bytes())
        .await
        .map_err(|e| {
            anyhow!(
                "getting the cluster's dKV key from etcd: {e} (or give every node the same \
                 --dkv-key-file)"
            )
        })?;
    DkvKey::from_slice(&stored).map_err(|e| {
        anyhow!(
            "the cluster's dKV key in etcd ({}): {e}",
            tandem_discovery::secret_key(&cfg.cluster, ETCD_NAME)
        )
    })
}

/// A key file: 64 hexadecimal digits (`openssl rand -hex 32 > FILE`).
pub fn read(path: &Path) -> Result<DkvKey> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading --dkv-key-file {}", path.display()))?;
    DkvKey::from_hex(&text).map_err(|e| anyhow!("--dkv-key-file {}: {e}", path.display()))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn key_files_are_checked() {
        let dir = std::env::temp_dir().join(format!("tandem-dkv-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good");
        std::fs::write(&good, format!("{}\n", "ab".repeat(32))).unwrap();
        assert_eq!(read(&good).unwrap().as_bytes(), &[0xab; 32]);
        let short = dir.join("short");
        std::fs::write(&short, "abcd").unwrap();
        let e = read(&short).unwrap_err().to_string();
        assert!(e.contains("64 hexadecimal digits"), "{e}");
        let e = read(&dir.join("missing")).unwrap_err().to_string();
        assert!(e.contains("reading --dkv-key-file"), "{e}");
        // A file wins over etcd (none is reached).
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let from_file = rt.block_on(resolve(Some(&good), None)).unwrap();
        assert_eq!(from_file.as_bytes(), &[0xab; 32]);
        let a = rt.block_on(resolve(None, None)).unwrap();
        let b = rt.block_on(resolve(None, None)).unwrap();
        assert_ne!(a, b);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
