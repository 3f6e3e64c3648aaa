//! A client's token reservation, asked for beside the request's first lease call.
//!
//! With rate limits configured, a request is charged to its client's limiter (a Durable Object of
//! its own, [`keys::reserve`]) before anything serves it. Asked first, that is a round trip of its
//! own on every request, before the pool's lease call; asked beside the lease call, the two round
//! trips overlap and the request waits for the longer one. The backend is still never fetched
//! before the limiter has answered: a grant that comes back before a refusal is released unused,
//! and a refusal that comes while the pool holds the request in its queue ends that wait (the pool
//! is told, as for a client that hangs up). A client the limiter refused is asked first again until
//! its `Retry-After` has passed, so a client over its limits costs the pools no lease call beyond
//! the first refused one per isolate and retry period.
//!
//! With `RATE_LIMIT_AHEAD`, a client well within its limits by the limiter's last answer to this
//! isolate ([`LimitAheadBook`]: every limited bucket at least half full after the charges in flight
//! and this one, the answer at most 10 s old) is served without waiting for its charge's answer:
//! the charge goes on in the background, and if the limiter refuses it, the request, already
//! served, is charged all the same (`force`), so the client's next requests wait for the debt.
//! A client near its limits, refused recently or unknown to the isolate waits for its answer, as
//! without the setting. The book is kept with or without the setting: it also gives an admitted
//! request the OpenAI API's rate-limit headers ([`rate_limit_headers`]).

use crate::clients::keys::{self, Reservation};
use crate::platform::isolate;
use coordinator_protocol::messages::ReleaseRequest;
use coordinator_protocol::ApiError;
use routing_core::backend::BackendId;
use routing_core::pool::lease::LeaseId;
use routing_core::request::rate_limit::{openai_headers, RateLimits};
use routing_core::stream::outcome::{Outcome, OutcomeKind};
use std::cell::RefCell;
use std::rc::Rc;
use wasm_bindgen::JsValue;
use wasm_bindgen_futures::JsFuture;
use worker::{Context, Env};

/// Most refused clients an isolate remembers; past it the map starts again.
const MAX_REFUSED: usize = 4_096;

/// The limiter's answer, once it came.
type Slot = Rc<RefCell<Option<Result<Option<Reservation>, ApiError>>>>;

/// A request's token reservation ([`Reservation`], `clients/keys.rs`) while it is being made:
/// known already, or the limiter's answer still on its way ([`PendingReservation::resolve`] waits
/// for it).
pub enum PendingReservation {
    /// Charged already (or nothing to charge).
    Known(Option<Reservation>),
    /// Asked for; `done` settles when the answer is in `slot`, `refused` only if it is a refusal.
    Pending {
        slot: Slot,
        done: js_sys::Promise,
        refused: js_sys::Promise,
    },
}

