//! The errors a request can meet, rendered as vLLM renders them: the OpenAI-style JSON error body
//! with vLLM's types and messages, and the plain bodies its middleware answers with (401, 404, 405).
//! Both the router ([`crate::server`]) and the OpenAI handlers ([`crate::api`]) return them.

use hyper::{Response, StatusCode};
use serde_json::json;

use crate::body::{self, SimBody};
use crate::openai::{ErrorBody, ErrorDetail};

/// Everything that can go wrong between a request and its response.
#[derive(Debug, Clone, PartialEq)]
pub enum ApiError {
    /// 400: malformed JSON, missing or invalid fields, prompts that do not fit.
    BadRequest(String),
    /// 404: the requested model is not served.
    ModelNotFound(String),
    /// 401: `--api-key` is set and the bearer token is missing or wrong.
    Unauthorized,
    /// 429 (fault injection).
    RateLimited,
    /// 5xx (fault injection).
    Injected(u16),
    /// 503: the model is loading.
    Loading,
    /// 404 for an unknown path.
    RouteNotFound,
    /// 405 for a known path with the wrong method.
    MethodNotAllowed,
    /// 500: the engine task is gone.
    EngineGone,
    /// Drop the connection without a response (fault injection).
    Disconnect,
}

impl ApiError {
    /// The error as vLLM answers it. [`ApiError::Disconnect`] has no response; it is handled by
    /// the server, and renders as a 500 if it ever gets here.
    pub fn into_response(self) -> Response<SimBody> {
        let detail = |status: StatusCode, kind: &str, message: &str, param: Option<&str>| {
            body::json(
                status,
                &ErrorBody {
                    error: ErrorDetail {
                        message,
                        kind,
                        param,
                        code: status.as_u16(),
                    },
                },
            )
        };
        match self {
            ApiError::BadRequest(message) => {
                detail(StatusCode::BAD_REQUEST, "BadRequestError", &message, None)
            }
            ApiError::ModelNotFound(model) => detail(
                StatusCode::NOT_FOUND,
                "NotFoundError",
                &format!("The model `{model}` does not exist."),
                Some("model"),
            ),
            // vLLM's API-key middleware answers exactly this.
            ApiError::Unauthorized => {
                body::json(StatusCode::UNAUTHORIZED, &json!({"error": "Unauthorized"}))
            }
            ApiError::RateLimited => {
                let mut response = detail(
                    StatusCode::TOO_MANY_REQUESTS,
                    "RateLimitError",
                    "Too many requests (simulated)",
                    None,
                );
                response
                    .headers_mut()
                    .insert("retry-after", hyper::header::HeaderValue::from_static("1"));
                response
            }
            ApiError::Injected(status) => {
                let status =
                    StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
                let kind = if status == StatusCode::SERVICE_UNAVAILABLE {
                    "ServiceUnavailableError"
                } else {
                    "InternalServerError"
                };
                detail(
                    status,
                    kind,
                    "Simulated server error (fault injection)",
                    None,
                )
            }
            ApiError::Loading => detail(
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailableError",
                "The model is loading",
                None,
            ),
            ApiError::RouteNotFound => {
                body::json(StatusCode::NOT_FOUND, &json!({"detail": "Not Found"}))
            }
            ApiError::MethodNotAllowed => body::json(
                StatusCode::METHOD_NOT_ALLOWED,
                &json!({"detail": "Method Not Allowed"}),
            ),
            ApiError::EngineGone | ApiError::Disconnect => detail(
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalServerError",
                "The engine is not running",
                None,
            ),
        }
    }
}
