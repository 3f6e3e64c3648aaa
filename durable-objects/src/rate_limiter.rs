//! The client rate limiter: one Durable Object per client key (addressed by the key's hash), so a
//! client's budget is shared by every edge location that serves it.
//!
//! `POST /take {"limits": {...}, "tokens": N}` answers 200 when the request fits (charging the
//! estimate `N`) and 429 with `Retry-After` when it does not; `POST /settle {"limits": {...},
//! "reserved": N, "actual": M}` settles an admitted request with the tokens the backend reported
//! (see `routing_core::request::rate_limit`). The buckets are kept in the object's storage (one JSON value,
//! written after every change and read on the object's first request), so neither an eviction nor
//! a deploy hands a client a fresh minute's allowance.

use crate::call::{parse_route, read_body, reply, respond, Answered};
use coordinator_protocol::call::Ack;
use coordinator_protocol::messages::{SettleRequest, TakeRequest};
use coordinator_protocol::{ApiError, Object, Route};
use routing_core::request::rate_limit::RateLimiter as Buckets;
use std::cell::RefCell;
use worker::*;

/// The storage key of the buckets.
const BUCKETS_KEY: &str = "buckets";

/// One client's buckets.
#[durable_object]
pub struct ClientRateLimiter {
    state: State,
    /// `None` until read from storage (on the first request after the object started).
    buckets: RefCell<Option<Buckets>>,
}

impl DurableObject for ClientRateLimiter {
    fn new(state: State, _env: Env) -> Self {
        ClientRateLimiter {
            state,
            buckets: RefCell::new(None),
        }
    }

    async fn fetch(&self, mut req: Request) -> Result<Response> {
        let result = match parse_route(&req, Object::ClientRateLimiter) {
            Ok(Route::SettleTokens) => self.settle(&mut req).await,
            Ok(_) => self.take(&mut req).await,
            Err(e) => Err(e),
        };
        respond(result)
    }
}

impl ClientRateLimiter {
    /// The buckets, read from storage the first time (full ones when nothing was stored, or what
    /// was stored cannot be read).
    async fn load(&self) -> std::result::Result<(), ApiError> {
        if self.buckets.borrow().is_some() {
            return Ok(());
        }
        let stored: Option<String> = self.state.storage().get(BUCKETS_KEY).await?;
        let buckets = stored
            .and_then(|s| serde_json::from_str::<Buckets>(&s).ok())
            .unwrap_or_default();
        // Another request may have loaded them while this one read: keep the first.
        self.buckets.borrow_mut().get_or_insert(buckets);
        Ok(())
    }

    /// Applies `change` to the buckets and stores them.
    async fn change<T>(
        &self,
        change: impl FnOnce(&mut Buckets) -> T,
    ) -> std::result::Result<T, ApiError> {
        self.load().await?;
        let (result, stored) = {
            let mut slot = self.buckets.borrow_mut();
            let buckets = slot.get_or_insert_with(Buckets::new);
            let result = change(buckets);
            (result, serde_json::to_string(&*buckets))
        };
        let stored = stored.map_err(|e| ApiError::internal(e.to_string()))?;
        self.state.storage().put(BUCKETS_KEY, stored).await?;
        Ok(result)
    }

    async fn settle(&self, req: &mut Request) -> Answered {
        let s: SettleRequest = read_body(req, "settle request").await?;
        let now = Date::now().as_millis();
        self.change(|b| b.settle(&s.limits, s.reserved, s.actual, now))
            .await?;
        reply::<SettleRequest>(&Ack)
    }

    async fn take(&self, req: &mut Request) -> Answered {
        let take: TakeRequest = read_body(req, "take request").await?;
        let now = Date::now().as_millis();
        let result = self
            .change(|b| b.try_take(&take.limits, take.tokens, now))
            .await?;
        match result {
            Ok(()) => reply::<TakeRequest>(&Ack),
            Err(refusal) => Err(match refusal.retry_after_ms {
                Some(ms) => ApiError::rate_limited(
                    "Rate limit exceeded for this API key.",
                    ms.div_ceil(1000).clamp(1, 3600) as u32,
                ),
                None => ApiError::rate_limited(
                    "This request alone exceeds the per-minute token limit for this API key.",
                    60,
                )
                .with_code("request_too_large_for_rate_limit"),
            }),
        }
    }
}
