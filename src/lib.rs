//! The edge Worker: the OpenAI surface, the admin API, the metrics endpoint and the cron trigger.
//!
//! Handlers here are thin: they authenticate, parse, extract the request's routing features, ask
//! the nearest pool's Durable Object for a lease, and hand over to the streaming proxy. The routing
//! decisions live in `routing-core`, called by the pool coordinator in `durable-objects/`.

mod admin;
mod admission;
mod attempts;
mod auth;
mod dashboard;
mod do_client;
mod hop;
mod keys;
mod lease_guard;
mod metrics;
mod proxy;
mod regions;
mod relay;
mod releases;
mod resume;
mod settings;
mod upstream_body;

pub use coordinator_protocol::ApiError;
// Re-exported so the Durable Object classes are part of this Worker's wasm module.
pub use gateway_durable_objects::directory::GatewayDirectory;
pub use gateway_durable_objects::pool_coordinator::PoolCoordinator;
pub use gateway_durable_objects::rate_limiter::ClientRateLimiter;

use admission::Asked;
use coordinator_protocol::acquire::{AcquireBody, Granted};
use coordinator_protocol::call::{EnsureProbeAlarm, Models};
use coordinator_protocol::messages::PoolEntry;
use do_client::To;
use lease_guard::{GuardSetup, LeaseGuard};
use routing_core::endpoint::{endpoint_features, Endpoint};
use routing_core::lease::LeaseTerms;
use routing_core::region::walk::{Ask, PoolAnswer, PoolWalk, Verdict, WalkEnd};
use routing_core::region::ChoiceNote;
use routing_core::shard::shard_of_request;
use serde_json::{json, Value};
use wasm_bindgen::JsCast;
use worker::*;

#[event(fetch)]
async fn fetch(req: Request, env: Env, ctx: Context) -> Result<Response> {
    let request_id = request_id(&req);
    let path = req.path();
    let result = route(req, &env, &ctx, &request_id).await;
    let resp = match result {
        Ok(resp) => resp,
        Err(e) => {
            // Proxied requests log when their stream ends; refusals log here, one line each.
            let line = json!({ "event": "request", "request_id": request_id, "path": path, "status": e.status, "error": e.code });
            console_log!("{line}");
            e.to_response()?
        }
    };
    // The proxy sets the id on its responses itself.
    if resp.headers().get("x-request-id").ok().flatten().as_deref() == Some(&request_id) {
        return Ok(resp);
    }
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
    match do_client::list_pools(&env).await {
        Ok(list) => {
            for pool in list {
                if let Err(e) =
                    do_client::call(&env, To::Pool(&pool.name, 0), &EnsureProbeAlarm).await
                {
                    console_error!("cron: pool {}: {e}", pool.name);
                }
            }
        }
        Err(e) => console_error!("cron: cannot list pools: {e}"),
    }
}

/// The client's `x-request-id` when it is safe to echo (printable ASCII, no separators that
/// could split a header or a log line), otherwise a fresh one.
fn request_id(req: &Request) -> String {
    let given = req.headers().get("x-request-id").ok().flatten();
    match given {
        Some(id)
            if !id.is_empty()
                && id.len() <= 128
                && id
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.:@/+=".contains(&b)) =>
        {
            id
        }
        _ => "req-".to_string() + &random_hex(12),
    }
}

/// `n` random bytes from the platform's CSPRNG, hex-encoded.
pub(crate) fn random_hex(n: usize) -> String {
    thread_local! {
        // The global `crypto`, looked up once per isolate.
        static CRYPTO: Option<web_sys::Crypto> = js_sys::Reflect::get(&js_sys::global(), &"crypto".into())
            .ok()
            .and_then(|c| c.dyn_into::<web_sys::Crypto>().ok());
    }
    let mut bytes = vec![0u8; n];
    let filled = CRYPTO.with(|c| {
        c.as_ref()
            .is_some_and(|c| c.get_random_values_with_u8_array(&mut bytes).is_ok())
    });
    if !filled {
        // workerd always has crypto; this only keeps ids unique if it somehow does not.
        let t = (Date::now().as_millis() ^ (js_sys::Math::random() * 1e15) as u64).to_le_bytes();
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = t[i % 8].wrapping_add(i as u8);
        }
    }
    hex(&bytes)
}

