//! The client rate limiter: one Durable Object per client key (addressed by the key's hash), so a
//! client's budget is shared by every edge location that serves it.
//!
//! `POST /take {"limits": {...}, "tokens": N}` answers 200 when the request fits (charging the
//! estimate `N`) and 429 with `Retry-After` when it does not; `POST /settle {"limits": {...},
//! "reserved": N, "actual": M}` settles an admitted request with the tokens the backend reported
//! (see `routing_core::rate_limit`). The buckets live in memory: an evicted object starts full
//! again, which errs towards serving.

use crate::api_error::ApiError;
use routing_core::rate_limit::{RateLimiter as Buckets, RateLimits};
use serde::Deserialize;
use std::cell::RefCell;
use worker::*;

/// Body of `POST /take`.
#[derive(Debug, Deserialize)]
pub struct TakeRequest {
    /// The client's limits.
    pub limits: RateLimits,
    /// Tokens the request is charged.
    pub tokens: u64,
}

/// Body of `POST /settle`.
#[derive(Debug, Deserialize)]
pub struct SettleRequest {
    /// The client's limits.
    pub limits: RateLimits,
    /// Tokens charged at admission.
    pub reserved: u64,
    /// Tokens the request really used.
    pub actual: u64,
}

/// One client's buckets.
#[durable_object]
pub struct RateLimiter {
    buckets: RefCell<Buckets>,
}

impl DurableObject for RateLimiter {
    fn new(_state: State, _env: Env) -> Self {
        RateLimiter {
            buckets: RefCell::new(Buckets::new()),
        }
    }

    async fn fetch(&self, mut req: Request) -> Result<Response> {
        if req.method() == Method::Post && req.path() == "/settle" {
            return match req.json::<SettleRequest>().await {
                Ok(s) => {
                    self.buckets.borrow_mut().settle(
                        &s.limits,
                        s.reserved,
                        s.actual,
                        Date::now().as_millis(),
                    );
                    Response::ok("ok")
                }
                Err(e) => {
                    ApiError::bad_request(format!("invalid settle request: {e}")).to_response()
                }
            };
        }
        if req.method() != Method::Post || req.path() != "/take" {
            return ApiError::not_found("rate limiter has no such route").to_response();
        }
        let take: TakeRequest = match req.json().await {
            Ok(t) => t,
            Err(e) => {
                return ApiError::bad_request(format!("invalid take request: {e}")).to_response()
            }
        };
        let now = Date::now().as_millis();
        let result = self
            .buckets
            .borrow_mut()
            .try_take(&take.limits, take.tokens, now);
        match result {
            Ok(()) => Response::ok("ok"),
            Err(refusal) => match refusal.retry_after_ms {
                Some(ms) => ApiError::rate_limited(
                    "Rate limit exceeded for this API key.",
                    ms.div_ceil(1000).clamp(1, 3600) as u32,
                )
                .to_response(),
                None => ApiError::rate_limited(
                    "This request alone exceeds the per-minute token limit for this API key.",
                    60,
                )
                .with_code("request_too_large_for_rate_limit")
                .to_response(),
            },
        }
    }
}
