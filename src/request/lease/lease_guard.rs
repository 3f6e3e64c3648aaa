//! The one way a lease ends: a guard created as soon as the pool grants a lease, whose task runs
//! in `wait_until` and outlives the response.
//!
//! Every exit of a proxied request goes through it: the proxy calls [`LeaseGuard::finish`] with the
//! outcome (success, an error, a timeout, a client hang-up), and a guard dropped without that (an
//! early return, a panic-free bail-out) ends the lease as cancelled. The task also listens for the
//! client hanging up (on the edge, the request's own work may never run again after a disconnect),
//! reports the prefill stage of a disaggregated request as soon as it ends,
//! and, while the request lives, renews the lease several times per `lease_ttl_ms`, so a lease lasts
//! exactly as long as its request (every 20 s at most for its first five minutes, then at a third
//! of what the pool's deadline leaves, up to ten minutes: each renewal is a subrequest, and a
//! pool with a long `lease_ttl_ms` keeps an hours-long stream's count low). It is also how the
//! pool learns of the stream's first token (lease evidence, `routing_core::pool::evidence`): the
//! time is carried on the next renewal or the release, and a stream whose grant gave it a due time
//! and that has no first token by then renews early to say so (and again when its first token
//! comes), so a backend's engine queue shows in the pool before its next scrape; streams on time
//! add no call. When the request ends it releases the lease with the outcome, writes the access
//! log line, and settles the client's token reservation by `routing_core::stream::settle`: the
//! backend's reported usage; for a stream that started and has none (the client hung up mid-way),
//! the prompt's estimate and the tokens the client received, counted by the tokenizer of the backend
//! that streamed them (one bounded call before the release, [`StreamMeter::count`]: an answer
//! event is several tokens with speculative decoding; one token an event when it cannot be
//! counted, logged); for a hang-up before the first byte, the prompt's estimate, and during a
//! whole answer, the estimate charged (a hang-up never refunds the prefill the backend did). The
//! access log line shows what was charged (a resumed stream's totals as its client is told them).
//! Nothing on the response path waits for any of this.

use crate::clients::keys::{self, Reservation};
use crate::platform::do_client::{call, To};
use crate::request::context::RequestContext;
use coordinator_protocol::messages::{PrefillDone, ReleaseRequest, RenewRequest};
use futures_util::future::{select, Either, LocalBoxFuture};
use routing_core::backend::BackendId;
use routing_core::pool::lease::{LeaseId, LeaseTerms};
use routing_core::pool::RouteReceipt;
use routing_core::stream::outcome::{Outcome, OutcomeKind, StreamResume};
use routing_core::stream::settle::{charged_usage, counts_received, settled_tokens, Streamed};
use routing_core::stream::usage::Usage;
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;
use wasm_bindgen::JsValue;
use wasm_bindgen_futures::JsFuture;
use worker::{AbortSignal, Context};

/// After this long a request renews its lease at a third of what the pool's deadline leaves
/// instead of at the grant's interval.
const STEADY_AFTER_MS: u64 = 5 * 60_000;
/// The longest time between two renewals, whatever the pool's lease TTL.
const MAX_RENEW_EVERY: Duration = Duration::from_secs(10 * 60);

/// How a request ended.
struct Ending {
    outcome: Outcome,
    /// The pool already ended the lease itself (a retry its budget refused).
    released: bool,
}

/// The lease as the request runs: what the guard (its handles) and its keeper share.
struct LeaseState {
    lease_id: LeaseId,
    terms: LeaseTerms,
    attempts: u32,
    ending: Option<Ending>,
    /// The prefill stage's outcome and backend of a disaggregated request, until reported.
    prefill: Option<(Outcome, BackendId)>,
    /// Backends whose stream failed mid-answer and was resumed elsewhere, in order.
    resumed_from: Vec<String>,
    /// Wakes the task (the request ended, or its prefill stage did); taken when called.
    wake: Option<js_sys::Function>,
    /// What the client received of a streamed answer, once it started streaming.
    meter: Option<Box<dyn StreamMeter>>,
    /// The decision's receipt (the chosen backend and the best alternative, predicted), logged.
    receipt: Option<(BackendId, RouteReceipt)>,
    /// The stream's first token, in ms, once seen; taken when a renewal carries it.
    first_token: FirstToken,
}

