//! A stream survives its backend: when a streamed chat or completion request fails after its
//! first byte, the Worker resumes it on the next candidate and splices the continuation into the
//! same client stream, so the client never sees the failure.
//!
//! [`stream`] runs in `wait_until` for every streamed answer. It pipes the upstream body through
//! the relay (`relay.rs`); when that body fails mid-answer (reset, closed before `data: [DONE]`,
//! idle for `STREAM_IDLE_TIMEOUT_MS`, its backend force-removed) and the request allows it
//! (`routing_core::stream::resume` decides, and builds the continuation from the answer the client
//! received), it moves the lease to the next candidate the pool ranked, a retry like any other in
//! the pool's retry budget, which also reports the failure against the backend left behind, and
//! sends the continuation there with the same first-byte timeout as any attempt. At most
//! `MAX_STREAM_RESUMES` times per request. Whatever cannot be resumed ends as before: an SSE error
//! event and `data: [DONE]`.
//!
//! A complete stream ends its lease as soon as the backend's body has been read to its end; the
//! client then drains what the relay queued (`Relay::drain`). A client cut off for not reading
//! (`SLOW_CLIENT_TIMEOUT_MS`) ends it as cancelled: nobody is blamed.
//!
//! The continuation asks for `max_tokens` less the tokens the client already received. A content
//! event is one token only without speculative decoding (vLLM then streams each step's accepted
//! draft tokens and the sampled one as one event), so unless the client's continuous usage already
//! counted them, the text sent is counted by the next candidate's tokenizer first ([`tokens_in`],
//! vLLM's `POST /tokenize`, one call and only on a resumption; bounded by
//! [`TOKENIZE_TIMEOUT`]). When that fails the count falls back to one token per event, logged.
//!
//! Each share the lease ends with says what became of the stream (`Outcome::resume`), which the
//! pool counts in `llm_gateway_stream_resumes_total`; the lease guard's access log line names the
//! backends the stream was resumed from.

use crate::request::context::RequestContext;
use crate::request::forward::attempts::{
    send, stream_upstream, with_usage, Attempts, Moved, UpstreamCall,
};
use crate::request::forward::relay::{Meter, Piped, Relay, Upstream};
use crate::request::forward::upstream_body::read_whole;
use crate::request::lease::lease_guard::StreamMeter;
use futures_util::future::{select, Either, LocalBoxFuture};
use routing_core::pool::CandidateView;
use routing_core::request::endpoint::Endpoint;
use routing_core::stream::outcome::{Outcome, OutcomeKind, StoredResponse, StreamResume};
use routing_core::stream::resume::{continuation_body, NotResumable, Splice};
use routing_core::stream::settle::Streamed;
use std::rc::Rc;
use std::time::Duration;
use worker::AbortSignal;

/// The longest a resumption waits for the next candidate's tokenizer (the first byte's timeout
/// when that is shorter); past it, the tokens sent are counted one per event.
const TOKENIZE_TIMEOUT: Duration = Duration::from_secs(2);

/// The longest the lease guard waits for a tokenizer's count of what the client of a stream
/// without usage received (it holds the lease meanwhile); past it, one token per event.
const SETTLE_TOKENIZE_TIMEOUT: Duration = Duration::from_secs(1);

/// The largest `/tokenize` answer read (it lists every token id: about 8 bytes a token).
const MAX_TOKENIZE_BYTES: usize = 4 * 1024 * 1024;

/// Whether and how a stream may be resumed, decided before its answer flows.
pub(crate) struct Resumption {
    /// The endpoint and the body sent upstream, to continue from.
    plan: Option<(Endpoint, Vec<u8>)>,
    /// Why the request rules a resumption out, if it does.
    ruled_out: Option<NotResumable>,
    /// Resumptions left (`MAX_STREAM_RESUMES`).
    left: u32,
}

impl Resumption {
    /// The resumption of `request`'s stream, sent upstream with `body`, allowed
    /// `MAX_STREAM_RESUMES` times; whether its body allows one was decided when its features were
    /// read (`RequestContext::resumable`).
    pub(crate) fn of(request: &RequestContext, body: Vec<u8>) -> Resumption {
        let (endpoint, max) = (request.endpoint, request.settings.proxy.max_stream_resumes);
        if endpoint == Endpoint::Embeddings || max == 0 {
            return Resumption::never();
        }
        let ruled_out = request.resumable.err();
        Resumption {
            plan: Some((endpoint, body)),
            ruled_out,
            left: max,
        }
    }

    /// No resumption (turned off, or a stream that cannot move, such as a disaggregated decode).
    pub(crate) fn never() -> Resumption {
        Resumption {
            plan: None,
            ruled_out: None,
            left: 0,
        }
    }

    /// Whether the answer must be read on its way (only then is it).
    pub(crate) fn collects(&self) -> bool {
        self.left > 0 && self.ruled_out.is_none() && self.plan.is_some()
    }
}

