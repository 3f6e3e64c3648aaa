//! Reading and judging what a backend sent before anything reaches the client: a whole body
//! (bounded), a stream's first chunk (before the attempt's deadline), whether a 2xx is the kind of
//! answer the request asked for. Each failure is an [`AttemptFailure`] the attempts
//! (`attempts.rs`) retry on the next candidate. A stream's first chunk must carry an answer: an
//! error event first (vLLM's failure after its headers) fails the attempt like a first byte that
//! never came, and keep-alive comments alone are no first token (more is read, by the same
//! deadline); `routing_core::stream::usage::first_chunk` judges.

use futures_util::future::{select, Either};
use routing_core::stream::outcome::{Outcome, OutcomeKind};
use routing_core::stream::usage::{first_chunk, FirstChunk};
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
    /// The backend's server has no route for the endpoint (FastAPI's 404 `{"detail":"Not
    /// Found"}`): its model does not serve it (embeddings on a chat model). No breaker charge.
    pub(crate) unserved_endpoint: bool,
}

impl AttemptFailure {
    pub(crate) fn new(kind: OutcomeKind, reason: String) -> AttemptFailure {
        AttemptFailure {
            outcome: Outcome::of_kind(kind),
            reason,
            retryable: true,
            missing_model: false,
            unserved_endpoint: false,
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
                unserved_endpoint: false,
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
    let fail = AttemptFailure::new;
    // The chunks read so far, while they hold no answer yet (keep-alive comments only).
    let mut seen: Vec<u8> = Vec::new();
    loop {
        let read = JsFuture::from(reader.read());
        let result = match select(read, &mut *deadline).await {
            Either::Left((r, _)) => Some(r),
            Either::Right(_) => None,
        };
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
        let Some(bytes) = value.dyn_ref::<js_sys::Uint8Array>() else {
            return Ok((reader, value));
        };
        let at = seen.len();
        seen.resize(at + bytes.length() as usize, 0);
        bytes.copy_to(&mut seen[at..]);
        // Comments without end are not held for ever: past the scanner's bound, let them pass.
        let verdict = match seen.len() > routing_core::stream::usage::MAX_HELD_BYTES {
            true => FirstChunk::Answer,
            false => first_chunk(&seen),
        };
        match verdict {
            FirstChunk::Answer => {
                // The first chunk as the client gets it: the comments before it included.
                let value = match at {
                    0 => value,
                    _ => js_sys::Uint8Array::from(&seen[..]).into(),
                };
                return Ok((reader, value));
            }
            FirstChunk::Error(message) => {
                let _ = reader.cancel();
                worker::console_error!(
                    "backend {backend} sent an error event before its first token: {message}"
                );
                return Err(AttemptFailure {
                    outcome: Outcome {
                        kind: OutcomeKind::ServerError,
                        ..Outcome::from_status(200)
                    },
                    ..fail(
                        OutcomeKind::ServerError,
                        format!("backend {backend} failed before its first token (an error event)"),
                    )
                });
            }
            // Keep-alive comments only: no first token yet; read on by the same deadline.
            FirstChunk::NoTokenYet => {}
        }
    }
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