/// What the pool has been told of a stream's first token.
#[derive(Clone, Copy, PartialEq, Eq)]
enum FirstToken {
    /// Not seen yet.
    Awaited,
    /// Not seen by its due time, and the pool was told so.
    Overdue,
    /// Seen after it was reported overdue: the pool is told at once.
    LateUnreported(u64),
    /// Seen, to be carried by the next renewal (the release carries it anyway).
    Unreported(u64),
    /// Seen and reported (or not worth reporting).
    Done,
}

impl LeaseState {
    /// Records the ending unless one was recorded already (the first ending wins).
    fn end(&mut self, outcome: Outcome, released: bool) -> bool {
        if self.ending.is_some() {
            return false;
        }
        self.ending = Some(Ending { outcome, released });
        true
    }

    /// Wakes the task, if it waits.
    fn wake(&mut self) {
        if let Some(wake) = self.wake.take() {
            let _ = wake.call0(&JsValue::UNDEFINED);
        }
    }
}

/// Owned by the guard's handles; the last one dropped ends an unfinished lease as cancelled.
struct CancelOnLastDrop {
    state: Rc<RefCell<LeaseState>>,
}

impl Drop for CancelOnLastDrop {
    fn drop(&mut self) {
        let mut r = self.state.borrow_mut();
        r.end(Outcome::of_kind(OutcomeKind::Cancelled), false);
        r.wake();
    }
}

/// A handle on a granted lease; clones share it.
#[derive(Clone)]
pub struct LeaseGuard {
    shared: Rc<CancelOnLastDrop>,
}

/// The lease [`LeaseGuard::start`] guards (the request's pool, shard and client are its
/// [`RequestContext`]'s).
pub struct Lease {
    /// The lease.
    pub lease_id: LeaseId,
    /// The backend the pool granted it on.
    pub backend: BackendId,
    /// Time between renewals.
    pub renew_every: Duration,
    /// When the stream is overdue without a first token, after the grant (the grant's
    /// `first_token_due_ms`; `None` when it does not stream or the pool takes no evidence).
    pub first_token_due: Option<Duration>,
    /// The client's token reservation, settled when the request ends.
    pub reservation: Option<Reservation>,
}

impl LeaseGuard {
    /// Starts guarding a lease just granted to `request`, in `ctx`'s `wait_until`.
    pub(crate) fn start(request: &Rc<RequestContext>, ctx: &Context, lease: Lease) -> LeaseGuard {
        let (woken, wake) = signal_promise();
        let features = &request.features;
        // The lease as the Worker knows it (re-established from this if the pool loses it).
        let terms = LeaseTerms {
            backend: lease.backend,
            prompt_tokens: features.prompt_tokens,
            max_tokens: features.max_tokens,
            stream: features.stream,
            request_id: request.request_id.clone(),
        };
        let record = Rc::new(RefCell::new(LeaseState {
            lease_id: lease.lease_id,
            terms,
            attempts: 1,
            ending: None,
            prefill: None,
            resumed_from: Vec::new(),
            wake: Some(wake),
            meter: None,
            receipt: None,
            first_token: FirstToken::Awaited,
        }));
        let task = Keeper {
            request: request.clone(),
            state: record.clone(),
            renew_every: lease.renew_every,
            first_token_due: lease.first_token_due,
            reservation: lease.reservation,
            started_ms: crate::platform::http::now_ms(),
        };
        ctx.wait_until(task.run(woken, request.hung_up.clone()));
        LeaseGuard {
            shared: Rc::new(CancelOnLastDrop { state: record }),
        }
    }

    /// The lease's id.
    pub fn lease_id(&self) -> LeaseId {
        self.shared.state.borrow().lease_id
    }

    /// The lease as the Worker knows it now.
    pub fn terms(&self) -> LeaseTerms {
        self.shared.state.borrow().terms.clone()
    }

