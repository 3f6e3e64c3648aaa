//! The streamed answer's way to the client: the upstream body is piped through a `TransformStream`
//! whose transform, a wasm function, passes each chunk on and lets `routing_core::usage`'s
//! scanner read it on the way (the backend's usage, and the usage event to take out when the
//! client did not ask for it). Whole events go out as the same JS chunk; only a trailing partial
//! event is held until its end arrives.
//!
//! [`relay`] drives the pipe in `wait_until` and decides how the stream ended: cleanly, cut by
//! the backend (a reset, or a close before `data: [DONE]`; the client's stream then ends with an
//! SSE error event, always at an event boundary, and `data: [DONE]`), idle for longer than `STREAM_IDLE_TIMEOUT_MS` after the first
//! byte (the upstream is aborted and the same error event is sent), or abandoned by the client.
//! Idle time counts only while the client keeps up: a client that stops reading holds chunks in
//! the relay's queue and the backend is not blamed for the pause.

use coordinator_protocol::timed_fetch::{with_timeout, LinkedAbort};
use futures_util::future::{select, Either};
use routing_core::outcome::OutcomeKind;
use routing_core::usage::{Emit, StreamScanner, Usage};
use serde_json::json;
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;
use wasm_bindgen::closure::Closure;
use wasm_bindgen::{JsCast, JsValue};
use wasm_bindgen_futures::JsFuture;
use worker::{AbortSignal, Date, Delay};

/// Chunks the relay queues for a client that reads slowly before it stops reading upstream.
const QUEUED_CHUNKS: f64 = 16.0;

type TransformFn =
    dyn FnMut(JsValue, web_sys::TransformStreamDefaultController) -> Result<(), JsValue>;
type FlushFn = dyn FnMut(web_sys::TransformStreamDefaultController) -> Result<(), JsValue>;

struct State {
    scanner: StreamScanner,
    buf: Vec<u8>,
    last_chunk_ms: u64,
    controller: Option<web_sys::TransformStreamDefaultController>,
}

/// The client's side of a streamed answer.
pub struct Relay {
    stream: web_sys::TransformStream,
    state: Rc<RefCell<State>>,
    // The JS stream calls these until it closes; they live as long as the relay.
    _transform: Closure<TransformFn>,
    _flush: Closure<FlushFn>,
}

impl Relay {
    /// A relay; `strip_usage_event` when the client did not ask for the usage chunk.
    pub fn new(strip_usage_event: bool) -> Result<Relay, JsValue> {
        let state = Rc::new(RefCell::new(State {
            scanner: StreamScanner::new(strip_usage_event),
            buf: Vec::new(),
            last_chunk_ms: Date::now().as_millis(),
            controller: None,
        }));
        let s = state.clone();
        let transform = Closure::<TransformFn>::new(
            move |chunk: JsValue, controller: web_sys::TransformStreamDefaultController| {
                let mut st = s.borrow_mut();
                let st = &mut *st;
                st.last_chunk_ms = Date::now().as_millis();
                if st.controller.is_none() {
                    st.controller = Some(controller.clone());
                }
                let Some(bytes) = chunk.dyn_ref::<js_sys::Uint8Array>() else {
                    return controller.enqueue_with_chunk(&chunk);
                };
                let n = bytes.length() as usize;
                st.buf.resize(n, 0);
                bytes.copy_to(&mut st.buf[..n]);
                match st.scanner.push(&st.buf[..n]) {
                    Emit::Whole => controller.enqueue_with_chunk(&chunk),
                    Emit::Prefix(0) => Ok(()),
                    Emit::Prefix(k) => controller.enqueue_with_chunk(&bytes.subarray(0, k as u32)),
                    Emit::Bytes(out) if out.is_empty() => Ok(()),
                    Emit::Bytes(out) => {
                        controller.enqueue_with_chunk(&js_sys::Uint8Array::from(&out[..]))
                    }
                }
            },
        );
        let s = state.clone();
        let flush = Closure::<FlushFn>::new(
            move |controller: web_sys::TransformStreamDefaultController| {
                let rest = s.borrow_mut().scanner.finish();
                if rest.is_empty() {
                    return Ok(());
                }
                controller.enqueue_with_chunk(&js_sys::Uint8Array::from(&rest[..]))
            },
        );
        let transformer = js_sys::Object::new();
        js_sys::Reflect::set(&transformer, &"transform".into(), transform.as_ref())?;
        js_sys::Reflect::set(&transformer, &"flush".into(), flush.as_ref())?;
        let readable_strategy = js_sys::Object::new();
        js_sys::Reflect::set(
            &readable_strategy,
            &"highWaterMark".into(),
            &QUEUED_CHUNKS.into(),
        )?;
        let ctor: js_sys::Function =
            js_sys::Reflect::get(&js_sys::global(), &"TransformStream".into())?.dyn_into()?;
        let args = js_sys::Array::of3(&transformer, &js_sys::Object::new(), &readable_strategy);
        let stream: web_sys::TransformStream =
            js_sys::Reflect::construct(&ctor, &args)?.unchecked_into();
        Ok(Relay {
            stream,
            state,
            _transform: transform,
            _flush: flush,
        })
    }

