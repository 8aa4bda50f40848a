use thiserror::Error;

/// What can go wrong opening a device or running a kernel on it.
#[derive(Debug, Error)]
pub enum GpuError {
    /// No device answers to the requested index: neither a CUDA device nor
    /// a Vulkan adapter.
    #[error(
        "no GPU for gpu:{index}: CUDA: {cuda}; Vulkan: {vulkan} (on a machine without a GPU, \
         Mesa's lavapipe provides a Vulkan device: apt install mesa-vulkan-drivers)"
    )]
    NoDevice {
        index: usize,
        cuda: String,
        vulkan: String,
    },
    /// The model file cannot run on this backend yet.
    #[error("model not supported on the GPU backend: {0}")]
    UnsupportedModel(String),
    /// The model file could not be read.
    #[error(transparent)]
    ModelFile(#[from] tandem_modelfile::error::ModelError),
    /// A kernel's inputs do not have the sizes it needs.
    #[error("{kernel}: {what}")]
    Shape { kernel: &'static str, what: String },
    /// A tensor-parallel collective failed (a peer rank is gone, or the
    /// ranks disagree on sizes).
    #[error("tensor-parallel collective: {0}")]
    Collective(#[from] tandem_engine::comm::CommError),
    /// The device failed to run a kernel or to return its results.
    #[error("{kernel} failed on the device: {message}")]
    Device {
        kernel: &'static str,
        message: String,
    },
}