    /// The decision's receipt, for the access log line.
    pub fn note_receipt(&self, chosen: &BackendId, receipt: &RouteReceipt) {
        self.shared.state.borrow_mut().receipt = Some((chosen.clone(), receipt.clone()));
    }

    /// The lease moved to `backend` for another attempt.
    pub fn moved_to(&self, backend: &str) {
        let mut r = self.shared.state.borrow_mut();
        r.terms.backend = backend.into();
        r.attempts += 1;
    }

    /// The stream failed mid-answer on `backend` and goes on where the lease moved.
    pub fn resumed_from(&self, backend: &str) {
        self.shared
            .state
            .borrow_mut()
            .resumed_from
            .push(backend.to_string());
    }

    /// The prefill stage of a disaggregated request ended with `outcome`; the request goes on on
    /// `decode_backend`. The task tells the pool at once, so the prefill share ends now and only
    /// the prefill's own failures count against the prefill backend.
    pub fn finish_prefill(&self, outcome: Outcome, decode_backend: &str) {
        {
            let mut r = self.shared.state.borrow_mut();
            if r.ending.is_some() || r.prefill.is_some() {
                return;
            }
            let prefill_backend = std::mem::replace(&mut r.terms.backend, decode_backend.into());
            r.prefill = Some((outcome, prefill_backend));
            r.wake();
        }
    }

    /// The stream's first token came `ttfb_ms` after the request began: the next renewal tells
    /// the pool, or at once when the pool was told it was overdue.
    pub fn first_token(&self, ttfb_ms: u64) {
        let mut r = self.shared.state.borrow_mut();
        r.first_token = match r.first_token {
            FirstToken::Awaited => FirstToken::Unreported(ttfb_ms),
            FirstToken::Overdue => {
                r.wake();
                FirstToken::LateUnreported(ttfb_ms)
            }
            other => other,
        };
    }

    /// The answer started streaming: `meter` says what the client received, which is what it is
    /// charged when no usage is reported (it hung up, or the stream broke before the usage).
    pub fn meter(&self, meter: Box<dyn StreamMeter>) {
        self.shared.state.borrow_mut().meter = Some(meter);
    }

    /// Ends the request with `outcome` (the first ending wins); the task releases the lease.
    pub fn finish(&self, outcome: Outcome) {
        self.end(outcome, false);
    }

    /// Ends a request whose lease the pool already ended (it refused a retry).
    pub fn finish_released(&self, outcome: Outcome) {
        self.end(outcome, true);
    }

    fn end(&self, outcome: Outcome, released: bool) {
        let mut r = self.shared.state.borrow_mut();
        if r.end(outcome, released) {
            r.wake();
        }
    }
}

/// What the client received of a streamed answer, read when the request ends (the stream's relay
/// and attempts, `src/request/forward/resume.rs`).
pub trait StreamMeter {
    /// What the client received so far.
    fn streamed(&self) -> Streamed;
    /// The tokens of the answer text the client received, as backend `backend`'s tokenizer counts
    /// them, or why they cannot be counted.
    fn count<'a>(&'a self, backend: &'a str) -> LocalBoxFuture<'a, Result<u32, String>>;
}

/// A promise and the function that resolves it.
pub(crate) fn signal_promise() -> (js_sys::Promise, js_sys::Function) {
    let mut resolve = None;
    let promise = js_sys::Promise::new(&mut |res, _| resolve = Some(res));
    (
        promise,
        resolve.unwrap_or_else(|| js_sys::Function::new_no_args("")),
    )
}

/// A promise that resolves when the client hangs up (one per request: its admission and its
/// lease guard both wait on it).
pub fn hang_up(signal: &AbortSignal) -> js_sys::Promise {
    let signal: &web_sys::AbortSignal = signal;
    let signal = signal.clone();
    js_sys::Promise::new(&mut |resolve, _| {
        if signal.aborted() {
            let _ = resolve.call0(&JsValue::UNDEFINED);
        } else {
            let _ = signal.add_event_listener_with_callback("abort", &resolve);
        }
    })
}

