//! What the Worker does differently for vLLM's own routes passed through by model (issue 43:
//! `/tokenize`, `/detokenize`, `/v1/rerank`, `/v1/score`, `/pooling`, `/classify`, the audio
//! routes); their features are `routing_core::request::passthrough`'s. The audio routes' body is
//! multipart/form-data: it is read once, up to `MAX_BODY_BYTES` like every body (the attempts
//! send the same bytes to each candidate a retry moves to, so it cannot be streamed through), its
//! `model` and `stream` fields read in place, and the client's `content-type` (with its boundary)
//! forwarded. A backend that answers one of these routes with FastAPI's `404 {"detail":"Not
//! Found"}` does not serve the route for its model's task (a chat model asked to rerank): as for
//! every route (`forward/attempts.rs`), not the backend's failure, no breaker is charged, and the
//! client gets 404 `model_does_not_support_endpoint` naming the model and the route.

use routing_core::request::endpoint::Endpoint;
use routing_core::request::passthrough;
use routing_core::request::prompt::{PromptError, RequestFeatures};
use worker::Request;

/// The features of a multipart audio request, from its `content-type` header and body.
pub(crate) fn multipart_features(
    endpoint: Endpoint,
    body: &[u8],
    header: &dyn Fn(&str) -> Option<String>,
) -> Result<RequestFeatures, PromptError> {
    let content_type = header("content-type").unwrap_or_default();
    passthrough::multipart_features(endpoint, &content_type, body, header)
}

/// Adds the client's `content-type` to the headers sent upstream for a multipart route (its
/// boundary is the body's); JSON routes are sent as `application/json` by the attempts.
pub(crate) fn forward_content_type(
    endpoint: Endpoint,
    client: &Request,
    forwarded: &mut Vec<(String, String)>,
) {
    if !endpoint.is_multipart() {
        return;
    }
    if let Some(ct) = client.headers().get("content-type").ok().flatten() {
        forwarded.push(("content-type".to_string(), ct));
    }
}
