//! The streamed answer's way to the client: a small JavaScript loop (`relay_pump`) reads the upstream
//! body and hands each chunk, synchronously, to a wasm function that passes it on and lets
//! `routing_core::stream::usage`'s scanner read it on the way (the backend's usage, and the usage event to
//! take out when the client did not ask for it); what it returns is written to the client's side,
//! the platform's native `IdentityTransformStream`. Whole events go out as the same JS chunk; only
//! a trailing partial event is held until its end arrives. (A `TransformStream` with a wasm
//! `transform` did the same at about a fifth more CPU per streamed token in workerd: its queues and
//! the pipe into it are promise machinery per chunk, which a native stream and a plain loop skip.)
//!
//! [`Relay::pipe`] drives one upstream body through it in `wait_until` and says how it ended:
//! cleanly, abandoned by the client, or failed: cut by the backend (a reset, or a close before
//! `data: [DONE]`) or idle for longer than `STREAM_IDLE_TIMEOUT_MS` after the first byte (the
//! upstream is then aborted). The relay reads the backend's answer whatever the client's pace
//! (issue 42, item 5): a client that reads slower than the backend writes has up to
//! `RELAY_BUFFER_BYTES` queued for it in the relay, so the backend's work, and the lease, end when
//! the backend's body ends; a client that falls further behind is cut off (the upstream aborted,
//! the client's side failed, the reason logged as `slow_client_cut_off`, nobody blamed). A stream
//! whose scanner saw `data: [DONE]` is complete whatever the upstream socket does next (a reset
//! after the end is not a failure). A complete stream is handed back at once, so its lease ends
//! with the backend's work; [`Relay::drain`] then waits for the client to read what is queued, and
//! cuts off one that takes nothing for `SLOW_CLIENT_TIMEOUT_MS` meanwhile. A failed stream is
//! either resumed (`resume.rs` pipes a continuation into the same relay)
//! or ended with [`Relay::fail`]: an SSE error event, always at an event boundary, and
//! `data: [DONE]`.
//!
//! For a stream that could be resumed, the relay also reads the answer the client receives
//! ([`Relay::collect`], `routing_core::stream::resume::Partial`), and rewrites a continuation's events into
//! the client's stream ([`Relay::splice`]); other streams take the plain path, where a chunk of
//! whole events is passed on as the same JS chunk without a copy.

use crate::platform::http::Deadlines;
use coordinator_protocol::timed_fetch::{with_timeout, LinkedAbort};
use futures_util::future::{select, Either};
use routing_core::stream::outcome::OutcomeKind;
use routing_core::stream::resume::{Partial, Splice};
use routing_core::stream::settle::Streamed;
use routing_core::stream::usage::{is_keep_alive, Emit, StreamScanner, Usage};
use serde_json::json;
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;
use wasm_bindgen::closure::Closure;
use wasm_bindgen::prelude::wasm_bindgen;
use wasm_bindgen::{JsCast, JsValue};
use wasm_bindgen_futures::JsFuture;
use worker::AbortSignal;

/// The relay's JavaScript: the client's side of the stream (`relay_open`: its readable side, its
/// writer and the pump's status, made in one call), and the loop that moves one upstream body into
/// it. `pump` reads `reader` to its end as fast as the backend sends, passes each chunk (the first
/// one, read by the proxy, included) to `transform` and writes what it returns (unless
/// `undefined`) without waiting for the client to take it: `status.queued` counts the chunks not
/// yet taken and `status.bytes` their size. When those pass `bound` bytes (the client fell that far
/// behind), `status.over` is set and the pump stops reading; `status.gone` is set when the
/// client's side fails (the upstream is then cancelled), and `status.progress` is when the client
/// last took a chunk. It resolves with how it ended (`"ended"`: the upstream's end; `"gone"`: the
/// client's side failed; `"over"`: past the bound), and rejects when the upstream fails or is
/// aborted (the client's side stays open). `relay_cut` fails the client's side (a client cut off
/// for not reading).
#[wasm_bindgen(inline_js = r#"
export function relay_open() {
  const stream = typeof IdentityTransformStream === "function" ? new IdentityTransformStream() : new TransformStream();
  const status = { queued: 0, bytes: 0, gone: false, over: false, progress: Date.now() };
  return [stream.readable, stream.writable.getWriter(), status];
}
export function relay_pump(reader, writer, transform, status, first, bound) {
  const gone = () => {
    status.gone = true;
    reader.cancel().catch(() => {});
  };
  writer.closed.catch(gone);
  const send = (chunk) => {
    const out = transform(chunk);
    if (out === undefined) return;
    const size = out.byteLength ?? 0;
    status.queued += 1;
    status.bytes += size;
    if (status.bytes > bound) status.over = true;
    writer.write(out).then(() => {
      status.queued -= 1;
      status.bytes -= size;
      status.progress = Date.now();
    }, gone);
  };
  const run = async () => {
    if (first !== undefined) send(first);
    for (;;) {
      if (status.gone) return "gone";
      if (status.over) return "over";
      const { done, value } = await reader.read();
      if (status.gone) return "gone";
      if (done) return "ended";
      send(value);
    }
  };
  const done = run();
  done.catch(() => {});
  return done;
}
export function relay_cut(writer) {
  writer.abort(new Error("the client stopped reading")).catch(() => {});
}
"#)]
extern "C" {
    #[wasm_bindgen(catch)]
    fn relay_open() -> Result<js_sys::Array, JsValue>;
    fn relay_pump(
        reader: &web_sys::ReadableStreamDefaultReader,
        writer: &web_sys::WritableStreamDefaultWriter,
        transform: &JsValue,
        status: &js_sys::Object,
        first: &JsValue,
        bound: f64,
    ) -> js_sys::Promise;
    fn relay_cut(writer: &web_sys::WritableStreamDefaultWriter);
}

