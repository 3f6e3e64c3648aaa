//! The rest of a lease's life in the coordinator: a retry on the next candidate (the retry
//! budget's gate, [`super::reassign`]), renewals, the end of a disaggregated request's prefill
//! stage, and releases (which also record the stored response a Responses request left on its
//! backend). Each writes the backends the request touched when their state changed.

use super::reassign::{reassign, FailedAttempt, Reassignment, RetryRefused};
use super::{Coordinator, Effect, Effects};
use crate::backend::BackendId;
use crate::pool::lease::{LeaseId, LeaseTerms};
use crate::pool::PoolError;
use crate::stream::outcome::Outcome;

/// One lease to release, as the Worker reports it.
#[derive(Debug, Clone, Copy)]
pub struct Release<'a> {
    /// The lease.
    pub lease_id: LeaseId,
    /// How the request ended.
    pub outcome: &'a Outcome,
    /// The backend that served it, if the Worker knows.
    pub backend: Option<&'a BackendId>,
}

impl Coordinator {
    /// A failed attempt before the first byte: retried on its next candidate if the budget
    /// allows (counted as a retry), else the lease ends with the failure.
    pub fn reassign(&mut self, attempt: &FailedAttempt, now_ms: u64) -> (Reassignment, Effects) {
        let mut effects = Effects::new();
        // A 5xx the lease left earlier may be charged by this move: persist that backend too.
        let deferred = self.pool.deferred_failure(attempt.lease_id);
        let done = reassign(
            &mut self.pool,
            &mut self.budget,
            &self.retry_budget_config,
            attempt,
            now_ms,
        );
        let failed = attempt.terms.as_ref().map(|t| &t.backend);
        let touched = match &done.result {
            Ok(_) => {
                self.retries += 1;
                [failed, Some(&attempt.to), deferred.as_ref()]
            }
            Err(RetryRefused::BudgetExhausted) => [failed, deferred.as_ref(), None],
            Err(RetryRefused::Pool(_)) => [failed, Some(&attempt.to), deferred.as_ref()],
        };
        self.persist_backends(&touched, &mut effects);
        if done.probe_soon {
            // Its served models changed: probe now rather than at the next round. Asked once per
            // backend and model between probes and at most once per
            // `PROBE_SOON_MIN_INTERVAL_MS` per backend, so a stream of 404s cannot keep the pool
            // probing.
            effects.push(Effect::ProbeSoon);
        }
        (done, effects)
    }

    /// Renews a lease; a lease the pool lost (it expired, or the object restarted) is counted
    /// again from the Worker's `terms`. Returns the new deadline and whether it was re-established.
    pub fn renew(
        &mut self,
        lease_id: LeaseId,
        terms: &LeaseTerms,
        now_ms: u64,
    ) -> Result<(u64, bool), PoolError> {
        match self.pool.renew(lease_id, now_ms) {
            Ok(deadline_ms) => Ok((deadline_ms, false)),
            Err(_) => Ok((self.pool.readmit(lease_id, terms, now_ms)?, true)),
        }
    }

    /// A disaggregated request's prefill stage ended. Returns whether a lease share ended.
    pub fn prefill_done(
        &mut self,
        lease_id: LeaseId,
        outcome: &Outcome,
        backend: Option<&BackendId>,
        now_ms: u64,
    ) -> (bool, Effects) {
        let mut effects = Effects::new();
        let ended = self.pool.finish_prefill(lease_id, outcome, now_ms);
        if ended {
            self.persist_backends(&[backend], &mut effects);
        }
        (ended, effects)
    }

    /// Ends leases with their outcomes (one, or a batch an isolate collected), then finishes the
    /// drains they may have ended. Returns whether each lease was live.
    pub fn release(&mut self, releases: &[Release<'_>], now_ms: u64) -> (Vec<bool>, Effects) {
        let mut effects = Effects::new();
        let released = releases
            .iter()
            .map(|r| {
                // A backend whose 5xx the lease left is charged (or not) now: it changes too.
                let deferred = self.pool.deferred_failure(r.lease_id);
                let released = self.pool.release(r.lease_id, r.outcome, now_ms);
                // The backend holds the response it stored: a follow-up must find it there.
                if let (Some(response), Some(backend)) = (&r.outcome.stored_response, r.backend) {
                    if let Some(recorded) = self.pool.record_response(response, backend, now_ms) {
                        effects.push(Effect::PersistResponse {
                            response: (**response).clone(),
                            backend: backend.clone(),
                            at_ms: now_ms,
                            forget_before_ms: recorded.forget_before_ms,
                        });
                    }
                }
                if released {
                    self.persist_backends(&[r.backend, deferred.as_ref()], &mut effects);
                }
                released
            })
            .collect();
        self.finish_drains(now_ms, &mut effects);
        if self.pool.late_first_tokens() {
            // A first token reported past its due time: that backend's model was wrong.
            effects.extend(self.check_evidence(now_ms));
        }
        if let Some(card) = self.card_if_idle_now(now_ms) {
            effects.push(Effect::PublishCard(card));
        }
        (released, effects)
    }
}
