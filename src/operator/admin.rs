//! The admin API under `/admin`: backends, pools and client keys.
//!
//! Every route requires `Authorization: Bearer <ADMIN_TOKEN>` (checked by the caller). The Worker
//! validates the envelope (JSON, names), keeps the pool directory up to date, and relays each call
//! to the pool's coordinator, which validates the rest and owns the data.
//!
//! A pool of several coordinator shards gets every change on every shard (the other shards first,
//! shard 0 last, whose answer is returned). A shard that fails does not stop the others: the answer
//! is then 502 `shards_incomplete` naming the shards that failed, and every change is safe to
//! repeat (a settings `PUT` and a backend `PATCH` set the same state again; a registration or a
//! delete a shard already carried out counts as done there), so the operator re-runs it; reads come from shard 0 with the requests in flight,
//! queues and counters of the other shards added (`PoolSummary::add_shard`,
//! `AdminBackend::add_shard`).
//!
//! | route | what it does |
//! |---|---|
//! | `POST /admin/backends` | register a backend (`pool` in the body, default `default`) |
//! | `GET /admin/backends` | every backend of every pool |
//! | `GET/PATCH/DELETE /admin/backends/{id}` | inspect, change (weight, models, `drain`), remove (drains first unless `?force=true`) |
//! | `GET /admin/pools` | every pool with its summary |
//! | `GET/PUT /admin/pools/{pool}` | a pool's summary and settings; change policy and knobs (merged: see below) |
//! | `POST /admin/pools/{pool}/probe` | probe the pool's backends now |
//! | `GET /admin/pools/{pool}/history` | the pool's last hour, minute by minute (the dashboard's charts) |
//! | `POST/GET /admin/keys`, `PATCH/DELETE /admin/keys/{id}` | client API keys (shown once, stored hashed) and their admission `priority` |
//!
//! `PUT /admin/pools/{pool}` merges: the knobs sent replace those in effect, nested objects key by
//! key, and every knob not sent is kept (`region`, `location_hint`, `shards`, `jurisdiction` and
//! `residency` included), so `{"shards": 4}` changes the shard count and nothing else. Residency
//! is lifted only on purpose: `"jurisdiction": null` / `"residency": null` remove them, and an
//! empty value (`""`, `[]`) where one is set is refused with 400 naming the field.

use crate::clients::keys::invalidate;
use crate::platform::auth::hash_key;
use crate::platform::do_client::{
    call, call_raw, error_from_response, list_pools, remember_pool, To,
};
use crate::platform::http::{random_hex, read_body_limited, var_or};
use coordinator_protocol::call::{
    DeleteBackend, DeleteKey, GetConfig, History, ListBackends, ListKeys, PatchBackend, PatchKey,
    ProbeNow, ShowBackend, Summary,
};
use coordinator_protocol::messages::{
    AdminBackend, AdminPatch, BackendRegistration, DeleteAnswer, KeyPatch, PoolDetail, PoolEntry,
    PoolSummary, StoredKey, DEFAULT_POOL,
};
use coordinator_protocol::registration::host_is_ip;
use coordinator_protocol::settings::{validate_name, validate_residency, PoolSettings};
use coordinator_protocol::ApiError;
use coordinator_protocol::Call;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use worker::{Env, Method, Request, Response};

type AdminResult = Result<Response, ApiError>;

fn json_ok<T: Serialize>(value: &T) -> AdminResult {
    Ok(Response::from_json(value)?)
}

/// `{"object": "list", "data": [...]}`.
#[derive(Serialize)]
struct List<T> {
    object: &'static str,
    data: Vec<T>,
}

fn list<T>(data: Vec<T>) -> List<T> {
    List {
        object: "list",
        data,
    }
}

/// A key as listings show it (never its hash).
#[derive(Serialize)]
struct KeyListing {
    id: String,
    name: String,
    created_ms: u64,
    priority: i32,
    residency: Vec<String>,
}

