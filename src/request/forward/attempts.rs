//! The attempts on a grant's candidates: building the upstream request (the forwarded headers,
//! the backend's key), calling a backend with the first-byte or response timeout, reading a
//! stream's first chunk or a whole non-streamed answer (bounded, and only whole JSON passes), and
//! moving the lease to the next candidate after a failure, within the pool's retry budget.
//!
//! Only real answers pass: redirects are not followed (a 3xx is the backend's failure: the prompt
//! never goes to a host the operator did not register), a stream must be `text/event-stream` and
//! a whole answer JSON (a login page's 200 `text/html` is a failure, retried elsewhere), and a 404
//! means "model unloaded" only when it is vLLM's model-not-found answer (any other 404 is a
//! misconfigured URL, the backend's failure). Transport error text goes to the log, never to the
//! client.
//! [`Attempts`] owns what that takes (the candidates, the lease's guard, a share of the request's
//! context, `src/request/context.rs`), so the proxy (`proxy.rs`) makes the first attempts and a
//! stream's resumption (`resume.rs`) can go on making them from `wait_until`.

use crate::platform::do_client::{call, To};
use crate::platform::http::{Deadlines, HeaderList, Sleep};
use crate::platform::settings::ProxySettings;
use crate::request::context::RequestContext;
use crate::request::forward::relay::Upstream;
use crate::request::forward::upstream_body::{
    not_an_answer, read_first_chunk, read_whole, AttemptFailure,
};
use crate::request::lease::lease_guard::LeaseGuard;
use coordinator_protocol::messages::{ReassignAnswer, ReassignRequest};
use coordinator_protocol::timed_fetch::{
    send_until as await_fetch, start_web_fetch, FetchFailure, LinkedAbort,
};
use coordinator_protocol::ApiError;
use futures_util::future::{select, Either};
use routing_core::backend::BackendId;
use routing_core::pool::{CandidateView, Refusal};
use routing_core::request::endpoint::Endpoint;
use routing_core::stream::outcome::{judge_answer, AnswerVerdict, Outcome, OutcomeKind};
use routing_core::stream::usage::{body_report, Usage};
use serde_json::Value;
use std::rc::Rc;
use std::time::Duration;
use wasm_bindgen::{JsCast, JsValue};
use wasm_bindgen_futures::JsFuture;
use worker::{console_error, AbortSignal, Headers};

/// Upstream response headers passed to the client.
pub(crate) const PASSED_RESPONSE_HEADERS: [&str; 3] =
    ["content-type", "cache-control", "openai-processing-ms"];

/// Largest non-streamed answer read from a backend (embeddings of large batches included).
pub(crate) const MAX_ANSWER_BYTES: usize = 32 * 1024 * 1024;

/// Most of a 4xx body read: enough for vLLM's error message, and to tell its model-not-found
/// answer from any other 404.
const MAX_NOT_FOUND_BYTES: usize = 64 * 1024;

/// A successful (or non-retryable) attempt: headers known, and either the whole body or, for a
/// stream, its first chunk and the rest of the body.
pub(crate) struct Answer {
    pub(crate) status: u16,
    pub(crate) headers: Headers,
    /// A body read whole (or rewritten: an upstream client error).
    pub(crate) whole: Option<Vec<u8>>,
    pub(crate) usage: Option<Usage>,
    /// The id of the Responses API response a whole answer is (the pool records its holder).
    pub(crate) response_id: Option<String>,
    pub(crate) first_chunk: Option<JsValue>,
    /// A stream's body after its first chunk, locked to this reader.
    pub(crate) reader: Option<web_sys::ReadableStreamDefaultReader>,
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
            response_id: None,
            first_chunk: None,
            reader: None,
            ttfb_ms,
            abort,
        }
    }
}

/// What an upstream request is made of, besides its backend and body: known before any pool
/// is asked, so a fetch can be sent beside the lease call (`src/request/ahead.rs`).
#[derive(Clone, Copy)]
pub(crate) struct UpstreamCall<'a> {
    pub(crate) forwarded_headers: &'a [(String, String)],
    pub(crate) request_id: &'a str,
    pub(crate) endpoint: Endpoint,
    /// The first byte's deadline (a stream) or the whole answer's.
    pub(crate) timeout: Duration,
    pub(crate) deadlines: &'a Deadlines,
}

