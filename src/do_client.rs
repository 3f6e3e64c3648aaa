//! The Worker's side of the Durable Object protocol: finding pools and calling their coordinator,
//! the directory and the client rate limiters.
//!
//! Every call is a `stub.fetch` to the URL of a `coordinator_protocol::Route`, with a typed body
//! and a typed answer. A pool call names the pool and its coordinator shard (0 for a pool of one
//! shard, and for everything only shard 0 does: probes, listings). Errors a Durable Object answers with are already OpenAI-shaped and pass
//! through as they are. What the directory holds (pools, minted keys) is cached in the isolate and
//! refreshed in the background.

use coordinator_protocol::error::ErrorBody;
use coordinator_protocol::internal_call::{internal_web_request, ShardAddress};
use coordinator_protocol::messages::{shard_object_name, PoolEntry, POOL_BINDING};
use coordinator_protocol::ApiError;
use coordinator_protocol::Route;
use gateway_durable_objects::directory::DIRECTORY_NAME;
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::cell::RefCell;
use wasm_bindgen::JsCast;
use wasm_bindgen_futures::JsFuture;
use worker::{Context, Date, Env, Response, Stub};
/// Binding name of the client rate limiter namespace (wrangler.toml).
pub const RATE_LIMITER_BINDING: &str = "RATE_LIMITER";
/// Binding name of the pool directory namespace (wrangler.toml).
pub use coordinator_protocol::names::DIRECTORY_BINDING;

fn stub(env: &Env, binding: &str, name: &str) -> Result<Stub, ApiError> {
    Ok(env
        .durable_object(binding)?
        .id_from_name(name)?
        .get_stub()?)
}

/// A pool shard's stub, placed by the pool's location hint when this isolate knows one.
fn pool_stub(env: &Env, pool: &str, shard: u32) -> Result<Stub, ApiError> {
    let hint = POOLS.with(|p| {
        p.borrow().value.as_ref().and_then(|(_, list)| {
            list.iter()
                .find(|e| e.name == pool)
                .and_then(|e| e.location_hint.clone())
        })
    });
    let name = shard_object_name(pool, shard);
    match hint {
        Some(h) => Ok(env
            .durable_object(POOL_BINDING)?
            .id_from_name(&name)?
            .get_stub_with_location_hint(&h)?),
        None => stub(env, POOL_BINDING, &name),
    }
}

/// Sends a call to the object behind `stub` and returns its answer as the platform's response
/// object: the hot path reads status, headers and body from it directly, with one promise for the
/// body instead of `worker`'s stream reader.
async fn send_web(
    stub: Stub,
    to: Option<ShardAddress<'_>>,
    route: &Route,
    body: Option<String>,
) -> Result<web_sys::Response, ApiError> {
    let req = internal_web_request(route, to, body)?;
    let object: worker::worker_sys::DurableObject = stub.into_rpc();
    let promise = object
        .fetch_with_request(&req)
        .map_err(worker::Error::from)?;
    let resp = JsFuture::from(promise).await.map_err(worker::Error::from)?;
    Ok(resp.unchecked_into())
}

/// The whole body of an answer, as text.
pub async fn read_text(resp: &web_sys::Response) -> Result<String, ApiError> {
    let text = resp.text().map_err(worker::Error::from)?;
    let text = JsFuture::from(text).await.map_err(worker::Error::from)?;
    Ok(text.as_string().unwrap_or_default())
}

/// The body of an answer, decoded from JSON.
pub async fn read_json<T: DeserializeOwned>(resp: &web_sys::Response) -> Result<T, ApiError> {
    let text = read_text(resp).await?;
    Ok(serde_json::from_str(&text).map_err(worker::Error::from)?)
}

async fn decode<T: DeserializeOwned>(resp: web_sys::Response) -> Result<T, ApiError> {
    if !(200..300).contains(&resp.status()) {
        return Err(error_from_web(&resp).await);
    }
    read_json(&resp).await
}

/// The JSON text of a call's body.
pub fn encode(body: &impl Serialize) -> Result<String, ApiError> {
    serde_json::to_string(body).map_err(|e| ApiError::internal(e.to_string()))
}

