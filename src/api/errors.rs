//! Error responses in each protocol's own shape: OpenAI's
//! `{"error": {"message", "type", "param", "code"}}` and Anthropic's
//! `{"type": "error", "error": {"type", "message"}}`.

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use deepinfer_engine::request::RequestError;
use deepseek_recipe::request::ConversionError;
use serde_json::json;

use super::metrics;

/// `Retry-After` of a 429, in seconds.
pub const RETRY_AFTER_SECS: &str = "1";
/// `Retry-After` of a 503, in seconds: a lost node is declared down and its
/// work moved within a failure timeout (seconds), and a load balancer may
/// send the retry to another front end at once.
pub const RETRY_UNAVAILABLE_SECS: &str = "2";

/// Which protocol's error body to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavor {
    OpenAi,
    Anthropic,
}

/// What went wrong, independent of the protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    InvalidRequest,
    ContextLength,
    Unauthorized,
    ModelNotFound,
    NotFound,
    TooLarge,
    MethodNotAllowed,
    UnsupportedMediaType,
    Timeout,
    RateLimited,
    Internal,
    Unavailable,
}

/// An error answer: its kind, message and the protocol to write it in.
#[derive(Clone, Debug)]
pub struct ApiError {
    pub flavor: Flavor,
    pub kind: Kind,
    pub message: String,
}

impl ApiError {
    pub fn new(flavor: Flavor, kind: Kind, message: impl Into<String>) -> Self {
        Self { flavor, kind, message: message.into() }
    }

    pub fn bad_request(flavor: Flavor, message: impl Into<String>) -> Self {
        Self::new(flavor, Kind::InvalidRequest, message)
    }

    pub fn conversion(flavor: Flavor, e: ConversionError) -> Self {
        let kind = match &e {
            ConversionError::BadRequest { detail } if detail.contains("maximum context length") => Kind::ContextLength,
            ConversionError::BadRequest { .. } => Kind::InvalidRequest,
            ConversionError::Internal { .. } => Kind::Internal,
        };
        Self::new(flavor, kind, e.to_string())
    }

    pub fn engine(flavor: Flavor, e: &RequestError) -> Self {
        let kind = match e {
            RequestError::QueueFull { .. } => Kind::RateLimited,
            RequestError::PromptTooLong { .. } | RequestError::ExceedsKvBudget { .. } => Kind::ContextLength,
            _ => Kind::InvalidRequest,
        };
        Self::new(flavor, kind, e.to_string())
    }

    pub fn status(&self) -> StatusCode {
        match self.kind {
            Kind::InvalidRequest | Kind::ContextLength => StatusCode::BAD_REQUEST,
            Kind::Unauthorized => StatusCode::UNAUTHORIZED,
            Kind::ModelNotFound | Kind::NotFound => StatusCode::NOT_FOUND,
            Kind::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Kind::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Kind::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Kind::Timeout => StatusCode::REQUEST_TIMEOUT,
            Kind::RateLimited => StatusCode::TOO_MANY_REQUESTS,
            Kind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            Kind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The JSON body, also used for an error event inside a stream.
    pub fn body(&self) -> serde_json::Value {
        match self.flavor {
            Flavor::OpenAi => {
                let (kind, code) = match self.kind {
                    Kind::InvalidRequest => ("invalid_request_error", None),
                    Kind::ContextLength => ("invalid_request_error", Some("context_length_exceeded")),
                    Kind::Unauthorized => ("invalid_request_error", Some("invalid_api_key")),
                    Kind::ModelNotFound => ("invalid_request_error", Some("model_not_found")),
                    Kind::NotFound => ("invalid_request_error", Some("unknown_url")),
                    Kind::TooLarge => ("invalid_request_error", Some("request_too_large")),
                    Kind::MethodNotAllowed => ("invalid_request_error", Some("method_not_allowed")),
                    Kind::UnsupportedMediaType => ("invalid_request_error", Some("unsupported_media_type")),
                    Kind::Timeout => ("invalid_request_error", Some("request_timeout")),
                    Kind::RateLimited => ("rate_limit_error", Some("rate_limit_exceeded")),
                    Kind::Internal => ("server_error", None),
                    Kind::Unavailable => ("server_error", Some("service_unavailable")),
                };
                json!({"error": {"message": self.message, "type": kind, "param": null, "code": code}})
            }
            Flavor::Anthropic => {
                let kind = match self.kind {
                    Kind::InvalidRequest | Kind::ContextLength => "invalid_request_error",
                    Kind::Unauthorized => "authentication_error",
                    Kind::ModelNotFound | Kind::NotFound => "not_found_error",
                    Kind::TooLarge => "request_too_large",
                    Kind::MethodNotAllowed | Kind::UnsupportedMediaType | Kind::Timeout => "invalid_request_error",
                    Kind::RateLimited => "rate_limit_error",
                    Kind::Internal => "api_error",
                    Kind::Unavailable => "overloaded_error",
                };
                json!({"type": "error", "error": {"type": kind, "message": self.message}})
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        metrics::http_error(status.as_u16());
        let mut response = (status, Json(self.body())).into_response();
        let retry_after = match self.kind {
            // Requests in flight finish within seconds at most loads; retry soon.
            Kind::RateLimited => Some(RETRY_AFTER_SECS),
            // Nothing can serve it now: retryable, unlike a 500.
            Kind::Unavailable => Some(RETRY_UNAVAILABLE_SECS),
            _ => None,
        };
        if let Some(secs) = retry_after {
            response.headers_mut().insert(header::RETRY_AFTER, header::HeaderValue::from_static(secs));
        }
        response
    }
}