impl UpstreamCall<'_> {
    /// The deadline an attempt has: to a stream's first byte, or to a whole answer.
    pub(crate) fn timeout_for(proxy: &ProxySettings, stream: bool) -> Duration {
        match stream {
            true => proxy.first_byte_timeout,
            false => proxy.response_timeout,
        }
    }

    /// A granted request's.
    pub(crate) fn of(request: &RequestContext) -> UpstreamCall<'_> {
        UpstreamCall {
            forwarded_headers: &request.forwarded_headers,
            request_id: &request.request_id,
            endpoint: request.endpoint,
            timeout: Self::timeout_for(&request.settings.proxy, request.stream()),
            deadlines: &request.deadlines,
        }
    }
}

/// A fresh id for one upstream fetch (`gw-` and 96 random bits).
fn upstream_request_id() -> String {
    format!("gw-{}", crate::platform::http::random_hex(12))
}

/// The body of a backend's error answer (a 503, a 404, another non-2xx), at most
/// `MAX_NOT_FOUND_BYTES`, read by the attempt's deadline: empty when it has none, fails or comes
/// late. Only its shape or message is judged.
async fn error_body(resp: &web_sys::Response, deadline: &mut Sleep, backend: &str) -> Vec<u8> {
    let Some(stream) = resp.body() else {
        return Vec::new();
    };
    let read = Box::pin(read_whole(&stream, MAX_NOT_FOUND_BYTES, backend));
    let bytes = match select(read, deadline).await {
        Either::Left((Ok(bytes), _)) => bytes,
        _ => Vec::new(),
    };
    bytes
}

/// An upstream fetch sent and not yet answered: its promise, its abort, its deadline.
pub(crate) struct PendingFetch {
    fetch: js_sys::Promise,
    /// Taken when the fetch is waited for; a `PendingFetch` dropped before that aborts it.
    abort: Option<LinkedAbort>,
    deadline: Sleep,
    started_ms: u64,
    timeout: Duration,
    backend: BackendId,
}

impl PendingFetch {
    /// The backend it went to.
    pub(crate) fn backend(&self) -> &BackendId {
        &self.backend
    }

    /// Its response, by its deadline.
    pub(crate) async fn response(
        mut self,
    ) -> Result<(web_sys::Response, LinkedAbort), FetchFailure> {
        self.wait().await
    }

    /// Waits for the response by the deadline; from here on the abort is the caller's.
    async fn wait(&mut self) -> Result<(web_sys::Response, LinkedAbort), FetchFailure> {
        let Some(abort) = self.abort.take() else {
            return Err(FetchFailure::Transport(
                "the fetch was waited for already".into(),
            ));
        };
        await_fetch(self.fetch.clone(), abort, &mut self.deadline).await
    }

    /// Aborts it: the backend stops on the request, and nothing of it is read.
    pub(crate) fn abort(mut self) {
        self.abort_unread();
    }

    /// Aborts a fetch nobody waits for, and waits for its rejection itself (an abort rejects the
    /// fetch's promise: unawaited, that would be an unhandled rejection in the runtime's log).
    fn abort_unread(&mut self) {
        if let Some(abort) = self.abort.take() {
            abort.abort();
            let fetch = self.fetch.clone();
            wasm_bindgen_futures::spawn_local(async move {
                let _ = JsFuture::from(fetch).await;
            });
        }
    }
}

impl Drop for PendingFetch {
    fn drop(&mut self) {
        self.abort_unread();
    }
}