    /// The client's response body.
    pub fn readable(&self) -> web_sys::ReadableStream {
        self.stream.readable()
    }

    fn writable(&self) -> web_sys::WritableStream {
        self.stream.writable()
    }

    /// The usage the stream reported so far.
    pub fn usage(&self) -> Option<Usage> {
        self.state.borrow().scanner.usage()
    }

    /// Milliseconds since the last chunk, counting a client that is behind as activity.
    fn idle_ms(&self) -> u64 {
        let now = Date::now().as_millis();
        let mut st = self.state.borrow_mut();
        let behind = st
            .controller
            .as_ref()
            .and_then(|c| c.desired_size())
            .is_some_and(|d| d < QUEUED_CHUNKS);
        if behind {
            st.last_chunk_ms = now;
        }
        now.saturating_sub(st.last_chunk_ms)
    }
}

/// How a relayed stream ended.
pub struct RelayEnd {
    /// The class of ending (success, cut by the backend, idle timeout, client gone).
    pub kind: OutcomeKind,
    /// The usage the backend reported, if it got that far.
    pub usage: Option<Usage>,
}

/// What [`relay`] needs besides the relay itself.
pub struct Upstream {
    /// The backend's body, after its first chunk.
    pub body: web_sys::ReadableStream,
    /// The first chunk, read by the proxy.
    pub first_chunk: Option<JsValue>,
    /// Aborts the upstream fetch.
    pub abort: LinkedAbort,
    /// The backend's id (for the error event and logs).
    pub backend: String,
    /// Longest silence after the first byte.
    pub idle_timeout: Duration,
}

/// Pipes the upstream body through the relay to the client and says how the stream ended.
pub async fn relay(relay: Relay, up: Upstream, client_signal: &AbortSignal) -> RelayEnd {
    let kind = drive(&relay, up, client_signal).await;
    RelayEnd {
        kind,
        usage: relay.usage(),
    }
}

