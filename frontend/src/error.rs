//! The one place errors become HTTP: OpenAI's error JSON
//! `{"error": {"message", "type", "param", "code"}}` with the right status.
//! Server-side detail is logged here, once, and never sent to the client.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use tandem_modelfile::chat::ChatTemplateError;
use tandem_modelfile::tokenizer::TokenizerError;
use tandem_types::{GenFailure, InvalidRequest};

use crate::backend::SubmitError;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The request is malformed or asks for something we do not do (400).
    #[error("{message}")]
    InvalidRequest {
        message: String,
        param: Option<String>,
        code: Option<&'static str>,
    },
    /// No API key, or not one of ours (401).
    #[error("{0}")]
    Unauthorized(String),
    /// The model the request names is not served here (404).
    #[error("{0}")]
    ModelNotFound(String),
    /// No such route (404).
    #[error("{0}")]
    RouteNotFound(String),
    /// The route exists but not for this method (405).
    #[error("{0}")]
    MethodNotAllowed(String),
    /// A body that is not JSON (415).
    #[error("{0}")]
    UnsupportedMediaType(String),
    /// The body did not arrive in time (408; the connection is closed).
    #[error("{0}")]
    RequestTimeout(String),
    /// The body exceeds `max_body_bytes` (413).
    #[error("{0}")]
    PayloadTooLarge(String),
    /// This API key (or client address) holds too much (429 with
    /// `Retry-After`).
    #[error("{0}")]
    RateLimited(String),
    /// Too many requests in flight, or bodies being received (503 with
    /// `Retry-After`).
    #[error("{0}")]
    Overloaded(String),
    /// The backend cannot take or finish requests now (503, retryable).
    /// `detail` is logged, not sent.
    #[error("{message}")]
    Unavailable {
        message: &'static str,
        detail: Option<String>,
    },
    /// Our fault (500). `detail` is logged, not sent.
    #[error("The server had an error while processing your request.")]
    Internal { detail: String },
}

/// OpenAI's error object.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ErrorBody {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ErrorResponse {
    pub error: ErrorBody,
}

impl ApiError {
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> Self {
        Self::InvalidRequest {
            message: message.into(),
            param: param.map(str::to_string),
            code: None,
        }
    }