/// Sends `body` to backend `c` now, after `delay_ms` (a modelled round trip, `SIMULATE_NETWORK`
/// only): the forwarded headers, the backend's key, redirects not followed.
pub(crate) fn send(
    call: &UpstreamCall<'_>,
    c: &CandidateView,
    body: &[u8],
    client_signal: &AbortSignal,
    delay_ms: u64,
) -> Result<PendingFetch, AttemptFailure> {
    let built = || -> Result<web_sys::RequestInit, JsValue> {
        let mut list = HeaderList::new();
        for (name, value) in call.forwarded_headers {
            list.set(name, value);
        }
        // A multipart route forwards the client's own content type (its boundary).
        if !call.endpoint.is_multipart() {
            list.set("content-type", "application/json");
        }
        // vLLM takes `x-request-id` as its engine request id, and versions before PR #27987
        // refuse one still running: a client's id (a retry, or a constant id two tenants share)
        // would collide there. The backend gets an id the gateway made for this one fetch; the
        // client's stays in the access log and the response header.
        list.set("x-request-id", &upstream_request_id());
        if let Some(key) = &c.api_key {
            list.set("authorization", &format!("Bearer {key}"));
        }
        let headers = list.build()?;
        let init = web_sys::RequestInit::new();
        init.set_method("POST");
        // A 3xx comes back as it is, and counts as the backend's failure.
        init.set_redirect(web_sys::RequestRedirect::Manual);
        init.set_headers(&headers);
        init.set_body(&js_sys::Uint8Array::from(body));
        Ok(init)
    };
    let init = built().map_err(|e| {
        console_error!(
            "request {}: cannot build the request to backend {}: {}",
            call.request_id,
            c.id.0,
            worker::Error::from(e)
        );
        AttemptFailure::new(
            OutcomeKind::Transport,
            format!("the request to backend {} could not be built", c.id.0),
        )
    })?;
    let url = format!("{}{}", c.url, call.endpoint.path());
    let started_ms = crate::platform::http::now_ms();
    // One deadline for the response and, for a stream, its first chunk or, otherwise, its body.
    let deadline = call.deadlines.sleep(call.timeout);
    let (fetch, abort) = match delay_ms {
        0 => start_web_fetch(&url, &init, Some(client_signal)),
        _ => {
            let abort = LinkedAbort::new(Some(client_signal));
            init.set_signal(Some(abort.signal()));
            let fetch = wasm_bindgen_futures::future_to_promise(async move {
                worker::Delay::from(Duration::from_millis(delay_ms)).await;
                let global: web_sys::WorkerGlobalScope = js_sys::global().unchecked_into();
                JsFuture::from(global.fetch_with_str_and_init(&url, &init)).await
            });
            (fetch, abort)
        }
    };
    // Marked handled at once: a fetch sent ahead can reject (refused, or aborted by the client's
    // hang-up) before anything waits for it, which the runtime would log as an unhandled
    // rejection. Whatever waits for it later still sees the rejection.
    crate::platform::isolate::with_ignore_rejection(|ignore| {
        let _ = fetch.catch(ignore);
    });
    Ok(PendingFetch {
        fetch,
        abort: Some(abort),
        deadline,
        started_ms,
        timeout: call.timeout,
        backend: c.id.clone(),
    })
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
    /// The request (its pool and shard: the lease's moves go to the shard that granted it).
    pub(crate) request: Rc<RequestContext>,
    pub(crate) guard: LeaseGuard,
    pub(crate) candidates: Vec<CandidateView>,
    /// The next candidate in the ranking not tried yet.
    pub(crate) next_index: usize,
    /// Attempts made so far.
    pub(crate) count: u32,
}

impl Attempts {
    /// The attempts on `candidates`, the first of which the grant's lease is on.
    pub(crate) fn new(
        request: Rc<RequestContext>,
        guard: LeaseGuard,
        candidates: Vec<CandidateView>,
    ) -> Attempts {
        Attempts {
            request,
            guard,
            candidates,
            next_index: 1,
            count: 0,
        }
    }

    /// Timeouts, retries and resumptions.
    pub(crate) fn settings(&self) -> &ProxySettings {
        &self.request.settings.proxy
    }

    /// One attempt on `c` with `body`: the answer's headers and first chunk (a stream) or whole
    /// body, or why it failed before anything reached the client.
    pub(crate) async fn attempt(
        &self,
        c: &CandidateView,
        body: &[u8],
        client_signal: &AbortSignal,
    ) -> Result<Answer, AttemptFailure> {
        let sent = send(&UpstreamCall::of(&self.request), c, body, client_signal, 0)?;
        self.attempt_sent(c, sent).await
    }

