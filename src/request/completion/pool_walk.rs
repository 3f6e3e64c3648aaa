//! Stage 5 of a completion request, the pool walk: the planned pools in the order
//! `routing_core::region::walk` gives (nearest first, spilling over, back to the nearest full
//! pool's queue or the nearest saturated pool when nothing further has room), each asked for a
//! lease (`admission.rs`), with the backend fetch sent ahead beside the lease call under
//! `ROUTE_AHEAD` (`ahead.rs`). The first grant goes on to `granted.rs`; a walk no pool ended
//! becomes the request's error.

use super::intake::{Caller, Intake};
use crate::clients::reserving::PendingReservation;
use crate::platform::http::{self, Deadlines};
use crate::platform::settings::Settings;
use crate::request::admission::{self, Asked};
use crate::request::ahead::{self, Ahead};
use crate::request::forward::attempts::UpstreamCall;
use crate::request::regions::{self, Plan};
use coordinator_protocol::acquire::AcquireBody;
use coordinator_protocol::messages::PoolEntry;
use coordinator_protocol::ApiError;
use routing_core::pool::shard::shard_of_request;
use routing_core::pool::Refusal;
use routing_core::region::walk::{AfterAnswer, NextPool, PoolAnswer, PoolWalk, WalkEnd};
use routing_core::region::ChoiceNote;
use routing_core::request::endpoint::Endpoint;
use std::rc::Rc;
use worker::{console_error, AbortSignal, Context, Delay, Env, Response};

/// A request from its reservation to its grant: everything the earlier stages decided, which the
/// walk asks with and the grant hands to the proxy.
pub(super) struct Walker<'a> {
    pub(super) env: &'a Env,
    pub(super) ctx: &'a Context,
    pub(super) endpoint: Endpoint,
    pub(super) request_id: &'a str,
    pub(super) settings: Rc<Settings>,
    pub(super) caller: Caller,
    pub(super) intake: Intake,
    pub(super) plan: Plan,
    /// The client's abort signal: a hang-up aborts the upstream fetches.
    pub(super) client_signal: AbortSignal,
    /// Resolves when the client hangs up (`lease_guard::hang_up`).
    pub(super) hung_up: js_sys::Promise,
    /// When the Worker took the request, and when it started planning it.
    pub(super) entered_ms: u64,
    pub(super) started: u64,
}

/// What the walk keeps from one pool to the next.
pub(super) struct Asking {
    /// The features, serialised once, whichever pools are asked and however often a queued
    /// request asks again.
    acquire_body: AcquireBody,
    /// The request's deadlines, from its lease calls to its stream's watchdog, on one timer.
    pub(super) deadlines: Deadlines,
    /// At most one fetch goes ahead per request: to the first pool asked that it is guessed for.
    sent_ahead_once: bool,
    /// The modelled round trips waited out so far (`SIMULATE_NETWORK`).
    pub(super) simulated_waits: u32,
    /// The region the Worker runs in, for the modelled network: the client's at the edge, the
    /// pool's region at a regional Worker.
    simulate_from: Option<String>,
}

/// One lease call to a pool: what asking it started or measured, beside its answer.
pub(super) struct LeaseCall {
    /// The pool's coordinator shard for this request.
    pub(super) shard: u32,
    /// Why this pool was asked (the plan's reason for the first, `spill` for the others).
    pub(super) pool_choice: &'static str,
    /// The modelled round trip to the pool (`SIMULATE_NETWORK`; else 0).
    pub(super) network_delay_ms: u64,
    /// When the lease call went.
    pub(super) asked_ms: u64,
    /// The fetch sent ahead beside the lease call, if one was.
    pub(super) ahead: Option<Ahead>,
}

