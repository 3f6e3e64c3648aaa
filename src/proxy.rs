//! The streaming proxy: sends an OpenAI request to the backend a pool chose, retries on the next
//! candidate while nothing has reached the client yet, and passes the answer back.
//!
//! A non-streamed answer is read whole (bounded) before the client sees anything, so a body that
//! breaks off mid-way, or is not whole JSON, is retried like any failure before the first byte and
//! never reaches the client as a broken `200`. A stream's first chunk is read here (with the
//! first-byte timeout), so a backend that accepts the request and then hangs is retried elsewhere;
//! after it the answer flows through the relay (`relay.rs`), which reads the backend's usage on
//! the way; a stream that fails after its first byte is resumed on the next candidate when the
//! request allows it (`resume.rs`), and otherwise ended with an SSE error event. The attempts
//! (building the upstream request, reading the first chunk, moving the lease to the next
//! candidate) live in [`Attempts`], owned, so a resumption can make more of them from
//! `wait_until`. Every exit reports its outcome to the lease's guard (`lease_guard.rs`), which
//! releases the lease from `wait_until`. A client that hangs up aborts the upstream fetch through
//! its signal.

use crate::do_client::pool_json;
use crate::lease_guard::LeaseGuard;
use crate::relay::{Relay, Upstream};
use crate::resume::Resumption;
use crate::ApiError;
use coordinator_protocol::messages::ReassignRequest;
use coordinator_protocol::timed_fetch::{
    fetch_with_timeout, with_timeout, FetchFailure, LinkedAbort,
};
use coordinator_protocol::Route;
use routing_core::outcome::{Outcome, OutcomeKind};
use routing_core::pool::{CandidateView, Grant};
use routing_core::usage::{body_usage, Usage};
use serde_json::{json, Value};
use std::time::Duration;
use wasm_bindgen::{JsCast, JsValue};
use wasm_bindgen_futures::JsFuture;
use worker::{
    AbortSignal, Context, Date, Env, Headers, Method, Request, RequestInit, Response, ResponseBody,
};

/// Client request headers forwarded upstream (an allow-list: hop-by-hop headers, credentials,
/// cookies and platform headers never pass, and neither does an unbounded header set). The
/// gateway sets `content-type`, `x-request-id` and the backend's own `authorization` itself; the
/// configured routing-key header is forwarded too.
const FORWARDED_REQUEST_HEADERS: [&str; 8] = [
    "accept",
    "user-agent",
    "traceparent",
    "tracestate",
    "baggage",
    "x-session-id",
    "x-user-id",
    "x-tenant-id",
];

/// Longest client header value forwarded.
const MAX_FORWARDED_HEADER_BYTES: usize = 1024;

/// Upstream response headers passed to the client.
const PASSED_RESPONSE_HEADERS: [&str; 3] =
    ["content-type", "cache-control", "openai-processing-ms"];

/// Largest non-streamed answer read from a backend (embeddings of large batches included).
const MAX_ANSWER_BYTES: usize = 32 * 1024 * 1024;

/// Proxy timing and retry knobs (wrangler.toml vars).
#[derive(Debug, Clone, Copy)]
pub struct ProxySettings {
    /// Most extra attempts after the first (default 2).
    pub max_retries: u32,
    /// A streamed answer must deliver its first chunk within this time (default 30 s).
    pub first_byte_timeout: Duration,
    /// A non-streamed answer must arrive whole within this time (default 600 s).
    pub response_timeout: Duration,
    /// After its first chunk, a stream may go this long without one (default 60 s).
    pub stream_idle_timeout: Duration,
    /// Most times one stream is resumed on another backend after failing mid-answer (default 1;
    /// 0 turns resumption off).
    pub max_stream_resumes: u32,
}

