//! OpenAI-style errors, the one shape every failure takes on its way to a client.
//!
//! Clients of an OpenAI-compatible server parse `{"error": {"message", "type", "param", "code"}}`,
//! so the Worker, the admin API and the Durable Objects all answer with this body and the matching
//! HTTP status. The Durable Objects use the same type, which lets the Worker pass their errors
//! through unchanged; a pool's refusals are worded in [`crate::refusal`].

use serde::{Deserialize, Serialize};

/// An error as an OpenAI client expects it, plus its HTTP status and optional `Retry-After`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status code.
    pub status: u16,
    /// Human-readable explanation; never contains a secret.
    pub message: String,
    /// OpenAI error type.
    pub kind: ErrorKind,
    /// Machine-readable code, such as `model_not_found`.
    pub code: Option<String>,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    /// Seconds a client should wait before retrying (503, 429).
    pub retry_after_s: Option<u32>,
    /// Further response headers (such as the queue's drop reason).
    pub headers: Vec<(String, String)>,
}

/// The OpenAI error types the gateway answers with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// `invalid_request_error`: the request is at fault.
    InvalidRequest,
    /// `authentication_error`: a missing or wrong token.
    Authentication,
    /// `rate_limit_error`: over a limit or a full queue.
    RateLimit,
    /// `server_error`: the gateway or the upstream failed.
    Server,
}

impl ErrorKind {
    /// The type's name in the error body.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::InvalidRequest => "invalid_request_error",
            ErrorKind::Authentication => "authentication_error",
            ErrorKind::RateLimit => "rate_limit_error",
            ErrorKind::Server => "server_error",
        }
    }

    /// Reads a type's name; anything unknown counts as a server error.
    pub fn parse(name: &str) -> ErrorKind {
        [
            ErrorKind::InvalidRequest,
            ErrorKind::Authentication,
            ErrorKind::RateLimit,
        ]
        .into_iter()
        .find(|k| k.as_str() == name)
        .unwrap_or(ErrorKind::Server)
    }
}

/// The JSON body of an error response.
#[derive(Debug, Serialize, Deserialize)]
pub struct ErrorBody {
    /// The error object.
    pub error: ErrorObject,
}

/// The `error` object inside [`ErrorBody`].
#[derive(Debug, Serialize, Deserialize)]
pub struct ErrorObject {
    /// Human-readable explanation.
    pub message: String,
    /// OpenAI error type.
    #[serde(rename = "type")]
    pub kind: String,
    /// The request field at fault.
    pub param: Option<String>,
    /// Machine-readable code.
    pub code: Option<String>,
}

