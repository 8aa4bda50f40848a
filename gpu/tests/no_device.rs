//! With no Vulkan driver to load and no CUDA driver (this project's CI),
//! opening a GPU is a clear error naming both, not a panic, whichever
//! runtime is asked for. Its own test binary: the Vulkan loader reads its
//! driver list once per process.

use tandem_gpu::{GpuDevice, GpuError, GpuRuntime, RuntimeAlreadyChosen, prefer_runtime};

#[test]
fn no_vulkan_driver_is_a_clear_error_naming_cuda_and_vulkan() {
    // SAFETY: the only test in this process, set before any thread reads
    // the environment (the loader reads it when the device is opened).
    unsafe {
        std::env::set_var("VK_ICD_FILENAMES", "/nonexistent/icd.json");
        std::env::set_var("VK_DRIVER_FILES", "/nonexistent/icd.json");
    }
    let err = GpuDevice::open(0).expect_err("no driver, no device");
    assert!(
        matches!(err, GpuError::NoDevice { index: 0, .. }),
        "{err:?}"
    );
    let msg = err.to_string();
    for part in [
        "gpu:0",
        "CUDA: no CUDA driver (libcuda.so.1 not found)",
        "Vulkan",
        "mesa-vulkan-drivers",
    ] {
        assert!(msg.contains(part), "{part} missing from: {msg}");
    }
    // Asking for one runtime tries only that one, and says so.
    let cuda = GpuDevice::open_on(1, GpuRuntime::Cuda).expect_err("no CUDA driver");
    let msg = cuda.to_string();
    assert!(
        msg.contains("gpu:1") && msg.contains("libcuda") && msg.contains("Vulkan: not tried"),
        "{msg}"
    );
    let vulkan = GpuDevice::open_on(0, GpuRuntime::Vulkan).expect_err("no Vulkan driver");
    assert!(vulkan.to_string().contains("CUDA: not tried"), "{vulkan}");
    // `open` fixed the process's runtime (auto): choosing it again is a
    // no-op, another one an error that changes nothing.
    assert!(prefer_runtime(GpuRuntime::Auto).is_ok());
    assert!(matches!(
        prefer_runtime(GpuRuntime::Cuda),
        Err(RuntimeAlreadyChosen(GpuRuntime::Auto))
    ));
}
