use thiserror::Error;

/// Everything `dkv` can fail with. Descriptors and ops come from the network,
/// so each variant names what was wrong instead of panicking.
#[derive(Error, Debug)]
pub enum DkvError {
    #[error("UCX transport unavailable: {0}")]
    UcxUnavailable(String),
    #[error("UCX {op} failed: {status}")]
    Ucx { op: &'static str, status: String },
    #[error("write op out of bounds: {0}")]
    OutOfBounds(String),
    #[error("invalid remote region descriptor: {0}")]
    InvalidDescriptor(String),
    #[error("invalid local region: {0}")]
    InvalidRegion(String),
    #[error("invalid KV layout: {0}")]
    InvalidLayout(String),
    #[error("transfer deadline exceeded")]
    DeadlineExceeded,
    #[error("peer unreachable: {0}")]
    PeerUnreachable(String),
    #[error("dkv transport is shut down")]
    Shutdown,
}

impl DkvError {
    /// The bounded `reason` label of `tandem.dkv.transfer_failures`.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::DeadlineExceeded => "deadline",
            Self::PeerUnreachable(_) => "peer",
            Self::OutOfBounds(_)
            | Self::InvalidDescriptor(_)
            | Self::InvalidRegion(_)
            | Self::InvalidLayout(_) => "bounds",
            Self::UcxUnavailable(_) | Self::Ucx { .. } | Self::Shutdown => "transport",
        }
    }
}
