//! The errors a request can meet, rendered as vLLM renders them: the OpenAI-style JSON error body
//! with vLLM's types and messages, and the plain bodies its middleware answers with (401, 404, 405).
//! Both the router ([`crate::server`]) and the OpenAI handlers ([`crate::api`]) return them. Types
//! and statuses follow vLLM 0.34.0's `create_error_response`
//! (`vllm/entrypoints/serve/exception_handling/error_response.py`).

use hyper::{Response, StatusCode};
use serde_json::json;

use crate::body::{self, SimBody};
use crate::openai::{ErrorBody, ErrorDetail};

/// `QueueOverflowError`'s message (`vllm/exceptions.py`, 0.34.0).
pub const QUEUE_OVERFLOW_MESSAGE: &str = "The engine is currently busy and cannot accept new requests. Please try again later or on a different instance.";
/// `MaxQueuedTokensError`'s message (`vllm/exceptions.py`, 0.34.0).
pub const MAX_QUEUED_TOKENS_MESSAGE: &str = "The engine has reached its prefill token backlog limit. Please try again later or on a different instance.";
/// `GenerationError`'s message as `_raise_if_error` raises it
/// (`vllm/entrypoints/generate/base/serving.py`, 0.34.0).
pub const GENERATION_ERROR_MESSAGE: &str = "Internal server error";

/// Everything that can go wrong between a request and its response.
#[derive(Debug, Clone, PartialEq)]
pub enum ApiError {
    /// 400: malformed JSON, missing or invalid fields, prompts that do not fit.
    BadRequest(String),
    /// 400 from vLLM's `VLLMValidationError` with a parameter: the message ends with
    /// ` (parameter=P, value=V)` and `param` is `P` (`vllm/exceptions.py`).
    Invalid {
        /// The message before the suffix.
        message: String,
        /// `param`.
        param: &'static str,
        /// The rejected value.
        value: String,
    },
    /// 503 from vLLM 0.34's load shedding (`QueueOverflowError` / `MaxQueuedTokensError`,
    /// `vllm/exceptions.py`): type `Service Unavailable`, no `Retry-After`.
    Shed(crate::state::Shed),
    /// 500 from a `GenerationError` (`finish_reason == "error"`, e.g. a KV load failure):
    /// "Internal server error", type `InternalServerError`.
    Generation,
    /// 404: the requested model is not served.
    ModelNotFound(String),
    /// 401: `--api-key` is set and the bearer token is missing or wrong.
    Unauthorized,
    /// 429 (fault injection).
    RateLimited,
    /// 5xx (fault injection).
    Injected(u16),
    /// 503: the model is loading (only with the `loading_answers_503` fault; vLLM 0.34 refuses
    /// connections instead).
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
            ApiError::Invalid {
                message,
                param,
                value,
            } => detail(
                StatusCode::BAD_REQUEST,
                "BadRequestError",
                &format!("{message} (parameter={param}, value={value})"),
                Some(param),
            ),
            ApiError::Shed(shed) => detail(
                StatusCode::SERVICE_UNAVAILABLE,
                "Service Unavailable",
                match shed {
                    crate::state::Shed::QueuedReqs => QUEUE_OVERFLOW_MESSAGE,
                    crate::state::Shed::QueuedTokens => MAX_QUEUED_TOKENS_MESSAGE,
                },
                None,
            ),
            ApiError::Generation => detail(
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalServerError",
                GENERATION_ERROR_MESSAGE,
                None,
            ),
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
