//! The OpenAI completion endpoints, from the client's request to the proxied answer, one named
//! stage after another (`handle` reads as the request's path):
//!
//! 1. intake (`intake.rs`): who asks (a hop from the edge, else the client key and its
//!    admission identity), then the body read once, its routing features, the forwarded headers
//!    and the charge to the client's limits;
//! 2. the plan: the pools ordered on predicted time (`regions.rs`), or the edge's order a hop
//!    carries;
//! 3. the hop: the request handed to the chosen pool's regional Worker, when one is bound
//!    (`hop.rs`);
//! 4. the reservation of the client's tokens, started beside the first lease call
//!    (`clients/reserving.rs`);
//! 5. the pool walk (`pool_walk.rs`): the pools in `routing_core::region::walk`'s order (nearest
//!    first, spill, queue, saturated fallback), each asked for a lease (`admission.rs`), with a
//!    fetch sent ahead beside it under `ROUTE_AHEAD` (`ahead.rs`);
//! 6. the grant (`granted.rs`): once a pool grants a lease, the shared request context, the
//!    lease guard and the streaming proxy (`forward/proxy.rs`).

mod granted;
mod intake;
mod pool_walk;

use crate::clients::reserving::PendingReservation;
use crate::platform::{do_client, isolate, settings};
use crate::request::hop::{self, Charge, HopContext};
use crate::request::lease::lease_guard;
use crate::request::regions::{self, Plan};
use coordinator_protocol::ApiError;
use intake::{Caller, Intake};
use pool_walk::Walker;
use routing_core::request::endpoint::Endpoint;
use routing_core::request::prompt::RequestFeatures;
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
    let settings = isolate::settings(env);
    let caller = Caller::identify(&req, env, ctx).await?;
    let intake = intake::read(&mut req, env, endpoint, request_id, &settings, &caller).await?;
    let client_signal: AbortSignal = req.inner().signal().into();
    let hung_up = lease_guard::hang_up(&client_signal);
    let started = crate::platform::http::now_ms();
    let plan = plan(
        &req,
        env,
        ctx,
        &settings,
        &caller,
        &intake.features,
        started,
    )
    .await?;
    if let Some(answer) = hand_over(&req, env, &plan, &caller, &intake, request_id).await {
        return answer;
    }
    let reserved = reserve(ctx, env, &intake.charge, &caller.hop_in).await?;
    let walker = Walker {
        env,
        ctx,
        endpoint,
        request_id,
        settings,
        caller,
        intake,
        plan,
        client_signal,
        hung_up,
        entered_ms,
        started,
    };
    walker.walk_pools(reserved).await
}

/// Stage 2, the plan: the pools to try in order, the edge's when the request came by hop.
async fn plan(
    req: &Request,
    env: &Env,
    ctx: &Context,
    settings: &settings::Settings,
    caller: &Caller,
    features: &RequestFeatures,
    started: u64,
) -> std::result::Result<Plan, ApiError> {
    match &caller.hop_in {
        Some(h) => Ok(h.plan()),
        None => {
            let listed = do_client::list_pools_cached(env, ctx).await?;
            let key_residency = caller
                .key
                .as_ref()
                .map_or(&[][..], |k| k.residency.as_slice());
            regions::plan(req, env, settings, listed, features, key_residency, started)
        }
    }
}

/// Stage 3, the hop: the edge hands the request to the chosen pool's regional Worker when one is
/// bound, and returns its answer; the regional Worker charges the client's limits, beside its own
/// lease call. `None`: served here (no regional Worker, or this is one, or it never answered).
async fn hand_over(
    req: &Request,
    env: &Env,
    plan: &Plan,
    caller: &Caller,
    intake: &Intake,
    request_id: &str,
) -> Option<std::result::Result<Response, ApiError>> {
    if caller.hop_in.is_some() {
        return None;
    }
    let regional = hop::regional_for(env, plan)?;
    let handoff = hop::Handoff {
        client: req,
        env,
        plan,
        who: &caller.who,
        charge: intake.charge.clone(),
        request_id,
        strip_usage_event: intake.strip_usage_event,
        body: &intake.body,
    };
    regional.hand_over(handoff, &intake.features).await
}

/// Stage 4, the reservation: charged beside the first lease call, not before it (`reserving`); a
/// hop from an edge that charged already carries its reservation.
async fn reserve(
    ctx: &Context,
    env: &Env,
    charge: &Option<Charge>,
    hop_in: &Option<HopContext>,
) -> std::result::Result<PendingReservation, ApiError> {
    Ok(match (charge, hop_in) {
        (Some(c), _) => PendingReservation::start(ctx, env, c).await?,
        (None, Some(h)) => PendingReservation::Known(h.reservation.clone()),
        (None, None) => PendingReservation::Known(None),
    })
}