/// The guard's keeper in `wait_until`: renews the lease, then releases it with the outcome,
/// settles the tokens and writes the access log line.
struct Keeper {
    request: Rc<RequestContext>,
    state: Rc<RefCell<LeaseState>>,
    renew_every: Duration,
    /// See [`Lease::first_token_due`].
    first_token_due: Option<Duration>,
    reservation: Option<Reservation>,
    started_ms: u64,
}

impl Keeper {
    async fn run(self, woken: js_sys::Promise, hung_up: js_sys::Promise) {
        let mut woken = JsFuture::from(woken);
        let mut hung_up = JsFuture::from(hung_up);
        let mut renew_every = self.renew_every;
        let mut renew_at = self
            .started_ms
            .saturating_add(renew_every.as_millis() as u64);
        loop {
            let now = crate::platform::http::now_ms();
            // Wake at the next renewal, or earlier at the stream's due time while it has no
            // first token (the early renewal says it is overdue).
            let due_at = self
                .first_token_due
                .filter(|_| self.state.borrow().first_token == FirstToken::Awaited)
                .map(|d| self.started_ms.saturating_add(d.as_millis() as u64));
            let wake_at = due_at.map_or(renew_at, |d| d.min(renew_at));
            let tick = self
                .request
                .deadlines
                .sleep(Duration::from_millis(wake_at.saturating_sub(now)));
            match select(select(&mut woken, &mut hung_up), tick).await {
                Either::Left((Either::Left(_), _)) => {
                    if self.state.borrow().ending.is_some() {
                        break;
                    }
                    // The prefill stage ended, or a stream reported overdue had its first
                    // token: report it, then wait again (for the ending, unless it came
                    // meanwhile).
                    self.report_prefill().await;
                    let late = matches!(
                        self.state.borrow().first_token,
                        FirstToken::LateUnreported(_)
                    );
                    if late {
                        self.renew(false).await;
                    }
                    let (promise, wake) = signal_promise();
                    let mut r = self.state.borrow_mut();
                    if r.ending.is_some() {
                        break;
                    }
                    r.wake = Some(wake);
                    woken = JsFuture::from(promise);
                }
                Either::Left((Either::Right(_), _)) => {
                    // The upstream fetch shares the client's signal, so it is aborted already.
                    self.state
                        .borrow_mut()
                        .end(Outcome::of_kind(OutcomeKind::Cancelled), false);
                    break;
                }
                Either::Right(_) => {
                    let now = crate::platform::http::now_ms();
                    if now < renew_at {
                        // The due time passed: with no first token, say so now (one that came
                        // meanwhile waits for the renewal).
                        let awaited = {
                            let mut r = self.state.borrow_mut();
                            let awaited = r.first_token == FirstToken::Awaited;
                            if awaited {
                                r.first_token = FirstToken::Overdue;
                            }
                            awaited
                        };
                        if awaited {
                            self.renew(true).await;
                        }
                        continue;
                    }
                    let deadline_ms = self.renew(false).await;
                    renew_every = self.next_renewal(deadline_ms);
                    renew_at = crate::platform::http::now_ms()
                        .saturating_add(renew_every.as_millis() as u64);
                }
            }
        }
        // A prefill stage that ended in the same turn as the request is reported first.
        self.report_prefill().await;
        let (lease_id, backend, attempts, ending, resumed_from) = {
            let mut r = self.state.borrow_mut();
            let ending = r.ending.take().unwrap_or(Ending {
                outcome: Outcome::of_kind(OutcomeKind::Cancelled),
                released: false,
            });
            let resumed_from = std::mem::take(&mut r.resumed_from);
            let backend = r.terms.backend.0.clone();
            (r.lease_id, backend, r.attempts, ending, resumed_from)
        };
        let request_id = self.state.borrow().terms.request_id.clone();
        let receipt = self.state.borrow_mut().receipt.take();
        // The pool choice stops counting this request against the pool (src/request/regions.rs).
        crate::request::regions::finished(&self.request.pool, lease_id);
        let meter = self.state.borrow_mut().meter.take();
        let mut streamed = meter.as_ref().map(|m| m.streamed());
        // A stream without usage is charged the tokens its client received: the backend's
        // tokenizer counts its text (an event is several tokens with speculative decoding). One
        // call, bounded, before the release: once the pool has the lease back, the request is
        // settled.
        if let (Some(m), Some(s)) = (&meter, &mut streamed) {
            if counts_received(&ending.outcome, s) {
                match m.count(&backend).await {
                    Ok(n) => s.counted = Some(n),
                    Err(why) => worker::console_log!(
                        "request {request_id}: the tokens its client received are counted one per event ({}): {why}",
                        s.answer_events
                    ),
                }
            }
        }
        let (prompt_estimate, stream) = {
            let r = self.state.borrow();
            (r.terms.prompt_tokens, r.terms.stream)
        };
        access_log(
            &Served {
                request_id: &request_id,
                pool: &self.request.pool,
                backend: &backend,
                resumed_from: &resumed_from,
                attempts,
                receipt: receipt.as_ref(),
                pool_choice: self.request.pool_choice,
            },
            &ending.outcome,
            charged_usage(&ending.outcome, streamed, prompt_estimate),
            crate::platform::http::now_ms().saturating_sub(self.started_ms),
        );
        if !ending.released {
            self.release(lease_id, &backend, &ending.outcome).await;
        }
        if let Some(reservation) = &self.reservation {
            // A hang-up never refunds the prompt (routing_core::stream::settle).
            if let Some(actual) = settled_tokens(&ending.outcome, streamed, prompt_estimate, stream)
            {
                keys::settle(&self.request.env, reservation, actual).await;
            }
        }
    }