    /// The attempt whose fetch was sent already (by [`Attempts::attempt`], or beside the lease
    /// call, `src/request/ahead.rs`) on `c`.
    pub(crate) async fn attempt_sent(
        &self,
        c: &CandidateView,
        sent: PendingFetch,
    ) -> Result<Answer, AttemptFailure> {
        let mut sent = sent;
        let (started, timeout) = (sent.started_ms, sent.timeout);
        let elapsed = || crate::platform::http::now_ms().saturating_sub(started);
        let (resp, abort) = sent.wait().await.map_err(|f| match f {
            FetchFailure::Timeout => AttemptFailure {
                // How long it waited, for the pool to weigh against the backend's queue.
                outcome: Outcome {
                    ttfb_ms: Some(elapsed()),
                    ..Outcome::of_kind(OutcomeKind::Timeout)
                },
                ..AttemptFailure::new(
                    OutcomeKind::Timeout,
                    format!(
                        "backend {} sent no response within {} ms",
                        c.id.0,
                        timeout.as_millis()
                    ),
                )
            },
            FetchFailure::Transport(e) => {
                // The platform's text stays in the log: it is not the client's business.
                console_error!(
                    "request {}: backend {} could not be reached: {e}",
                    self.request.request_id,
                    c.id.0
                );
                AttemptFailure::new(
                    OutcomeKind::Transport,
                    format!("backend {} could not be reached", c.id.0),
                )
            }
        })?;
        let status = resp.status();
        let mut kind = OutcomeKind::from_status(status);
        // A 503 may be vLLM's load shedding: its body tells (read with a bound).
        let mut shed = false;
        if status == 503 {
            let text = error_body(&resp, &mut sent.deadline, &c.id.0).await;
            if judge_answer(status, &text) == (AnswerVerdict::Load { shed: true }) {
                // Load, like a 429: no breaker charge, the next backend is tried.
                shed = true;
                kind = OutcomeKind::RateLimited;
            }
        }
        // 401/403 from a backend means it rejects the gateway's own key (the client's is never
        // sent): the backend's misconfiguration, so it counts against it and is retried elsewhere.
        let rejects_gateway = matches!(status, 401 | 403);
        if matches!(kind, OutcomeKind::ServerError | OutcomeKind::RateLimited) || rejects_gateway {
            let mut outcome = Outcome::from_status(status);
            outcome.kind = kind;
            if rejects_gateway {
                outcome.kind = OutcomeKind::ServerError;
            }
            outcome.ttfb_ms = Some(elapsed());
            abort.abort();
            let why = if rejects_gateway {
                " (it rejects the gateway's API key for it)"
            } else if shed {
                " (vLLM's load shedding: its queue is full)"
            } else {
                ""
            };
            return Err(AttemptFailure {
                outcome,
                reason: format!("backend {} answered {status}{why}", c.id.0),
                ..AttemptFailure::new(kind, String::new())
            });
        }
        if (300..400).contains(&status) {
            // Redirects are not followed: the prompt goes only to registered backends.
            abort.abort();
            return Err(AttemptFailure {
                outcome: Outcome {
                    kind: OutcomeKind::ServerError,
                    ttfb_ms: Some(elapsed()),
                    ..Outcome::from_status(status)
                },
                reason: format!(
                    "backend {} answered a {status} redirect, which the gateway does not follow",
                    c.id.0
                ),
                ..AttemptFailure::new(OutcomeKind::ServerError, String::new())
            });
        }
        if status == 404 {
            let text = error_body(&resp, &mut sent.deadline, &c.id.0).await;
            if routing_core::stream::api_events::is_response_not_found(&text) {
                // A `previous_response_id` this backend does not hold: the client's error.
                let text = String::from_utf8_lossy(&text);
                return Ok(Answer::client_error(404, &text, abort, elapsed()));
            }
            abort.abort();
            let outcome = Outcome {
                ttfb_ms: Some(elapsed()),
                ..Outcome::from_status(404)
            };
            let verdict = judge_answer(404, &text);
            if verdict == AnswerVerdict::EndpointNotServed {
                // The server has no such route for its model's task (embeddings on a chat
                // model): an answer about the model, not the backend's failure.
                return Err(AttemptFailure {
                    outcome: Outcome {
                        kind: OutcomeKind::ClientError,
                        ..outcome
                    },
                    reason: format!(
                        "backend {} does not serve {} for the model",
                        c.id.0,
                        self.request.endpoint.path()
                    ),
                    unserved_endpoint: true,
                    ..AttemptFailure::new(OutcomeKind::ClientError, String::new())
                });
            }
            if verdict == AnswerVerdict::ModelNotFound {
                // The model was unloaded since the last probe: not the backend's fault, and
                // another backend may have it.
                return Err(AttemptFailure {
                    outcome,
                    reason: format!("backend {} does not serve the model", c.id.0),
                    missing_model: true,
                    ..AttemptFailure::new(OutcomeKind::ClientError, String::new())
                });
            }
            // Any other 404 is a backend that does not have the endpoint: a misconfigured URL.
            return Err(AttemptFailure {
                outcome: Outcome {
                    kind: OutcomeKind::ServerError,
                    ..outcome
                },
                reason: format!(
                    "backend {} answered 404 for {} (not a model-not-found answer: its URL may be wrong)",
                    c.id.0, self.request.endpoint.path()
                ),
                ..AttemptFailure::new(OutcomeKind::ServerError, String::new())
            });
        }
        if !(200..300).contains(&status) {
            // A client error the backend reported: pass it on in the OpenAI shape (its body read
            // with a bound: only its message is kept).
            let text = error_body(&resp, &mut sent.deadline, &c.id.0).await;
            let text = String::from_utf8_lossy(&text);
            return Ok(Answer::client_error(status, &text, abort, elapsed()));
        }
        let body = resp.body();
        let mut answer = Answer {
            status,
            headers: Headers(resp.headers()),
            whole: None,
            usage: None,
            response_id: None,
            first_chunk: None,
            reader: None,
            ttfb_ms: 0,
            abort,
        };
        // Whatever fails from here on, the upstream request is closed, not left to the collector.
        let read = self
            .read_answer(&mut answer, body, &mut sent.deadline, timeout, &c.id.0)
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
        deadline: &mut Sleep,
        timeout: Duration,
        backend: &str,
    ) -> Result<(), AttemptFailure> {
        let content_type = answer
            .headers
            .get("content-type")
            .ok()
            .flatten()
            .unwrap_or_default()
            .to_ascii_lowercase();
        if self.request.stream() {
            // Only an event stream is a stream (a login page's 200 text/html is not).
            if !content_type.starts_with("text/event-stream") {
                return Err(not_an_answer(backend, &content_type, "text/event-stream"));
            }
            let Some(stream) = body else {
                return Err(AttemptFailure::new(
                    OutcomeKind::Transport,
                    format!("backend {backend} sent no stream"),
                ));
            };
            let (reader, first) = read_first_chunk(&stream, deadline, timeout, backend).await?;
            answer.first_chunk = Some(first);
            answer.reader = Some(reader);
            return Ok(());
        }
        let bytes = match body {
            Some(stream) => {
                let read = Box::pin(read_whole(&stream, MAX_ANSWER_BYTES, backend));
                match select(read, deadline).await {
                    Either::Left((bytes, _)) => bytes?,
                    Either::Right(_) => {
                        return Err(AttemptFailure::new(
                            OutcomeKind::Timeout,
                            format!(
                                "backend {backend} did not finish its answer within {} ms",
                                timeout.as_millis()
                            ),
                        ))
                    }
                }
            }
            None => Vec::new(),
        };
        // Never a 200 with broken JSON or with something else: every vLLM answer is JSON, so a
        // body that is not one whole JSON document (or says it is something else, such as a
        // login page) is the backend's failure.
        if !(content_type.is_empty() || content_type.contains("json")) {
            return Err(not_an_answer(backend, &content_type, "JSON"));
        }
        let report = body_report(&bytes).map_err(|e| {
            AttemptFailure::new(
                OutcomeKind::Transport,
                format!("backend {backend} sent an incomplete or invalid JSON answer ({e})"),
            )
        })?;
        answer.usage = report.usage;
        answer.response_id = report.response_id;
        answer.whole = Some(bytes);
        Ok(())
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
                block_hashes: self.request.features.block_hashes.clone(),
                missing_model: missing_model.then(|| self.request.model().to_string()),
            };
            let to_pool = To::Pool(&self.request.pool, self.request.shard);
            match call(&self.request.env, to_pool, &req).await {
                Ok(ReassignAnswer::Moved(view)) => {
                    self.guard.moved_to(&view.id.0);
                    return Moved::To(view);
                }
                Ok(ReassignAnswer::Refused(Refusal::RetryBudgetExhausted)) => {
                    return Moved::Refused
                }
                // That candidate became unavailable (or the pool did not answer): try the next.
                Ok(ReassignAnswer::Refused(_)) | Err(_) => continue,
            }
        }
        Moved::Nowhere
    }
}

/// The relay's side of a streamed answer from `c`: its body after the first chunk.
pub(crate) fn stream_upstream(
    reader: web_sys::ReadableStreamDefaultReader,
    first_chunk: Option<JsValue>,
    abort: LinkedAbort,
    c: &CandidateView,
    settings: &ProxySettings,
) -> Upstream {
    Upstream {
        reader,
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

/// The client's error when the request failed with a 5xx on two backends: the request's own
/// failure (vLLM answers 500 for a request-specific engine error), so another backend would fail
/// it the same way. A 5xx-class answer without the backends' internals.
pub(crate) fn request_error(status: u16, attempts: u32) -> ApiError {
    ApiError::bad_gateway(format!(
        "The request failed on {attempts} backends, each answering {}xx: the failure is specific \
         to this request, so it was not retried further.",
        status / 100
    ))
    .with_code("upstream_request_error")
}

/// The client's error after every allowed attempt failed.
pub(crate) fn final_error(failure: &AttemptFailure, attempts: u32, suffix: &str) -> ApiError {
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
