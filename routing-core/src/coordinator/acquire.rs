//! Acquiring a lease: spillover when the pool is saturated, a grant at once when the pool does not
//! queue, else the waiting room; the first attempt a grant counts in the retry budget and the
//! card it carries; and the waiting room's settle, pause and dequeue.

use super::{Callers, Coordinator, Effects, Step, WaitEnd};
use crate::admission::{AdmissionRequest, Ticket};
use crate::pool::Grant;
use crate::region::ChoiceNote;
use crate::request::prompt::RequestFeatures;

impl Coordinator {
    /// An acquire: `admission` carries the tenant, priority and the ticket of a wait in progress
    /// (without it the pool never queues the request), `choice` why the Worker asked this pool,
    /// `spill_ok` whether a further pool can take the request.
    pub fn acquire(
        &mut self,
        features: RequestFeatures,
        admission: Option<AdmissionRequest>,
        choice: Option<&ChoiceNote>,
        spill_ok: bool,
        now_ms: u64,
        callers: &dyn Callers,
    ) -> (Step, Effects) {
        // Counted on a request's first call only (a queued request asks again with its ticket,
        // and the Worker aborted its fetch when it was first queued: nothing left to price).
        let first_call = admission.as_ref().is_none_or(|a| a.ticket.is_none());
        let mut features = features;
        if !first_call {
            features.sent_ahead = None;
        }
        let ahead = features
            .sent_ahead
            .as_ref()
            .filter(|_| first_call)
            .map(|a| a.backend.clone());
        let (step, effects) =
            self.acquire_step(features, admission, choice, spill_ok, now_ms, callers);
        if let Some(sent_to) = ahead {
            let counts = &mut self.sent_ahead;
            match &step {
                // A disaggregated pair is never kept (the Worker aborts what it sent).
                Step::Done(WaitEnd::Granted { grant, .. })
                    if grant.backend.0 == sent_to && grant.decode_candidates.is_empty() =>
                {
                    counts.kept += 1
                }
                Step::Done(WaitEnd::Granted { .. }) => counts.missed += 1,
                _ => counts.not_granted += 1,
            }
        }
        (step, effects)
    }

    fn acquire_step(
        &mut self,
        features: RequestFeatures,
        admission: Option<AdmissionRequest>,
        choice: Option<&ChoiceNote>,
        spill_ok: bool,
        now_ms: u64,
        callers: &dyn Callers,
    ) -> (Step, Effects) {
        let mut effects = Effects::new();
        let first_call = admission.as_ref().is_none_or(|a| a.ticket.is_none());
        if let (Some(note), true) = (choice, first_call) {
            self.routed.count(note);
        }
        let config = self.pool.config().admission;
        let queueing = config.enabled || self.room.knows(admission.as_ref().and_then(|a| a.ticket));
        let continuing = admission.as_ref().is_some_and(|a| a.ticket.is_some());
        if self.load.spills(spill_ok, continuing) {
            self.spills += 1;
            return (Step::Saturated, effects);
        }
        if !queueing {
            let step = match self.pool.acquire(&features, now_ms, &mut self.rng) {
                Ok(grant) => {
                    // Known by the Worker's wait id, for a dequeue if it never reads this.
                    if let Some(id) = admission.as_ref().and_then(|a| a.wait_id) {
                        self.room.record_delivered(id, grant.lease_id, now_ms);
                    }
                    Step::Done(WaitEnd::Granted {
                        grant,
                        waited_ms: 0,
                    })
                }
                Err(e) => Step::Refused(e),
            };
            return (step, effects);
        }
        let who = admission.unwrap_or_default();
        let step = self.room.enter(
            &mut self.pool,
            &config,
            features,
            &who,
            spill_ok,
            now_ms,
            &mut self.rng,
            callers,
            &mut effects,
        );
        if step == Step::Spill {
            self.spills += 1;
        }
        (step, effects)
    }

    /// A grant about to be answered: its first attempt counts in the retry budget, and it
    /// carries the pool's time card.
    pub fn hand_out(&mut self, grant: &mut Grant, now_ms: u64) {
        self.budget
            .record_request(now_ms, &self.retry_budget_config);
        grant.card = Some(Box::new(self.grant_card(now_ms)));
    }

    /// Lets queued requests in if backends have room (and drops those whose client left).
    pub fn settle(&mut self, now_ms: u64, callers: &dyn Callers) -> Effects {
        let mut effects = Effects::new();
        if self.pool.end_admission_hold(now_ms) {
            // A restart's hold is over: the queue is admitted against the renewed counts.
            self.room.wake();
        }
        let config = self.pool.config().admission;
        self.room.settle(
            &mut self.pool,
            &config,
            now_ms,
            &mut self.rng,
            callers,
            &mut effects,
        );
        effects
    }

    /// The end of call `call_id`'s wait on `ticket` without a verdict (see
    /// [`super::WaitingRoom::pause`]).
    pub fn pause(&mut self, ticket: Ticket, call_id: u64, now_ms: u64) -> Option<WaitEnd> {
        self.room.pause(ticket, call_id, now_ms)
    }

    /// A queued request's client left. Returns whether the ticket was known.
    pub fn dequeue(&mut self, ticket: Ticket, now_ms: u64) -> (bool, Effects) {
        let mut effects = Effects::new();
        let left = self
            .room
            .dequeue(&mut self.pool, ticket, now_ms, &mut effects);
        (left, effects)
    }

    /// A verdict handed out in an [`super::Effect::Answer`] that no open call took: its lease
    /// goes back. Returns false when a lease went back (settle again: room freed).
    pub fn unanswered(&mut self, ticket: Ticket, verdict: WaitEnd, now_ms: u64) -> bool {
        self.room
            .unanswered(&mut self.pool, ticket, verdict, now_ms)
    }
}