    /// Returns the lease to the shard that granted it (with other requests' releases when this
    /// isolate has several); failures are logged, and the lease's deadline is the backstop.
    async fn release(&self, lease_id: LeaseId, backend: &str, outcome: &Outcome) {
        let req = ReleaseRequest {
            lease_id,
            outcome: outcome.clone(),
            backend: Some(backend.into()),
        };
        crate::request::lease::releases::release(
            &self.request.env,
            &self.request.pool,
            self.request.shard,
            req,
        )
        .await;
    }

    /// Tells the pool the prefill stage ended (once).
    async fn report_prefill(&self) {
        let Some((outcome, backend)) = self.state.borrow_mut().prefill.take() else {
            return;
        };
        let req = PrefillDone {
            lease_id: self.state.borrow().lease_id,
            outcome,
            backend: Some(backend),
        };
        let to_pool = To::Pool(&self.request.pool, self.request.shard);
        if let Err(e) = call(&self.request.env, to_pool, &req).await {
            worker::console_error!(
                "reporting the prefill of lease {} in pool {} failed: {e}",
                req.lease_id,
                self.request.pool
            );
        }
    }

    /// The time to the next renewal: `renew_every` for the first [`STEADY_AFTER_MS`] (most
    /// requests end by then, and a pool that lost the lease counts it again soon), then a third of
    /// what the pool's deadline leaves, so a long stream on a pool with a long `lease_ttl_ms`
    /// makes few subrequests (each renewal is one).
    fn next_renewal(&self, deadline_ms: Option<u64>) -> Duration {
        let now = crate::platform::http::now_ms();
        match deadline_ms {
            Some(deadline) if now.saturating_sub(self.started_ms) >= STEADY_AFTER_MS => {
                let third = Duration::from_millis(deadline.saturating_sub(now) / 3);
                third.clamp(self.renew_every, MAX_RENEW_EVERY)
            }
            _ => self.renew_every,
        }
    }