impl PendingReservation {
    /// Starts charging `client` an estimate of `estimate` tokens: asked at once and waited for when
    /// the limiter refused the client recently, charged in the background when the client may go
    /// ahead (`RATE_LIMIT_AHEAD`), else left running beside what follows.
    /// The limits and `RATE_LIMIT_AHEAD` are the edge's decision (`decided`, carried by a hop).
    pub async fn start(
        ctx: &Context,
        env: &Env,
        decided: &crate::request::hop::Charge,
    ) -> Result<PendingReservation, ApiError> {
        let Some(limits) = decided.limits(env) else {
            return Ok(PendingReservation::Known(None));
        };
        let (client, estimate) = (decided.client.as_str(), decided.estimate);
        let now = crate::platform::http::now_ms();
        // The book is kept either way (it also gives the rate-limit headers); only
        // `RATE_LIMIT_AHEAD` lets a request go ahead on it.
        let sent = isolate::with_limit_ahead_book(|b| {
            b.borrow_mut().charge(client, &limits, estimate, now)
        });
        let may_go_ahead = sent.ahead && decided.may_go_ahead(env);
        let this = Charge {
            estimate,
            seq: sent.seq,
            limits,
        };
        if refused_recently(client, now) {
            let (slot, done, _) = kept_charge(ctx, env, client, this);
            return PendingReservation::Pending {
                slot,
                done,
                refused: js_sys::Promise::resolve(&JsValue::UNDEFINED),
            }
            .resolve()
            .await
            .map(PendingReservation::Known);
        }
        if may_go_ahead {
            let (env, owned) = (env.clone(), client.to_string());
            // Resolves to whether the charge landed, for the settlement.
            let charging = wasm_bindgen_futures::future_to_promise(async move {
                let charged = match charge(&env, &owned, this).await {
                    Ok(_) => Ok(()),
                    // Served already: paid for all the same.
                    Err(e) if e.status == 429 => {
                        keys::force_charge(&env, &owned, limits, estimate).await
                    }
                    Err(e) => Err(e),
                };
                if let Err(e) = &charged {
                    worker::console_error!(
                        "charging a request served ahead of its limiter failed: {e}"
                    );
                }
                Ok(JsValue::from_bool(charged.is_ok()))
            });
            keep_alive(ctx, &charging);
            let mut reservation = keys::reservation(client, limits, estimate);
            if let Some(r) = &mut reservation {
                r.charging = Some(charging);
            }
            return Ok(PendingReservation::Known(reservation));
        }
        let (slot, done, refused) = kept_charge(ctx, env, client, this);
        Ok(PendingReservation::Pending {
            slot,
            done,
            refused,
        })
    }

    /// Whether the charge is settled already (nothing to charge, or served ahead of the
    /// limiter's answer).
    pub fn is_known(&self) -> bool {
        matches!(self, PendingReservation::Known(_))
    }

    /// What a lease call gives up on: the client's hang-up, or the limiter's refusal while the
    /// answer is on its way.
    pub fn give_up_on(&self, hung_up: &js_sys::Promise) -> js_sys::Promise {
        match self {
            PendingReservation::Known(_) => hung_up.clone(),
            PendingReservation::Pending { refused, .. } => {
                js_sys::Promise::race(&js_sys::Array::of2(hung_up, refused))
            }
        }
    }

    /// The reservation, once the limiter has answered (at once when it has): the refusal, or
    /// the limiter's failure, as the request's error.
    pub async fn resolve(self) -> Result<Option<Reservation>, ApiError> {
        match self {
            PendingReservation::Known(r) => Ok(r),
            PendingReservation::Pending { slot, done, .. } => {
                let _ = JsFuture::from(done).await;
                let answer = slot.borrow_mut().take();
                answer.unwrap_or_else(|| {
                    Err(ApiError::internal("the rate limiter's answer was lost"))
                })
            }
        }
    }

    /// Gives the reservation back (a request no pool served), once the limiter has answered.
    pub fn refund(self, ctx: &Context, env: &Env) {
        let env = env.clone();
        ctx.wait_until(async move {
            if let Ok(Some(r)) = self.resolve().await {
                keys::settle(&env, &r, 0).await;
            }
        });
    }
}

/// Releases a lease granted to a request the limiter then refused, unused (the backend was not
/// fetched: the pool counts it as cancelled, which blames no backend).
pub fn release_unused(
    ctx: &Context,
    env: &Env,
    (pool, shard): (&str, u32),
    (lease_id, backend): (LeaseId, BackendId),
) {
    let req = ReleaseRequest {
        lease_id,
        outcome: Outcome::of_kind(OutcomeKind::Cancelled),
        backend: Some(backend),
    };
    let (env, pool) = (env.clone(), pool.to_string());
    ctx.wait_until(async move {
        crate::request::lease::releases::release(&env, &pool, shard, req).await
    });
}

/// One charge: its estimate, its number in the book, and the limits it is charged against.
#[derive(Clone, Copy)]
struct Charge {
    estimate: u64,
    seq: u64,
    limits: RateLimits,
}

