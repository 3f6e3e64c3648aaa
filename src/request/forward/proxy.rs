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
//! themselves (the upstream request, the first chunk, moving the lease) are `attempts.rs`'s.
//!
//! Blame goes to what failed: a 5xx that a second backend repeats (the same status) for the same
//! request is the request's (a request-specific engine error), so it is not retried on a third, the client gets a
//! 5xx-class error that says so, and the release tells the pool (`Outcome::request_fault`) to
//! charge neither backend's breaker (the first one's charge was deferred at the move).
//! Every exit reports its outcome to the lease's guard (`src/request/lease/lease_guard.rs`), which
//! releases the lease from `wait_until`. A client that hangs up aborts the upstream fetch through
//! its signal.

use crate::platform::http::HeaderList;
use crate::request::context::RequestContext;
use crate::request::forward::attempts::{
    final_error, request_error, send, stream_upstream, with_usage, Answer, Attempts, Moved,
    PendingFetch, UpstreamCall, MAX_ANSWER_BYTES, PASSED_RESPONSE_HEADERS,
};
use crate::request::forward::relay::Relay;
use crate::request::forward::resume::Resumption;
use crate::request::forward::upstream_body::{read_whole, AttemptFailure};
use crate::request::lease::lease_guard::LeaseGuard;
use coordinator_protocol::timed_fetch::FetchFailure;
use coordinator_protocol::ApiError;
use futures_util::future::{select, Either};
use routing_core::pool::{CandidateView, Grant};
use routing_core::stream::outcome::{Outcome, OutcomeKind, StoredResponse};
use routing_core::stream::usage::body_usage;
use serde_json::{json, Value};
use std::rc::Rc;
use wasm_bindgen::JsCast;
use worker::{Context, Headers, Response};

/// One proxied request's run on the lease a pool granted it.
pub struct Forward<'a> {
    /// The request, as every stage sees it.
    pub(crate) request: Rc<RequestContext>,
    /// Worker context, for `wait_until`.
    pub ctx: &'a Context,
    /// The lease and its ranked candidates.
    pub grant: Grant,
    /// The lease's guard: every exit reports to it.
    pub guard: LeaseGuard,
    /// The request body as sent upstream.
    pub body: Vec<u8>,
    /// Where the time before the attempts went, for `Server-Timing`.
    pub timing: Timing,
    /// Headers the pool walk adds (the pool choice, the queue wait).
    pub extra_headers: Vec<(&'static str, String)>,
    /// A modelled edge-to-pool round trip waited out before the first attempt (local runs with
    /// `SIMULATE_NETWORK` only; 0 on the platform).
    pub network_delay_ms: u64,
    /// The first attempt's fetch, sent beside the lease call to the backend the grant chose
    /// (`src/request/ahead.rs`), if it was.
    pub ahead: Option<PendingFetch>,
}

/// Where a request's time to its response went before the attempts, for `Server-Timing` (whole
/// milliseconds: workerd's clock).
pub struct Timing {
    /// When the Worker started on the request.
    pub entered_ms: u64,
    /// Choosing a backend: the pool list, the plan and the lease calls (`route`).
    pub route_ms: u64,
    /// From the start to sending the lease call that granted: key, body, features, pool list,
    /// plan, and the calls to pools that refused (`pre`).
    pub pre_ms: u64,
    /// That lease call to the pool's Durable Object, its wait in the pool's queue (and a modelled
    /// round trip, `SIMULATE_NETWORK`) included (`acquire`).
    pub acquire_ms: u64,
}

impl Timing {
    /// The header's value: `route` and `upstream` (the attempts, to the first chunk), then the
    /// finer parts, `pre`, `acquire`, and `worker` (the start to the response's headers).
    fn header_value(&self, upstream_ms: u64) -> String {
        let worker_ms = crate::platform::http::now_ms().saturating_sub(self.entered_ms);
        format!(
            "route;dur={}, upstream;dur={upstream_ms}, pre;dur={}, acquire;dur={}, worker;dur={worker_ms}",
            self.route_ms, self.pre_ms, self.acquire_ms
        )
    }
}

