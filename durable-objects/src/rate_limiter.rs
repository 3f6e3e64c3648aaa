//! The client rate limiter: one Durable Object per client key (addressed by the key's hash), so a
//! client's budget is shared by every edge location that serves it.
//!
//! `POST /take {"limits": {...}, "tokens": N}` answers 200 when the request fits (charging the
//! estimate `N`, and saying what is left) and 429 with `Retry-After` when it does not (with
//! `"force": true` it charges whatever the buckets hold: a request served ahead of its charge's
//! answer is paid for); `POST /settle {"limits": {...},
//! "reserved": N, "actual": M}` settles an admitted request with the tokens the backend reported
//! (see `routing_core::request::rate_limit`). The buckets live in memory and are kept in the
//! object's storage (one JSON value, read on the object's first request), so neither an eviction
//! nor a deploy hands a client a fresh minute's allowance. They are written behind: a change sets
//! an alarm [`FLUSH_AFTER_MS`] ahead (unless one is set), and the alarm writes whatever the
//! buckets are by then, so a busy key costs two storage writes a second (setting the alarm, which
//! the first request of each second waits for, and storing), not two per request (each one a
//! commit that the object's answer waited for: about 2 ms of a request's time to first byte under
//! Miniflare, in `make bench-round-trips`). What a crash, a deploy or a panic in the object can
//! lose is the charges not yet stored: usually those of the last `FLUSH_AFTER_MS`, longer when
//! the platform delays the alarm (up to a minute, by its documentation) or its write fails and
//! is retried. The Worker calls it by Durable Object RPC
//! (`gatewayCall`, as the pool coordinator), `fetch` answers the same routes.

use crate::call::{parse_route, parse_rpc_route, reply, respond, respond_rpc, Answered, Incoming};
use coordinator_protocol::call::Ack;
use coordinator_protocol::messages::{SettleRequest, TakeRequest, Taken};
use coordinator_protocol::{ApiError, Object, Route};
use routing_core::request::rate_limit::RateLimiter as Buckets;
use std::cell::{Cell, RefCell};
use worker::*;

/// The storage key of the buckets.
const BUCKETS_KEY: &str = "buckets";

/// How long a change to the buckets stays in memory only before the alarm stores it (ms).
const FLUSH_AFTER_MS: i64 = 1_000;

/// One client's buckets.
#[durable_object]
pub struct ClientRateLimiter {
    state: State,
    /// `None` until read from storage (on the first request after the object started).
    buckets: RefCell<Option<Buckets>>,
    /// Whether the alarm that stores the buckets is set (changes since the last write wait for it).
    flush_set: Cell<bool>,
}

impl DurableObject for ClientRateLimiter {
    fn new(state: State, _env: Env) -> Self {
        ClientRateLimiter {
            state,
            buckets: RefCell::new(None),
            flush_set: Cell::new(false),
        }
    }

    /// Stores the buckets as they are now (nothing when this instance never read them: a new
    /// instance's alarm set by the one before, whose changes since its last write are lost). A
    /// failed write fails the alarm, which the platform retries.
    async fn alarm(&self) -> Result<Response> {
        self.flush_set.set(false);
        self.store().await?;
        Response::ok("stored")
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
        let mut buckets = stored
            .and_then(|s| serde_json::from_str::<Buckets>(&s).ok())
            .unwrap_or_default();
        // The changes not yet written are lost: this instance's states count above them.
        buckets.restarted();
        // Another request may have loaded them while this one read: keep the first.
        self.buckets.borrow_mut().get_or_insert(buckets);
        Ok(())
    }

    /// Applies `change` to the buckets; the alarm stores them `FLUSH_AFTER_MS` later (or they
    /// are stored now, when the alarm cannot be set).
    async fn change<T>(
        &self,
        change: impl FnOnce(&mut Buckets) -> T,
    ) -> std::result::Result<T, ApiError> {
        self.load().await?;
        let result = change(self.buckets.borrow_mut().get_or_insert_with(Buckets::new));
        if !self.flush_set.replace(true) {
            if let Err(e) = self.state.storage().set_alarm(FLUSH_AFTER_MS).await {
                console_error!("rate limiter: cannot set the alarm that stores the buckets: {e}");
                self.flush_set.set(false);
                self.store().await?;
            }
        }
        Ok(result)
    }

    /// Writes the buckets to storage, if this instance has them.
    async fn store(&self) -> Result<()> {
        let stored = match self.buckets.borrow().as_ref() {
            Some(buckets) => serde_json::to_string(buckets)?,
            None => return Ok(()),
        };
        self.state.storage().put(BUCKETS_KEY, stored).await
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
            .change(|b| {
                let taken = if take.force {
                    b.force_take(&take.limits, take.tokens, now);
                    Ok(())
                } else {
                    b.try_take(&take.limits, take.tokens, now)
                };
                taken.map(|()| b.left(&take.limits, now))
            })
            .await?;
        match result {
            Ok(left) => reply::<TakeRequest>(&Taken { left }),
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
