//! The admin API under `/admin`: register, list and inspect backends and pools.
//!
//! Every route requires `Authorization: Bearer <ADMIN_TOKEN>`. The Worker validates the envelope
//! (JSON, pool name), records the pool in the directory, and relays the call to the pool's
//! coordinator, which validates the rest and owns the data.

use crate::pools::{call, error_from_response, list_pools, pool_stub, remember_pool};
use crate::ApiError;
use gateway_durable_objects::protocol::{BackendRegistration, PoolEntry, DEFAULT_POOL};
use gateway_durable_objects::registry::validate_name;
use serde_json::{json, Value};
use worker::{Env, Method, Request, Response};

/// Dispatches an authenticated admin request.
pub async fn handle(mut req: Request, env: &Env, segments: &[&str]) -> Result<Response, ApiError> {
    match (req.method(), segments) {
        (Method::Post, ["backends"]) => {
            let text = req.text().await.map_err(|_| ApiError::bad_request("request body is not valid UTF-8"))?;
            let reg: BackendRegistration = serde_json::from_str(&text)
                .map_err(|e| ApiError::bad_request(format!("invalid backend registration: {e}")))?;
            let pool = reg.pool.clone().unwrap_or_else(|| DEFAULT_POOL.to_string());
            validate_name("pool", &pool)?;
            let region = reg.region.clone().unwrap_or_default();
            let stub = pool_stub(env, &pool)?;
            let mut resp = call(&stub, Method::Post, "/backends", Some(text)).await?;
            if resp.status_code() != 201 {
                return Err(error_from_response(&mut resp).await);
            }
            remember_pool(env, &PoolEntry { name: pool, region }).await?;
            Ok(resp)
        }
        (Method::Get, ["backends"]) => {
            let mut all = Vec::new();
            for pool in list_pools(env).await? {
                let mut resp = call(&pool_stub(env, &pool.name)?, Method::Get, "/backends", None).await?;
                let listing: Value = resp.json().await.map_err(ApiError::from_worker)?;
                if let Some(items) = listing.get("data").and_then(Value::as_array) {
                    for item in items {
                        let mut item = item.clone();
                        item["pool"] = json!(pool.name);
                        all.push(item);
                    }
                }
            }
            Response::from_json(&json!({ "object": "list", "data": all })).map_err(ApiError::from_worker)
        }
        (Method::Get, ["pools"]) => {
            let pools = list_pools(env).await?;
            Response::from_json(&json!({ "object": "list", "data": pools })).map_err(ApiError::from_worker)
        }
        (Method::Get, ["pools", pool]) => {
            validate_name("pool", pool)?;
            call(&pool_stub(env, pool)?, Method::Get, "/state", None).await
        }
        (_, ["backends"] | ["pools"] | ["pools", _]) => Err(ApiError::method_not_allowed(&req.method().to_string(), &req.path())),
        _ => Err(ApiError::not_found(format!("no admin route {}", req.path()))),
    }
}
