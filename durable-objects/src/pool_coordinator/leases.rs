//! The rest of a lease's life: a retry on the next candidate, renewals, the end of a
//! disaggregated request's prefill stage, and the release (one, or a batch an isolate collected).

use super::*;
use crate::call::reply;
use coordinator_protocol::messages::ReassignAnswer;
use routing_core::pool::Refusal;

impl PoolCoordinator {
    pub(super) async fn reassign(&self, req: ReassignRequest) -> ApiResult {
        let (result, probe_soon) = self.with(|l| {
            // A 5xx the lease left earlier may be charged by this move: persist that backend too.
            let deferred = l.pool.deferred_failure(req.lease_id);
            let Live {
                pool,
                budget,
                settings,
                ..
            } = l;
            let done = reassign(pool, budget, &settings.retry_budget, &req, now_ms());
            let failed = req.terms.as_ref().map(|t| &t.backend);
            if let (true, Some(backend), Some(model)) =
                (done.forgot_model, failed, &req.missing_model)
            {
                console_log!(
                    "pool {}: backend {} no longer serves {model}",
                    l.name,
                    backend.0
                );
            }
            let answer = match done.result {
                Ok(candidate) => {
                    l.retries += 1;
                    persist_backends(l, &[failed, Some(&req.to), deferred.as_ref()]);
                    ReassignAnswer::Moved(candidate)
                }
                Err(RetryRefused::BudgetExhausted) => {
                    persist_backends(l, &[failed, deferred.as_ref()]);
                    ReassignAnswer::Refused(Refusal::RetryBudgetExhausted)
                }
                Err(RetryRefused::Pool(error)) => {
                    persist_backends(l, &[failed, Some(&req.to), deferred.as_ref()]);
                    ReassignAnswer::Refused(Refusal::CannotMove { error })
                }
            };
            (reply::<ReassignRequest>(&answer), done.probe_soon)
        });
        if probe_soon {
            // Its served models changed: probe now rather than at the next round. Asked once per
            // backend and model between probes (a model already forgotten is not forgotten again)
            // and at most once per PROBE_SOON_MIN_INTERVAL_MS per backend, so a stream of 404s
            // cannot keep the pool probing.
            self.probe_soon().await;
        }
        result
    }

    pub(super) fn renew(&self, req: RenewRequest) -> ApiResult {
        self.with(|l| {
            let now = now_ms();
            let (deadline_ms, reestablished) = match l.pool.renew(req.lease_id, now) {
                Ok(d) => (d, false),
                Err(_) => (
                    l.pool
                        .readmit(req.lease_id, &req.terms, now)
                        .map_err(pool_error)?,
                    true,
                ),
            };
            reply::<RenewRequest>(&RenewAnswer {
                deadline_ms,
                reestablished,
            })
        })
    }

    pub(super) fn prefill_done(&self, req: PrefillDone) -> ApiResult {
        self.with(|l| {
            let ended = l.pool.finish_prefill(req.lease_id, &req.outcome, now_ms());
            if ended {
                persist_backends(l, &[req.backend.as_ref()]);
            }
            reply::<PrefillDone>(&PrefillDoneAnswer { ended })
        })
    }

    pub(super) fn release(&self, req: ReleaseRequest) -> ApiResult {
        self.with(|l| {
            let released = release_one(l, &req);
            finish_drains(l);
            reply::<ReleaseRequest>(&ReleaseAnswer { released })
        })
    }

    /// Several releases in one call, each as [`Self::release`] does it.
    pub(super) fn release_batch(&self, batch: ReleaseBatch) -> ApiResult {
        self.with(|l| {
            let released = batch.releases.iter().map(|r| release_one(l, r)).collect();
            finish_drains(l);
            reply::<ReleaseBatch>(&ReleaseBatchAnswer { released })
        })
    }
}

/// Ends one lease with its outcome; persists its backend's state when the lease was live.
fn release_one(l: &mut Live, req: &ReleaseRequest) -> bool {
    // A backend whose 5xx the lease left is charged (or not) now: its state changes too.
    let deferred = l.pool.deferred_failure(req.lease_id);
    let released = l.pool.release(req.lease_id, &req.outcome, now_ms());
    if released {
        persist_backends(l, &[req.backend.as_ref(), deferred.as_ref()]);
    }
    released
}
