//! Stage 6 of a completion request, the grant: a pool granted a lease, so the reservation is
//! resolved (the backend is fetched only once the limiter admitted the request), the isolate
//! learns from the grant (round trip, time card, what it sent where), the response headers that
//! say how the request was routed are made, and the request context, the lease guard and the
//! streaming proxy (`forward/proxy.rs`) take the request from here.

use super::pool_walk::{Asking, LeaseCall, Walker};
use crate::clients::keys::Reservation;
use crate::clients::reserving::{self, PendingReservation};
use crate::platform::http::now_ms;
use crate::platform::http::Deadlines;
use crate::request::ahead;
use crate::request::context::RequestContext;
use crate::request::forward::proxy;
use crate::request::hop;
use crate::request::lease::lease_guard::{Lease, LeaseGuard};
use crate::request::regions;
use coordinator_protocol::acquire::Granted;
use coordinator_protocol::messages::{PoolEntry, QUEUE_WAIT_HEADER};
use coordinator_protocol::ApiError;
use routing_core::pool::Grant;
use std::rc::Rc;
use worker::Response;

impl Walker<'_> {
    /// Forwards the request to the backends `pool` granted.
    pub(super) async fn granted(
        mut self,
        pool: &PoolEntry,
        reserved: PendingReservation,
        asking: Asking,
        mut call: LeaseCall,
        granted: Granted,
    ) -> Result<Response, ApiError> {
        let Granted { grant, queued_ms } = granted;
        // The pool's round trip ends here: the limiter's wait below is not the pool's.
        let answered_ms = now_ms();
        // The backend is fetched only once the limiter has admitted the request.
        let reservation = match reserved.resolve().await {
            Ok(r) => r,
            Err(e) => {
                let lease = (grant.lease_id, grant.backend.clone());
                reserving::release_unused(self.ctx, self.env, (&pool.name, call.shard), lease);
                return Err(e);
            }
        };
        let (sent_ahead, ahead_note) = match call.ahead.take() {
            Some(a) => a.granted(&self.intake.features.block_hashes, &grant, queued_ms > 0),
            None => (None, None),
        };
        let disaggregated = !grant.decode_candidates.is_empty();
        let now = now_ms();
        let rtt = (queued_ms == 0).then(|| answered_ms.saturating_sub(call.asked_ms));
        self.learn_from_grant(pool, &grant, rtt, now);
        let waits = (ahead_note, queued_ms, asking.simulated_waits);
        let extra = self.routing_headers(pool, call.pool_choice, &grant, waits);
        let timing = proxy::Timing {
            entered_ms: self.entered_ms,
            route_ms: now.saturating_sub(self.started),
            pre_ms: call.asked_ms.saturating_sub(self.entered_ms),
            acquire_ms: now.saturating_sub(call.asked_ms),
        };
        let (ctx, body) = (self.ctx, std::mem::take(&mut self.intake.body));
        let request = self.into_context(pool, &call, asking.deadlines);
        let guard = LeaseGuard::start(&request, ctx, lease_of(&grant, reservation, now));
        let forward = proxy::Forward {
            request,
            ctx,
            grant,
            guard,
            body,
            timing,
            extra_headers: extra,
            network_delay_ms: call.network_delay_ms,
            ahead: sent_ahead,
        };
        match disaggregated {
            true => forward.run_disaggregated().await,
            false => forward.run().await,
        }
    }

    /// What the isolate learns from a grant: the pool's round trip (`rtt`, when the request did
    /// not queue), its newest time card, and what it sent there (`regions.rs`).
    fn learn_from_grant(&self, pool: &PoolEntry, grant: &Grant, rtt: Option<u64>, now: u64) {
        if let Some(rtt) = rtt {
            let client_region = self.plan.client_region.as_deref();
            regions::observe_rtt(self.env, client_region, &pool.name, rtt);
        }
        if let Some(card) = &grant.card {
            regions::fresh_card(&pool.name, card);
        }
        let card = grant.card.as_deref().or(pool.card.as_ref());
        let features = &self.intake.features;
        regions::served(self.env, &pool.name, card, features, grant.lease_id, now);
    }

    /// The context every later stage of the request shares (`context.rs`).
    fn into_context(
        self,
        pool: &PoolEntry,
        call: &LeaseCall,
        deadlines: Deadlines,
    ) -> Rc<RequestContext> {
        Rc::new(RequestContext {
            env: self.env.clone(),
            endpoint: self.endpoint,
            request_id: self.request_id.to_string(),
            settings: self.settings,
            features: self.intake.features,
            strip_usage_event: self.intake.strip_usage_event,
            resumable: self.intake.resumable,
            pool: pool.name.clone(),
            shard: call.shard,
            pool_choice: call.pool_choice,
            forwarded_headers: self.intake.forwarded_headers,
            client_signal: self.client_signal,
            hung_up: self.hung_up,
            deadlines,
        })
    }

    /// The response headers that say how the request was routed: why this pool, the card a hop
    /// brings back to the edge, the client's rate limits, the plan's prediction, and from `waits`
    /// what became of a fetch sent ahead, the queue wait and the modelled round trips waited out.
    fn routing_headers(
        &self,
        pool: &PoolEntry,
        pool_choice: &'static str,
        grant: &Grant,
        (ahead_note, queued_ms, simulated_waits): (Option<&'static str>, u64, u32),
    ) -> Vec<(&'static str, String)> {
        let (env, plan) = (self.env, &self.plan);
        let card = grant.card.as_deref().or(pool.card.as_ref());
        let mut extra = vec![("x-gateway-pool-choice", pool_choice.to_string())];
        // Through the hop, the edge counts this send and learns the card too.
        if let (Some(_), Some(card)) = (&self.caller.hop_in, card) {
            extra.push((hop::HOP_CARD_HEADER, hop::card_header(card, grant.lease_id)));
        }
        if let Some(c) = &self.intake.charge {
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
            extra.push((QUEUE_WAIT_HEADER, queued_ms.to_string()));
        }
        if regions::simulating(env) {
            // The waits so far; the proxy counts its own, before the backend fetch.
            extra.push((hop::SIMULATED_WAITS_HEADER, simulated_waits.to_string()));
        }
        extra
    }
}

/// The lease the guard keeps: renewed three times per lease period.
fn lease_of(grant: &Grant, reservation: Option<Reservation>, now: u64) -> Lease {
    Lease {
        lease_id: grant.lease_id,
        backend: grant.backend.clone(),
        renew_every: renew_interval(grant.deadline_ms.saturating_sub(now)),
        first_token_due: grant
            .first_token_due_ms
            .map(|ms| std::time::Duration::from_millis(u64::from(ms))),
        reservation,
    }
}

/// How often a live request renews its lease: three times per lease period, so one lost renewal
/// never lets it expire.
fn renew_interval(ttl_ms: u64) -> std::time::Duration {
    std::time::Duration::from_millis((ttl_ms / 3).clamp(300, 20_000))
}
