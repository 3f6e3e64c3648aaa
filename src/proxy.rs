//! The streaming proxy: sends an OpenAI request to the backend a pool chose, retries on the next
//! candidate while nothing has reached the client yet, and passes the answer straight back.
//!
//! Bytes stay out of wasm except the first chunk of a stream: it is read here (with the
//! first-byte timeout), so a backend that accepts the request and then hangs is retried
//! elsewhere. Everything after it is piped from the upstream body into a `TransformStream` whose
//! readable side is the client's response. The pipe's promise, awaited in `wait_until`, says when
//! and how the stream ended: then the lease is released with the outcome. A failure after the
//! first byte cannot be retried, so the stream is ended with an SSE error event instead of being
//! silently truncated. A client that hangs up aborts the upstream fetch through its signal.

use crate::pools::pool_json;
use crate::ApiError;
use gateway_durable_objects::protocol::{ReassignRequest, ReleaseRequest};
use gateway_durable_objects::timed_fetch::{fetch_with_timeout, with_timeout, FetchFailure, LinkedAbort};
use routing_core::outcome::{Outcome, OutcomeKind};
use routing_core::pool::{CandidateView, Grant};
use serde_json::{json, Value};
use std::time::Duration;
use wasm_bindgen::{JsCast, JsValue};
use wasm_bindgen_futures::JsFuture;
use worker::{AbortSignal, Context, Date, Env, Headers, Method, Request, RequestInit, Response, ResponseBody};

/// Client request headers forwarded upstream (an allow-list: hop-by-hop headers, credentials,
/// cookies and platform headers never pass, and neither does an unbounded header set). The
/// gateway sets `content-type`, `x-request-id` and the backend's own `authorization` itself; the
/// configured routing-key header is forwarded too.
const FORWARDED_REQUEST_HEADERS: [&str; 8] =
    ["accept", "user-agent", "traceparent", "tracestate", "baggage", "x-session-id", "x-user-id", "x-tenant-id"];

/// Longest client header value forwarded.
const MAX_FORWARDED_HEADER_BYTES: usize = 1024;

/// Upstream response headers passed to the client.
const PASSED_RESPONSE_HEADERS: [&str; 3] = ["content-type", "cache-control", "openai-processing-ms"];

/// Proxy timing and retry knobs (wrangler.toml vars).
#[derive(Debug, Clone, Copy)]
pub struct ProxySettings {
    /// Most extra attempts after the first (default 2).
    pub max_retries: u32,
    /// A streamed answer must deliver its first chunk within this time (default 30 s).
    pub first_byte_timeout: Duration,
    /// A non-streamed answer must arrive within this time (default 600 s).
    pub response_timeout: Duration,
}

impl ProxySettings {
    /// Reads the knobs from the environment, with defaults.
    pub fn from_env(env: &Env) -> Self {
        let var = |name: &str, default: u64| crate::var_or(env, name, default);
        ProxySettings {
            max_retries: var("MAX_RETRIES", 2).min(10) as u32,
            first_byte_timeout: Duration::from_millis(var("FIRST_BYTE_TIMEOUT_MS", 30_000).max(10)),
            response_timeout: Duration::from_millis(var("RESPONSE_TIMEOUT_MS", 600_000).max(10)),
        }
    }
}

/// Everything one proxied request needs.
pub struct Forward<'a> {
    /// The client's request (for its headers and abort signal).
    pub client: &'a Request,
    /// Worker environment.
    pub env: &'a Env,
    /// Worker context, for `wait_until`.
    pub ctx: &'a Context,
    /// Pool that granted the lease.
    pub pool: String,
    /// The lease and its ranked candidates.
    pub grant: Grant,
    /// Upstream path, such as `/v1/chat/completions`.
    pub path: &'a str,
    /// The request body, forwarded byte for byte.
    pub body: Vec<u8>,
    /// Whether the client asked for a stream.
    pub stream: bool,
    /// The request id, forwarded and echoed.
    pub request_id: &'a str,
    /// Timeouts and retries.
    pub settings: ProxySettings,
    /// The prefill backend of a disaggregated request, for the response headers.
    pub prefill_backend: Option<String>,
    /// The configured routing-key header (`ROUTING_KEY_HEADER`), forwarded with the standard ones.
    pub routing_header: Option<String>,
    /// Time spent choosing a backend (pool lookup and lease), for `Server-Timing`.
    pub route_ms: u64,
}

