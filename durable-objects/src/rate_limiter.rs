//! The client rate limiter: one Durable Object per client key (addressed by the key's hash), so a
//! client's budget is shared by every edge location that serves it.
//!
//! `POST /take {"limits": {...}, "tokens": N}` answers 200 when the request fits (charging the
//! estimate `N`) and 429 with `Retry-After` when it does not; `POST /settle {"limits": {...},
//! "reserved": N, "actual": M}` settles an admitted request with the tokens the backend reported
//! (see `routing_core::rate_limit`). The buckets live in memory: an evicted object starts full
//! again, which errs towards serving.

use crate::call::{parse_route, read_body};
use coordinator_protocol::messages::{SettleRequest, TakeRequest};
use coordinator_protocol::{ApiError, Object, Route};
use routing_core::rate_limit::RateLimiter as Buckets;
use std::cell::RefCell;
use worker::*;

/// One client's buckets.
#[durable_object]
pub struct ClientRateLimiter {
    buckets: RefCell<Buckets>,
}

impl DurableObject for ClientRateLimiter {
    fn new(_state: State, _env: Env) -> Self {
        ClientRateLimiter {
            buckets: RefCell::new(Buckets::new()),
        }
    }

    async fn fetch(&self, mut req: Request) -> Result<Response> {
        let result = match parse_route(&req, Object::ClientRateLimiter) {
            Ok(Route::SettleTokens) => self.settle(&mut req).await,
            Ok(_) => self.take(&mut req).await,
            Err(e) => Err(e),
        };
        result.or_else(|e| e.to_response())
    }
}

impl ClientRateLimiter {
    async fn settle(&self, req: &mut Request) -> std::result::Result<Response, ApiError> {
        let s: SettleRequest = read_body(req, "settle request").await?;
        self.buckets
            .borrow_mut()
            .settle(&s.limits, s.reserved, s.actual, Date::now().as_millis());
        Ok(Response::ok("ok")?)
    }

    async fn take(&self, req: &mut Request) -> std::result::Result<Response, ApiError> {
        let take: TakeRequest = read_body(req, "take request").await?;
        let now = Date::now().as_millis();
        let result = self
            .buckets
            .borrow_mut()
            .try_take(&take.limits, take.tokens, now);
        match result {
            Ok(()) => Ok(Response::ok("ok")?),
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
