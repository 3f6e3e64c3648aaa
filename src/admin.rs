//! The admin API under `/admin`: backends, pools and client keys.
//!
//! Every route requires `Authorization: Bearer <ADMIN_TOKEN>` (checked by the caller). The Worker
//! validates the envelope (JSON, names), keeps the pool directory up to date, and relays each call
//! to the pool's coordinator, which validates the rest and owns the data.
//!
//! | route | what it does |
//! |---|---|
//! | `POST /admin/backends` | register a backend (`pool` in the body, default `default`) |
//! | `GET /admin/backends` | every backend of every pool |
//! | `GET/PATCH/DELETE /admin/backends/{id}` | inspect, change (weight, models, `drain`), remove (drains first unless `?force=true`) |
//! | `GET /admin/pools` | every pool with its summary |
//! | `GET/PUT /admin/pools/{pool}` | a pool's summary and settings; change policy and knobs |
//! | `POST /admin/pools/{pool}/probe` | probe the pool's backends now |
//! | `GET /admin/pools/{pool}/history` | the pool's last hour, minute by minute (the dashboard's charts) |
//! | `POST/GET /admin/keys`, `PATCH/DELETE /admin/keys/{id}` | client API keys (shown once, stored hashed) and their admission `priority` |

use crate::keys::{hash_key, invalidate};
use crate::pools::{
    directory_json, error_from_response, list_pools, pool_call, pool_json, remember_pool,
};
use crate::ApiError;
use gateway_durable_objects::directory::{KeyPatch, StoredKey};
use gateway_durable_objects::pool_coordinator::{validate_pool_name, PoolSettings};
use gateway_durable_objects::protocol::{BackendRegistration, PoolEntry, DEFAULT_POOL};
use gateway_durable_objects::registry::{host_is_ip, validate_name};
use serde::Deserialize;
use serde_json::{json, Value};
use worker::{Date, Env, Method, Request, Response};

type AdminResult = Result<Response, ApiError>;

fn json_ok(value: &Value) -> AdminResult {
    Response::from_json(value).map_err(ApiError::from_worker)
}

/// Largest admin request body: registrations and settings are small.
const MAX_ADMIN_BODY_BYTES: usize = 64 * 1024;

/// Reads an admin body: at most 64 KiB (413 beyond) of strict UTF-8 (400 otherwise; workerd's
/// `text()` would silently replace bad bytes).
async fn body_text(req: &mut Request) -> Result<String, ApiError> {
    let bytes = crate::read_body_limited(req, MAX_ADMIN_BODY_BYTES).await?;
    String::from_utf8(bytes).map_err(|_| ApiError::bad_request("request body is not valid UTF-8"))
}

/// Relays a pool's answer, turning its error answers into `ApiError`s.
async fn relay(mut resp: Response) -> AdminResult {
    if resp.status_code() >= 400 {
        return Err(error_from_response(&mut resp).await);
    }
    Ok(resp)
}

