//! The streamed answer's way to the client: the upstream body is piped through a `TransformStream`
//! whose transform, a wasm function, passes each chunk on and lets `routing_core::usage`'s
//! scanner read it on the way (the backend's usage, and the usage event to take out when the
//! client did not ask for it). Whole events go out as the same JS chunk; only a trailing partial
//! event is held until its end arrives.
//!
//! [`Relay::pipe`] drives one upstream body through it in `wait_until` and says how it ended:
//! cleanly, abandoned by the client, or failed: cut by the backend (a reset, or a close before
//! `data: [DONE]`) or idle for longer than `STREAM_IDLE_TIMEOUT_MS` after the first byte (the
//! upstream is then aborted). Idle time counts only while the client keeps up: a client that stops
//! reading holds chunks in the relay's queue and the backend is not blamed for the pause. A failed
//! stream is either resumed (`resume.rs` pipes a continuation into the same relay) or ended with
//! [`Relay::fail`]: an SSE error event, always at an event boundary, and `data: [DONE]`.
//!
//! For a stream that could be resumed, the relay also reads the answer the client receives
//! ([`Relay::collect`], `routing_core::resume::Partial`), and rewrites a continuation's events into
//! the client's stream ([`Relay::splice`]); other streams take the plain path, where a chunk of
//! whole events is passed on as the same JS chunk without a copy.

use coordinator_protocol::timed_fetch::{with_timeout, LinkedAbort};
use futures_util::future::{select, Either};
use routing_core::outcome::OutcomeKind;
use routing_core::resume::{Partial, Splice};
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
type StartFn = dyn FnMut(web_sys::TransformStreamDefaultController);

struct State {
    scanner: StreamScanner,
    strip_usage_event: bool,
    buf: Vec<u8>,
    last_chunk_ms: u64,
    controller: Option<web_sys::TransformStreamDefaultController>,
    /// The answer the client received, read only for a stream that could be resumed.
    partial: Option<Partial>,
    /// Rewrites a continuation's events into the client's stream.
    splice: Option<Splice>,
}

impl State {
    /// One upstream chunk in, the client's bytes out: a chunk of whole events goes on as the same
    /// JS chunk (read on the way when the stream could be resumed) unless a continuation is
    /// being spliced.
    fn transform(
        &mut self,
        chunk: &JsValue,
        controller: &web_sys::TransformStreamDefaultController,
    ) -> Result<(), JsValue> {
        self.last_chunk_ms = Date::now().as_millis();
        if self.controller.is_none() {
            self.controller = Some(controller.clone());
        }
        let Some(bytes) = chunk.dyn_ref::<js_sys::Uint8Array>() else {
            return controller.enqueue_with_chunk(chunk);
        };
        let n = bytes.length() as usize;
        self.buf.resize(n, 0);
        bytes.copy_to(&mut self.buf[..n]);
        let emit = self.scanner.push(&self.buf[..n]);
        if self.splice.is_some() {
            let out = match emit {
                Emit::Whole => self.buf[..n].to_vec(),
                Emit::Prefix(k) => self.buf[..k].to_vec(),
                Emit::Bytes(out) => out,
            };
            return self.send(out, controller);
        }
        if let Some(partial) = &mut self.partial {
            match &emit {
                Emit::Whole => partial.observe(&self.buf[..n]),
                Emit::Prefix(k) => partial.observe(&self.buf[..*k]),
                Emit::Bytes(out) => partial.observe(out),
            }
        }
        match emit {
            Emit::Whole => controller.enqueue_with_chunk(chunk),
            Emit::Prefix(0) => Ok(()),
            Emit::Prefix(k) => controller.enqueue_with_chunk(&bytes.subarray(0, k as u32)),
            Emit::Bytes(out) if out.is_empty() => Ok(()),
            Emit::Bytes(out) => controller.enqueue_with_chunk(&js_sys::Uint8Array::from(&out[..])),
        }
    }

