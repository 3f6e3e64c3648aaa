//! Acquiring a lease: at once, or after a wait in the pool's admission queue, and the
//! error a request gets when it leaves the queue without one.

use super::{now_ms, ApiResult, PoolCoordinator};
use crate::call::answer;
use coordinator_protocol::acquire::AcquireRequest;
use coordinator_protocol::messages::{
    DequeueAnswer, DequeueRequest, Queued, QUEUE_DROP_HEADER, QUEUE_WAIT_HEADER,
};
use coordinator_protocol::ApiError;
use futures_util::future::{select, Either};
use routing_core::admission::DropReason;
use routing_core::coordinator::{Coordinator, Step, Verdict};
use routing_core::pool::AcquireError;
use std::time::Duration;
use worker::Delay;

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
        let (ticket, call_id, rx, until_ms) = match step {
            Step::Done(verdict) => return self.answer(verdict),
            Step::Saturated => {
                return Err(
                    ApiError::unavailable("This pool is saturated; try the next pool.", 1)
                        .with_code("pool_saturated"),
                );
            }
            Step::Spill => {
                return Err(ApiError::unavailable(
                    "Every backend of this pool is at capacity; try the next pool.",
                    1,
                )
                .with_code("pool_at_capacity"));
            }
            Step::Refused(AcquireError::ModelNotFound { model }) => {
                return Err(ApiError::model_not_found(&model))
            }
            Step::Refused(AcquireError::NoBackendAvailable { retry_after_s }) => {
                return Err(ApiError::unavailable(
                    "No backend in this pool can take the request now.",
                    retry_after_s.clamp(1, 3600) as u32,
                ))
            }
            Step::Refused(AcquireError::AtCapacity) => {
                return Err(
                    ApiError::unavailable("Every backend of this pool is at capacity.", 1)
                        .with_code("pool_at_capacity"),
                )
            }
            Step::Wait {
                ticket,
                call_id,
                until_ms,
            } => {
                let rx = self.with(|shard| shard.calls.open(ticket, call_id, Some(signal)));
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
                answer(
                    202,
                    &Queued {
                        ticket,
                        queue_length,
                    },
                )
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
                self.with(|shard| shard.coordinator.hand_out(&mut grant, now_ms()));
                let mut resp = answer(200, &grant)?;
                // Absent means no wait (the Worker reads it so); a header costs a call into JS.
                if waited_ms > 0 {
                    resp.headers_mut()
                        .set(QUEUE_WAIT_HEADER, &waited_ms.to_string())?;
                }
                Ok(resp)
            }
            Verdict::Dropped { reason, waited_ms } => {
                Err(self.with(|shard| drop_error(&shard.coordinator, reason, waited_ms)))
            }
        }
    }

    /// `POST /dequeue`: a queued request's client left.
    pub(super) fn dequeue(&self, req: DequeueRequest) -> ApiResult {
        self.with(|shard| {
            let now = now_ms();
            let (left, effects) = shard.coordinator.dequeue(req.ticket, now);
            let _ = shard.perform(effects, now);
            answer(200, &DequeueAnswer { dequeued: left })
        })
    }
}

/// The error a client gets for a request that left the queue without a lease.
pub(super) fn drop_error(
    coordinator: &Coordinator,
    reason: DropReason,
    waited_ms: u64,
) -> ApiError {
    let seconds = |ms: u64| ms.div_ceil(1000).clamp(1, 60) as u32;
    match reason {
        DropReason::QueueFull | DropReason::TenantLimit | DropReason::Evicted => {
            let oldest = coordinator
                .room()
                .queue
                .oldest_arrival_ms()
                .map_or(0, |a| now_ms().saturating_sub(a));
            ApiError::queue_full(reason.as_str(), seconds(oldest))
        }
        DropReason::Timeout => ApiError::queue_timeout(seconds(waited_ms)),
        DropReason::ClientGone => {
            let mut e = ApiError::bad_request("The client closed the request.")
                .with_code("client_closed_request");
            e.status = 499;
            e.with_header(QUEUE_DROP_HEADER, reason.as_str())
        }
        DropReason::ModelGone => {
            ApiError::model_not_found("").with_header(QUEUE_DROP_HEADER, reason.as_str())
        }
    }
}
