//! The Worker's side of the Durable Object protocol: finding pools and calling their coordinator.
//!
//! Every call is a `stub.fetch` to an internal URL (see `gateway_durable_objects::protocol`). Errors a
//! Durable Object answers with are already OpenAI-shaped and pass through as they are.

use crate::ApiError;
use gateway_durable_objects::directory::DIRECTORY_NAME;
use gateway_durable_objects::protocol::{PoolEntry, INTERNAL_ORIGIN};
use serde::de::DeserializeOwned;
use serde::Serialize;
use worker::{Env, Headers, Method, Request, RequestInit, Response, Stub};

/// Binding name of the pool coordinator namespace (wrangler.toml).
pub const POOL_BINDING: &str = "POOL";
/// Binding name of the pool directory namespace (wrangler.toml).
pub const DIRECTORY_BINDING: &str = "DIRECTORY";

/// The coordinator of the named pool.
pub fn pool_stub(env: &Env, pool: &str) -> Result<Stub, ApiError> {
    env.durable_object(POOL_BINDING)
        .and_then(|ns| ns.id_from_name(pool)?.get_stub())
        .map_err(ApiError::from_worker)
}

fn directory_stub(env: &Env) -> Result<Stub, ApiError> {
    env.durable_object(DIRECTORY_BINDING)
        .and_then(|ns| ns.id_from_name(DIRECTORY_NAME)?.get_stub())
        .map_err(ApiError::from_worker)
}

/// Sends a request to a Durable Object and returns its raw response.
pub async fn call(stub: &Stub, method: Method, path: &str, body: Option<String>) -> Result<Response, ApiError> {
    let mut init = RequestInit::new();
    init.with_method(method);
    if let Some(body) = body {
        let headers = Headers::new();
        headers.set("content-type", "application/json").map_err(ApiError::from_worker)?;
        init.with_headers(headers).with_body(Some(body.into()));
    }
    let req = Request::new_with_init(&format!("{INTERNAL_ORIGIN}{path}"), &init).map_err(ApiError::from_worker)?;
    stub.fetch_with_request(req).await.map_err(ApiError::from_worker)
}

/// Sends a JSON request and decodes a JSON answer; a non-2xx answer becomes its error.
pub async fn call_json<T: DeserializeOwned>(
    stub: &Stub,
    method: Method,
    path: &str,
    body: Option<&impl Serialize>,
) -> Result<T, ApiError> {
    let body = body.map(|b| serde_json::to_string(b)).transpose().map_err(|e| ApiError::internal(e.to_string()))?;
    let mut resp = call(stub, method, path, body).await?;
    if !(200..300).contains(&resp.status_code()) {
        return Err(error_from_response(&mut resp).await);
    }
    resp.json::<T>().await.map_err(ApiError::from_worker)
}

/// Rebuilds the `ApiError` a Durable Object answered with.
pub async fn error_from_response(resp: &mut Response) -> ApiError {
    let status = resp.status_code();
    let retry_after = resp.headers().get("retry-after").ok().flatten().and_then(|v| v.parse().ok());
    let body: Option<gateway_durable_objects::api_error::ErrorBody> = resp.json().await.ok();
    let mut err = match body {
        Some(b) => ApiError::from_parts(status, b.error),
        None => ApiError::internal(format!("pool answered {status}")),
    };
    err.retry_after_s = retry_after;
    err
}

/// Every pool the directory knows.
pub async fn list_pools(env: &Env) -> Result<Vec<PoolEntry>, ApiError> {
    call_json(&directory_stub(env)?, Method::Get, "/pools", None::<&()>).await
}

/// Records a pool in the directory (idempotent).
pub async fn remember_pool(env: &Env, entry: &PoolEntry) -> Result<(), ApiError> {
    let _: PoolEntry = call_json(&directory_stub(env)?, Method::Put, &format!("/pools/{}", entry.name), Some(entry)).await?;
    Ok(())
}