type TransformFn = dyn FnMut(JsValue) -> JsValue;

struct State {
    scanner: StreamScanner,
    strip_usage_event: bool,
    buf: Vec<u8>,
    last_chunk_ms: u64,
    /// The answer the client received, read only for a stream that could be resumed.
    partial: Option<Partial>,
    /// Rewrites a continuation's events into the client's stream.
    splice: Option<Splice>,
    /// Answer events the earlier upstreams of a resumed stream passed (their scanners are gone).
    answers_before: u32,
}

impl State {
    /// One upstream chunk in, the client's bytes out (`undefined`: nothing yet): a chunk of whole
    /// events goes on as the same JS chunk (read on the way when the stream could be resumed)
    /// unless a continuation is being spliced.
    fn transform(&mut self, chunk: &JsValue) -> JsValue {
        let Some(bytes) = chunk.dyn_ref::<js_sys::Uint8Array>() else {
            self.last_chunk_ms = crate::platform::http::now_ms();
            return chunk.clone();
        };
        let n = bytes.length() as usize;
        self.buf.resize(n, 0);
        bytes.copy_to(&mut self.buf[..n]);
        // A keep-alive comment is no sign of the engine's progress: the idle timer runs on.
        if !is_keep_alive(&self.buf[..n]) {
            self.last_chunk_ms = crate::platform::http::now_ms();
        }
        let emit = self.scanner.push(&self.buf[..n]);
        if self.splice.is_some() {
            let out = match emit {
                Emit::Whole => self.buf[..n].to_vec(),
                Emit::Prefix(k) => self.buf[..k].to_vec(),
                Emit::Bytes(out) => out,
            };
            return self.send(out);
        }
        if let Some(partial) = &mut self.partial {
            match &emit {
                Emit::Whole => partial.observe(&self.buf[..n]),
                Emit::Prefix(k) => partial.observe(&self.buf[..*k]),
                Emit::Bytes(out) => partial.observe(out),
            }
        }
        match emit {
            Emit::Whole => chunk.clone(),
            Emit::Prefix(0) => JsValue::UNDEFINED,
            Emit::Prefix(k) => bytes.subarray(0, k as u32).into(),
            Emit::Bytes(out) if out.is_empty() => JsValue::UNDEFINED,
            Emit::Bytes(out) => js_sys::Uint8Array::from(&out[..]).into(),
        }
    }

    /// Bytes through the splice and the reading of the answer, as the client's chunk.
    fn send(&mut self, out: Vec<u8>) -> JsValue {
        let out = match &mut self.splice {
            Some(splice) => splice.rewrite(&out),
            None => out,
        };
        if let Some(partial) = &mut self.partial {
            partial.observe(&out);
        }
        if out.is_empty() {
            return JsValue::UNDEFINED;
        }
        js_sys::Uint8Array::from(&out[..]).into()
    }
}

