//! Runtime CPU feature detection and the matmul worker pool.

use std::fmt;
use std::sync::OnceLock;

use crate::error::KernelError;
use crate::pool::Pool;

/// The instruction set a kernel implementation uses. Ordered: a CPU that
/// supports an ISA supports every smaller one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Portable scalar reference code.
    Scalar,
    /// AVX2 + FMA + F16C (256-bit).
    Avx2,
    /// AVX-512 F/BW/VL + VNNI (`vpdpbusd`), plus everything in `Avx2`.
    Avx512Vnni,
}

impl Isa {
    /// Every ISA, smallest first.
    pub const ALL: [Isa; 3] = [Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni];

    /// Short lowercase name.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512Vnni => "avx512vnni",
        }
    }

    /// Whether the running CPU can execute this ISA's kernels.
    pub fn is_supported(self) -> bool {
        self <= isa()
    }
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

fn detect() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        if avx2
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512vnni")
        {
            return Isa::Avx512Vnni;
        }
        if avx2 {
            return Isa::Avx2;
        }
    }
    Isa::Scalar
}

/// The best instruction set of this CPU (detected once, cached).
pub fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(detect)
}

static POOL: OnceLock<Pool> = OnceLock::new();

fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// The worker pool, built on first use with the default size. If the workers
/// cannot be spawned, work runs on the caller's thread.
pub(crate) fn pool() -> &'static Pool {
    POOL.get_or_init(|| Pool::new(default_threads()).unwrap_or_else(|_| Pool::single()))
}

/// Sets the number of kernel worker threads (the calling thread counts as
/// one of them).
///
/// The pool is built once per process. Call this before the first `matmul`
/// (or `num_threads`, `parallel_for`) to choose its size; afterwards a call
/// with the same count is a no-op returning `Ok`, and a call with a different
/// count returns [`KernelError::ThreadPoolAlreadyInitialized`] and changes
/// nothing. `n == 0` is rejected.
pub fn set_num_threads(n: usize) -> Result<(), KernelError> {
    if n == 0 {
        return Err(KernelError::InvalidThreadCount(n));
    }
    let mut err = None;
    let got = POOL.get_or_init(|| match Pool::new(n) {
        Ok(p) => p,
        Err(e) => {
            err = Some(e);
            Pool::single()
        }
    });
    if let Some(e) = err {
        return Err(e);
    }
    let current = got.threads();
    if current == n {
        Ok(())
    } else {
        Err(KernelError::ThreadPoolAlreadyInitialized {
            current,
            requested: n,
        })
    }
}

/// Number of kernel worker threads (builds the default pool if needed).
pub fn num_threads() -> usize {
    pool().threads()
}
