//! The OpenAI completion endpoints, from the client's request to the proxied answer: the key and
//! its token reservation, the body read once and its routing features, the pools ordered on
//! predicted time (`regions.rs`) or the regional Worker it is handed to (`hop.rs`), the walk over
//! those pools (`routing_core::region::walk`: nearest first, spill, queue, saturated fallback)
//! asking each for a lease (`admission.rs`), and, once a pool grants one, the shared request
//! context, the lease guard and the streaming proxy (`forward/proxy.rs`).

use crate::clients::keys;
use crate::clients::reserving::{self, Reserved};
use crate::platform::{do_client, http, settings};
use crate::request::admission::{self, Asked};
use crate::request::ahead::{self, Ahead};
use crate::request::context::{self, RequestContext};
use crate::request::forward::attempts::UpstreamCall;
use crate::request::forward::proxy;
use crate::request::lease::lease_guard::{self, Lease, LeaseGuard};
use crate::request::{hop, passthrough, regions};
use coordinator_protocol::acquire::{AcquireBody, Granted};
use coordinator_protocol::messages::PoolEntry;
use coordinator_protocol::ApiError;
use routing_core::pool::shard::shard_of_request;
use routing_core::region::walk::{Ask, PoolAnswer, PoolWalk, Verdict, WalkEnd};
use routing_core::region::ChoiceNote;
use routing_core::request::endpoint::Endpoint;
use routing_core::request::prompt::endpoint_features;
use routing_core::stream::resume::check_request;
use serde_json::Value;
use std::rc::Rc;
use worker::*;