impl Forward<'_> {
    /// Runs the attempts and returns the client's response.
    pub async fn run(self) -> Result<Response, ApiError> {
        self.run_on(None).await
    }

    /// Runs the attempts on the grant's candidates (the decode candidates of a disaggregated
    /// request whose prefill ran on `prefill_backend`: those are not retried elsewhere).
    async fn run_on(mut self, prefill_backend: Option<String>) -> Result<Response, ApiError> {
        let client_signal = self.request.client_signal.clone();
        // Sent beside the lease call, it waited its modelled round trip already.
        let mut ahead = self.ahead.take();
        if self.network_delay_ms > 0 && ahead.is_none() {
            self.count_simulated_wait();
            worker::Delay::from(std::time::Duration::from_millis(self.network_delay_ms)).await;
        }
        let max_retries = match prefill_backend {
            None => self.request.settings.proxy.max_retries,
            Some(_) => 0,
        };
        let mut attempts = self.attempts();
        let mut candidate = self
            .grant
            .candidates
            .first()
            .cloned()
            .ok_or_else(|| ApiError::internal("grant without candidates"))?;
        // The 5xx status an earlier attempt of this request got from its backend, if any.
        let mut earlier_5xx: Option<u16> = None;
        loop {
            attempts.count += 1;
            let tried = match ahead.take() {
                Some(sent) => attempts.attempt_sent(&candidate, sent).await,
                None => {
                    attempts
                        .attempt(&candidate, &self.body, &client_signal)
                        .await
                }
            };
            let mut failure = match tried {
                Ok(answer) => {
                    return self.respond(answer, &candidate, attempts, prefill_backend);
                }
                Err(f) => f,
            };
            if client_signal.aborted() {
                self.guard.finish(Outcome::of_kind(OutcomeKind::Cancelled));
                return Err(ApiError::client_closed());
            }
            if failure.outcome.is_suspect_5xx() {
                if earlier_5xx.is_some() && earlier_5xx == failure.outcome.status {
                    // The second backend fails it the same way: the request's failure. Neither
                    // breaker is charged, and a third backend would fail it too.
                    failure.outcome.request_fault = true;
                    self.guard.finish(failure.outcome.clone());
                    let status = failure.outcome.status.unwrap_or(500);
                    return Err(request_error(status, attempts.count));
                }
                earlier_5xx = failure.outcome.status;
            }
            let moved = if failure.retryable && attempts.count <= max_retries {
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
                        return Err(ApiError::model_not_found(self.request.model()));
                    }
                    if failure.unserved_endpoint {
                        let what = self.request.endpoint.path();
                        return Err(ApiError::model_does_not_support(self.request.model(), what));
                    }
                    return Err(final_error(&failure, attempts.count, ""));
                }
            }
        }
    }

    /// Counts a modelled round trip waited out here in the waits header (`SIMULATE_NETWORK`).
    fn count_simulated_wait(&mut self) {
        let header = crate::request::hop::SIMULATED_WAITS_HEADER;
        if let Some((_, v)) = self.extra_headers.iter_mut().find(|(k, _)| *k == header) {
            *v = (v.parse::<u32>().unwrap_or(0) + 1).to_string();
        }
    }

    /// What it takes to make attempts on the grant's candidates, owned.
    fn attempts(&self) -> Attempts {
        Attempts::new(
            self.request.clone(),
            self.guard.clone(),
            self.grant.candidates.clone(),
        )
    }

    fn respond(
        self,
        answer: Answer,
        c: &CandidateView,
        attempts: Attempts,
        prefill_backend: Option<String>,
    ) -> Result<Response, ApiError> {
        let request = &self.request;
        // Collected here, made into the platform's headers in one call.
        let mut out = HeaderList::new();
        let mut set = |k: &str, v: &str| out.set(k, v);
        for name in PASSED_RESPONSE_HEADERS {
            if let Some(v) = answer.headers.get(name).ok().flatten() {
                set(name, &v);
            }
        }
        set("x-request-id", &request.request_id);
        set("x-gateway-pool", &request.pool);
        set("x-gateway-shard", &request.shard.to_string());
        set("x-gateway-backend", &c.id.0);
        set("x-gateway-attempts", &attempts.count.to_string());
        for (k, v) in &self.extra_headers {
            set(k, v);
        }
        // Where the time to the first byte went: routing (pools, lease), the upstream attempts,
        // and the Worker's parts.
        set("server-timing", &self.timing.header_value(answer.ttfb_ms));
        if let Some(p) = &prefill_backend {
            set("x-gateway-prefill-backend", p);
        }
        if let Some(d) = self.grant.decision {
            if let Ok(serde_json::Value::String(s)) = serde_json::to_value(d) {
                set("x-gateway-decision", &s);
            }
        }
        // What the time model expected of the backend it chose (not of a fallback).
        if let (Some(p), true) = (self.grant.predicted_ttft_ms, c.id == self.grant.backend) {
            set("x-gateway-predicted-ttft-ms", &p.to_string());
        }
        // What the router weighed: the chosen backend's prediction and the best alternative's.
        if let Some(r) = &self.grant.receipt {
            set(
                "x-gateway-route-receipt",
                &r.header_value(&self.grant.backend),
            );
            self.guard.note_receipt(&self.grant.backend, r);
        }
        let out = Headers(
            out.build()
                .map_err(|e| ApiError::from(worker::Error::from(e)))?,
        );
        let status = answer.status;
        let mut outcome = Outcome::from_status(status);
        outcome.ttfb_ms = Some(answer.ttfb_ms);
        if request.stream() {
            // Lease evidence: the pool hears of it on the next renewal (or at once, when it was
            // told the stream was overdue).
            self.guard.first_token(answer.ttfb_ms);
        }
        let (Some(reader), true) = (answer.reader, request.stream()) else {
            with_usage(&mut outcome, answer.usage);
            // A stored response's id goes to the pool with the release: its follow-ups are
            // pinned to this backend.
            if (200..300).contains(&status) {
                outcome.stored_response =
                    StoredResponse::answered(&request.features, answer.response_id);
            }
            self.guard.finish(outcome);
            let bytes = answer.whole.unwrap_or_default();
            return Ok(Response::builder()
                .with_status(status)
                .with_headers(out)
                .fixed(bytes));
        };
        let relay = Relay::new(request.strip_usage_event, request.deadlines.clone())
            .map_err(|_| ApiError::internal("TransformStream unavailable"))?
            .for_endpoint(request.endpoint);
        let readable = relay.readable();
        let upstream = stream_upstream(
            reader,
            answer.first_chunk,
            answer.abort,
            c,
            attempts.settings(),
        );
        // A disaggregated request's decode share cannot move: its stream is never resumed.
        let resumption = match prefill_backend {
            None => Resumption::of(request, self.body),
            Some(_) => Resumption::never(),
        };
        if resumption.collects() {
            relay.collect();
        }
        self.ctx.wait_until(crate::request::forward::resume::stream(
            relay, upstream, attempts, resumption, outcome,
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
            // vLLM refuses `min_tokens` above `max_tokens: 1` (400); upstream's own proxy
            // removes them from the prefill request too.
            obj.remove("min_tokens");
            obj.remove("min_completion_tokens");
            obj.remove("stream_options");
        }
        let bytes =
            serde_json::to_vec(&prefill_body).map_err(|e| ApiError::internal(e.to_string()))?;
        let client_signal = self.request.client_signal.clone();
        let fail = |kind: OutcomeKind, reason: String| AttemptFailure::new(kind, reason);
        let params = async {
            let call = UpstreamCall {
                timeout: self.request.settings.proxy.response_timeout,
                ..UpstreamCall::of(&self.request)
            };
            // One deadline for the prefill's answer, its body included: a prefill server that
            // sends its headers and then stalls cannot hold the request (and its lease) forever.
            let timeout = call.timeout;
            let mut deadline = call.deadlines.sleep(timeout);
            let (resp, abort) = send(&call, &prefill, &bytes, &client_signal, 0)?
                .response()
                .await
                .map_err(|f| match f {
                    FetchFailure::Timeout => fail(
                        OutcomeKind::Timeout,
                        format!("prefill backend {} timed out", prefill.id.0),
                    ),
                    FetchFailure::Transport(e) => {
                        worker::console_error!(
                            "request {}: prefill backend {} could not be reached: {e}",
                            self.request.request_id,
                            prefill.id.0
                        );
                        fail(
                            OutcomeKind::Transport,
                            format!("prefill backend {} could not be reached", prefill.id.0),
                        )
                    }
                })?;
            let status = resp.status();
            if !(200..300).contains(&status) {
                return Err(AttemptFailure {
                    outcome: Outcome::from_status(status),
                    reason: format!("prefill backend {} answered {status}", prefill.id.0),
                    retryable: false,
                    missing_model: false,
                    unserved_endpoint: false,
                });
            }
            let bytes = match resp.body() {
                Some(s) => {
                    let read = Box::pin(read_whole(&s, MAX_ANSWER_BYTES, &prefill.id.0));
                    match select(read, &mut deadline).await {
                        Either::Left((bytes, _)) => bytes?,
                        Either::Right(_) => {
                            abort.abort();
                            return Err(fail(
                                OutcomeKind::Timeout,
                                format!(
                                    "prefill backend {} did not finish its answer within {} ms",
                                    prefill.id.0,
                                    timeout.as_millis()
                                ),
                            ));
                        }
                    }
                }
                None => Vec::new(),
            };
            let answer: Value = serde_json::from_slice(&bytes).map_err(|_| {
                fail(
                    OutcomeKind::Transport,
                    format!(
                        "prefill backend {} sent an answer that is not JSON",
                        prefill.id.0
                    ),
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
        self.run_on(Some(prefill.id.0)).await
    }
}
