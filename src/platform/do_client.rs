//! The Worker's side of the Durable Object protocol: finding pools and calling their coordinator,
//! the directory and the client rate limiters.
//!
//! Every call is one [`call`]: a request message (a `coordinator_protocol::Call`, which names its
//! route and its answer type) to the object [`To`] names, read back as that answer. A pool
//! coordinator is called by Durable Object RPC (its `gatewayCall` method: route, pool, shard and
//! body as strings, the answer as status, `Retry-After` and body), which makes no request or
//! response object on either side; the directory and the rate limiters, and the answers the
//! admin API relays untouched ([`call_raw`]), by a `stub.fetch` of the same route. A pool call
//! names the pool and its coordinator shard (0 for a pool of one shard, and for everything only
//! shard 0 does: probes, listings). Errors a Durable Object answers with are already OpenAI-shaped
//! and pass through as they are; a pool's refusals come back typed inside the acquire and reassign
//! answers.
//! What the directory holds (pools, minted keys) is cached in the isolate and refreshed in the
//! background.

use crate::platform::isolate::{self, stale_while_revalidate};
use coordinator_protocol::call::{read_answer, read_error, CallError, ListPools, RpcAnswer};
use coordinator_protocol::internal_call::{internal_init, ShardAddress};
use coordinator_protocol::messages::{shard_object_name, PoolEntry, POOL_BINDING};
use coordinator_protocol::ApiError;
use coordinator_protocol::{Answer, Call, Object, Route};
use gateway_durable_objects::directory::DIRECTORY_NAME;
use wasm_bindgen::prelude::wasm_bindgen;
use wasm_bindgen::{JsCast, JsValue};
use wasm_bindgen_futures::JsFuture;
use worker::worker_sys::{DurableObjectId, DurableObjectNamespace};
use worker::{Context, Env, Response};
/// Binding name of the client rate limiter namespace (wrangler.toml).
pub const RATE_LIMITER_BINDING: &str = "RATE_LIMITER";
/// Binding name of the pool directory namespace (wrangler.toml).
pub use coordinator_protocol::names::DIRECTORY_BINDING;

/// The object a call goes to.
#[derive(Debug, Clone, Copy)]
pub enum To<'a> {
    /// Shard `shard` (0 for a pool of one shard) of the named pool's coordinator.
    Pool(&'a str, u32),
    /// The pool directory.
    Directory,
    /// A client's rate limiter, by the hash of its key.
    Limiter(&'a str),
}

/// Most object ids an isolate keeps (pool shards, the directory, the rate limiters of the keys it
/// saw); past it the map starts again.
const MAX_CACHED_IDS: usize = 1024;

/// The stub of object `name` of `binding`'s namespace (placed by `location_hint`, if given).
fn stub(
    env: &Env,
    binding: &'static str,
    name: &str,
    location_hint: Option<&str>,
) -> Result<worker::worker_sys::DurableObject, ApiError> {
    let cached = isolate::with_namespaces(|n| n.borrow().get(binding).cloned());
    let namespace = match cached {
        Some(ns) => ns,
        None => {
            // Checked as `worker` checks it (a binding of that class), then kept as it is.
            env.durable_object(binding)?;
            let ns: DurableObjectNamespace = js_sys::Reflect::get(env, &JsValue::from_str(binding))
                .map_err(worker::Error::from)?
                .unchecked_into();
            isolate::with_namespaces(|n| n.borrow_mut().insert(binding, ns.clone()));
            ns
        }
    };
    let key = (binding, name.to_string());
    let id = match isolate::with_object_ids(|ids| ids.borrow().get(&key).cloned()) {
        Some(id) => id,
        None => {
            let id: JsValue = namespace
                .id_from_name(name)
                .map_err(worker::Error::from)?
                .into();
            isolate::with_object_ids(|ids| {
                let mut ids = ids.borrow_mut();
                if ids.len() >= MAX_CACHED_IDS {
                    ids.clear();
                }
                ids.insert(key, id.clone());
            });
            id
        }
    };
    let id: &DurableObjectId = id.unchecked_ref();
    let stub = match location_hint {
        Some(hint) => {
            let options = js_sys::Object::new();
            js_sys::Reflect::set(&options, &"locationHint".into(), &hint.into())
                .map_err(worker::Error::from)?;
            namespace.get_with_options(id, &options)
        }
        None => namespace.get(id),
    };
    Ok(stub.map_err(worker::Error::from)?)
}

/// A pool shard's stub, placed by the pool's location hint when this isolate knows one.
fn pool_stub(
    env: &Env,
    pool: &str,
    shard: u32,
) -> Result<worker::worker_sys::DurableObject, ApiError> {
    let hint = isolate::pool_list().with(|p| {
        p.borrow().value.as_ref().and_then(|(_, list)| {
            list.iter()
                .find(|e| e.name == pool)
                .and_then(|e| e.location_hint.clone())
        })
    });
    stub(
        env,
        POOL_BINDING,
        &shard_object_name(pool, shard),
        hint.as_deref(),
    )
}

/// An answer as it came back, unread: the platform's response to a `fetch` (the hot path reads
/// status and body from it directly, with one promise for the body instead of `worker`'s stream
/// reader), or a pool's RPC answer.
pub enum UnreadAnswer {
    /// The answer of a `fetch`.
    Response(web_sys::Response),
    /// The answer of a pool's RPC call.
    Rpc(RpcAnswer),
}

/// The stub of the object `to` names, and its shard address when it is a pool's; a route of
/// another kind of object is refused here.
fn target<'a>(
    env: &Env,
    to: To<'a>,
    route: &Route,
) -> Result<(worker::worker_sys::DurableObject, Option<ShardAddress<'a>>), ApiError> {
    Ok(match (to, route.object()) {
        (To::Pool(pool, shard), Object::Pool) => (
            pool_stub(env, pool, shard)?,
            Some(ShardAddress { pool, shard }),
        ),
        (To::Directory, Object::Directory) => {
            (stub(env, DIRECTORY_BINDING, DIRECTORY_NAME, None)?, None)
        }
        (To::Limiter(client), Object::ClientRateLimiter) => {
            (stub(env, RATE_LIMITER_BINDING, client, None)?, None)
        }
        _ => {
            let path = route.path();
            return Err(ApiError::internal(format!(
                "{path} is not a route of {to:?}"
            )));
        }
    })
}