    /// Pushes the lease's deadline out; a pool that lost the lease counts it again. Carries the
    /// stream's first token if not yet reported, or `overdue` when it has none by its due time.
    /// Returns the new deadline, when the pool answered.
    async fn renew(&self, overdue: bool) -> Option<u64> {
        let req = {
            let mut r = self.state.borrow_mut();
            let first_token_ms = match r.first_token {
                FirstToken::Unreported(ms) | FirstToken::LateUnreported(ms) => {
                    r.first_token = FirstToken::Done;
                    Some(ms)
                }
                _ => None,
            };
            RenewRequest {
                lease_id: r.lease_id,
                terms: r.terms.clone(),
                first_token_ms,
                overdue,
            }
        };
        let to_pool = To::Pool(&self.request.pool, self.request.shard);
        match call(&self.request.env, to_pool, &req).await {
            Ok(a) => {
                if let Some(card) = &a.card {
                    // The pool's card as of this overdue stream: the next choice sees its queue.
                    crate::request::regions::fresh_card(&self.request.pool, card);
                }
                if a.reestablished {
                    worker::console_log!(
                        "{}",
                        serde_json::json!({ "event": "lease_reestablished", "pool": self.request.pool, "lease_id": req.lease_id, "request_id": req.terms.request_id })
                    );
                }
                Some(a.deadline_ms)
            }
            Err(e) => {
                worker::console_error!(
                    "renewing lease {} in pool {} failed: {e}",
                    req.lease_id,
                    self.request.pool
                );
                None
            }
        }
    }
}

/// Where a request was served, for its access log line.
struct Served<'a> {
    request_id: &'a str,
    pool: &'a str,
    /// The backend that served it last.
    backend: &'a str,
    /// Backends whose stream failed mid-answer and was resumed on the next.
    resumed_from: &'a [String],
    attempts: u32,
    /// The decision's receipt: the backend chosen first, and what was predicted.
    receipt: Option<&'a (BackendId, RouteReceipt)>,
    /// Why the Worker asked this pool.
    pool_choice: &'static str,
}

/// One structured log line per proxied request (ids and figures only: never keys, URLs or bodies).
/// A resumed stream adds `resumed_from` (the backends it was resumed from, in order) and
/// `stream_resume` (what became of a stream that failed mid-answer).
fn access_log(served: &Served<'_>, outcome: &Outcome, charged: Option<Usage>, duration_ms: u64) {
    let resumed = !served.resumed_from.is_empty() || outcome.resume.is_some();
    let line = AccessLine {
        attempts: served.attempts,
        backend: served.backend,
        cached_tokens: charged.map_or(outcome.cached_tokens, |u| u.cached_tokens),
        completion_tokens: charged
            .map(|u| u.completion_tokens)
            .or(outcome.completion_tokens),
        duration_ms,
        event: "request",
        outcome: outcome.kind,
        pool: served.pool,
        pool_choice: served.pool_choice,
        prompt_tokens: charged.map(|u| u.prompt_tokens).or(outcome.prompt_tokens),
        request_id: served.request_id,
        resumed_from: resumed.then_some(served.resumed_from),
        route_receipt: served.receipt.map(|(chosen, r)| RouteLog {
            backend: chosen.as_str(),
            receipt: r,
        }),
        status: outcome.status,
        stream_resume: resumed.then_some(outcome.resume),
        ttfb_ms: outcome.ttfb_ms,
    };
    if let Ok(text) = serde_json::to_string(&line) {
        worker::console_log!("{text}");
    }
}

/// The access log line's fields, in the (alphabetical) order they are written.
#[derive(serde::Serialize)]
struct AccessLine<'a> {
    attempts: u32,
    backend: &'a str,
    cached_tokens: Option<u32>,
    completion_tokens: Option<u32>,
    duration_ms: u64,
    event: &'static str,
    outcome: OutcomeKind,
    pool: &'a str,
    pool_choice: &'static str,
    prompt_tokens: Option<u32>,
    request_id: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    resumed_from: Option<&'a [String]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    route_receipt: Option<RouteLog<'a>>,
    status: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream_resume: Option<Option<StreamResume>>,
    ttfb_ms: Option<u64>,
}

/// The access log's `route_receipt`: `{"backend", "predicted_ttft_ms", "alt",
/// "alt_predicted_ttft_ms"}`, as the `x-gateway-route-receipt` header says it.
#[derive(serde::Serialize)]
struct RouteLog<'a> {
    backend: &'a str,
    #[serde(flatten)]
    receipt: &'a RouteReceipt,
}