    pub fn internal(detail: impl Into<String>) -> Self {
        Self::Internal {
            detail: detail.into(),
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            Self::InvalidRequest { .. } => StatusCode::BAD_REQUEST,
            Self::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            Self::ModelNotFound(_) | Self::RouteNotFound(_) => StatusCode::NOT_FOUND,
            Self::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            Self::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Self::RequestTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            Self::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Self::RateLimited(_) => StatusCode::TOO_MANY_REQUESTS,
            Self::Overloaded(_) | Self::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Self::Internal { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The JSON body (also sent as an SSE event when a stream fails).
    pub fn body(&self) -> ErrorResponse {
        let (kind, param, code) = match self {
            Self::InvalidRequest { param, code, .. } => {
                ("invalid_request_error", param.clone(), *code)
            }
            Self::Unauthorized(_) => ("invalid_request_error", None, Some("invalid_api_key")),
            Self::ModelNotFound(_) => ("not_found_error", None, Some("model_not_found")),
            Self::RouteNotFound(_) => ("not_found_error", None, Some("not_found")),
            Self::MethodNotAllowed(_) => {
                ("invalid_request_error", None, Some("method_not_allowed"))
            }
            Self::PayloadTooLarge(_) => ("invalid_request_error", None, Some("request_too_large")),
            Self::RequestTimeout(_) => ("invalid_request_error", None, Some("request_timeout")),
            Self::UnsupportedMediaType(_) => (
                "invalid_request_error",
                None,
                Some("unsupported_media_type"),
            ),
            Self::RateLimited(_) => ("rate_limit_error", None, Some("rate_limit_exceeded")),
            Self::Overloaded(_) => ("server_overloaded", None, Some("overloaded")),
            Self::Unavailable { .. } => ("service_unavailable", None, Some("unavailable")),
            Self::Internal { .. } => ("server_error", None, None),
        };
        ErrorResponse {
            error: ErrorBody {
                message: self.to_string(),
                kind,
                param,
                code,
            },
        }
    }

    /// Logs what the client is not told (server errors and their detail).
    /// Called where the error is handled: the response, or the SSE event.
    pub fn log(&self) {
        match self {
            Self::Internal { detail } => tracing::error!(status = 500, "{detail}"),
            Self::Unavailable { message, detail } => {
                tracing::warn!(status = 503, detail = detail.as_deref(), "{message}")
            }
            Self::Overloaded(m) => tracing::warn!(status = 503, "{m}"),
            _ => {}
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.log();
        let mut r = (self.status(), Json(self.body())).into_response();
        use axum::http::header;
        let extra = match self {
            Self::Unauthorized(_) => Some((header::WWW_AUTHENTICATE, "Bearer")),
            Self::RateLimited(_) | Self::Overloaded(_) => Some((header::RETRY_AFTER, "1")),
            // The rest of a body that came too slowly is not read: the
            // connection cannot carry another request.
            Self::RequestTimeout(_) => Some((header::CONNECTION, "close")),
            _ => None,
        };
        if let Some((name, value)) = extra {
            r.headers_mut()
                .insert(name, axum::http::HeaderValue::from_static(value));
        }
        r
    }
}

impl From<InvalidRequest> for ApiError {
    fn from(e: InvalidRequest) -> Self {
        Self::InvalidRequest {
            message: e.to_string(),
            param: e.param().map(str::to_string),
            code: e.code(),
        }
    }
}

impl From<GenFailure> for ApiError {
    fn from(e: GenFailure) -> Self {
        match e {
            GenFailure::ShuttingDown => Self::Unavailable {
                message: "The server is shutting down; retry the request.",
                detail: None,
            },
            GenFailure::Unavailable(detail) => Self::Unavailable {
                message: "No worker is available to serve the request; retry later.",
                detail: Some(detail),
            },
            GenFailure::Rejected(message) => Self::invalid(message, None),
            GenFailure::Internal(detail) => Self::Internal { detail },
        }
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        match e {
            SubmitError::Invalid(e) => e.into(),
            SubmitError::Failed(e) => e.into(),
        }
    }
}

impl From<TokenizerError> for ApiError {
    fn from(e: TokenizerError) -> Self {
        Self::invalid(e.to_string(), None)
    }
}

impl From<ChatTemplateError> for ApiError {
    fn from(e: ChatTemplateError) -> Self {
        Self::invalid(e.to_string(), Some("messages"))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn invalid_requests_name_their_field() {
        let e = ApiError::from(InvalidRequest::PromptTooLong { prompt: 10, max: 8 });
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        let b = e.body().error;
        assert_eq!(
            b.message,
            "Prompt is too long: 10 tokens exceeds the configured maximum context length of 8 tokens. Please shorten your prompt."
        );
        assert_eq!(b.code, Some("context_length_exceeded"));
        assert_eq!(b.param.as_deref(), Some("prompt"));
        let z = ApiError::from(InvalidRequest::ZeroMaxTokens).body().error;
        assert_eq!((z.param.as_deref(), z.code), (Some("max_tokens"), None));
    }

    /// Failures map by kind, and server-side detail never reaches the body.
    #[test]
    fn failures_map_by_kind_and_hide_detail() {
        let secret = "decode node 10.1.2.3:50051: ucp_put_nbx failed";
        for (f, status) in [
            (GenFailure::ShuttingDown, StatusCode::SERVICE_UNAVAILABLE),
            (
                GenFailure::Unavailable(secret.into()),
                StatusCode::SERVICE_UNAVAILABLE,
            ),
            (
                GenFailure::Internal(secret.into()),
                StatusCode::INTERNAL_SERVER_ERROR,
            ),
        ] {
            let e = ApiError::from(f.clone());
            assert_eq!(e.status(), status, "{f:?}");
            let body = serde_json::to_string(&e.body()).unwrap();
            assert!(!body.contains("10.1.2.3"), "{body}");
            assert!(!e.body().error.message.is_empty());
        }
        let r = ApiError::from(GenFailure::Rejected("top_k must be >= 0".into()));
        assert_eq!(r.status(), StatusCode::BAD_REQUEST);
        assert_eq!(r.body().error.message, "top_k must be >= 0");
    }

    #[test]
    fn a_missing_route_is_not_a_missing_model() {
        let r = ApiError::RouteNotFound("no such route".into()).body().error;
        let m = ApiError::ModelNotFound("no such model".into()).body().error;
        assert_eq!(
            (r.code, m.code),
            (Some("not_found"), Some("model_not_found"))
        );
    }

    #[test]
    fn body_shape() {
        let v = serde_json::to_value(ApiError::invalid("bad", Some("n")).body()).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"error": {"message": "bad", "type": "invalid_request_error", "param": "n", "code": null}})
        );
    }
}