/// What a failed stream led to.
enum Next {
    /// A continuation whose first chunk arrived: pipe it.
    Continue(Upstream, u64),
    /// The stream ends with the error event; the lease ends with this outcome (`true`: the pool
    /// already ended it).
    End(Outcome, bool),
}

/// Pipes a streamed answer to the client, resuming it when its backend fails; ends the lease.
pub(crate) async fn stream(
    relay: Relay,
    mut upstream: Upstream,
    mut attempts: Attempts,
    mut resumption: Resumption,
    mut outcome: Outcome,
) {
    let client_signal = attempts.request.client_signal.clone();
    let guard = attempts.guard.clone();
    // A client that hangs up mid-stream is charged what it received (the guard reads this).
    guard.meter(Box::new(Received {
        relay: relay.meter(),
        request: attempts.request.clone(),
        candidates: attempts.candidates.clone(),
    }));
    loop {
        let backend = upstream.backend.clone();
        let piped = relay.pipe(upstream, &client_signal).await;
        with_usage(&mut outcome, relay.usage());
        outcome.held_by_client = relay.held();
        // A stored response's id goes to the pool with the release (its follow-ups are pinned
        // to this backend).
        outcome.stored_response =
            StoredResponse::answered(&attempts.request.features, relay.response_id());
        let failure = match piped {
            Piped::Complete => {
                // The backend's work is done: its share of the pool ends now, whatever the
                // client still has to read of what the relay queued.
                outcome.kind = OutcomeKind::Success;
                guard.finish(outcome);
                relay.drain().await;
                return;
            }
            Piped::Cancelled | Piped::CutOff => {
                outcome.kind = OutcomeKind::Cancelled;
                guard.finish(outcome);
                return;
            }
            Piped::Failed(f) => f,
        };
        outcome.kind = failure.kind;
        let next = resume(
            &relay,
            &mut attempts,
            &mut resumption,
            outcome,
            &backend,
            &client_signal,
        )
        .await;
        match next {
            Next::Continue(next, ttfb_ms) => {
                upstream = next;
                outcome = Outcome {
                    ttfb_ms: Some(ttfb_ms),
                    resume: Some(StreamResume::Continuation),
                    ..Outcome::from_status(200)
                };
            }
            Next::End(end, released) => {
                if end.kind != OutcomeKind::Cancelled {
                    relay.fail(&failure).await;
                }
                if released {
                    guard.finish_released(end);
                } else {
                    guard.finish(end);
                }
                return;
            }
        }
    }
}

/// After `failed` (the outcome of the share whose stream broke, on `from`): a continuation on
/// the next candidate, or the outcome to end the lease with.
async fn resume(
    relay: &Relay,
    attempts: &mut Attempts,
    resumption: &mut Resumption,
    failed: Outcome,
    from: &str,
    client_signal: &AbortSignal,
) -> Next {
    let mid_event = relay.abandon();
    let end = |mut o: Outcome, why: StreamResume| {
        // A continuation that fails is counted as one (with its failure's kind).
        o.resume.get_or_insert(why);
        Next::End(o, false)
    };
    if resumption.left == 0 {
        return end(failed, StreamResume::NotResumed);
    }
    let ruled_out = match (&resumption.ruled_out, mid_event) {
        (Some(why), _) => Some(*why),
        (None, true) => Some(NotResumable::MidEvent),
        (None, false) => None,
    };
    // The text sent, when the stream did not count its tokens and could be continued: the next
    // candidate's tokenizer counts it (the lease has not moved yet, so a count that leaves
    // nothing to ask for ends the stream where it is).
    let uncounted = match (ruled_out, relay.partial()) {
        (None, Some(p)) if p.resumable().is_ok() => {
            p.uncounted_text().map(|t| (t.to_string(), p.tokens))
        }
        _ => None,
    };
    let next = attempts.candidates.get(attempts.next_index).cloned();
    let tokenized = match (uncounted, next) {
        (Some((text, events)), Some(next)) => {
            match tokens_in(
                &attempts.request,
                &next,
                &text,
                client_signal,
                TOKENIZE_TIMEOUT,
            )
            .await
            {
                Ok(n) => Some(n),
                Err(e) => {
                    worker::console_log!(
                        "request {}: the tokens sent before backend {from} failed are counted one per event ({events}): backend {}'s /tokenize {e}",
                        attempts.request.request_id,
                        next.id.0
                    );
                    None
                }
            }
        }
        _ => None,
    };
    let continued = match (&resumption.plan, relay.partial(), ruled_out) {
        (Some((endpoint, body)), Some(partial), None) => {
            let sent = partial.tokens_sent_with(tokenized);
            continuation_body(body, *endpoint, &partial, sent)
                .map(|b| (b, Splice::new(&partial, sent)))
        }
        (_, _, Some(why)) => Err(why),
        _ => Err(NotResumable::Unreadable),
    };
    let (body, splice) = match continued {
        Ok(c) => c,
        Err(why) => {
            worker::console_log!("stream from backend {from} not resumable: {}", why.as_str());
            return end(failed, StreamResume::NotResumable);
        }
    };
    resumption.left -= 1;
    let untried = attempts.untried();
    let mut failure = failed;
    loop {
        let candidate = match attempts.move_on(&failure, false).await {
            Moved::To(c) => c,
            Moved::Nowhere => {
                worker::console_log!(
                    "stream from backend {from} not resumed: none of the {untried} candidates left could take it"
                );
                return end(failure, StreamResume::NotResumed);
            }
            Moved::Refused => return Next::End(failure, true),
        };
        attempts.count += 1;
        let answer = match attempts.attempt(&candidate, &body, client_signal).await {
            Ok(a) => a,
            Err(f) if client_signal.aborted() => {
                drop(f);
                return Next::End(Outcome::of_kind(OutcomeKind::Cancelled), false);
            }
            Err(f) => {
                failure = f.outcome;
                failure.resume = Some(StreamResume::Continuation);
                continue;
            }
        };
        let (Some(reader), true) = (answer.reader, (200..300).contains(&answer.status)) else {
            // The backend refused the continuation itself (a 4xx): no other would take it.
            answer.abort.abort();
            let refused = Outcome {
                resume: Some(StreamResume::Continuation),
                ..Outcome::from_status(answer.status)
            };
            return Next::End(refused, false);
        };
        worker::console_log!(
            "stream from backend {from} resumed on backend {}",
            candidate.id.0
        );
        attempts.guard.resumed_from(from);
        relay.splice(splice);
        let upstream = stream_upstream(
            reader,
            answer.first_chunk,
            answer.abort,
            &candidate,
            attempts.settings(),
        );
        return Next::Continue(upstream, answer.ttfb_ms);
    }
}

