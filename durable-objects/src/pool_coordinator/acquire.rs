//! Acquiring a lease: at once, or after a wait in the pool's admission queue, and the
//! refusal a request gets when it leaves the queue without one.

use super::{now_ms, ApiResult, PoolCoordinator};
use crate::call::reply;
use coordinator_protocol::acquire::{Acquire, AcquireAnswer, AcquireRequest, Granted};
use coordinator_protocol::messages::{DequeueAnswer, DequeueRequest, Queued};
use coordinator_protocol::refusal::dropped;
use futures_util::future::{select, Either};
use routing_core::admission::DropReason;
use routing_core::coordinator::{Coordinator, Step, WaitEnd};
use routing_core::pool::Refusal;
use std::time::Duration;
use worker::Delay;

impl PoolCoordinator {
    pub(super) async fn acquire(
        &self,
        req: AcquireRequest,
        spill_ok: bool,
        signal: Option<web_sys::AbortSignal>,
    ) -> ApiResult {
        let AcquireRequest {
            mut features,
            admission,
            choice,
            ahead,
        } = req;
        // A first call whose fetch went ahead hears at once that it must wait, so the Worker
        // aborts that fetch now rather than when its wait ends (a later call waits as usual).
        let answer_now = ahead.is_some() && admission.as_ref().is_none_or(|a| a.ticket.is_none());
        features.sent_ahead = ahead;
        let step = self.with(|shard| {
            let now = now_ms();
            let (step, effects) = shard.coordinator.acquire(
                features,
                admission,
                choice.as_ref(),
                spill_ok,
                now,
                &shard.calls,
            );
            // An evicted request's call hears of it.
            let _ = shard.perform(effects, now);
            step
        });
        let refused = |r: Refusal| reply::<Acquire>(&AcquireAnswer::Refused(r));
        let (ticket, call_id, rx, until_ms) = match step {
            Step::Done(verdict) => return self.answer(verdict),
            Step::Saturated => return refused(Refusal::Saturated),
            Step::Spill => return refused(Refusal::Full),
            Step::Refused(e) => return refused(Refusal::from(e)),
            Step::Wait {
                ticket,
                call_id,
                until_ms,
            } => {
                let rx = self.with(|shard| shard.calls.open(ticket, call_id, signal));
                let until_ms = if answer_now { now_ms() } else { until_ms };
                (ticket, call_id, rx, until_ms)
            }
        };
        let timer = Delay::from(Duration::from_millis(
            until_ms.saturating_sub(now_ms()).max(1),
        ));
        let verdict = match select(rx, timer).await {
            Either::Left((Ok(verdict), _)) => Some(verdict),
            // A newer call with the same ticket took over.
            Either::Left((Err(_), _)) => None,
            Either::Right((_, mut rx)) => self.with(|shard| {
                let now = now_ms();
                shard.settle_queue(now);
                // A verdict that arrived meanwhile, else one parked for this call.
                if let Ok(Some(verdict)) = rx.try_recv() {
                    return Some(verdict);
                }
                let verdict = shard.coordinator.pause(ticket, call_id, now);
                shard.calls.close(ticket, call_id);
                verdict
            }),
        };
        match verdict {
            Some(verdict) => self.answer(verdict),
            None => {
                let queue_length = self.with(|shard| shard.coordinator.room().queue.len());
                reply::<Acquire>(&AcquireAnswer::Queued(Queued {
                    ticket,
                    queue_length,
                }))
            }
        }
    }

    /// The answer to an acquire whose wait ended.
    pub(super) fn answer(&self, verdict: WaitEnd) -> ApiResult {
        match verdict {
            WaitEnd::Granted {
                mut grant,
                waited_ms,
            } => {
                self.with(|shard| shard.coordinator.hand_out(&mut grant, now_ms()));
                reply::<Acquire>(&AcquireAnswer::Granted(Granted {
                    grant,
                    queued_ms: waited_ms,
                }))
            }
            WaitEnd::Dropped { reason, waited_ms } => {
                let refusal =
                    self.with(|shard| drop_refusal(&shard.coordinator, reason, waited_ms));
                reply::<Acquire>(&AcquireAnswer::Refused(refusal))
            }
        }
    }

    /// `POST /dequeue`: a queued request's client left.
    pub(super) fn dequeue(&self, req: DequeueRequest) -> ApiResult {
        self.with(|shard| {
            let now = now_ms();
            let (left, effects) = shard.coordinator.dequeue(req.ticket, now);
            let _ = shard.perform(effects, now);
            reply::<DequeueRequest>(&DequeueAnswer { dequeued: left })
        })
    }
}

/// The refusal of a request that left the queue without a lease (with when its client may come
/// back: the oldest waiter's age for a full queue, its own wait for a timeout).
fn drop_refusal(coordinator: &Coordinator, reason: DropReason, waited_ms: u64) -> Refusal {
    let seconds = |ms: u64| ms.div_ceil(1000).clamp(1, 60) as u32;
    let retry_after_ms = match reason {
        DropReason::QueueFull | DropReason::TenantLimit | DropReason::Evicted => coordinator
            .room()
            .queue
            .oldest_arrival_ms()
            .map_or(0, |a| now_ms().saturating_sub(a)),
        _ => waited_ms,
    };
    dropped(reason, seconds(retry_after_ms))
}
