//! Errors of a node's request handling, rendered once into gRPC statuses.

use tandem_dkv::DkvError;
use tandem_engine::RequestError;
use tandem_proto::{ProtoError, failure_to_status};
use tandem_types::GenFailure;
use tonic::{Code, Status};

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// A malformed or incompatible message.
    #[error(transparent)]
    Proto(#[from] ProtoError),
    /// A request the engine refuses (prompt too long, bad sampling, ...).
    #[error(transparent)]
    Request(#[from] RequestError),
    #[error("KV transfer failed: {0}")]
    Transfer(#[from] DkvError),
    /// The KV region was registered by a connector we do not speak.
    #[error("KV region uses connector `{theirs}` but this node uses `{ours}`")]
    Connector { ours: String, theirs: String },
    #[error("deadline exceeded: {0}")]
    Deadline(String),
    #[error("the scheduler stopped")]
    Stopped,
    /// A request the scheduler accepted failed while running.
    #[error(transparent)]
    Failed(GenFailure),
    #[error("internal error: {0}")]
    Internal(String),
}

impl From<WorkerError> for Status {
    fn from(e: WorkerError) -> Status {
        let code = match &e {
            WorkerError::Proto(ProtoError::Fingerprint(_)) => Code::FailedPrecondition,
            WorkerError::Proto(ProtoError::Version { .. }) => Code::FailedPrecondition,
            WorkerError::Proto(_) | WorkerError::Connector { .. } => Code::InvalidArgument,
            WorkerError::Request(RequestError::Stopped) => Code::Unavailable,
            WorkerError::Request(RequestError::Invalid(_)) => Code::InvalidArgument,
            // Our failures, not the caller's.
            WorkerError::Request(
                RequestError::BlockTableTooShort { .. }
                | RequestError::KvCache(_)
                | RequestError::Tokenizer(_)
                | RequestError::Kernel(_)
                | RequestError::Collective(_)
                | RequestError::Device(_)
                | RequestError::LogitsShape { .. }
                | RequestError::Mock(_),
            ) => Code::Internal,
            WorkerError::Transfer(DkvError::OutOfBounds(_) | DkvError::InvalidDescriptor(_)) => {
                Code::InvalidArgument
            }
            // A region whose address no node of this cluster sealed.
            WorkerError::Transfer(DkvError::Unauthenticated(_)) => Code::PermissionDenied,
            WorkerError::Transfer(DkvError::DeadlineExceeded) | WorkerError::Deadline(_) => {
                Code::DeadlineExceeded
            }
            WorkerError::Transfer(_) | WorkerError::Stopped => Code::Unavailable,
            WorkerError::Internal(_) => Code::Internal,
            WorkerError::Failed(f) => return failure_to_status(f),
        };
        Status::new(code, e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_types::InvalidRequest;

    #[test]
    fn client_errors_are_invalid_argument_and_incompatibility_is_a_precondition() {
        let s = Status::from(WorkerError::Request(
            InvalidRequest::PromptTooLong { prompt: 10, max: 5 }.into(),
        ));
        assert_eq!(s.code(), Code::InvalidArgument);
        assert!(s.message().starts_with("Prompt is too long: 10 tokens"));
        let s = Status::from(WorkerError::Proto(ProtoError::Fingerprint("x".into())));
        assert_eq!(s.code(), Code::FailedPrecondition);
        let s = Status::from(WorkerError::Transfer(DkvError::DeadlineExceeded));
        assert_eq!(s.code(), Code::DeadlineExceeded);
        let s = Status::from(WorkerError::Transfer(DkvError::Unauthenticated("x".into())));
        assert_eq!(s.code(), Code::PermissionDenied);
        let s = Status::from(WorkerError::Stopped);
        assert_eq!(s.code(), Code::Unavailable);
    }

    /// A running request's failure crosses the wire and comes back as the
    /// same kind of failure.
    #[test]
    fn failures_round_trip_through_status() {
        for f in [
            GenFailure::Unavailable("x".into()),
            GenFailure::Rejected("bad top_k".into()),
            GenFailure::Internal("y".into()),
        ] {
            let back =
                tandem_proto::failure_from_status(&Status::from(WorkerError::Failed(f.clone())));
            assert_eq!(
                std::mem::discriminant(&back),
                std::mem::discriminant(&f),
                "{f:?} -> {back:?}"
            );
        }
        let s = Status::from(WorkerError::Failed(GenFailure::ShuttingDown));
        assert!(matches!(
            tandem_proto::failure_from_status(&s),
            GenFailure::Unavailable(_)
        ));
        if let GenFailure::Rejected(m) = tandem_proto::failure_from_status(&Status::from(
            WorkerError::Failed(GenFailure::Rejected("bad top_k".into())),
        )) {
            assert_eq!(m, "bad top_k");
        }
    }
}