/// A retryable failure of one attempt, before anything reached the client.
struct AttemptFailure {
    outcome: Outcome,
    reason: String,
}

/// A successful (or non-retryable) attempt: headers known, first chunk (if streaming) in hand.
struct Answer {
    status: u16,
    headers: Headers,
    first_chunk: Option<JsValue>,
    body: Option<web_sys::ReadableStream>,
    /// A body the gateway rewrote (an upstream client error), sent instead of `body`.
    fixed_body: Option<Vec<u8>>,
    ttfb_ms: u64,
    _abort: LinkedAbort,
}

impl Answer {
    /// A backend's 4xx, rewritten into an OpenAI error body whatever shape vLLM gave it
    /// (`{"error": {...}}`, the older `{"object": "error", "message": ...}`, or plain text).
    fn client_error(status: u16, text: &str, abort: LinkedAbort, ttfb_ms: u64) -> Answer {
        let parsed: Option<Value> = serde_json::from_str(text).ok();
        let inner = parsed.as_ref().map(|v| v.get("error").filter(|e| e.is_object()).unwrap_or(v));
        let message = inner
            .and_then(|e| e.get("message"))
            .and_then(Value::as_str)
            .map(str::to_string)
            .or_else(|| inner.and_then(|e| e.get("error")).and_then(Value::as_str).map(str::to_string))
            .unwrap_or_else(|| format!("The backend answered {status}."));
        let mut err = ApiError::bad_request(message);
        err.status = status;
        err.param = inner.and_then(|e| e.get("param")).and_then(Value::as_str).map(str::to_string);
        let body = serde_json::to_vec(&err.body()).unwrap_or_default();
        let headers = Headers::new();
        let _ = headers.set("content-type", "application/json");
        Answer { status, headers, first_chunk: None, body: None, fixed_body: Some(body), ttfb_ms, _abort: abort }
    }
}

