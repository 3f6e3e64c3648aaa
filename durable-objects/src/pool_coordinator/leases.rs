//! The rest of a lease's life: a retry on the next candidate, renewals, the end of a
//! disaggregated request's prefill stage, and the release (one, or a batch an isolate collected,
//! each recording the stored Responses API response it may report); and where such a stored
//! response is held (`GET /v1/responses/{id}` and its cancel).

use super::{now_ms, pool_error, ApiResult, PoolCoordinator};
use crate::call::reply;
use coordinator_protocol::messages::{
    PrefillDone, PrefillDoneAnswer, ReassignAnswer, ReassignRequest, ReleaseAnswer, ReleaseBatch,
    ReleaseBatchAnswer, ReleaseRequest, RenewAnswer, RenewRequest, ResponseHolder,
    ResponseHolderAnswer,
};
use routing_core::coordinator::reassign::RetryRefused;
use routing_core::coordinator::Release;
use routing_core::pool::Refusal;
use worker::console_log;

impl PoolCoordinator {
    pub(super) async fn reassign(&self, req: ReassignRequest) -> ApiResult {
        let (result, performed) = self.with(|shard| {
            let now = now_ms();
            let (done, effects) = shard.coordinator.reassign(&req, now);
            let failed = req.terms.as_ref().map(|t| &t.backend);
            if let (true, Some(backend), Some(model)) =
                (done.forgot_model, failed, &req.missing_model)
            {
                console_log!(
                    "pool {}: backend {} no longer serves {model}",
                    shard.name,
                    backend.0
                );
            }
            let performed = shard.perform(effects, now);
            let answer = match done.result {
                Ok(candidate) => ReassignAnswer::Moved(candidate),
                Err(RetryRefused::BudgetExhausted) => {
                    ReassignAnswer::Refused(Refusal::RetryBudgetExhausted)
                }
                Err(RetryRefused::Pool(error)) => {
                    ReassignAnswer::Refused(Refusal::CannotMove { error })
                }
            };
            (reply::<ReassignRequest>(&answer), performed)
        });
        // Its served models changed: probe now rather than at the next round (the coordinator
        // asks at most once per backend and model between probes).
        self.follow_up(performed).await;
        result
    }

    /// Renews a lease, with what the Worker reports of its stream (a first token, or none by
    /// its due time): when that shows a backend's model wrong, the backend is scraped now and
    /// the card that follows goes to the directory, before the answer (the renewal runs after
    /// the response, in the Worker's `waitUntil`). A renewal that said its stream was overdue
    /// has that card in its answer.
    pub(super) async fn renew(&self, req: RenewRequest) -> ApiResult {
        let (renewed, performed) = self.with(|shard| {
            let now = now_ms();
            let c = &mut shard.coordinator;
            c.count_renewal(req.overdue);
            if let Some(ttfb_ms) = req.first_token_ms {
                c.first_token(req.lease_id, ttfb_ms);
            }
            let renewed = c.renew(req.lease_id, &req.terms, now).map_err(pool_error);
            if req.overdue {
                c.overdue(req.lease_id);
            }
            let effects = if req.overdue || req.first_token_ms.is_some() {
                c.check_evidence(now)
            } else {
                Vec::new()
            };
            (renewed, shard.perform(effects, now))
        });
        self.follow_up(performed).await;
        let (deadline_ms, reestablished) = renewed?;
        let card = req
            .overdue
            .then(|| self.with(|shard| Box::new(shard.coordinator.grant_card(now_ms()))));
        reply::<RenewRequest>(&RenewAnswer {
            deadline_ms,
            reestablished,
            card,
        })
    }

    pub(super) fn prefill_done(&self, req: PrefillDone) -> ApiResult {
        self.with(|shard| {
            let now = now_ms();
            let (ended, effects) = shard.coordinator.prefill_done(
                req.lease_id,
                &req.outcome,
                req.backend.as_ref(),
                now,
            );
            let _ = shard.perform(effects, now);
            reply::<PrefillDone>(&PrefillDoneAnswer { ended })
        })
    }

    /// The backend holding a stored response, by the pool's record (`routing_core::pool::responses`).
    pub(super) fn response_holder(&self, req: ResponseHolder) -> ApiResult {
        self.with(|shard| {
            let pool = shard.coordinator.pool();
            let owner = req.owner.as_deref();
            let holder = pool.response_holder(&req.id, owner, now_ms()).ok();
            reply::<ResponseHolder>(&ResponseHolderAnswer { holder })
        })
    }

    pub(super) async fn release(&self, req: ReleaseRequest) -> ApiResult {
        let released = self.release_all(std::slice::from_ref(&req)).await;
        reply::<ReleaseRequest>(&ReleaseAnswer {
            released: released[0],
        })
    }

    /// Several releases in one call, each as [`Self::release`] does it.
    pub(super) async fn release_batch(&self, batch: ReleaseBatch) -> ApiResult {
        let released = self.release_all(&batch.releases).await;
        reply::<ReleaseBatch>(&ReleaseBatchAnswer { released })
    }

    /// Ends each lease with its outcome; its backend's state is written when the lease was live.
    /// When the last lease of a pool that published a busy card ended, the new card goes to the
    /// directory before the answer.
    async fn release_all(&self, requests: &[ReleaseRequest]) -> Vec<bool> {
        let releases: Vec<Release> = requests
            .iter()
            .map(|r| Release {
                lease_id: r.lease_id,
                outcome: &r.outcome,
                backend: r.backend.as_ref(),
            })
            .collect();
        let (released, performed) = self.with(|shard| {
            let now = now_ms();
            let (released, effects) = shard.coordinator.release(&releases, now);
            (released, shard.perform(effects, now))
        });
        self.follow_up(performed).await;
        released
    }
}