/// Dispatches an authenticated admin request.
pub async fn handle(mut req: Request, env: &Env, segments: &[&str]) -> AdminResult {
    let method = req.method();
    let query_pool = req.url().ok().and_then(|u| {
        u.query_pairs()
            .find(|(k, _)| k == "pool")
            .map(|(_, v)| v.to_string())
    });
    let force = req
        .url()
        .map(|u| u.query_pairs().any(|(k, v)| k == "force" && v == "true"))
        .unwrap_or(false);
    match (method.clone(), segments) {
        (Method::Post, ["backends"]) => {
            let text = body_text(&mut req).await?;
            let reg: BackendRegistration = serde_json::from_str(&text)
                .map_err(|e| ApiError::bad_request(format!("invalid backend registration: {e}")))?;
            let pool = reg.pool.clone().unwrap_or_else(|| DEFAULT_POOL.to_string());
            validate_pool_name(&pool)?;
            require_reachable_url(env, &reg.url)?;
            let resp =
                relay(pool_call(env, &pool, Method::Post, "/backends", Some(text)).await?).await?;
            if !list_pools(env).await?.iter().any(|p| p.name == pool) {
                remember_pool(
                    env,
                    &PoolEntry {
                        name: pool,
                        region: reg.region.unwrap_or_default(),
                        location_hint: None,
                    },
                )
                .await?;
            }
            Ok(resp)
        }
        (Method::Get, ["backends"]) => {
            let mut all = Vec::new();
            for pool in list_pools(env).await? {
                let listing: Value =
                    pool_json(env, &pool.name, Method::Get, "/backends", None::<&()>).await?;
                all.extend(
                    listing
                        .get("data")
                        .and_then(Value::as_array)
                        .cloned()
                        .unwrap_or_default(),
                );
            }
            json_ok(&json!({ "object": "list", "data": all }))
        }
        (Method::Get | Method::Patch | Method::Delete, ["backends", id]) => {
            validate_name("id", id)?;
            let pool = find_backend(env, id, query_pool.as_deref()).await?;
            let path = if force {
                format!("/backends/{id}?force=true")
            } else {
                format!("/backends/{id}")
            };
            let body = if method == Method::Patch {
                Some(body_text(&mut req).await?)
            } else {
                None
            };
            let new_url = body
                .as_deref()
                .and_then(|b| serde_json::from_str::<Value>(b).ok())
                .and_then(|v| v.get("url")?.as_str().map(str::to_string));
            if let Some(url) = new_url {
                require_reachable_url(env, &url)?;
            }
            relay(pool_call(env, &pool, method, &path, body).await?).await
        }
        (Method::Get, ["pools"]) => {
            let mut data = Vec::new();
            for pool in list_pools(env).await? {
                let mut state: Value =
                    pool_json(env, &pool.name, Method::Get, "/state", None::<&()>).await?;
                // A pool created by a registration has its region in the directory (which routing
                // reads) until a PUT sets it in the pool's settings too.
                if state
                    .get("region")
                    .and_then(Value::as_str)
                    .is_none_or(str::is_empty)
                {
                    state["region"] = json!(pool.region);
                }
                data.push(state);
            }
            json_ok(&json!({ "object": "list", "data": data }))
        }
        (Method::Get, ["pools", pool]) => {
            validate_pool_name(pool)?;
            if !list_pools(env).await?.iter().any(|p| p.name == *pool) {
                return Err(ApiError::not_found(format!("no pool `{pool}`")));
            }
            let mut state: Value = pool_json(env, pool, Method::Get, "/state", None::<&()>).await?;
            let config: Value = pool_json(env, pool, Method::Get, "/config", None::<&()>).await?;
            state["config"] = config;
            json_ok(&state)
        }
        (Method::Put, ["pools", pool]) => {
            validate_pool_name(pool)?;
            let text = body_text(&mut req).await?;
            let settings: PoolSettings = serde_json::from_str(&text)
                .map_err(|e| ApiError::bad_request(format!("invalid pool configuration: {e}")))?;
            settings.validate()?;
            let entry = PoolEntry {
                name: pool.to_string(),
                region: settings.routing.region.clone(),
                location_hint: settings.location_hint.clone(),
            };
            // A Durable Object stays where it was created, near the first call or at the location
            // hint that call carries: record the hint first, so a new pool's first call has it.
            remember_pool(env, &entry).await?;
            list_pools(env).await?;
            let applied: Value =
                pool_json(env, pool, Method::Put, "/config", Some(&settings)).await?;
            json_ok(&applied)
        }
        (Method::Post, ["pools", pool, "probe"]) => {
            validate_pool_name(pool)?;
            relay(pool_call(env, pool, Method::Post, "/probe/now", None).await?).await
        }
        (Method::Get, ["pools", pool, "history"]) => {
            validate_pool_name(pool)?;
            if !list_pools(env).await?.iter().any(|p| p.name == *pool) {
                return Err(ApiError::not_found(format!("no pool `{pool}`")));
            }
            relay(pool_call(env, pool, Method::Get, "/history", None).await?).await
        }
        (Method::Post, ["keys"]) => mint_key(&mut req, env).await,
        (Method::Get, ["keys"]) => {
            let keys: Vec<StoredKey> =
                directory_json(env, Method::Get, "/keys", None::<&()>).await?;
            let data: Vec<Value> =
                keys.iter().map(|k| json!({ "id": k.id, "name": k.name, "created_ms": k.created_ms, "priority": k.priority })).collect();
            json_ok(&json!({ "object": "list", "data": data }))
        }
        (Method::Patch, ["keys", id]) => {
            validate_name("id", id)?;
            let text = body_text(&mut req).await?;
            let patch: KeyPatch = serde_json::from_str(&text)
                .map_err(|e| ApiError::bad_request(format!("invalid key patch: {e}")))?;
            if let Some(p) = patch.priority {
                crate::admission::validate_priority(p)?;
            }
            let v: Value =
                directory_json(env, Method::Patch, &format!("/keys/{id}"), Some(&patch)).await?;
            invalidate();
            json_ok(&v)
        }
        (Method::Delete, ["keys", id]) => {
            validate_name("id", id)?;
            let v: Value =
                directory_json(env, Method::Delete, &format!("/keys/{id}"), None::<&()>).await?;
            invalidate();
            json_ok(&v)
        }
        (
            _,
            ["backends"]
            | ["backends", _]
            | ["pools"]
            | ["pools", _]
            | ["pools", _, "probe"]
            | ["pools", _, "history"]
            | ["keys"]
            | ["keys", _],
        ) => Err(ApiError::method_not_allowed(method.as_ref(), &req.path())),
        _ => Err(ApiError::not_found(format!(
            "no admin route {}",
            req.path()
        ))),
    }
}