impl ApiError {
    pub(crate) fn new(
        status: u16,
        kind: ErrorKind,
        code: Option<&'static str>,
        message: impl Into<String>,
    ) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            code: code.map(str::to_string),
            param: None,
            retry_after_s: None,
            headers: Vec::new(),
        }
    }

    /// 400: the request is malformed or fails validation.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, ErrorKind::InvalidRequest, None, message)
    }

    /// 401: missing or wrong bearer token.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(
            401,
            ErrorKind::Authentication,
            Some("invalid_api_key"),
            message,
        )
    }

    /// 404: no such route or resource.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(404, ErrorKind::InvalidRequest, Some("not_found"), message)
    }

    /// 404 `model_not_found`: no backend anywhere lists this model.
    pub fn model_not_found(model: &str) -> Self {
        Self::new(
            404,
            ErrorKind::InvalidRequest,
            Some("model_not_found"),
            format!("The model `{model}` does not exist or is not served by any backend."),
        )
        .with_param("model")
    }

    /// 404 `response_not_found`: the stored Responses API response `id` (named by
    /// `previous_response_id`, or in `/v1/responses/{id}`) is held by no backend the gateway can
    /// reach: it was never recorded, or the backend that stored it was removed or is down.
    pub fn response_not_found(id: &str, param: &str) -> Self {
        Self::new(
            404,
            ErrorKind::InvalidRequest,
            Some("response_not_found"),
            format!(
                "The response `{id}` is not held by any backend the gateway can reach: the \
                 server that stored it was removed or is down, or the id is unknown (stored \
                 responses live in one vLLM server's memory)."
            ),
        )
        .with_param(param)
    }

    /// 404 `model_does_not_support_endpoint`: the model's servers have no such route (vLLM
    /// registers only the routes of its model's task: no embeddings for a chat model).
    pub fn model_does_not_support(model: &str, what: &str) -> Self {
        Self::new(
            404,
            ErrorKind::InvalidRequest,
            Some("model_does_not_support_endpoint"),
            format!("The model `{model}` does not support {what}."),
        )
        .with_param("model")
    }

    /// 405: the route exists but not with this method.
    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        Self::new(
            405,
            ErrorKind::InvalidRequest,
            Some("method_not_allowed"),
            format!("Method {method} is not allowed on {path}."),
        )
    }

    /// 409: the resource already exists.
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(409, ErrorKind::InvalidRequest, Some("conflict"), message)
    }

    /// 413: the body is larger than the configured limit.
    pub fn payload_too_large(limit: usize) -> Self {
        Self::new(
            413,
            ErrorKind::InvalidRequest,
            Some("payload_too_large"),
            format!("Request body exceeds the limit of {limit} bytes."),
        )
    }

    /// 429: the client is over its rate limit.
    pub fn rate_limited(message: impl Into<String>, retry_after_s: u32) -> Self {
        Self::new(
            429,
            ErrorKind::RateLimit,
            Some("rate_limit_exceeded"),
            message,
        )
        .with_retry_after(retry_after_s)
    }

    /// 499 `client_closed_request`: the client closed the request before it was answered (the
    /// status nginx logs for it; nobody reads the answer).
    pub fn client_closed() -> Self {
        Self::new(
            499,
            ErrorKind::InvalidRequest,
            Some("client_closed_request"),
            "The client closed the request.",
        )
    }

    /// 500: a fault of the gateway itself (should never be seen; logged).
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(500, ErrorKind::Server, Some("internal_error"), message)
    }

    /// 502 `shards_incomplete`: an admin change reached some of a pool's coordinator shards but
    /// not every one; the message names the shards that failed and why. The admin changes are
    /// safe to repeat, and repeating the same call completes it.
    pub fn shards_incomplete(message: impl Into<String>) -> Self {
        Self::new(502, ErrorKind::Server, Some("shards_incomplete"), message)
    }

    /// 421: a regional Worker cannot read the hop context the edge sent (a newer version during a
    /// deploy); the edge serves the request itself (`src/request/hop.rs`).
    pub fn hop_context_unreadable(message: impl Into<String>) -> Self {
        Self::new(
            421,
            ErrorKind::InvalidRequest,
            Some("hop_context_unreadable"),
            message,
        )
    }

    /// 502: the upstream failed after every allowed attempt.
    pub fn bad_gateway(message: impl Into<String>) -> Self {
        Self::new(502, ErrorKind::Server, Some("upstream_error"), message)
    }

    /// 503: no backend can take the request now.
    pub fn unavailable(message: impl Into<String>, retry_after_s: u32) -> Self {
        Self::new(
            503,
            ErrorKind::Server,
            Some("no_backend_available"),
            message,
        )
        .with_retry_after(retry_after_s)
    }

    /// 504: the upstream did not answer in time.
    pub fn gateway_timeout(message: impl Into<String>) -> Self {
        Self::new(504, ErrorKind::Server, Some("upstream_timeout"), message)
    }

    /// Rebuilds an error from a status and a decoded body (an answer relayed from a Durable Object).
    pub fn from_parts(status: u16, error: ErrorObject) -> Self {
        ApiError {
            status,
            message: error.message,
            kind: ErrorKind::parse(&error.kind),
            code: error.code,
            param: error.param,
            retry_after_s: None,
            headers: Vec::new(),
        }
    }

    /// Names the request field at fault.
    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    /// Replaces the machine-readable code.
    pub fn with_code(mut self, code: &str) -> Self {
        self.code = Some(code.to_string());
        self
    }

    /// Adds a `Retry-After` header.
    pub fn with_retry_after(mut self, seconds: u32) -> Self {
        self.retry_after_s = Some(seconds);
        self
    }

    /// Adds a response header.
    pub fn with_header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.to_string(), value.to_string()));
        self
    }

    /// The JSON body.
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorObject {
                message: self.message.clone(),
                kind: self.kind.as_str().to_string(),
                param: self.param.clone(),
                code: self.code.clone(),
            },
        }
    }

    /// The error a body that does not parse as `what` gets.
    pub fn invalid_body(what: &str, e: impl std::fmt::Display) -> Self {
        Self::bad_request(format!("invalid {what}: {e}"))
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status, self.message)
    }
}

#[cfg(feature = "worker")]
impl From<worker::Error> for ApiError {
    /// 500 from a platform error (storage, bindings); the detail goes to the log, not the client.
    fn from(e: worker::Error) -> Self {
        worker::console_error!("internal error: {e}");
        Self::internal("The gateway hit an internal error; it has been logged.")
    }
}

#[cfg(feature = "worker")]
impl ApiError {
    /// Builds the HTTP response.
    pub fn to_response(&self) -> worker::Result<worker::Response> {
        let headers = worker::Headers::new();
        headers.set("content-type", "application/json")?;
        if let Some(s) = self.retry_after_s {
            headers.set("retry-after", &s.to_string())?;
        }
        for (name, value) in &self.headers {
            headers.set(name, value)?;
        }
        let body = serde_json::to_vec(&self.body())
            .map_err(|e| worker::Error::RustError(e.to_string()))?;
        Ok(worker::Response::from_bytes(body)?
            .with_status(self.status)
            .with_headers(headers))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_survives_the_trip_through_its_body() {
        let e = ApiError::model_not_found("m");
        let body = serde_json::to_string(&e.body()).unwrap();
        let back: ErrorBody = serde_json::from_str(&body).unwrap();
        assert_eq!(ApiError::from_parts(404, back.error), e);
        assert!(body.contains(r#""type":"invalid_request_error""#), "{body}");
    }

    #[test]
    fn an_error_fits_in_a_small_result() {
        // Small enough for clippy's `result_large_err` (128 bytes): no allow, no box.
        assert!(std::mem::size_of::<ApiError>() <= 128);
    }
}
