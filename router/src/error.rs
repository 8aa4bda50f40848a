//! The one place errors become HTTP: OpenAI's error JSON
//! `{"error": {"message", "type", "param", "code"}}` with the right status.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use tandem_engine::RequestError;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The request is malformed or asks for something we do not do (400).
    #[error("{message}")]
    InvalidRequest {
        message: String,
        param: Option<String>,
        code: Option<&'static str>,
    },
    /// Unknown model or route (404).
    #[error("{0}")]
    NotFound(String),
    /// The body exceeds `max_body_bytes` (413).
    #[error("{0}")]
    PayloadTooLarge(String),
    /// Too many requests in flight (503, retryable).
    #[error("{0}")]
    Overloaded(String),
    /// The engine cannot take requests (503).
    #[error("{0}")]
    Unavailable(String),
    /// Our fault (500).
    #[error("{0}")]
    Internal(String),
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

    pub fn status(&self) -> StatusCode {
        match self {
            Self::InvalidRequest { .. } => StatusCode::BAD_REQUEST,
            Self::NotFound(_) => StatusCode::NOT_FOUND,
            Self::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Overloaded(_) | Self::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The JSON body (also sent as an SSE event when a stream fails).
    pub fn body(&self) -> ErrorResponse {
        let (kind, param, code) = match self {
            Self::InvalidRequest { param, code, .. } => {
                ("invalid_request_error", param.clone(), *code)
            }
            Self::NotFound(_) => ("not_found_error", None, Some("model_not_found")),
            Self::PayloadTooLarge(_) => ("invalid_request_error", None, Some("request_too_large")),
            Self::Overloaded(_) => ("server_overloaded", None, Some("overloaded")),
            Self::Unavailable(_) => ("service_unavailable", None, Some("unavailable")),
            Self::Internal(_) => ("server_error", None, None),
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
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        if status.is_server_error() {
            tracing::warn!(status = status.as_u16(), "{self}");
        }
        (status, Json(self.body())).into_response()
    }
}

impl From<RequestError> for ApiError {
    fn from(e: RequestError) -> Self {
        let message = e.to_string();
        match e {
            RequestError::PromptTooLong { .. } => Self::InvalidRequest {
                message,
                param: Some("messages".into()),
                code: Some("context_length_exceeded"),
            },
            RequestError::TokenOutOfRange { .. }
            | RequestError::EmptyPrompt
            | RequestError::ZeroMaxTokens
            | RequestError::Sampling(_)
            | RequestError::Tokenizer(_)
            | RequestError::ChatTemplate(_) => Self::invalid(message, None),
            RequestError::Unavailable(_) => Self::Unavailable(message),
            RequestError::BlockTableTooShort { .. }
            | RequestError::KvCache(_)
            | RequestError::Kernel(_)
            | RequestError::Collective(_) => Self::Internal(message),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn engine_errors_are_classified() {
        let e = ApiError::from(RequestError::PromptTooLong { prompt: 10, max: 8 });
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        assert_eq!(
            e.body().error.message,
            "Prompt is too long: 10 tokens exceeds the configured maximum context length of 8 tokens. Please shorten your prompt."
        );
        assert_eq!(e.body().error.code, Some("context_length_exceeded"));
        let u = ApiError::from(RequestError::Unavailable("scheduler stopped"));
        assert_eq!(u.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            ApiError::from(RequestError::EmptyPrompt).status(),
            StatusCode::BAD_REQUEST
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
