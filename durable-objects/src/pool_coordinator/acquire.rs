//! Acquiring a lease: at once, or after a wait in the pool's admission queue, and the
//! refusal a request gets when it leaves the queue without one.

use super::*;
use crate::call::reply;
use coordinator_protocol::acquire::{Acquire, AcquireAnswer, Granted};
use coordinator_protocol::refusal::dropped;
use routing_core::pool::Refusal;

impl PoolCoordinator {
    pub(super) async fn acquire(
        &self,
        req: AcquireRequest,
        spill_ok: bool,
        signal: web_sys::AbortSignal,
    ) -> ApiResult {
        let AcquireRequest {
            features,
            admission,
            choice,
        } = req;
        let step = self.with(|l| {
            let now = now_ms();
            let first_call = admission.as_ref().is_none_or(|a| a.ticket.is_none());
            if let (Some(note), true) = (&choice, first_call) {
                l.routed.count(note);
            }
            let admission_config = l.settings.routing.admission;
            let queueing =
                admission_config.enabled || l.room.knows(admission.as_ref().and_then(|a| a.ticket));
            let continuing = admission.as_ref().is_some_and(|a| a.ticket.is_some());
            if l.load.spills(spill_ok, continuing) {
                l.spills += 1;
                return Err(Refusal::Saturated);
            }
            let Live {
                pool, rng, room, ..
            } = l;
            if !queueing {
                return Ok(match pool.acquire(&features, now, rng) {
                    Ok(grant) => {
                        // Known by the Worker's wait id, for a dequeue if it never reads this.
                        if let Some(id) = admission.as_ref().and_then(|a| a.wait_id) {
                            room.record_delivered(id, grant.lease_id, now);
                        }
                        Step::Done(Verdict::Granted {
                            grant,
                            waited_ms: 0,
                        })
                    }
                    Err(e) => Step::Refused(e),
                });
            }
            let who = admission.unwrap_or_default();
            Ok(room.enter(
                pool,
                &admission_config,
                features,
                &who,
                spill_ok,
                Some(signal),
                now,
                rng,
            ))
        });
        let refused = |r: Refusal| reply::<Acquire>(&AcquireAnswer::Refused(r));
        let (ticket, call_id, rx, until_ms) = match step {
            Err(r) => return refused(r),
            Ok(Step::Done(verdict)) => return self.answer(verdict),
            Ok(Step::Spill) => {
                self.with(|l| l.spills += 1);
                return refused(Refusal::Full);
            }
            Ok(Step::Refused(e)) => return refused(Refusal::from(e)),
            Ok(Step::Wait {
                ticket,
                call_id,
                rx,
                until_ms,
            }) => (ticket, call_id, rx, until_ms),
        };
        let timer = Delay::from(Duration::from_millis(
            until_ms.saturating_sub(now_ms()).max(1),
        ));
        let verdict = match select(rx, timer).await {
            Either::Left((Ok(verdict), _)) => Some(verdict),
            // A newer call with the same ticket took over.
            Either::Left((Err(_), _)) => None,
            Either::Right((_, mut rx)) => self.with(|l| {
                let now = now_ms();
                l.settle_queue(now);
                l.room.pause(ticket, call_id, &mut rx, now)
            }),
        };
        match verdict {
            Some(verdict) => self.answer(verdict),
            None => {
                let queue_length = self.with(|l| l.room.queue.len());
                reply::<Acquire>(&AcquireAnswer::Queued(Queued {
                    ticket,
                    queue_length,
                }))
            }
        }
    }

    /// The answer to an acquire whose wait ended.
    pub(super) fn answer(&self, verdict: Verdict) -> ApiResult {
        match verdict {
            Verdict::Granted {
                mut grant,
                waited_ms,
            } => {
                self.with(|l| {
                    let now = now_ms();
                    l.budget.record_request(now, &l.settings.retry_budget);
                    grant.card = Some(Box::new(card::grant_card(l, now)));
                });
                reply::<Acquire>(&AcquireAnswer::Granted(Granted {
                    grant,
                    queued_ms: waited_ms,
                }))
            }
            Verdict::Dropped { reason, waited_ms } => {
                let refusal = self.with(|l| drop_refusal(l, reason, waited_ms));
                reply::<Acquire>(&AcquireAnswer::Refused(refusal))
            }
        }
    }

    /// `POST /dequeue`: a queued request's client left.
    pub(super) fn dequeue(&self, req: DequeueRequest) -> ApiResult {
        self.with(|l| {
            let Live { pool, room, .. } = l;
            let left = room.dequeue(pool, req.ticket, now_ms());
            reply::<DequeueRequest>(&DequeueAnswer { dequeued: left })
        })
    }

    /// Lets queued requests in if backends have room (and drops those whose client left).
    pub(super) fn settle_queue(&self) {
        self.with(|l| l.settle_queue(now_ms()));
    }
}

/// The refusal of a request that left the queue without a lease (with when its client may come
/// back: the oldest waiter's age for a full queue, its own wait for a timeout).
fn drop_refusal(l: &Live, reason: DropReason, waited_ms: u64) -> Refusal {
    let seconds = |ms: u64| ms.div_ceil(1000).clamp(1, 60) as u32;
    let retry_after_ms = match reason {
        DropReason::QueueFull | DropReason::TenantLimit | DropReason::Evicted => l
            .room
            .queue
            .oldest_arrival_ms()
            .map_or(0, |a| now_ms().saturating_sub(a)),
        _ => waited_ms,
    };
    dropped(reason, seconds(retry_after_ms))
}

impl Live {
    /// Lets queued requests in if backends have room (and drops those whose client left).
    fn settle_queue(&mut self, now: u64) {
        let Live {
            pool,
            rng,
            room,
            settings,
            ..
        } = self;
        room.settle(pool, &settings.routing.admission, now, rng);
    }
}