    /// Sends bytes through the splice and the reading of the answer.
    fn send(
        &mut self,
        out: Vec<u8>,
        controller: &web_sys::TransformStreamDefaultController,
    ) -> Result<(), JsValue> {
        let out = match &mut self.splice {
            Some(splice) => splice.rewrite(&out),
            None => out,
        };
        if let Some(partial) = &mut self.partial {
            partial.observe(&out);
        }
        if out.is_empty() {
            return Ok(());
        }
        controller.enqueue_with_chunk(&js_sys::Uint8Array::from(&out[..]))
    }
}

/// The client's side of a streamed answer.
pub struct Relay {
    stream: web_sys::TransformStream,
    state: Rc<RefCell<State>>,
    // The JS stream calls these until it closes; they live as long as the relay.
    _start: Closure<StartFn>,
    _transform: Closure<TransformFn>,
    _flush: Closure<FlushFn>,
}

impl Relay {
    /// A relay; `strip_usage_event` when the client did not ask for the usage chunk.
    pub fn new(strip_usage_event: bool) -> Result<Relay, JsValue> {
        let state = Rc::new(RefCell::new(State {
            scanner: StreamScanner::new(strip_usage_event),
            strip_usage_event,
            buf: Vec::new(),
            last_chunk_ms: Date::now().as_millis(),
            controller: None,
            partial: None,
            splice: None,
        }));
        let s = state.clone();
        let start = Closure::<StartFn>::new(
            move |controller: web_sys::TransformStreamDefaultController| {
                s.borrow_mut().controller = Some(controller);
            },
        );
        let s = state.clone();
        let transform = Closure::<TransformFn>::new(
            move |chunk: JsValue, controller: web_sys::TransformStreamDefaultController| {
                s.borrow_mut().transform(&chunk, &controller)
            },
        );
        let s = state.clone();
        let flush = Closure::<FlushFn>::new(
            move |controller: web_sys::TransformStreamDefaultController| {
                let mut st = s.borrow_mut();
                let rest = st.scanner.finish();
                if rest.is_empty() {
                    return Ok(());
                }
                st.send(rest, &controller)
            },
        );
        let transformer = web_sys::Transformer::new();
        transformer.set_start(start.as_ref().unchecked_ref());
        transformer.set_transform(transform.as_ref().unchecked_ref());
        transformer.set_flush(flush.as_ref().unchecked_ref());
        let readable_strategy = web_sys::QueuingStrategy::new();
        readable_strategy.set_high_water_mark(QUEUED_CHUNKS);
        let stream =
            web_sys::TransformStream::new_with_transformer_and_writable_strategy_and_readable_strategy(
                &transformer,
                &web_sys::QueuingStrategy::new(),
                &readable_strategy,
            )?;
        Ok(Relay {
            stream,
            state,
            _start: start,
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

    /// The usage the current upstream reported so far.
    pub fn usage(&self) -> Option<Usage> {
        self.state.borrow().scanner.usage()
    }

    /// Starts reading the answer the client receives (a stream that could be resumed).
    pub fn collect(&self) {
        self.state.borrow_mut().partial = Some(Partial::new());
    }

    /// After a failure: the answer the client received, or why it cannot be continued (the
    /// failure cut an event the client already got part of). `None` when it was not read.
    pub fn partial(&self) -> Option<std::cell::Ref<'_, Partial>> {
        std::cell::Ref::filter_map(self.state.borrow(), |s| s.partial.as_ref()).ok()
    }

    /// Drops what the failed upstream left unfinished; says whether the client is in the middle
    /// of an event (only after a long event was let through).
    pub fn abandon(&self) -> bool {
        self.state.borrow_mut().scanner.abandon()
    }

    /// The next upstream is a continuation: its events are rewritten by `splice`, and it is read
    /// as a stream of its own (its own usage and `data: [DONE]`).
    pub fn splice(&self, splice: Splice) {
        let mut st = self.state.borrow_mut();
        st.scanner = StreamScanner::new(st.strip_usage_event);
        st.splice = Some(splice);
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

/// How one upstream body ended.
pub enum Piped {
    /// Whole, `data: [DONE]` included, and the client's side closed.
    Complete,
    /// The client went away.
    Cancelled,
    /// The backend failed after the first byte; the client's side is still open.
    Failed(StreamFailure),
}

/// A backend's failure after the first byte.
pub struct StreamFailure {
    /// `Transport` (reset or early close) or `Timeout` (idle).
    pub kind: OutcomeKind,
    /// The SSE error event's code: `upstream_stream_error` or `upstream_idle_timeout`.
    pub code: &'static str,
    /// The SSE error event's message.
    pub message: String,
}

/// What [`Relay::pipe`] needs besides the relay itself.
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

impl Relay {
    /// Pipes one upstream body through the relay to the client and says how it ended. A complete
    /// stream closes the client's side; a failed one leaves it open for a continuation or
    /// [`Relay::fail`].
    pub async fn pipe(&self, up: Upstream, client_signal: &AbortSignal) -> Piped {
        let writable = self.writable();
        if let Some(chunk) = &up.first_chunk {
            // Straight through the transform (the controller came with the stream's start): no
            // writer to take and release.
            let controller = self.state.borrow().controller.clone();
            if let Some(controller) = controller {
                let _ = self.state.borrow_mut().transform(chunk, &controller);
            } else {
                let Ok(writer) = writable.get_writer() else {
                    return Piped::Cancelled;
                };
                let _ = JsFuture::from(writer.write_with_chunk(chunk)).await;
                writer.release_lock();
            }
        }
        let options = web_sys::StreamPipeOptions::new();
        options.set_prevent_close(true);
        options.set_prevent_abort(true);
        let pipe = Box::pin(JsFuture::from(
            up.body.pipe_to_with_options(&writable, &options),
        ));
        let watchdog = Box::pin(idle_watchdog(self, up.idle_timeout));
        let backend = &up.backend;
        match select(pipe, watchdog).await {
            Either::Left((piped, _)) => match piped {
                _ if client_signal.aborted() => Piped::Cancelled,
                // The pipe can settle normally after the client hung up; the close then fails.
                // A backend that closed its stream early without an error (a close-delimited
                // body cut short, or no `data: [DONE]`) failed as much as one that reset the
                // connection.
                Ok(_) if !self.state.borrow().scanner.complete() => {
                    worker::console_error!(
                        "stream from backend {backend} ended before data: [DONE]"
                    );
                    Piped::Failed(StreamFailure {
                        kind: OutcomeKind::Transport,
                        code: "upstream_stream_error",
                        message: format!("The backend ({backend}) ended the stream early; the response is incomplete."),
                    })
                }
                Ok(_) if !close(self, &writable, None).await || client_signal.aborted() => {
                    Piped::Cancelled
                }
                Ok(_) => Piped::Complete,
                Err(e) => {
                    let reason = e
                        .as_string()
                        .unwrap_or_else(|| "the backend's stream failed".to_string());
                    worker::console_error!(
                        "stream from backend {backend} failed mid-way: {reason}"
                    );
                    Piped::Failed(StreamFailure {
                        kind: OutcomeKind::Transport,
                        code: "upstream_stream_error",
                        message: format!("The backend ({backend}) failed while streaming; the response is incomplete."),
                    })
                }
            },
            Either::Right(((), pipe)) => {
                up.abort.abort();
                // The aborted upstream errors the pipe, which then lets go of the client's side.
                let _ = with_timeout(pipe, Duration::from_secs(2)).await;
                if client_signal.aborted() {
                    return Piped::Cancelled;
                }
                let idle = up.idle_timeout.as_millis();
                worker::console_error!("stream from backend {backend} idle for {idle} ms: aborted");
                Piped::Failed(StreamFailure {
                    kind: OutcomeKind::Timeout,
                    code: "upstream_idle_timeout",
                    message: format!("The backend ({backend}) sent nothing for {idle} ms while streaming; the response is incomplete."),
                })
            }
        }
    }

    /// Ends a failed stream: the error event (at an event boundary), `data: [DONE]`, and the
    /// client's side closed.
    pub async fn fail(&self, failure: &StreamFailure) {
        let event = error_event(failure.code, &failure.message);
        close(self, &self.writable(), Some(&event)).await;
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