/// `POST /v1/chat/completions`, `/v1/completions`, `/v1/embeddings`, `/v1/responses`,
/// `/v1/messages`, `/v1/messages/count_tokens`, and the pass-through routes (`passthrough.rs`:
/// tokenize, rerank, score, pooling, classify, audio).
pub async fn handle(
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
    let entered_ms = crate::platform::http::now_ms();
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
    let mut body = http::read_body_limited(&mut req, settings.max_body_bytes).await?;
    // Read in place: `Headers::clone` would copy them into a new platform object.
    let headers = req.headers();
    let header = |name: &str| headers.get(name).ok().flatten();
    let (parsed, features) = match endpoint.is_multipart() {
        // The audio routes' forms: `model` and `stream` read from the buffered body (passthrough.rs).
        true => (
            Value::Null,
            passthrough::multipart_features(endpoint, &body, &header),
        ),
        false => {
            let mut parsed: Value = serde_json::from_slice(&body).map_err(|e| {
                ApiError::bad_request(format!("request body is not valid JSON: {e}"))
            })?;
            if !parsed.is_object() {
                return Err(ApiError::bad_request("request body must be a JSON object"));
            }
            // vLLM does not authenticate `kv_transfer_params`: only the gateway's own
            // disaggregated prefill/decode sets them, never a client.
            if context::drop_transfer_params(&mut parsed) {
                body =
                    serde_json::to_vec(&parsed).map_err(|e| ApiError::internal(e.to_string()))?;
            }
            let features = endpoint_features(endpoint, &parsed, &header, &settings.features);
            (parsed, features)
        }
    };
    let mut features = features.map_err(|e| {
        let err = ApiError::bad_request(e.to_string()).with_code(e.code());
        match e.param() {
            Some(p) => err.with_param(p),
            None => err,
        }
    })?;
    features.request_id = request_id.to_string();
    // Decided from the body read once here: whether a broken stream may be resumed, and the
    // client headers the backend gets.
    let resumable = check_request(&parsed, endpoint);
    let mut forwarded_headers =
        context::forwarded_headers(&req, settings.features.routing_header.as_deref())?;
    passthrough::forward_content_type(endpoint, &req, &mut forwarded_headers);
    // What the client's rate limits are charged: an estimate, settled with the real usage.
    let charge = match (&hop_in, &client) {
        (Some(h), _) => h.charge.clone(),
        (None, Some(client)) => Some(hop::Charge::at_edge(
            env,
            client,
            u64::from(features.prompt_tokens) + u64::from(features.max_tokens),
        )),
        (None, None) => None,
    };
    // A stored response is followed up and retrieved only with the key that made it (a hop
    // carries the edge's key hash in its charge).
    if features.is_stateful() {
        features.owner = charge.as_ref().map(|c| c.client.clone());
    }
    let stream = features.stream;
    // Streams report usage only when asked: ask, and take the event out again if the client didn't.
    // The Responses and Messages streams always report usage: nothing to ask for.
    let (body, strip_usage_event) = match (&hop_in, stream && endpoint.is_generation()) {
        (Some(h), _) => (body, h.strip_usage_event),
        (None, true) => context::ask_for_usage(parsed, body)?,
        (None, false) => (body, false),
    };
    let client_signal: AbortSignal = req.inner().signal().into();
    let hung_up = lease_guard::hang_up(&client_signal);
    let started = crate::platform::http::now_ms();
    let planned = match &hop_in {
        Some(h) => Ok(h.plan()),
        None => {
            let listed = do_client::list_pools_cached(env, ctx).await?;
            let key_residency = key.as_ref().map_or(&[][..], |k| k.residency.as_slice());
            regions::plan(
                &req,
                env,
                &settings,
                listed,
                &features,
                key_residency,
                started,
            )
        }
    };
    let mut plan = planned?;
    // The edge hands the request to the chosen pool's regional Worker when one is bound; the
    // regional Worker charges the client's limits, beside its own lease call.
    if hop_in.is_none() {
        if let Some(regional) = hop::regional_for(env, &plan) {
            let handoff = hop::Handoff {
                client: &req,
                env,
                plan: &plan,
                who: &who,
                charge: charge.clone(),
                request_id,
                strip_usage_event,
                body: &body,
            };
            if let Some(answer) = regional.hand_over(handoff, &features).await {
                return answer;
            }
        }
    }
    // Charged beside the first lease call, not before it (`reserving`); a hop from an edge that
    // charged already carries its reservation.
    let reserved = match (&charge, &hop_in) {
        (Some(c), _) => Reserved::start(ctx, env, c).await?,
        (None, Some(h)) => Reserved::Known(h.reservation.clone()),
        (None, None) => Reserved::Known(None),
    };
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
    // The request's deadlines, from its lease calls to its stream's watchdog, on one timer.
    let deadlines = http::Deadlines::new();
    // At most one fetch goes ahead per request: to the first pool asked that it is guessed for.
    let mut sent_ahead_once = false;
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
        // With `ROUTE_AHEAD`, the backend fetch goes beside the lease call, to the backend this
        // isolate expects the shard to choose; kept only if it does (`ahead.rs`).
        let ahead = settings.route_ahead.then(|| {
            let ask = ahead::Ask {
                pool: &pool.name,
                shard,
                model: &features.model,
                block_hashes: &features.block_hashes,
                // A follow-up of a stored response goes only where the pool's record says.
                may_send: !sent_ahead_once
                    && reserved.is_known()
                    && features.previous_response_id.is_none(),
                delay_ms: network_delay_ms,
                resend_ms: regions::rtt_estimate_ms(
                    env,
                    plan.client_region.as_deref(),
                    simulate_from.as_deref(),
                    pool,
                ),
            };
            let call = UpstreamCall {
                forwarded_headers: &forwarded_headers,
                request_id,
                endpoint,
                timeout: UpstreamCall::timeout_for(&settings.proxy, stream),
                deadlines: &deadlines,
            };
            Ahead::start(ask, &call, &body, &client_signal)
        });
        sent_ahead_once |= ahead.as_ref().is_some_and(|a| a.told().is_some());
        // The pool weighs the backend sent to against a re-send elsewhere (on this pool's first
        // call: it ignores the part on the calls of a wait).
        acquire_body.set_ahead(ahead.as_ref().and_then(Ahead::told));
        let asked_ms = crate::platform::http::now_ms();
        if network_delay_ms > 0 {
            simulated_waits += 1;
            Delay::from(std::time::Duration::from_millis(network_delay_ms)).await;
        }
        let give_up = reserved.give_up_on(&hung_up);
        let on_queued = || {
            if let Some(a) = &ahead {
                a.queued();
            }
        };
        let admitted = admission::acquire(
            env,
            ctx,
            &give_up,
            &pool.name,
            shard,
            spill_ok,
            &acquire_body,
            &who,
            &deadlines,
            &on_queued,
        );
        match admitted.await {
            Asked::Granted(Granted { grant, queued_ms }) => {
                // The pool's round trip ends here: the limiter's wait below is not the pool's.
                let answered_ms = crate::platform::http::now_ms();
                // The backend is fetched only once the limiter has admitted the request.
                let reservation = match reserved.resolve().await {
                    Ok(r) => r,
                    Err(e) => {
                        let lease = (grant.lease_id, grant.backend.clone());
                        reserving::release_unused(ctx, env, (&pool.name, shard), lease);
                        return Err(e);
                    }
                };
                let (sent_ahead, ahead_note) = match ahead {
                    Some(a) => a.granted(&features.block_hashes, &grant, queued_ms > 0),
                    None => (None, None),
                };
                let disaggregated = !grant.decode_candidates.is_empty();
                let now = crate::platform::http::now_ms();
                if queued_ms == 0 {
                    let rtt = answered_ms.saturating_sub(asked_ms);
                    regions::observe_rtt(env, plan.client_region.as_deref(), &pool.name, rtt);
                }
                if let Some(card) = &grant.card {
                    regions::fresh_card(&pool.name, card);
                }
                let card = grant.card.as_deref().or(pool.card.as_ref());
                regions::served(env, &pool.name, card, &features, grant.lease_id, now);
                let mut extra = vec![("x-gateway-pool-choice", pool_choice.to_string())];
                // Through the hop, the edge counts this send and learns the card too.
                if let (Some(_), Some(card)) = (&hop_in, card) {
                    extra.push((hop::HOP_CARD_HEADER, hop::card_header(card, grant.lease_id)));
                }
                if let Some(c) = &charge {
                    extra.extend(reserving::rate_limit_headers(c.limits(env), &c.client));
                }
                // The prediction is the planned first pool's, not a spill's.
                if let (Some(ms), false) = (plan.predicted_ms, pool_choice == "spill") {
                    extra.push(("x-gateway-pool-predicted-ms", ms.to_string()));
                    if let Some(anchor) = plan.anchor_ms {
                        extra.push(("x-gateway-pool-anchor-ms", anchor.to_string()));
                    }
                }
                if let Some(note) = ahead_note {
                    extra.push((ahead::AHEAD_HEADER, note.to_string()));
                }
                if queued_ms > 0 {
                    extra.push((
                        coordinator_protocol::messages::QUEUE_WAIT_HEADER,
                        queued_ms.to_string(),
                    ));
                }
                if regions::simulating(env) {
                    // The waits so far; the proxy counts its own, before the backend fetch.
                    extra.push((hop::SIMULATED_WAITS_HEADER, simulated_waits.to_string()));
                }
                let timing = proxy::Timing {
                    entered_ms,
                    route_ms: now.saturating_sub(started),
                    pre_ms: asked_ms.saturating_sub(entered_ms),
                    acquire_ms: now.saturating_sub(asked_ms),
                };
                let request = Rc::new(RequestContext {
                    env: env.clone(),
                    endpoint,
                    request_id: request_id.to_string(),
                    settings,
                    features,
                    strip_usage_event,
                    resumable,
                    pool: pool.name.clone(),
                    shard,
                    pool_choice,
                    forwarded_headers,
                    client_signal,
                    hung_up,
                    deadlines,
                });
                let lease = Lease {
                    lease_id: grant.lease_id,
                    backend: grant.backend.clone(),
                    renew_every: renew_interval(grant.deadline_ms.saturating_sub(now)),
                    first_token_due: grant
                        .first_token_due_ms
                        .map(|ms| std::time::Duration::from_millis(u64::from(ms))),
                    reservation,
                };
                let guard = LeaseGuard::start(&request, ctx, lease);
                let forward = proxy::Forward {
                    request,
                    ctx,
                    grant,
                    guard,
                    body,
                    timing,
                    extra_headers: extra,
                    network_delay_ms,
                    ahead: sent_ahead,
                };
                let resp = if disaggregated {
                    forward.run_disaggregated().await?
                } else {
                    forward.run().await?
                };
                return Ok(resp);
            }
            // The client left (the pool was told), or the limiter refused the request meanwhile.
            Asked::HungUp => {
                let reservation = reserved.resolve().await?;
                Reserved::Known(reservation).refund(ctx, env);
                return Err(ApiError::client_closed());
            }
            Asked::Refused(refusal) => {
                if let Some(a) = ahead {
                    a.refused();
                }
                if let Verdict::Stop(refusal) = walk.feed(PoolAnswer::Refused(refusal)) {
                    reserved.refund(ctx, env);
                    return Err(refusal.into());
                }
            }
            // The pool's object failed: the next pool may still serve the request.
            Asked::Failed(e) => {
                if let Some(a) = ahead {
                    a.refused();
                }
                console_error!("pool {} failed to answer an acquire: {e}", pool.name);
                walk.feed(PoolAnswer::Failed);
            }
        }
    }
    reserved.refund(ctx, env);
    Err(match walk.end() {
        WalkEnd::Refused(refusal) => refusal.into(),
        // A follow-up of a stored response no pool could place: the response is lost (each pool
        // refused it as unknown, or its backend gone), whatever the model.
        WalkEnd::NotServed => match &features.previous_response_id {
            Some(id) => ApiError::response_not_found(id, "previous_response_id"),
            None => ApiError::model_not_found(&features.model),
        },
        WalkEnd::NoAnswer => ApiError::unavailable("No pool could take the request now.", 1),
        // A restricted request never leaves its jurisdictions: say so when none of them took it.
        WalkEnd::Residency => regions::residency_error(&plan.allowed),
    })
}

/// How often a live request renews its lease: three times per lease period, so one lost renewal
/// never lets it expire.
fn renew_interval(ttl_ms: u64) -> std::time::Duration {
    std::time::Duration::from_millis((ttl_ms / 3).clamp(300, 20_000))
}
