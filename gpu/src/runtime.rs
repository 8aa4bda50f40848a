//! Which GPU runtime runs the kernels: CUDA (NVIDIA GPUs, through the
//! driver, NVRTC and NCCL that are on the machine) or Vulkan (any GPU, and
//! Mesa's lavapipe on a machine without one).

use std::fmt;
use std::str::FromStr;

/// The runtime asked for (`--gpu-runtime`), or the one a device was
/// opened on (never `Auto`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GpuRuntime {
    /// CUDA where a CUDA driver and device are present, else Vulkan.
    #[default]
    Auto,
    /// CUDA only.
    Cuda,
    /// Vulkan only.
    Vulkan,
}

impl GpuRuntime {
    /// Whether asking for `self` allows opening a device on `on`.
    pub fn admits(self, on: GpuRuntime) -> bool {
        self == GpuRuntime::Auto || self == on
    }
}

impl fmt::Display for GpuRuntime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GpuRuntime::Auto => "auto",
            GpuRuntime::Cuda => "cuda",
            GpuRuntime::Vulkan => "vulkan",
        })
    }
}

/// Not one of `auto`, `cuda`, `vulkan`.
#[derive(Debug, thiserror::Error)]
#[error("unknown GPU runtime {0:?} (expected auto, cuda or vulkan)")]
pub struct UnknownRuntime(String);

impl FromStr for GpuRuntime {
    type Err = UnknownRuntime;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(GpuRuntime::Auto),
            "cuda" => Ok(GpuRuntime::Cuda),
            "vulkan" => Ok(GpuRuntime::Vulkan),
            _ => Err(UnknownRuntime(s.into())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_auto_admits_both() {
        for r in [GpuRuntime::Auto, GpuRuntime::Cuda, GpuRuntime::Vulkan] {
            assert_eq!(r.to_string().parse::<GpuRuntime>().ok(), Some(r));
        }
        assert!("metal".parse::<GpuRuntime>().is_err());
        assert!(GpuRuntime::Auto.admits(GpuRuntime::Cuda));
        assert!(GpuRuntime::Auto.admits(GpuRuntime::Vulkan));
        assert!(!GpuRuntime::Cuda.admits(GpuRuntime::Vulkan));
        assert!(!GpuRuntime::Vulkan.admits(GpuRuntime::Cuda));
    }
}