impl Forward<'_> {
    /// Runs the attempts and returns the client's response.
    pub async fn run(self) -> Result<Response, ApiError> {
        let client_signal: AbortSignal = self.client.inner().signal().into();
        let mut candidate = self.grant.candidates.first().cloned().ok_or_else(|| ApiError::internal("grant without candidates"))?;
        let mut next_index = 1;
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            let failure = match self.attempt(&candidate, &client_signal).await {
                Ok(answer) => return self.respond(answer, &candidate, attempts, client_signal),
                Err(f) => f,
            };
            if client_signal.aborted() {
                self.release(Outcome::of_kind(OutcomeKind::Cancelled)).await;
                return Err(ApiError::bad_request("The client closed the request.").with_code("client_closed_request"));
            }
            // Walk the ranking: the next candidate the pool will move the lease to.
            let mut moved = None;
            while attempts <= self.settings.max_retries && next_index < self.grant.candidates.len() {
                let to = self.grant.candidates[next_index].clone();
                next_index += 1;
                match self.reassign(&to, &failure.outcome).await {
                    Ok(view) => {
                        moved = Some(view);
                        break;
                    }
                    Err(e) if e.code.as_deref() == Some("retry_budget_exhausted") => {
                        return Err(final_error(&failure, attempts, " (pool retry budget exhausted)"));
                    }
                    Err(_) => continue, // that candidate became unavailable; try the next
                }
            }
            match moved {
                Some(view) => candidate = view,
                None => {
                    self.release(failure.outcome.clone()).await;
                    return Err(final_error(&failure, attempts, ""));
                }
            }
        }
    }

    async fn attempt(&self, c: &CandidateView, client_signal: &AbortSignal) -> Result<Answer, AttemptFailure> {
        let started = Date::now().as_millis();
        let req = self.upstream_request(c).map_err(|e| AttemptFailure {
            outcome: Outcome::of_kind(OutcomeKind::Transport),
            reason: format!("cannot build the request to backend {}: {e}", c.id.0),
        })?;
        let timeout = if self.stream { self.settings.first_byte_timeout } else { self.settings.response_timeout };
        let (resp, abort) = fetch_with_timeout(req, timeout, Some(client_signal)).await.map_err(|f| match f {
            FetchFailure::Timeout => AttemptFailure {
                outcome: Outcome::of_kind(OutcomeKind::Timeout),
                reason: format!("backend {} sent no response within {} ms", c.id.0, timeout.as_millis()),
            },
            FetchFailure::Transport(e) => AttemptFailure {
                outcome: Outcome::of_kind(OutcomeKind::Transport),
                reason: format!("backend {} unreachable: {e}", c.id.0),
            },
        })?;
        let status = resp.status_code();
        let kind = OutcomeKind::from_status(status);
        // 401/403 from a backend means it rejects the gateway's own key (the client's is never
        // sent): the backend's misconfiguration, so it counts against it and is retried elsewhere.
        let rejects_gateway = matches!(status, 401 | 403);
        if matches!(kind, OutcomeKind::ServerError | OutcomeKind::RateLimited) || rejects_gateway {
            let mut outcome = Outcome::from_status(status);
            if rejects_gateway {
                outcome.kind = OutcomeKind::ServerError;
            }
            outcome.ttfb_ms = Some(Date::now().as_millis().saturating_sub(started));
            abort.abort();
            let why = if rejects_gateway { " (it rejects the gateway's API key for it)" } else { "" };
            return Err(AttemptFailure { outcome, reason: format!("backend {} answered {status}{why}", c.id.0) });
        }
        if !(200..300).contains(&status) {
            // A client error the backend reported: pass it on in the OpenAI shape.
            let mut resp = resp;
            let text = with_timeout(resp.text(), timeout).await.and_then(Result::ok).unwrap_or_default();
            return Ok(Answer::client_error(status, &text, abort, Date::now().as_millis().saturating_sub(started)));
        }
        let headers = resp.headers().clone();
        let (_, body) = resp.into_parts();
        let body = match body {
            ResponseBody::Stream(s) => Some(s),
            _ => None,
        };
        let mut answer = Answer { status, headers, first_chunk: None, body, fixed_body: None, ttfb_ms: 0, _abort: abort };
        if self.stream && (200..300).contains(&status) {
            if let Some(stream) = &answer.body {
                let remaining = timeout.saturating_sub(Duration::from_millis(Date::now().as_millis().saturating_sub(started)));
                answer.first_chunk = Some(read_first_chunk(stream, remaining, &c.id.0).await?);
            }
        }
        answer.ttfb_ms = Date::now().as_millis().saturating_sub(started);
        Ok(answer)
    }

    fn upstream_request(&self, c: &CandidateView) -> worker::Result<Request> {
        self.upstream_request_with(c, &self.body)
    }

    fn upstream_request_with(&self, c: &CandidateView, body: &[u8]) -> worker::Result<Request> {
        let headers = Headers::new();
        let routing_header = self.routing_header.as_deref();
        for name in FORWARDED_REQUEST_HEADERS.iter().copied().chain(routing_header) {
            if let Some(value) = self.client.headers().get(name)?.filter(|v| v.len() <= MAX_FORWARDED_HEADER_BYTES) {
                headers.set(name, &value)?;
            }
        }
        headers.set("content-type", "application/json")?;
        headers.set("x-request-id", self.request_id)?;
        if let Some(key) = &c.api_key {
            headers.set("authorization", &format!("Bearer {key}"))?;
        }
        let mut init = RequestInit::new();
        init.with_method(Method::Post)
            .with_headers(headers)
            .with_body(Some(js_sys::Uint8Array::from(body).into()));
        Request::new_with_init(&format!("{}{}", c.url, self.path), &init)
    }

    fn respond(self, answer: Answer, c: &CandidateView, attempts: u32, client_signal: AbortSignal) -> Result<Response, ApiError> {
        let out = Headers::new();
        let set = |k: &str, v: &str| out.set(k, v).map_err(ApiError::from_worker);
        for name in PASSED_RESPONSE_HEADERS {
            if let Some(v) = answer.headers.get(name).ok().flatten() {
                set(name, &v)?;
            }
        }
        set("x-request-id", self.request_id)?;
        set("x-gateway-pool", &self.pool)?;
        set("x-gateway-backend", &c.id.0)?;
        set("x-gateway-attempts", &attempts.to_string())?;
        // Where the time to the first byte went: routing (pools, lease) and the upstream attempts.
        set("server-timing", &format!("route;dur={}, upstream;dur={}", self.route_ms, answer.ttfb_ms))?;
        if let Some(p) = &self.prefill_backend {
            set("x-gateway-prefill-backend", p)?;
        }
        if let Some(d) = self.grant.decision {
            if let Ok(serde_json::Value::String(s)) = serde_json::to_value(d) {
                set("x-gateway-decision", &s)?;
            }
        }
        let status = answer.status;
        let mut outcome = Outcome::from_status(status);
        outcome.ttfb_ms = Some(answer.ttfb_ms);
        let Some(body) = answer.body else {
            let env = self.env.clone();
            let pool = self.pool.clone();
            let lease_id = self.grant.lease_id;
            access_log(self.request_id, &pool, &c.id.0, attempts, &outcome, answer.ttfb_ms);
            self.ctx.wait_until(async move { release(env, pool, lease_id, outcome).await });
            return Ok(match answer.fixed_body {
                Some(bytes) => Response::builder().with_status(status).with_headers(out).fixed(bytes),
                None => Response::builder().with_status(status).with_headers(out).empty(),
            });
        };
        let ts = web_sys::TransformStream::new().map_err(|_| ApiError::internal("TransformStream unavailable"))?;
        let writable = ts.writable();
        // The first chunk is queued now but piping starts only once it has been taken: the write
        // completes when the client starts reading, after this function has returned.
        let writer = writable.get_writer().map_err(|_| ApiError::internal("stream writer unavailable"))?;
        let first_write = answer.first_chunk.as_ref().map(|chunk| writer.write_with_chunk(chunk));
        let env = self.env.clone();
        let pool = self.pool.clone();
        let lease_id = self.grant.lease_id;
        let streaming = self.stream;
        let backend = c.id.0.clone();
        let request_id = self.request_id.to_string();
        let started = Date::now().as_millis().saturating_sub(answer.ttfb_ms);
        self.ctx.wait_until(async move {
            if let Some(w) = first_write {
                let _ = JsFuture::from(w).await;
            }
            writer.release_lock();
            let options = web_sys::StreamPipeOptions::new();
            options.set_prevent_close(true);
            options.set_prevent_abort(true);
            let piped = JsFuture::from(body.pipe_to_with_options(&writable, &options)).await;
            let outcome = match piped {
                _ if client_signal.aborted() => Outcome { kind: OutcomeKind::Cancelled, ..outcome },
                // The pipe can settle normally after the client hung up; the close then fails.
                Ok(_) if !close_writable(&writable, None).await || client_signal.aborted() => {
                    Outcome { kind: OutcomeKind::Cancelled, ..outcome }
                }
                Ok(_) => outcome,
                Err(e) => {
                    let reason = e.as_string().unwrap_or_else(|| "the backend's stream failed".to_string());
                    worker::console_error!("stream from backend {backend} failed mid-way: {reason}");
                    let event = streaming.then(|| mid_stream_error_event(&backend));
                    let _ = close_writable(&writable, event.as_deref()).await;
                    Outcome { kind: OutcomeKind::Transport, ..outcome }
                }
            };
            access_log(&request_id, &pool, &backend, attempts, &outcome, Date::now().as_millis().saturating_sub(started));
            release(env, pool, lease_id, outcome).await;
        });
        Ok(Response::builder().with_status(status).with_headers(out).stream(ts.readable().unchecked_into()))
    }

    /// Prefill/decode disaggregation (vLLM's NixlConnector protocol): the prefill server computes
    /// the prompt's KV cache and generates one token, answering with `kv_transfer_params`; the
    /// decode server receives the original request with those params, pulls the blocks instead of
    /// prefilling, and streams the answer. The lease covers both backends. The decode stage is not
    /// retried on another decode server (the lease's decode share cannot move); a failed prefill
    /// ends the request with 502/504.
    pub async fn run_disaggregated(mut self) -> Result<Response, ApiError> {
        let original: Value = serde_json::from_slice(&self.body).map_err(|e| ApiError::bad_request(e.to_string()))?;
        let prefill = self.grant.candidates.first().cloned().ok_or_else(|| ApiError::internal("grant without a prefill candidate"))?;
        let mut prefill_body = original.clone();
        if let Some(obj) = prefill_body.as_object_mut() {
            obj.insert("kv_transfer_params".into(), json!({
                "do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
                "remote_block_ids": null, "remote_host": null, "remote_port": null,
            }));
            obj.insert("max_tokens".into(), json!(1));
            obj.insert("stream".into(), json!(false));
            obj.remove("max_completion_tokens");
            obj.remove("stream_options");
        }
        let bytes = serde_json::to_vec(&prefill_body).map_err(|e| ApiError::internal(e.to_string()))?;
        let client_signal: AbortSignal = self.client.inner().signal().into();
        let fail = |kind: OutcomeKind, reason: String| AttemptFailure { outcome: Outcome::of_kind(kind), reason };
        let params = async {
            let req = self.upstream_request_with(&prefill, &bytes).map_err(|e| fail(OutcomeKind::Transport, e.to_string()))?;
            let (mut resp, _abort) = fetch_with_timeout(req, self.settings.response_timeout, Some(&client_signal))
                .await
                .map_err(|f| match f {
                    FetchFailure::Timeout => fail(OutcomeKind::Timeout, format!("prefill backend {} timed out", prefill.id.0)),
                    FetchFailure::Transport(e) => fail(OutcomeKind::Transport, format!("prefill backend {} unreachable: {e}", prefill.id.0)),
                })?;
            let status = resp.status_code();
            if !(200..300).contains(&status) {
                return Err(AttemptFailure { outcome: Outcome::from_status(status), reason: format!("prefill backend {} answered {status}", prefill.id.0) });
            }
            let answer: Value = resp.json().await.map_err(|e| fail(OutcomeKind::Transport, format!("prefill answer unreadable: {e}")))?;
            answer
                .get("kv_transfer_params")
                .filter(|p| p.is_object())
                .cloned()
                .ok_or_else(|| fail(OutcomeKind::ServerError, format!("prefill backend {} returned no kv_transfer_params", prefill.id.0)))
        }
        .await;
        let params = match params {
            Ok(p) => p,
            Err(failure) => {
                self.release(failure.outcome.clone()).await;
                return Err(final_error(&failure, 1, " (prefill stage)"));
            }
        };
        let mut decode_body = original;
        if let Some(obj) = decode_body.as_object_mut() {
            obj.insert("kv_transfer_params".into(), params);
        }
        self.body = serde_json::to_vec(&decode_body).map_err(|e| ApiError::internal(e.to_string()))?;
        self.grant.candidates = std::mem::take(&mut self.grant.decode_candidates);
        self.settings.max_retries = 0;
        self.prefill_backend = Some(prefill.id.0);
        self.run().await
    }

    async fn reassign(&self, to: &CandidateView, failure: &Outcome) -> Result<CandidateView, ApiError> {
        let req = ReassignRequest { lease_id: self.grant.lease_id, to: to.id.clone(), failure: failure.clone() };
        pool_json(self.env, &self.pool, Method::Post, "/reassign", Some(&req)).await
    }

    async fn release(&self, outcome: Outcome) {
        release(self.env.clone(), self.pool.clone(), self.grant.lease_id, outcome).await;
    }
}