/// Sends `msg` to the object `to` names and returns the answer unread: by RPC to a pool or a rate
/// limiter, by `fetch` to the directory.
pub async fn send<M: Call>(env: &Env, to: To<'_>, msg: &M) -> Result<UnreadAnswer, ApiError> {
    let route = msg.route();
    let body = msg.body().map_err(|e| ApiError::internal(e.to_string()))?;
    match target(env, to, &route)? {
        (stub, _) if by_rpc(to) => Ok(UnreadAnswer::Rpc(send_rpc(stub, to, &route, body).await?)),
        (stub, address) => Ok(UnreadAnswer::Response(
            send_web(stub, address, &route, body).await?,
        )),
    }
}

/// Whether calls to `to` go by RPC: a pool's and a rate limiter's (the request path's calls).
fn by_rpc(to: To<'_>) -> bool {
    matches!(to, To::Pool(..) | To::Limiter(_))
}

async fn send_web(
    stub: worker::worker_sys::DurableObject,
    to: Option<ShardAddress<'_>>,
    route: &Route,
    body: Option<String>,
) -> Result<web_sys::Response, ApiError> {
    let (url, init) = internal_init(route, to, body)?;
    let object: StubFetch = stub.unchecked_into();
    let promise = object
        .fetch_with_str_and_init(&url, &init)
        .map_err(worker::Error::from)?;
    let resp = JsFuture::from(promise).await.map_err(worker::Error::from)?;
    Ok(resp.unchecked_into())
}

async fn send_rpc(
    stub: worker::worker_sys::DurableObject,
    to: To<'_>,
    route: &Route,
    body: Option<String>,
) -> Result<RpcAnswer, ApiError> {
    let object: StubRpc = stub.unchecked_into();
    let (pool, shard) = match to {
        To::Pool(pool, shard) => (pool, shard),
        _ => ("", 0),
    };
    let shard = (shard != 0).then(|| shard.to_string());
    let promise = object
        .gateway_call(route.method().as_str(), &route.url(), pool, shard, body)
        .map_err(worker::Error::from)?;
    let value = JsFuture::from(promise).await.map_err(worker::Error::from)?;
    RpcAnswer::from_js(&value).ok_or_else(|| {
        worker::Error::RustError(format!("{to:?}: an RPC answer of no known shape")).into()
    })
}

#[wasm_bindgen]
extern "C" {
    /// A Durable Object stub, for its `fetch(url, init)` (worker-sys binds only
    /// `fetch(request)` and `fetch(url)`).
    type StubFetch;

    #[wasm_bindgen(method, catch, js_name = fetch)]
    fn fetch_with_str_and_init(
        this: &StubFetch,
        url: &str,
        init: &web_sys::RequestInit,
    ) -> Result<js_sys::Promise, JsValue>;

    /// A pool coordinator's or a rate limiter's stub, for its RPC method
    /// (`coordinator_protocol::call::RPC_METHOD`).
    type StubRpc;

    #[wasm_bindgen(method, catch, js_name = gatewayCall)]
    fn gateway_call(
        this: &StubRpc,
        method: &str,
        url: &str,
        pool: &str,
        shard: Option<String>,
        body: Option<String>,
    ) -> Result<js_sys::Promise, JsValue>;
}