/// Calls shard `shard` of the named pool's coordinator with a body already encoded, and returns
/// its raw response (for relayed admin answers).
pub async fn pool_call(
    env: &Env,
    pool: &str,
    shard: u32,
    route: &Route,
    body: Option<String>,
) -> Result<Response, ApiError> {
    Ok(pool_call_web(env, pool, shard, route, body).await?.into())
}

/// [`pool_call`] answering the platform's response object (for the acquire call, whose body is
/// built once per request, and the metrics pages).
pub async fn pool_call_web(
    env: &Env,
    pool: &str,
    shard: u32,
    route: &Route,
    body: Option<String>,
) -> Result<web_sys::Response, ApiError> {
    let to = ShardAddress { pool, shard };
    send_web(pool_stub(env, pool, shard)?, Some(to), route, body).await
}

/// Calls shard `shard` of the named pool's coordinator and decodes its answer; a non-2xx answer
/// becomes its error.
pub async fn pool_json<T: DeserializeOwned>(
    env: &Env,
    pool: &str,
    shard: u32,
    route: &Route,
    body: Option<&impl Serialize>,
) -> Result<T, ApiError> {
    let body = body.map(encode).transpose()?;
    decode(pool_call_web(env, pool, shard, route, body).await?).await
}

/// Calls shard `shard` of the named pool's coordinator for its effect: a 2xx answer's body is
/// not read (the release's), any other answer becomes its error.
pub async fn pool_ok(
    env: &Env,
    pool: &str,
    shard: u32,
    route: &Route,
    body: Option<&impl Serialize>,
) -> Result<(), ApiError> {
    let body = body.map(encode).transpose()?;
    let resp = pool_call_web(env, pool, shard, route, body).await?;
    if !(200..300).contains(&resp.status()) {
        return Err(error_from_web(&resp).await);
    }
    if let Some(body) = resp.body() {
        let _ = body.cancel();
    }
    Ok(())
}

/// Rebuilds the `ApiError` a Durable Object answered with.
pub async fn error_from_response(resp: Response) -> ApiError {
    error_from_web(&resp.into()).await
}

/// [`error_from_response`] of the platform's response object.
pub async fn error_from_web(resp: &web_sys::Response) -> ApiError {
    let status = resp.status();
    let retry_after = resp
        .headers()
        .get("retry-after")
        .ok()
        .flatten()
        .and_then(|v| v.parse().ok());
    let body: Option<ErrorBody> = read_json(resp).await.ok();
    let mut err = match body {
        Some(b) => ApiError::from_parts(status, b.error),
        None => ApiError::internal(format!("pool answered {status}")),
    };
    err.retry_after_s = retry_after;
    err
}

/// Calls the pool directory and decodes its answer.
pub async fn directory_json<T: DeserializeOwned>(
    env: &Env,
    route: &Route,
    body: Option<&impl Serialize>,
) -> Result<T, ApiError> {
    let body = body.map(encode).transpose()?;
    let resp = send_web(
        stub(env, DIRECTORY_BINDING, DIRECTORY_NAME)?,
        None,
        route,
        body,
    )
    .await?;
    decode(resp).await
}

/// A value an isolate keeps from the directory (the pool list, minted key hashes).
pub struct CacheSlot<T> {
    value: Option<(u64, T)>,
    /// When the background refresh in flight started.
    refreshing_since: Option<u64>,
}

impl<T> CacheSlot<T> {
    /// An empty slot.
    pub const fn new() -> Self {
        CacheSlot {
            value: None,
            refreshing_since: None,
        }
    }

    /// Forgets the value (this isolate just changed it).
    pub fn clear(&mut self) {
        self.value = None;
    }
}

/// A background refresh that has run this long is presumed lost and may be started again.
const REFRESH_GIVE_UP_MS: u64 = 10_000;