async fn drive(relay: &Relay, up: Upstream, client_signal: &AbortSignal) -> OutcomeKind {
    let writable = relay.writable();
    if let Some(chunk) = &up.first_chunk {
        let Ok(writer) = writable.get_writer() else {
            return OutcomeKind::Cancelled;
        };
        let _ = JsFuture::from(writer.write_with_chunk(chunk)).await;
        writer.release_lock();
    }
    let options = web_sys::StreamPipeOptions::new();
    options.set_prevent_close(true);
    options.set_prevent_abort(true);
    let pipe = Box::pin(JsFuture::from(
        up.body.pipe_to_with_options(&writable, &options),
    ));
    let watchdog = Box::pin(idle_watchdog(relay, up.idle_timeout));
    match select(pipe, watchdog).await {
        Either::Left((piped, _)) => match piped {
            _ if client_signal.aborted() => OutcomeKind::Cancelled,
            // The pipe can settle normally after the client hung up; the close then fails.
            // A backend that closed its stream early without an error (a close-delimited body cut
            // short, or no `data: [DONE]`) failed as much as one that reset the connection.
            Ok(_) if !relay.state.borrow().scanner.complete() => {
                worker::console_error!(
                    "stream from backend {} ended before data: [DONE]",
                    up.backend
                );
                let message = format!(
                    "The backend ({}) ended the stream early; the response is incomplete.",
                    up.backend
                );
                close(
                    relay,
                    &writable,
                    Some(&error_event("upstream_stream_error", &message)),
                )
                .await;
                OutcomeKind::Transport
            }
            Ok(_) if !close(relay, &writable, None).await || client_signal.aborted() => {
                OutcomeKind::Cancelled
            }
            Ok(_) => OutcomeKind::Success,
            Err(e) => {
                let reason = e
                    .as_string()
                    .unwrap_or_else(|| "the backend's stream failed".to_string());
                worker::console_error!(
                    "stream from backend {} failed mid-way: {reason}",
                    up.backend
                );
                let message = format!(
                    "The backend ({}) failed while streaming; the response is incomplete.",
                    up.backend
                );
                close(
                    relay,
                    &writable,
                    Some(&error_event("upstream_stream_error", &message)),
                )
                .await;
                OutcomeKind::Transport
            }
        },
        Either::Right(((), pipe)) => {
            up.abort.abort();
            // The aborted upstream errors the pipe, which then lets go of the client's side.
            let _ = with_timeout(pipe, Duration::from_secs(2)).await;
            if client_signal.aborted() {
                return OutcomeKind::Cancelled;
            }
            worker::console_error!(
                "stream from backend {} idle for {} ms: aborted",
                up.backend,
                up.idle_timeout.as_millis()
            );
            let message = format!(
                "The backend ({}) sent nothing for {} ms while streaming; the response is incomplete.",
                up.backend,
                up.idle_timeout.as_millis()
            );
            close(
                relay,
                &writable,
                Some(&error_event("upstream_idle_timeout", &message)),
            )
            .await;
            OutcomeKind::Timeout
        }
    }
}

/// Resolves once no chunk has passed for `idle` while the client kept up.
async fn idle_watchdog(relay: &Relay, idle: Duration) {
    let idle_ms = idle.as_millis() as u64;
    loop {
        let since = relay.idle_ms();
        if since >= idle_ms {
            return;
        }
        Delay::from(Duration::from_millis(idle_ms - since)).await;
    }
}

/// Writes an optional final error event, then closes the client's side of the stream. The event
/// starts on an event boundary whatever the backend left unfinished. Returns `false` when the
/// client's side was already gone.
async fn close(
    relay: &Relay,
    writable: &web_sys::WritableStream,
    final_event: Option<&str>,
) -> bool {
    let Ok(writer) = writable.get_writer() else {
        return false;
    };
    if let Some(event) = final_event {
        let mid_event = relay.state.borrow_mut().scanner.abandon();
        let text = if mid_event {
            format!("\n\n{event}")
        } else {
            event.to_string()
        };
        let bytes = js_sys::Uint8Array::from(text.as_bytes());
        let _ = JsFuture::from(writer.write_with_chunk(&bytes)).await;
    }
    JsFuture::from(writer.close()).await.is_ok()
}

/// The SSE events that end a stream whose backend failed after the first byte.
fn error_event(code: &str, message: &str) -> String {
    let body = json!({ "error": { "message": message, "type": "server_error", "param": null, "code": code } });
    format!("data: {body}\n\ndata: [DONE]\n\n")
}
