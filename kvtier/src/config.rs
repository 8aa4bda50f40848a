//! `--kv-connector-config`: which tiers a node keeps below its KV pool, as
//! the JSON object of MAX's former flags. Parsed and validated once, at
//! startup; sizes are held in bytes from then on.

use std::path::PathBuf;
use std::str::FromStr;

use serde::Deserialize;

/// One GB of the config's sizes (`*_gb`): 2^30 bytes.
const GB: f64 = (1u64 << 30) as f64;

/// The disk tier's size when the config names a directory but no size
/// (MAX's default).
pub const DEFAULT_DISK_GB: f64 = 50.0;

/// The tiers below a node's KV pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TierConfig {
    /// Host memory for blocks evicted from the pool.
    pub host_bytes: u64,
    /// Files for blocks evicted from host memory.
    pub disk: Option<DiskConfig>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskConfig {
    /// Where block files live (a subdirectory per model and KV layout).
    pub dir: PathBuf,
    /// Most bytes of block files kept.
    pub max_bytes: u64,
    /// Files written and read with `O_DIRECT`, bypassing the page cache.
    pub direct_io: bool,
}

/// The JSON as written; unknown keys are refused by name.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    host_kvcache_swap_space_gb: Option<f64>,
    disk_offload_dir: Option<PathBuf>,
    disk_offload_max_gb: Option<f64>,
    disk_offload_direct_io: Option<bool>,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConfigError {
    #[error("--kv-connector-config is not a JSON object of known keys: {0}")]
    Json(String),
    #[error("--kv-connector-config: {key} must be a positive number of GB, not {value}")]
    NotPositive { key: &'static str, value: f64 },
    #[error("--kv-connector-config: {key} = {value} GB is less than one KV block of {block} bytes")]
    BelowOneBlock {
        key: &'static str,
        value: f64,
        block: usize,
    },
    #[error("--kv-connector-config configures no tier: set host_kvcache_swap_space_gb")]
    NoTier,
    #[error(
        "--kv-connector-config: the disk tier holds blocks evicted from host memory, so disk_offload_dir needs host_kvcache_swap_space_gb"
    )]
    DiskWithoutHost,
    #[error("--kv-connector-config: {0} needs disk_offload_dir")]
    NeedsDiskDir(&'static str),
}

impl FromStr for TierConfig {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, ConfigError> {
        let raw: Raw = serde_json::from_str(s).map_err(|e| ConfigError::Json(e.to_string()))?;
        raw.validate()
    }
}

impl Raw {
    fn validate(self) -> Result<TierConfig, ConfigError> {
        let Some(host_gb) = self.host_kvcache_swap_space_gb else {
            return Err(if self.disk_offload_dir.is_some() {
                ConfigError::DiskWithoutHost
            } else {
                ConfigError::NoTier
            });
        };
        let host_bytes = bytes("host_kvcache_swap_space_gb", host_gb)?;
        let disk = match self.disk_offload_dir {
            None => {
                if self.disk_offload_max_gb.is_some() {
                    return Err(ConfigError::NeedsDiskDir("disk_offload_max_gb"));
                }
                if self.disk_offload_direct_io.is_some() {
                    return Err(ConfigError::NeedsDiskDir("disk_offload_direct_io"));
                }
                None
            }
            Some(dir) => Some(DiskConfig {
                dir,
                max_bytes: bytes(
                    "disk_offload_max_gb",
                    self.disk_offload_max_gb.unwrap_or(DEFAULT_DISK_GB),
                )?,
                direct_io: self.disk_offload_direct_io.unwrap_or(false),
            }),
        };
        Ok(TierConfig { host_bytes, disk })
    }
}

fn bytes(key: &'static str, gb: f64) -> Result<u64, ConfigError> {
    if !gb.is_finite() || gb <= 0.0 || gb * GB >= u64::MAX as f64 {
        return Err(ConfigError::NotPositive { key, value: gb });
    }
    Ok((gb * GB) as u64)
}