/// Starts charging `client`, kept running to its answer by the invocation whatever becomes of the
/// request (so the answer always reaches the refusals and the book): the answer goes into the
/// slot, `done` settles once it is there, `refused` only if it is a refusal.
fn kept_charge(
    ctx: &Context,
    env: &Env,
    client: &str,
    this: Charge,
) -> (Slot, js_sys::Promise, js_sys::Promise) {
    let slot: Slot = Rc::default();
    let (refused, refuse) = crate::request::lease::lease_guard::signal_promise();
    let (env, client, filled) = (env.clone(), client.to_string(), slot.clone());
    let done = wasm_bindgen_futures::future_to_promise(async move {
        let answer = charge(&env, &client, this).await;
        let is_refusal = answer.is_err();
        *filled.borrow_mut() = Some(answer);
        if is_refusal {
            let _ = refuse.call0(&JsValue::UNDEFINED);
        }
        Ok(JsValue::UNDEFINED)
    });
    keep_alive(ctx, &done);
    (slot, done, refused)
}

/// Keeps the invocation alive until `promise` settles.
fn keep_alive(ctx: &Context, promise: &js_sys::Promise) {
    let promise = promise.clone();
    ctx.wait_until(async move {
        let _ = JsFuture::from(promise).await;
    });
}

/// Charges `client` (after the modelled round trip to its limiter, in local runs that model one),
/// and remembers the answer: a refusal until its `Retry-After`, and what is left in the isolate's
/// [`LimitAheadBook`].
async fn charge(env: &Env, client: &str, this: Charge) -> Result<Option<Reservation>, ApiError> {
    let rtt = crate::request::regions::simulated_limiter_rtt_ms(env);
    if rtt > 0 {
        worker::Delay::from(std::time::Duration::from_millis(rtt)).await;
    }
    let answer = keys::reserve(env, client, this.limits, this.estimate).await;
    let left = answer.as_ref().ok().map(|(_, left)| *left);
    let now = crate::platform::http::now_ms();
    let newest = isolate::with_limit_ahead_book(|b| {
        let mut book = b.borrow_mut();
        book.answered(client, this.seq, this.estimate, left, now)
    });
    let answer = answer.map(|(reservation, _)| reservation);
    note(client, &answer, newest);
    answer
}

/// The OpenAI API's rate-limit headers for `client`'s admitted request: its buckets by the
/// isolate's account (the limiter's newest answer, refilled since, less the charges in flight):
/// for a request that waited, usually the answer to its own charge; for one served ahead of it,
/// an estimate.
pub fn rate_limit_headers(limits: Option<RateLimits>, client: &str) -> Vec<(&'static str, String)> {
    let Some(limits) = limits else {
        return Vec::new();
    };
    let now = crate::platform::http::now_ms();
    isolate::with_limit_ahead_book(|b| b.borrow().view(client, &limits, now))
        .map(|left| openai_headers(&limits, &left))
        .unwrap_or_default()
}

/// Whether the limiter refused `client` and its `Retry-After` has not passed.
fn refused_recently(client: &str, now_ms: u64) -> bool {
    isolate::with_refused_clients(|m| m.borrow().get(client).is_some_and(|&until| now_ms < until))
}

/// Remembers a refusal (429) until its `Retry-After`; forgets the client when it was admitted, by
/// an answer that is the `newest` word on it (not an admission given before a refusal).
fn note(client: &str, answer: &Result<Option<Reservation>, ApiError>, newest: bool) {
    isolate::with_refused_clients(|m| {
        let mut m = m.borrow_mut();
        match answer {
            Err(e) if e.status == 429 => {
                if m.len() >= MAX_REFUSED {
                    m.clear();
                }
                let wait_ms = u64::from(e.retry_after_s.unwrap_or(1).max(1)) * 1_000;
                m.insert(
                    client.to_string(),
                    crate::platform::http::now_ms() + wait_ms,
                );
            }
            Ok(_) if newest => {
                m.remove(client);
            }
            Ok(_) | Err(_) => {}
        }
    });
}