/// Lower-case hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(2 * bytes.len());
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 15)]));
    }
    out
}

async fn route(
    req: Request,
    env: &Env,
    ctx: &Context,
    request_id: &str,
) -> std::result::Result<Response, ApiError> {
    let path = req.path();
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let method = req.method();
    match segments.as_slice() {
        ["healthz"] => match method {
            Method::Get | Method::Head => Ok(Response::from_json(
                &json!({ "status": "ok", "version": env!("CARGO_PKG_VERSION") }),
            )?),
            m => Err(ApiError::method_not_allowed(m.as_ref(), &path)),
        },
        ["metrics"] => {
            if method != Method::Get {
                return Err(ApiError::method_not_allowed(method.as_ref(), &path));
            }
            auth::require_metrics(&req, env)?;
            metrics::handle(env).await
        }
        ["dashboard", rest @ ..] => dashboard::serve(&method, &path, rest),
        ["admin", rest @ ..] => {
            auth::require_admin(&req, env)?;
            admin::handle(req, env, rest).await
        }
        ["v1", "models"] => {
            if method != Method::Get {
                return Err(ApiError::method_not_allowed(method.as_ref(), &path));
            }
            keys::require_client(&req, env, ctx).await?;
            list_models(env).await
        }
        ["v1", "chat", "completions"] => {
            completion(req, env, ctx, Endpoint::Chat, request_id).await
        }
        ["v1", "completions"] => completion(req, env, ctx, Endpoint::Completions, request_id).await,
        ["v1", "embeddings"] => completion(req, env, ctx, Endpoint::Embeddings, request_id).await,
        _ => Err(ApiError::not_found(format!("Unknown route {path}."))),
    }
}

/// A `wrangler.toml` var parsed as `T`, or `default` when unset or unparsable.
pub(crate) fn var_or<T: std::str::FromStr>(env: &Env, name: &str, default: T) -> T {
    env.var(name)
        .ok()
        .and_then(|v| v.to_string().parse().ok())
        .unwrap_or(default)
}

