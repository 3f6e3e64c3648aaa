//! The client rate limiter: one Durable Object per client key (addressed by the key's hash), so a
//! client's budget is shared by every edge location that serves it.
//!
//! `POST /take {"limits": {...}, "tokens": N}` answers 200 when the request fits (charging the
//! estimate `N`) and 429 with `Retry-After` when it does not; `POST /settle {"limits": {...},
//! "reserved": N, "actual": M}` settles an admitted request with the tokens the backend reported
//! (see `routing_core::request::rate_limit`). The buckets are kept in the object's storage (one JSON value,
//! written after every change and read on the object's first request), so neither an eviction nor
//! a deploy hands a client a fresh minute's allowance. The Worker calls it by Durable Object RPC
//! (`gatewayCall`, as the pool coordinator), `fetch` answers the same routes.

use crate::call::{parse_route, parse_rpc_route, reply, respond, respond_rpc, Answered, Incoming};
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
        let route = parse_route(&req, Object::ClientRateLimiter);
        respond(self.dispatch(route, Incoming::Request(&mut req)).await)
    }
}

/// The Worker's calls by Durable Object RPC: the same routes as `fetch` (named by method and URL,
/// with the JSON body), the same signature as the pool coordinator's so one stub type calls both;
/// `pool` and `shard` are unused here.
#[wasm_bindgen::prelude::wasm_bindgen]
impl ClientRateLimiter {
    /// One call by RPC.
    #[wasm_bindgen::prelude::wasm_bindgen(js_name = gatewayCall)]
    pub async fn gateway_call(
        &self,
        method: String,
        url: String,
        _pool: Option<String>,
        _shard: Option<String>,
        body: Option<String>,
    ) -> std::result::Result<wasm_bindgen::JsValue, wasm_bindgen::JsValue> {
        let route = parse_rpc_route(&method, &url, Object::ClientRateLimiter);
        Ok(respond_rpc(self.dispatch(route, Incoming::Rpc(body)).await))
    }
}

impl ClientRateLimiter {
    /// Runs one call, however it came.
    async fn dispatch(
        &self,
        route: std::result::Result<Route, ApiError>,
        mut incoming: Incoming<'_>,
    ) -> Answered {
        match route? {
            Route::SettleTokens => self.settle(&mut incoming).await,
            _ => self.take(&mut incoming).await,
        }
    }

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

    async fn settle(&self, incoming: &mut Incoming<'_>) -> Answered {
        let s: SettleRequest = incoming.body("settle request").await?;
        let now = Date::now().as_millis();
        self.change(|b| b.settle(&s.limits, s.reserved, s.actual, now))
            .await?;
        reply::<SettleRequest>(&Ack)
    }

    async fn take(&self, incoming: &mut Incoming<'_>) -> Answered {
        let take: TakeRequest = incoming.body("take request").await?;
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