/// What the client of a stream received, for the lease guard when the request ends: the relay's
/// reading, and the count of its text by the tokenizer of the backend that streamed it last.
struct Received {
    relay: Meter,
    request: Rc<RequestContext>,
    candidates: Vec<CandidateView>,
}

impl StreamMeter for Received {
    fn streamed(&self) -> Streamed {
        self.relay.streamed()
    }

    fn count<'a>(&'a self, backend: &'a str) -> LocalBoxFuture<'a, Result<u32, String>> {
        Box::pin(async move {
            let text = self
                .relay
                .received_text()
                .ok_or("its text was not read (a stream that could not be resumed)")?;
            let c = self
                .candidates
                .iter()
                .find(|c| c.id.0 == backend)
                .ok_or_else(|| format!("backend {backend} is not one of the grant's candidates"))?;
            // The client's signal may have fired (a hang-up): the count has its own.
            let signal = worker::AbortController::default().signal();
            tokens_in(&self.request, c, &text, &signal, SETTLE_TOKENIZE_TIMEOUT)
                .await
                .map_err(|e| format!("backend {backend}'s /tokenize {e}"))
        })
    }
}

/// How many tokens `text` is by backend `c`'s tokenizer: vLLM's `POST /tokenize` (served with
/// every generate model) with the request's model, `add_special_tokens: false`, answered with
/// `{"count", ...}`; within `bound` (or the first byte's timeout when shorter), or why not. A
/// resumption counts the text sent with it, and so does the lease guard's settlement of a stream
/// that ended without its usage.
async fn tokens_in(
    request: &RequestContext,
    c: &CandidateView,
    text: &str,
    signal: &AbortSignal,
    bound: Duration,
) -> Result<u32, String> {
    #[derive(serde::Deserialize)]
    struct Counted {
        count: u32,
    }
    let body = serde_json::json!({
        "model": request.features.model,
        "prompt": text,
        "add_special_tokens": false,
    });
    let body = serde_json::to_vec(&body).map_err(|e| format!("could not be asked: {e}"))?;
    let mut call = UpstreamCall::of(request);
    call.endpoint = Endpoint::Tokenize;
    call.timeout = call.timeout.min(bound);
    // One deadline for the answer and its body.
    let deadline = request.deadlines.sleep(call.timeout);
    let sent = send(&call, c, &body, signal, 0).map_err(|f| f.reason)?;
    let (resp, abort) = sent.response().await.map_err(|f| f.to_string())?;
    let status = resp.status();
    let Some(stream) = resp.body().filter(|_| (200..300).contains(&status)) else {
        abort.abort();
        return Err(format!("answered {status}"));
    };
    let read = Box::pin(read_whole(&stream, MAX_TOKENIZE_BYTES, &c.id.0));
    let bytes = match select(read, deadline).await {
        Either::Left((Ok(bytes), _)) => bytes,
        Either::Left((Err(f), _)) => return Err(f.reason),
        Either::Right(_) => {
            abort.abort();
            return Err(format!("took longer than {} ms", call.timeout.as_millis()));
        }
    };
    serde_json::from_slice::<Counted>(&bytes)
        .map(|c| c.count)
        .map_err(|e| format!("answered no count: {e}"))
}
