//! The streaming proxy: forwards an OpenAI request to the backend a pool chose and passes the
//! answer straight back.
//!
//! The response body is never read in wasm: the upstream stream is piped into a `TransformStream`
//! whose readable side goes to the client, and the pipe's promise, awaited in `wait_until`, tells
//! us when the stream ended, so the lease is released then (also when the client hung up: the
//! client's abort signal is passed to the upstream fetch, which cancels it).

use crate::pools::{call_json, pool_stub};
use crate::ApiError;
use gateway_durable_objects::pool_coordinator::Grant;
use serde_json::json;
use wasm_bindgen::JsCast;
use wasm_bindgen_futures::JsFuture;
use worker::{AbortSignal, Context, Env, Fetch, Headers, Method, Request, RequestInit, Response, ResponseBody};

/// Forwards `body` to `path` on the granted backend and streams the answer back.
pub async fn forward(
    req: &Request,
    env: &Env,
    ctx: &Context,
    pool: String,
    grant: Grant,
    path: &str,
    body: Vec<u8>,
    request_id: &str,
) -> Result<Response, ApiError> {
    let headers = Headers::new();
    let set = |k: &str, v: &str| headers.set(k, v).map_err(ApiError::from_worker);
    set("content-type", "application/json")?;
    set("x-request-id", request_id)?;
    if let Some(key) = &grant.api_key {
        set("authorization", &format!("Bearer {key}"))?;
    }
    let mut init = RequestInit::new();
    init.with_method(Method::Post).with_headers(headers).with_body(Some(js_sys::Uint8Array::from(body.as_slice()).into()));
    let upstream_req =
        Request::new_with_init(&format!("{}{}", grant.url, path), &init).map_err(ApiError::from_worker)?;
    let signal: AbortSignal = req.inner().signal().into();
    let upstream = match Fetch::Request(upstream_req).send_with_signal(&signal).await {
        Ok(r) => r,
        Err(e) => {
            release(env.clone(), pool, grant.lease_id).await;
            return Err(ApiError::bad_gateway(format!("backend {} unreachable: {e}", grant.backend_id)));
        }
    };
    let status = upstream.status_code();
    let content_type = upstream.headers().get("content-type").ok().flatten();
    let (_, upstream_body) = upstream.into_parts();
    let out_headers = Headers::new();
    let oset = |k: &str, v: &str| out_headers.set(k, v).map_err(ApiError::from_worker);
    if let Some(ct) = content_type {
        oset("content-type", &ct)?;
    }
    oset("x-request-id", request_id)?;
    oset("x-gateway-backend", &grant.backend_id)?;
    oset("x-gateway-pool", &pool)?;
    let resp = match upstream_body {
        ResponseBody::Stream(stream) => {
            let ts = web_sys::TransformStream::new().map_err(|_| ApiError::internal("TransformStream unavailable"))?;
            let pipe = stream.pipe_to(&ts.writable());
            let lease_id = grant.lease_id;
            let env = env.clone();
            ctx.wait_until(async move {
                let _ = JsFuture::from(pipe).await;
                release(env, pool, lease_id).await;
            });
            Response::builder().with_status(status).with_headers(out_headers).stream(ts.readable().unchecked_into())
        }
        other => {
            release(env.clone(), pool, grant.lease_id).await;
            Response::builder().with_status(status).with_headers(out_headers).body(other)
        }
    };
    Ok(resp)
}

/// Returns a lease to its pool; failures are logged, and the lease's deadline is the backstop.
pub async fn release(env: Env, pool: String, lease_id: u64) {
    let result: Result<serde_json::Value, ApiError> = match pool_stub(&env, &pool) {
        Ok(stub) => call_json(&stub, Method::Post, "/release", Some(&json!({ "lease_id": lease_id }))).await,
        Err(e) => Err(e),
    };
    if let Err(e) = result {
        worker::console_error!("release of lease {lease_id} in pool {pool} failed: {e}");
    }
}