/// Reads the first chunk of a stream within `timeout`, then unlocks the stream for piping.
async fn read_first_chunk(stream: &web_sys::ReadableStream, timeout: Duration, backend: &str) -> Result<JsValue, AttemptFailure> {
    let reader: web_sys::ReadableStreamDefaultReader = stream.get_reader().unchecked_into();
    let read = JsFuture::from(reader.read());
    let result = with_timeout(read, timeout).await;
    let fail = |kind: OutcomeKind, reason: String| AttemptFailure { outcome: Outcome::of_kind(kind), reason };
    let chunk = match result {
        None => {
            let _ = reader.cancel();
            return Err(fail(OutcomeKind::Timeout, format!("backend {backend} sent no first token within {} ms", timeout.as_millis())));
        }
        Some(Err(_)) => return Err(fail(OutcomeKind::Transport, format!("backend {backend} failed before its first token"))),
        Some(Ok(r)) => r,
    };
    let done = js_sys::Reflect::get(&chunk, &"done".into()).ok().and_then(|v| v.as_bool()).unwrap_or(true);
    if done {
        return Err(fail(OutcomeKind::Transport, format!("backend {backend} closed the stream before its first token")));
    }
    reader.release_lock();
    js_sys::Reflect::get(&chunk, &"value".into())
        .map_err(|_| fail(OutcomeKind::Transport, format!("backend {backend} sent an unreadable chunk")))
}