/// Calls the object `to` names with `msg` and reads its answer: `msg`'s own answer type, or the
/// error the object answered with (a pool's refusal, when the answer has no place for it).
pub async fn call<M: Call>(env: &Env, to: To<'_>, msg: &M) -> Result<M::Answer, ApiError> {
    answer_of(send(env, to, msg).await?).await
}

/// [`call`] answering the object's response as it is, for the admin API to relay.
pub async fn call_raw<M: Call>(env: &Env, to: To<'_>, msg: &M) -> Result<Response, ApiError> {
    let route = msg.route();
    let body = msg.body().map_err(|e| ApiError::internal(e.to_string()))?;
    let (stub, address) = target(env, to, &route)?;
    Ok(send_web(stub, address, &route, body).await?.into())
}

/// Reads the answer to a call sent with [`send`].
pub async fn answer_of<A: Answer>(sent: UnreadAnswer) -> Result<A, ApiError> {
    let resp = match sent {
        UnreadAnswer::Response(resp) => resp,
        UnreadAnswer::Rpc(answer) => {
            return read_answer(answer.status, answer.retry_after_s, &answer.body)
                .map_err(call_error)
        }
    };
    let status = resp.status();
    if !(200..300).contains(&status) {
        let (retry_after, text) = error_parts(&resp).await;
        return read_answer(status, retry_after, &text).map_err(call_error);
    }
    let text = if A::READS_BODY {
        read_text(&resp).await?
    } else {
        if let Some(body) = resp.body() {
            let _ = body.cancel();
        }
        String::new()
    };
    read_answer(status, None, &text).map_err(call_error)
}

fn call_error(e: CallError) -> ApiError {
    match e {
        CallError::Answered(e) => e,
        // Logged; the client sees an internal error.
        CallError::Unreadable(detail) => worker::Error::RustError(detail).into(),
    }
}

/// The whole body of an answer, as text.
async fn read_text(resp: &web_sys::Response) -> Result<String, ApiError> {
    let text = resp.text().map_err(worker::Error::from)?;
    let text = JsFuture::from(text).await.map_err(worker::Error::from)?;
    Ok(text.as_string().unwrap_or_default())
}

/// An error answer's `Retry-After` and body (empty when it cannot be read).
async fn error_parts(resp: &web_sys::Response) -> (Option<u32>, String) {
    let retry_after = resp
        .headers()
        .get("retry-after")
        .ok()
        .flatten()
        .and_then(|v| v.parse().ok());
    (retry_after, read_text(resp).await.unwrap_or_default())
}

/// Rebuilds the `ApiError` a Durable Object answered with (for a relayed admin answer).
pub async fn error_from_response(resp: Response) -> ApiError {
    let resp: web_sys::Response = resp.into();
    let (retry_after, text) = error_parts(&resp).await;
    read_error(resp.status(), retry_after, &text).map_or_else(|e| e, ApiError::from)
}

/// How long an isolate trusts its copy of the pool list before refreshing it.
const POOL_CACHE_MS: u64 = 2_000;

async fn fetch_pools(env: Env) -> Result<Vec<PoolEntry>, ApiError> {
    call(&env, To::Directory, &ListPools).await
}

/// Every pool the directory knows, as fresh as the admin API needs: the isolate's copy while it
/// is fresh, else read now (an operator adding a pool in this isolate clears the copy).
pub async fn list_pools(env: &Env) -> Result<Vec<PoolEntry>, ApiError> {
    let now = js_sys::Date::now() as u64;
    let cached = isolate::pool_list().with(|p| {
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
    isolate::pool_list().with(|p| p.borrow_mut().value = Some((now, list.clone())));
    Ok(list)
}

/// Every pool, for the request path: from the isolate's copy, refreshed in the background, so a
/// slow or failing directory does not hold up or fail requests a cached copy can route.
pub async fn list_pools_cached(env: &Env, ctx: &Context) -> Result<Vec<PoolEntry>, ApiError> {
    let env = env.clone();
    stale_while_revalidate(isolate::pool_list(), POOL_CACHE_MS, ctx, move || {
        fetch_pools(env)
    })
    .await
}

/// Records a pool in the directory (idempotent).
pub async fn remember_pool(env: &Env, entry: &PoolEntry) -> Result<(), ApiError> {
    call(env, To::Directory, entry).await?;
    isolate::pool_list().with(|p| p.borrow_mut().clear());
    Ok(())
}