/// Reads the body, refusing it (413) past `limit` bytes (declared or actual). At most `limit`
/// bytes ever enter wasm; an oversize body is drained on the JS side (for a few seconds at most)
/// before the 413, so the client, still sending, reads the answer instead of a reset connection.
pub(crate) async fn read_body_limited(
    req: &mut Request,
    limit: usize,
) -> std::result::Result<Vec<u8>, ApiError> {
    use futures_util::StreamExt;
    let declared: Option<usize> = req
        .headers()
        .get("content-length")
        .ok()
        .flatten()
        .and_then(|v| v.parse().ok());
    if declared.is_some_and(|n| n > limit) {
        discard_body(req).await;
        return Err(ApiError::payload_too_large(limit));
    }
    // A body of declared length (framed by it, so it cannot grow) is read in one call.
    let chunked = req.headers().has("transfer-encoding").unwrap_or(true);
    if declared.is_some() && !chunked {
        let unreadable = |_| ApiError::bad_request("unreadable request body");
        let read = req.inner().array_buffer().map_err(unreadable)?;
        let buffer = wasm_bindgen_futures::JsFuture::from(read)
            .await
            .map_err(unreadable)?;
        let bytes = js_sys::Uint8Array::new(&buffer);
        if bytes.length() as usize > limit {
            return Err(ApiError::payload_too_large(limit));
        }
        return Ok(bytes.to_vec());
    }
    let mut body = Vec::with_capacity(declared.unwrap_or(0).min(limit));
    let Ok(mut stream) = req.stream() else {
        return Ok(body);
    };
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|_| ApiError::bad_request("unreadable request body"))?;
        if body.len() + chunk.len() > limit {
            return Err(ApiError::payload_too_large(limit));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// Reads and drops the request body in JS (no wasm copies), for at most 5 seconds.
async fn discard_body(req: &Request) {
    let (Some(body), Ok(sink)) = (req.inner().body(), web_sys::WritableStream::new()) else {
        return;
    };
    let drained = wasm_bindgen_futures::JsFuture::from(body.pipe_to(&sink));
    let _ =
        coordinator_protocol::timed_fetch::with_timeout(drained, std::time::Duration::from_secs(5))
            .await;
}

async fn completion(
    mut req: Request,
    env: &Env,
    ctx: &Context,
    endpoint: Endpoint,
    request_id: &str,
) -> std::result::Result<Response, ApiError> {
    if req.method() != Method::Post {
        return Err(ApiError::method_not_allowed(
            req.method().as_ref(),
            endpoint.path(),
        ));
    }
    let settings = settings::settings(env);
    // A request the edge Worker handed over (regional role only): keys, limits and the pool
    // order were decided there.
    let hop_in = hop::incoming(&req, env)?;
    let key = match hop_in {
        Some(_) => None,
        None => keys::identify(&req, env, ctx).await?,
    };
    let client = key.as_ref().map(|k| k.hash.clone());
    let who = match &hop_in {
        Some(h) => h.who.clone(),
        None => admission::admission_request(&req, key.as_ref(), &admission::tenant_salt(env))?,
    };
    let body = read_body_limited(&mut req, settings.max_body_bytes).await?;
    let parsed: Value = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("request body is not valid JSON: {e}")))?;
    if !parsed.is_object() {
        return Err(ApiError::bad_request("request body must be a JSON object"));
    }
    let headers = req.headers().clone();
    let header = move |name: &str| headers.get(name).ok().flatten();
    let mut features =
        endpoint_features(endpoint, &parsed, &header, &settings.features).map_err(|e| {
            let err = ApiError::bad_request(e.to_string()).with_code(e.code());
            match e.param() {
                Some(p) => err.with_param(p),
                None => err,
            }
        })?;
    features.request_id = request_id.to_string();
    let reservation = match (&hop_in, &client) {
        (Some(h), _) => h.reservation.clone(),
        (None, Some(client)) => {
            keys::reserve(
                env,
                client,
                u64::from(features.prompt_tokens) + u64::from(features.max_tokens),
            )
            .await?
        }
        (None, None) => None,
    };
    let stream = features.stream;
    // Streams report usage only when asked: ask, and take the event out again if the client didn't.
    let (body, strip_usage_event) = match (&hop_in, stream && endpoint != Endpoint::Embeddings) {
        (Some(h), _) => (body, h.strip_usage_event),
        (None, true) => ask_for_usage(parsed, body)?,
        (None, false) => (body, false),
    };
    let client_signal: AbortSignal = req.inner().signal().into();
    let hung_up = lease_guard::hang_up(&client_signal);
    let started = Date::now().as_millis();
    let planned = match &hop_in {
        Some(h) => Ok(h.plan()),
        None => {
            let listed = do_client::list_pools_cached(env, ctx).await?;
            regions::plan(&req, env, &settings, listed, &features, started)
        }
    };
    let mut plan = match planned {
        Ok(plan) => plan,
        Err(e) => {
            refund(ctx, env, reservation);
            return Err(e);
        }
    };
    // The edge hands the request to the chosen pool's regional Worker when one is bound.
    if hop_in.is_none() {
        if let Some(regional) = hop::regional_for(env, &plan) {
            let handoff = hop::Handoff {
                client: &req,
                env,
                plan: &plan,
                who: &who,
                reservation: reservation.as_ref(),
                request_id,
                strip_usage_event,
                body: &body,
            };
            if let Some(answer) = regional.hand_over(handoff, &features).await {
                return answer;
            }
        }
    }
    // The region the Worker runs in, for the modelled network: the client's at the edge, the
    // pool's region at a regional Worker.
    let simulate_from = match &hop_in {
        Some(h) => Some(h.region.clone()),
        None => plan.client_region.clone(),
    };
    let mut simulated_waits = 0u32;
    let first_pool = plan.pools.first().map(|p| p.name.clone());
    let reason_for = |pool: &PoolEntry| -> &'static str {
        match first_pool.as_deref() == Some(pool.name.as_str()) {
            true => plan.reason.as_str(),
            false => "spill",
        }
    };
    let pools = std::mem::take(&mut plan.pools);
    // Nearest first, spilling over, back to the nearest full pool's queue or the nearest
    // saturated pool when nothing further has room (`routing_core::region::walk`).
    let mut walk = PoolWalk::new(pools.len(), plan.excluded > 0);
    // Serialised once, whichever pools are asked and however often a queued request asks again.
    let mut acquire_body = AcquireBody::new(&features);
    while let Some(Ask { pool, spill_ok, .. }) = walk.next_pool() {
        let pool = &pools[pool];
        // The pool's coordinator shard for this request: by its key, else its first prefix block.
        let shard = shard_of_request(pool.shards, &features);
        let pool_choice = reason_for(pool);
        let note = ChoiceNote {
            reason: pool_choice.to_string(),
            cross_region: plan.cross_region(pool),
        };
        acquire_body.set_choice(&note);
        let network_delay_ms = regions::simulated_rtt_ms(env, simulate_from.as_deref(), pool);
        let asked_ms = Date::now().as_millis();
        if network_delay_ms > 0 {
            simulated_waits += 1;
            Delay::from(std::time::Duration::from_millis(network_delay_ms)).await;
        }
        let admitted = admission::acquire(
            env,
            ctx,
            &hung_up,
            &pool.name,
            shard,
            spill_ok,
            &acquire_body,
            &who,
        );
        match admitted.await {
            Asked::Granted(Granted { grant, queued_ms }) => {
                let disaggregated = !grant.decode_candidates.is_empty();
                let now = Date::now().as_millis();
                if queued_ms == 0 {
                    let rtt = now.saturating_sub(asked_ms);
                    regions::observe_rtt(env, plan.client_region.as_deref(), &pool.name, rtt);
                }
                if let Some(card) = &grant.card {
                    regions::fresh_card(&pool.name, card);
                }
                let card = grant.card.as_deref().or(pool.card.as_ref());
                regions::served(env, &pool.name, card, &features, grant.lease_id, now);
                let mut extra = vec![("x-gateway-pool-choice", pool_choice.to_string())];
                // The prediction is the planned first pool's, not a spill's.
                if let (Some(ms), false) = (plan.predicted_ms, pool_choice == "spill") {
                    extra.push(("x-gateway-pool-predicted-ms", ms.to_string()));
                }
                if queued_ms > 0 {
                    extra.push((
                        coordinator_protocol::messages::QUEUE_WAIT_HEADER,
                        queued_ms.to_string(),
                    ));
                }
                if regions::simulating(env) {
                    // The proxy waits once more, before the backend fetch.
                    let waits = simulated_waits + u32::from(network_delay_ms > 0);
                    extra.push((hop::SIMULATED_WAITS_HEADER, waits.to_string()));
                }
                let route_ms = now.saturating_sub(started);
                let guard = LeaseGuard::start(GuardSetup {
                    env,
                    ctx,
                    pool: pool.name.clone(),
                    shard,
                    lease_id: grant.lease_id,
                    terms: LeaseTerms {
                        backend: grant.backend.clone(),
                        prompt_tokens: features.prompt_tokens,
                        max_tokens: features.max_tokens,
                        stream,
                        request_id: request_id.to_string(),
                    },
                    hung_up: &hung_up,
                    renew_every: renew_interval(grant.deadline_ms.saturating_sub(now)),
                    pool_choice,
                    reservation,
                });
                let forward = proxy::Forward {
                    client: &req,
                    env,
                    ctx,
                    pool: pool.name.clone(),
                    shard,
                    grant,
                    guard,
                    path: endpoint.path(),
                    body,
                    stream,
                    model: features.model.clone(),
                    block_hashes: features.block_hashes.clone(),
                    strip_usage_event,
                    request_id,
                    settings: settings.proxy,
                    prefill_backend: None,
                    routing_header: settings.features.routing_header.clone(),
                    route_ms,
                    extra_headers: extra,
                    network_delay_ms,
                };
                let resp = if disaggregated {
                    forward.run_disaggregated().await?
                } else {
                    forward.run().await?
                };
                return Ok(resp);
            }
            // The client left: the pool was told.
            Asked::HungUp => {
                refund(ctx, env, reservation);
                return Err(ApiError::client_closed());
            }
            Asked::Refused(refusal) => {
                if let Verdict::Stop(refusal) = walk.feed(PoolAnswer::Refused(refusal)) {
                    refund(ctx, env, reservation);
                    return Err(refusal.into());
                }
            }
            // The pool's object failed: the next pool may still serve the request.
            Asked::Failed(e) => {
                console_error!("pool {} failed to answer an acquire: {e}", pool.name);
                walk.feed(PoolAnswer::Failed);
            }
        }
    }
    refund(ctx, env, reservation);
    Err(match walk.end() {
        WalkEnd::Refused(refusal) => refusal.into(),
        WalkEnd::NotServed => ApiError::model_not_found(&features.model),
        WalkEnd::NoAnswer => ApiError::unavailable("No pool could take the request now.", 1),
        // A restricted request never leaves its jurisdictions: say so when none of them took it.
        WalkEnd::Residency => regions::residency_error(&plan.allowed),
    })
}

