//! The gateway's own errors on Anthropic's Messages routes (`/v1/messages`,
//! `/v1/messages/count_tokens`), in the shape Anthropic's SDKs read:
//! `{"type":"error","error":{"type","message"}}`, each status with its Anthropic error type
//! (400 `invalid_request_error`, 401 `authentication_error`, 403 `permission_error`, 404
//! `not_found_error`, 413 `request_too_large`, 429 `rate_limit_error`, 500 `api_error`), and shed
//! load (the gateway's 503: no backend can take the request now) as Anthropic's 529
//! `overloaded_error`, which its SDKs retry. `Retry-After` and the gateway's own headers are kept.
//! Errors a backend answers are relayed as the backend wrote them (vLLM writes these routes'
//! errors in Anthropic's shape itself).

use coordinator_protocol::ApiError;
use serde_json::json;

/// Whether `path` is one of Anthropic's routes.
pub fn anthropic_path(path: &str) -> bool {
    matches!(
        path.trim_end_matches('/'),
        "/v1/messages" | "/v1/messages/count_tokens"
    )
}

/// Anthropic's status and error type for the gateway's `status`.
pub fn anthropic_status(status: u16) -> (u16, &'static str) {
    match status {
        400 | 405 | 422 => (status, "invalid_request_error"),
        401 => (401, "authentication_error"),
        403 => (403, "permission_error"),
        404 => (404, "not_found_error"),
        413 => (413, "request_too_large"),
        429 => (429, "rate_limit_error"),
        503 => (529, "overloaded_error"),
        s if s >= 500 => (s, "api_error"),
        s => (s, "invalid_request_error"),
    }
}

/// `e` as Anthropic's error response.
pub fn anthropic_response(e: &ApiError) -> worker::Result<worker::Response> {
    let (status, kind) = anthropic_status(e.status);
    let message = match &e.code {
        Some(code) => format!("{} ({code})", e.message),
        None => e.message.clone(),
    };
    let headers = worker::Headers::new();
    headers.set("content-type", "application/json")?;
    if let Some(s) = e.retry_after_s {
        headers.set("retry-after", &s.to_string())?;
    }
    for (name, value) in &e.headers {
        headers.set(name, value)?;
    }
    let body = json!({"type": "error", "error": {"type": kind, "message": message}});
    Ok(worker::Response::from_bytes(body.to_string().into_bytes())?
        .with_status(status)
        .with_headers(headers))
}
