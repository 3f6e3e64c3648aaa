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

use crate::keys::{self, Reservation};
use coordinator_protocol::messages::ReleaseRequest;
use coordinator_protocol::ApiError;
use routing_core::backend::BackendId;
use routing_core::pool::lease::LeaseId;
use routing_core::stream::outcome::{Outcome, OutcomeKind};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use wasm_bindgen::JsValue;
use wasm_bindgen_futures::JsFuture;
use worker::{Context, Env};

/// Most refused clients an isolate remembers; past it the map starts again.
const MAX_REFUSED: usize = 4_096;

thread_local! {
    /// Clients the limiter refused, with when (ms since the epoch) they may be asked beside again.
    static REFUSED: RefCell<HashMap<String, u64>> = RefCell::new(HashMap::new());
}

/// The limiter's answer, once it came.
type Slot = Rc<RefCell<Option<Result<Option<Reservation>, ApiError>>>>;

/// A request's token reservation: known, or on its way.
pub enum Reserved {
    /// Charged already (or nothing to charge).
    Known(Option<Reservation>),
    /// Asked for; `done` settles when the answer is in `slot`, `refused` only if it is a refusal.
    Pending {
        slot: Slot,
        done: js_sys::Promise,
        refused: js_sys::Promise,
    },
}

impl Reserved {
    /// Starts charging `client` an estimate of `estimate` tokens: asked at once and waited for when
    /// the limiter refused the client recently, else left running beside what follows.
    pub async fn start(env: &Env, client: &str, estimate: u64) -> Result<Reserved, ApiError> {
        if !keys::rate_limited(env) {
            return Ok(Reserved::Known(None));
        }
        if refused_recently(client, crate::http::now_ms()) {
            let answer = charge(env, client, estimate).await;
            note(client, &answer);
            return answer.map(Reserved::Known);
        }
        let slot: Slot = Rc::default();
        let (refused, refuse) = crate::lease_guard::signal_promise();
        let (env, client, filled) = (env.clone(), client.to_string(), slot.clone());
        let done = wasm_bindgen_futures::future_to_promise(async move {
            let answer = charge(&env, &client, estimate).await;
            note(&client, &answer);
            let is_refusal = answer.is_err();
            *filled.borrow_mut() = Some(answer);
            if is_refusal {
                let _ = refuse.call0(&JsValue::UNDEFINED);
            }
            Ok(JsValue::UNDEFINED)
        });
        Ok(Reserved::Pending {
            slot,
            done,
            refused,
        })
    }

    /// What a lease call gives up on: the client's hang-up, or the limiter's refusal while the
    /// answer is on its way.
    pub fn give_up_on(&self, hung_up: &js_sys::Promise) -> js_sys::Promise {
        match self {
            Reserved::Known(_) => hung_up.clone(),
            Reserved::Pending { refused, .. } => {
                js_sys::Promise::race(&js_sys::Array::of2(hung_up, refused))
            }
        }
    }

    /// The reservation, once the limiter has answered (at once when it has): the refusal, or
    /// the limiter's failure, as the request's error.
    pub async fn resolve(self) -> Result<Option<Reservation>, ApiError> {
        match self {
            Reserved::Known(r) => Ok(r),
            Reserved::Pending { slot, done, .. } => {
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
    ctx.wait_until(async move { crate::releases::release(&env, &pool, shard, req).await });
}

/// Charges `client` (after the modelled round trip to its limiter, in local runs that model one).
async fn charge(env: &Env, client: &str, estimate: u64) -> Result<Option<Reservation>, ApiError> {
    let rtt = crate::regions::simulated_limiter_rtt_ms(env);
    if rtt > 0 {
        worker::Delay::from(std::time::Duration::from_millis(rtt)).await;
    }
    keys::reserve(env, client, estimate).await
}

/// Whether the limiter refused `client` and its `Retry-After` has not passed.
fn refused_recently(client: &str, now_ms: u64) -> bool {
    REFUSED.with(|m| m.borrow().get(client).is_some_and(|&until| now_ms < until))
}

/// Remembers a refusal (429) until its `Retry-After`; forgets the client when it was admitted.
fn note(client: &str, answer: &Result<Option<Reservation>, ApiError>) {
    REFUSED.with(|m| {
        let mut m = m.borrow_mut();
        match answer {
            Err(e) if e.status == 429 => {
                if m.len() >= MAX_REFUSED {
                    m.clear();
                }
                let wait_ms = u64::from(e.retry_after_s.unwrap_or(1).max(1)) * 1_000;
                m.insert(client.to_string(), crate::http::now_ms() + wait_ms);
            }
            Ok(_) => {
                m.remove(client);
            }
            Err(_) => {}
        }
    });
}
