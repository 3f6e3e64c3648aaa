//! Reading and judging what a backend sent before anything reaches the client: a whole body
//! (bounded), a stream's first chunk (before the attempt's deadline), whether a 2xx is the kind of
//! answer the request asked for, and whether a 404 is vLLM's model-not-found answer. Each failure
//! is an [`AttemptFailure`] the attempts (`attempts.rs`) retry on the next candidate.

use futures_util::future::{select, Either};
use routing_core::stream::outcome::{Outcome, OutcomeKind};
use serde_json::Value;
use std::time::Duration;
use wasm_bindgen::{JsCast, JsValue};
use wasm_bindgen_futures::JsFuture;

/// A failure of one attempt, before anything of it reached the client.
pub(crate) struct AttemptFailure {
    pub(crate) outcome: Outcome,
    pub(crate) reason: String,
    /// Whether another candidate may be tried.
    pub(crate) retryable: bool,
    /// The backend answered vLLM's model-not-found 404: it does not serve the model (any more).
    pub(crate) missing_model: bool,
}

impl AttemptFailure {
    pub(crate) fn new(kind: OutcomeKind, reason: String) -> AttemptFailure {
        AttemptFailure {
            outcome: Outcome::of_kind(kind),
            reason,
            retryable: true,
            missing_model: false,
        }
    }
}

/// Reads a whole body, up to `limit` bytes. A body that breaks off is a transport failure; one
/// over the limit is not retried (another backend would send as much).
pub(crate) async fn read_whole(
    stream: &web_sys::ReadableStream,
    limit: usize,
    backend: &str,
) -> Result<Vec<u8>, AttemptFailure> {
    let reader: web_sys::ReadableStreamDefaultReader = stream.get_reader().unchecked_into();
    let mut out = Vec::new();
    loop {
        let chunk = JsFuture::from(reader.read()).await.map_err(|_| {
            AttemptFailure::new(
                OutcomeKind::Transport,
                format!("backend {backend} broke off its answer"),
            )
        })?;
        let done = js_sys::Reflect::get(&chunk, &"done".into())
            .ok()
            .and_then(|v| v.as_bool())
            .unwrap_or(true);
        if done {
            return Ok(out);
        }
        let Ok(bytes) = js_sys::Reflect::get(&chunk, &"value".into())
            .and_then(|v| v.dyn_into::<js_sys::Uint8Array>())
        else {
            return Err(AttemptFailure::new(
                OutcomeKind::Transport,
                format!("backend {backend} sent an unreadable chunk"),
            ));
        };
        let n = bytes.length() as usize;
        if out.len() + n > limit {
            let _ = reader.cancel();
            return Err(AttemptFailure {
                outcome: Outcome::from_status(200),
                reason: format!("backend {backend} answered more than {limit} bytes"),
                retryable: false,
                missing_model: false,
            });
        }
        let at = out.len();
        out.resize(at + n, 0);
        bytes.copy_to(&mut out[at..]);
    }
}

/// Reads the first chunk of a stream before `deadline` (the attempt's, of `timeout`); the reader,
/// still holding the stream, reads the rest.
pub(crate) async fn read_first_chunk(
    stream: &web_sys::ReadableStream,
    deadline: &mut (impl std::future::Future<Output = ()> + Unpin),
    timeout: Duration,
    backend: &str,
) -> Result<(web_sys::ReadableStreamDefaultReader, JsValue), AttemptFailure> {
    let reader: web_sys::ReadableStreamDefaultReader = stream.get_reader().unchecked_into();
    let read = JsFuture::from(reader.read());
    let result = match select(read, deadline).await {
        Either::Left((r, _)) => Some(r),
        Either::Right(_) => None,
    };
    let fail = AttemptFailure::new;
    let chunk = match result {
        None => {
            let _ = reader.cancel();
            let mut failure = fail(
                OutcomeKind::Timeout,
                format!(
                    "backend {backend} sent no first token within {} ms",
                    timeout.as_millis()
                ),
            );
            // How long it waited, for the pool to weigh against the backend's queue.
            failure.outcome.ttfb_ms = Some(timeout.as_millis() as u64);
            return Err(failure);
        }
        Some(Err(_)) => {
            return Err(fail(
                OutcomeKind::Transport,
                format!("backend {backend} failed before its first token"),
            ))
        }
        Some(Ok(r)) => r,
    };
    let done = js_sys::Reflect::get(&chunk, &"done".into())
        .ok()
        .and_then(|v| v.as_bool())
        .unwrap_or(true);
    if done {
        return Err(fail(
            OutcomeKind::Transport,
            format!("backend {backend} closed the stream before its first token"),
        ));
    }
    let value = js_sys::Reflect::get(&chunk, &"value".into()).map_err(|_| {
        fail(
            OutcomeKind::Transport,
            format!("backend {backend} sent an unreadable chunk"),
        )
    })?;
    Ok((reader, value))
}

/// A 2xx whose content type is not what the request asked for (`wanted`): the backend's failure,
/// retried elsewhere, never passed on as a success.
pub(crate) fn not_an_answer(backend: &str, content_type: &str, wanted: &str) -> AttemptFailure {
    let shown: String = content_type
        .chars()
        .take(64)
        .filter(|c| c.is_ascii_graphic() || *c == ' ')
        .collect();
    let shown = if shown.is_empty() { "none" } else { &shown };
    AttemptFailure {
        outcome: Outcome {
            kind: OutcomeKind::ServerError,
            ..Outcome::from_status(200)
        },
        ..AttemptFailure::new(
            OutcomeKind::ServerError,
            format!("backend {backend} answered with content type {shown}, not {wanted}"),
        )
    }
}

/// Whether a 404 body is vLLM's "model does not exist" answer: an OpenAI-style error (nested
/// under `error` or, in older vLLM, at the top) of type `NotFoundError` or whose message says
/// the model does not exist. A bare `{"detail":"Not Found"}` (no such route) is not.
pub(crate) fn is_model_not_found(body: &[u8]) -> bool {
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return false;
    };
    let inner = v.get("error").filter(|e| e.is_object()).unwrap_or(&v);
    let kind = inner.get("type").and_then(Value::as_str).unwrap_or("");
    let message = inner.get("message").and_then(Value::as_str).unwrap_or("");
    kind == "NotFoundError" || (message.contains("model") && message.contains("does not exist"))
}