/// The client's side of a streamed answer.
pub struct Relay {
    readable: web_sys::ReadableStream,
    writer: web_sys::WritableStreamDefaultWriter,
    /// `{queued, gone}`, kept by `relay_pump`.
    status: js_sys::Object,
    state: Rc<RefCell<State>>,
    // The pump calls it until the stream ends; it lives as long as the relay.
    transform: Closure<TransformFn>,
    /// `SLOW_CLIENT_TIMEOUT_MS`.
    slow_client_timeout: Duration,
    /// `RELAY_BUFFER_BYTES`: how far behind the backend a client may fall.
    buffer_bytes: u64,
    /// The request's deadlines (the watchdog's and the drain's waits).
    deadlines: Deadlines,
    /// The API whose stream this is (its error event's shape).
    endpoint: routing_core::request::endpoint::Endpoint,
}

impl Relay {
    /// A relay; `strip_usage_event` when the client did not ask for the usage chunk.
    pub fn new(strip_usage_event: bool, deadlines: Deadlines) -> Result<Relay, JsValue> {
        let state = Rc::new(RefCell::new(State {
            scanner: StreamScanner::new(strip_usage_event),
            strip_usage_event,
            buf: Vec::new(),
            last_chunk_ms: crate::platform::http::now_ms(),
            partial: None,
            splice: None,
            answers_before: 0,
        }));
        let s = state.clone();
        let transform =
            Closure::<TransformFn>::new(move |chunk: JsValue| s.borrow_mut().transform(&chunk));
        // The client's side, its writer and the pump's status, made in one call.
        let opened = relay_open()?;
        let readable: web_sys::ReadableStream = opened.get(0).unchecked_into();
        let writer: web_sys::WritableStreamDefaultWriter = opened.get(1).unchecked_into();
        let status: js_sys::Object = opened.get(2).unchecked_into();
        Ok(Relay {
            readable,
            writer,
            status,
            state,
            transform,
            slow_client_timeout: crate::platform::isolate::slow_client_timeout(),
            buffer_bytes: crate::platform::isolate::relay_buffer_bytes(),
            deadlines,
            endpoint: Default::default(),
        })
    }

    /// The relay of a stream of `endpoint`'s API: a failure ends it with that API's error event
    /// (`routing_core::stream::api_events`; chat and completions keep the OpenAI one).
    pub fn for_endpoint(mut self, endpoint: routing_core::request::endpoint::Endpoint) -> Self {
        self.endpoint = endpoint;
        self
    }

    /// The client's response body.
    pub fn readable(&self) -> web_sys::ReadableStream {
        self.readable.clone()
    }

    /// The usage the current upstream reported so far.
    pub fn usage(&self) -> Option<Usage> {
        self.state.borrow().scanner.usage()
    }

    /// The id of the response a Responses API stream answered with, once its terminal event
    /// passed.
    pub fn response_id(&self) -> Option<String> {
        self.state
            .borrow()
            .scanner
            .response_id()
            .map(str::to_string)
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

    /// What the client received so far, read by the lease guard when it settles the request (a
    /// client that hangs up mid-stream is charged what it got).
    pub fn meter(&self) -> Meter {
        // The state, not the relay: the guard may settle after the relay is gone.
        Meter {
            state: self.state.clone(),
        }
    }

    /// Whether the client held the stream up: it fell `RELAY_BUFFER_BYTES` behind the backend,
    /// and the relay stopped reading the backend's answer.
    pub fn held(&self) -> bool {
        self.status("over").as_bool().unwrap_or(false)
    }

    /// The next upstream is a continuation: its events are rewritten by `splice`, and it is read
    /// as a stream of its own (its own usage and `data: [DONE]`).
    pub fn splice(&self, splice: Splice) {
        let mut st = self.state.borrow_mut();
        st.answers_before += st.scanner.answer_events();
        st.scanner = StreamScanner::new(st.strip_usage_event);
        st.splice = Some(splice);
        // Its first chunk has just arrived: the idle time starts again.
        st.last_chunk_ms = crate::platform::http::now_ms();
    }

    /// A number or flag of the pump's status object.
    fn status(&self, key: &str) -> JsValue {
        js_sys::Reflect::get(&self.status, &key.into()).unwrap_or(JsValue::UNDEFINED)
    }

    /// Whether the client's side failed (the client went away).
    fn client_gone(&self) -> bool {
        self.status("gone").as_bool().unwrap_or(false)
    }

    /// Milliseconds since the backend's last chunk (the relay reads it whatever the client's
    /// pace, so a silence is the backend's).
    fn idle_ms(&self) -> u64 {
        let now = crate::platform::http::now_ms();
        now.saturating_sub(self.state.borrow().last_chunk_ms)
    }

    /// Writes one chunk to the client's side; `false` when it is gone.
    async fn write(&self, chunk: &JsValue) -> bool {
        JsFuture::from(self.writer.write_with_chunk(chunk))
            .await
            .is_ok()
    }
}

/// What the client received of a stream, read when the request ends ([`Relay::meter`]).
pub struct Meter {
    state: Rc<RefCell<State>>,
}

impl Meter {
    /// The answer events passed to the client, and the usage it was told (a resumed stream's
    /// totals: the prompt once, every completion token).
    pub fn streamed(&self) -> Streamed {
        let st = self.state.borrow();
        let reported = st
            .scanner
            .usage()
            .map(|u| st.splice.as_ref().map_or(u, |s| s.client_usage(u)));
        Streamed {
            reported,
            answer_events: st.answers_before + st.scanner.answer_events(),
            counted: None,
        }
    }

