//! KV tiers below the engine's block pool (`--kv-connector-config`):
//! prefix blocks the pool evicts are kept in host memory ([`host`]) and
//! from there in files ([`disk`], integrity-checked on every read), and
//! brought back when a prompt needs them, instead of being recomputed.
//!
//! The scheduler owns a [`TierStore`] on its thread. A block is the whole
//! of it: every layer (sliding-window and global alike) of every
//! tensor-parallel rank's share, as one byte string, so no cache of the
//! model can be left behind. The bytes are the pool's own, so a restored
//! block equals the evicted one bit for bit.

pub mod config;
pub mod disk;
mod error;
pub mod file;
pub mod host;
mod metrics;
mod store;

pub use config::{ConfigError, DiskConfig, TierConfig};
pub use disk::Waker;
pub use error::TierError;
pub use host::BlockBytes;
pub use metrics::{ErrorKind, Tier, peer};
pub use store::{Found, TierBlock, TierStore};