impl ProxySettings {
    /// Reads the knobs from the environment, with defaults.
    pub fn from_env(env: &Env) -> Self {
        let var = |name: &str, default: u64| crate::var_or(env, name, default);
        ProxySettings {
            max_retries: var("MAX_RETRIES", 2).min(10) as u32,
            first_byte_timeout: Duration::from_millis(var("FIRST_BYTE_TIMEOUT_MS", 30_000).max(10)),
            response_timeout: Duration::from_millis(var("RESPONSE_TIMEOUT_MS", 600_000).max(10)),
            stream_idle_timeout: Duration::from_millis(
                var("STREAM_IDLE_TIMEOUT_MS", 60_000).max(10),
            ),
            max_stream_resumes: var("MAX_STREAM_RESUMES", 1).min(5) as u32,
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
    /// The pool's coordinator shard that granted it.
    pub shard: u32,
    /// The lease and its ranked candidates.
    pub grant: Grant,
    /// The lease's guard: every exit reports to it.
    pub guard: LeaseGuard,
    /// Upstream path, such as `/v1/chat/completions`.
    pub path: &'a str,
    /// The request body as sent upstream.
    pub body: Vec<u8>,
    /// Whether the client asked for a stream.
    pub stream: bool,
    /// The model asked for.
    pub model: String,
    /// The prompt's prefix-block hashes (recorded on the backend that ends up serving).
    pub block_hashes: Vec<u64>,
    /// Whether the gateway asked for the stream's usage event and the client did not.
    pub strip_usage_event: bool,
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

/// A failure of one attempt, before anything of it reached the client.
pub(crate) struct AttemptFailure {
    pub(crate) outcome: Outcome,
    reason: String,
    /// Whether another candidate may be tried.
    retryable: bool,
    /// The backend answered 404: it does not serve the model (any more).
    missing_model: bool,
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

/// A successful (or non-retryable) attempt: headers known, and either the whole body or, for a
/// stream, its first chunk and the rest of the body.
pub(crate) struct Answer {
    pub(crate) status: u16,
    headers: Headers,
    /// A body read whole (or rewritten: an upstream client error).
    whole: Option<Vec<u8>>,
    usage: Option<Usage>,
    pub(crate) first_chunk: Option<JsValue>,
    pub(crate) body: Option<web_sys::ReadableStream>,
    pub(crate) ttfb_ms: u64,
    pub(crate) abort: LinkedAbort,
}

impl Answer {
    /// A backend's 4xx, rewritten into an OpenAI error body whatever shape vLLM gave it
    /// (`{"error": {...}}`, the older `{"object": "error", "message": ...}`, or plain text).
    fn client_error(status: u16, text: &str, abort: LinkedAbort, ttfb_ms: u64) -> Answer {
        let parsed: Option<Value> = serde_json::from_str(text).ok();
        let inner = parsed
            .as_ref()
            .map(|v| v.get("error").filter(|e| e.is_object()).unwrap_or(v));
        let message = inner
            .and_then(|e| e.get("message"))
            .and_then(Value::as_str)
            .map(str::to_string)
            .or_else(|| {
                inner
                    .and_then(|e| e.get("error"))
                    .and_then(Value::as_str)
                    .map(str::to_string)
            })
            .unwrap_or_else(|| format!("The backend answered {status}."));
        let mut err = ApiError::bad_request(message);
        err.status = status;
        err.param = inner
            .and_then(|e| e.get("param"))
            .and_then(Value::as_str)
            .map(str::to_string);
        let body = serde_json::to_vec(&err.body()).unwrap_or_default();
        let headers = Headers::new();
        let _ = headers.set("content-type", "application/json");
        Answer {
            status,
            headers,
            whole: Some(body),
            usage: None,
            first_chunk: None,
            body: None,
            ttfb_ms,
            abort,
        }
    }
}

impl Forward<'_> {
    /// Runs the attempts and returns the client's response.
    pub async fn run(self) -> Result<Response, ApiError> {
        let client_signal: AbortSignal = self.client.inner().signal().into();
        let mut attempts = self.attempts()?;
        let mut candidate = self
            .grant
            .candidates
            .first()
            .cloned()
            .ok_or_else(|| ApiError::internal("grant without candidates"))?;
        loop {
            attempts.count += 1;
            let failure = match attempts
                .attempt(&candidate, &self.body, &client_signal)
                .await
            {
                Ok(answer) => {
                    return self.respond(answer, &candidate, attempts, client_signal);
                }
                Err(f) => f,
            };
            if client_signal.aborted() {
                self.guard.finish(Outcome::of_kind(OutcomeKind::Cancelled));
                return Err(ApiError::bad_request("The client closed the request.")
                    .with_code("client_closed_request"));
            }
            let moved = if failure.retryable && attempts.count <= self.settings.max_retries {
                attempts
                    .move_on(&failure.outcome, failure.missing_model)
                    .await
            } else {
                Moved::Nowhere
            };
            match moved {
                Moved::To(view) => candidate = view,
                Moved::Refused => {
                    // The pool ended the lease with the failure itself.
                    self.guard.finish_released(failure.outcome.clone());
                    return Err(final_error(
                        &failure,
                        attempts.count,
                        " (pool retry budget exhausted)",
                    ));
                }
                Moved::Nowhere => {
                    self.guard.finish(failure.outcome.clone());
                    if failure.missing_model {
                        return Err(ApiError::model_not_found(&self.model));
                    }
                    return Err(final_error(&failure, attempts.count, ""));
                }
            }
        }
    }

    /// What it takes to make attempts on the grant's candidates, owned.
    fn attempts(&self) -> Result<Attempts, ApiError> {
        let mut headers = Vec::new();
        let routing_header = self.routing_header.as_deref();
        for name in FORWARDED_REQUEST_HEADERS
            .iter()
            .copied()
            .chain(routing_header)
        {
            if let Some(value) = self
                .client
                .headers()
                .get(name)
                .map_err(ApiError::from)?
                .filter(|v| v.len() <= MAX_FORWARDED_HEADER_BYTES)
            {
                headers.push((name.to_string(), value));
            }
        }
        Ok(Attempts {
            env: self.env.clone(),
            pool: self.pool.clone(),
            shard: self.shard,
            guard: self.guard.clone(),
            candidates: self.grant.candidates.clone(),
            next_index: 1,
            count: 0,
            path: self.path.to_string(),
            request_id: self.request_id.to_string(),
            headers,
            settings: self.settings,
            stream: self.stream,
            block_hashes: self.block_hashes.clone(),
            model: self.model.clone(),
        })
    }

    fn respond(
        self,
        answer: Answer,
        c: &CandidateView,
        attempts: Attempts,
        client_signal: AbortSignal,
    ) -> Result<Response, ApiError> {
        let out = Headers::new();
        let set = |k: &str, v: &str| out.set(k, v).map_err(ApiError::from);
        for name in PASSED_RESPONSE_HEADERS {
            if let Some(v) = answer.headers.get(name).ok().flatten() {
                set(name, &v)?;
            }
        }
        set("x-request-id", self.request_id)?;
        set("x-gateway-pool", &self.pool)?;
        set("x-gateway-shard", &self.shard.to_string())?;
        set("x-gateway-backend", &c.id.0)?;
        set("x-gateway-attempts", &attempts.count.to_string())?;
        // Where the time to the first byte went: routing (pools, lease) and the upstream attempts.
        set(
            "server-timing",
            &format!(
                "route;dur={}, upstream;dur={}",
                self.route_ms, answer.ttfb_ms
            ),
        )?;
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
        let (Some(body), true) = (answer.body, self.stream) else {
            with_usage(&mut outcome, answer.usage);
            self.guard.finish(outcome);
            let bytes = answer.whole.unwrap_or_default();
            return Ok(Response::builder()
                .with_status(status)
                .with_headers(out)
                .fixed(bytes));
        };
        let relay = Relay::new(self.strip_usage_event)
            .map_err(|_| ApiError::internal("TransformStream unavailable"))?;
        let readable = relay.readable();
        let upstream = stream_upstream(body, answer.first_chunk, answer.abort, c, &self.settings);
        // A disaggregated request's decode share cannot move: its stream is never resumed.
        let resumption = match self.prefill_backend {
            None => Resumption::of(self.path, self.body, self.settings.max_stream_resumes),
            Some(_) => Resumption::never(),
        };
        if resumption.collects() {
            relay.collect();
        }
        self.ctx.wait_until(crate::resume::stream(
            relay,
            upstream,
            attempts,
            resumption,
            outcome,
            client_signal,
        ));
        Ok(Response::builder()
            .with_status(status)
            .with_headers(out)
            .stream(readable.unchecked_into()))
    }

    /// Prefill/decode disaggregation (vLLM's NixlConnector protocol): the prefill server computes
    /// the prompt's KV cache and generates one token, answering with `kv_transfer_params`; the
    /// decode server receives the original request with those params, pulls the blocks instead of
    /// prefilling, and streams the answer. The lease covers both backends; each stage reports its
    /// own outcome, and the prefill share ends as soon as the prefill does. The decode stage is not
    /// retried on another decode server (the lease's decode share cannot move); a failed prefill
    /// ends the request with 502/504.
    pub async fn run_disaggregated(mut self) -> Result<Response, ApiError> {
        let original: Value =
            serde_json::from_slice(&self.body).map_err(|e| ApiError::bad_request(e.to_string()))?;
        let prefill = self
            .grant
            .candidates
            .first()
            .cloned()
            .ok_or_else(|| ApiError::internal("grant without a prefill candidate"))?;
        let mut prefill_body = original.clone();
        if let Some(obj) = prefill_body.as_object_mut() {
            obj.insert(
                "kv_transfer_params".into(),
                json!({
                    "do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
                    "remote_block_ids": null, "remote_host": null, "remote_port": null,
                }),
            );
            obj.insert("max_tokens".into(), json!(1));
            obj.insert("stream".into(), json!(false));
            obj.remove("max_completion_tokens");
            obj.remove("stream_options");
        }
        let bytes =
            serde_json::to_vec(&prefill_body).map_err(|e| ApiError::internal(e.to_string()))?;
        let client_signal: AbortSignal = self.client.inner().signal().into();
        let fail = |kind: OutcomeKind, reason: String| AttemptFailure::new(kind, reason);
        let params = async {
            let req = self
                .attempts()
                .and_then(|a| a.request(&prefill, &bytes).map_err(ApiError::from))
                .map_err(|e| fail(OutcomeKind::Transport, e.to_string()))?;
            let (resp, _abort) =
                fetch_with_timeout(req, self.settings.response_timeout, Some(&client_signal))
                    .await
                    .map_err(|f| match f {
                        FetchFailure::Timeout => fail(
                            OutcomeKind::Timeout,
                            format!("prefill backend {} timed out", prefill.id.0),
                        ),
                        FetchFailure::Transport(e) => fail(
                            OutcomeKind::Transport,
                            format!("prefill backend {} unreachable: {e}", prefill.id.0),
                        ),
                    })?;
            let status = resp.status_code();
            if !(200..300).contains(&status) {
                return Err(AttemptFailure {
                    outcome: Outcome::from_status(status),
                    reason: format!("prefill backend {} answered {status}", prefill.id.0),
                    retryable: false,
                    missing_model: false,
                });
            }
            let (_, body) = resp.into_parts();
            let bytes = match body {
                ResponseBody::Stream(s) => read_whole(&s, MAX_ANSWER_BYTES, &prefill.id.0).await?,
                _ => Vec::new(),
            };
            let answer: Value = serde_json::from_slice(&bytes).map_err(|e| {
                fail(
                    OutcomeKind::Transport,
                    format!("prefill backend {}: answer unreadable: {e}", prefill.id.0),
                )
            })?;
            let params = answer
                .get("kv_transfer_params")
                .filter(|p| p.is_object())
                .cloned()
                .ok_or_else(|| {
                    fail(
                        OutcomeKind::ServerError,
                        format!(
                            "prefill backend {} returned no kv_transfer_params",
                            prefill.id.0
                        ),
                    )
                })?;
            let mut outcome = Outcome::from_status(status);
            with_usage(&mut outcome, body_usage(&bytes).ok().flatten());
            Ok((params, outcome))
        }
        .await;
        // Each stage reports its own outcome: the prefill share ends here, whatever comes next.
        let decode = self
            .grant
            .decode_candidates
            .first()
            .map(|c| c.id.0.clone())
            .unwrap_or_default();
        let params = match params {
            Ok((params, outcome)) => {
                self.guard.finish_prefill(outcome, &decode);
                params
            }
            Err(failure) => {
                self.guard.finish_prefill(failure.outcome.clone(), &decode);
                // The decode stage never ran: nobody to blame there.
                self.guard.finish(Outcome::of_kind(OutcomeKind::Cancelled));
                return Err(final_error(&failure, 1, " (prefill stage)"));
            }
        };
        let mut decode_body = original;
        if let Some(obj) = decode_body.as_object_mut() {
            obj.insert("kv_transfer_params".into(), params);
        }
        self.body =
            serde_json::to_vec(&decode_body).map_err(|e| ApiError::internal(e.to_string()))?;
        self.grant.candidates = std::mem::take(&mut self.grant.decode_candidates);
        self.settings.max_retries = 0;
        self.prefill_backend = Some(prefill.id.0);
        self.run().await
    }
}

/// How the lease moved after a failed attempt.
pub(crate) enum Moved {
    /// To this candidate, for the next attempt.
    To(CandidateView),
    /// Nowhere: no further candidate could take it.
    Nowhere,
    /// The pool's retry budget refused, and the pool ended the lease with the failure.
    Refused,
}

/// What it takes to make attempts on a grant's candidates and move the lease between them, owned
/// so a stream's resumption can go on making them from `wait_until`.
pub(crate) struct Attempts {
    env: Env,
    pool: String,
    /// The shard that granted the lease: its moves go there too.
    shard: u32,
    pub(crate) guard: LeaseGuard,
    candidates: Vec<CandidateView>,
    /// The next candidate in the ranking not tried yet.
    next_index: usize,
    /// Attempts made so far.
    pub(crate) count: u32,
    path: String,
    request_id: String,
    /// The client headers forwarded upstream.
    headers: Vec<(String, String)>,
    pub(crate) settings: ProxySettings,
    stream: bool,
    block_hashes: Vec<u64>,
    model: String,
}

impl Attempts {
    /// One attempt on `c` with `body`: the answer's headers and first chunk (a stream) or whole
    /// body, or why it failed before anything reached the client.
    pub(crate) async fn attempt(
        &self,
        c: &CandidateView,
        body: &[u8],
        client_signal: &AbortSignal,
    ) -> Result<Answer, AttemptFailure> {
        let started = Date::now().as_millis();
        let elapsed = || Date::now().as_millis().saturating_sub(started);
        let req = self.request(c, body).map_err(|e| {
            AttemptFailure::new(
                OutcomeKind::Transport,
                format!("cannot build the request to backend {}: {e}", c.id.0),
            )
        })?;
        let timeout = if self.stream {
            self.settings.first_byte_timeout
        } else {
            self.settings.response_timeout
        };
        let (resp, abort) = fetch_with_timeout(req, timeout, Some(client_signal))
            .await
            .map_err(|f| match f {
                FetchFailure::Timeout => AttemptFailure::new(
                    OutcomeKind::Timeout,
                    format!(
                        "backend {} sent no response within {} ms",
                        c.id.0,
                        timeout.as_millis()
                    ),
                ),
                FetchFailure::Transport(e) => AttemptFailure::new(
                    OutcomeKind::Transport,
                    format!("backend {} unreachable: {e}", c.id.0),
                ),
            })?;
        let remaining = || timeout.saturating_sub(Duration::from_millis(elapsed()));
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
            outcome.ttfb_ms = Some(elapsed());
            abort.abort();
            let why = if rejects_gateway {
                " (it rejects the gateway's API key for it)"
            } else {
                ""
            };
            return Err(AttemptFailure {
                outcome,
                reason: format!("backend {} answered {status}{why}", c.id.0),
                ..AttemptFailure::new(kind, String::new())
            });
        }
        if status == 404 {
            // vLLM answers 404 only for a model it does not serve: unloaded since the last probe.
            // Not the backend's fault, and another backend may have it.
            abort.abort();
            return Err(AttemptFailure {
                outcome: Outcome {
                    ttfb_ms: Some(elapsed()),
                    ..Outcome::from_status(404)
                },
                reason: format!("backend {} does not serve the model", c.id.0),
                missing_model: true,
                ..AttemptFailure::new(OutcomeKind::ClientError, String::new())
            });
        }
        if !(200..300).contains(&status) {
            // A client error the backend reported: pass it on in the OpenAI shape.
            let mut resp = resp;
            let text = with_timeout(resp.text(), remaining())
                .await
                .and_then(Result::ok)
                .unwrap_or_default();
            return Ok(Answer::client_error(status, &text, abort, elapsed()));
        }
        let headers = resp.headers().clone();
        let (_, body) = resp.into_parts();
        let body = match body {
            ResponseBody::Stream(s) => Some(s),
            _ => None,
        };
        let mut answer = Answer {
            status,
            headers,
            whole: None,
            usage: None,
            first_chunk: None,
            body: None,
            ttfb_ms: 0,
            abort,
        };
        // Whatever fails from here on, the upstream request is closed, not left to the collector.
        let read = self
            .read_answer(&mut answer, body, remaining(), timeout, &c.id.0)
            .await;
        if let Err(failure) = read {
            answer.abort.abort();
            return Err(failure);
        }
        answer.ttfb_ms = elapsed();
        Ok(answer)
    }

    /// Reads what the client gets of a 2xx answer before its headers: a stream's first chunk, or
    /// a whole non-streamed body, checked to be one JSON document.
    async fn read_answer(
        &self,
        answer: &mut Answer,
        body: Option<web_sys::ReadableStream>,
        remaining: Duration,
        timeout: Duration,
        backend: &str,
    ) -> Result<(), AttemptFailure> {
        if self.stream {
            let Some(stream) = body else {
                return Err(AttemptFailure::new(
                    OutcomeKind::Transport,
                    format!("backend {backend} sent no stream"),
                ));
            };
            answer.first_chunk = Some(read_first_chunk(&stream, remaining, backend).await?);
            answer.body = Some(stream);
            return Ok(());
        }
        let bytes = match body {
            Some(stream) => with_timeout(read_whole(&stream, MAX_ANSWER_BYTES, backend), remaining)
                .await
                .unwrap_or_else(|| {
                    Err(AttemptFailure::new(
                        OutcomeKind::Timeout,
                        format!(
                            "backend {backend} did not finish its answer within {} ms",
                            timeout.as_millis()
                        ),
                    ))
                })?,
            None => Vec::new(),
        };
        // Never a 200 with broken JSON: a body that says it is JSON (as every vLLM answer does) but
        // is not one whole document is the backend's failure. Other content types pass as sent.
        let content_type = answer
            .headers
            .get("content-type")
            .ok()
            .flatten()
            .unwrap_or_default();
        if content_type.is_empty() || content_type.contains("json") {
            answer.usage = body_usage(&bytes).map_err(|e| {
                AttemptFailure::new(
                    OutcomeKind::Transport,
                    format!("backend {backend} sent an incomplete or invalid JSON answer ({e})"),
                )
            })?;
        }
        answer.whole = Some(bytes);
        Ok(())
    }

    /// The upstream request for `c` with `body`.
    pub(crate) fn request(&self, c: &CandidateView, body: &[u8]) -> worker::Result<Request> {
        let headers = Headers::new();
        for (name, value) in &self.headers {
            headers.set(name, value)?;
        }
        headers.set("content-type", "application/json")?;
        headers.set("x-request-id", &self.request_id)?;
        if let Some(key) = &c.api_key {
            headers.set("authorization", &format!("Bearer {key}"))?;
        }
        let mut init = RequestInit::new();
        init.with_method(Method::Post)
            .with_headers(headers)
            .with_body(Some(js_sys::Uint8Array::from(body).into()));
        Request::new_with_init(&format!("{}{}", c.url, self.path), &init)
    }

    /// Candidates of the ranking not tried yet.
    pub(crate) fn untried(&self) -> usize {
        self.candidates.len().saturating_sub(self.next_index)
    }

    /// Moves the lease to the next candidate in the ranking that takes it, reporting `failure`
    /// for the backend it leaves (a retry in the pool's budget).
    pub(crate) async fn move_on(&mut self, failure: &Outcome, missing_model: bool) -> Moved {
        while self.next_index < self.candidates.len() {
            let to = self.candidates[self.next_index].clone();
            self.next_index += 1;
            let req = ReassignRequest {
                lease_id: self.guard.lease_id(),
                to: to.id.clone(),
                failure: failure.clone(),
                terms: Some(self.guard.terms()),
                block_hashes: self.block_hashes.clone(),
                missing_model: missing_model.then(|| self.model.clone()),
            };
            let moved: Result<CandidateView, ApiError> = pool_json(
                &self.env,
                &self.pool,
                self.shard,
                &Route::Reassign,
                Some(&req),
            )
            .await;
            match moved {
                Ok(view) => {
                    self.guard.moved_to(&view.id.0);
                    return Moved::To(view);
                }
                Err(e) if e.code.as_deref() == Some("retry_budget_exhausted") => {
                    return Moved::Refused;
                }
                Err(_) => continue, // that candidate became unavailable; try the next
            }
        }
        Moved::Nowhere
    }
}

/// The relay's side of a streamed answer from `c`: its body after the first chunk.
pub(crate) fn stream_upstream(
    body: web_sys::ReadableStream,
    first_chunk: Option<JsValue>,
    abort: LinkedAbort,
    c: &CandidateView,
    settings: &ProxySettings,
) -> Upstream {
    Upstream {
        body,
        first_chunk,
        abort,
        backend: c.id.0.clone(),
        idle_timeout: settings.stream_idle_timeout,
    }
}

/// Copies the backend's reported usage into the outcome.
pub(crate) fn with_usage(outcome: &mut Outcome, usage: Option<Usage>) {
    if let Some(u) = usage {
        outcome.prompt_tokens = Some(u.prompt_tokens);
        outcome.cached_tokens = u.cached_tokens;
        outcome.completion_tokens = Some(u.completion_tokens);
    }
}

/// Reads a whole body, up to `limit` bytes. A body that breaks off is a transport failure; one
/// over the limit is not retried (another backend would send as much).
async fn read_whole(
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

/// Reads the first chunk of a stream within `timeout`, then unlocks the stream for piping.
async fn read_first_chunk(
    stream: &web_sys::ReadableStream,
    timeout: Duration,
    backend: &str,
) -> Result<JsValue, AttemptFailure> {
    let reader: web_sys::ReadableStreamDefaultReader = stream.get_reader().unchecked_into();
    let read = JsFuture::from(reader.read());
    let result = with_timeout(read, timeout).await;
    let fail = AttemptFailure::new;
    let chunk = match result {
        None => {
            let _ = reader.cancel();
            return Err(fail(
                OutcomeKind::Timeout,
                format!(
                    "backend {backend} sent no first token within {} ms",
                    timeout.as_millis()
                ),
            ));
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
    reader.release_lock();
    js_sys::Reflect::get(&chunk, &"value".into()).map_err(|_| {
        fail(
            OutcomeKind::Transport,
            format!("backend {backend} sent an unreadable chunk"),
        )
    })
}

/// The client's error after every allowed attempt failed.
fn final_error(failure: &AttemptFailure, attempts: u32, suffix: &str) -> ApiError {
    let message = format!(
        "Upstream failed after {attempts} attempt(s): {}{suffix}",
        failure.reason
    );
    match failure.outcome.kind {
        OutcomeKind::Timeout => ApiError::gateway_timeout(message),
        OutcomeKind::RateLimited => ApiError::rate_limited(message, 1),
        _ => ApiError::bad_gateway(message),
    }
}
