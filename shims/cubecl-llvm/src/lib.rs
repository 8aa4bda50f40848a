//! A stand-in for `cubecl-llvm`, CubeCL's LLVM backend, under
//! `cubecl-cuda` (the workspace's `[patch.crates-io]`).
//!
//! `cubecl-cuda` compiles kernels two ways: to CUDA C++ for NVRTC (its
//! `cpp` feature, which Tandem uses) or through LLVM to PTX. It depends on
//! `cubecl-llvm` for the second even when the first is chosen, and
//! `cubecl-llvm`'s build script downloads an LLVM bundle, which a build
//! that reaches only the package registries cannot. This crate has the
//! items `cubecl-cuda` names, and its LLVM compiler refuses every kernel
//! with an error that says why; with the `cpp` feature it is never asked.

use core::fmt;

use cubecl_core::ir::DeviceProperties;
use cubecl_core::ir::amd::GfxArch;
use cubecl_core::ir::nvidia::SmArch;
use cubecl_core::prelude::KernelDefinition;
use cubecl_environment::backtrace::BackTrace;
use cubecl_runtime::compiler::{CompilationError, Compiler};
use cubecl_runtime::kernel::BufferIOAttr;

/// Where the LLVM backend would compile for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LlvmTarget {
    /// The host CPU.
    #[default]
    Cpu,
    /// NVIDIA GPUs (PTX).
    Nvptx,
}

/// Options of the LLVM backend, as `cubecl-cuda` fills them.
#[derive(Clone, Debug, Default)]
pub struct PlironOptions {
    /// AMD GPU architecture (unused).
    pub arch: Option<GfxArch>,
    /// NVIDIA architecture.
    pub sm_arch: Option<SmArch>,
    /// PTX version to emit.
    pub ptx_version: Option<nvptx::ptx_version::PtxVersion>,
    /// Whether launch parameters are grid constants.
    pub grid_constants: bool,
}

/// A kernel compiled to PTX (never produced here).
#[derive(Clone, Debug, Default)]
pub struct NvptxModule {
    /// NUL-terminated PTX assembly.
    pub ptx: Vec<core::ffi::c_char>,
    /// Kernel entry point symbol.
    pub entrypoint: String,
    /// IR for logging and cache keys.
    pub ir: String,
    /// Shared memory per launch, in bytes.
    pub shared_memory_size: usize,
    /// Buffer access modes in binding order.
    pub io: Vec<BufferIOAttr>,
}

/// What the LLVM backend produces.
#[derive(Debug)]
pub enum PlironArtifact {
    /// PTX for the CUDA driver.
    NvptxCode(NvptxModule),
    /// Code for the host (not produced here).
    Host(String),
}

impl fmt::Display for PlironArtifact {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PlironArtifact::NvptxCode(m) => f.write_str(&m.ir),
            PlironArtifact::Host(ir) => f.write_str(ir),
        }
    }
}

/// The LLVM compiler: refuses every kernel.
#[derive(Clone, Debug, Default)]
pub struct PlironCompiler {
    /// What it would compile for.
    pub target: LlvmTarget,
}

impl Compiler for PlironCompiler {
    type Representation = PlironArtifact;
    type CompilationOptions = PlironOptions;

    fn compile(
        &mut self,
        _kernel: KernelDefinition,
        _options: &PlironOptions,
    ) -> Result<PlironArtifact, CompilationError> {
        Err(CompilationError::Generic {
            reason: "this build has no LLVM backend (cubecl-llvm is Tandem's stand-in); \
                     CUDA kernels compile through NVRTC (cubecl-cuda's `cpp` feature)"
                .into(),
            backtrace: BackTrace::capture(),
        })
    }

    fn extension(&self) -> &'static str {
        "ll"
    }

    fn lang_tag(&self) -> &'static str {
        "llvm"
    }
}

/// Device features by target (the LLVM backend's limits).
pub mod shared {
    /// What the LLVM backend can lower.
    pub mod lowered_features {
        use super::super::DeviceProperties;

        /// A GPU target of the LLVM backend.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum GpuTarget {
            /// NVIDIA GPUs.
            Nvptx,
        }

        /// Keeps only what the LLVM backend lowers; with no LLVM backend
        /// here nothing is lowered by it, so the properties stay as the
        /// runtime found them (the C++ backend's).
        pub fn restrict_features(_props: &mut DeviceProperties, _target: GpuTarget) {}
    }
}

/// The NVPTX target.
pub mod nvptx {
    /// The PTX ISA version for a driver.
    pub mod ptx_version {
        use core::fmt;

        /// A PTX ISA version, 8.7 as `87`.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub struct PtxVersion(u32);

        /// The first CUDA driver (as `cuDriverGetVersion` reports it) to load
        /// each PTX ISA version, newest first (NVIDIA's PTX ISA release
        /// notes).
        const DRIVER_PTX: &[(i32, u32)] = &[
            (13000, 90),
            (12090, 88),
            (12080, 87),
            (12050, 85),
            (12040, 84),
            (12030, 83),
            (12020, 82),
            (12010, 81),
            (12000, 80),
            (11080, 78),
            (11070, 77),
            (11060, 76),
            (11050, 75),
            (11040, 74),
            (11030, 73),
            (11020, 72),
            (11010, 71),
            (11000, 70),
            (10020, 65),
            (10010, 64),
            (10000, 63),
        ];

        impl PtxVersion {
            /// The newest version a driver of CUDA `driver` loads (12.8 is
            /// `12080`); `None` below CUDA 10.0.
            pub fn for_driver(driver: i32) -> Option<Self> {
                DRIVER_PTX
                    .iter()
                    .find(|(first, _)| driver >= *first)
                    .map(|&(_, ptx)| Self(ptx))
            }
        }

        impl fmt::Display for PtxVersion {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "ptx{}", self.0)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::nvptx::ptx_version::PtxVersion;

    #[test]
    fn ptx_versions_follow_the_driver() {
        assert_eq!(PtxVersion::for_driver(9020), None);
        assert_eq!(
            PtxVersion::for_driver(12080).map(|v| v.to_string()),
            Some("ptx87".into())
        );
        assert_eq!(
            PtxVersion::for_driver(13000).map(|v| v.to_string()),
            Some("ptx90".into())
        );
    }
}