/// Serves `slot`'s value: fresh for `fresh_ms`; after that the old copy is still served at once
/// while one refresh runs in the background (`ctx.wait_until`), and a failed refresh keeps it.
/// The directory is on the request path only while the isolate has no copy at all.
pub async fn stale_while_revalidate<T, F, Fut>(
    slot: &'static std::thread::LocalKey<RefCell<CacheSlot<T>>>,
    fresh_ms: u64,
    ctx: &Context,
    fetch: F,
) -> Result<T, ApiError>
where
    T: Clone + 'static,
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = Result<T, ApiError>> + 'static,
{
    let now = Date::now().as_millis();
    let (value, refreshing_since) = slot.with(|s| {
        let s = s.borrow();
        (s.value.clone(), s.refreshing_since)
    });
    match value {
        Some((at, v)) if now < at + fresh_ms => Ok(v),
        Some((_, v)) => {
            if refreshing_since.is_none_or(|t| now > t + REFRESH_GIVE_UP_MS) {
                slot.with(|s| s.borrow_mut().refreshing_since = Some(now));
                let refresh = fetch();
                ctx.wait_until(async move {
                    let result = refresh.await;
                    slot.with(|s| {
                        let mut s = s.borrow_mut();
                        s.refreshing_since = None;
                        match result {
                            Ok(v) => s.value = Some((Date::now().as_millis(), v)),
                            Err(e) => worker::console_error!(
                                "directory refresh failed; serving the cached copy: {e}"
                            ),
                        }
                    });
                });
            }
            Ok(v)
        }
        None => {
            let v = fetch().await?;
            slot.with(|s| s.borrow_mut().value = Some((now, v.clone())));
            Ok(v)
        }
    }
}

thread_local! {
    static POOLS: RefCell<CacheSlot<Vec<PoolEntry>>> = const { RefCell::new(CacheSlot::new()) };
}

/// How long an isolate trusts its copy of the pool list before refreshing it.
const POOL_CACHE_MS: u64 = 2_000;

async fn fetch_pools(env: Env) -> Result<Vec<PoolEntry>, ApiError> {
    directory_json(&env, &Route::ListPools, None::<&()>).await
}

/// Every pool the directory knows, as fresh as the admin API needs: the isolate's copy while it
/// is fresh, else read now (an operator adding a pool in this isolate clears the copy).
pub async fn list_pools(env: &Env) -> Result<Vec<PoolEntry>, ApiError> {
    let now = Date::now().as_millis();
    let cached = POOLS.with(|p| {
        p.borrow()
            .value
            .clone()
            .filter(|(at, _)| now < at + POOL_CACHE_MS)
            .map(|(_, l)| l)
    });
    if let Some(list) = cached {
        return Ok(list);
    }
    let list = fetch_pools(env.clone()).await?;
    POOLS.with(|p| p.borrow_mut().value = Some((now, list.clone())));
    Ok(list)
}

/// Every pool, for the request path: from the isolate's copy, refreshed in the background, so a
/// slow or failing directory does not hold up or fail requests a cached copy can route.
pub async fn list_pools_cached(env: &Env, ctx: &Context) -> Result<Vec<PoolEntry>, ApiError> {
    let env = env.clone();
    stale_while_revalidate(&POOLS, POOL_CACHE_MS, ctx, move || fetch_pools(env)).await
}

/// Records a pool in the directory (idempotent).
pub async fn remember_pool(env: &Env, entry: &PoolEntry) -> Result<(), ApiError> {
    let _: PoolEntry =
        directory_json(env, &Route::PutPool(entry.name.clone()), Some(entry)).await?;
    POOLS.with(|p| p.borrow_mut().clear());
    Ok(())
}

/// Calls the client's rate limiter (`TakeTokens` or `SettleTokens`); a refusal comes back as its
/// 429 error.
pub async fn rate_limit(
    env: &Env,
    client: &str,
    route: &Route,
    body: &impl Serialize,
) -> Result<(), ApiError> {
    let stub = stub(env, RATE_LIMITER_BINDING, client)?;
    let resp = send_web(stub, None, route, Some(encode(body)?)).await?;
    if resp.status() == 200 {
        return Ok(());
    }
    Err(error_from_web(&resp).await)
}