impl TierConfig {
    /// Refuses tiers too small to hold one block of `block_bytes` (every
    /// tensor-parallel rank's share together).
    pub fn check_block(&self, block_bytes: usize) -> Result<(), ConfigError> {
        let below = |key, b: u64| (b < block_bytes as u64).then_some((key, b));
        let small = below("host_kvcache_swap_space_gb", self.host_bytes).or_else(|| {
            self.disk
                .as_ref()
                .and_then(|d| below("disk_offload_max_gb", d.max_bytes))
        });
        match small {
            Some((key, b)) => Err(ConfigError::BelowOneBlock {
                key,
                value: b as f64 / GB,
                block: block_bytes,
            }),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<TierConfig, ConfigError> {
        s.parse()
    }

    #[test]
    fn the_four_keys_parse_into_bytes() {
        let c = parse(
            r#"{"host_kvcache_swap_space_gb": 0.5, "disk_offload_dir": "/var/kv",
                "disk_offload_max_gb": 2, "disk_offload_direct_io": true}"#,
        )
        .unwrap();
        assert_eq!(c.host_bytes, 1 << 29);
        let d = c.disk.unwrap();
        assert_eq!(
            (d.dir, d.max_bytes, d.direct_io),
            (PathBuf::from("/var/kv"), 2 << 30, true)
        );
        let c = parse(r#"{"host_kvcache_swap_space_gb": 1, "disk_offload_dir": "d"}"#).unwrap();
        let d = c.disk.unwrap();
        assert_eq!((d.max_bytes, d.direct_io), (50 << 30, false));
        assert_eq!(
            parse(r#"{"host_kvcache_swap_space_gb": 4}"#).unwrap(),
            TierConfig {
                host_bytes: 4 << 30,
                disk: None
            }
        );
    }

    #[test]
    fn unknown_keys_are_refused_by_name() {
        let e = parse(r#"{"host_kvcache_swap_space_gb": 1, "enable_lmcache": true}"#).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("unknown field `enable_lmcache`"), "{msg}");
        assert!(msg.contains("host_kvcache_swap_space_gb"), "{msg}");
    }

    #[test]
    fn bad_values_are_refused() {
        for (json, want) in [
            ("[]", "JSON object"),
            ("{}", "configures no tier"),
            (r#"{"host_kvcache_swap_space_gb": 0}"#, "positive"),
            (r#"{"host_kvcache_swap_space_gb": -1}"#, "positive"),
            (r#"{"host_kvcache_swap_space_gb": 1e300}"#, "positive"),
            (r#"{"host_kvcache_swap_space_gb": "1"}"#, "invalid type"),
            (r#"{"disk_offload_dir": "/d"}"#, "needs host_kvcache"),
            (
                r#"{"host_kvcache_swap_space_gb": 1, "disk_offload_max_gb": 1}"#,
                "disk_offload_max_gb needs disk_offload_dir",
            ),
            (
                r#"{"host_kvcache_swap_space_gb": 1, "disk_offload_direct_io": true}"#,
                "disk_offload_direct_io needs disk_offload_dir",
            ),
            (
                r#"{"host_kvcache_swap_space_gb": 1, "disk_offload_dir": "/d", "disk_offload_max_gb": 0}"#,
                "disk_offload_max_gb must be a positive",
            ),
        ] {
            let msg = parse(json).unwrap_err().to_string();
            assert!(msg.contains(want), "{json}: {msg}");
        }
    }

    #[test]
    fn a_tier_below_one_block_is_refused() {
        let c = parse(r#"{"host_kvcache_swap_space_gb": 0.000001}"#).unwrap();
        assert_eq!(c.host_bytes, 1073);
        assert!(c.check_block(1073).is_ok());
        let msg = c.check_block(1074).unwrap_err().to_string();
        assert!(
            msg.contains("less than one KV block of 1074 bytes"),
            "{msg}"
        );
    }
}
