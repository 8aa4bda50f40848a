use thiserror::Error;

use crate::Refusal;

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
    /// A peer's worker address whose tag does not verify under the
    /// cluster's dKV key: never handed to UCX.
    #[error("unauthenticated remote region descriptor: {0}")]
    Unauthenticated(String),
    #[error("invalid dKV key: {0}")]
    InvalidKey(String),
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
    /// The receiver refused the write (no valid grant for those bytes).
    #[error("the receiver refused the write ({})", .0.label())]
    Refused(Refusal),
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
            Self::Refused(_) => "refused",
            Self::Unauthenticated(_) => "unauthenticated",
            Self::UcxUnavailable(_) | Self::Ucx { .. } | Self::Shutdown | Self::InvalidKey(_) => {
                "transport"
            }
        }
    }
}
