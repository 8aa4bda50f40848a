//! Runtime CPU feature detection and the process-wide instruction set
//! choice ([`isa`], [`limit_isa`]).

use std::str::FromStr;
use std::sync::OnceLock;

use crate::error::KernelError;
pub use crate::types::Isa;

impl Isa {
    /// Whether the kernels may use this ISA: the CPU has it and
    /// [`limit_isa`] did not rule it out.
    pub fn is_supported(self) -> bool {
        self <= isa()
    }

    /// Whether the running CPU can execute this ISA's kernels, whatever
    /// [`limit_isa`] chose.
    pub fn is_supported_by_cpu(self) -> bool {
        self <= detect()
    }

    /// The best ISA of the running CPU, whatever [`limit_isa`] chose.
    pub fn detected() -> Isa {
        detect()
    }
}

impl FromStr for Isa {
    type Err = KernelError;

    /// Parses a [`Isa::name`].
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Isa::ALL
            .into_iter()
            .find(|isa| isa.name() == s)
            .ok_or_else(|| KernelError::UnknownIsa(s.to_owned()))
    }
}

fn detect() -> Isa {
    static DETECTED: OnceLock<Isa> = OnceLock::new();
    *DETECTED.get_or_init(detect_uncached)
}

fn detect_uncached() -> Isa {
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

static ISA: OnceLock<Isa> = OnceLock::new();

/// The instruction set every kernel dispatches on: the best one this CPU has
/// (detected once, cached), unless [`limit_isa`] chose a smaller one first.
pub fn isa() -> Isa {
    *ISA.get_or_init(detect)
}

/// Makes the kernels use at most `max` (to compare kernel paths end to end, or
/// to avoid a faulty unit), even where the CPU has more.
///
/// Like [`crate::set_num_threads`], the choice is made once per process:
/// call this before anything calls [`isa`] (weights packed for one ISA must
/// not be read by another's kernels). Afterwards a call that would give the
/// same ISA is a no-op returning `Ok`, and any other returns
/// [`KernelError::IsaAlreadyChosen`]. An ISA the CPU lacks is
/// [`KernelError::UnsupportedIsa`].
pub fn limit_isa(max: Isa) -> Result<(), KernelError> {
    let available = detect();
    if max > available {
        return Err(KernelError::UnsupportedIsa {
            requested: max,
            available,
        });
    }
    let current = *ISA.get_or_init(|| max);
    if current == max {
        Ok(())
    } else {
        Err(KernelError::IsaAlreadyChosen {
            current,
            requested: max,
        })
    }
}

/// For the "every ISA equals the scalar reference" tests: the ISAs a test
/// must run (every one this CPU has), and a check, when the test ends, that
/// it ran each of them. A test that skips an ISA the machine has fails
/// instead of passing silently; the ISAs run are printed (past the test
/// harness's capture, so they show in CI logs).
#[cfg(test)]
pub(crate) struct IsaCoverage {
    test: &'static str,
    ran: std::collections::BTreeSet<Isa>,
}

#[cfg(test)]
impl IsaCoverage {
    pub(crate) fn new(test: &'static str) -> Self {
        Self {
            test,
            ran: Default::default(),
        }
    }

    /// Every ISA the CPU runs, smallest first. Each must also be usable
    /// here: a limit on the kernels would hide one from the test.
    pub(crate) fn isas(&self) -> Vec<Isa> {
        let all: Vec<Isa> = Isa::ALL
            .into_iter()
            .filter(|i| i.is_supported_by_cpu())
            .collect();
        for isa in &all {
            assert!(
                isa.is_supported(),
                "{}: the CPU has {isa} but the kernels are limited to {}",
                self.test,
                self::isa()
            );
        }
        all
    }

    /// The test compared `isa`'s result with the reference.
    pub(crate) fn ran(&mut self, isa: Isa) {
        self.ran.insert(isa);
    }
}

#[cfg(test)]
impl Drop for IsaCoverage {
    fn drop(&mut self) {
        if std::thread::panicking() {
            return;
        }
        let names =
            |v: &mut dyn Iterator<Item = Isa>| v.map(Isa::name).collect::<Vec<_>>().join(", ");
        let ran = names(&mut self.ran.iter().copied());
        use std::io::Write as _;
        let _ = writeln!(
            std::io::stderr(),
            "tandem-kernels: {} ran {ran} (CPU: {})",
            self.test,
            Isa::detected()
        );
        let want = names(&mut self.isas().into_iter());
        assert_eq!(ran, want, "{}: ISAs run vs ISAs this CPU has", self.test);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn isa_names_round_trip_and_unknown_names_are_errors() {
        for isa in Isa::ALL {
            assert_eq!(isa.name().parse::<Isa>().unwrap(), isa);
        }
        for bad in ["", "AVX2", "avx512", "sse4"] {
            assert!(matches!(bad.parse::<Isa>(), Err(KernelError::UnknownIsa(s)) if s == bad));
        }
    }

    /// Detection against the kernel's own account of the CPU: an ISA missed
    /// here would go untested (and unused) without any test noticing. With
    /// `TANDEM_REQUIRE_ISA=<name>` (CI, on runners known to have it) a CPU
    /// without that ISA fails the run instead of skipping its kernels.
    #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
    #[test]
    fn detection_agrees_with_the_cpu_flags() {
        let info = std::fs::read_to_string("/proc/cpuinfo").expect("reading /proc/cpuinfo");
        let flags: std::collections::BTreeSet<&str> = info
            .lines()
            .find_map(|l| l.strip_prefix("flags"))
            .and_then(|l| l.split_once(':'))
            .expect("a flags line in /proc/cpuinfo")
            .1
            .split_whitespace()
            .collect();
        let has = |names: &[&str]| names.iter().all(|f| flags.contains(f));
        let want = if has(&[
            "avx2",
            "fma",
            "f16c",
            "avx512f",
            "avx512bw",
            "avx512vl",
            "avx512_vnni",
        ]) {
            Isa::Avx512Vnni
        } else if has(&["avx2", "fma", "f16c"]) {
            Isa::Avx2
        } else {
            Isa::Scalar
        };
        assert_eq!(Isa::detected(), want, "CPU flags: {flags:?}");
        // No kernel test limits the ISA: the equality tests can run them all.
        assert_eq!(isa(), Isa::detected());
        if let Ok(required) = std::env::var("TANDEM_REQUIRE_ISA") {
            let required: Isa = required.parse().unwrap_or_else(|e| {
                panic!("TANDEM_REQUIRE_ISA: {e} (one of scalar, avx2, avx512vnni)")
            });
            assert!(
                Isa::detected() >= required,
                "TANDEM_REQUIRE_ISA={required} but this CPU has only {}: its kernels would go untested",
                Isa::detected()
            );
        }
    }

    #[test]
    fn the_isa_is_chosen_once() {
        let chosen = isa();
        assert!(chosen <= detect());
        limit_isa(chosen).unwrap();
        for other in Isa::ALL.into_iter().filter(|&i| i != chosen) {
            match limit_isa(other) {
                Err(KernelError::IsaAlreadyChosen { current, requested }) => {
                    assert_eq!((current, requested), (chosen, other));
                }
                Err(KernelError::UnsupportedIsa {
                    requested,
                    available,
                }) => {
                    assert_eq!(requested, other);
                    assert!(other > available);
                }
                r => panic!("limit_isa({other}) after {chosen}: {r:?}"),
            }
        }
        assert_eq!(isa(), chosen);
    }
}
