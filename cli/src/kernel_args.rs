//! Flags that choose how the kernels run (the CPU's threads and
//! instruction set, the GPU's runtime), shared by every command that loads
//! a model.

use anyhow::{Context, Result, bail};
use clap::Args;
use tandem_gpu::GpuRuntime;
use tandem_kernels::Isa;

#[derive(Debug, Clone, Args)]
pub struct KernelArgs {
    /// Worker threads for the kernels (default: all cores).
    #[arg(long, env = "TANDEM_THREADS")]
    pub threads: Option<usize>,
    /// Use at most this instruction set: scalar, avx2 or avx512vnni (default:
    /// the best this CPU has). For comparing kernel paths on one machine.
    #[arg(long, env = "TANDEM_CPU_ISA")]
    pub cpu_isa: Option<Isa>,
    /// With --devices gpu:...: the GPU runtime, `auto` (CUDA where a CUDA
    /// driver and device are present, else Vulkan), `cuda` or `vulkan`.
    #[arg(long, env = "TANDEM_GPU_RUNTIME", default_value = "auto")]
    pub gpu_runtime: GpuRuntime,
}

impl KernelArgs {
    /// Checks the values without touching the kernels.
    pub fn validate(&self) -> Result<()> {
        if self.threads == Some(0) {
            bail!("--threads must be at least 1");
        }
        if let Some(isa) = self.cpu_isa
            && !isa.is_supported_by_cpu()
        {
            bail!(
                "--cpu-isa {isa}: this CPU supports at most {}",
                Isa::detected()
            );
        }
        Ok(())
    }

    /// Validates, then fixes the kernels' instruction set, thread count and
    /// GPU runtime for the life of the process. Call before the model is
    /// loaded: weights are repacked for the chosen instruction set.
    pub fn apply(&self) -> Result<()> {
        self.validate()?;
        tandem_gpu::prefer_runtime(self.gpu_runtime).context("setting --gpu-runtime")?;
        if let Some(isa) = self.cpu_isa {
            tandem_kernels::limit_isa(isa).context("setting --cpu-isa")?;
        }
        if let Some(n) = self.threads {
            tandem_kernels::set_num_threads(n).context("setting --threads")?;
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        kernels: KernelArgs,
    }

    fn parse(flags: &[&str]) -> Result<KernelArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("t").chain(flags.iter().copied())).map(|c| c.kernels)
    }

    #[test]
    fn flags_parse_and_bad_values_are_refused() {
        let k = parse(&["--threads", "3", "--cpu-isa", "scalar"]).unwrap();
        assert_eq!((k.threads, k.cpu_isa), (Some(3), Some(Isa::Scalar)));
        k.validate().unwrap();
        assert!(parse(&["--cpu-isa", "sse2"]).is_err());
        assert!(parse(&["--threads", "0"]).unwrap().validate().is_err());
        if !Isa::Avx512Vnni.is_supported_by_cpu() {
            let k = parse(&["--cpu-isa", "avx512vnni"]).unwrap();
            assert!(k.validate().is_err());
        }
    }
}