/// Refuses a backend URL whose host is an IP address (a deployed Worker can only fetch hostnames)
/// unless the `ALLOW_IP_BACKENDS` var is `"true"`, as it is for local development and tests.
fn require_reachable_url(env: &Env, url: &str) -> Result<(), ApiError> {
    if !host_is_ip(url) || crate::var_or(env, "ALLOW_IP_BACKENDS", false) {
        return Ok(());
    }
    Err(ApiError::bad_request(
        "invalid backend url: its host is an IP address, and a deployed Cloudflare Worker cannot fetch bare IP \
         addresses. Give the backend a DNS name (for a private GPU network, publish it through a Cloudflare Tunnel), \
         or set the ALLOW_IP_BACKENDS var to \"true\" for local development.",
    )
    .with_param("url")
    .with_code("ip_backend_not_allowed"))
}

/// The pool holding backend `id` (the `?pool=` hint is tried first).
async fn find_backend(env: &Env, id: &str, hint: Option<&str>) -> Result<String, ApiError> {
    let mut pools: Vec<String> = list_pools(env).await?.into_iter().map(|p| p.name).collect();
    if let Some(h) = hint {
        pools.retain(|p| p != h);
        pools.insert(0, h.to_string());
    }
    for pool in pools {
        let resp = pool_call(env, &pool, Method::Get, &format!("/backends/{id}"), None).await?;
        if resp.status_code() == 200 {
            return Ok(pool);
        }
    }
    Err(ApiError::not_found(format!("no backend `{id}`")))
}

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct MintRequest {
    name: String,
    priority: i32,
}

/// `POST /admin/keys`: mints a client key, stores its hash, and shows the key this once.
async fn mint_key(req: &mut Request, env: &Env) -> AdminResult {
    let text = body_text(req).await?;
    let mint: MintRequest = if text.trim().is_empty() {
        MintRequest::default()
    } else {
        serde_json::from_str(&text)
            .map_err(|e| ApiError::bad_request(format!("invalid key request: {e}")))?
    };
    if mint.name.len() > 128 || mint.name.chars().any(char::is_control) {
        return Err(
            ApiError::bad_request("`name` must be at most 128 printable characters")
                .with_param("name"),
        );
    }
    crate::admission::validate_priority(mint.priority)?;
    let key = format!("sk-gw-{}", crate::random_hex(24));
    let stored = StoredKey {
        id: format!("key-{}", crate::random_hex(6)),
        name: mint.name,
        hash: hash_key(&key),
        created_ms: Date::now().as_millis(),
        priority: mint.priority,
    };
    let _: StoredKey = directory_json(env, Method::Post, "/keys", Some(&stored)).await?;
    invalidate();
    Response::from_json(&json!({ "id": stored.id, "name": stored.name, "key": key, "created_ms": stored.created_ms, "priority": stored.priority }))
        .map(|r| r.with_status(201))
        .map_err(ApiError::from_worker)
}
