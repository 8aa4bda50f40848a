//! Why the tiers could not start.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum TierError {
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error("KV disk tier directory {dir}: {source}")]
    Dir {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "disk_offload_direct_io: {dir} does not take O_DIRECT writes ({source}); set disk_offload_direct_io false for its file system"
    )]
    DirectIo {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error("starting the KV disk tier's thread: {0}")]
    Thread(std::io::Error),
}
