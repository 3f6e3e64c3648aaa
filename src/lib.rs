//! The edge Worker: the OpenAI surface, the admin API, and the cron trigger.
//!
//! Handlers here are thin: they authenticate, parse, and call the proxy, the admin module or the
//! pools' Durable Objects. The routing decisions live in `routing-core`, called by the pool
//! coordinator in `durable-objects/`.

mod admin;
mod auth;
mod pools;
mod proxy;

pub use gateway_durable_objects::api_error::ApiError;
// Re-exported so the Durable Object classes are part of this Worker's wasm module.
pub use gateway_durable_objects::directory::PoolDirectory;
pub use gateway_durable_objects::pool_coordinator::PoolCoordinator;

use gateway_durable_objects::pool_coordinator::Grant;
use serde_json::{json, Value};
use wasm_bindgen::JsCast;
use worker::*;

/// Largest request body accepted unless `MAX_BODY_BYTES` says otherwise.
const DEFAULT_MAX_BODY_BYTES: usize = 4 * 1024 * 1024;

#[event(fetch)]
async fn fetch(req: Request, env: Env, ctx: Context) -> Result<Response> {
    let request_id = request_id(&req);
    let result = route(req, &env, &ctx, &request_id).await;
    let resp = match result {
        Ok(resp) => resp,
        Err(e) => e.to_response()?,
    };
    // Responses relayed from a Durable Object have immutable headers: copy them.
    let headers = Headers::new();
    for (k, v) in resp.headers().entries() {
        headers.append(&k, &v)?;
    }
    headers.set("x-request-id", &request_id)?;
    Ok(resp.with_headers(headers))
}

#[event(scheduled)]
async fn scheduled(_event: ScheduledEvent, env: Env, _ctx: ScheduleContext) {
    match pools::list_pools(&env).await {
        Ok(list) => {
            for pool in list {
                let result = match pools::pool_stub(&env, &pool.name) {
                    Ok(stub) => pools::call(&stub, Method::Post, "/probe/ensure", None).await.map(|_| ()),
                    Err(e) => Err(e),
                };
                if let Err(e) = result {
                    console_error!("cron: pool {}: {e}", pool.name);
                }
            }
        }
        Err(e) => console_error!("cron: cannot list pools: {e}"),
    }
}

/// The client's `x-request-id` when it is safe to echo, otherwise a fresh one.
fn request_id(req: &Request) -> String {
    let given = req.headers().get("x-request-id").ok().flatten();
    match given {
        Some(id) if !id.is_empty() && id.len() <= 128 && id.bytes().all(|b| b.is_ascii_graphic()) => id,
        _ => format!("req-{}", crypto_random_hex()),
    }
}

fn crypto_random_hex() -> String {
    let mut bytes = [0u8; 12];
    let crypto = js_sys::Reflect::get(&js_sys::global(), &"crypto".into()).ok();
    let filled = crypto
        .and_then(|c| c.dyn_into::<web_sys::Crypto>().ok())
        .map(|c| c.get_random_values_with_u8_array(&mut bytes).is_ok())
        .unwrap_or(false);
    if !filled {
        let t = Date::now().as_millis().to_le_bytes();
        bytes[..8].copy_from_slice(&t);
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

async fn route(req: Request, env: &Env, ctx: &Context, request_id: &str) -> std::result::Result<Response, ApiError> {
    let path = req.path();
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    match segments.as_slice() {
        ["healthz"] => match req.method() {
            Method::Get | Method::Head => {
                Response::from_json(&json!({ "status": "ok", "version": env!("CARGO_PKG_VERSION") })).map_err(ApiError::from_worker)
            }
            m => Err(ApiError::method_not_allowed(&m.to_string(), &path)),
        },
        ["admin", rest @ ..] => {
            auth::require_admin(&req, env)?;
            admin::handle(req, env, rest).await
        }
        ["v1", "chat", "completions"] => completion(req, env, ctx, "/v1/chat/completions", request_id).await,
        ["v1", "completions"] => completion(req, env, ctx, "/v1/completions", request_id).await,
        _ => Err(ApiError::not_found(format!("Unknown route {path}."))),
    }
}

fn max_body_bytes(env: &Env) -> usize {
    env.var("MAX_BODY_BYTES").ok().and_then(|v| v.to_string().parse().ok()).unwrap_or(DEFAULT_MAX_BODY_BYTES)
}

async fn completion(
    mut req: Request,
    env: &Env,
    ctx: &Context,
    path: &str,
    request_id: &str,
) -> std::result::Result<Response, ApiError> {
    if req.method() != Method::Post {
        return Err(ApiError::method_not_allowed(&req.method().to_string(), path));
    }
    let limit = max_body_bytes(env);
    let body = req.bytes().await.map_err(|_| ApiError::bad_request("unreadable request body"))?;
    if body.len() > limit {
        return Err(ApiError::payload_too_large(limit));
    }
    let parsed: Value =
        serde_json::from_slice(&body).map_err(|e| ApiError::bad_request(format!("request body is not valid JSON: {e}")))?;
    let model = parsed
        .get("model")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::bad_request("`model` is required and must be a string").with_param("model"))?;
    let mut last_err = ApiError::model_not_found(model);
    for pool in pools::list_pools(env).await? {
        let stub = pools::pool_stub(env, &pool.name)?;
        match pools::call_json::<Grant>(&stub, Method::Post, "/acquire", Some(&json!({ "model": model }))).await {
            Ok(grant) => return proxy::forward(&req, env, ctx, pool.name, grant, path, body, request_id).await,
            Err(e) if e.status == 404 => continue,
            Err(e) => last_err = e,
        }
    }
    Err(last_err)
}