/// Writes an optional final event, then closes the client's side of the stream.
/// Returns `false` when the client's side was already gone.
async fn close_writable(writable: &web_sys::WritableStream, final_event: Option<&str>) -> bool {
    let Ok(writer) = writable.get_writer() else { return false };
    if let Some(event) = final_event {
        let bytes = js_sys::Uint8Array::from(event.as_bytes());
        let _ = JsFuture::from(writer.write_with_chunk(&bytes)).await;
    }
    JsFuture::from(writer.close()).await.is_ok()
}

/// The SSE event that ends a stream whose backend failed after the first byte.
fn mid_stream_error_event(backend: &str) -> String {
    let body = json!({ "error": {
        "message": format!("The backend ({backend}) failed while streaming; the response is incomplete."),
        "type": "server_error",
        "param": null,
        "code": "upstream_stream_error",
    }});
    format!("data: {body}\n\ndata: [DONE]\n\n")
}

/// The client's error after every allowed attempt failed.
fn final_error(failure: &AttemptFailure, attempts: u32, suffix: &str) -> ApiError {
    let message = format!("Upstream failed after {attempts} attempt(s): {}{suffix}", failure.reason);
    match failure.outcome.kind {
        OutcomeKind::Timeout => ApiError::gateway_timeout(message),
        OutcomeKind::RateLimited => ApiError::rate_limited(message, 1),
        _ => ApiError::bad_gateway(message),
    }
}

/// One structured log line per proxied request (ids and figures only: never keys, URLs or bodies).
fn access_log(request_id: &str, pool: &str, backend: &str, attempts: u32, outcome: &Outcome, duration_ms: u64) {
    let line = json!({
        "event": "request",
        "request_id": request_id,
        "pool": pool,
        "backend": backend,
        "attempts": attempts,
        "status": outcome.status,
        "outcome": outcome.kind,
        "ttfb_ms": outcome.ttfb_ms,
        "duration_ms": duration_ms,
    });
    worker::console_log!("{line}");
}

/// Returns a lease to its pool; failures are logged, and the lease's deadline is the backstop.
pub async fn release(env: Env, pool: String, lease_id: u64, outcome: Outcome) {
    let req = ReleaseRequest { lease_id, outcome };
    let result: Result<serde_json::Value, ApiError> = pool_json(&env, &pool, Method::Post, "/release", Some(&req)).await;
    if let Err(e) = result {
        worker::console_error!("release of lease {lease_id} in pool {pool} failed: {e}");
    }
}