/// A freshly minted key: the only time the key itself is shown.
#[derive(Serialize)]
struct MintedKey {
    id: String,
    name: String,
    key: String,
    created_ms: u64,
    priority: i32,
    residency: Vec<String>,
}

/// Parses an admin body as `T` (400 naming `what` when it is not one).
fn parse<T: DeserializeOwned>(text: &str, what: &str) -> Result<T, ApiError> {
    serde_json::from_str(text).map_err(|e| ApiError::invalid_body(what, e))
}

fn validate_pool_name(name: &str) -> Result<(), ApiError> {
    validate_name("pool", name)
}

/// Largest admin request body: registrations and settings are small.
const MAX_ADMIN_BODY_BYTES: usize = 64 * 1024;

/// Reads an admin body: at most 64 KiB (413 beyond) of strict UTF-8 (400 otherwise; workerd's
/// `text()` would silently replace bad bytes).
async fn body_text(req: &mut Request) -> Result<String, ApiError> {
    let bytes = read_body_limited(req, MAX_ADMIN_BODY_BYTES).await?;
    String::from_utf8(bytes).map_err(|_| ApiError::bad_request("request body is not valid UTF-8"))
}

/// Relays a pool's answer, turning its error answers into `ApiError`s.
async fn relay(resp: Response) -> AdminResult {
    if resp.status_code() >= 400 {
        return Err(error_from_response(resp).await);
    }
    Ok(resp)
}

/// Dispatches an authenticated admin request. After any change the isolate's model list is
/// forgotten (`crate::operator::models`), so this isolate lists the change at once.
pub async fn handle(req: Request, env: &Env, segments: &[&str]) -> AdminResult {
    let change = req.method() != Method::Get;
    let answer = route(req, env, segments).await;
    if change {
        crate::operator::models::forget();
    }
    answer
}

