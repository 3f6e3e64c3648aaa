//! Acquiring a lease: at once, or after a wait in the pool's admission queue, and the
//! error a request gets when it leaves the queue without one.

use super::*;

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
                return Err(
                    ApiError::unavailable("This pool is saturated; try the next pool.", 1)
                        .with_code("pool_saturated"),
                );
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
        })?;
        let (ticket, call_id, rx, until_ms) = match step {
            Step::Done(verdict) => return self.answer(verdict),
            Step::Spill => {
                self.with(|l| l.spills += 1);
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
                rx,
                until_ms,
            } => (ticket, call_id, rx, until_ms),
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
                self.with(|l| {
                    let now = now_ms();
                    l.budget.record_request(now, &l.settings.retry_budget);
                    grant.card = Some(Box::new(card::grant_card(l, now)));
                });
                let mut resp = answer(200, &grant)?;
                // Absent means no wait (the Worker reads it so); a header costs a call into JS.
                if waited_ms > 0 {
                    resp.headers_mut()
                        .set(QUEUE_WAIT_HEADER, &waited_ms.to_string())?;
                }
                Ok(resp)
            }
            Verdict::Dropped { reason, waited_ms } => {
                Err(self.with(|l| drop_error(l, reason, waited_ms)))
            }
        }
    }

    /// `POST /dequeue`: a queued request's client left.
    pub(super) fn dequeue(&self, req: DequeueRequest) -> ApiResult {
        self.with(|l| {
            let Live { pool, room, .. } = l;
            let left = room.dequeue(pool, req.ticket, now_ms());
            answer(200, &DequeueAnswer { dequeued: left })
        })
    }

    /// Lets queued requests in if backends have room (and drops those whose client left).
    pub(super) fn settle_queue(&self) {
        self.with(|l| l.settle_queue(now_ms()));
    }
}

/// The error a client gets for a request that left the queue without a lease.
pub(super) fn drop_error(l: &Live, reason: DropReason, waited_ms: u64) -> ApiError {
    let seconds = |ms: u64| ms.div_ceil(1000).clamp(1, 60) as u32;
    match reason {
        DropReason::QueueFull | DropReason::TenantLimit | DropReason::Evicted => {
            let oldest = l
                .room
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