impl Walker<'_> {
    /// Asks the planned pools in the walk's order until one grants a lease (then forwards the
    /// request) or the walk ends (then refunds the reservation and says why no pool served).
    pub(super) async fn walk_pools(
        mut self,
        reserved: PendingReservation,
    ) -> Result<Response, ApiError> {
        let pools = std::mem::take(&mut self.plan.pools);
        let first_pool = pools.first().map(|p| p.name.clone());
        let mut walk = PoolWalk::new(pools.len(), self.plan.excluded > 0);
        let mut asking = Asking {
            acquire_body: AcquireBody::new(&self.intake.features),
            deadlines: Deadlines::new(),
            sent_ahead_once: false,
            simulated_waits: 0,
            simulate_from: match &self.caller.hop_in {
                Some(h) => Some(h.region.clone()),
                None => self.plan.client_region.clone(),
            },
        };
        while let Some(NextPool { pool, spill_ok, .. }) = walk.next_pool() {
            let pool = &pools[pool];
            let pool_choice = match first_pool.as_deref() == Some(pool.name.as_str()) {
                true => self.plan.reason.as_str(),
                false => "spill",
            };
            let (answer, call) = self
                .ask(pool, pool_choice, spill_ok, &reserved, &mut asking)
                .await;
            match answer {
                Asked::Granted(granted) => {
                    return self.granted(pool, reserved, asking, call, granted).await;
                }
                // The client left (the pool was told), or the limiter refused the request meanwhile.
                Asked::HungUp => {
                    let reservation = reserved.resolve().await?;
                    PendingReservation::Known(reservation).refund(self.ctx, self.env);
                    return Err(ApiError::client_closed());
                }
                Asked::Refused(refusal) => {
                    if let Some(a) = call.ahead {
                        a.refused();
                    }
                    if let AfterAnswer::Stop(refusal) = walk.feed(PoolAnswer::Refused(refusal)) {
                        reserved.refund(self.ctx, self.env);
                        return Err(refusal.into());
                    }
                }
                // The pool's object failed: the next pool may still serve the request.
                Asked::Failed(e) => {
                    if let Some(a) = call.ahead {
                        a.refused();
                    }
                    console_error!("pool {} failed to answer an acquire: {e}", pool.name);
                    walk.feed(PoolAnswer::Failed);
                }
            }
        }
        let error = no_pool_served(walk.end(), &self.intake, &self.plan);
        reserved.refund(self.ctx, self.env);
        Err(error)
    }

    /// Asks `pool` for a lease: the fetch sent ahead beside the call (`ROUTE_AHEAD`), the
    /// modelled round trip waited out, then the lease call and any queue wait.
    async fn ask(
        &self,
        pool: &PoolEntry,
        pool_choice: &'static str,
        spill_ok: bool,
        reserved: &PendingReservation,
        asking: &mut Asking,
    ) -> (Asked, LeaseCall) {
        // The pool's coordinator shard for this request: by its key, else its first prefix block.
        let shard = shard_of_request(pool.shards, &self.intake.features);
        let note = ChoiceNote {
            reason: pool_choice.to_string(),
            cross_region: self.plan.cross_region(pool),
        };
        asking.acquire_body.set_choice(&note);
        let network_delay_ms =
            regions::simulated_rtt_ms(self.env, asking.simulate_from.as_deref(), pool);
        let ahead = self
            .settings
            .route_ahead
            .then(|| self.send_ahead(pool, shard, network_delay_ms, reserved, asking));
        asking.sent_ahead_once |= ahead.as_ref().is_some_and(|a| a.told().is_some());
        // The pool weighs the backend sent to against a re-send elsewhere (on this pool's first
        // call: it ignores the part on the calls of a wait).
        asking
            .acquire_body
            .set_ahead(ahead.as_ref().and_then(Ahead::told));
        let asked_ms = http::now_ms();
        if network_delay_ms > 0 {
            asking.simulated_waits += 1;
            Delay::from(std::time::Duration::from_millis(network_delay_ms)).await;
        }
        let give_up = reserved.give_up_on(&self.hung_up);
        let on_queued = || {
            if let Some(a) = &ahead {
                a.queued();
            }
        };
        let answer = admission::acquire(
            self.env,
            self.ctx,
            &give_up,
            &pool.name,
            shard,
            spill_ok,
            &asking.acquire_body,
            &self.caller.who,
            &asking.deadlines,
            &on_queued,
        )
        .await;
        let call = LeaseCall {
            shard,
            pool_choice,
            network_delay_ms,
            asked_ms,
            ahead,
        };
        (answer, call)
    }

    /// With `ROUTE_AHEAD`, the backend fetch goes beside the lease call, to the backend this
    /// isolate expects the shard to choose; kept only if it does (`ahead.rs`).
    fn send_ahead(
        &self,
        pool: &PoolEntry,
        shard: u32,
        delay_ms: u64,
        reserved: &PendingReservation,
        asking: &Asking,
    ) -> Ahead {
        let features = &self.intake.features;
        let ask = ahead::AheadTarget {
            pool: &pool.name,
            shard,
            model: &features.model,
            block_hashes: &features.block_hashes,
            // A follow-up of a stored response goes only where the pool's record says.
            may_send: !asking.sent_ahead_once
                && reserved.is_known()
                && features.previous_response_id.is_none(),
            delay_ms,
            resend_ms: regions::rtt_estimate_ms(
                self.env,
                self.plan.client_region.as_deref(),
                asking.simulate_from.as_deref(),
                pool,
            ),
        };
        let call = UpstreamCall {
            forwarded_headers: &self.intake.forwarded_headers,
            request_id: self.request_id,
            endpoint: self.endpoint,
            timeout: UpstreamCall::timeout_for(&self.settings.proxy, features.stream),
            deadlines: &asking.deadlines,
        };
        Ahead::start(ask, &call, &self.intake.body, &self.client_signal)
    }
}

/// The error of a walk no pool served.
fn no_pool_served(end: WalkEnd<Refusal>, intake: &Intake, plan: &Plan) -> ApiError {
    match end {
        WalkEnd::Refused(refusal) => refusal.into(),
        // A follow-up of a stored response no pool could place: the response is lost (each
        // pool refused it as unknown, or its backend gone), whatever the model.
        WalkEnd::NotServed => match &intake.features.previous_response_id {
            Some(id) => ApiError::response_not_found(id, "previous_response_id"),
            None => ApiError::model_not_found(&intake.features.model),
        },
        WalkEnd::NoAnswer => ApiError::unavailable("No pool could take the request now.", 1),
        // A restricted request never leaves its jurisdictions: say so when none of them took
        // it.
        WalkEnd::Residency => regions::residency_error(&plan.allowed),
    }
}
