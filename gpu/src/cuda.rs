//! Opening a CUDA device: CubeCL's CUDA runtime (`cubecl-cuda`), whose
//! kernels are the same CubeCL sources as the Vulkan path, compiled to CUDA
//! C++ and then to PTX by NVRTC when first launched. Everything CUDA is
//! loaded at run time (cudarc), so a build or a machine without CUDA only
//! lacks the device: each missing piece is named before CubeCL is asked to
//! start, because CubeCL panics where these checks return a reason.

use cubecl::prelude::Client;
use cubecl_cuda::CudaRuntime;
use cubecl_runtime::device::CudaDevice;
use cubecl_runtime::runtime::Runtime;

/// The index-th CUDA device's client and name, or why there is none.
pub(crate) fn open(index: usize) -> Result<(Client, String), String> {
    let name = probe(index)?;
    let device = CudaDevice { index };
    // CubeCL's runtime starts (context, streams, memory pools) with
    // `expect`s: a failure there is a refusal of this device, not a crash.
    let client =
        std::panic::catch_unwind(|| <CudaRuntime as Runtime>::client(&device)).map_err(|e| {
            let msg = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            format!("CubeCL's CUDA runtime failed to start on device {index}: {msg}")
        })?;
    Ok((client, format!("{name} (CUDA)")))
}

/// Checks the driver, the device, NVRTC and the CUDA headers NVRTC
/// compiles the kernels against; the device's name.
fn probe(index: usize) -> Result<String, String> {
    // SAFETY: only tries to dlopen libcuda.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("no CUDA driver (libcuda.so.1 not found)".into());
    }
    use cudarc::driver::result;
    result::init().map_err(|e| format!("the CUDA driver did not start: {e}"))?;
    let count = result::device::get_count().map_err(|e| format!("counting CUDA devices: {e}"))?;
    let ordinal = i32::try_from(index).map_err(|_| format!("device index {index}"))?;
    if ordinal >= count {
        return Err(format!("{count} CUDA device(s), no device {index}"));
    }
    let dev = result::device::get(ordinal).map_err(|e| format!("CUDA device {index}: {e}"))?;
    let name = result::device::get_name(dev).map_err(|e| format!("CUDA device {index}: {e}"))?;
    // SAFETY: only tries to dlopen libnvrtc.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(format!(
            "{name}: no NVRTC (libnvrtc), which compiles the kernels for CUDA"
        ));
    }
    if cubecl_cuda::install::cuda_path().is_none() {
        return Err(format!(
            "{name}: no CUDA toolkit headers for NVRTC (set CUDA_PATH, or install them under \
             /usr/local/cuda)"
        ));
    }
    Ok(name)
}