/// Gives back a token reservation of a request no pool took.
fn refund(ctx: &Context, env: &Env, reservation: Option<keys::Reservation>) {
    if let Some(r) = reservation {
        let env = env.clone();
        ctx.wait_until(async move { keys::settle(&env, &r, 0).await });
    }
}

/// How often a live request renews its lease: three times per lease period, so one lost renewal
/// never lets it expire.
fn renew_interval(ttl_ms: u64) -> std::time::Duration {
    std::time::Duration::from_millis((ttl_ms / 3).clamp(300, 20_000))
}

/// Makes a streamed request ask for the usage event (`stream_options.include_usage`). Returns the
/// body to send upstream and whether the event must be taken out again (the client did not ask).
/// vLLM's `continuous_usage_stats` only applies with `include_usage`, so a client that set it
/// without asking for usage gets neither, as before.
fn ask_for_usage(
    mut parsed: Value,
    body: Vec<u8>,
) -> std::result::Result<(Vec<u8>, bool), ApiError> {
    let asked = parsed
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        == Some(true);
    if asked {
        return Ok((body, false));
    }
    let Some(obj) = parsed.as_object_mut() else {
        return Ok((body, false));
    };
    let options = obj.entry("stream_options").or_insert_with(|| json!({}));
    if !options.is_object() {
        *options = json!({});
    }
    if let Some(o) = options.as_object_mut() {
        o.insert("include_usage".into(), Value::Bool(true));
        o.remove("continuous_usage_stats");
    }
    let bytes = serde_json::to_vec(&parsed).map_err(|e| ApiError::internal(e.to_string()))?;
    Ok((bytes, true))
}

/// `GET /v1/models`: every model some pool has a ready backend for. A pool that cannot answer is
/// skipped (and logged), never turned into an error for the client.
async fn list_models(env: &Env) -> std::result::Result<Response, ApiError> {
    let mut models: Vec<String> = Vec::new();
    for pool in do_client::list_pools(env).await? {
        match do_client::call(env, To::Pool(&pool.name, 0), &Models).await {
            Ok(answer) => models.extend(answer.models),
            Err(e) => console_error!("models: pool {}: {e}", pool.name),
        }
    }
    models.sort();
    models.dedup();
    let data: Vec<Value> = models
        .iter()
        .map(|m| json!({ "id": m, "object": "model", "created": 0, "owned_by": "llm-gateway" }))
        .collect();
    Ok(Response::from_json(
        &json!({ "object": "list", "data": data }),
    )?)
}