/// Routes an admin request.
async fn route(mut req: Request, env: &Env, segments: &[&str]) -> AdminResult {
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
            let reg: BackendRegistration = parse(&text, "backend registration")?;
            let pool = reg.pool.clone().unwrap_or_else(|| DEFAULT_POOL.to_string());
            validate_pool_name(&pool)?;
            require_reachable_url(env, &reg.url)?;
            let shards = shard_count(env, &pool).await?;
            let resp = register_on_every_shard(env, &pool, shards, &reg).await;
            // The directory lists the pool once it holds a backend. A pool it does not list that
            // refused the registration is asked whether it holds backends: a directory that lost
            // the pool (local state kept across the v3 rename of its class: under wrangler dev
            // the renamed class started empty) finds them again.
            let listed = list_pools(env).await?.iter().any(|p| p.name == pool);
            if !listed && (resp.is_ok() || holds_backends(env, &pool).await) {
                remember_pool(
                    env,
                    &PoolEntry {
                        name: pool,
                        region: reg.region.unwrap_or_default(),
                        location_hint: None,
                        shards: 1,
                        shard_objects: 1,
                        jurisdiction: String::new(),
                        residency: Vec::new(),
                        card: None,
                    },
                )
                .await?;
            }
            resp
        }
        (Method::Get, ["backends"]) => {
            let mut all = Vec::new();
            for pool in list_pools(env).await? {
                let mut listing = call(env, To::Pool(&pool.name, 0), &ListBackends).await?;
                for k in 1..pool.all_shards() {
                    let other = call(env, To::Pool(&pool.name, k), &ListBackends).await?;
                    add_shard_backends(&mut listing.data, &other.data);
                }
                all.extend(listing.data);
            }
            json_ok(&list(all))
        }
        (Method::Get | Method::Patch | Method::Delete, ["backends", id]) => {
            validate_name("id", id)?;
            let pool = find_backend(env, id, query_pool.as_deref()).await?;
            let shards = shard_count(env, &pool).await?;
            let id = id.to_string();
            match method {
                Method::Patch => {
                    // Checked here, forwarded as written: a patch tells an absent `api_key` from
                    // a `null` one, which re-encoding would lose.
                    let text = body_text(&mut req).await?;
                    let patch: AdminPatch = parse(&text, "backend patch")?;
                    if let Some(url) = &patch.patch.url {
                        require_reachable_url(env, url)?;
                    }
                    // A drained or re-addressed backend gets nothing sent ahead from now on by
                    // this isolate (the others hear it from the next grant's roster number).
                    crate::request::ahead::forget_backend(&pool, &id);
                    let patch = PatchBackend { id, json: text };
                    to_every_shard(env, &pool, shards, &patch).await
                }
                Method::Delete => {
                    // Issue 42, item 11: nothing more goes ahead to it from the moment of deletion.
                    crate::request::ahead::forget_backend(&pool, &id);
                    let delete = DeleteBackend { id, force };
                    delete_on_every_shard(env, &pool, shards, &delete).await
                }
                _ => {
                    let show = ShowBackend(id);
                    let mut view: AdminBackend = call(env, To::Pool(&pool, 0), &show).await?;
                    for k in 1..shards {
                        if let Ok(other) = call(env, To::Pool(&pool, k), &show).await {
                            view.add_shard(&other);
                        }
                    }
                    json_ok(&view)
                }
            }
        }
        (Method::Get, ["pools"]) => {
            let mut data = Vec::new();
            for pool in list_pools(env).await? {
                let mut state = pool_summary(env, &pool.name, pool.all_shards()).await?;
                // A pool created by a registration has its region in the directory (which routing
                // reads) until a PUT sets it in the pool's settings too.
                if state.region.is_empty() {
                    state.region = pool.region;
                }
                state.jurisdiction = pool.jurisdiction;
                state.time_card = pool.card;
                data.push(state);
            }
            json_ok(&list(data))
        }
        (Method::Get, ["pools", pool]) => {
            validate_pool_name(pool)?;
            let Some(entry) = list_pools(env).await?.into_iter().find(|p| p.name == *pool) else {
                return Err(ApiError::not_found(format!("no pool `{pool}`")));
            };
            let mut summary = pool_summary(env, pool, entry.all_shards()).await?;
            summary.jurisdiction = entry.jurisdiction;
            summary.time_card = entry.card;
            let config = call(env, To::Pool(pool, 0), &GetConfig).await?;
            json_ok(&PoolDetail { summary, config })
        }
        (Method::Put, ["pools", pool]) => {
            validate_pool_name(pool)?;
            let text = body_text(&mut req).await?;
            // Merged onto the settings in effect, so a partial body keeps every knob it does not
            // name, residency included (`PoolSettings::merge_strict`). A pool the directory does
            // not list yet starts from the defaults, and is not called before its entry (and
            // location hint) is recorded.
            let listed = list_pools(env).await?.into_iter().find(|p| p.name == *pool);
            let current = match &listed {
                Some(entry) => call(env, To::Pool(pool, 0), &GetConfig)
                    .await?
                    .in_effect(entry),
                None => PoolSettings::default(),
            };
            let settings = current.merge_strict(&text)?;
            settings.validate()?;
            let old_shards = listed.as_ref().map_or(1, PoolEntry::all_shards);
            let entry = PoolEntry {
                name: pool.to_string(),
                region: settings.routing.region.clone(),
                location_hint: settings.location_hint.clone(),
                shards: settings.routing.shards,
                shard_objects: old_shards.max(settings.routing.shards),
                jurisdiction: settings.jurisdiction.clone(),
                residency: settings.residency.clone(),
                card: None,
            };
            // A Durable Object stays where it was created, near the first call or at the location
            // hint that call carries: record the hint first, so a new pool's first call has it.
            remember_pool(env, &entry).await?;
            list_pools(env).await?;
            // Every shard, those a smaller count retires included (they learn they are retired
            // and report to the others until their leases end); shard 0 last, which then brings
            // the other shards' registries in line with its own.
            relay(to_every_shard(env, pool, entry.shard_objects, &settings).await?).await
        }
        (Method::Post, ["pools", pool, "probe"]) => {
            validate_pool_name(pool)?;
            relay(call_raw(env, To::Pool(pool, 0), &ProbeNow).await?).await
        }
        (Method::Get, ["pools", pool, "history"]) => {
            validate_pool_name(pool)?;
            if !list_pools(env).await?.iter().any(|p| p.name == *pool) {
                return Err(ApiError::not_found(format!("no pool `{pool}`")));
            }
            relay(call_raw(env, To::Pool(pool, 0), &History).await?).await
        }
        (Method::Post, ["keys"]) => mint_key(&mut req, env).await,
        (Method::Get, ["keys"]) => {
            let keys = call(env, To::Directory, &ListKeys).await?;
            let data: Vec<KeyListing> = keys
                .into_iter()
                .filter(|k| !crate::clients::keys::is_seal(k))
                .map(|k| KeyListing {
                    id: k.id,
                    name: k.name,
                    created_ms: k.created_ms,
                    priority: k.priority,
                    residency: k.residency,
                })
                .collect();
            json_ok(&list(data))
        }
        (Method::Patch, ["keys", id]) => {
            validate_name("id", id)?;
            let text = body_text(&mut req).await?;
            let patch: KeyPatch = parse(&text, "key patch")?;
            if let Some(p) = patch.priority {
                crate::request::admission::validate_priority(p)?;
            }
            if let Some(r) = &patch.residency {
                validate_residency(r)?;
            }
            let patch = PatchKey {
                id: id.to_string(),
                patch,
            };
            let v = call(env, To::Directory, &patch).await?;
            invalidate();
            json_ok(&v)
        }
        (Method::Delete, ["keys", id]) => {
            validate_name("id", id)?;
            let v = call(env, To::Directory, &DeleteKey(id.to_string())).await?;
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

/// How many coordinator shard objects, current and retired, the directory says `pool` has (1 for
/// a pool it does not know).
async fn shard_count(env: &Env, pool: &str) -> Result<u32, ApiError> {
    Ok(list_pools(env)
        .await?
        .iter()
        .find(|p| p.name == pool)
        .map_or(1, PoolEntry::all_shards))
}

/// What one shard made of an admin change: its answer, or why it has none.
type ShardAnswer = (u32, Result<Response, ApiError>);

/// Sends an admin change to every shard of `pool`: shards `1..shards`, then shard 0 (which then
/// brings the others' registries in line with its own). A shard that fails does not stop the
/// others; each shard's answer comes back, shard 0's last.
async fn fan_out<M: Call>(env: &Env, pool: &str, shards: u32, change: &M) -> Vec<ShardAnswer> {
    let mut answers = Vec::new();
    for k in (1..shards).chain([0]) {
        let answer = match call_raw(env, To::Pool(pool, k), change).await {
            Ok(resp) => relay(resp).await,
            Err(e) => Err(e),
        };
        answers.push((k, answer));
    }
    answers
}

/// The one answer of a change every shard was sent: shard 0's when every shard took it, or when
/// every shard refused it as a request error (the same validation runs on each); otherwise 502
/// `shards_incomplete` naming each shard that failed and its error, so the operator re-runs the
/// call (each admin change is safe to repeat).
fn one_answer(pool: &str, answers: Vec<ShardAnswer>) -> AdminResult {
    let failed: Vec<(u32, String)> = answers
        .iter()
        .filter_map(|(k, a)| a.as_ref().err().map(|e| (*k, e)))
        .map(|(k, e)| (k, format!("{} {}", e.status, e.message)))
        .collect();
    let all_refused = failed.len() == answers.len()
        && answers
            .iter()
            .all(|(_, a)| a.as_ref().is_err_and(|e| e.status < 500));
    if failed.is_empty() || all_refused {
        return answers
            .into_iter()
            .find(|(k, _)| *k == 0)
            .map_or_else(|| Err(ApiError::internal("no shard answered")), |(_, a)| a);
    }
    let mut done: Vec<String> = answers
        .iter()
        .filter(|(_, a)| a.is_ok())
        .map(|(k, _)| k.to_string())
        .collect();
    done.sort_unstable();
    let mut failed = failed;
    failed.sort_unstable();
    let shards: Vec<String> = failed.iter().map(|(k, _)| k.to_string()).collect();
    let why: Vec<String> = failed
        .iter()
        .map(|(k, e)| format!("shard {k}: {e}"))
        .collect();
    Err(ApiError::shards_incomplete(format!(
        "The change reached {} of the {} coordinator shards of pool `{pool}`: failed on shards [{}] ({}), \
         done on shards [{}]. The call is safe to repeat: send the same request again to complete it.",
        done.len(),
        answers.len(),
        shards.join(", "),
        why.join("; "),
        done.join(", "),
    )))
}

/// Sends an admin change to every shard of `pool` and gives its one answer ([`one_answer`]).
async fn to_every_shard<M: Call>(env: &Env, pool: &str, shards: u32, change: &M) -> AdminResult {
    one_answer(pool, fan_out(env, pool, shards, change).await)
}

/// A registration sent to every shard. A shard that already holds the very backend (same id,
/// URL, models, role, weight, region and key, the capacity aside, which probes refine: an earlier
/// run of this call got that far)
/// counts as done there, so repeating a registration that failed on some shards completes it;
/// when every shard already held it the answer stays 409.
async fn register_on_every_shard(
    env: &Env,
    pool: &str,
    shards: u32,
    reg: &BackendRegistration,
) -> AdminResult {
    let mut answers = fan_out(env, pool, shards, reg).await;
    let Ok(spec) = coordinator_protocol::registration::validate_registration(reg.clone()) else {
        return one_answer(pool, answers);
    };
    if !answers.iter().any(|(_, a)| a.is_ok()) {
        return one_answer(pool, answers);
    }
    let show = ShowBackend(spec.id.0.clone());
    for (k, answer) in answers.iter_mut() {
        if !answer.as_ref().is_err_and(|e| e.status == 409) {
            continue;
        }
        if let Ok(held) = call(env, To::Pool(pool, *k), &show).await {
            let v = &held.view;
            let same = v.url == spec.url
                && v.models == spec.models
                && v.role == spec.role
                && v.weight == spec.weight
                && v.region == spec.region
                && v.has_api_key == spec.api_key.is_some();
            if same {
                *answer = Ok(Response::from_json(&held.view)?.with_status(201));
            }
        }
    }
    one_answer(pool, answers)
}

/// `DELETE` on every shard: the backend is deleted when every shard removed it, else it drains
/// with the requests still in flight on all shards. A shard that no longer holds the backend (an
/// earlier run of this call removed it there) counts as deleted, so repeating a delete that
/// failed on some shards completes it; when no shard holds it the answer stays 404.
async fn delete_on_every_shard(
    env: &Env,
    pool: &str,
    shards: u32,
    delete: &DeleteBackend,
) -> AdminResult {
    let mut answers = Vec::new();
    for k in (1..shards).chain([0]) {
        answers.push((k, call(env, To::Pool(pool, k), delete).await));
    }
    let gone = |a: &Result<DeleteAnswer, ApiError>| a.as_ref().is_err_and(|e| e.status == 404);
    let some_held = answers.iter().any(|(_, a)| !gone(a));
    let mut total: Option<DeleteAnswer> = None;
    let mut each: Vec<ShardAnswer> = Vec::new();
    for (k, answer) in answers {
        let a = match answer {
            Ok(a) => a,
            Err(e) if e.status == 404 && some_held => DeleteAnswer {
                id: delete.id.clone(),
                deleted: true,
                status: None,
                leases_in_flight: None,
            },
            Err(e) => {
                each.push((k, Err(e)));
                continue;
            }
        };
        each.push((k, Ok(Response::empty()?)));
        total = Some(match total {
            None => a,
            Some(t) => DeleteAnswer {
                deleted: t.deleted && a.deleted,
                status: t.status.or(a.status),
                leases_in_flight: match (t.leases_in_flight, a.leases_in_flight) {
                    (None, None) => None,
                    (x, y) => Some(x.unwrap_or(0) + y.unwrap_or(0)),
                },
                ..a
            },
        });
    }
    if each.iter().any(|(_, a)| a.is_err()) {
        return one_answer(pool, each);
    }
    let total = total.ok_or_else(|| ApiError::internal("no shard answered"))?;
    let status = if total.deleted { 200 } else { 202 };
    Ok(Response::from_json(&total)?.with_status(status))
}

/// A pool's summary: shard 0's, with the other shards' load and counters added.
async fn pool_summary(env: &Env, pool: &str, shards: u32) -> Result<PoolSummary, ApiError> {
    let mut summary = call(env, To::Pool(pool, 0), &Summary).await?;
    for k in 1..shards {
        let other = call(env, To::Pool(pool, k), &Summary).await?;
        summary.add_shard(&other);
    }
    Ok(summary)
}

/// Adds another shard's requests in flight to a listing of the same pool's backends.
fn add_shard_backends(list: &mut [AdminBackend], other: &[AdminBackend]) {
    for b in list.iter_mut() {
        if let Some(o) = other.iter().find(|o| o.view.id == b.view.id) {
            b.add_shard(o);
        }
    }
}

/// Refuses a backend URL whose host is an IP address (a deployed Worker can only fetch hostnames)
/// unless the `ALLOW_IP_BACKENDS` var is `"true"`, as it is for local development and tests.
fn require_reachable_url(env: &Env, url: &str) -> Result<(), ApiError> {
    if !host_is_ip(url) || var_or(env, "ALLOW_IP_BACKENDS", false) {
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
        let list = call(env, To::Pool(&pool, 0), &ListBackends).await?;
        if list.data.iter().any(|b| b.view.id.0 == id) {
            return Ok(pool);
        }
        // The pool named by the hint is asked on every shard: a change that failed on some shards
        // (and is being repeated) may have left the backend on them only.
        if hint == Some(pool.as_str()) {
            for k in 1..shard_count(env, &pool).await? {
                if let Ok(list) = call(env, To::Pool(&pool, k), &ListBackends).await {
                    if list.data.iter().any(|b| b.view.id.0 == id) {
                        return Ok(pool);
                    }
                }
            }
        }
    }
    Err(ApiError::not_found(format!("no backend `{id}`")))
}

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct MintRequest {
    name: String,
    priority: i32,
    /// Jurisdictions the key's requests may be served in (empty: anywhere the pools allow).
    residency: Vec<String>,
}

/// `POST /admin/keys`: mints a client key, stores its hash, and shows the key this once.
async fn mint_key(req: &mut Request, env: &Env) -> AdminResult {
    let text = body_text(req).await?;
    let mint: MintRequest = if text.trim().is_empty() {
        MintRequest::default()
    } else {
        parse(&text, "key request")?
    };
    if mint.name.len() > 128 || mint.name.chars().any(char::is_control) {
        return Err(
            ApiError::bad_request("`name` must be at most 128 printable characters")
                .with_param("name"),
        );
    }
    crate::request::admission::validate_priority(mint.priority)?;
    validate_residency(&mint.residency)?;
    let key = format!("sk-gw-{}", random_hex(24));
    let stored = StoredKey {
        id: format!("key-{}", random_hex(6)),
        name: mint.name,
        hash: hash_key(&key),
        created_ms: crate::platform::http::now_ms(),
        priority: mint.priority,
        residency: mint.residency,
    };
    let stored = call(env, To::Directory, &stored).await?;
    invalidate();
    let minted = MintedKey {
        id: stored.id,
        name: stored.name,
        key,
        created_ms: stored.created_ms,
        priority: stored.priority,
        residency: stored.residency,
    };
    Ok(Response::from_json(&minted)?.with_status(201))
}

/// Whether the pool's shard 0 holds any backend (false when it cannot say).
async fn holds_backends(env: &Env, pool: &str) -> bool {
    call(env, To::Pool(pool, 0), &ListBackends)
        .await
        .is_ok_and(|list| !list.data.is_empty())
}