    /// The answer text the client received, when the stream was read on its way (one that could
    /// be resumed) and all of it was (`Partial::received_text`).
    pub fn received_text(&self) -> Option<String> {
        let st = self.state.borrow();
        st.partial
            .as_ref()
            .and_then(|p| p.received_text())
            .map(str::to_string)
    }
}

/// How one upstream body ended.
pub enum Piped {
    /// Whole, `data: [DONE]` included: the backend's work is done. The client may still be
    /// reading what the relay queued; [`Relay::drain`] ends its side.
    Complete,
    /// The client went away.
    Cancelled,
    /// The client fell `RELAY_BUFFER_BYTES` behind the backend: the upstream was aborted and the
    /// client's side failed.
    CutOff,
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
    /// The backend's body, locked to this reader, after its first chunk.
    pub reader: web_sys::ReadableStreamDefaultReader,
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
    /// stream is handed to [`Relay::drain`]; a failed one leaves the client's side open for a
    /// continuation or [`Relay::fail`].
    pub async fn pipe(&self, up: Upstream, client_signal: &AbortSignal) -> Piped {
        let first = up.first_chunk.clone().unwrap_or(JsValue::UNDEFINED);
        let pump = Box::pin(JsFuture::from(relay_pump(
            &up.reader,
            &self.writer,
            self.transform.as_ref(),
            &self.status,
            &first,
            self.buffer_bytes as f64,
        )));
        let watchdog = Box::pin(watchdog(self, up.idle_timeout));
        let backend = &up.backend;
        match select(pump, watchdog).await {
            Either::Left((pumped, _)) => match pumped.as_ref().map(|e| e.as_string()) {
                _ if client_signal.aborted() => Piped::Cancelled,
                Ok(Some(end)) if end == "gone" => Piped::Cancelled,
                // The client fell the whole buffer behind before the backend finished: it would
                // hold the backend's slot for as long as it takes to read the rest.
                Ok(Some(end)) if end == "over" && !self.state.borrow().scanner.complete() => {
                    up.abort.abort();
                    self.cut_off(backend, "relay_buffer_full");
                    Piped::CutOff
                }
                Err(_) if self.client_gone() => Piped::Cancelled,
                // vLLM reported a failure inside the stream (`data: {"error": ...}`, then
                // `data: [DONE]`): the backend failed; the scanner kept the event and everything
                // after it from the client.
                _ if self.state.borrow().scanner.error().is_some() => {
                    let message = self
                        .state
                        .borrow()
                        .scanner
                        .error()
                        .unwrap_or("")
                        .to_string();
                    worker::console_error!(
                        "stream from backend {backend} reported an error: {message}"
                    );
                    Piped::Failed(StreamFailure {
                        kind: OutcomeKind::ServerError,
                        code: "upstream_stream_error",
                        message: format!("The backend ({backend}) reported an error while streaming; the response is incomplete."),
                    })
                }
                // The upstream can end normally after the client hung up; the close then fails.
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
                Ok(_) => Piped::Complete,
                // The whole answer, `data: [DONE]` included, arrived before the connection was
                // reset: what the socket does after the end changes nothing for the client.
                Err(_) if self.state.borrow().scanner.complete() => {
                    worker::console_log!(
                        "stream from backend {backend} was reset after data: [DONE]; it is complete"
                    );
                    Piped::Complete
                }
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
            Either::Right(((), pump)) => {
                up.abort.abort();
                // The aborted upstream fails the pump's read, which then stops.
                let _ = with_timeout(pump, Duration::from_secs(2)).await;
                if client_signal.aborted() || self.client_gone() {
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

    /// Ends the client's side of a complete stream once the client has read what the relay
    /// queued; a client that takes nothing for `SLOW_CLIENT_TIMEOUT_MS` meanwhile is cut off.
    /// The lease is released before this (the backend's work is done). Returns whether the
    /// client got it all.
    pub async fn drain(&self) -> bool {
        // Nothing queued: the client has taken every chunk, and as nothing more is written the
        // queue cannot fill again, so the watch below could never fire: no timer for it.
        if self.status("queued").as_f64().unwrap_or(0.0) <= 0.0 {
            return close(self, None).await;
        }
        let closed = Box::pin(close(self, None));
        let stalled = Box::pin(async {
            let started = crate::platform::http::now_ms();
            let bound = self.slow_client_timeout.as_millis() as u64;
            loop {
                let queued = self.status("queued").as_f64().unwrap_or(0.0);
                let progress = self.status("progress").as_f64().unwrap_or(0.0) as u64;
                let since = crate::platform::http::now_ms().saturating_sub(progress.max(started));
                if queued > 0.0 && since >= bound {
                    return;
                }
                let wait = if queued > 0.0 {
                    bound - since
                } else {
                    bound / 2
                };
                self.deadlines
                    .sleep(Duration::from_millis(wait.max(10)))
                    .await;
            }
        });
        match select(closed, stalled).await {
            Either::Left((complete, _)) => complete,
            Either::Right(((), _)) => {
                self.cut_off("(finished)", "no_progress_after_end");
                false
            }
        }
    }

    /// Fails the client's side, logging why: it fell `RELAY_BUFFER_BYTES` behind the backend
    /// (`relay_buffer_full`), or took nothing for `SLOW_CLIENT_TIMEOUT_MS` after the backend
    /// finished (`no_progress_after_end`).
    fn cut_off(&self, backend: &str, reason: &str) {
        let ms = self.slow_client_timeout.as_millis();
        let buffered = self.status("bytes").as_f64().unwrap_or(0.0) as u64;
        worker::console_log!(
            "{}",
            json!({ "event": "slow_client_cut_off", "backend": backend, "reason": reason, "buffered_bytes": buffered, "buffer_bytes": self.buffer_bytes, "stalled_ms": ms })
        );
        relay_cut(&self.writer);
    }

    /// Ends a failed stream: the error event (at an event boundary), `data: [DONE]`, and the
    /// client's side closed.
    pub async fn fail(&self, failure: &StreamFailure) {
        let event = routing_core::stream::api_events::error_event(
            self.endpoint,
            failure.code,
            &failure.message,
        )
        .unwrap_or_else(|| error_event(failure.code, &failure.message));
        close(self, Some(&event)).await;
    }
}

/// Resolves when the backend has sent nothing for `idle`.
async fn watchdog(relay: &Relay, idle: Duration) {
    let idle_ms = idle.as_millis() as u64;
    loop {
        let since = relay.idle_ms();
        if since >= idle_ms {
            return;
        }
        relay
            .deadlines
            .sleep(Duration::from_millis((idle_ms - since).max(10)))
            .await;
    }
}

/// Writes an optional final error event, then what the scanner still holds, and closes the
/// client's side of the stream. The event starts on an event boundary whatever the backend left
/// unfinished. Returns `false` when the client's side was already gone.
async fn close(relay: &Relay, final_event: Option<&str>) -> bool {
    if let Some(event) = final_event {
        let mid_event = relay.state.borrow_mut().scanner.abandon();
        let text = if mid_event {
            format!("\n\n{event}")
        } else {
            event.to_string()
        };
        relay
            .write(&js_sys::Uint8Array::from(text.as_bytes()).into())
            .await;
    }
    let rest = {
        let mut st = relay.state.borrow_mut();
        let rest = st.scanner.finish();
        (!rest.is_empty()).then(|| st.send(rest))
    };
    if let Some(rest) = rest.filter(|r| !r.is_undefined()) {
        relay.write(&rest).await;
    }
    JsFuture::from(relay.writer.close()).await.is_ok()
}

/// The SSE events that end a stream whose backend failed after the first byte.
fn error_event(code: &str, message: &str) -> String {
    let body = json!({ "error": { "message": message, "type": "server_error", "param": null, "code": code } });
    format!("data: {body}\n\ndata: [DONE]\n\n")
}
